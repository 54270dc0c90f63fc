//! What a sandbox may forbid this process, read from what is safe to read: a system call that a
//! seccomp filter forbids kills the process (systemd's default action), so the library never
//! finds out by making the call. Features that need a call outside what every service's filter
//! allows (systemd's `@system-service` without `@privileged` and `@resources`; docs/running.md
//! lists the library's calls) ask here first and are skipped when a filter is on.

use std::sync::OnceLock;

/// The process's seccomp state, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seccomp {
    /// `Seccomp:`: 0 none, 1 strict, 2 filter.
    pub mode: u32,
    /// `Seccomp_filters:`: how many filters are stacked (0 when the kernel does not say).
    pub filters: u32,
}

impl Seccomp {
    /// Now (a file read: not for hot paths). `None` when /proc cannot be read, which callers
    /// treat as filtered.
    pub fn now() -> Option<Self> {
        parse(&std::fs::read_to_string("/proc/self/status").ok()?)
    }

    /// As the process was when the library was loaded (its first call), for comparing: a
    /// filter added later is the program's own lock-down, whose rules we cannot read.
    pub fn at_load() -> Option<Self> {
        static AT_LOAD: OnceLock<Option<Seccomp>> = OnceLock::new();
        *AT_LOAD.get_or_init(Self::now)
    }
}

/// Whether a seccomp filter (or strict mode) may forbid calls outside the service baseline:
/// true when one is on, or when the process's status cannot be read.
pub fn filtered() -> bool {
    Seccomp::now().is_none_or(|s| s.mode != 0)
}

fn parse(status: &str) -> Option<Seccomp> {
    let field = |name: &str| {
        status.lines().find_map(|l| {
            let v = l.strip_prefix(name)?.strip_prefix(':')?;
            v.trim().parse::<u32>().ok()
        })
    };
    Some(Seccomp {
        mode: field("Seccomp")?,
        filters: field("Seccomp_filters").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields() {
        let s =
            "Name:\tredis-server\nSeccomp:\t2\nSeccomp_filters:\t3\nSpeculation_Store_Bypass:\tx\n";
        assert_eq!(
            parse(s),
            Some(Seccomp {
                mode: 2,
                filters: 3
            })
        );
        // Kernels before 5.9 have no filter count.
        assert_eq!(
            parse("Seccomp:\t0\n"),
            Some(Seccomp {
                mode: 0,
                filters: 0
            })
        );
        assert_eq!(parse("Name:\tx\n"), None);
        assert_eq!(parse("Seccomp:\tgarbage\n"), None);
    }

    #[test]
    fn this_process_reads_its_own() {
        let s = Seccomp::now().expect("/proc/self/status");
        assert!(s.mode <= 2);
    }
}
