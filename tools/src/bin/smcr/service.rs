//! `smcr service enable|disable|check UNIT`: turning smcr on for a systemd service the way an
//! administrator would (a drop-in with `Environment=LD_PRELOAD=…`), and saying what the unit's
//! hardening means for smcr (docs/running.md *Services under systemd*).
//!
//! The unit files are parsed here (a pure part, tested below); the system-call groups of
//! `SystemCallFilter=` are expanded by `systemd-analyze syscall-filter`, as systemd itself
//! defines them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every system call the library makes in a program's process (docs/running.md lists them by
/// what they do). A unit whose filter forbids one would kill the service.
pub(crate) const LIBRARY_SYSCALLS: &[&str] = &[
    "accept4",
    "bind",
    "capget",
    "chmod",
    "clock_nanosleep",
    "clone",
    "clone3",
    "close",
    "connect",
    "epoll_create1",
    "epoll_ctl",
    "epoll_pwait",
    "epoll_wait",
    "eventfd2",
    "exit",
    "fallocate",
    "fchmod",
    "fcntl",
    "flock",
    "fstat",
    "ftruncate",
    "futex",
    "getdents64",
    "getpeername",
    "getpid",
    "getsockname",
    "getsockopt",
    "gettid",
    "kill",
    "madvise",
    "memfd_create",
    "mkdir",
    "mmap",
    "mprotect",
    "munmap",
    "open",
    "openat",
    "poll",
    "ppoll",
    "prctl",
    "prlimit64",
    "read",
    "readlinkat",
    "recvfrom",
    "recvmmsg",
    "recvmsg",
    "rename",
    "rseq",
    "rt_sigprocmask",
    "sched_yield",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "set_robust_list",
    "setsockopt",
    "sigaltstack",
    "socket",
    "socketpair",
    "statx",
    "unlink",
    "write",
];

/// The drop-in's file name.
pub(crate) const DROPIN: &str = "smcr.conf";

/// A unit's `[Service]` assignments, in the order systemd reads them (the unit file, then its
/// drop-ins by name).
#[derive(Debug, Default, Clone)]
pub(crate) struct Settings(pub(crate) Vec<(String, String)>);

impl Settings {
    /// Adds the `[Service]` assignments of one file's text.
    pub(crate) fn read(&mut self, text: &str) {
        let mut section = String::new();
        let mut pending = String::new();
        for raw in text.lines() {
            let line = raw.trim();
            if pending.is_empty() && (line.is_empty() || line.starts_with(['#', ';'])) {
                continue;
            }
            // A trailing backslash continues the line.
            if let Some(head) = line.strip_suffix('\\') {
                pending.push_str(head);
                pending.push(' ');
                continue;
            }
            pending.push_str(line);
            let full = std::mem::take(&mut pending);
            if full.starts_with('[') && full.ends_with(']') {
                section = full[1..full.len() - 1].to_owned();
            } else if section == "Service"
                && let Some((k, v)) = full.split_once('=')
            {
                self.0.push((k.trim().to_owned(), v.trim().to_owned()));
            }
        }
    }

    /// The last value of a single-valued setting.
    pub(crate) fn last(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A list setting's assignments since the last empty one (which resets it).
    pub(crate) fn list(&self, key: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for (k, v) in &self.0 {
            if k == key {
                if v.is_empty() {
                    out.clear();
                } else {
                    out.push(v.as_str());
                }
            }
        }
        out
    }

    /// A boolean setting (systemd's spellings).
    pub(crate) fn yes(&self, key: &str) -> bool {
        self.last(key)
            .is_some_and(|v| matches!(v, "1" | "yes" | "true" | "on"))
    }

    /// The environment `Environment=` gives (later assignments of a variable win).
    pub(crate) fn environment(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = Vec::new();
        for v in self.list("Environment") {
            for word in split_words(v) {
                if let Some((k, val)) = word.split_once('=') {
                    env.retain(|(e, _)| e != k);
                    env.push((k.to_owned(), val.to_owned()));
                }
            }
        }
        env
    }
}

/// Splits a value into words, honouring double and single quotes (as systemd does for
/// `Environment=`).
fn split_words(v: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut any = false;
    for c in v.chars() {
        match (quote, c) {
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// One finding of [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finding {
    /// Works as it is.
    Ok(String),
    /// Works, with something the administrator should know.
    Note(String),
    /// smcr does not run in this service (or kills it): must be fixed.
    Problem(String),
}

/// What a unit's settings mean for smcr, with `lib` the library it should preload and
/// `allowed` the system calls its `SystemCallFilter=` allows (`None`: no filter, or it could
/// not be expanded — then `filter_expanded` says which).
pub(crate) fn check(
    s: &Settings,
    lib: &Path,
    allowed: Option<&BTreeSet<String>>,
    filter_expanded: bool,
) -> Vec<Finding> {
    use Finding::*;
    let mut out = Vec::new();
    let env = s.environment();
    let preload = env
        .iter()
        .find(|(k, _)| k == "LD_PRELOAD")
        .map(|(_, v)| v.clone());
    let ours = preloaded_library(s);
    match (&preload, &ours) {
        (_, Some(p)) => out.push(Ok(format!(
            "LD_PRELOAD names the library ({})",
            p.display()
        ))),
        (Some(p), None) => out.push(Problem(format!(
            "LD_PRELOAD is `{p}`, without the smcr library: `smcr service enable`"
        ))),
        (None, None) => out.push(Problem(
            "no LD_PRELOAD in the unit's environment: `smcr service enable` writes the drop-in"
                .into(),
        )),
    }
    // The library as the loader will look for it.
    let lib = ours.clone().unwrap_or_else(|| lib.to_path_buf());
    if lib.is_relative() {
        out.push(Note(format!(
            "LD_PRELOAD names {} by name: the loader finds it in its search path (/usr/lib, ld.so.cache)",
            lib.display()
        )));
    }
    let no_exec = s.list("NoExecPaths");
    if !no_exec.is_empty() {
        let strip = |p: &str| p.trim_start_matches(['-', '+']).to_owned();
        let covered = |dirs: &[&str]| {
            dirs.iter().flat_map(|d| d.split_whitespace()).any(|d| {
                let d = strip(d);
                lib.is_relative() && (d == "/usr/lib" || d == "/lib")
                    || lib.starts_with(Path::new(&d))
            })
        };
        let exec = s.list("ExecPaths");
        if covered(&no_exec) && !covered(&exec) {
            out.push(Problem(format!(
                "NoExecPaths= covers {} and ExecPaths= does not: the loader drops the library and the service runs without smcr; install it under an ExecPaths= entry (scripts/install.sh: /usr/lib) or add ExecPaths={}",
                lib.display(),
                lib.parent().unwrap_or(Path::new("/")).display()
            )));
        } else {
            out.push(Ok(format!(
                "NoExecPaths=/ExecPaths= let the loader map {}",
                lib.display()
            )));
        }
    }
    let filters = s.list("SystemCallFilter");
    if !filters.is_empty() {
        match allowed {
            Some(allowed) => {
                let missing: Vec<&str> = LIBRARY_SYSCALLS
                    .iter()
                    .copied()
                    .filter(|c| !allowed.contains(*c))
                    .collect();
                if missing.is_empty() {
                    out.push(Ok(
                        "SystemCallFilter= allows every call the library makes".into()
                    ));
                } else {
                    out.push(Problem(format!(
                        "SystemCallFilter= forbids calls the library makes ({}): the service would be killed; allow them or leave smcr off",
                        missing.join(" ")
                    )));
                }
            }
            None if !filter_expanded => out.push(Note(
                "SystemCallFilter= not checked: `systemd-analyze syscall-filter` is not available here"
                    .into(),
            )),
            None => {}
        }
    }
    let families = s.list("RestrictAddressFamilies").join(" ");
    if !families.trim().is_empty() {
        let words: Vec<&str> = families.split_whitespace().collect();
        let (deny, names): (bool, Vec<&str>) = match words.first() {
            Some(w) if w.starts_with('~') => (
                true,
                words.iter().map(|w| w.trim_start_matches('~')).collect(),
            ),
            _ => (false, words.clone()),
        };
        let allows = |f: &str| names.contains(&f) != deny;
        if names == ["none"] && !deny {
            out.push(Problem(
                "RestrictAddressFamilies=none: no sockets at all".into(),
            ));
        } else if !allows("AF_INET") {
            out.push(Problem(
                "RestrictAddressFamilies= forbids AF_INET: no TCP, no RoCE over UDP".into(),
            ));
        } else if !allows("AF_UNIX") {
            out.push(Note(
                "RestrictAddressFamilies= forbids AF_UNIX: same-host peers use RoCE over UDP on loopback instead of shared memory".into(),
            ));
        } else {
            out.push(Ok(
                "RestrictAddressFamilies= allows AF_INET and AF_UNIX (without AF_NETLINK, sockets passed over a socketpair to a child go as TCP)"
                    .into(),
            ));
        }
    }
    if s.yes("PrivateNetwork") {
        out.push(Note(
            "PrivateNetwork=: the service has only its own loopback; SMC-R with peers in that namespace only".into(),
        ));
    }
    if s.yes("PrivateDevices") || s.yes("PrivateTmp") {
        out.push(Note(
            "PrivateDevices=/PrivateTmp=: the stats area is in a private /dev/shm; smc-stat shows it when run as root".into(),
        ));
    }
    if s.yes("PrivateUsers") {
        out.push(Note(
            "PrivateUsers=: peers outside the user namespace look like nobody; same-host shared memory only with peers of the service's own user".into(),
        ));
    }
    if let Some(n) = s.last("LimitNPROC").or(s.last("TasksMax")) {
        out.push(Note(format!(
            "a thread limit ({n}): smcr creates its threads early and keeps spares (SMCR_SPARE_THREADS); past them connections stay TCP with NOTHREAD"
        )));
    }
    out
}

/// The smcr library the unit's `LD_PRELOAD` names, if any.
pub(crate) fn preloaded_library(s: &Settings) -> Option<PathBuf> {
    let env = s.environment();
    let preload = env.iter().find(|(k, _)| k == "LD_PRELOAD")?;
    preload
        .1
        .split([' ', ':'])
        .find(|w| {
            Path::new(w)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libsmcr"))
        })
        .map(PathBuf::from)
}

/// The directories systemd reads units from, in its order of precedence.
pub(crate) const UNIT_DIRS: &[&str] = &[
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
];

/// `name` as a full unit name (`.service` added), and its template (`a@.service` for
/// `a@b.service`).
pub(crate) fn unit_names(name: &str) -> (String, Option<String>) {
    let full = if name.contains('.') {
        name.to_owned()
    } else {
        format!("{name}.service")
    };
    let template = full
        .split_once('@')
        .filter(|(_, rest)| !rest.starts_with('.'))
        .map(|(head, rest)| {
            let suffix = rest.rsplit_once('.').map_or("service", |(_, s)| s);
            format!("{head}@.{suffix}")
        });
    (full, template)
}

/// Reads unit `name` and its drop-ins (and those in `extra`), as systemd would.
pub(crate) fn load(name: &str, extra: Option<&Path>) -> Result<(Settings, Vec<PathBuf>), String> {
    let (full, template) = unit_names(name);
    let candidates: Vec<&String> = std::iter::once(&full).chain(template.as_ref()).collect();
    let unit = candidates
        .iter()
        .flat_map(|n| UNIT_DIRS.iter().map(move |d| Path::new(d).join(n)))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("no unit file for {full} under {}", UNIT_DIRS.join(", ")))?;
    let mut files = vec![unit];
    // Drop-ins of the template, then of the unit; the same file name in an earlier directory
    // hides a later one; all are read in file-name order.
    let mut dropins: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for n in candidates.iter().rev() {
        for d in UNIT_DIRS.iter().rev() {
            collect_dropins(&Path::new(d).join(format!("{n}.d")), &mut dropins);
        }
    }
    if let Some(e) = extra {
        collect_dropins(e, &mut dropins);
    }
    files.extend(dropins.into_values());
    let mut s = Settings::default();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        s.read(&text);
    }
    Ok((s, files))
}

fn collect_dropins(dir: &Path, into: &mut std::collections::BTreeMap<String, PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "conf") {
            into.insert(e.file_name().to_string_lossy().into_owned(), p);
        }
    }
}

/// The system calls a `SystemCallFilter=` list allows, with the groups expanded by
/// `systemd-analyze syscall-filter`; `None` when that is not available.
pub(crate) fn allowed_calls(filters: &[&str]) -> Option<BTreeSet<String>> {
    fn expand(group: &str, seen: &mut BTreeSet<String>) -> Option<BTreeSet<String>> {
        if !seen.insert(group.to_owned()) {
            return Some(BTreeSet::new());
        }
        let out = std::process::Command::new("systemd-analyze")
            .args(["syscall-filter", group])
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let mut names = BTreeSet::new();
        for line in String::from_utf8_lossy(&out.stdout).lines().skip(1) {
            let w = line.trim();
            if w.is_empty() || w.starts_with('#') {
                continue;
            }
            if w.starts_with('@') {
                names.extend(expand(w, seen)?);
            } else {
                names.insert(w.to_owned());
            }
        }
        Some(names)
    }
    let mut allowed: Option<BTreeSet<String>> = None;
    for f in filters {
        let (deny, body) = match f.strip_prefix('~') {
            Some(b) => (true, b),
            None => (false, *f),
        };
        let mut set = BTreeSet::new();
        for w in body.split_whitespace() {
            let w = w.split(':').next().unwrap_or(w); // an errno suffix
            if w.starts_with('@') {
                set.extend(expand(w, &mut BTreeSet::new())?);
            } else {
                set.insert(w.to_owned());
            }
        }
        allowed = Some(match (allowed, deny) {
            // A deny list first: everything else is allowed; approximate with the calls we
            // care about.
            (None, true) => LIBRARY_SYSCALLS
                .iter()
                .map(|c| c.to_string())
                .filter(|c| !set.contains(c))
                .collect(),
            (None, false) => set,
            (Some(a), true) => a.difference(&set).cloned().collect(),
            (Some(a), false) => a.union(&set).cloned().collect(),
        });
    }
    allowed
}

/// The drop-in that turns smcr on: `LD_PRELOAD` with the library first, keeping what the
/// unit preloads already.
pub(crate) fn dropin(lib: &Path, existing: Option<&str>) -> String {
    let mut preload = lib.display().to_string();
    if let Some(e) = existing {
        for w in e.split([' ', ':']).filter(|w| !w.is_empty()) {
            if Path::new(w).file_name() != lib.file_name() {
                preload.push(' ');
                preload.push_str(w);
            }
        }
    }
    format!(
        "# Written by `smcr service enable`: the service's TCP sockets use SMC-R where the peer\n\
         # can (docs/running.md, Services under systemd). `smcr service disable` removes it.\n\
         [Service]\n\
         Environment=\"LD_PRELOAD={preload}\"\n\
         # Peers in other network namespaces find the service here (ProtectSystem=strict\n\
         # would make it read-only; `-`: nothing if smcr bpf install has not made it).\n\
         ReadWritePaths=-{rdv}\n",
        rdv = rdma::RENDEZVOUS_DIR
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const REDIS: &str = "[Unit]\nDescription=x\n[Service]\nType=notify\nUser=redis\n\
        NoExecPaths=/\nExecPaths=/usr/bin/redis-server /usr/lib /lib\n\
        SystemCallFilter=@system-service\nSystemCallFilter=~ @privileged @resources\n\
        RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX\nPrivateDevices=true\n\
        ExecStart=/usr/bin/redis-server \\\n  /etc/redis/redis.conf\n";

    #[test]
    fn parses_sections_continuations_lists_and_resets() {
        let mut s = Settings::default();
        s.read(REDIS);
        assert_eq!(s.last("User"), Some("redis"));
        assert_eq!(
            s.last("ExecStart"),
            Some("/usr/bin/redis-server  /etc/redis/redis.conf")
        );
        assert_eq!(s.last("Description"), None, "only [Service]");
        assert_eq!(s.list("SystemCallFilter").len(), 2);
        s.read("[Service]\nSystemCallFilter=\nSystemCallFilter=@basic-io\n");
        assert_eq!(s.list("SystemCallFilter"), ["@basic-io"]);
        assert!(s.yes("PrivateDevices") && !s.yes("PrivateUsers"));
    }

    #[test]
    fn environment_words_quotes_and_later_wins() {
        let mut s = Settings::default();
        s.read("[Service]\nEnvironment=A=1 \"B=two words\"\nEnvironment=A=3\n");
        assert_eq!(
            s.environment(),
            [("B".into(), "two words".into()), ("A".into(), "3".into())]
        );
    }

    fn problems(f: &[Finding]) -> Vec<&String> {
        f.iter()
            .filter_map(|f| match f {
                Finding::Problem(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_library_outside_exec_paths_is_a_problem_and_usr_lib_is_not() {
        let all: BTreeSet<String> = LIBRARY_SYSCALLS.iter().map(|c| c.to_string()).collect();
        let mut s = Settings::default();
        s.read(REDIS);
        s.read(&dropin(Path::new("/usr/local/lib/libsmcr.so"), None));
        let f = check(&s, Path::new("/usr/lib/libsmcr.so"), Some(&all), true);
        let p = problems(&f);
        assert_eq!(p.len(), 1, "{f:?}");
        assert!(p[0].contains("NoExecPaths") && p[0].contains("/usr/local/lib"));

        let mut s = Settings::default();
        s.read(REDIS);
        s.read(&dropin(Path::new("/usr/lib/libsmcr.so"), None));
        let f = check(&s, Path::new("/usr/lib/libsmcr.so"), Some(&all), true);
        assert!(problems(&f).is_empty(), "{f:?}");
        assert!(f.contains(&Finding::Ok(
            "SystemCallFilter= allows every call the library makes".into()
        )));
    }

    #[test]
    fn missing_preload_and_forbidden_calls_are_problems() {
        let mut s = Settings::default();
        s.read(REDIS);
        let mut some: BTreeSet<String> = LIBRARY_SYSCALLS.iter().map(|c| c.to_string()).collect();
        some.remove("memfd_create");
        let f = check(&s, Path::new("/usr/lib/libsmcr.so"), Some(&some), true);
        let p = problems(&f);
        assert_eq!(p.len(), 2, "{f:?}");
        assert!(p.iter().any(|p| p.contains("no LD_PRELOAD")));
        assert!(p.iter().any(|p| p.contains("memfd_create")));
    }

    #[test]
    fn the_dropin_keeps_other_preloads_once() {
        let d = dropin(
            Path::new("/usr/lib/libsmcr.so"),
            Some("/usr/lib/libjemalloc.so /usr/local/lib/libsmcr.so"),
        );
        assert!(
            d.contains("Environment=\"LD_PRELOAD=/usr/lib/libsmcr.so /usr/lib/libjemalloc.so\""),
            "{d}"
        );
        let mut s = Settings::default();
        s.read(&d);
        assert_eq!(
            s.environment(),
            [(
                "LD_PRELOAD".into(),
                "/usr/lib/libsmcr.so /usr/lib/libjemalloc.so".into()
            )]
        );
    }

    #[test]
    fn unit_names_and_templates() {
        assert_eq!(
            unit_names("redis-server"),
            ("redis-server.service".into(), None)
        );
        assert_eq!(
            unit_names("postgresql@15-main"),
            (
                "postgresql@15-main.service".into(),
                Some("postgresql@.service".into())
            )
        );
        assert_eq!(unit_names("postgresql@.service").1, None);
    }

    #[test]
    fn the_library_needs_only_what_services_allow() {
        // Debian's redis unit's filter, as systemd defines the groups here.
        let Some(allowed) = allowed_calls(&["@system-service", "~ @privileged @resources"]) else {
            eprintln!("SKIP: systemd-analyze is not available");
            return;
        };
        let missing: Vec<_> = LIBRARY_SYSCALLS
            .iter()
            .filter(|c| !allowed.contains(**c))
            .collect();
        assert!(missing.is_empty(), "{missing:?}");
        assert!(!allowed.contains("bpf"), "{allowed:?}");
    }
}
