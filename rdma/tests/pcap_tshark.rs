//! The pcap writer's capture of real engine traffic is decoded by tshark as RoCE v2 /
//! InfiniBand with the right opcodes, QPs and PSNs and no malformed packets, and every ICRC in it
//! checks out when recomputed by an independent implementation (Python's zlib).
//!
//! Needs `tshark` and `python3`; without them the test says so and passes, unless
//! `SMCR_REQUIRE_TOOLS=1` (set by CI), where a missing tool is a failure.

use rdma::*;
use std::process::Command;
use std::time::Duration;

fn tool(name: &str) -> bool {
    let found = Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("SMCR_REQUIRE_TOOLS").is_none(),
            "{name} is required (SMCR_REQUIRE_TOOLS is set)"
        );
        eprintln!("SKIP: {name} not installed (run scripts/setup.sh)");
    }
    found
}

fn wait(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY];
    assert_eq!(cq.wait(&mut wc, Some(Duration::from_secs(10))).unwrap(), 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    wc[0]
}

/// How many whole records the pcap file at `path` holds now.
fn records(path: &std::path::Path) -> usize {
    let d = std::fs::read(path).unwrap();
    let (mut off, mut n) = (24, 0);
    while off + 16 <= d.len() {
        let len = u32::from_le_bytes(d[off + 8..off + 12].try_into().unwrap()) as usize;
        if off + 16 + len > d.len() {
            break;
        }
        off += 16 + len;
        n += 1;
    }
    n
}

const ICRC_CHECK: &str = r#"
import struct, sys, zlib
f = open(sys.argv[1], 'rb'); gh = f.read(24)
assert struct.unpack('<I', gh[20:24])[0] == 1, 'not an Ethernet capture'
ok = bad = 0
while True:
    rh = f.read(16)
    if len(rh) < 16: break
    n = struct.unpack('<IIII', rh)[2]; ip = bytearray(f.read(n)[14:])
    stored = struct.unpack('<I', ip[-4:])[0]
    m = ip[:-4]
    m[1] = 0xff; m[8] = 0xff; m[10] = 0xff; m[11] = 0xff; m[26] = 0xff; m[27] = 0xff; m[32] = 0xff
    if zlib.crc32(b'\xff' * 8 + bytes(m)) & 0xffffffff == stored: ok += 1
    else: bad += 1
print(ok, bad)
"#;

#[test]
fn tshark_decodes_our_capture_and_every_icrc_checks_out() {
    if !tool("tshark") || !tool("python3") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("smcr-pcap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("a.pcap");
    let (a_qpn, b_qpn, a_port);
    let live_records;
    {
        let mut ca = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
        ca.pcap = Some(pcap.clone());
        let a = Device::open(ca).unwrap();
        a_port = a.local_addr().port();
        // B on the RoCE v2 port, where Wireshark's dissector looks for it.
        let b = Device::open(DeviceConfig::new("127.0.0.1:4791".parse().unwrap()))
            .expect("UDP port 4791 must be free for this test");
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (cqa, cqb) = (a.create_cq().unwrap(), b.create_cq().unwrap());
        let qa = pa.create_qp(&cqa, &cqa, QpCaps::default(), true).unwrap();
        let qb = pb.create_qp(&cqb, &cqb, QpCaps::default(), true).unwrap();
        (a_qpn, b_qpn) = (qa.qp_num(), qb.qp_num());
        // PSNs just below the 24-bit wrap.
        for (q, peer, dev, my, theirs) in [
            (&qa, &qb, &b, 0xFF_FFFE, 0x10),
            (&qb, &qa, &a, 0x10, 0xFF_FFFE),
        ] {
            q.modify(&QpAttr::state(QpState::Init)).unwrap();
            q.modify(&QpAttr {
                path_mtu: Some(Mtu::Mtu1024),
                dest_qp_num: Some(peer.qp_num()),
                rq_psn: Some(Psn::new(theirs)),
                av: Some(dev.local_addr()),
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
            q.modify(&QpAttr {
                sq_psn: Some(Psn::new(my)),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
        }
        let src = pa.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[0xAB; 4096]);
        let rmb = pb
            .reg_mr(
                4096,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap();
        let rbuf = pb.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        qb.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &[rbuf.sge(0, 64)],
        }])
        .unwrap();
        qa.post_send(&[SendWr {
            wr_id: 1,
            opcode: WrOpcode::Send,
            sg_list: &[src.sge(0, 44)],
            flags: SendFlags::SOLICITED,
        }])
        .unwrap();
        wait(&cqa);
        wait(&cqb);
        let write = WrOpcode::RdmaWrite {
            remote_addr: rmb.addr(),
            rkey: rmb.rkey(),
        };
        qa.post_send(&[SendWr {
            wr_id: 2,
            opcode: write,
            sg_list: &[src.sge(0, 2500)],
            flags: SendFlags::empty(),
        }])
        .unwrap();
        wait(&cqa);
        let read = WrOpcode::RdmaRead {
            remote_addr: rmb.addr(),
            rkey: rmb.rkey(),
        };
        qa.post_send(&[SendWr {
            wr_id: 3,
            opcode: read,
            sg_list: &[src.sge(2048, 1500)],
            flags: SendFlags::empty(),
        }])
        .unwrap();
        assert_eq!(wait(&cqa).opcode, WcOpcode::RdmaRead);
        // Written as it goes: complete while the device runs (a preloaded process is never
        // torn down, so nothing may wait for a flush at drop).
        live_records = records(&pcap);
        assert!(live_records >= 8, "{live_records} records while running");
    } // every handle dropped: the engines stop
    assert_eq!(records(&pcap), live_records, "records written only at drop");

    let out = Command::new("tshark")
        .args([
            "-r",
            pcap.to_str().unwrap(),
            "-T",
            "fields",
            "-E",
            "separator=,",
            // B answers A on A's own port (and, when a steering program shares 4791 on this
            // host, from a port of its own, not 4791): decoded as RoCE too.
            "-d",
            &format!("udp.port=={a_port},infiniband"),
        ])
        .args([
            "-e",
            "ip.src",
            "-e",
            "ip.flags.df",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "_ws.malformed",
            "-e",
            "udp.dstport",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
    assert!(
        rows.iter().all(|r| r.len() >= 7 && r[5].is_empty()),
        "malformed packets:\n{text}"
    );
    assert!(
        rows.iter().all(|r| r[1] == "1" || r[1] == "True"),
        "DF must be set:\n{text}"
    );
    // Our packets to B, in order: SEND_ONLY, WRITE FIRST/MIDDLE/LAST across the PSN wrap, READ request.
    let parse = |s: &str| {
        u32::from_str_radix(
            s.trim_start_matches("0x"),
            if s.starts_with("0x") { 16 } else { 10 },
        )
        .unwrap()
    };
    // (A loaded machine delays B's ACKs past the early-retransmission interval: the copies
    // repeat packets already listed, so each counts once.)
    let mut seen = std::collections::HashSet::new();
    let ours: Vec<(u32, u32, u32)> = rows
        .iter()
        .filter(|r| r[6] == "4791")
        .map(|r| (parse(r[2]), parse(r[3]), parse(r[4])))
        .filter(|p| seen.insert(*p))
        .collect();
    assert_eq!(
        ours,
        [
            (4, b_qpn, 0xFF_FFFE),
            (6, b_qpn, 0xFF_FFFF),
            (7, b_qpn, 0),
            (8, b_qpn, 1),
            (12, b_qpn, 2)
        ],
        "tshark:\n{text}"
    );
    // B's answers: ACKs and the two READ responses, whose PSNs are the request's.
    let theirs: Vec<(u32, u32)> = rows
        .iter()
        .filter(|r| r[6] != "4791")
        .map(|r| (parse(r[2]), parse(r[4])))
        .collect();
    assert!(
        rows.iter()
            .filter(|r| r[6] != "4791")
            .all(|r| parse(r[3]) == a_qpn),
        "{text}"
    );
    assert!(
        theirs.contains(&(0x0d, 2)) && theirs.contains(&(0x0f, 3)),
        "read responses missing:\n{text}"
    );
    assert!(theirs.iter().any(|t| t.0 == 0x11), "no ACK:\n{text}");
    let check = Command::new("python3")
        .args(["-c", ICRC_CHECK, pcap.to_str().unwrap()])
        .output()
        .unwrap();
    let counts = String::from_utf8_lossy(&check.stdout);
    let v: Vec<usize> = counts
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(
        v,
        [rows.len(), 0],
        "ICRC recomputed by zlib: {counts} {}",
        String::from_utf8_lossy(&check.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}
