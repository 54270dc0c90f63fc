//! Two hosts (network namespaces joined by veth), capability signalled by the TCP option
//! program: SMC-R between our ends with one link group for many connections, and fallback to
//! TCP with the right reason against plain TCP peers and declining servers.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;

use clc::DeclineReason;
use common::{
    NetPair, TestInstall, check_pattern, in_netns, nft, pattern, privileged, send_pattern,
    wait_until,
};
use smcr::{FallbackReason, Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn runtime(install: &TestInstall) -> Runtime {
    runtime_with(install, |_| {})
}

/// [`runtime`] with `adjust` applied to the configuration first.
fn runtime_with(install: &TestInstall, adjust: impl FnOnce(&mut RuntimeConfig)) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    // Two namespaces stand for two hosts: the RoCE path (not shared memory through the
    // host-wide rendezvous).
    cfg.same_host = false;
    adjust(&mut cfg);
    Runtime::new(cfg)
}

/// How a connection whose peer or link died fails (TCP's errors for a dead peer).
fn is_peer_gone(kind: std::io::ErrorKind) -> bool {
    matches!(
        kind,
        std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
    )
}

/// Echoes every connection until EOF; returns the modes it saw.
fn echo_server(l: SmcListener, conns: usize) -> Vec<Mode> {
    let mut modes = Vec::new();
    for _ in 0..conns {
        let (mut s, _) = l.accept().unwrap();
        modes.push(s.mode().clone());
        let mut buf = [0u8; 2048];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
    }
    modes
}

fn echo_once(c: &mut SmcStream, msg: &[u8]) {
    c.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn thousand_sequential_connections_share_one_link_group() {
    if !privileged("netns 1000 connections") {
        return;
    }
    let install = TestInstall::new("seq");
    let net = NetPair::new().unwrap();
    let server_addr: SocketAddr = (net.addr_b, 7100).into();
    let n: usize = std::env::var("SMCR_TEST_CONNS").map_or(1000, |v| v.parse().unwrap());
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, server_addr).unwrap();
            tx.send(()).unwrap();
            let modes = echo_server(l, n);
            (modes, rt.links_confirmed())
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = runtime(&install);
        in_netns(&net.a, move || {
            let t0 = std::time::Instant::now();
            for i in 0..n {
                let mut c = SmcStream::connect(&rt, server_addr).unwrap();
                if std::env::var_os("SMCR_TEST_DEBUG").is_some() {
                    c.set_read_timeout(Some(std::time::Duration::from_secs(3)))
                        .unwrap();
                    if let Err(e) = c
                        .write_all(b"probe")
                        .and_then(|_| c.read_exact(&mut [0u8; 5]))
                    {
                        panic!("{e}\n{}", rt.debug_summary());
                    }
                }
                assert_eq!(
                    c.mode(),
                    &Mode::SmcR {
                        first_contact: i == 0
                    },
                    "connection {i}"
                );
                echo_once(&mut c, format!("message {i}").as_bytes());
            }
            let secs = t0.elapsed().as_secs_f64();
            eprintln!(
                "{n} sequential SMC-R connections: {secs:.2} s ({:.0}/s)",
                n as f64 / secs
            );
            let confirmed = rt.links_confirmed();
            rt.shutdown();
            confirmed
        })
    };
    let client_confirmed = client.join().unwrap();
    let (modes, server_confirmed) = server.join().unwrap();
    assert!(modes.iter().all(|m| matches!(m, Mode::SmcR { .. })));
    assert_eq!(
        client_confirmed, 1,
        "one CONFIRM LINK exchange for all connections"
    );
    assert_eq!(server_confirmed, 1);
}

#[test]
fn fallback_against_plain_peers_and_declines() {
    if !privileged("netns fallback") {
        return;
    }
    let install = TestInstall::new("fallback");
    let net = NetPair::new().unwrap();
    let plain_addr: SocketAddr = (net.addr_b, 7200).into();
    let smc_addr: SocketAddr = (net.addr_b, 7201).into();
    let stingy_addr: SocketAddr = (net.addr_b, 7202).into();
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        let mut stingy_cfg = rt.config().clone();
        stingy_cfg.rmb_budget = 0;
        let stingy = Runtime::new(stingy_cfg);
        in_netns(&net.b, move || {
            let plain = TcpListener::bind(plain_addr).unwrap();
            let smc = SmcListener::bind(&rt, smc_addr).unwrap();
            let stingy = SmcListener::bind(&stingy, stingy_addr).unwrap();
            tx.send(()).unwrap();
            // 1. our client → plain server: a plain echo.
            let (mut s, _) = plain.accept().unwrap();
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).unwrap();
            s.write_all(&buf[..n]).unwrap();
            drop(s);
            // 2. plain client → our server; 3. our client → declining server.
            let m2 = echo_server(smc, 1);
            let m3 = echo_server(stingy, 1);
            (m2, m3)
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = runtime(&install);
        in_netns(&net.a, move || {
            let mut c = SmcStream::connect(&rt, plain_addr).unwrap();
            let m1 = c.mode().clone();
            c.write_all(b"plain peer").unwrap();
            let mut back = [0u8; 10];
            c.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"plain peer");
            // The plain server saw exactly our bytes: no CLC byte went out.
            let mut plain = TcpStream::connect(smc_addr).unwrap();
            plain.write_all(b"from a plain client").unwrap();
            let mut back = [0u8; 19];
            plain.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"from a plain client");
            drop(plain);
            let mut c3 = SmcStream::connect(&rt, stingy_addr).unwrap();
            let m3 = c3.mode().clone();
            echo_once(&mut c3, b"after a decline the TCP stream is clean");
            (m1, m3)
        })
    };
    let (m1, m3) = client.join().unwrap();
    let (m2, m3_server) = server.join().unwrap();
    assert_eq!(m1, Mode::Tcp(FallbackReason::PeerNoSmc));
    assert_eq!(m2, vec![Mode::Tcp(FallbackReason::PeerNoSmc)]);
    assert_eq!(
        m3,
        Mode::Tcp(FallbackReason::Declined {
            reason: DeclineReason::MEM,
            by_peer: true
        })
    );
    assert_eq!(
        m3_server,
        vec![Mode::Tcp(FallbackReason::Declined {
            reason: DeclineReason::MEM,
            by_peer: false
        })]
    );
}

#[test]
fn concurrent_connections_and_a_gibibyte_and_half_close() {
    if !privileged("netns bulk") {
        return;
    }
    let install = TestInstall::new("bulk");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7300).into();
    const CONNS: u64 = 64;
    const EACH: u64 = 16 << 20;
    const BIG: u64 = 1 << 30;
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let mut handles = Vec::new();
            for _ in 0..CONNS + 1 {
                let (mut s, _) = l.accept().unwrap();
                assert!(matches!(s.mode(), Mode::SmcR { .. }));
                handles.push(std::thread::spawn(move || {
                    // The client says which stream it sends; we check it, answer with the count
                    // (the peer has half-closed: we can still write), then send our own stream.
                    let mut seed = [0u8; 8];
                    s.read_exact(&mut seed).unwrap();
                    let seed = u64::from_le_bytes(seed);
                    let (got, _) = check_pattern(&mut s, seed);
                    s.write_all(&got.to_le_bytes()).unwrap();
                    send_pattern(&mut s, !seed, 1 << 20);
                    got
                }));
            }
            let mut total = 0;
            for h in handles {
                total += h.join().unwrap();
            }
            (total, rt.links_confirmed())
        })
    };
    rx.recv().unwrap();
    let rt = runtime(&install);
    let client = in_netns(&net.a, move || {
        let t0 = std::time::Instant::now();
        let mut handles = Vec::new();
        for i in 0..CONNS + 1 {
            let rt = rt.clone();
            handles.push(std::thread::spawn(move || {
                let (seed, total) = if i == CONNS { (999, BIG) } else { (i, EACH) };
                let mut c = SmcStream::connect(&rt, addr).unwrap();
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
                c.write_all(&seed.to_le_bytes()).unwrap();
                send_pattern(&mut c, seed, total);
                // Half-closed: reading still works, both the count and the server's stream.
                let mut got = [0u8; 8];
                c.read_exact(&mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), total);
                assert_eq!(check_pattern(&mut c, !seed).0, 1 << 20);
                total
            }));
        }
        let sum: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        let secs = t0.elapsed().as_secs_f64();
        eprintln!(
            "{} connections moved {} MiB in {secs:.2} s ({:.2} Gbit/s)",
            CONNS + 1,
            sum >> 20,
            sum as f64 * 8.0 / secs / 1e9
        );
        (sum, rt.links_confirmed())
    });
    let (sent, client_links) = client.join().unwrap();
    let (received, server_links) = server.join().unwrap();
    assert_eq!(sent, CONNS * EACH + BIG);
    assert_eq!(received, sent);
    assert_eq!(
        (client_links, server_links),
        (1, 1),
        "one link group for all"
    );
}

/// Run as a child process by `killed_server_fails_the_client_promptly`: an SMC-R sink in the
/// namespace it is started in.
/// What a test run as a child process gets from its parent: the option program's install
/// (the parent's: never removed here), the namespace to run in and the address. `None` when
/// the test runs on its own (it then does nothing).
struct ChildEnv {
    install: std::mem::ManuallyDrop<TestInstall>,
    ns: String,
    addr: String,
}

fn child_env() -> Option<ChildEnv> {
    Some(ChildEnv {
        install: std::mem::ManuallyDrop::new(TestInstall(
            std::env::var_os("SMCR_TEST_BPF_DIR")?.into(),
        )),
        ns: std::env::var("SMCR_TEST_NETNS").ok()?,
        addr: std::env::var("SMCR_TEST_ADDR").ok()?,
    })
}

/// Starts the ignored test `name` as a child process in namespace `ns` with `install` and
/// `addr` (and `extra` variables); its stdout (and stdin, with `stdin`) piped.
fn spawn_child(
    name: &str,
    ns: &str,
    install: &TestInstall,
    addr: impl ToString,
    extra: &[(&str, String)],
    stdin: bool,
) -> std::process::Child {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--ignored", "--nocapture"])
        .env("SMCR_TEST_NETNS", ns)
        .env("SMCR_TEST_BPF_DIR", &install.0)
        .env("SMCR_TEST_ADDR", addr.to_string())
        .envs(extra.iter().map(|(k, v)| (*k, v)))
        .stdout(std::process::Stdio::piped());
    if stdin {
        cmd.stdin(std::process::Stdio::piped());
    }
    cmd.spawn().unwrap()
}

#[test]
#[ignore = "run as a child process"]
fn sink_server_child() {
    let Some(env) = child_env() else {
        return;
    };
    // setns in a thread rather than `ip netns exec`, which remounts /sys and hides bpffs.
    in_netns(&env.ns.clone(), move || {
        let rt = runtime(&env.install);
        let l = SmcListener::bind(&rt, env.addr.parse::<std::net::SocketAddr>().unwrap()).unwrap();
        println!("READY");
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        while s.read(&mut buf).unwrap() > 0 {}
    })
    .join()
    .unwrap();
}

/// Starts `sink_server_child` in namespace `b` on `addr` and waits until it listens.
fn start_sink_server(
    net: &NetPair,
    install: &TestInstall,
    addr: SocketAddr,
) -> std::process::Child {
    use std::io::BufRead;
    let mut child = spawn_child("sink_server_child", &net.b, install, addr, &[], false);
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains("READY")));
    child
}

#[test]
fn killed_server_fails_the_client_promptly() {
    if !privileged("netns kill") {
        return;
    }
    let install = TestInstall::new("kill");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7400).into();
    let mut child = start_sink_server(&net, &install, addr);
    let pid = child.id() as i32;
    let rt = runtime(&install);
    let client = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }));
        let chunk = vec![0x5au8; 64 * 1024];
        let t0 = std::time::Instant::now();
        let mut killed_at = None;
        loop {
            if killed_at.is_none() && t0.elapsed() > std::time::Duration::from_millis(300) {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed_at = Some(std::time::Instant::now());
            }
            if let Err(e) = c.write_all(&chunk) {
                let after = killed_at.expect("error before the kill").elapsed();
                return (e.kind(), after);
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(30),
                "client hangs"
            );
        }
    });
    let (kind, after) = client.join().unwrap();
    let _ = child.wait();
    eprintln!("client saw {kind:?} {after:?} after the kill");
    assert!(is_peer_gone(kind), "{kind:?}");
    assert!(after < std::time::Duration::from_secs(10), "{after:?}");
}

/// A client that only waits to read learns promptly that the server's process died: the
/// kernel closes the TCP connection under the SMC-R one, the group's TCP watch sees it at once
/// and probes the link, and the probe finds nobody.
#[test]
fn killed_server_fails_an_idle_reader_promptly() {
    if !privileged("netns kill idle") {
        return;
    }
    use std::io::Read;
    let install = TestInstall::new("killidle");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7401).into();
    let mut child = start_sink_server(&net, &install, addr);
    let pid = child.id() as i32;
    let rt = runtime(&install);
    let client = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            std::time::Instant::now()
        });
        let r = c.read(&mut [0u8; 16]);
        let killed_at = killer.join().unwrap();
        (r.map_err(|e| e.kind()), killed_at.elapsed())
    });
    let (r, after) = client.join().unwrap();
    let _ = child.wait();
    eprintln!("idle reader saw {r:?} {after:?} after the kill");
    assert!(matches!(r, Ok(0)) || r.is_err_and(is_peer_gone), "{r:?}");
    assert!(after < std::time::Duration::from_secs(5), "{after:?}");
}

/// The TCP connection under a live SMC-R connection is reset (`ss -K` destroys the server's
/// socket: RST to the client, ECONNABORTED locally), both processes alive: the data path does
/// not depend on it. Both ends see the hang-up, probe their link, get an answer, and the
/// connection goes on moving data and closes cleanly on the same link group.
#[test]
fn a_tcp_reset_under_a_live_connection_leaves_it_working() {
    if !privileged("netns tcp reset") || !common::have_tool("netns tcp reset", "ss") {
        return;
    }
    let install = TestInstall::new("tcprst");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7402).into();
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            assert!(matches!(s.mode(), Mode::SmcR { .. }));
            let mut total = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = s.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).unwrap();
                total += n as u64;
            }
            drop(s);
            // The runtime goes back with the results: dropping it here would delete the
            // group (DELETE LINK) before the client has looked at its own.
            (total, rt.links_confirmed(), rt.link_groups(), rt)
        })
    };
    rx.recv().unwrap();
    let rt = runtime(&install);
    let ns_b = net.b.clone();
    let client = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let round = |c: &mut SmcStream, seed: u64| {
            let mut out = vec![0u8; 100_000];
            pattern(seed, 0, &mut out);
            c.write_all(&out).unwrap();
            let mut back = vec![0u8; out.len()];
            c.read_exact(&mut back).unwrap();
            assert!(back == out, "round {seed}: echo differs");
        };
        round(&mut c, 1);
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &ns_b, "ss", "-K", "state", "established"])
            .arg("( sport = :7402 )")
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(":7402"),
            "ss -K killed nothing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Long enough for both hang-ups to be seen and both probes answered.
        std::thread::sleep(std::time::Duration::from_millis(500));
        for seed in 2..12 {
            round(&mut c, seed);
        }
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        (rt.links_confirmed(), rt.link_groups())
    });
    let (client_links, client_groups) = client.join().unwrap();
    let (echoed, server_links, server_groups, _server_rt) = server.join().unwrap();
    assert_eq!(echoed, 11 * 100_000);
    assert_eq!((client_links, server_links), (1, 1), "no new link group");
    assert_eq!(
        (client_groups, server_groups),
        (1, 1),
        "the group is still up on both sides"
    );
}

/// A client that goes away after the server's Accept (as if killed mid-handshake: it never
/// confirms, its TCP connection closes): the server's handshake ends at the EOF, and the link
/// group, token and RMB it had set up for that client go; the next client gets SMC-R.
#[test]
fn a_client_gone_after_the_accept_leaves_nothing_behind() {
    if !privileged("netns handshake abandoned") {
        return;
    }
    use smcr::handshake::{Client, Event};
    use std::os::fd::AsFd;
    let install = TestInstall::new("abandon");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7404).into();
    let (tx, rx) = mpsc::channel();
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            // The abandoned handshake may or may not surface as a (fallen back) connection;
            // the first SMC-R one is the real client's.
            loop {
                let (mut s, _) = l.accept().unwrap();
                if matches!(s.mode(), Mode::SmcR { .. }) {
                    echo_once(&mut s, b"after");
                    return;
                }
            }
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime(&install);
    let ip_a = net.addr_a;
    let rt = client_rt.clone();
    let abandoned = in_netns(&net.a, move || {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        assert!(rt.mark(sock.as_fd()), "the option program marks the socket");
        sock.connect(&addr.into()).unwrap();
        let mut tcp: std::net::TcpStream = sock.into();
        let cfg = RuntimeConfig::new().handshake;
        let mut hs = Client::new(cfg, clc::Gid::from_ipv4(ip_a), std::time::Instant::now());
        while let Some(b) = hs.poll_transmit() {
            tcp.write_all(&b).unwrap();
        }
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tcp.read(&mut buf).unwrap();
            assert!(n > 0, "EOF before the Accept");
            let mut at = 0;
            while at < n {
                at += hs.handle_data(&buf[at..n]);
            }
            match hs.poll_event() {
                Some(Event::Accepted { .. }) => return tcp,
                None => {}
                Some(other) => panic!("expected Accept, got {other:?}"),
            }
        }
    });
    let tcp = abandoned.join().unwrap();
    // The server has set the client up (a new link group, listed once its link is
    // confirmed, and an RMB) and waits for a Confirm.
    assert!(server_rt.rmb_in_use() > 0, "the server holds an RMB");
    // The client goes without confirming.
    drop(tcp);
    // The server gives up at the EOF, long before its 6 s CLC wait.
    let waited = wait_until(std::time::Duration::from_secs(3), || {
        server_rt.link_groups() == 0 && server_rt.rmb_in_use() == 0
    });
    assert_eq!(
        (server_rt.link_groups(), server_rt.rmb_in_use()),
        (0, 0),
        "after {waited:?}: the abandoned group or RMB is still held"
    );
    let rt = client_rt.clone();
    let client = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        echo_once(&mut c, b"after");
    });
    client.join().unwrap();
    server.join().unwrap();
}

/// The only link dies mid-transfer (the veth goes down; both processes stay alive): the
/// writer gets an error when its retransmissions run out (~6 s), the reader, which has
/// nothing in flight, when the keepalive's TEST LINK goes unanswered (its idle time here 3 s
/// instead of Linux's 30 s, to keep the test short) — neither hangs, as a TCP reader would —
/// and each runtime frees the group and its RMBs once the streams are dropped.
#[test]
fn the_only_link_dying_fails_its_connections_promptly() {
    if !privileged("netns link down") {
        return;
    }
    let install = TestInstall::new("linkdown");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7405).into();
    let (tx, rx) = mpsc::channel();
    let (down_tx, down_rx) = mpsc::channel::<std::time::Instant>();
    let keepalive = std::time::Duration::from_secs(3);
    let runtime =
        |install: &TestInstall| runtime_with(install, |cfg| cfg.test_link_time = Some(keepalive));
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            assert!(matches!(s.mode(), Mode::SmcR { .. }));
            let mut buf = vec![0u8; 256 * 1024];
            let err = loop {
                match s.read(&mut buf) {
                    Ok(0) => panic!("EOF instead of an error"),
                    Ok(_) => {}
                    Err(e) => break e.kind(),
                }
            };
            let after = down_rx.recv().unwrap().elapsed();
            (err, after)
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime(&install);
    let rt = client_rt.clone();
    let (ns_a, veth_a) = (net.a.clone(), net.veth_a.clone());
    let client = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let chunk = vec![0x3cu8; 128 * 1024];
        let t0 = std::time::Instant::now();
        let mut down_at = None;
        loop {
            if down_at.is_none() && t0.elapsed() > std::time::Duration::from_millis(300) {
                let ok = std::process::Command::new("ip")
                    .args(["-n", &ns_a, "link", "set", &veth_a, "down"])
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "ip link set down");
                let now = std::time::Instant::now();
                down_tx.send(now).unwrap();
                down_at = Some(now);
            }
            if let Err(e) = c.write_all(&chunk) {
                return (
                    e.kind(),
                    down_at.expect("error before the link went down").elapsed(),
                );
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "writer hangs"
            );
        }
    });
    let (werr, wafter) = client.join().unwrap();
    let (rerr, rafter) = server.join().unwrap();
    eprintln!("writer: {werr:?} after {wafter:?}; reader: {rerr:?} after {rafter:?}");
    for (who, kind, after) in [("writer", werr, wafter), ("reader", rerr, rafter)] {
        assert!(is_peer_gone(kind), "{who}: {kind:?}");
        assert!(
            // Retries: 7, from ~134 ms doubling to a ceiling; keepalive: idle time + LLC_WAIT.
            after < std::time::Duration::from_secs(10) + keepalive,
            "{who}: {after:?}"
        );
    }
    // The streams are gone: nothing of the dead group stays held.
    wait_until(std::time::Duration::from_secs(5), || {
        client_rt.link_groups() + server_rt.link_groups() == 0
            && client_rt.rmb_in_use() + server_rt.rmb_in_use() == 0
    });
    assert_eq!(
        (
            client_rt.link_groups(),
            server_rt.link_groups(),
            client_rt.rmb_in_use(),
            server_rt.rmb_in_use()
        ),
        (0, 0, 0, 0),
        "groups and RMBs after the link died"
    );
}

/// Run as a child process by `restarted_client_gets_a_new_link_group`: connects, reports, waits
/// to be killed.
#[test]
#[ignore = "run as a child process"]
fn idle_client_child() {
    let Some(env) = child_env() else {
        return;
    };
    in_netns(&env.ns.clone(), move || {
        let rt = runtime(&env.install);
        let c = SmcStream::connect(&rt, env.addr.parse::<SocketAddr>().unwrap()).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }));
        println!("CONNECTED");
        std::thread::sleep(std::time::Duration::from_secs(60));
        drop(c);
    })
    .join()
    .unwrap();
}

#[test]
fn restarted_client_gets_a_new_link_group() {
    if !privileged("netns restart") {
        return;
    }
    use std::io::BufRead;
    let install = TestInstall::new("restart");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7500).into();
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            // The killed client's connection, then the new client's three.
            let (first, _) = l.accept().unwrap();
            assert!(
                matches!(first.mode(), Mode::SmcR { .. }),
                "{:?}",
                first.mode()
            );
            tx.send(()).unwrap();
            echo_server(l, 3)
        })
    };
    rx.recv().unwrap();
    // A client process makes the link group, then dies without DELETE LINK.
    let mut child = spawn_child("idle_client_child", &net.a, &install, addr, &[], false);
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains("CONNECTED")));
    // Killed only once the server has the connection too: a client killed while the server
    // still confirms the link fails that handshake, and the connection never reaches accept
    // (the new client's first connection would be taken for it).
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the server accepted the killed client's connection");
    child.kill().unwrap();
    let _ = child.wait();
    // At once, a new process on the same address (the server may still think the old group
    // is alive): its connections still work, and once the stale group is gone they are SMC-R.
    let rt = runtime(&install);
    let modes = in_netns(&net.a, move || {
        let mut modes = Vec::new();
        for i in 0..3 {
            let mut c = SmcStream::connect(&rt, addr).unwrap();
            modes.push(c.mode().clone());
            // Fails rather than hangs should the echo never come.
            c.set_read_timeout(Some(std::time::Duration::from_secs(60)))
                .unwrap();
            echo_once(&mut c, format!("new client {i}").as_bytes());
        }
        modes
    })
    .join()
    .unwrap();
    eprintln!("new client's modes: {modes:?}");
    // At most the first connection falls back: the server offers the dead process's group,
    // notices it is dead (the client declines SYNCERR, or the group's CONFIRM RKEY goes
    // unanswered: ERR_REGBUF) and ends it.
    assert!(matches!(modes[1], Mode::SmcR { .. }), "{modes:?}");
    assert!(matches!(modes[2], Mode::SmcR { .. }), "{modes:?}");
    let stale = [DeclineReason::SYNCERR, DeclineReason::ERR_REGBUF];
    assert!(
        matches!(&modes[0], Mode::SmcR { .. })
            || matches!(&modes[0], Mode::Tcp(FallbackReason::Declined { reason, .. }) if stale.contains(reason)),
        "{modes:?}"
    );
    let server_modes = server.join().unwrap();
    assert_eq!(server_modes.len(), 3);
}

#[test]
fn data_and_close_in_flight_when_the_peer_deletes_its_link_group_still_arrive() {
    // The server writes, closes and shuts its runtime down (DELETE LINK) while none of its
    // RoCE packets reach the client: its data, close CDC and DELETE LINK must be retransmitted
    // after the group was deleted, as TCP delivers what a process wrote before it ended. (Was:
    // the queue pair failed at once, the client waited for the close until TEST LINK failed.)
    if !privileged("netns delete with data in flight") || !common::have_tool("netns delete", "nft")
    {
        return;
    }
    let install = TestInstall::new("inflight");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7400).into();
    const LEN: usize = 100_000;
    let (ready_tx, ready_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            ready_tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            assert!(matches!(s.mode(), Mode::SmcR { .. }));
            go_rx.recv().unwrap();
            let mut data = vec![0u8; LEN];
            pattern(5, 0, &mut data);
            s.write_all(&data).unwrap();
            drop(s);
            rt.shutdown();
        })
    };
    ready_rx.recv().unwrap();
    let rt = runtime(&install);
    let ns_a = net.a.clone();
    let client = in_netns(&net.a, move || {
        let c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        nft(
            &ns_a,
            "table inet smcr_test { chain input { type filter hook input priority 0; udp dport 4791 drop; }; }",
        );
        go_tx.send(()).unwrap();
        (c, rt)
    });
    let (mut c, rt) = client.join().unwrap();
    server.join().unwrap();
    // Everything the server sent so far was dropped; its transport retries for about a second.
    std::thread::sleep(std::time::Duration::from_millis(300));
    nft(&net.a, "delete table inet smcr_test");
    let t = std::time::Instant::now();
    let mut got = Vec::new();
    c.read_to_end(&mut got)
        .unwrap_or_else(|e| panic!("{e} after {} bytes, {:?}", got.len(), t.elapsed()));
    let mut want = vec![0u8; LEN];
    pattern(5, 0, &mut want);
    assert!(got == want, "{} bytes", got.len());
    drop(c);
    rt.shutdown();
}

/// Resident set size of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Raises this process's soft descriptor limit (children inherit it) to its hard limit (which
/// root without CAP_SYS_RESOURCE cannot raise); returns it.
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls with valid arguments.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    lim.rlim_cur
}

/// Run as a child process by `ten_thousand_concurrent_connections_from_one_process`: accepts
/// `SMCR_TEST_CONNS` connections, echoes 8 bytes on each and keeps them all open; reports its
/// memory and link groups, then echoes once more on each and waits for every EOF.
#[test]
#[ignore = "run as a child process"]
fn hold_server_child() {
    let (Some(env), Some(n)) = (child_env(), std::env::var("SMCR_TEST_CONNS").ok()) else {
        return;
    };
    let n: usize = n.parse().unwrap();
    in_netns(&env.ns.clone(), move || {
        let rt = runtime(&env.install);
        let l = SmcListener::bind(&rt, env.addr.parse::<std::net::SocketAddr>().unwrap()).unwrap();
        let base = rss_kib(std::process::id());
        println!("READY");
        let mut conns = Vec::with_capacity(n);
        let mut smcr = 0;
        for _ in 0..n {
            let (mut s, _) = l.accept().unwrap();
            smcr += usize::from(matches!(s.mode(), Mode::SmcR { .. }));
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            conns.push(s);
        }
        println!(
            "HELD smcr={smcr} groups={} rss_kib={} base_kib={base} rmb={}",
            rt.link_groups(),
            rss_kib(std::process::id()),
            rt.rmb_in_use()
        );
        for s in &mut conns {
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
        }
        for mut s in conns {
            assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
        }
        println!("DONE");
    })
    .join()
    .unwrap();
}

/// Issue 8's resource limit: 10 000 concurrent SMC-R connections from one client process to
/// one server process (40 link groups of 255), each checked by an echo when opened and again
/// once all are open; memory per connection reported and bounded.
#[test]
fn ten_thousand_concurrent_connections_from_one_process() {
    if !privileged("netns 10000 connections") {
        return;
    }
    use std::io::BufRead;
    let n: usize = std::env::var("SMCR_TEST_CONCURRENT").map_or(10_000, |v| v.parse().unwrap());
    let nofile = raise_nofile();
    eprintln!("descriptor limit {nofile}");
    let install = TestInstall::new("many");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7407).into();
    let mut child = spawn_child(
        "hold_server_child",
        &net.b,
        &install,
        addr,
        &[("SMCR_TEST_CONNS", n.to_string())],
        false,
    );
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains("READY")));
    let rt = runtime(&install);
    let me = std::process::id();
    let base = rss_kib(me);
    let client = in_netns(&net.a, move || {
        let t0 = std::time::Instant::now();
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            let mut c =
                SmcStream::connect(&rt, addr).unwrap_or_else(|e| panic!("connection {i}: {e}"));
            assert!(
                matches!(c.mode(), Mode::SmcR { .. }),
                "connection {i}: {:?}",
                c.mode()
            );
            let m = (i as u64).to_le_bytes();
            c.write_all(&m).unwrap();
            let mut b = [0u8; 8];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b, m, "connection {i}");
            conns.push(c);
        }
        let opened = t0.elapsed();
        let rss = rss_kib(me);
        let groups = rt.link_groups();
        for (i, c) in conns.iter_mut().enumerate() {
            let m = (!(i as u64)).to_le_bytes();
            c.write_all(&m).unwrap();
            let mut b = [0u8; 8];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b, m, "connection {i}, second echo");
        }
        drop(conns);
        (opened, rss, groups, rt)
    });
    let (opened, rss, groups, rt) = client.join().unwrap();
    let held = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("HELD"))
        .expect("the server reports");
    assert!(lines.any(|l| l.unwrap().contains("DONE")), "server ends");
    assert!(child.wait().unwrap().success());
    let per_conn = rss.saturating_sub(base) as f64 / n as f64;
    eprintln!(
        "{n} concurrent SMC-R connections opened in {:.1} s ({:.0}/s); client: {groups} link \
         groups, RSS +{} MiB ({per_conn:.1} KiB per connection); server: {held}",
        opened.as_secs_f64(),
        n as f64 / opened.as_secs_f64(),
        rss.saturating_sub(base) / 1024
    );
    assert_eq!(groups, n.div_ceil(255), "255 connections per link group");
    assert!(held.contains(&format!("smcr={n}")), "{held}");
    // RMBs are not touched until data arrives: a connection costs its bookkeeping, not 64 KiB.
    assert!(per_conn < 48.0, "{per_conn:.1} KiB per connection");
    rt.shutdown();
}

/// RMB memory runs out with connections held open: beyond the server's budget every new
/// connection is declined with MEM (by the server) and goes on over TCP, echoing intact;
/// the same beyond the client's own budget (declined by the client); once SMC-R connections
/// close, their pooled RMBs serve new ones over SMC-R again. Nothing crashes or hangs.
#[test]
fn rmb_budget_exhaustion_declines_with_mem_and_recovers() {
    if !privileged("netns rmb exhaustion") {
        return;
    }
    const RMB: u64 = 64 * 1024;
    let install = TestInstall::new("budget");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7408).into();
    let stingy_addr: SocketAddr = (net.addr_b, 7409).into();
    let small = |budget: u64| {
        move |c: &mut RuntimeConfig| {
            c.rmb_budget = budget;
            c.remote_rmb_size = None;
        }
    };
    // One runtime serves both listeners (two engines cannot share an address).
    let server_rt = runtime_with(&install, small(200 * RMB));
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            let l2 = SmcListener::bind(&rt, stingy_addr).unwrap();
            tx.send(()).unwrap();
            // Every connection, on either listener, echoes until EOF on a thread of its own.
            let serve = |l: SmcListener| {
                std::thread::spawn(move || {
                    let mut modes = Vec::new();
                    let mut threads = Vec::new();
                    while let Ok((mut s, _)) = l.accept() {
                        let done = s.mode() == &Mode::Tcp(FallbackReason::PeerNoSmc);
                        modes.push(s.mode().clone());
                        threads.push(std::thread::spawn(move || {
                            let mut buf = [0u8; 256];
                            loop {
                                match s.read(&mut buf) {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => s.write_all(&buf[..n]).unwrap(),
                                }
                            }
                        }));
                        if done {
                            break; // the plain "stop" connection
                        }
                    }
                    for t in threads {
                        t.join().unwrap();
                    }
                    modes
                })
            };
            let a = serve(l);
            let b = serve(l2);
            (a.join().unwrap(), b.join().unwrap())
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime_with(&install, small(1 << 30));
    let stingy_client = runtime_with(&install, small(50 * RMB));
    let rt = client_rt.clone();
    let server_rt2 = server_rt.clone();
    let client = in_netns(&net.a, move || {
        let open = |rt: &Runtime, to: SocketAddr, i: usize| {
            let mut c = SmcStream::connect(rt, to).unwrap_or_else(|e| panic!("{i}: {e}"));
            let m = format!("connection {i}");
            c.write_all(m.as_bytes()).unwrap();
            let mut b = vec![0u8; m.len()];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b, m.as_bytes());
            c
        };
        let mode_counts = |cs: &[SmcStream]| {
            let mut smc = 0;
            let mut other = std::collections::BTreeMap::new();
            for c in cs {
                match c.mode() {
                    Mode::SmcR { .. } => smc += 1,
                    m => *other.entry(format!("{m:?}")).or_insert(0) += 1,
                }
            }
            (smc, other)
        };
        // 1. A client's own budget: 50 RMBs (the server has room for 200).
        let stingy: Vec<SmcStream> = (0..60)
            .map(|i| open(&stingy_client, stingy_addr, i))
            .collect();
        let first = mode_counts(&stingy);
        // That client goes (two engines cannot share its address): its link group ends on
        // both sides and the server's 50 RMBs are freed with it.
        drop(stingy);
        stingy_client.shutdown();
        drop(stingy_client);
        wait_until(std::time::Duration::from_secs(5), || {
            server_rt2.rmb_in_use() == 0
        });
        assert_eq!(
            server_rt2.rmb_in_use(),
            0,
            "the server freed the group's RMBs"
        );
        // 2. The server's budget: 200 RMBs.
        let mut held: Vec<SmcStream> = (0..240).map(|i| open(&rt, addr, i)).collect();
        let second = mode_counts(&held);
        // 3. 100 SMC-R connections close; the RMBs they gave back to their link group's pool
        // serve new connections over SMC-R.
        let freed: Vec<SmcStream> = held.drain(..100).collect();
        for mut c in freed {
            c.shutdown(std::net::Shutdown::Write).unwrap();
            let _ = c.read_to_end(&mut Vec::new());
        }
        let again: Vec<SmcStream> = (0..40).map(|i| open(&rt, addr, 1000 + i)).collect();
        let third = mode_counts(&again);
        held.extend(again);
        // Everything still open still works.
        for (i, c) in held.iter_mut().enumerate() {
            c.write_all(b"x").unwrap();
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"x", "{i}");
        }
        drop(held);
        for to in [addr, stingy_addr] {
            drop(TcpStream::connect(to).unwrap()); // a plain connection: the server stops
        }
        (first, second, third)
    });
    let (first, second, third) = client.join().unwrap();
    let (_, _) = server.join().unwrap();
    eprintln!("client budget: {first:?}; server budget: {second:?}; after closes: {third:?}");
    let mem = |by_peer| {
        format!(
            "{:?}",
            Mode::Tcp(FallbackReason::Declined {
                reason: DeclineReason::MEM,
                by_peer
            })
        )
    };
    assert_eq!(first.0, 50);
    assert_eq!(first.1.get(&mem(false)), Some(&10), "{first:?}");
    assert_eq!(second.0, 200);
    assert_eq!(second.1.get(&mem(true)), Some(&40), "{second:?}");
    assert_eq!(third, (40, Default::default()));
}

/// The server's process dies in the middle of the handshake (played by a raw server that
/// closes its socket, as the kernel does for a killed process): after reading the Proposal,
/// and after sending its Accept (first contact: the client has set up a link group, a QP and
/// an RMB for it and waits for CONFIRM LINK, watching the TCP socket meanwhile); and after
/// its Accept with a reset (SO_LINGER 0), so that the client's Confirm cannot be sent. The
/// client's connect fails promptly in all three cases (no fallback is possible on a closed
/// socket) and leaves no group or RMB behind, checked right after the last connect: the
/// group made for a Confirm that failed ends with it, not at its CONFIRM LINK wait 4 s
/// later. The next connection to a live server gets SMC-R.
#[test]
fn a_server_gone_mid_handshake_fails_the_connect_and_leaves_nothing() {
    if !privileged("netns server gone mid-handshake") {
        return;
    }
    use smcr::handshake::{Endpoint, Event, Server};
    use std::os::fd::AsFd;
    let install = TestInstall::new("hsgone");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7410).into();
    let marker = runtime(&install);
    let (tx, rx) = mpsc::channel();
    let ip_b = net.addr_b;
    let raw = in_netns(&net.b, move || {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_reuse_address(true).unwrap();
        assert!(marker.mark(sock.as_fd()));
        sock.bind(&addr.into()).unwrap();
        sock.listen(8).unwrap();
        let l: TcpListener = sock.into();
        tx.send(()).unwrap();
        for (accept, reset) in [(false, false), (true, false), (true, true)] {
            let (mut tcp, _) = l.accept().unwrap();
            let mut hs = Server::new(RuntimeConfig::new().handshake, std::time::Instant::now());
            let mut buf = [0u8; 4096];
            loop {
                let n = tcp.read(&mut buf).unwrap();
                assert!(n > 0);
                let mut at = 0;
                while at < n {
                    at += hs.handle_data(&buf[at..n]);
                }
                if let Some(Event::Proposed { .. }) = hs.poll_event() {
                    break;
                }
            }
            if accept {
                let ep = Endpoint {
                    gid: clc::Gid::from_ipv4(ip_b),
                    mac: clc::Mac([2, 0, 10, 77, 0, 2]),
                    qpn: 0x4242,
                    initial_psn: 1,
                    mtu: clc::QpMtu::MTU_1024,
                    rmb_rkey: 0x77,
                    rmb_vaddr: 0x10000,
                    rmb_size: clc::RmbSize::round_up(65536),
                    token: 5,
                };
                hs.accept(&ep, true, std::time::Instant::now()).unwrap();
                while let Some(b) = hs.poll_transmit() {
                    tcp.write_all(&b).unwrap();
                }
            }
            if reset {
                socket2::SockRef::from(&tcp)
                    .set_linger(Some(std::time::Duration::ZERO))
                    .unwrap();
            }
            drop(tcp); // the process is gone
        }
    });
    rx.recv().unwrap();
    let rt = runtime(&install);
    let client_rt = rt.clone();
    let results = in_netns(&net.a, move || {
        let mut out = Vec::new();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let r = SmcStream::connect(&rt, addr).map(|s| s.mode().clone());
            out.push((r.map_err(|e| e.to_string()), t.elapsed()));
        }
        out
    })
    .join()
    .unwrap();
    raw.join().unwrap();
    for ((r, took), when) in results.iter().zip([
        "after the Proposal",
        "after the Accept",
        "after the Accept, with a reset",
    ]) {
        eprintln!("server gone {when}: connect {r:?} in {took:?}");
        assert!(r.is_err(), "{when}: {r:?}");
        // All within a second: waiting for CONFIRM LINK, the client watches the TCP
        // socket, so the server's close ends that wait too.
        assert!(
            *took < std::time::Duration::from_secs(1),
            "{when}: {took:?}"
        );
    }
    assert_eq!(
        (client_rt.link_groups(), client_rt.rmb_in_use()),
        (0, 0),
        "the abandoned link group and RMB are freed"
    );
    // A live server afterwards: SMC-R.
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            echo_server(l, 1)
        })
    };
    rx.recv().unwrap();
    in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&client_rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        echo_once(&mut c, b"a live server");
    })
    .join()
    .unwrap();
    assert!(matches!(server.join().unwrap()[0], Mode::SmcR { .. }));
}

/// The engine's UDP socket fails every send (an nftables rule in the client's namespace makes
/// `sendmsg` return EPERM for RoCE packets), both processes alive: the writer gets an error
/// once the transport's retries run out, instead of hanging; the device counts the failed
/// sends; once sends work again, a new connection gets SMC-R on a new link group (the engine
/// survived its socket's errors).
#[test]
fn a_failing_engine_socket_fails_its_connections_and_the_engine_recovers() {
    if !privileged("netns engine socket failing") || !common::have_tool("engine socket", "nft") {
        return;
    }
    let install = TestInstall::new("sockfail");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7411).into();
    let (tx, rx) = mpsc::channel();
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            // The first connection: read until it fails; the second: echo.
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; 1 << 20];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
            }
            drop(s);
            echo_server(l, 1)
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime(&install);
    let rt = client_rt.clone();
    let ns_a = net.a.clone();
    let (kind, after) = in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let chunk = vec![0x3cu8; 128 * 1024];
        let t0 = std::time::Instant::now();
        let mut failing_at = None;
        loop {
            if failing_at.is_none() && t0.elapsed() > std::time::Duration::from_millis(300) {
                nft(
                    &ns_a,
                    "table inet smcr_sockfail {\n chain out {\n  type filter hook output \
                     priority 0;\n  udp dport 4791 drop\n }\n}\n",
                );
                failing_at = Some(std::time::Instant::now());
            }
            if let Err(e) = c.write_all(&chunk) {
                return (
                    e.kind(),
                    failing_at.expect("error before the fault").elapsed(),
                );
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "writer hangs"
            );
        }
    })
    .join()
    .unwrap();
    let tx_errors: u64 = client_rt
        .device_stats()
        .iter()
        .map(|(_, s)| s.tx_errors)
        .sum();
    eprintln!("writer: {kind:?} {after:?} after sends began to fail; {tx_errors} failed sends");
    assert!(is_peer_gone(kind), "{kind:?}");
    assert!(after < std::time::Duration::from_secs(10), "{after:?}");
    assert!(tx_errors > 0, "the device saw its sends fail");
    nft(&net.a, "delete table inet smcr_sockfail");
    // At once, before the server has noticed the dead link (a TCP hang-up and an unanswered
    // TEST LINK take ~2 s): the server offers its dead group, its CONFIRM RKEY goes
    // unanswered (2 s), and it makes this connection a first contact on a new group instead
    // of declining — SMC-R either way.
    let rt = client_rt.clone();
    let (mode, took) = in_netns(&net.a, move || {
        let t = std::time::Instant::now();
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        let took = t.elapsed();
        echo_once(&mut c, b"after the socket recovered");
        (c.mode().clone(), took)
    })
    .join()
    .unwrap();
    eprintln!("right after the fault: {mode:?} in {took:?}");
    assert_eq!(
        mode,
        Mode::SmcR {
            first_contact: true
        }
    );
    let waited = wait_until(std::time::Duration::from_secs(10), || {
        server_rt.link_groups() == 1
    });
    assert_eq!(
        server_rt.link_groups(),
        1,
        "only the new group ({waited:?})"
    );
    assert!(matches!(server.join().unwrap()[0], Mode::SmcR { .. }));
}

/// RoCE blocked between the hosts (nftables drops UDP 4791 both ways in the client's
/// namespace): the first connection's link cannot come up, and instead of failing it goes on
/// as TCP on both sides, as Linux does — the server gives up after its 2 s CONFIRM LINK wait
/// and declines TIMEOUT_CL, the client (waiting 4 s, and watching the TCP socket meanwhile)
/// takes that Decline. Echo intact, nothing left behind; with RoCE back, SMC-R again.
#[test]
fn a_first_link_that_cannot_come_up_falls_back_to_tcp_on_both_sides() {
    if !privileged("netns first link fails") || !common::have_tool("first link fails", "nft") {
        return;
    }
    let install = TestInstall::new("nolink");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7412).into();
    nft(
        &net.a,
        "table inet smcr_nolink {\n chain out {\n  type filter hook output priority 0;\n  \
         udp dport 4791 drop\n }\n chain in {\n  type filter hook input priority 0;\n  \
         udp dport 4791 drop\n }\n}\n",
    );
    let (tx, rx) = mpsc::channel();
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            echo_server(l, 2)
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime(&install);
    let rt = client_rt.clone();
    let (mode, took) = in_netns(&net.a, move || {
        let t = std::time::Instant::now();
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        let took = t.elapsed();
        let mut payload = vec![0u8; 300_000];
        for (i, b) in payload.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        c.write_all(&payload).unwrap();
        let mut back = vec![0u8; payload.len()];
        c.read_exact(&mut back).unwrap();
        assert!(back == payload, "echo over the fallback differs");
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "no CLC byte reached the application");
        (c.mode().clone(), took)
    })
    .join()
    .unwrap();
    eprintln!("RoCE blocked: client {mode:?} after {took:?}");
    assert_eq!(
        mode,
        Mode::Tcp(FallbackReason::Declined {
            reason: DeclineReason::TIMEOUT_CL,
            by_peer: true
        })
    );
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    // Both runtimes dropped the group that never came up (the server's goes once its
    // DELETE LINK is given up on).
    for (who, rt) in [("client", &client_rt), ("server", &server_rt)] {
        let waited = wait_until(std::time::Duration::from_secs(10), || {
            rt.link_groups() == 0 && rt.rmb_in_use() == 0
        });
        assert_eq!(
            (rt.link_groups(), rt.rmb_in_use()),
            (0, 0),
            "{who}: nothing left ({waited:?})"
        );
    }
    nft(&net.a, "delete table inet smcr_nolink");
    let rt = client_rt.clone();
    in_netns(&net.a, move || {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert_eq!(
            c.mode(),
            &Mode::SmcR {
                first_contact: true
            }
        );
        echo_once(&mut c, b"RoCE passes again");
    })
    .join()
    .unwrap();
    let modes = server.join().unwrap();
    assert_eq!(
        modes[0],
        Mode::Tcp(FallbackReason::Declined {
            reason: DeclineReason::TIMEOUT_CL,
            by_peer: false
        })
    );
    assert!(matches!(modes[1], Mode::SmcR { .. }), "{:?}", modes[1]);
}

/// Peers that answer the CLC handshake late (past the 6 s CLC wait): where Linux fails the
/// connection (ETIMEDOUT), we wait further rounds for the message the peer owes, sending
/// nothing meanwhile. A raw server that declines 6.5 s after the Proposal, and a raw client that
/// sends its Proposal 6.5 s after connecting (and declines our Accept): both connections go on
/// as TCP with the peer's reason, the application bytes intact both ways.
#[test]
fn peers_that_answer_the_clc_handshake_late_are_waited_for() {
    if !privileged("netns slow CLC peers") {
        return;
    }
    use smcr::handshake::{self, Event};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};
    const LATE: Duration = Duration::from_millis(6500);
    let install = TestInstall::new("slowclc");
    let net = NetPair::new().unwrap();
    let slow_server: SocketAddr = (net.addr_b, 7413).into();
    let our_server: SocketAddr = (net.addr_b, 7414).into();
    let marker = runtime(&install);

    /// Feeds what the handshake asks for from `tcp` until it reports an event.
    fn next_event(tcp: &mut TcpStream, hs: &mut dyn FnMut(&[u8]) -> Option<Event>) -> Event {
        let mut buf = [0u8; 1];
        loop {
            // One byte at a time: never read past the CLC message into application data.
            if let Some(ev) = hs(&[]) {
                return ev;
            }
            assert_eq!(tcp.read(&mut buf).unwrap(), 1, "EOF in the handshake");
            if let Some(ev) = hs(&buf) {
                return ev;
            }
        }
    }

    // The slow raw server.
    let (tx, rx) = mpsc::channel();
    let m = marker.clone();
    let raw_server = in_netns(&net.b, move || {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_reuse_address(true).unwrap();
        assert!(m.mark(sock.as_fd()));
        sock.bind(&slow_server.into()).unwrap();
        sock.listen(8).unwrap();
        let l: TcpListener = sock.into();
        tx.send(()).unwrap();
        let (mut tcp, _) = l.accept().unwrap();
        let mut hs = handshake::Server::new(RuntimeConfig::new().handshake, Instant::now());
        let ev = next_event(&mut tcp, &mut |b| {
            hs.handle_data(b);
            hs.poll_event()
        });
        assert!(matches!(ev, Event::Proposed { .. }), "{ev:?}");
        std::thread::sleep(LATE);
        hs.decline(DeclineReason::NOSMCRDEV).unwrap();
        while let Some(b) = hs.poll_transmit() {
            tcp.write_all(&b).unwrap();
        }
        let ev = hs.poll_event().unwrap();
        // Then plain TCP: echo one line.
        let mut line = [0u8; 5];
        tcp.read_exact(&mut line).unwrap();
        tcp.write_all(&line).unwrap();
        ev
    });
    rx.recv().unwrap();
    // Our server, and the slow raw client.
    let (tx, rx) = mpsc::channel();
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, our_server).unwrap();
            tx.send(()).unwrap();
            echo_server(l, 1)
        })
    };
    rx.recv().unwrap();
    let ip_a = net.addr_a;
    let raw_client = in_netns(&net.a, move || {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        assert!(marker.mark(sock.as_fd()));
        sock.connect(&our_server.into()).unwrap();
        let mut tcp: TcpStream = sock.into();
        let mut hs = handshake::Client::new(
            RuntimeConfig::new().handshake,
            clc::Gid::from_ipv4(ip_a),
            Instant::now(),
        );
        std::thread::sleep(LATE);
        while let Some(b) = hs.poll_transmit() {
            tcp.write_all(&b).unwrap();
        }
        let ev = next_event(&mut tcp, &mut |b| {
            hs.handle_data(b);
            hs.poll_event()
        });
        assert!(matches!(ev, Event::Accepted { .. }), "{ev:?}");
        hs.decline(DeclineReason::NOSMCRDEV).unwrap();
        while let Some(b) = hs.poll_transmit() {
            tcp.write_all(&b).unwrap();
        }
        let ev = hs.poll_event().unwrap();
        tcp.write_all(b"late!").unwrap();
        let mut back = [0u8; 5];
        tcp.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"late!");
        tcp.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        tcp.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        ev
    });

    // Our client against the slow server.
    let client_rt = runtime(&install);
    let rt = client_rt.clone();
    let (mode, took) = in_netns(&net.a, move || {
        let t = Instant::now();
        let mut c = SmcStream::connect(&rt, slow_server).unwrap();
        let took = t.elapsed();
        c.write_all(b"hello").unwrap();
        let mut back = [0u8; 5];
        c.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"hello", "no CLC byte reached the application");
        (c.mode().clone(), took)
    })
    .join()
    .unwrap();
    eprintln!("slow server: our client {mode:?} after {took:?}");
    let theirs = |by_peer| {
        Mode::Tcp(FallbackReason::Declined {
            reason: DeclineReason::NOSMCRDEV,
            by_peer,
        })
    };
    assert_eq!(mode, theirs(true), "the late Decline was waited for");
    assert!(
        took >= LATE && took < LATE + Duration::from_secs(2),
        "{took:?}"
    );
    let ours = Event::Fallback {
        reason: DeclineReason::NOSMCRDEV,
        by_peer: false,
        out_of_sync: false,
    };
    assert_eq!(
        raw_server.join().unwrap(),
        ours,
        "nothing came from our client but data"
    );
    assert_eq!(raw_client.join().unwrap(), ours);
    assert_eq!(
        server.join().unwrap()[0],
        theirs(true),
        "the late Proposal was waited for"
    );
    for rt in [&client_rt, &server_rt] {
        wait_until(Duration::from_secs(5), || {
            rt.link_groups() == 0 && rt.rmb_in_use() == 0
        });
    }
    for rt in [&client_rt, &server_rt] {
        assert_eq!((rt.link_groups(), rt.rmb_in_use()), (0, 0));
    }
}

/// A burst of connections to one server while its link groups fill up: the server reuses a
/// group without holding up the client's other handshakes, yet no group takes more than its
/// negotiated connection limit (the reuse reserves its place before the next one looks).
/// 40 connections at once with 16 per group: all SMC-R, three groups on each side.
#[test]
fn a_burst_of_connections_fills_groups_to_their_limit_and_no_further() {
    if !privileged("netns connection burst") {
        return;
    }
    let install = TestInstall::new("burst");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7415).into();
    let limit = |c: &mut RuntimeConfig| c.handshake.max_conns = 16;
    let (tx, rx) = mpsc::channel();
    let server_rt = runtime_with(&install, limit);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let mut held = Vec::new();
            for _ in 0..40 {
                let (mut s, _) = l.accept().unwrap();
                assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
                let mut b = [0u8; 8];
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
                held.push(s);
            }
            let groups = rt.link_groups();
            for mut s in held {
                assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
            }
            groups
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime_with(&install, limit);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(40));
    let threads: Vec<_> = (0..40u64)
        .map(|i| {
            let (rt, barrier) = (client_rt.clone(), barrier.clone());
            in_netns(&net.a, move || {
                barrier.wait();
                let mut c = SmcStream::connect(&rt, addr).unwrap();
                assert!(matches!(c.mode(), Mode::SmcR { .. }), "{i}: {:?}", c.mode());
                c.write_all(&i.to_le_bytes()).unwrap();
                let mut b = [0u8; 8];
                c.read_exact(&mut b).unwrap();
                assert_eq!(u64::from_le_bytes(b), i);
                c
            })
        })
        .collect();
    let conns: Vec<SmcStream> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let groups = client_rt.link_groups();
    drop(conns);
    let server_groups = server.join().unwrap();
    eprintln!("40 at once, 16 per group: client {groups} groups, server {server_groups}");
    assert_eq!((groups, server_groups), (3, 3));
}

/// Descriptors and threads of this process.
fn fds_and_threads() -> (usize, usize) {
    let count = |d: &str| std::fs::read_dir(d).map_or(0, |r| r.count());
    (count("/proc/self/fd"), count("/proc/self/task"))
}

/// The survivor of `a_killed_peer_leaves_the_survivor_nothing_behind`, in its own process so
/// that its descriptors and threads are its own: an echo server on every address of namespace
/// `b` (a short linger, so idle groups go quickly), commanded by lines on stdin: `BASELINE` and
/// `CHECK` print its descriptors, threads, link groups and RMB bytes; the second connection it
/// accepts gets a stream of writes until it fails, and the failure is printed (`GONE`).
#[test]
#[ignore = "run as a child process"]
fn survivor_server_child() {
    use std::io::BufRead;
    let Some(env) = child_env() else {
        return;
    };
    let rt = in_netns(&env.ns.clone(), move || {
        let rt = runtime_with(&env.install, |c| {
            c.linger = std::time::Duration::from_millis(300);
        });
        let l = SmcListener::bind(&rt, env.addr.parse::<std::net::SocketAddr>().unwrap()).unwrap();
        let rt2 = rt.clone();
        std::thread::spawn(move || {
            let _keep = rt2;
            for n in 0.. {
                let (mut s, _) = l.accept().unwrap();
                std::thread::spawn(move || {
                    if n == 1 {
                        // The doomed peer: write until it is gone.
                        let chunk = vec![0x77u8; 64 * 1024];
                        let err = loop {
                            if let Err(e) = s.write_all(&chunk) {
                                break e;
                            }
                        };
                        println!("GONE {:?}", err.kind());
                        return;
                    }
                    let mut buf = [0u8; 4096];
                    while let Ok(k) = s.read(&mut buf) {
                        if k == 0 || s.write_all(&buf[..k]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        rt
    })
    .join()
    .unwrap();
    println!("READY");
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        if line == "BASELINE" || line == "CHECK" {
            let (fds, threads) = fds_and_threads();
            println!(
                "{line} fds={fds} threads={threads} groups={} rmb={}",
                rt.link_groups(),
                rt.rmb_in_use()
            );
        }
    }
}

/// A client that connects (SMC-R), echoes once and exits: a peer that comes and goes.
#[test]
#[ignore = "run as a child process"]
fn echo_once_client_child() {
    let Some(env) = child_env() else {
        return;
    };
    in_netns(&env.ns.clone(), move || {
        let rt = runtime(&env.install);
        let mut c = SmcStream::connect(&rt, env.addr.parse::<SocketAddr>().unwrap()).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }));
        echo_once(&mut c, b"warm-up");
        rt.shutdown();
    })
    .join()
    .unwrap();
}

/// Issue 8's "frees its resources (no leaked RMBs, fds, threads — checked) and keeps serving
/// other peers": a server process (the survivor) streams data to a client process that is
/// SIGKILLed mid-transfer, holding the link group's only connection. The survivor's write fails
/// promptly; once the dead group is gone its descriptors, threads, groups and RMB bytes are back
/// to what they were before that client came (measured after an earlier client from the same
/// address came and went, so the RoCE device for that address exists in both counts); and a
/// peer in a third namespace gets SMC-R from it afterwards.
#[test]
fn a_killed_peer_leaves_the_survivor_nothing_behind() {
    if !privileged("netns survivor") {
        return;
    }
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let install = TestInstall::new("survivor");
    let net = NetPair::new().unwrap();
    let third = common::Third::new(&net).unwrap();
    let port = 7416u16;
    let any: SocketAddr = (std::net::Ipv4Addr::UNSPECIFIED, port).into();
    let mut survivor = spawn_child("survivor_server_child", &net.b, &install, any, &[], true);
    let mut cmd = survivor.stdin.take().unwrap();
    let (tx, lines) = mpsc::channel::<String>();
    let out = survivor.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let expect = |prefix: &str, within: Duration| -> String {
        let t = Instant::now();
        loop {
            let left = within.saturating_sub(t.elapsed());
            match lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(e) => panic!("no {prefix} from the survivor: {e}"),
            }
        }
    };
    expect("READY", Duration::from_secs(20));
    let to: SocketAddr = (net.addr_b, port).into();
    let client = |name: &str| spawn_child(name, &net.a, &install, to, &[], false);
    // A first client comes and goes; its group lingers 300 ms, then the counts settle.
    assert!(client("echo_once_client_child").wait().unwrap().success());
    let measure = |what: &str, cmd: &mut std::process::ChildStdin| -> String {
        writeln!(cmd, "{what}").unwrap();
        expect(what, Duration::from_secs(5))
    };
    // Until the counts stop changing (a deleted group's poller ends, its descriptors close)
    // and, when given, equal `target`.
    let counts = |l: &str| l.split_once(' ').map(|(_, r)| r.to_owned()).unwrap();
    let settle = |cmd: &mut std::process::ChildStdin, target: Option<&str>| -> String {
        let t = Instant::now();
        let mut last = String::new();
        loop {
            let l = measure("CHECK", cmd);
            let steady = counts(&l) == last && l.contains("groups=0");
            if (steady && target.is_none_or(|b| counts(&l) == counts(b)))
                || t.elapsed() > Duration::from_secs(15)
            {
                return l;
            }
            last = counts(&l);
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    settle(&mut cmd, None);
    let baseline = measure("BASELINE", &mut cmd);
    assert!(baseline.contains("groups=0 rmb=0"), "{baseline}");
    // The doomed client: it holds the group's only connection, the survivor streams to it.
    let mut doomed = client("idle_client_child");
    let mut dout = std::io::BufReader::new(doomed.stdout.take().unwrap()).lines();
    assert!(dout.any(|l| l.unwrap().contains("CONNECTED")));
    std::thread::sleep(Duration::from_millis(300));
    // The counts see the doomed connection's group (so they would see it left behind).
    let during = measure("CHECK", &mut cmd);
    let field = |l: &str, k: &str| -> usize {
        l.split(' ')
            .find_map(|f| f.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    assert_eq!(field(&during, "groups="), 1, "{during}");
    assert!(
        field(&during, "fds=") > field(&baseline, "fds="),
        "{during}"
    );
    assert!(
        field(&during, "threads=") > field(&baseline, "threads="),
        "{during}"
    );
    doomed.kill().unwrap();
    let killed = Instant::now();
    let _ = doomed.wait();
    let gone = expect("GONE", Duration::from_secs(15));
    let took = killed.elapsed();
    let after = settle(&mut cmd, Some(&baseline));
    eprintln!("survivor: {gone} {took:?} after the kill; {baseline} → {during} → {after}");
    assert!(
        gone.contains("ConnectionReset")
            || gone.contains("ConnectionAborted")
            || gone.contains("BrokenPipe"),
        "{gone}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(counts(&after), counts(&baseline), "nothing left behind");
    // Another peer is served.
    let rt = runtime(&install);
    let to_c: SocketAddr = (third.addr_b2, port).into();
    in_netns(&third.c, move || {
        let mut c = SmcStream::connect(&rt, to_c).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        echo_once(&mut c, b"another peer");
    })
    .join()
    .unwrap();
    drop(cmd);
    let _ = survivor.kill();
    let _ = survivor.wait();
}

/// A connection its application closed before the peer did waits for the peer's close to be
/// freed; if the peer deletes the link group first, that close never comes. Its RMB's share of
/// the budget must come back anyway (it stayed counted for good: found by the survivor test
/// above, one run in a few; here the order is forced).
#[test]
fn a_closed_connection_on_a_group_the_peer_deletes_gives_its_rmb_budget_back() {
    if !privileged("netns closed then deleted") {
        return;
    }
    let install = TestInstall::new("closedel");
    let net = NetPair::new().unwrap();
    let addr: SocketAddr = (net.addr_b, 7417).into();
    let (tx, rx) = mpsc::channel();
    let (closed_tx, closed_rx) = mpsc::channel::<()>();
    let server_rt = runtime(&install);
    let server = {
        let rt = server_rt.clone();
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (s, _) = l.accept().unwrap();
            assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
            assert!(rt.rmb_in_use() > 0);
            drop(s); // closed here; the client has not closed
            closed_tx.send(()).unwrap();
        })
    };
    rx.recv().unwrap();
    let client_rt = runtime(&install);
    let rt = client_rt.clone();
    in_netns(&net.a, move || {
        let c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }));
        closed_rx.recv().unwrap();
        rt.shutdown(); // DELETE LINK before our close: the server's group ends
        drop(c);
    })
    .join()
    .unwrap();
    server.join().unwrap();
    let waited = wait_until(std::time::Duration::from_secs(10), || {
        server_rt.link_groups() == 0 && server_rt.rmb_in_use() == 0
    });
    assert_eq!(
        (server_rt.link_groups(), server_rt.rmb_in_use()),
        (0, 0),
        "the group is gone and its RMB budget given back ({waited:?})"
    );
}
