//! Real programs run the way a Linux distribution runs them, under the shim (issue 23).
//!
//! The other end-to-end tests start programs as root, with a generous `ulimit -n`, from the
//! build tree, with a private option-program pin directory and an engine port of their own.
//! A distribution does none of that: services run as their own non-root users (`redis`,
//! `postgres`, `nobody`), with `ulimit -n 1024`, from a clean environment, started by root
//! (nginx's master) or a service manager, forking workers or a process per connection, in
//! network namespaces, on dual-stack listeners; the library comes from a system directory
//! and the option program is installed once, at its default pin directory
//! (`smcr bpf install`), with the default RoCE port. This suite runs such programs in
//! exactly those conditions (`distro/harness.rs`): a world-readable copy of
//! `libsmcr_preload.so`, `smcr` and `smc-stat` per test under `/tmp/smcr-distro-…`, a stats
//! directory every user can write (1777), a shim log per program, every program dropped to
//! its user with `setpriv` after `prlimit --nofile=N:N`, no `SMCR_BPF_DIR`, no
//! `SMCR_ROCE_PORT`, no `SMCR_NEGOTIATION=assume`.
//!
//! Every scenario runs twice: `baseline::*` over plain TCP (the programs' own success
//! criteria, and proof that the byte check below would see TCP payload), and `over_smcr::*`
//! under the shim, which must also show that the traffic went over SMC-R: (a) every request
//! succeeded by the program's own account; (b) `smc-stat --json`, read while the programs
//! run, counts the servers' connections as SMC-R (or, where fallbacks are allowed, names the
//! reason of each TCP one); (c) the servers' TCP sockets (`ss -ti`) carried at most the CLC
//! handshake. Assertion messages carry the shim logs' `): SMC-R` / `TCP:` counts and their
//! first distinct non-SMC-R lines. A failing
//! test keeps its directory (logs, programs' output, stats areas); `SMCR_KEEP_LOGS=1` keeps
//! every one. For diagnosis only: `SMCR_DISTRO_NOFILE=N` gives every program `ulimit -n N`
//! (to see what fails past the descriptor limit), `SMCR_DISTRO_ENV="K=V …"` adds variables
//! to every shimmed program.
//!
//! Scenarios: redis-server/redis-benchmark as `redis`/`nobody`; nginx (root master, two
//! `nobody` workers) with wrk; PostgreSQL (postmaster forks a backend per connection) with
//! pgbench; 4 redis pairs at once on 127.0.0.1, and across two namespaces; a dual-stack
//! nginx (`[::]`, ipv6only=off) with IPv4 (SMC-R) and IPv6 (TCP, named reason) clients;
//! redis under `ip netns exec` through `smcr run`; 200 connections under `ulimit -n 256`;
//! an inetd-style fork-per-connection server, with and without exec; gunicorn (2 sync
//! workers, a connection per request) as nobody with wrk; Node.js and Java's HttpServer on
//! their default dual-stack sockets (`::`) as nobody, wrk to 127.0.0.1; memcached started by
//! root dropping to `memcache` (`-u`), with a Python text-protocol client, blocking or with
//! socket timeouts. All need root (users, namespaces, the option program): they skip
//! without it (fail under SMCR_REQUIRE_TOOLS=1).

mod common;
#[path = "distro/harness.rs"]
mod harness;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::NetPair;
use harness::{
    CLIENT_TIMEOUT, Finished, Net, Proc, User, World, check_benchmark, pg_bin, redis_benchmark,
};

/// Ports: `common::port(BASE)` (64 per test process).
const BASE: u16 = 12000;

// ---------------------------------------------------------------------------------------
// Programs.

fn redis_server(w: &World, spec: harness::Spec, addr: &str, port: u16, data: &Path) -> Proc {
    let port = port.to_string();
    w.spawn(
        &spec,
        "redis-server",
        &[
            "--bind",
            addr,
            "--port",
            &port,
            "--save",
            "",
            "--appendonly",
            "no",
            // Clients from the other namespace are not on the loopback interface.
            "--protected-mode",
            "no",
            "--dir",
            data.to_str().unwrap(),
        ],
    )
}

/// Group name of `u`'s primary group (nginx's `user` directive takes names).
fn group_name(u: &User) -> String {
    std::fs::read_to_string("/etc/group")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 2 && f[2].parse() == Ok(u.gid)).then(|| f[0].to_owned())
        })
        .unwrap_or_else(|| u.name.clone())
}

/// An nginx configuration as a distribution's, with every path in the test's directory:
/// `workers` workers as nobody, access log lines `PID STATUS BYTES`, a 64 KiB file at
/// `/file64k`.
fn nginx_conf(w: &World, workers: u32, listen: &str) -> PathBuf {
    let body: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    w.file("html/file64k", &body);
    let tmp = w.dir.join("nginx-tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let nobody = User::or_nobody("nobody");
    let d = w.dir.display();
    let conf = format!(
        "worker_processes {workers};
user {user} {group};
daemon off;
master_process on;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log notice;
events {{ worker_connections 512; }}
http {{
    log_format withpid '$pid $status $body_bytes_sent';
    access_log {d}/access.log withpid;
    client_body_temp_path {d}/nginx-tmp/body;
    proxy_temp_path {d}/nginx-tmp/proxy;
    fastcgi_temp_path {d}/nginx-tmp/fastcgi;
    uwsgi_temp_path {d}/nginx-tmp/uwsgi;
    scgi_temp_path {d}/nginx-tmp/scgi;
    server {{
        listen {listen};
        root {d}/html;
    }}
}}
",
        user = nobody.name,
        group = group_name(&nobody)
    );
    w.file("nginx.conf", conf.as_bytes())
}

/// nginx's master as root (as systemd starts it), in the foreground; returns it once it
/// listens on `port` and its `workers` workers run, with the workers' pids.
fn nginx(w: &World, conf: &Path, port: u16, workers: usize) -> (Proc, Vec<u32>) {
    let dir = w.dir.to_str().unwrap();
    let err = w.dir.join("nginx-error.log");
    let mut master = w.spawn(
        &w.spec("nginx"),
        "nginx",
        &[
            "-c",
            conf.to_str().unwrap(),
            "-p",
            dir,
            "-e",
            err.to_str().unwrap(),
        ],
    );
    w.wait_listening(&Net::Host, port, &mut master);
    let pids = w.wait_workers(&mut master, workers, &|| {
        std::fs::read_to_string(&err).unwrap_or_default()
    });
    (master, pids)
}

/// wrk as `nobody` against `url`.
fn wrk(w: &World, name: &str, threads: u32, conns: u32, secs: u32, url: &str) -> Finished {
    let nobody = User::or_nobody("nobody");
    w.run(
        &w.spec(name).user(&nobody),
        "wrk",
        &[
            &format!("-t{threads}"),
            &format!("-c{conns}"),
            &format!("-d{secs}s"),
            url,
        ],
        CLIENT_TIMEOUT,
    )
}

/// wrk succeeded with requests, no non-2xx answer and no socket error; returns the count.
fn check_wrk(w: &World, f: &Finished) -> u64 {
    w.expect_ok(f);
    let requests = f
        .stdout
        .lines()
        .find_map(|l| {
            l.split_once(" requests in ")
                .and_then(|(n, _)| n.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    let bad: Vec<&str> = f
        .stdout
        .lines()
        .filter(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
        .collect();
    assert!(
        requests > 0 && bad.is_empty(),
        "[{}] {}: {requests} requests, {bad:?}\n{}\n{}",
        w.mode(),
        f.name,
        f.describe(),
        w.log_summary()
    );
    eprintln!("{} [{}]: {requests} requests", f.name, w.mode());
    requests
}

/// The access log's lines per pid (`PID STATUS BYTES`; gunicorn writes the pid as `<PID>`),
/// asserting every answer was a 200 with the whole 64 KiB, but for at most `conns` cut short
/// when wrk stopped.
fn access_log_by_pid(
    w: &World,
    log: &Path,
    conns: usize,
) -> std::collections::BTreeMap<u32, usize> {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let mut by_pid = std::collections::BTreeMap::new();
    let mut short = Vec::new();
    for l in log.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert!(
            f.len() == 3 && f[1] == "200",
            "[{}] access log line {l:?}",
            w.mode()
        );
        if f[2] != "65536" {
            short.push(l);
        }
        let pid = f[0].trim_start_matches('<').trim_end_matches('>');
        *by_pid.entry(pid.parse::<u32>().unwrap()).or_insert(0) += 1;
    }
    assert!(
        short.len() <= conns,
        "[{}] {} answers cut short: {:?}",
        w.mode(),
        short.len(),
        &short[..short.len().min(10)]
    );
    by_pid
}

/// An echo server on one thread (selectors: epoll), as small daemons are written; errors
/// go to stderr as `ERROR …`.
const ECHO_SERVER: &str = r#"
import selectors, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
sel = selectors.DefaultSelector()
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((host, port))
ls.listen(512)
ls.setblocking(False)
sel.register(ls, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is ls:
            try:
                c, _ = ls.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                print("ERROR accept:", e, file=sys.stderr, flush=True)
                continue
            sel.register(c, selectors.EVENT_READ)
            continue
        c = key.fileobj
        try:
            d = c.recv(65536)
            if d:
                c.sendall(d)
                continue
        except OSError as e:
            print("ERROR recv/send:", e, file=sys.stderr, flush=True)
        sel.unregister(c)
        c.close()
"#;

/// inetd-style: the parent accepts and forks; the child serves the connection (echo) or
/// execs a separate program on it (fds 0 and 1); the parent closes its copy.
const FORK_SERVER: &str = r#"
import os, select, signal, socket, sys
host, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ECHO = """
import os
while True:
    d = os.read(0, 65536)
    if not d:
        break
    while d:
        d = d[os.write(1, d):]
"""
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((host, port))
ls.listen(64)
while True:
    c, _ = ls.accept()
    if os.fork() == 0:
        try:
            ls.close()
            if mode == "exec":
                os.dup2(c.fileno(), 0)
                os.dup2(c.fileno(), 1)
                c.close()
                os.execv(sys.executable, [sys.executable, "-c", ECHO])
            while True:
                d = c.recv(65536)
                if not d:
                    break
                c.sendall(d)
        except BaseException as e:
            print("ERROR child %d: %r" % (os.getpid(), e), file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)
    if mode == "shared":
        # The parent waits on the connection too (a use of it) while the child echoes.
        select.select([c], [], [], 0.3)
    c.close()
"#;

/// Opens N connections and keeps them all open, echoes SIZE bytes on each, says `echoed N`,
/// waits for a line on stdin (the test samples meanwhile), then closes them.
const HOLDING_CLIENT: &str = r#"
import socket, sys
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
socks = []
for i in range(n):
    try:
        socks.append(socket.create_connection((host, port), timeout=30))
    except OSError as e:
        sys.exit("ERROR connect %d of %d: %r" % (i + 1, n, e))
print("connected", n, flush=True)
for i, s in enumerate(socks):
    msg = (b"%08d" % i) * (size // 8)
    try:
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            d = s.recv(len(msg) - len(got))
            if not d:
                raise OSError("closed by the server after %d bytes" % len(got))
            got += d
    except OSError as e:
        sys.exit("ERROR echo on connection %d of %d: %r" % (i + 1, n, e))
    if got != msg:
        sys.exit("ERROR echo on connection %d of %d: wrong bytes" % (i + 1, n))
print("echoed", n, flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print("closed", flush=True)
"#;

/// A Python server and the holding client, both as nobody with `ulimit -n nofile`: `n`
/// connections of `size` bytes echoed; returns the verdict sampled while all were open.
fn python_pair(
    w: &World,
    server_py: &str,
    server_args: &[&str],
    n: u32,
    size: u32,
    nofile: u32,
) -> harness::Verdict {
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let ps = port.to_string();
    let server_file = w.file("server.py", server_py.as_bytes());
    let client_file = w.file("client.py", HOLDING_CLIENT.as_bytes());
    let mut args = vec![server_file.to_str().unwrap(), "127.0.0.1", &ps];
    args.extend(server_args);
    let mut server = w.spawn(
        &w.spec("server").user(&nobody).nofile(nofile),
        "python3",
        &args,
    );
    w.wait_listening(&Net::Host, port, &mut server);
    let mut client = w.spawn(
        &w.spec("client").user(&nobody).nofile(nofile).stdin(),
        "python3",
        &[
            client_file.to_str().unwrap(),
            "127.0.0.1",
            &ps,
            &n.to_string(),
            &size.to_string(),
        ],
    );
    w.wait_output(&mut client, &format!("echoed {n}"), CLIENT_TIMEOUT);
    let seen = w.snapshot(&Net::Host, &[port]);
    let verdict = w.verdict(&seen, &[&server]);
    client.write_stdin("done\n");
    client.close_stdin();
    let done = client.finish(CLIENT_TIMEOUT);
    w.expect_ok(&done);
    let err = server.stderr();
    assert!(
        server.alive() && !err.contains("ERROR") && !err.contains("Traceback"),
        "[{}] the server failed:\n{}\n{}",
        w.mode(),
        harness::head(&err, 20),
        w.log_summary()
    );
    verdict
}

/// A WSGI application as packaged apps are: a module with `application`, answering every
/// request with 64 KiB (the bytes nginx serves).
const WSGI_APP: &str = r#"
BODY = bytes(((i * 2654435761) & 0xFFFFFFFF) >> 24 for i in range(65536))


def application(environ, start_response):
    start_response("200 OK", [
        ("Content-Type", "application/octet-stream"),
        ("Content-Length", str(len(BODY))),
    ])
    return [BODY]
"#;

/// Node's HTTP server as its documentation writes it: `listen(PORT)` with no host, which is
/// one AF_INET6 socket on `::` taking IPv4 too; 64 KiB per answer.
const NODE_SERVER: &str = r#"
const http = require('http');
const port = Number(process.argv[2]);
const body = Buffer.alloc(65536);
for (let i = 0; i < body.length; i++) body[i] = Math.imul(i, 2654435761) >>> 24;
const server = http.createServer((req, res) => {
  req.resume();
  res.writeHead(200, { 'Content-Type': 'application/octet-stream', 'Content-Length': body.length });
  res.end(body);
});
server.on('error', (e) => { console.error('ERROR', e); process.exit(1); });
server.listen(port, () => console.log('listening on ' + JSON.stringify(server.address())));
"#;

/// The JDK's HTTP server on `new InetSocketAddress(PORT)` (the wildcard: one AF_INET6 socket
/// on `::` taking IPv4 too), handlers on a pool of 4 threads; 64 KiB per answer.
const JAVA_SERVER: &str = r#"
import com.sun.net.httpserver.HttpServer;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.util.concurrent.Executors;

public class Server {
    public static void main(String[] args) throws Exception {
        int port = Integer.parseInt(args[0]);
        byte[] body = new byte[65536];
        for (int i = 0; i < body.length; i++) {
            body[i] = (byte) (((i * 2654435761L) & 0xffffffffL) >>> 24);
        }
        HttpServer server = HttpServer.create(new InetSocketAddress(port), 512);
        server.createContext("/", ex -> {
            ex.getRequestBody().readAllBytes();
            ex.getResponseHeaders().set("Content-Type", "application/octet-stream");
            ex.sendResponseHeaders(200, body.length);
            try (OutputStream os = ex.getResponseBody()) {
                os.write(body);
            }
        });
        server.setExecutor(Executors.newFixedThreadPool(4));
        server.start();
        System.out.println("listening on " + server.getAddress());
    }
}
"#;

/// The memcached client (`tests/py/memcached_client.py`).
const MEMCACHED_CLIENT: &str = include_str!("py/memcached_client.py");

// ---------------------------------------------------------------------------------------
// Scenarios (`shim`: under the shim with the SMC-R checks, else the plain TCP baseline).

/// Scenario 1: redis-server as `redis`, redis-benchmark (`-c 50 -n 20000 -t set,get`) as nobody.
fn redis_as_distribution_users(shim: bool) {
    let Some(w) = World::new("redis", shim, &["redis-server", "redis-benchmark"]) else {
        return;
    };
    let port = common::port(BASE);
    let (redis, nobody) = (User::or_nobody("redis"), User::or_nobody("nobody"));
    let data = w.private_dir("redis-data", &redis);
    let mut server = redis_server(
        &w,
        w.spec("redis-server").user(&redis),
        "127.0.0.1",
        port,
        &data,
    );
    w.wait_listening(&Net::Host, port, &mut server);
    let sampler = w.sampler(&Net::Host, &[port]);
    let bench = redis_benchmark(
        &w,
        w.spec("redis-benchmark").user(&nobody),
        "127.0.0.1",
        port,
    )
    .finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    check_benchmark(&w, &bench);
    let v = w.verdict(&seen, &[&server]);
    v.assert_mode(shim, 50, 1);
    if shim {
        // Two users on one host: shared memory all the same (issue 37).
        v.assert_shared_memory(nobody.uid);
    }
}

/// Scenario 2: nginx with a root master and two nobody workers serving a 64 KiB file; wrk
/// `-t2 -c20 -d5s` as nobody. Both workers must serve (access log; and under the shim,
/// SMC-R in each one's totals).
fn nginx_master_and_two_workers(shim: bool) {
    let Some(w) = World::new("nginx", shim, &["nginx", "wrk"]) else {
        return;
    };
    let port = common::port(BASE);
    let conf = nginx_conf(&w, 2, &format!("127.0.0.1:{port}"));
    let (master, workers) = nginx(&w, &conf, port, 2);
    let sampler = w.sampler(&Net::Host, &[port]);
    let url = format!("http://127.0.0.1:{port}/file64k");
    check_wrk(&w, &wrk(&w, "wrk", 2, 20, 5, &url));
    let mut by_pid = access_log_by_pid(&w, &w.dir.join("access.log"), 20);
    // The kernel may hand all of a round's 20 connections to one worker (it did once in CI,
    // over plain TCP): new rounds, new connections, until both served (or four rounds).
    for round in 2..=4 {
        if workers.iter().all(|p| by_pid.contains_key(p)) {
            break;
        }
        eprintln!("round {}: one worker served all: {by_pid:?}", round - 1);
        check_wrk(&w, &wrk(&w, "wrk", 2, 20, 2, &url));
        by_pid = access_log_by_pid(&w, &w.dir.join("access.log"), 20 * round);
    }
    let seen = sampler.stop();
    eprintln!("access log lines per worker: {by_pid:?} (workers {workers:?})");
    assert!(
        workers.iter().all(|p| by_pid.contains_key(p)),
        "[{}] not every worker served: {by_pid:?}, workers {workers:?}",
        w.mode()
    );
    let v = w.verdict(&seen, &[&master]);
    if shim {
        v.assert_all_smcr(20);
        let t = &v.servers[0];
        assert!(
            workers
                .iter()
                .all(|p| t.by_pid.get(p).is_some_and(|&n| n > 0)),
            "not every worker accepted SMC-R connections: {:?} (workers {workers:?})\n{}",
            t.by_pid,
            v.summary()
        );
    } else {
        v.assert_tcp_baseline(20);
    }
}

/// Scenario 3: PostgreSQL: initdb (plain: no network), the postmaster as `postgres` on
/// 127.0.0.1, `pgbench -i`, then `pgbench -c 4 -t 500`, all as postgres.
fn postgres_pgbench(shim: bool) {
    let Some(w) = World::new("postgres", shim, &[]) else {
        return;
    };
    let Some(bin) = pg_bin() else {
        common::have("/usr/lib/postgresql/VERSION/bin/postgres");
        return;
    };
    let pg = User::or_nobody("postgres");
    let port = common::port(BASE);
    let ps = port.to_string();
    let root = w.private_dir("pg", &pg);
    let data = root.join("data");
    let sock = w.private_dir("pg-sock", &pg);
    let prog = |p: &str| bin.join(p).to_str().unwrap().to_owned();
    w.initdb(&pg, &bin, &data);
    let mut server = w.spawn(
        &w.spec("postgres").user(&pg),
        &prog("postgres"),
        &[
            "-D",
            data.to_str().unwrap(),
            "-k",
            sock.to_str().unwrap(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-p",
            &ps,
        ],
    );
    w.wait_output(
        &mut server,
        "ready to accept connections",
        Duration::from_secs(30),
    );
    w.wait_listening(&Net::Host, port, &mut server);
    // The client as another user than the server, as on a real host.
    let nobody = User::or_nobody("nobody");
    let (run, seen) = w.pgbench(&nobody, &bin, port);
    w.check_pgbench(&run);
    eprintln!(
        "pgbench [{}]: {}",
        w.mode(),
        run.stdout
            .lines()
            .filter(|l| l.starts_with("tps") || l.starts_with("latency"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let v = w.verdict(&seen, &[&server]);
    if shim {
        // pgbench's 4 clients, each served by a backend the postmaster forked (counted while
        // they ran: a backend's area goes with it).
        v.assert_all_smcr(4);
        v.assert_shared_memory(nobody.uid);
        // Every server side was SMC-R, negotiated in the backend: pgbench -i's connection,
        // pgbench's first one and its 4 clients.
        let log = std::fs::read_to_string(w.log_path("postgres")).unwrap_or_default();
        let accepts = log.lines().filter(|l| l.contains(" accept ")).count();
        let smcr = log
            .lines()
            .filter(|l| l.contains(" accept ") && l.contains("): SMC-R"))
            .count();
        assert!(
            accepts >= 6 && smcr == accepts,
            "postgres: {smcr} of {accepts} accepted connections SMC-R, expected 6 or more, all\n{log}"
        );
    } else {
        v.assert_tcp_baseline(4);
    }
    // PostgreSQL's fast shutdown, which removes its shared memory segments from /dev/shm.
    server.stop(libc::SIGINT, Duration::from_secs(20));
}

/// Scenario 4: four redis-server/redis-benchmark pairs at once, 8 shimmed processes: on
/// 127.0.0.1, or servers in one namespace and clients in another (veth, `nsenter`).
fn four_redis_pairs(shim: bool, across_namespaces: bool) {
    let tag = if across_namespaces {
        "redis4-netns"
    } else {
        "redis4"
    };
    let Some(w) = World::new(tag, shim, &["redis-server", "redis-benchmark", "ip"]) else {
        return;
    };
    let (redis, nobody) = (User::or_nobody("redis"), User::or_nobody("nobody"));
    let pair = across_namespaces.then(NetPair::new);
    if shim && let Some(p) = &pair {
        // The administrator's step for namespaces it makes (the program's users cannot).
        harness::attach_steering(&p.a);
        harness::attach_steering(&p.b);
    }
    let (server_net, client_net, addr) = match &pair {
        Some(p) => (
            Net::Nsenter(p.a.clone()),
            Net::Nsenter(p.b.clone()),
            NetPair::ADDR_A,
        ),
        None => (Net::Host, Net::Host, "127.0.0.1"),
    };
    let ports: Vec<u16> = (0..4).map(|_| common::port(BASE)).collect();
    let mut servers = Vec::new();
    for (i, &port) in ports.iter().enumerate() {
        let data = w.private_dir(&format!("redis-data-{i}"), &redis);
        let spec = w
            .spec(&format!("redis-server-{i}"))
            .user(&redis)
            .net(server_net.clone());
        let mut s = redis_server(&w, spec, addr, port, &data);
        w.wait_listening(&server_net, port, &mut s);
        servers.push(s);
    }
    let sampler = w.sampler(&server_net, &ports);
    let benches: Vec<Proc> = ports
        .iter()
        .enumerate()
        .map(|(i, &port)| {
            let spec = w
                .spec(&format!("redis-benchmark-{i}"))
                .user(&nobody)
                .net(client_net.clone());
            redis_benchmark(&w, spec, addr, port)
        })
        .collect();
    let done: Vec<Finished> = benches
        .into_iter()
        .map(|b| b.finish(CLIENT_TIMEOUT * 2))
        .collect();
    let seen = sampler.stop();
    for d in &done {
        check_benchmark(&w, d);
    }
    let v = w.verdict(&seen, &servers.iter().collect::<Vec<_>>());
    v.assert_mode(shim, 50, 4);
    if shim {
        // Two users in two network namespaces of one host: shared memory, found through the
        // host-wide rendezvous that `smcr bpf install` made (issue 37).
        v.assert_shared_memory(nobody.uid);
    }
}

/// Two network namespaces entered by `ip netns exec` (which also gives each program a fresh
/// /sys: the launcher finds the option program's pins where `smcr bpf install` mirrors them),
/// redis-server as `redis` in one, redis-benchmark as `nobody` in the other: under the shim
/// every link moves its data through shared memory, found through `/run/smcr/rdv` (issue 37).
fn redis_across_namespaces_by_ip_netns_exec(shim: bool) {
    let Some(w) = World::new(
        "netns-exec-pair",
        shim,
        &["redis-server", "redis-benchmark", "ip"],
    ) else {
        return;
    };
    let (redis, nobody) = (User::or_nobody("redis"), User::or_nobody("nobody"));
    let pair = NetPair::new();
    if shim {
        harness::attach_steering(&pair.a);
        harness::attach_steering(&pair.b);
    }
    let (server_net, client_net) = (
        Net::IpNetnsExec(pair.a.clone()),
        Net::IpNetnsExec(pair.b.clone()),
    );
    let port = common::port(BASE);
    let data = w.private_dir("redis-data", &redis);
    let spec = w
        .spec("redis-server")
        .user(&redis)
        .net(server_net.clone())
        .launcher();
    let mut server = redis_server(&w, spec, NetPair::ADDR_A, port, &data);
    w.wait_listening(&server_net, port, &mut server);
    let sampler = w.sampler(&server_net, &[port]);
    let spec = w
        .spec("redis-benchmark")
        .user(&nobody)
        .net(client_net)
        .launcher();
    let bench = redis_benchmark(&w, spec, NetPair::ADDR_A, port).finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    check_benchmark(&w, &bench);
    let v = w.verdict(&seen, &[&server]);
    v.assert_mode(shim, 50, 1);
    if shim {
        v.assert_shared_memory(nobody.uid);
    }
}

/// Scenario 5: dual stack: nginx on `[::]` with one AF_INET6 socket (ipv6only=off). An
/// IPv4 client to 127.0.0.1 (v4-mapped on the server) must go over SMC-R; a native IPv6
/// client to [::1] stays TCP with a named reason in smc-stat.
fn dual_stack_listener(shim: bool) {
    let Some(w) = World::new("dualstack", shim, &["nginx", "wrk"]) else {
        return;
    };
    let port = common::port(BASE);
    let conf = nginx_conf(&w, 1, &format!("[::]:{port} ipv6only=off"));
    let (master, _) = nginx(&w, &conf, port, 1);
    // IPv4 to the dual-stack socket.
    let sampler = w.sampler(&Net::Host, &[port]);
    let out = wrk(
        &w,
        "wrk-ipv4",
        1,
        8,
        2,
        &format!("http://127.0.0.1:{port}/file64k"),
    );
    let seen = sampler.stop();
    check_wrk(&w, &out);
    let v = w.verdict(&seen, &[&master]);
    v.assert_mode(shim, 8, 8);
    // Native IPv6.
    let sampler = w.sampler(&Net::Host, &[port]);
    let out = wrk(
        &w,
        "wrk-ipv6",
        1,
        4,
        2,
        &format!("http://[::1]:{port}/file64k"),
    );
    let seen = sampler.stop();
    check_wrk(&w, &out);
    let v = w.verdict(&seen, &[&master]);
    if shim {
        let reasons = v.assert_tcp_named();
        eprintln!("IPv6 connections stayed TCP: {reasons:?}");
    } else {
        v.assert_tcp_baseline(4);
    }
}

/// Scenario 6: redis-server and redis-benchmark inside a namespace entered with `ip netns
/// exec` (which remounts /sys, hiding /sys/fs/bpf), started through the launcher `smcr
/// run`: they must run, and go over SMC-R or fall back with a named reason.
fn ip_netns_exec_with_launcher(shim: bool) {
    let Some(w) = World::new(
        "netns-exec",
        shim,
        &["redis-server", "redis-benchmark", "ip"],
    ) else {
        return;
    };
    let ns = harness::Netns::new();
    let net = Net::IpNetnsExec(ns.name.clone());
    let (redis, nobody) = (User::or_nobody("redis"), User::or_nobody("nobody"));
    let port = common::port(BASE);
    let data = w.private_dir("redis-data", &redis);
    let spec = w
        .spec("redis-server")
        .user(&redis)
        .net(net.clone())
        .launcher();
    let mut server = redis_server(&w, spec, "127.0.0.1", port, &data);
    w.wait_listening(&net, port, &mut server);
    let sampler = w.sampler(&net, &[port]);
    let spec = w
        .spec("redis-benchmark")
        .user(&nobody)
        .net(net.clone())
        .launcher();
    let bench = redis_benchmark(&w, spec, "127.0.0.1", port).finish(CLIENT_TIMEOUT);
    let seen = sampler.stop();
    check_benchmark(&w, &bench);
    let v = w.verdict(&seen, &[&server]);
    if !shim {
        v.assert_tcp_baseline(1);
    } else if !v.unavailable.is_empty() {
        // SMC-R unavailable in the namespace: fine if smc-stat names why.
        eprintln!("{}", v.summary());
        assert!(
            v.servers_in_stat == 1
                && v.unavailable
                    .iter()
                    .all(|u| harness::named(&serde_json::Value::from(u.as_str()))),
            "SMC-R unavailable without a named reason\n{}",
            v.summary()
        );
    } else {
        let n = v.assert_smcr_or_named(50);
        eprintln!("{n} SMC-R connections under ip netns exec");
    }
}

/// Scenario 7: `ulimit -n 256` on both ends, 200 connections open at once, each echoing
/// 1 KiB: every one must work; some may fall back (with a named reason).
fn fd_limit_256_with_200_connections(shim: bool) {
    let Some(w) = World::new("fdlimit", shim, &["python3"]) else {
        return;
    };
    let v = python_pair(&w, ECHO_SERVER, &[], 200, 1024, 256);
    if shim {
        let n = v.assert_smcr_or_named(200);
        eprintln!("{n} of 200 connections were SMC-R under ulimit -n 256");
    } else {
        v.assert_tcp_baseline(200);
    }
}

/// Scenario 8: inetd-style fork per connection (`fork`), and fork + exec of a separate
/// program on fds 0/1 (`exec`): 10 connections, 64 KiB echoed on each.
fn fork_per_connection(shim: bool, mode: &str) {
    let Some(w) = World::new(&format!("fork-{mode}"), shim, &["python3"]) else {
        return;
    };
    let v = python_pair(&w, FORK_SERVER, &[mode], 10, 65536, 1024);
    v.assert_mode(shim, 10, 10);
}

/// Scenario 8b: the forking server's parent also waits on each connection (select, 0.3 s)
/// while its child echoes: both processes use it at once, so it stays TCP (SHARED) — decided
/// by one of them, the other following the claim, with one Decline on the wire (a second one
/// would reach the client as data: the echo would differ).
fn fork_shared_per_connection(shim: bool) {
    let Some(w) = World::new("fork-shared", shim, &["python3"]) else {
        return;
    };
    let v = python_pair(&w, FORK_SERVER, &["shared"], 10, 65536, 1024);
    if shim {
        let reasons = v.assert_tcp_named();
        assert!(
            reasons.keys().all(|r| r.contains("SHARED")),
            "expected SHARED only: {reasons:?}"
        );
    } else {
        v.assert_tcp_baseline(10);
    }
}

/// Under the shim: every worker of a prefork server accepted SMC-R connections (its own
/// totals in smc-stat).
fn assert_each_worker_smcr(v: &harness::Verdict, workers: &[u32]) {
    let t = &v.servers[0];
    assert!(
        workers
            .iter()
            .all(|p| t.by_pid.get(p).is_some_and(|&n| n > 0)),
        "not every worker accepted SMC-R connections: {:?} (workers {workers:?})\n{}",
        t.by_pid,
        v.summary()
    );
}

/// Scenario 9: a second prefork server: gunicorn with 2 sync workers (one connection at a
/// time each, closed after every answer: a connection per request) serving a WSGI app's
/// 64 KiB, run as nobody directly (as gunicorn's deployment guide's systemd unit does,
/// `User=`; its master never needs root for a port above 1024); wrk `-t2 -c20 -d5s` as
/// nobody. Both workers must serve (access log `<PID> STATUS BYTES`; under the shim SMC-R in
/// each one's totals).
fn gunicorn_two_sync_workers(shim: bool) {
    let Some(w) = World::new("gunicorn", shim, &["gunicorn", "wrk"]) else {
        return;
    };
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let app = w.file("wsgi/app.py", WSGI_APP.as_bytes());
    let logs = w.private_dir("gunicorn-logs", &nobody);
    let access = logs.join("access.log");
    let mut master = w.spawn(
        &w.spec("gunicorn").user(&nobody),
        "gunicorn",
        &[
            "--workers",
            "2",
            "--worker-class",
            "sync",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--chdir",
            app.parent().unwrap().to_str().unwrap(),
            "--access-logfile",
            access.to_str().unwrap(),
            "--access-logformat",
            "%(p)s %(s)s %(B)s",
            "app:application",
        ],
    );
    w.wait_listening(&Net::Host, port, &mut master);
    let workers = w.wait_workers(&mut master, 2, &String::new);
    // Each worker says so once it has forked (then it loads the app and accepts).
    let booted = |m: &harness::Proc| m.stderr().matches("Booting worker with pid").count();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while booted(&master) < 2 {
        assert!(
            master.alive() && std::time::Instant::now() < deadline,
            "[{}] gunicorn's workers did not boot:\n{}\n{}",
            w.mode(),
            harness::head(&master.stderr(), 20),
            w.log_summary()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    let sampler = w.sampler(&Net::Host, &[port]);
    let out = wrk(&w, "wrk", 2, 20, 5, &format!("http://127.0.0.1:{port}/"));
    let seen = sampler.stop();
    let requests = check_wrk(&w, &out);
    // A worker logs an answer after sending it: the last lines may follow wrk's count.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (by_pid, logged) = loop {
        let by_pid = access_log_by_pid(&w, &access, 20);
        let logged: usize = by_pid.values().sum();
        if logged as u64 >= requests || std::time::Instant::now() > deadline {
            break (by_pid, logged);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("access log lines per worker: {by_pid:?} (workers {workers:?})");
    assert!(
        workers.iter().all(|p| by_pid.contains_key(p)) && logged as u64 >= requests,
        "[{}] {logged} access log lines for {requests} requests, per pid {by_pid:?}, workers {workers:?}\n{}",
        w.mode(),
        harness::head(&master.stderr(), 20)
    );
    let v = w.verdict(&seen, &[&master]);
    if shim {
        v.assert_all_smcr(20);
        assert_each_worker_smcr(&v, &workers);
    } else {
        v.assert_tcp_baseline(20);
    }
}

/// A dual-stack HTTP server that printed `listening on …` and listens on `port` with one
/// AF_INET6 socket on `::` (`ss`: `*:PORT`); wrk `-t2 -c20 -d5s` as nobody to 127.0.0.1
/// (IPv4, v4-mapped on the server), which must go over SMC-R.
fn wrk_to_dual_stack_server(w: &World, server: &mut harness::Proc, port: u16) {
    w.wait_output(server, "listening on", Duration::from_secs(30));
    w.wait_listening(&Net::Host, port, server);
    let listening = harness::listeners(&Net::Host, port);
    assert_eq!(
        listening,
        vec![format!("*:{port}")],
        "[{}] {} is not on one dual-stack socket: {}",
        w.mode(),
        server.name,
        server.stdout()
    );
    eprintln!("{}: {}", server.name, server.stdout().trim());
    let sampler = w.sampler(&Net::Host, &[port]);
    let out = wrk(w, "wrk", 2, 20, 5, &format!("http://127.0.0.1:{port}/"));
    let seen = sampler.stop();
    check_wrk(w, &out);
    assert!(
        server.alive(),
        "[{}] {} exited:\n{}\n{}",
        w.mode(),
        server.name,
        harness::head(&server.stderr(), 20),
        w.log_summary()
    );
    let v = w.verdict(&seen, &[server]);
    if w.shim {
        v.assert_all_smcr(20);
    } else {
        v.assert_tcp_baseline(20);
    }
}

/// Scenario 10: Node.js (`http.createServer(…).listen(PORT)`: Node's default dual-stack
/// socket on `::`) as nobody, 64 KiB answers; wrk to 127.0.0.1.
fn node_dual_stack(shim: bool) {
    let Some(w) = World::new("node", shim, &["node", "wrk"]) else {
        return;
    };
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let js = w.file("server.js", NODE_SERVER.as_bytes());
    let mut server = w.spawn(
        &w.spec("node").user(&nobody),
        "node",
        &[js.to_str().unwrap(), &port.to_string()],
    );
    wrk_to_dual_stack_server(&w, &mut server, port);
}

/// Scenario 11: Java: `com.sun.net.httpserver.HttpServer` on `new InetSocketAddress(PORT)`
/// (the JDK's dual-stack socket on `::`), compiled here with javac (plain, as root, as a
/// package build would), run with `java` as nobody; wrk to 127.0.0.1.
fn java_dual_stack(shim: bool) {
    let Some(w) = World::new("java", shim, &["javac", "java", "wrk"]) else {
        return;
    };
    let nobody = User::or_nobody("nobody");
    let port = common::port(BASE);
    let src = w.file("java/Server.java", JAVA_SERVER.as_bytes());
    let classes = src.parent().unwrap();
    let javac = w.run(
        &w.spec("javac").plain(),
        "javac",
        &["-d", classes.to_str().unwrap(), src.to_str().unwrap()],
        Duration::from_secs(60),
    );
    w.expect_ok(&javac);
    for e in std::fs::read_dir(classes).unwrap().flatten() {
        // Readable by nobody whatever the test's umask.
        std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let mut server = w.spawn(
        &w.spec("java").user(&nobody),
        "java",
        &[
            "-cp",
            classes.to_str().unwrap(),
            "Server",
            &port.to_string(),
        ],
    );
    wrk_to_dual_stack_server(&w, &mut server, port);
}

/// Scenario 12: a server that drops privileges after start: memcached started by root with
/// `-u memcache` (as Debian's unit starts it: root, `-u memcache` from /etc/memcached.conf),
/// so the shim starts as root and goes on as memcache; a Python client of the text protocol
/// as nobody (memtier_benchmark is not packaged in Debian 12): 20 connections, 100 rounds of
/// set + get of 1 KiB on each (4000 commands), every reply checked, then memcached's own
/// `stats` must count them. The client's sockets block (pymemcache's default: no timeout);
/// `timeout_s` gives them python-memcached's socket timeout instead (3 s), and then no reply
/// may take as long as that.
fn memcached_drops_privileges(shim: bool, timeout_s: Option<u32>) {
    let tag = if timeout_s.is_some() {
        "memcached-timeouts"
    } else {
        "memcached"
    };
    let Some(w) = World::new(tag, shim, &["memcached", "python3"]) else {
        return;
    };
    let (memcache, nobody) = (User::or_nobody("memcache"), User::or_nobody("nobody"));
    let port = common::port(BASE);
    let ps = port.to_string();
    const CONNS: u64 = 20;
    const ROUNDS: u64 = 100;
    let mut server = w.spawn(
        &w.spec("memcached"),
        "memcached",
        &[
            "-u",
            &memcache.name,
            "-l",
            "127.0.0.1",
            "-p",
            &ps,
            "-m",
            "64",
            "-v",
        ],
    );
    w.wait_listening(&Net::Host, port, &mut server);
    // It runs as memcache now (memcached drops root before it binds).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while harness::uids(server.pid()) != Some((memcache.uid, memcache.uid)) {
        assert!(
            server.alive() && std::time::Instant::now() < deadline,
            "[{}] memcached runs as {:?}, not {} ({})",
            w.mode(),
            harness::uids(server.pid()),
            memcache.name,
            memcache.uid
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let client_file = w.file("client.py", MEMCACHED_CLIENT.as_bytes());
    let mut client = w.spawn(
        &w.spec("client").user(&nobody).stdin(),
        "python3",
        &[
            client_file.to_str().unwrap(),
            "127.0.0.1",
            &ps,
            &CONNS.to_string(),
            &ROUNDS.to_string(),
            &timeout_s.map_or("none".to_owned(), |t| t.to_string()),
        ],
    );
    w.wait_output(
        &mut client,
        &format!("done {} commands", CONNS * ROUNDS * 2),
        CLIENT_TIMEOUT,
    );
    let seen = w.snapshot(&Net::Host, &[port]);
    let v = w.verdict(&seen, &[&server]);
    client.write_stdin("done\n");
    client.close_stdin();
    let done = client.finish(CLIENT_TIMEOUT);
    w.expect_ok(&done);
    // memcached's own account.
    let stats: std::collections::BTreeMap<&str, u64> = done
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("stats "))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, n)| Some((k, n.parse().ok()?)))
        .collect();
    eprintln!("memcached [{}]: {stats:?}", w.mode());
    let n = |k: &str| stats.get(k).copied();
    assert!(
        n("cmd_set") == Some(CONNS * ROUNDS)
            && n("get_hits") == Some(CONNS * ROUNDS)
            && n("get_misses") == Some(0)
            && n("curr_connections").is_some_and(|c| c >= CONNS),
        "[{}] memcached's stats {stats:?}, expected {} sets and hits, no miss\n{}",
        w.mode(),
        CONNS * ROUNDS,
        done.describe()
    );
    // A reply on loopback takes microseconds; one that waited for the socket timeout was
    // not woken when it arrived.
    let slowest = done
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("slowest "))
        .and_then(|t| t.parse::<f64>().ok());
    eprintln!("memcached [{}]: slowest reply {slowest:?} s", w.mode());
    assert!(
        slowest.is_some_and(|t| t < 2.0),
        "[{}] the slowest reply took {slowest:?} s (socket timeout {timeout_s:?} s): a wait for a reply that had arrived was not woken\n{}\n{}",
        w.mode(),
        done.describe(),
        w.log_summary()
    );
    assert!(
        server.alive(),
        "[{}] memcached exited:\n{}\n{}",
        w.mode(),
        harness::head(&server.stderr(), 20),
        w.log_summary()
    );
    if shim {
        v.assert_all_smcr(CONNS);
    } else {
        v.assert_tcp_baseline(CONNS as usize);
    }
}

// ---------------------------------------------------------------------------------------

/// The scenarios over plain TCP: the harness and the programs work here, and the byte
/// check sees TCP payload.
mod baseline {
    #[test]
    fn redis_as_distribution_users() {
        super::redis_as_distribution_users(false);
    }
    #[test]
    fn nginx_master_and_two_workers() {
        super::nginx_master_and_two_workers(false);
    }
    #[test]
    fn postgres_pgbench() {
        super::postgres_pgbench(false);
    }
    #[test]
    fn four_redis_pairs_on_one_address() {
        super::four_redis_pairs(false, false);
    }
    #[test]
    fn four_redis_pairs_across_namespaces() {
        super::four_redis_pairs(false, true);
    }
    #[test]
    fn redis_across_namespaces_by_ip_netns_exec() {
        super::redis_across_namespaces_by_ip_netns_exec(false);
    }
    #[test]
    fn dual_stack_listener() {
        super::dual_stack_listener(false);
    }
    #[test]
    fn ip_netns_exec_with_launcher() {
        super::ip_netns_exec_with_launcher(false);
    }
    #[test]
    fn fd_limit_256_with_200_connections() {
        super::fd_limit_256_with_200_connections(false);
    }
    #[test]
    fn fork_per_connection() {
        super::fork_per_connection(false, "fork");
    }
    #[test]
    fn fork_exec_per_connection() {
        super::fork_per_connection(false, "exec");
    }
    #[test]
    fn fork_shared_per_connection() {
        super::fork_shared_per_connection(false);
    }
    #[test]
    fn gunicorn_two_sync_workers() {
        super::gunicorn_two_sync_workers(false);
    }
    #[test]
    fn node_dual_stack() {
        super::node_dual_stack(false);
    }
    #[test]
    fn java_dual_stack() {
        super::java_dual_stack(false);
    }
    #[test]
    fn memcached_drops_privileges() {
        super::memcached_drops_privileges(false, None);
    }
    #[test]
    fn memcached_client_with_socket_timeouts() {
        super::memcached_drops_privileges(false, Some(3));
    }
}

/// The same under the shim, with the SMC-R checks.
mod over_smcr {
    #[test]
    fn redis_as_distribution_users() {
        super::redis_as_distribution_users(true);
    }
    #[test]
    fn nginx_master_and_two_workers() {
        super::nginx_master_and_two_workers(true);
    }
    #[test]
    fn postgres_pgbench() {
        super::postgres_pgbench(true);
    }
    #[test]
    fn four_redis_pairs_on_one_address() {
        super::four_redis_pairs(true, false);
    }
    #[test]
    fn four_redis_pairs_across_namespaces() {
        super::four_redis_pairs(true, true);
    }
    #[test]
    fn redis_across_namespaces_by_ip_netns_exec() {
        super::redis_across_namespaces_by_ip_netns_exec(true);
    }
    #[test]
    fn dual_stack_listener() {
        super::dual_stack_listener(true);
    }
    #[test]
    fn ip_netns_exec_with_launcher() {
        super::ip_netns_exec_with_launcher(true);
    }
    #[test]
    fn fd_limit_256_with_200_connections() {
        super::fd_limit_256_with_200_connections(true);
    }
    #[test]
    fn fork_per_connection() {
        super::fork_per_connection(true, "fork");
    }
    #[test]
    fn fork_exec_per_connection() {
        super::fork_per_connection(true, "exec");
    }
    #[test]
    fn fork_shared_per_connection() {
        super::fork_shared_per_connection(true);
    }
    #[test]
    fn gunicorn_two_sync_workers() {
        super::gunicorn_two_sync_workers(true);
    }
    #[test]
    fn node_dual_stack() {
        super::node_dual_stack(true);
    }
    #[test]
    fn java_dual_stack() {
        super::java_dual_stack(true);
    }
    #[test]
    fn memcached_drops_privileges() {
        super::memcached_drops_privileges(true, None);
    }
    #[test]
    fn memcached_client_with_socket_timeouts() {
        super::memcached_drops_privileges(true, Some(3));
    }
}
