//! The consumer side of a same-host QP: entries of its inbound ring become receive completions
//! while receive requests are posted (run by whoever polls or waits on the receive CQ).

use super::{
    E_HDR, E_SEND, E_SEND_IMM, E_WRITE_IMM, F_FIRST, F_LAST, RING_SLOT, RxCur, ShmFault, ShmQp,
};
use crate::rc::{CqSide, RcQp, WcOpcode, WcStatus, WorkCompletion};
use crate::shm::RingError;

impl ShmQp {
    /// Something in the inbound ring can be delivered now.
    pub(crate) fn rx_pending(&self, rc: &RcQp) -> bool {
        !self.inbound.is_empty() && (self.rx.is_some() || rc.has_recv())
    }

    /// Tells producers who of us sleeps (the word's bits: [`WAIT_EVENT`](super::WAIT_EVENT),
    /// [`WAIT_DRIVER`](super::WAIT_DRIVER); none: nobody).
    pub(crate) fn set_waiting(&self, word: u64) {
        self.inbound.set_waiting_word(word);
    }

    /// Turns inbound ring entries into receive completions while receive requests are posted.
    /// Returns how many messages completed.
    pub(crate) fn receive(&mut self, rc: &mut RcQp) -> Result<usize, ShmFault> {
        let mut buf = [0u8; RING_SLOT];
        let mut n = 0;
        loop {
            if self.inbound.is_empty() || (self.rx.is_none() && !rc.has_recv()) {
                return Ok(n);
            }
            let len = match self.inbound.pop(&mut buf) {
                Ok(Some(l)) => l,
                Ok(None) => return Ok(n),
                Err(RingError::Corrupt(w)) => return Err(ShmFault(w)),
                Err(_) => return Err(ShmFault("oversized ring entry")),
            };
            if len < E_HDR {
                return Err(ShmFault("short ring entry"));
            }
            let (op, flags) = (buf[0], buf[1]);
            let imm = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
            let total = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
            let data = &buf[E_HDR..len];
            if !matches!(op, E_SEND | E_SEND_IMM | E_WRITE_IMM) {
                return Err(ShmFault("unknown ring entry"));
            }
            if flags & F_FIRST != 0 {
                if self.rx.is_some() {
                    return Err(ShmFault("message started inside another"));
                }
                let wqe = rc.take_recv().ok_or(ShmFault("no receive request"))?;
                if op != E_WRITE_IMM && total > wqe.sgl.len() {
                    // Too long for the receive buffers: as on the wire, the receive fails
                    // and the QP enters the error state.
                    rc.push_completion(
                        CqSide::Recv,
                        WorkCompletion {
                            wr_id: wqe.wr_id,
                            status: WcStatus::LocLenErr,
                            opcode: WcOpcode::Recv,
                            byte_len: 0,
                            imm_data: None,
                            qp_num: rc.qp_num(),
                        },
                    );
                    return Err(ShmFault("message longer than the receive request"));
                }
                self.rx = Some(RxCur {
                    wqe,
                    op,
                    imm,
                    total,
                    done: 0,
                });
            }
            let Some(cur) = self.rx.as_mut() else {
                return Err(ShmFault("continuation without a message"));
            };
            if op != cur.op
                || data.len() > cur.total - cur.done
                || (op == E_WRITE_IMM && !data.is_empty())
            {
                return Err(ShmFault("ring entry does not continue its message"));
            }
            cur.wqe.sgl.scatter(cur.done, data);
            cur.done += data.len();
            if flags & F_LAST != 0 {
                let cur = self.rx.take().expect("set above");
                if cur.op != E_WRITE_IMM && cur.done != cur.total {
                    return Err(ShmFault("message shorter than announced"));
                }
                rc.push_completion(
                    CqSide::Recv,
                    WorkCompletion {
                        wr_id: cur.wqe.wr_id,
                        status: WcStatus::Success,
                        opcode: if cur.op == E_WRITE_IMM {
                            WcOpcode::RecvRdmaWithImm
                        } else {
                            WcOpcode::Recv
                        },
                        byte_len: cur.total as u32,
                        imm_data: (cur.op != E_SEND).then_some(cur.imm),
                        qp_num: rc.qp_num(),
                    },
                );
                n += 1;
            }
        }
    }
}
