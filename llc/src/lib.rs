//! LLC (Link Layer Control) messages of SMC-R: the 44-byte (v1) and variable-length (v2)
//! messages sent with RDMA SEND on a link's queue pair — CONFIRM_LINK, ADD_LINK, DELETE_LINK,
//! CONFIRM_RKEY, DELETE_RKEY, TEST_LINK and their v2 forms (issue 3). Pure codecs: no I/O.
#![forbid(unsafe_code)]
