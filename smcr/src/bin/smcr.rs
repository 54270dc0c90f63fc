//! `smcr`: the command-line front end: the launcher (`smcr run -- CMD`, like smc-tools'
//! `smc_run`) and the eBPF programs — the TCP option and the RoCE steering program
//! (`smcr bpf install|uninstall|status`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use smcr::{option, steer};

const USAGE: &str = "usage: smcr run [OPTIONS] -- CMD [ARGS...]
       smcr bpf {install|uninstall|status} [--dir DIR] [--netns NAME] [--only option|steer]

run: start CMD with its TCP sockets accelerated by SMC-R (LD_PRELOAD of the smcr library).
  --dir DIR          the option program's pin directory (default /sys/fs/bpf/smcr); as root
                     it is installed there if missing
  --assume           no option program: assume every peer runs smcr (both ends launched by
                     smcr run, e.g. in tests); a plain peer would then see CLC bytes
  --rmb-kib N        receive buffer (RMB) per connection in KiB (default 64)
  --include RULES    use SMC-R only for these destinations/listeners
  --exclude RULES    never use SMC-R for these (RULES: comma-separated PORT, LO-HI,
                     A.B.C.D[/N][:PORT[-HI]]; see docs/running.md)
  --log FILE         one line per connection: SMC-R, or TCP and the fallback reason
  --lib PATH         the library (default: libsmcr_preload.so next to this program, or
                     $SMCR_LIB)

bpf:
  install    load the SMC-R TCP option program, attach it to the cgroup v2 root and pin it
             under DIR (default /sys/fs/bpf/smcr); load the RoCE steering program, pin it
             there and attach it (tc ingress, tcx) to lo and every Ethernet interface of the
             network namespace, so that any number of processes per address run SMC-R;
             needs root; what is present already is kept
  uninstall  remove the pins (the programs detach, in every namespace); marked sockets
             carry on as plain TCP, processes that relied on steering lose remote peers
  status     say whether the programs are installed, attached here and usable by this user
  --netns NAME   act in network namespace NAME (/var/run/netns/NAME, or a path) — instead
                 of `ip netns exec`, whose private /sys has no bpffs to keep the pins
  --only WHICH   just the option program, or just the steering program";

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

/// `smcr run [OPTIONS] -- CMD ARGS...`: sets the environment up and execs CMD.
fn run(args: &[String]) -> ExitCode {
    let Some(split) = args.iter().position(|a| a == "--") else {
        return usage();
    };
    let (opts, cmd) = (&args[..split], &args[split + 1..]);
    if cmd.is_empty() {
        return usage();
    }
    let mut dir = option::default_dir();
    let mut dir_given = false;
    let (mut assume, mut lib, mut log) = (false, None, None);
    let (mut rmb, mut include, mut exclude) = (None, None, None);
    let mut it = opts.iter();
    while let Some(o) = it.next() {
        let mut val = || it.next().cloned();
        match o.as_str() {
            "--dir" => {
                dir = PathBuf::from(val().unwrap_or_default());
                dir_given = true;
            }
            "--assume" => assume = true,
            "--lib" => lib = val().map(PathBuf::from),
            "--log" => log = val(),
            "--rmb-kib" => match val().and_then(|v| v.parse::<u32>().ok()) {
                Some(k) if k >= 16 => rmb = Some(k),
                _ => {
                    eprintln!("smcr run: --rmb-kib needs a number of KiB, at least 16");
                    return ExitCode::from(2);
                }
            },
            "--include" => include = val(),
            "--exclude" => exclude = val(),
            _ => return usage(),
        }
    }
    if let Err(e) = smcr::policy::Policy::parse(include.as_deref(), exclude.as_deref()) {
        eprintln!("smcr run: {e}");
        return ExitCode::from(2);
    }
    let lib = match find_lib(lib) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smcr run: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut c = std::process::Command::new(&cmd[0]);
    c.args(&cmd[1..]);
    if assume {
        c.env("SMCR_NEGOTIATION", "assume");
    } else {
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
        c.env_remove("SMCR_NEGOTIATION");
    }
    // Ours first; keep whatever the user preloads already.
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.trim().is_empty() => format!("{} {p}", lib.display()),
        _ => lib.display().to_string(),
    };
    c.env("LD_PRELOAD", preload);
    for (k, v) in [
        ("SMCR_RMB_KIB", rmb.map(|k| k.to_string())),
        ("SMCR_INCLUDE", include),
        ("SMCR_EXCLUDE", exclude),
        ("SMCR_LOG", log),
    ] {
        if let Some(v) = v {
            c.env(k, v);
        }
    }
    let e = c.exec();
    eprintln!("smcr run: cannot start {}: {e}", cmd[0]);
    ExitCode::from(127)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("run") {
        return run(&args[1..]);
    }
    let mut dir = PathBuf::from(option::DEFAULT_DIR);
    let mut words = Vec::new();
    let (mut netns, mut only) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => match it.next() {
                Some(d) => dir = PathBuf::from(d),
                None => return usage(),
            },
            "--netns" => match it.next() {
                Some(n) => netns = Some(n.clone()),
                None => return usage(),
            },
            "--only" => match it.next().map(String::as_str) {
                Some(w @ ("option" | "steer")) => only = Some(w.to_owned()),
                _ => return usage(),
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            w => words.push(w),
        }
    }
    if !matches!(
        words.as_slice(),
        ["bpf", "install" | "uninstall" | "status"]
    ) {
        return usage();
    }
    if let Some(ns) = &netns
        && let Err(e) = enter_netns(ns)
    {
        eprintln!("smcr: network namespace {ns}: {e}");
        return ExitCode::FAILURE;
    }
    let (opt, st) = (
        only.as_deref() != Some("steer"),
        only.as_deref() != Some("option"),
    );
    let mut ok = true;
    match words[1] {
        "install" => {
            if opt {
                ok &= install_option(&dir);
            }
            if st {
                ok &= install_steer(&dir);
            }
        }
        "uninstall" => {
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
        _ => {
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
    match option::OptionMap::open(dir) {
        Ok(_) if option::is_installed(dir) => {
            println!(
                "option: installed under {} and usable by this user",
                dir.display()
            );
            true
        }
        Ok(_) => {
            println!(
                "option: map pinned under {} but the link is missing",
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

fn usage() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

fn fail(e: &dyn std::fmt::Display) -> bool {
    eprintln!("smcr: {e}");
    false
}
