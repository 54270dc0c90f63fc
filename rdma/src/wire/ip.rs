//! The IPv4 and UDP headers around a RoCE v2 packet, as Linux would put them on the wire for our
//! sends. The engine itself never writes these (the kernel does); they exist for the ICRC
//! pseudo-header, for the pcap writer and for tests.

use super::IcrcHeaders;

/// Length of an IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// Length of a UDP header.
pub const UDP_HEADER_LEN: usize = 8;
/// The IANA port for RoCE v2; Linux rxe peers always send to it.
pub const ROCE_V2_PORT: u16 = 4791;

/// The Internet checksum of an IPv4 header.
pub fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for pair in header.chunks(2) {
        let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// Writes a 20-byte IPv4 header and an 8-byte UDP header (checksum 0, as rxe sends) for a RoCE
/// packet of `roce_len` bytes into `buf[..28]`.
pub fn emit_ipv4_udp(buf: &mut [u8], h: &IcrcHeaders, ttl: u8, roce_len: usize) {
    let tot = (IPV4_HEADER_LEN + UDP_HEADER_LEN + roce_len) as u16;
    let ip = &mut buf[..IPV4_HEADER_LEN];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&tot.to_be_bytes());
    ip[4..6].copy_from_slice(&h.ip_id.to_be_bytes());
    ip[6..8].copy_from_slice(&(if h.df { 0x4000u16 } else { 0 }).to_be_bytes());
    ip[8] = ttl;
    ip[9] = 17;
    ip[10..12].fill(0);
    ip[12..16].copy_from_slice(&h.src.octets());
    ip[16..20].copy_from_slice(&h.dst.octets());
    let csum = ipv4_checksum(ip);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let udp = &mut buf[IPV4_HEADER_LEN..IPV4_HEADER_LEN + UDP_HEADER_LEN];
    udp[0..2].copy_from_slice(&h.sport.to_be_bytes());
    udp[2..4].copy_from_slice(&h.dport.to_be_bytes());
    udp[4..6].copy_from_slice(&((UDP_HEADER_LEN + roce_len) as u16).to_be_bytes());
    udp[6..8].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// The header of wire-spec §7.9 (c) with IP ID 0: `45 00 00 58 00 00 40 00 01 11 65 93 …`.
    #[test]
    fn header_matches_spec_vector() {
        let h = IcrcHeaders {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            ip_id: 0,
            df: true,
            sport: 0xc012,
            dport: ROCE_V2_PORT,
        };
        let mut b = [0u8; 28];
        emit_ipv4_udp(&mut b, &h, 1, 0x58 - 28);
        assert_eq!(
            b,
            [
                0x45, 0x00, 0x00, 0x58, 0x00, 0x00, 0x40, 0x00, 0x01, 0x11, 0x65, 0x93, 10, 0, 0,
                1, 10, 0, 0, 2, 0xc0, 0x12, 0x12, 0xb7, 0x00, 0x44, 0x00, 0x00
            ]
        );
    }
}
