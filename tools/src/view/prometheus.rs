//! The Prometheus text exposition, and a strict parser of it for tests.

use super::*;

pub(super) fn label(v: &str) -> String {
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
    // smc-tools' RX/TX statistics of SMC-R connections, closed and open ones (read as of one
    // moment, so they only grow between resets).
    let dirs = |p: &Proc| [("rx", p.traffic(false)), ("tx", p.traffic(true))];
    let sized = |p: &Proc, f: fn(&Traffic) -> &[u64; stats::BUCKETS]| {
        dirs(p)
            .iter()
            .flat_map(|(d, t)| {
                stats::BUCKET_NAMES
                    .iter()
                    .zip(f(t))
                    .map(|(size, &n)| (format!("{},direction=\"{d}\",size=\"{size}\"", who(p)), n))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    family(
        "smcr_requests_total",
        "counter",
        "Reads (rx) and writes (tx) of SMC-R connections that moved data, by bytes moved (Linux's buckets).",
        per(&|p| sized(p, |t| &t.reqs)),
    );
    family(
        "smcr_buffers_total",
        "counter",
        "SMC-R connections by buffer size: RMB (rx), send buffer (tx).",
        per(&|p| sized(p, |t| &t.bufs)),
    );
    family(
        "smcr_buffer_full_total",
        "counter",
        "Buffer full: rx, a CDC filled our RMB; tx, a write found no room; tx_remote, it found the peer's RMB full.",
        per(&|p| {
            let [(_, rx), (_, tx)] = dirs(p);
            [
                ("rx", rx.full),
                ("tx", tx.full),
                ("tx_remote", tx.full_remote),
            ]
            .into_iter()
            .map(|(d, n)| (format!("{},direction=\"{d}\"", who(p)), n))
            .collect()
        }),
    );
    for (i, name) in rdma::DeviceStats::NAMES.iter().enumerate() {
        // The one high-water mark among the counters is a gauge, not a total.
        let gauge = name.starts_with("rc_longest_");
        family(
            &if gauge {
                format!("smcr_device_{name}")
            } else {
                format!("smcr_device_{name}_total")
            },
            if gauge { "gauge" } else { "counter" },
            &if gauge {
                format!("The RoCE engine's {name} high-water mark, per local address.")
            } else {
                format!("The RoCE engine's {name} counter, per local address.")
            },
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
