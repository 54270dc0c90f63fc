//! Shared by smcr's integration tests: privilege checks, two network namespaces joined by a veth
//! pair, running code inside a namespace, and reading TCP options out of a pcap.
#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// True when the test may run privileged steps. Otherwise prints why it skips, or panics when
/// the environment promises the tools (SMCR_REQUIRE_TOOLS=1, set by scripts/test.sh as root).
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("SMCR_REQUIRE_TOOLS").as_deref() == Ok("1") {
        panic!("{test}: needs root (network namespaces, BPF) but SMCR_REQUIRE_TOOLS=1");
    }
    eprintln!("SKIP {test}: needs root for network namespaces and BPF");
    false
}

/// Whether `tool` is on PATH; panics under SMCR_REQUIRE_TOOLS=1 when it is not.
pub fn have_tool(test: &str, tool: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !found {
        if std::env::var("SMCR_REQUIRE_TOOLS").as_deref() == Ok("1") {
            panic!("{test}: {tool} is missing (scripts/setup.sh installs it)");
        }
        eprintln!("SKIP {test}: {tool} is not installed (scripts/setup.sh installs it)");
    }
    found
}

fn run(args: &[&str]) -> io::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces, `a` and `b`, joined by a veth pair: `a` has 10.77.0.1/24 on
/// `veth_a`, `b` has 10.77.0.2/24 on `veth_b`. Both are deleted on drop.
pub struct NetPair {
    pub a: String,
    pub b: String,
    pub veth_a: String,
    pub veth_b: String,
    pub addr_a: Ipv4Addr,
    pub addr_b: Ipv4Addr,
}

/// Deletes the namespaces `smcr-PID-…` of test processes that are gone (killed before their
/// drops ran), once per process.
fn sweep_dead_namespaces() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(dir) = std::fs::read_dir("/var/run/netns") else {
            return;
        };
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("smcr-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = run(&["ip", "netns", "del", &name]);
            }
        }
    });
}

impl NetPair {
    pub fn new() -> io::Result<Self> {
        sweep_dead_namespaces();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let pair = Self {
            a: format!("smcr-{pid}-{n}-a"),
            b: format!("smcr-{pid}-{n}-b"),
            // Interface names are at most 15 bytes.
            veth_a: format!("v{pid}a{n}"),
            veth_b: format!("v{pid}b{n}"),
            addr_a: Ipv4Addr::new(10, 77, 0, 1),
            addr_b: Ipv4Addr::new(10, 77, 0, 2),
        };
        // (A step that fails drops `pair`: what was made is deleted.)
        run(&["ip", "netns", "add", &pair.a])?;
        run(&["ip", "netns", "add", &pair.b])?;
        run(&[
            "ip",
            "link",
            "add",
            &pair.veth_a,
            "netns",
            &pair.a,
            "type",
            "veth",
            "peer",
            "name",
            &pair.veth_b,
            "netns",
            &pair.b,
        ])?;
        for (ns, dev, addr) in [
            (&pair.a, &pair.veth_a, pair.addr_a),
            (&pair.b, &pair.veth_b, pair.addr_b),
        ] {
            let cidr = format!("{addr}/24");
            run(&["ip", "-n", ns, "addr", "add", &cidr, "dev", dev])?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }
}

/// A second veth pair between a [`NetPair`]'s namespaces (another path between the two
/// hosts): `a` gets 10.78.0.1/24 on `veth_a`, `b` 10.78.0.2/24 on `veth_b`.
pub struct SecondPath {
    pub veth_a: String,
    pub veth_b: String,
    pub addr_a: Ipv4Addr,
    pub addr_b: Ipv4Addr,
}

impl NetPair {
    /// Joins the namespaces by a second veth pair in another subnet.
    pub fn add_path(&self) -> io::Result<SecondPath> {
        let p = SecondPath {
            veth_a: format!("{}p", self.veth_a),
            veth_b: format!("{}p", self.veth_b),
            addr_a: Ipv4Addr::new(10, 78, 0, 1),
            addr_b: Ipv4Addr::new(10, 78, 0, 2),
        };
        run(&[
            "ip", "link", "add", &p.veth_a, "netns", &self.a, "type", "veth", "peer", "name",
            &p.veth_b, "netns", &self.b,
        ])?;
        for (ns, dev, addr) in [
            (&self.a, &p.veth_a, p.addr_a),
            (&self.b, &p.veth_b, p.addr_b),
        ] {
            run(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                dev,
            ])?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(p)
    }

    /// Takes interface `dev` of namespace `ns` down or up (its veth peer loses or regains
    /// its carrier: the path is cut or back).
    pub fn set_link(&self, ns: &str, dev: &str, up: bool) -> io::Result<()> {
        run(&[
            "ip",
            "-n",
            ns,
            "link",
            "set",
            dev,
            if up { "up" } else { "down" },
        ])
    }

    /// Makes the veth pair segment GSO datagrams before they are captured (tcpdump on a veth
    /// otherwise sees one frame per GSO batch, where a real network carries one per packet).
    pub fn segment_before_capture(&self) -> io::Result<()> {
        for (ns, dev) in [(&self.a, &self.veth_a), (&self.b, &self.veth_b)] {
            run(&["ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1"])?;
        }
        Ok(())
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.a]);
        let _ = run(&["ip", "netns", "del", &self.b]);
    }
}

/// Runs `f` on a new thread that has entered network namespace `ns` (setns affects only the
/// calling thread, so the test's other threads stay where they are).
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        // SAFETY: a valid namespace fd; CLONE_NEWNET only switches this thread's namespace.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", io::Error::last_os_error());
        f()
    })
}

/// tcpdump writing a pcap; stopped (and flushed) by [`Capture::stop`].
pub struct Capture {
    child: Child,
}

impl Capture {
    /// Starts `tcpdump -i dev -w file filter` inside `ns` and waits until it listens.
    pub fn start(ns: &str, dev: &str, file: &Path, filter: &str) -> io::Result<Self> {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "tcpdump",
                "-n",
                "-U",
                "--immediate-mode",
                // 64 MiB: the engine sends bursts of up to 4096 packets; a capture must not
                // drop what a test counts.
                "-B",
                "65536",
                "-i",
                dev,
                "-w",
            ])
            .arg(file)
            .arg(filter)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().expect("piped");
        let mut lines = BufReader::new(stderr).lines();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match lines.next() {
                Some(Ok(l)) if l.contains("listening on") => break,
                Some(Ok(_)) if Instant::now() < deadline => continue,
                other => {
                    let _ = child.kill();
                    return Err(io::Error::other(format!(
                        "tcpdump did not start: {other:?}"
                    )));
                }
            }
        }
        // Drain the rest so tcpdump never blocks on a full pipe; its summary goes to the log.
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                eprintln!("tcpdump: {l}");
            }
        });
        Ok(Self { child })
    }

    /// Stops tcpdump with SIGINT (it writes what it has) and waits for it.
    pub fn stop(mut self) -> io::Result<()> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.child.wait().map(drop)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP segment from a pcap: ports, flags and the raw option bytes.
#[derive(Debug, Clone)]
pub struct Segment {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
    pub options: Vec<u8>,
    pub payload_len: usize,
}

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;

/// TCP segments of an Ethernet (or Linux cooked) pcap written by tcpdump.
pub fn tcp_segments(path: &Path) -> io::Result<Vec<Segment>> {
    let data = std::fs::read(path)?;
    if data.len() < 24 {
        return Err(io::Error::other("pcap too short"));
    }
    let magic = u32::from_le_bytes(data[0..4].try_into().unwrap());
    if magic != 0xa1b2_c3d4 && magic != 0xa1b2_3c4d {
        return Err(io::Error::other(format!(
            "not a little-endian pcap: {magic:#x}"
        )));
    }
    let linktype = u32::from_le_bytes(data[20..24].try_into().unwrap());
    let l2 = match linktype {
        1 => 14,
        113 => 16,
        other => return Err(io::Error::other(format!("linktype {other}"))),
    };
    let mut out = Vec::new();
    let mut off = 24;
    while off + 16 <= data.len() {
        let incl = u32::from_le_bytes(data[off + 8..off + 12].try_into().unwrap()) as usize;
        let frame = &data[off + 16..(off + 16 + incl).min(data.len())];
        off += 16 + incl;
        let Some(ip) = frame.get(l2..) else { continue };
        if ip.len() < 20 || ip[0] >> 4 != 4 || ip[9] != 6 {
            continue;
        }
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]])).min(ip.len());
        let Some(tcp) = ip.get(ihl..total) else {
            continue;
        };
        if tcp.len() < 20 {
            continue;
        }
        let doff = usize::from(tcp[12] >> 4) * 4;
        if doff < 20 || doff > tcp.len() {
            continue;
        }
        out.push(Segment {
            src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            sport: u16::from_be_bytes([tcp[0], tcp[1]]),
            dport: u16::from_be_bytes([tcp[2], tcp[3]]),
            flags: tcp[13],
            options: tcp[20..doff].to_vec(),
            payload_len: tcp.len() - doff,
        });
    }
    Ok(out)
}

/// Whether `haystack` contains `needle`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// An install of the option program in a directory of its own, removed on drop, so tests never
/// touch a system-wide install and may run in parallel.
pub struct TestInstall(pub std::path::PathBuf);

impl TestInstall {
    pub fn new(tag: &str) -> Self {
        let dir = std::path::PathBuf::from(format!(
            "/sys/fs/bpf/smcr-test-{}-{tag}",
            std::process::id()
        ));
        let installed = smcr::option::install(&dir).expect("install the option program");
        assert!(matches!(installed, smcr::option::Installed::Fresh { .. }));
        Self(dir)
    }
}

impl Drop for TestInstall {
    fn drop(&mut self) {
        smcr::option::uninstall(&self.0).expect("uninstall");
    }
}

/// The byte at stream position `pos` of the test stream `seed`, for `out.len()` positions.
pub fn pattern(seed: u64, pos: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = pos + i as u64;
        *b = ((p ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 29) as u8;
    }
}

/// Sends `total` bytes of `pattern(seed)` and half-closes.
pub fn send_pattern(c: &mut smcr::SmcStream, seed: u64, total: u64) {
    use std::io::Write;
    let mut chunk = vec![0u8; 128 * 1024 + 13];
    let mut pos = 0u64;
    while pos < total {
        let n = chunk.len().min((total - pos) as usize);
        pattern(seed, pos, &mut chunk[..n]);
        c.write_all(&chunk[..n])
            .unwrap_or_else(|e| panic!("seed {seed}: write at {pos}: {e}"));
        pos += n as u64;
    }
    c.shutdown(std::net::Shutdown::Write).unwrap();
}

/// Reads to EOF checking `pattern(seed)`; returns the byte count and the longest wait for a
/// read.
pub fn check_pattern(s: &mut smcr::SmcStream, seed: u64) -> (u64, Duration) {
    use std::io::Read;
    let mut buf = vec![0u8; 256 * 1024];
    let mut want = vec![0u8; buf.len()];
    let mut pos = 0u64;
    let mut longest = Duration::ZERO;
    loop {
        let t = Instant::now();
        let n = s
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("seed {seed}: read at {pos}: {e}"));
        longest = longest.max(t.elapsed());
        if n == 0 {
            return (pos, longest);
        }
        pattern(seed, pos, &mut want[..n]);
        assert!(buf[..n] == want[..n], "seed {seed}: corrupt data at {pos}");
        pos += n as u64;
    }
}

/// Loads an nftables script into namespace `ns`.
pub fn nft(ns: &str, script: &str) {
    use std::io::Write;
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(script.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert!(
        out.status.success(),
        "nft in {ns}: {}\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A third namespace, `c`, joined to `b` of a [`NetPair`] by a second veth pair: `c` has
/// 10.78.0.1/24, `b` 10.78.0.2/24 (a second peer of b's, or b's second path). Deleted on drop.
pub struct Third {
    pub c: String,
    pub veth_c: String,
    pub veth_b2: String,
    pub addr_c: Ipv4Addr,
    pub addr_b2: Ipv4Addr,
}

impl Third {
    pub fn new(pair: &NetPair) -> io::Result<Self> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let t = Self {
            c: format!("smcr-{pid}-{n}-c"),
            veth_c: format!("v{pid}c{n}"),
            veth_b2: format!("v{pid}d{n}"),
            addr_c: Ipv4Addr::new(10, 78, 0, 1),
            addr_b2: Ipv4Addr::new(10, 78, 0, 2),
        };
        run(&["ip", "netns", "add", &t.c])?;
        run(&[
            "ip", "link", "add", &t.veth_c, "netns", &t.c, "type", "veth", "peer", "name",
            &t.veth_b2, "netns", &pair.b,
        ])?;
        for (ns, dev, addr) in [
            (&t.c, &t.veth_c, t.addr_c),
            (&pair.b, &t.veth_b2, t.addr_b2),
        ] {
            let cidr = format!("{addr}/24");
            run(&["ip", "-n", ns, "addr", "add", &cidr, "dev", dev])?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        }
        run(&["ip", "-n", &t.c, "link", "set", "lo", "up"])?;
        Ok(t)
    }
}

impl Drop for Third {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.c]);
    }
}

/// Polls `done` every 20 ms until it holds or `limit` has passed; returns the time waited.
pub fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !done() && t.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

/// A test's own directory (`<temp>/<prefix>-<tag>-<pid>`, made empty): removed when the test
/// passes, kept for a look when it fails.
pub struct TestDir(pub std::path::PathBuf);

impl TestDir {
    pub fn new(prefix: &str, tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("{prefix}-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl std::ops::Deref for TestDir {
    type Target = std::path::PathBuf;
    fn deref(&self) -> &std::path::PathBuf {
        &self.0
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Settings that assume SMC-R (no BPF needed) on a RoCE port of their own: `base` plus a slot
/// per process and `next`'s count, so the tests of one binary run in parallel and binaries
/// with different bases at the same time.
pub fn assume_config(base: u16, next: &std::sync::atomic::AtomicU16) -> smcr::RuntimeConfig {
    let n = next.fetch_add(1, Ordering::Relaxed);
    let mut cfg = smcr::RuntimeConfig::new();
    cfg.negotiation = smcr::Negotiation::Assume;
    cfg.roce_port = base + (std::process::id() % 2000) as u16 * 8 + n;
    cfg
}

/// The directory of a test's stats areas.
pub fn stats_dir(tag: &str) -> TestDir {
    TestDir::new("smcr-stats", tag)
}

/// A listener on 127.0.0.1 (a free port) and its address.
pub fn listen(rt: &smcr::Runtime) -> (smcr::SmcListener, std::net::SocketAddr) {
    let l = smcr::SmcListener::bind(rt, "127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Bytes at stream position `pos` of the tests' data pattern.
pub fn byte_pattern(pos: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = pos + i as u64;
        *b = (p.wrapping_mul(0x9e37_79b9) >> 13) as u8;
    }
}
