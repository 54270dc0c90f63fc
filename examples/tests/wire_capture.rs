//! What really crosses a wire: the demo runs between two network namespaces joined by a veth
//! pair whose UDP segmentation offload is off, so the kernel cuts our GSO batches into separate
//! IPv4 datagrams (numbering their identification 0, 1, 2, …) before tcpdump sees them. Every
//! RoCE packet in the capture must carry a correct ICRC, recomputed from the captured headers by
//! an independent implementation (Python's zlib) — the proof that our choice of IP
//! identification for the ICRC matches the kernel's.
//!
//! Needs root (namespaces), tcpdump, ethtool and python3. Skips with a message otherwise, unless
//! `SMCR_REQUIRE_TOOLS=1` (CI), where that is a failure.

use std::process::{Command, Stdio};
use std::time::Duration;

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn available() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    let tools = ["tcpdump", "ethtool", "python3", "ip"]
        .iter()
        .all(|t| sh(&["sh", "-c", &format!("command -v {t}")]));
    if !(root && tools) {
        assert!(
            std::env::var_os("SMCR_REQUIRE_TOOLS").is_none(),
            "root, tcpdump, ethtool, python3 and iproute2 are required (SMCR_REQUIRE_TOOLS is set)"
        );
        eprintln!(
            "SKIP: needs root and tcpdump/ethtool/python3/iproute2 (run scripts/setup.sh as root)"
        );
    }
    root && tools
}

const ICRC_CHECK: &str = r#"
import struct, sys, zlib
f = open(sys.argv[1], 'rb'); gh = f.read(24)
ok = bad = gso = 0
while True:
    rh = f.read(16)
    if len(rh) < 16: break
    n = struct.unpack('<IIII', rh)[2]; frame = f.read(n)
    if frame[12:14] != b'\x08\x00': continue
    ip = bytearray(frame[14:])
    if ip[9] != 17: continue  # all UDP in these namespaces is the engines' RoCE traffic
    ipid = struct.unpack('!H', ip[4:6])[0]
    if ipid > 0: gso += 1
    stored = struct.unpack('<I', ip[-4:])[0]
    m = ip[:-4]
    m[1] = 0xff; m[8] = 0xff; m[10] = 0xff; m[11] = 0xff; m[26] = 0xff; m[27] = 0xff; m[32] = 0xff
    if zlib.crc32(b'\xff' * 8 + bytes(m)) & 0xffffffff == stored: ok += 1
    else: bad += 1
print(ok, bad, gso)
"#;

struct Netns(&'static [&'static str]);
impl Drop for Netns {
    fn drop(&mut self) {
        for ns in self.0 {
            sh(&["ip", "netns", "del", ns]);
        }
    }
}

#[test]
fn icrc_of_kernel_segmented_gso_batches_checks_out_on_the_wire() {
    if !available() {
        return;
    }
    let (a, b) = ("smcr-wa", "smcr-wb");
    let _cleanup = Netns(&["smcr-wa", "smcr-wb"]);
    for ns in [a, b] {
        sh(&["ip", "netns", "del", ns]);
        assert!(sh(&["ip", "netns", "add", ns]));
        assert!(sh(&["ip", "-n", ns, "link", "set", "lo", "up"]));
    }
    assert!(sh(&[
        "ip", "link", "add", "smcrwa", "netns", a, "type", "veth", "peer", "name", "smcrwb",
        "netns", b
    ]));
    for (ns, dev, addr) in [(a, "smcrwa", "10.99.7.1/24"), (b, "smcrwb", "10.99.7.2/24")] {
        assert!(sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev]));
        assert!(sh(&["ip", "-n", ns, "link", "set", dev, "up"]));
        // No UDP segmentation offload: the kernel segments GSO batches in software.
        assert!(sh(&[
            "ip",
            "netns",
            "exec",
            ns,
            "ethtool",
            "-K",
            dev,
            "tx-udp-segmentation",
            "off"
        ]));
    }
    let dir = std::env::temp_dir().join(format!("smcr-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("wire.pcap");
    let mut dump = Command::new("ip")
        .args([
            "netns", "exec", b, "tcpdump", "-i", "smcrwb", "-n", "-U", "-s", "0",
            // A 64 MiB capture buffer: the engine sends up to 4096 packets in one burst, and
            // a capture that drops some leaves too few to count (seen ~1 run in 5 with the
            // default 2 MiB).
            "-B", "65536", "-w",
        ])
        .arg(&pcap)
        .arg("udp")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            a,
            env!("CARGO_BIN_EXE_rdma-demo"),
            "8388608",
        ])
        .env("DEMO_SOURCE_IP", "10.99.7.1")
        .env("DEMO_SINK_IP", "10.99.7.2")
        .env("DEMO_SINK_NETNS", b)
        .env("DEMO_MTU", "1024") // veth MTU 1500, as rxe picks on Ethernet
        .env_remove("SMCR_RDMA_FAULTS")
        // Plain RoCE v2 as a Linux peer gets it, every ICRC computed: two of our engines
        // would otherwise bundle and leave the ICRC out (rdma's loopback tests check that).
        .env("SMCR_RDMA_EXT", "off")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("OK: data verified"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::thread::sleep(Duration::from_millis(300));
    sh(&["kill", "-INT", &dump.id().to_string()]);
    let _ = dump.wait();
    let check = Command::new("python3")
        .args(["-c", ICRC_CHECK])
        .arg(&pcap)
        .output()
        .unwrap();
    let counts: Vec<usize> = String::from_utf8_lossy(&check.stdout)
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(
        counts.len(),
        3,
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let (ok, bad, segmented) = (counts[0], counts[1], counts[2]);
    // 8 MiB at MTU 1024 is > 8192 data packets, most of them sent in GSO batches.
    assert!(ok > 8000, "too few RoCE packets captured: {counts:?}");
    assert_eq!(bad, 0, "packets with a wrong ICRC on the wire: {counts:?}");
    assert!(
        segmented > 4000,
        "GSO batches were not segmented by the kernel: {counts:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
