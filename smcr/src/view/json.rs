//! The JSON rendering (the stable schema our tests read; [`super::JSON_VERSION`]).

use super::*;

pub(super) fn json_str(s: &str) -> String {
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
