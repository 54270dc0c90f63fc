//! What a sandbox may forbid this process, read from what is safe to read: a system call that a
//! seccomp filter forbids kills the process (systemd's default action), so the library never
//! finds out by making the call. Features that need a call outside what every service's filter
//! allows (systemd's `@system-service` without `@privileged` and `@resources`; docs/running.md
//! lists the library's calls) ask here first and are skipped when a filter is on.

/// Whether a seccomp filter (or strict mode) may forbid calls outside the service baseline:
/// true when one is on for the calling thread, or when its status cannot be read.
pub fn filtered() -> bool {
    crate::thread::procfs::read_now().is_none_or(|s| s.mode != 0)
}

/// The user namespace this process is in, as its `uid_map` says: who a uid seen here really
/// is. Outside the initial namespace (systemd's `PrivateUsers=`, a container) the kernel shows
/// every user it does not map as the overflow uid (65534), which may also be a user mapped
/// here (`nobody`): such a uid names nobody in particular.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserNs {
    /// (inside, outside, count) ranges.
    map: Vec<(u32, u32, u32)>,
    /// `/proc/sys/kernel/overflowuid`.
    overflow: u32,
}

impl UserNs {
    /// This process's (read now: a process can enter another namespace).
    pub fn now() -> Self {
        let map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
        let overflow = std::fs::read_to_string("/proc/sys/kernel/overflowuid")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(65534);
        Self::parse(&map, overflow)
    }

    fn parse(uid_map: &str, overflow: u32) -> Self {
        let map = uid_map
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace().map(|x| x.parse::<u32>().ok());
                Some((w.next()??, w.next()??, w.next()??))
            })
            .collect();
        Self { map, overflow }
    }

    /// The initial user namespace (the whole range maps to itself).
    pub fn initial(&self) -> bool {
        self.map == [(0, 0, u32::MAX)]
    }

    /// Whether `uid`, as this process sees it, is one user: always in the initial namespace;
    /// elsewhere any uid but the overflow one (an unmapped user, whoever it is).
    pub fn names_one_user(&self, uid: u32) -> bool {
        self.initial() || uid != self.overflow
    }

    /// Whether uid 0 here is the host's root (the initial namespace, or 0 mapped to 0, as
    /// systemd's `PrivateUsers=` maps it); a container's root is not.
    pub fn root_is_real(&self) -> bool {
        self.initial()
            || self
                .map
                .iter()
                .any(|&(inside, outside, n)| inside == 0 && outside == 0 && n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_namespaces() {
        let init = UserNs::parse("         0          0 4294967295\n", 65534);
        assert!(init.initial() && init.root_is_real() && init.names_one_user(65534));
        // systemd's PrivateUsers= with User=nobody: root and nobody mapped to themselves.
        let unit = UserNs::parse("0 0 1\n65534 65534 1\n", 65534);
        assert!(!unit.initial() && unit.root_is_real());
        assert!(unit.names_one_user(0) && !unit.names_one_user(65534));
        // A container: its root is an unprivileged user of the host.
        let container = UserNs::parse("0 100000 65536\n", 65534);
        assert!(!container.root_is_real() && !container.names_one_user(65534));
        assert!(!UserNs::parse("", 65534).initial());
    }

    #[test]
    fn this_thread_is_not_filtered() {
        // The test harness installs no filter.
        assert!(!filtered());
    }
}
