//! Shared code of the demo binaries: two processes that set up an RC queue pair between their
//! `rdma` devices (exchanging QP numbers, PSNs and keys over a TCP connection, as SMC-R's CLC
//! does) and then move data the way SMC-R does — RDMA WRITE into the peer's ring buffer,
//! followed by a SEND that tells the peer what arrived ([`peer`]); two network namespaces
//! joined by veth and a server for the demos' streams ([`netns`]). The bench harness
//! (`smcr-bench`) measures with the same pieces.

pub mod netns;
pub mod peer;
