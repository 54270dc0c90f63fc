//! How packets leave and enter the process: the UDP socket with its batching, and the test
//! middleware (fault injection and pcap capture) that can sit in front of it.

pub mod fault;
pub mod pcap;
pub(crate) mod sys;
pub(crate) mod udp;
