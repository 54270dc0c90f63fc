//! redis-server and redis-benchmark, unmodified, under the shim (issue 5's main job): every
//! request succeeds, the connections are SMC-R (the shim's log, and the server's TCP sockets
//! carried only the CLC handshake), redis-cli works, a BGSAVE during load completes, and
//! mixed pairs (one side plain) run over TCP with PEERNOSMC recorded.

#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{have, lib};

/// Whether the TCP option program can be used (root): otherwise both ends `assume`.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// How the shimmed processes negotiate: the TCP option program in a private pin directory
/// (root), else `assume` (both ends shimmed).
struct Setup {
    bpf: Option<PathBuf>,
    log: PathBuf,
    roce_port: u16,
    dir: PathBuf,
}

impl Setup {
    fn new(tag: &str, want_bpf: bool) -> Self {
        let pid = std::process::id();
        let bpf = want_bpf.then(|| {
            let d = PathBuf::from(format!("/sys/fs/bpf/smcr-test-redis-{pid}-{tag}"));
            smcr::option::install(&d).expect("install the option program");
            d
        });
        let dir = std::env::temp_dir().join(format!("smcr-redis-{pid}-{tag}"));
        let _ = std::fs::create_dir_all(&dir);
        let log = dir.join("smcr.log");
        let _ = std::fs::remove_file(&log);
        let roce_port = 40000 + (pid % 5000) as u16 * 4 + u16::from(tag.len() as u8 % 4);
        Self {
            bpf,
            log,
            roce_port,
            dir,
        }
    }

    fn cmd(&self, shim: bool, prog: &str) -> Command {
        let mut c = Command::new(prog);
        if shim {
            c.env("LD_PRELOAD", lib())
                .env("SMCR_LOG", &self.log)
                .env("SMCR_STATS_DIR", self.dir.join("stats"))
                .env("SMCR_ROCE_PORT", self.roce_port.to_string());
            match &self.bpf {
                Some(d) => c.env("SMCR_BPF_DIR", d),
                None => c.env("SMCR_NEGOTIATION", "assume"),
            };
        }
        c
    }

    fn server(&self, shim: bool, port: u16) -> Server {
        let child = self
            .cmd(shim, "redis-server")
            .args(["--bind", "127.0.0.2", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.2", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        // That probe was a plain client: under the option program it just fell back.
        Server(child)
    }

    fn cli(&self, shim: bool, port: u16, args: &[&str]) -> String {
        let out = self
            .cmd(shim, "redis-cli")
            .args(["-h", "127.0.0.2", "-p", &port.to_string()])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "redis-cli {args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A redis-server that is killed however the test ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some(d) = &self.bpf {
            let _ = smcr::option::uninstall(d);
        }
        if std::env::var_os("SMCR_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Runs redis-benchmark and checks that every test reported its rate (it prints a line per
/// test only when all its requests completed); returns those lines.
fn benchmark(setup: &Setup, shim: bool, port: u16, args: &str, tests: &[&str]) -> Vec<String> {
    let out = setup
        .cmd(shim, "redis-benchmark")
        .args(["-h", "127.0.0.2", "-p", &port.to_string(), "-q"])
        .args(args.split_whitespace())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    assert!(out.status.success(), "redis-benchmark {args}: {text}");
    let lines: Vec<String> = text
        .lines()
        .filter(|l| l.contains("requests per second"))
        .map(str::to_owned)
        .collect();
    for t in tests {
        assert!(
            lines.iter().any(|l| l.starts_with(t)),
            "{t} did not complete in `{args}`:\n{text}"
        );
    }
    eprintln!("redis-benchmark {args}: {lines:?}");
    lines
}

/// Server-side established TCP sockets on `port` and the bytes each received.
fn tcp_bytes_received(port: u16) -> Vec<u64> {
    let out = Command::new("ss")
        .args([
            "-tin",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("bytes_received:"))
        .filter_map(|n| n.parse().ok())
        .collect()
}

fn wait_bgsave(setup: &Setup, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = setup.cli(true, port, &["INFO", "persistence"]);
        if info.contains("rdb_bgsave_in_progress:0") {
            assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
            return;
        }
        assert!(Instant::now() < deadline, "BGSAVE did not finish: {info}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn redis_benchmark_over_smcr() {
    if !have("redis-server") || !have("redis-benchmark") || !have("ss") {
        return;
    }
    let setup = Setup::new("main", is_root());
    let port = 17000 + (std::process::id() % 1000) as u16 * 2;
    let server = setup.server(true, port);

    // Meanwhile, prove that the benchmark's TCP connections carry no payload: sample the
    // server's sockets while the first run is under way.
    let sampler = std::thread::spawn(move || {
        let mut best: Vec<u64> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let v = tcp_bytes_received(port);
            if v.len() > best.len() {
                best = v;
            }
            if best.len() >= 50 {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        best
    });
    benchmark(
        &setup,
        true,
        port,
        "-t set,get,incr,lpush,lpop,mset -n 100000 -c 50",
        &["SET", "GET", "INCR", "LPUSH", "LPOP", "MSET"],
    );
    let sockets = sampler.join().unwrap();
    assert!(
        sockets.len() >= 50,
        "saw {} benchmark connections",
        sockets.len()
    );
    // Per connection only the CLC Proposal and Confirm arrived over TCP (156 + 180 or 108).
    assert!(sockets.iter().all(|&b| b <= 512), "{sockets:?}");

    // Pipelined, with a BGSAVE (redis forks; the child closes our sockets) during the load.
    let bg = {
        let log = setup.log.clone();
        let (bpf, rp) = (setup.bpf.clone(), setup.roce_port);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let mut c = Command::new("redis-cli");
            c.args(["-h", "127.0.0.2", "-p", &port.to_string(), "BGSAVE"])
                .env("LD_PRELOAD", lib())
                .env("SMCR_LOG", log)
                .env("SMCR_ROCE_PORT", rp.to_string());
            match bpf {
                Some(d) => c.env("SMCR_BPF_DIR", d),
                None => c.env("SMCR_NEGOTIATION", "assume"),
            };
            let out = c.output().unwrap();
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    benchmark(
        &setup,
        true,
        port,
        "-t set,get -n 200000 -c 50 -P 16",
        &["SET", "GET"],
    );
    let reply = bg.join().unwrap();
    assert!(reply.contains("Background saving started"), "{reply}");
    wait_bgsave(&setup, port);
    assert!(setup.dir.join("dump.rdb").exists());

    benchmark(
        &setup,
        true,
        port,
        "-t set,get -n 20000 -c 50 -d 1024",
        &["SET", "GET"],
    );

    // redis-cli under the shim.
    assert_eq!(
        setup
            .cli(true, port, &["SET", "smcr:key", "value over SMC-R"])
            .trim(),
        "OK"
    );
    assert_eq!(
        setup.cli(true, port, &["GET", "smcr:key"]).trim(),
        "value over SMC-R"
    );

    drop(server);
    let log = setup.log();
    let smcr_accepts = log
        .lines()
        .filter(|l| l.contains("accept") && l.contains("): SMC-R"))
        .count();
    let smcr_connects = log
        .lines()
        .filter(|l| l.contains("connect") && l.contains("): SMC-R"))
        .count();
    eprintln!("SMC-R connections: {smcr_connects} client side, {smcr_accepts} server side");
    assert!(smcr_accepts >= 150 && smcr_connects >= 150, "{log}");
    assert!(!log.contains("handshake failed"), "{log}");
}

#[test]
fn mixed_redis_pairs_run_over_tcp_with_the_reason() {
    if !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    if !common::root("mixed pairs (the TCP option program)") {
        return;
    }
    let setup = Setup::new("mixed", true);
    let port = 18000 + (std::process::id() % 1000) as u16 * 2;
    // Plain client → shimmed server.
    let server = setup.server(true, port);
    benchmark(
        &setup,
        false,
        port,
        "-t set,get -n 5000 -c 10",
        &["SET", "GET"],
    );
    drop(server);
    // Shimmed client → plain server.
    let server = setup.server(false, port + 1);
    benchmark(
        &setup,
        true,
        port + 1,
        "-t set,get -n 5000 -c 10",
        &["SET", "GET"],
    );
    drop(server);
    let log = setup.log();
    let count = |what: &str| {
        log.lines()
            .filter(|l| l.contains(what) && l.contains("PEERNOSMC 0x03010000"))
            .count()
    };
    assert!(count("accept") >= 10, "{log}");
    assert!(count("connect") >= 10, "{log}");
    assert!(!log.contains("): SMC-R"), "{log}");
}

/// `redis-server --daemonize yes` forks at start-up and the parent exits: the library starts
/// its engine lazily in the daemon, which then serves SMC-R.
#[test]
fn daemonized_redis_server_serves_smcr() {
    if !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    let setup = Setup::new("daemon", false);
    let port = 19000 + (std::process::id() % 1000) as u16 * 2;
    let pidfile = setup.dir.join("redis.pid");
    let st = setup
        .cmd(true, "redis-server")
        .args(["--bind", "127.0.0.2", "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "yes"])
        .arg("--pidfile")
        .arg(&pidfile)
        .arg("--dir")
        .arg(&setup.dir)
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid = loop {
        if let Some(p) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            break p;
        }
        assert!(Instant::now() < deadline, "the daemon wrote no pid file");
        std::thread::sleep(Duration::from_millis(50));
    };
    struct Kill(i32);
    impl Drop for Kill {
        fn drop(&mut self) {
            // SAFETY: signalling the daemon this test started.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
    let _daemon = Kill(pid);
    while std::net::TcpStream::connect(("127.0.0.2", port)).is_err() {
        assert!(Instant::now() < deadline, "the daemon does not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    benchmark(
        &setup,
        true,
        port,
        "-t set,get -n 5000 -c 5",
        &["SET", "GET"],
    );
    let log = setup.log();
    let accepts = log
        .lines()
        .filter(|l| {
            l.contains(&format!("smcr[{pid}]")) && l.contains("accept") && l.contains("): SMC-R")
        })
        .count();
    assert!(
        accepts >= 10,
        "the daemon (pid {pid}) accepted no SMC-R connections: {log}"
    );
}

/// A client that sends `SET` commands in RESP over one connection, prints its local port and
/// the bytes it sent and received, and keeps the connection open until its stdin closes.
const RESP_CLIENT: &str = r#"
import socket, sys
s = socket.create_connection(("127.0.0.2", int(sys.argv[1])))
sent = received = 0
for i in range(int(sys.argv[2])):
    key = b"key:%d" % i
    cmd = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$5\r\nvalue\r\n" % (len(key), key)
    s.sendall(cmd)
    sent += len(cmd)
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = s.recv(64)
        assert chunk, "server closed"
        reply += chunk
    assert reply == b"+OK\r\n", reply
    received += len(reply)
print(s.getsockname()[1], sent, received, flush=True)
sys.stdin.read()
"#;

/// Issue 6's acceptance test: redis-server under the shim with one SMC-R client (shimmed)
/// and one plain client: `smc-stat --json` shows one SMCR and one TCP row for the server with
/// the right reason, PIDs and byte counts (the TCP row's from the kernel), the client's own
/// row, the listener, and no row for the start-up probe that already closed; `--prometheus`
/// parses.
#[test]
fn smc_stat_shows_redis_smcr_and_tcp_clients() {
    if !have("redis-server") || !have("python3") {
        return;
    }
    if !common::root("a plain client next to an SMC-R one (the TCP option program)") {
        return;
    }
    use std::io::{BufRead, BufReader};
    let setup = Setup::new("smcstat", true);
    let port = 21000 + (std::process::id() % 1000) as u16;
    let server = setup.server(true, port);
    let client = |shim: bool, n: u32| {
        let mut c = setup
            .cmd(shim, "python3")
            .args(["-c", RESP_CLIENT, &port.to_string(), &n.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: Vec<u64> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(v.len(), 3, "client said {line:?}");
        (Server(c), v[0] as u16, v[1], v[2])
    };
    let (smc_client, smc_port, smc_sent, smc_received) = client(true, 200);
    let (_plain_client, plain_port, plain_sent, plain_received) = client(false, 70);
    let stat = |args: &[&str]| {
        let out = Command::new(common::bin("smc-stat"))
            .arg("--dir")
            .arg(setup.dir.join("stats"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "smc-stat {args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let redis_pid = server.0.id();
    // redis counts a reply once its write returned, which the client's read may precede by a
    // moment: read the stats until the server's rows have caught up (or 5 s passed).
    let caught_up = |doc: &serde_json::Value| {
        let sent: u64 = doc["connections"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["pid"] == redis_pid)
            .map(|c| c["bytes_sent"].as_u64().unwrap_or(0))
            .sum();
        sent == smc_received + plain_received
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let doc = loop {
        let doc: serde_json::Value = serde_json::from_str(&stat(&["--json"])).unwrap();
        if caught_up(&doc) || Instant::now() > deadline {
            break doc;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let rows: Vec<&serde_json::Value> = doc["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["pid"] == redis_pid)
        .collect();
    assert_eq!(
        rows.len(),
        2,
        "one SMCR and one TCP row (the probe closed): {doc}"
    );
    let by_peer = |p: u16| {
        rows.iter()
            .find(|c| c["peer"] == format!("127.0.0.1:{p}"))
            .unwrap_or_else(|| panic!("no row for peer port {p}: {doc}"))
    };
    let smc = by_peer(smc_port);
    assert_eq!(smc["mode"], "SMCR", "{smc}");
    assert_eq!(smc["command"], "redis-server");
    assert_eq!(smc["role"], "server");
    assert_eq!(smc["bytes_received"], smc_sent, "{smc}");
    assert_eq!(smc["bytes_sent"], smc_received, "{smc}");
    assert_eq!(smc["local"], format!("127.0.0.2:{port}"));
    let tcp = by_peer(plain_port);
    assert_eq!(tcp["mode"], "TCP", "{tcp}");
    assert_eq!(tcp["reason"], "PEERNOSMC", "{tcp}");
    assert_eq!(tcp["reason_code"], 0x0301_0000);
    assert_eq!(tcp["bytes_received"], plain_sent, "{tcp}");
    assert_eq!(tcp["bytes_sent"], plain_received, "{tcp}");
    assert!(tcp["fd"].is_u64(), "{tcp}");
    // The shimmed client's own row, under its pid.
    let mine: Vec<&serde_json::Value> = doc["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["pid"] == smc_client.0.id())
        .collect();
    assert_eq!(mine.len(), 1, "{doc}");
    assert_eq!(mine[0]["mode"], "SMCR");
    assert_eq!(mine[0]["role"], "client");
    assert_eq!(mine[0]["bytes_sent"], smc_sent);
    assert_eq!(mine[0]["local"], format!("127.0.0.1:{smc_port}"));
    assert!(mine[0]["stages_us"]["first_write"].is_u64(), "{doc}");
    let listeners = doc["listeners"].as_array().unwrap();
    assert!(
        listeners
            .iter()
            .any(|l| l["pid"] == redis_pid && l["local"] == format!("127.0.0.2:{port}")),
        "{doc}"
    );
    let redis = doc["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == redis_pid)
        .unwrap();
    assert_eq!(redis["totals"]["smcr_connections"], 1, "{redis}");
    // The start-up probe and the plain client.
    assert_eq!(redis["totals"]["tcp_connections"], 2, "{redis}");
    let table = stat(&[]);
    assert!(table.contains("PEERNOSMC 0x03010000"), "{table}");
    assert!(table.contains("redis-server"), "{table}");
    let prom = stat(&["--prometheus"]);
    let samples =
        smcr_tools::view::parse_prometheus(&prom).unwrap_or_else(|e| panic!("{e}\n{prom}"));
    assert!(
        samples.iter().any(|(n, l, v)| n == "smcr_fallbacks_total"
            && l.iter().any(|(k, x)| k == "reason" && x == "PEERNOSMC")
            && *v == 2.0),
        "{prom}"
    );
    if std::env::var_os("SMCR_SHOW").is_some() {
        eprintln!("{table}\n{}", stat(&["--links"]));
    }
    // A process killed without cleaning up: its area is recognised as stale and removed, its
    // rows are gone; the server's SMC-R row goes once its link group notices.
    let killed = smc_client.0.id();
    drop(smc_client); // SIGKILL
    let doc: serde_json::Value = serde_json::from_str(&stat(&["--json"])).unwrap();
    assert!(
        doc["processes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["pid"] != killed),
        "{doc}"
    );
    let areas: Vec<String> = std::fs::read_dir(setup.dir.join("stats"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !areas.iter().any(|a| a.starts_with(&format!("{killed}-"))),
        "{areas:?}"
    );
    assert!(
        areas
            .iter()
            .any(|a| a.starts_with(&format!("{redis_pid}-"))),
        "{areas:?}"
    );
}
