//! The runtime's settings (`RuntimeConfig`): defaults, and the `SMCR_*` environment.

#[allow(unused_imports)]
use super::*;

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
