//! `smcr`: the command-line front end: the launcher (`smcr run CMD`, like smc-tools'
//! `smc_run`), the eBPF programs — the TCP option and the RoCE steering program
//! (`smcr bpf install|uninstall|status`) — and smc-tools' `smcr` views (`smcr stats`,
//! `smcr linkgroup show`, `smcr device show`, `smcr ueid show`) of the stats areas.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use smcr::{option, settings, stats, steer};
use smcr_tools::view::{self, Snapshot};

mod config;
mod service;
use config::{config, generate, ueid};

/// SMC-R for unmodified programs: the launcher, the eBPF programs and smc-tools' views.
#[derive(Parser, Debug)]
#[command(
    name = "smcr",
    version,
    propagate_version = true,
    about = "SMC-R for unmodified programs: the launcher (like smc-tools' smc_run), the eBPF \
             programs, and smc-tools' `smcr stats|linkgroup|device|ueid` views",
    after_help = "Connections, link groups and fallbacks of every process: `smc-stat` \
                  (like smc-tools' smcss). See docs/running.md."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start CMD with its TCP sockets accelerated by SMC-R (LD_PRELOAD of the smcr library),
    /// like smc-tools' smc_run
    #[command(
        long_about = "Start CMD with its TCP sockets accelerated by SMC-R (LD_PRELOAD of the \
                      smcr library), like smc-tools' smc_run. Options after CMD are CMD's; \
                      `--` before CMD is accepted too.",
        arg_required_else_help = true
    )]
    Run(RunArgs),
    /// The eBPF programs: the TCP option program and the RoCE steering program
    #[command(subcommand_required = true, arg_required_else_help = true)]
    Bpf(BpfArgs),
    /// Counters of the processes running smcr (like smc-tools' `smcr stats`): connections
    /// by mode and role, handshake errors, bytes, fallback reasons
    Stats(StatsArgs),
    /// Link groups and their links (like `smc-stat -R`)
    #[command(visible_alias = "lgr")]
    Linkgroup(ShowArgs),
    /// Our RoCE engine per process and address: how packets reach it, its counters (like
    /// `smc-stat --devices`)
    #[command(visible_alias = "dev")]
    Device(ShowArgs),
    /// The configuration programs started from here get: every setting's value and where it
    /// comes from (environment, the configuration file and its line, or the default)
    Config(ConfigArgs),
    /// The user EIDs (UEIDs) programs started from this environment offer (SMCR_UEID, else
    /// the configuration file's smcr.ueid, else the default); add/del/flush edit the file
    #[command(subcommand_required = false)]
    Ueid {
        #[command(subcommand)]
        action: Option<UeidAction>,
    },
    /// Turn smcr on or off for a systemd service (a drop-in with LD_PRELOAD), or check what
    /// the unit's hardening means for smcr
    #[command(subcommand_required = true, arg_required_else_help = true)]
    Service(ServiceArgs),
    /// Write the man pages or shell completions (used by scripts/install.sh)
    #[command(hide = true, subcommand_required = true)]
    Generate {
        #[command(subcommand)]
        what: Generate,
    },
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The option program's pin directory (default /sys/fs/bpf/smcr); as root it is
    /// installed there if missing
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// No option program: assume every peer runs smcr (both ends launched by smcr run, e.g.
    /// in tests); a plain peer would then see CLC bytes
    #[arg(long)]
    assume: bool,
    /// Receive buffer (RMB) per connection in KiB, at least 16 (default 512, the most SMC-R
    /// allows; SMCR_RMB_KIB)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(16..))]
    rmb_kib: Option<u32>,
    /// smc_run's receive buffer size: bytes, or with a K/M/G suffix; sets the RMB size
    /// (--rmb-kib), rounded up to whole KiB and at least 16 KiB
    #[arg(short = 'r', value_name = "SIZE", value_parser = parse_size, conflicts_with = "rmb_kib")]
    rcvbuf: Option<u64>,
    /// smc_run's send buffer size: accepted and ignored with a warning — our send buffer
    /// is always as large as the peer's RMB (set -r/--rmb-kib on the peer)
    #[arg(short = 't', value_name = "SIZE", value_parser = parse_size)]
    sndbuf: Option<u64>,
    /// Use SMC-R only for these destinations/listeners (RULES: comma-separated PORT, LO-HI,
    /// A.B.C.D[/N][:PORT[-HI]]; see docs/running.md)
    #[arg(long, value_name = "RULES")]
    include: Option<String>,
    /// Never use SMC-R for these (RULES as for --include)
    #[arg(long, value_name = "RULES")]
    exclude: Option<String>,
    /// One line per connection: SMC-R, or TCP and the fallback reason
    #[arg(long, value_name = "FILE")]
    log: Option<String>,
    /// The configuration file (default $SMCR_CONFIG, else /etc/smcr.toml if it exists); the
    /// program reads it too. Checked before CMD starts, as is every SMCR_* variable
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The library (default: libsmcr_preload.so next to this program, ../lib/libsmcr.so, or
    /// $SMCR_LIB)
    #[arg(long, value_name = "PATH")]
    lib: Option<PathBuf>,
    /// The program and its arguments
    #[arg(value_name = "CMD", required = true, trailing_var_arg = true, num_args = 1..)]
    cmd: Vec<OsString>,
}

#[derive(Args, Debug)]
struct ServiceArgs {
    #[command(subcommand)]
    action: ServiceAction,
    /// The unit, e.g. redis-server (.service is added) or postgresql@15-main
    #[arg(global = true, value_name = "UNIT")]
    unit: Option<String>,
    /// The library to preload (default /usr/lib/libsmcr.so, where scripts/install.sh and the
    /// .deb put it)
    #[arg(long, global = true, value_name = "PATH")]
    lib: Option<PathBuf>,
    /// The drop-in directory (default /etc/systemd/system/UNIT.service.d); check reads it
    /// after the unit's own
    #[arg(long, global = true, value_name = "DIR")]
    dropin_dir: Option<PathBuf>,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum ServiceAction {
    /// Write the drop-in that preloads the library (keeping the unit's other preloads); then
    /// `systemctl daemon-reload && systemctl restart UNIT`
    Enable,
    /// Remove the drop-in
    Disable,
    /// Say what the unit's settings mean for smcr: the preload, ExecPaths=,
    /// SystemCallFilter=, RestrictAddressFamilies=, private namespaces, thread limits (exit 1
    /// on a problem)
    Check,
}

#[derive(Args, Debug)]
struct BpfArgs {
    #[command(subcommand)]
    action: BpfAction,
    /// Where the programs are pinned (default /sys/fs/bpf/smcr)
    #[arg(long, global = true, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Act in network namespace NAME (/var/run/netns/NAME, or a path) — instead of `ip
    /// netns exec`, whose private /sys has no bpffs to keep the pins
    #[arg(long, global = true, value_name = "NAME")]
    netns: Option<String>,
    /// Just the option program, or just the steering program
    #[arg(long, global = true, value_name = "WHICH")]
    only: Option<Only>,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum BpfAction {
    /// Load the SMC-R TCP option program, attach it to the cgroup v2 root and pin it under
    /// DIR; load the RoCE steering program, pin it there and attach it (tc ingress, tcx) to
    /// lo and every Ethernet interface of the network namespace, so that any number of
    /// processes per address run SMC-R; needs root; what is present already is kept
    Install,
    /// Remove the pins (the programs detach, in every namespace); marked sockets carry on
    /// as plain TCP, processes that relied on steering lose remote peers
    Uninstall,
    /// Say whether the programs are installed, attached here and usable by this user
    Status,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Only {
    /// The TCP option program
    Option,
    /// The RoCE steering program
    Steer,
}

/// Where the stats areas are, and which.
#[derive(Args, Debug)]
struct AreaArgs {
    /// Where the stats areas are (default /dev/shm/smcr, or $SMCR_STATS_DIR)
    #[arg(long, global = true, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Only that process
    #[arg(long, global = true, value_name = "PID")]
    pid: Option<u32>,
    /// More: fallback meanings and per-process counters (stats), every engine counter by
    /// name (device)
    #[arg(short, long, global = true)]
    details: bool,
}

#[derive(Args, Debug)]
struct StatsArgs {
    #[command(subcommand)]
    action: Option<StatsAction>,
    #[command(flatten)]
    area: AreaArgs,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum StatsAction {
    /// Show the counters (the default)
    Show,
    /// Zero the counters (totals and fallback counters) in the stats areas; needs write
    /// access to them (their owner, or root)
    Reset,
}

#[derive(Args, Debug)]
struct ShowArgs {
    #[command(subcommand)]
    action: Option<ShowAction>,
    #[command(flatten)]
    area: AreaArgs,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum ShowAction {
    /// Show them (the default)
    Show,
}

#[derive(Args, Debug)]
struct ConfigArgs {
    /// Read this configuration file (default $SMCR_CONFIG, else /etc/smcr.toml if it exists)
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// List every setting: its name in the file, its variable, what it takes, its default
    #[arg(long)]
    list: bool,
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
enum UeidAction {
    /// The UEIDs in effect (the default)
    Show,
    /// Add UEID to smcr.ueid in the configuration file
    Add {
        ueid: String,
        /// The configuration file to edit (default $SMCR_CONFIG, else /etc/smcr.toml)
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Remove UEID from smcr.ueid in the configuration file
    Del {
        ueid: String,
        /// The configuration file to edit (default $SMCR_CONFIG, else /etc/smcr.toml)
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Remove smcr.ueid from the configuration file (programs then offer the default)
    Flush {
        /// The configuration file to edit (default $SMCR_CONFIG, else /etc/smcr.toml)
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
enum Generate {
    /// The man pages: smcr.1 and one per subcommand
    Man { dir: PathBuf },
    /// Completions for SHELL, into DIR
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
        dir: PathBuf,
    },
}

/// A size as smc_run takes it: bytes, or with a K, M or G suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?} is not a size (bytes, or with a K/M/G suffix)"))
}

/// -r SIZE as --rmb-kib: whole KiB, rounded up, at least 16.
fn rcvbuf_kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .max(16)
}

/// The stats directory: --dir, else the programs' setting (SMCR_STATS_DIR, else the
/// configuration file's smcr.stats_dir; unless `off`), else the default.
fn stats_dir(given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(|| {
        settings::for_tools("SMCR_STATS_DIR")
            .filter(|d| d != "off")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(stats::DEFAULT_DIR))
    })
}

/// The environment's value of `k` (empty is unset, as for the programs).
fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// The library `smcr run` preloads.
fn find_lib(given: Option<PathBuf>) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = match given
        .or_else(|| std::env::var_os("SMCR_LIB").map(PathBuf::from))
    {
        Some(p) => vec![p],
        None => {
            let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
            let dir = exe.parent().unwrap_or(Path::new("/"));
            vec![
                dir.join("libsmcr_preload.so"),
                dir.join("libsmcr.so"),
                dir.join("../lib/libsmcr.so"),
                // scripts/install.sh's default, where hardened units may map it.
                PathBuf::from("/usr/lib/libsmcr.so"),
            ]
        }
    };
    for c in &candidates {
        if c.is_file() {
            return std::fs::canonicalize(c).map_err(|e| format!("{}: {e}", c.display()));
        }
    }
    Err(format!(
        "the smcr library is not at {} (build it with `cargo build --release -p preload`, or pass --lib)",
        candidates
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    ))
}

/// `smcr run [OPTIONS] [--] CMD ARGS...`: sets the environment up and execs CMD.
fn run(a: RunArgs) -> ExitCode {
    if let Err(e) = smcr::policy::Policy::parse(a.include.as_deref(), a.exclude.as_deref()) {
        eprintln!("smcr run: {e}");
        return ExitCode::from(2);
    }
    if let Some(t) = a.sndbuf {
        eprintln!(
            "smcr run: warning: -t {t} is ignored: the send buffer is always as large as the \
             peer's RMB (set -r or --rmb-kib on the peer)"
        );
    }
    let rmb = a.rmb_kib.or(a.rcvbuf.map(rcvbuf_kib));
    // What the program will get: our options, over the environment, over the file. Checked
    // here, so that a bad setting stops us instead of turning SMC-R off in the program.
    let config = match a.config.as_deref().map(std::path::absolute).transpose() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("smcr run: --config: {e}");
            return ExitCode::from(2);
        }
    };
    let mut set: Vec<(&str, String)> = Vec::new();
    if let Some(c) = &config {
        set.push((settings::FILE_VAR, c.display().to_string()));
    }
    // Without --assume, the option program, whatever the environment or file say.
    let negotiation = if a.assume { "assume" } else { "option" };
    set.push(("SMCR_NEGOTIATION", negotiation.into()));
    for (k, v) in [
        ("SMCR_RMB_KIB", rmb.map(|k| k.to_string())),
        ("SMCR_INCLUDE", a.include),
        ("SMCR_EXCLUDE", a.exclude),
        ("SMCR_LOG", a.log),
    ] {
        if let Some(v) = v {
            set.push((k, v));
        }
    }
    let lookup = |k: &str| {
        set.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.clone())
            .or_else(|| env(k))
    };
    let checked = settings::read_file(&lookup)
        .and_then(|file| settings::resolve(&lookup, file.as_ref()).map(drop));
    if let Err(e) = checked {
        eprintln!("smcr run: {e}");
        return ExitCode::from(2);
    }
    let lib = match find_lib(a.lib) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smcr run: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir_given = a.dir.is_some();
    let dir = a.dir.unwrap_or_else(option::default_dir);
    let mut c = std::process::Command::new(&a.cmd[0]);
    c.args(&a.cmd[1..]);
    if !a.assume {
        // The program always starts: without the option program its connections stay TCP
        // (NOBPF, with the remedy in its log and in smc-stat).
        if !option::is_installed(&dir) {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!(
                    "smcr run: warning: the SMC-R option program is not installed under {}; connections stay TCP (run `sudo smcr bpf install` once, or use --assume when every peer runs smcr)",
                    dir.display()
                );
            } else {
                match option::install(&dir) {
                    Ok(_) => {
                        // Root installs the steering program along (every process of an
                        // address then shares RoCE port 4791); not fatal either.
                        if let Err(e) = steer::install(&dir) {
                            eprintln!("smcr run: warning: steering program: {e}");
                        }
                    }
                    Err(e) => eprintln!(
                        "smcr run: warning: installing the option program: {e}; connections stay TCP"
                    ),
                }
            }
        }
        if dir_given {
            c.env("SMCR_BPF_DIR", &dir);
        }
    }
    for (k, v) in &set {
        c.env(k, v);
    }
    // Ours first; keep whatever the user preloads already.
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.trim().is_empty() => format!("{} {p}", lib.display()),
        _ => lib.display().to_string(),
    };
    c.env("LD_PRELOAD", preload);
    let e = c.exec();
    eprintln!("smcr run: cannot start {}: {e}", a.cmd[0].to_string_lossy());
    ExitCode::from(127)
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Run(a) => run(a),
        Cmd::Bpf(b) => bpf(b),
        Cmd::Stats(s) => {
            let dir = stats_dir(s.area.dir);
            if s.action == Some(StatsAction::Reset) {
                return match view::reset(&dir, s.area.pid) {
                    Ok(n) => {
                        println!("reset the counters of {n} process area(s)");
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("smcr stats reset: {}: {e}", dir.display());
                        ExitCode::FAILURE
                    }
                };
            }
            let snap = Snapshot::collect(&dir, s.area.pid);
            print!("{}", view::render_stats(&snap, s.area.details));
            ExitCode::SUCCESS
        }
        Cmd::Linkgroup(s) => {
            let snap = Snapshot::collect(&stats_dir(s.area.dir), s.area.pid);
            print!("{}", view::render_links(&snap));
            ExitCode::SUCCESS
        }
        Cmd::Device(s) => {
            let snap = Snapshot::collect(&stats_dir(s.area.dir), s.area.pid);
            print!(
                "{}{}",
                view::render_devices(&snap, s.area.details),
                view::render_host_rdma()
            );
            ExitCode::SUCCESS
        }
        Cmd::Config(a) => config(a),
        Cmd::Service(a) => service_cmd(a),
        Cmd::Ueid { action } => ueid(action.unwrap_or(UeidAction::Show)),
        Cmd::Generate { what } => match generate(what) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("smcr generate: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// `smcr bpf install|uninstall|status`.
fn bpf(b: BpfArgs) -> ExitCode {
    let dir = b.dir.unwrap_or_else(|| PathBuf::from(option::DEFAULT_DIR));
    if let Some(ns) = &b.netns
        && let Err(e) = enter_netns(ns)
    {
        eprintln!("smcr: network namespace {ns}: {e}");
        return ExitCode::FAILURE;
    }
    let (opt, st) = (b.only != Some(Only::Steer), b.only != Some(Only::Option));
    let mut ok = true;
    match b.action {
        BpfAction::Install => {
            if opt {
                ok &= install_option(&dir);
            }
            if st {
                ok &= install_steer(&dir);
            }
        }
        BpfAction::Uninstall => {
            // Steering first: the option program's uninstall removes the directory when empty.
            if st {
                match steer::uninstall(&dir) {
                    Ok(n) => println!(
                        "steering: removed the program pin and {n} link pin(s) under {}",
                        dir.display()
                    ),
                    Err(e) => ok &= fail(&e),
                }
            }
            if opt {
                match option::uninstall(&dir) {
                    Ok(()) => println!("option: removed the pins under {}", dir.display()),
                    Err(e) => ok &= fail(&e),
                }
            }
        }
        BpfAction::Status => {
            if opt {
                ok &= option_status(&dir);
            }
            if st {
                ok &= steer_status(&dir);
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Moves this (single-threaded) process into network namespace `ns`: a name under
/// /var/run/netns, or a path (/proc/PID/ns/net). Mounts are not touched, so the pins land on
/// the host's bpffs.
fn enter_netns(ns: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let path = if ns.contains('/') {
        PathBuf::from(ns)
    } else {
        Path::new("/var/run/netns").join(ns)
    };
    let f = std::fs::File::open(&path)?;
    // SAFETY: a valid namespace descriptor; CLONE_NEWNET only switches the network namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn install_option(dir: &Path) -> bool {
    match option::install(dir) {
        Ok(option::Installed::Fresh { cgroup }) => {
            println!(
                "option: installed: attached to {} and pinned under {}",
                cgroup.display(),
                dir.display()
            );
            true
        }
        Ok(option::Installed::Present) => {
            println!("option: already installed under {}", dir.display());
            true
        }
        Err(e) => fail(&e),
    }
}

fn install_steer(dir: &Path) -> bool {
    match steer::install(dir) {
        Ok(att) => {
            println!(
                "steering: program pinned under {}; network namespace {}:",
                dir.display(),
                steer::netns_inode().unwrap_or(0)
            );
            for a in att {
                let what = match &a.outcome {
                    steer::Outcome::Attached => "attached".to_owned(),
                    steer::Outcome::AlreadyAttached => "already attached".to_owned(),
                    steer::Outcome::Skipped(why) => format!("skipped: {why}"),
                };
                println!("  {} (index {}): {what}", a.ifname, a.ifindex);
            }
            true
        }
        Err(e) => fail(&e),
    }
}

fn option_status(dir: &Path) -> bool {
    match option::OptionRecords::open(dir) {
        Ok(_) if option::is_installed(dir) => {
            println!(
                "option: installed under {} and usable by this user",
                dir.display()
            );
            true
        }
        Ok(_) => {
            println!(
                "option: the socket option is answered but the pins under {} are incomplete (run `smcr bpf install`)",
                dir.display()
            );
            false
        }
        Err(e) => fail(&e),
    }
}

fn steer_status(dir: &Path) -> bool {
    let s = steer::status(dir);
    if !s.program {
        println!(
            "steering: not installed (no {} under {}); one process per address can own \
             RoCE port 4791; run `smcr bpf install` as root",
            steer::PROG_PIN,
            dir.display()
        );
        return false;
    }
    println!(
        "steering: program pinned under {}; network namespace {}:",
        dir.display(),
        s.netns
    );
    let mut here = false;
    for i in &s.interfaces {
        let att = match i.attached {
            Some(true) => {
                here = true;
                "attached"
            }
            Some(false) => "not attached",
            None => "unknown (no permission)",
        };
        let others = i
            .tcx_programs
            .map(|n| format!(", {n} tcx ingress program(s)"))
            .unwrap_or_default();
        println!("  {} (index {}): {att}{others}", i.name, i.ifindex);
    }
    let elsewhere = s.links.iter().filter(|l| l.netns != s.netns).count();
    let dead = s.links.iter().filter(|l| l.live == Some(false)).count();
    println!(
        "  link pins: {} ({elsewhere} in other namespaces, {dead} dead)",
        s.links.len()
    );
    here
}

/// `smcr service enable|disable|check UNIT`.
fn service_cmd(a: ServiceArgs) -> ExitCode {
    let Some(unit) = a.unit else {
        eprintln!("smcr service: name the unit (e.g. `smcr service check redis-server`)");
        return ExitCode::from(2);
    };
    let lib = a
        .lib
        .unwrap_or_else(|| PathBuf::from("/usr/lib/libsmcr.so"));
    let (full, _) = service::unit_names(&unit);
    let dir = a
        .dropin_dir
        .clone()
        .unwrap_or_else(|| Path::new("/etc/systemd/system").join(format!("{full}.d")));
    let file = dir.join(service::DROPIN);
    match a.action {
        ServiceAction::Enable => {
            if !lib.is_file() {
                eprintln!(
                    "smcr service: warning: {} does not exist (install it: scripts/install.sh, or --lib)",
                    lib.display()
                );
            }
            // Keep the unit's own preloads (ours not counted: it is rewritten).
            let existing = service::load(&unit, None).ok().and_then(|(s, _)| {
                s.environment()
                    .into_iter()
                    .find(|(k, _)| k == "LD_PRELOAD")
                    .map(|(_, v)| v)
            });
            let text = service::dropin(&lib, existing.as_deref());
            if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&file, text))
            {
                eprintln!("smcr service: {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
            println!("wrote {}", file.display());
            println!("now: systemctl daemon-reload && systemctl restart {full}");
            ExitCode::SUCCESS
        }
        ServiceAction::Disable => match std::fs::remove_file(&file) {
            Ok(()) => {
                let _ = std::fs::remove_dir(&dir);
                println!("removed {}", file.display());
                println!("now: systemctl daemon-reload && systemctl restart {full}");
                ExitCode::SUCCESS
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("no drop-in of smcr for {full} ({})", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("smcr service: {}: {e}", file.display());
                ExitCode::FAILURE
            }
        },
        ServiceAction::Check => {
            let (settings, files) = match service::load(&unit, a.dropin_dir.as_deref()) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("smcr service: {e}");
                    return ExitCode::FAILURE;
                }
            };
            for f in &files {
                println!("read {}", f.display());
            }
            let filters = settings.list("SystemCallFilter");
            let allowed = (!filters.is_empty())
                .then(|| service::allowed_calls(&filters))
                .flatten();
            let mut findings = service::check(&settings, &lib, allowed.as_ref(), allowed.is_some());
            if let Some(p) = service::preloaded_library(&settings)
                && p.is_absolute()
                && !p.is_file()
            {
                findings.push(service::Finding::Problem(format!(
                    "{} does not exist: install it (scripts/install.sh, or the .deb)",
                    p.display()
                )));
            }
            let mut bad = false;
            for f in findings {
                match f {
                    service::Finding::Ok(t) => println!("ok: {t}"),
                    service::Finding::Note(t) => println!("note: {t}"),
                    service::Finding::Problem(t) => {
                        bad = true;
                        println!("problem: {t}");
                    }
                }
            }
            if bad {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}

fn fail(e: &dyn std::fmt::Display) -> bool {
    eprintln!("smcr: {e}");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cmd, clap::Error> {
        Cli::try_parse_from(std::iter::once("smcr").chain(args.iter().copied())).map(|c| c.cmd)
    }

    fn run_args(args: &[&str]) -> RunArgs {
        match parse(args).unwrap() {
            Cmd::Run(a) => a,
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_takes_cmd_without_dashes_and_its_options_stay_its_own() {
        let a = run_args(&["run", "--assume", "redis-cli", "-p", "7000", "--lib", "x"]);
        assert!(a.assume && a.lib.is_none());
        assert_eq!(a.cmd, ["redis-cli", "-p", "7000", "--lib", "x"]);
        let a = run_args(&["run", "--rmb-kib", "128", "--", "sh", "-c", "echo"]);
        assert_eq!((a.rmb_kib, a.cmd.len()), (Some(128), 3));
        let a = run_args(&["run", "--", "--weird-name"]);
        assert_eq!(a.cmd, ["--weird-name"]);
    }

    #[test]
    fn run_rejects_unknown_options_and_small_rmbs() {
        let e = parse(&["run", "--bogus", "true"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        assert!(e.to_string().contains("--bogus"), "{e}");
        assert!(parse(&["run", "--rmb-kib", "8", "true"]).is_err());
        assert!(parse(&["run"]).is_err());
        assert!(parse(&["run", "-r", "64K", "--rmb-kib", "64", "true"]).is_err());
    }

    #[test]
    fn smc_run_sizes_map_to_the_rmb() {
        let a = run_args(&["run", "-r", "256K", "-t", "1M", "true"]);
        assert_eq!((a.rcvbuf, a.sndbuf), (Some(256 << 10), Some(1 << 20)));
        assert_eq!(rcvbuf_kib(a.rcvbuf.unwrap()), 256);
        assert_eq!(rcvbuf_kib(1000), 16);
        assert_eq!(rcvbuf_kib(70_000), 69);
        assert_eq!(parse_size("2m"), Ok(2 << 20));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert!(parse_size("12Q").is_err() && parse_size("0").is_err());
    }

    #[test]
    fn smc_tools_commands_and_aliases_parse() {
        assert!(matches!(
            parse(&["stats"]),
            Ok(Cmd::Stats(StatsArgs { action: None, .. }))
        ));
        assert!(matches!(
            parse(&["stats", "reset", "--dir", "/x"]),
            Ok(Cmd::Stats(StatsArgs {
                action: Some(StatsAction::Reset),
                ..
            }))
        ));
        for w in ["linkgroup", "lgr"] {
            assert!(matches!(parse(&[w, "show"]), Ok(Cmd::Linkgroup(_))), "{w}");
        }
        match parse(&["dev", "show", "-d"]).unwrap() {
            Cmd::Device(s) => assert!(s.area.details),
            c => panic!("{c:?}"),
        }
        assert!(matches!(
            parse(&["ueid", "add", "X"]),
            Ok(Cmd::Ueid {
                action: Some(UeidAction::Add { .. })
            })
        ));
        match parse(&["bpf", "install", "--netns", "ns1", "--only", "steer"]).unwrap() {
            Cmd::Bpf(b) => {
                assert_eq!((b.action, b.only), (BpfAction::Install, Some(Only::Steer)));
                assert_eq!(b.netns.as_deref(), Some("ns1"));
            }
            c => panic!("{c:?}"),
        }
        assert!(parse(&["bpf", "--dir", "/d", "status"]).is_ok());
        assert!(parse(&["bpf", "frob"]).is_err());
    }
}
