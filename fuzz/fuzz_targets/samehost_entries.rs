//! Same-host transport: whatever entries a peer pushes into a QP's inbound ring (headers,
//! lengths, fragment sequences), delivering them never panics and never writes outside the
//! posted receive buffers.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rdma::fuzz_samehost_entries(data);
});
