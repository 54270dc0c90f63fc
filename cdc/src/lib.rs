//! CDC (Connection Data Control) messages of SMC-R: the 44-byte message carrying a connection's
//! producer/consumer cursors and flags, plus wrap-aware cursor arithmetic (issue 3). Pure: no I/O.
#![forbid(unsafe_code)]
