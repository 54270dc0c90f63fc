//! Fork tracking: how many times this process forked and which children it made since, so
//! that an accepted connection can tell whether another process may hold it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::forkhold::{self, Held};

static FORKS: AtomicU64 = AtomicU64::new(0);
/// Children this process forked through `fork` (pid, fork count after it), most recent last.
/// A `std` lock: held across `fork` (`forkhold`).
static CHILDREN: Mutex<Vec<(u32, u64)>> = Mutex::new(Vec::new());

fn children() -> Held<MutexGuard<'static, Vec<(u32, u64)>>> {
    forkhold::lock(&CHILDREN)
}

/// Before a fork: the forking thread takes the list (see `forkhold`).
pub(crate) fn hold_for_fork() {
    forkhold::hold_mutex(&CHILDREN);
}

/// Forks made by this process so far.
pub(super) fn forks() -> u64 {
    FORKS.load(Ordering::Acquire)
}

/// The application forked: `child` in the parent.
pub(crate) fn forked(child: u32) {
    let n = FORKS.fetch_add(1, Ordering::AcqRel) + 1;
    let mut c = children();
    // Only recent children matter (those forked while a connection waits for its first use).
    if c.len() >= 256 {
        c.drain(..128);
    }
    c.push((child, n));
}

/// In a forked child: its own fork history starts empty.
pub(crate) fn forked_child() {
    FORKS.store(0, Ordering::Release);
    // The parent's list is not ours. The lock was released after the fork (`forkhold`),
    // unless the fork could not take it: then leave it.
    if let Ok(mut c) = CHILDREN.try_lock() {
        c.clear();
    }
}

/// Children forked after the `since`th fork.
pub(super) fn children_since(since: u64) -> Vec<u32> {
    children()
        .iter()
        .filter(|&&(_, n)| n > since)
        .map(|&(p, _)| p)
        .collect()
}
