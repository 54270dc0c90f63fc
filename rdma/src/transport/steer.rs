//! Many engines on one address: QPN ranges, a UDP port per range, and the kernel program that
//! steers RoCE packets to them (docs/rdma.md, *Sharing the RoCE port*).
//!
//! Linux peers send every RoCE v2 packet to UDP port 4791, and only one socket of one user can
//! own that port on an address. So each device claims a *range* `r` of queue pair numbers
//! (QPN = `r << 12 | i`, 4095 QPs a device) by binding its own UDP port `STEER_BASE + r`: the
//! kernel keeps ports unique per address and network namespace, and an exiting process gives
//! its range back. A root-installed tc ingress program (smcr's `steer` module) rewrites the
//! destination port of a RoCE datagram addressed to 4791 to `STEER_BASE + (dest QPN >> 12)`, so
//! the packet lands on the socket of the process that owns the QP. A process can only receive
//! packets of a range whose port it bound; nobody can steer another user's traffic to itself.
//!
//! Ranges below [`FIRST_RANGE`] are never steered: a Linux rxe device on this host allocates
//! its QPNs below `1 << 20` and keeps receiving them on 4791.
//!
//! When nothing steers (the program is not attached), a device binds 4791 itself as before
//! ([`PortMode::Owner`]), or, when another process holds 4791, opens anyway with its private
//! port only ([`PortMode::LocalOnly`]): same-host peers reach it through shared memory, remote
//! ones cannot.

use super::sys;
use super::udp::{UdpOptions, UdpSocket};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// The RoCE v2 UDP port, where Linux sends every RoCE packet.
pub const ROCE_PORT: u16 = crate::wire::ROCE_V2_PORT;
/// A QPN is `range << RANGE_SHIFT | index` (24 bits: 12 of range, 12 of index).
pub const RANGE_SHIFT: u32 = 12;
/// The port of range `r` is `STEER_BASE + r` (57345..=61439: above the ports services listen
/// on; inside Linux's default ephemeral range, where a busy port only moves us to another
/// range).
pub const STEER_BASE: u16 = 57344;
/// The first range a device claims and the program steers: QPNs below `FIRST_RANGE << 12`
/// (`0x101000`) reach 4791 untouched, so a Linux rxe device on the same address (its QPNs are
/// below `1 << 20`) keeps working beside us.
pub const FIRST_RANGE: u32 = 0x101;
/// The last range (`0xFFF`: 24-bit QPNs).
pub const LAST_RANGE: u32 = 0xFFF;
/// The index of a range reserved for the steering probe; never a QP.
pub const PROBE_INDEX: u32 = 0xFFF;
/// How long a device waits for its probe to come back steered.
pub const PROBE_WAIT: Duration = Duration::from_millis(50);

/// The range of a QPN.
pub fn range_of(qpn: u32) -> u32 {
    (qpn & 0xFF_FFFF) >> RANGE_SHIFT
}

/// The QPN of index `index` in range `range`.
pub fn qpn_of(range: u32, index: u32) -> u32 {
    (range & LAST_RANGE) << RANGE_SHIFT | (index & 0xFFF)
}

/// The UDP port of range `range`.
pub fn port_of_range(range: u32) -> u16 {
    STEER_BASE + (range & LAST_RANGE) as u16
}

/// Where the steering program sends a RoCE datagram for `dest_qpn` that was addressed to
/// [`ROCE_PORT`]: the range's port, or `None` (left on 4791) below [`FIRST_RANGE`]. The
/// reference the kernel program is tested against.
pub fn steered_port(dest_qpn: u32) -> Option<u16> {
    let r = range_of(dest_qpn);
    (FIRST_RANGE..=LAST_RANGE)
        .contains(&r)
        .then(|| port_of_range(r))
}

/// How a device receives its packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortMode {
    /// Peers send to the RoCE port (4791); the steering program moves our range's packets to
    /// our own port. Any number of processes share the address.
    Steered,
    /// Nothing steers, and the device owns the RoCE port on its address (one such process per
    /// address). It also keeps its range's port, so packets steered later still reach it.
    Owner,
    /// Nothing steers and another process owns the RoCE port: the device has its private port
    /// only. Peers on this host reach it through shared memory (or by its private port when
    /// they are told it); peers elsewhere, which always send to 4791, cannot.
    LocalOnly,
    /// The configuration named a port other than the RoCE port (or turned steering off): the
    /// device is bound there, and its peers must be told the port.
    Fixed,
    /// Not our engine: a verbs device (an RNIC or the kernel's soft-RoCE) receives.
    Verbs,
}

impl PortMode {
    /// Whether peers on other hosts (which send to the RoCE port) reach the device.
    pub fn reaches_remote(self) -> bool {
        self != Self::LocalOnly
    }

    /// A short name (`steered`, `owner`, `local-only`, `fixed`, `verbs`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Steered => "steered",
            Self::Owner => "owner",
            Self::LocalOnly => "local-only",
            Self::Fixed => "fixed",
            Self::Verbs => "verbs",
        }
    }
}

/// What [`claim`] got: the sockets and the range of a device.
pub(crate) struct Claim {
    pub(crate) mode: PortMode,
    pub(crate) range: u32,
    /// Sends and receives; on the main address.
    pub(crate) main: UdpSocket,
    /// One per further address, on the main socket's port (they send too).
    pub(crate) alt: Vec<(Ipv4Addr, UdpSocket)>,
    /// Owner mode: the range's port on every address, for packets steered to us later
    /// (receive only).
    pub(crate) spare: Vec<(Ipv4Addr, UdpSocket)>,
    /// The same-host rendezvous of the range, when it could be bound.
    pub(crate) rendezvous: Option<OwnedFd>,
    /// The port peers send to (`local_addr().port()`).
    pub(crate) advertised: u16,
    /// The destination port a peer's packets carried when the ICRC was computed: the RoCE
    /// port for a device that shares it, the bound port for a [`PortMode::Fixed`] one.
    pub(crate) addressed: u16,
}

fn in_use(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EADDRINUSE)
}

/// Binds `port` on `ip` and every further address: all or nothing.
fn bind_all(
    ip: Ipv4Addr,
    extra: &[Ipv4Addr],
    port: u16,
    o: UdpOptions,
) -> io::Result<(UdpSocket, Vec<(Ipv4Addr, UdpSocket)>)> {
    let main = UdpSocket::bind(SocketAddrV4::new(ip, port), o)?;
    let port = main.local_addr().port();
    let alt = extra
        .iter()
        .filter(|&&a| a != ip)
        .map(|&a| Ok((a, UdpSocket::bind(SocketAddrV4::new(a, port), o)?)))
        .collect::<io::Result<Vec<_>>>()?;
    Ok((main, alt))
}

/// A random number (not security relevant: a starting point).
pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), libc::GRND_NONBLOCK) };
    if n == 4 {
        return u32::from_ne_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut x = t.subsec_nanos() ^ (t.as_secs() as u32).rotate_left(16) ^ std::process::id();
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    x
}

/// The ranges in the order a device tries them: all of them, from a random one.
fn ranges_from(start: u32) -> impl Iterator<Item = u32> {
    let n = LAST_RANGE - FIRST_RANGE + 1;
    (0..n).map(move |k| FIRST_RANGE + (start % n + k) % n)
}

/// Claims a range and binds the device's sockets (see the module documentation). `steer`:
/// share the RoCE port (`addr`'s port is [`ROCE_PORT`] and the configuration allows it).
/// `listen` binds the range's same-host rendezvous (the device passes the same-host
/// transport's; EADDRINUSE: another device has the range).
pub(crate) fn claim(
    addr: SocketAddrV4,
    extra: &[Ipv4Addr],
    o: UdpOptions,
    steer: bool,
    listen: impl Fn(Ipv4Addr, u32) -> io::Result<OwnedFd>,
) -> io::Result<Claim> {
    let ip = *addr.ip();
    if !steer {
        // The port as configured; a range whose rendezvous name is free (the claim among
        // devices that do not bind range ports).
        let (main, alt) = bind_all(ip, extra, addr.port(), o)?;
        let mut range = FIRST_RANGE + random_u32() % (LAST_RANGE - FIRST_RANGE + 1);
        let mut rendezvous = None;
        for r in ranges_from(range) {
            match listen(ip, r) {
                Ok(fd) => {
                    (range, rendezvous) = (r, Some(fd));
                    break;
                }
                Err(e) if in_use(&e) => continue,
                Err(_) => break, // no rendezvous: same-host peers use UDP
            }
        }
        let port = main.local_addr().port();
        return Ok(Claim {
            mode: if port == ROCE_PORT {
                PortMode::Owner
            } else {
                PortMode::Fixed
            },
            range,
            main,
            alt,
            spare: Vec::new(),
            rendezvous,
            advertised: port,
            addressed: port,
        });
    }
    // The claim is the bind of the range's port (on every address), then of its rendezvous.
    let mut got = None;
    for r in ranges_from(random_u32()) {
        let (main, alt) = match bind_all(ip, extra, port_of_range(r), o) {
            Ok(s) => s,
            Err(e) if in_use(&e) => continue,
            Err(e) => return Err(e),
        };
        match listen(ip, r) {
            Ok(fd) => {
                got = Some((r, main, alt, Some(fd)));
                break;
            }
            Err(e) if in_use(&e) => continue,
            Err(_) => {
                got = Some((r, main, alt, None));
                break;
            }
        }
    }
    let Some((range, main, alt, rendezvous)) = got else {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "every QPN range's port ({}..={}) on {ip} is taken",
                port_of_range(FIRST_RANGE),
                port_of_range(LAST_RANGE)
            ),
        ));
    };
    let mut c = Claim {
        mode: PortMode::Steered,
        range,
        main,
        alt,
        spare: Vec::new(),
        rendezvous,
        advertised: ROCE_PORT,
        addressed: ROCE_PORT,
    };
    if probe(ip, &c.main, range).unwrap_or(false) {
        return Ok(c);
    }
    // Nothing steers: own the RoCE port as before, keeping the range's sockets for packets
    // steered to us once the program is attached; or, when another process has it, go on with
    // the private port (same-host peers only).
    match bind_all(ip, extra, ROCE_PORT, o) {
        Ok((main, alt)) => {
            let range_main = std::mem::replace(&mut c.main, main);
            let range_alt = std::mem::replace(&mut c.alt, alt);
            c.spare = std::iter::once((ip, range_main)).chain(range_alt).collect();
            c.mode = PortMode::Owner;
        }
        Err(e)
            if !extra.is_empty()
                && UdpSocket::bind(SocketAddrV4::new(ip, ROCE_PORT), o).is_ok() =>
        {
            // 4791 is ours on the main address but not on a further one: fail as before, so
            // that the caller opens the device without that path rather than local-only.
            return Err(io::Error::new(
                e.kind(),
                format!("RoCE port {ROCE_PORT} of a further address: {e}"),
            ));
        }
        Err(_) => {
            c.mode = PortMode::LocalOnly;
            c.advertised = c.main.local_addr().port();
        }
    }
    Ok(c)
}

/// The probe's payload marker (after the BTH).
const PROBE_MAGIC: &[u8; 8] = b"SMCRPRB1";
/// BTH, marker, nonce, a zero ICRC.
const PROBE_LEN: usize = 12 + 8 + 8 + 4;

/// A probe datagram for range `range` carrying `nonce`.
pub(crate) fn probe_packet(range: u32, nonce: u64) -> [u8; PROBE_LEN] {
    let mut p = [0u8; PROBE_LEN];
    p[0] = 0x04; // RC SEND only
    p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
    p[4..8].copy_from_slice(&qpn_of(range, PROBE_INDEX).to_be_bytes());
    p[12..20].copy_from_slice(PROBE_MAGIC);
    p[20..28].copy_from_slice(&nonce.to_le_bytes());
    p
}

/// Whether `bytes` is a steering probe (of any device): the engine drops these silently.
pub(crate) fn is_probe(bytes: &[u8]) -> bool {
    bytes.len() == PROBE_LEN
        && &bytes[12..20] == PROBE_MAGIC
        && u32::from_be_bytes([0, bytes[5], bytes[6], bytes[7]]) & 0xFFF == PROBE_INDEX
}

/// Sends a probe for `range` to (`ip`, 4791) and waits up to [`PROBE_WAIT`] for it on `sock`
/// (the range's socket): `true` if it came, steered. It is sent from a socket of its own with
/// `IP_RECVERR`, so that "nobody listens on 4791" (ICMP port unreachable) ends the wait at
/// once; when another process owns 4791 the wait runs out.
fn probe(ip: Ipv4Addr, sock: &UdpSocket, range: u32) -> io::Result<bool> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
    // Out of the application's descriptor numbers, as every descriptor of ours (it lives up
    // to PROBE_WAIT).
    let tx = crate::fdzone::place(rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)?;
    sys::setsockopt_int(tx.as_raw_fd(), libc::IPPROTO_IP, libc::IP_RECVERR, 1)?;
    let nonce = u64::from(random_u32()) << 32 | u64::from(random_u32());
    let pkt = probe_packet(range, nonce);
    let dst = std::net::SocketAddr::V4(SocketAddrV4::new(ip, ROCE_PORT));
    rustix::net::sendto(&tx, &pkt, SendFlags::NOSIGNAL, &dst)?;
    let deadline = Instant::now() + PROBE_WAIT;
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let ts = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: left.as_nanos() as i64,
        };
        let mut fds = [
            rustix::event::PollFd::new(sock.fd(), rustix::event::PollFlags::IN),
            rustix::event::PollFd::new(&tx, rustix::event::PollFlags::empty()),
        ];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        if fds[0].revents().contains(rustix::event::PollFlags::IN) {
            // Drain: anything else here is stale traffic for the range's previous owner.
            while let Ok((n, _)) = rustix::net::recv(sock.fd(), &mut buf, RecvFlags::DONTWAIT) {
                if n == PROBE_LEN && buf[..n] == pkt {
                    return Ok(true);
                }
            }
        }
        if fds[1].revents().contains(rustix::event::PollFlags::ERR) {
            return Ok(false); // port unreachable: 4791 is nobody's, nothing steered
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qpn_range_arithmetic() {
        assert_eq!(qpn_of(0x101, 0), 0x101000);
        assert_eq!(qpn_of(0xFFF, 0xFFE), 0xFFFFFE);
        assert_eq!(range_of(0x123456), 0x123);
        assert_eq!(range_of(qpn_of(0x345, 0x678)), 0x345);
        assert_eq!(range_of(0xFF_123456), 0x123, "24-bit QPNs");
        assert_eq!(port_of_range(FIRST_RANGE), 57601);
        assert_eq!(port_of_range(LAST_RANGE), 61439);
        // Every range's port is above 57344 and below 61440.
        for r in FIRST_RANGE..=LAST_RANGE {
            let p = port_of_range(r);
            assert!((STEER_BASE + 1..=61439).contains(&p));
            assert_eq!(steered_port(qpn_of(r, 7)), Some(p));
            assert_eq!(steered_port(qpn_of(r, PROBE_INDEX)), Some(p));
        }
        // Below the first range (QPN 0, 1 and a kernel rxe's QPNs): untouched.
        for q in [0, 1, 0x11, 0x1_0000, 0xF_FFFF, 0x10_0000, 0x10_0FFF] {
            assert_eq!(steered_port(q), None, "{q:#x}");
        }
        assert_eq!(steered_port(0x10_1000), Some(57601));
    }

    #[test]
    fn ranges_cover_everything_once_from_any_start() {
        for start in [0, 1, 7, 0xFFF, u32::MAX] {
            let mut v: Vec<u32> = ranges_from(start).collect();
            assert_eq!(v.len() as u32, LAST_RANGE - FIRST_RANGE + 1);
            v.sort_unstable();
            v.dedup();
            assert_eq!(v.len() as u32, LAST_RANGE - FIRST_RANGE + 1);
            assert_eq!(v[0], FIRST_RANGE);
            assert_eq!(*v.last().unwrap(), LAST_RANGE);
        }
    }

    #[test]
    fn probes_are_recognised() {
        let p = probe_packet(0x2AB, 0x1122_3344_5566_7788);
        assert!(is_probe(&p));
        assert_eq!(
            u32::from_be_bytes([0, p[5], p[6], p[7]]),
            qpn_of(0x2AB, PROBE_INDEX)
        );
        let mut q = p;
        q[12] ^= 1;
        assert!(!is_probe(&q));
        assert!(!is_probe(&p[..PROBE_LEN - 4]));
    }
}
