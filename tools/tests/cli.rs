//! The `smcr` command line as users type it: help, version, unknown options, `smcr run`
//! without `--`, and smc-tools' views (`smcr stats`, `linkgroup show`, `device show`,
//! `ueid show`) on an empty stats directory and on this process's live SMC-R connection.

#[path = "../../smcr/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant};

use common::TestDir;
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

fn smcr(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smcr"))
        .args(args)
        .env_remove("SMCR_UEID")
        .env_remove("SMCR_STATS_DIR")
        // A configuration file of the machine stays out of the tests.
        .env("SMCR_CONFIG", "off")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `smcr ARGS… --dir DIR`, which must succeed; its output.
fn view(dir: &Path, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.extend(["--dir", dir.to_str().unwrap()]);
    let out = smcr(&all);
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// The numbers of the line that starts (after blanks) with `label`.
fn numbers(out: &str, label: &str) -> Vec<u64> {
    out.lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} in:\n{out}"))
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

#[test]
fn help_and_version_go_to_stdout_with_success() {
    let out = smcr(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    for w in [
        "run",
        "bpf",
        "stats",
        "linkgroup",
        "device",
        "ueid",
        "--version",
    ] {
        assert!(help.contains(w), "{w} in:\n{help}");
    }
    assert!(
        !help.contains("generate"),
        "the generator stays hidden:\n{help}"
    );
    let out = smcr(&["run", "-h"]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    assert!(
        help.contains("--rmb-kib") && help.contains("default 512") && help.contains("-t <SIZE>"),
        "{help}"
    );
    let out = smcr(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("smcr {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn unknown_options_are_named_with_exit_2() {
    for args in [
        &["--frob"][..],
        &["run", "--frob", "true"],
        &["stats", "--frob"],
    ] {
        let out = smcr(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains("'--frob'"), "{args:?}: {err}");
    }
}

#[test]
fn run_takes_the_command_without_dashes() {
    // Options after CMD are CMD's: `-x` does not reach smcr; the library is checked first.
    for args in [
        &[
            "run",
            "--assume",
            "--lib",
            "/nonexistent/libsmcr.so",
            "true",
            "-x",
        ][..],
        &[
            "run",
            "--lib",
            "/nonexistent/libsmcr.so",
            "-r",
            "64K",
            "--",
            "true",
        ],
    ] {
        let out = smcr(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("/nonexistent/libsmcr.so"), "{err}");
    }
    // -t is not dropped silently.
    let out = smcr(&["run", "--lib", "/nonexistent/x.so", "-t", "1M", "true"]);
    assert!(text(&out.stderr).contains("-t 1048576 is ignored"));
}

#[test]
fn views_of_an_empty_stats_directory() {
    let dir = TestDir::new("smcr-cli", "empty");
    let stats = view(&dir.0, &["stats"]);
    assert_eq!(numbers(&stats, "Total connections handled"), [0]);
    for h in [
        "SMC-R Connections Summary",
        "Open connections",
        "Fallback reasons",
    ] {
        assert!(stats.contains(h), "{h}:\n{stats}");
    }
    assert_eq!(view(&dir.0, &["stats", "show"]), stats);
    for args in [&["linkgroup", "show"][..], &["lgr", "show"]] {
        assert!(view(&dir.0, args).starts_with("PID "), "{args:?}");
    }
    for args in [&["device", "show"][..], &["dev", "show", "-d"]] {
        assert!(view(&dir.0, args).contains("ADDRESS"), "{args:?}");
    }
    assert!(view(&dir.0, &["stats", "reset"]).contains("0 process area(s)"));
}

#[test]
fn ueid_show_prints_the_default_or_smcr_ueid() {
    let out = smcr(&["ueid", "show"]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), smcr::runtime::DEFAULT_UEID);
    let out = Command::new(env!("CARGO_BIN_EXE_smcr"))
        .arg("ueid")
        .env("SMCR_UEID", "A.B, bad ,C-1")
        .env("SMCR_CONFIG", "off")
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "A.B\nC-1\n");
    assert!(text(&out.stderr).contains("\"bad\"") && text(&out.stderr).contains("stays TCP"));
}

/// `smcr` with a configuration file (`SMCR_CONFIG`) and environment.
fn smcr_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smcr"))
        .args(args)
        .env_remove("SMCR_UEID")
        .env_remove("SMCR_HOLD_US")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `smcr ueid add/del/flush` edit smcr.ueid in the configuration file, keeping the rest of it;
/// `show` then reads it (the environment still wins); what Linux refuses is refused.
#[test]
fn ueid_add_del_flush_edit_the_config_file() {
    let dir = TestDir::new("smcr-cli", "ueid");
    let file = dir.0.join("smcr.toml");
    let f = file.to_str().unwrap();
    std::fs::write(&file, "# keep me\n[smcr]\nhold_us = 5 # and me\n").unwrap();
    let cfg = [("SMCR_CONFIG", f)];
    for u in ["smc-a", "SMC-B"] {
        let out = smcr_with(&["ueid", "add", u], &cfg);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let out = smcr_with(&["ueid", "show"], &cfg);
    assert_eq!(text(&out.stdout), "SMC-A\nSMC-B\n");
    assert!(
        text(&out.stderr).contains(&format!("({f}:")),
        "{}",
        text(&out.stderr)
    );
    let kept = std::fs::read_to_string(&file).unwrap();
    assert!(
        kept.contains("# keep me") && kept.contains("hold_us = 5 # and me"),
        "{kept}"
    );
    // Refused: twice, not valid, more than Linux's 4, deleting one that is not there.
    assert_eq!(
        smcr_with(&["ueid", "add", "SMC-A"], &cfg).status.code(),
        Some(1)
    );
    assert_eq!(
        smcr_with(&["ueid", "add", "A B"], &cfg).status.code(),
        Some(1)
    );
    for u in ["C", "D"] {
        assert!(smcr_with(&["ueid", "add", u], &cfg).status.success());
    }
    let out = smcr_with(&["ueid", "add", "E"], &cfg);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("4 already"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        smcr_with(&["ueid", "del", "X"], &cfg).status.code(),
        Some(1)
    );
    assert!(smcr_with(&["ueid", "del", "smc-b"], &cfg).status.success());
    let out = smcr_with(&["ueid"], &cfg);
    assert_eq!(text(&out.stdout), "SMC-A\nC\nD\n");
    // The environment wins over the file.
    let out = smcr_with(&["ueid"], &[("SMCR_CONFIG", f), ("SMCR_UEID", "ENV")]);
    assert_eq!(text(&out.stdout), "ENV\n");
    assert!(smcr_with(&["ueid", "flush"], &cfg).status.success());
    let out = smcr_with(&["ueid"], &cfg);
    assert_eq!(text(&out.stdout).trim(), smcr::runtime::DEFAULT_UEID);
    assert!(!std::fs::read_to_string(&file).unwrap().contains("ueid"));
    // A file that does not parse is not touched.
    std::fs::write(&file, "smcr.hold_us = \"x\"\n").unwrap();
    let out = smcr_with(&["ueid", "add", "A"], &cfg);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("not changed"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "smcr.hold_us = \"x\"\n"
    );
}

/// `smcr config`: every setting with its value and source (environment over file over
/// default); `--list` names them all; a bad file or variable is refused naming the entry, by
/// `smcr config` (exit 1) and by `smcr run` before the program starts (exit 2).
#[test]
fn config_shows_values_and_sources_and_run_refuses_a_bad_one() {
    let dir = TestDir::new("smcr-cli", "config");
    let file = dir.0.join("smcr.toml");
    let f = file.to_str().unwrap();
    std::fs::write(
        &file,
        "net.smc.rmem = 131072\n[smcr]\nhold_us = 5\nroce_port = 4800\n",
    )
    .unwrap();
    let out = smcr_with(&["config"], &[("SMCR_CONFIG", f), ("SMCR_HOLD_US", "7")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    let row = |key: &str| -> Vec<String> {
        o.lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("no {key}:\n{o}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        row("net.smc.rmem")[1..],
        [String::from("131072"), format!("{f}:1")]
    );
    assert_eq!(
        row("smcr.roce_port")[1..],
        [String::from("4800"), format!("{f}:4")]
    );
    assert_eq!(row("smcr.hold_us")[1..], ["7", "SMCR_HOLD_US"]);
    assert_eq!(row("smcr.lgr_linger")[1..], ["600", "default"]);
    assert!(
        o.starts_with(&format!("configuration file: {f} (3 setting(s))")),
        "{o}"
    );
    // --file instead of SMCR_CONFIG; no file at all.
    let out = smcr_with(&["config", "--file", f], &[("SMCR_CONFIG", "off")]);
    assert!(text(&out.stdout).contains(&format!("{f}:4")));
    let out = smcr_with(&["config"], &[("SMCR_CONFIG", "off")]);
    assert!(text(&out.stdout).starts_with("configuration file: none (SMCR_CONFIG=off)"));
    let out = smcr_with(&["config", "--list"], &[]);
    assert_eq!(
        text(&out.stdout)
            .lines()
            .filter(|l| !l.starts_with(' '))
            .count(),
        smcr::settings::SETTINGS.len()
    );
    // Bad: a value in the file, an unknown key, a variable.
    let marker = dir.0.join("ran");
    let touch = ["run", "--assume", "touch", marker.to_str().unwrap()];
    for (text_of_file, env, needle) in [
        (
            "[smcr]\nroce_port = 0\n",
            None,
            format!("{f}:2: smcr.roce_port = 0 is not valid"),
        ),
        (
            "net.smc.wmem = 1\n",
            None,
            format!("{f}:1: net.smc.wmem is not a setting"),
        ),
        (
            "",
            Some(("SMCR_LGR_LINGER", "1h")),
            "SMCR_LGR_LINGER=\"1h\" is not valid".into(),
        ),
    ] {
        std::fs::write(&file, text_of_file).unwrap();
        let mut vars = vec![("SMCR_CONFIG", f)];
        vars.extend(env);
        let out = smcr_with(&["config"], &vars);
        assert_eq!(out.status.code(), Some(1), "{text_of_file}");
        assert!(text(&out.stderr).contains(&needle), "{}", text(&out.stderr));
        let out = smcr_with(&touch, &vars);
        assert_eq!(out.status.code(), Some(2), "{text_of_file}");
        assert!(text(&out.stderr).contains(&needle), "{}", text(&out.stderr));
        assert!(!marker.exists(), "smcr run started the program");
    }
    // `smcr run --config` names the file for the program too; a missing one is refused.
    let out = smcr_with(&["run", "--config", "/nonexistent/smcr.toml", "true"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("/nonexistent/smcr.toml: cannot be read"));
}

/// The lines of `out` from the one that is `title` to the next blank one.
fn block<'a>(out: &'a str, title: &str) -> &'a str {
    let at = out
        .find(&format!("\n{title}\n"))
        .unwrap_or_else(|| panic!("no {title:?} in:\n{out}"));
    let rest = &out[at + 1..];
    &rest[..rest.find("\n\n").unwrap_or(rest.len())]
}

/// `smcr stats` of this process once `done` holds of it (or after 5 s).
fn stats_when(dir: &Path, done: impl Fn(&str) -> bool) -> String {
    let me = std::process::id().to_string();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let s = view(dir, &["stats", "--pid", &me]);
        if done(&s) || Instant::now() > until {
            return s;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// A real SMC-R connection in this process (both ends), with 16 KiB RMBs (so 16 KiB send
/// buffers): `smcr stats` counts its connections, bytes, requests by size, buffers by size
/// and the buffer filling up on both sides.
#[test]
fn stats_count_a_live_smcr_connection() {
    let dir = TestDir::new("smcr-cli", "live");
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 24000 + (std::process::id() % 4000) as u16;
    cfg.stats_dir = Some(dir.0.clone());
    cfg.rmb_size = 16 * 1024;
    cfg.same_host_rmb_size = Some(16 * 1024);
    cfg.remote_rmb_size = Some(16 * 1024);
    let rt = Runtime::new(cfg);
    let l = SmcListener::bind(&rt, "127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 100];
        s.read_exact(&mut buf).unwrap();
        // Its CDC also tells the client we consumed the 100 bytes.
        s.write_all(&buf[..40]).unwrap();
        // Not reading until told: the client fills our RMB.
        wait.recv().unwrap();
        let mut full = vec![0u8; 16 * 1024];
        s.read_exact(&mut full).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
    c.write_all(&[5u8; 100]).unwrap();
    let mut back = [0u8; 40];
    c.read_exact(&mut back).unwrap();
    // Both ends are this process; the byte counts land when the writes return, and the
    // client can read the server's 40 bytes before the server's write has returned.
    let stats = stats_when(&dir.0, |s| {
        numbers(s, "SMC-R  ") == [1, 1]
            && numbers(s, "Data received") == [140]
            && numbers(s, "Data transmitted") == [140]
    });
    assert_eq!(
        numbers(&stats, "SMC-R  "),
        [1, 1],
        "client, server:\n{stats}"
    );
    assert_eq!(numbers(&stats, "SMC connections"), [2], "{stats}");
    assert_eq!(numbers(&stats, "TCP fallback"), [0], "{stats}");
    assert_eq!(numbers(&stats, "Handshake errors"), [0], "{stats}");
    assert_eq!(numbers(&stats, "Data received"), [140], "{stats}");
    assert_eq!(numbers(&stats, "Data transmitted"), [140], "{stats}");
    assert_eq!(numbers(&stats, "Processes"), [1], "{stats}");

    // The server's 16 KiB RMB holds nothing now: 10 000 bytes go, then the 6 384 left (a
    // short write), then no room: EAGAIN.
    c.set_nonblocking(true).unwrap();
    assert_eq!((&c).write(&[1u8; 10_000]).unwrap(), 10_000);
    assert_eq!((&c).write(&[2u8; 10_000]).unwrap(), 6_384);
    // Once the server's RMB is full, all we wrote is there and nothing waits in our send
    // buffer: the next write finds the peer's RMB full.
    let full = |s: &str| numbers(block(s, "RX Stats"), "Buffer full").first() == Some(&1);
    let stats = stats_when(&dir.0, full);
    assert!(full(&stats), "the server's RMB filled up:\n{stats}");
    let e = (&c).write(&[3u8; 10_000]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
    c.set_nonblocking(false).unwrap();
    go.send(()).unwrap();
    let stats = stats_when(&dir.0, |s| numbers(s, "Data received") == [16_524]);
    let (rx, tx) = (block(&stats, "RX Stats"), block(&stats, "TX Stats"));
    // RX: the server read 100 and 16 384 bytes, the client 40; the CDC of the 6 384 bytes
    // filled the server's RMB. Two 16 KiB RMBs.
    assert_eq!(numbers(rx, "Data received"), [16_524], "{stats}");
    assert_eq!(numbers(rx, "Total requests"), [3], "{stats}");
    assert_eq!(numbers(rx, "Buffer full"), [1], "{stats}");
    assert!(rx.contains("(33.33%)"), "{stats}");
    assert_eq!(numbers(rx, "Bufs"), [0, 2, 0, 0, 0, 0, 0, 0], "{stats}");
    assert_eq!(numbers(rx, "Reqs"), [2, 1, 0, 0, 0, 0, 0, 0], "{stats}");
    // TX: the client wrote 100, 10 000 and 6 384 bytes, the server 40; the failed write is
    // no request but found both buffers full. Two 16 KiB send buffers.
    assert_eq!(numbers(tx, "Data transmitted"), [16_524], "{stats}");
    assert_eq!(numbers(tx, "Total requests"), [4], "{stats}");
    assert_eq!(numbers(tx, "Buffer full  "), [1], "{stats}");
    assert_eq!(numbers(tx, "Buffer full (remote)"), [1], "{stats}");
    assert_eq!(numbers(tx, "Bufs"), [0, 2, 0, 0, 0, 0, 0, 0], "{stats}");
    assert_eq!(numbers(tx, "Reqs"), [3, 1, 0, 0, 0, 0, 0, 0], "{stats}");
    // 7 requests over 2 connections.
    assert!(
        stats.contains("Avg requests per SMC conn                    3.5"),
        "{stats}"
    );
    let me = std::process::id().to_string();
    let links = view(&dir.0, &["linkgroup", "show", "--pid", &me]);
    assert!(
        links.lines().skip(1).any(|l| l.starts_with(&me)),
        "a link group of this process:\n{links}"
    );
    c.shutdown(std::net::Shutdown::Write).unwrap();
    drop(c);
    server.join().unwrap();
    // Closed, the connections' counts are in the process totals; a reset zeroes them.
    let stats = stats_when(&dir.0, |s| numbers(s, "SMC-R  ") == [0, 0]);
    assert_eq!(
        numbers(block(&stats, "TX Stats"), "Reqs"),
        [3, 1, 0, 0, 0, 0, 0, 0],
        "{stats}"
    );
    assert_eq!(
        numbers(block(&stats, "TX Stats"), "Bufs"),
        [0, 2, 0, 0, 0, 0, 0, 0],
        "{stats}"
    );
    let json = smcr_tools::view::render_json(&smcr_tools::view::Snapshot::collect(
        &dir.0,
        Some(std::process::id()),
    ));
    assert!(json.contains("\"closed_tx_reqs_16k\":1"), "{json}");
    view(&dir.0, &["stats", "reset", "--pid", &me]);
    let stats = view(&dir.0, &["stats", "--pid", &me]);
    assert_eq!(
        numbers(block(&stats, "TX Stats"), "Reqs"),
        [0; 8],
        "{stats}"
    );
    assert_eq!(
        numbers(block(&stats, "RX Stats"), "Buffer full"),
        [0],
        "{stats}"
    );
    rt.shutdown();
}

/// `smcr service` as an administrator uses it on Debian's redis unit (when installed):
/// enable writes the drop-in, check judges it (a library outside the unit's ExecPaths= is a
/// problem, /usr/lib is not), disable removes it.
#[test]
fn service_enable_check_disable_on_a_real_unit() {
    if !Path::new("/lib/systemd/system/redis-server.service").exists() {
        eprintln!("SKIP: no redis-server unit on this machine");
        return;
    }
    let d = TestDir::new("smcr-cli", "service");
    let dropins = d.0.join("redis-server.service.d");
    let dir = dropins.to_str().unwrap();
    // A library the unit cannot map.
    let lib_local = d.0.join("libsmcr.so");
    std::fs::write(&lib_local, b"").unwrap();
    let out = smcr(&[
        "service",
        "enable",
        "redis-server",
        "--dropin-dir",
        dir,
        "--lib",
        lib_local.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let conf = std::fs::read_to_string(dropins.join("smcr.conf")).unwrap();
    assert!(
        conf.contains(&format!(
            "Environment=\"LD_PRELOAD={}\"",
            lib_local.display()
        )),
        "{conf}"
    );
    let out = smcr(&["service", "check", "redis-server", "--dropin-dir", dir]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.lines()
            .any(|l| l.starts_with("problem: NoExecPaths=") && l.contains("/usr/lib")),
        "{said}"
    );
    // The install's place passes (the file's presence aside).
    let out = smcr(&["service", "enable", "redis-server", "--dropin-dir", dir]);
    assert!(out.status.success());
    let out = smcr(&["service", "check", "redis-server", "--dropin-dir", dir]);
    let said = text(&out.stdout);
    assert!(
        said.contains("ok: NoExecPaths=/ExecPaths= let the loader map /usr/lib/libsmcr.so"),
        "{said}"
    );
    assert!(!said.contains("problem: NoExecPaths"), "{said}");
    let out = smcr(&["service", "disable", "redis-server", "--dropin-dir", dir]);
    assert!(out.status.success());
    assert!(!dropins.join("smcr.conf").exists());
}
