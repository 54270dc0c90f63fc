//! Unmodified Python programs (blocking sockets) under `LD_PRELOAD=libsmcr_preload.so`: an echo
//! server and a client that sends 1 MiB while reading the echo. Both ends under the shim →
//! SMC-R (the log says so for both); one end plain → TCP with the reason; data intact either
//! way.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};

fn lib() -> PathBuf {
    // `cargo test` rebuilds the cdylib next to the test binary (target/<profile>/deps); the
    // copy in target/<profile> is only refreshed by `cargo build`.
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libsmcr_preload.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}

static PORT: AtomicU16 = AtomicU16::new(0);

fn port() -> u16 {
    21000 + (std::process::id() % 1000) as u16 * 8 + PORT.fetch_add(1, Ordering::Relaxed)
}

struct Run {
    log: PathBuf,
    roce_port: u16,
}

impl Drop for Run {
    /// The log goes when the test passed (kept for a look when it failed).
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

impl Run {
    fn new(tag: &str) -> Self {
        let log = std::env::temp_dir().join(format!("smcr-py-{}-{tag}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        // Each test's processes get a RoCE port of their own: tests run in parallel on the
        // same loopback addresses.
        Self {
            log,
            roce_port: 30000 + port() % 30000,
        }
    }

    fn cmd(&self, shim: bool, args: &[&str]) -> Command {
        let mut c = Command::new("python3");
        c.args(args);
        if shim {
            self.shim(&mut c);
        }
        c
    }

    /// `c` under the shim: the library, this test's log and RoCE port, assume negotiation.
    fn shim<'c>(&self, c: &'c mut Command) -> &'c mut Command {
        c.env("LD_PRELOAD", lib())
            .env("SMCR_LOG", &self.log)
            .env("SMCR_NEGOTIATION", "assume")
            .env("SMCR_ROCE_PORT", self.roce_port.to_string())
    }

    fn server(&self, shim: bool, port: u16) -> Child {
        let mut child = self
            .cmd(
                shim,
                &[
                    script("server.py").to_str().unwrap(),
                    "127.0.0.2",
                    &port.to_string(),
                ],
            )
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        wait_ready(&mut child);
        child
    }

    fn client(&self, shim: bool, port: u16) -> String {
        let out = self
            .cmd(
                shim,
                &[
                    script("client.py").to_str().unwrap(),
                    "127.0.0.2",
                    &port.to_string(),
                ],
            )
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && stdout.contains("OK"),
            "client failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Waits for a server's first line, which must say READY.
fn wait_ready(server: &mut Child) {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("READY"), "{line}");
}

fn finish(mut server: Child) -> String {
    let mut out = String::new();
    use std::io::Read;
    server
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(server.wait().unwrap().success());
    out
}

#[test]
fn python_echo_over_smcr_with_both_ends_shimmed() {
    let run = Run::new("both");
    let p = port();
    let server = run.server(true, p);
    run.client(true, p);
    let served = finish(server);
    assert!(served.contains("SERVED 1118581"), "{served}");
    let log = run.log();
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("connect") && l.contains("SMC-R")),
        "{log}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("accept") && l.contains("SMC-R")),
        "{log}"
    );
}

#[test]
fn python_with_timeouts_waits_in_poll_on_the_smcr_socket() {
    // settimeout() after connect: Python sets O_NONBLOCK and polls for POLLIN/POLLOUT before
    // each recv/send, so this passes only if the application-facing socket's readiness
    // follows the SMC-R connection (1 MiB in flight: the sender waits for POLLOUT too).
    let run = Run::new("poll");
    let p = port();
    let server = run.server(true, p);
    let out = run
        .cmd(
            true,
            &[
                script("client.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
                "--timeout",
            ],
        )
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(finish(server).contains("SERVED 1118581"));
    let log = run.log();
    assert!(log.contains("connect") && log.contains("): SMC-R"), "{log}");
}

#[test]
fn forked_children_close_or_misuse_the_parents_smcr_socket_safely() {
    let run = Run::new("fork");
    let p = port();
    let server = run.server(true, p);
    let out = run
        .cmd(
            true,
            &[
                script("fork_client.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
            ],
        )
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(finish(server).contains("SERVED 21"));
    let log = run.log();
    assert!(log.contains("connect") && log.contains("): SMC-R"), "{log}");
    assert!(log.contains("inherited through fork"), "{log}");
}

#[test]
fn without_the_option_program_a_shimmed_client_stays_tcp_with_the_reason() {
    let run = Run::new("nobpf");
    let p = port();
    let server = run.server(false, p);
    let out = Command::new("python3")
        .args([
            script("client.py").to_str().unwrap(),
            "127.0.0.2",
            &p.to_string(),
        ])
        .env("LD_PRELOAD", lib())
        .env("SMCR_LOG", &run.log)
        .env("SMCR_ROCE_PORT", run.roce_port.to_string())
        .env("SMCR_BPF_DIR", "/nonexistent/smcr-bpf")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(finish(server).contains("SERVED 1118581"));
    let log = run.log();
    assert!(log.contains("SMC-R unavailable"), "{log}");
    assert!(log.contains("connect") && log.contains("TCP:"), "{log}");
    assert!(log.contains("0x7f000001"), "{log}");
}

/// With the TCP option program (root): SMC-R between shimmed ends, PEERNOSMC fallback when one
/// end is a plain program, in both directions.
#[test]
fn with_the_option_program_mixed_pairs_fall_back_with_peernosmc() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "needs root under SMCR_REQUIRE_TOOLS=1"
        );
        eprintln!("SKIP: the option program needs root");
        return;
    }
    let dir = PathBuf::from(format!("/sys/fs/bpf/smcr-test-py-{}", std::process::id()));
    smcr::option::install(&dir).expect("install the option program");
    let opt = |c: &mut Command| {
        c.env_remove("SMCR_NEGOTIATION").env("SMCR_BPF_DIR", &dir);
    };
    let run = Run::new("option");
    let result = std::panic::catch_unwind(|| {
        for (client_shim, server_shim) in [(true, true), (true, false), (false, true)] {
            let p = port();
            let mut sc = run.cmd(
                server_shim,
                &[
                    script("server.py").to_str().unwrap(),
                    "127.0.0.2",
                    &p.to_string(),
                ],
            );
            opt(&mut sc);
            let mut server = sc.stdout(Stdio::piped()).spawn().unwrap();
            wait_ready(&mut server);
            let mut cc = run.cmd(
                client_shim,
                &[
                    script("client.py").to_str().unwrap(),
                    "127.0.0.2",
                    &p.to_string(),
                ],
            );
            opt(&mut cc);
            let out = cc.output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(finish(server).contains("SERVED 1118581"));
        }
    });
    let _ = smcr::option::uninstall(&dir);
    result.unwrap();
    let log = run.log();
    let count = |what: &str, how: &str| {
        log.lines()
            .filter(|l| l.contains(what) && l.contains(how))
            .count()
    };
    assert_eq!(count("connect", "): SMC-R"), 1, "{log}");
    assert_eq!(count("accept", "): SMC-R"), 1, "{log}");
    assert_eq!(count("connect", "0x03010000"), 1, "{log}");
    assert_eq!(count("accept", "0x03010000"), 1, "{log}");
}

#[test]
fn smcr_sockets_never_cross_exec_and_sendfile_onto_them_is_exact() {
    let run = Run::new("exec");
    let p = port();
    let server = run.server(true, p);
    let out = run
        .cmd(
            true,
            &[
                script("exec_sendfile.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
            ],
        )
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let served = finish(server);
    assert!(
        served.contains(&format!("SERVED {}", (1 << 20) + 5000)),
        "{served}"
    );
    let log = run.log();
    assert!(log.contains("connect") && log.contains("): SMC-R"), "{log}");
}

/// A C program built with `-D_FORTIFY_SOURCE=2` (as Debian builds packages) reads through
/// glibc's `__read_chk`, `__recv_chk` and `__recvfrom_chk`.
#[test]
fn fortified_reads_reach_the_smcr_connection() {
    let Some(bin) = common::build_c("fortify", &["-O2", "-D_FORTIFY_SOURCE=2"]) else {
        return;
    };
    let run = Run::new("fortify");
    let syms = Command::new("nm").arg("-D").arg(&bin).output().unwrap();
    let syms = String::from_utf8_lossy(&syms.stdout);
    for s in ["__read_chk", "__recv_chk", "__recvfrom_chk"] {
        assert!(syms.contains(s), "the compiler did not fortify {s}: {syms}");
    }
    let p = port();
    let server = run.server(true, p);
    let out = run
        .shim(Command::new(&bin).args(["127.0.0.2", &p.to_string()]))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bin);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    finish(server);
    let log = run.log();
    assert!(log.contains("connect") && log.contains("): SMC-R"), "{log}");
}

/// A client opens two connections before using either; the server serves one at a time (the
/// second waits in its backlog, unaccepted, while the first is served). As over TCP, both
/// blocking connects return at once — the client's SMC-R negotiation waits for the server's
/// first use behind the application, not in `connect` — and both connections are SMC-R.
#[test]
fn blocking_connects_to_a_busy_iterative_server_return_at_once() {
    let run = Run::new("queued");
    let p = port();
    let mut server = run
        .cmd(
            true,
            &[
                script("server.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
                "2",
            ],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_ready(&mut server);
    let mut client = run
        .cmd(
            true,
            &[
                script("queued_client.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = client.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > std::time::Duration::from_secs(30) {
            let _ = client.kill();
            let _ = server.kill();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = client.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        status.is_some_and(|s| s.success()) && stdout.contains("OK"),
        "client (killed after 30 s if no status): {stdout}\n{}\n--- log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        run.log()
    );
    assert!(finish(server).contains("SERVED"));
    let log = run.log();
    let smc = |what: &str| {
        log.lines()
            .filter(|l| l.contains(what) && l.contains("): SMC-R"))
            .count()
    };
    assert_eq!((smc(" connect "), smc(" accept ")), (2, 2), "{log}");
}

/// A server forks right after its first use of an accepted connection started the
/// negotiation on a worker (which the child does not have); the child uses the connection.
/// It must not wait forever for a worker that is not there: it follows what the parent
/// records on the socket (TCP: it echoes; SMC-R in the parent: EIO, as documented).
#[test]
fn a_child_forked_while_its_parent_negotiates_follows_the_parents_outcome() {
    let run = Run::new("forksettle");
    let p = port();
    // Its own process group: a child that hangs is killed with it (it holds the pipe).
    use std::os::unix::process::CommandExt;
    let mut server = run
        .cmd(
            true,
            &[
                script("fork_while_settling.py").to_str().unwrap(),
                "127.0.0.2",
                &p.to_string(),
            ],
        )
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::{BufRead, Read, Write};
    out.read_line(&mut line).unwrap();
    assert!(line.contains("READY"), "{line}");
    let client = std::thread::spawn(move || {
        let mut c = run.cmd(
            true,
            &[
                "-c",
                "import socket, sys\n\
                 c = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n\
                 c.settimeout(20)\n\
                 c.sendall(b'ping')\n\
                 try:\n    print('GOT', c.recv(100))\n\
                 except OSError as e:\n    print('ENDED', e)\n",
                "127.0.0.2",
                &p.to_string(),
            ],
        );
        let o = c.output().unwrap();
        (String::from_utf8_lossy(&o.stdout).into_owned(), run)
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = server.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > std::time::Duration::from_secs(30) {
            // SAFETY: signalling the process group we made for the server.
            unsafe { libc::kill(-(server.id() as i32), libc::SIGKILL) };
            let _ = server.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let (client_out, run) = client.join().unwrap();
    let _ = std::io::stderr().flush();
    assert!(
        status.is_some_and(|s| s.success()) && rest.contains("SERVED"),
        "the server (killed after 30 s if no status): {rest}\n--- log:\n{}",
        run.log()
    );
    if rest.contains("CHILD ECHO") {
        assert!(client_out.contains("GOT b'ping'"), "{client_out}");
    } else {
        assert!(rest.contains("CHILD EIO"), "{rest}\n{}", run.log());
    }
    eprintln!("child: {rest}client: {client_out}");
}

/// A threaded program forks while its threads open and close SMC-R connections (a threaded
/// server running subprocesses). Each child closes an inherited SMC-R descriptor, every 8th
/// also connects, then exits. The library's process-wide locks are taken by the forking thread
/// around the fork, so no child inherits one held: here the table's writers hold theirs 200 µs
/// longer (debug builds), and without that handling a child hung within a few forks.
#[test]
fn a_threaded_program_forks_while_its_threads_use_smcr() {
    let Some(bin) = common::build_c("forkstorm", &["-O2", "-pthread"]) else {
        return;
    };
    let run = Run::new("forkstorm");
    let p = port();
    let mut server = run
        .shim(Command::new(&bin).args(["server", "127.0.0.2", &p.to_string()]))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_ready(&mut server);
    let out = run
        .shim(Command::new(&bin).args(["client", "127.0.0.2", &p.to_string(), "3"]))
        .env("SMCR_DEBUG_LOCK_HOLD_US", "200")
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_file(&bin);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", stdout.trim());
    let field = |k: &str| -> u64 {
        let w: Vec<&str> = stdout.split_whitespace().collect();
        let i = w.iter().position(|x| *x == k).expect(&stdout);
        w[i + 1].parse().expect(&stdout)
    };
    assert_eq!(field("HUNG"), 0, "children hung: {stdout}");
    assert_eq!(field("FAILED"), 0, "children failed: {stdout}");
    assert!(field("FORKS") >= 20, "{stdout}");
    assert!(field("ECHOES") >= 20, "{stdout}");
    let log = run.log();
    let smcr = log
        .lines()
        .filter(|l| l.contains("connect") && l.contains("): SMC-R"))
        .count();
    assert!(smcr >= 20, "the threads' connections were not SMC-R: {log}");
}

/// On a machine without RDMA devices the library never loads libibverbs (installed or not),
/// says nothing about it, and runs SMC-R on its own engine as before (issue 38).
#[test]
fn without_rdma_devices_libibverbs_is_never_loaded() {
    let devices = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count())
        .unwrap_or(0);
    if devices > 0 {
        eprintln!("skipped: this machine has RDMA devices");
        return;
    }
    let run = Run::new("noverbs");
    let p = port();
    let server = run.server(true, p);
    // The client, then a look at its own mappings once its SMC-R connection is done.
    let code = format!(
        "import runpy, sys\nsys.argv = ['client.py', '127.0.0.2', '{p}']\n\
         runpy.run_path({:?}, run_name='__main__')\n\
         maps = open('/proc/self/maps').read()\n\
         print('IBVERBS', 'mapped' if 'libibverbs' in maps else 'absent', flush=True)\n",
        script("client.py").to_str().unwrap()
    );
    let out = run.cmd(true, &["-c", &code]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("OK"),
        "client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    finish(server);
    assert!(stdout.contains("IBVERBS absent"), "{stdout}");
    let log = run.log();
    assert!(
        log.lines()
            .any(|l| l.contains("connect") && l.contains("SMC-R")),
        "{log}"
    );
    assert!(
        !log.to_lowercase().contains("verbs"),
        "the log mentions verbs devices: {log}"
    );
}
