//! The distribution-like harness of `distro.rs`: a world-readable directory per test with
//! copies of the library and binaries, programs started as a distribution starts them (a
//! non-root user, `ulimit -n`, a clean environment, optionally in a network namespace), their
//! output and shim logs in files, and the SMC-R verdict: `smc-stat --json` rows and process
//! totals, the bytes the servers' TCP sockets carried (`ss -ti`), and the shim logs' counts.
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common;

/// What a service manager gives a program: no user's PATH (the test's may point into root's
/// home, e.g. pyenv shims that other users cannot read).
pub const CLEAN_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The most one server-side TCP socket of an SMC-R connection may carry each way: the CLC
/// handshake (Proposal 156 + Confirm 180 or 108 in, Accept out).
pub const CLC_BYTES: u64 = 512;

/// How long a client may take before it counts as hung (killed, the test fails).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(45);

/// A user from /etc/passwd.
#[derive(Clone, Debug)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl User {
    pub fn get(name: &str) -> Option<Self> {
        let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
        passwd.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 || f[0] != name {
                return None;
            }
            Some(Self {
                name: name.to_owned(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
            })
        })
    }

    /// `name`, or `nobody` where the system has no such user.
    pub fn or_nobody(name: &str) -> Self {
        Self::get(name)
            .or_else(|| Self::get("nobody"))
            .expect("no user nobody")
    }
}

/// Where a program runs.
#[derive(Clone, Debug)]
pub enum Net {
    /// The test's own network namespace.
    Host,
    /// `nsenter --net=/run/netns/NAME` (keeps /sys and so /sys/fs/bpf).
    Nsenter(String),
    /// `ip netns exec NAME` (remounts /sys: the option program's pins are not visible).
    IpNetnsExec(String),
}

impl Net {
    fn ns(&self) -> Option<&str> {
        match self {
            Self::Host => None,
            Self::Nsenter(n) | Self::IpNetnsExec(n) => Some(n),
        }
    }

    /// A root command in this namespace (for `ss`).
    fn root_cmd(&self, prog: &str) -> Command {
        let mut c = match self.ns() {
            None => Command::new(prog),
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(prog);
                c
            }
        };
        c.env("PATH", CLEAN_PATH);
        c
    }
}

/// How to start one program.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Names its log and output files; unique within a test.
    pub name: String,
    /// `None`: root (e.g. nginx's master, which drops to its workers' user itself).
    pub user: Option<User>,
    /// `ulimit -n` (soft = hard).
    pub nofile: u32,
    pub net: Net,
    /// Under the shim (LD_PRELOAD), or plain.
    pub shim: bool,
    /// Through the launcher (`smcr run --log LOG -- PROG`) instead of LD_PRELOAD.
    pub launcher: bool,
    pub cwd: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// A pipe to its stdin (closed by `Proc::close_stdin` or on drop).
    pub stdin: bool,
    /// Run as a systemd unit runs it (`scripts/unit-sandbox.py`), not as `user`/`nofile` say.
    pub unit: Option<UnitSpec>,
}

/// A program run with a systemd unit's settings applied as systemd applies them
/// (`scripts/unit-sandbox.py`: the unit's user, limits, environment, namespaces and seccomp
/// filters); under the shim the library is turned on by a drop-in, as an administrator does
/// (`systemctl edit UNIT` → `Environment=LD_PRELOAD=…`).
#[derive(Clone, Debug)]
pub struct UnitSpec {
    /// The unit (`redis-server`, `postgresql@15-main`), or the path of a unit file.
    pub name: String,
    /// [Service] lines of the test's own drop-in (a data directory in `ReadWritePaths=`, …).
    pub conf: Vec<String>,
}

impl Spec {
    pub fn user(mut self, u: &User) -> Self {
        self.user = Some(u.clone());
        self
    }
    pub fn nofile(mut self, n: u32) -> Self {
        self.nofile = n;
        self
    }
    pub fn net(mut self, net: Net) -> Self {
        self.net = net;
        self
    }
    pub fn launcher(mut self) -> Self {
        self.launcher = true;
        self
    }
    pub fn cwd(mut self, d: &Path) -> Self {
        self.cwd = Some(d.to_owned());
        self
    }
    pub fn stdin(mut self) -> Self {
        self.stdin = true;
        self
    }
    /// Without the shim even in a shimmed world (set-up steps such as initdb).
    pub fn plain(mut self) -> Self {
        self.shim = false;
        self
    }
    /// Under systemd unit `name`'s settings.
    pub fn unit(mut self, name: &str) -> Self {
        self.unit = Some(UnitSpec {
            name: name.to_owned(),
            conf: Vec::new(),
        });
        self
    }
    /// One more [Service] line in the unit's drop-in (after `unit`).
    pub fn unit_conf(mut self, line: &str) -> Self {
        self.unit
            .as_mut()
            .expect("unit_conf without unit")
            .conf
            .push(line.to_owned());
        self
    }
}

/// The unit runner (`scripts/unit-sandbox.py`), run by Debian's Python, which has
/// python3-seccomp (a pyenv `python3` first in PATH does not).
pub fn unit_sandbox() -> (PathBuf, PathBuf) {
    (
        PathBuf::from("/usr/bin/python3"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/unit-sandbox.py"),
    )
}

/// A program of the test, in a process group of its own: the group (workers, forked
/// children) is killed however the test ends.
pub struct Proc {
    pub name: String,
    child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
    stdin: Option<ChildStdin>,
}

impl Proc {
    /// The program's pid (every wrapper execs: prlimit, setpriv, env, nsenter, ip netns exec).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// How it ended, if it has.
    pub fn status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Every live process of its group (the program, its workers and forked children).
    pub fn group(&self) -> Vec<u32> {
        let pgid = self.pid();
        let mut pids = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() > 2 && f[0] != "Z" && f[2].parse::<u32>() == Ok(pgid) {
                pids.push(pid);
            }
        }
        pids.sort_unstable();
        pids
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    pub fn write_stdin(&mut self, s: &str) {
        if let Some(i) = self.stdin.as_mut() {
            let _ = i.write_all(s.as_bytes());
        }
    }

    /// Waits up to `timeout` for the program to exit; kills its group if it does not.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() > deadline {
                self.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the end (killed after `timeout`) and collects the output.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let status = self.wait(timeout);
        Finished {
            name: self.name.clone(),
            status,
            stdout: self.stdout(),
            stderr: self.stderr(),
        }
    }

    /// Asks the program to stop (`sig`: its own clean shutdown) and waits up to `timeout`;
    /// what is left is killed on drop. PostgreSQL removes its shared memory segments
    /// (`/dev/shm/PostgreSQL.*`) only when it stops so: killed, it leaves them on the host.
    pub fn stop(&mut self, sig: i32, timeout: Duration) -> Option<ExitStatus> {
        // SAFETY: signalling the program this test started.
        unsafe { libc::kill(self.pid() as i32, sig) };
        self.wait(timeout)
    }

    pub fn kill(&mut self) {
        // SAFETY: signalling the process group this test started (its pid is the group id).
        unsafe { libc::kill(-(self.pid() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stdin = None;
        self.kill();
    }
}

/// A program that ran to its end (or was killed at its timeout).
pub struct Finished {
    pub name: String,
    /// `None`: timed out and killed.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// The first line that says what went wrong (stderr first).
    pub fn first_error(&self) -> String {
        let pick = |t: &str| {
            t.lines()
                .find(|l| {
                    let l = l.to_ascii_lowercase();
                    l.contains("error")
                        || l.contains("fail")
                        || l.contains("fatal")
                        || l.contains("traceback")
                        || l.contains("refused")
                        || l.contains("reset")
                        || l.contains("timeout")
                })
                .map(str::to_owned)
        };
        pick(&self.stderr)
            .or_else(|| pick(&self.stdout))
            .or_else(|| {
                self.stderr
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| match self.status {
                None => "(timed out, no output)".into(),
                Some(s) => format!("(no output; {s})"),
            })
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: {} — first error: {}\n--- stdout (tail):\n{}\n--- stderr (head):\n{}",
            self.name,
            match self.status {
                None => "TIMED OUT (killed)".to_owned(),
                Some(s) => s.to_string(),
            },
            self.first_error(),
            tail(&self.stdout, 15),
            head(&self.stderr, 15)
        )
    }
}

pub fn head(s: &str, n: usize) -> String {
    s.lines().take(n).collect::<Vec<_>>().join("\n")
}

pub fn tail(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(n)..].join("\n")
}

/// `tool` is in the programs' PATH (the test's own PATH may lack /usr/sbin), else
/// `common::have` (a skip, or a failure under SMCR_REQUIRE_TOOLS=1).
pub fn have(tool: &str) -> bool {
    CLEAN_PATH
        .split(':')
        .any(|d| Path::new(d).join(tool).is_file())
        || common::have(tool)
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", p.display()));
}

fn chown(p: &Path, u: &User) {
    std::os::unix::fs::chown(p, Some(u.uid), Some(u.gid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
}

/// Installs the TCP option program at its default pin directory (/sys/fs/bpf/smcr) once per
/// test process, as an administrator would (`smcr bpf install`). It stays: other programs
/// (and test processes) use the same pins.
pub fn install_option_program() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let out = Command::new(common::smcr_bin())
            .args(["bpf", "install"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "smcr bpf install: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

/// Attaches the steering program in network namespace `ns` as an administrator does for a
/// namespace it made (`smcr bpf install --netns NS`): then every process there, whatever its
/// user, shares RoCE port 4791 (non-root processes cannot attach it themselves).
pub fn attach_steering(ns: &str) {
    install_option_program();
    let out = Command::new(common::smcr_bin())
        .args(["bpf", "install", "--netns", ns])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "smcr bpf install --netns {ns}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One test's world: `/tmp/smcr-distro-<pid>-<tag>-<smcr|tcp>/` (0755) with `bin/` (the
/// library, `smcr` and `smc-stat`, readable by every user), `stats/` (1777), `logs/` (one
/// shim log per program, pre-created 0666) and `out/` (programs' stdout and stderr).
pub struct World {
    pub tag: String,
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub stats: PathBuf,
    pub logs: PathBuf,
    pub out: PathBuf,
    pub shim: bool,
    /// Programs keep their stats areas where they would by default (no `SMCR_STATS_DIR`) and
    /// `smc-stat` looks where it looks by default (no `--dir`): what an administrator sees.
    pub default_stats: bool,
    /// The library a unit's drop-in preloads (default: the world's copy in `bin/`).
    pub unit_lib: Option<PathBuf>,
}

impl World {
    /// `None` (a skip) without root or without one of `tools`; SMCR_REQUIRE_TOOLS=1 makes
    /// those failures.
    pub fn new(tag: &str, shim: bool, tools: &[&str]) -> Option<Self> {
        Self::new_at("/tmp/smcr-distro", tag, shim, tools)
    }

    /// [`Self::new`] in `PREFIX-<pid>-<tag>-<smcr|tcp>/` (outside /tmp for programs whose
    /// unit gives them a private /tmp).
    pub fn new_at(prefix: &str, tag: &str, shim: bool, tools: &[&str]) -> Option<Self> {
        if !common::root(&format!(
            "{tag}: programs run as distribution users (setpriv, prlimit)"
        )) {
            return None;
        }
        for t in ["setpriv", "prlimit", "nsenter", "ss", "env"]
            .iter()
            .chain(tools)
        {
            if !have(t) {
                return None;
            }
        }
        let dir = PathBuf::from(format!(
            "{prefix}-{}-{tag}-{}",
            std::process::id(),
            if shim { "smcr" } else { "tcp" }
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let w = Self {
            tag: tag.to_owned(),
            bin: dir.join("bin"),
            stats: dir.join("stats"),
            logs: dir.join("logs"),
            out: dir.join("out"),
            dir,
            shim,
            default_stats: false,
            unit_lib: None,
        };
        for (d, mode) in [
            (&w.dir, 0o755),
            (&w.bin, 0o755),
            (&w.stats, 0o1777),
            (&w.logs, 0o755),
            (&w.out, 0o755),
        ] {
            std::fs::create_dir_all(d).unwrap();
            chmod(d, mode);
        }
        if shim {
            for (from, name) in [
                (common::lib(), "libsmcr_preload.so"),
                (common::smcr_bin(), "smcr"),
                (common::bin("smc-stat"), "smc-stat"),
            ] {
                let to = w.bin.join(name);
                std::fs::copy(&from, &to)
                    .unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
                chmod(&to, 0o755);
            }
            install_option_program();
        }
        Some(w)
    }

    /// A spec for program `name` with the world's defaults: root, `ulimit -n 1024`, this
    /// namespace, shimmed when the world is.
    pub fn spec(&self, name: &str) -> Spec {
        Spec {
            name: name.to_owned(),
            user: None,
            nofile: 1024,
            net: Net::Host,
            shim: self.shim,
            launcher: false,
            cwd: None,
            env: Vec::new(),
            stdin: false,
            unit: None,
        }
    }

    /// A directory under the world owned by `u` (a data directory).
    pub fn private_dir(&self, name: &str, u: &User) -> PathBuf {
        let d = self.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        chown(&d, u);
        chmod(&d, 0o700);
        d
    }

    /// Writes a file every user can read.
    pub fn file(&self, name: &str, contents: &[u8]) -> PathBuf {
        let p = self.dir.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
            chmod(parent, 0o755);
        }
        std::fs::write(&p, contents).unwrap();
        chmod(&p, 0o644);
        p
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.logs.join(format!("{name}.log"))
    }

    /// The command line: `[nsenter --net=… -- | ip netns exec NS] prlimit --nofile=N:N --
    /// [setpriv --reuid --regid --clear-groups --] env [SMCR_*=… LD_PRELOAD=…] PROG ARGS`,
    /// with a clean environment. Only PROG gets the shim (the wrappers do not load it).
    pub fn command<S: AsRef<std::ffi::OsStr>>(
        &self,
        spec: &Spec,
        prog: &str,
        args: &[S],
    ) -> Command {
        let mut argv: Vec<OsString> = Vec::new();
        let mut push = |a: &dyn AsRef<std::ffi::OsStr>| argv.push(a.as_ref().to_owned());
        match &spec.net {
            Net::Host => {}
            Net::Nsenter(ns) => {
                push(&"nsenter");
                push(&format!("--net=/run/netns/{ns}"));
                push(&"--");
            }
            Net::IpNetnsExec(ns) => {
                push(&"ip");
                push(&"netns");
                push(&"exec");
                push(ns);
            }
        }
        if let Some(unit) = &spec.unit {
            // The unit gives the user, limits and environment (the runner builds it from
            // scratch, as systemd does); the shim comes in by the administrator's drop-in.
            let (python, runner) = unit_sandbox();
            push(&python);
            push(&runner);
            // A path is a unit file of the test's own.
            push(&if unit.name.starts_with('/') {
                "--unit-file"
            } else {
                "--unit"
            });
            push(&unit.name);
            push(&"--dropin-dir");
            push(&self.unit_dropins(spec, unit));
            push(&"--report");
            push(&self.out.join(format!("{}.unit.json", spec.name)));
            push(&"--");
        } else {
            // Diagnosis only: SMCR_DISTRO_NOFILE=N lifts every program's limit (to see what
            // fails past the descriptor limit).
            let nofile = std::env::var("SMCR_DISTRO_NOFILE")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(spec.nofile);
            push(&"prlimit");
            push(&format!("--nofile={nofile}:{nofile}"));
            push(&"--");
            if let Some(u) = &spec.user {
                push(&"setpriv");
                push(&format!("--reuid={}", u.uid));
                push(&format!("--regid={}", u.gid));
                push(&"--clear-groups");
                push(&"--");
            }
            push(&"env");
            for (k, v) in &spec.env {
                push(&format!("{k}={v}"));
            }
            if spec.shim {
                // Diagnosis only: SMCR_DISTRO_ENV="K=V K=V" adds variables to shimmed programs.
                for kv in std::env::var("SMCR_DISTRO_ENV")
                    .unwrap_or_default()
                    .split_whitespace()
                {
                    push(&kv);
                }
                let log = self.log_path(&spec.name);
                File::create(&log).unwrap();
                chmod(&log, 0o666);
                if !self.default_stats {
                    push(&format!("SMCR_STATS_DIR={}", self.stats.display()));
                }
                if spec.launcher {
                    push(&self.bin.join("smcr"));
                    push(&"run");
                    push(&"--log");
                    push(&log);
                    push(&"--");
                } else {
                    push(&format!(
                        "LD_PRELOAD={}",
                        self.bin.join("libsmcr_preload.so").display()
                    ));
                    push(&format!("SMCR_LOG={}", log.display()));
                }
            }
        }
        push(&prog);
        for a in args {
            push(a);
        }
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..])
            .env_clear()
            .env("PATH", CLEAN_PATH)
            .env("HOME", &self.dir)
            .env("LANG", "C.UTF-8")
            .current_dir(spec.cwd.as_deref().unwrap_or(&self.dir))
            .process_group(0);
        c
    }

    /// The drop-in directory of `spec`'s unit: the test's own lines (`10-test.conf`) and,
    /// under the shim, the administrator's drop-in as `smcr service enable UNIT` writes it
    /// (`smcr.conf`: `Environment=LD_PRELOAD=LIB`, what `systemctl edit` would hold) and the
    /// test's shim log (`90-smcr-log.conf`). `smcr service check UNIT` must then find no
    /// problem, unless the library is outside the unit's `ExecPaths=` (it must say so).
    fn unit_dropins(&self, spec: &Spec, unit: &UnitSpec) -> PathBuf {
        let dir = self.dir.join("units").join(&spec.name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut test = String::from("[Service]\n");
        for l in &unit.conf {
            let _ = writeln!(test, "{l}");
        }
        std::fs::write(dir.join("10-test.conf"), test).unwrap();
        if spec.shim {
            let lib = self
                .unit_lib
                .clone()
                .unwrap_or_else(|| self.bin.join("libsmcr_preload.so"));
            let smcr = |action: &str| {
                Command::new(self.bin.join("smcr"))
                    .args(["service", action, &unit.name, "--dropin-dir"])
                    .arg(&dir)
                    .arg("--lib")
                    .arg(&lib)
                    .env("SMCR_CONFIG", "off")
                    .output()
                    .unwrap()
            };
            assert!(
                !unit.name.contains('/'),
                "a unit under the shim is named, as an administrator names it"
            );
            let enable = smcr("enable");
            assert!(
                enable.status.success(),
                "smcr service enable {}: {}",
                unit.name,
                String::from_utf8_lossy(&enable.stderr)
            );
            let check = smcr("check");
            let said = String::from_utf8_lossy(&check.stdout);
            let outside = !lib.starts_with("/usr/lib") && !lib.starts_with("/lib");
            if outside {
                assert!(
                    said.contains("problem: NoExecPaths="),
                    "smcr service check {} did not name the library outside ExecPaths=:\n{said}",
                    unit.name
                );
            } else {
                assert!(
                    check.status.success() && !said.contains("problem:"),
                    "smcr service check {}:\n{said}",
                    unit.name
                );
            }
            let log = self.log_path(&spec.name);
            File::create(&log).unwrap();
            chmod(&log, 0o666);
            let mut conf = format!(
                "[Service]\nEnvironment=SMCR_LOG={}\nReadWritePaths={}\n",
                log.display(),
                self.logs.display()
            );
            if !self.default_stats {
                let _ = writeln!(
                    conf,
                    "Environment=SMCR_STATS_DIR={0}\nReadWritePaths={0}",
                    self.stats.display()
                );
            }
            // Diagnosis only, as for the other programs.
            for kv in std::env::var("SMCR_DISTRO_ENV")
                .unwrap_or_default()
                .split_whitespace()
            {
                let _ = writeln!(conf, "Environment={kv}");
            }
            std::fs::write(dir.join("90-smcr-log.conf"), conf).unwrap();
        }
        dir
    }

    /// Starts a program (stdout and stderr to `out/NAME.out`, `out/NAME.err`).
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(&self, spec: &Spec, prog: &str, args: &[S]) -> Proc {
        let out = self.out.join(format!("{}.out", spec.name));
        let err = self.out.join(format!("{}.err", spec.name));
        let mut c = self.command(spec, prog, args);
        c.stdout(File::create(&out).unwrap())
            .stderr(File::create(&err).unwrap())
            .stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        let mut child = c.spawn().unwrap_or_else(|e| panic!("starting {prog}: {e}"));
        let stdin = child.stdin.take();
        Proc {
            name: spec.name.clone(),
            child,
            out,
            err,
            stdin,
        }
    }

    /// Runs a program to its end (killed after `timeout`).
    pub fn run<S: AsRef<std::ffi::OsStr>>(
        &self,
        spec: &Spec,
        prog: &str,
        args: &[S],
        timeout: Duration,
    ) -> Finished {
        self.spawn(spec, prog, args).finish(timeout)
    }

    /// Waits until the program's stdout or stderr holds `text` (it said it is ready); panics
    /// with its output and the shim logs if it exits first or `timeout` passes.
    pub fn wait_output(&self, p: &mut Proc, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let (out, err) = (p.stdout(), p.stderr());
            if out.contains(text) || err.contains(text) {
                return;
            }
            let dead = !p.alive();
            assert!(
                !dead && Instant::now() < deadline,
                "[{}] {} {} before printing {text:?}:\nstdout: {}\nstderr: {}\n{}",
                self.mode(),
                p.name,
                if dead { "exited" } else { "timed out" },
                tail(&out, 15),
                head(&err, 20),
                self.log_summary()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics with the program's output and the shim logs unless it succeeded.
    pub fn expect_ok(&self, f: &Finished) {
        assert!(
            f.ok(),
            "[{}] {}\n{}",
            self.mode(),
            f.describe(),
            self.log_summary()
        );
    }

    pub fn mode(&self) -> &'static str {
        if self.shim {
            "under the shim"
        } else {
            "plain TCP"
        }
    }

    /// Waits until something listens on `port` (in `net`), while `server` lives.
    pub fn wait_listening(&self, net: &Net, port: u16, server: &mut Proc) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if !listeners(net, port).is_empty() {
                return;
            }
            let dead = !server.alive();
            assert!(
                !dead && Instant::now() < deadline,
                "[{}] {} {} instead of listening on port {port}:\nstdout: {}\nstderr: {}\n{}",
                self.mode(),
                server.name,
                if dead { "exited" } else { "timed out" },
                tail(&server.stdout(), 10),
                head(&server.stderr(), 20),
                self.log_summary()
            );
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// Waits until `master`'s process group holds `n` processes besides it (a prefork
    /// server's workers) and returns their pids; `diag` adds to the failure message (the
    /// server's own log).
    pub fn wait_workers(&self, master: &mut Proc, n: usize, diag: &dyn Fn() -> String) -> Vec<u32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pids: Vec<u32> = master
                .group()
                .into_iter()
                .filter(|&p| p != master.pid())
                .collect();
            if pids.len() >= n {
                return pids;
            }
            assert!(
                master.alive() && Instant::now() < deadline,
                "[{}] {} has {} of {n} workers:\nstderr: {}\n{}\n{}",
                self.mode(),
                master.name,
                pids.len(),
                head(&master.stderr(), 20),
                diag(),
                self.log_summary()
            );
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// `smc-stat --json` over this world's stats directory (run as root).
    pub fn stat(&self) -> Option<Value> {
        if !self.shim {
            return None;
        }
        let mut c = Command::new(self.bin.join("smc-stat"));
        c.arg("--json");
        if !self.default_stats {
            c.arg("--dir").arg(&self.stats);
        }
        let out = c.output().ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Samples, until stopped, the server-side rows of `smc-stat` on `ports` and the
    /// server-side established TCP sockets on them (in `net`).
    pub fn sampler(&self, net: &Net, ports: &[u16]) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut threads = Vec::new();
        {
            let (stop, seen, net, ports) =
                (stop.clone(), seen.clone(), net.clone(), ports.to_vec());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let socks = ss_sockets(&net, &ports);
                    seen.lock().unwrap().add_tcp(socks);
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        if self.shim {
            let (stop, seen, ports) = (stop.clone(), seen.clone(), ports.to_vec());
            let (bin, stats) = (self.bin.join("smc-stat"), self.stats.clone());
            let default_stats = self.default_stats;
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut c = Command::new(&bin);
                    c.arg("--json");
                    if !default_stats {
                        c.arg("--dir").arg(&stats);
                    }
                    let doc = c
                        .output()
                        .ok()
                        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok());
                    if let Some(doc) = doc {
                        seen.lock().unwrap().add_doc(&doc, &ports);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }));
        }
        Sampler {
            stop,
            seen,
            threads,
        }
    }

    /// One sample now (connections the clients hold open).
    pub fn snapshot(&self, net: &Net, ports: &[u16]) -> Seen {
        let mut seen = Seen::default();
        seen.add_tcp(ss_sockets(net, ports));
        if let Some(doc) = self.stat() {
            seen.add_doc(&doc, ports);
        }
        seen
    }

    /// Per shim log: its SMC-R and TCP lines, and the first distinct lines that were not
    /// SMC-R (the reasons).
    pub fn log_summary(&self) -> String {
        if !self.shim {
            return String::new();
        }
        let mut s = String::from("shim logs:");
        let mut names: Vec<PathBuf> = std::fs::read_dir(&self.logs)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        names.sort();
        for p in names {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let c = LogCounts::of(&text);
            let _ = write!(
                s,
                "\n  {}: {} lines, {} `): SMC-R`, {} `TCP:`",
                p.file_name().unwrap().to_string_lossy(),
                c.lines,
                c.smcr,
                c.tcp
            );
            let mut shown = BTreeSet::new();
            for l in text.lines().filter(|l| !l.contains("): SMC-R")) {
                // One line per kind: the pid and numbers vary.
                let kind: String = l
                    .split_once(": ")
                    .map_or(l, |(_, r)| r)
                    .chars()
                    .filter(|c| !c.is_ascii_digit())
                    .collect();
                if shown.len() < 6 && shown.insert(kind) {
                    let _ = write!(s, "\n    {l}");
                }
            }
        }
        s
    }

    /// Sum of every log's counts.
    pub fn log_counts(&self) -> LogCounts {
        let mut all = LogCounts::default();
        for e in std::fs::read_dir(&self.logs)
            .into_iter()
            .flatten()
            .flatten()
        {
            let c = LogCounts::of(&std::fs::read_to_string(e.path()).unwrap_or_default());
            all.lines += c.lines;
            all.smcr += c.smcr;
            all.tcp += c.tcp;
        }
        all
    }

    /// The SMC-R verdict on what `seen` sampled and on the servers' process totals now (call
    /// it while the servers still run: areas of exited processes are removed).
    pub fn verdict(&self, seen: &Seen, servers: &[&Proc]) -> Verdict {
        let doc = self.stat();
        let mut per_server = Vec::new();
        let mut unavailable = BTreeSet::new();
        let mut servers_in_stat = 0;
        for s in servers {
            let group = s.group();
            let mut t = Totals {
                name: s.name.clone(),
                pids: group.clone(),
                ..Totals::default()
            };
            for p in doc
                .as_ref()
                .and_then(|d| d["processes"].as_array())
                .into_iter()
                .flatten()
            {
                let pid = p["pid"].as_u64().unwrap_or(0) as u32;
                if !group.contains(&pid) {
                    continue;
                }
                t.in_stat = true;
                let n = |k: &str| p["totals"][k].as_u64().unwrap_or(0);
                t.smcr += n("smcr_connections");
                t.tcp += n("tcp_connections");
                t.by_pid.insert(pid, n("smcr_connections"));
                if let Some(u) = p["smcr_unavailable"].as_str() {
                    unavailable.insert(u.to_owned());
                }
            }
            // Processes of the group that exited meanwhile (a child per connection), as sampled.
            for (&pid, &((pgrp, ppid), smcr, tcp)) in &seen.totals {
                let ours = pgrp == s.pid() || ppid == s.pid();
                if ours && !t.by_pid.contains_key(&pid) {
                    t.in_stat = true;
                    t.smcr += smcr;
                    t.tcp += tcp;
                    t.by_pid.insert(pid, smcr);
                }
            }
            servers_in_stat += usize::from(t.in_stat);
            per_server.push(t);
        }
        let fallbacks = doc
            .as_ref()
            .and_then(|d| d["fallbacks"].as_array())
            .into_iter()
            .flatten()
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or("?").to_owned(),
                    f["count"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        Verdict {
            shim: self.shim,
            seen: seen.clone(),
            servers: per_server,
            unavailable,
            fallbacks,
            logs: self.log_counts(),
            log_summary: self.log_summary(),
            mode: self.mode(),
            servers_in_stat,
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if std::env::var_os("SMCR_KEEP_LOGS").is_none() && !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kept {}", self.dir.display());
        }
    }
}

/// `SMC-R` and `TCP:` lines of a shim log.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogCounts {
    pub lines: usize,
    pub smcr: usize,
    pub tcp: usize,
}

impl LogCounts {
    fn of(text: &str) -> Self {
        Self {
            lines: text.lines().count(),
            smcr: text.lines().filter(|l| l.contains("): SMC-R")).count(),
            tcp: text.lines().filter(|l| l.contains("TCP:")).count(),
        }
    }
}

/// The local addresses of the sockets listening on `port` in `net`, as `ss` prints them:
/// `*:PORT` is an AF_INET6 socket on `::` that takes IPv4 too (dual stack), `[::]:PORT` one
/// with IPV6_V6ONLY, `0.0.0.0:PORT` and `127.0.0.1:PORT` IPv4 ones.
pub fn listeners(net: &Net, port: u16) -> Vec<String> {
    let Ok(out) = net
        .root_cmd("ss")
        .args(["-ltnH", &format!("( sport = :{port} )")])
        .output()
    else {
        return Vec::new();
    };
    // State Recv-Q Send-Q Local Peer.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .filter(|a| a.ends_with(&format!(":{port}")))
        .collect()
}

/// The real and effective user ids of a running process (`/proc/PID/status`).
pub fn uids(pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let f: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    Some((*f.first()?, *f.get(1)?))
}

/// An address as `ip:port` with IPv4-mapped IPv6 addresses shown as IPv4 (so `ss` and
/// `smc-stat` agree).
pub fn norm_addr(s: &str) -> String {
    match s.parse::<SocketAddr>() {
        Ok(a) => {
            let ip = match a.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                v4 => v4,
            };
            SocketAddr::new(ip, a.port()).to_string()
        }
        Err(_) => s.to_owned(),
    }
}

fn port_of(s: &str) -> Option<u16> {
    s.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// One server-side TCP socket seen by `ss`: the most it had received and sent (acked).
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpBytes {
    pub received: u64,
    pub acked: u64,
}

/// Established TCP sockets whose local port is one of `ports`, keyed (local, peer).
fn ss_sockets(net: &Net, ports: &[u16]) -> Vec<((String, String), TcpBytes)> {
    let filter = ports
        .iter()
        .map(|p| format!("sport = :{p}"))
        .collect::<Vec<_>>()
        .join(" or ");
    let Ok(out) = net
        .root_cmd("ss")
        .args(["-tinH", "state", "established", &format!("( {filter} )")])
        .output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut socks = Vec::new();
    let mut cur: Option<(String, String)> = None;
    for line in text.lines() {
        if line.starts_with(char::is_whitespace) {
            // The info line of the socket above.
            if let Some(key) = cur.take() {
                let field = |name: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(name))
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0)
                };
                socks.push((
                    key,
                    TcpBytes {
                        received: field("bytes_received:"),
                        acked: field("bytes_acked:"),
                    },
                ));
            }
        } else {
            // Recv-Q Send-Q Local Peer (no state column with a state filter).
            let f: Vec<&str> = line.split_whitespace().collect();
            cur = (f.len() >= 4).then(|| (norm_addr(f[2]), norm_addr(f[3])));
        }
    }
    socks
}

/// What a sampler saw.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// Server-side TCP sockets on the ports, (local, peer) → the most bytes each way.
    pub tcp: BTreeMap<(String, String), TcpBytes>,
    /// Server-side `smc-stat` rows on the ports, (pid, local, peer) → the latest row.
    pub rows: BTreeMap<(u64, String, String), Value>,
    pub stat_samples: usize,
    pub ss_samples: usize,
    /// Each process's totals as last sampled, with its process group and parent then: a
    /// server that forks a process per connection (PostgreSQL, whose children start sessions
    /// of their own) counts its connections in children that have exited (and whose areas
    /// are gone) by the end.
    pub totals: BTreeMap<u32, ((u32, u32), u64, u64)>,
    /// Server-side links (`smc-stat` link groups whose role is server), (pid, id) → the
    /// latest row.
    pub links: BTreeMap<(u64, u64), Value>,
}

impl Seen {
    fn add_tcp(&mut self, socks: Vec<((String, String), TcpBytes)>) {
        self.ss_samples += 1;
        for (k, b) in socks {
            let e = self.tcp.entry(k).or_default();
            e.received = e.received.max(b.received);
            e.acked = e.acked.max(b.acked);
        }
    }

    fn add_doc(&mut self, doc: &Value, ports: &[u16]) {
        self.stat_samples += 1;
        for p in doc["processes"].as_array().into_iter().flatten() {
            let pid = p["pid"].as_u64().unwrap_or(0) as u32;
            let n = |k: &str| p["totals"][k].as_u64().unwrap_or(0);
            if let Some(ids) = pgrp_of(pid) {
                self.totals
                    .insert(pid, (ids, n("smcr_connections"), n("tcp_connections")));
            }
        }
        for l in doc["link_groups"].as_array().into_iter().flatten() {
            if l["role"] == "server" {
                let key = (
                    l["pid"].as_u64().unwrap_or(0),
                    l["id"].as_u64().unwrap_or(0),
                );
                self.links.insert(key, l.clone());
            }
        }
        for c in doc["connections"].as_array().into_iter().flatten() {
            let local = norm_addr(c["local"].as_str().unwrap_or(""));
            if c["role"] != "server" || !port_of(&local).is_some_and(|p| ports.contains(&p)) {
                continue;
            }
            let peer = norm_addr(c["peer"].as_str().unwrap_or(""));
            self.rows
                .insert((c["pid"].as_u64().unwrap_or(0), local, peer), c.clone());
        }
    }

    /// Rows by distinct peer (a connection may show under the acceptor and a forked child).
    pub fn peers(&self, mode: &str) -> BTreeSet<String> {
        self.rows
            .iter()
            .filter(|(_, r)| r["mode"] == mode)
            .map(|((_, _, peer), _)| peer.clone())
            .collect()
    }

    /// Fallback reasons of the TCP rows and how many.
    pub fn reasons(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for r in self.rows.values().filter(|r| r["mode"] == "TCP") {
            let name = match (r["reason"].as_str(), r["reason_code"].as_u64()) {
                (Some(n), Some(c)) => format!("{n} {c:#010x}"),
                (Some(n), None) => n.to_owned(),
                _ => "(none)".to_owned(),
            };
            *m.entry(name).or_insert(0) += 1;
        }
        m
    }
}

/// The process group and the parent of `pid`, while it runs.
fn pgrp_of(pid: u32) -> Option<(u32, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
    let f: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    Some((f.get(2)?.parse().ok()?, f.get(1)?.parse().ok()?))
}

/// A named fallback reason: one `smc-stat` can explain.
pub fn named(reason: &Value) -> bool {
    reason
        .as_str()
        .is_some_and(|n| !n.is_empty() && n != "OTHER" && n != "UNKNOWN")
}

/// A background sampler (`World::sampler`).
pub struct Sampler {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    threads: Vec<JoinHandle<()>>,
}

impl Sampler {
    pub fn stop(self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }

        self.seen.lock().unwrap().clone()
    }
}

/// A server's process totals in `smc-stat` (its whole process group).
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub name: String,
    pub pids: Vec<u32>,
    pub in_stat: bool,
    pub smcr: u64,
    pub tcp: u64,
    /// SMC-R connections per pid of the group that has a stats area.
    pub by_pid: BTreeMap<u32, u64>,
}

/// Everything the SMC-R assertions look at, and a summary for their messages.
pub struct Verdict {
    pub shim: bool,
    pub seen: Seen,
    pub servers: Vec<Totals>,
    /// `smcr_unavailable` reasons of the servers' processes.
    pub unavailable: BTreeSet<String>,
    /// Fallback counters of every process (name, count).
    pub fallbacks: Vec<(String, u64)>,
    pub logs: LogCounts,
    pub log_summary: String,
    pub mode: &'static str,
    pub servers_in_stat: usize,
}

impl Verdict {
    /// SMC-R rows seen for which `ss` showed the server's TCP socket.
    fn smcr_sockets(&self) -> Vec<(&(String, String), &TcpBytes)> {
        let smcr = self.seen.peers("SMCR");
        self.seen
            .tcp
            .iter()
            .filter(|((_, peer), _)| smcr.contains(peer))
            .collect()
    }

    pub fn summary(&self) -> String {
        let mut s = format!("[{}]", self.mode);
        for t in &self.servers {
            let _ = write!(
                s,
                "\n  server {} (pids {:?}): {} SMC-R and {} TCP connections in smc-stat's totals{}",
                t.name,
                t.pids,
                t.smcr,
                t.tcp,
                if t.in_stat {
                    format!(" (per pid {:?})", t.by_pid)
                } else {
                    " — NO stats area".to_owned()
                }
            );
        }
        let max = |f: fn(&TcpBytes) -> u64| self.seen.tcp.values().map(f).max().unwrap_or(0);
        let _ = write!(
            s,
            "\n  server rows sampled ({} samples): {} SMCR, {} TCP, reasons {:?}\n  smcr_unavailable: {:?}; fallback counters: {:?}\n  server TCP sockets sampled ({} samples): {}, most received {} B, most sent {} B; of SMC-R rows: {}\n  shim log lines: {} `): SMC-R`, {} `TCP:` ({} lines)\n{}",
            self.seen.stat_samples,
            self.seen.peers("SMCR").len(),
            self.seen.peers("TCP").len(),
            self.seen.reasons(),
            self.unavailable,
            self.fallbacks,
            self.seen.ss_samples,
            self.seen.tcp.len(),
            max(|b| b.received),
            max(|b| b.acked),
            self.smcr_sockets().len(),
            self.logs.smcr,
            self.logs.tcp,
            self.logs.lines,
            self.log_summary
        );
        s
    }

    /// Over the shim, same host: every server-side link sampled once its same-host sharing
    /// was decided (not `pending`: a link sampled while it was being set up, whose process
    /// ended before the next sample) moved its data through shared memory (`TRANSPORT shm`),
    /// with a peer process of user `peer_uid`; at least one was.
    pub fn assert_shared_memory(&self, peer_uid: u32) {
        let s = self.summary();
        let links: Vec<&Value> = self
            .seen
            .links
            .values()
            .filter(|l| l["same_host"] != "pending")
            .collect();
        assert!(
            !links.is_empty(),
            "smc-stat showed no settled server link\n{s}"
        );
        for l in &links {
            assert_eq!(
                l["transport"], "shm",
                "a link not over shared memory: {l}\n{s}"
            );
            assert_eq!(
                l["peer_uid"].as_u64(),
                Some(u64::from(peer_uid)),
                "the link's peer process: {l}\n{s}"
            );
        }
        eprintln!(
            "{} server links over shared memory, peer uid {peer_uid}",
            links.len()
        );
    }

    /// [`Self::assert_all_smcr`]`(min_each)` for a run over the shim, else
    /// [`Self::assert_tcp_baseline`]`(min_sockets)`.
    pub fn assert_mode(&self, shim: bool, min_each: u64, min_sockets: usize) {
        if shim {
            self.assert_all_smcr(min_each);
        } else {
            self.assert_tcp_baseline(min_sockets);
        }
    }

    /// Over the shim: each server's process group counted at least `min_each` SMC-R
    /// connections and no TCP one, every sampled server row was SMC-R, and every sampled
    /// server TCP socket carried at most the CLC handshake.
    pub fn assert_all_smcr(&self, min_each: u64) {
        let s = self.summary();
        eprintln!("{s}");
        assert!(self.shim);
        for t in &self.servers {
            assert!(
                t.in_stat,
                "{}: no stats area in smc-stat (the shim did not run, or its area is not in SMCR_STATS_DIR)\n{s}",
                t.name
            );
            assert!(
                t.smcr >= min_each,
                "{}: {} SMC-R connections, expected at least {min_each}\n{s}",
                t.name,
                t.smcr
            );
            assert_eq!(t.tcp, 0, "{}: connections fell back to TCP\n{s}", t.name);
        }
        assert!(
            !self.seen.rows.is_empty(),
            "smc-stat showed no server connection row while the clients ran\n{s}"
        );
        assert!(
            self.seen.rows.values().all(|r| r["mode"] == "SMCR"),
            "a server row was not SMC-R\n{s}"
        );
        self.assert_clc_only(&self.seen.tcp.iter().collect::<Vec<_>>(), &s);
    }

    /// Over the shim, where fallbacks are allowed: at least `min_total` connections are
    /// accounted for in the servers' totals (SMC-R + TCP), every TCP row sampled has a named
    /// reason, and the SMC-R rows' TCP sockets carried only the handshake. Returns the number
    /// of SMC-R connections.
    pub fn assert_smcr_or_named(&self, min_total: u64) -> u64 {
        let s = self.summary();
        eprintln!("{s}");
        assert!(self.shim);
        let (smcr, tcp): (u64, u64) = self
            .servers
            .iter()
            .fold((0, 0), |(a, b), t| (a + t.smcr, b + t.tcp));
        assert!(
            self.servers.iter().all(|t| t.in_stat),
            "a server has no stats area in smc-stat\n{s}"
        );
        assert!(
            smcr + tcp >= min_total,
            "{smcr} SMC-R + {tcp} TCP connections in the servers' totals, expected {min_total}\n{s}"
        );
        let unnamed: Vec<&Value> = self
            .seen
            .rows
            .values()
            .filter(|r| r["mode"] != "SMCR" && !named(&r["reason"]))
            .collect();
        assert!(
            unnamed.is_empty(),
            "TCP rows without a named reason: {unnamed:?}\n{s}"
        );
        if tcp > 0 {
            assert!(
                self.seen.rows.values().any(|r| r["mode"] == "TCP"),
                "{tcp} connections fell back but smc-stat showed none of them\n{s}"
            );
        }
        self.assert_clc_only(&self.smcr_sockets(), &s);
        smcr
    }

    /// Over the shim, for connections that must stay TCP: at least one server row was
    /// sampled, and every one is TCP with a named reason. Returns the reasons.
    pub fn assert_tcp_named(&self) -> BTreeMap<String, usize> {
        let s = self.summary();
        eprintln!("{s}");
        assert!(self.shim);
        assert!(
            !self.seen.rows.is_empty(),
            "smc-stat showed no server row for these connections: their fallback is invisible\n{s}"
        );
        let bad: Vec<&Value> = self
            .seen
            .rows
            .values()
            .filter(|r| r["mode"] != "TCP" || !named(&r["reason"]))
            .collect();
        assert!(
            bad.is_empty(),
            "rows that are not TCP with a named reason: {bad:?}\n{s}"
        );
        self.seen.reasons()
    }

    fn assert_clc_only(&self, socks: &[(&(String, String), &TcpBytes)], s: &str) {
        assert!(
            !self.seen.tcp.is_empty(),
            "ss showed no server TCP socket while the clients ran\n{s}"
        );
        assert!(
            !socks.is_empty() || self.seen.peers("SMCR").is_empty(),
            "ss showed none of the SMC-R rows' TCP sockets (peers differ?)\n{s}"
        );
        let heavy: Vec<String> = socks
            .iter()
            .filter(|(_, b)| b.received > CLC_BYTES || b.acked > CLC_BYTES)
            .map(|((l, p), b)| format!("{l} <- {p}: received {} B, sent {} B", b.received, b.acked))
            .collect();
        assert!(
            heavy.is_empty(),
            "{} of {} server TCP sockets carried more than the CLC handshake ({CLC_BYTES} B): the payload went over TCP: {:?}\n{s}",
            heavy.len(),
            socks.len(),
            &heavy[..heavy.len().min(5)]
        );
    }

    /// Plain TCP: the sampler saw the server's sockets, and the payload on them (so the
    /// byte check of the SMC-R run would tell).
    pub fn assert_tcp_baseline(&self, min_sockets: usize) {
        let s = self.summary();
        eprintln!("{s}");
        assert!(!self.shim);
        assert!(
            self.seen.tcp.len() >= min_sockets,
            "ss saw {} server TCP sockets, expected at least {min_sockets}\n{s}",
            self.seen.tcp.len()
        );
        assert!(
            self.seen
                .tcp
                .values()
                .any(|b| b.received > CLC_BYTES || b.acked > CLC_BYTES),
            "no server TCP socket carried more than {CLC_BYTES} B: the byte check would not tell TCP from SMC-R\n{s}"
        );
    }
}

static NEXT_NS: AtomicU32 = AtomicU32::new(0);

/// A network namespace with only `lo` (up); deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new() -> Self {
        let n = NEXT_NS.fetch_add(1, Ordering::Relaxed);
        let name = format!("smcr-dx-{}-{n}", std::process::id());
        for args in [
            vec!["netns", "add", &name],
            vec!["-n", &name, "link", "set", "lo", "up"],
        ] {
            let st = Command::new("ip")
                .args(&args)
                .env("PATH", CLEAN_PATH)
                .status()
                .unwrap();
            assert!(st.success(), "ip {args:?}");
        }
        Self { name }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .env("PATH", CLEAN_PATH)
            .status();
    }
}

// ---------------------------------------------------------------------------------------
// Programs several suites run.

pub const BENCH_ARGS: &[&str] = &["-c", "50", "-n", "20000", "-t", "set,get", "--csv"];

pub fn redis_benchmark(w: &World, spec: Spec, addr: &str, port: u16) -> Proc {
    let port = port.to_string();
    let mut args = vec!["-h", addr, "-p", &port];
    args.extend(BENCH_ARGS);
    w.spawn(&spec, "redis-benchmark", &args)
}

/// redis-benchmark succeeded and printed a rate for SET and GET (`--csv`: a row per test,
/// written only when all its requests completed).
pub fn check_benchmark(w: &World, f: &Finished) {
    w.expect_ok(f);
    for t in ["SET", "GET"] {
        let rps = f.stdout.lines().find_map(|l| {
            let cols: Vec<&str> = l.split(',').map(|c| c.trim_matches('"')).collect();
            (cols.len() > 1 && cols[0] == t).then(|| cols[1].parse::<f64>().ok())?
        });
        assert!(
            rps.is_some_and(|r| r > 0.0),
            "[{}] {}: no {t} rate in its CSV:\n{}\n{}",
            w.mode(),
            f.name,
            f.describe(),
            w.log_summary()
        );
    }
    eprintln!(
        "{} [{}]: {}",
        f.name,
        w.mode(),
        f.stdout.lines().skip(1).collect::<Vec<_>>().join("; ")
    );
}

/// The newest PostgreSQL's binaries (`/usr/lib/postgresql/*/bin`).
impl World {
    /// `initdb` of PostgreSQL's `bin` (see [`pg_bin`]) as `pg` into `data`: trust
    /// authentication, user `postgres`, no fsync, UTF-8 with the C locale.
    pub fn initdb(&self, pg: &User, bin: &Path, data: &Path) {
        let init = self.run(
            &self.spec("initdb").user(pg).plain(),
            bin.join("initdb").to_str().unwrap(),
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-N",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            Duration::from_secs(120),
        );
        self.expect_ok(&init);
    }
}

impl World {
    /// `pgbench -i`, then `pgbench -c 4 -t 500` (PostgreSQL's `bin`) as `user` against user
    /// `postgres` at 127.0.0.1:`port`, the server's sockets sampled meanwhile.
    pub fn pgbench(&self, user: &User, bin: &Path, port: u16) -> (Finished, Seen) {
        let prog = bin.join("pgbench");
        let prog = prog.to_str().unwrap();
        let ps = port.to_string();
        let conn = ["-h", "127.0.0.1", "-p", &ps, "-U", "postgres"];
        let mut args = vec!["-i"];
        args.extend(conn);
        args.push("postgres");
        let init = self.run(
            &self.spec("pgbench-init").user(user),
            prog,
            &args,
            CLIENT_TIMEOUT,
        );
        self.expect_ok(&init);
        let sampler = self.sampler(&Net::Host, &[port]);
        let mut args = vec!["-c", "4", "-t", "500"];
        args.extend(conn);
        args.push("postgres");
        let run = self.run(
            &self.spec("pgbench").user(user),
            prog,
            &args,
            CLIENT_TIMEOUT,
        );
        (run, sampler.stop())
    }

    /// [`World::pgbench`]'s run succeeded with every transaction.
    pub fn check_pgbench(&self, run: &Finished) {
        self.expect_ok(run);
        for want in [
            "number of transactions actually processed: 2000/2000",
            "number of failed transactions: 0 ",
        ] {
            assert!(
                run.stdout.contains(want),
                "[{}] pgbench did not report {want:?}:\n{}\n{}",
                self.mode(),
                run.describe(),
                self.log_summary()
            );
        }
    }
}

pub fn pg_bin() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}
