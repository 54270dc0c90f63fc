//! SmcStream/SmcListener end to end in one process over loopback: the CLC handshake on a real
//! TCP connection, a link confirmed with LLC over our RDMA engine, data by RDMA WRITE + CDC.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::thread;

use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

static PORT: AtomicU16 = AtomicU16::new(0);

/// A runtime that assumes SMC-R (no BPF needed) on its own RoCE port, so tests run in parallel.
fn runtime() -> Runtime {
    let n = PORT.fetch_add(1, Ordering::Relaxed);
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 20000 + (std::process::id() % 2000) as u16 * 8 + n;
    Runtime::new(cfg)
}

fn listen(rt: &Runtime) -> (SmcListener, SocketAddr) {
    let l = SmcListener::bind(rt, "127.0.0.1:0".parse().unwrap()).unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

fn pattern(pos: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = pos + i as u64;
        *b = (p.wrapping_mul(0x9e37_79b9) >> 13) as u8;
    }
}

#[test]
fn echo_and_link_group_reuse() {
    let rt = runtime();
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        for _ in 0..3 {
            let (mut s, _) = l.accept().unwrap();
            assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
            let mut buf = [0u8; 4096];
            loop {
                let n = s.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).unwrap();
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
            c.write_all(msg).unwrap();
            let mut back = vec![0u8; msg.len()];
            c.read_exact(&mut back).unwrap();
            assert_eq!(back, msg);
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
        "one CONFIRM LINK exchange (both ends count it)"
    );
    assert_eq!(
        rt.link_groups(),
        2,
        "client and server side of one link group"
    );
    rt.shutdown();
}

#[test]
fn bulk_transfer_with_checksum() {
    let rt = runtime();
    let (l, addr) = listen(&rt);
    const TOTAL: u64 = 64 << 20;
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 256 * 1024];
        let mut expect = vec![0u8; buf.len()];
        let mut pos = 0u64;
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            pattern(pos, &mut expect[..n]);
            assert!(buf[..n] == expect[..n], "corruption at {pos}");
            pos += n as u64;
        }
        s.write_all(&pos.to_le_bytes()).unwrap();
        pos
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }));
    let mut chunk = vec![0u8; 100_003];
    let mut pos = 0u64;
    while pos < TOTAL {
        let n = chunk.len().min((TOTAL - pos) as usize);
        pattern(pos, &mut chunk[..n]);
        c.write_all(&chunk[..n]).unwrap();
        pos += n as u64;
    }
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut got = [0u8; 8];
    c.read_exact(&mut got).unwrap();
    assert_eq!(u64::from_le_bytes(got), TOTAL);
    assert_eq!(server.join().unwrap(), TOTAL);
    rt.shutdown();
}

#[test]
fn idle_link_group_lingers_then_is_deleted() {
    let n = PORT.fetch_add(1, Ordering::Relaxed);
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 20000 + (std::process::id() % 2000) as u16 * 8 + n;
    cfg.linger = std::time::Duration::from_millis(300);
    let rt = Runtime::new(cfg);
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            // Wait for the client's close so both sides have released the connection.
            assert_eq!(s.read(&mut b).unwrap(), 0);
        }
    });
    let echo = |first: bool| {
        let mut c = SmcStream::connect(&rt, addr).unwrap();
        assert_eq!(
            c.mode(),
            &Mode::SmcR {
                first_contact: first
            }
        );
        c.write_all(b"a").unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
    };
    echo(true);
    // Within the linger time the group is kept...
    thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(rt.link_groups(), 2);
    // ...after it, deleted on both sides (DELETE LINK), and the next connection is a first
    // contact again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while rt.link_groups() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            rt.debug_summary()
        );
        thread::sleep(std::time::Duration::from_millis(50));
    }
    echo(true);
    server.join().unwrap();
    assert_eq!(rt.links_confirmed(), 4);
    rt.shutdown();
}

#[test]
fn small_writes_are_corked_while_a_cdc_is_in_flight() {
    let rt = runtime();
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        all
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    // A lone write goes at once: one CDC, nothing held back.
    c.write_all(b"lone").unwrap();
    thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(c.stats().unwrap().data_cdcs, 1);
    // A burst of small writes shares CDCs (Linux's autocorking).
    let mut expect = b"lone".to_vec();
    for i in 0..1000u32 {
        let m = format!("<{i}>");
        c.write_all(m.as_bytes()).unwrap();
        expect.extend_from_slice(m.as_bytes());
    }
    c.flush().unwrap();
    let st = c.stats().unwrap();
    assert_eq!(st.writes, 1001);
    eprintln!("{st:?}");
    assert!(st.data_cdcs <= 500, "{st:?}");
    drop(c);
    assert_eq!(server.join().unwrap(), expect);
    rt.shutdown();
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

#[test]
fn abort_fails_both_ends_with_connection_reset() {
    let rt = runtime();
    let (l, addr) = listen(&rt);
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 16];
        s.read_exact(&mut buf).unwrap();
        read_tx.send(()).unwrap();
        // The client aborts once these bytes were read: the next read reports the reset.
        let e = s.read(&mut buf).unwrap_err();
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
    rt.shutdown();
}

#[test]
fn connections_and_fallbacks_appear_in_the_stats_area() {
    use smcr::stats::{Area, conn};
    let dir = std::env::temp_dir().join(format!("smcr-stats-it-{}", std::process::id()));
    let n = PORT.fetch_add(1, Ordering::Relaxed);
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 20000 + (std::process::id() % 2000) as u16 * 8 + n;
    cfg.stats_dir = Some(dir.clone());
    let rt = Runtime::new(cfg);
    let path = rt.stats_path().expect("an area").to_owned();
    let area = Area::open(&path).unwrap();
    assert_eq!(area.pid(), std::process::id());
    let rows = |area: &Area| -> Vec<smcr::stats::ConnRecord> {
        (0..area.conn_slots())
            .filter_map(|i| area.read_conn(i).unwrap())
            .collect()
    };
    let (l, addr) = listen(&rt);
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 100];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf[..40]).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    c.write_all(&[5u8; 100]).unwrap();
    let mut back = [0u8; 40];
    c.read_exact(&mut back).unwrap();
    let live = rows(&area);
    assert_eq!(live.len(), 2, "client and server rows: {live:?}");
    for r in &live {
        assert_eq!(r.words[conn::STATE] >> 16 & 0xff, conn::MODE_SMCR);
        assert_ne!(r.words[conn::SIZES], 0);
        let server_side = r.words[conn::STATE] >> 8 & 1 == 1;
        let (sent, received) = if server_side { (40, 100) } else { (100, 40) };
        assert_eq!((r.bytes_sent, r.bytes_received), (sent, received), "{r:?}");
        let local = r.words[if server_side { conn::LOCAL } else { conn::PEER }];
        assert_eq!(local & 0xffff, u64::from(addr.port()));
    }
    c.shutdown(std::net::Shutdown::Write).unwrap();
    drop(c);
    server.join().unwrap();
    assert!(rows(&area).is_empty(), "closed connections leave the area");
    assert!(area.fallbacks().is_empty());
    drop(area);
    rt.shutdown();
    drop(rt);
    assert!(!path.exists(), "the runtime removes its area");
}

/// `smc-stat` (another process) reads this process's area while its connections are open.
#[test]
fn smc_stat_shows_live_connections_and_fallbacks() {
    let dir = std::env::temp_dir().join(format!("smcr-stats-cli-{}", std::process::id()));
    let n = PORT.fetch_add(1, Ordering::Relaxed);
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 20000 + (std::process::id() % 2000) as u16 * 8 + n;
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
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_smc-stat"))
            .arg("--dir")
            .arg(&dir)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let json = run(&["--json", "--pid", &std::process::id().to_string()]);
    let port = addr.port();
    assert!(
        json.contains(&format!("\"peer\":\"127.0.0.1:{port}\"")),
        "{json}"
    );
    assert!(
        json.contains(&format!("\"local\":\"127.0.0.1:{port}\"")),
        "{json}"
    );
    assert_eq!(json.matches("\"mode\":\"TCP\"").count(), 2, "{json}");
    assert_eq!(json.matches("\"reason\":\"MEM\"").count(), 2, "{json}");
    assert!(
        json.contains("\"bytes_sent\":5,\"bytes_received\":8"),
        "{json}"
    );
    assert!(
        json.contains("\"bytes_sent\":8,\"bytes_received\":5"),
        "{json}"
    );
    // Valid JSON (python3 is a test dependency).
    let st = std::process::Command::new("python3")
        .args(["-c", "import json,sys; json.load(sys.stdin)"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut p| {
            use std::io::Write as _;
            p.stdin.take().unwrap().write_all(json.as_bytes())?;
            p.wait()
        });
    if let Ok(st) = st {
        assert!(st.success(), "not JSON: {json}");
    }
    let text = run(&[]);
    assert!(text.contains("TCP   MEM 0x01010000"), "{text}");
    let fb = run(&["--fallback"]);
    assert!(
        fb.contains("0x01010000   MEM") && fb.contains("       2  "),
        "{fb}"
    );
    c.shutdown(std::net::Shutdown::Write).unwrap();
    drop(c);
    server.join().unwrap();
    assert!(
        !run(&["--json"]).contains("\"mode\""),
        "rows gone after close"
    );
    rt.shutdown();
}
