//! Many devices on one address and RoCE port (4791), each with its own QPN range and UDP port,
//! reached through the steering program (smcr's tc ingress program, attached by
//! `smcr bpf install --only steer --netns NS`), in network namespaces made by each test; and
//! what a device does without it (owner of 4791, or local-only with shared memory).
//!
//! Root (network namespaces, BPF): otherwise each test says SKIP and passes, unless
//! `SMCR_REQUIRE_TOOLS=1`, where it fails.

use rdma::transport::steer::{PortMode, ROCE_PORT, STEER_BASE, port_of_range, qpn_of};
use rdma::*;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn root(why: &str) -> bool {
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

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A network namespace with `lo` up; deleted on drop.
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("smcr-st{}-{n}-{tag}", std::process::id());
        run(&["ip", "netns", "add", &name]);
        run(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        Self(name)
    }

    /// Runs `f` on a thread inside the namespace (devices opened there stay there).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            // SAFETY: a namespace descriptor; CLONE_NEWNET switches only this thread.
            let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// The `smcr` binary of this profile (built if this run did not build it).
fn smcr_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
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
            "smcr",
        ])
        .status()
        .unwrap();
    assert!(st.success(), "building smcr failed");
    profile_dir.join("smcr")
}

/// The steering program pinned under a directory of this test, attached in the namespaces
/// given to [`Self::attach`]; everything removed on drop.
struct Steering {
    bin: PathBuf,
    dir: String,
}

impl Steering {
    fn new() -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self {
            bin: smcr_bin(),
            dir: format!("/sys/fs/bpf/smcr-rdma-steer-{}-{n}", std::process::id()),
        }
    }

    fn attach(&self, ns: &Ns) {
        let out = Command::new(&self.bin)
            .args(["bpf", "install", "--only", "steer", "--dir", &self.dir])
            .args(["--netns", &ns.0])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("lo (index 1): attached"),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Steering {
    fn drop(&mut self) {
        let _ = Command::new(&self.bin)
            .args(["bpf", "uninstall", "--only", "steer", "--dir", &self.dir])
            .output();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn roce(ip: Ipv4Addr) -> DeviceConfig {
    DeviceConfig::new(SocketAddrV4::new(ip, ROCE_PORT))
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| ((i ^ seed).wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(n, 1, "timed out waiting for a completion");
    assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
    wc[0]
}

/// One end of a connection: a QP with a source buffer, an RMB and a receive buffer.
struct End {
    cq: CompletionQueue,
    qp: QueuePair,
    src: MemoryRegion,
    rmb: MemoryRegion,
    rbuf: MemoryRegion,
    _pd: ProtectionDomain,
}

const LEN: usize = 256 << 10;

fn end(dev: &Device, shared: bool) -> End {
    let pd = if shared {
        dev.alloc_shared_pd().unwrap()
    } else {
        dev.alloc_pd()
    };
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false).unwrap();
    End {
        src: pd.reg_mr(LEN, Access::LOCAL_WRITE).unwrap(),
        rmb: pd
            .reg_mr(LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap(),
        rbuf: pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap(),
        cq,
        qp,
        _pd: pd,
    }
}

/// Moves `e` to RTS towards the peer QP `peer_qpn` at `av`.
fn connect_to(e: &End, peer_qpn: u32, av: SocketAddrV4, my_psn: u32, peer_psn: u32) {
    e.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    e.qp.modify(&QpAttr {
        path_mtu: Some(Mtu::Mtu1024),
        dest_qp_num: Some(peer_qpn),
        rq_psn: Some(Psn::new(peer_psn)),
        av: Some(av),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    e.qp.modify(&QpAttr {
        sq_psn: Some(Psn::new(my_psn)),
        timeout: Some(14),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
}

fn connect(a: (&Device, &End), b: (&Device, &End)) {
    connect_to(a.1, b.1.qp.qp_num(), b.0.local_addr(), 100, 200);
    connect_to(b.1, a.1.qp.qp_num(), a.0.local_addr(), 200, 100);
}

/// Posts a receive (wr_id 7) for a SEND of up to 4096 bytes into `e`'s receive buffer.
fn post_recv(e: &End) {
    e.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: &[e.rbuf.sge(0, 4096)],
    }])
    .unwrap();
}

/// `from` RDMA-WRITEs `data` to `remote_addr`/`rkey` (wr_id 1), then SENDs its first 44 bytes
/// (wr_id 2, signalled).
fn post_write_and_send(from: &End, remote_addr: u64, rkey: u32, data: &[u8]) {
    from.src.write(0, data);
    from.qp
        .post_send(&[
            SendWr {
                wr_id: 1,
                opcode: WrOpcode::RdmaWrite { remote_addr, rkey },
                sg_list: &[from.src.sge(0, data.len())],
                flags: SendFlags::empty(),
            },
            SendWr {
                wr_id: 2,
                opcode: WrOpcode::Send,
                sg_list: &[from.src.sge(0, 44)],
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
}

/// `from` RDMA-WRITEs `LEN` bytes of pattern `seed` into `to`'s RMB, then SENDs 44 bytes;
/// `to` checks both.
fn write_and_send(from: &End, to: &End, seed: u32) {
    let data = pattern(seed, LEN);
    post_recv(to);
    post_write_and_send(from, to.rmb.addr(), to.rmb.rkey(), &data);
    let r = wait_one(&to.cq);
    assert_eq!((r.wr_id, r.byte_len), (7, 44));
    let mut got = vec![0u8; LEN];
    to.rmb.read(0, &mut got);
    assert!(got == data, "RMB content differs (seed {seed})");
    let mut head = [0u8; 44];
    to.rbuf.read(0, &mut head);
    assert_eq!(head[..], data[..44]);
    assert_eq!(wait_one(&from.cq).wr_id, 2);
}

/// Both ways between `a` and `b` over new QPs (private domains: UDP).
fn exchange(a: &Device, b: &Device, seed: u32) {
    let (ea, eb) = (end(a, false), end(b, false));
    connect((a, &ea), (b, &eb));
    write_and_send(&ea, &eb, seed);
    write_and_send(&eb, &ea, seed ^ 0x5555);
    assert!(!ea.qp.is_same_host() && !eb.qp.is_same_host());
    // Two of our engines hold the ACK of a SEND for the answer (up to 200 µs, and while a
    // thread keeps the timers up to 5 ms more); the peer's probe may meanwhile have resent
    // it. Both settle before the QPs go, so that nothing arrives for a QP that is gone.
    std::thread::sleep(Duration::from_millis(20));
}

fn assert_clean(devs: &[&Device]) {
    for d in devs {
        let s = d.stats();
        assert_eq!(
            (
                s.rx_icrc_errors,
                s.rx_malformed,
                s.rx_unknown_qp,
                s.rx_wrong_source
            ),
            (0, 0, 0, 0),
            "{d:?}: {s:?}"
        );
    }
}

/// Eight devices on 127.0.0.1:4791 — each would need the port alone without steering — run
/// RDMA WRITE + SEND over UDP between every neighbour pair (peers address 4791; the program
/// moves each packet to its QP's owner); one device goes away and the others carry on, and a
/// new one gets a range.
#[test]
fn eight_devices_share_the_roce_port_of_one_address() {
    if !root("steering in a network namespace") {
        return;
    }
    let steer = Steering::new();
    let ns = Ns::new("eight");
    steer.attach(&ns);
    ns.run(|| {
        let lo = Ipv4Addr::LOCALHOST;
        let t = Instant::now();
        let mut devs: Vec<Option<Device>> = (0..8)
            .map(|_| Some(Device::open(roce(lo)).unwrap()))
            .collect();
        eprintln!("8 devices opened, steered, in {:?}", t.elapsed());
        let d = |devs: &Vec<Option<Device>>, i: usize| devs[i].clone().unwrap();
        let mut ranges = Vec::new();
        for i in 0..8 {
            let dev = d(&devs, i);
            assert_eq!(dev.mode(), PortMode::Steered, "{dev:?}");
            assert_eq!(dev.local_addr(), SocketAddrV4::new(lo, ROCE_PORT));
            assert_eq!(dev.bound_addr().port(), port_of_range(dev.qpn_range()));
            assert!(dev.reaches_remote());
            ranges.push(dev.qpn_range());
        }
        ranges.sort_unstable();
        ranges.dedup();
        assert_eq!(ranges.len(), 8, "ranges are unique");
        // Nobody bound 4791 itself.
        UdpSocket::bind((lo, ROCE_PORT)).expect("4791 stays free");
        for i in 0..8 {
            exchange(&d(&devs, i), &d(&devs, (i + 1) % 8), i as u32);
        }
        let all: Vec<Device> = devs.iter().flatten().cloned().collect();
        assert_clean(&all.iter().collect::<Vec<_>>());
        drop(all);
        // One goes away (its port and range are free again); the others carry on.
        let gone = devs[3].take().unwrap();
        let gone_range = gone.qpn_range();
        drop(gone);
        for (a, b) in [(2, 4), (0, 7), (5, 6), (1, 2)] {
            exchange(&d(&devs, a), &d(&devs, b), 100 + a as u32);
        }
        UdpSocket::bind((lo, port_of_range(gone_range))).expect("its range's port is free");
        let new = Device::open(roce(lo)).unwrap();
        assert_eq!(new.mode(), PortMode::Steered);
        exchange(&new, &d(&devs, 4), 200);
        let all: Vec<Device> = devs.iter().flatten().cloned().collect();
        assert_clean(&all.iter().chain([&new]).collect::<Vec<_>>());
    });
}

/// Two namespaces joined by a veth pair, the program attached in each (on `lo` and the
/// veth): three devices per side on its address and 4791, each talking to one on the other
/// side.
#[test]
fn devices_of_two_namespaces_share_4791_across_a_veth_pair() {
    if !root("steering across network namespaces") {
        return;
    }
    let steer = Steering::new();
    let (a, b) = (Ns::new("a"), Ns::new("b"));
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let (va, vb) = (
        format!("vs{}a{n}", std::process::id() % 100_000),
        format!("vs{}b{n}", std::process::id() % 100_000),
    );
    run(&[
        "ip", "link", "add", &va, "netns", &a.0, "type", "veth", "peer", "name", &vb, "netns", &b.0,
    ]);
    let (ip_a, ip_b) = (Ipv4Addr::new(10, 79, 0, 1), Ipv4Addr::new(10, 79, 0, 2));
    for (ns, dev, ip) in [(&a, &va, ip_a), (&b, &vb, ip_b)] {
        run(&[
            "ip",
            "-n",
            &ns.0,
            "addr",
            "add",
            &format!("{ip}/24"),
            "dev",
            dev,
        ]);
        run(&["ip", "-n", &ns.0, "link", "set", dev, "up"]);
        steer.attach(ns);
    }
    let side_a: Vec<Device> =
        a.run(move || (0..3).map(|_| Device::open(roce(ip_a)).unwrap()).collect());
    let side_b: Vec<Device> =
        b.run(move || (0..3).map(|_| Device::open(roce(ip_b)).unwrap()).collect());
    for d in side_a.iter().chain(&side_b) {
        assert_eq!(d.mode(), PortMode::Steered, "{d:?}");
    }
    for i in 0..3 {
        exchange(&side_a[i], &side_b[i], 300 + i as u32);
        exchange(&side_a[i], &side_b[(i + 1) % 3], 400 + i as u32);
    }
    assert_clean(&side_a.iter().chain(&side_b).collect::<Vec<_>>());
    for d in side_a.iter().chain(&side_b) {
        assert!(d.stats().rx_packets > 0);
    }
}

/// Without the program: the first device on an address owns 4791 (as before), a second one
/// opens local-only on its private port (remote peers cannot reach it) — and shared-memory
/// QPs between them work without a single UDP packet. Once the program is attached, the
/// owner's QPs are also reached by steered packets (its range's port).
#[test]
fn without_steering_one_device_owns_4791_and_the_next_is_local_only() {
    if !root("a network namespace of its own") {
        return;
    }
    let steer = Steering::new();
    let ns = Ns::new("nosteer");
    let owner = ns.run(|| {
        let lo = Ipv4Addr::LOCALHOST;
        let t = Instant::now();
        let owner = Device::open(roce(lo)).unwrap();
        // 4791 was free: the probe's ICMP "port unreachable" ended the wait at once.
        eprintln!("owner opened in {:?}", t.elapsed());
        assert_eq!(owner.mode(), PortMode::Owner);
        assert_eq!(owner.bound_addr(), SocketAddrV4::new(lo, ROCE_PORT));
        assert_eq!(owner.local_addr(), SocketAddrV4::new(lo, ROCE_PORT));
        assert!(owner.reaches_remote());
        let t = Instant::now();
        let second = Device::open(roce(lo)).unwrap();
        eprintln!("local-only opened in {:?}", t.elapsed());
        assert_eq!(second.mode(), PortMode::LocalOnly);
        assert!(!second.reaches_remote());
        assert_eq!(second.local_addr(), second.bound_addr());
        assert_eq!(
            second.bound_addr().port(),
            port_of_range(second.qpn_range())
        );
        // Same-host QPs (shared domains): the offers go through the rendezvous of each
        // range, and requests wait for them instead of trying UDP.
        for (x, y) in [(&owner, &second), (&second, &owner)] {
            let (ex, ey) = (end(x, true), end(y, true));
            connect((x, &ex), (y, &ey));
            write_and_send(&ex, &ey, 1);
            write_and_send(&ey, &ex, 2);
            assert!(ex.qp.is_same_host() && ey.qp.is_same_host());
        }
        let third = Device::open(roce(lo)).unwrap();
        assert_eq!(third.mode(), PortMode::LocalOnly);
        let (e2, e3) = (end(&second, true), end(&third, true));
        connect((&second, &e2), (&third, &e3));
        write_and_send(&e2, &e3, 3);
        write_and_send(&e3, &e2, 4);
        for d in [&owner, &second, &third] {
            assert_eq!(d.stats().tx_packets, 0, "no UDP at all: {d:?}");
        }
        owner
    });
    // Steering attached while the owner runs: a steered device reaches it (packets to 4791
    // for the owner's range go to its range's port, which it kept).
    steer.attach(&ns);
    ns.run(move || {
        let dev = Device::open(roce(Ipv4Addr::LOCALHOST)).unwrap();
        assert_eq!(dev.mode(), PortMode::Steered);
        exchange(&owner, &dev, 5);
        assert_clean(&[&owner, &dev]);
    });
}

/// A RoCE packet to 4791 for a range nobody claimed is moved to that range's port, where
/// nobody listens: no device sees it, nor a plain socket on 4791; a QPN below the first range
/// is left on 4791. The devices' traffic goes on.
#[test]
fn a_packet_for_an_unclaimed_range_reaches_nobody() {
    if !root("steering in a network namespace") {
        return;
    }
    let steer = Steering::new();
    let ns = Ns::new("unknown");
    steer.attach(&ns);
    ns.run(|| {
        let lo = Ipv4Addr::LOCALHOST;
        let (a, b) = (
            Device::open(roce(lo)).unwrap(),
            Device::open(roce(lo)).unwrap(),
        );
        exchange(&a, &b, 9);
        // A plain socket on 4791 (what an old engine would be).
        let plain = UdpSocket::bind((lo, ROCE_PORT)).unwrap();
        plain
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        // What the devices received (not how often their engine threads looked at timers).
        let seen = |d: &Device| DeviceStats {
            engine_wakes: 0,
            ..d.stats()
        };
        // Settled first: the exchange's last ACKs (a held one leaves when its QP goes) may
        // still be on their way.
        let mut before = (seen(&a), seen(&b));
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(20));
            let now = (seen(&a), seen(&b));
            if now == before {
                break;
            }
            before = now;
        }
        let free = (0x101..=0xFFF)
            .find(|r| *r != a.qpn_range() && *r != b.qpn_range())
            .unwrap();
        let tx = UdpSocket::bind((lo, 0)).unwrap();
        let pkt = |qpn: u32| {
            let mut p = vec![0u8; 12 + 64 + 4];
            p[0] = 0x04;
            p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
            p[4..8].copy_from_slice(&qpn.to_be_bytes());
            p
        };
        for i in 0..20 {
            tx.send_to(&pkt(qpn_of(free, i)), (lo, ROCE_PORT)).unwrap();
        }
        let mut buf = [0u8; 256];
        assert!(
            plain.recv_from(&mut buf).is_err(),
            "a steered packet reached 4791"
        );
        // The port of the free range is nobody's: the datagrams were dropped there.
        assert!(UdpSocket::bind((lo, STEER_BASE + free as u16)).is_ok());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!((seen(&a), seen(&b)), before, "a device saw them");
        // Below the first range: untouched, delivered to 4791.
        tx.send_to(&pkt(0x00_0042), (lo, ROCE_PORT)).unwrap();
        let (n, _) = plain.recv_from(&mut buf).unwrap();
        assert_eq!(n, 12 + 64 + 4);
        assert_eq!(buf[5..8], [0, 0, 0x42]);
        exchange(&a, &b, 10);
        assert_clean(&[&a, &b]);
    });
}

/// Same-host QPs (shared domains) of two devices on one host: requests posted right after
/// RTS wait for the peer's offer (ours reached its device) instead of starting on UDP, so not
/// one UDP packet is sent. (Before, the first messages went over UDP and the QP switched once
/// nothing was outstanding.)
#[test]
fn same_host_requests_wait_for_the_offer_instead_of_using_udp() {
    let lo = Ipv4Addr::LOCALHOST;
    let a = Device::open(DeviceConfig::new(SocketAddrV4::new(lo, 0))).unwrap();
    let b = Device::open(DeviceConfig::new(SocketAddrV4::new(lo, 0))).unwrap();
    assert_eq!((a.mode(), b.mode()), (PortMode::Fixed, PortMode::Fixed));
    for round in 0..3 {
        let (ea, eb) = (end(&a, true), end(&b, true));
        connect((&a, &ea), (&b, &eb));
        write_and_send(&ea, &eb, round);
        write_and_send(&eb, &ea, round + 10);
        assert!(ea.qp.is_same_host() && eb.qp.is_same_host());
    }
    assert_eq!(
        a.stats().tx_packets + b.stats().tx_packets,
        0,
        "UDP was used"
    );
    assert_eq!(a.stats().shm_offers, 3);
}

/// A peer on this host that refuses our offer (its QP is in a private domain) closes the
/// offer's connection: requests held for its offer go over UDP at once, not after the 2 s
/// wait.
#[test]
fn a_refused_offer_sends_the_held_requests_over_udp_at_once() {
    let lo = Ipv4Addr::LOCALHOST;
    let a = Device::open(DeviceConfig::new(SocketAddrV4::new(lo, 0))).unwrap();
    let b = Device::open(DeviceConfig::new(SocketAddrV4::new(lo, 0))).unwrap();
    let (ea, eb) = (end(&a, true), end(&b, false));
    connect((&a, &ea), (&b, &eb));
    let t = Instant::now();
    write_and_send(&ea, &eb, 1);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "held {:?}",
        t.elapsed()
    );
    write_and_send(&eb, &ea, 2);
    assert!(!ea.qp.is_same_host());
    assert!(a.stats().tx_packets > 0);
}

/// Env var naming the namespace of the other user's process.
const PEER_ENV: &str = "SMCR_STEER_TEST_PEER";

/// Devices of two users (root and nobody) on one address and 4791, in two processes: data
/// both ways over UDP. (`SO_REUSEPORT` could not do this: Linux keeps sockets of different
/// users out of one group.)
#[test]
fn processes_of_two_users_share_4791() {
    if !root("changing user in a network namespace") {
        return;
    }
    let steer = Steering::new();
    let ns = Ns::new("users");
    steer.attach(&ns);
    let nsfile = std::fs::File::open(format!("/var/run/netns/{}", ns.0)).unwrap();
    let nsfd = nsfile.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "steer_peer_process", "--ignored", "--nocapture"])
        .env(PEER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(nsfd, libc::CLONE_NEWNET) != 0
                || libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let peer: Vec<u64> = loop {
        line.clear();
        assert!(from_child.read_line(&mut line).unwrap() > 0, "peer exited");
        if let Some(rest) = line.strip_prefix("PEER ") {
            break rest
                .split_whitespace()
                .map(|w| w.parse().unwrap())
                .collect();
        }
    };
    let peer2 = peer.clone();
    let outcome = ns.run({
        let mut w = {
            use std::os::fd::AsFd;
            std::fs::File::from(to_child.as_fd().try_clone_to_owned().unwrap())
        };
        move || {
            let dev = Device::open(roce(Ipv4Addr::LOCALHOST)).unwrap();
            assert_eq!(dev.mode(), PortMode::Steered);
            assert_ne!(dev.qpn_range() as u64, peer2[4], "two ranges");
            let e = end(&dev, false);
            // Connected before the peer learns our QPN: its first write must find an RTR QP
            // (earlier packets would count as from a wrong source and wait for a retry).
            connect_to(&e, peer2[0] as u32, dev.local_addr(), 100, 200);
            writeln!(
                w,
                "PEER {} {} {}",
                e.qp.qp_num(),
                e.rmb.rkey(),
                e.rmb.addr()
            )
            .unwrap();
            // The peer writes pattern 11 to us, then we write pattern 12 to it.
            post_recv(&e);
            let r = wait_one(&e.cq);
            assert_eq!(r.byte_len, 44);
            let mut got = vec![0u8; LEN];
            e.rmb.read(0, &mut got);
            assert!(got == pattern(11, LEN), "data from nobody's process");
            post_write_and_send(&e, peer2[2], peer2[1] as u32, &pattern(12, LEN));
            assert_eq!(wait_one(&e.cq).wr_id, 2);
            assert_clean(&[&dev]);
            dev.stats().rx_packets
        }
    });
    assert!(outcome > 0);
    line.clear();
    from_child.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "DONE", "peer: {line}");
    writeln!(to_child, "BYE").unwrap();
    assert!(child.wait().unwrap().success(), "the peer process failed");
}

/// The other user's process of [`processes_of_two_users_share_4791`] (uid 65534, in the
/// test's namespace): a steered device; receives pattern 11's counterpart check and writes.
#[test]
#[ignore = "run by processes_of_two_users_share_4791"]
fn steer_peer_process() {
    if std::env::var_os(PEER_ENV).is_none() {
        return;
    }
    // SAFETY: getuid has no preconditions.
    assert_eq!(unsafe { libc::getuid() }, 65534);
    let dev = Device::open(roce(Ipv4Addr::LOCALHOST)).unwrap();
    assert_eq!(dev.mode(), PortMode::Steered, "{dev:?}");
    let e = end(&dev, false);
    println!(
        "PEER {} {} {} 0 {}",
        e.qp.qp_num(),
        e.rmb.rkey(),
        e.rmb.addr(),
        dev.qpn_range()
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let stdin = std::io::stdin();
    stdin.lock().read_line(&mut line).unwrap();
    let peer: Vec<u64> = line
        .strip_prefix("PEER ")
        .unwrap()
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    connect_to(&e, peer[0] as u32, dev.local_addr(), 200, 100);
    post_recv(&e);
    post_write_and_send(&e, peer[2], peer[1] as u32, &pattern(11, LEN));
    assert_eq!(wait_one(&e.cq).wr_id, 2);
    let r = wait_one(&e.cq);
    assert_eq!((r.wr_id, r.byte_len), (7, 44));
    let mut got = vec![0u8; LEN];
    e.rmb.read(0, &mut got);
    assert!(got == pattern(12, LEN), "data from root's process");
    assert_clean(&[&dev]);
    println!("DONE");
    std::io::stdout().flush().unwrap();
    line.clear();
    stdin.lock().read_line(&mut line).unwrap();
}

/// Linux 6.12 rxe's RoCE frames (captured from the kernel-peer rig: 10.77.0.2 → 10.77.0.1,
/// IPv4 identifications from its per-destination counter), replayed over UDP from their own
/// source ports to a device on 10.77.0.1:4791 in a namespace: the engine accepts every one
/// (no ICRC error; each counted as a foreign identification and, having no QP here, as an
/// unknown QP), and drops a copy with one bit flipped as an ICRC error.
#[test]
fn kernel_rxe_datagrams_pass_the_receive_path() {
    if !root("network namespaces") {
        return;
    }
    let ns = Ns::new("kframes");
    for a in ["10.77.0.1/32", "10.77.0.2/32"] {
        run(&["ip", "-n", &ns.0, "addr", "add", a, "dev", "lo"]);
    }
    let pcap = include_bytes!("data/kernel-6.12-rxe-frames.pcap");
    let mut frames = Vec::new();
    let mut off = 24;
    while off + 16 <= pcap.len() {
        let cl = u32::from_le_bytes(pcap[off + 8..off + 12].try_into().unwrap()) as usize;
        let udp = &pcap[off + 16 + 34..off + 16 + cl];
        off += 16 + cl;
        let ulen = u16::from_be_bytes([udp[4], udp[5]]) as usize;
        frames.push((u16::from_be_bytes([udp[0], udp[1]]), udp[8..ulen].to_vec()));
    }
    let n = frames.len() as u64;
    assert_eq!(n, 30);
    let stats = ns.run(move || {
        let dev = Device::open(roce(Ipv4Addr::new(10, 77, 0, 1))).unwrap();
        assert_eq!(dev.mode(), PortMode::Owner, "{dev:?}");
        let to = SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 1), ROCE_PORT);
        let send = |sport: u16, bytes: &[u8]| {
            let s = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 2), sport)).unwrap();
            s.send_to(bytes, to).unwrap();
        };
        // Waits for the counter a packet's handling bumps last (a packet is counted received
        // before its ICRC is checked and its QP looked up).
        let settle = |done: &dyn Fn(&DeviceStats) -> bool| {
            let t = Instant::now();
            while !done(&dev.stats()) && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(5));
            }
            dev.stats()
        };
        for (sport, bytes) in &frames {
            send(*sport, bytes);
        }
        let good = settle(&|s| s.rx_unknown_qp + s.rx_icrc_errors >= n);
        let (sport, mut bad) = frames[0].clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x08;
        send(sport, &bad);
        (good, settle(&|s| s.rx_icrc_errors + s.rx_unknown_qp > n))
    });
    let (good, after) = stats;
    assert_eq!(
        (
            good.rx_packets,
            good.rx_icrc_errors,
            good.rx_foreign_ip_id,
            good.rx_unknown_qp,
            good.rx_malformed
        ),
        (n, 0, n, n, 0),
        "{good:?}"
    );
    assert_eq!(after.rx_icrc_errors, 1, "{after:?}");
}
