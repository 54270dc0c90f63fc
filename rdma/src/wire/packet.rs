//! BTH, RETH, AETH, ImmDt, IETH, AtomicETH, AtomicAckETH and whole RC packets
//! (wire-spec §6.2–6.4). Big-endian throughout.

use super::{Error, Opcode, Psn};

/// Length of the Base Transport Header.
pub const BTH_LEN: usize = 12;
/// Length of the invariant CRC trailer.
pub const ICRC_LEN: usize = 4;
/// Length of an AETH.
pub const AETH_LEN: usize = 4;
const RETH_LEN: usize = 16;
const ATOMIC_ETH_LEN: usize = 28;

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be24(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}
fn put24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// A read-only or read-write view of a RoCE v2 packet: the UDP payload from the BTH through
/// the ICRC.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it. Accessors may panic until [`Self::check_len`] passes.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a buffer and checks that every accessor is safe to call.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Validates the length, transport version, opcode and pad count.
    pub fn check_len(&self) -> Result<(), Error> {
        let b = self.buffer.as_ref();
        let len = b.len();
        if len < BTH_LEN + ICRC_LEN {
            return Err(Error::TooShort { len });
        }
        if len % 4 != 0 {
            return Err(Error::Misaligned { len });
        }
        if self.tver() != 0 {
            return Err(Error::BadTransportVersion(self.tver()));
        }
        let opcode = self.opcode();
        if !opcode.is_supported() {
            return Err(Error::UnsupportedOpcode(opcode.0));
        }
        let need = BTH_LEN + opcode.ext_len() + ICRC_LEN;
        if len < need {
            return Err(Error::TruncatedHeaders {
                opcode,
                need,
                have: len,
            });
        }
        let padded = len - need;
        let pad = self.pad_count();
        if !opcode.has_payload() {
            if padded != 0 || pad != 0 {
                return Err(Error::UnexpectedPayload {
                    opcode,
                    len: padded,
                });
            }
        } else if usize::from(pad) > padded {
            return Err(Error::BadPadCount {
                pad,
                payload: padded,
            });
        }
        if opcode.has_aeth() {
            Syndrome::from_byte(b[BTH_LEN])?;
        }
        Ok(())
    }

    /// Consumes the view and returns the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The BTH opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.buffer.as_ref()[0])
    }
    /// Solicited event bit.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[1] & 0x80 != 0
    }
    /// Migration request bit.
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[1] & 0x40 != 0
    }
    /// Number of pad bytes at the end of the payload (0–3).
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[1] >> 4) & 0x3
    }
    /// Transport header version (must be 0).
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[1] & 0xF
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }
    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[4] & 0x80 != 0
    }
    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[4] & 0x40 != 0
    }
    /// The reserved low six bits of byte 4 (our engines' extension flags).
    pub fn ext_flags(&self) -> u8 {
        self.buffer.as_ref()[4] & 0x3F
    }
    /// Destination queue pair number (24 bits).
    pub fn dest_qp(&self) -> u32 {
        be24(self.buffer.as_ref(), 5)
    }
    /// Acknowledge-request bit.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[8] & 0x80 != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(be24(self.buffer.as_ref(), 9))
    }

    fn ext(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[BTH_LEN..BTH_LEN + self.opcode().ext_len()]
    }

    /// Offset of a header inside the extension area, in the IBA order
    /// RETH, AtomicETH, AETH, AtomicAckETH, ImmDt, IETH.
    fn ext_offset(&self, which: u8) -> usize {
        let op = self.opcode();
        let mut at = 0;
        let order = [
            (op.has_reth(), RETH_LEN),
            (op.has_atomic_eth(), ATOMIC_ETH_LEN),
            (op.has_aeth(), AETH_LEN),
            (op.has_atomic_ack_eth(), 8),
            (op.has_imm(), 4),
            (op.has_ieth(), 4),
        ];
        for (i, (present, len)) in order.iter().enumerate() {
            if i == usize::from(which) {
                break;
            }
            if *present {
                at += len;
            }
        }
        at
    }

    /// The RETH, if the opcode carries one.
    pub fn reth(&self) -> Option<Reth> {
        self.opcode().has_reth().then(|| {
            let e = &self.ext()[self.ext_offset(0)..];
            Reth {
                va: be64(e, 0),
                rkey: be32(e, 8),
                len: be32(e, 12),
            }
        })
    }
    /// The AtomicETH, if the opcode carries one.
    pub fn atomic_eth(&self) -> Option<AtomicEth> {
        self.opcode().has_atomic_eth().then(|| {
            let e = &self.ext()[self.ext_offset(1)..];
            AtomicEth {
                va: be64(e, 0),
                rkey: be32(e, 8),
                swap_add: be64(e, 12),
                compare: be64(e, 20),
            }
        })
    }
    /// The AETH, if the opcode carries one and its syndrome is valid.
    pub fn aeth(&self) -> Option<Aeth> {
        if !self.opcode().has_aeth() {
            return None;
        }
        let e = &self.ext()[self.ext_offset(2)..];
        Some(Aeth {
            syndrome: Syndrome::from_byte(e[0]).ok()?,
            msn: be24(e, 1),
        })
    }
    /// The AtomicAckETH (original remote value), if present.
    pub fn atomic_ack_eth(&self) -> Option<u64> {
        self.opcode()
            .has_atomic_ack_eth()
            .then(|| be64(&self.ext()[self.ext_offset(3)..], 0))
    }
    /// Immediate data, if present.
    pub fn imm(&self) -> Option<u32> {
        self.opcode()
            .has_imm()
            .then(|| be32(&self.ext()[self.ext_offset(4)..], 0))
    }
    /// The rkey to invalidate (IETH), if present.
    pub fn ieth(&self) -> Option<u32> {
        self.opcode()
            .has_ieth()
            .then(|| be32(&self.ext()[self.ext_offset(5)..], 0))
    }

    /// Payload bytes, without padding.
    pub fn payload(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let start = BTH_LEN + self.opcode().ext_len();
        let end = b.len() - ICRC_LEN - usize::from(self.pad_count());
        &b[start..end]
    }

    /// The ICRC as stored on the wire (least-significant byte first).
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        let n = b.len();
        u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Stores the ICRC (least-significant byte first, as Linux rxe does on x86).
    pub fn set_icrc(&mut self, icrc: u32) {
        let b = self.buffer.as_mut();
        let n = b.len();
        b[n - 4..].copy_from_slice(&icrc.to_le_bytes());
    }

    /// The payload area (without padding), for filling in place after [`PacketRepr::emit_headers`].
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = BTH_LEN + self.opcode().ext_len();
        let pad = usize::from(self.pad_count());
        let b = self.buffer.as_mut();
        let end = b.len() - ICRC_LEN - pad;
        &mut b[start..end]
    }
}

/// RDMA extended transport header: where a WRITE or READ goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length: the length of the whole message.
    pub len: u32,
}

/// Atomic extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEth {
    /// Remote virtual address (8-byte aligned).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap (compare-and-swap) or add (fetch-and-add) operand.
    pub swap_add: u64,
    /// Compare operand.
    pub compare: u64,
}

/// NAK codes (AETH syndrome `011xxxxx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NakCode {
    /// PSN sequence error: the responder expected an earlier PSN.
    PsnSequenceError,
    /// Invalid request.
    InvalidRequest,
    /// Remote access error: bad rkey, address range or permission.
    RemoteAccessError,
    /// Remote operational error.
    RemoteOperationalError,
    /// Invalid RD request.
    InvalidRdRequest,
}

/// The AETH syndrome: ACK, RNR NAK or NAK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syndrome {
    /// Positive acknowledgement with an end-to-end credit code (0x1F = unlimited).
    Ack {
        /// Credit count code (5 bits).
        credits: u8,
    },
    /// Receiver not ready: no receive WQE was posted.
    RnrNak {
        /// RNR timer code (5 bits; its duration: `rc::rnr_timer_duration`).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl Syndrome {
    /// Decodes a syndrome byte.
    pub fn from_byte(b: u8) -> Result<Self, Error> {
        let value = b & 0x1F;
        Ok(match b >> 5 {
            0 => Self::Ack { credits: value },
            1 => Self::RnrNak { timer: value },
            3 => Self::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => return Err(Error::ReservedSyndrome(b)),
            }),
            _ => return Err(Error::ReservedSyndrome(b)),
        })
    }

    /// Encodes the syndrome byte.
    pub fn to_byte(self) -> u8 {
        match self {
            Self::Ack { credits } => credits & 0x1F,
            Self::RnrNak { timer } => 0x20 | (timer & 0x1F),
            Self::Nak(code) => {
                0x60 | match code {
                    NakCode::PsnSequenceError => 0,
                    NakCode::InvalidRequest => 1,
                    NakCode::RemoteAccessError => 2,
                    NakCode::RemoteOperationalError => 3,
                    NakCode::InvalidRdRequest => 4,
                }
            }
        }
    }

    /// The "unlimited credits" ACK syndrome that rxe always sends (0x1F).
    pub const ACK: Self = Self::Ack { credits: 0x1F };
}

/// ACK extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aeth {
    /// ACK/NAK syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits): requests the responder has completed.
    pub msn: u32,
}

/// The BTH fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration request.
    pub mig_req: bool,
    /// Partition key (rxe's default is 0xFFFF).
    pub pkey: u16,
    /// FECN bit.
    pub fecn: bool,
    /// BECN bit.
    pub becn: bool,
    /// The reserved low six bits of byte 4: our engines' extension flags ([`super::MARK`],
    /// [`super::ACK_NOW`], …); 0 from rxe and RNICs.
    pub ext: u8,
    /// Destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// A BTH with rxe's defaults (P_Key 0xFFFF, no flags).
    pub const fn new(opcode: Opcode, dest_qp: u32, psn: Psn) -> Self {
        Self {
            opcode,
            solicited: false,
            mig_req: false,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            ext: 0,
            dest_qp,
            ack_req: false,
            psn,
        }
    }
}

/// A parsed RoCE v2 RC packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketRepr<'a> {
    /// The base transport header (its pad count is derived from the payload length).
    pub bth: BthRepr,
    /// RDMA extended header (WRITE FIRST/ONLY, READ request).
    pub reth: Option<Reth>,
    /// Atomic extended header.
    pub atomic_eth: Option<AtomicEth>,
    /// ACK extended header.
    pub aeth: Option<Aeth>,
    /// Atomic ACK extended header (original remote data).
    pub atomic_ack_eth: Option<u64>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Invalidate rkey.
    pub ieth: Option<u32>,
    /// Payload without padding.
    pub payload: &'a [u8],
}

impl<'a> PacketRepr<'a> {
    /// Parses a view (checking it first). The ICRC is not verified here (see
    /// [`super::verify_icrc`]).
    pub fn parse(packet: &Packet<&'a [u8]>) -> Result<Self, Error> {
        packet.check_len()?;
        let b: &'a [u8] = packet.buffer;
        let view = Packet::new_unchecked(b);
        Ok(Self {
            bth: BthRepr {
                opcode: view.opcode(),
                solicited: view.solicited(),
                mig_req: view.mig_req(),
                pkey: view.pkey(),
                fecn: view.fecn(),
                becn: view.becn(),
                ext: view.ext_flags(),
                dest_qp: view.dest_qp(),
                ack_req: view.ack_req(),
                psn: view.psn(),
            },
            reth: view.reth(),
            atomic_eth: view.atomic_eth(),
            aeth: view.aeth(),
            atomic_ack_eth: view.atomic_ack_eth(),
            imm: view.imm(),
            ieth: view.ieth(),
            payload: {
                let start = BTH_LEN + view.opcode().ext_len();
                let end = b.len() - ICRC_LEN - usize::from(view.pad_count());
                &b[start..end]
            },
        })
    }

    /// Parses bytes (a UDP payload: BTH through ICRC) directly.
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Self, Error> {
        Self::parse(&Packet::new_unchecked(bytes))
    }

    /// Pad bytes needed after the payload.
    pub const fn pad(payload_len: usize) -> usize {
        (4 - payload_len % 4) % 4
    }

    /// Bytes from the BTH up to the payload.
    pub fn header_len(&self) -> usize {
        BTH_LEN + self.bth.opcode.ext_len()
    }

    /// Total length of the packet, ICRC included.
    pub fn buffer_len(&self) -> usize {
        Self::len_for(self.bth.opcode, self.payload.len())
    }

    /// Total packet length for an opcode and payload length.
    pub fn len_for(opcode: Opcode, payload_len: usize) -> usize {
        BTH_LEN + opcode.ext_len() + payload_len + Self::pad(payload_len) + ICRC_LEN
    }

    /// Writes the BTH and extension headers; the payload, pad and ICRC areas are left for the
    /// caller (see [`Packet::payload_mut`]), except that the pad bytes are zeroed.
    /// `buf` must be at least [`Self::buffer_len`] long; only that prefix is used.
    pub fn emit_headers(&self, buf: &mut [u8]) {
        self.emit_headers_for(self.payload.len(), buf);
    }

    /// Like [`Self::emit_headers`], for a packet that will carry `payload_len` bytes (the
    /// `payload` field is ignored): lets a sender copy the payload straight into `buf`.
    pub fn emit_headers_for(&self, payload_len: usize, buf: &mut [u8]) {
        let op = self.bth.opcode;
        let total = Self::len_for(op, payload_len);
        let pad = Self::pad(payload_len);
        let b = &mut buf[..total];
        b[0] = op.0;
        b[1] = (u8::from(self.bth.solicited) << 7)
            | (u8::from(self.bth.mig_req) << 6)
            | ((pad as u8) << 4);
        b[2..4].copy_from_slice(&self.bth.pkey.to_be_bytes());
        b[4] =
            (u8::from(self.bth.fecn) << 7) | (u8::from(self.bth.becn) << 6) | (self.bth.ext & 0x3F);
        put24(b, 5, self.bth.dest_qp & 0xFF_FFFF);
        b[8] = u8::from(self.bth.ack_req) << 7;
        put24(b, 9, self.bth.psn.value());
        let mut at = BTH_LEN;
        if op.has_reth() {
            let r = self.reth.unwrap_or_default();
            b[at..at + 8].copy_from_slice(&r.va.to_be_bytes());
            b[at + 8..at + 12].copy_from_slice(&r.rkey.to_be_bytes());
            b[at + 12..at + 16].copy_from_slice(&r.len.to_be_bytes());
            at += RETH_LEN;
        }
        if op.has_atomic_eth() {
            let a = self.atomic_eth.unwrap_or_default();
            b[at..at + 8].copy_from_slice(&a.va.to_be_bytes());
            b[at + 8..at + 12].copy_from_slice(&a.rkey.to_be_bytes());
            b[at + 12..at + 20].copy_from_slice(&a.swap_add.to_be_bytes());
            b[at + 20..at + 28].copy_from_slice(&a.compare.to_be_bytes());
            at += ATOMIC_ETH_LEN;
        }
        if op.has_aeth() {
            let a = self.aeth.unwrap_or(Aeth {
                syndrome: Syndrome::ACK,
                msn: 0,
            });
            b[at] = a.syndrome.to_byte();
            put24(b, at + 1, a.msn & 0xFF_FFFF);
            at += AETH_LEN;
        }
        if op.has_atomic_ack_eth() {
            b[at..at + 8].copy_from_slice(&self.atomic_ack_eth.unwrap_or(0).to_be_bytes());
            at += 8;
        }
        if op.has_imm() {
            b[at..at + 4].copy_from_slice(&self.imm.unwrap_or(0).to_be_bytes());
            at += 4;
        }
        if op.has_ieth() {
            b[at..at + 4].copy_from_slice(&self.ieth.unwrap_or(0).to_be_bytes());
        }
        let pad_at = total - ICRC_LEN - pad;
        b[pad_at..total - ICRC_LEN].fill(0);
    }

    /// Writes the whole packet except the ICRC, which is set to zero (compute it with
    /// [`super::compute_icrc`] and store it with [`Packet::set_icrc`]).
    pub fn emit(&self, buf: &mut [u8]) {
        self.emit_headers(buf);
        let start = self.header_len();
        buf[start..start + self.payload.len()].copy_from_slice(self.payload);
        let total = self.buffer_len();
        buf[total - ICRC_LEN..total].fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Kind;

    // Frame 16 of the reference capture (Linux 6.12 rxe): RDMA WRITE_ONLY of 16 bytes, UDP payload.
    const WRITE_ONLY: [u8; 48] = [
        0x0a, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x1a, 0xbc, 0xb9, // BTH
        0xff, 0x3d, 0x23, 0x3f, 0x84, 0x36, 0x00, 0x00, 0x00, 0x00, 0x03, 0xe3, 0x00, 0x00, 0x00,
        0x10, // RETH
        0x31, 0x42, 0x50, 0x4b, 0x45, 0x00, 0x00, 0x00, 0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, // payload
        0x38, 0x62, 0x15, 0x45, // ICRC
    ];
    // Frame 10: the ACK.
    const ACK: [u8; 20] = [
        0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x36, 0x00, 0xa1, 0x1f, 0x00, 0x00,
        0x01, 0x55, 0xa8, 0xe0, 0x4c,
    ];

    #[test]
    fn deconstruct_kernel_write_only() {
        let p = Packet::new_checked(&WRITE_ONLY[..]).unwrap();
        assert_eq!(p.opcode(), Opcode::RDMA_WRITE_ONLY);
        assert_eq!(p.opcode().kind(), Some(Kind::Write));
        assert!(!p.solicited());
        assert_eq!(p.pkey(), 0xffff);
        assert_eq!(p.dest_qp(), 0x11);
        assert!(p.ack_req());
        assert_eq!(p.psn(), Psn::new(0x1abcb9));
        assert_eq!(
            p.reth(),
            Some(Reth {
                va: 0xff3d233f84360000,
                rkey: 0x3e3,
                len: 16
            })
        );
        assert_eq!(p.payload().len(), 16);
        assert_eq!(p.icrc(), 0x45156238);
        assert_eq!(p.aeth(), None);
    }

    #[test]
    fn deconstruct_kernel_ack() {
        let p = Packet::new_checked(&ACK[..]).unwrap();
        assert_eq!(p.opcode(), Opcode::ACKNOWLEDGE);
        assert_eq!(
            p.aeth(),
            Some(Aeth {
                syndrome: Syndrome::ACK,
                msn: 1
            })
        );
        assert_eq!(p.psn(), Psn::new(0x3600a1));
        assert!(p.payload().is_empty());
    }

    #[test]
    fn parse_emit_round_trip_kernel_packets() {
        for bytes in [&WRITE_ONLY[..], &ACK[..]] {
            let repr = PacketRepr::parse_bytes(bytes).unwrap();
            let mut out = vec![0xAAu8; repr.buffer_len()];
            repr.emit(&mut out);
            Packet::new_unchecked(&mut out[..]).set_icrc(Packet::new_unchecked(bytes).icrc());
            assert_eq!(out, bytes);
        }
    }

    #[test]
    fn pad_is_derived_and_zeroed() {
        let repr = PacketRepr {
            bth: BthRepr::new(Opcode::SEND_ONLY, 7, Psn::new(1)),
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            imm: None,
            ieth: None,
            payload: b"hello",
        };
        assert_eq!(repr.buffer_len(), 12 + 5 + 3 + 4);
        let mut out = vec![0xEEu8; repr.buffer_len()];
        repr.emit(&mut out);
        let p = Packet::new_checked(&out[..]).unwrap();
        assert_eq!(p.pad_count(), 3);
        assert_eq!(p.payload(), b"hello");
        assert_eq!(&out[17..20], &[0, 0, 0]);
        assert_eq!(PacketRepr::parse_bytes(&out).unwrap(), repr);
    }

    #[test]
    fn every_header_in_iba_order() {
        let repr = PacketRepr {
            bth: BthRepr::new(
                Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                0x123456,
                Psn::new(0xfffffe),
            ),
            reth: Some(Reth {
                va: 0x1122334455667788,
                rkey: 0xdeadbeef,
                len: 3,
            }),
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            imm: Some(0xcafef00d),
            ieth: None,
            payload: &[1, 2, 3],
        };
        let mut out = vec![0u8; repr.buffer_len()];
        repr.emit(&mut out);
        assert_eq!(&out[28..32], &[0xca, 0xfe, 0xf0, 0x0d]);
        assert_eq!(PacketRepr::parse_bytes(&out).unwrap(), repr);

        let atomic = PacketRepr {
            bth: BthRepr::new(Opcode::ATOMIC_ACKNOWLEDGE, 1, Psn::new(2)),
            aeth: Some(Aeth {
                syndrome: Syndrome::ACK,
                msn: 9,
            }),
            atomic_ack_eth: Some(0x0102030405060708),
            payload: &[],
            ..repr
        };
        let atomic = PacketRepr {
            reth: None,
            imm: None,
            ..atomic
        };
        let mut out = vec![0u8; atomic.buffer_len()];
        atomic.emit(&mut out);
        assert_eq!(PacketRepr::parse_bytes(&out).unwrap(), atomic);

        let cas = PacketRepr {
            bth: BthRepr::new(Opcode::COMPARE_SWAP, 1, Psn::new(3)),
            atomic_eth: Some(AtomicEth {
                va: 8,
                rkey: 9,
                swap_add: 10,
                compare: 11,
            }),
            aeth: None,
            atomic_ack_eth: None,
            ..atomic
        };
        let mut out = vec![0u8; cas.buffer_len()];
        cas.emit(&mut out);
        assert_eq!(out.len(), 12 + 28 + 4);
        assert_eq!(PacketRepr::parse_bytes(&out).unwrap(), cas);

        let inv = PacketRepr {
            bth: BthRepr::new(Opcode::SEND_ONLY_WITH_INVALIDATE, 1, Psn::new(4)),
            atomic_eth: None,
            ieth: Some(0x77),
            payload: b"abcd",
            ..cas
        };
        let mut out = vec![0u8; inv.buffer_len()];
        inv.emit(&mut out);
        assert_eq!(PacketRepr::parse_bytes(&out).unwrap(), inv);
    }

    #[test]
    fn syndromes_round_trip() {
        for b in 0u8..=255 {
            match Syndrome::from_byte(b) {
                Ok(s) => assert_eq!(s.to_byte(), b),
                Err(Error::ReservedSyndrome(x)) => assert_eq!(x, b),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(
            Syndrome::from_byte(0x62),
            Ok(Syndrome::Nak(NakCode::RemoteAccessError))
        );
        assert_eq!(Syndrome::from_byte(0x25), Ok(Syndrome::RnrNak { timer: 5 }));
    }

    // One test per decode error.
    #[test]
    fn error_too_short() {
        assert_eq!(
            PacketRepr::parse_bytes(&ACK[..12]),
            Err(Error::TooShort { len: 12 })
        );
    }
    #[test]
    fn error_misaligned() {
        let mut v = WRITE_ONLY.to_vec();
        v.push(0);
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::Misaligned { len: 49 })
        );
    }
    #[test]
    fn error_bad_version() {
        let mut v = ACK;
        v[1] |= 0x1;
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::BadTransportVersion(1))
        );
    }
    #[test]
    fn error_unsupported_opcode() {
        let mut v = ACK;
        v[0] = 0x64; // UD SEND_ONLY
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::UnsupportedOpcode(0x64))
        );
    }
    #[test]
    fn error_truncated_headers() {
        let mut v = WRITE_ONLY[..20].to_vec(); // BTH + 4 bytes of RETH + ICRC space
        v[1] = 0;
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::TruncatedHeaders {
                opcode: Opcode::RDMA_WRITE_ONLY,
                need: 32,
                have: 20
            })
        );
    }
    #[test]
    fn error_bad_pad_count() {
        let mut v = vec![0u8; 16];
        v[0] = Opcode::SEND_ONLY.0;
        v[1] = 0x30; // pad 3, but the payload is empty
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::BadPadCount { pad: 3, payload: 0 })
        );
    }
    #[test]
    fn error_unexpected_payload() {
        let mut v = ACK.to_vec();
        v.splice(16..16, [0u8; 4]);
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::UnexpectedPayload {
                opcode: Opcode::ACKNOWLEDGE,
                len: 4
            })
        );
    }
    #[test]
    fn error_reserved_syndrome() {
        let mut v = ACK;
        v[12] = 0x45;
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::ReservedSyndrome(0x45))
        );
        v[12] = 0x7f; // NAK code 31: reserved
        assert_eq!(
            PacketRepr::parse_bytes(&v),
            Err(Error::ReservedSyndrome(0x7f))
        );
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn exercise(bytes: &[u8]) {
        // Every accessor of a checked view, and parse, must not panic.
        if let Ok(p) = Packet::new_checked(bytes) {
            let _ = (
                p.opcode(),
                p.solicited(),
                p.pkey(),
                p.dest_qp(),
                p.psn(),
                p.reth(),
                p.aeth(),
            );
            let _ = (
                p.atomic_eth(),
                p.atomic_ack_eth(),
                p.imm(),
                p.ieth(),
                p.payload(),
                p.icrc(),
            );
            let r = PacketRepr::parse(&p).expect("a checked view parses");
            let mut out = vec![0u8; r.buffer_len()];
            r.emit(&mut out);
            let again = PacketRepr::parse_bytes(&out).expect("emitted packets parse");
            assert_eq!(again.payload, r.payload);
            assert_eq!(again.bth.psn, r.bth.psn);
        } else {
            assert!(PacketRepr::parse_bytes(bytes).is_err());
        }
        let _ = PacketRepr::parse_bytes(bytes).map_err(|e| e.to_string());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            exercise(&bytes);
        }

        #[test]
        fn mutated_valid_packets_never_panic(op in 0u8..0x18, len in 0usize..64, flips in proptest::collection::vec((0usize..128, any::<u8>()), 1..6), cut in 0usize..140) {
            let opcode = Opcode(op);
            prop_assume!(opcode.is_supported());
            let payload = vec![0x5a; if opcode.has_payload() { len } else { 0 }];
            let r = PacketRepr {
                bth: BthRepr::new(opcode, 0x123, Psn::new(7)),
                reth: opcode.has_reth().then_some(Reth { va: 1, rkey: 2, len: 3 }),
                atomic_eth: opcode.has_atomic_eth().then_some(AtomicEth::default()),
                aeth: opcode.has_aeth().then_some(Aeth { syndrome: Syndrome::ACK, msn: 1 }),
                atomic_ack_eth: opcode.has_atomic_ack_eth().then_some(9),
                imm: opcode.has_imm().then_some(4),
                ieth: opcode.has_ieth().then_some(5),
                payload: &payload,
            };
            let mut b = vec![0u8; r.buffer_len()];
            r.emit(&mut b);
            prop_assert_eq!(PacketRepr::parse_bytes(&b).unwrap(), r);
            for (at, x) in flips {
                if let Some(byte) = b.get_mut(at) {
                    *byte ^= x;
                }
            }
            b.truncate(cut.max(1));
            exercise(&b);
        }
    }
}
