//! Snapshot tests of every output format, on a fixed snapshot. After an intended format
//! change, regenerate with `SMCR_UPDATE_SNAPSHOTS=1 cargo test -p smcr-tools --lib view` and
//! review the diff.

use super::*;

fn example() -> Snapshot {
    let a = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
    let mapped = |ip: [u8; 4]| {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&ip);
        g
    };
    let mut totals = [0; total::COUNT];
    totals[total::SMCR] = 12;
    totals[total::TCP] = 3;
    totals[total::FIRST_CONTACT] = 1;
    totals[total::LINK_GROUPS] = 1;
    totals[total::BYTES_SENT] = 1000;
    totals[total::BYTES_RECEIVED] = 2000;
    // Closed connections: 4 reads of up to 8 KiB and one of 20 000 bytes, 3 writes of up to
    // 8 KiB and 2 over 1 MiB; one RMB filled, two writes found no room; one 64 KiB
    // connection.
    {
        use stats::conn::counter;
        totals[total::COUNTERS + counter::RX_REQS] = 4;
        totals[total::COUNTERS + counter::RX_REQS + 2] = 1;
        totals[total::COUNTERS + counter::TX_REQS] = 3;
        totals[total::COUNTERS + counter::TX_REQS + 8] = 2;
        totals[total::COUNTERS + counter::RX_FULL] = 1;
        totals[total::COUNTERS + counter::TX_FULL] = 2;
        totals[total::COUNTERS + counter::TX_FULL_PEER] = 1;
        totals[total::RX_BUFS + 3] = 1;
        totals[total::TX_BUFS + 3] = 1;
    }
    let server = Proc {
        pid: 4242,
        comm: "redis-server".into(),
        conns: vec![
            Conn {
                kind: Kind::Smcr,
                state: 1,
                server: true,
                local: a("10.0.0.1:6379"),
                peer: a("10.0.0.2:40001"),
                rmb: 65536,
                sndbuf: 65536,
                token: 0x1234,
                lg: 1,
                sent: 5120,
                received: 2048,
                since_ns: 1_700_000_000_000_000_000,
                stages_ns: [2_000, 150_000, 300_000, 900_000, 2_500_000, 3_100_000],
                cursors: [5120, 2048, 1 << 32 | 2048, 1 << 32 | 2048],
                counters: {
                    use stats::conn::counter;
                    let mut c = [0; counter::COUNT];
                    c[counter::RX_REQS] = 2; // 2 reads of 1 KiB
                    c[counter::TX_REQS] = 1; // 1 write of 5 KiB
                    c[counter::TX_FULL] = 1;
                    c
                },
                ..Conn::default()
            },
            Conn {
                kind: Kind::Tcp,
                state: 1,
                server: true,
                local: a("10.0.0.1:6379"),
                peer: a("10.0.0.3:40002"),
                code: 0x0301_0000,
                sent: 11,
                received: 27,
                fd: Some(9),
                since_ns: 1_700_000_000_000_000_000,
                stages_ns: [3_000, 0, 0, 0, 0, 0],
                ..Conn::default()
            },
            Conn {
                kind: Kind::Tcp,
                state: 22,
                server: true,
                local: a("10.0.0.1:6379"),
                peer: a("10.0.0.4:40003"),
                code: 0x0101_0000,
                peer_code: 0x0101_0000,
                local_flags: 0,
                peer_flags: 0x80,
                ..Conn::default()
            },
            Conn {
                kind: Kind::Tcp,
                state: 1,
                server: true,
                local: a("[2001:db8::1]:6379"),
                peer: a("[2001:db8::5]:40004"),
                code: 0x7f00_0003,
                sent: 5,
                received: 7,
                fd: Some(11),
                ..Conn::default()
            },
            Conn {
                kind: Kind::Listen,
                state: 10,
                server: true,
                local: a("0.0.0.0:6379"),
                ..Conn::default()
            },
        ],
        links: vec![
            Link {
                id: 1,
                client: false,
                link_id: 1,
                state: 3,
                gid: mapped([10, 0, 0, 1]),
                peer_gid: mapped([10, 0, 0, 2]),
                qpn: 0x3a1,
                peer_qpn: 0x7f2,
                peer_system: [0x02, 0, 0, 0, 0, 0x2a, 0, 1],
                mtu: 1024,
                transport: "udp",
                peer_proc: None,
                same_host: "not-found",
                conns: 1,
                since_ns: 1_700_000_000_000_000_000,
            },
            Link {
                id: 2,
                client: false,
                link_id: 1,
                state: 3,
                gid: mapped([10, 0, 0, 1]),
                peer_gid: mapped([10, 0, 0, 3]),
                qpn: 0x3a2,
                peer_qpn: 0x9c4,
                peer_system: [0x02, 0, 0, 0, 0, 0x2a, 0, 2],
                mtu: 1024,
                transport: "shm",
                peer_proc: Some((65534, 4343)),
                same_host: "shm",
                conns: 2,
                since_ns: 1_700_000_000_000_000_000,
            },
        ],
        fallbacks: vec![(0x0301_0000, 2), (0x0101_0000, 1)],
        totals,
        reset_epoch: 0,
        unavailable: 0,
        devices: vec![stats::DevRecord {
            addr: "10.0.0.1:57601".parse().unwrap(),
            mode: "steered",
            range: 0x101,
            stats: rdma::DeviceStats {
                tx_packets: 9100,
                rx_packets: 8800,
                rx_icrc_errors: 2,
                rx_unknown_qp: 3,
                rx_foreign_ip_id: 4000,
                tx_retransmits: 65,
                rc_probes: 1,
                rc_spurious_probes: 1,
                rx_rnr_naks: 1,
                ..Default::default()
            },
        }],
    };
    let client = Proc {
        pid: 4300,
        comm: "redis \"bench\"".into(),
        conns: vec![Conn {
            kind: Kind::Smcr,
            state: 20,
            local: a("10.0.0.2:40001"),
            peer: a("10.0.0.1:6379"),
            rmb: 65536,
            sndbuf: 65536,
            token: 0x99,
            lg: 7,
            sent: 2048,
            received: 5120,
            local_flags: 0x80,
            ..Conn::default()
        }],
        fallbacks: vec![(0x7f00_0004, 4)],
        ..Proc::default()
    };
    let off = Proc {
        pid: 4400,
        comm: "curl".into(),
        unavailable: 0x7f00_0001,
        ..Proc::default()
    };
    Snapshot {
        procs: vec![server, client, off],
    }
}

fn check(name: &str, got: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/view/snapshots")
        .join(name);
    if std::env::var_os("SMCR_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with SMCR_UPDATE_SNAPSHOTS=1)", path.display()));
    assert!(
        want == got,
        "{name} changed; got:\n{got}\n(run with SMCR_UPDATE_SNAPSHOTS=1 and review the diff)"
    );
}

#[test]
fn socket_table() {
    check(
        "sockets.txt",
        &render_sockets(&example(), Rows::Connections, false),
    );
    check(
        "sockets-all-details.txt",
        &render_sockets(&example(), Rows::All, true),
    );
    check(
        "listeners.txt",
        &render_sockets(&example(), Rows::Listeners, false),
    );
}

/// smcss's options: -R (SMC-R rows only, with link columns), -W (addresses whole), -D (no
/// SMC-D: the header and a note), -d's hex cursors.
#[test]
fn socket_table_with_smcss_options() {
    let smcr = SocketView {
        smcr: true,
        ..SocketView::new(Rows::Connections)
    };
    let t = render_socket_table(&example(), smcr);
    check("sockets-smcr.txt", &t);
    let rows: Vec<&str> = t.lines().skip(2).collect();
    assert_eq!(rows.len(), 2, "{t}");
    assert!(rows.iter().all(|r| r.contains(" SMCR ")), "{t}");
    let mut long = example();
    long.procs[0].conns[3].peer = "[2001:db8:1234:5678:9abc:def0:1234:5678]:40004"
        .parse()
        .unwrap();
    check(
        "sockets-truncated.txt",
        &render_socket_table(&long, SocketView::new(Rows::All)),
    );
    let wide = SocketView {
        wide: true,
        ..SocketView::new(Rows::All)
    };
    check("sockets-wide.txt", &render_socket_table(&long, wide));
    let smcd = SocketView {
        smcd: true,
        ..SocketView::new(Rows::All)
    };
    check("sockets-smcd.txt", &render_socket_table(&example(), smcd));
    // A long IPv6 address: cut to smcss's 23 columns with `..` before the port, or whole.
    let a: SocketAddr = "[2001:db8:1234:5678:9abc:def0:1234:5678]:40004"
        .parse()
        .unwrap();
    assert_eq!(smcss_addr(&a, false), "2001:db8:1234:5..:40004");
    assert_eq!(smcss_addr(&a, false).len(), ADDR_WIDTH);
    assert_eq!(
        smcss_addr(&a, true),
        "2001:db8:1234:5678:9abc:def0:1234:5678:40004"
    );
    assert_eq!(
        smcss_addr(&"10.0.0.1:6379".parse().unwrap(), false),
        "10.0.0.1:6379"
    );
    assert_eq!(smcss_cursor(1 << 32 | 0x800), "0001:00000800");
    assert_eq!(stats::smcss_state_name(20), "PEERCLOSEWAIT1");
    assert_eq!(stats::smcss_state_name(3), "0x3?");
}

#[test]
fn link_groups() {
    check("links.txt", &render_links(&example()));
}

#[test]
fn devices() {
    check("devices.txt", &render_devices(&example(), false));
    let every = render_devices(&example(), true);
    check("devices-details.txt", &every);
    for name in rdma::DeviceStats::NAMES {
        assert!(every.contains(name), "{name}");
    }
}

#[test]
fn fallbacks() {
    check("fallbacks.txt", &render_fallbacks(&example(), false));
    let every = render_fallbacks(&example(), true);
    // Every Linux code and ours is named, with a meaning and a remedy.
    for c in all_codes() {
        let (name, meaning) = stats::reason(c);
        assert!(name != "UNKNOWN" && !meaning.is_empty(), "{c:#x}");
        assert!(
            every.contains(&format!("{c:#010x}  {name:<12}")),
            "{c:#x} missing"
        );
    }
    assert_eq!(all_codes().len(), 45);
    assert_eq!(every.matches("  remedy: ").count(), 45);
}

#[test]
fn json_document() {
    check("snapshot.json", &render_json(&example()));
}

#[test]
fn prometheus_exposition() {
    let text = render_prometheus(&example());
    check("metrics.prom", &text);
    parse_prometheus(&text).unwrap();
}

#[test]
fn the_prometheus_parser_rejects_bad_text() {
    for bad in [
        "smcr_x 1\n",
        "# TYPE smcr_x counter\nsmcr_x{a=\"b} 1\n",
        "# TYPE smcr_x counter\nsmcr_x{a=b} 1\n",
        "# TYPE smcr_x counter\nsmcr_x{a=\"\\q\"} 1\n",
        "# TYPE smcr_x counter\nsmcr_x one\n",
        "# TYPE smcr_x counter\n# TYPE smcr_x counter\n",
        "# TYPE 9x counter\n",
    ] {
        assert!(parse_prometheus(bad).is_err(), "{bad:?}");
    }
    let ok = parse_prometheus("# TYPE smcr_x counter\nsmcr_x{a=\"q\\\"\\\\\",b=\"\"} 3\n").unwrap();
    assert_eq!(
        ok,
        vec![(
            "smcr_x".to_owned(),
            vec![("a".into(), "q\"\\".into()), ("b".into(), String::new())],
            3.0
        )]
    );
}

#[test]
fn records_decode_into_rows() {
    let mut r = stats::ConnRecord::default();
    r.words[conn::IN_USE] = 1;
    r.words[conn::LOCAL] = u64::from(u32::from(Ipv4Addr::new(10, 0, 0, 1))) << 16 | 6379;
    r.words[conn::PEER] = u64::from(u32::from(Ipv4Addr::new(10, 0, 0, 2))) << 16 | 40001;
    r.words[conn::STATE] = conn::STATE_ACTIVE | 1 << 8 | conn::MODE_TCP << 16;
    r.words[conn::REASON] = 0x0101_0000 | 0x0101_0000 << 32;
    r.words[conn::FD] = 10;
    r.words[conn::T_PROPOSAL] = 5;
    r.live[conn::live::FLAGS] = 0x80 << 8 | 22 << 16;
    r.live[conn::live::FIRST_WRITE] = 9;
    let c = Conn::from_record(&r);
    assert_eq!(
        (
            c.kind,
            c.state,
            c.server,
            c.local.port(),
            c.peer.port(),
            c.fd
        ),
        (Kind::Tcp, 22, true, 6379, 40001, Some(9))
    );
    assert_eq!(c.stages_ns, [0, 5, 0, 0, 0, 9]);
    assert_eq!(c.fallback(), "MEM 0x01010000 by peer");
    assert_eq!(c.peer_flags, 0x80);
}

#[test]
fn native_ipv6_rows_round_trip_and_v4_mapped_ones_are_ipv4() {
    use smcr::stats::{ConnRecord, conn};
    let mut r = ConnRecord::default();
    r.words[conn::IN_USE] = 1;
    r.words[conn::STATE] = conn::STATE_ACTIVE | conn::MODE_TCP << 16;
    // Local: 10.0.0.1:80 (a dual-stack socket's v4-mapped address is recorded as IPv4).
    r.words[conn::LOCAL] = u64::from(u32::from(std::net::Ipv4Addr::new(10, 0, 0, 1))) << 16 | 80;
    // Peer: [2001:db8::5]:4000.
    let ip: std::net::Ipv6Addr = "2001:db8::5".parse().unwrap();
    let o = ip.octets();
    r.words[conn::PEER] = 4000;
    r.words[conn::PEER6] = u64::from_be_bytes(o[..8].try_into().unwrap());
    r.words[conn::PEER6 + 1] = u64::from_be_bytes(o[8..].try_into().unwrap());
    r.words[conn::FAMILY] = 2;
    let c = Conn::from_record(&r);
    assert_eq!(c.local.to_string(), "10.0.0.1:80");
    assert_eq!(c.peer.to_string(), "[2001:db8::5]:4000");
}

/// `smcr stats` in smc-tools' layout: RX and TX blocks with requests and buffers by size,
/// closed connections' counts (totals) and open ones' (records) together.
#[test]
fn smc_tools_stats() {
    let s = example();
    check("stats.txt", &render_stats(&s, false));
    check("stats-details.txt", &render_stats(&s, true));
    let (rx, tx) = (traffic(&s, false), traffic(&s, true));
    // Totals plus the open SMC-R connections' records (two 64 KiB buffers each way).
    assert_eq!(rx.reqs, [6, 0, 1, 0, 0, 0, 0, 0, 0]);
    assert_eq!(tx.reqs, [4, 0, 0, 0, 0, 0, 0, 0, 2]);
    assert_eq!(rx.bufs, [0, 0, 0, 3, 0, 0, 0, 0, 0]);
    assert_eq!(tx.bufs, [0, 0, 0, 3, 0, 0, 0, 0, 0]);
    assert_eq!((rx.full, tx.full, tx.full_remote), (1, 3, 1));
    assert_eq!((rx.requests(), tx.requests()), (7, 6));
}

#[test]
fn rdma_ports_render_as_smc_rnics_does() {
    use rdma::ibv::sysfs::{GidEntry, GidKind, PortInfo, parse_gid};
    assert_eq!(render_rdma_ports(&[], |_| None), "", "no devices: nothing");
    let v2 = |i, g: &str| GidEntry {
        index: i,
        gid: parse_gid(g).unwrap(),
        kind: GidKind::RoceV2,
        netdev: Some("eth0".into()),
    };
    let ports = [
        PortInfo {
            device: "rxe0".into(),
            port: 1,
            state: "ACTIVE".into(),
            link_layer: "Ethernet".into(),
            gids: vec![
                GidEntry {
                    kind: GidKind::RoceV1,
                    ..v2(0, "fe80:0000:0000:0000:5054:00ff:fe77:0002")
                },
                v2(1, "0000:0000:0000:0000:0000:ffff:0a4d:0002"),
            ],
        },
        PortInfo {
            device: "mlx5_1".into(),
            port: 1,
            state: "DOWN".into(),
            link_layer: "InfiniBand".into(),
            gids: vec![],
        },
    ];
    let t = render_rdma_ports(&ports, |nd| (nd == "eth0").then_some(1500));
    let lines: Vec<&str> = t.lines().collect();
    assert!(lines[1].contains("MODE verbs"), "{t}");
    assert!(lines[2].starts_with("DEVICE"), "{t}");
    assert_eq!(lines.len(), 5, "{t}");
    assert!(
        lines[3].contains("rxe0")
            && lines[3].contains("10.77.0.2")
            && lines[3].contains("eth0")
            && lines[3].ends_with("1500"),
        "{t}"
    );
    assert!(!t.contains("fe80"), "the v1 entry is not listed: {t}");
    assert!(
        lines[4].contains("mlx5_1") && lines[4].contains("DOWN"),
        "{t}"
    );
}
