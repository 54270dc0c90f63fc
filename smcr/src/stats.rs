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
//! `lg_slots` link-group records of [`LG_WORDS`] words, then [`DEV_SLOTS`] RoCE device records
//! of [`DEV_WORDS`] words (the engine's counters, which it bumps there itself).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering, fence};

/// `SMCRSTA1`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SMCRSTA1");
/// Layout version.
pub const VERSION: u64 = 3;
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
const H_UNAVAILABLE: usize = 9; // fallback code why SMC-R is off for the whole process (0: on)
const H_TOTALS: usize = 16; // [`total`] counters, up to H_FALLBACKS
const H_FALLBACKS: usize = 32; // (code, count) pairs up to the header's end
/// How many distinct fallback codes the header counts.
pub const FALLBACK_CODES: usize = (HEADER_WORDS - H_FALLBACKS) / 2;

/// Process-wide counters in the header (indices for [`Area::count`] and [`Area::totals`]).
/// `reset` zeroes them, with the fallback counters.
pub mod total {
    /// Connections that went SMC-R.
    pub const SMCR: usize = 0;
    /// Connections that stayed on or fell back to TCP.
    pub const TCP: usize = 1;
    /// Connections that created a link group (first contact).
    pub const FIRST_CONTACT: usize = 2;
    /// Handshakes that failed with no fallback possible (the connection was reset).
    pub const FAILED: usize = 3;
    /// Link groups created.
    pub const LINK_GROUPS: usize = 4;
    /// Bytes sent by connections that have closed (live ones are in their records).
    pub const BYTES_SENT: usize = 5;
    /// Bytes received by connections that have closed.
    pub const BYTES_RECEIVED: usize = 6;
    /// Links that failed while their group had another (its connections moved there).
    pub const LINK_FAILOVERS: usize = 7;
    /// How many there are.
    pub const COUNT: usize = 8;
    /// Their names, as `smc-stat` prints them.
    pub const NAMES: [&str; COUNT] = [
        "smcr_connections",
        "tcp_connections",
        "first_contacts",
        "handshake_failures",
        "link_groups_created",
        "closed_bytes_sent",
        "closed_bytes_received",
        "link_failovers",
    ];
}

/// How long a reader waits for a record that is being written before giving up on it.
pub const READ_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);

/// Words per connection record.
pub const CONN_WORDS: usize = 32;
const C_FIELDS: usize = 1; // fields covered by the sequence lock: 1..C_BYTES_SENT
const C_BYTES_SENT: usize = 24;
const C_BYTES_RECEIVED: usize = 25;
const C_LIVE: usize = 26; // [`conn::live`] words, stored without the lock

/// What the words of [`ConnRecord::words`] hold (indices into `words`).
pub mod conn {
    /// Non-zero while the slot is in use.
    pub const IN_USE: usize = 0;
    /// Local IPv4 address and port: `ip << 16 | port`.
    pub const LOCAL: usize = 1;
    /// Peer IPv4 address and port: `ip << 16 | port` (0 for a listener).
    pub const PEER: usize = 2;
    /// Bits 0..8: Linux SMC state when recorded (the live one is in [`live::FLAGS`]); bit 8:
    /// we are the server; bits 16..24: [`MODE_SMCR`] or [`MODE_TCP`].
    pub const STATE: usize = 3;
    /// Low 32 bits: the fallback code (ours or the peer's decline); high 32: the peer's
    /// decline diagnosis when the peer declined.
    pub const REASON: usize = 4;
    /// Low 32 bits: RMB bytes; high 32: send buffer bytes.
    pub const SIZES: usize = 5;
    /// Low 32 bits: our connection token; high 32: the link group's id.
    pub const IDS: usize = 6;
    /// Unix time (ns) when negotiation began (the TCP connection was up); stage times are
    /// offsets from it.
    pub const SINCE: usize = 7;
    /// The application's descriptor number + 1 (0: not known), for a socket handed back to
    /// the application as plain TCP.
    pub const FD: usize = 8;
    /// That socket's inode (`socket:[N]`): `smc-stat` checks it is still open and reads its
    /// byte counts from the kernel.
    pub const INODE: usize = 9;
    /// Stage times, ns after [`SINCE`] (0: not reached): TCP option checked, Proposal,
    /// Accept, Confirm (sent or received), CONFIRM LINK done (first contact only). The first
    /// RDMA WRITE is [`live::FIRST_WRITE`].
    pub const T_OPTION: usize = 10;
    /// See [`T_OPTION`].
    pub const T_PROPOSAL: usize = 11;
    /// See [`T_OPTION`].
    pub const T_ACCEPT: usize = 12;
    /// See [`T_OPTION`].
    pub const T_CONFIRM: usize = 13;
    /// See [`T_OPTION`].
    pub const T_LINK: usize = 14;
    /// Bit 0: the local address is a native IPv6 one (in [`LOCAL6`]; [`LOCAL`] keeps the
    /// port); bit 1: the peer's (in [`PEER6`]). A dual-stack socket's IPv4 peer (v4-mapped)
    /// is recorded as IPv4.
    pub const FAMILY: usize = 15;
    /// The local IPv6 address (2 words, big-endian halves) when [`FAMILY`] bit 0 is set.
    pub const LOCAL6: usize = 16;
    /// The peer's IPv6 address (2 words) when [`FAMILY`] bit 1 is set.
    pub const PEER6: usize = 18;
    /// Mode: SMC-R.
    pub const MODE_SMCR: u64 = 1;
    /// Mode: TCP (fallback).
    pub const MODE_TCP: u64 = 2;
    /// Linux's `SMC_ACTIVE`.
    pub const STATE_ACTIVE: u64 = 1;
    /// Linux's `SMC_LISTEN`.
    pub const STATE_LISTEN: u64 = 10;

    /// Words of [`super::ConnRecord::live`]: updated as the connection runs, each word on
    /// its own (no lock).
    pub mod live {
        /// How far we wrote into the peer's RMB: `wrap << 32 | count`.
        pub const TX_PROD: usize = 0;
        /// How far the peer says it consumed of what we wrote.
        pub const PEER_CONS: usize = 1;
        /// How far the peer wrote into our RMB.
        pub const RX_PROD: usize = 2;
        /// How far our application read.
        pub const RX_CONS: usize = 3;
        /// Bits 0..8: our CDC connection-state flags; 8..16: the peer's; 16..24: the Linux
        /// SMC state now.
        pub const FLAGS: usize = 4;
        /// ns after `SINCE` of the first RDMA WRITE (0: none yet).
        pub const FIRST_WRITE: usize = 5;
        /// How many.
        pub const COUNT: usize = 6;
    }
}

/// A claimed connection record in an area, freed with the stream (or, for a socket handed
/// back to the application as plain TCP, when its descriptor is found closed).
pub(crate) struct StatSlot {
    pub(crate) area: std::sync::Arc<Area>,
    pub(crate) slot: usize,
}

impl Drop for StatSlot {
    fn drop(&mut self) {
        self.area.release_conn(self.slot);
    }
}

/// Linux's SMC socket states (`enum smc_state`) by number, with `smcss`'s short names.
pub fn state_name(state: u64) -> &'static str {
    crate::conn::SmcState::from_code(state).map_or("UNKNOWN", crate::conn::SmcState::name)
}

/// RoCE device records per area (a process has one device per local address it runs SMC-R
/// on, plus its alternate addresses).
pub const DEV_SLOTS: usize = 8;
/// Words per device record.
pub const DEV_WORDS: usize = 32;
/// Where a device record's counters start ([`rdma::DeviceStats::NAMES`] order).
const D_COUNTERS: usize = 8;
const _: () = assert!(D_COUNTERS + rdma::DeviceStats::COUNT <= DEV_WORDS);

/// What the words of a device record hold (word 0 is unused, 1 is in use).
pub mod dev {
    /// The device's IPv4 address and UDP port: `ip << 16 | port`.
    pub const ADDR: usize = 2;
    /// Bits 0..8: how packets reach it (1 steered, 2 owner, 3 local-only, 4 fixed); 8..24:
    /// its queue pair range.
    pub const MODE: usize = 3;
    /// Mode names by code (see [`MODE`]).
    pub const MODE_NAMES: [&str; 5] = ["?", "steered", "owner", "local-only", "fixed"];
}

/// A device's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevRecord {
    /// The device's address.
    pub addr: std::net::SocketAddrV4,
    /// How packets reach it ([`dev::MODE_NAMES`]).
    pub mode: &'static str,
    /// Its queue pair range.
    pub range: u32,
    /// The engine's counters.
    pub stats: rdma::DeviceStats,
}

/// Words per link-group record.
pub const LG_WORDS: usize = 16;
const L_CONNS: usize = 15; // live connection count, no lock

/// What the words of [`LgRecord::words`] hold.
pub mod lg {
    /// Non-zero while the slot is in use.
    pub const IN_USE: usize = 0;
    /// Bits 0..32: link group id; 32..40: role ([`ROLE_CLIENT`]/[`ROLE_SERVER`]); 40..48:
    /// link id; 48..56: link state ([`LINK_ACTIVATING`], [`LINK_ACTIVE`], [`LINK_INACTIVE`]).
    pub const ID: usize = 1;
    /// Our GID (16 bytes, big-endian halves).
    pub const GID: usize = 2;
    /// The peer's GID (2 words).
    pub const PEER_GID: usize = 4;
    /// Low 32 bits: our QPN; high 32: the peer's.
    pub const QPNS: usize = 6;
    /// The peer's system id (8 bytes, big-endian).
    pub const PEER_SYSTEM: usize = 7;
    /// Unix time (ns) of creation.
    pub const SINCE: usize = 8;
    /// Low 32 bits: path MTU bytes; high 32: the most connections the peer allows.
    pub const MTU: usize = 9;
    /// How the link moves data: [`TRANSPORT_UDP`] or [`TRANSPORT_SHM`] (0: not known).
    pub const TRANSPORT: usize = 10;
    /// RoCE v2 over UDP.
    pub const TRANSPORT_UDP: u64 = 1;
    /// Same-host shared memory.
    pub const TRANSPORT_SHM: u64 = 2;
    /// Role: we sent the Proposal.
    pub const ROLE_CLIENT: u64 = 1;
    /// Role: we answered it.
    pub const ROLE_SERVER: u64 = 2;
    /// Link state (Linux's names): created, waiting for CONFIRM LINK.
    pub const LINK_ACTIVATING: u64 = 2;
    /// Confirmed and usable.
    pub const LINK_ACTIVE: u64 = 3;
    /// Down (failed or ended).
    pub const LINK_INACTIVE: u64 = 1;
}

/// Linux's link state names by number.
pub fn link_state_name(state: u64) -> &'static str {
    match state {
        1 => "INACTIVE",
        2 => "ACTIVATING",
        3 => "ACTIVE",
        _ => "UNUSED",
    }
}

/// A connection's record: what the sequence lock protects (addresses, mode, reason, sizes,
/// stage timestamps), as words, so that the layout is the format (see [`conn`]); index 0 is
/// `in_use` (non-zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnRecord {
    /// Words 1..24 of the slot.
    pub words: [u64; C_BYTES_SENT - C_FIELDS],
    /// Bytes sent (a running counter, outside the lock).
    pub bytes_sent: u64,
    /// Bytes received (a running counter, outside the lock).
    pub bytes_received: u64,
    /// Cursors, flags, first write ([`conn::live`]; outside the lock).
    pub live: [u64; conn::live::COUNT],
}

/// A link group's record (see [`lg`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LgRecord {
    /// Words 1..15 of the slot.
    pub words: [u64; L_CONNS - 1],
    /// Connections on the group now (outside the lock).
    pub conns: u64,
}

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
        f.set_len((words * 8) as u64)?;
        let mut area = Self::map(&f, words, true, path.clone())?;
        debug_assert!(area.owner);
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
        std::fs::rename(&tmp, &path)?;
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

    fn open_with(path: &Path, rw: bool) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        // Not through a symlink, and never blocking on a FIFO someone planted.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(rw)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
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

    /// Frees a slot (a reader then sees it empty); its bytes go to the process totals.
    pub fn release_conn(&self, slot: usize) {
        self.next_conn.store(slot, Ordering::Relaxed);
        let r = self.conn(slot);
        self.count_n(total::BYTES_SENT, r[C_BYTES_SENT].load(Ordering::Relaxed));
        self.count_n(
            total::BYTES_RECEIVED,
            r[C_BYTES_RECEIVED].load(Ordering::Relaxed),
        );
        seq_free(r, C_BYTES_SENT);
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

    /// Zeroes the process counters and the fallback counters (not the records of live
    /// connections, which describe sockets that exist), and bumps the reset epoch. Needs an
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
        h[H_RESET_EPOCH].fetch_add(1, Ordering::Release);
        Ok(())
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

/// Name and meaning of a fallback code: Linux's decline codes, and ours (0x7f00_00xx).
pub fn reason(code: u32) -> (&'static str, &'static str) {
    use crate::FallbackReason as F;
    match code {
        F::CODE_NO_BPF => ("NOBPF", "the TCP option program is not usable here"),
        F::CODE_OPTION_NOT_OBSERVED => (
            "OPTNOTSEEN",
            "the TCP option program did not see the handshake (socket outside its cgroup?)",
        ),
        F::CODE_NOT_IPV4 => (
            "NOTIPV4",
            "a native IPv6 connection (SMC-Rv2 runs over IPv4; a dual-stack socket's IPv4 peers are served)",
        ),
        F::CODE_EXCLUDED => ("EXCLUDED", "kept on TCP by SMCR_INCLUDE/SMCR_EXCLUDE"),
        F::CODE_NO_FD => (
            "NOFD",
            "no file descriptor left for SMC-R within the process's RLIMIT_NOFILE",
        ),
        F::CODE_SHARED => (
            "SHARED",
            "the connection was held by several processes (fork) when first used",
        ),
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

/// What a user can do about a fallback code (one line).
pub fn remedy(code: u32) -> &'static str {
    use crate::FallbackReason as F;
    match code {
        F::CODE_NO_BPF => {
            "load the TCP option program: `smcr bpf install` as root (smcr run does it as root); it also makes the pins visible under /run/smcr/bpf for programs whose /sys is another one (`ip netns exec`)"
        }
        F::CODE_OPTION_NOT_OBSERVED => {
            "run the program inside the cgroup v2 hierarchy the option program is attached to (`smcr bpf status`)"
        }
        F::CODE_NOT_IPV4 => {
            "connect to the server's IPv4 address (a server listening on [::] serves it over SMC-R)"
        }
        F::CODE_EXCLUDED => {
            "adjust SMCR_INCLUDE / SMCR_EXCLUDE if this connection should use SMC-R"
        }
        F::CODE_NO_FD => {
            "raise the descriptor limit (`ulimit -n`, LimitNOFILE=): with a hard limit above the soft one smcr's descriptors take none of the program's, else it uses at most the top eighth of the limit"
        }
        F::CODE_SHARED => {
            "none needed (the connection works over TCP); have one process use each connection"
        }
        0x0101_0000 => {
            "the RMB budget is used up: lower the RMB size (smcr run --rmb-kib, SMCR_RMB_KIB)"
        }
        0x0201_0000 | 0x0202_0000 => {
            "check that RoCE v2 (UDP 4791) passes between the hosts (firewall, MTU)"
        }
        0x0300_0000 | 0x0307_0000 => {
            "give both interfaces addresses in a common subnet, or use SMC-Rv2 routing"
        }
        0x0301_0000 => "start the peer under smcr (`smcr run`), or exclude it with SMCR_EXCLUDE",
        0x0302_0000 => "SMC cannot run under IPsec: exclude the connection",
        0x0303_0000 | 0x0303_0002 => {
            "declined by a Linux peer: it shares none of our user EIDs (it offers SMC-Rv2 only with a UEID it has): set SMCR_UEID to one of its UEIDs (`smcr ueid show` there); ours: another process owns UDP 4791 on the local address and no steering program shares it: run `smcr bpf install` as root"
        }
        0x0303_0001 | 0x0303_0003 | 0x0303_0005 | 0x0303_0007 | 0x0309_0000 | 0x030d_0000 => {
            "SMC-D only: no action for SMC-R"
        }
        0x0303_0004 | 0x0303_0006 | 0x0303_0009 | 0x0304_0000 | 0x030c_0000 => {
            "the peer speaks another SMC version or mode: upgrade it to SMC-Rv2"
        }
        0x0303_0008 => "configure the same user EID on both sides (SMCR_UEID)",
        0x0303_000a | 0x0303_000b => "align the peers' max-links / max-connections settings",
        0x0305_0000 => "the peer uses RMBE eye catchers: not supported",
        0x0306_0000 => "do not use TCP_FASTOPEN on sockets meant for SMC-R",
        0x0308_0000 => "check the VLAN configuration of the interface",
        0x030a_0000 | 0x030b_0000 | 0x0400_0000 => {
            "transient: the link group was being replaced; retry (persisting: restart the peer)"
        }
        0x030e_0000 | 0x030f_0000 => {
            "make the peer reachable directly (same subnet) or fix the route"
        }
        0x0500_0000 => "see the peer's decline code (PEER column) and fix it there",
        0x0999_0000..=0x0999_0003 => {
            "internal error: see SMCR_LOG output; report it if it persists"
        }
        0 => "more distinct codes than the area counts: see individual rows",
        _ => "unknown code: see the peer's documentation",
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
}
