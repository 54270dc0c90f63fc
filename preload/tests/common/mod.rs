//! Shared by the preload crate's end-to-end tests: the library and launcher under test, tool
//! checks, a shimmed-process environment, and two network namespaces joined by a veth pair.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The path of `tests/py/NAME`, a Python program of the end-to-end tests.
pub fn py_script(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// The library `cargo test` just built (next to the test binary; the copy one directory up is
/// only refreshed by `cargo build`).
pub fn lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libsmcr_preload.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

/// The `smcr` launcher of the same profile, built if this run did not build it.
pub fn smcr_bin() -> PathBuf {
    bin("smcr")
}

/// A binary of the smcr package (`smcr`, `smc-stat`) of the same profile, built if this run
/// did not build it.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let bin = profile_dir.join(name);
    let profile = profile_dir.file_name().unwrap().to_str().unwrap();
    let profile = if profile == "debug" { "dev" } else { profile };
    let st = Command::new(env!("CARGO"))
        .args([
            "build",
            "-q",
            "--profile",
            profile,
            "-p",
            "smcr-tools",
            "--bin",
            name,
        ])
        .status()
        .unwrap();
    assert!(st.success(), "building {name} failed");
    bin
}

/// Builds `tests/c/<name>.c` with `flags`; `None` (skip) without a C compiler, which CI
/// (SMCR_REQUIRE_TOOLS=1) does not accept.
pub fn build_c(name: &str, flags: &[&str]) -> Option<PathBuf> {
    let ok = Command::new("cc")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "cc missing (scripts/setup.sh installs gcc)"
        );
        eprintln!("SKIP: no C compiler");
        return None;
    }
    // Once per test process and program: tests run in parallel, and one compiling over the
    // binary another is starting makes that exec fail (ETXTBSY). Written aside and renamed,
    // so a path handed out is always a finished binary.
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let key = format!("{name} {}", flags.join(" "));
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, bin)) = built.iter().find(|(k, _)| *k == key) {
        return Some(bin.clone());
    }
    let bin = std::env::temp_dir().join(format!(
        "smcr-{name}-{}-{}",
        std::process::id(),
        built.len()
    ));
    let part = bin.with_extension("part");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let st = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&part)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "building {name}.c failed");
    std::fs::rename(&part, &bin).unwrap();
    built.push((key, bin.clone()));
    Some(bin)
}

/// Whether `tool` is installed; with SMCR_REQUIRE_TOOLS=1 (CI as root) a missing tool fails.
pub fn have(tool: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "{tool} missing (scripts/setup.sh installs it)"
        );
        eprintln!("SKIP: {tool} is not installed (scripts/setup.sh installs it)");
    }
    ok
}

/// Root, or a skip message (a failure under SMCR_REQUIRE_TOOLS=1).
pub fn root(why: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let ok = unsafe { libc::geteuid() } == 0;
    if !ok {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "{why} needs root"
        );
        eprintln!("SKIP: {why} needs root");
    }
    ok
}

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A TCP port for this test process (`base` + a slice of 64 per process). The slice must hold
/// every port the process's tests take at once: with 16, a binary whose parallel tests took
/// more got one port twice (a server that could not listen).
pub fn port(base: u16) -> u16 {
    loop {
        let n = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
        assert!(
            n < 64,
            "more than 64 ports in one test process: widen port()'s slice"
        );
        let p = base + (std::process::id() % 100) as u16 * 64 + n;
        // A port some socket of this host holds now (another test's client, whose
        // ephemeral port it may be) would make the server fail to bind: skip it.
        if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
            return p;
        }
    }
}

/// Environment of shimmed processes: both ends shimmed (`assume`), a log, an engine UDP port.
pub struct Shim {
    pub log: PathBuf,
    pub roce_port: u16,
    pub dir: PathBuf,
}

impl Shim {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("smcr-e2e-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            log: dir.join("smcr.log"),
            roce_port: 32000 + port(0) % 30000,
            dir,
        }
    }

    /// `prog` with (or without) the shim.
    pub fn cmd(&self, shim: bool, prog: &str) -> Command {
        let mut c = Command::new(prog);
        if shim {
            self.apply(&mut c);
        }
        c
    }

    /// Puts the shim's environment on `c`.
    pub fn apply(&self, c: &mut Command) {
        c.env("LD_PRELOAD", lib())
            .env("SMCR_LOG", &self.log)
            .env("SMCR_NEGOTIATION", "assume")
            .env("SMCR_ROCE_PORT", self.roce_port.to_string())
            // A configuration file of the machine (/etc/smcr.toml) stays out of the tests.
            .env("SMCR_CONFIG", "off");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Log lines of SMC-R connections of one kind (`connect` or `accept`).
    pub fn smcr_count(&self, what: &str) -> usize {
        self.log()
            .lines()
            .filter(|l| l.contains(what) && l.contains("): SMC-R"))
            .count()
    }
}

impl Drop for Shim {
    fn drop(&mut self) {
        if std::env::var_os("SMCR_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A child killed however the test ends.
pub struct Bg(pub Child);

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something accepts TCP connections at `addr:port` (inside `netns`, if given).
pub fn wait_listening(netns: Option<&str>, addr: &str, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // `ss` rather than a probe connection: a probe would be a connection of its own.
        let mut c = match netns {
            Some(ns) => NetPair::cmd(ns, "ss"),
            None => Command::new("ss"),
        };
        let out = c
            .args(["-ltnH", &format!("( sport = :{port} )")])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout).contains(&format!("{addr}:{port}")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "nothing listens on {addr}:{port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

static NEXT_NS: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces joined by a veth pair (10.79.0.1 in `a`, 10.79.0.2 in `b`); deleted
/// on drop.
pub struct NetPair {
    pub a: String,
    pub b: String,
}

impl NetPair {
    pub const ADDR_A: &str = "10.79.0.1";
    pub const ADDR_B: &str = "10.79.0.2";

    pub fn new() -> Self {
        let n = NEXT_NS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let p = Self {
            a: format!("smcr-pl-{pid}-{n}-a"),
            b: format!("smcr-pl-{pid}-{n}-b"),
        };
        let (va, vb) = (format!("p{pid}a{n}"), format!("p{pid}b{n}"));
        let ip = |args: &[&str]| {
            let st = Command::new("ip").args(args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["netns", "add", &p.a]);
        ip(&["netns", "add", &p.b]);
        ip(&[
            "link", "add", &va, "netns", &p.a, "type", "veth", "peer", "name", &vb, "netns", &p.b,
        ]);
        for (ns, dev, addr) in [(&p.a, &va, Self::ADDR_A), (&p.b, &vb, Self::ADDR_B)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        p
    }

    /// `prog` inside namespace `ns`.
    pub fn cmd(ns: &str, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, prog]);
        c
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Asserts that the shim's log shows exactly `n` connects and `n` accepts, all SMC-R.
pub fn assert_all_smcr(log: &str, n: usize) {
    for what in ["connect", "accept"] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!(" {what} Some(")))
            .collect();
        assert!(
            lines.iter().all(|l| l.contains("): SMC-R")),
            "a {what} was not SMC-R:\n{log}"
        );
        assert_eq!(lines.len(), n, "expected {n} SMC-R {what}s:\n{log}");
    }
}

/// Asserts that the shim's log shows exactly `n` connects and `n` accepts that were SMC-R, and
/// that any other connect was closed by the application before it was settled (a connection
/// never used is never negotiated on its server's side: docs/architecture.md).
pub fn assert_smcr_settled(log: &str, n: usize) {
    for what in ["connect", "accept"] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!(" {what} Some(")))
            .collect();
        let smcr = lines.iter().filter(|l| l.contains("): SMC-R")).count();
        assert!(
            lines
                .iter()
                .all(|l| l.contains("): SMC-R") || l.contains("closed before it was settled")),
            "a {what} was neither SMC-R nor closed unused:\n{log}"
        );
        assert_eq!(smcr, n, "expected {n} SMC-R {what}s:\n{log}");
    }
}

/// Text of a finished command, asserting success.
pub fn run_ok(c: &mut Command, what: &str) -> String {
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed: {text}");
    text
}
