//! smcr's RDMA device: a userspace soft-RoCE engine.
//!
//! RoCE v2 reliable connections over UDP, with a verbs-like API whose names RDMA people know:
//! [`Device`], [`ProtectionDomain`], [`MemoryRegion`], [`CompletionQueue`], [`QueuePair`],
//! `post_send`, `post_recv` and `poll_cq`. Packets are real RoCE v2 (BTH, RETH, AETH, ImmDt,
//! ICRC), so Wireshark decodes them.
//!
//! Layers, bottom up:
//! * [`wire`]: packet codecs, the ICRC and PSN arithmetic. Pure.
//! * [`rc`]: the reliable-connection transport as sans-IO state machines (requester,
//!   responder, completer): segmentation, ACK/NAK, go-back-N, timers, RNR, access checks.
//! * the verbs and the engine: the objects applications use (and, apart, [`CqScheduler`]: which
//!   thread takes a CQ's completions), one engine thread per device that
//!   receives UDP and runs timers, and the UDP transport with its test middleware (fault
//!   injection, pcap capture).
#![warn(missing_docs)]

mod access;
mod arena;
pub mod cork;
mod device;
pub mod env;
pub mod fdzone;
pub mod forkhold;
pub mod ibv;
pub mod locks;
pub mod mem;
pub mod mr;
mod notify;
pub mod rc;
mod samehost;
pub mod sandbox;
mod sched;
pub mod shm;
mod signals;
pub mod thread;
pub mod transport;
mod verbs;
pub mod wire;

pub use device::{CounterWords, DeviceConfig, DeviceStats, SharedCounters, gid_of};
pub use mr::{Access, AccessError, MrTable, Region};
pub use rc::{
    ModifyError, Mtu, PostError, QpAttr, QpCaps, QpState, RecvWr, SendFlags, SendWr, Sge, WcOpcode,
    WcStatus, WorkCompletion, WrOpcode,
};
pub use samehost::{PeerCred, RENDEZVOUS_DIR, SameHost, rendezvous_dir};
pub use sched::CqScheduler;

/// Before a `fork` (`pthread_atfork`'s prepare): the forking thread takes this crate's
/// process-wide locks (the thread reserve's, the descriptor zone's), until
/// [`forkhold::release`] (see [`forkhold`]).
pub fn hold_for_fork() {
    thread::hold_for_fork();
    fdzone::hold_for_fork();
}
pub use transport::fault::{FaultConfig, FaultStats};
pub use verbs::{CompletionQueue, Device, MemoryRegion, ProtectionDomain, QueuePair};
pub use wire::Psn;

/// Fuzzing entry point (not an API): feeds arbitrary ring entries to a same-host consumer.
#[doc(hidden)]
pub fn fuzz_samehost_entries(data: &[u8]) {
    samehost::fuzz_entries(data)
}
