//! CLC: arbitrary bytes never panic the decoder; whatever parses re-emits to bytes that parse
//! to the same message; Display never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = clc::message_len(data);
    if let Ok(m) = clc::Message::parse(data) {
        let _ = m.to_string();
        let bytes = m.to_vec();
        assert_eq!(bytes.len(), m.buffer_len());
        assert_eq!(clc::Message::parse(&bytes).as_ref(), Ok(&m));
    }
});
