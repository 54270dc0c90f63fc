//! How a connection being settled ends ([`Outcome`]), installed at every number showing it
//! ([`Settling::finish`]): SMC-R (the pair follows the connection from then on), TCP (what
//! was staged goes on the TCP socket, the numbers become plain), failed, or another
//! process's.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use smcr::{Blocking, SmcStream};

use super::numbers::{manage_cloexec, set_cloexec};
use super::runtime::{NEGOTIATING, runtime};
use crate::fds::is_nonblocking;
use crate::pair::{Pair, PairSink};
use crate::sock::{Settling, Sock, State, cloexec_managed, smc_fd};
use crate::{log, real, table};

impl Settling {
    /// Installs how the connection ended up (at every number still showing it) and sends what
    /// was staged first, so nothing the application writes later overtakes it.
    pub(super) fn finish(&self, fd: i32, outcome: Outcome) {
        use std::net::Shutdown;
        let mut st = self.st.lock();
        let staged = std::mem::take(&mut st.staged);
        let shut = match (st.shut_rd, st.shut_wr) {
            (true, true) => Some(Shutdown::Both),
            (true, false) => Some(Shutdown::Read),
            (false, true) => Some(Shutdown::Write),
            (false, false) => None,
        };
        let shown = st.shown.take();
        let installed = outcome.apply(fd, &self.pair, staged, shut, shown, &self.nonblock);
        st.settled = installed.clone();
        if st.state == State::Running {
            let _ =
                NEGOTIATING.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        st.state = State::Done;
        drop(st);
        self.done.notify_all();
        // What was staged goes now (after the lock: the application's reads must not wait
        // for a peer that waits for them), before anything the application writes later.
        if let Some(sock) = installed
            && let Sock::Smc(c) = &*sock
            && c.flush_preamble(Blocking::Yes(None)).is_err()
        {
            log::line(format_args!("fd {fd}: staged bytes could not be sent"));
        }
    }
}

/// The stream's own TCP socket.
pub(super) fn tcp_of(s: &SmcStream) -> i32 {
    s.tcp().as_raw_fd()
}

/// How a connection being settled ends.
pub(super) enum Outcome {
    /// SMC-R: installed at the number, following the connection with the same readiness.
    Smc(SmcStream),
    /// TCP after a fallback the stream recorded (its row stays with the number).
    Fallback(SmcStream),
    /// TCP, settled without a stream of ours (with our duplicate, if we have one, to send
    /// what was staged).
    Plain(Option<OwnedFd>),
    /// The CLC handshake failed: the TCP connection cannot carry data; it is shut down (the
    /// application sees it end).
    Failed,
    /// Another process negotiated it as SMC-R: not this process's to use (EIO).
    Foreign,
}

impl Outcome {
    /// Applies the outcome at every number showing the connection settled through `pair`,
    /// after sending `staged` on it.
    ///
    /// Runs under the settling entry's lock, which the close hooks take to remove a number:
    /// a number closed before is not in the table any more, one closed after loses the entry
    /// made here. With no number left (all closed), what was staged still goes, and the
    /// connection then closes.
    /// Returns the SMC-R connection installed, whose preamble (`staged`) the caller sends
    /// once the lock is released.
    ///
    /// `shown`: our duplicate of the TCP socket while the numbers show the pair (the kernel
    /// answered for the connection while it settled); settled as TCP, the numbers get the
    /// socket back, with the application's O_NONBLOCK (`nonblock`).
    fn apply(
        self,
        fd: i32,
        pair: &Arc<Pair>,
        staged: Vec<u8>,
        shut: Option<std::net::Shutdown>,
        shown: Option<Arc<OwnedFd>>,
        nonblock: &AtomicBool,
    ) -> Option<Arc<Sock>> {
        let numbers = table::numbers_with_pair(pair);
        let rt = runtime();
        if let Some(tcp) = &shown
            && matches!(self, Self::Fallback(_) | Self::Plain(_) | Self::Failed)
        {
            show_tcp(
                &numbers,
                pair,
                tcp.as_raw_fd(),
                nonblock.load(Ordering::Relaxed),
            );
        }
        match self {
            Self::Smc(s) => {
                if numbers.is_empty() {
                    log::line(format_args!("fd {fd}: closed before it was settled"));
                    if !staged.is_empty() && smc_send_all(&s, &staged).is_err() {
                        log::line(format_args!("fd {fd}: staged bytes could not be sent"));
                    }
                    return None;
                }
                let nonblock = is_nonblocking(numbers[0]);
                let sock = smc_fd(s, nonblock, pair.clone(), staged);
                if let (Some(how), Sock::Smc(c)) = (shut, &*sock) {
                    // Queued behind the preamble for writing.
                    let _ = c.shutdown(how);
                }
                for &n in &numbers {
                    // (A connect's numbers are managed already: their view stays.)
                    if !table::get_any(n).is_some_and(|s| cloexec_managed(&s)) {
                        manage_cloexec(n);
                    }
                    table::insert(n, sock.clone());
                }
                follow(&sock);
                for &n in &numbers {
                    // Kernel registrations made before (on the TCP socket) become ours; the
                    // sets holding ours wake for the connection's link group from now on.
                    crate::epoll::virtualize(n, pair);
                    for epfd in pair.watchers() {
                        crate::epoll::drive_with(epfd, n);
                    }
                }
                return Some(sock);
            }
            Self::Foreign => {
                let inherited = Arc::new(Sock::Inherited);
                for &n in &numbers {
                    table::insert(n, inherited.clone());
                    crate::epoll::vepoll::to_kernel_fd(n, pair);
                }
                pair.set(smcr::ReadyState {
                    readable: true,
                    writable: true,
                    error: true,
                    ..Default::default()
                });
            }
            Self::Fallback(_) | Self::Plain(_) | Self::Failed => {
                let failed = matches!(self, Self::Failed);
                let via = match &self {
                    Self::Fallback(s) => Some(tcp_of(s)),
                    Self::Plain(Some(d)) => Some(d.as_raw_fd()),
                    _ => numbers.first().copied(),
                };
                if !failed
                    && !staged.is_empty()
                    && let Some(t) = via
                    && write_all(t, &staged).is_err()
                {
                    log::line(format_args!("fd {fd}: staged bytes could not be sent"));
                }
                if failed && let Some(&n) = numbers.first() {
                    // SAFETY: shutting the socket down (every number shows the same one).
                    unsafe { real::shutdown()(n, libc::SHUT_RDWR) };
                } else if let (Some(how), Some(t)) = (shut, via) {
                    let how = match how {
                        std::net::Shutdown::Read => libc::SHUT_RD,
                        std::net::Shutdown::Write => libc::SHUT_WR,
                        std::net::Shutdown::Both => libc::SHUT_RDWR,
                    };
                    // SAFETY: the application's shutdown, after what it staged.
                    unsafe { real::shutdown()(t, how) };
                }
                if let Self::Fallback(s) = self {
                    // Its stats row stays with the application's number.
                    s.hand_over(&rt, numbers.first().copied().unwrap_or(-1));
                }
                for &n in &numbers {
                    if let Some(was) = table::remove(n)
                        && cloexec_managed(&was)
                    {
                        // A plain TCP connection may cross exec as the application asked.
                        set_cloexec(n, table::cloexec_view(n));
                    }
                    // Our registrations of it become the kernel's, on the TCP socket.
                    crate::epoll::vepoll::to_kernel_fd(n, pair);
                    crate::epoll::forget(n);
                }
                // Whoever waits through our hooks looks again (now at the kernel's view).
                pair.set(smcr::ReadyState {
                    readable: true,
                    writable: true,
                    hup: failed,
                    ..Default::default()
                });
            }
        }
        None
    }
}

/// The numbers showing the pair of a connection that settled as TCP get the TCP socket `tcp`
/// back (with the application's registrations, close-on-exec view and O_NONBLOCK).
fn show_tcp(numbers: &[i32], pair: &Arc<Pair>, tcp: i32, nonblock: bool) {
    crate::fds::set_nonblocking(tcp, nonblock);
    for &n in numbers {
        let flags = if table::cloexec_view(n) {
            libc::O_CLOEXEC
        } else {
            0
        };
        let still = || {
            table::get_any(n)
                .as_deref()
                .and_then(Sock::pair)
                .is_some_and(|p| Arc::ptr_eq(p, pair))
        };
        if let Err(e) = crate::epoll::swap(n, tcp, flags, still, || {}) {
            log::line(format_args!(
                "fd {n}: could not show the TCP socket again: {e}"
            ));
        }
    }
}

/// Sends all of `buf` on an SMC-R connection (waiting for room in the peer's RMB).
fn smc_send_all(s: &SmcStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let n = s.send(buf, Blocking::Yes(Some(Duration::from_secs(30))))?;
        buf = &buf[n..];
    }
    Ok(())
}

/// Writes all of `buf` to the TCP socket `fd` (blocking or not: waits in poll).
fn write_all(fd: i32, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: sending from our buffer on a socket we hold.
        let n = unsafe {
            real::send()(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            buf = &buf[n as usize..];
            continue;
        }
        match crate::guard::errno() {
            libc::EINTR => {}
            libc::EAGAIN => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: polling a socket we hold.
                unsafe { libc::poll(&mut p, 1, 30_000) };
            }
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
    Ok(())
}

/// Makes the pair follow the connection's readiness. Called once the number is ours in the
/// table: an application woken by the pair must find its calls going to SMC-R.
fn follow(sock: &Sock) {
    if let Sock::Smc(c) = sock {
        if let Some(d) = c.stream.driver()
            && c.pair.driver.set(d).is_ok()
        {
            c.pair.driver_set();
        }
        c.stream
            .set_readiness(Box::new(PairSink(c.pair.clone(), c.gate.clone())));
    }
}
