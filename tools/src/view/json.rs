//! The JSON rendering (the stable schema our tests read; [`super::JSON_VERSION`]), through
//! serde_json (keys in the schema's order: its `preserve_order`).

use super::*;
use serde_json::{Map, Value, json};

/// A JSON object of `names` and `values`, in order.
fn named<'a>(
    names: impl IntoIterator<Item = &'a str>,
    values: impl IntoIterator<Item = Value>,
) -> Value {
    Value::Object(
        names
            .into_iter()
            .map(str::to_owned)
            .zip(values)
            .collect::<Map<String, Value>>(),
    )
}

/// smc-tools' RX or TX statistics: requests (the buckets' sum), requests and buffers by size
/// (Linux's nine buckets), buffer full (and for TX, the peer's RMB full).
fn traffic_json(t: &Traffic, tx: bool) -> Value {
    let by = |v: &[u64; stats::BUCKETS]| {
        named(
            stats::BUCKET_NAMES.iter().copied(),
            v.iter().map(|&n| Value::from(n)),
        )
    };
    let mut m = json!({
        "requests": t.requests(),
        "reqs": by(&t.reqs),
        "bufs": by(&t.bufs),
        "buffer_full": t.full,
    });
    if tx {
        m["buffer_full_remote"] = Value::from(t.full_remote);
    }
    m
}

/// Everything as one JSON document (stable schema, version [`JSON_VERSION`]):
/// `{"version", "processes": [{pid, command, reset_epoch, totals{…}, rx{…}, tx{…}}],
/// "connections": [... rx{…}, tx{…}],
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
            devices.push(json!({
                "pid": p.pid,
                "command": p.comm,
                "address": d.addr.to_string(),
                "mode": d.mode.to_string(),
                "range": d.range,
                "counters": named(
                    rdma::DeviceStats::NAMES.iter().copied(),
                    d.stats.to_words().into_iter().map(Value::from),
                ),
            }));
        }
        let unavailable = if p.unavailable == 0 {
            Value::Null
        } else {
            Value::from(stats::reason(p.unavailable).0)
        };
        procs.push(json!({
            "pid": p.pid,
            "command": p.comm,
            "reset_epoch": p.reset_epoch,
            "smcr_unavailable": unavailable,
            "totals": named(total::NAMES.iter().copied(), p.totals.into_iter().map(Value::from)),
            "rx": traffic_json(&p.traffic(false), false),
            "tx": traffic_json(&p.traffic(true), true),
        }));
        for c in &p.conns {
            if c.kind == Kind::Listen {
                listeners.push(json!({
                    "pid": p.pid,
                    "command": p.comm,
                    "state": "LISTEN",
                    "local": c.local.to_string(),
                }));
                continue;
            }
            let (name, _) = stats::reason(c.code);
            let stages = named(
                STAGES.iter().copied(),
                c.stages_ns.into_iter().map(|t| {
                    if t == 0 {
                        Value::Null
                    } else {
                        Value::from(t / 1000)
                    }
                }),
            );
            let tcp = c.kind == Kind::Tcp;
            conns.push(json!({
                "pid": p.pid,
                "command": p.comm,
                "state": stats::state_name(c.state),
                "role": if c.server { "server" } else { "client" },
                "local": c.local.to_string(),
                "peer": c.peer.to_string(),
                "mode": c.mode().to_string(),
                "reason": if tcp { Value::from(name) } else { Value::Null },
                "reason_code": c.code,
                "peer_reason_code": c.peer_code,
                "bytes_sent": c.sent,
                "bytes_received": c.received,
                "rmb": c.rmb,
                "sndbuf": c.sndbuf,
                "token": c.token,
                "link_group": c.lg,
                "fd": c.fd,
                "since_ns": c.since_ns,
                "stages_us": stages,
                "cursors": {
                    "tx_prod": cursor(c.cursors[0]),
                    "peer_cons": cursor(c.cursors[1]),
                    "rx_prod": cursor(c.cursors[2]),
                    "rx_cons": cursor(c.cursors[3]),
                },
                "flags": {
                    "local": cdc_flags(c.local_flags),
                    "peer": cdc_flags(c.peer_flags),
                },
                "rx": traffic_json(&c.traffic(false), false),
                "tx": traffic_json(&c.traffic(true), true),
            }));
        }
        for l in &p.links {
            links.push(json!({
                "pid": p.pid,
                "command": p.comm,
                "id": l.id,
                "role": if l.client { "client" } else { "server" },
                "link_id": l.link_id,
                "state": stats::link_state_name(l.state),
                "connections": l.conns,
                "qpn": l.qpn,
                "peer_qpn": l.peer_qpn,
                "gid": gid_text(&l.gid),
                "peer_gid": gid_text(&l.peer_gid),
                "peer_system_id": hex(&l.peer_system),
                "mtu": l.mtu,
                "transport": l.transport.to_string(),
                "same_host": l.same_host,
                "peer_uid": l.peer_proc.map(|p| p.0),
                "peer_pid": l.peer_proc.map(|p| p.1),
                "since_ns": l.since_ns,
            }));
        }
    }
    let fallbacks: Vec<Value> = fallback_totals(s)
        .iter()
        .map(|(code, n)| {
            let (name, meaning) = stats::reason(*code);
            json!({
                "code": code,
                "name": name,
                "count": n,
                "meaning": meaning,
                "remedy": stats::remedy(*code),
            })
        })
        .collect();
    let doc = json!({
        "version": JSON_VERSION,
        "processes": procs,
        "connections": conns,
        "listeners": listeners,
        "link_groups": links,
        "devices": devices,
        "fallbacks": fallbacks,
    });
    format!("{doc}\n")
}
