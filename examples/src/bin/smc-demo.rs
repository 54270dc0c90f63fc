//! SMC-R examples with `SmcStream`/`SmcListener`, runnable on loopback or between namespaces.
//!
//! ```text
//! smc-demo server ADDR [--assume]                 serve echo, bulk (CRC-checked) and ping-pong
//! smc-demo client ADDR echo TEXT [--assume]       one echo
//! smc-demo client ADDR bulk BYTES [--assume]      send BYTES, compare the server's CRC-32
//! smc-demo client ADDR ping N [--assume]          N 64-byte round trips, p50/p99
//! smc-demo two-ns [BYTES]                         (root) all three across two namespaces
//! ```
//! `--assume` skips the TCP option (both ends must be ours); otherwise the option program must
//! be installed (`smcr bpf install`). `--netns NS` enters a network namespace first.

use anyhow::{Context, Result, bail, ensure};
use examples::netns::{Net, enter_netns, serve};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn runtime(assume: bool, dir: Option<&str>) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = if assume {
        Negotiation::Assume
    } else {
        Negotiation::TcpOption {
            dir: dir.unwrap_or(smcr::option::DEFAULT_DIR).into(),
        }
    };
    Runtime::new(cfg)
}

fn describe(m: &Mode) -> String {
    match m {
        Mode::SmcR { first_contact } => format!(
            "SMC-R ({})",
            if *first_contact {
                "new link group"
            } else {
                "reused link group"
            }
        ),
        Mode::Tcp(r) => format!("TCP fallback: {r} [code {:#010x}]", r.code()),
    }
}

fn server(rt: &Runtime, addr: SocketAddr) -> Result<()> {
    let l = SmcListener::bind(rt, addr).with_context(|| format!("listening on {addr}"))?;
    println!("READY listening on {addr}");
    std::io::stdout().flush()?;
    loop {
        let (s, peer) = l.accept()?;
        eprintln!("server: {peer} over {}", describe(s.mode()));
        std::thread::spawn(move || serve(s));
    }
}

fn connect(rt: &Runtime, addr: SocketAddr, kind: u8) -> Result<SmcStream> {
    let mut c = SmcStream::connect(rt, addr).with_context(|| format!("connecting to {addr}"))?;
    println!("client: connected to {addr} over {}", describe(c.mode()));
    c.write_all(&[kind])?;
    Ok(c)
}

fn echo(rt: &Runtime, addr: SocketAddr, text: &str) -> Result<()> {
    let mut c = connect(rt, addr, b'E')?;
    let mut b = [0u8; 1];
    c.read_exact(&mut b)?;
    ensure!(&b == b"E", "bad echo");
    println!("client: echo ok ({text:?} acknowledged)");
    Ok(())
}

fn bulk(rt: &Runtime, addr: SocketAddr, total: u64) -> Result<()> {
    let mut c = connect(rt, addr, b'C')?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut crc = crc32fast::Hasher::new();
    let (t, mut sent) = (Instant::now(), 0u64);
    while sent < total {
        let n = buf.len().min((total - sent) as usize);
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = ((sent + i as u64).wrapping_mul(0x9e37_79b9) >> 11) as u8;
        }
        crc.update(&buf[..n]);
        c.write_all(&buf[..n])?;
        sent += n as u64;
    }
    c.shutdown(std::net::Shutdown::Write)?;
    let mut r = [0u8; 12];
    c.read_exact(&mut r)?;
    let secs = t.elapsed().as_secs_f64();
    let (n, their) = (
        u64::from_le_bytes(r[..8].try_into()?),
        u32::from_le_bytes(r[8..].try_into()?),
    );
    let ours = crc.finalize();
    ensure!(
        n == total && their == ours,
        "mismatch: {n} bytes, CRC {their:#x} vs {ours:#x}"
    );
    println!(
        "client: bulk {} MiB in {secs:.2} s ({:.2} Gbit/s), CRC-32 {ours:#010x} matches",
        total >> 20,
        total as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

fn ping(rt: &Runtime, addr: SocketAddr, n: usize) -> Result<()> {
    let mut c = connect(rt, addr, b'P')?;
    let mut b = [7u8; 64];
    let mut v: Vec<Duration> = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
        v.push(t.elapsed());
    }
    v.sort();
    println!(
        "client: {n} ping-pongs of 64 B, round trip p50 {:.1} us, p99 {:.1} us",
        v[n / 2].as_secs_f64() * 1e6,
        v[(n - 1) * 99 / 100].as_secs_f64() * 1e6
    );
    Ok(())
}

fn two_ns(total: u64) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(unsafe { libc::geteuid() } == 0, "two-ns needs root");
    let dir = format!("/sys/fs/bpf/smcr-demo-{}", std::process::id());
    smcr::option::install(dir.as_ref()).context("installing the TCP option program")?;
    let r = (|| -> Result<()> {
        let net = Net::new()?;
        let addr: SocketAddr = "10.78.0.2:7600".parse()?;
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "server",
                &addr.to_string(),
                "--netns",
                &net.b,
                "--bpf-dir",
                &dir,
            ])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        ensure!(line.contains("READY"), "server did not start");
        println!("server: {} in namespace {}", line.trim(), net.b);
        enter_netns(&net.a)?;
        let rt = runtime(false, Some(&dir));
        let r = echo(&rt, addr, "hello")
            .and_then(|_| bulk(&rt, addr, total))
            .and_then(|_| ping(&rt, addr, 10_000));
        println!(
            "client: {} CONFIRM LINK exchange(s) for 3 connections: one link group reused",
            rt.links_confirmed()
        );
        let _ = child.kill();
        let _ = child.wait();
        r
    })();
    let _ = smcr::option::uninstall(dir.as_ref());
    r
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut flag = |name: &str, value: bool| -> Option<String> {
        let i = args.iter().position(|a| a == name)?;
        args.remove(i);
        if value {
            Some(args.remove(i))
        } else {
            Some(String::new())
        }
    };
    let assume = flag("--assume", false).is_some();
    let netns = flag("--netns", true);
    let dir = flag("--bpf-dir", true);
    if let Some(ns) = &netns {
        enter_netns(ns)?;
    }
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["server", addr] => server(&runtime(assume, dir.as_deref()), addr.parse()?),
        ["client", addr, "echo", text] => {
            echo(&runtime(assume, dir.as_deref()), addr.parse()?, text)
        }
        ["client", addr, "bulk", n] => {
            bulk(&runtime(assume, dir.as_deref()), addr.parse()?, n.parse()?)
        }
        ["client", addr, "ping", n] => {
            ping(&runtime(assume, dir.as_deref()), addr.parse()?, n.parse()?)
        }
        ["two-ns"] => two_ns(1 << 30),
        ["two-ns", n] => two_ns(n.parse()?),
        _ => bail!("usage: see the header of examples/src/bin/smc-demo.rs"),
    }
}
