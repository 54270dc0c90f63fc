//! CLC (Connection Layer Control) messages of SMC-R, as the Linux kernel sends them.
//!
//! This crate will hold byte-exact codecs for the CLC header and trailer, Proposal (v1 and v2
//! sections, IP prefix list, SMC-Rv2 extension), Accept, Confirm and Decline, and the
//! `SMC_CLC_DECL_*` decline/fallback codes with their Linux names (issue 3). It is pure: no I/O.
#![forbid(unsafe_code)]
