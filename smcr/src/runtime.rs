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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cdc::{CdcMessage, ConnStateFlags, ProducerFlags};
use clc::{Eid, Gid, Mac, PeerId, QpMtu};
use llc::Version;
use parking_lot::{Condvar, Mutex};
use rdma::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, Mtu, ProtectionDomain, Psn,
    QpAttr, QpCaps, QpState, QueuePair, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus,
    WorkCompletion, WrOpcode,
};

use crate::conn::ConnCore;
use crate::error::ConnFailure;
use crate::group::{GroupCore, GroupDown, GroupEvent, PathIds, RkeyError};
use crate::handshake;
use crate::lgr::{LgrCore, Route, Slot};
use crate::link::{self, LinkParams};
use crate::option::OptionMap;

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

/// Runtime settings.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// CLC settings (identity, UEIDs, limits, timeouts).
    pub handshake: handshake::Config,
    /// Size of each connection's receive buffer (RMB); rounded up to Linux's sizes and kept
    /// within 16 KiB..=512 KiB (Linux's SMC-R range).
    pub rmb_size: u32,
    /// UDP port of the RoCE engine (4791, where Linux sends RoCE v2). On 4791 a device shares
    /// the port with the other processes of its address through the steering program
    /// ([`crate::steer`]); another port is bound as given (tests, closed deployments).
    pub roce_port: u16,
    /// Whether the runtime attaches the steering program in its network namespace before it
    /// opens a device on 4791, when it has CAP_NET_ADMIN and CAP_BPF (`SMCR_STEER_ATTACH`:
    /// `off`, `pinned` — the default: when `smcr bpf install` pinned it under the option
    /// program's directory, or [`crate::option::DEFAULT_DIR`] — or `load`: load it there
    /// first if absent).
    pub steer_attach: crate::steer::SteerAttach,
    /// How capability is learned.
    pub negotiation: Negotiation,
    /// LLC keepalive idle time (None: off).
    pub test_link_time: Option<Duration>,
    /// How long a link group without connections is kept for new ones before it is deleted
    /// (DELETE LINK); Linux keeps them 10 minutes.
    pub linger: Duration,
    /// How long the end of a preloaded process may wait for its connections' data to be
    /// acknowledged and its link groups' DELETE LINK to be answered ([`Runtime::end`];
    /// `SMCR_EXIT_DRAIN_MS`, default 2000; 0: no wait, DELETE LINK still sent).
    pub exit_drain: Duration,
    /// Bytes of RMB memory the runtime may hold in total; a server declines with `MEM` beyond it
    /// (0 makes every server handshake decline).
    pub rmb_budget: u64,
    /// Where the shared-memory stats area goes (`None`: no area; `smc-stat` will not see
    /// this process). Default `/dev/shm/smcr`.
    pub stats_dir: Option<PathBuf>,
    /// Link groups with a peer on this host (same network namespace, same user) move data
    /// through shared memory instead of RoCE v2/UDP (`SMCR_SAME_HOST=off` disables it).
    pub same_host: bool,
    /// RMB size for connections to a peer address of this host (`SMCR_SAME_HOST_RMB_KIB`;
    /// default 512 KiB, the most SMC-R allows, unless `SMCR_RMB_KIB` is set, which then
    /// applies to every peer): the RMB bounds what one round trip moves, and on one host
    /// memory is cheaper than wake-ups. Pages are used only as they are written.
    pub same_host_rmb_size: Option<u32>,
    /// RMB size for connections to other hosts (`SMCR_REMOTE_RMB_KIB`; default 512 KiB
    /// unless `SMCR_RMB_KIB` is set): Linux's 64 KiB moves one RMB per round trip of wake-ups,
    /// a fraction of what TCP moves over the same path.
    pub remote_rmb_size: Option<u32>,
    /// How long an event-loop thread that drives a link group from `epoll_wait` keeps it
    /// between two waits (`SMCR_HOLD_US`; 0: hands it back to the poller at once). Meanwhile
    /// what arrives waits for the loop's next `epoll_wait` instead of waking the poller, which
    /// takes the group back once the loop has been away longer than this.
    pub app_hold: Duration,
    /// On UDP links, lengthen a data WRITE shorter than 28 bytes into free space of the
    /// peer's RMB so that it and its CDC leave in one GSO datagram (`SMCR_WRITE_PAD=off`
    /// sends Linux's exact lengths; the peer reads neither way any byte past its producer
    /// cursor). See docs/protocol.md.
    pub write_pad: bool,
    /// A pooled RMB keeps the rkey the peer confirmed for it: a later connection on the group
    /// that reuses it skips CONFIRM RKEY, and a closing one sends no DELETE RKEY (the setup
    /// on an existing group is then one CLC exchange, no LLC round trip on either side).
    /// `SMCR_RKEY_REUSE=off` makes Linux's exchanges (DELETE RKEY when a connection's RMB is
    /// unused, CONFIRM RKEY at its next use). Either way a peer sees valid rkeys only: Linux
    /// looks an rkey up in its rtoken table and keeps entries it is not told to delete.
    pub rkey_reuse: bool,
    /// Faults the RoCE engine injects into the packets it sends (tests; `None`: the
    /// `SMCR_RDMA_FAULTS` environment variable decides, as for any device).
    pub faults: Option<rdma::FaultConfig>,
    /// Other local addresses of this host, each on another path to the peers than the
    /// address a connection's TCP runs over (`SMCR_ALT_ADDRS`, comma-separated). With one, a
    /// link group gets a second link over it (ADD LINK), connections move to it when their
    /// link fails, and the group heals when the path comes back (docs/failover.md). Each
    /// local address the process runs SMC-R on takes the next one not taken (a server on two
    /// addresses lists two). Empty: one link per group (max_links 1 in the CLC handshake).
    pub alt_addrs: Vec<Ipv4Addr>,
}

/// Linux's `SMC_LGR_FREE_DELAY_CLNT`/`_SERV`: 10 minutes.
pub const LINGER: Duration = Duration::from_secs(600);

/// Connection and link-group records in a runtime's stats area (more connections than slots
/// work, unseen by smc-stat).
pub const STATS_CONN_SLOTS: usize = 4096;
/// See [`STATS_CONN_SLOTS`].
pub const STATS_LG_SLOTS: usize = 64;

/// The user EID both ends must share for SMC-Rv2 unless configured otherwise.
pub const DEFAULT_UEID: &str = "SMCR-RS-DEFAULT";

impl RuntimeConfig {
    /// Defaults like Linux's: 64 KiB RMBs, port 4791, TCP-option negotiation.
    pub fn new() -> Self {
        let mut id = [0u8; 8];
        id[..4].copy_from_slice(&std::process::id().to_be_bytes());
        id[4..].copy_from_slice(&(random_u32() as u16).to_be_bytes().repeat(2));
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        Self {
            handshake: handshake::Config::new(
                PeerId(id),
                vec![Eid::new(DEFAULT_UEID).expect("valid EID")],
                host.trim(),
            ),
            rmb_size: 64 * 1024,
            roce_port: 4791,
            steer_attach: crate::steer::SteerAttach::Pinned,
            negotiation: Negotiation::TcpOption {
                dir: crate::option::default_dir(),
            },
            test_link_time: Some(link::TEST_LINK_TIME),
            linger: LINGER,
            exit_drain: Duration::from_secs(2),
            rmb_budget: 1 << 30,
            stats_dir: Some(PathBuf::from(crate::stats::DEFAULT_DIR)),
            same_host: true,
            same_host_rmb_size: Some(512 * 1024),
            remote_rmb_size: Some(512 * 1024),
            app_hold: Duration::from_millis(1),
            write_pad: true,
            rkey_reuse: true,
            faults: None,
            alt_addrs: Vec::new(),
        }
    }
}

impl RuntimeConfig {
    /// Defaults, changed by the environment (how the preload and `smcr run` configure it):
    /// `SMCR_NEGOTIATION=option|assume`, `SMCR_BPF_DIR`, `SMCR_RMB_KIB`, `SMCR_ROCE_PORT`,
    /// `SMCR_UEID` (comma-separated user EIDs), `SMCR_STATS_DIR` (`off`: no stats area),
    /// `SMCR_TESTLINK_TIME` (seconds of link idleness before a TEST LINK, like
    /// `net.smc.smcr_testlink_time`; 0: off), `SMCR_LGR_LINGER` (seconds a link group without
    /// connections is kept before DELETE LINK; default 600 like Linux).
    pub fn from_env() -> Self {
        let mut cfg = Self::new();
        let var = |k: &str| crate::env::var(k).filter(|v| !v.is_empty());
        if let Some(dir) = var("SMCR_BPF_DIR") {
            cfg.negotiation = Negotiation::TcpOption { dir: dir.into() };
        }
        if var("SMCR_NEGOTIATION").as_deref() == Some("assume") {
            cfg.negotiation = Negotiation::Assume;
        }
        if let Some(k) = var("SMCR_RMB_KIB").and_then(|v| v.parse::<u32>().ok()) {
            cfg.rmb_size = k.saturating_mul(1024);
            cfg.same_host_rmb_size = None;
            cfg.remote_rmb_size = None;
        }
        if let Some(p) = var("SMCR_ROCE_PORT").and_then(|v| v.parse::<u16>().ok()) {
            cfg.roce_port = p;
        }
        if let Some(a) = var("SMCR_STEER_ATTACH").and_then(|v| crate::steer::SteerAttach::parse(&v))
        {
            cfg.steer_attach = a;
        }
        if let Some(list) = var("SMCR_UEID") {
            let ueids: Vec<Eid> = list
                .split(',')
                .filter_map(|u| Eid::new(u.trim()).ok())
                .collect();
            if !ueids.is_empty() {
                cfg.handshake.ueids = ueids;
            }
        }
        if matches!(var("SMCR_SAME_HOST").as_deref(), Some("off" | "0" | "no")) {
            cfg.same_host = false;
        }
        if let Some(k) = var("SMCR_SAME_HOST_RMB_KIB").and_then(|v| v.parse::<u32>().ok()) {
            cfg.same_host_rmb_size = Some(k.saturating_mul(1024));
        }
        if let Some(k) = var("SMCR_REMOTE_RMB_KIB").and_then(|v| v.parse::<u32>().ok()) {
            cfg.remote_rmb_size = Some(k.saturating_mul(1024));
        }
        if matches!(var("SMCR_WRITE_PAD").as_deref(), Some("off" | "0" | "no")) {
            cfg.write_pad = false;
        }
        if matches!(var("SMCR_RKEY_REUSE").as_deref(), Some("off" | "0" | "no")) {
            cfg.rkey_reuse = false;
        }
        if let Some(us) = var("SMCR_HOLD_US").and_then(|v| v.parse::<u64>().ok()) {
            cfg.app_hold = Duration::from_micros(us);
        }
        if let Some(list) = var("SMCR_ALT_ADDRS") {
            cfg.alt_addrs = list
                .split(',')
                .filter_map(|a| a.trim().parse().ok())
                .collect();
        }
        // net.smc.smcr_testlink_time: seconds, 0 = off.
        if let Some(s) = var("SMCR_TESTLINK_TIME").and_then(|v| v.parse::<u64>().ok()) {
            cfg.test_link_time = (s > 0).then(|| Duration::from_secs(s));
        }
        if let Some(s) = var("SMCR_LGR_LINGER").and_then(|v| v.parse::<u64>().ok()) {
            cfg.linger = Duration::from_secs(s);
        }
        if let Some(ms) = var("SMCR_EXIT_DRAIN_MS").and_then(|v| v.parse::<u64>().ok()) {
            cfg.exit_drain = Duration::from_millis(ms);
        }
        match var("SMCR_STATS_DIR").as_deref() {
            Some("off") => cfg.stats_dir = None,
            Some(d) => cfg.stats_dir = Some(d.into()),
            None => {}
        }
        cfg
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self::new()
    }
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

/// A process's SMC-R state: devices, link groups, settings.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: RuntimeConfig,
    pub(crate) option: Result<OptionMap, String>,
    devices: Mutex<HashMap<Ipv4Addr, Arc<Dev>>>,
    groups: Mutex<Vec<Arc<LinkGroup>>>,
    next_token: AtomicU32,
    next_lgr: AtomicU32,
    rmb_in_use: Mutex<u64>,
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
}

#[derive(Default)]
struct FallbackRows {
    rows: Vec<(crate::stream::StatSlot, i32, u64)>,
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

impl Runtime {
    /// A runtime with `cfg`. With TCP-option negotiation, the pinned map is opened now; if
    /// that fails every connection falls back to TCP with the reason (see [`crate::Mode`]).
    pub fn new(mut cfg: RuntimeConfig) -> Self {
        if !cfg.alt_addrs.is_empty() {
            // A second path: offer two links per group (Linux's default); without one, a
            // single link, so peers never try to add a link we could not run.
            cfg.handshake.max_links = cfg.handshake.max_links.max(2);
        }
        // No area is no accelerator failure: smc-stat just does not see this process.
        // Areas of processes that are gone (the preload's runtime is never dropped) are
        // removed by whoever starts next.
        let cfg_stats = cfg
            .stats_dir
            .as_deref()
            .and_then(|d| {
                crate::stats::clean_stale(d);
                crate::stats::Area::create(d, STATS_CONN_SLOTS, STATS_LG_SLOTS).ok()
            })
            .map(Arc::new);
        let option = match &cfg.negotiation {
            Negotiation::TcpOption { dir } => OptionMap::open(dir).map_err(|e| e.to_string()),
            Negotiation::Assume => Err("not used".into()),
        };
        if let (Negotiation::TcpOption { .. }, Err(_), Some(a)) =
            (&cfg.negotiation, &option, &cfg_stats)
        {
            a.set_unavailable(crate::FallbackReason::CODE_NO_BPF);
        }
        Self {
            inner: Arc::new(Inner {
                cfg,
                option,
                devices: Mutex::new(HashMap::new()),
                groups: Mutex::new(Vec::new()),
                next_token: AtomicU32::new(random_u32() | 1),
                next_lgr: AtomicU32::new(1),
                rmb_in_use: Mutex::new(0),
                links_confirmed: AtomicU32::new(0),
                failovers: AtomicU32::new(0),
                rkey_requests: AtomicU32::new(0),
                pending: Mutex::new(HashMap::new()),
                stats: cfg_stats,
                fallback_rows: Mutex::new(FallbackRows::default()),
                local_addrs: Mutex::new(HashMap::new()),
                problem: Mutex::new(None),
            }),
        }
    }

    /// The shared-memory stats area of this runtime (see [`crate::stats`]), if any.
    pub fn stats_path(&self) -> Option<&std::path::Path> {
        self.inner.stats.as_deref().map(crate::stats::Area::path)
    }

    /// The settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.cfg
    }

    /// Marks a TCP socket for the SMC-R option (before `listen`); false when the option
    /// program is unusable or negotiation does not use it.
    pub fn mark(&self, sock: std::os::fd::BorrowedFd<'_>) -> bool {
        self.mark_as(sock, false)
    }

    /// [`Runtime::mark`] before `connect` (the record says the socket is a client's).
    pub fn mark_connecting(&self, sock: std::os::fd::BorrowedFd<'_>) -> bool {
        self.mark_as(sock, true)
    }

    fn mark_as(&self, sock: std::os::fd::BorrowedFd<'_>, connecting: bool) -> bool {
        match (&self.inner.cfg.negotiation, &self.inner.option) {
            (Negotiation::TcpOption { .. }, Ok(map)) => map.mark(sock, connecting).is_ok(),
            (Negotiation::Assume, _) => true,
            _ => false,
        }
    }

    /// Why SMC-R cannot be negotiated at all here (the TCP option program is not installed or
    /// not usable by this user), to tell the user once; `None` when it can.
    pub fn negotiation_problem(&self) -> Option<&str> {
        match (&self.inner.cfg.negotiation, &self.inner.option) {
            (Negotiation::TcpOption { .. }, Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Why SMC-R could not be had for the last connection declined for a local condition
    /// (e.g. a device that cannot receive RoCE from other hosts), if any.
    pub fn problem(&self) -> Option<String> {
        self.inner.problem.lock().clone()
    }

    /// Link groups currently alive.
    pub fn link_groups(&self) -> usize {
        self.inner
            .groups
            .lock()
            .iter()
            .filter(|g| !g.is_down())
            .count()
    }

    /// The end of the process (the preload calls it at `exit`, after closing the program's
    /// connections as the kernel would): waits, up to `limit` in all, until what the
    /// connections still hold is written and acknowledged, then deletes every link group
    /// (DELETE LINK, as Linux does when it ends its groups) and waits for the peers to
    /// acknowledge that too. Without it a peer learns of our end only from TEST LINK (Linux:
    /// 30 s and retries), and data not yet acknowledged on the wire is lost.
    pub fn end(&self) {
        self.end_within(self.inner.cfg.exit_drain);
    }

    /// [`Self::end`] with another bound.
    pub fn end_within(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let groups: Vec<Arc<LinkGroup>> = self.inner.groups.lock().clone();
        for g in &groups {
            g.wait(deadline, |g| g.drained());
        }
        // The groups go; the stats area stays (unlike `shutdown`), so that what the process
        // did can still be read after it ended, until smc-stat finds the area stale.
        self.delete_groups();
        for g in &groups {
            g.wait(deadline, |g| g.sends_done());
        }
    }

    /// Deletes every link group (DELETE LINK to the peers); their connections fail.
    pub fn shutdown(&self) {
        self.delete_groups();
        // Threads may still hold the runtime for a while; its stats are over now.
        if let Some(a) = &self.inner.stats {
            a.unlink();
        }
    }

    /// Deletes every link group (DELETE LINK to the peers).
    fn delete_groups(&self) {
        let groups: Vec<_> = self.inner.groups.lock().drain(..).collect();
        for g in groups {
            g.terminate();
        }
    }

    /// A multi-line description of devices and link groups, for diagnostics.
    pub fn debug_summary(&self) -> String {
        let mut out = String::new();
        for (ip, d) in self.inner.devices.lock().iter() {
            out += &format!("device {ip}: {:?}\n", d.device.stats());
        }
        for g in self.inner.groups.lock().iter() {
            let st = g.st.lock();
            out += &format!(
                "link group {} {:?} peer {:?} up={} down={:?} spare_up={} last_failover={:?} \
                 conns={} free_slots={}\n  {}\n",
                g.id,
                g.role,
                g.peer_gid.to_ipv4(),
                st.g.is_up(),
                st.g.down(),
                st.g.spare_up(),
                st.g.last_failover(),
                st.g.conns.len(),
                st.g.conns.free_slots(),
                g.paths
                    .iter()
                    .map(|p| p.qp.summary())
                    .collect::<Vec<_>>()
                    .join("\n  ")
            );
        }
        out
    }

    /// The number of usable links of each live link group (1, or 2 with a second path).
    pub fn group_links(&self) -> Vec<usize> {
        self.inner
            .groups
            .lock()
            .iter()
            .filter(|g| !g.is_down())
            .map(|g| g.links())
            .collect()
    }

    /// Times a link failed and its group's connections moved to the other link.
    pub fn failovers(&self) -> u32 {
        self.inner.failovers.load(Ordering::Relaxed)
    }

    /// Bytes of RMB memory the runtime holds (connections' RMBs and the pooled ones), counted
    /// against [`RuntimeConfig::rmb_budget`].
    pub fn rmb_in_use(&self) -> u64 {
        *self.inner.rmb_in_use.lock()
    }

    /// The counters of each RoCE device (local address) this runtime opened.
    pub fn device_stats(&self) -> Vec<(Ipv4Addr, rdma::DeviceStats)> {
        self.inner
            .devices
            .lock()
            .iter()
            .map(|(ip, d)| (*ip, d.device.stats()))
            .collect()
    }

    /// Link confirmations (CONFIRM LINK exchanges, first links and added ones) so far.
    pub fn links_confirmed(&self) -> u32 {
        self.inner.links_confirmed.load(Ordering::Relaxed)
    }

    /// CONFIRM RKEY and DELETE RKEY requests sent so far (LLC round trips a connection's
    /// setup or end cost; see [`RuntimeConfig::rkey_reuse`]).
    pub fn rkey_requests(&self) -> u32 {
        self.inner.rkey_requests.load(Ordering::Relaxed)
    }
}

impl Drop for Inner {
    /// The last handle is gone: delete the link groups (their pollers then stop).
    fn drop(&mut self) {
        for g in self.groups.get_mut().drain(..) {
            g.terminate();
        }
    }
}

impl Inner {
    /// Records why a connection could not have SMC-R here (see [`Runtime::problem`]).
    pub(crate) fn note(&self, why: String) {
        *self.problem.lock() = Some(why);
    }

    /// The RMB size connections use.
    pub(crate) fn rmb_size(&self) -> clc::RmbSize {
        clc::RmbSize::round_up(self.cfg.rmb_size.clamp(16 * 1024, 512 * 1024))
    }

    /// The RMB size for a connection with `peer`: the configured one, or larger (the
    /// same-host or remote size) while large RMBs hold at most a quarter of the budget — a
    /// few busy connections get room for bulk, many get Linux's size, and the budget is not
    /// spent on the first ones.
    pub(crate) fn rmb_size_for(&self, peer: Ipv4Addr) -> clc::RmbSize {
        let base = self.rmb_size();
        let want = if self.cfg.same_host && self.is_local(peer) {
            self.cfg.same_host_rmb_size
        } else {
            self.cfg.remote_rmb_size
        };
        let Some(want) = want else {
            return base;
        };
        let large = clc::RmbSize::round_up(want.clamp(16 * 1024, 512 * 1024));
        if large.bytes() <= base.bytes() {
            return base;
        }
        let used = *self.rmb_in_use.lock();
        if used + u64::from(large.bytes()) > self.cfg.rmb_budget / 4 {
            return base;
        }
        large
    }

    /// Whether `ip` is an address of this host in our network namespace (it can be bound).
    fn is_local(&self, ip: Ipv4Addr) -> bool {
        if let Some(&v) = self.local_addrs.lock().get(&ip) {
            return v;
        }
        // A raw socket call: inside the preload, libc's would be our own hook.
        let v = (|| -> io::Result<()> {
            use rustix::net::{AddressFamily, SocketFlags, SocketType};
            let s = rustix::net::socket_with(
                AddressFamily::INET,
                SocketType::DGRAM,
                SocketFlags::CLOEXEC,
                None,
            )?;
            rustix::net::bind(&s, &std::net::SocketAddr::from((ip, 0)))?;
            Ok(())
        })()
        .is_ok();
        self.local_addrs.lock().insert(ip, v);
        v
    }

    pub(crate) fn device(&self, ip: Ipv4Addr) -> io::Result<Arc<Dev>> {
        let mut devs = self.devices.lock();
        if let Some(d) = devs.get(&ip) {
            return Ok(d.clone());
        }
        if self.cfg.roce_port == crate::steer::ROCE_PORT {
            // Root in its own network namespace: steer there, so that this process and the
            // others on the address all reach their peers (else the device finds out itself:
            // steered, owner of 4791, or local-only).
            let dir = match &self.cfg.negotiation {
                Negotiation::TcpOption { dir } => dir.as_path(),
                Negotiation::Assume => std::path::Path::new(crate::option::DEFAULT_DIR),
            };
            crate::steer::runtime_attach(self.cfg.steer_attach, dir, ip);
        }
        let mut dcfg = DeviceConfig::new(SocketAddrV4::new(ip, self.cfg.roce_port));
        dcfg.faults = self.cfg.faults;
        // Multi-homed: the second link of a group is a second queue pair of this device,
        // sending from an alternate address (same memory regions, same CQ). Each device gets
        // its own (the first configured one no other device has or is; none for a loopback
        // address, whose peers are on this host).
        let alt = (!ip.is_loopback())
            .then(|| {
                self.cfg
                    .alt_addrs
                    .iter()
                    .copied()
                    .find(|&a| a != ip && !devs.values().any(|d| d.ip == a || d.alt == Some(a)))
            })
            .flatten();
        dcfg.extra_addrs = alt.into_iter().collect();
        // The engine counts into our stats area, where smc-stat reads it.
        let counters = self.stats.as_ref().and_then(|area| {
            let slot = area.claim_dev()?;
            Some(Arc::new(DevCounters {
                area: area.clone(),
                slot,
            }))
        });
        dcfg.counters = counters
            .clone()
            .map(|c| rdma::SharedCounters(c as Arc<dyn rdma::CounterWords>));
        let (device, alt) = match Device::open(dcfg.clone()) {
            Ok(d) => (d, alt),
            // The alternate address cannot be had (not on this host, or another process has
            // its port): this address still runs SMC-R, on one link per group.
            Err(_) if alt.is_some() => {
                dcfg.extra_addrs.clear();
                (Device::open(dcfg)?, None)
            }
            Err(e) => return Err(e),
        };
        if let Some(c) = &counters {
            let mode = match device.mode() {
                rdma::transport::steer::PortMode::Steered => 1,
                rdma::transport::steer::PortMode::Owner => 2,
                rdma::transport::steer::PortMode::LocalOnly => 3,
                rdma::transport::steer::PortMode::Fixed => 4,
            };
            c.area
                .set_dev(c.slot, device.local_addr(), mode, device.qpn_range());
        }
        let o = ip.octets();
        let d = Arc::new(Dev {
            ip,
            alt,
            device,
            // Locally administered, derived from the address: our "port" has no real MAC.
            mac: Mac([0x02, 0x00, o[0], o[1], o[2], o[3]]),
        });
        devs.insert(ip, d.clone());
        Ok(d)
    }

    /// The lock serialising handshakes of `role` with `peer`.
    pub(crate) fn pending(&self, server: bool, peer: Ipv4Addr) -> PendingLock {
        self.pending
            .lock()
            .entry((server, peer))
            .or_default()
            .clone()
    }

    pub(crate) fn token(&self) -> u32 {
        loop {
            let t = self.next_token.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t;
            }
        }
    }

    /// Reserves RMB memory against the budget.
    pub(crate) fn reserve_rmb(&self, bytes: u32) -> bool {
        let mut used = self.rmb_in_use.lock();
        if *used + u64::from(bytes) > self.cfg.rmb_budget {
            return false;
        }
        *used += u64::from(bytes);
        true
    }

    pub(crate) fn release_rmb(&self, bytes: u32) {
        let mut used = self.rmb_in_use.lock();
        *used = used.saturating_sub(u64::from(bytes));
    }

    /// A live link group to the peer system `peer_id` at `peer_gid` where we have `role`,
    /// with room for a connection (client: the server's QPN must match the Accept).
    pub(crate) fn find_group(
        &self,
        local: Ipv4Addr,
        peer_gid: Gid,
        role: link::Role,
        peer_id: PeerId,
        peer_qpn: Option<u32>,
    ) -> Option<Arc<LinkGroup>> {
        let groups = self.groups.lock();
        groups
            .iter()
            .find(|g| {
                g.role == role
                    && g.dev.ip == local
                    && g.peer_id == peer_id
                    // A client finds the group by the link the server's Accept names (any
                    // of its links, as Linux's `smcr_lgr_match`); a server by the client's GID.
                    && match peer_qpn {
                        Some(q) => g.has_peer_link(peer_gid, q),
                        None => g.peer_gid == peer_gid,
                    }
                    && g.is_up()
                    && g.has_room()
            })
            .cloned()
    }

    /// A handshake failed with no fallback (the connection was reset).
    pub(crate) fn handshake_failed(&self) {
        if let Some(a) = &self.stats {
            a.count(crate::stats::total::FAILED);
        }
        crate::metrics::handshake_failed();
    }

    /// Keeps a fallback socket's record until its descriptor is closed. Records whose
    /// descriptor is gone (closed, or the number now holds another file) are freed by a
    /// sweep of a few entries per call (`smc-stat` hides them meanwhile).
    pub(crate) fn keep_fallback_row(&self, st: crate::stream::StatSlot, fd: i32, ino: u64) {
        let mut f = self.fallback_rows.lock();
        let gone = |&(_, fd, ino): &(crate::stream::StatSlot, i32, u64)| {
            crate::stream::socket_inode(fd) != Some(ino)
        };
        let n = f.rows.len();
        if n > 0 {
            let mut i = f.next % n;
            for _ in 0..n.min(16) {
                if i >= f.rows.len() {
                    i = 0;
                }
                if gone(&f.rows[i]) {
                    f.rows.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            f.next = i;
        }
        f.rows.push((st, fd, ino));
    }

    pub(crate) fn add_group(&self, g: Arc<LinkGroup>) {
        let mut groups = self.groups.lock();
        groups.retain(|g| !g.is_down());
        groups.push(g);
    }
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
    cq: CompletionQueue,
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
    /// See [`RuntimeConfig::write_pad`].
    write_pad: bool,
    /// See [`RuntimeConfig::rkey_reuse`].
    rkey_reuse: bool,
    /// `smc-stat` shows the link on shared memory.
    shown_shm: AtomicBool,
    /// The QP sends through shared memory (sticky, see `same_host()`).
    same_host: AtomicBool,
    /// The group's own protection domain: with a same-host peer its memory is shared with
    /// that peer (and only that peer), so RMBs of other peers are never in reach.
    pd: ProtectionDomain,
    pub(crate) peer_gid: Gid,
    /// The peer's system ID (from its Proposal or Accept): a restarted peer process on the same
    /// address is another system, with link groups of its own (Linux's `smcr_lgr_match`).
    pub(crate) peer_id: PeerId,
    pub(crate) mtu: QpMtu,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    st: Mutex<LgState>,
    cond: Condvar,
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

/// The drive event-loop threads keep between two `epoll_wait`s: what arrives while the loop
/// works waits in the rings for its next wait (no wake-up for anyone) instead of going to the
/// poller. The poller takes the group back when no loop came by for `hold_for` (a loop busy
/// elsewhere, blocked in another call, or gone), so nothing waits longer than that (plus
/// [`HOLD_IDLE`] right after a long sleep).
struct Hold {
    /// The hold's own drive is on.
    held: bool,
    /// The holders watch the device's socket themselves (their epoll sets hold it): the
    /// engine thread does not, so a packet wakes the holder directly instead of the engine
    /// thread, which would then signal the holder (two wake-ups).
    rx: bool,
    /// Threads between `sleep_begin` and `sleep_end`.
    sleeping: u32,
    /// When a loop last went to sleep or woke.
    last: Instant,
    /// When the poller looks at the hold next (set as it goes to sleep): a holder that wakes
    /// earlier than that minus `hold_for` kicks it, so that nothing waits past `hold_for` after
    /// the holders stop coming, whenever the hold began.
    poller_until: Option<Instant>,
}

/// How long a deleted group's poller waits for the peer to acknowledge what was posted
/// before the DELETE LINK: the transport's retries (7 × ~134 ms) fit.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// The longest a link group's poller sleeps when no timer is due.
const IDLE_WAIT: Duration = Duration::from_secs(30);

/// Holders asleep this long leave the poller on its long timer (they kick it when they wake).
const HOLD_IDLE: Duration = Duration::from_millis(5);

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

fn post_error(e: rdma::PostError) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, format!("post_send: {e:?}"))
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
        if std::mem::take(&mut self.hold.get_mut().rx) {
            self.cq.delegate_rx(false);
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

impl Path {
    /// Sets the path up anew (a link added on it): a new initial PSN, the queue pair reset to
    /// INIT with every receive slot posted.
    fn reset(&self, recv_mr: &MemoryRegion) -> io::Result<()> {
        self.psn.store(random_u32() & 0xff_ffff, Ordering::Relaxed);
        self.init(recv_mr)
    }

    /// Resets the queue pair to INIT with every receive slot posted.
    fn init(&self, recv_mr: &MemoryRegion) -> io::Result<()> {
        self.qp
            .modify(&QpAttr::state(QpState::Reset))
            .and_then(|()| self.qp.modify(&QpAttr::state(QpState::Init)))
            .map_err(|e| io::Error::other(format!("QP to INIT: {e:?}")))?;
        for i in self.base..self.base + RECV_SLOTS {
            self.post_recv(recv_mr, i)
                .map_err(|e| io::Error::other(format!("post_recv: {e:?}")))?;
        }
        Ok(())
    }

    /// Posts receive slot `slot` (and the buffer for longer LLC messages after it).
    fn post_recv(&self, recv_mr: &MemoryRegion, slot: usize) -> Result<(), rdma::PostError> {
        let first = recv_mr.sge(slot * SLOT, SLOT);
        let sges = match &self.big {
            Some(b) => [first, b.sge(0, LLC_MAX - SLOT)],
            None => [first, first],
        };
        let n = if self.big.is_some() { 2 } else { 1 };
        self.qp.post_recv(&[RecvWr {
            wr_id: slot as u64,
            sg_list: &sges[..n],
        }])
    }

    /// Connects the queue pair to the peer's (`peer_qpn` at `peer_ip`, starting at
    /// `peer_psn`): RTR, then RTS.
    fn connect(
        &self,
        peer_ip: Ipv4Addr,
        peer_qpn: u32,
        peer_psn: u32,
        mtu: QpMtu,
        port: u16,
        pin: bool,
    ) -> io::Result<()> {
        self.peer_qpn.store(peer_qpn, Ordering::Relaxed);
        self.peer_ip.store(u32::from(peer_ip), Ordering::Relaxed);
        self.qp
            .modify(&QpAttr {
                path_mtu: Some(rdma_mtu(mtu)),
                dest_qp_num: Some(peer_qpn),
                rq_psn: Some(Psn::new(peer_psn)),
                av: Some(SocketAddrV4::new(peer_ip, port)),
                // On a multi-homed device every path names its source (the ICRC covers it).
                src: pin.then_some(self.src),
                ..QpAttr::state(QpState::Rtr)
            })
            .map_err(|e| io::Error::other(format!("QP to RTR: {e:?}")))?;
        self.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(self.psn.load(Ordering::Relaxed))),
                ..QpAttr::state(QpState::Rts)
            })
            .map_err(|e| io::Error::other(format!("QP to RTS: {e:?}")))
    }
}

impl LinkGroup {
    /// Creates the QP (in INIT, receives posted) for a new link group.
    pub(crate) fn create(
        rt: &Arc<Inner>,
        dev: Arc<Dev>,
        role: link::Role,
        peer_gid: Gid,
        peer_id: PeerId,
        mtu: QpMtu,
    ) -> io::Result<Arc<Self>> {
        let cq = dev.device.create_cq()?;
        let caps = QpCaps {
            max_send_wr: 4096,
            max_recv_wr: RECV_SLOTS as u32,
            ..QpCaps::default()
        };
        let pd = if rt.cfg.same_host {
            dev.device.alloc_shared_pd()?
        } else {
            dev.device.alloc_pd()
        };
        // A second path only over UDP between our addresses (a same-host group has one).
        let alt = dev
            .alt
            .filter(|_| !(rt.cfg.same_host && rt.is_local(peer_gid.to_ipv4().unwrap_or(dev.ip))));
        let srcs: Vec<Ipv4Addr> = std::iter::once(dev.ip).chain(alt).collect();
        let recv_mr = pd.reg_mr(SLOT * RECV_SLOTS * srcs.len(), Access::LOCAL_WRITE)?;
        // One slot more than are handed out: it stays zero (see `ZERO_SLOT`).
        let send_mr = pd.reg_mr(SLOT * (SEND_SLOTS + 1), Access::LOCAL_WRITE)?;
        let mut paths = Vec::new();
        for (i, &src) in srcs.iter().enumerate() {
            let path = Path {
                qp: pd.create_qp(&cq, &cq, caps, false)?,
                base: i * RECV_SLOTS,
                big: if srcs.len() > 1 {
                    Some(pd.reg_mr(LLC_MAX - SLOT, Access::LOCAL_WRITE)?)
                } else {
                    None
                },
                src,
                psn: AtomicU32::new(random_u32() & 0xff_ffff),
                peer_qpn: AtomicU32::new(0),
                peer_ip: AtomicU32::new(0),
            };
            path.init(&recv_mr)?;
            paths.push(path);
        }
        let path_ids = paths
            .iter()
            .map(|p| PathIds {
                gid: Gid::from_ipv4(p.src),
                qpn: p.qp.qp_num(),
            })
            .collect();
        Ok(Arc::new(Self {
            id: rt.next_lgr.fetch_add(1, Ordering::Relaxed),
            role,
            dev,
            paths,
            rtokens: Mutex::new(crate::rtokens::PeerRtokens::default()),
            route: AtomicU64::new(0),
            link_id: AtomicU32::new(1),
            cq,
            driver: Mutex::new(()),
            blocking_driver: AtomicBool::new(false),
            hold: Mutex::new(Hold {
                held: false,
                rx: false,
                sleeping: 0,
                last: Instant::now(),
                poller_until: None,
            }),
            hold_for: rt.cfg.app_hold,
            write_pad: rt.cfg.write_pad,
            rkey_reuse: rt.cfg.rkey_reuse,
            shown_shm: AtomicBool::new(false),
            same_host: AtomicBool::new(false),
            pd,
            peer_gid,
            peer_id,
            mtu,
            recv_mr,
            send_mr,
            st: Mutex::new(LgState {
                g: GroupCore::new(
                    role,
                    path_ids,
                    LgrCore::new(
                        255,
                        SEND_SLOTS,
                        POLLER_RESERVE,
                        RECV_SLOTS,
                        rt.cfg.linger,
                        Instant::now(),
                    ),
                ),
                watch: HashMap::new(),
                rmb_pool: Vec::new(),
                sndbuf_pool: Vec::new(),
                confirmed: HashSet::new(),
            }),
            cond: Condvar::new(),
            down: AtomicBool::new(false),
            runtime: Arc::downgrade(rt),
            stat: rt.stats.as_ref().and_then(|area| {
                area.count(crate::stats::total::LINK_GROUPS);
                Some(LgStat {
                    area: area.clone(),
                    slot: area.claim_lg()?,
                    released: Mutex::new(false),
                    since: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as u64),
                })
            }),
        }))
        .inspect(|g| g.publish(crate::stats::lg::LINK_ACTIVATING))
    }

    /// Writes this group's record in the stats area with link state `state`.
    fn publish(&self, state: u64) {
        use crate::stats::lg;
        let Some(st) = &self.stat else { return };
        let released = st.released.lock();
        if *released {
            return; // the slot may be another group's now
        }
        // Once down, always shown down (a late ACTIVE from the poller must not win).
        let state = if self.is_down() {
            lg::LINK_INACTIVE
        } else {
            state
        };
        let gid = |g: &Gid| {
            [
                u64::from_be_bytes(g.0[..8].try_into().expect("8 bytes")),
                u64::from_be_bytes(g.0[8..].try_into().expect("8 bytes")),
            ]
        };
        let mut rec = crate::stats::LgRecord::default();
        rec.words[lg::IN_USE] = 1;
        let role = match self.role {
            link::Role::Client => lg::ROLE_CLIENT,
            link::Role::Server => lg::ROLE_SERVER,
        };
        let link_id = u64::from(self.link_id.load(Ordering::Relaxed));
        rec.words[lg::ID] = u64::from(self.id) | role << 32 | link_id << 40 | state << 48;
        let (ours, _, qpn, _, _) = self.local_endpoint();
        let path = &self.paths[self.active()];
        let peer_gid = match path.peer_ip.load(Ordering::Relaxed) {
            0 => self.peer_gid,
            ip => Gid::from_ipv4(Ipv4Addr::from(ip)),
        };
        rec.words[lg::GID..lg::GID + 2].copy_from_slice(&gid(&ours));
        rec.words[lg::PEER_GID..lg::PEER_GID + 2].copy_from_slice(&gid(&peer_gid));
        rec.words[lg::QPNS] =
            u64::from(qpn) | u64::from(path.peer_qpn.load(Ordering::Relaxed)) << 32;
        rec.words[lg::PEER_SYSTEM] = u64::from_be_bytes(self.peer_id.0);
        rec.words[lg::SINCE] = st.since;
        rec.words[lg::MTU] = u64::from(self.mtu.bytes().unwrap_or(0));
        // Sticky: a same-host link whose peer went away (its offer closed) still shows what
        // it ran on, not UDP.
        rec.words[lg::TRANSPORT] = if self.same_host() {
            lg::TRANSPORT_SHM
        } else {
            lg::TRANSPORT_UDP
        };
        st.area.write_lg(st.slot, &rec);
    }

    /// Publishes the number of connections on the group (caller holds `st`).
    fn publish_conns(&self, st: &LgState) {
        if let Some(s) = &self.stat {
            let released = s.released.lock();
            if !*released {
                s.area.set_lg_conns(s.slot, st.g.conns.len() as u64);
            }
        }
    }

    /// Our side of the active link as CLC carries it.
    pub(crate) fn local_endpoint(&self) -> (Gid, Mac, u32, u32, QpMtu) {
        let p = &self.paths[self.active()];
        (
            Gid::from_ipv4(p.src),
            self.dev.mac,
            p.qp.qp_num(),
            p.psn.load(Ordering::Relaxed),
            self.mtu,
        )
    }

    /// The active path and the failover epoch.
    pub(crate) fn route(&self) -> (u32, usize) {
        let r = self.route.load(Ordering::Acquire);
        ((r >> 8) as u32, (r & 0xff) as usize)
    }

    /// The peer RMB `rmb` as `path` reaches it, as `(vaddr, rkey)` for an RDMA WRITE there;
    /// `rmb` keeps the answer (a connection moves to the path once).
    pub(crate) fn peer_rmb(&self, rmb: &mut crate::rtokens::PeerRmb, path: usize) -> (u64, u32) {
        if rmb.path != path {
            *rmb = self.rtokens.lock().on(*rmb, path);
        }
        (rmb.vaddr, rmb.rkey)
    }

    /// The path whose peer queue pair is `qpn` (a connection's CLC messages name its link by
    /// it; its rkey is for that link); the active one when none is.
    pub(crate) fn path_of_peer_qpn(&self, qpn: u32) -> usize {
        self.paths
            .iter()
            .position(|p| p.peer_qpn.load(Ordering::Relaxed) == qpn)
            .unwrap_or_else(|| self.active())
    }

    /// The active path.
    pub(crate) fn active(&self) -> usize {
        self.route().1
    }

    /// The active path's queue pair.
    pub(crate) fn qp(&self) -> &QueuePair {
        &self.paths[self.active()].qp
    }

    /// Usable links (1, or 2 while the spare is confirmed; 0 once down).
    pub(crate) fn links(&self) -> usize {
        let st = self.st.lock();
        if !st.g.is_up() || st.g.down().is_some() {
            return 0;
        }
        1 + usize::from(st.g.spare_up())
    }

    /// Whether the peer's QP `qpn` at `gid` is one of this group's live links.
    pub(crate) fn has_peer_link(&self, gid: Gid, qpn: u32) -> bool {
        let Some(ip) = gid.to_ipv4() else {
            return false;
        };
        let st = self.st.lock();
        let active = self.active();
        self.paths.iter().enumerate().any(|(i, p)| {
            (i == active || st.g.spare_up())
                && p.peer_qpn.load(Ordering::Relaxed) == qpn
                && p.peer_ip.load(Ordering::Relaxed) == u32::from(ip)
        })
    }

    /// The path whose queue pair is `qpn`.
    fn path_of(&self, qpn: u32) -> usize {
        self.paths
            .iter()
            .position(|p| p.qp.qp_num() == qpn)
            .unwrap_or(0)
    }

    /// Connects the QP to the peer (RTR, RTS) and starts the LLC conversation and the poller.
    pub(crate) fn start(
        self: &Arc<Self>,
        peer: &handshake::Endpoint,
        mtu: QpMtu,
        negotiated: &handshake::Negotiated,
        cfg: &RuntimeConfig,
    ) -> io::Result<()> {
        let (peer_qpn, peer_psn) = (peer.qpn, peer.initial_psn);
        let (max_links, max_conns) = (negotiated.max_links, negotiated.max_conns);
        let peer_ip = self
            .peer_gid
            .to_ipv4()
            .ok_or_else(|| io::Error::other("peer GID is not IPv4-mapped"))?;
        self.paths[0].connect(
            peer_ip,
            peer_qpn,
            peer_psn,
            mtu,
            cfg.roce_port,
            self.paths.len() > 1,
        )?;
        self.publish(crate::stats::lg::LINK_ACTIVATING);
        let (gid, mac, qpn, _, _) = self.local_endpoint();
        let now = Instant::now();
        let params = LinkParams {
            role: self.role,
            version: Version::V2,
            mac,
            gid,
            qpn,
            link_id: 1,
            link_uid: [
                0,
                (self.id >> 16) as u8,
                (self.id >> 8) as u8,
                self.id as u8,
            ],
            max_links,
            max_conns,
            test_link_time: cfg.test_link_time,
        };
        {
            let mut st = self.st.lock();
            st.g.start(params, now);
            self.flush_llc(&mut st);
        }
        let me = self.clone();
        rdma::thread::spawn(format!("smcr-lgr-{}", self.id), move || me.poll_loop())?;
        Ok(())
    }

    pub(crate) fn is_up(&self) -> bool {
        self.st.lock().g.is_up() && !self.is_down()
    }

    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    fn has_room(&self) -> bool {
        self.st.lock().g.conns.has_room()
    }

    /// Waits until the link is confirmed, or fails.
    pub(crate) fn wait_up(&self, timeout: Duration, tcp: &std::net::TcpStream) -> io::Result<()> {
        // The peer sends nothing on the TCP connection while the link comes up, except a
        // Decline (it gave up) or its close: look every slice, so a peer that gave up or died
        // ends the wait at once instead of at the deadline.
        const SLICE: Duration = Duration::from_millis(20);
        let deadline = Instant::now() + timeout;
        let mut st = self.st.lock();
        loop {
            if let Some(r) = st.g.down() {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    r.to_string(),
                ));
            }
            if st.g.is_up() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "link not confirmed in time",
                ));
            }
            let _ = self.cond.wait_until(&mut st, deadline.min(now + SLICE));
            if !st.g.is_up()
                && st.g.down().is_none()
                && parking_lot::MutexGuard::unlocked(&mut st, || tcp_has_input(tcp))
            {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the peer closed or declined on the TCP connection while the link came up",
                ));
            }
        }
    }

    /// Reserves `token` before it is sent in an Accept (see `LgState::early`).
    pub(crate) fn reserve(&self, token: u32) {
        self.st.lock().g.conns.promise(token);
    }

    /// Forgets a reserved token whose handshake did not complete.
    pub(crate) fn unreserve(&self, token: u32) {
        self.st.lock().g.conns.unpromise(token);
    }

    pub(crate) fn attach(
        self: &Arc<Self>,
        token: u32,
        c: Arc<ConnShared>,
        tcp: Option<Arc<std::net::TcpStream>>,
    ) {
        let watched = tcp.map(|fd| crate::tcpwatch::watch(self, token, fd));
        let early = {
            let mut st = self.st.lock();
            if let Some(w) = watched {
                st.watch.insert(token, w);
            }
            if let Some(why) = st.g.down() {
                // The group ended while this connection was set up (another handshake found it
                // dead, or it failed): its drain is over, so fail the connection here, or a
                // reader would wait for ever and its RMB stay counted.
                let why = why.clone();
                drop(st);
                c.fail(&why);
                return;
            }
            let early = st.g.conns.attach(token, c.clone());
            self.publish_conns(&st);
            early
        };
        for m in early {
            c.on_cdc(self, &m);
        }
    }

    /// A SEND slot (waits for one unless `poller`: the poller never waits and gets the reserve).
    pub(crate) fn take_slot(&self, poller: bool) -> io::Result<usize> {
        Ok({
            let mut st = self.st.lock();
            loop {
                if let Some(r) = st.g.down() {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        r.to_string(),
                    ));
                }
                if let Slot::Got(slot) = st.g.conns.take_slot(poller) {
                    break slot;
                }
                if poller {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "no SEND slot for the poller",
                    ));
                }
                self.cond.wait(&mut st);
            }
        })
    }

    /// Sends CDC `m` from `slot`; `owner` (a connection token, 0 for none) hears of its
    /// completion (autocorking waits for it). Returns `true` when the SEND completed at once
    /// (same-host link): the slot is free again and no completion will follow, so the caller
    /// counts it as done.
    pub(crate) fn post_cdc(
        &self,
        path: usize,
        slot: usize,
        m: &CdcMessage,
        owner: u32,
    ) -> io::Result<bool> {
        self.post_cdc_after(path, &[], slot, m, owner)
    }

    /// [`Self::post_cdc`], with `before` (RDMA WRITEs) posted ahead of it in the same post.
    fn post_cdc_after(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        m: &CdcMessage,
        owner: u32,
    ) -> io::Result<bool> {
        let mut b = [0u8; cdc::CDC_LEN];
        m.emit(&mut b);
        self.post_owned(path, before, slot, &b, owner)
    }

    /// Posts `bytes` from `slot` for connection `owner` (0: none), after `before`; the slot
    /// is freed here if the SEND completed at once or was never posted.
    fn post_owned(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        bytes: &[u8],
        owner: u32,
    ) -> io::Result<bool> {
        // The owner first: on UDP the completion may be handled before post_send returns.
        self.st.lock().g.conns.set_owner(slot, owner);
        let done = self.post_send_slot_with(path, before, slot, bytes, SendFlags::empty());
        if !matches!(done, Ok(false)) {
            // Completed at once, or never posted: the slot is free again.
            self.put_back(slot);
        }
        done
    }

    /// Posts `bytes` as a SEND of no connection (feature `hostile`: tests of what the peer
    /// makes of messages we would never send).
    #[cfg(feature = "hostile")]
    pub(crate) fn post_raw_send(&self, bytes: &[u8]) -> io::Result<()> {
        if bytes.len() > SLOT {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let slot = self.take_slot(false)?;
        self.post_owned(self.active(), &[], slot, bytes, 0)
            .map(drop)
    }

    /// Why the QP failed, as the link's down reason: a flush caused by a request of the peer
    /// that our responder refused says so (the peer misbehaved), rather than only `WR_FLUSH_ERR`.
    fn failure_cause(&self, path: usize, status: WcStatus) -> String {
        let r = self.paths[path].qp.responder_stats();
        match status {
            WcStatus::WrFlushErr if r.access_errors > 0 => {
                "the peer's RDMA request was refused (remote access error: rkey, range or \
                 rights; WR_FLUSH_ERR)"
                    .into()
            }
            WcStatus::WrFlushErr if r.invalid > 0 => {
                "the peer's RDMA request was refused (invalid request; WR_FLUSH_ERR)".into()
            }
            s => s.name().into(),
        }
    }

    /// Returns a slot that carries nothing in flight.
    pub(crate) fn put_back(&self, slot: usize) {
        self.st.lock().g.conns.put_back(slot);
        self.cond.notify_all();
    }

    /// Whether the link moves data through shared memory (sticky once seen).
    fn same_host(&self) -> bool {
        if self.same_host.load(Ordering::Relaxed) {
            return true;
        }
        // A same-host group has one path.
        let yes = self.paths[0].qp.is_same_host();
        if yes {
            self.same_host.store(true, Ordering::Relaxed);
        }
        yes
    }

    /// Posts a SEND of `bytes` from `slot` on `path`, with `extra` flags. Returns `true` if it
    /// completed at once (same-host link: the payload was copied into the peer's ring; the
    /// slot may be reused). `before`: requests posted ahead of the SEND in the same post (then
    /// `true` means they all ran too).
    fn post_send_slot_with(
        &self,
        path: usize,
        before: &[SendWr<'_>],
        slot: usize,
        bytes: &[u8],
        extra: SendFlags,
    ) -> io::Result<bool> {
        let same_host = self.same_host();
        self.send_mr.write(slot * SLOT, bytes);
        let sge = [self.send_mr.sge(slot * SLOT, bytes.len())];
        let send = SendWr {
            wr_id: slot as u64,
            opcode: WrOpcode::Send,
            sg_list: &sge,
            // Linux posts every LLC/CDC SEND signaled and solicited (smc_wr.c). On a
            // same-host link a SEND that ran when posted is done: a completion would only
            // wake our own poller. One that had to wait for ring space completes later,
            // like a SEND on the wire (so slots and autocorking still hold writers back).
            flags: extra
                | if same_host {
                    SendFlags::SIGNAL_IF_DEFERRED | SendFlags::SOLICITED
                } else {
                    SendFlags::SIGNALED | SendFlags::SOLICITED
                },
        };
        let qp = &self.paths[path].qp;
        let ran = if before.is_empty() {
            qp.post_send_report(&[send])
        } else {
            let mut wrs = before.to_vec();
            wrs.push(send);
            qp.post_send_report(&wrs)
        }
        .map_err(post_error)?;
        Ok(same_host && ran == before.len() + 1)
    }

    /// Posts a connection's data: the RDMA WRITEs of `w`, then the CDC `m` announcing them
    /// from `slot`, like [`Self::post_cdc`].
    pub(crate) fn post_data(
        &self,
        path: usize,
        w: &DataWrites<'_>,
        slot: usize,
        m: &CdcMessage,
        owner: u32,
    ) -> io::Result<bool> {
        let DataWrites {
            sndbuf,
            pieces,
            peer,
            slack,
        } = *w;
        let same_host = self.same_host();
        let zero_len = match pieces.last() {
            Some(&(_, len)) if self.write_pad && !same_host && len < GSO_WRITE_MIN => {
                (GSO_WRITE_MIN - len).min(slack)
            }
            _ => 0,
        };
        let sges: Vec<[rdma::Sge; 2]> = pieces
            .iter()
            .map(|&(off, len)| {
                [
                    sndbuf.sge(off as usize, len as usize),
                    self.send_mr.sge(ZERO_SLOT * SLOT, zero_len as usize),
                ]
            })
            .collect();
        let last = pieces.len().saturating_sub(1);
        let wrs: Vec<SendWr<'_>> = pieces
            .iter()
            .zip(&sges)
            .enumerate()
            .map(|(i, (&(off, _), sg))| SendWr {
                wr_id: u64::MAX,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: peer.0 + u64::from(off),
                    rkey: peer.1,
                },
                sg_list: if i == last && zero_len > 0 {
                    &sg[..]
                } else {
                    &sg[..1]
                },
                // Unsignaled: the CDC after them is signaled and completes later.
                flags: SendFlags::empty(),
            })
            .collect();
        if same_host {
            // The shared-memory transport copies WRITEs as they are posted, and reports
            // whether the SEND ran at once on its own.
            if let Err(e) = self.paths[path].qp.post_send(&wrs) {
                self.put_back(slot);
                return Err(post_error(e));
            }
            return self.post_cdc(path, slot, m, owner);
        }
        // On UDP, WRITEs and SEND in one post: they are transmitted in one pass (one GSO
        // datagram when their sizes allow), not one system call each.
        self.post_cdc_after(path, &wrs, slot, m, owner)
    }

    /// Sends an LLC message longer than a slot: its first [`SLOT`] bytes from `slot`, the rest
    /// from a region registered for it (the request keeps it alive until it completes).
    fn post_long_llc(&self, path: usize, slot: usize, b: &[u8]) -> io::Result<()> {
        if b.len() > LLC_MAX || self.paths.len() < 2 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let tail = self.pd.reg_mr(b.len() - SLOT, Access::LOCAL_WRITE)?;
        tail.write(0, &b[SLOT..]);
        self.send_mr.write(slot * SLOT, &b[..SLOT]);
        let sge = [
            self.send_mr.sge(slot * SLOT, SLOT),
            tail.sge(0, b.len() - SLOT),
        ];
        self.paths[path]
            .qp
            .post_send(&[SendWr {
                wr_id: slot as u64,
                opcode: WrOpcode::Send,
                sg_list: &sge,
                flags: SendFlags::SIGNALED | SendFlags::SOLICITED | SendFlags::EXPEDITE,
            }])
            .map_err(post_error)
    }

    fn flush_llc(&self, st: &mut LgState) {
        while st.g.has_transmit() {
            let Slot::Got(slot) = st.g.conns.take_slot(true) else {
                return;
            };
            let (path, m) = st.g.poll_transmit().expect("non-empty");
            let mut b = vec![0u8; m.buffer_len()];
            m.emit(&mut b);
            if b.len() > SLOT {
                // Only two-link groups make longer ones (ADD LINK).
                if self.post_long_llc(path, slot, &b).is_err() {
                    st.g.conns.put_back(slot);
                }
                continue;
            }
            // LLC requests and answers go ahead of connection data that has not started to
            // leave (a CONFIRM RKEY answer behind megabytes of data on a slow path outlived
            // the peer's LLC_WAIT); DELETE LINK stays behind it: what was posted before it
            // must arrive first.
            let flags = if matches!(m.body, llc::Llc::DeleteLink(_)) {
                SendFlags::empty()
            } else {
                SendFlags::EXPEDITE
            };
            if !matches!(
                self.post_send_slot_with(path, &[], slot, &b, flags),
                Ok(false)
            ) {
                st.g.conns.put_back(slot);
            }
        }
    }

    fn poll_loop(self: Arc<Self>) {
        let mut wcs = [WorkCompletion::EMPTY; 64];
        loop {
            let wait = {
                let next = self.next_timer(&self.st.lock());
                // Nothing is due: sleep until something arrives (an idle program uses no
                // CPU); the cap only bounds what a missed wake-up could cost.
                let wait = next.map_or(IDLE_WAIT, |t| {
                    t.saturating_duration_since(Instant::now()).min(IDLE_WAIT)
                });
                self.check_hold(wait)
            };
            // Sleep without taking completions: an application thread may take and handle
            // them first (`progress`), always under the driver lock, so they stay in order.
            if let Err(e) = self.cq.wait_ready(Some(wait)) {
                self.fail(GroupDown::CompletionQueue(e.to_string()));
                self.release_hold();
                return;
            }
            // While an application thread drives the group, what arrives is its to take (it is
            // signalled, and sleeps until then): only the timers are ours. Woken with none due
            // (a kick: a holder came back), only the wait is recomputed, without the driver
            // lock: a driver's `progress` must not find it taken for nothing.
            if self.cq.driven() && !self.timers_due(Instant::now()) {
                continue;
            }
            let driver = self.driver.lock();
            let n = if self.cq.driven() {
                0
            } else {
                self.cq.poll(&mut wcs)
            };
            if self.handle(&wcs[..n]) {
                drop(driver);
                self.release_hold();
                self.finish();
                return;
            }
        }
    }

    /// Whether one of the poller's timers (the link's, the linger) is due at `now`.
    fn timers_due(&self, now: Instant) -> bool {
        self.next_timer(&self.st.lock()).is_some_and(|t| t <= now)
    }

    /// The earliest of the links' timers, the linger and the next try to add a link.
    fn next_timer(&self, st: &LgState) -> Option<Instant> {
        st.g.poll_timeout()
    }

    /// The poller stops (the group failed or was deleted): nobody will take the hold back, so
    /// it ends now; the device socket goes back to the engine thread for the other groups.
    fn release_hold(&self) {
        let mut h = self.hold.lock();
        if std::mem::take(&mut h.rx) {
            self.cq.delegate_rx(false);
        }
        if std::mem::take(&mut h.held) {
            drop(h);
            self.cq.end_drive();
        }
    }

    /// The completion queue's driver descriptor (see [`crate::Driver`]).
    pub(crate) fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.cq.driver_fd()
    }

    /// The device socket the group's packets arrive on, unless it uses shared memory only
    /// (see [`crate::Driver::rx_fd`]).
    pub(crate) fn rx_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        // Without the hold the socket stays with the engine thread: a watcher would only race
        // it for packets.
        if self.hold_for.is_zero() {
            return None;
        }
        self.cq.rx_fd()
    }

    /// Receives what waits on the device socket, then handles the group's completions (see
    /// [`crate::Driver::receive`]).
    pub(crate) fn receive(self: &Arc<Self>) {
        // (A group on shared memory has nothing on the socket: no system call for nothing.)
        if !self.same_host() {
            self.cq.receive();
        }
        self.progress();
    }

    /// For a thread about to sleep in its own wait on [`Self::event_fd`] (an epoll set):
    /// starts a drive and says it sleeps. `false`: something is there already — it was
    /// handled and the drive ended; check readiness without sleeping. Either way the group
    /// stays held for the thread's next wait (see [`Hold`]).
    ///
    /// `rx`: the caller's wait also watches [`Self::rx_fd`] (edge-triggered) and calls
    /// [`Self::receive`] when it fires; then the group's packets wake it directly.
    pub(crate) fn sleep_begin(self: &Arc<Self>, rx: bool) -> bool {
        self.cq.begin_drive();
        if !self.hold_for.is_zero() {
            let mut h = self.hold.lock();
            // A group that is down has no poller left to take a hold back (`release_hold`);
            // read under the hold's lock, which `release_hold` takes after the group went down.
            if !self.down.load(Ordering::Acquire) {
                if !h.held {
                    h.held = true;
                    self.cq.begin_drive();
                }
                if rx && !h.rx && !self.same_host() {
                    h.rx = true;
                    self.cq.delegate_rx(true);
                }
            }
            h.sleeping += 1;
            h.last = Instant::now();
        }
        if self.cq.drive_spin() || self.cq.drive_sleep(true) {
            self.hold_woke();
            self.cq.end_drive();
            self.progress();
            return false;
        }
        true
    }

    /// Ends what [`Self::sleep_begin`] started (after the wait returned).
    pub(crate) fn sleep_end(&self, slept: Duration, woken: bool) {
        self.cq.drive_sleep(false);
        if woken {
            self.cq.drive_woke_after(slept);
        }
        self.hold_woke();
        self.cq.end_drive();
    }

    /// A holder's sleep ended: the poller, if it went to its long timer meanwhile, must watch
    /// the hold again.
    fn hold_woke(&self) {
        if self.hold_for.is_zero() {
            return;
        }
        let mut h = self.hold.lock();
        h.sleeping = h.sleeping.saturating_sub(1);
        let now = Instant::now();
        h.last = now;
        // Under the hold lock: `check_hold` sets `poller_until` under it too.
        if h.poller_until.is_some_and(|t| t > now + self.hold_for) {
            h.poller_until = None;
            self.cq.kick();
        }
    }

    /// The poller's look at the hold before it sleeps for at most `wait`: takes the group back
    /// from holders away longer than `hold_for`; returns how long to sleep (shorter while
    /// holders are awake; while they sleep they are signalled themselves, and the first to wake
    /// kicks the poller, see `hold_woke`).
    fn check_hold(&self, wait: Duration) -> Duration {
        if self.hold_for.is_zero() {
            return wait;
        }
        let mut h = self.hold.lock();
        let now = Instant::now();
        let since = now.saturating_duration_since(h.last);
        let wait = if !h.held {
            wait
        } else if h.sleeping > 0 {
            if since >= HOLD_IDLE {
                wait
            } else {
                wait.min(HOLD_IDLE - since)
            }
        } else if since >= self.hold_for {
            h.held = false;
            if std::mem::take(&mut h.rx) {
                self.cq.delegate_rx(false);
            }
            // What arrived meanwhile is signalled to the poller (us) now.
            self.cq.end_drive();
            wait
        } else {
            wait.min(self.hold_for - since)
        };
        h.poller_until = Some(now + wait);
        wait
    }

    /// A thread blocked in a read or write (until `deadline`) waits for the group's next
    /// completions and handles them itself, so the message it waits for costs one wake-up (its
    /// own) instead of two (the poller's, then its own). Returns false if another thread is
    /// the blocking driver already (then wait on the condition variable: it handles ours too).
    ///
    /// `changed` says whether the caller's condition may have changed since it checked it
    /// (another thread handled something for it meanwhile): then it does not sleep.
    ///
    /// Call it only after [`Self::claim_blocking_driver`] returned true (it gives the claim
    /// back): the claim is taken while the caller still holds its connection's lock, so a
    /// thread that does not get it waits on its condition variable without a gap in which a
    /// wake-up could pass unseen.
    pub(crate) fn drive_blocked(
        self: &Arc<Self>,
        deadline: Option<Instant>,
        changed: impl Fn() -> bool,
    ) {
        /// Ends the drive and gives the role back however this function is left (a panic in
        /// `handle` must not leave the group driven: the poller would never take completions).
        struct Drive<'a>(&'a LinkGroup);
        impl Drop for Drive<'_> {
            fn drop(&mut self) {
                self.0.cq.end_drive();
                self.0.blocking_driver.store(false, Ordering::Release);
                DRIVING.with(|d| d.set(false));
            }
        }
        DRIVING.with(|d| d.set(true));
        self.cq.begin_drive();
        let _drive = Drive(self);
        // The poller takes no new batch now; waiting for the driver lock lets it finish the
        // one it may be handling, so `changed` sees its effect.
        self.handle_queued();
        if !changed() {
            // Capped: a wake-up lost to a bug would cost a second, not the connection.
            let cap = Duration::from_secs(1);
            let timeout = deadline.map_or(cap, |d| {
                d.saturating_duration_since(Instant::now()).min(cap)
            });
            // An error of the CQ wait is the poller's to report; this thread just goes on.
            let _ = self.cq.drive_wait(Some(timeout));
            self.handle_queued();
        }
    }

    /// Wakes the blocking driver, if there is one and it is not this thread's own handling
    /// (its sleep ends; it re-checks its condition).
    /// Wakes whoever sleeps on the group's driver descriptor (see [`crate::Driver::kick`]).
    pub(crate) fn kick_drivers(&self) {
        self.cq.kick_driver();
    }

    pub(crate) fn kick_blocking_driver(&self) {
        if self.blocking_driver.load(Ordering::Acquire) && !DRIVING.with(|d| d.get()) {
            self.cq.kick_driver();
        }
    }

    /// Claims the group's blocking driver role (see [`Self::drive_blocked`]); false if another
    /// thread has it or the group is down.
    pub(crate) fn claim_blocking_driver(&self) -> bool {
        !self.down.load(Ordering::Acquire) && !self.blocking_driver.swap(true, Ordering::AcqRel)
    }

    /// Takes and handles what the completion queue holds, under the driver lock.
    fn handle_queued(self: &Arc<Self>) {
        let _driver = self.driver.lock();
        self.handle_batches(usize::MAX);
    }

    /// Takes and handles up to `batches` batches of completions (the driver lock held);
    /// stops early when the queue is empty or the group failed.
    fn handle_batches(self: &Arc<Self>, batches: usize) {
        let mut wcs = [WorkCompletion::EMPTY; 64];
        for _ in 0..batches {
            let n = self.cq.poll(&mut wcs);
            if n == 0 || self.handle(&wcs[..n]) {
                return;
            }
        }
    }

    /// Handles what an application thread finds in the completion queue, if no other thread
    /// is doing so (never blocks): the CDC that makes its socket readable is then handled
    /// on its own thread, without waiting for the poller to wake.
    pub(crate) fn progress(self: &Arc<Self>) {
        if !self.hold_for.is_zero() {
            // A loop came by (an `epoll_wait` that does not sleep, too): the hold stays.
            let mut h = self.hold.lock();
            if h.held {
                h.last = Instant::now();
            }
        }
        let Some(_driver) = self.driver.try_lock() else {
            return;
        };
        self.handle_batches(16);
    }

    /// Handles completions (CDCs, LLC messages, SEND completions), runs the link's timers and
    /// wakes connections. Called with the driver lock held. Returns true once the group failed.
    fn handle(self: &Arc<Self>, wcs: &[WorkCompletion]) -> bool {
        if !self.shown_shm.load(Ordering::Relaxed) && self.same_host() {
            // The switch to shared memory happens once the first UDP exchanges are
            // acknowledged: show it (whichever thread handles completions then).
            self.shown_shm.store(true, Ordering::Relaxed);
            let up = self.st.lock().g.is_up();
            self.publish(if up {
                crate::stats::lg::LINK_ACTIVE
            } else {
                crate::stats::lg::LINK_ACTIVATING
            });
        }
        let now = Instant::now();
        let mut cdcs: Vec<(Arc<ConnShared>, CdcMessage)> = Vec::new();
        // Connections whose data CDC's SEND completed (with its sequence number) or was
        // flushed by a failed link (none).
        let mut sent: Vec<(Arc<ConnShared>, Option<u16>)> = Vec::new();
        let unmoved = {
            let mut guard = self.st.lock();
            let st = &mut *guard;
            for wc in wcs {
                let path = self.path_of(wc.qp_num);
                if wc.status != WcStatus::Success {
                    if st.g.is_live(path) {
                        st.g.transport_failed(path, &self.failure_cause(path, wc.status));
                    }
                    // A SEND flushed by a failed link frees its slot (and its connection's
                    // count of CDCs in flight); a surviving link carries on.
                    if wc.opcode == WcOpcode::Send && (wc.wr_id as usize) < SEND_SLOTS {
                        if let Some(c) = st.g.conns.complete(wc.wr_id as usize) {
                            sent.push((c, None));
                        }
                        self.cond.notify_all();
                    }
                    continue;
                }
                match wc.opcode {
                    WcOpcode::Recv => {
                        let slot = wc.wr_id as usize;
                        let p = &self.paths[path];
                        let len = (wc.byte_len as usize).min(SLOT);
                        let mut b = [0u8; SLOT];
                        self.recv_mr.read(slot * SLOT, &mut b[..len]);
                        // An LLC message longer than a slot (ADD LINK with many rkeys).
                        let long = match &p.big {
                            Some(big) if wc.byte_len as usize > SLOT => {
                                let n = (wc.byte_len as usize).min(LLC_MAX);
                                let mut v = vec![0u8; n];
                                v[..SLOT].copy_from_slice(&b);
                                big.read(0, &mut v[SLOT..]);
                                Some(v)
                            }
                            _ => None,
                        };
                        let _ = p.post_recv(&self.recv_mr, slot);
                        if b[0] == cdc::CDC_TYPE {
                            // CDCs count on any link (Linux accepts them on each).
                            st.g.note_activity(path, now);
                            match CdcMessage::parse(&b[..len]) {
                                // Linux drops CDCs for unknown tokens too.
                                Ok(m) => {
                                    if let Route::Conn(c) = st.g.conns.route(m) {
                                        cdcs.push((c, m));
                                    }
                                }
                                Err(_) => st.g.bad_cdc(now),
                            }
                        } else {
                            st.g.handle_llc(path, long.as_deref().unwrap_or(&b[..len]), now);
                        }
                    }
                    WcOpcode::Send => {
                        let slot = wc.wr_id as usize;
                        if let Some(c) = st.g.conns.complete(slot) {
                            // A data CDC: its sequence number is what a failover validates
                            // (groups that can fail over only).
                            let seq = (self.paths.len() > 1).then(|| {
                                let mut b = [0u8; cdc::CDC_LEN];
                                self.send_mr.read(slot * SLOT, &mut b);
                                CdcMessage::parse(&b).ok().map(|m| m.seq)
                            });
                            sent.push((c, seq.flatten()));
                        }
                        self.cond.notify_all();
                    }
                    _ => {}
                }
            }
            // (The linger timer too: the group's state machine deletes an idle group.)
            self.run_links(st, now);
            st.g.take_unmoved()
        };
        for (c, m) in cdcs {
            c.on_cdc(self, &m);
        }
        let retry: Vec<Arc<ConnShared>> = { self.st.lock().g.conns.take_deferred() };
        for (c, seq) in sent {
            if let Some(seq) = seq {
                c.core.lock().core.cdc_done(seq);
            }
            c.on_sent(self);
        }
        for c in retry {
            c.flush_corked(self);
        }
        if unmoved {
            // A link failed: its requests were flushed into the completion queue. Take them
            // first (their SEND slots, the connections' counts, what completed before), then
            // move every connection to the surviving link.
            let mut more = [WorkCompletion::EMPTY; 64];
            loop {
                let n = self.cq.poll(&mut more);
                if n == 0 {
                    break;
                }
                if self.handle(&more[..n]) {
                    return true;
                }
            }
            self.move_conns();
        }
        let down = self.st.lock().g.down().cloned();
        if let Some(r) = down {
            self.fail(r);
            return true;
        }
        false
    }

    /// Runs the group's timers and handles what its links reported (a failover, an added
    /// link, the group down: see [`GroupEvent`]), then sends what their LLC queued.
    fn run_links(&self, st: &mut LgState, now: Instant) {
        if self.paths.len() > 1 && self.same_host() {
            st.g.set_same_host();
        }
        st.g.handle_timeout(now);
        self.on_group_events(st, now);
        self.flush_llc(st);
    }

    /// Carries out what the group's state machine asks for (queue pairs to stop or connect,
    /// a failover to publish, waiters to wake).
    fn on_group_events(&self, st: &mut LgState, now: Instant) {
        while let Some(ev) = st.g.poll_event() {
            match ev {
                GroupEvent::Up { link_id } => {
                    self.link_id.store(u32::from(link_id), Ordering::Relaxed);
                    self.publish(crate::stats::lg::LINK_ACTIVE);
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.links_confirmed.fetch_add(1, Ordering::Relaxed);
                    }
                    self.cond.notify_all();
                }
                GroupEvent::SpareUp { .. } => {
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.links_confirmed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                GroupEvent::RkeyDone { .. } => {
                    self.cond.notify_all();
                }
                GroupEvent::PeerConfirmedRkey { path, rkey } => {
                    // A new RMB's key on each link (Linux's differ per link).
                    self.rtokens
                        .lock()
                        .confirm(path, &rkey, |id| st.g.path_of_link(id));
                }
                GroupEvent::PeerDeletedRkeys { path, rkeys } => {
                    self.rtokens.lock().delete(path, &rkeys);
                }
                GroupEvent::PathError(path) => {
                    if let Some(p) = self.paths.get(path) {
                        let _ = p.qp.modify(&QpAttr::state(QpState::Error));
                    }
                }
                GroupEvent::PrepareAddLink { path, link_id } => {
                    let req = self
                        .rkey_pairs(st)
                        .filter(|_| self.paths[path].reset(&self.recv_mr).is_ok())
                        .map(|rkeys| self.add_link_msg(path, link_id, self.mtu, rkeys));
                    match req {
                        Some(req) => st.g.add_link_request(req, now),
                        None => st.g.add_link_failed(now),
                    }
                }
                GroupEvent::ConnectAdded { path, resp } => {
                    let mtu = smaller_mtu(resp.mtu, self.mtu);
                    let ok = resp.gid.to_ipv4().is_some_and(|ip| {
                        self.paths[path]
                            .connect(ip, resp.qpn, resp.initial_psn, mtu, self.peer_port(), true)
                            .is_ok()
                    });
                    if ok {
                        self.learn_rkeys(path, resp.v2.as_ref());
                    }
                    st.g.added_link_connected(path, resp.link_id, ok, now);
                }
                GroupEvent::AnswerAddLink { path, req } => {
                    let mtu = smaller_mtu(req.mtu, self.mtu);
                    let rkeys = self.rkey_pairs(st);
                    let set_up = rkeys.is_some()
                        && req.gid.to_ipv4().is_some_and(|ip| {
                            let p = &self.paths[path];
                            p.reset(&self.recv_mr).is_ok()
                                && p.connect(
                                    ip,
                                    req.qpn,
                                    req.initial_psn,
                                    mtu,
                                    self.peer_port(),
                                    true,
                                )
                                .is_ok()
                        });
                    let resp = match (rkeys, set_up) {
                        (Some(rkeys), true) => {
                            self.learn_rkeys(path, req.v2.as_ref());
                            Some(self.add_link_msg(path, req.link_id, mtu, rkeys))
                        }
                        _ => None,
                    };
                    st.g.answer_add_link(path, resp, now);
                }
                GroupEvent::Failover {
                    epoch,
                    active,
                    link_id,
                } => {
                    self.link_id.store(u32::from(link_id), Ordering::Relaxed);
                    self.route
                        .store(u64::from(epoch) << 8 | active as u64, Ordering::Release);
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.failovers.fetch_add(1, Ordering::Relaxed);
                        if let Some(a) = &rt.stats {
                            a.count(crate::stats::total::LINK_FAILOVERS);
                        }
                    }
                    crate::metrics::link_failover();
                    self.publish(crate::stats::lg::LINK_ACTIVE);
                }
                // `handle` fails the group and its connections once it is down.
                GroupEvent::Down(_) => {}
            }
        }
    }

    /// Our RMBs (in use and pooled) as ADD LINK's rkey entries: the same key and address on
    /// both links (one protection domain). `None` when they do not fit one message.
    fn rkey_pairs(&self, st: &LgState) -> Option<Vec<llc::RkeyPair>> {
        let mut pairs: Vec<llc::RkeyPair> =
            st.g.conns
                .conns()
                .iter()
                .map(|c| c.rmb.clone())
                .chain(st.rmb_pool.iter().cloned())
                .map(|m| llc::RkeyPair {
                    rkey: m.rkey(),
                    rkey_new: m.rkey(),
                    vaddr_new: m.addr(),
                })
                .collect();
        pairs.sort_by_key(|p| p.rkey);
        pairs.dedup_by_key(|p| p.rkey);
        (pairs.len() <= ADD_LINK_MAX_RKEYS).then_some(pairs)
    }

    /// The peer's RMB keys on the link being added on `spare`, from its ADD LINK.
    fn learn_rkeys(&self, spare: usize, v2: Option<&llc::AddLinkV2Ext>) {
        if let Some(x) = v2 {
            self.rtokens.lock().add_link(1 - spare, spare, &x.rkeys);
        }
    }

    /// ADD LINK for our side of a link on `path` (its address, QP and PSN), with `rkeys` (the
    /// request; `LinkCore` marks an answer as the response).
    fn add_link_msg(
        &self,
        path: usize,
        link_id: u8,
        mtu: QpMtu,
        rkeys: Vec<llc::RkeyPair>,
    ) -> llc::AddLink {
        let p = &self.paths[path];
        let gid = Gid::from_ipv4(p.src);
        llc::AddLink {
            response: false,
            reject: false,
            reject_reason: 0,
            mac: self.dev.mac,
            gid,
            qpn: p.qp.qp_num(),
            link_id,
            mtu,
            initial_psn: p.psn.load(Ordering::Relaxed),
            v2: Some(llc::AddLinkV2Ext {
                v2_direct: true,
                target_gid: gid,
                rkeys,
            }),
        }
    }

    /// The peer's RoCE port.
    fn peer_port(&self) -> u16 {
        self.runtime.upgrade().map_or(4791, |rt| rt.cfg.roce_port)
    }

    /// After a failover: every connection moves to the active link (one that cannot now —
    /// no SEND slot — is tried again at the next completion, and moves itself before it
    /// posts anything).
    fn move_conns(&self) {
        let conns = self.st.lock().g.conns.conns();
        let mut left = false;
        let epoch = self.route().0;
        for c in conns {
            // A thread holding the connection may be waiting for a SEND slot, which only the
            // driver (us) frees: never wait for it here; it moves itself before it posts.
            let Some(mut s) = c.core.try_lock() else {
                left = true;
                continue;
            };
            if s.released || s.epoch == epoch {
                continue;
            }
            // `route` wants a slot held for the caller's own message; there is none here.
            let moved = self.take_slot(true).and_then(|slot| {
                c.route(&mut s, self, slot, true)
                    .map(|_| self.put_back(slot))
            });
            match moved {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => left = true,
                Err(_) => {
                    // `route` recorded why.
                    drop(s);
                    c.wake();
                }
            }
        }
        if left {
            self.st.lock().g.set_unmoved();
        }
    }

    /// An RMB of `size` bytes for a new connection: a free one from the pool, else a new
    /// registration within the runtime's budget.
    pub(crate) fn take_rmb(&self, size: u32) -> Result<Arc<MemoryRegion>, clc::DeclineReason> {
        {
            let mut st = self.st.lock();
            if let Some(i) = st
                .rmb_pool
                .iter()
                .position(|m| m.len() == size as usize && Arc::strong_count(m) == 1)
            {
                return Ok(st.rmb_pool.swap_remove(i));
            }
        }
        let rt = self.runtime.upgrade().ok_or(clc::DeclineReason::INTERR)?;
        if !rt.reserve_rmb(size) {
            return Err(clc::DeclineReason::MEM);
        }
        match self
            .pd
            .reg_mr(size as usize, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        {
            Ok(mr) => Ok(Arc::new(mr)),
            Err(_) => {
                rt.release_rmb(size);
                Err(clc::DeclineReason::MEM)
            }
        }
    }

    /// A send buffer of `size` bytes (the peer's RMB size), pooled like RMBs.
    pub(crate) fn take_sndbuf(&self, size: u32) -> io::Result<Arc<MemoryRegion>> {
        {
            let mut st = self.st.lock();
            if let Some(i) = st
                .sndbuf_pool
                .iter()
                .position(|m| m.len() == size as usize && Arc::strong_count(m) == 1)
            {
                return Ok(st.sndbuf_pool.swap_remove(i));
            }
        }
        Ok(Arc::new(
            self.pd.reg_mr(size as usize, Access::LOCAL_WRITE)?,
        ))
    }

    /// Announces a connection's RMB on this existing group with CONFIRM RKEY and waits for the
    /// peer's answer, as Linux does before its Accept/Confirm (`smcr_lgr_reg_rmbs`).
    pub(crate) fn confirm_rkey(&self, rmb: &MemoryRegion) -> io::Result<()> {
        loop {
            let epoch = self.route().0;
            match self.confirm_rkey_once(rmb) {
                // The link it went on failed meanwhile (the group survived on the other):
                // ask again there.
                Err(_) if self.route().0 != epoch && !self.is_down() => {}
                r => return r,
            }
        }
    }

    fn confirm_rkey_once(&self, rmb: &MemoryRegion) -> io::Result<()> {
        let mut guard = self.st.lock();
        if guard.confirmed.contains(&rmb.rkey()) {
            // A pooled RMB the peer still knows (`rkey_reuse`).
            return Ok(());
        }
        let st = &mut *guard;
        // The link answers every request (the peer's answer, its LLC_WAIT timer once sent,
        // or the link going down), one request at a time: ours may wait behind the others
        // (many connections set up at once over a slow path). The deadline only bounds a
        // bug. (Was LLC_WAIT + 1 s from now: 65 connections at once over a 20 ms path timed
        // out in the queue and deleted a healthy group.)
        let (id, backlog) = match st.g.confirm_rkey(rmb.rkey(), rmb.addr(), Instant::now()) {
            Ok(started) => started,
            Err(RkeyError::NoLink) => return Err(io::Error::other("link not started")),
            Err(RkeyError::Down(why)) => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    why.to_string(),
                ));
            }
        };
        self.count_rkey_request();
        self.flush_llc(st);
        let deadline = Instant::now() + link::LLC_WAIT * backlog + Duration::from_secs(1);
        loop {
            if let Some(ok) = guard.g.take_rkey_result(id) {
                return if ok {
                    if self.rkey_reuse {
                        guard.confirmed.insert(rmb.rkey());
                    }
                    Ok(())
                } else {
                    Err(io::Error::other("CONFIRM RKEY refused or unanswered"))
                };
            }
            if let Some(r) = guard.g.down() {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    r.to_string(),
                ));
            }
            if self.cond.wait_until(&mut guard, deadline).timed_out() {
                guard.g.forget_rkey(id);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "CONFIRM RKEY unanswered",
                ));
            }
        }
    }

    fn count_rkey_request(&self) {
        if let Some(rt) = self.runtime.upgrade() {
            rt.rkey_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An RMB taken for a connection whose setup failed: back to the pool, or its budget back
    /// to the runtime when the group is not usable.
    pub(crate) fn give_back(&self, rmb: Arc<MemoryRegion>) {
        let mut st = self.st.lock();
        if st.g.link_params().is_some() && st.g.down().is_none() {
            st.rmb_pool.push(rmb);
        } else if let Some(rt) = self.runtime.upgrade() {
            rt.release_rmb(rmb.len() as u32);
        }
    }

    /// A connection is gone: keep its buffers for later connections, and withdraw its RMB's
    /// rkey (DELETE RKEY, not waited for) unless the peer keeps it (`rkey_reuse`).
    fn recycle(&self, rmb: &Arc<MemoryRegion>, sndbuf: &Arc<MemoryRegion>) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        if st.g.down().is_some() {
            if let Some(rt) = self.runtime.upgrade() {
                rt.release_rmb(rmb.len() as u32);
            }
            return;
        }
        if !st.confirmed.contains(&rmb.rkey()) && st.g.delete_rkey(rmb.rkey(), Instant::now()) {
            self.count_rkey_request();
        }
        self.flush_llc(st);
        st.rmb_pool.push(rmb.clone());
        st.sndbuf_pool.push(sndbuf.clone());
    }

    /// Marks the group down and fails every connection on it.
    /// The connections learn the group's first reason (a later one is the same failure seen
    /// again).
    pub(crate) fn fail(&self, reason: GroupDown) {
        self.down.store(true, Ordering::Release);
        self.publish(crate::stats::lg::LINK_INACTIVE);
        let (conns, reason) = {
            let mut st = self.st.lock();
            let reason = st.g.fail(reason).clone();
            self.cond.notify_all();
            if let Some(rt) = self.runtime.upgrade() {
                for mr in st.rmb_pool.drain(..) {
                    rt.release_rmb(mr.len() as u32);
                }
            }
            st.sndbuf_pool.clear();
            let conns = st.g.conns.drain();
            self.publish_conns(&st);
            (conns, reason)
        };
        if let Some(s) = &self.stat {
            s.release();
        }
        for c in conns {
            c.fail(&reason);
            // A connection its application already closed waits for the peer's close to be
            // released; that will not come now: release it here, or its RMB's share of the
            // budget would stay counted for good (the stream is gone, nobody else will).
            let closed = c.core.lock().local_closed;
            if closed {
                c.release(self);
            }
        }
        let orderly = self.st.lock().g.orderly();
        for (i, p) in self.paths.iter().enumerate() {
            // After our own DELETE LINK the active link still delivers what was posted
            // (`finish`); every other queue pair stops now.
            if !orderly || i != self.active() {
                let _ = p.qp.modify(&QpAttr::state(QpState::Error));
            }
        }
    }

    /// The poller's last act: after our own DELETE LINK, waits (bounded by the transport's
    /// retries) until the peer has acknowledged everything posted, so closing a connection
    /// and deleting the group right after it (a process that ends) loses nothing in flight;
    /// then the queue pair fails.
    fn finish(&self) {
        if self.st.lock().g.orderly() {
            let deadline = Instant::now() + DRAIN_WAIT;
            let qp = self.qp();
            while qp.unfinished_sends() > 0
                && qp.state() != QpState::Error
                && Instant::now() < deadline
            {
                // The engine thread receives the ACKs, unless an event loop holding another
                // group of this device watches the socket: then the ACKs would wait for it.
                self.cq.receive();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for p in &self.paths {
            let _ = p.qp.modify(&QpAttr::state(QpState::Error));
        }
    }

    /// Whether every request posted on the group's queue pairs is acknowledged (or can never
    /// be: the queue pair failed).
    fn sends_done(&self) -> bool {
        self.paths
            .iter()
            .all(|p| p.qp.unfinished_sends() == 0 || p.qp.state() == QpState::Error)
    }

    /// Whether the connections hold nothing more to write and all that was sent is
    /// acknowledged.
    fn drained(&self) -> bool {
        let conns = self.st.lock().g.conns.conns();
        conns.iter().all(|c| {
            let s = c.core.lock();
            s.staged == 0 && s.inflight == 0
        }) && self.sends_done()
    }

    /// Drives the group until `done` holds, the group is down, or `deadline` passed.
    fn wait(self: &Arc<Self>, deadline: Instant, done: impl Fn(&Self) -> bool) {
        while !done(self) && Instant::now() < deadline {
            // As `finish`: take what arrived, whoever else might (an event loop that holds
            // the group, the poller), then handle it.
            self.cq.receive();
            self.progress();
            if self.is_down() && self.sends_done() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Removes a connection whose both sides have closed; the link group stays (lingers) for
    /// later connections.
    pub(crate) fn detach(&self, token: u32) {
        let mut st = self.st.lock();
        st.g.conns.detach(token, Instant::now());
        st.watch.remove(&token);
        self.publish_conns(&st);
    }

    /// The TCP connection under `token` hung up (seen by `tcpwatch`): unless the connection
    /// closed meanwhile, the link is probed (TEST LINK): a peer whose process died does not
    /// answer, and the group fails.
    pub(crate) fn tcp_hung_up(&self, token: u32) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        if st.watch.remove(&token).is_none() {
            return;
        }
        st.g.probe(Instant::now());
        self.flush_llc(st);
        drop(guard);
        // The poller, asleep on its long timer, learns the probe's deadline.
        self.cq.kick();
    }

    /// Gives up a new group whose first link did not come up. A client's fails here and now,
    /// its RMBs freed: the server never confirmed it (Linux: `smc_lgr_cleanup_early`). A
    /// server's is deleted (DELETE LINK): the client's link may be up while ours is not (its
    /// CONFIRM LINK response lost), and its connection must fail now, not at its keepalive.
    /// A group that came up after all is deleted as usual.
    pub(crate) fn abandon(&self) {
        if self.st.lock().g.is_up() || self.role == link::Role::Server {
            self.terminate();
        } else {
            self.fail(GroupDown::FirstLinkNotUp);
        }
    }

    /// Deletes the link group (DELETE LINK to the peer) and stops its poller.
    pub(crate) fn terminate(&self) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        // No new connection may pick this group from now on.
        st.g.terminate();
        self.flush_llc(st);
    }
}

/// One SMC-R connection's shared state (the stream holds it; so does the link group until
/// both sides closed, because the peer may still write into our RMB until it has seen our
/// close).
pub(crate) struct ConnShared {
    pub(crate) token: u32,
    pub(crate) rmb: Arc<MemoryRegion>,
    pub(crate) sndbuf: Arc<MemoryRegion>,
    pub(crate) core: Mutex<ConnState>,
    pub(crate) cond: Condvar,
    /// Counts [`ConnShared::wake`]s: a thread that checked its condition and then drives the
    /// group instead of waiting on `cond` learns from it that the condition may have changed
    /// in between.
    pub(crate) wakes: std::sync::atomic::AtomicU64,
    /// The group, to wake its blocking driver when something other than a completion changes
    /// this connection (a shutdown or abort by another thread, the group failing).
    pub(crate) lg: Weak<LinkGroup>,
    /// Two eventfds, for readers and for writers, made readable at every state change (data,
    /// space, close, failure); created on demand for poll/epoll and async users. Two, because
    /// a reactor keeps one waiter per fd and direction.
    pub(crate) events: [std::sync::OnceLock<OwnedFd>; 2],
    /// Told the readiness an application would see (the preload's fd), at every change.
    pub(crate) readiness: std::sync::OnceLock<Box<dyn Readiness>>,
}

/// What `poll` should report for a connection, kept current by the connection (under its
/// lock, so updates arrive in order). The preload implements it with a socket whose kernel
/// readiness it controls.
pub trait Readiness: Send + Sync {
    /// The state changed: readable (data, EOF or error), writable (space, or an error to
    /// report), read side hung up (peer done writing or gone), fully hung up.
    fn update(&self, state: ReadyState);
}

/// Readiness of a connection as poll/epoll report it for sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadyState {
    /// POLLIN: a read would not block.
    pub readable: bool,
    /// POLLOUT: a write would not block.
    pub writable: bool,
    /// POLLRDHUP: the peer will send no more.
    pub rdhup: bool,
    /// POLLHUP: both directions are finished (or the connection failed).
    pub hup: bool,
    /// POLLERR: the connection was reset (the peer aborted it, or it failed).
    pub error: bool,
    /// Counts arrivals of data (wrapping): a change while `readable` stays true is a new
    /// arrival, which edge-triggered epoll reports again for a socket.
    pub arrivals: u32,
}

pub(crate) struct ConnState {
    pub(crate) core: ConnCore,
    pub(crate) failed: Option<ConnFailure>,
    pub(crate) local_closed: bool,
    pub(crate) released: bool,
    /// The peer's RMB as the path we last wrote on reaches it (see [`crate::rtokens`]).
    pub(crate) peer: crate::rtokens::PeerRmb,
    /// Bytes copied into the send buffer but not yet written and announced (autocorking).
    pub(crate) staged: u32,
    /// Data CDCs posted whose SEND has not completed.
    pub(crate) inflight: u32,
    /// Counters.
    pub(crate) stats: crate::ConnStats,
    /// We shut down writing (shutdown or close).
    pub(crate) shut_wr: bool,
    /// We shut down reading: reads give EOF once the queued data is read.
    pub(crate) shut_rd: bool,
    /// A reset (peer abort or failure) was reported to the application once; later reads
    /// give EOF and writes EPIPE, as for a TCP socket whose error was collected.
    pub(crate) reset_reported: bool,
    /// What the readiness sink was last told.
    pub(crate) reported: Option<ReadyState>,
    /// Data arrivals (see [`ReadyState::arrivals`]).
    pub(crate) arrivals: u32,
    /// The connection's record in the stats area, while the stream holds it (cleared under
    /// this lock before the record is freed, so no late update lands in a reused slot).
    pub(crate) stat: Option<StatRef>,
    /// The group's failover epoch this connection last moved at (see [`ConnShared::route`]).
    pub(crate) epoch: u32,
}

/// Where a connection publishes its cursors and state.
pub(crate) struct StatRef {
    pub(crate) area: Arc<crate::stats::Area>,
    pub(crate) slot: usize,
    /// When negotiation began (stage times are offsets from it).
    pub(crate) start: Instant,
}

impl ConnState {
    /// Linux's SMC state for this connection now (`enum smc_state`).
    pub(crate) fn linux_state(&self) -> u64 {
        let (_, _, _, _, local, peer) = self.core.cursors();
        let closed = ConnStateFlags::PEER_CONN_CLOSED;
        let done = ConnStateFlags::PEER_DONE_WRITING | closed;
        if peer.contains(ConnStateFlags::PEER_CONN_ABORT) || self.failed.is_some() {
            return if self.local_closed { 7 } else { 27 }; // CLOSED, PROCESSABORT
        }
        if local.contains(ConnStateFlags::PEER_CONN_ABORT) {
            return 26; // PEERABORTWAIT
        }
        match (local.intersects(done), peer.intersects(done)) {
            (false, false) => 1, // ACTIVE
            // We closed or shut down writing; the peer has not.
            (true, false) => {
                if local.contains(closed) {
                    21 // PEERCLOSEWAIT2
                } else {
                    20 // PEERCLOSEWAIT1
                }
            }
            // The peer did; we have not.
            (false, true) => {
                if peer.contains(closed) {
                    23 // APPCLOSEWAIT2
                } else {
                    22 // APPCLOSEWAIT1
                }
            }
            (true, true) => {
                if local.contains(closed) && peer.contains(closed) {
                    7 // CLOSED
                } else if local.contains(closed) {
                    25 // PEERFINCLOSEWAIT
                } else {
                    24 // APPFINCLOSEWAIT
                }
            }
        }
    }

    /// Publishes cursors, flags and state to the stats area (cheap relaxed stores).
    pub(crate) fn publish(&self) {
        use crate::stats::conn::live;
        let Some(st) = &self.stat else { return };
        let (tp, pc, rp, rc, lf, pf) = self.core.cursors();
        let w = |c: cdc::Cursor| u64::from(c.wrap) << 32 | u64::from(c.count);
        st.area.set_live(st.slot, live::TX_PROD, w(tp));
        st.area.set_live(st.slot, live::PEER_CONS, w(pc));
        st.area.set_live(st.slot, live::RX_PROD, w(rp));
        st.area.set_live(st.slot, live::RX_CONS, w(rc));
        st.area.set_live(
            st.slot,
            live::FLAGS,
            u64::from(lf.bits()) | u64::from(pf.bits()) << 8 | self.linux_state() << 16,
        );
    }
}

impl ConnShared {
    /// Most bytes held back while a CDC is in flight (Linux: min(sndbuf/2, autocorking_size
    /// 64 KiB)).
    pub(crate) fn cork_limit(&self) -> u32 {
        ((self.sndbuf.len() / 2) as u32).min(64 * 1024)
    }

    /// Writes and announces the staged bytes (one or two RDMA WRITEs and a CDC); `pending` is
    /// what the writer has in all (for the "writing blocked" flag).
    pub(crate) fn flush_locked(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        pending: u32,
        poller: bool,
    ) -> io::Result<()> {
        self.flush_staged(s, lg, pending, poller, false)
    }

    /// Writes the staged bytes (unless `written`: already in the peer's RMB, see
    /// [`Self::write_direct`]) and announces them with a CDC.
    fn flush_staged(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        pending: u32,
        poller: bool,
        written: bool,
    ) -> io::Result<()> {
        if s.staged == 0 {
            return Ok(());
        }
        // The slot first: once the cursor has advanced, the CDC must go out.
        let slot = lg.take_slot(poller)?;
        let path = self.route(s, lg, slot, poller)?;
        let plan = s.core.prepare_write(s.staged, pending.max(s.staged));
        let pieces: Vec<(u32, u32)> = plan
            .pieces
            .into_iter()
            .filter(|p| p.1 > 0 && !written)
            .collect();
        s.stats.bytes_sent += u64::from(s.staged);
        s.stats.data_cdcs += 1;
        if let Some(st) = &s.stat {
            let at = st.start.elapsed().as_nanos().max(1) as u64;
            st.area
                .set_live_once(st.slot, crate::stats::conn::live::FIRST_WRITE, at);
        }
        s.staged = 0;
        s.inflight += 1;
        s.publish();
        let writes = DataWrites {
            sndbuf: &self.sndbuf,
            pieces: &pieces,
            peer: lg.peer_rmb(&mut s.peer, path),
            slack: plan.slack,
        };
        if lg.post_data(path, &writes, slot, &plan.cdc, self.token)? {
            s.inflight -= 1;
        }
        Ok(())
    }

    /// The path this connection posts on now, holding `slot` (a SEND slot the caller took
    /// first, so the answer is still true when it posts). After a failover (a new epoch), the
    /// connection first moves there (under its lock, before anything else of it is posted
    /// there): Linux's validation CDC, every byte the peer has not consumed written again,
    /// then a CDC with the current cursors (see [`ConnCore::failover`]). A CDC of ours that
    /// announced bytes lost with the failed link can then never arrive before those bytes. A
    /// failed connection moves too (its abort or close CDC announces the same cursors); a
    /// released one posts nothing (its buffers may serve another connection). On an error
    /// `slot` is given back and the connection has failed.
    pub(crate) fn route(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        slot: usize,
        poller: bool,
    ) -> io::Result<usize> {
        let (epoch, path) = lg.route();
        if s.epoch == epoch {
            return Ok(path);
        }
        if s.released {
            lg.put_back(slot);
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "the connection is gone",
            ));
        }
        if s.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_ABORT)
        {
            // The peer aborted: its RMB may already serve another of its connections, so
            // nothing is written again (Linux re-points such connections without a rewrite).
            s.epoch = epoch;
            return Ok(path);
        }
        let moved = (|| -> io::Result<()> {
            let second = lg.take_slot(poller)?;
            let third = match lg.take_slot(poller) {
                Ok(x) => x,
                Err(e) => {
                    lg.put_back(second);
                    return Err(e);
                }
            };
            let f = s.core.failover();
            if let Err(e) = lg.post_cdc(path, second, &f.validation, 0) {
                lg.put_back(third);
                return Err(e);
            }
            let pieces: Vec<(u32, u32)> = f.pieces.into_iter().filter(|p| p.1 > 0).collect();
            let writes = DataWrites {
                sndbuf: &self.sndbuf,
                pieces: &pieces,
                peer: lg.peer_rmb(&mut s.peer, path),
                slack: 0,
            };
            if !lg.post_data(path, &writes, third, &f.cdc, self.token)? {
                s.inflight += 1;
            }
            Ok(())
        })();
        match moved {
            Ok(()) => {
                // Moved: only now may its other messages go to this path.
                s.epoch = epoch;
                s.stats.failovers += 1;
                Ok(path)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                lg.put_back(slot);
                Err(e)
            }
            Err(e) => {
                lg.put_back(slot);
                s.failed
                    .get_or_insert_with(|| ConnFailure::Move(e.to_string()));
                s.publish();
                Err(e)
            }
        }
    }

    /// Sends a CDC of this connection (`m`, made under the same lock) on its path.
    pub(crate) fn send_ctl(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        m: &CdcMessage,
        poller: bool,
    ) -> io::Result<()> {
        let slot = lg.take_slot(poller)?;
        let path = self.route(s, lg, slot, poller)?;
        lg.post_cdc(path, slot, m, 0).map(drop)
    }

    /// Same-host links: writes `buf` straight into the peer's RMB where the next staged bytes
    /// would go (the peer reads nothing past the producer cursor we announced, and `buf` fits
    /// the free space) and announces it, with no copy through the send buffer. Returns false
    /// (nothing announced) when that cannot be done: bytes already staged or a CDC in flight
    /// (order), or a link on UDP.
    pub(crate) fn write_direct(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        buf: &[u8],
        pending: u32,
    ) -> io::Result<bool> {
        if s.staged != 0 || s.inflight != 0 || !lg.same_host() {
            return Ok(false);
        }
        let n = buf.len() as u32;
        let mut at = 0usize;
        for (off, len) in s.core.stage_pieces(0, n) {
            if len == 0 {
                continue;
            }
            let piece = &buf[at..at + len as usize];
            // Same-host groups have one path.
            if !lg.paths[0]
                .qp
                .write_direct(piece, s.peer.vaddr + u64::from(off), s.peer.rkey)
            {
                return Ok(false);
            }
            at += len as usize;
        }
        s.staged = n;
        self.flush_staged(s, lg, pending, false, true)?;
        Ok(true)
    }

    /// A data CDC of ours completed: when none is left in flight, post what was corked.
    fn on_sent(&self, lg: &LinkGroup) {
        let mut s = self.core.lock();
        s.inflight = s.inflight.saturating_sub(1);
        if s.inflight == 0 && s.staged > 0 {
            drop(s);
            self.flush_corked(lg);
        }
    }

    fn flush_corked(&self, lg: &LinkGroup) {
        let mut s = self.core.lock();
        if s.failed.is_some() || s.inflight > 0 {
            return;
        }
        let pending = s.staged;
        match self.flush_locked(&mut s, lg, pending, true) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                lg.st.lock().g.conns.defer_flush(self.token);
            }
            Err(e) => {
                s.failed.get_or_insert(ConnFailure::Post(e.to_string()));
                s.publish();
                drop(s);
                self.wake();
            }
        }
    }

    /// Ends the connection because of the peer (bad cursors, urgent data): an abort CDC tells
    /// it, our application gets `ConnectionReset` with `why`.
    pub(crate) fn abort(&self, s: &mut ConnState, lg: &LinkGroup, why: ConnFailure) {
        s.failed = Some(why);
        let cdc = s.core.close_flags(ConnStateFlags::PEER_CONN_ABORT);
        s.publish();
        let _ = self.send_ctl(s, lg, &cdc, true);
    }

    fn on_cdc(&self, lg: &LinkGroup, m: &CdcMessage) {
        let mut s = self.core.lock();
        if s.failed.is_some() {
            return;
        }
        if m.prod_flags
            .intersects(ProducerFlags::URG_DATA_PENDING | ProducerFlags::URG_DATA_PRESENT)
        {
            // Delivering the urgent byte inline would corrupt the stream for a program that
            // asked for it out of band: refuse clearly instead.
            self.abort(&mut s, lg, ConnFailure::UrgentData);
            drop(s);
            self.wake();
            return;
        }
        let before = s.core.readable();
        match s.core.on_cdc(m) {
            Ok(u) => {
                if s.core.readable() > before {
                    s.arrivals = s.arrivals.wrapping_add(1);
                }
                if u.update_requested {
                    let cdc = s.core.control_cdc();
                    // The poller must not wait; a missed update is re-requested by the peer.
                    let _ = self.send_ctl(&mut s, lg, &cdc, true);
                }
            }
            Err(e) => {
                self.abort(&mut s, lg, ConnFailure::Protocol(e));
            }
        }
        s.publish();
        let peer = s.core.peer_flags();
        let both_closed = s.local_closed
            && (peer.contains(ConnStateFlags::PEER_CONN_CLOSED)
                || peer.contains(ConnStateFlags::PEER_CONN_ABORT));
        drop(s);
        self.wake();
        if both_closed {
            self.release(lg);
        }
    }

    fn fail(&self, reason: &GroupDown) {
        let mut s = self.core.lock();
        s.failed
            .get_or_insert_with(|| ConnFailure::Group(reason.clone()));
        s.publish();
        drop(s);
        self.wake();
    }

    /// Tells the readiness sink the current state if it changed (caller holds the lock).
    pub(crate) fn report(&self, s: &mut ConnState) {
        let Some(sink) = self.readiness.get() else {
            return;
        };
        let pf = s.core.peer_flags();
        let gone = s.failed.is_some() || pf.contains(ConnStateFlags::PEER_CONN_ABORT);
        let peer_done = gone
            || s.shut_rd
            || pf.intersects(ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED);
        let now = ReadyState {
            readable: s.core.readable() > 0 || peer_done,
            writable: s.core.space() > s.staged
                || gone
                || s.local_closed
                || pf.contains(ConnStateFlags::PEER_CONN_CLOSED),
            rdhup: peer_done,
            hup: gone || (peer_done && s.shut_wr),
            error: gone && !s.reset_reported,
            arrivals: s.arrivals,
        };
        if s.reported != Some(now) {
            s.reported = Some(now);
            sink.update(now);
        }
    }

    /// Wakes blocked readers and writers and signals the readiness fds.
    pub(crate) fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::AcqRel);
        if let Some(lg) = self.lg.upgrade() {
            lg.kick_blocking_driver();
        }
        if self.readiness.get().is_some() {
            let mut s = self.core.lock();
            self.report(&mut s);
        }
        self.cond.notify_all();
        for fd in self.events.iter().filter_map(std::sync::OnceLock::get) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes from a valid buffer to our eventfd; a full counter
            // (EAGAIN) already means "readable".
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }

    /// The readiness eventfd, created on first use (non-blocking, close-on-exec). It starts
    /// readable, so a first poll always tries the operation.
    pub(crate) fn readiness_fd(&self, write: bool) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::{AsFd, FromRawFd};
        let slot = &self.events[usize::from(write)];
        if slot.get().is_none() {
            // SAFETY: eventfd has no memory preconditions; the result is checked.
            let fd = unsafe { libc::eventfd(1, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a new fd nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // A concurrent caller may have won; its fd is kept, ours dropped.
            let _ = slot.set(fd);
        }
        Ok(slot.get().expect("set above").as_fd())
    }

    /// Frees the RMB budget and detaches from the link group (once).
    pub(crate) fn release(&self, lg: &LinkGroup) {
        let mut s = self.core.lock();
        if s.released {
            return;
        }
        s.released = true;
        drop(s);
        lg.detach(self.token);
        lg.recycle(&self.rmb, &self.sndbuf);
    }
}
