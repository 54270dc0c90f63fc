//! The driver: runs the sans-IO cores ([`crate::handshake`], [`crate::link`], [`crate::conn`])
//! over a real TCP socket and the `rdma` engine.
//!
//! One [`Runtime`] per process (or per test). It owns one RDMA device per local IPv4 address
//! (bound to UDP `roce_port`, 4791 by default, where a Linux peer sends RoCE), and the link
//! groups: one RC queue pair each, shared by up to `max_conns` connections to the same peer.
//! Each link group has a poller thread that waits on its completion queue: it runs the LLC
//! conversation, hands CDC messages to connections and wakes their readers and writers.
//! Application threads do their own copies and post their own RDMA WRITEs and CDC SENDs.
//!
//! Lock order: a connection's lock before its link group's lock; the poller never holds the
//! link group's lock while taking a connection's.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cdc::{CdcMessage, ConnStateFlags, ProducerFlags};
use clc::{Eid, Gid, Mac, PeerId, QpMtu};
use llc::Version;
use parking_lot::Condvar;
use rdma::locks::Mutex;
use rdma::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, Mtu, ProtectionDomain, Psn,
    QpAttr, QpCaps, QpState, QueuePair, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus,
    WorkCompletion, WrOpcode,
};

use crate::conn::ConnCore;
use crate::error::{ConnFailure, PostFailure, SetupError, Unreachable};
use crate::group::{GroupCore, GroupDown, GroupEvent, PathIds, RkeyError};
use crate::handshake;
use crate::lgr::{LgrCore, Route, Slot};
use crate::link::{self, LinkParams};
use crate::option::OptionRecords;
use hold::Hold;

mod api;
mod clock;
mod config;
mod connection;
mod drive;
mod events;
mod hold;
mod inner;
mod lgroup;
mod post;
#[cfg(test)]
mod tests;

pub(crate) use config::flag as config_flag;
pub use config::{
    ConfigError, DEFAULT_UEID, LINGER, RdmaDevice, RuntimeConfig, STATS_CONN_SLOTS, STATS_LG_SLOTS,
};
pub(crate) use connection::{ConnShared, StatRef};
pub use connection::{ConnStats, Readiness, ReadyState};
pub(crate) use events::pinning_note;

/// How a connection learns that its peer can do SMC-R.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Negotiation {
    /// TCP option 254 in SYN/SYN-ACK, through the eBPF program pinned under `dir` (as Linux).
    TcpOption {
        /// Where the program is pinned ([`crate::option::DEFAULT_DIR`]).
        dir: PathBuf,
    },
    /// Assume the peer speaks SMC-R and start the CLC handshake at once. Only for peers known
    /// to be ours (tests, closed deployments): a plain TCP peer would see CLC bytes.
    Assume,
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Not security relevant (PSNs, ids): fall back to the clock.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return t.subsec_nanos() ^ std::process::id();
    }
    u32::from_ne_bytes(b)
}

/// A process's SMC-R state: devices, link groups, settings. Cheap to clone (a handle); make
/// one per process and pass it to [`SmcStream::connect`](crate::SmcStream::connect) and
/// [`SmcListener::bind`](crate::SmcListener::bind).
///
/// ```no_run
/// use smcr::{Negotiation, Runtime, RuntimeConfig};
///
/// let mut cfg = RuntimeConfig::new();
/// // As Linux: the TCP option in SYN/SYN-ACK tells a peer that can do SMC-R (needs the option
/// // program installed once as root). `Negotiation::Assume` skips it for known peers.
/// cfg.negotiation = Negotiation::TcpOption { dir: smcr::option::DEFAULT_DIR.into() };
/// let rt = Runtime::new(cfg);
/// println!("{rt:?}");
/// // ... connect and listen with `rt` ...
/// rt.shutdown();
/// ```
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: RuntimeConfig,
    pub(crate) option: Result<OptionRecords, String>,
    devices: Mutex<HashMap<Ipv4Addr, Arc<Dev>>>,
    groups: Mutex<Vec<Arc<LinkGroup>>>,
    next_token: AtomicU32,
    next_lgr: AtomicU32,
    rmb_in_use: Mutex<u64>,
    /// What pinning allows the RMBs (`u64::MAX`: no cap): a verbs device pins every RMB and
    /// send buffer, counted against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK.
    pin_cap: AtomicU64,
    /// CONFIRM LINK exchanges completed (first contacts), for tests and stats.
    pub(crate) links_confirmed: AtomicU32,
    pub(crate) failovers: AtomicU32,
    /// CONFIRM RKEY and DELETE RKEY requests sent.
    pub(crate) rkey_requests: AtomicU32,
    /// This runtime's shared-memory stats area (`smc-stat` reads it), if it could be made.
    pub(crate) stats: Option<Arc<crate::stats::Area>>,
    /// One handshake at a time per (role, peer address), as Linux's `smc_*_lgr_pending`: two
    /// concurrent first contacts to one peer would otherwise create two link groups.
    pending: Mutex<HashMap<(bool, Ipv4Addr), PendingLock>>,
    /// Stats records of fallback sockets the application holds (see
    /// [`crate::SmcStream::hand_over`]), with their descriptor and inode.
    fallback_rows: Mutex<FallbackRows>,
    /// Whether an address is one of this host's (in our network namespace), by address.
    local_addrs: Mutex<HashMap<Ipv4Addr, bool>>,
    /// Why the last connection that could not have SMC-R here could not (a local condition
    /// a decline code alone does not explain), for the program's log.
    problem: Mutex<Option<String>>,
    /// What the link groups' timers run on (the system's clock but in driver tests).
    pub(crate) clock: clock::Clock,
}

#[derive(Default)]
struct FallbackRows {
    rows: Vec<(crate::stats::StatSlot, i32, u64)>,
    /// Where the next partial sweep starts.
    next: usize,
}

/// Serialises the handshakes of one role with one peer.
type PendingLock = Arc<Mutex<()>>;

pub(crate) struct Dev {
    pub(crate) ip: Ipv4Addr,
    /// Its alternate address (a second path for its link groups; see
    /// [`RuntimeConfig::alt_addrs`]).
    pub(crate) alt: Option<Ipv4Addr>,
    pub(crate) device: Device,
    pub(crate) mac: Mac,
}

/// The smaller of two path MTUs (what both ends of a link can take).
pub(crate) fn smaller_mtu(a: QpMtu, b: QpMtu) -> QpMtu {
    if a.bytes() < b.bytes() { a } else { b }
}

/// Path MTU for RoCE on a path whose IP MTU is `ip_mtu`: the largest IB MTU whose packets
/// (payload + IPv4/UDP/BTH/RETH/ICRC, 64 bytes) fit.
pub(crate) fn roce_mtu(ip_mtu: u32) -> QpMtu {
    [
        QpMtu::MTU_4096,
        QpMtu::MTU_2048,
        QpMtu::MTU_1024,
        QpMtu::MTU_512,
    ]
    .into_iter()
    .find(|m| m.bytes().is_some_and(|b| b + 64 <= ip_mtu))
    .unwrap_or(QpMtu::MTU_256)
}

fn rdma_mtu(m: QpMtu) -> Mtu {
    match m.bytes() {
        Some(4096) => Mtu::Mtu4096,
        Some(2048) => Mtu::Mtu2048,
        Some(1024) => Mtu::Mtu1024,
        Some(512) => Mtu::Mtu512,
        _ => Mtu::Mtu256,
    }
}

const SLOT: usize = 128;
const RECV_SLOTS: usize = 256;
const SEND_SLOTS: usize = 1024;
/// Set in a receive's `wr_id` (the slot below it): a completion says by its `wr_id` alone
/// which queue it came from. An error completion's opcode is undefined (libibverbs; rxe
/// leaves 0, `IBV_WC_SEND`, in a flushed receive), and a receive slot taken for a SEND slot
/// freed a SEND in flight: two messages then shared one slot.
const RECV_TAG: u64 = 1 << 62;
/// A send slot never handed out, always zero: the source of the bytes a short WRITE is
/// lengthened by (see [`GSO_WRITE_MIN`]).
const ZERO_SLOT: usize = SEND_SLOTS;
/// On a UDP link, a data WRITE carrying fewer bytes is lengthened into free space of the
/// peer's RMB (with zeros the peer never reads: they lie past its producer cursor) to this
/// many. Its packet is then at least as long as the CDC SEND's (12 + 16 + 28 + 4 = 60 = 12 +
/// 44 + 4 bytes), so the two leave in one GSO datagram (the shorter one last) and cross the
/// network stack once instead of twice.
const GSO_WRITE_MIN: u32 = 28;
/// SEND slots only the poller may take (consumer updates, LLC answers), so it never waits.
const POLLER_RESERVE: usize = 32;

/// One link of a group: a queue pair of the group's device (sharing its protection domain,
/// so the same memory regions and rkeys, its CQ and its SEND slots), with receive slots of
/// its own. Path 0 sends from the device's address, path 1 from the alternate one.
pub(crate) struct Path {
    pub(crate) qp: QueuePair,
    /// Its receive slots are `recv_mr` slots `base..base + RECV_SLOTS`.
    base: usize,
    /// Where the part of an LLC message beyond its slot lands (two-link groups; see
    /// [`LLC_MAX`]): every receive names it after its slot.
    big: Option<MemoryRegion>,
    /// Where the part of an LLC message we send beyond its slot waits until the SEND
    /// completes (two-link groups). A verbs device reads a request's memory when it sends it,
    /// not when it is posted: a buffer deregistered meanwhile fails the request and the whole
    /// queue pair (rxe: a local protection error, reported as a flush of every request). One
    /// long message in flight per path, as Linux has one v2 send buffer per link (smc_wr.c,
    /// `smc_wr_tx_get_v2_slot()`, busy: -EBUSY).
    big_tx: Option<MemoryRegion>,
    /// The SEND slot + 1 whose message uses `big_tx` (0: free).
    big_tx_slot: AtomicUsize,
    /// The local address its packets leave from.
    src: Ipv4Addr,
    /// Our initial PSN (a new one each time the path is set up).
    psn: AtomicU32,
    /// The peer's QP and address on it (its GID's IPv4 address), once connected.
    peer_qpn: AtomicU32,
    peer_ip: AtomicU32,
}

/// The longest LLC message a two-link group sends or takes (Linux's `SMC_WR_BUF_V2_SIZE`):
/// ADD LINK carries one 16-byte rkey entry per RMB of the group, more than a [`SLOT`] holds.
/// The part beyond the slot goes through a buffer of its own (receives: one per path, as
/// Linux has one per link; LLC flows run one at a time).
const LLC_MAX: usize = 8192;

/// Rkey entries one ADD LINK carries (Linux's `SMC_LLC_RKEYS_PER_MSG_V2`): a group with more
/// RMBs adds no link.
const ADD_LINK_MAX_RKEYS: usize = 255;

/// A link group: one link, or two over two paths (the active one carries every connection;
/// the other stands by).
/// A link group's completions and who takes them (job C of the driver contract,
/// docs/architecture.md): its poller by default, an application thread blocked in a call
/// (`drive_blocked`), or an event loop that holds the group between its waits. The methods
/// that use it are in `drive.rs`.
pub(crate) struct Drive {
    cq: CompletionQueue,
    /// The poller's thread, claimed when the group is made (a group that could get none is
    /// never made: NOTHREAD), taken by [`LinkGroup::start`] — the server starts its group
    /// after the client's Confirm, when declining is no longer possible.
    poller: Mutex<Option<rdma::thread::Claim>>,
    /// Which thread takes `cq`'s completions and how it sleeps for them (drives, holds).
    sched: rdma::CqScheduler,
    /// Held by whoever takes and handles completions (the poller, or an application thread in
    /// `progress`), so that they are handled one batch at a time, in order.
    driver: Mutex<()>,
    /// An application thread blocked in a read or write drives the group (one at a time; the
    /// others wait on their connection's condition variable).
    blocking_driver: AtomicBool,
    /// Event-loop threads driving the group from `epoll_wait` keep it driven between their
    /// waits for up to `hold_for` (see [`Hold`]).
    hold: Mutex<Hold>,
    hold_for: Duration,
}

/// A link group's own memory for its control messages (`post.rs` posts from it).
pub(crate) struct Slots {
    /// The group's own protection domain: with a same-host peer its memory is shared with
    /// that peer (and only that peer), so RMBs of other peers are never in reach.
    pd: ProtectionDomain,
    /// The receive slots (CDCs and LLC messages from the peer), one region for every path.
    recv_mr: MemoryRegion,
    /// The SEND slots (our CDCs and LLC messages), and the zeros a short write is padded with.
    send_mr: MemoryRegion,
}

pub(crate) struct LinkGroup {
    pub(crate) id: u32,
    pub(crate) role: link::Role,
    pub(crate) dev: Arc<Dev>,
    /// One path, or two with an alternate local address.
    pub(crate) paths: Vec<Path>,
    /// The active path (low 8 bits) and the failover epoch above them, in one word: a
    /// connection reads both at once, and moves itself to the path (see
    /// [`ConnShared::route`]) before it posts anything there after a failover.
    route: AtomicU64,
    /// The active link's id (for the stats record).
    link_id: AtomicU32,
    /// Who takes the group's completions, and how they sleep for them.
    drive: Drive,
    /// See [`RuntimeConfig::write_pad`].
    write_pad: bool,
    /// See [`RuntimeConfig::rkey_reuse`].
    rkey_reuse: bool,
    /// `smc-stat` shows the link on shared memory.
    shown_shm: AtomicBool,
    /// The group's own memory for its control messages.
    slots: Slots,
    pub(crate) peer_gid: Gid,
    /// The peer's system ID (from its Proposal or Accept): a restarted peer process on the same
    /// address is another system, with link groups of its own (Linux's `smcr_lgr_match`).
    pub(crate) peer_id: PeerId,
    pub(crate) mtu: QpMtu,
    st: Mutex<LgState>,
    cond: Condvar,
    /// What the protocol's timers run on (`Inner::clock`).
    clock: clock::Clock,
    down: AtomicBool,
    runtime: Weak<Inner>,
    /// This group's record in the stats area (freed when the group is).
    stat: Option<LgStat>,
    /// The peer's RMB keys per path (Linux's differ per link). A leaf lock: nothing else is
    /// taken while it is held.
    rtokens: Mutex<crate::rtokens::PeerRtokens>,
}

thread_local! {
    /// This thread is a group's blocking driver (its own wake-ups need no kick).
    static DRIVING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How long a deleted group's poller waits for the peer to acknowledge what was posted
/// before the DELETE LINK: the transport's retries (7 × ~134 ms) fit.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// The longest a link group's poller sleeps when no timer is due.
const IDLE_WAIT: Duration = Duration::from_secs(30);

/// A refused post, as the connection sees it.
/// The TCP socket has bytes, EOF or an error to report (without waiting).
fn tcp_has_input(tcp: &std::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: tcp.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// A connection's data to write (see [`LinkGroup::post_data`]).
#[derive(Clone, Copy)]
pub(crate) struct DataWrites<'a> {
    /// The connection's send buffer.
    pub(crate) sndbuf: &'a MemoryRegion,
    /// (offset in the send buffer and in the peer's RMB, length) pieces.
    pub(crate) pieces: &'a [(u32, u32)],
    /// The peer's RMB: address and rkey.
    pub(crate) peer: (u64, u32),
    /// Free bytes after the last piece in the peer's RMB (see [`GSO_WRITE_MIN`]).
    pub(crate) slack: u32,
}

/// A RoCE device's record in the stats area: the engine bumps its counters there (freed when
/// the engine lets go of it).
struct DevCounters {
    area: Arc<crate::stats::Area>,
    slot: usize,
}

impl rdma::CounterWords for DevCounters {
    fn words(&self) -> &[std::sync::atomic::AtomicU64] {
        self.area.dev_counters(self.slot)
    }
}

impl Drop for DevCounters {
    fn drop(&mut self) {
        self.area.release_dev(self.slot);
    }
}

/// A link group's claimed record in the stats area.
struct LgStat {
    area: Arc<crate::stats::Area>,
    slot: usize,
    /// Serialises writers of the record (the poller and a failing thread may both publish);
    /// true once the record is given back.
    released: Mutex<bool>,
    /// Unix time of creation (ns).
    since: u64,
}

impl LgStat {
    /// Gives the record back (once): a group that is down is gone for smc-stat, as Linux frees
    /// its link group, even while a thread that held it last still keeps the object.
    fn release(&self) {
        let mut released = self.released.lock();
        if !std::mem::replace(&mut *released, true) {
            self.area.release_lg(self.slot);
        }
    }
}

impl Drop for LinkGroup {
    fn drop(&mut self) {
        // The device socket goes back to the engine thread, for the other groups on it.
        if std::mem::take(&mut self.drive.hold.get_mut().rx) {
            self.drive.sched.delegate_rx(false);
        }
    }
}

impl Drop for LgStat {
    fn drop(&mut self) {
        self.release();
    }
}

struct LgState {
    /// The group's state machine (links, failover, healing, rkey flows, LLC queue) with its
    /// bookkeeping (`g.conns`: connections by token, promised tokens, SEND slots, linger).
    g: GroupCore<Arc<ConnShared>>,
    /// A duplicate of each connection's TCP socket, watched for a hang-up (`tcpwatch`): one
    /// without an SMC-R close makes the group probe the link (a killed peer process is found
    /// within seconds).
    watch: HashMap<u32, crate::tcpwatch::Watched>,
    /// RMBs and send buffers of closed connections, reused by later ones (Linux keeps them in
    /// the link group too). An entry is free once no connection holds it any more.
    rmb_pool: Vec<Arc<MemoryRegion>>,
    sndbuf_pool: Vec<Arc<MemoryRegion>>,
    /// Rkeys of our RMBs the peer confirmed (CONFIRM RKEY answered) and still holds: with
    /// `rkey_reuse`, their pooled RMBs need no new CONFIRM RKEY.
    confirmed: HashSet<u32>,
}
