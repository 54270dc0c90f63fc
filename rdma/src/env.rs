//! The `SMCR_*` settings of the process as they were when it started.
//!
//! Programs change their own environment: nginx gives its worker processes an environment
//! with nothing but `TZ`, daemons clear theirs. The preload library is still loaded in such a
//! process (a fork keeps it), so its settings must not depend on the environment at the time
//! they are first read: the library takes a [`snapshot`] when it is loaded, and every setting
//! is read through [`var`].
//!
//! A snapshot has two layers: the configuration file's values (`smcr::settings` reads the
//! file and hands them in with [`snapshot_over`]), and the environment's `SMCR_*` variables
//! over them: the environment wins.

use std::collections::HashMap;
use std::sync::OnceLock;

struct Snapshot {
    env: HashMap<String, String>,
    file: HashMap<String, String>,
}

static SNAPSHOT: OnceLock<Snapshot> = OnceLock::new();

/// Takes the `SMCR_*` variables of the environment now (once: later calls keep the first).
pub fn snapshot() {
    snapshot_over(HashMap::new());
}

/// As [`snapshot`], over `file`: settings (by variable name) that apply where the environment
/// does not set them. Only the first snapshot of the process counts.
pub fn snapshot_over(file: HashMap<String, String>) {
    SNAPSHOT.get_or_init(|| Snapshot {
        env: std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| k.starts_with("SMCR_"))
            .collect(),
        file,
    });
}

/// A setting: from the snapshot when one was taken (the environment's value, else the
/// file's), else from the environment.
pub fn var(key: &str) -> Option<String> {
    match SNAPSHOT.get() {
        Some(s) => s.env.get(key).or_else(|| s.file.get(key)).cloned(),
        None => std::env::var(key).ok(),
    }
}

/// Whether `key`'s value comes from the environment (not from the file, or unset).
pub fn from_environment(key: &str) -> bool {
    match SNAPSHOT.get() {
        Some(s) => s.env.contains_key(key),
        None => std::env::var_os(key).is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_outlives_the_environment_and_overrides_the_file() {
        // SAFETY: this test binary's other tests do not read these variables.
        unsafe { std::env::set_var("SMCR_ENV_TEST_KEEP", "1") };
        snapshot_over(HashMap::from([
            ("SMCR_ENV_TEST_KEEP".to_owned(), "file".to_owned()),
            ("SMCR_ENV_TEST_FILE".to_owned(), "2".to_owned()),
        ]));
        unsafe { std::env::remove_var("SMCR_ENV_TEST_KEEP") };
        assert_eq!(var("SMCR_ENV_TEST_KEEP").as_deref(), Some("1"));
        assert!(from_environment("SMCR_ENV_TEST_KEEP"));
        assert_eq!(var("SMCR_ENV_TEST_FILE").as_deref(), Some("2"));
        assert!(!from_environment("SMCR_ENV_TEST_FILE"));
        assert_eq!(var("SMCR_ENV_TEST_NEVER_SET"), None);
    }
}
