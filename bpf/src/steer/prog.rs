//! The steering program: a tc ingress classifier (`BPF_PROG_TYPE_SCHED_CLS`, attached with
//! tcx) that moves RoCE v2 datagrams addressed to UDP 4791 to the port of their destination
//! QP's range. Pure: builds instructions, loads nothing.
//!
//! For a frame whose `skb->protocol` is IPv4, with an Ethernet header (`lo` has one too, of
//! zeros), it reads the IPv4 header (any IHL), and for UDP that is not a fragment and goes to
//! port 4791 it reads the BTH's destination QP (UDP payload bytes 5..8, 24 bits big-endian).
//! For range `r = qpn >> 12` from [`FIRST_RANGE`] up, it fixes the UDP checksum with
//! `bpf_l4_csum_replace(…, BPF_F_MARK_MANGLED_0 | 2)` — a zero checksum (rxe sends zero)
//! stays zero; for a `CHECKSUM_PARTIAL` skb (loopback, veth) the helper leaves the
//! pseudo-header sum alone, as the port is not part of it — then writes `STEER_BASE + r` as
//! the destination port with `bpf_skb_store_bytes`. Everything else passes untouched. Reads go
//! through `bpf_skb_load_bytes`, so a frame whose headers are not in the linear part is
//! handled too.
//!
//! It returns `TCX_NEXT` (-1) for every packet: programs attached after it still run, and
//! the packet continues as without them. (`TCX_PASS`, 0 — `TC_ACT_OK` — would skip the rest.)

use crate::option::asm::{Asm, Insn, R0, R1, R2, R3, R4, R5, R6, R7, R8, R10};
use rdma::transport::steer::{FIRST_RANGE, ROCE_PORT, STEER_BASE};

/// `struct __sk_buff` offset of `protocol` (checked against the UAPI header).
const SKB_PROTOCOL: i16 = 16;
/// `htons(ETH_P_IP)` as the 32-bit context field reads on a little-endian machine.
const ETH_P_IP_BE: i32 = 0x0008;
/// Ethernet header length (`lo` included).
const L2_LEN: i32 = 14;
const IPPROTO_UDP: i32 = 17;
/// `frag_off & (IP_MF | IP_OFFSET)` read as a little-endian u16 from the big-endian field.
const FRAG_MASK_LE: i32 = 0xff3f;

// Helper numbers (`___BPF_FUNC_MAPPER`).
const HELPER_SKB_STORE_BYTES: i32 = 9;
const HELPER_L4_CSUM_REPLACE: i32 = 11;
const HELPER_SKB_LOAD_BYTES: i32 = 26;
/// `BPF_F_MARK_MANGLED_0 | 2` (a 16-bit field).
const CSUM_FLAGS: i32 = (1 << 5) | 2;
/// `TCX_NEXT`.
pub(crate) const TCX_NEXT: i32 = -1;

// Stack: the IPv4 header (20 bytes) at -48, the new port at -24, UDP header + 8 BTH bytes at -16.
const ST_IP: i16 = -48;
const ST_PORT: i16 = -24;
const ST_UDP: i16 = -16;

/// A 16-bit big-endian value as a little-endian load of its two bytes reads.
const fn be16_as_le(v: u16) -> i32 {
    v.swap_bytes() as i32
}

/// The program's instructions.
pub(crate) fn program() -> Vec<Insn> {
    let mut a = Asm::default();
    a.mov(R6, R1)
        .ldx_w(R1, R6, SKB_PROTOCOL)
        .jne_imm(R1, ETH_P_IP_BE, "pass")
        // The IPv4 header.
        .mov(R1, R6)
        .mov_imm(R2, L2_LEN)
        .mov(R3, R10)
        .add_imm(R3, ST_IP as i32)
        .mov_imm(R4, 20)
        .call(HELPER_SKB_LOAD_BYTES)
        .jne_imm(R0, 0, "pass")
        .ldx_b(R1, R10, ST_IP)
        .mov(R2, R1)
        .rsh_imm(R2, 4)
        .jne_imm(R2, 4, "pass")
        .and_imm(R1, 0x0f)
        .jlt_imm(R1, 5, "pass")
        .lsh_imm(R1, 2)
        .add_imm(R1, L2_LEN)
        .mov(R7, R1) // r7: offset of the UDP header
        .ldx_b(R2, R10, ST_IP + 9)
        .jne_imm(R2, IPPROTO_UDP, "pass")
        .ldx_h(R2, R10, ST_IP + 6)
        .and_imm(R2, FRAG_MASK_LE)
        .jne_imm(R2, 0, "pass")
        // UDP header and the BTH up to its destination QP.
        .mov(R1, R6)
        .mov(R2, R7)
        .mov(R3, R10)
        .add_imm(R3, ST_UDP as i32)
        .mov_imm(R4, 16)
        .call(HELPER_SKB_LOAD_BYTES)
        .jne_imm(R0, 0, "pass")
        .ldx_h(R1, R10, ST_UDP + 2)
        .jne_imm(R1, be16_as_le(ROCE_PORT), "pass")
        // range = qpn >> 12 = bth[5] << 4 | bth[6] >> 4
        .ldx_b(R2, R10, ST_UDP + 8 + 5)
        .ldx_b(R3, R10, ST_UDP + 8 + 6)
        .lsh_imm(R2, 4)
        .rsh_imm(R3, 4)
        .or(R2, R3)
        .jlt_imm(R2, FIRST_RANGE as i32, "pass")
        .add_imm(R2, i32::from(STEER_BASE))
        // r8: the new port, big-endian, as a little-endian load reads it.
        .mov(R8, R2)
        .and_imm(R8, 0xff)
        .lsh_imm(R8, 8)
        .mov(R3, R2)
        .rsh_imm(R3, 8)
        .or(R8, R3)
        .stx_h(R10, ST_PORT, R8)
        // The checksum first (nothing is changed if it fails), then the port.
        .mov(R1, R6)
        .mov(R2, R7)
        .add_imm(R2, 6)
        .mov_imm(R3, be16_as_le(ROCE_PORT))
        .mov(R4, R8)
        .mov_imm(R5, CSUM_FLAGS)
        .call(HELPER_L4_CSUM_REPLACE)
        .jne_imm(R0, 0, "pass")
        .mov(R1, R6)
        .mov(R2, R7)
        .add_imm(R2, 2)
        .mov(R3, R10)
        .add_imm(R3, ST_PORT as i32)
        .mov_imm(R4, 2)
        .mov_imm(R5, 0)
        .call(HELPER_SKB_STORE_BYTES)
        .label("pass")
        .mov_imm(R0, TCX_NEXT)
        .exit();
    a.finish()
        .expect("the steering program's labels are consistent")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_builds_ends_with_exit_and_jumps_stay_inside() {
        let p = program();
        assert!(p.len() < 100, "{} instructions", p.len());
        assert_eq!(p.last().unwrap().code, 0x95);
        assert_eq!(p[p.len() - 2].code, 0xb7, "r0 = TCX_NEXT before exit");
        assert_eq!(p[p.len() - 2].imm, -1);
        for (pc, i) in p.iter().enumerate() {
            if i.code & 0x07 == 0x05 && i.code != 0x85 && i.code != 0x95 {
                let target = pc as i64 + 1 + i64::from(i.off);
                assert!((0..p.len() as i64).contains(&target), "pc {pc}");
            }
        }
        // Only the three helpers it is meant to call.
        let calls: Vec<i32> = p.iter().filter(|i| i.code == 0x85).map(|i| i.imm).collect();
        assert_eq!(calls, [26, 26, 11, 9]);
    }

    #[test]
    fn constants_read_as_the_wire_bytes() {
        // 4791 = 0x12b7: bytes 12 b7, which a little-endian u16 load reads as 0xb712.
        assert_eq!(be16_as_le(4791), 0xb712);
        assert_eq!(
            u16::from_le_bytes(4791u16.to_be_bytes()),
            be16_as_le(4791) as u16
        );
        // frag_off bytes [flags|offset_hi, offset_lo]: mask 3f ff on the wire.
        assert_eq!(
            u16::from_le_bytes([0x3f, 0xff]) as i32,
            FRAG_MASK_LE,
            "MF and the offset, not DF"
        );
        assert_eq!(
            u16::from_le_bytes([0x40, 0x00]) as i32 & FRAG_MASK_LE,
            0,
            "DF alone is not a fragment"
        );
        assert_eq!(u16::from_le_bytes([0x08, 0x00]) as i32, 8, "ETH_P_IP");
    }
}
