//! What a run prints and writes: the tables, the JSON, the SVG chart; option parsing and the
//! tools check.

#[allow(unused_imports)]
use super::*;

/// The engines' counters per workload and setup ([`Engine`]).
pub fn engine_table(rows: &[Engine]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<12} {:<12} {:>12} {:>9} {:>8} {:>9} {:>9}",
        "engine", "setup", "packets out", "resent", "probes", "spurious", "timeouts"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:<12} {:<12} {:>12} {:>9} {:>8} {:>9} {:>9}",
            r.workload, r.setup, r.packets, r.resent, r.probes, r.spurious, r.timeouts
        );
    }
    o.push_str(
        "engine: RoCE packets the shimmed programs' engines sent and sent again (probes: early \
         retransmissions; spurious: probes whose ACK was late, not lost), all repetitions\n",
    );
    o
}

/// The table: values per setup, and each smcr setup's ratio to its TCP baseline.
pub fn table(metrics: &[Metric]) -> String {
    let mut o = String::new();
    let cols: Vec<Setup> = Setup::ALL
        .into_iter()
        .filter(|s| metrics.iter().any(|m| m.get(*s).is_some()))
        .collect();
    let _ = write!(o, "{:<42}", "metric");
    for s in &cols {
        let _ = write!(o, " {:>16}", s.name());
        if s.baseline().is_some() {
            let _ = write!(o, " {:>7}", "ratio");
        }
    }
    o.push('\n');
    for m in metrics {
        let _ = write!(o, "{:<42}", m.name);
        for s in &cols {
            match m.get(*s) {
                Some(v) if v >= 1000.0 => {
                    let _ = write!(o, " {v:>16.0}");
                }
                Some(v) => {
                    let _ = write!(o, " {v:>16.2}");
                }
                None => {
                    let _ = write!(o, " {:>16}", "-");
                }
            }
            if s.baseline().is_some() {
                match m.ratio(*s) {
                    Some(r) => {
                        let _ = write!(o, " {:>6.2}x", r);
                    }
                    None => {
                        let _ = write!(o, " {:>7}", "-");
                    }
                }
            }
        }
        o.push('\n');
    }
    o.push_str(
        "ratio: the setup's value / plain TCP's in the same topology (latency: lower is better)\n",
    );
    o
}

/// JSON: `{"setups": [...], "metrics": [{name, higher_is_better, values{setup: v}, ratios{setup: r}}]}`.
/// A value that is not a number (a run that measured nothing) is `null`: NaN is not JSON.
pub fn json(metrics: &[Metric], engine: &[Engine]) -> String {
    use serde_json::{Map, Value, json};
    let num = |v: f64| json_num(v, 15);
    let items: Vec<Value> = metrics
        .iter()
        .map(|m| {
            let values: Map<String, Value> = m
                .values
                .iter()
                .map(|(s, v)| (s.name().to_string(), num(*v)))
                .collect();
            let ratios: Map<String, Value> = Setup::ALL
                .iter()
                .filter_map(|s| {
                    let r = m.ratio(*s)?;
                    Some((s.name().to_string(), json_num(r, 4)))
                })
                .collect();
            json!({
                "name": m.name,
                "higher_is_better": m.higher_is_better,
                "values": values,
                "ratios": ratios,
            })
        })
        .collect();
    let setups: Vec<&str> = Setup::ALL.iter().map(|s| s.name()).collect();
    let engine: Vec<Value> = engine
        .iter()
        .map(|r| {
            json!({
                "workload": r.workload,
                "setup": r.setup,
                "packets": r.packets,
                "resent": r.resent,
                "probes": r.probes,
                "spurious_probes": r.spurious,
                "timeouts": r.timeouts,
            })
        })
        .collect();
    format!(
        "{}\n",
        json!({ "setups": setups, "metrics": items, "engine": engine })
    )
}

/// `v` rounded to `decimals` places as a JSON number, or `null` when it is not a number (NaN
/// or infinite: a run that measured nothing, a ratio to zero). The benches' JSON goes through
/// serde_json, so it always parses.
pub fn json_num(v: f64, decimals: i32) -> serde_json::Value {
    let k = 10f64.powi(decimals.min(15));
    let r = if decimals >= 15 {
        v
    } else {
        (v * k).round() / k
    };
    serde_json::Number::from_f64(r)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

/// An SVG bar chart of the ratios (one group per metric; a line at 1.0x).
pub fn svg(metrics: &[Metric]) -> String {
    // The setups this run has ratios for (smcr-verbs only where an RDMA device is), each with
    // its colour.
    let (series, colors): (Vec<Setup>, Vec<&str>) = [
        (Setup::SmcrLocal, "#1f77b4"),
        (Setup::SmcrXuser, "#2ca02c"),
        (Setup::SmcrSamehostNs, "#9467bd"),
        (Setup::SmcrRemote, "#ff7f0e"),
        (Setup::Fallback, "#7f7f7f"),
        (Setup::SmcrVerbs, "#d62728"),
    ]
    .into_iter()
    .filter(|(s, _)| metrics.iter().any(|m| m.ratio(*s).is_some()))
    .unzip();
    let max = metrics
        .iter()
        .flat_map(|m| series.iter().filter_map(|s| m.ratio(*s)))
        .fold(1.5f64, f64::max)
        .min(20.0);
    let (left, bar, gap, width) = (250.0, 10.0, 8.0, 500.0);
    let group = bar * series.len() as f64 + gap;
    let height = 40.0 + group * metrics.len() as f64 + 30.0;
    let x = |r: f64| left + width * (r.min(max) / max);
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        left + width + 60.0
    );
    let _ = writeln!(
        o,
        "<text x=\"10\" y=\"18\" font-size=\"13\">smcr / plain TCP (same topology); latency rows: lower is better</text>"
    );
    for (i, m) in metrics.iter().enumerate() {
        let y0 = 30.0 + group * i as f64;
        let _ = writeln!(
            o,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left - 6.0,
            y0 + bar * 1.8,
            m.name
        );
        for (k, s) in series.iter().enumerate() {
            if let Some(r) = m.ratio(*s) {
                let y = y0 + bar * k as f64;
                let _ = writeln!(
                    o,
                    "<rect x=\"{left}\" y=\"{y}\" width=\"{:.1}\" height=\"{}\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\">{r:.2}x</text>",
                    x(r) - left,
                    bar - 1.0,
                    colors[k],
                    x(r) + 3.0,
                    y + bar - 2.0
                );
            }
        }
    }
    let bottom = 30.0 + group * metrics.len() as f64;
    let _ = writeln!(
        o,
        "<line x1=\"{0:.1}\" y1=\"26\" x2=\"{0:.1}\" y2=\"{bottom}\" stroke=\"black\" stroke-dasharray=\"4 3\"/><text x=\"{0:.1}\" y=\"{1:.1}\" text-anchor=\"middle\">1.0x</text>",
        x(1.0),
        bottom + 12.0
    );
    for (k, s) in series.iter().enumerate() {
        let lx = 10.0 + 150.0 * k as f64;
        let _ = writeln!(
            o,
            "<rect x=\"{lx}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            bottom + 18.0,
            colors[k],
            lx + 14.0,
            bottom + 27.0,
            s.name()
        );
    }
    o.push_str("</svg>\n");
    o
}

/// Parses `--only a,b`.
pub fn parse_setups(list: &str) -> Result<Vec<Setup>> {
    list.split(',')
        .map(|n| {
            Setup::ALL
                .into_iter()
                .find(|s| s.name() == n.trim())
                .with_context(|| format!("unknown setup {n:?}"))
        })
        .collect()
}

/// Parses `--workloads a,b`.
pub fn parse_workloads(list: &str) -> Result<Vec<&'static str>> {
    list.split(',')
        .map(|n| {
            WORKLOADS
                .into_iter()
                .find(|w| *w == n.trim())
                .with_context(|| format!("unknown workload {n:?}; workloads: {WORKLOADS:?}"))
        })
        .collect()
}

/// Writes `text` to `path`.
pub fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Where the bench writes its outputs unless told (`--json`, `--svg`): `bench/` in the cargo
/// target directory the bench binary was built into (`target/release/bench` →
/// `target/bench/`), generated output staying out of the sources; a binary elsewhere writes
/// to the current directory.
pub fn out_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.to_path_buf()))
        .filter(|t| t.join("CACHEDIR.TAG").exists() || t.file_name().is_some_and(|n| n == "target"))
        .map_or_else(|| PathBuf::from("."), |t| t.join("bench"))
}

/// Errors unless the tools are there (`ss` and `ip` only for the setups with namespaces).
pub fn check_tools(netns: bool) -> Result<()> {
    require_tools(&["redis-server", "redis-benchmark", "sockperf", "iperf3"])?;
    if netns {
        require_tools(&["ss", "ip"])?;
    }
    Ok(())
}

/// Errors naming the first of `tools` that is not on the PATH.
pub(crate) fn require_tools(tools: &[&str]) -> Result<()> {
    for t in tools {
        let ok = Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("{t} is missing: run scripts/setup.sh as root");
        }
    }
    Ok(())
}
