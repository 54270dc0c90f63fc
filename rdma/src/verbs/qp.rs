//! [`QueuePair`] and its verbs-device kind.

#[allow(unused_imports)]
use super::*;

/// A reliable-connection queue pair.
pub struct QueuePair(pub(super) QpKind);

pub(super) enum QpKind {
    Engine(EngineQp),
    Verbs(VerbsQp),
    Mem(Arc<MemQp>),
}

/// Each call, on the engine's queue pair, a verbs device's or an in-memory one's.
macro_rules! on_qp {
    ($self:ident, $e:ident => $engine:expr, $v:ident => $verbs:expr, $m:ident => $mem:expr) => {
        match &$self.0 {
            QpKind::Engine($e) => $engine,
            QpKind::Verbs($v) => $verbs,
            QpKind::Mem($m) => $mem,
        }
    };
}

impl QueuePair {
    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        on_qp!(self, e => e.qp_num(), v => v.qp.qp_num(), m => m.qpn)
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        on_qp!(self, e => e.state(), v => *v.state.lock(), m => m.state())
    }

    /// Changes state and attributes (`ibv_modify_qp`). INIT → RTR needs `av`, the peer's
    /// address (its GID is `::ffff:` and the address, as RoCE v2 names IPv4 peers).
    pub fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        on_qp!(self, e => e.modify(attr), v => v.modify(attr), m => m.modify(attr))
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
        on_qp!(self, e => e.post_send_report(wrs), v => v.post_send(wrs).map(|()| 0), m => m.post_send(wrs))
    }

    /// Whether requests go through shared memory (the peer is on this host and in this
    /// network namespace; see [`Device::alloc_shared_pd`]) rather than UDP. Once true it stays
    /// true, and then a SEND's payload has been copied when `post_send` returns (its buffer
    /// may be reused at once; a signaled one still produces its completion). Never on a verbs
    /// device.
    pub fn is_same_host(&self) -> bool {
        on_qp!(self, e => e.is_same_host(), _v => false, _m => false)
    }

    /// What became of the QP's same-host sharing (shared memory, or why not).
    pub fn same_host_state(&self) -> crate::SameHost {
        on_qp!(self, e => e.same_host_state(), _v => crate::SameHost::Off, _m => crate::SameHost::Off)
    }

    /// Whether the peer is our engine, proven by its same-host offer (its pair's proof
    /// checked): from then on, whether or not requests go through shared memory yet.
    pub fn peer_is_our_engine(&self) -> bool {
        on_qp!(self, e => e.peer_is_our_engine(), _v => false, _m => false)
    }

    /// The same-host peer's process (user and pid, as SO_PEERCRED tells them in our user
    /// namespace), once its offer came.
    pub fn same_host_peer(&self) -> Option<crate::PeerCred> {
        on_qp!(self, e => e.same_host_peer(), _v => None, _m => None)
    }

    /// Whether a post (or [`Self::is_same_host`]) already saw requests go through shared
    /// memory, without taking the QP's lock: a hot path's check. It lags the switch by at most
    /// one post; a caller that asks then treats that request as one sent over UDP, which is
    /// also correct (it is posted signaled, and its completion comes as on UDP).
    pub fn same_host_seen(&self) -> bool {
        on_qp!(self, e => e.same_host_seen(), _v => false, _m => false)
    }

    /// Same-host transport only: places `data` at `remote_addr` of the peer (`rkey` checked),
    /// as an RDMA WRITE of a registered buffer would, but straight from the caller's memory
    /// (one copy less). Data written this way is in the peer's memory when this returns, so a
    /// SEND posted afterwards is seen after it. `false`: the QP does not send through shared
    /// memory (or the check failed): post a WRITE instead.
    pub fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        on_qp!(self, e => e.write_direct(data, remote_addr, rkey), _v => false, _m => false)
    }

    /// Send requests posted and not finished: on UDP, those the peer has not acknowledged
    /// yet; on the same-host transport, those waiting for room in the peer's ring (the rest
    /// are in the peer's memory already). Zero once everything posted has reached the peer.
    /// On a verbs device, those whose completion has not come (see `ibv::Tracks`).
    pub fn unfinished_sends(&self) -> usize {
        on_qp!(self, e => e.unfinished_sends(), v => {
            v.send_cq.has_completions();
            v.tracks.unfinished()
        }, _m => 0)
    }

    /// Posts receive requests (`ibv_post_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        on_qp!(self, e => e.post_recv(wrs), v => v.post_recv(wrs), m => m.post_recv(wrs))
    }

    /// A summary of the transport state (PSNs, window, timers), for diagnostics.
    pub fn summary(&self) -> String {
        on_qp!(self, e => e.summary(), v => format!(
            "verbs {} qpn {} {:?}",
            v.dev.ctx.name(),
            v.qp.qp_num(),
            *v.state.lock()
        ), m => m.summary())
    }

    /// What the responder refused so far (sequence errors, RNR, access errors…); a verbs
    /// device keeps its own counters (not read here).
    pub fn responder_stats(&self) -> crate::rc::ResponderStats {
        on_qp!(self, e => e.responder_stats(), _v => crate::rc::ResponderStats::default(), _m => crate::rc::ResponderStats::default())
    }
}

/// A verbs device's queue pair, and the state it was last moved to.
pub(super) struct VerbsQp {
    pub(super) qp: ibv::Qp,
    pub(super) dev: Arc<VerbsDevice>,
    pub(super) state: Mutex<QpState>,
    pub(super) send_cq: Arc<VerbsCq>,
    pub(super) recv_cq: Arc<VerbsCq>,
    pub(super) tracks: Arc<ibv::Tracks>,
    /// The GID entry it sends from (the device's, or an alternate address's: `QpAttr::src`).
    pub(super) sgid: std::sync::atomic::AtomicU8,
    pub(super) sq_sig_all: bool,
    /// Held from taking our ids to the device's post: the ids' order must be the device's
    /// queue order (two threads posting at once swapped them, and a completion was lost).
    pub(super) posting: Mutex<()>,
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
    pub(super) fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
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

    pub(super) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
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

    pub(super) fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
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
