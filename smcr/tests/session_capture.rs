//! A whole SMC-R session between two namespaces, captured with tcpdump on the veth and decoded
//! by tshark: option 254 in SYN/SYN-ACK, CLC Proposal/Accept/Confirm, LLC CONFIRM LINK over
//! RDMA SEND, RDMA WRITEs and CDC messages, in the order and sizes of the Linux reference
//! session (../shared/reference: frames 1-24 and 182-214: close, DELETE RKEY, a second
//! connection with CONFIRM RKEY both ways).

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::mpsc;

use common::{Capture, NetPair, TestInstall, in_netns, privileged};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

/// A runtime negotiating with the test's option program; `write_pad` off sends Linux's exact
/// WRITE lengths (our default lengthens short ones, checked below).
fn runtime(install: &TestInstall, write_pad: bool) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    assert!(cfg.write_pad, "on by default");
    cfg.write_pad = write_pad;
    // Two namespaces stand for two hosts: the RoCE path (not shared memory through the
    // host-wide rendezvous).
    cfg.same_host = false;
    // What a Linux peer sees: plain RoCE v2 (two of our engines bundle small packets and
    // leave the ICRC out, which tshark cannot decode; rdma's loopback tests check that).
    cfg.rdma_ext = false;
    Runtime::new(cfg)
}

/// Whether this machine can capture and decode a session (root, tcpdump, tshark).
fn can_capture() -> bool {
    privileged("session capture")
        && common::have_tool("session capture", "tcpdump")
        && common::have_tool("session capture", "tshark")
}

#[test]
fn session_decodes_like_the_linux_reference() {
    if !can_capture() {
        return;
    }
    let install = TestInstall::new("capture");
    let net = NetPair::new().unwrap();
    net.segment_before_capture().unwrap();
    let pcap = std::env::temp_dir().join(format!("smcr-session-{}.pcap", std::process::id()));
    let cap = Capture::start(&net.a, &net.veth_a, &pcap, "tcp or udp port 4791").unwrap();
    let addr: SocketAddr = (net.addr_b, 4444).into();
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install, false);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            s.read_exact(&mut buf[..16]).unwrap();
            s.write_all(&[0x42; 1000]).unwrap();
            s.read_exact(&mut buf[..1000]).unwrap();
            assert_eq!(s.read(&mut buf).unwrap(), 0);
            drop(s);
            // A second connection reuses the link group: CONFIRM RKEY both ways.
            let (mut s, _) = l.accept().unwrap();
            assert_eq!(
                s.mode(),
                &Mode::SmcR {
                    first_contact: false
                }
            );
            s.read_exact(&mut buf[..16]).unwrap();
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = runtime(&install, false);
        in_netns(&net.a, move || {
            let mut c = SmcStream::connect(&rt, addr).unwrap();
            assert_eq!(
                c.mode(),
                &Mode::SmcR {
                    first_contact: true
                }
            );
            // The reference session's first writes: 16 bytes, then 1000 each way.
            c.write_all(&[0x11; 16]).unwrap();
            let mut buf = [0u8; 1000];
            c.read_exact(&mut buf).unwrap();
            c.write_all(&[0x22; 1000]).unwrap();
            drop(c);
            // Closed on both sides: each withdraws its RMB's rkey (DELETE RKEY).
            std::thread::sleep(std::time::Duration::from_millis(100));
            let mut c = SmcStream::connect(&rt, addr).unwrap();
            assert_eq!(
                c.mode(),
                &Mode::SmcR {
                    first_contact: false
                }
            );
            c.write_all(&[0x33; 16]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
        })
    };
    client.join().unwrap();
    server.join().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    cap.stop().unwrap();

    let (text, rows) = decode(&pcap);
    if std::env::var_os("SMCR_KEEP_PCAP").is_none() {
        let _ = std::fs::remove_file(&pcap);
    } else {
        eprintln!("capture kept at {}", pcap.display());
    }
    eprintln!("{text}");
    check(&text, &rows);
    // The same expectations hold for the Linux session, decoded by the same tshark (its extra
    // ADD LINK request and reject come from max_links 2; we negotiate 1, docs/protocol.md).
    let reference = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/smcr-v2-kernel-6.12-rxe.pcap"
    );
    let (ref_text, ref_rows) = decode(std::path::Path::new(reference));
    check(&ref_text, &ref_rows);
}

#[test]
fn short_writes_are_lengthened_with_zeros_the_reader_never_sees() {
    if !can_capture() {
        return;
    }
    let install = TestInstall::new("capture-pad");
    let net = NetPair::new().unwrap();
    net.segment_before_capture().unwrap();
    let pcap = std::env::temp_dir().join(format!("smcr-pad-{}.pcap", std::process::id()));
    let cap = Capture::start(&net.a, &net.veth_a, &pcap, "udp port 4791").unwrap();
    let addr: SocketAddr = (net.addr_b, 4445).into();
    let (tx, rx) = mpsc::channel();
    let server = {
        let rt = runtime(&install, true);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            // 16 bytes, then 5, then 1000: exactly what was written, nothing in between.
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        })
    };
    rx.recv().unwrap();
    let client = {
        let rt = runtime(&install, true);
        in_netns(&net.a, move || {
            let mut c = SmcStream::connect(&rt, addr).unwrap();
            assert!(matches!(c.mode(), Mode::SmcR { .. }));
            for (b, n) in [(0x11u8, 16usize), (0x22, 5), (0x33, 1000)] {
                c.write_all(&vec![b; n]).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        })
    };
    client.join().unwrap();
    let got = server.join().unwrap();
    let mut want = vec![0x11u8; 16];
    want.extend([0x22; 5]);
    want.extend([0x33; 1000]);
    assert_eq!(got, want);
    std::thread::sleep(std::time::Duration::from_millis(200));
    cap.stop().unwrap();
    let (text, rows) = decode(&pcap);
    let _ = std::fs::remove_file(&pcap);
    eprintln!("{text}");
    // Each short WRITE carries 28 bytes (a 102-byte frame, as long as a CDC's) and its CDC
    // follows it (they left in one GSO datagram); the long one is as written. A WRITE sent
    // again (an early probe whose ACK was only late) goes alone: one of that length was
    // followed by its CDC before.
    let mut with_cdc = Vec::new();
    let writes: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.2.contains("RDMA Write Only"))
        .map(|(i, r)| {
            // (The other side's ACKs may be captured in between.)
            let next = rows[i + 1..].iter().find(|r| !r.2.contains("Acknowledge"));
            if next.is_some_and(|n| n.2.contains("CDC Message")) {
                with_cdc.push(r.0);
            } else {
                assert!(with_cdc.contains(&r.0), "a WRITE without its CDC: {text}");
            }
            r.0
        })
        .collect();
    // (A WRITE retransmitted under load shows twice: compare the distinct lengths, in order.)
    let mut distinct = writes.clone();
    distinct.dedup();
    assert_eq!(distinct, [102, 1074], "{text}");
    assert!(writes.iter().filter(|&&l| l == 102).count() >= 2, "{text}");
    assert!(!text.contains("NAK"), "{text}");
}

type Row = (usize, String, String);

/// Frame length, protocol and info column of every frame, as tshark decodes them.
fn decode(pcap: &std::path::Path) -> (String, Vec<Row>) {
    let out = Command::new("tshark")
        .args(["-r"])
        .arg(pcap)
        .args(["-T", "fields", "-E", "separator=|"])
        .args([
            "-e",
            "frame.len",
            "-e",
            "_ws.col.Protocol",
            "-e",
            "_ws.col.Info",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let rows = text
        .lines()
        .map(|l| {
            let mut f = l.splitn(3, '|');
            let len = f.next().unwrap().parse().unwrap();
            (
                len,
                f.next().unwrap().to_owned(),
                f.next().unwrap_or("").to_owned(),
            )
        })
        .collect();
    (text, rows)
}

fn check(text: &str, rows: &[Row]) {
    // The significant frames, in order, as (frame length, protocol, info fragment).
    let expected: &[(Option<usize>, &str, &str)] = &[
        (None, "TCP", "[SYN]"),
        (None, "TCP", "[SYN, ACK]"),
        (Some(222), "SMCv2", "SMC-Rv2-Proposal"),
        (Some(226), "SMCv2", "SMC-Rv2-Accept"),
        (Some(246), "SMCv2", "SMC-Rv2-Confirm"),
        (Some(102), "RRoCE", "RC Send Only"), // CONFIRM LINK request
        (Some(102), "RRoCE", "RC Send Only"), // CONFIRM LINK response
        (Some(90), "RRoCE", "RC RDMA Write Only"), // 16 bytes
        (Some(102), "SMC-R", "CDC Message"),
        (Some(1074), "RRoCE", "RC RDMA Write Only"), // 1000 bytes
        (Some(102), "SMC-R", "CDC Message"),
        // Both close; DELETE RKEY request and response each way.
        (Some(102), "RRoCE", "RC Send Only"),
        (Some(102), "RRoCE", "RC Send Only"),
        (Some(102), "RRoCE", "RC Send Only"),
        (Some(102), "RRoCE", "RC Send Only"),
        // Second connection on the same link group.
        (None, "TCP", "[SYN]"),
        (None, "TCP", "[SYN, ACK]"),
        (Some(222), "SMCv2", "SMC-Rv2-Proposal"),
        (Some(102), "RRoCE", "RC Send Only"), // server's CONFIRM RKEY
        (Some(102), "RRoCE", "RC Send Only"), // response
        (Some(174), "SMCv2", "SMC-Rv2-Accept"),
        (Some(102), "RRoCE", "RC Send Only"), // client's CONFIRM RKEY
        (Some(102), "RRoCE", "RC Send Only"), // response
        (Some(174), "SMCv2", "SMC-Rv2-Confirm"),
        (Some(90), "RRoCE", "RC RDMA Write Only"),
        (Some(102), "SMC-R", "CDC Message"),
    ];
    let mut at = 0;
    for (len, proto, info) in expected {
        let found = rows[at..]
            .iter()
            .position(|(l, p, i)| len.is_none_or(|n| n == *l) && p == proto && i.contains(info));
        let Some(k) = found else {
            panic!("expected {len:?} {proto} {info:?} after row {at} in:\n{text}");
        };
        at += k + 1;
    }
    // Option 254 with the SMC-R ExID on both SYNs, exactly as tshark names it for Linux.
    for syn in rows.iter().filter(|r| r.1 == "TCP" && r.2.contains("[SYN")) {
        assert!(syn.2.contains("ExID=E2D4"), "{syn:?}");
    }
    // No RoCE NAKs on a clean link.
    assert!(!text.contains("NAK"), "{text}");
}
