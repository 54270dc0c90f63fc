//! `smc-stat` reading the stats areas of a live runtime in this process: connections, link
//! groups, cursors, stage times, fallbacks with their reasons, the watch mode, and the RMB
//! sizes the budget allows. The runtime writes the areas (`smcr::stats`); this crate reads
//! them, so these tests live beside the reader.

#[path = "../../smcr/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::sync::atomic::AtomicU16;
use std::thread;

use common::{byte_pattern as pattern, listen, stats_dir};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcStream};

static PORT: AtomicU16 = AtomicU16::new(0);

/// Settings that assume SMC-R (no BPF needed) on a RoCE port of their own.
fn config() -> RuntimeConfig {
    common::assume_config(40000, &PORT)
}

/// `smc-stat --dir DIR ARGS…`, which must succeed; its output.
fn smc_stat(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_smc-stat"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn missing_option_program_is_reported_once_and_connections_fall_back() {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: "/nonexistent/smcr".into(),
    };
    let rt = Runtime::new(cfg);
    let why = rt.negotiation_problem().expect("a problem");
    assert!(why.contains("not installed"), "{why}");
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 3];
        s.read_exact(&mut b).unwrap();
        b
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    match c.mode() {
        Mode::Tcp(r) => {
            assert_eq!(r.code(), smcr::FallbackReason::CODE_NO_BPF);
            assert!(r.to_string().contains("not installed"), "{r}");
        }
        m => panic!("{m:?}"),
    }
    c.write_all(b"abc").unwrap();
    assert_eq!(&t.join().unwrap(), b"abc");
    assert!(c.stats().is_none());
    // The stats area has the TCP row with its reason and bytes, and counts the fallback.
    let area = smcr::stats::Area::open(rt.stats_path().unwrap()).unwrap();
    assert_eq!(
        area.fallbacks(),
        vec![(smcr::FallbackReason::CODE_NO_BPF, 1)]
    );
    // The whole process is marked: smc-stat says SMC-R is unavailable here, and why.
    assert_eq!(area.unavailable(), smcr::FallbackReason::CODE_NO_BPF);
    let dir = rt.stats_path().unwrap().parent().unwrap().to_owned();
    let me = std::process::id().to_string();
    let text = smc_stat(&dir, &["--pid", &me]);
    assert!(
        text.contains("SMC-R unavailable") && text.contains("NOBPF"),
        "{text}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&smc_stat(&dir, &["--json", "--pid", &me])).unwrap();
    assert_eq!(doc["processes"][0]["smcr_unavailable"], "NOBPF", "{doc}");
    let row = (0..area.conn_slots())
        .find_map(|i| area.read_conn(i).unwrap())
        .unwrap();
    use smcr::stats::conn;
    assert_eq!(row.words[conn::STATE] >> 16 & 0xff, conn::MODE_TCP);
    assert_eq!(
        row.words[conn::REASON] as u32,
        smcr::FallbackReason::CODE_NO_BPF
    );
    assert_eq!(row.bytes_sent, 3);
}

/// `smc-stat` (another process) reads this process's area while its connections are open.
#[test]
fn smc_stat_shows_live_connections_and_fallbacks() {
    let dir = stats_dir("cli");
    let mut cfg = config();
    cfg.stats_dir = Some(dir.clone());
    cfg.rmb_budget = 0; // the server declines every connection: MEM fallbacks
    let rt = Runtime::new(cfg);
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(b"12345678").unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::Tcp(_)), "{:?}", c.mode());
    c.write_all(b"hello").unwrap();
    let mut back = [0u8; 8];
    c.read_exact(&mut back).unwrap();
    let run = |args: &[&str]| smc_stat(&dir, args);
    let me = std::process::id();
    let doc: serde_json::Value =
        serde_json::from_str(&run(&["--json", "--pid", &me.to_string()])).expect("JSON");
    let port = addr.port();
    let conns = doc["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 2, "{doc}");
    for c in conns {
        assert_eq!(c["pid"], me);
        assert_eq!(c["mode"], "TCP");
        assert_eq!(c["reason"], "MEM");
        assert_eq!(c["reason_code"], 0x0101_0000);
        assert_eq!(c["state"], "ACTIVE");
        let server_side = c["role"] == "server";
        let (ours, sent, received) = if server_side {
            ("local", 8, 5)
        } else {
            ("peer", 5, 8)
        };
        assert_eq!(c[ours], format!("127.0.0.1:{port}"), "{c}");
        assert_eq!(
            (c["bytes_sent"].as_u64(), c["bytes_received"].as_u64()),
            (Some(sent), Some(received)),
            "{c}"
        );
        // The server declined: the client's row carries the peer's diagnosis.
        assert_eq!(
            c["peer_reason_code"],
            if server_side { 0 } else { 0x0101_0000 },
            "{c}"
        );
        assert!(c["stages_us"]["proposal"].is_u64(), "{c}");
        assert!(c["stages_us"]["confirm_link"].is_null(), "{c}");
    }
    assert_eq!(doc["listeners"].as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(doc["fallbacks"][0]["name"], "MEM");
    assert_eq!(doc["fallbacks"][0]["count"], 2);
    assert_eq!(doc["processes"][0]["totals"]["tcp_connections"], 2);
    let text = run(&[]);
    assert!(text.contains("TCP  MEM 0x01010000"), "{text}");
    assert!(text.contains("MEM 0x01010000 by peer"), "{text}");
    assert!(!text.contains("LISTEN"), "{text}");
    assert!(run(&["-l"]).contains("LISTEN"));
    let fb = run(&["--fallback"]);
    assert!(fb.contains("0x01010000  MEM                 2  "), "{fb}");
    assert!(fb.contains("remedy: "), "{fb}");
    // reset zeroes the counters in the area itself; the live rows stay.
    assert!(run(&["reset", "--pid", &me.to_string()]).contains("1 process"));
    let doc: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    assert_eq!(doc["fallbacks"].as_array().unwrap().len(), 0, "{doc}");
    assert_eq!(doc["processes"][0]["totals"]["tcp_connections"], 0);
    assert_eq!(doc["processes"][0]["reset_epoch"], 1);
    assert_eq!(doc["connections"].as_array().unwrap().len(), 2);
    c.shutdown(std::net::Shutdown::Write).unwrap();
    drop(c);
    server.join().unwrap();
    // (The device row stays: the engine runs until the runtime ends.)
    let doc: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    assert_eq!(
        doc["connections"].as_array().map(Vec::len),
        Some(0),
        "rows gone after close: {doc}"
    );
    rt.shutdown();
}

/// An SMC-R connection as `smc-stat` shows it: both rows with cursors, flags and every
/// handshake stage (first contact: CONFIRM LINK too), both link groups, Prometheus text.
#[test]
fn smc_stat_shows_link_groups_cursors_and_stage_times() {
    let dir = stats_dir("lg");
    let mut cfg = config();
    cfg.stats_dir = Some(dir.clone());
    let rt = Runtime::new(cfg);
    let (l, addr) = listen(&rt);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 1000];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf[..300]).unwrap();
        done_rx.recv().unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert_eq!(
        c.mode(),
        &Mode::SmcR {
            first_contact: true
        }
    );
    c.write_all(&[9u8; 1000]).unwrap();
    let mut back = [0u8; 300];
    c.read_exact(&mut back).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let run = |args: &[&str]| smc_stat(&dir, args);
    // Cursors and flags are published as CDCs come and go, without waiting for a busy lock:
    // read until both rows show the final state (or 2 s passed; the asserts below then say
    // what is missing).
    let settled = |c: &serde_json::Value| {
        let (sent, received) = if c["role"] == "server" {
            (300, 1000)
        } else {
            (1000, 300)
        };
        c["cursors"]["tx_prod"] == format!("0:{sent}")
            && c["cursors"]["peer_cons"] == format!("0:{sent}")
            && c["cursors"]["rx_cons"] == format!("0:{received}")
            && c["state"] != "ACTIVE"
    };
    let mut doc = serde_json::Value::Null;
    for _ in 0..200 {
        doc = serde_json::from_str(&run(&["--json"])).unwrap();
        let conns = doc["connections"].as_array().unwrap();
        // The links show `shm` once each group has handled something after the switch (its
        // poller does within its timer period).
        let on_shm = doc["link_groups"]
            .as_array()
            .is_some_and(|g| g.iter().all(|g| g["transport"] == "shm"));
        if conns.len() == 2 && conns.iter().all(settled) && on_shm {
            break;
        }
        thread::sleep(std::time::Duration::from_millis(10));
    }
    // The engine's counters, bumped by the engine in the area itself: one device (both ends
    // are this process), on the configured port, with the same-host offers it accepted.
    let devs = doc["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 1, "{doc}");
    assert_eq!(devs[0]["pid"], std::process::id());
    assert_eq!(devs[0]["mode"], "fixed", "{doc}");
    assert!(
        devs[0]["address"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:")
    );
    assert!(
        devs[0]["counters"]["shm_offers"].as_u64() >= Some(1),
        "{doc}"
    );
    assert_eq!(devs[0]["counters"]["rx_icrc_errors"], 0, "{doc}");
    let table = run(&["--devices", "-d"]);
    assert!(
        table.contains(" fixed ") && table.contains("shm_offers"),
        "{table}"
    );
    let conns = doc["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 2, "{doc}");
    for c in conns {
        assert_eq!(c["mode"], "SMCR", "{c}");
        assert!(c["reason"].is_null());
        let server_side = c["role"] == "server";
        let (sent, received) = if server_side {
            (300, 1000)
        } else {
            (1000, 300)
        };
        assert_eq!(
            (c["bytes_sent"].as_u64(), c["bytes_received"].as_u64()),
            (Some(sent), Some(received)),
            "{c}"
        );
        assert_eq!(c["cursors"]["tx_prod"], format!("0:{sent}"), "{c}");
        assert_eq!(c["cursors"]["peer_cons"], format!("0:{sent}"), "{c}");
        assert_eq!(c["cursors"]["rx_cons"], format!("0:{received}"), "{c}");
        // The client shut down writing: PEERCLW1 on its side, APPCLW1 on the server's.
        let (state, local, peer) = if server_side {
            ("APPCLW1", "-", "done-writing")
        } else {
            ("PEERCLW1", "done-writing", "-")
        };
        assert_eq!(c["state"], state, "{c}");
        assert_eq!(c["flags"]["local"], local, "{c}");
        assert_eq!(c["flags"]["peer"], peer, "{c}");
        // Every stage was reached, in order.
        let st = &c["stages_us"];
        let t: Vec<u64> = smcr_tools::view::STAGES
            .iter()
            .map(|s| st[s].as_u64().unwrap_or_else(|| panic!("{s} missing: {c}")))
            .collect();
        assert!(t.windows(2).all(|w| w[0] <= w[1]), "{c}");
        assert!(c["token"].as_u64().unwrap() != 0 && c["link_group"].as_u64().unwrap() != 0);
        // A peer on this host gets the same-host RMB size.
        assert_eq!(c["rmb"], 512 * 1024);
    }
    let lgs = doc["link_groups"].as_array().unwrap();
    assert_eq!(lgs.len(), 2, "client's and server's: {doc}");
    let (a, b) = (&lgs[0], &lgs[1]);
    assert_ne!(a["role"], b["role"]);
    assert_eq!(a["qpn"], b["peer_qpn"], "{doc}");
    assert_eq!(a["peer_qpn"], b["qpn"], "{doc}");
    for g in lgs {
        assert_eq!(g["state"], "ACTIVE");
        assert_eq!(g["connections"], 1);
        assert_eq!(g["gid"], "::ffff:127.0.0.1");
        // Both ends on this host, in one network namespace: shared memory, not UDP.
        assert_eq!(g["transport"], "shm", "{doc}");
    }
    let links = run(&["--links"]);
    assert_eq!(links.matches("ACTIVE").count(), 2, "{links}");
    assert_eq!(links.matches(" shm").count(), 2, "{links}");
    // smcss's -R: the SMC-R sockets with their link's role and GIDs; smcss's state names.
    let smcr = run(&["-R"]);
    assert!(smcr.contains(" CLNT ") && smcr.contains(" SERV "), "{smcr}");
    assert_eq!(smcr.matches("::ffff:127.0.0.1").count(), 4, "{smcr}");
    assert!(
        smcr.contains("APPCLOSEWAIT1 ") && smcr.contains("PEERCLOSEWAIT1 "),
        "{smcr}"
    );
    let details = run(&["-d"]);
    assert!(details.contains("txprod-Cursor 0000:000003e8"), "{details}");
    assert_eq!(
        details.matches("ms after TCP up: option ").count(),
        2,
        "{details}"
    );
    assert!(!details.contains("confirm_link -"), "{details}");
    let prom = run(&["--prometheus"]);
    let samples =
        smcr_tools::view::parse_prometheus(&prom).unwrap_or_else(|e| panic!("{e}\n{prom}"));
    let me = std::process::id().to_string();
    let get = |name: &str, label: (&str, &str)| {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.iter().any(|(k, v)| k == "pid" && *v == me)
                    && l.iter().any(|(k, v)| k == label.0 && v == label.1)
            })
            .map(|s| s.2)
    };
    assert_eq!(
        get("smcr_connections_total", ("mode", "smcr")),
        Some(2.0),
        "{prom}"
    );
    assert_eq!(
        get("smcr_open_connections", ("mode", "smcr")),
        Some(2.0),
        "{prom}"
    );
    assert_eq!(
        get("smcr_bytes", ("direction", "sent")),
        Some(1300.0),
        "{prom}"
    );
    done_tx.send(()).unwrap();
    drop(c);
    server.join().unwrap();
    rt.shutdown();
}

#[test]
fn smc_stat_watch_redraws() {
    let dir = stats_dir("watch");
    let mut cfg = config();
    cfg.stats_dir = Some(dir.clone());
    let rt = Runtime::new(cfg);
    let (l, addr) = listen(&rt);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_smc-stat"))
        .arg("--dir")
        .arg(&*dir)
        .args(["-l", "--watch", "0.2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    thread::sleep(std::time::Duration::from_millis(1100));
    child.kill().unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let _ = child.wait();
    let frames: Vec<&str> = out.split("\x1b[H\x1b[2J").skip(1).collect();
    assert!(
        (2..=8).contains(&frames.len()),
        "{} frames: {out:?}",
        frames.len()
    );
    for f in &frames[..frames.len() - 1] {
        assert!(f.starts_with("PID"), "{f:?}");
        assert!(f.contains(&format!("127.0.0.1:{}", addr.port())), "{f:?}");
    }
    drop(l);
    rt.shutdown();
}

/// `smc-stat --watch N` redraws (home + clear, then the table) every N seconds until stopped.
#[test]
fn large_rmbs_take_at_most_a_quarter_of_the_budget() {
    // 4 MiB of budget: the first two RMBs (the first connection's, one per side in this one
    // runtime) get the same-host size of 512 KiB, which fills the quarter; the next
    // connection's get Linux's 64 KiB and still work.
    let dir = stats_dir("budget");
    let mut cfg = config();
    cfg.stats_dir = Some(dir.clone());
    cfg.rmb_budget = 4 << 20;
    let rt = Runtime::new(cfg);
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        let mut kept = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; 200_000];
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf).unwrap();
            kept.push(s);
        }
        kept
    });
    let mut conns = Vec::new();
    for i in 0..2u64 {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let mut out = vec![0u8; 200_000];
        pattern(i * 1000, &mut out);
        c.write_all(&out).unwrap();
        let mut back = vec![0u8; out.len()];
        c.read_exact(&mut back).unwrap();
        assert!(back == out, "connection {i}: the echo differs");
        conns.push(c);
    }
    let kept = server.join().unwrap();
    let doc: serde_json::Value = serde_json::from_str(&smc_stat(&dir, &["--json"])).unwrap();
    let mut sizes: Vec<u64> = doc["connections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["rmb"].as_u64().unwrap())
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [64 << 10, 64 << 10, 512 << 10, 512 << 10], "{doc}");
    drop((conns, kept));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server whose program reads our CLC Proposal as data (its end went to a program without
/// smcr) answers with bytes that are not CLC — an echo of the Proposal, or its own protocol's
/// error: the client's handshake fails with an error `smcr::not_clc` recognises, and the
/// process counts NOTCLC, which smc-stat names with its meaning and remedy. A server that
/// just closes is a failure of another kind.
#[test]
fn a_server_that_does_not_speak_clc_is_counted_as_notclc() {
    let dir = stats_dir("notclc");
    let mut cfg = config();
    cfg.stats_dir = Some(dir.0.clone());
    let rt = Runtime::new(cfg);
    let answers: [(&str, &[u8]); 3] = [
        ("echo", b""),
        ("http", b"HTTP/1.1 400 Bad Request\r\n\r\n"),
        ("close", b""),
    ];
    let mut not_clc = 0;
    for (what, reply) in answers {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let reply = reply.to_vec();
        let server = thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let n = c.read(&mut buf).unwrap();
            match what {
                "echo" => c.write_all(&buf[..n]).unwrap(),
                "http" => c.write_all(&reply).unwrap(),
                _ => {}
            }
            // Let the client read before the close.
            thread::sleep(std::time::Duration::from_millis(100));
        });
        let e = SmcStream::connect(&rt, addr).expect_err(what);
        server.join().unwrap();
        let nc = smcr::not_clc(&e);
        assert_eq!(nc, what != "close", "{what}: {e}");
        not_clc += usize::from(nc);
    }
    assert_eq!(not_clc, 2);
    let out = smc_stat(&dir.0, &["--fallback"]);
    assert!(
        out.lines()
            .any(|l| l.contains("0x7f000009") && l.contains("NOTCLC") && l.contains(" 2")),
        "{out}"
    );
}
