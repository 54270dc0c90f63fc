//! The SMC-R protocol as pure state machines (RFC 7609, as Linux speaks it): no threads, no
//! I/O, no clock of their own. Each takes the time and the messages that arrived as arguments
//! and returns what to send and when to be called again; `smcr`'s runtime drives them over the
//! `rdma` engine and the TCP connection. Style as quinn-proto: every case is reachable from a
//! unit test with a virtual clock.
//!
//! - [`handshake`]: the CLC negotiation on the TCP connection, both roles.
//! - [`link`]: one link's LLC conversation (CONFIRM LINK, ADD/DELETE LINK, CONFIRM RKEY, test
//!   link).
//! - [`group`]: a link group's links, failover and the second link.
//! - [`lgr`]: a link group's connections, RMB slots and linger.
//! - [`conn`]: one connection's cursors, flow control and close (CDC).
//! - [`rtokens`]: the peer's rkeys for each of our links.
//!
//! docs/protocol.md describes each against the wire specification.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod conn;
pub mod group;
pub mod handshake;
pub mod lgr;
pub mod link;
pub mod rtokens;
