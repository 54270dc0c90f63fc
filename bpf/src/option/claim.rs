//! Who settled a connection that several processes may hold (inherited through `fork` or
//! `exec`): the socket's record kept by the option program carries it, so every holder — whatever its
//! memory says — learns it from the socket itself.
//!
//! The record's first word keeps the program's flags (it only ORs bits in, at connect, listen
//! and establishment); we add [`CLAIMED_SMC`] or [`CLAIMED_TCP`] and put the claiming process's
//! id in the second word, after the handshake (or the decision not to have one).

use std::os::fd::BorrowedFd;

use super::{OptionError, OptionRecords};

/// The connection was negotiated as SMC-R by the process in [`Claim::pid`].
pub const CLAIMED_SMC: u32 = 1 << 8;
/// The connection was settled as plain TCP (a fallback, a decline, or never negotiated).
pub const CLAIMED_TCP: u32 = 1 << 9;

/// Set with the mark before `connect`: the socket is a client's (never cloned to accepted
/// sockets: only a listener's record is).
pub const CONNECTING: u32 = 1 << 10;

/// A connection's claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// SMC-R (else TCP).
    pub smc: bool,
    /// The process that settled it.
    pub pid: u32,
}

impl OptionRecords {
    /// Records that `pid` settled `sock` (SMC-R or TCP), keeping the program's flags.
    pub fn claim(&self, sock: BorrowedFd<'_>, smc: bool, pid: u32) -> Result<(), OptionError> {
        let old = self.record(sock)?;
        let flags = u32::from_ne_bytes(old[..4].try_into().expect("4 bytes"))
            & !(CLAIMED_SMC | CLAIMED_TCP)
            | if smc { CLAIMED_SMC } else { CLAIMED_TCP };
        let mut v = [0u8; 8];
        v[..4].copy_from_slice(&flags.to_ne_bytes());
        v[4..].copy_from_slice(&pid.to_ne_bytes());
        self.set_record(sock, &v)
            .map_err(|e| OptionError::from_io("record the socket's claim", e))
    }

    /// The claim recorded for `sock`, if any.
    pub fn claimed(&self, sock: BorrowedFd<'_>) -> Result<Option<Claim>, OptionError> {
        let v = self.record(sock)?;
        let flags = u32::from_ne_bytes(v[..4].try_into().expect("4 bytes"));
        let pid = u32::from_ne_bytes(v[4..].try_into().expect("4 bytes"));
        Ok((flags & (CLAIMED_SMC | CLAIMED_TCP) != 0).then_some(Claim {
            smc: flags & CLAIMED_SMC != 0,
            pid,
        }))
    }
}
