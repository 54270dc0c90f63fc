//! The responder half of an RC queue pair: the peer's requests.
//!
//! In-order packets (PSN == ePSN) are executed; a gap gets one PSN-sequence-error NAK and
//! later packets are dropped until the expected PSN arrives; duplicates are re-acknowledged
//! without being executed again, except RDMA READs, which are re-executed (IBA). Every
//! RDMA WRITE and READ is checked against the rkey, the protection domain, the access rights
//! and the region bounds before any byte moves; a violation answers with a remote-access-error
//! NAK and puts the QP into the error state, as rxe does.

use super::{SgList, WcOpcode, WcStatus, WorkCompletion};
use crate::mr::{Access, AccessError, MrTable, Region};
use crate::wire::{
    Aeth, BthRepr, Kind, NakCode, Opcode, Packet, PacketRepr, Position, Psn, Syndrome,
};
use std::collections::VecDeque;
use std::sync::Arc;

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
        }
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
    pub(crate) fn handle_request(&mut self, pkt: &PacketRepr<'_>, mrs: &MrTable) {
        if self.failed {
            return;
        }
        let psn = pkt.bth.psn;
        let d = psn.diff(self.epsn);
        if d > 0 {
            // One NAK per gap, repeated on packets that ask for an acknowledgement: if the
            // requester's retransmission was lost as well, this tells it again.
            if !self.nak_sent || pkt.bth.ack_req {
                self.nak_sent = true;
                self.stats.nak_seq += 1;
                self.ack(self.epsn, Syndrome::Nak(NakCode::PsnSequenceError));
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
                self.out.pop_front();
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
        self.failed = true;
    }
}
