//! The same-host transport (issue 7): when both ends of a queue pair run on one host and in
//! one network namespace, the QP moves its requests through shared memory instead of UDP.
//!
//! * Memory regions of a *shared* protection domain ([`crate::Device::alloc_shared_pd`]) live
//!   in that domain's [`Arena`], a sealed memfd. The arena also holds a table of the domain's
//!   regions (rkey, access, offset, length, address) so that a peer can check an rkey before it
//!   copies: a wrong key or range is a `REM_ACCESS_ERR`, as on the wire.
//! * Each QP of a shared domain has an inbound [`Ring`] (it consumes, its peer produces).
//! * At INIT → RTR the QP *offers* both to the peer: it connects to the peer device's
//!   rendezvous socket (an abstract Unix socket named after the device's address, so only
//!   processes in the same network namespace can reach it) and sends the arena, the ring and
//!   its receive CQ's eventfd (the doorbell) with SCM_RIGHTS. Offers are accepted only from
//!   processes of our own user (or root), checked with SO_PEERCRED.
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

use crate::mr::{Access, AccessError, MrTable};
use crate::rc::{
    CqSide, PostError, RcQp, RecvWqe, SendFlags, SendWr, SgList, Sge, WcOpcode, WcStatus,
    WorkCompletion, WrOpcode,
};
use crate::shm::{Ring, RingError, Segment};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

/// Virtual size of an arena (pages are used only when touched).
pub(crate) const ARENA_BYTES: usize = 4 << 30;
const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"SMCRARN1");
const TABLE_AT: usize = 64;
const TABLE_SLOTS: usize = 16384;
const DESC: usize = 32;
const PROBES: usize = 64;
/// Region data starts here (after the table).
const DATA_AT: usize = 1 << 20;
const PAGE: usize = 4096;
const D_VALID: u64 = 1 << 63;
const D_TOMB: u64 = 1 << 62;

/// A shared protection domain's memory: a sealed memfd holding its regions and their table.
pub(crate) struct Arena {
    seg: Segment,
    alloc: Mutex<Alloc>,
}

struct Alloc {
    next: usize,
    free: Vec<(usize, usize)>,
}

impl Arena {
    pub(crate) fn create() -> io::Result<Arc<Self>> {
        let seg = Segment::create("smcr-arena", ARENA_BYTES)?;
        seg.u64_at(0).store(ARENA_MAGIC, Ordering::Release);
        Ok(Arc::new(Self {
            seg,
            alloc: Mutex::new(Alloc {
                next: DATA_AT,
                free: Vec::new(),
            }),
        }))
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }

    /// Zeroed, page-aligned room for `len` bytes: (offset, pointer).
    pub(crate) fn alloc(&self, len: usize) -> io::Result<(usize, NonNull<u8>)> {
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .filter(|s| *s <= ARENA_BYTES)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    "region larger than a shared memory arena",
                )
            })?;
        let mut a = self.alloc.lock();
        let off = if let Some(i) = a.free.iter().position(|&(_, l)| l >= size) {
            let (off, l) = a.free[i];
            if l == size {
                a.free.swap_remove(i);
            } else {
                a.free[i] = (off + size, l - size);
            }
            off
        } else {
            let off = a.next;
            if off.checked_add(size).is_none_or(|e| e > self.seg.len()) {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    "shared memory arena of the protection domain is full",
                ));
            }
            a.next = off + size;
            off
        };
        // SAFETY: `off + size` is inside the mapping.
        let ptr = unsafe { self.seg.base_ptr().add(off) };
        Ok((off, NonNull::new(ptr).expect("mapping is not null")))
    }

    /// Unpublishes `key` and gives `[off, off + len)` back (zeroed).
    pub(crate) fn release(&self, key: u32, off: usize, len: usize) {
        // `alloc` checked that this cannot overflow.
        let size = len.max(1).next_multiple_of(PAGE);
        let mut a = self.alloc.lock();
        if let Some(d) = self.find(&a, key) {
            self.seg.u64_at(d).store(D_TOMB, Ordering::Release);
        }
        self.seg.punch(off, size);
        a.free.push((off, size));
    }

    fn find(&self, _held: &Alloc, key: u32) -> Option<usize> {
        let h = (key >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Relaxed);
            if w == 0 {
                return None;
            }
            if w & D_VALID != 0 && w as u32 == key {
                return Some(d);
            }
        }
        None
    }

    /// Makes region `key` visible to peers.
    pub(crate) fn publish(
        &self,
        key: u32,
        access: Access,
        off: usize,
        len: usize,
        iova: u64,
    ) -> io::Result<()> {
        let _a = self.alloc.lock();
        let h = (key >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Relaxed);
            if w == 0 || w == D_TOMB {
                self.seg.u64_at(d + 8).store(off as u64, Ordering::Relaxed);
                self.seg.u64_at(d + 16).store(len as u64, Ordering::Relaxed);
                self.seg.u64_at(d + 24).store(iova, Ordering::Relaxed);
                let word = D_VALID | u64::from(access.bits() & 0xff) << 32 | u64::from(key);
                self.seg.u64_at(d).store(word, Ordering::Release);
                return Ok(());
            }
        }
        Err(io::Error::new(
            io::ErrorKind::OutOfMemory,
            "shared memory arena: region table full",
        ))
    }
}

/// A peer's arena, mapped here. Its table and sizes are untrusted.
pub(crate) struct PeerArena {
    seg: Segment,
}

impl PeerArena {
    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        let seg = Segment::open(fd)?;
        if seg.len() < DATA_AT || seg.u64_at(0).load(Ordering::Acquire) != ARENA_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a memory arena",
            ));
        }
        Ok(Self { seg })
    }

    /// The arena offset of `[va, va + len)` in the peer's region `rkey`, checked against the
    /// peer's table (key, rights, bounds) as the peer's responder would.
    pub(crate) fn lookup(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<usize, AccessError> {
        let h = (rkey >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Acquire);
            if w == 0 {
                break;
            }
            if w & D_VALID == 0 || w as u32 != rkey {
                continue;
            }
            let off = self.seg.u64_at(d + 8).load(Ordering::Relaxed);
            let rlen = self.seg.u64_at(d + 16).load(Ordering::Relaxed);
            let iova = self.seg.u64_at(d + 24).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.seg.u64_at(d).load(Ordering::Relaxed) != w {
                break; // changed while read: the region is going away
            }
            let access = Access::from_bits_truncate((w >> 32) as u32 & 0xff);
            if !access.contains(need) {
                return Err(AccessError::NotPermitted { need });
            }
            let inside = va
                .checked_sub(iova)
                .filter(|o| o.checked_add(len).is_some_and(|e| e <= rlen));
            let Some(rel) = inside else {
                return Err(AccessError::OutOfBounds { addr: va, len });
            };
            // The table itself may lie: the range must be inside the mapping.
            let start = off.checked_add(rel).filter(|s| *s >= DATA_AT as u64);
            return match start {
                Some(s)
                    if s.checked_add(len)
                        .is_some_and(|e| e <= self.seg.len() as u64) =>
                {
                    Ok(s as usize)
                }
                _ => Err(AccessError::BadKey(rkey)),
            };
        }
        Err(AccessError::BadKey(rkey))
    }
}

// ---- the offer ----------------------------------------------------------------------------

const OFFER_MAGIC: u64 = u64::from_le_bytes(*b"SMCRSHO1");
pub(crate) const OFFER_LEN: usize = 32;

/// What a QP tells its peer when it offers its shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The QP the offer is for (the peer's QPN).
    pub(crate) to_qpn: u32,
    /// The offering QP.
    pub(crate) from_qpn: u32,
    /// The offering device's address.
    pub(crate) from: SocketAddrV4,
}

impl Offer {
    pub(crate) fn emit(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..8].copy_from_slice(&OFFER_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..16].copy_from_slice(&self.to_qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.from_qpn.to_le_bytes());
        b[20..24].copy_from_slice(&self.from.ip().octets());
        b[24..26].copy_from_slice(&self.from.port().to_le_bytes());
        b
    }

    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        if b.len() != OFFER_LEN
            || b[..8] != OFFER_MAGIC.to_le_bytes()
            || b[8..12] != 1u32.to_le_bytes()
        {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let ip: [u8; 4] = b[20..24].try_into().expect("4 bytes");
        Some(Self {
            to_qpn: u32_at(12),
            from_qpn: u32_at(16),
            from: SocketAddrV4::new(ip.into(), u16::from_le_bytes([b[24], b[25]])),
        })
    }
}

/// The abstract Unix socket name of the device at `ip` whose QPNs are in `range` (per network
/// namespace): a peer finds it from our address and the QPN it sends to.
fn rendezvous_name(ip: Ipv4Addr, range: u32) -> String {
    format!("smcr-rdma/{ip}/{range:03x}")
}

fn rendezvous_addr(ip: Ipv4Addr, range: u32) -> rustix::net::SocketAddrUnix {
    rustix::net::SocketAddrUnix::new_abstract_name(rendezvous_name(ip, range).as_bytes())
        .expect("short name")
}

/// Binds the rendezvous socket of the device at `ip` with QPN range `range` (non-blocking
/// listener). EADDRINUSE: another device of this namespace has the range.
pub(crate) fn listen(ip: Ipv4Addr, range: u32) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = crate::fdzone::place(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)?;
    rustix::net::bind(&fd, &rendezvous_addr(ip, range))?;
    rustix::net::listen(&fd, 64)?;
    Ok(fd)
}

/// Whether the process at the other end of `conn` may share memory with us: the same user,
/// or root on either side.
pub(crate) fn trusted(conn: BorrowedFd<'_>) -> bool {
    match rustix::net::sockopt::socket_peercred(conn) {
        Ok(c) => {
            let me = rustix::process::geteuid();
            c.uid == me || c.uid.is_root() || me.is_root()
        }
        Err(_) => false,
    }
}

/// Connects to the rendezvous of the device at `peer` that owns QPN `offer.to_qpn` and sends
/// `offer` with our arena, our inbound ring's segment and our doorbell. Returns the connection
/// (kept open: closing it tells the peer we are gone), or `None` when the peer is not
/// reachable this way.
pub(crate) fn send_offer(
    peer: Ipv4Addr,
    offer: &Offer,
    fds: [BorrowedFd<'_>; 4],
) -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .ok()
    .and_then(|fd| crate::fdzone::place(fd).ok())?;
    let range = crate::transport::steer::range_of(offer.to_qpn);
    rustix::net::connect(&fd, &rendezvous_addr(peer, range)).ok()?;
    if !trusted(fd.as_fd()) {
        return None;
    }
    crate::shm::send_fds(fd.as_fd(), &fds, &offer.emit()).ok()?;
    Some(fd)
}

// ---- a QP's same-host state ---------------------------------------------------------------

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

/// Waiting-word bit: the consumer's CQ notification descriptor has a sleeper (its poller).
pub(crate) const WAIT_EVENT: u32 = 1;
/// Waiting-word bit: a driver (an application thread handling completions itself) sleeps on
/// the CQ's driver descriptor.
pub(crate) const WAIT_DRIVER: u32 = 2;

/// What the peer offered: where our requests go.
pub(crate) struct PeerTx {
    pub(crate) from_qpn: u32,
    pub(crate) from: SocketAddrV4,
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
    pub(crate) fn new(offer: &Offer, fds: Vec<OwnedFd>, conn: OwnedFd) -> io::Result<Self> {
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
            from_qpn: offer.from_qpn,
            from: offer.from,
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

/// How long requests wait for a same-host peer's offer before they go over UDP.
pub(crate) const OFFER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A message being received into a receive request.
struct RxCur {
    wqe: RecvWqe,
    op: u8,
    imm: u32,
    total: usize,
    done: usize,
}

/// Same-host state of a QP in a shared protection domain.
pub(crate) struct ShmQp {
    pub(crate) arena: Arc<Arena>,
    inbound: Ring,
    inbound_seg: Arc<Segment>,
    /// Our offer's connection to the peer.
    pub(crate) offered: Option<OwnedFd>,
    /// The peer's offer, once it came.
    pub(crate) tx: Option<PeerTx>,
    /// Requests go through shared memory (sticky once set).
    pub(crate) active: bool,
    backlog: VecDeque<Backlog>,
    rx: Option<RxCur>,
    /// Which of the peer's doorbells to ring (its waiting word: [`WAIT_EVENT`],
    /// [`WAIT_DRIVER`]).
    ring_bell: u32,
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
            tx: None,
            active: false,
            backlog: VecDeque::new(),
            rx: None,
            ring_bell: 0,
            rang_full: false,
            fault: None,
            held: VecDeque::new(),
            wait_until: None,
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
        self.tx = None;
        self.active = false;
        self.wait_until = None;
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
    /// our own offer reached a device on this host (its QP will offer back at its INIT → RTR),
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
        let need = if matches!(wr.opcode, WrOpcode::RdmaRead { .. }) {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        SgList::resolve(
            mrs,
            rc.pd(),
            wr.sg_list,
            rc.caps().max_send_sge as usize,
            need,
        )?;
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

    /// Executes (or queues, if the peer's ring is full) one send request; returns whether it
    /// ran at once.
    pub(crate) fn post(
        &mut self,
        rc: &mut RcQp,
        wr: &SendWr<'_>,
        mrs: &MrTable,
    ) -> Result<bool, PostError> {
        match rc.state() {
            crate::rc::QpState::Rts => {}
            crate::rc::QpState::Error => {
                rc.push_completion(
                    CqSide::Send,
                    wc(rc, wr.wr_id, WcStatus::WrFlushErr, &wr.opcode, 0),
                );
                return Ok(false);
            }
            s => return Err(PostError::InvalidState(s)),
        }
        if self.backlog.len() >= rc.caps().max_send_wr as usize {
            return Err(PostError::QueueFull);
        }
        let need = if matches!(wr.opcode, WrOpcode::RdmaRead { .. }) {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        let sgl = SgList::resolve(
            mrs,
            rc.pd(),
            wr.sg_list,
            rc.caps().max_send_sge as usize,
            need,
        )?;
        let signaled = wr.flags.contains(SendFlags::SIGNALED) || rc.sq_sig_all();
        self.backlog.push_back(Backlog {
            wr_id: wr.wr_id,
            op: wr.opcode,
            signaled,
            sgl,
            done: 0,
            owned: None,
            written: false,
        });
        self.flush(rc);
        let Some(b) = self.backlog.back_mut() else {
            return Ok(true);
        };
        // Deferred: it completes later; the caller may still reuse a SEND's buffer.
        if wr.flags.contains(SendFlags::SIGNAL_IF_DEFERRED) {
            b.signaled = true;
        }
        if b.owned.is_none() && matches!(b.op, WrOpcode::Send | WrOpcode::SendWithImm(_)) {
            let mut v = vec![0u8; b.sgl.len()];
            b.sgl.gather(0, &mut v);
            b.owned = Some(v);
        }
        Ok(false)
    }

    /// Copies `data` into the peer's memory at `remote_addr` (checked against `rkey` as an
    /// RDMA WRITE is), from the caller's buffer rather than a local region: `false` if there
    /// is no peer yet or the check fails (then post the WRITE, which reports it).
    pub(crate) fn write_direct(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        let Some(tx) = &self.tx else { return false };
        let Ok(off) = tx
            .arena
            .lookup(rkey, remote_addr, data.len() as u64, Access::REMOTE_WRITE)
        else {
            return false;
        };
        // SAFETY: `data` is valid for its length; the destination was checked by `lookup`.
        unsafe { tx.arena.seg.copy_in_raw(off, data.as_ptr(), data.len()) }
    }

    /// Requests still waiting for ring space.
    pub(crate) fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Executes queued requests in order until the peer's ring is full.
    pub(crate) fn flush(&mut self, rc: &mut RcQp) {
        while let Some(b) = self.backlog.front_mut() {
            if rc.state() != crate::rc::QpState::Rts {
                let b = self.backlog.pop_front().expect("non-empty");
                rc.push_completion(
                    CqSide::Send,
                    wc(rc, b.wr_id, WcStatus::WrFlushErr, &b.op, 0),
                );
                continue;
            }
            let Some(tx) = &self.tx else { return };
            match execute(tx, b, &mut self.ring_bell, &mut self.rang_full) {
                Ok(true) => {
                    let b = self.backlog.pop_front().expect("non-empty");
                    if b.signaled {
                        let n = b.sgl.len() as u32;
                        rc.push_completion(
                            CqSide::Send,
                            wc(rc, b.wr_id, WcStatus::Success, &b.op, n),
                        );
                    }
                }
                Ok(false) => return, // ring full: retried later
                Err(status) => {
                    let b = self.backlog.pop_front().expect("non-empty");
                    rc.push_completion(CqSide::Send, wc(rc, b.wr_id, status, &b.op, 0));
                    rc.fail();
                    self.disconnect(Some(rc));
                    return;
                }
            }
        }
    }

    /// Wakes the peer if it sleeps and we gave it something since the last call.
    pub(crate) fn ring_bell(&mut self) {
        let word = std::mem::take(&mut self.ring_bell);
        if word != 0
            && let Some(tx) = &self.tx
        {
            if word & WAIT_EVENT != 0 {
                let _ = rustix::io::write(&tx.bell, &1u64.to_ne_bytes());
            }
            if word & WAIT_DRIVER != 0 {
                let _ = rustix::io::write(&tx.bell_driver, &1u64.to_ne_bytes());
            }
        }
    }

    /// Something in the inbound ring can be delivered now.
    pub(crate) fn rx_pending(&self, rc: &RcQp) -> bool {
        !self.inbound.is_empty() && (self.rx.is_some() || rc.has_recv())
    }

    /// Tells producers who of us sleeps ([`WAIT_EVENT`], [`WAIT_DRIVER`]; 0: nobody).
    pub(crate) fn set_waiting(&self, word: u32) {
        self.inbound.set_waiting_word(word);
    }

    /// Turns inbound ring entries into receive completions while receive requests are posted.
    /// Returns how many messages completed.
    pub(crate) fn receive(&mut self, rc: &mut RcQp) -> Result<usize, ShmFault> {
        let mut buf = [0u8; RING_SLOT];
        let mut n = 0;
        loop {
            if self.inbound.is_empty() || (self.rx.is_none() && !rc.has_recv()) {
                return Ok(n);
            }
            let len = match self.inbound.pop(&mut buf) {
                Ok(Some(l)) => l,
                Ok(None) => return Ok(n),
                Err(RingError::Corrupt(w)) => return Err(ShmFault(w)),
                Err(_) => return Err(ShmFault("oversized ring entry")),
            };
            if len < E_HDR {
                return Err(ShmFault("short ring entry"));
            }
            let (op, flags) = (buf[0], buf[1]);
            let imm = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
            let total = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
            let data = &buf[E_HDR..len];
            if !matches!(op, E_SEND | E_SEND_IMM | E_WRITE_IMM) {
                return Err(ShmFault("unknown ring entry"));
            }
            if flags & F_FIRST != 0 {
                if self.rx.is_some() {
                    return Err(ShmFault("message started inside another"));
                }
                let wqe = rc.take_recv().ok_or(ShmFault("no receive request"))?;
                if op != E_WRITE_IMM && total > wqe.sgl.len() {
                    // Too long for the receive buffers: as on the wire, the receive fails
                    // and the QP enters the error state.
                    rc.push_completion(
                        CqSide::Recv,
                        WorkCompletion {
                            wr_id: wqe.wr_id,
                            status: WcStatus::LocLenErr,
                            opcode: WcOpcode::Recv,
                            byte_len: 0,
                            imm_data: None,
                            qp_num: rc.qp_num(),
                        },
                    );
                    return Err(ShmFault("message longer than the receive request"));
                }
                self.rx = Some(RxCur {
                    wqe,
                    op,
                    imm,
                    total,
                    done: 0,
                });
            }
            let Some(cur) = self.rx.as_mut() else {
                return Err(ShmFault("continuation without a message"));
            };
            if op != cur.op
                || data.len() > cur.total - cur.done
                || (op == E_WRITE_IMM && !data.is_empty())
            {
                return Err(ShmFault("ring entry does not continue its message"));
            }
            cur.wqe.sgl.scatter(cur.done, data);
            cur.done += data.len();
            if flags & F_LAST != 0 {
                let cur = self.rx.take().expect("set above");
                if cur.op != E_WRITE_IMM && cur.done != cur.total {
                    return Err(ShmFault("message shorter than announced"));
                }
                rc.push_completion(
                    CqSide::Recv,
                    WorkCompletion {
                        wr_id: cur.wqe.wr_id,
                        status: WcStatus::Success,
                        opcode: if cur.op == E_WRITE_IMM {
                            WcOpcode::RecvRdmaWithImm
                        } else {
                            WcOpcode::Recv
                        },
                        byte_len: cur.total as u32,
                        imm_data: (cur.op != E_SEND).then_some(cur.imm),
                        qp_num: rc.qp_num(),
                    },
                );
                n += 1;
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

/// Runs `b` against the peer: `Ok(true)` done, `Ok(false)` the ring is full (progress kept in
/// `b`), `Err` a failed request.
fn execute(
    tx: &PeerTx,
    b: &mut Backlog,
    bell: &mut u32,
    rang_full: &mut bool,
) -> Result<bool, WcStatus> {
    let len = b.sgl.len();
    match b.op {
        WrOpcode::RdmaWrite { remote_addr, rkey }
        | WrOpcode::RdmaWriteWithImm {
            remote_addr, rkey, ..
        } => {
            if !b.written {
                let off = tx
                    .arena
                    .lookup(rkey, remote_addr, len as u64, Access::REMOTE_WRITE)
                    .map_err(|_| WcStatus::RemAccessErr)?;
                b.sgl.raw_pieces(0, len, |p, n, done| {
                    // SAFETY: `p` is valid for `n` bytes (a piece of a resolved local SGE);
                    // the destination was checked against the mapping by `lookup`.
                    unsafe { tx.arena.seg.copy_in_raw(off + done, p, n) };
                });
                b.written = true;
            }
            if let WrOpcode::RdmaWriteWithImm { imm, .. } = b.op {
                return push(
                    tx,
                    E_WRITE_IMM,
                    F_FIRST | F_LAST,
                    imm,
                    len,
                    &[],
                    bell,
                    rang_full,
                );
            }
            Ok(true)
        }
        WrOpcode::RdmaRead { remote_addr, rkey } => {
            let off = tx
                .arena
                .lookup(rkey, remote_addr, len as u64, Access::REMOTE_READ)
                .map_err(|_| WcStatus::RemAccessErr)?;
            b.sgl.raw_pieces(0, len, |p, n, done| {
                // SAFETY: as above, in the other direction.
                unsafe { tx.arena.seg.copy_out_raw(off + done, p, n) };
            });
            Ok(true)
        }
        WrOpcode::Send | WrOpcode::SendWithImm(_) => {
            let (op, imm) = match b.op {
                WrOpcode::SendWithImm(i) => (E_SEND_IMM, i),
                _ => (E_SEND, 0),
            };
            let mut chunk = [0u8; E_DATA];
            loop {
                let take = (len - b.done).min(E_DATA);
                let mut flags = 0;
                if b.done == 0 {
                    flags |= F_FIRST;
                }
                if b.done + take == len {
                    flags |= F_LAST;
                }
                match &b.owned {
                    Some(v) => chunk[..take].copy_from_slice(&v[b.done..b.done + take]),
                    None => b.sgl.gather(b.done, &mut chunk[..take]),
                }
                if !push(tx, op, flags, imm, len, &chunk[..take], bell, rang_full)? {
                    return Ok(false);
                }
                b.done += take;
                if b.done == len {
                    return Ok(true);
                }
            }
        }
    }
}

/// Pushes one ring entry; `Ok(false)` if the ring is full.
#[allow(clippy::too_many_arguments)] // one entry's fields and the caller's doorbell state
fn push(
    tx: &PeerTx,
    op: u8,
    flags: u8,
    imm: u32,
    total: usize,
    data: &[u8],
    bell: &mut u32,
    rang_full: &mut bool,
) -> Result<bool, WcStatus> {
    let mut e = [0u8; RING_SLOT];
    e[0] = op;
    e[1] = flags;
    e[4..8].copy_from_slice(&imm.to_le_bytes());
    e[8..12].copy_from_slice(&(total as u32).to_le_bytes());
    e[E_HDR..E_HDR + data.len()].copy_from_slice(data);
    match tx.ring.push_word(&e[..E_HDR + data.len()]) {
        Ok(waiting) => {
            *bell |= waiting;
            *rang_full = false;
            Ok(true)
        }
        Err(RingError::Full) => {
            // The consumer may sleep with a full ring: make sure it looks, once.
            if !std::mem::replace(rang_full, true) {
                *bell |= WAIT_EVENT | WAIT_DRIVER;
            }
            Ok(false)
        }
        // The peer's ring is garbage or too small: the request fails.
        Err(_) => Err(WcStatus::RemOpErr),
    }
}

#[cfg(test)]
mod tests;

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
