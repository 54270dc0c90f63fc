//! Logging only on request (`SMCR_LOG=<file>`): never to the application's stdout/stderr, which
//! a daemon may have closed and reused for a client.

use std::io::Write;
use std::sync::OnceLock;

fn path() -> Option<&'static str> {
    static PATH: OnceLock<Option<String>> = OnceLock::new();
    PATH.get_or_init(|| {
        // Made absolute at load: a daemon that changes its directory later keeps logging to
        // the file the user named.
        let p = smcr::env::var("SMCR_LOG").filter(|p| !p.is_empty())?;
        Some(match std::path::absolute(&p) {
            Ok(a) => a.to_string_lossy().into_owned(),
            Err(_) => p,
        })
    })
    .as_deref()
}

/// Reads `SMCR_LOG` now, at load, before the program has threads: were a thread of ours
/// first to log while another forks, the child would find the lazy initialisation still
/// running, for ever (seen: a forked child's first log line never returned). With a log, the
/// `log` facade's records of smcr and rdma (links up and down, failovers, engine errors) go
/// there too, filtered by `SMCR_LOG_LEVEL`.
pub(crate) fn init() {
    let Some(p) = path() else {
        return;
    };
    // The file opened now too, for when its path no longer leads there (a daemon that
    // chroots, as haproxy's worker does).
    if let Ok(f) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
        && let Ok(id) = f.metadata().map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        })
        && let Ok(fd) = smcr::fdzone::place(std::os::fd::OwnedFd::from(f))
    {
        let _ = KEPT.set((fd, id));
    }
    let (level, bad) = match smcr::env::var("SMCR_LOG_LEVEL").as_deref().map(str::trim) {
        None | Some("") => (::log::LevelFilter::Info, None),
        Some(v) => match v.parse::<::log::LevelFilter>() {
            Ok(l) => (l, None),
            Err(_) => (::log::LevelFilter::Info, Some(v.to_string())),
        },
    };
    if ::log::set_logger(&FILE).is_ok() {
        ::log::set_max_level(level);
    }
    if let Some(v) = bad {
        line(format_args!(
            "SMCR_LOG_LEVEL={v:?} is not a level (off, error, warn, info, debug, trace): info"
        ));
    }
}

/// The `log` facade's records, as lines of the log file with their level.
struct FileLog;

static FILE: FileLog = FileLog;

impl ::log::Log for FileLog {
    fn enabled(&self, m: &::log::Metadata<'_>) -> bool {
        m.level() <= ::log::max_level()
    }

    fn log(&self, r: &::log::Record<'_>) {
        if self.enabled(r.metadata()) {
            line(format_args!("{} {}", r.level(), r.args()));
        }
    }

    fn flush(&self) {}
}

/// Whether logging was asked for (to skip work done only for a line).
pub(crate) fn enabled() -> bool {
    path().is_some()
}

/// The log file as opened at load, with its device and inode.
static KEPT: OnceLock<(std::os::fd::OwnedFd, (u64, u64))> = OnceLock::new();

/// UTC time of day to the microsecond (`HH:MM:SS.ffffff`): lines of several processes, and a
/// capture, line up by it (a failover's seconds show).
struct TimeOfDay(std::time::SystemTime);

impl std::fmt::Display for TimeOfDay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self
            .0
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let s = d.as_secs() % 86_400;
        write!(
            f,
            "{:02}:{:02}:{:02}.{:06}",
            s / 3600,
            s / 60 % 60,
            s % 60,
            d.subsec_micros()
        )
    }
}

/// Appends one line (with the pid and the time) to the log file, if logging was asked for:
/// opened by its path (so a file rotated or removed meanwhile is made again), else through the
/// descriptor kept since load, when it still is that file (a program may have closed it and
/// reused the number: no line is ever written into one of its own files or sockets).
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    let Some(p) = path() else { return };
    let _b = crate::bypass::Bypass::new();
    // One write per line: O_APPEND keeps it whole among other processes' lines.
    let line = format!(
        "smcr[{}]: {} {args}\n",
        std::process::id(),
        TimeOfDay(std::time::SystemTime::now())
    );
    // std opens with O_CLOEXEC.
    match std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
    {
        Ok(mut f) => {
            let _ = f.write_all(line.as_bytes());
        }
        Err(_) => {
            use std::os::fd::{AsRawFd, FromRawFd};
            let Some((fd, id)) = KEPT.get() else { return };
            // SAFETY: fstat of our descriptor into a zeroed stat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 && (st.st_dev, st.st_ino) == *id
            {
                // SAFETY: our open descriptor, borrowed for one write (never closed here).
                let mut f = std::mem::ManuallyDrop::new(unsafe {
                    std::fs::File::from_raw_fd(fd.as_raw_fd())
                });
                let _ = f.write_all(line.as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TimeOfDay;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn time_of_day_is_utc_to_the_microsecond() {
        // 2026-11-30 15:55:42.000123 UTC
        let t = UNIX_EPOCH + Duration::new(1_796_054_142, 123_456);
        assert_eq!(TimeOfDay(t).to_string(), "15:55:42.000123");
        assert_eq!(TimeOfDay(UNIX_EPOCH).to_string(), "00:00:00.000000");
        let end = UNIX_EPOCH + Duration::new(86_399, 999_999_999);
        assert_eq!(TimeOfDay(end).to_string(), "23:59:59.999999");
    }
}
