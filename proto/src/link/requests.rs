//! The LLC requests a link makes and answers for its group: CONFIRM/DELETE RKEY (one at a
//! time, the rest queued), ADD LINK (asked, accepted, refused), DELETE LINK of another link.

use super::*;

impl LinkCore {
    /// Announces a new RMB (`rkey`, `vaddr`) to the peer with CONFIRM RKEY, as Linux does for
    /// every RMB of a connection on an existing link group (af_smc.c, `smcr_lgr_reg_rmbs()`;
    /// smc_llc.c, `smc_llc_do_confirm_rkey()`); [`LinkEvent::RkeyDone`] with the returned id
    /// follows.
    pub fn confirm_rkey(&mut self, rkey: u32, vaddr: u64, now: Instant) -> u64 {
        let tok = llc::Rtoken {
            link_id: 0,
            rkey,
            vaddr,
        };
        self.rkey_request(
            Llc::ConfirmRkey(ConfirmRkey {
                response: false,
                negative: false,
                retry: false,
                num_additional: 0,
                rtokens: [tok, llc::Rtoken::default(), llc::Rtoken::default()],
            }),
            now,
        )
    }

    /// Withdraws an RMB's `rkey` (its connection is gone) with DELETE RKEY.
    pub fn delete_rkey(&mut self, rkey: u32, now: Instant) -> u64 {
        self.rkey_request(
            Llc::DeleteRkey(DeleteRkey {
                response: false,
                negative: false,
                errors: 0,
                rkeys: vec![rkey],
            }),
            now,
        )
    }

    /// Rkey requests queued or awaiting an answer: each is answered, or given up after
    /// [`LLC_WAIT`] from when it is sent, one after the other.
    pub fn rkey_backlog(&self) -> usize {
        self.rkey_queue.len() + usize::from(self.rkey_outstanding.is_some())
    }

    pub(super) fn rkey_request(&mut self, body: Llc, now: Instant) -> u64 {
        let id = self.next_rkey_id;
        self.next_rkey_id += 1;
        if self.state != LinkState::Active {
            self.events.push_back(LinkEvent::RkeyDone { id, ok: false });
            return id;
        }
        self.rkey_queue.push_back((id, body));
        if self.rkey_outstanding.is_none() {
            self.next_rkey(now);
        }
        id
    }

    pub(super) fn next_rkey(&mut self, now: Instant) {
        if let Some((id, body)) = self.rkey_queue.pop_front() {
            let confirm = matches!(body, Llc::ConfirmRkey(_));
            self.rkey_outstanding = Some((id, now, confirm));
            self.send(body);
        }
    }

    pub(super) fn rkey_answered(&mut self, confirm: bool, ok: bool, now: Instant) {
        match self.rkey_outstanding {
            Some((id, _, c)) if c == confirm => {
                self.rkey_outstanding = None;
                self.events.push_back(LinkEvent::RkeyDone { id, ok });
                self.next_rkey(now);
            }
            _ => self.stats.dropped += 1,
        }
    }

    /// Announces a new RMB on a group with several links: `rkey`/`vaddr` for this link, and
    /// `{link id, rkey, vaddr}` for each other active link (Linux: at most two more; smc_llc.c,
    /// `smc_llc_send_confirm_rkey()`).
    pub fn confirm_rkey_links(
        &mut self,
        rkey: u32,
        vaddr: u64,
        others: &[llc::Rtoken],
        now: Instant,
    ) -> u64 {
        let mut rtokens = [llc::Rtoken::default(); 3];
        rtokens[0] = llc::Rtoken {
            link_id: 0,
            rkey,
            vaddr,
        };
        for (slot, t) in rtokens[1..].iter_mut().zip(others) {
            *slot = *t;
        }
        self.rkey_request(
            Llc::ConfirmRkey(ConfirmRkey {
                response: false,
                negative: false,
                retry: false,
                num_additional: others.len().min(2) as u8,
                rtokens,
            }),
            now,
        )
    }

    /// Server: asks the client to add a link (`req`: our new QP's MAC, GID, QPN, link id, MTU,
    /// PSN, and the v2 extension with every RMB's rkeys); [`LinkEvent::AddLinkResult`] follows.
    /// Refused (false) unless the link is active and no other ADD LINK is running (one flow at
    /// a time, as Linux: smc_llc.c, `smc_llc_flow_start()`).
    pub fn add_link(&mut self, req: AddLink, now: Instant) -> bool {
        if self.p.role != Role::Server
            || self.state != LinkState::Active
            || self.add_link_sent.is_some()
        {
            return false;
        }
        self.add_link_sent = Some((req.link_id, now));
        self.send(Llc::AddLink(AddLink {
            response: false,
            reject: false,
            reject_reason: 0,
            ..req
        }));
        true
    }

    /// Client: whether an ADD LINK request may be handed to the driver (it has an alternate
    /// path); otherwise requests are rejected at once. Linux's client (smc_llc.c,
    /// `smc_llc_cli_add_link()`) rejects only when neither side has a second device; with one
    /// device of its own it builds an asymmetric link on it instead.
    pub fn set_accept_add_link(&mut self, on: bool) {
        self.accept_add_link = on;
    }

    /// Client: answers the ADD LINK request of [`LinkEvent::PeerAddLink`]: our new link's
    /// response (MAC, GID, QPN, MTU, PSN, our rkeys), or `None` to reject it.
    pub fn answer_add_link(&mut self, resp: Option<AddLink>) -> bool {
        let Some(req) = self.add_link_asked.take() else {
            return false;
        };
        match resp {
            Some(r) => self.send(Llc::AddLink(AddLink {
                response: true,
                reject: false,
                reject_reason: 0,
                link_id: req.link_id,
                ..r
            })),
            None => self.reject_add_link(req),
        }
        true
    }

    pub(super) fn reject_add_link(&mut self, req: AddLink) {
        // The request sent back with the reject flag, as smc_llc.c,
        // `smc_llc_cli_add_link_reject()`; Linux also sets reason NO_ALT_PATH (1), which only a
        // v1 header keeps (v2 writes the length over it).
        self.stats.add_links_rejected += 1;
        self.send(Llc::AddLink(AddLink {
            response: true,
            reject: true,
            reject_reason: 0,
            v2: None,
            ..req
        }));
    }

    /// The group's other links, whose DELETE LINK arrives on this one.
    pub fn set_group_links(&mut self, ids: &[u8]) {
        self.group_links = ids.to_vec();
    }

    /// Tells the peer that another link of the group (`link_id`) is gone (DELETE LINK, orderly,
    /// not ALL, as Linux sends it on the surviving link: smc_core.c, `smcr_link_down()`).
    pub fn delete_other_link(&mut self, link_id: u8, reason: DeleteLinkReason) {
        self.group_links.retain(|&l| l != link_id);
        self.send(Llc::DeleteLink(DeleteLink {
            response: false,
            all: false,
            orderly: true,
            link_id,
            reason,
        }));
    }
}
