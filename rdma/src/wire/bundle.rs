//! What two of our engines add to RoCE v2 between themselves: a mark, packets without an
//! ICRC, and bundles of small packets in one datagram.
//!
//! * Every packet our engine sends carries [`MARK`] in the BTH's reserved bits (byte 4, the
//!   low six bits: rxe and RNICs ignore them, and the ICRC masks the byte). A QP that
//!   received a marked packet from its peer knows the peer is our engine.
//! * To such a peer that also says [`TAKES_NO_ICRC`], a packet may carry [`NO_ICRC`]: its
//!   ICRC field is zero and not checked. The UDP checksum covers the datagram, as it covers a
//!   TCP segment (computed and checked by the NICs, or not at all on loopback and veth,
//!   exactly as for TCP); the ICRC costs a CRC-32 pass over every byte on each end.
//! * To such a peer small packets of one QP go as a *bundle*: one datagram that starts with a
//!   BTH-shaped header of opcode [`BUNDLE_OPCODE`] (a manufacturer-specific opcode; the
//!   destination QP where the BTH has it, so that the steering program routes bundles like
//!   packets), followed by each packet (with its ICRC, computed as for a lone datagram,
//!   unless it says [`NO_ICRC`]) behind its length as a big-endian `u16`. A message's WRITE,
//!   its CDC SEND and the ACK of what came the other way leave as one datagram instead of
//!   three: the kernel's work is paid per datagram.
//!
//! A peer that is not our engine (Linux rxe, an RNIC) never sends the mark, and so is sent
//! plain RoCE v2 only.

use super::Error;

/// Byte 4 of the BTH: "sent by an smcr engine, which takes bundles".
pub const MARK: u8 = 0x01;
/// Byte 4 of the BTH: this packet's ICRC was not computed (only sent to a peer that said
/// [`TAKES_NO_ICRC`]).
pub const NO_ICRC: u8 = 0x02;
/// Byte 4 of the BTH, with [`MARK`]: "and I take packets without ICRC".
pub const TAKES_NO_ICRC: u8 = 0x04;
/// Byte 4 of the BTH, on the last packet of a message: "acknowledge this at once". Our
/// engine may hold the ACK of a message that ends in a SEND for a moment, for the answer to
/// carry it ([`QpCaps::ack_delay`](crate::QpCaps::ack_delay)); a sender that expects no
/// answer (a close, an LLC message, data nobody replies to) says so, and is not kept waiting
/// for its completion.
pub const ACK_NOW: u8 = 0x08;
/// The first byte of a bundle (IBA: opcodes `110xxxxx` are manufacturer-specific).
pub const BUNDLE_OPCODE: u8 = 0xC0;
/// A bundle's header: shaped as a BTH (opcode, flags, destination QP at bytes 5..8).
pub const BUNDLE_HEADER_LEN: usize = 12;
/// Each packet of a bundle follows its length, as a big-endian `u16`.
pub const BUNDLE_PREFIX_LEN: usize = 2;

/// Whether a datagram is a bundle (see the module's documentation).
pub fn is_bundle(datagram: &[u8]) -> bool {
    datagram.first() == Some(&BUNDLE_OPCODE)
}

/// Whether a packet (at least a BTH) carries `flag` ([`MARK`], [`NO_ICRC`]).
pub fn has_flag(packet: &[u8], flag: u8) -> bool {
    packet.get(4).is_some_and(|b| b & flag != 0)
}

/// The header of a bundle for QP `dest_qp`.
pub fn bundle_header(dest_qp: u32) -> [u8; BUNDLE_HEADER_LEN] {
    let q = (dest_qp & 0xFF_FFFF).to_be_bytes();
    [BUNDLE_OPCODE, 0, 0, 0, MARK, q[1], q[2], q[3], 0, 0, 0, 0]
}

/// The packets of a bundle, in order. Each is checked only for being whole and for the same
/// destination QP as the bundle's header; the packet parser checks the rest. A defect ends
/// the iteration with its error.
#[derive(Debug, Clone)]
pub struct Bundle<'a> {
    qp: [u8; 3],
    rest: &'a [u8],
    at: usize,
    failed: bool,
}

/// Reads a bundle's header; its packets follow from the iterator.
pub fn parse_bundle(datagram: &[u8]) -> Result<Bundle<'_>, Error> {
    if datagram.len() < BUNDLE_HEADER_LEN {
        return Err(Error::BadBundle {
            at: 0,
            len: datagram.len(),
        });
    }
    if !is_bundle(datagram) || datagram[1] != 0 {
        return Err(Error::BadBundle {
            at: 0,
            len: datagram.len(),
        });
    }
    Ok(Bundle {
        qp: [datagram[5], datagram[6], datagram[7]],
        rest: &datagram[BUNDLE_HEADER_LEN..],
        at: BUNDLE_HEADER_LEN,
        failed: false,
    })
}

impl<'a> Bundle<'a> {
    /// The destination QP of the bundle's packets.
    pub fn dest_qp(&self) -> u32 {
        u32::from_be_bytes([0, self.qp[0], self.qp[1], self.qp[2]])
    }
}

impl<'a> Iterator for Bundle<'a> {
    type Item = Result<&'a [u8], Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let bad = Error::BadBundle {
            at: self.at,
            len: self.at + self.rest.len(),
        };
        let Some((len, rest)) = self.rest.split_first_chunk::<BUNDLE_PREFIX_LEN>() else {
            self.failed = true;
            return Some(Err(bad));
        };
        let len = usize::from(u16::from_be_bytes(*len));
        // At least a BTH and an ICRC field, and for the bundle's QP.
        if len < 16 || len > rest.len() || rest[5..8] != self.qp {
            self.failed = true;
            return Some(Err(bad));
        }
        let (pkt, rest) = rest.split_at(len);
        self.rest = rest;
        self.at += BUNDLE_PREFIX_LEN + len;
        Some(Ok(pkt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(qp: u32, len: usize, fill: u8) -> Vec<u8> {
        let mut p = vec![fill; len];
        p[4] = MARK | NO_ICRC;
        p[5..8].copy_from_slice(&qp.to_be_bytes()[1..]);
        p
    }

    fn bundle(qp: u32, pkts: &[Vec<u8>]) -> Vec<u8> {
        let mut b = bundle_header(qp).to_vec();
        for p in pkts {
            b.extend_from_slice(&(p.len() as u16).to_be_bytes());
            b.extend_from_slice(p);
        }
        b
    }

    #[test]
    fn packets_come_out_as_they_went_in() {
        let pkts = [
            packet(0x12345, 112, 1),
            packet(0x12345, 60, 2),
            packet(0x12345, 20, 3),
        ];
        let b = bundle(0x12345, &pkts);
        assert!(is_bundle(&b));
        assert!(has_flag(&b, MARK));
        let got = parse_bundle(&b).unwrap();
        assert_eq!(got.dest_qp(), 0x12345);
        let got: Vec<_> = got.map(|p| p.unwrap().to_vec()).collect();
        assert_eq!(got, pkts);
    }

    #[test]
    fn a_plain_packet_is_not_a_bundle() {
        // RC opcodes are 0x00–0x1F; rxe's CNP 0x81.
        for op in [0x00u8, 0x0A, 0x11, 0x81] {
            assert!(!is_bundle(&[op; 16]));
        }
        assert!(!is_bundle(&[]));
    }

    #[test]
    fn defects_end_the_bundle_with_an_error() {
        let good = packet(7, 20, 0);
        let mut cases: Vec<Vec<u8>> = Vec::new();
        // Truncated packet, short length prefix, tiny packet, another QP's packet.
        let mut b = bundle(7, std::slice::from_ref(&good));
        b.truncate(b.len() - 1);
        cases.push(b);
        let mut b = bundle(7, std::slice::from_ref(&good));
        b.push(0);
        cases.push(b);
        cases.push(bundle(7, &[good.clone(), vec![0u8; 8]]));
        cases.push(bundle(7, &[good.clone(), packet(8, 20, 0)]));
        for b in cases {
            let items: Vec<_> = parse_bundle(&b).unwrap().collect();
            assert!(items.last().unwrap().is_err(), "{items:?}");
            assert!(items[..items.len() - 1].iter().all(|i| i.is_ok()));
        }
        assert!(parse_bundle(&[BUNDLE_OPCODE; 11]).is_err());
        let mut b = bundle(7, &[good]);
        b[1] = 1; // a later version
        assert!(parse_bundle(&b).is_err());
    }

    #[test]
    fn never_panics_on_any_prefix() {
        let b = bundle(9, &[packet(9, 40, 5), packet(9, 16, 6)]);
        for n in 0..=b.len() {
            if let Ok(it) = parse_bundle(&b[..n]) {
                for _ in it {}
            }
        }
    }
}
