//! Readiness of SMC-R sockets under `LD_PRELOAD=libsmcr_preload.so`, "mio style": an
//! unmodified Python program (`tests/py/readiness.py`, standard library only) drives epoll
//! (level- and edge-triggered, one-shot, several sets), poll and select over connections whose
//! two ends live in the one process, and after every step checks that the expected events
//! arrive and no others do. Each test runs one group of checks twice: plainly first (the
//! expectations are what Linux TCP gives; a failure there means the script is wrong), then
//! under the shim, where the log must show that every connection was SMC-R.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use common::lib;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/readiness.py")
}

static NEXT: AtomicU16 = AtomicU16::new(0);

/// An engine UDP port of this test's own (tests run in parallel, each process with its own
/// engine on the same loopback addresses).
fn roce_port() -> u16 {
    24000 + (std::process::id() % 500) as u16 * 16 + NEXT.fetch_add(1, Ordering::Relaxed) % 16
}

fn python3() -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP: python3 is not installed");
    }
    ok
}

struct Run {
    ok: bool,
    out: String,
}

/// Runs the script's `group`, plainly or under the shim (with `log`, an engine port and the
/// settings `env`), killed after a minute.
fn run(group: &str, shim: Option<&Path>, env: &[(&str, &str)]) -> Run {
    let tmp = std::env::temp_dir();
    let tag = format!(
        "smcr-ready-{}-{group}-{}{}",
        std::process::id(),
        if shim.is_some() { "shim" } else { "plain" },
        settings_tag(env)
    );
    let (out_path, err_path) = (
        tmp.join(format!("{tag}.out")),
        tmp.join(format!("{tag}.err")),
    );
    let mut c = Command::new("python3");
    c.arg(script())
        .arg(group)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    if let Some(log) = shim {
        c.env("LD_PRELOAD", lib())
            .env("SMCR_NEGOTIATION", "assume")
            .env("SMCR_LOG", log)
            .env("SMCR_ROCE_PORT", roce_port().to_string())
            .env("SMCR_RMB_KIB", "16")
            .envs(env.iter().copied());
    }
    let mut child = c.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    let ok = status.is_some_and(|s| s.success()) && out.contains("OK readiness");
    let mut out = format!("{out}{err}");
    if status.is_none() {
        out.push_str("\n(killed after 60 s)");
    }
    Run { ok, out }
}

/// The group passes plainly (the expectations are Linux TCP's), then under the shim with
/// `conns` connections SMC-R at both ends (others, never used, closed before they were
/// settled).
fn check(group: &str, conns: usize) {
    check_with(group, conns, &[]);
}

/// Names a run's files after its settings (tests with other settings run the same groups at
/// the same time).
fn settings_tag(env: &[(&str, &str)]) -> String {
    env.iter().map(|(k, v)| format!("-{k}={v}")).collect()
}

/// [`check`] with the settings `env` under the shim.
fn check_with(group: &str, conns: usize, env: &[(&str, &str)]) {
    if !python3() {
        return;
    }
    // (The settings apply under the shim only; they name the files.)
    let plain = run(group, None, env);
    assert!(
        plain.ok,
        "plain TCP does not meet the script's expectations (fix the script):\n{}",
        plain.out
    );
    let log = std::env::temp_dir().join(format!(
        "smcr-ready-{}-{group}{}.log",
        std::process::id(),
        settings_tag(env)
    ));
    let _ = std::fs::remove_file(&log);
    let shim = run(group, Some(&log), env);
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    // The failing step, first, then the whole story.
    let failed = shim
        .out
        .lines()
        .find(|l| l.starts_with("FAIL"))
        .unwrap_or("(no FAIL line)");
    assert!(
        shim.ok,
        "under the shim: {failed}\n--- script output:\n{}\n--- shim log:\n{logged}",
        shim.out
    );
    common::assert_smcr_settled(&logged, conns);
}

/// Check 1: Level-triggered: EPOLLIN while data is unread, repeatedly, gone once all is
/// read, and EPOLLOUT on a connected socket.
#[test]
fn epoll_level_triggered() {
    check("level", 1);
}

/// Check 2: Edge-triggered: one event per arrival, also while older data is still unread.
#[test]
fn epoll_edge_triggered() {
    check("edge", 1);
}

/// Check 3: EPOLLONESHOT: one event, then nothing until EPOLL_CTL_MOD re-arms.
#[test]
fn epoll_oneshot() {
    check("oneshot", 1);
}

/// Check 4a: The peer's shutdown(SHUT_WR): EPOLLIN|EPOLLRDHUP, read gives EOF; both directions
/// shut: EPOLLHUP.
#[test]
fn peer_shutdown_write() {
    check("shutdown", 1);
}

/// Check 4b: The peer's close (nothing unread on its side).
#[test]
fn peer_close() {
    check("close", 1);
}

/// Check 4c: The peer closes with data it never read: Linux TCP resets (EPOLLERR, ECONNRESET).
#[test]
fn peer_close_with_unread_data() {
    check("reset", 1);
}

/// Check 5: A full connection (16 KiB RMB) is not writable; EPOLLOUT (level and edge) once the
/// reader drains, and a send then succeeds.
#[test]
fn epollout_after_the_reader_frees_space() {
    check("writable", 1);
}

/// Check 6: Several epoll sets on one descriptor all get its events.
#[test]
fn several_epoll_sets() {
    check("multi", 1);
}

/// Check 7: A closed SMC-R socket's number reused by a new socket: nothing of the old connection
/// (its peer's writes, shutdown, close) shows on the new one.
#[test]
fn reused_descriptor_number_gets_no_stale_events() {
    check("reuse", 2);
}

/// Check 8: poll() and select() agree with epoll (in, out, full, half-closed, hung up).
#[test]
fn poll_and_select_agree_with_epoll() {
    check("pollselect", 1);
}

/// Check 9: A listener: readable only while a connection waits for accept, an edge per connection.
#[test]
fn listener_readiness() {
    // (The second and third connections are never used: a process negotiates its side of a
    // connection to its own listener when it accepts it.)
    check("listener", 3);
}

/// Check 10: Non-blocking connect: writable only once connected (SO_ERROR 0, data flows), through
/// epoll, poll and select; a refused connect reports the error.
#[test]
fn nonblocking_connect() {
    check("connect", 3);
}

/// Check 11: readiness asked for first (poll, select) long after it changed — data, a full
/// and a drained connection, a reset collected by recv before anything looked.
#[test]
fn readiness_first_asked_after_it_changed() {
    check("unwatched", 1);
}

/// Check 12: EEXIST/ENOENT, a set nested in another set and polled, a registration and a
/// shutdown by another thread while one sleeps in epoll_wait, poll or select, five ready
/// sockets served one per call.
#[test]
fn epoll_sets_in_use() {
    check("sets", 9);
}

/// Every group again with `SMCR_APP_DRIVE=off`: the link groups' pollers handle every message
/// and our epoll, poll and select still answer for the sockets, woken by the sockets' changes.
/// Its `writable` group fills a connect that is still settling (64 KiB staged, which then wait
/// for the reader) and checks that a send right after EPOLLOUT succeeds.
#[test]
fn every_group_with_the_pollers_alone() {
    for (group, conns) in GROUPS {
        check_with(group, conns, &[("SMCR_APP_DRIVE", "off")]);
    }
}

/// Every group again with `SMCR_VIRTUAL_EPOLL=off`: the kernel's epoll sets hold the
/// registrations, on each connection's pair (a connection still being settled shows its pair
/// too, not its TCP socket with the peer's CLC messages unread).
#[test]
fn every_group_with_kernel_epoll_sets() {
    for (group, conns) in GROUPS {
        check_with(group, conns, &[("SMCR_VIRTUAL_EPOLL", "off")]);
    }
}

/// The groups and their connections, as the tests above check them.
const GROUPS: [(&str, usize); 14] = [
    ("level", 1),
    ("edge", 1),
    ("oneshot", 1),
    ("shutdown", 1),
    ("close", 1),
    ("reset", 1),
    ("writable", 1),
    ("multi", 1),
    ("reuse", 2),
    ("pollselect", 1),
    ("listener", 3),
    ("connect", 3),
    ("unwatched", 1),
    ("sets", 9),
];
