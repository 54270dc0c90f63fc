//! The calls by which a program locks itself down: setrlimit/setrlimit64/prlimit/prlimit64
//! lowering its own `RLIMIT_NPROC` (haproxy sets it to 0 once its listeners are bound),
//! prctl(PR_SET_SECCOMP) and libseccomp's seccomp_load forbid it new threads: before the real
//! call the shim parks the spare threads SMC-R will need (`shim::locking_down`). chroot takes
//! `/proc` away, where a new filter would be seen: a descriptor of it is kept first. The call
//! itself, its result and errno are libc's, whatever happened on our side.
//!
//! Not hooked: `syscall(SYS_seccomp, …)` (what libseccomp does inside seccomp_load, and what a
//! program without libseccomp may do directly). Interposing `syscall` would put our code on
//! every futex wait and wake of programs that call it (Rust's std among them, ours included)
//! and in front of calls that must not gain a stack frame (clone, vfork); not worth it for a
//! call we can only prepare for. Such a filter finds the spares parked when the runtime
//! started, and a thread is never created after it (`rdma::thread`: the filter count).

use std::ffi::c_void;

use libc::{c_int, c_ulong};

use crate::guard::{bypassed, errno, guarded, set_errno};
use crate::{real, shim};

/// Whether `pid` names this process (prlimit's 0 or our own pid).
fn this_process(pid: libc::pid_t) -> bool {
    // SAFETY: getpid has no preconditions.
    pid == 0 || pid == unsafe { libc::getpid() }
}

/// Before a call that may set this process's `resource` soft limit to `soft` (`new` given).
fn before_limit(resource: c_int, soft: Option<u64>) {
    if bypassed() || resource != libc::RLIMIT_NPROC as c_int {
        return;
    }
    let Some(soft) = soft else {
        return;
    };
    let mut now = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: reading our own limit into a local.
    unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut now) };
    if soft < now.rlim_cur {
        prepare("RLIMIT_NPROC lowered");
    }
}

/// Parks what SMC-R will need, keeping the program's errno for its own call.
fn prepare(what: &'static str) {
    let e = errno();
    guarded((), || shim::locking_down(what));
    set_errno(e);
}

/// # Safety
/// libc's contract for setrlimit(2) (`rlim` is read before the call when it is not null).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setrlimit(resource: c_int, rlim: *const libc::rlimit) -> c_int {
    // SAFETY: the caller's rlimit, or null.
    before_limit(resource, unsafe { rlim.as_ref() }.map(|r| r.rlim_cur));
    // SAFETY: forwarding.
    unsafe { real::setrlimit()(resource, rlim) }
}

/// # Safety
/// As [`setrlimit`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setrlimit64(resource: c_int, rlim: *const libc::rlimit64) -> c_int {
    // SAFETY: as above.
    before_limit(resource, unsafe { rlim.as_ref() }.map(|r| r.rlim_cur));
    // SAFETY: forwarding.
    unsafe { real::setrlimit64()(resource, rlim) }
}

/// # Safety
/// libc's contract for prlimit(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn prlimit(
    pid: libc::pid_t,
    resource: c_int,
    new: *const libc::rlimit,
    old: *mut libc::rlimit,
) -> c_int {
    if this_process(pid) {
        // SAFETY: as above.
        before_limit(resource, unsafe { new.as_ref() }.map(|r| r.rlim_cur));
    }
    // SAFETY: forwarding.
    unsafe { real::prlimit()(pid, resource, new, old) }
}

/// # Safety
/// As [`prlimit`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn prlimit64(
    pid: libc::pid_t,
    resource: c_int,
    new: *const libc::rlimit64,
    old: *mut libc::rlimit64,
) -> c_int {
    if this_process(pid) {
        // SAFETY: as above.
        before_limit(resource, unsafe { new.as_ref() }.map(|r| r.rlim_cur));
    }
    // SAFETY: forwarding.
    unsafe { real::prlimit64()(pid, resource, new, old) }
}

/// # Safety
/// libc's contract for prctl(2); the arguments after `option` are read as four
/// pointer-sized integers, which is how x86-64 and aarch64 Linux pass them, and passed on
/// as they came.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    a4: c_ulong,
    a5: c_ulong,
) -> c_int {
    if option == libc::PR_SET_SECCOMP && !bypassed() {
        prepare("prctl(PR_SET_SECCOMP)");
    }
    // SAFETY: forwarding.
    unsafe { real::prctl()(option, a2, a3, a4, a5) }
}

/// # Safety
/// libc's contract for chroot(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn chroot(path: *const libc::c_char) -> c_int {
    if !bypassed() {
        let e = errno();
        guarded((), shim::before_chroot);
        set_errno(e);
    }
    // SAFETY: forwarding.
    unsafe { real::chroot()(path) }
}

/// # Safety
/// libseccomp's contract for seccomp_load(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn seccomp_load(ctx: *mut c_void) -> c_int {
    if !bypassed() {
        prepare("seccomp_load");
    }
    match real::seccomp_load() {
        // SAFETY: forwarding.
        Some(f) => unsafe { f(ctx) },
        None => -libc::ENOSYS,
    }
}
