//! Linux TCP socket semantics on SMC-R sockets under `LD_PRELOAD=libsmcr_preload.so`: an
//! unmodified Python program (`tests/py/semantics.py`, standard library only) checks partial
//! reads, MSG_PEEK, MSG_WAITALL, MSG_DONTWAIT and non-blocking sockets, SO_RCVTIMEO and
//! SO_SNDTIMEO, FIONREAD, EOF and half-close, resets, EPIPE and SIGPIPE, SO_ERROR, addresses
//! and options, threads sharing a socket, scatter/gather I/O, and accept (connections
//! negotiated before the program accepts, addresses, flags, EAGAIN, EINTR, shutdown). Both ends of every connection
//! live in the one Python process (server on 127.0.0.2, client from 127.0.0.1; the shim's engine
//! serves both addresses).
//!
//! Each test runs one group of checks twice: plainly first (kernel TCP: the expectations are
//! Linux's, a failure there means the script is wrong), then under the shim, where the same
//! checks must pass and the log must show that every connection was SMC-R at both ends.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one run of a group may take before it is killed (a hang is a failure).
const RUN_LIMIT: Duration = Duration::from_secs(120);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/semantics.py")
}

/// The TCP port of group `idx` (each group its own, so that groups run in parallel; the plain
/// and the shimmed run of a group take turns on it): in `common::port(29000)`'s range, 32 per
/// test process.
fn tcp_port(idx: u16) -> u16 {
    assert!(idx < 32);
    29000 + (std::process::id() % 250) as u16 * 32 + idx
}

/// The engine's UDP port for group `idx`'s shimmed run (one engine per process).
fn roce_port(idx: u16) -> u16 {
    assert!(idx < 32);
    33000 + (std::process::id() % 250) as u16 * 32 + idx
}

struct Run {
    ok: bool,
    out: String,
    secs: f64,
}

/// Runs the script's `group`, plainly or under the shim (with `log`), killed after
/// [`RUN_LIMIT`].
fn run(group: &str, idx: u16, shim: Option<&Path>) -> Run {
    let tag = format!(
        "smcr-sem-{}-{group}-{}",
        std::process::id(),
        if shim.is_some() { "shim" } else { "plain" }
    );
    let tmp = std::env::temp_dir();
    let (out_path, err_path) = (
        tmp.join(format!("{tag}.out")),
        tmp.join(format!("{tag}.err")),
    );
    let mut c = Command::new("python3");
    c.arg(script())
        .arg(group)
        .arg(tcp_port(idx).to_string())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    if let Some(log) = shim {
        c.env("LD_PRELOAD", common::lib())
            .env("SMCR_NEGOTIATION", "assume")
            .env("SMCR_LOG", log)
            .env("SMCR_ROCE_PORT", roce_port(idx).to_string())
            // A small RMB: "fill the connection" takes a few kilobytes.
            .env("SMCR_RMB_KIB", "16");
        if group == "accept" {
            // A thread blocked in accept gets a connect of its own process before the
            // connect's entry is in (debug builds: the tests' `ci` profile).
            c.env("SMCR_DEBUG_CONNECT_PAUSE_MS", "30");
        }
    }
    let start = Instant::now();
    let mut child = c.spawn().unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let secs = start.elapsed().as_secs_f64();
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    let ok = status.is_some_and(|s| s.success()) && out.contains(&format!("OK semantics {group}"));
    let mut out = format!("{out}{err}");
    if status.is_none() {
        out.push_str(&format!("\n(killed after {} s)", RUN_LIMIT.as_secs()));
    }
    Run { ok, out, secs }
}

/// The number of connections the script made (its last line says).
fn conns(out: &str) -> usize {
    out.lines()
        .find_map(|l| l.strip_prefix("OK semantics ")?.split("conns=").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .expect("the script reports its connections")
}

/// Group `group` passes plainly (the expectations are Linux TCP's), then under the shim with
/// every connection SMC-R at both ends.
fn check(group: &str, idx: u16) {
    if !common::have("python3") {
        return;
    }
    let plain = run(group, idx, None);
    assert!(
        plain.ok,
        "plain TCP does not meet the script's expectations (fix the script):\n{}",
        plain.out
    );
    let log = std::env::temp_dir().join(format!("smcr-sem-{}-{group}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let shim = run(group, idx, Some(&log));
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    eprintln!(
        "{group}: plain {:.1} s, shim {:.1} s",
        plain.secs, shim.secs
    );
    // The failing step first, then the whole story.
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
    let n = conns(&plain.out);
    assert_eq!(n, conns(&shim.out), "both runs make the same connections");
    // A connection whose server side was never used is never negotiated; the process's exit
    // closes it (logged as closed before it was settled).
    common::assert_smcr_settled(&logged, n);
}

/// Check 1: recv(n) with less data there returns what is there; a blocking recv waits.
#[test]
fn partial_reads() {
    check("partial", 0);
}

/// Check 2: MSG_PEEK returns data without consuming it.
#[test]
fn msg_peek() {
    check("peek", 1);
}

/// Check 3: MSG_WAITALL waits for the full length (short only at EOF).
#[test]
fn msg_waitall() {
    check("waitall", 2);
}

/// Check 4a: MSG_DONTWAIT on a blocking socket and recv on a non-blocking one fail with EAGAIN.
#[test]
fn msg_dontwait_and_nonblocking_recv() {
    check("dontwait", 3);
}

/// Check 4b: non-blocking sends until EAGAIN lose no byte.
#[test]
fn nonblocking_send_until_eagain_loses_nothing() {
    check("nonblock_send", 4);
}

/// Check 5a: SO_RCVTIMEO.
#[test]
fn so_rcvtimeo() {
    check("rcvtimeo", 5);
}

/// Check 5b: SO_SNDTIMEO on a full connection.
#[test]
fn so_sndtimeo() {
    check("sndtimeo", 6);
}

/// Check 6: FIONREAD.
#[test]
fn fionread() {
    check("fionread", 7);
}

/// Check 7a: EOF after the peer's SHUT_WR, repeatedly; half-close.
#[test]
fn eof_and_half_close() {
    check("eof", 8);
}

/// Check 7b: after our own SHUT_WR the peer reads EOF, our sends fail with EPIPE, we still
/// receive.
#[test]
fn own_shut_wr() {
    check("shut_wr", 19);
}

/// Check 7c: after our own SHUT_RD reads return EOF at once; we still send.
#[test]
fn own_shut_rd() {
    check("shut_rd", 20);
}

/// Check 7d: after our own SHUT_RDWR: EOF at both ends, EPIPE on send.
#[test]
fn own_shut_rdwr() {
    check("shut_rdwr", 21);
}

/// Check 8a: the peer closed with unread data: ECONNRESET, then EPIPE.
#[test]
fn reset_by_close_with_unread_data() {
    check("reset", 9);
}

/// Check 8b: the peer closed with SO_LINGER {1, 0}: ECONNRESET, then EPIPE.
#[test]
fn reset_by_close_with_linger_zero() {
    check("reset_linger", 16);
}

/// Check 8c: a reset is reported once (by recv or SO_ERROR); reads then give EOF.
#[test]
fn reset_is_reported_once() {
    check("reset_once", 17);
}

/// Check 8d: the first send after a reset reports ECONNRESET, the next EPIPE.
#[test]
fn send_after_reset() {
    check("reset_send", 18);
}

/// Check 8e: EPIPE after the peer closed, SIGPIPE unless MSG_NOSIGNAL.
#[test]
fn epipe_and_sigpipe() {
    check("epipe", 10);
}

/// Check 9: SO_ERROR.
#[test]
fn so_error() {
    check("so_error", 11);
}

/// Check 10: addresses and options.
#[test]
fn names_and_options() {
    check("names", 12);
}

/// Check 11: one socket shared by a sending and a receiving thread, another socket in use by
/// a third thread.
#[test]
fn threads_share_a_socket() {
    check("threads", 13);
}

/// Check 12: sendmsg/recvmsg with several buffers, readv/writev.
#[test]
fn scatter_gather() {
    check("vectors", 14);
}

/// Blocking send/write/sendmsg of 1 MiB return 1 MiB, as Linux TCP's do.
#[test]
fn blocking_sends_are_complete() {
    check("blocking_send", 15);
}

/// Check 14: accept — connections are negotiated before the program accepts them, each comes
/// with its peer's address (cut to the caller's buffer), SOCK_CLOEXEC, EAGAIN when non-blocking,
/// a signal interrupts a blocking accept, listen() again, shutdown() wakes a blocked accept.
#[test]
fn accept() {
    check("accept", 16);
}

/// Check 15: the accepted socket's first call (which settles the server's side under the shim)
/// is shutdown (each way), dup2 or dup with the original closed, or a non-blocking recv: TCP's
/// results, and every connection SMC-R.
#[test]
fn first_use_of_an_accepted_socket() {
    check("first_use", 17);
}
