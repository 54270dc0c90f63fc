//! The `smcr` command line as users type it: help, version, unknown options, `smcr run`
//! without `--`, and smc-tools' views (`smcr stats`, `linkgroup show`, `device show`,
//! `ueid show`) on an empty stats directory and on this process's live SMC-R connection.

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
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "A.B\nC-1\n");
    assert!(text(&out.stderr).contains("\"bad\""));
    let out = smcr(&["ueid", "add", "X"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("SMCR_UEID"));
}

#[test]
fn stats_count_a_live_smcr_connection() {
    let dir = TestDir::new("smcr-cli", "live");
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 24000 + (std::process::id() % 4000) as u16;
    cfg.stats_dir = Some(dir.0.clone());
    let rt = Runtime::new(cfg);
    let l = SmcListener::bind(&rt, "127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 100];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf[..40]).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
    c.write_all(&[5u8; 100]).unwrap();
    let mut back = [0u8; 40];
    c.read_exact(&mut back).unwrap();
    let me = std::process::id().to_string();
    // Both ends are this process; the byte counts land when the writes return.
    let until = Instant::now() + Duration::from_secs(5);
    let stats = loop {
        let s = view(&dir.0, &["stats", "--pid", &me]);
        let done = numbers(&s, "SMC-R  ") == [1, 1] && numbers(&s, "Data received") == [140];
        if done || Instant::now() > until {
            break s;
        }
        thread::sleep(Duration::from_millis(10));
    };
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
    let links = view(&dir.0, &["linkgroup", "show", "--pid", &me]);
    assert!(
        links.lines().skip(1).any(|l| l.starts_with(&me)),
        "a link group of this process:\n{links}"
    );
    c.shutdown(std::net::Shutdown::Write).unwrap();
    drop(c);
    server.join().unwrap();
    rt.shutdown();
}
