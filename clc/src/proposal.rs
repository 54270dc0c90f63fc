//! CLC Proposal (type 1): what a client offers.

use crate::header::{Eyecatcher, HEADER_LEN, MsgType, SmcType, TRAILER_LEN, emit_frame};
use crate::types::{Eid, Gid, Mac, PeerId};
use crate::{Error, Rd, Wr};
use core::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Length of the fixed part before the optional areas (header, local area, `iparea_offset`).
const FIXED_LEN: usize = 40;
/// The SMC-D / v2 info area that follows it in Linux proposals.
const SMCD_AREA_LEN: usize = 40;
/// Where `v2_ext_offset` counts from (end of that field).
const V2_OFFSET_BASE: usize = 52;
/// Most IPv6 prefixes and EIDs Linux sends or accepts.
pub const MAX_IPV6_PREFIXES: usize = 8;
/// Most user EIDs in a v2 extension.
pub const MAX_EIDS: usize = 8;
/// Most ISM GID/CHID entries in an SMC-Dv2 extension.
pub const MAX_ISM_GIDS: usize = 8;

/// The 40-byte "SMC-D / v2 info area" at offset 40 (its `v2_ext_offset` is computed on emit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SmcdInfo {
    /// ISM GID (SMC-D v1; 0 for SMC-R).
    pub ism_gid: u64,
    /// ISM CHID (SMC-D; 0 for SMC-R).
    pub ism_chid: u16,
    /// Vendor OUI (Linux: 0).
    pub vendor_oui: [u8; 3],
    /// Vendor experimental options (Linux: 0).
    pub vendor_options: [u8; 5],
}

/// The IP prefix area (present when a v1 variant is offered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpPrefixArea {
    /// IPv4 subnet of the outgoing interface (address AND mask); 0.0.0.0 for IPv6.
    pub ipv4_subnet: Ipv4Addr,
    /// Its prefix length in bits.
    pub ipv4_prefix_len: u8,
    /// IPv6 prefixes and their lengths (at most 8).
    pub ipv6: Vec<(Ipv6Addr, u8)>,
}

impl IpPrefixArea {
    fn len(&self) -> usize {
        8 + 17 * self.ipv6.len()
    }
}

/// The SMC-Dv2 extension (parsed and carried; smcr never offers SMC-D).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmcdV2Extension {
    /// System EID.
    pub system_eid: Eid,
    /// ISM GID/CHID pairs (at most 8).
    pub gid_chids: Vec<(u64, u16)>,
}

/// The SMC v2 extension: what SMC-Rv2 needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V2Extension {
    /// SMC release offered (flags high nibble; Linux today: 1, "v2.1").
    pub release: u8,
    /// SEID present (SMC-D on s390 only).
    pub seid: bool,
    /// The RoCE v2 GID of the client's preferred port.
    pub roce_gid: Gid,
    /// Connections per link group the client supports (v2.1; Linux default 255).
    pub max_conns: u8,
    /// Links per link group the client supports (v2.1; Linux default 2).
    pub max_links: u8,
    /// Feature mask (Linux sends 0x0001).
    pub feature_mask: u16,
    /// User EIDs (at most 8).
    pub eids: Vec<Eid>,
    /// SMC-Dv2 extension, present exactly when `typev2` includes SMC-D.
    pub smcd_v2: Option<SmcdV2Extension>,
}

impl V2Extension {
    fn len(&self) -> usize {
        40 + 32 * self.eids.len()
            + self
                .smcd_v2
                .as_ref()
                .map_or(0, |d| 48 + 10 * d.gid_chids.len())
    }
}

/// A CLC Proposal.
///
/// Which optional parts are present follows the header: a prefix area exactly when `typev1`
/// is not `None`; the v2 extension only when `version >= 2` and `typev2` is not `None` (a
/// Proposal that offers v2 without an extension parses with `v2: None`, which a server answers
/// with `NOV2EXT`). `smcd` is the 40-byte area Linux always sends; only RFC 7609-style v1
/// proposals (header version 1) leave it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    /// Eye catcher of header and trailer.
    pub eyecatcher: Eyecatcher,
    /// Highest SMC version offered (Linux always sends 2).
    pub version: u8,
    /// v1 variants offered.
    pub typev1: SmcType,
    /// v2 variants offered.
    pub typev2: SmcType,
    /// Sender's system ID (zero when no v1 SMC-R is offered, as Linux does).
    pub peer_id: PeerId,
    /// GID of the sender's preferred RoCE port (v1).
    pub gid: Gid,
    /// MAC of that port (v1).
    pub mac: Mac,
    /// The SMC-D / v2 info area.
    pub smcd: Option<SmcdInfo>,
    /// The IP prefix area.
    pub prefix: Option<IpPrefixArea>,
    /// The SMC v2 extension.
    pub v2: Option<V2Extension>,
}

impl Proposal {
    /// Total length in bytes, header and trailer included.
    pub fn buffer_len(&self) -> usize {
        FIXED_LEN
            + self.smcd.map_or(0, |_| SMCD_AREA_LEN)
            + self.prefix.as_ref().map_or(0, IpPrefixArea::len)
            + self.v2.as_ref().map_or(0, V2Extension::len)
            + TRAILER_LEN
    }

    /// Parses a whole message (header to trailer). The header must already say Proposal.
    pub(crate) fn parse_body(b: &[u8]) -> Result<Self, Error> {
        let r = Rd::new(b);
        let version = b[7] >> 4;
        let typev1 = SmcType::from_bits(b[7]);
        let typev2 = SmcType::from_bits(b[7] >> 2);
        if version == 1 && typev1 == SmcType::None {
            return Err(Error::NothingOffered);
        }
        let iparea_offset = r.be16(38, "iparea_offset")?;
        if usize::from(iparea_offset) > SMCD_AREA_LEN
            || (typev1 != SmcType::None && !matches!(iparea_offset, 0 | 40))
        {
            return Err(Error::BadIpAreaOffset(iparea_offset));
        }
        let v2_wanted = version >= 2 && typev2 != SmcType::None;
        let has_smcd = iparea_offset == 40 || typev1 == SmcType::None;
        if v2_wanted && !has_smcd {
            return Err(Error::MissingSmcdArea);
        }
        let mut pos = FIXED_LEN;
        let mut v2_ext_offset = 0;
        let smcd = if has_smcd {
            v2_ext_offset = r.be16(50, "v2_ext_offset")?;
            let info = SmcdInfo {
                ism_gid: r.be64(40, "SMC-D area")?,
                ism_chid: r.be16(48, "SMC-D area")?,
                vendor_oui: r.arr(52, "SMC-D area")?,
                vendor_options: r.arr(55, "SMC-D area")?,
            };
            r.need(pos + SMCD_AREA_LEN, "SMC-D area")?;
            pos += SMCD_AREA_LEN;
            Some(info)
        } else {
            None
        };
        let prefix = if typev1 != SmcType::None {
            let n = r.u8(pos + 7, "IP prefix area")?;
            if usize::from(n) > MAX_IPV6_PREFIXES {
                return Err(Error::TooManyIpv6Prefixes(n));
            }
            let mut ipv6 = Vec::with_capacity(n.into());
            for i in 0..usize::from(n) {
                let at = pos + 8 + 17 * i;
                ipv6.push((
                    Ipv6Addr::from(r.arr::<16>(at, "IPv6 prefix")?),
                    r.u8(at + 16, "IPv6 prefix")?,
                ));
            }
            let area = IpPrefixArea {
                ipv4_subnet: Ipv4Addr::from(r.arr::<4>(pos, "IP prefix area")?),
                ipv4_prefix_len: r.u8(pos + 4, "IP prefix area")?,
                ipv6,
            };
            pos += area.len();
            Some(area)
        } else {
            None
        };
        let v2 = if v2_wanted && v2_ext_offset != 0 {
            let expected = pos - V2_OFFSET_BASE;
            if usize::from(v2_ext_offset) != expected {
                return Err(Error::BadV2ExtOffset {
                    expected,
                    found: v2_ext_offset,
                });
            }
            let eid_cnt = r.u8(pos, "v2 extension")?;
            let ism_cnt = r.u8(pos + 1, "v2 extension")?;
            if usize::from(eid_cnt) > MAX_EIDS {
                return Err(Error::TooManyEids(eid_cnt));
            }
            let flags = r.u8(pos + 3, "v2 extension")?;
            let smcd_off = r.be16(pos + 6, "v2 extension")?;
            let mut ext = V2Extension {
                release: flags >> 4,
                seid: flags & 1 != 0,
                roce_gid: Gid(r.arr(pos + 8, "v2 extension")?),
                max_conns: r.u8(pos + 24, "v2 extension")?,
                max_links: r.u8(pos + 25, "v2 extension")?,
                feature_mask: r.be16(pos + 26, "v2 extension")?,
                eids: Vec::with_capacity(eid_cnt.into()),
                smcd_v2: None,
            };
            r.need(pos + 40, "v2 extension")?;
            for i in 0..usize::from(eid_cnt) {
                ext.eids.push(Eid(r.arr(pos + 40 + 32 * i, "user EID")?));
            }
            let dpos = pos + 40 + 32 * usize::from(eid_cnt);
            if typev2.has_d() {
                let expected = dpos - (pos + 8);
                if usize::from(smcd_off) != expected {
                    return Err(Error::BadSmcdV2ExtOffset {
                        expected,
                        found: smcd_off,
                    });
                }
                if usize::from(ism_cnt) > MAX_ISM_GIDS {
                    return Err(Error::TooManyIsmGids(ism_cnt));
                }
                let mut d = SmcdV2Extension {
                    system_eid: Eid(r.arr(dpos, "SMC-Dv2 extension")?),
                    gid_chids: Vec::with_capacity(ism_cnt.into()),
                };
                r.need(dpos + 48, "SMC-Dv2 extension")?;
                for i in 0..usize::from(ism_cnt) {
                    let at = dpos + 48 + 10 * i;
                    d.gid_chids
                        .push((r.be64(at, "ISM GID")?, r.be16(at + 8, "ISM GID")?));
                }
                ext.smcd_v2 = Some(d);
            }
            pos += ext.len();
            Some(ext)
        } else {
            None
        };
        if pos + TRAILER_LEN != b.len() {
            return Err(Error::BadLength {
                msg: MsgType::Proposal,
                expected: pos + TRAILER_LEN,
                found: b.len(),
            });
        }
        Ok(Self {
            eyecatcher: Eyecatcher::from_bytes(r.arr(0, "header")?).unwrap_or_default(),
            version,
            typev1,
            typev2,
            peer_id: PeerId(r.arr(8, "local area")?),
            gid: Gid(r.arr(16, "local area")?),
            mac: Mac(r.arr(32, "local area")?),
            smcd,
            prefix,
            v2,
        })
    }

    /// Writes the message into `buf`, which must be exactly [`Proposal::buffer_len`] long.
    pub fn emit(&self, buf: &mut [u8]) {
        assert_eq!(
            buf.len(),
            self.buffer_len(),
            "buffer must be buffer_len() bytes"
        );
        buf.fill(0);
        let byte7 = (self.version << 4) | ((self.typev2 as u8) << 2) | self.typev1 as u8;
        emit_frame(buf, self.eyecatcher, MsgType::Proposal, byte7);
        let mut w = Wr::new(buf);
        w.put(8, &self.peer_id.0);
        w.put(16, &self.gid.0);
        w.put(32, &self.mac.0);
        let mut pos = FIXED_LEN;
        if let Some(s) = &self.smcd {
            if self.prefix.is_some() {
                w.put(38, &(SMCD_AREA_LEN as u16).to_be_bytes());
            }
            w.put(40, &s.ism_gid.to_be_bytes());
            w.put(48, &s.ism_chid.to_be_bytes());
            w.put(52, &s.vendor_oui);
            w.put(55, &s.vendor_options);
            pos += SMCD_AREA_LEN;
        }
        if let Some(p) = &self.prefix {
            w.put(pos, &p.ipv4_subnet.octets());
            w.put(pos + 4, &[p.ipv4_prefix_len]);
            w.put(pos + 7, &[p.ipv6.len() as u8]);
            for (i, (addr, len)) in p.ipv6.iter().enumerate() {
                w.put(pos + 8 + 17 * i, &addr.octets());
                w.put(pos + 8 + 17 * i + 16, &[*len]);
            }
            pos += p.len();
        }
        if let Some(v2) = &self.v2 {
            if self.smcd.is_some() {
                w.put(50, &((pos - V2_OFFSET_BASE) as u16).to_be_bytes());
            }
            w.put(pos, &[v2.eids.len() as u8]);
            w.put(pos + 3, &[(v2.release << 4) | u8::from(v2.seid)]);
            w.put(pos + 8, &v2.roce_gid.0);
            w.put(pos + 24, &[v2.max_conns, v2.max_links]);
            w.put(pos + 26, &v2.feature_mask.to_be_bytes());
            for (i, eid) in v2.eids.iter().enumerate() {
                w.put(pos + 40 + 32 * i, &eid.0);
            }
            if let Some(d) = &v2.smcd_v2 {
                let dpos = pos + 40 + 32 * v2.eids.len();
                w.put(pos + 1, &[d.gid_chids.len() as u8]);
                w.put(pos + 6, &((dpos - pos - 8) as u16).to_be_bytes());
                w.put(dpos, &d.system_eid.0);
                for (i, (gid, chid)) in d.gid_chids.iter().enumerate() {
                    w.put(dpos + 48 + 10 * i, &gid.to_be_bytes());
                    w.put(dpos + 56 + 10 * i, &chid.to_be_bytes());
                }
            }
        }
        debug_assert_eq!(HEADER_LEN, 8);
    }
}

impl fmt::Display for Proposal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CLC Proposal v{} len={} v1={} v2={}",
            self.version,
            self.buffer_len(),
            self.typev1,
            self.typev2
        )?;
        if self.typev1.has_r() {
            write!(
                f,
                " peer_id={} gid={} mac={}",
                self.peer_id, self.gid, self.mac
            )?;
        }
        if let Some(p) = &self.prefix {
            write!(f, " prefix={}/{}", p.ipv4_subnet, p.ipv4_prefix_len)?;
            for (a, l) in &p.ipv6 {
                write!(f, " prefix6={a}/{l}")?;
            }
        }
        if let Some(v2) = &self.v2 {
            write!(
                f,
                " release={} roce_gid={} max_conns={} max_links={} features={:#06x} ueids=[",
                v2.release, v2.roce_gid, v2.max_conns, v2.max_links, v2.feature_mask
            )?;
            for (i, e) in v2.eids.iter().enumerate() {
                write!(f, "{}{e}", if i > 0 { "," } else { "" })?;
            }
            f.write_str("]")?;
        } else if self.version >= 2 && self.typev2 != SmcType::None {
            f.write_str(" (v2 offered without v2 extension)")?;
        }
        Ok(())
    }
}
