//! `libsmcr`: the `LD_PRELOAD` shim (issue 5). Unmodified programs' TCP sockets become SMC-R
//! connections when both ends can, plain TCP otherwise, with nothing else for the program to
//! notice. `hooks` exports the libc socket functions, `shim` holds what happens to our sockets,
//! `table` says (lock-free) which descriptors are ours, `real` finds libc's own functions, and
//! `guard` keeps our own calls out of our hooks, sets errno and stops panics at the boundary.
//!
//! Dependencies point down (`scripts/module_cycles.py`): `hooks`; `poll` and `sendfile`; `shim`
//! (what happens to our sockets); `epoll` (the application's epoll registrations, ours in
//! `epoll::vepoll`, the kernel's view of a connection) and `workers`; `table`; the types it
//! holds, `sock` (`Sock`, `SmcFd`, `Settling`) over `pair` (`Pair`, readiness); `wake` (how a
//! pair wakes waiters: vepoll hands its kick in at load); `fds`, `guard`, `log`, `real`,
//! `bypass`.
//!
//! The exports keep libc's signatures and contracts; their `# Safety` sections say so once
//! each rather than restating the man pages.
#![allow(clippy::missing_safety_doc)]

mod bypass;
mod debug;
mod epoll;
mod fds;
mod forkhold;
mod guard;
mod hooks;
mod log;
mod pair;
mod poll;
mod real;
mod sendfile;
mod shim;
mod sock;
mod table;
mod wake;
mod workers;

/// Runs when the library is loaded, before the program's `main`: the `SMCR_*` settings (the
/// configuration file's, the environment's over them) are kept as they are now (a program
/// may clear its environment later: nginx's workers), and
/// sockets the program inherited through `exec` are recognised (see `shim::adopt`).
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = {
    extern "C" fn on_load() {
        guard::guarded((), || {
            // The configuration file, then the environment over it (`smcr::settings`).
            smcr::settings::load_process();
            // From our first descriptor on (the kept log's), ours live outside the numbers
            // the program gets: a daemon that closes or reuses 3, 4, … never meets them.
            smcr::fdzone::enable();
            log::init();
            shim::init_settings();
            hooks::prepare_exec();
            shim::adopt();
        });
        // Registered first, so run after the program's own handlers (which may still use
        // their sockets).
        // SAFETY: registering a plain function without arguments.
        unsafe { libc::atexit(on_exit) };
        // SAFETY: registering plain functions without arguments.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
    }
    /// The forking thread takes our process-wide locks (`forkhold`), in the order code nests
    /// them: the table first (a socket dropped under it may reach the others), smcr's and the
    /// engine's last (the runtime's creation takes them).
    extern "C" fn before_fork() {
        guard::guarded((), || {
            // What this thread corked and the ACKs it holds leave now (it is not answering
            // while it forks), so that no child inherits a list of the parent's queue pairs
            // and sends on them at its first call into us. Before the fork's locks.
            smcr::cork::end();
            table::hold_for_fork();
            shim::hold_for_fork();
            workers::hold_for_fork();
            smcr::hold_for_fork();
        });
    }
    extern "C" fn after_fork() {
        guard::guarded((), smcr::release_after_fork);
    }
    extern "C" fn on_exit() {
        guard::guarded((), shim::at_exit);
    }
    on_load
};
