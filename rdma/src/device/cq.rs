//! The completion-queue side: a CQ's state shared by its handle and the engine, and the
//! threads that wait for completions — pollers and `ibv_req_notify_cq` users
//! ([`Shared::wait_cq`]) and *drivers*, application threads that handle completions themselves
//! while they wait ([`Shared::drive_wait`]). A waiter receives from the socket itself when no
//! one else does.

use super::rx::RxState;
use super::spin::{SpinState, Spun, YIELD_LOST};
use super::{Shared, drain_eventfd, timespec, wait_readable};
use crate::locks::Mutex;
use crate::notify::{Notify, Sleepers, Wake};
use crate::rc::WorkCompletion;
use rustix::event::EventfdFlags;
use rustix::fd::OwnedFd;
use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Completion queue state shared by the application handle and the engine.
///
/// Two kinds of sleepers wait for completions, each on its own descriptor so that a
/// completion wakes one of them, not both: *drivers* (application threads that handle
/// completions themselves while they wait, [`crate::CqScheduler::begin_drive`]) on
/// `event_driver`, and everyone else (a poller thread, `ibv_req_notify_cq` users) on `event`.
/// While a driver is at work the others are not signalled: the driver covers the queue.
/// Who to signal when is decided in [`Notify`] (the model-checked handshakes).
pub(crate) struct CqShared {
    pub(crate) queue: Mutex<VecDeque<WorkCompletion>>,
    pub(crate) event: OwnedFd,
    pub(crate) event_driver: OwnedFd,
    /// Armed descriptors, drives, sleepers, kicks.
    pub(crate) notify: Notify,
    /// When the last drive ended (device nanoseconds; 0: never).
    pub(crate) drive_ended: AtomicU64,
    /// The drivers' adaptive spin.
    pub(crate) spin: SpinState,
    /// QPs receiving into this CQ through a same-host ring: whoever polls or waits on the CQ
    /// turns their ring entries into completions.
    pub(crate) shm_qps: Mutex<Vec<std::sync::Weak<super::QpShared>>>,
    /// How many of those QPs have offered their ring to a peer on this host (only such a ring
    /// can fill): at 0 the same-host polling is skipped — the QPs of a UDP link pay nothing
    /// for it (it was ~4 % of a cross-host ping-pong's CPU).
    pub(crate) shm_live: Arc<AtomicUsize>,
}

impl CqShared {
    pub(crate) fn new() -> io::Result<Self> {
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            event: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            event_driver: crate::fdzone::place(rustix::event::eventfd(0, flags)?)?,
            notify: Notify::new(),
            drive_ended: AtomicU64::new(0),
            spin: SpinState::default(),
            shm_qps: Mutex::new(Vec::new()),
            shm_live: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Whether a ring of this CQ's QPs can fill (see `shm_live`).
    #[inline]
    pub(crate) fn has_live_rings(&self) -> bool {
        self.shm_live.load(Ordering::SeqCst) > 0
    }

    pub(crate) fn push(&self, wc: WorkCompletion) {
        self.queue.lock().push_back(wc);
        if let Some(w) = self.notify.after_push() {
            self.signal(w);
        }
    }

    /// Writes the descriptor `w` names.
    pub(crate) fn signal(&self, w: Wake) {
        let fd = match w {
            Wake::Event => &self.event,
            Wake::Driver => &self.event_driver,
        };
        let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
    }
}

impl Shared {
    /// Blocks the calling thread until `cq` has a completion or `timeout` passes. If no other
    /// thread is receiving, the caller receives and handles packets itself, so the packet that
    /// completes its request costs one wake-up (its own), not two (engine, then caller).
    ///
    /// While drivers work on the CQ (or did within [`RECENTLY_DRIVEN`]) this sleeper leaves the
    /// socket to them and is not signalled (they cover the queue); it wakes for its timeout.
    pub(crate) fn wait_cq(&self, cq: &CqShared, timeout: Option<Duration>) -> io::Result<()> {
        let driven = cq.notify.driven();
        let recent = !driven && self.recently_driven(cq);
        let timeout = if recent {
            Some(timeout.map_or(RECENTLY_DRIVEN, |t| t.min(RECENTLY_DRIVEN)))
        } else {
            timeout
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        // A CQ fed by shared memory only has nothing to receive from the socket: taking it
        // would only cost the engine's interest twice (two epoll_ctl) per wake-up.
        // Nor while an event loop watches the socket (it hands our completions over): a
        // poller taking it too would be woken for the loop's packets.
        let rx = if driven
            || recent
            || self.receive.delegated.load(Ordering::SeqCst) > 0
            || self.shm_only(cq)
        {
            None
        } else {
            self.rx_try()
        };
        let Some(mut rx) = rx else {
            // Driven: what is there is the driver's; we are signalled if it is left behind.
            let sleep = cq.notify.event_sleep(
                || self.shm_sleepers(cq, |s| s.event += 1),
                || cq.queue.lock().is_empty(),
            );
            let slept = if sleep {
                wait_readable(&cq.event, timeout)
            } else {
                Ok(false)
            };
            self.shm_sleepers(cq, Sleepers::event_woke);
            if slept? {
                drain_eventfd(&cq.event);
            }
            self.shm_poll(cq);
            return Ok(());
        };
        let keep = self.may_keep_timers(cq);
        self.rx_take(keep);
        let res = loop {
            // Holding the socket, this thread keeps the timers (see `timer_keeper`).
            self.run_due_timers(Instant::now());
            // Armed only while asleep: completions this thread produces itself need no signal.
            // The order of `Notify::event_sleep`: arm, register, look.
            cq.notify.arm();
            // Same-host producers ring the CQ's eventfd only when told we sleep.
            if self.shm_sleepers(cq, |s| s.event += 1) {
                self.shm_sleepers(cq, Sleepers::event_woke);
                self.shm_poll(cq);
                if cq.queue.lock().is_empty() {
                    // Part of a message arrived: set the flag again before sleeping.
                    continue;
                }
                break Ok(());
            }
            if !cq.queue.lock().is_empty() {
                self.shm_sleepers(cq, Sleepers::event_woke);
                break Ok(());
            }
            // Sleep first: poll returns at once if a packet is already waiting, which saves
            // a receive call that would find nothing.
            let now = Instant::now();
            let left = deadline.map(|d| d.saturating_duration_since(now));
            let mut fds = [
                rustix::event::PollFd::new(self.sock.fd(), rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&cq.event, rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&self.receive.rx_yield, rustix::event::PollFlags::IN),
            ];
            let ts = if keep {
                self.until_next_timer(now, left)
            } else {
                left
            }
            .map(timespec);
            let ready = match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => 0,
                Err(e) => {
                    self.shm_sleepers(cq, Sleepers::event_woke);
                    break Err(e.into());
                }
            };
            cq.notify.disarm();
            self.shm_sleepers(cq, Sleepers::event_woke);
            if fds[1].revents().contains(rustix::event::PollFlags::IN) {
                drain_eventfd(&cq.event);
            }
            if fds[0].revents().contains(rustix::event::PollFlags::IN) {
                self.rx_drain(&mut rx, 64);
            }
            self.shm_poll(cq);
            if !cq.queue.lock().is_empty() {
                break Ok(());
            }
            if self.receive.delegated.load(Ordering::SeqCst) > 0 {
                // An event loop watches the socket now: it is its (the caller waits again).
                break Ok(());
            }
            if ready == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            if cq.notify.driven() {
                // A driver started: it is signalled, not us; let it have the socket.
                break Ok(());
            }
        };
        cq.notify.disarm();
        // Hand receiving back to the engine thread (it wakes at once if data is waiting):
        // release first, so that the engine never finds the socket readable and the state held.
        drop(rx);
        self.rx_give(keep);
        res
    }

    fn recently_driven(&self, cq: &CqShared) -> bool {
        let e = cq.drive_ended.load(Ordering::Acquire);
        e != 0 && self.nanos(Instant::now()).saturating_sub(e) < RECENTLY_DRIVEN.as_nanos() as u64
    }

    /// A thread starts driving `cq` (see [`crate::CqScheduler::begin_drive`]).
    pub(crate) fn begin_drive(&self, cq: &CqShared) {
        if cq.notify.begin_drive() {
            // The rings stop ringing the other sleepers.
            self.shm_sleepers(cq, |_| {});
        }
    }

    /// A thread stops driving `cq`: when it was the last, the other sleepers are signalled
    /// again, and woken now if something came that no driver took.
    pub(crate) fn end_drive(&self, cq: &CqShared) {
        let wake = cq.notify.end_drive(|last| {
            if !last {
                // Other drivers remain: if this one leaves completions behind (it could not
                // take them, or took only some), the others must look.
                return !cq.queue.lock().is_empty() || self.shm_pending(cq);
            }
            cq.drive_ended
                .store(self.nanos(Instant::now()).max(1), Ordering::Release);
            let pending = self.shm_sleepers(cq, |_| {});
            pending || !cq.queue.lock().is_empty()
        });
        if let Some(w) = wake {
            cq.signal(w);
        }
    }

    /// A driver is about to sleep on `cq`'s driver descriptor (`on`), or woke: returns, when
    /// going to sleep, whether something is already there (then do not sleep).
    pub(crate) fn drive_sleep(&self, cq: &CqShared, on: bool) -> bool {
        if on {
            let sleep = cq.notify.driver_sleep(
                || self.shm_sleepers(cq, |s| s.drivers += 1),
                || cq.queue.lock().is_empty(),
            );
            if !sleep {
                self.shm_sleepers(cq, Sleepers::driver_woke);
            }
            !sleep
        } else {
            self.shm_sleepers(cq, Sleepers::driver_woke);
            false
        }
    }

    /// A driver about to sleep spins first (adaptively, see
    /// [`DeviceConfig::spin`](super::DeviceConfig::spin)): on `cq`'s same-host rings when they
    /// feed it alone, and on the socket when the driver holds it (`rx`). True if something
    /// arrived (it is in the CQ).
    pub(crate) fn drive_spin(&self, cq: &CqShared, rx: Option<&mut RxState>) -> bool {
        if rx.is_none() && !self.shm_only(cq) {
            return false;
        }
        let now = Instant::now();
        let Some(budget) = cq.spin.budget(self.cfg.spin, self.nanos(now)) else {
            return false;
        };
        let spun = self.spin(cq, rx, now + budget);
        cq.spin.record(spun, self.nanos(Instant::now()));
        spun == Spun::Caught
    }

    /// [`Self::drive_spin`] for a driver that receives for itself when it wakes (`rx`): the
    /// spin receives too, unless another thread is receiving.
    pub(crate) fn drive_spin_rx(&self, cq: &CqShared, rx: bool) -> bool {
        // Only while the engine's interest is off (delegated): else the engine, woken by each
        // packet, would find the socket taken again and again.
        let rx = rx && self.receive.delegated.load(Ordering::SeqCst) > 0;
        match rx.then(|| self.rx_try()).flatten() {
            Some(mut g) => self.drive_spin(cq, Some(&mut g)),
            None => self.drive_spin(cq, None),
        }
    }

    /// Polls the rings (and the socket, with `rx`) until something completes on `cq` or
    /// `until`. Each turn yields the CPU, so that a peer on this very CPU runs (and answers)
    /// instead of waiting for us to give up; a yield that comes back late means other work
    /// wants this CPU (a busy machine): then the spin ends as [`Spun::Lost`].
    fn spin(&self, cq: &CqShared, mut rx: Option<&mut RxState>, until: Instant) -> Spun {
        loop {
            if let Some(rx) = rx.as_deref_mut() {
                self.rx_drain(rx, 4);
            }
            if self.shm_pending(cq) {
                self.shm_poll(cq);
            }
            if !cq.queue.lock().is_empty() {
                return Spun::Caught;
            }
            if rx.is_none() {
                // (A turn on the socket is a system call already.)
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
            let before = Instant::now();
            if before >= until {
                return Spun::Missed;
            }
            // (Rather than the engine thread, which would take this CPU to do it.)
            self.run_due_timers(before);
            rustix::thread::sched_yield();
            if before.elapsed() > YIELD_LOST {
                return Spun::Lost;
            }
        }
    }

    /// Whether a thread about to hold the socket for `cq` should keep the timers. Not while the
    /// CQ's spins keep losing the CPU (a busy machine): such a thread is often runnable but not
    /// running, and a timer it keeps waits for it — for a whole scheduler slice of another task
    /// (ping-pong p99 ~840 µs beside a busy loop per CPU) — where the engine thread, asleep most
    /// of the time, gets a CPU at once.
    fn may_keep_timers(&self, cq: &CqShared) -> bool {
        !cq.spin.backed_off(self.nanos(Instant::now()))
    }

    /// A driver that slept woke after `slept`: had it arrived within a spin, spinning resumes.
    pub(crate) fn drive_woke_after(&self, cq: &CqShared, slept: Duration) {
        cq.spin.woke_after(slept, self.cfg.spin);
    }

    /// A driver's blocking wait: like [`Self::wait_cq`], but signalled on the driver
    /// descriptor, and it takes over receiving from the socket when it can.
    pub(crate) fn drive_wait(&self, cq: &CqShared, timeout: Option<Duration>) -> io::Result<()> {
        let shm_only = self.shm_only(cq);
        // A CQ fed by shared memory only has nothing to receive from the socket.
        // Nor while an event loop watches it (it hands our completions over).
        let delegated = || self.receive.delegated.load(Ordering::SeqCst) > 0;
        let mut rx = if shm_only || delegated() {
            None
        } else {
            self.rx_try()
        };
        // Whether this thread keeps the timers while it holds the socket.
        let mut keep = false;
        if rx.is_some() {
            keep = self.may_keep_timers(cq);
            self.rx_take(keep);
        }
        if self.drive_spin(cq, rx.as_deref_mut()) {
            if rx.is_some() {
                drop(rx);
                self.rx_give(keep);
            }
            return Ok(());
        }
        let slept = Instant::now();
        let deadline = timeout.map(|t| slept + t);
        let res = loop {
            self.run_due_timers(Instant::now());
            if self.drive_sleep(cq, true) {
                self.shm_poll(cq);
                if cq.queue.lock().is_empty() {
                    continue; // part of a message
                }
                break Ok(());
            }
            let now = Instant::now();
            let left = deadline.map(|d| d.saturating_duration_since(now));
            // Holding the socket, this thread keeps the timers (see `timer_keeper`).
            let left = if rx.is_some() && keep {
                self.until_next_timer(now, left)
            } else {
                left
            };
            let ts = left.map(timespec);
            let ev = rustix::event::PollFd::new(&cq.event_driver, rustix::event::PollFlags::IN);
            let (r, sock_ready, ev_ready) = match &rx {
                Some(_) => {
                    let mut fds = [
                        ev,
                        rustix::event::PollFd::new(self.sock.fd(), rustix::event::PollFlags::IN),
                        rustix::event::PollFd::new(
                            &self.receive.rx_yield,
                            rustix::event::PollFlags::IN,
                        ),
                    ];
                    let r = rustix::event::poll(&mut fds, ts.as_ref());
                    let rd = |f: &rustix::event::PollFd<'_>| {
                        f.revents().contains(rustix::event::PollFlags::IN)
                    };
                    (r, rd(&fds[1]), rd(&fds[0]))
                }
                None => {
                    let mut fds = [ev];
                    let r = rustix::event::poll(&mut fds, ts.as_ref());
                    (
                        r,
                        false,
                        fds[0].revents().contains(rustix::event::PollFlags::IN),
                    )
                }
            };
            self.drive_sleep(cq, false);
            let ready = match r {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => 0,
                Err(e) => break Err(e.into()),
            };
            if ev_ready {
                drain_eventfd(&cq.event_driver);
            }
            if sock_ready && let Some(rx) = rx.as_mut() {
                self.rx_drain(rx, 64);
            }
            if rx.is_some() && delegated() {
                // An event loop watches the socket now: leave it to it.
                rx = None;
                if keep {
                    self.timer_keeper(false);
                    keep = false;
                }
                self.engine_rx_interest(true);
            }
            self.shm_poll(cq);
            // (A socket wake restores the spin only when it brought this CQ something: the
            // socket carries every QP's packets.)
            if ev_ready || (sock_ready && !cq.queue.lock().is_empty()) {
                self.drive_woke_after(cq, slept.elapsed());
            }
            // Signalled: even with the queue empty now (another driver took what came), the
            // caller's condition may have changed.
            if ev_ready || !cq.queue.lock().is_empty() {
                break Ok(());
            }
            if ready == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            if rx.is_none() && !shm_only && !delegated() {
                rx = self.rx_try();
                if rx.is_some() {
                    keep = self.may_keep_timers(cq);
                    self.rx_take(keep);
                }
            }
        };
        if rx.is_some() {
            drop(rx);
            self.rx_give(keep);
        }
        res
    }
}

/// How long after the last drive a CQ's other sleepers keep leaving the socket to drivers
/// (an application thread between two waits comes back within it).
const RECENTLY_DRIVEN: Duration = Duration::from_millis(10);
