//! `bench soak` (issue 8): redis under the shim, with random faults on the wire, for N minutes,
//! and a data-integrity check at the end.
//!
//! Across two network namespaces joined by veth (`Env`): redis-server under the shim in one,
//! every client (redis-cli, redis-benchmark) under the shim in the other.
//! 1. Loads a known data set through the shim (`redis-cli --pipe`): `--keys` keys `soak:<i>`
//!    whose values (1..4096 printable bytes) follow from `i` and the seed.
//! 2. Adds nftables rules on both veth ends: ingress drop of `--loss` percent, optionally egress
//!    duplication of `--dup` percent, of RoCE v2 packets (UDP 4791) or, with `--faults all`, of
//!    every IPv4 packet.
//! 3. Runs redis-benchmark (SET, GET, INCR, LPUSH, LPOP; 50 clients; `-P` 1 and 16, `-d` 64,
//!    1024 and 16384; keys that are not `soak:*`) in a loop until the time is up; every run must
//!    exit 0, finish every test and print no error. Meanwhile, every 10 s, a verifier reads back
//!    a random sample of the data set.
//! 4. Removes the faults, reads back every key and compares it byte for byte; checks DBSIZE, the
//!    number of `soak:*` keys, the server's error replies (INFO stats) and the server's stats
//!    area (every connection SMC-R, none fell back, no handshake failed — except, as the shim's
//!    log (`SMCR_LOG`) tells, ones a client abandoned by exiting mid-handshake, and setups
//!    whose first link did not come up under the faults and went on as TCP (TIMEOUT_CL;
//!    counted in the summary). A client
//!    that exits non-zero, hangs, or prints an error (redis-cli reconnects after a failed
//!    connection and says so on stderr) is an error too.
//!
//! With `--flap`, the namespaces are also joined by a second veth pair, every shimmed process
//! has an alternate address on it (`SMCR_ALT_ADDRS`: link groups get a second link), and the
//! first path is cut (every packet dropped) for 10 s every 30 s while redis-benchmark runs: the connections
//! move to the second link as the path flaps, and the groups heal (docs/failover.md); the
//! server's link failovers are counted (at least one).
//!
//! Prints a summary; fails on any error, mismatch or connection that was not SMC-R.
//! `--self-test-corrupt` overwrites one key (through the shim) before the final check, which
//! must then report it.

use crate::app_bench::{Bg, Env, Setup};
use anyhow::{Context, Result, bail, ensure};
use std::fmt::Write as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const SETUP: Setup = Setup::SmcrRemote;
/// A second address on each veth end for the verifier: it runs beside redis-benchmark, and two
/// processes on one address cannot both run an engine (UDP 4791; docs/limitations.md).
const VERIFY_CLIENT: &str = "10.78.1.1";
const VERIFY_SERVER: &str = "10.78.1.2";
/// `--flap`: the second path's addresses (each process that runs SMC-R on an address needs
/// its own alternate one): the clients', the verifier's, and the server's two.
const ALT_CLIENT: &str = "10.79.0.1";
const ALT_VERIFY_CLIENT: &str = "10.79.0.11";
const ALT_SERVER: &str = "10.79.0.2,10.79.0.12";
/// `--flap`: how long the first path stays up, then down, in each round.
const FLAP_UP: Duration = Duration::from_secs(20);
const FLAP_DOWN: Duration = Duration::from_secs(10);
const TESTS: [&str; 5] = ["SET", "GET", "INCR", "LPUSH", "LPOP"];
/// Longest value of the data set.
const MAX_VALUE: u64 = 4096;
/// Keys per MGET when reading the data set back.
const BATCH: usize = 500;
/// Longest a single client run may take before it counts as hung (and is killed).
const RUN_LIMIT: Duration = Duration::from_secs(180);
/// How often the verifier samples the data set during the soak, and how many keys.
const VERIFY_EVERY: Duration = Duration::from_secs(10);
const VERIFY_KEYS: usize = 200;
/// Target length of one redis-benchmark test (`-n` adapts to the measured rate).
const TEST_SECS: f64 = 1.5;
/// Bounds of `-n`: enough that all 50 clients of a test finish their handshakes before it
/// ends (see `app_bench::run`).
const MIN_N: u64 = 10_000;
const MAX_N: u64 = 2_000_000;

/// Which packets the faults hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Faults {
    /// RoCE v2 only (UDP destination port 4791): TCP (and so CLC) is spared.
    Roce,
    /// Every IPv4 packet on the veth, TCP included.
    All,
}

/// Options of `bench soak`.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long the benchmark loop runs.
    pub minutes: f64,
    /// Percent of packets dropped on ingress, each side.
    pub loss: f64,
    /// Percent of packets duplicated on egress, each side.
    pub dup: f64,
    /// Which packets.
    pub faults: Faults,
    /// Seeds the data set, the run order and the verifier's samples.
    pub seed: u64,
    /// Keys in the data set.
    pub keys: u32,
    /// Overwrite one key before the final check (which must then fail).
    pub corrupt: bool,
    /// Two paths; the first one flaps (see the module's description).
    pub flap: bool,
}

/// Usage of `bench soak`.
pub const USAGE: &str = "bench soak [--minutes N (5)] [--loss PCT (1)] [--dup PCT (0)] [--faults roce|all] [--seed N] [--keys N (100000)] [--flap]";

/// Parses the arguments after `soak`.
pub fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        minutes: 5.0,
        loss: 1.0,
        dup: 0.0,
        faults: Faults::Roce,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 % 1_000_000_000),
        keys: 100_000,
        corrupt: false,
        flap: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .with_context(|| format!("{a} needs a value; usage: {USAGE}"))
        };
        match a.as_str() {
            "--minutes" => o.minutes = val()?.parse().context("--minutes")?,
            "--loss" => o.loss = val()?.parse().context("--loss")?,
            "--dup" => o.dup = val()?.parse().context("--dup")?,
            "--seed" => o.seed = val()?.parse().context("--seed")?,
            "--keys" => o.keys = val()?.parse().context("--keys")?,
            "--faults" => {
                o.faults = match val()?.as_str() {
                    "roce" => Faults::Roce,
                    "all" => Faults::All,
                    f => bail!("--faults {f}: roce or all"),
                }
            }
            "--self-test-corrupt" => o.corrupt = true,
            "--flap" => o.flap = true,
            _ => bail!("unknown argument {a}; usage: {USAGE}"),
        }
    }
    ensure!(
        o.minutes.is_finite() && o.minutes >= 0.0,
        "--minutes must be a number ≥ 0"
    );
    ensure!(
        (0.0..=100.0).contains(&o.loss) && (0.0..=100.0).contains(&o.dup),
        "--loss and --dup are percentages"
    );
    ensure!(o.keys > 0, "--keys must be positive");
    Ok(o)
}

/// splitmix64.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small PRNG for the run order and samples.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// The value of key `soak:<i>`: 1..=4096 printable bytes, from `i` and the seed alone.
fn value(seed: u64, i: u32) -> Vec<u8> {
    let mut h = mix(seed ^ mix(u64::from(i)));
    let len = 1 + (h % MAX_VALUE) as usize;
    let mut v = Vec::with_capacity(len + 10);
    while v.len() < len {
        h = mix(h);
        v.extend((0..10).map(|k| ALPHABET[(h >> (6 * k)) as usize & 63]));
    }
    v.truncate(len);
    v
}

/// A client process under the shim, its stdin, stdout and stderr in files.
struct Run {
    child: Child,
    out: PathBuf,
    err: PathBuf,
    started: Instant,
}

/// What a finished [`Run`] did (`status` None: it hung and was killed).
struct Done {
    status: Option<ExitStatus>,
    stdout: Vec<u8>,
    stderr: String,
    secs: f64,
}

struct Soak<'a> {
    opt: &'a Options,
    env: &'a Env,
    log: PathBuf,
    addr: String,
    port: String,
    seq: u32,
    errors: Vec<String>,
    rng: Rng,
    verify_rounds: u32,
    verify_keys: u64,
    verify_mismatches: u64,
}

impl Soak<'_> {
    fn file(&mut self, what: &str) -> PathBuf {
        self.seq += 1;
        self.env.work.join(format!("soak-{}-{what}", self.seq))
    }

    fn error(&mut self, e: String) {
        eprintln!("  ERROR: {e}");
        self.errors.push(e);
    }

    /// Starts `prog args` on the client side, under the shim, connecting to the server at
    /// `host`, stdin from `input`.
    fn spawn(
        &mut self,
        prog: &str,
        host: &str,
        args: &[&str],
        input: Option<&Path>,
    ) -> Result<Run> {
        let (out, err) = (self.file("out"), self.file("err"));
        let stdin = match input {
            Some(p) => Stdio::from(File::open(p)?),
            None => Stdio::null(),
        };
        let mut cmd = self.env.cmd(SETUP, false, prog);
        if self.opt.flap {
            let alt = if host == VERIFY_SERVER {
                ALT_VERIFY_CLIENT
            } else {
                ALT_CLIENT
            };
            cmd.env("SMCR_ALT_ADDRS", alt);
        }
        let child = cmd
            .env("SMCR_LOG", &self.log)
            .args(["-h", host, "-p", &self.port])
            .args(args)
            .stdin(stdin)
            .stdout(File::create(&out)?)
            .stderr(File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting {prog}"))?;
        Ok(Run {
            child,
            out,
            err,
            started: Instant::now(),
        })
    }

    /// Waits for `r` (killing it after `limit`), calling `tick` meanwhile.
    fn wait(
        &mut self,
        mut r: Run,
        limit: Duration,
        mut tick: impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<Done> {
        let status = loop {
            if let Some(st) = r.child.try_wait()? {
                break Some(st);
            }
            if r.started.elapsed() > limit {
                // What the shim's stats areas say, for the report.
                let snap = smcr::view::Snapshot::collect(&self.env.stats, None);
                let keep = std::env::temp_dir().join(format!(
                    "smcr-soak-{}-hang-{}.json",
                    std::process::id(),
                    r.child.id()
                ));
                if std::fs::write(&keep, smcr::view::render_json(&snap)).is_ok() {
                    eprintln!("  hung: the stats areas are saved in {}", keep.display());
                }
                let _ = r.child.kill();
                let _ = r.child.wait();
                break None;
            }
            tick(self)?;
            std::thread::sleep(Duration::from_millis(50));
        };
        let d = Done {
            status,
            stdout: std::fs::read(&r.out)?,
            stderr: String::from_utf8_lossy(&std::fs::read(&r.err)?).into_owned(),
            secs: r.started.elapsed().as_secs_f64(),
        };
        let _ = std::fs::remove_file(&r.out);
        let _ = std::fs::remove_file(&r.err);
        Ok(d)
    }

    /// Runs a client to its end; an error (in the list) unless it exits 0 within the limit.
    fn client(
        &mut self,
        what: &str,
        host: &str,
        prog: &str,
        args: &[&str],
        input: Option<&Path>,
    ) -> Result<Option<Done>> {
        let r = self.spawn(prog, host, args, input)?;
        let d = self.wait(r, RUN_LIMIT, |_| Ok(()))?;
        match d.status {
            None => self.error(format!(
                "{what}: hung, killed after {:.0} s",
                RUN_LIMIT.as_secs_f64()
            )),
            Some(st) if !st.success() => {
                self.error(format!("{what}: {st}: {}", d.stderr.trim()));
            }
            Some(_) => {
                // redis-cli reports a failed connection here and carries on with a new one.
                let noise = ["All data transferred", "Last reply received"];
                let err: Vec<&str> = d
                    .stderr
                    .lines()
                    .filter(|l| !l.trim().is_empty() && !noise.iter().any(|n| l.starts_with(n)))
                    .collect();
                if !err.is_empty() {
                    self.error(format!("{what}: {}", err.join(" / ")));
                }
                return Ok(Some(d));
            }
        }
        Ok(None)
    }

    /// Reads `keys` back with MGETs (`redis-cli --raw`, connecting to `host`) and compares
    /// them; returns the mismatches (the first few) and their count (None: redis-cli failed,
    /// an error in the list).
    fn read_back(
        &mut self,
        what: &str,
        host: &str,
        keys: &[u32],
    ) -> Result<Option<(Vec<String>, u64)>> {
        let cmds = self.file("mget");
        {
            let mut f = std::io::BufWriter::new(File::create(&cmds)?);
            for chunk in keys.chunks(BATCH) {
                use std::io::Write;
                f.write_all(b"MGET")?;
                for k in chunk {
                    write!(f, " soak:{k}")?;
                }
                f.write_all(b"\n")?;
            }
        }
        let d = self.client(what, host, "redis-cli", &["--raw"], Some(&cmds))?;
        let _ = std::fs::remove_file(&cmds);
        let Some(d) = d else { return Ok(None) };
        let mut lines: Vec<&[u8]> = d.stdout.split(|b| *b == b'\n').collect();
        if lines.last() == Some(&&b""[..]) {
            lines.pop();
        }
        if lines.len() != keys.len() {
            self.error(format!(
                "{what}: {} lines for {} keys: {}",
                lines.len(),
                keys.len(),
                String::from_utf8_lossy(&d.stdout[..d.stdout.len().min(300)])
            ));
        }
        let mut bad = Vec::new();
        let mut n = 0;
        for (i, &k) in keys.iter().enumerate() {
            let got = lines.get(i).copied().unwrap_or_default();
            if got != value(self.opt.seed, k) {
                n += 1;
                if bad.len() < 5 {
                    bad.push(if got.is_empty() {
                        format!("soak:{k} missing")
                    } else {
                        format!(
                            "soak:{k} is {} bytes {:?}…, expected {} bytes",
                            got.len(),
                            String::from_utf8_lossy(&got[..got.len().min(24)]),
                            value(self.opt.seed, k).len()
                        )
                    });
                }
            }
        }
        Ok(Some((bad, n)))
    }

    /// One verifier round: a random sample of the data set.
    fn verify(&mut self) -> Result<()> {
        let keys: Vec<u32> = (0..VERIFY_KEYS)
            .map(|_| self.rng.below(u64::from(self.opt.keys)) as u32)
            .collect();
        let Some((bad, n)) = self.read_back("verifier", VERIFY_SERVER, &keys)? else {
            return Ok(());
        };
        self.verify_rounds += 1;
        self.verify_keys += keys.len() as u64;
        self.verify_mismatches += n;
        if n > 0 {
            self.error(format!(
                "verifier: {n} of {} keys wrong: {bad:?}",
                keys.len()
            ));
        }
        Ok(())
    }

    /// A command through redis-cli; its output (None: it failed, an error in the list).
    fn cli(&mut self, args: &[&str]) -> Result<Option<String>> {
        let what = format!("redis-cli {}", args.join(" "));
        let addr = self.addr.clone();
        let d = self.client(&what, &addr, "redis-cli", args, None)?;
        Ok(d.map(|d| String::from_utf8_lossy(&d.stdout).into_owned()))
    }
}

/// One redis-benchmark run's figures.
struct BenchRun {
    pipeline: u32,
    size: u32,
    end: f64,
    secs: f64,
    /// `-n`: requests per test.
    n: u64,
    /// Requests of the tests that finished.
    requests: u64,
    /// (index in [`TESTS`], requests/s) of each test that finished.
    rates: Vec<(usize, f64)>,
}

/// Requests/s of a set of tests, each with its `-n`: all their requests over all their time.
fn aggregate(tests: impl Iterator<Item = (u64, f64)>) -> Option<f64> {
    let (reqs, secs) = tests.fold((0.0, 0.0), |(q, t), (n, r)| {
        (q + n as f64, t + n as f64 / r)
    });
    (secs > 0.0).then(|| reqs / secs)
}

/// The nftables rules of one side.
fn nft_script(opt: &Options, dev: &str) -> String {
    let m = match opt.faults {
        Faults::Roce => "udp dport 4791",
        Faults::All => "meta protocol ip",
    };
    let pct = |p: f64| (p * 100.0).round() as u32; // numgen over 10000: hundredths of a percent
    let mut s = String::from("table netdev smcr_soak {\n");
    if opt.loss > 0.0 {
        let _ = writeln!(
            s,
            "  chain loss {{ type filter hook ingress device \"{dev}\" priority 0; {m} numgen random mod 10000 < {} counter drop; }}",
            pct(opt.loss)
        );
    }
    if opt.dup > 0.0 {
        // The copy leaves through the same device without passing the egress hook again.
        let _ = writeln!(
            s,
            "  chain copies {{ type filter hook egress device \"{dev}\" priority 0; {m} numgen random mod 10000 < {} counter dup to \"{dev}\"; }}",
            pct(opt.dup)
        );
    }
    s.push_str("}\n");
    s
}

fn nft(ns: &str, args: &[&str], input: Option<&str>) -> Result<String> {
    use std::io::Write;
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft")?;
    let mut stdin = c.stdin.take().context("nft stdin")?;
    if let Some(i) = input {
        stdin.write_all(i.as_bytes())?;
    }
    drop(stdin);
    let out = c.wait_with_output()?;
    ensure!(
        out.status.success(),
        "nft {args:?} in {ns}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        input.unwrap_or("")
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Packets the rules of one side dropped and duplicated (their counters).
fn nft_counts(ns: &str) -> Result<(u64, u64)> {
    let text = nft(ns, &["list", "table", "netdev", "smcr_soak"], None)?;
    let (mut dropped, mut duplicated) = (0, 0);
    for l in text.lines() {
        let n: u64 = l
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if l.trim_end().ends_with("drop") {
            dropped += n;
        } else if l.contains(" dup to ") {
            duplicated += n;
        }
    }
    Ok((dropped, duplicated))
}

/// Handshake failures in the shim's log (`SMCR_LOG`).
#[derive(Default)]
struct Failures {
    /// Reported to a client program.
    client: u64,
    /// On the server, because the client closed (or reset) the TCP connection during the CLC
    /// handshake: after a failure of its own (counted in `client`), or with none of its own:
    /// redis-benchmark exits once its last test's requests are done, even while some of that
    /// test's 50 connections are still negotiating (slow when the faults hit TCP too). The
    /// program never used them; the server drops them.
    abandoned: u64,
    /// The first few lines.
    lines: Vec<String>,
}

fn handshake_failures(log: &Path) -> Failures {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut f = Failures::default();
    for l in text.lines().filter(|l| l.contains("handshake failed")) {
        if l.contains(" connect ") {
            f.client += 1;
        } else if l.contains("closed during the CLC handshake")
            || l.contains("Connection reset by peer")
        {
            f.abandoned += 1;
            continue;
        }
        if f.lines.len() < 5 {
            f.lines.push(l.to_owned());
        }
    }
    f
}

/// Errors unless the tools are there.
fn check_tools() -> Result<()> {
    crate::app_bench::require_tools(&[
        "redis-server",
        "redis-cli",
        "redis-benchmark",
        "nft",
        "ip",
        "ss",
        "nsenter",
    ])
}

/// Runs the soak; prints the summary; errors if anything went wrong.
pub fn run(opt: &Options) -> Result<()> {
    check_tools()?;
    let env = Env::new(true, None)?;
    for (server, addr) in [(false, VERIFY_CLIENT), (true, VERIFY_SERVER)] {
        let (ns, dev) = env.veth(server).context("no namespaces")?;
        let st = Command::new("ip")
            .args(["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", &dev])
            .status()?;
        ensure!(st.success(), "adding {addr} to {dev}");
    }
    let work = env.work.to_string_lossy().into_owned();
    // Every shimmed process logs its handshakes here: how the failures are told apart.
    let log = env.work.join("smcr.log");
    if opt.flap {
        second_path(&env)?;
    }
    let (addr, port) = (env.server_addr(SETUP), env.port());
    let mut server_cmd = env.cmd(SETUP, true, "redis-server");
    if opt.flap {
        server_cmd.env("SMCR_ALT_ADDRS", ALT_SERVER);
    }
    let server = Bg(server_cmd
        .env("SMCR_LOG", &log)
        .args(["--bind", addr, VERIFY_SERVER, "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
        .args(["--dir", &work])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?);
    env.wait_listening(SETUP, port)?;
    let mut s = Soak {
        opt,
        env: &env,
        log: log.clone(),
        addr: addr.into(),
        port: port.to_string(),
        seq: 0,
        errors: Vec::new(),
        rng: Rng(mix(opt.seed ^ 0x50a4)),
        verify_rounds: 0,
        verify_keys: 0,
        verify_mismatches: 0,
    };
    let faults = match opt.faults {
        Faults::Roce => "RoCE (UDP 4791)",
        Faults::All => "all IPv4",
    };
    eprintln!(
        "soak: seed {}, {} keys, {} min, faults on {faults} packets: {}% loss, {}% duplication, each side",
        opt.seed, opt.keys, opt.minutes, opt.loss, opt.dup
    );

    // 1. The data set, through the shim.
    let t = Instant::now();
    let resp = s.file("load");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(File::create(&resp)?);
        for i in 0..opt.keys {
            let k = format!("soak:{i}");
            let v = value(opt.seed, i);
            write!(
                f,
                "*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n${}\r\n",
                k.len(),
                v.len()
            )?;
            f.write_all(&v)?;
            f.write_all(b"\r\n")?;
        }
    }
    let bytes = std::fs::metadata(&resp)?.len();
    let load = s.client(
        "load (redis-cli --pipe)",
        addr,
        "redis-cli",
        &["--pipe"],
        Some(&resp),
    )?;
    let _ = std::fs::remove_file(&resp);
    let load = load.context("loading the data set failed")?;
    let out = String::from_utf8_lossy(&load.stdout);
    let want = format!("errors: 0, replies: {}", opt.keys);
    ensure!(
        out.contains(&want),
        "loading the data set: expected \"{want}\" from redis-cli --pipe, got: {out}{}",
        load.stderr
    );
    eprintln!(
        "loaded {} keys ({:.0} MiB of commands) in {:.1} s",
        opt.keys,
        bytes as f64 / (1 << 20) as f64,
        t.elapsed().as_secs_f64()
    );

    // 2. The faults.
    let sides = [env.veth(false), env.veth(true)];
    let sides: Vec<(String, String)> = sides
        .into_iter()
        .map(|v| v.map(|(ns, dev)| (ns.to_owned(), dev)))
        .collect::<Option<_>>()
        .context("no namespaces")?;
    let faulty = opt.loss > 0.0 || opt.dup > 0.0;
    if faulty {
        for (ns, dev) in &sides {
            nft(ns, &["-f", "-"], Some(&nft_script(opt, dev)))?;
        }
    }

    // 3. redis-benchmark in a loop, the verifier beside it.
    let mut combos: Vec<(u32, u32)> = [1u32, 16]
        .into_iter()
        .flat_map(|p| [64u32, 1024, 16384].map(|d| (p, d)))
        .collect();
    for i in (1..combos.len()).rev() {
        let j = s.rng.below(i as u64 + 1) as usize;
        combos.swap(i, j);
    }
    // -n per combination, adapted to the rate measured in its previous run.
    let mut n: Vec<u64> = combos
        .iter()
        .map(|&(p, d)| match (p, d) {
            (16, 16384) => 20_000,
            (16, _) => 200_000,
            (_, 16384) => 10_000,
            _ => 50_000,
        })
        .collect();
    let soak_start = Instant::now();
    let deadline = soak_start + Duration::from_secs_f64(opt.minutes * 60.0);
    let flapper = opt.flap.then(|| Flapper::start(sides.clone()));
    let mut next_verify = soak_start;
    let mut runs: Vec<BenchRun> = Vec::new();
    let mut failed_runs = 0u32;
    let mut k = 0usize;
    while Instant::now() < deadline {
        let c = k % combos.len();
        k += 1;
        let (p, d) = combos[c];
        let (ps, ds, ns) = (p.to_string(), d.to_string(), n[c].to_string());
        let args = [
            "-q",
            "-c",
            "50",
            "-r",
            "100000",
            "-t",
            "set,get,incr,lpush,lpop",
            "-P",
            &ps,
            "-d",
            &ds,
            "-n",
            &ns,
        ];
        let addr = s.addr.clone();
        let r = s.spawn("redis-benchmark", &addr, &args, None)?;
        let done = s.wait(r, RUN_LIMIT, |s| {
            if Instant::now() >= next_verify {
                next_verify = Instant::now() + VERIFY_EVERY;
                s.verify()?;
            }
            Ok(())
        })?;
        let what = format!("redis-benchmark -P {p} -d {d} -n {ns}");
        let out = String::from_utf8_lossy(&done.stdout).into_owned();
        let mut rates = Vec::new();
        let mut bad: Vec<String> = Vec::new();
        for l in out.split(['\r', '\n']) {
            let l = l.trim();
            if l.contains("rror") || l.contains("ERR") || l.starts_with("WARN") {
                bad.push(l.to_owned());
            } else if let Some((t, rest)) = l.split_once(": ")
                && let Some(i) = TESTS.iter().position(|x| *x == t)
                && rest.contains("requests per second")
                && let Some(r) = rest.split_whitespace().next().and_then(|r| r.parse().ok())
                && r > 0.0
            {
                rates.push((i, r));
            }
        }
        bad.extend(
            done.stderr
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
        bad.dedup();
        let ok = match done.status {
            None => {
                let last = out.split(['\r', '\n']).rfind(|l| !l.trim().is_empty());
                s.error(format!(
                    "{what}: hung, killed after {:.0} s; last output {:?}; stderr {:?}",
                    RUN_LIMIT.as_secs_f64(),
                    last.unwrap_or("").trim(),
                    done.stderr.trim()
                ));
                false
            }
            Some(st) if !st.success() => {
                s.error(format!("{what}: {st}: {:?}", &bad[..bad.len().min(5)]));
                false
            }
            Some(_) if !bad.is_empty() => {
                s.error(format!("{what}: {:?}", &bad[..bad.len().min(5)]));
                false
            }
            Some(_) if rates.len() != TESTS.len() => {
                s.error(format!(
                    "{what}: {} of {} tests reported a rate",
                    rates.len(),
                    TESTS.len()
                ));
                false
            }
            Some(_) => true,
        };
        if !ok {
            failed_runs += 1;
        }
        let requests = n[c] * rates.len() as u64;
        let end = soak_start.elapsed().as_secs_f64();
        eprintln!(
            "  {end:>6.1} s  -P {p:<2} -d {d:<5} -n {ns:<7} {:>5.1} s  {}{}",
            done.secs,
            rates
                .iter()
                .map(|&(i, r)| format!("{} {r:.0}", TESTS[i]))
                .collect::<Vec<_>>()
                .join("  "),
            if ok { "" } else { "  FAILED" }
        );
        let this_n = n[c];
        if let Some(r) = aggregate(rates.iter().map(|&(_, r)| (this_n, r))) {
            n[c] = ((r * TEST_SECS) as u64).clamp(MIN_N, MAX_N);
        }
        runs.push(BenchRun {
            pipeline: p,
            size: d,
            end,
            secs: done.secs,
            n: this_n,
            requests,
            rates,
        });
    }
    let soak_secs = soak_start.elapsed().as_secs_f64();
    // The first path up again for good.
    let flaps = match flapper {
        Some(f) => f.stop()?,
        None => 0,
    };

    // 4. Faults off, then the final checks.
    let mut dropped = [0u64; 2];
    let mut duplicated = 0;
    if faulty {
        for (i, (ns, _)) in sides.iter().enumerate() {
            let (d, u) = nft_counts(ns)?;
            dropped[i] = d;
            duplicated += u;
            nft(ns, &["delete", "table", "netdev", "smcr_soak"], None)?;
        }
    }
    let wrong = s.rng.below(u64::from(opt.keys)) as u32;
    if opt.corrupt {
        eprintln!("self-test: overwriting soak:{wrong}; the final check must report it");
        let key = format!("soak:{wrong}");
        s.cli(&["SET", &key, "corrupted-by-self-test"])?;
    }
    let t = Instant::now();
    let all: Vec<u32> = (0..opt.keys).collect();
    let final_check = match s.read_back("final read-back", addr, &all)? {
        Some((bad, n)) => {
            if n > 0 {
                s.error(format!(
                    "final read-back: {n} of {} keys wrong: {bad:?}",
                    opt.keys
                ));
            }
            format!("{} keys, {n} wrong", opt.keys)
        }
        None => "FAILED (redis-cli)".into(),
    };
    eprintln!(
        "final read-back: {final_check} ({:.1} s)",
        t.elapsed().as_secs_f64()
    );
    let dbsize = s
        .cli(&["DBSIZE"])?
        .and_then(|d| d.trim().parse::<u64>().ok());
    let soak_keys = s
        .cli(&["--scan", "--pattern", "soak:*"])?
        .map(|k| k.lines().collect::<std::collections::HashSet<_>>().len() as u64);
    if soak_keys != Some(u64::from(opt.keys)) || dbsize < soak_keys {
        s.error(format!(
            "DBSIZE {dbsize:?}, soak:* keys {soak_keys:?}, expected {} soak:* keys",
            opt.keys
        ));
    }
    let error_replies = s.cli(&["INFO", "stats"])?.and_then(|i| {
        i.lines().find_map(|l| {
            l.strip_prefix("total_error_replies:")?
                .trim()
                .parse::<u64>()
                .ok()
        })
    });
    if error_replies != Some(0) {
        let errstats = s.cli(&["INFO", "errorstats"])?.unwrap_or_default();
        s.error(format!(
            "the server sent {error_replies:?} error replies: {}",
            errstats.trim()
        ));
    }
    // The server's stats area: every connection (from every client) SMC-R.
    let snap = smcr::view::Snapshot::collect(&env.stats, Some(server.0.id()));
    let p = snap.procs.first().context("the server has no stats area")?;
    use smcr::stats::total;
    let (smcr_conns, tcp_conns, failed_conns) = (
        p.totals[total::SMCR],
        p.totals[total::TCP],
        p.totals[total::FAILED],
    );
    let failovers = p.totals[total::LINK_FAILOVERS];
    // A flap while no data flows (between runs) may pass unnoticed by the server's links.
    if flaps > 0 && failovers == 0 {
        s.error(format!(
            "the first path was cut {flaps} times, the server never failed over"
        ));
    }
    let fallbacks: Vec<String> = p
        .fallbacks
        .iter()
        .map(|&(c, n)| format!("{} {n}", smcr::stats::reason(c).0))
        .collect();
    // Setups whose first link did not come up under the faults (or while the first path was
    // down) go on as TCP (TIMEOUT_CL): allowed, counted and shown, their data checked like
    // any other. Any other fallback is an error.
    let timed_out: u64 = p
        .fallbacks
        .iter()
        .filter(|(c, _)| (opt.loss > 0.0 || opt.flap) && *c == smcr::DeclineReason::TIMEOUT_CL.0)
        .map(|&(_, n)| n)
        .sum();
    drop(server);
    let hf = handshake_failures(&log);
    if smcr_conns == 0 || tcp_conns > timed_out || failed_conns > hf.abandoned || hf.client > 0 {
        s.error(format!(
            "not all over SMC-R: the server counted {smcr_conns} SMC-R, {tcp_conns} TCP (fallbacks {fallbacks:?}), {failed_conns} failed handshakes on the server ({} closed by the client mid-handshake), {} on the client side; the log says: {:?}",
            hf.abandoned, hf.client, hf.lines
        ));
    }

    // The summary.
    let requests: u64 = runs.iter().map(|r| r.requests).sum();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nreq/s over time (redis-benchmark requests; a run's spread evenly over its time):"
    );
    let window = (soak_secs / 10.0).max(10.0).ceil();
    let mut w0 = 0.0;
    while w0 < soak_secs {
        let w1 = (w0 + window).min(soak_secs);
        let reqs: f64 = runs
            .iter()
            .map(|r| {
                let overlap = r.end.min(w1) - (r.end - r.secs).max(w0);
                r.requests as f64 * overlap.max(0.0) / r.secs.max(1e-9)
            })
            .sum();
        let _ = writeln!(
            o,
            "  {w0:>6.0}..{w1:>4.0} s  {reqs:>9.0} requests  {:>8.0} req/s",
            reqs / (w1 - w0).max(1e-9)
        );
        w0 += window;
    }
    let _ = write!(
        o,
        "by workload (redis-benchmark's own rates, req/s):\n  {:<15} {:>4} {:>10} {:>8}",
        "", "runs", "requests", "all"
    );
    for t in TESTS {
        let _ = write!(o, " {t:>7}");
    }
    o.push('\n');
    for &(p, d) in &combos {
        let rs: Vec<&BenchRun> = runs
            .iter()
            .filter(|r| r.pipeline == p && r.size == d)
            .collect();
        let rate = |test: Option<usize>| {
            aggregate(rs.iter().flat_map(|r| {
                r.rates
                    .iter()
                    .filter(move |(i, _)| test.is_none_or(|t| t == *i))
                    .map(|&(_, rate)| (r.n, rate))
            }))
            .map_or("-".into(), |r| format!("{r:.0}"))
        };
        if rs.is_empty() {
            continue;
        }
        let _ = write!(
            o,
            "  -P {p:<2} -d {d:<5}   {:>4} {:>10} {:>8}",
            rs.len(),
            rs.iter().map(|r| r.requests).sum::<u64>(),
            rate(None)
        );
        for i in 0..TESTS.len() {
            let _ = write!(o, " {:>7}", rate(Some(i)));
        }
        o.push('\n');
    }
    if opt.loss > 0.0 && dropped[0] + dropped[1] == 0 {
        s.error("the faults dropped nothing".into());
    }
    let pass = s.errors.is_empty();
    let row = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{k:<28} {v}");
    };
    let _ = writeln!(o, "\nsoak summary");
    row(&mut o, "seed", opt.seed.to_string());
    row(
        &mut o,
        "faults",
        format!(
            "{faults} packets, {}% loss, {}% duplication, each side",
            opt.loss, opt.dup
        ),
    );
    row(
        &mut o,
        "soak time",
        format!("{:.1} min ({soak_secs:.0} s)", soak_secs / 60.0),
    );
    row(
        &mut o,
        "packets dropped",
        format!(
            "{} (client side {}, server side {})",
            dropped[0] + dropped[1],
            dropped[0],
            dropped[1]
        ),
    );
    row(&mut o, "packets duplicated", duplicated.to_string());
    if opt.flap {
        row(
            &mut o,
            "first path cut",
            format!(
                "{flaps} times for {} s; server link failovers {failovers}",
                FLAP_DOWN.as_secs()
            ),
        );
    }
    row(
        &mut o,
        "redis-benchmark runs",
        format!("{} ({failed_runs} failed)", runs.len()),
    );
    row(&mut o, "requests completed", requests.to_string());
    row(
        &mut o,
        "req/s (soak average)",
        format!("{:.0}", requests as f64 / soak_secs.max(1e-9)),
    );
    row(
        &mut o,
        "verifier",
        format!(
            "{} rounds, {} keys, {} wrong",
            s.verify_rounds, s.verify_keys, s.verify_mismatches
        ),
    );
    let opt_num = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
    row(&mut o, "final read-back", final_check);
    row(
        &mut o,
        "DBSIZE",
        format!("{} ({} soak:* keys)", opt_num(dbsize), opt_num(soak_keys)),
    );
    row(&mut o, "server error replies", opt_num(error_replies));
    row(
        &mut o,
        "server connections",
        format!("{smcr_conns} SMC-R, {tcp_conns} TCP (fallbacks {fallbacks:?})"),
    );
    row(
        &mut o,
        "failed handshakes",
        format!(
            "server {failed_conns} ({} closed by the client mid-handshake), client {}",
            hf.abandoned, hf.client
        ),
    );
    row(&mut o, "errors", s.errors.len().to_string());
    row(&mut o, "result", if pass { "PASS" } else { "FAIL" }.into());
    print!("{o}");
    if !pass {
        let keep = std::env::temp_dir().join(format!("smcr-soak-{}.log", std::process::id()));
        if std::fs::copy(&log, &keep).is_ok() {
            eprintln!("the shim's log (SMCR_LOG) is kept in {}", keep.display());
        }
        eprintln!("errors:");
        for e in s.errors.iter().take(20) {
            eprintln!("  {e}");
        }
        bail!("soak failed: {} errors", s.errors.len());
    }
    Ok(())
}

/// `--flap`: joins the namespaces by a second veth pair (10.79.0.0/24) with the alternate
/// addresses on it.
fn second_path(env: &Env) -> Result<()> {
    let (ns_a, _) = env.veth(false).context("no namespaces")?;
    let (ns_b, _) = env.veth(true).context("no namespaces")?;
    let pid = std::process::id();
    let (va, vb) = (format!("sb{pid}c"), format!("sb{pid}d"));
    let ip = |args: &[&str]| -> Result<()> {
        let st = Command::new("ip").args(args).status()?;
        ensure!(st.success(), "ip {args:?} failed");
        Ok(())
    };
    ip(&[
        "link", "add", &va, "netns", ns_a, "type", "veth", "peer", "name", &vb, "netns", ns_b,
    ])?;
    let a_addrs = [ALT_CLIENT, ALT_VERIFY_CLIENT];
    let b_addrs: Vec<&str> = ALT_SERVER.split(',').collect();
    for (ns, dev, addrs) in [(ns_a, &va, &a_addrs[..]), (ns_b, &vb, &b_addrs[..])] {
        for a in addrs {
            ip(&["-n", ns, "addr", "add", &format!("{a}/24"), "dev", dev])?;
        }
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    Ok(())
}

/// `--flap`: cuts the first path for [`FLAP_DOWN`] after every [`FLAP_UP`], on a thread of its
/// own, until stopped. Cut means every packet dropped at both ends (nftables, ingress), as a
/// dead switch or cable would: taking the interface down would also remove its routes, and
/// new TCP connections would fail at once (ENETUNREACH) instead of waiting.
struct Flapper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Result<u64>>,
}

impl Flapper {
    fn start(sides: Vec<(String, String)>) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || -> Result<u64> {
                let set = |up: bool| -> Result<()> {
                    for (ns, dev) in &sides {
                        if up {
                            nft(ns, &["delete", "table", "netdev", "smcr_flap"], None)?;
                        } else {
                            let script = format!(
                                "table netdev smcr_flap {{\n  chain cut {{ type filter hook ingress device \"{dev}\" priority -10; counter drop; }}\n}}\n"
                            );
                            nft(ns, &["-f", "-"], Some(&script))?;
                        }
                    }
                    Ok(())
                };
                // Sleeps `d` unless stopped first; true when stopped.
                let pause = |d: Duration| {
                    let until = Instant::now() + d;
                    while Instant::now() < until {
                        if stop.load(Ordering::Relaxed) {
                            return true;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    stop.load(Ordering::Relaxed)
                };
                let mut flaps = 0;
                while !pause(FLAP_UP) {
                    set(false)?;
                    flaps += 1;
                    eprintln!(
                        "  flap {flaps}: first path cut for {} s",
                        FLAP_DOWN.as_secs()
                    );
                    let stopped = pause(FLAP_DOWN);
                    set(true)?;
                    if stopped {
                        break;
                    }
                }
                Ok(flaps)
            })
        };
        Self { stop, thread }
    }

    /// Stops flapping with the path up; returns how many times it went down.
    fn stop(self) -> Result<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the flapper panicked"))?
    }
}
