//! A link group's driver, part 2: posting — CDCs, data writes (with their CDC), SENDs from
//! slots, long LLC messages, and the LLC queue of the group's state machine.

#[allow(unused_imports)]
use super::*;

impl LinkGroup {
    /// Sends CDC `m` (one without data: cursors, close flags) from `slot` (its owner, who
    /// hears of its completion, named when it was taken: [`Self::take_slot`]). Returns `true` when the SEND
    /// completed at once (same-host link): the slot is free again and no completion will
    /// follow, so the caller counts it as done. The peer acknowledges it at once: nothing of
    /// its own answers such a CDC soon.
    pub(crate) fn post_cdc(
        &self,
        path: usize,
        slot: usize,
        m: &CdcMessage,
    ) -> Result<bool, PostFailure> {
        self.post_cdc_after(path, &[], slot, m, SendFlags::ACK_NOW)
    }

    /// [`Self::post_cdc`], with `before` (RDMA WRITEs) posted ahead of it in the same post,
    /// and `flags` on the SEND.
    pub(super) fn post_cdc_after(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        m: &CdcMessage,
        flags: SendFlags,
    ) -> Result<bool, PostFailure> {
        let mut b = [0u8; cdc::CDC_LEN];
        m.emit(&mut b);
        self.post_owned(path, before, slot, &b, flags)
    }

    /// Posts `bytes` from `slot` (for the owner it was taken for), after `before`; the slot
    /// is freed here if the SEND completed at once or was never posted.
    pub(super) fn post_owned(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        bytes: &[u8],
        flags: SendFlags,
    ) -> Result<bool, PostFailure> {
        let done = self.post_send_slot_with(path, before, slot, bytes, flags);
        if !matches!(done, Ok(false)) {
            // Completed at once, or never posted: the slot is free again.
            self.put_back(slot);
        }
        done
    }

    /// Posts `bytes` as a SEND of no connection (feature `hostile`: tests of what the peer
    /// makes of messages we would never send).
    #[cfg(feature = "hostile")]
    pub(crate) fn post_raw_send(&self, bytes: &[u8]) -> io::Result<()> {
        if bytes.len() > SLOT {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let slot = self.take_slot(false, 0)?;
        self.post_owned(self.active(), &[], slot, bytes, SendFlags::empty())?;
        Ok(())
    }

    /// Why the QP failed, as the link's down reason: a flush caused by a request of the peer
    /// that our responder refused says so (the peer misbehaved), rather than only `WR_FLUSH_ERR`.
    pub(super) fn failure_cause(&self, path: usize, status: WcStatus) -> String {
        let r = self.paths[path].qp.responder_stats();
        match status {
            WcStatus::WrFlushErr if r.access_errors > 0 => {
                "the peer's RDMA request was refused (remote access error: rkey, range or \
                 rights; WR_FLUSH_ERR)"
                    .into()
            }
            WcStatus::WrFlushErr if r.invalid > 0 => {
                "the peer's RDMA request was refused (invalid request; WR_FLUSH_ERR)".into()
            }
            // A verbs device keeps no responder counters we can read, and rxe reports its own
            // local errors (a request naming memory no longer registered) as flushes too.
            WcStatus::WrFlushErr if self.dev.device.is_verbs() => {
                "WR_FLUSH_ERR (the verbs device gave no first error: a local error of the queue \
                 pair, or a request of the peer it refused)"
                    .into()
            }
            s => s.name().into(),
        }
    }

    /// Returns a slot that carries nothing in flight.
    pub(crate) fn put_back(&self, slot: usize) {
        self.st.lock().g.conns.put_back(slot);
        self.cond.notify_all();
    }

    /// Whether the link moves data through shared memory, as its queue pair last saw it
    /// (sticky; no lock: it may lag the switch by one post, which then goes as on UDP — also
    /// correct). A same-host group has one path.
    pub(super) fn same_host(&self) -> bool {
        self.paths[0].qp.same_host_seen()
    }

    /// As [`Self::same_host`], but exact: when no post saw the switch yet, the queue pair is
    /// asked under its lock (it may switch now). For what is shown and decided once per batch
    /// or timer run, not per write: a link whose last posts preceded the switch would
    /// otherwise be shown on UDP for good.
    pub(super) fn same_host_now(&self) -> bool {
        self.same_host() || self.paths[0].qp.is_same_host()
    }

    /// Posts a SEND of `bytes` from `slot` on `path`, with `extra` flags. Returns `true` if it
    /// completed at once (same-host link: the payload was copied into the peer's ring; the
    /// slot may be reused). `before`: requests posted ahead of the SEND in the same post (then
    /// `true` means they all ran too).
    pub(super) fn post_send_slot_with(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        bytes: &[u8],
        extra: SendFlags,
    ) -> Result<bool, PostFailure> {
        self.slots.send_mr.write(slot * SLOT, bytes);
        let sge = [self.slots.send_mr.sge(slot * SLOT, bytes.len())];
        let send = SendWr {
            wr_id: slot as u64,
            opcode: WrOpcode::Send,
            sg_list: &sge,
            // Linux posts every LLC/CDC SEND signaled and solicited (smc_wr.c). On a
            // same-host link a SEND that ran when posted is done: a completion would only
            // wake our own poller. One that had to wait for ring space completes later,
            // like a SEND on the wire (so slots and autocorking still hold writers back); over
            // UDP every SEND does (SIGNAL_IF_DEFERRED is SIGNALED there).
            flags: extra | SendFlags::SIGNAL_IF_DEFERRED | SendFlags::SOLICITED,
        };
        let qp = &self.paths[path].qp;
        // The data WRITEs before it (at most two) and the SEND, on the stack.
        let n = before.len();
        let ran = if n <= 2 {
            let mut wrs = [send; 3];
            wrs[..n].copy_from_slice(before);
            wrs[n] = send;
            qp.post_send_report(&wrs[..=n])
        } else {
            let mut wrs = before.to_vec();
            wrs.push(send);
            qp.post_send_report(&wrs)
        }
        .map_err(PostFailure::Refused)?;
        // Only the same-host transport runs requests when posted.
        Ok(ran == before.len() + 1)
    }

    /// Posts a connection's data: the RDMA WRITEs of `w`, then the CDC `m` announcing them
    /// from `slot`, like [`Self::post_cdc`]; with `ack_now` the peer acknowledges it at once
    /// ([`crate::conn::WritePlan::ack_now`]), else it may hold the ACK for its answer.
    pub(crate) fn post_data(
        &self,
        path: usize,
        w: &DataWrites<'_>,
        slot: usize,
        m: &CdcMessage,
        ack_now: bool,
    ) -> Result<bool, PostFailure> {
        let DataWrites {
            sndbuf,
            pieces,
            peer,
            slack,
        } = *w;
        let same_host = self.same_host();
        let zero_len = match pieces.last() {
            Some(&(_, len)) if self.write_pad && !same_host && len < GSO_WRITE_MIN => {
                (GSO_WRITE_MIN - len).min(slack)
            }
            _ => 0,
        };
        // At most two pieces (the ring wraps once): scatter lists and requests on the stack.
        if pieces.len() > 2 {
            self.put_back(slot);
            return Err(PostFailure::TooManyPieces);
        }
        let zero = self.slots.send_mr.sge(ZERO_SLOT * SLOT, zero_len as usize);
        let mut sges = [[zero; 2]; 2];
        for (sg, &(off, len)) in sges.iter_mut().zip(pieces) {
            sg[0] = sndbuf.sge(off as usize, len as usize);
        }
        let last = pieces.len().saturating_sub(1);
        let write = |i: usize, off: u32| SendWr {
            wr_id: u64::MAX,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: peer.0 + u64::from(off),
                rkey: peer.1,
            },
            sg_list: if i == last && zero_len > 0 {
                &sges[i][..]
            } else {
                &sges[i][..1]
            },
            // Unsignaled: the CDC after them is signaled and completes later.
            flags: SendFlags::empty(),
        };
        let mut wrs = [write(0, pieces.first().map_or(0, |p| p.0)); 2];
        for (i, &(off, _)) in pieces.iter().enumerate().skip(1) {
            wrs[i] = write(i, off);
        }
        let wrs = &wrs[..pieces.len()];
        // WRITEs and SEND in one post (one lock of the QP). On UDP they are transmitted in
        // one pass (one GSO datagram when their sizes allow), not one system call each; the
        // shared-memory transport copies them as they are posted.
        let flags = if ack_now {
            SendFlags::ACK_NOW
        } else {
            SendFlags::empty()
        };
        self.post_cdc_after(path, wrs, slot, m, flags)
    }

    /// Sends an LLC message longer than a slot: its first [`SLOT`] bytes from `slot`, the rest
    /// from the path's long-message buffer, which stays the request's until it completes
    /// (`WouldBlock` while another long message is in flight there; see `Path::big_tx`).
    pub(super) fn post_long_llc(&self, path: usize, slot: usize, b: &[u8]) -> io::Result<()> {
        let p = &self.paths[path];
        let Some(tail) = p.big_tx.as_ref().filter(|_| b.len() <= LLC_MAX) else {
            return Err(io::ErrorKind::InvalidInput.into());
        };
        // The buffer is the path's until the SEND using it completes (see `Path::big_tx`).
        if p.big_tx_slot
            .compare_exchange(0, slot + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        tail.write(0, &b[SLOT..]);
        self.slots.send_mr.write(slot * SLOT, &b[..SLOT]);
        let sge = [
            self.slots.send_mr.sge(slot * SLOT, SLOT),
            tail.sge(0, b.len() - SLOT),
        ];
        p.qp.post_send(&[SendWr {
            wr_id: slot as u64,
            opcode: WrOpcode::Send,
            sg_list: &sge,
            flags: SendFlags::SIGNALED
                | SendFlags::SOLICITED
                | SendFlags::EXPEDITE
                | SendFlags::ACK_NOW,
        }])
        .map_err(|e| {
            p.big_tx_slot.store(0, Ordering::Release);
            PostFailure::Refused(e).into()
        })
    }

    /// SEND slot `slot` of `path` completed (or was flushed): a long LLC message's buffer it
    /// held is free again.
    pub(super) fn sent_on(&self, path: usize, slot: usize) {
        // (Under the group's lock, as every use of the mark: a load per completion, no RMW.)
        let mark = &self.paths[path].big_tx_slot;
        if mark.load(Ordering::Relaxed) == slot + 1 {
            mark.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn flush_llc(&self, st: &mut LgState) {
        while st.g.has_transmit() {
            let Slot::Got(slot) = st.g.conns.take_slot(true) else {
                return;
            };
            let (path, m) = st.g.poll_transmit().expect("non-empty");
            let mut b = vec![0u8; m.buffer_len()];
            m.emit(&mut b);
            if b.len() > SLOT {
                // Only two-link groups make longer ones (ADD LINK).
                if let Err(e) = self.post_long_llc(path, slot, &b) {
                    // Lost like a message on a failing link: its flow times out and is retried.
                    log::info!(
                        "link group {} ({}): an LLC message of {} bytes on path {path} not \
                         sent: {e}",
                        self.id,
                        self.peer_text(),
                        b.len()
                    );
                    st.g.conns.put_back(slot);
                }
                continue;
            }
            // LLC requests and answers go ahead of connection data that has not started to
            // leave (a CONFIRM RKEY answer behind megabytes of data on a slow path outlived
            // the peer's LLC_WAIT); DELETE LINK stays behind it: what was posted before it
            // must arrive first.
            // An LLC request's answer is an LLC message too, but not sent from the
            // application's path: the peer acknowledges LLC messages at once.
            let flags = if matches!(m.body, llc::Llc::DeleteLink(_)) {
                SendFlags::ACK_NOW
            } else {
                SendFlags::EXPEDITE | SendFlags::ACK_NOW
            };
            if !matches!(
                self.post_send_slot_with(path, &[], slot, &b, flags),
                Ok(false)
            ) {
                st.g.conns.put_back(slot);
            }
        }
    }
}
