//! One SMC-R link's LLC conversation, sans-IO: CONFIRM LINK on first contact, keepalive with
//! TEST LINK, the answers a Linux peer expects (ADD LINK rejected when we have no second path,
//! CONFIRM/DELETE RKEY acknowledged), and DELETE LINK on teardown.
//!
//! For groups of two links (failover, not yet driven by the runtime, which keeps one link per
//! group): the server's ADD LINK request with every RMB's rkeys and its 2 s answer wait
//! ([`LinkCore::add_link`], byte-identical to Linux's), the client handing a usable request to
//! its driver and answering it ([`LinkCore::answer_add_link`]), CONFIRM LINK on the added link
//! with Linux's 5 s wait ([`LinkCore::new_added`]), CONFIRM RKEY with the other link's rtoken,
//! and DELETE LINK for one link of the group, sent and answered as Linux does.
//!
//! The driver feeds received LLC SEND payloads to [`LinkCore::handle_llc`], reports other
//! traffic (CDC) with [`LinkCore::note_activity`], sends what [`LinkCore::poll_transmit`] gives
//! as RDMA SENDs, and acts on [`LinkCore::poll_event`]. Time is a parameter.
//!
//! Linux's behaviour followed (net/smc/smc_llc.c, and the reference capture): the server sends
//! the CONFIRM LINK request (flags 0x03) right after the CLC Confirm (af_smc.c,
//! `smcr_serv_conf_first_link()`) and the client answers (`smcr_clnt_conf_first_link()`) with
//! its own MAC/GID/QPN and the server's link id, link uid and limits; both wait up to
//! [`CONFIRM_WAIT`]. Responses echo the request (ADD LINK reject: request fields with flags
//! 0xC0 and no v2 extension; CONFIRM RKEY: the rtokens; DELETE RKEY: the count, keys zeroed;
//! TEST LINK: the user data). An unknown LLC type is dropped, as Linux does; any other
//! malformed LLC message is a protocol violation that takes the link down.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use clc::{Gid, Mac};
use llc::{
    AddLink, ConfirmLink, ConfirmRkey, DeleteLink, DeleteLinkReason, DeleteRkey, Llc, LlcMessage,
    RequestAddLink, TestLink, Version,
};

mod requests;

/// How long the server waits for the client's CONFIRM LINK response (`SMC_LLC_WAIT_TIME`, 2 s,
/// smc_llc.h; af_smc.c, `smcr_serv_conf_first_link()`).
pub const CONFIRM_WAIT: Duration = Duration::from_secs(2);
/// How long the client waits for the server's CONFIRM LINK request: twice the server's wait, as
/// current Linux does (`2 * SMC_LLC_WAIT_TIME` in af_smc.c, `smcr_clnt_conf_first_link()`), so
/// a server that gives up has declined on the TCP connection before the client looks there
/// (the server decides; no crossed Declines).
pub const CLIENT_CONFIRM_WAIT: Duration = Duration::from_secs(4);
/// How long a TEST LINK request may go unanswered (`SMC_LLC_WAIT_TIME`: smc_llc.c,
/// `smc_llc_testlink_work()`); also the wait for an ADD LINK or rkey answer.
pub const LLC_WAIT: Duration = Duration::from_secs(2);
/// How long both sides wait for CONFIRM LINK on a link added to a group
/// (`SMC_LLC_WAIT_FIRST_TIME`, 5 s: smc_llc.c, `smc_llc_srv_conf_link()`,
/// `smc_llc_cli_conf_link()`).
pub const ADDED_CONFIRM_WAIT: Duration = Duration::from_secs(5);
/// Idle time before a TEST LINK keepalive (Linux's `net.smc.smcr_testlink_time` default,
/// `SMC_LLC_TESTLINK_DEFAULT_TIME`, 30 s, set in smc_sysctl.c).
pub const TEST_LINK_TIME: Duration = Duration::from_secs(30);

/// Which end of the link group we are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// CLC server: sends CONFIRM LINK.
    Server,
    /// CLC client: answers it.
    Client,
}

/// Our side of the link and the link group's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkParams {
    /// Our role.
    pub role: Role,
    /// LLC format of the link group (v2 for SMC-Rv2).
    pub version: Version,
    /// Our port's MAC.
    pub mac: Mac,
    /// Our GID.
    pub gid: Gid,
    /// Our QP number.
    pub qpn: u32,
    /// Link id (the server chooses; the client learns it from CONFIRM LINK).
    pub link_id: u8,
    /// Link uid (server: link group id and link id, as Linux; client: learned).
    pub link_uid: [u8; 4],
    /// Negotiated links per group (sent in CONFIRM LINK).
    pub max_links: u8,
    /// Negotiated connections per group (sent in CONFIRM LINK).
    pub max_conns: u8,
    /// Idle time before TEST LINK; `None` disables the keepalive.
    pub test_link_time: Option<Duration>,
}

/// Where the link is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// Waiting for CONFIRM LINK (client: the request; server: the response).
    Confirming,
    /// Usable.
    Active,
    /// Down; nothing more is sent.
    Down,
}

/// Why a link went down.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DownReason {
    /// The CONFIRM LINK exchange did not complete in time.
    #[error("CONFIRM LINK not completed within {0:?}")]
    ConfirmTimeout(Duration),
    /// A TEST LINK request went unanswered.
    #[error("TEST LINK unanswered for {0:?}")]
    TestLinkTimeout(Duration),
    /// The peer deleted this link (DELETE LINK naming it).
    #[error("peer sent DELETE LINK ({0})")]
    PeerDeleted(DeleteLinkReason),
    /// The peer deleted the whole link group (DELETE LINK ALL): no other link of it survives.
    #[error("peer sent DELETE LINK ALL ({0})")]
    PeerDeletedGroup(DeleteLinkReason),
    /// We deleted it.
    #[error("deleted locally ({0})")]
    Local(DeleteLinkReason),
    /// The peer broke the LLC protocol.
    #[error("LLC protocol violation: {0}")]
    ProtocolViolation(String),
    /// The queue pair failed (retry exhaustion, remote access error, …).
    #[error("RDMA transport failed: {0}")]
    Transport(String),
}

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// The link is confirmed; `peer` is the peer's CONFIRM LINK.
    Up {
        /// Peer's MAC, GID, QPN, link id and limits.
        peer: ConfirmLink,
    },
    /// The peer announced rkeys of a new RMB (already acknowledged).
    PeerConfirmedRkey(ConfirmRkey),
    /// The peer withdrew rkeys (already acknowledged).
    PeerDeletedRkeys(Vec<u32>),
    /// Our CONFIRM RKEY or DELETE RKEY request `id` was answered (`ok`: positively) or timed
    /// out (`ok` false).
    RkeyDone {
        /// What [`LinkCore::confirm_rkey`] / [`LinkCore::delete_rkey`] returned.
        id: u64,
        /// Positive answer in time.
        ok: bool,
    },
    /// The link is down: fail its connections (after sending what `poll_transmit` still has).
    Down(DownReason),
    /// Server: the answer to our ADD LINK request ([`LinkCore::add_link`]): the client's
    /// response (its new QP, MAC, GID, PSN, MTU and rkeys), or why there is none.
    AddLinkResult(Result<AddLink, AddLinkRefused>),
    /// Client: the server asks to add a link (already checked: we allow a second link and the
    /// request is usable). Set the new link up and answer with [`LinkCore::answer_add_link`]
    /// (`None` rejects).
    PeerAddLink(AddLink),
    /// The peer deleted another link of the group (`link_id`, one of
    /// [`LinkCore::set_group_links`]); already answered. Move its connections here.
    PeerDeletedLink {
        /// The deleted link.
        link_id: u8,
        /// The peer's reason.
        reason: DeleteLinkReason,
    },
}

/// Why an ADD LINK request got no usable response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddLinkRefused {
    /// The client rejected it (no alternate path).
    Rejected,
    /// No response within [`LLC_WAIT`] (Linux drops the new link silently then: smc_llc.c,
    /// `smc_llc_srv_add_link()`).
    Timeout,
}

/// Counters for diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// LLC messages received.
    pub rx: u64,
    /// LLC messages queued for sending.
    pub tx: u64,
    /// TEST LINK requests we sent.
    pub test_links_sent: u64,
    /// ADD LINK requests we rejected.
    pub add_links_rejected: u64,
    /// Messages dropped (unknown type, unsolicited responses).
    pub dropped: u64,
}

/// The LLC state machine of one link.
#[derive(Debug)]
pub struct LinkCore {
    p: LinkParams,
    state: LinkState,
    peer: Option<ConfirmLink>,
    /// CONFIRM LINK deadline while confirming.
    confirm_deadline: Option<Instant>,
    /// How long that wait is (for the reason given when it runs out).
    confirm_wait: Duration,
    last_activity: Instant,
    /// Outstanding TEST LINK: when it was sent.
    test_sent: Option<Instant>,
    tx: VecDeque<LlcMessage>,
    events: VecDeque<LinkEvent>,
    stats: LinkStats,
    /// Our rkey requests: one on the wire at a time (Linux runs one local LLC flow at a time:
    /// smc_llc.c, `smc_llc_flow_initiate()`), the rest queued; responses carry no id, so they
    /// match in order.
    rkey_queue: VecDeque<(u64, Llc)>,
    rkey_outstanding: Option<(u64, Instant, bool)>,
    next_rkey_id: u64,
    /// Server: our ADD LINK request and when it went out (one ADD LINK flow at a time).
    add_link_sent: Option<(u8, Instant)>,
    /// Client: an ADD LINK request handed to the driver, not yet answered.
    add_link_asked: Option<AddLink>,
    /// Client: the driver can set up a second link (an alternate path exists).
    accept_add_link: bool,
    /// The group's other links (DELETE LINK for one of them is the group's business).
    group_links: Vec<u8>,
}

impl LinkCore {
    /// A new link after the CLC handshake: the server queues CONFIRM LINK, the client waits for
    /// it. The server gives up after [`CONFIRM_WAIT`], the client after [`CLIENT_CONFIRM_WAIT`].
    pub fn new(p: LinkParams, now: Instant) -> Self {
        Self::with_wait(p, now, Self::confirm_wait(p.role))
    }

    /// A link added to an existing group (after the ADD LINK exchange on another link): the
    /// server sends CONFIRM LINK on it at once; both give up after [`ADDED_CONFIRM_WAIT`].
    pub fn new_added(p: LinkParams, now: Instant) -> Self {
        Self::with_wait(p, now, ADDED_CONFIRM_WAIT)
    }

    fn with_wait(p: LinkParams, now: Instant, wait: Duration) -> Self {
        let mut l = Self {
            p,
            state: LinkState::Confirming,
            peer: None,
            confirm_deadline: Some(now + wait),
            confirm_wait: wait,
            last_activity: now,
            test_sent: None,
            tx: VecDeque::new(),
            events: VecDeque::new(),
            stats: LinkStats::default(),
            rkey_queue: VecDeque::new(),
            rkey_outstanding: None,
            next_rkey_id: 1,
            add_link_sent: None,
            add_link_asked: None,
            accept_add_link: false,
            group_links: Vec::new(),
        };
        if p.role == Role::Server {
            let m = l.confirm_link(false);
            l.send(m);
        }
        l
    }

    /// How long `role` waits for the first CONFIRM LINK exchange.
    pub fn confirm_wait(role: Role) -> Duration {
        match role {
            Role::Server => CONFIRM_WAIT,
            Role::Client => CLIENT_CONFIRM_WAIT,
        }
    }

    /// The link's state.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Our parameters (the client's `link_id`/`link_uid` are the server's once confirmed).
    pub fn params(&self) -> &LinkParams {
        &self.p
    }

    /// The peer's CONFIRM LINK, once the link is up.
    pub fn peer(&self) -> Option<&ConfirmLink> {
        self.peer.as_ref()
    }

    /// Counters.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    fn confirm_link(&self, response: bool) -> Llc {
        Llc::ConfirmLink(ConfirmLink {
            response,
            no_rmbe_eyecatcher: 0x03,
            mac: self.p.mac,
            gid: self.p.gid,
            qpn: self.p.qpn,
            link_id: self.p.link_id,
            link_uid: self.p.link_uid,
            max_links: self.p.max_links,
            max_conns: self.p.max_conns,
        })
    }

    fn send(&mut self, body: Llc) {
        if self.state == LinkState::Down {
            return;
        }
        self.stats.tx += 1;
        self.tx.push_back(LlcMessage {
            version: self.p.version,
            body,
        });
    }

    fn down(&mut self, reason: DownReason) {
        if self.state != LinkState::Down {
            self.state = LinkState::Down;
            self.confirm_deadline = None;
            self.test_sent = None;
            self.add_link_sent = None;
            self.add_link_asked = None;
            let waiting = self.rkey_outstanding.take().map(|(id, ..)| id);
            for id in waiting
                .into_iter()
                .chain(self.rkey_queue.drain(..).map(|(id, _)| id))
            {
                self.events.push_back(LinkEvent::RkeyDone { id, ok: false });
            }
            self.events.push_back(LinkEvent::Down(reason));
        }
    }

    fn violation(&mut self, what: String) {
        // Tell the peer why, as Linux does (DELETE LINK ALL, PROT_VIOL, not orderly), then stop.
        // Linux: smc_llc.c, `smc_llc_protocol_violation()`; smc_core.c, `smc_lgr_cleanup()`.
        self.send(Llc::DeleteLink(DeleteLink {
            response: false,
            all: true,
            orderly: false,
            link_id: 0,
            reason: DeleteLinkReason::PROT_VIOL,
        }));
        self.down(DownReason::ProtocolViolation(what));
    }

    /// Any traffic from the peer on this link (CDC messages, completions of our sends) shows it
    /// is alive and postpones the keepalive (Linux counts receives only: smc_wr.c,
    /// `smc_wr_rx_process_cqes()` sets `wr_rx_tstamp`).
    pub fn note_activity(&mut self, now: Instant) {
        self.last_activity = now;
    }

    /// Checks the link now with a TEST LINK (unless one is outstanding), e.g. because a
    /// connection's TCP socket was closed without an SMC-R close: a dead peer then takes the
    /// link down within [`LLC_WAIT`].
    pub fn probe(&mut self, now: Instant) {
        if self.state == LinkState::Active && self.test_sent.is_none() {
            self.test_sent = Some(now);
            self.stats.test_links_sent += 1;
            self.send(Llc::TestLink(TestLink {
                response: false,
                user_data: [0; 16],
            }));
        }
    }

    /// A received SEND payload that is not a CDC message.
    pub fn handle_llc(&mut self, bytes: &[u8], now: Instant) {
        if self.state == LinkState::Down {
            return;
        }
        self.stats.rx += 1;
        self.last_activity = now;
        let msg = match LlcMessage::parse(bytes) {
            Ok(m) => m,
            Err(llc::Error::UnknownType(_)) => {
                // No handler for the type: Linux drops it too (smc_wr.c,
                // `smc_wr_rx_demultiplex()`).
                self.stats.dropped += 1;
                return;
            }
            Err(e) => return self.violation(format!("malformed LLC message: {e}")),
        };
        if msg.version != self.p.version {
            return self.violation(format!(
                "LLC {:?} message on a {:?} link group",
                msg.version, self.p.version
            ));
        }
        if self.state == LinkState::Confirming {
            return self.while_confirming(msg.body);
        }
        match msg.body {
            // Echoed with the response flag (smc_llc.c, `smc_llc_event_handler()`).
            Llc::TestLink(t) if !t.response => self.send(Llc::TestLink(TestLink {
                response: true,
                user_data: t.user_data,
            })),
            Llc::TestLink(_) => {
                if self.test_sent.take().is_none() {
                    self.stats.dropped += 1;
                }
            }
            Llc::AddLink(a) if !a.response => {
                // Only a client with an alternate path takes it (Linux: the server runs ADD
                // LINK, a client only suggests); an unusable MTU (as smc_llc.c,
                // `smc_llc_cli_add_link()`), a second request while one is open, or a link id
                // in use are refused like a missing path.
                let usable = self.p.role == Role::Client
                    && self.accept_add_link
                    && self.p.max_links > 1
                    && a.mtu.bytes().is_some()
                    && a.link_id != 0
                    && a.link_id != self.p.link_id
                    && !self.group_links.contains(&a.link_id)
                    && self.add_link_asked.is_none();
                if usable {
                    self.add_link_asked = Some(a.clone());
                    self.events.push_back(LinkEvent::PeerAddLink(a));
                } else {
                    self.reject_add_link(a);
                }
            }
            // The answer to ours: the reject flag ends the flow (smc_llc_srv_add_link()).
            Llc::AddLink(a) => match self.add_link_sent {
                Some((id, _)) if a.link_id == id => {
                    self.add_link_sent = None;
                    self.events.push_back(LinkEvent::AddLinkResult(if a.reject {
                        Err(AddLinkRefused::Rejected)
                    } else {
                        Ok(a)
                    }));
                }
                _ => self.stats.dropped += 1,
            },
            // Our server adds links on its own schedule (a Linux server starts an ADD LINK
            // flow on it, `smc_llc_event_handler()`); Linux's client only ends its request flow
            // on the response.
            Llc::RequestAddLink(r) if !r.response => {
                self.send(Llc::RequestAddLink(RequestAddLink {
                    response: true,
                    reject: true,
                    gids: Vec::new(),
                }))
            }
            // The request goes back as the response (smc_llc.c, `smc_llc_rmt_conf_rkey()`).
            Llc::ConfirmRkey(c) if !c.response => {
                self.send(Llc::ConfirmRkey(ConfirmRkey {
                    response: true,
                    ..c
                }));
                self.events.push_back(LinkEvent::PeerConfirmedRkey(c));
            }
            Llc::DeleteRkey(d) if !d.response => {
                // The count kept, the keys zeroed, as Linux's v2 answer (smc_llc.c,
                // `smc_llc_rmt_delete_rkey()`; its v1 answer echoes the keys).
                let count = d.rkeys.len();
                self.send(Llc::DeleteRkey(DeleteRkey {
                    response: true,
                    negative: false,
                    errors: 0,
                    rkeys: vec![0; count],
                }));
                self.events.push_back(LinkEvent::PeerDeletedRkeys(d.rkeys));
            }
            Llc::ConfirmRkey(c) => self.rkey_answered(true, !c.negative, now),
            Llc::DeleteRkey(d) => self.rkey_answered(false, !d.negative && d.errors == 0, now),
            Llc::DeleteLink(d)
                if !d.response && !d.all && self.group_links.contains(&d.link_id) =>
            {
                // Another link of the group: confirmed (as Linux's client answers: reason 0,
                // smc_llc.c, `smc_llc_process_cli_delete_link()`); the driver moves its
                // connections here.
                self.group_links.retain(|&l| l != d.link_id);
                self.send(Llc::DeleteLink(DeleteLink {
                    response: true,
                    reason: DeleteLinkReason(0),
                    ..d
                }));
                self.events.push_back(LinkEvent::PeerDeletedLink {
                    link_id: d.link_id,
                    reason: d.reason,
                });
            }
            Llc::DeleteLink(d) if !d.response && !d.all && d.link_id != self.p.link_id => {
                // Not a link of ours (Linux: answered with NO_LINK, nothing deleted;
                // `smc_llc_process_cli_delete_link()`).
                self.stats.dropped += 1;
                self.send(Llc::DeleteLink(DeleteLink {
                    response: true,
                    reason: DeleteLinkReason::NO_LINK,
                    ..d
                }));
            }
            Llc::DeleteLink(d) if !d.response => {
                if d.all {
                    self.down(DownReason::PeerDeletedGroup(d.reason));
                } else {
                    // A single link: confirm its deletion. For the whole group Linux's client
                    // sends nothing back (`smc_llc_process_cli_delete_link()`); its server
                    // sends its own DELETE LINK ALL (`smc_llc_process_srv_delete_link()`).
                    self.send(Llc::DeleteLink(DeleteLink {
                        response: true,
                        ..d
                    }));
                    self.down(DownReason::PeerDeleted(d.reason));
                }
            }
            Llc::ConfirmLink(_) => {
                self.violation("CONFIRM LINK on a confirmed link".into());
            }
            // Responses to requests we do not send, and v1 continuations: ignore.
            _ => self.stats.dropped += 1,
        }
    }

    fn while_confirming(&mut self, body: Llc) {
        match (self.p.role, body) {
            (Role::Client, Llc::ConfirmLink(c)) if !c.response => {
                // The server assigns the link id (smc_llc.c, `smc_llc_eval_conf_link()`).
                self.p.link_id = c.link_id;
                self.p.link_uid = c.link_uid;
                self.p.max_links = c.max_links;
                self.p.max_conns = c.max_conns;
                let m = self.confirm_link(true);
                self.send(m);
                self.up(c);
            }
            (Role::Server, Llc::ConfirmLink(c)) if c.response => {
                if c.link_id != self.p.link_id {
                    return self.violation(format!(
                        "CONFIRM LINK response for link {} (ours is {})",
                        c.link_id, self.p.link_id
                    ));
                }
                self.up(c);
            }
            (_, Llc::DeleteLink(d)) if !d.response => self.down(if d.all {
                DownReason::PeerDeletedGroup(d.reason)
            } else {
                DownReason::PeerDeleted(d.reason)
            }),
            (_, other) => self.violation(format!(
                "{} before the link was confirmed",
                LlcMessage {
                    version: self.p.version,
                    body: other
                }
                .llc_type()
                .name()
            )),
        }
    }

    fn up(&mut self, peer: ConfirmLink) {
        self.state = LinkState::Active;
        self.confirm_deadline = None;
        self.peer = Some(peer);
        self.events.push_back(LinkEvent::Up { peer });
    }

    /// Deletes the link group (our last connection is gone and the linger time passed, or the
    /// process is leaving): queues DELETE LINK (ALL, link id 0) and goes down, as smc_llc.c,
    /// `smc_llc_send_link_delete_all()`.
    pub fn delete(&mut self, reason: DeleteLinkReason, orderly: bool) {
        self.send(Llc::DeleteLink(DeleteLink {
            response: false,
            all: true,
            orderly,
            link_id: 0,
            reason,
        }));
        self.down(DownReason::Local(reason));
    }

    /// The transport failed under the link (QP error, retry exhaustion): down, nothing sent.
    pub fn transport_failed(&mut self, what: &str) {
        self.tx.clear();
        self.down(DownReason::Transport(what.to_owned()));
    }

    /// The next LLC message to send as an RDMA SEND.
    pub fn poll_transmit(&mut self) -> Option<LlcMessage> {
        self.tx.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<LinkEvent> {
        self.events.pop_front()
    }

    /// When [`LinkCore::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            LinkState::Down => None,
            LinkState::Confirming => self.confirm_deadline,
            LinkState::Active => {
                let keepalive = match (self.test_sent, self.p.test_link_time) {
                    (Some(sent), _) => Some(sent + LLC_WAIT),
                    (None, Some(idle)) => Some(self.last_activity + idle),
                    (None, None) => None,
                };
                let rkey = self.rkey_outstanding.map(|(_, sent, _)| sent + LLC_WAIT);
                let add = self.add_link_sent.map(|(_, sent)| sent + LLC_WAIT);
                [keepalive, rkey, add].into_iter().flatten().min()
            }
        }
    }

    /// Runs timers: CONFIRM LINK deadline, keepalive, TEST LINK, rkey and ADD LINK answer
    /// deadlines.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Linux's server waits SMC_LLC_WAIT_TIME for the ADD LINK answer
        // (`smc_llc_srv_add_link()`).
        if self.state == LinkState::Active
            && let Some((_, sent)) = self.add_link_sent
            && now >= sent + LLC_WAIT
        {
            self.add_link_sent = None;
            self.events
                .push_back(LinkEvent::AddLinkResult(Err(AddLinkRefused::Timeout)));
        }
        if self.state == LinkState::Active
            && let Some((id, sent, _)) = self.rkey_outstanding
            && now >= sent + LLC_WAIT
        {
            // Linux gives up on the flow (and the connection setup) after SMC_LLC_WAIT_TIME
            // (smc_llc.c, `smc_llc_do_confirm_rkey()`).
            self.rkey_outstanding = None;
            self.events.push_back(LinkEvent::RkeyDone { id, ok: false });
            self.next_rkey(now);
        }
        match self.state {
            LinkState::Down => {}
            LinkState::Confirming => {
                if self.confirm_deadline.is_some_and(|d| now >= d) {
                    self.tx.clear();
                    self.down(DownReason::ConfirmTimeout(self.confirm_wait));
                }
            }
            LinkState::Active => match (self.test_sent, self.p.test_link_time) {
                (Some(sent), _) => {
                    // No answer within SMC_LLC_WAIT_TIME takes the link down, as smc_llc.c,
                    // `smc_llc_testlink_work()`; unlike Linux, other traffic counts as one.
                    if now >= sent + LLC_WAIT {
                        if self.last_activity > sent {
                            // Other traffic arrived meanwhile: the link is alive.
                            self.test_sent = None;
                        } else {
                            self.down(DownReason::TestLinkTimeout(LLC_WAIT));
                        }
                    }
                }
                (None, Some(idle)) => {
                    if now >= self.last_activity + idle {
                        self.test_sent = Some(now);
                        self.stats.test_links_sent += 1;
                        self.send(Llc::TestLink(TestLink {
                            response: false,
                            user_data: [0; 16],
                        }));
                    }
                }
                (None, None) => {}
            },
        }
    }
}

#[cfg(test)]
mod tests;
