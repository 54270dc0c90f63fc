//! The locks of the engine and the runtime: parking_lot's, behind a newtype that can count
//! acquisitions per thread (feature `lock-count`), so a test measures how many locks one
//! `write()` and one `read()` take (docs/architecture.md, "One write, one read"). Without the
//! feature `lock` is parking_lot's `lock`, inlined; the guard is parking_lot's, so
//! `parking_lot::Condvar` and `MutexGuard::unlocked` work as before (their re-locks are not
//! counted: they follow a wait, not a call's own path).

pub use parking_lot::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

#[cfg(feature = "lock-count")]
mod count {
    use std::cell::{Cell, RefCell};
    use std::panic::Location;
    use std::sync::atomic::{AtomicU64, Ordering};

    thread_local! {
        static TAKEN: Cell<u64> = const { Cell::new(0) };
        pub(super) static SITES: RefCell<Option<Vec<&'static Location<'static>>>> =
            const { RefCell::new(None) };
    }
    static ALL: AtomicU64 = AtomicU64::new(0);

    #[inline]
    #[track_caller]
    pub(super) fn note() {
        // `try_with`: locks are taken in exit handlers too, after thread-locals went.
        let _ = TAKEN.try_with(|c| c.set(c.get() + 1));
        ALL.fetch_add(1, Ordering::Relaxed);
        let at = Location::caller();
        let _ = SITES.try_with(|s| {
            if let Some(v) = s.borrow_mut().as_mut() {
                v.push(at);
            }
        });
    }

    pub(super) fn taken() -> u64 {
        TAKEN.try_with(Cell::get).unwrap_or(0)
    }

    pub(super) fn taken_by_all() -> u64 {
        ALL.load(Ordering::Relaxed)
    }
}

/// Counts one lock taken by this thread (for locks taken around [`Mutex`], e.g. a raw lock
/// held across a batch). A no-op without the feature `lock-count`.
#[inline(always)]
#[cfg_attr(feature = "lock-count", track_caller)]
pub fn note() {
    #[cfg(feature = "lock-count")]
    count::note();
}

/// How many locks this thread has taken so far (feature `lock-count`).
#[cfg(feature = "lock-count")]
pub fn taken() -> u64 {
    count::taken()
}

/// Runs `f` and returns, with its result, where each lock it took on this thread was taken
/// (file and line of the `lock` call; feature `lock-count`).
#[cfg(feature = "lock-count")]
pub fn sites<R>(f: impl FnOnce() -> R) -> (R, Vec<&'static std::panic::Location<'static>>) {
    count::SITES.with(|s| *s.borrow_mut() = Some(Vec::new()));
    let r = f();
    let v = count::SITES
        .with(|s| s.borrow_mut().take())
        .unwrap_or_default();
    (r, v)
}

/// How many locks every thread of the process has taken so far (feature `lock-count`).
#[cfg(feature = "lock-count")]
pub fn taken_by_all() -> u64 {
    count::taken_by_all()
}

/// A mutual-exclusion lock (parking_lot's), counted under the feature `lock-count`.
#[derive(Default)]
pub struct Mutex<T: ?Sized>(parking_lot::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `v`.
    pub const fn new(v: T) -> Self {
        Self(parking_lot::Mutex::new(v))
    }

    /// The value, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.0.into_inner()
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Locks, waiting for the lock.
    #[inline]
    #[cfg_attr(feature = "lock-count", track_caller)]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        note();
        self.0.lock()
    }

    /// Locks if it is free now.
    #[inline]
    #[cfg_attr(feature = "lock-count", track_caller)]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let g = self.0.try_lock();
        if g.is_some() {
            note();
        }
        g
    }

    /// The value, through exclusive access (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }

    /// Whether it is locked now.
    pub fn is_locked(&self) -> bool {
        self.0.is_locked()
    }

    /// The raw lock, for a guard kept across calls (the receive path holds a queue pair's
    /// lock across its packets of a batch; it counts that with [`note`]).
    ///
    /// # Safety
    /// As `lock_api::Mutex::raw`: the caller must not unlock a lock it does not hold.
    pub unsafe fn raw(&self) -> &parking_lot::RawMutex {
        // SAFETY: forwarded contract.
        unsafe { self.0.raw() }
    }

    /// A pointer to the value (valid while the mutex lives; access needs the lock).
    pub fn data_ptr(&self) -> *mut T {
        self.0.data_ptr()
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A reader-writer lock (parking_lot's), counted under the feature `lock-count`.
#[derive(Default)]
pub struct RwLock<T: ?Sized>(parking_lot::RwLock<T>);

impl<T> RwLock<T> {
    /// A new unlocked lock holding `v`.
    pub const fn new(v: T) -> Self {
        Self(parking_lot::RwLock::new(v))
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Locks shared.
    #[inline]
    #[cfg_attr(feature = "lock-count", track_caller)]
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        note();
        self.0.read()
    }

    /// Locks exclusive.
    #[inline]
    #[cfg_attr(feature = "lock-count", track_caller)]
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        note();
        self.0.write()
    }

    /// The value, through exclusive access (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(all(test, feature = "lock-count"))]
mod tests {
    use super::*;

    #[test]
    fn each_acquisition_is_counted_on_its_thread() {
        let m = Mutex::new(1);
        let r = RwLock::new(2);
        let before = taken();
        drop(m.lock());
        drop(m.try_lock());
        let g = m.lock();
        assert!(m.try_lock().is_none(), "held");
        drop(g);
        drop(r.read());
        drop(r.write());
        note();
        assert_eq!(taken() - before, 6);
        assert!(taken_by_all() >= 6);
        let other = std::thread::spawn(taken).join().unwrap();
        assert_eq!(other, 0, "another thread's count is its own");
        let ((), at) = sites(|| drop(m.lock()));
        assert_eq!(at.len(), 1);
        assert_eq!(at[0].file(), file!());
    }
}
