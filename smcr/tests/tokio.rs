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
    let l = AsyncSmcListener::bind(&rt, "127.0.0.1:0").await.unwrap();
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

/// `accept()` dropped inside `select!` over and over while clients connect: every connection
/// still arrives (the acceptor queues it; `accept` only takes from the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_is_cancel_safe() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    const N: u32 = 1000;
    // One at a time: the queue is mostly empty, so most accept futures are pending when dropped.
    const CLIENTS: u32 = 1;
    let rt = runtime(1);
    let l = AsyncSmcListener::bind(&rt, "127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let started = Instant::now();
    let drops = Arc::new(AtomicU64::new(0));
    let server = {
        let drops = drops.clone();
        tokio::spawn(async move {
            let mut seen = vec![false; N as usize];
            let mut echoes = Vec::new();
            let (mut accepted, mut round) = (0, 0u64);
            while accepted < N {
                round += 1;
                let (mut s, _) = tokio::select! {
                    r = l.accept() => r.unwrap(),
                    // Often first: the accept future, polled at least once, is dropped, maybe
                    // as a connection lands. Mostly after one yield (the next poll), sometimes
                    // after a short sleep.
                    _ = async {
                        if round % 64 == 0 {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        } else {
                            tokio::task::yield_now().await;
                        }
                    } => {
                        drops.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                accepted += 1;
                echoes.push(tokio::spawn(async move {
                    let mut b = [0u8; 4];
                    s.read_exact(&mut b).await.unwrap();
                    s.write_all(&b).await.unwrap();
                    s.shutdown().await.unwrap();
                    u32::from_le_bytes(b)
                }));
            }
            for e in echoes {
                let i = e.await.unwrap();
                assert!(!std::mem::replace(&mut seen[i as usize], true), "{i} twice");
            }
            accepted
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let rt = rt.clone();
            tokio::spawn(async move {
                for i in (c..N).step_by(CLIENTS as usize) {
                    let mut s = AsyncSmcStream::connect(&rt, addr).await.unwrap();
                    s.write_all(&i.to_le_bytes()).await.unwrap();
                    let mut b = [0u8; 4];
                    s.read_exact(&mut b).await.unwrap();
                    assert_eq!(u32::from_le_bytes(b), i);
                }
            })
        })
        .collect();
    let all = async {
        for c in clients {
            c.await.unwrap();
        }
        server.await.unwrap()
    };
    let accepted = tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("a connection was lost (or the run is far too slow)");
    let drops = drops.load(Ordering::Relaxed);
    eprintln!(
        "{accepted} connections, accept dropped {drops} times, {:?}",
        started.elapsed()
    );
    assert_eq!(accepted, N);
    assert!(drops > 0, "the accept future was never dropped");
    rt.shutdown();
}
