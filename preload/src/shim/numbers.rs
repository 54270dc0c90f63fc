//! What the application's numbers of our sockets show: a number made plain again (`untrack`,
//! by policy or for an option SMC-R cannot honour), the real close-on-exec flag of a number
//! whose flag the application sees through our view, and O_NONBLOCK and the hidden TCP socket
//! through our entries. (The kernel's view of a connection, the socketpair at the number, is
//! `epoll::show_kernel`'s: the registrations move with it.)

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smcr::FallbackReason;

use crate::sock::{SmcFd, Sock};
use crate::{log, real, table};

/// The application set an option SMC-R cannot honour before connecting: plain TCP, as Linux's
/// SMC falls back with OPTUNSUPP.
pub(crate) fn unsupported_option(fd: i32, what: &str) {
    untrack(fd);
    log::line(format_args!(
        "fd {fd}: TCP: {what} is not supported with SMC-R (OPTUNSUPP {:#010x})",
        smcr::DeclineReason::OPTUNSUPP.0
    ));
}

/// `fd` stays plain TCP by policy: forget it and say so.
pub(crate) fn exclude(fd: i32, what: &str, a: std::net::SocketAddrV4) {
    untrack(fd);
    log::line(format_args!(
        "fd {fd} {what} {a}: TCP: excluded by SMCR_INCLUDE/SMCR_EXCLUDE [{:#010x}]",
        FallbackReason::CODE_EXCLUDED
    ));
}

/// Sets the real close-on-exec flag of `n`.
pub(super) fn set_cloexec(n: i32, on: bool) {
    // SAFETY: reading and setting descriptor flags of the application's number.
    let fl = unsafe { real::fcntl()(n, libc::F_GETFD, 0) };
    if fl < 0 {
        return;
    }
    let fl = if on {
        fl | libc::FD_CLOEXEC
    } else {
        fl & !libc::FD_CLOEXEC
    };
    // SAFETY: as above.
    unsafe { real::fcntl()(n, libc::F_SETFD, fl as libc::c_ulong) };
}

/// The application's close-on-exec flag of `n` becomes its view; the number is close-on-exec
/// for real from now on.
pub(super) fn manage_cloexec(n: i32) {
    // SAFETY: reading and setting descriptor flags of the application's number.
    let fl = unsafe { real::fcntl()(n, libc::F_GETFD, 0) };
    if fl < 0 {
        return;
    }
    table::set_cloexec_view(n, fl & libc::FD_CLOEXEC != 0);
    // SAFETY: as above.
    unsafe { real::fcntl()(n, libc::F_SETFD, (fl | libc::FD_CLOEXEC) as libc::c_ulong) };
}

/// `fd` is plain from now on (or gone): not ours, no registrations kept.
pub(crate) fn untrack(fd: i32) -> Option<Arc<Sock>> {
    let s = table::remove(fd);
    crate::epoll::forget(fd);
    s
}

/// The application set (or cleared) O_NONBLOCK on a number of ours.
pub(crate) fn set_nonblock(s: &Sock, on: bool) {
    match s {
        Sock::Smc(c) => c.nonblock.store(on, Ordering::Relaxed),
        Sock::Accepted(a) | Sock::Pending(a) => a.nonblock.store(on, Ordering::Relaxed),
        _ => {}
    }
}

/// The hidden TCP socket's descriptor of an SMC-R fd (for addresses and socket options).
pub(crate) fn tcp_fd(s: &SmcFd) -> i32 {
    s.stream.tcp().as_raw_fd()
}
