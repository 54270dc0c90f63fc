//! sock_diag dumps (kernel netlink messages, parsed by smc-stat): arbitrary datagrams give an
//! error or a result, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut out = std::collections::HashMap::new();
    let _ = smcr::diag::parse_datagram(data, &mut out);
});
