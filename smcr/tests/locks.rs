//! How many locks one `write` and one `read` take (issue 40), counted by `rdma::locks` (feature
//! `lock-count`: every parking_lot lock of smcr and rdma, and the receive path's raw queue-pair
//! lock). A 64-byte ping-pong between two connections of this process, over UDP (the RoCE
//! path) and over shared memory (same host): the application threads' locks per `write`, and
//! per `read` that finds the bytes there (each side first waits for readability with
//! `poll(2)` on the stream's readiness descriptor, which takes no lock of ours, so waiting is
//! not counted). Every thread's locks per round trip (engines and pollers included) are
//! printed, not bounded: an engine that spins while it waits takes locks by the time it
//! waits. docs/architecture.md ("One write, one read") gives the figures; the bounds are a
//! little above them, so a change that adds locks to the data path fails here and is weighed
//! on purpose.
//!
//! `cargo test --profile ci -p smcr --features lock-count --test locks -- --nocapture`

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc;

use rdma::locks::{sites, taken, taken_by_all};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

static PORT: AtomicU16 = AtomicU16::new(0);
/// One measurement at a time: threads of the other would take the CPUs and add spins.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const WARM: usize = 2_000;
const ROUNDS: usize = 20_000;
/// Fewer: a read after `poll` on the readiness descriptor waits for the poller's hand-over.
const POLLED_ROUNDS: usize = 5_000;
/// Measured: 7 over UDP, 8 over shared memory (docs/architecture.md).
const WRITE_MAX: f64 = 11.0;
/// Measured: 1 (the connection's lock).
const READ_MAX: f64 = 2.0;

/// Waits until `s` has bytes to read, without taking a lock of ours.
fn wait_readable(s: &SmcStream) {
    use std::os::fd::AsRawFd;
    let fd = s.readiness_fd(false).unwrap();
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    while s.readable_bytes() == 0 {
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, 1000) };
        assert!(r >= 0, "poll: {}", std::io::Error::last_os_error());
        // Re-armed by reading it (see `SmcStream::readiness_fd`); empty: EAGAIN.
        let mut v = [0u8; 8];
        // SAFETY: 8 writable bytes.
        let _ = unsafe { libc::read(fd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
    }
}

fn runtime(same_host: bool) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port =
        37000 + (std::process::id() % 1000) as u16 * 4 + PORT.fetch_add(1, Ordering::Relaxed);
    cfg.stats_dir = None;
    cfg.same_host = same_host;
    Runtime::new(cfg)
}

/// Locks per call on the application threads, and of all threads per round trip.
#[derive(Debug)]
struct Counts {
    client_write: f64,
    client_read: f64,
    server_read: f64,
    server_write: f64,
    all_per_round_trip: f64,
    udp_packets: u64,
    /// Where the client's last write and last read took their locks (`file:line`).
    write_sites: Vec<String>,
    read_sites: Vec<String>,
}

/// `rounds` ping-pongs after a warm-up; with `poll_first`, each read waits for readability
/// first (see the top), else it blocks in `read` (and drives the receive path itself).
fn measure(rt: &Runtime, rounds: usize, poll_first: bool) -> Counts {
    let l = SmcListener::bind(rt, "127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        assert!(matches!(s.mode(), Mode::SmcR { .. }), "{:?}", s.mode());
        let mut b = [0u8; 64];
        let (mut reads, mut writes) = (0u64, 0u64);
        for i in 0..WARM + rounds {
            if i == WARM {
                (reads, writes) = (0, 0);
            }
            if poll_first {
                wait_readable(&s);
            }
            let t = taken();
            s.read_exact(&mut b).unwrap();
            reads += taken() - t;
            let t = taken();
            s.write_all(&b).unwrap();
            writes += taken() - t;
        }
        tx.send((reads, writes)).unwrap();
        // Until the client has read the last answer.
        let _ = s.read(&mut b);
    });
    let mut c = SmcStream::connect(rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
    let packets = || -> u64 { rt.device_stats().iter().map(|(_, d)| d.tx_packets).sum() };
    let mut b = [7u8; 64];
    let (mut reads, mut writes, mut all, mut udp) = (0u64, 0u64, 0u64, 0u64);
    let (mut write_sites, mut read_sites) = (vec![], vec![]);
    let names = |v: Vec<&std::panic::Location<'_>>| -> Vec<String> {
        v.iter()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .collect()
    };
    for i in 0..WARM + rounds {
        if i == WARM {
            (reads, writes) = (0, 0);
            all = taken_by_all();
            udp = packets();
        }
        let t = taken();
        let ((), at) = sites(|| c.write_all(&b).unwrap());
        writes += taken() - t;
        write_sites = names(at);
        if poll_first {
            wait_readable(&c);
        }
        let t = taken();
        let ((), at) = sites(|| c.read_exact(&mut b).unwrap());
        reads += taken() - t;
        read_sites = names(at);
    }
    let all = taken_by_all() - all;
    let udp = packets() - udp;
    let (s_reads, s_writes) = rx.recv().unwrap();
    drop(c);
    server.join().unwrap();
    let n = rounds as f64;
    Counts {
        client_write: writes as f64 / n,
        client_read: reads as f64 / n,
        server_read: s_reads as f64 / n,
        server_write: s_writes as f64 / n,
        all_per_round_trip: all as f64 / n,
        udp_packets: udp,
        write_sites,
        read_sites,
    }
}

fn show(what: &str, c: &Counts) {
    eprintln!(
        "{what}: write {:.2} / {:.2} (client / server), read {:.2} / {:.2}, all threads {:.1} per round trip; {} UDP packets",
        c.client_write,
        c.server_write,
        c.client_read,
        c.server_read,
        c.all_per_round_trip,
        c.udp_packets
    );
    eprintln!("  the client's last write: {}", c.write_sites.join(" "));
    eprintln!("  the client's last read: {}", c.read_sites.join(" "));
}

/// Both phases on `rt`: the writes of both, the reads that found their bytes; `udp`: whether
/// the data went over UDP (else shared memory).
fn check(what: &str, rt: &Runtime, udp: bool) {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let blocking = measure(rt, ROUNDS, false);
    show(&format!("{what}, blocking reads"), &blocking);
    let polled = measure(rt, POLLED_ROUNDS, true);
    show(&format!("{what}, reads after poll"), &polled);
    for c in [&blocking, &polled] {
        let rounds = if std::ptr::eq(c, &blocking) {
            ROUNDS
        } else {
            POLLED_ROUNDS
        } as u64;
        if udp {
            // The 64 bytes with their CDC each way at least.
            assert!(c.udp_packets >= 2 * rounds, "{what}: not over UDP: {c:?}");
        } else {
            assert!(
                c.udp_packets < rounds / 100,
                "{what}: not over shared memory: {c:?}"
            );
        }
        for (name, v) in [("client", c.client_write), ("server", c.server_write)] {
            assert!(
                (1.0..=WRITE_MAX).contains(&v),
                "{what}: a {name} write takes {v:.2} locks (bound {WRITE_MAX}): {c:?}"
            );
        }
    }
    for (name, v) in [
        ("client", polled.client_read),
        ("server", polled.server_read),
    ] {
        assert!(
            (1.0..=READ_MAX).contains(&v),
            "{what}: a {name} read of bytes already there takes {v:.2} locks (bound {READ_MAX}): {polled:?}"
        );
    }
}

#[test]
fn locks_per_write_and_read_over_udp() {
    check("UDP", &runtime(false), true);
}

#[test]
fn locks_per_write_and_read_over_shared_memory() {
    check("shared memory", &runtime(true), false);
}
