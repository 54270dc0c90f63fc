use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;
use std::sync::Arc;

fn ring(slots: usize, size: usize) -> Ring {
    let seg = Arc::new(Segment::create("test", Ring::bytes(slots, size)).unwrap());
    Ring::create(seg, 0, slots, size).unwrap()
}

#[test]
fn messages_come_out_in_order_and_full_is_reported() {
    let r = ring(4, 16);
    let mut out = [0u8; 12];
    assert_eq!(r.pop(&mut out), Ok(None));
    for i in 0..4u8 {
        r.push(&[i; 3]).unwrap();
    }
    assert_eq!(r.push(b"x"), Err(RingError::Full));
    assert_eq!(r.push(&[0; 13]), Err(RingError::TooLong(13)));
    for i in 0..4u8 {
        assert_eq!(r.pop(&mut out), Ok(Some(3)));
        assert_eq!(&out[..3], &[i; 3]);
    }
    assert!(r.is_empty());
    // Empty and maximal messages, many times round.
    for i in 0..1000u32 {
        let m = if i % 2 == 0 {
            vec![]
        } else {
            vec![i as u8; 12]
        };
        r.push(&m).unwrap();
        assert_eq!(r.pop(&mut out), Ok(Some(m.len())));
        assert_eq!(&out[..m.len()], &m[..]);
    }
}

#[test]
fn a_hostile_peer_gets_errors_not_panics() {
    let seg = Arc::new(Segment::create("test", 4096).unwrap());
    assert!(matches!(
        Ring::attach(seg.clone(), 0),
        Err(RingError::Corrupt(_))
    ));
    let r = Ring::create(seg.clone(), 0, 8, 64).unwrap();
    // A slot length beyond the slot.
    r.push(b"hello").unwrap();
    seg.write(R_SLOTS_AT, &1000u32.to_le_bytes());
    let mut out = [0u8; 60];
    assert!(matches!(r.pop(&mut out), Err(RingError::Corrupt(_))));
    // A producer cursor far ahead, a consumer cursor ahead of the producer.
    seg.u64_at(R_TAIL).store(1 << 40, Ordering::Relaxed);
    assert!(matches!(r.pop(&mut out), Err(RingError::Corrupt(_))));
    seg.u64_at(R_TAIL).store(0, Ordering::Relaxed);
    seg.u64_at(R_HEAD).store(5, Ordering::Relaxed);
    assert!(matches!(r.push(b"x"), Err(RingError::Corrupt(_))));
    // Headers that do not fit, or are not powers of two.
    for (slots, size) in [
        (3u64, 64u64),
        (8, 3),
        (1 << 30, 64),
        (8, 1 << 30),
        (1024, 64),
    ] {
        seg.u64_at(R_SLOTS).store(slots, Ordering::Relaxed);
        seg.u64_at(R_SLOT_SIZE).store(size, Ordering::Relaxed);
        assert!(
            matches!(Ring::attach(seg.clone(), 0), Err(RingError::Corrupt(_))),
            "{slots} {size}"
        );
    }
    assert!(matches!(
        Ring::attach(seg.clone(), 4096),
        Err(RingError::Corrupt(_))
    ));
    assert!(matches!(
        Ring::create(seg, 64, 64, 64),
        Err(RingError::Corrupt(_))
    ));
}

proptest! {
    /// Any interleaving of pushes and pops behaves like a bounded queue.
    #[test]
    fn behaves_like_a_bounded_queue(ops in proptest::collection::vec((any::<bool>(), 0usize..=28), 0..400)) {
        let r = ring(8, 32);
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        let mut out = [0u8; 28];
        for (i, (push, len)) in ops.into_iter().enumerate() {
            if push {
                let m = vec![i as u8; len];
                let got = r.push(&m);
                if model.len() == 8 {
                    prop_assert_eq!(got, Err(RingError::Full));
                } else {
                    prop_assert_eq!(got, Ok(()));
                    model.push_back(m);
                }
            } else {
                let got = r.pop(&mut out).unwrap();
                match model.pop_front() {
                    None => prop_assert_eq!(got, None),
                    Some(m) => {
                        prop_assert_eq!(got, Some(m.len()));
                        prop_assert_eq!(&out[..m.len()], &m[..]);
                    }
                }
            }
        }
    }
}

#[test]
fn a_sleeping_consumer_is_woken_and_nothing_is_lost() {
    let seg = Arc::new(Segment::create("test", Ring::bytes(64, 16)).unwrap());
    let r = Ring::create(seg.clone(), 0, 64, 16).unwrap();
    const N: u64 = 200_000;
    let consumer = std::thread::spawn(move || {
        let c = Ring::attach(seg, 0).unwrap();
        let mut out = [0u8; 12];
        let mut next = 0u64;
        while next < N {
            match c.pop(&mut out).unwrap() {
                Some(8) => {
                    assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), next);
                    next += 1;
                }
                Some(n) => panic!("length {n}"),
                // A lost wake-up would hang here (the timeout makes it a failure instead).
                None => c.wait(Some(Duration::from_secs(5))).unwrap(),
            }
        }
    });
    let mut i = 0u64;
    while i < N {
        match r.push(&i.to_le_bytes()) {
            Ok(()) => i += 1,
            Err(RingError::Full) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    consumer.join().unwrap();
}

#[test]
fn wait_times_out_on_an_empty_ring() {
    let r = ring(4, 16);
    let t = Instant::now();
    r.wait(Some(Duration::from_millis(30))).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(25));
}

#[test]
fn segments_reject_bad_bounds_and_files() {
    let s = Segment::create("t", 100).unwrap();
    assert!(s.write(90, &[1; 10]));
    assert!(!s.write(91, &[1; 10]));
    assert!(!s.write(usize::MAX, &[1]));
    let mut b = [0u8; 10];
    assert!(s.read(90, &mut b) && b == [1; 10]);
    assert!(!s.read(95, &mut b));
    // Not a regular file: a socket.
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(Segment::open(OwnedFd::from(a)).is_err());
    assert!(Segment::create("t", 0).is_err());
}

/// The other process of `two_processes_ping_pong_over_a_passed_segment`.
#[test]
#[ignore = "run by the two-process test"]
fn peer_process() {
    let Ok(path) = std::env::var("SMCR_SHM_TEST_SOCK") else {
        return;
    };
    let sock = std::os::unix::net::UnixStream::connect(path).unwrap();
    let mut b = [0u8; 16];
    let (n, fd) = recv_fd(sock.as_fd(), &mut b).unwrap();
    assert_eq!(&b[..n], b"segment");
    let seg = Arc::new(Segment::open(fd.expect("a descriptor")).unwrap());
    let req = Ring::attach(seg.clone(), 0).unwrap();
    let resp = Ring::attach(seg, 4096).unwrap();
    let spin = Duration::from_micros(
        std::env::var("SMCR_SHM_TEST_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let mut out = [0u8; 60];
    loop {
        match req.pop(&mut out).unwrap() {
            Some(n) if &out[..n] == b"bye" => return,
            Some(n) => resp.push(&out[..n]).unwrap(),
            None => req
                .wait_spinning(spin, Some(Duration::from_secs(5)))
                .unwrap(),
        }
    }
}

fn ping_pong(spin: Duration) -> Duration {
    let dir = std::env::temp_dir().join(format!(
        "smcr-shm-{}-{}",
        std::process::id(),
        spin.as_micros()
    ));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("sock");
    let _ = std::fs::remove_file(&path);
    let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "shm::tests::peer_process",
            "--ignored",
            "--nocapture",
        ])
        .env("SMCR_SHM_TEST_SOCK", &path)
        .env("SMCR_SHM_TEST_SPIN_US", spin.as_micros().to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (sock, _) = l.accept().unwrap();
    let seg = Arc::new(Segment::create("pingpong", 8192).unwrap());
    let req = Ring::create(seg.clone(), 0, 16, 64).unwrap();
    let resp = Ring::create(seg.clone(), 4096, 16, 64).unwrap();
    send_fd(sock.as_fd(), seg.fd(), b"segment").unwrap();
    let mut out = [0u8; 60];
    let n = 20_000u32;
    let t = Instant::now();
    for i in 0..n {
        let m = i.to_le_bytes();
        req.push(&m).unwrap();
        loop {
            match resp.pop(&mut out).unwrap() {
                Some(4) => {
                    assert_eq!(out[..4], m);
                    break;
                }
                Some(k) => panic!("length {k}"),
                None => resp
                    .wait_spinning(spin, Some(Duration::from_secs(5)))
                    .unwrap(),
            }
        }
    }
    let rtt = t.elapsed() / n;
    req.push(b"bye").unwrap();
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
    rtt
}

#[test]
fn two_processes_ping_pong_over_a_passed_segment() {
    let sleeping = ping_pong(Duration::ZERO);
    let spinning = ping_pong(Duration::from_micros(50));
    // Figures for the notes, not timed assertions.
    eprintln!(
        "shm ring ping-pong between two processes: {sleeping:?} per round trip with futex sleeps, {spinning:?} spinning up to 50 µs first"
    );
}

#[test]
fn descriptor_passing_refuses_empty_messages_and_reports_no_descriptor() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let seg = Segment::create("t", 64).unwrap();
    assert!(send_fd(a.as_fd(), seg.fd(), b"").is_err());
    use std::io::Write;
    (&a).write_all(b"plain").unwrap();
    let mut buf = [0u8; 8];
    let (n, fd) = recv_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!((&buf[..n], fd.is_none()), (&b"plain"[..], true));
}

#[test]
fn only_sealed_segments_are_accepted() {
    // Ours are sealed against resizing.
    let s = Segment::create("t", 4096).unwrap();
    let dup = s.fd().try_clone_to_owned().unwrap();
    assert!(
        rustix::fs::ftruncate(&dup, 0).is_err(),
        "a sealed segment cannot shrink"
    );
    assert!(Segment::open(dup).is_ok());
    // A memfd a peer could still shrink is refused.
    let raw = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&raw, 4096).unwrap();
    assert!(Segment::open(raw).is_err());
}
