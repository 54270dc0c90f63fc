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

/// What the socket table shows: `smcss`'s options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketView {
    /// Which rows (`-a`, `-l`).
    pub rows: Rows,
    /// `-d`, `--debug`: token, buffer sizes and cursors as `smcss` prints them, CDC flags,
    /// fallback meaning and handshake stage times under each row.
    pub details: bool,
    /// `-R`, `--smcr`: SMC-R sockets only, with their link's role, id and GIDs.
    pub smcr: bool,
    /// `-D`, `--smcd`: SMC-D sockets only (smcr has none: an empty table and a note).
    pub smcd: bool,
    /// `-W`, `--wide`: addresses never truncated.
    pub wide: bool,
}

impl SocketView {
    /// `rows`, no option.
    pub fn new(rows: Rows) -> Self {
        Self {
            rows,
            details: false,
            smcr: false,
            smcd: false,
            wide: false,
        }
    }
}

/// `smcss`'s address column width (longer addresses are truncated with `..` unless `-W`).
pub const ADDR_WIDTH: usize = 23;

/// An address as `smcss` prints it: `ip:port` (IPv6 without brackets), the ip cut and `..`
/// added when it is longer than [`ADDR_WIDTH`] and not `wide`.
pub fn smcss_addr(a: &SocketAddr, wide: bool) -> String {
    let (ip, port) = (a.ip().to_string(), a.port().to_string());
    if wide || ip.len() + 1 + port.len() <= ADDR_WIDTH {
        return format!("{ip}:{port}");
    }
    let keep = ADDR_WIDTH.saturating_sub(port.len() + 3).min(ip.len());
    format!("{}..:{port}", &ip[..keep])
}

/// A cursor (`wrap << 32 | count`) as `smcss -d` prints it: `wwww:cccccccc`, hex.
pub fn smcss_cursor(w: u64) -> String {
    format!("{:04x}:{:08x}", (w >> 32) & 0xffff, w & 0xffff_ffff)
}

/// The socket table (`smcss`'s columns State, Local Address, Peer Address, Mode and, with
/// `-R`, Role, Linkid, GID, Peer-GID, spelled as `smcss` spells them; ours in capitals).
pub fn render_sockets(s: &Snapshot, rows: Rows, details: bool) -> String {
    render_socket_table(
        s,
        SocketView {
            details,
            ..SocketView::new(rows)
        },
    )
}

/// The socket table with every `smcss` option (see [`SocketView`]).
pub fn render_socket_table(s: &Snapshot, v: SocketView) -> String {
    let mut o = unavailable_notes(s);
    if v.smcd {
        o.push_str(
            "note: no SMC-D socket: smcr implements SMC-R only (no ISM device); -R or no option shows its sockets\n",
        );
    }
    let shown = |c: &&Conn| v.rows.shows(c) && !v.smcd && (!v.smcr || c.kind == Kind::Smcr);
    let peer_of = |c: &Conn| {
        if c.kind == Kind::Listen {
            "*:*".to_owned()
        } else {
            smcss_addr(&c.peer, v.wide)
        }
    };
    // With -W the columns widen to the longest address shown.
    let (mut lw, mut pw) = (ADDR_WIDTH, ADDR_WIDTH);
    for c in s.procs.iter().flat_map(|p| p.conns.iter()).filter(shown) {
        lw = lw.max(smcss_addr(&c.local, v.wide).len());
        pw = pw.max(peer_of(c).len());
    }
    let _ = write!(
        o,
        "{:<8} {:<15} {:<16} {:<lw$} {:<pw$} {:<4} {:<30} {:>12} {:>12} {:>7} {:>7}",
        "PID",
        "COMMAND",
        "State",
        "Local Address",
        "Peer Address",
        "Mode",
        "FALLBACK",
        "SENT",
        "RECEIVED",
        "RMB",
        "SNDBUF"
    );
    if v.smcr {
        let _ = write!(o, " {:<4} {:<6} {:<40} Peer-GID", "Role", "Linkid", "GID");
    }
    o.push('\n');
    for p in &s.procs {
        for c in p.conns.iter().filter(shown) {
            let _ = write!(
                o,
                "{:<8} {:<15} {:<16} {:<lw$} {:<pw$} {:<4} {:<30} {:>12} {:>12} {:>7} {:>7}",
                p.pid,
                p.comm,
                stats::smcss_state_name(c.state),
                smcss_addr(&c.local, v.wide),
                peer_of(c),
                c.mode(),
                c.fallback(),
                c.sent,
                c.received,
                c.rmb,
                c.sndbuf
            );
            if v.smcr {
                match p.links.iter().find(|l| l.id == c.lg) {
                    Some(l) => {
                        let _ = write!(
                            o,
                            " {:<4} {:<6} {:<40} {}",
                            if l.client { "CLNT" } else { "SERV" },
                            format!("{:02x}", l.link_id),
                            gid_text(&l.gid),
                            gid_text(&l.peer_gid)
                        );
                    }
                    None => {
                        let _ = write!(o, " {:<4} {:<6} {:<40} -", "-", "-", "-");
                    }
                }
            }
            o.push('\n');
            if v.details && c.kind != Kind::Listen {
                if c.kind == Kind::Smcr {
                    let _ = writeln!(
                        o,
                        "    Token {:08x} Sndbuf {:08x} Rcvbuf {:08x} rxprod-Cursor {} rxcons-Cursor {} txprod-Cursor {} txcons-Cursor {} | link group {} | flags local {} peer {}",
                        c.token,
                        c.sndbuf,
                        c.rmb,
                        smcss_cursor(c.cursors[2]),
                        smcss_cursor(c.cursors[1]),
                        smcss_cursor(c.cursors[0]),
                        smcss_cursor(c.cursors[3]),
                        c.lg,
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

/// Link groups and their links (`--links`; `-R` before `smc-stat` took smcss's options).
pub fn render_links(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<8} {:<15} {:>5} {:<6} {:>3} {:<10} {:>5} {:>8} {:>8} {:<22} {:<22} {:<16} {:>5} {:<9} SAME-HOST",
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
                "{:<8} {:<15} {:>5} {:<6} {:>3} {:<10} {:>5} {:>8} {:>8} {:<22} {:<22} {:<16} {:>5} {:<9} {}",
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
                l.transport,
                // The peer process (uid/pid) once shared, else what became of sharing.
                l.peer_proc
                    .map_or_else(|| l.same_host.to_string(), |(u, p)| format!("{u}/{p}"))
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

/// The RDMA devices the kernel lists on this host (`/sys/class/infiniband`), as smc-tools'
/// `smc_rnics` shows them: device, port, state, link layer, and each RoCE v2 GID with its
/// network device and that device's MTU (`mtu_of`). Empty when there are none.
pub fn render_rdma_ports(
    ports: &[rdma::ibv::sysfs::PortInfo],
    mtu_of: impl Fn(&str) -> Option<u32>,
) -> String {
    use rdma::ibv::sysfs::{GidKind, format_gid};
    let mut o = String::new();
    if ports.is_empty() {
        return o;
    }
    let _ = writeln!(
        o,
        "\nRDMA devices on this host (an address with a RoCE v2 GID here runs its links on that device: MODE verbs above; SMCR_RDMA_DEVICE)"
    );
    let _ = writeln!(
        o,
        "{:<12} {:>4} {:<8} {:<10} {:>5} {:<39} {:<15} {:<10} {:>6}",
        "DEVICE", "PORT", "STATE", "LINK", "INDEX", "ROCE V2 GID", "IPV4", "NETDEV", "MTU"
    );
    for p in ports {
        let v2: Vec<_> = p
            .gids
            .iter()
            .filter(|g| g.kind == GidKind::RoceV2)
            .collect();
        let head = format!(
            "{:<12} {:>4} {:<8} {:<10}",
            p.device, p.port, p.state, p.link_layer
        );
        if v2.is_empty() {
            let _ = writeln!(o, "{head} {:>5} -", "-");
        }
        for g in v2 {
            let nd = g.netdev.as_deref().unwrap_or("-");
            let _ = writeln!(
                o,
                "{head} {:>5} {:<39} {:<15} {:<10} {:>6}",
                g.index,
                format_gid(&g.gid),
                g.ipv4().map_or("-".to_string(), |a| a.to_string()),
                nd,
                g.netdev
                    .as_deref()
                    .and_then(&mtu_of)
                    .map_or("-".to_string(), |m| m.to_string()),
            );
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
    use smcr::FallbackReason as F;
    let mut v: Vec<u32> = smcr::DeclineReason::ALL.iter().map(|r| r.0).collect();
    v.extend([
        F::CODE_NO_BPF,
        F::CODE_OPTION_NOT_OBSERVED,
        F::CODE_NOT_IPV4,
        F::CODE_EXCLUDED,
        F::CODE_NO_FD,
        F::CODE_SHARED,
        F::CODE_NO_THREAD,
        F::CODE_HANDED_OFF,
        F::CODE_NOT_CLC,
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
