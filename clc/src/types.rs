//! Small wire types shared by CLC and LLC: peer IDs, GIDs, MACs, EIDs and host names, the
//! IB MTU enumeration and the compressed RMB size.

use core::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The 8-byte system identifier a peer sends in CLC messages (Linux: 2 random bytes followed
/// by the MAC of its first RoCE port). Peers only compare it for equality.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PeerId(pub [u8; 8]);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A 16-byte RoCE GID. RoCE v2 GIDs of IPv4 addresses are IPv4-mapped IPv6 addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The RoCE v2 GID of an IPv4 address (`::ffff:a.b.c.d`).
    pub fn from_ipv4(addr: Ipv4Addr) -> Self {
        Self(addr.to_ipv6_mapped().octets())
    }

    /// The IPv4 address of an IPv4-mapped GID.
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Ipv6Addr::from(self.0))
    }
}

/// A 6-byte Ethernet MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Error from building an [`Eid`] or [`Hostname`] out of a string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Longer than the 32 bytes the field holds.
    #[error("{len} bytes is longer than the 32-byte field")]
    TooLong {
        /// Length of the string.
        len: usize,
    },
    /// A character the field does not allow.
    #[error("character {0:?} is not allowed (EIDs take A-Z, 0-9, '.' and '-')")]
    BadChar(char),
    /// Empty.
    #[error("empty name")]
    Empty,
}

fn blank_padded(s: &str) -> [u8; 32] {
    let mut out = [b' '; 32];
    out[..s.len()].copy_from_slice(s.as_bytes());
    out
}

fn fmt_blank_padded(b: &[u8; 32], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let end = b
        .iter()
        .rposition(|&c| c != b' ' && c != 0)
        .map_or(0, |i| i + 1);
    for &c in &b[..end] {
        if c.is_ascii_graphic() || c == b' ' {
            write!(f, "{}", c as char)?;
        } else {
            write!(f, "\\x{c:02x}")?;
        }
    }
    Ok(())
}

/// A 32-byte SMC Enterprise ID (user EID or system EID): ASCII, blank padded. Parsing keeps the
/// bytes as they came (Linux compares them with `memcmp`); [`Eid::new`] checks the character set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Eid(pub [u8; 32]);

impl Eid {
    /// An EID from upper-case letters, digits, '.' and '-' (what `smcr ueid add` accepts).
    pub fn new(s: &str) -> Result<Self, NameError> {
        if s.is_empty() {
            return Err(NameError::Empty);
        }
        if s.len() > 32 {
            return Err(NameError::TooLong { len: s.len() });
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '.' || *c == '-'))
        {
            return Err(NameError::BadChar(c));
        }
        Ok(Self(blank_padded(s)))
    }
}

impl fmt::Display for Eid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_blank_padded(&self.0, f)
    }
}

/// The 32-byte host name of a first-contact extension (ASCII, blank padded, truncated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hostname(pub [u8; 32]);

impl Hostname {
    /// The host name as Linux sends it: `uname -n`, truncated to 32 bytes, blank padded.
    /// Non-ASCII bytes are replaced by '?'.
    pub fn truncated(s: &str) -> Self {
        let mut out = [b' '; 32];
        for (o, c) in out.iter_mut().zip(s.bytes()) {
            *o = if c.is_ascii() { c } else { b'?' };
        }
        Self(out)
    }
}

impl fmt::Display for Hostname {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_blank_padded(&self.0, f)
    }
}

/// The InfiniBand MTU enumeration carried in 4 bits (CLC Accept/Confirm byte 50, LLC ADD LINK
/// byte 32): 1 = 256 … 5 = 4096. Other values round-trip but have no size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpMtu(u8);

impl QpMtu {
    /// 256 bytes.
    pub const MTU_256: Self = Self(1);
    /// 512 bytes.
    pub const MTU_512: Self = Self(2);
    /// 1024 bytes (rxe on a 1500-byte Ethernet).
    pub const MTU_1024: Self = Self(3);
    /// 2048 bytes.
    pub const MTU_2048: Self = Self(4);
    /// 4096 bytes.
    pub const MTU_4096: Self = Self(5);

    /// The enumeration value as found on the wire; only the low 4 bits are kept.
    pub const fn from_code(code: u8) -> Self {
        Self(code & 0x0f)
    }

    /// The 4-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }

    /// The MTU in bytes, for the five defined codes.
    pub const fn bytes(self) -> Option<u32> {
        match self.0 {
            1..=5 => Some(128 << self.0),
            _ => None,
        }
    }

    /// The code of an MTU of exactly 256, 512, 1024, 2048 or 4096 bytes.
    pub const fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            256 => Some(Self::MTU_256),
            512 => Some(Self::MTU_512),
            1024 => Some(Self::MTU_1024),
            2048 => Some(Self::MTU_2048),
            4096 => Some(Self::MTU_4096),
            _ => None,
        }
    }

    /// The largest defined MTU that fits an IP link MTU, as rxe derives its active MTU (link
    /// MTU minus 80 bytes of headers, rounded down): 1500 gives 1024, 9000 gives 4096.
    pub const fn for_link_mtu(link_mtu: u32) -> Option<Self> {
        let room = link_mtu.saturating_sub(80);
        let mut code = 5;
        while code >= 1 {
            if (128u32 << code) <= room {
                return Some(Self(code));
            }
            code -= 1;
        }
        None
    }
}

impl fmt::Display for QpMtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bytes() {
            Some(b) => write!(f, "{b}"),
            None => write!(f, "invalid({})", self.0),
        }
    }
}

/// The compressed RMB (receive buffer) size of CLC Accept/Confirm byte 50, high nibble:
/// `size = 16 KiB << code`, code 0..=15 (16 KiB … 512 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RmbSize(u8);

impl RmbSize {
    /// The smallest size, 16 KiB.
    pub const MIN_BYTES: u32 = 16 * 1024;
    /// Linux's default RMB, 64 KiB (code 2).
    pub const DEFAULT: Self = Self(2);

    /// The size for a 4-bit code as found on the wire (high bits ignored).
    pub const fn from_code(code: u8) -> Self {
        Self(code & 0x0f)
    }

    /// The 4-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }

    /// The size in bytes.
    pub const fn bytes(self) -> u32 {
        Self::MIN_BYTES << self.0
    }

    /// The smallest size that holds `bytes`, rounding up as Linux's `smc_compress_bufsize`
    /// does; sizes above 512 MiB are clamped to code 15.
    pub const fn round_up(bytes: u32) -> Self {
        if bytes <= Self::MIN_BYTES {
            return Self(0);
        }
        // floor(log2((bytes - 1) >> 14)) + 1
        let shifted = (bytes - 1) >> 14;
        let code = 32 - shifted.leading_zeros();
        if code > 15 {
            Self(15)
        } else {
            Self(code as u8)
        }
    }
}

impl fmt::Display for RmbSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bytes();
        if b >= 1 << 20 {
            write!(f, "{}MiB", b >> 20)
        } else {
            write!(f, "{}KiB", b >> 10)
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn test_rmb_size_codes() {
        let cases = [
            (0, 0),
            (1, 0),
            (16384, 0),
            (16385, 1),
            (32768, 1),
            (32769, 2),
            (65536, 2),
            (65537, 3),
            (131072, 3),
            (512 * 1024, 5),
            (512 << 20, 15),
            ((512 << 20) + 1, 15),
            (u32::MAX, 15),
        ];
        for (bytes, code) in cases {
            assert_eq!(RmbSize::round_up(bytes).code(), code, "{bytes}");
        }
        for code in 0..16u8 {
            let s = RmbSize::from_code(code);
            assert_eq!(s.bytes(), 16384 << code);
            assert_eq!(
                RmbSize::round_up(s.bytes()),
                s,
                "exact sizes encode to themselves"
            );
            assert!(RmbSize::round_up(s.bytes()).bytes() >= s.bytes());
        }
        assert_eq!(RmbSize::DEFAULT.bytes(), 65536);
        assert_eq!(RmbSize::from_code(2).to_string(), "64KiB");
        assert_eq!(RmbSize::from_code(15).to_string(), "512MiB");
    }

    #[test]
    fn test_qp_mtu_codes() {
        for (code, bytes) in [(1, 256), (2, 512), (3, 1024), (4, 2048), (5, 4096)] {
            let m = QpMtu::from_code(code);
            assert_eq!(m.bytes(), Some(bytes));
            assert_eq!(QpMtu::from_bytes(bytes), Some(m));
        }
        assert_eq!(QpMtu::from_code(0).bytes(), None);
        assert_eq!(QpMtu::from_code(6).bytes(), None);
        assert_eq!(QpMtu::from_bytes(1500), None);
        assert_eq!(QpMtu::for_link_mtu(1500), Some(QpMtu::MTU_1024));
        assert_eq!(QpMtu::for_link_mtu(9000), Some(QpMtu::MTU_4096));
        assert_eq!(QpMtu::for_link_mtu(65536), Some(QpMtu::MTU_4096));
        assert_eq!(QpMtu::for_link_mtu(336), Some(QpMtu::MTU_256));
        assert_eq!(QpMtu::for_link_mtu(335), None);
        assert_eq!(QpMtu::from_code(0x13), QpMtu::MTU_1024, "high bits ignored");
    }

    #[test]
    fn test_names() {
        assert_eq!(
            Eid::new("SMC-KERNEL-PEER").unwrap().to_string(),
            "SMC-KERNEL-PEER"
        );
        assert_eq!(Eid::new("lower"), Err(NameError::BadChar('l')));
        assert_eq!(Eid::new(""), Err(NameError::Empty));
        assert!(matches!(
            Eid::new(&"A".repeat(33)),
            Err(NameError::TooLong { len: 33 })
        ));
        assert_eq!(
            Hostname::truncated(&"h".repeat(40)).to_string(),
            "h".repeat(32)
        );
        let g = Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, 2));
        assert_eq!(g.to_string(), "::ffff:10.77.0.2");
        assert_eq!(g.to_ipv4(), Some(Ipv4Addr::new(10, 77, 0, 2)));
        assert_eq!(
            Mac([0x52, 0x54, 0, 0x77, 0, 2]).to_string(),
            "52:54:00:77:00:02"
        );
    }
}
