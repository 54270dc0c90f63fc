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
use crate::mr::{Access, Region};
use crate::rc::{
    ModifyError, PostError, QpAttr, QpCaps, QpState, RcQp, RecvWr, SendWr, Sge, WorkCompletion,
};
use crate::sched::CqScheduler;
use crate::transport::fault::FaultStats;
use crate::transport::steer::PortMode;
use parking_lot::Mutex;
use rustix::fd::{AsFd, BorrowedFd};
use std::io;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// An RDMA device: a UDP socket and the engine thread serving it.
#[derive(Clone)]
pub struct Device {
    guard: Arc<EngineGuard>,
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
            guard: Arc::new(EngineGuard {
                shared,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.guard.shared
    }

    /// The IPv4 address and UDP port peers send to: the RoCE port (4791) for a device that
    /// shares it ([`PortMode::Steered`]) or owns it, the configured port, or, local-only, the
    /// private port.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.shared().local
    }

    /// The address of the device's own UDP socket (its QPN range's port when it shares the
    /// RoCE port). Packets sent there directly are accepted too.
    pub fn bound_addr(&self) -> SocketAddrV4 {
        self.shared().sock.local_addr()
    }

    /// How packets reach the device (see [`crate::transport::steer`]).
    pub fn mode(&self) -> PortMode {
        self.shared().mode
    }

    /// Whether peers on other hosts (which send to the RoCE port) reach the device: false
    /// when it is local-only (another process owns 4791 on its address and no steering program
    /// is attached). Same-host peers reach it through shared memory either way.
    pub fn reaches_remote(&self) -> bool {
        self.shared().mode.reaches_remote()
    }

    /// The device's QPN range: each of its QPNs is `range << 12 | index`.
    pub fn qpn_range(&self) -> u32 {
        self.shared().range
    }

    /// The device's GID (`::ffff:` + its IPv4 address), as SMC-R puts it in CLC messages.
    pub fn gid(&self) -> [u8; 16] {
        crate::device::gid_of(*self.local_addr().ip())
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        let id = self.shared().next_pd.fetch_add(1, Ordering::Relaxed);
        ProtectionDomain {
            guard: self.guard.clone(),
            id,
            arena: None,
        }
    }

    /// Allocates a protection domain whose memory regions live in shared memory (a sealed
    /// memfd of up to 4 GiB, used as regions are registered), so that its queue pairs can use
    /// the same-host transport with peers on this host and in this network namespace: an RDMA
    /// WRITE becomes a copy into the peer's region, a SEND an entry in a shared ring (see
    /// `docs/rdma.md`). Peers elsewhere are reached over UDP as usual. A same-host peer (of
    /// the same user) can reach every region of the domain, so use one domain per peer.
    pub fn alloc_shared_pd(&self) -> io::Result<ProtectionDomain> {
        let id = self.shared().next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(ProtectionDomain {
            guard: self.guard.clone(),
            id,
            arena: Some(crate::arena::Arena::create()?),
        })
    }

    /// Creates a completion queue.
    pub fn create_cq(&self) -> io::Result<CompletionQueue> {
        Ok(CompletionQueue {
            shared: Arc::new(CqShared::new()?),
            guard: self.guard.clone(),
        })
    }

    /// Counters.
    pub fn stats(&self) -> DeviceStats {
        self.shared().stats()
    }

    /// Counters of the fault injector, when one is configured.
    pub fn fault_stats(&self) -> Option<FaultStats> {
        self.shared().fault_stats()
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("addr", &self.local_addr())
            .field("mode", &self.mode())
            .field("range", &self.qpn_range())
            .finish()
    }
}

/// A protection domain: memory regions and queue pairs of one domain only work together.
pub struct ProtectionDomain {
    guard: Arc<EngineGuard>,
    id: u32,
    arena: Option<Arc<crate::arena::Arena>>,
}

impl ProtectionDomain {
    /// Allocates `len` bytes of zeroed, page-aligned memory and registers it (`ibv_reg_mr`).
    pub fn reg_mr(&self, len: usize, access: Access) -> io::Result<MemoryRegion> {
        let region =
            self.guard
                .shared
                .mrs
                .register_in(self.id, len, access, self.arena.as_ref())?;
        Ok(MemoryRegion {
            region,
            guard: self.guard.clone(),
        })
    }

    /// Registers the memory of `mr` (of this or another device) again in this domain
    /// (`ibv_reg_mr` of an already registered buffer): a second link of an SMC-R link group
    /// reaches the same RMB with its own rkey. The alias keeps the memory alive; dropping it
    /// deregisters only its own key. Refused for memory of a shared (same-host) domain.
    pub fn reg_alias(&self, mr: &MemoryRegion, access: Access) -> io::Result<MemoryRegion> {
        if self.arena.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "aliases are registered in private domains only",
            ));
        }
        let region = self
            .guard
            .shared
            .mrs
            .register_alias(self.id, &mr.region, access)?;
        Ok(MemoryRegion {
            region,
            guard: self.guard.clone(),
        })
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
        let shared = &self.guard.shared;
        let qpn = shared.alloc_qpn().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                "all 4095 QP numbers of the device's range are in use",
            )
        })?;
        let rc = RcQp::new(qpn, self.id, caps, sq_sig_all);
        let shm = match &self.arena {
            Some(a) => Some(crate::samehost::ShmQp::new(a.clone())?),
            None => None,
        };
        let same_host = shm.is_some();
        let qp = Arc::new(QpShared::new(
            rc,
            send_cq.shared.clone(),
            recv_cq.shared.clone(),
            shm,
        ));
        shared.qps.write().insert(qpn, qp.clone());
        if same_host {
            let mut list = recv_cq.shared.shm_qps.lock();
            // (Pruned here too: polling, which prunes, skips CQs with no live ring.)
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&qp));
        }
        Ok(QueuePair {
            qp,
            guard: self.guard.clone(),
        })
    }
}

/// Registered memory. Peers reach it through [`Self::rkey`] and [`Self::addr`]; local work
/// requests through [`Self::lkey`]. Deregistered when dropped.
pub struct MemoryRegion {
    region: Arc<Region>,
    guard: Arc<EngineGuard>,
}

impl MemoryRegion {
    /// The address of the first byte, in the address space work requests and peers use.
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }
    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.region.key()
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.region.key()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// The region is empty.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
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
        self.region.write(offset, data)
    }
    /// Copies from the region at `offset` into `out`. Panics if out of range.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.region.read(offset, out)
    }
    /// Pointer to the first byte (see [`Region::as_ptr`] for the rules).
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.guard.shared.mrs.deregister(self.region.key());
    }
}

/// A completion queue. Poll it with [`Self::poll`]; to sleep until completions arrive, call
/// [`Self::req_notify`], poll once more, then wait for [`Self::fd`] to become readable (or just
/// call [`Self::wait`]).
pub struct CompletionQueue {
    shared: Arc<CqShared>,
    guard: Arc<EngineGuard>,
}

impl CompletionQueue {
    /// Takes up to `out.len()` completions (`ibv_poll_cq`).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        self.guard.shared.shm_poll(&self.shared);
        let mut q = self.shared.queue.lock();
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        n
    }

    /// Arms the notification: the next completion makes [`Self::fd`] readable
    /// (`ibv_req_notify_cq`).
    pub fn req_notify(&self) {
        self.shared.notify.arm();
        // Same-host producers write the eventfd only for a consumer that says it sleeps.
        self.guard
            .shared
            .shm_sleepers(&self.shared, |s| s.notify = true);
    }

    /// The notification file descriptor, for poll/epoll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.event.as_fd()
    }

    /// Clears the notification fd after it fired (`ibv_get_cq_event` + `ibv_ack_cq_events`).
    pub fn ack_events(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.shared.event, &mut b);
        self.guard
            .shared
            .shm_sleepers(&self.shared, |s| s.notify = false);
    }

    /// The scheduling of this CQ's completions among threads: smcr's extension, apart from
    /// the verbs (see [`CqScheduler`]).
    pub fn scheduler(&self) -> CqScheduler {
        CqScheduler {
            shared: self.shared.clone(),
            guard: self.guard.clone(),
        }
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
            self.guard.shared.wait_cq(&self.shared, left)?;
        }
    }
}

/// A reliable-connection queue pair.
pub struct QueuePair {
    qp: Arc<QpShared>,
    guard: Arc<EngineGuard>,
}

impl QueuePair {
    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        self.qp.qpn
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.qp.core.lock().rc.state()
    }

    /// Changes state and attributes (`ibv_modify_qp`). INIT → RTR needs `av`, the peer
    /// engine's address.
    pub fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
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
        core.rc.modify(attr)?;
        if let Some(av) = attr.av {
            core.av = Some(av);
        }
        if attr.src.is_some() {
            core.src = attr.src;
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
                    // A peer's hello that came before we knew the pair's secret.
                    shared.answer_hellos(self.qp.qpn, &core_ref.rc, core_ref.av, shm);
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
                }
                _ => {}
            }
        }
        self.guard.shared.drive(&mut core, Instant::now());
        Ok(())
    }

    /// Posts send requests and starts transmitting them on the calling thread
    /// (`ibv_post_send`). Stops at the first request that cannot be posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.post_send_report(wrs).map(drop)
    }

    /// As [`Self::post_send`]; returns how many of the requests already ran (same-host
    /// transport only: their data is in place and a SEND's payload copied; with
    /// [`SendFlags::SIGNAL_IF_DEFERRED`](crate::SendFlags::SIGNAL_IF_DEFERRED) only the others
    /// produce a completion).
    pub fn post_send_report(&self, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
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
        shared.drive(&mut core, Instant::now());
        res.map(|()| ran)
    }

    /// Whether requests go through shared memory (the peer is on this host and in this
    /// network namespace; see [`Device::alloc_shared_pd`]) rather than UDP. Once true it stays
    /// true, and then a SEND's payload has been copied when `post_send` returns (its buffer
    /// may be reused at once; a signaled one still produces its completion).
    pub fn is_same_host(&self) -> bool {
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
    pub fn same_host_state(&self) -> crate::SameHost {
        let core = self.qp.core.lock();
        core.shm
            .as_ref()
            .map_or(crate::SameHost::Off, crate::samehost::ShmQp::state)
    }

    /// The same-host peer's process (user and pid, as SO_PEERCRED tells them in our user
    /// namespace), once its offer came.
    pub fn same_host_peer(&self) -> Option<crate::PeerCred> {
        let core = self.qp.core.lock();
        core.shm.as_ref()?.tx.as_ref()?.cred
    }

    /// Whether a post (or [`Self::is_same_host`]) already saw requests go through shared
    /// memory, without taking the QP's lock: a hot path's check. It lags the switch by at most
    /// one post; a caller that asks then treats that request as one sent over UDP, which is
    /// also correct (it is posted signaled, and its completion comes as on UDP).
    pub fn same_host_seen(&self) -> bool {
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
    pub fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
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
    pub fn unfinished_sends(&self) -> usize {
        let core = self.qp.core.lock();
        core.rc.send_queue_len()
            + core
                .shm
                .as_ref()
                .map_or(0, |s| s.backlog_len() + s.held_len())
    }

    /// Posts receive requests (`ibv_post_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
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
    pub fn summary(&self) -> String {
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
    pub fn responder_stats(&self) -> crate::rc::ResponderStats {
        self.qp.core.lock().rc.responder_stats()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.guard.shared.qps.write().remove(&self.qp.qpn);
        let _ = self
            .qp
            .core
            .lock()
            .rc
            .modify(&QpAttr::state(QpState::Reset));
    }
}
