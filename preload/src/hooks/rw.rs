//! The read and write family (read, recv, recvfrom, readv, recvmsg; write, send, sendto,
//! writev, sendmsg; glibc's FORTIFY `__*_chk` variants): to an SMC-R connection, into the
//! stage of one not settled yet, or to libc.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use libc::{c_int, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};

use super::{Op, SETTLE_WAIT, Target, as_smc, ret_len, target, timeo};
use crate::guard::{bypassed, errno, errno_of, guarded, set_errno};
use crate::shim;
use crate::sock::{Sock, Staged};
use crate::{real, table};

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
            Target::Real | Target::Eof => {
                // Another descriptor (a pipe, a file, a TCP socket): the call may block.
                smcr::cork::end();
                return real();
            }
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
                match guarded(Staged::WouldBlock, || a.stage(b, wait)) {
                    Staged::Took(n) if wait.is_none() || n == b.len() => return n as ssize_t,
                    Staged::Took(n) => staged = n,
                    Staged::WouldBlock => {
                        set_errno(libc::EAGAIN);
                        return -1;
                    }
                    Staged::Settled => {}
                    Staged::Shut => {
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
        Target::Real => {
            // Another descriptor: the read may block.
            smcr::cork::end();
            real()
        }
    }
}

/// As [`guarded`], for a call on a connection: after a panic its state cannot be trusted, so
/// the connection is ended (the peer sees a reset, later calls fail with ECONNRESET).
fn guarded_on<T>(s: &Sock, fail: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            crate::log::line(format_args!(
                "panic inside a hook; the call fails with EIO and the connection is aborted"
            ));
            if let Sock::Smc(c) = s {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    c.stream.abort("aborted after a panic inside smcr")
                }));
            }
            set_errno(libc::EIO);
            fail
        }
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
        || {
            // SAFETY: forwarding.
            let r = unsafe { real::recvmsg()(fd, msg, flags) };
            if r >= 0 && !bypassed() {
                // SAFETY: the caller's msghdr, as the kernel filled it.
                unsafe { received_descriptors(fd, msg) };
            }
            r
        },
    )
}

/// After a `recvmsg` on a socket of the kernel's: the descriptors it carried (SCM_RIGHTS) may
/// be TCP sockets another process marked or accepted (`shim::received`). The call's result
/// and errno stay as the kernel gave them.
///
/// # Safety
/// `msg` is the caller's msghdr as `recvmsg` filled it.
unsafe fn received_descriptors(on: c_int, msg: *const msghdr) {
    // SAFETY: as the caller says.
    let fds = unsafe { message_fds(msg) };
    if fds.is_empty() {
        return;
    }
    let e = errno();
    // A panic in here must not turn the program's successful call into a failure.
    let _ = std::panic::catch_unwind(|| shim::received(on, &fds));
    set_errno(e);
}

/// Sends the caller's message with each SMC-R connection it carries replaced by the
/// receiver's end of its relay's pair (`shim::relay`); the relays run once it went.
///
/// # Safety
/// `msg` is the caller's valid msghdr.
unsafe fn send_relayed(
    fd: c_int,
    msg: *const msghdr,
    flags: c_int,
    relays: Vec<shim::relay::Relay>,
) -> ssize_t {
    use std::os::fd::AsRawFd;
    // SAFETY: the caller's msghdr.
    let mut m = unsafe { *msg };
    // SAFETY: the control buffer holds msg_controllen bytes.
    let mut control =
        unsafe { std::slice::from_raw_parts(m.msg_control.cast::<u8>(), m.msg_controllen) }
            .to_vec();
    m.msg_control = control.as_mut_ptr().cast();
    // SAFETY: our copy of the control buffer; the relayed descriptors are rewritten in place.
    for slot in unsafe { rights_slots(&m) } {
        // SAFETY: a slot inside our copy (`rights_slots`).
        let v = unsafe { slot.read_unaligned() };
        if let Some(r) = relays.iter().find(|r| r.fd == v) {
            // SAFETY: as above.
            unsafe { slot.write_unaligned(r.theirs.as_raw_fd()) };
        }
    }
    // SAFETY: our copy of the caller's message.
    let r = unsafe { real::sendmsg()(fd, &m, flags) };
    let e = errno();
    if r >= 0 {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            shim::relay::start(relays)
        }));
    }
    set_errno(e);
    r
}

/// The descriptors a message carries (SCM_RIGHTS), read from its control buffer.
///
/// # Safety
/// `msg` is a valid msghdr whose control buffer, if any, holds `msg_controllen` bytes.
unsafe fn message_fds(msg: *const msghdr) -> Vec<c_int> {
    // SAFETY: the caller's msghdr; each slot lies inside its control buffer.
    unsafe { rights_slots(&*msg) }
        .into_iter()
        .map(|p| unsafe { p.read_unaligned() })
        .collect()
}

/// Where the descriptors of `m`'s SCM_RIGHTS messages lie (unaligned), only those wholly
/// inside its control buffer: the walk ends at a `cmsg_len` that claims more than the buffer
/// holds (the kernel refuses such a message).
///
/// # Safety
/// `m.msg_control` is null or holds `m.msg_controllen` bytes.
unsafe fn rights_slots(m: &msghdr) -> Vec<*mut c_int> {
    let mut slots = Vec::new();
    if m.msg_control.is_null() || m.msg_controllen < std::mem::size_of::<libc::cmsghdr>() {
        return slots;
    }
    let end = m.msg_control as usize + m.msg_controllen;
    // SAFETY: walking the control buffer with libc's CMSG macros, which keep each header
    // inside it; each message's data is inside it too (checked against `end` first).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(m);
        while !c.is_null() {
            // A length past the buffer's end (the kernel refuses the message) ends the walk:
            // its data is not all there, and CMSG_NXTHDR's alignment could wrap on it.
            if (*c).cmsg_len as usize > end - c as usize {
                break;
            }
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<c_int>();
                let n = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<c_int>();
                slots.extend((0..n).map(|i| data.add(i)));
            }
            c = libc::CMSG_NXTHDR(m, c);
        }
    }
    slots
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
            if !bypassed() {
                // SAFETY: the caller's msghdr.
                let fds = unsafe { message_fds(msg) };
                if !fds.is_empty() {
                    let e = errno();
                    let relays = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        shim::sending(fd, &fds);
                        shim::relay::prepare(&fds)
                    }))
                    .unwrap_or_default();
                    set_errno(e);
                    if !relays.is_empty() {
                        // SAFETY: the caller's msghdr; the relays' descriptors are open.
                        return unsafe { send_relayed(fd, msg, flags, relays) };
                    }
                }
            }
            // SAFETY: forwarding.
            unsafe { real::sendmsg()(fd, msg, flags) }
        },
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_on_a_connection_becomes_eio_and_the_fallback_value() {
        set_errno(0);
        let r = guarded_on(&Sock::Inet, -1isize, || panic!("on a socket"));
        assert_eq!((r, errno()), (-1, libc::EIO));
    }

    /// SCM_RIGHTS descriptors are read from the control buffer, never past its end, whatever
    /// `cmsg_len` claims.
    #[test]
    fn rights_in_a_control_buffer_and_not_past_it() {
        // Room for one header and 3 descriptors (8-byte aligned).
        // SAFETY: arithmetic only.
        let space = unsafe { libc::CMSG_SPACE(12) as usize };
        let mut control = vec![0u64; space.div_ceil(8)];
        // SAFETY: a plain C struct, all zeros is valid.
        let mut m: msghdr = unsafe { std::mem::zeroed() };
        m.msg_control = control.as_mut_ptr().cast();
        m.msg_controllen = space;
        // SAFETY: the header and its data lie in `control`.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(12) as usize;
            for (i, fd) in [7, 8, 9].into_iter().enumerate() {
                libc::CMSG_DATA(c)
                    .cast::<c_int>()
                    .add(i)
                    .write_unaligned(fd);
            }
        }
        // SAFETY: a msghdr over `control`.
        assert_eq!(unsafe { message_fds(&m) }, vec![7, 8, 9]);
        // A length beyond the buffer, or one that would wrap: nothing read, the walk ends.
        for bad in [space + 1, 1 << 20, usize::MAX - 3] {
            // SAFETY: as above.
            unsafe { (*libc::CMSG_FIRSTHDR(&m)).cmsg_len = bad };
            // SAFETY: as above.
            assert!(unsafe { message_fds(&m) }.is_empty(), "cmsg_len {bad}");
        }
        m.msg_controllen = 4;
        // SAFETY: as above.
        assert!(unsafe { message_fds(&m) }.is_empty());
    }
}
