//! Waiting for readiness: epoll_ctl and the epoll waits (`crate::epoll`), poll, ppoll and
//! their FORTIFY variants, select and pselect (`crate::poll`).

use libc::{c_int, size_t};

use crate::guard::{bypassed, guarded};
use crate::{real, table};

/// # Safety
/// libc's contract for epoll_ctl(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    if bypassed() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    }
    // An accepted connection a set of ours first holds starts negotiating (the socket
    // machinery's, above the epoll module).
    guarded(-1, || {
        crate::epoll::ctl(epfd, op, fd, ev, |a| {
            a.start(fd);
        })
    })
}

/// # Safety
/// libc's contract for epoll_wait(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_wait()(epfd, events, maxevents, timeout) };
    }
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, timeout, |e, max, t| {
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_wait()(epfd, e, max, t) }
        })
    })
}

/// # Safety
/// libc's contract for epoll_pwait(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait()(epfd, events, maxevents, timeout, sigmask) };
    }
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, timeout, |e, max, t| {
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_pwait()(epfd, e, max, t, sigmask) }
        })
    })
}

/// # Safety
/// libc's contract for epoll_pwait2(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait2()(epfd, events, maxevents, timeout, sigmask) };
    }
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, ms, |e, max, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_pwait2()(epfd, e, max, p, sigmask) }
        })
    })
}

/// Milliseconds for a poll from a timespec (`None`: wait forever), rounded up: a wait is never
/// cut shorter than asked.
fn timespec_ms(t: Option<&libc::timespec>) -> c_int {
    match t {
        None => -1,
        Some(t) => (t.tv_sec.max(0) as i128 * 1000
            + i128::from((t.tv_nsec.max(0) + 999_999) / 1_000_000))
        .clamp(0, i128::from(i32::MAX)) as i32,
    }
}

/// A timespec for `ms` (negative: none, wait forever).
fn ms_timespec(ms: c_int, ts: &mut libc::timespec) -> *const libc::timespec {
    if ms < 0 {
        return std::ptr::null();
    }
    *ts = libc::timespec {
        tv_sec: libc::time_t::from(ms / 1000),
        tv_nsec: libc::c_long::from(ms % 1000) * 1_000_000,
    };
    ts
}

/// The poll array of a poll call, if it may hold our connections and the call should go
/// through `crate::poll` (with the link groups behind them).
///
/// # Safety
/// `fds` points to `nfds` entries (the caller's contract).
unsafe fn poll_groups<'a>(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
) -> Option<(&'a mut [libc::pollfd], crate::poll::Ours)> {
    // What this thread corked goes before it may sleep (also `poll(NULL, 0, ms)`).
    smcr::cork::end();
    if bypassed() || fds.is_null() || nfds == 0 || nfds > table::MAX_FDS as libc::nfds_t {
        return None;
    }
    // SAFETY: per the caller's contract.
    let app = unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) };
    let ours = guarded(None, || crate::poll::ours(app.iter().map(|p| p.fd)))?;
    Some((app, ours))
}

/// # Safety
/// libc's contract for poll(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's contract.
    let Some((app, ours)) = (unsafe { poll_groups(fds, nfds) }) else {
        // SAFETY: forwarding.
        return unsafe { real::poll()(fds, nfds, timeout) };
    };
    guarded(-1, || {
        crate::poll::wait(app, &ours, timeout, |a, t| {
            // SAFETY: our array (the application's entries, then ours).
            unsafe { real::poll()(a.as_mut_ptr(), a.len() as libc::nfds_t, t) }
        })
    })
}

/// # Safety
/// libc's contract for the FORTIFY `__poll_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < nfds as usize {
        // SAFETY: forwarding: libc reports the overflow.
        return unsafe { real::__poll_chk()(fds, nfds, timeout, fdslen) };
    }
    // SAFETY: checked as libc would; the caller's contract otherwise.
    unsafe { poll(fds, nfds, timeout) }
}

/// # Safety
/// libc's contract for ppoll(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some((app, ours)) = (unsafe { poll_groups(fds, nfds) }) else {
        // SAFETY: forwarding.
        return unsafe { real::ppoll()(fds, nfds, timeout, sigmask) };
    };
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    guarded(-1, || {
        crate::poll::wait(app, &ours, ms, |a, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: our array, the remaining time, the caller's mask.
            unsafe { real::ppoll()(a.as_mut_ptr(), a.len() as libc::nfds_t, p, sigmask) }
        })
    })
}

/// # Safety
/// libc's contract for the FORTIFY `__ppoll_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < nfds as usize {
        // SAFETY: forwarding: libc reports the overflow.
        return unsafe { real::__ppoll_chk()(fds, nfds, timeout, sigmask, fdslen) };
    }
    // SAFETY: checked as libc would; the caller's contract otherwise.
    unsafe { ppoll(fds, nfds, timeout, sigmask) }
}

/// # Safety
/// libc's contract for select(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    // What this thread corked goes before it may sleep.
    smcr::cork::end();
    if bypassed() || nfds <= 0 {
        // SAFETY: forwarding.
        return unsafe { real::select()(nfds, readfds, writefds, exceptfds, timeout) };
    }
    // SAFETY: a non-null timeout points to a timeval (the caller's contract).
    let ms = match unsafe { timeout.as_ref() } {
        None => -1,
        Some(t) => (t.tv_sec.max(0) as i128 * 1000 + i128::from((t.tv_usec.max(0) + 999) / 1000))
            .clamp(0, i128::from(i32::MAX)) as i32,
    };
    let start = std::time::Instant::now();
    let r = guarded(Some(-1), || {
        crate::poll::select(nfds, [readfds, writefds, exceptfds], ms, |a, t| {
            // SAFETY: our array, the remaining time.
            unsafe { real::poll()(a.as_mut_ptr(), a.len() as libc::nfds_t, t) }
        })
    });
    let Some(r) = r else {
        // SAFETY: forwarding (none of ours in the sets).
        return unsafe { real::select()(nfds, readfds, writefds, exceptfds, timeout) };
    };
    // Linux's select leaves the time not slept in the timeout.
    // SAFETY: as above.
    if let Some(t) = unsafe { timeout.as_mut() }
        && ms >= 0
    {
        let left = std::time::Duration::from_millis(ms as u64).saturating_sub(start.elapsed());
        t.tv_sec = left.as_secs() as libc::time_t;
        t.tv_usec = libc::suseconds_t::from(left.subsec_micros() as i32);
    }
    r
}

/// # Safety
/// libc's contract for pselect(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // What this thread corked goes before it may sleep.
    smcr::cork::end();
    if bypassed() || nfds <= 0 {
        // SAFETY: forwarding.
        return unsafe { real::pselect()(nfds, readfds, writefds, exceptfds, timeout, sigmask) };
    }
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    let r = guarded(Some(-1), || {
        crate::poll::select(nfds, [readfds, writefds, exceptfds], ms, |a, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: our array, the remaining time, the caller's mask.
            unsafe { real::ppoll()(a.as_mut_ptr(), a.len() as libc::nfds_t, p, sigmask) }
        })
    });
    match r {
        Some(r) => r,
        // SAFETY: forwarding (none of ours in the sets).
        None => unsafe { real::pselect()(nfds, readfds, writefds, exceptfds, timeout, sigmask) },
    }
}
