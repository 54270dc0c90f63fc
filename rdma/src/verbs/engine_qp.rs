//! A queue pair on our engine: posting, transmitting, same-host offers, waiting.

#[allow(unused_imports)]
use super::*;

/// Our engine's queue pair.
pub(super) struct EngineQp {
    pub(super) qp: Arc<QpShared>,
    pub(super) guard: Arc<EngineGuard>,
}

impl EngineQp {
    /// The QP number peers address.
    pub(super) fn qp_num(&self) -> u32 {
        self.qp.qpn
    }

    /// The current state.
    pub(super) fn state(&self) -> QpState {
        self.qp.core.lock().rc.state()
    }

    /// Changes state and attributes (`ibv_modify_qp`). INIT → RTR needs `av`, the peer
    /// engine's address.
    pub(super) fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
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
        if matches!(attr.qp_state, QpState::Error | QpState::Reset) {
            // A held ACK leaves first: flushing would drop it, and the peer would retry
            // against a QP that no longer answers.
            if core.rc.end_ack_hold() {
                shared.drive(&mut core, Instant::now());
            }
        }
        core.rc.modify(attr)?;
        if attr.qp_state == QpState::Reset {
            // Whatever the next peer is, it is learnt again from its packets.
            core.peer_ext = false;
            core.peer_no_icrc = false;
        }
        if attr.src.is_some() {
            core.src = attr.src;
        }
        if let Some(av) = attr.av {
            // A new peer: whether it is our engine is learnt again from its packets.
            core.peer_ext &= core.av == Some(av);
            core.av = Some(av);
            let src = core.src.unwrap_or(*shared.local.ip());
            core.max_dgram = crate::transport::udp::interface_mtu(src).map(|m| {
                (m as usize)
                    .saturating_sub(crate::wire::IPV4_HEADER_LEN + crate::wire::UDP_HEADER_LEN)
            });
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
                    // A peer's hello that came before we knew the pair's secret: challenged,
                    // or refused if our own offer did not go.
                    shared.answer_hellos(self.qp.qpn, &core_ref.rc, core_ref.av, shm);
                }
                _ => {}
            }
        }
        self.guard.shared.drive(&mut core, Instant::now());
        Ok(())
    }

    /// As [`QueuePair::post_send`]; returns how many of the requests already ran (same-host
    /// transport only: their data is in place and a SEND's payload copied; with
    /// [`SendFlags::SIGNAL_IF_DEFERRED`](crate::SendFlags::SIGNAL_IF_DEFERRED) only the others
    /// produce a completion).
    pub(super) fn post_send_report(&self, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
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
        // `now` from before the posting serves here too (the requests took microseconds; a
        // clock read is a measurable part of a small write). A corked thread's requests over
        // UDP leave when it uncorks (crate::cork); the engine sends them if it does not come
        // back in time.
        let deferred = (!same_host && res.is_ok() && crate::cork::corked())
            .then(|| crate::cork::defer(&self.guard, &self.qp))
            .flatten();
        match deferred {
            Some(first) => {
                if first {
                    shared.arm(&mut core, now + shared.cfg.cork_max);
                }
            }
            None => shared.drive(&mut core, now),
        }
        res.map(|()| ran)
    }

    /// Whether requests go through shared memory (the peer is on this host and in this
    /// network namespace; see [`Device::alloc_shared_pd`]) rather than UDP. Once true it stays
    /// true, and then a SEND's payload has been copied when `post_send` returns (its buffer
    /// may be reused at once; a signaled one still produces its completion).
    pub(super) fn is_same_host(&self) -> bool {
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
    pub(super) fn same_host_state(&self) -> crate::SameHost {
        let core = self.qp.core.lock();
        core.shm
            .as_ref()
            .map_or(crate::SameHost::Off, crate::samehost::ShmQp::state)
    }

    /// Whether the peer's offer came with its proof (or requests go through shared memory).
    pub(super) fn peer_is_our_engine(&self) -> bool {
        let core = self.qp.core.lock();
        core.shm
            .as_ref()
            .is_some_and(|s| s.active || s.tx.is_some())
    }

    /// The same-host peer's process (user and pid, as SO_PEERCRED tells them in our user
    /// namespace), once its offer came.
    pub(super) fn same_host_peer(&self) -> Option<crate::PeerCred> {
        let core = self.qp.core.lock();
        core.shm.as_ref()?.tx.as_ref()?.cred
    }

    /// Whether a post (or [`Self::is_same_host`]) already saw requests go through shared
    /// memory, without taking the QP's lock: a hot path's check. It lags the switch by at most
    /// one post; a caller that asks then treats that request as one sent over UDP, which is
    /// also correct (it is posted signaled, and its completion comes as on UDP).
    pub(super) fn same_host_seen(&self) -> bool {
        self.qp.same_host.load(Ordering::Relaxed)
    }

    /// Requests held for the peer's offer run before anything else (a drive settles them,
    /// and sends or rings what they produced).
    pub(super) fn settle_held(&self, core: &mut crate::device::QpCore) {
        if core.shm.as_ref().is_some_and(|s| s.held_len() > 0) {
            self.guard.shared.drive(core, Instant::now());
        }
    }

    /// Same-host transport only: places `data` at `remote_addr` of the peer (`rkey` checked),
    /// as an RDMA WRITE of a registered buffer would, but straight from the caller's memory
    /// (one copy less). Data written this way is in the peer's memory when this returns, so a
    /// SEND posted afterwards is seen after it. `false`: the QP does not send through shared
    /// memory (or the check failed): post a WRITE instead.
    pub(super) fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
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
    pub(super) fn unfinished_sends(&self) -> usize {
        let core = self.qp.core.lock();
        core.rc.send_queue_len()
            + core
                .shm
                .as_ref()
                .map_or(0, |s| s.backlog_len() + s.held_len())
    }

    /// Posts receive requests (`ibv_post_recv`).
    pub(super) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
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
    pub(super) fn summary(&self) -> String {
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
    pub(super) fn responder_stats(&self) -> crate::rc::ResponderStats {
        self.qp.core.lock().rc.responder_stats()
    }
}

impl Drop for EngineQp {
    fn drop(&mut self) {
        self.guard.shared.qps.write().remove(&self.qp.qpn);
        let mut core = self.qp.core.lock();
        if core.rc.end_ack_hold() {
            // The peer waits for it: without it, it would send again to a QP that is gone.
            self.guard.shared.drive(&mut core, Instant::now());
        }
        let _ = core.rc.modify(&QpAttr::state(QpState::Reset));
    }
}
