//! The text tables: sockets (like `smcss`), link groups, devices, fallback counters.

use super::*;

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

pub(super) fn cursor(w: u64) -> String {
    format!("{}:{}", w >> 32, w & 0xffff_ffff)
}

pub(super) fn cdc_flags(f: u8) -> String {
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

pub(super) fn ms(ns: u64) -> String {
    if ns == 0 {
        "-".into()
    } else {
        format!("{:.3}", ns as f64 / 1e6)
    }
}

/// Lines saying which processes cannot use SMC-R at all (their sockets have no rows).
pub(super) fn unavailable_notes(s: &Snapshot) -> String {
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

pub(super) fn gid_text(g: &[u8; 16]) -> String {
    Ipv6Addr::from(*g).to_string()
}

pub(super) fn hex(b: &[u8]) -> String {
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
