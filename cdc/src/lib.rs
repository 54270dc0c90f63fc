//! The SMC-R CDC (Connection Data Control) message and the cursor arithmetic of RMB rings,
//! byte-exact with the Linux kernel (net/smc/smc_cdc.h).
//!
//! A CDC message is a 44-byte RDMA SEND that follows the RDMA WRITEs of a connection's data. It
//! carries the connection's sequence number, the receiver's alert token, the producer cursor
//! (how far the sender has written into the receiver's RMB), the consumer cursor (how far the
//! sender's application has read its own RMB), and the producer and connection-state flags.
//!
//! Cursors are `(wrap, count)` pairs in a ring of `size` bytes: `count` in `0..size`, `wrap`
//! counting (mod 2^16) how often `count` went round. [`Cursor::diff`], [`Cursor::comp`],
//! [`Cursor::advance`] and [`Cursor::moved_backwards`] are Linux's `smc_curs_diff`,
//! `smc_curs_comp`, `smc_curs_add` and the check in `smc_cdc_cursor_to_host`; [`seq_before`] is
//! `smc_cdc_before`. The connection code leans on them, so their laws are property-tested.
//!
//! Style (smoltcp): [`Packet`] is a view with checked accessors and setters; [`CdcMessage`] is
//! the owned form with `parse`, `emit` and `buffer_len`. Parsing never panics.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use core::cmp::Ordering;
use core::fmt;

/// Length of a CDC message.
pub const CDC_LEN: usize = 44;
/// Fewest bytes Linux processes (everything after byte 25 is reserved).
pub const CDC_MIN_LEN: usize = 26;
/// The type byte that marks CDC (LLC messages use other values).
pub const CDC_TYPE: u8 = 0xfe;

bitflags::bitflags! {
    /// Producer flags (byte 24).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct ProducerFlags: u8 {
        /// The sender has more data than the receiver's free space.
        const WRITE_BLOCKED = 0x80;
        /// Urgent data is pending.
        const URG_DATA_PENDING = 0x40;
        /// Urgent data is present (the byte before the producer cursor).
        const URG_DATA_PRESENT = 0x20;
        /// The sender asks for a consumer-cursor update now.
        const CONS_CURS_UPD_REQ = 0x10;
        /// Failover validation: carries the sequence number of the last completed CDC.
        const FAILOVER_VALIDATION = 0x08;
    }
}

bitflags::bitflags! {
    /// Connection state flags (byte 25). Sticky: once sent, kept in every later CDC.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct ConnStateFlags: u8 {
        /// Peer done writing (shutdown write, FIN-like).
        const PEER_DONE_WRITING = 0x80;
        /// Peer connection closed.
        const PEER_CONN_CLOSED = 0x40;
        /// Peer aborted (RST-like): the reader gets ECONNRESET.
        const PEER_CONN_ABORT = 0x20;
    }
}

/// Why bytes are not a CDC message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The first byte is not 0xFE.
    #[error("not a CDC message: type byte {0:#04x} (CDC is 0xfe)")]
    NotCdc(u8),
    /// Fewer than 26 bytes.
    #[error("CDC message too short: {len} bytes, at least 26 needed")]
    TooShort {
        /// Bytes present.
        len: usize,
    },
    /// Byte 1 is not 44.
    #[error("CDC length byte is {0}, must be 44")]
    BadLength(u8),
}

/// A position in an RMB ring: `count` bytes into the buffer after `wrap` rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cursor {
    /// Rounds completed, mod 2^16.
    pub wrap: u16,
    /// Offset in the ring, `0..size`.
    pub count: u32,
}

impl Cursor {
    /// A cursor.
    pub const fn new(wrap: u16, count: u32) -> Self {
        Self { wrap, count }
    }

    /// The cursor moved on by `n` bytes in a ring of `size` bytes (Linux `smc_curs_add`,
    /// generalised to any `n`). A cursor that ends exactly at the end has count 0 and the next
    /// wrap.
    pub fn advance(self, n: u32, size: u32) -> Self {
        debug_assert!(size > 0 && self.count < size);
        let total = u64::from(self.count) + u64::from(n);
        let size = u64::from(size.max(1));
        Self {
            wrap: self.wrap.wrapping_add((total / size) as u16),
            count: (total % size) as u32,
        }
    }

    /// Bytes from `old` to `new` in a ring of `size` (Linux `smc_curs_diff`): cursors of one
    /// ring are at most one ring apart, so a different wrap means `new` went round once.
    /// Never negative: 0 if `new` is behind `old`.
    pub fn diff(size: u32, old: Self, new: Self) -> u32 {
        let (size, oc, nc) = (i64::from(size), i64::from(old.count), i64::from(new.count));
        let d = if old.wrap != new.wrap {
            size - oc + nc
        } else {
            nc - oc
        };
        d.clamp(0, i64::from(u32::MAX)) as u32
    }

    /// Signed distance from `old` to `new` (Linux `smc_curs_comp`): negative when `new` is
    /// behind `old`.
    pub fn comp(size: u32, old: Self, new: Self) -> i64 {
        if old.wrap > new.wrap || (old.wrap == new.wrap && old.count > new.count) {
            -i64::from(Self::diff(size, new, old))
        } else {
            i64::from(Self::diff(size, old, new))
        }
    }

    /// Whether a received cursor moved backwards and must be ignored, exactly as Linux's
    /// `smc_cdc_cursor_to_host` decides: an older wrap (unless the new wrap is 0, i.e. the wrap
    /// counter went round), or the same wrap with a smaller count.
    pub fn moved_backwards(old: Self, new: Self) -> bool {
        (old.wrap > new.wrap && new.wrap != 0) || (old.wrap == new.wrap && old.count > new.count)
    }

    /// Wrap-aware order of two cursors of one ring: wraps compared with 16-bit serial
    /// arithmetic (a wrap up to 2^15 − 1 rounds ahead is later), then counts.
    pub fn serial_cmp(self, other: Self) -> Ordering {
        match (self.wrap.wrapping_sub(other.wrap) as i16).cmp(&0) {
            Ordering::Equal => self.count.cmp(&other.count),
            o => o,
        }
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.wrap, self.count)
    }
}

/// Whether CDC sequence number `a` is older than `b` (Linux `smc_cdc_before`, 16-bit serial
/// arithmetic). A receiver drops CDCs older than the last accepted one; equal is accepted.
pub fn seq_before(a: u16, b: u16) -> bool {
    (a.wrapping_sub(b) as i16) < 0
}

mod field {
    pub(crate) const TYPE: usize = 0;
    pub(crate) const LEN: usize = 1;
    pub(crate) const SEQ: core::ops::Range<usize> = 2..4;
    pub(crate) const TOKEN: core::ops::Range<usize> = 4..8;
    pub(crate) const PROD: usize = 8;
    pub(crate) const CONS: usize = 16;
    pub(crate) const PROD_FLAGS: usize = 24;
    pub(crate) const CONN_FLAGS: usize = 25;
}

/// A view over a CDC message.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checks (for emitting into a buffer of [`CDC_LEN`] bytes).
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a received SEND payload: type 0xFE, at least 26 bytes, length byte 44. After this
    /// no accessor panics.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks what [`Packet::new_checked`] promises.
    pub fn check_len(&self) -> Result<(), Error> {
        let b = self.buffer.as_ref();
        match b.first() {
            Some(&CDC_TYPE) => {}
            Some(&t) => return Err(Error::NotCdc(t)),
            None => return Err(Error::TooShort { len: 0 }),
        }
        if b.len() < CDC_MIN_LEN {
            return Err(Error::TooShort { len: b.len() });
        }
        if b[field::LEN] as usize != CDC_LEN {
            return Err(Error::BadLength(b[field::LEN]));
        }
        Ok(())
    }

    fn cursor(&self, at: usize) -> Cursor {
        let b = self.buffer.as_ref();
        Cursor {
            wrap: u16::from_be_bytes([b[at + 2], b[at + 3]]),
            count: u32::from_be_bytes([b[at + 4], b[at + 5], b[at + 6], b[at + 7]]),
        }
    }

    /// Sequence number.
    pub fn seq(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[2], b[3]])
    }

    /// The receiver's alert token.
    pub fn token(&self) -> u32 {
        let b = self.buffer.as_ref();
        u32::from_be_bytes([b[4], b[5], b[6], b[7]])
    }

    /// Producer cursor.
    pub fn prod(&self) -> Cursor {
        self.cursor(field::PROD)
    }

    /// Consumer cursor.
    pub fn cons(&self) -> Cursor {
        self.cursor(field::CONS)
    }

    /// Producer flags (unknown bits kept).
    pub fn prod_flags(&self) -> ProducerFlags {
        ProducerFlags::from_bits_retain(self.buffer.as_ref()[field::PROD_FLAGS])
    }

    /// Connection state flags (unknown bits kept).
    pub fn conn_flags(&self) -> ConnStateFlags {
        ConnStateFlags::from_bits_retain(self.buffer.as_ref()[field::CONN_FLAGS])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_cursor(&mut self, at: usize, c: Cursor) {
        let b = self.buffer.as_mut();
        b[at..at + 2].fill(0);
        b[at + 2..at + 4].copy_from_slice(&c.wrap.to_be_bytes());
        b[at + 4..at + 8].copy_from_slice(&c.count.to_be_bytes());
    }

    /// Writes type, length and zeroes every reserved byte.
    pub fn init(&mut self) {
        let b = self.buffer.as_mut();
        b[..CDC_LEN].fill(0);
        b[field::TYPE] = CDC_TYPE;
        b[field::LEN] = CDC_LEN as u8;
    }

    /// Sets the sequence number.
    pub fn set_seq(&mut self, seq: u16) {
        self.buffer.as_mut()[field::SEQ].copy_from_slice(&seq.to_be_bytes());
    }

    /// Sets the alert token.
    pub fn set_token(&mut self, token: u32) {
        self.buffer.as_mut()[field::TOKEN].copy_from_slice(&token.to_be_bytes());
    }

    /// Sets the producer cursor.
    pub fn set_prod(&mut self, c: Cursor) {
        self.set_cursor(field::PROD, c);
    }

    /// Sets the consumer cursor.
    pub fn set_cons(&mut self, c: Cursor) {
        self.set_cursor(field::CONS, c);
    }

    /// Sets the producer flags.
    pub fn set_prod_flags(&mut self, f: ProducerFlags) {
        self.buffer.as_mut()[field::PROD_FLAGS] = f.bits();
    }

    /// Sets the connection state flags.
    pub fn set_conn_flags(&mut self, f: ConnStateFlags) {
        self.buffer.as_mut()[field::CONN_FLAGS] = f.bits();
    }
}

/// A CDC message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CdcMessage {
    /// Per-connection sequence number (1 for the first CDC, +1 each, mod 2^16).
    pub seq: u16,
    /// The receiver's alert token (from its Accept/Confirm).
    pub token: u32,
    /// How far the sender has written into the receiver's RMB.
    pub prod: Cursor,
    /// How far the sender's application has consumed its own RMB.
    pub cons: Cursor,
    /// Producer flags.
    pub prod_flags: ProducerFlags,
    /// Connection state flags.
    pub conn_flags: ConnStateFlags,
}

impl CdcMessage {
    /// Parses a received SEND payload. Never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let p = Packet::new_checked(bytes)?;
        Ok(Self {
            seq: p.seq(),
            token: p.token(),
            prod: p.prod(),
            cons: p.cons(),
            prod_flags: p.prod_flags(),
            conn_flags: p.conn_flags(),
        })
    }

    /// Always 44.
    pub const fn buffer_len(&self) -> usize {
        CDC_LEN
    }

    /// Writes the message into `buf` (at least 44 bytes; the first 44 are written).
    pub fn emit(&self, buf: &mut [u8]) {
        let mut p = Packet::new_unchecked(buf);
        p.init();
        p.set_seq(self.seq);
        p.set_token(self.token);
        p.set_prod(self.prod);
        p.set_cons(self.cons);
        p.set_prod_flags(self.prod_flags);
        p.set_conn_flags(self.conn_flags);
    }

    /// The message as bytes.
    pub fn to_bytes(&self) -> [u8; CDC_LEN] {
        let mut b = [0; CDC_LEN];
        self.emit(&mut b);
        b
    }
}

fn fmt_flags<F: bitflags::Flags>(f: &mut fmt::Formatter<'_>, flags: F) -> fmt::Result
where
    F::Bits: fmt::LowerHex,
{
    let mut first = true;
    for (name, _) in flags.iter_names() {
        write!(f, "{}{name}", if first { "" } else { "|" })?;
        first = false;
    }
    let rest = F::from_bits_retain(flags.bits()).difference(F::from_bits_truncate(flags.bits()));
    if !rest.is_empty() {
        write!(f, "{}{:#x}", if first { "" } else { "|" }, rest.bits())?;
        first = false;
    }
    if first {
        f.write_str("-")?;
    }
    Ok(())
}

impl fmt::Display for CdcMessage {
    /// `CDC seq=1 token=0x1 prod=0:16 cons=0:0 flags=- state=-`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CDC seq={} token={:#x} prod={} cons={} flags=",
            self.seq, self.token, self.prod, self.cons
        )?;
        fmt_flags(f, self.prod_flags)?;
        f.write_str(" state=")?;
        fmt_flags(f, self.conn_flags)
    }
}

#[cfg(test)]
mod tests;
