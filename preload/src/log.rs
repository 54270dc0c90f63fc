//! Logging only on request (`SMCR_LOG=<file>`): never to the application's stdout/stderr, which
//! a daemon may have closed and reused for a client.

use std::io::Write;
use std::sync::OnceLock;

fn path() -> Option<&'static str> {
    static PATH: OnceLock<Option<String>> = OnceLock::new();
    PATH.get_or_init(|| smcr::env::var("SMCR_LOG").filter(|p| !p.is_empty()))
        .as_deref()
}

/// Reads `SMCR_LOG` now, at load, before the program has threads: were a thread of ours
/// first to log while another forks, the child would find the lazy initialisation still
/// running, for ever (seen: a forked child's first log line never returned).
pub(crate) fn init() {
    let _ = path();
}

/// Whether logging was asked for (to skip work done only for a line).
pub(crate) fn enabled() -> bool {
    path().is_some()
}

/// Appends one line (with the pid) to the log file, if logging was asked for.
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    let Some(p) = path() else { return };
    let _b = crate::bypass::Bypass::new();
    // std opens with O_CLOEXEC.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
    {
        // One write per line: O_APPEND keeps it whole among other processes' lines.
        let line = format!("smcr[{}]: {args}\n", std::process::id());
        let _ = f.write_all(line.as_bytes());
    }
}
