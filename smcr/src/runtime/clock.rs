//! The link groups' protocol clock: what their timers (TEST LINK, the LLC waits, the linger of
//! an idle group, the core's deadlines) are measured on. The system's monotonic clock; in
//! tests of the drivers, one that moves only when the test says, so that a timer's expiry is
//! a step of the test, not a sleep. Waits of threads (condition variables, `poll`) stay on
//! the system clock: only the protocol's notion of "now" is virtual.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
pub(crate) struct Clock(Option<Arc<Manual>>);

struct Manual {
    base: Instant,
    /// Nanoseconds since `base`.
    offset: AtomicU64,
}

impl Clock {
    pub(crate) fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.base + Duration::from_nanos(m.offset.load(Ordering::Acquire)),
        }
    }

    /// A clock that stands still until [`Self::advance`].
    #[cfg(test)]
    pub(crate) fn manual() -> Self {
        Self(Some(Arc::new(Manual {
            base: Instant::now(),
            offset: AtomicU64::new(0),
        })))
    }

    /// Moves a manual clock forward by `d`.
    #[cfg(test)]
    pub(crate) fn advance(&self, d: Duration) {
        let m = self.0.as_ref().expect("a manual clock");
        m.offset.fetch_add(d.as_nanos() as u64, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let c = Clock::manual();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        c.advance(Duration::from_secs(30));
        assert_eq!(c.now() - t0, Duration::from_secs(30));
        let sys = Clock::default();
        assert!(sys.now() >= t0);
    }
}
