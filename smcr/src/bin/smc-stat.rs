//! `smc-stat`: every SMC-R connection, link group and fallback reason of the processes running
//! smcr, read from their shared-memory stats areas (`smcr::stats`) without disturbing them.
//! The formats live in `smcr::view` (snapshot-tested); this is the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use smcr::stats;
use smcr::view::{self, Rows, Snapshot};

const USAGE: &str = "usage: smc-stat [OPTIONS]
       smc-stat reset [--pid PID] [--dir DIR]

  (default)        one row per connection: pid, command, SMC state, addresses, mode (SMCR or
                   TCP), fallback reason (name, code, `by peer` when the peer declined), bytes
                   sent/received, RMB and send buffer sizes
  -a, --all        connections and listening sockets
  -l, --listening  listening sockets only
  -d, --details    cursors, CDC flags, fallback meaning and handshake stage times per row
  -R, --links      link groups and their links: role, state, connections, QPNs, GIDs, peer
  --devices        RoCE devices per process and address: how packets reach the engine
                   (steered, owner, local-only, fixed), packets, ICRC errors, drops,
                   retransmissions, NAKs, packets from Linux rxe peers (with -d: every
                   counter by name)
  --fallback       totals and fallback counters per reason: code, name, count, meaning,
                   remedy (with -a: every code smc-stat knows, Linux's and ours)
  --pid PID        only that process
  --json           everything as one JSON document (stable schema, \"version\" 1)
  --prometheus     the counters in the Prometheus text format
  --watch N        redraw every N seconds (Ctrl-C stops)
  --dir DIR        where the areas are (default /dev/shm/smcr, or $SMCR_STATS_DIR)

reset: zero the counters (totals and fallback counters) in the stats areas themselves, as
       `smcr stats reset` does; needs write access to the areas (their owner, or root).";

#[derive(Clone, Copy, PartialEq, Eq)]
enum View {
    Sockets,
    Links,
    Devices,
    Fallback,
    Json,
    Prometheus,
}

fn main() -> ExitCode {
    let mut dir = std::env::var_os("SMCR_STATS_DIR")
        .filter(|d| d != "off")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(stats::DEFAULT_DIR));
    let (mut pid, mut view, mut rows, mut details, mut watch) =
        (None, View::Sockets, Rows::Connections, false, None);
    let mut reset = false;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "reset" => reset = true,
            "--dir" => match it.next() {
                Some(d) => dir = PathBuf::from(d),
                None => return usage("--dir needs a directory"),
            },
            "--pid" => match it.next().and_then(|p| p.parse::<u32>().ok()) {
                Some(p) => pid = Some(p),
                None => return usage("--pid needs a process id"),
            },
            "--watch" => match it.next().and_then(|p| p.parse::<f64>().ok()) {
                Some(s) if s > 0.0 && s.is_finite() => watch = Some(Duration::from_secs_f64(s)),
                _ => return usage("--watch needs a number of seconds"),
            },
            "-a" | "--all" => rows = Rows::All,
            "-l" | "--listening" => rows = Rows::Listeners,
            "-d" | "--details" => details = true,
            "-R" | "--links" => view = View::Links,
            "--devices" => view = View::Devices,
            "--fallback" => view = View::Fallback,
            "--json" => view = View::Json,
            "--prometheus" => view = View::Prometheus,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    if reset {
        return match view::reset(&dir, pid) {
            Ok(n) => {
                println!("reset the counters of {n} process area(s)");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("smc-stat reset: {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let render = || {
        let snap = Snapshot::collect(&dir, pid);
        match view {
            View::Sockets => view::render_sockets(&snap, rows, details),
            View::Links => view::render_links(&snap),
            View::Devices => view::render_devices(&snap, details),
            View::Fallback => view::render_fallbacks(&snap, rows == Rows::All),
            View::Json => view::render_json(&snap),
            View::Prometheus => view::render_prometheus(&snap),
        }
    };
    match watch {
        None => print!("{}", render()),
        Some(every) => loop {
            // Home and clear, then the frame: one write, so a terminal never shows half.
            let frame = format!("\x1b[H\x1b[2J{}", render());
            print!("{frame}");
            use std::io::Write;
            if std::io::stdout().flush().is_err() {
                return ExitCode::SUCCESS; // the reader went away
            }
            std::thread::sleep(every);
        },
    }
    ExitCode::SUCCESS
}

fn usage(why: &str) -> ExitCode {
    eprintln!("smc-stat: {why}\n{USAGE}");
    ExitCode::from(2)
}
