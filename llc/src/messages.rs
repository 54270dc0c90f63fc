//! The LLC messages' fields, one type per message (parsed and written by [`crate::LlcMessage`]).

use clc::{Gid, Mac, QpMtu};
use core::fmt;

use crate::Version;

/// CONFIRM LINK: confirms a new link (server request flags 0x03, client response 0x83).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfirmLink {
    /// Response (0x80).
    pub response: bool,
    /// Flag bits 0–1, "RMBEs have no eye catcher"; Linux requires both (0x03).
    pub no_rmbe_eyecatcher: u8,
    /// Sender's MAC.
    pub mac: Mac,
    /// Sender's GID.
    pub gid: Gid,
    /// Sender's QP number.
    pub qpn: u32,
    /// Link number (chosen by the server).
    pub link_id: u8,
    /// Opaque link user id (Linux: BE32 of link group id + link id).
    pub link_uid: [u8; 4],
    /// Max links (Linux 2, or the negotiated value).
    pub max_links: u8,
    /// Max connections (0, or the negotiated value in v2.1).
    pub max_conns: u8,
}

/// One rkey entry of ADD LINK (v2 extension) and ADD LINK CONTINUATION.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RkeyPair {
    /// rkey of the RMB on the existing link.
    pub rkey: u32,
    /// rkey of the same RMB on the new link.
    pub rkey_new: u32,
    /// Virtual address of that RMB on the new link.
    pub vaddr_new: u64,
}

/// The v2 extension of ADD LINK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddLinkV2Ext {
    /// No gateway between the new link's ports.
    pub v2_direct: bool,
    /// "Client target GID" (x86 Linux fills in the sender's GID of the new link).
    pub target_gid: Gid,
    /// rkeys of the link group's RMBs for the new link.
    pub rkeys: Vec<RkeyPair>,
}

/// ADD LINK: request from the server, response (possibly reject) from the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddLink {
    /// Response (0x80).
    pub response: bool,
    /// Reject (0x40, responses only).
    pub reject: bool,
    /// v1 only: reject reason (byte 2 low nibble; 1 = no alternate path). v2 Linux loses it.
    pub reject_reason: u8,
    /// MAC of the new link's port.
    pub mac: Mac,
    /// GID of the new link.
    pub gid: Gid,
    /// QP number of the new link.
    pub qpn: u32,
    /// Link number of the new link.
    pub link_id: u8,
    /// Path MTU (request: sender's; response: min of both).
    pub mtu: QpMtu,
    /// Initial PSN of the new QP.
    pub initial_psn: u32,
    /// v2 extension (v2 link groups; Linux's reject responses leave it out).
    pub v2: Option<AddLinkV2Ext>,
}

/// ADD LINK CONTINUATION (v1): two rkey entries per message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddLinkCont {
    /// Response bit (Linux sets it when the client sends).
    pub response: bool,
    /// Link number of the new link.
    pub link_id: u8,
    /// rkeys still to be transferred, counting this message's.
    pub num_rkeys: u8,
    /// The two entries (unused ones zero).
    pub rkeys: [RkeyPair; 2],
}

/// Reason codes of DELETE LINK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeleteLinkReason(pub u32);

impl DeleteLinkReason {
    /// Path lost.
    pub const LOST_PATH: Self = Self(0x0001_0000);
    /// Operator initiated termination.
    pub const OP_INIT_TERM: Self = Self(0x0002_0000);
    /// Program initiated termination (Linux: idle link group's linger timer expired).
    pub const PROG_INIT_TERM: Self = Self(0x0003_0000);
    /// LLC protocol violation.
    pub const PROT_VIOL: Self = Self(0x0004_0000);
    /// Asymmetric link no longer needed.
    pub const ASYM_LINK: Self = Self(0x0005_0000);
    /// Response only: unknown link.
    pub const NO_LINK: Self = Self(0x0010_0000);
    /// Response only: unknown link group.
    pub const NO_LGR: Self = Self(0x0020_0000);

    /// Linux-style name.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::LOST_PATH => "LOST_PATH",
            Self::OP_INIT_TERM => "OP_INIT_TERM",
            Self::PROG_INIT_TERM => "PROG_INIT_TERM",
            Self::PROT_VIOL => "PROT_VIOL",
            Self::ASYM_LINK => "ASYM_LINK",
            Self::NO_LINK => "NO_LINK",
            Self::NO_LGR => "NO_LGR",
            _ => return None,
        })
    }
}

impl fmt::Display for DeleteLinkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}({:#010x})", self.0),
            None => write!(f, "{:#010x}", self.0),
        }
    }
}

/// DELETE LINK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeleteLink {
    /// Response (0x80).
    pub response: bool,
    /// ALL (0x40): terminate the link group.
    pub all: bool,
    /// ORDERLY (0x20).
    pub orderly: bool,
    /// Link to delete (0 with ALL).
    pub link_id: u8,
    /// Reason.
    pub reason: DeleteLinkReason,
}

/// REQUEST ADD LINK (v2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestAddLink {
    /// Response (0x80).
    pub response: bool,
    /// Reject (0x40).
    pub reject: bool,
    /// The requester's GIDs.
    pub gids: Vec<Gid>,
}

/// One 13-byte rtoken of CONFIRM RKEY: an RMB's rkey and address on one link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rtoken {
    /// Link the rtoken is for (unused in the first slot: that is the link the message came on;
    /// there the byte holds the number of further rtokens).
    pub link_id: u8,
    /// rkey.
    pub rkey: u32,
    /// Virtual address.
    pub vaddr: u64,
}

/// CONFIRM RKEY: three packed rtokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfirmRkey {
    /// Response (0x80).
    pub response: bool,
    /// Negative response (0x20).
    pub negative: bool,
    /// Retry (0x10; Linux sets it with negative).
    pub retry: bool,
    /// Number of rtokens after the first (0–2; Linux answers more with a negative response).
    pub num_additional: u8,
    /// The three slots; slot 0's `link_id` is unused (byte 4 is `num_additional`).
    pub rtokens: [Rtoken; 3],
}

/// CONFIRM RKEY CONTINUATION (v1; never sent by Linux, ignored on receipt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfirmRkeyCont {
    /// Response (0x80).
    pub response: bool,
    /// Negative response (0x20).
    pub negative: bool,
    /// rtokens still to come, counting this message's.
    pub num_rtokens: u8,
    /// Three rtokens.
    pub rtokens: [Rtoken; 3],
}

/// DELETE RKEY.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteRkey {
    /// Response (0x80).
    pub response: bool,
    /// Negative response (0x20).
    pub negative: bool,
    /// Byte 5: v1 — error mask (bit 7−i set when rkey i was unknown); v2 — number of unknown
    /// rkeys in a response.
    pub errors: u8,
    /// The rkeys (v1: at most 8). Linux's v2 response keeps the count and zeroes the keys.
    pub rkeys: Vec<u32>,
}

/// TEST LINK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestLink {
    /// Response (0x80).
    pub response: bool,
    /// Opaque data echoed in the response (Linux: zeros).
    pub user_data: [u8; 16],
}

/// The body of an LLC message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Llc {
    /// CONFIRM LINK.
    ConfirmLink(ConfirmLink),
    /// ADD LINK.
    AddLink(AddLink),
    /// ADD LINK CONTINUATION (v1).
    AddLinkCont(AddLinkCont),
    /// DELETE LINK.
    DeleteLink(DeleteLink),
    /// REQUEST ADD LINK (v2).
    RequestAddLink(RequestAddLink),
    /// CONFIRM RKEY.
    ConfirmRkey(ConfirmRkey),
    /// CONFIRM RKEY CONTINUATION (v1).
    ConfirmRkeyCont(ConfirmRkeyCont),
    /// DELETE RKEY.
    DeleteRkey(DeleteRkey),
    /// TEST LINK.
    TestLink(TestLink),
}

/// An LLC message: format and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlcMessage {
    /// v1 or v2 format.
    pub version: Version,
    /// The message.
    pub body: Llc,
}
