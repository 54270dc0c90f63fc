//! The two descriptors through which a completion queue wakes its threads, and the
//! scheduling of its completions among them (the contract is [`crate::CqScheduler`]'s), for
//! CQs whose completions another party queues: a verbs device's pump
//! ([`crate::ibv`]), the in-memory fabric's posters ([`crate::mem`]). The engine's CQs keep
//! their own (`device::cq`): there, the waiting thread also receives from the socket.
//!
//! The queue stays the CQ's; each call that must know whether completions wait is given
//! `has`, which looks (and may pull them from the device first).

use rustix::event::EventfdFlags;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub(crate) struct Signals {
    /// Readable after a completion (or a kick) while no thread drives the CQ.
    event: OwnedFd,
    /// Readable after a completion (or a driver kick) while a thread drives it.
    event_driver: OwnedFd,
    drives: AtomicU32,
    kicked: AtomicBool,
}

fn ring(fd: &OwnedFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn drain(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// Sleeps until `fd` is readable or `timeout` passes.
fn sleep_on(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<()> {
    let mut p = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = timeout.map(crate::device::timespec);
    match rustix::event::poll(&mut p, ts.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

impl Signals {
    pub(crate) fn new() -> io::Result<Self> {
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        Ok(Self {
            event: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            event_driver: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            drives: AtomicU32::new(0),
            kicked: AtomicBool::new(false),
        })
    }

    /// A completion came: wakes the driver if a thread drives the CQ, else the CQ's waiters.
    pub(crate) fn signal(&self) {
        if self.driven() {
            ring(&self.event_driver);
        } else {
            ring(&self.event);
        }
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// The notification is always armed; a completion already there is rung at once so that
    /// a caller about to sleep on [`Self::fd`] does not miss it.
    pub(crate) fn req_notify(&self, has: impl FnOnce() -> bool) {
        if !self.driven() && has() {
            ring(&self.event);
        }
    }

    pub(crate) fn ack_events(&self) {
        drain(&self.event);
    }

    /// [`crate::CompletionQueue::wait`]'s sleep: until a completion or a kick, or `left`.
    pub(crate) fn sleep(&self, left: Option<Duration>) -> io::Result<()> {
        sleep_on(self.event.as_fd(), left)?;
        drain(&self.event);
        Ok(())
    }

    pub(crate) fn kick(&self) {
        self.kicked.store(true, Ordering::SeqCst);
        ring(&self.event);
    }

    pub(crate) fn kick_driver(&self) {
        ring(&self.event_driver);
    }

    pub(crate) fn begin_drive(&self) {
        self.drives.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn end_drive(&self, has: impl FnOnce() -> bool) {
        if self.drives.fetch_sub(1, Ordering::SeqCst) == 1 && has() {
            ring(&self.event);
        }
    }

    pub(crate) fn driver_fd(&self) -> BorrowedFd<'_> {
        self.event_driver.as_fd()
    }

    pub(crate) fn drive_sleep(&self, on: bool, has: impl FnOnce() -> bool) -> bool {
        if on {
            return has();
        }
        drain(&self.event_driver);
        false
    }

    pub(crate) fn drive_wait(
        &self,
        timeout: Option<Duration>,
        has: impl FnOnce() -> bool,
    ) -> io::Result<()> {
        drain(&self.event_driver);
        if has() {
            return Ok(());
        }
        sleep_on(self.event_driver.as_fd(), timeout)?;
        drain(&self.event_driver);
        Ok(())
    }

    pub(crate) fn driven(&self) -> bool {
        self.drives.load(Ordering::SeqCst) > 0
    }

    pub(crate) fn wait_ready(
        &self,
        timeout: Option<Duration>,
        has: impl Fn() -> bool,
    ) -> io::Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if !self.driven() && has() {
                return Ok(true);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(false);
            }
            let driven = self.driven();
            if self.kicked.swap(false, Ordering::SeqCst) {
                return Ok(false);
            }
            sleep_on(self.event.as_fd(), left)?;
            drain(&self.event);
            if driven || self.driven() || self.kicked.swap(false, Ordering::SeqCst) {
                return Ok(false);
            }
        }
    }
}
