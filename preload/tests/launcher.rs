//! `smcr run` and the SMCR_INCLUDE/SMCR_EXCLUDE policy, driven as a user would: Python's echo
//! server and client started by the launcher with the TCP option program.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::{Bg, Shim, lib, port, root, run_ok, smcr_bin, wait_listening};

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}

/// `smcr run` with a private option-program directory, our log, our engine port.
fn launch(shim: &Shim, bpf: &std::path::Path, opts: &[&str], prog: &[&str]) -> Command {
    let mut c = Command::new(smcr_bin());
    c.arg("run")
        .arg("--dir")
        .arg(bpf)
        .arg("--lib")
        .arg(lib())
        .arg("--log")
        .arg(&shim.log)
        .args(opts)
        .arg("--")
        .args(prog)
        .env("SMCR_ROCE_PORT", shim.roce_port.to_string());
    c
}

#[test]
fn smcr_run_accelerates_and_the_policy_keeps_excluded_traffic_on_tcp() {
    if !root("the option program") {
        return;
    }
    let shim = Shim::new("launcher");
    let bpf = PathBuf::from(format!("/sys/fs/bpf/smcr-test-run-{}", std::process::id()));
    let result = std::panic::catch_unwind(|| {
        let server_py = script("server.py");
        let client_py = script("client.py");
        // Round 1: nothing excluded → SMC-R (and `smcr run` installs the program itself).
        // Round 2: the client excludes the server's port → TCP, PEERNOSMC at the server.
        // Round 3: the client includes only another port → TCP as well.
        // Rounds 4, 5: TCP fast open (TCP_FASTOPEN_CONNECT, MSG_FASTOPEN) → TCP, OPTUNSUPP.
        for (round, client_opts, flag) in [
            (1, vec![], None),
            (2, vec!["--exclude", "PORT"], None),
            (3, vec!["--include", "1-100,10.0.0.0/8"], None),
            (4, vec![], Some("--tfo-connect")),
            (5, vec![], Some("--msg-fastopen")),
        ] {
            let p = port(26000);
            let ps = p.to_string();
            let server = Bg(launch(
                &shim,
                &bpf,
                &[],
                &["python3", server_py.to_str().unwrap(), "127.0.0.2", &ps],
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap());
            wait_listening(None, "127.0.0.2", p);
            let opts: Vec<String> = client_opts.iter().map(|o| o.replace("PORT", &ps)).collect();
            let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
            let mut prog = vec!["python3", client_py.to_str().unwrap(), "127.0.0.2", &ps];
            prog.extend(flag);
            let out = run_ok(
                &mut launch(&shim, &bpf, &opts, &prog),
                &format!("round {round} client"),
            );
            assert!(out.contains("OK"), "{out}");
            drop(server);
        }
    });
    // `smcr run` also pins its steering there; both go, and with them the directory.
    let _ = smcr::steer::uninstall(&bpf);
    let _ = smcr::option::uninstall(&bpf);
    result.unwrap();
    assert!(
        !bpf.exists(),
        "the test install left pins in {}",
        bpf.display()
    );
    let log = shim.log();
    let lines = |f: &dyn Fn(&str) -> bool| log.lines().filter(|l| f(l)).count();
    assert_eq!(
        lines(&|l| l.contains("connect") && l.contains("): SMC-R")),
        1,
        "{log}"
    );
    assert_eq!(
        lines(&|l| l.contains("accept") && l.contains("): SMC-R")),
        1,
        "{log}"
    );
    assert_eq!(
        lines(&|l| l.contains("connect 127.0.0.2") && l.contains("0x7f000004")),
        2,
        "{log}"
    );
    for opt in ["TCP_FASTOPEN", "MSG_FASTOPEN"] {
        assert_eq!(
            lines(&|l| l.contains(opt) && l.contains("OPTUNSUPP 0x03060000")),
            1,
            "{log}"
        );
    }
    assert_eq!(
        lines(&|l| l.contains("accept") && l.contains("PEERNOSMC")),
        4,
        "{log}"
    );
}

#[test]
fn smcr_run_refuses_bad_rules_and_a_missing_library() {
    let bin = smcr_bin();
    let out = Command::new(&bin)
        .args([
            "run",
            "--assume",
            "--exclude",
            "80,10.0.0.0/40",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("SMCR_EXCLUDE") && err.contains("10.0.0.0/40"),
        "{err}"
    );
    let out = Command::new(&bin)
        .args([
            "run",
            "--assume",
            "--lib",
            "/nonexistent/libsmcr.so",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/nonexistent/libsmcr.so"),
        "{err}"
    );
    // And a good run execs the command with the library preloaded first.
    let out = Command::new(&bin)
        .args(["run", "--assume", "--lib"])
        .arg(lib())
        .args([
            "--rmb-kib",
            "128",
            "--",
            "sh",
            "-c",
            "echo $LD_PRELOAD $SMCR_RMB_KIB $SMCR_NEGOTIATION",
        ])
        .env("LD_PRELOAD", "/lib/other.so")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        format!(
            "{} /lib/other.so 128 assume",
            std::fs::canonicalize(lib()).unwrap().display()
        )
    );
}

/// A policy that does not parse, set by hand: the library keeps the process on TCP and says why.
#[test]
fn a_bad_policy_in_the_environment_keeps_everything_on_tcp() {
    let shim = Shim::new("badpolicy");
    let p = port(26000);
    let ps = p.to_string();
    let server = Bg(Command::new("python3")
        .args([script("server.py").to_str().unwrap(), "127.0.0.2", &ps])
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(None, "127.0.0.2", p);
    let mut c = shim.cmd(true, "python3");
    c.args([script("client.py").to_str().unwrap(), "127.0.0.2", &ps])
        .env("SMCR_EXCLUDE", "http");
    let out = run_ok(&mut c, "client");
    assert!(out.contains("OK"));
    drop(server);
    let log = shim.log();
    // Checked with every setting when the library loads: the whole process is off (no
    // connection of it reaches the policy), named with what the list takes.
    assert!(
        log.contains("SMCR_EXCLUDE=\"http\" is not valid (rules: PORT, LO-HI")
            && log.contains("SMC-R is off for this process"),
        "{log}"
    );
    assert!(!log.contains("): SMC-R"), "{log}");
}
