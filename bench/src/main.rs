//! `bench apps [--quick|--smoke] [--only SETUPS] [--workloads W,..] [--mtu N] [--json FILE]
//! [--svg FILE]` (root): real programs
//! (redis-benchmark, sockperf, iperf3, a connect+echo+close loop) over plain TCP, smcr on one
//! host, both across two namespaces (joined by a veth of MTU `N`, default 1500), and smcr
//! fallback, with ratios (see `smcr_bench::app_bench`).
//!
//! `bench soak [--minutes N] [--loss PCT] [--dup PCT] [--faults roce|all] [--seed N] [--keys N]`
//! (root): redis-benchmark under the shim with random faults on the wire for N minutes, then a
//! check of every key of a known data set (see `smcr_bench::soak`).
//!
//! `bench xdp [--quick] [--rounds N] [--iters N] [--secs S] [--cpus A,B] [--only V,..]
//! [--sizes N,..]` (root):
//! issue 27's probe — AF_XDP against kernel UDP sockets (and TCP) across a veth pair, ping-pong
//! latency and one-way throughput (see `smcr_bench::xdp_bench`).
//!
//! `bench smc [--quick] [--json FILE]`: SmcStream against TcpStream across a veth pair (see
//! `smcr_bench::smc_bench`).
//!
//! `bench rdma [--quick] [--json FILE]`: the rdma engine against kernel TCP on loopback, measured
//! in the same run, in separate processes as a real application would use them:
//! * throughput: 64 KiB RDMA WRITEs on one QP (each announced by a SEND, flow-controlled by
//!   credits, like SMC-R) against 64 KiB `write()`s on a TCP socket;
//! * latency: 64-byte SEND ping-pong against 64-byte TCP ping-pong (round-trip p50/p99).
//!
//! Each figure is the median of several runs; ratios are smcr / TCP.

use anyhow::{Context, Result, bail, ensure};
use examples::peer::{Conn, Options, run_ping, run_pong, run_sink, run_source};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CHUNK: usize = 64 << 10;

fn spawn(role: &str, addr: &str) -> Result<Child> {
    Command::new(std::env::current_exe()?)
        .args(["--role", role, addr])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("spawning the peer process")
}

fn child_role(role: &str, addr: &str) -> Result<()> {
    let mut tcp = TcpStream::connect(addr)?;
    tcp.set_nodelay(true)?;
    match role {
        "tcp-sink" => {
            let mut buf = vec![0u8; CHUNK];
            let mut n = 0u64;
            loop {
                let r = tcp.read(&mut buf)?;
                if r == 0 {
                    break;
                }
                n += r as u64;
            }
            tcp.write_all(&n.to_le_bytes())?;
        }
        "tcp-pong" => {
            let mut b = [0u8; 64];
            while tcp.read_exact(&mut b).is_ok() {
                tcp.write_all(&b)?;
            }
        }
        "rdma-sink" => {
            let mut c = Conn::establish(&mut tcp, &Options::default(), true)?;
            run_sink(&mut c)?;
        }
        "rdma-pong" => {
            let mut c = Conn::establish(&mut tcp, &Options::default(), true)?;
            run_pong(&mut c)?;
        }
        _ => bail!("unknown role {role}"),
    }
    Ok(())
}

fn with_peer<T>(role: &str, f: impl FnOnce(TcpStream) -> Result<T>) -> Result<T> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let mut child = spawn(role, &l.local_addr()?.to_string())?;
    let (tcp, _) = l.accept()?;
    tcp.set_nodelay(true)?;
    let r = f(tcp);
    let st = child.wait()?;
    let v = r?;
    ensure!(st.success(), "{role} peer failed: {st}");
    Ok(v)
}

fn tcp_throughput(total: u64) -> Result<f64> {
    with_peer("tcp-sink", |mut tcp| {
        let buf = vec![0x5au8; CHUNK];
        let t = Instant::now();
        let mut sent = 0u64;
        while sent < total {
            tcp.write_all(&buf)?;
            sent += CHUNK as u64;
        }
        tcp.shutdown(std::net::Shutdown::Write)?;
        let mut n = [0u8; 8];
        tcp.read_exact(&mut n)?;
        let el = t.elapsed();
        ensure!(
            u64::from_le_bytes(n) == sent,
            "TCP sink counted a different byte count"
        );
        Ok(sent as f64 * 8.0 / el.as_secs_f64() / 1e9)
    })
}

fn rdma_throughput(total: u64) -> Result<f64> {
    with_peer("rdma-sink", |mut tcp| {
        let mut c = Conn::establish(&mut tcp, &Options::default(), false)?;
        let r = run_source(&mut c, total, CHUNK, false)?;
        if std::env::var_os("BENCH_DEBUG").is_some() {
            eprintln!("source device: {:?}", c.dev.stats());
        }
        Ok(r.bytes as f64 * 8.0 / r.elapsed.as_secs_f64() / 1e9)
    })
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (p(0.5), p(0.99))
}

fn tcp_pingpong(iters: usize) -> Result<(f64, f64)> {
    with_peer("tcp-pong", |mut tcp| {
        let mut b = [7u8; 64];
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters + 1000 {
            let t = Instant::now();
            tcp.write_all(&b)?;
            tcp.read_exact(&mut b)?;
            if i >= 1000 {
                rtts.push(t.elapsed());
            }
        }
        drop(tcp);
        Ok(percentiles(rtts))
    })
}

fn rdma_pingpong(iters: usize) -> Result<(f64, f64)> {
    with_peer("rdma-pong", |mut tcp| {
        let mut c = Conn::establish(&mut tcp, &Options::default(), false)?;
        Ok(percentiles(run_ping(&mut c, iters, 1000)?))
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--role") {
        if args[2] == "smc-server" {
            return smcr_bench::smc_bench::server_role(&args[3], &args[4]);
        }
        if args[2] == "echo-server" {
            return smcr_bench::app_bench::echo_server(&args[3]);
        }
        if args[2] == "connect-loop" {
            return smcr_bench::app_bench::connect_loop(&args[3], args[4].parse()?);
        }
        if args[2] == "hold" {
            return smcr_bench::app_bench::hold(&args[3], args[4].parse()?);
        }
        return child_role(&args[2], &args[3]);
    }
    let what = args.get(1).map(String::as_str).unwrap_or("rdma");
    if matches!(what, "help") || args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", usage());
        return Ok(());
    }
    let quick = args.iter().any(|a| a == "--quick");
    let json_path = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    if what == "apps" {
        use smcr_bench::app_bench;
        let opt = app_bench::Options {
            quick,
            smoke: args.iter().any(|a| a == "--smoke"),
            only: match arg("--only") {
                Some(l) => app_bench::parse_setups(&l)?,
                None => Vec::new(),
            },
            workloads: match arg("--workloads") {
                Some(l) => app_bench::parse_workloads(&l)?,
                None => Vec::new(),
            },
            mtu: match arg("--mtu") {
                Some(m) => Some(
                    m.parse::<u32>()
                        .ok()
                        .filter(|m| (576..=65535).contains(m))
                        .with_context(|| format!("--mtu {m}: not an MTU (576-65535)"))?,
                ),
                None => None,
            },
        };
        let (metrics, engine) = app_bench::run(&opt)?;
        print!("{}", app_bench::table(&metrics));
        print!("{}", app_bench::engine_table(&engine));
        let out = app_bench::out_dir();
        let json = arg("--json")
            .unwrap_or_else(|| out.join("bench-apps.json").to_string_lossy().into_owned());
        app_bench::write(json.as_ref(), &app_bench::json(&metrics, &engine))?;
        let svg = arg("--svg")
            .unwrap_or_else(|| out.join("bench-apps.svg").to_string_lossy().into_owned());
        app_bench::write(svg.as_ref(), &app_bench::svg(&metrics))?;
        eprintln!("wrote {json} and {svg}");
        return Ok(());
    }
    if what == "soak" {
        let opt = smcr_bench::soak::parse(&args[2..])?;
        return smcr_bench::soak::run(&opt);
    }
    if what == "xdp" {
        return smcr_bench::xdp_bench::run(&smcr_bench::xdp_bench::Options::parse(&args[2..])?);
    }
    if what == "smc" {
        let json = smcr_bench::smc_bench::suite(quick)?;
        if let Some(p) = json_path {
            std::fs::write(&p, &json).with_context(|| format!("writing {p}"))?;
            eprintln!("wrote {p}");
        }
        return Ok(());
    }
    ensure!(what == "rdma", "{}", usage());
    let (bytes, runs, iters) = if quick {
        (256u64 << 20, 3, 2000)
    } else {
        (2u64 << 30, 5, 20000)
    };
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    if let Some(o) = only {
        // Profiling aid: one side of one measurement.
        match o.as_str() {
            "rdma-throughput" => println!("{:.2} Gbit/s", rdma_throughput(bytes)?),
            "tcp-throughput" => println!("{:.2} Gbit/s", tcp_throughput(bytes)?),
            "rdma-latency" => println!("{:?} us", rdma_pingpong(iters)?),
            "tcp-latency" => println!("{:?} us", tcp_pingpong(iters)?),
            _ => bail!("--only rdma-throughput|tcp-throughput|rdma-latency|tcp-latency"),
        }
        return Ok(());
    }

    eprintln!(
        "bench rdma: {runs} runs each, {} MiB per throughput run, {iters} ping-pongs per latency run",
        bytes >> 20
    );
    let mut tcp_t = vec![];
    let mut rdma_t = vec![];
    let mut tcp_l = vec![];
    let mut rdma_l = vec![];
    for _ in 0..runs {
        // Interleave so that drift in machine speed hits both sides alike.
        tcp_t.push(tcp_throughput(bytes)?);
        rdma_t.push(rdma_throughput(bytes)?);
        tcp_l.push(tcp_pingpong(iters)?);
        rdma_l.push(rdma_pingpong(iters)?);
    }
    let (tt, rt) = (median(tcp_t), median(rdma_t));
    let tl50 = median(tcp_l.iter().map(|x| x.0).collect());
    let tl99 = median(tcp_l.iter().map(|x| x.1).collect());
    let rl50 = median(rdma_l.iter().map(|x| x.0).collect());
    let rl99 = median(rdma_l.iter().map(|x| x.1).collect());
    println!(
        "{:<44} {:>12} {:>12} {:>8}",
        "metric (loopback, separate processes)", "kernel TCP", "smcr rdma", "ratio"
    );
    println!(
        "{:<44} {:>12.2} {:>12.2} {:>7.2}x",
        "throughput, 64 KiB writes (Gbit/s)",
        tt,
        rt,
        rt / tt
    );
    println!(
        "{:<44} {:>12.1} {:>12.1} {:>7.2}x",
        "ping-pong 64 B round trip p50 (us)",
        tl50,
        rl50,
        rl50 / tl50
    );
    println!(
        "{:<44} {:>12.1} {:>12.1} {:>7.2}x",
        "ping-pong 64 B round trip p99 (us)",
        tl99,
        rl99,
        rl99 / tl99
    );
    let n = smcr_bench::app_bench::json_num;
    let json = format!(
        "{}\n",
        serde_json::json!({
            "suite": "rdma",
            "runs": runs,
            "throughput_gbps": { "tcp": n(tt, 3), "rdma": n(rt, 3), "ratio": n(rt / tt, 3) },
            "pingpong_rtt_us": {
                "tcp_p50": n(tl50, 2), "tcp_p99": n(tl99, 2),
                "rdma_p50": n(rl50, 2), "rdma_p99": n(rl99, 2),
                "ratio_p50": n(rl50 / tl50, 3), "ratio_p99": n(rl99 / tl99, 3),
            },
        })
    );
    if let Some(p) = json_path {
        std::fs::write(&p, &json).with_context(|| format!("writing {p}"))?;
        eprintln!("wrote {p}");
    }
    Ok(())
}

/// The commands and their options (`bench --help`, and with an unknown command).
fn usage() -> String {
    format!(
        "usage: bench {{rdma|smc}} [--quick] [--json FILE]\n       {}\n       \
         bench apps [--quick|--smoke] [--only SETUPS] [--workloads W,..] [--mtu N] [--json FILE] [--svg FILE]\n       {}",
        smcr_bench::xdp_bench::USAGE,
        smcr_bench::soak::USAGE
    )
}
