//! `bench smc`: `SmcStream` against `std::net::TcpStream` across a veth pair between two network
//! namespaces, in the same run: bulk throughput, 64-byte ping-pong (p50/p99) and connections per
//! second (connect + 1-byte echo + close). The server is a separate process in the second
//! namespace serving both kinds of stream; capability is signalled with the TCP option program,
//! installed under a private bpffs directory for the run. Needs root.

use anyhow::{Context, Result, bail, ensure};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use examples::netns::{CHUNK, Net, enter_netns, serve};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

const SMC_PORT: u16 = 7500;
const TCP_PORT: u16 = 7501;

fn runtime(dir: &std::path::Path) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: dir.to_path_buf(),
    };
    // Across a veth pair standing for two hosts: the RoCE path, not shared memory.
    cfg.same_host = false;
    // RMB size (default 64 KiB like Linux); BENCH_RMB_KIB overrides it for experiments.
    if let Some(k) = std::env::var("BENCH_RMB_KIB")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        cfg.rmb_size = k * 1024;
    }
    Runtime::new(cfg)
}

/// The server process: `bench --role smc-server NS BPF_DIR`.
pub fn server_role(ns: &str, dir: &str) -> Result<()> {
    enter_netns(ns)?;
    let rt = runtime(std::path::Path::new(dir));
    let ip = Ipv4Addr::new(10, 78, 0, 2);
    let smc = SmcListener::bind(&rt, (ip, SMC_PORT))?;
    let tcp = TcpListener::bind((ip, TCP_PORT))?;
    std::thread::spawn(move || {
        for s in tcp.incoming().flatten() {
            let _ = s.set_nodelay(true);
            std::thread::spawn(move || serve(s));
        }
    });
    println!("READY");
    std::io::stdout().flush()?;
    loop {
        let (s, _) = smc.accept()?;
        std::thread::spawn(move || serve(s));
    }
}

/// Either kind of stream, with the half-close the bulk run ends with.
trait Stream: Read + Write {
    fn shut_write(&mut self) -> std::io::Result<()>;
}
impl Stream for SmcStream {
    fn shut_write(&mut self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}
impl Stream for TcpStream {
    fn shut_write(&mut self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

fn open(rt: &Runtime, smc: bool, kind: u8) -> Result<Box<dyn Stream>> {
    let ip = Ipv4Addr::new(10, 78, 0, 2);
    let mut s: Box<dyn Stream> = if smc {
        let s = SmcStream::connect(rt, SocketAddr::from((ip, SMC_PORT)))?;
        ensure!(
            matches!(s.mode(), Mode::SmcR { .. }),
            "the smcr run did not use SMC-R: {:?}",
            s.mode()
        );
        Box::new(s)
    } else {
        let s = TcpStream::connect((ip, TCP_PORT))?;
        s.set_nodelay(true)?;
        Box::new(s)
    };
    s.write_all(&[kind])?;
    Ok(s)
}

fn throughput(rt: &Runtime, smc: bool, total: u64) -> Result<f64> {
    let mut s = open(rt, smc, b'B')?;
    let buf = vec![0x5au8; CHUNK];
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        s.write_all(&buf)?;
        sent += CHUNK as u64;
    }
    s.shut_write()?;
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let el = t.elapsed();
    ensure!(
        u64::from_le_bytes(n) == sent,
        "the sink counted other bytes"
    );
    Ok(sent as f64 * 8.0 / el.as_secs_f64() / 1e9)
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (p(0.5), p(0.99))
}

fn pingpong(rt: &Runtime, smc: bool, iters: usize) -> Result<(f64, f64)> {
    let mut s = open(rt, smc, b'P')?;
    let mut b = [7u8; 64];
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..iters + 500 {
        let t = Instant::now();
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
        if i >= 500 {
            rtts.push(t.elapsed());
        }
    }
    Ok(percentiles(rtts))
}

fn conns_per_sec(rt: &Runtime, smc: bool, n: usize) -> Result<f64> {
    let t = Instant::now();
    for _ in 0..n {
        let mut s = open(rt, smc, b'E')?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spawn_server(ns: &str, dir: &str) -> Result<Child> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--role", "smc-server", ns, dir])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("spawning the server process")?;
    let out = child.stdout.take().expect("piped");
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    ensure!(line.contains("READY"), "server did not start: {line:?}");
    Ok(child)
}

/// Runs the suite; prints a table and returns the JSON.
pub fn suite(quick: bool) -> Result<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("bench smc needs root (network namespaces, BPF)");
    }
    let dir = PathBuf::from(format!("/sys/fs/bpf/smcr-bench-{}", std::process::id()));
    smcr::option::install(&dir).context("installing the TCP option program")?;
    let result = (|| {
        let net = Net::new()?;
        let mut server = spawn_server(&net.b, &dir.to_string_lossy())?;
        let r = measure(&net, &dir, quick);
        let _ = server.kill();
        let _ = server.wait();
        r
    })();
    let _ = smcr::option::uninstall(&dir);
    result
}

fn measure(net: &Net, dir: &std::path::Path, quick: bool) -> Result<String> {
    let (bytes, runs, iters, conns) = if quick {
        (256u64 << 20, 3, 2000, 300)
    } else {
        (1u64 << 30, 5, 20000, 2000)
    };
    let (ns, dir) = (net.a.clone(), dir.to_path_buf());
    let h = std::thread::spawn(move || -> Result<[(f64, f64); 5]> {
        enter_netns(&ns)?;
        let rt = runtime(&dir);
        // First contact outside the measurements: the link group then exists, as it would
        // for an application past its first connection.
        conns_per_sec(&rt, true, 1)?;
        let (mut tt, mut st, mut tl, mut sl, mut tc, mut sc) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..runs {
            tt.push(throughput(&rt, false, bytes)?);
            st.push(throughput(&rt, true, bytes)?);
            tl.push(pingpong(&rt, false, iters)?);
            sl.push(pingpong(&rt, true, iters)?);
            tc.push(conns_per_sec(&rt, false, conns)?);
            sc.push(conns_per_sec(&rt, true, conns)?);
        }
        let p = |v: &Vec<(f64, f64)>, i: usize| {
            median(v.iter().map(|x| if i == 0 { x.0 } else { x.1 }).collect())
        };
        Ok([
            (median(tt), median(st)),
            (p(&tl, 0), p(&sl, 0)),
            (p(&tl, 1), p(&sl, 1)),
            (median(tc), median(sc)),
            (
                f64::from(rt.links_confirmed()),
                f64::from(rt.link_groups() as u32),
            ),
        ])
    });
    let [thr, p50, p99, cps, links] = h.join().expect("bench thread")?;
    eprintln!(
        "bench smc: {runs} runs, {} MiB bulk, {iters} ping-pongs, {conns} connections per run",
        bytes >> 20
    );
    println!(
        "{:<46} {:>12} {:>12} {:>8}",
        "metric (veth between two namespaces)", "TcpStream", "SmcStream", "ratio"
    );
    let row = |name: &str, (t, s): (f64, f64)| {
        println!("{name:<46} {t:>12.2} {s:>12.2} {:>7.2}x", s / t);
    };
    row("bulk throughput, 64 KiB writes (Gbit/s)", thr);
    row("ping-pong 64 B round trip p50 (us)", p50);
    row("ping-pong 64 B round trip p99 (us)", p99);
    row("connections/s (connect, 1 B echo, close)", cps);
    println!(
        "SMC-R link groups created by the client: {} (CONFIRM LINK exchanges: {})",
        links.1, links.0
    );
    let n = crate::app_bench::json_num;
    let doc = serde_json::json!({
        "suite": "smc",
        "runs": runs,
        "throughput_gbps": { "tcp": n(thr.0, 3), "smc": n(thr.1, 3) },
        "pingpong_us": {
            "tcp_p50": n(p50.0, 2), "smc_p50": n(p50.1, 2),
            "tcp_p99": n(p99.0, 2), "smc_p99": n(p99.1, 2),
        },
        "conns_per_sec": { "tcp": n(cps.0, 0), "smc": n(cps.1, 0) },
    });
    Ok(format!("{doc}\n"))
}
