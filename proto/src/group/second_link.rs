//! A link group's second link: ADD LINK both ways, the spare's events, failover onto it
//! and healing (docs/failover.md).

use super::*;

impl<C: Clone> GroupCore<C> {
    /// An event of the spare link.
    pub(super) fn on_spare_event(&mut self, ev: LinkEvent, now: Instant) {
        match ev {
            LinkEvent::Up { .. } => {
                self.spare_up = true;
                self.heal_delay = HEAL_RETRY;
                let ids = |l: &Option<LinkCore>| l.as_ref().map(|l| l.params().link_id);
                let (a, b) = (ids(&self.link), ids(&self.spare));
                if let (Some(l), Some(b)) = (self.link.as_mut(), b) {
                    l.set_group_links(&[b]);
                }
                if let (Some(l), Some(a)) = (self.spare.as_mut(), a) {
                    l.set_group_links(&[a]);
                }
                self.events.push_back(GroupEvent::SpareUp {
                    link_id: b.unwrap_or(0),
                });
            }
            LinkEvent::Down(DownReason::PeerDeletedGroup(r)) => {
                // The whole group, whichever link it came on.
                self.go_down(GroupDown::Link(DownReason::PeerDeletedGroup(r)));
            }
            LinkEvent::Down(r) => {
                let told = matches!(r, DownReason::PeerDeleted(_));
                self.drop_spare(!told, now);
            }
            LinkEvent::RkeyDone { id, ok } => {
                let link_id = self.spare.as_ref().map_or(0, |l| l.params().link_id);
                self.rkey_done(rkey_key(link_id, id), ok);
            }
            LinkEvent::PeerDeletedLink { .. } => {
                // The peer lost the active link and tells us on this one (as Linux does:
                // smc_core.c, `smcr_link_down()`; smc_llc.c, `smc_llc_process_cli_delete_link()`).
                if self.spare_up {
                    self.switch("the peer lost the path".into(), true, now);
                } else {
                    self.go_down(GroupDown::PeerLostPath);
                }
            }
            LinkEvent::PeerAddLink(_) => {
                if let Some(l) = self.spare.as_mut() {
                    l.answer_add_link(None);
                }
            }
            LinkEvent::PeerConfirmedRkey(rkey) => {
                self.events.push_back(GroupEvent::PeerConfirmedRkey {
                    path: 1 - self.active,
                    rkey,
                });
            }
            LinkEvent::PeerDeletedRkeys(rkeys) => {
                self.events.push_back(GroupEvent::PeerDeletedRkeys {
                    path: 1 - self.active,
                    rkeys,
                });
            }
            LinkEvent::AddLinkResult(_) => {}
        }
    }

    /// An rkey flow (`key`) was answered or given up.
    pub(super) fn rkey_done(&mut self, key: u64, ok: bool) {
        if self.rkey_waiting.remove(&key) {
            self.rkey_results.insert(key, ok);
            self.events.push_back(GroupEvent::RkeyDone { key });
        }
    }

    /// Whether this group may run a second link: a second path, two links negotiated, not
    /// through shared memory.
    pub(super) fn can_add_link(&self) -> bool {
        self.paths.len() > 1
            && self.link.as_ref().is_some_and(|l| l.params().max_links > 1)
            && !self.same_host
    }

    /// The active link failed (`why`) and the spare is up: it becomes the active one, and
    /// every connection moves to it. Unless the peer `told` us, DELETE LINK (LOST_PATH) for the
    /// failed link goes out on the new one (smc_core.c, `smcr_link_down()`; the server's via
    /// smc_llc.c, `smc_llc_srv_delete_link_local()`).
    pub(super) fn switch(&mut self, why: String, told: bool, now: Instant) {
        let old = self.active;
        // Nothing more arrives on the failed link, and what was posted on it is flushed.
        self.events.push_back(GroupEvent::PathError(old));
        let old_id = self.link.take().map(|l| l.params().link_id);
        if let Some(id) = old_id {
            // Rkey flows on the failed link get no answer: their waiters try again on the
            // new one.
            let lost: Vec<u64> = self
                .rkey_waiting
                .iter()
                .copied()
                .filter(|k| (k >> 56) as u8 == id)
                .collect();
            for k in lost {
                self.rkey_done(k, false);
            }
        }
        self.link = self.spare.take();
        self.spare_up = false;
        if let Some(l) = self.link.as_mut() {
            l.set_group_links(&[]);
            if let (false, Some(id)) = (told, old_id) {
                l.delete_other_link(id, DeleteLinkReason::LOST_PATH);
            }
        }
        self.active = 1 - old;
        self.epoch = self.epoch.wrapping_add(1);
        self.unmoved = true;
        self.events.push_back(GroupEvent::Failover {
            epoch: self.epoch,
            active: self.active,
            link_id: self.link_id(),
        });
        if self.role == Role::Server {
            self.heal_delay = HEAL_RETRY;
            self.heal_later(now);
        }
        self.last_failover = Some(why);
    }

    /// The spare link is gone (failed, timed out, or deleted by the peer): its queue pair
    /// stops, and a server tries again later. `tell`: DELETE LINK for it to the peer.
    pub(super) fn drop_spare(&mut self, tell: bool, now: Instant) {
        let spare = 1 - self.active;
        if let Some(l) = self.spare.take()
            && tell
            && let Some(a) = self.link.as_mut()
        {
            a.delete_other_link(l.params().link_id, DeleteLinkReason::LOST_PATH);
        }
        self.spare_up = false;
        if let Some(a) = self.link.as_mut() {
            a.set_group_links(&[]);
        }
        if spare < self.paths.len() {
            self.events.push_back(GroupEvent::PathError(spare));
        }
        if self.role == Role::Server {
            self.heal_later(now);
        }
    }

    /// Server: the next try to add a link, after a wait that doubles with each failed one.
    pub(super) fn heal_later(&mut self, now: Instant) {
        self.heal_at = Some(now + self.heal_delay);
        self.heal_delay = (self.heal_delay * 2).min(HEAL_MAX);
    }

    /// The id the next added link gets (not the active one's, never 0; smc_core.c,
    /// `smcr_next_link_id()`).
    pub(super) fn next_id(&self) -> u8 {
        let mut id = self.next_link_id;
        if id == self.link_id() || id == 0 {
            id = id.wrapping_add(1).max(1);
        }
        id
    }

    /// Server: time to ask the client for a link over the other path.
    pub(super) fn add_link(&mut self) {
        self.heal_at = None;
        if !self.can_add_link() || self.spare.is_some() || !self.up {
            return;
        }
        self.events.push_back(GroupEvent::PrepareAddLink {
            path: 1 - self.active,
            link_id: self.next_id(),
        });
    }

    /// Server: our ADD LINK for [`GroupEvent::PrepareAddLink`] (the path is set up): it goes
    /// out on the active link (smc_llc.c, `smc_llc_srv_add_link()`).
    pub fn add_link_request(&mut self, req: AddLink, now: Instant) {
        self.next_link_id = req.link_id.wrapping_add(1).max(1);
        if !self.link.as_mut().is_some_and(|l| l.add_link(req, now)) {
            self.heal_later(now);
        }
        self.collect();
    }

    /// Server: [`GroupEvent::PrepareAddLink`] could not be done (the path could not be set up,
    /// too many rkeys): try again later.
    pub fn add_link_failed(&mut self, now: Instant) {
        self.heal_later(now);
    }

    /// Server: the client's answer to our ADD LINK.
    pub(super) fn add_link_result(&mut self, res: Result<AddLink, AddLinkRefused>, now: Instant) {
        match res {
            Ok(resp) => self.events.push_back(GroupEvent::ConnectAdded {
                path: 1 - self.active,
                resp,
            }),
            // Linux's server drops the new link then (`smc_llc_srv_add_link()`).
            Err(_) => self.heal_later(now),
        }
    }

    /// The parameters of a link added on `path` with `link_id` (the rest as the active one's).
    pub(super) fn added_params(&self, path: usize, link_id: u8) -> Option<LinkParams> {
        let ids = self.paths.get(path)?;
        let base = *self.link.as_ref()?.params();
        Some(LinkParams {
            gid: ids.gid,
            qpn: ids.qpn,
            link_id,
            ..base
        })
    }

    /// Server: the path of [`GroupEvent::ConnectAdded`] is connected (`ok`) or could not be:
    /// the new link (`link_id`) confirms itself, or the client is told it is gone.
    pub fn added_link_connected(&mut self, path: usize, link_id: u8, ok: bool, now: Instant) {
        match self.added_params(path, link_id) {
            Some(params) if ok => {
                self.spare = Some(LinkCore::new_added(params, now));
                self.confirming_spare(link_id);
            }
            _ => {
                // As Linux's server when the new link does not come up (smc_llc.c,
                // `smc_llc_srv_conf_link()`: DELETE LINK, LOST_PATH, on the old link).
                if let Some(l) = self.link.as_mut() {
                    l.delete_other_link(link_id, DeleteLinkReason::LOST_PATH);
                }
                self.heal_later(now);
            }
        }
        self.collect();
    }

    /// A spare link (`link_id`) is confirming: the peer may delete it over the active link
    /// before it comes up (its side could not be set up), as Linux's
    /// `smc_llc_process_cli_delete_link` finds a link that is still activating.
    pub(super) fn confirming_spare(&mut self, link_id: u8) {
        if let Some(l) = self.link.as_mut() {
            l.set_group_links(&[link_id]);
        }
    }

    /// Client: our answer to [`GroupEvent::AnswerAddLink`]: the response for our new link on
    /// `path` (set up and connected), or `None` to reject the request (smc_llc.c,
    /// `smc_llc_cli_add_link()`).
    pub fn answer_add_link(&mut self, path: usize, resp: Option<AddLink>, now: Instant) {
        let params = resp
            .as_ref()
            .and_then(|r| self.added_params(path, r.link_id));
        let Some(l) = self.link.as_mut() else {
            return;
        };
        match (resp, params) {
            (Some(resp), Some(params)) => {
                l.answer_add_link(Some(resp));
                let mut added = LinkCore::new_added(params, now);
                // Once it is the active link (after a failover), it takes the next ADD LINK.
                added.set_accept_add_link(true);
                let link_id = added.params().link_id;
                self.spare = Some(added);
                self.confirming_spare(link_id);
            }
            _ => {
                l.answer_add_link(None);
            }
        }
        self.collect();
    }
}
