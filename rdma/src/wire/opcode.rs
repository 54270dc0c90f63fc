//! BTH opcodes of the reliable-connection class and the header layout each one implies
//! (wire-spec §6.4; Linux `rxe_opcode.c`, `ib_pack.h`).

use core::fmt;

/// What a packet does, independent of its position within a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SEND: consumes a receive WQE at the responder.
    Send,
    /// RDMA WRITE: places data at a remote address.
    Write,
    /// RDMA READ request.
    ReadRequest,
    /// RDMA READ response (carries data back to the requester).
    ReadResponse,
    /// Acknowledgement (ACK or NAK).
    Acknowledge,
    /// Atomic request (compare-and-swap, fetch-and-add).
    Atomic,
    /// Atomic acknowledgement.
    AtomicAcknowledge,
}

/// Where a packet sits within a multi-packet message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// First packet of a message of several (carries exactly one path MTU of payload).
    First,
    /// A middle packet (exactly one path MTU of payload).
    Middle,
    /// Last packet (1 to path MTU bytes).
    Last,
    /// The only packet of a message (0 to path MTU bytes).
    Only,
}

impl Position {
    /// The packet starts a message.
    pub const fn starts(self) -> bool {
        matches!(self, Self::First | Self::Only)
    }
    /// The packet ends a message.
    pub const fn ends(self) -> bool {
        matches!(self, Self::Last | Self::Only)
    }
}

/// A BTH opcode. Unknown values are kept so that they can be reported.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(pub u8);

struct Info {
    name: &'static str,
    kind: Kind,
    position: Position,
    reth: bool,
    aeth: bool,
    imm: bool,
    ieth: bool,
    atomic_eth: bool,
    atomic_ack_eth: bool,
    payload: bool,
}

const fn info(
    name: &'static str,
    kind: Kind,
    position: Position,
    hdrs: u8, // bit 0 RETH, 1 AETH, 2 ImmDt, 3 IETH, 4 AtomicETH, 5 AtomicAckETH
    payload: bool,
) -> Info {
    Info {
        name,
        kind,
        position,
        reth: hdrs & 1 != 0,
        aeth: hdrs & 2 != 0,
        imm: hdrs & 4 != 0,
        ieth: hdrs & 8 != 0,
        atomic_eth: hdrs & 16 != 0,
        atomic_ack_eth: hdrs & 32 != 0,
        payload,
    }
}

const RETH: u8 = 1;
const AETH: u8 = 2;
const IMM: u8 = 4;
const IETH: u8 = 8;
const ATOMIC: u8 = 16;
const ATOMIC_ACK: u8 = 32;

use Kind::*;
use Position::*;

const TABLE: [Option<Info>; 0x18] = [
    Some(info("SEND_FIRST", Send, First, 0, true)),
    Some(info("SEND_MIDDLE", Send, Middle, 0, true)),
    Some(info("SEND_LAST", Send, Last, 0, true)),
    Some(info("SEND_LAST_WITH_IMMEDIATE", Send, Last, IMM, true)),
    Some(info("SEND_ONLY", Send, Only, 0, true)),
    Some(info("SEND_ONLY_WITH_IMMEDIATE", Send, Only, IMM, true)),
    Some(info("RDMA_WRITE_FIRST", Write, First, RETH, true)),
    Some(info("RDMA_WRITE_MIDDLE", Write, Middle, 0, true)),
    Some(info("RDMA_WRITE_LAST", Write, Last, 0, true)),
    Some(info(
        "RDMA_WRITE_LAST_WITH_IMMEDIATE",
        Write,
        Last,
        IMM,
        true,
    )),
    Some(info("RDMA_WRITE_ONLY", Write, Only, RETH, true)),
    Some(info(
        "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        Write,
        Only,
        RETH | IMM,
        true,
    )),
    Some(info("RDMA_READ_REQUEST", ReadRequest, Only, RETH, false)),
    Some(info(
        "RDMA_READ_RESPONSE_FIRST",
        ReadResponse,
        First,
        AETH,
        true,
    )),
    Some(info(
        "RDMA_READ_RESPONSE_MIDDLE",
        ReadResponse,
        Middle,
        0,
        true,
    )),
    Some(info(
        "RDMA_READ_RESPONSE_LAST",
        ReadResponse,
        Last,
        AETH,
        true,
    )),
    Some(info(
        "RDMA_READ_RESPONSE_ONLY",
        ReadResponse,
        Only,
        AETH,
        true,
    )),
    Some(info("ACKNOWLEDGE", Acknowledge, Only, AETH, false)),
    Some(info(
        "ATOMIC_ACKNOWLEDGE",
        AtomicAcknowledge,
        Only,
        AETH | ATOMIC_ACK,
        false,
    )),
    Some(info("COMPARE_SWAP", Atomic, Only, ATOMIC, false)),
    Some(info("FETCH_ADD", Atomic, Only, ATOMIC, false)),
    None,
    Some(info("SEND_LAST_WITH_INVALIDATE", Send, Last, IETH, true)),
    Some(info("SEND_ONLY_WITH_INVALIDATE", Send, Only, IETH, true)),
];

#[allow(missing_docs)]
impl Opcode {
    pub const SEND_FIRST: Self = Self(0x00);
    pub const SEND_MIDDLE: Self = Self(0x01);
    pub const SEND_LAST: Self = Self(0x02);
    pub const SEND_LAST_WITH_IMMEDIATE: Self = Self(0x03);
    pub const SEND_ONLY: Self = Self(0x04);
    pub const SEND_ONLY_WITH_IMMEDIATE: Self = Self(0x05);
    pub const RDMA_WRITE_FIRST: Self = Self(0x06);
    pub const RDMA_WRITE_MIDDLE: Self = Self(0x07);
    pub const RDMA_WRITE_LAST: Self = Self(0x08);
    pub const RDMA_WRITE_LAST_WITH_IMMEDIATE: Self = Self(0x09);
    pub const RDMA_WRITE_ONLY: Self = Self(0x0A);
    pub const RDMA_WRITE_ONLY_WITH_IMMEDIATE: Self = Self(0x0B);
    pub const RDMA_READ_REQUEST: Self = Self(0x0C);
    pub const RDMA_READ_RESPONSE_FIRST: Self = Self(0x0D);
    pub const RDMA_READ_RESPONSE_MIDDLE: Self = Self(0x0E);
    pub const RDMA_READ_RESPONSE_LAST: Self = Self(0x0F);
    pub const RDMA_READ_RESPONSE_ONLY: Self = Self(0x10);
    pub const ACKNOWLEDGE: Self = Self(0x11);
    pub const ATOMIC_ACKNOWLEDGE: Self = Self(0x12);
    pub const COMPARE_SWAP: Self = Self(0x13);
    pub const FETCH_ADD: Self = Self(0x14);
    pub const SEND_LAST_WITH_INVALIDATE: Self = Self(0x16);
    pub const SEND_ONLY_WITH_INVALIDATE: Self = Self(0x17);
}

impl Opcode {
    fn info(self) -> Option<&'static Info> {
        TABLE.get(usize::from(self.0)).and_then(Option::as_ref)
    }

    /// The opcode belongs to the RC class and is one this engine implements.
    pub fn is_supported(self) -> bool {
        self.info().is_some()
    }

    /// The IBA name, or `None` for an opcode this engine does not implement.
    pub fn name(self) -> Option<&'static str> {
        self.info().map(|i| i.name)
    }

    /// The operation kind (`None` if unsupported).
    pub fn kind(self) -> Option<Kind> {
        self.info().map(|i| i.kind)
    }

    /// The position within a message (`None` if unsupported).
    pub fn position(self) -> Option<Position> {
        self.info().map(|i| i.position)
    }

    /// Length of the extension headers between the BTH and the payload.
    pub fn ext_len(self) -> usize {
        self.info().map_or(0, |i| {
            usize::from(i.reth) * 16
                + usize::from(i.aeth) * 4
                + usize::from(i.imm) * 4
                + usize::from(i.ieth) * 4
                + usize::from(i.atomic_eth) * 28
                + usize::from(i.atomic_ack_eth) * 8
        })
    }

    /// Carries a RETH.
    pub fn has_reth(self) -> bool {
        self.info().is_some_and(|i| i.reth)
    }
    /// Carries an AETH.
    pub fn has_aeth(self) -> bool {
        self.info().is_some_and(|i| i.aeth)
    }
    /// Carries immediate data.
    pub fn has_imm(self) -> bool {
        self.info().is_some_and(|i| i.imm)
    }
    /// Carries an IETH (invalidate rkey).
    pub fn has_ieth(self) -> bool {
        self.info().is_some_and(|i| i.ieth)
    }
    /// Carries an AtomicETH.
    pub fn has_atomic_eth(self) -> bool {
        self.info().is_some_and(|i| i.atomic_eth)
    }
    /// Carries an AtomicAckETH.
    pub fn has_atomic_ack_eth(self) -> bool {
        self.info().is_some_and(|i| i.atomic_ack_eth)
    }
    /// May carry payload bytes.
    pub fn has_payload(self) -> bool {
        self.info().is_some_and(|i| i.payload)
    }

    /// Sent by a requester (as opposed to a responder's response or acknowledgement).
    pub fn is_request(self) -> bool {
        matches!(self.kind(), Some(Send | Write | ReadRequest | Atomic))
    }

    /// The SEND or WRITE opcode for a packet at `position`, with immediate data or not.
    pub fn for_request(kind: Kind, position: Position, imm: bool) -> Self {
        match (kind, position, imm) {
            (Send, First, _) => Self::SEND_FIRST,
            (Send, Middle, _) => Self::SEND_MIDDLE,
            (Send, Last, false) => Self::SEND_LAST,
            (Send, Last, true) => Self::SEND_LAST_WITH_IMMEDIATE,
            (Send, Only, false) => Self::SEND_ONLY,
            (Send, Only, true) => Self::SEND_ONLY_WITH_IMMEDIATE,
            (Write, First, _) => Self::RDMA_WRITE_FIRST,
            (Write, Middle, _) => Self::RDMA_WRITE_MIDDLE,
            (Write, Last, false) => Self::RDMA_WRITE_LAST,
            (Write, Last, true) => Self::RDMA_WRITE_LAST_WITH_IMMEDIATE,
            (Write, Only, false) => Self::RDMA_WRITE_ONLY,
            (Write, Only, true) => Self::RDMA_WRITE_ONLY_WITH_IMMEDIATE,
            (ReadResponse, First, _) => Self::RDMA_READ_RESPONSE_FIRST,
            (ReadResponse, Middle, _) => Self::RDMA_READ_RESPONSE_MIDDLE,
            (ReadResponse, Last, _) => Self::RDMA_READ_RESPONSE_LAST,
            (ReadResponse, Only, _) => Self::RDMA_READ_RESPONSE_ONLY,
            (ReadRequest, ..) => Self::RDMA_READ_REQUEST,
            (Acknowledge, ..) => Self::ACKNOWLEDGE,
            (AtomicAcknowledge, ..) => Self::ATOMIC_ACKNOWLEDGE,
            (Atomic, ..) => Self::COMPARE_SWAP,
        }
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "Opcode({:#04x})", self.0),
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_match_the_spec_table() {
        assert_eq!(Opcode::SEND_ONLY.ext_len(), 0);
        assert_eq!(Opcode::RDMA_WRITE_FIRST.ext_len(), 16);
        assert_eq!(Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE.ext_len(), 20);
        assert_eq!(Opcode::ACKNOWLEDGE.ext_len(), 4);
        assert_eq!(Opcode::ATOMIC_ACKNOWLEDGE.ext_len(), 12);
        assert_eq!(Opcode::COMPARE_SWAP.ext_len(), 28);
        assert_eq!(Opcode::SEND_ONLY_WITH_INVALIDATE.ext_len(), 4);
        assert_eq!(Opcode::RDMA_READ_RESPONSE_MIDDLE.ext_len(), 0);
        assert!(!Opcode(0x15).is_supported());
        assert!(!Opcode(0x64).is_supported()); // UD SEND_ONLY: not an RC opcode
        assert_eq!(format!("{:?}", Opcode(0x81)), "Opcode(0x81)");
    }

    #[test]
    fn for_request_round_trips_through_the_table() {
        for op in 0u8..0x18 {
            let op = Opcode(op);
            let (Some(kind), Some(pos)) = (op.kind(), op.position()) else {
                continue;
            };
            if op.has_ieth() || op == Opcode::FETCH_ADD {
                continue; // not produced by for_request
            }
            assert_eq!(Opcode::for_request(kind, pos, op.has_imm()), op, "{op:?}");
        }
    }
}
