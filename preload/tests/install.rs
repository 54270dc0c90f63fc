//! The install step as a user takes it (issue 26): `scripts/install.sh` into a fresh prefix,
//! then `LD_PRELOAD=libsmcr.so` by name (through `LD_LIBRARY_PATH`, as for any prefix the
//! loader does not search) and the installed `smcr run` from another directory, both with
//! redis over SMC-R; then `--uninstall` leaves nothing behind.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{Bg, have, lib, port, run_ok, smcr_bin, wait_listening};

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        }
        out.push(p);
    }
    out
}

/// `c` preloads the library by name from `libdir` (as for any prefix the loader does not
/// search), with `assume` and the default RoCE port, logging to `log`.
fn by_name(c: &mut Command, libdir: &Path, log: &Path) {
    c.env("LD_PRELOAD", "libsmcr.so")
        .env("LD_LIBRARY_PATH", libdir)
        .env("SMCR_NEGOTIATION", "assume")
        .env("SMCR_CONFIG", "off")
        .env("SMCR_LOG", log)
        .env_remove("SMCR_ROCE_PORT");
}

/// `redis-server` on 127.0.0.1:`p` under the library by name; the guard stops it.
fn redis_by_name(p: u16, libdir: &Path, log: &Path) -> Bg {
    let mut server = Command::new("redis-server");
    server
        .args(["--bind", "127.0.0.1", "--port", &p.to_string()])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .current_dir("/");
    by_name(&mut server, libdir, log);
    let server = Bg(server.spawn().unwrap());
    wait_listening(None, "127.0.0.1", p);
    server
}

#[test]
fn install_then_preload_by_name_and_smcr_run_then_uninstall_leaves_nothing() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let top = std::env::temp_dir().join(format!("smcr-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&top);
    std::fs::create_dir_all(&top).unwrap();
    let prefix = top.join("prefix");
    let from = smcr_bin().parent().unwrap().to_path_buf();
    run_ok(
        Command::new("bash")
            .arg(root.join("scripts/install.sh"))
            .arg("--prefix")
            .arg(&prefix)
            .arg("--from")
            .arg(&from)
            .arg("--lib")
            .arg(lib())
            .arg("--no-ldconfig"),
        "install.sh",
    );
    for f in [
        "lib/libsmcr.so",
        "bin/smcr",
        "bin/smc-stat",
        "share/man/man1/smcr.1",
        "share/man/man1/smcr-run.1",
        "share/man/man1/smc-stat.1",
        "share/bash-completion/completions/smcr",
        "share/bash-completion/completions/smc-stat",
        "share/zsh/site-functions/_smcr",
        "share/fish/vendor_completions.d/smcr.fish",
    ] {
        assert!(prefix.join(f).is_file(), "{f} not installed");
    }

    // Both ends on 127.0.0.1, the library named as users name it.
    let log = top.join("smcr.log");
    let p = port(27000);
    let libdir = prefix.join("lib");
    let _server = redis_by_name(p, &libdir, &log);
    let mut set = Command::new("redis-cli");
    set.args(["-p", &p.to_string(), "set", "k", "installed"])
        .current_dir("/");
    by_name(&mut set, &libdir, &log);
    assert_eq!(run_ok(&mut set, "redis-cli set").trim(), "OK");

    // The installed launcher finds the installed library by itself, from any directory.
    let mut get = Command::new(prefix.join("bin/smcr"));
    get.args(["run", "--assume", "--log"])
        .arg(&log)
        .args(["--", "redis-cli", "-p", &p.to_string(), "get", "k"])
        .env("SMCR_NEGOTIATION", "assume")
        .env_remove("SMCR_LIB")
        .env_remove("SMCR_ROCE_PORT")
        .current_dir("/");
    assert_eq!(
        run_ok(&mut get, "smcr run redis-cli get").trim(),
        "installed"
    );
    drop(_server);

    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let smcr = |what: &str| {
        text.lines()
            .filter(|l| l.contains(&format!(" {what} Some(")) && l.contains("): SMC-R"))
            .count()
    };
    assert_eq!(smcr("connect"), 2, "both clients SMC-R:\n{text}");
    assert_eq!(
        smcr("accept"),
        2,
        "both accepted connections SMC-R:\n{text}"
    );

    // The `log` facade's records reach the same file with their level (info by default).
    assert!(
        text.lines()
            .any(|l| l.contains("INFO link group") && l.contains("up (CONFIRM LINK done)")),
        "no link-up line:\n{text}"
    );

    // --keep-bpf: the machine's option program serves the other tests.
    run_ok(
        Command::new("bash")
            .arg(root.join("scripts/install.sh"))
            .args(["--uninstall", "--keep-bpf", "--no-ldconfig", "--prefix"])
            .arg(&prefix),
        "install.sh --uninstall",
    );
    let left = files_under(&prefix);
    assert!(left.is_empty() && !prefix.exists(), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&top);
}

/// `scripts/deb.sh` packages the same files under /usr, stripped, with maintainer scripts
/// that run ldconfig and remove the BPF programs on removal; the package's library, taken out
/// with `dpkg-deb -x`, preloaded by name, carries redis over SMC-R, and its `smcr` runs.
/// (Not installed with dpkg here: its prerm would remove the BPF programs other tests use.)
#[test]
fn the_debian_package_holds_a_working_install() {
    if !have("dpkg-deb") || !have("redis-server") || !have("redis-cli") {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let top = std::env::temp_dir().join(format!("smcr-deb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&top);
    std::fs::create_dir_all(&top).unwrap();
    let from = smcr_bin().parent().unwrap().to_path_buf();
    let out = run_ok(
        Command::new("bash")
            .arg(root.join("scripts/deb.sh"))
            .arg("--from")
            .arg(&from)
            .arg("--lib")
            .arg(lib())
            .arg("--out")
            .arg(&top),
        "deb.sh",
    );
    let deb = PathBuf::from(out.trim());
    assert!(deb.is_file(), "{out}");
    let info = run_ok(
        Command::new("dpkg-deb").arg("--info").arg(&deb),
        "dpkg-deb --info",
    );
    assert!(
        info.contains("Package: smcr") && info.contains("Depends: libc6"),
        "{info}"
    );
    let prerm = run_ok(
        Command::new("dpkg-deb")
            .arg("--info")
            .arg(&deb)
            .arg("prerm"),
        "dpkg-deb --info prerm",
    );
    assert!(prerm.contains("smcr bpf uninstall"), "{prerm}");
    let contents = run_ok(
        Command::new("dpkg-deb").arg("--contents").arg(&deb),
        "contents",
    );
    for f in [
        "./usr/lib/libsmcr.so",
        "./usr/bin/smcr",
        "./usr/bin/smc-stat",
        "./usr/share/man/man1/smcr-run.1.gz",
        "./usr/share/man/man1/smc-stat.1.gz",
        "./usr/share/bash-completion/completions/smcr",
        "./usr/share/doc/smcr/smcr.toml.example",
    ] {
        assert!(contents.contains(f), "{f} not in the package:\n{contents}");
    }
    assert!(!contents.contains("share/smcr/installed"), "{contents}");
    let x = top.join("root");
    run_ok(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&x),
        "dpkg-deb -x",
    );
    let v = run_ok(
        Command::new(x.join("usr/bin/smcr")).arg("--version"),
        "smcr --version",
    );
    assert!(v.starts_with("smcr "), "{v}");

    // The packaged library, by name, on both ends (127.0.0.1, the default RoCE port).
    let log = top.join("smcr.log");
    let p = port(27100);
    let libdir = x.join("usr/lib");
    let server = redis_by_name(p, &libdir, &log);
    let mut ping = Command::new("redis-cli");
    ping.args(["-p", &p.to_string(), "ping"]);
    by_name(&mut ping, &libdir, &log);
    assert_eq!(run_ok(&mut ping, "redis-cli ping").trim(), "PONG");
    drop(server);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.lines()
            .any(|l| l.contains(" connect Some(") && l.contains("): SMC-R")),
        "the packaged library did not run SMC-R:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&top);
}
