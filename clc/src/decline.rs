//! CLC Decline (type 4): "no SMC for this connection", with the reason.

use crate::header::{Eyecatcher, MsgType, emit_frame};
use crate::reason::DeclineReason;
use crate::types::PeerId;
use crate::{Error, Rd, Wr};
use core::fmt;

/// v1 Decline length.
pub const DECLINE_V1_LEN: usize = 28;
/// v2 Decline length.
pub const DECLINE_V2_LEN: usize = 44;

/// A CLC Decline. Linux accepts either length whatever the header version says; the layout is
/// chosen by the length (`diag_v2` is `Some` for 44 bytes). Its trailer is never checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decline {
    /// Eye catcher.
    pub eyecatcher: Eyecatcher,
    /// Version of the exchange.
    pub version: u8,
    /// "Out of sync" (byte 7, 0x08): Linux sets it with `SYNCERR`; the receiver then ends the
    /// link group it was using.
    pub out_of_sync: bool,
    /// Sender's system ID (Linux: zero when it has none).
    pub peer_id: PeerId,
    /// The reason ("peer diagnosis").
    pub reason: DeclineReason,
    /// OS type (Linux: 0 in v1, 2 in v2).
    pub os_type: u8,
    /// v2 only: four more diagnosis codes (Linux sends zeros).
    pub diag_v2: Option<[u32; 4]>,
}

impl Decline {
    /// A Decline as Linux sends it: v2 layout for version 2, v1 otherwise.
    pub fn linux(version: u8, peer_id: PeerId, reason: DeclineReason) -> Self {
        Self {
            eyecatcher: Eyecatcher::SmcR,
            version,
            out_of_sync: reason == DeclineReason::SYNCERR,
            peer_id,
            reason,
            os_type: if version >= 2 { 2 } else { 0 },
            diag_v2: (version >= 2).then_some([0; 4]),
        }
    }

    /// Total length in bytes.
    pub fn buffer_len(&self) -> usize {
        if self.diag_v2.is_some() {
            DECLINE_V2_LEN
        } else {
            DECLINE_V1_LEN
        }
    }

    pub(crate) fn parse_body(b: &[u8]) -> Result<Self, Error> {
        if b.len() != DECLINE_V1_LEN && b.len() != DECLINE_V2_LEN {
            return Err(Error::BadLength {
                msg: MsgType::Decline,
                expected: if b[7] >> 4 >= 2 {
                    DECLINE_V2_LEN
                } else {
                    DECLINE_V1_LEN
                },
                found: b.len(),
            });
        }
        let r = Rd::new(b);
        let diag_v2 = if b.len() == DECLINE_V2_LEN {
            Some([
                r.be32(24, "diagnosis")?,
                r.be32(28, "diagnosis")?,
                r.be32(32, "diagnosis")?,
                r.be32(36, "diagnosis")?,
            ])
        } else {
            None
        };
        Ok(Self {
            eyecatcher: Eyecatcher::from_bytes(r.arr(0, "header")?).unwrap_or_default(),
            version: b[7] >> 4,
            out_of_sync: b[7] & 0x08 != 0,
            peer_id: PeerId(r.arr(8, "peer ID")?),
            reason: DeclineReason(r.be32(16, "diagnosis")?),
            os_type: r.u8(20, "OS type")? >> 4,
            diag_v2,
        })
    }

    /// Writes the message into `buf`, which must be exactly [`Decline::buffer_len`] long.
    pub fn emit(&self, buf: &mut [u8]) {
        assert_eq!(
            buf.len(),
            self.buffer_len(),
            "buffer must be buffer_len() bytes"
        );
        buf.fill(0);
        let byte7 = (self.version << 4) | if self.out_of_sync { 0x08 } else { 0 };
        emit_frame(buf, self.eyecatcher, MsgType::Decline, byte7);
        let mut w = Wr::new(buf);
        w.put(8, &self.peer_id.0);
        w.put(16, &self.reason.0.to_be_bytes());
        w.put(20, &[self.os_type << 4]);
        if let Some(d) = &self.diag_v2 {
            for (i, code) in d.iter().enumerate() {
                w.put(24 + 4 * i, &code.to_be_bytes());
            }
        }
    }
}

impl fmt::Display for Decline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CLC Decline v{} len={} reason={} peer_id={}",
            self.version,
            self.buffer_len(),
            self.reason,
            self.peer_id
        )?;
        if self.out_of_sync {
            f.write_str(" out_of_sync")?;
        }
        if let Some(d) = self.diag_v2.filter(|d| d.iter().any(|&c| c != 0)) {
            write!(
                f,
                " more_diag=[{:#010x},{:#010x},{:#010x},{:#010x}]",
                d[0], d[1], d[2], d[3]
            )?;
        }
        Ok(())
    }
}
