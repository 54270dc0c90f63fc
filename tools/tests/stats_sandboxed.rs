//! smc-stat sees the stats areas of sandboxed processes: one whose `/dev/shm` is a private
//! tmpfs in its own mount namespace (a systemd unit's `PrivateDevices=`), and one chrooted into
//! a directory without `/dev/shm` (haproxy's `chroot`), whose area has no file at all. Both are
//! found through `/proc/PID/fd` and shown with the pid this reader sees.

#[path = "../../smcr/tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use smcr::stats::{ANONYMOUS_NAME, Area};
use smcr_tools::view::Snapshot;

/// Run by `areas_of_sandboxed_processes_are_found` in a child that the test put in a sandbox
/// (a thread of the test harness cannot change the process's namespaces itself): makes an area
/// in the default directory (or without a file), prints its path and waits for stdin to close.
#[test]
#[ignore = "run as a child process by areas_of_sandboxed_processes_are_found"]
fn sandboxed_child() {
    if std::env::var_os("SMCR_TEST_SANDBOXED").is_none() {
        return;
    }
    let dir = std::path::Path::new(smcr::stats::DEFAULT_DIR);
    let area = Area::create_anywhere(dir, 8, 2).expect("an area, with or without a file");
    println!("AREA {}", area.path().display());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The child, its area's path, and its output (kept open until the end).
type Sandboxed = (
    std::process::Child,
    String,
    BufReader<std::process::ChildStdout>,
);

/// Starts [`sandboxed_child`] under `script` (`sh -c`, `$0` the test binary, `$@` its
/// arguments), in a mount namespace of its own.
fn sandboxed(what: &str, script: &str) -> Sandboxed {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-ec", script])
        .arg(&exe)
        .args(["--exact", "sandboxed_child", "--ignored", "--nocapture"])
        .env("SMCR_TEST_SANDBOXED", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while out.read_line(&mut line).unwrap() > 0 {
        if let Some(p) = line.trim().strip_prefix("AREA ") {
            return (child, p.to_owned(), out);
        }
        line.clear();
    }
    let _ = child.wait();
    panic!("the {what} child made no area");
}

#[test]
fn areas_of_sandboxed_processes_are_found() {
    if !common::privileged("stats areas in other mount namespaces") {
        return;
    }
    // A private tmpfs on /dev/shm (PrivateDevices=); and a jail with only /usr in it, entered
    // as nobody (haproxy's chroot and user): no /dev/shm there, and none it could make.
    let jail = std::env::temp_dir().join(format!("smcr-jail-{}", std::process::id()));
    std::fs::create_dir_all(jail.join("usr")).unwrap();
    for l in ["lib", "lib64", "bin"] {
        let _ = std::os::unix::fs::symlink(format!("usr/{l}"), jail.join(l));
    }
    std::fs::write(jail.join("child"), b"").unwrap();
    let (mut shm, shm_path, _shm_out) = sandboxed(
        "private /dev/shm",
        r#"mount -t tmpfs tmpfs /dev/shm; exec "$0" "$@""#,
    );
    let (mut jail_child, jail_path, _jail_out) = sandboxed(
        "chroot",
        &format!(
            r#"mount --bind -o ro /usr {j}/usr; mount --bind "$0" {j}/child; exec chroot --userspec=65534:65534 {j} /child "$@""#,
            j = jail.display()
        ),
    );
    let jail_pid = jail_child.id();
    // The private /dev/shm's file is not in ours; the chrooted one has no file.
    assert!(shm_path.starts_with(smcr::stats::DEFAULT_DIR), "{shm_path}");
    assert!(
        !std::path::Path::new(&shm_path).exists(),
        "{shm_path} is in our /dev/shm"
    );
    assert_eq!(jail_path, ANONYMOUS_NAME);

    let s = Snapshot::collect(std::path::Path::new(smcr::stats::DEFAULT_DIR), None);
    // The pids are unshare's, which execs sh, which execs the child.
    for (pid, what) in [(shm.id(), "private /dev/shm"), (jail_pid, "chroot")] {
        let found: Vec<_> = s.procs.iter().filter(|p| p.pid == pid).collect();
        assert_eq!(found.len(), 1, "{what}: pid {pid} not shown once");
        assert!(!found[0].comm.is_empty(), "{what}: no command name");
    }
    // Asked for by pid, too.
    let one = Snapshot::collect(
        std::path::Path::new(smcr::stats::DEFAULT_DIR),
        Some(jail_pid),
    );
    assert_eq!(one.procs.len(), 1);
    assert_eq!(one.procs[0].pid, jail_pid);

    for c in [&mut shm, &mut jail_child] {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    // Gone with their processes.
    std::thread::sleep(Duration::from_millis(50));
    let after = Snapshot::collect(std::path::Path::new(smcr::stats::DEFAULT_DIR), None);
    assert!(
        !after
            .procs
            .iter()
            .any(|p| p.pid == shm.id() || p.pid == jail_pid)
    );
    let _ = std::fs::remove_dir_all(&jail);
}
