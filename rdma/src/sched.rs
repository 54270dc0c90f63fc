//! Who takes a completion queue's completions, and who sleeps for them: smcr's scheduling,
//! apart from the verbs (which keep libibverbs' shape: [`CompletionQueue::poll`](crate::CompletionQueue::poll),
//! [`CompletionQueue::req_notify`](crate::CompletionQueue::req_notify), [`CompletionQueue::fd`](crate::CompletionQueue::fd), [`CompletionQueue::wait`](crate::CompletionQueue::wait)).
//!
//! A *drive* lets the thread that wants a completion (a writer waiting for a slot, a reader
//! waiting for data) take it and handle it itself instead of the engine thread handing it
//! over: one wake-up per completion, on the thread that needs it. While a CQ is driven its
//! completions signal only [`CqScheduler::driver_fd`]; a driver may also receive the device's
//! packets itself ([`CqScheduler::delegate_rx`], [`CqScheduler::receive`]), and spin briefly
//! on same-host rings and the socket before sleeping ([`CqScheduler::drive_spin`]). docs/architecture.md
//! ("Threads, locks and wake-ups") shows who sleeps where.

use crate::device::{CqShared, EngineGuard};
use rustix::fd::{AsFd, BorrowedFd};
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The scheduling side of a [`CompletionQueue`](crate::CompletionQueue) ([`CompletionQueue::scheduler`](crate::CompletionQueue::scheduler)(crate::CompletionQueue::scheduler)): cheap to
/// clone, shares the CQ.
#[derive(Clone)]
pub struct CqScheduler(pub(crate) SchedKind);

#[derive(Clone)]
pub(crate) enum SchedKind {
    Engine(EngineSched),
    Verbs(Arc<crate::ibv::VerbsCq>),
    Mem(Arc<crate::mem::MemCq>),
}

/// The engine's scheduling of one CQ.
#[derive(Clone)]
pub(crate) struct EngineSched {
    pub(crate) shared: Arc<CqShared>,
    pub(crate) guard: Arc<EngineGuard>,
}

/// Each public call, on the engine's CQ or a verbs device's.
macro_rules! dispatch {
    ($self:ident, $e:ident => $engine:expr, $v:ident => $verbs:expr, $m:ident => $mem:expr) => {
        match &$self.0 {
            SchedKind::Engine($e) => $engine,
            SchedKind::Verbs($v) => $verbs,
            SchedKind::Mem($m) => $mem,
        }
    };
}

impl CqScheduler {
    /// Makes [`CompletionQueue::fd`](crate::CompletionQueue::fd) readable without a completion: wakes a thread waiting on it (a
    /// poller in [`Self::wait_ready`], which then returns so that it looks again).
    pub fn kick(&self) {
        dispatch!(self, e => e.kick(), v => v.kick(), m => m.sig.kick())
    }

    /// Makes [`Self::driver_fd`] readable without a completion: a sleeping driver wakes and
    /// re-checks its condition.
    pub fn kick_driver(&self) {
        dispatch!(self, e => e.kick_driver(), v => v.kick_driver(), m => m.sig.kick_driver())
    }

    /// Starts a *drive*: the calling thread will take and handle this CQ's completions itself
    /// whenever it wakes ([`Self::drive_wait`], or its own poll on [`Self::driver_fd`] between
    /// [`Self::drive_sleep`] calls) until [`Self::end_drive`]. Meanwhile completions signal
    /// only the driver descriptor, so a thread sleeping on [`CompletionQueue::fd`](crate::CompletionQueue::fd) (a poller) is not
    /// woken for them: one wake-up per completion, the driver's. Drives nest and count.
    pub fn begin_drive(&self) {
        dispatch!(self, e => e.begin_drive(), v => v.begin_drive(), m => m.sig.begin_drive())
    }

    /// Ends a drive; after the last one, [`CompletionQueue::fd`](crate::CompletionQueue::fd) is signalled again (at once if a
    /// completion is waiting).
    pub fn end_drive(&self) {
        dispatch!(self, e => e.end_drive(), v => v.end_drive(), m => m.sig.end_drive(|| m.has_completions()))
    }

    /// The driver descriptor (an eventfd, readable after a completion arrived for a sleeping
    /// driver; drain it or register it edge-triggered).
    pub fn driver_fd(&self) -> BorrowedFd<'_> {
        dispatch!(self, e => e.driver_fd(), v => v.driver_fd(), m => m.sig.driver_fd())
    }

    /// Within a drive: says the caller is about to sleep on [`Self::driver_fd`] (`true`) or
    /// woke (`false`). Going to sleep, returns `true` if a completion is already there (then
    /// poll instead of sleeping; the sleep is not counted).
    pub fn drive_sleep(&self, on: bool) -> bool {
        dispatch!(self, e => e.drive_sleep(on), v => v.drive_sleep(on), m => m.sig.drive_sleep(on, || m.has_completions()))
    }

    /// Within a drive: sleeps until a completion is there to poll or `timeout` passes, without
    /// taking any; receives from the device's socket itself while it sleeps when no other thread
    /// does.
    pub fn drive_wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        dispatch!(self, e => e.drive_wait(timeout), v => v.drive_wait(timeout), m => m.sig.drive_wait(timeout, || m.has_completions()))
    }

    /// The device's UDP socket, for a driver that sleeps in its own wait (an epoll set) and
    /// wants arriving packets to wake it directly rather than through the engine thread and
    /// [`Self::driver_fd`]; `None` while every QP of this CQ uses shared memory, and on a
    /// verbs device (the device receives). Register it edge-triggered, call
    /// [`Self::delegate_rx`] while it is watched, and [`Self::receive`] when it fires.
    pub fn rx_fd(&self) -> Option<BorrowedFd<'_>> {
        dispatch!(self, e => e.rx_fd(), _v => None, _m => None)
    }

    /// `true`: a thread watches [`Self::rx_fd`] itself (and receives when it fires), so the
    /// engine thread stops watching the socket; `false` gives it back. Counted: every `true`
    /// needs its `false`. While away from the engine, packets wait for the watcher; packets
    /// for other CQs of the device too (they are handed to their CQs as usual).
    pub fn delegate_rx(&self, on: bool) {
        dispatch!(self, e => e.delegate_rx(on), _v => (), _m => ())
    }

    /// Receives and handles what waits on the device's socket (all of it, for every QP), on
    /// the calling thread, unless another thread is receiving; never blocks. Returns how
    /// many datagrams were handled (none on a verbs device).
    pub fn receive(&self) -> usize {
        dispatch!(self, e => e.receive(), _v => 0, _m => 0)
    }

    /// Within a drive, before sleeping: polls the same-host rings for a short, adaptive while
    /// (see [`crate::DeviceConfig::spin`]); true if a completion arrived meanwhile. With `rx`
    /// (the caller receives from the device's socket itself when it wakes) the spin also
    /// receives from the socket, unless another thread is receiving.
    pub fn drive_spin(&self, rx: bool) -> bool {
        // In memory: no spin, one look (what a spin's first poll would see).
        dispatch!(self, e => e.drive_spin(rx), _v => false, m => m.has_completions())
    }

    /// Within a drive: the sleep that followed a failed [`Self::drive_spin`] ended after
    /// `slept` because something arrived (it tunes the spinning).
    pub fn drive_woke_after(&self, slept: Duration) {
        dispatch!(self, e => e.drive_woke_after(slept), _v => (), _m => ())
    }

    /// Whether a thread is driving this CQ.
    pub fn driven(&self) -> bool {
        dispatch!(self, e => e.driven(), v => v.driven(), m => m.sig.driven())
    }

    /// Sleeps until a completion is there to poll (returns `true`) or `timeout` passes
    /// (`false`), without taking any: for a thread that must take them under a lock of its
    /// own. Receives for itself while it sleeps, as [`CompletionQueue::wait`](crate::CompletionQueue::wait) does. While the CQ is
    /// driven ([`Self::begin_drive`]) its completions are the driver's: this waits for the
    /// timeout, the end of the drive (if something is left then), or a write to [`CompletionQueue::fd`](crate::CompletionQueue::fd)
    /// (a kick: the caller's view of the drive may have changed), and returns `false`.
    pub fn wait_ready(&self, timeout: Option<Duration>) -> io::Result<bool> {
        dispatch!(self, e => e.wait_ready(timeout), v => v.wait_ready(timeout), m => m.wait_ready(timeout))
    }
}

impl EngineSched {
    /// Makes [`CompletionQueue::fd`](crate::CompletionQueue::fd) readable without a completion: wakes a thread waiting on it (a
    /// poller in [`Self::wait_ready`], which then returns so that it looks again).
    pub(crate) fn kick(&self) {
        self.shared.notify.kick();
        self.shared.signal(crate::notify::Wake::Event);
    }

    /// Makes [`Self::driver_fd`] readable without a completion: a sleeping driver wakes and
    /// re-checks its condition.
    pub(crate) fn kick_driver(&self) {
        self.shared.signal(crate::notify::Wake::Driver);
    }

    /// Starts a *drive*: the calling thread will take and handle this CQ's completions itself
    /// whenever it wakes ([`Self::drive_wait`], or its own poll on [`Self::driver_fd`] between
    /// [`Self::drive_sleep`] calls) until [`Self::end_drive`]. Meanwhile completions signal
    /// only the driver descriptor, so a thread sleeping on [`CompletionQueue::fd`](crate::CompletionQueue::fd) (a poller) is not
    /// woken for them: one wake-up per completion, the driver's. Drives nest and count.
    pub(crate) fn begin_drive(&self) {
        self.guard.shared.begin_drive(&self.shared);
    }

    /// Ends a drive; after the last one, [`CompletionQueue::fd`](crate::CompletionQueue::fd) is signalled again (at once if a
    /// completion is waiting).
    pub(crate) fn end_drive(&self) {
        self.guard.shared.end_drive(&self.shared);
    }

    /// The driver descriptor (an eventfd, readable after a completion arrived for a sleeping
    /// driver; drain it or register it edge-triggered).
    pub(crate) fn driver_fd(&self) -> BorrowedFd<'_> {
        self.shared.event_driver.as_fd()
    }

    /// Within a drive: says the caller is about to sleep on [`Self::driver_fd`] (`true`) or
    /// woke (`false`). Going to sleep, returns `true` if a completion is already there (then
    /// poll instead of sleeping; the sleep is not counted).
    pub(crate) fn drive_sleep(&self, on: bool) -> bool {
        self.guard.shared.drive_sleep(&self.shared, on)
    }

    /// Within a drive: sleeps until a completion is there to poll or `timeout` passes, without
    /// taking any; receives from the device's socket itself while it sleeps when no other thread
    /// does.
    pub(crate) fn drive_wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.guard.shared.drive_wait(&self.shared, timeout)
    }

    /// The device's UDP socket, for a driver that sleeps in its own wait (an epoll set) and
    /// wants arriving packets to wake it directly rather than through the engine thread and
    /// [`Self::driver_fd`]; `None` while every QP of this CQ uses shared memory. Register it
    /// edge-triggered, call [`Self::delegate_rx`] while it is watched, and
    /// [`Self::receive`] when it fires.
    pub(crate) fn rx_fd(&self) -> Option<BorrowedFd<'_>> {
        let shared = &self.guard.shared;
        (!shared.shm_only(&self.shared)).then(|| shared.sock.fd().as_fd())
    }

    /// `true`: a thread watches [`Self::rx_fd`] itself (and receives when it fires), so the
    /// engine thread stops watching the socket; `false` gives it back. Counted: every `true`
    /// needs its `false`. While away from the engine, packets wait for the watcher; packets
    /// for other CQs of the device too (they are handed to their CQs as usual).
    pub(crate) fn delegate_rx(&self, on: bool) {
        self.guard.shared.delegate_rx(on);
    }

    /// Receives and handles what waits on the device's socket (all of it, for every QP), on
    /// the calling thread, unless another thread is receiving; never blocks. Returns how
    /// many datagrams were handled.
    pub(crate) fn receive(&self) -> usize {
        self.guard.shared.receive_now()
    }

    /// Within a drive, before sleeping: polls the same-host rings for a short, adaptive while
    /// (see [`crate::DeviceConfig::spin`]); true if a completion arrived meanwhile. With `rx`
    /// (the caller receives from the device's socket itself when it wakes) the spin also
    /// receives from the socket, unless another thread is receiving.
    pub(crate) fn drive_spin(&self, rx: bool) -> bool {
        self.guard.shared.drive_spin_rx(&self.shared, rx)
    }

    /// Within a drive: the sleep that followed a failed [`Self::drive_spin`] ended after
    /// `slept` because something arrived (it tunes the spinning).
    pub(crate) fn drive_woke_after(&self, slept: Duration) {
        self.guard.shared.drive_woke_after(&self.shared, slept);
    }

    /// Whether a thread is driving this CQ.
    pub(crate) fn driven(&self) -> bool {
        self.shared.notify.driven()
    }

    /// Sleeps until a completion is there to poll (returns `true`) or `timeout` passes
    /// (`false`), without taking any: for a thread that must take them under a lock of its
    /// own. Receives for itself while it sleeps, as [`CompletionQueue::wait`](crate::CompletionQueue::wait) does. While the CQ is
    /// driven ([`Self::begin_drive`]) its completions are the driver's: this waits for the
    /// timeout, the end of the drive (if something is left then), or a write to [`CompletionQueue::fd`](crate::CompletionQueue::fd)
    /// (a kick: the caller's view of the drive may have changed), and returns `false`.
    pub(crate) fn wait_ready(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if !self.driven() {
                self.guard.shared.shm_poll(&self.shared);
                if !self.shared.queue.lock().is_empty() {
                    return Ok(true);
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(false);
            }
            let driven = self.driven();
            if self.shared.notify.take_kick() {
                return Ok(false);
            }
            self.guard.shared.wait_cq(&self.shared, left)?;
            // Driven before or now (a drive began while we slept, and the kick that woke us
            // says so), or kicked: the caller decides anew.
            if driven || self.driven() || self.shared.notify.take_kick() {
                return Ok(false);
            }
        }
    }
}
