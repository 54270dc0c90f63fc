//! The device: one UDP socket, one engine thread, and the tables of queue pairs and memory
//! regions. Application threads post work and transmit on their own; the engine thread
//! receives packets, runs timers and delivers completions. It sleeps in `epoll_wait` when there
//! is nothing to do (no busy polling), and is woken through an eventfd only when a new timer is
//! earlier than the one it sleeps on.

use crate::mr::MrTable;
use crate::rc::{CqSide, RcQp, WorkCompletion};
use crate::transport::fault::{FaultConfig, FaultInjector, FaultStats, Release};
use crate::transport::pcap::PcapWriter;
use crate::transport::steer::{self, PortMode};
use crate::transport::udp::{MAX_DATAGRAM, MAX_GSO_SEGMENTS, RecvBatch, UdpOptions, UdpSocket};
use crate::wire::{IcrcHeaders, Packet, PacketRepr, verify_icrc};

use parking_lot::{Mutex, RwLock};
use rustix::event::{EventfdFlags, epoll};
use rustix::fd::{AsFd, OwnedFd};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a [`Device`](crate::Device) is set up.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// The IPv4 address (the device's GID) and UDP port the engine uses. The address must be a
    /// specific local address. Port 0 picks a free port; Linux rxe peers always send to 4791.
    /// With port 4791 (and [`Self::steer`]) the device shares the port with other processes
    /// (see [`crate::transport::steer`]); with any other port it binds that port, as peers
    /// that are told the port expect.
    pub addr: SocketAddrV4,
    /// With `addr` on the RoCE port (4791): claim a QPN range and its own port and receive
    /// through the steering program when it is attached, else own 4791 as before, else open
    /// local-only ([`crate::transport::steer::PortMode`]). Default on; off binds 4791 itself
    /// (and fails when it is taken).
    pub steer: bool,
    /// Send packets of one work request in one `sendmsg` with UDP GSO.
    pub gso: bool,
    /// Let the kernel coalesce received datagrams (UDP GRO).
    pub gro: bool,
    /// Further local addresses this device serves besides `addr` (multi-homed: a socket on each,
    /// on `addr`'s port; a queue pair sends from one of them with [`crate::QpAttr::src`], so
    /// that two links of an SMC-R link group can run over two paths on one device, sharing its
    /// memory regions). Empty: `addr` alone.
    pub extra_addrs: Vec<std::net::Ipv4Addr>,
    /// Socket receive buffer in bytes (forced beyond `rmem_max` when the process may).
    pub rcvbuf: usize,
    /// Socket send buffer in bytes.
    pub sndbuf: usize,
    /// IPv4 TTL of RoCE packets (Linux SMC uses 1 for a directly attached peer).
    pub ttl: u8,
    /// Inject faults into outgoing packets (also `SMCR_RDMA_FAULTS`).
    pub faults: Option<FaultConfig>,
    /// Capture every packet sent and received into this pcap file (also `SMCR_RDMA_PCAP`).
    pub pcap: Option<PathBuf>,
    /// Keep the counters in these words instead of the device's own memory (see
    /// [`CounterWords`]).
    pub counters: Option<SharedCounters>,
    /// How long a *driver* (an application thread waiting on a CQ it handles itself, see
    /// [`crate::CompletionQueue::begin_drive`]) polls same-host rings before it sleeps (also
    /// `SMCR_SPIN_US`; 0 turns it off). A message that comes within it costs no sleep and no
    /// wake-up — a cross-CPU wake-up costs tens of microseconds on some machines. The spinning
    /// yields the CPU at every turn (a peer on the same CPU runs meanwhile) and adapts: after
    /// spins that caught nothing it gets shorter, down to none, until a wait ends quickly
    /// again. Default 15 µs (longer spins cost bulk transfers: iperf3 on one host moved 33–38
    /// Gbit/s with 50 µs, 47–51 with 10–15, at the same ping-pong latency).
    pub spin: Duration,
}

impl DeviceConfig {
    /// Defaults for a device on `addr`.
    pub fn new(addr: SocketAddrV4) -> Self {
        Self {
            addr,
            steer: true,
            extra_addrs: Vec::new(),
            gso: true,
            gro: true,
            rcvbuf: 8 << 20,
            sndbuf: 8 << 20,
            ttl: 64,
            faults: None,
            pcap: None,
            counters: None,
            spin: crate::env::var("SMCR_SPIN_US")
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(DEFAULT_SPIN, |us| Duration::from_micros(us.min(10_000))),
        }
    }
}

/// See [`DeviceConfig::spin`].
const DEFAULT_SPIN: Duration = Duration::from_micros(15);

/// Defines [`DeviceStats`] and its atomic twin from one list, so that their order (which is
/// the layout of [`CounterWords`]) cannot drift apart.
macro_rules! device_counters {
    ($( $(#[$doc:meta])* $name:ident, )*) => {
        /// Counters of a device (all monotonic).
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct DeviceStats {
            $( $(#[$doc])* pub $name: u64, )*
        }

        impl DeviceStats {
            /// The counters' names, in the order of [`Self::to_words`].
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name)),*];
            /// How many counters there are.
            pub const COUNT: usize = Self::NAMES.len();

            /// The counters in [`Self::NAMES`] order.
            pub fn to_words(&self) -> [u64; Self::COUNT] {
                [$(self.$name),*]
            }

            /// Counters from words in [`Self::NAMES`] order (missing ones are 0).
            pub fn from_words(w: &[u64]) -> Self {
                let mut it = w.iter().copied();
                Self { $( $name: it.next().unwrap_or(0), )* }
            }
        }

        /// The atomic counters a device bumps: laid out as [`DeviceStats::COUNT`] words.
        #[derive(Default)]
        #[repr(C)]
        struct AtomicStats {
            $( $name: AtomicU64, )*
        }

        impl AtomicStats {
            fn load(&self) -> DeviceStats {
                DeviceStats { $( $name: self.$name.load(Ordering::Relaxed), )* }
            }
        }
    };
}

device_counters! {
    /// RoCE packets sent.
    tx_packets,
    /// `sendmsg` calls made.
    tx_syscalls,
    /// Sends the kernel refused.
    tx_errors,
    /// RoCE packets received.
    rx_packets,
    /// Receive system calls that returned data.
    rx_syscalls,
    /// Packets dropped because they did not parse.
    rx_malformed,
    /// Packets dropped because their ICRC was wrong.
    rx_icrc_errors,
    /// Packets for a QP number that does not exist.
    rx_unknown_qp,
    /// Packets from an address other than the QP's peer.
    rx_wrong_source,
    /// Packets whose IPv4 identification (solved from the ICRC) is not one our senders use:
    /// from a Linux rxe peer.
    rx_foreign_ip_id,
    /// Times an application thread woke the engine.
    engine_kicks,
    /// Same-host offers accepted (a peer's QP on this host sends to ours through shared
    /// memory).
    shm_offers,
    /// QPs failed because their shared memory was corrupt or refused an access.
    shm_faults,
    /// Request packets sent again (go-back-N after a NAK, a probe or a timeout).
    tx_retransmits,
    /// Early retransmissions: no ACK within the measured round trip (no retry spent).
    rc_probes,
    /// Local ACK timeouts (a retry spent).
    rc_timeouts,
    /// Sequence-error NAKs received.
    rx_naks,
    /// RNR NAKs received (the peer had no receive posted).
    rx_rnr_naks,
    /// Sequence-error NAKs sent.
    tx_naks,
    /// RNR NAKs sent.
    tx_rnr_naks,
    /// Duplicate requests received (the peer resent what we had).
    rx_duplicates,
    /// Requests refused with a remote access error (bad rkey, range or rights).
    rx_access_errors,
}

/// Words a device keeps its counters in, when its user provides them: smcr puts them in its
/// shared-memory stats area, so that `smc-stat` reads the engine's counters live from outside
/// the process. [`DeviceStats::NAMES`] gives the order.
pub trait CounterWords: Send + Sync {
    /// At least [`DeviceStats::COUNT`] words (a shorter slice is not used).
    fn words(&self) -> &[AtomicU64];
}

/// [`DeviceConfig::counters`]: someone else's [`CounterWords`].
#[derive(Clone)]
pub struct SharedCounters(pub Arc<dyn CounterWords>);

impl std::fmt::Debug for SharedCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedCounters")
    }
}

/// Where a device's counters are.
enum Counters {
    Own(Box<AtomicStats>),
    Shared(Arc<dyn CounterWords>),
}

impl Counters {
    fn new(shared: Option<&SharedCounters>) -> Self {
        match shared {
            Some(s) if s.0.words().len() >= DeviceStats::COUNT => Self::Shared(s.0.clone()),
            _ => Self::Own(Box::default()),
        }
    }
}

impl std::ops::Deref for Counters {
    type Target = AtomicStats;

    fn deref(&self) -> &AtomicStats {
        match self {
            Self::Own(b) => b,
            Self::Shared(s) => {
                let w = s.words();
                debug_assert!(w.len() >= DeviceStats::COUNT);
                // SAFETY: `AtomicStats` is `repr(C)` with `DeviceStats::COUNT` `AtomicU64`
                // fields, the layout of that many consecutive `AtomicU64`s, which `w` holds
                // (checked in `new`); it lives as long as `s`, which we hold.
                unsafe { &*w.as_ptr().cast::<AtomicStats>() }
            }
        }
    }
}

/// How many transport counters [`Shared::count_rc`] follows per QP.
const RC_COUNTERS: usize = 9;

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Completion queue state shared by the application handle and the engine.
///
/// Two kinds of sleepers wait for completions, each on its own descriptor so that a
/// completion wakes one of them, not both: *drivers* (application threads that handle
/// completions themselves while they wait, [`crate::CompletionQueue::begin_drive`]) on
/// `event_driver`, and everyone else (a poller thread, `ibv_req_notify_cq` users) on `event`.
/// While a driver is at work the others are not signalled: the driver covers the queue.
pub(crate) struct CqShared {
    pub(crate) queue: Mutex<VecDeque<WorkCompletion>>,
    pub(crate) event: OwnedFd,
    pub(crate) armed: AtomicBool,
    pub(crate) event_driver: OwnedFd,
    pub(crate) armed_driver: AtomicBool,
    /// Threads between `begin_drive` and `end_drive`.
    pub(crate) drivers: AtomicU32,
    /// When the last drive ended (device nanoseconds; 0: never).
    pub(crate) drive_ended: AtomicU64,
    /// Driver spins in a row that caught nothing (each halves the next one).
    pub(crate) spin_fails: AtomicU32,
    /// Who sleeps, for the waiting words of the same-host rings.
    pub(crate) sleepers: Mutex<Sleepers>,
    /// QPs receiving into this CQ through a same-host ring: whoever polls or waits on the CQ
    /// turns their ring entries into completions.
    pub(crate) shm_qps: Mutex<Vec<std::sync::Weak<QpShared>>>,
    /// Set by `CompletionQueue::kick`: a poller in `wait_ready` returns to recompute its
    /// timers rather than sleeping on to its old deadline.
    pub(crate) kicked: AtomicBool,
}

/// Sleepers of a CQ (see [`CqShared`]).
#[derive(Default)]
pub(crate) struct Sleepers {
    /// Threads asleep on `event` (a poller).
    pub(crate) event: u32,
    /// An `ibv_req_notify_cq` user armed `event`.
    pub(crate) notify: bool,
    /// Drivers asleep on `event_driver`.
    pub(crate) drivers: u32,
}

impl Sleepers {
    fn event_woke(&mut self) {
        self.event = self.event.saturating_sub(1);
    }

    fn driver_woke(&mut self) {
        self.drivers = self.drivers.saturating_sub(1);
    }
}

impl CqShared {
    pub(crate) fn new() -> io::Result<Self> {
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            event: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            armed: AtomicBool::new(false),
            event_driver: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            armed_driver: AtomicBool::new(false),
            drivers: AtomicU32::new(0),
            drive_ended: AtomicU64::new(0),
            spin_fails: AtomicU32::new(0),
            sleepers: Mutex::new(Sleepers::default()),
            shm_qps: Mutex::new(Vec::new()),
            kicked: AtomicBool::new(false),
        })
    }

    pub(crate) fn push(&self, wc: WorkCompletion) {
        self.queue.lock().push_back(wc);
        // A driver at work covers the queue: only it is signalled (if it sleeps). Ordering:
        // `end_drive` lowers `drivers` before it looks at the queue, under the queue's lock,
        // so either it sees this completion or we see `drivers` at 0.
        if self.drivers.load(Ordering::SeqCst) > 0 {
            if self.armed_driver.swap(false, Ordering::AcqRel) {
                let _ = rustix::io::write(&self.event_driver, &1u64.to_ne_bytes());
            }
        } else if self.armed.swap(false, Ordering::AcqRel) {
            let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
        }
    }

    /// The waiting word the same-host producers see (`samehost::WAIT_*` bits).
    fn waiting_word(&self, s: &Sleepers) -> u32 {
        let mut w = 0;
        if s.drivers > 0 {
            w |= crate::samehost::WAIT_DRIVER;
        }
        if (s.event > 0 || s.notify) && self.drivers.load(Ordering::SeqCst) == 0 {
            w |= crate::samehost::WAIT_EVENT;
        }
        w
    }
}

/// A QP's state behind its lock.
pub(crate) struct QpCore {
    pub(crate) rc: RcQp,
    pub(crate) av: Option<SocketAddrV4>,
    /// Our source address on this QP's path (a multi-homed device's other address).
    pub(crate) src: Option<Ipv4Addr>,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    timer_at: Option<Instant>,
    /// Same-host transport state (QPs of a shared protection domain).
    pub(crate) shm: Option<crate::samehost::ShmQp>,
    /// The transport's counters as last added to the device's (see [`Shared::count_rc`]).
    counted: [u64; RC_COUNTERS],
}

pub(crate) struct QpShared {
    pub(crate) qpn: u32,
    pub(crate) core: Mutex<QpCore>,
}

impl QpShared {
    pub(crate) fn new(
        rc: RcQp,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        shm: Option<crate::samehost::ShmQp>,
    ) -> Self {
        Self {
            qpn: rc.qp_num(),
            core: Mutex::new(QpCore {
                rc,
                av: None,
                src: None,
                send_cq,
                recv_cq,
                timer_at: None,
                shm,
                counted: [0; RC_COUNTERS],
            }),
        }
    }
}

struct Middleware {
    faults: Option<FaultInjector>,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    released: Vec<Release>,
}

/// Room after each packet's head in the scratch buffer for pad bytes and the ICRC.
const TRAILER: usize = 8;

struct Pending {
    head: usize,
    parts: crate::rc::TxParts,
}

/// Scratch space for one transmit pass: packet heads and trailers, and the iovecs of a batch.
struct TxScratch {
    buf: Box<[u8]>,
    used: usize,
    bytes: usize,
    pkts: Vec<Pending>,
    iov: Vec<libc::iovec>,
}

// SAFETY: the raw pointers inside are only used while the owning thread holds the QP lock.
unsafe impl Send for TxScratch {}

impl TxScratch {
    fn new() -> Self {
        Self {
            buf: vec![0u8; TX_BUF].into_boxed_slice(),
            used: 0,
            bytes: 0,
            pkts: Vec::with_capacity(MAX_GSO_SEGMENTS),
            iov: Vec::with_capacity(MAX_GSO_SEGMENTS * 7),
        }
    }

    fn reset(&mut self) {
        self.used = 0;
        self.bytes = 0;
        self.pkts.clear();
    }

    /// Another packet (of at most 64 + 4096 bytes, and its head in the buffer) fits the batch.
    fn has_room(&self) -> bool {
        self.bytes + 4096 + 64 + TRAILER <= MAX_DATAGRAM
            && self.pkts.len() < MAX_GSO_SEGMENTS
            && self.used + 4096 + 64 + TRAILER <= self.buf.len()
    }
}

/// Pseudo QP number used for the fault injector's timer.
const FAULT_TIMER: u32 = u32::MAX;
/// Size of a transmit scratch buffer: a full GSO batch plus one packet.
const TX_BUF: usize = MAX_DATAGRAM + 8192;

pub(crate) struct Shared {
    pub(crate) cfg: DeviceConfig,
    pub(crate) sock: UdpSocket,
    /// The address peers send to: our IPv4 address and the RoCE port (or the configured or
    /// private port, see [`PortMode`]).
    pub(crate) local: SocketAddrV4,
    /// How packets reach us.
    pub(crate) mode: PortMode,
    /// Our QPN range: every QPN of the device is `range << 12 | index`.
    pub(crate) range: u32,
    /// The destination port peers' packets carry (the ICRC covers it): the RoCE port unless
    /// the configuration named another. A packet that fails the ICRC with it is checked with
    /// the receiving socket's own port (a peer that addressed that port directly).
    addressed: u16,
    /// A socket on each further address (see [`DeviceConfig::extra_addrs`]), on the same
    /// port: a queue pair whose path starts there sends through it, and what it receives is
    /// addressed to it. Only the engine thread receives on them (with `alt_rx`); the main
    /// socket's receiving may be handed to application threads.
    alt: Vec<(Ipv4Addr, UdpSocket)>,
    /// [`PortMode::Owner`]: our range's port on every address, receive only (packets steered
    /// to us once the steering program is attached). Engine thread only, as `alt`.
    spare: Vec<(Ipv4Addr, UdpSocket)>,
    alt_rx: Mutex<RxState>,
    pub(crate) mrs: MrTable,
    pub(crate) qps: RwLock<HashMap<u32, Arc<QpShared>>>,
    /// The next QP index to try (round robin through the range, from a random start).
    next_qpn: AtomicU32,
    pub(crate) next_pd: AtomicU32,
    timers: Mutex<BinaryHeap<Reverse<(Instant, u32)>>>,
    /// When the engine will wake by itself (ns since `base`); 0 while it is awake.
    sleep_until: AtomicU64,
    base: Instant,
    kick: OwnedFd,
    stop: AtomicBool,
    mw: Option<Mutex<Middleware>>,
    tx_bufs: Mutex<Vec<TxScratch>>,
    rx: Mutex<RxState>,
    /// A thread found the socket readable but the receive state taken (see [`RxGuard`]).
    rx_wanted: AtomicBool,
    /// The engine thread's epoll set (socket and kick eventfd).
    epoll: OwnedFd,
    /// Why the engine thread does not watch the socket now (see `engine_rx_interest`).
    rx_away: Mutex<u32>,
    /// Threads watching the socket from their own epoll sets ([`Self::delegate_rx`]).
    delegated: AtomicU32,
    /// Readable when delegation starts: a thread asleep in a receive of its own (holding the
    /// receive state) lets go of it.
    rx_yield: OwnedFd,
    stats: Counters,
    /// The same-host rendezvous (abstract Unix socket), if it could be bound.
    rendezvous: Option<OwnedFd>,
    /// Accepted rendezvous connections whose offer has not arrived yet, by descriptor number.
    offers: Mutex<HashMap<i32, OwnedFd>>,
}

/// Engine epoll tags.
const EV_SOCK: u64 = 0;
const EV_KICK: u64 = 1;
const EV_RENDEZVOUS: u64 = 2;
/// `EV_OFFER | fd`: an accepted connection whose offer is awaited.
const EV_OFFER: u64 = 3 << 32;
/// `EV_PEER | qpn`: the connection a QP's peer offer came on.
const EV_PEER: u64 = 4 << 32;
/// Readable: further address `low 32 bits` of a multi-homed device.
const EV_ALT: u64 = 5 << 32;
/// Readable: spare socket `low 32 bits` (our range's port while we own the RoCE port).
const EV_SPARE: u64 = 6 << 32;
/// `EV_OFFERED | qpn`: the connection our QP's offer went on hung up before the peer's offer
/// came (the peer refused it or is gone): its held requests go over UDP.
const EV_OFFERED: u64 = 7 << 32;

impl Shared {
    pub(crate) fn open(mut cfg: DeviceConfig) -> io::Result<Arc<Self>> {
        if cfg.addr.ip().is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an RDMA device binds to a specific local IPv4 address (its GID), not 0.0.0.0",
            ));
        }
        if cfg.faults.is_none()
            && let Some(f) = FaultConfig::from_env()
        {
            cfg.faults = Some(f.map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("SMCR_RDMA_FAULTS: {e}"),
                )
            })?);
        }
        if cfg.pcap.is_none() {
            cfg.pcap = crate::env::var("SMCR_RDMA_PCAP")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from);
        }
        let faults = cfg
            .faults
            .filter(FaultConfig::is_active)
            .map(FaultInjector::new);
        let pcap = match &cfg.pcap {
            Some(p) => Some(PcapWriter::create(p).map_err(|e| {
                io::Error::new(e.kind(), format!("pcap file {}: {e}", p.display()))
            })?),
            None => None,
        };
        let stats = Counters::new(cfg.counters.as_ref());
        let mw = (faults.is_some() || pcap.is_some()).then(|| {
            Mutex::new(Middleware {
                faults,
                pcap,
                released: Vec::new(),
            })
        });
        let opts = UdpOptions {
            rcvbuf: cfg.rcvbuf,
            sndbuf: cfg.sndbuf,
            gro: cfg.gro,
            ttl: cfg.ttl,
            pktinfo: false,
        };
        // One socket per address (not one on the wildcard address): other processes keep the
        // port on this host's other addresses.
        let steer = cfg.steer && cfg.addr.port() == steer::ROCE_PORT;
        let claim = steer::claim(cfg.addr, &cfg.extra_addrs, opts, steer)?;
        let steer::Claim {
            mode,
            range,
            main: sock,
            alt,
            spare,
            rendezvous,
            advertised,
            addressed,
        } = claim;
        let local = SocketAddrV4::new(*cfg.addr.ip(), advertised);
        let seed = (std::process::id() ^ range << 16 ^ steer::random_u32()) | 1;
        let kick = crate::fdzone::place(rustix::event::eventfd(
            0,
            EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
        )?)?;
        let ep = crate::fdzone::place(epoll::create(epoll::CreateFlags::CLOEXEC)?)?;
        epoll::add(
            &ep,
            sock.fd().as_fd(),
            epoll::EventData::new_u64(EV_SOCK),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &ep,
            kick.as_fd(),
            epoll::EventData::new_u64(EV_KICK),
            epoll::EventFlags::IN,
        )?;
        for (i, (_, s)) in alt.iter().enumerate() {
            epoll::add(
                &ep,
                s.fd().as_fd(),
                epoll::EventData::new_u64(EV_ALT | i as u64),
                epoll::EventFlags::IN,
            )?;
        }
        for (i, (_, s)) in spare.iter().enumerate() {
            epoll::add(
                &ep,
                s.fd().as_fd(),
                epoll::EventData::new_u64(EV_SPARE | i as u64),
                epoll::EventFlags::IN,
            )?;
        }
        // Not fatal: without it, peers on this host use UDP to reach us.
        if let Some(r) = &rendezvous {
            epoll::add(
                &ep,
                r.as_fd(),
                epoll::EventData::new_u64(EV_RENDEZVOUS),
                // Edge-triggered: a failed accept (EMFILE) must not make the engine spin.
                epoll::EventFlags::IN | epoll::EventFlags::ET,
            )?;
        }
        Ok(Arc::new(Self {
            cfg,
            sock,
            local,
            mode,
            range,
            addressed,
            alt,
            spare,
            alt_rx: Mutex::new(RxState {
                batch: RecvBatch::new(RX_BATCH),
                dirty: Vec::new(),
                ids: IdCache::default(),
            }),
            mrs: MrTable::new(seed.wrapping_mul(0x9E37_79B9)),
            qps: RwLock::new(HashMap::new()),
            // A process that restarts on the same address should not reuse its predecessor's
            // QPNs (a peer's stale QP would still send to them): a random range, and a random
            // start in it.
            next_qpn: AtomicU32::new(steer::random_u32() % steer::PROBE_INDEX),
            next_pd: AtomicU32::new(1),
            timers: Mutex::new(BinaryHeap::new()),
            sleep_until: AtomicU64::new(0),
            base: Instant::now(),
            kick,
            stop: AtomicBool::new(false),
            mw,
            tx_bufs: Mutex::new(Vec::new()),
            rx_wanted: AtomicBool::new(false),
            rx: Mutex::new(RxState {
                batch: RecvBatch::new(RX_BATCH),
                dirty: Vec::new(),
                ids: IdCache::default(),
            }),
            epoll: ep,
            rx_away: Mutex::new(0),
            delegated: AtomicU32::new(0),
            rx_yield: crate::fdzone::place(rustix::event::eventfd(
                0,
                EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
            )?)?,
            stats,
            rendezvous,
            offers: Mutex::new(HashMap::new()),
        }))
    }

    pub(crate) fn stats(&self) -> DeviceStats {
        self.stats.load()
    }

    pub(crate) fn fault_stats(&self) -> Option<FaultStats> {
        self.mw.as_ref()?.lock().faults.as_ref().map(|f| f.stats)
    }

    fn nanos(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    fn wake_engine(&self) {
        bump(&self.stats.engine_kicks, 1);
        let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
    }

    /// Asks the engine to call back for `qpn` at `at`.
    fn schedule(&self, at: Instant, qpn: u32) {
        let mut heap = self.timers.lock();
        heap.push(Reverse((at, qpn)));
        let sleeping = self.sleep_until.load(Ordering::Acquire);
        if sleeping != 0 && self.nanos(at) < sleeping {
            // Mark it awake so that a burst of earlier timers kicks only once.
            self.sleep_until.store(0, Ordering::Release);
            drop(heap);
            self.wake_engine();
        }
    }

    /// Sends what the QP has to send, hands out its completions and re-arms its timer.
    /// Called with the QP locked, from any thread.
    /// Adds what the QP's transport counted since the last call to the device's counters.
    fn count_rc(&self, core: &mut QpCore) {
        let (q, r) = (core.rc.requester_stats(), core.rc.responder_stats());
        let now = [
            q.retransmits,
            q.probes,
            q.timeouts,
            q.naks,
            q.rnr_naks,
            r.nak_seq,
            r.rnr_nak,
            r.duplicates,
            r.access_errors,
        ];
        let st = &self.stats;
        let to = [
            &st.tx_retransmits,
            &st.rc_probes,
            &st.rc_timeouts,
            &st.rx_naks,
            &st.rx_rnr_naks,
            &st.tx_naks,
            &st.tx_rnr_naks,
            &st.rx_duplicates,
            &st.rx_access_errors,
        ];
        for ((&n, old), c) in now.iter().zip(&mut core.counted).zip(to) {
            // A requester made anew (the QP reset and reused) counts from 0 again.
            let d = n.checked_sub(*old).unwrap_or(n);
            if d > 0 {
                bump(c, d);
            }
            *old = n;
        }
    }

    pub(crate) fn drive(&self, core: &mut QpCore, now: Instant) {
        let mut retry = false;
        let mut hold_until = None;
        if let Some(shm) = &mut core.shm {
            // Requests held for the peer's offer go first: through shared memory if it came,
            // over UDP if the wait is over.
            shm.settle(&mut core.rc, core.av, now, &self.mrs);
            hold_until = shm.hold_deadline();
            if shm.active {
                shm.flush(&mut core.rc);
                shm.ring_bell();
                retry = shm.backlog_len() > 0;
            }
            if let Err(f) = shm.receive(&mut core.rc) {
                bump(&self.stats.shm_faults, 1);
                core.rc.fail();
                shm.disconnect(Some(&mut core.rc));
                shm.fault = Some(f.0);
            }
        }
        if let Some(dst) = core.av {
            self.transmit(core, dst, now);
        }
        self.count_rc(core);
        while let Some((side, wc)) = core.rc.poll_completion() {
            match side {
                CqSide::Send => core.send_cq.push(wc),
                CqSide::Recv => core.recv_cq.push(wc),
            }
        }
        let mut next = core.rc.poll_timeout();
        if let Some(h) = hold_until {
            next = Some(next.map_or(h, |t| t.min(h)));
        }
        if retry {
            // The peer's ring is full: look again soon (its consumer frees slots as it goes).
            let r = now + Duration::from_micros(200);
            next = Some(next.map_or(r, |t| t.min(r)));
        }
        if let Some(t) = next
            && core.timer_at.is_none_or(|old| t < old)
        {
            core.timer_at = Some(t);
            self.schedule(t, core.rc.qp_num());
        }
    }

    fn transmit(&self, core: &mut QpCore, dst: SocketAddrV4, now: Instant) {
        let src = core.src.unwrap_or(*self.local.ip());
        let mut tx = self.tx_bufs.lock().pop().unwrap_or_else(TxScratch::new);
        tx.reset();
        let mut seg = 0;
        // Requests first, so that an ACK closes their batch; but once a batch had to be sent
        // full (bulk), what the responder has goes next instead of after the whole window.
        let mut req_first = true;
        loop {
            if !tx.has_room() {
                self.flush(&mut tx, seg, dst, src, now);
                req_first = false;
            }
            let at = tx.used;
            let Some(parts) = core
                .rc
                .poll_transmit_parts(now, &mut tx.buf[at..], req_first)
            else {
                break;
            };
            let len = parts.len();
            if !tx.pkts.is_empty() && len > seg {
                // A longer packet cannot follow in the same GSO batch: send the batch first.
                self.flush(&mut tx, seg, dst, src, now);
            }
            tx.used = at + parts.head + TRAILER;
            if tx.pkts.is_empty() {
                seg = len;
            }
            tx.bytes += len;
            tx.pkts.push(Pending { head: at, parts });
            if len < seg || !self.cfg.gso {
                // A shorter packet ends a GSO batch (without GSO, each packet is one).
                self.flush(&mut tx, seg, dst, src, now);
            }
        }
        if !tx.pkts.is_empty() {
            self.flush(&mut tx, seg, dst, src, now);
        }
        self.tx_bufs.lock().push(tx);
    }

    fn icrc_headers(&self, src: Ipv4Addr, dst: SocketAddrV4, ip_id: u16) -> IcrcHeaders {
        IcrcHeaders {
            src,
            dst: *dst.ip(),
            ip_id,
            df: true,
            // The port we send from (the ICRC covers the real one), not the one we advertise.
            sport: self.sock.local_addr().port(),
            dport: dst.port(),
        }
    }

    /// Sends the pending packets (all `seg` bytes long but the last) and empties the batch.
    /// Must be called with the QP still locked: payloads point into its registered memory.
    fn flush(
        &self,
        tx: &mut TxScratch,
        seg: usize,
        dst: SocketAddrV4,
        src: Ipv4Addr,
        now: Instant,
    ) {
        // Each address has its socket (see `alt`).
        let pktinfo = (src != *self.local.ip()).then_some(src);
        let count = tx.pkts.len();
        let faults = self.mw.as_ref().is_some_and(|m| m.lock().faults.is_some());
        let gso = self.cfg.gso && count > 1 && !faults;
        tx.iov.clear();
        let buf_ptr = tx.buf.as_mut_ptr();
        for (i, p) in tx.pkts.iter().enumerate() {
            // Linux numbers the identification of GSO segments 0, 1, 2, …; a lone datagram from
            // our unconnected DF socket gets 0. The ICRC covers it, so compute it per segment.
            let id = if gso { i as u16 } else { 0 };
            let head_end = p.head + p.parts.head;
            // SAFETY: head and trailer areas are disjoint parts of `tx.buf`; payload pieces point
            // into registered memory kept alive by the (locked) QP's outstanding request.
            let (head, trailer) = unsafe {
                (
                    std::slice::from_raw_parts(buf_ptr.add(p.head), p.parts.head),
                    std::slice::from_raw_parts_mut(buf_ptr.add(head_end), TRAILER),
                )
            };
            let mut parts: [&[u8]; 6] = [&[]; 6];
            parts[0] = head;
            let mut n = 1;
            // SAFETY: as above.
            for s in unsafe { p.parts.payload.slices() } {
                parts[n] = s;
                n += 1;
            }
            parts[n] = &[0u8; 3][..p.parts.pad];
            let icrc =
                crate::wire::compute_icrc_vectored(&self.icrc_headers(src, dst, id), &parts[..=n]);
            trailer[..p.parts.pad].fill(0);
            trailer[p.parts.pad..p.parts.pad + 4].copy_from_slice(&icrc.to_le_bytes());
            parts[n] = &trailer[..p.parts.pad + 4];
            for s in &parts[..=n] {
                if !s.is_empty() {
                    tx.iov.push(libc::iovec {
                        iov_base: s.as_ptr() as *mut _,
                        iov_len: s.len(),
                    });
                }
            }
        }
        bump(&self.stats.tx_packets, count as u64);
        if let Some(mw) = &self.mw {
            // Capture and fault injection work on contiguous copies of each packet.
            let mut flat = Vec::with_capacity(tx.bytes);
            for v in &tx.iov {
                // SAFETY: the iovecs were built above from live memory.
                flat.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
            let mut mw = mw.lock();
            let mw = &mut *mw;
            let mut at = 0;
            for (i, p) in tx.pkts.iter().enumerate() {
                let pkt = &flat[at..at + p.parts.len()];
                at += p.parts.len();
                let id = if gso { i as u16 } else { 0 };
                if let Some(pc) = &mut mw.pcap {
                    let _ = pc.write_packet(&self.icrc_headers(src, dst, id), self.cfg.ttl, pkt);
                }
                if let Some(f) = &mut mw.faults {
                    f.process(now, dst, pktinfo, pkt.to_vec(), &mut mw.released);
                }
            }
            if mw.faults.is_some() {
                for r in mw.released.drain(..) {
                    self.send_raw(r.dst, r.src, &r.bytes, None);
                }
                if let Some(t) = mw.faults.as_ref().and_then(FaultInjector::next_due) {
                    self.schedule(t, FAULT_TIMER);
                }
                tx.reset();
                return;
            }
        }
        bump(&self.stats.tx_syscalls, 1);
        // SAFETY: the iovecs point at `tx.buf` and at registered memory, both alive here.
        if unsafe {
            self.sock_for(pktinfo)
                .send_iov(dst, None, &tx.iov, gso.then_some(seg as u16))
        }
        .is_err()
        {
            bump(&self.stats.tx_errors, 1);
        }
        tx.reset();
    }

    /// The socket of local address `src` (`None`: the device's own).
    fn sock_for(&self, src: Option<Ipv4Addr>) -> &UdpSocket {
        src.and_then(|a| self.alt.iter().find(|(x, _)| *x == a))
            .map_or(&self.sock, |(_, s)| s)
    }

    fn send_raw(&self, dst: SocketAddrV4, src: Option<Ipv4Addr>, bytes: &[u8], gso: Option<u16>) {
        bump(&self.stats.tx_syscalls, 1);
        if self.sock_for(src).send(dst, None, bytes, gso).is_err() {
            bump(&self.stats.tx_errors, 1);
        }
    }

    fn release_faulted(&self, now: Instant) {
        let Some(mw) = &self.mw else { return };
        let mut guard = mw.lock();
        let mw = &mut *guard;
        let Some(f) = &mut mw.faults else { return };
        f.release(now, &mut mw.released);
        let next = f.next_due();
        for r in mw.released.drain(..) {
            self.send_raw(r.dst, r.src, &r.bytes, None);
        }
        drop(guard);
        if let Some(t) = next {
            self.timers.lock().push(Reverse((t, FAULT_TIMER)));
        }
    }

    /// Accepts connections on the rendezvous; their offers are read when they arrive.
    fn accept_offers(&self) {
        let Some(l) = &self.rendezvous else { return };
        while let Ok(c) = rustix::net::accept_with(
            l,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
        ) {
            if !crate::samehost::trusted(c.as_fd()) || self.offers.lock().len() >= 256 {
                continue; // another user, or too many silent connections: dropped (UDP)
            }
            let Ok(c) = crate::fdzone::place(c) else {
                continue; // no room for it: the peer's QP stays on UDP
            };
            use std::os::fd::AsRawFd;
            let raw = c.as_raw_fd();
            if epoll::add(
                &self.epoll,
                c.as_fd(),
                epoll::EventData::new_u64(EV_OFFER | u64::from(raw as u32)),
                epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
            )
            .is_ok()
            {
                self.offers.lock().insert(raw, c);
            }
        }
    }

    /// Reads the offer on accepted connection `raw` and gives it to its QP.
    fn take_offer(&self, raw: i32) {
        let Some(conn) = self.offers.lock().remove(&raw) else {
            return;
        };
        let mut buf = [0u8; crate::samehost::OFFER_LEN + 1];
        let (n, fds) = match crate::shm::recv_fds(conn.as_fd(), &mut buf) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.offers.lock().insert(raw, conn);
                return;
            }
            Err(_) => return,
        };
        let _ = epoll::delete(&self.epoll, conn.as_fd());
        let Some(offer) = crate::samehost::Offer::parse(&buf[..n]) else {
            return;
        };
        let Some(qp) = self.lookup(offer.to_qpn) else {
            return;
        };
        let Ok(tx) = crate::samehost::PeerTx::new(&offer, fds, conn) else {
            return;
        };
        let mut core = qp.core.lock();
        let Some(shm) = &mut core.shm else { return };
        if shm.active {
            // Already sending through shared memory to its peer: a second offer is refused.
            return;
        }
        if epoll::add(
            &self.epoll,
            tx.conn.as_fd(),
            epoll::EventData::new_u64(EV_PEER | u64::from(offer.to_qpn)),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        )
        .is_err()
        {
            return;
        }
        // A newer offer replaces an older one (the peer QP was recreated).
        shm.tx = Some(tx);
        bump(&self.stats.shm_offers, 1);
        self.drive(&mut core, Instant::now());
    }

    /// The connection QP `qpn`'s offer went on hung up. Before the peer's offer came, the peer
    /// refused ours (another user, no shared memory, not that QP) or is gone: stop waiting
    /// for its offer, send the held requests over UDP.
    fn offer_refused(&self, qpn: u32) {
        let Some(qp) = self.lookup(qpn) else { return };
        let mut core = qp.core.lock();
        let Some(shm) = &mut core.shm else { return };
        if let Some(c) = &shm.offered {
            let _ = epoll::delete(&self.epoll, c.as_fd());
        }
        if shm.tx.is_some() || shm.active {
            return; // the peer's offer came: its own connection tells when it goes
        }
        shm.offered = None;
        self.drive(&mut core, Instant::now());
    }

    /// Watches the connection our QP `qpn`'s offer went on (see [`Self::offer_refused`]).
    pub(crate) fn watch_offer(&self, qpn: u32, conn: &OwnedFd) {
        let _ = epoll::add(
            &self.epoll,
            conn.as_fd(),
            epoll::EventData::new_u64(EV_OFFERED | u64::from(qpn)),
            epoll::EventFlags::RDHUP,
        );
    }

    /// A free QPN of our range, or `None` when all 4095 are in use.
    pub(crate) fn alloc_qpn(&self) -> Option<u32> {
        let qps = self.qps.read();
        for _ in 0..steer::PROBE_INDEX {
            let i = self.next_qpn.fetch_add(1, Ordering::Relaxed) % steer::PROBE_INDEX;
            let qpn = steer::qpn_of(self.range, i);
            if !qps.contains_key(&qpn) {
                return Some(qpn);
            }
        }
        None
    }

    /// The peer of QP `qpn` went away (its offer's connection closed): deliver what it left
    /// in our ring, then fail the QP so its user learns at once.
    fn peer_gone(&self, qpn: u32) {
        let Some(qp) = self.lookup(qpn) else { return };
        let mut core = qp.core.lock();
        let QpCore { rc, shm, .. } = &mut *core;
        let Some(shm) = shm else { return };
        let Some(tx) = &shm.tx else { return };
        let _ = epoll::delete(&self.epoll, tx.conn.as_fd());
        let _ = shm.receive(rc);
        rc.fail();
        shm.disconnect(Some(rc));
        self.drive(&mut core, Instant::now());
    }

    pub(crate) fn lookup(&self, qpn: u32) -> Option<Arc<QpShared>> {
        self.qps.read().get(&qpn).cloned()
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake_engine();
    }
}

/// Receive state: whoever holds it (the engine thread, or an application thread waiting for
/// completions) reads the socket.
/// The receive state, taken. A watcher of the socket woken edge-triggered
/// ([`crate::CompletionQueue::receive`]) that finds it taken leaves what came to its holder:
/// letting go, the holder receives again if such a watcher came by (else those packets would
/// wait for the next one to arrive).
struct RxGuard<'a> {
    shared: &'a Shared,
    g: Option<parking_lot::MutexGuard<'a, RxState>>,
}

impl std::ops::Deref for RxGuard<'_> {
    type Target = RxState;
    fn deref(&self) -> &RxState {
        self.g.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for RxGuard<'_> {
    fn deref_mut(&mut self) -> &mut RxState {
        self.g.as_mut().expect("held until drop")
    }
}

impl Drop for RxGuard<'_> {
    fn drop(&mut self) {
        drop(self.g.take());
        self.shared.rx_recheck();
    }
}

pub(crate) struct RxState {
    batch: RecvBatch,
    dirty: Vec<Arc<QpShared>>,
    ids: IdCache,
}

/// Identification values our senders use: segment indices of a GSO batch.
const GSO_IDS: u16 = MAX_GSO_SEGMENTS as u16;

/// How the ICRC of a packet of one length changes with the 16 identification bits, as a
/// reduced basis: row `k` is `(delta, bits)` — the XOR of the deltas of the identification bits
/// in `bits` ([`crate::wire::ip_id_delta`]) — with distinct leading bits, highest first.
#[derive(Clone, Copy)]
struct IdBasis {
    rows: [(u32, u16); 16],
    n: usize,
}

impl IdBasis {
    fn new(len: usize) -> Self {
        let mut b = Self {
            rows: [(0, 0); 16],
            n: 0,
        };
        for i in 0..16 {
            let (mut v, mut m) = (crate::wire::ip_id_delta(len, i), 1u16 << i);
            for &(rv, rm) in &b.rows[..b.n] {
                if v ^ rv < v {
                    v ^= rv;
                    m ^= rm;
                }
            }
            if v == 0 {
                continue; // cannot happen for CRC-32 (a 16-bit burst); harmless if it did
            }
            let at = b.rows[..b.n].iter().position(|r| r.0 < v).unwrap_or(b.n);
            b.rows.copy_within(at..b.n, at + 1);
            b.rows[at] = (v, m);
            b.n += 1;
        }
        b
    }

    /// The identification bits whose flip turns the ICRC by `want`, if any.
    fn solve(&self, mut want: u32) -> Option<u16> {
        let mut bits = 0;
        for &(rv, rm) in &self.rows[..self.n] {
            if want ^ rv < want {
                want ^= rv;
                bits ^= rm;
            }
        }
        (want == 0).then_some(bits)
    }
}

/// Per packet length, how the ICRC changes with the identification (an [`IdBasis`], computed
/// once per length: RoCE lengths are multiples of 4, so at most ~1100 of them).
///
/// A plain UDP socket cannot see the IPv4 identification the ICRC covers. Our senders use the
/// GSO segment index (0 for a lone datagram; a batch split up on the way arrives as lone
/// datagrams with 1, 2, …); Linux rxe uses the kernel's per-destination counter
/// (`__ip_select_ident`), any of the 65536 values. The CRC is affine in the identification, so
/// the receiver solves for it: 16 XORs against a reduced basis.
#[derive(Default)]
pub(crate) struct IdCache {
    by_len: HashMap<usize, IdBasis>,
}

impl IdCache {
    /// The identification for which the packet's ICRC is right, given the ICRC `computed` for
    /// identification `tried` and the one `found` in the packet.
    fn find(&mut self, len: usize, tried: u16, found: u32, computed: u32) -> Option<u16> {
        let basis = self.by_len.entry(len).or_insert_with(|| IdBasis::new(len));
        basis.solve(found ^ computed).map(|bits| tried ^ bits)
    }
}

const RX_BATCH: usize = 8;

impl Shared {
    /// Reads and handles what waits on the socket, up to `rounds` recvmmsg calls; returns how
    /// many datagrams were handled.
    fn rx_drain(&self, rx: &mut RxState, rounds: usize) -> usize {
        self.rx_drain_from(&self.sock, *self.local.ip(), rx, rounds)
    }

    /// [`Self::rx_drain`] for socket `sock`, whose datagrams are addressed to `to`.
    fn rx_drain_from(
        &self,
        sock: &UdpSocket,
        to: Ipv4Addr,
        rx: &mut RxState,
        rounds: usize,
    ) -> usize {
        let gro = sock.gro();
        let own = sock.local_addr().port();
        let mut total = 0;
        for _ in 0..rounds {
            let n = match rx.batch.recv(sock) {
                Ok(n) if n > 0 => n,
                _ => break,
            };
            total += n;
            bump(&self.stats.rx_syscalls, 1);
            let now = Instant::now();
            let mut current: Option<Arc<QpShared>> = None;
            let RxState { batch, dirty, ids } = rx;
            for i in 0..n {
                let d = batch.get(i, gro);
                let seg = d.segment.unwrap_or(d.data.len()).max(1);
                for (k, chunk) in d.data.chunks(seg).enumerate() {
                    receive(
                        self,
                        now,
                        d.from,
                        (d.to.unwrap_or(to), own),
                        chunk,
                        k as u16,
                        &mut current,
                        dirty,
                        ids,
                    );
                }
            }
            for qp in dirty.drain(..) {
                let mut core = qp.core.lock();
                self.drive(&mut core, now);
            }
            if n < RX_BATCH {
                break;
            }
        }
        total
    }

    /// Turns the engine thread's interest in the socket on or off. An application thread that
    /// receives for itself turns it off, so that the engine is not woken (on the other core) by
    /// packets the application thread handles anyway.
    ///
    /// Counted: each `false` (a thread that receives, an event loop that holds a group and
    /// watches the socket itself, see [`Self::delegate_rx`]) needs its `true`; the interest
    /// is back when none is left.
    fn engine_rx_interest(&self, on: bool) {
        let mut away = self.rx_away.lock();
        if on {
            *away = away.saturating_sub(1);
            if *away > 0 {
                return;
            }
        } else {
            *away += 1;
            if *away > 1 {
                return;
            }
        }
        let flags = if on {
            epoll::EventFlags::IN
        } else {
            epoll::EventFlags::empty()
        };
        let _ = epoll::modify(
            &self.epoll,
            self.sock.fd().as_fd(),
            epoll::EventData::new_u64(EV_SOCK),
            flags,
        );
    }

    /// Blocks the calling thread until `cq` has a completion or `timeout` passes. If no other
    /// thread is receiving, the caller receives and handles packets itself, so the packet that
    /// completes its request costs one wake-up (its own), not two (engine, then caller).
    ///
    /// While drivers work on the CQ (or did within [`RECENTLY_DRIVEN`]) this sleeper leaves the
    /// socket to them and is not signalled (they cover the queue); it wakes for its timeout.
    pub(crate) fn wait_cq(&self, cq: &CqShared, timeout: Option<Duration>) -> io::Result<()> {
        let driven = cq.drivers.load(Ordering::SeqCst) > 0;
        let recent = !driven && self.recently_driven(cq);
        let timeout = if recent {
            Some(timeout.map_or(RECENTLY_DRIVEN, |t| t.min(RECENTLY_DRIVEN)))
        } else {
            timeout
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        // A CQ fed by shared memory only has nothing to receive from the socket: taking it
        // would only cost the engine's interest twice (two epoll_ctl) per wake-up.
        // Nor while an event loop watches the socket (it hands our completions over): a
        // poller taking it too would be woken for the loop's packets.
        let rx =
            if driven || recent || self.delegated.load(Ordering::SeqCst) > 0 || self.shm_only(cq) {
                None
            } else {
                self.rx_try()
            };
        let Some(mut rx) = rx else {
            cq.armed.store(true, Ordering::SeqCst);
            let pending = self.shm_sleepers(cq, |s| s.event += 1);
            // Driven: what is there is the driver's; we are signalled if it is left behind.
            let driven = cq.drivers.load(Ordering::SeqCst) > 0;
            let slept = if driven || (!pending && cq.queue.lock().is_empty()) {
                wait_readable(&cq.event, timeout)
            } else {
                Ok(false)
            };
            self.shm_sleepers(cq, Sleepers::event_woke);
            if slept? {
                drain_eventfd(&cq.event);
            }
            self.shm_poll(cq);
            return Ok(());
        };
        self.engine_rx_interest(false);
        let res = loop {
            // Armed only while asleep: completions this thread produces itself need no signal.
            cq.armed.store(true, Ordering::SeqCst);
            // Same-host producers ring the CQ's eventfd only when told we sleep.
            if self.shm_sleepers(cq, |s| s.event += 1) {
                self.shm_sleepers(cq, Sleepers::event_woke);
                self.shm_poll(cq);
                if cq.queue.lock().is_empty() {
                    // Part of a message arrived: set the flag again before sleeping.
                    continue;
                }
                break Ok(());
            }
            if !cq.queue.lock().is_empty() {
                self.shm_sleepers(cq, Sleepers::event_woke);
                break Ok(());
            }
            // Sleep first: poll returns at once if a packet is already waiting, which saves
            // a receive call that would find nothing.
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let mut fds = [
                rustix::event::PollFd::new(self.sock.fd(), rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&cq.event, rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&self.rx_yield, rustix::event::PollFlags::IN),
            ];
            let ts = left.map(timespec);
            let ready = match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => 0,
                Err(e) => {
                    self.shm_sleepers(cq, Sleepers::event_woke);
                    break Err(e.into());
                }
            };
            cq.armed.store(false, Ordering::Release);
            self.shm_sleepers(cq, Sleepers::event_woke);
            if fds[1].revents().contains(rustix::event::PollFlags::IN) {
                drain_eventfd(&cq.event);
            }
            if fds[0].revents().contains(rustix::event::PollFlags::IN) {
                self.rx_drain(&mut rx, 64);
            }
            self.shm_poll(cq);
            if !cq.queue.lock().is_empty() {
                break Ok(());
            }
            if self.delegated.load(Ordering::SeqCst) > 0 {
                // An event loop watches the socket now: it is its (the caller waits again).
                break Ok(());
            }
            if ready == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            if cq.drivers.load(Ordering::SeqCst) > 0 {
                // A driver started: it is signalled, not us; let it have the socket.
                break Ok(());
            }
        };
        cq.armed.store(false, Ordering::Release);
        // Hand receiving back to the engine thread (it wakes at once if data is waiting):
        // release first, so that the engine never finds the socket readable and the state held.
        drop(rx);
        self.engine_rx_interest(true);
        res
    }

    /// See [`crate::CompletionQueue::delegate_rx`].
    pub(crate) fn delegate_rx(&self, on: bool) {
        if on {
            if self.delegated.fetch_add(1, Ordering::SeqCst) == 0 {
                let _ = rustix::io::write(&self.rx_yield, &1u64.to_ne_bytes());
            }
        } else if self.delegated.fetch_sub(1, Ordering::SeqCst) == 1 {
            drain_eventfd(&self.rx_yield);
        }
        self.engine_rx_interest(!on);
    }

    /// See [`crate::CompletionQueue::receive`]: drains the socket (the watcher is woken
    /// edge-triggered, so what is left would wake nobody).
    pub(crate) fn receive_now(&self) -> usize {
        let mut total = 0;
        loop {
            self.rx_wanted.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            // Taken: its holder receives again once it lets go.
            let Some(mut rx) = self.rx.try_lock() else {
                return total;
            };
            self.rx_wanted.store(false, Ordering::SeqCst);
            total += self.rx_drain(&mut rx, usize::MAX);
            drop(rx);
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.rx_wanted.load(Ordering::SeqCst) {
                return total;
            }
        }
    }

    /// Takes the receive state if free (see [`RxGuard`]).
    fn rx_try(&self) -> Option<RxGuard<'_>> {
        self.rx.try_lock().map(|g| RxGuard {
            shared: self,
            g: Some(g),
        })
    }

    /// After letting go of the receive state: a thread that wanted it meanwhile (woken by
    /// the socket, edge-triggered) left its packets to us.
    fn rx_recheck(&self) -> usize {
        std::sync::atomic::fence(Ordering::SeqCst);
        // (Not while unwinding: a second panic would abort.)
        if self.rx_wanted.load(Ordering::SeqCst) && !std::thread::panicking() {
            self.receive_now()
        } else {
            0
        }
    }

    fn recently_driven(&self, cq: &CqShared) -> bool {
        let e = cq.drive_ended.load(Ordering::Acquire);
        e != 0 && self.nanos(Instant::now()).saturating_sub(e) < RECENTLY_DRIVEN.as_nanos() as u64
    }

    /// A thread starts driving `cq` (see [`crate::CompletionQueue::begin_drive`]).
    pub(crate) fn begin_drive(&self, cq: &CqShared) {
        if cq.drivers.fetch_add(1, Ordering::SeqCst) == 0 {
            // The rings stop ringing the other sleepers.
            self.shm_sleepers(cq, |_| {});
        }
    }

    /// A thread stops driving `cq`: when it was the last, the other sleepers are signalled
    /// again, and woken now if something came that no driver took.
    pub(crate) fn end_drive(&self, cq: &CqShared) {
        if cq.drivers.fetch_sub(1, Ordering::SeqCst) != 1 {
            // Other drivers remain: if this one leaves completions behind (it could not take
            // them, or took only some), the others must look.
            if !cq.queue.lock().is_empty() || self.shm_pending(cq) {
                let _ = rustix::io::write(&cq.event_driver, &1u64.to_ne_bytes());
            }
            return;
        }
        cq.drive_ended
            .store(self.nanos(Instant::now()).max(1), Ordering::Release);
        let pending = self.shm_sleepers(cq, |_| {});
        if (pending || !cq.queue.lock().is_empty()) && cq.armed.swap(false, Ordering::AcqRel) {
            let _ = rustix::io::write(&cq.event, &1u64.to_ne_bytes());
        }
    }

    /// A driver is about to sleep on `cq`'s driver descriptor (`on`), or woke: returns, when
    /// going to sleep, whether something is already there (then do not sleep).
    pub(crate) fn drive_sleep(&self, cq: &CqShared, on: bool) -> bool {
        if on {
            let pending = self.shm_sleepers(cq, |s| s.drivers += 1);
            if pending || !cq.queue.lock().is_empty() {
                self.shm_sleepers(cq, Sleepers::driver_woke);
                return true;
            }
            false
        } else {
            self.shm_sleepers(cq, Sleepers::driver_woke);
            false
        }
    }

    /// A driver about to sleep spins on `cq`'s same-host rings first (adaptively, see
    /// [`DeviceConfig::spin`]); true if something arrived (it is in the CQ).
    pub(crate) fn drive_spin(&self, cq: &CqShared) -> bool {
        let max = self.cfg.spin;
        if max.is_zero() || !self.shm_only(cq) {
            return false;
        }
        let fails = cq.spin_fails.load(Ordering::Relaxed);
        let budget = max / (1u32 << fails.min(16));
        if budget < Duration::from_micros(1) {
            return false;
        }
        if self.shm_spin(cq, budget) {
            cq.spin_fails.store(0, Ordering::Relaxed);
            return true;
        }
        cq.spin_fails.store((fails + 1).min(16), Ordering::Relaxed);
        false
    }

    /// A driver that slept woke after `slept`: had it arrived within a spin, spinning resumes.
    pub(crate) fn drive_woke_after(&self, cq: &CqShared, slept: Duration) {
        if slept < self.cfg.spin {
            cq.spin_fails.store(0, Ordering::Relaxed);
        }
    }

    /// A driver's blocking wait: like [`Self::wait_cq`], but signalled on the driver
    /// descriptor, and it takes over receiving from the socket when it can.
    pub(crate) fn drive_wait(&self, cq: &CqShared, timeout: Option<Duration>) -> io::Result<()> {
        let shm_only = self.shm_only(cq);
        if self.drive_spin(cq) {
            return Ok(());
        }
        let slept = Instant::now();
        let deadline = timeout.map(|t| slept + t);
        // A CQ fed by shared memory only has nothing to receive from the socket.
        // Nor while an event loop watches it (it hands our completions over).
        let delegated = || self.delegated.load(Ordering::SeqCst) > 0;
        let mut rx = if shm_only || delegated() {
            None
        } else {
            self.rx_try()
        };
        if rx.is_some() {
            self.engine_rx_interest(false);
        }
        let res = loop {
            if self.drive_sleep(cq, true) {
                self.shm_poll(cq);
                if cq.queue.lock().is_empty() {
                    continue; // part of a message
                }
                break Ok(());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ts = left.map(timespec);
            let ev = rustix::event::PollFd::new(&cq.event_driver, rustix::event::PollFlags::IN);
            let (r, sock_ready, ev_ready) = match &rx {
                Some(_) => {
                    let mut fds = [
                        ev,
                        rustix::event::PollFd::new(self.sock.fd(), rustix::event::PollFlags::IN),
                        rustix::event::PollFd::new(&self.rx_yield, rustix::event::PollFlags::IN),
                    ];
                    let r = rustix::event::poll(&mut fds, ts.as_ref());
                    let rd = |f: &rustix::event::PollFd<'_>| {
                        f.revents().contains(rustix::event::PollFlags::IN)
                    };
                    (r, rd(&fds[1]), rd(&fds[0]))
                }
                None => {
                    let mut fds = [ev];
                    let r = rustix::event::poll(&mut fds, ts.as_ref());
                    (
                        r,
                        false,
                        fds[0].revents().contains(rustix::event::PollFlags::IN),
                    )
                }
            };
            self.drive_sleep(cq, false);
            let ready = match r {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => 0,
                Err(e) => break Err(e.into()),
            };
            if ev_ready {
                drain_eventfd(&cq.event_driver);
            }
            if sock_ready && let Some(rx) = rx.as_mut() {
                self.rx_drain(rx, 64);
            }
            if rx.is_some() && delegated() {
                // An event loop watches the socket now: leave it to it.
                rx = None;
                self.engine_rx_interest(true);
            }
            self.shm_poll(cq);
            if ev_ready {
                self.drive_woke_after(cq, slept.elapsed());
            }
            // Signalled: even with the queue empty now (another driver took what came), the
            // caller's condition may have changed.
            if ev_ready || !cq.queue.lock().is_empty() {
                break Ok(());
            }
            if ready == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            if rx.is_none() && !shm_only && !delegated() {
                rx = self.rx_try();
                if rx.is_some() {
                    self.engine_rx_interest(false);
                }
            }
        };
        if rx.is_some() {
            drop(rx);
            self.engine_rx_interest(true);
        }
        res
    }
}

/// How long after the last drive a CQ's other sleepers keep leaving the socket to drivers
/// (an application thread between two waits comes back within it).
const RECENTLY_DRIVEN: Duration = Duration::from_millis(10);

impl Shared {
    /// Delivers what the same-host rings of `cq`'s QPs hold (and sends what waits for ring
    /// space), on the calling thread.
    pub(crate) fn shm_poll(&self, cq: &CqShared) {
        let mut list = cq.shm_qps.lock();
        if list.is_empty() {
            return;
        }
        list.retain(|w| w.strong_count() > 0);
        let now = Instant::now();
        for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
            let mut core = qp.core.lock();
            if core.shm.as_ref().is_some_and(|s| s.rx_pending(&core.rc)) {
                self.drive(&mut core, now);
            }
        }
    }

    /// Polls `cq`'s same-host rings for up to `spin`; returns whether something arrived (and
    /// was delivered into the CQ).
    fn shm_spin(&self, cq: &CqShared, spin: Duration) -> bool {
        if cq.shm_qps.lock().is_empty() {
            return false;
        }
        let until = Instant::now() + spin;
        let mut n = 0u32;
        loop {
            if self.shm_pending(cq) || !cq.queue.lock().is_empty() {
                self.shm_poll(cq);
                return !cq.queue.lock().is_empty();
            }
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            n = n.wrapping_add(1);
            // A peer on this very CPU gets to run (and answer) instead of waiting for us to
            // give up; on another CPU it costs a system call per turn.
            rustix::thread::sched_yield();
            if n.is_multiple_of(8) && Instant::now() >= until {
                return false;
            }
        }
    }

    /// Whether every QP of `cq` receives through shared memory (and there is one).
    pub(crate) fn shm_only(&self, cq: &CqShared) -> bool {
        let list = cq.shm_qps.lock();
        let mut any = false;
        for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
            if !qp.core.lock().shm.as_ref().is_some_and(|s| s.active) {
                return false;
            }
            any = true;
        }
        any
    }

    /// Whether a ring of `cq` holds something deliverable.
    fn shm_pending(&self, cq: &CqShared) -> bool {
        let list = cq.shm_qps.lock();
        list.iter().filter_map(std::sync::Weak::upgrade).any(|qp| {
            let core = qp.core.lock();
            core.shm.as_ref().is_some_and(|s| s.rx_pending(&core.rc))
        })
    }

    /// Changes who sleeps on `cq` and tells the producers of its rings (their waiting words);
    /// returns whether something can be delivered already (then do not sleep).
    pub(crate) fn shm_sleepers(&self, cq: &CqShared, change: impl FnOnce(&mut Sleepers)) -> bool {
        let mut s = cq.sleepers.lock();
        change(&mut s);
        cq.armed_driver.store(s.drivers > 0, Ordering::SeqCst);
        let word = cq.waiting_word(&s);
        let list = cq.shm_qps.lock();
        let mut pending = false;
        for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
            let core = qp.core.lock();
            if let Some(shm) = &core.shm {
                shm.set_waiting(word);
                pending |= word != 0 && shm.rx_pending(&core.rc);
            }
        }
        pending
    }
}

fn drain_eventfd(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    }
}

/// The engine thread's loop: timers, and receiving while no application thread does.
pub(crate) fn run_engine(shared: Arc<Shared>) {
    let mut evbuf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
    while !shared.stop.load(Ordering::Acquire) {
        run_timers(&shared, Instant::now());
        // Decide how long to sleep, under the timer lock so that `schedule` sees a consistent
        // picture (it kicks only when its deadline is earlier than ours).
        let timeout = {
            let heap = shared.timers.lock();
            let next = heap.peek().map(|Reverse((t, _))| *t);
            shared.sleep_until.store(
                next.map_or(u64::MAX, |t| shared.nanos(t).max(1)),
                Ordering::Release,
            );
            next.map(|t| t.saturating_duration_since(Instant::now()))
        };
        let ts = timeout.map(timespec);
        let (mut kicked, mut readable) = (false, false);
        let (mut alt_ready, mut spare_ready) = (0u64, 0u64);
        if let Ok((evs, _)) = epoll::wait(&shared.epoll, &mut evbuf, ts.as_ref()) {
            for ev in evs.iter() {
                match ev.data.u64() {
                    EV_SOCK => readable = true,
                    t if t & !0xFFFF_FFFF == EV_ALT => alt_ready |= 1 << (t as u32).min(63),
                    t if t & !0xFFFF_FFFF == EV_SPARE => spare_ready |= 1 << (t as u32).min(63),
                    t if t & !0xFFFF_FFFF == EV_OFFERED => shared.offer_refused(t as u32),
                    EV_KICK => kicked = true,
                    EV_RENDEZVOUS => shared.accept_offers(),
                    t if t & !0xFFFF_FFFF == EV_OFFER => shared.take_offer(t as u32 as i32),
                    t if t & !0xFFFF_FFFF == EV_PEER => shared.peer_gone(t as u32),
                    _ => {}
                }
            }
        }
        shared.sleep_until.store(0, Ordering::Release);
        if kicked {
            drain_eventfd(&shared.kick);
        }
        if readable {
            // Never block here: an application thread may hold the receive state while it
            // sleeps, and timers must keep running. It has turned our socket interest off (or
            // is about to), so a failed attempt does not repeat.
            if let Some(mut rx) = shared.rx_try() {
                shared.rx_drain(&mut rx, 64);
            }
        }
        if alt_ready != 0 || spare_ready != 0 {
            // Only this thread receives on the further addresses and the spare sockets: never
            // contended.
            let mut rx = shared.alt_rx.lock();
            for (ready, socks) in [(alt_ready, &shared.alt), (spare_ready, &shared.spare)] {
                for (i, (addr, sock)) in socks.iter().enumerate() {
                    if ready >> i.min(63) & 1 == 1 {
                        shared.rx_drain_from(sock, *addr, &mut rx, 64);
                    }
                }
            }
        }
    }
}

fn run_timers(shared: &Shared, now: Instant) {
    loop {
        let due = {
            let mut heap = shared.timers.lock();
            match heap.peek() {
                Some(Reverse((t, _))) if *t <= now => heap.pop().map(|Reverse(e)| e),
                _ => None,
            }
        };
        let Some((t, qpn)) = due else { return };
        if qpn == FAULT_TIMER {
            shared.release_faulted(now);
            continue;
        }
        let Some(qp) = shared.lookup(qpn) else {
            continue;
        };
        let mut core = qp.core.lock();
        if core.timer_at == Some(t) {
            core.timer_at = None;
            core.rc.handle_timeout(now);
            shared.drive(&mut core, now);
        }
    }
}

/// The IPv4 identification for which the ICRC of `bytes` (received with headers `h`, whose
/// `dport` and `ip_id` are what the receiver guesses) is right, for one of the destination
/// ports it may have been sent to: `addressed[0]` (the RoCE port: a sender that addressed 4791
/// and was steered to us) or else `addressed[1]` (the port of the socket it came on: a sender
/// that addressed it directly). `None`: the packet is corrupt. The identification is solved
/// (see [`IdCache`]): any value is accepted, since Linux rxe senders use any.
pub(crate) fn icrc_matches(
    mut h: IcrcHeaders,
    addressed: [u16; 2],
    bytes: &[u8],
    ids: &mut IdCache,
) -> Option<u16> {
    for (k, &port) in addressed.iter().enumerate() {
        if k == 1 && port == addressed[0] {
            break;
        }
        h.dport = port;
        match verify_icrc(&h, bytes) {
            Ok(()) => return Some(h.ip_id),
            Err(crate::wire::Error::BadIcrc { found, computed }) => {
                if let Some(id) = ids.find(bytes.len(), h.ip_id, found, computed) {
                    return Some(id);
                }
            }
            Err(_) => {}
        }
    }
    None
}

#[allow(clippy::too_many_arguments)] // one packet and the receive loop's scratch state
fn receive(
    shared: &Shared,
    now: Instant,
    from: SocketAddrV4,
    (to, own_port): (Ipv4Addr, u16),
    bytes: &[u8],
    ip_id: u16,
    current: &mut Option<Arc<QpShared>>,
    dirty: &mut Vec<Arc<QpShared>>,
    ids: &mut IdCache,
) {
    let st = &shared.stats;
    if steer::is_probe(bytes) {
        return; // a device's steering probe (ours, late, or another's while we own 4791)
    }
    bump(&st.rx_packets, 1);
    let h = IcrcHeaders {
        src: *from.ip(),
        dst: to,
        ip_id,
        df: true,
        sport: from.port(),
        // As addressed by the sender (before steering), not our socket's port.
        dport: shared.addressed,
    };
    let capture = |id: Option<u16>| {
        if let Some(mw) = &shared.mw
            && let Some(p) = &mut mw.lock().pcap
        {
            // With the identification the ICRC was computed with, when it was found.
            let h = IcrcHeaders {
                ip_id: id.unwrap_or(h.ip_id),
                ..h
            };
            let _ = p.write_packet(&h, shared.cfg.ttl, bytes);
        }
    };
    let Ok(pkt) = Packet::new_checked(bytes) else {
        capture(None);
        bump(&st.rx_malformed, 1);
        return;
    };
    let Some(id) = icrc_matches(h, [shared.addressed, own_port], bytes, ids) else {
        capture(None);
        bump(&st.rx_icrc_errors, 1);
        return;
    };
    capture(Some(id));
    if id >= GSO_IDS {
        // Not a GSO segment index: a sender numbering its datagrams like Linux rxe does.
        bump(&st.rx_foreign_ip_id, 1);
    }
    let Ok(repr) = PacketRepr::parse(&pkt) else {
        bump(&st.rx_malformed, 1);
        return;
    };
    let qpn = repr.bth.dest_qp;
    if current.as_ref().is_none_or(|q| q.qpn != qpn) {
        *current = shared.lookup(qpn);
    }
    let Some(qp) = current.as_ref() else {
        bump(&st.rx_unknown_qp, 1);
        return;
    };
    let mut core = qp.core.lock();
    // rxe accepts a packet only from the QP's peer address (Linux peers vary the source port).
    if core.av.is_none_or(|av| av.ip() != from.ip()) {
        bump(&st.rx_wrong_source, 1);
        return;
    }
    core.rc.handle_packet(now, &repr, &shared.mrs);
    drop(core);
    if !dirty.iter().any(|d| Arc::ptr_eq(d, qp)) {
        dirty.push(qp.clone());
    }
}

/// Stops and joins the engine thread when the last handle of the device goes away.
pub(crate) struct EngineGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for EngineGuard {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(t) = self.thread.lock().take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
        if let Some(mw) = &self.shared.mw
            && let Some(p) = &mut mw.lock().pcap
        {
            let _ = p.flush();
        }
    }
}

/// The GID of an IPv4 address (`::ffff:a.b.c.d`).
pub fn gid_of(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

pub(crate) fn wait_readable(fd: &OwnedFd, timeout: Option<Duration>) -> io::Result<bool> {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    let ts = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    });
    loop {
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::compute_icrc;

    /// A SEND-only packet whose ICRC was computed for `h` (segment `ip_id` of a batch).
    fn packet(h: &IcrcHeaders) -> Vec<u8> {
        let mut p = vec![0u8; 12 + 16 + 4];
        p[0] = 0x04;
        p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
        p[5..8].copy_from_slice(&[0x2a, 0xb0, 0x07]);
        for (i, b) in p[12..28].iter_mut().enumerate() {
            *b = i as u8;
        }
        let icrc = compute_icrc(h, &p);
        let n = p.len();
        p[n - 4..].copy_from_slice(&icrc.to_le_bytes());
        p
    }

    /// The receive path's ICRC rule: a packet is checked with the destination port the sender
    /// addressed — the RoCE port (steered to our own port on the way), else our socket's own
    /// port (a sender that addressed it directly) — never with any other.
    #[test]
    fn icrc_is_checked_with_the_roce_port_then_the_socket_port() {
        let own = steer::port_of_range(0x2ab);
        let base = IcrcHeaders {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            ip_id: 0,
            df: true,
            sport: 50123,
            dport: 0,
        };
        let mut ids = IdCache::default();
        let addressed = [steer::ROCE_PORT, own];
        for (sent_to, ok) in [
            (steer::ROCE_PORT, true), // a peer that sends to 4791: steered to us
            (own, true),              // a peer that addressed our port
            (own + 1, false),         // a third port: not ours
            (4790, false),
        ] {
            let p = packet(&IcrcHeaders {
                dport: sent_to,
                ..base
            });
            // What the receiver sees: the headers without the destination port.
            assert_eq!(
                icrc_matches(base, addressed, &p, &mut ids).is_some(),
                ok,
                "sent to {sent_to}"
            );
        }
        // Without the RoCE port in the rule (the old one: the socket's port only), a steered
        // packet fails: the receiver's port is not what the sender's ICRC covered.
        let steered = packet(&IcrcHeaders {
            dport: steer::ROCE_PORT,
            ..base
        });
        assert_eq!(icrc_matches(base, [own, own], &steered, &mut ids), None);
        // Identifications are found, GSO segment indices and others, for either port.
        for sent_to in [steer::ROCE_PORT, own] {
            for id in [5, 63, 64, 0x56d6, 0xffff] {
                let p = packet(&IcrcHeaders {
                    dport: sent_to,
                    ip_id: id,
                    ..base
                });
                assert_eq!(
                    icrc_matches(base, addressed, &p, &mut ids),
                    Some(id),
                    "{sent_to}"
                );
            }
        }
        // A corrupted byte fails with both.
        let mut bad = steered.clone();
        bad[20] ^= 0x10;
        assert_eq!(icrc_matches(base, addressed, &bad, &mut ids), None);
        // A fixed-port device has one port: checked once.
        let fixed = packet(&IcrcHeaders {
            dport: 40000,
            ..base
        });
        assert_eq!(
            icrc_matches(base, [40000, 40000], &fixed, &mut ids),
            Some(0)
        );
    }

    /// RoCE frames Linux 6.12's rxe sent to our engine (kernel-peer rig captures), with the
    /// IPv4 identifications its per-destination counter gave them (0x3777…, 0x81b2…, 0xffb9…,
    /// 0xb8c4…): what a UDP socket receives of each, and the identification it did not see.
    fn kernel_frames() -> Vec<(IcrcHeaders, u16, Vec<u8>)> {
        let d = include_bytes!("../tests/data/kernel-6.12-rxe-frames.pcap");
        let mut out = Vec::new();
        let mut off = 24;
        while off + 16 <= d.len() {
            let cl = u32::from_le_bytes(d[off + 8..off + 12].try_into().unwrap()) as usize;
            let f = &d[off + 16..off + 16 + cl];
            off += 16 + cl;
            let (ip, udp) = (&f[14..34], &f[34..]);
            let ulen = u16::from_be_bytes([udp[4], udp[5]]) as usize;
            let h = IcrcHeaders {
                src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
                dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
                ip_id: 0, // not visible to the receiver
                df: ip[6] & 0x40 != 0,
                sport: u16::from_be_bytes([udp[0], udp[1]]),
                dport: 0, // replaced by the ports tried
            };
            out.push((h, u16::from_be_bytes([ip[4], ip[5]]), udp[8..ulen].to_vec()));
        }
        out
    }

    /// Linux rxe's datagrams pass with their identification hidden (it is solved, and comes
    /// out as the one on the wire); with any single bit flipped — in the packet, its ICRC, or
    /// the addresses and port the receiver supplies — they fail.
    #[test]
    fn kernel_rxe_datagrams_pass_and_any_single_bit_flip_fails() {
        let frames = kernel_frames();
        assert_eq!(frames.len(), 30);
        let mut ids = IdCache::default();
        let roce = [steer::ROCE_PORT; 2];
        let mut ids_seen = std::collections::BTreeSet::new();
        for (h, real_id, bytes) in &frames {
            assert_eq!(h.dst, Ipv4Addr::new(10, 77, 0, 1));
            assert_eq!(icrc_matches(*h, roce, bytes, &mut ids), Some(*real_id));
            ids_seen.insert(*real_id);
            let mut flipped = bytes.clone();
            for bit in 0..bytes.len() * 8 {
                if bit / 8 == 4 {
                    continue; // BTH byte 4 (FECN, BECN, reserved): masked out of the ICRC
                }
                flipped[bit / 8] ^= 1 << (bit % 8);
                assert_eq!(
                    icrc_matches(*h, roce, &flipped, &mut ids),
                    None,
                    "{} bytes from {real_id:#x}: bit {bit} flipped",
                    bytes.len()
                );
                flipped[bit / 8] ^= 1 << (bit % 8);
            }
            for field in 0..80 {
                let mut g = *h;
                match field {
                    0..32 => g.src = Ipv4Addr::from(u32::from(g.src) ^ 1 << field),
                    32..64 => g.dst = Ipv4Addr::from(u32::from(g.dst) ^ 1 << (field - 32)),
                    _ => g.sport ^= 1 << (field - 64),
                }
                assert_eq!(icrc_matches(g, roce, bytes, &mut ids), None, "{g:?}");
            }
        }
        assert!(ids_seen.iter().all(|&id| id >= GSO_IDS), "{ids_seen:x?}");
    }
}
