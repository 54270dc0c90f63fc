//! Which file descriptors are ours. The question is asked on every hooked call, so the answer
//! for a descriptor that is not ours is one atomic load (a bit per fd), with no lock and no
//! allocation (hooks may run in signal handlers).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::shim::Sock;

/// Descriptors we track (higher ones are left to libc: the application's sockets live low).
pub(crate) const MAX_FDS: usize = 1 << 16;

static BITS: [AtomicU64; MAX_FDS / 64] = [const { AtomicU64::new(0) }; MAX_FDS / 64];
static MAP: RwLock<BTreeMap<i32, Arc<Sock>>> = RwLock::new(BTreeMap::new());

fn slot(fd: i32) -> Option<(usize, u64)> {
    let i = usize::try_from(fd).ok().filter(|&i| i < MAX_FDS)?;
    Some((i / 64, 1u64 << (i % 64)))
}

/// The socket behind `fd`, if it is ours.
pub(crate) fn get(fd: i32) -> Option<Arc<Sock>> {
    let (w, b) = slot(fd)?;
    if BITS[w].load(Ordering::Acquire) & b == 0 {
        return None;
    }
    MAP.read().get(&fd).cloned()
}

/// Records `fd` as ours (replacing what was there).
pub(crate) fn insert(fd: i32, s: Arc<Sock>) {
    let Some((w, b)) = slot(fd) else { return };
    MAP.write().insert(fd, s);
    BITS[w].fetch_or(b, Ordering::Release);
}

/// Forgets `fd`; returns what it was.
pub(crate) fn remove(fd: i32) -> Option<Arc<Sock>> {
    let (w, b) = slot(fd)?;
    if BITS[w].load(Ordering::Acquire) & b == 0 {
        return None;
    }
    let mut m = MAP.write();
    BITS[w].fetch_and(!b, Ordering::Release);
    m.remove(&fd)
}
