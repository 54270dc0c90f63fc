//! Every LLC message of a real Linux 6.12 SMC-Rv2 session (testdata/README.md) parses into the
//! fields Linux sent and re-emits byte for byte.

#[path = "../../testdata/capture.rs"]
mod capture;

use clc::{Gid, Mac, QpMtu};
use llc::*;
use std::net::Ipv4Addr;

fn llc_messages() -> Vec<(usize, Vec<u8>)> {
    capture::read(capture::REFERENCE)
        .into_iter()
        .filter_map(|i| match i {
            capture::Item::Send { frame, payload, .. } if payload[0] != CDC_TYPE => {
                Some((frame, payload))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn test_every_llc_message_roundtrips() {
    let msgs = llc_messages();
    assert_eq!(
        msgs.len(),
        39,
        "2 CONFIRM_LINK, 2 ADD_LINK, 4 CONFIRM_RKEY, 17 DELETE_LINK, 8 DELETE_RKEY, 6 TEST_LINK"
    );
    let mut kinds = std::collections::BTreeMap::new();
    for (frame, bytes) in &msgs {
        let m = LlcMessage::parse(bytes).unwrap_or_else(|e| panic!("frame {frame}: {e}"));
        assert_eq!(m.version, Version::V2, "frame {frame}");
        assert_eq!(
            &m.to_vec(),
            bytes,
            "frame {frame} re-emits byte for byte: {m}"
        );
        *kinds.entry(m.llc_type().name()).or_insert(0) += 1;
    }
    let kinds: Vec<_> = kinds.into_iter().collect();
    assert_eq!(
        kinds,
        [
            ("ADD_LINK", 2),
            ("CONFIRM_LINK", 2),
            ("CONFIRM_RKEY", 4),
            ("DELETE_LINK", 17),
            ("DELETE_RKEY", 8),
            ("TEST_LINK", 6)
        ]
    );
}

#[test]
fn test_fields_of_the_kernel_session() {
    let msgs: std::collections::BTreeMap<usize, LlcMessage> = llc_messages()
        .iter()
        .map(|(f, b)| (*f, LlcMessage::parse(b).unwrap()))
        .collect();
    let a_gid = Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 2));
    let a_mac = Mac([0x52, 0x54, 0x00, 0x77, 0x00, 0x02]);

    let Llc::ConfirmLink(cl) = &msgs[&9].body else {
        panic!()
    };
    assert_eq!(
        *cl,
        ConfirmLink {
            response: false,
            no_rmbe_eyecatcher: 3,
            mac: a_mac,
            gid: a_gid,
            qpn: 0x11,
            link_id: 1,
            link_uid: [0, 0, 1, 1],
            max_links: 2,
            max_conns: 255,
        }
    );
    assert!(msgs[&11].is_response());

    // Frame 13: ADD LINK v2 with one rkey entry; frame 15: the client's reject (44 bytes).
    let Llc::AddLink(al) = &msgs[&13].body else {
        panic!()
    };
    assert_eq!(
        (al.qpn, al.link_id, al.mtu, al.initial_psn),
        (0x12, 2, QpMtu::MTU_1024, 0x86e686)
    );
    let x = al.v2.as_ref().unwrap();
    assert!(x.v2_direct);
    assert_eq!(x.target_gid, a_gid);
    assert_eq!(
        x.rkeys,
        [RkeyPair {
            rkey: 0x3e3,
            rkey_new: 0x5ca,
            vaddr_new: 0xff3d_233f_8436_0000
        }]
    );
    assert_eq!(msgs[&13].buffer_len(), 88);
    let Llc::AddLink(rej) = &msgs[&15].body else {
        panic!()
    };
    assert!(rej.response && rej.reject && rej.v2.is_none());
    assert_eq!(
        rej.reject_reason, 0,
        "v2 loses the reason nibble under the length"
    );

    let Llc::ConfirmRkey(ck) = &msgs[&202].body else {
        panic!()
    };
    assert_eq!(
        (ck.num_additional, ck.rtokens[0].rkey, ck.rtokens[0].vaddr),
        (0, 0x3e3, 0xff3d_233f_8436_0000)
    );
    let Llc::DeleteRkey(dk) = &msgs[&189].body else {
        panic!()
    };
    assert_eq!(
        (dk.response, dk.rkeys.as_slice(), dk.errors),
        (false, &[0x308][..], 0)
    );
    let Llc::DeleteRkey(dk) = &msgs[&192].body else {
        panic!()
    };
    assert_eq!(
        (dk.response, dk.rkeys.as_slice()),
        (true, &[0][..]),
        "response zeroes the keys"
    );
    let Llc::DeleteLink(dl) = &msgs[&536].body else {
        panic!()
    };
    assert_eq!(
        (dl.all, dl.orderly, dl.link_id, dl.reason),
        (true, true, 0, DeleteLinkReason::OP_INIT_TERM)
    );
    assert_eq!(
        msgs[&522].body,
        Llc::TestLink(TestLink {
            response: false,
            user_data: [0; 16]
        })
    );

    assert_eq!(
        msgs[&9].to_string(),
        "LLC CONFIRM_LINK_V2 REQ len=44 mac=52:54:00:77:00:02 gid=::ffff:10.77.0.2 qp=0x000011 \
         link=1 link_uid=00000101 max_links=2 max_conns=255"
    );
}
