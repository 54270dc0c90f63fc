//! The connect path: the plan made before the kernel's connect (our duplicate, the mark, or
//! plain TCP), and the worker that waits for the TCP handshake and negotiates SMC-R.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use smcr::{FallbackReason, Mode, SmcStream};

use super::numbers::{manage_cloexec, untrack};
use super::outcome::{Outcome, tcp_of};
use super::runtime::{claim, describe, runtime, spares_to_keep};
use crate::fds::{borrowed, hide, is_nonblocking, sock_addr};
use crate::guard::Bypass;
use crate::sock::{Role, Settling, Sock};
use crate::{log, table};

/// Destinations of this process's connects between the kernel's connect and their entry in
/// the table ([`connect_async`]): a thread of this process blocked in `accept` on that
/// destination gets the connection in between, and must still learn that it is this
/// process's own (its server side negotiates at once: see `accept`).
static IN_FLIGHT: std::sync::Mutex<Vec<SocketAddr>> = std::sync::Mutex::new(Vec::new());
/// Its length, read without the lock by every accept (almost always 0).
static IN_FLIGHT_N: AtomicUsize = AtomicUsize::new(0);

/// [`IN_FLIGHT`], a `std` lock: held across `fork` (`forkhold`).
fn in_flight() -> crate::forkhold::Held<std::sync::MutexGuard<'static, Vec<SocketAddr>>> {
    crate::forkhold::lock(&IN_FLIGHT)
}

/// Before a fork: the forking thread takes the list (see `forkhold`).
pub(crate) fn hold_for_fork() {
    crate::forkhold::hold_mutex(&IN_FLIGHT);
}

/// A connect to `dest` in flight (see [`IN_FLIGHT`]) until dropped, after its entry is in.
pub(crate) struct Connecting(SocketAddr);

pub(crate) fn connecting(dest: SocketAddr) -> Connecting {
    let dest = smcr::v4_of(dest).map_or(dest, SocketAddr::V4);
    in_flight().push(dest);
    IN_FLIGHT_N.fetch_add(1, Ordering::SeqCst);
    Connecting(dest)
}

impl Drop for Connecting {
    fn drop(&mut self) {
        let mut v = in_flight();
        if let Some(i) = v.iter().position(|d| *d == self.0) {
            v.swap_remove(i);
        }
        IN_FLIGHT_N.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether the connection accepted at `c` from `peer` is a connect of this process being
/// settled: one in the table, or one still between the kernel's connect and its entry, which
/// this waits for (briefly: that thread has only the entry left to make).
pub(crate) fn own_connect(c: i32, peer: SocketAddr) -> bool {
    if table::connecting_from(peer) {
        return true;
    }
    if IN_FLIGHT_N.load(Ordering::SeqCst) == 0 {
        return false;
    }
    let Some(local) = sock_addr(c, false) else {
        return false;
    };
    let local = smcr::v4_of(local).map_or(local, SocketAddr::V4);
    let start = std::time::Instant::now();
    while in_flight().contains(&local) && start.elapsed() < IN_FLIGHT_WAIT {
        if table::connecting_from(peer) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    table::connecting_from(peer)
}

/// The longest an accept waits for a connect of its own process to be entered (a connect to
/// this destination from another thread may be slow to finish: then its connection is not
/// the accepted one, whose own connect would have been entered within microseconds).
const IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Tests only (debug builds): `SMCR_DEBUG_CONNECT_PAUSE_MS` stretches the time between the
/// kernel's connect and the connection's entry, where an accept of the same process can get
/// the connection first (`own_connect`); a loaded machine stretches it too, by chance.
pub(crate) fn debug_pause() {
    #[cfg(debug_assertions)]
    {
        static PAUSE: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
        let ms = std::time::Duration::from_millis;
        crate::debug::sleep_from_env(&PAUSE, "SMCR_DEBUG_CONNECT_PAUSE_MS", ms);
    }
}

/// What `connect` does with a socket of ours, decided before the kernel's connect.
pub(crate) enum ConnectPlan {
    /// Marked for the TCP option, with our duplicate of the socket ready.
    Smc { dup: OwnedFd, marked: bool },
    /// Plain TCP from the SYN on, for a reason recorded once connected.
    Tcp(FallbackReason),
}

/// Before the application's `connect` to `dest`: takes our duplicate (none: NOFD) and marks
/// the socket, or decides plain TCP (a native IPv6 peer).
pub(crate) fn plan_connect(fd: i32, dest: SocketAddr) -> ConnectPlan {
    let _b = Bypass::new();
    if smcr::v4_of(dest).is_none() {
        return ConnectPlan::Tcp(FallbackReason::NotIpv4);
    }
    let rt = runtime();
    let Ok(dup) = hide(fd) else {
        return ConnectPlan::Tcp(FallbackReason::NoDescriptors);
    };
    let marked = rt.mark_connecting(borrowed(fd));
    ConnectPlan::Smc { dup, marked }
}

/// A connection that stays TCP for `reason` decided before the TCP handshake (never marked):
/// recorded for smc-stat and the log.
pub(crate) fn plain_connect(fd: i32, reason: FallbackReason) {
    let _b = Bypass::new();
    untrack(fd);
    let rt = runtime();
    log::line(format_args!(
        "fd {fd} connect {:?}: {}",
        sock_addr(fd, true),
        describe(&Mode::Tcp(reason.clone()))
    ));
    SmcStream::record_local(&rt, borrowed(fd), false, reason);
}

/// The application's non-blocking `connect` returned EINPROGRESS (or succeeded at once), or
/// it connected to a listener of its own (`connected`): the number stays the TCP socket,
/// shown not writable through our hooks until TCP is connected, and a worker negotiates.
pub(crate) fn connect_async(fd: i32, dup: OwnedFd, marked: bool, connected: bool) {
    let _b = Bypass::new();
    let s = Settling::new(
        Role::Client {
            local: sock_addr(fd, false),
        },
        connected,
        is_nonblocking(fd),
    );
    table::insert(fd, Arc::new(Sock::Pending(s.clone())));
    manage_cloexec(fd);
    crate::workers::run(spares_to_keep(), move || {
        finish_connect(fd, marked, dup, &s)
    });
}

fn finish_connect(fd: i32, marked: bool, dup: OwnedFd, s: &Arc<Settling>) {
    // Wait for the kernel's TCP handshake.
    let mut p = libc::pollfd {
        fd: dup.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // As long as the kernel tries (its SYN retries end it with an error).
    loop {
        // SAFETY: polling our own descriptor.
        if unsafe { libc::poll(&mut p, 1, -1) } >= 0 || crate::guard::errno() != libc::EINTR {
            break;
        }
    }
    if p.revents & (libc::POLLERR | libc::POLLHUP) != 0 || p.revents & libc::POLLOUT == 0 {
        // Failed (or timed out): the socket is the application's again, its error unread
        // (SO_ERROR reports it).
        log::line(format_args!(
            "fd {fd} connect: TCP connect failed (poll revents {:#x})",
            p.revents
        ));
        return s.finish(fd, Outcome::Plain(None));
    }
    // Connected: writable for the application (its writes are staged meanwhile).
    s.connected();
    let rt = runtime();
    let tcp = TcpStream::from(dup);
    let ends = (tcp.local_addr().ok(), tcp.peer_addr().ok());
    let peer = ends.1;
    let outcome = match SmcStream::from_connected(&rt, tcp, marked) {
        Ok(st) => {
            log::line(format_args!(
                "fd {fd} connect {peer:?}: {}",
                describe(st.mode())
            ));
            let smc = matches!(st.mode(), Mode::SmcR { .. });
            claim(&rt, borrowed(tcp_of(&st)), smc);
            if smc {
                Outcome::Smc(st)
            } else {
                Outcome::Fallback(st)
            }
        }
        Err(e) => {
            if table::numbers_with_pair(&s.pair).is_empty() {
                // The application closed it meanwhile (and so, often, did the peer).
                log::line(format_args!(
                    "fd {fd} connect {peer:?}: closed before it was settled ({e})"
                ));
            } else if let Some(again) = super::reconnect::plain_again(fd, s, &rt, ends, &e) {
                log::line(format_args!(
                    "fd {fd} connect {peer:?}: {} [{:#010x}] (the server answered our Proposal \
                     with {e}: the program reading its end had no record of the connection)",
                    describe(&Mode::Tcp(FallbackReason::NotClc)),
                    FallbackReason::CODE_NOT_CLC
                ));
                return s.finish(fd, Outcome::Plain(Some(again)));
            } else {
                if smcr::not_clc(&e) {
                    rt.count_code(FallbackReason::CODE_NOT_CLC);
                }
                log::line(format_args!(
                    "fd {fd} connect {peer:?}: handshake failed: {e}"
                ));
            }
            Outcome::Failed
        }
    };
    s.finish(fd, outcome);
}
