//! The device: one UDP socket, one engine thread, and the tables of queue pairs and memory
//! regions. Application threads post work and transmit on their own; the engine thread
//! receives packets, runs timers and delivers completions. It sleeps in `epoll_wait` when there
//! is nothing to do (no busy polling), and is woken through an eventfd only when a new timer is
//! earlier than the one it sleeps on.

use crate::mr::MrTable;
use crate::rc::{CqSide, RcQp, WorkCompletion};
use crate::transport::fault::{FaultConfig, FaultInjector, FaultStats, Release};
use crate::transport::pcap::PcapWriter;
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
    pub addr: SocketAddrV4,
    /// Send packets of one work request in one `sendmsg` with UDP GSO.
    pub gso: bool,
    /// Let the kernel coalesce received datagrams (UDP GRO).
    pub gro: bool,
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
}

impl DeviceConfig {
    /// Defaults for a device on `addr`.
    pub fn new(addr: SocketAddrV4) -> Self {
        Self {
            addr,
            gso: true,
            gro: true,
            rcvbuf: 8 << 20,
            sndbuf: 8 << 20,
            ttl: 64,
            faults: None,
            pcap: None,
        }
    }
}

/// Counters of a device.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStats {
    /// RoCE packets sent.
    pub tx_packets: u64,
    /// `sendmsg` calls made.
    pub tx_syscalls: u64,
    /// Sends the kernel refused.
    pub tx_errors: u64,
    /// RoCE packets received.
    pub rx_packets: u64,
    /// Receive system calls that returned data.
    pub rx_syscalls: u64,
    /// Packets dropped because they did not parse.
    pub rx_malformed: u64,
    /// Packets dropped because their ICRC was wrong.
    pub rx_icrc_errors: u64,
    /// Packets for a QP number that does not exist.
    pub rx_unknown_qp: u64,
    /// Packets from an address other than the QP's peer.
    pub rx_wrong_source: u64,
    /// Times an application thread woke the engine.
    pub engine_kicks: u64,
}

#[derive(Default)]
struct AtomicStats {
    tx_packets: AtomicU64,
    tx_syscalls: AtomicU64,
    tx_errors: AtomicU64,
    rx_packets: AtomicU64,
    rx_syscalls: AtomicU64,
    rx_malformed: AtomicU64,
    rx_icrc_errors: AtomicU64,
    rx_unknown_qp: AtomicU64,
    rx_wrong_source: AtomicU64,
    engine_kicks: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Completion queue state shared by the application handle and the engine.
pub(crate) struct CqShared {
    pub(crate) queue: Mutex<VecDeque<WorkCompletion>>,
    pub(crate) event: OwnedFd,
    pub(crate) armed: AtomicBool,
}

impl CqShared {
    pub(crate) fn new() -> io::Result<Self> {
        let event = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            event,
            armed: AtomicBool::new(false),
        })
    }

    pub(crate) fn push(&self, wc: WorkCompletion) {
        self.queue.lock().push_back(wc);
        if self.armed.swap(false, Ordering::AcqRel) {
            let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
        }
    }
}

/// A QP's state behind its lock.
pub(crate) struct QpCore {
    pub(crate) rc: RcQp,
    pub(crate) av: Option<SocketAddrV4>,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    timer_at: Option<Instant>,
}

pub(crate) struct QpShared {
    pub(crate) qpn: u32,
    pub(crate) core: Mutex<QpCore>,
}

impl QpShared {
    pub(crate) fn new(rc: RcQp, send_cq: Arc<CqShared>, recv_cq: Arc<CqShared>) -> Self {
        Self {
            qpn: rc.qp_num(),
            core: Mutex::new(QpCore {
                rc,
                av: None,
                send_cq,
                recv_cq,
                timer_at: None,
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
    pub(crate) local: SocketAddrV4,
    pub(crate) mrs: MrTable,
    pub(crate) qps: RwLock<HashMap<u32, Arc<QpShared>>>,
    pub(crate) next_qpn: AtomicU32,
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
    /// The engine thread's epoll set (socket and kick eventfd).
    epoll: OwnedFd,
    stats: AtomicStats,
}

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
            cfg.pcap = std::env::var_os("SMCR_RDMA_PCAP")
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
        let mw = (faults.is_some() || pcap.is_some()).then(|| {
            Mutex::new(Middleware {
                faults,
                pcap,
                released: Vec::new(),
            })
        });
        let sock = UdpSocket::bind(
            cfg.addr,
            UdpOptions {
                rcvbuf: cfg.rcvbuf,
                sndbuf: cfg.sndbuf,
                gro: cfg.gro,
                ttl: cfg.ttl,
            },
        )?;
        let local = sock.local_addr();
        let seed = (std::process::id() ^ (local.port() as u32) << 16) | 1;
        let kick = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(
            &ep,
            sock.fd().as_fd(),
            epoll::EventData::new_u64(0),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &ep,
            kick.as_fd(),
            epoll::EventData::new_u64(1),
            epoll::EventFlags::IN,
        )?;
        Ok(Arc::new(Self {
            cfg,
            sock,
            local,
            mrs: MrTable::new(seed.wrapping_mul(0x9E37_79B9)),
            qps: RwLock::new(HashMap::new()),
            // A process that restarts on the same address must not reuse its predecessor's
            // QPNs: a peer's stale QP would still send to them.
            next_qpn: AtomicU32::new(first_qpn(seed)),
            next_pd: AtomicU32::new(1),
            timers: Mutex::new(BinaryHeap::new()),
            sleep_until: AtomicU64::new(0),
            base: Instant::now(),
            kick,
            stop: AtomicBool::new(false),
            mw,
            tx_bufs: Mutex::new(Vec::new()),
            rx: Mutex::new(RxState {
                batch: RecvBatch::new(RX_BATCH),
                dirty: Vec::new(),
                ids: IdCache::default(),
            }),
            epoll: ep,
            stats: AtomicStats::default(),
        }))
    }

    pub(crate) fn stats(&self) -> DeviceStats {
        let s = &self.stats;
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DeviceStats {
            tx_packets: l(&s.tx_packets),
            tx_syscalls: l(&s.tx_syscalls),
            tx_errors: l(&s.tx_errors),
            rx_packets: l(&s.rx_packets),
            rx_syscalls: l(&s.rx_syscalls),
            rx_malformed: l(&s.rx_malformed),
            rx_icrc_errors: l(&s.rx_icrc_errors),
            rx_unknown_qp: l(&s.rx_unknown_qp),
            rx_wrong_source: l(&s.rx_wrong_source),
            engine_kicks: l(&s.engine_kicks),
        }
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
    pub(crate) fn drive(&self, core: &mut QpCore, now: Instant) {
        if let Some(dst) = core.av {
            self.transmit(core, dst, now);
        }
        while let Some((side, wc)) = core.rc.poll_completion() {
            match side {
                CqSide::Send => core.send_cq.push(wc),
                CqSide::Recv => core.recv_cq.push(wc),
            }
        }
        if let Some(t) = core.rc.poll_timeout()
            && core.timer_at.is_none_or(|old| t < old)
        {
            core.timer_at = Some(t);
            self.schedule(t, core.rc.qp_num());
        }
    }

    fn transmit(&self, core: &mut QpCore, dst: SocketAddrV4, now: Instant) {
        let mut tx = self.tx_bufs.lock().pop().unwrap_or_else(TxScratch::new);
        tx.reset();
        let mut seg = 0;
        loop {
            if !tx.has_room() {
                self.flush(&mut tx, seg, dst, now);
            }
            let at = tx.used;
            let Some(parts) = core.rc.poll_transmit_parts(now, &mut tx.buf[at..]) else {
                break;
            };
            let len = parts.len();
            if !tx.pkts.is_empty() && len > seg {
                // A longer packet cannot follow in the same GSO batch: send the batch first.
                self.flush(&mut tx, seg, dst, now);
            }
            tx.used = at + parts.head + TRAILER;
            if tx.pkts.is_empty() {
                seg = len;
            }
            tx.bytes += len;
            tx.pkts.push(Pending { head: at, parts });
            if len < seg {
                // A shorter packet ends a GSO batch.
                self.flush(&mut tx, seg, dst, now);
            }
        }
        if !tx.pkts.is_empty() {
            self.flush(&mut tx, seg, dst, now);
        }
        self.tx_bufs.lock().push(tx);
    }

    fn icrc_headers(&self, dst: SocketAddrV4, ip_id: u16) -> IcrcHeaders {
        IcrcHeaders {
            src: *self.local.ip(),
            dst: *dst.ip(),
            ip_id,
            df: true,
            sport: self.local.port(),
            dport: dst.port(),
        }
    }

    /// Sends the pending packets (all `seg` bytes long but the last) and empties the batch.
    /// Must be called with the QP still locked: payloads point into its registered memory.
    fn flush(&self, tx: &mut TxScratch, seg: usize, dst: SocketAddrV4, now: Instant) {
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
                crate::wire::compute_icrc_vectored(&self.icrc_headers(dst, id), &parts[..=n]);
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
                    let _ = pc.write_packet(&self.icrc_headers(dst, id), self.cfg.ttl, pkt);
                }
                if let Some(f) = &mut mw.faults {
                    f.process(now, dst, pkt.to_vec(), &mut mw.released);
                }
            }
            if mw.faults.is_some() {
                for r in mw.released.drain(..) {
                    self.send_raw(r.dst, &r.bytes, None);
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
        if unsafe { self.sock.send_iov(dst, &tx.iov, gso.then_some(seg as u16)) }.is_err() {
            bump(&self.stats.tx_errors, 1);
        }
        tx.reset();
    }

    fn send_raw(&self, dst: SocketAddrV4, bytes: &[u8], gso: Option<u16>) {
        bump(&self.stats.tx_syscalls, 1);
        if self.sock.send(dst, bytes, gso).is_err() {
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
            self.send_raw(r.dst, &r.bytes, None);
        }
        drop(guard);
        if let Some(t) = next {
            self.timers.lock().push(Reverse((t, FAULT_TIMER)));
        }
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
pub(crate) struct RxState {
    batch: RecvBatch,
    dirty: Vec<Arc<QpShared>>,
    ids: IdCache,
}

/// Identification values our senders use: segment indices of a GSO batch.
const GSO_IDS: u16 = MAX_GSO_SEGMENTS as u16;
const ID_BITS: usize = GSO_IDS.trailing_zeros() as usize;

/// Per packet length, how the ICRC changes with the low identification bits (see
/// [`crate::wire::ip_id_delta`]); computed once per length.
#[derive(Default)]
pub(crate) struct IdCache {
    by_len: HashMap<usize, [u32; ID_BITS]>,
}

impl IdCache {
    /// The identification in `0..GSO_IDS` for which the packet's ICRC is right, given the ICRC
    /// computed for `tried`. A plain UDP socket cannot see the identification; our senders use
    /// the GSO segment index, and a batch split up on the way arrives as lone datagrams.
    fn find(&mut self, len: usize, tried: u16, found: u32, computed: u32) -> Option<u16> {
        let basis = *self
            .by_len
            .entry(len)
            .or_insert_with(|| std::array::from_fn(|i| crate::wire::ip_id_delta(len, i as u32)));
        let want = found ^ computed;
        (0..GSO_IDS).find(|&id| {
            let flip = id ^ tried;
            flip >> ID_BITS == 0
                && (0..ID_BITS)
                    .filter(|i| flip >> i & 1 == 1)
                    .fold(0, |acc, i| acc ^ basis[i])
                    == want
        })
    }
}

const RX_BATCH: usize = 8;

impl Shared {
    /// Reads and handles what waits on the socket, up to `rounds` recvmmsg calls; returns how
    /// many datagrams were handled.
    fn rx_drain(&self, rx: &mut RxState, rounds: usize) -> usize {
        let gro = self.sock.gro();
        let mut total = 0;
        for _ in 0..rounds {
            let n = match rx.batch.recv(&self.sock) {
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
                    receive(self, now, d.from, chunk, k as u16, &mut current, dirty, ids);
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
    fn engine_rx_interest(&self, on: bool) {
        let flags = if on {
            epoll::EventFlags::IN
        } else {
            epoll::EventFlags::empty()
        };
        let _ = epoll::modify(
            &self.epoll,
            self.sock.fd().as_fd(),
            epoll::EventData::new_u64(0),
            flags,
        );
    }

    /// Blocks the calling thread until `cq` has a completion or `timeout` passes. If no other
    /// thread is receiving, the caller receives and handles packets itself, so the packet that
    /// completes its request costs one wake-up (its own), not two (engine, then caller).
    pub(crate) fn wait_cq(&self, cq: &CqShared, timeout: Option<Duration>) -> io::Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let Some(mut rx) = self.rx.try_lock() else {
            cq.armed.store(true, Ordering::Release);
            if cq.queue.lock().is_empty() && wait_readable(&cq.event, timeout)? {
                drain_eventfd(&cq.event);
            }
            return Ok(());
        };
        self.engine_rx_interest(false);
        let res = loop {
            // Armed only while asleep: completions this thread produces itself need no signal.
            cq.armed.store(true, Ordering::Release);
            if !cq.queue.lock().is_empty() {
                break Ok(());
            }
            // Sleep first: poll returns at once if a packet is already waiting, which saves
            // a receive call that would find nothing.
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let mut fds = [
                rustix::event::PollFd::new(self.sock.fd(), rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&cq.event, rustix::event::PollFlags::IN),
            ];
            let ts = left.map(timespec);
            let ready = match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => 0,
                Err(e) => break Err(e.into()),
            };
            cq.armed.store(false, Ordering::Release);
            if fds[1].revents().contains(rustix::event::PollFlags::IN) {
                drain_eventfd(&cq.event);
            }
            if fds[0].revents().contains(rustix::event::PollFlags::IN) {
                self.rx_drain(&mut rx, 64);
            }
            if !cq.queue.lock().is_empty() {
                break Ok(());
            }
            if ready == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
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
    let mut evbuf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 4];
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
        let (kicked, readable) = match epoll::wait(&shared.epoll, &mut evbuf, ts.as_ref()) {
            Ok((evs, _)) => (
                evs.iter().any(|ev| ev.data.u64() == 1),
                evs.iter().any(|ev| ev.data.u64() == 0),
            ),
            Err(_) => (false, false),
        };
        shared.sleep_until.store(0, Ordering::Release);
        if kicked {
            drain_eventfd(&shared.kick);
        }
        if readable {
            // Never block here: an application thread may hold the receive state while it
            // sleeps, and timers must keep running. It has turned our socket interest off (or
            // is about to), so a failed attempt does not repeat.
            if let Some(mut rx) = shared.rx.try_lock() {
                shared.rx_drain(&mut rx, 64);
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

#[allow(clippy::too_many_arguments)] // one packet and the receive loop's scratch state
fn receive(
    shared: &Shared,
    now: Instant,
    from: SocketAddrV4,
    bytes: &[u8],
    ip_id: u16,
    current: &mut Option<Arc<QpShared>>,
    dirty: &mut Vec<Arc<QpShared>>,
    ids: &mut IdCache,
) {
    let st = &shared.stats;
    bump(&st.rx_packets, 1);
    if let Some(mw) = &shared.mw
        && let Some(p) = &mut mw.lock().pcap
    {
        let h = IcrcHeaders {
            src: *from.ip(),
            dst: *shared.local.ip(),
            ip_id,
            df: true,
            sport: from.port(),
            dport: shared.local.port(),
        };
        let _ = p.write_packet(&h, shared.cfg.ttl, bytes);
    }
    let Ok(pkt) = Packet::new_checked(bytes) else {
        bump(&st.rx_malformed, 1);
        return;
    };
    let h = IcrcHeaders {
        src: *from.ip(),
        dst: *shared.local.ip(),
        ip_id,
        df: true,
        sport: from.port(),
        dport: shared.local.port(),
    };
    if let Err(crate::wire::Error::BadIcrc { found, computed }) = verify_icrc(&h, bytes)
        && ids.find(bytes.len(), ip_id, found, computed).is_none()
    {
        bump(&st.rx_icrc_errors, 1);
        return;
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

/// Where a device's QPNs start: 0x100 and up, different per process and start time.
fn first_qpn(seed: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() ^ d.as_secs() as u32);
    let mut x = seed ^ nanos.rotate_left(16);
    // xorshift mixing.
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    0x100 + x % 0x7f_0000
}
