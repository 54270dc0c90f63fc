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

use parking_lot::Mutex;

/// Who is told of a hang-up (the link group: it probes its link). A trait, so this module
/// depends on nothing above it.
pub(crate) trait HangUp: Send + Sync {
    /// The TCP socket of connection `token` hung up.
    fn tcp_hung_up(&self, token: u32);
}

/// A watched TCP socket; dropping it ends the watch (and lets the socket close once the
/// stream is gone too).
pub(crate) struct Watched {
    fd: Arc<TcpStream>,
    key: u64,
}

struct Watcher {
    /// The process the set and its thread belong to (a forked child makes its own).
    pid: u32,
    ep: Arc<OwnedFd>,
    /// Registrations by key: the group, the connection's token and the descriptor.
    regs: HashMap<u64, (Weak<dyn HangUp>, u32, RawFd)>,
}

static WATCHER: Mutex<Option<Watcher>> = Mutex::new(None);
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// Watches `fd`, the TCP socket of connection `token` of `lg`, for a hang-up. If the watch
/// cannot be set up (no epoll set, no thread), the socket is kept without one: the link's own
/// keepalive still finds a dead peer.
pub(crate) fn watch<G: HangUp + 'static>(lg: &Arc<G>, token: u32, fd: Arc<TcpStream>) -> Watched {
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    let mut w = WATCHER.lock();
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
    Watched { fd, key }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut w = WATCHER.lock();
        if let Some(w) = w.as_mut()
            && w.pid == std::process::id()
            && w.regs.remove(&self.key).is_some()
        {
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
    let mine = ep.clone();
    rdma::thread::spawn("smcr-tcpwatch".into(), move || run(&mine)).ok()?;
    Some(Watcher {
        pid,
        ep,
        regs: HashMap::new(),
    })
}

fn run(ep: &OwnedFd) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 32];
    loop {
        // SAFETY: `evs` has room for 32 events.
        let n = unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 32, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let mut hung = Vec::new();
        {
            let mut w = WATCHER.lock();
            let Some(w) = w.as_mut() else {
                continue;
            };
            for e in &evs[..n as usize] {
                let key = e.u64;
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
    }
}
