//! What `smc-stat` shows: a [`Snapshot`] of every stats area ([`smcr::stats`]), and its
//! renderings — the socket table (like smc-tools' `smcss`), link groups, fallback counters
//! with meanings and remedies, JSON (the stable schema our tests read) and the Prometheus
//! text exposition. Pure functions of the snapshot, so the formats are snapshot-tested.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::Path;

use smcr::stats::{self, Area, conn, lg, total};

/// Version of the JSON schema (bumped on incompatible changes).
pub const JSON_VERSION: u32 = 1;

/// Every process's state at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// By pid.
    pub procs: Vec<Proc>,
}

/// One process running smcr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// Its pid.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// Its sockets: connections (SMC-R and TCP) and listeners.
    pub conns: Vec<Conn>,
    /// Its link groups.
    pub links: Vec<Link>,
    /// Fallback counters: (code, count).
    pub fallbacks: Vec<(u32, u64)>,
    /// Process counters, indexed by [`total`].
    pub totals: [u64; total::COUNT],
    /// Times the counters were reset.
    pub reset_epoch: u64,
    /// Why SMC-R is off for the whole process (a fallback code; 0: it is on).
    pub unavailable: u32,
    /// Its RoCE devices and their engines' counters.
    pub devices: Vec<stats::DevRecord>,
}

impl Default for Proc {
    fn default() -> Self {
        Self {
            pid: 0,
            comm: String::new(),
            conns: Vec::new(),
            links: Vec::new(),
            fallbacks: Vec::new(),
            totals: [0; total::COUNT],
            reset_epoch: 0,
            unavailable: 0,
            devices: Vec::new(),
        }
    }
}

/// smc-tools' RX or TX statistics of SMC-R connections: closed ones' (the totals) and open
/// ones' (their records) together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Requests that moved data, by size ([`stats::BUCKET_NAMES`]).
    pub reqs: [u64; stats::BUCKETS],
    /// Connections by buffer size (RX: RMB; TX: send buffer).
    pub bufs: [u64; stats::BUCKETS],
    /// Buffer full (RX: a CDC filled our RMB; TX: a write found no room).
    pub full: u64,
    /// TX only: the write found the peer's RMB full.
    pub full_remote: u64,
}

impl Traffic {
    /// All requests.
    pub fn requests(&self) -> u64 {
        self.reqs.iter().fold(0, |a, &b| a.saturating_add(b))
    }

    fn add(&mut self, o: &Self) {
        let sum = |a: &mut [u64], b: &[u64]| {
            for (x, y) in a.iter_mut().zip(b) {
                *x = x.saturating_add(*y);
            }
        };
        sum(&mut self.reqs, &o.reqs);
        sum(&mut self.bufs, &o.bufs);
        self.full = self.full.saturating_add(o.full);
        self.full_remote = self.full_remote.saturating_add(o.full_remote);
    }
}

impl Proc {
    /// RX (`false`) or TX statistics: closed connections' and open SMC-R ones'.
    pub fn traffic(&self, tx: bool) -> Traffic {
        use stats::conn::counter;
        let t = &self.totals;
        let c = |i: usize| t[total::COUNTERS + i];
        let (reqs, bufs) = if tx {
            (counter::TX_REQS, total::TX_BUFS)
        } else {
            (counter::RX_REQS, total::RX_BUFS)
        };
        let mut out = Traffic {
            reqs: std::array::from_fn(|i| c(reqs + i)),
            bufs: std::array::from_fn(|i| t[bufs + i]),
            full: c(if tx {
                counter::TX_FULL
            } else {
                counter::RX_FULL
            }),
            full_remote: if tx { c(counter::TX_FULL_PEER) } else { 0 },
        };
        for conn in self.conns.iter().filter(|c| c.kind == Kind::Smcr) {
            out.add(&conn.traffic(tx));
        }
        out
    }
}

/// [`Proc::traffic`] summed over the processes.
pub fn traffic(s: &Snapshot, tx: bool) -> Traffic {
    let mut t = Traffic::default();
    for p in &s.procs {
        t.add(&p.traffic(tx));
    }
    t
}

/// What a socket row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kind {
    /// A connection over SMC-R.
    #[default]
    Smcr,
    /// A connection that stayed on or fell back to TCP.
    Tcp,
    /// A listening socket.
    Listen,
}

/// A socket row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conn {
    /// SMC-R, TCP or listening.
    pub kind: Kind,
    /// Linux SMC state number (see [`stats::state_name`]).
    pub state: u64,
    /// We accepted it.
    pub server: bool,
    /// Our address.
    pub local: SocketAddr,
    /// The peer's (unspecified for a listener).
    pub peer: SocketAddr,
    /// Fallback code (TCP rows).
    pub code: u32,
    /// The peer's decline diagnosis, when the peer declined.
    pub peer_code: u32,
    /// RMB bytes.
    pub rmb: u64,
    /// Send buffer bytes.
    pub sndbuf: u64,
    /// Our connection token.
    pub token: u32,
    /// Link group id.
    pub lg: u32,
    /// Payload bytes sent.
    pub sent: u64,
    /// Payload bytes received.
    pub received: u64,
    /// The application's descriptor (fallback sockets handed back to the application).
    pub fd: Option<i32>,
    /// Unix time (ns) the negotiation began.
    pub since_ns: u64,
    /// Stage times (ns after `since_ns`, 0: not reached): option, Proposal, Accept, Confirm,
    /// CONFIRM LINK, first RDMA WRITE.
    pub stages_ns: [u64; 6],
    /// Our producer, the peer's consumer, the peer's producer, our consumer
    /// (`wrap << 32 | count`).
    pub cursors: [u64; 4],
    /// Our CDC connection-state flags.
    pub local_flags: u8,
    /// The peer's.
    pub peer_flags: u8,
    /// Requests by size and buffer-full counts ([`stats::conn::counter`]).
    pub counters: [u64; stats::conn::counter::COUNT],
}

impl Conn {
    /// This connection's RX (`false`) or TX statistics (its buffer in `bufs`).
    pub fn traffic(&self, tx: bool) -> Traffic {
        use stats::conn::counter;
        let c = &self.counters;
        let (reqs, size) = if tx {
            (counter::TX_REQS, self.sndbuf)
        } else {
            (counter::RX_REQS, self.rmb)
        };
        let mut bufs = [0; stats::BUCKETS];
        if size > 0 {
            bufs[stats::bucket(size)] = 1;
        }
        Traffic {
            reqs: std::array::from_fn(|i| c[reqs + i]),
            bufs,
            full: c[if tx {
                counter::TX_FULL
            } else {
                counter::RX_FULL
            }],
            full_remote: if tx { c[counter::TX_FULL_PEER] } else { 0 },
        }
    }
}

impl Default for Conn {
    fn default() -> Self {
        let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
        Self {
            kind: Kind::default(),
            state: 0,
            server: false,
            local: any,
            peer: any,
            code: 0,
            peer_code: 0,
            rmb: 0,
            sndbuf: 0,
            token: 0,
            lg: 0,
            sent: 0,
            received: 0,
            fd: None,
            since_ns: 0,
            stages_ns: [0; 6],
            cursors: [0; 4],
            local_flags: 0,
            peer_flags: 0,
            counters: [0; stats::conn::counter::COUNT],
        }
    }
}

/// A link group and its (single) link.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Link {
    /// Link group id.
    pub id: u32,
    /// We are the client (sent the Proposal).
    pub client: bool,
    /// Link id.
    pub link_id: u8,
    /// Link state (see [`stats::link_state_name`]).
    pub state: u64,
    /// Our GID.
    pub gid: [u8; 16],
    /// The peer's GID.
    pub peer_gid: [u8; 16],
    /// Our QP number.
    pub qpn: u32,
    /// The peer's.
    pub peer_qpn: u32,
    /// The peer's system id.
    pub peer_system: [u8; 8],
    /// Path MTU in bytes.
    pub mtu: u32,
    /// How data moves: "udp" (RoCE v2, our engine), "shm" (same-host shared memory), "verbs"
    /// (a verbs device) or "-".
    pub transport: &'static str,
    /// A same-host peer's process: (uid, pid), as the kernel told them when its offer came.
    pub peer_proc: Option<(u32, u32)>,
    /// What became of same-host sharing ([`rdma::SameHost::name`]: `shm`, or why not), or
    /// `-` when not known.
    pub same_host: &'static str,
    /// Connections on it now.
    pub conns: u64,
    /// Unix time (ns) of creation.
    pub since_ns: u64,
}

/// Stage names, in order (JSON keys and column names).
pub const STAGES: [&str; 6] = [
    "option",
    "proposal",
    "accept",
    "confirm",
    "confirm_link",
    "first_write",
];

fn v4(w: u64) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from((w >> 16) as u32), w as u16)
}

/// A record's address: IPv4 in `word`, or IPv6 in the two words at `word6` when the
/// record's family says so (the port stays in `word`).
fn addr_of(w: &[u64], word: usize, word6: usize, bit: u64) -> SocketAddr {
    if w[conn::FAMILY] & bit != 0 {
        let ip = (u128::from(w[word6]) << 64) | u128::from(w[word6 + 1]);
        SocketAddr::new(Ipv6Addr::from(ip).into(), w[word] as u16)
    } else {
        SocketAddr::V4(v4(w[word]))
    }
}

fn gid(hi: u64, lo: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&hi.to_be_bytes());
    g[8..].copy_from_slice(&lo.to_be_bytes());
    g
}

impl Conn {
    /// Decodes a record.
    pub fn from_record(r: &stats::ConnRecord) -> Self {
        use conn::live;
        let w = &r.words;
        let state_word = w[conn::STATE];
        let kind = if state_word & 0xff == conn::STATE_LISTEN {
            Kind::Listen
        } else if state_word >> 16 & 0xff == conn::MODE_SMCR {
            Kind::Smcr
        } else {
            Kind::Tcp
        };
        let flags = r.live[live::FLAGS];
        let live_state = flags >> 16 & 0xff;
        let mut stages_ns = [0u64; 6];
        stages_ns[..5].copy_from_slice(&w[conn::T_OPTION..=conn::T_LINK]);
        stages_ns[5] = r.live[live::FIRST_WRITE];
        Self {
            kind,
            state: if live_state != 0 {
                live_state
            } else {
                state_word & 0xff
            },
            server: state_word >> 8 & 1 == 1,
            local: addr_of(w, conn::LOCAL, conn::LOCAL6, 1),
            peer: addr_of(w, conn::PEER, conn::PEER6, 2),
            code: w[conn::REASON] as u32,
            peer_code: (w[conn::REASON] >> 32) as u32,
            rmb: w[conn::SIZES] & 0xffff_ffff,
            sndbuf: w[conn::SIZES] >> 32,
            token: w[conn::IDS] as u32,
            lg: (w[conn::IDS] >> 32) as u32,
            sent: r.bytes_sent,
            received: r.bytes_received,
            fd: (w[conn::FD] != 0).then(|| (w[conn::FD] - 1) as i32),
            since_ns: w[conn::SINCE],
            stages_ns,
            cursors: [
                r.live[live::TX_PROD],
                r.live[live::PEER_CONS],
                r.live[live::RX_PROD],
                r.live[live::RX_CONS],
            ],
            local_flags: flags as u8,
            peer_flags: (flags >> 8) as u8,
            counters: r.counters,
        }
    }

    /// `SMCR`, `TCP` or `-` (listener).
    pub fn mode(&self) -> &'static str {
        match self.kind {
            Kind::Smcr => "SMCR",
            Kind::Tcp => "TCP",
            Kind::Listen => "-",
        }
    }

    /// The fallback column: `NAME 0xCODE` (`by peer` when the peer declined), or `-`.
    pub fn fallback(&self) -> String {
        if self.kind != Kind::Tcp {
            return "-".into();
        }
        let by_peer = if self.peer_code != 0 { " by peer" } else { "" };
        format!(
            "{} {:#010x}{by_peer}",
            stats::reason(self.code).0,
            self.code
        )
    }
}

impl Link {
    /// Decodes a record.
    pub fn from_record(r: &stats::LgRecord) -> Self {
        let w = &r.words;
        Self {
            id: w[lg::ID] as u32,
            client: w[lg::ID] >> 32 & 0xff == lg::ROLE_CLIENT,
            link_id: (w[lg::ID] >> 40) as u8,
            state: w[lg::ID] >> 48 & 0xff,
            gid: gid(w[lg::GID], w[lg::GID + 1]),
            peer_gid: gid(w[lg::PEER_GID], w[lg::PEER_GID + 1]),
            qpn: w[lg::QPNS] as u32,
            peer_qpn: (w[lg::QPNS] >> 32) as u32,
            peer_system: w[lg::PEER_SYSTEM].to_be_bytes(),
            mtu: w[lg::MTU] as u32,
            transport: match w[lg::TRANSPORT] {
                lg::TRANSPORT_UDP => "udp",
                lg::TRANSPORT_SHM => "shm",
                lg::TRANSPORT_VERBS => "verbs",
                _ => "-",
            },
            peer_proc: (w[lg::PEER_PROC] & lg::PEER_PROC_KNOWN != 0).then(|| {
                (
                    w[lg::PEER_PROC] as u32,
                    (w[lg::PEER_PROC] >> 32) as u32 & 0x7fff_ffff,
                )
            }),
            same_host: rdma::SameHost::from_code(w[lg::SAME_HOST])
                .map_or("-", rdma::SameHost::name),
            conns: r.conns,
            since_ns: w[lg::SINCE],
        }
    }
}

/// The areas of processes in a sandbox, whose `/dev/shm` may not be ours or whose area may
/// have no file — in another mount or user namespace or under another root (a systemd unit's
/// `PrivateDevices=`/`PrivateTmp=`/`PrivateUsers=`, a chroot, a container) — found through
/// their `/proc/PID/fd` (each area's maker keeps it open; readable by root, or by the same user
/// where the process allows it); `pid` only, if given.
fn sandboxed_areas(pid: Option<u32>) -> Vec<Area> {
    let ns = |p: &str| {
        Some((
            std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok()?,
            std::fs::read_link(format!("/proc/{p}/ns/user")).ok()?,
        ))
    };
    let root = |p: &str| std::fs::read_link(format!("/proc/{p}/root")).ok();
    let (my_ns, my_root) = (ns("self"), root("self"));
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid.is_some_and(|want| want != p) {
            continue;
        }
        let key = p.to_string();
        // Unreadable (another user's process): nothing we could open either.
        let (Some(n), Some(r)) = (ns(&key), root(&key)) else {
            continue;
        };
        if Some(&n) == my_ns.as_ref() && Some(&r) == my_root.as_ref() {
            continue; // its areas are in the directory, or it has none
        }
        out.extend(
            Area::held_by(p)
                .into_iter()
                .filter_map(|fd| Area::open_held(p, fd).ok())
                .filter(|a| a.made_by(p) && !a.is_stale()),
        );
    }
    out
}

/// Whether `/proc/PID/fd/FD` is still the socket with `inode`.
fn still_open(pid: u32, fd: i32, inode: u64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
        .is_ok_and(|l| l.to_string_lossy() == format!("socket:[{inode}]"))
}

impl Snapshot {
    /// Reads every live area in `dir` (only `pid`'s if given), after removing the areas of
    /// dead processes. Rows of fallback sockets the application has closed are left out; their
    /// byte counts come from the kernel (sock_diag), in the process's network namespace.
    pub fn collect(dir: &Path, pid: Option<u32>) -> Self {
        stats::clean_stale(dir);
        let mut areas: Vec<Area> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "stats"))
                    .filter_map(|p| Area::open(&p).ok())
                    .filter(|a| !a.is_stale() && pid.is_none_or(|p| a.pid() == p))
                    .collect()
            })
            .unwrap_or_default();
        let seen: std::collections::HashSet<_> = areas.iter().map(Area::file_id).collect();
        areas.extend(
            sandboxed_areas(pid)
                .into_iter()
                .filter(|a| !seen.contains(&a.file_id())),
        );
        areas.sort_by_key(|a| (a.pid(), a.path().to_owned()));
        let mut procs: Vec<Proc> = Vec::new();
        for a in &areas {
            let mut kernel = None;
            let mut p = Proc {
                pid: a.pid(),
                // A command name is the program's to choose: no control characters in tables.
                // A chrooted maker may not have read its own name (no /proc in its jail).
                comm: Some(a.comm())
                    .filter(|c| !c.is_empty())
                    .or_else(|| std::fs::read_to_string(format!("/proc/{}/comm", a.pid())).ok())
                    .unwrap_or_default()
                    .trim_end()
                    .chars()
                    .map(|c| if c.is_control() { '?' } else { c })
                    .collect(),
                fallbacks: a.fallbacks(),
                reset_epoch: a.reset_epoch(),
                unavailable: a.unavailable(),
                ..Proc::default()
            };
            let pid = p.pid;
            // The totals and the open connections' records of one moment: each closed
            // connection counted once.
            (p.totals, p.conns) = a.read_consistent(|| {
                let mut conns = Vec::new();
                for i in 0..a.conn_slots() {
                    // A slot that stays mid-update (its writer died there) is skipped.
                    let Ok(Some(r)) = a.read_conn(i) else {
                        continue;
                    };
                    if r.words[conn::STATE] == 0 {
                        continue; // claimed, not written yet
                    }
                    let mut c = Conn::from_record(&r);
                    let inode = r.words[conn::INODE];
                    if let Some(fd) = c.fd {
                        if !still_open(pid, fd, inode) {
                            continue;
                        }
                        let k = kernel.get_or_insert_with(|| {
                            smcr::diag::tcp_bytes_of(pid).unwrap_or_default()
                        });
                        if let Some(b) = k.get(&inode) {
                            c.sent = b.sent;
                            c.received = b.received;
                        }
                    }
                    conns.push(c);
                }
                (a.totals(), conns)
            });
            p.conns.sort_by_key(|c| {
                (
                    c.kind == Kind::Listen,
                    c.local.port(),
                    c.peer.ip(),
                    c.peer.port(),
                )
            });
            for i in 0..a.lg_slots() {
                if let Ok(Some(r)) = a.read_lg(i) {
                    p.links.push(Link::from_record(&r));
                }
            }
            p.links.sort_by_key(|l| l.id);
            p.devices = (0..stats::DEV_SLOTS)
                .filter_map(|i| a.read_dev(i))
                .collect();
            // Several runtimes in one process (tests) show as one process.
            match procs.last_mut() {
                Some(last) if last.pid == p.pid => merge(last, p),
                _ => procs.push(p),
            }
        }
        Self { procs }
    }
}

fn merge(into: &mut Proc, p: Proc) {
    into.conns.extend(p.conns);
    into.links.extend(p.links);
    into.devices.extend(p.devices);
    for (code, n) in p.fallbacks {
        match into.fallbacks.iter_mut().find(|(c, _)| *c == code) {
            Some((_, m)) => *m = m.saturating_add(n),
            None => into.fallbacks.push((code, n)),
        }
    }
    for (a, b) in into.totals.iter_mut().zip(p.totals) {
        *a = a.saturating_add(b);
    }
    into.reset_epoch = into.reset_epoch.max(p.reset_epoch);
    into.unavailable = into.unavailable.max(p.unavailable);
}

/// Resets the counters of every area in `dir` (only `pid`'s if given); returns how many.
pub fn reset(dir: &Path, pid: Option<u32>) -> std::io::Result<usize> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)?.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "stats") {
            continue;
        }
        let Ok(a) = Area::open_rw(&p) else { continue };
        if a.is_stale() || pid.is_some_and(|q| a.pid() != q) {
            continue;
        }
        a.reset()?;
        n += 1;
    }
    Ok(n)
}

/// [`render_rdma_ports`] of this host's devices (sysfs), with their network devices' MTUs.
pub fn render_host_rdma() -> String {
    let ports = rdma::ibv::sysfs::scan(Path::new(rdma::ibv::sysfs::SYSFS_ROOT));
    render_rdma_ports(&ports, |nd| {
        std::fs::read_to_string(format!("/sys/class/net/{nd}/mtu"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
}

mod json;
mod prometheus;
mod text;
mod tools;

// The renderings share their small formatters (cursors, flags, times, GIDs).
#[allow(unused_imports)]
use {json::*, prometheus::*, text::*};

pub use json::render_json;
pub use prometheus::{Sample, parse_prometheus, render_prometheus};
pub use text::{
    ADDR_WIDTH, Rows, SocketView, all_codes, fallback_totals, render_devices, render_fallbacks,
    render_links, render_rdma_ports, render_socket_table, render_sockets, smcss_addr, smcss_cursor,
    totals,
};
pub use tools::render_stats;

#[cfg(test)]
mod tests;
