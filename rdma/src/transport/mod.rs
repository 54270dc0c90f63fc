//! How packets leave and enter the process: the UDP socket with its batching, how a device
//! shares the RoCE port with other processes ([`steer`]), and the test middleware (fault
//! injection and pcap capture) that can sit in front of it.

pub mod fault;
pub mod pcap;
pub mod steer;
pub(crate) mod sys;
pub(crate) mod udp;
