//! Two engines in two processes: `rdma-demo` writes 1 GiB of pseudo-random data with RDMA WRITE
//! into the other process's ring buffer; the sink checks every 64 KiB chunk's CRC and the CRC
//! of the whole stream. Once on a clean path and once with 5 % drop, duplication, reordering
//! and corruption injected by both engines (SMCR_RDMA_FAULTS).

use std::process::Command;

fn run_demo(bytes: u64, faults: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rdma-demo"));
    cmd.arg(bytes.to_string()).env("RUST_BACKTRACE", "0");
    match faults {
        Some(f) => cmd.env("SMCR_RDMA_FAULTS", f),
        None => cmd.env_remove("SMCR_RDMA_FAULTS"),
    };
    let out = cmd.output().expect("running rdma-demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "rdma-demo failed:\n{text}");
    assert!(text.contains("OK: data verified end to end"), "{text}");
    assert!(
        text.contains(&format!(
            "received {bytes} bytes, every chunk's CRC matched"
        )),
        "{text}"
    );
    text
}

/// The number after `key` in the demo's output (the first occurrence after `after`).
fn number_after(text: &str, after: &str, key: &str) -> u64 {
    let start = text
        .find(after)
        .unwrap_or_else(|| panic!("no {after:?} in\n{text}"));
    let rest = &text[start..];
    let at = rest
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} after {after:?} in\n{text}"))
        + key.len();
    rest[at..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn one_gib_of_rdma_writes_between_two_processes() {
    let text = run_demo(1 << 30, None);
    assert_eq!(
        number_after(&text, "sink", "packets in,"),
        0,
        "no ICRC errors on a clean path:\n{text}"
    );
}

#[test]
fn one_gib_with_five_percent_drop_dup_reorder_corrupt() {
    let text = run_demo(
        1 << 30,
        Some("drop=5%,dup=5%,reorder=5%,corrupt=5%,seed=11"),
    );
    // The faults really happened, on both engines' sends …
    for side in ["source faults", "sink   faults"] {
        assert!(number_after(&text, side, "dropped:") > 0, "{text}");
        assert!(number_after(&text, side, "duplicated:") > 0, "{text}");
        assert!(number_after(&text, side, "reordered:") > 0, "{text}");
        assert!(number_after(&text, side, "corrupted:") > 0, "{text}");
    }
    // … and every corrupted packet the sink received was caught by the ICRC check.
    assert!(
        number_after(&text, "sink", "packets in,") > 0,
        "the ICRC caught nothing:\n{text}"
    );
}
