//! Held ACKs a thread will send itself (see `crate::cork`): the queue pairs on which it
//! received a message whose ACK waits for its answer
//! ([`QpCaps::ack_delay`](crate::QpCaps::ack_delay)).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::QpShared;

thread_local! {
    /// The thread calls into the cork: it is an application's (the engine thread and the
    /// pollers never do, and would keep what they noted for ever).
    static CALLS: Cell<bool> = const { Cell::new(false) };
    /// Queue pairs on which this thread received a message whose ACK is held.
    static HELD: RefCell<Vec<Arc<QpShared>>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread calls into the cork.
pub(crate) fn calls_in() {
    let _ = CALLS.try_with(|c| c.set(true));
}

/// The calling thread received a message on `qp` whose ACK is now held (the receive path,
/// under the QP's lock): [`send`] sends it, if this thread calls it before the hold is over.
pub(super) fn note(qp: &Arc<QpShared>) {
    if !CALLS.try_with(Cell::get).unwrap_or(false) {
        return;
    }
    let _ = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        if !h.iter().any(|q| Arc::ptr_eq(q, qp)) {
            h.push(qp.clone());
        }
    });
}

/// Ends the holds this thread noted and sends their ACKs. Cheap when there are none.
pub(crate) fn send() {
    // One at a time: no borrow is held while a QP is driven, and the list keeps its
    // capacity (a write and a read allocate nothing, smcr/tests/alloc.rs).
    while let Some(qp) = HELD.try_with(|h| h.borrow_mut().pop()).ok().flatten() {
        let Some(dev) = qp.dev.upgrade() else {
            continue;
        };
        let mut core = qp.core.lock();
        // (Answered meanwhile: the ACK went with the answer and nothing is held.)
        if core.rc.end_ack_hold() {
            dev.drive(&mut core, std::time::Instant::now());
        }
    }
}
