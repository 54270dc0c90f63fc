//! What happens to a socket of ours, call by call. The hooks (`hooks.rs`) only decide whether a
//! descriptor is ours and translate arguments; the SMC-R work is `smcr`'s.
//!
//! The application's number always holds the real TCP socket (a connected one, or the
//! listening one): `fstat`, socket options, addresses, `fork` and `exec` see what they would
//! without us. What makes a connection SMC-R is our table entry for the number; our own
//! duplicate of the TCP socket lives out of the application's numbers (`smcr::fdzone`), one
//! descriptor per connection. Readiness is answered by our poll, select and epoll hooks from
//! the connection's state; only when the kernel itself must answer for the socket (an epoll
//! set that is polled or nested, `SMCR_VIRTUAL_EPOLL=off`) does the number get a socketpair
//! end whose readiness we set ([`Pair`]).
//!
//! Life of a socket:
//! * `socket(AF_INET or AF_INET6, SOCK_STREAM)` → [`Sock::Inet`].
//! * `connect`: our duplicate is taken first (no room: the socket stays unmarked, plain TCP
//!   with NOFD), then the socket is marked for the TCP option and connected. The call returns
//!   as TCP's does (a blocking one once the TCP handshake is done, a non-blocking one with
//!   EINPROGRESS); [`Sock::Pending`] while a worker negotiates: writes are staged, reads wait
//!   for the outcome. The server's half may run only once its program uses the connection
//!   (see `accept`), which may be after this program made other connections or, for a
//!   listener of this very program, accepted this one.
//! * `listen`: marked first; the socket stays at the application's number and listens as
//!   usual ([`Sock::Listener`]), in this process and in every process that inherits it
//!   (prefork servers: each worker accepts on it itself).
//! * `accept` (in whichever process calls it): the kernel's connection is returned at once.
//!   A peer that sent no SMC-R option is plain TCP from then on. One that did becomes
//!   [`Sock::Accepted`]: the server side of the CLC handshake runs in the process that first
//!   uses the socket (reads, writes, waits on it) — the accepting process, or the child it
//!   forked for the connection (PostgreSQL, inetd-style servers) — so that the process using
//!   the connection owns its SMC-R state. A connection several processes hold at that moment
//!   stays TCP (SHARED), settled before any byte of the application's.
//! * Whichever process settles a connection records it in the socket's option record
//!   (`smcr::option::Claim`), so every other holder learns it from the socket itself.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use smcr::{Blocking, FallbackReason, Mode, Runtime, RuntimeConfig, SmcStream};

use crate::guard::Bypass;
use crate::{log, real, table};

/// A socket the shim manages.
pub(crate) enum Sock {
    /// A TCP socket (IPv4, or IPv6 that may reach IPv4 peers), not connected or listening yet.
    Inet,
    /// A marked listening socket (at the application's number, shared by every process that
    /// holds it).
    Listener(Arc<Listener>),
    /// A non-blocking connect (or one to a listener of this process) being completed and
    /// negotiated in the background.
    Pending(Arc<Settling>),
    /// An accepted connection whose peer offered SMC-R: negotiated at its first use.
    Accepted(Arc<Settling>),
    /// An SMC-R connection.
    Smc(SmcFd),
    /// An SMC-R connection (or a connect in progress) of another process, inherited through
    /// fork: the child may close it (nothing is sent) but not use it (EIO).
    Inherited,
}

impl Sock {
    /// Whether the entry belongs to the process that made it only (a forked child's copy is
    /// [`Sock::Inherited`]); listeners, accepted connections not negotiated yet and plain
    /// sockets are any holder's.
    pub(crate) fn per_process(&self) -> bool {
        matches!(self, Self::Smc(_) | Self::Pending(_))
    }

    /// The readiness this socket shows through our hooks, if it is ours to answer for.
    pub(crate) fn pair(&self) -> Option<&Arc<Pair>> {
        match self {
            Self::Smc(c) => Some(&c.pair),
            Self::Pending(p) => Some(&p.pair),
            Self::Accepted(a) => Some(&a.pair),
            _ => None,
        }
    }
}

/// An SMC-R connection at an application descriptor.
pub(crate) struct SmcFd {
    pub(crate) stream: SmcStream,
    /// The application's O_NONBLOCK.
    pub(crate) nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in microseconds (0: none).
    pub(crate) rcvtimeo_us: AtomicU64,
    pub(crate) sndtimeo_us: AtomicU64,
    /// The connection's readiness as our hooks report it (and the kernel pair, if any).
    pub(crate) pair: Arc<Pair>,
    /// What the application wrote before the connection was settled, not sent yet: it goes
    /// before anything written later (the settling worker sends it right after installing
    /// the connection; a write that comes first sends it itself).
    preamble: Mutex<Vec<u8>>,
    /// The preamble is sent (the usual case: no lock on the way to a send).
    preamble_sent: AtomicBool,
    /// A shutdown of writing asked for while the preamble was still going: done right after
    /// it (once: whoever swaps it out does it).
    shut_after: AtomicBool,
}

impl SmcFd {
    /// Sends the preamble, if any is left: all of it, waiting as `how` says (as a send
    /// waits for room: without end, or until SO_SNDTIMEO), or what fits now (else
    /// WouldBlock while some is left).
    pub(crate) fn flush_preamble(&self, how: Blocking) -> io::Result<()> {
        if self.preamble_sent.load(Ordering::Acquire) {
            return Ok(());
        }
        let until = Until::new(how);
        let busy = || io::Error::from(io::ErrorKind::WouldBlock);
        let mut p = match how {
            Blocking::No => self.preamble.try_lock().ok_or_else(busy)?,
            Blocking::Yes(None) => self.preamble.lock(),
            Blocking::Yes(Some(t)) => self.preamble.try_lock_for(t).ok_or_else(busy)?,
        };
        while !p.is_empty() {
            let how = until.left().ok_or_else(busy)?;
            let n = self.stream.send(&p, how)?;
            p.drain(..n);
        }
        // SeqCst with `shutdown`'s: one of the two sees the other's flag (Dekker), so the
        // queued end of writing is done exactly once.
        self.preamble_sent.store(true, Ordering::SeqCst);
        drop(p);
        if self.shut_after.swap(false, Ordering::SeqCst) {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }

    /// The application's shutdown: at once, but the end of writing waits (without blocking
    /// the caller) for a preamble still going, as TCP queues its FIN after the data.
    pub(crate) fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        use std::net::Shutdown;
        if self.preamble_sent.load(Ordering::SeqCst) || how == Shutdown::Read {
            return self.stream.shutdown(how);
        }
        if how == Shutdown::Both {
            self.stream.shutdown(Shutdown::Read)?;
        }
        self.shut_after.store(true, Ordering::SeqCst);
        // Sent meanwhile: then it is ours to do (exactly once).
        if self.preamble_sent.load(Ordering::SeqCst)
            && self.shut_after.swap(false, Ordering::SeqCst)
        {
            return self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }

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

    /// A reset reported to the application is collected: the socket stops showing EPOLLERR.
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
        let r = self
            .flush_preamble(how)
            .and_then(|()| self.send_all(buf, how));
        let r = self.collect(r);
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
struct Until(Option<Option<Instant>>);

impl Until {
    fn new(how: Blocking) -> Self {
        Self(match how {
            Blocking::No => None,
            Blocking::Yes(t) => Some(t.map(|t| Instant::now() + t)),
        })
    }

    /// How the next wait may block; `None` once the deadline passed.
    fn left(&self) -> Option<Blocking> {
        match self.0 {
            None => Some(Blocking::No),
            Some(None) => Some(Blocking::Yes(None)),
            Some(Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                (!left.is_zero()).then_some(Blocking::Yes(Some(left)))
            }
        }
    }
}

/// The process's runtime, created on first use, and again in a forked child (whose engine and
/// poller threads did not survive the fork).
/// This process's runtime with its pid (a forked child makes its own).
static RT: OnceLock<Mutex<Option<(u32, Runtime)>>> = OnceLock::new();

pub(crate) fn runtime() -> Runtime {
    let cell = RT.get_or_init(|| Mutex::new(None));
    let mut g = cell.lock();
    let pid = table::pid();
    match &*g {
        Some((p, rt)) if *p == pid => rt.clone(),
        _ => {
            let _b = Bypass::new();
            smcr::fdzone::enable();
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

/// Negotiations running in this process (connects being settled, accepted connections whose
/// server side runs): the end of the process lets them finish first.
static NEGOTIATING: AtomicUsize = AtomicUsize::new(0);

/// How long the end of the process waits for [`NEGOTIATING`] to reach 0 (same host: well
/// under a millisecond each; a kernel peer over TCG: ~50 ms).
const EXIT_NEGOTIATION_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// At `exit`: the kernel would now close the process's sockets; close our SMC-R connections
/// the same way (what they hold is written, then the close goes to the peer), then end the
/// runtime: wait (bounded) for it all to be acknowledged and delete the link groups (DELETE
/// LINK), so that peers neither lose data nor wait out TEST LINK. Only the process that made
/// the runtime: a forked child's copy of its parent's connections is not the child's to close.
pub(crate) fn at_exit() {
    let Some(rt) = RT.get().and_then(|c| {
        let g = c.try_lock()?;
        g.as_ref()
            .filter(|(p, _)| *p == table::pid())
            .map(|(_, rt)| rt.clone())
    }) else {
        return;
    };
    // Negotiations under way finish first (briefly: one whose server side nobody uses would
    // not): the program's own closes at its end may just have set them going, and deleting
    // the groups under them would turn connections about to be SMC-R into errors.
    let until = std::time::Instant::now() + rt.config().exit_drain.min(EXIT_NEGOTIATION_WAIT);
    while NEGOTIATING.load(Ordering::Acquire) > 0 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for fd in table::own_smc_numbers() {
        if let Some(s) = table::remove(fd) {
            drop(s);
        }
    }
    rt.end();
}

/// Whether the shim is on (`SMCR_DISABLE=1` turns it off).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let on = smcr::env::var("SMCR_DISABLE").is_none_or(|v| v != "1");
        if on {
            // Our descriptors stay out of the application's numbers from the first one.
            smcr::fdzone::enable();
        }
        on
    })
}

/// Whether `SMCR_INCLUDE`/`SMCR_EXCLUDE` let a connection to (or a listener on) `a` use
/// SMC-R. A list that does not parse turns SMC-R off for the process (said once in the log):
/// the user asked to keep some traffic off SMC-R and we cannot tell which.
pub(crate) fn policy_allows(a: std::net::SocketAddrV4) -> bool {
    policy().is_some_and(|p| p.allows(a))
}

fn policy() -> Option<&'static smcr::policy::Policy> {
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
}

/// Reads the process's settings now, at load, before the program has threads. Each is
/// initialised lazily behind a `OnceLock`; were a thread of ours the first to read one while
/// the program forks, the child would find that initialisation running for ever.
pub(crate) fn init_settings() {
    let _ = enabled();
    let _ = policy();
    let _ = lazy();
    let _ = RT.get_or_init(|| Mutex::new(None));
    let _ = crate::epoll::app_drive();
    let _ = crate::vepoll::on();
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
        FallbackReason::CODE_EXCLUDED
    ));
}

fn is_nonblocking(fd: i32) -> bool {
    // SAFETY: fcntl F_GETFL on any descriptor is harmless.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Whether `fd` is in non-blocking mode.
pub(crate) fn nonblocking(fd: i32) -> bool {
    is_nonblocking(fd)
}

/// A socket's own address (IPv4, or IPv6 for a dual-stack socket).
fn sock_addr(fd: i32, peer: bool) -> Option<SocketAddr> {
    // SAFETY: an all-zero sockaddr_storage is valid; the kernel fills at most `len` bytes.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let f = if peer {
        real::getpeername()
    } else {
        real::getsockname()
    };
    // SAFETY: as above.
    let r = unsafe { f(fd, (&raw mut ss).cast(), &mut len) };
    (r == 0).then(|| sockaddr_of(&ss, len)).flatten()
}

/// A socket address from what the kernel filled.
pub(crate) fn sockaddr_of(ss: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: an AF_INET address of full length.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::from((
                std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: an AF_INET6 address of full length.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn borrowed(fd: i32) -> BorrowedFd<'static> {
    // SAFETY: used only for the duration of a call while the application holds `fd` open.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Our own duplicate of a socket, out of the application's numbers (close-on-exec).
fn hide(fd: i32) -> io::Result<OwnedFd> {
    smcr::fdzone::place_copy(borrowed(fd))
}

/// [`hide`] for a new descriptor of ours: moved out of the application's range.
pub(crate) fn hide_owned(fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: `fd` is a new descriptor nothing else owns.
    smcr::fdzone::place(unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---- readiness --------------------------------------------------------------------------

/// A connection's readiness as our poll, select and epoll hooks report it: the latest state,
/// packed, and how often each bit rose (edge-triggered registrations report again when one of
/// theirs moved), read without a lock.
///
/// When the kernel must answer for the socket (an epoll set that is polled, selected or
/// nested, or our epoll off), the application's number gets one end of a Unix socketpair
/// whose readiness we set ([`Pair::kernel_end`]): readable while bytes wait in its receive
/// queue (one more per arrival, so edge-triggered epoll fires again) or once our end shut
/// down writing (EOF, RDHUP); not writable while its send side is filled (through our duplicate
/// of it) until the kernel refuses more; hung up when our end shut down both ways; reset
/// (EPOLLERR, ECONNRESET) when our end closes holding unread bytes. Kept in step only while
/// the kernel may be asked.
pub(crate) struct Pair {
    st: Mutex<PairState>,
    /// The connection's latest state, packed (bit 0 readable, 1 writable, 2 read side hung
    /// up, 3 hung up, 4 error).
    latest: AtomicU32,
    /// How often each of those bits rose (the readable one also at each new arrival).
    rises: [AtomicU32; 5],
    /// Epoll sets that hold the socket as a registration of ours (vepoll.rs): a bit that
    /// rises wakes their waiters.
    watched: Mutex<Vec<i32>>,
    /// poll/select calls in progress that answer for the socket themselves (poll.rs), by the
    /// waker eventfd of their thread: a bit that rises on another thread wakes them there
    /// (the link group's descriptor cannot: a thread that handled the group's messages may
    /// drain it before the waiting one looks).
    pollers: Mutex<Vec<i32>>,
    /// The connection's link group, to wake those calls (set when SMC-R is up).
    driver: OnceLock<smcr::Driver>,
}

struct PairState {
    /// What the kernel pair shows (what was last applied to it).
    cur: smcr::ReadyState,
    /// The connection's latest state.
    want: smcr::ReadyState,
    /// poll/select calls looking at the kernel pair (our hooks count them), plus `epoll` for
    /// good once a kernel epoll set holds it.
    observers: u32,
    epoll: bool,
    /// The socketpair, once the kernel must answer for the socket.
    kernel: Option<KernelPair>,
    /// The reset is showing as EPOLLERR and nobody collected it yet.
    error_pending: bool,
}

struct KernelPair {
    /// A duplicate of the application's end (same open file), for draining and filling.
    app_dup: OwnedFd,
    /// Our end (non-blocking); gone once the connection was reset.
    ours: Option<OwnedFd>,
}

impl Pair {
    /// Readiness starting not readable, and writable or not.
    pub(crate) fn new(writable: bool) -> Arc<Self> {
        let s = smcr::ReadyState {
            writable,
            ..Default::default()
        };
        Arc::new(Self {
            latest: AtomicU32::new(pack(s)),
            rises: Default::default(),
            watched: Mutex::new(Vec::new()),
            pollers: Mutex::new(Vec::new()),
            driver: OnceLock::new(),
            st: Mutex::new(PairState {
                cur: s,
                want: s,
                observers: 0,
                epoll: false,
                kernel: None,
                error_pending: false,
            }),
        })
    }

    /// Whether the kernel pair exists (the application's number shows it).
    pub(crate) fn has_kernel(&self) -> bool {
        self.st.lock().kernel.is_some()
    }

    /// Makes the kernel socketpair, showing the current state; returns the application's end
    /// for the caller to put at the application's number(s). `None` when it exists already.
    fn kernel_end(&self) -> io::Result<Option<OwnedFd>> {
        let mut st = self.st.lock();
        if st.kernel.is_some() {
            return Ok(None);
        }
        let _b = Bypass::new();
        let last = || io::Error::last_os_error();
        // SAFETY: plain descriptor calls on descriptors we create.
        let (app, ours) = unsafe {
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
            (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]))
        };
        // Small buffers: filling the application's end takes a few kilobytes.
        let one: libc::c_int = 1;
        // SAFETY: setting options and flags on our new descriptors.
        unsafe {
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
        }
        let ours = smcr::fdzone::place(ours)?;
        let app_dup = hide(app.as_raw_fd())?;
        st.kernel = Some(KernelPair {
            app_dup,
            ours: Some(ours),
        });
        // A fresh pair shows writable, not readable: bring it to the latest state.
        st.cur = smcr::ReadyState {
            writable: true,
            ..Default::default()
        };
        st.observers += 1;
        self.apply(&mut st);
        st.observers -= 1;
        Ok(Some(app))
    }

    /// The connection's state changed: shown through our hooks at once, and through the
    /// kernel pair while someone may look there.
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
        if st.kernel.is_some() && (st.observers > 0 || st.epoll || !lazy()) {
            self.apply(&mut st);
        }
        drop(st);
        if rose != 0 {
            self.wake();
        }
    }

    /// Wakes whoever waits on the socket through our hooks.
    fn wake(&self) {
        let sets = self.watched.lock().clone();
        if !sets.is_empty() {
            crate::vepoll::kick(&sets);
        }
        let pollers = self.pollers.lock();
        if !pollers.is_empty() {
            crate::poll::wake(&pollers);
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

    /// A poll or select call on the thread whose waker is `fd` answers for the socket
    /// (`on`), or no longer does.
    pub(crate) fn polled_by(&self, fd: i32, on: bool) {
        let mut p = self.pollers.lock();
        if on {
            p.push(fd);
        } else if let Some(i) = p.iter().position(|&w| w == fd) {
            p.swap_remove(i);
        }
    }

    /// The connection's link group, once it is SMC-R (its descriptor wakes poll calls).
    pub(crate) fn driver(&self) -> Option<&smcr::Driver> {
        self.driver.get()
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

    /// The epoll sets holding registrations of ours for the socket.
    pub(crate) fn watchers(&self) -> Vec<i32> {
        self.watched.lock().clone()
    }

    /// A poll or select is about to look at the kernel pair (`true`), or is done (`false`).
    pub(crate) fn observe(&self, on: bool) {
        let mut st = self.st.lock();
        if on {
            st.observers += 1;
            self.apply(&mut st);
        } else {
            st.observers = st.observers.saturating_sub(1);
        }
    }

    /// A kernel epoll set holds the pair: kept in step from now on.
    pub(crate) fn observe_epoll(&self) {
        let mut st = self.st.lock();
        if !st.epoll {
            st.epoll = true;
            self.apply(&mut st);
        }
    }

    /// Makes the kernel pair (if any) show `want`.
    fn apply(&self, st: &mut PairState) {
        let _b = Bypass::new();
        let (cur, now) = (st.cur, st.want);
        if cur == now {
            return;
        }
        let Some(k) = st.kernel.as_mut() else {
            return;
        };
        st.cur = now;
        let Some(o) = k.ours.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        let a = k.app_dup.as_raw_fd();
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
                k.ours = None;
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
        if let Some(k) = &st.kernel {
            clear_so_error(k.app_dup.as_raw_fd());
        }
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

/// Whether kernel pairs are kept in step only while someone may look at them
/// (`SMCR_LAZY_PAIR=off` keeps them in step at every change).
fn lazy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !smcr::env::var("SMCR_LAZY_PAIR").is_some_and(|v| matches!(v.as_str(), "off" | "0" | "no"))
    })
}

/// Empties the receive queue of `fd` (ours, non-blocking calls). Every sender holds the
/// pair's lock, as the caller does, so a short read means the queue is empty.
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

/// The kernel must answer for the socket at `fd` (an epoll set of the kernel's, a poll of the
/// kernel's): for an SMC-R connection, the number gets its kernel pair (made now if needed),
/// kept in step from then on. Other sockets of ours show their TCP socket, whose readiness the
/// kernel reports itself. Returns the socket's pair if the number shows one.
pub(crate) fn show_kernel(fd: i32) -> Option<Arc<Pair>> {
    let sock = table::get(fd)?;
    let Sock::Smc(c) = &*sock else {
        return None;
    };
    let pair = c.pair.clone();
    let _b = Bypass::new();
    match pair.kernel_end() {
        Ok(Some(app)) => {
            // Every number showing this connection gets the pair (dup'd numbers share it).
            for n in table::numbers_of(&sock) {
                if let Err(e) = replace(n, app.as_raw_fd(), &sock, || {}) {
                    log::line(format_args!("fd {n}: could not show readiness: {e}"));
                }
            }
            Some(pair)
        }
        Ok(None) => Some(pair),
        Err(e) => {
            log::line(format_args!(
                "fd {fd}: no socketpair for the kernel's view of the connection: {e}"
            ));
            None
        }
    }
}

/// Puts `file` at the application's number `fd`, moving the epoll registrations the
/// application made for `fd` to the new file; `then` (the table update) runs before the
/// application's next `epoll_ctl` on `fd` (`epoll::swap`). A pair (`ours`) is always
/// close-on-exec, the flag the application set being kept as its view.
fn replace(fd: i32, file: i32, sock: &Arc<Sock>, then: impl FnOnce()) -> io::Result<()> {
    let cloexec = app_cloexec(fd);
    table::set_cloexec_view(fd, cloexec);
    let still = || table::get_any(fd).is_some_and(|s| Arc::ptr_eq(&s, sock));
    crate::epoll::swap(fd, file, libc::O_CLOEXEC, still, then)
}

/// Whether the number's close-on-exec flag is the application's view only: an SMC-R
/// connection, or a connect being negotiated (its worker would not survive the exec), is
/// close-on-exec for real (an exec'd image could not serve it: it arrives closed rather than
/// silent), whatever the program sets; one that settles as TCP gets the flag of the view.
pub(crate) fn cloexec_managed(s: &Sock) -> bool {
    matches!(s, Sock::Smc(_) | Sock::Pending(_))
}

/// Sets the real close-on-exec flag of `n`.
fn set_cloexec(n: i32, on: bool) {
    // SAFETY: reading and setting descriptor flags of the application's number.
    let fl = unsafe { real::fcntl()(n, libc::F_GETFD, 0) };
    if fl < 0 {
        return;
    }
    let fl = if on {
        fl | libc::FD_CLOEXEC
    } else {
        fl & !libc::FD_CLOEXEC
    };
    // SAFETY: as above.
    unsafe { real::fcntl()(n, libc::F_SETFD, fl as libc::c_ulong) };
}

/// The application's close-on-exec flag of `n` becomes its view; the number is close-on-exec
/// for real from now on.
fn manage_cloexec(n: i32) {
    // SAFETY: reading and setting descriptor flags of the application's number.
    let fl = unsafe { real::fcntl()(n, libc::F_GETFD, 0) };
    if fl < 0 {
        return;
    }
    table::set_cloexec_view(n, fl & libc::FD_CLOEXEC != 0);
    // SAFETY: as above.
    unsafe { real::fcntl()(n, libc::F_SETFD, (fl | libc::FD_CLOEXEC) as libc::c_ulong) };
}

/// The close-on-exec flag as the application sees it.
pub(crate) fn app_cloexec(fd: i32) -> bool {
    if table::get_any(fd).is_some_and(|s| cloexec_managed(&s)) {
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
fn smc_fd(stream: SmcStream, nonblock: bool, pair: Arc<Pair>, preamble: Vec<u8>) -> Arc<Sock> {
    // Timeouts the application set before the connection was ours (kept by the socket).
    let timeo = |name| {
        // SAFETY: an all-zero timeval is valid; the kernel fills at most `len` bytes.
        let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
        // SAFETY: reading a timeval option of our socket.
        let r = unsafe {
            real::getsockopt()(
                stream.tcp().as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&raw mut tv).cast(),
                &mut len,
            )
        };
        if r == 0 {
            tv.tv_sec.max(0) as u64 * 1_000_000 + tv.tv_usec.max(0) as u64
        } else {
            0
        }
    };
    let (rcv, snd) = (timeo(libc::SO_RCVTIMEO), timeo(libc::SO_SNDTIMEO));
    Arc::new(Sock::Smc(SmcFd {
        stream,
        nonblock: AtomicBool::new(nonblock),
        rcvtimeo_us: AtomicU64::new(rcv),
        sndtimeo_us: AtomicU64::new(snd),
        pair,
        preamble_sent: AtomicBool::new(preamble.is_empty()),
        preamble: Mutex::new(preamble),
        shut_after: AtomicBool::new(false),
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
                Mode::Tcp(r) => {
                    write!(f, "TCP: {r} [{:#010x}]", r.code())?;
                    // A decline of ours for a local condition: say which.
                    if let FallbackReason::Declined {
                        reason,
                        by_peer: false,
                    } = r
                        && *reason == smcr::DeclineReason::NOSMCRDEV
                        && let Some(why) = runtime().problem()
                    {
                        write!(f, " ({why})")?;
                    }
                    Ok(())
                }
            }
        }
    }
    D(m)
}

/// Records who settled the connection on the socket itself (see the module docs).
fn claim(rt: &Runtime, fd: BorrowedFd<'_>, smc: bool) {
    if let Some(m) = rt.option_map() {
        let _ = m.claim(fd, smc, table::pid());
    }
}

// ---- connecting ---------------------------------------------------------------------------

/// Marks `fd` for the TCP option (before `listen`).
pub(crate) fn mark(fd: i32) -> bool {
    let _b = Bypass::new();
    runtime().mark(borrowed(fd))
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

/// The most a connection being settled takes from writes before it is settled (as a new TCP
/// connection's send buffer takes them before the peer acknowledges anything).
const STAGE_MAX: usize = 64 * 1024;

/// A connection whose SMC-R negotiation is not settled yet: a non-blocking connect finishing
/// on a worker ([`Sock::Pending`]), or an accepted connection negotiated at its first use
/// ([`Sock::Accepted`]). To the application it is a connected TCP socket (once the TCP
/// handshake is done): writes are staged here (up to [`STAGE_MAX`]) and go out, in order,
/// over whatever the connection settles on; reads wait for it (or say EAGAIN).
pub(crate) struct Settling {
    /// Readiness while settling: writable once TCP is connected and while the stage has room,
    /// never readable; carried over to the SMC-R connection.
    pub(crate) pair: Arc<Pair>,
    st: Mutex<Phase>,
    done: Condvar,
    /// The application's O_NONBLOCK (kept by the fcntl and ioctl hooks).
    pub(crate) nonblock: AtomicBool,
    role: Role,
    /// The process whose worker settles it (once [`State::Running`]): a child that forked
    /// meanwhile holds a copy saying Running with no worker of its own.
    runner: AtomicU32,
}

struct Phase {
    state: State,
    /// The application shut reading or writing down before the connection was settled: done
    /// once it is (writing: after what was staged).
    shut_rd: bool,
    shut_wr: bool,
    /// What the numbers showing the connection became (`None`: plain TCP, no entry): a number
    /// that copied the settling entry meanwhile (`dup` racing the install) takes it on its next
    /// call.
    settled: Option<Arc<Sock>>,
    /// The TCP handshake is done.
    connected: bool,
    /// What the application wrote before the connection was settled.
    staged: Vec<u8>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Accepted, not used yet: nothing started.
    Idle,
    Running,
    Done,
}

enum Role {
    Client {
        /// Our address: a listener of this process that accepts the connection negotiates
        /// its side at once (the program may wait on this end before using that one).
        local: Option<SocketAddr>,
    },
    Server {
        /// The process that accepted it, and how many forks it had made by then: a holder
        /// whose pid differs, or that forked since, may share the socket with another
        /// process.
        pid: u32,
        forks: u64,
        /// A native IPv6 peer (dual-stack listener): declined, NOTIPV4.
        native_v6: bool,
    },
}

/// What a write to a connection being settled did.
pub(crate) enum Staged {
    /// Took this many bytes.
    Took(usize),
    /// Settled meanwhile: write where the connection is now.
    Settled,
    /// Full, and the call must not wait.
    WouldBlock,
    /// Writing was shut down (EPIPE).
    Shut,
}

impl Settling {
    /// The local address of a connect being settled (`None` for an accepted connection).
    pub(crate) fn client_local(&self) -> Option<SocketAddr> {
        match self.role {
            Role::Client { local } => local,
            Role::Server { .. } => None,
        }
    }

    fn new(role: Role, connected: bool, nonblock: bool) -> Arc<Self> {
        if matches!(role, Role::Client { .. }) {
            NEGOTIATING.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(Self {
            pair: Pair::new(connected),
            st: Mutex::new(Phase {
                state: match role {
                    Role::Client { .. } => State::Running,
                    Role::Server { .. } => State::Idle,
                },
                staged: Vec::new(),
                connected,
                shut_rd: false,
                shut_wr: false,
                settled: None,
            }),
            done: Condvar::new(),
            nonblock: AtomicBool::new(nonblock),
            role,
            runner: AtomicU32::new(table::pid()),
        })
    }

    /// The application closes a number of this connection: `remove` runs under the lock that
    /// settling takes (see [`Settling::finish`]).
    pub(crate) fn closing(&self, remove: impl FnOnce()) {
        let _st = self.st.lock();
        remove();
    }

    /// Whether settled; then the entry a number that still shows this settling entry gets
    /// (`None`: plain TCP, no entry).
    pub(crate) fn outcome(&self) -> Option<Option<Arc<Sock>>> {
        let st = self.st.lock();
        (st.state == State::Done).then(|| st.settled.clone())
    }

    /// The application shuts the connection down before it is settled: recorded (done once it
    /// is settled, writing after what was staged), `true`; `false` when it is settled already.
    pub(crate) fn shutdown(&self, how: std::net::Shutdown) -> bool {
        use std::net::Shutdown;
        let mut st = self.st.lock();
        if st.state == State::Done {
            return false;
        }
        st.shut_rd |= matches!(how, Shutdown::Read | Shutdown::Both);
        st.shut_wr |= matches!(how, Shutdown::Write | Shutdown::Both);
        if st.shut_wr {
            // No more writes: not writable (EPIPE) from now on, as TCP shows it.
            drop(st);
            self.pair.set(smcr::ReadyState {
                writable: true,
                ..Default::default()
            });
        }
        true
    }

    /// Reading was shut down before the connection settled: reads say EOF.
    pub(crate) fn read_shut(&self) -> bool {
        self.st.lock().shut_rd
    }

    /// Waits until settled, at most `limit`; whether it is.
    pub(crate) fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut st = self.st.lock();
        while st.state != State::Done {
            if self.done.wait_until(&mut st, deadline).timed_out() {
                return st.state == State::Done;
            }
        }
        true
    }

    /// The application uses the connection at `fd`: an accepted one starts negotiating, in
    /// this process, on a worker (a connect's worker runs already). Whether it is settled.
    pub(crate) fn start(self: &Arc<Self>, fd: i32) -> bool {
        let mut st = self.st.lock();
        let me = table::pid();
        match st.state {
            State::Done => return true,
            State::Running if self.runner.load(Ordering::Acquire) == me => return false,
            State::Running => {
                // A copy forked while the parent negotiated: the parent records the outcome
                // on the socket; this process follows it.
                let parent = self.runner.swap(me, Ordering::AcqRel);
                drop(st);
                let _b = Bypass::new();
                let dup = hide(fd).ok();
                let me2 = self.clone();
                crate::workers::run(move || me2.follow_runner(fd, dup, parent));
                return false;
            }
            State::Idle => {
                st.state = State::Running;
                self.runner.store(me, Ordering::Release);
                NEGOTIATING.fetch_add(1, Ordering::AcqRel);
            }
        }
        drop(st);
        let _b = Bypass::new();
        // Our duplicate, taken on the application's thread while `fd` is surely its socket.
        match hide(fd) {
            Ok(dup) => {
                let me = self.clone();
                crate::workers::run(move || me.settle_accepted(fd, Some(dup)));
                false
            }
            Err(_) => {
                // No room for it: settled here, on the application's number (NOFD).
                self.settle_accepted(fd, None);
                true
            }
        }
    }

    /// Whether the TCP handshake is done (a connect asked again says EISCONN).
    pub(crate) fn tcp_connected(&self) -> bool {
        let st = self.st.lock();
        st.state == State::Done || st.connected
    }

    /// TCP is connected: writable while the stage has room.
    fn connected(&self) {
        let mut st = self.st.lock();
        st.connected = true;
        if st.state != State::Done {
            self.pair.set(smcr::ReadyState {
                writable: st.staged.len() < STAGE_MAX,
                ..Default::default()
            });
        }
    }

    /// The application writes `buf`: staged while there is room. `wait`: a blocking call,
    /// which waits (at most that long: SO_SNDTIMEO) for the connection to settle when the
    /// stage is full.
    pub(crate) fn stage(&self, buf: &[u8], wait: Option<Duration>) -> Staged {
        // (A wait that does not fit an Instant is one without end.)
        let deadline = wait.map(|w| Instant::now().checked_add(w));
        let mut st = self.st.lock();
        loop {
            if st.state == State::Done {
                return Staged::Settled;
            }
            if st.shut_wr {
                return Staged::Shut;
            }
            let room = STAGE_MAX.saturating_sub(st.staged.len());
            if room > 0 && self.pair.latest() & 2 != 0 {
                let n = room.min(buf.len());
                st.staged.extend_from_slice(&buf[..n]);
                if st.staged.len() >= STAGE_MAX {
                    // Full: not writable until it settles.
                    self.pair.set(smcr::ReadyState::default());
                }
                return Staged::Took(n);
            }
            match deadline {
                None => return Staged::WouldBlock,
                Some(None) => self.done.wait(&mut st),
                Some(Some(d)) => {
                    if self.done.wait_until(&mut st, d).timed_out() && st.state != State::Done {
                        return Staged::WouldBlock;
                    }
                }
            }
        }
    }

    /// Installs how the connection ended up (at every number still showing it) and sends what
    /// was staged first, so nothing the application writes later overtakes it.
    fn finish(&self, fd: i32, outcome: Outcome) {
        use std::net::Shutdown;
        let mut st = self.st.lock();
        let staged = std::mem::take(&mut st.staged);
        let shut = match (st.shut_rd, st.shut_wr) {
            (true, true) => Some(Shutdown::Both),
            (true, false) => Some(Shutdown::Read),
            (false, true) => Some(Shutdown::Write),
            (false, false) => None,
        };
        let installed = outcome.apply(fd, &self.pair, staged, shut);
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

    // -- the server side ------------------------------------------------------------------

    fn settle_accepted(&self, fd: i32, dup: Option<OwnedFd>) {
        let _b = Bypass::new();
        let rt = runtime();
        let outcome = self.accepted_outcome(&rt, fd, dup);
        self.finish(fd, outcome);
    }

    /// In a child forked while `parent` settled the connection: waits for the outcome the
    /// parent records on the socket (SMC-R there: not this process's to use; TCP: plain here
    /// too). A parent gone without recording one leaves a connection in an unknown state:
    /// not usable here either.
    fn follow_runner(&self, fd: i32, dup: Option<OwnedFd>, parent: u32) {
        let _b = Bypass::new();
        let rt = runtime();
        let sock = dup.as_ref().map_or(fd, AsRawFd::as_raw_fd);
        let outcome = loop {
            let c = rt
                .option_map()
                .and_then(|m| m.claimed(borrowed(sock)).ok().flatten());
            match c {
                Some(c) if c.smc && c.pid != table::pid() => break Outcome::Foreign,
                Some(c) => {
                    if c.pid != table::pid() {
                        SmcStream::record_follower(&rt, borrowed(fd), true);
                    }
                    break Outcome::Plain(dup);
                }
                None if !alive(parent) || rt.option_map().is_none() => {
                    log::line(format_args!(
                        "fd {fd}: inherited while process {parent} negotiated it, which \
                         recorded no outcome: not usable here"
                    ));
                    break Outcome::Foreign;
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        self.finish(fd, outcome);
    }

    fn accepted_outcome(&self, rt: &Runtime, fd: i32, dup: Option<OwnedFd>) -> Outcome {
        let Role::Server {
            pid,
            forks: at,
            native_v6,
        } = self.role
        else {
            unreachable!("an accepted connection")
        };
        let sock = dup.as_ref().map_or(fd, AsRawFd::as_raw_fd);
        // Another process may hold the socket and use it now too: one decides at a time, and
        // records the decision on the socket before the next looks (only one CLC answer may
        // reach the peer).
        let _lock = (pid != table::pid() || forks() != at)
            .then(|| inode(sock).and_then(ClaimLock::take))
            .flatten();
        // Settled by another holder already (it recorded it on the socket).
        if let Some(c) = rt
            .option_map()
            .and_then(|m| m.claimed(borrowed(sock)).ok().flatten())
        {
            log::line(format_args!(
                "fd {fd}: settled by process {} as {}",
                c.pid,
                if c.smc { "SMC-R" } else { "TCP" }
            ));
            return if c.smc && c.pid != table::pid() {
                Outcome::Foreign
            } else {
                if c.pid != table::pid() {
                    SmcStream::record_follower(rt, borrowed(fd), true);
                }
                Outcome::Plain(dup)
            };
        }
        let local = if native_v6 {
            Some(FallbackReason::NotIpv4)
        } else if shared(pid, at, sock) {
            Some(FallbackReason::Shared)
        } else if dup.is_none() {
            Some(FallbackReason::NoDescriptors)
        } else {
            None
        };
        if let Some(reason) = local {
            let r = SmcStream::decline_local(rt, borrowed(sock), fd, true, true, reason);
            log::line(format_args!("fd {fd} accept: {r:?}"));
            claim(rt, borrowed(sock), false);
            return if r.is_ok() {
                Outcome::Plain(dup)
            } else {
                Outcome::Failed
            };
        }
        let tcp = TcpStream::from(dup.expect("checked above"));
        let peer = log::enabled().then(|| tcp.peer_addr().ok()).flatten();
        match SmcStream::from_accepted(rt, tcp) {
            Ok(s) => {
                log::line(format_args!(
                    "fd {fd} accept {peer:?}: {}",
                    describe(s.mode())
                ));
                let smc = matches!(s.mode(), Mode::SmcR { .. });
                claim(rt, borrowed(sock), smc);
                if smc {
                    Outcome::Smc(s)
                } else {
                    Outcome::Fallback(s)
                }
            }
            Err(e) => {
                // As Linux: a connection whose handshake failed is unusable; here the
                // application already holds it, so it sees it end.
                log::line(format_args!(
                    "fd {fd} accept {peer:?}: handshake failed: {e}"
                ));
                claim(rt, borrowed(sock), false);
                Outcome::Failed
            }
        }
    }
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
    crate::workers::run(move || finish_connect(fd, marked, dup, &s));
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
    let peer = log::enabled().then(|| tcp.peer_addr().ok()).flatten();
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
            } else {
                log::line(format_args!(
                    "fd {fd} connect {peer:?}: handshake failed: {e}"
                ));
            }
            Outcome::Failed
        }
    };
    s.finish(fd, outcome);
}

/// The stream's own TCP socket.
fn tcp_of(s: &SmcStream) -> i32 {
    s.tcp().as_raw_fd()
}

/// How a connection being settled ends.
enum Outcome {
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
    fn apply(
        self,
        fd: i32,
        pair: &Arc<Pair>,
        staged: Vec<u8>,
        shut: Option<std::net::Shutdown>,
    ) -> Option<Arc<Sock>> {
        let numbers = table::numbers_with_pair(pair);
        let rt = runtime();
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
                    crate::vepoll::to_kernel_fd(n, pair);
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
                    crate::vepoll::to_kernel_fd(n, pair);
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

// ---- listening and accepting ------------------------------------------------------------

/// A marked listening socket: at the application's number, shared by every process that
/// holds it. Accepting needs nothing of ours but the option program's verdict per connection.
pub(crate) struct Listener {
    /// Its row in the stats area of the process that listened (`smc-stat -l`), until that
    /// process closes it.
    stat: Mutex<Option<smcr::ListenerRecord>>,
    /// The address it is bound to (`0.0.0.0`/`::` for every address).
    pub(crate) bound: Option<SocketAddr>,
}

impl Listener {
    /// The application closed the listener in the process that made the entry.
    pub(crate) fn close(&self) {
        self.stat.lock().take();
    }
}

/// After the application's `listen` on a marked socket: the number stays the listening
/// socket; the table says its connections may negotiate.
pub(crate) fn listening(fd: i32) {
    let _b = Bypass::new();
    let bound = sock_addr(fd, false);
    let stat = bound.and_then(|a| runtime().listener_record(a));
    table::insert(
        fd,
        Arc::new(Sock::Listener(Arc::new(Listener {
            stat: Mutex::new(stat),
            bound,
        }))),
    );
}

/// The application's `accept4(fd, addr, len, flags)` on a marked listener: the kernel's
/// connection at once; one whose peer offered SMC-R negotiates at its first use.
pub(crate) fn accept(
    fd: i32,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    flags: i32,
) -> i32 {
    // SAFETY: an all-zero sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: accepting on the application's listener into our address buffer, with its flags.
    let c = unsafe { real::accept4()(fd, (&raw mut ss).cast(), &mut sl, flags) };
    if c < 0 {
        return c;
    }
    // SAFETY: the kernel filled `sl` bytes of `ss`; the caller's buffer as accept fills it.
    unsafe { copy_addr(&ss, sl, addr, len) };
    let e = crate::guard::errno();
    let _b = Bypass::new();
    crate::epoll::forget(c);
    let peer = sockaddr_of(&ss, sl);
    let local = table::get_any(fd)
        .and_then(|s| match &*s {
            Sock::Listener(l) => l.bound,
            _ => None,
        })
        .filter(|a| !a.ip().is_unspecified());
    let rt = runtime();
    let addrs = local.zip(peer);
    match SmcStream::accept_verdict(&rt, borrowed(c), addrs) {
        Err(why) => {
            log::line(format_args!(
                "fd {fd} accept {peer:?}: {}",
                describe(&Mode::Tcp(why))
            ));
        }
        Ok(()) => {
            let acc = Settling::new(
                Role::Server {
                    pid: table::pid(),
                    forks: forks(),
                    native_v6: peer.is_some_and(|p| smcr::v4_of(p).is_none()),
                },
                true,
                flags & libc::SOCK_NONBLOCK != 0,
            );
            table::insert(c, Arc::new(Sock::Accepted(acc.clone())));
            // From a connect of this very process: negotiated now (the program may wait on its
            // end of the connection before it uses this one).
            if peer.is_some_and(table::connecting_from) {
                acc.start(c);
            }
        }
    }
    crate::guard::set_errno(e);
    c
}

/// Copies an accepted peer's address into the caller's buffer as accept(2) does: at most
/// `*len` bytes, and `*len` set to the address's full length.
///
/// # Safety
/// `addr`/`len` are null or the caller's valid buffer and length, as accept's contract says.
unsafe fn copy_addr(
    sa: &libc::sockaddr_storage,
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
            (sa as *const libc::sockaddr_storage).cast::<u8>(),
            addr.cast(),
            n,
        );
        *len = sl;
    }
}

/// How long a connection held by several processes at its first use waits for the others to
/// let go (a forking server's parent closes its copy right after the fork) before it is
/// settled as TCP.
const SHARED_GRACE: Duration = Duration::from_millis(250);

/// Whether another process still holds the socket `fd` (after waiting [`SHARED_GRACE`] for
/// it to let go): the accepting process `pid`, for a child that inherited it; the children
/// forked since the `at`th fork, for the accepting process.
fn shared(pid: u32, at: u64, fd: i32) -> bool {
    let me = table::pid();
    let others: Vec<u32> = if pid != me {
        // SAFETY: getppid has no preconditions.
        let mut v = vec![pid, unsafe { libc::getppid() } as u32];
        v.dedup();
        v
    } else if forks() != at {
        children_since(at)
    } else {
        return false;
    };
    let Some(ino) = inode(fd) else { return false };
    let deadline = Instant::now() + SHARED_GRACE;
    loop {
        if !others.iter().any(|&p| p != me && holds(p, ino)) {
            return false;
        }
        if Instant::now() >= deadline {
            log::line(format_args!(
                "socket {ino} is held by processes {others:?} too: it stays TCP"
            ));
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An exclusive lock, across processes, on deciding an accepted connection: `flock` on a
/// file named by the socket's inode in `/dev/shm` (any user may make one there; a lock dies
/// with its process). The file is removed when the lock is let go, after the decision is on
/// the socket: a process that opened it before still gets the lock, and then reads the claim.
struct ClaimLock {
    _file: OwnedFd,
    path: std::ffi::CString,
}

impl ClaimLock {
    fn take(ino: u64) -> Option<Self> {
        let path = std::ffi::CString::new(format!("/dev/shm/smcr-claim-{ino}")).ok()?;
        // SAFETY: opening a file by a valid C string.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o666,
            )
        };
        if fd < 0 {
            log::line(format_args!(
                "socket {ino}: no claim lock ({}): deciding without it",
                io::Error::last_os_error()
            ));
            return None;
        }
        let file = hide_owned(fd).ok()?;
        // SAFETY: our descriptor; other users' processes may hold the socket too (umask).
        unsafe { libc::fchmod(file.as_raw_fd(), 0o666) };
        loop {
            // SAFETY: locking our descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                break;
            }
            if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return None;
            }
        }
        Some(Self { _file: file, path })
    }
}

impl Drop for ClaimLock {
    fn drop(&mut self) {
        // SAFETY: removing our lock file by name (another user's may stay: harmless).
        unsafe { libc::unlink(self.path.as_ptr()) };
    }
}

/// Whether process `pid` exists.
fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The inode of the socket at `fd`.
fn inode(fd: i32) -> Option<u64> {
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Whether process `pid` (alive) has the socket with inode `ino` open. A process whose
/// descriptors we may not read counts as holding it.
fn holds(pid: u32, ino: u64) -> bool {
    if !alive(pid) {
        return false;
    }
    let want = format!("socket:[{ino}]");
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        // Gone meanwhile, or not ours to look at.
        return std::path::Path::new(&format!("/proc/{pid}")).exists();
    };
    dir.flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
}

// ---- fork tracking ------------------------------------------------------------------------

static FORKS: AtomicU64 = AtomicU64::new(0);
/// Children this process forked through `fork` (pid, fork count after it), most recent last.
static CHILDREN: Mutex<Vec<(u32, u64)>> = Mutex::new(Vec::new());

/// Forks made by this process so far.
fn forks() -> u64 {
    FORKS.load(Ordering::Acquire)
}

/// The application forked: `child` in the parent.
pub(crate) fn forked(child: u32) {
    let n = FORKS.fetch_add(1, Ordering::AcqRel) + 1;
    let mut c = CHILDREN.lock();
    // Only recent children matter (those forked while a connection waits for its first use).
    if c.len() >= 256 {
        c.drain(..128);
    }
    c.push((child, n));
}

/// In a forked child: its own fork history starts empty.
pub(crate) fn forked_child() {
    FORKS.store(0, Ordering::Release);
    // The parent's list is not ours; a lock held at fork time may never be released here.
    if let Some(mut c) = CHILDREN.try_lock() {
        c.clear();
    }
}

/// Children forked after the `since`th fork.
fn children_since(since: u64) -> Vec<u32> {
    CHILDREN
        .lock()
        .iter()
        .filter(|&&(_, n)| n > since)
        .map(|&(p, _)| p)
        .collect()
}

// ---- socket options and state through our entries ---------------------------------------

/// The application set (or cleared) O_NONBLOCK on a number of ours.
pub(crate) fn set_nonblock(s: &Sock, on: bool) {
    match s {
        Sock::Smc(c) => c.nonblock.store(on, Ordering::Relaxed),
        Sock::Accepted(a) | Sock::Pending(a) => a.nonblock.store(on, Ordering::Relaxed),
        _ => {}
    }
}

/// The hidden TCP socket's descriptor of an SMC-R fd (for addresses and socket options).
pub(crate) fn tcp_fd(s: &SmcFd) -> i32 {
    s.stream.tcp().as_raw_fd()
}

// ---- sockets inherited through exec ----------------------------------------------------------

/// At start-up (a new program image): TCP sockets inherited from the program that exec'd us —
/// an inetd-style server's accepted connection at fd 0, a listener handed to a new binary —
/// are recognised by their option record: a marked listener is ours to accept on; an accepted
/// connection whose peer offered SMC-R and that nobody settled yet negotiates at its first
/// use here; one another process runs over SMC-R is not ours to use.
pub(crate) fn adopt() {
    if !enabled() {
        return;
    }
    let _b = Bypass::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut map = None;
    // Numbers of one socket (dup2'd onto 0 and 1 by an inetd-style parent) share one entry.
    let mut seen: std::collections::HashMap<u64, Arc<Sock>> = std::collections::HashMap::new();
    for fd in fds {
        if !is_tcp(fd) {
            continue;
        }
        if let Some(s) = inode(fd).and_then(|i| seen.get(&i)) {
            table::insert(fd, s.clone());
            continue;
        }
        let m = match &map {
            Some(m) => m,
            None => {
                let cfg = RuntimeConfig::from_env();
                let smcr::Negotiation::TcpOption { dir } = &cfg.negotiation else {
                    return;
                };
                let Ok(m) = smcr::option::OptionMap::open(dir) else {
                    return;
                };
                map.insert(m)
            }
        };
        let Ok(st) = m.state(borrowed(fd)) else {
            continue;
        };
        if !st.marked() {
            continue;
        }
        let claim = m.claimed(borrowed(fd)).ok().flatten();
        let entry = if listening_socket(fd) {
            let bound = sock_addr(fd, false);
            Arc::new(Sock::Listener(Arc::new(Listener {
                stat: Mutex::new(None),
                bound,
            })))
        } else if let Some(c) = claim {
            if !c.smc {
                continue;
            }
            Arc::new(Sock::Inherited)
        } else if st.connecting() {
            if st.capability() != smcr::option::Capability::PeerCapable {
                continue;
            }
            // A connect whose negotiation the image before this one had begun (its worker
            // did not survive the exec): what it sent is unknown, so neither side's CLC can
            // go on, nor can the bytes be plain TCP.
            log::line(format_args!(
                "fd {fd}: a connect inherited through exec while its SMC-R negotiation ran: \
                 not usable (EIO)"
            ));
            Arc::new(Sock::Inherited)
        } else if st.capability() == smcr::option::Capability::PeerCapable {
            let peer = sock_addr(fd, true);
            let acc = Settling::new(
                Role::Server {
                    // SAFETY: getppid has no preconditions.
                    pid: unsafe { libc::getppid() } as u32,
                    forks: 0,
                    native_v6: peer.is_some_and(|p| smcr::v4_of(p).is_none()),
                },
                true,
                is_nonblocking(fd),
            );
            log::line(format_args!(
                "fd {fd}: an accepted connection from {peer:?} inherited through exec: \
                 negotiated at its first use"
            ));
            Arc::new(Sock::Accepted(acc))
        } else {
            continue;
        };
        table::insert(fd, entry.clone());
        if let Some(i) = inode(fd) {
            seen.insert(i, entry);
        }
    }
}

/// Whether `fd` is a TCP socket (IPv4 or IPv6).
fn is_tcp(fd: i32) -> bool {
    let int = |level, name| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading an int option into an int.
        let r = unsafe { real::getsockopt()(fd, level, name, (&raw mut v).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    matches!(
        int(libc::SOL_SOCKET, libc::SO_DOMAIN),
        Some(libc::AF_INET | libc::AF_INET6)
    ) && int(libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && int(libc::SOL_SOCKET, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Whether `fd` listens.
fn listening_socket(fd: i32) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reading an int option into an int.
    let r = unsafe {
        real::getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut v).cast(),
            &mut len,
        )
    };
    r == 0 && v != 0
}
