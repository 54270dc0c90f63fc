//! The exec family and posix_spawn: a new program image gets the descriptors that are not
//! close-on-exec. One that will not load the library (its environment has no `LD_PRELOAD`
//! naming it: `systemd-socket-activate` execs its command with a fresh environment, `env -u
//! LD_PRELOAD`, a program that cleans its environment) cannot negotiate, so before the real
//! call our sockets handed to it are made plain TCP (`shim::handing_off`): a marked listener
//! goes quiet (its peers are no longer told we speak SMC-R), an accepted connection nobody
//! settled yet is declined now. Handed to it: at 0, 1 or 2 (inetd's), or at 3 and up to the
//! new environment's `LISTEN_FDS` (socket activation's); a socket merely left open elsewhere
//! (not close-on-exec by oversight) is not the new program's to use, and quieting it would take
//! SMC-R from the process that does use it. An image that loads the library recognises them itself
//! (`shim::adopt`). The call, its result and errno are libc's.
//!
//! The variadic `execl`, `execle`, `execlp` (glibc's reach its internal `__execve`, past our
//! hook): stable Rust cannot write a C variadic function's body, so ours are naked entry
//! points that jump, registers and stack untouched, into C (`execl.c`), which builds the
//! array and calls [`execve`] or [`execvp`] here. Not hooked: the exec inside glibc's own
//! `system`/`popen` (internal calls), whose shells keep the environment.

use libc::{c_char, c_int, pid_t};

use crate::guard::{bypassed, errno, guarded, set_errno};
use crate::{real, shim};

/// At load: what the exec hooks need is looked up now, not in a forked child about to exec
/// (`dlsym` and `dladdr` take the loader's lock, which another thread of the parent may have
/// held at the fork).
pub(crate) fn prepare() {
    let _ = (
        real::execve(),
        real::execv(),
        real::execvp(),
        real::execvpe(),
    );
    let _ = (real::fexecve(), real::execveat());
    let _ = (real::posix_spawn(), real::posix_spawnp());
    shim::prepare_handoff();
}

/// The environment the new image gets.
enum Env {
    /// This one (`environ`).
    Current,
    /// The caller's `envp` (null: empty).
    Given(*const *const c_char),
}

/// Before an exec (or spawn): our sockets that would reach an image without the library are
/// made plain TCP. Keeps the program's errno.
fn before_exec(env: Env) {
    // What this thread corked leaves before the image goes.
    smcr::cork::end();
    if bypassed() {
        return;
    }
    let e = errno();
    guarded((), || {
        let envp = match env {
            // SAFETY: glibc's environment array, as the exec would read it.
            Env::Current => unsafe { environ },
            Env::Given(p) => p,
        };
        // SAFETY: a NULL-terminated array of NUL-terminated strings, or null.
        let preload = unsafe { find_var(envp, b"LD_PRELOAD=") };
        if !shim::library_in(preload.as_deref()) {
            // SAFETY: as above.
            let listen_fds = unsafe { find_var(envp, b"LISTEN_FDS=") }
                .and_then(|v| v.trim().parse::<i32>().ok())
                .unwrap_or(0);
            shim::handing_off("an exec without the library", listen_fds);
        }
    });
    set_errno(e);
}

/// An exec of this process: [`before_exec`], this process's stats area goes (the pid stays,
/// the image that updated it does not), then `call`, which returns only when it failed.
fn exec(env: Env, call: impl FnOnce() -> c_int) -> c_int {
    before_exec(env);
    if !bypassed() {
        guarded((), shim::before_exec);
    }
    let r = call();
    if !bypassed() {
        let e = errno();
        guarded((), || shim::exec_failed(e));
        set_errno(e);
    }
    r
}

unsafe extern "C" {
    static environ: *const *const c_char;
}

/// The value of the variable `name` (with its `=`) in `envp`, if any.
///
/// # Safety
/// `envp` is null or a NULL-terminated array of NUL-terminated strings.
unsafe fn find_var(envp: *const *const c_char, name: &[u8]) -> Option<String> {
    if envp.is_null() {
        return None;
    }
    let mut i = 0;
    loop {
        // SAFETY: within the array, up to its NULL.
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated string of the environment.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes();
        if let Some(v) = s.strip_prefix(name) {
            return Some(String::from_utf8_lossy(v).into_owned());
        }
        i += 1;
    }
}

/// # Safety
/// libc's contract for execve(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Given(envp), || unsafe {
        real::execve()(path, argv, envp)
    })
}

/// # Safety
/// libc's contract for execv(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Current, || unsafe { real::execv()(path, argv) })
}

/// # Safety
/// libc's contract for execvp(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Current, || unsafe { real::execvp()(file, argv) })
}

/// # Safety
/// libc's contract for execvpe(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Given(envp), || unsafe {
        real::execvpe()(file, argv, envp)
    })
}

/// What `execl.c`'s `execl`/`execle` call: [`execve`].
///
/// # Safety
/// libc's contract for execve(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn smcr_preload_execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { execve(path, argv, envp) }
}

/// What `execl.c`'s `execlp` calls: [`execvp`].
///
/// # Safety
/// libc's contract for execvp(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn smcr_preload_execvp(
    file: *const c_char,
    argv: *const *const c_char,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { execvp(file, argv) }
}

unsafe extern "C" {
    // execl.c's variadic bodies; only jumped to.
    fn smcr_execl();
    fn smcr_execlp();
    fn smcr_execle();
}

/// Exported `execl`, `execlp`, `execle`: a jump to the C body of the same call. Naked, so the
/// variadic arguments (registers, stack, and on x86-64 `al`) reach it exactly as the program
/// passed them.
macro_rules! variadic_exec {
    ($($name:ident => $body:ident),*) => {$(
        /// # Safety
        #[doc = concat!("libc's contract for ", stringify!($name), "(3).")]
        #[unsafe(no_mangle)]
        #[unsafe(naked)]
        pub unsafe extern "C" fn $name() {
            #[cfg(target_arch = "x86_64")]
            core::arch::naked_asm!("jmp {}", sym $body);
            #[cfg(target_arch = "aarch64")]
            core::arch::naked_asm!("b {}", sym $body);
        }
    )*};
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
variadic_exec!(execl => smcr_execl, execlp => smcr_execlp, execle => smcr_execle);

/// # Safety
/// libc's contract for fexecve(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Given(envp), || unsafe {
        real::fexecve()(fd, argv, envp)
    })
}

/// # Safety
/// libc's contract for execveat(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    // SAFETY: forwarding.
    exec(Env::Given(envp), || unsafe {
        real::execveat()(dirfd, path, argv, envp, flags)
    })
}

/// # Safety
/// libc's contract for posix_spawn(3). The child gets our descriptors that are not
/// close-on-exec (its file actions aside): the parent's listener is shared with it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    before_exec(Env::Given(envp.cast()));
    // SAFETY: forwarding.
    unsafe { real::posix_spawn()(pid, path, actions, attr, argv, envp) }
}

/// # Safety
/// libc's contract for posix_spawnp(3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    before_exec(Env::Given(envp.cast()));
    // SAFETY: forwarding.
    unsafe { real::posix_spawnp()(pid, file, actions, attr, argv, envp) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preload_of_an_environment() {
        let vars = [c"A=1", c"LD_PRELOAD=/usr/lib/libsmcr.so /x.so", c"B=2"];
        let mut ptrs: Vec<*const c_char> = vars.iter().map(|v| v.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        // SAFETY: a NULL-terminated array of C strings that outlive the call.
        let got = unsafe { find_var(ptrs.as_ptr(), b"LD_PRELOAD=") };
        assert_eq!(got.as_deref(), Some("/usr/lib/libsmcr.so /x.so"));
        let none = [c"A=1".as_ptr(), std::ptr::null()];
        // SAFETY: as above.
        assert_eq!(unsafe { find_var(none.as_ptr(), b"LD_PRELOAD=") }, None);
        // SAFETY: null is allowed.
        assert_eq!(unsafe { find_var(std::ptr::null(), b"LD_PRELOAD=") }, None);
    }
}
