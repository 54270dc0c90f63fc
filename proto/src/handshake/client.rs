//! The client side of the CLC handshake.

#[allow(unused_imports)]
use super::*;

/// The client side of the handshake.
#[derive(Debug)]
pub struct Client {
    pub(super) c: Common,
    pub(super) state: ClientState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ClientState {
    AwaitAccept,
    AwaitLocal {
        negotiated: Negotiated,
        server: PeerInfo,
    },
    /// Confirm sent (first contact: the link must come up next).
    Confirmed {
        first_contact: bool,
        at: Instant,
    },
    /// The first link failed: listening for the server's Decline.
    AwaitLinkDecline,
}

impl Client {
    /// Starts a handshake on a TCP connection whose peer advertised SMC-R: queues the Proposal.
    pub fn new(cfg: Config, roce_gid: Gid, now: Instant) -> Self {
        let mut c = Common::new(cfg, now);
        let p = Proposal {
            eyecatcher: clc::Eyecatcher::SmcR,
            version: 2,
            typev1: SmcType::None,
            typev2: SmcType::R,
            // Linux leaves this zero in a v2-only Proposal; we send our system ID (the field
            // RFC 7609 defines for it), so a server can tell a restarted client process on the
            // same address from its predecessor (docs/protocol.md).
            peer_id: c.cfg.peer_id,
            gid: Gid::default(),
            mac: Mac::default(),
            smcd: Some(SmcdInfo::default()),
            prefix: None,
            v2: Some(V2Extension {
                release: c.cfg.release,
                seid: false,
                roce_gid,
                max_conns: c.cfg.max_conns,
                max_links: c.cfg.max_links,
                feature_mask: c.cfg.feature_mask,
                eids: c.cfg.ueids.clone(),
                smcd_v2: None,
            }),
        };
        c.send(&Message::Proposal(p));
        c.wait_for(MsgType::Accept, now);
        Self {
            c,
            state: ClientState::AwaitAccept,
        }
    }

    pub(super) fn on_message(&mut self, m: Message) {
        match (&self.state, &m) {
            (ClientState::AwaitAccept, _) => {}
            (ClientState::AwaitLinkDecline, Message::Decline(d)) => {
                return self.c.peer_declined(d);
            }
            (ClientState::AwaitLinkDecline, _) => {
                return self.c.fail(Error::Unexpected {
                    expected: MsgType::Decline,
                    got: m.msg_type(),
                });
            }
            _ => return,
        }
        let a = match m {
            Message::Decline(d) => {
                return self.c.peer_declined(&d);
            }
            Message::AcceptConfirm(a) if a.role == Role::Accept => a,
            other => {
                return self.c.fail(Error::Unexpected {
                    expected: MsgType::Accept,
                    got: other.msg_type(),
                });
            }
        };
        match self.check_accept(&a) {
            Ok((negotiated, server)) => {
                self.c.deadline = None;
                self.c.events.push_back(Event::Accepted {
                    negotiated,
                    server: server.clone(),
                });
                self.state = ClientState::AwaitLocal { negotiated, server };
            }
            Err(reason) => {
                self.c.decline(a.version.min(2), reason);
            }
        }
    }

    pub(super) fn on_timeout(&mut self, what: MsgType, now: Instant) {
        match self.state {
            // The server owes an Accept or Decline: wait more rounds.
            ClientState::AwaitAccept => {
                let max = self.c.cfg.accept_wait_max;
                self.c.owed_for(what, now, max)
            }
            ClientState::AwaitLinkDecline => self.c.decline(2, DeclineReason::TIMEOUT_CL),
            _ => self.c.timed_out(what),
        }
    }

    /// Linux's client checks of an Accept (`smc_connect_rdma_v2_prepare`,
    /// `smc_clc_clnt_v2x_features_validate`), plus what we cannot do.
    pub(super) fn check_accept(
        &self,
        a: &AcceptConfirm,
    ) -> Result<(Negotiated, PeerInfo), DeclineReason> {
        let cfg = &self.c.cfg;
        // We offered SMC-R v2 only.
        let (AcceptBody::SmcR(r), 2..) = (&a.body, a.version) else {
            return Err(DeclineReason::MODEUNSUPP);
        };
        let v2 = r.v2.as_ref().ok_or(DeclineReason::MODEUNSUPP)?;
        if !cfg.ueids.contains(&v2.eid) {
            return Err(DeclineReason::NOUEID);
        }
        if r.qp_mtu.bytes().is_none() {
            return Err(DeclineReason::ERR_RDYLNK);
        }
        let mut neg = Negotiated {
            version: 2,
            eid: v2.eid,
            release: cfg.release,
            max_conns: cfg.max_conns,
            max_links: cfg.max_links,
            feature_mask: cfg.feature_mask,
        };
        if let Some(fce) = &v2.fce {
            // Only direct (same subnet) SMC-Rv2: we do no route lookups.
            if !fce.v2_direct {
                return Err(DeclineReason::NOINDIRECT);
            }
            if fce.release > cfg.release {
                return Err(DeclineReason::RELEASEERR);
            }
            neg.release = fce.release;
            if fce.release >= 1 {
                if fce.max_conns < MIN_CONNS_PER_LGR || fce.max_conns > cfg.max_conns {
                    return Err(DeclineReason::MAXCONNERR);
                }
                if !(1..=cfg.max_links.min(MAX_LINKS_PER_LGR)).contains(&fce.max_links) {
                    return Err(DeclineReason::MAXLINKERR);
                }
                neg.max_conns = fce.max_conns;
                neg.max_links = fce.max_links;
            }
            neg.feature_mask &= fce.feature_mask;
        } else if a.first_contact {
            return Err(DeclineReason::MODEUNSUPP);
        }
        let server = PeerInfo {
            peer_id: r.peer_id,
            endpoint: endpoint_of(r),
            first_contact: a.first_contact,
            hostname: v2.fce.map(|f| f.hostname),
            gids: Vec::new(),
        };
        Ok((neg, server))
    }

    /// Sends the Confirm with our endpoint (after the link is set up or found). `alt_gids` are
    /// further RoCE v2 GIDs of ours (first contact only; Linux lists the link GID first).
    pub fn confirm(
        &mut self,
        local: &Endpoint,
        alt_gids: &[Gid],
        now: Instant,
    ) -> Result<(), StateError> {
        let (ClientState::AwaitLocal { negotiated, server }, false) = (&self.state, self.c.done)
        else {
            return Err(StateError("confirm needs an Accept first"));
        };
        let mtu = if local.mtu.code() < server.endpoint.mtu.code() {
            local.mtu
        } else {
            server.endpoint.mtu
        };
        let mut gids = vec![local.gid];
        gids.extend_from_slice(alt_gids);
        let m = accept_confirm(
            Role::Confirm,
            &self.c.cfg,
            local,
            mtu,
            negotiated,
            server.first_contact,
            Some(gids),
        );
        self.state = ClientState::Confirmed {
            first_contact: server.first_contact,
            at: now,
        };
        self.c.send(&m);
        self.c.finish(Event::Confirmed);
        Ok(())
    }

    /// The first link did not come up (first contact, after [`Client::confirm`]): the server
    /// decides, so listen for its Decline until [`CLC_WAIT_TIME_SHORT`] after the server's own
    /// CONFIRM LINK wait would have ended, then decline `TIMEOUT_CL` ourselves. Ends in
    /// [`Event::Fallback`] (or `Failed` if the TCP connection closed).
    pub fn link_failed(&mut self, now: Instant) -> Result<(), StateError> {
        let ClientState::Confirmed {
            first_contact: true,
            at,
        } = self.state
        else {
            return Err(StateError(
                "link_failed needs a first-contact Confirm first",
            ));
        };
        let until = now.max(at + crate::link::CLIENT_CONFIRM_WAIT) + CLC_WAIT_TIME_SHORT;
        self.state = ClientState::AwaitLinkDecline;
        self.c.await_link_decline(until);
        Ok(())
    }

    /// A client that cannot take part although both sides sent the option (no resources):
    /// a Decline with `reason` instead of a Proposal, as Linux's `smc_connect_decline_fallback`
    /// sends one; ends in [`Event::Fallback`] (ours) once it is out.
    pub fn declining(cfg: Config, reason: DeclineReason, now: Instant) -> Self {
        let mut c = Common::new(cfg, now);
        c.decline(2, reason);
        Self {
            c,
            state: ClientState::AwaitAccept,
        }
    }

    /// Declines after an Accept (no resources, link group not found → `SYNCERR`, …).
    pub fn decline(&mut self, reason: DeclineReason) -> Result<(), StateError> {
        if self.c.done || !matches!(self.state, ClientState::AwaitLocal { .. }) {
            return Err(StateError("the client declines only after an Accept"));
        }
        self.c.decline(2, reason);
        Ok(())
    }
}
