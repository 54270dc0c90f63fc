//! What happens to a socket of ours, call by call. The hooks (`hooks.rs`) only decide whether a
//! descriptor is ours and translate arguments; the SMC-R work is `smcr`'s.
//!
//! Life of a socket (this step supports blocking sockets; see docs/limitations.md):
//! * `socket(AF_INET, SOCK_STREAM)` → [`Sock::Inet`].
//! * `connect` on a blocking socket: marked for the TCP option, connected, then negotiated
//!   (`SmcStream::from_connected`). SMC-R → the TCP socket moves to a hidden high descriptor
//!   and an eventfd takes the application's number ([`Sock::Smc`]); TCP → forgotten (plain
//!   socket, zero cost from then on).
//! * `listen` on a blocking socket: marked first ([`Sock::Listener`]); `accept` negotiates each
//!   connection as the server, the same way.
//! * Non-blocking sockets are left unmarked: they stay plain TCP (the asynchronous handshake
//!   comes with the event-loop support).

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use smcr::{Blocking, Mode, Runtime, RuntimeConfig, SmcStream};

use crate::guard::{Bypass, errno_of};
use crate::{log, real, table};

/// Hidden descriptors (our duplicates of TCP sockets) live at or above this number, out of the
/// way of `select` (FD_SETSIZE 1024) and of the application's low numbers.
const HIDDEN_MIN: i32 = 1100;

/// A socket the shim manages.
pub(crate) enum Sock {
    /// An IPv4 TCP socket, not connected or listening yet.
    Inet,
    /// A listening socket; `marked`: its connections negotiate SMC-R.
    Listener {
        /// Marked for the TCP option before `listen`.
        marked: bool,
    },
    /// An SMC-R connection.
    Smc(SmcFd),
}

/// An SMC-R connection at an application descriptor.
pub(crate) struct SmcFd {
    pub(crate) stream: SmcStream,
    /// The application's O_NONBLOCK.
    pub(crate) nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in microseconds (0: none).
    pub(crate) rcvtimeo_us: AtomicU64,
    pub(crate) sndtimeo_us: AtomicU64,
}

impl SmcFd {
    fn blocking(&self, dontwait: bool, timeo: &AtomicU64) -> Blocking {
        if dontwait || self.nonblock.load(Ordering::Relaxed) {
            Blocking::No
        } else {
            match timeo.load(Ordering::Relaxed) {
                0 => Blocking::Yes(None),
                us => Blocking::Yes(Some(Duration::from_micros(us))),
            }
        }
    }

    pub(crate) fn recv(&self, buf: &mut [u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.rcvtimeo_us);
        let peek = flags & libc::MSG_PEEK != 0;
        if flags & libc::MSG_WAITALL != 0 && !peek {
            // Until the buffer is full, EOF, or an error after some data.
            let mut got = 0;
            while got < buf.len() {
                match self.stream.recv(&mut buf[got..], false, how) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(_) if got > 0 => break,
                    Err(e) => return Err(e),
                }
            }
            return Ok(got);
        }
        self.stream.recv(buf, peek, how)
    }

    pub(crate) fn send(&self, buf: &[u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.sndtimeo_us);
        let r = self.stream.send(buf, how);
        if let Err(e) = &r
            && e.kind() == io::ErrorKind::BrokenPipe
            && flags & libc::MSG_NOSIGNAL == 0
        {
            // As a socket would: SIGPIPE unless MSG_NOSIGNAL (the default action ends the
            // program, as it would with TCP).
            // SAFETY: raise has no preconditions.
            unsafe { libc::raise(libc::SIGPIPE) };
        }
        r
    }
}

/// The process's runtime, created on first use, and again in a forked child (whose engine and
/// poller threads did not survive the fork).
pub(crate) fn runtime() -> Runtime {
    static RT: OnceLock<Mutex<Option<(u32, Runtime)>>> = OnceLock::new();
    let cell = RT.get_or_init(|| Mutex::new(None));
    let mut g = cell.lock();
    let pid = std::process::id();
    match &*g {
        Some((p, rt)) if *p == pid => rt.clone(),
        _ => {
            let _b = Bypass::new();
            let rt = Runtime::new(RuntimeConfig::from_env());
            if let Some(why) = rt.negotiation_problem() {
                log::line(format_args!(
                    "SMC-R unavailable, all connections stay TCP: {why}"
                ));
            }
            *g = Some((pid, rt.clone()));
            rt
        }
    }
}

/// Whether the shim is on (`SMCR_DISABLE=1` turns it off).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMCR_DISABLE").map_or(true, |v| v != "1"))
}

fn is_nonblocking(fd: i32) -> bool {
    // SAFETY: fcntl F_GETFL on any descriptor is harmless.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

fn borrowed(fd: i32) -> BorrowedFd<'static> {
    // SAFETY: used only for the duration of a call while the application holds `fd` open.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Our own duplicate of the application's socket, as a TcpStream, at a hidden number.
fn hidden_dup(fd: i32) -> io::Result<TcpStream> {
    // SAFETY: fcntl duplicates `fd`; the new descriptor is ours alone.
    let h = unsafe { real::fcntl()(fd, libc::F_DUPFD_CLOEXEC, HIDDEN_MIN as libc::c_ulong) };
    if h < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `h` is a new descriptor nothing else owns.
    Ok(unsafe { TcpStream::from_raw_fd(h) })
}

/// The application-facing socket of an SMC-R connection: one end (`app`) of a Unix stream
/// socketpair sits at the application's descriptor number, and we make the kernel report for
/// it exactly the connection's readiness, so poll/select/epoll (level- or edge-triggered) need
/// no translation. Readable: one byte waits in `app`'s receive queue (or its peer end `ours`
/// shut down writing: EOF, RDHUP). Not writable: `app`'s send side is filled (through our
/// duplicate `app_dup`) until the kernel refuses more. Hung up: `ours` shut down both ways.
struct Pair {
    /// A duplicate of the application's end (same open file), for draining and filling.
    app_dup: std::os::fd::OwnedFd,
    /// Our end (non-blocking).
    ours: std::os::fd::OwnedFd,
    state: Mutex<smcr::ReadyState>,
}

impl smcr::Readiness for Pair {
    fn update(&self, now: smcr::ReadyState) {
        let _b = Bypass::new();
        let mut cur = self.state.lock();
        let (a, o) = (self.app_dup.as_raw_fd(), self.ours.as_raw_fd());
        let mut buf = [0u8; 1024];
        // SAFETY (all calls below): descriptors we own; MSG_DONTWAIT so the application's
        // O_NONBLOCK (shared with `app_dup`) never makes us block.
        unsafe {
            if now.readable != cur.readable && !cur.rdhup {
                if now.readable {
                    real::send()(o, b"r".as_ptr().cast(), 1, libc::MSG_DONTWAIT);
                } else {
                    real::recv()(a, buf.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT);
                }
            }
            if now.writable != cur.writable {
                if now.writable {
                    while real::recv()(o, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
                        > 0
                    {}
                } else {
                    while real::send()(a, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) > 0 {}
                }
            }
            if now.rdhup && !cur.rdhup {
                real::shutdown()(o, libc::SHUT_WR);
            }
            if now.hup && !cur.hup {
                real::shutdown()(o, libc::SHUT_RD);
            }
        }
        *cur = now;
    }
}

/// Puts the application-facing socket of a new SMC-R connection at the application's number
/// `fd` (keeping its close-on-exec and O_NONBLOCK); the TCP socket lives on in the stream's
/// hidden duplicate.
fn take_over(fd: i32, stream: SmcStream) -> io::Result<()> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let last = || io::Error::last_os_error();
    // SAFETY: plain descriptor calls on descriptors we own or the application passed us.
    unsafe {
        let fdflags = real::fcntl()(fd, libc::F_GETFD, 0);
        let nonblock = is_nonblocking(fd);
        let mut sv = [0; 2];
        if libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        ) != 0
        {
            return Err(last());
        }
        let (app, ours) = (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]));
        // Small buffers: filling the application's end takes a few kilobytes.
        let one: libc::c_int = 1;
        real::setsockopt()(
            app.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&one as *const libc::c_int).cast(),
            4,
        );
        real::fcntl()(
            ours.as_raw_fd(),
            libc::F_SETFL,
            libc::O_NONBLOCK as libc::c_ulong,
        );
        let app_dup = real::fcntl()(
            app.as_raw_fd(),
            libc::F_DUPFD_CLOEXEC,
            HIDDEN_MIN as libc::c_ulong,
        );
        let ours_hi = real::fcntl()(
            ours.as_raw_fd(),
            libc::F_DUPFD_CLOEXEC,
            HIDDEN_MIN as libc::c_ulong,
        );
        if app_dup < 0 || ours_hi < 0 {
            return Err(last());
        }
        let flags = if fdflags >= 0 && fdflags & libc::FD_CLOEXEC != 0 {
            libc::O_CLOEXEC
        } else {
            0
        };
        if real::dup3()(app.as_raw_fd(), fd, flags) < 0 {
            return Err(last());
        }
        drop((app, ours));
        if nonblock {
            real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong);
        }
        stream.set_readiness(Box::new(Pair {
            app_dup: OwnedFd::from_raw_fd(app_dup),
            ours: OwnedFd::from_raw_fd(ours_hi),
            state: Mutex::new(smcr::ReadyState {
                writable: true,
                ..Default::default()
            }),
        }));
        table::insert(
            fd,
            Arc::new(Sock::Smc(SmcFd {
                stream,
                nonblock: AtomicBool::new(nonblock),
                rcvtimeo_us: AtomicU64::new(0),
                sndtimeo_us: AtomicU64::new(0),
            })),
        );
    }
    Ok(())
}

fn describe(m: &Mode) -> String {
    match m {
        Mode::SmcR { first_contact } => format!(
            "SMC-R ({})",
            if *first_contact {
                "new link group"
            } else {
                "link group reused"
            }
        ),
        Mode::Tcp(r) => format!("TCP: {r} [{:#010x}]", r.code()),
    }
}

/// After the application's own successful, blocking `connect`: negotiate.
pub(crate) fn after_connect(fd: i32, marked: bool) -> Result<(), i32> {
    let _b = Bypass::new();
    let rt = runtime();
    let tcp = hidden_dup(fd).map_err(|e| errno_of(&e))?;
    let peer = tcp.peer_addr().ok();
    match SmcStream::from_connected(&rt, tcp, marked) {
        Ok(s) => {
            log::line(format_args!(
                "fd {fd} connect {peer:?}: {}",
                describe(s.mode())
            ));
            if matches!(s.mode(), Mode::SmcR { .. }) {
                take_over(fd, s).map_err(|e| errno_of(&e))
            } else {
                // Plain TCP from now on; our duplicate closes with `s`.
                table::remove(fd);
                Ok(())
            }
        }
        Err(e) => {
            log::line(format_args!(
                "fd {fd} connect {peer:?}: handshake failed: {e}"
            ));
            table::remove(fd);
            Err(errno_of(&e))
        }
    }
}

/// After the application's `accept` on a marked listener returned `fd`: negotiate as server.
/// `Err`: the connection failed (it is closed; the caller accepts the next one).
pub(crate) fn after_accept(fd: i32) -> Result<(), ()> {
    let _b = Bypass::new();
    let rt = runtime();
    // Out of descriptors: the client expects CLC on this marked connection, so fail it.
    let tcp = hidden_dup(fd).map_err(drop)?;
    let peer = tcp.peer_addr().ok();
    match SmcStream::from_accepted(&rt, tcp) {
        Ok(s) => {
            log::line(format_args!(
                "fd {fd} accept {peer:?}: {}",
                describe(s.mode())
            ));
            if matches!(s.mode(), Mode::SmcR { .. }) {
                take_over(fd, s).map_err(|_| ())
            } else {
                Ok(())
            }
        }
        Err(e) => {
            log::line(format_args!(
                "fd {fd} accept {peer:?}: handshake failed: {e}"
            ));
            Err(())
        }
    }
}

/// Marks a blocking socket for the option: `Some(marked)`; `None` for a non-blocking socket,
/// which stays plain TCP (the asynchronous negotiation is not built yet).
pub(crate) fn mark_if_blocking(fd: i32) -> Option<bool> {
    if is_nonblocking(fd) {
        log::line(format_args!(
            "fd {fd}: non-blocking socket stays TCP (asynchronous negotiation not built yet)"
        ));
        return None;
    }
    let _b = Bypass::new();
    Some(runtime().mark(borrowed(fd)))
}

/// The hidden TCP socket's descriptor of an SMC-R fd (for addresses and socket options).
pub(crate) fn tcp_fd(s: &SmcFd) -> i32 {
    s.stream.tcp().as_raw_fd()
}
