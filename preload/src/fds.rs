//! Descriptor helpers: O_NONBLOCK, socket addresses, inodes, and our own duplicates kept out
//! of the application's numbers (`smcr::fdzone`).

use std::io;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use crate::real;

/// Whether `fd` is in non-blocking mode.
pub(crate) fn is_nonblocking(fd: i32) -> bool {
    // SAFETY: fcntl F_GETFL on any descriptor is harmless.
    let fl = unsafe { real::fcntl()(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Sets or clears O_NONBLOCK on `fd` (the application's flag on the file now at its number).
pub(crate) fn set_nonblocking(fd: i32, on: bool) {
    // SAFETY: reading and setting file status flags of a descriptor we hold.
    unsafe {
        let fl = real::fcntl()(fd, libc::F_GETFL, 0);
        if fl >= 0 {
            let fl = if on {
                fl | libc::O_NONBLOCK
            } else {
                fl & !libc::O_NONBLOCK
            };
            real::fcntl()(fd, libc::F_SETFL, fl as libc::c_ulong);
        }
    }
}

/// A socket's own address (IPv4, or IPv6 for a dual-stack socket).
pub(crate) fn sock_addr(fd: i32, peer: bool) -> Option<SocketAddr> {
    // SAFETY: an all-zero sockaddr_storage is valid; the kernel fills at most `len` bytes.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let f = if peer {
        real::getpeername()
    } else {
        real::getsockname()
    };
    // SAFETY: as above.
    let r = unsafe { f(fd, (&raw mut ss).cast(), &mut len) };
    (r == 0).then(|| sockaddr_of(&ss, len)).flatten()
}

/// A socket address from what the kernel filled.
pub(crate) fn sockaddr_of(ss: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: an AF_INET address of full length.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::from((
                std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: an AF_INET6 address of full length.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// `a` as a `sockaddr_storage` and its length, for bind/connect.
pub(crate) fn storage_of(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; the family's struct is written into it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

pub(crate) fn borrowed(fd: i32) -> BorrowedFd<'static> {
    // SAFETY: used only for the duration of a call while the application holds `fd` open.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Our own duplicate of a socket, out of the application's numbers (close-on-exec).
pub(crate) fn hide(fd: i32) -> io::Result<OwnedFd> {
    smcr::fdzone::place_copy(borrowed(fd))
}

/// [`hide`] for a new descriptor of ours: moved out of the application's range.
pub(crate) fn hide_owned(fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: `fd` is a new descriptor nothing else owns.
    smcr::fdzone::place(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The inode of the socket at `fd`.
pub(crate) fn inode(fd: i32) -> Option<u64> {
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}
