//! socket, connect, listen, accept and accept4: which sockets are ours, and how a connection
//! of ours begins (the work is the shim's).

use std::sync::Arc;

use libc::{c_int, sockaddr, socklen_t};

use crate::fds;
use crate::guard::{bypassed, errno, guarded, set_errno};
use crate::shim;
use crate::sock::Sock;
use crate::{real, table};

/// # Safety
/// libc's contract for socket(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let fd = unsafe { real::socket()(domain, ty, proto) };
    if fd >= 0
        && !bypassed()
        && shim::enabled()
        && (domain == libc::AF_INET || domain == libc::AF_INET6)
        && ty & 0xf == libc::SOCK_STREAM
        && (proto == 0 || proto == libc::IPPROTO_TCP)
    {
        // A new file: whatever was recorded for an earlier file at this number is void.
        crate::epoll::forget(fd);
        table::insert(fd, Arc::new(Sock::Inet));
    }
    fd
}

/// # Safety
/// libc's contract for connect(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // A blocking connect waits (and a handshake of ours may run here).
    smcr::cork::end();
    let s = if bypassed() { None } else { table::get(fd) };
    match s.as_deref() {
        Some(Sock::Inet) => {}
        // Asking again how a non-blocking connect went (hiredis, libcurl do): as TCP answers,
        // connected once the TCP handshake is done (SMC-R settles behind the application).
        Some(Sock::Pending(p)) => {
            set_errno(if p.tcp_connected() {
                libc::EISCONN
            } else {
                libc::EALREADY
            });
            return -1;
        }
        Some(Sock::Smc(_)) => {
            set_errno(libc::EISCONN);
            return -1;
        }
        // SAFETY: forwarding.
        _ => return unsafe { real::connect()(fd, addr, len) },
    }
    // SAFETY: the caller passes `len` valid bytes at `addr`.
    let dest = unsafe { sockaddr_in_any(addr, len) };
    let Some(dest) = dest else {
        // AF_UNSPEC (dissolving an association) or garbage: the kernel answers.
        // SAFETY: forwarding.
        return unsafe { real::connect()(fd, addr, len) };
    };
    if let Some(a) = smcr::v4_of(dest)
        && !shim::policy_allows(a)
    {
        guarded((), || shim::exclude(fd, "connect", a));
        // SAFETY: forwarding.
        return unsafe { real::connect()(fd, addr, len) };
    }
    guarded(-1, || {
        let plan = shim::plan_connect(fd, dest);
        // Until its entry is in: an accept of this process may get the connection first.
        let _flight = matches!(plan, shim::ConnectPlan::Smc { .. }).then(|| shim::connecting(dest));
        let nonblocking = fds::is_nonblocking(fd);
        // SAFETY: forwarding.
        let r = unsafe { real::connect()(fd, addr, len) };
        let e = errno();
        shim::debug_pause();
        let started = r == 0 || (nonblocking && e == libc::EINPROGRESS);
        let dup = match plan {
            shim::ConnectPlan::Tcp(reason) => {
                if started {
                    shim::plain_connect(fd, reason);
                } else {
                    shim::untrack(fd);
                }
                set_errno(e);
                return r;
            }
            shim::ConnectPlan::Smc { dup, marked } => (dup, marked),
        };
        let (dup, marked) = dup;
        if !nonblocking && r != 0 && (e == libc::EINTR || e == libc::EINPROGRESS) {
            // A blocking connect cut short (a signal, SO_SNDTIMEO): the kernel goes on
            // connecting, with our option in the SYN; settled in the background as a
            // non-blocking one would be. The application sees the kernel's answer.
            shim::connect_async(fd, dup, marked, false);
            set_errno(e);
            return r;
        }
        if !started {
            shim::untrack(fd);
            set_errno(e);
            return r;
        }
        if nonblocking {
            // Finish (TCP handshake, then SMC-R negotiation) on a worker; the application
            // waits for writability as for any non-blocking connect.
            shim::connect_async(fd, dup, marked, false);
            set_errno(libc::EINPROGRESS);
            return -1;
        }
        // Connected, as TCP says: the call returns now and SMC-R is negotiated on a worker
        // (writes are staged meanwhile, reads wait for it). The server's half of the
        // handshake runs once its program uses the connection — perhaps only after this
        // program makes another connection (a queue of connections for an iterative
        // server), or, for a listener of this very program, after this call returns.
        shim::connect_async(fd, dup, marked, true);
        0
    })
}

/// An IPv4 or IPv6 socket address from a sockaddr, if it is one.
///
/// # Safety
/// `addr` points to `len` readable bytes (or is null).
unsafe fn sockaddr_in_any(addr: *const sockaddr, len: socklen_t) -> Option<std::net::SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: an all-zero sockaddr_storage is valid; at most `len` bytes are copied in.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let n = (len as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: `addr` has `len` readable bytes (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), (&raw mut ss).cast::<u8>(), n) };
    fds::sockaddr_of(&ss, len)
}

/// # Safety
/// libc's contract for listen(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    if bypassed() || !table::get(fd).is_some_and(|s| matches!(*s, Sock::Inet)) {
        // Not ours, or listening again (a new backlog): the socket itself.
        // SAFETY: forwarding.
        return unsafe { real::listen()(fd, backlog) };
    }
    // SAFETY: an all-zero sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: asking the kernel for the bound address into a sockaddr_storage.
    let named = unsafe { real::getsockname()(fd, (&raw mut ss).cast(), &mut sl) } == 0;
    let bound = named.then(|| fds::sockaddr_of(&ss, sl)).flatten();
    // Which IPv4 address its peers reach it on: its own, or any for 0.0.0.0 and a dual-stack
    // [::]. A socket that cannot have IPv4 peers (IPv6-only, a native IPv6 address) stays TCP.
    let v4 = match bound {
        Some(a) => match smcr::v4_of(a) {
            Some(v4) => Some(v4),
            None if a.ip().is_unspecified() && !v6only(fd) => Some(std::net::SocketAddrV4::new(
                std::net::Ipv4Addr::UNSPECIFIED,
                a.port(),
            )),
            None => None,
        },
        None => None,
    };
    let Some(v4) = v4 else {
        shim::untrack(fd);
        // SAFETY: forwarding.
        return unsafe { real::listen()(fd, backlog) };
    };
    if !shim::policy_allows(v4) {
        guarded((), || shim::exclude(fd, "listen", v4));
        // SAFETY: forwarding.
        return unsafe { real::listen()(fd, backlog) };
    }
    guarded(-1, || {
        let marked = shim::mark(fd);
        // SAFETY: forwarding.
        let r = unsafe { real::listen()(fd, backlog) };
        if r != 0 || !marked {
            let e = errno();
            shim::untrack(fd);
            set_errno(e);
            return r;
        }
        shim::listening(fd);
        0
    })
}

/// Whether an IPv6 socket takes IPv6 peers only (IPV6_V6ONLY).
fn v6only(fd: c_int) -> bool {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: reading an int option into an int.
    let r = unsafe {
        real::getsockopt()(
            fd,
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&mut v as *mut c_int).cast(),
            &mut len,
        )
    };
    r != 0 || v != 0
}

fn accept_common(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // A blocking accept may wait: what this thread corked goes first.
    smcr::cork::end();
    let ours = !bypassed() && table::get(fd).is_some_and(|s| matches!(*s, Sock::Listener(_)));
    if !ours {
        // SAFETY: forwarding.
        return unsafe { real::accept4()(fd, addr, len, flags) };
    }
    guarded(-1, || shim::accept(fd, addr, len, flags))
}

/// # Safety
/// libc's contract for accept(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    accept_common(fd, addr, len, 0)
}

/// # Safety
/// libc's contract for accept4(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    accept_common(fd, addr, len, flags)
}
