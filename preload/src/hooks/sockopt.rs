//! Socket names and options (getpeername, getsockname, getsockopt, setsockopt): answered by
//! the TCP socket, with what SMC-R changes (SO_ERROR after a reset, the timeouts, options
//! it cannot honour).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use libc::{c_int, sockaddr, socklen_t};

use super::{as_smc, smc};
use crate::guard::{bypassed, guarded, set_errno};
use crate::shim;
use crate::sock::Sock;
use crate::{real, table};

/// The descriptor socket calls about `fd` should reach: the hidden TCP socket of an SMC-R fd
/// (or of a connection being settled) whose number shows the kernel pair; with what keeps
/// that descriptor open for the call.
fn socket_fd(fd: c_int) -> (c_int, Option<Arc<OwnedFd>>) {
    if bypassed() {
        return (fd, None);
    }
    match table::get(fd).as_deref() {
        // The number shows the kernel pair: the socket is our duplicate.
        Some(Sock::Smc(c)) if c.pair.has_kernel() => (shim::tcp_fd(c), None),
        Some(Sock::Accepted(a) | Sock::Pending(a)) => match a.shown_socket() {
            Some(d) => (d.as_raw_fd(), Some(d)),
            None => (fd, None),
        },
        // The number is the socket itself.
        _ => (fd, None),
    }
}

/// # Safety
/// libc's contract for getpeername(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, a: *mut sockaddr, l: *mut socklen_t) -> c_int {
    let (sock, _open) = socket_fd(fd);
    // SAFETY: forwarding.
    unsafe { real::getpeername()(sock, a, l) }
}

/// # Safety
/// libc's contract for getsockname(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, a: *mut sockaddr, l: *mut socklen_t) -> c_int {
    let (sock, _open) = socket_fd(fd);
    // SAFETY: forwarding.
    unsafe { real::getsockname()(sock, a, l) }
}

/// # Safety
/// libc's contract for getsockopt(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET
        && name == libc::SO_ERROR
        && !val.is_null()
        && !len.is_null()
        // SAFETY: the caller passes a valid length.
        && unsafe { *len } as usize >= std::mem::size_of::<c_int>()
        && let Some(s) = smc(fd)
        && let Sock::Smc(c) = &*s
        && c.stream.take_reset()
    {
        c.pair.take_error();
        // A reset not yet collected by a read or write: reported (and cleared) as TCP does.
        // SAFETY: room for an int, checked above.
        unsafe {
            *val.cast::<c_int>() = libc::ECONNRESET;
            *len = std::mem::size_of::<c_int>() as socklen_t;
        }
        return 0;
    }
    let (sock, _open) = socket_fd(fd);
    // SAFETY: forwarding.
    unsafe { real::getsockopt()(sock, level, name, val, len) }
}

/// # Safety
/// libc's contract for setsockopt(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level == libc::IPPROTO_TCP
        && !bypassed()
        && let Some(s) = table::get(fd)
    {
        match (name, &*s) {
            // SMC-R cannot honour these: as Linux's SMC, a socket not yet connecting falls
            // back to TCP (OPTUNSUPP), anything later refuses the option.
            (
                libc::TCP_FASTOPEN
                | libc::TCP_FASTOPEN_CONNECT
                | libc::TCP_FASTOPEN_KEY
                | libc::TCP_FASTOPEN_NO_COOKIE,
                Sock::Inet,
            ) => guarded((), || shim::unsupported_option(fd, "TCP_FASTOPEN")),
            (
                libc::TCP_FASTOPEN
                | libc::TCP_FASTOPEN_CONNECT
                | libc::TCP_FASTOPEN_KEY
                | libc::TCP_FASTOPEN_NO_COOKIE,
                _,
            ) => {
                set_errno(libc::EINVAL);
                return -1;
            }
            // A ULP (kernel TLS) would sit on the TCP socket, which carries no data.
            (libc::TCP_ULP, Sock::Smc(_) | Sock::Listener(_) | Sock::Pending(_)) => {
                set_errno(libc::EOPNOTSUPP);
                return -1;
            }
            _ => {}
        }
    }
    if let Some(s) = smc(fd)
        && let Ok(c) = as_smc(&s)
        && level == libc::SOL_SOCKET
        && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO)
        && len as usize >= std::mem::size_of::<libc::timeval>()
    {
        // SAFETY: the caller passes a timeval of at least `len` bytes.
        let tv = unsafe { &*val.cast::<libc::timeval>() };
        let us = (tv.tv_sec.max(0) as u64) * 1_000_000 + tv.tv_usec.max(0) as u64;
        let slot = if name == libc::SO_RCVTIMEO {
            &c.rcvtimeo_us
        } else {
            &c.sndtimeo_us
        };
        slot.store(us, Ordering::Relaxed);
    }
    let (sock, _open) = socket_fd(fd);
    // SAFETY: forwarding (the TCP socket keeps the option too).
    unsafe { real::setsockopt()(sock, level, name, val, len) }
}
