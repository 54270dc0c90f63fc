//! The link and connection flows over each kind of device, through the one device seam
//! (`rdma::Device`): our engine (RoCE v2 over UDP, on 127.0.0.1) and a verbs device — the
//! kernel's rxe or an RNIC through libibverbs — on the address of its RoCE v2 GID. Each flow
//! is one function run twice, `engine::NAME` and `verbs::NAME`: first contact and reuse, bulk
//! data both ways, many connections on one group, abort, CONFIRM/DELETE RKEY, TEST LINK on an
//! idle link, DELETE LINK of an idle group, and a Decline.
//!
//! Both ends run in this process, so a verbs device talks to itself (rxe loops such packets
//! back; an RNIC does the same in hardware). Where no verbs device is active, `verbs::*` skip
//! with a message — unless `SMCR_REQUIRE_VERBS=1`, which the kernel-interop suite sets when it
//! runs this binary in a guest with rxe (part V). `SMCR_TEST_VERBS_ADDR` picks the address
//! when a machine has several.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU16, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use clc::DeclineReason;
use smcr::{
    FallbackReason, Mode, Negotiation, RdmaDevice, Runtime, RuntimeConfig, SmcListener, SmcStream,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Engine,
    Verbs,
}

/// Where one kind of device runs here.
struct Setup {
    kind: Kind,
    addr: Ipv4Addr,
    /// The device `Runtime::devices` should name for `addr`.
    device: Option<String>,
}

/// The runtime's log on stderr when `SMCR_TEST_LOG` is set (what a failing run in a guest
/// shows).
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        eprintln!("{:?} {} {}", Instant::now(), r.level(), r.args());
    }
    fn flush(&self) {}
}

impl Setup {
    /// The setup of `kind`, or `None` (having said why) when this machine has no such device.
    fn of(kind: Kind, test: &str) -> Option<Self> {
        if std::env::var_os("SMCR_TEST_LOG").is_some() && log::set_logger(&StderrLog).is_ok() {
            log::set_max_level(log::LevelFilter::Debug);
        }
        match kind {
            Kind::Engine => Some(Self {
                kind,
                addr: Ipv4Addr::LOCALHOST,
                device: None,
            }),
            Kind::Verbs => {
                let ports =
                    rdma::ibv::sysfs::scan(std::path::Path::new(rdma::ibv::sysfs::SYSFS_ROOT));
                let want: Option<Ipv4Addr> = std::env::var("SMCR_TEST_VERBS_ADDR")
                    .ok()
                    .map(|a| a.parse().expect("SMCR_TEST_VERBS_ADDR: an IPv4 address"));
                let found = ports
                    .iter()
                    .filter(|p| p.is_active() && p.link_layer == "Ethernet")
                    .flat_map(|p| p.gids.iter().map(move |g| (p, g)))
                    .find_map(|(p, g)| {
                        let ip = g.ipv4()?;
                        let usable = g.kind == rdma::ibv::sysfs::GidKind::RoceV2
                            && !ip.is_loopback()
                            && want.is_none_or(|w| w == ip);
                        usable.then(|| (p.device.clone(), ip))
                    });
                match found {
                    Some((name, addr)) => Some(Self {
                        kind,
                        addr,
                        device: Some(name),
                    }),
                    None if std::env::var("SMCR_REQUIRE_VERBS").as_deref() == Ok("1") => {
                        panic!("{test}: no active RoCE v2 GID of an IPv4 address: {ports:?}")
                    }
                    None => {
                        eprintln!(
                            "SKIP verbs::{test}: no RDMA device here has an active RoCE v2 GID \
                             of an IPv4 address (the kernel-interop suite runs these over rxe)"
                        );
                        None
                    }
                }
            }
        }
    }

    /// Settings for a runtime on this device: SMC-R assumed (no BPF needed), the RC path
    /// (not the engine's same-host shared memory), the device forced, so a missing one fails
    /// the test instead of falling back.
    fn config(&self) -> RuntimeConfig {
        static PORT: AtomicU16 = AtomicU16::new(0);
        let mut cfg = RuntimeConfig::new();
        cfg.negotiation = Negotiation::Assume;
        cfg.same_host = false;
        cfg.rdma_device = match self.kind {
            Kind::Engine => RdmaDevice::Engine,
            Kind::Verbs => RdmaDevice::Verbs,
        };
        // Our engine's own RoCE port per runtime, so tests run in parallel.
        let n = PORT.fetch_add(1, Ordering::Relaxed) % 16;
        cfg.roce_port = 20000 + (std::process::id() % 1000) as u16 * 16 + n;
        cfg
    }

    fn listen(&self, rt: &Runtime) -> (SmcListener, SocketAddr) {
        let l = SmcListener::bind(rt, (self.addr, 0)).unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    /// The runtime ran its links on the device of this setup, and only there.
    fn check_device(&self, rt: &Runtime) {
        assert_eq!(
            rt.devices(),
            vec![(self.addr, self.device.clone())],
            "{:?} links on the wrong device",
            self.kind
        );
    }

    /// Like `check_device`, for a runtime whose links start at `addr`.
    fn check_device_at(&self, rt: &Runtime, addr: Ipv4Addr) {
        assert_eq!(rt.devices(), vec![(addr, self.device.clone())]);
    }

    /// Bytes for bulk tests: the guests' rxe is emulated and slow.
    fn bulk(&self) -> u64 {
        match self.kind {
            Kind::Engine => 64 << 20,
            Kind::Verbs => 8 << 20,
        }
    }
}

macro_rules! over_both_kinds {
    (both: [$($name:ident),* $(,)?], verbs_only: [$($vname:ident),* $(,)?] $(,)?) => {
        mod engine {
            $( #[test] fn $name() {
                if let Some(s) = super::Setup::of(super::Kind::Engine, stringify!($name)) {
                    super::$name(&s)
                }
            } )*
        }
        mod verbs {
            $( #[test] fn $name() {
                if let Some(s) = super::Setup::of(super::Kind::Verbs, stringify!($name)) {
                    super::$name(&s)
                }
            } )*
            $( #[test] fn $vname() {
                if let Some(s) = super::Setup::of(super::Kind::Verbs, stringify!($vname)) {
                    super::$vname(&s)
                }
            } )*
        }
    };
}

over_both_kinds!(
    both: [
        first_contact_then_reuse,
        bulk_both_ways_with_checksum,
        many_connections_share_one_link_group,
        abort_resets_both_ends,
        rkeys_are_confirmed_and_deleted_per_connection,
        test_link_keeps_an_idle_link_up,
        an_idle_link_group_is_deleted,
        a_declining_server_leaves_a_clean_tcp_stream,
        a_declining_client_ends_its_new_group_at_once,
    ],
    // Our engine's two links and failover: tests/failover.rs, across namespaces.
    verbs_only: [two_links_fail_over_when_the_first_path_goes],
);

fn pattern(seed: u64, pos: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = pos + i as u64;
        *b = ((p ^ seed).wrapping_mul(0x9e37_79b9) >> 13) as u8;
    }
}

/// Writes `total` bytes of `pattern(seed)` in odd-sized chunks, then half-closes.
fn send_pattern(c: &mut SmcStream, seed: u64, total: u64) {
    let mut chunk = vec![0u8; 100_003];
    let mut pos = 0u64;
    while pos < total {
        let n = chunk.len().min((total - pos) as usize);
        pattern(seed, pos, &mut chunk[..n]);
        c.write_all(&chunk[..n]).unwrap();
        pos += n as u64;
    }
    c.shutdown(std::net::Shutdown::Write).unwrap();
}

/// Reads to EOF, checking every byte against `pattern(seed)`; the count.
fn check_pattern(c: &mut SmcStream, seed: u64) -> u64 {
    let mut buf = vec![0u8; 256 * 1024];
    let mut expect = vec![0u8; buf.len()];
    let mut pos = 0u64;
    loop {
        let n = c.read(&mut buf).unwrap();
        if n == 0 {
            return pos;
        }
        pattern(seed, pos, &mut expect[..n]);
        assert!(buf[..n] == expect[..n], "corruption at {pos}");
        pos += n as u64;
    }
}

/// A one-byte echo, then waits for the peer's close.
fn echo_server(l: SmcListener, n: usize) -> thread::JoinHandle<Vec<Mode>> {
    thread::spawn(move || {
        (0..n)
            .map(|_| {
                let (mut s, _) = l.accept().unwrap();
                let mut b = [0u8; 64];
                let got = s.read(&mut b).unwrap();
                s.write_all(&b[..got]).unwrap();
                assert_eq!(s.read(&mut b).unwrap(), 0);
                s.mode().clone()
            })
            .collect()
    })
}

fn echo_once(c: &mut SmcStream, msg: &[u8]) {
    c.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
}

/// Waits up to `limit` for `done`.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while !done() {
        if Instant::now() > until {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The first connection makes the link group (CONFIRM LINK), the next ones reuse it.
fn first_contact_then_reuse(s: &Setup) {
    let rt = Runtime::new(s.config());
    let (l, addr) = s.listen(&rt);
    let server = thread::spawn(move || {
        for _ in 0..3 {
            let (mut c, _) = l.accept().unwrap();
            assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
            let mut buf = [0u8; 4096];
            loop {
                let n = c.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                c.write_all(&buf[..n]).unwrap();
            }
        }
    });
    for i in 0..3 {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert_eq!(
            c.mode(),
            &Mode::SmcR {
                first_contact: i == 0
            }
        );
        for msg in [&b"hello"[..], &[7u8; 3000][..], b"x"] {
            echo_once(&mut c, msg);
        }
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }
    server.join().unwrap();
    assert_eq!(
        rt.links_confirmed(),
        2,
        "one CONFIRM LINK (both ends count it)"
    );
    assert_eq!(rt.link_groups(), 2, "client and server side of one group");
    s.check_device(&rt);
    rt.shutdown();
}

/// Bulk data in both directions at once, every byte checked; RMBs wrap many times.
fn bulk_both_ways_with_checksum(s: &Setup) {
    let rt = Runtime::new(s.config());
    let (l, addr) = s.listen(&rt);
    let total = s.bulk();
    let server = thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let mut w = c.try_clone().unwrap();
        let writer = thread::spawn(move || send_pattern(&mut w, 2, total));
        let mut r = c;
        let got = check_pattern(&mut r, 1);
        writer.join().unwrap();
        got
    });
    let c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
    let mut w = c.try_clone().unwrap();
    let writer = thread::spawn(move || send_pattern(&mut w, 1, total));
    let mut r = c;
    assert_eq!(check_pattern(&mut r, 2), total);
    writer.join().unwrap();
    assert_eq!(server.join().unwrap(), total);
    s.check_device(&rt);
    rt.shutdown();
}

/// Connections open at once on one link group, each with its own RMB and data.
fn many_connections_share_one_link_group(s: &Setup) {
    const CONNS: u64 = 16;
    let each = s.bulk() / 16;
    let rt = Runtime::new(s.config());
    let (l, addr) = s.listen(&rt);
    let server = thread::spawn(move || {
        let readers: Vec<_> = (0..CONNS)
            .map(|_| {
                let (mut c, _) = l.accept().unwrap();
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
                thread::spawn(move || {
                    let mut seed = [0u8; 8];
                    c.read_exact(&mut seed).unwrap();
                    let seed = u64::from_le_bytes(seed);
                    let got = check_pattern(&mut c, seed);
                    c.write_all(&got.to_le_bytes()).unwrap();
                    (seed, got)
                })
            })
            .collect();
        let mut seen: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        seen.sort();
        seen
    });
    // The first connection makes the group; the rest arrive together on it.
    let first = SmcStream::connect(&rt, addr).unwrap();
    assert_eq!(
        first.mode(),
        &Mode::SmcR {
            first_contact: true
        }
    );
    let mut streams = vec![first];
    let writers: Vec<_> = (1..CONNS)
        .map(|_| {
            let rt = rt.clone();
            thread::spawn(move || SmcStream::connect(&rt, addr).unwrap())
        })
        .collect();
    streams.extend(writers.into_iter().map(|w| w.join().unwrap()));
    let writers: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(seed, mut c)| {
            thread::spawn(move || {
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
                c.write_all(&(seed as u64).to_le_bytes()).unwrap();
                send_pattern(&mut c, seed as u64, each);
                let mut got = [0u8; 8];
                c.read_exact(&mut got).unwrap();
                u64::from_le_bytes(got)
            })
        })
        .collect();
    for w in writers {
        assert_eq!(w.join().unwrap(), each);
    }
    let seen = server.join().unwrap();
    assert_eq!(seen, (0..CONNS).map(|i| (i, each)).collect::<Vec<_>>());
    assert_eq!(
        rt.link_groups(),
        2,
        "one group (both sides) for all of them"
    );
    assert_eq!(rt.links_confirmed(), 2);
    s.check_device(&rt);
    rt.shutdown();
}

/// An abort: the aborting end reports the reset once, the peer reads ECONNRESET.
fn abort_resets_both_ends(s: &Setup) {
    let rt = Runtime::new(s.config());
    let (l, addr) = s.listen(&rt);
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut buf = [0u8; 16];
        c.read_exact(&mut buf).unwrap();
        read_tx.send(()).unwrap();
        let e = c.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }));
    c.write_all(&[1u8; 16]).unwrap();
    read_rx.recv().unwrap();
    c.abort("the test gave up on it");
    let e = c.write(b"more").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
    assert!(e.to_string().contains("the test gave up on it"), "{e}");
    // Reported once, as TCP reports a reset: then EOF and EPIPE.
    assert_eq!(c.read(&mut [0u8; 4]).unwrap(), 0);
    let e = c.write(b"more").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
    server.join().unwrap();
    s.check_device(&rt);
    rt.shutdown();
}

/// Without rkey reuse each connection makes Linux's exchanges: CONFIRM RKEY at setup and
/// DELETE RKEY at its end, on both sides, over the link's SEND path.
fn rkeys_are_confirmed_and_deleted_per_connection(s: &Setup) {
    const N: usize = 4;
    let mut cfg = s.config();
    cfg.rkey_reuse = false;
    let rt = Runtime::new(cfg);
    let (l, addr) = s.listen(&rt);
    let server = echo_server(l, N);
    for i in 0..N {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert_eq!(
            c.mode(),
            &Mode::SmcR {
                first_contact: i == 0
            }
        );
        echo_once(&mut c, format!("connection {i}").as_bytes());
    }
    server.join().unwrap();
    let want = 2 * N as u32;
    assert!(
        wait_until(Duration::from_secs(20), || rt.rkey_requests() >= want),
        "{} rkey requests for {N} connections, want {want}: {}",
        rt.rkey_requests(),
        rt.debug_summary()
    );
    s.check_device(&rt);
    rt.shutdown();
}

/// An idle link is probed by TEST LINK and answered: with a probe after 300 ms and
/// LLC_WAIT (2 s) for the answer, an unanswered probe would end the group within 2.3 s;
/// after 4 s idle the connection still carries data.
fn test_link_keeps_an_idle_link_up(s: &Setup) {
    let mut cfg = s.config();
    cfg.test_link_time = Some(Duration::from_millis(300));
    let rt = Runtime::new(cfg);
    let (l, addr) = s.listen(&rt);
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut b = [0u8; 64];
        loop {
            let n = c.read(&mut b).unwrap();
            if n == 0 {
                break;
            }
            c.write_all(&b[..n]).unwrap();
        }
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }));
    echo_once(&mut c, b"before");
    thread::sleep(Duration::from_secs(4));
    echo_once(&mut c, b"after four idle seconds");
    assert_eq!(rt.link_groups(), 2, "{}", rt.debug_summary());
    // Both ends probed (each every 300 ms of quiet, or once per LLC_WAIT while one is out).
    let sent = rt.test_links_sent();
    assert!(sent >= 2, "{sent} TEST LINKs sent in 4 idle seconds");
    drop(c);
    server.join().unwrap();
    s.check_device(&rt);
    rt.shutdown();
}

/// An idle group is kept for its linger time (1 s here), then DELETE LINK ends it on both
/// sides, and the next connection is a first contact again.
fn an_idle_link_group_is_deleted(s: &Setup) {
    let mut cfg = s.config();
    cfg.linger = Duration::from_secs(1);
    let rt = Runtime::new(cfg);
    let (l, addr) = s.listen(&rt);
    let server = echo_server(l, 2);
    let echo = |first: bool| {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert_eq!(
            c.mode(),
            &Mode::SmcR {
                first_contact: first
            }
        );
        echo_once(&mut c, b"a");
    };
    echo(true);
    // Within the linger time the group is kept...
    thread::sleep(Duration::from_millis(100));
    assert_eq!(rt.link_groups(), 2);
    // ...after it, deleted on both sides.
    assert!(
        wait_until(Duration::from_secs(20), || rt.link_groups() == 0),
        "{}",
        rt.debug_summary()
    );
    echo(true);
    server.join().unwrap();
    assert_eq!(rt.links_confirmed(), 4);
    s.check_device(&rt);
    rt.shutdown();
}

/// TCP after a Decline for want of memory (`MEM`), sent by the peer or by us.
fn mem_declined(by_peer: bool) -> Mode {
    Mode::Tcp(FallbackReason::Declined {
        reason: DeclineReason::MEM,
        by_peer,
    })
}

/// A server that cannot give an RMB declines (CLC Decline, out of memory): both ends fall
/// back, say why, and the TCP stream carries the data untouched.
fn a_declining_server_leaves_a_clean_tcp_stream(s: &Setup) {
    let client_rt = Runtime::new(s.config());
    let mut stingy = s.config();
    stingy.rmb_budget = 0;
    let server_rt = Runtime::new(stingy);
    let (l, addr) = s.listen(&server_rt);
    let server = echo_server(l, 1);
    let mut c = SmcStream::connect(&client_rt, addr).unwrap();
    echo_once(&mut c, b"after a decline the TCP stream is clean");
    let mode = c.mode().clone();
    drop(c);
    assert_eq!(mode, mem_declined(true));
    assert_eq!(server.join().unwrap(), vec![mem_declined(false)]);
    client_rt.shutdown();
    server_rt.shutdown();
}

/// A client that cannot give an RMB for a first contact declines (MEM) after the server's
/// Accept: both ends go on over TCP, and the group it had made for that connection ends at
/// once. (It used to stay until its link's CONFIRM LINK wait ran out, 4 s later, holding
/// its buffers: pinned memory on a verbs device past RLIMIT_MEMLOCK.)
fn a_declining_client_ends_its_new_group_at_once(s: &Setup) {
    let mut stingy = s.config();
    stingy.rmb_budget = 0;
    let client_rt = Runtime::new(stingy);
    let server_rt = Runtime::new(s.config());
    let (l, addr) = s.listen(&server_rt);
    let server = echo_server(l, 1);
    let mut c = SmcStream::connect(&client_rt, addr).unwrap();
    // Checked before anything else could end it: the group was ended inside the handshake.
    let groups = client_rt.link_groups();
    echo_once(&mut c, b"after our decline the TCP stream is clean");
    let mode = c.mode().clone();
    drop(c);
    assert_eq!(mode, mem_declined(false));
    assert_eq!(groups, 0, "{}", client_rt.debug_summary());
    assert_eq!(server.join().unwrap(), vec![mem_declined(true)]);
    assert_eq!(server_rt.link_groups(), 0, "{}", server_rt.debug_summary());
    client_rt.shutdown();
    server_rt.shutdown();
}

/// Removes a temporary address when the test ends, however it ends.
struct TempAddr {
    cidr: String,
    dev: String,
}

impl TempAddr {
    fn add(ip: Ipv4Addr, dev: &str) -> Self {
        let cidr = format!("{ip}/32");
        let ok = std::process::Command::new("ip")
            .args(["addr", "add", &cidr, "dev", dev])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip addr add {cidr} dev {dev}");
        Self {
            cidr,
            dev: dev.to_string(),
        }
    }

    fn remove(&self) -> bool {
        std::process::Command::new("ip")
            .args(["addr", "del", &self.cidr, "dev", &self.dev])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for TempAddr {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Two links on one verbs device: the group's first path runs from a temporary address of
/// the port (`SMCR_TEST_VERBS_CUT_ADDR`), its second (ADD LINK) from the device's own. The
/// temporary address is deleted mid-transfer: its GID leaves the device's table and the
/// first path's queue pairs fail (rxe ends their work requests in error; were they only
/// silent, TEST LINK would find them, its idle time here 1 s). Both ends fail over and the
/// transfer completes on the second link, every byte checked once.
fn two_links_fail_over_when_the_first_path_goes(s: &Setup) {
    let Ok(cut) = std::env::var("SMCR_TEST_VERBS_CUT_ADDR") else {
        assert!(
            std::env::var("SMCR_REQUIRE_VERBS").as_deref() != Ok("1"),
            "SMCR_REQUIRE_VERBS=1 needs SMCR_TEST_VERBS_CUT_ADDR, a free address on the port's \
             network"
        );
        eprintln!(
            "SKIP verbs::two_links_fail_over_when_the_first_path_goes: \
             SMCR_TEST_VERBS_CUT_ADDR (a free address to add to the port's netdev) is not set"
        );
        return;
    };
    let cut: Ipv4Addr = cut
        .parse()
        .expect("SMCR_TEST_VERBS_CUT_ADDR: an IPv4 address");
    let scan = || rdma::ibv::sysfs::scan(std::path::Path::new(rdma::ibv::sysfs::SYSFS_ROOT));
    let ports = scan();
    let (_, entry) = rdma::ibv::sysfs::roce_v2_for(&ports, s.addr).expect("the setup's GID");
    let netdev = entry.netdev.clone().expect("the GID's network device");
    let temp = TempAddr::add(cut, &netdev);
    assert!(
        wait_until(Duration::from_secs(10), || rdma::ibv::sysfs::roce_v2_for(
            &scan(),
            cut
        )
        .is_some()),
        "no RoCE v2 GID appeared for {cut} on {netdev}"
    );
    let mut cfg = s.config();
    cfg.alt_addrs = vec![s.addr];
    cfg.test_link_time = Some(Duration::from_secs(1));
    let rt = Runtime::new(cfg);
    let l = SmcListener::bind(&rt, (cut, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        check_pattern(&mut c, 7)
    });
    let c = SmcStream::connect(&rt, addr).unwrap();
    assert_eq!(
        c.mode(),
        &Mode::SmcR {
            first_contact: true
        }
    );
    assert!(
        wait_until(Duration::from_secs(30), || rt.group_links() == vec![2, 2]),
        "no second link: {:?}\n{}",
        rt.group_links(),
        rt.debug_summary()
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let mut c = c.try_clone().unwrap();
        thread::spawn(move || {
            let mut chunk = vec![0u8; 64 * 1024 + 7];
            let mut pos = 0u64;
            while !stop.load(Ordering::Relaxed) {
                pattern(7, pos, &mut chunk);
                c.write_all(&chunk).unwrap();
                pos += chunk.len() as u64;
            }
            c.shutdown(std::net::Shutdown::Write).unwrap();
            pos
        })
    };
    thread::sleep(Duration::from_millis(500));
    assert!(temp.remove(), "ip addr del {cut}");
    let t0 = Instant::now();
    let failed_over = wait_until(Duration::from_secs(60), || rt.failovers() >= 2);
    let took = t0.elapsed();
    // Data keeps flowing on the second link for a while before the writer stops.
    thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let wrote = writer.join().unwrap();
    let read = server.join().unwrap();
    eprintln!("failover after {took:?}; {wrote} bytes written, {read} read intact");
    assert!(
        failed_over,
        "failovers {} (both ends should count one)\n{}",
        rt.failovers(),
        rt.debug_summary()
    );
    assert_eq!(read, wrote);
    assert_eq!(rt.group_links(), vec![1, 1], "{}", rt.debug_summary());
    drop(c);
    s.check_device_at(&rt, cut);
    rt.shutdown();
}
