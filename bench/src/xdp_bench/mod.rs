//! `bench xdp` (root): issue 27's question — would an AF_XDP transport beat the engine's kernel
//! UDP sockets on a veth pair between two namespaces? Measured in one run, interleaved:
//! * ping-pong round trip (p50/p99) of 100-byte payloads: AF_XDP at both ends (sleeping in
//!   poll(), native and generic XDP; busy-polling the RX ring, native), kernel UDP (blocking
//!   recv, and busy recv), TCP;
//! * one-way throughput of 1 KiB payloads (MTU 1500), 3 KiB (MTU 3500) and 4 KiB (MTU 9000,
//!   multi-buffer for AF_XDP): AF_XDP, native and generic XDP (batches of 64 on the TX ring,
//!   kicked with sendto), UDP sendmmsg (64 per call), UDP GSO (UDP_SEGMENT, 64 KiB sends) into
//!   a GRO receiver;
//!
//! each with both threads on one core and on two cores. The ends are threads that enter their
//! namespace with setns(2). The XDP program and AF_XDP socket are `smcr::xdp_probe`.

use anyhow::{Context, Result, bail, ensure};
use smcr::xdp_probe::{self as xp, Endpoint, Steering, Xsk};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod measure;
#[allow(unused_imports)]
use measure::*;

const NS: [&str; 2] = ["xpa", "xpb"];
const DEV: [&str; 2] = ["xva", "xvb"];
const IP: [[u8; 4]; 2] = [[10, 78, 0, 1], [10, 78, 0, 2]];
const PING: usize = 100;
const UDP_PORT: u16 = 5000;
const TCP_PORT: u16 = 5001;
const NATIVE: u32 = xp::XDP_FLAGS_DRV_MODE;
const GENERIC: u32 = xp::XDP_FLAGS_SKB_MODE;
/// UMEM frame size: a page (the largest aligned chunk).
const FRAME: u32 = 4096;

/// Options of `bench xdp`.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rounds (each measurement is the median over rounds).
    pub rounds: usize,
    /// Ping-pongs per latency run.
    pub iters: usize,
    /// Seconds per throughput run.
    pub secs: f64,
    /// The two CPUs for the split placement; the first alone for the shared one.
    pub cpus: [usize; 2],
    /// Only these variants (by name), or all.
    pub only: Vec<String>,
    /// Throughput payload sizes (1024, 3072, 4096), or all.
    pub sizes: Vec<usize>,
}

impl Options {
    /// Parses `[--quick] [--rounds N] [--iters N] [--secs S] [--cpus A,B] [--only V,..]`.
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut o = Self {
            rounds: 3,
            iters: 20000,
            secs: 2.0,
            cpus: [0, 1],
            only: Vec::new(),
            sizes: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = || it.next().context("missing value");
            match a.as_str() {
                "--quick" => (o.rounds, o.iters, o.secs) = (1, 5000, 1.0),
                "--rounds" => o.rounds = val()?.parse()?,
                "--iters" => o.iters = val()?.parse()?,
                "--secs" => o.secs = val()?.parse()?,
                "--cpus" => {
                    let v: Vec<usize> = val()?
                        .split(',')
                        .map(str::parse)
                        .collect::<Result<_, _>>()?;
                    ensure!(v.len() == 2, "--cpus A,B");
                    o.cpus = [v[0], v[1]];
                }
                "--only" => o.only = val()?.split(',').map(String::from).collect(),
                "--sizes" => {
                    o.sizes = val()?
                        .split(',')
                        .map(str::parse)
                        .collect::<Result<_, _>>()?
                }
                _ => bail!("{USAGE}"),
            }
        }
        ensure!(o.secs <= 10.0, "--secs at most 10");
        Ok(o)
    }
}

/// Usage line.
pub const USAGE: &str = "bench xdp [--quick] [--rounds N] [--iters N] [--secs S] [--cpus A,B] [--only V,..] [--sizes N,..]";

fn ip(args: &[&str]) -> Result<String> {
    let o = Command::new("ip").args(args).output()?;
    ensure!(
        o.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The two namespaces and their veth; removed on drop.
struct Net {
    mac: [[u8; 6]; 2],
    ifindex: [u32; 2],
}

impl Net {
    fn new() -> Result<Self> {
        for n in NS {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(std::process::Stdio::null())
                .status();
        }
        ip(&["netns", "add", NS[0]])?;
        ip(&["netns", "add", NS[1]])?;
        ip(&[
            "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1], "netns",
            NS[1],
        ])?;
        let mut mac = [[0u8; 6]; 2];
        let mut ifindex = [0u32; 2];
        for i in 0..2 {
            let addr = format!("{}/24", Ipv4Addr::from(IP[i]));
            ip(&["-n", NS[i], "addr", "add", &addr, "dev", DEV[i]])?;
            ip(&["-n", NS[i], "link", "set", DEV[i], "up"])?;
            ip(&["-n", NS[i], "link", "set", "lo", "up"])?;
            // "3: xva@if2: <...> ... link/ether aa:bb:.. brd ..."
            let line = ip(&["-n", NS[i], "-o", "link", "show", DEV[i]])?;
            ifindex[i] = line
                .split(':')
                .next()
                .and_then(|s| s.trim().parse().ok())
                .context("ifindex")?;
            let m = line
                .split_whitespace()
                .skip_while(|w| *w != "link/ether")
                .nth(1)
                .context("mac")?;
            for (j, b) in m.split(':').enumerate() {
                mac[i][j] = u8::from_str_radix(b, 16)?;
            }
        }
        Ok(Self { mac, ifindex })
    }

    fn set_mtu(&self, mtu: u32) -> Result<()> {
        for i in 0..2 {
            ip(&["-n", NS[i], "link", "set", DEV[i], "mtu", &mtu.to_string()])?;
        }
        Ok(())
    }

    fn endpoint(&self, i: usize) -> Endpoint {
        Endpoint {
            mac: self.mac[i],
            ip: IP[i],
            port: xp::ROCE_PORT,
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in NS {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Enters namespace `ns` (this thread only) and pins the thread to `cpu`.
fn enter(ns: &str, cpu: usize) -> Result<()> {
    let f = std::fs::File::open(format!("/run/netns/{ns}"))?;
    // SAFETY: setns on a namespace file we hold open; affects this thread.
    ensure!(
        unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
        "setns {ns}: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        ensure!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0,
            "sched_setaffinity {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// A two-party barrier that fails instead of hanging when the other side has given up (an
/// error at one end must not leave the other waiting forever).
#[derive(Default)]
struct Gate {
    /// (generation, arrived, broken)
    m: Mutex<(u64, u32, bool)>,
    cv: Condvar,
}

impl Gate {
    fn wait(&self) -> Result<()> {
        let mut g = self.m.lock().expect("gate");
        ensure!(!g.2, "the other end failed");
        g.1 += 1;
        if g.1 == 2 {
            (g.0, g.1) = (g.0 + 1, 0);
            self.cv.notify_all();
            return Ok(());
        }
        let gen0 = g.0;
        let (g, t) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(20), |g| g.0 == gen0 && !g.2)
            .expect("gate");
        ensure!(!g.2 && !t.timed_out(), "the other end failed or stalled");
        Ok(())
    }
    fn fail(&self) {
        self.m.lock().expect("gate").2 = true;
        self.cv.notify_all();
    }
}

/// Runs `a` in namespace A on `cpus[0]` and `b` in B on `cpus[1]`, both after a common
/// barrier they also get (to order set-up).
fn pair<RA: Send + 'static, RB: Send + 'static>(
    cpus: [usize; 2],
    a: impl FnOnce(&Gate) -> Result<RA> + Send + 'static,
    b: impl FnOnce(&Gate) -> Result<RB> + Send + 'static,
) -> Result<(RA, RB)> {
    let bar = Arc::new(Gate::default());
    let bb = bar.clone();
    // Both ends in threads of their own: setns and the CPU mask stay with the thread.
    let ta = std::thread::spawn(move || -> Result<RA> {
        let r = enter(NS[0], cpus[0]).and_then(|()| a(&bar));
        if r.is_err() {
            bar.fail();
        }
        r
    });
    let tb = std::thread::spawn(move || -> Result<RB> {
        let r = enter(NS[1], cpus[1]).and_then(|()| b(&bb));
        if r.is_err() {
            bb.fail();
        }
        r
    });
    let ra = ta.join().map_err(|_| anyhow::anyhow!("A panicked"))?;
    let rb = tb.join().map_err(|_| anyhow::anyhow!("B panicked"))?;
    match (ra, rb) {
        (Ok(a), Ok(b)) => Ok((a, b)),
        // The end that failed first says why; the other one only saw the gate break.
        (Err(a), Err(b)) if format!("{a}").contains("other end") => Err(b),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

/// An AF_XDP end: the socket, the program and map, the link attaching them.
struct XdpEnd {
    xsk: Xsk,
    _steer: Steering,
    _link: OwnedFd,
}

impl XdpEnd {
    /// `sg`: frames larger than a UMEM chunk (multi-buffer socket and program); `attach`:
    /// `XDP_FLAGS_DRV_MODE` (native) or `XDP_FLAGS_SKB_MODE` (generic).
    fn open(ifindex: u32, sg: bool, attach: u32) -> Result<Self> {
        let flags = xp::XDP_COPY | if sg { xp::XDP_USE_SG } else { 0 };
        let xsk = Xsk::open(ifindex, 0, flags, FRAME).context("AF_XDP socket")?;
        let steer = Steering::load(1, sg).context("loading the XDP program")?;
        steer.insert(0, &xsk)?;
        let link = steer.attach(ifindex, attach).with_context(|| {
            let native = attach == xp::XDP_FLAGS_DRV_MODE;
            format!(
                "attaching XDP ({})",
                if native { "native" } else { "generic" }
            )
        })?;
        Ok(Self {
            xsk,
            _steer: steer,
            _link: link,
        })
    }
}

/// What the kernel allows on veth: native and generic attach, zero-copy and copy binds, and
/// whether a native program on the receiver alone (no program on its peer) gets RoCE from a
/// kernel UDP socket into the AF_XDP socket.
fn probe_modes(net: &Net) -> Result<Vec<String>> {
    let ib = net.ifindex[1];
    let ((), lines) = pair(
        [0, 0],
        |bar| {
            bar.wait()?;
            bar.wait()?;
            let s = UdpSocket::bind(udp_addr(0, 0))?;
            for _ in 0..100 {
                s.send_to(&[1u8; PING], udp_addr(1, xp::ROCE_PORT))?;
            }
            bar.wait()?;
            Ok(())
        },
        move |bar| {
            let mut out = Vec::new();
            let st = Steering::load(1, false)?;
            let show = |r: &std::io::Result<OwnedFd>| match r {
                Ok(_) => "ok".to_string(),
                Err(e) => format!("refused ({e})"),
            };
            let native = st.attach(ib, xp::XDP_FLAGS_DRV_MODE);
            out.push(format!(
                "attach native (XDP_FLAGS_DRV_MODE): {}",
                show(&native)
            ));
            drop(native);
            let generic = st.attach(ib, xp::XDP_FLAGS_SKB_MODE);
            out.push(format!(
                "attach generic (XDP_FLAGS_SKB_MODE): {}",
                show(&generic)
            ));
            drop(generic);
            let zc = Xsk::open(ib, 0, xp::XDP_ZEROCOPY, FRAME);
            out.push(format!(
                "bind XDP_ZEROCOPY: {}",
                match &zc {
                    Ok(x) => format!("ok ({:?})", x.mode),
                    Err(e) => format!("refused ({e})"),
                }
            ));
            drop(zc);
            let any = Xsk::open(ib, 0, 0, FRAME).context("bind without a mode flag")?;
            out.push(format!("bind without a mode flag: {:?} mode", any.mode));
            drop(any);
            let mut x = Xsk::open(ib, 0, xp::XDP_COPY, FRAME).context("bind XDP_COPY")?;
            st.insert(0, &x)?;
            let link = st
                .attach(ib, xp::XDP_FLAGS_DRV_MODE)
                .context("attach native")?;
            bar.wait()?;
            bar.wait()?;
            bar.wait()?;
            std::thread::sleep(Duration::from_millis(50));
            let n = x.recv(1024, |_, _| {});
            out.push(format!(
                "native program on the receiving veth only (none on its peer): {n}/100 UDP-4791 datagrams from a kernel socket reached the AF_XDP socket"
            ));
            drop(link);
            Ok(out)
        },
    )?;
    Ok(lines)
}

/// One measurement of a run: (p50, p99) or (Gbit/s, Mpps).
type Measure<'a> = Box<dyn Fn() -> Result<(f64, f64)> + 'a>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the suite and prints the tables.
pub fn run(o: &Options) -> Result<()> {
    ensure!(
        // SAFETY: no arguments, no failure.
        unsafe { libc::geteuid() } == 0,
        "bench xdp needs root (namespaces, XDP)"
    );
    let net = Net::new()?;
    println!("cpu pressure before: {}", pressure());
    println!("modes on veth (kernel {}):", kernel());
    for l in probe_modes(&net)? {
        println!("  {l}");
    }
    let placements = [("1 core", [o.cpus[0], o.cpus[0]]), ("2 cores", o.cpus)];
    let want = |name: &str| o.only.is_empty() || o.only.iter().any(|p| p == name);

    type Lat = Vec<(String, Vec<(f64, f64)>)>;
    let mut lat: Lat = Vec::new();
    fn put(tbl: &mut Lat, k: String, v: (f64, f64)) {
        match tbl.iter_mut().find(|e| e.0 == k) {
            Some(e) => e.1.push(v),
            None => tbl.push((k, vec![v])),
        }
    }
    let mut thr: Lat = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut note = |what: &str, e: anyhow::Error| {
        let s = format!("{what}: {e:#}");
        if !failures.contains(&s) {
            eprintln!("  {s}");
            failures.push(s);
        }
    };
    for round in 0..o.rounds {
        eprintln!("round {}/{}", round + 1, o.rounds);
        net.set_mtu(1500)?;
        for (pl, cpus) in placements {
            let same = cpus[0] == cpus[1];
            let mut lv: Vec<(&str, Measure<'_>)> = vec![
                (
                    "xdp-poll",
                    Box::new(|| xdp_pingpong(&net, cpus, o.iters, Wait::Block, NATIVE)),
                ),
                (
                    "xdp-skb-poll",
                    Box::new(|| xdp_pingpong(&net, cpus, o.iters, Wait::Block, GENERIC)),
                ),
                ("udp", Box::new(|| udp_pingpong(cpus, o.iters, Wait::Block))),
                ("tcp", Box::new(|| tcp_pingpong(cpus, o.iters))),
            ];
            // Two spinning threads on one core only take turns at the scheduler's tick.
            if !same {
                lv.push((
                    "xdp-busy",
                    Box::new(|| xdp_pingpong(&net, cpus, o.iters, Wait::Busy, NATIVE)),
                ));
                lv.push((
                    "udp-busy",
                    Box::new(|| udp_pingpong(cpus, o.iters, Wait::Busy)),
                ));
            }
            for (name, f) in lv {
                if !want(name) {
                    continue;
                }
                match f() {
                    Ok(v) => put(&mut lat, format!("{name:<12} {pl}"), v),
                    Err(e) => note(&format!("latency {name} {pl}"), e),
                }
            }
        }
        // 3 KiB at MTU 3500: about the largest frame native XDP on veth takes without
        // multi-buffer (a page less headroom and skb_shared_info).
        for (mtu, size) in [(1500, 1024), (3500, 3072), (9000, 4096)] {
            if !o.sizes.is_empty() && !o.sizes.contains(&size) {
                continue;
            }
            net.set_mtu(mtu)?;
            for (pl, cpus) in placements {
                let tv: Vec<(&str, Measure<'_>)> = vec![
                    (
                        "xdp",
                        Box::new(|| xdp_throughput(&net, cpus, size, o.secs, NATIVE)),
                    ),
                    (
                        "xdp-skb",
                        Box::new(|| xdp_throughput(&net, cpus, size, o.secs, GENERIC)),
                    ),
                    (
                        "udp-mmsg",
                        Box::new(|| udp_throughput(cpus, size, o.secs, false)),
                    ),
                    (
                        "udp-gso",
                        Box::new(|| udp_throughput(cpus, size, o.secs, true)),
                    ),
                ];
                for (name, f) in tv {
                    if !want(name) {
                        continue;
                    }
                    match f() {
                        Ok(v) => put(
                            &mut thr,
                            format!("{name:<9} {size:>4} B mtu {mtu:<4} {pl}"),
                            v,
                        ),
                        Err(e) => note(&format!("throughput {name} {size} B mtu {mtu} {pl}"), e),
                    }
                }
            }
        }
    }
    println!(
        "\nping-pong, {PING}-byte payload, median of {} rounds:",
        o.rounds
    );
    println!(
        "{:<20} {:>9} {:>9}",
        "variant  placement", "p50 us", "p99 us"
    );
    for (k, v) in &lat {
        let p50 = median(v.iter().map(|x| x.0).collect());
        let p99 = median(v.iter().map(|x| x.1).collect());
        println!("{k:<23} {p50:>9.1} {p99:>9.1}");
    }
    println!(
        "\none-way throughput (payload bytes received), median of {} rounds:",
        o.rounds
    );
    println!(
        "{:<34} {:>8} {:>8}",
        "variant  size  mtu  placement", "Gbit/s", "Mpps"
    );
    for (k, v) in &thr {
        let g = median(v.iter().map(|x| x.0).collect());
        let m = median(v.iter().map(|x| x.1).collect());
        println!("{k:<34} {g:>8.2} {m:>8.3}");
    }
    println!("\ncpu pressure after: {}", pressure());
    if !failures.is_empty() {
        println!("\nnot measured:");
        for f in &failures {
            println!("  {f}");
        }
    }
    Ok(())
}

/// `/proc/pressure/cpu`'s "some" line: how much other work competed for the CPUs (the
/// machine may be shared).
fn pressure() -> String {
    std::fs::read_to_string("/proc/pressure/cpu")
        .ok()
        .and_then(|s| s.lines().next().map(String::from))
        .unwrap_or_default()
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// One `mmsghdr` per iovec (one buffer each, no address, no control), for `sendmmsg` and
/// `recvmmsg`; they point into `iov`, which must outlive their use.
fn mmsghdrs(iov: &mut [libc::iovec]) -> Vec<libc::mmsghdr> {
    iov.iter_mut()
        .map(|v| {
            // SAFETY: an all-zero mmsghdr is valid (null name, no control).
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect()
}
