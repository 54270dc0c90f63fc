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

/// Starts `redis-server` on 127.0.0.2:`p` under the shim with `env` (two shimmed processes
/// with a test's RoCE port, not 4791, need two addresses); the guard stops it.
fn redis(shim: &Shim, p: &str, env: &[(&str, &str)]) -> Bg {
    let mut server = shim.cmd(true, "redis-server");
    server
        .args([
            "--bind",
            "127.0.0.2",
            "--port",
            p,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .envs(env.iter().copied())
        .stdout(Stdio::null());
    let bg = Bg(server.spawn().unwrap());
    wait_listening(None, "127.0.0.2", p.parse().unwrap());
    bg
}

/// A configuration file `name` holding `text` in the shim's directory (removed with it).
fn config_file(shim: &Shim, name: &str, text: &str) -> String {
    let f = shim.dir.join(name);
    std::fs::write(&f, text).unwrap();
    f.to_str().unwrap().to_owned()
}

/// `redis-cli ping` to 127.0.0.2:`p` without the shim.
fn plain_ping(p: &str) {
    let mut plain = Command::new("redis-cli");
    plain.args(["-h", "127.0.0.2", "-p", p, "ping"]);
    assert_eq!(run_ok(&mut plain, "plain redis-cli ping").trim(), "PONG");
}

/// The library reads the configuration file `SMCR_CONFIG` names, and the environment wins
/// over it: a file that keeps every port but 1-2 off SMC-R leaves the listener TCP (logged
/// as excluded); the same file under `SMCR_INCLUDE=1-65535` lets the next one use SMC-R.
#[test]
fn the_library_reads_the_config_file_and_the_environment_overrides_it() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let shim = Shim::new("config-file");
    let f = &config_file(
        &shim,
        "smcr.toml",
        "# only ports 1-2\n[smcr]\ninclude = [\"1-2\"]\n",
    );
    let p = port(28100).to_string();
    {
        let _server = redis(&shim, &p, &[("SMCR_CONFIG", f)]);
        plain_ping(&p);
    }
    let log = shim.log();
    assert!(
        log.contains("TCP: excluded by SMCR_INCLUDE/SMCR_EXCLUDE"),
        "the file's include list was not applied:\n{log}"
    );
    let p = port(28200).to_string();
    let _server = redis(
        &shim,
        &p,
        &[("SMCR_CONFIG", f), ("SMCR_INCLUDE", "1-65535")],
    );
    let mut cli = shim.cmd(true, "redis-cli");
    cli.args(["-h", "127.0.0.2", "-p", &p, "ping"])
        .env("SMCR_CONFIG", f)
        .env("SMCR_INCLUDE", "1-65535");
    assert_eq!(run_ok(&mut cli, "redis-cli ping").trim(), "PONG");
    assert_eq!(shim.smcr_count("accept"), 1, "{}", shim.log());
}

/// A configuration file that does not parse leaves the process on TCP, and the log names the
/// file, the line and the entry.
#[test]
fn a_bad_config_file_leaves_the_process_on_tcp_and_names_the_entry() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let shim = Shim::new("config-bad-file");
    let f = &config_file(&shim, "smcr.toml", "[smcr]\nroce_port = \"fast\"\n");
    let p = port(28300).to_string();
    let _server = redis(&shim, &p, &[("SMCR_CONFIG", f)]);
    plain_ping(&p);
    let log = shim.log();
    assert!(
        log.contains(&format!(
            "{f}:2: smcr.roce_port = \"fast\" is not valid (a UDP port, 1-65535); SMC-R is off"
        )),
        "the bad entry was not named:\n{log}"
    );
    assert_eq!(shim.smcr_count("accept"), 0, "{log}");
}

/// Two ends whose UEIDs differ (set in each one's configuration file): the server declines,
/// both stay on TCP, redis works, and each side's `log` records say who declined and why
/// (INFO), next to the shim's own per-connection line.
#[test]
fn a_decline_is_logged_with_its_reason_on_both_sides() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let shim = Shim::new("config-decline");
    let fa = config_file(&shim, "a.toml", "smcr.ueid = [\"SMC-SIDE-A\"]\n");
    let fb = config_file(&shim, "b.toml", "smcr.ueid = [\"SMC-SIDE-B\"]\n");
    let p = port(28400).to_string();
    let server = redis(&shim, &p, &[("SMCR_CONFIG", &fa)]);
    let mut cli = shim.cmd(true, "redis-cli");
    cli.args(["-h", "127.0.0.2", "-p", &p, "ping"])
        .env("SMCR_CONFIG", &fb);
    assert_eq!(run_ok(&mut cli, "redis-cli ping").trim(), "PONG");
    drop(server);
    let log = shim.log();
    let has = |level: &str, what: &str| {
        log.lines()
            .any(|l| l.contains(level) && l.contains("stays on TCP, ") && l.contains(what))
    };
    assert!(
        has(
            "INFO",
            "(server) stays on TCP, we declined: NOUEID (0x03030008)"
        ),
        "no server decline record:\n{log}"
    );
    assert!(
        has(
            "INFO",
            "(client) stays on TCP, peer declined: NOUEID (0x03030008)"
        ),
        "no client decline record:\n{log}"
    );
    assert_eq!(
        shim.smcr_count("accept") + shim.smcr_count("connect"),
        0,
        "{log}"
    );
}

/// With a log (`SMCR_LOG`), the library keeps the file open from load on (for daemons that
/// chroot later), outside the numbers the program gets: its first `open` still returns 3, as
/// without the library (a daemon that closes or reuses low numbers never meets ours).
#[test]
fn the_kept_log_stays_out_of_the_programs_numbers() {
    if !have("python3") {
        return;
    }
    let shim = Shim::new("lognum");
    let first = "import os; print(os.open('/dev/null', os.O_RDONLY))";
    let plain = run_ok(Command::new("python3").args(["-c", first]), "plain python");
    let shimmed = run_ok(
        shim.cmd(true, "python3").args(["-c", first]),
        "python under the shim",
    );
    assert_eq!(
        shimmed.trim(),
        plain.trim(),
        "the first open under the shim"
    );
    // The file is open in the process all the same (its descriptor is ours, numbered high).
    let fds = "import os; print(sum(os.path.realpath('/proc/self/fd/' + f) == os.environ['SMCR_LOG'] for f in os.listdir('/proc/self/fd')))";
    let kept = run_ok(
        shim.cmd(true, "python3").args(["-c", fds]),
        "python under the shim",
    );
    assert_eq!(kept.trim(), "1", "descriptors of the log in the process");
}
