//! Link failover (issue 8): two network namespaces joined by two veth pairs, so a link group
//! gets two links (ADD LINK over the second path). One path is cut mid-transfer: the
//! connections move to the other link with nothing lost or duplicated; the path comes back:
//! the group has two links again; both are cut: the connections fail with an error.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{NetPair, TestInstall, in_netns, pattern, privileged, wait_until};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn runtime(install: &TestInstall, alt: std::net::Ipv4Addr) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    cfg.alt_addrs = vec![alt];
    Runtime::new(cfg)
}

/// What one direction of a connection moved: bytes, and whether every one was right.
struct Flow {
    bytes: AtomicU64,
    /// Why reading stopped early (an error), if it did.
    error: parking_lot::Mutex<Option<std::io::Error>>,
}

/// Writes `pattern(seed)` until `stop`, then half-closes; returns the bytes written or the
/// error that ended writing.
fn writer(mut c: SmcStream, seed: u64, stop: Arc<AtomicBool>) -> std::io::Result<u64> {
    let mut chunk = vec![0u8; 64 * 1024 + 7];
    let mut pos = 0u64;
    while !stop.load(Ordering::Relaxed) {
        pattern(seed, pos, &mut chunk);
        c.write_all(&chunk)?;
        pos += chunk.len() as u64;
    }
    c.shutdown(std::net::Shutdown::Write)?;
    // Keep the connection until the peer has read everything and closed.
    let mut rest = Vec::new();
    c.read_to_end(&mut rest)?;
    Ok(pos)
}

/// Reads to EOF checking `pattern(seed)`, counting into `flow`.
fn reader(mut s: SmcStream, seed: u64, flow: Arc<Flow>) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut want = vec![0u8; buf.len()];
    let mut pos = 0u64;
    loop {
        match s.read(&mut buf) {
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
    let flows: Vec<Arc<Flow>> = (0..CONNS)
        .map(|_| {
            Arc::new(Flow {
                bytes: AtomicU64::new(0),
                error: parking_lot::Mutex::new(None),
            })
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let rt = server_rt.clone();
        let flows = flows.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let mut readers = Vec::new();
            for (i, flow) in flows.into_iter().enumerate() {
                let (s, _) = l.accept().unwrap();
                assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
                readers.push(std::thread::spawn(move || reader(s, 100 + i as u64, flow)));
            }
            for r in readers {
                r.join().unwrap();
            }
        })
    };
    rx.recv().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (ctx, crx) = std::sync::mpsc::channel();
    let client = {
        let rt = client_rt.clone();
        let stop = stop.clone();
        in_netns(&net.a, move || {
            let mut writers = Vec::new();
            for i in 0..CONNS {
                let c = SmcStream::connect(&rt, addr).unwrap();
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
                let stop = stop.clone();
                writers.push(std::thread::spawn(move || writer(c, 100 + i as u64, stop)));
            }
            ctx.send(()).unwrap();
            writers
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
    let moved = || {
        flows
            .iter()
            .map(|f| f.bytes.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let flowing = |what: &str| {
        let before = moved();
        let waited = wait_until(Duration::from_secs(10), || moved() > before + (8 << 20));
        assert!(
            moved() > before + (8 << 20),
            "{what}: data stopped ({waited:?})\n{}",
            summary()
        );
    };

    // 1. The server adds a link over the second path right after the first came up.
    let waited = wait_until(Duration::from_secs(10), || {
        both_links(&client_rt) && both_links(&server_rt)
    });
    assert!(
        both_links(&client_rt) && both_links(&server_rt),
        "two links per group ({waited:?}): client {:?}, server {:?}\n{}",
        client_rt.group_links(),
        server_rt.group_links(),
        summary()
    );
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
        "failover: both sides moved within {waited:?}; data flowing again {:?} after the cut",
        cut.elapsed()
    );
    assert_eq!(client_rt.group_links(), vec![1]);

    // 3. The path comes back: the group heals (two links again), the data keeps flowing.
    net.set_link(&net.a, &net.veth_a, true).unwrap();
    let back = Instant::now();
    let waited = wait_until(Duration::from_secs(20), || {
        both_links(&client_rt) && both_links(&server_rt)
    });
    assert!(
        both_links(&client_rt) && both_links(&server_rt),
        "healed ({waited:?}): client {:?}, server {:?}\n{}",
        client_rt.group_links(),
        server_rt.group_links(),
        summary()
    );
    eprintln!("healed {:?} after the path came back", back.elapsed());
    flowing("healed");

    // 4. Nothing lost or duplicated: the writers stop; every byte arrived, in order
    // (`reader` checks each one).
    stop.store(true, Ordering::Relaxed);
    let written: Vec<u64> = client
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("writing"))
        .collect();
    server.join().unwrap();
    for (i, f) in flows.iter().enumerate() {
        assert!(f.error.lock().is_none(), "conn {i}: {:?}", f.error.lock());
        assert_eq!(
            f.bytes.load(Ordering::Relaxed),
            written[i],
            "conn {i}: bytes"
        );
    }
    eprintln!(
        "moved {} MiB over {CONNS} connections, {} failover(s)",
        written.iter().sum::<u64>() >> 20,
        client_rt.failovers()
    );

    // 5. Both paths cut under a new transfer: the group has no link left; its
    // connections fail with an error, never hang.
    let (tx, rx) = std::sync::mpsc::channel();
    let flow = Arc::new(Flow {
        bytes: AtomicU64::new(0),
        error: parking_lot::Mutex::new(None),
    });
    let server = {
        let rt = server_rt.clone();
        let flow = flow.clone();
        let addr: SocketAddr = (net.addr_b, 7901).into();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (s, _) = l.accept().unwrap();
            reader(s, 200, flow);
        })
    };
    rx.recv().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let rt = client_rt.clone();
        let stop = stop.clone();
        let addr: SocketAddr = (net.addr_b, 7901).into();
        in_netns(&net.a, move || {
            let c = SmcStream::connect(&rt, addr).unwrap();
            assert_eq!(
                c.mode(),
                &Mode::SmcR {
                    first_contact: false
                }
            );
            writer(c, 200, stop)
        })
    };
    let waited = wait_until(Duration::from_secs(10), || {
        flow.bytes.load(Ordering::Relaxed) > 8 << 20
    });
    assert!(flow.bytes.load(Ordering::Relaxed) > 8 << 20, "{waited:?}");
    let cut = Instant::now();
    net.set_link(&net.a, &net.veth_a, false).unwrap();
    net.set_link(&net.a, &second.veth_a, false).unwrap();
    let err = client
        .join()
        .unwrap()
        .expect_err("writing with no link left");
    let took = cut.elapsed();
    eprintln!("no link left: the writer failed after {took:?}: {err}");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
        ),
        "{err}"
    );
    server.join().unwrap();
    assert!(
        flow.error.lock().is_some(),
        "the reader sees an error too, not EOF"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    stop.store(true, Ordering::Relaxed);
}
