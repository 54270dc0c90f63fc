//! The exported libc functions. Each one: not ours (one atomic load) or bypassed → libc;
//! ours → the shim, inside `guarded` (a panic becomes EIO, never a retry or an unwind).
// The exports are reached by the dynamic linker, not by Rust paths.
#![allow(unreachable_pub)]

use std::ffi::c_void;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use libc::{c_int, c_ulong, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};

use crate::guard::{bypassed, errno, errno_of, guarded, guarded_on, set_errno};
use crate::shim::{self, SmcFd, Sock};
use crate::{real, table};

/// The SMC-R connection at `fd`, unless the call must go to libc.
fn smc(fd: c_int) -> Option<Arc<Sock>> {
    if bypassed() {
        return None;
    }
    table::get(fd).filter(|s| matches!(**s, Sock::Smc(_) | Sock::Inherited))
}

/// What a read or write on `fd` goes to.
enum Target {
    /// libc (a socket not ours, or plain TCP).
    Real,
    /// An SMC-R connection (or one inherited from the parent: EIO).
    Smc(Arc<Sock>),
    /// A connection not settled yet: a write is staged there.
    Stage(Arc<shim::Settling>),
    /// Fails with this errno (EAGAIN while a non-blocking read's connection is settled).
    Err(c_int),
    /// A read returns 0 (reading was shut down before the connection settled).
    Eof,
}

/// What a call on `fd` does with a connection not settled yet.
#[derive(Clone, Copy)]
enum Op {
    /// A read (`dontwait`: MSG_DONTWAIT): waits for it to settle, or says EAGAIN.
    Read { dontwait: bool },
    /// A write: staged.
    Write,
    /// Waits for it to settle (shutdown, sendfile).
    Wait,
}

/// Where a call on `fd` goes. A connection not settled yet (an accepted one starts
/// negotiating in this process now) takes writes into its stage and makes reads wait (or say
/// EAGAIN), as a TCP connection with nothing received yet would.
fn target(fd: c_int, op: Op) -> Target {
    if bypassed() {
        return Target::Real;
    }
    for _ in 0..4 {
        let Some(s) = table::get(fd) else {
            return Target::Real;
        };
        match &*s {
            Sock::Smc(_) | Sock::Inherited => return Target::Smc(s),
            Sock::Accepted(a) | Sock::Pending(a) => {
                if let Some(settled) = a.outcome() {
                    // A number that copied the settling entry while it was installed (a dup
                    // racing it): it takes what the others got.
                    let _ = table::replace_if(fd, &s, settled);
                    continue;
                }
                if guarded(true, || a.start(fd)) {
                    continue;
                }
                match op {
                    Op::Write => return Target::Stage(a.clone()),
                    Op::Read { .. } if a.read_shut() => return Target::Eof,
                    Op::Read { dontwait } if dontwait || a.nonblock.load(Ordering::Relaxed) => {
                        return Target::Err(libc::EAGAIN);
                    }
                    Op::Read { .. } => {
                        // Nothing can arrive before it settles: SO_RCVTIMEO bounds the wait.
                        match timeo(fd, libc::SO_RCVTIMEO) {
                            Some(limit) => {
                                if !a.wait(limit) {
                                    return Target::Err(libc::EAGAIN);
                                }
                            }
                            None => while !a.wait(SETTLE_WAIT) {},
                        }
                    }
                    Op::Wait => while !a.wait(SETTLE_WAIT) {},
                }
            }
            Sock::Inet | Sock::Listener(_) => return Target::Real,
        }
    }
    Target::Err(libc::EAGAIN)
}

/// The socket's SO_RCVTIMEO or SO_SNDTIMEO (`name`), if set.
fn timeo(fd: c_int, name: c_int) -> Option<std::time::Duration> {
    // SAFETY: an all-zero timeval is valid; the kernel fills at most `len` bytes.
    let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
    // SAFETY: reading a timeval option of the application's socket.
    let r =
        unsafe { real::getsockopt()(fd, libc::SOL_SOCKET, name, (&raw mut tv).cast(), &mut len) };
    (r == 0 && (tv.tv_sec > 0 || tv.tv_usec > 0)).then(|| {
        std::time::Duration::from_secs(tv.tv_sec as u64)
            + std::time::Duration::from_micros(tv.tv_usec as u64)
    })
}

/// A write hook's dispatch: `bytes` (gathered only when staged), `smc` on an SMC-R
/// connection, `real` on anything else. A blocking write to a connection being settled takes
/// all of its bytes, as TCP's does: what the stage cannot hold goes once it is settled.
fn write_to(
    fd: c_int,
    flags: c_int,
    bytes: &dyn Fn() -> std::borrow::Cow<'static, [u8]>,
    smc: &dyn Fn(&Sock) -> ssize_t,
    real: &dyn Fn() -> ssize_t,
) -> ssize_t {
    // Bytes the stage took so far (a blocking write goes on with the rest).
    let mut staged = 0usize;
    let mut held: Option<std::borrow::Cow<'static, [u8]>> = None;
    loop {
        let t = target(fd, Op::Write);
        if staged > 0 {
            // The rest of a blocking write, after the connection settled.
            let rest = &held.as_deref().unwrap_or_default()[staged..];
            let more = match t {
                Target::Smc(s) => as_smc(&s).and_then(|c| c.send(rest, flags)).unwrap_or(0),
                Target::Real => real_send_all(fd, rest, flags),
                Target::Stage(a) => {
                    // The rest waits for the connection to settle (SO_SNDTIMEO bounds it:
                    // then the call returns what was taken, as TCP's does).
                    match timeo(fd, libc::SO_SNDTIMEO) {
                        Some(t) if !a.wait(t) => return staged as ssize_t,
                        Some(_) => {}
                        None => while !a.wait(SETTLE_WAIT) {},
                    }
                    continue;
                }
                Target::Err(_) | Target::Eof => 0,
            };
            return (staged + more) as ssize_t;
        }
        match t {
            Target::Real | Target::Eof => return real(),
            Target::Smc(s) => return smc(&s),
            Target::Err(e) => {
                set_errno(e);
                return -1;
            }
            Target::Stage(a) => {
                let b = held.get_or_insert_with(bytes);
                if b.is_empty() {
                    return 0;
                }
                // A blocking write waits for the connection to settle when the stage is full
                // (SO_SNDTIMEO bounds it, else as long as it takes).
                let wait = (flags & libc::MSG_DONTWAIT == 0 && !a.nonblock.load(Ordering::Relaxed))
                    .then(|| timeo(fd, libc::SO_SNDTIMEO).unwrap_or(std::time::Duration::MAX));
                match guarded(shim::Staged::WouldBlock, || a.stage(b, wait)) {
                    shim::Staged::Took(n) if wait.is_none() || n == b.len() => return n as ssize_t,
                    shim::Staged::Took(n) => staged = n,
                    shim::Staged::WouldBlock => {
                        set_errno(libc::EAGAIN);
                        return -1;
                    }
                    shim::Staged::Settled => {}
                    shim::Staged::Shut => {
                        if flags & libc::MSG_NOSIGNAL == 0 {
                            // SAFETY: raise has no preconditions (SIGPIPE, as TCP's write).
                            unsafe { libc::raise(libc::SIGPIPE) };
                        }
                        set_errno(libc::EPIPE);
                        return -1;
                    }
                }
            }
        }
    }
}

/// Sends all of `buf` on the (blocking) TCP socket `fd`; how much went.
fn real_send_all(fd: c_int, mut buf: &[u8], flags: c_int) -> usize {
    let mut sent = 0;
    while !buf.is_empty() {
        // SAFETY: sending from the caller's bytes on its socket.
        let n = unsafe { real::send()(fd, buf.as_ptr().cast(), buf.len(), flags) };
        if n <= 0 {
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            break;
        }
        sent += n as usize;
        buf = &buf[n as usize..];
    }
    sent
}

/// How long a call that must not return early waits for a connection to be settled (the CLC
/// handshake's own waits are shorter).
const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(90);

/// The connection, or `Err(EIO)` for a socket a forked child inherited.
fn as_smc(s: &Sock) -> Result<&SmcFd, io::Error> {
    match s {
        Sock::Smc(c) => Ok(c),
        _ => {
            crate::log::line(format_args!(
                "an SMC-R socket inherited through fork was used in the child: EIO \
                 (docs/limitations.md)"
            ));
            Err(io::Error::from_raw_os_error(libc::EIO))
        }
    }
}

fn ret_len(r: io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

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
        let nonblocking = shim::nonblocking(fd);
        // SAFETY: forwarding.
        let r = unsafe { real::connect()(fd, addr, len) };
        let e = errno();
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
    shim::sockaddr_of(&ss, len)
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
    let bound = named.then(|| shim::sockaddr_of(&ss, sl)).flatten();
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

/// The read family's dispatch (`flags`: the call's, for MSG_DONTWAIT): a connection not
/// settled yet answers as a TCP one with nothing received would (EOF after a shutdown, EAGAIN,
/// or the wait [`target`] did), an SMC-R one reads with `smc`, any other goes to libc.
fn read_from(
    fd: c_int,
    flags: c_int,
    smc: impl FnOnce(&Sock) -> ssize_t,
    real: impl FnOnce() -> ssize_t,
) -> ssize_t {
    match target(
        fd,
        Op::Read {
            dontwait: flags & libc::MSG_DONTWAIT != 0,
        },
    ) {
        Target::Eof => 0,
        Target::Stage(_) => {
            set_errno(libc::EAGAIN);
            -1
        }
        Target::Err(e) => {
            set_errno(e);
            -1
        }
        Target::Smc(s) => smc(&s),
        Target::Real => real(),
    }
}

fn recv_into(fd: c_int, s: &Sock, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    let _ = fd;
    guarded_on(s, -1, || {
        if n == 0 {
            return 0;
        }
        // SAFETY: the caller gives a writable buffer of `n` bytes.
        let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), n) };
        ret_len(as_smc(s).and_then(|c| c.recv(b, flags)))
    })
}

fn send_from(s: &Sock, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    guarded_on(s, -1, || {
        if n == 0 {
            return 0;
        }
        // SAFETY: the caller gives a readable buffer of `n` bytes.
        let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) };
        ret_len(as_smc(s).and_then(|c| c.send(b, flags)))
    })
}

/// # Safety
/// libc's contract for read(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    read_from(
        fd,
        0,
        |s| recv_into(fd, s, buf, n, 0),
        // SAFETY: forwarding.
        || unsafe { real::read()(fd, buf, n) },
    )
}

/// # Safety
/// libc's contract for recv(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    read_from(
        fd,
        flags,
        |s| recv_into(fd, s, buf, n, flags),
        // SAFETY: forwarding.
        || unsafe { real::recv()(fd, buf, n, flags) },
    )
}

/// # Safety
/// libc's contract for recvfrom(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    read_from(
        fd,
        flags,
        |s| {
            if !alen.is_null() {
                // Connected stream: no source address, as for TCP.
                // SAFETY: the caller passed a valid length pointer.
                unsafe { *alen = 0 };
            }
            recv_into(fd, s, buf, n, flags)
        },
        // SAFETY: forwarding.
        || unsafe { real::recvfrom()(fd, buf, n, flags, addr, alen) },
    )
}

/// # Safety
/// libc's contract for write(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    write_to(
        fd,
        0,
        // SAFETY: the caller gives a readable buffer of `n` bytes.
        &|| std::borrow::Cow::Owned(unsafe { slice(buf, n) }.to_vec()),
        &|s| send_from(s, buf, n, 0),
        // SAFETY: forwarding.
        &|| unsafe { real::write()(fd, buf, n) },
    )
}

/// # Safety
/// libc's contract for send(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    write_to(
        fd,
        flags,
        // SAFETY: the caller gives a readable buffer of `n` bytes.
        &|| std::borrow::Cow::Owned(unsafe { slice(buf, n) }.to_vec()),
        &|s| send_from(s, buf, n, flags),
        // SAFETY: forwarding.
        &|| unsafe { real::send()(fd, buf, n, flags) },
    )
}

/// # Safety
/// libc's contract for sendto(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    write_to(
        fd,
        flags,
        // SAFETY: the caller gives a readable buffer of `n` bytes.
        &|| std::borrow::Cow::Owned(unsafe { slice(buf, n) }.to_vec()),
        // A destination on a connected stream is ignored, as TCP does.
        &|s| send_from(s, buf, n, flags),
        &|| {
            fastopen(fd, flags);
            // SAFETY: forwarding.
            unsafe { real::sendto()(fd, buf, n, flags, addr, alen) }
        },
    )
}

/// `sendto`/`sendmsg` with MSG_FASTOPEN connects with data in the SYN: as Linux's SMC, such a
/// socket falls back to TCP (OPTUNSUPP).
fn fastopen(fd: c_int, flags: c_int) {
    if flags & libc::MSG_FASTOPEN != 0
        && !bypassed()
        && table::get(fd).is_some_and(|s| matches!(*s, Sock::Inet))
    {
        guarded((), || shim::unsupported_option(fd, "MSG_FASTOPEN"));
    }
}

/// The caller's buffer of `n` bytes (empty for a null or zero-length one).
///
/// # Safety
/// A non-null `buf` points to `n` readable bytes.
unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) }
}

/// Gathers iovecs into one buffer (SMC-R copies into the send buffer anyway).
fn gather(iov: *const iovec, cnt: c_int) -> Vec<u8> {
    let mut v = Vec::new();
    for i in 0..cnt.max(0) as usize {
        // SAFETY: the caller gives `cnt` valid iovecs.
        let e = unsafe { &*iov.add(i) };
        if e.iov_len > 0 {
            // SAFETY: each iovec describes a readable buffer.
            v.extend_from_slice(unsafe {
                std::slice::from_raw_parts(e.iov_base.cast::<u8>(), e.iov_len)
            });
        }
    }
    v
}

/// Scatters `data` into iovecs.
fn scatter(iov: *const iovec, cnt: c_int, data: &[u8]) {
    let mut at = 0;
    for i in 0..cnt.max(0) as usize {
        if at == data.len() {
            break;
        }
        // SAFETY: the caller gives `cnt` valid, writable iovecs.
        let e = unsafe { &*iov.add(i) };
        let n = e.iov_len.min(data.len() - at);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), e.iov_base.cast(), n) };
        at += n;
    }
}

fn iov_total(iov: *const iovec, cnt: c_int) -> usize {
    (0..cnt.max(0) as usize)
        // SAFETY: the caller gives `cnt` valid iovecs.
        .map(|i| unsafe { (*iov.add(i)).iov_len })
        .sum()
}

fn readv_smc(s: &Sock, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    guarded_on(s, -1, || {
        let mut buf = vec![0u8; iov_total(iov, cnt)];
        match as_smc(s).and_then(|c| c.recv(&mut buf, flags)) {
            Ok(n) => {
                scatter(iov, cnt, &buf[..n]);
                n as ssize_t
            }
            Err(e) => {
                set_errno(errno_of(&e));
                -1
            }
        }
    })
}

fn writev_smc(s: &Sock, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    guarded_on(s, -1, || {
        let data = gather(iov, cnt);
        if data.is_empty() {
            return 0;
        }
        ret_len(as_smc(s).and_then(|c| c.send(&data, flags)))
    })
}

/// # Safety
/// libc's contract for readv(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    read_from(
        fd,
        0,
        |s| readv_smc(s, iov, cnt, 0),
        // SAFETY: forwarding.
        || unsafe { real::readv()(fd, iov, cnt) },
    )
}

/// # Safety
/// libc's contract for writev(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    write_to(
        fd,
        0,
        &|| std::borrow::Cow::Owned(gather(iov, cnt)),
        &|s| writev_smc(s, iov, cnt, 0),
        // SAFETY: forwarding.
        &|| unsafe { real::writev()(fd, iov, cnt) },
    )
}

/// # Safety
/// libc's contract for recvmsg(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    read_from(
        fd,
        flags,
        |s| {
            // SAFETY: the caller gives a valid msghdr.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            readv_smc(s, m.msg_iov, m.msg_iovlen as c_int, flags)
        },
        // SAFETY: forwarding.
        || unsafe { real::recvmsg()(fd, msg, flags) },
    )
}

/// # Safety
/// libc's contract for sendmsg(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller gives a valid msghdr.
    let m = unsafe { &*msg };
    write_to(
        fd,
        flags,
        &|| std::borrow::Cow::Owned(gather(m.msg_iov, m.msg_iovlen as c_int)),
        &|s| writev_smc(s, m.msg_iov, m.msg_iovlen as c_int, flags),
        &|| {
            fastopen(fd, flags);
            // SAFETY: forwarding.
            unsafe { real::sendmsg()(fd, msg, flags) }
        },
    )
}

/// # Safety
/// libc's contract for close(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !bypassed() {
        crate::epoll::closed_epfd(fd);
        guarded((), || forget_number(fd));
    }
    // SAFETY: forwarding.
    unsafe { real::close()(fd) }
}

/// The application's number `fd` is about to close (or be replaced by dup2/dup3): our entry
/// goes (dropping the last one sends SMC-R's close and releases our duplicate of the TCP
/// socket). A connection being settled takes the number out under its own lock, so nothing
/// is installed at a number closed meanwhile.
fn forget_number(fd: c_int) {
    let Some(s) = table::get_any(fd) else {
        return;
    };
    let mut gone = None;
    let mut last = false;
    let mut remove = || {
        gone = table::remove(fd);
        last = !table::shows(&s);
    };
    match &*s {
        Sock::Pending(p) | Sock::Accepted(p) => p.closing(remove),
        _ => remove(),
    }
    // Epoll drops a registration only when its file goes, and the file outlives this number
    // (our duplicate): take the application's registrations off by hand when no other number
    // shows this socket, or the old connection's events would arrive under a reused number.
    crate::epoll::closed(fd, last && s.pair().is_some());
    if last
        && let Some(g) = &gone
        && let Sock::Listener(l) = &**g
    {
        l.close();
    }
    drop(gone);
}

/// # Safety
/// libc's contract for shutdown(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let shut = match how {
        libc::SHUT_RD => Some(std::net::Shutdown::Read),
        libc::SHUT_WR => Some(std::net::Shutdown::Write),
        libc::SHUT_RDWR => Some(std::net::Shutdown::Both),
        _ => None,
    };
    // A connection not settled yet records it (done once settled, after what was staged):
    // TCP's shutdown does not wait either.
    if !bypassed()
        && let Some(how) = shut
        && let Some(s) = table::get(fd)
        && let Sock::Accepted(a) | Sock::Pending(a) = &*s
    {
        let recorded = guarded(false, || {
            a.start(fd);
            a.shutdown(how)
        });
        if recorded {
            return 0;
        }
    }
    match target(fd, Op::Wait) {
        Target::Smc(s) => guarded(-1, || {
            let how = match how {
                libc::SHUT_RD => std::net::Shutdown::Read,
                libc::SHUT_WR => std::net::Shutdown::Write,
                libc::SHUT_RDWR => std::net::Shutdown::Both,
                _ => {
                    set_errno(libc::EINVAL);
                    return -1;
                }
            };
            // (What was staged before the connection settled goes before the end of writing.)
            match as_smc(&s).and_then(|c| c.shutdown(how)) {
                Ok(()) => 0,
                Err(e) => {
                    set_errno(errno_of(&e));
                    -1
                }
            }
        }),
        // A listener (threads waiting in accept wake with EINVAL) or plain TCP.
        // SAFETY: forwarding.
        Target::Real | Target::Err(_) | Target::Stage(_) | Target::Eof => unsafe {
            real::shutdown()(fd, how)
        },
    }
}

/// The descriptor socket calls about `fd` should reach: the hidden TCP socket of an SMC-R fd.
fn socket_fd(fd: c_int) -> c_int {
    if bypassed() {
        return fd;
    }
    match table::get(fd).as_deref() {
        // The number shows the kernel pair: the socket is our duplicate.
        Some(Sock::Smc(c)) if c.pair.has_kernel() => shim::tcp_fd(c),
        // The number is the socket itself.
        _ => fd,
    }
}

/// # Safety
/// libc's contract for getpeername(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, a: *mut sockaddr, l: *mut socklen_t) -> c_int {
    // SAFETY: forwarding.
    unsafe { real::getpeername()(socket_fd(fd), a, l) }
}

/// # Safety
/// libc's contract for getsockname(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, a: *mut sockaddr, l: *mut socklen_t) -> c_int {
    // SAFETY: forwarding.
    unsafe { real::getsockname()(socket_fd(fd), a, l) }
}

/// # Safety
/// libc's contract for getsockopt(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET
        && name == libc::SO_ERROR
        && !val.is_null()
        && !len.is_null()
        // SAFETY: the caller passes a valid length.
        && unsafe { *len } as usize >= std::mem::size_of::<c_int>()
        && let Some(s) = smc(fd)
        && let Sock::Smc(c) = &*s
        && c.stream.take_reset()
    {
        c.pair.take_error();
        // A reset not yet collected by a read or write: reported (and cleared) as TCP does.
        // SAFETY: room for an int, checked above.
        unsafe {
            *val.cast::<c_int>() = libc::ECONNRESET;
            *len = std::mem::size_of::<c_int>() as socklen_t;
        }
        return 0;
    }
    // SAFETY: forwarding.
    unsafe { real::getsockopt()(socket_fd(fd), level, name, val, len) }
}

/// # Safety
/// libc's contract for setsockopt(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level == libc::IPPROTO_TCP
        && !bypassed()
        && let Some(s) = table::get(fd)
    {
        match (name, &*s) {
            // SMC-R cannot honour these: as Linux's SMC, a socket not yet connecting falls
            // back to TCP (OPTUNSUPP), anything later refuses the option.
            (
                libc::TCP_FASTOPEN
                | libc::TCP_FASTOPEN_CONNECT
                | libc::TCP_FASTOPEN_KEY
                | libc::TCP_FASTOPEN_NO_COOKIE,
                Sock::Inet,
            ) => guarded((), || shim::unsupported_option(fd, "TCP_FASTOPEN")),
            (
                libc::TCP_FASTOPEN
                | libc::TCP_FASTOPEN_CONNECT
                | libc::TCP_FASTOPEN_KEY
                | libc::TCP_FASTOPEN_NO_COOKIE,
                _,
            ) => {
                set_errno(libc::EINVAL);
                return -1;
            }
            // A ULP (kernel TLS) would sit on the TCP socket, which carries no data.
            (libc::TCP_ULP, Sock::Smc(_) | Sock::Listener(_) | Sock::Pending(_)) => {
                set_errno(libc::EOPNOTSUPP);
                return -1;
            }
            _ => {}
        }
    }
    if let Some(s) = smc(fd)
        && let Ok(c) = as_smc(&s)
        && level == libc::SOL_SOCKET
        && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO)
        && len as usize >= std::mem::size_of::<libc::timeval>()
    {
        // SAFETY: the caller passes a timeval of at least `len` bytes.
        let tv = unsafe { &*val.cast::<libc::timeval>() };
        let us = (tv.tv_sec.max(0) as u64) * 1_000_000 + tv.tv_usec.max(0) as u64;
        let slot = if name == libc::SO_RCVTIMEO {
            &c.rcvtimeo_us
        } else {
            &c.sndtimeo_us
        };
        slot.store(us, Ordering::Relaxed);
    }
    // SAFETY: forwarding (the TCP socket keeps the option too).
    unsafe { real::setsockopt()(socket_fd(fd), level, name, val, len) }
}

fn fcntl_common(
    fd: c_int,
    cmd: c_int,
    arg: c_ulong,
    f: unsafe extern "C" fn(c_int, c_int, c_ulong) -> c_int,
) -> c_int {
    let s = if bypassed() { None } else { table::get(fd) };
    if let Some(s) = &s
        && cmd == libc::F_SETFL
    {
        shim::set_nonblock(s, arg as c_int & libc::O_NONBLOCK != 0);
    }
    // Decided on the file, even in a forked child (where the connection is the parent's):
    // what it execs must not inherit a pair nothing serves.
    let pair = !bypassed() && table::get_any(fd).is_some_and(|s| shim::cloexec_managed(&s));
    if pair {
        // Our pair stays close-on-exec; the application sees (and sets) its own flag.
        match cmd {
            libc::F_GETFD => {
                // SAFETY: forwarding.
                let r = unsafe { f(fd, cmd, arg) };
                if r < 0 {
                    return r;
                }
                let view = if table::cloexec_view(fd) {
                    libc::FD_CLOEXEC
                } else {
                    0
                };
                return (r & !libc::FD_CLOEXEC) | view;
            }
            libc::F_SETFD => {
                // SAFETY: forwarding, with close-on-exec kept.
                let r = unsafe { f(fd, cmd, arg | libc::FD_CLOEXEC as c_ulong) };
                if r == 0 {
                    table::set_cloexec_view(fd, arg as c_int & libc::FD_CLOEXEC != 0);
                }
                return r;
            }
            _ => {}
        }
    }
    let dupfd = cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC;
    let real_cmd = if pair && dupfd {
        libc::F_DUPFD_CLOEXEC
    } else {
        cmd
    };
    // SAFETY: forwarding (on the pair at `fd`, which takes O_NONBLOCK too).
    let r = unsafe { f(fd, real_cmd, arg) };
    if r >= 0
        && dupfd
        && let Some(s) = s
    {
        if pair {
            table::set_cloexec_view(r, cmd == libc::F_DUPFD_CLOEXEC);
        }
        crate::epoll::forget(r);
        table::insert(r, s);
    }
    r
}

/// # Safety
/// libc's contract for fcntl(2); the third argument is read as a pointer-sized integer, which
/// is how x86-64 and aarch64 Linux pass a variadic int or pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg, real::fcntl())
}

/// # Safety
/// As [`fcntl`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_common(fd, cmd, arg, real::fcntl64())
}

/// # Safety
/// libc's contract for ioctl(2), with the same variadic assumption as [`fcntl`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    if (req == libc::FIOCLEX || req == libc::FIONCLEX)
        && !bypassed()
        && table::get_any(fd).is_some_and(|s| shim::cloexec_managed(&s))
    {
        // As F_SETFD: the pair stays close-on-exec, the application's flag is its view.
        // SAFETY: checking that the descriptor is open.
        if unsafe { real::fcntl()(fd, libc::F_GETFD, 0) } < 0 {
            return -1;
        }
        table::set_cloexec_view(fd, req == libc::FIOCLEX);
        return 0;
    }
    if req == libc::FIONBIO
        && !bypassed()
        && let Some(s) = table::get(fd)
    {
        // SAFETY: FIONBIO's argument points to an int.
        shim::set_nonblock(&s, unsafe { *(arg as *const c_int) } != 0);
    }
    if req == libc::FIONREAD
        && !bypassed()
        && table::get(fd).is_some_and(|s| matches!(*s, Sock::Accepted(_) | Sock::Pending(_)))
    {
        // Not settled: what waits on the TCP socket is the CLC handshake's, not data.
        // SAFETY: FIONREAD's argument points to an int.
        unsafe { *(arg as *mut c_int) = 0 };
        return 0;
    }
    if req == libc::FIONREAD
        && let Some(s) = smc(fd)
        && let Ok(c) = as_smc(&s)
    {
        let n = c.stream.readable_bytes().min(c_int::MAX as usize) as c_int;
        // SAFETY: FIONREAD's argument points to an int.
        unsafe { *(arg as *mut c_int) = n };
        return 0;
    }
    // SAFETY: forwarding.
    unsafe { real::ioctl()(fd, req, arg) }
}

/// # Safety
/// libc's contract for epoll_ctl(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    if bypassed() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    }
    guarded(-1, || crate::epoll::ctl(epfd, op, fd, ev))
}

/// # Safety
/// libc's contract for epoll_wait(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_wait()(epfd, events, maxevents, timeout) };
    }
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, timeout, |e, max, t| {
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_wait()(epfd, e, max, t) }
        })
    })
}

/// # Safety
/// libc's contract for epoll_pwait(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait()(epfd, events, maxevents, timeout, sigmask) };
    }
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, timeout, |e, max, t| {
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_pwait()(epfd, e, max, t, sigmask) }
        })
    })
}

/// # Safety
/// libc's contract for epoll_pwait2(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if bypassed() || !crate::epoll::managed() || events.is_null() {
        // SAFETY: forwarding.
        return unsafe { real::epoll_pwait2()(epfd, events, maxevents, timeout, sigmask) };
    }
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    guarded(-1, || {
        crate::epoll::wait(epfd, events, maxevents, ms, |e, max, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: forwarding with the remaining time (into the caller's buffer).
            unsafe { real::epoll_pwait2()(epfd, e, max, p, sigmask) }
        })
    })
}

/// Milliseconds for a poll from a timespec (`None`: wait forever), rounded up: a wait is never
/// cut shorter than asked.
fn timespec_ms(t: Option<&libc::timespec>) -> c_int {
    match t {
        None => -1,
        Some(t) => (t.tv_sec.max(0) as i128 * 1000
            + i128::from((t.tv_nsec.max(0) + 999_999) / 1_000_000))
        .clamp(0, i128::from(i32::MAX)) as i32,
    }
}

/// A timespec for `ms` (negative: none, wait forever).
fn ms_timespec(ms: c_int, ts: &mut libc::timespec) -> *const libc::timespec {
    if ms < 0 {
        return std::ptr::null();
    }
    *ts = libc::timespec {
        tv_sec: libc::time_t::from(ms / 1000),
        tv_nsec: libc::c_long::from(ms % 1000) * 1_000_000,
    };
    ts
}

/// The poll array of a poll call, if it may hold our connections and the call should go
/// through `crate::poll` (with the link groups behind them).
///
/// # Safety
/// `fds` points to `nfds` entries (the caller's contract).
unsafe fn poll_groups<'a>(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
) -> Option<(&'a mut [libc::pollfd], crate::poll::Ours)> {
    if bypassed() || fds.is_null() || nfds == 0 || nfds > table::MAX_FDS as libc::nfds_t {
        return None;
    }
    // SAFETY: per the caller's contract.
    let app = unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) };
    let ours = guarded(None, || crate::poll::ours(app.iter().map(|p| p.fd)))?;
    Some((app, ours))
}

/// # Safety
/// libc's contract for poll(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's contract.
    let Some((app, ours)) = (unsafe { poll_groups(fds, nfds) }) else {
        // SAFETY: forwarding.
        return unsafe { real::poll()(fds, nfds, timeout) };
    };
    guarded(-1, || {
        crate::poll::wait(app, &ours, timeout, |a, t| {
            // SAFETY: our array (the application's entries, then ours).
            unsafe { real::poll()(a.as_mut_ptr(), a.len() as libc::nfds_t, t) }
        })
    })
}

/// # Safety
/// libc's contract for the FORTIFY `__poll_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < nfds as usize {
        // SAFETY: forwarding: libc reports the overflow.
        return unsafe { real::__poll_chk()(fds, nfds, timeout, fdslen) };
    }
    // SAFETY: checked as libc would; the caller's contract otherwise.
    unsafe { poll(fds, nfds, timeout) }
}

/// # Safety
/// libc's contract for ppoll(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some((app, ours)) = (unsafe { poll_groups(fds, nfds) }) else {
        // SAFETY: forwarding.
        return unsafe { real::ppoll()(fds, nfds, timeout, sigmask) };
    };
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    guarded(-1, || {
        crate::poll::wait(app, &ours, ms, |a, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: our array, the remaining time, the caller's mask.
            unsafe { real::ppoll()(a.as_mut_ptr(), a.len() as libc::nfds_t, p, sigmask) }
        })
    })
}

/// # Safety
/// libc's contract for the FORTIFY `__ppoll_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < nfds as usize {
        // SAFETY: forwarding: libc reports the overflow.
        return unsafe { real::__ppoll_chk()(fds, nfds, timeout, sigmask, fdslen) };
    }
    // SAFETY: checked as libc would; the caller's contract otherwise.
    unsafe { ppoll(fds, nfds, timeout, sigmask) }
}

/// # Safety
/// libc's contract for select(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    if bypassed() || nfds <= 0 {
        // SAFETY: forwarding.
        return unsafe { real::select()(nfds, readfds, writefds, exceptfds, timeout) };
    }
    // SAFETY: a non-null timeout points to a timeval (the caller's contract).
    let ms = match unsafe { timeout.as_ref() } {
        None => -1,
        Some(t) => (t.tv_sec.max(0) as i128 * 1000 + i128::from((t.tv_usec.max(0) + 999) / 1000))
            .clamp(0, i128::from(i32::MAX)) as i32,
    };
    let start = std::time::Instant::now();
    let r = guarded(Some(-1), || {
        crate::poll::select(nfds, [readfds, writefds, exceptfds], ms, |a, t| {
            // SAFETY: our array, the remaining time.
            unsafe { real::poll()(a.as_mut_ptr(), a.len() as libc::nfds_t, t) }
        })
    });
    let Some(r) = r else {
        // SAFETY: forwarding (none of ours in the sets).
        return unsafe { real::select()(nfds, readfds, writefds, exceptfds, timeout) };
    };
    // Linux's select leaves the time not slept in the timeout.
    // SAFETY: as above.
    if let Some(t) = unsafe { timeout.as_mut() }
        && ms >= 0
    {
        let left = std::time::Duration::from_millis(ms as u64).saturating_sub(start.elapsed());
        t.tv_sec = left.as_secs() as libc::time_t;
        t.tv_usec = libc::suseconds_t::from(left.subsec_micros() as i32);
    }
    r
}

/// # Safety
/// libc's contract for pselect(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if bypassed() || nfds <= 0 {
        // SAFETY: forwarding.
        return unsafe { real::pselect()(nfds, readfds, writefds, exceptfds, timeout, sigmask) };
    }
    // SAFETY: a non-null timeout points to a timespec (the caller's contract).
    let ms = timespec_ms(unsafe { timeout.as_ref() });
    let r = guarded(Some(-1), || {
        crate::poll::select(nfds, [readfds, writefds, exceptfds], ms, |a, t| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let p = ms_timespec(t, &mut ts);
            // SAFETY: our array, the remaining time, the caller's mask.
            unsafe { real::ppoll()(a.as_mut_ptr(), a.len() as libc::nfds_t, p, sigmask) }
        })
    });
    match r {
        Some(r) => r,
        // SAFETY: forwarding (none of ours in the sets).
        None => unsafe { real::pselect()(nfds, readfds, writefds, exceptfds, timeout, sigmask) },
    }
}

/// A duplicate of a number showing our pair: close-on-exec for real, as asked in the view.
fn dup_pair(new: c_int, cloexec: bool) {
    // SAFETY: setting a flag on the descriptor just made.
    unsafe { real::fcntl()(new, libc::F_SETFD, libc::FD_CLOEXEC as c_ulong) };
    table::set_cloexec_view(new, cloexec);
}

/// # Safety
/// libc's contract for dup(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::dup()(fd) };
    if r >= 0 && !bypassed() {
        if table::get_any(fd).is_some_and(|s| shim::cloexec_managed(&s)) {
            dup_pair(r, false);
        }
        if let Some(s) = table::get(fd) {
            crate::epoll::forget(r);
            table::insert(r, s);
        }
    }
    r
}

/// dup2/dup3 (`real`) of `old` onto `new`. `new` is closed implicitly: when it shows a
/// connection being settled, the replacement and the forgetting happen under that
/// connection's settling lock, as a close's do, so nothing is installed at `new` afterwards.
fn dup_to(old: c_int, new: c_int, cloexec: bool, real: impl FnOnce() -> c_int) -> c_int {
    if bypassed() || old == new {
        return real();
    }
    let prior = table::get_any(new);
    let mut r = -1;
    let mut gone = None;
    let swap = || {
        r = real();
        if r >= 0 {
            gone = shim::untrack(new);
        }
    };
    match prior.as_deref() {
        Some(Sock::Pending(p) | Sock::Accepted(p)) => p.closing(swap),
        _ => swap(),
    }
    guarded((), || drop(gone));
    dup_onto(old, new, r, cloexec)
}

fn dup_onto(old: c_int, new: c_int, r: c_int, cloexec: bool) -> c_int {
    if r >= 0 && !bypassed() && old != new {
        // `new` is now what `old` is.
        if table::get_any(old).is_some_and(|s| shim::cloexec_managed(&s)) {
            dup_pair(new, cloexec);
        }
        if let Some(s) = table::get(old) {
            table::insert(new, s);
        }
    }
    r
}

/// # Safety
/// libc's contract for dup2(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwarding.
    dup_to(old, new, false, || unsafe { real::dup2()(old, new) })
}

/// # Safety
/// libc's contract for dup3(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarding.
    dup_to(old, new, flags & libc::O_CLOEXEC != 0, || unsafe {
        real::dup3()(old, new, flags)
    })
}

fn end(fd: c_int, s: &Option<Arc<Sock>>) -> io::Result<crate::sendfile::End<'_>> {
    Ok(match s {
        Some(s) => crate::sendfile::End::Smc(as_smc(s)?),
        None => crate::sendfile::End::Fd(fd),
    })
}

/// The two ends of a sendfile, settled (`None`: both plain, libc's call).
fn sendfile_ends(out_fd: c_int, in_fd: c_int) -> Option<Result<[Option<Arc<Sock>>; 2], c_int>> {
    let mut ends = [None, None];
    for (i, (fd, write)) in [(out_fd, true), (in_fd, false)].into_iter().enumerate() {
        let _ = write;
        match target(fd, Op::Wait) {
            Target::Real | Target::Stage(_) | Target::Eof => {}
            Target::Smc(s) => ends[i] = Some(s),
            Target::Err(e) => return Some(Err(e)),
        }
    }
    (ends[0].is_some() || ends[1].is_some()).then_some(Ok(ends))
}

fn sendfile_common(
    out_fd: c_int,
    in_fd: c_int,
    ends: Result<[Option<Arc<Sock>>; 2], c_int>,
    offset: Option<&mut i64>,
    count: size_t,
) -> ssize_t {
    let [out, inn] = match ends {
        Ok(e) => e,
        Err(e) => {
            set_errno(e);
            return -1;
        }
    };
    guarded(-1, || match (end(out_fd, &out), end(in_fd, &inn)) {
        (Ok(d), Ok(s)) => crate::sendfile::copy(d, s, offset, count),
        (Err(e), _) | (_, Err(e)) => ret_len(Err(e)),
    })
}

/// # Safety
/// libc's contract for sendfile(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    let Some(ends) = sendfile_ends(out_fd, in_fd) else {
        // SAFETY: forwarding.
        return unsafe { real::sendfile()(out_fd, in_fd, offset, count) };
    };
    // SAFETY: a non-null offset points to the caller's off_t (64-bit here).
    sendfile_common(out_fd, in_fd, ends, unsafe { offset.as_mut() }, count)
}

/// # Safety
/// libc's contract for sendfile64(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    let Some(ends) = sendfile_ends(out_fd, in_fd) else {
        // SAFETY: forwarding.
        return unsafe { real::sendfile64()(out_fd, in_fd, offset, count) };
    };
    // SAFETY: as above.
    sendfile_common(out_fd, in_fd, ends, unsafe { offset.as_mut() }, count)
}

// The FORTIFY_SOURCE variants: programs built with -D_FORTIFY_SOURCE call these instead of
// read/recv/recvfrom (glibc reaches the syscall without going through our exports). A
// too-small buffer is left to glibc's own check, which aborts as the program expects.

/// # Safety
/// glibc's contract for __read_chk.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    // SAFETY: forwarding.
    let real = || unsafe { real::__read_chk()(fd, buf, n, buflen) };
    read_from(
        fd,
        0,
        |s| {
            if n <= buflen {
                recv_into(fd, s, buf, n, 0)
            } else {
                real()
            }
        },
        real,
    )
}

/// # Safety
/// glibc's contract for __recv_chk.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: forwarding.
    let real = || unsafe { real::__recv_chk()(fd, buf, n, buflen, flags) };
    read_from(
        fd,
        flags,
        |s| {
            if n <= buflen {
                recv_into(fd, s, buf, n, flags)
            } else {
                real()
            }
        },
        real,
    )
}

/// # Safety
/// glibc's contract for __recvfrom_chk.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    // SAFETY: forwarding.
    let real = || unsafe { real::__recvfrom_chk()(fd, buf, n, buflen, flags, addr, alen) };
    read_from(
        fd,
        flags,
        |_| {
            if n <= buflen {
                // SAFETY: the same arguments recvfrom takes.
                unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
            } else {
                real()
            }
        },
        real,
    )
}

/// # Safety
/// libc's contract for fork(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // SAFETY: forwarding.
    let r = unsafe { real::fork()() };
    if !bypassed() {
        match r {
            0 => shim::forked_child(),
            p if p > 0 => {
                let e = errno();
                guarded((), || shim::forked(p as u32));
                set_errno(e);
            }
            _ => {}
        }
    }
    r
}
