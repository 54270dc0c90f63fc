//! Receive-side ICRC checking: a plain UDP socket does not see the IPv4 identification the
//! ICRC covers, so it is solved for ([`IdCache`]), and the destination ports a sender may have
//! addressed are tried ([`icrc_matches`]).

use crate::transport::udp::MAX_GSO_SEGMENTS;
use crate::wire::{IcrcHeaders, verify_icrc};
use std::collections::HashMap;

/// Identification values our senders use: segment indices of a GSO batch.
pub(super) const GSO_IDS: u16 = MAX_GSO_SEGMENTS as u16;

/// How the ICRC of a packet of one length changes with the 16 identification bits, as a
/// reduced basis: row `k` is `(delta, bits)` — the XOR of the deltas of the identification bits
/// in `bits` ([`crate::wire::ip_id_delta`]) — with distinct leading bits, highest first.
#[derive(Clone, Copy)]
struct IdBasis {
    rows: [(u32, u16); 16],
    n: usize,
}

impl IdBasis {
    fn new(len: usize) -> Self {
        let mut b = Self {
            rows: [(0, 0); 16],
            n: 0,
        };
        for i in 0..16 {
            let (mut v, mut m) = (crate::wire::ip_id_delta(len, i), 1u16 << i);
            for &(rv, rm) in &b.rows[..b.n] {
                if v ^ rv < v {
                    v ^= rv;
                    m ^= rm;
                }
            }
            if v == 0 {
                continue; // cannot happen for CRC-32 (a 16-bit burst); harmless if it did
            }
            let at = b.rows[..b.n].iter().position(|r| r.0 < v).unwrap_or(b.n);
            b.rows.copy_within(at..b.n, at + 1);
            b.rows[at] = (v, m);
            b.n += 1;
        }
        b
    }

    /// The identification bits whose flip turns the ICRC by `want`, if any.
    fn solve(&self, mut want: u32) -> Option<u16> {
        let mut bits = 0;
        for &(rv, rm) in &self.rows[..self.n] {
            if want ^ rv < want {
                want ^= rv;
                bits ^= rm;
            }
        }
        (want == 0).then_some(bits)
    }
}

/// Per packet length, how the ICRC changes with the identification (an [`IdBasis`], computed
/// once per length: RoCE lengths are multiples of 4, so at most ~1100 of them).
///
/// A plain UDP socket cannot see the IPv4 identification the ICRC covers. Our senders use the
/// GSO segment index (0 for a lone datagram; a batch split up on the way arrives as lone
/// datagrams with 1, 2, …); Linux rxe uses the kernel's per-destination counter
/// (`__ip_select_ident`), any of the 65536 values. The CRC is affine in the identification, so
/// the receiver solves for it: 16 XORs against a reduced basis.
#[derive(Default)]
pub(crate) struct IdCache {
    by_len: HashMap<usize, IdBasis>,
}

impl IdCache {
    /// The identification for which the packet's ICRC is right, given the ICRC `computed` for
    /// identification `tried` and the one `found` in the packet.
    fn find(&mut self, len: usize, tried: u16, found: u32, computed: u32) -> Option<u16> {
        let basis = self.by_len.entry(len).or_insert_with(|| IdBasis::new(len));
        basis.solve(found ^ computed).map(|bits| tried ^ bits)
    }
}

/// The IPv4 identification for which the ICRC of `bytes` (received with headers `h`, whose
/// `dport` and `ip_id` are what the receiver guesses) is right, for one of the destination
/// ports it may have been sent to: `addressed[0]` (the RoCE port: a sender that addressed 4791
/// and was steered to us) or else `addressed[1]` (the port of the socket it came on: a sender
/// that addressed it directly). `None`: the packet is corrupt. The identification is solved
/// (see [`IdCache`]): any value is accepted, since Linux rxe senders use any.
pub(crate) fn icrc_matches(
    mut h: IcrcHeaders,
    addressed: [u16; 2],
    bytes: &[u8],
    ids: &mut IdCache,
) -> Option<u16> {
    for (k, &port) in addressed.iter().enumerate() {
        if k == 1 && port == addressed[0] {
            break;
        }
        h.dport = port;
        match verify_icrc(&h, bytes) {
            Ok(()) => return Some(h.ip_id),
            Err(crate::wire::Error::BadIcrc { found, computed }) => {
                if let Some(id) = ids.find(bytes.len(), h.ip_id, found, computed) {
                    return Some(id);
                }
            }
            Err(_) => {}
        }
    }
    None
}
