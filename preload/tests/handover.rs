//! Sockets that change hands keep working and keep SMC-R (issue 36): descriptors passed over
//! Unix sockets (SCM_RIGHTS), listeners inherited across `exec`, and listeners or connections
//! handed down by an activator (`systemd-socket-activate`) to a program with or without the
//! library.
//!
//! Programs: `tests/c/handover.c` (a primary that passes each accepted connection, its
//! listener, or a connection it has already used, to forked workers over socketpairs; a
//! listener exec'd into a new image; a server on systemd's fd 3; a client that holds N
//! connections, checks every answer byte for byte and waits for the test before closing),
//! Debian's `systemd-socket-activate`, and Node.js's `cluster` module in its default
//! round-robin mode (`tests/js/cluster.js`) with wrk.
//!
//! Every scenario runs twice, in the distribution-like harness of `distro.rs`
//! (`distro/harness.rs`: programs as `nobody`, `ulimit -n 1024`, a clean environment, the
//! option program at its default pins, a shim log per program): `baseline::*` over plain
//! TCP, and `over_smcr::*` under the shim, where every request must succeed by the programs'
//! own account and the connections must be SMC-R where both ends run smcr — the servers'
//! shim log lines (`): SMC-R`, from the process that should have negotiated), the clients'
//! (`connect …: SMC-R`), `smc-stat --json` (the servers' totals and rows) and the servers'
//! TCP sockets (`ss -ti`: at most the CLC handshake) — or TCP with a reason code where the
//! issue says TCP (a child started without the library). Every program is bounded in time
//! (the C programs end themselves after 90 s, and each socket operation after 10 s; the test
//! kills what outlives its timeouts), so a hang is a failure within seconds. All need root
//! (users, the option program): they skip without it (fail under SMCR_REQUIRE_TOOLS=1).

mod common;
#[path = "distro/harness.rs"]
mod harness;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use harness::{Finished, Net, Proc, User, Verdict, World};

/// Ports: `common::port(BASE)` (64 per test process).
const BASE: u16 = 2500;

/// Connections per run, all open at once.
const CONNS: u32 = 20;
/// Bytes per message; a connection carries `msgs` of them each way.
const SIZE: u32 = 128 * 1024;
/// Connections at once to `systemd-socket-activate --accept`: each runs its own CMD process,
/// so each is a link group of its own, whose descriptors the client holds (with 20, under
/// `ulimit -n 1024`, some stay TCP with NOFD or are declined for memory: not this test's
/// subject).
const ACCEPT_CONNS: u32 = 10;
/// How long a client may take to have every answer (each socket operation of the C client
/// gives up after 10 s).
const CLIENT_WAIT: Duration = Duration::from_secs(40);
/// How long a server may take to end once its clients closed.
const SERVER_WAIT: Duration = Duration::from_secs(20);

/// `tests/c/handover.c`, built once per test process (tests run in parallel; one output
/// file).
fn program() -> Option<PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| common::build_c("handover", &["-O2", "-pthread", "-Wall"]))
        .clone()
}

fn nobody() -> User {
    User::or_nobody("nobody")
}

// ---------------------------------------------------------------------------------------
// Reading what the programs said.

/// Lines of program `name`'s shim log with the pid that wrote each (`smcr[PID]: …`).
fn log_lines(w: &World, name: &str) -> Vec<(u32, String)> {
    std::fs::read_to_string(w.log_path(name))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let pid = l
                .strip_prefix("smcr[")
                .and_then(|r| r.split_once(']'))
                .and_then(|(p, _)| p.parse().ok())
                .unwrap_or(0);
            (pid, l.to_owned())
        })
        .collect()
}

/// `): SMC-R` lines of a log per pid.
fn smcr_by_pid(lines: &[(u32, String)]) -> BTreeMap<u32, usize> {
    let mut m = BTreeMap::new();
    for (pid, l) in lines {
        if l.contains("): SMC-R") {
            *m.entry(*pid).or_insert(0) += 1;
        }
    }
    m
}

/// The pids a program printed after `tag` (`WORKER 123` → 123), each once.
fn pids_after(out: &str, tag: &str) -> Vec<u32> {
    let mut v: Vec<u32> = out
        .lines()
        .filter_map(|l| l.strip_prefix(tag)?.split_whitespace().next()?.parse().ok())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The lines of `text` that contain `what`, at most `n`.
fn grep(text: &str, what: &str, n: usize) -> String {
    let v: Vec<&str> = text.lines().filter(|l| l.contains(what)).collect();
    let more = v.len().saturating_sub(n);
    let mut s = v[..v.len().min(n)].join("\n");
    if more > 0 {
        s.push_str(&format!("\n… and {more} more"));
    }
    s
}

/// Waits until `p` printed `text` on stdout; false if it exited or `timeout` passed first.
fn wait_text(p: &mut Proc, text: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if p.stdout().contains(text) {
            return true;
        }
        if !p.alive() || Instant::now() > deadline {
            return p.stdout().contains(text);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Everything a failure message shows: the programs' outputs (their error lines) and the
/// shim logs' summary.
fn context(w: &World, procs: &[(&str, &str)]) -> String {
    let mut s = format!("[{}]", w.mode());
    for (name, out) in procs {
        let rest: Vec<&str> = out.lines().filter(|l| !l.contains("ERROR")).collect();
        s.push_str(&format!(
            "\n--- {name} (errors, then the last other lines):\n{}\n…\n{}",
            grep(out, "ERROR", 8),
            harness::tail(&rest.join("\n"), 6)
        ));
    }
    s.push('\n');
    s.push_str(&w.log_summary());
    s
}

// ---------------------------------------------------------------------------------------
// Running a server with the holding client.

/// What a run left.
struct Ran {
    client: Finished,
    /// Sampled while every connection was open (`None` when the client never got there).
    verdict: Option<Verdict>,
    /// The server's output once it ended (or was killed at `SERVER_WAIT`).
    server: Finished,
}

impl Ran {
    fn context(&self, w: &World) -> String {
        context(
            w,
            &[
                (&self.client.name, &self.client.stdout),
                (&self.server.name, &self.server.stdout),
            ],
        )
    }

    /// The client had every answer intact, and the server ended on its own, with no error.
    fn assert_served(&self, w: &World, n: u32) {
        let ctx = self.context(w);
        assert!(
            self.client.ok() && self.client.stdout.contains(&format!("OK {n}")),
            "{}: not every connection got its answers ({}):\n{ctx}",
            self.client.name,
            self.client.first_error()
        );
        assert!(
            self.server.ok() && !self.server.stdout.contains("ERROR"),
            "{}: the server failed ({}):\n{ctx}",
            self.server.name,
            match self.server.status {
                None => "did not end: killed".to_owned(),
                Some(s) => s.to_string(),
            }
        );
    }

    fn verdict(&self, w: &World) -> &Verdict {
        self.verdict.as_ref().unwrap_or_else(|| {
            panic!(
                "no sample: the client never had its answers\n{}",
                self.context(w)
            )
        })
    }
}

/// The C client `name` as nobody: `n` connections at once to 127.0.0.1:`port`, `msgs`
/// messages each; once every answer is in (or it gave up), the sockets of `servers` are
/// sampled (smc-stat, ss) while it holds its connections, then it closes them.
fn hold_client(
    w: &World,
    name: &str,
    port: u16,
    n: u32,
    msgs: u32,
    servers: &[&Proc],
) -> (Finished, Option<Verdict>) {
    let bin = program().unwrap();
    let mut client = w.spawn(
        &w.spec(name).user(&nobody()).stdin(),
        bin.to_str().unwrap(),
        &[
            "client",
            "127.0.0.1",
            &port.to_string(),
            &n.to_string(),
            &SIZE.to_string(),
            &msgs.to_string(),
        ],
    );
    let verdict = wait_text(&mut client, "ECHOED", CLIENT_WAIT).then(|| {
        let seen = w.snapshot(&Net::Host, &[port]);
        w.verdict(&seen, servers)
    });
    client.write_stdin("done\n");
    client.close_stdin();
    (client.finish(Duration::from_secs(10)), verdict)
}

/// `handover ARGS` as nobody (it listens on `port`), then the holding client.
fn c_run(w: &World, args: &[&str], port: u16, msgs: u32) -> Ran {
    c_run_with(w, args, &[], port, msgs)
}

/// [`c_run`] with `env` added to the server's environment.
fn c_run_with(w: &World, args: &[&str], env: &[(&str, &str)], port: u16, msgs: u32) -> Ran {
    let bin = program().unwrap();
    let mut spec = w.spec("server").user(&nobody());
    spec.env
        .extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let mut server = w.spawn(&spec, bin.to_str().unwrap(), args);
    assert!(
        wait_text(&mut server, "READY", Duration::from_secs(20)),
        "the server did not get ready:\n{}",
        context(w, &[("server", &server.stdout())])
    );
    w.wait_listening(&Net::Host, port, &mut server);
    let (client, verdict) = hold_client(w, "client", port, CONNS, msgs, &[&server]);
    let server = server.finish(SERVER_WAIT);
    Ran {
        client,
        verdict,
        server,
    }
}

/// Over the shim: every connect of `client`'s log was SMC-R (exactly `n`), the server's log
/// has at least `n` SMC-R lines written by `pids` (the processes that should negotiate), and
/// smc-stat and ss agree (the server group's totals SMC-R only, payload not on TCP).
fn assert_smcr_in(w: &World, r: &Ran, client: &str, pids: &[u32], n: u32) {
    let ctx = r.context(w);
    let server_log = log_lines(w, "server");
    let by_pid = smcr_by_pid(&server_log);
    let in_pids: usize = pids
        .iter()
        .map(|p| by_pid.get(p).copied().unwrap_or(0))
        .sum();
    assert!(
        in_pids >= n as usize,
        "{in_pids} SMC-R lines in the server's log from {pids:?} (expected {n}); per pid: {by_pid:?}\n{ctx}"
    );
    let connects: Vec<String> = log_lines(w, client)
        .into_iter()
        .map(|(_, l)| l)
        .filter(|l| l.contains(" connect Some("))
        .collect();
    let smcr = connects.iter().filter(|l| l.contains("): SMC-R")).count();
    assert_eq!(
        (smcr, connects.len()),
        (n as usize, n as usize),
        "{client}: {smcr} of {} connects SMC-R (expected {n}):\n{}\n{ctx}",
        connects.len(),
        harness::head(&connects.join("\n"), 8)
    );
    let v = r.verdict(w);
    v.assert_all_smcr(u64::from(n));
    let counted: u64 = pids
        .iter()
        .map(|p| v.servers[0].by_pid.get(p).copied().unwrap_or(0))
        .sum();
    assert!(
        counted >= u64::from(n),
        "smc-stat counts {counted} SMC-R connections in {pids:?} (expected {n}): {:?}\n{}",
        v.servers[0].by_pid,
        v.summary()
    );
}

/// Over plain TCP: every answer, and the server sockets carried the payload.
fn assert_baseline(w: &World, r: &Ran, n: u32) {
    r.assert_served(w, n);
    r.verdict(w).assert_tcp_baseline(n as usize);
}

// ---------------------------------------------------------------------------------------
// Scenarios of tests/c/handover.c (`shim`: under the shim, else the plain TCP baseline).

/// 1. The primary accepts each connection and sends it to one of 2 forked workers over a
///    socketpair (SCM_RIGHTS), closing its copy once sent; the workers echo. 20 clients at
///    once, 2 messages of 128 KiB each. Under the shim: SMC-R, negotiated in the workers.
fn connections_passed_to_workers(shim: bool) {
    let Some(w) = World::new("ho-conn", shim, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let r = c_run(
        &w,
        &["conn", &port.to_string(), &CONNS.to_string(), "2"],
        port,
        2,
    );
    if !shim {
        return assert_baseline(&w, &r, CONNS);
    }
    r.assert_served(&w, CONNS);
    let workers = pids_after(&r.server.stdout, "WORKER ");
    assert_eq!(workers.len(), 2, "{}", r.context(&w));
    assert_smcr_in(&w, &r, "client", &workers, CONNS);
}

/// 1b and 2b. As 1 and 2, but the workers do not run the library (exec'd without
///    LD_PRELOAD): before the primary sends a socket to such a process it is made plain TCP —
///    an accepted connection declined (the clients: TCP, peer declined), the listener quiet
///    (the clients: TCP, PEERNOSMC). Every echo intact; the primary's log names HANDOFF.
///    `exec_delay_ms`: each worker waits that long between its fork and its exec, so the
///    primary sends to a child that still runs the library's image and is about to drop it.
fn passed_to_workers_without_the_library(listener: bool, exec_delay_ms: u32) {
    let tag = match (listener, exec_delay_ms) {
        (true, 0) => "ho-plain-l",
        (true, _) => "ho-plain-ld",
        (false, _) => "ho-plain-c",
    };
    let Some(w) = World::new(tag, true, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let (mode, n) = if listener {
        ("listener", vec![port.to_string(), CONNS.to_string()])
    } else {
        (
            "conn",
            vec![port.to_string(), CONNS.to_string(), "2".into()],
        )
    };
    let mut args = vec![mode];
    args.extend(n.iter().map(String::as_str));
    let delay = exec_delay_ms.to_string();
    let env = [
        ("HANDOVER_PLAIN_WORKERS", "1"),
        ("HANDOVER_EXEC_DELAY_MS", delay.as_str()),
    ];
    let r = c_run_with(&w, &args, &env, port, 2);
    r.assert_served(&w, CONNS);
    let ctx = r.context(&w);
    let connects: Vec<String> = log_lines(&w, "client")
        .into_iter()
        .map(|(_, l)| l)
        .filter(|l| l.contains(" connect Some("))
        .collect();
    let want = if listener {
        "TCP: peer did not offer SMC-R (PEERNOSMC"
    } else {
        "TCP: peer declined: MEM"
    };
    let tcp = connects.iter().filter(|l| l.contains(want)).count();
    assert_eq!(
        (tcp, connects.len()),
        (CONNS as usize, CONNS as usize),
        "{tcp} of {} connects '{want}':\n{}\n{ctx}",
        connects.len(),
        harness::head(&connects.join("\n"), 8)
    );
    let primary: Vec<String> = log_lines(&w, "server")
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    let said = if listener {
        "a listener going to process"
    } else {
        "an accepted connection going to process"
    };
    assert!(
        primary.iter().any(|l| l.contains(said)),
        "the primary's log does not say '{said}':\n{}\n{ctx}",
        harness::head(&primary.join("\n"), 8)
    );
}

/// 2. The primary listens and sends the listener to a forked worker (SCM_RIGHTS), closing
///    its copy; the worker accepts and echoes. Under the shim: SMC-R, negotiated in the
///    worker.
fn listener_passed_to_a_worker(shim: bool) {
    let Some(w) = World::new("ho-listener", shim, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let r = c_run(
        &w,
        &["listener", &port.to_string(), &CONNS.to_string()],
        port,
        2,
    );
    if !shim {
        return assert_baseline(&w, &r, CONNS);
    }
    r.assert_served(&w, CONNS);
    let workers = pids_after(&r.server.stdout, "WORKER ");
    assert_eq!(workers.len(), 1, "{}", r.context(&w));
    assert_smcr_in(&w, &r, "client", &workers, CONNS);
}

/// 3. The primary accepts, serves each connection's first message itself (so it is settled
///    in the primary), then sends the established connection to a worker, which serves the
///    two others. Under the shim the issue allows either SMC-R (served from the receiving
///    process, or the sender keeps serving) or TCP with a reason code; never a hang, EIO or
///    a reset: every answer must come, the log must say what became of the connections, and
///    the test prints which it was.
fn established_connection_passed_to_a_worker(shim: bool) {
    let Some(w) = World::new("ho-established", shim, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let r = c_run(
        &w,
        &["established", &port.to_string(), &CONNS.to_string(), "2"],
        port,
        3,
    );
    if !shim {
        return assert_baseline(&w, &r, CONNS);
    }
    let ctx = r.context(&w);
    for bad in ["EIO", "ECONNRESET", "EPIPE"] {
        for (who, out) in [("client", &r.client.stdout), ("server", &r.server.stdout)] {
            assert!(
                !out.contains(&format!("({bad})")),
                "the {who} saw {bad}:\n{ctx}"
            );
        }
    }
    r.assert_served(&w, CONNS);
    let v = r.verdict(&w);
    let server_log = log_lines(&w, "server");
    let payload_on_tcp = v
        .seen
        .tcp
        .values()
        .any(|b| b.received > harness::CLC_BYTES || b.acked > harness::CLC_BYTES);
    if payload_on_tcp {
        // TCP: each connection's reason is named, in smc-stat's rows or the server's log.
        let coded: Vec<&str> = server_log
            .iter()
            .map(|(_, l)| l.as_str())
            .filter(|l| l.contains("TCP:") && l.contains("[0x"))
            .collect();
        let rows = v.seen.peers("TCP").len();
        let reasons = v.seen.reasons();
        assert!(
            coded.len() >= CONNS as usize || (rows >= CONNS as usize && !reasons.is_empty()),
            "the payload went over TCP, but neither the server's log ({} lines with a reason code) nor smc-stat ({rows} TCP rows, reasons {reasons:?}) names why for each connection\n{}",
            coded.len(),
            v.summary()
        );
        assert!(
            reasons.keys().all(|r| !r.starts_with("(none)")),
            "TCP rows without a reason: {reasons:?}\n{}",
            v.summary()
        );
        eprintln!(
            "established connections handed over: TCP; reasons in smc-stat {reasons:?}; in the log:\n{}",
            harness::head(&coded.join("\n"), 4)
        );
    } else {
        // SMC-R: every connection was settled as SMC-R somewhere (the primary, which used
        // it first), and the payload after the hand-over did not travel on TCP either.
        let by_pid = smcr_by_pid(&server_log);
        let smcr: usize = by_pid.values().sum();
        assert!(
            smcr >= CONNS as usize,
            "{smcr} SMC-R lines in the server's log (expected {CONNS}): {by_pid:?}\n{ctx}"
        );
        v.assert_all_smcr(u64::from(CONNS));
        // The primary keeps serving them (the workers hold Unix sockets it relays).
        let relayed = server_log
            .iter()
            .filter(|(_, l)| l.contains("this process relays it"))
            .count();
        assert_eq!(
            relayed, CONNS as usize,
            "relays in the primary's log\n{ctx}"
        );
        let workers = pids_after(&r.server.stdout, "WORKER ");
        let lines: Vec<&str> = server_log
            .iter()
            .filter(|(p, _)| workers.contains(p))
            .map(|(_, l)| l.as_str())
            .collect();
        eprintln!(
            "established connections handed over: SMC-R; SMC-R lines per pid {by_pid:?} (workers {workers:?}); the workers' log lines:\n{}",
            harness::head(&lines.join("\n"), 6)
        );
    }
}

/// 4. The primary listens, moves the listener to fd 3 and execs a new image of the program
///    (`handover fd 3 N`), which accepts and echoes: SMC-R (this works today).
fn listener_inherited_across_exec(shim: bool) {
    let Some(w) = World::new("ho-exec", shim, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let r = c_run(
        &w,
        &["exec", &port.to_string(), &CONNS.to_string()],
        port,
        2,
    );
    if !shim {
        return assert_baseline(&w, &r, CONNS);
    }
    r.assert_served(&w, CONNS);
    // exec keeps the pid.
    let server = pids_after(&r.server.stdout, "SERVER ");
    assert_eq!(server.len(), 1, "{}", r.context(&w));
    assert_smcr_in(&w, &r, "client", &server, CONNS);
    // One stats area for the pid: the image before the exec removed its own (the new one's
    // stays after its end, as every process's does until it is found stale).
    let areas: Vec<String> = std::fs::read_dir(&w.stats)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("{}-", server[0])) && n.ends_with(".stats"))
        .collect();
    assert_eq!(areas.len(), 1, "areas of pid {}: {areas:?}", server[0]);
}

/// 4b. As 4, but the new image does not run the library: the primary execs it with `call`
///    (`execl`, `execle` with its own environment, or `execlp`: glibc's reach its internal
///    `__execve`, past the `execve` hook) without LD_PRELOAD and with LISTEN_FDS=1. The
///    listener goes quiet before the exec: every client TCP (PEERNOSMC), every echo intact
///    (an image that read a CLC Proposal as data would echo the wrong bytes).
fn listener_exec_without_the_library(call: &str) {
    let Some(w) = World::new(&format!("ho-{call}"), true, &[]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let port = common::port(BASE);
    let r = c_run_with(
        &w,
        &["exec", &port.to_string(), &CONNS.to_string()],
        &[("HANDOVER_PLAIN_EXEC", call)],
        port,
        2,
    );
    r.assert_served(&w, CONNS);
    let ctx = r.context(&w);
    let connects: Vec<String> = log_lines(&w, "client")
        .into_iter()
        .map(|(_, l)| l)
        .filter(|l| l.contains(" connect Some("))
        .collect();
    let want = "TCP: peer did not offer SMC-R (PEERNOSMC";
    let tcp = connects.iter().filter(|l| l.contains(want)).count();
    assert_eq!(
        (tcp, connects.len()),
        (CONNS as usize, CONNS as usize),
        "{call}: {tcp} of {} connects '{want}':\n{}\n{ctx}",
        connects.len(),
        harness::head(&connects.join("\n"), 8)
    );
    let primary: Vec<String> = log_lines(&w, "server")
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    let said = "a listener going to an exec without the library: quiet";
    assert!(
        primary.iter().any(|l| l.contains(said)),
        "{call}: the primary's log does not say '{said}':\n{}\n{ctx}",
        harness::head(&primary.join("\n"), 8)
    );
    // The primary's stats area went before the exec: the image without the library would
    // never update it, and it would look alive as long as the pid.
    let server = pids_after(&r.server.stdout, "PRIMARY ");
    let areas: Vec<String> = std::fs::read_dir(&w.stats)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("{}-", server[0])))
        .collect();
    assert!(
        areas.is_empty(),
        "{call}: areas of pid {}: {areas:?}",
        server[0]
    );
}

// ---------------------------------------------------------------------------------------
// systemd-socket-activate (systemd 252): without --accept it binds and listens on fd 3,
// waits (epoll) for the first connection, then execs CMD in its own process (same pid) with
// LISTEN_FDS=1 and LISTEN_PID; with --accept it accepts each connection itself, forks, moves
// the connection to fd 3 and execs CMD in the child. CMD's environment is built from scratch
// (PATH, HOME, TERM, LISTEN_*) plus the `-E NAME[=VALUE]` variables: LD_PRELOAD reaches CMD
// only when named with -E.

/// The activator (under the shim when the world is) on 127.0.0.1:`port` with CMD
/// `handover fd 3 N`; `preload_child`: CMD gets the library, its log and stats directory
/// (`-E`), else it runs without them.
fn socket_activate(w: &World, port: u16, accept: bool, preload_child: bool, n: u32) -> Proc {
    let bin = program().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let n = n.to_string();
    let mut args: Vec<&str> = vec!["-l", &listen];
    if accept {
        args.push("--accept");
    }
    if preload_child {
        args.extend(["-E", "LD_PRELOAD", "-E", "SMCR_LOG", "-E", "SMCR_STATS_DIR"]);
    }
    args.extend([bin.to_str().unwrap(), "fd", "3"]);
    args.push(if accept { "1" } else { &n });
    let mut sa = w.spawn(
        &w.spec("server").user(&nobody()),
        "systemd-socket-activate",
        &args,
    );
    w.wait_listening(&Net::Host, port, &mut sa);
    sa
}

/// What the activator's runs left: the clients (without --accept the first connection,
/// which starts CMD, then `CONNS` at once) and the activator's and CMD's output.
struct Activated {
    first: Option<Finished>,
    ran: Ran,
    /// Connections the client opened at once.
    n: u32,
}

/// Without --accept: one connection first (it starts CMD), then `CONNS` at once; with it,
/// `ACCEPT_CONNS` at once. Two messages of 128 KiB per connection.
fn activated_run(w: &World, accept: bool, preload_child: bool) -> Activated {
    let port = common::port(BASE);
    let n = if accept { ACCEPT_CONNS } else { CONNS };
    // Without --accept and without the library in CMD, the triggering connection reaches
    // CMD twice: once carrying the client's CLC Proposal (answered with the option before
    // the exec), then again, plain (the client connects anew when the answer is not CLC).
    let bogus = u32::from(w.shim && !accept && !preload_child);
    let total = if accept { n } else { n + 1 + bogus };
    let mut sa = socket_activate(w, port, accept, preload_child, total);
    let first = (!accept).then(|| {
        let (first, _) = hold_client(w, "first", port, 1, 2, &[&sa]);
        // CMD runs now (it says so), whatever became of the first connection.
        wait_text(&mut sa, "SERVER ", Duration::from_secs(10));
        first
    });
    let (client, verdict) = hold_client(w, "client", port, n, 2, &[&sa]);
    let server = if accept {
        // The activator runs until killed; its children (one CMD per connection) end once
        // the client closed, each saying what it served.
        let deadline = Instant::now() + SERVER_WAIT;
        let served = |sa: &Proc| sa.stdout().matches(" SERVED ").count() >= n as usize;
        while !served(&sa) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let ok = served(&sa);
        let (stdout, stderr) = (sa.stdout(), sa.stderr());
        drop(sa);
        Finished {
            name: "server".into(),
            // `None`: not every CMD ended by the deadline (the group is killed).
            status: ok.then(|| std::os::unix::process::ExitStatusExt::from_raw(0)),
            stdout,
            stderr,
        }
    } else {
        sa.finish(SERVER_WAIT)
    };
    Activated {
        first,
        n,
        ran: Ran {
            client,
            verdict,
            server,
        },
    }
}

impl Activated {
    fn context(&self, w: &World) -> String {
        let mut procs = Vec::new();
        if let Some(f) = &self.first {
            procs.push(("first (starts CMD)", f.stdout.as_str()));
        }
        procs.push(("client", &self.ran.client.stdout));
        procs.push(("systemd-socket-activate and CMD", &self.ran.server.stdout));
        context(w, &procs)
    }

    /// Every connection (the first one too) had its answers; CMD reported no error.
    fn assert_served(&self, w: &World) {
        let ctx = self.context(w);
        let first_ok = self
            .first
            .as_ref()
            .is_none_or(|f| f.ok() && f.stdout.contains("OK 1"));
        let n = self.n;
        let rest_ok = self.ran.client.ok() && self.ran.client.stdout.contains(&format!("OK {n}"));
        let first = match &self.first {
            None => String::new(),
            Some(_) if first_ok => "the first one (it starts CMD) did, ".into(),
            Some(_) => "the first one (it starts CMD) did NOT, ".into(),
        };
        assert!(
            first_ok && rest_ok,
            "not every connection got its answers: {first}the {n} at once {}:\n{ctx}",
            if rest_ok { "did" } else { "did NOT" },
        );
        assert!(
            self.ran.server.ok() && !self.ran.server.stdout.contains("ERROR"),
            "CMD failed:\n{ctx}"
        );
    }

    /// The client logs to look at: `first` (without --accept) and `client`.
    fn clients(&self) -> Vec<&'static str> {
        if self.first.is_some() {
            vec!["first", "client"]
        } else {
            vec!["client"]
        }
    }
}

/// 5a/5c. CMD preloaded (`-E LD_PRELOAD …`): every connection SMC-R, negotiated by CMD.
fn socket_activate_to_a_preloaded_child(shim: bool, accept: bool) {
    let tag = if accept { "ho-sa-accept" } else { "ho-sa" };
    let Some(w) = World::new(tag, shim, &["systemd-socket-activate"]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let a = activated_run(&w, accept, shim);
    a.assert_served(&w);
    let r = &a.ran;
    if !shim {
        return r.verdict(&w).assert_tcp_baseline(a.n as usize);
    }
    assert!(
        r.server.stdout.contains("LD_PRELOAD /"),
        "CMD was not preloaded:\n{}",
        a.context(&w)
    );
    // CMD's pids: the activator's own (exec) without --accept, its children with it.
    let cmd = pids_after(&r.server.stdout, "SERVER ");
    assert!(!cmd.is_empty(), "{}", a.context(&w));
    let total = a.n + u32::from(a.first.is_some());
    let by_pid = smcr_by_pid(&log_lines(&w, "server"));
    let in_cmd: usize = cmd
        .iter()
        .map(|p| by_pid.get(p).copied().unwrap_or(0))
        .sum();
    assert!(
        in_cmd >= total as usize,
        "{in_cmd} SMC-R lines from CMD in the server log (expected {total}); per pid {by_pid:?}\n{}",
        a.context(&w)
    );
    for client in a.clients() {
        let connects: Vec<String> = log_lines(&w, client)
            .into_iter()
            .map(|(_, l)| l)
            .filter(|l| l.contains(" connect Some("))
            .collect();
        assert!(
            !connects.is_empty() && connects.iter().all(|l| l.contains("): SMC-R")),
            "{client}: not every connect was SMC-R:\n{}\n{}",
            harness::head(&connects.join("\n"), 8),
            a.context(&w)
        );
    }
    r.verdict(&w).assert_all_smcr(u64::from(a.n));
}

/// 5b/5d. CMD started without the library (systemd-socket-activate's default environment
/// drops LD_PRELOAD) under an activator that runs smcr: every connection works, over TCP,
/// with a reason code in the client's log (the listener must not have told the peers it
/// speaks SMC-R, or the connection must have been settled as TCP before CMD got it).
///
/// Without `--accept`, the connection that triggers the activation was answered with the
/// option before the exec, so CMD reads its CLC Proposal as data (and reports a bad header);
/// the client, answered with bytes that are not CLC (or a close), connects again unmarked
/// and is served over TCP (NOTCLC). Every later connection is TCP from the start.
fn socket_activate_to_a_child_without_the_library(accept: bool) {
    let tag = if accept {
        "ho-sa-accept-plain"
    } else {
        "ho-sa-plain"
    };
    let Some(w) = World::new(tag, true, &["systemd-socket-activate"]) else {
        return;
    };
    if program().is_none() {
        return;
    }
    let a = activated_run(&w, accept, false);
    let ctx = a.context(&w);
    if accept {
        a.assert_served(&w);
    } else {
        let n = a.n;
        assert!(
            a.ran.client.ok() && a.ran.client.stdout.contains(&format!("OK {n}")),
            "not every later connection got its answers:\n{ctx}"
        );
        let first = a.first.as_ref().expect("a first connection");
        assert!(
            first.ok() && first.stdout.contains("OK 1"),
            "the triggering connection was not served:\n{ctx}"
        );
        let again: Vec<String> = log_lines(&w, "first")
            .into_iter()
            .map(|(_, l)| l)
            .filter(|l| l.contains(" connect Some(") && l.contains("[0x7f000009]"))
            .collect();
        assert_eq!(
            again.len(),
            1,
            "the triggering connection was not made again (NOTCLC):\n{ctx}"
        );
        let errors: Vec<&str> = a
            .ran
            .server
            .stdout
            .lines()
            .filter(|l| l.starts_with("ERROR"))
            .collect();
        assert!(
            errors.len() == 1 && errors[0].contains("CLC eye catcher"),
            "CMD's errors should be the triggering connection's Proposal alone: {errors:?}\n{ctx}"
        );
    }
    assert!(
        a.ran.server.stdout.contains("LD_PRELOAD (unset)"),
        "CMD did not run, or ran with the library:\n{ctx}"
    );
    let mut reasons = BTreeMap::new();
    for client in a.clients() {
        let connects: Vec<String> = log_lines(&w, client)
            .into_iter()
            .map(|(_, l)| l)
            .filter(|l| l.contains(" connect Some("))
            .collect();
        let bad: Vec<&String> = connects
            .iter()
            .filter(|l| !(l.contains("TCP:") && l.contains("[0x")))
            .collect();
        assert!(
            !connects.is_empty() && bad.is_empty(),
            "{client}: connects that are not TCP with a reason code ({} of {}):\n{}\n{ctx}",
            bad.len(),
            connects.len(),
            harness::head(
                &bad.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
                8
            )
        );
        for l in &connects {
            let reason = l.split_once("TCP: ").map_or("", |(_, r)| r);
            *reasons.entry(reason.to_owned()).or_insert(0) += 1;
        }
    }
    eprintln!("clients' reasons: {reasons:?}");
}

// ---------------------------------------------------------------------------------------
// Node.js cluster.

/// 6. Node's `cluster` (`tests/js/cluster.js`, 2 workers, round-robin: the primary accepts
///    and passes each connection to a worker over its IPC channel) as nobody, HTTP on
///    127.0.0.1 (16 KiB answers); wrk `-t2 -c20 -d3s` as nobody. Every answer a 200, no
///    socket error; under the shim (primary and workers preloaded, the workers inheriting
///    the environment) the connections SMC-R, in both workers' totals.
fn node_cluster_round_robin(shim: bool) {
    let Some(w) = World::new("ho-node", shim, &["node", "wrk"]) else {
        return;
    };
    let port = common::port(BASE);
    let js = w.file("cluster.js", include_bytes!("js/cluster.js").as_slice());
    let mut node = w.spawn(
        &w.spec("node").user(&nobody()),
        "node",
        &[js.to_str().unwrap(), &port.to_string(), "2"],
    );
    assert!(
        wait_text(&mut node, "READY", Duration::from_secs(30)),
        "node's cluster did not start:\n{}\n{}",
        context(&w, &[("node", &node.stdout())]),
        harness::head(&node.stderr(), 20)
    );
    w.wait_listening(&Net::Host, port, &mut node);
    let out = node.stdout();
    assert!(
        out.contains("schedulingPolicy 2"),
        "not round-robin (SCHED_RR): {out}"
    );
    let workers = pids_after(&out, "worker ");
    assert_eq!(workers.len(), 2, "{out}");
    let sampler = w.sampler(&Net::Host, &[port]);
    let wrk = w.run(
        &w.spec("wrk").user(&nobody()),
        "wrk",
        &["-t2", "-c20", "-d3s", &format!("http://127.0.0.1:{port}/")],
        harness::CLIENT_TIMEOUT,
    );
    let seen = sampler.stop();
    let alive = node.alive();
    let ctx = || {
        format!(
            "{}\n--- node's stderr:\n{}",
            context(&w, &[("wrk", &wrk.stdout), ("node", &node.stdout())]),
            harness::head(&node.stderr(), 12)
        )
    };
    let requests = wrk
        .stdout
        .lines()
        .find_map(|l| {
            l.split_once(" requests in ")
                .and_then(|(n, _)| n.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    let bad: Vec<&str> = wrk
        .stdout
        .lines()
        .filter(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
        .collect();
    assert!(
        wrk.ok() && requests > 0 && bad.is_empty(),
        "wrk: {requests} requests, {bad:?}:\n{}",
        ctx()
    );
    eprintln!("wrk [{}]: {requests} requests", w.mode());
    assert!(
        alive && !node.stderr().contains("ERROR"),
        "node failed:\n{}",
        ctx()
    );
    let v = w.verdict(&seen, &[&node]);
    if !shim {
        return v.assert_tcp_baseline(20);
    }
    let by_pid = smcr_by_pid(&log_lines(&w, "node"));
    assert!(
        workers
            .iter()
            .all(|p| by_pid.get(p).is_some_and(|&n| n > 0)),
        "not every worker negotiated SMC-R: SMC-R log lines per pid {by_pid:?} (workers {workers:?})\n{}",
        ctx()
    );
    v.assert_all_smcr(20);
    let t = &v.servers[0];
    assert!(
        workers
            .iter()
            .all(|p| t.by_pid.get(p).is_some_and(|&n| n > 0)),
        "not every worker counts SMC-R connections in smc-stat: {:?} (workers {workers:?})\n{}",
        t.by_pid,
        v.summary()
    );
}

// ---------------------------------------------------------------------------------------

/// Plain TCP: the programs and the checks work, and the byte check sees TCP payload.
mod baseline {
    #[test]
    fn connections_passed_to_workers() {
        super::connections_passed_to_workers(false);
    }

    #[test]
    fn listener_passed_to_a_worker() {
        super::listener_passed_to_a_worker(false);
    }

    #[test]
    fn established_connection_passed_to_a_worker() {
        super::established_connection_passed_to_a_worker(false);
    }

    #[test]
    fn listener_inherited_across_exec() {
        super::listener_inherited_across_exec(false);
    }

    #[test]
    fn socket_activate_listener() {
        super::socket_activate_to_a_preloaded_child(false, false);
    }

    #[test]
    fn socket_activate_accept() {
        super::socket_activate_to_a_preloaded_child(false, true);
    }

    #[test]
    fn node_cluster_round_robin() {
        super::node_cluster_round_robin(false);
    }
}

/// Under the shim: SMC-R where both ends run smcr, TCP with a reason code where the reader
/// cannot negotiate.
mod over_smcr {
    #[test]
    fn connections_passed_to_workers_without_the_library() {
        super::passed_to_workers_without_the_library(false, 0);
    }
    #[test]
    fn listener_passed_to_a_worker_without_the_library() {
        super::passed_to_workers_without_the_library(true, 0);
    }
    /// The worker is still the primary's image (forked, library mapped) when the listener is
    /// sent, and execs without the library 30 ms later: the listener must go quiet all the
    /// same (it once reached the worker offering SMC-R, whose clients then sent it CLC).
    #[test]
    fn listener_passed_to_a_worker_that_execs_late_without_the_library() {
        super::passed_to_workers_without_the_library(true, 30);
    }
    #[test]
    fn connections_passed_to_workers() {
        super::connections_passed_to_workers(true);
    }

    #[test]
    fn listener_passed_to_a_worker() {
        super::listener_passed_to_a_worker(true);
    }

    #[test]
    fn established_connection_passed_to_a_worker() {
        super::established_connection_passed_to_a_worker(true);
    }

    #[test]
    fn listener_inherited_across_exec() {
        super::listener_inherited_across_exec(true);
    }

    #[test]
    fn listener_execl_without_the_library() {
        super::listener_exec_without_the_library("execl");
    }

    #[test]
    fn listener_execle_without_the_library() {
        super::listener_exec_without_the_library("execle");
    }

    #[test]
    fn listener_execlp_without_the_library() {
        super::listener_exec_without_the_library("execlp");
    }

    #[test]
    fn socket_activate_listener_to_a_preloaded_child() {
        super::socket_activate_to_a_preloaded_child(true, false);
    }

    #[test]
    fn socket_activate_listener_to_a_child_without_the_library() {
        super::socket_activate_to_a_child_without_the_library(false);
    }

    #[test]
    fn socket_activate_accept_to_a_preloaded_child() {
        super::socket_activate_to_a_preloaded_child(true, true);
    }

    #[test]
    fn socket_activate_accept_to_a_child_without_the_library() {
        super::socket_activate_to_a_child_without_the_library(true);
    }

    #[test]
    fn node_cluster_round_robin() {
        super::node_cluster_round_robin(true);
    }
}

/// A vfork child's exec (shells, JVMs, CPython may run commands so) shares the parent's
/// memory and runs no fork handler: it must not take the parent's stats area for its own and
/// remove it. The program prints its areas before and after (`tests/c/vfork_exec.c`).
#[test]
fn a_vfork_childs_exec_leaves_the_parents_stats_area() {
    let Some(bin) = common::build_c("vfork_exec", &[]) else {
        return;
    };
    let shim = common::Shim::new("vfork");
    let stats = shim.dir.join("stats");
    std::fs::create_dir_all(&stats).unwrap();
    let out = common::run_ok(
        shim.cmd(true, bin.to_str().unwrap())
            .env("SMCR_STATS_DIR", &stats),
        "vfork_exec under the shim",
    );
    assert_eq!(
        out.trim(),
        "1 1",
        "the parent's areas before and after the child's exec"
    );
}
