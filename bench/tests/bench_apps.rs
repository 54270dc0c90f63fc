//! `bench apps --smoke`: every workload runs in every setup, the smcr runs really used SMC-R
//! (the bench checks the servers' stats and fails otherwise), and the table, JSON and SVG come
//! out with a ratio for every metric. Figures are not checked (benchmarks, not timed tests).

use std::process::Command;

#[test]
fn bench_apps_smoke_run() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "needs root"
        );
        eprintln!("SKIP: bench apps needs root (namespaces, the TCP option program)");
        return;
    }
    // The preload library next to the bench binary (cargo builds the cdylib for this test
    // only if asked).
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let profile_dir = exe.parent().unwrap();
    let profile = profile_dir.file_name().unwrap().to_str().unwrap();
    let profile = if profile == "debug" { "dev" } else { profile };
    let st = Command::new(env!("CARGO"))
        .args([
            "build",
            "-q",
            "--profile",
            profile,
            "-p",
            "preload",
            "--lib",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let dir = std::env::temp_dir().join(format!("smcr-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("b.json"), dir.join("b.svg"));
    let out = Command::new(&exe)
        .args(["apps", "--smoke", "--json"])
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("metric") && text.contains("smcr-local"),
        "{text}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let metrics = doc["metrics"].as_array().unwrap();
    assert_eq!(metrics.len(), 26, "{doc}");
    // The engines' counters: across the namespaces every workload's programs sent RoCE packets
    // (counted from the exited clients' stats areas too), and a needless probe was a probe.
    let engine = doc["engine"].as_array().unwrap();
    for w in smcr_bench::app_bench::WORKLOADS {
        let row = engine
            .iter()
            .find(|r| r["workload"] == w && r["setup"] == "smcr-remote")
            .unwrap_or_else(|| panic!("no engine row for {w}: {doc}"));
        assert!(row["packets"].as_u64().unwrap() > 0, "{row}");
        assert!(
            row["spurious_probes"].as_u64() <= row["probes"].as_u64(),
            "{row}"
        );
    }
    for m in metrics {
        let name = m["name"].as_str().unwrap();
        for s in [
            "tcp-local",
            "smcr-local",
            "smcr-xuser",
            "tcp-netns",
            "smcr-samehost-ns",
            "smcr-remote",
            "fallback",
        ] {
            assert!(m["values"][s].is_number(), "{s} missing: {m}");
        }
        // Memory and CPU figures of plain TCP can be ~0: no ratio then.
        if !name.contains("RSS") && !name.contains("CPU") {
            for s in [
                "smcr-local",
                "smcr-xuser",
                "smcr-samehost-ns",
                "smcr-remote",
                "fallback",
            ] {
                assert!(m["ratios"][s].as_f64().is_some_and(|r| r > 0.0), "{m}");
            }
        }
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // A bar per ratio, plus the legend's five (smcr-verbs only where an RDMA device is).
    let bars: usize = metrics
        .iter()
        .map(|m| m["ratios"].as_object().unwrap().len())
        .sum();
    assert_eq!(svg.matches("<rect").count(), bars + 5, "{svg}");
    let _ = std::fs::remove_dir_all(&dir);
}
