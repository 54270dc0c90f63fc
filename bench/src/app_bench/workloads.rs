//! The workloads: redis-benchmark, sockperf, iperf3, connections, memory and idle CPU, and
//! the helper roles the bench binary runs (echo server, connect loop, holder).

#[allow(unused_imports)]
use super::*;

/// The machine's busy CPU time so far, in seconds: user, nice, system, irq and softirq of
/// `/proc/stat` — both programs and the kernel's work for them (packets, wake-ups), which a
/// process's own times miss; nothing else runs during a bench. 10 ms resolution.
pub(super) fn busy_secs() -> f64 {
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
pub(super) fn redis(
    env: &Env,
    s: Setup,
    pipeline: u32,
    size: u32,
    n: u32,
) -> Result<(f64, f64, f64)> {
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
pub(super) fn sockperf(env: &Env, s: Setup, size: u32, secs: u32) -> Result<(f64, f64)> {
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
pub(super) fn iperf3(env: &Env, s: Setup, secs: u32) -> Result<(f64, f64)> {
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
pub(super) fn conn_rate(env: &Env, s: Setup, secs: u32) -> Result<f64> {
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
pub(super) fn rss_kib(pid: u32) -> Result<f64> {
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
pub(super) fn cpu_ns(pid: u32) -> Result<std::collections::HashMap<u32, u64>> {
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
pub(super) fn cpu_ms_between(
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
pub(super) fn memory_and_idle(
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
pub(super) fn listens(table: &str, port: u16) -> bool {
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
