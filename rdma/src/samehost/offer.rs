//! The offer: what a QP tells its same-host peer (its QPN, its device's address) with its
//! arena, ring and doorbells, over the peer device's rendezvous (an abstract Unix socket);
//! binding that rendezvous, and who may use it.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

const OFFER_MAGIC: u64 = u64::from_le_bytes(*b"SMCRSHO1");
pub(crate) const OFFER_LEN: usize = 32;

/// What a QP tells its peer when it offers its shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The QP the offer is for (the peer's QPN).
    pub(crate) to_qpn: u32,
    /// The offering QP.
    pub(crate) from_qpn: u32,
    /// The offering device's address.
    pub(crate) from: SocketAddrV4,
}

impl Offer {
    pub(crate) fn emit(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..8].copy_from_slice(&OFFER_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..16].copy_from_slice(&self.to_qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.from_qpn.to_le_bytes());
        b[20..24].copy_from_slice(&self.from.ip().octets());
        b[24..26].copy_from_slice(&self.from.port().to_le_bytes());
        b
    }

    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        if b.len() != OFFER_LEN
            || b[..8] != OFFER_MAGIC.to_le_bytes()
            || b[8..12] != 1u32.to_le_bytes()
        {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let ip: [u8; 4] = b[20..24].try_into().expect("4 bytes");
        Some(Self {
            to_qpn: u32_at(12),
            from_qpn: u32_at(16),
            from: SocketAddrV4::new(ip.into(), u16::from_le_bytes([b[24], b[25]])),
        })
    }
}

/// The abstract Unix socket name of the device at `ip` whose QPNs are in `range` (per network
/// namespace): a peer finds it from our address and the QPN it sends to.
fn rendezvous_name(ip: Ipv4Addr, range: u32) -> String {
    format!("smcr-rdma/{ip}/{range:03x}")
}

fn rendezvous_addr(ip: Ipv4Addr, range: u32) -> rustix::net::SocketAddrUnix {
    rustix::net::SocketAddrUnix::new_abstract_name(rendezvous_name(ip, range).as_bytes())
        .expect("short name")
}

/// Binds the rendezvous socket of the device at `ip` with QPN range `range` (non-blocking
/// listener). EADDRINUSE: another device of this namespace has the range.
pub(crate) fn listen(ip: Ipv4Addr, range: u32) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = crate::fdzone::place(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)?;
    rustix::net::bind(&fd, &rendezvous_addr(ip, range))?;
    rustix::net::listen(&fd, 64)?;
    Ok(fd)
}

/// Whether the process at the other end of `conn` may share memory with us: the same user,
/// or root on either side. In a user namespace (systemd's `PrivateUsers=`, a container) an
/// unmapped peer shows as the overflow uid, which is no one user, and root counts only where
/// it is the host's root.
pub(crate) fn trusted(conn: BorrowedFd<'_>) -> bool {
    match rustix::net::sockopt::socket_peercred(conn) {
        Ok(c) => {
            let ns = crate::sandbox::UserNs::now();
            let (peer, me) = (c.uid.as_raw(), rustix::process::geteuid().as_raw());
            ns.names_one_user(peer) && (peer == me || ((peer == 0 || me == 0) && ns.root_is_real()))
        }
        Err(_) => false,
    }
}

/// Connects to the rendezvous of the device at `peer` that owns QPN `offer.to_qpn` (its QPN
/// range is `range`) and sends `offer` with our arena, our inbound ring's segment and our
/// doorbell. Returns the connection (kept open: closing it tells the peer we are gone), or
/// `None` when the peer is not reachable this way.
pub(crate) fn send_offer(
    peer: Ipv4Addr,
    range: u32,
    offer: &Offer,
    fds: [BorrowedFd<'_>; 4],
) -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .ok()
    .and_then(|fd| crate::fdzone::place(fd).ok())?;
    rustix::net::connect(&fd, &rendezvous_addr(peer, range)).ok()?;
    if !trusted(fd.as_fd()) {
        return None;
    }
    crate::shm::send_fds(fd.as_fd(), &fds, &offer.emit()).ok()?;
    Some(fd)
}
