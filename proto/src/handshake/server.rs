//! The server side of the CLC handshake.

#[allow(unused_imports)]
use super::*;

/// The server side of the handshake.
#[derive(Debug)]
pub struct Server {
    pub(super) c: Common,
    pub(super) state: ServerState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// What the server waits for.
pub(super) enum ServerState {
    Proposal,
    LocalDecision {
        negotiated: Negotiated,
        version: u8,
    },
    Confirm {
        negotiated: Negotiated,
        first_contact: bool,
        mtu: QpMtu,
    },
    /// The client confirmed (first contact: the link must come up next).
    Established {
        first_contact: bool,
    },
    /// The first link failed: listening for the client's Decline.
    AwaitLinkDecline,
}

impl Server {
    /// Starts waiting for the client's Proposal on an accepted TCP connection whose SYN
    /// carried the SMC-R option.
    pub fn new(cfg: Config, now: Instant) -> Self {
        let mut c = Common::new(cfg, now);
        c.wait_for(MsgType::Proposal, now);
        Self {
            c,
            state: ServerState::Proposal,
        }
    }

    pub(super) fn on_message(&mut self, m: Message) {
        let expected = match self.state {
            ServerState::Proposal => MsgType::Proposal,
            ServerState::Confirm { .. } => MsgType::Confirm,
            ServerState::AwaitLinkDecline => {
                return match m {
                    Message::Decline(d) => self.c.peer_declined(&d),
                    other => self.c.fail(Error::Unexpected {
                        expected: MsgType::Decline,
                        got: other.msg_type(),
                    }),
                };
            }
            _ => return,
        };
        if let Message::Decline(d) = &m {
            return self.c.peer_declined(d);
        }
        if m.msg_type() != expected {
            return self.c.fail(Error::Unexpected {
                expected,
                got: m.msg_type(),
            });
        }
        match (m, self.state.clone()) {
            (Message::Proposal(p), _) => match self.check_proposal(&p) {
                Ok((negotiated, client_gid)) => {
                    self.c.deadline = None;
                    self.state = ServerState::LocalDecision {
                        negotiated,
                        version: 2,
                    };
                    self.c.events.push_back(Event::Proposed {
                        negotiated,
                        client_gid,
                        client_id: p.peer_id,
                    });
                }
                Err(reason) => {
                    // Linux declines with the Proposal's header version.
                    self.c.decline(p.version.min(2), reason);
                }
            },
            (
                Message::AcceptConfirm(c),
                ServerState::Confirm {
                    negotiated,
                    first_contact,
                    mtu,
                    ..
                },
            ) => match Self::check_confirm(&c, &negotiated, first_contact, mtu) {
                Ok(client) => {
                    self.state = ServerState::Established { first_contact };
                    self.c.finish(Event::Established { negotiated, client });
                }
                Err(reason) => {
                    self.c.decline(2, reason);
                }
            },
            _ => {}
        }
    }

    pub(super) fn on_timeout(&mut self, what: MsgType, now: Instant) {
        match self.state {
            ServerState::AwaitLinkDecline => self.c.decline(2, DeclineReason::TIMEOUT_CL),
            // The client owes a Proposal (or Decline), or a Confirm (or Decline) after our
            // Accept — on a reused link group it may already be writing over RDMA then.
            ServerState::Proposal | ServerState::Confirm { .. } => self.c.owed(what, now),
            _ => self.c.timed_out(what),
        }
    }

    /// The first link did not come up (first contact, after `Established`): listen
    /// [`CLC_WAIT_TIME_SHORT`] for the client's Decline, then decline `TIMEOUT_CL`. Ends in
    /// [`Event::Fallback`] (or `Failed` if the TCP connection closed).
    pub fn link_failed(&mut self, now: Instant) -> Result<(), StateError> {
        if self.state
            != (ServerState::Established {
                first_contact: true,
            })
        {
            return Err(StateError(
                "link_failed needs a first-contact Confirm first",
            ));
        }
        self.state = ServerState::AwaitLinkDecline;
        self.c.await_link_decline(now + CLC_WAIT_TIME_SHORT);
        Ok(())
    }

    /// Linux's server-side choice (`smc_listen_v2_check`, `smc_find_rdma_v2_device_serv`,
    /// `smc_clc_srv_v2x_features_validate`) for a server with SMC-Rv2 only.
    pub(super) fn check_proposal(&self, p: &Proposal) -> Result<(Negotiated, Gid), DeclineReason> {
        let cfg = &self.c.cfg;
        let v2_r = p.version >= 2 && p.typev2.has_r();
        if !v2_r {
            // Only v1 or SMC-D offered: we have no device for either.
            return Err(if p.typev1.has_r() || p.typev2.has_r() {
                DeclineReason::NOSMCRDEV
            } else {
                DeclineReason::NOSMCDEV
            });
        }
        let Some(v2) = &p.v2 else {
            return Err(DeclineReason::NOV2EXT);
        };
        // The first of the client's UEIDs that we share (Linux walks the client's list).
        let eid = v2
            .eids
            .iter()
            .find(|e| cfg.ueids.contains(e))
            .copied()
            .ok_or(DeclineReason::NOUEID)?;
        let release = v2.release.min(cfg.release);
        let mut neg = Negotiated {
            version: 2,
            eid,
            release,
            max_conns: cfg.max_conns,
            max_links: cfg.max_links,
            feature_mask: cfg.feature_mask & v2.feature_mask,
        };
        if release >= 1 {
            neg.max_conns = v2.max_conns.min(cfg.max_conns);
            if neg.max_conns < MIN_CONNS_PER_LGR {
                return Err(DeclineReason::MAXCONNERR);
            }
            neg.max_links = v2.max_links.min(cfg.max_links).min(MAX_LINKS_PER_LGR);
            if neg.max_links < 1 {
                return Err(DeclineReason::MAXLINKERR);
            }
        }
        if v2.roce_gid.to_ipv4().is_none() {
            // SMC-Rv2 is IPv4 only: the client's RoCE v2 GID must be IPv4-mapped.
            return Err(DeclineReason::NOROUTE);
        }
        Ok((neg, v2.roce_gid))
    }

    /// Accepts the Proposal with our endpoint: `first_contact` when a new link group was
    /// created for this client.
    pub fn accept(
        &mut self,
        local: &Endpoint,
        first_contact: bool,
        now: Instant,
    ) -> Result<(), StateError> {
        let (ServerState::LocalDecision { negotiated, .. }, false) =
            (self.state.clone(), self.c.done)
        else {
            return Err(StateError("accept needs an acceptable Proposal first"));
        };
        let m = accept_confirm(
            Role::Accept,
            &self.c.cfg,
            local,
            local.mtu,
            &negotiated,
            first_contact,
            None,
        );
        self.c.send(&m);
        self.c.wait_for(MsgType::Confirm, now);
        self.state = ServerState::Confirm {
            negotiated,
            first_contact,
            mtu: local.mtu,
        };
        Ok(())
    }

    /// Declines after a Proposal (no memory, too many connections, …).
    pub fn decline(&mut self, reason: DeclineReason) -> Result<(), StateError> {
        let (ServerState::LocalDecision { version, .. }, false) = (&self.state, self.c.done) else {
            return Err(StateError("the server declines only after a Proposal"));
        };
        self.c.decline(*version, reason);
        Ok(())
    }

    /// Linux's checks of a Confirm (`smc_clc_v2x_features_confirm_check`).
    pub(super) fn check_confirm(
        c: &AcceptConfirm,
        neg: &Negotiated,
        first_contact: bool,
        our_mtu: QpMtu,
    ) -> Result<PeerInfo, DeclineReason> {
        let (AcceptBody::SmcR(r), 2..) = (&c.body, c.version) else {
            return Err(DeclineReason::MODEUNSUPP);
        };
        if c.first_contact != first_contact {
            return Err(DeclineReason::SYNCERR);
        }
        let v2 = r.v2.as_ref().ok_or(DeclineReason::MODEUNSUPP)?;
        if let Some(fce) = &v2.fce {
            if fce.release != neg.release {
                return Err(DeclineReason::RELEASEERR);
            }
            if neg.release >= 1 {
                if fce.max_conns != neg.max_conns {
                    return Err(DeclineReason::MAXCONNERR);
                }
                if fce.max_links != neg.max_links {
                    return Err(DeclineReason::MAXLINKERR);
                }
            }
        } else if first_contact {
            return Err(DeclineReason::MODEUNSUPP);
        }
        if r.qp_mtu.bytes().is_none() || r.qp_mtu.code() > our_mtu.code() {
            return Err(DeclineReason::ERR_RDYLNK);
        }
        Ok(PeerInfo {
            peer_id: r.peer_id,
            endpoint: endpoint_of(r),
            first_contact,
            hostname: v2.fce.map(|f| f.hostname),
            gids: v2.gids.clone().unwrap_or_default(),
        })
    }
}
