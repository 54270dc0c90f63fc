//! The area itself: mapping, claiming and freeing records, the per-record sequence lock,
//! reading snapshots, removing stale files.

use super::*;

mod records;

/// A stats area, mapped shared.
pub struct Area {
    map: *mut AtomicU64,
    words: usize,
    path: PathBuf,
    owner: bool,
    writable: bool,
    /// Slot counts, fixed when created or opened (the file could be changed later).
    conn_slots: usize,
    lg_slots: usize,
    /// Where the next connection-slot search starts (slots just freed are found at once, and
    /// a process with many long-lived rows does not rescan them on every claim).
    next_conn: std::sync::atomic::AtomicUsize,
    /// The owner keeps its file open, out of the program's numbers: `smc-stat` finds the areas
    /// of processes whose `/dev/shm` is not its own (another mount namespace or root: a
    /// systemd unit's `PrivateDevices=`/`PrivateTmp=`, a chroot, a container) through
    /// `/proc/PID/fd`. `None` for readers, or when no descriptor was left.
    keep: Option<std::os::fd::OwnedFd>,
    /// The owner's pid as this reader sees it, for an area opened through `/proc/PID/fd`: in
    /// another pid namespace the header's pid is not.
    seen_pid: Option<u32>,
    /// Device and inode of the file, for readers.
    file_id: (u64, u64),
}

/// The name of an area that has no file ([`Area::create_anywhere`] when the directory cannot
/// be used): what `/proc/PID/fd` shows for it, without the kernel's " (deleted)".
pub const ANONYMOUS_NAME: &str = "/memfd:smcr-stats";

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
        // A directory another user made (before us) is theirs to play tricks in: not used,
        // unless it is shared the way /tmp is (sticky and writable by all, as we make it):
        // then nobody can replace or remove our file there, and every user of the host
        // (postgres, nobody, root) keeps a stats area whoever came first.
        {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::symlink_metadata(dir)?;
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            let shared = m.mode() & 0o1777 == 0o1777;
            if !m.is_dir() || (m.uid() != me && m.uid() != 0 && !shared) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{} is not a directory of root or ours", dir.display()),
                ));
            }
        }
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{pid}-{n}.stats"));
        let words =
            HEADER_WORDS + conn_slots * CONN_WORDS + lg_slots * LG_WORDS + DEV_SLOTS * DEV_WORDS;
        let tmp = dir.join(format!(".{pid}-{n}.stats.tmp"));
        // A new file, never one that is there (a planted symlink would be followed).
        let _ = std::fs::remove_file(&tmp);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let area = Self::init(f, words, path.clone(), conn_slots, lg_slots)?;
        std::fs::rename(&tmp, &path)?;
        Ok(area)
    }

    /// [`Area::create`] in `dir`, or, when the directory cannot be used (read-only, missing or
    /// not ours: a chroot, `ProtectSystem=strict`), an area without a file (a memfd, named
    /// [`ANONYMOUS_NAME`]) that `smc-stat` finds through `/proc/PID/fd` (as root, or as the
    /// same user).
    pub fn create_anywhere(dir: &Path, conn_slots: usize, lg_slots: usize) -> io::Result<Self> {
        Self::create(dir, conn_slots, lg_slots)
            .or_else(|_| Self::create_anonymous(conn_slots, lg_slots))
    }

    /// An area without a file (see [`Area::create_anywhere`]).
    pub fn create_anonymous(conn_slots: usize, lg_slots: usize) -> io::Result<Self> {
        let words =
            HEADER_WORDS + conn_slots * CONN_WORDS + lg_slots * LG_WORDS + DEV_SLOTS * DEV_WORDS;
        let fd = rustix::fs::memfd_create(
            &ANONYMOUS_NAME["/memfd:".len()..],
            rustix::fs::MemfdFlags::CLOEXEC,
        )?;
        // Nothing to remove when dropped: the memory goes with the last mapping and descriptor.
        let path = PathBuf::from(ANONYMOUS_NAME);
        Self::init(File::from(fd), words, path, conn_slots, lg_slots)
    }

    /// Sizes `f`, maps it and writes the header; the area keeps `f` open (see `keep`).
    fn init(
        f: File,
        words: usize,
        path: PathBuf,
        conn_slots: usize,
        lg_slots: usize,
    ) -> io::Result<Self> {
        let pid = std::process::id();
        f.set_len((words * 8) as u64)?;
        let mut area = Self::map(&f, words, true, path)?;
        debug_assert!(area.owner);
        area.keep = rdma::fdzone::place(std::os::fd::OwnedFd::from(f)).ok();
        (area.conn_slots, area.lg_slots) = (conn_slots, lg_slots);
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
        Ok(area)
    }

    /// Maps an existing area read-only (for `smc-stat`); checks magic, version and size.
    pub fn open(path: &Path) -> io::Result<Self> {
        Self::open_with(path, false)
    }

    /// Maps an existing area read-write, for [`Area::reset`] (needs write permission on the
    /// file: its owner or root).
    pub fn open_rw(path: &Path) -> io::Result<Self> {
        Self::open_with(path, true)
    }

    /// Maps, read-only, the area a process holds at descriptor `fd` (found by
    /// [`Area::held_by`]), whatever its mount namespace or root; [`Area::pid`] is then `pid`.
    pub fn open_held(pid: u32, fd: i32) -> io::Result<Self> {
        let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
        // The magic link is followed (it is the kernel's, not a planted one).
        let mut a = Self::open_file(&path, false, 0)?;
        a.seen_pid = Some(pid);
        Ok(a)
    }

    /// The descriptors of process `pid` that hold stats areas (ours, a file of a stats
    /// directory or [`ANONYMOUS_NAME`]), as its `/proc/PID/fd` links show them.
    pub fn held_by(pid: u32) -> Vec<i32> {
        let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| {
                let fd: i32 = e.file_name().to_str()?.parse().ok()?;
                let l = std::fs::read_link(e.path()).ok()?;
                let l = l.to_string_lossy();
                let l = l.strip_suffix(" (deleted)").unwrap_or(&l);
                (l == ANONYMOUS_NAME || (l.ends_with(".stats") && l.contains("/smcr/")))
                    .then_some(fd)
            })
            .collect()
    }

    /// Whether `pid` (as this reader sees it) is the process that made the area: a forked
    /// child keeps its parent's descriptor until it execs, and in another pid namespace the
    /// header's pid is the one the owner sees (the last of its `NSpid`).
    pub fn made_by(&self, pid: u32) -> bool {
        let header = self.slice()[H_PID].load(Ordering::Relaxed) as u32;
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|v| v.split_whitespace().last()?.parse::<u32>().ok())
                == Some(header)
        })
    }

    /// The file's device and inode (one area seen two ways is one area).
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }

    fn open_with(path: &Path, rw: bool) -> io::Result<Self> {
        // Not through a symlink, and never blocking on a FIFO someone planted.
        Self::open_file(path, rw, libc::O_NOFOLLOW)
    }

    fn open_file(path: &Path, rw: bool, flags: i32) -> io::Result<Self> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(rw)
            .custom_flags(flags | libc::O_NONBLOCK)
            .open(path)?;
        let meta = f.metadata()?;
        if !meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a stats area (not a regular file)",
            ));
        }
        let len = meta.len() as usize;
        if len < HEADER_WORDS * 8 || !len.is_multiple_of(8) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a stats area (size)",
            ));
        }
        let mut area = Self::map(&f, len / 8, rw, path.to_owned())?;
        area.owner = false;
        area.file_id = (meta.dev(), meta.ino());
        let h = area.slice();
        if h[H_MAGIC].load(Ordering::Acquire) != MAGIC
            || h[H_VERSION].load(Ordering::Relaxed) != VERSION
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a stats area (magic or version)",
            ));
        }
        // Slot counts come from the file: read once (the file may change later), and a
        // corrupt one must not overflow the arithmetic.
        let (conns, lgs) = (
            h[H_CONN_SLOTS].load(Ordering::Relaxed) as usize,
            h[H_LG_SLOTS].load(Ordering::Relaxed) as usize,
        );
        (area.conn_slots, area.lg_slots) = (conns, lgs);
        let need = conns
            .checked_mul(CONN_WORDS)
            .and_then(|c| c.checked_add(lgs.checked_mul(LG_WORDS)?))
            .and_then(|n| n.checked_add(HEADER_WORDS + DEV_SLOTS * DEV_WORDS));
        if need.is_none_or(|n| n > area.words) {
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
            writable: write,
            conn_slots: 0,
            lg_slots: 0,
            next_conn: std::sync::atomic::AtomicUsize::new(0),
            keep: None,
            seen_pid: None,
            file_id: (0, 0),
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
        if self.path != Path::new(ANONYMOUS_NAME) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// The process that owns the area: as the reader sees it when opened through
    /// `/proc/PID/fd`, else as the header says.
    pub fn pid(&self) -> u32 {
        self.seen_pid
            .unwrap_or_else(|| self.slice()[H_PID].load(Ordering::Relaxed) as u32)
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
        self.conn_slots
    }

    /// Link-group slots.
    pub fn lg_slots(&self) -> usize {
        self.lg_slots
    }

    /// Whether the owner is gone: no such process, or the pid now belongs to a process that
    /// started at another time.
    pub fn is_stale(&self) -> bool {
        let h = self.slice();
        // The start time is counted from boot, the same in every pid namespace.
        match start_time(self.pid()) {
            None => true,
            Some(t) => {
                let recorded = h[H_START].load(Ordering::Relaxed);
                recorded != 0 && recorded != t
            }
        }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped.
        unsafe { libc::munmap(self.map.cast(), self.words * 8) };
        if self.owner && self.path != Path::new(ANONYMOUS_NAME) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Takes a free record (word 1, `in_use`, 0 → 1).
fn claim(r: &[AtomicU64]) -> bool {
    r[1].compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// Writes `words` into `r[1..]` under the sequence lock in `r[0]` (odd while written).
fn seq_write(r: &[AtomicU64], words: &[u64]) {
    r[0].fetch_add(1, Ordering::AcqRel);
    fence(Ordering::Release);
    for (i, w) in words.iter().enumerate() {
        r[1 + i].store(*w, Ordering::Relaxed);
    }
    r[0].fetch_add(1, Ordering::Release);
}

/// Frees a record: clears words `2..end` under the lock while `in_use` (word 1) still holds
/// it, and only then releases `in_use`, so a claimer never races the clearing.
fn seq_free(r: &[AtomicU64], end: usize) {
    r[0].fetch_add(1, Ordering::AcqRel);
    fence(Ordering::Release);
    for w in &r[2..end] {
        w.store(0, Ordering::Relaxed);
    }
    r[0].fetch_add(1, Ordering::Release);
    r[1].store(0, Ordering::Release);
}

/// Reads `r[1..]` into `out` consistently; `Ok(false)` if the record is free (word 0 of
/// `out` is 0), `Err` if it stayed mid-update for [`READ_PATIENCE`]. Spins briefly, then
/// yields the CPU (a writer preempted mid-update needs it back to finish).
fn seq_read(r: &[AtomicU64], out: &mut [u64]) -> Result<bool, ()> {
    let mut deadline = None;
    for attempt in 1u64.. {
        let s1 = r[0].load(Ordering::Acquire);
        if s1.is_multiple_of(2) {
            for (i, w) in out.iter_mut().enumerate() {
                *w = r[1 + i].load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            if r[0].load(Ordering::Relaxed) == s1 {
                return Ok(out[0] != 0);
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
    Err(())
}

/// A process's start time (clock ticks after boot).
fn start_time(pid: u32) -> Option<u64> {
    crate::sys::proc_stat(pid).map(|s| s.start_ticks)
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
