//! The producer side of a same-host QP: send requests run against the peer — a WRITE or READ
//! is a copy into or out of its arena, a SEND ring entries — or wait for ring space, and the
//! peer's doorbells rung when it sleeps.

use super::{
    Backlog, E_DATA, E_HDR, E_SEND, E_SEND_IMM, E_WRITE_IMM, F_FIRST, F_LAST, PeerTx, RING_SLOT,
    ShmQp, WAIT_DRIVER, WAIT_EVENT, wc,
};
use crate::mr::{Access, MrTable};
use crate::rc::{CqSide, PostError, RcQp, SendFlags, SendWr, WcStatus, WrOpcode};
use crate::shm::RingError;

impl ShmQp {
    /// Executes (or queues, if the peer's ring is full) one send request; returns whether it
    /// ran at once.
    pub(crate) fn post(
        &mut self,
        rc: &mut RcQp,
        wr: &SendWr<'_>,
        mrs: &MrTable,
    ) -> Result<bool, PostError> {
        match rc.state() {
            crate::rc::QpState::Rts => {}
            crate::rc::QpState::Error => {
                rc.push_completion(
                    CqSide::Send,
                    wc(rc, wr.wr_id, WcStatus::WrFlushErr, &wr.opcode, 0),
                );
                return Ok(false);
            }
            s => return Err(PostError::InvalidState(s)),
        }
        if self.backlog.len() >= rc.caps().max_send_wr as usize {
            return Err(PostError::QueueFull);
        }
        let sgl = rc.resolve_send_sgl(wr, mrs)?;
        let signaled = wr.flags.contains(SendFlags::SIGNALED) || rc.sq_sig_all();
        self.backlog.push_back(Backlog {
            wr_id: wr.wr_id,
            op: wr.opcode,
            signaled,
            sgl,
            done: 0,
            owned: None,
            written: false,
        });
        self.flush(rc);
        let Some(b) = self.backlog.back_mut() else {
            return Ok(true);
        };
        // Deferred: it completes later; the caller may still reuse a SEND's buffer.
        if wr.flags.contains(SendFlags::SIGNAL_IF_DEFERRED) {
            b.signaled = true;
        }
        if b.owned.is_none() && matches!(b.op, WrOpcode::Send | WrOpcode::SendWithImm(_)) {
            let mut v = vec![0u8; b.sgl.len()];
            b.sgl.gather(0, &mut v);
            b.owned = Some(v);
        }
        Ok(false)
    }

    /// Copies `data` into the peer's memory at `remote_addr` (checked against `rkey` as an
    /// RDMA WRITE is), from the caller's buffer rather than a local region: `false` if there
    /// is no peer yet or the check fails (then post the WRITE, which reports it).
    pub(crate) fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        let Some(tx) = &self.tx else { return false };
        let Ok(off) = tx
            .arena
            .lookup(rkey, remote_addr, data.len() as u64, Access::REMOTE_WRITE)
        else {
            return false;
        };
        // SAFETY: `data` is valid for its length; the destination was checked by `lookup`.
        unsafe { tx.arena.seg.copy_in_raw(off, data.as_ptr(), data.len()) }
    }

    /// Requests still waiting for ring space.
    pub(crate) fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Executes queued requests in order until the peer's ring is full.
    pub(crate) fn flush(&mut self, rc: &mut RcQp) {
        while let Some(b) = self.backlog.front_mut() {
            if rc.state() != crate::rc::QpState::Rts {
                let b = self.backlog.pop_front().expect("non-empty");
                rc.push_completion(
                    CqSide::Send,
                    wc(rc, b.wr_id, WcStatus::WrFlushErr, &b.op, 0),
                );
                continue;
            }
            let Some(tx) = &self.tx else { return };
            let bell = Bell {
                ring: &mut self.ring_bell,
                rang: &mut self.rang,
                rang_full: &mut self.rang_full,
            };
            match execute(tx, b, bell) {
                Ok(true) => {
                    let b = self.backlog.pop_front().expect("non-empty");
                    if b.signaled {
                        let n = b.sgl.len() as u32;
                        rc.push_completion(
                            CqSide::Send,
                            wc(rc, b.wr_id, WcStatus::Success, &b.op, n),
                        );
                    }
                }
                Ok(false) => return, // ring full: retried later
                Err(status) => {
                    let b = self.backlog.pop_front().expect("non-empty");
                    rc.push_completion(CqSide::Send, wc(rc, b.wr_id, status, &b.op, 0));
                    rc.fail();
                    self.disconnect(Some(rc));
                    return;
                }
            }
        }
    }

    /// Wakes the peer if it sleeps and we gave it something since the last call.
    pub(crate) fn ring_bell(&mut self) {
        let word = std::mem::take(&mut self.ring_bell);
        if word != 0
            && let Some(tx) = &self.tx
        {
            if word & WAIT_EVENT != 0 {
                let _ = rustix::io::write(&tx.bell, &1u64.to_ne_bytes());
            }
            if word & WAIT_DRIVER != 0 {
                let _ = rustix::io::write(&tx.bell_driver, &1u64.to_ne_bytes());
            }
        }
    }
}

/// The producer's doorbell state (of [`ShmQp`]), for the entries one request pushes.
struct Bell<'a> {
    /// The doorbells to ring at the end of the drive.
    ring: &'a mut u32,
    /// The waiting word last rung for.
    rang: &'a mut u64,
    /// Rung for a full ring.
    rang_full: &'a mut bool,
}

/// Runs `b` against the peer: `Ok(true)` done, `Ok(false)` the ring is full (progress kept in
/// `b`), `Err` a failed request.
fn execute(tx: &PeerTx, b: &mut Backlog, mut bell: Bell<'_>) -> Result<bool, WcStatus> {
    let len = b.sgl.len();
    match b.op {
        WrOpcode::RdmaWrite { remote_addr, rkey }
        | WrOpcode::RdmaWriteWithImm {
            remote_addr, rkey, ..
        } => {
            if !b.written {
                let off = tx
                    .arena
                    .lookup(rkey, remote_addr, len as u64, Access::REMOTE_WRITE)
                    .map_err(|_| WcStatus::RemAccessErr)?;
                b.sgl.raw_pieces(0, len, |p, n, done| {
                    // SAFETY: `p` is valid for `n` bytes (a piece of a resolved local SGE);
                    // the destination was checked against the mapping by `lookup`.
                    unsafe { tx.arena.seg.copy_in_raw(off + done, p, n) };
                });
                b.written = true;
            }
            if let WrOpcode::RdmaWriteWithImm { imm, .. } = b.op {
                return push(tx, E_WRITE_IMM, F_FIRST | F_LAST, imm, len, &[], &mut bell);
            }
            Ok(true)
        }
        WrOpcode::RdmaRead { remote_addr, rkey } => {
            let off = tx
                .arena
                .lookup(rkey, remote_addr, len as u64, Access::REMOTE_READ)
                .map_err(|_| WcStatus::RemAccessErr)?;
            b.sgl.raw_pieces(0, len, |p, n, done| {
                // SAFETY: as above, in the other direction.
                unsafe { tx.arena.seg.copy_out_raw(off + done, p, n) };
            });
            Ok(true)
        }
        WrOpcode::Send | WrOpcode::SendWithImm(_) => {
            let (op, imm) = match b.op {
                WrOpcode::SendWithImm(i) => (E_SEND_IMM, i),
                _ => (E_SEND, 0),
            };
            let mut chunk = [0u8; E_DATA];
            loop {
                let take = (len - b.done).min(E_DATA);
                let mut flags = 0;
                if b.done == 0 {
                    flags |= F_FIRST;
                }
                if b.done + take == len {
                    flags |= F_LAST;
                }
                match &b.owned {
                    Some(v) => chunk[..take].copy_from_slice(&v[b.done..b.done + take]),
                    None => b.sgl.gather(b.done, &mut chunk[..take]),
                }
                if !push(tx, op, flags, imm, len, &chunk[..take], &mut bell)? {
                    return Ok(false);
                }
                b.done += take;
                if b.done == len {
                    return Ok(true);
                }
            }
        }
    }
}

/// Pushes one ring entry; `Ok(false)` if the ring is full.
fn push(
    tx: &PeerTx,
    op: u8,
    flags: u8,
    imm: u32,
    total: usize,
    data: &[u8],
    bell: &mut Bell<'_>,
) -> Result<bool, WcStatus> {
    let mut e = [0u8; RING_SLOT];
    e[0] = op;
    e[1] = flags;
    e[4..8].copy_from_slice(&imm.to_le_bytes());
    e[8..12].copy_from_slice(&(total as u32).to_le_bytes());
    e[E_HDR..E_HDR + data.len()].copy_from_slice(data);
    match tx.ring.push_word(&e[..E_HDR + data.len()]) {
        Ok(waiting) => {
            *bell.ring |= crate::notify::doorbells(waiting, bell.rang);
            *bell.rang_full = false;
            Ok(true)
        }
        Err(RingError::Full) => {
            // The consumer may sleep with a full ring: make sure it looks, once.
            if !std::mem::replace(bell.rang_full, true) {
                *bell.ring |= WAIT_EVENT | WAIT_DRIVER;
            }
            Ok(false)
        }
        // The peer's ring is garbage or too small: the request fails.
        Err(_) => Err(WcStatus::RemOpErr),
    }
}
