//! The objects applications use, named as in libibverbs: [`Device`], [`ProtectionDomain`],
//! [`MemoryRegion`], [`CompletionQueue`] and [`QueuePair`].
//!
//! ```no_run
//! use rdma::*;
//! let dev = Device::open(DeviceConfig::new("127.0.0.1:0".parse().unwrap()))?;
//! let pd = dev.alloc_pd();
//! let mr = pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let cq = dev.create_cq()?;
//! let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false)?;
//! # let (peer_qpn, peer_psn, peer_addr) = (0, Psn::new(0), "127.0.0.1:4791".parse().unwrap());
//! qp.modify(&QpAttr::state(QpState::Init))?;
//! qp.modify(&QpAttr { path_mtu: Some(Mtu::Mtu1024), dest_qp_num: Some(peer_qpn),
//!     rq_psn: Some(peer_psn), av: Some(peer_addr), ..QpAttr::state(QpState::Rtr) })?;
//! qp.modify(&QpAttr { sq_psn: Some(Psn::new(1)), ..QpAttr::state(QpState::Rts) })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::device::{
    CqShared, DeviceConfig, DeviceStats, EngineGuard, QpShared, Shared, run_engine,
};
use crate::ibv::{self, VerbsCq, VerbsDevice};
use crate::mr::{Access, Region};
use crate::rc::{
    ModifyError, PostError, QpAttr, QpCaps, QpState, RcQp, RecvWr, SendFlags, SendWr, Sge,
    WorkCompletion,
};
use crate::sched::{CqScheduler, EngineSched, SchedKind};
use crate::transport::fault::FaultStats;
use crate::transport::steer::PortMode;
use parking_lot::Mutex;
use rustix::fd::{AsFd, BorrowedFd};
use std::io;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// An RDMA device: our engine (a UDP socket and the engine thread serving it), or a verbs
/// device (an RNIC or the kernel's soft-RoCE, through libibverbs: [`Device::open_verbs`]).
/// The objects made from either take the same requests and give the same completions.
#[derive(Clone)]
pub struct Device {
    kind: DevKind,
}

#[derive(Clone)]
enum DevKind {
    Engine(Arc<EngineGuard>),
    /// The device and its one protection domain (every [`Device::alloc_pd`] shares it: an
    /// rkey names one region either way).
    Verbs(Arc<VerbsDevice>, Arc<ibv::Pd>),
}

impl Device {
    /// Opens a device and starts its engine thread.
    pub fn open(cfg: DeviceConfig) -> io::Result<Self> {
        // The thread first: without one (`crate::thread::NoThread`) nothing is opened.
        let engine = crate::thread::claim()?;
        let shared = Shared::open(cfg)?;
        let s2 = shared.clone();
        let thread = engine.run("smcr-rdma".into(), move || run_engine(s2))?;
        Ok(Self {
            kind: DevKind::Engine(Arc::new(EngineGuard {
                shared,
                thread: Mutex::new(Some(thread)),
            })),
        })
    }

    /// Opens port `port` of the verbs device `name` for the local address `ip`, whose RoCE v2
    /// GID is the port's entry `gid_index` (see [`crate::ibv::sysfs::roce_v2_for`]). `alts`
    /// are other addresses of the port, with their entries, that queue pairs may send from
    /// (`QpAttr::src`): a link group's second path on the same device.
    pub fn open_verbs(
        name: &str,
        port: u8,
        gid_index: u32,
        ip: std::net::Ipv4Addr,
        alts: &[(std::net::Ipv4Addr, u32)],
    ) -> io::Result<Self> {
        let dev = VerbsDevice::open(name, port, gid_index, SocketAddrV4::new(ip, 4791), alts)?;
        let pd = dev.alloc_pd()?;
        Ok(Self {
            kind: DevKind::Verbs(dev, pd),
        })
    }

    /// The verbs device behind this one (`None`: our engine).
    pub fn verbs(&self) -> Option<ibv::VerbsInfo> {
        match &self.kind {
            DevKind::Engine(_) => None,
            DevKind::Verbs(v, _) => Some(v.info()),
        }
    }

    /// Whether this is a verbs device (not our engine).
    pub fn is_verbs(&self) -> bool {
        matches!(self.kind, DevKind::Verbs(..))
    }

    fn engine(&self) -> Option<&Arc<EngineGuard>> {
        match &self.kind {
            DevKind::Engine(g) => Some(g),
            DevKind::Verbs(..) => None,
        }
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        self.engine().map(|g| &g.shared)
    }

    /// The IPv4 address and UDP port peers send to: the RoCE port (4791) for a device that
    /// shares it ([`PortMode::Steered`]) or owns it, the configured port, or, local-only, the
    /// private port.
    pub fn local_addr(&self) -> SocketAddrV4 {
        match &self.kind {
            DevKind::Engine(g) => g.shared.local,
            DevKind::Verbs(v, _) => v.addr,
        }
    }

    /// The address of the device's own UDP socket (its QPN range's port when it shares the
    /// RoCE port). Packets sent there directly are accepted too.
    pub fn bound_addr(&self) -> SocketAddrV4 {
        self.shared()
            .map_or_else(|| self.local_addr(), |s| s.sock.local_addr())
    }

    /// How packets reach the device (see [`crate::transport::steer`]).
    pub fn mode(&self) -> PortMode {
        self.shared().map_or(PortMode::Verbs, |s| s.mode)
    }

    /// Whether peers on other hosts (which send to the RoCE port) reach the device: false
    /// when it is local-only (another process owns 4791 on its address and no steering program
    /// is attached). Same-host peers reach it through shared memory either way.
    pub fn reaches_remote(&self) -> bool {
        self.mode().reaches_remote()
    }

    /// The device's QPN range: each of its QPNs is `range << 12 | index`.
    pub fn qpn_range(&self) -> u32 {
        self.shared().map_or(0, |s| s.range)
    }

    /// The device's GID (`::ffff:` + its IPv4 address), as SMC-R puts it in CLC messages.
    pub fn gid(&self) -> [u8; 16] {
        match &self.kind {
            DevKind::Engine(g) => crate::device::gid_of(*g.shared.local.ip()),
            DevKind::Verbs(v, _) => v.gid,
        }
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        match &self.kind {
            DevKind::Engine(g) => ProtectionDomain(PdKind::Engine {
                guard: g.clone(),
                id: g.shared.next_pd.fetch_add(1, Ordering::Relaxed),
                arena: None,
            }),
            DevKind::Verbs(v, pd) => ProtectionDomain(PdKind::Verbs(v.clone(), pd.clone())),
        }
    }

    /// Allocates a protection domain whose memory regions live in shared memory (a sealed
    /// memfd of up to 4 GiB, used as regions are registered), so that its queue pairs can use
    /// the same-host transport with peers on this host and in this network namespace: an RDMA
    /// WRITE becomes a copy into the peer's region, a SEND an entry in a shared ring (see
    /// `docs/rdma.md`). Peers elsewhere are reached over UDP as usual. A same-host peer (of
    /// the same user) can reach every region of the domain, so use one domain per peer. On a
    /// verbs device this is [`Self::alloc_pd`] (the device reaches same-host peers itself).
    pub fn alloc_shared_pd(&self) -> io::Result<ProtectionDomain> {
        match &self.kind {
            DevKind::Engine(g) => Ok(ProtectionDomain(PdKind::Engine {
                guard: g.clone(),
                id: g.shared.next_pd.fetch_add(1, Ordering::Relaxed),
                arena: Some(crate::arena::Arena::create()?),
            })),
            DevKind::Verbs(..) => Ok(self.alloc_pd()),
        }
    }

    /// Creates a completion queue.
    pub fn create_cq(&self) -> io::Result<CompletionQueue> {
        Ok(CompletionQueue(match &self.kind {
            DevKind::Engine(g) => CqKind::Engine {
                shared: Arc::new(CqShared::new()?),
                guard: g.clone(),
            },
            DevKind::Verbs(v, _) => CqKind::Verbs(v.create_cq()?),
        }))
    }

    /// Counters.
    pub fn stats(&self) -> DeviceStats {
        self.shared().map(|s| s.stats()).unwrap_or_default()
    }

    /// Counters of the fault injector, when one is configured.
    pub fn fault_stats(&self) -> Option<FaultStats> {
        self.shared()?.fault_stats()
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("addr", &self.local_addr())
            .field("mode", &self.mode())
            .field("range", &self.qpn_range())
            .field("verbs", &self.verbs())
            .finish()
    }
}

/// A protection domain: memory regions and queue pairs of one domain only work together.
pub struct ProtectionDomain(PdKind);

enum PdKind {
    Engine {
        guard: Arc<EngineGuard>,
        id: u32,
        arena: Option<Arc<crate::arena::Arena>>,
    },
    Verbs(Arc<VerbsDevice>, Arc<ibv::Pd>),
}

impl ProtectionDomain {
    /// Allocates `len` bytes of zeroed, page-aligned memory and registers it (`ibv_reg_mr`).
    pub fn reg_mr(&self, len: usize, access: Access) -> io::Result<MemoryRegion> {
        match &self.0 {
            PdKind::Engine { guard, id, arena } => {
                let region = guard
                    .shared
                    .mrs
                    .register_in(*id, len, access, arena.as_ref())?;
                Ok(MemoryRegion(MrKind::Engine(EngineMr {
                    region,
                    guard: guard.clone(),
                })))
            }
            PdKind::Verbs(_, pd) => Ok(MemoryRegion(MrKind::Verbs(Arc::new(
                pd.reg_mr(len, access)?,
            )))),
        }
    }

    /// Registers the memory of `mr` (of this or another device) again in this domain
    /// (`ibv_reg_mr` of an already registered buffer): a second link of an SMC-R link group
    /// reaches the same RMB with its own rkey. The alias keeps the memory alive; dropping it
    /// deregisters only its own key. Refused for memory of a shared (same-host) domain, and
    /// between our engine and a verbs device.
    pub fn reg_alias(&self, mr: &MemoryRegion, access: Access) -> io::Result<MemoryRegion> {
        match (&self.0, &mr.0) {
            (PdKind::Engine { arena: Some(_), .. }, _) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "aliases are registered in private domains only",
            )),
            (PdKind::Engine { guard, id, .. }, MrKind::Engine(m)) => {
                let region = guard.shared.mrs.register_alias(*id, &m.region, access)?;
                Ok(MemoryRegion(MrKind::Engine(EngineMr {
                    region,
                    guard: guard.clone(),
                })))
            }
            (PdKind::Verbs(_, pd), MrKind::Verbs(m)) => Ok(MemoryRegion(MrKind::Verbs(Arc::new(
                pd.reg_alias(m, access)?,
            )))),
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a region of our engine and one of a verbs device cannot alias each other",
            )),
        }
    }

    /// Creates an RC queue pair in the RESET state (`ibv_create_qp`). With `sq_sig_all`, every
    /// send request produces a completion.
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        sq_sig_all: bool,
    ) -> io::Result<QueuePair> {
        let (guard, id, arena) = match (&self.0, &send_cq.0, &recv_cq.0) {
            (PdKind::Engine { guard, id, arena }, ..) => (guard, *id, arena),
            (PdKind::Verbs(dev, pd), CqKind::Verbs(s), CqKind::Verbs(r)) => {
                let qp = ibv::Qp::create(pd, &s.cq, &r.cq, &caps, sq_sig_all)?;
                let tracks = Arc::new(ibv::Tracks::default());
                s.track(qp.qp_num(), tracks.clone());
                r.track(qp.qp_num(), tracks.clone());
                return Ok(QueuePair(QpKind::Verbs(VerbsQp {
                    qp,
                    dev: dev.clone(),
                    state: Mutex::new(QpState::Reset),
                    send_cq: s.clone(),
                    recv_cq: r.clone(),
                    tracks,
                    sgid: std::sync::atomic::AtomicU8::new(dev.sgid_index),
                    sq_sig_all,
                    posting: Mutex::new(()),
                })));
            }
            (PdKind::Verbs(..), ..) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a verbs queue pair needs completion queues of its own device",
                ));
            }
        };
        let (
            CqKind::Engine {
                shared: send_cq, ..
            },
            CqKind::Engine {
                shared: recv_cq, ..
            },
        ) = (&send_cq.0, &recv_cq.0)
        else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an engine queue pair needs the engine's completion queues",
            ));
        };
        let shared = &guard.shared;
        let qpn = shared.alloc_qpn().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                "all 4095 QP numbers of the device's range are in use",
            )
        })?;
        let rc = RcQp::new(qpn, id, caps, sq_sig_all);
        let shm = match arena {
            Some(a) => Some(crate::samehost::ShmQp::new(a.clone())?),
            None => None,
        };
        let same_host = shm.is_some();
        let qp = Arc::new(QpShared::new(rc, send_cq.clone(), recv_cq.clone(), shm));
        shared.qps.write().insert(qpn, qp.clone());
        if same_host {
            let mut list = recv_cq.shm_qps.lock();
            // (Pruned here too: polling, which prunes, skips CQs with no live ring.)
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&qp));
        }
        Ok(QueuePair(QpKind::Engine(EngineQp {
            qp,
            guard: guard.clone(),
        })))
    }
}

/// Registered memory. Peers reach it through [`Self::rkey`] and [`Self::addr`]; local work
/// requests through [`Self::lkey`]. Deregistered when dropped.
pub struct MemoryRegion(MrKind);

enum MrKind {
    Engine(EngineMr),
    /// Shared with its aliases.
    Verbs(Arc<ibv::Mr>),
}

/// An engine region; deregistered when dropped.
struct EngineMr {
    region: Arc<Region>,
    guard: Arc<EngineGuard>,
}

impl Drop for EngineMr {
    fn drop(&mut self) {
        self.guard.shared.mrs.deregister(self.region.key());
    }
}

impl MemoryRegion {
    /// The address of the first byte, in the address space work requests and peers use.
    pub fn addr(&self) -> u64 {
        match &self.0 {
            MrKind::Engine(m) => m.region.addr(),
            MrKind::Verbs(m) => m.addr(),
        }
    }
    /// The local key.
    pub fn lkey(&self) -> u32 {
        match &self.0 {
            MrKind::Engine(m) => m.region.key(),
            MrKind::Verbs(m) => m.lkey(),
        }
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        match &self.0 {
            MrKind::Engine(m) => m.region.key(),
            MrKind::Verbs(m) => m.rkey(),
        }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            MrKind::Engine(m) => m.region.len(),
            MrKind::Verbs(m) => m.len(),
        }
    }
    /// The region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A scatter/gather element for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + offset as u64,
            length: len as u32,
            lkey: self.lkey(),
        }
    }
    /// Copies `data` into the region at `offset`. Panics if it does not fit.
    pub fn write(&self, offset: usize, data: &[u8]) {
        match &self.0 {
            MrKind::Engine(m) => m.region.write(offset, data),
            MrKind::Verbs(m) => m.write(offset, data),
        }
    }
    /// Copies from the region at `offset` into `out`. Panics if out of range.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        match &self.0 {
            MrKind::Engine(m) => m.region.read(offset, out),
            MrKind::Verbs(m) => m.read(offset, out),
        }
    }
    /// Pointer to the first byte (see [`Region::as_ptr`] for the rules).
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.0 {
            MrKind::Engine(m) => m.region.as_ptr(),
            MrKind::Verbs(m) => m.as_ptr(),
        }
    }
}

/// A completion queue. Poll it with [`Self::poll`]; to sleep until completions arrive, call
/// [`Self::req_notify`], poll once more, then wait for [`Self::fd`] to become readable (or just
/// call [`Self::wait`]).
pub struct CompletionQueue(CqKind);

enum CqKind {
    Engine {
        shared: Arc<CqShared>,
        guard: Arc<EngineGuard>,
    },
    Verbs(Arc<VerbsCq>),
}

impl CompletionQueue {
    /// Takes up to `out.len()` completions (`ibv_poll_cq`).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.poll(out),
        };
        guard.shared.shm_poll(shared);
        let mut q = shared.queue.lock();
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        n
    }

    /// Arms the notification: the next completion makes [`Self::fd`] readable
    /// (`ibv_req_notify_cq`).
    pub fn req_notify(&self) {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.req_notify(),
        };
        shared.notify.arm();
        // Same-host producers write the eventfd only for a consumer that says it sleeps.
        guard.shared.shm_sleepers(shared, |s| s.notify = true);
    }

    /// The notification file descriptor, for poll/epoll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.0 {
            CqKind::Engine { shared, .. } => shared.event.as_fd(),
            CqKind::Verbs(v) => v.fd(),
        }
    }

    /// Clears the notification fd after it fired (`ibv_get_cq_event` + `ibv_ack_cq_events`).
    pub fn ack_events(&self) {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.ack_events(),
        };
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&shared.event, &mut b);
        guard.shared.shm_sleepers(shared, |s| s.notify = false);
    }

    /// The scheduling of this CQ's completions among threads: smcr's extension, apart from
    /// the verbs (see [`CqScheduler`]).
    pub fn scheduler(&self) -> CqScheduler {
        CqScheduler(match &self.0 {
            CqKind::Engine { shared, guard } => SchedKind::Engine(EngineSched {
                shared: shared.clone(),
                guard: guard.clone(),
            }),
            CqKind::Verbs(v) => SchedKind::Verbs(v.clone()),
        })
    }

    /// Polls, sleeping until at least one completion arrives or `timeout` passes. While it
    /// sleeps, the calling thread receives and handles the device's packets itself when no other
    /// thread does (so no hand-off between threads is paid per completion).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> io::Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(0);
            }
            match &self.0 {
                CqKind::Engine { shared, guard } => guard.shared.wait_cq(shared, left)?,
                CqKind::Verbs(v) => v.sleep(left)?,
            }
        }
    }
}

/// A reliable-connection queue pair.
pub struct QueuePair(QpKind);

enum QpKind {
    Engine(EngineQp),
    Verbs(VerbsQp),
}

/// Each call, on the engine's queue pair or a verbs device's.
macro_rules! on_qp {
    ($self:ident, $e:ident => $engine:expr, $v:ident => $verbs:expr) => {
        match &$self.0 {
            QpKind::Engine($e) => $engine,
            QpKind::Verbs($v) => $verbs,
        }
    };
}

impl QueuePair {
    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        on_qp!(self, e => e.qp_num(), v => v.qp.qp_num())
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        on_qp!(self, e => e.state(), v => *v.state.lock())
    }

    /// Changes state and attributes (`ibv_modify_qp`). INIT → RTR needs `av`, the peer's
    /// address (its GID is `::ffff:` and the address, as RoCE v2 names IPv4 peers).
    pub fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        on_qp!(self, e => e.modify(attr), v => v.modify(attr))
    }

    /// Posts send requests and starts transmitting them on the calling thread
    /// (`ibv_post_send`; a corked thread's leave when it uncorks, see [`crate::cork`]). Stops
    /// at the first request that cannot be posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.post_send_report(wrs).map(drop)
    }

    /// As [`Self::post_send`]; returns how many of the requests already ran (same-host
    /// transport only: their data is in place and a SEND's payload copied; with
    /// [`SendFlags::SIGNAL_IF_DEFERRED`](crate::SendFlags::SIGNAL_IF_DEFERRED) only the others
    /// produce a completion).
    pub fn post_send_report(&self, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
        on_qp!(self, e => e.post_send_report(wrs), v => v.post_send(wrs).map(|()| 0))
    }

    /// Whether requests go through shared memory (the peer is on this host and in this
    /// network namespace; see [`Device::alloc_shared_pd`]) rather than UDP. Once true it stays
    /// true, and then a SEND's payload has been copied when `post_send` returns (its buffer
    /// may be reused at once; a signaled one still produces its completion). Never on a verbs
    /// device.
    pub fn is_same_host(&self) -> bool {
        on_qp!(self, e => e.is_same_host(), _v => false)
    }

    /// What became of the QP's same-host sharing (shared memory, or why not).
    pub fn same_host_state(&self) -> crate::SameHost {
        on_qp!(self, e => e.same_host_state(), _v => crate::SameHost::Off)
    }

    /// The same-host peer's process (user and pid, as SO_PEERCRED tells them in our user
    /// namespace), once its offer came.
    pub fn same_host_peer(&self) -> Option<crate::PeerCred> {
        on_qp!(self, e => e.same_host_peer(), _v => None)
    }

    /// Whether a post (or [`Self::is_same_host`]) already saw requests go through shared
    /// memory, without taking the QP's lock: a hot path's check. It lags the switch by at most
    /// one post; a caller that asks then treats that request as one sent over UDP, which is
    /// also correct (it is posted signaled, and its completion comes as on UDP).
    pub fn same_host_seen(&self) -> bool {
        on_qp!(self, e => e.same_host_seen(), _v => false)
    }

    /// Same-host transport only: places `data` at `remote_addr` of the peer (`rkey` checked),
    /// as an RDMA WRITE of a registered buffer would, but straight from the caller's memory
    /// (one copy less). Data written this way is in the peer's memory when this returns, so a
    /// SEND posted afterwards is seen after it. `false`: the QP does not send through shared
    /// memory (or the check failed): post a WRITE instead.
    pub fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        on_qp!(self, e => e.write_direct(data, remote_addr, rkey), _v => false)
    }

    /// Send requests posted and not finished: on UDP, those the peer has not acknowledged
    /// yet; on the same-host transport, those waiting for room in the peer's ring (the rest
    /// are in the peer's memory already). Zero once everything posted has reached the peer.
    /// On a verbs device, those whose completion has not come (see `ibv::Tracks`).
    pub fn unfinished_sends(&self) -> usize {
        on_qp!(self, e => e.unfinished_sends(), v => {
            v.send_cq.has_completions();
            v.tracks.unfinished()
        })
    }

    /// Posts receive requests (`ibv_post_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        on_qp!(self, e => e.post_recv(wrs), v => v.post_recv(wrs))
    }

    /// A summary of the transport state (PSNs, window, timers), for diagnostics.
    pub fn summary(&self) -> String {
        on_qp!(self, e => e.summary(), v => format!(
            "verbs {} qpn {} {:?}",
            v.dev.ctx.name(),
            v.qp.qp_num(),
            *v.state.lock()
        ))
    }

    /// What the responder refused so far (sequence errors, RNR, access errors…); a verbs
    /// device keeps its own counters (not read here).
    pub fn responder_stats(&self) -> crate::rc::ResponderStats {
        on_qp!(self, e => e.responder_stats(), _v => crate::rc::ResponderStats::default())
    }
}

/// A verbs device's queue pair, and the state it was last moved to.
struct VerbsQp {
    qp: ibv::Qp,
    dev: Arc<VerbsDevice>,
    state: Mutex<QpState>,
    send_cq: Arc<VerbsCq>,
    recv_cq: Arc<VerbsCq>,
    tracks: Arc<ibv::Tracks>,
    /// The GID entry it sends from (the device's, or an alternate address's: `QpAttr::src`).
    sgid: std::sync::atomic::AtomicU8,
    sq_sig_all: bool,
    /// Held from taking our ids to the device's post: the ids' order must be the device's
    /// queue order (two threads posting at once swapped them, and a completion was lost).
    posting: Mutex<()>,
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        let qpn = self.qp.qp_num();
        self.send_cq.untrack(qpn);
        self.recv_cq.untrack(qpn);
    }
}

impl VerbsQp {
    /// Every request goes signaled under an id of ours (see `ibv::Tracks`).
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let _posting = self.posting.lock();
        let ours: Vec<SendWr<'_>> = wrs
            .iter()
            .map(|w| {
                let deliver = self.sq_sig_all
                    || w.flags
                        .intersects(SendFlags::SIGNALED | SendFlags::SIGNAL_IF_DEFERRED);
                SendWr {
                    wr_id: self.tracks.send(w.wr_id, deliver),
                    flags: w.flags | SendFlags::SIGNALED,
                    ..*w
                }
            })
            .collect();
        self.qp.post_send_counted(&ours).map_err(|(took, e)| {
            self.tracks.unsend(ours.len() - took);
            e
        })
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let _posting = self.posting.lock();
        let ours: Vec<RecvWr<'_>> = wrs
            .iter()
            .map(|w| RecvWr {
                wr_id: self.tracks.recv(w.wr_id),
                ..*w
            })
            .collect();
        self.qp.post_recv_counted(&ours).map_err(|(took, e)| {
            self.tracks.unrecv(ours.len() - took);
            e
        })
    }

    fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        let mut state = self.state.lock();
        if let Some(src) = attr.src {
            // Each address has its own GID entry; one the device was not opened for has none.
            let i = self
                .dev
                .sgid_for(src)
                .ok_or(ModifyError::NotModifiable("src"))?;
            self.sgid.store(i, Ordering::Relaxed);
        }
        let r = match attr.qp_state {
            QpState::Init if *state == QpState::Reset => self.qp.to_init(false),
            QpState::Rtr if *state == QpState::Init => {
                let av = attr.av.ok_or(ModifyError::MissingAttr("av"))?;
                let rq_psn = attr.rq_psn.ok_or(ModifyError::MissingAttr("rq_psn"))?;
                let dest = attr
                    .dest_qp_num
                    .ok_or(ModifyError::MissingAttr("dest_qp_num"))?;
                let mtu = attr.path_mtu.unwrap_or(self.dev.mtu);
                self.qp.to_rtr(&ibv::RtrAttr {
                    dest_qpn: dest,
                    rq_psn: rq_psn.value(),
                    // Never above what the device's port does.
                    mtu: if mtu.bytes() > self.dev.mtu.bytes() {
                        self.dev.mtu
                    } else {
                        mtu
                    },
                    dgid: crate::device::gid_of(*av.ip()),
                    sgid_index: self.sgid.load(Ordering::Relaxed),
                    hop_limit: 64,
                    min_rnr_timer: attr.min_rnr_timer,
                })
            }
            QpState::Rts if *state == QpState::Rtr => {
                let psn = attr.sq_psn.ok_or(ModifyError::MissingAttr("sq_psn"))?;
                self.qp.to_rts(&ibv::RtsAttr {
                    sq_psn: psn.value(),
                    timeout: attr.timeout,
                    retry_cnt: attr.retry_cnt,
                    rnr_retry: attr.rnr_retry,
                })
            }
            QpState::Error => self.qp.to_error(),
            QpState::Reset => self.qp.to_reset(),
            s if s == *state => Ok(()),
            _ => {
                return Err(ModifyError::InvalidTransition {
                    from: *state,
                    to: attr.qp_state,
                });
            }
        };
        r.map_err(|e| ModifyError::Device(e.raw_os_error().unwrap_or(libc::EINVAL)))?;
        *state = attr.qp_state;
        Ok(())
    }
}

/// Our engine's queue pair.
struct EngineQp {
    qp: Arc<QpShared>,
    guard: Arc<EngineGuard>,
}

impl EngineQp {
    /// The QP number peers address.
    fn qp_num(&self) -> u32 {
        self.qp.qpn
    }

    /// The current state.
    fn state(&self) -> QpState {
        self.qp.core.lock().rc.state()
    }

    /// Changes state and attributes (`ibv_modify_qp`). INIT → RTR needs `av`, the peer
    /// engine's address.
    fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        let mut core = self.qp.core.lock();
        let from = core.rc.state();
        if attr.qp_state == QpState::Rtr && from == QpState::Init && attr.av.is_none() {
            return Err(ModifyError::MissingAttr("av"));
        }
        let shared = &self.guard.shared;
        if let Some(src) = attr.src
            && src != *shared.local.ip()
            && !shared.cfg.extra_addrs.contains(&src)
        {
            // Not an address of this device: its packets could not carry a valid ICRC.
            return Err(ModifyError::NotModifiable("src"));
        }
        if matches!(attr.qp_state, QpState::Error | QpState::Reset) {
            // A held ACK leaves first: flushing would drop it, and the peer would retry
            // against a QP that no longer answers.
            if core.rc.end_ack_hold() {
                shared.drive(&mut core, Instant::now());
            }
        }
        core.rc.modify(attr)?;
        if attr.qp_state == QpState::Reset {
            // Whatever the next peer is, it is learnt again from its packets.
            core.peer_ext = false;
            core.peer_no_icrc = false;
        }
        if attr.src.is_some() {
            core.src = attr.src;
        }
        if let Some(av) = attr.av {
            // A new peer: whether it is our engine is learnt again from its packets.
            core.peer_ext &= core.av == Some(av);
            core.av = Some(av);
            let src = core.src.unwrap_or(*shared.local.ip());
            core.max_dgram = crate::transport::udp::interface_mtu(src).map(|m| {
                (m as usize)
                    .saturating_sub(crate::wire::IPV4_HEADER_LEN + crate::wire::UDP_HEADER_LEN)
            });
        }
        let core_ref = &mut *core;
        if let Some(shm) = &mut core_ref.shm {
            match attr.qp_state {
                QpState::Reset => shm.disconnect(None),
                QpState::Error => shm.disconnect(Some(&mut core_ref.rc)),
                QpState::Rtr if from == QpState::Init => {
                    shm.rq_psn = attr.rq_psn.map(|p| p.value());
                }
                QpState::Rts if from == QpState::Rtr => {
                    shm.sq_psn = attr.sq_psn.map(|p| p.value());
                    // Offer our shared memory to the peer (at the rendezvous of its address
                    // and QPN range); if it is on this host and proves it is our peer, it
                    // gets our descriptors and offers back — until then (at most
                    // OFFER_WAIT) our requests wait for it rather than going out over UDP.
                    let hello = crate::samehost::nonce().ok().map(|nonce| {
                        (
                            nonce,
                            crate::samehost::Msg::Hello {
                                to_qpn: core_ref.rc.dest_qp_num(),
                                from_qpn: self.qp.qpn,
                                from: shared.local,
                                nonce,
                            },
                        )
                    });
                    // Counted live before the exchange starts (the peer may write as soon as
                    // it has our descriptors), with the sleepers' waiting word so that it
                    // rings our bell (Notify::published).
                    let cq = &core_ref.recv_cq;
                    shm.live = Some(crate::samehost::Live::new(cq.shm_live.clone()));
                    shm.set_waiting(cq.notify.published());
                    shm.offered = match (core_ref.av, &hello, shm.as_initiator(&core_ref.rc)) {
                        (Some(av), Some((_, m)), Some(_)) => crate::samehost::send_hello(
                            *av.ip(),
                            crate::transport::steer::range_of(core_ref.rc.dest_qp_num()),
                            m,
                        ),
                        _ => None,
                    };
                    // Nobody at the peer's rendezvous: not on this host (or out of reach).
                    shm.not_found = shm.offered.is_none() && core_ref.av.is_some();
                    match &shm.offered {
                        Some(c) => {
                            shm.hello = hello.map(|(n, _)| n);
                            shm.wait_until = Some(Instant::now() + crate::samehost::OFFER_WAIT);
                            shared.watch_offer(self.qp.qpn, c);
                        }
                        None => shm.live = None,
                    }
                    // A peer's hello that came before we knew the pair's secret: challenged,
                    // or refused if our own offer did not go.
                    shared.answer_hellos(self.qp.qpn, &core_ref.rc, core_ref.av, shm);
                }
                _ => {}
            }
        }
        self.guard.shared.drive(&mut core, Instant::now());
        Ok(())
    }

    /// As [`QueuePair::post_send`]; returns how many of the requests already ran (same-host
    /// transport only: their data is in place and a SEND's payload copied; with
    /// [`SendFlags::SIGNAL_IF_DEFERRED`](crate::SendFlags::SIGNAL_IF_DEFERRED) only the others
    /// produce a completion).
    fn post_send_report(&self, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
        let shared = &self.guard.shared;
        let mut core = self.qp.core.lock();
        let mut res = Ok(());
        let now = Instant::now();
        let crate::device::QpCore { rc, shm, av, .. } = &mut *core;
        if let Some(shm) = shm.as_mut() {
            // Held requests go before these.
            shm.settle(rc, *av, now, &shared.mrs);
        }
        let same_host = shm.as_mut().is_some_and(|s| s.ready(rc, *av));
        if same_host {
            self.qp.same_host.store(true, Ordering::Relaxed);
        }
        let mut ran = 0;
        match shm {
            Some(shm) if !same_host && shm.awaiting(now) && rc.state() == QpState::Rts => {
                // The peer is on this host and its offer is due: wait for it rather than
                // start on UDP (which would delay the switch until all of it is acknowledged).
                for wr in wrs {
                    if let Err(e) = shm.hold(rc, wr, &shared.mrs) {
                        res = Err(e);
                        break;
                    }
                }
            }
            Some(shm) if same_host => {
                for wr in wrs {
                    match shm.post(rc, wr, &shared.mrs) {
                        Ok(now) => ran += usize::from(now),
                        Err(e) => {
                            res = Err(e);
                            break;
                        }
                    }
                }
            }
            _ => {
                for wr in wrs {
                    if let Err(e) = rc.post_send(wr, &shared.mrs) {
                        res = Err(e);
                        break;
                    }
                }
            }
        }
        let now = Instant::now();
        // A corked thread's requests over UDP leave when it uncorks (crate::cork); the engine
        // sends them if it does not come back in time.
        let deferred = (!same_host && res.is_ok() && crate::cork::corked())
            .then(|| crate::cork::defer(&self.guard, &self.qp))
            .flatten();
        match deferred {
            Some(first) => {
                if first {
                    shared.arm(&mut core, now + shared.cfg.cork_max);
                }
            }
            None => shared.drive(&mut core, now),
        }
        res.map(|()| ran)
    }

    /// Whether requests go through shared memory (the peer is on this host and in this
    /// network namespace; see [`Device::alloc_shared_pd`]) rather than UDP. Once true it stays
    /// true, and then a SEND's payload has been copied when `post_send` returns (its buffer
    /// may be reused at once; a signaled one still produces its completion).
    fn is_same_host(&self) -> bool {
        let mut core = self.qp.core.lock();
        self.settle_held(&mut core);
        let crate::device::QpCore { rc, shm, av, .. } = &mut *core;
        let yes = shm.as_mut().is_some_and(|s| s.ready(rc, *av));
        if yes {
            self.qp.same_host.store(true, Ordering::Relaxed);
        }
        yes
    }

    /// What became of the QP's same-host sharing (shared memory, or why not).
    fn same_host_state(&self) -> crate::SameHost {
        let core = self.qp.core.lock();
        core.shm
            .as_ref()
            .map_or(crate::SameHost::Off, crate::samehost::ShmQp::state)
    }

    /// The same-host peer's process (user and pid, as SO_PEERCRED tells them in our user
    /// namespace), once its offer came.
    fn same_host_peer(&self) -> Option<crate::PeerCred> {
        let core = self.qp.core.lock();
        core.shm.as_ref()?.tx.as_ref()?.cred
    }

    /// Whether a post (or [`Self::is_same_host`]) already saw requests go through shared
    /// memory, without taking the QP's lock: a hot path's check. It lags the switch by at most
    /// one post; a caller that asks then treats that request as one sent over UDP, which is
    /// also correct (it is posted signaled, and its completion comes as on UDP).
    fn same_host_seen(&self) -> bool {
        self.qp.same_host.load(Ordering::Relaxed)
    }

    /// Requests held for the peer's offer run before anything else (a drive settles them,
    /// and sends or rings what they produced).
    fn settle_held(&self, core: &mut crate::device::QpCore) {
        if core.shm.as_ref().is_some_and(|s| s.held_len() > 0) {
            self.guard.shared.drive(core, Instant::now());
        }
    }

    /// Same-host transport only: places `data` at `remote_addr` of the peer (`rkey` checked),
    /// as an RDMA WRITE of a registered buffer would, but straight from the caller's memory
    /// (one copy less). Data written this way is in the peer's memory when this returns, so a
    /// SEND posted afterwards is seen after it. `false`: the QP does not send through shared
    /// memory (or the check failed): post a WRITE instead.
    fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        let mut core = self.qp.core.lock();
        self.settle_held(&mut core);
        let crate::device::QpCore { rc, shm, av, .. } = &mut *core;
        let Some(shm) = shm else { return false };
        rc.state() == QpState::Rts
            && shm.ready(rc, *av)
            && shm.held_len() == 0
            && shm.write_direct(data, remote_addr, rkey)
    }

    /// Send requests posted and not finished: on UDP, those the peer has not acknowledged
    /// yet; on the same-host transport, those waiting for room in the peer's ring (the rest
    /// are in the peer's memory already). Zero once everything posted has reached the peer.
    fn unfinished_sends(&self) -> usize {
        let core = self.qp.core.lock();
        core.rc.send_queue_len()
            + core
                .shm
                .as_ref()
                .map_or(0, |s| s.backlog_len() + s.held_len())
    }

    /// Posts receive requests (`ibv_post_recv`).
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let shared = &self.guard.shared;
        let mut core = self.qp.core.lock();
        let mut res = Ok(());
        for wr in wrs {
            if let Err(e) = core.rc.post_recv(wr, &shared.mrs) {
                res = Err(e);
                break;
            }
        }
        shared.drive(&mut core, Instant::now());
        res
    }

    /// A summary of the transport state (PSNs, window, timers), for diagnostics.
    fn summary(&self) -> String {
        let core = self.qp.core.lock();
        let mut s = core.rc.summary(Instant::now());
        if let Some(shm) = &core.shm {
            s.push_str(if shm.active { " | same-host" } else { " | udp" });
            if let Some(f) = shm.fault {
                s.push_str(" (shared memory failed: ");
                s.push_str(f);
                s.push(')');
            }
        }
        s
    }

    /// What the responder refused so far (sequence errors, RNR, access errors…).
    fn responder_stats(&self) -> crate::rc::ResponderStats {
        self.qp.core.lock().rc.responder_stats()
    }
}

impl Drop for EngineQp {
    fn drop(&mut self) {
        self.guard.shared.qps.write().remove(&self.qp.qpn);
        let mut core = self.qp.core.lock();
        if core.rc.end_ack_hold() {
            // The peer waits for it: without it, it would send again to a QP that is gone.
            self.guard.shared.drive(&mut core, Instant::now());
        }
        let _ = core.rc.modify(&QpAttr::state(QpState::Reset));
    }
}
