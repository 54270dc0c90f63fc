//! A reliable-connection queue pair without I/O: the state machine RESET → INIT → RTR → RTS
//! (→ ERR), and the routing of packets, posts and timers to the requester and responder.

use super::TxParts;
use super::requester::{ReqParams, Requester, RequesterStats};
use super::responder::{RecvWqe, RespParams, Responder, ResponderStats};
use super::{
    CqSide, Mtu, PostError, RecvWr, SendFlags, SendWr, SgList, WcOpcode, WcStatus, WorkCompletion,
    WrOpcode, timeout_duration,
};
use crate::mr::{Access, MrTable};
use crate::wire::{Kind, PacketRepr, Psn};
use std::collections::VecDeque;
use std::net::SocketAddrV4;
use std::time::Instant;

/// Queue pair states (`IBV_QPS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created or reset: nothing is accepted.
    Reset,
    /// Receive requests may be posted; no traffic.
    Init,
    /// Ready to receive: the responder runs.
    Rtr,
    /// Ready to send: both halves run.
    Rts,
    /// Failed: every request is flushed with `WR_FLUSH_ERR`.
    Error,
}

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Maximum outstanding send requests.
    pub max_send_wr: u32,
    /// Maximum posted receive requests.
    pub max_recv_wr: u32,
    /// Maximum scatter/gather elements per send request.
    pub max_send_sge: u32,
    /// Maximum scatter/gather elements per receive request.
    pub max_recv_sge: u32,
    /// Largest send window in packets (our extension: the congestion window grows up to this).
    /// 4096 (4 MiB at 1 KiB packets): one link carries all of a link group's connections, and
    /// over a 50 ms round trip 512 packets moved 10 MiB/s, so an LLC answer queued behind the
    /// connections' data took longer than LLC_WAIT (tests/faults.rs, the delay case).
    pub max_inflight: u32,
    /// Our extension: how long the ACK of a message that completes a receive (a SEND) may
    /// wait for a request of ours to leave with (`None`: sent at once, as rxe does). The
    /// receiver usually answers such a message: the ACK then closes the answer's datagram
    /// instead of taking a datagram, a system call and a wake-up of the peer of its own.
    /// Held only for a peer that is our engine (its packets carry [`crate::wire::MARK`]),
    /// and never for a message sent with [`SendFlags::ACK_NOW`](crate::SendFlags::ACK_NOW).
    pub ack_delay: Option<std::time::Duration>,
}

/// A held ACK may leave at most this many of the peer's packets unacknowledged: a request
/// (its WRITE and its CDC SEND), not a bulk transfer's window, whose sender would probe.
const HOLD_MAX_PKTS: u32 = 4;

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inflight: 4096,
            ack_delay: None,
        }
    }
}

/// Attributes for [`RcQp::modify`] (`struct ibv_qp_attr`); `None` leaves a value unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// The state to move to.
    pub qp_state: QpState,
    /// Path MTU (required for INIT → RTR).
    pub path_mtu: Option<Mtu>,
    /// The peer's QP number (required for INIT → RTR).
    pub dest_qp_num: Option<u32>,
    /// The peer's initial PSN: our expected PSN (required for INIT → RTR).
    pub rq_psn: Option<Psn>,
    /// Where the peer's engine listens (required for INIT → RTR by the device layer).
    pub av: Option<SocketAddrV4>,
    /// Our source address on this path: the device's address (the default) or one of its
    /// `extra_addrs` (device layer; a second path of a multi-homed device).
    pub src: Option<std::net::Ipv4Addr>,
    /// RNR timer code we put in RNR NAKs (default 12, 0.64 ms).
    pub min_rnr_timer: Option<u8>,
    /// Our initial PSN (required for RTR → RTS).
    pub sq_psn: Option<Psn>,
    /// Local ACK timeout code, 4.096 µs × 2^n, 0 = infinite (default 15, ≈134 ms, as Linux SMC).
    pub timeout: Option<u8>,
    /// Retransmissions on timeout before failing (default 7).
    pub retry_cnt: Option<u8>,
    /// Retransmissions after RNR NAKs before failing; 7 = infinite (default 7).
    pub rnr_retry: Option<u8>,
}

impl QpAttr {
    /// Attributes that only change the state.
    pub const fn state(qp_state: QpState) -> Self {
        Self {
            qp_state,
            path_mtu: None,
            dest_qp_num: None,
            rq_psn: None,
            av: None,
            src: None,
            min_rnr_timer: None,
            sq_psn: None,
            timeout: None,
            retry_cnt: None,
            rnr_retry: None,
        }
    }
}

/// Why a state change was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModifyError {
    /// The transition is not allowed from the current state.
    InvalidTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// A required attribute is missing.
    MissingAttr(&'static str),
    /// The attribute cannot be changed in this transition (IBA: e.g. `retry_cnt` is set only
    /// on the way from RTR to RTS).
    NotModifiable(&'static str),
    /// A verbs device refused the change (its errno).
    Device(i32),
}

impl core::fmt::Display for ModifyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::InvalidTransition { from, to } => {
                write!(f, "cannot move a QP from {from:?} to {to:?}")
            }
            Self::MissingAttr(a) => write!(f, "attribute {a} is required for this transition"),
            Self::NotModifiable(a) => {
                write!(f, "attribute {a} cannot be changed in this transition")
            }
            Self::Device(e) => write!(
                f,
                "the verbs device refused: {}",
                std::io::Error::from_raw_os_error(*e)
            ),
        }
    }
}

impl std::error::Error for ModifyError {}

/// A reliable-connection queue pair, sans I/O.
pub struct RcQp {
    qp_num: u32,
    pd: u32,
    caps: QpCaps,
    sq_sig_all: bool,
    state: QpState,
    pending_rq: VecDeque<RecvWqe>,
    resp: Option<Responder>,
    req: Option<Requester>,
    mtu: Option<Mtu>,
    dest_qp: u32,
    rq_psn: Psn,
    min_rnr_timer: u8,
    flushed: VecDeque<(CqSide, WorkCompletion)>,
    /// Until when the responder's pending ACK waits for a request to leave with
    /// ([`QpCaps::ack_delay`]).
    ack_hold: Option<Instant>,
    /// A request left in this transmit pass: a held ACK goes with it.
    ack_ride: bool,
}

impl RcQp {
    /// A new QP in the RESET state.
    pub fn new(qp_num: u32, pd: u32, caps: QpCaps, sq_sig_all: bool) -> Self {
        Self {
            qp_num,
            pd,
            caps,
            sq_sig_all,
            state: QpState::Reset,
            pending_rq: VecDeque::new(),
            resp: None,
            req: None,
            mtu: None,
            dest_qp: 0,
            rq_psn: Psn::new(0),
            min_rnr_timer: 12,
            flushed: VecDeque::new(),
            ack_hold: None,
            ack_ride: false,
        }
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// The path MTU, once set.
    pub fn path_mtu(&self) -> Option<Mtu> {
        self.mtu
    }

    /// The peer's QP number, once set.
    pub fn dest_qp_num(&self) -> u32 {
        self.dest_qp
    }

    /// What the responder refused so far.
    pub fn responder_stats(&self) -> ResponderStats {
        self.resp.as_ref().map(|r| r.stats).unwrap_or_default()
    }

    /// What the requester did so far (zero before RTS).
    pub fn requester_stats(&self) -> RequesterStats {
        self.req.as_ref().map(|r| r.stats).unwrap_or_default()
    }

    /// Changes state (`ibv_modify_qp`).
    pub fn modify(&mut self, attr: &QpAttr) -> Result<(), ModifyError> {
        use QpState::*;
        let to = attr.qp_state;
        match (self.state, to) {
            (_, Reset) => {
                let caps = self.caps;
                *self = Self::new(self.qp_num, self.pd, caps, self.sq_sig_all);
            }
            (_, Error) => self.enter_error(),
            (Reset, Init) | (Init, Init) => self.state = Init,
            (Init, Rtr) => {
                let mtu = attr.path_mtu.ok_or(ModifyError::MissingAttr("path_mtu"))?;
                self.dest_qp = attr
                    .dest_qp_num
                    .ok_or(ModifyError::MissingAttr("dest_qp_num"))?;
                self.rq_psn = attr.rq_psn.ok_or(ModifyError::MissingAttr("rq_psn"))?;
                self.min_rnr_timer = attr.min_rnr_timer.unwrap_or(12) & 0x1F;
                self.mtu = Some(mtu);
                let rq = std::mem::take(&mut self.pending_rq);
                self.resp = Some(Responder::new(
                    self.qp_num,
                    self.pd,
                    RespParams {
                        mtu: mtu.bytes(),
                        dest_qp: self.dest_qp,
                        rq_psn: self.rq_psn,
                        min_rnr_timer: self.min_rnr_timer,
                    },
                    rq,
                ));
                self.state = Rtr;
            }
            (Rtr, Rts) => {
                let sq_psn = attr.sq_psn.ok_or(ModifyError::MissingAttr("sq_psn"))?;
                let mtu = self.mtu.ok_or(ModifyError::MissingAttr("path_mtu"))?;
                self.req = Some(Requester::new(
                    self.qp_num,
                    ReqParams {
                        mtu: mtu.bytes(),
                        dest_qp: self.dest_qp,
                        sq_psn,
                        timeout: timeout_duration(attr.timeout.unwrap_or(15)),
                        retry_cnt: attr.retry_cnt.unwrap_or(7).min(7),
                        rnr_retry: attr.rnr_retry.unwrap_or(7).min(7),
                        max_window: self.caps.max_inflight.max(1),
                    },
                ));
                self.state = Rts;
            }
            (Rts, Rts) => {
                let fixed = [
                    ("path_mtu", attr.path_mtu.is_some()),
                    ("dest_qp_num", attr.dest_qp_num.is_some()),
                    ("rq_psn", attr.rq_psn.is_some()),
                    ("sq_psn", attr.sq_psn.is_some()),
                    ("timeout", attr.timeout.is_some()),
                    ("retry_cnt", attr.retry_cnt.is_some()),
                    ("rnr_retry", attr.rnr_retry.is_some()),
                ];
                if let Some((name, _)) = fixed.iter().find(|(_, set)| *set) {
                    return Err(ModifyError::NotModifiable(name));
                }
            }
            (from, to) => return Err(ModifyError::InvalidTransition { from, to }),
        }
        Ok(())
    }

    fn enter_error(&mut self) {
        if let Some(r) = &mut self.req {
            r.flush();
        }
        if let Some(r) = &mut self.resp {
            r.flush();
        }
        while let Some(w) = self.pending_rq.pop_front() {
            self.flushed
                .push_back((CqSide::Recv, flush_wc(self.qp_num, w.wr_id, WcOpcode::Recv)));
        }
        self.state = QpState::Error;
    }

    fn check_failed(&mut self) {
        let failed = self.req.as_ref().is_some_and(|r| r.failed)
            || self.resp.as_ref().is_some_and(|r| r.failed);
        if failed && self.state != QpState::Error {
            self.enter_error();
        }
    }

    /// A send request's scatter list checked against this QP's protection domain and limits
    /// (a READ's buffers must be locally writable). Shared with the same-host transport.
    pub(crate) fn resolve_send_sgl(
        &self,
        wr: &SendWr<'_>,
        mrs: &MrTable,
    ) -> Result<SgList, PostError> {
        let need = if matches!(wr.opcode, WrOpcode::RdmaRead { .. }) {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        SgList::resolve(
            mrs,
            self.pd,
            wr.sg_list,
            self.caps.max_send_sge as usize,
            need,
        )
    }

    /// Posts a send request (`ibv_post_send`).
    pub fn post_send(&mut self, wr: &SendWr<'_>, mrs: &MrTable) -> Result<(), PostError> {
        let opcode = match wr.opcode {
            WrOpcode::RdmaRead { .. } => WcOpcode::RdmaRead,
            WrOpcode::RdmaWrite { .. } | WrOpcode::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            _ => WcOpcode::Send,
        };
        match self.state {
            QpState::Rts => {}
            QpState::Error => {
                self.flushed
                    .push_back((CqSide::Send, flush_wc(self.qp_num, wr.wr_id, opcode)));
                return Ok(());
            }
            s => return Err(PostError::InvalidState(s)),
        }
        let outstanding = self.req.as_ref().map_or(0, |r| r.outstanding());
        if outstanding >= self.caps.max_send_wr as usize {
            return Err(PostError::QueueFull);
        }
        let sgl = self.resolve_send_sgl(wr, mrs)?;
        let req = self.req.as_mut().expect("RTS has a requester");
        let mut flags = wr.flags;
        // Over the wire nothing runs when posted: a request signaled "if deferred" always is.
        if self.sq_sig_all || flags.contains(SendFlags::SIGNAL_IF_DEFERRED) {
            flags |= SendFlags::SIGNALED;
        }
        req.push(wr.wr_id, wr.opcode, flags, sgl);
        Ok(())
    }

    /// Posts a receive request (`ibv_post_recv`).
    pub fn post_recv(&mut self, wr: &RecvWr<'_>, mrs: &MrTable) -> Result<(), PostError> {
        let queued = match self.state {
            QpState::Init => self.pending_rq.len(),
            QpState::Rtr | QpState::Rts => self.resp.as_ref().map_or(0, |r| r.rq.len()),
            QpState::Error => {
                self.flushed.push_back((
                    CqSide::Recv,
                    flush_wc(self.qp_num, wr.wr_id, WcOpcode::Recv),
                ));
                return Ok(());
            }
            s => return Err(PostError::InvalidState(s)),
        };
        if queued >= self.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull);
        }
        let sgl = SgList::resolve(
            mrs,
            self.pd,
            wr.sg_list,
            self.caps.max_recv_sge as usize,
            Access::LOCAL_WRITE,
        )?;
        let wqe = RecvWqe {
            wr_id: wr.wr_id,
            sgl,
        };
        match &mut self.resp {
            Some(r) => r.rq.push_back(wqe),
            None => self.pending_rq.push_back(wqe),
        }
        Ok(())
    }

    /// Feeds a received packet addressed to this QP (its ICRC already checked).
    pub fn handle_packet(&mut self, now: Instant, pkt: &PacketRepr<'_>, mrs: &MrTable) {
        let op = pkt.bth.opcode;
        let Some(kind) = op.kind() else { return };
        // rxe accepts the default and the limited-membership default P_Key.
        if pkt.bth.pkey & 0x7FFF != 0x7FFF {
            return;
        }
        match kind {
            Kind::Send | Kind::Write | Kind::ReadRequest | Kind::Atomic => {
                if matches!(self.state, QpState::Rtr | QpState::Rts)
                    && let Some(r) = &mut self.resp
                {
                    if let Some(a) = self.req.as_ref().and_then(Requester::reorder_allowance) {
                        r.allowance = a;
                    }
                    r.handle_request(now, pkt, mrs);
                    // Hold the ACK of a message the receiver will likely answer (a SEND's
                    // end); any other reason to answer (a NAK, a READ, data that is not
                    // answered) sends what is pending at once.
                    // Only our engine (its packets marked) waits for such an ACK knowingly, and
                    // its sender says when none of ours will come soon (ACK_NOW).
                    let answered = kind == Kind::Send
                        && op.position().is_some_and(|p| p.ends())
                        && pkt.bth.ext & (crate::wire::MARK | crate::wire::ACK_NOW)
                            == crate::wire::MARK;
                    self.ack_hold = match self.caps.ack_delay {
                        // Not after bulk: the peer's whole window would wait.
                        Some(d)
                            if answered && r.only_plain_ack() && r.unacked() <= HOLD_MAX_PKTS =>
                        {
                            // Rides only with requests sent from now on.
                            self.ack_ride = false;
                            Some(self.ack_hold.unwrap_or(now + d))
                        }
                        _ => None,
                    };
                }
            }
            Kind::Acknowledge | Kind::ReadResponse | Kind::AtomicAcknowledge => {
                if self.state != QpState::Rts {
                    return;
                }
                let Some(r) = &mut self.req else { return };
                match (kind, pkt.aeth) {
                    (Kind::Acknowledge, Some(aeth)) => r.handle_ack(now, pkt.bth.psn, aeth),
                    (Kind::ReadResponse, aeth) => {
                        // An error AETH on a read response is handled as the NAK it is.
                        if let Some(a) = aeth
                            .filter(|a| !matches!(a.syndrome, crate::wire::Syndrome::Ack { .. }))
                        {
                            r.handle_ack(now, pkt.bth.psn, a);
                        } else if let Some(pos) = op.position() {
                            r.handle_read_response(now, pkt.bth.psn, pos, pkt.payload);
                        }
                    }
                    _ => r.fail(WcStatus::BadRespErr),
                }
            }
        }
        self.check_failed();
    }

    /// Writes the next outgoing packet (BTH … pad; the 4 ICRC bytes are zeroed for the driver
    /// to fill) into `buf`, which must hold 64 + MTU bytes. Returns its length.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        if !self.ack_held(now)
            && let Some(n) = self.poll_response(buf)
        {
            return Some(n);
        }
        let p = if self.state == QpState::Rts {
            self.req.as_mut().and_then(|r| r.poll_transmit(now, buf))
        } else {
            None
        };
        if p.is_some() {
            self.ack_ride = true;
        } else if self.ack_ride {
            // The held ACK goes after the requests of this pass.
            self.ack_ride = false;
            if let Some(n) = self.poll_response(buf) {
                return Some(n);
            }
        }
        p
    }

    /// The responder's next packet (an ACK sent ends any hold).
    fn poll_response(&mut self, buf: &mut [u8]) -> Option<usize> {
        let n = self.resp.as_mut()?.poll_transmit(buf)?;
        self.ack_hold = None;
        Some(n)
    }

    /// Ends a hold of the responder's ACK: it leaves with the next transmission. Returns
    /// whether one was held.
    pub fn end_ack_hold(&mut self) -> bool {
        self.ack_hold.take().is_some()
    }

    /// Whether an ACK is held for the answer (see [`QpCaps::ack_delay`]), whatever its time.
    pub fn holds_ack(&self) -> bool {
        self.ack_hold.is_some()
    }

    /// Whether the responder's pending ACK waits (see [`QpCaps::ack_delay`]).
    fn ack_held(&self, now: Instant) -> bool {
        !self.ack_ride && self.ack_hold.is_some_and(|t| now < t)
    }

    /// Like [`Self::poll_transmit`], but leaves the payload of SEND/WRITE packets in registered
    /// memory (see [`TxParts`]), for zero-copy transmission. With `req_first` the requester's
    /// packets come before the responder's (an ACK is short: last, it can close a GSO batch of
    /// requests instead of leaving in a datagram of its own); the two PSN spaces are
    /// independent, so either order is correct.
    pub fn poll_transmit_parts(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        req_first: bool,
    ) -> Option<TxParts> {
        if req_first && let Some(p) = self.poll_request_parts(now, buf) {
            self.ack_ride = true;
            return Some(p);
        }
        if !self.ack_held(now)
            && let Some(n) = self.poll_response(buf)
        {
            let pad = usize::from((buf[1] >> 4) & 3);
            return Some(TxParts {
                head: n - pad - crate::wire::ICRC_LEN,
                payload: super::PayloadRef::default(),
                pad,
            });
        }
        if req_first {
            self.ack_ride = false;
            return None;
        }
        let p = self.poll_request_parts(now, buf);
        self.ack_ride = p.is_some();
        p
    }

    fn poll_request_parts(&mut self, now: Instant, buf: &mut [u8]) -> Option<TxParts> {
        if self.state != QpState::Rts {
            return None;
        }
        self.req.as_mut()?.poll_transmit_parts(now, buf)
    }

    /// The responder has something to send (an ACK, NAK or READ response).
    pub fn has_response(&self) -> bool {
        self.resp.as_ref().is_some_and(Responder::has_output)
    }

    /// When [`Self::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        // A held ACK leaves by itself when its wait is over (the responder runs in RTR too).
        let hold = self.ack_hold.filter(|_| self.has_response());
        let req = if self.state == QpState::Rts {
            self.req.as_ref().and_then(Requester::poll_timeout)
        } else {
            None
        };
        // A gap in what the peer sent is NAKed when it outlives the reorder allowance.
        let gap = if matches!(self.state, QpState::Rtr | QpState::Rts) {
            self.resp.as_ref().and_then(Responder::poll_timeout)
        } else {
            None
        };
        [req, hold, gap].into_iter().flatten().min()
    }

    /// Runs the timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if matches!(self.state, QpState::Rtr | QpState::Rts)
            && let Some(r) = &mut self.resp
        {
            r.handle_timeout(now);
        }
        if self.state == QpState::Rts {
            if let Some(r) = &mut self.req {
                r.handle_timeout(now);
            }
            self.check_failed();
        }
    }

    /// The next completion and the queue it belongs to.
    pub fn poll_completion(&mut self) -> Option<(CqSide, WorkCompletion)> {
        if let Some(c) = self.flushed.pop_front() {
            return Some(c);
        }
        if let Some(c) = self.req.as_mut().and_then(|r| r.completions.pop_front()) {
            return Some((CqSide::Send, c));
        }
        self.resp
            .as_mut()
            .and_then(|r| r.completions.pop_front())
            .map(|c| (CqSide::Recv, c))
    }

    /// A summary of the QP's transport state, for diagnostics and logs.
    pub fn summary(&self, now: Instant) -> String {
        format!(
            "qp {:#x} {:?} | {} | {}",
            self.qp_num,
            self.state,
            self.req
                .as_ref()
                .map_or_else(|| "req: -".into(), |r| r.summary(now)),
            self.resp
                .as_ref()
                .map_or_else(|| "resp: -".into(), Responder::summary)
        )
    }

    // Hooks of the same-host transport (the `samehost` module): below the QP, shared memory
    // instead of packets. The QP keeps its state, queues and completion rules.

    /// The capabilities it was created with.
    pub(crate) fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Every send request produces a completion.
    pub(crate) fn sq_sig_all(&self) -> bool {
        self.sq_sig_all
    }

    /// The oldest posted receive request, taken off the queue (RTR and RTS only).
    pub(crate) fn take_recv(&mut self) -> Option<RecvWqe> {
        match self.state {
            QpState::Rtr | QpState::Rts => self.resp.as_mut()?.rq.pop_front(),
            _ => None,
        }
    }

    /// Whether a receive request is posted (RTR and RTS only).
    pub(crate) fn has_recv(&self) -> bool {
        matches!(self.state, QpState::Rtr | QpState::Rts)
            && self.resp.as_ref().is_some_and(|r| !r.rq.is_empty())
    }

    /// Queues a completion produced outside the packet path.
    pub(crate) fn push_completion(&mut self, side: CqSide, wc: WorkCompletion) {
        // Behind the completions of the same queue that the packet path produced, so that
        // a message received over UDP before the switch is always handed out first.
        match side {
            CqSide::Send if let Some(r) = self.req.as_mut() => r.completions.push_back(wc),
            CqSide::Recv if let Some(r) = self.resp.as_mut() => r.completions.push_back(wc),
            _ => self.flushed.push_back((side, wc)),
        }
    }

    /// Enters the error state (flushing what is queued), unless already there.
    pub(crate) fn fail(&mut self) {
        if self.state != QpState::Error {
            self.enter_error();
        }
    }

    /// Send requests not yet completed.
    pub fn send_queue_len(&self) -> usize {
        self.req.as_ref().map_or(0, Requester::outstanding)
    }
}

fn flush_wc(qp_num: u32, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status: WcStatus::WrFlushErr,
        opcode,
        byte_len: 0,
        imm_data: None,
        qp_num,
    }
}
