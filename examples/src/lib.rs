//! Shared code of the demo and bench binaries: two processes that set up an RC queue pair
//! between their `rdma` devices (exchanging QP numbers, PSNs and keys over a TCP connection, as
//! SMC-R's CLC does) and then move data the way SMC-R does — RDMA WRITE into the peer's ring
//! buffer, followed by a SEND that tells the peer what arrived.

pub mod app_bench;
pub mod peer;
pub mod smc_bench;
pub mod soak;
pub mod xdp_bench;
