//! A setting that does not parse (issue 26): the program still works, every socket stays TCP,
//! and the log names the variable — decided at load, before the program's first socket.

mod common;

use std::process::{Command, Stdio};

use common::{Bg, Shim, have, port, run_ok, wait_listening};

#[test]
fn a_bad_setting_leaves_the_process_on_tcp_and_is_named() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let shim = Shim::new("config");
    let p = port(28000).to_string();
    let mut server = shim.cmd(true, "redis-server");
    server
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &p,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .env("SMCR_RMB_KIB", "64k")
        .stdout(Stdio::null());
    let _server = Bg(server.spawn().unwrap());
    wait_listening(None, "127.0.0.1", p.parse().unwrap());
    // A plain client (the server's process is all TCP); then a shimmed client whose own
    // setting is bad too: it stays TCP as well (were its settings fine, it would speak CLC
    // under `assume` to a server that does not).
    let mut plain = Command::new("redis-cli");
    plain.args(["-p", &p, "ping"]);
    assert_eq!(run_ok(&mut plain, "plain redis-cli ping").trim(), "PONG");
    let mut cli = shim.cmd(true, "redis-cli");
    cli.args(["-p", &p, "ping"]).env("SMCR_SAME_HOST", "maybe");
    assert_eq!(run_ok(&mut cli, "redis-cli ping").trim(), "PONG");
    let log = shim.log();
    assert!(
        log.contains("SMCR_RMB_KIB=\"64k\" is not valid (KiB, a whole number)")
            && log.contains("SMC-R is off for this process"),
        "the bad setting was not named:\n{log}"
    );
    assert!(
        log.contains("SMCR_SAME_HOST=\"maybe\" is not valid (on or off"),
        "the client's bad setting was not named:\n{log}"
    );
    assert_eq!(
        shim.smcr_count("accept") + shim.smcr_count("connect"),
        0,
        "a process with a bad setting used SMC-R:\n{log}"
    );
}
