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
//! Layout (in 64-bit words; see the `H_*`, `C_*` constants): a 192-word header (magic,
//! version, pid, start time, command name, slot counts, reset epoch, release generation,
//! process totals, fallback counters as (code, count) pairs), then `conn_slots` connection records of [`CONN_WORDS`] words, then
//! `lg_slots` link-group records of [`LG_WORDS`] words, then [`DEV_SLOTS`] RoCE device records
//! of [`DEV_WORDS`] words (the engine's counters, which it bumps there itself).

#![warn(missing_docs)]

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering, fence};

/// `SMCRSTA1`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SMCRSTA1");
/// Layout version.
pub const VERSION: u64 = 6;
/// Where the areas live.
pub const DEFAULT_DIR: &str = "/dev/shm/smcr";

// A multiple of 8 words, so that every record starts on its own cache line.
const HEADER_WORDS: usize = 192;
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_PID: usize = 2;
const H_START: usize = 3;
const H_COMM: usize = 4; // 2 words, 16 bytes
const H_CONN_SLOTS: usize = 6;
const H_LG_SLOTS: usize = 7;
const H_RESET_EPOCH: usize = 8;
const H_UNAVAILABLE: usize = 9; // fallback code why SMC-R is off for the whole process (0: on)
// Records being freed and freed: their counters go into the totals in between (see
// [`Area::read_consistent`]).
const H_RELEASING: usize = 10;
const H_RELEASED: usize = 11;
const H_TOTALS: usize = 16; // [`total`] counters, up to H_FALLBACKS
const H_FALLBACKS: usize = 96; // (code, count) pairs up to the header's end
const _: () = assert!(H_TOTALS + total::COUNT <= H_FALLBACKS);
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
    /// Where the [`super::conn::counter`] counters of closed connections start (the same
    /// order: RX and TX requests by size, RX, TX and TX-remote buffer full).
    pub const COUNTERS: usize = 8;
    /// Closed SMC-R connections by RMB size ([`super::BUCKETS`] words).
    pub const RX_BUFS: usize = COUNTERS + super::conn::counter::COUNT;
    /// Closed SMC-R connections by send-buffer size.
    pub const TX_BUFS: usize = RX_BUFS + super::BUCKETS;
    /// How many there are.
    pub const COUNT: usize = TX_BUFS + super::BUCKETS;
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
        "closed_rx_reqs_8k",
        "closed_rx_reqs_16k",
        "closed_rx_reqs_32k",
        "closed_rx_reqs_64k",
        "closed_rx_reqs_128k",
        "closed_rx_reqs_256k",
        "closed_rx_reqs_512k",
        "closed_rx_reqs_1024k",
        "closed_rx_reqs_over_1024k",
        "closed_tx_reqs_8k",
        "closed_tx_reqs_16k",
        "closed_tx_reqs_32k",
        "closed_tx_reqs_64k",
        "closed_tx_reqs_128k",
        "closed_tx_reqs_256k",
        "closed_tx_reqs_512k",
        "closed_tx_reqs_1024k",
        "closed_tx_reqs_over_1024k",
        "closed_rx_buffer_full",
        "closed_tx_buffer_full",
        "closed_tx_buffer_full_remote",
        "closed_rx_bufs_8k",
        "closed_rx_bufs_16k",
        "closed_rx_bufs_32k",
        "closed_rx_bufs_64k",
        "closed_rx_bufs_128k",
        "closed_rx_bufs_256k",
        "closed_rx_bufs_512k",
        "closed_rx_bufs_1024k",
        "closed_rx_bufs_over_1024k",
        "closed_tx_bufs_8k",
        "closed_tx_bufs_16k",
        "closed_tx_bufs_32k",
        "closed_tx_bufs_64k",
        "closed_tx_bufs_128k",
        "closed_tx_bufs_256k",
        "closed_tx_bufs_512k",
        "closed_tx_bufs_1024k",
        "closed_tx_bufs_over_1024k",
    ];
}

/// Size buckets of the request and buffer histograms: Linux's `SMC_BUF_8K` ..
/// `SMC_BUF_1024K` and `SMC_BUF_G_1024K` (net/smc/smc_stats.h).
pub const BUCKETS: usize = 9;
/// Their names (the last: more than 1024 KiB).
pub const BUCKET_NAMES: [&str; BUCKETS] = [
    "8KB", "16KB", "32KB", "64KB", "128KB", "256KB", "512KB", "1024KB", ">1024KB",
];

/// The smallest bucket that holds `bytes` (Linux's `fls64((len - 1) >> 13)`, capped).
pub fn bucket(bytes: u64) -> usize {
    let above = bytes.saturating_sub(1) >> 13;
    ((u64::BITS - above.leading_zeros()) as usize).min(BUCKETS - 1)
}

/// How long a reader waits for a record that is being written before giving up on it.
pub const READ_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);

/// Words per connection record (a multiple of 8: records never share a cache line, so the
/// threads of two connections never bounce one between them).
pub const CONN_WORDS: usize = 56;
const C_FIELDS: usize = 1; // fields covered by the sequence lock: 1..C_BYTES_SENT
const C_BYTES_SENT: usize = 24;
const C_BYTES_RECEIVED: usize = 25;
const C_LIVE: usize = 26; // [`conn::live`] words, stored without the lock
const C_COUNTERS: usize = 32; // [`conn::counter`] words, relaxed adds without the lock
const _: () = assert!(C_LIVE + conn::live::COUNT <= C_COUNTERS);
const _: () = assert!(C_COUNTERS + conn::counter::COUNT <= CONN_WORDS);
const _: () = assert!(CONN_WORDS.is_multiple_of(8) && HEADER_WORDS.is_multiple_of(8));

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

    /// Words of [`super::ConnRecord::counters`]: what smc-tools' `smcr stats` shows per
    /// direction, counted for SMC-R connections only (as Linux counts SMC sockets only), one
    /// relaxed add each. Folded into the process totals ([`super::total::COUNTERS`], same
    /// order) when the record is freed.
    pub mod counter {
        /// Reads that moved data, by bytes moved ([`super::super::bucket`]; 9 words). Linux
        /// buckets by the length asked for and counts calls that moved nothing in its total;
        /// we count what each call moved, and the total is the buckets' sum.
        pub const RX_REQS: usize = 0;
        /// Writes that moved data, by bytes moved (9 words; see [`RX_REQS`]).
        pub const TX_REQS: usize = RX_REQS + super::super::BUCKETS;
        /// CDCs that announced data and left our RMB completely full (Linux's
        /// `SMC_STAT_RMB_RX_FULL`, smc_cdc.c).
        pub const RX_FULL: usize = TX_REQS + super::super::BUCKETS;
        /// Writes that found no room in the send buffer and waited or failed with EAGAIN, once
        /// per call (Linux counts `SMC_STAT_RMB_TX_FULL` when room comes back to a sender that
        /// had found none; a write that stages part and returns short is not counted, as in
        /// Linux). Our send buffer mirrors the peer's RMB, so room comes back only as the peer
        /// consumes.
        pub const TX_FULL: usize = RX_FULL + 1;
        /// Of those, the ones that found the peer's RMB itself full (all we wrote unconsumed,
        /// nothing merely staged): Linux's `SMC_STAT_RMB_TX_PEER_FULL`, which Linux counts
        /// when it tries to write staged bytes and finds no room; we never stage more than
        /// the room, so the write is where we learn it.
        pub const TX_FULL_PEER: usize = TX_FULL + 1;
        /// How many.
        pub const COUNT: usize = TX_FULL_PEER + 1;
    }
}

/// A claimed connection record in an area, freed with the stream (or, for a socket handed
/// back to the application as plain TCP, when its descriptor is found closed).
pub struct StatSlot {
    /// The area holding the record.
    pub area: std::sync::Arc<Area>,
    /// The record's slot in it.
    pub slot: usize,
}

impl Drop for StatSlot {
    fn drop(&mut self) {
        self.area.release_conn(self.slot);
    }
}

/// Linux's SMC socket states (`enum smc_state`) by number, with the short names of smcss(8)'s
/// manual page (the JSON schema's).
pub fn state_name(state: u64) -> &'static str {
    smcr_proto::conn::SmcState::from_code(state).map_or("UNKNOWN", smcr_proto::conn::SmcState::name)
}

/// The state as `smcss` prints it (`PEERCLOSEWAIT1`; an unknown number as `0x3?`).
pub fn smcss_state_name(state: u64) -> String {
    smcr_proto::conn::SmcState::from_code(state)
        .map_or_else(|| format!("{state:#x}?"), |s| s.smcss_name().to_owned())
}

/// RoCE device records per area (a process has one device per local address it runs SMC-R
/// on, plus its alternate addresses).
pub const DEV_SLOTS: usize = 8;
/// Words per device record.
pub const DEV_WORDS: usize = 40;
/// Where a device record's counters start ([`rdma::DeviceStats::NAMES`] order).
const D_COUNTERS: usize = 8;
const _: () = assert!(D_COUNTERS + rdma::DeviceStats::COUNT <= DEV_WORDS);

/// What the words of a device record hold (word 0 is unused, 1 is in use).
pub mod dev {
    /// The device's IPv4 address and UDP port: `ip << 16 | port`.
    pub const ADDR: usize = 2;
    /// Bits 0..8: how packets reach it (1 steered, 2 owner, 3 local-only, 4 fixed: our
    /// engine; 5 verbs: a verbs device); 8..24: its queue pair range.
    pub const MODE: usize = 3;
    /// Mode names by code (see [`MODE`]).
    pub const MODE_NAMES: [&str; 6] = ["?", "steered", "owner", "local-only", "fixed", "verbs"];
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
    /// How the link moves data: [`TRANSPORT_UDP`], [`TRANSPORT_SHM`] or [`TRANSPORT_VERBS`]
    /// (0: not known).
    pub const TRANSPORT: usize = 10;
    /// RoCE v2 over UDP.
    pub const TRANSPORT_UDP: u64 = 1;
    /// Same-host shared memory.
    pub const TRANSPORT_SHM: u64 = 2;
    /// A verbs device (an RNIC, the kernel's rxe): the device moves the data.
    pub const TRANSPORT_VERBS: u64 = 3;
    /// A same-host peer's process, as SO_PEERCRED told it: bit 63 set when known; bits 32..63
    /// its pid, low 32 its uid.
    pub const PEER_PROC: usize = 11;
    /// [`PEER_PROC`]'s "known" bit.
    pub const PEER_PROC_KNOWN: u64 = 1 << 63;
    /// What became of same-host sharing ([`rdma::SameHost::code`]; 0: not known).
    pub const SAME_HOST: usize = 12;
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
    /// Requests by size and buffer-full counts ([`conn::counter`]; outside the lock).
    pub counters: [u64; conn::counter::COUNT],
}

/// A link group's record (see [`lg`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LgRecord {
    /// Words 1..15 of the slot.
    pub words: [u64; L_CONNS - 1],
    /// Connections on the group now (outside the lock).
    pub conns: u64,
}

mod area;
mod codes;
mod fallback;
pub mod sys;

pub use area::{ANONYMOUS_NAME, Area, clean_stale};
pub use codes::{reason, remedy};
pub use fallback::FallbackReason;

#[cfg(test)]
mod tests;
