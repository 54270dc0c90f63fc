//! The command-line tools' side of smcr: what `smc-stat` and `smcr stats` show ([`view`]),
//! read from the shared-memory stats areas the runtime writes (`smcr::stats`). The binaries
//! `smcr` and `smc-stat` are this crate's; it alone pulls clap, serde_json and toml_edit, so
//! `libsmcr.so` links none of them.
#![warn(missing_docs)]

pub mod view;
