//! Spec vectors (wire-spec §7.1, §7.7), one test per decode error, and property tests.

use super::*;
use proptest::prelude::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn confirm_link(version: Version) -> LlcMessage {
    LlcMessage {
        version,
        body: Llc::ConfirmLink(ConfirmLink {
            response: false,
            no_rmbe_eyecatcher: 3,
            mac: Mac([2, 0, 0, 0, 0, 2]),
            gid: Gid::from_ipv4(std::net::Ipv4Addr::new(10, 0, 0, 2)),
            qpn: 0x11,
            link_id: 1,
            link_uid: [0, 0, 1, 1],
            max_links: 2,
            max_conns: if version == Version::V2 { 255 } else { 0 },
        }),
    }
}

#[test]
fn test_confirm_link_vectors() {
    let v1 = hex(
        "012c0003 02000000 00020000 00000000 00000000 ffff0a00 00020000 11010000 01010200 00000000 00000000",
    );
    let v2 = hex(
        "212c0003 02000000 00020000 00000000 00000000 ffff0a00 00020000 11010000 010102ff 00000000 00000000",
    );
    for (bytes, version) in [(v1, Version::V1), (v2, Version::V2)] {
        let m = LlcMessage::parse(&bytes).unwrap();
        assert_eq!(m, confirm_link(version));
        assert_eq!(m.to_vec(), bytes);
    }
}

#[test]
fn test_header_constants() {
    // §7.1: ADD LINK reject (v1) and DELETE LINK "terminate, orderly, program initiated".
    let rej = LlcMessage {
        version: Version::V1,
        body: Llc::AddLink(AddLink {
            response: true,
            reject: true,
            reject_reason: 1,
            mac: Mac::default(),
            gid: Gid::default(),
            qpn: 0,
            link_id: 0,
            mtu: QpMtu::from_code(0),
            initial_psn: 0,
            v2: None,
        }),
    };
    assert_eq!(rej.to_vec()[..4], [0x02, 0x2c, 0x01, 0xc0]);
    let del = LlcMessage {
        version: Version::V1,
        body: Llc::DeleteLink(DeleteLink {
            response: false,
            all: true,
            orderly: true,
            link_id: 0,
            reason: DeleteLinkReason::PROG_INIT_TERM,
        }),
    };
    assert_eq!(del.to_vec()[..9], hex("042c0060 00000300 00"));
    assert_eq!(
        del.to_string(),
        "LLC DELETE_LINK REQ len=44 link=0 all=1 orderly=1 reason=PROG_INIT_TERM(0x00030000)"
    );
}

#[test]
fn test_v2_length_read_in_either_byte_order() {
    let mut be = confirm_link(Version::V2).to_vec();
    be[1] = 0x00;
    be[2] = 0x2c;
    assert_eq!(LlcMessage::parse(&be).unwrap(), confirm_link(Version::V2));
    // An ADD LINK whose rkey count was written big-endian still finds its one entry.
    let mut m = LlcMessage {
        version: Version::V2,
        body: Llc::AddLink(AddLink {
            response: false,
            reject: false,
            reject_reason: 0,
            mac: Mac::default(),
            gid: Gid::default(),
            qpn: 0x12,
            link_id: 2,
            mtu: QpMtu::MTU_1024,
            initial_psn: 5,
            v2: Some(AddLinkV2Ext {
                v2_direct: true,
                target_gid: Gid::default(),
                rkeys: vec![RkeyPair {
                    rkey: 1,
                    rkey_new: 2,
                    vaddr_new: 3,
                }],
            }),
        }),
    };
    let mut bytes = m.to_vec();
    bytes[70] = 0;
    bytes[71] = 1;
    assert_eq!(LlcMessage::parse(&bytes).unwrap(), m);
    // A v2 44-byte type received with extra bytes: Linux reads 44, so do we.
    m = confirm_link(Version::V2);
    let mut long = m.to_vec();
    long.extend_from_slice(&[0xaa; 20]);
    assert_eq!(LlcMessage::parse(&long).unwrap(), m);
}

#[test]
fn test_decode_errors() {
    let good = confirm_link(Version::V1).to_vec();
    let err = |b: &[u8]| LlcMessage::parse(b).unwrap_err();
    assert_eq!(err(&good[..43]), Error::TooShort { len: 43 });
    let mut cdc = good.clone();
    cdc[0] = 0xfe;
    assert_eq!(err(&cdc), Error::NotLlc);
    let mut b = good.clone();
    b[0] = 0x11;
    assert_eq!(err(&b), Error::UnknownVersion(1));
    for t in [0x00, 0x0a, 0x0f, 0x05, 0x23, 0x28, 0x20] {
        let mut b = good.clone();
        b[0] = t;
        if t >> 4 == 2 {
            b[1] = 44;
        }
        assert_eq!(err(&b), Error::UnknownType(t), "{t:#x}");
    }
    let mut b = good.clone();
    b[1] = 40;
    assert_eq!(
        err(&b),
        Error::BadV1Length {
            field: 40,
            actual: 44
        }
    );
    let mut b = good.clone();
    b.push(0);
    assert_eq!(
        err(&b),
        Error::BadV1Length {
            field: 44,
            actual: 45
        }
    );
    let mut b = confirm_link(Version::V2).to_vec();
    b[1] = 10;
    b[2] = 0;
    assert_eq!(err(&b), Error::BadV2Length([10, 0]));
    // ADD LINK v2 cut inside its extension.
    let mut b = confirm_link(Version::V2).to_vec();
    b[0] = 0x22;
    b.extend_from_slice(&[0; 10]);
    assert_eq!(
        err(&b),
        Error::Truncated {
            msg: "ADD_LINK v2 extension",
            need: 72,
            have: 54
        }
    );
    // ADD LINK v2 claiming 3 rkeys with room for 1.
    let mut b = vec![0u8; 88];
    b[..4].copy_from_slice(&[0x22, 88, 0, 0]);
    b[70] = 3;
    assert_eq!(
        err(&b),
        Error::CountTooLarge {
            msg: "ADD_LINK",
            what: "rkeys",
            count: 3,
            room: 1
        }
    );
    // REQUEST ADD LINK claiming 2 GIDs in 44 bytes.
    let mut b = vec![0u8; 44];
    b[..4].copy_from_slice(&[0x25, 44, 0, 0]);
    b[24] = 2;
    assert_eq!(
        err(&b),
        Error::CountTooLarge {
            msg: "REQ_ADD_LINK",
            what: "GIDs",
            count: 2,
            room: 1
        }
    );
    // DELETE RKEY v1 with 9 keys.
    let mut b = vec![0u8; 44];
    b[..4].copy_from_slice(&[0x09, 44, 0, 0]);
    b[4] = 9;
    assert_eq!(
        err(&b),
        Error::CountTooLarge {
            msg: "DELETE_RKEY",
            what: "rkeys",
            count: 9,
            room: 8
        }
    );
    assert_eq!(
        Error::NotLlc.to_string(),
        "not LLC: first byte 0xfe marks a CDC message"
    );
}

fn arb_gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn arb_pair() -> impl Strategy<Value = RkeyPair> {
    any::<(u32, u32, u64)>().prop_map(|(rkey, rkey_new, vaddr_new)| RkeyPair {
        rkey,
        rkey_new,
        vaddr_new,
    })
}

fn arb_rtoken() -> impl Strategy<Value = Rtoken> {
    any::<(u8, u32, u64)>().prop_map(|(link_id, rkey, vaddr)| Rtoken {
        link_id,
        rkey,
        vaddr,
    })
}

fn arb_message() -> impl Strategy<Value = LlcMessage> {
    let v1 = prop_oneof![
        (
            any::<(bool, u8, [u8; 6], u8, u32, u8, [u8; 4], u8, u8)>(),
            arb_gid()
        )
            .prop_map(
                |((response, fl, mac, _, qpn, link_id, link_uid, max_links, max_conns), gid)| {
                    Llc::ConfirmLink(ConfirmLink {
                        response,
                        no_rmbe_eyecatcher: fl & 3,
                        mac: Mac(mac),
                        gid,
                        qpn: qpn & 0xff_ffff,
                        link_id,
                        link_uid,
                        max_links,
                        max_conns,
                    })
                }
            ),
        (
            any::<(bool, u8, u8, [u8; 6], u32, u8, u8, u32)>(),
            arb_gid()
        )
            .prop_map(
                |((response, flags, reason, mac, qpn, link_id, mtu, psn), gid)| Llc::AddLink(
                    AddLink {
                        response,
                        reject: flags & 1 != 0,
                        reject_reason: reason & 15,
                        mac: Mac(mac),
                        gid,
                        qpn: qpn & 0xff_ffff,
                        link_id,
                        mtu: QpMtu::from_code(mtu),
                        initial_psn: psn & 0xff_ffff,
                        v2: None,
                    }
                )
            ),
        (any::<(bool, u8, u8, bool, u32)>()).prop_map(|(response, link_id, _, all, reason)| {
            Llc::DeleteLink(DeleteLink {
                response,
                all,
                orderly: !all,
                link_id,
                reason: DeleteLinkReason(reason),
            })
        }),
        (
            any::<(bool, bool, bool, u8)>(),
            arb_rtoken(),
            arb_rtoken(),
            arb_rtoken()
        )
            .prop_map(
                |((response, negative, retry, n), a, b, c)| Llc::ConfirmRkey(ConfirmRkey {
                    response,
                    negative,
                    retry,
                    num_additional: n,
                    rtokens: [Rtoken { link_id: 0, ..a }, b, c],
                })
            ),
        (
            any::<(bool, bool, u8)>(),
            prop::collection::vec(any::<u32>(), 0..=8)
        )
            .prop_map(|((response, negative, errors), rkeys)| Llc::DeleteRkey(
                DeleteRkey {
                    response,
                    negative,
                    errors,
                    rkeys
                }
            )),
        (any::<(bool, [u8; 16])>()).prop_map(|(response, user_data)| Llc::TestLink(TestLink {
            response,
            user_data
        })),
    ];
    let v1_only = prop_oneof![
        (any::<(bool, u8, u8)>(), arb_pair(), arb_pair()).prop_map(
            |((response, link_id, num_rkeys), a, b)| Llc::AddLinkCont(AddLinkCont {
                response,
                link_id,
                num_rkeys,
                rkeys: [a, b]
            })
        ),
        (
            any::<(bool, bool, u8)>(),
            arb_rtoken(),
            arb_rtoken(),
            arb_rtoken()
        )
            .prop_map(|((response, negative, n), a, b, c)| Llc::ConfirmRkeyCont(
                ConfirmRkeyCont {
                    response,
                    negative,
                    num_rtokens: n,
                    rtokens: [Rtoken { link_id: 0, ..a }, b, c],
                }
            )),
    ];
    let v2_only = prop_oneof![
        (
            any::<(bool, bool)>(),
            prop::collection::vec(arb_gid(), 0..6)
        )
            .prop_map(
                |((response, reject), gids)| Llc::RequestAddLink(RequestAddLink {
                    response,
                    reject,
                    gids
                })
            ),
        (
            any::<(bool, [u8; 6], u32, u8, u8, u32, bool)>(),
            arb_gid(),
            arb_gid(),
            prop::collection::vec(arb_pair(), 0..6)
        )
            .prop_map(
                |((response, mac, qpn, link_id, mtu, psn, direct), gid, tgid, rkeys)| Llc::AddLink(
                    AddLink {
                        response,
                        reject: false,
                        reject_reason: 0,
                        mac: Mac(mac),
                        gid,
                        qpn: qpn & 0xff_ffff,
                        link_id,
                        mtu: QpMtu::from_code(mtu),
                        initial_psn: psn & 0xff_ffff,
                        v2: Some(AddLinkV2Ext {
                            v2_direct: direct,
                            target_gid: tgid,
                            rkeys
                        }),
                    }
                )
            ),
        (
            any::<(bool, bool, u8)>(),
            prop::collection::vec(any::<u32>(), 0..40)
        )
            .prop_map(|((response, negative, errors), rkeys)| Llc::DeleteRkey(
                DeleteRkey {
                    response,
                    negative,
                    errors,
                    rkeys
                }
            )),
    ];
    prop_oneof![
        v1.clone().prop_map(|body| {
            // v2 ADD LINK keeps no reject reason.
            LlcMessage {
                version: Version::V1,
                body,
            }
        }),
        v1_only.prop_map(|body| LlcMessage {
            version: Version::V1,
            body
        }),
        v1.prop_map(|mut body| {
            if let Llc::AddLink(a) = &mut body {
                a.reject_reason = 0;
            }
            LlcMessage {
                version: Version::V2,
                body,
            }
        }),
        v2_only.prop_map(|body| LlcMessage {
            version: Version::V2,
            body
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn prop_parse_emit_roundtrip(m in arb_message()) {
        let bytes = m.to_vec();
        prop_assert_eq!(bytes.len(), m.buffer_len());
        prop_assert_eq!(LlcMessage::parse(&bytes), Ok(m.clone()), "{}", m);
    }

    #[test]
    fn prop_parse_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(m) = LlcMessage::parse(&bytes) {
            let _ = m.to_string();
            prop_assert_eq!(LlcMessage::parse(&m.to_vec()), Ok(m));
        }
    }

    #[test]
    fn prop_plausible_headers_never_panic(t in prop::sample::select(vec![1u8, 2, 3, 4, 5, 6, 7, 8, 9, 0x21, 0x22, 0x24, 0x25, 0x26, 0x27, 0x29]), mut body in prop::collection::vec(any::<u8>(), 44..300)) {
        body[0] = t;
        if t < 0x20 { body[1] = 44; body.truncate(44); }
        if let Ok(m) = LlcMessage::parse(&body) {
            prop_assert_eq!(LlcMessage::parse(&m.to_vec()), Ok(m));
        }
    }
}
