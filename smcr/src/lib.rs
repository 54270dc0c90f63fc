//! The SMC-R protocol core (issue 4): CLC negotiation over the TCP connection, link groups and
//! links on the `rdma` engine, the RDMA WRITE data path with CDC cursor updates, close and
//! fallback to TCP, with a Rust socket API (`SmcStream`/`SmcListener`).
//!
//! Built so far: [`option`], the eBPF program that signals capability in SYN/SYN-ACK, with its
//! loader and per-socket records; and, sans-IO, [`handshake`], the CLC handshake of both roles (Proposal, Accept,
//! Confirm, Decline; version, UEID and v2.1 feature negotiation as Linux does it; Linux's
//! timeouts), and [`conn`], a connection's cursors and flow control (where RDMA WRITEs go, the
//! CDC after them, Linux's consumer-update rule, rejection of hostile cursors). Link groups,
//! the drivers and the socket API follow.
#![warn(missing_docs)]

pub mod conn;
pub mod handshake;
pub mod link;
pub mod option;
pub mod runtime;
mod stream;

pub use runtime::{Negotiation, Runtime, RuntimeConfig};
pub use stream::{FallbackReason, Mode, SmcListener, SmcStream};
