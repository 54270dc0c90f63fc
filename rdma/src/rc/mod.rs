//! The reliable-connection (RC) transport as sans-IO state machines.
//!
//! [`RcQp`] joins a requester (our outgoing requests: segmentation, PSNs, retransmission,
//! completion) and a responder (the peer's requests: PSN checks, placement into memory, ACK/NAK
//! generation, RDMA READ responses). It does no I/O and reads no clock: inputs arrive through
//! `handle_*` calls with an explicit `now`, outputs leave through `poll_*` calls, in quinn's
//! style. A driver loops "feed input → drain every `poll_*`".
//!
//! Behaviour follows the IBA and Linux rxe (wire-spec §6.7), with these choices of ours:
//! * AckReq is set on the last packet of every message, and also every `window / 4` packets
//!   and when the send window fills, so that long messages keep ACKs flowing.
//! * The responder coalesces ACKs: an ACK waiting to be sent is replaced by a newer one.
//! * The requester limits packets in flight with a congestion window (slow start, halved on
//!   NAK or timeout), so a burst does not overrun the peer's socket buffer.
//! * On local ACK timeout the retransmission interval doubles (up to 8× the QP timeout) until
//!   progress resumes; `retry_cnt` timeouts in a row fail the QP with `RetryExcErr` (IBA
//!   semantics, where Linux rxe treats 7 as infinite). `rnr_retry` 7 is infinite.

mod qp;
mod requester;
mod responder;
mod sgl;

pub use qp::{ModifyError, QpAttr, QpCaps, QpState, RcQp};

pub use requester::RequesterStats;
pub(crate) use responder::RecvWqe;
pub use responder::ResponderStats;
pub(crate) use sgl::SgList;

use bitflags::bitflags;
use std::time::Duration;

/// Path MTU, with the IBA enumeration used by SMC-R's CLC and ADD LINK messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes (enum 1).
    Mtu256 = 1,
    /// 512 bytes (enum 2).
    Mtu512 = 2,
    /// 1024 bytes (enum 3); what rxe uses on a 1500-byte Ethernet.
    Mtu1024 = 3,
    /// 2048 bytes (enum 4).
    Mtu2048 = 4,
    /// 4096 bytes (enum 5).
    Mtu4096 = 5,
}

impl Mtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> usize {
        128 << (self as u32)
    }

    /// From the IBA enumeration (1–5).
    pub const fn from_enum(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => return None,
        })
    }

    /// The largest MTU whose packets (plus 28 bytes of IPv4/UDP and up to 48 of RoCE headers)
    /// fit in a link MTU of `link_mtu` bytes — rxe's rule (netdev MTU − 80, rounded down).
    pub fn for_link_mtu(link_mtu: usize) -> Option<Self> {
        let room = link_mtu.checked_sub(80)?;
        [
            Self::Mtu4096,
            Self::Mtu2048,
            Self::Mtu1024,
            Self::Mtu512,
            Self::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
    }
}

/// The local ACK timeout for an IBA timeout code: 4.096 µs × 2^code; 0 means infinite.
pub fn timeout_duration(code: u8) -> Option<Duration> {
    match code {
        0 => None,
        c => Some(Duration::from_nanos(4096u64 << u32::from(c.min(31)))),
    }
}

/// The RNR NAK delay for an RNR timer code (IBA table; code 0 is 655.36 ms).
pub fn rnr_timer_duration(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(u64::from(US[usize::from(code & 0x1F)]))
}

/// A scatter/gather element: `length` bytes at `addr` in the region whose local key is `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address in the region's address space (`MemoryRegion::addr() + offset`).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOpcode {
    /// SEND: consumes a receive request at the peer.
    Send,
    /// SEND with 32 bits of immediate data.
    SendWithImm(u32),
    /// RDMA WRITE to `remote_addr` in the peer's region `rkey`.
    RdmaWrite {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate data (consumes a receive request at the peer).
    RdmaWriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ from `remote_addr` in the peer's region `rkey` into the local SGEs.
    RdmaRead {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
}

bitflags! {
    /// Send work request flags (`IBV_SEND_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub struct SendFlags: u32 {
        /// Generate a completion when the request completes successfully.
        const SIGNALED = 1;
        /// Set the solicited-event bit on the last packet.
        const SOLICITED = 2;
        /// Our extension: produce a completion only if the request could not run when posted.
        /// Only the same-host transport runs requests when posted (when the peer's ring has
        /// room); over UDP this is [`Self::SIGNALED`]. See
        /// [`QueuePair::post_send_report`](crate::QueuePair::post_send_report).
        const SIGNAL_IF_DEFERRED = 4;
        /// Our extension: the request goes ahead of requests posted before it that have not
        /// started to transmit (none of their packets was ever sent), instead of behind them.
        /// The wire stays one in-order PSN stream; only the order of posting is not kept, so
        /// use it only for a message that does not depend on earlier ones having arrived
        /// (SMC-R's LLC requests and answers, so that they do not wait behind megabytes of
        /// connection data on a slow path). Its completion may come before theirs.
        const EXPEDITE = 8;
        /// Our extension: the peer acknowledges the request at once, instead of holding the
        /// ACK for an answer to carry ([`QpCaps::ack_delay`](crate::QpCaps::ack_delay)): for
        /// a message nobody answers soon (a close, an LLC message, data the peer does not
        /// reply to), whose completion the sender would otherwise wait for. Only a peer that
        /// is our engine holds ACKs; to others it is not sent.
        const ACK_NOW = 16;
    }
}

/// A send work request.
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// Local data (source for SEND/WRITE, destination for READ).
    pub sg_list: &'a [Sge],
    /// Flags.
    pub flags: SendFlags,
}

/// A receive work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's data goes.
    pub sg_list: &'a [Sge],
}

/// Completion status (`IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// The request completed.
    Success,
    /// An incoming message did not fit the receive buffers.
    LocLenErr,
    /// A local protection error (bad local key or range).
    LocProtErr,
    /// The request was flushed because the QP entered the error state.
    WrFlushErr,
    /// The peer sent an unexpected or malformed response.
    BadRespErr,
    /// The peer reported an invalid request.
    RemInvReqErr,
    /// The peer refused access: bad rkey, range or permission.
    RemAccessErr,
    /// The peer could not complete the request.
    RemOpErr,
    /// No acknowledgement after `retry_cnt` retransmissions.
    RetryExcErr,
    /// The peer kept answering "receiver not ready" beyond `rnr_retry`.
    RnrRetryExcErr,
    /// Another error a verbs device reported (its `ibv_wc_status` value); our engine never
    /// produces it.
    DeviceErr(u32),
}

impl WcStatus {
    /// The verbs name (`IBV_WC_*`), for logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "SUCCESS",
            Self::LocLenErr => "LOC_LEN_ERR",
            Self::LocProtErr => "LOC_PROT_ERR",
            Self::WrFlushErr => "WR_FLUSH_ERR",
            Self::BadRespErr => "BAD_RESP_ERR",
            Self::RemInvReqErr => "REM_INV_REQ_ERR",
            Self::RemAccessErr => "REM_ACCESS_ERR",
            Self::RemOpErr => "REM_OP_ERR",
            Self::RetryExcErr => "RETRY_EXC_ERR",
            Self::RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            Self::DeviceErr(_) => "DEVICE_ERR",
        }
    }
}

/// What a completed work request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (with or without immediate) we posted.
    Send,
    /// An RDMA WRITE we posted.
    RdmaWrite,
    /// An RDMA READ we posted.
    RdmaRead,
    /// An incoming SEND consumed a receive request.
    Recv,
    /// An incoming RDMA WRITE with immediate consumed a receive request.
    RecvRdmaWithImm,
}

/// A work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's identifier.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Operation.
    pub opcode: WcOpcode,
    /// Bytes received (receive completions) or transferred.
    pub byte_len: u32,
    /// Immediate data of an incoming message.
    pub imm_data: Option<u32>,
    /// The local QP number.
    pub qp_num: u32,
}

impl WorkCompletion {
    /// A placeholder, e.g. to size a buffer for [`CompletionQueue::poll`](crate::CompletionQueue::poll).
    pub const EMPTY: Self = Self {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: 0,
    };
}

/// Why a work request could not be posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostError {
    /// The QP is not in a state that accepts this request.
    InvalidState(QpState),
    /// The queue is full (`max_send_wr` / `max_recv_wr`).
    QueueFull,
    /// More scatter/gather elements than the QP allows.
    TooManySge {
        /// Elements given.
        given: usize,
        /// The QP's limit.
        max: usize,
    },
    /// A scatter/gather element names memory the QP may not use.
    BadSge {
        /// Index of the element.
        index: usize,
        /// Why.
        error: crate::AccessError,
    },
    /// The message is longer than 2^31 bytes.
    MessageTooLong,
}

impl core::fmt::Display for PostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::InvalidState(s) => write!(f, "queue pair is in state {s:?}"),
            Self::QueueFull => f.write_str("work queue is full"),
            Self::TooManySge { given, max } => {
                write!(
                    f,
                    "{given} scatter/gather elements, the queue pair allows {max}"
                )
            }
            Self::BadSge { index, error } => write!(f, "scatter/gather element {index}: {error}"),
            Self::MessageTooLong => f.write_str("message longer than 2^31 bytes"),
        }
    }
}

impl std::error::Error for PostError {}

/// The payload of an outgoing packet as pieces of registered memory, so that a driver can hand
/// it to the kernel without copying (zero-copy transmit).
///
/// The pointers stay valid while the QP is not touched otherwise: a driver must finish sending
/// (and stop using them) before it releases the QP for other calls. The application must not
/// modify a buffer while a request that reads it is outstanding (the verbs rule).
#[derive(Debug, Clone, Copy)]
pub struct PayloadRef {
    pieces: [(*const u8, usize); 4],
    n: usize,
}

impl Default for PayloadRef {
    fn default() -> Self {
        Self {
            pieces: [(std::ptr::null(), 0); 4],
            n: 0,
        }
    }
}

impl PayloadRef {
    /// The pieces, in order.
    ///
    /// # Safety
    /// Only while the pointers are valid, as described on the type.
    pub unsafe fn slices(&self) -> impl Iterator<Item = &[u8]> {
        // SAFETY: per the function contract.
        self.pieces[..self.n]
            .iter()
            .map(|&(p, l)| unsafe { std::slice::from_raw_parts(p, l) })
    }

    /// Total length.
    pub fn len(&self) -> usize {
        self.pieces[..self.n].iter().map(|p| p.1).sum()
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of pieces.
    pub fn count(&self) -> usize {
        self.n
    }
}

/// One outgoing packet from [`RcQp::poll_transmit_parts`]: `head` bytes written at the start of
/// the caller's buffer (headers, or a whole small packet), then `payload`, then `pad` zero bytes,
/// then the 4-byte ICRC the driver computes.
#[derive(Debug, Clone, Copy)]
pub struct TxParts {
    /// Bytes written into the buffer.
    pub head: usize,
    /// Payload still in registered memory.
    pub payload: PayloadRef,
    /// Pad bytes after the payload.
    pub pad: usize,
}

impl TxParts {
    /// Total packet length, ICRC included.
    pub fn len(&self) -> usize {
        self.head + self.payload.len() + self.pad + crate::wire::ICRC_LEN
    }

    /// Never true: a packet has at least a BTH and an ICRC.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Which completion queue a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqSide {
    /// The QP's send CQ.
    Send,
    /// The QP's receive CQ.
    Recv,
}

#[cfg(test)]
mod encoding_tests {
    use super::*;

    #[test]
    fn encodings() {
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::from_enum(5), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::from_enum(0), None);
        assert_eq!(Mtu::for_link_mtu(1500), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::for_link_mtu(9000), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_link_mtu(65536), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_link_mtu(300), None);
        let t15 = timeout_duration(15).unwrap();
        assert!(t15 > Duration::from_millis(134) && t15 < Duration::from_millis(135));
        assert_eq!(timeout_duration(0), None);
        assert_eq!(rnr_timer_duration(5), Duration::from_micros(60));
        assert_eq!(rnr_timer_duration(0), Duration::from_micros(655_360));
    }
}

#[cfg(test)]
mod tests;
