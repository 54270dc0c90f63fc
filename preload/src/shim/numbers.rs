//! What the application's numbers of our sockets show: a number made plain again (`untrack`,
//! by policy or for an option SMC-R cannot honour), the kernel's view of a connection
//! (`show_kernel`: the socketpair at the number), the close-on-exec flag as the application
//! sees it, and O_NONBLOCK and the hidden TCP socket through our entries.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smcr::FallbackReason;

use super::pair::Pair;
use super::sock::{SmcFd, Sock};
use crate::guard::Bypass;
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

/// The kernel must answer for the socket at `fd` (an epoll set of the kernel's, a poll of the
/// kernel's): for an SMC-R connection, the number gets its kernel pair (made now if needed),
/// kept in step from then on. Other sockets of ours show their TCP socket, whose readiness the
/// kernel reports itself. Returns the socket's pair if the number shows one.
pub(crate) fn show_kernel(fd: i32) -> Option<Arc<Pair>> {
    let sock = table::get(fd)?;
    let Sock::Smc(c) = &*sock else {
        return None;
    };
    let pair = c.pair.clone();
    let _b = Bypass::new();
    match pair.kernel_end() {
        Ok(Some(app)) => {
            // Every number showing this connection gets the pair (dup'd numbers share it).
            for n in table::numbers_of(&sock) {
                if let Err(e) = replace(n, app.as_raw_fd(), &sock, || {}) {
                    log::line(format_args!("fd {n}: could not show readiness: {e}"));
                }
            }
            Some(pair)
        }
        Ok(None) => Some(pair),
        Err(e) => {
            log::line(format_args!(
                "fd {fd}: no socketpair for the kernel's view of the connection: {e}"
            ));
            None
        }
    }
}

/// Puts `file` at the application's number `fd`, moving the epoll registrations the
/// application made for `fd` to the new file; `then` (the table update) runs before the
/// application's next `epoll_ctl` on `fd` (`epoll::swap`). A pair (`ours`) is always
/// close-on-exec, the flag the application set being kept as its view.
fn replace(fd: i32, file: i32, sock: &Arc<Sock>, then: impl FnOnce()) -> io::Result<()> {
    let cloexec = app_cloexec(fd);
    table::set_cloexec_view(fd, cloexec);
    let still = || table::get_any(fd).is_some_and(|s| Arc::ptr_eq(&s, sock));
    crate::epoll::swap(fd, file, libc::O_CLOEXEC, still, then)
}

/// Whether the number's close-on-exec flag is the application's view only: an SMC-R
/// connection, or a connect being negotiated (its worker would not survive the exec), is
/// close-on-exec for real (an exec'd image could not serve it: it arrives closed rather than
/// silent), whatever the program sets; one that settles as TCP gets the flag of the view.
pub(crate) fn cloexec_managed(s: &Sock) -> bool {
    matches!(s, Sock::Smc(_) | Sock::Pending(_))
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

/// The close-on-exec flag as the application sees it.
pub(crate) fn app_cloexec(fd: i32) -> bool {
    if table::get_any(fd).is_some_and(|s| cloexec_managed(&s)) {
        return table::cloexec_view(fd);
    }
    // SAFETY: reading descriptor flags.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFD, 0) };
    fl >= 0 && fl & libc::FD_CLOEXEC != 0
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
