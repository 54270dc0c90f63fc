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
}
