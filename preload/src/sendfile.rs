//! `sendfile` with an SMC-R socket at either end: the kernel cannot reach our buffers, so the
//! bytes go through a user-space copy, with sendfile's contract kept: the source's offset (or
//! file position) advances by exactly what was sent, so nothing is skipped or sent twice.

use std::io;

use crate::guard::set_errno;
use crate::real;
use crate::sock::SmcFd;

/// One end of the copy.
pub(crate) enum End<'a> {
    Smc(&'a SmcFd),
    Fd(i32),
}

const CHUNK: usize = 64 * 1024;

/// Copies up to `count` bytes from `src` to `dst`; `offset` as sendfile(2).
pub(crate) fn copy(dst: End<'_>, src: End<'_>, offset: Option<&mut i64>, count: usize) -> isize {
    let mut buf = vec![0u8; CHUNK.min(count.max(1))];
    // Where a plain source's position lives: the caller's offset, the file position (seekable),
    // or nowhere (a pipe, a socket: what was read is gone, so it must all be sent).
    let src_fd = match src {
        End::Fd(fd) => Some(fd),
        End::Smc(_) => None,
    };
    let mut pos: Option<i64> = match (&offset, src_fd) {
        (Some(o), _) => Some(**o),
        // SAFETY: querying the file position of the caller's descriptor.
        (None, Some(fd)) => Some(unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) }).filter(|&p| p >= 0),
        (None, None) => None,
    };
    let mut total = 0usize;
    while total < count {
        let want = buf.len().min(count - total);
        let got = match (&src, pos) {
            (End::Smc(c), _) => c.recv(&mut buf[..want], 0),
            // SAFETY: reading into our buffer at the source's offset.
            (End::Fd(fd), Some(p)) => {
                cvt(unsafe { libc::pread(*fd, buf.as_mut_ptr().cast(), want, p) })
            }
            // SAFETY: reading into our buffer.
            (End::Fd(fd), None) => cvt(unsafe { real::read()(*fd, buf.as_mut_ptr().cast(), want) }),
        };
        let got = match got {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if total > 0 && would_block(&e) => break,
            Err(e) => return fail(total, e),
        };
        let sent = match send(&dst, &buf[..got]) {
            Ok(n) => n,
            Err(e) if pos.is_some() && total > 0 && would_block(&e) => 0,
            Err(e) if pos.is_some() => return fail(total, e),
            Err(e) => {
                // Read from a source that cannot rewind: the bytes must still go.
                match send_all(&dst, &buf[..got]) {
                    Ok(()) => got,
                    Err(_) => return fail(total, e),
                }
            }
        };
        let sent = if sent < got && pos.is_none() {
            match send_all(&dst, &buf[sent..got]) {
                Ok(()) => got,
                Err(_) => sent,
            }
        } else {
            sent
        };
        total += sent;
        if let Some(p) = pos.as_mut() {
            *p += sent as i64;
        }
        if sent < got {
            break;
        }
    }
    match (offset, pos, src_fd) {
        (Some(o), Some(p), _) => *o = p,
        // SAFETY: moving the caller's file position past what was sent.
        (None, Some(p), Some(fd)) => unsafe {
            libc::lseek(fd, p, libc::SEEK_SET);
        },
        _ => {}
    }
    total as isize
}

fn cvt(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

fn fail(total: usize, e: io::Error) -> isize {
    if total > 0 {
        return total as isize;
    }
    set_errno(crate::guard::errno_of(&e));
    -1
}

fn send(dst: &End<'_>, b: &[u8]) -> io::Result<usize> {
    match dst {
        End::Smc(c) => c.send(b, 0),
        // SAFETY: writing our buffer.
        End::Fd(fd) => cvt(unsafe { real::write()(*fd, b.as_ptr().cast(), b.len()) }),
    }
}

/// Sends all of `b`, waiting for room even on a non-blocking destination.
fn send_all(dst: &End<'_>, mut b: &[u8]) -> io::Result<()> {
    while !b.is_empty() {
        let r = match dst {
            End::Smc(c) => c
                .flush_preamble(smcr::Blocking::Yes(None))
                .and_then(|()| c.stream.send(b, smcr::Blocking::Yes(None))),
            End::Fd(fd) => {
                let mut p = libc::pollfd {
                    fd: *fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: waiting on the caller's descriptor.
                unsafe { libc::poll(&mut p, 1, -1) };
                send(dst, b)
            }
        };
        match r {
            Ok(n) => b = &b[n..],
            Err(e) if would_block(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
