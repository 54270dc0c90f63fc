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

use crate::conn::ConnCore;
use crate::error::ConnFailure;
use crate::handshake::{self, Endpoint, Event};
use crate::link::{self, CLIENT_CONFIRM_WAIT, CONFIRM_WAIT};
use crate::option::Capability;
use crate::runtime::{ConnShared, ConnState, LinkGroup, Negotiation, Runtime, roce_mtu};

/// Why a connection is plain TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackReason {
    /// The peer did not send the SMC-R TCP option (Linux: `PEERNOSMC`); no CLC byte was sent.
    PeerNoSmc,
    /// One side declined during the CLC handshake; both agreed to continue over TCP.
    Declined {
        /// The decline code (the peer's diagnosis if it declined, else ours).
        reason: DeclineReason,
        /// Whether the peer declined.
        by_peer: bool,
    },
    /// Local: the TCP option program is not usable here (not installed, no permission).
    NoBpf(String),
    /// Local: we marked the socket but the option program never saw its handshake.
    OptionNotObserved,
    /// Local: not IPv4 (SMC-Rv2 is IPv4 only); a dual-stack socket's IPv4 peer (v4-mapped) is
    /// IPv4.
    NotIpv4,
    /// Local: the process had no descriptor left for SMC-R within its `RLIMIT_NOFILE`
    /// (`rdma::fdzone`). The peer is declined (`MEM`) when it had offered SMC-R.
    NoDescriptors,
    /// Local: the connection was held by more than one process (inherited through `fork`)
    /// when it was first used; one SMC-R connection cannot be served to several processes.
    Shared,
}

/// Codes of our local reasons, outside Linux's `SMC_CLC_DECL_*` space.
impl FallbackReason {
    /// Local code: the option program is not usable.
    pub const CODE_NO_BPF: u32 = 0x7f00_0001;
    /// Local code: marked, but the program did not see the handshake.
    pub const CODE_OPTION_NOT_OBSERVED: u32 = 0x7f00_0002;
    /// Local code: not an IPv4 connection.
    pub const CODE_NOT_IPV4: u32 = 0x7f00_0003;
    /// Local code: kept off SMC-R by the user's policy (`SMCR_INCLUDE`/`SMCR_EXCLUDE`, see
    /// [`crate::policy`]); the preload applies it before the TCP handshake.
    pub const CODE_EXCLUDED: u32 = 0x7f00_0004;
    /// Local code: no descriptor left for SMC-R in the process's limit.
    pub const CODE_NO_FD: u32 = 0x7f00_0005;
    /// Local code: the connection was shared by several processes at its first use.
    pub const CODE_SHARED: u32 = 0x7f00_0006;

    /// A numeric code: Linux's decline codes where they apply, ours (0x7f00_00xx) otherwise.
    pub fn code(&self) -> u32 {
        match self {
            Self::PeerNoSmc => DeclineReason::PEERNOSMC.0,
            Self::Declined { reason, .. } => reason.0,
            Self::NoBpf(_) => Self::CODE_NO_BPF,
            Self::OptionNotObserved => Self::CODE_OPTION_NOT_OBSERVED,
            Self::NotIpv4 => Self::CODE_NOT_IPV4,
            Self::NoDescriptors => Self::CODE_NO_FD,
            Self::Shared => Self::CODE_SHARED,
        }
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerNoSmc => write!(
                f,
                "peer did not offer SMC-R (PEERNOSMC {:#010x})",
                self.code()
            ),
            Self::Declined { reason, by_peer } => write!(
                f,
                "{} declined: {} ({:#010x})",
                if *by_peer { "peer" } else { "we" },
                reason.name().unwrap_or("unknown"),
                reason.0
            ),
            Self::NoBpf(why) => write!(f, "TCP option program unusable: {why}"),
            Self::OptionNotObserved => {
                write!(f, "TCP option program did not see the handshake")
            }
            Self::NotIpv4 => write!(f, "not IPv4"),
            Self::NoDescriptors => write!(
                f,
                "no descriptor left for SMC-R within RLIMIT_NOFILE (NOFD {:#010x})",
                self.code()
            ),
            Self::Shared => write!(
                f,
                "used by several processes (SHARED {:#010x})",
                self.code()
            ),
        }
    }
}

/// Counters of an SMC-R stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Bytes written into the peer's RMB and announced.
    pub bytes_sent: u64,
    /// Bytes read by the application.
    pub bytes_received: u64,
    /// CDCs that announced data (fewer than writes when autocorking coalesced them).
    pub data_cdcs: u64,
    /// `write` calls that moved bytes.
    pub writes: u64,
    /// Times the connection moved to another link of its group (a link failed).
    pub failovers: u64,
}

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
pub struct SmcStream {
    /// Shared with the link group's hang-up watch (`tcpwatch`), which needs the socket open
    /// as long as the connection is attached: one descriptor per connection, not two.
    tcp: Arc<TcpStream>,
    smc: Option<Smc>,
    mode: Mode,
    /// This connection's record in the runtime's stats area.
    stat: Option<StatSlot>,
    /// Negotiation stage times.
    timeline: Box<Timeline>,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    nonblocking: bool,
}

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

/// A claimed record in the stats area, freed with the stream (or, for a socket handed back
/// to the application as plain TCP, when its descriptor is found closed).
pub(crate) struct StatSlot {
    pub(crate) area: Arc<crate::stats::Area>,
    pub(crate) slot: usize,
}

/// A listening socket's row in the stats area (`smc-stat -l`), removed when dropped.
pub struct ListenerRecord {
    _slot: StatSlot,
}

impl Runtime {
    /// The TCP option program's per-socket map, when negotiation uses it and it could be
    /// opened (for claims of connections several processes hold: [`crate::option::Claim`]).
    pub fn option_map(&self) -> Option<&crate::option::OptionMap> {
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

impl Drop for StatSlot {
    fn drop(&mut self) {
        self.area.release_conn(self.slot);
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
    fn new() -> Self {
        Self {
            start: Instant::now(),
            unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            at: [0; 5],
        }
    }

    /// Records a stage the first time it is reached.
    fn mark(&mut self, stage: usize) {
        if self.at[stage] == 0 {
            self.at[stage] = self.start.elapsed().as_nanos().max(1) as u64;
        }
    }

    /// A CLC message of ours went out (its type is byte 4).
    fn sent(&mut self, clc: &[u8]) {
        match clc.get(4) {
            Some(1) => self.mark(T_PROPOSAL),
            Some(2) => self.mark(T_ACCEPT),
            Some(3) => self.mark(T_CONFIRM),
            _ => {}
        }
    }

    /// The handshake reported that a peer's message arrived.
    fn event(&mut self, ev: &Event) {
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
            return Err(io::Error::other("CLC handshake stalled"));
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
    let ms = timeout.map_or(-1, |t| {
        // Rounded up: a sub-millisecond remainder must not become a zero-timeout spin.
        i32::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
    });
    let mut p = libc::pollfd {
        fd: tcp.as_raw_fd(),
        events,
        revents: 0,
    };
    loop {
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

fn failed(e: handshake::Error) -> io::Error {
    let kind = match e {
        handshake::Error::Timeout { .. } => io::ErrorKind::TimedOut,
        handshake::Error::PeerClosed => io::ErrorKind::ConnectionReset,
        _ => io::ErrorKind::InvalidData,
    };
    io::Error::new(kind, e)
}

/// The inode of the socket at `fd` (as `/proc/PID/fd/N` shows it: `socket:[inode]`).
/// The first link of a new group did not come up: the group ends, its never-used
/// connection goes, and the handshake (already told `link_failed`) settles the fallback on the
/// TCP connection — the peer's Decline, or ours with `TIMEOUT_CL` — as Linux does.
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
        other => Err(io::Error::other(format!("unexpected {other:?}"))),
    }
}

pub(crate) fn socket_inode(fd: std::os::fd::RawFd) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat struct; an invalid fd is an error, not UB.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some(st.st_ino)
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

/// What a server handshake holds in a group before its connection exists: the token it
/// reserved (counted against the group's connections; CDCs for it are held) and the RMB it
/// took. Dropped, it gives both back — the RMB to the group's pool, or its budget to the
/// runtime once the group is down — so no return path can forget one.
struct Reserved {
    lg: Arc<LinkGroup>,
    /// `None` once the connection holds it.
    token: Option<u32>,
    rmb: Option<Arc<rdma::MemoryRegion>>,
}

impl Reserved {
    fn new(lg: &Arc<LinkGroup>, token: u32, rmb: Arc<rdma::MemoryRegion>) -> Self {
        lg.reserve(token);
        Self {
            lg: lg.clone(),
            token: Some(token),
            rmb: Some(rmb),
        }
    }

    fn rmb(&self) -> &Arc<rdma::MemoryRegion> {
        self.rmb.as_ref().expect("held until into_conn")
    }

    /// The connection takes the token and the RMB (its `attach` ends the reservation). If it
    /// cannot be made, `make_conn` gave the RMB back and the token is released here.
    fn into_conn(mut self, peer: &Endpoint, tcp: &Arc<TcpStream>) -> io::Result<Arc<ConnShared>> {
        let rmb = self.rmb.take().expect("held until into_conn");
        let token = self.token.expect("held until into_conn");
        let conn = make_conn(&self.lg, token, rmb, peer, tcp)?;
        self.token = None;
        Ok(conn)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(token) = self.token.take() {
            self.lg.unreserve(token);
        }
        if let Some(rmb) = self.rmb.take() {
            self.lg.give_back(rmb);
        }
    }
}

fn make_conn(
    lg: &Arc<LinkGroup>,
    token: u32,
    rmb: Arc<rdma::MemoryRegion>,
    peer: &Endpoint,
    tcp: &Arc<TcpStream>,
) -> io::Result<Arc<ConnShared>> {
    let peer_rmb = peer.rmb_size.bytes();
    let sndbuf = match lg.take_sndbuf(peer_rmb) {
        Ok(b) => b,
        Err(e) => {
            // The RMB's budget goes back (or the RMB to the pool).
            lg.give_back(rmb);
            return Err(e);
        }
    };
    let rmb_len = rmb.len() as u32;
    let c = Arc::new(ConnShared {
        token,
        rmb,
        sndbuf,
        core: parking_lot::Mutex::new(ConnState {
            // The key is for the peer's link of this connection, named by its QPN.
            peer: crate::rtokens::PeerRmb {
                vaddr: peer.rmb_vaddr,
                rkey: peer.rmb_rkey,
                path: lg.path_of_peer_qpn(peer.qpn),
            },
            core: ConnCore::new(peer.token, peer_rmb, rmb_len),
            failed: None,
            local_closed: false,
            released: false,
            staged: 0,
            inflight: 0,
            stats: ConnStats::default(),
            shut_wr: false,
            shut_rd: false,
            reset_reported: false,
            reported: None,
            arrivals: 0,
            stat: None,
            epoch: lg.route().0,
        }),
        cond: parking_lot::Condvar::new(),
        wakes: std::sync::atomic::AtomicU64::new(0),
        lg: Arc::downgrade(lg),
        events: [std::sync::OnceLock::new(), std::sync::OnceLock::new()],
        readiness: std::sync::OnceLock::new(),
    });
    lg.attach(token, c.clone(), Some(tcp.clone()));
    Ok(c)
}

impl SmcStream {
    /// The connection and its link group, when SMC-R.
    #[cfg(feature = "hostile")]
    pub(crate) fn smc_parts(&self) -> Option<(&Arc<ConnShared>, &Arc<LinkGroup>)> {
        self.smc.as_ref().map(|s| (&s.conn, &s.lg))
    }

    /// Connects to `addr` (the first address that accepts a TCP connection), then negotiates
    /// SMC-R; falls back to TCP as Linux would.
    pub fn connect(rt: &Runtime, addr: impl ToSocketAddrs) -> io::Result<Self> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(rt, a) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn connect_one(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        let marked = v4_of(addr).is_some() && mark(rt, &sock, true);
        sock.connect(&addr.into())?;
        Self::from_connected(rt, sock.into(), marked)
    }

    /// Negotiates on a TCP connection the caller connected (`marked`: the socket was marked
    /// with [`Runtime::mark`] before `connect`). Used by the preload shim, whose application
    /// creates and connects the socket itself.
    pub fn from_connected(rt: &Runtime, tcp: TcpStream, marked: bool) -> io::Result<Self> {
        let ipv4 = v4_of(tcp.peer_addr()?).is_some();
        let mut s = Self::plain(tcp, Mode::Tcp(FallbackReason::PeerNoSmc));
        let verdict = verdict(rt, &s.tcp, marked, ipv4);
        s.timeline.mark(T_OPTION);
        match verdict {
            Err(reason) => s.mode = Mode::Tcp(reason),
            Ok(()) => {
                if let Err(e) = s.client_handshake(rt) {
                    rt.inner.handshake_failed();
                    return Err(e);
                }
            }
        }
        s.record(rt, false);
        Ok(s)
    }

    /// Negotiates, as the server, on a TCP connection accepted from a listener that was
    /// marked with [`Runtime::mark`] before `listen`. Blocks for the handshake.
    pub fn from_accepted(rt: &Runtime, tcp: TcpStream) -> io::Result<Self> {
        let peer = tcp.peer_addr()?;
        Self::negotiate_server(rt, tcp, peer)
    }

    /// For an acceptor, before any handshake: when the accepted connection (from a listener
    /// marked with [`Runtime::mark`]) cannot negotiate — its peer sent no SMC-R option, it is
    /// not IPv4, the option program is unusable — the TCP-mode stream at once (recorded and
    /// counted like any fallback). Otherwise `tcp` comes back for [`SmcStream::from_accepted`],
    /// which blocks for the CLC handshake. Lets an acceptor serve plain peers inline, without
    /// a thread per connection.
    pub fn accept_fallback(rt: &Runtime, tcp: TcpStream) -> Result<Self, TcpStream> {
        let Ok(peer) = tcp.peer_addr() else {
            return Err(tcp);
        };
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        // A native IPv6 peer that offered SMC-R goes to the handshake too (to be declined).
        match option_verdict(rt, &tcp, marked) {
            Ok(()) => Err(tcp),
            Err(r) => {
                let r = if v4_of(peer).is_some() {
                    r
                } else {
                    FallbackReason::NotIpv4
                };
                let mut s = Self::plain(tcp, Mode::Tcp(r));
                s.timeline.mark(T_OPTION);
                s.record(rt, true);
                Ok(s)
            }
        }
    }

    /// For an acceptor that leaves each accepted socket where `accept` put it (the preload:
    /// at the application's new descriptor `fd`): `Ok` when the peer may negotiate (then
    /// hand the socket to [`SmcStream::from_accepted`]); otherwise the fallback is recorded
    /// and counted as [`SmcStream::hand_over`] records one (the row stays with `fd`) and its
    /// reason comes back. The socket is not touched either way. `fd` must be an accepted IPv4
    /// TCP socket of a listener marked with [`Runtime::mark`].
    /// `addrs` (local, peer), when the caller knows them, spare two system calls.
    pub fn accept_verdict(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        addrs: Option<(SocketAddr, SocketAddr)>,
    ) -> Result<(), FallbackReason> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        // The option decides: a native IPv6 peer that offered SMC-R still needs our Decline
        // (the caller's handshake, with `NotIpv4`); one that did not is plain TCP at once.
        let reason = match option_verdict(rt, &tcp, marked) {
            Ok(()) => return Ok(()),
            Err(r) => {
                let peer = addrs.map_or_else(|| tcp.peer_addr(), |(_, p)| Ok(p));
                if peer.is_ok_and(|p| v4_of(p).is_none()) {
                    FallbackReason::NotIpv4
                } else {
                    r
                }
            }
        };
        let mut timeline = Timeline::new();
        timeline.mark(T_OPTION);
        let mode = Mode::Tcp(reason.clone());
        let addrs = || {
            addrs.map_or_else(
                || (tcp.local_addr(), tcp.peer_addr()),
                |(l, p)| (Ok(l), Ok(p)),
            )
        };
        if let Some(st) = record_row(rt, addrs, &mode, &timeline, None, true) {
            keep_row(rt, st, fd.as_raw_fd());
        }
        Err(reason)
    }

    /// For a caller that cannot give a connection SMC-R resources (the preload when the
    /// process has no descriptor left: [`FallbackReason::NoDescriptors`]): settles it as a
    /// fallback on the TCP connection `fd` itself (the application's socket, borrowed for the
    /// call) — without a CLC byte when the peer did not offer SMC-R (that verdict is recorded
    /// instead), else with a Decline (`MEM` on the wire, Linux's code for a shortage of
    /// resources; a server reads the client's Proposal first). The row is recorded with the
    /// local reason and stays with `row_at` (the application's number of the same socket) as
    /// [`SmcStream::hand_over`] leaves it. Returns the reason recorded; an error when the
    /// handshake failed (the connection is unusable).
    pub fn decline_local(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        row_at: std::os::fd::RawFd,
        marked: bool,
        server: bool,
        reason: FallbackReason,
    ) -> io::Result<FallbackReason> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let mut timeline = Timeline::new();
        let recorded = decline_exchange(
            rt,
            &tcp,
            marked,
            server,
            reason,
            DeclineReason::MEM,
            &mut timeline,
        )?;
        let mode = Mode::Tcp(recorded.clone());
        if let Some(st) = record_row(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &mode,
            &timeline,
            None,
            server,
        ) {
            keep_row(rt, st, row_at);
        }
        Ok(recorded)
    }

    /// Records a connection that stays TCP for a local `reason` decided before any CLC byte
    /// (the peer never offered SMC-R, or was never marked): its row stays with `fd` as
    /// [`SmcStream::hand_over`] leaves it. For the preload's own decisions (native IPv6 peers, `NoDescriptors`
    /// before marking).
    pub fn record_local(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        server: bool,
        reason: FallbackReason,
    ) {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let mut timeline = Timeline::new();
        timeline.mark(T_OPTION);
        if let Some(st) = record_row(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &Mode::Tcp(reason),
            &timeline,
            None,
            server,
        ) {
            keep_row(rt, st, fd.as_raw_fd());
        }
    }

    /// Shows a connection that another process holding it too settled as TCP (this process
    /// inherited it): its row, reason [`FallbackReason::Shared`], stays with `fd` as
    /// [`SmcStream::hand_over`] leaves it; not counted in the totals (the settling process
    /// counted it).
    pub fn record_follower(rt: &Runtime, fd: std::os::fd::BorrowedFd<'_>, server: bool) {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let timeline = Timeline::new();
        if let Some(st) = record_row_counted(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &Mode::Tcp(FallbackReason::Shared),
            &timeline,
            None,
            server,
            false,
        ) {
            keep_row(rt, st, fd.as_raw_fd());
        }
    }

    /// The TCP connection underneath (for addresses and socket options; after SMC-R is
    /// established no data goes over it).
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Installs the sink that is told this connection's poll readiness at every change (the
    /// preload's application-facing socket); it is told the current state at once. Only the
    /// first call installs a sink.
    pub fn set_readiness(&self, sink: Box<dyn crate::runtime::Readiness>) {
        if let Some(smc) = &self.smc
            && smc.conn.readiness.set(sink).is_ok()
        {
            let mut s = smc.conn.core.lock();
            smc.conn.report(&mut s);
        }
    }

    /// Bytes that a read would return now (FIONREAD).
    pub fn readable_bytes(&self) -> usize {
        match &self.smc {
            Some(smc) => smc.conn.core.lock().core.readable() as usize,
            None => 0,
        }
    }

    fn plain(tcp: TcpStream, mode: Mode) -> Self {
        Self {
            tcp: Arc::new(tcp),
            smc: None,
            mode,
            stat: None,
            timeline: Box::new(Timeline::new()),
            read_timeout: None,
            write_timeout: None,
            nonblocking: false,
        }
    }

    /// Puts the negotiated connection into the runtime's stats area, counts it, and feeds
    /// the `metrics` facade.
    fn record(&mut self, rt: &Runtime, server: bool) {
        self.stat = record_row(
            rt,
            || (self.tcp.local_addr(), self.tcp.peer_addr()),
            &self.mode,
            &self.timeline,
            self.smc.as_ref(),
            server,
        );
    }

    /// The application keeps this connection's TCP socket at descriptor `fd` (a fallback: the
    /// stream's own duplicate closes now). Its row in the stats area stays, with the
    /// descriptor and the socket's inode, until that descriptor is found closed (`smc-stat`
    /// reads the socket's byte counts from the kernel). For the preload shim.
    pub fn hand_over(mut self, rt: &Runtime, fd: std::os::fd::RawFd) {
        if let Some(st) = self.stat.take() {
            keep_row(rt, st, fd);
        }
    }

    /// Counts bytes moved in the stats area (cursors are published under the connection's
    /// lock where they change: reads, writes, CDCs).
    fn counted(&self, r: io::Result<usize>, sent: bool) -> io::Result<usize> {
        if let (Ok(n), Some(st)) = (&r, &self.stat) {
            let n = *n as u64;
            if sent {
                st.area.add_bytes(st.slot, n, 0);
            } else {
                st.area.add_bytes(st.slot, 0, n);
            }
        }
        r
    }

    fn client_handshake(&mut self, rt: &Runtime) -> io::Result<()> {
        let local = local_v4(&self.tcp).expect("checked IPv4");
        let mtu = roce_mtu(path_mtu(&self.tcp));
        let mut hs = handshake::Client::new(
            rt.inner.cfg.handshake.clone(),
            Gid::from_ipv4(*local.ip()),
            Instant::now(),
        );
        let (negotiated, server) = match drive(&self.tcp, &mut hs, &mut self.timeline)? {
            Event::Accepted { negotiated, server } => (negotiated, server),
            Event::Fallback {
                reason, by_peer, ..
            } => {
                self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                return Ok(());
            }
            Event::Failed(e) => return Err(failed(e)),
            other => return Err(io::Error::other(format!("unexpected {other:?}"))),
        };
        let peer = server.endpoint;
        let size = match peer.gid.to_ipv4() {
            Some(ip) => rt.inner.rmb_size_for(ip),
            None => rt.inner.rmb_size(),
        };
        // No descriptor left for the device or the group (EMFILE): declined with MEM on the
        // wire, recorded as NOFD.
        let nofd = std::cell::Cell::new(false);
        let fd_short = |e: &io::Error, other: DeclineReason| {
            if out_of_descriptors(e) {
                nofd.set(true);
                DeclineReason::MEM
            } else {
                other
            }
        };
        let setup = || -> Result<(Arc<LinkGroup>, Arc<rdma::MemoryRegion>), DeclineReason> {
            let lg = if server.first_contact {
                let dev = rt
                    .inner
                    .device(*local.ip())
                    .map_err(|e| fd_short(&e, DeclineReason::NOSMCRDEV))?;
                // A device that cannot receive RoCE from elsewhere (another process owns the
                // port and no steering program shares it) serves only peers on this host.
                if let Some(ip) = peer.gid.to_ipv4()
                    && let Err(why) = link_possible(rt, &dev, &self.tcp, ip)
                {
                    rt.inner.note(why);
                    return Err(DeclineReason::NOSMCRDEV);
                }
                let mtu = crate::runtime::smaller_mtu(peer.mtu, mtu);
                let lg = LinkGroup::create(
                    &rt.inner,
                    dev,
                    link::Role::Client,
                    peer.gid,
                    server.peer_id,
                    mtu,
                )
                .map_err(|e| fd_short(&e, DeclineReason::ERR_RDYLNK))?;
                lg.start(&peer, mtu, &negotiated, &rt.inner.cfg)
                    .map_err(|e| fd_short(&e, DeclineReason::ERR_RDYLNK))?;
                rt.inner.add_group(lg.clone());
                lg
            } else {
                rt.inner
                    .find_group(
                        *local.ip(),
                        peer.gid,
                        link::Role::Client,
                        server.peer_id,
                        Some(peer.qpn),
                    )
                    .ok_or(DeclineReason::SYNCERR)?
            };
            let rmb = lg.take_rmb(size.bytes())?;
            if !server.first_contact && lg.confirm_rkey(&rmb).is_err() {
                // The peer does not answer on this group: it is dead to us.
                lg.give_back(rmb);
                lg.terminate();
                return Err(DeclineReason::ERR_REGBUF);
            }
            Ok((lg, rmb))
        };
        let (lg, rmb) = match setup() {
            Ok(x) => x,
            Err(reason) => {
                hs.decline(reason).map_err(io::Error::other)?;
                let ev = drive(&self.tcp, &mut hs, &mut self.timeline)?;
                if let Event::Fallback {
                    reason, by_peer, ..
                } = ev
                {
                    self.mode = Mode::Tcp(if nofd.get() && !by_peer {
                        FallbackReason::NoDescriptors
                    } else {
                        FallbackReason::Declined { reason, by_peer }
                    });
                    return Ok(());
                }
                return Err(io::Error::other(format!("unexpected {ev:?}")));
            }
        };
        let token = rt.inner.token();
        let local_ep = endpoint(&lg, &rmb, size, token);
        let conn = make_conn(&lg, token, rmb, &peer, &self.tcp)?;
        let finish = |s: &mut Self, hs: &mut handshake::Client| -> io::Result<()> {
            hs.confirm(&local_ep, &[], Instant::now())
                .map_err(io::Error::other)?;
            match drive(&s.tcp, hs, &mut s.timeline)? {
                Event::Confirmed => Ok(()),
                Event::Failed(e) => Err(failed(e)),
                other => Err(io::Error::other(format!("unexpected {other:?}"))),
            }
        };
        if let Err(e) = finish(self, &mut hs) {
            // Never used: detach it and keep its RMB for others (or free it with the group).
            lg.detach(token);
            lg.give_back(conn.rmb.clone());
            return Err(e);
        }
        if server.first_contact {
            if lg
                .wait_up(CLIENT_CONFIRM_WAIT + Duration::from_secs(1), &self.tcp)
                .is_err()
            {
                hs.link_failed(Instant::now()).map_err(io::Error::other)?;
                self.mode = Mode::Tcp(link_not_up(self, &lg, &conn, &mut hs)?);
                return Ok(());
            }
            self.timeline.mark(T_LINK);
        }
        self.mode = Mode::SmcR {
            first_contact: server.first_contact,
        };
        self.smc = Some(Smc { conn, lg });
        Ok(())
    }

    /// SMC-R or TCP, with the fallback reason.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// The id of the link group this connection runs on (`None` for TCP): what
    /// [`Driver::id`] would say, without making one.
    pub fn group_id(&self) -> Option<u64> {
        self.smc.as_ref().map(|smc| u64::from(smc.lg.id))
    }

    /// What an application thread needs to do this connection's link-group work itself
    /// (`None` for a plain TCP connection). See [`Driver`].
    pub fn driver(&self) -> Option<Driver> {
        let smc = self.smc.as_ref()?;
        use std::os::fd::AsRawFd;
        Some(Driver {
            fd: smc.lg.event_fd().as_raw_fd(),
            id: u64::from(smc.lg.id),
            lg: Arc::downgrade(&smc.lg),
        })
    }

    /// Counters of an SMC-R stream (`None` for TCP).
    pub fn stats(&self) -> Option<ConnStats> {
        self.smc.as_ref().map(|smc| smc.conn.core.lock().stats)
    }

    /// A file descriptor for poll/epoll, for readers (`write` false) or writers: it becomes
    /// readable whenever the stream's state may have changed (data arrived, space freed,
    /// closed, failed). Read it (8 bytes) to re-arm, then retry the operation in non-blocking
    /// mode. For a TCP-mode stream this is the TCP socket itself (wait for POLLIN or POLLOUT).
    pub fn readiness_fd(&self, write: bool) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        match &self.smc {
            Some(smc) => smc.conn.readiness_fd(write),
            None => Ok(self.tcp.as_fd()),
        }
    }

    /// The TCP stream of a connection that fell back (the same socket, under a duplicated
    /// descriptor), or the stream itself when it is SMC-R.
    pub fn into_tcp(self) -> Result<TcpStream, Self> {
        if self.smc.is_some() {
            return Err(self);
        }
        match self.tcp.try_clone() {
            Ok(tcp) => Ok(tcp),
            Err(_) => Err(self),
        }
    }

    /// The peer's address (of the TCP connection).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Our address (of the TCP connection).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Read timeout (None: block).
    pub fn set_read_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        self.read_timeout = t;
        self.tcp.set_read_timeout(t)
    }

    /// Write timeout (None: block).
    pub fn set_write_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        self.write_timeout = t;
        self.tcp.set_write_timeout(t)
    }

    /// Non-blocking mode: reads and writes that would wait fail with `WouldBlock`.
    pub fn set_nonblocking(&mut self, on: bool) -> io::Result<()> {
        self.nonblocking = on;
        self.tcp.set_nonblocking(on)
    }

    /// Shuts down reading, writing or both. Writing: the peer reads EOF after our data.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let Some(smc) = &self.smc else {
            return self.tcp.shutdown(how);
        };
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            let mut s = smc.conn.core.lock();
            s.shut_rd = true;
            smc.conn.report(&mut s);
            drop(s);
            smc.conn.wake();
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            let mut s = smc.conn.core.lock();
            if s.shut_wr {
                return Ok(());
            }
            let staged = s.staged;
            smc.conn.flush_locked(&mut s, &smc.lg, staged, false)?;
            let cdc = s.core.close_flags(ConnStateFlags::PEER_DONE_WRITING);
            s.publish();
            s.shut_wr = true;
            smc.conn.send_ctl(&mut s, &smc.lg, &cdc, false)?;
            smc.conn.report(&mut s);
        }
        Ok(())
    }

    /// Ends the connection at once: the peer is told (an abort CDC, which it reports as
    /// `ConnectionReset`), and our own reads and writes fail with `ConnectionReset` carrying
    /// `why`. For callers that can no longer trust the connection (the preload after a panic
    /// in a call on it). A TCP-mode stream is shut down both ways.
    pub fn abort(&self, why: &str) {
        let Some(smc) = &self.smc else {
            let _ = self.tcp.shutdown(Shutdown::Both);
            return;
        };
        let mut s = smc.conn.core.lock();
        if s.failed.is_none() {
            smc.conn
                .abort(&mut s, &smc.lg, ConnFailure::Aborted(why.to_owned()));
            smc.conn.report(&mut s);
        }
        drop(s);
        smc.conn.wake();
    }

    /// The reset to report, once: the peer aborted or the connection failed, and the
    /// application has not been told yet (later calls see EOF / EPIPE, as TCP after its
    /// error was collected).
    fn pending_reset(s: &mut crate::runtime::ConnState) -> Option<io::Error> {
        if s.reset_reported {
            return None;
        }
        let why = if let Some(f) = &s.failed {
            f.to_string()
        } else if s
            .core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_ABORT)
        {
            "peer aborted the connection".to_owned()
        } else {
            return None;
        };
        s.reset_reported = true;
        Some(io::Error::new(io::ErrorKind::ConnectionReset, why))
    }

    /// Takes a reset not yet reported (for SO_ERROR, which reports it once): `true` if there
    /// was one. A TCP-mode stream: `false` (the socket keeps its own error).
    pub fn take_reset(&self) -> bool {
        let Some(smc) = &self.smc else {
            return false;
        };
        let mut s = smc.conn.core.lock();
        let taken = Self::pending_reset(&mut s).is_some();
        if taken {
            smc.conn.report(&mut s);
        }
        taken
    }

    fn deadline(t: Option<Duration>) -> Option<Instant> {
        t.map(|t| Instant::now() + t)
    }

    /// Reads from an SMC-R stream with per-call blocking (the preload passes the
    /// application's O_NONBLOCK and SO_RCVTIMEO); `peek` leaves the data in place (MSG_PEEK).
    /// On a TCP-mode stream this reads the TCP socket.
    pub fn recv(&self, buf: &mut [u8], peek: bool, how: Blocking) -> io::Result<usize> {
        let r = if self.smc.is_none() {
            (&*self.tcp).read(buf)
        } else {
            self.smc_read(buf, peek, how)
        };
        if peek { r } else { self.counted(r, false) }
    }

    /// Writes to an SMC-R stream with per-call blocking; on a TCP-mode stream, to the socket.
    pub fn send(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        let r = if self.smc.is_none() {
            (&*self.tcp).write(buf)
        } else {
            self.smc_write(buf, how)
        };
        self.counted(r, true)
    }

    fn how(&self, timeout: Option<Duration>) -> Blocking {
        if self.nonblocking {
            Blocking::No
        } else {
            Blocking::Yes(timeout)
        }
    }

    fn smc_read(&self, buf: &mut [u8], peek: bool, how: Blocking) -> io::Result<usize> {
        let smc = self.smc.as_ref().expect("SMC-R mode");
        if buf.is_empty() {
            return Ok(0);
        }
        let (nonblocking, deadline) = match how {
            Blocking::No => (true, None),
            Blocking::Yes(t) => (false, Self::deadline(t)),
        };
        let mut s = smc.conn.core.lock();
        loop {
            let readable = s.core.readable();
            if readable > 0 {
                let n = readable.min(buf.len().min(u32::MAX as usize) as u32);
                let mut at = 0usize;
                for (off, len) in s.core.read_pieces(n) {
                    let len = len as usize;
                    if len > 0 {
                        smc.conn.rmb.read(off as usize, &mut buf[at..at + len]);
                        at += len;
                    }
                }
                s.stats.bytes_received += u64::from(n);
                if peek {
                    return Ok(n as usize);
                }
                if let Some(cdc) = s.core.consume(n) {
                    // The bytes are in `buf` and consumed: they are returned even if the
                    // update cannot go (a peer that closed and deleted the link group before
                    // we read its last bytes); a dead link shows on the next call.
                    let _ = smc.conn.send_ctl(&mut s, &smc.lg, &cdc, false);
                }
                s.publish();
                smc.conn.report(&mut s);
                return Ok(n as usize);
            }
            let pf = s.core.peer_flags();
            if s.shut_rd {
                return Ok(0);
            }
            // A peer that finished cleanly gives EOF even if the link goes away afterwards
            // (its process exits and deletes the link group right after closing): checked
            // before a local failure, which would otherwise turn the clean end into a reset.
            // So does a reset already reported.
            if s.reset_reported
                || (pf.intersects(
                    ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED,
                ) && !pf.contains(ConnStateFlags::PEER_CONN_ABORT))
            {
                return Ok(0);
            }
            if let Some(e) = Self::pending_reset(&mut s) {
                return Err(e);
            }
            wait(&smc.conn, &smc.lg, &mut s, nonblocking, deadline)?;
        }
    }

    fn smc_write(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        let smc = self.smc.as_ref().expect("SMC-R mode");
        if buf.is_empty() {
            return Ok(0);
        }
        let (nonblocking, deadline) = match how {
            Blocking::No => (true, None),
            Blocking::Yes(t) => (false, Self::deadline(t)),
        };
        let mut s = smc.conn.core.lock();
        loop {
            if let Some(e) = Self::pending_reset(&mut s) {
                return Err(e);
            }
            let pf = s.core.peer_flags();
            if pf.intersects(ConnStateFlags::PEER_CONN_CLOSED | ConnStateFlags::PEER_CONN_ABORT)
                || s.local_closed
                || s.shut_wr
                || s.reset_reported
            {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    format!(
                        "the connection is closed (token {:#x}, peer flags {:?}, local close {})",
                        smc.conn.token, pf, s.local_closed
                    ),
                ));
            }
            let avail = s.core.space().saturating_sub(s.staged);
            if avail > 0 {
                let want = buf.len().min(u32::MAX as usize) as u32;
                let n = want.min(avail);
                // On one host, straight into the peer's RMB when nothing waits before it.
                if smc
                    .conn
                    .write_direct(&mut s, &smc.lg, &buf[..n as usize], want)?
                {
                    s.stats.writes += 1;
                    smc.conn.report(&mut s);
                    return Ok(n as usize);
                }
                let mut at = 0usize;
                for (off, len) in s.core.stage_pieces(s.staged, n) {
                    if len > 0 {
                        smc.conn
                            .sndbuf
                            .write(off as usize, &buf[at..at + len as usize]);
                        at += len as usize;
                    }
                }
                s.staged += n;
                s.stats.writes += 1;
                // Autocorking as Linux: while a CDC of ours is in flight, small writes wait in
                // the send buffer and go out together when it completes; a lone write (nothing
                // in flight) goes at once.
                let cork = s.inflight > 0 && s.staged <= smc.conn.cork_limit();
                if !cork {
                    let pending = s.staged + (want - n);
                    smc.conn.flush_locked(&mut s, &smc.lg, pending, false)?;
                }
                smc.conn.report(&mut s);
                return Ok(n as usize);
            }
            wait(&smc.conn, &smc.lg, &mut s, nonblocking, deadline)?;
        }
    }
}

fn wait(
    conn: &ConnShared,
    lg: &Arc<LinkGroup>,
    s: &mut parking_lot::MutexGuard<'_, ConnState>,
    nonblocking: bool,
    deadline: Option<Instant>,
) -> io::Result<()> {
    if nonblocking {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    if lg.claim_blocking_driver() {
        let seen = conn.wakes.load(std::sync::atomic::Ordering::Acquire);
        let changed = || conn.wakes.load(std::sync::atomic::Ordering::Acquire) != seen;
        parking_lot::MutexGuard::unlocked(s, || lg.drive_blocked(deadline, changed));
        // Woken by the group's next completions, handled on this thread; the caller checks
        // its condition again (a deadline passed with nothing new is a time-out).
        if !changed() && deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
        }
        return Ok(());
    }
    match deadline {
        Some(d) => {
            if conn.cond.wait_until(s, d).timed_out() {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
            }
        }
        None => conn.cond.wait(s),
    }
    Ok(())
}

/// Whether an error is the process (or the system) running out of descriptors.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Whether `dev` can run a link with the peer of `tcp` (at `peer_ip`): a device that cannot
/// receive RoCE from elsewhere serves peers on this host only, through shared memory, which
/// is only between processes of one user (or root): the peer's socket's owner says.
fn link_possible(
    rt: &Runtime,
    dev: &crate::runtime::Dev,
    tcp: &TcpStream,
    peer_ip: std::net::Ipv4Addr,
) -> Result<(), String> {
    dev.reaches(peer_ip, rt.inner.cfg.same_host)?;
    if dev.reaches_remote() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if me == 0 {
        return Ok(());
    }
    match (tcp.local_addr(), tcp.peer_addr()) {
        (Ok(l), Ok(p)) => match crate::diag::peer_uid(l, p) {
            Some(u) if u != me && u != 0 => Err(format!(
                "{}; the peer runs as another user (uid {u}) and shared memory only serves processes of one user",
                crate::steer::local_only_diagnosis(dev.ip)
            )),
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Marks a socket for the TCP option (`connecting`: before `connect`); false when the option
/// program is unusable.
fn mark(rt: &Runtime, sock: &Socket, connecting: bool) -> bool {
    match (&rt.inner.cfg.negotiation, &rt.inner.option) {
        (Negotiation::TcpOption { .. }, Ok(map)) => map.mark(sock.as_fd(), connecting).is_ok(),
        _ => false,
    }
}

/// After the TCP handshake: may the CLC handshake start?
fn verdict(rt: &Runtime, tcp: &TcpStream, marked: bool, ipv4: bool) -> Result<(), FallbackReason> {
    if !ipv4 {
        return Err(FallbackReason::NotIpv4);
    }
    option_verdict(rt, tcp, marked)
}

/// Settles a connection whose CLC handshake we will not run as a fallback for `reason`: no CLC
/// byte when the peer did not offer SMC-R (that verdict is returned instead, or `NotIpv4` for
/// a native IPv6 peer), else a Decline with `wire` (a server reads the client's Proposal
/// first; a client sends it instead of its Proposal). The peer's own Decline, if it comes
/// first, is the reason returned.
fn decline_exchange(
    rt: &Runtime,
    tcp: &TcpStream,
    marked: bool,
    server: bool,
    reason: FallbackReason,
    wire: DeclineReason,
    timeline: &mut Timeline,
) -> io::Result<FallbackReason> {
    let ipv4 = tcp.peer_addr().is_ok_and(|a| v4_of(a).is_some());
    let marked = marked
        || (server
            && matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok());
    let offered = option_verdict(rt, tcp, marked);
    timeline.mark(T_OPTION);
    if let Err(r) = offered {
        return Ok(if ipv4 { r } else { FallbackReason::NotIpv4 });
    }
    let cfg = rt.inner.cfg.handshake.clone();
    let ev = if server {
        let mut hs = handshake::Server::new(cfg, Instant::now());
        match drive(tcp, &mut hs, timeline)? {
            Event::Proposed { .. } => {
                hs.decline(wire).map_err(io::Error::other)?;
                drive(tcp, &mut hs, timeline)?
            }
            other => other,
        }
    } else {
        let mut hs = handshake::Client::declining(cfg, wire, Instant::now());
        drive(tcp, &mut hs, timeline)?
    };
    match ev {
        Event::Fallback {
            reason: r,
            by_peer: true,
            ..
        } => Ok(FallbackReason::Declined {
            reason: r,
            by_peer: true,
        }),
        Event::Fallback { .. } => Ok(reason),
        Event::Failed(e) => {
            rt.inner.handshake_failed();
            Err(failed(e))
        }
        other => {
            rt.inner.handshake_failed();
            Err(io::Error::other(format!("unexpected {other:?}")))
        }
    }
}

/// Whether the peer offered SMC-R (the option program's record), IPv4 or not.
fn option_verdict(rt: &Runtime, tcp: &TcpStream, marked: bool) -> Result<(), FallbackReason> {
    match (&rt.inner.cfg.negotiation, &rt.inner.option) {
        (Negotiation::Assume, _) => Ok(()),
        (Negotiation::TcpOption { .. }, Err(e)) => Err(FallbackReason::NoBpf(e.clone())),
        (Negotiation::TcpOption { .. }, Ok(map)) => {
            if !marked {
                return Err(FallbackReason::NoBpf("could not mark the socket".into()));
            }
            match map.state(tcp.as_fd()).map(|s| s.capability()) {
                Ok(Capability::PeerCapable) => Ok(()),
                Ok(Capability::PeerNotCapable) => Err(FallbackReason::PeerNoSmc),
                Ok(_) => Err(FallbackReason::OptionNotObserved),
                Err(e) => Err(FallbackReason::NoBpf(e.to_string())),
            }
        }
    }
}

/// Whether an operation may wait, and how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocking {
    /// Fail with `WouldBlock` instead of waiting.
    No,
    /// Wait, at most this long (`None`: as long as it takes).
    Yes(Option<Duration>),
}

/// Leaves a fallback's stats row with the socket at `fd` (see [`SmcStream::hand_over`]).
fn keep_row(rt: &Runtime, st: StatSlot, fd: std::os::fd::RawFd) {
    let (Some(ino), Ok(Some(mut rec))) = (socket_inode(fd), st.area.read_conn(st.slot)) else {
        return;
    };
    rec.words[crate::stats::conn::FD] = fd as u64 + 1;
    rec.words[crate::stats::conn::INODE] = ino;
    st.area.write_conn(st.slot, &rec);
    rt.inner.keep_fallback_row(st, fd, ino);
}

/// Counts a negotiated connection and writes its row in the stats area (the connection's
/// cursors publish into it from then on); the row's slot, while the area has room.
fn record_row(
    rt: &Runtime,
    addrs: impl FnOnce() -> (io::Result<SocketAddr>, io::Result<SocketAddr>),
    mode: &Mode,
    timeline: &Timeline,
    smc: Option<&Smc>,
    server: bool,
) -> Option<StatSlot> {
    record_row_counted(rt, addrs, mode, timeline, smc, server, true)
}

/// [`record_row`]; `count`: the connection counts in the totals and metrics (once per
/// connection: a process showing a connection another one counted does not count it again).
fn record_row_counted(
    rt: &Runtime,
    addrs: impl FnOnce() -> (io::Result<SocketAddr>, io::Result<SocketAddr>),
    mode: &Mode,
    timeline: &Timeline,
    smc: Option<&Smc>,
    server: bool,
    count: bool,
) -> Option<StatSlot> {
    use crate::stats::{conn, total};
    let handshake = timeline.start.elapsed();
    match mode {
        _ if !count => {}
        Mode::SmcR { first_contact } => {
            crate::metrics::connection(None, *first_contact, handshake);
        }
        Mode::Tcp(r) => crate::metrics::connection(Some(r), false, handshake),
    }
    let area = rt.inner.stats.as_ref()?;
    let mut rec = crate::stats::ConnRecord::default();
    rec.words[conn::IN_USE] = 1;
    let (local, peer) = addrs();
    put_addr(&mut rec, local.ok(), false);
    put_addr(&mut rec, peer.ok(), true);
    let mode = match mode {
        Mode::SmcR { first_contact } => {
            if count {
                area.count(total::SMCR);
                if *first_contact {
                    area.count(total::FIRST_CONTACT);
                }
            }
            conn::MODE_SMCR
        }
        Mode::Tcp(r) => {
            if count {
                area.count(total::TCP);
                area.count_fallback(r.code());
            }
            let peer = match r {
                FallbackReason::Declined {
                    reason,
                    by_peer: true,
                } => u64::from(reason.0),
                _ => 0,
            };
            rec.words[conn::REASON] = u64::from(r.code()) | peer << 32;
            conn::MODE_TCP
        }
    };
    rec.words[conn::STATE] = conn::STATE_ACTIVE | u64::from(server) << 8 | mode << 16;
    if let Some(smc) = smc {
        rec.words[conn::SIZES] = smc.conn.rmb.len() as u64 | (smc.conn.sndbuf.len() as u64) << 32;
        rec.words[conn::IDS] = u64::from(smc.conn.token) | u64::from(smc.lg.id) << 32;
    }
    rec.words[conn::SINCE] = timeline.unix_ns;
    rec.words[conn::T_OPTION..=conn::T_LINK].copy_from_slice(&timeline.at);
    let slot = area.claim_conn()?;
    area.write_conn(slot, &rec);
    if let Some(smc) = smc {
        let mut s = smc.conn.core.lock();
        s.stat = Some(crate::runtime::StatRef {
            area: area.clone(),
            slot,
            start: timeline.start,
        });
        s.publish();
    }
    Some(StatSlot {
        area: area.clone(),
        slot,
    })
}

/// Writes an address into a record: IPv4 (or v4-mapped) in `LOCAL`/`PEER`, a native IPv6 one
/// in `LOCAL6`/`PEER6` with its `FAMILY` bit (the port stays in `LOCAL`/`PEER`).
fn put_addr(rec: &mut crate::stats::ConnRecord, a: Option<SocketAddr>, peer: bool) {
    use crate::stats::conn;
    let Some(a) = a else { return };
    let (word, word6, bit) = if peer {
        (conn::PEER, conn::PEER6, 2)
    } else {
        (conn::LOCAL, conn::LOCAL6, 1)
    };
    match (v4_of(a), a) {
        (Some(v4), _) => {
            rec.words[word] = u64::from(u32::from(*v4.ip())) << 16 | u64::from(v4.port());
        }
        (None, SocketAddr::V6(v6)) => {
            let o = v6.ip().octets();
            rec.words[word] = u64::from(v6.port());
            rec.words[word6] = u64::from_be_bytes(o[..8].try_into().expect("8 bytes"));
            rec.words[word6 + 1] = u64::from_be_bytes(o[8..].try_into().expect("8 bytes"));
            rec.words[conn::FAMILY] |= bit;
        }
        (None, SocketAddr::V4(_)) => {}
    }
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let r = if self.smc.is_some() {
            self.smc_read(buf, false, self.how(self.read_timeout))
        } else {
            (&*self.tcp).read(buf)
        };
        self.counted(r, false)
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let r = if self.smc.is_some() {
            self.smc_write(buf, self.how(self.write_timeout))
        } else {
            (&*self.tcp).write(buf)
        };
        self.counted(r, true)
    }

    fn flush(&mut self) -> io::Result<()> {
        // Posts what autocorking holds back.
        if let Some(smc) = &self.smc {
            let mut s = smc.conn.core.lock();
            let staged = s.staged;
            smc.conn.flush_locked(&mut s, &smc.lg, staged, false)?;
        }
        Ok(())
    }
}

impl Drop for SmcStream {
    fn drop(&mut self) {
        let Some(smc) = self.smc.take() else {
            return;
        };
        let mut s = smc.conn.core.lock();
        // Our stats record is freed after this body (field drop): no update may follow.
        s.stat = None;
        if !s.local_closed {
            s.local_closed = true;
            let staged = s.staged;
            let _ = smc.conn.flush_locked(&mut s, &smc.lg, staged, false);
            // As Linux's smc_close_final (and TCP's RST): closing with unread data aborts;
            // so does SO_LINGER {on, 0}, as for TCP.
            let flag = if s.core.readable() > 0 || linger_zero(&self.tcp) {
                ConnStateFlags::PEER_CONN_ABORT
            } else {
                ConnStateFlags::PEER_CONN_CLOSED
            };
            let cdc = s.core.close_flags(flag);
            let _ = smc.conn.send_ctl(&mut s, &smc.lg, &cdc, false);
        }
        let peer_gone = s
            .core
            .peer_flags()
            .intersects(ConnStateFlags::PEER_CONN_CLOSED | ConnStateFlags::PEER_CONN_ABORT)
            || s.failed.is_some();
        drop(s);
        if peer_gone {
            smc.conn.release(&smc.lg);
        }
    }
}

/// A listening socket whose accepted connections negotiate SMC-R.
///
/// Like Linux's SMC listener, negotiation happens off the accepting thread: a background
/// thread takes TCP connections and runs each handshake on a thread of its own, and
/// [`SmcListener::accept`] returns connections whose negotiation has finished (SMC-R or TCP).
/// A connection whose handshake fails (timeout, protocol error) is closed and never returned.
pub struct SmcListener {
    local: SocketAddr,
    /// A duplicate of the listening socket, to wake the acceptor with shutdown() on drop.
    wake: TcpListener,
    ready: parking_lot::Mutex<std::sync::mpsc::Receiver<(SmcStream, SocketAddr)>>,
    nonblocking: bool,
    _stat: Option<ListenerRecord>,
}

/// What the acceptor does after a failed `accept`.
#[derive(Debug, PartialEq)]
enum AcceptError {
    /// At once: a signal, or a connection that went before it was taken.
    Retry,
    /// After a pause: the process or system is out of descriptors or memory.
    Later,
    /// Never again: the listener was shut down or is not a listener.
    Stop,
}

fn accept_error(e: &io::Error) -> AcceptError {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptError::Later,
        Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT) => {
            AcceptError::Stop
        }
        // EINTR, ECONNABORTED, EPROTO, EPERM (a firewall rule), and the pending network
        // errors accept(2) may pass on: that connection is lost, the listener is fine.
        _ => AcceptError::Retry,
    }
}

impl SmcListener {
    /// Binds and listens on `addr`, marked for the SMC-R option.
    pub fn bind(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        // A dual-stack [::] listener serves IPv4 peers through v4-mapped addresses: marked too
        // (a native IPv6 peer's connection falls back, NOTIPV4).
        if addr.is_ipv4() || matches!(addr, SocketAddr::V6(a) if !a.ip().is_loopback()) {
            mark(rt, &sock, false);
        }
        sock.bind(&addr.into())?;
        sock.listen(1024)?;
        let tcp: TcpListener = sock.into();
        let local = tcp.local_addr()?;
        let wake = tcp.try_clone()?;
        let stat = rt.listener_record(local);
        let (tx, ready) = std::sync::mpsc::channel();
        let rt = rt.clone();
        rdma::thread::spawn("smcr-accept".into(), move || {
            loop {
                let (tcp, peer) = match tcp.accept() {
                    Ok(x) => x,
                    Err(e) => match accept_error(&e) {
                        AcceptError::Retry => continue,
                        // Out of descriptors or memory: the connection waits in the kernel's
                        // backlog (as it would for a TCP server) until some are freed.
                        AcceptError::Later => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        // The listener was shut down (dropped) or is broken.
                        AcceptError::Stop => return,
                    },
                };
                let (rt, tx) = (rt.clone(), tx.clone());
                let _ = rdma::thread::spawn("smcr-handshake".into(), move || {
                    if let Ok(s) = SmcStream::negotiate_server(&rt, tcp, peer) {
                        let _ = tx.send((s, peer));
                    }
                });
            }
        })?;
        Ok(Self {
            local,
            wake,
            ready: parking_lot::Mutex::new(ready),
            nonblocking: false,
            _stat: stat,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Non-blocking mode: `accept` fails with `WouldBlock` when no connection is ready.
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }

    /// The next connection whose negotiation has finished.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        if self.nonblocking {
            self.ready.lock().try_recv().map_err(|e| match e {
                std::sync::mpsc::TryRecvError::Empty => io::ErrorKind::WouldBlock.into(),
                std::sync::mpsc::TryRecvError::Disconnected => {
                    io::Error::other("the listener's acceptor stopped")
                }
            })
        } else {
            self.ready
                .lock()
                .recv()
                .map_err(|_| io::Error::other("the listener's acceptor stopped"))
        }
    }
}

impl Drop for SmcListener {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid listening socket; SHUT_RD makes the blocked accept() return.
        unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RD) };
    }
}

impl SmcStream {
    fn negotiate_server(rt: &Runtime, tcp: TcpStream, peer: SocketAddr) -> io::Result<Self> {
        // The listener was marked (by SmcListener, or by the preload before listen()); the
        // accepted socket inherits the mark.
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        let mut s = Self::plain(tcp, Mode::Tcp(FallbackReason::PeerNoSmc));
        if v4_of(peer).is_none() {
            // A native IPv6 peer of a dual-stack listener: declined if it offered SMC-R (its
            // Proposal must not reach the application as data).
            let r = decline_exchange(
                rt,
                &s.tcp,
                marked,
                true,
                FallbackReason::NotIpv4,
                DeclineReason::NOSMCRDEV,
                &mut s.timeline,
            )?;
            s.mode = Mode::Tcp(r);
            s.record(rt, true);
            return Ok(s);
        }
        let verdict = verdict(rt, &s.tcp, marked, true);
        s.timeline.mark(T_OPTION);
        match verdict {
            Err(r) => s.mode = Mode::Tcp(r),
            Ok(()) => {
                if let Err(e) = s.server_handshake(rt) {
                    rt.inner.handshake_failed();
                    return Err(e);
                }
            }
        }
        s.record(rt, true);
        Ok(s)
    }

    fn server_handshake(&mut self, rt: &Runtime) -> io::Result<()> {
        let local = local_v4(&self.tcp).expect("checked IPv4");
        let peer_ip = *v4_of(self.tcp.peer_addr()?)
            .ok_or_else(|| io::Error::other("not IPv4 (checked before)"))?
            .ip();
        let mtu = roce_mtu(path_mtu(&self.tcp));
        let mut hs = handshake::Server::new(rt.inner.cfg.handshake.clone(), Instant::now());
        let decline = |s: &mut Self, hs: &mut handshake::Server, reason| -> io::Result<()> {
            hs.decline(reason).map_err(io::Error::other)?;
            match drive(&s.tcp, hs, &mut s.timeline)? {
                Event::Fallback {
                    reason, by_peer, ..
                } => {
                    s.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                    Ok(())
                }
                ev => Err(io::Error::other(format!("unexpected {ev:?}"))),
            }
        };
        // No descriptor left for the device or the group: MEM on the wire, NOFD recorded.
        let decline_nofd = |s: &mut Self, hs: &mut handshake::Server| -> io::Result<()> {
            decline(s, hs, DeclineReason::MEM)?;
            if matches!(
                s.mode,
                Mode::Tcp(FallbackReason::Declined { by_peer: false, .. })
            ) {
                s.mode = Mode::Tcp(FallbackReason::NoDescriptors);
            }
            Ok(())
        };
        let (client_gid, client_id) = match drive(&self.tcp, &mut hs, &mut self.timeline)? {
            Event::Proposed {
                client_gid,
                client_id,
                ..
            } => (client_gid, client_id),
            Event::Fallback {
                reason, by_peer, ..
            } => {
                self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                return Ok(());
            }
            Event::Failed(e) => return Err(failed(e)),
            other => return Err(io::Error::other(format!("unexpected {other:?}"))),
        };
        // One handshake per client while it may create a link group (Linux's
        // smc_server_lgr_pending): concurrent first contacts would create two. A handshake that
        // reuses a group holds it only until its token is reserved in that group (which counts
        // against the group's connection limit): the CONFIRM RKEY and CLC round trips of a burst
        // of connections then overlap instead of queueing one after another (65 at once over a
        // 50 ms round trip used to exceed the client's 6 s Accept wait). Linux holds its lock
        // (for all clients) until the link is up or the Confirm is in.
        let pending = rt.inner.pending(true, peer_ip);
        let mut one_at_a_time = Some(pending.lock());
        let token = rt.inner.token();
        let size = match client_gid.to_ipv4() {
            Some(ip) => rt.inner.rmb_size_for(ip),
            None => rt.inner.rmb_size(),
        };
        // Groups found dead (their client did not answer CONFIRM RKEY) on the way: each is
        // ended, so the next look finds another one (or none); after a few, a new group (the
        // client's Accept wait has room for about two lost CONFIRM RKEY waits).
        let mut stale = 0;
        let (lg, first_contact, res) = loop {
            if one_at_a_time.is_none() {
                one_at_a_time = Some(pending.lock());
            }
            let existing = if stale >= 2 {
                None
            } else {
                rt.inner
                    .find_group(*local.ip(), client_gid, link::Role::Server, client_id, None)
            };
            let first_contact = existing.is_none();
            let lg = match existing {
                Some(lg) => lg,
                None => {
                    let dev = match rt.inner.device(*local.ip()) {
                        Ok(d) => d,
                        Err(e) if out_of_descriptors(&e) => {
                            return decline_nofd(self, &mut hs);
                        }
                        Err(_) => return decline(self, &mut hs, DeclineReason::NOSMCRDEV),
                    };
                    // See the client's first contact: a local-only device serves this host.
                    if let Err(why) = link_possible(rt, &dev, &self.tcp, peer_ip) {
                        rt.inner.note(why);
                        return decline(self, &mut hs, DeclineReason::NOSMCRDEV);
                    }
                    match LinkGroup::create(
                        &rt.inner,
                        dev,
                        link::Role::Server,
                        client_gid,
                        client_id,
                        mtu,
                    ) {
                        Ok(lg) => lg,
                        Err(e) if out_of_descriptors(&e) => {
                            return decline_nofd(self, &mut hs);
                        }
                        Err(_) => return decline(self, &mut hs, DeclineReason::ERR_RDYLNK),
                    }
                }
            };
            let res = match lg.take_rmb(size.bytes()) {
                Ok(rmb) => Reserved::new(&lg, token, rmb),
                Err(reason) => return decline(self, &mut hs, reason),
            };
            if !first_contact {
                one_at_a_time = None;
                if lg.confirm_rkey(res.rmb()).is_err() {
                    // The client does not answer on this group (its side is gone: a process
                    // that died without DELETE LINK, or a link it already found dead): end it
                    // and offer this connection a new group as a first contact — nothing was
                    // sent yet, and the client's Accept wait (6 s) has room for the 2 s lost.
                    drop(res);
                    lg.terminate();
                    stale += 1;
                    continue;
                }
            }
            break (lg, first_contact, res);
        };
        // From here, any return before the connection exists gives the token and the RMB back
        // (`Reserved`'s drop).
        let local_ep = endpoint(&lg, res.rmb(), size, token);
        hs.accept(&local_ep, first_contact, Instant::now())
            .map_err(io::Error::other)?;
        let (negotiated, client) = match drive(&self.tcp, &mut hs, &mut self.timeline) {
            Ok(Event::Established { negotiated, client }) => (negotiated, client),
            other => {
                drop(res);
                return match other {
                    Ok(Event::Fallback {
                        reason,
                        by_peer,
                        out_of_sync,
                    }) => {
                        if out_of_sync && !first_contact {
                            // The client does not know the group we offered (Linux: SYNCERR);
                            // end it so its next connection is a first contact (a restarted
                            // client process on the same address is a new peer to us).
                            lg.terminate();
                        }
                        self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                        Ok(())
                    }
                    Ok(Event::Failed(e)) => Err(failed(e)),
                    Ok(ev) => Err(io::Error::other(format!("unexpected {ev:?}"))),
                    Err(e) => Err(e),
                };
            }
        };
        let peer = client.endpoint;
        if first_contact {
            let mtu = crate::runtime::smaller_mtu(peer.mtu, lg.mtu);
            if let Err(e) = lg.start(&peer, mtu, &negotiated, &rt.inner.cfg) {
                // Give back what was reserved; the group ends (its RMB budget with it).
                drop(res);
                lg.fail(crate::group::GroupDown::Start(e.to_string()));
                return Err(e);
            }
            rt.inner.add_group(lg.clone());
        }
        let conn = res.into_conn(&peer, &self.tcp)?;
        if first_contact {
            if lg
                .wait_up(CONFIRM_WAIT + Duration::from_secs(1), &self.tcp)
                .is_err()
            {
                hs.link_failed(Instant::now()).map_err(io::Error::other)?;
                self.mode = Mode::Tcp(link_not_up(self, &lg, &conn, &mut hs)?);
                return Ok(());
            }
            self.timeline.mark(T_LINK);
        }
        // A first contact's link is up: later handshakes of this client may reuse the group.
        drop(one_at_a_time);
        self.mode = Mode::SmcR { first_contact };
        self.smc = Some(Smc { conn, lg });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_acceptor_outlives_what_accept_can_report_for_one_connection_or_a_shortage() {
        let e = |n| io::Error::from_raw_os_error(n);
        for n in [
            libc::EINTR,
            libc::ECONNABORTED,
            libc::EPROTO,
            libc::EPERM,
            libc::ETIMEDOUT,
        ] {
            assert_eq!(accept_error(&e(n)), AcceptError::Retry, "{n}");
        }
        for n in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert_eq!(accept_error(&e(n)), AcceptError::Later, "{n}");
        }
        for n in [libc::EINVAL, libc::EBADF, libc::ENOTSOCK] {
            assert_eq!(accept_error(&e(n)), AcceptError::Stop, "{n}");
        }
    }
}
