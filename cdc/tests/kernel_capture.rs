//! Every CDC message of a real Linux 6.12 SMC-Rv2 session (testdata/README.md) parses and
//! re-emits byte for byte, and the cursors behave as the arithmetic says.

#[path = "../../testdata/capture.rs"]
mod capture;

use cdc::*;

#[test]
fn test_every_cdc_message_roundtrips() {
    let msgs: Vec<(usize, [u8; 4], Vec<u8>)> = capture::read(capture::REFERENCE)
        .into_iter()
        .filter_map(|i| match i {
            capture::Item::Send {
                frame,
                src,
                payload,
            } if payload[0] == CDC_TYPE => Some((frame, src, payload)),
            _ => None,
        })
        .collect();
    assert_eq!(msgs.len(), 58);
    let mut parsed = Vec::new();
    for (frame, src, bytes) in &msgs {
        let m = CdcMessage::parse(bytes).unwrap_or_else(|e| panic!("frame {frame}: {e}"));
        assert_eq!(
            m.to_bytes().as_slice(),
            bytes.as_slice(),
            "frame {frame}: {m}"
        );
        parsed.push((*frame, *src, m));
    }
    assert_eq!(parsed[0].0, 17);
    assert_eq!(
        parsed[0].2.to_string(),
        "CDC seq=1 token=0x1 prod=0:16 cons=0:0 flags=- state=-"
    );
    // The producer advances by what the RDMA WRITEs carried (16, then 1000 bytes).
    assert_eq!(parsed[1].2.prod, Cursor::new(0, 16).advance(1000, 65536));

    // Per connection (sender, token): sequence numbers start at 1 and rise by one, cursors
    // never move backwards, and close flags are sticky.
    let mut last: std::collections::HashMap<([u8; 4], u32), CdcMessage> = Default::default();
    for (frame, src, m) in &parsed {
        match last.get(&(*src, m.token)) {
            None => assert_eq!(m.seq, 1, "frame {frame}"),
            Some(prev) => {
                assert_eq!(m.seq, prev.seq.wrapping_add(1), "frame {frame}");
                assert!(!seq_before(m.seq, prev.seq));
                assert!(!Cursor::moved_backwards(prev.prod, m.prod), "frame {frame}");
                assert!(!Cursor::moved_backwards(prev.cons, m.cons), "frame {frame}");
                assert!(
                    m.conn_flags.contains(prev.conn_flags),
                    "frame {frame}: sticky flags"
                );
            }
        }
        last.insert((*src, m.token), *m);
    }
    assert_eq!(last.len(), 4, "two connections, two directions each");
    let all_prod = parsed
        .iter()
        .fold(ProducerFlags::empty(), |a, (_, _, m)| a | m.prod_flags);
    let all_conn = parsed
        .iter()
        .fold(ConnStateFlags::empty(), |a, (_, _, m)| a | m.conn_flags);
    assert!(all_prod.contains(ProducerFlags::WRITE_BLOCKED));
    assert!(
        all_conn.contains(ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED)
    );
}
