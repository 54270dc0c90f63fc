//! The kernel side of smcr: eBPF programs assembled in Rust (no toolchain, no object files),
//! their loaders and what reads their results.
//!
//! - [`option`]: TCP option 254 in SYN and SYN-ACK (a sock_ops program on the cgroup v2 root),
//!   the two cgroup socket-option programs that let any process mark its sockets and read
//!   their records, and `smcr bpf install`'s pinning; the XDP probe beside it.
//! - [`steer`]: the tcx ingress program that hands RoCE packets for a process's QPN range to
//!   that process's port, so many processes of one address share 4791.
//!
//! Installing is for root (`smcr bpf install`); using what is installed is for every process,
//! through socket options and pinned maps, within a systemd unit's default filters.
#![warn(missing_docs)]

pub mod option;
pub mod steer;
