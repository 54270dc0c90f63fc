//! Same-host peers of different users: the pair proves itself (QPNs and PSNs) instead of
//! showing one user, and then shares only its own link group's memory. The peer runs as
//! `nobody` in a child process (this test binary again, with `SMCR_TEST_CHILD` set); it talks
//! to us over its stdin and stdout, lines starting with `CHILD `.
//!
//! Needs root (to start the child as another user): skipped with a message otherwise.

use rdma::*;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const NOBODY: u32 = 65534;
const RMB: usize = 64 << 10;

struct Side {
    _dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    addr: std::net::SocketAddrV4,
}

fn side() -> Side {
    let dev = Device::open(DeviceConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
    let pd = dev.alloc_shared_pd().unwrap();
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false).unwrap();
    qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    let addr = dev.local_addr();
    Side {
        _dev: dev,
        pd,
        cq,
        qp,
        addr,
    }
}

/// What one side tells the other to connect (as CLC would).
fn hello(s: &Side, psn: u32, rmb: &MemoryRegion) -> String {
    format!(
        "{} {} {} {} {}",
        s.qp.qp_num(),
        psn,
        s.addr,
        rmb.addr(),
        rmb.rkey()
    )
}

struct Peer {
    qpn: u32,
    psn: u32,
    addr: std::net::SocketAddrV4,
    rmb_addr: u64,
    rkey: u32,
}

fn parse_peer(line: &str) -> Peer {
    let f: Vec<&str> = line.split_whitespace().collect();
    Peer {
        qpn: f[0].parse().unwrap(),
        psn: f[1].parse().unwrap(),
        addr: f[2].parse().unwrap(),
        rmb_addr: f[3].parse().unwrap(),
        rkey: f[4].parse().unwrap(),
    }
}

fn connect(s: &Side, my_psn: u32, p: &Peer) {
    s.qp.modify(&QpAttr {
        path_mtu: Some(Mtu::Mtu1024),
        dest_qp_num: Some(p.qpn),
        rq_psn: Some(Psn::new(p.psn)),
        av: Some(p.addr),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    s.qp.modify(&QpAttr {
        sq_psn: Some(Psn::new(my_psn)),
        timeout: Some(14),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
}

/// The parent's part of the exchange: 32 bytes of `src` written into the peer's RMB, then
/// `send_len` bytes from `src` at offset 100 sent.
fn write_and_send(s: &Side, peer: &Peer, src: &MemoryRegion, send_len: usize) {
    s.qp.post_send(&[
        SendWr {
            wr_id: 2,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: peer.rmb_addr,
                rkey: peer.rkey,
            },
            sg_list: &[src.sge(0, 32)],
            flags: SendFlags::empty(),
        },
        SendWr {
            wr_id: 3,
            opcode: WrOpcode::Send,
            sg_list: &[src.sge(100, send_len)],
            flags: SendFlags::empty(),
        },
    ])
    .unwrap();
}

fn wait_same_host(s: &Side) {
    let until = Instant::now() + Duration::from_secs(10);
    while !s.qp.is_same_host() {
        assert!(
            Instant::now() < until,
            "no shared memory with the peer in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(n, 1, "timed out waiting for a completion");
    wc[0]
}

fn psn() -> u32 {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u32::from_ne_bytes(b) & 0xff_ffff
}

/// A copy of this test binary that `nobody` may execute (the build
/// directory may be closed to it), made once: written under another name and
/// renamed, so no test ever executes a file still being written.
fn peer_copy() -> &'static (std::path::PathBuf, std::path::PathBuf) {
    static COPY: std::sync::OnceLock<(std::path::PathBuf, std::path::PathBuf)> =
        std::sync::OnceLock::new();
    COPY.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("smcr-samehost-users-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let exe = dir.join("peer");
        let part = dir.join("peer.part");
        std::fs::copy(std::env::current_exe().unwrap(), &part).unwrap();
        std::fs::rename(&part, &exe).unwrap();
        (dir, exe)
    })
}

/// Runs this test binary's test `name` as `nobody`, in role `role`.
fn spawn_child(
    name: &str,
    role: &str,
) -> (Child, ChildStdin, BufReader<std::process::ChildStdout>) {
    let (dir, exe) = peer_copy();
    // The tests run in parallel: a fork by the other test's thread can hold a
    // writable descriptor of a file for a moment (it closes at that child's
    // exec), which makes exec fail with ETXTBSY; that passes, so try again.
    let mut tries = 0;
    let mut child = loop {
        let r = Command::new(exe)
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env("SMCR_TEST_CHILD", role)
            .current_dir(dir)
            .uid(NOBODY)
            .gid(NOBODY)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 50 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r.unwrap(),
        }
    };
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdin, stdout)
}

/// The child's next `CHILD ` line (libtest's own lines skipped).
fn child_line(out: &mut BufReader<std::process::ChildStdout>) -> String {
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the child ended");
        // libtest's "test NAME ... " may lead the first line.
        if let Some(at) = l.find("CHILD ") {
            return l[at + 6..].trim_end().to_string();
        }
    }
}

fn stdin_line() -> String {
    let mut l = String::new();
    std::io::stdin().read_line(&mut l).unwrap();
    l.trim_end().to_string()
}

fn is_root() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to start a peer as another user");
        return false;
    }
    true
}

/// The memfds this process holds (its own and those its peers sent).
fn memfds() -> Vec<OwnedFd> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(t) = std::fs::read_link(e.path()) else {
            continue;
        };
        if t.to_string_lossy().starts_with("/memfd:")
            && let Ok(f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(e.path())
        {
            v.push(f.into());
        }
    }
    v
}

/// Every byte written in `fd` (its data extents), with its offset.
fn extents(fd: &OwnedFd) -> Vec<(u64, Vec<u8>)> {
    let raw = fd.as_raw_fd();
    let mut out = Vec::new();
    let mut at: i64 = 0;
    loop {
        // SAFETY: plain lseek/pread on a descriptor we hold.
        let start = unsafe { libc::lseek(raw, at, libc::SEEK_DATA) };
        if start < 0 {
            break;
        }
        let end = unsafe { libc::lseek(raw, start, libc::SEEK_HOLE) };
        let len = (end - start) as usize;
        let mut buf = vec![0u8; len];
        let n = unsafe { libc::pread(raw, buf.as_mut_ptr().cast(), len, start) };
        assert_eq!(n as usize, len);
        out.push((start as u64, buf));
        at = end;
    }
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The child: a peer of another user. Connects, takes a WRITE and a SEND, answers with a WRITE
/// with immediate; then, as a hostile peer would, maps every memory object it was given and
/// looks for the parent's secrets, and scribbles over all of it.
fn child(role: &str) {
    let s = side();
    let my_psn = psn();
    let rmb =
        s.pd.reg_mr(RMB, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let buf = s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    println!("CHILD {}", hello(&s, my_psn, &rmb));
    let peer = parse_peer(&stdin_line());
    s.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: &[buf.sge(0, 4096)],
    }])
    .unwrap();
    connect(&s, my_psn, &peer);
    wait_same_host(&s);
    let cred = s.qp.same_host_peer().expect("the peer's process is known");
    println!("CHILD same-host {} {}", cred.uid, cred.pid);
    // The parent's WRITE, then its SEND.
    let wc = wait_one(&s.cq);
    assert_eq!((wc.status, wc.wr_id), (WcStatus::Success, 7), "{wc:?}");
    let mut got = vec![0u8; 32];
    rmb.read(0, &mut got);
    let mut msg = vec![0u8; wc.byte_len as usize];
    buf.read(0, &mut msg);
    // Echo what arrived into the parent's RMB, with an immediate.
    let src = s.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    src.write(0, &got);
    src.write(32, &msg[..msg.len().min(32)]);
    s.qp.post_send(&[SendWr {
        wr_id: 9,
        opcode: WrOpcode::RdmaWriteWithImm {
            remote_addr: peer.rmb_addr,
            rkey: peer.rkey,
            imm: 0x5eed,
        },
        sg_list: &[src.sge(0, 64)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    let wc = wait_one(&s.cq);
    assert_eq!((wc.status, wc.wr_id), (WcStatus::Success, 9), "{wc:?}");
    println!("CHILD echoed");
    if role != "hostile" {
        let _ = stdin_line();
        return;
    }
    // Hostile from here: what can it see?
    let markers: Vec<Vec<u8>> = stdin_line()
        .split_whitespace()
        .map(|m| m.as_bytes().to_vec())
        .collect();
    let (mut seen, mut found) = (0usize, Vec::new());
    for fd in memfds() {
        for (_, data) in extents(&fd) {
            seen += data.len();
            for (i, m) in markers.iter().enumerate() {
                if contains(&data, m) {
                    found.push(i);
                }
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    let found: Vec<String> = found.iter().map(ToString::to_string).collect();
    println!("CHILD seen {seen} found {}", found.join(","));
    // And it writes garbage over every byte of every object it holds (through a mapping,
    // as it would to attack: table, ring, regions).
    for fd in memfds() {
        let len = rustix::fs::fstat(&fd).unwrap().st_size as usize;
        for (off, data) in extents(&fd) {
            let garbage = vec![0xA5u8; data.len()];
            // SAFETY: pwrite on a descriptor we hold.
            unsafe {
                libc::pwrite(
                    fd.as_raw_fd(),
                    garbage.as_ptr().cast(),
                    garbage.len(),
                    off as i64,
                )
            };
        }
        // The first megabyte (tables, ring headers) even where nothing was written yet.
        let head = vec![0x5Au8; len.min(1 << 20)];
        // SAFETY: as above.
        unsafe { libc::pwrite(fd.as_raw_fd(), head.as_ptr().cast(), head.len(), 0) };
    }
    println!("CHILD scribbled");
    let _ = stdin_line();
}

#[test]
fn peers_of_different_users_share_memory_after_proving_the_pair() {
    if let Ok(role) = std::env::var("SMCR_TEST_CHILD") {
        return child(&role);
    }
    if !is_root() {
        return;
    }
    let (mut ch, mut stdin, mut out) = spawn_child(
        "peers_of_different_users_share_memory_after_proving_the_pair",
        "peer",
    );
    let s = side();
    let my_psn = psn();
    let rmb =
        s.pd.reg_mr(RMB, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let peer = parse_peer(&child_line(&mut out));
    writeln!(stdin, "{}", hello(&s, my_psn, &rmb)).unwrap();
    s.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[rmb.sge(RMB - 4096, 4096)],
    }])
    .unwrap();
    connect(&s, my_psn, &peer);
    wait_same_host(&s);
    let line = child_line(&mut out);
    assert!(
        line.starts_with("same-host 0 "),
        "the child saw root: {line}"
    );
    let cred = s.qp.same_host_peer().expect("the peer's process is known");
    assert_eq!((cred.uid, cred.pid as u32), (NOBODY, ch.id()));
    let src = s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    src.write(0, b"written by root into nobody's RMB");
    src.write(100, b"sent by root to nobody");
    write_and_send(&s, &peer, &src, 22);
    let wc = wait_one(&s.cq);
    assert_eq!(
        (wc.status, wc.opcode, wc.imm_data),
        (WcStatus::Success, WcOpcode::RecvRdmaWithImm, Some(0x5eed)),
        "{wc:?}"
    );
    let mut echo = [0u8; 64];
    rmb.read(0, &mut echo);
    assert_eq!(&echo[..32], b"written by root into nobody's RM");
    assert_eq!(&echo[32..54], b"sent by root to nobody");
    assert_eq!(child_line(&mut out), "echoed");
    assert!(s.qp.is_same_host());
    writeln!(stdin).unwrap();
    assert!(ch.wait().unwrap().success());
}

#[test]
fn a_hostile_peer_of_another_user_reaches_only_its_own_link_groups_buffers() {
    const NAME: &str = "a_hostile_peer_of_another_user_reaches_only_its_own_link_groups_buffers";
    if let Ok(role) = std::env::var("SMCR_TEST_CHILD") {
        return child(&role);
    }
    if !is_root() {
        return;
    }
    let (mut ch, mut stdin, mut out) = spawn_child(NAME, "hostile");
    let marker = |what: &str| format!("SECRET-{what}-{:08x}", psn() << 8 | psn());
    let (m_rmb, m_local, m_other, m_heap) = (
        marker("rmb"),
        marker("sndbuf"),
        marker("othergroup"),
        marker("heap"),
    );
    let s = side();
    let my_psn = psn();
    let rmb =
        s.pd.reg_mr(RMB, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    // What the peer may see: its own RMB at our end (it writes there).
    rmb.write(8192, m_rmb.as_bytes());
    // What it may not: a local buffer of the same link group (a send buffer)...
    let sndbuf = s.pd.reg_mr(RMB, Access::LOCAL_WRITE).unwrap();
    sndbuf.write(100, m_local.as_bytes());
    // ...another link group's RMB (another peer's)...
    let other_pd = s._dev.alloc_shared_pd().unwrap();
    let other = other_pd
        .reg_mr(RMB, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    other.write(0, m_other.as_bytes());
    // ...and the rest of our memory.
    let heap = m_heap.clone().into_bytes();
    let peer = parse_peer(&child_line(&mut out));
    writeln!(stdin, "{}", hello(&s, my_psn, &rmb)).unwrap();
    s.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[sndbuf.sge(RMB - 4096, 4096)],
    }])
    .unwrap();
    connect(&s, my_psn, &peer);
    wait_same_host(&s);
    assert!(child_line(&mut out).starts_with("same-host"));
    let src = s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    write_and_send(&s, &peer, &src, 8);
    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
    assert_eq!(child_line(&mut out), "echoed");
    writeln!(stdin, "{m_rmb} {m_local} {m_other} {m_heap}").unwrap();
    let seen = child_line(&mut out);
    // It did map our link group's memory (it found its own RMB's marker) and nothing else.
    let found = seen.rsplit(' ').next().unwrap();
    assert_eq!(
        found, "0",
        "markers the hostile peer found (0 allowed): {seen}"
    );
    assert_eq!(child_line(&mut out), "scribbled");
    // Its garbage reached only that link group: the rest is intact and we are alive.
    let mut b = vec![0u8; m_local.len()];
    sndbuf.read(100, &mut b);
    assert_eq!(b, m_local.as_bytes());
    let mut b = vec![0u8; m_other.len()];
    other.read(0, &mut b);
    assert_eq!(b, m_other.as_bytes());
    assert_eq!(heap, m_heap.as_bytes());
    writeln!(stdin).unwrap();
    assert!(ch.wait().unwrap().success());
}
