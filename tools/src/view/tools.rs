//! The smc-tools-style views of `smcr stats`: the counters the stats areas hold, grouped as
//! smc-tools' `smcr stats` groups them (summary, connections by role, bytes, fallback
//! reasons). Only what the areas record is shown; nothing is estimated.

use std::fmt::Write as _;

use super::{Kind, Snapshot, Traffic, fallback_totals, totals, traffic};
use smcr::stats::{self, total};

/// Connections now, by mode and role: `[smcr, tcp]` × `[client, server]`, and listeners.
fn live_by_role(s: &Snapshot) -> ([[u64; 2]; 2], u64) {
    let mut by = [[0u64; 2]; 2];
    let mut listening = 0;
    for c in s.procs.iter().flat_map(|p| &p.conns) {
        let mode = match c.kind {
            Kind::Smcr => 0,
            Kind::Tcp => 1,
            Kind::Listen => {
                listening += 1;
                continue;
            }
        };
        by[mode][usize::from(c.server)] += 1;
    }
    (by, listening)
}

/// Bytes of the connections open now: (sent, received), by mode (`[smcr, tcp]`).
fn live_bytes(s: &Snapshot) -> [(u64, u64); 2] {
    let mut b = [(0u64, 0u64); 2];
    for c in s.procs.iter().flat_map(|p| &p.conns) {
        let i = match c.kind {
            Kind::Smcr => 0,
            Kind::Tcp => 1,
            Kind::Listen => continue,
        };
        b[i].0 = b[i].0.saturating_add(c.sent);
        b[i].1 = b[i].1.saturating_add(c.received);
    }
    b
}

/// A count and its share of `of` as smc-tools prints it: `N (x.xx%)`.
fn share(n: u64, of: u64) -> String {
    let pct = if of > 0 {
        100.0 * n as f64 / of as f64
    } else {
        0.0
    };
    format!("{n:>12} ({pct:.2}%)")
}

/// smc-tools' histogram rows: its eight columns, the last (`>512KB`) holding Linux's 1024KB
/// and >1024KB buckets together as smc-tools prints them (`--json` and `--prometheus` keep
/// all nine).
fn histogram(o: &mut String, t: &Traffic) {
    let _ = writeln!(
        o,
        "            8KB    16KB    32KB    64KB   128KB   256KB   512KB  >512KB"
    );
    for (name, v) in [("Bufs", &t.bufs), ("Reqs", &t.reqs)] {
        let _ = write!(o, "  {name}   ");
        for (i, n) in v[..7].iter().enumerate() {
            let _ = write!(o, "{}{n:>6}", if i > 0 { "  " } else { "" });
        }
        let _ = writeln!(o, "  {:>6}", v[7].saturating_add(v[8]));
    }
}

/// `smcr stats`: the summary (connections handled since the last reset, by mode), the
/// connections open now by role, bytes moved, smc-tools' RX and TX statistics of SMC-R
/// connections (requests by size, buffers by size, buffer full), and the fallback reasons
/// with their names (`details`: with meanings, and one summary line per process).
pub fn render_stats(s: &Snapshot, details: bool) -> String {
    let t = totals(s);
    let mut o = String::new();
    let row = |o: &mut String, name: &str, v: u64| {
        let _ = writeln!(o, "  {name:<34}{v:>12}");
    };
    let _ = writeln!(o, "SMC-R Connections Summary");
    row(
        &mut o,
        "Total connections handled",
        t[total::SMCR] + t[total::TCP],
    );
    row(&mut o, "SMC connections", t[total::SMCR]);
    row(&mut o, "TCP fallback", t[total::TCP]);
    row(&mut o, "Handshake errors", t[total::FAILED]);
    let (rx, tx) = (traffic(s, false), traffic(s, true));
    let requests = rx.requests().saturating_add(tx.requests());
    let avg = if t[total::SMCR] > 0 {
        requests as f64 / t[total::SMCR] as f64
    } else {
        0.0
    };
    let _ = writeln!(o, "  {:<34}{avg:>14.1}", "Avg requests per SMC conn");
    row(&mut o, "First contacts", t[total::FIRST_CONTACT]);
    row(&mut o, "Link groups created", t[total::LINK_GROUPS]);
    row(&mut o, "Link failovers", t[total::LINK_FAILOVERS]);
    let _ = writeln!(o, "  {:<34}{:>12}", "Processes", s.procs.len());

    let (by, listening) = live_by_role(s);
    let _ = writeln!(
        o,
        "\n{:<24}{:>12}{:>12}",
        "Open connections", "Client", "Server"
    );
    for (name, r) in [("SMC-R", by[0]), ("TCP fallback", by[1])] {
        let _ = writeln!(o, "  {name:<22}{:>12}{:>12}", r[0], r[1]);
    }
    row(&mut o, "Listening sockets", listening);

    // Closed connections' bytes are in the totals, open ones' in their records.
    let b = live_bytes(s);
    let sent = t[total::BYTES_SENT]
        .saturating_add(b[0].0)
        .saturating_add(b[1].0);
    let received = t[total::BYTES_RECEIVED]
        .saturating_add(b[0].1)
        .saturating_add(b[1].1);
    let _ = writeln!(o, "\nRX Stats");
    row(&mut o, "Data received (Bytes)", received);
    row(&mut o, "  of open SMC-R connections", b[0].1);
    row(&mut o, "Total requests", rx.requests());
    let _ = writeln!(
        o,
        "  {:<34}{}",
        "Buffer full",
        share(rx.full, rx.requests())
    );
    histogram(&mut o, &rx);
    let _ = writeln!(o, "\nTX Stats");
    row(&mut o, "Data transmitted (Bytes)", sent);
    row(&mut o, "  of open SMC-R connections", b[0].0);
    row(&mut o, "Total requests", tx.requests());
    let _ = writeln!(
        o,
        "  {:<34}{}",
        "Buffer full",
        share(tx.full, tx.requests())
    );
    let _ = writeln!(
        o,
        "  {:<34}{}",
        "Buffer full (remote)",
        share(tx.full_remote, tx.requests())
    );
    histogram(&mut o, &tx);

    let _ = writeln!(o, "\n{:<36}{:>12}", "Fallback reasons", "Count");
    let counts = fallback_totals(s);
    if counts.is_empty() {
        let _ = writeln!(o, "  (none)");
    }
    for (code, n) in counts {
        let (name, meaning) = stats::reason(code);
        let _ = write!(o, "  {code:#010x} {name:<23}{n:>12}");
        if details {
            let _ = write!(o, "  {meaning}");
        }
        o.push('\n');
    }
    for p in s.procs.iter().filter(|p| p.unavailable != 0) {
        let (name, _) = stats::reason(p.unavailable);
        let _ = writeln!(
            o,
            "  note: SMC-R is off in pid {} ({}): {name} {:#010x}: {}",
            p.pid,
            p.comm,
            p.unavailable,
            stats::remedy(p.unavailable)
        );
    }
    if details {
        let _ = writeln!(
            o,
            "\n{:<8} {:<15} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10} {:>8} {:>8}",
            "PID",
            "COMMAND",
            "SMCR",
            "TCP",
            "FAILED",
            "RESETS",
            "RX-REQS",
            "TX-REQS",
            "RX-FULL",
            "TX-FULL"
        );
        for p in &s.procs {
            let (rx, tx) = (p.traffic(false), p.traffic(true));
            let _ = writeln!(
                o,
                "{:<8} {:<15} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10} {:>8} {:>8}",
                p.pid,
                p.comm,
                p.totals[total::SMCR],
                p.totals[total::TCP],
                p.totals[total::FAILED],
                p.reset_epoch,
                rx.requests(),
                tx.requests(),
                rx.full,
                tx.full
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{Conn, Proc};

    #[test]
    fn stats_groups_the_counters() {
        let mut totals = [0u64; total::COUNT];
        totals[total::SMCR] = 3;
        totals[total::TCP] = 1;
        totals[total::BYTES_SENT] = 100;
        totals[total::BYTES_RECEIVED] = 50;
        let s = Snapshot {
            procs: vec![Proc {
                pid: 7,
                comm: "redis".into(),
                totals,
                fallbacks: vec![(0x0101_0000, 1)],
                conns: vec![
                    Conn {
                        sent: 10,
                        received: 20,
                        ..Conn::default()
                    },
                    Conn {
                        server: true,
                        sent: 1,
                        received: 2,
                        ..Conn::default()
                    },
                    Conn {
                        kind: Kind::Listen,
                        ..Conn::default()
                    },
                ],
                ..Proc::default()
            }],
        };
        let o = render_stats(&s, false);
        let line = |start: &str| {
            o.lines()
                .find(|l| l.trim_start().starts_with(start))
                .unwrap_or_else(|| panic!("{start}:\n{o}"))
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(line("Total connections handled").last().unwrap(), "4");
        assert_eq!(line("SMC connections").last().unwrap(), "3");
        assert_eq!(line("SMC-R  ").as_slice()[1..], ["1", "1"]);
        assert_eq!(line("Listening sockets").last().unwrap(), "1");
        assert_eq!(line("Data received").last().unwrap(), "72");
        assert_eq!(line("Data transmitted").last().unwrap(), "111");
        assert!(o.contains("0x01010000 MEM"), "{o}");
        assert!(render_stats(&Snapshot::default(), true).contains("(none)"));
    }
}
