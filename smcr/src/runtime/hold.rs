//! The timing of a hold (see [`Hold`]): when the poller looks at it, when a holder must kick
//! the poller, when the poller takes the group back. Pure (times passed in), so the rules are
//! tested without threads; `drive.rs` takes the lock and does what they say.

use std::time::{Duration, Instant};

/// Holders asleep this long leave the poller on its long timer (they kick it when they wake).
pub(super) const HOLD_IDLE: Duration = Duration::from_millis(5);

/// The drive event-loop threads keep between two `epoll_wait`s: what arrives while the loop
/// works waits in the rings for its next wait (no wake-up for anyone) instead of going to the
/// poller. The poller takes the group back when no loop came by for `hold_for` (a loop busy
/// elsewhere, blocked in another call, or gone), so nothing waits longer than that (plus
/// [`HOLD_IDLE`] right after a long sleep).
#[derive(Debug)]
pub(super) struct Hold {
    /// The hold's own drive is on.
    pub(super) held: bool,
    /// The holders watch the device's socket themselves (their epoll sets hold it): the
    /// engine thread does not, so a packet wakes the holder directly instead of the engine
    /// thread, which would then signal the holder (two wake-ups).
    pub(super) rx: bool,
    /// Threads between `sleep_begin` and `sleep_end`.
    pub(super) sleeping: u32,
    /// When a loop last went to sleep or woke.
    pub(super) last: Instant,
    /// When the poller looks at the hold next (set as it goes to sleep): a holder that wakes
    /// earlier than that minus `hold_for` kicks it, so that nothing waits past `hold_for` after
    /// the holders stop coming, whenever the hold began.
    pub(super) poller_until: Option<Instant>,
}

/// What the poller's look at the hold decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Look {
    /// How long the poller sleeps (its wake-up is its next look).
    pub(super) wait: Duration,
    /// The holders stayed away for `hold_for`: the hold ended, the group is the poller's.
    pub(super) taken_back: bool,
    /// With `taken_back`: the holders watched the device's socket; it goes back to the engine.
    pub(super) rx_back: bool,
}

impl Hold {
    /// No hold yet.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            held: false,
            rx: false,
            sleeping: 0,
            last: now,
            poller_until: None,
        }
    }

    /// A holder came by at `now` (it woke, or found something without sleeping). `true`: kick
    /// the poller, which sleeps past `hold_for` from now and must look again by then.
    pub(super) fn seen(&mut self, now: Instant, hold_for: Duration) -> bool {
        self.last = now;
        if self.poller_until.is_some_and(|t| t > now + hold_for) {
            self.poller_until = None;
            true
        } else {
            false
        }
    }

    /// The poller's look at `now`, before it sleeps for at most `wait` (its own timers).
    ///
    /// While holders are awake it looks again when `hold_for` since the last one ran out. While
    /// they sleep (they are signalled themselves) it still looks every `hold_for` until they
    /// have slept [`HOLD_IDLE`]: a loop that sleeps and wakes many times a millisecond then
    /// finds the poller's next look near enough on every waking and kicks nobody (a sleep to
    /// the end of `HOLD_IDLE` made every waking after a sleep a kick: the poller's thread woke
    /// twice per `hold_for` and took the loop's CPU from it). Only holders asleep longer leave
    /// the poller on its long timer, and the first of them to wake kicks it.
    pub(super) fn look(&mut self, now: Instant, wait: Duration, hold_for: Duration) -> Look {
        let since = now.saturating_duration_since(self.last);
        let mut look = Look {
            wait,
            taken_back: false,
            rx_back: false,
        };
        if self.held && self.sleeping > 0 {
            if since < HOLD_IDLE {
                look.wait = wait.min(hold_for).min(HOLD_IDLE - since);
            }
        } else if self.held && since >= hold_for {
            self.held = false;
            look.taken_back = true;
            look.rx_back = std::mem::take(&mut self.rx);
        } else if self.held {
            look.wait = wait.min(hold_for - since);
        }
        self.poller_until = Some(now + look.wait);
        look
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_millis(1);
    const LONG: Duration = Duration::from_secs(30);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A held group, its holder awake since `t0`.
    fn held(t0: Instant) -> Hold {
        let mut h = Hold::new(t0);
        h.held = true;
        h
    }

    /// An event loop that wakes for 20 µs every 70 µs for 100 ms, and a poller that looks
    /// when its sleep ends (or when kicked): no kick, about one look per `hold_for`, and the
    /// group stays held.
    #[test]
    fn a_loop_that_sleeps_and_wakes_often_never_kicks_the_poller() {
        let t0 = Instant::now();
        let mut h = held(t0);
        let (mut kicks, mut looks) = (0, 0);
        let mut next_look = t0;
        for step in 0..10_000u64 {
            let t = t0 + us(step * 10);
            match step % 7 {
                // sleep_begin: counted asleep, seen.
                2 => {
                    h.sleeping += 1;
                    h.last = t;
                }
                // sleep_end: awake again.
                0 if step > 0 => {
                    h.sleeping -= 1;
                    if h.seen(t, HOLD) {
                        kicks += 1;
                        next_look = t;
                    }
                }
                _ => {}
            }
            if t >= next_look {
                looks += 1;
                let l = h.look(t, LONG, HOLD);
                assert!(!l.taken_back, "taken back at {:?}", t - t0);
                next_look = t + l.wait;
            }
        }
        assert_eq!(kicks, 0, "the loop kicked the poller");
        assert!(looks <= 110, "{looks} looks in 100 ms with a 1 ms hold");
        assert!(h.held);
    }

    /// A loop that wakes at `t0` and never comes back: the poller, looking when its sleeps
    /// end, takes the group back `hold_for` later, not sooner, and then sleeps its own wait.
    #[test]
    fn a_loop_that_stops_coming_is_taken_back_after_hold_for() {
        let t0 = Instant::now();
        let mut h = held(t0);
        h.rx = true;
        let mut t = t0 + us(300);
        let first = h.look(t, LONG, HOLD);
        assert_eq!(first.wait, us(700), "looks again when the hold runs out");
        t += first.wait;
        let l = h.look(t, LONG, HOLD);
        assert!(l.taken_back && l.rx_back);
        assert_eq!(l.wait, LONG);
        assert!(!h.held && !h.rx);
        // Not held any more: the poller's own timers only.
        assert_eq!(h.look(t + us(5), LONG, HOLD).wait, LONG);
    }

    /// Holders asleep for `HOLD_IDLE` leave the poller on its long timer; the first to wake
    /// kicks it, and its next look comes within `hold_for`.
    #[test]
    fn holders_asleep_long_leave_the_poller_asleep_until_one_wakes() {
        let t0 = Instant::now();
        let mut h = held(t0);
        h.sleeping = 1;
        let mut t = t0;
        let mut looks = 0;
        loop {
            let l = h.look(t, LONG, HOLD);
            looks += 1;
            assert!(!l.taken_back);
            if l.wait == LONG {
                break;
            }
            assert!(l.wait <= HOLD);
            t += l.wait;
        }
        assert_eq!(
            t - t0,
            HOLD_IDLE,
            "long timer once the holder slept HOLD_IDLE"
        );
        assert!(looks <= 6);
        // A second later the holder wakes: the poller must look within `hold_for`.
        let woke = t + Duration::from_secs(1);
        h.sleeping = 0;
        assert!(h.seen(woke, HOLD), "a kick");
        assert!(!h.seen(woke + us(1), HOLD), "one kick is enough");
        let l = h.look(woke + us(50), LONG, HOLD);
        assert_eq!(
            l.wait,
            us(951),
            "hold_for after the last waking (woke + 1 µs)"
        );
    }

    /// The poller's own timers come first whatever the hold says.
    #[test]
    fn a_due_timer_shortens_every_look() {
        let t0 = Instant::now();
        let mut h = held(t0);
        assert_eq!(h.look(t0, us(100), HOLD).wait, us(100));
        h.sleeping = 1;
        assert_eq!(h.look(t0, us(100), HOLD).wait, us(100));
        assert_eq!(h.poller_until, Some(t0 + us(100)));
    }
}
