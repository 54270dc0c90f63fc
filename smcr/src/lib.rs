//! The SMC-R protocol core (issue 4): CLC negotiation over the TCP connection, link groups and
//! links on the `rdma` engine, the RDMA WRITE data path with CDC cursor updates, close and
//! fallback to TCP, with a Rust socket API (`SmcStream`/`SmcListener`).
//!
//! Layers: [`option`] (the eBPF program that signals capability in SYN/SYN-ACK, its loader and
//! per-socket records); the sans-IO state machines [`handshake`] (CLC, both roles), [`link`]
//! (one link's LLC conversation), [`lgr`] (a link group's connections, slots and linger) and
//! [`conn`] (a connection's cursors and flow control); and the
//! driver, [`runtime`], under the socket API [`SmcStream`]/[`SmcListener`], which tells its
//! [`Mode`]: SMC-R, or TCP with the [`FallbackReason`]. docs/protocol.md describes each.
#![warn(missing_docs)]

pub mod diag;
pub use smcr_bpf::{option, steer};
pub use smcr_proto::{conn, group, handshake, lgr, link, rtokens};
pub use smcr_stats::{self as stats, sys};
pub mod error;
#[cfg(feature = "hostile")]
mod hostile;
mod metrics;
pub mod policy;
pub mod runtime;
pub mod settings;
mod stream;
mod tcpwatch;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use clc::DeclineReason;
/// The AF_XDP probe of issue 27 (measurement only; see `bench xdp`).
#[doc(hidden)]
pub use option::xdp as xdp_probe;
pub use rdma::cork;
/// Threads that leave the application's signals to the application (see [`rdma::thread`]).
pub use rdma::thread;
pub use rdma::{DeviceStats, FaultConfig};
/// Where the runtime's descriptors go in a process shared with an application (see
/// [`rdma::fdzone`]).
pub use rdma::{env, fdzone, forkhold, sandbox};
pub use runtime::{
    ConfigError, ConnStats, Negotiation, RdmaDevice, Readiness, ReadyState, Runtime, RuntimeConfig,
};
pub use smcr_stats::FallbackReason;

/// Before a `fork` (`pthread_atfork`'s prepare): the forking thread takes this library's
/// process-wide locks, so that the child finds none held by a thread it does not have; then
/// [`release_after_fork`] in both processes (see [`rdma::forkhold`]).
pub fn hold_for_fork() {
    tcpwatch::hold_for_fork();
    rdma::hold_for_fork();
}

/// After a `fork`, in the parent and in the child: releases what [`hold_for_fork`] took.
pub fn release_after_fork() {
    rdma::forkhold::release();
}
pub use stream::{
    Blocking, Driver, Incoming, ListenerRecord, Mode, SmcListener, SmcStream, not_clc, v4_of,
};
