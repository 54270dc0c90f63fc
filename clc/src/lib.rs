//! CLC (Connection Layer Control) messages of SMC-R, byte-exact with the Linux kernel, and the
//! small wire types CLC and LLC share.
//!
//! CLC messages travel in the TCP stream of the connection being upgraded: Proposal (client),
//! Accept (server), Confirm (client), or a Decline from either side. Layouts follow Linux's
//! net/smc/smc_clc.h (see docs/protocol.md); every message of a real Linux 6.12 SMC-Rv2
//! session parses and re-emits byte for byte (tests/kernel_capture.rs).
//!
//! Style (smoltcp): [`Packet`] is a checked view over one whole message; [`Message`] and the
//! per-type representations own their fields and have `parse`, `emit` and `buffer_len`.
//! Parsing never panics: each defect is its own [`Error`] variant. Reserved bytes are ignored
//! when parsing and written as zero. Where Linux is lenient (either eye catcher in a trailer,
//! v2 Accept/Confirm longer than known) so is this crate; where Linux rejects a message
//! (`EPROTO`) this crate returns an error.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod accept;
mod decline;
mod header;
mod message;
mod proposal;
mod reason;
mod types;

pub use accept::{
    AcceptBody, AcceptConfirm, FCE_LEN, FirstContactExt, Role, SMCD_V1_LEN, SMCD_V2_MIN_LEN,
    SMCR_V1_LEN, SMCR_V2_LEN, SmcrAcceptConfirm, SmcrV2,
};
pub use decline::{DECLINE_V1_LEN, DECLINE_V2_LEN, Decline};
pub use header::{
    EYECATCHER_SMCD, EYECATCHER_SMCR, Eyecatcher, HEADER_LEN, MsgType, Packet, SmcType,
    TRAILER_LEN, message_len,
};
pub use message::Message;
pub use proposal::{
    IpPrefixArea, MAX_EIDS, MAX_IPV6_PREFIXES, MAX_ISM_GIDS, Proposal, SmcdInfo, SmcdV2Extension,
    V2Extension,
};
pub use reason::DeclineReason;
pub use types::{Eid, Gid, Hostname, Mac, NameError, PeerId, QpMtu, RmbSize};

/// Why a CLC message could not be decoded. Each variant names one defect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Fewer bytes than a CLC header.
    #[error("CLC message too short: {len} bytes, a header alone is 8")]
    TooShort {
        /// Bytes present.
        len: usize,
    },
    /// The header does not start with "SMCR" or "SMCD" in EBCDIC.
    #[error(
        "not a CLC message: eye catcher {0:02x?} is neither SMCR (e2d4c3d9) nor SMCD (e2d4c3c4)"
    )]
    BadEyecatcher([u8; 4]),
    /// The trailer is not an eye catcher.
    #[error("CLC trailer {0:02x?} is not an SMCR/SMCD eye catcher")]
    BadTrailer([u8; 4]),
    /// Header byte 4 is not 1–4.
    #[error("unknown CLC message type {0}")]
    UnknownType(u8),
    /// Header version 0.
    #[error("CLC version {0} is not valid (must be 1 or more)")]
    BadVersion(u8),
    /// The length field disagrees with the bytes given (or is shorter than header + trailer).
    #[error("CLC length field says {field} bytes but the message has {actual}")]
    LengthMismatch {
        /// The header's length field.
        field: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The length does not match what the message's contents require.
    #[error("CLC {msg} is {found} bytes long; its contents need {expected}")]
    BadLength {
        /// Message type.
        msg: MsgType,
        /// Length the contents imply.
        expected: usize,
        /// Length found.
        found: usize,
    },
    /// A field lies beyond the end of the message.
    #[error("CLC message ends inside the {what} (needs {need} bytes, has {have})")]
    Truncated {
        /// Which part.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// A version-1 Proposal that offers no v1 variant.
    #[error("CLC Proposal v1 offers no SMC variant")]
    NothingOffered,
    /// `iparea_offset` is neither 0 nor 40 (or above 40).
    #[error("CLC Proposal iparea_offset {0} is invalid (0 or 40)")]
    BadIpAreaOffset(u16),
    /// A v2 Proposal without the SMC-D / v2 info area that holds `v2_ext_offset`.
    #[error("CLC Proposal offers v2 but has no SMC-D/v2 info area")]
    MissingSmcdArea,
    /// `v2_ext_offset` does not point right after the prefix area.
    #[error("CLC Proposal v2_ext_offset is {found}, expected {expected}")]
    BadV2ExtOffset {
        /// Offset the layout implies.
        expected: usize,
        /// Offset found.
        found: u16,
    },
    /// `smcd_v2_ext_offset` does not point right after the EIDs.
    #[error("CLC Proposal smcd_v2_ext_offset is {found}, expected {expected}")]
    BadSmcdV2ExtOffset {
        /// Offset the layout implies.
        expected: usize,
        /// Offset found.
        found: u16,
    },
    /// More than 8 IPv6 prefixes.
    #[error("CLC Proposal lists {0} IPv6 prefixes (at most 8)")]
    TooManyIpv6Prefixes(u8),
    /// More than 8 user EIDs.
    #[error("CLC Proposal lists {0} user EIDs (at most 8)")]
    TooManyEids(u8),
    /// More than 8 ISM GIDs.
    #[error("CLC Proposal lists {0} ISM GIDs (at most 8)")]
    TooManyIsmGids(u8),
    /// An Accept/Confirm whose chosen variant is neither SMC-R nor SMC-D.
    #[error("CLC {msg} chose variant {typev1} (must be 0 = SMC-R or 1 = SMC-D)")]
    BadChosenType {
        /// Message type.
        msg: MsgType,
        /// typev1 bits found.
        typev1: u8,
    },
}

/// Checked big-endian reads: every out-of-range read is an [`Error::Truncated`].
struct Rd<'a> {
    b: &'a [u8],
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8]) -> Self {
        Self { b }
    }

    fn need(&self, end: usize, what: &'static str) -> Result<(), Error> {
        // The trailer is not part of any field.
        let have = self.b.len().saturating_sub(TRAILER_LEN);
        if end > have {
            return Err(Error::Truncated {
                what,
                need: end + TRAILER_LEN,
                have: self.b.len(),
            });
        }
        Ok(())
    }

    fn arr<const N: usize>(&self, at: usize, what: &'static str) -> Result<[u8; N], Error> {
        self.need(at + N, what)?;
        let mut out = [0; N];
        out.copy_from_slice(&self.b[at..at + N]);
        Ok(out)
    }

    fn u8(&self, at: usize, what: &'static str) -> Result<u8, Error> {
        Ok(self.arr::<1>(at, what)?[0])
    }

    fn be16(&self, at: usize, what: &'static str) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(self.arr(at, what)?))
    }

    fn be24(&self, at: usize, what: &'static str) -> Result<u32, Error> {
        let [a, b, c] = self.arr(at, what)?;
        Ok(u32::from_be_bytes([0, a, b, c]))
    }

    fn be32(&self, at: usize, what: &'static str) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.arr(at, what)?))
    }

    fn be64(&self, at: usize, what: &'static str) -> Result<u64, Error> {
        Ok(u64::from_be_bytes(self.arr(at, what)?))
    }
}

/// Writes into a buffer sized by `buffer_len()`.
struct Wr<'a> {
    b: &'a mut [u8],
}

impl<'a> Wr<'a> {
    fn new(b: &'a mut [u8]) -> Self {
        Self { b }
    }

    fn put(&mut self, at: usize, bytes: &[u8]) {
        self.b[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests;
