//! The bench's environment: the namespaces, the steering and option programs, the users
//! and limits programs run with, starting and stopping servers and clients.

#[allow(unused_imports)]
use super::*;

impl Env {
    /// Removes what an interrupted earlier run left behind: its namespaces and option-program
    /// pins (named after a pid that no longer exists).
    pub(super) fn clean_leftovers() {
        let dead = |name: &str| {
            name.strip_prefix("smcr-bench-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists())
        };
        for e in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = Command::new("ip").args(["netns", "del", &n]).status();
            }
        }
        for e in std::fs::read_dir("/sys/fs/bpf")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = smcr::option::uninstall(&e.path());
            }
        }
    }

    pub(crate) fn new(need_ns: bool, mtu: Option<u32>) -> Result<Self> {
        Self::clean_leftovers();
        let exe = std::env::current_exe()?;
        let built = exe.parent().context("exe dir")?.join("libsmcr_preload.so");
        ensure!(
            built.exists(),
            "{} missing: build with `cargo build --release -p preload -p smcr-bench`",
            built.display()
        );
        let pid = std::process::id();
        let work = std::env::temp_dir().join(format!("smcr-bench-{pid}"));
        std::fs::create_dir_all(&work)?;
        // The programs run as RUN_AS: the library, the bench binary and the stats directory
        // must be theirs to read (a checkout may live in a 0700 home).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o755))?;
        let lib = work.join("libsmcr_preload.so");
        std::fs::copy(&built, &lib)?;
        let bench = work.join("bench");
        std::fs::copy(&exe, &bench)?;
        for f in [&lib, &bench] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755))?;
        }
        let stats = work.join("stats");
        std::fs::create_dir_all(&stats)?;
        std::fs::set_permissions(&stats, std::fs::Permissions::from_mode(0o1777))?;
        let user = user_ids(RUN_AS);
        let server_user = SERVER_AS.iter().find_map(|n| user_ids(n));
        let bpf = PathBuf::from(format!("/sys/fs/bpf/smcr-bench-{pid}"));
        smcr::option::install(&bpf)
            .map_err(|e| anyhow::anyhow!("installing the TCP option program (root?): {e}"))?;
        let mut env = Self {
            lib,
            exe: bench,
            user,
            server_user,
            bpf,
            stats,
            work,
            ns: None,
            next_port: std::cell::Cell::new(10000 + (pid % 100) as u16 * 200),
            placement: std::cell::Cell::new(None),
            engine: std::cell::RefCell::new(Vec::new()),
            workload: std::cell::Cell::new(""),
            verbs_addr: verbs_device().map(|(_, ip)| &*Box::leak(ip.to_string().into_boxed_str())),
        };
        if need_ns {
            let (a, b) = (format!("smcr-bench-{pid}-a"), format!("smcr-bench-{pid}-b"));
            let (va, vb) = (format!("sb{pid}a"), format!("sb{pid}b"));
            let ip = |args: &[&str]| -> Result<()> {
                let st = Command::new("ip").args(args).status()?;
                ensure!(st.success(), "ip {args:?} failed");
                Ok(())
            };
            ip(&["netns", "add", &a])?;
            ip(&["netns", "add", &b])?;
            env.ns = Some((a.clone(), b.clone()));
            ip(&[
                "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
            ])?;
            for (ns, dev, addr) in [(&a, &va, NS_A), (&b, &vb, NS_B)] {
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
                if let Some(m) = mtu {
                    ip(&["-n", ns, "link", "set", dev, "mtu", &m.to_string()])?;
                }
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                // What an administrator does for a namespace it makes (`smcr bpf install
                // --netns`): every process there shares RoCE port 4791 whatever its user.
                attach_steering(ns, &env.bpf)?;
            }
        }
        Ok(env)
    }

    /// A TCP port for the next server: below the kernel's ephemeral range (32768–60999 by
    /// default), and skipping one any socket of this host uses now (a client's local port,
    /// a connection in TIME_WAIT): a server that cannot bind would abort the run.
    pub(crate) fn port(&self) -> u16 {
        loop {
            let p = self.next_port.get();
            self.next_port.set(if p >= 32767 { 10000 } else { p + 1 });
            if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
                return p;
            }
        }
    }

    /// The namespace and veth device of the server's (b) or the client's (a) side.
    pub(crate) fn veth(&self, server: bool) -> Option<(&str, String)> {
        let (a, b) = self.ns.as_ref()?;
        let pid = std::process::id();
        Some(if server {
            (b, format!("sb{pid}b"))
        } else {
            (a, format!("sb{pid}a"))
        })
    }

    pub(crate) fn server_addr(&self, s: Setup) -> &'static str {
        match s {
            Setup::SmcrVerbs => self.verbs_addr.unwrap_or(SERVER_ADDR_LOCAL),
            s if s.netns() => NS_B,
            _ => SERVER_ADDR_LOCAL,
        }
    }

    /// `prog` for one side of a setup: in its namespace, under the shim if that side is.
    pub(crate) fn cmd(&self, s: Setup, server: bool, prog: &str) -> Command {
        let mut c = match (&self.ns, s.netns()) {
            (Some((a, b)), true) => {
                // nsenter --net, not `ip netns exec`: that one also gives the program a
                // mount namespace with a fresh /sys, where the option program's pins
                // (/sys/fs/bpf) are not visible.
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", if server { b } else { a }));
                // nsenter needs root to enter; it becomes the user once inside.
                if let Some((uid, gid)) = self.user_of(s, server) {
                    c.args(["-S", &uid.to_string(), "-G", &gid.to_string()]);
                }
                c.arg(prog);
                c
            }
            _ => Command::new(prog),
        };
        // Die with the bench, even when it is killed (no Drop then): a leftover shimmed server
        // would keep its address's RoCE port and fail the next run (NOSMCRDEV).
        // SAFETY: prctl is async-signal-safe; no allocation between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        if s.shim(server) {
            c.env("LD_PRELOAD", &self.lib)
                .env("SMCR_BPF_DIR", &self.bpf)
                .env("SMCR_STATS_DIR", &self.stats);
            if s == Setup::SmcrRemote {
                c.env("SMCR_SAME_HOST", "off");
            }
            if s == Setup::SmcrVerbs {
                c.env("SMCR_SAME_HOST", "off")
                    .env("SMCR_RDMA_DEVICE", "verbs");
            }
        }
        // As a distribution runs a service: its own user, `ulimit -n 1024` (every setup, so
        // the ratios compare like with like). In a namespace nsenter changes the user itself,
        // once it has entered (as root).
        let user = self
            .user_of(s, server)
            .filter(|_| !(s.netns() && self.ns.is_some()));
        // Pinned before exec: the program and every thread it (and the shim) makes later.
        let cpu = self.placement.get().and_then(|p| p.cpu(server));
        // An RDMA device pins every buffer: its programs get what RDMA users configure
        // (`ulimit -l unlimited`, LimitMEMLOCK=infinity), or connections beyond the limit
        // would stay TCP.
        let memlock = s == Setup::SmcrVerbs;
        // SAFETY: only async-signal-safe system calls between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: NOFILE,
                    rlim_max: NOFILE,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let unlimited = libc::rlimit {
                    rlim_cur: libc::RLIM_INFINITY,
                    rlim_max: libc::RLIM_INFINITY,
                };
                if memlock && libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(cpu) = cpu {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((uid, gid)) = user
                    && (libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }

    /// Who runs one side of a setup.
    pub(super) fn user_of(&self, s: Setup, server: bool) -> Option<(u32, u32)> {
        if s == Setup::SmcrXuser && server {
            self.server_user
        } else {
            self.user
        }
    }

    pub(crate) fn wait_listening(&self, s: Setup, port: u16) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let listening = match (&self.ns, s.netns()) {
                (Some((_, b)), true) => {
                    let out = Command::new("ip")
                        .args(["netns", "exec", b, "ss"])
                        .args(["-ltnH", &format!("( sport = :{port} )")])
                        .output()?;
                    String::from_utf8_lossy(&out.stdout).contains(&format!(":{port}"))
                }
                // Our own namespace: the kernel's tables (no `ss` needed, e.g. in a guest).
                _ => ["/proc/net/tcp", "/proc/net/tcp6"]
                    .iter()
                    .filter_map(|f| std::fs::read_to_string(f).ok())
                    .any(|t| listens(&t, port)),
            };
            if listening {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "nothing listens on port {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the server of a workload on a fresh port (under the shim if the setup says so)
    /// and waits until it listens; `args` makes its arguments from the address and port.
    pub(super) fn serve(
        &self,
        s: Setup,
        prog: &str,
        args: impl FnOnce(&str, &str) -> Vec<String>,
    ) -> Result<(Bg, &'static str, u16)> {
        let port = self.port();
        let addr = self.server_addr(s);
        let server = Bg(self
            .cmd(s, true, prog)
            .args(args(addr, &port.to_string()))
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {prog}"))?);
        self.wait_listening(s, port)?;
        Ok((server, addr, port))
    }

    /// Adds the device counters of every stats area (the programs of this run, the exited
    /// clients' too: read before [`smcr_tools::view::Snapshot::collect`] removes those) to the
    /// workload's [`Engine`] row.
    pub(super) fn count_engines(&self, s: Setup) {
        let mut rows = self.engine.borrow_mut();
        let what = self.workload.get();
        let i = match rows
            .iter()
            .position(|r| r.workload == what && r.setup == s.name())
        {
            Some(i) => i,
            None => {
                rows.push(Engine {
                    workload: what.to_string(),
                    setup: s.name(),
                    ..Engine::default()
                });
                rows.len() - 1
            }
        };
        let row = &mut rows[i];
        for e in std::fs::read_dir(&self.stats)
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "stats") {
                continue;
            }
            let Ok(a) = smcr::stats::Area::open(&p) else {
                continue;
            };
            for slot in 0..smcr::stats::DEV_SLOTS {
                if let Some(d) = a.read_dev(slot) {
                    row.add(&d.stats);
                }
            }
        }
    }

    /// The server's stats say its connections were SMC-R (or TCP with PEERNOSMC for the
    /// fallback setup): at least `min` of them, none of the other kind.
    pub(super) fn check(&self, s: Setup, server: &Child, min: u64, what: &str) -> Result<()> {
        if !s.shim(true) {
            return Ok(());
        }
        self.count_engines(s);
        let snap = smcr_tools::view::Snapshot::collect(&self.stats, Some(server.id()));
        let p = snap
            .procs
            .first()
            .with_context(|| format!("{what} ({}): the server has no stats area", s.name()))?;
        let (smcr, tcp) = (
            p.totals[smcr::stats::total::SMCR],
            p.totals[smcr::stats::total::TCP],
        );
        if s == Setup::Fallback {
            let peernosmc = p
                .fallbacks
                .iter()
                .find(|(c, _)| *c == 0x0301_0000)
                .map_or(0, |f| f.1);
            ensure!(
                smcr == 0 && peernosmc >= min,
                "{what} (fallback): expected ≥{min} PEERNOSMC fallbacks and no SMC-R, stats say {smcr} SMC-R, {tcp} TCP {:?}",
                p.fallbacks
            );
        } else {
            ensure!(
                smcr >= min && tcp == 0,
                "{what} ({}): NOT over SMC-R — stats say {smcr} SMC-R and {tcp} TCP connections (fallbacks {:?})",
                s.name(),
                p.fallbacks
            );
        }
        // The links still there moved their data as the setup says (shared memory on one
        // host, whatever the users and namespaces; UDP where sharing is off).
        if let Some(want) = s.transport() {
            for l in &p.links {
                ensure!(
                    l.transport == want,
                    "{what} ({}): a link over {} where {want} was expected",
                    s.name(),
                    l.transport
                );
            }
        }
        Ok(())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some((a, b)) = &self.ns {
            for ns in [a, b] {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
        }
        let _ = smcr::steer::uninstall(&self.bpf);
        let _ = smcr::option::uninstall(&self.bpf);
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// The uid and gid of `name`, if that user exists.
pub(super) fn user_ids(name: &str) -> Option<(u32, u32)> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: getpwnam with a valid name; the result is read at once (no other thread of
    // ours looks users up).
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    // SAFETY: a non-null result points to a valid passwd.
    (!pw.is_null()).then(|| unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// Attaches the steering program (pinned under `bpf`) in network namespace `ns`.
pub(super) fn attach_steering(ns: &str, bpf: &Path) -> Result<()> {
    let (path, bpf) = (format!("/run/netns/{ns}"), bpf.to_path_buf());
    std::thread::spawn(move || -> Result<()> {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(&path)?;
        // SAFETY: entering a network namespace on this short-lived thread only.
        ensure!(
            unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
            "setns {path}: {}",
            std::io::Error::last_os_error()
        );
        smcr::steer::install(&bpf).map_err(|e| anyhow::anyhow!("steering in {path}: {e}"))?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the steering thread panicked"))?
}

/// A background process, killed on drop.
pub(crate) struct Bg(pub(crate) Child);

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(super) fn output(c: &mut Command, what: &str) -> Result<String> {
    let out = c
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "{what} failed: {text}");
    Ok(text)
}
