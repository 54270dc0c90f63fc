//! The requester half of an RC queue pair: our outgoing requests.
//!
//! Each posted work request gets its PSN range at post time (one PSN per packet; an RDMA READ
//! takes as many PSNs as response packets). `snd_psn` is the next PSN to transmit and `una` the
//! oldest unacknowledged one; go-back-N simply moves `snd_psn` back. Completions are produced
//! strictly in posting order.

use super::{PayloadRef, SendFlags, SgList, TxParts, WcOpcode, WcStatus, WorkCompletion, WrOpcode};
use crate::wire::{
    Aeth, BthRepr, Kind, NakCode, Opcode, Packet, PacketRepr, Position, Psn, Reth, Syndrome,
};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

mod recovery;

/// rnr_retry / retry_cnt value that means "retry for ever" for RNR (IBA).
const INFINITE_RNR: u8 = 7;
/// Ceiling of the exponential backoff of the retransmission timer, in multiples of the timeout.
const MAX_BACKOFF: u32 = 8;
/// Smallest congestion window, in packets.
const MIN_CWND: u32 = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum WqeKind {
    Send,
    Write,
    Read,
}

pub(crate) struct SendWqe {
    wr_id: u64,
    kind: WqeKind,
    imm: Option<u32>,
    remote_addr: u64,
    rkey: u32,
    signaled: bool,
    solicited: bool,
    /// [`SendFlags::ACK_NOW`]: its last packet asks for the ACK at once.
    ack_now: bool,
    sgl: SgList,
    first_psn: Psn,
    npkts: u32,
    /// READ only: response packets received in order so far.
    read_done: u32,
}

impl SendWqe {
    fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npkts - 1)
    }
    fn contains(&self, psn: Psn) -> bool {
        psn.in_window(self.first_psn, self.npkts)
    }
    fn wc_opcode(&self) -> WcOpcode {
        match self.kind {
            WqeKind::Send => WcOpcode::Send,
            WqeKind::Write => WcOpcode::RdmaWrite,
            WqeKind::Read => WcOpcode::RdmaRead,
        }
    }
}

/// Static parameters of the requester, set when the QP moves to RTS.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReqParams {
    pub(crate) mtu: usize,
    pub(crate) dest_qp: u32,
    pub(crate) sq_psn: Psn,
    pub(crate) timeout: Option<Duration>,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) max_window: u32,
}

/// What a requester did so far (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequesterStats {
    /// Packets sent again (go-back-N).
    pub retransmits: u64,
    /// Early retransmissions (no progress within the measured round trip; no retry spent).
    pub probes: u64,
    /// Early retransmissions found needless afterwards: the peer acknowledged packets that
    /// had not been sent again yet, so it had the first copies (its ACK was late, not lost).
    pub spurious_probes: u64,
    /// Local ACK timeouts (a retry spent).
    pub timeouts: u64,
    /// Sequence-error NAKs received.
    pub naks: u64,
    /// RNR NAKs received.
    pub rnr_naks: u64,
    /// The longest wait for an acknowledgement while packets were outstanding, in µs: from
    /// the first packet sent after idling, or the last progress, to the next progress. A
    /// packet overtaken or lost costs a round trip or so; a timer's wait shows here.
    pub longest_stall_us: u64,
}

/// See [`Requester::probe_undo`].
#[derive(Debug, Clone, Copy)]
struct ProbeUndo {
    upto: Psn,
    /// `stats.retransmits` when it fired: more since means it sent packets again.
    retransmits: u64,
    cwnd: u32,
    ssthresh: u32,
    recovery: Option<Psn>,
    sent_at: Instant,
}

pub(crate) struct Requester {
    qp_num: u32,
    p: ReqParams,
    wqes: VecDeque<SendWqe>,
    /// Index in `wqes` of the request holding `snd_psn` (== len when none).
    snd_idx: usize,
    next_psn: Psn,
    snd_psn: Psn,
    una: Psn,
    max_sent: Psn,
    last_ackreq: Psn,
    cwnd: u32,
    cwnd_acc: u32,
    ssthresh: u32,
    retries_left: u8,
    rnr_left: u8,
    backoff: u32,
    rtx_deadline: Option<Instant>,
    rnr_until: Option<Instant>,
    /// The PSN we last went back to on a sequence-error NAK, and when: a repeat of that NAK
    /// sooner than a round trip later is a duplicate and is ignored.
    gobackn_from: Option<Psn>,
    gobackn_at: Option<Instant>,
    /// Early retransmission ("probe") timer, from the measured round-trip time, counted from
    /// the last new packet that asked for an ACK (its ACK cannot come sooner: a long
    /// message's last packet leaves well after its first).
    probe_at: Option<Instant>,
    probe_backoff: u32,
    /// When the last new packet asking for an ACK was sent.
    last_ackreq_at: Option<Instant>,
    /// The probe that went back last: how far it must resend, the window it cut (cwnd,
    /// ssthresh) and when the packet whose ACK it gave up on was sent; kept until the PSNs it
    /// resends are acknowledged, to tell a late ACK (spurious probe) from a lost packet.
    probe_undo: Option<ProbeUndo>,
    /// Since when packets have been outstanding without progress (`None`: idle).
    stall_from: Option<Instant>,
    srtt: Option<Duration>,
    rttvar: Duration,
    /// The AckReq packet being timed: its PSN and when it was first sent.
    rtt_sample: Option<(Psn, Instant)>,
    /// `max_sent` when the window was last reduced: one reduction per window of data.
    recovery: Option<Psn>,
    /// After a sequence-error NAK: resending stops at this PSN until an acknowledgement
    /// comes. A responder that keeps what came after a gap (ours) needs only the missing
    /// packet and then acknowledges everything it holds; one that drops it (go-back-N) is
    /// sent the rest after that acknowledgement, one round trip later.
    resend_until: Option<Psn>,
    /// With a peer that keeps what comes after a gap: where sending goes on once the missing
    /// packet was resent (it does not wait for the acknowledgement).
    resume_at: Option<Psn>,
    /// The peer acknowledged past a packet resent alone after a NAK: it keeps what comes
    /// after a gap (ours does; go-back-N responders drop it). Then a NAK costs one resent
    /// packet and does not stop new data, and, reordering not being congestion, it does not
    /// cut the window (a probe or a timeout still does).
    peer_keeps: bool,
    /// The packet resent alone after a NAK, and when it is resent again if it is still not
    /// acknowledged (lost or held up once more): a round trip or two, from the smallest one
    /// measured, doubling — not the early probe's wait, which reordering stretches.
    resend_psn: Option<Psn>,
    resend_at: Option<Instant>,
    resend_backoff: u32,
    /// The smallest round trip measured (reordering delays ACKs; this does not grow with it).
    min_rtt: Option<Duration>,
    pub(crate) completions: VecDeque<WorkCompletion>,
    /// Set when a fatal error puts the QP into the error state.
    pub(crate) failed: bool,
    pub(crate) stats: RequesterStats,
}

impl Requester {
    pub(crate) fn new(qp_num: u32, p: ReqParams) -> Self {
        Self {
            qp_num,
            p,
            wqes: VecDeque::new(),
            snd_idx: 0,
            next_psn: p.sq_psn,
            snd_psn: p.sq_psn,
            una: p.sq_psn,
            max_sent: p.sq_psn,
            last_ackreq: p.sq_psn.sub(1),
            cwnd: p.max_window.clamp(MIN_CWND, 64),
            cwnd_acc: 0,
            ssthresh: p.max_window,
            retries_left: p.retry_cnt,
            rnr_left: p.rnr_retry,
            backoff: 1,
            rtx_deadline: None,
            rnr_until: None,
            gobackn_from: None,
            gobackn_at: None,
            probe_at: None,
            probe_backoff: 1,
            last_ackreq_at: None,
            probe_undo: None,
            stall_from: None,
            srtt: None,
            rttvar: Duration::ZERO,
            rtt_sample: None,
            recovery: None,
            resend_until: None,
            resume_at: None,
            peer_keeps: false,
            resend_psn: None,
            resend_at: None,
            resend_backoff: 1,
            min_rtt: None,
            completions: VecDeque::new(),
            failed: false,
            stats: RequesterStats::default(),
        }
    }

    /// A one-line summary of the sender state, for diagnostics.
    pub(crate) fn summary(&self, now: Instant) -> String {
        format!(
            "req: wqes={} next={} snd={} una={} max_sent={} cwnd={} retries_left={} backoff={} rtx_in={:?} rnr_in={:?} probe_in={:?} srtt={:?} gobackn={:?} failed={} keeps={} resend={:?}/{:?}",
            self.wqes.len(),
            self.next_psn,
            self.snd_psn,
            self.una,
            self.max_sent,
            self.cwnd,
            self.retries_left,
            self.backoff,
            self.rtx_deadline.map(|t| t.saturating_duration_since(now)),
            self.rnr_until.map(|t| t.saturating_duration_since(now)),
            self.probe_at.map(|t| t.saturating_duration_since(now)),
            self.srtt,
            self.gobackn_from,
            self.failed,
            self.peer_keeps,
            self.resend_until,
            self.resume_at
        )
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.wqes.len()
    }

    /// Queues a request whose memory was already resolved.
    pub(crate) fn push(&mut self, wr_id: u64, op: WrOpcode, flags: SendFlags, sgl: SgList) {
        let len = sgl.len();
        let npkts = (len.div_ceil(self.p.mtu)).max(1) as u32;
        let (kind, imm, remote_addr, rkey) = match op {
            WrOpcode::Send => (WqeKind::Send, None, 0, 0),
            WrOpcode::SendWithImm(i) => (WqeKind::Send, Some(i), 0, 0),
            WrOpcode::RdmaWrite { remote_addr, rkey } => (WqeKind::Write, None, remote_addr, rkey),
            WrOpcode::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => (WqeKind::Write, Some(imm), remote_addr, rkey),
            WrOpcode::RdmaRead { remote_addr, rkey } => (WqeKind::Read, None, remote_addr, rkey),
        };
        let mut wqe = SendWqe {
            wr_id,
            kind,
            imm,
            remote_addr,
            rkey,
            signaled: flags.contains(SendFlags::SIGNALED),
            solicited: flags.contains(SendFlags::SOLICITED),
            ack_now: flags.contains(SendFlags::ACK_NOW),
            sgl,
            first_psn: self.next_psn,
            npkts,
            read_done: 0,
        };
        self.next_psn = self.next_psn.add(npkts);
        if flags.contains(SendFlags::EXPEDITE) {
            // Ahead of the first request none of whose packets was ever sent (the responder
            // may hold any PSN before `max_sent`; after a go-back-N, `snd_psn` is behind it).
            let sent = if self.snd_psn.is_after(self.max_sent) {
                self.snd_psn
            } else {
                self.max_sent
            };
            if let Some(pos) = self.wqes.iter().position(|w| !w.first_psn.is_before(sent)) {
                wqe.first_psn = self.wqes[pos].first_psn;
                for w in self.wqes.iter_mut().skip(pos) {
                    w.first_psn = w.first_psn.add(npkts);
                }
                self.wqes.insert(pos, wqe);
                self.seek();
                return;
            }
        }
        self.wqes.push_back(wqe);
    }

    fn in_flight(&self) -> u32 {
        self.snd_psn.diff(self.una).max(0) as u32
    }

    /// Resends the packet at `psn` alone: then, with a peer that keeps what follows a gap, on
    /// with what was next; with one that does not, nothing more until it is acknowledged.
    fn resend_one(&mut self, psn: Psn) {
        let resume = self.snd_psn;
        self.go_back_to(psn);
        self.resend_until = Some(psn.add(1));
        if self.peer_keeps && resume.is_after(psn.add(1)) {
            self.resume_at = Some(resume);
        }
    }

    fn resend_done(&mut self) {
        self.resend_psn = None;
        self.resend_at = None;
        self.resend_backoff = 1;
    }

    /// Packets that may be in flight: the congestion window, and with a peer that keeps what
    /// comes after a gap, no more than it keeps (beyond, a gap drops the rest as go-back-N).
    fn window(&self) -> u32 {
        if self.peer_keeps {
            let keeps = super::responder::REORDER_BYTES / self.p.mtu.max(1);
            self.cwnd
                .min(super::responder::REORDER_PKTS as u32)
                .min(keeps as u32)
                .max(1)
        } else {
            self.cwnd
        }
    }

    fn rto(&self) -> Option<Duration> {
        self.p.timeout.map(|t| t * self.backoff)
    }

    /// Points `snd_idx` at the request holding `snd_psn`.
    fn seek(&mut self) {
        self.snd_idx = self
            .wqes
            .iter()
            .position(|w| w.contains(self.snd_psn) || w.first_psn.is_after(self.snd_psn))
            .unwrap_or(self.wqes.len());
    }

    fn go_back_to(&mut self, psn: Psn) {
        self.resend_until = None;
        self.resume_at = None;
        self.snd_psn = psn;
        self.rtt_sample = None; // Karn: never time a retransmitted packet
        self.seek();
    }

    /// The early-retransmission interval: smoothed RTT plus four deviations, at least 500 µs
    /// (so that jitter alone rarely triggers it) and at most the QP's local ACK timeout. None
    /// until a round trip was measured: then only the local ACK timeout applies.
    fn probe_interval(&self) -> Option<Duration> {
        let cap = self.p.timeout;
        let est = (self.srtt? + 4 * self.rttvar).max(Duration::from_micros(500));
        let est = est * self.probe_backoff;
        Some(cap.map_or(est, |c| est.min(c)))
    }

    /// How long the responder of this QP lets a gap in the peer's packets stay open before it
    /// NAKs it (a packet overtaken by others is not lost): a quarter of the smallest round
    /// trip measured (reordering stretches the smoothed one), within 20–250 µs, well inside the peer's early retransmission (≥ 500 µs), so
    /// that the NAK, which asks for the missing packet only, comes first. `None` before a
    /// round trip was measured.
    pub(crate) fn reorder_allowance(&self) -> Option<Duration> {
        let rtt = self.min_rtt.or(self.srtt)?;
        Some((rtt / 4).clamp(Duration::from_micros(20), Duration::from_micros(250)))
    }

    /// How long a packet resent alone after a NAK waits for its acknowledgement before it goes
    /// again.
    fn resend_interval(&self) -> Duration {
        let rtt = self
            .min_rtt
            .or(self.srtt)
            .unwrap_or(Duration::from_micros(500));
        let d = (rtt * 2).max(Duration::from_micros(100)) * self.resend_backoff;
        self.p.timeout.map_or(d, |t| d.min(t))
    }

    fn rtt_update(&mut self, sample: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(sample, |m| m.min(sample)));
        match self.srtt {
            None => {
                self.srtt = Some(sample);
                self.rttvar = sample / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(sample);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + sample) / 8);
            }
        }
    }

    /// Writes the next packet (BTH … pad, ICRC zeroed) into `buf`; returns its length.
    pub(crate) fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.next_packet(now, buf, None)
    }

    /// Writes the next packet's headers into `buf` and describes its payload in place.
    pub(crate) fn poll_transmit_parts(&mut self, now: Instant, buf: &mut [u8]) -> Option<TxParts> {
        let mut payload = PayloadRef::default();
        let total = self.next_packet(now, buf, Some(&mut payload))?;
        let pad = PacketRepr::pad(payload.len());
        Some(TxParts {
            head: total - payload.len() - pad - crate::wire::ICRC_LEN,
            payload,
            pad,
        })
    }

    /// The next packet: headers into `buf`, and the payload either copied after them or, with
    /// `zero_copy`, described there. Returns the total packet length.
    fn next_packet(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        zero_copy: Option<&mut PayloadRef>,
    ) -> Option<usize> {
        if self.failed || self.snd_psn == self.next_psn {
            return None;
        }
        if let Some(t) = self.rnr_until {
            if t > now {
                return None;
            }
            self.rnr_until = None;
        }
        if self.in_flight() >= self.window() {
            return None;
        }
        if self.resume_at.is_none()
            && self.resend_until.is_some_and(|l| {
                !self.snd_psn.is_before(l) && self.snd_psn.is_before(self.max_sent)
            })
        {
            return None; // the rest waits for the acknowledgement of what was resent
        }
        let w = self.wqes.get(self.snd_idx)?;
        let psn0 = self.snd_psn;
        let fresh = !psn0.is_before(self.max_sent);
        if !fresh {
            self.stats.retransmits += 1;
        }
        let k = self.snd_psn.diff(w.first_psn) as u32;
        let mtu = self.p.mtu;
        let len = match w.kind {
            WqeKind::Read => {
                let done = (k as usize * mtu).min(w.sgl.len());
                let repr = PacketRepr {
                    bth: BthRepr {
                        ack_req: true,
                        ..BthRepr::new(Opcode::RDMA_READ_REQUEST, self.p.dest_qp, self.snd_psn)
                    },
                    reth: Some(Reth {
                        va: w.remote_addr.wrapping_add(done as u64),
                        rkey: w.rkey,
                        len: (w.sgl.len() - done) as u32,
                    }),
                    atomic_eth: None,
                    aeth: None,
                    atomic_ack_eth: None,
                    imm: None,
                    ieth: None,
                    payload: &[],
                };
                repr.emit(buf);
                self.last_ackreq = self.snd_psn;
                self.snd_psn = w.first_psn.add(w.npkts);
                self.snd_idx += 1;
                repr.buffer_len()
            }
            WqeKind::Send | WqeKind::Write => {
                let offset = k as usize * mtu;
                let plen = (w.sgl.len() - offset).min(mtu);
                let position = match (w.npkts, k) {
                    (1, _) => Position::Only,
                    (_, 0) => Position::First,
                    (n, k) if k + 1 == n => Position::Last,
                    _ => Position::Middle,
                };
                let kind = if w.kind == WqeKind::Send {
                    Kind::Send
                } else {
                    Kind::Write
                };
                let opcode = Opcode::for_request(kind, position, w.imm.is_some());
                let ends = position.ends();
                let since = self.snd_psn.diff(self.last_ackreq).max(0) as u32;
                let ack_req = ends
                    || since >= (self.window() / 4).max(1)
                    || self.in_flight() + 1 >= self.window()
                    || self.resend_until == Some(self.snd_psn.add(1));
                let solicited = ends && w.solicited && (kind == Kind::Send || w.imm.is_some());
                let repr = PacketRepr {
                    bth: BthRepr {
                        solicited,
                        ack_req,
                        ext: if ends && w.ack_now {
                            crate::wire::ACK_NOW
                        } else {
                            0
                        },
                        ..BthRepr::new(opcode, self.p.dest_qp, self.snd_psn)
                    },
                    reth: opcode.has_reth().then_some(Reth {
                        va: w.remote_addr,
                        rkey: w.rkey,
                        len: w.sgl.len() as u32,
                    }),
                    atomic_eth: None,
                    aeth: None,
                    atomic_ack_eth: None,
                    imm: if opcode.has_imm() { w.imm } else { None },
                    ieth: None,
                    payload: &[],
                };
                let total = PacketRepr::len_for(opcode, plen);
                // Headers first, then the payload gathered straight from the registered memory.
                match zero_copy {
                    Some(out) => {
                        repr.emit_headers_for(0, buf);
                        buf[1] = (buf[1] & !0x30) | ((PacketRepr::pad(plen) as u8) << 4);
                        w.sgl.slices(offset, plen, out);
                    }
                    None => {
                        repr.emit_headers_for(plen, buf);
                        let mut pkt = Packet::new_unchecked(&mut buf[..total]);
                        w.sgl.gather(offset, pkt.payload_mut());
                    }
                }
                if ack_req {
                    self.last_ackreq = self.snd_psn;
                    if fresh {
                        if self.rtt_sample.is_none() {
                            self.rtt_sample = Some((psn0, now));
                        }
                        // Its ACK is the next one due: the probe waits from here.
                        self.last_ackreq_at = Some(now);
                        self.probe_at = self.probe_interval().map(|d| now + d);
                    }
                }
                self.snd_psn = self.snd_psn.add(1);
                if k + 1 == w.npkts {
                    self.snd_idx += 1;
                }
                total
            }
        };
        if self.snd_psn.is_after(self.max_sent) {
            self.max_sent = self.snd_psn;
        }
        if let (Some(l), Some(r)) = (self.resend_until, self.resume_at)
            && !self.snd_psn.is_before(l)
        {
            // The missing packet went again: on with what was next before the NAK.
            self.resend_until = None;
            self.resume_at = None;
            self.snd_psn = r;
            self.seek();
        }
        if self.rtx_deadline.is_none() {
            self.rtx_deadline = self.rto().map(|d| now + d);
        }
        if self.stall_from.is_none() {
            self.stall_from = Some(now);
        }
        if self.probe_at.is_none() {
            self.probe_at = self.probe_interval().map(|d| now + d);
        }
        Some(len)
    }
}
