//! Reads the reference capture for the codec tests: TCP payloads and RoCE v2 SEND payloads.
//! Test helper only (included with `#[path]`); it panics on a malformed capture.

#![allow(dead_code)]

/// What a frame carried that the codec tests care about.
#[derive(Debug, Clone)]
pub(crate) enum Item {
    /// TCP payload (frame number, source port, bytes).
    Tcp {
        frame: usize,
        sport: u16,
        payload: Vec<u8>,
    },
    /// The payload of an RC SEND_ONLY (frame number, IPv4 source, bytes without pad and ICRC).
    Send {
        frame: usize,
        src: [u8; 4],
        payload: Vec<u8>,
    },
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Every TCP payload and SEND_ONLY payload of an Ethernet pcap, in capture order.
pub(crate) fn read(path: &str) -> Vec<Item> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(
        &data[..4],
        &0xa1b2_c3d4u32.to_le_bytes(),
        "little-endian microsecond pcap"
    );
    assert_eq!(
        u32::from_le_bytes(data[20..24].try_into().unwrap()),
        1,
        "Ethernet link type"
    );
    let mut out = Vec::new();
    let mut at = 24;
    let mut frame = 0;
    while at + 16 <= data.len() {
        let incl = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap()) as usize;
        let f = &data[at + 16..at + 16 + incl];
        at += 16 + incl;
        frame += 1;
        if be16(f, 12) != 0x0800 {
            continue;
        }
        let ip = &f[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let ip = &ip[..usize::from(be16(ip, 2))];
        let l4 = &ip[ihl..];
        match ip[9] {
            6 => {
                let doff = usize::from(l4[12] >> 4) * 4;
                if l4.len() > doff {
                    out.push(Item::Tcp {
                        frame,
                        sport: be16(l4, 0),
                        payload: l4[doff..].to_vec(),
                    });
                }
            }
            17 if be16(l4, 2) == 4791 => {
                let bth = &l4[8..];
                if bth[0] == 0x04 {
                    let pad = usize::from((bth[1] >> 4) & 3);
                    let payload = bth[12..bth.len() - 4 - pad].to_vec();
                    let src = [ip[12], ip[13], ip[14], ip[15]];
                    out.push(Item::Send {
                        frame,
                        src,
                        payload,
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// The reference capture's path from a crate directory.
pub(crate) const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/smcr-v2-kernel-6.12-rxe.pcap"
);
