//! The `SMCR_*` settings of the process as they were when it started.
//!
//! Programs change their own environment: nginx gives its worker processes an environment
//! with nothing but `TZ`, daemons clear theirs. The preload library is still loaded in such a
//! process (a fork keeps it), so its settings must not depend on the environment at the time
//! they are first read: the library takes a [`snapshot`] when it is loaded, and every setting
//! is read through [`var`].

use std::collections::HashMap;
use std::sync::OnceLock;

static SNAPSHOT: OnceLock<HashMap<String, String>> = OnceLock::new();

/// Takes the `SMCR_*` variables of the environment now (once: later calls keep the first).
pub fn snapshot() {
    SNAPSHOT.get_or_init(|| {
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| k.starts_with("SMCR_"))
            .collect()
    });
}

/// A setting: from the snapshot when one was taken, else from the environment.
pub fn var(key: &str) -> Option<String> {
    match SNAPSHOT.get() {
        Some(s) => s.get(key).cloned(),
        None => std::env::var(key).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_outlives_the_environment() {
        // SAFETY: this test binary's other tests do not read these variables.
        unsafe { std::env::set_var("SMCR_ENV_TEST_KEEP", "1") };
        snapshot();
        unsafe { std::env::remove_var("SMCR_ENV_TEST_KEEP") };
        assert_eq!(var("SMCR_ENV_TEST_KEEP").as_deref(), Some("1"));
        assert_eq!(var("SMCR_ENV_TEST_NEVER_SET"), None);
    }
}
