//! `smcr`: the command-line front end. For now it manages the TCP-option eBPF program
//! (`smcr bpf install|uninstall|status`); the launcher (`smcr run -- CMD`) comes with the preload.

use std::path::PathBuf;
use std::process::ExitCode;

use smcr::option;

const USAGE: &str = "usage: smcr bpf {install|uninstall|status} [--dir DIR]

  install    load the SMC-R TCP option program, attach it to the cgroup v2 root and pin it
             under DIR (default /sys/fs/bpf/smcr); needs root; does nothing if present
  uninstall  remove the pins (the program detaches); marked sockets carry on as plain TCP
  status     say whether the program is installed and usable by this user";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
