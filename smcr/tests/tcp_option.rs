//! The SMC-R TCP option on the wire: between two network namespaces, tcpdump shows
//! `fe 06 e2 d4 c3 d9` in SYN and SYN-ACK of two marked sockets, and not where Linux would not
//! send it; each socket's record says what the peer sent.

mod common;

use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use smcr::option::{self, Capability, OptionRecords};
use socket2::{Domain, Socket, Type};

use common::{ACK, Capture, NetPair, SYN, TestInstall, contains, in_netns, privileged};

fn fresh_install(tag: &str) -> TestInstall {
    let i = TestInstall::new(tag);
    // A second install finds the first.
    assert_eq!(option::install(&i.0).unwrap(), option::Installed::Present);
    i
}

fn listener(map: Option<&OptionRecords>, addr: SocketAddrV4) -> Socket {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    if let Some(map) = map {
        map.mark(s.as_fd(), false).unwrap();
    }
    s.set_reuse_address(true).unwrap();
    s.bind(&SocketAddr::V4(addr).into()).unwrap();
    s.listen(16).unwrap();
    s
}

fn connect(map: Option<&OptionRecords>, to: SocketAddrV4) -> (TcpStream, Capability) {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    if let Some(map) = map {
        map.mark(s.as_fd(), true).unwrap();
    }
    s.connect(&SocketAddr::V4(to).into()).unwrap();
    if let Some(map) = map {
        assert!(
            map.state(s.as_fd()).unwrap().connecting(),
            "a client's record says so"
        );
    }
    let cap = match map {
        Some(map) => map.state(s.as_fd()).unwrap().capability(),
        None => Capability::NotMarked,
    };
    (s.into(), cap)
}

#[test]
fn option_in_syn_and_synack_only_between_marked_sockets() {
    if !privileged("tcp option") || !common::have_tool("tcp option", "tcpdump") {
        return;
    }
    let install = fresh_install("wire");
    let net = NetPair::new().expect("network namespaces");
    let pcap = std::env::temp_dir().join(format!("smcr-option-{}.pcap", std::process::id()));
    let cap = Capture::start(&net.a, &net.veth_a, &pcap, "tcp").expect("tcpdump");

    let dir: Arc<Path> = install.0.clone().into();
    let marked_port = 7001;
    let plain_port = 7002;
    let server_addr = net.addr_b;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = {
        let dir = dir.clone();
        in_netns(&net.b, move || {
            let map = OptionRecords::open(&dir).unwrap();
            let marked = listener(Some(&map), SocketAddrV4::new(server_addr, marked_port));
            let plain = listener(None, SocketAddrV4::new(server_addr, plain_port));
            ready_tx.send(()).unwrap();
            // 1: marked client; 2: plain client (both to the marked listener).
            let mut verdicts = Vec::new();
            for _ in 0..2 {
                let (c, _) = marked.accept().unwrap();
                let st = map.state(c.as_fd()).unwrap();
                // The listener's record is cloned, not the client's CONNECTING.
                assert!(!st.connecting(), "an accepted socket is not a client's");
                verdicts.push(st.capability());
            }
            // 3: marked client to the plain listener: the accepted socket was never marked.
            let (c, _) = plain.accept().unwrap();
            verdicts.push(map.state(c.as_fd()).unwrap().capability());
            verdicts
        })
    };
    ready_rx.recv().unwrap();
    let client = {
        let dir = dir.clone();
        in_netns(&net.a, move || {
            let map = OptionRecords::open(&dir).unwrap();
            let (s1, v1) = connect(Some(&map), SocketAddrV4::new(server_addr, marked_port));
            let (s2, v2) = connect(None, SocketAddrV4::new(server_addr, marked_port));
            let (s3, v3) = connect(Some(&map), SocketAddrV4::new(server_addr, plain_port));
            let ports = [s1, s2, s3].map(|s| s.local_addr().unwrap().port());
            (ports, [v1, v2, v3])
        })
    };
    let (ports, client_verdicts) = client.join().unwrap();
    let server_verdicts = server.join().unwrap();
    // Let the last ACKs reach the capture before stopping it.
    std::thread::sleep(std::time::Duration::from_millis(200));
    cap.stop().unwrap();

    assert_eq!(
        client_verdicts,
        [
            Capability::PeerCapable,
            Capability::NotMarked,
            Capability::PeerNotCapable
        ]
    );
    assert_eq!(
        server_verdicts,
        [
            Capability::PeerCapable,
            Capability::PeerNotCapable,
            Capability::NotMarked
        ]
    );

    let segs = common::tcp_segments(&pcap).unwrap();
    eprintln!("{} segments captured", segs.len());
    if std::env::var_os("SMCR_KEEP_PCAP").is_none() {
        let _ = std::fs::remove_file(&pcap);
    }
    let find = |port: u16, flags: u8| {
        let s: Vec<_> = segs
            .iter()
            .filter(|s| {
                s.flags & (SYN | ACK) == flags
                    && if flags == SYN {
                        s.sport == port
                    } else {
                        s.dport == port
                    }
            })
            .collect();
        assert!(!s.is_empty(), "no segment flags {flags:#x} for port {port}");
        s[0].clone()
    };
    let expect = [(true, true), (false, false), (true, false)];
    for (port, (syn_has, synack_has)) in ports.iter().zip(expect) {
        let syn = find(*port, SYN);
        let synack = find(*port, SYN | ACK);
        assert_eq!(
            contains(&syn.options, &option::OPTION),
            syn_has,
            "SYN {syn:02x?}"
        );
        assert_eq!(
            contains(&synack.options, &option::OPTION),
            synack_has,
            "SYN-ACK {synack:02x?}"
        );
        eprintln!("port {port}: SYN options {:02x?}", syn.options);
        eprintln!("port {port}: SYN-ACK options {:02x?}", synack.options);
    }
    // Never on any other segment: the callbacks are off once the connection is established.
    for s in segs.iter().filter(|s| s.flags & SYN == 0) {
        assert!(!contains(&s.options, &option::OPTION), "{s:?}");
    }
}

/// Kills this process at its first `bpf(2)`, as a service's `SystemCallFilter=~@privileged` does.
fn forbid_bpf() {
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let filter = [
        // A = the system call number.
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_bpf as u32,
        },
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut _,
    };
    // SAFETY: prctl with a filter program that outlives the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog
            ),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
    }
}

/// Run by `unprivileged_process_can_mark_its_sockets` as user nobody, then under a seccomp
/// filter that kills on `bpf(2)`: marking and reading work (socket options answered by the
/// install's cgroup programs), installing does not, and the map pin is root's alone.
#[test]
#[ignore = "run as a child process by unprivileged_process_can_mark_its_sockets"]
fn unprivileged_child() {
    let Some(dir) = std::env::var_os("SMCR_TEST_BPF_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    // SAFETY: geteuid has no preconditions.
    assert_ne!(unsafe { libc::geteuid() }, 0, "must run unprivileged");
    let e = option::install(&dir.with_file_name("smcr-should-not-exist")).unwrap_err();
    assert!(matches!(e, option::OptionError::NoPermission { .. }), "{e}");
    use std::os::unix::fs::PermissionsExt;
    for pin in std::fs::read_dir(&dir).unwrap() {
        let pin = pin.unwrap();
        let mode = pin.metadata().unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{:?} is open to others", pin.file_name());
    }
    // From here a bpf(2) call kills the process, and the parent sees it.
    forbid_bpf();
    let map = OptionRecords::open(&dir).expect("reach the records as nobody, without bpf(2)");
    let l = listener(Some(&map), "127.0.0.1:0".parse().unwrap());
    let port = l.local_addr().unwrap().as_socket_ipv4().unwrap().port();
    let (_c, verdict) = connect(Some(&map), SocketAddrV4::new([127, 0, 0, 1].into(), port));
    let (a, _) = l.accept().unwrap();
    assert_eq!(verdict, Capability::PeerCapable);
    assert_eq!(
        map.state(a.as_fd()).unwrap().capability(),
        Capability::PeerCapable
    );
    println!("UNPRIVILEGED-OK");
}

#[test]
fn unprivileged_process_can_mark_its_sockets() {
    if !privileged("unprivileged marking") {
        return;
    }
    use std::os::unix::process::CommandExt;
    let install = fresh_install("unpriv");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "unprivileged_child", "--ignored", "--nocapture"])
        .env("SMCR_TEST_BPF_DIR", &install.0)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("UNPRIVILEGED-OK"),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The records of one install are its own, and every other socket option behaves as without
/// the programs (they pass everything but their own level and names through).
#[test]
fn installs_keep_apart_and_other_options_pass_through() {
    if !privileged("socket-option programs") {
        return;
    }
    let (a, b) = (fresh_install("apart-a"), fresh_install("apart-b"));
    let ra = OptionRecords::open(&a.0).unwrap();
    let rb = OptionRecords::open(&b.0).unwrap();
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    ra.mark(s.as_fd(), true).unwrap();
    assert!(ra.state(s.as_fd()).unwrap().marked());
    assert!(
        !rb.state(s.as_fd()).unwrap().marked(),
        "marked for the other install"
    );
    ra.claim(s.as_fd(), true, 4242).unwrap();
    assert_eq!(
        ra.claimed(s.as_fd()).unwrap(),
        Some(option::Claim {
            smc: true,
            pid: 4242
        })
    );
    assert!(
        ra.state(s.as_fd()).unwrap().connecting(),
        "a claim keeps the flags"
    );
    ra.unmark(s.as_fd()).unwrap();
    assert_eq!(ra.state(s.as_fd()).unwrap(), option::SockOption(0));
    assert_eq!(ra.claimed(s.as_fd()).unwrap(), None);

    // Other options, set and read, on TCP and UDP sockets.
    s.set_tcp_nodelay(true).unwrap();
    assert!(s.tcp_nodelay().unwrap());
    s.set_recv_buffer_size(200_000).unwrap();
    assert!(s.recv_buffer_size().unwrap() >= 200_000);
    let u = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
    u.set_broadcast(true).unwrap();
    assert!(u.broadcast().unwrap());
    // The private level under a name no install answers: the kernel's own refusal.
    let mut v = [0u8; 8];
    let mut len = 8 as libc::socklen_t;
    // SAFETY: v and len are valid for the call.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            option::sockopt::SOL_SMCR,
            option::sockopt::optname(0xfffe, option::sockopt::OP_RECORD),
            v.as_mut_ptr().cast(),
            &mut len,
        )
    };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EOPNOTSUPP)
    );
}

/// A listener made quiet (before it goes to a program that cannot negotiate) sends no option
/// in its SYN-ACKs: a marked client sees a plain peer (PEERNOSMC), and the accepted socket has
/// no record. A marked socket that listens on the port again offers SMC-R again.
#[test]
fn a_quiet_listener_offers_nothing_until_a_marked_socket_listens_again() {
    if !privileged("quiet listeners") {
        return;
    }
    let install = fresh_install("quiet");
    let m = OptionRecords::open(&install.0).unwrap();
    let addr: SocketAddrV4 = "127.0.0.1:0".parse().unwrap();
    let l = listener(Some(&m), addr);
    let port = l.local_addr().unwrap().as_socket_ipv4().unwrap().port();
    let to = SocketAddrV4::new([127, 0, 0, 1].into(), port);
    let (_c1, before) = connect(Some(&m), to);
    assert_eq!(before, Capability::PeerCapable);
    let _ = l.accept().unwrap();

    m.quiet(l.as_fd()).unwrap();
    assert!(!m.state(l.as_fd()).unwrap().marked(), "the record goes");
    let (_c2, quiet) = connect(Some(&m), to);
    assert_eq!(
        quiet,
        Capability::PeerNotCapable,
        "a quiet port offered SMC-R"
    );
    let (a, _) = l.accept().unwrap();
    assert_eq!(m.state(a.as_fd()).unwrap(), option::SockOption(0));
    drop((l, a));

    // Another marked listener on that port advertises again.
    let l2 = listener(Some(&m), to);
    let (_c3, again) = connect(Some(&m), to);
    assert_eq!(again, Capability::PeerCapable);
    let _ = l2.accept().unwrap();

    // Quiet is per install: another install's listener on another port is untouched.
    let other = fresh_install("quiet-other");
    let mo = OptionRecords::open(&other.0).unwrap();
    let lo = listener(Some(&mo), addr);
    let po = lo.local_addr().unwrap().as_socket_ipv4().unwrap().port();
    let (_c4, v) = connect(Some(&mo), SocketAddrV4::new([127, 0, 0, 1].into(), po));
    assert_eq!(v, Capability::PeerCapable);
}

/// Two marked listeners share a port (`SO_REUSEPORT`) and one is made quiet: the port's
/// SYN-ACKs go without the option, so the other's accepted sockets must not count the client's
/// SYN as a capable peer either — both ends agree on plain TCP. Quieting a socket that is not a
/// listener (an accepted one) leaves the port offering.
#[test]
fn a_port_made_quiet_is_plain_on_both_ends_and_only_listeners_quiet_it() {
    if !privileged("quiet listeners") {
        return;
    }
    let install = fresh_install("quiet-shared");
    let m = OptionRecords::open(&install.0).unwrap();
    let shared = |to: SocketAddrV4| {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        m.mark(s.as_fd(), false).unwrap();
        s.set_reuse_port(true).unwrap();
        s.bind(&SocketAddr::V4(to).into()).unwrap();
        s.listen(16).unwrap();
        s
    };
    let first = shared("127.0.0.1:0".parse().unwrap());
    let port = first.local_addr().unwrap().as_socket_ipv4().unwrap().port();
    let to = SocketAddrV4::new([127, 0, 0, 1].into(), port);
    let second = shared(to);

    // Quieting an accepted socket leaves the port as it was.
    let (_c0, before) = connect(Some(&m), to);
    assert_eq!(before, Capability::PeerCapable);
    first.set_nonblocking(true).unwrap();
    second.set_nonblocking(true).unwrap();
    let accept_one = || loop {
        for l in [&first, &second] {
            if let Ok((a, _)) = l.accept() {
                return a;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    let a0 = accept_one();
    m.quiet(a0.as_fd()).unwrap();
    let (_c1, still) = connect(Some(&m), to);
    assert_eq!(
        still,
        Capability::PeerCapable,
        "an accepted socket quieted the port"
    );
    let _ = accept_one();

    m.quiet(first.as_fd()).unwrap();
    assert!(m.state(second.as_fd()).unwrap().marked());
    for i in 0..8 {
        let (_c, client) = connect(Some(&m), to);
        assert_eq!(
            client,
            Capability::PeerNotCapable,
            "connection {i}: SYN-ACK offered"
        );
        let a = accept_one();
        let server = m.state(a.as_fd()).unwrap().capability();
        assert_ne!(
            server,
            Capability::PeerCapable,
            "connection {i}: the server counted a peer its SYN-ACK did not answer"
        );
    }
}

/// Installers racing on one directory (several services starting at boot) end with one
/// working install: exactly one reports it fresh, and marked sockets negotiate through it.
#[test]
fn concurrent_installs_make_one_working_install() {
    if !privileged("concurrent installs") {
        return;
    }
    for round in 0..4 {
        let dir = PathBuf::from(format!(
            "/sys/fs/bpf/smcr-test-{}-race{round}",
            std::process::id()
        ));
        let start = Arc::new(std::sync::Barrier::new(4));
        let racers: Vec<_> = (0..4)
            .map(|_| {
                let (dir, start) = (dir.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    option::install(&dir).unwrap()
                })
            })
            .collect();
        let fresh = racers
            .into_iter()
            .map(|r| r.join().unwrap())
            .filter(|i| matches!(i, option::Installed::Fresh { .. }))
            .count();
        assert_eq!(fresh, 1, "round {round}: installs that each made their own");
        assert!(option::is_installed(&dir));
        let m = OptionRecords::open(&dir).unwrap();
        let l = listener(Some(&m), "127.0.0.1:0".parse().unwrap());
        let to = l.local_addr().unwrap().as_socket_ipv4().unwrap();
        let (_c, cap) = connect(Some(&m), to);
        assert_eq!(cap, Capability::PeerCapable, "round {round}");
        let (a, _) = l.accept().unwrap();
        assert_eq!(
            m.state(a.as_fd()).unwrap().capability(),
            Capability::PeerCapable
        );
        option::uninstall(&dir).unwrap();
        assert!(!dir.exists());
    }
}
