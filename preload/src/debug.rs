//! Pauses that tests ask of debug builds through the environment, to widen a race window a
//! loaded machine opens by chance (a leaf).

#[cfg(debug_assertions)]
use std::{sync::OnceLock, time::Duration};

/// Sleeps for the value of `var` in `unit`s (read once, into `cell`); not at all without it.
#[cfg(debug_assertions)]
pub(crate) fn sleep_from_env(cell: &OnceLock<Duration>, var: &str, unit: fn(u64) -> Duration) {
    let d = *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, unit)
    });
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}
