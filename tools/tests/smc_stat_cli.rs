//! `smc-stat`'s command line: help and version, unknown options, smcss's options (`-a -l -d -D
//! -R -W -v`, combined short flags) and ours, on an empty stats directory.

#[path = "../../smcr/tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use common::TestDir;

fn smc_stat(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smc-stat"))
        .args(args)
        .env_remove("SMCR_STATS_DIR")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs with `--dir` on an empty directory; must succeed; its stdout.
fn ok(dir: &TestDir, args: &[&str]) -> String {
    let mut all = vec!["--dir", dir.path()];
    all.extend_from_slice(args);
    let out = smc_stat(&all);
    assert!(
        out.status.success(),
        "smc-stat {args:?}: {:?}\n{}",
        out.status,
        text(&out.stderr)
    );
    assert!(out.stderr.is_empty(), "{args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn help_goes_to_stdout_with_exit_0() {
    for h in ["--help", "-h"] {
        let out = smc_stat(&[h]);
        assert_eq!(out.status.code(), Some(0), "{h}");
        let s = text(&out.stdout);
        for flag in [
            "--all",
            "--listening",
            "--debug",
            "--smcd",
            "--smcr",
            "--wide",
            "--links",
        ] {
            assert!(s.contains(flag), "{h}: {flag} missing:\n{s}");
        }
        assert!(out.stderr.is_empty());
    }
    // The move of -R's old meaning is in the help.
    let long = text(&smc_stat(&["--help"]).stdout);
    assert!(long.contains("-R showed before"), "{long}");
}

#[test]
fn version_like_smcss() {
    for v in ["-v", "-V", "--version"] {
        let out = smc_stat(&[v]);
        assert_eq!(out.status.code(), Some(0), "{v}");
        assert!(text(&out.stdout).starts_with("smc-stat "), "{v}");
    }
}

#[test]
fn unknown_options_are_named_with_exit_2() {
    for (args, named) in [
        (&["--bogus"][..], "--bogus"),
        (&["-ax"][..], "-x"),
        (&["--watch", "0"][..], "--watch"),
        (&["--pid", "me"][..], "--pid"),
    ] {
        let out = smc_stat(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains(named), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn smcss_options_on_an_empty_directory() {
    let d = TestDir::new("smc-stat-cli", "smcss");
    let header = |s: &str| {
        s.lines()
            .any(|l| l.contains("State") && l.contains("Local Address"))
    };
    for args in [
        &[][..],
        &["-a"],
        &["-l"],
        &["-d"],
        &["-ad"],
        &["-adW"],
        &["-W"],
        &["--all", "--debug", "--wide"],
        &["--details"],
    ] {
        let s = ok(&d, args);
        assert!(header(&s), "{args:?}: {s}");
        assert_eq!(s.lines().count(), 1, "{args:?}: only the header: {s}");
    }
    // -R: SMC-R sockets only, with smcss's link columns.
    for args in [&["-R"][..], &["--smcr"], &["-aR"], &["-dR"]] {
        let s = ok(&d, args);
        assert!(
            header(&s) && s.contains("Linkid") && s.contains("Peer-GID"),
            "{s}"
        );
    }
    // -D: no SMC-D here, said so, exit 0.
    for args in [&["-D"][..], &["--smcd"], &["-aD"]] {
        let s = ok(&d, args);
        assert!(s.contains("no SMC-D"), "{s}");
        assert!(header(&s), "{s}");
    }
    // smcss's combinations it refuses.
    for args in [&["-R", "-D"][..], &["-l", "-a"], &["-lR"]] {
        let mut all = vec!["--dir", d.path()];
        all.extend_from_slice(args);
        let out = smc_stat(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn our_views_on_an_empty_directory() {
    let d = TestDir::new("smc-stat-cli", "ours");
    let links = ok(&d, &["--links"]);
    assert!(
        links.starts_with("PID") && links.contains("LG-ID"),
        "{links}"
    );
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(ok(&d, &["--devices", "-d"]).contains("ICRC-ERR"));
    assert!(ok(&d, &["--fallback", "-a"]).contains("remedy: "));
    let doc = ok(&d, &["--json"]);
    let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
    assert_eq!(v["version"], 1, "{doc}");
    assert!(ok(&d, &["--prometheus"]).is_ascii());
    assert!(ok(&d, &["reset"]).contains("0 process"));
    assert!(ok(&d, &["reset", "--pid", "1"]).contains("0 process"));
    // One view at a time.
    let out = smc_stat(&["--dir", d.path(), "--links", "--json"]);
    assert_eq!(out.status.code(), Some(2));
}
