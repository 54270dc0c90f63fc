//! A connect whose server answered our CLC Proposal with bytes that are not CLC, or closed at
//! it: the program reading the server's end had no record of the connection (a listener that
//! offered SMC-R before it went to a program without smcr: the connection that triggers
//! `systemd-socket-activate`; a server that lost its state). Nothing of the program's reached
//! the server — its writes are staged until the connection is settled — so the connection is
//! made again, unmarked (plain TCP: no option, no CLC), and put at the program's numbers in
//! place of the first one ([`plain_again`]). The server's program saw one connection carrying
//! our Proposal, then the real one.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use smcr::{FallbackReason, Runtime, SmcStream};

use crate::fds::{borrowed, is_nonblocking, storage_of};
use crate::sock::{Settling, Sock};
use crate::{real, table};

/// How long the new connection may take.
const CONNECT_WAIT_MS: i32 = 10_000;

/// The new, plain connection at every number showing `s` (its stats row recorded, NOTCLC),
/// when `e` says the server did not speak CLC and the connection could be made again; our
/// descriptor of it, to send what was staged.
pub(super) fn plain_again(
    fd: i32,
    s: &Arc<Settling>,
    rt: &Runtime,
    (local, peer): (Option<SocketAddr>, Option<SocketAddr>),
    e: &std::io::Error,
) -> Option<OwnedFd> {
    let gave_up = matches!(e.raw_os_error(), Some(libc::ECONNRESET | libc::EPIPE))
        || e.kind() == std::io::ErrorKind::ConnectionReset;
    if !(smcr::not_clc(e) || gave_up) {
        return None;
    }
    let peer = peer?;
    let numbers = table::numbers_with_pair(&s.pair);
    let first = *numbers.first()?;
    // Made like the program's socket: our duplicate of it while the numbers show the pair.
    let shown = s.shown_socket();
    let like = shown.as_ref().map_or(first, |d| d.as_raw_fd());
    let new = connect_plain(like, local, peer).ok()?;
    {
        // The numbers get the new connection: the old socket is not shown again, nor the pair.
        let mut st = s.st.lock();
        st.shown = None;
        st.replaced = true;
    }
    if is_nonblocking(first) {
        // SAFETY: setting a file status flag of our own socket.
        unsafe {
            libc::fcntl(
                new.as_raw_fd(),
                libc::F_SETFL,
                libc::O_NONBLOCK | libc::O_RDWR,
            )
        };
    }
    let mine = |n: i32| {
        table::get_any(n).is_some_and(|x| matches!(&*x, Sock::Pending(p) if Arc::ptr_eq(p, s)))
    };
    for &n in &numbers {
        let flags = if table::app_cloexec(n) {
            libc::O_CLOEXEC
        } else {
            0
        };
        if crate::epoll::swap(n, new.as_raw_fd(), flags, || mine(n), || {}).is_err() {
            crate::log::line(format_args!(
                "fd {fd}: could not put the new connection at number {n}"
            ));
        }
    }
    SmcStream::record_local(rt, borrowed(first), false, FallbackReason::NotClc);
    Some(new)
}

/// A plain TCP connection to `peer` like the program's socket at `like` (its domain, the
/// options a client sets before connecting, its local address), unmarked.
fn connect_plain(
    like: i32,
    local: Option<SocketAddr>,
    peer: SocketAddr,
) -> std::io::Result<OwnedFd> {
    let int = |fd: i32, level: i32, name: i32| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading an int option into an int.
        let r = unsafe { real::getsockopt()(fd, level, name, (&raw mut v).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    let domain = int(like, libc::SOL_SOCKET, libc::SO_DOMAIN).unwrap_or(libc::AF_INET);
    // SAFETY: a new socket; owned below.
    let raw = unsafe {
        real::socket()(
            domain,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::IPPROTO_TCP,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let new = crate::fds::hide_owned(raw)?;
    let mut opts = vec![
        (libc::IPPROTO_TCP, libc::TCP_NODELAY),
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
        (libc::SOL_SOCKET, libc::SO_PRIORITY),
    ];
    if domain == libc::AF_INET6 {
        opts.push((libc::IPPROTO_IPV6, libc::IPV6_V6ONLY));
    } else {
        opts.push((libc::IPPROTO_IP, libc::IP_TOS));
    }
    for (level, name) in opts {
        if let Some(v) = int(like, level, name) {
            // SAFETY: setting an int option from an int.
            unsafe {
                real::setsockopt()(
                    new.as_raw_fd(),
                    level,
                    name,
                    (&raw const v).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
    let addr = |a: SocketAddr| -> (libc::sockaddr_storage, libc::socklen_t) {
        let a = match (domain, a) {
            (libc::AF_INET6, SocketAddr::V4(v4)) => {
                SocketAddr::from((v4.ip().to_ipv6_mapped(), v4.port()))
            }
            _ => a,
        };
        storage_of(a)
    };
    if let Some(mut l) = local {
        l.set_port(0);
        let (ss, len) = addr(l);
        // SAFETY: binding our socket to a valid address of its family.
        unsafe { libc::bind(new.as_raw_fd(), (&raw const ss).cast(), len) };
    }
    let (ss, len) = addr(peer);
    // SAFETY: connecting our socket to a valid address of its family.
    let r = unsafe { real::connect()(new.as_raw_fd(), (&raw const ss).cast(), len) };
    if r != 0 && crate::guard::errno() != libc::EINPROGRESS {
        return Err(std::io::Error::last_os_error());
    }
    let mut p = libc::pollfd {
        fd: new.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: polling our socket.
    if unsafe { libc::poll(&mut p, 1, CONNECT_WAIT_MS) } != 1
        || int(new.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR) != Some(0)
    {
        return Err(std::io::Error::from(std::io::ErrorKind::TimedOut));
    }
    // Blocking again (the program's own flag is set by the caller).
    // SAFETY: clearing O_NONBLOCK on our socket.
    unsafe { libc::fcntl(new.as_raw_fd(), libc::F_SETFL, libc::O_RDWR) };
    Ok(new)
}
