//! `bench apps`: real programs (redis-benchmark, sockperf, iperf3, and a connect+echo+close
//! loop) side by side in one run, in seven setups: plain TCP on one host; smcr on one host
//! (shared memory), the same with server and client under different users (shared memory);
//! plain TCP across two network namespaces (veth); smcr across them with same-host sharing
//! (shared memory, found through `/run/smcr/rdv`) and without it (`SMCR_SAME_HOST=off`: our
//! RoCE v2 over UDP, the stand-in for two hosts); and smcr fallback (server under the shim,
//! client plain). Prints a table of ratios against
//! the plain TCP of the same topology, writes JSON and an SVG chart. Every smcr run checks the
//! server's stats area: the connections must have been SMC-R (or, for the fallback setup, TCP
//! with PEERNOSMC), otherwise the bench says so and fails. Needs root (namespaces, the TCP
//! option program) and the tools `scripts/setup.sh` installs.

use anyhow::{Context, Result, bail, ensure};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod env;
mod report;
mod workloads;
pub(crate) use env::Bg;
pub use report::*;
pub use workloads::{connect_loop, echo_server, hold, verbs_device};
#[allow(unused_imports)]
use {env::*, workloads::*};

/// Where a run happens and who is under the shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Plain TCP, one host (loopback).
    TcpLocal,
    /// Both ends under the shim, one host.
    SmcrLocal,
    /// Both ends under the shim, one host, the server under another user (`redis`, else
    /// `daemon`).
    SmcrXuser,
    /// Plain TCP across two namespaces.
    TcpNetns,
    /// Both ends under the shim across two namespaces of one host: shared memory.
    SmcrSamehostNs,
    /// Both ends under the shim across two namespaces, same-host sharing off
    /// (`SMCR_SAME_HOST=off`): RoCE v2 over UDP, as between two hosts.
    SmcrRemote,
    /// Server under the shim, client plain, one host: every connection falls back.
    Fallback,
    /// Both ends under the shim on one host, on the address of an RDMA device's RoCE v2 GID
    /// (an RNIC, rxe, siw), forced onto it (`SMCR_RDMA_DEVICE=verbs`, same-host sharing
    /// off): the device carries every byte (an RNIC loops it back in hardware). Run only
    /// where such a device is active.
    SmcrVerbs,
}

impl Setup {
    /// All, in table order.
    pub const ALL: [Self; 8] = [
        Self::TcpLocal,
        Self::SmcrLocal,
        Self::SmcrXuser,
        Self::TcpNetns,
        Self::SmcrSamehostNs,
        Self::SmcrRemote,
        Self::Fallback,
        Self::SmcrVerbs,
    ];

    /// Its name in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::TcpLocal => "tcp-local",
            Self::SmcrLocal => "smcr-local",
            Self::SmcrXuser => "smcr-xuser",
            Self::TcpNetns => "tcp-netns",
            Self::SmcrSamehostNs => "smcr-samehost-ns",
            Self::SmcrRemote => "smcr-remote",
            Self::Fallback => "fallback",
            Self::SmcrVerbs => "smcr-verbs",
        }
    }

    /// The plain-TCP setup it is compared with.
    pub fn baseline(self) -> Option<Self> {
        match self {
            Self::SmcrLocal | Self::SmcrXuser | Self::Fallback | Self::SmcrVerbs => {
                Some(Self::TcpLocal)
            }
            Self::SmcrSamehostNs | Self::SmcrRemote => Some(Self::TcpNetns),
            _ => None,
        }
    }

    fn netns(self) -> bool {
        matches!(
            self,
            Self::TcpNetns | Self::SmcrSamehostNs | Self::SmcrRemote
        )
    }

    /// The transport its links must have used (`smc-stat --links`).
    fn transport(self) -> Option<&'static str> {
        match self {
            Self::SmcrLocal | Self::SmcrXuser | Self::SmcrSamehostNs => Some("shm"),
            Self::SmcrRemote => Some("udp"),
            Self::SmcrVerbs => Some("verbs"),
            _ => None,
        }
    }

    fn shim(self, server: bool) -> bool {
        match self {
            Self::SmcrLocal
            | Self::SmcrXuser
            | Self::SmcrSamehostNs
            | Self::SmcrRemote
            | Self::SmcrVerbs => true,
            Self::Fallback => server,
            _ => false,
        }
    }
}

/// One figure of one workload.
#[derive(Debug, Clone)]
pub struct Metric {
    /// e.g. `redis SET -P 1 (req/s)`.
    pub name: String,
    /// Bigger is better (throughput) or smaller (latency).
    pub higher_is_better: bool,
    /// By setup (missing if that setup was not run or failed to produce it).
    pub values: Vec<(Setup, f64)>,
}

impl Metric {
    fn get(&self, s: Setup) -> Option<f64> {
        self.values.iter().find(|(t, _)| *t == s).map(|v| v.1)
    }

    /// `value / baseline value` for a setup that has a baseline.
    pub fn ratio(&self, s: Setup) -> Option<f64> {
        let b = self.get(s.baseline()?)?;
        let v = self.get(s)?;
        (b > 0.0).then_some(v / b)
    }
}

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Shorter runs.
    pub quick: bool,
    /// Tiny runs that only check every workload works in every setup (the CI test).
    pub smoke: bool,
    /// Only these setups (and their baselines).
    pub only: Vec<Setup>,
    /// Only these workloads (names in [`WORKLOADS`]; all when empty).
    pub workloads: Vec<&'static str>,
    /// The MTU of the veth between the namespaces (`None`: the kernel's 1500). At 9000 the
    /// engine's path MTU is 4096 (4 KiB RoCE packets, as on RoCE networks with jumbo frames).
    pub mtu: Option<u32>,
}

/// The workloads, as `--workloads` names them.
pub const WORKLOADS: [&str; 6] = [
    "redis",
    "sockperf",
    "placement",
    "iperf3",
    "connections",
    "memory",
];

/// Where the ping-pong of the `placement` workload runs (issue 27: our latency must not lean
/// on cross-core wake-ups more than TCP's does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Both programs, all their threads, on CPU 0.
    OneCore,
    /// The server on CPU 0, the client on CPU 1.
    TwoCores,
    /// Unpinned, with a busy loop per CPU beside them (a loaded machine).
    Busy,
}

impl Placement {
    const ALL: [Self; 3] = [Self::OneCore, Self::TwoCores, Self::Busy];

    fn name(self) -> &'static str {
        match self {
            Self::OneCore => "one core",
            Self::TwoCores => "two cores",
            Self::Busy => "busy",
        }
    }

    /// The CPU a side runs on, if pinned: the first of the CPUs this process may use, and for
    /// the client on two cores the second (the first again when there is only one).
    fn cpu(self, server: bool) -> Option<usize> {
        self.cpu_of(server, &allowed_cpus())
    }

    fn cpu_of(self, server: bool, allowed: &[usize]) -> Option<usize> {
        let nth = |i: usize| allowed.get(i).or(allowed.first()).copied();
        match self {
            Self::OneCore => nth(0),
            Self::TwoCores => nth(usize::from(!server)),
            Self::Busy => None,
        }
    }
}

/// The CPUs this process may run on (its affinity mask: a container's cpuset, `taskset`), in
/// order; empty if it cannot be read (then nothing is pinned).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is an empty set; the kernel fills at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0
    {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `i` is below CPU_SETSIZE.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect()
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Busy loops, one per CPU, until dropped: the "busy machine" of [`Placement::Busy`].
struct Hogs {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hogs {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..cpus())
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Both ends on one address, as users run them (the RoCE port is shared: same-host links use
/// shared memory; across namespaces a steering program shares 4791).
const SERVER_ADDR_LOCAL: &str = "127.0.0.1";
/// Every program of every setup runs as this user with `ulimit -n 1024` (soft = hard), as
/// distributions run services (root only prepares: namespaces, BPF programs).
const RUN_AS: &str = "nobody";
/// The server's user in [`Setup::SmcrXuser`] (a service's own user, as Debian runs redis);
/// `daemon` where there is no such user.
const SERVER_AS: [&str; 2] = ["redis", "daemon"];
const NOFILE: u64 = 1024;
const NS_A: &str = "10.78.0.1";
const NS_B: &str = "10.78.0.2";

pub(crate) struct Env {
    lib: PathBuf,
    /// The bench binary, readable by [`RUN_AS`] (the echo server and the connect loop).
    pub(crate) exe: PathBuf,
    /// Who runs the programs (uid, gid); `None`: as we are.
    user: Option<(u32, u32)>,
    /// Who runs the servers of [`Setup::SmcrXuser`].
    server_user: Option<(u32, u32)>,
    bpf: PathBuf,
    pub(crate) stats: PathBuf,
    pub(crate) work: PathBuf,
    ns: Option<(String, String)>,
    next_port: std::cell::Cell<u16>,
    /// The programs started now are pinned so (see [`Placement`]).
    placement: std::cell::Cell<Option<Placement>>,
    /// The engines' counters per workload and setup (see [`Engine`]), and the workload
    /// running now.
    engine: std::cell::RefCell<Vec<Engine>>,
    workload: std::cell::Cell<&'static str>,
    /// The address of the RDMA device [`Setup::SmcrVerbs`] runs on, if this host has one.
    verbs_addr: Option<&'static str>,
}

/// What the RoCE engines of one workload's programs (servers and clients, summed over the
/// repetitions) sent and sent again: retransmissions, early ones (probes) and the probes that
/// turned out needless (the ACK was late, not lost), and local ACK timeouts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Engine {
    pub workload: String,
    pub setup: &'static str,
    pub packets: u64,
    pub resent: u64,
    pub probes: u64,
    pub spurious: u64,
    pub timeouts: u64,
}

impl Engine {
    fn add(&mut self, d: &rdma::DeviceStats) {
        self.packets += d.tx_packets;
        self.resent += d.tx_retransmits;
        self.probes += d.rc_probes;
        self.spurious += d.rc_spurious_probes;
        self.timeouts += d.rc_timeouts;
    }
}

/// Runs everything; returns the metrics.
pub fn run(opt: &Options) -> Result<(Vec<Metric>, Vec<Engine>)> {
    let verbs = verbs_device();
    if opt.only.contains(&Setup::SmcrVerbs) {
        ensure!(
            verbs.is_some(),
            "smcr-verbs: no RDMA device here has an active RoCE v2 GID of an IPv4 address"
        );
    }
    match &verbs {
        Some((name, ip)) => println!("smcr-verbs: RDMA device {name}, address {ip}"),
        None => println!(
            "smcr-verbs: skipped (no RDMA device with an active RoCE v2 GID of an IPv4 address)"
        ),
    }
    let mut setups: Vec<Setup> = if opt.only.is_empty() {
        Setup::ALL
            .into_iter()
            .filter(|&s| s != Setup::SmcrVerbs || verbs.is_some())
            .collect()
    } else {
        let mut v = opt.only.clone();
        v.extend(opt.only.iter().filter_map(|s| s.baseline()));
        Setup::ALL.into_iter().filter(|s| v.contains(s)).collect()
    };
    setups.dedup();
    check_tools(setups.iter().any(|s| s.netns()))?;
    let env = Env::new(setups.iter().any(|s| s.netns()), opt.mtu)?;
    // Enough requests that redis-benchmark's 50 clients have all finished their handshakes
    // before a test ends: a client that exits while one of its connections is still
    // negotiating leaves that connection declined (ERR_REGBUF) on the server, which the
    // check below (rightly) counts as not SMC-R.
    // `-P 16` moves 16 requests per round trip: 20 times the requests make its runs last
    // about as long as `-P 1`'s (2–3 s in full runs), so that a run measures the steady state
    // rather than a few hundred milliseconds of the machine's weather.
    let (n, n16, secs) = if opt.smoke {
        (10_000, 40_000, 1)
    } else if opt.quick {
        (20_000, 80_000, 2)
    } else {
        (200_000, 4_000_000, 5)
    };
    // Workloads outermost, setups interleaved within each repetition: a slow spell of the
    // machine then hits every setup of a figure alike; the median of the repetitions is kept.
    let reps = if opt.smoke || opt.quick { 1 } else { 3 };
    let mut samples: Vec<(String, bool, Setup, Vec<f64>)> = Vec::new();
    let mut put = |name: String, higher: bool, s: Setup, v: f64| match samples
        .iter_mut()
        .find(|m| m.0 == name && m.2 == s)
    {
        Some(m) => m.3.push(v),
        None => samples.push((name, higher, s, vec![v])),
    };
    type Run<'a> = Box<dyn Fn(&Env, Setup) -> Result<Vec<(String, bool, f64)>> + 'a>;
    let mut workloads: Vec<(&str, Run<'_>)> = Vec::new();
    for (p, d) in [(1u32, 3u32), (16, 3), (1, 1024)] {
        let tag = if d == 3 {
            format!("-P {p}")
        } else {
            format!("-d {d}")
        };
        let count = if p == 16 { n16 } else { n };
        workloads.push((
            "redis",
            Box::new(move |env: &Env, s: Setup| {
                let (set, get, cpu) = redis(env, s, p, d, count)
                    .with_context(|| format!("redis {tag} ({})", s.name()))?;
                eprintln!(
                    "  {}: redis {tag}: SET {set:.0} GET {get:.0} req/s, CPU {cpu:.2} us/req",
                    s.name()
                );
                Ok(vec![
                    (format!("redis SET {tag} (req/s)"), true, set),
                    (format!("redis GET {tag} (req/s)"), true, get),
                    (format!("redis CPU {tag} (us/req)"), false, cpu),
                ])
            }),
        ));
    }
    for size in [64u32, 1024] {
        workloads.push((
            "sockperf",
            Box::new(move |env: &Env, s: Setup| {
                let (p50, p99) = sockperf(env, s, size, secs)
                    .with_context(|| format!("sockperf {size} B ({})", s.name()))?;
                eprintln!(
                    "  {}: sockperf pp {size} B: p50 {p50:.2} p99 {p99:.2} us",
                    s.name()
                );
                Ok(vec![
                    (format!("sockperf pp {size} B p50 (us)"), false, p50),
                    (format!("sockperf pp {size} B p99 (us)"), false, p99),
                ])
            }),
        ));
    }
    workloads.push((
        "placement",
        Box::new(move |env: &Env, s: Setup| {
            let mut v = Vec::new();
            for p in Placement::ALL {
                env.placement.set(Some(p));
                let _hogs = (p == Placement::Busy).then(Hogs::start);
                let r = sockperf(env, s, 64, secs);
                env.placement.set(None);
                let (p50, p99) =
                    r.with_context(|| format!("sockperf 64 B, {} ({})", p.name(), s.name()))?;
                eprintln!(
                    "  {}: sockperf pp 64 B, {}: p50 {p50:.2} p99 {p99:.2} us",
                    s.name(),
                    p.name()
                );
                v.push((
                    format!("sockperf pp 64 B {} p50 (us)", p.name()),
                    false,
                    p50,
                ));
                v.push((
                    format!("sockperf pp 64 B {} p99 (us)", p.name()),
                    false,
                    p99,
                ));
            }
            Ok(v)
        }),
    ));
    workloads.push((
        "iperf3",
        Box::new(move |env: &Env, s: Setup| {
            let (g, cpu) =
                iperf3(env, s, secs).with_context(|| format!("iperf3 ({})", s.name()))?;
            eprintln!("  {}: iperf3: {g:.2} Gbit/s, CPU {cpu:.3} s/GB", s.name());
            Ok(vec![
                ("iperf3 (Gbit/s)".into(), true, g),
                ("iperf3 CPU (s/GB)".into(), false, cpu),
            ])
        }),
    ));
    workloads.push((
        "connections",
        Box::new(move |env: &Env, s: Setup| {
            let c = conn_rate(env, s, secs)
                .with_context(|| format!("connect+echo+close ({})", s.name()))?;
            eprintln!("  {}: connect+echo+close: {c:.0}/s", s.name());
            Ok(vec![("connect+echo+close (conn/s)".into(), true, c)])
        }),
    ));
    let idle = Duration::from_secs(if opt.smoke { 1 } else { 10 });
    workloads.push((
        "memory",
        Box::new(move |env: &Env, s: Setup| {
            let v = memory_and_idle(env, s, 100, idle)
                .with_context(|| format!("memory and idle ({})", s.name()))?;
            for (name, _, x) in &v {
                eprintln!("  {}: {name}: {x:.1}", s.name());
            }
            Ok(v)
        }),
    ));
    workloads.retain(|(w, _)| opt.workloads.is_empty() || opt.workloads.contains(w));
    for (what, w) in &workloads {
        // Memory and idle CPU are not noisy the same way, and each run idles for a while.
        let reps = if *what == "memory" { 1 } else { reps };
        for rep in 0..reps {
            eprintln!("== {what} ({}/{reps})", rep + 1);
            env.workload.set(what);
            for &s in &setups {
                for (name, higher, v) in w(&env, s)? {
                    put(name, higher, s, v);
                }
            }
        }
    }
    let mut metrics: Vec<Metric> = Vec::new();
    for (name, higher, s, mut v) in samples {
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        match metrics.iter_mut().find(|m| m.name == name) {
            Some(m) => m.values.push((s, median)),
            None => metrics.push(Metric {
                name,
                higher_is_better: higher,
                values: vec![(s, median)],
            }),
        }
    }
    let engine = env.engine.take();
    Ok((metrics, engine))
}

#[cfg(test)]
mod json_tests {
    use super::*;

    #[test]
    fn listening_sockets_are_found_in_the_kernels_table() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F91 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1
";
        assert!(listens(t, 8080));
        assert!(!listens(t, 8081), "established, not listening");
        assert!(!listens(t, 80));
    }

    #[test]
    fn placement_pins_to_the_cpus_this_process_may_use() {
        // A cpuset of CPUs 2 and 5 (a container): never CPU 0 or 1.
        let set = [2, 5];
        assert_eq!(Placement::OneCore.cpu_of(true, &set), Some(2));
        assert_eq!(Placement::OneCore.cpu_of(false, &set), Some(2));
        assert_eq!(Placement::TwoCores.cpu_of(true, &set), Some(2));
        assert_eq!(Placement::TwoCores.cpu_of(false, &set), Some(5));
        assert_eq!(Placement::Busy.cpu_of(false, &set), None);
        // One CPU: both sides on it; none readable: nothing pinned.
        assert_eq!(Placement::TwoCores.cpu_of(false, &[3]), Some(3));
        assert_eq!(Placement::OneCore.cpu_of(true, &[]), None);
        // This process's own mask has the CPU it runs on.
        let mine = allowed_cpus();
        // SAFETY: sched_getcpu has no preconditions.
        let now = unsafe { libc::sched_getcpu() };
        assert!(mine.contains(&(now as usize)), "{now} not in {mine:?}");
    }

    #[test]
    fn not_a_number_is_null_and_the_document_parses() {
        let m = Metric {
            name: "x \"quoted\" (req/s)".into(),
            higher_is_better: true,
            values: vec![(Setup::ALL[0], 100.0), (Setup::ALL[1], f64::NAN)],
        };
        let text = json(&[m], &[]);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let metric = &v["metrics"][0];
        assert_eq!(metric["name"], "x \"quoted\" (req/s)");
        assert_eq!(metric["values"][Setup::ALL[0].name()], 100.0);
        assert!(metric["values"][Setup::ALL[1].name()].is_null());
        assert!(!text.contains("NaN"));
    }
}
