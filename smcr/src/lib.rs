//! The SMC-R protocol core (issue 4): CLC negotiation over the TCP connection, link groups and
//! links on the `rdma` engine, the RDMA WRITE data path with CDC cursor updates, close and
//! fallback to TCP, with a Rust socket API (`SmcStream`/`SmcListener`).
//!
//! Built so far: [`handshake`], the sans-IO CLC handshake of both roles (Proposal, Accept,
//! Confirm, Decline; version, UEID and v2.1 feature negotiation as Linux does it; Linux's
//! timeouts). Link groups, connections and the socket API follow.
#![warn(missing_docs)]

pub mod handshake;
