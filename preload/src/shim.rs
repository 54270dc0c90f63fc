//! What happens to a socket of ours, call by call. The hooks (`hooks.rs`) only decide whether a
//! descriptor is ours and translate arguments; the SMC-R work is `smcr`'s.
//!
//! Life of a socket:
//! * `socket(AF_INET, SOCK_STREAM)` → [`Sock::Inet`].
//! * `connect`: marked for the TCP option, then connected. Blocking: negotiated in the call
//!   (`SmcStream::from_connected`). Non-blocking: the application's number gets a socket that
//!   is neither readable nor writable ([`Sock::Pending`]) while a thread waits for the TCP
//!   handshake and negotiates; the number becomes writable only when SMC-R is up or the real
//!   TCP socket is back in place (fallback, or a failed connect whose error SO_ERROR reports).
//! * SMC-R: the TCP socket moves to a hidden high descriptor and the application's number is
//!   one end of a socketpair whose readiness follows the connection ([`Sock::Smc`]). TCP: the
//!   descriptor is forgotten (plain socket, zero cost from then on).
//! * `listen`: marked first; the listening socket moves to a hidden descriptor served by an
//!   acceptor thread that negotiates each connection on a thread of its own; the application's
//!   number is readable while negotiated connections wait ([`Sock::Listener`]), and `accept`
//!   hands them out (SMC-R or TCP), blocking or not as the application asked.
//! * Whenever the file behind an application's number changes, its epoll registrations are
//!   moved to the new file (`epoll.rs`).

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
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
    /// A marked listening socket served by our acceptor.
    Listener(Arc<Listener>),
    /// A non-blocking connect being completed and negotiated in the background.
    Pending(Arc<Pending>),
    /// An SMC-R connection.
    Smc(SmcFd),
    /// One of the above, inherited from the parent process through fork: its connection is
    /// the parent's; the child may close it (nothing is sent) but not use it (EIO).
    Inherited,
}

/// An SMC-R connection at an application descriptor.
pub(crate) struct SmcFd {
    pub(crate) stream: SmcStream,
    /// The application's O_NONBLOCK.
    pub(crate) nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in microseconds (0: none).
    pub(crate) rcvtimeo_us: AtomicU64,
    pub(crate) sndtimeo_us: AtomicU64,
    /// The pair at the application's number (to clear a reset it shows once collected).
    pub(crate) pair: Arc<Pair>,
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
        let r = self.recv_inner(buf, flags);
        self.collect(r)
    }

    fn recv_inner(&self, buf: &mut [u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.rcvtimeo_us);
        let peek = flags & libc::MSG_PEEK != 0;
        if flags & libc::MSG_WAITALL != 0 && !peek {
            // Until the buffer is full, EOF, or an error or the timeout after some data; one
            // SO_RCVTIMEO bounds the whole call, as for TCP.
            let until = Until::new(how);
            let mut got = 0;
            while got < buf.len() {
                let Some(how) = until.left() else { break };
                match self.stream.recv(&mut buf[got..], false, how) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(_) if got > 0 => break,
                    Err(e) => return Err(e),
                }
            }
            return if got == 0 && !buf.is_empty() && until.left().is_none() {
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                Ok(got)
            };
        }
        self.stream.recv(buf, peek, how)
    }

    /// A blocking send takes all of `buf` (TCP returns short only on SO_SNDTIMEO, a signal or
    /// an error after some bytes); a non-blocking one what fits.
    fn send_all(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        if matches!(how, Blocking::No) {
            return self.stream.send(buf, how);
        }
        let until = Until::new(how);
        let mut done = 0;
        while done < buf.len() {
            let Some(how) = until.left() else { break };
            match self.stream.send(&buf[done..], how) {
                Ok(n) => done += n,
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            }
        }
        if done == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(done)
    }

    /// A reset reported to the application is collected: the pair stops showing EPOLLERR.
    fn collect<T>(&self, r: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &r
            && e.kind() == io::ErrorKind::ConnectionReset
        {
            self.pair.take_error();
        }
        r
    }

    pub(crate) fn send(&self, buf: &[u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.sndtimeo_us);
        let r = self.collect(self.send_all(buf, how));
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

/// One deadline for a whole blocking call made of several waits.
struct Until(Option<Option<std::time::Instant>>);

impl Until {
    fn new(how: Blocking) -> Self {
        Self(match how {
            Blocking::No => None,
            Blocking::Yes(t) => Some(t.map(|t| std::time::Instant::now() + t)),
        })
    }

    /// How the next wait may block; `None` once the deadline passed.
    fn left(&self) -> Option<Blocking> {
        match self.0 {
            None => Some(Blocking::No),
            Some(None) => Some(Blocking::Yes(None)),
            Some(Some(d)) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                (!left.is_zero()).then_some(Blocking::Yes(Some(left)))
            }
        }
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
            // A parent's runtime inherited through fork belongs to the parent: dropping it here
            // could send DELETE LINK on the parent's links. Leak it instead.
            if let Some(old) = g.replace((pid, rt.clone())) {
                std::mem::forget(old);
            }
            rt
        }
    }
}

/// Whether the shim is on (`SMCR_DISABLE=1` turns it off).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMCR_DISABLE").map_or(true, |v| v != "1"))
}

/// Whether `SMCR_INCLUDE`/`SMCR_EXCLUDE` let a connection to (or a listener on) `a` use
/// SMC-R. A list that does not parse turns SMC-R off for the process (said once in the log):
/// the user asked to keep some traffic off SMC-R and we cannot tell which.
pub(crate) fn policy_allows(a: std::net::SocketAddrV4) -> bool {
    static P: OnceLock<Option<smcr::policy::Policy>> = OnceLock::new();
    P.get_or_init(|| {
        let _b = Bypass::new();
        match smcr::policy::Policy::from_env() {
            Ok(p) => Some(p),
            Err(e) => {
                log::line(format_args!("{e}; SMC-R is off for this process"));
                None
            }
        }
    })
    .as_ref()
    .is_some_and(|p| p.allows(a))
}

/// The application set an option SMC-R cannot honour before connecting: plain TCP, as Linux's
/// SMC falls back with OPTUNSUPP.
pub(crate) fn unsupported_option(fd: i32, what: &str) {
    untrack(fd);
    log::line(format_args!(
        "fd {fd}: TCP: {what} is not supported with SMC-R (OPTUNSUPP {:#010x})",
        smcr::DeclineReason::OPTUNSUPP.0
    ));
}

/// `fd` stays plain TCP by policy: forget it and say so.
pub(crate) fn exclude(fd: i32, what: &str, a: std::net::SocketAddrV4) {
    untrack(fd);
    log::line(format_args!(
        "fd {fd} {what} {a}: TCP: excluded by SMCR_INCLUDE/SMCR_EXCLUDE [{:#010x}]",
        smcr::FallbackReason::CODE_EXCLUDED
    ));
}

fn is_nonblocking(fd: i32) -> bool {
    // SAFETY: fcntl F_GETFL on any descriptor is harmless.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// The IPv4 address a socket is bound to.
fn local_v4(fd: i32) -> Option<std::net::SocketAddr> {
    // SAFETY: getsockname into a sockaddr_in of the size we pass.
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let r = unsafe { real::getsockname()(fd, (&mut a as *mut libc::sockaddr_in).cast(), &mut len) };
    (r == 0 && i32::from(a.sin_family) == libc::AF_INET).then(|| {
        std::net::SocketAddr::from((
            std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
            u16::from_be(a.sin_port),
        ))
    })
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

/// The socket we put at an application's descriptor number: one end (`app`) of a Unix stream
/// socketpair whose readiness we set, so poll/select/epoll (level- or edge-triggered) report
/// our state with no translation. Readable: bytes wait in `app`'s receive queue, one more for
/// each new arrival so edge-triggered epoll fires again (or the other end, `ours`, shut down
/// writing: EOF, RDHUP). Not writable: `app`'s send side is filled (through our duplicate
/// `app_dup`) until the kernel refuses more. Hung up: `ours` shut down both ways. Reset: `ours`
/// closed while it holds unread bytes, which sets ECONNRESET on `app` (EPOLLERR) until the
/// application collects the error.
pub(crate) struct Pair {
    /// A duplicate of the application's end (same open file), for draining and filling.
    app_dup: OwnedFd,
    st: Mutex<PairState>,
}

struct PairState {
    cur: smcr::ReadyState,
    /// Our end (non-blocking); gone once the connection was reset.
    ours: Option<OwnedFd>,
    /// The reset is showing as EPOLLERR and nobody collected it yet.
    error_pending: bool,
}

impl Pair {
    /// A new pair, starting neither readable nor writable; the application's end is returned
    /// (at a hidden number, for the caller to place).
    fn new() -> io::Result<(OwnedFd, Arc<Self>)> {
        let last = || io::Error::last_os_error();
        // SAFETY: plain descriptor calls on descriptors we create.
        unsafe {
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
            // Both ends move out of the application's range at once, so that the number the
            // application gets (accept: the lowest free one) is the one a socket would get.
            let app = {
                let h = hide(app.as_raw_fd())?;
                drop(app);
                h
            };
            let app_dup = hide(app.as_raw_fd())?;
            let ours = {
                let h = hide(ours.as_raw_fd())?;
                drop(ours);
                h
            };
            let p = Arc::new(Self {
                app_dup,
                st: Mutex::new(PairState {
                    cur: smcr::ReadyState {
                        writable: true,
                        ..Default::default()
                    },
                    ours: Some(ours),
                    error_pending: false,
                }),
            });
            // A fresh socketpair end is writable: make it not.
            p.set(smcr::ReadyState::default());
            Ok((app, p))
        }
    }

    pub(crate) fn set(&self, now: smcr::ReadyState) {
        let _b = Bypass::new();
        let mut st = self.st.lock();
        let cur = st.cur;
        st.cur = now;
        let Some(o) = st.ours.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        let a = self.app_dup.as_raw_fd();
        let mut buf = [0u8; 1024];
        // SAFETY (all calls below): descriptors we own; MSG_DONTWAIT so the application's
        // O_NONBLOCK (shared with `app_dup`) never makes us block.
        unsafe {
            if !cur.rdhup {
                if now.readable && (!cur.readable || now.arrivals != cur.arrivals) {
                    // Readable, or a new arrival while readable: a wake-up for epoll (ET).
                    real::send()(o, b"r".as_ptr().cast(), 1, libc::MSG_DONTWAIT);
                } else if !now.readable && cur.readable {
                    drain(a, &mut buf);
                }
            }
            if now.writable != cur.writable {
                if now.writable {
                    drain(o, &mut buf);
                } else {
                    while real::send()(a, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) > 0 {}
                }
            }
            if now.error && !cur.error {
                // A byte left unread in `ours`, then `ours` closed: the kernel marks `app`
                // ECONNRESET (EPOLLERR) and hung up, with EPOLLIN and EPOLLOUT, as a reset
                // TCP socket shows.
                real::send()(a, b"e".as_ptr().cast(), 1, libc::MSG_DONTWAIT);
                st.ours = None;
                st.error_pending = true;
                return;
            }
            if now.rdhup && !cur.rdhup {
                real::shutdown()(o, libc::SHUT_WR);
            }
            if now.hup && !cur.hup {
                real::shutdown()(o, libc::SHUT_RD);
            }
        }
    }

    /// The application collected the reset (a read or write failed with it, or SO_ERROR):
    /// EPOLLERR stops, as for a TCP socket. Returns whether it was still pending.
    pub(crate) fn take_error(&self) -> bool {
        let mut st = self.st.lock();
        if !std::mem::replace(&mut st.error_pending, false) {
            return false;
        }
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading (and so clearing) SO_ERROR of our duplicate into an int.
        unsafe {
            real::getsockopt()(
                self.app_dup.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        true
    }

    /// One more queued connection on a listener that is already readable: a new wake-up for
    /// edge-triggered epoll.
    pub(crate) fn pulse(&self) {
        let _b = Bypass::new();
        let st = self.st.lock();
        if st.cur.readable
            && let Some(o) = &st.ours
        {
            // SAFETY: our descriptor, a one-byte buffer, never blocking.
            unsafe { real::send()(o.as_raw_fd(), b"r".as_ptr().cast(), 1, libc::MSG_DONTWAIT) };
        }
    }
}

/// Empties the receive queue of `fd` (ours, non-blocking calls). Every sender holds the
/// pair's lock, as the caller does, so a short read means the queue is empty: no second call
/// to find that out.
fn drain(fd: i32, buf: &mut [u8]) {
    loop {
        // SAFETY: receiving into our buffer from our descriptor, never blocking.
        let n = unsafe { real::recv()(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < buf.len() as isize {
            return;
        }
    }
}

/// The connection's readiness, through the pair.
struct PairSink(Arc<Pair>);

impl smcr::Readiness for PairSink {
    fn update(&self, now: smcr::ReadyState) {
        self.0.set(now);
    }
}

/// Moves a descriptor of ours out of the application's range (close-on-exec).
fn hide(fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: duplicating a descriptor we own; the result is ours alone.
    let h = unsafe { real::fcntl()(fd, libc::F_DUPFD_CLOEXEC, HIDDEN_MIN as libc::c_ulong) };
    if h < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(h) })
}

/// Puts `file` at the application's number `fd`, moving the epoll registrations the
/// application made for `fd` to the new file; `then` (the table update) runs before the
/// application's next `epoll_ctl` on `fd` (`epoll::swap`). A pair (`ours`) is always
/// close-on-exec, the flag the application set being kept as its view; a socket handed back
/// gets the application's flag for real.
fn replace(fd: i32, file: i32, ours: bool, then: impl FnOnce()) -> io::Result<()> {
    let cloexec = app_cloexec(fd);
    table::set_cloexec_view(fd, cloexec);
    let flags = if ours || cloexec { libc::O_CLOEXEC } else { 0 };
    crate::epoll::swap(fd, file, flags, then)
}

/// Whether a file of ours is at the application's number `fd` (a pair, not the TCP socket).
pub(crate) fn shows_pair(s: &Sock) -> bool {
    matches!(s, Sock::Smc(_) | Sock::Listener(_) | Sock::Pending(_))
}

/// The close-on-exec flag as the application sees it.
pub(crate) fn app_cloexec(fd: i32) -> bool {
    if table::get_any(fd).is_some_and(|s| shows_pair(&s)) {
        return table::cloexec_view(fd);
    }
    // SAFETY: reading descriptor flags.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFD, 0) };
    fl >= 0 && fl & libc::FD_CLOEXEC != 0
}

/// `fd` is plain from now on (or gone): not ours, no registrations kept.
pub(crate) fn untrack(fd: i32) -> Option<Arc<Sock>> {
    let s = table::remove(fd);
    crate::epoll::forget(fd);
    s
}

/// An SMC-R connection to show through `pair`.
fn smc_fd(stream: SmcStream, nonblock: bool, pair: Arc<Pair>) -> Arc<Sock> {
    Arc::new(Sock::Smc(SmcFd {
        stream,
        nonblock: AtomicBool::new(nonblock),
        rcvtimeo_us: AtomicU64::new(0),
        sndtimeo_us: AtomicU64::new(0),
        pair,
    }))
}

/// Makes the pair follow the connection's readiness. Called once the number is ours in the
/// table: an application woken by the pair must find its calls going to SMC-R.
fn follow(sock: &Sock) {
    if let Sock::Smc(c) = sock {
        c.stream.set_readiness(Box::new(PairSink(c.pair.clone())));
    }
}

/// Makes `fd` (currently the application's TCP socket) an SMC-R connection: a pair at its
/// number, the TCP socket hidden in `stream`.
fn take_over(fd: i32, stream: SmcStream) -> io::Result<()> {
    let nonblock = is_nonblocking(fd);
    let (app, pair) = Pair::new()?;
    replace(fd, app.as_raw_fd(), true, || {})?;
    drop(app);
    if nonblock {
        // SAFETY: setting a status flag on the application's (new) descriptor.
        unsafe { real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong) };
    }
    let sock = smc_fd(stream, nonblock, pair);
    table::insert(fd, sock.clone());
    follow(&sock);
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

/// Marks `fd` for the TCP option (before `connect` or `listen`).
pub(crate) fn mark(fd: i32) -> bool {
    let _b = Bypass::new();
    runtime().mark(borrowed(fd))
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
                // Plain TCP from now on; our duplicate closes, the stats row stays.
                untrack(fd);
                s.hand_over(&rt, fd);
                Ok(())
            }
        }
        Err(e) => {
            log::line(format_args!(
                "fd {fd} connect {peer:?}: handshake failed: {e}"
            ));
            untrack(fd);
            Err(errno_of(&e))
        }
    }
}

/// A non-blocking connect in progress.
pub(crate) struct Pending {
    /// The application closed its descriptor: install nothing.
    cancelled: AtomicBool,
    /// Serialises the outcome against `close`.
    lock: Mutex<()>,
    /// The TCP socket (the application's number shows the pair meanwhile).
    tcp: OwnedFd,
}

impl Pending {
    /// The TCP socket, for SO_ERROR and addresses while pending.
    pub(crate) fn tcp_fd(&self) -> i32 {
        self.tcp.as_raw_fd()
    }

    /// The application closed the descriptor.
    pub(crate) fn cancel(&self) {
        let _g = self.lock.lock();
        self.cancelled.store(true, Ordering::Release);
    }
}

/// The application's non-blocking `connect` returned EINPROGRESS (or succeeded at once):
/// hide the socket, show a pair that is not ready, and finish in the background.
pub(crate) fn connect_async(fd: i32, marked: bool) -> io::Result<()> {
    let _b = Bypass::new();
    let tcp = hide(fd)?;
    let (app, pair) = Pair::new()?;
    replace(fd, app.as_raw_fd(), true, || {})?;
    drop(app);
    // SAFETY: the application's socket was non-blocking; its new descriptor is too.
    unsafe { real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong) };
    let pending = Arc::new(Pending {
        cancelled: AtomicBool::new(false),
        lock: Mutex::new(()),
        tcp,
    });
    table::insert(fd, Arc::new(Sock::Pending(pending.clone())));
    std::thread::Builder::new()
        .name("smcr-connect".into())
        .spawn(move || {
            let _b = Bypass::new();
            finish_connect(fd, marked, &pending, pair);
        })?;
    Ok(())
}

fn finish_connect(fd: i32, marked: bool, pending: &Pending, pair: Arc<Pair>) {
    let t = pending.tcp.as_raw_fd();
    // Wait for the kernel's TCP handshake.
    let mut p = libc::pollfd {
        fd: t,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: polling our own descriptor.
    unsafe { libc::poll(&mut p, 1, 75_000) };
    let put_back = |why: &str| {
        // The real socket returns to the application's number (its SO_ERROR, if any, is
        // still pending for the application to read).
        let _g = pending.lock.lock();
        if !pending.cancelled.load(Ordering::Acquire) {
            // The socket first, then the number stops being ours: until then reads and writes
            // reach whatever file is at the number (the pair, not ready, or the socket).
            let _ = replace(fd, t, false, || {
                table::remove(fd);
            });
        }
        log::line(format_args!("fd {fd} connect: {why}"));
    };
    if p.revents & (libc::POLLERR | libc::POLLHUP) != 0 || p.revents & libc::POLLOUT == 0 {
        // Failed (or timed out): the socket goes back with its error unread, for the
        // application's SO_ERROR (reading it here would clear it).
        return put_back(&format!(
            "TCP connect failed (poll revents {:#x})",
            p.revents
        ));
    }
    let rt = runtime();
    let Ok(dup) = hidden_dup(t) else {
        return put_back("TCP (out of descriptors)");
    };
    let peer = dup.peer_addr().ok();
    match SmcStream::from_connected(&rt, dup, marked) {
        Ok(s) if matches!(s.mode(), Mode::SmcR { .. }) => {
            let _g = pending.lock.lock();
            log::line(format_args!(
                "fd {fd} connect {peer:?}: {}",
                describe(s.mode())
            ));
            if pending.cancelled.load(Ordering::Acquire) {
                return;
            }
            // Ours before the pair turns writable: an application woken by the writability
            // must find its writes going to SMC-R, not into the pair.
            let sock = smc_fd(s, true, pair);
            table::insert(fd, sock.clone());
            follow(&sock);
        }
        Ok(s) => {
            put_back(&format!("{peer:?}: {}", describe(s.mode())));
            if !pending.cancelled.load(Ordering::Acquire) {
                s.hand_over(&rt, fd);
            }
        }
        Err(e) => {
            // The TCP stream carried CLC: it cannot become plain TCP. Show the failure.
            let _g = pending.lock.lock();
            log::line(format_args!(
                "fd {fd} connect {peer:?}: handshake failed: {e}"
            ));
            if pending.cancelled.load(Ordering::Acquire) {
                return;
            }
            // SAFETY: resetting our TCP socket (SO_LINGER 0 + shutdown) makes its SO_ERROR and
            // reads report the failure once it is back at the application's number.
            unsafe { real::shutdown()(t, libc::SHUT_RDWR) };
            let _ = replace(fd, t, false, || {
                table::remove(fd);
            });
        }
    }
}

/// A marked listening socket: our acceptor negotiates, the application accepts the results.
pub(crate) struct Listener {
    /// The real listening socket (blocking; the application's number shows `pair`).
    tcp: OwnedFd,
    queue: Mutex<std::collections::VecDeque<Ready>>,
    cond: parking_lot::Condvar,
    pair: Arc<Pair>,
    closed: AtomicBool,
    /// Its row in the stats area (`smc-stat -l`), until the application closes it.
    stat: Mutex<Option<smcr::ListenerRecord>>,
}

/// A negotiated connection waiting for `accept`.
enum Ready {
    /// SMC-R (its TCP socket hidden in the stream).
    Smc(SmcStream),
    /// Plain TCP (a hidden descriptor, and the stream that holds its stats row).
    Tcp(OwnedFd, SmcStream),
}

impl Listener {
    /// The real listening socket, for addresses and options.
    pub(crate) fn tcp_fd(&self) -> i32 {
        self.tcp.as_raw_fd()
    }

    fn ready_state(&self, nonempty: bool) {
        self.pair.set(smcr::ReadyState {
            readable: nonempty,
            ..Default::default()
        });
    }

    /// The application closed the listener: stop accepting; queued connections close.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.stat.lock().take();
        // SAFETY: shutting down our listening socket wakes the acceptor's accept().
        unsafe { real::shutdown()(self.tcp.as_raw_fd(), libc::SHUT_RDWR) };
        self.queue.lock().clear();
        self.cond.notify_all();
    }

    /// The application's accept: the next negotiated connection at a new descriptor, with
    /// `flags` (SOCK_NONBLOCK, SOCK_CLOEXEC) applied.
    pub(crate) fn accept(&self, app_fd: i32, flags: i32) -> io::Result<i32> {
        let r = {
            let mut q = self.queue.lock();
            loop {
                if let Some(r) = q.pop_front() {
                    self.ready_state(!q.is_empty());
                    break r;
                }
                if self.closed.load(Ordering::Acquire) {
                    return Err(io::Error::from_raw_os_error(libc::EINVAL));
                }
                if is_nonblocking(app_fd) {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                self.cond.wait(&mut q);
            }
        };
        let cloexec = flags & libc::SOCK_CLOEXEC != 0;
        let nonblock = flags & libc::SOCK_NONBLOCK != 0;
        let place = |file: i32, ours: bool| -> io::Result<i32> {
            let cmd = if cloexec || ours {
                libc::F_DUPFD_CLOEXEC
            } else {
                libc::F_DUPFD
            };
            // SAFETY: duplicating our descriptor to the lowest free number, as accept would.
            let n = unsafe { real::fcntl()(file, cmd, 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as accept4 with SOCK_NONBLOCK would (O_NONBLOCK of the new file only).
            let fl = unsafe { real::fcntl()(n, libc::F_GETFL, 0) };
            let fl = if nonblock {
                fl | libc::O_NONBLOCK
            } else {
                fl & !libc::O_NONBLOCK
            };
            // SAFETY: as above.
            unsafe { real::fcntl()(n, libc::F_SETFL, fl as libc::c_ulong) };
            Ok(n)
        };
        match r {
            Ready::Tcp(fd, s) => {
                let n = place(fd.as_raw_fd(), false)?;
                s.hand_over(&runtime(), n);
                Ok(n)
            }
            Ready::Smc(s) => {
                let (app, pair) = Pair::new()?;
                let n = place(app.as_raw_fd(), true)?;
                table::set_cloexec_view(n, cloexec);
                drop(app);
                let sock = smc_fd(s, nonblock, pair);
                crate::epoll::forget(n);
                table::insert(n, sock.clone());
                follow(&sock);
                Ok(n)
            }
        }
    }
}

/// After the application's `listen` on a marked socket: hide the listening socket behind a
/// pair and start the acceptor.
pub(crate) fn take_over_listener(fd: i32) -> io::Result<()> {
    let _b = Bypass::new();
    let tcp = hide(fd)?;
    let nonblock = is_nonblocking(fd);
    // Our acceptor blocks; the application's blocking mode now lives on its pair end.
    // SAFETY: clearing O_NONBLOCK on the listening socket (only we reach it from now on).
    unsafe {
        let fl = real::fcntl()(tcp.as_raw_fd(), libc::F_GETFL, 0);
        real::fcntl()(
            tcp.as_raw_fd(),
            libc::F_SETFL,
            (fl & !libc::O_NONBLOCK) as libc::c_ulong,
        );
    }
    let (app, pair) = Pair::new()?;
    replace(fd, app.as_raw_fd(), true, || {})?;
    drop(app);
    if nonblock {
        // SAFETY: the application's listener was non-blocking; its new descriptor is too.
        unsafe { real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong) };
    }
    let local = local_v4(tcp.as_raw_fd());
    let l = Arc::new(Listener {
        tcp,
        queue: Mutex::new(std::collections::VecDeque::new()),
        cond: parking_lot::Condvar::new(),
        pair,
        closed: AtomicBool::new(false),
        stat: Mutex::new(local.and_then(|a| runtime().listener_record(a))),
    });
    table::insert(fd, Arc::new(Sock::Listener(l.clone())));
    std::thread::Builder::new()
        .name("smcr-accept".into())
        .spawn(move || {
            let _b = Bypass::new();
            acceptor(fd, &l);
        })?;
    Ok(())
}

fn acceptor(fd: i32, l: &Arc<Listener>) {
    loop {
        // SAFETY: accepting on our listening socket.
        let c = unsafe {
            real::accept4()(
                l.tcp.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if c < 0 {
            let e = crate::guard::errno();
            if l.closed.load(Ordering::Acquire) {
                return;
            }
            if e == libc::EINTR || e == libc::ECONNABORTED || e == libc::EAGAIN {
                continue;
            }
            log::line(format_args!(
                "listener fd {fd}: accept failed ({e}); stopping"
            ));
            return;
        }
        // SAFETY: a new descriptor of ours.
        let low = unsafe { OwnedFd::from_raw_fd(c) };
        let Ok(conn) = hide(low.as_raw_fd()) else {
            continue;
        };
        drop(low);
        let rt = runtime();
        let Ok(dup) = conn.try_clone() else { continue };
        // A peer that cannot negotiate (no SMC-R option in its SYN) is served here: no thread,
        // no wait (issue 7: a fallback costs about what plain TCP costs).
        let tcp = match SmcStream::accept_fallback(&rt, TcpStream::from(dup)) {
            Ok(s) => {
                log::line(format_args!(
                    "fd {fd} accept {:?}: {}",
                    s.peer_addr().ok(),
                    describe(s.mode())
                ));
                enqueue(l, Ready::Tcp(conn, s));
                continue;
            }
            Err(tcp) => tcp,
        };
        let l = l.clone();
        crate::workers::run(move || {
            let rt = runtime();
            let peer = tcp.peer_addr().ok();
            let ready = match SmcStream::from_accepted(&rt, tcp) {
                Ok(s) => {
                    log::line(format_args!(
                        "fd {fd} accept {peer:?}: {}",
                        describe(s.mode())
                    ));
                    if matches!(s.mode(), Mode::SmcR { .. }) {
                        Ready::Smc(s)
                    } else {
                        Ready::Tcp(conn, s)
                    }
                }
                Err(e) => {
                    // As Linux: the application never sees a connection that failed.
                    log::line(format_args!(
                        "fd {fd} accept {peer:?}: handshake failed: {e}"
                    ));
                    return;
                }
            };
            enqueue(&l, ready);
        });
    }
}

/// Queues a negotiated connection for the application's `accept` and shows the listener
/// readable.
fn enqueue(l: &Listener, ready: Ready) {
    let mut q = l.queue.lock();
    if l.closed.load(Ordering::Acquire) {
        return;
    }
    q.push_back(ready);
    l.ready_state(true);
    if q.len() > 1 {
        // Already readable: a new arrival still wakes edge-triggered epoll.
        l.pair.pulse();
    }
    l.cond.notify_one();
}

/// Whether `fd` is in non-blocking mode.
pub(crate) fn nonblocking(fd: i32) -> bool {
    is_nonblocking(fd)
}

/// The hidden TCP socket's descriptor of an SMC-R fd (for addresses and socket options).
pub(crate) fn tcp_fd(s: &SmcFd) -> i32 {
    s.stream.tcp().as_raw_fd()
}
