//! A link group's state machine, sans-IO: its links' LLC conversations ([`LinkCore`], one on
//! the active path and a spare on the other), its bookkeeping ([`LgrCore`]: connections, SEND
//! slots, linger), the server's healing with backoff, the failover epoch, the rkey flows
//! someone waits for, and the LLC messages queued for sending with the path each goes on.
//!
//! The driver (`runtime`) holds it under the group's lock. It feeds what arrives
//! ([`GroupCore::handle_llc`], [`GroupCore::note_activity`], [`GroupCore::transport_failed`])
//! and the time ([`GroupCore::handle_timeout`], due at [`GroupCore::poll_timeout`]); it sends
//! what [`GroupCore::poll_transmit`] gives as RDMA SENDs on the path named, and acts on
//! [`GroupCore::poll_event`]: queue pairs to stop or to connect, a failover to publish, the
//! group down with a typed reason. Three events need an answer from the driver, because only
//! it can set a queue pair up and knows the RMBs' keys: [`GroupEvent::PrepareAddLink`] →
//! [`GroupCore::add_link_request`] (or [`GroupCore::add_link_failed`]),
//! [`GroupEvent::ConnectAdded`] → [`GroupCore::added_link_connected`], and
//! [`GroupEvent::AnswerAddLink`] → [`GroupCore::answer_add_link`]. No locks, threads, sockets
//! or clocks inside: the tests run two groups over an in-memory fabric with a virtual clock.
//!
//! Paths are numbered alike on both ends: path 0 carries the first link (the CLC handshake's
//! QPs), path 1 the link added over the alternate addresses; each end's path `i` talks to the
//! peer's path `i`.
//!
//! Behaviour followed (RFC 7609 on link groups, adding links and failover; Linux's
//! net/smc/smc_llc.c and smc_core.c, named per rule):
//! * the server adds a link over the other path once the first one is up (af_smc.c,
//!   `smcr_serv_conf_first_link` → `smc_llc_srv_add_link`), and again after each loss, here
//!   after [`HEAL_RETRY`] doubling to [`HEAL_MAX`] (Linux tries at once after a deletion,
//!   `smc_llc_process_srv_delete_link`, on its one remaining device if need be, and on a port
//!   event, `smcr_port_add`, which has no counterpart here);
//! * the end that finds the active link dead moves its connections to the other one and sends
//!   DELETE LINK (LOST_PATH) for it there (`smcr_link_down`, `smc_llc_srv_delete_link_local`);
//!   the end that receives it moves too (`smc_llc_process_cli_delete_link`);
//! * a group without connections for the linger time is deleted with DELETE LINK (ALL,
//!   PROG_INIT_TERM), as Linux's free-delay timer does (`smc_lgr_free_work`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use clc::Gid;
use llc::{AddLink, ConfirmRkey, DeleteLinkReason, LlcMessage, Rtoken};

use crate::lgr::LgrCore;
use crate::link::{self, AddLinkRefused, DownReason, LinkCore, LinkEvent, LinkParams, Role};

mod second_link;

/// How long a server waits after a link failed before it tries to add one again. Linux tries
/// at once (smc_llc.c, `smc_llc_process_srv_delete_link()`), building an asymmetric link on
/// its remaining device if it must, then again on a port event (smc_core.c,
/// `smcr_port_add()`); we build no asymmetric links and see no port events. Each try that
/// fails (the path still down, the client refusing) doubles the wait, up to [`HEAL_MAX`].
pub const HEAL_RETRY: Duration = Duration::from_secs(3);
/// See [`HEAL_RETRY`].
pub const HEAL_MAX: Duration = Duration::from_secs(30);

/// Why a group went down.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupDown {
    /// Its last link went down (no spare to fail over to).
    #[error("link down: {0}")]
    Link(DownReason),
    /// The peer told us (on the spare) that it lost the active link, and the spare was not up.
    #[error("link down: the peer lost the path")]
    PeerLostPath,
    /// A new group's first link did not come up in time (client: the server never confirmed
    /// it).
    #[error("the first link did not come up")]
    FirstLinkNotUp,
    /// The first link's queue pair could not be connected.
    #[error("starting the link: {0}")]
    Start(String),
    /// The completion queue failed under the group.
    #[error("completion queue: {0}")]
    CompletionQueue(String),
    /// A new group's first connection was declined before its link came up (no buffer for
    /// it): the group has nothing to carry.
    #[error("its first connection was declined before the link came up")]
    Declined,
}

impl GroupDown {
    /// An orderly end (a program or operator ended the group, ours or the peer's: linger,
    /// exit, terminate), not a failure.
    pub fn orderly(&self) -> bool {
        let ended = |r: &DeleteLinkReason| {
            matches!(
                *r,
                DeleteLinkReason::PROG_INIT_TERM | DeleteLinkReason::OP_INIT_TERM
            )
        };
        match self {
            Self::Link(
                DownReason::PeerDeleted(r) | DownReason::PeerDeletedGroup(r) | DownReason::Local(r),
            ) => ended(r),
            Self::Declined => true,
            _ => false,
        }
    }
}

/// Why [`GroupCore::confirm_rkey`] could not start a flow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RkeyError {
    /// The group has no link yet (not started).
    #[error("link not started")]
    NoLink,
    /// The group is down.
    #[error("{0}")]
    Down(GroupDown),
}

/// Our side of one path: what an added link on it announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathIds {
    /// Our GID on the path (its source address).
    pub gid: Gid,
    /// Our queue pair on the path.
    pub qpn: u32,
}

/// What the driver must act on, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    /// The first link is confirmed (`link_id`): the group takes connections.
    Up {
        /// Its link id.
        link_id: u8,
    },
    /// A link added over the other path is confirmed: the group can fail over to it.
    SpareUp {
        /// Its link id.
        link_id: u8,
    },
    /// An rkey flow ended (see [`GroupCore::take_rkey_result`]): wake whoever waits.
    RkeyDone {
        /// The flow's key.
        key: u64,
    },
    /// The peer announced a new RMB's rkeys on `path` (already answered).
    PeerConfirmedRkey {
        /// Where it arrived.
        path: usize,
        /// Its rtokens.
        rkey: ConfirmRkey,
    },
    /// The peer withdrew rkeys on `path` (already answered).
    PeerDeletedRkeys {
        /// Where it arrived.
        path: usize,
        /// The keys.
        rkeys: Vec<u32>,
    },
    /// Stop `path`'s queue pair (error state: what was posted on it is flushed).
    PathError(usize),
    /// Server: a link should be added on `path` with `link_id`. Set the path up anew (reset,
    /// receives posted) and call [`GroupCore::add_link_request`] with our ADD LINK, or
    /// [`GroupCore::add_link_failed`].
    PrepareAddLink {
        /// The path.
        path: usize,
        /// The new link's id.
        link_id: u8,
    },
    /// Server: the client answered our ADD LINK with `resp`: connect `path` to its queue pair
    /// (and learn its rkeys), then call [`GroupCore::added_link_connected`].
    ConnectAdded {
        /// The path.
        path: usize,
        /// The client's response.
        resp: AddLink,
    },
    /// Client: the server asks for a link over `path` (`req`): set the path up and connect it,
    /// then call [`GroupCore::answer_add_link`] with our response, or `None` to reject.
    AnswerAddLink {
        /// The path.
        path: usize,
        /// The server's request.
        req: AddLink,
    },
    /// The active link failed and the spare took over: connections move to `active` (their
    /// epoch is older than `epoch`).
    Failover {
        /// The new failover epoch.
        epoch: u32,
        /// The new active path.
        active: usize,
        /// Its link id.
        link_id: u8,
    },
    /// The group is down: fail its connections.
    Down(GroupDown),
}

/// The state machine of one link group; `C` is the driver's connection handle.
#[derive(Debug)]
pub struct GroupCore<C> {
    role: Role,
    paths: Vec<PathIds>,
    /// The group moves data through shared memory: it keeps one link.
    same_host: bool,
    active: usize,
    epoch: u32,
    /// The LLC of the active path's link.
    link: Option<LinkCore>,
    /// The LLC of the other path's link, while one is being added or stands by. Two links at
    /// most, as Linux negotiates (`SMC_LINKS_ADD_LNK_MAX`, smc_core.h); its
    /// `SMC_LINKS_PER_LGR_MAX` (3) also holds an asymmetric link, which we never build.
    spare: Option<LinkCore>,
    /// The spare link is confirmed: the active one may fail over to it.
    spare_up: bool,
    /// Server: when to try adding a link over the other path.
    heal_at: Option<Instant>,
    /// Server: the wait before the next try after this one fails.
    heal_delay: Duration,
    /// Server: the link id the next added link gets.
    next_link_id: u8,
    up: bool,
    down: Option<GroupDown>,
    /// We deleted the group ourselves (DELETE LINK sent): what was posted before it still
    /// goes out, so the active queue pair is not stopped at once.
    orderly: bool,
    /// Why the last failover happened (diagnostics).
    last_failover: Option<String>,
    /// A failover happened and connections may still have to move.
    unmoved: bool,
    /// Rkey flows someone waits for, and their outcomes.
    rkey_waiting: HashSet<u64>,
    rkey_results: HashMap<u64, bool>,
    /// LLC messages to send, with their path.
    llc_out: VecDeque<(usize, LlcMessage)>,
    events: VecDeque<GroupEvent>,
    /// Connections by token, promised tokens, SEND slots, linger.
    pub conns: LgrCore<C>,
}

/// The key of rkey flow `id` of link `link_id` (each link numbers its flows from 1).
pub fn rkey_key(link_id: u8, id: u64) -> u64 {
    u64::from(link_id) << 56 | (id & ((1 << 56) - 1))
}

impl<C: Clone> GroupCore<C> {
    /// A group of `role` over `paths` (one, or two with an alternate address), with `conns`
    /// for its bookkeeping. It has no link until [`GroupCore::start`].
    pub fn new(role: Role, paths: Vec<PathIds>, conns: LgrCore<C>) -> Self {
        Self {
            role,
            paths,
            same_host: false,
            active: 0,
            epoch: 0,
            link: None,
            spare: None,
            spare_up: false,
            heal_at: None,
            heal_delay: HEAL_RETRY,
            next_link_id: 2,
            up: false,
            down: None,
            orderly: false,
            last_failover: None,
            unmoved: false,
            rkey_waiting: HashSet::new(),
            rkey_results: HashMap::new(),
            llc_out: VecDeque::new(),
            events: VecDeque::new(),
            conns,
        }
    }

    /// Starts the first link on path 0 (the server queues CONFIRM LINK).
    pub fn start(&mut self, params: LinkParams, now: Instant) {
        let mut l = LinkCore::new(params, now);
        // A client with a second path takes the server's ADD LINK.
        l.set_accept_add_link(self.paths.len() > 1 && params.max_links > 1);
        self.link = Some(l);
        self.conns.set_max_conns(usize::from(params.max_conns));
        self.collect();
    }

    /// The group moves data through shared memory from now on: no second link.
    pub fn set_same_host(&mut self) {
        self.same_host = true;
    }

    /// The first link came up and the group is neither down nor deleted.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Why the group is down, once it is.
    pub fn down(&self) -> Option<&GroupDown> {
        self.down.as_ref()
    }

    /// Whether we deleted the group ourselves (DELETE LINK sent).
    pub fn orderly(&self) -> bool {
        self.orderly
    }

    /// Whether the spare link is confirmed.
    pub fn spare_up(&self) -> bool {
        self.spare_up
    }

    /// Usable links: 1, or 2 while the spare is confirmed; 0 when not up.
    pub fn links(&self) -> usize {
        if !self.up || self.down.is_some() {
            return 0;
        }
        1 + usize::from(self.spare_up)
    }

    /// The failover epoch and the active path.
    pub fn route(&self) -> (u32, usize) {
        (self.epoch, self.active)
    }

    /// Why the last failover happened.
    pub fn last_failover(&self) -> Option<&str> {
        self.last_failover.as_deref()
    }

    /// The active link's counters (`None` before the group started).
    pub fn link_stats(&self) -> Option<crate::link::LinkStats> {
        self.link.as_ref().map(|l| l.stats())
    }

    /// The active link's id (0 before the group started).
    pub fn link_id(&self) -> u8 {
        self.link.as_ref().map_or(0, |l| l.params().link_id)
    }

    /// The active link's parameters.
    pub fn link_params(&self) -> Option<&LinkParams> {
        self.link.as_ref().map(LinkCore::params)
    }

    /// The path of our link `link_id`, if it is one of the group's.
    pub fn path_of_link(&self, link_id: u8) -> Option<usize> {
        let is = |l: &Option<LinkCore>| l.as_ref().is_some_and(|l| l.params().link_id == link_id);
        if is(&self.link) {
            Some(self.active)
        } else if is(&self.spare) {
            Some(1 - self.active)
        } else {
            None
        }
    }

    /// Takes the "connections may still have to move" mark of a failover.
    pub fn take_unmoved(&mut self) -> bool {
        std::mem::take(&mut self.unmoved)
    }

    /// Some connections could not move yet: try again at the next completion.
    pub fn set_unmoved(&mut self) {
        self.unmoved = true;
    }

    fn link_on(&mut self, path: usize) -> Option<&mut LinkCore> {
        if path == self.active {
            self.link.as_mut()
        } else {
            self.spare.as_mut()
        }
    }

    /// An LLC message (a SEND that is not a CDC) arrived on `path`.
    pub fn handle_llc(&mut self, path: usize, bytes: &[u8], now: Instant) {
        if let Some(l) = self.link_on(path) {
            l.handle_llc(bytes, now);
        }
    }

    /// A malformed CDC arrived: a protocol violation on the active link.
    pub fn bad_cdc(&mut self, now: Instant) {
        if let Some(l) = self.link.as_mut() {
            l.handle_llc(&[], now);
        }
    }

    /// Other traffic (a CDC) arrived on `path`: the link is alive.
    pub fn note_activity(&mut self, path: usize, now: Instant) {
        if let Some(l) = self.link_on(path) {
            l.note_activity(now);
        }
    }

    /// Whether `path` carries a link that is not down (a failed work request there matters).
    pub fn is_live(&self, path: usize) -> bool {
        let l = if path == self.active {
            &self.link
        } else {
            &self.spare
        };
        l.as_ref()
            .is_some_and(|l| l.state() != link::LinkState::Down)
    }

    /// A work request on `path` failed (`cause`): its link is down (as smc_wr.c,
    /// `smc_wr_tx_process_cqe()` and `smc_wr_rx_process_cqes()` → `smcr_link_down_cond_sched()`).
    pub fn transport_failed(&mut self, path: usize, cause: &str) {
        if let Some(l) = self.link_on(path)
            && l.state() != link::LinkState::Down
        {
            l.transport_failed(cause);
        }
    }

    /// Checks the active link now with a TEST LINK (a connection's TCP socket hung up).
    pub fn probe(&mut self, now: Instant) {
        if let Some(l) = self.link.as_mut() {
            l.probe(now);
        }
        self.collect();
    }

    /// Deletes the group (DELETE LINK ALL, PROG_INIT_TERM): no new connection may pick it (as
    /// smc_core.c, `smc_lgr_free_work()`).
    pub fn terminate(&mut self) {
        self.up = false;
        if let Some(l) = self.link.as_mut() {
            l.delete(DeleteLinkReason::PROG_INIT_TERM, true);
        }
        self.collect();
    }

    /// The driver failed the group (`why`, kept if it was already down): not up any more.
    pub fn fail(&mut self, why: GroupDown) -> &GroupDown {
        self.up = false;
        self.down.get_or_insert(why)
    }

    /// Announces an RMB (CONFIRM RKEY on the active link, with the spare's rtoken when it is
    /// up, as smc_llc.c, `smc_llc_send_confirm_rkey()`). Returns the flow's key (see
    /// [`GroupCore::take_rkey_result`]) and how many flows are ahead of it.
    pub fn confirm_rkey(
        &mut self,
        rkey: u32,
        vaddr: u64,
        now: Instant,
    ) -> Result<(u64, u32), RkeyError> {
        if let Some(d) = &self.down {
            return Err(RkeyError::Down(d.clone()));
        }
        let spare = self
            .spare
            .as_ref()
            .filter(|_| self.spare_up)
            .map(|l| l.params().link_id);
        let l = self.link.as_mut().ok_or(RkeyError::NoLink)?;
        let id = match spare {
            // Both links: the same key and address on the other one (one protection domain).
            Some(link_id) => l.confirm_rkey_links(
                rkey,
                vaddr,
                &[Rtoken {
                    link_id,
                    rkey,
                    vaddr,
                }],
                now,
            ),
            None => l.confirm_rkey(rkey, vaddr, now),
        };
        let key = rkey_key(l.params().link_id, id);
        let backlog = l.rkey_backlog() as u32;
        self.rkey_waiting.insert(key);
        self.collect();
        Ok((key, backlog))
    }

    /// Withdraws an RMB's rkey (DELETE RKEY, not waited for; Linux waits, smc_core.c,
    /// `smcr_buf_unuse()` → `smc_llc_do_delete_rkey()`). False without a link.
    pub fn delete_rkey(&mut self, rkey: u32, now: Instant) -> bool {
        let Some(l) = self.link.as_mut() else {
            return false;
        };
        l.delete_rkey(rkey, now);
        self.collect();
        true
    }

    /// The outcome of rkey flow `key`, once it ended (taken).
    pub fn take_rkey_result(&mut self, key: u64) -> Option<bool> {
        self.rkey_results.remove(&key)
    }

    /// Nobody waits for flow `key` any more.
    pub fn forget_rkey(&mut self, key: u64) {
        self.rkey_waiting.remove(&key);
    }

    /// Whether an LLC message waits to be sent.
    pub fn has_transmit(&self) -> bool {
        !self.llc_out.is_empty()
    }

    /// The next LLC message to send, and the path it goes on.
    pub fn poll_transmit(&mut self) -> Option<(usize, LlcMessage)> {
        self.llc_out.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<GroupEvent> {
        self.events.pop_front()
    }

    /// When [`GroupCore::handle_timeout`] is due next: the links' timers, the linger and the
    /// next try to add a link.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.down.is_some() {
            return None;
        }
        [
            self.link.as_ref().and_then(LinkCore::poll_timeout),
            self.spare.as_ref().and_then(LinkCore::poll_timeout),
            self.conns.linger_deadline(),
            self.heal_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs the timers and handles what the links reported: the linger, both links' timers
    /// and events (a failover, an added link, the group down), the next try to add a link.
    /// Call after feeding received messages too.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.conns.linger_expired(now)
            && let Some(l) = self.link.as_mut()
        {
            // Nobody used the group for the linger time: delete it (Linux: the free-delay
            // timer, smc_core.c, `smc_lgr_free_work()`, DELETE LINK ALL with PROG_INIT_TERM).
            l.delete(DeleteLinkReason::PROG_INIT_TERM, true);
        }
        for l in [self.link.as_mut(), self.spare.as_mut()]
            .into_iter()
            .flatten()
        {
            l.handle_timeout(now);
        }
        // Queued before the events: a link dropped by one still sends what it had.
        self.collect();
        loop {
            if let Some(ev) = self.link.as_mut().and_then(LinkCore::poll_event) {
                self.on_link_event(ev, now);
            } else if let Some(ev) = self.spare.as_mut().and_then(LinkCore::poll_event) {
                self.on_spare_event(ev, now);
            } else {
                break;
            }
            self.collect();
        }
        if self.role == Role::Server
            && self.heal_at.is_some_and(|t| t <= now)
            && self.down.is_none()
        {
            self.add_link();
        }
    }

    /// Moves what both links' LLC queued to the send queue, each with its path.
    fn collect(&mut self) {
        let active = self.active;
        if let Some(l) = self.link.as_mut() {
            while let Some(m) = l.poll_transmit() {
                self.llc_out.push_back((active, m));
            }
        }
        if let Some(l) = self.spare.as_mut() {
            while let Some(m) = l.poll_transmit() {
                self.llc_out.push_back((1 - active, m));
            }
        }
    }

    fn go_down(&mut self, why: GroupDown) {
        if self.down.is_none() {
            self.down = Some(why.clone());
            self.events.push_back(GroupEvent::Down(why));
        }
    }

    /// An event of the active link.
    fn on_link_event(&mut self, ev: LinkEvent, now: Instant) {
        match ev {
            LinkEvent::Up { .. } => {
                self.up = true;
                self.events.push_back(GroupEvent::Up {
                    link_id: self.link_id(),
                });
                // Linux's server tries a second link right after the first (af_smc.c,
                // `smcr_serv_conf_first_link()`).
                if self.role == Role::Server && self.can_add_link() {
                    self.heal_at = Some(now);
                }
            }
            LinkEvent::Down(r) => {
                let lost = matches!(
                    r,
                    DownReason::Transport(_)
                        | DownReason::TestLinkTimeout(_)
                        | DownReason::PeerDeleted(DeleteLinkReason::LOST_PATH)
                );
                // smc_core.c, `smcr_link_down()`: connections move to a surviving link
                // (`smc_switch_conns()`); without one the group ends (`smc_lgr_terminate_sched()`).
                if lost && self.spare_up && !self.orderly {
                    self.switch(r.to_string(), false, now);
                } else {
                    self.orderly = matches!(r, DownReason::Local(_));
                    self.go_down(GroupDown::Link(r));
                }
            }
            LinkEvent::RkeyDone { id, ok } => {
                let key = rkey_key(self.link_id(), id);
                self.rkey_done(key, ok);
            }
            LinkEvent::PeerConfirmedRkey(rkey) => {
                self.events.push_back(GroupEvent::PeerConfirmedRkey {
                    path: self.active,
                    rkey,
                });
            }
            LinkEvent::PeerDeletedRkeys(rkeys) => {
                self.events.push_back(GroupEvent::PeerDeletedRkeys {
                    path: self.active,
                    rkeys,
                });
            }
            LinkEvent::PeerAddLink(req) => {
                // Client: smc_llc.c, `smc_llc_cli_add_link()`.
                if self.can_add_link() && self.spare.is_none() && self.up {
                    self.events.push_back(GroupEvent::AnswerAddLink {
                        path: 1 - self.active,
                        req,
                    });
                } else if let Some(l) = self.link.as_mut() {
                    l.answer_add_link(None);
                }
            }
            LinkEvent::AddLinkResult(res) => self.add_link_result(res, now),
            LinkEvent::PeerDeletedLink { link_id, .. } => {
                // The peer gave up the spare link (already answered).
                if self
                    .spare
                    .as_ref()
                    .is_some_and(|l| l.params().link_id == link_id)
                {
                    self.drop_spare(false, now);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
