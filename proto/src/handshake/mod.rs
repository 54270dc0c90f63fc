//! The CLC handshake, sans-IO: what a client and a server send and decide, as Linux does it.
//!
//! Both roles are driven the same way (quinn style): feed the TCP bytes the handshake asks for
//! ([`Client::wants`] / [`Client::handle_data`] — never more than one message, so application
//! bytes after a Decline stay in the socket), write whatever [`Client::poll_transmit`] returns,
//! call `handle_timeout` at [`Client::poll_timeout`], and act on [`Event`]s. Time is always a
//! parameter.
//!
//! Negotiation (wire spec §2.5): we speak SMC-Rv2 only (RoCE v2 GIDs, like rxe), so the client
//! proposes v2 SMC-R with an empty v1 area, its user EIDs and SMC release 1 (v2.1) with
//! `max_conns` / `max_links`; the server needs a common UEID, takes the minimum of both sides'
//! release and limits, and refuses what Linux refuses, with Linux's decline codes. Outcomes
//! follow Linux's rules: a positive reason is a Decline and a fallback to TCP agreed by both
//! sides; a malformed/unexpected message fails the connection (Linux: `EPROTO`).
//!
//! Timeouts, where we do better than Linux (which fails the connection with `ETIMEDOUT` after
//! one [`CLC_WAIT_TIME`]): every CLC message is owed by the peer — a Proposal or Decline first,
//! an Accept or Decline for a Proposal, a Confirm or Decline for an Accept — so while none of it
//! has arrived, a side waits another round, up to [`OWED_WAIT_MAX`] in all, and never declines
//! because of a timeout: a Decline sent on a timeout could cross the peer's late message or its
//! own Decline and end up in one side's application stream. Heavy TCP loss delays a segment for
//! many seconds; a peer that is gone closes the TCP connection, which ends the wait at once;
//! part of a message that then stalls is a broken peer and fails at the end of its round.
//! When the first link does not come up (no CONFIRM LINK in time, or it fails), both sides do
//! what Linux does: listen [`CLC_WAIT_TIME_SHORT`] for the peer's Decline, else decline with
//! `TIMEOUT_CL`; either way the connection continues as TCP.

use clc::{
    AcceptBody, AcceptConfirm, Decline, DeclineReason, Eid, FirstContactExt, Gid, Hostname, Mac,
    Message, MsgType, PeerId, Proposal, QpMtu, RmbSize, Role, SmcType, SmcdInfo, SmcrAcceptConfirm,
    SmcrV2, V2Extension,
};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Linux's `CLC_WAIT_TIME` (6 s, smc_clc.h): how long each side waits for the peer's next CLC
/// message.
pub const CLC_WAIT_TIME: Duration = Duration::from_secs(6);
/// Linux's `CLC_WAIT_TIME_SHORT` (1 s, smc_clc.h): how long to listen for the peer's Decline
/// after the first link failed to come up (af_smc.c, `smcr_clnt_conf_first_link()`,
/// `smcr_serv_conf_first_link()`).
pub const CLC_WAIT_TIME_SHORT: Duration = Duration::from_secs(1);
/// How long we wait in all, in rounds of the CLC wait while nothing of it has come, for the
/// CLC message the peer owes (Linux fails after one round). Giving up early strands a peer
/// that is fine — e.g. a client on a reused link group that sent its Confirm already writes
/// over RDMA — and a timeout Decline could cross the peer's late message (found in review).
/// Heavy TCP loss delays a segment past 6 s, and even 12 s, now and then (10%-loss soaks saw
/// both); a peer that is gone closes the TCP connection, which ends the wait at once.
pub const OWED_WAIT_MAX: Duration = Duration::from_secs(30);
/// Fewest connections per link group a v2.1 peer may negotiate (`SMC_CONN_PER_LGR_MIN`,
/// smc_core.h).
pub const MIN_CONNS_PER_LGR: u8 = 16;
/// Most links per link group (`SMC_LINKS_ADD_LNK_MAX`, smc_core.h).
pub const MAX_LINKS_PER_LGR: u8 = 2;
/// The SMC release we implement (v2.1; Linux's `SMC_RELEASE`, smc.h).
pub const SMC_RELEASE: u8 = 1;
/// OS type sent in first-contact extensions (2 = Linux, `SMC_CLC_OS_LINUX` in smc_clc.h: we
/// interoperate as one).
pub const OS_TYPE_LINUX: u8 = 2;

/// Local settings for the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Our system ID (sent in Accept/Confirm/Decline; peers use it to find link groups).
    pub peer_id: PeerId,
    /// User EIDs; SMC-Rv2 needs one in common with the peer (Linux: `smcr ueid add`).
    pub ueids: Vec<Eid>,
    /// Highest SMC release offered (1 = v2.1).
    pub release: u8,
    /// Connections per link group we support (16..=255).
    pub max_conns: u8,
    /// Links per link group we support (1..=2). We default to 1: with a single path, a Linux
    /// peer then skips the ADD LINK exchange it would otherwise wait seconds for (af_smc.c,
    /// `smcr_clnt_conf_first_link()` waits for the server's ADD LINK when `max_links > 1`).
    pub max_links: u8,
    /// Feature mask offered.
    pub feature_mask: u16,
    /// Host name for first-contact extensions.
    pub hostname: Hostname,
    /// How long to wait for each peer message.
    pub timeout: Duration,
    /// How long in all a client waits for the server's answer to its Proposal while nothing
    /// of it has come (`None`: as long as the TCP connection is up). Our own servers answer
    /// when the application first uses the accepted connection — which may be late (a
    /// connection queued for a busy worker), as a TCP client would just wait for its reply.
    pub accept_wait_max: Option<Duration>,
}

impl Config {
    /// Linux-like defaults with the given identity and user EIDs.
    pub fn new(peer_id: PeerId, ueids: Vec<Eid>, hostname: &str) -> Self {
        Self {
            peer_id,
            ueids,
            release: SMC_RELEASE,
            // Linux's `SMC_CONN_PER_LGR_PREFER` (smc_core.h).
            max_conns: 255,
            // Not Linux's `SMC_LINKS_PER_LGR_MAX_PREFER` (2): see `max_links`.
            max_links: 1,
            feature_mask: 0,
            hostname: Hostname::truncated(hostname),
            timeout: CLC_WAIT_TIME,
            accept_wait_max: None,
        }
    }
}

/// One side's link endpoint and RMB, as carried in Accept/Confirm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// RoCE v2 GID of the link's port.
    pub gid: Gid,
    /// MAC of that port.
    pub mac: Mac,
    /// QP number of the link (first contact: the new QP).
    pub qpn: u32,
    /// First PSN this side sends with.
    pub initial_psn: u32,
    /// Active path MTU.
    pub mtu: QpMtu,
    /// rkey of the RMB.
    pub rmb_rkey: u32,
    /// Address the peer writes to.
    pub rmb_vaddr: u64,
    /// RMB size.
    pub rmb_size: RmbSize,
    /// Alert token the peer must put into its CDCs.
    pub token: u32,
}

/// What the two sides agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// SMC version (2).
    pub version: u8,
    /// The common user EID.
    pub eid: Eid,
    /// SMC release.
    pub release: u8,
    /// Connections per link group.
    pub max_conns: u8,
    /// Links per link group.
    pub max_links: u8,
    /// Common features.
    pub feature_mask: u16,
}

/// The peer's side of an Accept or Confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// Peer's system ID.
    pub peer_id: PeerId,
    /// Peer's endpoint (its QP, RMB and token).
    pub endpoint: Endpoint,
    /// A new link group (first contact) or an existing one.
    pub first_contact: bool,
    /// Peer's host name (first contact only).
    pub hostname: Option<Hostname>,
    /// Client's GID list (Confirm, first contact).
    pub gids: Vec<Gid>,
}

/// Why a handshake failed without falling back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The peer's next message did not come in time.
    #[error("timed out after {waited:?} waiting for the CLC {waiting_for}")]
    Timeout {
        /// What was expected.
        waiting_for: MsgType,
        /// How long we waited.
        waited: Duration,
    },
    /// The peer sent bytes that are not a valid CLC message.
    #[error("malformed CLC message: {0}")]
    Malformed(clc::Error),
    /// The peer sent a valid message of the wrong type.
    #[error("expected a CLC {expected} (or Decline), received a {got}")]
    Unexpected {
        /// What was expected.
        expected: MsgType,
        /// What came.
        got: MsgType,
    },
    /// The TCP connection closed during the handshake.
    #[error("the TCP connection closed during the CLC handshake")]
    PeerClosed,
}

/// Misuse of the API (calling `accept` before a Proposal, for instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("handshake step not allowed now: {0}")]
pub struct StateError(&'static str);

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Client: the server accepted. Set up the link (first contact) or find the link group
    /// (check `server.peer_id`, `server.endpoint.gid` and QPN; none → decline `SYNCERR`),
    /// then call [`Client::confirm`] or [`Client::decline`].
    Accepted {
        /// Agreed parameters (from the first-contact extension, or ours for a reused group).
        negotiated: Negotiated,
        /// The server's side.
        server: PeerInfo,
    },
    /// Client: Confirm sent; the connection is SMC-R (first contact: LLC CONFIRM LINK next).
    Confirmed,
    /// Server: the client's Proposal is acceptable. Find or create the link group, then call
    /// [`Server::accept`] or [`Server::decline`].
    Proposed {
        /// Agreed parameters.
        negotiated: Negotiated,
        /// The client's RoCE v2 GID.
        client_gid: Gid,
        /// The client's system ID (a link group serves one peer system, as Linux matches it).
        client_id: PeerId,
    },
    /// Server: the client confirmed; the connection is SMC-R.
    Established {
        /// Agreed parameters.
        negotiated: Negotiated,
        /// The client's side.
        client: PeerInfo,
    },
    /// Both: the connection continues as plain TCP.
    Fallback {
        /// The reason (ours if we declined, the peer's diagnosis otherwise).
        reason: DeclineReason,
        /// Whether the peer declined (else we did).
        by_peer: bool,
        /// Decline's out-of-sync flag: the link group in use must be terminated.
        out_of_sync: bool,
    },
    /// Both: the connection fails; no fallback (Linux behaves the same).
    Failed(Error),
}

/// Reads exactly one CLC message at a time from the TCP stream.
#[derive(Debug, Default)]
struct Framer {
    buf: Vec<u8>,
}

impl Framer {
    /// Bytes still needed for the current message.
    fn wants(&self) -> usize {
        if self.buf.len() < clc::HEADER_LEN {
            return clc::HEADER_LEN - self.buf.len();
        }
        match clc::message_len(&self.buf) {
            Ok(len) => len - self.buf.len(),
            Err(_) => 0,
        }
    }

    /// Takes up to `wants()` bytes; returns bytes taken and a message once complete.
    fn push(&mut self, data: &[u8]) -> (usize, Option<Result<Message, clc::Error>>) {
        let n = self.wants().min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= clc::HEADER_LEN {
            if let Err(e) = clc::message_len(&self.buf) {
                self.buf.clear();
                return (n, Some(Err(e)));
            }
            if self.wants() == 0 {
                let msg = Message::parse(&self.buf);
                self.buf.clear();
                return (n, Some(msg));
            }
        }
        (n, None)
    }
}

/// State shared by both roles.
#[derive(Debug)]
struct Common {
    cfg: Config,
    framer: Framer,
    out: VecDeque<Vec<u8>>,
    events: VecDeque<Event>,
    deadline: Option<(Instant, MsgType)>,
    /// When the wait for the current message began (its rounds count from there).
    waiting_since: Instant,
    done: bool,
}

impl Common {
    fn new(cfg: Config, now: Instant) -> Self {
        Self {
            cfg,
            framer: Framer::default(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            deadline: None,
            waiting_since: now,
            done: false,
        }
    }

    fn send(&mut self, m: &Message) {
        self.out.push_back(m.to_vec());
    }

    fn wait_for(&mut self, what: MsgType, now: Instant) {
        self.deadline = Some((now + self.cfg.timeout, what));
        self.waiting_since = now;
    }

    fn finish(&mut self, ev: Event) {
        self.done = true;
        self.deadline = None;
        self.events.push_back(ev);
    }

    fn fail(&mut self, e: Error) {
        self.finish(Event::Failed(e));
    }

    fn decline(&mut self, version: u8, reason: DeclineReason) {
        let d = Decline::linux(version.max(1), self.cfg.peer_id, reason);
        self.send(&Message::Decline(d));
        self.finish(Event::Fallback {
            reason,
            by_peer: false,
            out_of_sync: d.out_of_sync,
        });
    }

    fn peer_declined(&mut self, d: &Decline) {
        self.finish(Event::Fallback {
            reason: d.reason,
            by_peer: true,
            out_of_sync: d.out_of_sync,
        });
    }

    fn wants(&self) -> usize {
        if self.done || self.deadline.is_none() {
            0
        } else {
            self.framer.wants()
        }
    }

    /// The message waited for, once its deadline has passed.
    fn expired(&self, now: Instant) -> Option<MsgType> {
        match self.deadline {
            Some((at, what)) if now >= at && !self.done => Some(what),
            _ => None,
        }
    }

    fn timed_out(&mut self, what: MsgType) {
        let waited = self.cfg.timeout;
        self.fail(Error::Timeout {
            waiting_for: what,
            waited,
        });
    }

    /// The wait for a message the peer owes (since `since`) ran out: another round while
    /// nothing of it has come, up to [`OWED_WAIT_MAX`]; then, or with part of it stalled, fail.
    fn owed(&mut self, what: MsgType, now: Instant) {
        self.owed_for(what, now, Some(OWED_WAIT_MAX));
    }

    /// As [`Self::owed`], waiting at most `max` in all (`None`: without end).
    fn owed_for(&mut self, what: MsgType, now: Instant, max: Option<Duration>) {
        let since = self.waiting_since;
        let more = max.is_none_or(|m| now < since + m);
        if self.framer.buf.is_empty() && more {
            self.deadline = Some((now + self.cfg.timeout, what));
        } else {
            self.fail(Error::Timeout {
                waiting_for: what,
                waited: now.saturating_duration_since(since),
            });
        }
    }

    /// The first link did not come up: listen briefly for the peer's Decline (`until`).
    fn await_link_decline(&mut self, until: Instant) {
        self.done = false;
        self.framer = Framer::default();
        self.deadline = Some((until, MsgType::Decline));
    }

    /// Feeds bytes; returns bytes consumed and a parsed message, or handles a framing error.
    fn take(&mut self, data: &[u8]) -> (usize, Option<Message>) {
        let mut used = 0;
        // Header first, then exactly the rest of that one message.
        while self.wants() > 0 && used < data.len() {
            match self.framer.push(&data[used..]) {
                (n, Some(Ok(m))) => return (used + n, Some(m)),
                (n, Some(Err(e))) => {
                    self.fail(Error::Malformed(e));
                    return (used + n, None);
                }
                (n, None) => used += n,
            }
        }
        (used, None)
    }
}

fn endpoint_of(r: &SmcrAcceptConfirm) -> Endpoint {
    Endpoint {
        gid: r.gid,
        mac: r.mac,
        qpn: r.qpn,
        initial_psn: r.initial_psn,
        mtu: r.qp_mtu,
        rmb_rkey: r.rmb_rkey,
        rmb_vaddr: r.rmb_vaddr,
        rmb_size: r.rmbe_size,
        token: r.rmbe_alert_token,
    }
}

#[allow(clippy::too_many_arguments)]
fn accept_confirm(
    role: Role,
    cfg: &Config,
    ep: &Endpoint,
    mtu: QpMtu,
    neg: &Negotiated,
    first_contact: bool,
    gids: Option<Vec<Gid>>,
) -> Message {
    Message::AcceptConfirm(AcceptConfirm {
        role,
        eyecatcher: clc::Eyecatcher::SmcR,
        version: neg.version,
        first_contact,
        body: AcceptBody::SmcR(SmcrAcceptConfirm {
            peer_id: cfg.peer_id,
            gid: ep.gid,
            mac: ep.mac,
            qpn: ep.qpn,
            rmb_rkey: ep.rmb_rkey,
            rmbe_idx: 1,
            rmbe_alert_token: ep.token,
            rmbe_size: ep.rmb_size,
            qp_mtu: mtu,
            rmb_vaddr: ep.rmb_vaddr,
            initial_psn: ep.initial_psn,
            v2: Some(SmcrV2 {
                eid: neg.eid,
                fce: first_contact.then_some(FirstContactExt {
                    v2_direct: true,
                    os_type: OS_TYPE_LINUX,
                    release: neg.release,
                    hostname: cfg.hostname,
                    max_conns: neg.max_conns,
                    max_links: neg.max_links,
                    feature_mask: neg.feature_mask,
                    vendor_options: 0,
                }),
                gids: if first_contact { gids } else { None },
            }),
        }),
    })
}

/// The driver-facing methods both roles share; `on_message` is each role's own.
macro_rules! driver_methods {
    ($ty:ident) => {
        impl $ty {
            /// Bytes to read from the TCP socket next (0: read nothing; what follows is
            /// application data).
            pub fn wants(&self) -> usize {
                self.c.wants()
            }

            /// Feeds bytes read from the TCP socket; returns how many were used (at most
            /// `wants()`).
            pub fn handle_data(&mut self, data: &[u8]) -> usize {
                let (n, msg) = self.c.take(data);
                if let Some(m) = msg {
                    self.on_message(m);
                }
                n
            }

            /// The TCP connection reached EOF.
            pub fn handle_eof(&mut self) {
                if !self.c.done {
                    self.c.fail(Error::PeerClosed);
                }
            }

            /// Call at (or after) `poll_timeout()`.
            pub fn handle_timeout(&mut self, now: Instant) {
                if let Some(what) = self.c.expired(now) {
                    self.on_timeout(what, now);
                }
            }

            /// When `handle_timeout` must be called next.
            pub fn poll_timeout(&self) -> Option<Instant> {
                self.c.deadline.filter(|_| !self.c.done).map(|(at, _)| at)
            }

            /// Next bytes to write to the TCP socket.
            pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
                self.c.out.pop_front()
            }

            /// Next event.
            pub fn poll_event(&mut self) -> Option<Event> {
                self.c.events.pop_front()
            }
        }
    };
}

driver_methods!(Client);
driver_methods!(Server);

mod client;
mod server;
pub use client::Client;
pub use server::Server;
#[allow(unused_imports)]
use {client::*, server::*};

#[cfg(test)]
mod tests;
