//! The same-host transport: when both ends of a queue pair run on one host — any users, any
//! network namespaces that share the rendezvous directory — the QP moves its requests through
//! shared memory instead of UDP.
//!
//! * Memory regions of a *shared* protection domain ([`crate::Device::alloc_shared_pd`]) that
//!   peers may reach (a remote right) live in that domain's [`Arena`], a sealed memfd; local
//!   ones (send buffers, message slots) stay private, as they are to a peer over the wire. The
//!   arena also holds a table of those regions (rkey, access, offset, length, address) so that
//!   a peer can check an rkey before it copies: a wrong key or range is a `REM_ACCESS_ERR`, as
//!   on the wire.
//! * Each QP of a shared domain has an inbound [`Ring`] (it consumes, its peer produces).
//! * At RTR → RTS the QP *offers* both to the peer: it connects to the peer device's
//!   rendezvous — its abstract Unix socket (per network namespace), else its socket in the
//!   host-wide directory ([`offer::rendezvous_dir`], other namespaces) — and the two prove to
//!   each other that they are the pair (a challenge and answer keyed by the QPNs and starting
//!   PSNs, see [`offer`]); only then do the arena, the ring and the receive CQ's eventfds (the
//!   doorbells) go, with SCM_RIGHTS. The proof, not the user, decides: a peer of another user
//!   gets what a peer over the wire could reach. Its uid and pid (SO_PEERCRED) are kept.
//! * A QP that holds its peer's offer, is in RTS and has nothing in flight on UDP switches to
//!   shared memory for good: an RDMA WRITE is a copy into the peer's arena, a SEND (or the
//!   immediate of a WRITE) is one or more ring entries, an RDMA READ a copy out; completions
//!   are immediate. The doorbell is written only when the consumer said it sleeps.
//! * The consumer side runs in whoever polls or waits on the receive CQ: ring entries become
//!   receive completions while receive requests are posted (none posted: they wait, as an RNR).
//! * A peer that goes away closes the connection its offer came on: the QP delivers what is
//!   already in its ring and enters the error state, so its user learns at once.
//!
//! Everything in shared memory is untrusted: a corrupt ring or table is an error of that QP.
//!
//! Here a QP's same-host state ([`ShmQp`]) and what its peer offered ([`PeerTx`]); the offer
//! exchange and the rendezvous are in [`offer`], the producer side in [`tx`], the consumer side
//! in [`rx`], and the arenas in [`crate::arena`].

mod offer;
mod rx;
mod tx;

pub(crate) use offer::{
    FsRendezvous, MSG_LEN, Msg, Nonce, Pairing, listen, listen_fs, nonce, peer_cred, send,
    send_hello,
};
pub use offer::{PeerCred, RENDEZVOUS_DIR, rendezvous_dir};

use crate::arena::{Arena, PeerArena};
use crate::mr::{Access, MrTable};
use crate::rc::{
    CqSide, PostError, RcQp, RecvWqe, SendFlags, SendWr, SgList, Sge, WcOpcode, WcStatus,
    WorkCompletion, WrOpcode,
};
use crate::shm::{Ring, Segment};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Inbound ring geometry: 1024 slots of 128 bytes (a CDC or LLC message takes one).
const RING_SLOTS: usize = 1024;
const RING_SLOT: usize = 128;
/// Entry header inside a slot: op, flags, 2 spare, imm (u32), total length (u32).
const E_HDR: usize = 12;
const E_SEND: u8 = 1;
const E_SEND_IMM: u8 = 2;
const E_WRITE_IMM: u8 = 3;
const F_FIRST: u8 = 1;
const F_LAST: u8 = 2;
/// Payload bytes per entry.
const E_DATA: usize = RING_SLOT - 4 - E_HDR;

/// The waiting-word bits ([`crate::notify`]): the consumer's CQ notification descriptor has a
/// sleeper (its poller), a driver sleeps on the CQ's driver descriptor.
pub(crate) use crate::notify::{WAIT_DRIVER, WAIT_EVENT};

/// What the peer offered: where our requests go.
pub(crate) struct PeerTx {
    pub(crate) from_qpn: u32,
    pub(crate) from: SocketAddrV4,
    /// The peer process (SO_PEERCRED of its connection).
    pub(crate) cred: Option<PeerCred>,
    arena: PeerArena,
    ring: Ring,
    /// The peer CQ's notification descriptor (its poller, or an `ibv_req_notify_cq` user).
    bell: OwnedFd,
    /// The peer CQ's driver descriptor (application threads that handle completions
    /// themselves while they wait).
    bell_driver: OwnedFd,
    /// The connection the offer came on (its hang-up means the peer is gone).
    pub(crate) conn: OwnedFd,
}

impl PeerTx {
    /// Builds the transmit side from an offer's descriptors: arena, ring segment, the two
    /// doorbells.
    pub(crate) fn new(
        from_qpn: u32,
        from: SocketAddrV4,
        fds: Vec<OwnedFd>,
        conn: OwnedFd,
    ) -> io::Result<Self> {
        let [arena, ring, bell, bell_driver]: [OwnedFd; 4] = fds.try_into().map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidData, "an offer carries 4 descriptors")
        })?;
        let arena = PeerArena::open(arena)?;
        let ring = Ring::attach(Arc::new(Segment::open(ring)?), 0)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if ring.max_message() < E_HDR + E_DATA {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "ring slots too small",
            ));
        }
        // Only an eventfd-like descriptor (anonymous inode: no pipe that could raise SIGPIPE,
        // no socket, no file) that cannot block us.
        for b in [&bell, &bell_driver] {
            let st = rustix::fs::fstat(b)?;
            let fl = rustix::fs::fcntl_getfl(b)?;
            if st.st_mode & libc::S_IFMT != 0 || !fl.contains(rustix::fs::OFlags::NONBLOCK) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "doorbell is not non-blocking",
                ));
            }
        }
        Ok(Self {
            from_qpn,
            from,
            cred: peer_cred(conn.as_fd()),
            arena,
            ring,
            bell,
            bell_driver,
            conn,
        })
    }
}

/// A send request waiting for ring space (the consumer is behind).
struct Backlog {
    wr_id: u64,
    op: WrOpcode,
    signaled: bool,
    sgl: SgList,
    /// Bytes of a SEND already pushed.
    done: usize,
    /// A SEND's payload, copied when it has to wait (the caller may reuse its buffer as
    /// soon as `post_send` returns: a same-host SEND is complete when posted).
    owned: Option<Vec<u8>>,
    /// The data of a WRITE is already copied.
    written: bool,
}

/// A send request held while the QP waits for its peer's offer (see [`ShmQp::hold`]): what
/// `post_send` was given, resolved again when it is released.
struct Held {
    wr_id: u64,
    op: WrOpcode,
    sges: Vec<Sge>,
    flags: SendFlags,
}

/// How long requests wait for a same-host peer's offer before they go over UDP: the offer
/// normally follows ours within milliseconds; this is for a peer that stopped answering, and
/// stays well inside the waits of the protocols above (SMC-R's CONFIRM LINK: 2 s), so that a
/// response held this long still arrives in time.
pub(crate) const OFFER_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A message being received into a receive request.
struct RxCur {
    wqe: RecvWqe,
    op: u8,
    imm: u32,
    total: usize,
    done: usize,
}

/// Counts a ring in its CQ's live rings (`CqShared::shm_live`) while it exists.
pub(crate) struct Live(Arc<AtomicUsize>);

impl Live {
    pub(crate) fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Same-host state of a QP in a shared protection domain.
pub(crate) struct ShmQp {
    pub(crate) arena: Arc<Arena>,
    inbound: Ring,
    inbound_seg: Arc<Segment>,
    /// Our offer's connection to the peer.
    pub(crate) offered: Option<OwnedFd>,
    /// Counted among the CQ's live rings: from just before our offer goes until it fails, is
    /// refused or the QP disconnects.
    pub(crate) live: Option<Live>,
    /// The peer's offer, once it came.
    pub(crate) tx: Option<PeerTx>,
    /// Requests go through shared memory (sticky once set).
    pub(crate) active: bool,
    backlog: VecDeque<Backlog>,
    rx: Option<RxCur>,
    /// Which of the peer's doorbells to ring (its waiting word: [`WAIT_EVENT`],
    /// [`WAIT_DRIVER`]).
    ring_bell: u32,
    /// The peer's waiting word we last rang its doorbells for ([`crate::notify::doorbells`]).
    rang: u64,
    /// The doorbell was rung for a full ring (once per episode: a consumer without receive
    /// requests would otherwise be woken at every retry).
    rang_full: bool,
    /// Why the shared memory path failed, for diagnostics.
    pub(crate) fault: Option<&'static str>,
    /// Send requests posted while waiting for the peer's offer, in order.
    held: VecDeque<Held>,
    /// Our offer reached a device on this host (so its offer should follow): requests wait
    /// for it until then instead of going out over UDP.
    pub(crate) wait_until: Option<std::time::Instant>,
    /// Our nonce while our offer's exchange runs (set with `offered`).
    pub(crate) hello: Option<Nonce>,
    /// Our descriptors went to the peer (its proof checked).
    pub(crate) offer_sent: bool,
    /// The starting PSNs (RTR's `rq_psn`, RTS's `sq_psn`): with the QPNs, the pair's secret.
    pub(crate) rq_psn: Option<u32>,
    pub(crate) sq_psn: Option<u32>,
    /// No device answered at the peer's rendezvous (another host, or not reachable here).
    pub(crate) not_found: bool,
    /// The peer ended our offer's exchange before its own offer came.
    pub(crate) refused: bool,
}

/// What became of a QP's same-host sharing ([`crate::QueuePair::same_host_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SameHost {
    /// Not a QP of a shared protection domain (sharing off).
    Off,
    /// Not decided yet (before RTS, or the exchange runs).
    Pending,
    /// Requests go through shared memory.
    Shared,
    /// No device answered at the peer's rendezvous: the peer is on another host, or its
    /// rendezvous is not reachable from here (another network namespace without a shared
    /// `/run/smcr/rdv`).
    NotFound,
    /// The peer's device ended the exchange (no such QP, sharing off there, or the peer
    /// went away).
    Refused,
    /// A process at a rendezvous failed the pair's proof.
    ProofFailed,
    /// The shared memory broke (a corrupt ring or table, a refused access).
    Failed,
}

impl SameHost {
    /// A word for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Pending => "pending",
            Self::Shared => "shm",
            Self::NotFound => "not-found",
            Self::Refused => "refused",
            Self::ProofFailed => "proof-failed",
            Self::Failed => "failed",
        }
    }

    /// A number for the stats area (0 is "not known").
    pub fn code(self) -> u64 {
        match self {
            Self::Off => 1,
            Self::Pending => 2,
            Self::Shared => 3,
            Self::NotFound => 4,
            Self::Refused => 5,
            Self::ProofFailed => 6,
            Self::Failed => 7,
        }
    }

    /// The state of a [`Self::code`].
    pub fn from_code(c: u64) -> Option<Self> {
        [
            Self::Off,
            Self::Pending,
            Self::Shared,
            Self::NotFound,
            Self::Refused,
            Self::ProofFailed,
            Self::Failed,
        ]
        .into_iter()
        .find(|s| s.code() == c)
    }
}

/// The QP's shared memory broke (peer wrote garbage, or an access was refused).
#[derive(Debug)]
pub(crate) struct ShmFault(pub(crate) &'static str);

impl ShmQp {
    pub(crate) fn new(arena: Arc<Arena>) -> io::Result<Self> {
        let seg = Arc::new(Segment::create(
            "smcr-ring",
            Ring::bytes(RING_SLOTS, RING_SLOT),
        )?);
        let inbound = Ring::create(seg.clone(), 0, RING_SLOTS, RING_SLOT)
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Self {
            arena,
            inbound,
            inbound_seg: seg,
            offered: None,
            live: None,
            tx: None,
            active: false,
            backlog: VecDeque::new(),
            rx: None,
            ring_bell: 0,
            rang: 0,
            rang_full: false,
            fault: None,
            held: VecDeque::new(),
            wait_until: None,
            hello: None,
            offer_sent: false,
            rq_psn: None,
            sq_psn: None,
            not_found: false,
            refused: false,
        })
    }

    /// What became of the sharing so far.
    pub(crate) fn state(&self) -> SameHost {
        match self.fault {
            _ if self.active => SameHost::Shared,
            Some(f) if f.contains("proof") => SameHost::ProofFailed,
            Some(_) => SameHost::Failed,
            None if self.not_found => SameHost::NotFound,
            None if self.refused => SameHost::Refused,
            None => SameHost::Pending,
        }
    }

    /// The pair's secret with this QP as the initiator (its offer), once both PSNs are known.
    pub(crate) fn as_initiator(&self, rc: &RcQp) -> Option<Pairing> {
        Some(Pairing {
            initiator_qpn: rc.qp_num(),
            responder_qpn: rc.dest_qp_num(),
            initiator_psn: self.sq_psn?,
            responder_psn: self.rq_psn?,
        })
    }

    /// The pair's secret with this QP as the responder (the peer's offer), in RTS only.
    pub(crate) fn as_responder(&self, rc: &RcQp) -> Option<Pairing> {
        if rc.state() != crate::rc::QpState::Rts {
            return None;
        }
        Some(Pairing {
            initiator_qpn: rc.dest_qp_num(),
            responder_qpn: rc.qp_num(),
            initiator_psn: self.rq_psn?,
            responder_psn: self.sq_psn?,
        })
    }

    /// The descriptors an offer carries (arena, ring segment) besides the doorbell.
    pub(crate) fn offer_fds(&self) -> [BorrowedFd<'_>; 2] {
        [self.arena.fd(), self.inbound_seg.fd()]
    }

    /// Forgets the peer (QP reset or failed): closing our offer tells the peer. With `rc`
    /// (the QP entered the error state), requests still waiting for ring space and a message
    /// being received complete as flushed; without it (reset) they are dropped, as a reset
    /// empties the work queues.
    pub(crate) fn disconnect(&mut self, rc: Option<&mut RcQp>) {
        self.offered = None;
        self.live = None;
        self.tx = None;
        self.rang = 0;
        self.active = false;
        self.wait_until = None;
        self.hello = None;
        self.offer_sent = false;
        let backlog = std::mem::take(&mut self.backlog);
        let held = std::mem::take(&mut self.held);
        let cur = self.rx.take();
        if let Some(rc) = rc {
            for h in held {
                let w = wc(rc, h.wr_id, WcStatus::WrFlushErr, &h.op, 0);
                rc.push_completion(CqSide::Send, w);
            }
            for b in backlog {
                let w = wc(rc, b.wr_id, WcStatus::WrFlushErr, &b.op, 0);
                rc.push_completion(CqSide::Send, w);
            }
            if let Some(cur) = cur {
                let mut w = wc(rc, cur.wqe.wr_id, WcStatus::WrFlushErr, &WrOpcode::Send, 0);
                w.opcode = WcOpcode::Recv;
                rc.push_completion(CqSide::Recv, w);
            }
        }
    }

    /// Switches to shared memory if the peer's offer matches this QP's peer (its QPN and
    /// address; the port is not compared: devices that share the RoCE port are told apart by
    /// their QPN ranges) and nothing is in flight on UDP; returns whether requests go through
    /// shared memory.
    pub(crate) fn ready(&mut self, rc: &RcQp, av: Option<SocketAddrV4>) -> bool {
        if self.active {
            return true;
        }
        let Some(tx) = &self.tx else { return false };
        if rc.state() != crate::rc::QpState::Rts
            || rc.send_queue_len() != 0
            || tx.from_qpn != rc.dest_qp_num()
            || av.map(|a| *a.ip()) != Some(*tx.from.ip())
        {
            return false;
        }
        self.active = true;
        true
    }

    /// Whether send requests should wait for the peer's offer instead of going out over UDP:
    /// our own offer reached a device on this host (its QP will offer back at its RTR → RTS),
    /// and the wait ([`OFFER_WAIT`]) is not over.
    pub(crate) fn awaiting(&self, now: std::time::Instant) -> bool {
        !self.active
            && self.tx.is_none()
            && self.offered.is_some()
            && self.wait_until.is_some_and(|t| now < t)
    }

    /// When held requests must go over UDP if no offer came (for the QP's timer).
    pub(crate) fn hold_deadline(&self) -> Option<std::time::Instant> {
        if self.held.is_empty() {
            None
        } else {
            self.wait_until
        }
    }

    /// Requests held for the peer's offer.
    pub(crate) fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Holds a send request until the peer's offer comes (or the wait ends): checked now as
    /// `post_send` checks it (state, queue room, local memory), run later.
    pub(crate) fn hold(
        &mut self,
        rc: &RcQp,
        wr: &SendWr<'_>,
        mrs: &MrTable,
    ) -> Result<(), PostError> {
        if rc.state() != crate::rc::QpState::Rts {
            return Err(PostError::InvalidState(rc.state()));
        }
        if self.held.len() + rc.send_queue_len() >= rc.caps().max_send_wr as usize {
            return Err(PostError::QueueFull);
        }
        rc.resolve_send_sgl(wr, mrs)?;
        self.held.push_back(Held {
            wr_id: wr.wr_id,
            op: wr.opcode,
            sges: wr.sg_list.to_vec(),
            flags: wr.flags,
        });
        Ok(())
    }

    /// Releases held requests, in order and before anything posted later: through shared
    /// memory once the peer's offer is here, over UDP (posted to `rc`) once the wait is over
    /// or the peer refused our offer. They were deferred when posted, so each produces a
    /// completion if it asked for one when deferred.
    pub(crate) fn settle(
        &mut self,
        rc: &mut RcQp,
        av: Option<SocketAddrV4>,
        now: std::time::Instant,
        mrs: &MrTable,
    ) {
        if self.held.is_empty() {
            return;
        }
        let shm = self.ready(rc, av);
        if !shm && self.awaiting(now) && rc.state() == crate::rc::QpState::Rts {
            return;
        }
        for h in std::mem::take(&mut self.held) {
            let mut flags = h.flags;
            if flags.contains(SendFlags::SIGNAL_IF_DEFERRED) {
                flags |= SendFlags::SIGNALED;
            }
            let wr = SendWr {
                wr_id: h.wr_id,
                opcode: h.op,
                sg_list: &h.sges,
                flags,
            };
            let r = if shm {
                self.post(rc, &wr, mrs).map(drop)
            } else {
                rc.post_send(&wr, mrs)
            };
            if r.is_err() {
                // The memory went away meanwhile (or the state changed): the request fails.
                let w = wc(rc, h.wr_id, WcStatus::LocProtErr, &h.op, 0);
                rc.push_completion(CqSide::Send, w);
            }
        }
    }
}

fn wc(rc: &RcQp, wr_id: u64, status: WcStatus, op: &WrOpcode, byte_len: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode: match op {
            WrOpcode::RdmaRead { .. } => WcOpcode::RdmaRead,
            WrOpcode::RdmaWrite { .. } | WrOpcode::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            _ => WcOpcode::Send,
        },
        byte_len,
        imm_data: None,
        qp_num: rc.qp_num(),
    }
}

#[cfg(test)]
pub(crate) mod tests;

/// Fuzzing entry point: `data` cut into ring entries (a length byte, then that many bytes)
/// is pushed into a consumer QP's inbound ring and delivered; nothing may panic, and the
/// completions stay within the posted receive buffers.
pub(crate) fn fuzz_entries(data: &[u8]) {
    use crate::rc::{QpAttr, QpCaps, QpState, RecvWr, Sge};
    let Ok(arena) = Arena::create() else { return };
    let mrs = MrTable::new(5);
    let Ok(buf) = mrs.register_in(1, 4096, Access::LOCAL_WRITE, Some(&arena)) else {
        return;
    };
    let mut rc = RcQp::new(9, 1, QpCaps::default(), false);
    let _ = rc.modify(&QpAttr::state(crate::rc::QpState::Init));
    for i in 0..8u64 {
        let sge = Sge {
            addr: buf.addr() + i * 512,
            length: 512,
            lkey: buf.key(),
        };
        let _ = rc.post_recv(
            &RecvWr {
                wr_id: i,
                sg_list: &[sge],
            },
            &mrs,
        );
    }
    let _ = rc.modify(&QpAttr {
        path_mtu: Some(crate::rc::Mtu::Mtu1024),
        dest_qp_num: Some(3),
        rq_psn: Some(crate::wire::Psn::new(0)),
        ..QpAttr::state(QpState::Rtr)
    });
    let Ok(mut shm) = ShmQp::new(arena) else {
        return;
    };
    let Ok(prod) = Ring::attach(shm.inbound_seg.clone(), 0) else {
        return;
    };
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = usize::from(n).min(tail.len()).min(prod.max_message());
        let _ = prod.push(&tail[..n]);
        rest = &tail[n..];
        if shm.receive(&mut rc).is_err() {
            return;
        }
    }
    while let Some((_, wc)) = rc.poll_completion() {
        assert!(wc.byte_len <= 512 || wc.opcode == WcOpcode::RecvRdmaWithImm);
    }
}
