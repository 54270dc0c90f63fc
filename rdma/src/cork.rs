//! Corked transmission: an event loop's replies leave together.
//!
//! An event loop takes the ready connections from one `epoll_wait` and answers each with a
//! `write`. Over TCP each answer is a segment of its own socket. Our connections to one peer
//! share a link group, whose queue pair carries them all: while a thread is *corked*, what it
//! posts on an engine queue pair over UDP is not transmitted at the post but when the thread
//! uncorks ([`end`]), so the answers of one pass leave in a few bundles (one datagram, one
//! system call and one wake-up of the peer for several connections) instead of one each.
//!
//! The caller decides when a thread is corked: the preload corks a thread when its
//! `epoll_wait` returns events and uncorks it when it calls into us for anything but data on
//! our connections (the next `epoll_wait`, `poll`, a call on another descriptor, a wait for
//! data or room). A thread that does not come back (it blocks where we do not see it) is
//! covered by the engine: a deferred queue pair gets a timer [`CORK_MAX`] ahead, and the
//! engine transmits it then (up to `TIMER_GRACE` later while a thread keeps the timers).
//! Same-host links and verbs devices are never deferred.
//!
//! The same call points send the thread's *held ACKs*: a message this thread received whose
//! ACK waits for its answer ([`QpCaps::ack_delay`](crate::QpCaps::ack_delay)). A thread that
//! calls into us for anything else (a `connect`, its next wait) is not answering now; left to
//! the timers, the ACK would leave when the engine thread runs them, up to `TIMER_GRACE` late,
//! after the peer had probed and resent (a client reading each echo and then connecting
//! again: 505 of the echo server's 1 910 packets resent, every one a duplicate).

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::device::{EngineGuard, QpShared};

/// How long a deferred queue pair waits for its thread before the engine sends it, by default
/// (`DeviceConfig::cork_max`).
pub const CORK_MAX: Duration = crate::device::DEFAULT_CORK_MAX;

/// Corking is allowed in this process (smcr's `SMCR_CORK`).
static ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    static CORKED: Cell<bool> = const { Cell::new(false) };
    static DEFERRED: RefCell<Vec<(Arc<EngineGuard>, Arc<QpShared>)>> =
        const { RefCell::new(Vec::new()) };
}

/// Allows or forbids corking in this process (forbidden: [`begin`] does nothing).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether corking is allowed in this process.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Corks the calling thread: its posts on engine queue pairs over UDP wait for [`end`] (or
/// the engine's timer).
pub fn begin() {
    crate::device::held::calls_in();
    if enabled() {
        let _ = CORKED.try_with(|c| c.set(true));
    }
}

/// Whether the calling thread is corked (false while its thread-locals are being destroyed).
pub fn corked() -> bool {
    CORKED.try_with(Cell::get).unwrap_or(false)
}

/// Records that `qp` has requests to transmit when the thread uncorks. Returns whether it
/// was recorded now (the first time in this cork: the caller arms the engine's timer); false
/// also when the thread-locals are gone (the caller must transmit at once).
pub(crate) fn defer(g: &Arc<EngineGuard>, qp: &Arc<QpShared>) -> Option<bool> {
    DEFERRED
        .try_with(|d| {
            let mut d = d.borrow_mut();
            if d.iter().any(|(_, q)| Arc::ptr_eq(q, qp)) {
                false
            } else {
                d.push((g.clone(), qp.clone()));
                true
            }
        })
        .ok()
}

/// Uncorks the calling thread: what it deferred is transmitted now, and the ACKs it holds
/// leave. Cheap when there is neither.
pub fn end() {
    crate::device::held::calls_in();
    if corked() {
        let _ = CORKED.try_with(|c| c.set(false));
        // Taken out so that no borrow is held while a QP is driven, and put back emptied:
        // the list keeps its capacity (a corked pass allocates nothing, smcr/tests/alloc.rs).
        let mut list = DEFERRED
            .try_with(|d| std::mem::take(&mut *d.borrow_mut()))
            .unwrap_or_default();
        for (g, qp) in list.drain(..) {
            let mut core = qp.core.lock();
            g.shared.drive(&mut core, std::time::Instant::now());
        }
        let _ = DEFERRED.try_with(|d| {
            let mut d = d.borrow_mut();
            if d.is_empty() {
                *d = list;
            }
        });
    }
    crate::device::held::send();
}
