//! The real libc functions behind our exports, found with `dlsym(RTLD_NEXT)` once and cached.

use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, Ordering};

/// Resolves `name` (NUL-terminated) to the next definition after ours.
pub(crate) fn resolve(cache: &AtomicPtr<c_void>, name: &'static [u8]) -> *mut c_void {
    let p = cache.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    // SAFETY: `name` is NUL-terminated; dlsym has no other preconditions.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) };
    if p.is_null() {
        // Without the real function nothing sensible can happen; glibc always has these.
        // SAFETY: abort has no preconditions.
        unsafe { libc::abort() };
    }
    cache.store(p, Ordering::Release);
    p
}

/// `real!(name: fn(args) -> ret)` defines `real::name()`, returning the real function.
macro_rules! real {
    ($($name:ident : fn($($t:ty),*) -> $r:ty;)*) => {
        $(
            #[allow(non_snake_case)]
            pub(crate) fn $name() -> unsafe extern "C" fn($($t),*) -> $r {
                static CACHE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
                let p = resolve(&CACHE, concat!(stringify!($name), "\0").as_bytes());
                // SAFETY: the symbol of that name in libc has exactly this signature.
                unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> $r>(p) }
            }
        )*
    };
}

use libc::{c_int, c_ulong, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};

real! {
    socket: fn(c_int, c_int, c_int) -> c_int;
    connect: fn(c_int, *const sockaddr, socklen_t) -> c_int;
    listen: fn(c_int, c_int) -> c_int;
    accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
    read: fn(c_int, *mut c_void, size_t) -> ssize_t;
    write: fn(c_int, *const c_void, size_t) -> ssize_t;
    readv: fn(c_int, *const iovec, c_int) -> ssize_t;
    writev: fn(c_int, *const iovec, c_int) -> ssize_t;
    recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t;
    send: fn(c_int, *const c_void, size_t, c_int) -> ssize_t;
    recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t;
    sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t;
    recvmsg: fn(c_int, *mut msghdr, c_int) -> ssize_t;
    sendmsg: fn(c_int, *const msghdr, c_int) -> ssize_t;
    close: fn(c_int) -> c_int;
    shutdown: fn(c_int, c_int) -> c_int;
    dup: fn(c_int) -> c_int;
    dup2: fn(c_int, c_int) -> c_int;
    dup3: fn(c_int, c_int, c_int) -> c_int;
    fcntl: fn(c_int, c_int, c_ulong) -> c_int;
    fcntl64: fn(c_int, c_int, c_ulong) -> c_int;
    ioctl: fn(c_int, c_ulong, c_ulong) -> c_int;
    getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
    setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
    getpeername: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    getsockname: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int;
    epoll_wait: fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int;
    epoll_pwait: fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int;
    epoll_pwait2: fn(c_int, *mut libc::epoll_event, c_int, *const libc::timespec, *const libc::sigset_t) -> c_int;
    __read_chk: fn(c_int, *mut c_void, size_t, size_t) -> ssize_t;
    __recv_chk: fn(c_int, *mut c_void, size_t, size_t, c_int) -> ssize_t;
    __recvfrom_chk: fn(c_int, *mut c_void, size_t, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t;
    sendfile: fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t;
    poll: fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;
    __poll_chk: fn(*mut libc::pollfd, libc::nfds_t, c_int, size_t) -> c_int;
    ppoll: fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int;
    __ppoll_chk: fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t, size_t) -> c_int;
    select: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int;
    pselect: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int;
    sendfile64: fn(c_int, c_int, *mut libc::off64_t, size_t) -> ssize_t;
    fork: fn() -> libc::pid_t;
    setrlimit: fn(c_int, *const libc::rlimit) -> c_int;
    setrlimit64: fn(c_int, *const libc::rlimit64) -> c_int;
    prlimit: fn(libc::pid_t, c_int, *const libc::rlimit, *mut libc::rlimit) -> c_int;
    prlimit64: fn(libc::pid_t, c_int, *const libc::rlimit64, *mut libc::rlimit64) -> c_int;
    chroot: fn(*const libc::c_char) -> c_int;
    execve: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    execv: fn(*const libc::c_char, *const *const libc::c_char) -> c_int;
    execvp: fn(*const libc::c_char, *const *const libc::c_char) -> c_int;
    execvpe: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    fexecve: fn(c_int, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    execveat: fn(c_int, *const libc::c_char, *const *const libc::c_char, *const *const libc::c_char, c_int) -> c_int;
    posix_spawn: fn(*mut libc::pid_t, *const libc::c_char, *const libc::posix_spawn_file_actions_t, *const libc::posix_spawnattr_t, *const *mut libc::c_char, *const *mut libc::c_char) -> c_int;
    posix_spawnp: fn(*mut libc::pid_t, *const libc::c_char, *const libc::posix_spawn_file_actions_t, *const libc::posix_spawnattr_t, *const *mut libc::c_char, *const *mut libc::c_char) -> c_int;
}

/// libc's `prctl`, variadic as it is declared (`int prctl(int option, ...)`).
pub(crate) fn prctl() -> unsafe extern "C" fn(c_int, ...) -> c_int {
    static CACHE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let p = resolve(&CACHE, b"prctl\0");
    // SAFETY: libc's prctl has exactly this signature.
    unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int, ...) -> c_int>(p) }
}

/// libseccomp's `seccomp_load`, if a library after ours defines it (`None`: a program that
/// reached our export without libseccomp loaded, which cannot happen through the linker).
pub(crate) fn seccomp_load() -> Option<unsafe extern "C" fn(*mut c_void) -> c_int> {
    static CACHE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let mut p = CACHE.load(Ordering::Acquire);
    if p.is_null() {
        // SAFETY: a NUL-terminated name; dlsym has no other preconditions.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"seccomp_load".as_ptr()) };
        if p.is_null() {
            return None;
        }
        CACHE.store(p, Ordering::Release);
    }
    // SAFETY: libseccomp's seccomp_load has exactly this signature.
    Some(unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void) -> c_int>(p)
    })
}
