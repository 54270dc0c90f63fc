//! The responder half of an RC queue pair: the peer's requests.
//!
//! In-order packets (PSN == ePSN) are executed. Packets ahead of a gap are kept (up to
//! [`REORDER_PKTS`] PSNs and [`REORDER_BYTES`] of payload) and executed when the gap fills, as if
//! they had come in order; the gap gets its PSN-sequence-error NAK only when it outlives the
//! reorder allowance (a fraction of the measured round trip, set by the QP), so a packet that
//! was only overtaken costs nothing. A requester that goes back N on that NAK finds the packets
//! it resends already placed (they are acknowledged as duplicates); ours resends only the
//! missing one (see the requester). Beyond the window a gap is NAKed at once and later packets
//! are dropped until the expected PSN arrives (plain go-back-N). An open gap's NAK is repeated
//! on a timer, later each time. Duplicates are re-acknowledged without being executed again,
//! except RDMA READs, which are re-executed (IBA). Every RDMA WRITE and READ is checked against the rkey, the protection domain, the access rights
//! and the region bounds before any byte moves; a violation answers with a remote-access-error
//! NAK and puts the QP into the error state, as rxe does.

use super::{SgList, WcOpcode, WcStatus, WorkCompletion};
use crate::mr::{Access, AccessError, MrTable, Region};
use crate::wire::{
    Aeth, BthRepr, Kind, NakCode, Opcode, Packet, PacketRepr, Position, Psn, Syndrome,
};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How far ahead of the expected PSN packets are kept while a gap is open.
pub(crate) const REORDER_PKTS: i32 = 1024;
/// The most payload bytes kept ahead of a gap (per QP).
pub(crate) const REORDER_BYTES: usize = 1024 * 1024;
/// The least time between two NAKs of one gap.
const NAK_REPEAT_MIN: Duration = Duration::from_micros(100);
/// The reorder allowance before a round trip was measured.
pub(crate) const DEFAULT_ALLOWANCE: Duration = Duration::from_micros(50);

/// A packet that came ahead of a gap: its headers and a copy of its payload.
struct Ahead {
    head: PacketRepr<'static>,
    payload: Vec<u8>,
    /// When it came: a gap is as old as the first packet seen beyond it.
    at: Instant,
}

pub(crate) struct RecvWqe {
    pub(crate) wr_id: u64,
    pub(crate) sgl: SgList,
}

enum Current {
    Idle,
    Send {
        wqe: RecvWqe,
        received: usize,
    },
    Write {
        mr: Arc<Region>,
        offset: usize,
        done: usize,
        total: usize,
    },
}

struct ReadJob {
    mr: Option<Arc<Region>>,
    offset: usize,
    len: usize,
    psn: Psn,
    npkts: u32,
    next: u32,
    msn: u32,
}

enum Out {
    Ack {
        psn: Psn,
        syndrome: Syndrome,
        msn: u32,
    },
    Read(ReadJob),
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct RespParams {
    pub(crate) mtu: usize,
    pub(crate) dest_qp: u32,
    pub(crate) rq_psn: Psn,
    pub(crate) min_rnr_timer: u8,
}

/// Counters of what the responder refused, for statistics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ResponderStats {
    /// Sequence-error NAKs sent.
    pub nak_seq: u64,
    /// RNR NAKs sent.
    pub rnr_nak: u64,
    /// Duplicate requests seen.
    pub duplicates: u64,
    /// Remote access errors (bad rkey, range or rights).
    pub access_errors: u64,
    /// Invalid requests (bad opcode sequence or lengths).
    pub invalid: u64,
    /// Packets that came ahead of a gap and were kept, then placed when it filled.
    pub reordered: u64,
}

pub(crate) struct Responder {
    qp_num: u32,
    pd: u32,
    p: RespParams,
    epsn: Psn,
    msn: u32,
    pub(crate) rq: VecDeque<RecvWqe>,
    cur: Current,
    nak_sent: bool,
    out: VecDeque<Out>,
    pub(crate) completions: VecDeque<WorkCompletion>,
    /// Set when a fatal error was detected (the NAK is still queued for sending).
    pub(crate) failed: bool,
    pub(crate) stats: ResponderStats,
    /// Packets ahead of the expected PSN, by PSN, and their payload bytes.
    ahead: BTreeMap<u32, Ahead>,
    ahead_bytes: usize,
    /// Since when the current gap is open (packets are kept ahead of it).
    gap_since: Option<Instant>,
    /// How long a gap may stay open before it is NAKed (see the module doc).
    pub(crate) allowance: Duration,
    /// When the gap was last NAKed: repeated (on packets asking for an acknowledgement) only
    /// after four allowances, in case the NAK or the resent packet was lost — not on every
    /// such packet, which made a storm of NAKs and resends.
    nak_at: Option<Instant>,
    /// NAKs of this gap repeated by the timer (each waits twice as long).
    nak_repeats: u32,
    /// The PSN after the last one an ACK or NAK that left covered.
    acked_to: Psn,
}

impl Responder {
    pub(crate) fn new(qp_num: u32, pd: u32, p: RespParams, rq: VecDeque<RecvWqe>) -> Self {
        Self {
            qp_num,
            pd,
            p,
            epsn: p.rq_psn,
            msn: 0,
            rq,
            cur: Current::Idle,
            nak_sent: false,
            out: VecDeque::new(),
            completions: VecDeque::new(),
            failed: false,
            stats: ResponderStats::default(),
            ahead: BTreeMap::new(),
            ahead_bytes: 0,
            gap_since: None,
            allowance: DEFAULT_ALLOWANCE,
            nak_at: None,
            nak_repeats: 0,
            acked_to: p.rq_psn,
        }
    }

    /// Request packets executed since the last ACK left (what a held ACK would leave waiting).
    pub(crate) fn unacked(&self) -> u32 {
        self.epsn.diff(self.acked_to).max(0) as u32
    }

    fn ack(&mut self, psn: Psn, syndrome: Syndrome) {
        let msn = self.msn;
        // Coalesce: a newer ACK replaces an unsent older one.
        if let Some(Out::Ack {
            syndrome: Syndrome::Ack { .. },
            ..
        }) = self.out.back()
        {
            self.out.pop_back();
        }
        self.out.push_back(Out::Ack { psn, syndrome, msn });
    }

    fn fatal(&mut self, psn: Psn, code: NakCode) {
        match code {
            NakCode::RemoteAccessError => self.stats.access_errors += 1,
            _ => self.stats.invalid += 1,
        }
        self.ack(psn, Syndrome::Nak(code));
        self.failed = true;
    }

    fn complete_recv(
        &mut self,
        wqe: RecvWqe,
        status: WcStatus,
        opcode: WcOpcode,
        len: usize,
        imm: Option<u32>,
    ) {
        self.completions.push_back(WorkCompletion {
            wr_id: wqe.wr_id,
            status,
            opcode,
            byte_len: len as u32,
            imm_data: imm,
            qp_num: self.qp_num,
        });
    }

    fn check_remote(
        &self,
        mrs: &MrTable,
        rkey: u32,
        va: u64,
        len: usize,
        need: Access,
    ) -> Result<Option<(Arc<Region>, usize)>, AccessError> {
        if len == 0 {
            return Ok(None); // IBA: a zero-length access checks no key
        }
        mrs.check(rkey, self.pd, va, len as u64, need).map(Some)
    }

    /// Handles a request packet (SEND, WRITE, READ request, atomic).
    pub(crate) fn handle_request(&mut self, now: Instant, pkt: &PacketRepr<'_>, mrs: &MrTable) {
        if self.failed {
            return;
        }
        let psn = pkt.bth.psn;
        let d = psn.diff(self.epsn);
        if d > 0 {
            let kept = self.keep_ahead(now, pkt, d);
            // Kept: NAKed only when the gap outlives the allowance ([`Self::handle_timeout`]).
            // Then (or not kept), one NAK per gap, repeated on packets that ask for an
            // acknowledgement: if the requester's retransmission was lost as well, this tells
            // it again.
            let again = self.nak_sent
                && pkt.bth.ack_req
                && self.nak_at.is_none_or(|t| now >= t + self.nak_repeat());
            if (!kept && !self.nak_sent) || again {
                self.nak_gap(now);
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates += 1;
            if pkt.bth.opcode == Opcode::RDMA_READ_REQUEST {
                self.execute_read(pkt, mrs, true);
            } else {
                self.ack(self.epsn.sub(1), Syndrome::ACK);
            }
            return;
        }
        self.execute(pkt, mrs);
        if self.ahead.is_empty() {
            return;
        }
        // The gap filled: what came ahead of it runs now, in PSN order, as far as it reaches.
        let mut placed = false;
        while !self.failed
            && let Some(a) = self.ahead.remove(&self.epsn.value())
        {
            self.ahead_bytes -= a.payload.len();
            let before = self.epsn;
            self.execute(
                &PacketRepr {
                    payload: &a.payload,
                    ..a.head
                },
                mrs,
            );
            if self.epsn == before {
                break; // not placed (no receive posted: the RNR NAK went)
            }
            placed = true;
        }
        let epsn = self.epsn;
        self.ahead.retain(|&k, _| Psn::new(k).diff(epsn) > 0);
        self.ahead_bytes = self.ahead.values().map(|a| a.payload.len()).sum();
        if placed && !self.nak_sent {
            // Tell the requester at once how far it got (it may be resending what is here).
            self.ack(self.epsn.sub(1), Syndrome::ACK);
        }
        // What is left lies beyond another gap, open since the first of it came (it may be
        // due for its NAK already).
        self.gap_since = self.ahead.values().map(|a| a.at).min();
        if self.poll_timeout().is_some_and(|t| t <= now) {
            // Old enough already: NAKed now (the NAK acknowledges what was placed, too).
            self.nak_gap(now);
        }
    }

    /// Keeps a packet that came `d` PSNs ahead of the expected one; whether it is kept (it
    /// may be already; beyond the window or the byte budget it is not).
    fn keep_ahead(&mut self, now: Instant, pkt: &PacketRepr<'_>, d: i32) -> bool {
        if self.ahead.contains_key(&pkt.bth.psn.value()) {
            self.stats.duplicates += 1;
            return true;
        }
        if d > REORDER_PKTS || self.ahead_bytes + pkt.payload.len() > REORDER_BYTES {
            return false;
        }
        self.ahead.insert(
            pkt.bth.psn.value(),
            Ahead {
                head: PacketRepr {
                    payload: &[],
                    ..*pkt
                },
                payload: pkt.payload.to_vec(),
                at: now,
            },
        );
        self.ahead_bytes += pkt.payload.len();
        self.stats.reordered += 1;
        self.gap_since.get_or_insert(now);
        true
    }

    fn nak_gap(&mut self, now: Instant) {
        self.nak_sent = true;
        self.nak_at = Some(now);
        self.stats.nak_seq += 1;
        self.ack(self.epsn, Syndrome::Nak(NakCode::PsnSequenceError));
    }

    /// When the open gap is to be NAKed: once it outlived the allowance, and again while it
    /// stays open (the NAK or the resent packet may be lost, and a sender whose window is
    /// full sends nothing that could carry the repeat), each time twice as late.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        if self.failed {
            return None;
        }
        let since = self.gap_since?;
        if !self.nak_sent {
            return Some(since + self.allowance);
        }
        let at = self.nak_at?;
        Some(at + self.nak_repeat())
    }

    fn nak_repeat(&self) -> Duration {
        (self.allowance * 4).max(NAK_REPEAT_MIN) * (1 << self.nak_repeats.min(6))
    }

    /// NAKs a gap that outlived the reorder allowance (or its last NAK).
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if self.poll_timeout().is_some_and(|t| t <= now) {
            if self.nak_sent {
                self.nak_repeats += 1;
            }
            self.nak_gap(now);
        }
    }

    /// Executes the request packet with the expected PSN.
    fn execute(&mut self, pkt: &PacketRepr<'_>, mrs: &MrTable) {
        let psn = pkt.bth.psn;
        let op = pkt.bth.opcode;
        let (Some(kind), Some(pos)) = (op.kind(), op.position()) else {
            return;
        };
        let mtu = self.p.mtu;
        let plen = pkt.payload.len();
        let len_ok = match pos {
            Position::First | Position::Middle => plen == mtu,
            Position::Last => (1..=mtu).contains(&plen),
            Position::Only => plen <= mtu,
        };
        if !len_ok {
            self.fatal(psn, NakCode::InvalidRequest);
            return;
        }
        let continues = matches!(pos, Position::Middle | Position::Last);
        match (&self.cur, kind, continues) {
            (Current::Idle, Kind::Send | Kind::Write, false) => {}
            (Current::Send { .. }, Kind::Send, true)
            | (Current::Write { .. }, Kind::Write, true) => {}
            (Current::Idle, Kind::ReadRequest, false) => {
                self.execute_read(pkt, mrs, false);
                return;
            }
            _ => {
                self.fatal(psn, NakCode::InvalidRequest);
                return;
            }
        }
        // Requests that consume a receive WQE need one before anything is placed.
        let needs_wqe = match kind {
            Kind::Send => pos.starts(),
            _ => op.has_imm() && pos.ends(),
        };
        if needs_wqe && self.rq.is_empty() {
            self.stats.rnr_nak += 1;
            self.nak_sent = true; // drop what follows until this PSN comes again
            self.ack(
                psn,
                Syndrome::RnrNak {
                    timer: self.p.min_rnr_timer,
                },
            );
            return;
        }
        match kind {
            Kind::Send => {
                if pos.starts() {
                    let wqe = self.rq.pop_front().expect("checked above");
                    self.cur = Current::Send { wqe, received: 0 };
                }
                let Current::Send { wqe, received } = &mut self.cur else {
                    unreachable!()
                };
                if *received + plen > wqe.sgl.len() {
                    let Current::Send { wqe, received } =
                        std::mem::replace(&mut self.cur, Current::Idle)
                    else {
                        unreachable!()
                    };
                    self.complete_recv(wqe, WcStatus::LocLenErr, WcOpcode::Recv, received, None);
                    self.fatal(psn, NakCode::InvalidRequest);
                    return;
                }
                wqe.sgl.scatter(*received, pkt.payload);
                *received += plen;
                if pos.ends() {
                    let Current::Send { wqe, received } =
                        std::mem::replace(&mut self.cur, Current::Idle)
                    else {
                        unreachable!()
                    };
                    self.msn = (self.msn + 1) & 0xFF_FFFF;
                    self.complete_recv(wqe, WcStatus::Success, WcOpcode::Recv, received, pkt.imm);
                }
            }
            Kind::Write => {
                if pos.starts() {
                    let Some(reth) = pkt.reth else { return };
                    let total = reth.len as usize;
                    let shape_ok = match pos {
                        Position::First => total > mtu,
                        _ => total == plen,
                    };
                    if !shape_ok {
                        self.fatal(psn, NakCode::InvalidRequest);
                        return;
                    }
                    match self.check_remote(mrs, reth.rkey, reth.va, total, Access::REMOTE_WRITE) {
                        Ok(Some((mr, offset))) => {
                            self.cur = Current::Write {
                                mr,
                                offset,
                                done: 0,
                                total,
                            }
                        }
                        Ok(None) => {} // zero-length WRITE_ONLY
                        Err(_) => {
                            self.fatal(psn, NakCode::RemoteAccessError);
                            return;
                        }
                    }
                }
                let mut finished_len = plen;
                if let Current::Write {
                    mr,
                    offset,
                    done,
                    total,
                } = &mut self.cur
                {
                    let fits = *done + plen <= *total && (pos.ends() == (*done + plen == *total));
                    if !fits {
                        self.cur = Current::Idle;
                        self.fatal(psn, NakCode::InvalidRequest);
                        return;
                    }
                    mr.write(*offset + *done, pkt.payload);
                    *done += plen;
                    finished_len = *total;
                }
                if pos.ends() {
                    self.cur = Current::Idle;
                    self.msn = (self.msn + 1) & 0xFF_FFFF;
                    if op.has_imm() {
                        let wqe = self.rq.pop_front().expect("checked above");
                        self.complete_recv(
                            wqe,
                            WcStatus::Success,
                            WcOpcode::RecvRdmaWithImm,
                            finished_len,
                            pkt.imm,
                        );
                    }
                }
            }
            Kind::Atomic => {
                // Atomics are not implemented: SMC-R never uses them.
                self.fatal(psn, NakCode::InvalidRequest);
                return;
            }
            _ => return,
        }
        self.epsn = psn.add(1);
        self.nak_sent = false;
        self.nak_repeats = 0;
        if pkt.bth.ack_req {
            self.ack(psn, Syndrome::ACK);
        }
    }

    fn execute_read(&mut self, pkt: &PacketRepr<'_>, mrs: &MrTable, duplicate: bool) {
        let psn = pkt.bth.psn;
        let Some(reth) = pkt.reth else { return };
        let len = reth.len as usize;
        let Ok(mr) = self.check_remote(mrs, reth.rkey, reth.va, len, Access::REMOTE_READ) else {
            if !duplicate {
                self.fatal(psn, NakCode::RemoteAccessError);
            }
            return;
        };
        let npkts = len.div_ceil(self.p.mtu).max(1) as u32;
        if !duplicate {
            self.epsn = psn.add(npkts);
            self.nak_sent = false;
            self.nak_repeats = 0;
            self.msn = (self.msn + 1) & 0xFF_FFFF;
        } else if psn.add(npkts).is_after(self.epsn) {
            return; // overlaps PSNs we never issued: not a genuine duplicate
        }
        let (mr, offset) = match mr {
            Some((m, o)) => (Some(m), o),
            None => (None, 0),
        };
        self.out.push_back(Out::Read(ReadJob {
            mr,
            offset,
            len,
            psn,
            npkts,
            next: 0,
            msn: self.msn,
        }));
    }

    /// Writes the next ACK/NAK or READ response into `buf`; returns its length.
    pub(crate) fn poll_transmit(&mut self, buf: &mut [u8]) -> Option<usize> {
        let dest_qp = self.p.dest_qp;
        let mtu = self.p.mtu;
        match self.out.front_mut()? {
            Out::Ack { psn, syndrome, msn } => {
                let repr = PacketRepr {
                    bth: BthRepr::new(Opcode::ACKNOWLEDGE, dest_qp, *psn),
                    reth: None,
                    atomic_eth: None,
                    aeth: Some(Aeth {
                        syndrome: *syndrome,
                        msn: *msn,
                    }),
                    atomic_ack_eth: None,
                    imm: None,
                    ieth: None,
                    payload: &[],
                };
                repr.emit(buf);
                // A NAK names the expected PSN: it acknowledges what came before it.
                let next = match syndrome {
                    Syndrome::Ack { .. } => psn.add(1),
                    _ => *psn,
                };
                self.out.pop_front();
                if next.is_after(self.acked_to) {
                    self.acked_to = next;
                }
                Some(repr.buffer_len())
            }
            Out::Read(job) => {
                let k = job.next;
                let position = match (job.npkts, k) {
                    (1, _) => Position::Only,
                    (_, 0) => Position::First,
                    (n, k) if k + 1 == n => Position::Last,
                    _ => Position::Middle,
                };
                let opcode = Opcode::for_request(Kind::ReadResponse, position, false);
                let at = k as usize * mtu;
                let plen = (job.len - at).min(mtu);
                let repr = PacketRepr {
                    bth: BthRepr::new(opcode, dest_qp, job.psn.add(k)),
                    reth: None,
                    atomic_eth: None,
                    aeth: opcode.has_aeth().then_some(Aeth {
                        syndrome: Syndrome::ACK,
                        msn: job.msn,
                    }),
                    atomic_ack_eth: None,
                    imm: None,
                    ieth: None,
                    payload: &[],
                };
                repr.emit_headers_for(plen, buf);
                let total = PacketRepr::len_for(opcode, plen);
                if let Some(mr) = &job.mr {
                    let mut p = Packet::new_unchecked(&mut buf[..total]);
                    mr.read(job.offset + at, p.payload_mut());
                }
                job.next += 1;
                if job.next == job.npkts {
                    self.out.pop_front();
                }
                Some(total)
            }
        }
    }

    /// A one-line summary of the receiver state, for diagnostics.
    pub(crate) fn summary(&self) -> String {
        format!(
            "resp: epsn={} msn={} rq={} nak_sent={} out={} in_progress={} failed={} {:?}",
            self.epsn,
            self.msn,
            self.rq.len(),
            self.nak_sent,
            self.out.len(),
            !matches!(self.cur, Current::Idle),
            self.failed,
            self.stats
        )
    }

    pub(crate) fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Whether all that waits to be sent is one plain ACK (no NAK, no READ response).
    pub(crate) fn only_plain_ack(&self) -> bool {
        self.out.len() == 1
            && matches!(
                self.out.front(),
                Some(Out::Ack {
                    syndrome: Syndrome::Ack { .. },
                    ..
                })
            )
    }

    /// Completes every posted receive with `WR_FLUSH_ERR`; drops queued READ responses (a NAK
    /// already queued is kept so that the peer learns why).
    pub(crate) fn flush(&mut self) {
        if let Current::Send { wqe, received } = std::mem::replace(&mut self.cur, Current::Idle) {
            self.complete_recv(wqe, WcStatus::WrFlushErr, WcOpcode::Recv, received, None);
        }
        while let Some(wqe) = self.rq.pop_front() {
            self.complete_recv(wqe, WcStatus::WrFlushErr, WcOpcode::Recv, 0, None);
        }
        self.out.retain(|o| {
            matches!(
                o,
                Out::Ack {
                    syndrome: Syndrome::Nak(_),
                    ..
                }
            )
        });
        self.ahead.clear();
        self.ahead_bytes = 0;
        self.gap_since = None;
        self.failed = true;
    }
}
