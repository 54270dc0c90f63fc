//! The shared-memory stats area (issue 6, first step): each process running the runtime keeps
//! its connections, link groups and fallback counters in a file under `/dev/shm/smcr/`,
//! mapped shared, that `smc-stat` maps read-only while the program runs (or hangs).
//!
//! The area is an array of 64-bit atomics, so no reader can tear a counter and nothing in it
//! is a pointer. Records are fixed-size slots; a slot's fields change under a per-slot
//! sequence lock (odd while written), which readers retry on and writers never wait for —
//! the application is never blocked by a reader. Hot counters (bytes) are plain atomic adds
//! outside the sequence lock. A file whose process is gone (no such pid, or a pid reused by
//! a process with another start time) is stale and removed by [`clean_stale`].
//!
//! Layout (in 64-bit words; see the `H_*`, `C_*` constants): a 128-word header (magic,
//! version, pid, start time, command name, slot counts, reset epoch, fallback counters as
//! (code, count) pairs), then `conn_slots` connection records of [`CONN_WORDS`] words, then
//! `lg_slots` link-group records of [`LG_WORDS`] words.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering, fence};

/// `SMCRSTA1`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SMCRSTA1");
/// Layout version.
pub const VERSION: u64 = 1;
/// Where the areas live.
pub const DEFAULT_DIR: &str = "/dev/shm/smcr";

const HEADER_WORDS: usize = 128;
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_PID: usize = 2;
const H_START: usize = 3;
const H_COMM: usize = 4; // 2 words, 16 bytes
const H_CONN_SLOTS: usize = 6;
const H_LG_SLOTS: usize = 7;
const H_RESET_EPOCH: usize = 8;
const H_FALLBACKS: usize = 32; // (code, count) pairs up to the header's end
/// How many distinct fallback codes the header counts.
pub const FALLBACK_CODES: usize = (HEADER_WORDS - H_FALLBACKS) / 2;

/// How long a reader waits for a record that is being written before giving up on it.
pub const READ_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);

/// Words per connection record.
pub const CONN_WORDS: usize = 32;
const C_SEQ: usize = 0;
const C_FIELDS: usize = 1; // fields covered by the sequence lock: 1..C_BYTES_SENT
const C_BYTES_SENT: usize = 24;
const C_BYTES_RECEIVED: usize = 25;

/// What the words of [`ConnRecord::words`] hold (indices into `words`).
pub mod conn {
    /// Non-zero while the slot is in use.
    pub const IN_USE: usize = 0;
    /// Local IPv4 address and port: `ip << 16 | port`.
    pub const LOCAL: usize = 1;
    /// Peer IPv4 address and port: `ip << 16 | port`.
    pub const PEER: usize = 2;
    /// Bits 0..8: Linux SMC state; bit 8: we are the server; bits 16..24: [`MODE_SMCR`] or
    /// [`MODE_TCP`].
    pub const STATE: usize = 3;
    /// Low 32 bits: the fallback code (ours or the peer's decline); high 32: the peer's
    /// decline diagnosis when the peer declined.
    pub const REASON: usize = 4;
    /// Low 32 bits: RMB bytes; high 32: send buffer bytes.
    pub const SIZES: usize = 5;
    /// Low 32 bits: our connection token; high 32: the link group's id.
    pub const IDS: usize = 6;
    /// Unix time (ns) when the connection was recorded (negotiation finished).
    pub const SINCE: usize = 7;
    /// Mode: SMC-R.
    pub const MODE_SMCR: u64 = 1;
    /// Mode: TCP (fallback).
    pub const MODE_TCP: u64 = 2;
    /// Linux's `SMC_ACTIVE`.
    pub const STATE_ACTIVE: u64 = 1;
}

/// Words per link-group record.
pub const LG_WORDS: usize = 16;

/// A connection's record: what the sequence lock protects (addresses, mode, reason, sizes,
/// stage timestamps), as words, so that the layout is the format. Field meanings are
/// assigned by the runtime (issue 6's next step); index 0 is `in_use` (non-zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnRecord {
    /// Words 1..24 of the slot.
    pub words: [u64; C_BYTES_SENT - C_FIELDS],
    /// Bytes sent (a running counter, outside the lock).
    pub bytes_sent: u64,
    /// Bytes received (a running counter, outside the lock).
    pub bytes_received: u64,
}

/// A stats area, mapped shared.
pub struct Area {
    map: *mut AtomicU64,
    words: usize,
    path: PathBuf,
    owner: bool,
}

// SAFETY: the mapping is only accessed through atomics; the pointer stays valid until drop.
unsafe impl Send for Area {}
// SAFETY: as above.
unsafe impl Sync for Area {}

impl Area {
    /// Creates an area of this process in `dir`, named `<pid>-<n>.stats` (`n` counts the
    /// areas this process made: one per runtime), with room for `conn_slots` connections and
    /// `lg_slots` link groups.
    pub fn create(dir: &Path, conn_slots: usize, lg_slots: usize) -> io::Result<Self> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        std::fs::create_dir_all(dir)?;
        // Readers of other users may look; nothing in the area is secret beyond addresses.
        let _ = std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777));
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{pid}-{n}.stats"));
        let words = HEADER_WORDS + conn_slots * CONN_WORDS + lg_slots * LG_WORDS;
        let tmp = dir.join(format!(".{pid}-{n}.stats.tmp"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.set_len((words * 8) as u64)?;
        let area = Self::map(&f, words, true, path.clone())?;
        let h = area.slice();
        h[H_VERSION].store(VERSION, Ordering::Relaxed);
        h[H_PID].store(u64::from(pid), Ordering::Relaxed);
        h[H_START].store(start_time(pid).unwrap_or(0), Ordering::Relaxed);
        let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
        let mut c = [0u8; 16];
        let b = comm.trim_end().as_bytes();
        c[..b.len().min(16)].copy_from_slice(&b[..b.len().min(16)]);
        h[H_COMM].store(
            u64::from_le_bytes(c[..8].try_into().unwrap()),
            Ordering::Relaxed,
        );
        h[H_COMM + 1].store(
            u64::from_le_bytes(c[8..].try_into().unwrap()),
            Ordering::Relaxed,
        );
        h[H_CONN_SLOTS].store(conn_slots as u64, Ordering::Relaxed);
        h[H_LG_SLOTS].store(lg_slots as u64, Ordering::Relaxed);
        // The magic last: a reader never sees a half-initialised header as valid.
        h[H_MAGIC].store(MAGIC, Ordering::Release);
        std::fs::rename(&tmp, &path)?;
        Ok(area)
    }

    /// Maps an existing area read-only (for `smc-stat`); checks magic, version and size.
    pub fn open(path: &Path) -> io::Result<Self> {
        let f = File::open(path)?;
        let len = f.metadata()?.len() as usize;
        if len < HEADER_WORDS * 8 || !len.is_multiple_of(8) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a stats area (size)",
            ));
        }
        let area = Self::map(&f, len / 8, false, path.to_owned())?;
        let h = area.slice();
        if h[H_MAGIC].load(Ordering::Acquire) != MAGIC
            || h[H_VERSION].load(Ordering::Relaxed) != VERSION
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a stats area (magic or version)",
            ));
        }
        let need = HEADER_WORDS + area.conn_slots() * CONN_WORDS + area.lg_slots() * LG_WORDS;
        if need > area.words {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "stats area shorter than its header says",
            ));
        }
        Ok(area)
    }

    fn map(f: &File, words: usize, write: bool, path: PathBuf) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mapping `words * 8` bytes of a file at least that long; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * 8,
                prot,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            map: p.cast(),
            words,
            path,
            owner: write,
        })
    }

    fn slice(&self) -> &[AtomicU64] {
        // SAFETY: the mapping holds `words` aligned u64s for our lifetime; a read-only map
        // is only ever loaded from (readers never store).
        unsafe { std::slice::from_raw_parts(self.map, self.words) }
    }

    /// The file behind the area.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file (readers stop finding the area; the mapping stays valid).
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The process that owns the area.
    pub fn pid(&self) -> u32 {
        self.slice()[H_PID].load(Ordering::Relaxed) as u32
    }

    /// Its command name.
    pub fn comm(&self) -> String {
        let h = self.slice();
        let mut b = h[H_COMM].load(Ordering::Relaxed).to_le_bytes().to_vec();
        b.extend_from_slice(&h[H_COMM + 1].load(Ordering::Relaxed).to_le_bytes());
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    }

    /// Connection slots.
    pub fn conn_slots(&self) -> usize {
        self.slice()[H_CONN_SLOTS].load(Ordering::Relaxed) as usize
    }

    /// Link-group slots.
    pub fn lg_slots(&self) -> usize {
        self.slice()[H_LG_SLOTS].load(Ordering::Relaxed) as usize
    }

    /// Whether the owner is gone: no such process, or the pid now belongs to a process that
    /// started at another time.
    pub fn is_stale(&self) -> bool {
        let h = self.slice();
        let pid = h[H_PID].load(Ordering::Relaxed) as u32;
        match start_time(pid) {
            None => true,
            Some(t) => {
                let recorded = h[H_START].load(Ordering::Relaxed);
                recorded != 0 && recorded != t
            }
        }
    }

    fn conn(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < self.conn_slots(), "connection slot out of range");
        let at = HEADER_WORDS + slot * CONN_WORDS;
        &self.slice()[at..at + CONN_WORDS]
    }

    /// Claims a free connection slot (its `in_use` word 0 → 1); `None` when all are taken.
    pub fn claim_conn(&self) -> Option<usize> {
        (0..self.conn_slots()).find(|&i| {
            let r = self.conn(i);
            r[C_FIELDS]
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                .then(|| {
                    r[C_BYTES_SENT].store(0, Ordering::Relaxed);
                    r[C_BYTES_RECEIVED].store(0, Ordering::Relaxed);
                })
                .is_some()
        })
    }

    /// Writes a connection's locked fields (`rec.words[0]`, `in_use`, must stay non-zero).
    pub fn write_conn(&self, slot: usize, rec: &ConnRecord) {
        let r = self.conn(slot);
        r[C_SEQ].fetch_add(1, Ordering::AcqRel);
        fence(Ordering::Release);
        for (i, w) in rec.words.iter().enumerate() {
            r[C_FIELDS + i].store(*w, Ordering::Relaxed);
        }
        r[C_SEQ].fetch_add(1, Ordering::Release);
    }

    /// Adds to a connection's byte counters.
    pub fn add_bytes(&self, slot: usize, sent: u64, received: u64) {
        let r = self.conn(slot);
        if sent > 0 {
            r[C_BYTES_SENT].fetch_add(sent, Ordering::Relaxed);
        }
        if received > 0 {
            r[C_BYTES_RECEIVED].fetch_add(received, Ordering::Relaxed);
        }
    }

    /// Frees a slot (a reader then sees it empty).
    pub fn release_conn(&self, slot: usize) {
        self.write_conn(slot, &ConnRecord::default());
    }

    /// A consistent copy of a slot, or `None` if it is free. Retries while a writer is in
    /// the middle of an update, yielding the CPU now and then (a writer preempted
    /// mid-update needs it back to finish), for at most [`READ_PATIENCE`]: a writer that
    /// died mid-update leaves the slot unreadable, reported as an error.
    pub fn read_conn(&self, slot: usize) -> io::Result<Option<ConnRecord>> {
        let r = self.conn(slot);
        let mut deadline = None;
        for attempt in 1u64.. {
            let s1 = r[C_SEQ].load(Ordering::Acquire);
            if s1.is_multiple_of(2) {
                let mut rec = ConnRecord::default();
                for (i, w) in rec.words.iter_mut().enumerate() {
                    *w = r[C_FIELDS + i].load(Ordering::Relaxed);
                }
                fence(Ordering::Acquire);
                if r[C_SEQ].load(Ordering::Relaxed) == s1 {
                    if rec.words[0] == 0 {
                        return Ok(None);
                    }
                    rec.bytes_sent = r[C_BYTES_SENT].load(Ordering::Relaxed);
                    rec.bytes_received = r[C_BYTES_RECEIVED].load(Ordering::Relaxed);
                    return Ok(Some(rec));
                }
            }
            if !attempt.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let now = std::time::Instant::now();
            match deadline {
                None => deadline = Some(now + READ_PATIENCE),
                Some(d) if now >= d => break,
                Some(_) => {}
            }
            std::thread::yield_now();
        }
        Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("connection slot {slot} stays mid-update"),
        ))
    }

    /// Counts one fallback with `code`. Codes beyond [`FALLBACK_CODES`] distinct ones are
    /// counted under code 0 ("other").
    pub fn count_fallback(&self, code: u32) {
        let h = self.slice();
        let key = u64::from(code) | 1 << 32; // never 0: 0 marks a free pair
        for i in 0..FALLBACK_CODES {
            let k = &h[H_FALLBACKS + 2 * i];
            let cur = k.load(Ordering::Acquire);
            let owned = cur == key
                || (cur == 0
                    && match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => true,
                        Err(now) => now == key,
                    });
            if owned {
                h[H_FALLBACKS + 2 * i + 1].fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if code != 0 {
            self.count_fallback(0);
        }
    }

    /// The fallback counters, by code.
    pub fn fallbacks(&self) -> Vec<(u32, u64)> {
        let h = self.slice();
        (0..FALLBACK_CODES)
            .filter_map(|i| {
                let k = h[H_FALLBACKS + 2 * i].load(Ordering::Acquire);
                (k != 0).then(|| (k as u32, h[H_FALLBACKS + 2 * i + 1].load(Ordering::Relaxed)))
            })
            .collect()
    }

    /// The reset epoch (bumped by each reset of the counters).
    pub fn reset_epoch(&self) -> u64 {
        self.slice()[H_RESET_EPOCH].load(Ordering::Relaxed)
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped.
        unsafe { libc::munmap(self.map.cast(), self.words * 8) };
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Name and meaning of a fallback code: Linux's decline codes, and ours (0x7f00_00xx).
pub fn reason(code: u32) -> (&'static str, &'static str) {
    use crate::FallbackReason as F;
    match code {
        F::CODE_NO_BPF => ("NOBPF", "the TCP option program is not usable here"),
        F::CODE_OPTION_NOT_OBSERVED => (
            "OPTNOTSEEN",
            "the TCP option program did not see the handshake (socket outside its cgroup?)",
        ),
        F::CODE_NOT_IPV4 => ("NOTIPV4", "not an IPv4 connection"),
        F::CODE_EXCLUDED => ("EXCLUDED", "kept on TCP by SMCR_INCLUDE/SMCR_EXCLUDE"),
        0 => ("OTHER", "codes beyond the area's counters"),
        c => {
            let r = clc::DeclineReason(c);
            (
                r.name().unwrap_or("UNKNOWN"),
                r.meaning().unwrap_or("unknown code"),
            )
        }
    }
}

/// A process's start time (clock ticks after boot, field 22 of /proc/PID/stat).
fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Removes the areas in `dir` whose processes are gone; returns their paths.
pub fn clean_stale(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "stats")
            && let Ok(a) = Area::open(&p)
            && a.is_stale()
            && std::fs::remove_file(&p).is_ok()
        {
            removed.push(p);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("smcr-stats-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
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
    }
}
