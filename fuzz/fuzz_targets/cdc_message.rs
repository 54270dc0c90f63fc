//! CDC: arbitrary SEND payloads never panic the decoder; whatever parses re-emits to the same
//! message (reserved bytes, e.g. the cursors' first two, are written as zero).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = cdc::CdcMessage::parse(data) {
        let _ = m.to_string();
        assert_eq!(cdc::CdcMessage::parse(&m.to_bytes()), Ok(m));
    }
});
