//! Two hosts (network namespaces joined by veth), capability signalled by the TCP option
//! program: SMC-R between our ends with one link group for many connections, and fallback to
//! TCP with the right reason against plain TCP peers and declining servers.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;

use clc::DeclineReason;
use common::{NetPair, TestInstall, in_netns, privileged};
use smcr::{FallbackReason, Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn runtime(install: &TestInstall) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    Runtime::new(cfg)
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
