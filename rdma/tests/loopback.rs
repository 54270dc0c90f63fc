//! Two devices in one process talking RoCE v2 over loopback UDP.

use rdma::*;
use std::time::Duration;

struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(faults: Option<FaultConfig>) -> Side {
    side_gso(faults, true)
}

fn side_gso(faults: Option<FaultConfig>, gso: bool) -> Side {
    let mut cfg = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.faults = faults;
    cfg.gso = gso;
    side_of(cfg)
}

fn side_of(cfg: DeviceConfig) -> Side {
    let dev = Device::open(cfg).unwrap();
    let pd = dev.alloc_pd();
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false).unwrap();
    Side { dev, pd, cq, qp }
}

/// A side whose device keeps the socket with a waiting thread for `hold` between its waits
/// ([`DeviceConfig::rx_hold`]).
fn side_held(hold: Duration) -> Side {
    side_of(held(hold))
}

fn held(hold: Duration) -> DeviceConfig {
    let mut cfg = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.rx_hold = hold;
    cfg
}

/// As [`side_held`], without spinning: the timer-keeper tests count the engine thread's
/// wake-ups, and a waiter whose spins lose the CPU three times in a row (a loaded machine)
/// hands the timers back to the engine for a second, by design.
fn side_keeping(hold: Duration) -> Side {
    side_of(DeviceConfig {
        spin: Duration::ZERO,
        ..held(hold)
    })
}

/// A receive of 64 bytes at the start of `m`.
fn post_recv(s: &Side, m: &MemoryRegion, id: u64) {
    s.qp.post_recv(&[RecvWr {
        wr_id: id,
        sg_list: &[m.sge(0, 64)],
    }])
    .unwrap();
}

/// A SEND of `len` bytes from offset 1024 of `m`.
fn post_send(s: &Side, m: &MemoryRegion, id: u64, len: usize, flags: SendFlags) {
    s.qp.post_send(&[SendWr {
        wr_id: id,
        opcode: WrOpcode::Send,
        sg_list: &[m.sge(1024, len)],
        flags,
    }])
    .unwrap();
}

fn connect(a: &Side, b: &Side, mtu: Mtu, timeout: u8) {
    connect_with(a, b, mtu, timeout, 7);
}

fn connect_with(a: &Side, b: &Side, mtu: Mtu, timeout: u8, retry_cnt: u8) {
    for (me, peer, my_psn, peer_psn) in [(a, b, 0xFF_FFF0, 77), (b, a, 77, 0xFF_FFF0)] {
        me.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
        me.qp
            .modify(&QpAttr {
                path_mtu: Some(mtu),
                dest_qp_num: Some(peer.qp.qp_num()),
                rq_psn: Some(Psn::new(peer_psn)),
                av: Some(peer.dev.local_addr()),
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
        me.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(my_psn)),
                timeout: Some(timeout),
                retry_cnt: Some(retry_cnt),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
    }
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(n, 1, "timed out waiting for a completion");
    wc[0]
}

#[test]
fn send_and_write_over_udp() {
    send_and_write(true);
}

#[test]
fn send_and_write_over_udp_without_gso() {
    send_and_write(false);
}

fn send_and_write(gso: bool) {
    let a = side_gso(None, gso);
    let b = side_gso(None, gso);
    connect(&a, &b, Mtu::Mtu1024, 14);
    let src = a.pd.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    src.write(0, &data);
    b.qp.post_recv(&[RecvWr {
        wr_id: 42,
        sg_list: &[rbuf.sge(0, 4096)],
    }])
    .unwrap();
    a.qp.post_send(&[
        SendWr {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: rmb.addr(),
                rkey: rmb.rkey(),
            },
            sg_list: &[src.sge(0, 1 << 20)],
            flags: SendFlags::SIGNALED,
        },
        SendWr {
            wr_id: 2,
            opcode: WrOpcode::Send,
            sg_list: &[src.sge(0, 44)],
            flags: SendFlags::SIGNALED,
        },
    ])
    .unwrap();
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status, r.byte_len), (42, WcStatus::Success, 44));
    // The SEND follows the WRITE, so once it arrived every written byte is in place.
    let mut got = vec![0u8; 1 << 20];
    rmb.read(0, &mut got);
    assert!(got == data, "RMB content differs");
    assert_eq!(wait_one(&a.cq).wr_id, 1);
    assert_eq!(wait_one(&a.cq).wr_id, 2);
    let st = b.dev.stats();
    assert_eq!(st.rx_icrc_errors, 0);
    assert_eq!(st.rx_malformed, 0);
    let st = a.dev.stats();
    assert!(st.tx_packets >= 1024);
    if gso {
        assert!(st.tx_syscalls < st.tx_packets / 4, "{st:?}");
    } else {
        // One datagram per packet (a batch sent as one would arrive as one malformed packet,
        // which `rx_malformed` above rules out), up to 4 datagrams per `sendmmsg`.
        assert!(
            st.tx_syscalls <= st.tx_packets && st.tx_syscalls * 4 >= st.tx_packets,
            "{st:?}"
        );
    }
}

#[test]
fn bad_rkey_and_out_of_bounds_writes_are_refused_over_udp() {
    for case in ["wrong rkey", "out of bounds"] {
        let a = side(None);
        let b = side(None);
        connect(&a, &b, Mtu::Mtu1024, 14);
        let src = a.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[0xEE; 8192]);
        let guard =
            b.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
        let rmb =
            b.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
        let (addr, rkey, len) = match case {
            "wrong rkey" => (rmb.addr(), rmb.rkey() ^ 0x01, 100),
            _ => (rmb.addr() + 4000, rmb.rkey(), 200), // crosses the end of the region
        };
        a.qp.post_send(&[SendWr {
            wr_id: 7,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: addr,
                rkey,
            },
            sg_list: &[src.sge(0, len)],
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
        let wc = wait_one(&a.cq);
        assert_eq!((wc.wr_id, wc.status), (7, WcStatus::RemAccessErr), "{case}");
        assert_eq!(a.qp.state(), QpState::Error, "{case}");
        assert_eq!(
            b.qp.state(),
            QpState::Error,
            "the responder stops too, as rxe does ({case})"
        );
        assert_eq!(b.qp.responder_stats().access_errors, 1, "{case}");
        let mut got = vec![1u8; 4096];
        for mr in [&rmb, &guard] {
            mr.read(0, &mut got);
            assert!(got.iter().all(|&x| x == 0), "memory was touched ({case})");
        }
    }
}

#[test]
fn retry_exhaustion_when_the_peer_is_gone() {
    let a = side(None);
    let b = side(None);
    connect_with(&a, &b, Mtu::Mtu1024, 10, 2); // 4 ms local ACK timeout, 2 retries
    assert_eq!(
        a.qp.modify(&QpAttr {
            retry_cnt: Some(5),
            ..QpAttr::state(QpState::Rts)
        }),
        Err(ModifyError::NotModifiable("retry_cnt"))
    );
    drop(b); // its engine stops: nothing will ever answer
    let src = a.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let t = std::time::Instant::now();
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 8)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    let wc = wait_one(&a.cq);
    assert_eq!(
        a.dev.stats().tx_packets,
        3,
        "one send and two retransmissions"
    );
    assert_eq!(wc.status, WcStatus::RetryExcErr);
    // The device counts them: two retransmitted packets after two local ACK timeouts (the
    // third ends the QP; a probe may come first, it spends no retry).
    let s = a.dev.stats();
    assert_eq!((s.tx_retransmits, s.rc_timeouts), (2, 2), "{s:?}");
    // 3 timeouts with doubling intervals (4 + 8 + 16 ms) before giving up; never hangs.
    // (retry_cnt 7 would take ~190 ms.)
    let el = t.elapsed();
    assert!(
        el >= Duration::from_millis(25) && el < Duration::from_millis(150),
        "{el:?}"
    );
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn rnr_then_receive_posted_over_udp() {
    let a = side(None);
    let b = side(None);
    connect(&a, &b, Mtu::Mtu1024, 14);
    let src = a.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    src.write(0, b"ready?");
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 6)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    // No receive is posted yet: the responder answers RNR NAKs until one is.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while b.qp.responder_stats().rnr_nak == 0 {
        assert!(std::time::Instant::now() < deadline, "no RNR NAK");
        std::thread::sleep(Duration::from_millis(1));
    }
    let dst = b.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&[RecvWr {
        wr_id: 2,
        sg_list: &[dst.sge(0, 64)],
    }])
    .unwrap();
    assert_eq!(wait_one(&b.cq).byte_len, 6);
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut got = [0u8; 6];
    dst.read(0, &mut got);
    assert_eq!(&got, b"ready?");
    // Both devices count the RNR NAKs: sent by b's responder, received by a's requester.
    let (sa, sb) = (a.dev.stats(), b.dev.stats());
    assert!(sb.tx_rnr_naks >= 1, "{sb:?}");
    assert_eq!(sa.rx_rnr_naks, sb.tx_rnr_naks, "{sa:?} {sb:?}");
    assert!(sa.tx_retransmits >= 1, "{sa:?}");
}

/// One buffer registered on two devices (an SMC-R RMB reachable over two links): a WRITE
/// through either device's key lands in the same bytes; each key works only on its own
/// device; the alias keeps the memory after the first registration is dropped.
#[test]
fn a_buffer_registered_on_two_devices_takes_writes_through_either_key() {
    let (a1, b1) = (side(None), side(None));
    let (a2, b2) = (side(None), side(None));
    connect(&a1, &b1, Mtu::Mtu1024, 14);
    connect(&a2, &b2, Mtu::Mtu1024, 14);
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let rmb = b1.pd.reg_mr(8192, rights).unwrap();
    // Another index on device 2, so device 1's key cannot name the alias by chance (keys are
    // index and a random tag).
    let _other = b2.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let alias = b2.pd.reg_alias(&rmb, rights).unwrap();
    assert_ne!(alias.rkey(), rmb.rkey());
    assert_eq!(alias.len(), rmb.len());
    let write = |from: &Side, off: u64, addr: u64, rkey: u32, byte: u8| {
        let src = from.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[byte; 4096]);
        from.qp
            .post_send(&[SendWr {
                wr_id: u64::from(byte),
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: addr + off,
                    rkey,
                },
                sg_list: &[src.sge(0, 4096)],
                flags: SendFlags::SIGNALED,
            }])
            .unwrap();
        wait_one(&from.cq)
    };
    let wc = write(&a1, 0, rmb.addr(), rmb.rkey(), 0x11);
    assert_eq!(wc.status, WcStatus::Success);
    let wc = write(&a2, 4096, alias.addr(), alias.rkey(), 0x22);
    assert_eq!(wc.status, WcStatus::Success);
    let mut got = vec![0u8; 8192];
    alias.read(0, &mut got);
    assert!(got[..4096].iter().all(|&b| b == 0x11), "link 1's bytes");
    assert!(got[4096..].iter().all(|&b| b == 0x22), "link 2's bytes");
    rmb.read(0, &mut got);
    assert!(got[4096..].iter().all(|&b| b == 0x22), "the same memory");
    // Device 1's key means nothing on device 2.
    let wc = write(&a2, 0, rmb.addr(), rmb.rkey(), 0x33);
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    // The alias outlives the first registration.
    drop(rmb);
    let (a3, b3) = (side(None), side(None));
    connect(&a3, &b3, Mtu::Mtu1024, 14);
    let alias3 = b3.pd.reg_alias(&alias, rights).unwrap();
    let wc = write(&a3, 0, alias3.addr(), alias3.rkey(), 0x44);
    assert_eq!(wc.status, WcStatus::Success);
    alias.read(0, &mut got[..4096]);
    assert!(
        got[..4096].iter().all(|&b| b == 0x44),
        "an alias of an alias"
    );
    // Shared (same-host) domains keep their memory to themselves.
    let shared = b1.dev.alloc_shared_pd().unwrap();
    let in_arena = shared.reg_mr(4096, rights).unwrap();
    assert!(b2.pd.reg_alias(&in_arena, rights).is_err());
    assert!(shared.reg_alias(&alias, rights).is_err());
}

/// A multi-homed device (bound to the wildcard address, serving 127.0.0.1 and 127.0.0.2): two
/// queue pairs on it, each sending from its own address, talk to two queue pairs of a peer
/// device; both paths carry SENDs and WRITEs with valid ICRCs in both directions (the ICRC
/// covers the source and destination addresses, so a wrong one on either side would be
/// dropped and counted). Both paths reach the same memory region with the same key: what a
/// second SMC-R link on a second path needs.
#[test]
fn a_multi_homed_device_runs_queue_pairs_from_each_of_its_addresses() {
    let mut cfg = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.extra_addrs = vec!["127.0.0.2".parse().unwrap()];
    let a = Device::open(cfg).unwrap();
    let b = Device::open(DeviceConfig::new("127.0.0.3:0".parse().unwrap())).unwrap();
    assert_eq!(
        a.local_addr().ip().octets(),
        [127, 0, 0, 1],
        "the GID address"
    );
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (cqa, cqb) = (a.create_cq().unwrap(), b.create_cq().unwrap());
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let rmb = pa.reg_mr(8192, rights).unwrap();
    let src = pb.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let rbuf = pa.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let port = a.local_addr().port();
    let mut pairs = Vec::new();
    for (i, ours) in ["127.0.0.1", "127.0.0.2"].iter().enumerate() {
        let ours: std::net::Ipv4Addr = ours.parse().unwrap();
        let qa = pa.create_qp(&cqa, &cqa, QpCaps::default(), false).unwrap();
        let qb = pb.create_qp(&cqb, &cqb, QpCaps::default(), false).unwrap();
        for (me, peer, av, src) in [
            (&qa, &qb, b.local_addr(), Some(ours)),
            (&qb, &qa, std::net::SocketAddrV4::new(ours, port), None),
        ] {
            me.modify(&QpAttr::state(QpState::Init)).unwrap();
            me.modify(&QpAttr {
                path_mtu: Some(Mtu::Mtu1024),
                dest_qp_num: Some(peer.qp_num()),
                rq_psn: Some(Psn::new(100)),
                av: Some(av),
                src,
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
            me.modify(&QpAttr {
                sq_psn: Some(Psn::new(100)),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
        }
        // b writes 4 KiB into a's region over this path, then a SEND that a receives.
        src.write(i * 4096, &[0x50 + i as u8; 4096]);
        qa.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[rbuf.sge(0, 64)],
        }])
        .unwrap();
        qb.post_send(&[
            SendWr {
                wr_id: 10 + i as u64,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: rmb.addr() + (i * 4096) as u64,
                    rkey: rmb.rkey(),
                },
                sg_list: &[src.sge(i * 4096, 4096)],
                flags: SendFlags::empty(),
            },
            SendWr {
                wr_id: 20 + i as u64,
                opcode: WrOpcode::Send,
                sg_list: &[src.sge(i * 4096, 44)],
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
        let wc = wait_one(&cqa);
        assert_eq!(
            (wc.wr_id, wc.status, wc.qp_num),
            (i as u64, WcStatus::Success, qa.qp_num())
        );
        assert_eq!(
            wait_one(&cqb).status,
            WcStatus::Success,
            "acknowledged over path {i}"
        );
        pairs.push((qa, qb));
    }
    let mut got = vec![0u8; 8192];
    rmb.read(0, &mut got);
    assert!(got[..4096].iter().all(|&x| x == 0x50), "path 1's WRITE");
    assert!(got[4096..].iter().all(|&x| x == 0x51), "path 2's WRITE");
    for s in [a.stats(), b.stats()] {
        assert_eq!(
            (s.rx_icrc_errors, s.rx_wrong_source),
            (0, 0),
            "every packet's addresses as its ICRC says"
        );
    }
    // An address the device does not serve is refused as a source.
    let q = pa.create_qp(&cqa, &cqa, QpCaps::default(), false).unwrap();
    q.modify(&QpAttr::state(QpState::Init)).unwrap();
    assert!(
        q.modify(&QpAttr {
            path_mtu: Some(Mtu::Mtu1024),
            dest_qp_num: Some(1),
            rq_psn: Some(Psn::new(1)),
            av: Some(b.local_addr()),
            src: Some("127.0.0.9".parse().unwrap()),
            ..QpAttr::state(QpState::Rtr)
        })
        .is_err()
    );
}

/// A side whose QP holds the ACK of a SEND for 300 µs (`QpCaps::ack_delay`).
fn side_holding_acks() -> Side {
    side_holding_acks_for(Duration::from_micros(300))
}

/// A side whose QP holds the ACK of a SEND for `delay`.
fn side_holding_acks_for(delay: Duration) -> Side {
    let caps = QpCaps {
        ack_delay: Some(delay),
        ..QpCaps::default()
    };
    let dev = Device::open(DeviceConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
    let pd = dev.alloc_pd();
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, caps, false).unwrap();
    Side { dev, pd, cq, qp }
}

/// `QpCaps::ack_delay` over real UDP: B holds the ACK of A's SEND, answers with a SEND of its
/// own, and the answer and the ACK leave in one system call (`sendmmsg`); A sees both. With
/// no answer, the held ACK leaves by itself (A's SEND completes).
#[test]
fn a_held_ack_leaves_with_the_answer_in_one_system_call() {
    let (a, b) = (side_holding_acks(), side_holding_acks());
    connect(&a, &b, Mtu::Mtu1024, 14);
    let mr = |s: &Side| s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let (ma, mb) = (mr(&a), mr(&b));
    let recv = post_recv;
    let send = |s: &Side, m: &MemoryRegion, id| post_send(s, m, id, 44, SendFlags::SIGNALED);
    // Exchanges until B answers within the hold once (on a loaded machine the hold may end
    // first, and the ACK then leaves alone: that exchange proves nothing).
    let mut merged = 0;
    for round in 0..40u64 {
        if merged > 0 {
            break;
        }
        recv(&b, &mb, 100 + round);
        recv(&a, &ma, 200 + round);
        send(&a, &ma, 300 + round);
        assert_eq!(wait_one(&b.cq).wr_id, 100 + round, "B received A's SEND");
        let (calls, pkts) = (b.dev.stats().tx_syscalls, b.dev.stats().tx_packets);
        send(&b, &mb, 400 + round);
        // A gets the answer and the ACK of its SEND, in either order.
        let mut ids = [wait_one(&a.cq).wr_id, wait_one(&a.cq).wr_id];
        ids.sort();
        assert_eq!(ids, [200 + round, 300 + round]);
        let st = b.dev.stats();
        // Two packets in one call: the answer took the held ACK along. (Two calls happen
        // when B's thread answered after the hold ended, on a loaded machine.)
        if st.tx_packets - pkts == 2 && st.tx_syscalls - calls == 1 {
            merged += 1;
        }
        // B's SEND is not answered: A's ACK leaves alone after its hold.
        assert_eq!(wait_one(&b.cq).wr_id, 400 + round);
    }
    assert!(
        merged > 0,
        "B never answered within the 300 µs hold in 40 exchanges"
    );
    assert_eq!(a.dev.stats().rc_probes + b.dev.stats().rc_probes, 0);
}

/// A thread that received a message whose ACK it holds and then calls into us for anything
/// else (`cork::end`: the preload calls it at `connect`, `socket`, the next wait…) is not
/// answering now: the ACK leaves in that call. Left to the timers it would leave when the
/// engine thread runs them (here: after a 30 s hold), and a peer would probe and resend.
#[test]
fn a_thread_that_moves_on_sends_the_ack_it_holds() {
    // This thread is an application's: it calls into the cork.
    cork::end();
    let (a, b) = (
        side_holding_acks(),
        side_holding_acks_for(Duration::from_secs(30)),
    );
    connect(&a, &b, Mtu::Mtu1024, 14);
    let ma = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    // B's packets are received by this thread only (as by a blocked reader).
    let sched = b.cq.scheduler();
    sched.delegate_rx(true);
    post_recv(&b, &mb, 1);
    post_send(&a, &ma, 2, 44, SendFlags::SIGNALED);
    let mut wc = [WorkCompletion::EMPTY];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while b.cq.poll(&mut wc) == 0 {
        assert!(std::time::Instant::now() < deadline, "A's SEND never came");
        if sched.receive() == 0 {
            std::thread::yield_now();
        }
    }
    assert_eq!(wc[0].wr_id, 1);
    let sent = b.dev.stats().tx_packets;
    cork::end();
    assert_eq!(
        b.dev.stats().tx_packets,
        sent + 1,
        "the held ACK did not leave when the thread moved on"
    );
    assert_eq!(wait_one(&a.cq).wr_id, 2, "A's SEND is acknowledged");
    assert_eq!(a.dev.stats().rc_probes, 0);
    // Nothing more is held: a second call sends nothing.
    cork::end();
    assert_eq!(b.dev.stats().tx_packets, sent + 1);
    sched.delegate_rx(false);
}

/// `DeviceConfig::rx_hold`: after a thread's wait returns, the socket stays with it for its
/// next wait; a thread that does not come back loses it to the engine thread when the hold
/// is over, and what arrives meanwhile is received then (nothing waits for ever).
#[test]
fn a_held_socket_goes_back_to_the_engine_when_its_thread_does_not_return() {
    let hold = Duration::from_millis(20);
    let (a, b) = (side_held(hold), side_held(hold));
    connect(&a, &b, Mtu::Mtu1024, 14);
    let ma = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    for id in 1..=3 {
        b.qp.post_recv(&[RecvWr {
            wr_id: id,
            sg_list: &[mb.sge(64 * id as usize, 64)],
        }])
        .unwrap();
    }
    let send = |id, flags| {
        a.qp.post_send(&[SendWr {
            wr_id: id,
            opcode: WrOpcode::Send,
            sg_list: &[ma.sge(0, 44)],
            flags,
        }])
        .unwrap();
    };
    // Waits that come back at once keep the socket between them. B's thread waits before
    // A sends: sent first, the engine thread could receive the SEND before B's thread takes
    // the socket (the wait then finds the completion and never holds it).
    for id in 1..=2 {
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(5));
                send(10 + id, SendFlags::empty());
            });
            assert_eq!(wait_one(&b.cq).wr_id, id);
        });
    }
    // B's thread does not wait again: nobody receives B's packets until the hold is over,
    // then the engine thread does, and B acknowledges the next SEND (A's completion).
    let start = std::time::Instant::now();
    send(13, SendFlags::SIGNALED);
    assert_eq!(wait_one(&a.cq).wr_id, 13);
    assert!(
        start.elapsed() >= Duration::from_millis(10),
        "acknowledged within {:?}: the socket was not held",
        start.elapsed()
    );
    // (The engine sends the ACK before it queues the completion.)
    assert_eq!(wait_one(&b.cq).wr_id, 3);
}

/// Two threads blocked on two CQs of one device take turns with its socket, each leaving a
/// hand-back behind ([`DeviceConfig::rx_hold`]); when both stop, the engine thread gets the
/// socket back all the same (a second hand-back while one is held must not keep it away).
#[test]
fn two_blocked_readers_on_one_device_hand_the_socket_back() {
    let mut cfg = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.rx_hold = Duration::from_millis(5);
    let bdev = Device::open(cfg).unwrap();
    let bpd = bdev.alloc_pd();
    let a = side(None);
    let a2 = side(None);
    struct B {
        cq: CompletionQueue,
        qp: QueuePair,
    }
    let mut bs = Vec::new();
    for peer in [&a, &a2] {
        let cq = bdev.create_cq().unwrap();
        let caps = QpCaps {
            max_recv_wr: 4096,
            ..QpCaps::default()
        };
        let qp = bpd.create_qp(&cq, &cq, caps, false).unwrap();
        let ends = [
            (&peer.qp, qp.qp_num(), bdev.local_addr()),
            (&qp, peer.qp.qp_num(), peer.dev.local_addr()),
        ];
        for (me, dest, av) in ends {
            me.modify(&QpAttr::state(QpState::Init)).unwrap();
            me.modify(&QpAttr {
                path_mtu: Some(Mtu::Mtu1024),
                dest_qp_num: Some(dest),
                rq_psn: Some(Psn::new(5)),
                av: Some(av),
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
            me.modify(&QpAttr {
                sq_psn: Some(Psn::new(5)),
                timeout: Some(14),
                retry_cnt: Some(7),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
        }
        bs.push(B { cq, qp });
    }
    const ROUNDS: u64 = 1500;
    let mrs: Vec<_> = bs
        .iter()
        .map(|_| bpd.reg_mr(4096, Access::LOCAL_WRITE).unwrap())
        .collect();
    for (b, m) in bs.iter().zip(&mrs) {
        for i in 0..ROUNDS + 1 {
            b.qp.post_recv(&[RecvWr {
                wr_id: i,
                sg_list: &[m.sge(0, 64)],
            }])
            .unwrap();
        }
    }
    // Posts, waiting for room in the send queue (the sender outruns the round trips).
    let send = |s: &Side, m: &MemoryRegion, id, flags| loop {
        let wr = SendWr {
            wr_id: id,
            opcode: WrOpcode::Send,
            sg_list: &[m.sge(0, 44)],
            flags,
        };
        match s.qp.post_send(&[wr]) {
            Ok(()) => break,
            Err(_) => std::thread::yield_now(),
        }
    };
    let (ma, ma2) = (
        a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap(),
        a2.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap(),
    );
    std::thread::scope(|sc| {
        for b in &bs {
            sc.spawn(move || {
                for i in 0..ROUNDS {
                    assert_eq!(wait_one(&b.cq).wr_id, i);
                }
            });
        }
        for i in 0..ROUNDS {
            send(&a, &ma, i, SendFlags::empty());
            send(&a2, &ma2, i, SendFlags::empty());
        }
    });
    // Nobody waits on B now: its engine must take the socket back and acknowledge.
    std::thread::sleep(Duration::from_millis(10));
    send(&a, &ma, 99_999, SendFlags::SIGNALED);
    assert_eq!(wait_one(&a.cq).wr_id, 99_999);
    assert_eq!(wait_one(&bs[0].cq).wr_id, ROUNDS);
}

/// Threads blocked on the socket run the timers themselves: a ping-pong's RC deadlines (armed
/// and met or moved with every message) do not wake the engine thread, which looks at the
/// timers only every 5 ms then. Each of its wake-ups took the CPU from a spinning thread for
/// microseconds, ~800 times a second per process: the ping-pong's p99.
#[test]
fn waiting_threads_run_the_timers_and_the_engine_sleeps() {
    // As smcr opens its devices: the socket stays with a thread between its waits (else the
    // engine thread receives what arrives in between, and wakes for that).
    let hold = Duration::from_millis(1);
    let (a, b) = (side_keeping(hold), side_keeping(hold));
    connect(&a, &b, Mtu::Mtu1024, 14);
    let ma = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let run = Duration::from_millis(400);
    let post = post_recv;
    let send = |s: &Side, m: &MemoryRegion, id| post_send(s, m, id, 32, SendFlags::empty());
    let wakes = |s: &Side| s.dev.stats().engine_wakes;
    let (wa, wb) = (wakes(&a), wakes(&b));
    let start = std::time::Instant::now();
    let mut n = 0u64;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let stop = &stop;
    std::thread::scope(|sc| {
        post(&b, &mb, 0);
        sc.spawn(|| {
            // B answers each message.
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut wc = [WorkCompletion::EMPTY];
                if b.cq.wait(&mut wc, Some(Duration::from_millis(50))).unwrap() == 0 {
                    continue;
                }
                if wc[0].opcode == WcOpcode::Recv {
                    i += 1;
                    post(&b, &mb, i);
                    send(&b, &mb, i);
                }
            }
        });
        while start.elapsed() < run {
            post(&a, &ma, n);
            send(&a, &ma, n);
            // A waits for the answer (its own SEND completes unsignalled).
            loop {
                let wc = wait_one(&a.cq);
                if wc.opcode == WcOpcode::Recv {
                    break;
                }
            }
            n += 1;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let (wa, wb) = (wakes(&a) - wa, wakes(&b) - wb);
    assert!(n > 200, "only {n} exchanges");
    // 400 ms at one look per 5 ms is 80 (82–89 measured); when the engine ran the timers
    // itself it woke ~380 times.
    for (who, w) in [("A", wa), ("B", wb)] {
        assert!(
            w < 200,
            "{who}'s engine woke {w} times in {n} exchanges over {run:?}"
        );
    }
}

/// A thread blocked on an idle connection keeps the timers, and there are none left: the
/// engine thread then sleeps until woken (it looked every 5 ms once: 31 ms of CPU per 10 s for
/// 101 idle connections).
#[test]
fn an_idle_blocked_reader_leaves_the_engine_asleep() {
    let hold = Duration::from_millis(1);
    let (a, b) = (side_keeping(hold), side_keeping(hold));
    connect(&a, &b, Mtu::Mtu1024, 14);
    let ma = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let recv = post_recv;
    let send = |s: &Side, m: &MemoryRegion, id| post_send(s, m, id, 32, SendFlags::SIGNALED);
    // A few exchanges (timers armed, met, handed to the waiting threads), then B waits on an
    // idle connection.
    for id in 0..5u64 {
        recv(&b, &mb, id);
        send(&a, &ma, id);
        assert_eq!(wait_one(&b.cq).wr_id, id);
        assert_eq!(wait_one(&a.cq).wr_id, id);
    }
    recv(&b, &mb, 99);
    // (The deadlines left behind — the hold, the probes — are met within 100 ms.)
    let mut wc = [WorkCompletion::EMPTY];
    assert_eq!(
        b.cq.wait(&mut wc, Some(Duration::from_millis(100)))
            .unwrap(),
        0
    );
    let before = b.dev.stats().engine_wakes;
    assert_eq!(
        b.cq.wait(&mut wc, Some(Duration::from_millis(300)))
            .unwrap(),
        0
    );
    let woke = b.dev.stats().engine_wakes - before;
    assert!(
        woke <= 3,
        "the engine woke {woke} times in 300 ms of idle waiting"
    );
}

/// Small WRITE + SEND messages from A to B, each answered by a SEND from B: `rounds` of them,
/// every byte checked; what A's device counted meanwhile.
fn small_messages(a: &Side, b: &Side, rounds: u64) -> DeviceStats {
    let ma = a.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let before = a.dev.stats();
    for round in 0..rounds {
        let data: Vec<u8> = (0..300u32).map(|i| (i as u64 * 7 + round) as u8).collect();
        ma.write(2048, &data);
        post_recv(b, &mb, 100 + round);
        post_recv(a, &ma, 200 + round);
        a.qp.post_send(&[
            SendWr {
                wr_id: 300 + round,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: rmb.addr() + round * 300 % 60_000,
                    rkey: rmb.rkey(),
                },
                sg_list: &[ma.sge(2048, 300)],
                flags: SendFlags::empty(),
            },
            SendWr {
                wr_id: 400 + round,
                opcode: WrOpcode::Send,
                sg_list: &[ma.sge(1024, 44)],
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
        assert_eq!(wait_one(&b.cq).wr_id, 100 + round);
        let mut got = vec![0u8; 300];
        rmb.read((round * 300 % 60_000) as usize, &mut got);
        assert_eq!(got, data, "round {round}");
        post_send(b, &mb, 500 + round, 44, SendFlags::empty());
        let mut ids = [wait_one(&a.cq).wr_id, wait_one(&a.cq).wr_id];
        ids.sort();
        assert_eq!(ids, [200 + round, 400 + round]);
    }
    let after = a.dev.stats();
    DeviceStats::from_words(
        &after
            .to_words()
            .iter()
            .zip(before.to_words())
            .map(|(x, y)| x - y)
            .collect::<Vec<_>>(),
    )
}

/// Two of our engines learn from each other's mark that they may skip the ICRC and bundle:
/// a message's WRITE and SEND (and an ACK) leave as one datagram; bulk keeps its GSO batches,
/// without ICRC; every byte arrives.
#[test]
fn our_engines_bundle_small_packets_and_skip_the_icrc() {
    let (a, b) = (side(None), side(None));
    connect(&a, &b, Mtu::Mtu1024, 14);
    let d = small_messages(&a, &b, 50);
    assert!(d.tx_bundles >= 45, "{d:?}");
    assert!(d.tx_no_icrc >= 90, "{d:?}");
    // Fewer datagrams than packets: WRITE and SEND together.
    assert!(d.tx_bundles * 3 <= d.tx_packets * 2, "{d:?}");
    let st = b.dev.stats();
    assert!(st.rx_bundles >= 45, "{st:?}");
    assert_eq!((st.rx_icrc_errors, st.rx_malformed), (0, 0), "{st:?}");

    // Bulk: full-size packets in GSO batches, unchecked.
    let before = a.dev.stats();
    let src = a.pd.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    src.write(0, &data);
    a.qp.post_send(&[SendWr {
        wr_id: 9,
        opcode: WrOpcode::RdmaWrite {
            remote_addr: rmb.addr(),
            rkey: rmb.rkey(),
        },
        sg_list: &[src.sge(0, 1 << 20)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    assert_eq!(wait_one(&a.cq).wr_id, 9);
    let mut got = vec![0u8; 1 << 20];
    rmb.read(0, &mut got);
    assert!(got == data, "RMB content differs");
    let st = a.dev.stats();
    let pkts = st.tx_packets - before.tx_packets;
    assert!(st.tx_no_icrc - before.tx_no_icrc >= 1024, "{st:?}");
    assert!(st.tx_syscalls - before.tx_syscalls < pkts / 4, "{st:?}");
    assert_eq!(b.dev.stats().rx_icrc_errors, 0);
}

/// A peer that does not mark (here our engine with the extensions off; Linux rxe and RNICs
/// never mark) is sent plain RoCE v2 only, and its packets are checked.
#[test]
fn a_peer_that_does_not_mark_gets_plain_roce() {
    let a = side(None);
    let b = side_of(DeviceConfig {
        ext: false,
        ..DeviceConfig::new("127.0.0.1:0".parse().unwrap())
    });
    connect(&a, &b, Mtu::Mtu1024, 14);
    let d = small_messages(&a, &b, 20);
    assert_eq!((d.tx_bundles, d.tx_no_icrc), (0, 0), "{d:?}");
    let st = b.dev.stats();
    assert_eq!(
        (st.tx_bundles, st.tx_no_icrc, st.rx_bundles),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!((st.rx_icrc_errors, st.rx_malformed), (0, 0), "{st:?}");
    assert_eq!(a.dev.stats().rx_icrc_errors, 0);
}

/// Bundles are lost, duplicated and overtaken whole, as datagrams are: go-back-N recovers
/// every message.
#[test]
fn bundles_lost_duplicated_and_reordered_are_recovered() {
    let f = FaultConfig {
        drop: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        reorder_delay: Duration::from_micros(300),
        seed: 7,
        ..FaultConfig::default()
    };
    let (a, b) = (side(Some(f)), side(Some(FaultConfig { seed: 8, ..f })));
    connect(&a, &b, Mtu::Mtu1024, 10);
    let d = small_messages(&a, &b, 200);
    assert!(d.tx_bundles >= 100, "{d:?}");
    assert!(d.tx_retransmits > 0, "{d:?}");
    assert_eq!(b.dev.stats().rx_icrc_errors, 0);
}

/// With a peer that is our engine, a held ACK (`QpCaps::ack_delay`) rides in the answer's
/// bundle: one datagram carries both.
#[test]
fn with_our_engine_the_ack_rides_in_the_answers_bundle() {
    let (a, b) = (side_holding_acks(), side_holding_acks());
    connect(&a, &b, Mtu::Mtu1024, 14);
    let mr = |s: &Side| s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let (ma, mb) = (mr(&a), mr(&b));
    let send = |s: &Side, m: &MemoryRegion, id| post_send(s, m, id, 44, SendFlags::SIGNALED);
    // Exchanges until B answers within the hold once (on a loaded machine the hold may end
    // first: that exchange proves nothing). The first ones teach each side the other's mark.
    let mut merged = 0;
    for round in 0..40u64 {
        post_recv(&b, &mb, 100 + round);
        post_recv(&a, &ma, 200 + round);
        send(&a, &ma, 300 + round);
        assert_eq!(wait_one(&b.cq).wr_id, 100 + round, "B received A's SEND");
        let before = b.dev.stats();
        send(&b, &mb, 400 + round);
        let mut ids = [wait_one(&a.cq).wr_id, wait_one(&a.cq).wr_id];
        ids.sort();
        assert_eq!(ids, [200 + round, 300 + round]);
        let st = b.dev.stats();
        if round > 2
            && st.tx_packets - before.tx_packets == 2
            && st.tx_bundles - before.tx_bundles == 1
            && st.tx_syscalls - before.tx_syscalls == 1
        {
            merged += 1;
        }
        assert_eq!(wait_one(&b.cq).wr_id, 400 + round);
        if merged >= 3 {
            break;
        }
    }
    assert!(merged >= 3, "B's answer and ACK never left as one bundle");
    assert_eq!(
        a.dev.stats().rx_icrc_errors + b.dev.stats().rx_icrc_errors,
        0
    );
}

/// A message a little over the path MTU (a full-size WRITE packet, its short last one, the
/// CDC SEND) leaves as one datagram when the route carries it, as TCP sends it in one
/// segment.
#[test]
fn a_message_just_over_the_mtu_leaves_as_one_datagram() {
    let (a, b) = (side(None), side(None));
    connect(&a, &b, Mtu::Mtu1024, 14);
    small_messages(&a, &b, 3); // each learns the other's mark
    let ma = a.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let data: Vec<u8> = (0..1100u32).map(|i| (i * 13) as u8).collect();
    ma.write(2048, &data);
    post_recv(&b, &mb, 1);
    let before = a.dev.stats();
    a.qp.post_send(&[
        SendWr {
            wr_id: 2,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: rmb.addr(),
                rkey: rmb.rkey(),
            },
            sg_list: &[ma.sge(2048, 1100)],
            flags: SendFlags::empty(),
        },
        SendWr {
            wr_id: 3,
            opcode: WrOpcode::Send,
            sg_list: &[ma.sge(1024, 44)],
            flags: SendFlags::SIGNALED,
        },
    ])
    .unwrap();
    assert_eq!(wait_one(&b.cq).wr_id, 1);
    // (Looked at once B has it: later, A's probe may resend, B holding its ACK for an answer.)
    let st = a.dev.stats();
    let mut got = vec![0u8; 1100];
    rmb.read(0, &mut got);
    assert_eq!(got, data);
    if st.tx_retransmits == before.tx_retransmits {
        let d = (
            st.tx_packets - before.tx_packets,
            st.tx_bundles - before.tx_bundles,
            st.tx_syscalls - before.tx_syscalls,
        );
        // (A fourth packet: the held ACK of B's last answer, riding along.)
        assert!(matches!(d, (3 | 4, 1, 1)), "{d:?} {st:?}");
    } else {
        // A machine that stalled past the probe: the first copy still went as a bundle.
        assert!(st.tx_bundles > before.tx_bundles, "{st:?}");
    }
    assert_eq!(wait_one(&a.cq).wr_id, 3);
}

/// `rdma::cork`: what a corked thread posts leaves when it uncorks, all of it in one
/// datagram; a thread that does not uncork has it sent by the engine's timer
/// (`DeviceConfig::cork_max`).
#[test]
fn a_corked_threads_requests_leave_together_when_it_uncorks_or_by_the_engine() {
    let long = DeviceConfig {
        cork_max: Duration::from_secs(30),
        ..DeviceConfig::new("127.0.0.1:0".parse().unwrap())
    };
    let (a, b) = (side_of(long), side(None));
    connect(&a, &b, Mtu::Mtu1024, 14);
    small_messages(&a, &b, 3); // each learns the other's mark: bundles
    let ma = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let mb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    for id in 1..=3 {
        post_recv(&b, &mb, id);
    }
    let before = a.dev.stats();
    rdma::cork::begin();
    assert!(rdma::cork::corked());
    for id in 11..=13 {
        post_send(&a, &ma, id, 40, SendFlags::SIGNALED);
    }
    // Nothing can send them now: the cork's timer is 30 s away, nothing else is in flight.
    assert_eq!(a.dev.stats().tx_packets, before.tx_packets);
    rdma::cork::end();
    assert!(!rdma::cork::corked());
    let got: Vec<u64> = (0..3).map(|_| wait_one(&b.cq).wr_id).collect();
    assert_eq!(got, [1, 2, 3]);
    let st = a.dev.stats();
    assert_eq!(st.tx_packets - before.tx_packets, 3);
    assert_eq!(
        st.tx_syscalls - before.tx_syscalls,
        1,
        "one datagram: {st:?}"
    );
    assert_eq!(st.tx_bundles - before.tx_bundles, 1);
    let mut done: Vec<u64> = (0..3).map(|_| wait_one(&a.cq).wr_id).collect();
    done.sort();
    assert_eq!(done, [11, 12, 13]);

    // A thread that stays corked: the engine sends what it posted (default cork_max).
    let (c, d) = (side(None), side(None));
    connect(&c, &d, Mtu::Mtu1024, 14);
    let mc = c.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let md = d.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    post_recv(&d, &md, 7);
    rdma::cork::begin();
    post_send(&c, &mc, 70, 40, SendFlags::SIGNALED);
    assert_eq!(wait_one(&d.cq).wr_id, 7, "sent without the thread");
    assert_eq!(wait_one(&c.cq).wr_id, 70);
    rdma::cork::end();
}
