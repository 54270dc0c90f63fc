//! RoCE v2 (BTH through ICRC): arbitrary UDP payloads never panic the decoder, the ICRC
//! check or the bundle reader (our engines' datagrams of several packets); whatever parses
//! re-emits to a packet that parses the same.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdma::wire::{IcrcHeaders, PacketRepr, parse_bundle, verify_icrc};
use std::net::Ipv4Addr;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = parse_bundle(data) {
        for pkt in b.flatten() {
            assert!(pkt.len() >= 16 && pkt[5..8] == data[5..8]);
            let _ = PacketRepr::parse_bytes(pkt);
        }
    }
    let Ok(p) = PacketRepr::parse_bytes(data) else { return };
    let h = IcrcHeaders {
        src: Ipv4Addr::new(10, 0, 0, 1),
        dst: Ipv4Addr::new(10, 0, 0, 2),
        ip_id: 0,
        df: true,
        sport: 0xc000,
        dport: 4791,
    };
    let _ = verify_icrc(&h, data);
    let mut buf = vec![0; p.buffer_len()];
    p.emit(&mut buf);
    let again = PacketRepr::parse_bytes(&buf).expect("re-emitted packet parses");
    assert_eq!(format!("{again:?}"), format!("{p:?}"));
});
