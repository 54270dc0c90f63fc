//! Process-wide locks across `fork`. A child has only the thread that forked: a lock another
//! thread held at that instant stays held there for ever. A program that forks calls
//! `rdma::hold_for_fork` before (`pthread_atfork`'s prepare: the preload library does) and
//! [`release`] after, in both processes; the forking thread then holds every such lock across
//! the fork, and no child inherits one held by a thread it does not have.
//!
//! Those locks are `std::sync` ones: releasing one that others waited for is a futex wake-up,
//! which a child can do; parking_lot's goes through its global table of parked threads, whose
//! bucket locks the child may have inherited held.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

thread_local! {
    /// The guards the forking thread holds between prepare and parent/child.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// How long [`hold_mutex`] tries. Its locks are held for microseconds and rarely contended;
/// a thread that forks while it holds one itself (a signal handler) would wait for ever, so
/// after this the lock is left alone (the child may then find it held, as without this).
const WAIT: Duration = Duration::from_millis(100);

/// Keeps `guard` until [`release`] (the lock it holds stays taken across the fork).
pub fn keep<G: 'static>(guard: G) {
    let _ = HELD.try_with(|h| h.borrow_mut().push(Box::new(guard)));
}

/// Takes `m` for the fork, trying for at most 100 ms.
pub fn hold_mutex<T: 'static>(m: &'static Mutex<T>) {
    let start = Instant::now();
    loop {
        match m.try_lock() {
            Ok(g) => return keep(g),
            Err(TryLockError::Poisoned(p)) => return keep(p.into_inner()),
            Err(TryLockError::WouldBlock) if start.elapsed() < WAIT => std::thread::yield_now(),
            Err(TryLockError::WouldBlock) => return,
        }
    }
}

/// How many guards this thread keeps now (tests).
pub fn kept() -> usize {
    HELD.try_with(|h| h.borrow().len()).unwrap_or(0)
}

/// After the fork (in both processes): releases what was kept, the last taken first.
pub fn release() {
    let _ = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        while let Some(g) = h.pop() {
            drop(g);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_another_thread_keeps_is_left_alone_after_the_wait() {
        static M: Mutex<()> = Mutex::new(());
        let (took, taken) = std::sync::mpsc::channel();
        let (done, finish) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let _g = M.lock().unwrap();
            took.send(()).unwrap();
            let _ = finish.recv();
        });
        taken.recv().unwrap();
        let start = Instant::now();
        hold_mutex(&M);
        assert!(start.elapsed() >= WAIT);
        assert_eq!(HELD.with(|h| h.borrow().len()), 0);
        done.send(()).unwrap();
        t.join().unwrap();
        // Free: taken at once, kept until release.
        hold_mutex(&M);
        assert_eq!(HELD.with(|h| h.borrow().len()), 1);
        assert!(std::thread::spawn(|| M.try_lock().is_err()).join().unwrap());
        release();
        assert!(M.try_lock().is_ok());
    }
}
