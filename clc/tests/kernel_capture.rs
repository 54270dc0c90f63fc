//! Every CLC message of a real Linux 6.12 SMC-Rv2 session (testdata/README.md) parses into the
//! fields Linux sent and re-emits byte for byte.

#[path = "../../testdata/capture.rs"]
mod capture;

use clc::*;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

/// (frame, message bytes) of every CLC message, framed from each direction's TCP byte stream.
fn clc_messages() -> Vec<(usize, Vec<u8>)> {
    let mut streams: BTreeMap<u16, Vec<(usize, Vec<u8>)>> = BTreeMap::new();
    for item in capture::read(capture::REFERENCE) {
        if let capture::Item::Tcp {
            frame,
            sport,
            payload,
        } = item
        {
            streams.entry(sport).or_default().push((frame, payload));
        }
    }
    let mut out = Vec::new();
    for segs in streams.values() {
        let mut buf = Vec::new();
        let mut frame_of_start = 0;
        for (frame, p) in segs {
            if buf.is_empty() {
                frame_of_start = *frame;
            }
            buf.extend_from_slice(p);
            while buf.len() >= HEADER_LEN {
                let len = message_len(&buf).expect("CLC header in the TCP stream");
                if buf.len() < len {
                    break;
                }
                out.push((frame_of_start, buf.drain(..len).collect()));
                frame_of_start = *frame;
            }
        }
        assert!(buf.is_empty(), "no partial CLC message left over");
    }
    out.sort_by_key(|(f, _)| *f);
    out
}

fn smcr(m: &Message) -> (&AcceptConfirm, &SmcrAcceptConfirm) {
    let Message::AcceptConfirm(a) = m else {
        panic!("not an Accept/Confirm: {m}")
    };
    (a, a.smcr().expect("SMC-R"))
}

#[test]
fn test_every_clc_message_roundtrips() {
    let msgs = clc_messages();
    let frames: Vec<usize> = msgs.iter().map(|(f, _)| *f).collect();
    assert_eq!(
        frames,
        [4, 6, 8, 200, 206, 212],
        "two handshakes: first contact and reuse"
    );
    for (frame, bytes) in &msgs {
        let m = Message::parse(bytes).unwrap_or_else(|e| panic!("frame {frame}: {e}"));
        assert_eq!(m.buffer_len(), bytes.len(), "frame {frame}");
        assert_eq!(
            &m.to_vec(),
            bytes,
            "frame {frame} re-emits byte for byte: {m}"
        );
    }
}

#[test]
fn test_fields_of_the_kernel_handshake() {
    let msgs: Vec<Message> = clc_messages()
        .iter()
        .map(|(_, b)| Message::parse(b).unwrap())
        .collect();
    let ueid = Eid::new("SMC-KERNEL-PEER").unwrap();

    // Frame 4: the Linux-on-rxe Proposal — v2 SMC-R only, empty local area, one UEID.
    let Message::Proposal(p) = &msgs[0] else {
        panic!("{}", msgs[0])
    };
    assert_eq!(
        (p.version, p.typev1, p.typev2),
        (2, SmcType::None, SmcType::R)
    );
    assert_eq!((p.peer_id, p.gid, p.mac), Default::default());
    assert!(p.prefix.is_none());
    assert_eq!(p.smcd, Some(SmcdInfo::default()));
    let v2 = p.v2.as_ref().unwrap();
    assert_eq!(v2.release, 1);
    assert!(!v2.seid);
    assert_eq!(v2.roce_gid, Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 3)));
    assert_eq!(
        (v2.max_conns, v2.max_links, v2.feature_mask),
        (255, 2, 0x0001)
    );
    assert_eq!(v2.eids, [ueid]);
    assert!(v2.smcd_v2.is_none());
    assert_eq!(msgs[3], msgs[0], "the second connection proposes the same");

    // Frame 6: Accept, first contact.
    let (a, r) = smcr(&msgs[1]);
    assert_eq!(
        (a.role, a.version, a.first_contact),
        (Role::Accept, 2, true)
    );
    assert_eq!(
        r.peer_id,
        PeerId([0xe4, 0x1b, 0x52, 0x54, 0x00, 0x77, 0x00, 0x02])
    );
    assert_eq!(r.gid, Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 2)));
    assert_eq!(r.mac, Mac([0x52, 0x54, 0x00, 0x77, 0x00, 0x02]));
    assert_eq!(
        (r.qpn, r.rmb_rkey, r.rmbe_idx, r.rmbe_alert_token),
        (0x11, 0x3e3, 1, 1)
    );
    assert_eq!((r.rmbe_size.bytes(), r.qp_mtu.bytes()), (65536, Some(1024)));
    assert_eq!(
        (r.rmb_vaddr, r.initial_psn),
        (0xff3d_233f_8436_0000, 0x3600a1)
    );
    let v2 = r.v2.as_ref().unwrap();
    assert_eq!(v2.eid, ueid);
    let fce = v2.fce.unwrap();
    assert!(fce.v2_direct);
    assert_eq!((fce.os_type, fce.release), (2, 1));
    assert_eq!(fce.hostname.to_string(), "A");
    assert_eq!(
        (
            fce.max_conns,
            fce.max_links,
            fce.feature_mask,
            fce.vendor_options
        ),
        (255, 2, 1, 0)
    );
    assert!(v2.gids.is_none());

    // Frame 8: Confirm, first contact, with the client's GID list.
    let (c, r) = smcr(&msgs[2]);
    assert_eq!((c.role, c.first_contact), (Role::Confirm, true));
    assert_eq!(
        (r.qpn, r.rmb_rkey, r.rmbe_alert_token, r.initial_psn),
        (0x11, 0x308, 1, 0x1abcb7)
    );
    assert_eq!(r.rmb_vaddr, 0xff45_718d_7f6e_0000);
    let v2 = r.v2.as_ref().unwrap();
    assert_eq!(v2.fce.unwrap().hostname.to_string(), "B");
    assert_eq!(
        v2.gids.as_deref(),
        Some(&[Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 3))][..])
    );

    // Frames 206/212: the reused link group — no first contact, new tokens, same QPs and PSNs.
    let (a2, r2) = smcr(&msgs[4]);
    assert!(!a2.first_contact);
    assert_eq!(a2.buffer_len(), SMCR_V2_LEN);
    assert_eq!(
        (r2.qpn, r2.rmbe_alert_token, r2.initial_psn),
        (0x11, 2, 0x3600a1)
    );
    assert!(r2.v2.as_ref().unwrap().fce.is_none());
    let (c2, r2) = smcr(&msgs[5]);
    assert!(!c2.first_contact && c2.role == Role::Confirm);
    assert_eq!((r2.rmbe_alert_token, r2.rmb_rkey), (2, 0x308));

    // Display is what smc-stat and logs print.
    assert_eq!(
        msgs[0].to_string(),
        "CLC Proposal v2 len=156 v1=none v2=R release=1 roce_gid=::ffff:10.77.0.3 max_conns=255 \
         max_links=2 features=0x0001 ueids=[SMC-KERNEL-PEER]"
    );
}
