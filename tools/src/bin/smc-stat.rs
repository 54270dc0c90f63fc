//! `smc-stat`: every SMC-R connection, link group and fallback reason of the processes running
//! smcr, read from their shared-memory stats areas (`smcr::stats`) without disturbing them.
//! It takes smc-tools' `smcss` options with their meaning (`-a -l -d -D -R -W -v`) and adds
//! its own views. The formats live in `smcr_tools::view` (snapshot-tested); this is the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{ArgAction, Parser, Subcommand};
use smcr::stats;
use smcr_tools::view::{self, Rows, Snapshot, SocketView};

/// Connections, link groups, devices and fallback reasons of the processes running smcr
/// (like smc-tools' smcss, with its options, plus PID, command, fallback reasons, remedies and
/// handshake stage times).
///
/// With no option: one row per connection (not listening): pid, command, state, local and
/// peer address, mode (SMCR or TCP), fallback reason (name, code, `by peer` when the peer
/// declined), bytes sent/received, RMB and send buffer sizes.
#[derive(Parser, Debug)]
#[command(
    name = "smc-stat",
    version,
    disable_version_flag = true,
    after_help = "smcss's options keep smcss's meaning. `-R` is smcss's --smcr (SMC-R sockets \
                  only, with link role, id and GIDs); the link-group table that `-R` showed \
                  before is `--links`."
)]
struct Cli {
    /// Connections and listening sockets (smcss -a)
    #[arg(short, long)]
    all: bool,
    /// Listening sockets only (smcss -l)
    #[arg(short, long, conflicts_with_all = ["all", "smcr", "smcd"])]
    listening: bool,
    /// Token, buffer sizes and cursors in hex as smcss prints them, CDC flags, fallback
    /// meaning and handshake stage times under each row (smcss -d; with --devices: every
    /// counter by name)
    #[arg(short, long, visible_alias = "details")]
    debug: bool,
    /// SMC-D sockets only (smcss -D): smcr has no SMC-D, so an empty table and a note
    #[arg(short = 'D', long, conflicts_with = "smcr")]
    smcd: bool,
    /// SMC-R sockets only, with their link's role, link id and GIDs (smcss -R; the link
    /// groups, which -R showed before, are --links)
    #[arg(short = 'R', long)]
    smcr: bool,
    /// Do not truncate addresses (smcss -W)
    #[arg(short = 'W', long)]
    wide: bool,
    /// Print the version (smcss -v)
    #[arg(short = 'v', short_alias = 'V', long, action = ArgAction::Version)]
    version: Option<bool>,
    /// Link groups and their links: role, state, connections, QPNs, GIDs, peer, transport
    #[arg(long, group = "view")]
    links: bool,
    /// RoCE devices per process and address: how packets reach the engine (steered, owner,
    /// local-only, fixed), packets, ICRC errors, drops, retransmissions, NAKs, packets from
    /// Linux rxe peers (with -d: every counter by name)
    #[arg(long, group = "view")]
    devices: bool,
    /// Totals and fallback counters per reason: code, name, count, meaning, remedy (with -a:
    /// every code smc-stat knows, Linux's and ours)
    #[arg(long, group = "view")]
    fallback: bool,
    /// Everything as one JSON document (stable schema, "version" 1)
    #[arg(long, group = "view")]
    json: bool,
    /// The counters in the Prometheus text format
    #[arg(long, group = "view")]
    prometheus: bool,
    /// Redraw every SECONDS seconds (Ctrl-C stops)
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    watch: Option<Duration>,
    /// Only that process
    #[arg(long, global = true)]
    pid: Option<u32>,
    /// Where the stats areas are (default /dev/shm/smcr, or $SMCR_STATS_DIR)
    #[arg(long, global = true, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Write smc-stat.1 and the bash, zsh and fish completions into DIR (scripts/install.sh)
    #[arg(long, hide = true, value_name = "DIR", exclusive = true)]
    generate: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

/// `--generate DIR`: the man page and the shell completions, from this command line.
fn generate(dir: &std::path::Path) -> std::io::Result<()> {
    use clap::CommandFactory;
    std::fs::create_dir_all(dir)?;
    let mut cmd = Cli::command();
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    std::fs::write(dir.join("smc-stat.1"), page)?;
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        clap_complete::generate_to(shell, &mut cmd, "smc-stat", dir)?;
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Zero the counters (totals and fallback counters) in the stats areas themselves, as
    /// `smcr stats reset` does; needs write access to the areas (their owner, or root)
    Reset,
}

fn seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(Duration::from_secs_f64(x)),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(dir) = &cli.generate {
        return match generate(dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("smc-stat --generate: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let dir = cli.dir.clone().unwrap_or_else(|| {
        // The programs' setting: the environment's, else the configuration file's.
        smcr::settings::for_tools("SMCR_STATS_DIR")
            .filter(|d| d != "off")
            .map_or_else(|| PathBuf::from(stats::DEFAULT_DIR), PathBuf::from)
    });
    if let Some(Command::Reset) = cli.command {
        return match view::reset(&dir, cli.pid) {
            Ok(n) => {
                println!("reset the counters of {n} process area(s)");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("smc-stat reset: {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let rows = if cli.listening {
        Rows::Listeners
    } else if cli.all {
        Rows::All
    } else {
        Rows::Connections
    };
    let render = || {
        let snap = Snapshot::collect(&dir, cli.pid);
        if cli.links {
            view::render_links(&snap)
        } else if cli.devices {
            view::render_devices(&snap, cli.debug) + &view::render_host_rdma()
        } else if cli.fallback {
            view::render_fallbacks(&snap, cli.all)
        } else if cli.json {
            view::render_json(&snap)
        } else if cli.prometheus {
            view::render_prometheus(&snap)
        } else {
            view::render_socket_table(
                &snap,
                SocketView {
                    rows,
                    details: cli.debug,
                    smcr: cli.smcr,
                    smcd: cli.smcd,
                    wide: cli.wide,
                },
            )
        }
    };
    match cli.watch {
        None => print!("{}", render()),
        Some(every) => loop {
            // Home and clear, then the frame: one write, so a terminal never shows half.
            let frame = format!("\x1b[H\x1b[2J{}", render());
            print!("{frame}");
            use std::io::Write;
            if std::io::stdout().flush().is_err() {
                return ExitCode::SUCCESS; // the reader went away
            }
            std::thread::sleep(every);
        },
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
