//! Programs that forbid themselves new threads once they run (issue 35), under the shim: the
//! library's spare threads (`smcr::thread`) carry SMC-R; where they cannot, the connection
//! stays TCP with NOTHREAD, and the program is never killed.
//!
//! `tests/c/lockdown.c` listens, then locks itself down — `setrlimit(RLIMIT_NPROC, {0, 0})`
//! as haproxy does, or a seccomp filter that kills the process on clone/clone3, installed
//! with `prctl(PR_SET_SECCOMP)` (hooked) or with `syscall(SYS_seccomp)` and TSYNC (what
//! libseccomp does; not hooked: the spares made when the runtime started must do) — then
//! serves echo connections from one epoll loop. RLIMIT_NPROC binds only non-root users: as
//! root the programs run as `nobody` (setpriv), otherwise as the user running the tests.
//! And haproxy as Debian runs it (root-started master, `-Ws`, chroot, user haproxy, which
//! sets RLIMIT_NPROC to 0 in its worker) between redis-benchmark and redis-server (root).
//! Negotiation uses the option program at its default pins (installed as root), as a user's
//! programs do; without root and without an install, the option is assumed.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Bg, port};

/// Ports: `common::port(BASE)`.
const BASE: u16 = 26000;

/// How many connections each run serves, all open at once (more than the spares: some
/// handshakes run on the program's thread).
const CONNS: usize = 16;
const SIZE: usize = 65536;

/// A run's directory (world-readable: the programs may run as `nobody`): the library, the
/// test program, the shim's log (writable by all).
struct World {
    dir: PathBuf,
    lib: PathBuf,
    bin: Option<PathBuf>,
    log: PathBuf,
    roce_port: u16,
    /// `setpriv` arguments that drop to the programs' user (none when not root).
    user: Vec<String>,
    /// No option program to use (not root, and none installed): the option is assumed.
    assume: bool,
}

impl World {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("smcr-lockdown-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let lib = dir.join("libsmcr_preload.so");
        std::fs::copy(common::lib(), &lib).unwrap();
        let log = dir.join("smcr.log");
        std::fs::write(&log, "").unwrap();
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666)).unwrap();
        // SAFETY: geteuid has no preconditions.
        let user = if unsafe { libc::geteuid() } == 0 {
            let (uid, gid) = user_ids("nobody").expect("no user nobody");
            vec![
                format!("--reuid={uid}"),
                format!("--regid={gid}"),
                "--clear-groups".into(),
            ]
        } else {
            Vec::new()
        };
        // The option program as `smcr bpf install` leaves it (root installs it): the workers
        // that chroot (haproxy's) mark their sockets through socket options, with no pin.
        let dflt = Path::new(smcr::option::DEFAULT_DIR);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            smcr::option::install(dflt).expect("install the option program");
        }
        let assume = smcr::option::OptionRecords::open(dflt).is_err();
        Self {
            dir,
            lib,
            bin: None,
            log,
            roce_port: 32000 + port(0) % 30000,
            user,
            assume,
        }
    }

    /// Builds `tests/c/lockdown.c` (world-readable, for the programs' user); false (skip)
    /// without a C compiler.
    fn build(&mut self) -> bool {
        self.bin = common::build_c("lockdown", &["-O2", "-pthread"]);
        self.bin.is_some()
    }

    /// `prog args` under the shim (as the programs' user), with `env` over the defaults.
    fn cmd(&self, prog: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut c = if self.user.is_empty() {
            Command::new(prog)
        } else {
            let mut c = Command::new("setpriv");
            c.args(&self.user).arg(prog);
            c
        };
        c.args(args);
        self.shim(&mut c);
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    /// The shim's environment on `c`.
    fn shim(&self, c: &mut Command) {
        if self.assume {
            c.env("SMCR_NEGOTIATION", "assume");
        }
        c.env("LD_PRELOAD", &self.lib)
            .env("SMCR_LOG", &self.log)
            .env("SMCR_ROCE_PORT", self.roce_port.to_string())
            .env("SMCR_STATS_DIR", "off")
            .env("SMCR_CONFIG", "off");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if !std::thread::panicking() && std::env::var_os("SMCR_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `name`'s uid and primary gid.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name; the entry is read at once (tests are the only users of
    // getpwnam in this process).
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    // SAFETY: non-null: a valid passwd entry.
    (!pw.is_null()).then(|| unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// Waits (at most 60 s) for `c` to end; its output, and whether it succeeded.
fn finish(c: Child, what: &str) -> (bool, String) {
    let mut c = Bg(c);
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "{what} did not end within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = c.0.wait().unwrap();
    let mut out = String::new();
    use std::io::Read;
    if let Some(mut o) = c.0.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = c.0.stderr.take() {
        let _ = e.read_to_string(&mut out);
    }
    (status.success(), format!("{out}[{status}]"))
}

/// What a run left: the server's and the client's output, and the shim's log.
struct Ran {
    server: String,
    client: String,
    log: String,
}

impl Ran {
    /// The server's `accept` lines (one per connection).
    fn accepts(&self) -> Vec<&str> {
        self.log
            .lines()
            .filter(|l| l.contains(" accept Some("))
            .collect()
    }
}

/// The lockdown server (`how`) and a client with `CONNS` connections at once, under `env`.
fn echo(w: &World, how: &str, env: &[(&str, &str)]) -> Ran {
    let bin = w.bin.as_deref().unwrap();
    let p = port(BASE).to_string();
    let n = CONNS.to_string();
    let mut server = w
        .cmd(bin, &["server", "127.0.0.2", &p, &n, how], env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    use std::io::{BufRead, Read};
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    out.read_line(&mut line).unwrap();
    if !line.contains("READY") {
        // Why it ended (its stderr, its exit status: a signal such as SIGSYS).
        let mut err = String::new();
        let _ = server.stderr.take().map(|mut e| e.read_to_string(&mut err));
        let status = server.wait();
        panic!("server: {line:?} {status:?}\n{err}\n{}", w.log());
    }
    server.stdout = Some(out.into_inner());
    let client = w
        .cmd(
            bin,
            &["client", "127.0.0.2", &p, &n, &SIZE.to_string()],
            &[],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, client) = finish(client, "the client");
    assert!(
        ok && client.contains(&format!("OK {CONNS}")),
        "client: {client}\n{}",
        w.log()
    );
    let (ok, server) = finish(server, "the server");
    // Never killed (a filtered clone would be SIGSYS), every echo served.
    assert!(
        ok && server.contains(&format!("SERVED {CONNS} BYTES {}", CONNS * SIZE)),
        "server: {server}\n{}",
        w.log()
    );
    Ran {
        server,
        client,
        log: w.log(),
    }
}

/// Every connection the server accepted was SMC-R, none NOTHREAD.
fn assert_all_smcr(r: &Ran) {
    let accepts = r.accepts();
    assert_eq!(accepts.len(), CONNS, "{}", r.log);
    assert!(
        accepts.iter().all(|l| l.contains("): SMC-R")),
        "not all SMC-R:\n{}",
        r.log
    );
    assert!(!r.log.contains("NOTHREAD"), "{}", r.log);
    let _ = &r.client;
}

/// As haproxy: RLIMIT_NPROC 0 after listen. The hooked setrlimit parks the spares first:
/// `SMCR_SPARE_THREADS` (4) and the engine and TCP watch not started yet. With one spare
/// setting, the same three suffice for one peer; without the hook the one spare made when the
/// runtime started would not (see the filter through syscall below).
#[test]
fn a_server_that_sets_rlimit_nproc_to_0_after_listen_serves_smcr() {
    for (spares, parked) in [("4", 6), ("1", 3)] {
        let mut w = World::new(&format!("nproc-{spares}"));
        if !w.build() {
            return;
        }
        let r = echo(&w, "nproc", &[("SMCR_SPARE_THREADS", spares)]);
        // The limit held: the program itself could create no thread afterwards.
        assert!(r.server.contains("THREADS refused"), "{}", r.server);
        assert_all_smcr(&r);
        let said = format!(
            "RLIMIT_NPROC lowered: no new threads from now on; {parked} spare threads parked"
        );
        assert!(r.log.contains(&said), "{}", r.log);
    }
}

#[test]
fn a_seccomp_filter_installed_with_prctl_finds_the_spares_parked() {
    let mut w = World::new("prctl");
    if !w.build() {
        return;
    }
    let r = echo(&w, "seccomp-prctl", &[("SMCR_SPARE_THREADS", "1")]);
    assert_all_smcr(&r);
    assert!(
        r.log
            .contains("prctl(PR_SET_SECCOMP): no new threads from now on; 3 spare threads parked"),
        "{}",
        r.log
    );
}

/// A filter through `syscall(SYS_seccomp)` (not hooked) on every thread (TSYNC): the spares
/// made when the runtime started are all there is. Four (the default) are enough; with one,
/// no link group can get its poller, and every connection stays TCP with NOTHREAD — never a
/// clone, which would kill the process.
#[test]
fn under_a_filter_we_did_not_see_coming_the_spares_decide_and_nothing_is_killed() {
    let mut w = World::new("syscall");
    if !w.build() {
        return;
    }
    let r = echo(&w, "seccomp-syscall", &[]);
    assert!(!r.log.contains("no new threads from now on"), "{}", r.log);
    assert_all_smcr(&r);

    let mut w1 = World::new("syscall-1");
    if !w1.build() {
        return;
    }
    let r = echo(&w1, "seccomp-syscall", &[("SMCR_SPARE_THREADS", "1")]);
    let accepts = r.accepts();
    assert_eq!(accepts.len(), CONNS, "{}", r.log);
    assert!(
        accepts.iter().all(|l| l.contains("[0x7f000007]")
            && l.contains("a seccomp filter was installed after start-up")),
        "not all NOTHREAD:\n{}",
        r.log
    );
    // The clients were declined with MEM (as for NOFD): plain TCP, not an error.
    assert_eq!(
        r.log
            .lines()
            .filter(|l| l.contains(" connect Some(") && l.contains("peer declined: MEM"))
            .count(),
        CONNS,
        "{}",
        r.log
    );
}

/// haproxy as Debian runs it: started by root (`-Ws`, master-worker), its worker chroots,
/// drops to user haproxy and sets RLIMIT_NPROC to 0 in each of its threads (no
/// `insecure-fork-wanted`); TCP mode between redis-benchmark and redis-server, both as user
/// haproxy. The frontend on 127.0.0.2, the backend reached from 127.0.0.4 (`source`): two
/// devices, so two engines, two link groups' pollers and the TCP watch, all from spares
/// parked before the limit. Both legs must be SMC-R, with no NOTHREAD. (A plain run: the
/// systemd unit's own sandboxing is another suite's.)
#[test]
fn haproxy_in_its_default_configuration_gets_smcr_on_both_legs() {
    if !common::root("haproxy (user haproxy, chroot)")
        || !common::have("haproxy")
        || !common::have("redis-server")
        || !common::have("redis-benchmark")
    {
        return;
    }
    let Some((uid, gid)) = user_ids("haproxy") else {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "no user haproxy (the haproxy package makes it)"
        );
        eprintln!("SKIP: no user haproxy");
        return;
    };
    let mut w = World::new("haproxy");
    w.user = vec![
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
        "--clear-groups".into(),
    ];
    // The worker logs from inside its chroot: the same file at the same path there (a hard
    // link; the shim opens the log by name for each line).
    let chroot = w.dir.join("chroot");
    let inside = chroot.join(w.log.strip_prefix("/").unwrap());
    std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
    std::fs::hard_link(&w.log, &inside).unwrap();
    let (front, back) = (port(BASE), port(BASE));
    let cfg = w.dir.join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n\tchroot {}\n\tuser haproxy\n\tgroup haproxy\n\n\
             defaults\n\tmode tcp\n\ttimeout connect 5s\n\ttimeout client 30s\n\ttimeout server 30s\n\n\
             frontend fe\n\tbind 127.0.0.2:{front}\n\tdefault_backend be\n\n\
             backend be\n\tserver redis 127.0.0.3:{back} source 127.0.0.4\n",
            chroot.display()
        ),
    )
    .unwrap();
    let data = w.dir.join("redis");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).unwrap();
    let back_s = back.to_string();
    let _redis = Bg(w
        .cmd(
            Path::new("redis-server"),
            &[
                "--bind",
                "127.0.0.3",
                "--port",
                &back_s,
                "--save",
                "",
                "--appendonly",
                "no",
                // Its clients come from 127.0.0.4, which protected mode does not count as
                // loopback.
                "--protected-mode",
                "no",
                "--dir",
                data.to_str().unwrap(),
            ],
            &[],
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    common::wait_listening(None, "127.0.0.3", back);
    // Started by root, as its unit does; it drops to haproxy itself.
    let mut hap = Command::new("haproxy");
    hap.args(["-Ws", "-f", cfg.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    w.shim(&mut hap);
    let _hap = Bg(hap.spawn().unwrap());
    common::wait_listening(None, "127.0.0.2", front);
    let front_s = front.to_string();
    let bench = w
        .cmd(
            Path::new("redis-benchmark"),
            &[
                "-h",
                "127.0.0.2",
                "-p",
                &front_s,
                "-c",
                "10",
                "-n",
                "5000",
                "-t",
                "set,get",
                "--csv",
            ],
            &[],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, out) = finish(bench, "redis-benchmark");
    assert!(
        ok && out.contains("\"SET\"") && out.contains("\"GET\""),
        "redis-benchmark: {out}\n{}",
        w.log()
    );
    let log = w.log();
    // The worker: the process that lowered its limit.
    let worker = log
        .lines()
        .find(|l| l.contains("RLIMIT_NPROC lowered: no new threads from now on"))
        .and_then(|l| l.strip_prefix("smcr["))
        .and_then(|l| l.split(']').next())
        .unwrap_or_else(|| panic!("no worker lowered RLIMIT_NPROC:\n{log}"))
        .to_owned();
    let of_worker = |what: &str| -> Vec<&str> {
        log.lines()
            .filter(|l| l.starts_with(&format!("smcr[{worker}]: ")) && l.contains(what))
            .collect()
    };
    let (accepts, connects) = (of_worker(" accept Some("), of_worker(" connect Some("));
    assert!(
        !accepts.is_empty() && accepts.iter().all(|l| l.contains("): SMC-R")),
        "client side of haproxy not all SMC-R:\n{log}"
    );
    assert!(
        !connects.is_empty() && connects.iter().all(|l| l.contains("): SMC-R")),
        "server side of haproxy not all SMC-R:\n{log}"
    );
    assert!(!log.contains("NOTHREAD") && !log.contains("TCP:"), "{log}");
    // Both legs' peers agree.
    assert!(
        log.lines()
            .any(|l| l.contains(" connect Some(127.0.0.2:") && l.contains("): SMC-R"))
    );
    assert!(
        log.lines()
            .any(|l| l.contains(" accept Some(127.0.0.4:") && l.contains("): SMC-R"))
    );
}
