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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
    let pid = table::pid();
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
    /// The connection's latest state, packed (bit 0 readable, 1 writable, 2 read side hung
    /// up, 3 hung up, 4 error): what our epoll (vepoll.rs) reports, read without a lock.
    latest: AtomicU32,
    /// How often each of those bits rose (the readable one also at each new arrival): an
    /// edge-triggered registration of ours reports again when one of its bits moved.
    rises: [AtomicU32; 5],
    /// Epoll sets that hold the socket as a registration of ours (vepoll.rs): a bit that
    /// rises wakes their waiters.
    watched: Mutex<Vec<i32>>,
    /// poll/select calls in progress that answer for the socket themselves (poll.rs): a bit
    /// that rises elsewhere wakes them through the link group's descriptor.
    pub(crate) polled: AtomicU32,
    /// The connection's link group, to wake those calls (set when the pair starts to follow
    /// the connection).
    driver: std::sync::OnceLock<smcr::Driver>,
}

struct PairState {
    /// What the kernel shows (what was last applied to the pair).
    cur: smcr::ReadyState,
    /// The connection's latest state.
    want: smcr::ReadyState,
    /// Who may look at the pair through the kernel: poll/select calls in progress (our hooks
    /// count them), plus one for good once an epoll set holds it (sticky), or while a
    /// non-blocking connect is pending. Without any, `set` only records the state: a program
    /// that reads and writes without waiting in poll or epoll (or never on this socket) pays
    /// no system call for readiness.
    observers: u32,
    epoll: bool,
    /// Our end (non-blocking); gone once the connection was reset.
    ours: Option<OwnedFd>,
    /// The reset is showing as EPOLLERR and nobody collected it yet.
    error_pending: bool,
}

impl Pair {
    /// A new pair, starting not readable, and writable or not; the application's end is
    /// returned (at a hidden number, for the caller to place).
    fn new(writable: bool) -> io::Result<(OwnedFd, Arc<Self>)> {
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
            let fresh = smcr::ReadyState {
                writable: true,
                ..Default::default()
            };
            let p = Arc::new(Self {
                app_dup,
                latest: AtomicU32::new(pack(fresh)),
                rises: Default::default(),
                watched: Mutex::new(Vec::new()),
                polled: AtomicU32::new(0),
                driver: std::sync::OnceLock::new(),
                st: Mutex::new(PairState {
                    cur: fresh,
                    want: fresh,
                    // A pending connect's pair is looked at (the application waits for its
                    // writability): kept in step from the start.
                    observers: u32::from(!writable),
                    epoll: false,
                    ours: Some(ours),
                    error_pending: false,
                }),
            });
            if !writable {
                // A fresh socketpair end is writable: make it not.
                p.set(smcr::ReadyState::default());
            }
            Ok((app, p))
        }
    }

    /// The connection's state changed: shown at once while someone may look (see
    /// [`PairState::observers`]), else when someone starts to.
    pub(crate) fn set(&self, now: smcr::ReadyState) {
        let mut st = self.st.lock();
        let before = st.want;
        st.want = now;
        let (old, new) = (pack(before), pack(now));
        self.latest.store(new, Ordering::Release);
        let mut rose = new & !old;
        if now.readable && now.arrivals != before.arrivals {
            rose |= 1;
        }
        for (b, r) in self.rises.iter().enumerate() {
            if rose & (1 << b) != 0 {
                r.fetch_add(1, Ordering::AcqRel);
            }
        }
        if st.observers > 0 || st.epoll || !lazy() {
            self.apply(&mut st);
        }
        drop(st);
        if rose != 0 {
            let sets = self.watched.lock().clone();
            if !sets.is_empty() {
                crate::vepoll::kick(&sets);
            }
            if self.polled.load(Ordering::Acquire) > 0
                && !crate::poll::polling()
                && let Some(d) = self.driver.get()
            {
                d.kick();
            }
        }
    }

    /// The packed latest state (see [`Pair::latest`]).
    pub(crate) fn latest(&self) -> u32 {
        self.latest.load(Ordering::Acquire)
    }

    /// The rise counters (see [`Pair::rises`]).
    pub(crate) fn rises(&self) -> [u32; 5] {
        std::array::from_fn(|b| self.rises[b].load(Ordering::Acquire))
    }

    /// The epoll set `epfd` holds (`on`) or no longer holds a registration of ours for the
    /// socket.
    pub(crate) fn watched_by(&self, epfd: i32, on: bool) {
        let mut w = self.watched.lock();
        if on {
            w.push(epfd);
        } else if let Some(i) = w.iter().position(|&e| e == epfd) {
            w.swap_remove(i);
        }
    }

    /// A poll or select is about to look at the pair through the kernel (`true`), or is done
    /// (`false`).
    pub(crate) fn observe(&self, on: bool) {
        let mut st = self.st.lock();
        if on {
            st.observers += 1;
            self.apply(&mut st);
        } else {
            st.observers = st.observers.saturating_sub(1);
        }
    }

    /// An epoll set holds the pair: kept in step from now on.
    pub(crate) fn observe_epoll(&self) {
        let mut st = self.st.lock();
        if !st.epoll {
            st.epoll = true;
            self.apply(&mut st);
        }
    }

    /// Makes the kernel show `want`.
    fn apply(&self, st: &mut PairState) {
        let _b = Bypass::new();
        let (cur, now) = (st.cur, st.want);
        if cur == now {
            return;
        }
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
        if st.want.error {
            // Collected: no EPOLLERR from now on, whether the kernel showed it yet or not.
            st.want.error = false;
            self.latest.store(pack(st.want), Ordering::Release);
        }
        if !std::mem::replace(&mut st.error_pending, false) {
            return false;
        }
        clear_so_error(self.app_dup.as_raw_fd());
        true
    }
}

/// A state packed as [`Pair::latest`] keeps it.
fn pack(s: smcr::ReadyState) -> u32 {
    u32::from(s.readable)
        | u32::from(s.writable) << 1
        | u32::from(s.rdhup) << 2
        | u32::from(s.hup) << 3
        | u32::from(s.error) << 4
}

/// Reads (and so clears) SO_ERROR of `fd`.
fn clear_so_error(fd: i32) {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reading SO_ERROR of our descriptor into an int.
    unsafe {
        real::getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut err as *mut libc::c_int).cast(),
            &mut len,
        )
    };
}

/// Whether pairs are kept in step only while someone may look at them (`SMCR_LAZY_PAIR=off`
/// keeps every pair in step at every change, as before).
fn lazy() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("SMCR_LAZY_PAIR").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "no"))
    })
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
        if let Some(d) = c.stream.driver() {
            let _ = c.pair.driver.set(d);
        }
        c.stream.set_readiness(Box::new(PairSink(c.pair.clone())));
    }
}

/// Makes `fd` (currently the application's TCP socket) an SMC-R connection: a pair at its
/// number, the TCP socket hidden in `stream`.
fn take_over(fd: i32, stream: SmcStream) -> io::Result<()> {
    let nonblock = is_nonblocking(fd);
    // A new connection is writable: so is its pair from the start. The number is ours in the
    // table before the pair shows there, so a write that the writability invites reaches
    // SMC-R, never the pair.
    let (app, pair) = Pair::new(true)?;
    let sock = smc_fd(stream, nonblock, pair);
    // The socket's close-on-exec flag becomes the application's view first (`replace`
    // reads the view once the number is ours).
    table::set_cloexec_view(fd, app_cloexec(fd));
    table::insert(fd, sock.clone());
    if let Err(e) = replace(fd, app.as_raw_fd(), true, || {}) {
        table::insert(fd, Arc::new(Sock::Inet));
        return Err(e);
    }
    drop(app);
    if nonblock {
        // SAFETY: setting a status flag on the application's (new) descriptor.
        unsafe { real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong) };
    }
    if let Sock::Smc(c) = &*sock {
        // Registrations made on the TCP socket moved to the pair: ours where they can be.
        crate::epoll::virtualize(fd, &c.pair);
    }
    follow(&sock);
    Ok(())
}

/// How a connection was negotiated, for the log (formatted only when a line is written).
fn describe(m: &Mode) -> impl std::fmt::Display + '_ {
    struct D<'a>(&'a Mode);
    impl std::fmt::Display for D<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.0 {
                Mode::SmcR {
                    first_contact: true,
                } => f.write_str("SMC-R (new link group)"),
                Mode::SmcR { .. } => f.write_str("SMC-R (link group reused)"),
                Mode::Tcp(r) => write!(f, "TCP: {r} [{:#010x}]", r.code()),
            }
        }
    }
    D(m)
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
    let peer = log::enabled().then(|| tcp.peer_addr().ok()).flatten();
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
    let (app, pair) = Pair::new(false)?;
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
    smcr::thread::spawn("smcr-connect".into(), move || {
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
    let peer = log::enabled().then(|| dup.peer_addr().ok()).flatten();
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
            let sock = smc_fd(s, true, pair.clone());
            table::insert(fd, sock.clone());
            crate::epoll::virtualize(fd, &pair);
            follow(&sock);
            // No longer a pending connect: kept in step only while someone looks.
            pair.observe(false);
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

/// A marked listening socket. The application's number shows an epoll instance that watches
/// the real listening socket (hidden) and `ready` (an eventfd, non-zero while connections
/// wait in `queue`): poll, select and epoll on the number report "acceptable" exactly when
/// either has something. The application's `accept` takes the next connection itself: a peer
/// that sent no SMC-R option is returned at once, as TCP's accept returns it (no other
/// thread, no hand-over: issue 7's fallback goal); one that can negotiate goes to a handshake
/// worker, whose result joins `queue`.
///
/// A *backstop* thread makes sure handshakes do not wait for the application, as Linux's
/// run in the kernel whatever the program does (a program may connect to its own listener
/// before it accepts, or be busy for a while): when connections have been waiting for
/// [`BACKSTOP_GRACE`] and the application took none meanwhile, it accepts them itself (plain
/// ones join `queue`). While the application accepts, the backstop wakes at most once per
/// grace period.
pub(crate) struct Listener {
    /// The real listening socket (non-blocking; only our calls reach it).
    tcp: OwnedFd,
    /// Readable while `queue` is not empty (written once per queued connection, so each
    /// arrival is a new edge for edge-triggered epoll; read back to zero when it empties).
    ready: OwnedFd,
    queue: Mutex<std::collections::VecDeque<Ready>>,
    closed: AtomicBool,
    /// The application's O_NONBLOCK on its number (kept by the fcntl and ioctl hooks): a
    /// blocking accept then waits first and accepts once, as TCP's does in one call.
    pub(crate) nonblock: AtomicBool,
    /// Its row in the stats area (`smc-stat -l`), until the application closes it.
    stat: Mutex<Option<smcr::ListenerRecord>>,
    /// The address it is bound to, unless that is 0.0.0.0 (then each connection's own
    /// address is asked for).
    local: Option<std::net::SocketAddr>,
    /// Connections the application's accepts took from the socket (the backstop watches it
    /// move).
    taken: std::sync::atomic::AtomicU64,
}

/// How long connections may wait in the listening socket's queue, the application accepting
/// none, before the backstop takes them.
const BACKSTOP_GRACE: std::time::Duration = std::time::Duration::from_millis(2);

/// A negotiated connection waiting for `accept`.
enum Ready {
    /// SMC-R (its TCP socket hidden in the stream).
    Smc(SmcStream),
    /// Plain TCP after a decline (a hidden descriptor, and the stream that holds its stats row).
    Tcp(OwnedFd, SmcStream),
}

/// What [`Listener::accept`] gives the application.
pub(crate) struct Accepted {
    pub(crate) fd: i32,
    /// The kernel filled the caller's address buffer (a socket accepted by this call).
    pub(crate) addr_filled: bool,
}

impl Listener {
    /// The real listening socket, for addresses and options.
    pub(crate) fn tcp_fd(&self) -> i32 {
        self.tcp.as_raw_fd()
    }

    /// The application closed the listener: stop accepting; queued connections close.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.stat.lock().take();
        // SAFETY: shutting down our listening socket: threads of the application waiting in
        // its accept wake (the epoll instance reports the hang-up) and see it closed.
        unsafe { real::shutdown()(self.tcp.as_raw_fd(), libc::SHUT_RDWR) };
        self.queue.lock().clear();
    }

    /// The application's accept on its number `app_fd`: the next connection, at the lowest
    /// free descriptor, with `flags` (SOCK_NONBLOCK, SOCK_CLOEXEC) applied. `addr`/`len` are
    /// the caller's, filled by the kernel when the connection is accepted by this call.
    pub(crate) fn accept(
        self: &Arc<Self>,
        app_fd: i32,
        addr: *mut libc::sockaddr,
        len: *mut libc::socklen_t,
        flags: i32,
    ) -> io::Result<Accepted> {
        let _b = Bypass::new();
        let rt = runtime();
        let mut waited = false;
        loop {
            if let Some(r) = self.pop() {
                return Ok(Accepted {
                    fd: place(r, flags)?,
                    addr_filled: false,
                });
            }
            if self.closed.load(Ordering::Acquire) {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            let nonblock = self.nonblock.load(Ordering::Relaxed);
            if !nonblock && !waited {
                // Blocking: wait until something is there (at once if it already is), then
                // look again, our queue first.
                self.wait()?;
                waited = true;
                continue;
            }
            // SAFETY: an all-zero sockaddr_in is valid.
            let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            let mut sl = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            // SAFETY: accepting on our (non-blocking) listening socket into our address
            // buffer, with the caller's flags.
            let c = unsafe {
                real::accept4()(self.tcp.as_raw_fd(), (&raw mut sa).cast(), &mut sl, flags)
            };
            if c >= 0 {
                self.taken.fetch_add(1, Ordering::Relaxed);
                // SAFETY: the kernel filled `sl` bytes of `sa`; the caller's buffer as accept
                // fills it (truncated to its length, the full length reported).
                unsafe { copy_addr(&sa, sl, addr, len) };
                // The peer's address from accept, ours from the listener's when it is bound
                // to one: no system call for the stats row.
                let peer = std::net::SocketAddr::V4(std::net::SocketAddrV4::new(
                    u32::from_be(sa.sin_addr.s_addr).into(),
                    u16::from_be(sa.sin_port),
                ));
                let addrs = self.local.map(|l| (l, peer));
                match SmcStream::accept_verdict(&rt, borrowed(c), addrs) {
                    Err(why) => {
                        log::line(format_args!(
                            "fd {app_fd} accept: {}",
                            describe(&Mode::Tcp(why))
                        ));
                        crate::epoll::forget(c);
                        return Ok(Accepted {
                            fd: c,
                            addr_filled: true,
                        });
                    }
                    Ok(()) => {
                        let conn = hide(c);
                        // SAFETY: the number accept gave us; the socket lives on hidden.
                        unsafe { real::close()(c) };
                        if let Ok(conn) = conn
                            && let Ok(tcp) = conn.try_clone()
                        {
                            self.negotiate(app_fd, conn, TcpStream::from(tcp));
                        }
                    }
                }
                continue;
            }
            match crate::guard::errno() {
                libc::EAGAIN => {}
                // A connection that went away before we took it, as TCP's accept skips it
                // (Linux returns it to the caller only for some protocols).
                libc::ECONNABORTED | libc::EINTR => continue,
                e => return Err(io::Error::from_raw_os_error(e)),
            }
            if nonblock {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            // Another thread took it: wait again.
            waited = false;
        }
    }

    /// Sleeps until a connection waits in the kernel's queue or ours, or the listener shut
    /// down; a signal interrupts it (EINTR), as it interrupts TCP's accept.
    fn wait(&self) -> io::Result<()> {
        // The socket and the eventfd themselves, not the epoll instance that watches them:
        // the socket's wake-up then reaches this thread directly (as a synchronous wake-up,
        // like the one TCP's accept gets), not through the instance's second wake-up.
        let mut p = [self.tcp.as_raw_fd(), self.ready.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: polling our own descriptors.
        if unsafe { real::poll()(p.as_mut_ptr(), 2, -1) } < 0 {
            let e = crate::guard::errno();
            if e == libc::EINTR {
                return Err(io::Error::from_raw_os_error(e));
            }
        }
        Ok(())
    }

    /// The backstop thread (see [`Listener`]).
    fn backstop(self: &Arc<Self>, app_fd: i32) {
        let rt = runtime();
        let readable = |timeout: i32| {
            let mut p = libc::pollfd {
                fd: self.tcp.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polling our own descriptor.
            unsafe { real::poll()(&mut p, 1, timeout) };
            p.revents
        };
        loop {
            if readable(-1) & libc::POLLHUP != 0 {
                // The application shut the socket down (it may listen again): nothing to
                // accept, and poll would not wait.
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
            loop {
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                let seen = self.taken.load(Ordering::Relaxed);
                std::thread::sleep(BACKSTOP_GRACE);
                if readable(0) != libc::POLLIN {
                    break;
                }
                if self.taken.load(Ordering::Relaxed) != seen {
                    // The application is accepting: its turn.
                    continue;
                }
                self.take_all(&rt, app_fd);
            }
        }
    }

    /// The backstop takes every connection waiting in the socket's queue.
    fn take_all(self: &Arc<Self>, rt: &smcr::Runtime, app_fd: i32) {
        loop {
            // SAFETY: accepting on our non-blocking listening socket.
            let c = unsafe {
                real::accept4()(
                    self.tcp.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if c < 0 {
                if crate::guard::errno() == libc::ECONNABORTED {
                    continue;
                }
                return;
            }
            let Ok(conn) = hide(c) else {
                // SAFETY: our descriptor.
                unsafe { real::close()(c) };
                continue;
            };
            // SAFETY: the number accept gave us; the socket lives on at its hidden one.
            unsafe { real::close()(c) };
            let Ok(dup) = conn.try_clone() else { continue };
            match SmcStream::accept_fallback(rt, TcpStream::from(dup)) {
                Ok(s) => {
                    log::line(format_args!(
                        "fd {app_fd} accept (backstop) {:?}: {}",
                        s.peer_addr().ok(),
                        describe(s.mode())
                    ));
                    self.enqueue(Ready::Tcp(conn, s));
                }
                Err(tcp) => self.negotiate(app_fd, conn, tcp),
            }
        }
    }

    /// An accepted socket whose peer can negotiate (`conn`, hidden, and `tcp`, a duplicate):
    /// the server handshake runs on a worker; the result is queued for `accept`.
    fn negotiate(self: &Arc<Self>, app_fd: i32, conn: OwnedFd, tcp: TcpStream) {
        // The handshake waits in poll; an accept's SOCK_NONBLOCK belongs to the application.
        // SAFETY: setting status flags on our own descriptor.
        unsafe { real::fcntl()(conn.as_raw_fd(), libc::F_SETFL, 0) };
        let l = self.clone();
        crate::workers::run(move || {
            let rt = runtime();
            let peer = log::enabled().then(|| tcp.peer_addr().ok()).flatten();
            let ready = match SmcStream::from_accepted(&rt, tcp) {
                Ok(s) => {
                    log::line(format_args!(
                        "fd {app_fd} accept {peer:?}: {}",
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
                        "fd {app_fd} accept {peer:?}: handshake failed: {e}"
                    ));
                    return;
                }
            };
            l.enqueue(ready);
        });
    }

    /// Queues a negotiated connection for the application's `accept`; the number turns (or
    /// stays, with a new edge) readable.
    fn enqueue(&self, ready: Ready) {
        let mut q = self.queue.lock();
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        q.push_back(ready);
        // SAFETY: 8 bytes into our eventfd.
        unsafe {
            real::write()(
                self.ready.as_raw_fd(),
                1u64.to_ne_bytes().as_ptr().cast(),
                8,
            )
        };
    }

    /// The next negotiated connection; the eventfd goes back to zero with the last one.
    fn pop(&self) -> Option<Ready> {
        let mut q = self.queue.lock();
        let r = q.pop_front()?;
        if q.is_empty() {
            let mut b = [0u8; 8];
            // SAFETY: reading our non-blocking eventfd into 8 bytes.
            unsafe { real::read()(self.ready.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
        Some(r)
    }
}

/// Copies an accepted peer's address into the caller's buffer as accept(2) does: at most
/// `*len` bytes, and `*len` set to the address's full length.
///
/// # Safety
/// `addr`/`len` are null or the caller's valid buffer and length, as accept's contract says.
unsafe fn copy_addr(
    sa: &libc::sockaddr_in,
    sl: libc::socklen_t,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) {
    if addr.is_null() || len.is_null() {
        return;
    }
    // SAFETY: per the contract, `len` is valid and `addr` has `*len` writable bytes.
    unsafe {
        let n = (*len).min(sl) as usize;
        std::ptr::copy_nonoverlapping(
            (sa as *const libc::sockaddr_in).cast::<u8>(),
            addr.cast(),
            n,
        );
        *len = sl;
    }
}

/// Puts a negotiated connection at the lowest free descriptor, with accept's `flags`.
fn place(r: Ready, flags: i32) -> io::Result<i32> {
    let cloexec = flags & libc::SOCK_CLOEXEC != 0;
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    let dup_low = |file: i32, ours: bool| -> io::Result<i32> {
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
            let n = dup_low(fd.as_raw_fd(), false)?;
            crate::epoll::forget(n);
            s.hand_over(&runtime(), n);
            Ok(n)
        }
        Ready::Smc(s) => {
            let (app, pair) = Pair::new(true)?;
            let n = dup_low(app.as_raw_fd(), true)?;
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

/// After the application's `listen` on a marked socket: hide the listening socket and show an
/// epoll instance watching it (see [`Listener`]) at the application's number.
pub(crate) fn take_over_listener(fd: i32) -> io::Result<()> {
    let _b = Bypass::new();
    let nonblock = is_nonblocking(fd);
    let tcp = hide(fd)?;
    let last = || io::Error::last_os_error();
    // SAFETY (block): creating and configuring descriptors of our own.
    let (ready, ep) = unsafe {
        // Only our calls reach the socket from now on, and they never wait in accept.
        real::fcntl()(
            tcp.as_raw_fd(),
            libc::F_SETFL,
            libc::O_NONBLOCK as libc::c_ulong,
        );
        let ready = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
        if ready < 0 {
            return Err(last());
        }
        let ready = hide_owned(ready)?;
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if ep < 0 {
            return Err(last());
        }
        let ep = hide_owned(ep)?;
        for watched in [tcp.as_raw_fd(), ready.as_raw_fd()] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: watched as u64,
            };
            if real::epoll_ctl()(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, watched, &mut ev) != 0 {
                return Err(last());
            }
        }
        (ready, ep)
    };
    replace(fd, ep.as_raw_fd(), true, || {})?;
    drop(ep);
    if nonblock {
        // SAFETY: the application's listener was non-blocking; its new descriptor is too.
        unsafe { real::fcntl()(fd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong) };
    }
    let local = local_v4(tcp.as_raw_fd());
    let l = Arc::new(Listener {
        tcp,
        ready,
        queue: Mutex::new(std::collections::VecDeque::new()),
        closed: AtomicBool::new(false),
        nonblock: AtomicBool::new(nonblock),
        stat: Mutex::new(local.and_then(|a| runtime().listener_record(a))),
        local: local.filter(|a| !a.ip().is_unspecified()),
        taken: std::sync::atomic::AtomicU64::new(0),
    });
    table::insert(fd, Arc::new(Sock::Listener(l.clone())));
    smcr::thread::spawn("smcr-accept".into(), move || {
        let _b = Bypass::new();
        l.backstop(fd);
    })?;
    Ok(())
}

/// [`hide`] for a new descriptor of ours: moved out of the application's range.
pub(crate) fn hide_owned(fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let low = unsafe { OwnedFd::from_raw_fd(fd) };
    hide(low.as_raw_fd())
}

/// The application set (or cleared) O_NONBLOCK on a number of ours.
pub(crate) fn set_nonblock(s: &Sock, on: bool) {
    match s {
        Sock::Smc(c) => c.nonblock.store(on, Ordering::Relaxed),
        Sock::Listener(l) => l.nonblock.store(on, Ordering::Relaxed),
        _ => {}
    }
}

/// Whether `fd` is in non-blocking mode.
pub(crate) fn nonblocking(fd: i32) -> bool {
    is_nonblocking(fd)
}

/// The hidden TCP socket's descriptor of an SMC-R fd (for addresses and socket options).
pub(crate) fn tcp_fd(s: &SmcFd) -> i32 {
    s.stream.tcp().as_raw_fd()
}
