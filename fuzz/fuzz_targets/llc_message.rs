//! LLC: arbitrary SEND payloads never panic the decoder; parse(emit(parse(x))) == parse(x).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = llc::LlcMessage::parse(data) {
        let _ = m.to_string();
        assert_eq!(llc::LlcMessage::parse(&m.to_vec()).as_ref(), Ok(&m));
    }
});
