use super::*;

/// A test's directory: removed when the test passes, kept for a look when it fails.
struct TestDir(std::path::PathBuf);

impl std::ops::Deref for TestDir {
    type Target = std::path::PathBuf;
    fn deref(&self) -> &std::path::PathBuf {
        &self.0
    }
}

impl AsRef<std::path::Path> for TestDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn dir(tag: &str) -> TestDir {
    let d = std::env::temp_dir().join(format!("smcr-stats-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    TestDir(d)
}

/// A Linux server that shares none of our UEIDs declines NOSMCDEV (not NOUEID): the
/// remedy must name the setting, as it does for NOUEID.
#[test]
fn ueid_mismatch_remedies_name_the_setting() {
    for code in [0x0303_0000, 0x0303_0008] {
        assert!(
            remedy(code).contains("SMCR_UEID"),
            "{code:#x}: {}",
            remedy(code)
        );
    }
}

#[test]
fn a_reader_sees_what_the_writer_wrote() {
    let d = dir("rw");
    let w = Area::create(&d, 4, 2).unwrap();
    let r = Area::open(w.path()).unwrap();
    assert_eq!(
        (r.pid(), r.conn_slots(), r.lg_slots()),
        (std::process::id(), 4, 2)
    );
    assert!(!r.comm().is_empty());
    assert!(!r.is_stale());
    let s = w.claim_conn().unwrap();
    let mut rec = ConnRecord::default();
    rec.words[0] = 1;
    rec.words[1] = 0x7f00_0001_1f90;
    w.write_conn(s, &rec);
    w.add_bytes(s, 100, 7);
    let got = r.read_conn(s).unwrap().unwrap();
    assert_eq!(
        (got.words[1], got.bytes_sent, got.bytes_received),
        (0x7f00_0001_1f90, 100, 7)
    );
    assert_eq!(r.read_conn(s + 1).unwrap(), None);
    w.release_conn(s);
    assert_eq!(r.read_conn(s).unwrap(), None);
    assert_eq!(w.claim_conn(), Some(s), "a freed slot is reused");
    w.count_fallback(0x0301_0000);
    w.count_fallback(0x0301_0000);
    w.count_fallback(0x7f00_0004);
    assert_eq!(r.fallbacks(), vec![(0x0301_0000, 2), (0x7f00_0004, 1)]);
    let path = w.path().to_owned();
    drop(w);
    assert!(!path.exists(), "the owner removes its area");
}

#[test]
fn readers_never_see_a_torn_record() {
    let d = dir("torn");
    let w = std::sync::Arc::new(Area::create(&d, 1, 0).unwrap());
    let s = w.claim_conn().unwrap();
    // (Between claim and first write a slot reads as in use with zero fields.)
    w.write_conn(
        s,
        &ConnRecord {
            words: [1; 23],
            ..Default::default()
        },
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (w, stop) = (w.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 1u64;
            while !stop.load(Ordering::Relaxed) {
                // Real writers update a record a few times per connection; this one
                // hammers it, and gives the CPU away now and then as a busy program would.
                if n.is_multiple_of(16) {
                    std::thread::yield_now();
                }
                w.write_conn(
                    s,
                    &ConnRecord {
                        words: [n; 23],
                        ..Default::default()
                    },
                );
                n += 1;
            }
        })
    };
    let r = Area::open(w.path()).unwrap();
    let mut seen = 0;
    let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
    while seen < 20_000 && std::time::Instant::now() < until {
        if let Some(rec) = r.read_conn(s).unwrap() {
            assert!(
                rec.words.iter().all(|&x| x == rec.words[0]),
                "torn: {:?}",
                rec.words
            );
            seen += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(seen > 0);
}

#[test]
fn areas_of_dead_processes_are_stale_and_cleaned() {
    let d = dir("stale");
    let live = Area::create(&d, 1, 0).unwrap();
    // A copy of our area claiming a pid that does not exist.
    let dead = d.join("4194303.stats");
    std::fs::copy(live.path(), &dead).unwrap();
    {
        let f = std::fs::OpenOptions::new().write(true).open(&dead).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&4_194_303u64.to_le_bytes(), (H_PID * 8) as u64)
            .unwrap();
    }
    assert!(Area::open(&dead).unwrap().is_stale());
    // Our own pid with another start time: reused pid, stale too.
    let reused = d.join("reused.stats");
    std::fs::copy(live.path(), &reused).unwrap();
    {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&reused)
            .unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&1u64.to_le_bytes(), (H_START * 8) as u64)
            .unwrap();
    }
    let removed = clean_stale(&d);
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(live.path().exists() && !dead.exists() && !reused.exists());
}

#[test]
fn garbage_is_not_an_area() {
    let d = dir("garbage");
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("x.stats");
    std::fs::write(&p, vec![0u8; 4096]).unwrap();
    assert!(Area::open(&p).is_err());
    std::fs::write(&p, b"short").unwrap();
    assert!(Area::open(&p).is_err());
    // A valid header whose slot counts do not fit the file (or overflow) is refused.
    let real = Area::create(&d, 1, 1).unwrap();
    let mut bytes = std::fs::read(real.path()).unwrap();
    for (conn, lg) in [
        (2u64, 1u64),
        (u64::MAX, 0),
        (1 << 60, 1 << 60),
        (0, u64::MAX / 8),
    ] {
        bytes[H_CONN_SLOTS * 8..][..8].copy_from_slice(&conn.to_le_bytes());
        bytes[H_LG_SLOTS * 8..][..8].copy_from_slice(&lg.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        assert!(Area::open(&p).is_err(), "{conn} {lg}");
    }
}

#[test]
fn link_groups_live_words_totals_and_reset() {
    let d = dir("lg");
    let w = Area::create(&d, 2, 2).unwrap();
    let r = Area::open(w.path()).unwrap();
    let g = w.claim_lg().unwrap();
    let mut rec = LgRecord::default();
    rec.words[lg::IN_USE] = 1;
    rec.words[lg::ID] = 7 | lg::ROLE_SERVER << 32 | lg::LINK_ACTIVE << 48;
    w.write_lg(g, &rec);
    w.set_lg_conns(g, 3);
    let got = r.read_lg(g).unwrap().unwrap();
    assert_eq!((got.words[lg::ID], got.conns), (rec.words[lg::ID], 3));
    assert_eq!(r.read_lg(1 - g).unwrap(), None);
    w.release_lg(g);
    assert_eq!(r.read_lg(g).unwrap(), None);
    // Live words: plain stores; "once" keeps the first value; a claim clears them.
    let c = w.claim_conn().unwrap();
    w.write_conn(
        c,
        &ConnRecord {
            words: [1; 23],
            ..Default::default()
        },
    );
    w.set_live(c, conn::live::TX_PROD, 5);
    w.set_live_once(c, conn::live::FIRST_WRITE, 10);
    w.set_live_once(c, conn::live::FIRST_WRITE, 20);
    w.add_bytes(c, 30, 40);
    let got = r.read_conn(c).unwrap().unwrap();
    assert_eq!(got.live[conn::live::TX_PROD], 5);
    assert_eq!(got.live[conn::live::FIRST_WRITE], 10);
    // Released bytes go to the process totals.
    w.release_conn(c);
    let c2 = w.claim_conn().unwrap();
    assert_eq!(c2, c);
    w.write_conn(
        c2,
        &ConnRecord {
            words: [1; 23],
            ..Default::default()
        },
    );
    assert_eq!(
        r.read_conn(c2).unwrap().unwrap().live,
        [0; conn::live::COUNT]
    );
    w.count(total::SMCR);
    w.count(total::SMCR);
    w.count_fallback(0x0301_0000);
    let t = r.totals();
    assert_eq!(
        (
            t[total::SMCR],
            t[total::BYTES_SENT],
            t[total::BYTES_RECEIVED]
        ),
        (2, 30, 40)
    );
    assert_eq!(r.fallbacks(), vec![(0x0301_0000, 1)]);
    // A read-only mapping cannot reset; a read-write one resets for every reader.
    assert_eq!(
        r.reset().unwrap_err().kind(),
        io::ErrorKind::PermissionDenied
    );
    Area::open_rw(w.path()).unwrap().reset().unwrap();
    assert_eq!(r.totals(), [0; total::COUNT]);
    assert_eq!(r.fallbacks(), vec![]);
    assert_eq!(r.reset_epoch(), 1);
    // Counting resumes, in the same (code, count) pair.
    w.count_fallback(0x0301_0000);
    assert_eq!(r.fallbacks(), vec![(0x0301_0000, 1)]);
    assert!(
        w.path().exists(),
        "a reader's drop never removes the owner's area"
    );
}

#[test]
fn planted_fifos_and_symlinks_are_not_areas_and_never_block() {
    let d = dir("planted");
    std::fs::create_dir_all(&d).unwrap();
    let fifo = d.join("1-0.stats");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let real = Area::create(&d, 1, 1).unwrap();
    std::os::unix::fs::symlink(real.path(), d.join("2-0.stats")).unwrap();
    // Neither blocks (a FIFO opened without O_NONBLOCK would wait for a writer).
    assert!(Area::open(&fifo).is_err());
    assert!(Area::open(&d.join("2-0.stats")).is_err());
    assert!(clean_stale(&d).is_empty());
    assert!(Area::open(real.path()).is_ok());
}

#[test]
fn codes_beyond_the_counters_go_to_other() {
    let d = dir("other");
    let w = Area::create(&d, 1, 0).unwrap();
    for c in 1..=FALLBACK_CODES as u32 + 5 {
        w.count_fallback(0x0500_0000 + c);
    }
    let f = w.fallbacks();
    assert_eq!(f.len(), FALLBACK_CODES);
    assert_eq!(f.iter().find(|(c, _)| *c == 0), Some(&(0, 6)));
}

/// Linux's buckets (`fls64((len - 1) >> 13)`, capped at SMC_BUF_G_1024K): a request or buffer
/// goes in the smallest that holds it.
#[test]
fn sizes_go_in_the_smallest_bucket_that_holds_them() {
    for (bytes, want) in [
        (1, 0),
        (100, 0),
        (8192, 0),
        (8193, 1),
        (10_000, 1),
        (16384, 1),
        (16385, 2),
        (65536, 3),
        (512 * 1024, 6),
        (1024 * 1024, 7),
        (1024 * 1024 + 1, 8),
        (u64::MAX, 8),
    ] {
        assert_eq!(bucket(bytes), want, "{bytes}");
    }
    assert_eq!(BUCKET_NAMES[bucket(10_000)], "16KB");
}

/// Requests and buffer-full counts land in the record, are folded into the totals (with the
/// buffer sizes of an SMC-R connection) when it is freed, and a reset zeroes both the totals
/// and the open records' counts; a freed record starts the next connection from zero.
#[test]
fn requests_and_buffer_full_are_counted_and_folded() {
    use conn::counter;
    let d = dir("reqs");
    let w = Area::create(&d, 2, 0).unwrap();
    let r = Area::open(w.path()).unwrap();
    let s = w.claim_conn().unwrap();
    let mut rec = ConnRecord::default();
    rec.words[conn::IN_USE] = 1;
    rec.words[conn::STATE] = conn::STATE_ACTIVE | conn::MODE_SMCR << 16;
    rec.words[conn::SIZES] = 65536 | 16384 << 32; // RMB 64 KiB, send buffer 16 KiB
    w.write_conn(s, &rec);
    for n in [10_000, 10_000, 10_000, 100] {
        w.count_request(s, true, n);
    }
    w.count_request(s, true, 0); // moved nothing: not a request
    w.count_request(s, false, 2_000_000);
    w.count_conn(s, counter::RX_FULL);
    w.count_conn(s, counter::TX_FULL);
    w.count_conn(s, counter::TX_FULL);
    w.count_conn(s, counter::TX_FULL_PEER);
    let got = r.read_conn(s).unwrap().unwrap().counters;
    let mut want = [0; counter::COUNT];
    want[counter::TX_REQS] = 1;
    want[counter::TX_REQS + 1] = 3;
    want[counter::RX_REQS + 8] = 1;
    want[counter::RX_FULL] = 1;
    want[counter::TX_FULL] = 2;
    want[counter::TX_FULL_PEER] = 1;
    assert_eq!(got, want);
    // A TCP connection's record: its (absent) sizes are no buffers.
    let t = w.claim_conn().unwrap();
    let mut tcp = ConnRecord::default();
    tcp.words[conn::IN_USE] = 1;
    tcp.words[conn::STATE] = conn::STATE_ACTIVE | conn::MODE_TCP << 16;
    w.write_conn(t, &tcp);
    w.release_conn(t);
    w.release_conn(s);
    let totals = r.totals();
    assert_eq!(
        totals[total::COUNTERS..total::COUNTERS + counter::COUNT],
        want
    );
    let (mut rx_bufs, mut tx_bufs) = ([0; BUCKETS], [0; BUCKETS]);
    rx_bufs[3] = 1;
    tx_bufs[1] = 1;
    assert_eq!(totals[total::RX_BUFS..total::RX_BUFS + BUCKETS], rx_bufs);
    assert_eq!(totals[total::TX_BUFS..total::TX_BUFS + BUCKETS], tx_bufs);
    // The slot, claimed again, starts from zero.
    let s2 = w.claim_conn().unwrap();
    w.write_conn(s2, &rec);
    assert_eq!(
        r.read_conn(s2).unwrap().unwrap().counters,
        [0; counter::COUNT]
    );
    w.count_request(s2, false, 1);
    w.reset().unwrap();
    assert_eq!(r.totals(), [0; total::COUNT]);
    assert_eq!(
        r.read_conn(s2).unwrap().unwrap().counters,
        [0; counter::COUNT],
        "a reset zeroes open connections' counts too"
    );
}

/// A reader summing totals and open records never sees a closing connection in neither
/// place or in both: the sum only grows while connections open, count and close.
#[test]
fn totals_plus_records_never_go_down_while_connections_close() {
    let d = dir("consistent");
    let w = std::sync::Arc::new(Area::create(&d, 4, 0).unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (w, stop) = (w.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rec = ConnRecord::default();
            rec.words[conn::IN_USE] = 1;
            rec.words[conn::STATE] = conn::STATE_ACTIVE | conn::MODE_SMCR << 16;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let s = w.claim_conn().unwrap();
                w.write_conn(s, &rec);
                for _ in 0..3 {
                    w.count_request(s, true, 100);
                }
                w.release_conn(s);
                n += 1;
                // Pauses now and then: a reader needs a moment without a release to finish
                // (after 1000 tries `read_consistent` gives up and returns what it read,
                // which a writer releasing without pause on a loaded machine could force).
                if n.is_multiple_of(16) {
                    std::thread::sleep(std::time::Duration::from_micros(20));
                }
            }
        })
    };
    let r = Area::open(w.path()).unwrap();
    let mut last = 0;
    let until = std::time::Instant::now() + std::time::Duration::from_millis(200);
    while std::time::Instant::now() < until {
        let sum = r.read_consistent(|| {
            let live: u64 = (0..r.conn_slots())
                .filter_map(|i| r.read_conn(i).ok().flatten())
                .map(|c| c.counters[conn::counter::TX_REQS])
                .sum();
            live + r.totals()[total::COUNTERS + conn::counter::TX_REQS]
        });
        assert!(sum >= last, "went down: {last} → {sum}");
        last = sum;
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(last > 0);
}
