//! The bypass for our own calls (a leaf: the log and the hooks use it, it uses nothing of
//! ours).

use std::cell::Cell;

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
