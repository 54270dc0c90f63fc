//! Two processes move data with RDMA WRITE + SEND over smcr's own RoCE v2 engine and verify it.
//!
//! `rdma-demo [BYTES]` starts a sink process (itself, with `--sink`), connects to it, writes
//! BYTES (default 256 MiB) of pseudo-random data into the sink's ring buffer in 64 KiB RDMA
//! WRITEs, each announced by a SEND carrying its CRC, and prints what both engines saw.
//!
//! Across two hosts (network namespaces): `DEMO_SOURCE_IP`, `DEMO_SINK_IP` choose the addresses
//! (default 127.0.0.1), `DEMO_SINK_NETNS` starts the sink with `ip netns exec NAME`, and
//! `DEMO_MTU` sets the path MTU (default 4096; use 1024 on a 1500-byte Ethernet, as rxe does).

use anyhow::{Context, Result, bail};
use examples::peer::{Conn, Options, run_sink, run_source};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--sink") {
        let mut tcp = TcpStream::connect(args.get(2).context("--sink needs ADDR")?)?;
        let mut c = Conn::establish(
            &mut tcp,
            &Options {
                ip: ip_from_env("DEMO_SINK_IP")?,
                mtu: mtu_from_env()?,
                ..Options::default()
            },
            true,
        )?;
        let got = run_sink(&mut c)?;
        let s = c.dev.stats();
        println!(
            "sink   (pid {}): received {got} bytes, every chunk's CRC matched; {} RoCE packets in, {} ICRC errors, {} malformed",
            std::process::id(),
            s.rx_packets,
            s.rx_icrc_errors,
            s.rx_malformed
        );
        if let Some(f) = c.dev.fault_stats() {
            println!("sink   faults injected on its sends: {f:?}");
        }
        return Ok(());
    }
    let total: u64 = args
        .get(1)
        .map(|s| s.parse())
        .transpose()
        .context("BYTES must be a number")?
        .unwrap_or(256 << 20);
    let source_ip = ip_from_env("DEMO_SOURCE_IP")?;
    let listener = TcpListener::bind((source_ip, 0))?;
    let addr = listener.local_addr()?;
    let exe = std::env::current_exe()?;
    let mut cmd = match std::env::var("DEMO_SINK_NETNS") {
        Ok(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns]).arg(&exe);
            c
        }
        Err(_) => Command::new(&exe),
    };
    let mut child = cmd
        .args(["--sink", &addr.to_string()])
        .stdout(Stdio::inherit())
        .spawn()
        .context("starting the sink process")?;
    let (mut tcp, _) = listener.accept()?;
    let mut c = Conn::establish(
        &mut tcp,
        &Options {
            ip: source_ip,
            mtu: mtu_from_env()?,
            ..Options::default()
        },
        false,
    )?;
    println!(
        "source (pid {}): QP {:#x} on {} -> sink QP {:#x} on {} (ring {} KiB, rkey {:#x})",
        std::process::id(),
        c.qp.qp_num(),
        c.dev.local_addr(),
        c.peer.qpn,
        c.peer.addr,
        c.peer.rlen / 1024,
        c.peer.rkey
    );
    let r = run_source(&mut c, total, 64 << 10, true)?;
    let s = c.dev.stats();
    println!(
        "source (pid {}): wrote {} bytes in {:.2?} ({:.2} Gbit/s) with RDMA WRITE + SEND, stream CRC {:#010x}; {} RoCE packets out in {} sendmsg calls",
        std::process::id(),
        r.bytes,
        r.elapsed,
        r.bytes as f64 * 8.0 / r.elapsed.as_secs_f64() / 1e9,
        r.crc,
        s.tx_packets,
        s.tx_syscalls
    );
    if let Some(f) = c.dev.fault_stats() {
        println!(
            "source faults injected on its sends: {f:?}; retransmission state: {}",
            c.qp.summary()
        );
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("sink process failed: {status}");
    }
    println!("OK: data verified end to end");
    Ok(())
}

fn ip_from_env(var: &str) -> Result<std::net::Ipv4Addr> {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{var}={v:?} is not an IPv4 address")),
        Err(_) => Ok([127, 0, 0, 1].into()),
    }
}

fn mtu_from_env() -> Result<rdma::Mtu> {
    let Ok(v) = std::env::var("DEMO_MTU") else {
        return Ok(rdma::Mtu::Mtu4096);
    };
    let n: usize = v
        .parse()
        .with_context(|| format!("DEMO_MTU={v:?} is not a number"))?;
    [
        rdma::Mtu::Mtu256,
        rdma::Mtu::Mtu512,
        rdma::Mtu::Mtu1024,
        rdma::Mtu::Mtu2048,
        rdma::Mtu::Mtu4096,
    ]
    .into_iter()
    .find(|m| m.bytes() == n)
    .with_context(|| format!("DEMO_MTU must be 256, 512, 1024, 2048 or 4096, not {n}"))
}
