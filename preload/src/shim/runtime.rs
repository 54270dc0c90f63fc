//! The process's runtime (made on first use, again in a forked child), the end of the process
//! (`at_exit`), the settings that turn SMC-R on or off (`SMCR_DISABLE`, `SMCR_INCLUDE`/
//! `SMCR_EXCLUDE`), and what each settled connection leaves behind: its log line
//! (`describe`) and its claim on the socket (`claim`).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use smcr::{FallbackReason, Mode, Runtime, RuntimeConfig};

use crate::guard::Bypass;
use crate::{log, table};

/// The process's runtime, created on first use, and again in a forked child (whose engine and
/// poller threads did not survive the fork).
/// This process's runtime with its pid (a forked child makes its own).
/// A `std` lock: held across `fork` (`forkhold`).
static RT: Mutex<Option<(u32, Runtime)>> = Mutex::new(None);

/// Before a fork: the forking thread takes the runtime's cell (see `forkhold`).
pub(crate) fn hold_for_fork() {
    crate::forkhold::hold_mutex(&RT);
}

pub(crate) fn runtime() -> Runtime {
    let mut g = crate::forkhold::lock(&RT);
    let pid = table::pid();
    match &*g {
        Some((p, rt)) if *p == pid => rt.clone(),
        _ => {
            let _b = Bypass::new();
            smcr::fdzone::enable();
            let rt = Runtime::new(RuntimeConfig::from_env());
            // The threads the first connection will want (engine, TCP watch, a link group's
            // poller, a handshake worker, with the default 4), made now: the program may
            // forbid new ones later in ways we do not see (a pids limit, a seccomp filter
            // through syscall()).
            smcr::thread::reserve(smcr::thread::target());
            if let Some(why) = rt.negotiation_problem() {
                log::line(format_args!(
                    "SMC-R unavailable, all connections stay TCP: {why}"
                ));
            }
            // A parent's runtime inherited through fork belongs to the parent: dropping it here
            // could send DELETE LINK on the parent's links. Leak it instead.
            if let Some(old) = g.replace((pid, rt.clone())) {
                std::mem::forget(old);
            }
            rt
        }
    }
}

/// Before an exec (which keeps the pid): this process's stats area goes, when it has one —
/// the new image never updates it, and the area would look alive for as long as the pid is
/// (a new image that runs the library makes its own). Builds no runtime; if the exec fails,
/// the process's stats are no longer listed (said in the log).
pub(crate) fn before_exec() {
    // A fresh getpid, not the table's cached pid: a vfork child (CPython's subprocess, a JVM)
    // runs no atfork handler, shares our memory, and must not remove its parent's area.
    let me = std::process::id();
    let rt = {
        let _holding = crate::forkhold::Holding::new();
        RT.try_lock().ok().and_then(|g| {
            g.as_ref()
                .filter(|(p, _)| *p == me)
                .map(|(_, rt)| rt.clone())
        })
    };
    if let Some(rt) = rt {
        rt.unlink_stats();
    }
}

/// After an exec that returned (it failed): see [`before_exec`].
pub(crate) fn exec_failed(errno: i32) {
    let me = std::process::id();
    let ran = {
        let _holding = crate::forkhold::Holding::new();
        RT.try_lock()
            .ok()
            .is_some_and(|g| g.as_ref().is_some_and(|(p, _)| *p == me))
    };
    if ran {
        log::line(format_args!(
            "exec failed ({}): this process's stats area was removed before it and is no longer listed",
            std::io::Error::from_raw_os_error(errno)
        ));
    }
}

/// The program is about to forbid itself new threads (`what`: it lowers `RLIMIT_NPROC`,
/// installs a seccomp filter): parks `SMCR_SPARE_THREADS` spares now, plus the engine and the
/// TCP watch if this process does not run them yet, and keeps every thread of ours from then
/// on (see `smcr::thread`).
pub(crate) fn locking_down(what: &str) {
    if !enabled() {
        return;
    }
    let _b = Bypass::new();
    // Without waiting: a signal handler's call could come while this thread holds the cell.
    let to_come = {
        let _holding = crate::forkhold::Holding::new();
        RT.try_lock().ok().and_then(|g| {
            g.as_ref()
                .filter(|(p, _)| *p == table::pid())
                .map(|(_, rt)| rt.threads_to_come())
        })
    };
    let parked = smcr::thread::lock_down(to_come.unwrap_or(2));
    let why = smcr::thread::last_refusal()
        .map(|w| format!(" (no more: {w})"))
        .unwrap_or_default();
    log::line(format_args!(
        "{what}: no new threads from now on; {parked} spare threads parked for SMC-R{why} (SMCR_SPARE_THREADS={})",
        smcr::thread::target()
    ));
}

/// The program is about to chroot: `/proc`, where a seccomp filter it adds later is seen, is
/// kept open first (see `smcr::thread`).
pub(crate) fn before_chroot() {
    if enabled() {
        let _b = Bypass::new();
        smcr::thread::keep_proc();
    }
}

/// The spare threads a handshake worker leaves parked: those the runtime may still need (its
/// engine, its TCP watch) and one for the next link group's poller.
pub(super) fn spares_to_keep() -> usize {
    runtime().threads_to_come() + 1
}

/// Negotiations running in this process (connects being settled, accepted connections whose
/// server side runs): the end of the process lets them finish first.
pub(super) static NEGOTIATING: AtomicUsize = AtomicUsize::new(0);

/// How long the end of the process waits for [`NEGOTIATING`] to reach 0 (same host: well
/// under a millisecond each; a kernel peer over TCG: ~50 ms).
const EXIT_NEGOTIATION_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// At `exit`: the kernel would now close the process's sockets; close our SMC-R connections
/// the same way (what they hold is written, then the close goes to the peer), then end the
/// runtime: wait (bounded) for it all to be acknowledged and delete the link groups (DELETE
/// LINK), so that peers neither lose data nor wait out TEST LINK. Only the process that made
/// the runtime: a forked child's copy of its parent's connections is not the child's to close.
pub(crate) fn at_exit() {
    let rt = {
        let _holding = crate::forkhold::Holding::new();
        RT.try_lock().ok().and_then(|g| {
            g.as_ref()
                .filter(|(p, _)| *p == table::pid())
                .map(|(_, rt)| rt.clone())
        })
    };
    let Some(rt) = rt else {
        return;
    };
    // Negotiations under way finish first (briefly: one whose server side nobody uses would
    // not): the program's own closes at its end may just have set them going, and deleting
    // the groups under them would turn connections about to be SMC-R into errors.
    let until = std::time::Instant::now() + rt.config().exit_drain.min(EXIT_NEGOTIATION_WAIT);
    while NEGOTIATING.load(Ordering::Acquire) > 0 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for fd in table::own_smc_numbers() {
        if let Some(s) = table::remove(fd) {
            drop(s);
        }
    }
    rt.end();
}

/// Whether the shim is on (`SMCR_DISABLE=1` turns it off).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let mut on = smcr::settings::flag("SMCR_DISABLE") != Some(true);
        let check = smcr::settings::check_process()
            .map_err(|e| e.to_string())
            .and_then(|()| {
                smcr::RuntimeConfig::try_from_env()
                    .map_err(|e| e.to_string())
                    .map(drop)
            });
        if on && let Err(e) = check {
            // Which setting the user meant cannot be guessed: the whole process stays TCP,
            // and the log says why (decided at load, before the program's first socket).
            log::line(format_args!(
                "{e}; SMC-R is off for this process (every socket stays TCP)"
            ));
            on = false;
        }
        if on {
            // Our descriptors stay out of the application's numbers from the first one.
            smcr::fdzone::enable();
        }
        on
    })
}

/// Whether `SMCR_INCLUDE`/`SMCR_EXCLUDE` let a connection to (or a listener on) `a` use
/// SMC-R. A list that does not parse turns SMC-R off for the process (said once in the log):
/// the user asked to keep some traffic off SMC-R and we cannot tell which.
pub(crate) fn policy_allows(a: std::net::SocketAddrV4) -> bool {
    policy().is_some_and(|p| p.allows(a))
}

fn policy() -> Option<&'static smcr::policy::Policy> {
    static P: OnceLock<Option<smcr::policy::Policy>> = OnceLock::new();
    P.get_or_init(|| {
        let _b = Bypass::new();
        match smcr::policy::Policy::from_env() {
            Ok(p) => Some(p),
            Err(e) => {
                log::line(format_args!("{e}; SMC-R is off for this process"));
                None
            }
        }
    })
    .as_ref()
}

/// Reads the process's settings now, at load, before the program has threads. Each is
/// initialised lazily behind a `OnceLock`; were a thread of ours the first to read one while
/// the program forks, the child would find that initialisation running for ever. (So is the
/// epoll sets' kick handed to `wake`, see `vepoll::init`.)
pub(crate) fn init_settings() {
    // Before the program can install a seccomp filter of its own (see `smcr::thread`).
    smcr::thread::note_start();
    smcr::thread::set_target(smcr::settings::spare_threads());
    let _ = enabled();
    let _ = policy();
    let _ = crate::pair::lazy();
    let _ = crate::epoll::app_drive();
    crate::epoll::vepoll::init();
}

/// How a connection was negotiated, for the log (formatted only when a line is written).
pub(super) fn describe(m: &Mode) -> impl std::fmt::Display + '_ {
    struct D<'a>(&'a Mode);
    impl std::fmt::Display for D<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.0 {
                Mode::SmcR {
                    first_contact: true,
                } => f.write_str("SMC-R (new link group)"),
                Mode::SmcR { .. } => f.write_str("SMC-R (link group reused)"),
                Mode::Tcp(r) => {
                    write!(f, "TCP: {r} [{:#010x}]", r.code())?;
                    // A decline of ours for a local condition: say which.
                    if let FallbackReason::Declined {
                        reason,
                        by_peer: false,
                    } = r
                        && *reason == smcr::DeclineReason::NOSMCRDEV
                        && let Some(why) = runtime().problem()
                    {
                        write!(f, " ({why})")?;
                    }
                    Ok(())
                }
            }
        }
    }
    D(m)
}

/// Records who settled the connection on the socket itself (see the module docs).
pub(super) fn claim(rt: &Runtime, fd: BorrowedFd<'_>, smc: bool) {
    if let Some(m) = rt.option_records() {
        let _ = m.claim(fd, smc, table::pid());
    }
}
