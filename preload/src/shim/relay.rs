//! An SMC-R connection this process runs, passed to another process over a Unix socket
//! (SCM_RIGHTS): its state — link group, receive buffer, cursors — is this process's and
//! cannot follow the descriptor, so the other process gets one end of a Unix socketpair
//! instead of the TCP socket, and this process keeps serving the connection, relaying bytes
//! between the pair and the connection until both directions are closed ([`prepare`],
//! [`start`]). The receiver reads and writes as before; what it sees differently is the
//! socket itself (a Unix socket: `getpeername`, TCP options). The connection lives as long as
//! the relay, whatever the sender's program does with its own number, and ends with this
//! process.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use smcr::{Blocking, SmcStream};

use crate::sock::Sock;
use crate::{log, real, table};

/// One connection about to be relayed.
pub(crate) struct Relay {
    /// The program's number of the connection (what the message named).
    pub(crate) fd: i32,
    /// The receiver's end of the pair (what the message carries instead).
    pub(crate) theirs: OwnedFd,
    ours: OwnedFd,
    conn: SmcStream,
}

/// The relays for the SMC-R connections of this process among `fds` (a message's
/// descriptors).
pub(crate) fn prepare(fds: &[i32]) -> Vec<Relay> {
    let mut out = Vec::new();
    for &fd in fds {
        if out.iter().any(|r: &Relay| r.fd == fd) {
            continue;
        }
        let Some(sock) = table::get(fd) else { continue };
        let Sock::Smc(c) = &*sock else { continue };
        let _b = crate::guard::Bypass::new();
        // What the program wrote before the connection was settled goes first.
        if c.flush_preamble(Blocking::Yes(None)).is_err() {
            continue;
        }
        let Ok(conn) = c.stream.try_clone() else {
            continue;
        };
        let mut sv = [0; 2];
        // SAFETY: a socketpair into a local array.
        if unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                sv.as_mut_ptr(),
            )
        } != 0
        {
            continue;
        }
        // SAFETY: a descriptor socketpair just made, owned here (ours goes out of the
        // program's numbers; theirs leaves with the message).
        let theirs = unsafe { OwnedFd::from_raw_fd(sv[0]) };
        let Ok(ours) = crate::fds::hide_owned(sv[1]) else {
            continue;
        };
        // The receiver's number behaves as the sender's did: non-blocking stays so.
        if c.nonblock.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: fcntl on the pair's end we own.
            unsafe {
                let fl = libc::fcntl(theirs.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(theirs.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
        }
        out.push(Relay {
            fd,
            theirs,
            ours,
            conn,
        });
    }
    out
}

/// The message went: each relay runs (two threads: one per direction); the receiver's ends
/// close here.
pub(crate) fn start(relays: Vec<Relay>) {
    for r in relays {
        let Relay {
            fd,
            theirs,
            ours,
            conn,
        } = r;
        drop(theirs);
        log::line(format_args!(
            "fd {fd}: an SMC-R connection passed to another process: this process relays it (the receiver holds a Unix socket)"
        ));
        let ours = std::sync::Arc::new(ours);
        let (Ok(back), Ok(end)) = (conn.try_clone(), conn.try_clone()) else {
            // SAFETY: our end of the pair; the receiver reads EOF at once.
            unsafe { real::shutdown()(ours.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = conn.shutdown(std::net::Shutdown::Both);
            continue;
        };
        let (o1, o2) = (ours.clone(), ours.clone());
        let down = smcr::thread::spawn("smcr-relay".into(), move || to_receiver(&conn, &o1));
        let up = smcr::thread::spawn("smcr-relay".into(), move || from_receiver(&back, &o2));
        if down.is_err() || up.is_err() {
            // A relay one way only would leave the other end waiting: both ends see the
            // connection end (a running half stops on it).
            // SAFETY: our end of the pair.
            unsafe { real::shutdown()(ours.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = end.shutdown(std::net::Shutdown::Both);
            log::line(format_args!(
                "fd {fd}: no thread to relay the passed connection: it ends"
            ));
        }
    }
}

/// The peer's bytes to the receiver, until the peer closes (then the receiver reads EOF).
fn to_receiver(conn: &SmcStream, ours: &OwnedFd) {
    let _b = crate::guard::Bypass::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match conn.recv(&mut buf, false, Blocking::Yes(None)) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if write_all(ours.as_raw_fd(), &buf[..n]).is_err() {
                    // The receiver is gone: what the peer sends has nowhere to go.
                    let _ = conn.shutdown(std::net::Shutdown::Read);
                    return;
                }
            }
        }
    }
    // SAFETY: shutting our end of the pair down for writing.
    unsafe { real::shutdown()(ours.as_raw_fd(), libc::SHUT_WR) };
}

/// The receiver's bytes to the peer, until the receiver closes (then the peer reads EOF).
fn from_receiver(conn: &SmcStream, ours: &OwnedFd) {
    let _b = crate::guard::Bypass::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: reading into our buffer from our end of the pair.
        let n = unsafe { real::read()(ours.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 && crate::guard::errno() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            break;
        }
        let mut part = &buf[..n as usize];
        while !part.is_empty() {
            match conn.send(part, Blocking::Yes(None)) {
                Ok(m) => part = &part[m..],
                Err(_) => return,
            }
        }
    }
    let _ = conn.shutdown(std::net::Shutdown::Write);
}

fn write_all(fd: i32, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: writing from our buffer to our end of the pair.
        let n = unsafe { real::send()(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            if crate::guard::errno() == libc::EINTR {
                continue;
            }
            return Err(std::io::Error::last_os_error());
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}
