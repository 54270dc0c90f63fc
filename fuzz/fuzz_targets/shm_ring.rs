//! Same-host ring: whatever a peer writes into the shared segment (header, cursors, slot
//! lengths), attaching, popping and pushing never panic or touch memory outside it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    let seg = Arc::new(rdma::shm::Segment::create("fuzz", 8192).unwrap());
    seg.write(0, &data[..data.len().min(8192)]);
    if let Ok(r) = rdma::shm::Ring::attach(seg, 0) {
        let mut out = vec![0u8; r.max_message()];
        for i in 0..64u8 {
            let _ = r.pop(&mut out);
            let _ = r.push(&[i; 7]);
        }
    }
});
