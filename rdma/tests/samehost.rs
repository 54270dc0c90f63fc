//! The same-host transport: two devices of one host (here one process, two loopback
//! addresses or ports) whose QPs are in shared protection domains move data through shared
//! memory, with the semantics of the UDP path.

use rdma::*;
use std::time::{Duration, Instant};

struct Side {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(shared: bool, caps: QpCaps) -> Side {
    let dev = Device::open(DeviceConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
    let pd = if shared {
        dev.alloc_shared_pd().unwrap()
    } else {
        dev.alloc_pd()
    };
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, caps, false).unwrap();
    Side { dev, pd, cq, qp }
}

fn pair(shared: bool) -> (Side, Side) {
    pair_caps(shared, QpCaps::default())
}

fn pair_caps(shared: bool, caps: QpCaps) -> (Side, Side) {
    let a = side(shared, caps);
    let b = side(shared, caps);
    for (me, peer, my_psn, peer_psn) in [(&a, &b, 0xFF_FFF0, 77), (&b, &a, 77, 0xFF_FFF0)] {
        me.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
        me.qp
            .modify(&QpAttr {
                path_mtu: Some(Mtu::Mtu1024),
                dest_qp_num: Some(peer.qp.qp_num()),
                rq_psn: Some(Psn::new(peer_psn)),
                av: Some(peer.dev.local_addr()),
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
        me.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(my_psn)),
                timeout: Some(14),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
    }
    (a, b)
}

/// Waits until both QPs hold each other's offers (the engine threads take them).
fn wait_same_host(a: &Side, b: &Side) {
    let until = Instant::now() + Duration::from_secs(5);
    while !(a.qp.is_same_host() && b.qp.is_same_host()) {
        assert!(Instant::now() < until, "offers not taken in 5 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A pair ready to talk: through shared memory if `shared`, else over UDP.
fn ready_pair(shared: bool) -> (Side, Side) {
    let (a, b) = pair(shared);
    if shared {
        wait_same_host(&a, &b);
    }
    (a, b)
}

/// A same-host pair whose queues hold 4096 requests each.
fn deep_pair() -> (Side, Side) {
    let caps = QpCaps {
        max_send_wr: 4096,
        max_recv_wr: 4096,
        ..QpCaps::default()
    };
    let (a, b) = pair_caps(true, caps);
    wait_same_host(&a, &b);
    (a, b)
}

/// `n` empty SENDs carrying their index as immediate data.
fn imm_sends(n: u64, flags: SendFlags) -> Vec<SendWr<'static>> {
    (0..n)
        .map(|i| SendWr {
            wr_id: i,
            opcode: WrOpcode::SendWithImm(i as u32),
            sg_list: &[],
            flags,
        })
        .collect()
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(n, 1, "timed out waiting for a completion");
    wc[0]
}

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

#[test]
fn write_and_send_go_through_shared_memory() {
    let (a, b) = pair(true);
    wait_same_host(&a, &b);
    let src = a.pd.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let data = pattern(1 << 20, 1);
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
            sg_list: &[src.sge(100, 44)],
            flags: SendFlags::SIGNALED,
        },
    ])
    .unwrap();
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.opcode),
        (42, WcStatus::Success, 44, WcOpcode::Recv)
    );
    let mut got = vec![0u8; 1 << 20];
    rmb.read(0, &mut got);
    assert!(got == data, "RMB content differs");
    let mut msg = [0u8; 44];
    rbuf.read(0, &mut msg);
    assert_eq!(&msg[..], &data[100..144]);
    assert_eq!(wait_one(&a.cq).wr_id, 1);
    assert_eq!(wait_one(&a.cq).wr_id, 2);
    assert_eq!(a.dev.stats().tx_packets, 0, "nothing went over UDP");
    assert_eq!(b.dev.stats().tx_packets, 0, "nothing went over UDP");
    assert_eq!(a.dev.stats().shm_offers, 1);
    assert_eq!(b.dev.stats().shm_offers, 1);
}

#[test]
fn long_sends_immediates_and_reads() {
    let (a, b) = pair(true);
    wait_same_host(&a, &b);
    let src = a.pd.reg_mr(64 << 10, Access::LOCAL_WRITE).unwrap();
    let data = pattern(64 << 10, 7);
    src.write(0, &data);
    let rbuf = b.pd.reg_mr(64 << 10, Access::LOCAL_WRITE).unwrap();
    let rmb =
        b.pd.reg_mr(
            8192,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    // Two receive requests, the first in two pieces.
    b.qp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sg_list: &[rbuf.sge(0, 1000), rbuf.sge(4096, 40000)],
        },
        RecvWr {
            wr_id: 2,
            sg_list: &[rbuf.sge(48 << 10, 16)],
        },
    ])
    .unwrap();
    a.qp.post_send(&[
        SendWr {
            wr_id: 10,
            opcode: WrOpcode::SendWithImm(0xABCD),
            sg_list: &[src.sge(0, 30000)],
            flags: SendFlags::SIGNALED,
        },
        SendWr {
            wr_id: 11,
            opcode: WrOpcode::RdmaWriteWithImm {
                remote_addr: rmb.addr() + 8,
                rkey: rmb.rkey(),
                imm: 99,
            },
            sg_list: &[src.sge(0, 100)],
            flags: SendFlags::SIGNALED,
        },
    ])
    .unwrap();
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.imm_data),
        (1, WcStatus::Success, 30000, Some(0xABCD))
    );
    let mut got = vec![0u8; 30000];
    rbuf.read(0, &mut got[..1000]);
    rbuf.read(4096, &mut got[1000..]);
    assert!(got == data[..30000], "long SEND scattered wrongly");
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.opcode, r.byte_len, r.imm_data),
        (2, WcOpcode::RecvRdmaWithImm, 100, Some(99))
    );
    let mut w = [0u8; 100];
    rmb.read(8, &mut w);
    assert_eq!(&w[..], &data[..100]);
    // READ back what was written.
    let dst = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    a.qp.post_send(&[SendWr {
        wr_id: 12,
        opcode: WrOpcode::RdmaRead {
            remote_addr: rmb.addr() + 8,
            rkey: rmb.rkey(),
        },
        sg_list: &[dst.sge(0, 100)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let c = wait_one(&a.cq);
        assert_eq!(c.status, WcStatus::Success);
        seen.push(c.wr_id);
    }
    assert_eq!(seen, [10, 11, 12], "completions in order");
    let mut back = [0u8; 100];
    dst.read(0, &mut back);
    assert_eq!(&back[..], &data[..100]);
}

#[test]
fn a_receive_that_comes_late_gets_the_message() {
    let (a, b) = pair(true);
    wait_same_host(&a, &b);
    let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    src.write(0, b"late");
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 4)],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    let mut none = [WorkCompletion::EMPTY];
    assert_eq!(
        b.cq.wait(&mut none, Some(Duration::from_millis(50)))
            .unwrap(),
        0,
        "no receive posted: nothing completes"
    );
    post_recv_64(&b, &rbuf, 5, 0);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.byte_len), (5, 4));
    let mut m = [0u8; 4];
    rbuf.read(0, &mut m);
    assert_eq!(&m, b"late");
}

#[test]
fn a_full_ring_holds_requests_back_without_losing_any() {
    let (a, b) = deep_pair();
    let src = a.pd.reg_mr(4096 * 8, Access::LOCAL_WRITE).unwrap();
    let rbuf = b.pd.reg_mr(64 * 3000, Access::LOCAL_WRITE).unwrap();
    // 3000 messages into a ring of 1024 slots, while the receiver posts slowly.
    let n = 3000usize;
    let wrs = imm_sends(n as u64, SendFlags::SIGNALED);
    src.write(0, &[1; 64]);
    a.qp.post_send(&wrs).unwrap();
    let mut received = 0usize;
    let mut posted = 0usize;
    while received < n {
        if posted < n {
            let k = (n - posted).min(100);
            let rws: Vec<_> = (posted..posted + k)
                .map(|i| (i, [rbuf.sge(i * 64, 64)]))
                .collect();
            let rw: Vec<RecvWr> = rws
                .iter()
                .map(|(i, s)| RecvWr {
                    wr_id: *i as u64,
                    sg_list: s,
                })
                .collect();
            b.qp.post_recv(&rw).unwrap();
            posted += k;
        }
        let c = wait_one(&b.cq);
        assert_eq!(c.status, WcStatus::Success);
        assert_eq!(c.imm_data, Some(received as u32), "in order, none lost");
        received += 1;
    }
    let mut sent = 0;
    while sent < n {
        let c = wait_one(&a.cq);
        assert_eq!(
            (c.status, c.wr_id),
            (WcStatus::Success, sent as u64),
            "send {sent}"
        );
        sent += 1;
    }
}

#[test]
fn bad_rkeys_and_ranges_are_refused_and_nothing_is_touched() {
    for case in ["wrong rkey", "out of bounds", "no write right"] {
        let (a, b) = pair(true);
        wait_same_host(&a, &b);
        let src = a.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[0xEE; 8192]);
        let guard =
            b.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
        let rmb =
            b.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
        let ro = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        let (addr, rkey, len) = match case {
            "wrong rkey" => (rmb.addr(), rmb.rkey() ^ 0x01, 100),
            "out of bounds" => (rmb.addr() + 4000, rmb.rkey(), 200),
            _ => (ro.addr(), ro.rkey(), 10),
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
        // The peer learns through the closed offer connection.
        let until = Instant::now() + Duration::from_secs(5);
        while b.qp.state() != QpState::Error {
            assert!(Instant::now() < until, "peer QP not failed ({case})");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut got = vec![1u8; 4096];
        for mr in [&rmb, &guard, &ro] {
            mr.read(0, &mut got);
            assert!(got.iter().all(|&x| x == 0), "memory was touched ({case})");
        }
    }
}

#[test]
fn a_peer_that_goes_away_fails_the_qp_at_once_after_delivering_what_it_sent() {
    let (a, b) = pair(true);
    wait_same_host(&a, &b);
    let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    src.write(0, b"last words");
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sg_list: &[rbuf.sge(0, 64)],
        },
        RecvWr {
            wr_id: 2,
            sg_list: &[rbuf.sge(64, 64)],
        },
    ])
    .unwrap();
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 10)],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    let t0 = Instant::now();
    drop(a);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status, r.byte_len), (1, WcStatus::Success, 10));
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status), (2, WcStatus::WrFlushErr));
    assert_eq!(b.qp.state(), QpState::Error);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn private_domains_stay_on_udp() {
    let (a, b) = pair(false);
    std::thread::sleep(Duration::from_millis(20));
    assert!(!a.qp.is_same_host() && !b.qp.is_same_host());
    assert_eq!(a.qp.same_host_state(), SameHost::Off);
    let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    post_recv_64(&b, &rbuf, 1, 0);
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 8)],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    assert_eq!(wait_one(&b.cq).byte_len, 8);
    assert!(a.dev.stats().tx_packets > 0);
    assert_eq!(b.dev.stats().shm_offers, 0);
}

#[test]
fn a_shared_domain_talks_udp_to_a_private_one() {
    let a = side(true, QpCaps::default());
    let b = side(false, QpCaps::default());
    for (me, peer) in [(&a, &b), (&b, &a)] {
        me.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
        me.qp
            .modify(&QpAttr {
                path_mtu: Some(Mtu::Mtu1024),
                dest_qp_num: Some(peer.qp.qp_num()),
                rq_psn: Some(Psn::new(5)),
                av: Some(peer.dev.local_addr()),
                ..QpAttr::state(QpState::Rtr)
            })
            .unwrap();
        me.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(5)),
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let ra = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let rb = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    for (qp, mr) in [(&a.qp, &ra), (&b.qp, &rb)] {
        qp.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &[mr.sge(0, 64)],
        }])
        .unwrap();
    }
    for qp in [&a.qp, &b.qp] {
        qp.post_send(&[SendWr {
            wr_id: 1,
            opcode: WrOpcode::Send,
            sg_list: &[],
            flags: SendFlags::empty(),
        }])
        .unwrap();
    }
    let _ = src;
    assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert!(!a.qp.is_same_host() && !b.qp.is_same_host());
}

#[test]
fn deferred_sends_report_and_complete_later_and_a_lost_peer_flushes_them() {
    let (a, b) = deep_pair();
    // No receive posted at b: its ring (1024 entries) fills, the rest waits at a.
    let wrs = imm_sends(1500, SendFlags::SIGNAL_IF_DEFERRED);
    assert_eq!(
        a.qp.post_send_report(&wrs).unwrap(),
        1024,
        "one ring full ran"
    );
    let mut none = [WorkCompletion::EMPTY];
    assert_eq!(a.cq.poll(&mut none), 0, "nothing completed yet");
    // b goes away: the 476 waiting requests complete as flushed, none hangs.
    drop(b);
    let mut flushed = 0;
    while flushed < 476 {
        let c = wait_one(&a.cq);
        assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
        assert!(c.wr_id >= 1024, "only deferred requests complete: {c:?}");
        flushed += 1;
    }
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn deferred_sends_complete_once_the_peer_receives() {
    let (a, b) = deep_pair();
    let wrs = imm_sends(1100, SendFlags::SIGNAL_IF_DEFERRED);
    assert_eq!(a.qp.post_send_report(&wrs).unwrap(), 1024);
    let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sges: Vec<[Sge; 1]> = (0..1100).map(|_| [rbuf.sge(0, 16)]).collect();
    let rws: Vec<RecvWr> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sg_list: s,
        })
        .collect();
    b.qp.post_recv(&rws).unwrap();
    for i in 0..1100u32 {
        assert_eq!(wait_one(&b.cq).imm_data, Some(i));
    }
    // Only the 76 deferred ones produce completions at a.
    for i in 1024..1100u64 {
        let c = wait_one(&a.cq);
        assert_eq!((c.status, c.wr_id), (WcStatus::Success, i));
    }
    let mut none = [WorkCompletion::EMPTY];
    assert_eq!(a.cq.poll(&mut none), 0);
}

/// Whether `fd` is readable within `ms`.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: i32) -> bool {
    let mut p = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::time::Timespec {
        tv_sec: i64::from(ms / 1000),
        tv_nsec: i64::from(ms % 1000) * 1_000_000,
    };
    rustix::event::poll(&mut p, Some(&ts)).unwrap() > 0
}

fn drain(fd: std::os::fd::BorrowedFd<'_>) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// Posts a 64-byte receive at `off` in `mr`.
fn post_recv_64(s: &Side, mr: &MemoryRegion, wr_id: u64, off: usize) {
    s.qp.post_recv(&[RecvWr {
        wr_id,
        sg_list: &[mr.sge(off, 64)],
    }])
    .unwrap();
}

fn send_one(a: &Side, src: &MemoryRegion, wr_id: u64) {
    a.qp.post_send(&[SendWr {
        wr_id,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 8)],
        flags: SendFlags::empty(),
    }])
    .unwrap();
}

#[test]
fn a_driven_cq_wakes_its_driver_and_not_its_other_sleepers() {
    for shared in [true, false] {
        let (a, b) = ready_pair(shared);
        let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        for i in 0..4 {
            post_recv_64(&b, &rbuf, i, i as usize * 64);
        }
        // Driven: a driver says it sleeps, a notification user armed the CQ too; only the
        // driver's descriptor fires.
        b.cq.scheduler().begin_drive();
        assert!(b.cq.scheduler().driven());
        b.cq.req_notify();
        assert!(
            !b.cq.scheduler().drive_sleep(true),
            "nothing there yet ({shared})"
        );
        send_one(&a, &src, 1);
        assert!(
            readable(b.cq.scheduler().driver_fd(), 5000),
            "driver not woken ({shared})"
        );
        b.cq.scheduler().drive_sleep(false);
        assert!(
            !readable(b.cq.fd(), 50),
            "the other sleeper was woken ({shared})"
        );
        drain(b.cq.scheduler().driver_fd());
        let mut wc = [WorkCompletion::EMPTY; 4];
        assert_eq!(b.cq.poll(&mut wc), 1);
        // Something that comes while the driver is busy (not asleep) is left for it, not
        // signalled; ending the drive hands it to the armed sleeper at once.
        send_one(&a, &src, 2);
        // (Over UDP the engine thread receives it meanwhile.)
        std::thread::sleep(Duration::from_millis(100));
        assert!(!readable(b.cq.fd(), 0), "signalled while driven ({shared})");
        b.cq.scheduler().end_drive();
        assert!(!b.cq.scheduler().driven());
        assert!(
            readable(b.cq.fd(), 5000),
            "left-over not handed on ({shared})"
        );
        b.cq.ack_events();
        let mut got = 0;
        let until = Instant::now() + Duration::from_secs(5);
        while got == 0 {
            assert!(Instant::now() < until);
            got = b.cq.poll(&mut wc);
        }
        assert_eq!(wc[0].byte_len, 8);
        // Not driven: the notification descriptor fires, the driver's does not.
        b.cq.req_notify();
        send_one(&a, &src, 3);
        assert!(readable(b.cq.fd(), 5000), "notification lost ({shared})");
        assert!(
            !readable(b.cq.scheduler().driver_fd(), 0),
            "driver woken undriven ({shared})"
        );
    }
}

#[test]
fn a_driver_wait_returns_with_the_message_and_ends_by_its_timeout() {
    for shared in [true, false] {
        let (a, b) = ready_pair(shared);
        let src = a.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        let rbuf = b.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
        post_recv_64(&b, &rbuf, 9, 0);
        b.cq.scheduler().begin_drive();
        let t = Instant::now();
        b.cq.scheduler()
            .drive_wait(Some(Duration::from_millis(100)))
            .unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(90),
            "returned early ({shared})"
        );
        let mut wc = [WorkCompletion::EMPTY];
        assert_eq!(b.cq.poll(&mut wc), 0);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            send_one(&a, &src, 1);
            a
        });
        let t = Instant::now();
        let mut n = 0;
        while n == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "no message ({shared})"
            );
            b.cq.scheduler()
                .drive_wait(Some(Duration::from_secs(5)))
                .unwrap();
            n = b.cq.poll(&mut wc);
        }
        assert_eq!((wc[0].wr_id, wc[0].byte_len), (9, 8));
        b.cq.scheduler().end_drive();
        drop(sender.join().unwrap());
    }
}

#[test]
fn a_kick_ends_the_wait_of_a_sleeper_on_a_driven_cq() {
    // A link group's poller sleeps in `wait_ready` while an event loop drives the CQ; when the
    // loop wakes from a long sleep it kicks the poller (a write to the notification fd), which
    // must end that wait at once — not at its timeout — so the poller watches the loop again.
    for shared in [true, false] {
        let (a, b) = ready_pair(shared);
        let b = std::sync::Arc::new(b);
        b.cq.scheduler().begin_drive();
        let sleeper = {
            let b = b.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let got =
                    b.cq.scheduler()
                        .wait_ready(Some(Duration::from_secs(10)))
                        .unwrap();
                (got, t.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!sleeper.is_finished(), "nothing woke it yet ({shared})");
        b.cq.scheduler().kick();
        let (got, took) = sleeper.join().unwrap();
        assert!(!got, "nothing to poll ({shared})");
        assert!(
            took < Duration::from_secs(5),
            "woke after {took:?} ({shared})"
        );
        b.cq.scheduler().end_drive();
        drop(a);
    }
}

#[test]
fn direct_writes_land_in_the_peers_region_after_the_same_checks() {
    // write_direct: the caller's bytes straight into the peer's region (no local region),
    // refused for a wrong rkey, a range outside the region, or a QP that talks UDP.
    let (a, b) = ready_pair(true);
    let dst =
        b.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let data = pattern(1000, 9);
    assert!(a.qp.write_direct(&data, dst.addr() + 100, dst.rkey()));
    let mut got = vec![0u8; 1000];
    dst.read(100, &mut got);
    assert_eq!(got, data);
    assert!(!a.qp.write_direct(&data, dst.addr(), dst.rkey() ^ 0x100));
    assert!(!a.qp.write_direct(&data, dst.addr() + 3500, dst.rkey()));
    let mut untouched = vec![0u8; 596];
    dst.read(3500, &mut untouched);
    assert!(
        untouched.iter().all(|&b| b == 0),
        "nothing written past the end"
    );
    let (u, v) = ready_pair(false);
    let dst =
        v.pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    assert!(
        !u.qp.write_direct(&data, dst.addr(), dst.rkey()),
        "UDP: post a WRITE"
    );
}

/// A message of the offer exchange, as `samehost::offer` lays it out (48 bytes).
fn offer_msg(kind: u32, fill: impl FnOnce(&mut [u8; 48])) -> [u8; 48] {
    let mut b = [0u8; 48];
    b[..8].copy_from_slice(b"SMCRSHO3");
    b[8..12].copy_from_slice(&kind.to_le_bytes());
    fill(&mut b);
    b
}

fn seqpacket() -> std::os::fd::OwnedFd {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

fn rendezvous(ip: &str, qpn: u32) -> rustix::net::SocketAddrUnix {
    let name = format!("smcr-rdma/{ip}/{:03x}", transport::steer::range_of(qpn));
    rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()
}

/// Receives one message with its descriptors (with a timeout): (bytes, descriptor count).
fn recv_with_fds(fd: std::os::fd::BorrowedFd<'_>, secs: u64) -> (usize, usize) {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let t = Duration::from_secs(secs);
    rustix::net::sockopt::set_socket_timeout(fd, rustix::net::sockopt::Timeout::Recv, Some(t))
        .unwrap();
    let mut buf = [0u8; 64];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(
        fd,
        &mut [std::io::IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::empty(),
    )
    .expect("an answer or the end, in time");
    let fds = control
        .drain()
        .map(|m| match m {
            RecvAncillaryMessage::ScmRights(f) => f.count(),
            _ => 0,
        })
        .sum();
    (r.bytes, fds)
}

/// Whoever meets a QP at a rendezvous without the pair's secret (QPNs and starting PSNs) gets
/// no descriptor, and none of its descriptors is taken: a process that squats the name our
/// peer's device would have answers our hello with a challenge it cannot prove, and a process
/// that says hello to a peer's device in our QP's name cannot prove its offer.
#[test]
fn a_process_without_the_pairs_secret_gets_no_memory_and_gives_none() {
    use std::os::fd::AsFd;
    // 1. A squatter at the rendezvous of an address where no device is.
    let squatter = seqpacket();
    let peer_qpn = 0x0ab_001;
    rustix::net::bind(&squatter, &rendezvous("127.0.0.9", peer_qpn)).unwrap();
    rustix::net::listen(&squatter, 4).unwrap();
    let a = side(true, QpCaps::default());
    a.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    a.qp.modify(&QpAttr {
        path_mtu: Some(Mtu::Mtu1024),
        dest_qp_num: Some(peer_qpn),
        rq_psn: Some(Psn::new(0x12_3456)),
        av: Some("127.0.0.9:4791".parse().unwrap()),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    a.qp.modify(&QpAttr {
        sq_psn: Some(Psn::new(0x65_4321)),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
    let c = rustix::net::accept(&squatter).unwrap();
    let (n, fds) = recv_with_fds(c.as_fd(), 5);
    assert_eq!((n, fds), (48, 0), "a hello, without descriptors");
    // A challenge with a made-up proof.
    let challenge = offer_msg(2, |b| b[16..48].fill(0x42));
    rustix::net::send(&c, &challenge, rustix::net::SendFlags::empty()).unwrap();
    let (n, fds) = recv_with_fds(c.as_fd(), 5);
    assert_eq!((n, fds), (0, 0), "the QP hangs up and sends nothing");
    assert!(a.qp.same_host_peer().is_none());
    assert_eq!(
        a.qp.same_host_state(),
        SameHost::ProofFailed,
        "why, visible"
    );
    // Nobody at all at the peer's address: not found (another host).
    let lone = side(true, QpCaps::default());
    lone.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    assert_eq!(lone.qp.same_host_state(), SameHost::Pending);
    lone.qp
        .modify(&QpAttr {
            path_mtu: Some(Mtu::Mtu1024),
            dest_qp_num: Some(peer_qpn),
            rq_psn: Some(Psn::new(1)),
            av: Some("127.0.0.10:4791".parse().unwrap()),
            ..QpAttr::state(QpState::Rtr)
        })
        .unwrap();
    lone.qp
        .modify(&QpAttr {
            sq_psn: Some(Psn::new(2)),
            ..QpAttr::state(QpState::Rts)
        })
        .unwrap();
    assert_eq!(lone.qp.same_host_state(), SameHost::NotFound);

    // 2. A process in the name of a peer QP, at a real device's rendezvous.
    let (x, y) = pair(true);
    wait_same_host(&x, &y);
    let z = side(true, QpCaps::default());
    z.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    let claimed = 0x0cd_002;
    // Where z's own offer goes (a QP refuses offers while its own is not out): the
    // impostor's, which takes it and stays silent.
    let impostor = seqpacket();
    rustix::net::bind(&impostor, &rendezvous("127.0.0.1", claimed)).unwrap();
    rustix::net::listen(&impostor, 4).unwrap();
    z.qp.modify(&QpAttr {
        path_mtu: Some(Mtu::Mtu1024),
        dest_qp_num: Some(claimed),
        rq_psn: Some(Psn::new(1)),
        av: Some("127.0.0.1:4791".parse().unwrap()),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    z.qp.modify(&QpAttr {
        sq_psn: Some(Psn::new(2)),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
    let c = seqpacket();
    rustix::net::connect(&c, &rendezvous("127.0.0.1", z.qp.qp_num())).unwrap();
    let hello = offer_msg(1, |b| {
        b[12..16].copy_from_slice(&z.qp.qp_num().to_le_bytes());
        b[16..20].copy_from_slice(&claimed.to_le_bytes());
        b[20..24].copy_from_slice(&[127, 0, 0, 1]);
        b[24..26].copy_from_slice(&4791u16.to_le_bytes());
        b[32..48].fill(7);
    });
    rustix::net::send(&c, &hello, rustix::net::SendFlags::empty()).unwrap();
    let (n, fds) = recv_with_fds(c.as_fd(), 5);
    assert_eq!((n, fds), (48, 0), "challenged");
    let ev = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
    let offer = offer_msg(3, |b| b[32..48].fill(0x17));
    let fds = [ev.as_fd(), ev.as_fd(), ev.as_fd(), ev.as_fd()];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        &c,
        &[std::io::IoSlice::new(&offer)],
        &mut control,
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    let (n, _) = recv_with_fds(c.as_fd(), 5);
    assert_eq!(n, 0, "the device hangs up");
    assert!(
        z.qp.same_host_peer().is_none(),
        "an offer without a proof was taken"
    );
    assert!(!z.qp.is_same_host());
    assert_eq!(z.qp.same_host_state(), SameHost::ProofFailed);
    // The real pair is not disturbed.
    assert!(x.qp.is_same_host() && y.qp.is_same_host());
    assert_eq!(x.qp.same_host_state(), SameHost::Shared);
}
