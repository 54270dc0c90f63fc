//! Byte counts of TCP sockets from the kernel (`sock_diag` netlink, as `ss -i` reads them),
//! by socket inode. `smc-stat` uses them for connections that fell back to TCP: the
//! application then talks to the kernel socket directly and the library counts nothing, so a
//! fallback costs the application no per-call bookkeeping.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const INET_DIAG_INFO: u16 = 2;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_msg`: family, state, timer, retrans, sockid (48), expires, rqueue,
/// wqueue, uid, inode.
const DIAG_MSG: usize = 72;
const DIAG_MSG_INODE: usize = 68;
/// Offsets in `struct tcp_info` (stable kernel ABI; appended-only; these since Linux 4.19).
const TCPI_BYTES_RECEIVED: usize = 128;
const TCPI_BYTES_SENT: usize = 200;
const TCPI_BYTES_RETRANS: usize = 208;

/// Payload bytes a TCP socket moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpBytes {
    /// Sent once (`tcpi_bytes_sent - tcpi_bytes_retrans`: retransmissions not counted again;
    /// the SYN and FIN are not data).
    pub sent: u64,
    /// `tcpi_bytes_received`.
    pub received: u64,
}

/// All TCP sockets (IPv4 and IPv6) of the calling thread's network namespace, by inode.
pub fn tcp_bytes() -> io::Result<HashMap<u64, TcpBytes>> {
    let mut out = tcp_bytes_family(libc::AF_INET)?;
    // Dual-stack programs' sockets are IPv6 ones (a kernel without IPv6 has none).
    if let Ok(v6) = tcp_bytes_family(libc::AF_INET6) {
        out.extend(v6);
    }
    Ok(out)
}

/// The TCP sockets of one address family, by inode.
fn tcp_bytes_family(family: libc::c_int) -> io::Result<HashMap<u64, TcpBytes>> {
    // SAFETY: creating a netlink socket; checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor we just created.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = [0u8; NLMSG_HDR + 56];
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let body = &mut req[NLMSG_HDR..];
    body[0] = family as u8;
    body[1] = libc::IPPROTO_TCP as u8;
    body[2] = 1 << (INET_DIAG_INFO - 1);
    body[4..8].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
    // SAFETY: sending our buffer on our socket (the kernel is the default destination).
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: receiving into our buffer.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if parse(&buf[..n as usize], &mut out)? {
            return Ok(out);
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Parses one datagram of a sock_diag dump into `out` (inode → bytes); `Ok(true)` at the
/// dump's end. Malformed input is an error, never a panic (fuzzed: `fuzz/fuzz_targets`).
pub fn parse_datagram(b: &[u8], out: &mut HashMap<u64, TcpBytes>) -> io::Result<bool> {
    parse(b, out)
}

fn parse(mut b: &[u8], out: &mut HashMap<u64, TcpBytes>) -> io::Result<bool> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed sock_diag message");
    while b.len() >= NLMSG_HDR {
        let len = u32_at(b, 0).ok_or_else(bad)? as usize;
        let ty = u16_at(b, 4).ok_or_else(bad)?;
        if len < NLMSG_HDR || len > b.len() {
            return Err(bad());
        }
        let msg = &b[NLMSG_HDR..len];
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let e = u32_at(msg, 0).ok_or_else(bad)? as i32;
                if e == 0 {
                    // An acknowledgement, not an error.
                } else {
                    return Err(io::Error::from_raw_os_error(e.wrapping_neg()));
                }
            }
            SOCK_DIAG_BY_FAMILY if msg.len() >= DIAG_MSG => {
                let inode = u64::from(u32_at(msg, DIAG_MSG_INODE).ok_or_else(bad)?);
                let mut attrs = &msg[DIAG_MSG..];
                while attrs.len() >= 4 {
                    let alen = usize::from(u16_at(attrs, 0).ok_or_else(bad)?);
                    let aty = u16_at(attrs, 2).ok_or_else(bad)?;
                    if alen < 4 || alen > attrs.len() {
                        return Err(bad());
                    }
                    if aty == INET_DIAG_INFO {
                        let info = &attrs[4..alen];
                        if let (Some(sent), Some(retrans), Some(received)) = (
                            u64_at(info, TCPI_BYTES_SENT),
                            u64_at(info, TCPI_BYTES_RETRANS),
                            u64_at(info, TCPI_BYTES_RECEIVED),
                        ) {
                            let sent = sent.saturating_sub(retrans);
                            out.insert(inode, TcpBytes { sent, received });
                        }
                    }
                    let step = (alen + 3) & !3;
                    attrs = &attrs[step.min(attrs.len())..];
                }
            }
            _ => {}
        }
        let step = (len + 3) & !3;
        b = &b[step.min(b.len())..];
    }
    Ok(false)
}

/// [`tcp_bytes`] in the network namespace of process `pid` (entered on a thread of its own;
/// needs CAP_SYS_ADMIN when it is not ours).
pub fn tcp_bytes_of(pid: u32) -> io::Result<HashMap<u64, TcpBytes>> {
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/net"))?;
    let ours = std::fs::metadata("/proc/thread-self/ns/net")?;
    use std::os::unix::fs::MetadataExt;
    if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
        return tcp_bytes();
    }
    let path = format!("/proc/{pid}/ns/net");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(path)?;
        // SAFETY: entering a network namespace on this (short-lived) thread only.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        tcp_bytes()
    })
    .join()
    .map_err(|_| io::Error::other("sock_diag thread panicked"))?
}

/// The user owning the socket at the other end of a TCP connection on this host (in our
/// network namespace) from `local` to `peer`: the socket whose local address is `peer` and
/// remote address `local`, from /proc/net/tcp (or tcp6). `None` when it is not here.
pub fn peer_uid(local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<u32> {
    let (file, lw, pw) = match (local, peer) {
        (std::net::SocketAddr::V4(l), std::net::SocketAddr::V4(p)) => {
            ("/proc/net/tcp", hex_v4(l), hex_v4(p))
        }
        (l, p) => ("/proc/net/tcp6", hex_v6(l), hex_v6(p)),
    };
    let text = std::fs::read_to_string(file).ok()?;
    peer_uid_in(&text, &pw, &lw)
}

/// `/proc/net/tcp`'s spelling of an IPv4 address and port: the address as a host-order word.
fn hex_v4(a: std::net::SocketAddrV4) -> String {
    format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(a.ip().octets()),
        a.port()
    )
}

/// `/proc/net/tcp6`'s: four host-order words (an IPv4 peer of an IPv6 socket is v4-mapped).
fn hex_v6(a: std::net::SocketAddr) -> String {
    let ip = match a {
        std::net::SocketAddr::V4(v4) => v4.ip().to_ipv6_mapped(),
        std::net::SocketAddr::V6(v6) => *v6.ip(),
    };
    let o = ip.octets();
    let mut s = String::new();
    for w in o.chunks(4) {
        s += &format!("{:08X}", u32::from_ne_bytes(w.try_into().expect("4 bytes")));
    }
    format!("{s}:{:04X}", a.port())
}

/// The uid of the line whose local address is `local` and remote address `remote`.
fn peer_uid_in(text: &str, local: &str, remote: &str) -> Option<u32> {
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 7 && f[1] == local && f[2] == remote)
            .then(|| f[7].parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::MetadataExt;

    fn inode(s: &std::net::TcpStream) -> u64 {
        let fd = s.as_raw_fd();
        std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .map(|m| m.ino())
            .unwrap()
    }

    #[test]
    fn kernel_byte_counts_by_inode() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        c.write_all(&[7u8; 1000]).unwrap();
        let mut b = [0u8; 1000];
        s.read_exact(&mut b).unwrap();
        s.write_all(&[1u8; 10]).unwrap();
        c.read_exact(&mut b[..10]).unwrap();
        let m = tcp_bytes().unwrap();
        let got = (m[&inode(&c)], m[&inode(&s)]);
        assert_eq!(
            got,
            (
                TcpBytes {
                    sent: 1000,
                    received: 10
                },
                TcpBytes {
                    sent: 10,
                    received: 1000
                }
            )
        );
        assert_eq!(tcp_bytes_of(std::process::id()).unwrap()[&inode(&c)], got.0);
    }

    #[test]
    fn the_other_end_of_a_local_connection_has_our_uid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let (cl, sl) = (c.local_addr().unwrap(), s.local_addr().unwrap());
        assert_eq!(
            peer_uid(cl, sl),
            Some(me),
            "the server's socket, seen from the client"
        );
        assert_eq!(
            peer_uid(sl, cl),
            Some(me),
            "the client's socket, seen from the server"
        );
        let gone: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(peer_uid(cl, gone), None);
        // Parsing: a line of /proc/net/tcp with uid 101.
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000   101        0 12345 1";
        assert_eq!(
            peer_uid_in(text, "0100007F:1F90", "0100007F:A1B2"),
            Some(101)
        );
        assert_eq!(peer_uid_in("garbage", "a", "b"), None);
    }

    #[test]
    fn malformed_dumps_are_errors_not_panics() {
        let mut out = HashMap::new();
        assert!(!parse(&[0u8; 3], &mut out).unwrap());
        let mut m = vec![0u8; 20];
        m[0..4].copy_from_slice(&200u32.to_ne_bytes()); // longer than the datagram
        assert!(parse(&m, &mut out).is_err());
        let mut m = vec![0u8; NLMSG_HDR + DIAG_MSG + 4];
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m[NLMSG_HDR + DIAG_MSG..][..2].copy_from_slice(&2u16.to_ne_bytes()); // attr len < 4
        assert!(parse(&m, &mut out).is_err());
        for n in 0..m.len() {
            let _ = parse(&m[..n], &mut out);
        }
    }
}

const UDIAG_SHOW_PEER: u32 = 4;
const UNIX_DIAG_PEER: u16 = 2;

/// The inode of the socket at the other end of the Unix socket with inode `ino` (sock_diag,
/// as `ss -x` reads it): for a socketpair, whose `SO_PEERCRED` names its maker on both ends,
/// this is how the holder of the other end is found. `None` without netlink (a sandbox's
/// `RestrictAddressFamilies=`) or without a peer.
pub fn unix_peer_inode(ino: u64) -> Option<u64> {
    let ino = u32::try_from(ino).ok()?;
    // SAFETY: creating a netlink socket; checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: a descriptor we just created.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct unix_diag_req: family, protocol, pad, states, ino, show, cookie[2].
    let mut req = [0u8; NLMSG_HDR + 24];
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let body = &mut req[NLMSG_HDR..];
    body[0] = libc::AF_UNIX as u8;
    body[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
    body[8..12].copy_from_slice(&ino.to_ne_bytes());
    body[12..16].copy_from_slice(&UDIAG_SHOW_PEER.to_ne_bytes());
    body[16..24].copy_from_slice(&[0xff; 8]);
    // SAFETY: sending our buffer on our socket.
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return None;
    }
    let mut buf = [0u8; 4096];
    // SAFETY: receiving into our buffer.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n <= 0 {
        return None;
    }
    parse_unix_peer(&buf[..n as usize], ino)
}

/// The peer inode in a sock_diag answer about Unix socket `ino`. Malformed input is `None`,
/// never a panic.
pub fn parse_unix_peer(b: &[u8], ino: u32) -> Option<u64> {
    let len = u32_at(b, 0)? as usize;
    if u16_at(b, 4)? != SOCK_DIAG_BY_FAMILY || len < NLMSG_HDR || len > b.len() {
        return None;
    }
    // struct unix_diag_msg: family, type, state, pad, ino, cookie[2] (16 bytes), then
    // attributes.
    let msg = &b[NLMSG_HDR..len];
    if u32_at(msg, 4)? != ino {
        return None;
    }
    let mut a = msg.get(16..)?;
    while a.len() >= 4 {
        let alen = u16_at(a, 0)? as usize;
        let ty = u16_at(a, 2)?;
        if alen < 4 || alen > a.len() {
            return None;
        }
        if ty == UNIX_DIAG_PEER {
            return u32_at(a, 4).map(u64::from);
        }
        // The padding to 4 may reach past a last attribute that ends the message.
        a = a.get((alen + 3) & !3..).unwrap_or_default();
    }
    None
}

#[cfg(test)]
mod unix_tests {
    use super::*;

    /// A reply whose last attribute is not padded to 4 (it ends the message) is read without
    /// a panic; any cut of a reply gives `None` or the peer, never a panic.
    #[test]
    fn unpadded_or_cut_replies() {
        let ino = 77u32;
        let mut msg = vec![0u8; 16];
        msg[4..8].copy_from_slice(&ino.to_ne_bytes());
        // An attribute of 5 bytes (type 9), unpadded, then nothing.
        msg.extend_from_slice(&5u16.to_ne_bytes());
        msg.extend_from_slice(&9u16.to_ne_bytes());
        msg.push(1);
        let reply = |msg: &[u8]| {
            let mut b = Vec::new();
            b.extend_from_slice(&((NLMSG_HDR + msg.len()) as u32).to_ne_bytes());
            b.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
            b.resize(NLMSG_HDR, 0);
            b.extend_from_slice(msg);
            b
        };
        assert_eq!(parse_unix_peer(&reply(&msg), ino), None);
        // With a peer attribute first.
        let mut with_peer = msg[..16].to_vec();
        with_peer.extend_from_slice(&8u16.to_ne_bytes());
        with_peer.extend_from_slice(&UNIX_DIAG_PEER.to_ne_bytes());
        with_peer.extend_from_slice(&4242u32.to_ne_bytes());
        with_peer.extend_from_slice(&msg[16..]);
        let full = reply(&with_peer);
        assert_eq!(parse_unix_peer(&full, ino), Some(4242));
        for cut in 0..full.len() {
            let _ = parse_unix_peer(&full[..cut], ino);
        }
    }

    #[test]
    fn a_socketpairs_peer_is_the_other_end() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let ino = |s: &std::os::unix::net::UnixStream| {
            use std::os::unix::fs::MetadataExt;
            // SAFETY: fstat of our socket via /proc is not needed: a File view of the fd.
            std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd()))
                .unwrap()
                .ino()
        };
        assert_eq!(unix_peer_inode(ino(&a)), Some(ino(&b)));
        assert_eq!(unix_peer_inode(ino(&b)), Some(ino(&a)));
    }

    #[test]
    fn malformed_answers_are_none() {
        assert_eq!(parse_unix_peer(&[], 1), None);
        assert_eq!(parse_unix_peer(&[0xff; 40], 1), None);
        let mut m = vec![0u8; NLMSG_HDR + 16 + 8];
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&7u32.to_ne_bytes());
        let at = NLMSG_HDR + 16;
        m[at..at + 2].copy_from_slice(&8u16.to_ne_bytes());
        m[at + 2..at + 4].copy_from_slice(&UNIX_DIAG_PEER.to_ne_bytes());
        m[at + 4..at + 8].copy_from_slice(&99u32.to_ne_bytes());
        assert_eq!(parse_unix_peer(&m, 7), Some(99));
        assert_eq!(parse_unix_peer(&m, 8), None, "another socket's answer");
        // An attribute length running past the end.
        m[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert_eq!(parse_unix_peer(&m, 7), None);
    }
}
