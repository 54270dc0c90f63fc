//! Real programs, unmodified, under the shim (issue 5): iperf3 (loopback, with sendfile, reverse,
//! and across two network namespaces), sockperf ping-pong and throughput in its epoll, poll and
//! select modes, and curl against Python's http.server. Each checks the program's own result and
//! that its connections were SMC-R (the library's log).

mod common;

use std::process::Stdio;

use common::{Bg, NetPair, Shim, have, port, root, run_ok, wait_listening};

fn iperf3_bytes(json: &str) -> u64 {
    // "sum_received": { ... "bytes": N ... }
    let at = json
        .find("\"sum_received\"")
        .expect("iperf3 JSON has sum_received");
    let rest = &json[at..];
    let b = rest.find("\"bytes\":").unwrap() + 8;
    rest[b..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn iperf3_client_and_server_move_data_over_smcr() {
    if !have("iperf3") {
        return;
    }
    let shim = Shim::new("iperf3");
    for extra in [&[][..], &["-Z"][..], &["-R"][..]] {
        let p = port(27000);
        let ps = p.to_string();
        let server = Bg(shim
            .cmd(true, "iperf3")
            .args(["-s", "-1", "-B", "127.0.0.2", "-p", &ps])
            .stdout(Stdio::null())
            .spawn()
            .unwrap());
        wait_listening(None, "127.0.0.2", p);
        let mut c = shim.cmd(true, "iperf3");
        c.args(["-c", "127.0.0.2", "-p", &ps, "-t", "2", "-J"])
            .args(extra);
        let json = run_ok(&mut c, &format!("iperf3 {extra:?}"));
        let bytes = iperf3_bytes(&json);
        eprintln!(
            "iperf3 {extra:?}: {bytes} bytes in 2 s ({:.2} Gbit/s)",
            bytes as f64 * 8.0 / 2e9
        );
        assert!(bytes > 10 << 20, "{json}");
        drop(server);
    }
    // Control and data connection, three runs, both sides.
    assert!(shim.smcr_count("connect") >= 6, "{}", shim.log());
    assert!(shim.smcr_count("accept") >= 6, "{}", shim.log());
}

#[test]
fn iperf3_across_two_namespaces() {
    if !have("iperf3") || !root("network namespaces") {
        return;
    }
    let shim = Shim::new("iperf3ns");
    let net = NetPair::new();
    let p = port(27000);
    let ps = p.to_string();
    let mut s = NetPair::cmd(&net.b, "iperf3");
    shim.apply(&mut s);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    s.env("SMCR_SAME_HOST", "off");
    let server = Bg(s
        .args(["-s", "-1", "-B", NetPair::ADDR_B, "-p", &ps])
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(Some(&net.b), NetPair::ADDR_B, p);
    let mut c = NetPair::cmd(&net.a, "iperf3");
    shim.apply(&mut c);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    c.env("SMCR_SAME_HOST", "off");
    c.args(["-c", NetPair::ADDR_B, "-p", &ps, "-t", "2", "-J"]);
    let bytes = iperf3_bytes(&run_ok(&mut c, "iperf3 across namespaces"));
    eprintln!(
        "iperf3 across namespaces: {bytes} bytes in 2 s ({:.2} Gbit/s)",
        bytes as f64 * 8.0 / 2e9
    );
    assert!(bytes > 10 << 20);
    drop(server);
    let log = shim.log();
    // iperf3 waits in select: both ends' selects drive their link groups.
    assert!(
        log.matches("poll/select now drives link group").count() >= 2,
        "{log}"
    );
    assert!(shim.smcr_count("connect") >= 2, "{log}");
    assert!(shim.smcr_count("accept") >= 2, "{log}");
}

#[test]
fn python_polling_from_two_threads_across_two_namespaces_loses_nothing() {
    // A Python client with a timeout polls before every recv and send, from two threads at
    // once (one sends 1 MiB of random bytes, one reads the echo): each poll watches the link
    // group's descriptors and RoCE socket and handles the packets itself, over UDP. The echo
    // must come back byte for byte.
    if !have("python3") || !root("network namespaces") {
        return;
    }
    let shim = Shim::new("pypollns");
    let net = NetPair::new();
    let p = port(27000);
    let ps = p.to_string();
    let py = |name: &str| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/py")
            .join(name)
    };
    let mut s = NetPair::cmd(&net.b, "python3");
    shim.apply(&mut s);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    s.env("SMCR_SAME_HOST", "off");
    let server = s
        .arg(py("server.py"))
        .args([NetPair::ADDR_B, &ps])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_listening(Some(&net.b), NetPair::ADDR_B, p);
    let mut c = NetPair::cmd(&net.a, "python3");
    shim.apply(&mut c);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    c.env("SMCR_SAME_HOST", "off");
    c.arg(py("client.py"))
        .args([NetPair::ADDR_B, &ps, "--timeout"]);
    let out = run_ok(&mut c, "client.py --timeout across namespaces");
    assert!(out.contains("OK"), "{out}");
    let served = server.wait_with_output().unwrap();
    let served = String::from_utf8_lossy(&served.stdout);
    assert!(served.contains("SERVED 1118581"), "{served}");
    let log = shim.log();
    assert!(log.contains("poll/select now drives link group"), "{log}");
    assert!(shim.smcr_count("connect") >= 1, "{log}");
    assert!(shim.smcr_count("accept") >= 1, "{log}");
}

#[test]
fn redis_across_two_namespaces_with_the_event_loops_receiving() {
    // Across namespaces (UDP): redis-server and redis-benchmark are epoll loops, so each
    // watches its RoCE socket itself while it holds its link group. Short values make short
    // WRITEs (lengthened to share a datagram with their CDC); redis-cli then checks, over the
    // same link group, that values of every short length arrive intact.
    if !have("redis-server") || !root("network namespaces") {
        return;
    }
    let shim = Shim::new("redisns");
    let net = NetPair::new();
    let p = port(27000);
    let ps = p.to_string();
    let mut s = NetPair::cmd(&net.b, "redis-server");
    shim.apply(&mut s);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    s.env("SMCR_SAME_HOST", "off");
    let server = Bg(s
        .args(["--bind", NetPair::ADDR_B, "--port", &ps])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(Some(&net.b), NetPair::ADDR_B, p);
    for d in ["3", "1000"] {
        let mut b = NetPair::cmd(&net.a, "redis-benchmark");
        shim.apply(&mut b);
        // Two namespaces stand for two hosts: the RoCE path, not shared memory.
        b.env("SMCR_SAME_HOST", "off");
        b.args(["-h", NetPair::ADDR_B, "-p", &ps, "-q", "-t", "set,get"])
            .args(["-n", "20000", "-c", "20", "-d", d]);
        let out = run_ok(&mut b, "redis-benchmark across namespaces");
        eprintln!("redis-benchmark -d {d} across namespaces: {}", out.trim());
        assert_eq!(out.matches("requests per second").count(), 2, "{out}");
    }
    // Values of 0..=40 bytes, and enough commands to wrap the 64 KiB ring several times.
    let mut cmds = String::new();
    for i in 0..3000 {
        let v: String = (0..i % 41)
            .map(|k| (b'a' + ((i + k) % 26) as u8) as char)
            .collect();
        cmds += &format!("SET k{i} \"{v}\"\nGET k{i}\n");
    }
    let mut cli = NetPair::cmd(&net.a, "redis-cli");
    shim.apply(&mut cli);
    // Two namespaces stand for two hosts: the RoCE path, not shared memory.
    cli.env("SMCR_SAME_HOST", "off");
    cli.args(["-h", NetPair::ADDR_B, "-p", &ps])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = cli.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        stdin.write_all(cmds.as_bytes()).unwrap();
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    let mut lines = out.lines();
    for i in 0..3000 {
        let v: String = (0..i % 41)
            .map(|k| (b'a' + ((i + k) % 26) as u8) as char)
            .collect();
        assert_eq!(lines.next(), Some("OK"), "SET k{i}");
        assert_eq!(lines.next(), Some(v.as_str()), "GET k{i}");
    }
    drop(server);
    let log = shim.log();
    assert!(
        log.contains("now watches the RoCE socket (application-driven receive)"),
        "{log}"
    );
    assert!(shim.smcr_count("connect") >= 41, "{log}");
    assert!(shim.smcr_count("accept") >= 41, "{log}");
}

#[test]
fn sockperf_ping_pong_and_throughput_in_epoll_poll_and_select_modes() {
    if !have("sockperf") {
        return;
    }
    let shim = Shim::new("sockperf");
    for mode in ["epoll", "poll", "select"] {
        let p = port(27000);
        let feed = shim.dir.join(format!("feed-{mode}"));
        std::fs::write(&feed, format!("T:127.0.0.2:{p}\n")).unwrap();
        let feed = feed.to_str().unwrap().to_owned();
        let server = Bg(shim
            .cmd(true, "sockperf")
            .args(["sr", "-f", &feed, "-F", mode])
            .stdout(Stdio::null())
            .spawn()
            .unwrap());
        wait_listening(None, "127.0.0.2", p);
        for (test, size) in [("pp", "64"), ("tp", "1024")] {
            let mut c = shim.cmd(true, "sockperf");
            c.args([test, "-f", &feed, "-F", mode, "-t", "1", "-m", size]);
            let out = run_ok(&mut c, &format!("sockperf {test} -F {mode}"));
            let summary: Vec<&str> = out.lines().filter(|l| l.contains("Summary")).collect();
            eprintln!("sockperf {test} -F {mode}: {summary:?}");
            assert!(!summary.is_empty() && !out.contains("ERROR"), "{out}");
            if test == "pp" {
                assert!(out.contains("Latency is"), "{out}");
            } else {
                assert!(out.contains("Message Rate is"), "{out}");
            }
        }
        drop(server);
    }
    assert!(shim.smcr_count("connect") >= 6, "{}", shim.log());
    assert!(shim.smcr_count("accept") >= 6, "{}", shim.log());
}

#[test]
fn application_driven_epoll_handles_messages_on_the_waiting_thread() {
    // The default: the link group's event descriptor joins the application's epoll set, the
    // thread in epoll_wait handles what arrives, and the group stays held between its waits.
    // SMCR_APP_DRIVE is not set: this is what a user gets.
    epoll_apps(None);
}

#[test]
fn epoll_applications_work_with_the_poller_alone() {
    // SMCR_APP_DRIVE=off: the group's poller handles everything, as before.
    epoll_apps(Some("off"));
}

/// sockperf (ping-pong, throughput, large messages) and redis-benchmark, both ends epoll
/// event loops, with `SMCR_APP_DRIVE=mode` (unset: `None`).
fn epoll_apps(mode: Option<&str>) {
    if !have("sockperf") || !have("redis-server") {
        return;
    }
    let shim = Shim::new(&format!("appdrive-{}", mode.unwrap_or("default")));
    let shimmed = |prog: &str| {
        let mut c = shim.cmd(true, prog);
        if let Some(m) = mode {
            c.env("SMCR_APP_DRIVE", m);
        }
        c
    };
    let p = port(27000);
    let feed = shim.dir.join("feed");
    std::fs::write(&feed, format!("T:127.0.0.2:{p}\n")).unwrap();
    let feed = feed.to_str().unwrap().to_owned();
    let server = Bg(shimmed("sockperf")
        .args(["sr", "-f", &feed, "-F", "epoll"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(None, "127.0.0.2", p);
    for (test, size) in [("pp", "64"), ("tp", "1024"), ("pp", "4000")] {
        let mut c = shimmed("sockperf");
        c.args([test, "-f", &feed, "-F", "epoll", "-t", "1", "-m", size]);
        let out = run_ok(&mut c, &format!("sockperf {test} -m {size}"));
        eprintln!(
            "app-driven sockperf {test} -m {size}: {:?}",
            out.lines()
                .filter(|l| l.contains("Summary"))
                .collect::<Vec<_>>()
        );
        assert!(!out.contains("ERROR"), "{out}");
        assert!(
            out.contains(if test == "pp" {
                "Latency is"
            } else {
                "Message Rate is"
            }),
            "{out}"
        );
    }
    drop(server);
    // redis: an event loop with many connections on one link group.
    let rp = port(27000);
    let rps = rp.to_string();
    let redis = Bg(shimmed("redis-server")
        .args([
            "--bind",
            "127.0.0.2",
            "--port",
            &rps,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(None, "127.0.0.2", rp);
    let mut b = shimmed("redis-benchmark");
    b.args([
        "-h",
        "127.0.0.2",
        "-p",
        &rps,
        "-q",
        "-t",
        "set,get,lpush,lpop",
    ])
    .args(["-n", "20000", "-c", "20", "-d", "100"]);
    let out = run_ok(&mut b, "redis-benchmark");
    assert_eq!(out.matches("requests per second").count(), 4, "{out}");
    drop(redis);
    let log = shim.log();
    assert_eq!(
        log.contains("(application-driven)"),
        mode != Some("off"),
        "SMCR_APP_DRIVE={mode:?}: {log}"
    );
    assert!(shim.smcr_count("connect") >= 43, "{log}");
}

#[test]
fn curl_fetches_from_python_http_server_both_shimmed() {
    if !have("curl") {
        return;
    }
    let shim = Shim::new("curl");
    let www = shim.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let body: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(www.join("blob.bin"), &body).unwrap();
    let p = port(27000);
    let ps = p.to_string();
    let server = Bg(shim
        .cmd(true, "python3")
        .args(["-m", "http.server", "--bind", "127.0.0.2", &ps])
        .current_dir(&www)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_listening(None, "127.0.0.2", p);
    let got = shim.dir.join("got.bin");
    for _ in 0..3 {
        let mut c = shim.cmd(true, "curl");
        c.args(["-sS", "--fail", "-o"])
            .arg(&got)
            .arg(format!("http://127.0.0.2:{p}/blob.bin"));
        run_ok(&mut c, "curl");
        assert!(
            std::fs::read(&got).unwrap() == body,
            "downloaded bytes differ"
        );
    }
    drop(server);
    assert!(shim.smcr_count("connect") >= 3, "{}", shim.log());
    assert!(shim.smcr_count("accept") >= 3, "{}", shim.log());
}
