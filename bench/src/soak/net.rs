//! The network around the soak: nftables faults and their counters, the second path and its
//! flapping, handshake failures in the logs, the tools check.

#[allow(unused_imports)]
use super::*;

/// The nftables rules of one side.
pub(super) fn nft_script(opt: &Options, dev: &str) -> String {
    let m = match opt.faults {
        Faults::Roce => "udp dport 4791",
        Faults::All => "meta protocol ip",
    };
    let pct = |p: f64| (p * 100.0).round() as u32; // numgen over 10000: hundredths of a percent
    let mut s = String::from("table netdev smcr_soak {\n");
    if opt.loss > 0.0 {
        let _ = writeln!(
            s,
            "  chain loss {{ type filter hook ingress device \"{dev}\" priority 0; {m} numgen random mod 10000 < {} counter drop; }}",
            pct(opt.loss)
        );
    }
    if opt.dup > 0.0 {
        // The copy leaves through the same device without passing the egress hook again.
        let _ = writeln!(
            s,
            "  chain copies {{ type filter hook egress device \"{dev}\" priority 0; {m} numgen random mod 10000 < {} counter dup to \"{dev}\"; }}",
            pct(opt.dup)
        );
    }
    s.push_str("}\n");
    s
}

pub(super) fn nft(ns: &str, args: &[&str], input: Option<&str>) -> Result<String> {
    use std::io::Write;
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft")?;
    let mut stdin = c.stdin.take().context("nft stdin")?;
    if let Some(i) = input {
        stdin.write_all(i.as_bytes())?;
    }
    drop(stdin);
    let out = c.wait_with_output()?;
    ensure!(
        out.status.success(),
        "nft {args:?} in {ns}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        input.unwrap_or("")
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Packets the rules of one side dropped and duplicated (their counters).
pub(super) fn nft_counts(ns: &str) -> Result<(u64, u64)> {
    let text = nft(ns, &["list", "table", "netdev", "smcr_soak"], None)?;
    let (mut dropped, mut duplicated) = (0, 0);
    for l in text.lines() {
        let n: u64 = l
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if l.trim_end().ends_with("drop") {
            dropped += n;
        } else if l.contains(" dup to ") {
            duplicated += n;
        }
    }
    Ok((dropped, duplicated))
}

/// Handshake failures in the shim's log (`SMCR_LOG`).
#[derive(Default)]
pub(super) struct Failures {
    /// Reported to a client program.
    pub(super) client: u64,
    /// On the server, because the client closed (or reset) the TCP connection during the CLC
    /// handshake: after a failure of its own (counted in `client`), or with none of its own:
    /// redis-benchmark exits once its last test's requests are done, even while some of that
    /// test's 50 connections are still negotiating (slow when the faults hit TCP too). The
    /// program never used them; the server drops them.
    pub(super) abandoned: u64,
    /// The first few lines.
    pub(super) lines: Vec<String>,
}

pub(super) fn handshake_failures(log: &Path) -> Failures {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut f = Failures::default();
    for l in text.lines().filter(|l| l.contains("handshake failed")) {
        if l.contains(" connect ") {
            f.client += 1;
        } else if l.contains("closed during the CLC handshake")
            || l.contains("Connection reset by peer")
        {
            f.abandoned += 1;
            continue;
        }
        if f.lines.len() < 5 {
            f.lines.push(l.to_owned());
        }
    }
    f
}

/// Errors unless the tools are there.
pub(super) fn check_tools() -> Result<()> {
    crate::app_bench::require_tools(&[
        "redis-server",
        "redis-cli",
        "redis-benchmark",
        "nft",
        "ip",
        "ss",
        "nsenter",
    ])
}

/// `--flap`: joins the namespaces by a second veth pair (10.79.0.0/24) with the alternate
/// addresses on it.
pub(super) fn second_path(env: &Env) -> Result<()> {
    let (ns_a, _) = env.veth(false).context("no namespaces")?;
    let (ns_b, _) = env.veth(true).context("no namespaces")?;
    let pid = std::process::id();
    let (va, vb) = (format!("sb{pid}c"), format!("sb{pid}d"));
    let ip = |args: &[&str]| -> Result<()> {
        let st = Command::new("ip").args(args).status()?;
        ensure!(st.success(), "ip {args:?} failed");
        Ok(())
    };
    ip(&[
        "link", "add", &va, "netns", ns_a, "type", "veth", "peer", "name", &vb, "netns", ns_b,
    ])?;
    let a_addrs = [ALT_CLIENT, ALT_VERIFY_CLIENT];
    let b_addrs: Vec<&str> = ALT_SERVER.split(',').collect();
    for (ns, dev, addrs) in [(ns_a, &va, &a_addrs[..]), (ns_b, &vb, &b_addrs[..])] {
        for a in addrs {
            ip(&["-n", ns, "addr", "add", &format!("{a}/24"), "dev", dev])?;
        }
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    Ok(())
}

/// `--flap`: cuts the first path for [`FLAP_DOWN`] after every [`FLAP_UP`], on a thread of its
/// own, until stopped. Cut means every packet dropped at both ends (nftables, ingress), as a
/// dead switch or cable would: taking the interface down would also remove its routes, and
/// new TCP connections would fail at once (ENETUNREACH) instead of waiting.
pub(super) struct Flapper {
    pub(super) stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub(super) thread: std::thread::JoinHandle<Result<u64>>,
}

impl Flapper {
    pub(super) fn start(sides: Vec<(String, String)>) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || -> Result<u64> {
                let set = |up: bool| -> Result<()> {
                    for (ns, dev) in &sides {
                        if up {
                            nft(ns, &["delete", "table", "netdev", "smcr_flap"], None)?;
                        } else {
                            let script = format!(
                                "table netdev smcr_flap {{\n  chain cut {{ type filter hook ingress device \"{dev}\" priority -10; counter drop; }}\n}}\n"
                            );
                            nft(ns, &["-f", "-"], Some(&script))?;
                        }
                    }
                    Ok(())
                };
                // Sleeps `d` unless stopped first; true when stopped.
                let pause = |d: Duration| {
                    let until = Instant::now() + d;
                    while Instant::now() < until {
                        if stop.load(Ordering::Relaxed) {
                            return true;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    stop.load(Ordering::Relaxed)
                };
                let mut flaps = 0;
                while !pause(FLAP_UP) {
                    set(false)?;
                    flaps += 1;
                    eprintln!(
                        "  flap {flaps}: first path cut for {} s",
                        FLAP_DOWN.as_secs()
                    );
                    let stopped = pause(FLAP_DOWN);
                    set(true)?;
                    if stopped {
                        break;
                    }
                }
                Ok(flaps)
            })
        };
        Self { stop, thread }
    }

    /// Stops flapping with the path up; returns how many times it went down.
    pub(super) fn stop(self) -> Result<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the flapper panicked"))?
    }
}
