//! Our process-wide locks across `fork` (a leaf). A child has only the thread that forked: a
//! lock another thread held at that instant stays held there for ever, and the child's first
//! hooked call that needs it (closing an inherited connection, a connect) never returns. So the
//! thread that forks takes them first (`pthread_atfork`'s prepare, in the lock order) and both
//! processes release them after (libc's own locks are handled the same way).
//!
//! Those locks are `std::sync` ones: releasing one that other threads waited for is a futex
//! wake-up, which a child can do; parking_lot's goes through its global table of parked
//! threads, whose bucket locks the child may have inherited held. Each is taken through
//! [`Held`], which counts what this thread holds: a fork from a thread that holds one (a signal
//! handler run inside a hook) cannot wait for the others, and leaves them all alone.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

thread_local! {
    /// How many of our process-wide locks this thread holds now.
    static HOLDING: Cell<u32> = const { Cell::new(0) };
}

/// Counts one lock this thread holds while it lives.
pub(crate) struct Holding(());

impl Holding {
    pub(crate) fn new() -> Self {
        let _ = HOLDING.try_with(|h| h.set(h.get() + 1));
        Self(())
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = HOLDING.try_with(|h| h.set(h.get() - 1));
    }
}

/// A guard of one of our process-wide locks, counted (see [`Holding`]). The lock is released
/// before the count goes down (fields drop in order).
pub(crate) struct Held<G> {
    guard: G,
    _holding: Holding,
}

impl<G: Deref> Deref for Held<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Held<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

/// Locks `m` (a panic under it left it usable: our state is changed in one go).
pub(crate) fn lock<T>(m: &Mutex<T>) -> Held<MutexGuard<'_, T>> {
    let _holding = Holding::new();
    let guard = m.lock().unwrap_or_else(PoisonError::into_inner);
    Held { guard, _holding }
}

/// Takes `l` for reading.
pub(crate) fn read<T>(l: &RwLock<T>) -> Held<RwLockReadGuard<'_, T>> {
    let _holding = Holding::new();
    let guard = l.read().unwrap_or_else(PoisonError::into_inner);
    Held { guard, _holding }
}

/// Takes `l` for writing.
pub(crate) fn write<T>(l: &RwLock<T>) -> Held<RwLockWriteGuard<'_, T>> {
    let _holding = Holding::new();
    let guard = l.write().unwrap_or_else(PoisonError::into_inner);
    Held { guard, _holding }
}

/// Whether the thread about to fork may wait for our locks: not if it holds one itself (it
/// would wait for ever, or against the lock order).
fn may_wait() -> bool {
    HOLDING.try_with(Cell::get).is_ok_and(|n| n == 0)
}

/// Takes `m` for the fork, kept with smcr's and the engine's until
/// `smcr::release_after_fork` (one list, released the last taken first).
pub(crate) fn hold_mutex<T: 'static>(m: &'static Mutex<T>) {
    if may_wait() {
        smcr::forkhold::keep(m.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Takes `l` for writing for the fork (as [`hold_mutex`]).
pub(crate) fn hold_rwlock<T: 'static>(l: &'static RwLock<T>) {
    if may_wait() {
        smcr::forkhold::keep(l.write().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Tests only (debug builds): `SMCR_DEBUG_LOCK_HOLD_US` keeps a process-wide lock this much
/// longer (the table's writers call it while they hold it), so that a fork from another thread
/// finds it held, as on a loaded machine by chance.
pub(crate) fn debug_stretch() {
    #[cfg(debug_assertions)]
    {
        static HOLD: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
        let us = std::time::Duration::from_micros;
        crate::debug::sleep_from_env(&HOLD, "SMCR_DEBUG_LOCK_HOLD_US", us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static A: Mutex<u32> = Mutex::new(0);
    static B: RwLock<u32> = RwLock::new(0);

    fn held() -> usize {
        smcr::forkhold::kept()
    }

    fn release() {
        smcr::release_after_fork();
    }

    #[test]
    fn the_forking_thread_holds_the_locks_until_release() {
        hold_rwlock(&B);
        hold_mutex(&A);
        assert_eq!(held(), 2);
        // Another thread cannot have them meanwhile.
        std::thread::spawn(|| {
            assert!(A.try_lock().is_err());
            assert!(B.try_read().is_err());
        })
        .join()
        .unwrap();
        release();
        assert_eq!(held(), 0);
        assert!(A.try_lock().is_ok() && B.try_write().is_ok());
    }

    #[test]
    fn a_thread_that_holds_one_of_ours_does_not_wait_for_the_others() {
        static C: Mutex<u32> = Mutex::new(0);
        static D: Mutex<u32> = Mutex::new(0);
        let g = lock(&C);
        // D is free, but the lock order cannot be kept from here (C is held): nothing taken.
        hold_mutex(&D);
        assert_eq!(held(), 0);
        drop(g);
        hold_mutex(&D);
        assert_eq!(held(), 1);
        release();
        assert!(D.try_lock().is_ok());
    }
}
