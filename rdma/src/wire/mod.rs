//! RoCE v2 wire formats: the IBA Base Transport Header and its extensions, whole packets as
//! carried in a UDP datagram to port 4791, the invariant CRC, and PSN arithmetic.
//!
//! Each format comes as a borrowed *view* over bytes ([`Packet`]) with checked accessors, and
//! an owned *representation* ([`PacketRepr`]) with `parse`, `emit` and `buffer_len`, in the style
//! of smoltcp's `wire` module. The contract, as in smoltcp:
//!
//! * [`Packet::new_checked`] validates lengths, the transport version, the opcode and the pad
//!   count; after it succeeds no accessor can panic. [`Packet::new_unchecked`] skips this and its
//!   accessors may then panic on short buffers — it exists for emitting into a buffer the caller
//!   sized with [`PacketRepr::buffer_len`].
//! * [`PacketRepr::parse`] never panics: every malformed packet is an [`Error`].
//! * [`PacketRepr::emit`] never fails when given a buffer of `buffer_len()` bytes.

mod bundle;
mod icrc;
mod ip;
mod opcode;
mod packet;
mod psn;

pub use bundle::{
    ACK_NOW, BUNDLE_HEADER_LEN, BUNDLE_OPCODE, BUNDLE_PREFIX_LEN, Bundle, MARK, NO_ICRC,
    TAKES_NO_ICRC, bundle_header, has_flag, is_bundle, parse_bundle,
};
pub use icrc::{IcrcHeaders, compute_icrc, compute_icrc_vectored, ip_id_delta, verify_icrc};
pub use ip::{IPV4_HEADER_LEN, ROCE_V2_PORT, UDP_HEADER_LEN, emit_ipv4_udp, ipv4_checksum};
pub use opcode::{Kind, Opcode, Position};
pub use packet::{
    AETH_LEN, Aeth, AtomicEth, BTH_LEN, BthRepr, ICRC_LEN, NakCode, Packet, PacketRepr, Reth,
    Syndrome,
};
pub use psn::Psn;

use core::fmt;

/// Why a packet could not be decoded. Each variant names one defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Shorter than a BTH plus an ICRC (16 bytes).
    TooShort {
        /// Bytes present.
        len: usize,
    },
    /// The total length is not a multiple of four bytes.
    Misaligned {
        /// Bytes present.
        len: usize,
    },
    /// The BTH transport header version is not 0.
    BadTransportVersion(u8),
    /// The opcode is not one of the reliable-connection opcodes this engine implements.
    UnsupportedOpcode(u8),
    /// The extension headers the opcode requires do not fit.
    TruncatedHeaders {
        /// The packet's opcode.
        opcode: Opcode,
        /// Bytes needed for BTH, extension headers and ICRC.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The pad count does not match the payload length.
    BadPadCount {
        /// PadCnt from the BTH.
        pad: u8,
        /// Payload bytes including padding.
        payload: usize,
    },
    /// An opcode that carries no payload has payload bytes.
    UnexpectedPayload {
        /// The packet's opcode.
        opcode: Opcode,
        /// Payload bytes found.
        len: usize,
    },
    /// The AETH syndrome is in a reserved range.
    ReservedSyndrome(u8),
    /// A bundle (see [`parse_bundle`]) is cut short, holds a packet too short to be one, or
    /// one for another QP, at byte `at`.
    BadBundle {
        /// Where the defect is.
        at: usize,
        /// The bundle's length.
        len: usize,
    },
    /// The invariant CRC does not match the packet's contents.
    BadIcrc {
        /// The ICRC carried by the packet.
        found: u32,
        /// The ICRC computed over the packet.
        computed: u32,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::TooShort { len } => {
                write!(
                    f,
                    "RoCE packet of {len} bytes is shorter than BTH + ICRC (16 bytes)"
                )
            }
            Self::Misaligned { len } => {
                write!(f, "RoCE packet length {len} is not a multiple of 4")
            }
            Self::BadTransportVersion(v) => {
                write!(f, "BTH transport header version is {v}, must be 0")
            }
            Self::UnsupportedOpcode(op) => {
                write!(f, "BTH opcode {op:#04x} is not a supported RC opcode")
            }
            Self::TruncatedHeaders { opcode, need, have } => write!(
                f,
                "{opcode} needs {need} bytes of headers and ICRC, the packet has {have}"
            ),
            Self::BadPadCount { pad, payload } => write!(
                f,
                "BTH pad count {pad} does not fit a padded payload of {payload} bytes"
            ),
            Self::UnexpectedPayload { opcode, len } => {
                write!(
                    f,
                    "{opcode} carries no payload, but {len} bytes follow its headers"
                )
            }
            Self::ReservedSyndrome(s) => write!(f, "AETH syndrome {s:#04x} is reserved"),
            Self::BadBundle { at, len } => {
                write!(f, "bundle of {len} bytes is malformed at byte {at}")
            }
            Self::BadIcrc { found, computed } => write!(
                f,
                "ICRC mismatch: packet carries {found:#010x}, contents give {computed:#010x}"
            ),
        }
    }
}

impl std::error::Error for Error {}
