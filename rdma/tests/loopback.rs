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
    let mut cfg = DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.faults = faults;
    let dev = Device::open(cfg).unwrap();
    let pd = dev.alloc_pd();
    let cq = dev.create_cq().unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false).unwrap();
    Side { dev, pd, cq, qp }
}

fn connect(a: &Side, b: &Side, mtu: Mtu, timeout: u8) {
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
                ..QpAttr::state(QpState::Rts)
            })
            .unwrap();
    }
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: 0,
    }];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(n, 1, "timed out waiting for a completion");
    wc[0]
}

#[test]
fn send_and_write_over_udp() {
    let a = side(None);
    let b = side(None);
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
    assert!(a.dev.stats().tx_packets >= 1024);
}
