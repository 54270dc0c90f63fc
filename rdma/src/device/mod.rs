//! The device: one UDP socket, one engine thread, and the tables of queue pairs and memory
//! regions. Application threads post work and transmit on their own; the engine thread
//! receives packets, runs timers and delivers completions. It sleeps in `epoll_wait` when there
//! is nothing to do (no busy polling), and is woken through an eventfd only when a new timer is
//! earlier than the one it sleeps on.
//!
//! Split by responsibility: [`tx`] (the transmit path), [`rx`] (the receive path), [`ids`] (the
//! receiver's ICRC check), [`cq`] (completion queues and the threads that wait on them),
//! [`samehost`] (the engine's side of the same-host transport), [`engine`] (the engine thread
//! and its timers) and [`counters`]; here the configuration, the device's shared state and its
//! opening.

mod counters;
mod cq;
mod engine;
pub(crate) mod held;
mod ids;
mod rx;
mod samehost;
mod spin;
mod tx;

pub use counters::{CounterWords, DeviceStats, SharedCounters};
pub(crate) use cq::CqShared;
pub(crate) use engine::{EngineGuard, run_engine};

use counters::{Counters, RC_COUNTERS};
use rx::RxState;
use tx::TxScratch;

use crate::mr::MrTable;
use crate::rc::RcQp;
use crate::transport::fault::{FaultConfig, FaultInjector, FaultStats, Release};
use crate::transport::pcap::PcapWriter;
use crate::transport::steer::{self, PortMode};
use crate::transport::udp::{UdpOptions, UdpSocket};

use crate::locks::{Mutex, RwLock};
use rustix::event::{EventfdFlags, epoll};
use rustix::fd::{AsFd, OwnedFd};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::{self, BufWriter};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
    /// [`crate::CqScheduler::begin_drive`]) polls before it sleeps (also `SMCR_SPIN_US`; 0
    /// turns it off): the same-host rings, and the socket when the driver receives from it
    /// itself. A message that comes within it costs no sleep and no wake-up — a cross-CPU
    /// wake-up costs tens of microseconds on some machines (across two namespaces, sockperf
    /// 64 B p50 8.5 → 5.9 µs). The spinning yields the CPU at every turn (a peer on the same
    /// CPU runs meanwhile) and adapts: after spins that caught nothing it gets shorter, down to
    /// none, until a wait ends quickly again; when yields keep coming back a scheduler slice
    /// later (other work wants the CPU) it stops for a second. Default 15 µs (longer spins
    /// cost bulk transfers: iperf3 on one host moved 33–38 Gbit/s with 50 µs, 47–51 with
    /// 10–15, at the same ping-pong latency).
    pub spin: Duration,
    /// How long the socket stays with an application thread after its blocking wait returned
    /// (0: handed back to the engine thread at once). A thread that reads, answers and waits
    /// again comes back within microseconds: it then takes the socket again without the two
    /// `epoll_ctl` calls that hand it to the engine thread and back; if it does not come back
    /// in time, the engine thread takes it (smcr: `SMCR_HOLD_US`, as event loops' holds).
    pub rx_hold: Duration,
    /// Speak our engines' extensions to a peer that is our engine too ([`crate::wire::MARK`]):
    /// no ICRC, small packets bundled into one datagram. Every packet is marked; a peer that
    /// never marks (Linux rxe, an RNIC) gets plain RoCE v2. Default on; `SMCR_RDMA_EXT=off`
    /// turns it off (plain RoCE v2 to everyone, the ICRC checked on every packet).
    pub ext: bool,
    /// With [`Self::ext`]: check the ICRC of every packet even from our own engines (they
    /// then compute it; bundles are kept). Default off; `SMCR_RDMA_ICRC=always` turns it on:
    /// corruption past the UDP checksum (a NIC or bus that corrupts after its check) is then
    /// caught, as it is with any RoCE peer.
    pub icrc_always: bool,
    /// How long requests a corked thread posted wait for it before the engine sends them
    /// (the `cork` module; default 200 µs, its `CORK_MAX`).
    pub cork_max: Duration,
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
            rx_hold: Duration::ZERO,
            ext: !crate::env::var("SMCR_RDMA_EXT").is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "off" | "0" | "no" | "false"
                )
            }),
            icrc_always: crate::env::var("SMCR_RDMA_ICRC").is_some_and(|v| v == "always"),
            cork_max: DEFAULT_CORK_MAX,
        }
    }
}

/// See [`DeviceConfig::cork_max`]: a pass of an event loop takes microseconds; a loop away
/// longer is not coming back soon.
pub(crate) const DEFAULT_CORK_MAX: Duration = Duration::from_micros(200);

/// See [`DeviceConfig::spin`].
const DEFAULT_SPIN: Duration = Duration::from_micros(15);

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
    /// The peer marked its packets: it is our engine, and takes bundles
    /// ([`DeviceConfig::ext`]).
    pub(crate) peer_ext: bool,
    /// It also takes packets without ICRC (`wire::TAKES_NO_ICRC`).
    pub(crate) peer_no_icrc: bool,
    /// The largest UDP payload our interface carries (the MTU of the interface holding our
    /// address, less the IPv4 and UDP headers), when known: a bundle may hold a full-size
    /// packet and the small ones behind it. (The interface, not the route: a connected
    /// socket's `IP_MTU` would take a port for a moment, perhaps one a steered range needs.)
    pub(crate) max_dgram: Option<usize>,
}

pub(crate) struct QpShared {
    pub(crate) qpn: u32,
    pub(crate) core: Mutex<QpCore>,
    /// Set (under `core`'s lock) once requests were seen going through shared memory; it stays
    /// so. Lets a hot path ask without the lock ([`crate::QueuePair::same_host_seen`]).
    pub(crate) same_host: std::sync::atomic::AtomicBool,
    /// Its device (a thread sending the QP's held ACK on its own, `crate::cork`).
    pub(crate) dev: std::sync::Weak<Shared>,
}

impl QpShared {
    pub(crate) fn new(
        dev: &Arc<Shared>,
        rc: RcQp,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        shm: Option<crate::samehost::ShmQp>,
    ) -> Self {
        Self {
            dev: Arc::downgrade(dev),
            qpn: rc.qp_num(),
            same_host: std::sync::atomic::AtomicBool::new(false),
            core: Mutex::new(QpCore {
                rc,
                av: None,
                src: None,
                send_cq,
                recv_cq,
                timer_at: None,
                shm,
                counted: [0; RC_COUNTERS],
                peer_ext: false,
                peer_no_icrc: false,
                max_dgram: None,
            }),
        }
    }
}

struct Middleware {
    faults: Option<FaultInjector>,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    released: Vec<Release>,
}

/// The device's timers (RC retransmissions and probes, held ACKs, RNR waits, hand-back ends)
/// and who runs them: the engine thread, or a thread that holds the socket while it waits
/// (the keeper; docs/architecture.md, "The driver contract", job T). `engine.rs` keeps them.
struct Timers {
    heap: Mutex<BinaryHeap<Reverse<(Instant, u32)>>>,
    /// The earliest entry of `heap` (ns since `base`; `u64::MAX`: none), read without the
    /// lock by the thread that keeps the timers while it waits.
    next: AtomicU64,
    /// Waiting threads holding the socket now, which keep the timers (see
    /// `Shared::timer_keeper`).
    keepers: AtomicU32,
    /// When one of them last let go of the socket (ns since `base`).
    kept_at: AtomicU64,
    /// When the engine will wake by itself (ns since `base`); 0 while it is awake.
    sleep_until: AtomicU64,
}

/// The device socket's receive path and who watches the socket: the engine thread, a thread
/// waiting in `drive_wait`, or event loops it is delegated to (docs/architecture.md, "The
/// driver contract", job R). `rx.rs` hands it over.
struct Receive {
    /// The receive state: whoever holds it reads the socket.
    rx: Mutex<RxState>,
    /// A thread found the socket readable but the receive state taken (see
    /// [`RxGuard`](rx::RxGuard)).
    rx_wanted: crate::notify::RxWanted,
    /// Why the engine thread does not watch the socket now (see `engine_rx_interest`).
    rx_away: Mutex<u32>,
    /// A waiting thread's hand-back of the socket, held for its next wait (see
    /// [`DeviceConfig::rx_hold`]): set, it keeps one count of `rx_away`.
    rx_sticky: AtomicBool,
    /// Until when (ns since `base`) the hand-back waits for the thread to come back.
    rx_sticky_until: AtomicU64,
    /// An `RX_HOLD_TIMER` entry is in the engine's timers.
    rx_sticky_armed: AtomicBool,
    /// Threads watching the socket from their own epoll sets ([`Shared::delegate_rx`]).
    delegated: AtomicU32,
    /// Readable when delegation starts: a thread asleep in a receive of its own (holding the
    /// receive state) lets go of it.
    rx_yield: OwnedFd,
}

/// Where same-host peers find the device and offer their queue pairs' shared memory.
struct Rendezvous {
    /// The same-host rendezvous (abstract Unix socket), if it could be bound.
    local: Option<OwnedFd>,
    /// The host-wide rendezvous (a socket in `samehost::rendezvous_dir`), for peers in other
    /// network namespaces.
    fs: Option<crate::samehost::FsRendezvous>,
    /// Accepted rendezvous connections whose offer has not arrived yet, by descriptor number.
    offers: Mutex<HashMap<i32, samehost::Incoming>>,
}

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
    /// The timers and who runs them (job T of the driver contract).
    timers: Timers,
    base: Instant,
    kick: OwnedFd,
    stop: AtomicBool,
    mw: Option<Mutex<Middleware>>,
    /// This device marks its packets and bundles to peers that do ([`DeviceConfig::ext`],
    /// unless it captures).
    ext: bool,
    /// It may leave out the ICRC to a peer that takes that (not while it injects bit flips).
    send_no_icrc: bool,
    /// It takes packets without ICRC (not with [`DeviceConfig::icrc_always`]).
    take_no_icrc: bool,
    tx_bufs: Mutex<Vec<TxScratch>>,
    /// The engine thread's epoll set (socket and kick eventfd).
    epoll: OwnedFd,
    /// The socket's receive path and who watches it (job R of the driver contract).
    receive: Receive,
    stats: Counters,
    /// Where same-host peers find this device (`samehost.rs` answers them).
    rendezvous: Rendezvous,
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
/// `EV_OFFERED | qpn`: the connection our QP's offer goes on has the peer's challenge, or hung
/// up before the peer's offer came (the peer refused it or is gone: held requests go over UDP).
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
        // A capture shows plain RoCE v2 (what Wireshark decodes): a capturing device does not
        // mark its packets, and so is sent none of our extensions. Corruption injected here
        // happens before the kernel's UDP checksum, which only the ICRC can then catch: such a
        // device computes the ICRC of everything it sends.
        let ext = cfg.ext && pcap.is_none();
        let send_no_icrc = ext && faults.as_ref().is_none_or(|f| !f.corrupts());
        let take_no_icrc = ext && !cfg.icrc_always;
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
        let claim = steer::claim(
            cfg.addr,
            &cfg.extra_addrs,
            opts,
            steer,
            crate::samehost::listen,
        )?;
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
        let rendezvous_fs = rendezvous
            .as_ref()
            .and_then(|_| crate::samehost::listen_fs(*cfg.addr.ip(), range));
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
        for r in rendezvous.iter().chain(rendezvous_fs.iter().map(|r| &r.fd)) {
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
            alt_rx: Mutex::new(RxState::new()),
            mrs: MrTable::new(seed.wrapping_mul(0x9E37_79B9)),
            qps: RwLock::new(HashMap::new()),
            // A process that restarts on the same address should not reuse its predecessor's
            // QPNs (a peer's stale QP would still send to them): a random range, and a random
            // start in it.
            next_qpn: AtomicU32::new(steer::random_u32() % steer::PROBE_INDEX),
            next_pd: AtomicU32::new(1),
            timers: Timers {
                heap: Mutex::new(BinaryHeap::new()),
                next: AtomicU64::new(u64::MAX),
                keepers: AtomicU32::new(0),
                kept_at: AtomicU64::new(0),
                sleep_until: AtomicU64::new(0),
            },
            base: Instant::now(),
            kick,
            stop: AtomicBool::new(false),
            mw,
            ext,
            send_no_icrc,
            take_no_icrc,
            tx_bufs: Mutex::new(Vec::new()),
            epoll: ep,
            receive: Receive {
                rx: Mutex::new(RxState::new()),
                rx_wanted: crate::notify::RxWanted::new(),
                rx_away: Mutex::new(0),
                rx_sticky: AtomicBool::new(false),
                rx_sticky_until: AtomicU64::new(0),
                rx_sticky_armed: AtomicBool::new(false),
                delegated: AtomicU32::new(0),
                rx_yield: crate::fdzone::place(rustix::event::eventfd(
                    0,
                    EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
                )?)?,
            },
            stats,
            rendezvous: Rendezvous {
                local: rendezvous,
                fs: rendezvous_fs,
                offers: Mutex::new(HashMap::new()),
            },
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

    pub(crate) fn lookup(&self, qpn: u32) -> Option<Arc<QpShared>> {
        self.qps.read().get(&qpn).cloned()
    }
}

fn drain_eventfd(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

pub(crate) fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
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
mod tests;
