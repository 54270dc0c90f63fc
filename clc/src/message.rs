//! Any CLC message.

use crate::Error;
use crate::accept::{AcceptConfirm, Role};
use crate::decline::Decline;
use crate::header::{MsgType, Packet};
use crate::proposal::Proposal;
use core::fmt;

/// One CLC message of any type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Proposal.
    Proposal(Proposal),
    /// Accept or Confirm.
    AcceptConfirm(AcceptConfirm),
    /// Decline.
    Decline(Decline),
}

impl Message {
    /// Parses exactly one whole message (use [`crate::message_len`] to frame a stream).
    /// Never panics; every defect is an [`Error`].
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let p = Packet::new_checked(bytes)?;
        Self::parse_packet(&p)
    }

    /// Parses a checked [`Packet`].
    pub fn parse_packet(p: &Packet<&[u8]>) -> Result<Self, Error> {
        let ty = p.msg_type();
        if ty != MsgType::Decline {
            // Linux accepts either eye catcher in the trailer.
            let t = p.trailer();
            if crate::header::Eyecatcher::from_bytes(t).is_none() {
                return Err(Error::BadTrailer(t));
            }
        }
        let b = p.as_bytes();
        match ty {
            MsgType::Proposal => Proposal::parse_body(b).map(Self::Proposal),
            MsgType::Accept => AcceptConfirm::parse_body(b, Role::Accept).map(Self::AcceptConfirm),
            MsgType::Confirm => {
                AcceptConfirm::parse_body(b, Role::Confirm).map(Self::AcceptConfirm)
            }
            MsgType::Decline => Decline::parse_body(b).map(Self::Decline),
        }
    }

    /// The message type.
    pub fn msg_type(&self) -> MsgType {
        match self {
            Self::Proposal(_) => MsgType::Proposal,
            Self::AcceptConfirm(a) if a.role == Role::Accept => MsgType::Accept,
            Self::AcceptConfirm(_) => MsgType::Confirm,
            Self::Decline(_) => MsgType::Decline,
        }
    }

    /// Total length in bytes.
    pub fn buffer_len(&self) -> usize {
        match self {
            Self::Proposal(m) => m.buffer_len(),
            Self::AcceptConfirm(m) => m.buffer_len(),
            Self::Decline(m) => m.buffer_len(),
        }
    }

    /// Writes the message into `buf`, which must be exactly `buffer_len()` long.
    pub fn emit(&self, buf: &mut [u8]) {
        match self {
            Self::Proposal(m) => m.emit(buf),
            Self::AcceptConfirm(m) => m.emit(buf),
            Self::Decline(m) => m.emit(buf),
        }
    }

    /// The message as bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v);
        v
    }
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Proposal(m) => m.fmt(f),
            Self::AcceptConfirm(m) => m.fmt(f),
            Self::Decline(m) => m.fmt(f),
        }
    }
}
