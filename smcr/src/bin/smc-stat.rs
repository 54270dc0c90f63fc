//! `smc-stat`: the SMC-R connections and fallback reasons of every process running smcr, read
//! from their shared-memory stats areas (`smcr::stats`) without disturbing them. First step of
//! issue 6: the connection view, `--fallback`, `--pid`, `--json`.

use std::path::PathBuf;
use std::process::ExitCode;

use smcr::stats::{self, Area, conn};

const USAGE: &str = "usage: smc-stat [--dir DIR] [--pid PID] [--json] [--fallback]

  (default)   one row per connection: pid, command, state, addresses, mode, fallback reason,
              bytes, buffer sizes
  --fallback  fallback counters per reason: code, name, count, meaning
  --pid PID   only that process
  --json      the same as JSON
  --dir DIR   where the areas are (default /dev/shm/smcr, or $SMCR_STATS_DIR)";

struct Row {
    pid: u32,
    comm: String,
    server: bool,
    smcr: bool,
    local: String,
    peer: String,
    code: u32,
    peer_code: u32,
    rmb: u64,
    sndbuf: u64,
    sent: u64,
    received: u64,
}

fn addr(w: u64) -> String {
    let ip = std::net::Ipv4Addr::from((w >> 16) as u32);
    format!("{ip}:{}", w & 0xffff)
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

fn main() -> ExitCode {
    let mut dir = std::env::var_os("SMCR_STATS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(stats::DEFAULT_DIR));
    let (mut pid, mut json, mut fallback) = (None, false, false);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => match it.next() {
                Some(d) => dir = PathBuf::from(d),
                None => return usage(),
            },
            "--pid" => match it.next().and_then(|p| p.parse::<u32>().ok()) {
                Some(p) => pid = Some(p),
                None => return usage(),
            },
            "--json" => json = true,
            "--fallback" => fallback = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ => return usage(),
        }
    }
    stats::clean_stale(&dir);
    let mut areas: Vec<Area> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "stats"))
                .filter_map(|p| Area::open(&p).ok())
                .filter(|a| !a.is_stale() && pid.is_none_or(|p| a.pid() == p))
                .collect()
        })
        .unwrap_or_default();
    areas.sort_by_key(Area::pid);
    if fallback {
        print_fallbacks(&areas, json);
    } else {
        print_rows(&rows(&areas), json);
    }
    ExitCode::SUCCESS
}

fn rows(areas: &[Area]) -> Vec<Row> {
    let mut out = Vec::new();
    for a in areas {
        let comm = a.comm();
        for i in 0..a.conn_slots() {
            // A slot that stays mid-update (its writer died there) is skipped.
            let Ok(Some(r)) = a.read_conn(i) else {
                continue;
            };
            let w = &r.words;
            out.push(Row {
                pid: a.pid(),
                comm: comm.clone(),
                server: w[conn::STATE] >> 8 & 1 == 1,
                smcr: w[conn::STATE] >> 16 & 0xff == conn::MODE_SMCR,
                local: addr(w[conn::LOCAL]),
                peer: addr(w[conn::PEER]),
                code: w[conn::REASON] as u32,
                peer_code: (w[conn::REASON] >> 32) as u32,
                rmb: w[conn::SIZES] & 0xffff_ffff,
                sndbuf: w[conn::SIZES] >> 32,
                sent: r.bytes_sent,
                received: r.bytes_received,
            });
        }
    }
    out
}

fn print_rows(rows: &[Row], json: bool) {
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                let (name, _) = stats::reason(r.code);
                format!(
                    "{{\"pid\":{},\"command\":{},\"state\":\"ACTIVE\",\"role\":\"{}\",\"local\":\"{}\",\"peer\":\"{}\",\"mode\":\"{}\",\"reason\":{},\"reason_code\":{},\"peer_reason_code\":{},\"bytes_sent\":{},\"bytes_received\":{},\"rmb\":{},\"sndbuf\":{}}}",
                    r.pid,
                    json_str(&r.comm),
                    if r.server { "server" } else { "client" },
                    r.local,
                    r.peer,
                    if r.smcr { "SMCR" } else { "TCP" },
                    if r.smcr { "null".to_owned() } else { json_str(name) },
                    r.code,
                    r.peer_code,
                    r.sent,
                    r.received,
                    r.rmb,
                    r.sndbuf
                )
            })
            .collect();
        println!("{{\"connections\":[{}]}}", items.join(","));
        return;
    }
    println!(
        "{:<8} {:<15} {:<7} {:<21} {:<21} {:<5} {:<24} {:>12} {:>12} {:>7} {:>7}",
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
    for r in rows {
        let reason = if r.smcr {
            "-".to_owned()
        } else {
            format!("{} {:#010x}", stats::reason(r.code).0, r.code)
        };
        println!(
            "{:<8} {:<15} {:<7} {:<21} {:<21} {:<5} {:<24} {:>12} {:>12} {:>7} {:>7}",
            r.pid,
            r.comm,
            "ACTIVE",
            r.local,
            r.peer,
            if r.smcr { "SMCR" } else { "TCP" },
            reason,
            r.sent,
            r.received,
            r.rmb,
            r.sndbuf
        );
    }
}

fn print_fallbacks(areas: &[Area], json: bool) {
    let mut total: std::collections::BTreeMap<u32, u64> = Default::default();
    for a in areas {
        for (code, n) in a.fallbacks() {
            *total.entry(code).or_default() += n;
        }
    }
    if json {
        let items: Vec<String> = total
            .iter()
            .map(|(code, n)| {
                let (name, meaning) = stats::reason(*code);
                format!(
                    "{{\"code\":{code},\"name\":{},\"count\":{n},\"meaning\":{}}}",
                    json_str(name),
                    json_str(meaning)
                )
            })
            .collect();
        println!("{{\"fallbacks\":[{}]}}", items.join(","));
        return;
    }
    println!("{:<12} {:<12} {:>8}  MEANING", "CODE", "NAME", "COUNT");
    for (code, n) in &total {
        let (name, meaning) = stats::reason(*code);
        println!("{code:#010x}   {name:<12} {n:>8}  {meaning}");
    }
}

fn usage() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}
