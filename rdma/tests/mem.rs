//! The in-memory device ([`rdma::mem`]): requests run when posted, with the checks and the
//! errors of RC.

use rdma::*;
use std::net::Ipv4Addr;

struct Pair {
    a: Device,
    b: Device,
    qa: QueuePair,
    qb: QueuePair,
    ca: CompletionQueue,
    cb: CompletionQueue,
    pa: ProtectionDomain,
    pb: ProtectionDomain,
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, last)
}

fn connect(q: &QueuePair, peer: &QueuePair, dev: &Device) {
    connect_at(q, peer, dev.local_addr());
}

/// Connects `q` to `peer` at address `av` (a device may have more than one).
fn connect_at(q: &QueuePair, peer: &QueuePair, av: std::net::SocketAddrV4) {
    q.modify(&QpAttr::state(QpState::Init)).unwrap();
    q.modify(&QpAttr {
        dest_qp_num: Some(peer.qp_num()),
        av: Some(av),
        rq_psn: Some(Psn::new(0)),
        path_mtu: Some(Mtu::Mtu1024),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    q.modify(&QpAttr {
        sq_psn: Some(Psn::new(0)),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
}

fn pair(fabric: &std::sync::Arc<mem::Fabric>) -> Pair {
    let a = Device::open_mem(fabric, ip(1)).unwrap();
    let b = Device::open_mem(fabric, ip(2)).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (a.create_cq().unwrap(), b.create_cq().unwrap());
    let qa = pa.create_qp(&ca, &ca, QpCaps::default(), false).unwrap();
    let qb = pb.create_qp(&cb, &cb, QpCaps::default(), false).unwrap();
    connect(&qa, &qb, &b);
    connect(&qb, &qa, &a);
    Pair {
        a,
        b,
        qa,
        qb,
        ca,
        cb,
        pa,
        pb,
    }
}

fn poll(cq: &CompletionQueue) -> Vec<WorkCompletion> {
    let mut wcs = [WorkCompletion::EMPTY; 16];
    let n = cq.poll(&mut wcs);
    wcs[..n].to_vec()
}

#[test]
fn a_send_fills_the_oldest_receive_and_one_without_a_receive_waits_for_it() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    let src = p.pa.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let dst = p.pb.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    src.write(0, b"first second");
    let send = |off: usize, len: usize, id: u64, imm: Option<u32>| {
        p.qa.post_send(&[SendWr {
            wr_id: id,
            opcode: imm.map_or(WrOpcode::Send, WrOpcode::SendWithImm),
            sg_list: &[src.sge(off, len)],
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    };
    // No receive posted yet: it waits (as an RNR retry would), and the sender's completion
    // is there already.
    send(0, 5, 1, None);
    assert_eq!(poll(&p.ca).len(), 1);
    assert!(poll(&p.cb).is_empty());
    p.qb.post_recv(&[RecvWr {
        wr_id: 10,
        sg_list: &[dst.sge(0, 32)],
    }])
    .unwrap();
    let got = poll(&p.cb);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].wr_id, got[0].byte_len, got[0].opcode),
        (10, 5, WcOpcode::Recv)
    );
    p.qb.post_recv(&[RecvWr {
        wr_id: 11,
        sg_list: &[dst.sge(32, 32)],
    }])
    .unwrap();
    send(6, 6, 2, Some(0xabcd));
    let got = poll(&p.cb);
    assert_eq!((got[0].wr_id, got[0].imm_data), (11, Some(0xabcd)));
    let mut out = [0u8; 6];
    dst.read(32, &mut out);
    assert_eq!(&out, b"second");
    dst.read(0, &mut out[..5]);
    assert_eq!(&out[..5], b"first");
}

#[test]
fn a_write_lands_before_post_send_returns_and_unsignaled_ones_complete_silently() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    let src = p.pa.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let dst = p.pb.reg_mr(4096, Access::REMOTE_WRITE).unwrap();
    src.write(100, &[7u8; 300]);
    for (id, flags) in [(1, SendFlags::empty()), (2, SendFlags::SIGNALED)] {
        p.qa.post_send(&[SendWr {
            wr_id: id,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: dst.addr() + 1000,
                rkey: dst.rkey(),
            },
            sg_list: &[src.sge(100, 300)],
            flags,
        }])
        .unwrap();
    }
    let mut out = [0u8; 300];
    dst.read(1000, &mut out);
    assert_eq!(out, [7u8; 300]);
    let got = poll(&p.ca);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].wr_id, got[0].opcode, got[0].byte_len),
        (2, WcOpcode::RdmaWrite, 300)
    );
    assert!(poll(&p.cb).is_empty(), "a plain WRITE consumes no receive");
}

#[test]
fn a_bad_rkey_or_range_fails_the_request_and_both_queue_pairs() {
    for case in ["key", "range", "rights"] {
        let fabric = mem::Fabric::new();
        let p = pair(&fabric);
        let src = p.pa.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let dst = p.pb.reg_mr(64, Access::REMOTE_READ).unwrap();
        let ok = p.pb.reg_mr(64, Access::REMOTE_WRITE).unwrap();
        let (addr, rkey) = match case {
            "key" => (ok.addr(), ok.rkey() ^ 0x100),
            "range" => (ok.addr() + 32, ok.rkey()),
            _ => (dst.addr(), dst.rkey()),
        };
        p.qb.post_recv(&[RecvWr {
            wr_id: 5,
            sg_list: &[],
        }])
        .unwrap();
        p.qa.post_send(&[
            SendWr {
                wr_id: 1,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: addr,
                    rkey,
                },
                sg_list: &[src.sge(0, 64)],
                flags: SendFlags::empty(),
            },
            SendWr {
                wr_id: 2,
                opcode: WrOpcode::Send,
                sg_list: &[],
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
        let got = poll(&p.ca);
        let st: Vec<_> = got.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            st,
            [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)],
            "{case}"
        );
        assert_eq!(p.qa.state(), QpState::Error, "{case}");
        assert_eq!(p.qb.state(), QpState::Error, "{case}");
        // The responder's posted receive is flushed; the region it guards is untouched.
        let got = poll(&p.cb);
        assert_eq!((got[0].wr_id, got[0].status), (5, WcStatus::WrFlushErr));
        let mut out = [1u8; 64];
        ok.read(0, &mut out);
        assert_eq!(out, [0u8; 64], "{case}");
    }
}

#[test]
fn a_local_key_that_is_wrong_fails_with_loc_prot_err() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    let src = p.pa.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let mut sge = src.sge(0, 128); // past its end
    p.qa.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[sge],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    assert_eq!(poll(&p.ca)[0].status, WcStatus::LocProtErr);
    // Posting to a QP in error flushes.
    sge.length = 8;
    p.qa.post_send(&[SendWr {
        wr_id: 2,
        opcode: WrOpcode::Send,
        sg_list: &[sge],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    assert_eq!(poll(&p.ca)[0].status, WcStatus::WrFlushErr);
}

#[test]
fn nobody_at_the_peer_address_is_a_retry_exceeded() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    let Pair {
        a,
        qa,
        ca,
        b,
        qb,
        pb,
        ..
    } = p;
    // Every handle of device b goes: its address is nobody's.
    drop((qb, pb, b));
    qa.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    assert_eq!(poll(&ca)[0].status, WcStatus::RetryExcErr);
    assert_eq!(qa.state(), QpState::Error);
    // The address is free again; a's is not.
    Device::open_mem(&fabric, ip(2)).unwrap();
    assert!(
        Device::open_mem(&fabric, *a.local_addr().ip()).is_err(),
        "taken"
    );
}

#[test]
fn posting_before_rts_is_refused_and_the_fd_wakes_a_sleeper() {
    let fabric = mem::Fabric::new();
    let a = Device::open_mem(&fabric, ip(1)).unwrap();
    let pd = a.alloc_pd();
    let cq = a.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default(), true).unwrap();
    let e = qp
        .post_send(&[SendWr {
            wr_id: 1,
            opcode: WrOpcode::Send,
            sg_list: &[],
            flags: SendFlags::empty(),
        }])
        .unwrap_err();
    assert!(
        matches!(e, PostError::InvalidState(QpState::Reset)),
        "{e:?}"
    );
    // A QP to itself: its own SEND completes both ways, and the CQ's fd is readable.
    connect(&qp, &qp, &a);
    qp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &[],
    }])
    .unwrap();
    qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[],
        flags: SendFlags::empty(),
    }])
    .unwrap();
    let fd = cq.fd();
    let mut p = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    assert_eq!(rustix::event::poll(&mut p, None).unwrap(), 1);
    let sched = cq.scheduler();
    assert!(sched.wait_ready(Some(std::time::Duration::ZERO)).unwrap());
    // The receiver's completion first: the data is there before the sender hears of it.
    let ids: Vec<_> = poll(&cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [9, 1]);
}

#[test]
fn deferred_sends_read_their_memory_when_they_run_and_fail_if_it_was_deregistered() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    let dst = p.pb.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.qb.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[dst.sge(0, 64)],
    }])
    .unwrap();
    let kept = p.pa.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    kept.write(0, b"posted");
    p.a.defer_sends(true);
    let send = |mr: &MemoryRegion, id: u64| {
        p.qa.post_send(&[SendWr {
            wr_id: id,
            opcode: WrOpcode::Send,
            sg_list: &[mr.sge(0, 6)],
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    };
    send(&kept, 7);
    // Nothing ran: no completion on either side, and the request reads what is there later.
    assert_eq!(p.a.deferred_sends(), 1);
    assert!(poll(&p.ca).is_empty() && poll(&p.cb).is_empty());
    kept.write(0, b"latest");
    p.a.defer_sends(false);
    assert_eq!(p.a.deferred_sends(), 0);
    let wcs = poll(&p.ca);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (7, WcStatus::Success));
    let mut got = [0u8; 6];
    dst.read(0, &mut got);
    assert_eq!(&got, b"latest");
    // A buffer deregistered between post and send fails the request, as on a verbs device.
    let gone = p.pa.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.a.defer_sends(true);
    send(&gone, 8);
    drop(gone);
    p.a.defer_sends(false);
    let wcs = poll(&p.ca);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (8, WcStatus::LocProtErr));
    assert_eq!(p.qa.state(), QpState::Error);
}

#[test]
fn a_second_address_reaches_the_same_device() {
    let fabric = mem::Fabric::new();
    let p = pair(&fabric);
    assert!(fabric.add_address(ip(2), ip(12)));
    assert!(!fabric.add_address(ip(2), ip(1)), "taken");
    assert!(!fabric.add_address(ip(9), ip(19)), "no device there");
    // qa's peer at b's second address.
    let qa2 =
        p.pa.create_qp(&p.ca, &p.ca, QpCaps::default(), false)
            .unwrap();
    let qb2 =
        p.pb.create_qp(&p.cb, &p.cb, QpCaps::default(), false)
            .unwrap();
    connect_at(&qa2, &qb2, std::net::SocketAddrV4::new(ip(12), 4791));
    connect(&qb2, &qa2, &p.a);
    let src = p.pa.reg_mr(8, Access::LOCAL_WRITE).unwrap();
    let dst = p.pb.reg_mr(8, Access::LOCAL_WRITE).unwrap();
    qb2.post_recv(&[RecvWr {
        wr_id: 3,
        sg_list: &[dst.sge(0, 8)],
    }])
    .unwrap();
    src.write(0, b"via alt!");
    qa2.post_send(&[SendWr {
        wr_id: 4,
        opcode: WrOpcode::Send,
        sg_list: &[src.sge(0, 8)],
        flags: SendFlags::SIGNALED,
    }])
    .unwrap();
    assert_eq!(poll(&p.ca)[0].status, WcStatus::Success);
    let mut got = [0u8; 8];
    dst.read(0, &mut got);
    assert_eq!(&got, b"via alt!");
}
