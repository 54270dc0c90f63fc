//! Access rights of registered memory ([`Access`]) and why an access is refused
//! ([`AccessError`]). A leaf: the region table (`mr`, which re-exports both) and the same-host
//! arenas it places regions in (`arena`) both use them.

use bitflags::bitflags;

bitflags! {
    /// Access rights of a memory region (`IBV_ACCESS_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local side may write (receive buffers, RDMA READ targets).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA WRITE into the region.
        const REMOTE_WRITE = 2;
        /// Peers may RDMA READ from the region.
        const REMOTE_READ = 4;
        /// Peers may run atomics on the region.
        const REMOTE_ATOMIC = 8;
    }
}

/// Why an access to registered memory was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessError {
    /// No region has this key (or the key byte does not match).
    BadKey(u32),
    /// The region belongs to another protection domain.
    WrongPd,
    /// The region lacks the access right the operation needs.
    NotPermitted {
        /// The right that was needed.
        need: Access,
    },
    /// The address range is not inside the region.
    OutOfBounds {
        /// Start address of the access.
        addr: u64,
        /// Length of the access.
        len: u64,
    },
}

impl core::fmt::Display for AccessError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Self::BadKey(k) => write!(f, "no memory region has key {k:#010x}"),
            Self::WrongPd => f.write_str("memory region belongs to another protection domain"),
            Self::NotPermitted { need } => write!(f, "memory region lacks {need:?} access"),
            Self::OutOfBounds { addr, len } => {
                write!(f, "range {addr:#x}+{len} is outside the memory region")
            }
        }
    }
}

impl std::error::Error for AccessError {}
