//! Raw Linux system calls for the UDP fast path.
//!
//! The engine will later run inside programs whose libc socket calls we intercept, so it must not
//! call libc's `sendmsg`/`recvmsg` (they would land in our own hooks) and must not disturb the
//! application's `errno`. rustix covers most needs, but not the UDP_SEGMENT / UDP_GRO control
//! messages, so these few calls are made here directly. `libc` is used for type layouts only.

use std::io;

#[cfg(target_arch = "x86_64")]
unsafe fn syscall6(n: libc::c_long, a: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the Linux x86-64 syscall ABI; the caller guarantees the arguments are valid.
    unsafe {
        core::arch::asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
            in("r10") a[3], in("r8") a[4], in("r9") a[5],
            lateout("rcx") _, lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

#[cfg(target_arch = "aarch64")]
unsafe fn syscall6(n: libc::c_long, a: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the Linux aarch64 syscall ABI; the caller guarantees the arguments are valid.
    unsafe {
        core::arch::asm!(
            "svc 0",
            in("x8") n as usize,
            inlateout("x0") a[0] => ret,
            in("x1") a[1], in("x2") a[2], in("x3") a[3], in("x4") a[4], in("x5") a[5],
            options(nostack),
        );
    }
    ret
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
unsafe fn syscall6(n: libc::c_long, a: [usize; 6]) -> isize {
    // Other architectures go through libc's generic wrapper (which may touch errno).
    // SAFETY: forwarded arguments, as above.
    let r = unsafe { libc::syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]) };
    if r < 0 {
        -(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO) as isize)
    } else {
        r as isize
    }
}

fn check(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::from_raw_os_error(-r as i32))
    } else {
        Ok(r as usize)
    }
}

/// `sendmsg(2)`.
///
/// # Safety
/// `msg` must describe valid buffers for the duration of the call.
pub(crate) unsafe fn sendmsg(fd: i32, msg: &libc::msghdr, flags: i32) -> io::Result<usize> {
    // SAFETY: per the function contract.
    check(unsafe {
        syscall6(
            libc::SYS_sendmsg,
            [
                fd as usize,
                msg as *const _ as usize,
                flags as usize,
                0,
                0,
                0,
            ],
        )
    })
}

/// `sendmmsg(2)`: how many of `msgs` were sent.
///
/// # Safety
/// `msgs` must describe valid buffers for the duration of the call.
pub(crate) unsafe fn sendmmsg(
    fd: i32,
    msgs: &mut [libc::mmsghdr],
    flags: i32,
) -> io::Result<usize> {
    // SAFETY: per the function contract.
    unsafe { mmsg(libc::SYS_sendmmsg, fd, msgs, flags) }
}

/// `recvmmsg(2)` without a timeout.
///
/// # Safety
/// `msgs` must describe valid, writable buffers for the duration of the call.
pub(crate) unsafe fn recvmmsg(
    fd: i32,
    msgs: &mut [libc::mmsghdr],
    flags: i32,
) -> io::Result<usize> {
    // SAFETY: per the function contract.
    unsafe { mmsg(libc::SYS_recvmmsg, fd, msgs, flags) }
}

/// `sendmmsg`/`recvmmsg` (`nr`; no timeout): how many of `msgs` went.
///
/// # Safety
/// As the two callers say.
unsafe fn mmsg(
    nr: libc::c_long,
    fd: i32,
    msgs: &mut [libc::mmsghdr],
    flags: i32,
) -> io::Result<usize> {
    // SAFETY: per the function contract.
    check(unsafe {
        syscall6(
            nr,
            [
                fd as usize,
                msgs.as_mut_ptr() as usize,
                msgs.len(),
                flags as usize,
                0,
                0,
            ],
        )
    })
}

/// `setsockopt(2)` with an `int` value.
pub(crate) fn setsockopt_int(fd: i32, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `value` outlives the call and its size is passed.
    check(unsafe {
        syscall6(
            libc::SYS_setsockopt,
            [
                fd as usize,
                level as usize,
                name as usize,
                &value as *const i32 as usize,
                4,
                0,
            ],
        )
    })
    .map(drop)
}
