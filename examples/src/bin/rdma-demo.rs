//! Two processes move data with RDMA WRITE + SEND over smcr's own RoCE v2 engine and verify it.
//!
//! `rdma-demo [BYTES]` starts a sink process (itself, with `--sink`), connects to it, writes
//! BYTES (default 256 MiB) of pseudo-random data into the sink's ring buffer in 64 KiB RDMA
//! WRITEs, each announced by a SEND carrying its CRC, and prints what both engines saw.

use anyhow::{Context, Result, bail};
use examples::peer::{Conn, Options, run_sink, run_source};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--sink") {
        let mut tcp = TcpStream::connect(args.get(2).context("--sink needs ADDR")?)?;
        let mut c = Conn::establish(&mut tcp, &Options::default(), true)?;
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
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--sink", &addr.to_string()])
        .stdout(Stdio::inherit())
        .spawn()
        .context("starting the sink process")?;
    let (mut tcp, _) = listener.accept()?;
    let mut c = Conn::establish(&mut tcp, &Options::default(), false)?;
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
