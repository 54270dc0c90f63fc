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

mod load;
mod net;
#[allow(unused_imports)]
use {load::*, net::*};

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
    let snap = smcr_tools::view::Snapshot::collect(&env.stats, Some(server.0.id()));
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
