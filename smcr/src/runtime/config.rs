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
    /// Which device carries links (`SMCR_RDMA_DEVICE`, `smcr.rdma_device`).
    pub rdma_device: RdmaDevice,
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
    /// On UDP links, an event loop's writes after an `epoll_wait` leave together when it
    /// calls in again (`rdma::cork`: the next `epoll_wait`, `poll`, a wait, a call on another
    /// descriptor), in a few bundles of the link's queue pair instead of a datagram each; a
    /// loop that does not come back has them sent by the engine's timer (200 µs, up to 5 ms
    /// later while a thread of ours keeps the timers). `SMCR_CORK=off`: each write leaves at
    /// once.
    pub cork: bool,
    /// On UDP links to a peer that is our engine, how long the ACK of a received data CDC
    /// may wait for a message of ours to leave with (`SMCR_ACK_DELAY_US`, at most 400;
    /// 0: at once, as rxe does; default 200). The receiver usually answers: the ACK then
    /// rides in the answer's datagram instead of taking a datagram, a system call and a
    /// wake-up of the peer of its own. The sender says when no answer is expected (a CDC
    /// without data, a close, an LLC message, data sent again without hearing back:
    /// `SendFlags::ACK_NOW`), and those are acknowledged at once; a peer that is not our
    /// engine (Linux rxe, an RNIC) is never held. Unanswered, the ACK leaves when the wait
    /// is over (up to `TIMER_GRACE` later when no thread of ours waits), below the 500 µs a
    /// peer of ours waits before probing, and far below Linux's 134 ms local ACK timeout.
    /// Needs `rdma_ext`.
    pub ack_delay: Option<Duration>,
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
    /// The RoCE engine checks the ICRC of every packet, also from a peer that is our engine
    /// (which then computes it); `SMCR_RDMA_ICRC=always` does the same for any device.
    pub rdma_icrc_always: bool,
    /// The RoCE engine's extensions with a peer that is our engine (bundles, no ICRC; see
    /// `rdma::DeviceConfig::ext`); off: plain RoCE v2 to everyone. `SMCR_RDMA_EXT=off`
    /// turns them off for any device.
    pub rdma_ext: bool,
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
            rdma_device: RdmaDevice::Auto,
            same_host_rmb_size: Some(512 * 1024),
            remote_rmb_size: Some(512 * 1024),
            app_hold: Duration::from_millis(1),
            write_pad: true,
            cork: true,
            ack_delay: Some(Duration::from_micros(200)),
            rkey_reuse: true,
            faults: None,
            rdma_icrc_always: false,
            rdma_ext: true,
            alt_addrs: Vec::new(),
        }
    }
}

/// A setting of the environment that does not parse: which variable, its value, what it
/// takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not valid ({expected})")]
pub struct ConfigError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What it takes.
    pub expected: &'static str,
}

/// How an on/off setting may be spelled (one set for every variable).
const FLAG: &str = "on or off (also 1/0, yes/no, true/false)";

pub(crate) fn flag(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "yes" | "true" => Some(true),
        "off" | "0" | "no" | "false" => Some(false),
        _ => None,
    }
}

/// Which RDMA device carries the links of a local address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaDevice {
    /// The verbs device (RNIC, the kernel's rxe or siw) whose active RoCE v2 GID holds the
    /// address, as the kernel's SMC-R picks one; our engine when there is none, or when it
    /// cannot be opened (no libibverbs, no permission on `/dev/infiniband`).
    Auto,
    /// Our engine always (RoCE v2 over UDP; shared memory with peers on this host).
    Engine,
    /// A verbs device always: an address without one runs no SMC-R (TCP, named reason).
    Verbs,
}

impl RuntimeConfig {
    /// Defaults, changed by the environment (how the preload and `smcr run` configure it):
    /// `SMCR_NEGOTIATION=option|assume`, `SMCR_BPF_DIR`, `SMCR_RMB_KIB`, `SMCR_ROCE_PORT`,
    /// `SMCR_UEID` (comma-separated user EIDs), `SMCR_STATS_DIR` (`off`: no stats area),
    /// `SMCR_TESTLINK_TIME` (seconds of link idleness before a TEST LINK, like
    /// `net.smc.smcr_testlink_time`; 0: off), `SMCR_LGR_LINGER` (seconds a link group without
    /// connections is kept before DELETE LINK; default 600 like Linux), and the others of
    /// docs/running.md. A value that does not parse is left out (its default stays) and logged
    /// (`log` facade); [`Self::try_from_env`] refuses it instead.
    pub fn from_env() -> Self {
        match Self::from_lookup(&|k| crate::env::var(k), false) {
            Ok(c) => c,
            Err(_) => unreachable!("lenient parsing does not fail"),
        }
    }

    /// As [`Self::from_env`], but the first value that does not parse is an error naming the
    /// variable (the preload then leaves the process on TCP and says why).
    pub fn try_from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(&|k| crate::env::var(k), true)
    }

    /// The settings from `get` (a variable's value, if set). `strict`: the first bad value is
    /// the error; else bad values are logged and left out.
    pub fn from_lookup(
        get: &dyn Fn(&str) -> Option<String>,
        strict: bool,
    ) -> Result<Self, ConfigError> {
        let mut cfg = Self::new();
        let mut bad: Vec<ConfigError> = Vec::new();
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut err = |var: &'static str, value: String, expected: &'static str| {
            bad.push(ConfigError {
                var,
                value,
                expected,
            });
        };
        macro_rules! num {
            ($k:literal, $t:ty, $expected:literal) => {
                match var($k) {
                    None => None,
                    Some(v) => match v.trim().parse::<$t>() {
                        Ok(x) => Some(x),
                        Err(_) => {
                            err($k, v, $expected);
                            None
                        }
                    },
                }
            };
        }
        macro_rules! on_off {
            ($k:literal) => {
                match var($k) {
                    None => None,
                    Some(v) => match flag(&v) {
                        Some(b) => Some(b),
                        None => {
                            err($k, v, FLAG);
                            None
                        }
                    },
                }
            };
        }
        if let Some(dir) = var("SMCR_BPF_DIR") {
            cfg.negotiation = Negotiation::TcpOption { dir: dir.into() };
        }
        match var("SMCR_RDMA_DEVICE").as_deref().map(str::trim) {
            None | Some("auto") => {}
            Some("engine") => cfg.rdma_device = RdmaDevice::Engine,
            Some("verbs") => cfg.rdma_device = RdmaDevice::Verbs,
            Some(v) => err("SMCR_RDMA_DEVICE", v.into(), "auto, engine or verbs"),
        }
        match var("SMCR_NEGOTIATION").as_deref().map(str::trim) {
            None | Some("option") => {}
            Some("assume") => cfg.negotiation = Negotiation::Assume,
            Some(v) => err("SMCR_NEGOTIATION", v.into(), "option or assume"),
        }
        if let Some(k) = num!("SMCR_RMB_KIB", u32, "KiB, a whole number") {
            cfg.rmb_size = k.saturating_mul(1024);
            cfg.same_host_rmb_size = None;
            cfg.remote_rmb_size = None;
        }
        if let Some(p) = num!("SMCR_ROCE_PORT", u16, "a UDP port, 1-65535") {
            if p == 0 {
                err("SMCR_ROCE_PORT", "0".into(), "a UDP port, 1-65535");
            } else {
                cfg.roce_port = p;
            }
        }
        if let Some(v) = var("SMCR_STEER_ATTACH") {
            match crate::steer::SteerAttach::parse(v.trim()) {
                Some(a) => cfg.steer_attach = a,
                None => err("SMCR_STEER_ATTACH", v, "pinned (on), load or off"),
            }
        }
        if let Some(list) = var("SMCR_UEID") {
            let mut ueids = Vec::new();
            for u in list.split(',').map(str::trim).filter(|u| !u.is_empty()) {
                match Eid::new(u) {
                    Ok(e) => ueids.push(e),
                    Err(_) => err(
                        "SMCR_UEID",
                        list.clone(),
                        "comma-separated UEIDs: 1 to 32 of A-Z, 0-9, . and -",
                    ),
                }
            }
            if !ueids.is_empty() {
                cfg.handshake.ueids = ueids;
            }
        }
        if let Some(b) = on_off!("SMCR_SAME_HOST") {
            cfg.same_host = b;
        }
        if let Some(k) = num!("SMCR_SAME_HOST_RMB_KIB", u32, "KiB, a whole number") {
            cfg.same_host_rmb_size = Some(k.saturating_mul(1024));
        }
        if let Some(k) = num!("SMCR_REMOTE_RMB_KIB", u32, "KiB, a whole number") {
            cfg.remote_rmb_size = Some(k.saturating_mul(1024));
        }
        if let Some(b) = on_off!("SMCR_WRITE_PAD") {
            cfg.write_pad = b;
        }
        if let Some(b) = on_off!("SMCR_CORK") {
            cfg.cork = b;
        }
        if let Some(b) = on_off!("SMCR_RKEY_REUSE") {
            cfg.rkey_reuse = b;
        }
        if let Some(us) = num!("SMCR_HOLD_US", u64, "microseconds, a whole number") {
            cfg.app_hold = Duration::from_micros(us);
        }
        if let Some(us) = num!(
            "SMCR_ACK_DELAY_US",
            u64,
            "microseconds, a whole number, at most 400; 0: off"
        ) {
            if us > 400 {
                err(
                    "SMCR_ACK_DELAY_US",
                    us.to_string(),
                    "microseconds, a whole number, at most 400; 0: off",
                );
            } else {
                cfg.ack_delay = (us > 0).then(|| Duration::from_micros(us));
            }
        }
        if let Some(list) = var("SMCR_ALT_ADDRS") {
            let mut addrs = Vec::new();
            for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                match a.parse() {
                    Ok(ip) => addrs.push(ip),
                    Err(_) => err(
                        "SMCR_ALT_ADDRS",
                        list.clone(),
                        "comma-separated IPv4 addresses",
                    ),
                }
            }
            cfg.alt_addrs = addrs;
        }
        // net.smc.smcr_testlink_time: seconds, 0 = off.
        if let Some(s) = num!("SMCR_TESTLINK_TIME", u64, "seconds, a whole number; 0: off") {
            cfg.test_link_time = (s > 0).then(|| Duration::from_secs(s));
        }
        if let Some(s) = num!("SMCR_LGR_LINGER", u64, "seconds, a whole number") {
            cfg.linger = Duration::from_secs(s);
        }
        if let Some(ms) = num!("SMCR_EXIT_DRAIN_MS", u64, "milliseconds, a whole number") {
            cfg.exit_drain = Duration::from_millis(ms);
        }
        match var("SMCR_STATS_DIR").as_deref() {
            Some("off") => cfg.stats_dir = None,
            Some(d) => cfg.stats_dir = Some(d.into()),
            None => {}
        }
        if strict && !bad.is_empty() {
            return Err(bad.swap_remove(0));
        }
        for e in bad {
            log::warn!("{e}: left at its default");
        }
        Ok(cfg)
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)], strict: bool) -> Result<RuntimeConfig, ConfigError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RuntimeConfig::from_lookup(
            &|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
            strict,
        )
    }

    #[test]
    fn good_values_are_taken() {
        let c = with(
            &[
                ("SMCR_NEGOTIATION", "assume"),
                ("SMCR_RMB_KIB", "128"),
                ("SMCR_ROCE_PORT", "4800"),
                ("SMCR_SAME_HOST", "OFF"),
                ("SMCR_WRITE_PAD", "no"),
                ("SMCR_RKEY_REUSE", "true"),
                ("SMCR_UEID", "SMC-A, SMC-B"),
                ("SMCR_ALT_ADDRS", "10.0.0.2,10.0.0.3"),
                ("SMCR_TESTLINK_TIME", "0"),
                ("SMCR_LGR_LINGER", " 5 "),
                ("SMCR_STEER_ATTACH", "load"),
            ],
            true,
        )
        .unwrap();
        assert!(matches!(c.negotiation, Negotiation::Assume));
        assert_eq!(c.rmb_size, 128 * 1024);
        assert_eq!(c.same_host_rmb_size, None);
        assert_eq!(c.roce_port, 4800);
        assert!(!c.same_host && !c.write_pad && c.rkey_reuse);
        assert_eq!(c.handshake.ueids.len(), 2);
        assert_eq!(c.alt_addrs.len(), 2);
        assert_eq!(c.test_link_time, None);
        assert_eq!(c.linger, Duration::from_secs(5));
        assert_eq!(c.steer_attach, crate::steer::SteerAttach::Load);
    }

    /// Each kind of bad value is refused naming its variable (strict), or left at its
    /// default (lenient, as `from_env`).
    #[test]
    fn each_kind_of_bad_value_is_named() {
        let defaults = RuntimeConfig::new();
        for (k, v) in [
            ("SMCR_RMB_KIB", "64k"),
            ("SMCR_RMB_KIB", "-1"),
            ("SMCR_ROCE_PORT", "70000"),
            ("SMCR_ROCE_PORT", "0"),
            ("SMCR_NEGOTIATION", "maybe"),
            ("SMCR_SAME_HOST", "disabled"),
            ("SMCR_WRITE_PAD", "2"),
            ("SMCR_UEID", "lower-case"),
            ("SMCR_UEID", "THIS-UEID-IS-LONGER-THAN-THIRTY-TWO-BYTES"),
            ("SMCR_ALT_ADDRS", "10.0.0.2,fe80::1"),
            ("SMCR_TESTLINK_TIME", "30s"),
            ("SMCR_LGR_LINGER", "1.5"),
            ("SMCR_EXIT_DRAIN_MS", "x"),
            ("SMCR_HOLD_US", "-5"),
            ("SMCR_ACK_DELAY_US", "401"),
            ("SMCR_STEER_ATTACH", "sometimes"),
        ] {
            let e = with(&[(k, v)], true).unwrap_err();
            assert_eq!(e.var, k, "{k}={v}");
            assert!(
                e.to_string().contains(k) && e.to_string().contains(v),
                "{e}"
            );
            let lenient = with(&[(k, v)], false).unwrap();
            assert_eq!(lenient.rmb_size, defaults.rmb_size, "{k}={v}");
            assert_eq!(lenient.roce_port, defaults.roce_port, "{k}={v}");
            assert_eq!(lenient.linger, defaults.linger, "{k}={v}");
        }
        // The first bad value is the one named; later good ones do not hide it.
        let e = with(&[("SMCR_LGR_LINGER", "soon"), ("SMCR_RMB_KIB", "64")], true).unwrap_err();
        assert_eq!(e.var, "SMCR_LGR_LINGER");
    }

    /// Empty means unset (a shell's `VAR=`), as before.
    #[test]
    fn empty_values_are_unset() {
        let c = with(&[("SMCR_RMB_KIB", ""), ("SMCR_NEGOTIATION", " ")], true).unwrap();
        assert_eq!(c.rmb_size, RuntimeConfig::new().rmb_size);
    }
}
