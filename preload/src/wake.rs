//! Waking the threads that wait on our sockets through our hooks when a socket's readiness
//! rises (`Pair`, below the modules that wait): the poll and select calls answering for it,
//! through their thread's waker eventfd (made and kept here, watched by poll.rs), and the
//! threads in `epoll_wait` on sets holding a registration of it, through the sets' kick
//! eventfds (kept with the sets in epoll/vepoll.rs, which hands its kick in at load:
//! [`kick_with`]).

use std::cell::Cell;
use std::sync::OnceLock;

use crate::guard;

thread_local! {
    /// This thread's waker: an eventfd its poll and select calls watch, written when a socket
    /// they answer for becomes ready on another thread. Made on first use; closed with the
    /// thread.
    static WAKER: std::cell::OnceCell<Option<std::os::fd::OwnedFd>> =
        const { std::cell::OnceCell::new() };
}

/// This thread's waker (see [`WAKER`]), if one could be made.
pub(crate) fn waker() -> Option<i32> {
    WAKER
        .try_with(|w| {
            w.get_or_init(|| {
                let _b = guard::Bypass::new();
                // SAFETY: a new eventfd of ours.
                let k = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
                (k >= 0).then(|| crate::fds::hide_owned(k).ok()).flatten()
            })
            .as_ref()
            .map(std::os::fd::AsRawFd::as_raw_fd)
        })
        .ok()
        .flatten()
}

/// A socket became ready: wakes the poll and select calls answering for it (`wakers`), but
/// this thread's own (it looks again before it sleeps).
pub(crate) fn pollers(wakers: &[i32]) {
    let mine = if polling() { waker() } else { None };
    let one = 1u64.to_ne_bytes();
    for &w in wakers.iter().filter(|&&w| Some(w) != mine) {
        // SAFETY: 8 bytes into a waker eventfd of ours.
        unsafe { crate::real::write()(w, one.as_ptr().cast(), one.len()) };
    }
}

thread_local! {
    /// This thread is in a poll or select that answers for SMC-R sockets: what it makes ready
    /// itself needs no kick. Const-initialised, no destructor.
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is in such a poll or select.
pub(crate) fn polling() -> bool {
    POLLING.try_with(Cell::get).unwrap_or(false)
}

/// Marks this thread as in a poll that answers for SMC-R sockets while it lives.
pub(crate) struct Polling(bool);

impl Polling {
    pub(crate) fn new() -> Self {
        Self(POLLING.try_with(|p| p.replace(true)).unwrap_or(false))
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        let _ = POLLING.try_with(|p| p.set(self.0));
    }
}

/// How the threads in `epoll_wait` on a set holding registrations of ours are woken
/// (`vepoll::kick`): set at load, before the program has threads (`vepoll::init`, from
/// `shim::init_settings`), so that a fork never finds it being set.
static KICK: OnceLock<fn(&[i32])> = OnceLock::new();

/// Sets how [`epoll_sets`] wakes the sets' waiters (once, at load).
pub(crate) fn kick_with(kick: fn(&[i32])) {
    let _ = KICK.set(kick);
}

/// A registered socket became ready (a bit rose) on this thread: wakes the threads in
/// `epoll_wait` on `sets` (see `vepoll::kick`).
pub(crate) fn epoll_sets(sets: &[i32]) {
    if let Some(kick) = KICK.get() {
        kick(sets);
    }
}
