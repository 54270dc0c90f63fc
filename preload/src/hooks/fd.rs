//! Calls on the descriptor itself: close, shutdown, fcntl/fcntl64, ioctl, and dup/dup2/dup3
//! (a number's entry follows its duplicates; close-on-exec kept as the application's view).

use libc::{c_int, c_ulong};

use super::{Op, Target, as_smc, smc, target};
use crate::guard::{bypassed, errno_of, guarded, set_errno};
use crate::shim;
use crate::sock::{Sock, cloexec_managed};
use crate::{real, table};

/// # Safety
/// libc's contract for close(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !bypassed() {
        crate::epoll::closed_epfd(fd);
        guarded((), || forget_number(fd));
    }
    // SAFETY: forwarding.
    unsafe { real::close()(fd) }
}

/// The application's number `fd` is about to close (or be replaced by dup2/dup3): our entry
/// goes (dropping the last one sends SMC-R's close and releases our duplicate of the TCP
/// socket). A connection being settled takes the number out under its own lock, so nothing
/// is installed at a number closed meanwhile.
fn forget_number(fd: c_int) {
    let Some(s) = table::get_any(fd) else {
        return;
    };
    let mut gone = None;
    let mut last = false;
    let mut remove = || {
        gone = table::remove(fd);
        last = !table::shows(&s);
    };
    match &*s {
        Sock::Pending(p) | Sock::Accepted(p) => p.closing(remove),
        _ => remove(),
    }
    // Epoll drops a registration only when its file goes, and the file outlives this number
    // (our duplicate): take the application's registrations off by hand when no other number
    // shows this socket, or the old connection's events would arrive under a reused number.
    crate::epoll::closed(fd, last && s.pair().is_some());
    if last
        && let Some(g) = &gone
        && let Sock::Listener(l) = &**g
    {
        l.close();
    }
    drop(gone);
}

/// # Safety
/// libc's contract for shutdown(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let shut = match how {
        libc::SHUT_RD => Some(std::net::Shutdown::Read),
        libc::SHUT_WR => Some(std::net::Shutdown::Write),
        libc::SHUT_RDWR => Some(std::net::Shutdown::Both),
        _ => None,
    };
    // A connection not settled yet records it (done once settled, after what was staged):
    // TCP's shutdown does not wait either.
    if !bypassed()
        && let Some(how) = shut
        && let Some(s) = table::get(fd)
        && let Sock::Accepted(a) | Sock::Pending(a) = &*s
    {
        let recorded = guarded(false, || {
            a.start(fd);
            a.shutdown(how)
        });
        if recorded {
            return 0;
        }
    }
    match target(fd, Op::Wait) {
        Target::Smc(s) => guarded(-1, || {
            let how = match how {
                libc::SHUT_RD => std::net::Shutdown::Read,
                libc::SHUT_WR => std::net::Shutdown::Write,
                libc::SHUT_RDWR => std::net::Shutdown::Both,
                _ => {
                    set_errno(libc::EINVAL);
                    return -1;
                }
            };
            // (What was staged before the connection settled goes before the end of writing.)
            match as_smc(&s).and_then(|c| c.shutdown(how)) {
                Ok(()) => 0,
                Err(e) => {
                    set_errno(errno_of(&e));
                    -1
                }
            }
        }),
        // A listener (threads waiting in accept wake with EINVAL) or plain TCP.
        // SAFETY: forwarding.
        Target::Real | Target::Err(_) | Target::Stage(_) | Target::Eof => unsafe {
            real::shutdown()(fd, how)
        },
    }
}

fn fcntl_common(
    fd: c_int,
    cmd: c_int,
    arg: c_ulong,
    f: unsafe extern "C" fn(c_int, c_int, c_ulong) -> c_int,
) -> c_int {
    let s = if bypassed() { None } else { table::get(fd) };
    if let Some(s) = &s
        && cmd == libc::F_SETFL
    {
        shim::set_nonblock(s, arg as c_int & libc::O_NONBLOCK != 0);
    }
    // Decided on the file, even in a forked child (where the connection is the parent's):
    // what it execs must not inherit a pair nothing serves.
    let pair = !bypassed() && table::get_any(fd).is_some_and(|s| cloexec_managed(&s));
    if pair {
        // Our pair stays close-on-exec; the application sees (and sets) its own flag.
        match cmd {
            libc::F_GETFD => {
                // SAFETY: forwarding.
                let r = unsafe { f(fd, cmd, arg) };
                if r < 0 {
                    return r;
                }
                let view = if table::cloexec_view(fd) {
                    libc::FD_CLOEXEC
                } else {
                    0
                };
                return (r & !libc::FD_CLOEXEC) | view;
            }
            libc::F_SETFD => {
                // SAFETY: forwarding, with close-on-exec kept.
                let r = unsafe { f(fd, cmd, arg | libc::FD_CLOEXEC as c_ulong) };
                if r == 0 {
                    table::set_cloexec_view(fd, arg as c_int & libc::FD_CLOEXEC != 0);
                }
                return r;
            }
            _ => {}
        }
    }
    let dupfd = cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC;
    let real_cmd = if pair && dupfd {
        libc::F_DUPFD_CLOEXEC
    } else {
        cmd
    };
    // SAFETY: forwarding (on the pair at `fd`, which takes O_NONBLOCK too).
    let r = unsafe { f(fd, real_cmd, arg) };
    if r >= 0
        && dupfd
        && let Some(s) = s
    {
        if pair {
            table::set_cloexec_view(r, cmd == libc::F_DUPFD_CLOEXEC);
        }
        crate::epoll::forget(r);
        table::insert(r, s);
    }
    r
}

/// # Safety
/// libc's contract for fcntl(2); the third argument is read as a pointer-sized integer, which
/// is how x86-64 and aarch64 Linux pass a variadic int or pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg, real::fcntl())
}

/// # Safety
/// As [`fcntl`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg, real::fcntl64())
}

/// # Safety
/// libc's contract for ioctl(2), with the same variadic assumption as [`fcntl`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    if (req == libc::FIOCLEX || req == libc::FIONCLEX)
        && !bypassed()
        && table::get_any(fd).is_some_and(|s| cloexec_managed(&s))
    {
        // As F_SETFD: the pair stays close-on-exec, the application's flag is its view.
        // SAFETY: checking that the descriptor is open.
        if unsafe { real::fcntl()(fd, libc::F_GETFD, 0) } < 0 {
            return -1;
        }
        table::set_cloexec_view(fd, req == libc::FIOCLEX);
        return 0;
    }
    if req == libc::FIONBIO
        && !bypassed()
        && let Some(s) = table::get(fd)
    {
        // SAFETY: FIONBIO's argument points to an int.
        shim::set_nonblock(&s, unsafe { *(arg as *const c_int) } != 0);
    }
    if req == libc::FIONREAD
        && !bypassed()
        && table::get(fd).is_some_and(|s| matches!(*s, Sock::Accepted(_) | Sock::Pending(_)))
    {
        // Not settled: what waits on the TCP socket is the CLC handshake's, not data.
        // SAFETY: FIONREAD's argument points to an int.
        unsafe { *(arg as *mut c_int) = 0 };
        return 0;
    }
    if req == libc::FIONREAD
        && let Some(s) = smc(fd)
        && let Ok(c) = as_smc(&s)
    {
        let n = c.stream.readable_bytes().min(c_int::MAX as usize) as c_int;
        // SAFETY: FIONREAD's argument points to an int.
        unsafe { *(arg as *mut c_int) = n };
        return 0;
    }
    // SAFETY: forwarding.
    unsafe { real::ioctl()(fd, req, arg) }
}

/// A duplicate of a number showing our pair: close-on-exec for real, as asked in the view.
fn dup_pair(new: c_int, cloexec: bool) {
    // SAFETY: setting a flag on the descriptor just made.
    unsafe { real::fcntl()(new, libc::F_SETFD, libc::FD_CLOEXEC as c_ulong) };
    table::set_cloexec_view(new, cloexec);
}

/// # Safety
/// libc's contract for dup(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::dup()(fd) };
    if r >= 0 && !bypassed() {
        if table::get_any(fd).is_some_and(|s| cloexec_managed(&s)) {
            dup_pair(r, false);
        }
        if let Some(s) = table::get(fd) {
            crate::epoll::forget(r);
            table::insert(r, s);
        }
    }
    r
}

/// dup2/dup3 (`real`) of `old` onto `new`. `new` is closed implicitly: when it shows a
/// connection being settled, the replacement and the forgetting happen under that
/// connection's settling lock, as a close's do, so nothing is installed at `new` afterwards.
fn dup_to(old: c_int, new: c_int, cloexec: bool, real: impl FnOnce() -> c_int) -> c_int {
    if bypassed() || old == new {
        return real();
    }
    let prior = table::get_any(new);
    let mut r = -1;
    let mut gone = None;
    let swap = || {
        r = real();
        if r >= 0 {
            gone = shim::untrack(new);
        }
    };
    match prior.as_deref() {
        Some(Sock::Pending(p) | Sock::Accepted(p)) => p.closing(swap),
        _ => swap(),
    }
    guarded((), || drop(gone));
    dup_onto(old, new, r, cloexec)
}

fn dup_onto(old: c_int, new: c_int, r: c_int, cloexec: bool) -> c_int {
    if r >= 0 && !bypassed() && old != new {
        // `new` is now what `old` is.
        if table::get_any(old).is_some_and(|s| cloexec_managed(&s)) {
            dup_pair(new, cloexec);
        }
        if let Some(s) = table::get(old) {
            table::insert(new, s);
        }
    }
    r
}

/// # Safety
/// libc's contract for dup2(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwarding.
    dup_to(old, new, false, || unsafe { real::dup2()(old, new) })
}

/// # Safety
/// libc's contract for dup3(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarding.
    dup_to(old, new, flags & libc::O_CLOEXEC != 0, || unsafe {
        real::dup3()(old, new, flags)
    })
}
