//! Shared helpers for the demo and bench binaries.
