//! Same host (issue 37): what programs expect of loopback TCP across connections holds over
//! shared memory — a client that writes on connection A, then on B, has its server's event
//! loop (epoll, edge- and level-triggered) see A's bytes first, 10 000 rounds of 10 000
//! (`tests/c/order.c`) — and the connections went over shared memory (`smc-stat --json`:
//! every link `shm`).

#[path = "common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const ROUNDS: &str = "10000";

/// Runs the order pair (under the shim or not); returns the server's verdict line and, under
/// the shim, `smc-stat --json` taken while both still held their connections.
fn order_pair(
    shim: bool,
    mode: &str,
    bin: &std::path::Path,
) -> (String, Option<serde_json::Value>) {
    let s = common::Shim::new(&format!(
        "order-{mode}-{}",
        if shim { "smcr" } else { "tcp" }
    ));
    let port = common::port(47000).to_string();
    let stats = s.dir.join("stats");
    let mut server = s.cmd(shim, bin.to_str().unwrap());
    // The default RoCE port (4791, shared by steering or its owner): both ends' devices on
    // 127.0.0.1 (a fixed port of the test's would be one device's alone).
    server
        .env_remove("SMCR_ROCE_PORT")
        .args(["server", &port, ROUNDS, mode])
        .env("SMCR_STATS_DIR", &stats)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut server = common::Bg(server.spawn().unwrap());
    common::wait_listening(None, "127.0.0.1", port.parse().unwrap());
    let mut client = s.cmd(shim, bin.to_str().unwrap());
    client
        .env_remove("SMCR_ROCE_PORT")
        .args(["client", &port, ROUNDS])
        .env("SMCR_STATS_DIR", &stats);
    let mut client = common::Bg(client.spawn().unwrap());
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let stat = shim.then(|| {
        let out = Command::new(common::bin("smc-stat"))
            .args(["--json", "--dir"])
            .arg(&stats)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).expect("smc-stat --json")
    });
    drop(server.0.stdin.take());
    assert!(server.0.wait().unwrap().success(), "server: {line}");
    let st = wait_timeout(&mut client.0, Duration::from_secs(60));
    assert!(st.is_some_and(|s| s.success()), "client failed: {st:?}");
    if shim {
        common::assert_all_smcr(&s.log(), 2);
    }
    (line.trim().to_owned(), stat)
}

fn wait_timeout(c: &mut std::process::Child, t: Duration) -> Option<std::process::ExitStatus> {
    let until = std::time::Instant::now() + t;
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return Some(s);
        }
        if std::time::Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn writes_on_two_connections_are_read_in_the_order_they_were_written() {
    let Some(bin) = common::build_c("order", &["-O2"]) else {
        return;
    };
    for mode in ["et", "lt"] {
        // Loopback TCP, for reference (not asserted). Edge-triggered, the kernel queues a
        // file at each arrival, but a segment that comes while the server holds A's socket
        // (writing its ack) wakes only once that call returns, and B's may come first: about
        // 1 round in 10 000 here. Level-triggered, a file also goes back on the ready list
        // after each report: B first again when it was reported last the round before.
        let (tcp, _) = order_pair(false, mode, &bin);
        eprintln!("kernel TCP ({mode}): {tcp}");
        let (smcr, stat) = order_pair(true, mode, &bin);
        assert_eq!(
            smcr,
            format!("order {ROUNDS} rounds, 0 out of order"),
            "{mode}"
        );
        let stat = stat.unwrap();
        let links = stat["link_groups"].as_array().expect("link_groups");
        assert_eq!(links.len(), 2, "one link group each side: {stat}");
        for l in links {
            assert_eq!(l["transport"], "shm", "not over shared memory: {l}");
        }
    }
}
