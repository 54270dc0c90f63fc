//! Which file descriptors are ours. The question is asked on every hooked call, so the answer
//! for a descriptor that is not ours is one atomic load (a bit per fd), with no lock and no
//! allocation (hooks may run in signal handlers). Also the close-on-exec flag the application
//! sees on our numbers, and this process's id. Below everything but the types it holds (`sock`,
//! `pair`).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::forkhold::{self, Held};
use crate::pair::Pair;
use crate::real;
use crate::sock::{Sock, cloexec_managed};

/// Descriptors we track (higher ones are left to libc: the application's sockets live low).
pub(crate) const MAX_FDS: usize = 1 << 16;

static BITS: [AtomicU64; MAX_FDS / 64] = [const { AtomicU64::new(0) }; MAX_FDS / 64];
/// For numbers showing one of our pairs: the application asked for the descriptor to survive
/// exec (FD_CLOEXEC clear). The pair itself is always close-on-exec, so a new program image
/// never holds an end that nothing serves any more; the application sees its own flag.
static INHERIT: [AtomicU64; MAX_FDS / 64] = [const { AtomicU64::new(0) }; MAX_FDS / 64];
/// Each entry with the process that made it: a forked child inherits our memory and our
/// descriptors, but the connections belong to the parent. Indexed by the number (below
/// [`MAX_FDS`]; it grows to the highest one seen): a lookup is the read lock and an index.
/// A `std` lock: held across `fork` (`forkhold`).
static MAP: RwLock<Vec<Option<Entry>>> = RwLock::new(Vec::new());

/// The table to look at (a panic while it was held left it whole: entries are put in one go).
fn read() -> Held<RwLockReadGuard<'static, Vec<Option<Entry>>>> {
    forkhold::read(&MAP)
}

/// The table to change; in debug builds held longer on request (`forkhold::debug_stretch`).
fn write() -> Held<RwLockWriteGuard<'static, Vec<Option<Entry>>>> {
    let g = forkhold::write(&MAP);
    forkhold::debug_stretch();
    g
}

/// Before a fork: the forking thread takes the table (see `forkhold`).
pub(crate) fn hold_for_fork() {
    forkhold::hold_rwlock(&MAP);
}

/// The process that made an entry, and the socket.
type Entry = (u32, Arc<Sock>);

/// The entry at `fd` of the table `m`.
fn at(m: &[Option<Entry>], fd: i32) -> Option<&Entry> {
    m.get(usize::try_from(fd).ok()?)?.as_ref()
}

/// The table's entries with their numbers.
fn entries(m: &[Option<Entry>]) -> impl Iterator<Item = (i32, &Entry)> {
    m.iter()
        .enumerate()
        .filter_map(|(fd, e)| Some((fd as i32, e.as_ref()?)))
}

/// Puts `e` at `fd` (below [`MAX_FDS`]: checked by the callers' `slot`).
fn put(m: &mut Vec<Option<Entry>>, fd: usize, e: Option<Entry>) {
    if m.len() <= fd {
        if e.is_none() {
            return;
        }
        m.resize(fd + 1, None);
    }
    m[fd] = e;
}
static PID: AtomicU32 = AtomicU32::new(0);
static INHERITED: std::sync::OnceLock<Arc<Sock>> = std::sync::OnceLock::new();

extern "C" fn after_fork_in_child() {
    // SAFETY: getpid has no preconditions (async-signal-safe, as a fork child handler needs).
    PID.store(unsafe { libc::getpid() } as u32, Ordering::Release);
}

/// This process's id, kept current across fork without a syscall per call.
pub(crate) fn pid() -> u32 {
    let p = PID.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registering a child handler that only stores getpid().
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    // SAFETY: as above.
    let p = unsafe { libc::getpid() } as u32;
    PID.store(p, Ordering::Release);
    p
}

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
    let m = read();
    let (owner, s) = at(&m, fd)?;
    if *owner == pid() || !s.per_process() {
        Some(s.clone())
    } else {
        Some(INHERITED.get_or_init(|| Arc::new(Sock::Inherited)).clone())
    }
}

/// The socket behind `fd` whichever process made the entry (a forked child's view of the
/// parent's files, for decisions about the file itself rather than the connection).
pub(crate) fn get_any(fd: i32) -> Option<Arc<Sock>> {
    let (w, b) = slot(fd)?;
    if BITS[w].load(Ordering::Acquire) & b == 0 {
        return None;
    }
    at(&read(), fd).map(|(_, s)| s.clone())
}

/// Records `fd` as ours (replacing what was there).
pub(crate) fn insert(fd: i32, s: Arc<Sock>) {
    let Some((w, b)) = slot(fd) else { return };
    let owner = pid();
    put(&mut write(), fd as usize, Some((owner, s)));
    BITS[w].fetch_or(b, Ordering::Release);
}

/// Forgets `fd`; returns what it was, unless it was inherited from the parent process: the
/// parent's state must not be touched (no close message from the child, no stats row
/// dropped), so that entry is leaked in the child instead of dropped.
pub(crate) fn remove(fd: i32) -> Option<Arc<Sock>> {
    let (w, b) = slot(fd)?;
    if BITS[w].load(Ordering::Acquire) & b == 0 {
        return None;
    }
    let mut m = write();
    BITS[w].fetch_and(!b, Ordering::Release);
    let (owner, s) = m.get_mut(fd as usize)?.take()?;
    if owner == pid() {
        Some(s)
    } else {
        std::mem::forget(s);
        None
    }
}

/// The numbers showing SMC-R connections this process made (not a parent's).
pub(crate) fn own_smc_numbers() -> Vec<i32> {
    let me = pid();
    entries(&read())
        .filter(|(_, (owner, s))| *owner == me && matches!(**s, Sock::Smc(_)))
        .map(|(fd, _)| fd)
        .collect()
}

/// Every number of the table that would survive an `exec` (not close-on-exec as the
/// application sees it), with its entry.
pub(crate) fn inherited_by_exec() -> Vec<(i32, Arc<Sock>)> {
    let all: Vec<(i32, Arc<Sock>)> = entries(&read())
        .map(|(fd, (_, s))| (fd, s.clone()))
        .collect();
    all.into_iter()
        .filter(|(fd, _)| !app_cloexec(*fd))
        .collect()
}

/// Records the close-on-exec flag the application believes `fd` has.
pub(crate) fn set_cloexec_view(fd: i32, cloexec: bool) {
    let Some((w, b)) = slot(fd) else { return };
    if cloexec {
        INHERIT[w].fetch_and(!b, Ordering::Release);
    } else {
        INHERIT[w].fetch_or(b, Ordering::Release);
    }
}

/// The close-on-exec flag the application believes `fd` has (see [`set_cloexec_view`]).
pub(crate) fn cloexec_view(fd: i32) -> bool {
    slot(fd).is_none_or(|(w, b)| INHERIT[w].load(Ordering::Acquire) & b == 0)
}

/// The close-on-exec flag as the application sees it.
pub(crate) fn app_cloexec(fd: i32) -> bool {
    if get_any(fd).is_some_and(|s| cloexec_managed(&s)) {
        return cloexec_view(fd);
    }
    // SAFETY: reading descriptor flags.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFD, 0) };
    fl >= 0 && fl & libc::FD_CLOEXEC != 0
}

/// Whether some number of this process still shows `s` (after one was removed: dup'd
/// numbers share the socket).
pub(crate) fn shows(s: &Arc<Sock>) -> bool {
    entries(&read()).any(|(_, (_, t))| Arc::ptr_eq(s, t))
}

/// The numbers of this process's table that show `s` (dup'd numbers share one entry).
pub(crate) fn numbers_of(s: &Arc<Sock>) -> Vec<i32> {
    entries(&read())
        .filter(|(_, (_, t))| Arc::ptr_eq(s, t))
        .map(|(fd, _)| fd)
        .collect()
}

/// The numbers whose entry reports readiness through `pair` (a connection being settled:
/// pending or accepted, whichever process made the entry).
pub(crate) fn numbers_with_pair(pair: &Arc<Pair>) -> Vec<i32> {
    entries(&read())
        .filter(|(_, (_, t))| t.pair().is_some_and(|p| Arc::ptr_eq(p, pair)))
        .map(|(fd, _)| fd)
        .collect()
}

/// Whether a connect of this process being settled comes from `peer` (its local address).
pub(crate) fn connecting_from(peer: std::net::SocketAddr) -> bool {
    let me = pid();
    entries(&read()).any(|(_, (owner, s))| {
        *owner == me
            && matches!(&**s, Sock::Pending(p) if p.client_local().is_some_and(|l| {
                l == peer || smcr::v4_of(l).is_some_and(|l| smcr::v4_of(peer) == Some(l))
            }))
    })
}

/// Puts `new` at `fd` (`None`: forgets it) if `fd` still shows `old`.
pub(crate) fn replace_if(fd: i32, old: &Arc<Sock>, new: Option<Arc<Sock>>) -> bool {
    let Some((w, b)) = slot(fd) else { return false };
    let mut m = write();
    if !at(&m, fd).is_some_and(|(_, s)| Arc::ptr_eq(s, old)) {
        return false;
    }
    if new.is_none() {
        BITS[w].fetch_and(!b, Ordering::Release);
    }
    put(&mut m, fd as usize, new.map(|s| (pid(), s)));
    true
}
