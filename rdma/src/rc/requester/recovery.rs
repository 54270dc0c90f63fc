//! The requester's acknowledgements, timers and loss recovery: ACKs and NAKs taken in, the
//! early probe, the retransmission timeout, completions produced in posting order.

use super::*;

impl Requester {
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        [
            self.rtx_deadline,
            self.rnr_until,
            self.probe_at,
            self.resend_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if self.rnr_until.is_some_and(|t| t <= now) {
            self.rnr_until = None;
        }
        if self.resend_at.is_some_and(|t| t <= now) && !self.failed {
            match self.resend_psn {
                Some(p)
                    if p == self.una && self.una != self.max_sent && self.rnr_until.is_none() =>
                {
                    // The packet resent after the NAK was not acknowledged: lost or held up
                    // again. Once more, alone (no window cut: the early probe and the timeout
                    // remain for a path that lost everything).
                    self.resend_backoff = (self.resend_backoff * 2).min(16);
                    self.resend_one(p);
                    self.resend_at = Some(now + self.resend_interval());
                }
                _ => self.resend_done(),
            }
        }
        if self.probe_at.is_some_and(|t| t <= now) && !self.failed {
            if self.una == self.max_sent || self.rnr_until.is_some() {
                self.probe_at = None;
            } else {
                // No progress for a few round trips: the tail of the window (or a NAK, or our
                // retransmission) was lost, or the peer's ACK is late (it holds ACKs, its
                // thread is busy). Send the oldest unacknowledged packet again, alone (as TCP's
                // tail loss probe sends one segment), rather than waiting for the local ACK
                // timeout; this spends no retry. A late ACK then costs one duplicate, not the
                // window; a loss is told by the answer: an ACK up to it (then the rest goes
                // again, go-back-N, unless the peer kept it) or a NAK.
                self.stats.probes += 1;
                self.probe_undo = Some(ProbeUndo {
                    retransmits: self.stats.retransmits,
                    upto: self.max_sent,
                    cwnd: self.cwnd,
                    ssthresh: self.ssthresh,
                    recovery: self.recovery,
                    sent_at: self.last_ackreq_at.unwrap_or(now),
                });
                self.on_loss();
                self.gobackn_from = None;
                let una = self.una;
                self.resend_one(una);
                self.resend_psn = Some(una);
                self.resend_backoff = 1;
                self.resend_at = Some(now + self.resend_interval());
                self.probe_backoff = (self.probe_backoff * 2).min(64);
                self.probe_at = self.probe_interval().map(|d| now + d);
            }
        }
        let Some(deadline) = self.rtx_deadline else {
            return;
        };
        if deadline > now || self.failed {
            return;
        }
        if self.una == self.max_sent {
            self.rtx_deadline = None;
            return;
        }
        if self.rnr_until.is_some() {
            // Waiting out an RNR NAK is not a lost ACK.
            self.rtx_deadline = self.rto().map(|d| now + d);
            return;
        }
        if self.retries_left == 0 {
            self.fail(WcStatus::RetryExcErr);
            return;
        }
        self.retries_left -= 1;
        self.stats.timeouts += 1;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        self.on_loss();
        self.gobackn_from = None;
        self.resend_done();
        let una = self.una;
        self.go_back_to(una);
        self.rtx_deadline = self.rto().map(|d| now + d);
    }

    pub(super) fn on_loss(&mut self) {
        if self.recovery.is_some_and(|r| self.una.is_before(r)) {
            return; // already reduced for this window
        }
        self.recovery = Some(self.max_sent);
        self.ssthresh = (self.cwnd / 2).max(MIN_CWND);
        self.cwnd = self.ssthresh;
        self.cwnd_acc = 0;
    }

    pub(super) fn on_progress(&mut self, now: Instant, acked: u32) {
        self.retries_left = self.p.retry_cnt;
        self.rnr_left = self.p.rnr_retry;
        self.backoff = 1;
        if self.cwnd < self.ssthresh {
            self.cwnd = (self.cwnd + acked).min(self.p.max_window);
        } else {
            self.cwnd_acc += acked;
            if self.cwnd_acc >= self.cwnd {
                self.cwnd_acc -= self.cwnd;
                self.cwnd = (self.cwnd + 1).min(self.p.max_window);
            }
        }
        self.probe_backoff = 1;
        let busy = self.una != self.max_sent;
        if let Some(f) = self.stall_from {
            let us = now.saturating_duration_since(f).as_micros() as u64;
            self.stats.longest_stall_us = self.stats.longest_stall_us.max(us);
        }
        self.stall_from = busy.then_some(now);
        self.rtx_deadline = if busy {
            self.rto().map(|d| now + d)
        } else {
            None
        };
        self.probe_at = if busy {
            self.probe_interval().map(|d| now + d)
        } else {
            None
        };
    }

    /// A PSN the peer may legitimately acknowledge: in `[una - 1, max_sent - 1]`.
    pub(super) fn ackable(&self, psn: Psn) -> bool {
        psn.in_window(self.una.sub(1), self.max_sent.diff(self.una) as u32 + 1)
    }

    pub(super) fn complete_front(&mut self, status: WcStatus) {
        if let Some(w) = self.wqes.pop_front() {
            if self.snd_idx > 0 {
                self.snd_idx -= 1;
            }
            if w.signaled || status != WcStatus::Success {
                self.completions.push_back(WorkCompletion {
                    wr_id: w.wr_id,
                    status,
                    opcode: w.wc_opcode(),
                    byte_len: w.sgl.len() as u32,
                    imm_data: None,
                    qp_num: self.qp_num,
                });
            }
        }
    }

    /// A probe turned out needless: undo its window cut, and wait at least as long as this
    /// ACK took next time (rttvar covers the wait).
    pub(super) fn spurious_probe(&mut self, now: Instant, u: ProbeUndo) {
        self.stats.spurious_probes += 1;
        self.cwnd = self.cwnd.max(u.cwnd);
        self.ssthresh = self.ssthresh.max(u.ssthresh);
        self.recovery = u.recovery;
        let waited = now.saturating_duration_since(u.sent_at);
        self.rttvar = self.rttvar.max(waited / 2);
        self.probe_undo = None;
    }

    /// Everything up to and including `psn` is acknowledged.
    pub(super) fn ack_through(&mut self, now: Instant, psn: Psn) {
        let target = psn.add(1);
        if !self.peer_keeps
            && self.resume_at.is_none()
            && self.resend_until.is_some_and(|l| target.is_after(l))
        {
            // It kept what followed the gap: the window cut for that NAK was for reordering,
            // not congestion; slow start again to the window it may have.
            self.peer_keeps = true;
            self.ssthresh = self.p.max_window;
        }
        if let Some(u) = self.probe_undo {
            if target.is_after(self.snd_psn) && self.snd_psn.is_before(u.upto) {
                // Acknowledged beyond what the probe has sent again: the peer had the first
                // copies, and only its ACK was late.
                self.spurious_probe(now, u);
            } else if target == self.una
                && !self.una.is_before(u.upto)
                && self.stats.retransmits > u.retransmits
            {
                // The last resent packet acknowledged again (a responder re-acknowledges a
                // duplicate, C9-105): it had the first copies too. A real loss yields one ACK
                // for it, after it was sent again.
                self.spurious_probe(now, u);
            } else if target.is_after(u.upto) {
                self.probe_undo = None; // new data acknowledged: the episode is over
            }
        }
        if !target.is_after(self.una) {
            return;
        }
        let before = self.una;
        let mut new_una = target;
        while let Some(w) = self.wqes.front() {
            if w.kind == WqeKind::Read && w.read_done < w.npkts {
                if !psn.is_before(w.first_psn) {
                    // The peer acknowledged past a READ whose responses we lack: they were
                    // lost (IBA "implied NAK"). Ask again for the rest.
                    let resume = w.first_psn.add(w.read_done);
                    new_una = resume;
                    if self.snd_psn.is_after(resume) {
                        self.go_back_to(resume);
                    }
                }
                break;
            }
            if w.last_psn().is_after(psn) {
                break;
            }
            self.complete_front(WcStatus::Success);
        }
        if new_una.is_after(self.una) {
            self.una = new_una;
        }
        if self.una.is_after(self.snd_psn) {
            // Acknowledged past what is being resent: on from there — or, while a packet resent
            // alone was waiting to go, from where sending stood before (the peer keeps).
            let to = match self.resume_at {
                Some(r) if r.is_after(self.una) => r,
                _ => self.una,
            };
            self.go_back_to(to);
        }
        if self.gobackn_from.is_some_and(|g| self.una.is_after(g)) {
            self.gobackn_from = None;
        }
        if let Some((p, t)) = self.rtt_sample
            && !psn.is_before(p)
        {
            self.rtt_sample = None;
            self.rtt_update(now.saturating_duration_since(t));
        }
        let acked = self.una.diff(before).max(0) as u32;
        if self.resend_psn.is_some_and(|p| self.una.is_after(p)) {
            self.resend_done();
        }
        if acked > 0 {
            self.resend_until = None;
            self.on_progress(now, acked);
        }
    }

    /// Handles an ACKNOWLEDGE packet.
    pub(crate) fn handle_ack(&mut self, now: Instant, psn: Psn, aeth: Aeth) {
        if self.failed || !self.ackable(psn) {
            return;
        }
        match aeth.syndrome {
            Syndrome::Ack { .. } => self.ack_through(now, psn),
            Syndrome::RnrNak { timer } => {
                self.stats.rnr_naks += 1;
                self.ack_through(now, psn.sub(1));
                if psn != self.una {
                    return;
                }
                if self.p.rnr_retry != INFINITE_RNR {
                    if self.rnr_left == 0 {
                        self.fail(WcStatus::RnrRetryExcErr);
                        return;
                    }
                    self.rnr_left -= 1;
                }
                self.rnr_until = Some(now + crate::rc::rnr_timer_duration(timer));
                if self.peer_keeps {
                    // It kept what followed (a burst of SENDs placed at once when a gap filled
                    // can outrun the posted receives): only this one goes again, after the wait.
                    self.resend_one(psn);
                } else {
                    self.go_back_to(psn);
                }
                self.rtx_deadline = self.rto().map(|d| now + d);
            }
            Syndrome::Nak(NakCode::PsnSequenceError) => {
                self.stats.naks += 1;
                self.ack_through(now, psn.sub(1));
                if psn != self.una || self.rnr_until.is_some() {
                    return;
                }
                // The same NAK again within a round trip is a duplicate of the one we acted on;
                // later, it means our retransmission was lost too.
                let rtt = self
                    .srtt
                    .unwrap_or(Duration::from_millis(1))
                    .max(Duration::from_micros(100));
                if self.gobackn_from == Some(psn) && self.gobackn_at.is_some_and(|t| now < t + rtt)
                {
                    return;
                }
                self.gobackn_from = Some(psn);
                self.gobackn_at = Some(now);
                if !self.peer_keeps {
                    self.on_loss();
                }
                self.resend_one(psn);
                self.resend_psn = Some(psn);
                self.resend_at = Some(now + self.resend_interval());
            }
            Syndrome::Nak(code) => {
                self.ack_through(now, psn.sub(1));
                self.fail(match code {
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                    _ => WcStatus::RemInvReqErr,
                });
            }
        }
    }

    /// Handles an RDMA READ response packet.
    pub(crate) fn handle_read_response(
        &mut self,
        now: Instant,
        psn: Psn,
        position: Position,
        payload: &[u8],
    ) {
        if self.failed || !self.ackable(psn) {
            return;
        }
        let Some(idx) = self.wqes.iter().position(|w| w.contains(psn)) else {
            return;
        };
        if self.wqes[idx].kind != WqeKind::Read {
            // A read response for a SEND/WRITE PSN: the peer is confused.
            self.fail(WcStatus::BadRespErr);
            return;
        }
        let first = self.wqes[idx].first_psn;
        // A response implicitly acknowledges every earlier request.
        self.ack_through(now, first.sub(1));
        let Some(w) = self.wqes.front_mut() else {
            return;
        };
        if w.first_psn != first {
            return; // an earlier request is still incomplete (cannot happen in order)
        }
        let expected = w.first_psn.add(w.read_done);
        if psn != expected {
            if psn.is_after(expected) && self.snd_psn.is_after(expected) {
                // Responses went missing: re-request the remainder.
                self.on_loss();
                self.go_back_to(expected);
            }
            return;
        }
        let mtu = self.p.mtu;
        let offset = w.read_done as usize * mtu;
        let remaining = w.sgl.len() - offset;
        let ok = match position {
            Position::First | Position::Middle => payload.len() == mtu && remaining > mtu,
            Position::Last => payload.len() == remaining && w.read_done > 0,
            Position::Only => payload.len() == remaining && w.read_done == 0,
        };
        if !ok {
            self.fail(WcStatus::BadRespErr);
            return;
        }
        w.sgl.scatter(offset, payload);
        w.read_done += 1;
        let before = self.una;
        self.una = expected.add(1);
        if w.read_done == w.npkts {
            self.complete_front(WcStatus::Success);
        }
        if self.una.is_after(self.snd_psn) {
            self.go_back_to(self.una);
        }
        let acked = self.una.diff(before).max(0) as u32;
        self.on_progress(now, acked.max(1));
    }

    /// Fails the oldest request with `status` and flushes the rest.
    pub(crate) fn fail(&mut self, status: WcStatus) {
        if self.failed {
            return;
        }
        self.failed = true;
        if !self.wqes.is_empty() {
            self.complete_front(status);
        }
        self.flush();
    }

    /// Completes every queued request with `WR_FLUSH_ERR`.
    pub(crate) fn flush(&mut self) {
        self.failed = true;
        while !self.wqes.is_empty() {
            self.complete_front(WcStatus::WrFlushErr);
        }
        self.rtx_deadline = None;
        self.rnr_until = None;
        self.probe_at = None;
        self.probe_undo = None;
        self.stall_from = None;
    }
}
