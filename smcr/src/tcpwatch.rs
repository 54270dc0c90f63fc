//! Hang-ups of the TCP connections under SMC-R connections, seen without polling.
//!
//! A peer process that dies leaves no SMC-R close behind, but its kernel closes (or resets)
//! the TCP connection the handshake ran on. Each link group shares every attached
//! connection's TCP socket with its stream (it stays open while either holds it); the sockets are registered in one epoll set per process, and one
//! thread sleeps in it: an idle program makes no system call for this, and a hang-up is seen
//! at once (the group then probes its link, see `LinkGroup::tcp_hung_up`).

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Who is told of a hang-up (the link group: it probes its link). A trait, so this module
/// depends on nothing above it.
pub(crate) trait HangUp: Send + Sync {
    /// The TCP socket of connection `token` hung up.
    fn tcp_hung_up(&self, token: u32);
}

/// A watched TCP socket; dropping it ends the watch (and lets the socket close once the
/// stream is gone too), unless [`Watched::close_after_peer`] asked otherwise.
pub(crate) struct Watched {
    fd: Arc<TcpStream>,
    key: u64,
    /// Keep the socket open until the peer closes its end (or this deadline).
    linger: Option<std::time::Instant>,
}

/// How long a connection closed by its peer first keeps its TCP socket waiting for the
/// peer's FIN (Linux's `tcp_fin_timeout`).
pub(crate) const PASSIVE_CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// At most this many sockets wait so (each is a descriptor, and a process may have only
/// 1024): beyond, a socket closes at once and its TIME_WAIT stays here.
const MAX_LINGERING: usize = 256;

struct Watcher {
    /// The process the set and its thread belong to (a forked child makes its own).
    pid: u32,
    ep: Arc<OwnedFd>,
    /// Wakes the thread to look at `closing` again (key 0 in the set).
    wake: Arc<OwnedFd>,
    /// Registrations by key: the group, the connection's token and the descriptor.
    regs: HashMap<u64, (Weak<dyn HangUp>, u32, RawFd)>,
    /// Sockets of connections the peer closed first, kept open until the peer's TCP closes
    /// too (then our close is the passive one, and TIME_WAIT stays with the peer, which
    /// closed first, as TCP would have it) or their deadline passes.
    closing: HashMap<u64, (Arc<TcpStream>, std::time::Instant)>,
}

/// A `std` lock: held across `fork` (`rdma::forkhold`).
static WATCHER: Mutex<Option<Watcher>> = Mutex::new(None);

fn watcher() -> MutexGuard<'static, Option<Watcher>> {
    WATCHER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Before a fork: the forking thread takes the watcher (see `rdma::forkhold`).
pub(crate) fn hold_for_fork() {
    rdma::forkhold::hold_mutex(&WATCHER);
}

/// Whether this process's watch runs (its thread exists).
pub(crate) fn runs() -> bool {
    watcher()
        .as_ref()
        .is_some_and(|w| w.pid == std::process::id())
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// Watches `fd`, the TCP socket of connection `token` of `lg`, for a hang-up. If the watch
/// cannot be set up (no epoll set, no thread), the socket is kept without one: the link's own
/// keepalive still finds a dead peer.
pub(crate) fn watch<G: HangUp + 'static>(lg: &Arc<G>, token: u32, fd: Arc<TcpStream>) -> Watched {
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    let mut w = watcher();
    if w.as_ref().is_none_or(|w| w.pid != pid) {
        // First use, or a child forked from a process that watched: the inherited set is
        // shared with the parent and its thread did not come along, so the child makes its
        // own (the inherited one stays open, held by the parent's thread's handle).
        *w = start(pid);
    }
    if let Some(w) = w.as_mut() {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32,
            u64: key,
        };
        // SAFETY: registering a descriptor we own in our own set.
        let r = unsafe {
            libc::epoll_ctl(
                w.ep.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd.as_raw_fd(),
                &mut ev,
            )
        };
        if r == 0 {
            let lg: Weak<dyn HangUp> = Arc::downgrade(lg) as Weak<dyn HangUp>;
            w.regs.insert(key, (lg, token, fd.as_raw_fd()));
        }
    }
    Watched {
        fd,
        key,
        linger: None,
    }
}

impl Watched {
    /// Ends the watch, but keeps the socket open until the peer closes its TCP end (the
    /// SMC-R close was the peer's first), at most [`PASSIVE_CLOSE_WAIT`]. A socket that hung
    /// up already closes at once.
    pub(crate) fn close_after_peer(mut self) {
        self.linger = Some(std::time::Instant::now() + PASSIVE_CLOSE_WAIT);
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut w = watcher();
        let Some(w) = w.as_mut().filter(|w| w.pid == std::process::id()) else {
            return;
        };
        // Not registered any more: it hung up (the peer closed), nothing to wait for.
        if w.regs.remove(&self.key).is_none() {
            return;
        }
        if let Some(deadline) = self.linger
            && w.closing.len() < MAX_LINGERING
        {
            // The peer has not closed yet: the same registration now reports its close. The
            // thread learns of a first deadline (it sleeps without one); later ones are no
            // earlier than those it knows, so it is not woken for them (a wake-up per closed
            // connection was ~1 context switch each at 10 000 connections/s).
            let first = w.closing.is_empty();
            w.closing.insert(self.key, (self.fd.clone(), deadline));
            if first {
                let _ = rustix::io::write(&*w.wake, &1u64.to_ne_bytes());
            }
        } else {
            // The stream (or the application, under the preload) may hold the same file open:
            // only an explicit delete takes it out of the set.
            // SAFETY: our set and our descriptor, still open.
            unsafe {
                libc::epoll_ctl(
                    w.ep.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                )
            };
        }
    }
}

/// A new epoll set and the thread that sleeps in it; `None` if either cannot be made.
fn start(pid: u32) -> Option<Watcher> {
    // SAFETY: creates a new descriptor, owned below.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: just created, nothing else owns it.
    let ep = Arc::new(rdma::fdzone::place(unsafe { OwnedFd::from_raw_fd(raw) }).ok()?);
    let wake = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .ok()?;
    let wake = Arc::new(rdma::fdzone::place(wake).ok()?);
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: WAKE_KEY,
    };
    // SAFETY: registering a descriptor we own in our own set.
    if unsafe {
        libc::epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            &mut ev,
        )
    } != 0
    {
        return None;
    }
    let (mine, woken) = (ep.clone(), wake.clone());
    if let Err(e) = rdma::thread::spawn("smcr-tcpwatch".into(), move || run(&mine, &woken)) {
        // A program that forbids new threads, no spare left: the links' keepalive (TEST
        // LINK) still finds a dead peer. Said once per process; tried again per connection.
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        if SAID.swap(pid, Ordering::Relaxed) != pid {
            log::warn!(
                "no thread for the TCP hang-up watch ({e}): hang-ups are found by TEST LINK until a later connection gets one"
            );
        }
        return None;
    }
    Some(Watcher {
        pid,
        ep,
        wake,
        regs: HashMap::new(),
        closing: HashMap::new(),
    })
}

/// The key of the wake-up eventfd (registration keys start at 1).
const WAKE_KEY: u64 = 0;

/// Closes the lingering sockets whose peer closed (`keys`) or whose deadline passed; returns
/// how long to sleep until the next deadline (ms, -1: none).
fn close_lingering(ep: &OwnedFd, keys: &[u64]) -> i32 {
    let now = std::time::Instant::now();
    let mut done = Vec::new();
    let next = {
        let mut w = watcher();
        let Some(w) = w.as_mut() else {
            return -1;
        };
        for k in keys {
            if let Some(c) = w.closing.remove(k) {
                done.push(c.0);
            }
        }
        let expired: Vec<u64> = w
            .closing
            .iter()
            .filter(|(_, (_, t))| *t <= now)
            .map(|(k, _)| *k)
            .collect();
        for k in expired {
            if let Some(c) = w.closing.remove(&k) {
                done.push(c.0);
            }
        }
        for fd in &done {
            // SAFETY: our set; the descriptor is open (we hold it).
            unsafe {
                libc::epoll_ctl(
                    ep.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    fd.as_raw_fd(),
                    std::ptr::null_mut(),
                )
            };
        }
        w.closing.values().map(|(_, t)| *t).min()
    };
    // Closed here, outside the lock (the last holder closes the socket).
    drop(done);
    next.map_or(-1, |t| {
        let ms = t.saturating_duration_since(now).as_millis() + 1;
        i32::try_from(ms).unwrap_or(i32::MAX)
    })
}

/// After handling events the thread pauses this long before it looks again, so that the
/// hang-ups of a burst of closing connections are handled together rather than one wake-up
/// each (nothing here needs sub-millisecond reactions: a hang-up starts a link probe that
/// takes far longer, a lingering socket waits for seconds).
const BATCH: std::time::Duration = std::time::Duration::from_millis(2);

fn run(ep: &OwnedFd, wake: &OwnedFd) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 32];
    let mut timeout = -1;
    loop {
        // SAFETY: `evs` has room for 32 events.
        let n = unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 32, timeout) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let mut hung = Vec::new();
        let mut ended = Vec::new();
        {
            let mut w = watcher();
            let Some(w) = w.as_mut() else {
                continue;
            };
            for e in &evs[..n as usize] {
                let key = e.u64;
                if key == WAKE_KEY {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(wake, &mut b);
                    continue;
                }
                if w.closing.contains_key(&key) {
                    ended.push(key);
                    continue;
                }
                if let Some((lg, token, fd)) = w.regs.remove(&key) {
                    // Reported once: the group probes its link, and the socket says nothing
                    // more we need.
                    // SAFETY: our set; `fd` is open while its `Watched` lives, and that
                    // takes this lock before closing it.
                    unsafe {
                        libc::epoll_ctl(
                            ep.as_raw_fd(),
                            libc::EPOLL_CTL_DEL,
                            fd,
                            std::ptr::null_mut(),
                        )
                    };
                    hung.push((lg, token));
                }
            }
        }
        for (lg, token) in hung {
            if let Some(lg) = lg.upgrade() {
                lg.tcp_hung_up(token);
            }
        }
        timeout = close_lingering(ep, &ended);
        // (A full batch: more may be queued, look again at once.)
        if n > 0 && (n as usize) < evs.len() {
            std::thread::sleep(BATCH);
        }
    }
}
