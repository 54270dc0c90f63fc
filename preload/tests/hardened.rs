//! Services as Debian's systemd units run them, under the shim (issue 35).
//!
//! Debian runs redis-server, memcached, PostgreSQL and haproxy from units that sandbox them:
//! seccomp filters (`SystemCallFilter=@system-service ~@privileged @resources`, whose default
//! action kills the process), `RestrictAddressFamilies=`, `MemoryDenyWriteExecute=`, a private
//! `/dev` and `/tmp`, a read-only root, a user namespace, `NoExecPaths=/` with `ExecPaths=` …
//! An administrator turns smcr on for such a service with a drop-in (`smcr service enable
//! redis-server`, or by hand `systemctl edit redis-server` → `Environment=LD_PRELOAD=…`); the
//! library must then neither get the service killed nor leave it on TCP. The tests write the
//! drop-in with `smcr service enable` and check the unit with `smcr service check`, which must
//! find no problem (and must name the library under /usr/local/lib). These machines have no systemd as PID 1, so
//! `scripts/unit-sandbox.py` applies each unit's [Service] settings the way systemd 252
//! (Debian 12) applies them, and says which it does not apply (`out/NAME.unit.json`).
//!
//! `rig::*` check the runner itself, with no library: for every setting it claims, a probe
//! (`tests/c/unitprobe.c`) run under the unit (or a unit of that one setting, beside a
//! control without it) sees its effect: the unit's uid, gid and groups, the uid map of the
//! user namespace, umask, limits, environment, EROFS on a read-only root, a private `/dev` and
//! `/tmp`, EAFNOSUPPORT for AF_NETLINK, EPERM for writable-executable memory, SIGSYS for a
//! system call outside the filter, a shared object under a `NoExecPaths=` path that cannot be
//! mapped …
//!
//! The scenarios run twice: `baseline::*` without the library (must pass: the sandbox lets the
//! program work, and the byte check sees TCP payload) and `over_smcr::*` with the library
//! preloaded by the administrator's drop-in from a copy under `/usr/lib` (Debian's units allow
//! `ExecPaths=/usr/lib`; `scripts/install.sh` must install there), clients under the shim as
//! `nobody`, not sandboxed. Each over_smcr test asserts that the server is never killed (its
//! exit status or signal is named, SIGSYS with what it means), that every request succeeds,
//! that smc-stat (run as root at its default location, as an administrator runs it) shows
//! the server's connections as SMC-R while they run, and that the server's TCP sockets carried
//! only the CLC handshake (`ss`). Scenarios: redis-server (`redis-server.service`) with
//! redis-benchmark (and again with a /dev/shm of its own, so that smc-stat must find its stats
//! area in another mount namespace); memcached (`memcached.service`, root dropping to
//! `memcache`) with a Python
//! client; PostgreSQL (`postgresql@VERSION-main.service`, the postmaster forking a backend per
//! connection) with pgbench; haproxy (`haproxy.service`, Debian's default configuration:
//! chroot, user haproxy, master-worker, RLIMIT_NPROC 0 once started) proxying in TCP mode to
//! a redis-server, both legs checked; and redis with the library under /usr/local/lib, which
//! the loader drops under redis's unit (the program runs, over TCP).
//!
//! Worlds live in `/var/lib/smcr-hardened-<pid>-<tag>-<mode>/` (a unit's private /tmp would
//! hide /tmp); a failing test keeps its directory (`SMCR_KEEP_LOGS=1` keeps every one). All
//! need root; they skip without it or without the tools (fail under SMCR_REQUIRE_TOOLS=1).

mod common;
#[path = "distro/harness.rs"]
mod harness;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use harness::{
    CLIENT_TIMEOUT, Net, Proc, Spec, User, World, check_benchmark, pg_bin, redis_benchmark,
};

/// Ports: `common::port(BASE)` (64 per test process).
const BASE: u16 = 19000;

/// Worlds' directories: outside /tmp and /var/tmp (PrivateTmp=) and /home and /root
/// (ProtectHome=).
const PREFIX: &str = "/var/lib/smcr-hardened";

const MEMCACHED_CLIENT: &str = include_str!("py/memcached_client.py");

// ---------------------------------------------------------------------------------------
// The world under units.

/// A copy of the library (or a test object) installed where it is removed with the test.
struct Installed {
    dir: PathBuf,
    lib: PathBuf,
}

impl Installed {
    /// `libsmcr.so` in `BASE/smcr-hardened-<pid>-<tag>/` (BASE `/usr/lib`: where Debian's
    /// units may map it; `/usr/local/lib`: where they may not).
    fn library(base: &str, tag: &str) -> Self {
        let dir = PathBuf::from(format!("{base}/smcr-hardened-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let lib = dir.join("libsmcr.so");
        std::fs::copy(common::lib(), &lib).unwrap();
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o644)).unwrap();
        Self { dir, lib }
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The runner's own needs (Debian's Python with python3-seccomp; systemd-analyze for the
/// syscall groups), else a skip (a failure under SMCR_REQUIRE_TOOLS=1).
fn runner_ready() -> bool {
    let (python, _) = harness::unit_sandbox();
    let ok = Command::new(&python)
        .args(["-c", "import seccomp"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "{} cannot import seccomp (scripts/setup.sh installs python3-seccomp)",
            python.display()
        );
        eprintln!("SKIP: python3-seccomp is not installed (scripts/setup.sh installs it)");
    }
    ok
}

/// A world for programs under their units: outside /tmp; programs keep their stats areas, and
/// smc-stat looks, where they do by default; under the shim the library is installed under
/// /usr/lib for the units' drop-ins.
fn world(tag: &str, shim: bool, tools: &[&str]) -> Option<(World, Option<Installed>)> {
    let mut tools = tools.to_vec();
    tools.push("systemd-analyze");
    let mut w = World::new_at(PREFIX, tag, shim, &tools)?;
    if !runner_ready() {
        return None;
    }
    w.default_stats = true;
    let lib = shim.then(|| Installed::library("/usr/lib", tag));
    w.unit_lib = lib.as_ref().map(|l| l.lib.clone());
    Some((w, lib))
}

/// How a program ended, in words (SIGSYS with what it means under a unit; the runner's own
/// failures with systemd's exit status names).
fn ended(st: ExitStatus) -> String {
    if let Some(sig) = st.signal() {
        let name = match sig {
            31 => {
                return "was KILLED BY SIGSYS: it made a system call its unit's seccomp filter \
                        (SystemCallFilter=) forbids, whose action is to kill the process"
                    .to_owned();
            }
            6 => "SIGABRT",
            7 => "SIGBUS",
            9 => "SIGKILL",
            11 => "SIGSEGV",
            15 => "SIGTERM",
            _ => "",
        };
        return format!("was killed by signal {sig} {name}");
    }
    let code = st.code().unwrap_or(-1);
    let what = match code {
        200 => " (200/CHDIR)",
        203 => " (203/EXEC)",
        205 => " (205/LIMITS)",
        216 => " (216/GROUP)",
        217 => " (217/USER)",
        218 => " (218/CAPABILITIES)",
        226 => " (226/NAMESPACE: the unit's mounts could not be set up)",
        228 => " (228/SECCOMP)",
        _ => "",
    };
    format!("exited with status {code}{what}")
}

/// Waits until `server` listens on `port`; if it ends first, says how (a signal by name).
fn assert_up(w: &World, server: &mut Proc, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if !harness::listeners(&Net::Host, port).is_empty() {
            return;
        }
        if let Some(st) = server.status() {
            panic!(
                "[{}] {} {} instead of listening on port {port}\n--- stderr:\n{}\n{}",
                w.mode(),
                server.name,
                ended(st),
                harness::head(&server.stderr(), 30),
                w.log_summary()
            );
        }
        assert!(
            Instant::now() < deadline,
            "[{}] {} does not listen on port {port} after 20 s\n--- stderr:\n{}\n{}",
            w.mode(),
            server.name,
            harness::head(&server.stderr(), 30),
            w.log_summary()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
}

/// The server still runs (was not killed while it served).
fn assert_alive(w: &World, server: &mut Proc) {
    if let Some(st) = server.status() {
        panic!(
            "[{}] {} {} while serving\n--- stderr:\n{}\n{}",
            w.mode(),
            server.name,
            ended(st),
            harness::tail(&server.stderr(), 30),
            w.log_summary()
        );
    }
}

/// Under the shim, the server's own log says its connections were SMC-R (at least `min`).
fn assert_logged_smcr(w: &World, name: &str, min: usize) {
    let log = std::fs::read_to_string(w.log_path(name)).unwrap_or_default();
    let n = log.lines().filter(|l| l.contains("): SMC-R")).count();
    assert!(
        n >= min,
        "{name}'s shim log shows {n} SMC-R connections, expected {min} or more\n{}",
        w.log_summary()
    );
}

// ---------------------------------------------------------------------------------------
// Scenarios (`shim`: the library preloaded by the drop-in, with the SMC-R checks).

/// redis-server as its unit's ExecStart= runs it (Debian's /etc/redis/redis.conf,
/// `--supervised systemd --daemonize no`) on a test port, logging to stdout, its pid file in
/// its RuntimeDirectory= (removed with the returned guard: the test kills redis), saving
/// nothing.
fn redis_unit_server(w: &World, spec: Spec, port: u16) -> (Proc, Markers) {
    let p = port.to_string();
    let pidfile = format!("/run/redis/redis-server-{port}.pid");
    let guard = Markers(vec![PathBuf::from(&pidfile)]);
    let server = w.spawn(
        &spec,
        "/usr/bin/redis-server",
        &[
            "/etc/redis/redis.conf",
            "--supervised",
            "systemd",
            "--daemonize",
            "no",
            "--port",
            &p,
            "--logfile",
            "",
            "--pidfile",
            &pidfile,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
    );
    (server, guard)
}

/// Scenario 1: redis-server under `redis-server.service` (user redis, PrivateUsers=,
/// ProtectSystem=strict, NoExecPaths=/, SystemCallFilter=@system-service ~@privileged
/// @resources …); redis-benchmark `-c 50 -n 20000 -t set,get` as nobody. `private_shm`: an
/// administrator's drop-in also gives it a /dev/shm of its own (`TemporaryFileSystem=`;
/// systemd 252's PrivateDevices= keeps the host's), so its stats area is in another mount
/// namespace, where smc-stat must still find it.
fn redis(shim: bool, private_shm: bool) {
    let tag = if private_shm { "redis-shm" } else { "redis" };
    let Some((w, _lib)) = world(tag, shim, &["redis-server", "redis-benchmark"]) else {
        return;
    };
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let mut spec = w.spec("redis-server").unit("redis-server");
    if private_shm {
        spec = spec.unit_conf("TemporaryFileSystem=/dev/shm:mode=1777");
    }
    let (mut server, _pidfile) = redis_unit_server(&w, spec, port);
    assert_up(&w, &mut server, port);
    if private_shm {
        use std::os::unix::fs::MetadataExt;
        let inside = std::fs::metadata(format!("/proc/{}/root/dev/shm", server.pid()))
            .unwrap()
            .dev();
        assert_ne!(
            inside,
            std::fs::metadata("/dev/shm").unwrap().dev(),
            "redis-server's /dev/shm is the host's"
        );
    }
    let sampler = w.sampler(&Net::Host, &[port]);
    let bench = redis_benchmark(
        &w,
        w.spec("redis-benchmark").user(&nobody),
        "127.0.0.1",
        port,
    )
    .finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    assert_alive(&w, &mut server);
    check_benchmark(&w, &bench);
    let v = w.verdict(&seen, &[&server]);
    if shim {
        v.assert_all_smcr(50);
        assert_logged_smcr(&w, "redis-server", 50);
    } else {
        v.assert_tcp_baseline(1);
    }
}

/// Scenario 2: memcached under `memcached.service` (root with CapabilityBoundingSet=
/// CAP_SETGID CAP_SETUID CAP_SYS_RESOURCE, NoNewPrivileges=, PrivateDevices=, PrivateTmp=,
/// ProtectSystem=full, RestrictAddressFamilies=, MemoryDenyWriteExecute= …), started as the
/// unit's wrapper starts it from /etc/memcached.conf (`-u memcache`, dropping root itself);
/// the Python text-protocol client as nobody: 20 connections × 100 set + get of 1 KiB, every
/// reply checked, then memcached's own `stats` must count them.
fn memcached(shim: bool) {
    let Some((w, _lib)) = world("memcached", shim, &["memcached", "python3"]) else {
        return;
    };
    let (memcache, nobody) = (User::or_nobody("memcache"), User::or_nobody("nobody"));
    let port = common::port(BASE);
    let ps = port.to_string();
    const CONNS: u64 = 20;
    const ROUNDS: u64 = 100;
    let mut server = w.spawn(
        &w.spec("memcached").unit("memcached"),
        "/usr/bin/memcached",
        &[
            "-u",
            &memcache.name,
            "-l",
            "127.0.0.1",
            "-p",
            &ps,
            "-m",
            "64",
            "-v",
        ],
    );
    assert_up(&w, &mut server, port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while harness::uids(server.pid()) != Some((memcache.uid, memcache.uid)) {
        assert_alive(&w, &mut server);
        assert!(
            Instant::now() < deadline,
            "[{}] memcached runs as {:?}, not {}",
            w.mode(),
            harness::uids(server.pid()),
            memcache.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let client_file = w.file("client.py", MEMCACHED_CLIENT.as_bytes());
    let mut client = w.spawn(
        &w.spec("client").user(&nobody).stdin(),
        "python3",
        &[
            client_file.to_str().unwrap(),
            "127.0.0.1",
            &ps,
            &CONNS.to_string(),
            &ROUNDS.to_string(),
            "none",
        ],
    );
    w.wait_output(
        &mut client,
        &format!("done {} commands", CONNS * ROUNDS * 2),
        CLIENT_TIMEOUT,
    );
    let seen = w.snapshot(&Net::Host, &[port]);
    let v = w.verdict(&seen, &[&server]);
    client.write_stdin("done\n");
    client.close_stdin();
    let done = client.finish(CLIENT_TIMEOUT);
    w.expect_ok(&done);
    assert_alive(&w, &mut server);
    let stats: BTreeMap<&str, u64> = done
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("stats "))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, n)| Some((k, n.parse().ok()?)))
        .collect();
    eprintln!("memcached [{}]: {stats:?}", w.mode());
    let n = |k: &str| stats.get(k).copied();
    assert!(
        n("cmd_set") == Some(CONNS * ROUNDS)
            && n("get_hits") == Some(CONNS * ROUNDS)
            && n("get_misses") == Some(0),
        "[{}] memcached's stats {stats:?}, expected {} sets and hits, no miss\n{}",
        w.mode(),
        CONNS * ROUNDS,
        done.describe()
    );
    if shim {
        v.assert_all_smcr(CONNS);
        assert_logged_smcr(&w, "memcached", CONNS as usize);
    } else {
        v.assert_tcp_baseline(CONNS as usize);
    }
}

/// Scenario 3: PostgreSQL under `postgresql@VERSION-main.service` (its only process setting is
/// OOMScoreAdjust=-900), the postmaster started as the unit's pg_ctlcluster starts it: root
/// changing to the cluster owner with its groups, then `postgres`; it forks a backend per
/// connection. `pgbench -i`, then `pgbench -c 4 -t 500`, as nobody (role postgres, trust).
fn postgres(shim: bool) {
    let Some((w, _lib)) = world("postgres", shim, &["setpriv"]) else {
        return;
    };
    let Some(bin) = pg_bin() else {
        common::have("/usr/lib/postgresql/VERSION/bin/postgres");
        return;
    };
    let version = bin.parent().unwrap().file_name().unwrap().to_str().unwrap();
    let unit = format!("postgresql@{version}-main");
    let (pg, nobody) = (User::or_nobody("postgres"), User::or_nobody("nobody"));
    let port = common::port(BASE);
    let ps = port.to_string();
    let root = w.private_dir("pg", &pg);
    let data = root.join("data");
    let sock = w.private_dir("pg-sock", &pg);
    let prog = |p: &str| bin.join(p).to_str().unwrap().to_owned();
    w.initdb(&pg, &bin, &data);
    let mut server = w.spawn(
        &w.spec("postgres").unit(&unit),
        "/usr/bin/setpriv",
        &[
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
            &prog("postgres"),
            "-D",
            data.to_str().unwrap(),
            "-k",
            sock.to_str().unwrap(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-p",
            &ps,
        ],
    );
    assert_up(&w, &mut server, port);
    w.wait_output(
        &mut server,
        "ready to accept connections",
        Duration::from_secs(30),
    );
    // The unit's OOMScoreAdjust= reached the postmaster (lowering it needs CAP_SYS_RESOURCE;
    // without it systemd goes on without, and so does the runner).
    let adj = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", server.pid()))
        .unwrap_or_default();
    if cap_eff() >> 24 & 1 == 1 {
        assert_eq!(adj.trim(), "-900", "OOMScoreAdjust= of {unit} not applied");
    }
    let (run, seen) = w.pgbench(&nobody, &bin, port);
    assert_alive(&w, &mut server);
    w.check_pgbench(&run);
    let v = w.verdict(&seen, &[&server]);
    if shim {
        // pgbench's 4 clients, each served by a backend the postmaster forked.
        v.assert_all_smcr(4);
        let log = std::fs::read_to_string(w.log_path("postgres")).unwrap_or_default();
        let accepts = log.lines().filter(|l| l.contains(" accept ")).count();
        let smcr = log
            .lines()
            .filter(|l| l.contains(" accept ") && l.contains("): SMC-R"))
            .count();
        assert!(
            accepts >= 6 && smcr == accepts,
            "postgres: {smcr} of {accepts} accepted connections SMC-R, expected 6 or more, all\n{}",
            w.log_summary()
        );
    } else {
        v.assert_tcp_baseline(4);
    }
    // PostgreSQL's fast shutdown, which removes its shared memory segments from /dev/shm.
    server.stop(libc::SIGINT, Duration::from_secs(20));
}

/// A syslog socket (haproxy's `log /dev/log`, bound into its chroot): the messages it got.
struct Syslog {
    stop: Arc<AtomicBool>,
    reader: std::thread::JoinHandle<Vec<String>>,
}

impl Syslog {
    fn bind(path: &Path) -> Self {
        let sock = UnixDatagram::bind(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let reader = std::thread::spawn(move || {
            let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
            while !flag.load(Ordering::Relaxed) {
                if let Ok(n) = sock.recv(&mut buf) {
                    got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
            }
            got
        });
        Self { stop, reader }
    }

    /// Stops reading; how many messages contained `what`.
    fn stop(self, what: &str) -> usize {
        std::thread::sleep(Duration::from_millis(100));
        self.stop.store(true, Ordering::Relaxed);
        let got = self.reader.join().unwrap();
        got.iter().filter(|m| m.contains(what)).count()
    }
}

/// Debian's /etc/haproxy/haproxy.cfg, adapted for ports and backends only: its global and
/// defaults sections as shipped (chroot /var/lib/haproxy, user haproxy, daemon, logging to
/// /dev/log; no `insecure-fork-wanted`, so haproxy sets RLIMIT_NPROC to 0 once started), the
/// stats socket in the test's directory (two tests' haproxys must not share
/// /run/haproxy/admin.sock), and a TCP-mode frontend on `front` to a redis on `back`.
fn haproxy_cfg(w: &World, front: u16, back: u16) -> PathBuf {
    let debian = std::fs::read_to_string("/etc/haproxy/haproxy.cfg")
        .expect("/etc/haproxy/haproxy.cfg (Debian's haproxy package)");
    assert!(
        debian.contains("chroot /var/lib/haproxy") && !debian.contains("insecure-fork-wanted"),
        "/etc/haproxy/haproxy.cfg is not Debian's default"
    );
    let admin = w.dir.join("haproxy-admin.sock");
    let mut cfg = debian.replace(
        "stats socket /run/haproxy/admin.sock",
        &format!("stats socket {}", admin.display()),
    );
    cfg.push_str(&format!(
        "
frontend redis_in
\tbind 127.0.0.1:{front}
\tmode tcp
\toption tcplog
\tdefault_backend redis_out

backend redis_out
\tmode tcp
\tserver redis1 127.0.0.1:{back}
"
    ));
    w.file("haproxy.cfg", cfg.as_bytes())
}

/// Scenario 4: haproxy under `haproxy.service` as its ExecStart= runs it (`-Ws`:
/// master-worker, the master in the foreground), Debian's configuration (chroot, user
/// haproxy, RLIMIT_NPROC 0 once started) proxying in TCP mode to a redis-server (as `redis`,
/// not sandboxed; under the shim too); redis-benchmark as nobody through haproxy. Both legs
/// are checked: client → haproxy (haproxy's accepted connections) and haproxy → redis
/// (redis's). The unit binds /dev/log into the chroot (BindReadOnlyPaths=); with no journald
/// here, the test's drop-in binds a socket of its own there instead.
fn haproxy(shim: bool) {
    let Some((w, _lib)) = world(
        "haproxy",
        shim,
        &["haproxy", "redis-server", "redis-benchmark"],
    ) else {
        return;
    };
    let (redis, nobody, haproxy) = (
        User::or_nobody("redis"),
        User::or_nobody("nobody"),
        User::or_nobody("haproxy"),
    );
    let (front, back) = (common::port(BASE), common::port(BASE));
    let data = w.private_dir("redis-data", &redis);
    let bp = back.to_string();
    let mut backend = w.spawn(
        &w.spec("redis-backend").user(&redis),
        "redis-server",
        &[
            "--bind",
            "127.0.0.1",
            "--port",
            &bp,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            data.to_str().unwrap(),
        ],
    );
    w.wait_listening(&Net::Host, back, &mut backend);
    let log_sock = w.dir.join("haproxy-log.sock");
    let syslog = Syslog::bind(&log_sock);
    let cfg = haproxy_cfg(&w, front, back);
    let spec = w
        .spec("haproxy")
        .unit("haproxy")
        .unit_conf("BindReadOnlyPaths=")
        .unit_conf(&format!(
            "BindReadOnlyPaths={}:/var/lib/haproxy/dev/log",
            log_sock.display()
        ));
    let mut master = w.spawn(
        &spec,
        "/usr/sbin/haproxy",
        &[
            "-Ws",
            "-f",
            cfg.to_str().unwrap(),
            "-p",
            w.dir.join("haproxy.pid").to_str().unwrap(),
            "-S",
            w.dir.join("haproxy-master.sock").to_str().unwrap(),
        ],
    );
    assert_up(&w, &mut master, front);
    let workers = w.wait_workers(&mut master, 1, &String::new);
    // The worker runs as haproxy and can create no process or thread any more (haproxy's
    // default): what the library has to cope with.
    let deadline = Instant::now() + Duration::from_secs(10);
    let nproc_zero = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/limits"))
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("Max processes") && l.split_whitespace().nth(2) == Some("0"))
    };
    while !workers
        .iter()
        .all(|&p| harness::uids(p) == Some((haproxy.uid, haproxy.uid)) && nproc_zero(p))
    {
        assert_alive(&w, &mut master);
        assert!(
            Instant::now() < deadline,
            "[{}] haproxy's workers {workers:?} do not run as {} with RLIMIT_NPROC 0",
            w.mode(),
            haproxy.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let sampler = w.sampler(&Net::Host, &[front, back]);
    let bench = redis_benchmark(
        &w,
        w.spec("redis-benchmark").user(&nobody),
        "127.0.0.1",
        front,
    )
    .finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    assert_alive(&w, &mut master);
    assert!(
        workers.iter().all(|&p| harness::uids(p).is_some()),
        "[{}] a haproxy worker of {workers:?} exited\n{}",
        w.mode(),
        w.log_summary()
    );
    check_benchmark(&w, &bench);
    eprintln!(
        "haproxy [{}]: {} connections in its log (through the chroot's /dev/log)",
        w.mode(),
        syslog.stop("redis_in")
    );
    let v = w.verdict(&seen, &[&master, &backend]);
    if shim {
        v.assert_all_smcr(50);
        assert_logged_smcr(&w, "haproxy", 50);
        assert_logged_smcr(&w, "redis-backend", 50);
    } else {
        v.assert_tcp_baseline(2);
    }
}

/// The library installed under /usr/local/lib (install.sh's default prefix today), preloaded
/// by the drop-in into redis-server under its unit: `NoExecPaths=/` with
/// `ExecPaths=/usr/bin/redis-server /usr/lib /lib` leaves /usr/local noexec, so the loader
/// cannot map it and drops the preload ("cannot be preloaded … ignored"). redis runs, over
/// TCP, with no stats area and no shim log; this is why install.sh must default to /usr/lib.
fn library_in_usr_local_lib() {
    let Some((mut w, _usr_lib)) =
        world("redis-usrlocal", true, &["redis-server", "redis-benchmark"])
    else {
        return;
    };
    let local = Installed::library("/usr/local/lib", "redis-usrlocal");
    w.unit_lib = Some(local.lib.clone());
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let (mut server, _pidfile) =
        redis_unit_server(&w, w.spec("redis-server").unit("redis-server"), port);
    assert_up(&w, &mut server, port);
    let sampler = w.sampler(&Net::Host, &[port]);
    let bench = redis_benchmark(
        &w,
        w.spec("redis-benchmark").user(&nobody),
        "127.0.0.1",
        port,
    )
    .finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    assert_alive(&w, &mut server);
    check_benchmark(&w, &bench);
    let err = server.stderr();
    let want = format!(
        "object '{}' from LD_PRELOAD cannot be preloaded (failed to map segment from shared object): ignored",
        local.lib.display()
    );
    assert!(
        err.contains(&want),
        "the loader did not drop the library under /usr/local/lib:\n{}",
        harness::head(&err, 10)
    );
    let log = std::fs::read_to_string(w.log_path("redis-server")).unwrap_or_default();
    assert!(
        log.is_empty(),
        "the library ran in redis-server from /usr/local/lib:\n{log}"
    );
    let v = w.verdict(&seen, &[&server]);
    eprintln!("{}", v.summary());
    assert!(
        !v.servers[0].in_stat,
        "redis-server has a stats area: the library ran\n{}",
        v.summary()
    );
    assert!(
        v.seen
            .tcp
            .values()
            .any(|b| b.received > harness::CLC_BYTES || b.acked > harness::CLC_BYTES),
        "the payload did not go over TCP\n{}",
        v.summary()
    );
}

// ---------------------------------------------------------------------------------------
// The rig: every setting the runner claims, seen from inside.

/// The probe (`tests/c/unitprobe.c`) and a shared object, under /usr/lib (which units such as
/// redis's leave executable), and the object again under /usr/local/lib (which they do not).
struct Probe {
    bin: PathBuf,
    lib: PathBuf,
    local_lib: PathBuf,
    _dirs: (Installed, Installed),
}

impl Probe {
    fn build(w: &World, tag: &str) -> Option<Self> {
        if !harness::have("cc") {
            return None;
        }
        let mk = |base: &str| {
            let dir = PathBuf::from(format!("{base}/smcr-hardened-{}-{tag}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            Installed {
                lib: dir.join("probe.so"),
                dir,
            }
        };
        let (usr, local) = (mk("/usr/lib"), mk("/usr/local/lib"));
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/unitprobe.c");
        let bin = usr.dir.join("unitprobe");
        let obj_src = w.file("probe-so.c", b"int unitprobe_object = 1;\n");
        for (args, what) in [
            (
                vec![
                    "-O2".to_owned(),
                    "-o".to_owned(),
                    bin.display().to_string(),
                    src.display().to_string(),
                ],
                "unitprobe.c",
            ),
            (
                vec![
                    "-shared".to_owned(),
                    "-fPIC".to_owned(),
                    "-o".to_owned(),
                    usr.lib.display().to_string(),
                    obj_src.display().to_string(),
                ],
                "probe.so",
            ),
        ] {
            let st = Command::new("cc").args(&args).status().unwrap();
            assert!(st.success(), "building {what} failed");
        }
        std::fs::copy(&usr.lib, &local.lib).unwrap();
        for p in [&bin, &usr.lib, &local.lib] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Some(Self {
            bin,
            lib: usr.lib.clone(),
            local_lib: local.lib.clone(),
            _dirs: (usr, local),
        })
    }

    /// Runs the checks under `spec`'s unit; one result per check.
    fn run(&self, w: &World, spec: &Spec, checks: &[String]) -> Probed {
        let f = w.run(
            spec,
            self.bin.to_str().unwrap(),
            checks,
            Duration::from_secs(30),
        );
        let unit = spec
            .unit
            .as_ref()
            .map_or("?", |u| u.name.as_str())
            .to_owned();
        assert!(
            f.ok(),
            "the probe under {unit} {}:\n--- stdout:\n{}\n--- stderr:\n{}",
            f.status.map_or("timed out".to_owned(), ended),
            f.stdout,
            f.stderr
        );
        let results: BTreeMap<String, String> = f
            .stdout
            .lines()
            .filter_map(|l| l.split_once(' ').map(|(c, r)| (c.to_owned(), r.to_owned())))
            .collect();
        for c in checks {
            assert!(
                results.contains_key(c),
                "the probe under {unit} did not report {c}:\n{}",
                f.stdout
            );
        }
        Probed {
            unit,
            results,
            stderr: f.stderr,
        }
    }
}

/// What the probe saw under one unit.
struct Probed {
    unit: String,
    results: BTreeMap<String, String>,
    stderr: String,
}

impl Probed {
    fn get(&self, check: &str) -> &str {
        self.results.get(check).map_or("(not run)", String::as_str)
    }

    /// `check` gave exactly `want`, because of `setting`.
    fn is(&self, check: &str, want: &str, setting: &str) {
        assert_eq!(
            self.get(check),
            want,
            "{setting} not applied as systemd applies it: `{check}` under {}\nall results: {:#?}",
            self.unit,
            self.results
        );
    }

    fn has(&self, check: &str, part: &str, setting: &str) {
        assert!(
            self.get(check).contains(part),
            "{setting} not applied as systemd applies it: `{check}` under {} gave {:?}, expected it to contain {part:?}",
            self.unit,
            self.get(check)
        );
    }

    fn lacks(&self, check: &str, part: &str, setting: &str) {
        assert!(
            !self.get(check).contains(part),
            "{setting} not applied as systemd applies it: `{check}` under {} gave {:?}, which contains {part:?}",
            self.unit,
            self.get(check)
        );
    }

    /// The items of an `ls:` result.
    fn listing(&self, check: &str) -> BTreeSet<String> {
        self.get(check)
            .strip_prefix("ok")
            .unwrap_or_default()
            .trim()
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

/// The control: `want` under the setting must not be what the check gives without it (else
/// the check could not fail).
fn differs(control: &Probed, check: &str, want: &str) {
    assert_ne!(
        control.get(check),
        want,
        "`{check}` gives {want} without the setting too: the check proves nothing"
    );
}

/// Host files the probe must or must not see, removed with the test.
struct Markers(Vec<PathBuf>);

impl Markers {
    fn new(paths: &[PathBuf]) -> Self {
        for p in paths {
            std::fs::write(p, b"host\n").unwrap();
        }
        Self(paths.to_vec())
    }
}

impl Drop for Markers {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A unit file of the test's own: `[Service]` and `lines`.
fn unit_file(w: &World, name: &str, lines: &[&str]) -> String {
    let mut text = String::from("[Service]\n");
    for l in lines {
        text.push_str(l);
        text.push('\n');
    }
    w.file(&format!("unit-files/{name}.service"), text.as_bytes())
        .display()
        .to_string()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// `name`'s home directory (/etc/passwd).
fn home_of(name: &str) -> String {
    std::fs::read_to_string("/etc/passwd")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 5 && f[0] == name).then(|| f[5].to_owned())
        })
        .unwrap()
}

/// `u`'s groups as the kernel lists them after initgroups() (sorted by host gid), seen from
/// the unit's user namespace when `private_users` (groups other than root's and the unit's
/// own appear as nobody's, 65534).
fn groups_of(u: &User, private_users: bool) -> String {
    let mut gids = BTreeSet::from([u.gid]);
    for l in std::fs::read_to_string("/etc/group").unwrap().lines() {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() == 4 && f[3].split(',').any(|m| m == u.name) {
            gids.insert(f[2].parse().unwrap());
        }
    }
    gids.iter()
        .map(|&g| {
            if !private_users || g == u.gid || g == 0 {
                g
            } else {
                65534
            }
        })
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A limit of `soft:hard` as the unit's process gets it: lowered to our hard limit when we
/// cannot raise it (systemd's setrlimit_closest(), without CAP_SYS_RESOURCE).
fn limit(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> String {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct.
    unsafe { libc::getrlimit(resource, &mut l) };
    let low = |v: u64| {
        if cap_eff() >> 24 & 1 == 1 {
            v
        } else {
            v.min(l.rlim_max)
        }
    };
    format!("ok {}:{}", low(soft), low(hard))
}

fn status_field(name: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap()
}

fn cap_eff() -> u64 {
    status_field("CapEff:")
}

fn cap_bnd() -> u64 {
    status_field("CapBnd:")
}

/// The private /dev systemd 252 makes (namespace.c mount_private_dev).
fn private_dev_listing() -> BTreeSet<String> {
    let mut s: BTreeSet<String> = [
        "char",
        "fd",
        "full",
        "hugepages",
        "log",
        "mqueue",
        "null",
        "ptmx",
        "pts",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if Path::new("/proc/kcore").exists() {
        s.insert("core".to_owned());
    }
    s
}

/// Under redis-server.service, every setting it has, from inside.
fn rig_redis() {
    let Some((w, _)) = world("rig-redis", false, &["redis-server"]) else {
        return;
    };
    let Some(probe) = Probe::build(&w, "rig-redis") else {
        return;
    };
    let redis = User::get("redis").expect("user redis (Debian's redis-server package)");
    let pid = std::process::id();
    let mark = format!("smcr-hardened-{pid}-marker");
    let _markers = Markers::new(&[
        Path::new("/tmp").join(&mark),
        Path::new("/var/tmp").join(&mark),
        Path::new("/dev/shm").join(&mark),
    ]);
    let owned = w.file("owned-by-4321", b"x\n");
    std::os::unix::fs::chown(&owned, Some(4321), Some(4321)).unwrap();
    let inside = format!("smcr-hardened-{pid}-inside");
    let (lib, local) = (probe.lib.display(), probe.local_lib.display());
    let checks: Vec<String> = [
        "id".to_owned(),
        "umask".into(),
        "cwd".into(),
        "caps".into(),
        "env:PATH".into(),
        "env:HOME".into(),
        "env:USER".into(),
        "env:RUNTIME_DIRECTORY".into(),
        "rlimit:nofile".into(),
        "rlimit:rtprio".into(),
        "rlimit:memlock".into(),
        "read:/proc/self/uid_map".into(),
        "read:/proc/self/gid_map".into(),
        format!("stat:{}", owned.display()),
        "stat:/run/redis".into(),
        "write:/etc/smcr-probe".into(),
        format!("write:/var/lib/redis/{inside}"),
        format!("write:/run/redis/{inside}"),
        format!("write:/run/{inside}"),
        "ls:/tmp".into(),
        "ls:/var/tmp".into(),
        format!("write:/tmp/{inside}"),
        "ls:/dev".into(),
        // The marker itself, not a listing: a host's /dev/shm may hold hundreds of entries
        // (PostgreSQL's segments), more than the probe's answer has room for.
        format!("stat:/dev/shm/{mark}"),
        format!("write:/dev/shm/{inside}"),
        "ls:/home".into(),
        "ls:/root".into(),
        "write:/proc/sys/kernel/hostname".into(),
        "write:/sys/fs/cgroup/smcr-probe".into(),
        "ls:/proc".into(),
        "ns:user".into(),
        "ns:uts".into(),
        "socket:AF_INET".into(),
        "socket:AF_INET6".into(),
        "socket:AF_UNIX".into(),
        "socket:AF_NETLINK".into(),
        "socket:AF_PACKET".into(),
        "mmap-wx".into(),
        "mprotect-x".into(),
        "unshare:user".into(),
        "personality".into(),
        "chmod-suid:/tmp/suid".into(),
        "bpf".into(),
        "setuid".into(),
        "setrlimit".into(),
        "setaffinity".into(),
        "sethostname".into(),
        "i386-getpid".into(),
        "exec:/usr/bin/true".into(),
        "exec:/usr/bin/redis-server".into(),
        format!("dlopen:{lib}"),
        format!("dlopen:{local}"),
    ]
    .to_vec();
    let s = probe.run(&w, &w.spec("probe").unit("redis-server"), &checks);
    // The files the probe wrote where it may.
    for d in ["/var/lib/redis", "/run/redis", "/dev/shm"] {
        let _ = std::fs::remove_file(Path::new(d).join(&inside));
    }
    let _ = std::fs::remove_file("/sys/fs/cgroup/smcr-probe");

    s.is(
        "id",
        &format!(
            "ok uid={0} gid={1} euid={0} groups={2}",
            redis.uid,
            redis.gid,
            groups_of(&redis, true)
        ),
        "User=redis Group=redis (groups from /etc/group, as initgroups)",
    );
    s.is("umask", "ok 007", "UMask=007");
    s.is("cwd", "ok /", "the default working directory (/)");
    for part in [
        "CapEff: 0000000000000000",
        "CapBnd: 0000000000000000",
        "NoNewPrivs: 1",
        "Seccomp: 2",
    ] {
        s.has(
            "caps",
            part,
            "CapabilityBoundingSet= NoNewPrivileges=true and the seccomp filters",
        );
    }
    s.is(
        "env:PATH",
        "ok /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "systemd's environment",
    );
    s.is("env:USER", "ok redis", "User= (USER, HOME)");
    s.is(
        "env:HOME",
        &format!("ok {}", home_of("redis")),
        "User= (USER, HOME)",
    );
    s.is(
        "env:RUNTIME_DIRECTORY",
        "ok /run/redis",
        "RuntimeDirectory=redis",
    );
    s.is(
        "rlimit:nofile",
        &limit(libc::RLIMIT_NOFILE, 65535, 65535),
        "LimitNOFILE=65535",
    );
    s.is(
        "rlimit:rtprio",
        "ok 0:0",
        "RestrictRealtime= (RLIMIT_RTPRIO 0)",
    );
    s.is(
        "rlimit:memlock",
        &limit(libc::RLIMIT_MEMLOCK, 8 << 20, 8 << 20),
        "DefaultLimitMEMLOCK=8M",
    );
    s.is(
        "read:/proc/self/uid_map",
        &format!("ok 0 0 1;{0} {0} 1", redis.uid),
        "PrivateUsers=true",
    );
    s.is(
        "read:/proc/self/gid_map",
        &format!("ok 0 0 1;{0} {0} 1", redis.gid),
        "PrivateUsers=true",
    );
    s.is(
        &format!("stat:{}", owned.display()),
        "ok uid=65534 gid=65534 mode=644",
        "PrivateUsers=true (others' files are nobody's)",
    );
    s.is(
        "stat:/run/redis",
        &format!("ok uid={} gid={} mode=2755", redis.uid, redis.gid),
        "RuntimeDirectory=redis RuntimeDirectoryMode=2755",
    );
    s.is("write:/etc/smcr-probe", "EROFS", "ProtectSystem=strict");
    s.is(
        &format!("write:/run/{inside}"),
        "EROFS",
        "ProtectSystem=strict",
    );
    if Path::new("/var/lib/redis").is_dir() {
        s.is(
            &format!("write:/var/lib/redis/{inside}"),
            "ok",
            "ReadWritePaths=-/var/lib/redis",
        );
    }
    s.is(
        &format!("write:/run/redis/{inside}"),
        "ok",
        "RuntimeDirectory= (writable under ProtectSystem=strict)",
    );
    s.lacks("ls:/tmp", &mark, "PrivateTmp=true");
    s.lacks("ls:/var/tmp", &mark, "PrivateTmp=true");
    s.is(&format!("write:/tmp/{inside}"), "ok", "PrivateTmp=true");
    assert!(
        !Path::new("/tmp").join(&inside).exists(),
        "PrivateTmp=true: the probe's /tmp file is in the host's /tmp"
    );
    assert_eq!(
        s.listing("ls:/dev"),
        private_dev_listing(),
        "PrivateDevices=true: not systemd's private /dev"
    );
    // systemd 252 binds the host's /dev/shm into the private /dev (mount_private_dev): POSIX
    // shared memory is the host's, and so are smcr's stats areas there.
    s.has(
        &format!("stat:/dev/shm/{mark}"),
        "ok ",
        "PrivateDevices=true (/dev/shm is the host's)",
    );
    s.is(
        &format!("write:/dev/shm/{inside}"),
        "ok",
        "PrivateDevices=true (/dev/shm is the host's)",
    );
    s.is("ls:/home", "EACCES", "ProtectHome=true");
    s.is("ls:/root", "EACCES", "ProtectHome=true");
    s.is(
        "write:/proc/sys/kernel/hostname",
        "EROFS",
        "ProtectKernelTunables=true",
    );
    s.is(
        "write:/sys/fs/cgroup/smcr-probe",
        "EROFS",
        "ProtectControlGroups=true",
    );
    let procs = s.listing("ls:/proc");
    assert!(
        procs.contains("self") && !procs.contains("1"),
        "ProtectProc=invisible: /proc shows other users' processes: {procs:?}"
    );
    let own_ns = |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).unwrap();
    s.lacks(
        "ns:user",
        own_ns("user").to_str().unwrap(),
        "PrivateUsers=true",
    );
    s.lacks(
        "ns:uts",
        own_ns("uts").to_str().unwrap(),
        "ProtectHostname=true",
    );
    for f in ["AF_INET", "AF_INET6", "AF_UNIX"] {
        s.is(
            &format!("socket:{f}"),
            "ok",
            "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        );
    }
    for f in ["AF_NETLINK", "AF_PACKET"] {
        s.is(
            &format!("socket:{f}"),
            "EAFNOSUPPORT",
            "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        );
    }
    s.is("mmap-wx", "EPERM", "MemoryDenyWriteExecute=true");
    s.is("mprotect-x", "EPERM", "MemoryDenyWriteExecute=true");
    s.is("unshare:user", "EPERM", "RestrictNamespaces=true");
    s.is("personality", "EPERM", "LockPersonality=true");
    s.is("chmod-suid:/tmp/suid", "EPERM", "RestrictSUIDSGID=true");
    for c in ["bpf", "setuid", "sethostname"] {
        s.is(c, "killed:SYS", "SystemCallFilter=~@privileged");
    }
    for c in ["setrlimit", "setaffinity"] {
        s.is(c, "killed:SYS", "SystemCallFilter=~@resources");
    }
    s.is(
        "i386-getpid",
        "killed:SYS",
        "SystemCallArchitectures=native",
    );
    s.is("exec:/usr/bin/true", "EACCES", "NoExecPaths=/");
    s.is(
        "exec:/usr/bin/redis-server",
        "ok",
        "ExecPaths=/usr/bin/redis-server",
    );
    s.is(&format!("dlopen:{lib}"), "ok", "ExecPaths=/usr/lib");
    s.has(
        &format!("dlopen:{local}"),
        "failed to map segment from shared object",
        "NoExecPaths=/ (/usr/local/lib is not in ExecPaths=)",
    );
    // Nothing the unit has is silently dropped: what the runner does not apply is reported.
    let report = std::fs::read_to_string(w.out.join("probe.unit.json")).unwrap();
    assert!(
        report.contains("\"RemoveIPC\"") && report.contains("DefaultTasksMax"),
        "the runner's report does not list what it does not apply:\n{report}"
    );
    assert!(
        s.stderr.contains("not applied: RemoveIPC=true"),
        "the runner did not say on stderr what it does not apply:\n{}",
        s.stderr
    );

    // LD_PRELOAD from the drop-in, as an administrator adds it: from /usr/lib the object is
    // loaded; from /usr/local/lib the loader drops it and the program runs without it.
    for (obj, dropped) in [(&probe.lib, false), (&probe.local_lib, true)] {
        let spec = w
            .spec(if dropped {
                "probe-preload-local"
            } else {
                "probe-preload-usr"
            })
            .unit("redis-server")
            .unit_conf(&format!("Environment=LD_PRELOAD={}", obj.display()));
        let s = probe.run(&w, &spec, &strings(&["env:LD_PRELOAD"]));
        s.is(
            "env:LD_PRELOAD",
            &format!("ok {}", obj.display()),
            "Environment= of a drop-in",
        );
        let msg = format!(
            "object '{}' from LD_PRELOAD cannot be preloaded (failed to map segment from shared object): ignored",
            obj.display()
        );
        assert_eq!(
            s.stderr.contains(&msg),
            dropped,
            "NoExecPaths=/ ExecPaths=… /usr/lib: {} preloaded from {}:\n{}",
            if dropped { "not dropped" } else { "dropped" },
            obj.display(),
            s.stderr
        );
    }
}

/// Under memcached.service (root, a narrow capability bounding set, ProtectSystem=full …).
fn rig_memcached() {
    let Some((w, _)) = world("rig-memcached", false, &["memcached"]) else {
        return;
    };
    let Some(probe) = Probe::build(&w, "rig-memcached") else {
        return;
    };
    let pid = std::process::id();
    let mark = format!("smcr-hardened-{pid}-marker-mc");
    let _markers = Markers::new(&[Path::new("/tmp").join(&mark)]);
    let var = w.dir.join("written-inside");
    let checks: Vec<String> = vec![
        "id".into(),
        "caps".into(),
        "rlimit:nofile".into(),
        "openw:/etc/hostname".into(),
        format!("write:/usr/smcr-probe-{pid}"),
        format!("write:{}", var.display()),
        "ls:/tmp".into(),
        "ls:/dev".into(),
        "socket:AF_INET".into(),
        "socket:AF_NETLINK".into(),
        "mmap-wx".into(),
        "unshare:net".into(),
        "openw:/proc/sys/kernel/hostname".into(),
        "write:/sys/fs/cgroup/smcr-probe".into(),
        "bpf".into(),
        "i386-getpid".into(),
    ];
    let s = probe.run(&w, &w.spec("probe").unit("memcached"), &checks);
    let _ = std::fs::remove_file(format!("/usr/smcr-probe-{pid}"));
    let _ = std::fs::remove_file("/sys/fs/cgroup/smcr-probe");
    s.has("id", "ok uid=0 gid=0 euid=0", "no User= (root)");
    // CAP_SETGID (6), CAP_SETUID (7), CAP_SYS_RESOURCE (24), within what we have ourselves.
    let bset = (1u64 << 6 | 1 << 7 | 1 << 24) & cap_bnd();
    s.has(
        "caps",
        &format!("CapBnd: {bset:016x}"),
        "CapabilityBoundingSet=CAP_SETGID CAP_SETUID CAP_SYS_RESOURCE",
    );
    s.has("caps", "NoNewPrivs: 1", "NoNewPrivileges=true");
    s.is(
        "rlimit:nofile",
        &limit(libc::RLIMIT_NOFILE, 1024, 524_288),
        "DefaultLimitNOFILE=1024:524288",
    );
    s.is("openw:/etc/hostname", "EROFS", "ProtectSystem=full");
    s.is(
        &format!("write:/usr/smcr-probe-{pid}"),
        "EROFS",
        "ProtectSystem=full",
    );
    s.is(
        &format!("write:{}", var.display()),
        "ok",
        "ProtectSystem=full (/var stays writable)",
    );
    s.lacks("ls:/tmp", &mark, "PrivateTmp=true");
    assert_eq!(
        s.listing("ls:/dev"),
        private_dev_listing(),
        "PrivateDevices=true"
    );
    s.is("socket:AF_INET", "ok", "RestrictAddressFamilies=");
    s.is(
        "socket:AF_NETLINK",
        "EAFNOSUPPORT",
        "RestrictAddressFamilies=",
    );
    s.is("mmap-wx", "EPERM", "MemoryDenyWriteExecute=true");
    s.is("unshare:net", "EPERM", "RestrictNamespaces=true");
    s.is(
        "openw:/proc/sys/kernel/hostname",
        "EROFS",
        "ProtectKernelTunables=true",
    );
    s.is(
        "write:/sys/fs/cgroup/smcr-probe",
        "EROFS",
        "ProtectControlGroups=true",
    );
    // No SystemCallFilter= and no SystemCallArchitectures=: nothing is killed.
    s.lacks("bpf", "killed", "no SystemCallFilter=");
    s.is("i386-getpid", "ok", "no SystemCallArchitectures=");
}

/// A unit of one setting: what it is called, its [Service] lines, and (check, result) pairs.
type Case<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// Each seccomp-based setting alone (as root, where nothing else refuses the call), beside a
/// control unit without it.
fn rig_seccomp_alone() {
    let Some((w, _)) = world("rig-seccomp", false, &[]) else {
        return;
    };
    let Some(probe) = Probe::build(&w, "rig-seccomp") else {
        return;
    };
    let all = strings(&[
        "sched-fifo",
        "adjtimex",
        "syslog",
        "ioperm",
        "unshare:net",
        "unshare:user",
        "personality",
        "mmap-wx",
        "mprotect-x",
        "socket:AF_NETLINK",
        "socket:AF_INET",
        "socket:AF_UNIX",
        "bpf",
        "setuid",
        "i386-getpid",
        "caps",
        "sethostname",
        "ns:uts",
        "chmod-suid:/tmp/smcr-probe-suid",
    ]);
    let run = |name: &str, lines: &[&str]| {
        let f = unit_file(&w, name, lines);
        probe.run(&w, &w.spec(name).unit(&f), &all)
    };
    let control = run("control", &["PrivateTmp=yes"]);
    let cases: &[Case] = &[
        (
            "RestrictRealtime=yes",
            &["RestrictRealtime=yes"],
            &[("sched-fifo", "EPERM")],
        ),
        (
            "ProtectClock=yes",
            &["ProtectClock=yes"],
            &[("adjtimex", "EPERM")],
        ),
        (
            "ProtectKernelLogs=yes",
            &["ProtectKernelLogs=yes"],
            &[("syslog", "EPERM")],
        ),
        (
            "PrivateDevices=yes",
            &["PrivateDevices=yes"],
            &[("ioperm", "EPERM")],
        ),
        (
            "RestrictNamespaces=yes",
            &["RestrictNamespaces=yes"],
            &[("unshare:net", "EPERM"), ("unshare:user", "EPERM")],
        ),
        (
            "RestrictNamespaces=~user",
            &["RestrictNamespaces=~user"],
            &[("unshare:user", "EPERM"), ("unshare:net", "ok")],
        ),
        (
            "LockPersonality=yes",
            &["LockPersonality=yes"],
            &[("personality", "EPERM")],
        ),
        (
            "MemoryDenyWriteExecute=yes",
            &["MemoryDenyWriteExecute=yes"],
            &[("mmap-wx", "EPERM"), ("mprotect-x", "EPERM")],
        ),
        (
            "RestrictAddressFamilies=~AF_NETLINK",
            &["RestrictAddressFamilies=~AF_NETLINK"],
            &[
                ("socket:AF_NETLINK", "EAFNOSUPPORT"),
                ("socket:AF_INET", "ok"),
            ],
        ),
        (
            "RestrictAddressFamilies=none",
            &["RestrictAddressFamilies=none"],
            &[("socket:AF_UNIX", "EAFNOSUPPORT")],
        ),
        (
            "SystemCallFilter=~bpf with SystemCallErrorNumber=EPERM",
            &["SystemCallFilter=~bpf", "SystemCallErrorNumber=EPERM"],
            &[("bpf", "EPERM"), ("setuid", "ok")],
        ),
        (
            "SystemCallFilter=~bpf:ENOSYS",
            &["SystemCallFilter=~bpf:ENOSYS"],
            &[("bpf", "ENOSYS")],
        ),
        (
            "SystemCallFilter=@system-service (an allow-list: the rest is killed)",
            &["SystemCallFilter=@system-service"],
            &[("bpf", "killed:SYS"), ("setuid", "ok")],
        ),
        (
            "SystemCallFilter=~@privileged, then an empty SystemCallFilter= (reset)",
            &["SystemCallFilter=~@privileged", "SystemCallFilter="],
            &[("setuid", "ok")],
        ),
        (
            "SystemCallArchitectures=native",
            &["SystemCallArchitectures=native"],
            &[("i386-getpid", "killed:SYS")],
        ),
        (
            "ProtectHostname=yes",
            &["ProtectHostname=yes"],
            &[("sethostname", "EPERM")],
        ),
        (
            "RestrictSUIDSGID=yes",
            &["RestrictSUIDSGID=yes", "PrivateTmp=yes"],
            &[("chmod-suid:/tmp/smcr-probe-suid", "EPERM")],
        ),
    ];
    for (i, (setting, lines, want)) in cases.iter().enumerate() {
        let s = run(&format!("case{i}"), lines);
        for (check, result) in *want {
            if *result != "ok" {
                differs(&control, check, result);
            }
            s.is(check, result, setting);
        }
    }
    let s = run("nnp", &["NoNewPrivileges=yes"]);
    s.has("caps", "NoNewPrivs: 1", "NoNewPrivileges=yes");
    control.has("caps", "NoNewPrivs: 0", "(the control)");
    let s = run("hostname", &["ProtectHostname=yes"]);
    assert_ne!(
        s.get("ns:uts"),
        control.get("ns:uts"),
        "ProtectHostname=yes: no UTS namespace of its own"
    );
    // Bounding set: the named ones (within ours), and what PrivateDevices= &c. take away.
    let s = run(
        "bset",
        &[
            "CapabilityBoundingSet=CAP_CHOWN CAP_NET_BIND_SERVICE CAP_MKNOD",
            "PrivateDevices=yes",
        ],
    );
    s.has(
        "caps",
        &format!("CapBnd: {:016x}", (1u64 | 1 << 10) & cap_bnd()),
        "CapabilityBoundingSet= (less CAP_MKNOD: PrivateDevices=)",
    );
}

/// The file-system settings alone, and the unit-file semantics (drop-ins, resets, `-`).
fn rig_mounts_alone() {
    let Some((w, _)) = world("rig-mounts", false, &[]) else {
        return;
    };
    let Some(probe) = Probe::build(&w, "rig-mounts") else {
        return;
    };
    let d = w.dir.join("tree");
    for sub in [
        "rw", "hidden", "tmpfs", "src", "src2", "dst", "dst2", "exec",
    ] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    std::fs::write(d.join("hidden/marker"), b"x").unwrap();
    std::fs::write(d.join("tmpfs/marker"), b"x").unwrap();
    std::fs::write(d.join("src/file"), b"from src\n").unwrap();
    std::fs::copy(&probe.bin, d.join("unitprobe")).unwrap();
    std::fs::copy(&probe.bin, d.join("exec/unitprobe")).unwrap();
    let t = |p: &str| format!("{}/{p}", d.display());
    let checks = strings(&[
        &format!("write:{}", t("x")),
        &format!("write:{}", t("rw/x")),
        &format!("ls:{}", t("hidden")),
        &format!("ls:{}", t("tmpfs")),
        &format!("read:{}", t("dst/file")),
        &format!("write:{}", t("dst/x")),
        &format!("write:{}", t("dst2/x")),
        &format!("exec:{}", t("unitprobe")),
        &format!("exec:{}", t("exec/unitprobe")),
        "openw:/etc/hostname",
        "write:/usr/smcr-probe",
        "ls:/root",
    ]);
    let run = |name: &str, lines: &[&str], dropin: &[&str]| {
        let f = unit_file(&w, name, lines);
        let mut spec = w.spec(name).unit(&f);
        for l in dropin {
            spec = spec.unit_conf(l);
        }
        probe.run(&w, &spec, &checks)
    };
    let control = run("control", &[], &[]);
    let paths = [
        "ProtectSystem=strict".to_owned(),
        format!("ReadWritePaths={}", t("rw")),
        format!("InaccessiblePaths={} -/nonexistent-smcr", t("hidden")),
        format!("TemporaryFileSystem={}", t("tmpfs")),
        format!("BindReadOnlyPaths={}:{}", t("src"), t("dst")),
        format!("BindPaths={}:{}", t("src2"), t("dst2")),
        "ProtectHome=tmpfs".to_owned(),
    ];
    let lines: Vec<&str> = paths.iter().map(String::as_str).collect();
    let s = run("paths", &lines, &[]);
    s.is(
        &format!("write:{}", t("x")),
        "EROFS",
        "ProtectSystem=strict",
    );
    s.is(&format!("write:{}", t("rw/x")), "ok", "ReadWritePaths=");
    s.is(
        &format!("ls:{}", t("hidden")),
        "ok ",
        "InaccessiblePaths= (root sees an empty directory)",
    );
    s.is(&format!("ls:{}", t("tmpfs")), "ok ", "TemporaryFileSystem=");
    s.is(
        &format!("read:{}", t("dst/file")),
        "ok from src",
        "BindReadOnlyPaths=",
    );
    s.is(
        &format!("write:{}", t("dst/x")),
        "EROFS",
        "BindReadOnlyPaths=",
    );
    s.is(&format!("write:{}", t("dst2/x")), "ok", "BindPaths=");
    assert!(
        d.join("src2/x").exists(),
        "BindPaths=: the write did not reach the source"
    );
    s.is("ls:/root", "ok ", "ProtectHome=tmpfs");
    // Apart from ProtectSystem=: in systemd 252 an ExecPaths=/NoExecPaths= entry is a mount of
    // its own that the read-only pass skips (namespace.c's deny list), so it stays writable.
    let noexec = format!("NoExecPaths={}", d.display());
    let exec = format!("ExecPaths={}", t("exec"));
    let s = run("exec", &[&noexec, &exec], &[]);
    s.is(
        &format!("exec:{}", t("unitprobe")),
        "EACCES",
        "NoExecPaths=",
    );
    s.is(
        &format!("exec:{}", t("exec/unitprobe")),
        "ok",
        "ExecPaths= inside NoExecPaths=",
    );
    for (check, want) in [
        (format!("write:{}", t("x")), "EROFS"),
        (format!("exec:{}", t("unitprobe")), "EACCES"),
        ("ls:/root".to_owned(), "ok "),
    ] {
        differs(&control, &check, want);
    }
    let _ = std::fs::remove_file(d.join("x"));
    // ProtectSystem=yes leaves /etc writable, full does not; both make /usr read-only.
    let yes = run("system-yes", &["ProtectSystem=yes"], &[]);
    yes.is("openw:/etc/hostname", "ok", "ProtectSystem=yes");
    yes.is("write:/usr/smcr-probe", "EROFS", "ProtectSystem=yes");
    let full = run("system-full", &["ProtectSystem=full"], &[]);
    full.is("openw:/etc/hostname", "EROFS", "ProtectSystem=full");
    differs(&control, "openw:/etc/hostname", "EROFS");
    let _ = std::fs::remove_file("/usr/smcr-probe");
    // ReadOnlyPaths= with a ReadWritePaths= nested inside it.
    let ro = format!("ReadOnlyPaths={}", d.display());
    let rw = format!("ReadWritePaths={}", t("rw"));
    let s = run("nested", &[&ro, &rw], &[]);
    s.is(&format!("write:{}", t("x")), "EROFS", "ReadOnlyPaths=");
    s.is(
        &format!("write:{}", t("rw/x")),
        "ok",
        "ReadWritePaths= inside ReadOnlyPaths=",
    );
    // A drop-in's empty assignment resets the list; a later scalar wins.
    let s = run(
        "reset",
        &["ProtectSystem=strict", &rw, "ProtectHome=no"],
        &["ReadWritePaths=", "ProtectHome=tmpfs"],
    );
    s.is(
        &format!("write:{}", t("rw/x")),
        "EROFS",
        "a drop-in's ReadWritePaths= (empty: reset)",
    );
    s.is("ls:/root", "ok ", "a drop-in's ProtectHome= (later wins)");
    // A missing path without "-": systemd refuses to start the unit (226/NAMESPACE).
    let f = unit_file(&w, "missing", &["ReadOnlyPaths=/nonexistent-smcr-hardened"]);
    let r = w.run(
        &w.spec("missing").unit(&f),
        probe.bin.to_str().unwrap(),
        &["id"],
        Duration::from_secs(30),
    );
    assert_eq!(
        r.status.and_then(|s| s.code()),
        Some(226),
        "ReadOnlyPaths= of a missing path: expected 226/NAMESPACE\n{}",
        r.describe()
    );
}

/// The process settings alone: user, groups, umask, limits, environment, directories,
/// working directory, OOM score, /proc, network and IPC namespaces (the user namespace is
/// redis's, above).
fn rig_process_alone() {
    let Some((w, _)) = world("rig-process", false, &[]) else {
        return;
    };
    let Some(probe) = Probe::build(&w, "rig-process") else {
        return;
    };
    let nobody = User::or_nobody("nobody");
    let pid = std::process::id();
    let name = format!("smcr-hardened-{pid}");
    let envfile = w.file("env", b"# comment\nC=3\nD=\"quoted value\"\n");
    let wd = w.dir.join("wd");
    std::fs::create_dir_all(&wd).unwrap();
    let adm = std::fs::read_to_string("/etc/group")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() == 4 && f[0] == "adm").then(|| f[2].parse::<u32>().unwrap())
        })
        .unwrap_or(4);
    let lines = [
        "User=nobody".to_owned(),
        "SupplementaryGroups=adm".to_owned(),
        "UMask=0077".to_owned(),
        "LimitNOFILE=4096".to_owned(),
        "LimitNPROC=77".to_owned(),
        "Environment=\"A=1 2\" B=%n".to_owned(),
        format!("EnvironmentFile=-/nonexistent-smcr {}", envfile.display()),
        "UnsetEnvironment=D".to_owned(),
        format!("WorkingDirectory={}", wd.display()),
        format!("RuntimeDirectory={name}/sub"),
        "RuntimeDirectoryMode=0750".to_owned(),
        format!("StateDirectory={name}"),
        format!("LogsDirectory={name}"),
        "OOMScoreAdjust=-900".to_owned(),
        "ProtectProc=invisible".to_owned(),
        "PrivateNetwork=yes".to_owned(),
        // PrivateIPC= mounts a /dev/mqueue of its own: in a private /dev, not the host's.
        "PrivateIPC=yes".to_owned(),
        "PrivateDevices=yes".to_owned(),
    ];
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let f = unit_file(&w, "process", &lines);
    let checks = strings(&[
        "id",
        "umask",
        "rlimit:nofile",
        "rlimit:nproc",
        "env:A",
        "env:B",
        "env:C",
        "env:D",
        "env:USER",
        "env:RUNTIME_DIRECTORY",
        "env:STATE_DIRECTORY",
        "env:LOGS_DIRECTORY",
        "cwd",
        &format!("stat:/run/{name}/sub"),
        &format!("stat:/var/lib/{name}"),
        &format!("stat:/var/log/{name}"),
        "read:/proc/self/oom_score_adj",
        "ls:/proc",
        "read:/proc/self/net/dev",
        "ns:net",
        "ns:ipc",
    ]);
    let s = probe.run(&w, &w.spec("process").unit(&f), &checks);
    for d in [
        format!("/run/{name}"),
        format!("/var/lib/{name}"),
        format!("/var/log/{name}"),
    ] {
        let _ = std::fs::remove_dir_all(d);
    }
    // initgroups() (nobody's groups in /etc/group) and SupplementaryGroups=, sorted.
    let mut groups: Vec<u32> = groups_of(&nobody, false)
        .split(',')
        .map(|g| g.parse().unwrap())
        .collect();
    groups.push(adm);
    groups.sort_unstable();
    groups.dedup();
    s.is(
        "id",
        &format!(
            "ok uid={0} gid={1} euid={0} groups={2}",
            nobody.uid,
            nobody.gid,
            groups
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
        "User=nobody SupplementaryGroups=adm",
    );
    s.is("umask", "ok 077", "UMask=0077");
    s.is(
        "rlimit:nofile",
        &limit(libc::RLIMIT_NOFILE, 4096, 4096),
        "LimitNOFILE=4096",
    );
    s.is("rlimit:nproc", "ok 77:77", "LimitNPROC=77");
    s.is("env:A", "ok 1 2", "Environment= (quoted)");
    s.is("env:B", "ok process.service", "Environment= (specifier %n)");
    s.is("env:C", "ok 3", "EnvironmentFile= (with a missing -file)");
    s.is("env:D", "ok (unset)", "UnsetEnvironment=");
    s.is("env:USER", "ok nobody", "User=");
    s.is(
        "env:RUNTIME_DIRECTORY",
        &format!("ok /run/{name}/sub"),
        "RuntimeDirectory=",
    );
    s.is(
        "env:STATE_DIRECTORY",
        &format!("ok /var/lib/{name}"),
        "StateDirectory=",
    );
    s.is(
        "env:LOGS_DIRECTORY",
        &format!("ok /var/log/{name}"),
        "LogsDirectory=",
    );
    s.is("cwd", &format!("ok {}", wd.display()), "WorkingDirectory=");
    s.is(
        &format!("stat:/run/{name}/sub"),
        &format!("ok uid={} gid={} mode=750", nobody.uid, nobody.gid),
        "RuntimeDirectory= RuntimeDirectoryMode=0750",
    );
    s.is(
        &format!("stat:/var/lib/{name}"),
        &format!("ok uid={} gid={} mode=755", nobody.uid, nobody.gid),
        "StateDirectory=",
    );
    s.has(
        &format!("stat:/var/log/{name}"),
        &format!("ok uid={} gid={}", nobody.uid, nobody.gid),
        "LogsDirectory=",
    );
    if cap_eff() >> 24 & 1 == 1 {
        s.is(
            "read:/proc/self/oom_score_adj",
            "ok -900",
            "OOMScoreAdjust=-900",
        );
    } else {
        // Lowering it needs CAP_SYS_RESOURCE: systemd skips it then, and so must the runner.
        s.has(
            "read:/proc/self/oom_score_adj",
            "ok ",
            "OOMScoreAdjust=-900",
        );
        assert!(
            s.stderr.contains("OOMScoreAdjust=-900 skipped"),
            "OOMScoreAdjust= not applied and not said:\n{}",
            s.stderr
        );
    }
    assert!(
        !s.listing("ls:/proc").contains("1"),
        "ProtectProc=invisible: pid 1 is visible to nobody"
    );
    let ifaces: Vec<&str> = s
        .get("read:/proc/self/net/dev")
        .split(';')
        .skip(2)
        .filter_map(|l| l.trim().split(':').next())
        .collect();
    assert_eq!(
        ifaces,
        vec!["lo"],
        "PrivateNetwork=yes: interfaces {ifaces:?}, expected lo alone"
    );
    let own = |n: &str| {
        format!(
            "ok {}",
            std::fs::read_link(format!("/proc/self/ns/{n}"))
                .unwrap()
                .display()
        )
    };
    assert_ne!(s.get("ns:net"), own("net"), "PrivateNetwork=yes");
    assert_ne!(s.get("ns:ipc"), own("ipc"), "PrivateIPC=yes");
}

// ---------------------------------------------------------------------------------------

/// The runner applies each setting it claims (no library).
mod rig {
    #[test]
    fn redis_unit() {
        super::rig_redis();
    }
    #[test]
    fn memcached_unit() {
        super::rig_memcached();
    }
    #[test]
    fn seccomp_settings_alone() {
        super::rig_seccomp_alone();
    }
    #[test]
    fn mount_settings_alone() {
        super::rig_mounts_alone();
    }
    #[test]
    fn process_settings_alone() {
        super::rig_process_alone();
    }
}

/// The scenarios without the library: the sandbox itself lets the programs work.
mod baseline {
    #[test]
    fn redis_server_unit() {
        super::redis(false, false);
    }
    #[test]
    fn redis_server_unit_private_dev_shm() {
        super::redis(false, true);
    }
    #[test]
    fn memcached_unit() {
        super::memcached(false);
    }
    #[test]
    fn postgresql_unit() {
        super::postgres(false);
    }
    #[test]
    fn haproxy_unit_both_legs() {
        super::haproxy(false);
    }
}

/// The scenarios with the library preloaded by the administrator's drop-in.
mod over_smcr {
    #[test]
    fn redis_server_unit() {
        super::redis(true, false);
    }
    /// smc-stat finds the stats area of a service whose /dev/shm is its own.
    #[test]
    fn redis_server_unit_private_dev_shm() {
        super::redis(true, true);
    }
    #[test]
    fn memcached_unit() {
        super::memcached(true);
    }
    #[test]
    fn postgresql_unit() {
        super::postgres(true);
    }
    #[test]
    fn haproxy_unit_both_legs() {
        super::haproxy(true);
    }
    /// Passes today: documents why install.sh must default to /usr/lib.
    #[test]
    fn library_under_usr_local_lib_is_not_loaded() {
        super::library_in_usr_local_lib();
    }
}
