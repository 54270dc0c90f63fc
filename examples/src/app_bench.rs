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

impl Env {
    /// Removes what an interrupted earlier run left behind: its namespaces and option-program
    /// pins (named after a pid that no longer exists).
    fn clean_leftovers() {
        let dead = |name: &str| {
            name.strip_prefix("smcr-bench-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists())
        };
        for e in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = Command::new("ip").args(["netns", "del", &n]).status();
            }
        }
        for e in std::fs::read_dir("/sys/fs/bpf")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = smcr::option::uninstall(&e.path());
            }
        }
    }

    pub(crate) fn new(need_ns: bool, mtu: Option<u32>) -> Result<Self> {
        Self::clean_leftovers();
        let exe = std::env::current_exe()?;
        let built = exe.parent().context("exe dir")?.join("libsmcr_preload.so");
        ensure!(
            built.exists(),
            "{} missing: build with `cargo build --release -p preload -p examples`",
            built.display()
        );
        let pid = std::process::id();
        let work = std::env::temp_dir().join(format!("smcr-bench-{pid}"));
        std::fs::create_dir_all(&work)?;
        // The programs run as RUN_AS: the library, the bench binary and the stats directory
        // must be theirs to read (a checkout may live in a 0700 home).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o755))?;
        let lib = work.join("libsmcr_preload.so");
        std::fs::copy(&built, &lib)?;
        let bench = work.join("bench");
        std::fs::copy(&exe, &bench)?;
        for f in [&lib, &bench] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755))?;
        }
        let stats = work.join("stats");
        std::fs::create_dir_all(&stats)?;
        std::fs::set_permissions(&stats, std::fs::Permissions::from_mode(0o1777))?;
        let user = user_ids(RUN_AS);
        let server_user = SERVER_AS.iter().find_map(|n| user_ids(n));
        let bpf = PathBuf::from(format!("/sys/fs/bpf/smcr-bench-{pid}"));
        smcr::option::install(&bpf)
            .map_err(|e| anyhow::anyhow!("installing the TCP option program (root?): {e}"))?;
        let mut env = Self {
            lib,
            exe: bench,
            user,
            server_user,
            bpf,
            stats,
            work,
            ns: None,
            next_port: std::cell::Cell::new(10000 + (pid % 100) as u16 * 200),
            placement: std::cell::Cell::new(None),
            engine: std::cell::RefCell::new(Vec::new()),
            workload: std::cell::Cell::new(""),
            verbs_addr: verbs_device().map(|(_, ip)| &*Box::leak(ip.to_string().into_boxed_str())),
        };
        if need_ns {
            let (a, b) = (format!("smcr-bench-{pid}-a"), format!("smcr-bench-{pid}-b"));
            let (va, vb) = (format!("sb{pid}a"), format!("sb{pid}b"));
            let ip = |args: &[&str]| -> Result<()> {
                let st = Command::new("ip").args(args).status()?;
                ensure!(st.success(), "ip {args:?} failed");
                Ok(())
            };
            ip(&["netns", "add", &a])?;
            ip(&["netns", "add", &b])?;
            env.ns = Some((a.clone(), b.clone()));
            ip(&[
                "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
            ])?;
            for (ns, dev, addr) in [(&a, &va, NS_A), (&b, &vb, NS_B)] {
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
                if let Some(m) = mtu {
                    ip(&["-n", ns, "link", "set", dev, "mtu", &m.to_string()])?;
                }
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                // What an administrator does for a namespace it makes (`smcr bpf install
                // --netns`): every process there shares RoCE port 4791 whatever its user.
                attach_steering(ns, &env.bpf)?;
            }
        }
        Ok(env)
    }

    /// A TCP port for the next server: below the kernel's ephemeral range (32768–60999 by
    /// default), and skipping one any socket of this host uses now (a client's local port,
    /// a connection in TIME_WAIT): a server that cannot bind would abort the run.
    pub(crate) fn port(&self) -> u16 {
        loop {
            let p = self.next_port.get();
            self.next_port.set(if p >= 32767 { 10000 } else { p + 1 });
            if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
                return p;
            }
        }
    }

    /// The namespace and veth device of the server's (b) or the client's (a) side.
    pub(crate) fn veth(&self, server: bool) -> Option<(&str, String)> {
        let (a, b) = self.ns.as_ref()?;
        let pid = std::process::id();
        Some(if server {
            (b, format!("sb{pid}b"))
        } else {
            (a, format!("sb{pid}a"))
        })
    }

    pub(crate) fn server_addr(&self, s: Setup) -> &'static str {
        match s {
            Setup::SmcrVerbs => self.verbs_addr.unwrap_or(SERVER_ADDR_LOCAL),
            s if s.netns() => NS_B,
            _ => SERVER_ADDR_LOCAL,
        }
    }

    /// `prog` for one side of a setup: in its namespace, under the shim if that side is.
    pub(crate) fn cmd(&self, s: Setup, server: bool, prog: &str) -> Command {
        let mut c = match (&self.ns, s.netns()) {
            (Some((a, b)), true) => {
                // nsenter --net, not `ip netns exec`: that one also gives the program a
                // mount namespace with a fresh /sys, where the option program's pins
                // (/sys/fs/bpf) are not visible.
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", if server { b } else { a }));
                // nsenter needs root to enter; it becomes the user once inside.
                if let Some((uid, gid)) = self.user_of(s, server) {
                    c.args(["-S", &uid.to_string(), "-G", &gid.to_string()]);
                }
                c.arg(prog);
                c
            }
            _ => Command::new(prog),
        };
        // Die with the bench, even when it is killed (no Drop then): a leftover shimmed server
        // would keep its address's RoCE port and fail the next run (NOSMCRDEV).
        // SAFETY: prctl is async-signal-safe; no allocation between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        if s.shim(server) {
            c.env("LD_PRELOAD", &self.lib)
                .env("SMCR_BPF_DIR", &self.bpf)
                .env("SMCR_STATS_DIR", &self.stats);
            if s == Setup::SmcrRemote {
                c.env("SMCR_SAME_HOST", "off");
            }
            if s == Setup::SmcrVerbs {
                c.env("SMCR_SAME_HOST", "off")
                    .env("SMCR_RDMA_DEVICE", "verbs");
            }
        }
        // As a distribution runs a service: its own user, `ulimit -n 1024` (every setup, so
        // the ratios compare like with like). In a namespace nsenter changes the user itself,
        // once it has entered (as root).
        let user = self
            .user_of(s, server)
            .filter(|_| !(s.netns() && self.ns.is_some()));
        // Pinned before exec: the program and every thread it (and the shim) makes later.
        let cpu = self.placement.get().and_then(|p| p.cpu(server));
        // An RDMA device pins every buffer: its programs get what RDMA users configure
        // (`ulimit -l unlimited`, LimitMEMLOCK=infinity), or connections beyond the limit
        // would stay TCP.
        let memlock = s == Setup::SmcrVerbs;
        // SAFETY: only async-signal-safe system calls between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: NOFILE,
                    rlim_max: NOFILE,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let unlimited = libc::rlimit {
                    rlim_cur: libc::RLIM_INFINITY,
                    rlim_max: libc::RLIM_INFINITY,
                };
                if memlock && libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(cpu) = cpu {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((uid, gid)) = user
                    && (libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }

    /// Who runs one side of a setup.
    fn user_of(&self, s: Setup, server: bool) -> Option<(u32, u32)> {
        if s == Setup::SmcrXuser && server {
            self.server_user
        } else {
            self.user
        }
    }

    pub(crate) fn wait_listening(&self, s: Setup, port: u16) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let listening = match (&self.ns, s.netns()) {
                (Some((_, b)), true) => {
                    let out = Command::new("ip")
                        .args(["netns", "exec", b, "ss"])
                        .args(["-ltnH", &format!("( sport = :{port} )")])
                        .output()?;
                    String::from_utf8_lossy(&out.stdout).contains(&format!(":{port}"))
                }
                // Our own namespace: the kernel's tables (no `ss` needed, e.g. in a guest).
                _ => ["/proc/net/tcp", "/proc/net/tcp6"]
                    .iter()
                    .filter_map(|f| std::fs::read_to_string(f).ok())
                    .any(|t| listens(&t, port)),
            };
            if listening {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "nothing listens on port {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the server of a workload on a fresh port (under the shim if the setup says so)
    /// and waits until it listens; `args` makes its arguments from the address and port.
    fn serve(
        &self,
        s: Setup,
        prog: &str,
        args: impl FnOnce(&str, &str) -> Vec<String>,
    ) -> Result<(Bg, &'static str, u16)> {
        let port = self.port();
        let addr = self.server_addr(s);
        let server = Bg(self
            .cmd(s, true, prog)
            .args(args(addr, &port.to_string()))
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {prog}"))?);
        self.wait_listening(s, port)?;
        Ok((server, addr, port))
    }

    /// Adds the device counters of every stats area (the programs of this run, the exited
    /// clients' too: read before [`smcr::view::Snapshot::collect`] removes those) to the
    /// workload's [`Engine`] row.
    fn count_engines(&self, s: Setup) {
        let mut rows = self.engine.borrow_mut();
        let what = self.workload.get();
        let i = match rows
            .iter()
            .position(|r| r.workload == what && r.setup == s.name())
        {
            Some(i) => i,
            None => {
                rows.push(Engine {
                    workload: what.to_string(),
                    setup: s.name(),
                    ..Engine::default()
                });
                rows.len() - 1
            }
        };
        let row = &mut rows[i];
        for e in std::fs::read_dir(&self.stats)
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "stats") {
                continue;
            }
            let Ok(a) = smcr::stats::Area::open(&p) else {
                continue;
            };
            for slot in 0..smcr::stats::DEV_SLOTS {
                if let Some(d) = a.read_dev(slot) {
                    row.add(&d.stats);
                }
            }
        }
    }

    /// The server's stats say its connections were SMC-R (or TCP with PEERNOSMC for the
    /// fallback setup): at least `min` of them, none of the other kind.
    fn check(&self, s: Setup, server: &Child, min: u64, what: &str) -> Result<()> {
        if !s.shim(true) {
            return Ok(());
        }
        self.count_engines(s);
        let snap = smcr::view::Snapshot::collect(&self.stats, Some(server.id()));
        let p = snap
            .procs
            .first()
            .with_context(|| format!("{what} ({}): the server has no stats area", s.name()))?;
        let (smcr, tcp) = (
            p.totals[smcr::stats::total::SMCR],
            p.totals[smcr::stats::total::TCP],
        );
        if s == Setup::Fallback {
            let peernosmc = p
                .fallbacks
                .iter()
                .find(|(c, _)| *c == 0x0301_0000)
                .map_or(0, |f| f.1);
            ensure!(
                smcr == 0 && peernosmc >= min,
                "{what} (fallback): expected ≥{min} PEERNOSMC fallbacks and no SMC-R, stats say {smcr} SMC-R, {tcp} TCP {:?}",
                p.fallbacks
            );
        } else {
            ensure!(
                smcr >= min && tcp == 0,
                "{what} ({}): NOT over SMC-R — stats say {smcr} SMC-R and {tcp} TCP connections (fallbacks {:?})",
                s.name(),
                p.fallbacks
            );
        }
        // The links still there moved their data as the setup says (shared memory on one
        // host, whatever the users and namespaces; UDP where sharing is off).
        if let Some(want) = s.transport() {
            for l in &p.links {
                ensure!(
                    l.transport == want,
                    "{what} ({}): a link over {} where {want} was expected",
                    s.name(),
                    l.transport
                );
            }
        }
        Ok(())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some((a, b)) = &self.ns {
            for ns in [a, b] {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
        }
        let _ = smcr::steer::uninstall(&self.bpf);
        let _ = smcr::option::uninstall(&self.bpf);
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// The uid and gid of `name`, if that user exists.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: getpwnam with a valid name; the result is read at once (no other thread of
    // ours looks users up).
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    // SAFETY: a non-null result points to a valid passwd.
    (!pw.is_null()).then(|| unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// Attaches the steering program (pinned under `bpf`) in network namespace `ns`.
fn attach_steering(ns: &str, bpf: &Path) -> Result<()> {
    let (path, bpf) = (format!("/run/netns/{ns}"), bpf.to_path_buf());
    std::thread::spawn(move || -> Result<()> {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(&path)?;
        // SAFETY: entering a network namespace on this short-lived thread only.
        ensure!(
            unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
            "setns {path}: {}",
            std::io::Error::last_os_error()
        );
        smcr::steer::install(&bpf).map_err(|e| anyhow::anyhow!("steering in {path}: {e}"))?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the steering thread panicked"))?
}

/// A background process, killed on drop.
pub(crate) struct Bg(pub(crate) Child);

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn output(c: &mut Command, what: &str) -> Result<String> {
    let out = c
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "{what} failed: {text}");
    Ok(text)
}

/// The machine's busy CPU time so far, in seconds: user, nice, system, irq and softirq of
/// `/proc/stat` — both programs and the kernel's work for them (packets, wake-ups), which a
/// process's own times miss; nothing else runs during a bench. 10 ms resolution.
fn busy_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<f64> = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    [0, 1, 2, 5, 6]
        .iter()
        .filter_map(|&i| v.get(i))
        .sum::<f64>()
        / hz
}

/// redis-benchmark SET and GET requests/s, and the CPU time of both ends per request (µs).
fn redis(env: &Env, s: Setup, pipeline: u32, size: u32, n: u32) -> Result<(f64, f64, f64)> {
    let work = env.work.to_string_lossy().into_owned();
    let (server, addr, port) = env.serve(s, "redis-server", |addr, port| {
        [
            "--bind",
            addr,
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            &work,
        ]
        .map(String::from)
        .to_vec()
    })?;
    let busy = busy_secs();
    let out = output(
        env.cmd(s, false, "redis-benchmark")
            .args(["-h", addr, "-p", &port.to_string(), "-q"])
            .args(["-t", "set,get", "-c", "50"])
            .args(["-n", &n.to_string(), "-P", &pipeline.to_string()])
            .args(["-d", &size.to_string()]),
        "redis-benchmark",
    )?;
    // SET and GET: 2n requests.
    let cpu = (busy_secs() - busy) * 1e6 / (2.0 * f64::from(n));
    let rate = |test: &str| -> Result<f64> {
        // With -q, each finished test prints "SET: 12345.67 requests per second, p50=…" (after
        // progress lines ending in \r).
        out.split(['\r', '\n'])
            .filter_map(|l| l.trim().strip_prefix(&format!("{test}: ")))
            .find_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .filter(|_| out.contains("requests per second"))
            .with_context(|| format!("no {test} rate in: {out}"))
    };
    let r = (rate("SET")?, rate("GET")?, cpu);
    env.check(s, &server.0, 50, "redis")?;
    Ok(r)
}

/// sockperf ping-pong p50 and p99 (µs, sockperf's one-way figures).
fn sockperf(env: &Env, s: Setup, size: u32, secs: u32) -> Result<(f64, f64)> {
    let (server, addr, port) = env.serve(s, "sockperf", |addr, port| {
        ["sr", "--tcp", "-i", addr, "-p", port]
            .map(String::from)
            .to_vec()
    })?;
    let out = output(
        env.cmd(s, false, "sockperf").args([
            "pp",
            "--tcp",
            "-i",
            addr,
            "-p",
            &port.to_string(),
            "-m",
            &size.to_string(),
            "-t",
            &secs.to_string(),
        ]),
        "sockperf pp",
    )?;
    let pct = |p: &str| -> Result<f64> {
        out.lines()
            .find_map(|l| {
                l.split(&format!("percentile {p} ="))
                    .nth(1)?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .with_context(|| format!("no percentile {p} in: {out}"))
    };
    let r = (pct("50.000")?, pct("99.000")?);
    env.check(s, &server.0, 1, "sockperf")?;
    Ok(r)
}

/// iperf3's goodput (Gbit/s) and the CPU time of both ends per GB received (s).
fn iperf3(env: &Env, s: Setup, secs: u32) -> Result<(f64, f64)> {
    let (server, addr, port) = env.serve(s, "iperf3", |addr, port| {
        ["-s", "-1", "-B", addr, "-p", port]
            .map(String::from)
            .to_vec()
    })?;
    let busy = busy_secs();
    let out = output(
        env.cmd(s, false, "iperf3").args([
            "-c",
            addr,
            "-p",
            &port.to_string(),
            "-t",
            &secs.to_string(),
            "-J",
        ]),
        "iperf3 client",
    )?;
    // "sum_received": { ... "bits_per_second": X ... }
    let at = out
        .find("\"sum_received\"")
        .with_context(|| format!("no sum_received in: {out}"))?;
    let bps = out[at..]
        .split("\"bits_per_second\":")
        .nth(1)
        .and_then(|r| r.split([',', '\n', '}']).next())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .context("no bits_per_second")?;
    let cpu = busy_secs() - busy;
    env.check(s, &server.0, 1, "iperf3")?;
    let gb = bps * f64::from(secs) / 8.0 / 1e9;
    Ok((bps / 1e9, if gb > 0.0 { cpu / gb } else { f64::NAN }))
}

/// Connections per second: connect, echo 32 bytes, close, in a loop for `secs`.
fn conn_rate(env: &Env, s: Setup, secs: u32) -> Result<f64> {
    let exe = env.exe.to_str().context("exe path")?;
    let (server, addr, port) = env.serve(s, exe, |addr, port| {
        vec![
            "--role".into(),
            "echo-server".into(),
            format!("{addr}:{port}"),
        ]
    })?;
    let out = output(
        env.cmd(s, false, exe).args([
            "--role",
            "connect-loop",
            &format!("{addr}:{port}"),
            &secs.to_string(),
        ]),
        "connect loop",
    )?;
    let rate = out
        .lines()
        .find_map(|l| l.strip_prefix("conns/s ")?.trim().parse::<f64>().ok())
        .with_context(|| format!("no rate in: {out}"))?;
    env.check(s, &server.0, 10, "connect+echo+close")?;
    Ok(rate)
}

/// The echo server of the connection-rate test (one thread per connection).
pub fn echo_server(addr: &str) -> Result<()> {
    let l = std::net::TcpListener::bind(addr)?;
    for c in l.incoming() {
        let Ok(mut c) = c else { continue };
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut b = [0u8; 64];
            while let Ok(n) = c.read(&mut b) {
                if n == 0 || c.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
    }
    Ok(())
}

/// The client of the memory and idle test: one connection (echoed once), `one` on stdout; at
/// a line on stdin `n` more, `all`; then holds them until stdin closes.
pub fn hold(addr: &str, n: usize) -> Result<()> {
    use std::io::{BufRead, Read, Write};
    let open = || -> Result<std::net::TcpStream> {
        let mut c = std::net::TcpStream::connect(addr)?;
        c.write_all(&[1u8; 16])?;
        c.read_exact(&mut [0u8; 16])?;
        Ok(c)
    };
    let mut held = vec![open()?];
    println!("one");
    let stdin = std::io::stdin();
    let mut line = String::new();
    stdin.lock().read_line(&mut line)?;
    for _ in 0..n {
        held.push(open()?);
    }
    println!("all");
    line.clear();
    stdin.lock().read_line(&mut line)?;
    drop(held);
    Ok(())
}

/// Resident memory of a process, KiB.
fn rss_kib(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .context("no VmRSS")
}

/// CPU time each thread of a process used so far, ns, by thread id (the scheduler's own
/// account in `schedstat`: exact, where `stat`'s user and system times move in 10 ms ticks
/// charged to whoever runs when the tick comes).
fn cpu_ns(pid: u32) -> Result<std::collections::HashMap<u32, u64>> {
    let mut out = std::collections::HashMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let e = e?;
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        // A thread that ended since the listing has no file any more: it used nothing after.
        let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) else {
            continue;
        };
        let ns = s.split_whitespace().next().and_then(|v| v.parse().ok());
        out.insert(tid, ns.context("schedstat")?);
    }
    Ok(out)
}

/// CPU ms a process's threads used between two [`cpu_ns`] readings (threads that ended
/// between them are not counted: what they ran in the window is lost, a few system calls).
fn cpu_ms_between(
    before: &std::collections::HashMap<u32, u64>,
    after: &std::collections::HashMap<u32, u64>,
) -> f64 {
    let ns: u64 = after
        .iter()
        .map(|(tid, &a)| a.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    ns as f64 / 1e6
}

/// Memory per connection and for the first connection (link group, device, engine), on the
/// server and the client, and the CPU both use over `idle` with `n + 1` idle connections.
fn memory_and_idle(
    env: &Env,
    s: Setup,
    n: usize,
    idle: Duration,
) -> Result<Vec<(String, bool, f64)>> {
    use std::io::{BufRead, BufReader, Write};
    let exe = env.exe.to_str().context("exe path")?;
    let (server, addr, port) = env.serve(s, exe, |addr, port| {
        vec![
            "--role".into(),
            "echo-server".into(),
            format!("{addr}:{port}"),
        ]
    })?;
    let spid = server.0.id();
    let r0 = rss_kib(spid)?;
    let mut client = Bg(env
        .cmd(s, false, exe)
        .args(["--role", "hold", &format!("{addr}:{port}"), &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("hold client")?);
    let cpid = client.0.id();
    let mut lines = BufReader::new(client.0.stdout.take().context("stdout")?).lines();
    let mut input = client.0.stdin.take().context("stdin")?;
    let expect = |lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
                  what: &str|
     -> Result<()> {
        match lines.next() {
            Some(Ok(l)) if l == what => Ok(()),
            other => bail!("hold client: expected {what}, got {other:?}"),
        }
    };
    expect(&mut lines, "one")?;
    let (s1, c1) = (rss_kib(spid)?, rss_kib(cpid)?);
    writeln!(input, "more")?;
    expect(&mut lines, "all")?;
    let (s2, c2) = (rss_kib(spid)?, rss_kib(cpid)?);
    let (sc, cc) = (cpu_ns(spid)?, cpu_ns(cpid)?);
    std::thread::sleep(idle);
    let idle_ms = cpu_ms_between(&sc, &cpu_ns(spid)?) + cpu_ms_between(&cc, &cpu_ns(cpid)?);
    env.check(s, &server.0, n as u64, "memory and idle")?;
    drop(input);
    let secs = idle.as_secs_f64();
    Ok(vec![
        ("server RSS, first connection (KiB)".into(), false, s1 - r0),
        (
            "server RSS per further connection (KiB)".into(),
            false,
            (s2 - s1) / n as f64,
        ),
        (
            "client RSS per further connection (KiB)".into(),
            false,
            (c2 - c1) / n as f64,
        ),
        (
            format!("idle CPU, {} conns, both (ms per {secs:.0} s)", n + 1),
            false,
            idle_ms,
        ),
    ])
}

/// The client of the connection-rate test: prints `conns/s R`.
pub fn connect_loop(addr: &str, secs: u64) -> Result<()> {
    use std::io::{Read, Write};
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < Duration::from_secs(secs) {
        let mut c = std::net::TcpStream::connect(addr)?;
        c.write_all(&[7u8; 32])?;
        let mut b = [0u8; 32];
        c.read_exact(&mut b)?;
        drop(c);
        n += 1;
    }
    println!("conns/s {:.1}", n as f64 / t.elapsed().as_secs_f64());
    Ok(())
}

/// Whether a `/proc/net/tcp` table has a socket in LISTEN (state 0A) on `port`.
fn listens(table: &str, port: u16) -> bool {
    let want = format!(":{port:04X}");
    table.lines().skip(1).any(|l| {
        let mut f = l.split_whitespace();
        let local = f.nth(1).unwrap_or("");
        let state = f.nth(1).unwrap_or("");
        state == "0A" && local.ends_with(&want)
    })
}

/// The first active RDMA device port with a RoCE v2 GID of an IPv4 address (not loopback):
/// its name and that address.
pub fn verbs_device() -> Option<(String, std::net::Ipv4Addr)> {
    use rdma::ibv::sysfs;
    sysfs::scan(Path::new(sysfs::SYSFS_ROOT))
        .into_iter()
        .filter(|p| p.is_active() && p.link_layer == "Ethernet")
        .find_map(|p| {
            p.gids.iter().find_map(|g| {
                let ip = g.ipv4().filter(|ip| !ip.is_loopback())?;
                (g.kind == sysfs::GidKind::RoceV2).then(|| (p.device.clone(), ip))
            })
        })
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
    let (n, secs) = if opt.smoke {
        (10_000, 1)
    } else if opt.quick {
        (20_000, 2)
    } else {
        (200_000, 5)
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
        let count = if p == 16 { n * 4 } else { n };
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

/// The engines' counters per workload and setup ([`Engine`]).
pub fn engine_table(rows: &[Engine]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<12} {:<12} {:>12} {:>9} {:>8} {:>9} {:>9}",
        "engine", "setup", "packets out", "resent", "probes", "spurious", "timeouts"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:<12} {:<12} {:>12} {:>9} {:>8} {:>9} {:>9}",
            r.workload, r.setup, r.packets, r.resent, r.probes, r.spurious, r.timeouts
        );
    }
    o.push_str(
        "engine: RoCE packets the shimmed programs' engines sent and sent again (probes: early \
         retransmissions; spurious: probes whose ACK was late, not lost), all repetitions\n",
    );
    o
}

/// The table: values per setup, and each smcr setup's ratio to its TCP baseline.
pub fn table(metrics: &[Metric]) -> String {
    let mut o = String::new();
    let cols: Vec<Setup> = Setup::ALL
        .into_iter()
        .filter(|s| metrics.iter().any(|m| m.get(*s).is_some()))
        .collect();
    let _ = write!(o, "{:<42}", "metric");
    for s in &cols {
        let _ = write!(o, " {:>16}", s.name());
        if s.baseline().is_some() {
            let _ = write!(o, " {:>7}", "ratio");
        }
    }
    o.push('\n');
    for m in metrics {
        let _ = write!(o, "{:<42}", m.name);
        for s in &cols {
            match m.get(*s) {
                Some(v) if v >= 1000.0 => {
                    let _ = write!(o, " {v:>16.0}");
                }
                Some(v) => {
                    let _ = write!(o, " {v:>16.2}");
                }
                None => {
                    let _ = write!(o, " {:>16}", "-");
                }
            }
            if s.baseline().is_some() {
                match m.ratio(*s) {
                    Some(r) => {
                        let _ = write!(o, " {:>6.2}x", r);
                    }
                    None => {
                        let _ = write!(o, " {:>7}", "-");
                    }
                }
            }
        }
        o.push('\n');
    }
    o.push_str(
        "ratio: the setup's value / plain TCP's in the same topology (latency: lower is better)\n",
    );
    o
}

/// JSON: `{"setups": [...], "metrics": [{name, higher_is_better, values{setup: v}, ratios{setup: r}}]}`.
/// A value that is not a number (a run that measured nothing) is `null`: NaN is not JSON.
pub fn json(metrics: &[Metric], engine: &[Engine]) -> String {
    use serde_json::{Map, Value, json};
    let num = |v: f64| json_num(v, 15);
    let items: Vec<Value> = metrics
        .iter()
        .map(|m| {
            let values: Map<String, Value> = m
                .values
                .iter()
                .map(|(s, v)| (s.name().to_string(), num(*v)))
                .collect();
            let ratios: Map<String, Value> = Setup::ALL
                .iter()
                .filter_map(|s| {
                    let r = m.ratio(*s)?;
                    Some((s.name().to_string(), json_num(r, 4)))
                })
                .collect();
            json!({
                "name": m.name,
                "higher_is_better": m.higher_is_better,
                "values": values,
                "ratios": ratios,
            })
        })
        .collect();
    let setups: Vec<&str> = Setup::ALL.iter().map(|s| s.name()).collect();
    let engine: Vec<Value> = engine
        .iter()
        .map(|r| {
            json!({
                "workload": r.workload,
                "setup": r.setup,
                "packets": r.packets,
                "resent": r.resent,
                "probes": r.probes,
                "spurious_probes": r.spurious,
                "timeouts": r.timeouts,
            })
        })
        .collect();
    format!(
        "{}\n",
        json!({ "setups": setups, "metrics": items, "engine": engine })
    )
}

/// `v` rounded to `decimals` places as a JSON number, or `null` when it is not a number (NaN
/// or infinite: a run that measured nothing, a ratio to zero). The benches' JSON goes through
/// serde_json, so it always parses.
pub fn json_num(v: f64, decimals: i32) -> serde_json::Value {
    let k = 10f64.powi(decimals.min(15));
    let r = if decimals >= 15 {
        v
    } else {
        (v * k).round() / k
    };
    serde_json::Number::from_f64(r)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

/// An SVG bar chart of the ratios (one group per metric; a line at 1.0x).
pub fn svg(metrics: &[Metric]) -> String {
    // The setups this run has ratios for (smcr-verbs only where an RDMA device is), each with
    // its colour.
    let (series, colors): (Vec<Setup>, Vec<&str>) = [
        (Setup::SmcrLocal, "#1f77b4"),
        (Setup::SmcrXuser, "#2ca02c"),
        (Setup::SmcrSamehostNs, "#9467bd"),
        (Setup::SmcrRemote, "#ff7f0e"),
        (Setup::Fallback, "#7f7f7f"),
        (Setup::SmcrVerbs, "#d62728"),
    ]
    .into_iter()
    .filter(|(s, _)| metrics.iter().any(|m| m.ratio(*s).is_some()))
    .unzip();
    let max = metrics
        .iter()
        .flat_map(|m| series.iter().filter_map(|s| m.ratio(*s)))
        .fold(1.5f64, f64::max)
        .min(20.0);
    let (left, bar, gap, width) = (250.0, 10.0, 8.0, 500.0);
    let group = bar * series.len() as f64 + gap;
    let height = 40.0 + group * metrics.len() as f64 + 30.0;
    let x = |r: f64| left + width * (r.min(max) / max);
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        left + width + 60.0
    );
    let _ = writeln!(
        o,
        "<text x=\"10\" y=\"18\" font-size=\"13\">smcr / plain TCP (same topology); latency rows: lower is better</text>"
    );
    for (i, m) in metrics.iter().enumerate() {
        let y0 = 30.0 + group * i as f64;
        let _ = writeln!(
            o,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left - 6.0,
            y0 + bar * 1.8,
            m.name
        );
        for (k, s) in series.iter().enumerate() {
            if let Some(r) = m.ratio(*s) {
                let y = y0 + bar * k as f64;
                let _ = writeln!(
                    o,
                    "<rect x=\"{left}\" y=\"{y}\" width=\"{:.1}\" height=\"{}\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\">{r:.2}x</text>",
                    x(r) - left,
                    bar - 1.0,
                    colors[k],
                    x(r) + 3.0,
                    y + bar - 2.0
                );
            }
        }
    }
    let bottom = 30.0 + group * metrics.len() as f64;
    let _ = writeln!(
        o,
        "<line x1=\"{0:.1}\" y1=\"26\" x2=\"{0:.1}\" y2=\"{bottom}\" stroke=\"black\" stroke-dasharray=\"4 3\"/><text x=\"{0:.1}\" y=\"{1:.1}\" text-anchor=\"middle\">1.0x</text>",
        x(1.0),
        bottom + 12.0
    );
    for (k, s) in series.iter().enumerate() {
        let lx = 10.0 + 150.0 * k as f64;
        let _ = writeln!(
            o,
            "<rect x=\"{lx}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            bottom + 18.0,
            colors[k],
            lx + 14.0,
            bottom + 27.0,
            s.name()
        );
    }
    o.push_str("</svg>\n");
    o
}

/// Parses `--only a,b`.
pub fn parse_setups(list: &str) -> Result<Vec<Setup>> {
    list.split(',')
        .map(|n| {
            Setup::ALL
                .into_iter()
                .find(|s| s.name() == n.trim())
                .with_context(|| format!("unknown setup {n:?}"))
        })
        .collect()
}

/// Parses `--workloads a,b`.
pub fn parse_workloads(list: &str) -> Result<Vec<&'static str>> {
    list.split(',')
        .map(|n| {
            WORKLOADS
                .into_iter()
                .find(|w| *w == n.trim())
                .with_context(|| format!("unknown workload {n:?}; workloads: {WORKLOADS:?}"))
        })
        .collect()
}

/// Writes `text` to `path`.
pub fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Where the bench writes its outputs unless told (`--json`, `--svg`): `bench/` in the cargo
/// target directory the bench binary was built into (`target/release/bench` →
/// `target/bench/`), generated output staying out of the sources; a binary elsewhere writes
/// to the current directory.
pub fn out_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.to_path_buf()))
        .filter(|t| t.join("CACHEDIR.TAG").exists() || t.file_name().is_some_and(|n| n == "target"))
        .map_or_else(|| PathBuf::from("."), |t| t.join("bench"))
}

/// Errors unless the tools are there (`ss` and `ip` only for the setups with namespaces).
pub fn check_tools(netns: bool) -> Result<()> {
    require_tools(&["redis-server", "redis-benchmark", "sockperf", "iperf3"])?;
    if netns {
        require_tools(&["ss", "ip"])?;
    }
    Ok(())
}

/// Errors naming the first of `tools` that is not on the PATH.
pub(crate) fn require_tools(tools: &[&str]) -> Result<()> {
    for t in tools {
        let ok = Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("{t} is missing: run scripts/setup.sh as root");
        }
    }
    Ok(())
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
