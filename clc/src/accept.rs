//! CLC Accept (type 2) and Confirm (type 3): the same layout, sent by server and client.

use crate::header::{Eyecatcher, MsgType, TRAILER_LEN, emit_frame};
use crate::types::{Eid, Gid, Hostname, Mac, PeerId, QpMtu, RmbSize};
use crate::{Error, Rd, Wr};
use core::fmt;

/// SMC-R v1 Accept/Confirm length.
pub const SMCR_V1_LEN: usize = 68;
/// SMC-R v2 Accept/Confirm length without first-contact extension.
pub const SMCR_V2_LEN: usize = 108;
/// First-contact extension length.
pub const FCE_LEN: usize = 52;
/// SMC-D v1 Accept/Confirm length.
pub const SMCD_V1_LEN: usize = 48;
/// SMC-D v2 Accept/Confirm minimum length.
pub const SMCD_V2_MIN_LEN: usize = 78;

/// Which side sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Accept, from the server.
    Accept,
    /// Confirm, from the client.
    Confirm,
}

impl Role {
    fn msg_type(self) -> MsgType {
        match self {
            Self::Accept => MsgType::Accept,
            Self::Confirm => MsgType::Confirm,
        }
    }
}

/// The first-contact extension of an SMC-R v2 Accept/Confirm ("v2x" layout of SMC v2.1; v2.0
/// peers send zeros in the last 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstContactExt {
    /// Peers are on the same IP subnet (no gateway).
    pub v2_direct: bool,
    /// OS type (1 z/OS, 2 Linux, 3 AIX).
    pub os_type: u8,
    /// Negotiated SMC release (4 bits).
    pub release: u8,
    /// Sender's host name.
    pub hostname: Hostname,
    /// Negotiated connections per link group.
    pub max_conns: u8,
    /// Negotiated links per link group.
    pub max_links: u8,
    /// Negotiated feature mask.
    pub feature_mask: u16,
    /// Vendor experimental options (Linux: 0).
    pub vendor_options: u32,
}

/// The v2 part of an SMC-R Accept/Confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmcrV2 {
    /// The negotiated user EID.
    pub eid: Eid,
    /// Present exactly when the first-contact flag is set.
    pub fce: Option<FirstContactExt>,
    /// Confirm, first contact: the client's GIDs (its link GID first). `None`: no GID list.
    pub gids: Option<Vec<Gid>>,
}

/// The SMC-R fields of an Accept/Confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmcrAcceptConfirm {
    /// Sender's system ID.
    pub peer_id: PeerId,
    /// Sender's GID for this link.
    pub gid: Gid,
    /// Sender's MAC.
    pub mac: Mac,
    /// Sender's QP number (24 bits).
    pub qpn: u32,
    /// rkey of the sender's RMB for this link.
    pub rmb_rkey: u32,
    /// RMBE index (Linux: 1).
    pub rmbe_idx: u8,
    /// The sender's connection token: the peer puts it in every CDC it sends.
    pub rmbe_alert_token: u32,
    /// RMB size.
    pub rmbe_size: RmbSize,
    /// QP MTU: the server's active MTU in an Accept, min(client, server) in a Confirm.
    pub qp_mtu: QpMtu,
    /// RMB virtual address for RDMA WRITE.
    pub rmb_vaddr: u64,
    /// First PSN the sender will use (24 bits).
    pub initial_psn: u32,
    /// v2 fields, present exactly when the header version is 2 or more.
    pub v2: Option<SmcrV2>,
}

/// What follows the header, by the chosen variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceptBody {
    /// SMC-R (typev1 = 0).
    SmcR(SmcrAcceptConfirm),
    /// SMC-D (typev1 = 1): kept as raw bytes between header and trailer; smcr never uses it.
    SmcD(Vec<u8>),
}

/// A CLC Accept or Confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptConfirm {
    /// Accept or Confirm.
    pub role: Role,
    /// Eye catcher of header and trailer.
    pub eyecatcher: Eyecatcher,
    /// Negotiated SMC version.
    pub version: u8,
    /// First contact: a new link group (byte 7, 0x08).
    pub first_contact: bool,
    /// The variant's fields.
    pub body: AcceptBody,
}

impl AcceptConfirm {
    /// Total length in bytes.
    pub fn buffer_len(&self) -> usize {
        match &self.body {
            AcceptBody::SmcD(raw) => 8 + raw.len() + TRAILER_LEN,
            AcceptBody::SmcR(r) => match &r.v2 {
                None => SMCR_V1_LEN,
                Some(v2) => {
                    SMCR_V2_LEN
                        + v2.fce.map_or(0, |_| FCE_LEN)
                        + v2.gids.as_ref().map_or(0, |g| 4 + 16 * g.len())
                }
            },
        }
    }

    /// The SMC-R fields, if this is SMC-R.
    pub fn smcr(&self) -> Option<&SmcrAcceptConfirm> {
        match &self.body {
            AcceptBody::SmcR(r) => Some(r),
            AcceptBody::SmcD(_) => None,
        }
    }

    pub(crate) fn parse_body(b: &[u8], role: Role) -> Result<Self, Error> {
        let r = Rd::new(b);
        let msg = role.msg_type();
        let version = b[7] >> 4;
        let first_contact = b[7] & 0x08 != 0;
        let eyecatcher = Eyecatcher::from_bytes(r.arr(0, "header")?).unwrap_or_default();
        let body = match b[7] & 3 {
            0 => {
                let want = if version >= 2 {
                    SMCR_V2_LEN
                } else {
                    SMCR_V1_LEN
                };
                let bad_len = |expected| Error::BadLength {
                    msg,
                    expected,
                    found: b.len(),
                };
                if (version == 1 && b.len() != want) || b.len() < want {
                    return Err(bad_len(want));
                }
                let size_mtu = r.u8(50, "SMC-R fields")?;
                let mut f = SmcrAcceptConfirm {
                    peer_id: PeerId(r.arr(8, "SMC-R fields")?),
                    gid: Gid(r.arr(16, "SMC-R fields")?),
                    mac: Mac(r.arr(32, "SMC-R fields")?),
                    qpn: r.be24(38, "SMC-R fields")?,
                    rmb_rkey: r.be32(41, "SMC-R fields")?,
                    rmbe_idx: r.u8(45, "SMC-R fields")?,
                    rmbe_alert_token: r.be32(46, "SMC-R fields")?,
                    rmbe_size: RmbSize::from_code(size_mtu >> 4),
                    qp_mtu: QpMtu::from_code(size_mtu),
                    rmb_vaddr: r.be64(52, "SMC-R fields")?,
                    initial_psn: r.be24(61, "SMC-R fields")?,
                    v2: None,
                };
                if version >= 2 {
                    let mut v2 = SmcrV2 {
                        eid: Eid(r.arr(64, "v2 fields")?),
                        fce: None,
                        gids: None,
                    };
                    // Linux accepts v2 messages longer than it knows; bytes after the known
                    // parts are ignored.
                    let end = b.len() - TRAILER_LEN;
                    if first_contact {
                        if end < SMCR_V2_LEN - TRAILER_LEN + FCE_LEN {
                            return Err(bad_len(SMCR_V2_LEN + FCE_LEN));
                        }
                        let p = SMCR_V2_LEN - TRAILER_LEN;
                        let b0 = r.u8(p, "first-contact extension")?;
                        let b1 = r.u8(p + 1, "first-contact extension")?;
                        v2.fce = Some(FirstContactExt {
                            v2_direct: b0 & 0x80 != 0,
                            os_type: b1 >> 4,
                            release: b1 & 0x0f,
                            hostname: Hostname(r.arr(p + 4, "first-contact extension")?),
                            max_conns: r.u8(p + 36, "first-contact extension")?,
                            max_links: r.u8(p + 37, "first-contact extension")?,
                            feature_mask: r.be16(p + 38, "first-contact extension")?,
                            vendor_options: r.be32(p + 40, "first-contact extension")?,
                        });
                        let g = p + FCE_LEN;
                        if end >= g + 4 {
                            let n = usize::from(r.u8(g, "GID list")?);
                            if end < g + 4 + 16 * n {
                                return Err(bad_len(SMCR_V2_LEN + FCE_LEN + 4 + 16 * n));
                            }
                            let mut gids = Vec::with_capacity(n);
                            for i in 0..n {
                                gids.push(Gid(r.arr(g + 4 + 16 * i, "GID list")?));
                            }
                            v2.gids = Some(gids);
                        }
                    }
                    f.v2 = Some(v2);
                }
                AcceptBody::SmcR(f)
            }
            1 => {
                let want = if version >= 2 {
                    SMCD_V2_MIN_LEN
                } else {
                    SMCD_V1_LEN
                };
                if (version == 1 && b.len() != want) || b.len() < want {
                    return Err(Error::BadLength {
                        msg,
                        expected: want,
                        found: b.len(),
                    });
                }
                AcceptBody::SmcD(b[8..b.len() - TRAILER_LEN].to_vec())
            }
            t => return Err(Error::BadChosenType { msg, typev1: t }),
        };
        Ok(Self {
            role,
            eyecatcher,
            version,
            first_contact,
            body,
        })
    }

    /// Writes the message into `buf`, which must be exactly [`AcceptConfirm::buffer_len`] long.
    pub fn emit(&self, buf: &mut [u8]) {
        assert_eq!(
            buf.len(),
            self.buffer_len(),
            "buffer must be buffer_len() bytes"
        );
        buf.fill(0);
        let variant = match self.body {
            AcceptBody::SmcR(_) => 0,
            AcceptBody::SmcD(_) => 1,
        };
        let byte7 = (self.version << 4) | if self.first_contact { 0x08 } else { 0 } | variant;
        emit_frame(buf, self.eyecatcher, self.role.msg_type(), byte7);
        let n = buf.len();
        let mut w = Wr::new(buf);
        match &self.body {
            AcceptBody::SmcD(raw) => w.put(8, raw),
            AcceptBody::SmcR(f) => {
                w.put(8, &f.peer_id.0);
                w.put(16, &f.gid.0);
                w.put(32, &f.mac.0);
                w.put(38, &f.qpn.to_be_bytes()[1..]);
                w.put(41, &f.rmb_rkey.to_be_bytes());
                w.put(45, &[f.rmbe_idx]);
                w.put(46, &f.rmbe_alert_token.to_be_bytes());
                w.put(50, &[(f.rmbe_size.code() << 4) | f.qp_mtu.code()]);
                w.put(52, &f.rmb_vaddr.to_be_bytes());
                w.put(61, &f.initial_psn.to_be_bytes()[1..]);
                if let Some(v2) = &f.v2 {
                    w.put(64, &v2.eid.0);
                    let p = SMCR_V2_LEN - TRAILER_LEN;
                    if let Some(x) = &v2.fce {
                        w.put(
                            p,
                            &[
                                if x.v2_direct { 0x80 } else { 0 },
                                (x.os_type << 4) | (x.release & 0x0f),
                            ],
                        );
                        w.put(p + 4, &x.hostname.0);
                        w.put(p + 36, &[x.max_conns, x.max_links]);
                        w.put(p + 38, &x.feature_mask.to_be_bytes());
                        w.put(p + 40, &x.vendor_options.to_be_bytes());
                    }
                    if let Some(gids) = &v2.gids {
                        let g = p + v2.fce.map_or(0, |_| FCE_LEN);
                        w.put(g, &[gids.len() as u8]);
                        for (i, gid) in gids.iter().enumerate() {
                            w.put(g + 4 + 16 * i, &gid.0);
                        }
                    }
                }
            }
        }
        debug_assert!(n >= SMCD_V1_LEN);
    }
}

impl fmt::Display for AcceptConfirm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.role {
            Role::Accept => "Accept",
            Role::Confirm => "Confirm",
        };
        write!(
            f,
            "CLC {name} v{} len={} first_contact={}",
            self.version,
            self.buffer_len(),
            u8::from(self.first_contact)
        )?;
        match &self.body {
            AcceptBody::SmcD(raw) => write!(f, " SMC-D ({} bytes)", raw.len()),
            AcceptBody::SmcR(r) => {
                write!(
                    f,
                    " SMC-R peer_id={} gid={} mac={} qpn={:#08x} rkey={:#x} rmbe_idx={} token={:#x} rmb={} mtu={} vaddr={:#x} psn={:#08x}",
                    r.peer_id,
                    r.gid,
                    r.mac,
                    r.qpn,
                    r.rmb_rkey,
                    r.rmbe_idx,
                    r.rmbe_alert_token,
                    r.rmbe_size,
                    r.qp_mtu,
                    r.rmb_vaddr,
                    r.initial_psn
                )?;
                if let Some(v2) = &r.v2 {
                    write!(f, " eid={}", v2.eid)?;
                    if let Some(x) = &v2.fce {
                        write!(
                            f,
                            " direct={} os={} release={} host={} max_conns={} max_links={} features={:#06x}",
                            u8::from(x.v2_direct),
                            x.os_type,
                            x.release,
                            x.hostname,
                            x.max_conns,
                            x.max_links,
                            x.feature_mask
                        )?;
                    }
                    if let Some(g) = &v2.gids {
                        f.write_str(" gids=[")?;
                        for (i, gid) in g.iter().enumerate() {
                            write!(f, "{}{gid}", if i > 0 { "," } else { "" })?;
                        }
                        f.write_str("]")?;
                    }
                }
                Ok(())
            }
        }
    }
}
