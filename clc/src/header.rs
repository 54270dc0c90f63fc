//! The 8-byte CLC header, the 4-byte trailer, and the [`Packet`] view over one whole message.

use crate::Error;
use core::fmt;

/// `"SMCR"` in EBCDIC.
pub const EYECATCHER_SMCR: [u8; 4] = [0xe2, 0xd4, 0xc3, 0xd9];
/// `"SMCD"` in EBCDIC.
pub const EYECATCHER_SMCD: [u8; 4] = [0xe2, 0xd4, 0xc3, 0xc4];
/// Header length.
pub const HEADER_LEN: usize = 8;
/// Trailer length.
pub const TRAILER_LEN: usize = 4;

/// Which eye catcher frames a message. Linux accepts either on any message type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Eyecatcher {
    /// `E2 D4 C3 D9`, "SMCR".
    #[default]
    SmcR,
    /// `E2 D4 C3 C4`, "SMCD".
    SmcD,
}

impl Eyecatcher {
    /// The four bytes.
    pub const fn bytes(self) -> [u8; 4] {
        match self {
            Self::SmcR => EYECATCHER_SMCR,
            Self::SmcD => EYECATCHER_SMCD,
        }
    }

    /// Recognises the four bytes.
    pub fn from_bytes(b: [u8; 4]) -> Option<Self> {
        match b {
            EYECATCHER_SMCR => Some(Self::SmcR),
            EYECATCHER_SMCD => Some(Self::SmcD),
            _ => None,
        }
    }
}

/// CLC message type (header byte 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    /// Client → server: what the client offers.
    Proposal = 1,
    /// Server → client: what the server chose, with its RDMA resources.
    Accept = 2,
    /// Client → server: the client's RDMA resources.
    Confirm = 3,
    /// Either side: no SMC, fall back to TCP.
    Decline = 4,
}

impl MsgType {
    /// Recognises a type byte.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Proposal),
            2 => Some(Self::Accept),
            3 => Some(Self::Confirm),
            4 => Some(Self::Decline),
            _ => None,
        }
    }
}

impl fmt::Display for MsgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Proposal => "Proposal",
            Self::Accept => "Accept",
            Self::Confirm => "Confirm",
            Self::Decline => "Decline",
        })
    }
}

/// The 2-bit SMC type of header byte 7 (`typev1`, `typev2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmcType {
    /// SMC-R only.
    R = 0,
    /// SMC-D only.
    D = 1,
    /// Neither.
    None = 2,
    /// Both SMC-R and SMC-D.
    Both = 3,
}

impl SmcType {
    /// From the two low bits of `b`.
    pub const fn from_bits(b: u8) -> Self {
        match b & 3 {
            0 => Self::R,
            1 => Self::D,
            2 => Self::None,
            _ => Self::Both,
        }
    }

    /// Whether SMC-R is included.
    pub const fn has_r(self) -> bool {
        matches!(self, Self::R | Self::Both)
    }

    /// Whether SMC-D is included.
    pub const fn has_d(self) -> bool {
        matches!(self, Self::D | Self::Both)
    }
}

impl fmt::Display for SmcType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::R => "R",
            Self::D => "D",
            Self::None => "none",
            Self::Both => "R+D",
        })
    }
}

/// A view over one whole CLC message (header through trailer), smoltcp style.
///
/// [`Packet::new_checked`] validates the header (eye catcher, known type, version ≥ 1) and that
/// the length field equals the buffer length; after it succeeds no accessor can panic. It does
/// not check the trailer: Linux skips that for Declines; [`Packet::check_trailer`] does it.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checks (for emitting into a buffer sized by the caller).
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a buffer holding exactly one message, checking the header.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks everything [`Packet::new_checked`] promises.
    pub fn check_len(&self) -> Result<(), Error> {
        let b = self.buffer.as_ref();
        let expected = message_len(b)?;
        if expected != b.len() {
            return Err(Error::LengthMismatch {
                field: expected,
                actual: b.len(),
            });
        }
        Ok(())
    }

    /// Checks that the trailer repeats the header's eye catcher.
    pub fn check_trailer(&self) -> Result<(), Error> {
        let t = self.trailer();
        if t != self.eyecatcher_bytes() {
            return Err(Error::BadTrailer(t));
        }
        Ok(())
    }

    /// The whole message.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Header bytes 0–3.
    pub fn eyecatcher_bytes(&self) -> [u8; 4] {
        let b = self.buffer.as_ref();
        [b[0], b[1], b[2], b[3]]
    }

    /// The eye catcher (checked).
    pub fn eyecatcher(&self) -> Eyecatcher {
        Eyecatcher::from_bytes(self.eyecatcher_bytes()).unwrap_or_default()
    }

    /// Message type (checked).
    pub fn msg_type(&self) -> MsgType {
        MsgType::from_byte(self.buffer.as_ref()[4]).unwrap_or(MsgType::Decline)
    }

    /// The length field: the whole message in bytes.
    pub fn length(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[5], b[6]])
    }

    /// The SMC version (high nibble of byte 7).
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[7] >> 4
    }

    /// Byte 7 bits 3–2: `typev2` in a Proposal; bit 3 is the first-contact flag in an
    /// Accept/Confirm and the out-of-sync flag in a Decline.
    pub fn typev2_bits(&self) -> u8 {
        (self.buffer.as_ref()[7] >> 2) & 3
    }

    /// Byte 7 bits 1–0: `typev1`.
    pub fn typev1_bits(&self) -> u8 {
        self.buffer.as_ref()[7] & 3
    }

    /// Everything between header and trailer.
    pub fn body(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[HEADER_LEN..b.len() - TRAILER_LEN]
    }

    /// The last four bytes.
    pub fn trailer(&self) -> [u8; 4] {
        let b = self.buffer.as_ref();
        let n = b.len();
        [b[n - 4], b[n - 3], b[n - 2], b[n - 1]]
    }
}

/// Reads a CLC header from the start of a byte stream and returns the whole message's length,
/// as Linux does before reading the rest (`smc_clc_wait_msg` peeks exactly 8 bytes). Fails on
/// fewer than 8 bytes, an unknown eye catcher or type, version 0, or a length shorter than a
/// header plus trailer.
pub fn message_len(header: &[u8]) -> Result<usize, Error> {
    if header.len() < HEADER_LEN {
        return Err(Error::TooShort { len: header.len() });
    }
    let ec = [header[0], header[1], header[2], header[3]];
    if Eyecatcher::from_bytes(ec).is_none() {
        return Err(Error::BadEyecatcher(ec));
    }
    if MsgType::from_byte(header[4]).is_none() {
        return Err(Error::UnknownType(header[4]));
    }
    if header[7] >> 4 == 0 {
        return Err(Error::BadVersion(0));
    }
    let len = usize::from(u16::from_be_bytes([header[5], header[6]]));
    if len < HEADER_LEN + TRAILER_LEN {
        return Err(Error::LengthMismatch {
            field: len,
            actual: header.len(),
        });
    }
    Ok(len)
}

/// Writes header and trailer around a body the caller has filled in.
pub(crate) fn emit_frame(buf: &mut [u8], ec: Eyecatcher, ty: MsgType, byte7: u8) {
    let len = buf.len();
    buf[0..4].copy_from_slice(&ec.bytes());
    buf[4] = ty as u8;
    buf[5..7].copy_from_slice(&(len as u16).to_be_bytes());
    buf[7] = byte7;
    buf[len - 4..].copy_from_slice(&ec.bytes());
}
