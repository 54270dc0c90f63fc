//! `LD_PRELOAD` interposition layer (issue 5): translates libc socket calls of unmodified
//! programs into calls on the `smcr` crate. It exports no symbols yet.
