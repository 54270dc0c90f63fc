//! What every export needs: a bypass for our own calls, errno, and panics turned into errors.

use std::io;

pub(crate) use crate::bypass::{Bypass, bypassed};

pub(crate) fn set_errno(e: i32) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

pub(crate) fn errno() -> i32 {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() }
}

/// The errno for an error of ours.
pub(crate) fn errno_of(e: &io::Error) -> i32 {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Interrupted => libc::EINTR,
        io::ErrorKind::InvalidData => libc::EPROTO,
        _ => libc::EIO,
    }
}

/// Runs a hook body; a panic becomes `errno = EIO` and `fail` (never a retried call, never an
/// unwind into C).
pub(crate) fn guarded<T>(fail: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            crate::log::line(format_args!("panic inside a hook; the call fails with EIO"));
            set_errno(libc::EIO);
            fail
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_eio_and_the_fallback_value() {
        set_errno(0);
        let r = guarded(-1, || -> i32 { panic!("inside a hook") });
        assert_eq!((r, errno()), (-1, libc::EIO));
        assert_eq!(guarded(0, || 7), 7);
    }
}
