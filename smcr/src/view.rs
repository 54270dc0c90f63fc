//! What `smc-stat` shows: a [`Snapshot`] of every stats area ([`crate::stats`]), and its
//! renderings — the socket table (like smc-tools' `smcss`), link groups, fallback counters
//! with meanings and remedies, JSON (the stable schema our tests read) and the Prometheus
//! text exposition. Pure functions of the snapshot, so the formats are snapshot-tested.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::Path;

use crate::stats::{self, Area, conn, lg, total};

/// Version of the JSON schema (bumped on incompatible changes).
pub const JSON_VERSION: u32 = 1;

/// Every process's state at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// By pid.
    pub procs: Vec<Proc>,
}

/// One process running smcr.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// How data moves: "udp" (RoCE v2), "shm" (same-host shared memory) or "-".
    pub transport: &'static str,
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
                _ => "-",
            },
            conns: r.conns,
            since_ns: w[lg::SINCE],
        }
    }
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
        areas.sort_by_key(|a| (a.pid(), a.path().to_owned()));
        let mut procs: Vec<Proc> = Vec::new();
        for a in &areas {
            let mut kernel = None;
            let mut p = Proc {
                pid: a.pid(),
                // A command name is the program's to choose: no control characters in tables.
                comm: a
                    .comm()
                    .chars()
                    .map(|c| if c.is_control() { '?' } else { c })
                    .collect(),
                fallbacks: a.fallbacks(),
                totals: a.totals(),
                reset_epoch: a.reset_epoch(),
                unavailable: a.unavailable(),
                ..Proc::default()
            };
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
                    if !still_open(p.pid, fd, inode) {
                        continue;
                    }
                    let k = kernel.get_or_insert_with(|| {
                        crate::diag::tcp_bytes_of(p.pid).unwrap_or_default()
                    });
                    if let Some(b) = k.get(&inode) {
                        c.sent = b.sent;
                        c.received = b.received;
                    }
                }
                p.conns.push(c);
            }
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

/// Which rows the socket table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Connections (default, like `smcss`).
    Connections,
    /// Listeners only (`-l`).
    Listeners,
    /// Both (`-a`).
    All,
}

impl Rows {
    fn shows(self, c: &Conn) -> bool {
        match self {
            Self::Connections => c.kind != Kind::Listen,
            Self::Listeners => c.kind == Kind::Listen,
            Self::All => true,
        }
    }
}

fn cursor(w: u64) -> String {
    format!("{}:{}", w >> 32, w & 0xffff_ffff)
}

fn cdc_flags(f: u8) -> String {
    let mut v = Vec::new();
    if f & 0x80 != 0 {
        v.push("done-writing");
    }
    if f & 0x40 != 0 {
        v.push("closed");
    }
    if f & 0x20 != 0 {
        v.push("abort");
    }
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

fn ms(ns: u64) -> String {
    if ns == 0 {
        "-".into()
    } else {
        format!("{:.3}", ns as f64 / 1e6)
    }
}

/// Lines saying which processes cannot use SMC-R at all (their sockets have no rows).
fn unavailable_notes(s: &Snapshot) -> String {
    let mut o = String::new();
    for p in s.procs.iter().filter(|p| p.unavailable != 0) {
        let (name, meaning) = stats::reason(p.unavailable);
        let _ = writeln!(
            o,
            "note: pid {} ({}): SMC-R unavailable, every connection stays TCP: {name} {:#010x}, {meaning}; remedy: {}",
            p.pid,
            p.comm,
            p.unavailable,
            stats::remedy(p.unavailable)
        );
    }
    o
}

/// The socket table; `details` adds cursors, flags and stage times under each row (`-d`).
pub fn render_sockets(s: &Snapshot, rows: Rows, details: bool) -> String {
    let mut o = unavailable_notes(s);
    let _ = writeln!(
        o,
        "{:<8} {:<15} {:<12} {:<21} {:<21} {:<4} {:<30} {:>12} {:>12} {:>7} {:>7}",
        "PID",
        "COMMAND",
        "STATE",
        "LOCAL",
        "PEER",
        "MODE",
        "FALLBACK",
        "SENT",
        "RECEIVED",
        "RMB",
        "SNDBUF"
    );
    for p in &s.procs {
        for c in p.conns.iter().filter(|c| rows.shows(c)) {
            let peer = if c.kind == Kind::Listen {
                "*:*".to_owned()
            } else {
                c.peer.to_string()
            };
            let _ = writeln!(
                o,
                "{:<8} {:<15} {:<12} {:<21} {:<21} {:<4} {:<30} {:>12} {:>12} {:>7} {:>7}",
                p.pid,
                p.comm,
                stats::state_name(c.state),
                c.local.to_string(),
                peer,
                c.mode(),
                c.fallback(),
                c.sent,
                c.received,
                c.rmb,
                c.sndbuf
            );
            if details && c.kind != Kind::Listen {
                if c.kind == Kind::Smcr {
                    let _ = writeln!(
                        o,
                        "    token {:#010x} lg {} | tx prod {} peer cons {} | rx prod {} cons {} | flags local {} peer {}",
                        c.token,
                        c.lg,
                        cursor(c.cursors[0]),
                        cursor(c.cursors[1]),
                        cursor(c.cursors[2]),
                        cursor(c.cursors[3]),
                        cdc_flags(c.local_flags),
                        cdc_flags(c.peer_flags)
                    );
                } else if c.kind == Kind::Tcp {
                    let (_, meaning) = stats::reason(c.code);
                    let _ = writeln!(
                        o,
                        "    {meaning}{}",
                        if c.peer_code != 0 {
                            format!(" (peer's diagnosis {:#010x})", c.peer_code)
                        } else {
                            String::new()
                        }
                    );
                }
                let stages: Vec<String> = STAGES
                    .iter()
                    .zip(c.stages_ns)
                    .map(|(n, t)| format!("{n} {}", ms(t)))
                    .collect();
                let _ = writeln!(o, "    ms after TCP up: {}", stages.join(", "));
            }
        }
    }
    o
}

fn gid_text(g: &[u8; 16]) -> String {
    Ipv6Addr::from(*g).to_string()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Link groups and their links (`-R`, `--links`).
pub fn render_links(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<8} {:<15} {:>5} {:<6} {:>3} {:<10} {:>5} {:>8} {:>8} {:<22} {:<22} {:<16} {:>5} {:<9}",
        "PID",
        "COMMAND",
        "LG-ID",
        "ROLE",
        "LNK",
        "STATE",
        "CONNS",
        "QPN",
        "PEER-QPN",
        "GID",
        "PEER-GID",
        "PEER-SYSTEM-ID",
        "MTU",
        "TRANSPORT"
    );
    for p in &s.procs {
        for l in &p.links {
            let _ = writeln!(
                o,
                "{:<8} {:<15} {:>5} {:<6} {:>3} {:<10} {:>5} {:>8} {:>8} {:<22} {:<22} {:<16} {:>5} {:<9}",
                p.pid,
                p.comm,
                l.id,
                if l.client { "CLNT" } else { "SERV" },
                l.link_id,
                stats::link_state_name(l.state),
                l.conns,
                format!("{:#x}", l.qpn),
                format!("{:#x}", l.peer_qpn),
                gid_text(&l.gid),
                gid_text(&l.peer_gid),
                hex(&l.peer_system),
                l.mtu,
                l.transport
            );
        }
    }
    o
}

/// The columns of [`render_devices`]: the counters that tell whether the engine talks to its
/// peers (every counter is in `--json` and `--prometheus`).
type Column = (&'static str, fn(&rdma::DeviceStats) -> u64);
const DEVICE_COLUMNS: [Column; 10] = [
    ("TX-PKTS", |d| d.tx_packets),
    ("RX-PKTS", |d| d.rx_packets),
    ("ICRC-ERR", |d| d.rx_icrc_errors),
    ("DROPS", |d| {
        d.rx_malformed
            .saturating_add(d.rx_unknown_qp)
            .saturating_add(d.rx_wrong_source)
    }),
    ("TX-ERR", |d| d.tx_errors),
    ("RETRANS", |d| d.tx_retransmits),
    ("TIMEOUTS", |d| d.rc_timeouts),
    ("NAK-RX", |d| d.rx_naks.saturating_add(d.rx_rnr_naks)),
    ("NAK-TX", |d| d.tx_naks.saturating_add(d.tx_rnr_naks)),
    ("KERNEL-RX", |d| d.rx_foreign_ip_id),
];

/// The RoCE devices (`--devices`): per process and local address, how packets reach the
/// engine and what it counted; with `details`, every counter by name. DROPS: malformed, unknown
/// QP, wrong source; KERNEL-RX: packets numbered like Linux rxe's (a kernel peer).
pub fn render_devices(s: &Snapshot, details: bool) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "{:<8} {:<15} {:<21} {:<10} {:>5}",
        "PID", "COMMAND", "ADDRESS", "MODE", "RANGE"
    );
    for (name, _) in DEVICE_COLUMNS {
        let _ = write!(o, " {name:>10}");
    }
    o.push('\n');
    for p in &s.procs {
        for d in &p.devices {
            let _ = write!(
                o,
                "{:<8} {:<15} {:<21} {:<10} {:>5}",
                p.pid,
                p.comm,
                d.addr.to_string(),
                d.mode,
                format!("{:#x}", d.range)
            );
            for (_, f) in DEVICE_COLUMNS {
                let _ = write!(o, " {:>10}", f(&d.stats));
            }
            o.push('\n');
            if details {
                for (name, v) in rdma::DeviceStats::NAMES.iter().zip(d.stats.to_words()) {
                    let _ = writeln!(o, "{:8} {name:<18} {v}", "");
                }
            }
        }
    }
    o
}

/// Fallback counters summed over the processes, by code.
pub fn fallback_totals(s: &Snapshot) -> BTreeMap<u32, u64> {
    let mut t = BTreeMap::new();
    for p in &s.procs {
        for &(code, n) in &p.fallbacks {
            let e = t.entry(code).or_default();
            *e = u64::saturating_add(*e, n);
        }
    }
    t
}

/// Process counters summed.
pub fn totals(s: &Snapshot) -> [u64; total::COUNT] {
    let mut t = [0u64; total::COUNT];
    for p in &s.procs {
        for (a, b) in t.iter_mut().zip(p.totals) {
            *a = a.saturating_add(b);
        }
    }
    t
}

/// Every code `smc-stat` can name: Linux's decline codes and ours.
pub fn all_codes() -> Vec<u32> {
    use crate::FallbackReason as F;
    let mut v: Vec<u32> = clc::DeclineReason::ALL.iter().map(|r| r.0).collect();
    v.extend([
        F::CODE_NO_BPF,
        F::CODE_OPTION_NOT_OBSERVED,
        F::CODE_NOT_IPV4,
        F::CODE_EXCLUDED,
        F::CODE_NO_FD,
        F::CODE_SHARED,
    ]);
    v
}

/// The fallback view: totals, then one entry per code seen (`every`: per known code too,
/// with count 0), with name, count, meaning and remedy.
pub fn render_fallbacks(s: &Snapshot, every: bool) -> String {
    let t = totals(s);
    let smcr = t[total::SMCR];
    let tcp = t[total::TCP];
    let mut o = String::new();
    let pct = if smcr + tcp > 0 {
        100.0 * tcp as f64 / (smcr + tcp) as f64
    } else {
        0.0
    };
    let _ = write!(
        o,
        "connections: {smcr} SMC-R, {tcp} TCP ({pct:.1}% fell back); handshake failures {}; first contacts {}; link groups created {}",
        t[total::FAILED],
        t[total::FIRST_CONTACT],
        t[total::LINK_GROUPS]
    );
    // Only processes with a second path fail over (docs/failover.md).
    if t[total::LINK_FAILOVERS] > 0 {
        let _ = write!(o, "; link failovers {}", t[total::LINK_FAILOVERS]);
    }
    o.push('\n');
    o += &unavailable_notes(s);
    let _ = writeln!(o, "{:<10}  {:<12} {:>8}  MEANING", "CODE", "NAME", "COUNT");
    let mut counts = fallback_totals(s);
    if every {
        for c in all_codes() {
            counts.entry(c).or_default();
        }
    }
    for (code, n) in &counts {
        let (name, meaning) = stats::reason(*code);
        let _ = writeln!(o, "{code:#010x}  {name:<12} {n:>8}  {meaning}");
        let _ = writeln!(o, "{:34}  remedy: {}", "", stats::remedy(*code));
    }
    o
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o += "\\\"",
            '\\' => o += "\\\\",
            c if (c as u32) < 0x20 => o += &format!("\\u{:04x}", c as u32),
            c => o.push(c),
        }
    }
    o + "\""
}

/// Everything as one JSON document (stable schema, version [`JSON_VERSION`]):
/// `{"version", "processes": [{pid, command, reset_epoch, totals{…}}], "connections": [...],
/// "listeners": [...], "link_groups": [...], "fallbacks": [{code, name, count, meaning,
/// remedy}]}`.
pub fn render_json(s: &Snapshot) -> String {
    let mut procs = Vec::new();
    let mut conns = Vec::new();
    let mut listeners = Vec::new();
    let mut links = Vec::new();
    let mut devices = Vec::new();
    for p in &s.procs {
        for d in &p.devices {
            let counters: Vec<String> = rdma::DeviceStats::NAMES
                .iter()
                .zip(d.stats.to_words())
                .map(|(n, v)| format!("\"{n}\":{v}"))
                .collect();
            devices.push(format!(
                "{{\"pid\":{},\"command\":{},\"address\":\"{}\",\"mode\":\"{}\",\"range\":{},\"counters\":{{{}}}}}",
                p.pid,
                json_str(&p.comm),
                d.addr,
                d.mode,
                d.range,
                counters.join(",")
            ));
        }
        let totals: Vec<String> = total::NAMES
            .iter()
            .zip(p.totals)
            .map(|(n, v)| format!("\"{n}\":{v}"))
            .collect();
        let unavailable = if p.unavailable == 0 {
            "null".to_owned()
        } else {
            json_str(stats::reason(p.unavailable).0)
        };
        procs.push(format!(
            "{{\"pid\":{},\"command\":{},\"reset_epoch\":{},\"smcr_unavailable\":{unavailable},\"totals\":{{{}}}}}",
            p.pid,
            json_str(&p.comm),
            p.reset_epoch,
            totals.join(",")
        ));
        for c in &p.conns {
            if c.kind == Kind::Listen {
                listeners.push(format!(
                    "{{\"pid\":{},\"command\":{},\"state\":\"LISTEN\",\"local\":\"{}\"}}",
                    p.pid,
                    json_str(&p.comm),
                    c.local
                ));
                continue;
            }
            let (name, _) = stats::reason(c.code);
            let stages: Vec<String> = STAGES
                .iter()
                .zip(c.stages_ns)
                .map(|(n, t)| {
                    if t == 0 {
                        format!("\"{n}\":null")
                    } else {
                        format!("\"{n}\":{}", t / 1000)
                    }
                })
                .collect();
            let tcp = c.kind == Kind::Tcp;
            conns.push(format!(
                "{{\"pid\":{},\"command\":{},\"state\":\"{}\",\"role\":\"{}\",\"local\":\"{}\",\"peer\":\"{}\",\"mode\":\"{}\",\"reason\":{},\"reason_code\":{},\"peer_reason_code\":{},\"bytes_sent\":{},\"bytes_received\":{},\"rmb\":{},\"sndbuf\":{},\"token\":{},\"link_group\":{},\"fd\":{},\"since_ns\":{},\"stages_us\":{{{}}},\"cursors\":{{\"tx_prod\":\"{}\",\"peer_cons\":\"{}\",\"rx_prod\":\"{}\",\"rx_cons\":\"{}\"}},\"flags\":{{\"local\":\"{}\",\"peer\":\"{}\"}}}}",
                p.pid,
                json_str(&p.comm),
                stats::state_name(c.state),
                if c.server { "server" } else { "client" },
                c.local,
                c.peer,
                c.mode(),
                if tcp { json_str(name) } else { "null".into() },
                c.code,
                c.peer_code,
                c.sent,
                c.received,
                c.rmb,
                c.sndbuf,
                c.token,
                c.lg,
                c.fd.map_or("null".into(), |f| f.to_string()),
                c.since_ns,
                stages.join(","),
                cursor(c.cursors[0]),
                cursor(c.cursors[1]),
                cursor(c.cursors[2]),
                cursor(c.cursors[3]),
                cdc_flags(c.local_flags),
                cdc_flags(c.peer_flags)
            ));
        }
        for l in &p.links {
            links.push(format!(
                "{{\"pid\":{},\"command\":{},\"id\":{},\"role\":\"{}\",\"link_id\":{},\"state\":\"{}\",\"connections\":{},\"qpn\":{},\"peer_qpn\":{},\"gid\":\"{}\",\"peer_gid\":\"{}\",\"peer_system_id\":\"{}\",\"mtu\":{},\"transport\":\"{}\",\"since_ns\":{}}}",
                p.pid,
                json_str(&p.comm),
                l.id,
                if l.client { "client" } else { "server" },
                l.link_id,
                stats::link_state_name(l.state),
                l.conns,
                l.qpn,
                l.peer_qpn,
                gid_text(&l.gid),
                gid_text(&l.peer_gid),
                hex(&l.peer_system),
                l.mtu,
                l.transport,
                l.since_ns
            ));
        }
    }
    let fallbacks: Vec<String> = fallback_totals(s)
        .iter()
        .map(|(code, n)| {
            let (name, meaning) = stats::reason(*code);
            format!(
                "{{\"code\":{code},\"name\":{},\"count\":{n},\"meaning\":{},\"remedy\":{}}}",
                json_str(name),
                json_str(meaning),
                json_str(stats::remedy(*code))
            )
        })
        .collect();
    format!(
        "{{\"version\":{JSON_VERSION},\"processes\":[{}],\"connections\":[{}],\"listeners\":[{}],\"link_groups\":[{}],\"devices\":[{}],\"fallbacks\":[{}]}}\n",
        procs.join(","),
        conns.join(","),
        listeners.join(","),
        links.join(","),
        devices.join(","),
        fallbacks.join(",")
    )
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The Prometheus text exposition (version 0.0.4) of the counters and gauges.
pub fn render_prometheus(s: &Snapshot) -> String {
    let mut o = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(o, "{name}{{{labels}}} {v}");
        }
    };
    let who = |p: &Proc| format!("pid=\"{}\",command=\"{}\"", p.pid, label(&p.comm));
    let per = |f: &dyn Fn(&Proc) -> Vec<(String, u64)>| -> Vec<(String, u64)> {
        s.procs.iter().flat_map(f).collect()
    };
    family(
        "smcr_connections_total",
        "counter",
        "Connections negotiated, by mode.",
        per(&|p| {
            vec![
                (format!("{},mode=\"smcr\"", who(p)), p.totals[total::SMCR]),
                (format!("{},mode=\"tcp\"", who(p)), p.totals[total::TCP]),
            ]
        }),
    );
    family(
        "smcr_fallbacks_total",
        "counter",
        "Connections that stayed on TCP, by reason.",
        per(&|p| {
            p.fallbacks
                .iter()
                .map(|&(code, n)| {
                    (
                        format!(
                            "{},reason=\"{}\",code=\"{code:#010x}\"",
                            who(p),
                            stats::reason(code).0
                        ),
                        n,
                    )
                })
                .collect()
        }),
    );
    for (i, name, help) in [
        (
            total::FAILED,
            "smcr_handshake_failures_total",
            "Handshakes that failed with no fallback.",
        ),
        (
            total::FIRST_CONTACT,
            "smcr_first_contacts_total",
            "Connections that created a link group.",
        ),
        (
            total::LINK_GROUPS,
            "smcr_link_groups_created_total",
            "Link groups created.",
        ),
        (
            total::LINK_FAILOVERS,
            "smcr_link_failovers_total",
            "Links that failed while their group had another (connections moved there).",
        ),
    ] {
        family(name, "counter", help, per(&|p| vec![(who(p), p.totals[i])]));
    }
    let open = |p: &Proc, k: Kind| p.conns.iter().filter(|c| c.kind == k).count() as u64;
    family(
        "smcr_open_connections",
        "gauge",
        "Connections open now, by mode.",
        per(&|p| {
            vec![
                (format!("{},mode=\"smcr\"", who(p)), open(p, Kind::Smcr)),
                (format!("{},mode=\"tcp\"", who(p)), open(p, Kind::Tcp)),
            ]
        }),
    );
    family(
        "smcr_link_groups",
        "gauge",
        "Link groups now.",
        per(&|p| vec![(who(p), p.links.len() as u64)]),
    );
    let bytes = |p: &Proc, sent: bool| {
        let live = p
            .conns
            .iter()
            .filter(|c| c.kind == Kind::Smcr)
            .fold(0u64, |a, c| {
                a.saturating_add(if sent { c.sent } else { c.received })
            });
        live.saturating_add(
            p.totals[if sent {
                total::BYTES_SENT
            } else {
                total::BYTES_RECEIVED
            }],
        )
    };
    for (i, name) in rdma::DeviceStats::NAMES.iter().enumerate() {
        family(
            &format!("smcr_device_{name}_total"),
            "counter",
            &format!("The RoCE engine's {name} counter, per local address."),
            per(&|p| {
                p.devices
                    .iter()
                    .map(|d| {
                        (
                            format!("{},address=\"{}\"", who(p), d.addr),
                            d.stats.to_words()[i],
                        )
                    })
                    .collect()
            }),
        );
    }
    // A gauge, not a counter: a connection closing while the snapshot is taken can be seen
    // in neither or both places for a moment, and a counter must never go down.
    family(
        "smcr_bytes",
        "gauge",
        "Payload bytes of the connections the library carries (open SMC-R ones and closed ones), by direction; approximate while connections close.",
        per(&|p| {
            vec![
                (format!("{},direction=\"sent\"", who(p)), bytes(p, true)),
                (
                    format!("{},direction=\"received\"", who(p)),
                    bytes(p, false),
                ),
            ]
        }),
    );
    o
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

/// One sample of an exposition: metric name, labels, value.
pub type Sample = (String, Vec<(String, String)>, f64);

/// A strict parser of the text exposition format (0.0.4) for what we emit: HELP/TYPE lines
/// before their samples, metric and label names well-formed, label values properly escaped,
/// values numbers, no family repeated. For tests (ours and users').
pub fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut typed = std::collections::HashSet::new();
    let mut current: Option<String> = None;
    let mut out = Vec::new();
    for (no, line) in text.lines().enumerate() {
        let err = |m: &str| format!("line {}: {m}: {line}", no + 1);
        if let Some(rest) = line.strip_prefix("# ") {
            let mut it = rest.splitn(3, ' ');
            let (kw, name) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
            if !name_ok(name) {
                return Err(err("bad metric name"));
            }
            match kw {
                "HELP" => {}
                "TYPE" => {
                    if !matches!(
                        it.next(),
                        Some("counter" | "gauge" | "histogram" | "summary" | "untyped")
                    ) {
                        return Err(err("bad type"));
                    }
                    if !typed.insert(name.to_owned()) {
                        return Err(err("family repeated"));
                    }
                    current = Some(name.to_owned());
                }
                _ => return Err(err("unknown comment keyword")),
            }
            continue;
        }
        let (name, rest) = line.split_at(line.find(['{', ' ']).ok_or_else(|| err("no value"))?);
        if !name_ok(name) || current.as_deref() != Some(name) {
            return Err(err("sample outside its family"));
        }
        let mut labels = Vec::new();
        let mut rest = rest;
        if let Some(r) = rest.strip_prefix('{') {
            let mut r = r;
            loop {
                if let Some(after) = r.strip_prefix('}') {
                    rest = after;
                    break;
                }
                let eq = r.find('=').ok_or_else(|| err("label without ="))?;
                let lname = &r[..eq];
                if !name_ok(lname) || lname.contains(':') {
                    return Err(err("bad label name"));
                }
                let mut chars = r[eq + 1..].char_indices();
                if chars.next().map(|c| c.1) != Some('"') {
                    return Err(err("label value not quoted"));
                }
                let mut value = String::new();
                let mut end = None;
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => match chars.next().map(|c| c.1) {
                            Some('\\') => value.push('\\'),
                            Some('"') => value.push('"'),
                            Some('n') => value.push('\n'),
                            _ => return Err(err("bad escape")),
                        },
                        '"' => {
                            end = Some(eq + 1 + i + 1);
                            break;
                        }
                        '\n' => return Err(err("raw newline")),
                        c => value.push(c),
                    }
                }
                let end = end.ok_or_else(|| err("unterminated label value"))?;
                labels.push((lname.to_owned(), value));
                r = &r[end..];
                r = r.strip_prefix(',').unwrap_or(r);
            }
        }
        let v = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("no space before value"))?
            .parse::<f64>()
            .map_err(|_| err("value not a number"))?;
        out.push((name.to_owned(), labels, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
