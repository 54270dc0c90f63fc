//! Spec vectors, decode errors, cursor laws.

use super::*;
use proptest::prelude::*;

/// wire-spec §7.8: seq 1, token 1, producer (0, 4096).
#[test]
fn test_spec_vector() {
    let mut bytes = vec![0xfe, 0x2c, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0x10, 0];
    bytes.resize(44, 0);
    let m = CdcMessage::parse(&bytes).unwrap();
    assert_eq!(
        m,
        CdcMessage {
            seq: 1,
            token: 1,
            prod: Cursor::new(0, 4096),
            ..Default::default()
        }
    );
    assert_eq!(m.to_bytes().as_slice(), bytes.as_slice());
    assert_eq!(
        m.to_string(),
        "CDC seq=1 token=0x1 prod=0:4096 cons=0:0 flags=- state=-"
    );
}

#[test]
fn test_decode_errors() {
    let good = CdcMessage::default().to_bytes();
    assert_eq!(CdcMessage::parse(&[]), Err(Error::TooShort { len: 0 }));
    assert_eq!(
        CdcMessage::parse(&good[..25]),
        Err(Error::TooShort { len: 25 })
    );
    assert!(
        CdcMessage::parse(&good[..26]).is_ok(),
        "Linux reads 26 bytes"
    );
    let mut b = good;
    b[0] = 0x21;
    assert_eq!(CdcMessage::parse(&b), Err(Error::NotCdc(0x21)));
    let mut b = good;
    b[1] = 43;
    assert_eq!(CdcMessage::parse(&b), Err(Error::BadLength(43)));
    assert_eq!(
        Error::BadLength(43).to_string(),
        "CDC length byte is 43, must be 44"
    );
}

#[test]
fn test_flags_and_display() {
    let m = CdcMessage {
        seq: 2,
        token: 2,
        prod: Cursor::new(1, 0),
        prod_flags: ProducerFlags::WRITE_BLOCKED | ProducerFlags::from_bits_retain(0x01),
        conn_flags: ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED,
        ..Default::default()
    };
    let b = m.to_bytes();
    assert_eq!(b[24..26], [0x81, 0xc0]);
    assert_eq!(
        CdcMessage::parse(&b).unwrap(),
        m,
        "reserved flag bits survive"
    );
    assert_eq!(
        m.to_string(),
        "CDC seq=2 token=0x2 prod=1:0 cons=0:0 flags=WRITE_BLOCKED|0x1 state=PEER_DONE_WRITING|PEER_CONN_CLOSED"
    );
}

#[test]
fn test_cursor_examples() {
    let size = 65536;
    let c = Cursor::new(0, 65000);
    assert_eq!(
        c.advance(536, size),
        Cursor::new(1, 0),
        "ending exactly at the end wraps"
    );
    assert_eq!(c.advance(1000, size), Cursor::new(1, 464));
    assert_eq!(
        Cursor::new(u16::MAX, 10).advance(size, size),
        Cursor::new(0, 10)
    );
    assert_eq!(
        Cursor::diff(size, Cursor::new(0, 100), Cursor::new(0, 300)),
        200
    );
    assert_eq!(
        Cursor::diff(size, Cursor::new(0, 65000), Cursor::new(1, 464)),
        1000
    );
    assert_eq!(
        Cursor::diff(size, Cursor::new(0, 300), Cursor::new(0, 100)),
        0,
        "never negative"
    );
    assert_eq!(
        Cursor::diff(size, Cursor::new(0, 5), Cursor::new(1, 5)),
        size,
        "full ring"
    );
    assert_eq!(
        Cursor::comp(size, Cursor::new(0, 300), Cursor::new(0, 100)),
        -200
    );
    assert!(Cursor::moved_backwards(
        Cursor::new(3, 10),
        Cursor::new(3, 9)
    ));
    assert!(Cursor::moved_backwards(
        Cursor::new(3, 10),
        Cursor::new(2, 60000)
    ));
    assert!(
        !Cursor::moved_backwards(Cursor::new(u16::MAX, 60000), Cursor::new(0, 5)),
        "wrap counter went round"
    );
    assert!(seq_before(u16::MAX, 0));
    assert!(!seq_before(5, 5));
    assert!(seq_before(1, 2) && !seq_before(2, 1));
}

/// The kernel capture's frame 281: writing blocked and a wrapped producer cursor.
#[test]
fn test_kernel_frame_281() {
    let mut b = vec![
        0xfe, 0x2c, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0,
    ];
    b.resize(44, 0);
    let m = CdcMessage::parse(&b).unwrap();
    assert_eq!(
        (m.seq, m.token, m.prod, m.prod_flags),
        (2, 2, Cursor::new(1, 0), ProducerFlags::WRITE_BLOCKED)
    );
    assert_eq!(m.to_bytes().as_slice(), b.as_slice());
}

fn arb_size() -> impl Strategy<Value = u32> {
    prop_oneof![(0u8..16).prop_map(|c| 16384u32 << c), 1u32..100_000]
}

fn arb_cursor_in(size: u32) -> impl Strategy<Value = Cursor> {
    (any::<u16>(), 0..size).prop_map(|(w, c)| Cursor::new(w, c))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn prop_roundtrip(seq in any::<u16>(), token in any::<u32>(), pw in any::<u16>(), pc in any::<u32>(), cw in any::<u16>(), cc in any::<u32>(), pf in any::<u8>(), sf in any::<u8>()) {
        let m = CdcMessage {
            seq,
            token,
            prod: Cursor::new(pw, pc),
            cons: Cursor::new(cw, cc),
            prod_flags: ProducerFlags::from_bits_retain(pf),
            conn_flags: ConnStateFlags::from_bits_retain(sf),
        };
        prop_assert_eq!(CdcMessage::parse(&m.to_bytes()), Ok(m));
    }

    #[test]
    fn prop_parse_never_panics(mut bytes in prop::collection::vec(any::<u8>(), 0..64), framed in any::<bool>()) {
        // Half the cases get a valid type and length byte so the decoder's body is reached.
        if framed && bytes.len() >= 2 {
            bytes[0] = CDC_TYPE;
            bytes[1] = CDC_LEN as u8;
        }
        if let Ok(m) = CdcMessage::parse(&bytes) {
            let _ = m.to_string();
            prop_assert_eq!(CdcMessage::parse(&m.to_bytes()), Ok(m));
        }
    }

    /// advance then diff gives back n, across wrap, for any n up to the ring size.
    #[test]
    fn prop_advance_diff((size, c) in arb_size().prop_flat_map(|s| (Just(s), arb_cursor_in(s))), frac in 0.0f64..=1.0) {
        let n = ((f64::from(size)) * frac) as u32;
        let next = c.advance(n, size);
        prop_assert!(next.count < size);
        prop_assert_eq!(Cursor::diff(size, c, next), n);
        // Linux's smc_curs_comp compares wraps without wrapping: across the 16-bit wrap
        // (65535 → 0) it reads "behind", and so does ours.
        if !(c.wrap == u16::MAX && next.wrap == 0) {
            prop_assert_eq!(Cursor::comp(size, c, next), i64::from(n));
        }
        if n < size {
            prop_assert!(!Cursor::moved_backwards(c, next) || c.wrap == u16::MAX && next.wrap == 0);
        }
        // Advancing in two steps is advancing once.
        let k = n / 3;
        prop_assert_eq!(c.advance(k, size).advance(n - k, size), next);
        // The serial order agrees with the direction of travel (unless a full ring).
        if n > 0 && n < size {
            prop_assert_eq!(next.serial_cmp(c), Ordering::Greater);
            prop_assert_eq!(c.serial_cmp(next), Ordering::Less);
            // As above: Linux's comparison reads the 16-bit wrap (65535 → 0) the other way.
            if !(c.wrap == u16::MAX && next.wrap == 0) {
                prop_assert_eq!(Cursor::comp(size, next, c), -i64::from(n));
            }
        }
    }

    /// A full lap is exactly one wrap further on.
    #[test]
    fn prop_full_lap((size, c) in arb_size().prop_flat_map(|s| (Just(s), arb_cursor_in(s)))) {
        let lap = c.advance(size, size);
        prop_assert_eq!(lap, Cursor::new(c.wrap.wrapping_add(1), c.count));
        prop_assert_eq!(Cursor::diff(size, c, lap), size);
    }

    /// Linux's acceptance rule: never backwards for a cursor that moved forward by less than a
    /// ring, except where it cannot tell (wrap 0xffff → 0 is accepted by its special case).
    #[test]
    fn prop_backwards_is_rejected((size, c) in arb_size().prop_flat_map(|s| (Just(s), arb_cursor_in(s))), back in 1u32..1000) {
        let back = back.min(c.count.max(1));
        if c.count >= back {
            let older = Cursor::new(c.wrap, c.count - back);
            prop_assert!(Cursor::moved_backwards(c, older));
            prop_assert_eq!(Cursor::diff(size, c, older), 0);
        }
    }

    #[test]
    fn prop_seq_before_is_antisymmetric(a in any::<u16>(), d in 1u16..0x8000) {
        let b = a.wrapping_add(d);
        prop_assert!(seq_before(a, b));
        prop_assert!(!seq_before(b, a));
    }
}
