//! The socket API: [`SmcStream`] and [`SmcListener`], blocking `Read`/`Write` over SMC-R, or
//! over the TCP connection itself when SMC-R is not possible ([`Mode::Tcp`] with the reason).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cdc::ConnStateFlags;
use clc::{DeclineReason, Gid, RmbSize};
use socket2::{Domain, Socket, Type};

use crate::FallbackReason;
use crate::error::{ConnFailure, SetupError};
use crate::handshake::{self, Endpoint, Event};
use crate::link::{self, CLIENT_CONFIRM_WAIT, CONFIRM_WAIT};
use crate::option::Capability;
use crate::runtime::{ConnShared, ConnStats, LinkGroup, Negotiation, Runtime, roce_mtu};
use crate::stats::StatSlot;

mod api;
mod data;
mod listener;
mod negotiate;
mod records;

pub use data::Blocking;
pub(crate) use listener::Acceptor;
pub use listener::Incoming;
// The parts' helpers, for one another (each part imports `super::*`).
#[allow(unused_imports)]
use {api::*, data::*, listener::*, negotiate::*, records::*};

/// What a stream runs over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// SMC-R: data goes by RDMA WRITE into the peer's RMB.
    SmcR {
        /// This connection created the link group (CONFIRM LINK was exchanged).
        first_contact: bool,
    },
    /// Plain TCP, and why.
    Tcp(FallbackReason),
}

/// A connected stream: SMC-R when both ends could, TCP otherwise.
///
/// Used like [`TcpStream`]: [`Read`] and [`Write`] on the stream and on `&SmcStream` (so an
/// `Arc<SmcStream>` can be read on one thread and written on another), timeouts,
/// non-blocking mode, [`shutdown`](Self::shutdown); [`mode`](Self::mode) tells SMC-R or TCP
/// with the fallback reason. Dropping it closes the connection.
///
/// ```no_run
/// use std::io::{Read, Write};
/// use smcr::{Mode, Runtime, RuntimeConfig, SmcStream};
///
/// let rt = Runtime::new(RuntimeConfig::new());
/// let mut stream = SmcStream::connect(&rt, "192.0.2.1:7878")?;
/// if let Mode::Tcp(reason) = stream.mode() {
///     eprintln!("plain TCP: {reason}");
/// }
/// stream.write_all(b"hello")?;
/// let mut back = [0u8; 5];
/// stream.read_exact(&mut back)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct SmcStream {
    /// Shared with the link group's hang-up watch (`tcpwatch`), which needs the socket open
    /// as long as the connection is attached: one descriptor per connection, not two.
    tcp: Arc<TcpStream>,
    smc: Option<Smc>,
    mode: Mode,
    /// This connection's record in the runtime's stats area (shared by the handles of
    /// [`Self::try_clone`]; freed with the last).
    stat: Option<Arc<StatSlot>>,
    /// Negotiation stage times.
    timeline: Box<Timeline>,
    /// Read and write timeouts in ns (0: none, block), set through `&self` as std's; shared
    /// by the handles, as a socket's options are by duplicated descriptors.
    timeouts: Arc<[std::sync::atomic::AtomicU64; 2]>,
    nonblocking: Arc<std::sync::atomic::AtomicBool>,
    /// One reference per handle ([`Self::try_clone`]): the last one dropped closes the
    /// connection (`None` once dropped).
    handles: Option<Arc<()>>,
}

#[derive(Clone)]
struct Smc {
    conn: Arc<ConnShared>,
    lg: Arc<LinkGroup>,
}

/// Lets an application thread do a link group's work (take and handle its completions) when
/// the group's event descriptor fires, instead of waiting for the group's poller thread to
/// wake and hand each message over: one wake-up per message instead of two. The descriptor is
/// the group's completion-queue *driver* eventfd; it fires, instead of the poller's, when
/// something arrives while a thread sleeps between [`Driver::sleep_begin`] and
/// [`Driver::sleep_end`]. Holding a `Driver` does not keep the group alive.
#[derive(Clone)]
pub struct Driver {
    fd: std::os::fd::RawFd,
    id: u64,
    lg: std::sync::Weak<LinkGroup>,
}

impl Driver {
    /// The descriptor to watch for readability (edge-triggered, exclusive: it is not drained
    /// by everyone). Bracket each wait on it with [`Self::sleep_begin`] and
    /// [`Self::sleep_end`]: only then is it signalled.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.fd
    }

    /// The calling thread is about to sleep on [`Self::fd`]: while it sleeps, the group's
    /// completions wake it (and not the group's poller). `Some(false)`: something had arrived
    /// already and was handled here — do not sleep (no `sleep_end` needed). `None`: the group
    /// is gone.
    ///
    /// `rx`: the same wait also watches [`Self::rx_fd`] (registered edge-triggered) and calls
    /// [`Self::receive`] when it fires. Then, while the thread holds the group, the device's
    /// engine thread leaves the socket to it, and a packet wakes it directly (one wake-up,
    /// not two).
    pub fn sleep_begin(&self, rx: bool) -> Option<bool> {
        self.lg.upgrade().map(|lg| lg.sleep_begin(rx))
    }

    /// The socket the group's packets arrive on (UDP), to watch along with [`Self::fd`];
    /// `None` if the group is gone, uses shared memory only, or is never held (`app_hold`
    /// zero: the engine thread keeps the socket). Several groups may share it. A wait that
    /// does not sleep calls [`Self::receive`] rather than [`Self::progress`]: while the
    /// group is held, nobody else drains the socket.
    pub fn rx_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.lg
            .upgrade()
            .and_then(|lg| lg.rx_fd().map(|fd| fd.as_raw_fd()))
    }

    /// [`Self::rx_fd`] fired: receives what waits there (for every group on the socket) and
    /// handles this group's completions, on the calling thread; never blocks. Returns false
    /// once the group is gone.
    pub fn receive(&self) -> bool {
        match self.lg.upgrade() {
            Some(lg) => {
                lg.receive();
                true
            }
            None => false,
        }
    }

    /// The wait that followed `sleep_begin() == Some(true)` returned after `slept`; `woken`:
    /// [`Self::fd`] fired (this tunes the spinning before sleeps).
    pub fn sleep_end(&self, slept: std::time::Duration, woken: bool) {
        if let Some(lg) = self.lg.upgrade() {
            lg.sleep_end(slept, woken);
        }
    }

    /// The link group's id within this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Makes [`Self::fd`] readable: a thread waiting on it (with the group's other
    /// descriptors of its call) wakes and looks again, for a change no completion brought.
    pub fn kick(&self) {
        if let Some(lg) = self.lg.upgrade() {
            lg.kick_drivers();
        }
    }

    /// Handles what the link group has received, on the calling thread, unless another thread
    /// is doing so; never blocks. Returns false once the group is gone.
    pub fn progress(&self) -> bool {
        match self.lg.upgrade() {
            Some(lg) => {
                lg.progress();
                true
            }
            None => false,
        }
    }
}

/// A listening socket's row in the stats area (`smc-stat -l`), removed when dropped.
pub struct ListenerRecord {
    _slot: StatSlot,
}

impl Runtime {
    /// The TCP option program's per-socket map, when negotiation uses it and it could be
    /// opened (for claims of connections several processes hold: [`crate::option::Claim`]).
    pub fn option_records(&self) -> Option<&crate::option::OptionRecords> {
        match (&self.inner.cfg.negotiation, &self.inner.option) {
            (Negotiation::TcpOption { .. }, Ok(m)) => Some(m),
            _ => None,
        }
    }

    /// Records a listening socket on `local` in the stats area (`None` without an area or a
    /// free slot). Keep it while the socket listens.
    pub fn listener_record(&self, local: SocketAddr) -> Option<ListenerRecord> {
        use crate::stats::conn;
        let area = self.inner.stats.as_ref()?;
        let mut rec = crate::stats::ConnRecord::default();
        rec.words[conn::IN_USE] = 1;
        put_addr(&mut rec, Some(local), false);
        rec.words[conn::STATE] = conn::STATE_LISTEN | 1 << 8;
        rec.words[conn::SINCE] = Timeline::new().unix_ns;
        let slot = area.claim_conn()?;
        area.write_conn(slot, &rec);
        Some(ListenerRecord {
            _slot: StatSlot {
                area: area.clone(),
                slot,
            },
        })
    }
}

/// The handshake roles' shared driver methods.
trait Handshake {
    fn wants(&self) -> usize;
    fn handle_data(&mut self, data: &[u8]) -> usize;
    fn handle_eof(&mut self);
    fn handle_timeout(&mut self, now: Instant);
    fn poll_timeout(&self) -> Option<Instant>;
    fn poll_transmit(&mut self) -> Option<Vec<u8>>;
    fn poll_event(&mut self) -> Option<Event>;
    fn link_failed(&mut self, now: Instant) -> Result<(), handshake::StateError>;
}

macro_rules! impl_handshake {
    ($t:ty) => {
        impl Handshake for $t {
            fn wants(&self) -> usize {
                <$t>::wants(self)
            }
            fn handle_data(&mut self, data: &[u8]) -> usize {
                <$t>::handle_data(self, data)
            }
            fn handle_eof(&mut self) {
                <$t>::handle_eof(self)
            }
            fn handle_timeout(&mut self, now: Instant) {
                <$t>::handle_timeout(self, now)
            }
            fn poll_timeout(&self) -> Option<Instant> {
                <$t>::poll_timeout(self)
            }
            fn poll_transmit(&mut self) -> Option<Vec<u8>> {
                <$t>::poll_transmit(self)
            }
            fn poll_event(&mut self) -> Option<Event> {
                <$t>::poll_event(self)
            }
            fn link_failed(&mut self, now: Instant) -> Result<(), handshake::StateError> {
                <$t>::link_failed(self, now)
            }
        }
    };
}
impl_handshake!(handshake::Client);
impl_handshake!(handshake::Server);

/// Runs the handshake over `tcp` until it has an event; never reads past a CLC message.
/// When each stage of a connection's negotiation happened (ns after `start`, 0: not yet),
/// indexed like the stats record's `T_*` words from `T_OPTION`.
#[derive(Debug, Clone, Copy)]
struct Timeline {
    start: Instant,
    /// Unix time of `start`, ns.
    unix_ns: u64,
    at: [u64; 5],
}

const T_OPTION: usize = 0;
const T_PROPOSAL: usize = 1;
const T_ACCEPT: usize = 2;
const T_CONFIRM: usize = 3;
const T_LINK: usize = 4;

impl Timeline {
    pub(super) fn new() -> Self {
        Self {
            start: Instant::now(),
            unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            at: [0; 5],
        }
    }

    /// Records a stage the first time it is reached.
    pub(super) fn mark(&mut self, stage: usize) {
        if self.at[stage] == 0 {
            self.at[stage] = self.start.elapsed().as_nanos().max(1) as u64;
        }
    }

    /// A CLC message of ours went out (its type is byte 4).
    pub(super) fn sent(&mut self, clc: &[u8]) {
        match clc.get(4) {
            Some(1) => self.mark(T_PROPOSAL),
            Some(2) => self.mark(T_ACCEPT),
            Some(3) => self.mark(T_CONFIRM),
            _ => {}
        }
    }

    /// The handshake reported that a peer's message arrived.
    pub(super) fn event(&mut self, ev: &Event) {
        match ev {
            Event::Proposed { .. } => self.mark(T_PROPOSAL),
            Event::Accepted { .. } => self.mark(T_ACCEPT),
            Event::Established { .. } => self.mark(T_CONFIRM),
            _ => {}
        }
    }
}

fn drive(tcp: &TcpStream, hs: &mut impl Handshake, tl: &mut Timeline) -> io::Result<Event> {
    let mut tcp = tcp;
    // The socket may be non-blocking (the preload negotiates on the application's own
    // socket): wait in poll, never by spinning on EAGAIN.
    let mut buf = [0u8; 1024];
    loop {
        while let Some(b) = hs.poll_transmit() {
            let mut at = 0;
            while at < b.len() {
                match tcp.write(&b[at..]) {
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        wait_fd(tcp, libc::POLLOUT, None)?;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            tl.sent(&b);
        }
        if let Some(ev) = hs.poll_event() {
            tl.event(&ev);
            return Ok(ev);
        }
        let want = hs.wants().min(buf.len());
        if want == 0 {
            return Err(SetupError::Stalled.into());
        }
        let left = hs
            .poll_timeout()
            .map(|t| t.saturating_duration_since(Instant::now()));
        if left.is_some_and(|l| l.is_zero()) || !wait_fd(tcp, libc::POLLIN, left)? {
            hs.handle_timeout(Instant::now());
            continue;
        }
        match tcp.read(&mut buf[..want]) {
            Ok(0) => hs.handle_eof(),
            Ok(n) => {
                hs.handle_data(&buf[..n]);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

/// SO_LINGER is on with a zero timeout (close must reset, not finish).
fn linger_zero(tcp: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut l = libc::linger {
        l_onoff: 0,
        l_linger: 0,
    };
    let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
    // SAFETY: reading SO_LINGER into a linger struct of the right size.
    let r = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&mut l as *mut libc::linger).cast(),
            &mut len,
        )
    };
    r == 0 && l.l_onoff != 0 && l.l_linger == 0
}

/// Waits until `tcp` is ready for `events` (or has an error or hang-up); `false` on timeout.
fn wait_fd(tcp: &TcpStream, events: libc::c_short, timeout: Option<Duration>) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    rdma::cork::end();
    // A signal (the application's thread runs handshakes too) does not restart the wait from
    // the beginning: a periodic timer would otherwise keep a stalled peer's wait going.
    let deadline = timeout.and_then(|t| std::time::Instant::now().checked_add(t));
    let mut p = libc::pollfd {
        fd: tcp.as_raw_fd(),
        events,
        revents: 0,
    };
    loop {
        let ms = match (timeout, deadline) {
            (None, _) => -1,
            (Some(_), None) => i32::MAX,
            // Rounded up: a sub-millisecond remainder must not become a zero-timeout spin.
            (Some(_), Some(d)) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                i32::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
            }
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r >= 0 {
            return Ok(r > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether a client handshake failed because the server answered with bytes that are not CLC:
/// no eye catcher where a message must start, or our own Proposal back (an echo server). The
/// server's program got the Proposal as data: its end was read by a process without smcr, or
/// one that lost the connection's state (see [`FallbackReason::CODE_NOT_CLC`]).
pub fn not_clc(e: &io::Error) -> bool {
    use crate::handshake::Error as H;
    matches!(
        e.get_ref().and_then(|i| i.downcast_ref::<SetupError>()),
        Some(SetupError::Handshake(
            H::Malformed(clc::Error::BadEyecatcher(_))
                | H::Unexpected {
                    got: clc::MsgType::Proposal,
                    ..
                }
        ))
    )
}

fn failed(e: handshake::Error) -> io::Error {
    SetupError::Handshake(e).into()
}

/// The first link of a new group did not come up: the group ends, its never-used
/// connection goes, and the handshake (already told `link_failed`) settles the fallback on the
/// TCP connection — the peer's Decline, or ours with `TIMEOUT_CL` — as Linux does.
/// A first contact waits for its new link (CONFIRM LINK, both ways) before the connection is
/// used: `true` once it is up. Otherwise the handshake is told (it declines) and the stream
/// falls back to TCP with the reason (`false`).
fn await_first_link(
    s: &mut SmcStream,
    lg: &LinkGroup,
    conn: &ConnShared,
    hs: &mut impl Handshake,
    wait: Duration,
) -> io::Result<bool> {
    if lg.wait_up(wait, &s.tcp).is_ok() {
        s.timeline.mark(T_LINK);
        return Ok(true);
    }
    hs.link_failed(Instant::now()).map_err(SetupError::from)?;
    s.mode = Mode::Tcp(link_not_up(s, lg, conn, hs)?);
    Ok(false)
}

fn link_not_up(
    s: &mut SmcStream,
    lg: &LinkGroup,
    conn: &ConnShared,
    hs: &mut impl Handshake,
) -> io::Result<FallbackReason> {
    lg.detach(conn.token);
    lg.give_back(conn.rmb.clone());
    lg.abandon();
    match drive(&s.tcp, hs, &mut s.timeline)? {
        Event::Fallback {
            reason, by_peer, ..
        } => Ok(FallbackReason::Declined { reason, by_peer }),
        Event::Failed(e) => Err(failed(e)),
        other => Err(SetupError::Unexpected(format!("{other:?}")).into()),
    }
}

/// Path MTU of a connected TCP socket (IP_MTU).
fn path_mtu(tcp: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: valid socket fd, and v/len describe a c_int buffer.
    let r = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 && v > 0 { v as u32 } else { 1500 }
}

fn local_v4(tcp: &TcpStream) -> Option<SocketAddrV4> {
    v4_of(tcp.local_addr().ok()?)
}

/// The IPv4 address of `a`: itself, or the IPv4 address a dual-stack (AF_INET6) socket's
/// v4-mapped address (`::ffff:a.b.c.d`) stands for. Native IPv6 addresses have none.
pub fn v4_of(a: SocketAddr) -> Option<SocketAddrV4> {
    match a {
        SocketAddr::V4(a) => Some(a),
        SocketAddr::V6(a) => a
            .ip()
            .to_ipv4_mapped()
            .map(|ip| SocketAddrV4::new(ip, a.port())),
    }
}

fn endpoint(lg: &LinkGroup, rmb: &rdma::MemoryRegion, size: RmbSize, token: u32) -> Endpoint {
    let (gid, mac, qpn, psn, mtu) = lg.local_endpoint();
    Endpoint {
        gid,
        mac,
        qpn,
        initial_psn: psn,
        mtu,
        rmb_rkey: rmb.rkey(),
        rmb_vaddr: rmb.addr(),
        rmb_size: size,
        token,
    }
}

/// A listening socket whose accepted connections negotiate SMC-R.
///
/// Like Linux's SMC listener, negotiation happens off the accepting thread: a background
/// thread takes TCP connections and runs each handshake on a thread of its own, and
/// [`SmcListener::accept`] returns connections whose negotiation has finished (SMC-R or TCP).
/// A connection whose handshake fails (timeout, protocol error) is closed and never returned.
///
/// ```no_run
/// use std::io::{Read, Write};
/// use smcr::{Runtime, RuntimeConfig, SmcListener};
///
/// let rt = Runtime::new(RuntimeConfig::new());
/// let listener = SmcListener::bind(&rt, "0.0.0.0:7878")?;
/// for stream in listener.incoming() {
///     let mut stream = stream?;
///     println!("{:?}", stream.mode()); // SmcR { .. }, or Tcp(reason)
///     let mut buf = [0u8; 4096];
///     let n = stream.read(&mut buf)?;
///     stream.write_all(&buf[..n])?;
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct SmcListener {
    acceptor: Acceptor,
    ready: rdma::locks::Mutex<std::sync::mpsc::Receiver<(SmcStream, SocketAddr)>>,
    nonblocking: std::sync::atomic::AtomicBool,
}
