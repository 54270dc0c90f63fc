use super::*;
use std::mem::{offset_of, size_of};

/// Every offset and size this module relies on, as the installed `verbs.h` has them. Skips
/// (saying so) where the header or a C compiler is missing: CI's setup installs both.
#[test]
fn layouts_match_the_installed_header() {
    let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
    if !header.exists() {
        eprintln!(
            "skipped: {} not installed (libibverbs-dev)",
            header.display()
        );
        return;
    }
    let ours: Vec<(&str, usize)> = vec![
        ("sizeof ibv_sge", size_of::<ibv_sge>()),
        ("sizeof ibv_send_wr", size_of::<ibv_send_wr>()),
        ("sizeof ibv_recv_wr", size_of::<ibv_recv_wr>()),
        ("sizeof ibv_wc", size_of::<ibv_wc>()),
        ("sizeof ibv_qp_cap", size_of::<ibv_qp_cap>()),
        ("sizeof ibv_qp_init_attr", size_of::<ibv_qp_init_attr>()),
        ("sizeof ibv_global_route", size_of::<ibv_global_route>()),
        ("sizeof ibv_ah_attr", size_of::<ibv_ah_attr>()),
        ("sizeof ibv_qp_attr", size_of::<ibv_qp_attr>()),
        ("ibv_send_wr.sg_list", offset_of!(ibv_send_wr, sg_list)),
        ("ibv_send_wr.num_sge", offset_of!(ibv_send_wr, num_sge)),
        ("ibv_send_wr.opcode", offset_of!(ibv_send_wr, opcode)),
        (
            "ibv_send_wr.send_flags",
            offset_of!(ibv_send_wr, send_flags),
        ),
        ("ibv_send_wr.imm_data", offset_of!(ibv_send_wr, imm_data)),
        (
            "ibv_send_wr.wr.rdma.remote_addr",
            offset_of!(ibv_send_wr, remote_addr),
        ),
        ("ibv_send_wr.wr.rdma.rkey", offset_of!(ibv_send_wr, rkey)),
        ("ibv_wc.status", offset_of!(ibv_wc, status)),
        ("ibv_wc.opcode", offset_of!(ibv_wc, opcode)),
        ("ibv_wc.byte_len", offset_of!(ibv_wc, byte_len)),
        ("ibv_wc.imm_data", offset_of!(ibv_wc, imm_data)),
        ("ibv_wc.qp_num", offset_of!(ibv_wc, qp_num)),
        ("ibv_wc.wc_flags", offset_of!(ibv_wc, wc_flags)),
        ("ibv_qp_init_attr.cap", offset_of!(ibv_qp_init_attr, cap)),
        (
            "ibv_qp_init_attr.qp_type",
            offset_of!(ibv_qp_init_attr, qp_type),
        ),
        (
            "ibv_qp_init_attr.sq_sig_all",
            offset_of!(ibv_qp_init_attr, sq_sig_all),
        ),
        (
            "ibv_global_route.flow_label",
            offset_of!(ibv_global_route, flow_label),
        ),
        (
            "ibv_global_route.sgid_index",
            offset_of!(ibv_global_route, sgid_index),
        ),
        (
            "ibv_global_route.hop_limit",
            offset_of!(ibv_global_route, hop_limit),
        ),
        ("ibv_ah_attr.dlid", offset_of!(ibv_ah_attr, dlid)),
        ("ibv_ah_attr.is_global", offset_of!(ibv_ah_attr, is_global)),
        ("ibv_ah_attr.port_num", offset_of!(ibv_ah_attr, port_num)),
        ("ibv_qp_attr.path_mtu", offset_of!(ibv_qp_attr, path_mtu)),
        ("ibv_qp_attr.rq_psn", offset_of!(ibv_qp_attr, rq_psn)),
        ("ibv_qp_attr.sq_psn", offset_of!(ibv_qp_attr, sq_psn)),
        (
            "ibv_qp_attr.dest_qp_num",
            offset_of!(ibv_qp_attr, dest_qp_num),
        ),
        (
            "ibv_qp_attr.qp_access_flags",
            offset_of!(ibv_qp_attr, qp_access_flags),
        ),
        ("ibv_qp_attr.cap", offset_of!(ibv_qp_attr, cap)),
        ("ibv_qp_attr.ah_attr", offset_of!(ibv_qp_attr, ah_attr)),
        (
            "ibv_qp_attr.pkey_index",
            offset_of!(ibv_qp_attr, pkey_index),
        ),
        (
            "ibv_qp_attr.max_rd_atomic",
            offset_of!(ibv_qp_attr, max_rd_atomic),
        ),
        (
            "ibv_qp_attr.max_dest_rd_atomic",
            offset_of!(ibv_qp_attr, max_dest_rd_atomic),
        ),
        (
            "ibv_qp_attr.min_rnr_timer",
            offset_of!(ibv_qp_attr, min_rnr_timer),
        ),
        ("ibv_qp_attr.port_num", offset_of!(ibv_qp_attr, port_num)),
        ("ibv_qp_attr.timeout", offset_of!(ibv_qp_attr, timeout)),
        ("ibv_qp_attr.retry_cnt", offset_of!(ibv_qp_attr, retry_cnt)),
        ("ibv_qp_attr.rnr_retry", offset_of!(ibv_qp_attr, rnr_retry)),
        ("ibv_port_attr.state", offset_of!(ibv_port_attr, state)),
        (
            "ibv_port_attr.active_mtu",
            offset_of!(ibv_port_attr, active_mtu),
        ),
        (
            "ibv_port_attr.gid_tbl_len",
            offset_of!(ibv_port_attr, gid_tbl_len),
        ),
        ("ibv_context.ops", offset_of!(ibv_context, ops)),
        ("ibv_context_ops.poll_cq", 8 * OPS_POLL_CQ),
        ("ibv_context_ops.req_notify_cq", 8 * OPS_REQ_NOTIFY_CQ),
        ("ibv_context_ops.post_send", 8 * OPS_POST_SEND),
        ("ibv_context_ops.post_recv", 8 * OPS_POST_RECV),
        ("ibv_mr.addr", offset_of!(ibv_mr, addr)),
        ("ibv_mr.lkey", offset_of!(ibv_mr, lkey)),
        ("ibv_mr.rkey", offset_of!(ibv_mr, rkey)),
        ("ibv_qp.qp_num", offset_of!(ibv_qp, qp_num)),
        ("ibv_comp_channel.fd", offset_of!(ibv_comp_channel, fd)),
    ];
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void){\n",
    );
    for (name, _) in &ours {
        let expr = match name.strip_prefix("sizeof ") {
            Some(t) => format!("sizeof(struct {t})"),
            None => {
                let (t, f) = name.split_once('.').unwrap();
                format!("offsetof(struct {t}, {f})")
            }
        };
        c += &format!("printf(\"%zu\\n\", (size_t){expr});\n");
    }
    c += "return 0;}\n";
    let dir = std::env::temp_dir().join(format!("rdma-ibv-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("l.c");
    let exe = dir.join("l");
    std::fs::write(&src, c).unwrap();
    let built = std::process::Command::new("cc")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let built = match built {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C compiler ({e})");
            return;
        }
    };
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = std::process::Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let theirs: Vec<usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(theirs.len(), ours.len());
    // The ops offsets are within the table; ours counts from the table's start.
    let wrong: Vec<String> = ours
        .iter()
        .zip(&theirs)
        .filter(|((_, o), t)| o != *t)
        .map(|((n, o), t)| format!("{n}: ours {o}, verbs.h {t}"))
        .collect();
    assert!(wrong.is_empty(), "layouts differ: {wrong:#?}");
}

#[test]
fn send_requests_translate_to_verbs() {
    let sge = [crate::Sge {
        addr: 0x1000,
        length: 64,
        lkey: 7,
    }];
    let w = to_send_wr(&SendWr {
        wr_id: 42,
        opcode: WrOpcode::RdmaWriteWithImm {
            remote_addr: 0xdead_0000,
            rkey: 0x99,
            imm: 0x0102_0304,
        },
        sg_list: &sge,
        flags: SendFlags::SIGNAL_IF_DEFERRED | SendFlags::SOLICITED,
    });
    assert_eq!(w.wr_id, 42);
    assert_eq!(w.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    assert_eq!(w.num_sge, 1);
    assert_eq!((w.remote_addr, w.rkey), (0xdead_0000, 0x99));
    assert_eq!(w.imm_data.to_ne_bytes(), [1, 2, 3, 4], "network order");
    assert_eq!(w.send_flags, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED);
    let s = to_send_wr(&SendWr {
        wr_id: 1,
        opcode: WrOpcode::Send,
        sg_list: &[],
        flags: SendFlags::empty(),
    });
    assert_eq!((s.opcode, s.send_flags, s.num_sge), (IBV_WR_SEND, 0, 0));
}

#[test]
fn completions_translate_from_verbs() {
    let w = ibv_wc {
        wr_id: 5,
        status: 0,
        opcode: IBV_WC_RECV_RDMA_WITH_IMM,
        byte_len: 0,
        imm_data: 0x0a0b0c0du32.to_be(),
        qp_num: 17,
        wc_flags: IBV_WC_WITH_IMM,
        ..Default::default()
    };
    let c = from_wc(&w);
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(c.opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(c.imm_data, Some(0x0a0b0c0d));
    assert_eq!(c.qp_num, 17);
    let e = from_wc(&ibv_wc { status: 21, ..w });
    assert_eq!(e.status, WcStatus::DeviceErr(21));
    let f = from_wc(&ibv_wc {
        status: 5,
        wc_flags: 0,
        ..w
    });
    assert_eq!((f.status, f.imm_data), (WcStatus::WrFlushErr, None));
}

/// Without devices nothing fails: the scan is empty and opening a device names the problem.
#[test]
fn no_device_is_a_clear_error() {
    let ports = sysfs::scan(std::path::Path::new(sysfs::SYSFS_ROOT));
    if !ports.is_empty() {
        eprintln!("skipped: this machine has RDMA devices");
        return;
    }
    match Context::open("smcr-no-such-device", 1) {
        Ok(_) => panic!("opened a device that does not exist"),
        Err(e) => {
            let s = e.to_string();
            assert!(
                s.contains("no RDMA device") || s.contains("libibverbs"),
                "unclear error: {s}"
            );
        }
    }
}

/// Send completions get the caller's ids back; unsignaled successes are counted, not
/// delivered; errors always are; what is unfinished is known.
#[test]
fn tracks_give_the_callers_completions_back() {
    let t = Tracks::default();
    let a = t.send(10, false);
    let b = t.send(11, true);
    let c = t.send(12, false);
    let r = t.recv(99);
    assert_eq!(t.unfinished(), 3);
    let wc = |wr_id, status| WorkCompletion {
        wr_id,
        status,
        ..WorkCompletion::EMPTY
    };
    assert_eq!(
        t.complete(&wc(a, WcStatus::Success)),
        Some(None),
        "unsignaled: dropped"
    );
    let got = t.complete(&wc(b, WcStatus::Success)).unwrap().unwrap();
    assert_eq!(got.wr_id, 11);
    assert_eq!(t.unfinished(), 1);
    let err = t.complete(&wc(c, WcStatus::WrFlushErr)).unwrap().unwrap();
    assert_eq!(
        (err.wr_id, err.status),
        (12, WcStatus::WrFlushErr),
        "errors are delivered"
    );
    assert_eq!(t.unfinished(), 0);
    let rc = t.complete(&WorkCompletion {
        opcode: WcOpcode::Recv,
        ..wc(r, WcStatus::Success)
    });
    assert_eq!(rc.unwrap().unwrap().wr_id, 99);
    assert_eq!(
        t.complete(&wc(a, WcStatus::Success)),
        None,
        "not one of ours any more"
    );
    // Requests the device refused are forgotten.
    t.send(1, true);
    t.send(2, true);
    t.unsend(1);
    assert_eq!(t.unfinished(), 1);
}

#[test]
fn a_refused_chain_counts_what_was_taken() {
    let v = [0u64; 4];
    let first = v.as_ptr();
    assert_eq!(taken(first, (&v[2] as *const u64).cast_mut(), 4), 2);
    assert_eq!(taken(first, std::ptr::null_mut(), 4), 0);
}

#[test]
fn alternate_gids_are_checked_and_kept() {
    use std::net::Ipv4Addr;
    let table = |i: u32| -> std::io::Result<[u8; 16]> {
        match i {
            1 => Ok(Ipv4Addr::new(10, 77, 0, 3).to_ipv6_mapped().octets()),
            3 => Ok(Ipv4Addr::new(10, 77, 0, 13).to_ipv6_mapped().octets()),
            _ => Err(std::io::Error::other("no such entry")),
        }
    };
    let a = Ipv4Addr::new(10, 77, 0, 3);
    let b = Ipv4Addr::new(10, 77, 0, 13);
    // std::hint::black_box: the input as the caller's runtime values, not constants.
    let alts = std::hint::black_box(vec![(a, 1), (b, 3)]);
    assert_eq!(
        dev::checked_alts(&alts, table).unwrap(),
        vec![(a, 1), (b, 3)]
    );
    let e = dev::checked_alts(&[(b, 1)], table).unwrap_err();
    assert!(e.to_string().contains("GID 1 is not 10.77.0.13's"), "{e}");
    assert!(dev::checked_alts(&[(a, 7)], table).is_err());
    assert!(dev::checked_alts(&[(a, 300)], |_| Ok(a.to_ipv6_mapped().octets())).is_err());
}
