//! The exported libc functions. Each one: not ours (one atomic load) or bypassed → libc;
//! ours → the shim, inside `guarded` (a panic becomes EIO, never a retry or an unwind).
//!
//! By call family: `socket` (socket, connect, listen, accept), `rw` (the read and write
//! family, with glibc's FORTIFY variants), `fd` (close, shutdown, fcntl, ioctl, dup),
//! `sockopt` (socket names and options), `readiness` (poll, select, epoll), `misc`
//! (sendfile, fork) and `lockdown` (the calls by which a program locks itself down:
//! setrlimit, prlimit, prctl(PR_SET_SECCOMP), seccomp_load, chroot). This module holds the dispatch they share: whether a call goes to an
//! SMC-R connection, to one not settled yet, or to libc.
// The exports are reached by the dynamic linker, not by Rust paths.
#![allow(unreachable_pub)]

mod exec;
mod fd;
mod lockdown;
mod misc;
mod readiness;
mod rw;
mod socket;
mod sockopt;

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use libc::{c_int, socklen_t, ssize_t};

use crate::guard::{bypassed, errno_of, guarded, set_errno};
use crate::sock::{Settling, SmcFd, Sock};
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
    Stage(Arc<Settling>),
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
                // A blocking read without SO_RCVTIMEO waits for the outcome whatever runs the
                // handshake: it runs here (server side; a client's worker runs already).
                let here = matches!(op, Op::Read { dontwait: false })
                    && !a.nonblock.load(Ordering::Relaxed)
                    && !a.read_shut()
                    && a.idle_server()
                    && timeo(fd, libc::SO_RCVTIMEO).is_none();
                if guarded(true, || a.start_on(fd, here)) {
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

pub(crate) use exec::prepare as prepare_exec;
