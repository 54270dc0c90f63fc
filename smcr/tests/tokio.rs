//! The tokio streams: concurrent reads and writes on one SMC-R connection driven by its
//! readiness fd, and a fallback stream that is plain tokio TCP.
#![cfg(feature = "tokio")]

use smcr::tokio::{AsyncSmcListener, AsyncSmcStream};
use smcr::{FallbackReason, Mode, Negotiation, Runtime, RuntimeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn runtime(port_slot: u16) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 30000 + (std::process::id() % 2000) as u16 * 4 + port_slot;
    Runtime::new(cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_concurrent_halves() {
    let rt = runtime(0);
    let l = AsyncSmcListener::bind(&rt, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        assert!(matches!(s.mode(), Mode::SmcR { .. }));
        let (mut r, mut w) = tokio::io::split(s);
        let n = tokio::io::copy(&mut r, &mut w).await.unwrap();
        w.shutdown().await.unwrap();
        n
    });
    let c = AsyncSmcStream::connect(&rt, addr).await.unwrap();
    assert_eq!(
        c.mode(),
        &Mode::SmcR {
            first_contact: true
        }
    );
    const TOTAL: usize = 16 << 20;
    let (mut r, mut w) = tokio::io::split(c);
    // Write and read at the same time: more than the RMB is in flight, so each side waits on
    // the other through the readiness fd.
    let writer = tokio::spawn(async move {
        let chunk: Vec<u8> = (0..65_537u32).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        while sent < TOTAL {
            let n = chunk.len().min(TOTAL - sent);
            w.write_all(&chunk[..n]).await.unwrap();
            sent += n;
        }
        w.shutdown().await.unwrap();
    });
    let mut got = Vec::with_capacity(TOTAL);
    r.read_to_end(&mut got).await.unwrap();
    writer.await.unwrap();
    assert_eq!(got.len(), TOTAL);
    let chunk_len = 65_537;
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, ((i % chunk_len) as u32 % 251) as u8, "byte {i}");
    }
    assert_eq!(server.await.unwrap(), TOTAL as u64);
    rt.shutdown();
}

#[tokio::test]
async fn fallback_stream_is_plain_tcp() {
    // The option program is "installed" nowhere: every connection falls back, with the reason.
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: "/nonexistent/smcr".into(),
    };
    let rt = Runtime::new(cfg);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).await.unwrap();
        s.write_all(&b).await.unwrap();
    });
    let mut c = AsyncSmcStream::connect(&rt, addr).await.unwrap();
    assert!(
        matches!(c.mode(), Mode::Tcp(FallbackReason::NoBpf(_))),
        "{:?}",
        c.mode()
    );
    c.write_all(b"hello").await.unwrap();
    let mut b = [0u8; 5];
    c.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"hello");
    server.await.unwrap();
}
