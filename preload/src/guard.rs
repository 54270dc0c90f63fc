//! What every export needs: a bypass for our own calls, errno, and panics turned into errors.

use std::cell::Cell;
use std::io;

thread_local! {
    /// Set while this thread runs our own code (a handshake on the application's socket):
    /// its libc calls then go straight to libc. Const-initialised, no destructor.
    static BYPASS: Cell<bool> = const { Cell::new(false) };
}

/// Whether hooks on this thread must pass calls straight to libc (also during thread exit,
/// when thread-locals are gone).
pub(crate) fn bypassed() -> bool {
    BYPASS.try_with(Cell::get).unwrap_or(true)
}

/// Turns the bypass on for a scope.
pub(crate) struct Bypass(bool);

impl Bypass {
    pub(crate) fn new() -> Self {
        Self(BYPASS.try_with(|b| b.replace(true)).unwrap_or(true))
    }
}

impl Drop for Bypass {
    fn drop(&mut self) {
        let prev = self.0;
        let _ = BYPASS.try_with(|b| b.set(prev));
    }
}

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
