//! The end of a process: a shimmed client that sends 8 MiB and calls `exit()` at once, its
//! socket never closed, to a shimmed server in another network namespace (RoCE v2 over UDP).
//! As with TCP, the server gets every byte and then EOF; and since the exit deletes the link
//! group (DELETE LINK), the server's group is gone at once, not after TEST LINK gives up.
//!
//! Root (network namespaces): otherwise it says SKIP and passes, unless `SMCR_REQUIRE_TOOLS=1`.

mod common;

use common::{Bg, NetPair, Shim, py_script as script};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn a_process_that_exits_with_data_in_flight_loses_nothing_and_deletes_its_group() {
    if !common::root("network namespaces") {
        return;
    }
    let net = NetPair::new();
    let shim = Shim::new("exit");
    let stats = shim.dir.join("stats");
    let port = common::port(24000);
    let mut server = NetPair::cmd(&net.b, "python3");
    shim.apply(&mut server);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    server.env("SMCR_SAME_HOST", "off");
    server
        .env("SMCR_STATS_DIR", &stats)
        .args([
            &script("exit_server.py"),
            NetPair::ADDR_B,
            &port.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut server = Bg(server.spawn().unwrap());
    let mut lines = BufReader::new(server.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "READY");

    let n = 8 << 20;
    let mut client = NetPair::cmd(&net.a, "python3");
    shim.apply(&mut client);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    client.env("SMCR_SAME_HOST", "off");
    client.env("SMCR_STATS_DIR", &stats).args([
        &script("exit_client.py"),
        NetPair::ADDR_B,
        &port.to_string(),
        &n.to_string(),
    ]);
    let t = Instant::now();
    let out = client.output().unwrap();
    let took = t.elapsed();
    let sent = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && sent.starts_with("SENT"),
        "{sent}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every byte, then EOF (not a reset), as a TCP peer would see it.
    let got = lines.next().unwrap().unwrap();
    let hash = sent.split_whitespace().nth(2).unwrap();
    assert_eq!(got, format!("GOT {n} {hash} EOF"), "log:\n{}", shim.log());
    let log = shim.log();
    assert!(
        log.contains("connect") && log.contains("accept") && log.contains("SMC-R (new link group)"),
        "{log}"
    );
    // The exit handler runs after the main thread's thread-locals are gone: nothing of ours
    // may need one then (a panic there, caught, would skip the DELETE LINKs).
    assert!(!log.contains("panic"), "{log}");
    // The server's group went with the client (our DELETE LINK), while the server runs on:
    // without it, it would stay until TEST LINK gave up (30 s and retries).
    let server_pid = server.0.id().to_string();
    let smc_stat = common::bin("smc-stat");
    let deadline = Instant::now() + Duration::from_secs(3);
    let groups = loop {
        let out = std::process::Command::new(&smc_stat)
            .args([
                "--dir",
                stats.to_str().unwrap(),
                "--json",
                "--pid",
                &server_pid,
            ])
            .output()
            .unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let groups = doc["link_groups"].as_array().unwrap().len();
        if groups == 0 || Instant::now() > deadline {
            break groups;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(groups, 0, "the server's link group outlived the client");
    eprintln!("client ran {took:?} (connect, 8 MiB, drain at exit)");
    writeln!(server.0.stdin.as_mut().unwrap()).unwrap();
    assert!(server.0.wait().unwrap().success());
}
