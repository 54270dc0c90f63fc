//! The engine's UDP socket: GSO batches on send, GRO and recvmmsg batches on receive.

use super::sys;
use rustix::fd::{AsRawFd, OwnedFd};
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};

const SOL_UDP: i32 = 17;
const UDP_SEGMENT: i32 = 103;
const UDP_GRO: i32 = 104;
/// Most segments Linux accepts in one GSO send (`UDP_MAX_SEGMENTS`).
pub(crate) const MAX_GSO_SEGMENTS: usize = 64;
/// Largest UDP payload of one datagram (or GSO/GRO batch).
pub(crate) const MAX_DATAGRAM: usize = 65507;

/// Socket options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UdpOptions {
    pub(crate) rcvbuf: usize,
    pub(crate) sndbuf: usize,
    pub(crate) gro: bool,
    pub(crate) ttl: u8,
    /// Report each datagram's destination address (`IP_PKTINFO`): a socket bound to the
    /// wildcard address serves several local addresses.
    pub(crate) pktinfo: bool,
}

pub(crate) struct UdpSocket {
    fd: OwnedFd,
    local: SocketAddrV4,
    gro: bool,
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn from_sockaddr(s: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes()),
        u16::from_be(s.sin_port),
    )
}

impl UdpSocket {
    /// A blocking, close-on-exec UDP socket bound to `addr`, with DF set on every datagram
    /// (`IP_PMTUDISC_DO`) so that Linux sends identification 0, as the ICRC assumes.
    pub(crate) fn bind(addr: SocketAddrV4, o: UdpOptions) -> io::Result<Self> {
        let fd = crate::fdzone::place(rustix::net::socket_with(
            AddressFamily::INET,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )?)?;
        let raw = fd.as_raw_fd();
        sys::setsockopt_int(
            raw,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?;
        sys::setsockopt_int(raw, libc::IPPROTO_IP, libc::IP_TTL, i32::from(o.ttl.max(1)))?;
        for (force, plain, size) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, o.rcvbuf),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, o.sndbuf),
        ] {
            let size = size.min(i32::MAX as usize / 2) as i32;
            // FORCE needs CAP_NET_ADMIN; otherwise the kernel caps at net.core.[rw]mem_max.
            if sys::setsockopt_int(raw, libc::SOL_SOCKET, force, size).is_err() {
                sys::setsockopt_int(raw, libc::SOL_SOCKET, plain, size)?;
            }
        }
        let gro = o.gro && sys::setsockopt_int(raw, SOL_UDP, UDP_GRO, 1).is_ok();
        if o.pktinfo {
            sys::setsockopt_int(raw, libc::IPPROTO_IP, libc::IP_PKTINFO, 1)?;
        }
        rustix::net::bind(&fd, &std::net::SocketAddr::V4(addr))?;
        let Ok(std::net::SocketAddr::V4(local)) =
            std::net::SocketAddr::try_from(rustix::net::getsockname(&fd)?)
        else {
            return Err(io::ErrorKind::InvalidInput.into());
        };
        Ok(Self { fd, local, gro })
    }

    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Sends `buf` to `dst`; with `segment` set, as a GSO batch of `segment`-byte datagrams
    /// (the last may be shorter).
    pub(crate) fn send(
        &self,
        dst: SocketAddrV4,
        src: Option<Ipv4Addr>,
        buf: &[u8],
        segment: Option<u16>,
    ) -> io::Result<()> {
        let iov = [libc::iovec {
            iov_base: buf.as_ptr() as *mut _,
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at `buf`, alive for the call.
        unsafe { self.send_iov(dst, src, &iov, segment) }
    }

    /// Sends the concatenation of `iov` to `dst`, as a GSO batch of `segment`-byte datagrams
    /// when `segment` is set, from source address `src` when set (`IP_PKTINFO`, for a socket
    /// bound to the wildcard address).
    ///
    /// # Safety
    /// Every iovec must point at readable memory for the duration of the call.
    pub(crate) unsafe fn send_iov(
        &self,
        dst: SocketAddrV4,
        src: Option<Ipv4Addr>,
        iov: &[libc::iovec],
        segment: Option<u16>,
    ) -> io::Result<()> {
        let mut name = sockaddr(dst);
        let mut cmsg = [0u64; 8]; // 8-byte aligned control buffer: GSO (24) + pktinfo (32)
        let msg = header(&mut name, &mut cmsg, iov, segment, src);
        loop {
            // SAFETY: every pointer in `msg` refers to live locals or the caller's iovecs.
            match unsafe { sys::sendmsg(self.raw_fd(), &msg, libc::MSG_NOSIGNAL) } {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends several datagrams (or GSO batches) to `dst` in one `sendmmsg`: each entry of
    /// `batches` is the concatenation of its iovecs, as a GSO batch of that segment size
    /// when it has one. Returns how many entries failed.
    ///
    /// # Safety
    /// Every iovec must point at readable memory for the duration of the call.
    pub(crate) unsafe fn send_batches(
        &self,
        dst: SocketAddrV4,
        src: Option<Ipv4Addr>,
        batches: &[(&[libc::iovec], Option<u16>)],
    ) -> usize {
        const MAX: usize = 8;
        let n = batches.len().min(MAX);
        let mut names = [sockaddr(dst); MAX];
        let mut cmsgs = [[0u64; 8]; MAX];
        // SAFETY: zeroed mmsghdrs are valid empty headers.
        let mut msgs: [libc::mmsghdr; MAX] = unsafe { std::mem::zeroed() };
        for (i, ((iov, seg), (name, cmsg))) in batches[..n]
            .iter()
            .zip(names.iter_mut().zip(cmsgs.iter_mut()))
            .enumerate()
        {
            msgs[i].msg_hdr = header(name, cmsg, iov, *seg, src);
        }
        let mut failed = batches.len() - n;
        let mut at = 0;
        while at < n {
            // SAFETY: every header points at `names`, `cmsgs` and the caller's iovecs.
            match unsafe { sys::sendmmsg(self.raw_fd(), &mut msgs[at..n], libc::MSG_NOSIGNAL) } {
                Ok(0) => {
                    failed += n - at;
                    break;
                }
                Ok(k) => at += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    // The first of the rest failed: count it, go on with the others.
                    failed += 1;
                    at += 1;
                }
            }
        }
        failed
    }
}

/// A `msghdr` for `iov` to `name`, with a GSO segment size and a source address in `cmsg`
/// when given; it points at its arguments.
fn header(
    name: &mut libc::sockaddr_in,
    cmsg: &mut [u64; 8],
    iov: &[libc::iovec],
    segment: Option<u16>,
    src: Option<Ipv4Addr>,
) -> libc::msghdr {
    {
        let total: usize = iov.iter().map(|v| v.iov_len).sum();
        // SAFETY: zeroed msghdr is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = (name as *mut libc::sockaddr_in).cast();
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        msg.msg_iov = iov.as_ptr().cast_mut();
        msg.msg_iovlen = iov.len();
        if let Some(seg) = segment.filter(|&s| (s as usize) < total) {
            let bytes = cmsg.as_mut_ptr().cast::<u8>();
            // cmsghdr { len: usize, level: i32, type: i32 } followed by a u16.
            // SAFETY: the 32-byte buffer holds the 16-byte header and 2 data bytes.
            unsafe {
                (bytes as *mut usize).write(16 + 2);
                (bytes.add(8) as *mut i32).write(SOL_UDP);
                (bytes.add(12) as *mut i32).write(UDP_SEGMENT);
                (bytes.add(16) as *mut u16).write(seg);
            }
            msg.msg_control = bytes.cast();
            msg.msg_controllen = 24;
        }
        if let Some(src) = src {
            let at = msg.msg_controllen;
            // SAFETY: 32 bytes from `at` (0 or 24) fit the 64-byte buffer: a 16-byte header and
            // in_pktinfo { ifindex 0 (routing picks it), spec_dst = src, addr unused }.
            unsafe {
                let b = cmsg.as_mut_ptr().cast::<u8>().add(at);
                (b as *mut usize).write(16 + 12);
                (b.add(8) as *mut i32).write(libc::IPPROTO_IP);
                (b.add(12) as *mut i32).write(libc::IP_PKTINFO);
                (b.add(16) as *mut i32).write(0);
                (b.add(20) as *mut u32).write(u32::from_ne_bytes(src.octets()));
                (b.add(24) as *mut u32).write(0);
            }
            msg.msg_control = cmsg.as_mut_ptr().cast();
            msg.msg_controllen = at + 32;
        }
        msg
    }
}

/// Receive buffers for recvmmsg, reused across calls.
pub(crate) struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    names: Vec<libc::sockaddr_in>,
    iovs: Vec<libc::iovec>,
    cmsgs: Vec<[u64; 8]>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside point into the batch's own heap buffers.
unsafe impl Send for RecvBatch {}

/// One received datagram (possibly a GRO batch of equal-sized segments).
pub(crate) struct Datagram<'a> {
    pub(crate) from: SocketAddrV4,
    /// The address it was sent to (sockets with `pktinfo`).
    pub(crate) to: Option<Ipv4Addr>,
    pub(crate) data: &'a [u8],
    /// Segment size when GRO coalesced several datagrams.
    pub(crate) segment: Option<usize>,
}

impl RecvBatch {
    pub(crate) fn new(count: usize) -> Self {
        let mut b = Self {
            bufs: (0..count).map(|_| vec![0u8; MAX_DATAGRAM + 1]).collect(),
            // SAFETY: all-zero sockaddr_in / mmsghdr are valid values.
            names: vec![unsafe { std::mem::zeroed() }; count],
            iovs: Vec::with_capacity(count),
            cmsgs: vec![[0u64; 8]; count],
            hdrs: Vec::with_capacity(count),
        };
        for i in 0..count {
            b.iovs.push(libc::iovec {
                iov_base: b.bufs[i].as_mut_ptr().cast(),
                iov_len: b.bufs[i].len(),
            });
        }
        for i in 0..count {
            // SAFETY: zeroed is valid; pointers are filled in below and stay valid because the
            // vectors are never resized.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_name = (&mut b.names[i] as *mut libc::sockaddr_in).cast();
            h.msg_hdr.msg_iov = &mut b.iovs[i];
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_control = b.cmsgs[i].as_mut_ptr().cast();
            b.hdrs.push(h);
        }
        b
    }

    /// Receives up to the batch size without blocking; returns how many arrived.
    pub(crate) fn recv(&mut self, sock: &UdpSocket) -> io::Result<usize> {
        for h in &mut self.hdrs {
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
            h.msg_hdr.msg_controllen = 64;
            h.msg_len = 0;
        }
        loop {
            // SAFETY: headers point at our own live buffers.
            match unsafe { sys::recvmmsg(sock.raw_fd(), &mut self.hdrs, libc::MSG_DONTWAIT) } {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }

    /// The `i`-th datagram of the last `recv`.
    pub(crate) fn get(&self, i: usize, gro: bool) -> Datagram<'_> {
        let h = &self.hdrs[i];
        let len = (h.msg_len as usize).min(MAX_DATAGRAM);
        let mut segment = None;
        let mut to = None;
        if h.msg_hdr.msg_controllen >= 16 {
            let c = self.cmsgs[i].as_ptr().cast::<u8>();
            let mut at = 0usize;
            while at + 16 <= h.msg_hdr.msg_controllen {
                // SAFETY: within the 64-byte control buffer, as bounded by msg_controllen.
                let (clen, level, ty) = unsafe {
                    (
                        (c.add(at) as *const usize).read(),
                        (c.add(at + 8) as *const i32).read(),
                        (c.add(at + 12) as *const i32).read(),
                    )
                };
                if clen < 16 || at + clen > 64 {
                    break;
                }
                if level == libc::IPPROTO_IP && ty == libc::IP_PKTINFO && clen >= 28 {
                    // in_pktinfo { ifindex: i32, spec_dst: in_addr, addr: in_addr }: `addr` is
                    // the header's destination.
                    // SAFETY: the 12 data bytes are inside the cmsg just checked.
                    let a = unsafe { (c.add(at + 24) as *const u32).read_unaligned() };
                    to = Some(Ipv4Addr::from(a.to_ne_bytes()));
                }
                if gro && level == SOL_UDP && ty == UDP_GRO && clen >= 20 {
                    // SAFETY: the 4 data bytes are inside the cmsg just checked.
                    let s = unsafe { (c.add(at + 16) as *const i32).read() };
                    if s > 0 && (s as usize) < len {
                        segment = Some(s as usize);
                    }
                }
                at += (clen + 7) & !7;
            }
        }
        Datagram {
            from: from_sockaddr(&self.names[i]),
            to,
            data: &self.bufs[i][..len],
            segment,
        }
    }
}

impl UdpSocket {
    pub(crate) fn gro(&self) -> bool {
        self.gro
    }
}

/// The MTU of the interface that holds local address `src` (`SIOCGIFMTU` on an unbound
/// socket: no port is taken, which a connected socket's `IP_MTU` would do — for a moment, one
/// that a steered range may need), or `None` if it cannot be found.
pub(crate) fn interface_mtu(src: std::net::Ipv4Addr) -> Option<u32> {
    let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifs) } != 0 {
        return None;
    }
    let mut name = None;
    let mut at = ifs;
    while !at.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let ifa = unsafe { &*at };
        // SAFETY: an AF_INET address is a sockaddr_in.
        if !ifa.ifa_addr.is_null()
            && unsafe { (*ifa.ifa_addr).sa_family } == libc::AF_INET as libc::sa_family_t
        {
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            if u32::from_be(sin.sin_addr.s_addr) == u32::from(src) {
                // SAFETY: ifa_name is a NUL-terminated name.
                name = Some(unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_owned());
                break;
            }
        }
        at = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifs) };
    let name = name?;
    let bytes = name.as_bytes_with_nul();
    // SAFETY: a zeroed ifreq is valid; the name fits (checked) with its NUL.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if bytes.len() > req.ifr_name.len() {
        return None;
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: a plain socket, closed below; SIOCGIFMTU reads into `req`.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    let r = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    // SAFETY: our socket.
    unsafe { libc::close(fd) };
    // SAFETY: SIOCGIFMTU filled the union's MTU.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    (r == 0 && mtu > 0).then_some(mtu as u32)
}
