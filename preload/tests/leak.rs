//! No descriptor or thread leaks over 1000 SMC-R connect/close cycles (blocking and
//! non-blocking connects), counted by the programs themselves in /proc/self, and a clean exit
//! of both processes.

mod common;

use std::io::BufRead;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Shim, port};

#[test]
fn a_thousand_connections_leak_no_descriptors_or_threads() {
    let n: usize = std::env::var("SMCR_TEST_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let shim = Shim::new("leak");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/leak.py");
    let p = port(28000).to_string();
    let ns = n.to_string();
    let args = |role: &str| {
        [
            script.to_str().unwrap().to_owned(),
            role.into(),
            "127.0.0.2".into(),
            p.clone(),
            ns.clone(),
        ]
    };
    let spawn = |role: &str| {
        shim.cmd(true, "python3")
            .args(args(role))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut server = spawn("server");
    let mut server_out = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    server_out.read_line(&mut line).unwrap();
    assert!(line.contains("READY"), "{line}");
    let t0 = Instant::now();
    let mut client = spawn("client");
    let mut client_out = std::io::BufReader::new(client.stdout.take().unwrap());
    // Each side's report, before either may exit (see leak.py).
    let report = |out: &mut std::io::BufReader<std::process::ChildStdout>, role: &str| {
        let mut all = String::new();
        loop {
            let mut l = String::new();
            if out.read_line(&mut l).unwrap() == 0 {
                return all;
            }
            all.push_str(&l);
            if l.starts_with(&format!("{role}: fds")) {
                return all;
            }
        }
    };
    let client_report = report(&mut client_out, "client");
    let elapsed = t0.elapsed();
    if !client_report.contains("client: fds") {
        // The client ended early: the server would wait for its connections for ever.
        let _ = server.kill();
        let st = client.wait().unwrap();
        panic!("the client ended without its report ({st}):\n{client_report}");
    }
    let server_report = report(&mut server_out, "server");
    eprintln!("{client_report}{server_report}");
    // Both reported: they may exit now.
    drop(client.stdin.take());
    drop(server.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(20);
    let wait = |c: &mut std::process::Child, who: &str| loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the {who} did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (cs, ss) = (wait(&mut client, "client"), wait(&mut server, "server"));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut client_out, &mut rest).unwrap();
    std::io::Read::read_to_string(&mut server_out, &mut rest).unwrap();
    eprintln!("{rest}");
    assert!(cs.success(), "client: {client_report}{rest}");
    assert!(ss.success(), "server: {server_report}{rest}");
    eprintln!("{n} connections in {elapsed:?}");
    assert_eq!(shim.smcr_count("connect"), n + 10, "{}", shim.log());
    assert_eq!(shim.smcr_count("accept"), n + 10);
}
