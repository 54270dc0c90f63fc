//! Link failover (issue 8): two network namespaces joined by two veth pairs, so a link group
//! gets two links (ADD LINK over the second path). One path is cut mid-transfer: the
//! connections move to the other link with nothing lost or duplicated; the path comes back:
//! the group has two links again; both are cut: the connections fail with an error.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{NetPair, TestInstall, in_netns, pattern, privileged, wait_until};
use smcr::{Blocking, Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn runtime(install: &TestInstall, alt: std::net::Ipv4Addr) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    cfg.alt_addrs = vec![alt];
    // Two namespaces stand for two hosts: the RoCE path (not shared memory through the
    // host-wide rendezvous).
    cfg.same_host = false;
    Runtime::new(cfg)
}

/// What one direction of a connection moved: bytes, and whether every one was right.
struct Flow {
    bytes: AtomicU64,
    /// Why reading stopped early (an error), if it did.
    error: parking_lot::Mutex<Option<std::io::Error>>,
}

impl Flow {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            bytes: AtomicU64::new(0),
            error: parking_lot::Mutex::new(None),
        })
    }
}

const WAIT: Blocking = Blocking::Yes(None);

/// Writes `pattern(seed)` until `stop`, then half-closes; returns the bytes written or the
/// error that ended writing.
fn writer(c: &SmcStream, seed: u64, stop: &AtomicBool) -> std::io::Result<u64> {
    let mut chunk = vec![0u8; 64 * 1024 + 7];
    let mut pos = 0u64;
    while !stop.load(Ordering::Relaxed) {
        pattern(seed, pos, &mut chunk);
        let mut at = 0;
        while at < chunk.len() {
            at += c.send(&chunk[at..], WAIT)?;
        }
        pos += chunk.len() as u64;
    }
    c.shutdown(std::net::Shutdown::Write)?;
    Ok(pos)
}

/// Reads to EOF checking `pattern(seed)`, counting into `flow`.
fn reader(s: &SmcStream, seed: u64, flow: &Flow) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut want = vec![0u8; buf.len()];
    let mut pos = 0u64;
    loop {
        match s.recv(&mut buf, false, WAIT) {
            Ok(0) => return,
            Ok(n) => {
                pattern(seed, pos, &mut want[..n]);
                assert!(buf[..n] == want[..n], "seed {seed}: corrupt data at {pos}");
                pos += n as u64;
                flow.bytes.store(pos, Ordering::Relaxed);
            }
            Err(e) => {
                *flow.error.lock() = Some(e);
                return;
            }
        }
    }
}

/// Both directions at once on `s`: writes `pattern(out)` until `stop` and reads
/// `pattern(inn)` into `flow` until EOF; returns what was written (or the write error).
fn duplex(
    s: SmcStream,
    out: u64,
    inn: u64,
    flow: Arc<Flow>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<std::io::Result<u64>> {
    std::thread::spawn(move || {
        let s = Arc::new(s);
        let r = {
            let s = s.clone();
            std::thread::spawn(move || reader(&s, inn, &flow))
        };
        let written = writer(&s, out, &stop);
        r.join().unwrap();
        written
    })
}

fn recv_exact(s: &SmcStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        got += s.recv(&mut buf[got..], false, WAIT).unwrap();
    }
}

fn both_links(rt: &Runtime) -> bool {
    rt.group_links() == vec![2]
}

#[test]
fn a_group_with_two_links_fails_over_heals_and_fails_only_with_its_last_link() {
    if !privileged("netns link failover") {
        return;
    }
    // More RMBs than a SEND slot's worth of ADD LINK rkey entries (3): the healing ADD LINK
    // is a long LLC message.
    const CONNS: usize = 6;
    let install = TestInstall::new("failover");
    let net = NetPair::new().unwrap();
    let second = net.add_path().unwrap();
    let addr: SocketAddr = (net.addr_b, 7900).into();
    let server_rt = runtime(&install, second.addr_b);
    let client_rt = runtime(&install, second.addr_a);
    // Every connection carries data both ways at once: client → server with seed 100 + i,
    // server → client with seed 200 + i.
    let to_server: Vec<Arc<Flow>> = (0..CONNS).map(|_| Flow::new()).collect();
    let to_client: Vec<Arc<Flow>> = (0..CONNS).map(|_| Flow::new()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let rt = server_rt.clone();
        let flows = to_server.clone();
        let stop = stop.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let mut sides = Vec::new();
            for (i, flow) in flows.into_iter().enumerate() {
                let (s, _) = l.accept().unwrap();
                assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
                let i = i as u64;
                sides.push(duplex(s, 200 + i, 100 + i, flow, stop.clone()));
            }
            sides
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    rx.recv().unwrap();
    let (ctx, crx) = std::sync::mpsc::channel();
    let client = {
        let rt = client_rt.clone();
        let flows = to_client.clone();
        let stop = stop.clone();
        in_netns(&net.a, move || {
            let mut sides = Vec::new();
            for (i, flow) in flows.into_iter().enumerate() {
                let c = SmcStream::connect(&rt, addr).unwrap();
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
                let i = i as u64;
                sides.push(duplex(c, 100 + i, 200 + i, flow, stop.clone()));
            }
            ctx.send(()).unwrap();
            sides
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    crx.recv().unwrap();
    let summary = || {
        format!(
            "client:\n{}\nserver:\n{}",
            client_rt.debug_summary(),
            server_rt.debug_summary()
        )
    };
    let moved = |flows: &[Arc<Flow>]| {
        flows
            .iter()
            .map(|f| f.bytes.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let flowing = |what: &str| {
        let before = (moved(&to_server), moved(&to_client));
        let grew =
            || moved(&to_server) > before.0 + (8 << 20) && moved(&to_client) > before.1 + (8 << 20);
        let waited = wait_until(Duration::from_secs(10), grew);
        assert!(grew(), "{what}: data stopped ({waited:?})\n{}", summary());
    };

    // Waits up to `limit` for both sides' group to have two links.
    let two_links = |limit: Duration, what: &str| {
        let both = || both_links(&client_rt) && both_links(&server_rt);
        let waited = wait_until(limit, both);
        assert!(
            both(),
            "{what} ({waited:?}): client {:?}, server {:?}\n{}",
            client_rt.group_links(),
            server_rt.group_links(),
            summary()
        );
        waited
    };

    // 1. The server adds a link over the second path right after the first came up.
    let waited = two_links(Duration::from_secs(10), "two links per group");
    eprintln!("second link up {waited:?} after the connections");
    flowing("two links");

    // 2. The first path is cut mid-transfer: the connections move to the second link.
    let cut = Instant::now();
    net.set_link(&net.a, &net.veth_a, false).unwrap();
    let waited = wait_until(Duration::from_secs(10), || {
        client_rt.failovers() >= 1 && server_rt.failovers() >= 1
    });
    assert!(
        client_rt.failovers() >= 1 && server_rt.failovers() >= 1,
        "both sides fail over ({waited:?}): client {}, server {}\n{}",
        client_rt.failovers(),
        server_rt.failovers(),
        summary()
    );
    flowing("after the failover");
    eprintln!(
        "failover: both sides moved within {waited:?}; data flowing both ways again {:?} \
         after the cut",
        cut.elapsed()
    );
    assert_eq!(client_rt.group_links(), vec![1]);

    // 3. The path comes back: the group heals (two links again), the data keeps flowing.
    net.set_link(&net.a, &net.veth_a, true).unwrap();
    let back = Instant::now();
    two_links(Duration::from_secs(40), "healed");
    eprintln!("healed {:?} after the path came back", back.elapsed());
    flowing("healed");

    // 4. Nothing lost or duplicated: the writers stop; every byte arrived, in order, both
    // ways (`reader` checks each one).
    stop.store(true, Ordering::Relaxed);
    let sent_by_client: Vec<u64> = client
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("client writing"))
        .collect();
    let sent_by_server: Vec<u64> = server
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("server writing"))
        .collect();
    for (dir, flows, sent) in [
        ("to the server", &to_server, &sent_by_client),
        ("to the client", &to_client, &sent_by_server),
    ] {
        for (i, f) in flows.iter().enumerate() {
            assert!(
                f.error.lock().is_none(),
                "conn {i} {dir}: {:?}",
                f.error.lock()
            );
            assert_eq!(
                f.bytes.load(Ordering::Relaxed),
                sent[i],
                "conn {i} {dir}: bytes"
            );
        }
    }
    eprintln!(
        "moved {} MiB to the server and {} MiB to the client over {CONNS} connections, \
         {} failover(s) on each side",
        sent_by_client.iter().sum::<u64>() >> 20,
        sent_by_server.iter().sum::<u64>() >> 20,
        client_rt.failovers()
    );

    // 5. Both paths cut under a new transfer: the group has no link left; its
    // connections fail with an error on both sides, never hang.
    let (tx, rx) = std::sync::mpsc::channel();
    let (at_server, at_client) = (Flow::new(), Flow::new());
    let stop = Arc::new(AtomicBool::new(false));
    let addr: SocketAddr = (net.addr_b, 7901).into();
    let server = {
        let rt = server_rt.clone();
        let flow = at_server.clone();
        let stop = stop.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (s, _) = l.accept().unwrap();
            duplex(s, 301, 300, flow, stop).join().unwrap()
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = client_rt.clone();
        let flow = at_client.clone();
        let stop = stop.clone();
        in_netns(&net.a, move || {
            let c = SmcStream::connect(&rt, addr).unwrap();
            assert_eq!(
                c.mode(),
                &Mode::SmcR {
                    first_contact: false
                }
            );
            duplex(c, 300, 301, flow, stop).join().unwrap()
        })
    };
    let going = || {
        at_server.bytes.load(Ordering::Relaxed) > 8 << 20
            && at_client.bytes.load(Ordering::Relaxed) > 8 << 20
    };
    let waited = wait_until(Duration::from_secs(10), going);
    assert!(going(), "{waited:?}");
    let cut = Instant::now();
    net.set_link(&net.a, &net.veth_a, false).unwrap();
    net.set_link(&net.a, &second.veth_a, false).unwrap();
    for (side, written, flow) in [
        ("client", client.join().unwrap(), &at_client),
        ("server", server.join().unwrap(), &at_server),
    ] {
        let err = written.expect_err("writing with no link left");
        eprintln!(
            "no link left: the {side}'s writer failed {:?} after the cut: {err}",
            cut.elapsed()
        );
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            ),
            "{side}: {err}"
        );
        // The reader has returned too (`duplex` joins it): with the error, or with EOF when
        // the writer collected the error first (reported once, as TCP does).
        eprintln!("  its reader: {:?}", flow.error.lock());
    }
    assert!(
        cut.elapsed() < Duration::from_secs(40),
        "{:?}",
        cut.elapsed()
    );
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn an_alternate_address_that_cannot_be_had_leaves_one_link_and_smcr() {
    if !privileged("netns unusable alternate address") {
        return;
    }
    let install = TestInstall::new("noalt");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7910).into();
    // Not an address of either namespace: its socket cannot be bound.
    let missing: std::net::Ipv4Addr = "10.99.0.1".parse().unwrap();
    let (server_rt, client_rt) = (runtime(&install, missing), runtime(&install, missing));
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (s, _) = l.accept().unwrap();
            let mode = s.mode().clone();
            let mut buf = [0u8; 5];
            recv_exact(&s, &mut buf);
            s.send(&buf, WAIT).unwrap();
            mode
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = client_rt.clone();
        in_netns(&net.a, move || {
            let c = SmcStream::connect(&rt, addr).unwrap();
            c.send(b"hello", WAIT).unwrap();
            let mut buf = [0u8; 5];
            recv_exact(&c, &mut buf);
            assert_eq!(&buf, b"hello");
            let links = rt.group_links();
            (c.mode().clone(), links)
        })
    };
    let (mode, links) = client.join().unwrap();
    assert_eq!(
        mode,
        Mode::SmcR {
            first_contact: true
        }
    );
    assert_eq!(
        server.join().unwrap(),
        Mode::SmcR {
            first_contact: true
        }
    );
    assert_eq!(links, vec![1], "one link: no second path");
}
