//! The adaptive spin of a driver about to sleep (see
//! [`DeviceConfig::spin`](super::DeviceConfig::spin)): how long the next spin may last, and what
//! each spin's outcome does to that. Pure (times are device nanoseconds), so the rules are
//! tested without a scheduler; the spinning itself is `Shared::spin`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// A spin's yield that returns later than this lost the CPU to other work for a scheduler
/// slice (milliseconds; a peer on the same CPU answering, or a kernel thread, takes
/// microseconds): spinning on would cost a slice per yield (a busy loop per CPU beside a
/// same-host ping-pong made its p50 4 ms).
pub(crate) const YIELD_LOST: Duration = Duration::from_micros(250);

/// How many spins in a row must lose the CPU before the CQ stops spinning for
/// [`BACKOFF`]. Once in a while a yield comes back late on an idle machine too (the other
/// spinner and a kernel thread on this CPU): stopping at the first one cost the whole gain of
/// spinning on a UDP link.
pub(crate) const LOST_IN_A_ROW: u32 = 3;

/// How long a CQ does not spin after spins kept losing the CPU (a few lost slices per this at
/// most).
pub(crate) const BACKOFF: Duration = Duration::from_secs(1);

/// A sleep that ended within this many spins restores the spin (see [`SpinState::woke_after`]).
pub(crate) const RESTORE_WITHIN: u32 = 3;

/// How a driver's spin ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spun {
    /// Something completed.
    Caught,
    /// The spin's time ran out.
    Missed,
    /// A yield came back late: other work wants the CPU.
    Lost,
}

/// A CQ's spin state (updated by whichever driver spins; races only blur the adaptation).
#[derive(Debug, Default)]
pub(crate) struct SpinState {
    /// Spins in a row that caught nothing (each halves the next one).
    fails: AtomicU32,
    /// Spins in a row that lost the CPU.
    lost: AtomicU32,
    /// No spinning before this (device nanoseconds).
    off_until: AtomicU64,
}

impl SpinState {
    /// How long the next spin may last at `now` (at most `max`); `None`: do not spin.
    pub(crate) fn budget(&self, max: Duration, now: u64) -> Option<Duration> {
        if max.is_zero() || now < self.off_until.load(Ordering::Relaxed) {
            return None;
        }
        let fails = self.fails.load(Ordering::Relaxed);
        let b = max / (1u32 << fails.min(16));
        (b >= Duration::from_micros(1)).then_some(b)
    }

    /// Whether spinning is off at `now` because spins kept losing the CPU (a busy machine).
    pub(crate) fn backed_off(&self, now: u64) -> bool {
        now < self.off_until.load(Ordering::Relaxed)
    }

    /// A spin ended at `now` (device nanoseconds) as `spun`.
    pub(crate) fn record(&self, spun: Spun, now: u64) {
        if spun != Spun::Lost {
            self.lost.store(0, Ordering::Relaxed);
        }
        match spun {
            Spun::Caught => self.fails.store(0, Ordering::Relaxed),
            Spun::Missed => {
                let f = self.fails.load(Ordering::Relaxed);
                self.fails.store((f + 1).min(16), Ordering::Relaxed);
            }
            Spun::Lost => {
                if self.lost.fetch_add(1, Ordering::Relaxed) + 1 >= LOST_IN_A_ROW {
                    self.lost.store(0, Ordering::Relaxed);
                    let off = now.saturating_add(BACKOFF.as_nanos() as u64);
                    self.off_until.store(off, Ordering::Relaxed);
                }
            }
        }
    }

    /// A driver that slept woke after `slept`: had it arrived within [`RESTORE_WITHIN`] spins
    /// of `max`, spinning resumes at full length. (Within one spin only, two peers that both
    /// slept stayed asleep: each one's answer came after the other's wake-up, longer than a
    /// spin where wake-ups cost 10–15 µs, and a ping-pong then ran at twice a wake-up instead
    /// of the ~3 µs of two spinners.)
    pub(crate) fn woke_after(&self, slept: Duration, max: Duration) {
        if slept < max * RESTORE_WITHIN {
            self.fails.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(16);
    const MS: u64 = 1_000_000;

    #[test]
    fn misses_halve_the_budget_down_to_none_and_a_catch_restores_it() {
        let s = SpinState::default();
        assert_eq!(s.budget(MAX, 0), Some(MAX));
        for want in [8, 4, 2, 1] {
            s.record(Spun::Missed, 0);
            assert_eq!(s.budget(MAX, 0), Some(Duration::from_micros(want)));
        }
        s.record(Spun::Missed, 0);
        assert_eq!(s.budget(MAX, 0), None, "below 1 µs: no spin");
        s.record(Spun::Caught, 0);
        assert_eq!(s.budget(MAX, 0), Some(MAX));
        assert_eq!(s.budget(Duration::ZERO, 0), None, "spinning off");
    }

    #[test]
    fn a_quick_wake_restores_the_budget_a_slow_one_does_not() {
        let s = SpinState::default();
        s.record(Spun::Missed, 0);
        s.record(Spun::Missed, 0);
        s.woke_after(MAX * RESTORE_WITHIN, MAX);
        assert_eq!(s.budget(MAX, 0), Some(MAX / 4));
        s.woke_after(MAX * RESTORE_WITHIN - Duration::from_micros(1), MAX);
        assert_eq!(s.budget(MAX, 0), Some(MAX));
    }

    #[test]
    fn only_spins_that_keep_losing_the_cpu_stop_spinning_for_the_backoff() {
        let s = SpinState::default();
        // Two lost spins, then one that did not lose: the count starts again.
        s.record(Spun::Lost, 0);
        s.record(Spun::Lost, 0);
        s.record(Spun::Missed, 0);
        s.record(Spun::Lost, 0);
        s.record(Spun::Lost, 0);
        assert!(
            s.budget(MAX, MS).is_some(),
            "four lost, never three in a row"
        );
        s.record(Spun::Lost, 10 * MS);
        let back = 10 * MS + BACKOFF.as_nanos() as u64;
        assert_eq!(s.budget(MAX, 10 * MS), None);
        assert_eq!(s.budget(MAX, back - 1), None);
        assert!(
            s.budget(MAX, back).is_some(),
            "spins again after the backoff"
        );
        // The count restarted: one more lost spin does not stop it again.
        s.record(Spun::Lost, back);
        assert!(s.budget(MAX, back + 1).is_some());
    }
}
