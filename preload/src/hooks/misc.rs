//! sendfile/sendfile64 (`crate::sendfile` when an end is ours) and fork (fork tracking for
//! accepted connections).

use std::io;
use std::sync::Arc;

use libc::{c_int, size_t, ssize_t};

use super::{Op, Target, as_smc, ret_len, target};
use crate::guard::{bypassed, errno, guarded, set_errno};
use crate::sock::Sock;
use crate::{real, shim};

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

/// # Safety
/// libc's contract for fork(2).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    // What this thread corked leaves from the parent, before the child gets a copy.
    smcr::cork::end();
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
