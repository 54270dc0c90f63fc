//! `smcr`: the command-line front end: the launcher (`smcr run -- CMD`, like smc-tools'
//! `smc_run`) and the TCP-option eBPF program (`smcr bpf install|uninstall|status`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use smcr::option;

const USAGE: &str = "usage: smcr run [OPTIONS] -- CMD [ARGS...]
       smcr bpf {install|uninstall|status} [--dir DIR]

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
             under DIR (default /sys/fs/bpf/smcr); needs root; does nothing if present
  uninstall  remove the pins (the program detaches); marked sockets carry on as plain TCP
  status     say whether the program is installed and usable by this user";

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
    let mut dir = PathBuf::from(option::DEFAULT_DIR);
    let (mut assume, mut lib, mut log) = (false, None, None);
    let (mut rmb, mut include, mut exclude) = (None, None, None);
    let mut it = opts.iter();
    while let Some(o) = it.next() {
        let mut val = || it.next().cloned();
        match o.as_str() {
            "--dir" => dir = PathBuf::from(val().unwrap_or_default()),
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
        if !option::is_installed(&dir) {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!(
                    "smcr run: the SMC-R option program is not installed under {}; run `sudo smcr bpf install` once (or use --assume when every peer runs smcr)",
                    dir.display()
                );
                return ExitCode::FAILURE;
            }
            if let Err(e) = option::install(&dir) {
                eprintln!("smcr run: installing the option program: {e}");
                return ExitCode::FAILURE;
            }
        }
        c.env("SMCR_BPF_DIR", &dir).env_remove("SMCR_NEGOTIATION");
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
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => match it.next() {
                Some(d) => dir = PathBuf::from(d),
                None => return usage(),
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            w => words.push(w),
        }
    }
    match words.as_slice() {
        ["bpf", "install"] => match option::install(&dir) {
            Ok(option::Installed::Fresh { cgroup }) => {
                println!(
                    "installed: attached to {} and pinned under {}",
                    cgroup.display(),
                    dir.display()
                );
                ExitCode::SUCCESS
            }
            Ok(option::Installed::Present) => {
                println!("already installed under {}", dir.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        ["bpf", "uninstall"] => match option::uninstall(&dir) {
            Ok(()) => {
                println!("removed the pins under {}", dir.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        ["bpf", "status"] => match option::OptionMap::open(&dir) {
            Ok(_) if option::is_installed(&dir) => {
                println!("installed under {} and usable by this user", dir.display());
                ExitCode::SUCCESS
            }
            Ok(_) => {
                println!("map pinned under {} but the link is missing", dir.display());
                ExitCode::FAILURE
            }
            Err(e) => fail(&e),
        },
        _ => usage(),
    }
}

fn usage() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

fn fail(e: &option::OptionError) -> ExitCode {
    eprintln!("smcr: {e}");
    ExitCode::FAILURE
}
