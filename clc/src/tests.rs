//! Spec test vectors (wire-spec §7), one test per decode error, and property tests.

use super::*;
use proptest::prelude::*;
use std::net::{Ipv4Addr, Ipv6Addr};

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const CLIENT_ID: PeerId = PeerId([0x12, 0x34, 0x02, 0, 0, 0, 0, 0x01]);
const SERVER_ID: PeerId = PeerId([0x56, 0x78, 0x02, 0, 0, 0, 0, 0x02]);

fn gid(last: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, last))
}

fn roundtrip(bytes: &[u8]) -> Message {
    let m = Message::parse(bytes).unwrap();
    assert_eq!(m.to_vec(), bytes, "{m}");
    m
}

/// §7.2: v1 SMC-R only, IPv4 /24, Linux style.
#[test]
fn test_proposal_v1_vector() {
    let bytes = hex(
        "e2d4c3d9 01005c28 12340200 00000001 00000000 00000000 0000ffff 0a000001
         02000000 00010028 00000000 00000000 00000000 00000000 00000000 00000000
         00000000 00000000 00000000 00000000 0a000000 18000000 e2d4c3d9",
    );
    let expected = Message::Proposal(Proposal {
        eyecatcher: Eyecatcher::SmcR,
        version: 2,
        typev1: SmcType::R,
        typev2: SmcType::None,
        peer_id: CLIENT_ID,
        gid: gid(1),
        mac: Mac([2, 0, 0, 0, 0, 1]),
        smcd: Some(SmcdInfo::default()),
        prefix: Some(IpPrefixArea {
            ipv4_subnet: Ipv4Addr::new(10, 0, 0, 0),
            ipv4_prefix_len: 24,
            ipv6: vec![],
        }),
        v2: None,
    });
    assert_eq!(roundtrip(&bytes), expected);
    assert_eq!(bytes.len(), 92);
}

/// §7.3: v2 SMC-R only, one UEID.
#[test]
fn test_proposal_v2_vector() {
    let bytes = hex(
        "e2d4c3d9 01009c22 00000000 00000000 00000000 00000000 00000000 00000000
         00000000 00000000 00000000 00000000 0000001c 00000000 00000000 00000000
         00000000 00000000 00000000 00000000 01000010 00000000 00000000 00000000
         0000ffff 0a000001 ff020001 00000000 00000000 00000000 534d4352 2d494e54
         45524f50 2d544553 54202020 20202020 20202020 20202020 e2d4c3d9",
    );
    let Message::Proposal(p) = roundtrip(&bytes) else {
        panic!()
    };
    let v2 = p.v2.unwrap();
    assert_eq!(v2.eids, [Eid::new("SMCR-INTEROP-TEST").unwrap()]);
    assert_eq!(
        (v2.release, v2.max_conns, v2.max_links, v2.feature_mask),
        (1, 255, 2, 1)
    );
    assert_eq!(v2.roce_gid, gid(1));
}

fn accept_v1() -> SmcrAcceptConfirm {
    SmcrAcceptConfirm {
        peer_id: SERVER_ID,
        gid: gid(2),
        mac: Mac([2, 0, 0, 0, 0, 2]),
        qpn: 0x11,
        rmb_rkey: 0x1234,
        rmbe_idx: 1,
        rmbe_alert_token: 1,
        rmbe_size: RmbSize::from_code(2),
        qp_mtu: QpMtu::MTU_1024,
        rmb_vaddr: 0x1_0000_0000,
        initial_psn: 0xabcdef,
        v2: None,
    }
}

/// §7.4: v1 Accept and Confirm, first contact.
#[test]
fn test_accept_confirm_v1_vectors() {
    let accept = hex(
        "e2d4c3d9 02004418 56780200 00000002 00000000 00000000 0000ffff 0a000002
         02000000 00020000 11000012 34010000 00012300 00000001 00000000 00abcdef e2d4c3d9",
    );
    let m = roundtrip(&accept);
    assert_eq!(
        m,
        Message::AcceptConfirm(AcceptConfirm {
            role: Role::Accept,
            eyecatcher: Eyecatcher::SmcR,
            version: 1,
            first_contact: true,
            body: AcceptBody::SmcR(accept_v1()),
        })
    );
    let confirm = hex(
        "e2d4c3d9 03004418 12340200 00000001 00000000 00000000 0000ffff 0a000001
         02000000 00010000 12000056 78010000 00022300 00000002 00000000 00123456 e2d4c3d9",
    );
    let (_, r) = match roundtrip(&confirm) {
        Message::AcceptConfirm(a) => (a.role, a.smcr().unwrap().clone()),
        m => panic!("{m}"),
    };
    assert_eq!(
        (r.qpn, r.rmb_rkey, r.rmbe_alert_token, r.initial_psn),
        (0x12, 0x5678, 2, 0x123456)
    );
}

/// §7.5: v2 Accept (160 bytes) and Confirm with one GID (180 bytes), first contact.
#[test]
fn test_accept_confirm_v2_vectors() {
    let accept = hex(
        "e2d4c3d9 0200a028 56780200 00000002 00000000 00000000 0000ffff 0a000002
         02000000 00020000 11000012 34010000 00012300 00000001 00000000 00abcdef
         534d4352 2d494e54 45524f50 2d544553 54202020 20202020 20202020 20202020
         00000000 00000000 80210000 686f7374 62202020 20202020 20202020 20202020
         20202020 20202020 20202020 ff020001 00000000 00000000 00000000 e2d4c3d9",
    );
    let Message::AcceptConfirm(a) = roundtrip(&accept) else {
        panic!()
    };
    let r = a.smcr().unwrap();
    let fce = r.v2.as_ref().unwrap().fce.unwrap();
    assert_eq!(fce.hostname.to_string(), "hostb");
    assert!(fce.v2_direct);
    let confirm = hex(
        "e2d4c3d9 0300b428 12340200 00000001 00000000 00000000 0000ffff 0a000001
         02000000 00010000 12000056 78010000 00022300 00000002 00000000 00123456
         534d4352 2d494e54 45524f50 2d544553 54202020 20202020 20202020 20202020
         00000000 00000000 80210000 686f7374 61202020 20202020 20202020 20202020
         20202020 20202020 20202020 ff020001 00000000 00000000 00000000 01000000
         00000000 00000000 0000ffff 0a000001 e2d4c3d9",
    );
    let Message::AcceptConfirm(c) = roundtrip(&confirm) else {
        panic!()
    };
    assert_eq!(
        c.smcr().unwrap().v2.as_ref().unwrap().gids.as_deref(),
        Some(&[gid(1)][..])
    );
}

/// §7.6: Decline NOSMCRDEV, v1 and v2.
#[test]
fn test_decline_vectors() {
    let v1 = hex("e2d4c3d9 04001c10 56780200 00000002 03030002 00000000 e2d4c3d9");
    assert_eq!(
        roundtrip(&v1),
        Message::Decline(Decline::linux(1, SERVER_ID, DeclineReason::NOSMCRDEV))
    );
    let v2 = hex(
        "e2d4c3d9 04002c20 56780200 00000002 03030002 20000000 00000000 00000000
         00000000 00000000 e2d4c3d9",
    );
    let m = roundtrip(&v2);
    assert_eq!(
        m,
        Message::Decline(Decline::linux(2, SERVER_ID, DeclineReason::NOSMCRDEV))
    );
    assert_eq!(
        m.to_string(),
        "CLC Decline v2 len=44 reason=0x03030002 NOSMCRDEV (no SMC-R device found) peer_id=5678020000000002"
    );
    // SYNCERR carries the out-of-sync flag.
    let d = Decline::linux(2, SERVER_ID, DeclineReason::SYNCERR);
    assert_eq!(Message::Decline(d).to_vec()[7], 0x28);
    // Linux never checks a Decline's trailer.
    let mut odd = v1.clone();
    odd[24..].copy_from_slice(b"JUNK");
    assert!(Message::parse(&odd).is_ok());
}

/// One test per decode error.
#[test]
fn test_decode_errors() {
    let decl = hex("e2d4c3d9 04001c10 56780200 00000002 03030002 00000000 e2d4c3d9");
    let err = |b: &[u8]| Message::parse(b).unwrap_err();
    assert_eq!(err(&decl[..7]), Error::TooShort { len: 7 });
    let mut b = decl.clone();
    b[0] = 0;
    assert_eq!(err(&b), Error::BadEyecatcher([0, 0xd4, 0xc3, 0xd9]));
    let mut b = decl.clone();
    b[4] = 9;
    assert_eq!(err(&b), Error::UnknownType(9));
    let mut b = decl.clone();
    b[7] = 0x00;
    assert_eq!(err(&b), Error::BadVersion(0));
    assert_eq!(
        err(&decl[..20]),
        Error::LengthMismatch {
            field: 28,
            actual: 20
        }
    );
    let mut b = decl.clone();
    b[6] = 11;
    assert_eq!(
        err(&b[..11]),
        Error::LengthMismatch {
            field: 11,
            actual: 11
        }
    );
    // A 32-byte Decline.
    let mut b = decl.clone();
    b.splice(24..24, [0; 4]);
    b[6] = 32;
    assert_eq!(
        err(&b),
        Error::BadLength {
            msg: MsgType::Decline,
            expected: 28,
            found: 32
        }
    );

    let accept = Message::AcceptConfirm(AcceptConfirm {
        role: Role::Accept,
        eyecatcher: Eyecatcher::SmcR,
        version: 1,
        first_contact: false,
        body: AcceptBody::SmcR(accept_v1()),
    })
    .to_vec();
    let mut b = accept.clone();
    b[64] = 0;
    assert_eq!(err(&b), Error::BadTrailer([0, 0xd4, 0xc3, 0xd9]));
    let mut b = accept.clone();
    b[7] = 0x12;
    assert_eq!(
        err(&b),
        Error::BadChosenType {
            msg: MsgType::Accept,
            typev1: 2
        }
    );
    let mut b = accept.clone();
    b.splice(64..64, [0; 4]);
    b[6] = 72;
    assert_eq!(
        err(&b),
        Error::BadLength {
            msg: MsgType::Accept,
            expected: 68,
            found: 72
        }
    );
    // v2 first contact without room for the first-contact extension.
    let mut b = accept.clone();
    b.splice(64..64, [0x20; 40]);
    b[6] = 108;
    b[7] = 0x28;
    assert_eq!(
        err(&b),
        Error::BadLength {
            msg: MsgType::Accept,
            expected: 160,
            found: 108
        }
    );
    // A GID list claiming more GIDs than present.
    let mut b = accept.clone();
    b.splice(64..64, [0x20; 40 + 52 + 4]);
    b[6] = 164;
    b[7] = 0x28;
    b[156] = 3;
    assert_eq!(
        err(&b),
        Error::BadLength {
            msg: MsgType::Accept,
            expected: 212,
            found: 164
        }
    );

    let prop = |p: &Proposal| Message::Proposal(p.clone()).to_vec();
    let base = Proposal {
        eyecatcher: Eyecatcher::SmcR,
        version: 2,
        typev1: SmcType::R,
        typev2: SmcType::R,
        peer_id: CLIENT_ID,
        gid: gid(1),
        mac: Mac::default(),
        smcd: Some(SmcdInfo::default()),
        prefix: Some(IpPrefixArea {
            ipv4_subnet: Ipv4Addr::UNSPECIFIED,
            ipv4_prefix_len: 0,
            ipv6: vec![],
        }),
        v2: Some(V2Extension {
            release: 1,
            seid: false,
            roce_gid: gid(1),
            max_conns: 255,
            max_links: 2,
            feature_mask: 1,
            eids: vec![Eid::new("A").unwrap()],
            smcd_v2: None,
        }),
    };
    let good = prop(&base);
    assert_eq!(
        Message::parse(&good).unwrap(),
        Message::Proposal(base.clone())
    );
    let mut b = good.clone();
    b[7] = 0x1a; // version 1, typev1 none
    assert_eq!(err(&b), Error::NothingOffered);
    let mut b = good.clone();
    b[39] = 20;
    assert_eq!(err(&b), Error::BadIpAreaOffset(20));
    let mut b = good.clone();
    b[39] = 0; // RFC-style layout, but v2 is offered
    assert_eq!(err(&b), Error::MissingSmcdArea);
    let mut b = good.clone();
    b[51] = 29;
    assert_eq!(
        err(&b),
        Error::BadV2ExtOffset {
            expected: 36,
            found: 29
        }
    );
    let mut b = good.clone();
    b[87] = 9;
    assert_eq!(err(&b), Error::TooManyIpv6Prefixes(9));
    let mut b = good.clone();
    b[88] = 9;
    assert_eq!(err(&b), Error::TooManyEids(9));
    let mut b = good.clone();
    b[88] = 2; // two EIDs claimed, one present
    assert_eq!(
        err(&b),
        Error::Truncated {
            what: "user EID",
            need: 196,
            have: 164
        }
    );
    let mut d = base.clone();
    d.typev2 = SmcType::Both;
    d.v2.as_mut().unwrap().smcd_v2 = Some(SmcdV2Extension {
        system_eid: Eid::new("S").unwrap(),
        gid_chids: vec![(7, 8)],
    });
    let good_d = prop(&d);
    assert_eq!(
        Message::parse(&good_d).unwrap(),
        Message::Proposal(d.clone())
    );
    let mut b = good_d.clone();
    b[88 + 7] = 0;
    assert_eq!(
        err(&b),
        Error::BadSmcdV2ExtOffset {
            expected: 64,
            found: 0
        }
    );
    let mut b = good_d.clone();
    b[89] = 9;
    assert_eq!(err(&b), Error::TooManyIsmGids(9));
    // Wrong total length for the contents.
    let mut b = good.clone();
    b.splice(b.len() - 4..b.len() - 4, [0; 4]);
    let n = b.len() as u16;
    b[5..7].copy_from_slice(&n.to_be_bytes());
    assert_eq!(
        err(&b),
        Error::BadLength {
            msg: MsgType::Proposal,
            expected: 164,
            found: 168
        }
    );
    // Every error has a readable message.
    assert_eq!(
        Error::TooManyEids(9).to_string(),
        "CLC Proposal lists 9 user EIDs (at most 8)"
    );
}

#[test]
fn test_v2_offered_without_extension_parses() {
    // Linux's server answers this with NOV2EXT; it is not a framing error.
    let p = Proposal {
        eyecatcher: Eyecatcher::SmcR,
        version: 2,
        typev1: SmcType::R,
        typev2: SmcType::R,
        peer_id: CLIENT_ID,
        gid: gid(1),
        mac: Mac::default(),
        smcd: Some(SmcdInfo::default()),
        prefix: Some(IpPrefixArea {
            ipv4_subnet: Ipv4Addr::new(10, 0, 0, 0),
            ipv4_prefix_len: 8,
            ipv6: vec![],
        }),
        v2: None,
    };
    let bytes = Message::Proposal(p.clone()).to_vec();
    assert_eq!(Message::parse(&bytes).unwrap(), Message::Proposal(p));
}

#[test]
fn test_message_len_frames_a_stream() {
    let d = Message::Decline(Decline::linux(2, SERVER_ID, DeclineReason::MEM)).to_vec();
    let mut stream = d.clone();
    stream.extend_from_slice(b"application bytes after a decline");
    assert_eq!(message_len(&stream), Ok(44));
    assert_eq!(
        Message::parse(&stream[..44]).unwrap().msg_type(),
        MsgType::Decline
    );
    assert_eq!(
        message_len(b"GET / HTTP/1.1\r\n"),
        Err(Error::BadEyecatcher(*b"GET "))
    );
}

fn arb_eid() -> impl Strategy<Value = Eid> {
    any::<[u8; 32]>().prop_map(Eid)
}

fn arb_gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn arb_smctype() -> impl Strategy<Value = SmcType> {
    (0u8..4).prop_map(SmcType::from_bits)
}

prop_compose! {
    fn arb_proposal()(
        ec in prop::bool::ANY,
        version in 1u8..16,
        typev1 in arb_smctype(),
        typev2 in arb_smctype(),
        peer in any::<[u8; 8]>(),
        g in arb_gid(),
        mac in any::<[u8; 6]>(),
        smcd_fields in any::<(u64, u16, [u8; 3], [u8; 5])>(),
        rfc_style in prop::bool::ANY,
        v4 in any::<[u8; 4]>(),
        v4len in any::<u8>(),
        v6 in prop::collection::vec((any::<[u8; 16]>(), any::<u8>()), 0..=8),
        has_v2 in prop::bool::ANY,
        release in 0u8..16,
        seid in prop::bool::ANY,
        roce in arb_gid(),
        mc in any::<(u8, u8, u16)>(),
        eids in prop::collection::vec(arb_eid(), 0..=8),
        seid_eid in arb_eid(),
        gidchids in prop::collection::vec(any::<(u64, u16)>(), 0..=8),
    ) -> Proposal {
        let typev1 = if version == 1 && typev1 == SmcType::None { SmcType::R } else { typev1 };
        let v2_offered = version >= 2 && typev2 != SmcType::None;
        // RFC 7609 layout (no SMC-D/v2 area) only for v1-only proposals.
        let smcd = (!(rfc_style && !v2_offered && typev1 != SmcType::None)).then_some(SmcdInfo {
            ism_gid: smcd_fields.0,
            ism_chid: smcd_fields.1,
            vendor_oui: smcd_fields.2,
            vendor_options: smcd_fields.3,
        });
        let prefix = (typev1 != SmcType::None).then(|| IpPrefixArea {
            ipv4_subnet: Ipv4Addr::from(v4),
            ipv4_prefix_len: v4len,
            ipv6: v6.iter().map(|(a, l)| (Ipv6Addr::from(*a), *l)).collect(),
        });
        let v2 = (v2_offered && has_v2).then(|| V2Extension {
            release,
            seid,
            roce_gid: roce,
            max_conns: mc.0,
            max_links: mc.1,
            feature_mask: mc.2,
            eids: eids.clone(),
            smcd_v2: typev2.has_d().then(|| SmcdV2Extension {
                system_eid: seid_eid,
                gid_chids: gidchids.clone(),
            }),
        });
        Proposal {
            eyecatcher: if ec { Eyecatcher::SmcR } else { Eyecatcher::SmcD },
            version,
            typev1,
            typev2,
            peer_id: PeerId(peer),
            gid: g,
            mac: Mac(mac),
            smcd,
            prefix,
            v2,
        }
    }
}

prop_compose! {
    fn arb_accept()(
        confirm in prop::bool::ANY,
        version in 1u8..16,
        fc in prop::bool::ANY,
        smcd in prop::bool::ANY,
        raw in prop::collection::vec(any::<u8>(), 70..120),
        ids in any::<([u8; 8], [u8; 16], [u8; 6])>(),
        nums in any::<(u32, u32, u8, u32, u8, u8, u64, u32)>(),
        eid in arb_eid(),
        fce in any::<(bool, u8, u8, [u8; 32], u8, u8, u16, u32)>(),
        gids in prop::option::of(prop::collection::vec(arb_gid(), 0..4)),
    ) -> AcceptConfirm {
        let body = if smcd {
            let n = if version >= 2 { raw.len() } else { SMCD_V1_LEN - 12 };
            AcceptBody::SmcD(raw[..n].to_vec())
        } else {
            AcceptBody::SmcR(SmcrAcceptConfirm {
                peer_id: PeerId(ids.0),
                gid: Gid(ids.1),
                mac: Mac(ids.2),
                qpn: nums.0 & 0xff_ffff,
                rmb_rkey: nums.1,
                rmbe_idx: nums.2,
                rmbe_alert_token: nums.3,
                rmbe_size: RmbSize::from_code(nums.4),
                qp_mtu: QpMtu::from_code(nums.5),
                rmb_vaddr: nums.6,
                initial_psn: nums.7 & 0xff_ffff,
                v2: (version >= 2).then(|| SmcrV2 {
                    eid,
                    fce: fc.then_some(FirstContactExt {
                        v2_direct: fce.0,
                        os_type: fce.1 & 15,
                        release: fce.2 & 15,
                        hostname: Hostname(fce.3),
                        max_conns: fce.4,
                        max_links: fce.5,
                        feature_mask: fce.6,
                        vendor_options: fce.7,
                    }),
                    gids: if fc { gids.clone() } else { None },
                }),
            })
        };
        AcceptConfirm {
            role: if confirm { Role::Confirm } else { Role::Accept },
            eyecatcher: Eyecatcher::SmcR,
            version,
            first_contact: fc,
            body,
        }
    }
}

prop_compose! {
    fn arb_decline()(
        ec in prop::bool::ANY,
        version in 1u8..16,
        oos in prop::bool::ANY,
        peer in any::<[u8; 8]>(),
        reason in any::<u32>(),
        os in 0u8..16,
        diag in prop::option::of(any::<[u32; 4]>()),
    ) -> Decline {
        Decline {
            eyecatcher: if ec { Eyecatcher::SmcR } else { Eyecatcher::SmcD },
            version,
            out_of_sync: oos,
            peer_id: PeerId(peer),
            reason: DeclineReason(reason),
            os_type: os,
            diag_v2: diag,
        }
    }
}

fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        arb_proposal().prop_map(Message::Proposal),
        arb_accept().prop_map(Message::AcceptConfirm),
        arb_decline().prop_map(Message::Decline),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn prop_parse_emit_roundtrip(m in arb_message()) {
        let bytes = m.to_vec();
        prop_assert_eq!(bytes.len(), m.buffer_len());
        prop_assert_eq!(message_len(&bytes), Ok(bytes.len()));
        let back = Message::parse(&bytes);
        prop_assert_eq!(back, Ok(m.clone()), "{}", m);
    }

    #[test]
    fn prop_parse_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(m) = Message::parse(&bytes) {
            let _ = m.to_string();
            let again = Message::parse(&m.to_vec());
            prop_assert_eq!(again, Ok(m));
        }
    }

    #[test]
    fn prop_mutated_messages_never_panic(m in arb_message(), idx in any::<prop::sample::Index>(), val in any::<u8>()) {
        let mut bytes = m.to_vec();
        let i = idx.index(bytes.len());
        bytes[i] = val;
        if let Ok(m) = Message::parse(&bytes) {
            prop_assert_eq!(Message::parse(&m.to_vec()), Ok(m));
        }
    }
}
