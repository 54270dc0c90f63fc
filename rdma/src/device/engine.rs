//! The engine thread and its timers: the loop that sleeps in `epoll_wait` and dispatches
//! what woke it, the timer heap (woken through an eventfd only when a new timer is earlier
//! than the one it sleeps on), driving a QP (send, complete, re-arm its timer), and stopping.

use super::counters::bump;
use super::{
    EV_ALT, EV_KICK, EV_OFFER, EV_OFFERED, EV_PEER, EV_RENDEZVOUS, EV_SOCK, EV_SPARE, QpCore,
    Shared, drain_eventfd, timespec,
};
use crate::locks::Mutex;
use crate::rc::{CqSide, WcStatus};
use crate::thread::JoinHandle;
use rustix::event::epoll;
use std::cmp::Reverse;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Pseudo QP number used for the fault injector's timer.
pub(super) const FAULT_TIMER: u32 = u32::MAX;
/// The timer of a socket hand-back ([`DeviceConfig::rx_hold`](super::DeviceConfig::rx_hold)).
pub(super) const RX_HOLD_TIMER: u32 = u32::MAX - 1;

/// While a thread waiting on the socket keeps the timers (see `Shared::timer_keeper`), or did
/// within this long, the engine thread sleeps until this long after the next deadline: each
/// of its wake-ups took the CPU from a spinning thread for 3–4 µs, ~800 times a second in a
/// ping-pong (RC deadlines met or moved by the waiting threads), which was the ping-pong's
/// p99. A timer is at most this late when its thread stops waiting just before it.
pub(crate) const TIMER_GRACE: Duration = Duration::from_millis(5);

impl Shared {
    fn wake_engine(&self) {
        bump(&self.stats.engine_kicks, 1);
        let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
    }

    /// Asks the engine to call back for `qpn` at `at` (or the thread keeping the timers: then
    /// the engine is woken only if it would be late by more than [`TIMER_GRACE`]).
    pub(super) fn schedule(&self, at: Instant, qpn: u32) {
        let mut heap = self.timers.heap.lock();
        heap.push(Reverse((at, qpn)));
        let at = self.nanos(at);
        self.timers.next.fetch_min(at, Ordering::SeqCst);
        let sleeping = self.timers.sleep_until.load(Ordering::Acquire);
        let due = if self.timers_kept(Instant::now()) {
            at.saturating_add(TIMER_GRACE.as_nanos() as u64)
        } else {
            at
        };
        if sleeping != 0 && due < sleeping {
            // Mark it awake so that a burst of earlier timers kicks only once.
            self.timers.sleep_until.store(0, Ordering::Release);
            drop(heap);
            self.wake_engine();
        }
    }

    /// Sends what the QP has to send, hands out its completions and re-arms its timer.
    /// Called with the QP locked, from any thread.
    pub(crate) fn drive(&self, core: &mut QpCore, now: Instant) {
        let mut retry = false;
        let mut hold_until = None;
        if let Some(shm) = &mut core.shm {
            // Requests held for the peer's offer go first: through shared memory if it came,
            // over UDP if the wait is over.
            shm.settle(&mut core.rc, core.av, now, &self.mrs);
            hold_until = shm.hold_deadline();
            if shm.active {
                shm.flush(&mut core.rc);
                shm.ring_bell();
                retry = shm.backlog_len() > 0;
            }
            if let Err(f) = shm.receive(&mut core.rc) {
                log::warn!(
                    "rdma: QP {:#x}: the same-host transport failed ({}); the QP is in error",
                    core.rc.qp_num(),
                    f.0
                );
                bump(&self.stats.shm_faults, 1);
                core.rc.fail();
                shm.disconnect(Some(&mut core.rc));
                shm.fault = Some(f.0);
            }
        }
        if let Some(dst) = core.av {
            self.transmit(core, dst, now);
        }
        self.count_rc(core);
        while let Some((side, wc)) = core.rc.poll_completion() {
            if !matches!(wc.status, WcStatus::Success | WcStatus::WrFlushErr) {
                // What failed the QP (the flushes after it say nothing new).
                log::warn!(
                    "rdma: QP {:#x}: {} ({:?}, wr_id {})",
                    wc.qp_num,
                    wc.status.name(),
                    wc.opcode,
                    wc.wr_id
                );
            }
            match side {
                CqSide::Send => core.send_cq.push(wc),
                CqSide::Recv => core.recv_cq.push(wc),
            }
        }
        let mut next = core.rc.poll_timeout();
        if let Some(h) = hold_until {
            next = Some(next.map_or(h, |t| t.min(h)));
        }
        if retry {
            // The peer's ring is full: look again soon (its consumer frees slots as it goes).
            let r = now + Duration::from_micros(200);
            next = Some(next.map_or(r, |t| t.min(r)));
        }
        if let Some(t) = next {
            self.arm(core, t);
        }
    }

    /// Makes sure the QP's timer runs by `t` (its next deadline; for a corked QP, when the
    /// engine transmits it).
    pub(crate) fn arm(&self, core: &mut QpCore, t: Instant) {
        if core.timer_at.is_none_or(|old| t < old) {
            core.timer_at = Some(t);
            self.schedule(t, core.rc.qp_num());
        }
    }

    /// Whether a waiting thread keeps the timers (one holds the socket now, or let go within
    /// [`TIMER_GRACE`]): the engine then sleeps up to that much past a deadline.
    pub(super) fn timers_kept(&self, now: Instant) -> bool {
        let left = self.timers.kept_at.load(Ordering::Relaxed);
        self.timers.keepers.load(Ordering::SeqCst) > 0
            || (left != 0 && self.nanos(now).saturating_sub(left) < TIMER_GRACE.as_nanos() as u64)
    }

    /// For a waiting thread: runs the timers that are due (a lock-free look when none is).
    pub(super) fn run_due_timers(&self, now: Instant) {
        if self.nanos(now) >= self.timers.next.load(Ordering::SeqCst) {
            run_timers(self, now);
        }
    }

    /// A sleep of at most `left` (`None`: unbounded) cut short at the next timer, for the
    /// thread that keeps the timers.
    pub(super) fn until_next_timer(
        &self,
        now: Instant,
        left: Option<Duration>,
    ) -> Option<Duration> {
        let next = self.timers.next.load(Ordering::SeqCst);
        let timer =
            (next != u64::MAX).then(|| Duration::from_nanos(next.saturating_sub(self.nanos(now))));
        match (left, timer) {
            (Some(l), Some(t)) => Some(l.min(t)),
            (l, t) => l.or(t),
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake_engine();
    }
}

/// The engine thread's loop: timers, and receiving while no application thread does.
pub(crate) fn run_engine(shared: Arc<Shared>) {
    let mut evbuf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
    while !shared.stop.load(Ordering::Acquire) {
        run_timers(&shared, Instant::now());
        // Decide how long to sleep, under the timer lock so that `schedule` sees a consistent
        // picture (it kicks only when its deadline is earlier than ours).
        let timeout = {
            let heap = shared.timers.heap.lock();
            let now = Instant::now();
            let next = heap.peek().map(|Reverse((t, _))| *t);
            let next = if shared.timers_kept(now) {
                // The waiting threads run the timers: this thread looks TIMER_GRACE after the
                // next one (not woken by each deadline they meet or move), which is as late as
                // a deadline gets if they all stop waiting. No timer: no look (idle).
                next.map(|t| t.max(now) + TIMER_GRACE)
            } else {
                next
            };
            shared.timers.sleep_until.store(
                next.map_or(u64::MAX, |t| shared.nanos(t).max(1)),
                Ordering::Release,
            );
            next.map(|t| t.saturating_duration_since(now))
        };
        let ts = timeout.map(timespec);
        let (mut kicked, mut readable) = (false, false);
        let (mut alt_ready, mut spare_ready) = (0u64, 0u64);
        if let Ok((evs, _)) = epoll::wait(&shared.epoll, &mut evbuf, ts.as_ref()) {
            for ev in evs.iter() {
                match ev.data.u64() {
                    EV_SOCK => readable = true,
                    t if t & !0xFFFF_FFFF == EV_ALT => alt_ready |= 1 << (t as u32).min(63),
                    t if t & !0xFFFF_FFFF == EV_SPARE => spare_ready |= 1 << (t as u32).min(63),
                    t if t & !0xFFFF_FFFF == EV_OFFERED => shared.offer_progress(t as u32),
                    EV_KICK => kicked = true,
                    EV_RENDEZVOUS => shared.accept_offers(),
                    t if t & !0xFFFF_FFFF == EV_OFFER => shared.take_offer(t as u32 as i32),
                    t if t & !0xFFFF_FFFF == EV_PEER => shared.peer_gone(t as u32),
                    _ => {}
                }
            }
        }
        shared.timers.sleep_until.store(0, Ordering::Release);
        bump(&shared.stats.engine_wakes, 1);
        if kicked {
            drain_eventfd(&shared.kick);
        }
        if readable {
            // Never block here: an application thread may hold the receive state while it
            // sleeps, and timers must keep running. It has turned our socket interest off (or
            // is about to), so a failed attempt does not repeat.
            if let Some(mut rx) = shared.rx_try() {
                shared.rx_drain(&mut rx, 64);
            }
        }
        if alt_ready != 0 || spare_ready != 0 {
            // Only this thread receives on the further addresses and the spare sockets: never
            // contended.
            let mut rx = shared.alt_rx.lock();
            for (ready, socks) in [(alt_ready, &shared.alt), (spare_ready, &shared.spare)] {
                for (i, (addr, sock)) in socks.iter().enumerate() {
                    if ready >> i.min(63) & 1 == 1 {
                        shared.rx_drain_from(sock, *addr, &mut rx, 64);
                    }
                }
            }
        }
    }
}

fn run_timers(shared: &Shared, now: Instant) {
    loop {
        let due = {
            let mut heap = shared.timers.heap.lock();
            let due = match heap.peek() {
                Some(Reverse((t, _))) if *t <= now => heap.pop().map(|Reverse(e)| e),
                _ => None,
            };
            let next = heap
                .peek()
                .map_or(u64::MAX, |Reverse((t, _))| shared.nanos(*t));
            shared.timers.next.store(next, Ordering::SeqCst);
            due
        };
        let Some((t, qpn)) = due else { return };
        if qpn == FAULT_TIMER {
            shared.release_faulted(now);
            continue;
        }
        if qpn == RX_HOLD_TIMER {
            shared.rx_hold_due(now);
            continue;
        }
        let Some(qp) = shared.lookup(qpn) else {
            continue;
        };
        let mut core = qp.core.lock();
        if core.timer_at == Some(t) {
            core.timer_at = None;
            core.rc.handle_timeout(now);
            shared.drive(&mut core, now);
        }
    }
}

/// Stops and joins the engine thread when the last handle of the device goes away.
pub(crate) struct EngineGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for EngineGuard {
    fn drop(&mut self) {
        self.shared.stop();
        // Not from the engine's own job (the last handle dropped there): it would wait for
        // itself.
        if let Some(t) = self.thread.lock().take()
            && !t.is_running_here()
        {
            let _ = t.join();
        }
        if let Some(mw) = &self.shared.mw
            && let Some(p) = &mut mw.lock().pcap
        {
            let _ = p.flush();
        }
    }
}
