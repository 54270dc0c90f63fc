//! Sockets inherited through exec, recognised at start-up by their option record
//! ([`adopt`]).

use std::sync::Arc;

use parking_lot::Mutex;
use smcr::RuntimeConfig;

use super::runtime::enabled;
use crate::fds::{borrowed, inode, is_nonblocking, sock_addr};
use crate::guard::Bypass;
use crate::sock::{Listener, Role, Settling, Sock};
use crate::{log, real, table};

/// At start-up (a new program image): TCP sockets inherited from the program that exec'd us —
/// an inetd-style server's accepted connection at fd 0, a listener handed to a new binary —
/// are recognised by their option record: a marked listener is ours to accept on; an accepted
/// connection whose peer offered SMC-R and that nobody settled yet negotiates at its first
/// use here; one another process runs over SMC-R is not ours to use.
pub(crate) fn adopt() {
    if !enabled() {
        return;
    }
    let _b = Bypass::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut map = None;
    // Numbers of one socket (dup2'd onto 0 and 1 by an inetd-style parent) share one entry.
    let mut seen: std::collections::HashMap<u64, Arc<Sock>> = std::collections::HashMap::new();
    for fd in fds {
        if !is_tcp(fd) {
            continue;
        }
        if let Some(s) = inode(fd).and_then(|i| seen.get(&i)) {
            table::insert(fd, s.clone());
            continue;
        }
        let m = match &map {
            Some(m) => m,
            None => {
                let cfg = RuntimeConfig::from_env();
                let smcr::Negotiation::TcpOption { dir } = &cfg.negotiation else {
                    return;
                };
                let Ok(m) = smcr::option::OptionRecords::open(dir) else {
                    return;
                };
                map.insert(m)
            }
        };
        let Ok(st) = m.state(borrowed(fd)) else {
            continue;
        };
        if !st.marked() {
            continue;
        }
        let claim = m.claimed(borrowed(fd)).ok().flatten();
        let entry = if listening_socket(fd) {
            let bound = sock_addr(fd, false);
            Arc::new(Sock::Listener(Arc::new(Listener {
                stat: Mutex::new(None),
                bound,
            })))
        } else if let Some(c) = claim {
            if !c.smc {
                continue;
            }
            Arc::new(Sock::Inherited)
        } else if st.connecting() {
            if st.capability() != smcr::option::Capability::PeerCapable {
                continue;
            }
            // A connect whose negotiation the image before this one had begun (its worker
            // did not survive the exec): what it sent is unknown, so neither side's CLC can
            // go on, nor can the bytes be plain TCP.
            log::line(format_args!(
                "fd {fd}: a connect inherited through exec while its SMC-R negotiation ran: \
                 not usable (EIO)"
            ));
            Arc::new(Sock::Inherited)
        } else if st.capability() == smcr::option::Capability::PeerCapable {
            let peer = sock_addr(fd, true);
            let acc = Settling::new(
                Role::Server {
                    // SAFETY: getppid has no preconditions.
                    pid: unsafe { libc::getppid() } as u32,
                    forks: 0,
                    native_v6: peer.is_some_and(|p| smcr::v4_of(p).is_none()),
                },
                true,
                is_nonblocking(fd),
            );
            log::line(format_args!(
                "fd {fd}: an accepted connection from {peer:?} inherited through exec: \
                 negotiated at its first use"
            ));
            Arc::new(Sock::Accepted(acc))
        } else {
            continue;
        };
        table::insert(fd, entry.clone());
        if let Some(i) = inode(fd) {
            seen.insert(i, entry);
        }
    }
}

/// Whether `fd` is a TCP socket (IPv4 or IPv6).
fn is_tcp(fd: i32) -> bool {
    let int = |level, name| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading an int option into an int.
        let r = unsafe { real::getsockopt()(fd, level, name, (&raw mut v).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    matches!(
        int(libc::SOL_SOCKET, libc::SO_DOMAIN),
        Some(libc::AF_INET | libc::AF_INET6)
    ) && int(libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && int(libc::SOL_SOCKET, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Whether `fd` listens.
fn listening_socket(fd: i32) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reading an int option into an int.
    let r = unsafe {
        real::getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut v).cast(),
            &mut len,
        )
    };
    r == 0 && v != 0
}
