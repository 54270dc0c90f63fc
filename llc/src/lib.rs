//! LLC (Link Layer Control) messages of SMC-R, byte-exact with the Linux kernel.
//!
//! LLC messages travel as RDMA SENDs on a link's queue pair and manage links and rkeys:
//! CONFIRM LINK, ADD LINK (+ CONTINUATION), DELETE LINK, REQUEST ADD LINK (v2), CONFIRM RKEY
//! (+ CONTINUATION), DELETE RKEY and TEST LINK. In a v1 link group every message is 44 bytes
//! with the type in byte 0 and 44 in byte 1; in a v2 link group byte 0 is `0x20 | type` and
//! bytes 1–2 hold the total length, which x86 Linux writes **little-endian** (so a 44-byte
//! message still starts `2X 2C 00`). This crate writes it little-endian like Linux and accepts
//! what x86 Linux accepts (the field read little-endian is at least 44 — a big-endian length
//! passes too); sizes of variable messages come from their counts and the received bytes,
//! never from that field. ADD LINK's rkey count, also in CPU order, is read little-endian
//! unless only the big-endian reading fits the received bytes. The first byte `0xFE` marks a CDC message instead
//! ([`Error::NotLlc`]).
//!
//! Style (smoltcp): [`Packet`] is a checked view over the header; [`LlcMessage`] owns the
//! fields and has `parse`, `emit` and `buffer_len`. Parsing never panics; each defect has its
//! own [`Error`] variant. Reserved bytes are ignored and written as zero.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use clc::{Gid, Mac, QpMtu};
use core::fmt;

mod messages;
pub use messages::*;

/// Length of every v1 message and of the fixed part of every v2 message.
pub const LLC_LEN: usize = 44;
/// First byte of a CDC message, which shares the SEND channel with LLC.
pub const CDC_TYPE: u8 = 0xfe;
/// Flag bit of a response (all types).
pub const FLAG_RESPONSE: u8 = 0x80;
/// Most rkey entries Linux takes from an ADD LINK v2 extension.
pub const MAX_ADD_LINK_RKEYS: usize = 255;
/// Most rkeys in a v1 DELETE RKEY.
pub const MAX_DELETE_RKEYS_V1: usize = 8;

/// LLC message format of a link group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Version {
    /// SMC-Rv1: 44 bytes, length in byte 1.
    V1,
    /// SMC-Rv2: type `0x2X`, 16-bit length in bytes 1–2.
    V2,
}

/// LLC message type (low nibble of byte 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LlcType {
    /// Confirms a new link (server request, client response).
    ConfirmLink = 1,
    /// Adds a link to the link group.
    AddLink = 2,
    /// v1: rkey exchange for a new link.
    AddLinkCont = 3,
    /// Deletes a link or the whole link group.
    DeleteLink = 4,
    /// v2: the client asks the server to run ADD LINK.
    RequestAddLink = 5,
    /// Announces a new RMB's rkeys.
    ConfirmRkey = 6,
    /// Keepalive.
    TestLink = 7,
    /// v1: more rtokens of a CONFIRM RKEY (never sent by Linux).
    ConfirmRkeyCont = 8,
    /// Retracts RMB rkeys.
    DeleteRkey = 9,
}

impl LlcType {
    fn from_nibble(n: u8, version: Version) -> Option<Self> {
        Some(match (n, version) {
            (1, _) => Self::ConfirmLink,
            (2, _) => Self::AddLink,
            (3, Version::V1) => Self::AddLinkCont,
            (4, _) => Self::DeleteLink,
            (5, Version::V2) => Self::RequestAddLink,
            (6, _) => Self::ConfirmRkey,
            (7, _) => Self::TestLink,
            (8, Version::V1) => Self::ConfirmRkeyCont,
            (9, _) => Self::DeleteRkey,
            _ => return None,
        })
    }

    /// Linux's name, e.g. `CONFIRM_LINK`.
    pub fn name(self) -> &'static str {
        match self {
            Self::ConfirmLink => "CONFIRM_LINK",
            Self::AddLink => "ADD_LINK",
            Self::AddLinkCont => "ADD_LINK_CONT",
            Self::DeleteLink => "DELETE_LINK",
            Self::RequestAddLink => "REQ_ADD_LINK",
            Self::ConfirmRkey => "CONFIRM_RKEY",
            Self::TestLink => "TEST_LINK",
            Self::ConfirmRkeyCont => "CONFIRM_RKEY_CONT",
            Self::DeleteRkey => "DELETE_RKEY",
        }
    }
}

/// Why an LLC message could not be decoded. Each variant names one defect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Fewer than 44 bytes.
    #[error("LLC message too short: {len} bytes, at least 44 needed")]
    TooShort {
        /// Bytes present.
        len: usize,
    },
    /// It is a CDC message (first byte 0xFE).
    #[error("not LLC: first byte 0xfe marks a CDC message")]
    NotLlc,
    /// The high nibble of byte 0 is neither 0 (v1) nor 2 (v2).
    #[error("unknown LLC version nibble {0:#x} in type byte")]
    UnknownVersion(u8),
    /// A type byte without a message of that version (Linux drops these silently).
    #[error("unknown LLC type byte {0:#04x}")]
    UnknownType(u8),
    /// A v1 message whose byte 1 is not 44, or a v1 message not exactly 44 bytes long.
    #[error("LLC v1 length is {field} (message has {actual} bytes); v1 messages are exactly 44")]
    BadV1Length {
        /// Byte 1.
        field: u8,
        /// Bytes present.
        actual: usize,
    },
    /// A v2 length field below 44 (read little-endian, as x86 Linux does).
    #[error("LLC v2 length field {0:02x?} is below 44")]
    BadV2Length([u8; 2]),
    /// A v2 extension is cut short.
    #[error("LLC {msg} needs {need} bytes, has {have}")]
    Truncated {
        /// Which part.
        msg: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// A count implies more bytes than the message has.
    #[error("LLC {msg} lists {count} {what} but has room for {room}")]
    CountTooLarge {
        /// Message type.
        msg: &'static str,
        /// What is counted.
        what: &'static str,
        /// Count found.
        count: usize,
        /// How many fit in the received bytes.
        room: usize,
    },
}

/// A view over an LLC message's header.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checks.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a received SEND payload, checking length, version, type and length field; after
    /// this no accessor panics.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Self::new_unchecked(buffer);
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<(Version, LlcType), Error> {
        let b = self.buffer.as_ref();
        if b.first() == Some(&CDC_TYPE) {
            return Err(Error::NotLlc);
        }
        if b.len() < LLC_LEN {
            return Err(Error::TooShort { len: b.len() });
        }
        let version = match b[0] >> 4 {
            0 => Version::V1,
            2 => Version::V2,
            v => return Err(Error::UnknownVersion(v)),
        };
        let ty = LlcType::from_nibble(b[0] & 0x0f, version).ok_or(Error::UnknownType(b[0]))?;
        match version {
            Version::V1 if b[1] as usize != LLC_LEN || b.len() != LLC_LEN => {
                return Err(Error::BadV1Length {
                    field: b[1],
                    actual: b.len(),
                });
            }
            // x86 Linux's only check: the field, read little-endian, is at least 44. A
            // big-endian 44 (`00 2C`) reads as 11264 and passes, as it does in Linux.
            Version::V2 if u16::from_le_bytes([b[1], b[2]]) < LLC_LEN as u16 => {
                return Err(Error::BadV2Length([b[1], b[2]]));
            }
            _ => {}
        }
        Ok((version, ty))
    }

    /// The format (checked).
    pub fn version(&self) -> Version {
        if self.buffer.as_ref()[0] >> 4 == 2 {
            Version::V2
        } else {
            Version::V1
        }
    }

    /// The type (checked).
    pub fn llc_type(&self) -> LlcType {
        let b = self.buffer.as_ref();
        LlcType::from_nibble(b[0] & 0x0f, self.version()).unwrap_or(LlcType::TestLink)
    }

    /// The flags byte (3).
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[3]
    }

    /// Whether the response bit is set.
    pub fn is_response(&self) -> bool {
        self.flags() & FLAG_RESPONSE != 0
    }

    /// The whole message.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }
}

/// Checked reads over the received bytes.
struct Rd<'a>(&'a [u8]);

impl Rd<'_> {
    fn arr<const N: usize>(&self, at: usize) -> [u8; N] {
        // Callers only read inside the 44 checked bytes or after checking a count.
        let mut out = [0; N];
        out.copy_from_slice(&self.0[at..at + N]);
        out
    }
    fn u8(&self, at: usize) -> u8 {
        self.0[at]
    }
    fn be24(&self, at: usize) -> u32 {
        let [a, b, c] = self.arr(at);
        u32::from_be_bytes([0, a, b, c])
    }
    fn be32(&self, at: usize) -> u32 {
        u32::from_be_bytes(self.arr(at))
    }
    fn be64(&self, at: usize) -> u64 {
        u64::from_be_bytes(self.arr(at))
    }
}

fn flag(f: u8, bit: u8) -> bool {
    f & bit != 0
}

fn bit(on: bool, bit: u8) -> u8 {
    if on { bit } else { 0 }
}

/// A 16-bit count that Linux writes in CPU order (little-endian on x86): take it little-endian
/// unless only the big-endian reading fits the received bytes.
fn cpu_order_count(b: [u8; 2], fits: impl Fn(usize) -> bool) -> usize {
    let le = usize::from(u16::from_le_bytes(b));
    let be = usize::from(u16::from_be_bytes(b));
    if !fits(le) && fits(be) { be } else { le }
}

impl LlcMessage {
    /// Parses a received SEND payload. Never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let p = Packet::new_unchecked(bytes);
        let (version, ty) = p.check()?;
        let r = Rd(bytes);
        let f = r.u8(3);
        let response = flag(f, FLAG_RESPONSE);
        let rtoken = |at: usize| Rtoken {
            link_id: r.u8(at),
            rkey: r.be32(at + 1),
            vaddr: r.be64(at + 5),
        };
        let rkey_pair = |at: usize| RkeyPair {
            rkey: r.be32(at),
            rkey_new: r.be32(at + 4),
            vaddr_new: r.be64(at + 8),
        };
        let body = match ty {
            LlcType::ConfirmLink => Llc::ConfirmLink(ConfirmLink {
                response,
                no_rmbe_eyecatcher: f & 0x03,
                mac: Mac(r.arr(4)),
                gid: Gid(r.arr(10)),
                qpn: r.be24(26),
                link_id: r.u8(29),
                link_uid: r.arr(30),
                max_links: r.u8(34),
                max_conns: r.u8(35),
            }),
            LlcType::AddLink => {
                let v2 = if version == Version::V2 && bytes.len() > LLC_LEN {
                    let room = bytes.len().saturating_sub(72) / 16;
                    if bytes.len() < 72 {
                        return Err(Error::Truncated {
                            msg: "ADD_LINK v2 extension",
                            need: 72,
                            have: bytes.len(),
                        });
                    }
                    let n = cpu_order_count(r.arr(70), |n| n <= room);
                    if n > room {
                        return Err(Error::CountTooLarge {
                            msg: "ADD_LINK",
                            what: "rkeys",
                            count: n,
                            room,
                        });
                    }
                    Some(AddLinkV2Ext {
                        v2_direct: flag(r.u8(44), 0x80),
                        target_gid: Gid(r.arr(46)),
                        rkeys: (0..n).map(|i| rkey_pair(72 + 16 * i)).collect(),
                    })
                } else {
                    None
                };
                Llc::AddLink(AddLink {
                    response,
                    reject: flag(f, 0x40),
                    reject_reason: if version == Version::V1 {
                        r.u8(2) & 0x0f
                    } else {
                        0
                    },
                    mac: Mac(r.arr(4)),
                    gid: Gid(r.arr(12)),
                    qpn: r.be24(28),
                    link_id: r.u8(31),
                    mtu: QpMtu::from_code(r.u8(32)),
                    initial_psn: r.be24(33),
                    v2,
                })
            }
            LlcType::AddLinkCont => Llc::AddLinkCont(AddLinkCont {
                response,
                link_id: r.u8(4),
                num_rkeys: r.u8(5),
                rkeys: [rkey_pair(8), rkey_pair(24)],
            }),
            LlcType::DeleteLink => Llc::DeleteLink(DeleteLink {
                response,
                all: flag(f, 0x40),
                orderly: flag(f, 0x20),
                link_id: r.u8(4),
                reason: DeleteLinkReason(r.be32(5)),
            }),
            LlcType::RequestAddLink => {
                let n = usize::from(r.u8(24));
                let room = (bytes.len() - 28) / 16;
                if n > room {
                    return Err(Error::CountTooLarge {
                        msg: "REQ_ADD_LINK",
                        what: "GIDs",
                        count: n,
                        room,
                    });
                }
                Llc::RequestAddLink(RequestAddLink {
                    response,
                    reject: flag(f, 0x40),
                    gids: (0..n).map(|i| Gid(r.arr(28 + 16 * i))).collect(),
                })
            }
            LlcType::ConfirmRkey | LlcType::ConfirmRkeyCont => {
                let mut rtokens = [rtoken(4), rtoken(17), rtoken(30)];
                let count = rtokens[0].link_id;
                rtokens[0].link_id = 0;
                if ty == LlcType::ConfirmRkey {
                    Llc::ConfirmRkey(ConfirmRkey {
                        response,
                        negative: flag(f, 0x20),
                        retry: flag(f, 0x10),
                        num_additional: count,
                        rtokens,
                    })
                } else {
                    Llc::ConfirmRkeyCont(ConfirmRkeyCont {
                        response,
                        negative: flag(f, 0x20),
                        num_rtokens: count,
                        rtokens,
                    })
                }
            }
            LlcType::DeleteRkey => {
                let n = usize::from(r.u8(4));
                let room = match version {
                    Version::V1 => MAX_DELETE_RKEYS_V1,
                    Version::V2 => (bytes.len() - 8) / 4,
                };
                if n > room {
                    return Err(Error::CountTooLarge {
                        msg: "DELETE_RKEY",
                        what: "rkeys",
                        count: n,
                        room,
                    });
                }
                Llc::DeleteRkey(DeleteRkey {
                    response,
                    negative: flag(f, 0x20),
                    errors: r.u8(5),
                    rkeys: (0..n).map(|i| r.be32(8 + 4 * i)).collect(),
                })
            }
            LlcType::TestLink => Llc::TestLink(TestLink {
                response,
                user_data: r.arr(4),
            }),
        };
        Ok(Self { version, body })
    }

    /// The type.
    pub fn llc_type(&self) -> LlcType {
        match &self.body {
            Llc::ConfirmLink(_) => LlcType::ConfirmLink,
            Llc::AddLink(_) => LlcType::AddLink,
            Llc::AddLinkCont(_) => LlcType::AddLinkCont,
            Llc::DeleteLink(_) => LlcType::DeleteLink,
            Llc::RequestAddLink(_) => LlcType::RequestAddLink,
            Llc::ConfirmRkey(_) => LlcType::ConfirmRkey,
            Llc::ConfirmRkeyCont(_) => LlcType::ConfirmRkeyCont,
            Llc::DeleteRkey(_) => LlcType::DeleteRkey,
            Llc::TestLink(_) => LlcType::TestLink,
        }
    }

    /// Whether this is a response.
    pub fn is_response(&self) -> bool {
        match &self.body {
            Llc::ConfirmLink(m) => m.response,
            Llc::AddLink(m) => m.response,
            Llc::AddLinkCont(m) => m.response,
            Llc::DeleteLink(m) => m.response,
            Llc::RequestAddLink(m) => m.response,
            Llc::ConfirmRkey(m) => m.response,
            Llc::ConfirmRkeyCont(m) => m.response,
            Llc::DeleteRkey(m) => m.response,
            Llc::TestLink(m) => m.response,
        }
    }

    /// Length in bytes: 44, or more for v2 messages with lists.
    pub fn buffer_len(&self) -> usize {
        let var = match (&self.body, self.version) {
            (Llc::AddLink(AddLink { v2: Some(x), .. }), Version::V2) => 72 + 16 * x.rkeys.len(),
            (Llc::RequestAddLink(m), Version::V2) => 28 + 16 * m.gids.len(),
            (Llc::DeleteRkey(m), Version::V2) => 8 + 4 * m.rkeys.len(),
            _ => 0,
        };
        var.max(LLC_LEN)
    }

    /// Writes the message into `buf`, which must be exactly [`LlcMessage::buffer_len`] long.
    pub fn emit(&self, buf: &mut [u8]) {
        let len = self.buffer_len();
        assert_eq!(buf.len(), len, "buffer must be buffer_len() bytes");
        buf.fill(0);
        let ty = self.llc_type() as u8;
        let mut put = |at: usize, bytes: &[u8]| buf[at..at + bytes.len()].copy_from_slice(bytes);
        put(
            0,
            &[match self.version {
                Version::V1 => ty,
                Version::V2 => 0x20 | ty,
            }],
        );
        match self.version {
            Version::V1 => put(1, &[LLC_LEN as u8]),
            // Linux writes the length in CPU order; x86 is little-endian.
            Version::V2 => put(1, &(len as u16).to_le_bytes()),
        }
        let resp = bit(self.is_response(), FLAG_RESPONSE);
        let rtoken = |put: &mut dyn FnMut(usize, &[u8]), at: usize, t: &Rtoken| {
            put(at, &[t.link_id]);
            put(at + 1, &t.rkey.to_be_bytes());
            put(at + 5, &t.vaddr.to_be_bytes());
        };
        let pair = |put: &mut dyn FnMut(usize, &[u8]), at: usize, p: &RkeyPair| {
            put(at, &p.rkey.to_be_bytes());
            put(at + 4, &p.rkey_new.to_be_bytes());
            put(at + 8, &p.vaddr_new.to_be_bytes());
        };
        match &self.body {
            Llc::ConfirmLink(m) => {
                put(3, &[resp | (m.no_rmbe_eyecatcher & 0x03)]);
                put(4, &m.mac.0);
                put(10, &m.gid.0);
                put(26, &m.qpn.to_be_bytes()[1..]);
                put(29, &[m.link_id]);
                put(30, &m.link_uid);
                put(34, &[m.max_links, m.max_conns]);
            }
            Llc::AddLink(m) => {
                if self.version == Version::V1 {
                    put(2, &[m.reject_reason & 0x0f]);
                }
                put(3, &[resp | bit(m.reject, 0x40)]);
                put(4, &m.mac.0);
                put(12, &m.gid.0);
                put(28, &m.qpn.to_be_bytes()[1..]);
                put(31, &[m.link_id, m.mtu.code()]);
                put(33, &m.initial_psn.to_be_bytes()[1..]);
                if let (Some(x), Version::V2) = (&m.v2, self.version) {
                    put(44, &[bit(x.v2_direct, 0x80)]);
                    put(46, &x.target_gid.0);
                    put(70, &(x.rkeys.len() as u16).to_le_bytes());
                    for (i, p) in x.rkeys.iter().enumerate() {
                        pair(&mut put, 72 + 16 * i, p);
                    }
                }
            }
            Llc::AddLinkCont(m) => {
                put(3, &[resp]);
                put(4, &[m.link_id, m.num_rkeys]);
                pair(&mut put, 8, &m.rkeys[0]);
                pair(&mut put, 24, &m.rkeys[1]);
            }
            Llc::DeleteLink(m) => {
                put(3, &[resp | bit(m.all, 0x40) | bit(m.orderly, 0x20)]);
                put(4, &[m.link_id]);
                put(5, &m.reason.0.to_be_bytes());
            }
            Llc::RequestAddLink(m) => {
                put(3, &[resp | bit(m.reject, 0x40)]);
                put(24, &[m.gids.len() as u8]);
                for (i, g) in m.gids.iter().enumerate() {
                    put(28 + 16 * i, &g.0);
                }
            }
            Llc::ConfirmRkey(ConfirmRkey {
                negative, rtokens, ..
            })
            | Llc::ConfirmRkeyCont(ConfirmRkeyCont {
                negative, rtokens, ..
            }) => {
                let (count, retry) = match &self.body {
                    Llc::ConfirmRkey(m) => (m.num_additional, m.retry),
                    Llc::ConfirmRkeyCont(m) => (m.num_rtokens, false),
                    _ => (0, false),
                };
                put(3, &[resp | bit(*negative, 0x20) | bit(retry, 0x10)]);
                rtoken(
                    &mut put,
                    4,
                    &Rtoken {
                        link_id: count,
                        ..rtokens[0]
                    },
                );
                rtoken(&mut put, 17, &rtokens[1]);
                rtoken(&mut put, 30, &rtokens[2]);
            }
            Llc::DeleteRkey(m) => {
                put(3, &[resp | bit(m.negative, 0x20)]);
                put(4, &[m.rkeys.len() as u8, m.errors]);
                for (i, k) in m.rkeys.iter().enumerate() {
                    put(8 + 4 * i, &k.to_be_bytes());
                }
            }
            Llc::TestLink(m) => {
                put(3, &[resp]);
                put(4, &m.user_data);
            }
        }
    }

    /// The message as bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v);
        v
    }
}

impl fmt::Display for LlcMessage {
    /// One line in the style of the reference decode, e.g.
    /// `LLC CONFIRM_LINK_V2 REQ len=44 mac=… gid=… qp=0x000011 link=1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = if self.version == Version::V2 {
            "_V2"
        } else {
            ""
        };
        let rr = if self.is_response() { "RESP" } else { "REQ" };
        write!(
            f,
            "LLC {}{v} {rr} len={}",
            self.llc_type().name(),
            self.buffer_len()
        )?;
        match &self.body {
            Llc::ConfirmLink(m) => write!(
                f,
                " mac={} gid={} qp={:#08x} link={} link_uid={:02x}{:02x}{:02x}{:02x} max_links={} max_conns={}",
                m.mac,
                m.gid,
                m.qpn,
                m.link_id,
                m.link_uid[0],
                m.link_uid[1],
                m.link_uid[2],
                m.link_uid[3],
                m.max_links,
                m.max_conns
            ),
            Llc::AddLink(m) => {
                write!(
                    f,
                    " mac={} gid={} qp={:#08x} link={} mtu={} psn={:#08x}",
                    m.mac, m.gid, m.qpn, m.link_id, m.mtu, m.initial_psn
                )?;
                if m.reject {
                    write!(f, " REJECT reason={}", m.reject_reason)?;
                }
                if let Some(x) = &m.v2 {
                    write!(
                        f,
                        " direct={} target_gid={} rkeys={}",
                        u8::from(x.v2_direct),
                        x.target_gid,
                        x.rkeys.len()
                    )?;
                }
                Ok(())
            }
            Llc::AddLinkCont(m) => write!(f, " link={} remaining={}", m.link_id, m.num_rkeys),
            Llc::DeleteLink(m) => write!(
                f,
                " link={} all={} orderly={} reason={}",
                m.link_id,
                u8::from(m.all),
                u8::from(m.orderly),
                m.reason
            ),
            Llc::RequestAddLink(m) => {
                write!(f, " reject={} gids={}", u8::from(m.reject), m.gids.len())
            }
            Llc::ConfirmRkey(m) => {
                write!(
                    f,
                    " rkey={:#x} vaddr={:#x} more={}",
                    m.rtokens[0].rkey, m.rtokens[0].vaddr, m.num_additional
                )?;
                if m.negative {
                    f.write_str(" NEGATIVE")?;
                }
                Ok(())
            }
            Llc::ConfirmRkeyCont(m) => write!(f, " remaining={}", m.num_rtokens),
            Llc::DeleteRkey(m) => {
                f.write_str(" rkeys=[")?;
                for (i, k) in m.rkeys.iter().enumerate() {
                    write!(f, "{}{k:#x}", if i > 0 { "," } else { "" })?;
                }
                write!(f, "] errors={:#x}", m.errors)
            }
            Llc::TestLink(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
