//! The area itself: mapping, claiming and freeing records, the per-record sequence lock,
//! reading snapshots, removing stale files.

use super::*;

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

    fn conn(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < self.conn_slots(), "connection slot out of range");
        let at = HEADER_WORDS + slot * CONN_WORDS;
        &self.slice()[at..at + CONN_WORDS]
    }

    fn lg(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < self.lg_slots(), "link-group slot out of range");
        let at = HEADER_WORDS + self.conn_slots() * CONN_WORDS + slot * LG_WORDS;
        &self.slice()[at..at + LG_WORDS]
    }

    fn dev(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < DEV_SLOTS, "device slot out of range");
        let at = HEADER_WORDS
            + self.conn_slots() * CONN_WORDS
            + self.lg_slots() * LG_WORDS
            + slot * DEV_WORDS;
        &self.slice()[at..at + DEV_WORDS]
    }

    /// Claims a free device slot; `None` when all are taken.
    pub fn claim_dev(&self) -> Option<usize> {
        (0..DEV_SLOTS).find(|&i| claim(self.dev(i)))
    }

    /// The counter words of device slot `slot`, for the engine to bump
    /// ([`rdma::CounterWords`]).
    pub fn dev_counters(&self, slot: usize) -> &[AtomicU64] {
        &self.dev(slot)[D_COUNTERS..D_COUNTERS + rdma::DeviceStats::COUNT]
    }

    /// Records what device slot `slot` is: its address, mode code ([`dev::MODE`]) and range.
    pub fn set_dev(&self, slot: usize, addr: std::net::SocketAddrV4, mode: u64, range: u32) {
        let r = self.dev(slot);
        r[dev::ADDR].store(
            u64::from(u32::from(*addr.ip())) << 16 | u64::from(addr.port()),
            Ordering::Relaxed,
        );
        r[dev::MODE].store(mode | u64::from(range & 0xFFFF) << 8, Ordering::Relaxed);
    }

    /// Frees a device slot (its counters zeroed for the next device).
    pub fn release_dev(&self, slot: usize) {
        let r = self.dev(slot);
        for w in &r[2..] {
            w.store(0, Ordering::Relaxed);
        }
        r[1].store(0, Ordering::Release);
    }

    /// Device slot `slot`, or `None` if it is free. Counters are read one by one (each is
    /// monotonic; no lock).
    pub fn read_dev(&self, slot: usize) -> Option<DevRecord> {
        let r = self.dev(slot);
        if r[1].load(Ordering::Acquire) == 0 {
            return None;
        }
        let a = r[dev::ADDR].load(Ordering::Relaxed);
        let m = r[dev::MODE].load(Ordering::Relaxed);
        let words: Vec<u64> = r[D_COUNTERS..D_COUNTERS + rdma::DeviceStats::COUNT]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        Some(DevRecord {
            addr: std::net::SocketAddrV4::new(((a >> 16) as u32).into(), a as u16),
            mode: dev::MODE_NAMES
                .get((m & 0xFF) as usize)
                .copied()
                .unwrap_or("?"),
            range: ((m >> 8) & 0xFFFF) as u32,
            stats: rdma::DeviceStats::from_words(&words),
        })
    }

    /// Claims a free connection slot (its `in_use` word 0 → 1); `None` when all are taken.
    pub fn claim_conn(&self) -> Option<usize> {
        let n = self.conn_slots();
        let start = self.next_conn.load(Ordering::Relaxed);
        let i = (0..n).map(|k| (start + k) % n).find(|&i| {
            let r = self.conn(i);
            claim(r)
                .then(|| {
                    r[C_BYTES_SENT].store(0, Ordering::Relaxed);
                    r[C_BYTES_RECEIVED].store(0, Ordering::Relaxed);
                    for w in &r[C_LIVE..C_LIVE + conn::live::COUNT] {
                        w.store(0, Ordering::Relaxed);
                    }
                    for w in &r[C_COUNTERS..C_COUNTERS + conn::counter::COUNT] {
                        w.store(0, Ordering::Relaxed);
                    }
                })
                .is_some()
        })?;
        self.next_conn.store(i + 1, Ordering::Relaxed);
        Some(i)
    }

    /// Writes a connection's locked fields (`rec.words[0]`, `in_use`, must stay non-zero).
    pub fn write_conn(&self, slot: usize, rec: &ConnRecord) {
        seq_write(self.conn(slot), &rec.words);
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

    /// Counts a read (`sent` false) or write that moved `bytes` (none: not a request that
    /// moved data, not counted) in its size bucket.
    pub fn count_request(&self, slot: usize, sent: bool, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let base = if sent {
            conn::counter::TX_REQS
        } else {
            conn::counter::RX_REQS
        };
        self.conn(slot)[C_COUNTERS + base + super::bucket(bytes)].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds one to a connection's [`conn::counter`] word (the buffer-full counts).
    pub fn count_conn(&self, slot: usize, which: usize) {
        assert!(which < conn::counter::COUNT, "no such counter");
        self.conn(slot)[C_COUNTERS + which].fetch_add(1, Ordering::Relaxed);
    }

    /// Stores one of a connection's [`conn::live`] words.
    pub fn set_live(&self, slot: usize, word: usize, value: u64) {
        self.conn(slot)[C_LIVE + word].store(value, Ordering::Relaxed);
    }

    /// Stores a live word if it is still 0 (first-time events).
    pub fn set_live_once(&self, slot: usize, word: usize, value: u64) {
        let _ = self.conn(slot)[C_LIVE + word].compare_exchange(
            0,
            value,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Frees a slot (a reader then sees it empty); its bytes, requests, buffer-full counts
    /// and (an SMC-R connection's) buffer sizes go to the process totals first, between two
    /// counters [`Area::read_consistent`] checks.
    pub fn release_conn(&self, slot: usize) {
        self.next_conn.store(slot, Ordering::Relaxed);
        let h = self.slice();
        h[H_RELEASING].fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        let r = self.conn(slot);
        self.count_n(total::BYTES_SENT, r[C_BYTES_SENT].load(Ordering::Relaxed));
        self.count_n(
            total::BYTES_RECEIVED,
            r[C_BYTES_RECEIVED].load(Ordering::Relaxed),
        );
        for i in 0..conn::counter::COUNT {
            self.count_n(
                total::COUNTERS + i,
                r[C_COUNTERS + i].load(Ordering::Relaxed),
            );
        }
        // The sizes are set once, before the stream is handed out: no lock needed to read.
        let sizes = r[C_FIELDS + conn::SIZES].load(Ordering::Relaxed);
        let smcr =
            r[C_FIELDS + conn::STATE].load(Ordering::Relaxed) >> 16 & 0xff == conn::MODE_SMCR;
        if smcr && sizes != 0 {
            self.count_n(total::RX_BUFS + super::bucket(sizes & 0xffff_ffff), 1);
            self.count_n(total::TX_BUFS + super::bucket(sizes >> 32), 1);
        }
        // Zeroed before the slot is free, not when claimed again: a reader must never see a
        // claimed slot still holding counts that are in the totals already.
        for w in &r[C_BYTES_SENT..CONN_WORDS] {
            w.store(0, Ordering::Relaxed);
        }
        seq_free(r, C_BYTES_SENT);
        h[H_RELEASED].fetch_add(1, Ordering::Release);
    }

    /// Runs `read` (a reading of the totals and the records) again until no record was
    /// being freed while it ran: otherwise a connection closing meanwhile could be counted
    /// in neither place or in both, and a sum of the two that should only grow would not.
    /// Gives up after a while (a writer that died mid-release) and returns the last reading.
    pub fn read_consistent<T>(&self, mut read: impl FnMut() -> T) -> T {
        let h = self.slice();
        for attempt in 0..1000 {
            let started = h[H_RELEASING].load(Ordering::Acquire);
            let done = h[H_RELEASED].load(Ordering::Acquire);
            let v = read();
            // Had `read` seen any write of a release that began after our first load, it
            // would see that release's start below.
            fence(Ordering::Acquire);
            if started == done && h[H_RELEASING].load(Ordering::Relaxed) == started {
                return v;
            }
            if attempt % 16 == 15 {
                std::thread::yield_now();
            }
        }
        read()
    }

    /// A consistent copy of a slot, or `None` if it is free. Retries while a writer is in
    /// the middle of an update, yielding the CPU now and then (a writer preempted
    /// mid-update needs it back to finish), for at most [`READ_PATIENCE`]: a writer that
    /// died mid-update leaves the slot unreadable, reported as an error.
    pub fn read_conn(&self, slot: usize) -> io::Result<Option<ConnRecord>> {
        let r = self.conn(slot);
        let mut rec = ConnRecord::default();
        if !seq_read(r, &mut rec.words).map_err(|()| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("connection slot {slot} stays mid-update"),
            )
        })? {
            return Ok(None);
        }
        rec.bytes_sent = r[C_BYTES_SENT].load(Ordering::Relaxed);
        rec.bytes_received = r[C_BYTES_RECEIVED].load(Ordering::Relaxed);
        for (i, w) in rec.live.iter_mut().enumerate() {
            *w = r[C_LIVE + i].load(Ordering::Relaxed);
        }
        for (i, w) in rec.counters.iter_mut().enumerate() {
            *w = r[C_COUNTERS + i].load(Ordering::Relaxed);
        }
        Ok(Some(rec))
    }

    /// Claims a free link-group slot.
    pub fn claim_lg(&self) -> Option<usize> {
        (0..self.lg_slots()).find(|&i| {
            let r = self.lg(i);
            claim(r)
                .then(|| r[L_CONNS].store(0, Ordering::Relaxed))
                .is_some()
        })
    }

    /// Writes a link group's locked fields.
    pub fn write_lg(&self, slot: usize, rec: &LgRecord) {
        seq_write(self.lg(slot), &rec.words);
    }

    /// Sets a link group's connection count.
    pub fn set_lg_conns(&self, slot: usize, n: u64) {
        self.lg(slot)[L_CONNS].store(n, Ordering::Relaxed);
    }

    /// Frees a link-group slot.
    pub fn release_lg(&self, slot: usize) {
        seq_free(self.lg(slot), L_CONNS);
    }

    /// A consistent copy of a link-group slot, or `None` if it is free (see
    /// [`Area::read_conn`]).
    pub fn read_lg(&self, slot: usize) -> io::Result<Option<LgRecord>> {
        let r = self.lg(slot);
        let mut rec = LgRecord::default();
        if !seq_read(r, &mut rec.words).map_err(|()| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("link-group slot {slot} stays mid-update"),
            )
        })? {
            return Ok(None);
        }
        rec.conns = r[L_CONNS].load(Ordering::Relaxed);
        Ok(Some(rec))
    }

    /// Adds one to a process counter ([`total`]).
    pub fn count(&self, which: usize) {
        self.count_n(which, 1);
    }

    fn count_n(&self, which: usize, n: u64) {
        assert!(which < total::COUNT, "no such total");
        if n > 0 {
            self.slice()[H_TOTALS + which].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The process counters, indexed by [`total`].
    pub fn totals(&self) -> [u64; total::COUNT] {
        let h = self.slice();
        std::array::from_fn(|i| h[H_TOTALS + i].load(Ordering::Relaxed))
    }

    /// Counts one fallback with `code`. Codes beyond [`FALLBACK_CODES`] distinct ones are
    /// counted under code 0 ("other").
    pub fn count_fallback(&self, code: u32) {
        let h = self.slice();
        let key = u64::from(code) | 1 << 32; // never 0: 0 marks a free pair
        // The last pair is kept for code 0 ("other"), so it always has room.
        let pairs = if code == 0 {
            FALLBACK_CODES - 1..FALLBACK_CODES
        } else {
            0..FALLBACK_CODES - 1
        };
        for i in pairs {
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
                let n = h[H_FALLBACKS + 2 * i + 1].load(Ordering::Relaxed);
                (k != 0 && n != 0).then_some((k as u32, n))
            })
            .collect()
    }

    /// Records that SMC-R is unavailable to the whole process, with the fallback code (e.g.
    /// NOBPF): its connections then never reach the negotiation and have no rows.
    pub fn set_unavailable(&self, code: u32) {
        self.slice()[H_UNAVAILABLE].store(u64::from(code), Ordering::Relaxed);
    }

    /// The code set by [`Area::set_unavailable`] (0: SMC-R is available).
    pub fn unavailable(&self) -> u32 {
        self.slice()[H_UNAVAILABLE].load(Ordering::Relaxed) as u32
    }

    /// The reset epoch (bumped by each reset of the counters).
    pub fn reset_epoch(&self) -> u64 {
        self.slice()[H_RESET_EPOCH].load(Ordering::Relaxed)
    }

    /// Zeroes the process counters, the fallback counters and the open connections' request
    /// and buffer-full counters (not the rest of their records, which describe sockets that
    /// exist, nor their bytes, which the socket table shows), and bumps the reset epoch. Needs an
    /// area opened with [`Area::open_rw`] (or our own). Increments racing with the reset
    /// land before or after it, never lost in between (each counter is swapped, not stored).
    pub fn reset(&self) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "stats area opened read-only",
            ));
        }
        let h = self.slice();
        for w in &h[H_TOTALS..H_TOTALS + total::COUNT] {
            w.swap(0, Ordering::Relaxed);
        }
        for i in 0..FALLBACK_CODES {
            h[H_FALLBACKS + 2 * i + 1].swap(0, Ordering::Relaxed);
        }
        for slot in 0..self.conn_slots() {
            for w in &self.conn(slot)[C_COUNTERS..C_COUNTERS + conn::counter::COUNT] {
                w.swap(0, Ordering::Relaxed);
            }
        }
        h[H_RESET_EPOCH].fetch_add(1, Ordering::Release);
        Ok(())
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
