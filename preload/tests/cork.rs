//! Corked event loops (`smcr::cork`): an `epoll_wait` that returns events corks its thread,
//! and the replies it writes leave together when it calls in again. A loop that answers and
//! then stays away — it sleeps where the shim does not see it — must not hold its answer
//! back until it returns: the engine sends it. Two namespaces (the RoCE path over UDP, where
//! corking applies).
//!
//! Root (network namespaces): otherwise it says SKIP and passes, unless `SMCR_REQUIRE_TOOLS=1`.

mod common;

use common::{Bg, NetPair, Shim, py_script as script};
use std::io::{BufRead, BufReader};
use std::process::Stdio;

#[test]
fn an_event_loop_that_answers_and_stays_away_does_not_hold_its_answer_back() {
    if !common::root("network namespaces") {
        return;
    }
    let net = NetPair::new();
    let shim = Shim::new("cork");
    let port = common::port(25000).to_string();
    let rounds = "3";
    // The server sleeps 1 s after each answer; the client asks again 1.2 s after an answer
    // (the server is back in its loop). The engine sends a corked answer within 200 µs (up
    // to 5 ms later while a thread keeps its timers).
    let mut server = NetPair::cmd(&net.b, "python3");
    shim.apply(&mut server);
    server
        .env("SMCR_SAME_HOST", "off")
        .args([
            &script("cork_server.py"),
            NetPair::ADDR_B,
            &port,
            "1",
            rounds,
        ])
        .stdout(Stdio::piped());
    let mut server = Bg(server.spawn().unwrap());
    let mut lines = BufReader::new(server.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "READY");
    let mut client = NetPair::cmd(&net.a, "python3");
    shim.apply(&mut client);
    client.env("SMCR_SAME_HOST", "off").args([
        &script("cork_client.py"),
        NetPair::ADDR_B,
        &port,
        rounds,
        "1.2",
    ]);
    let out = client.output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        shim.log()
    );
    let longest: f64 = said
        .trim()
        .strip_prefix("LONGEST ")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    eprintln!(
        "longest wait for an answer: {longest:.6} s (the server sleeps 1 s after each)\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Held until the loop came back, an answer would wait 1 s; sent by the engine, a few
    // milliseconds at most (a machine ten times slower stays far below the bound).
    assert!(longest < 0.5, "an answer waited {longest} s for its loop");
    assert_eq!(lines.next().unwrap().unwrap(), "ANSWERED 3");
    let log = shim.log();
    assert_eq!(
        log.lines().filter(|l| l.contains("): SMC-R")).count(),
        2,
        "{log}"
    );
}
