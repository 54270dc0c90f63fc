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
    let mut server = shim
        .cmd(true, "python3")
        .args(args("server"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("READY"), "{line}");
    let t0 = Instant::now();
    let client = shim
        .cmd(true, "python3")
        .args(args("client"))
        .output()
        .unwrap();
    let elapsed = t0.elapsed();
    let client_out = String::from_utf8_lossy(&client.stdout).into_owned();
    eprintln!("{client_out}{}", String::from_utf8_lossy(&client.stderr));
    assert!(client.status.success(), "client: {client_out}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = server.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut server_out = String::new();
    std::io::Read::read_to_string(&mut out, &mut server_out).unwrap();
    eprintln!("{server_out}");
    assert!(status.success(), "server: {server_out}");
    eprintln!("{n} connections in {elapsed:?}");
    assert_eq!(shim.smcr_count("connect"), n + 10, "{}", shim.log());
    assert_eq!(shim.smcr_count("accept"), n + 10);
}
