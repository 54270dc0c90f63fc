//! Sockets that reach this process from another one — inherited through exec, recognised at
//! start-up ([`adopt`]), or received over a Unix socket (SCM_RIGHTS, [`received`]) — by their
//! option record, which lives on the socket: whatever process marked or accepted it, the
//! record says whether it is a marked listener, an accepted connection whose peer offered
//! SMC-R and that nobody settled yet, or one another process runs.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use smcr::RuntimeConfig;
use smcr::option::OptionRecords;

use super::runtime::enabled;
use crate::fds::{borrowed, inode, is_nonblocking, sock_addr};
use crate::guard::Bypass;
use crate::sock::{Listener, Role, Settling, Sock};
use crate::{log, real, table};

/// Where a socket came from: who may hold it still (the sharing check of its first use).
#[derive(Clone, Copy)]
enum Origin {
    /// Inherited through exec from our parent.
    Exec,
    /// Received over a Unix socket from process `from` (its credentials).
    Received { from: u32 },
}

/// The option records of this process's configuration (opened once: a probe socket each).
pub(super) fn records() -> Option<OptionRecords> {
    static R: OnceLock<Option<OptionRecords>> = OnceLock::new();
    *R.get_or_init(|| {
        let cfg = RuntimeConfig::from_env();
        let smcr::Negotiation::TcpOption { dir } = &cfg.negotiation else {
            return None;
        };
        OptionRecords::open(dir).ok()
    })
}

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
    recognise(&fds, Origin::Exec);
}

/// After a `recvmsg` that received descriptors (`fds`, SCM_RIGHTS) on the Unix socket `on`:
/// the TCP sockets among them are recognised as at exec — a primary that accepts and hands
/// each connection to a worker (a cluster-mode server), a listener passed to the process
/// that accepts on it. The sender is the peer of `on` (its credentials).
pub(crate) fn received(on: i32, fds: &[i32]) {
    if !enabled() || fds.is_empty() {
        return;
    }
    let _b = Bypass::new();
    let from = peer_pid(on).unwrap_or(0);
    for &fd in fds {
        // A number just made by the kernel: nothing of an earlier socket at it may stay.
        crate::epoll::forget(fd);
        table::remove(fd);
    }
    recognise(fds, Origin::Received { from });
}

/// The pid of the process at the other end of Unix socket `fd` (as it connected, or made the
/// pair).
pub(super) fn peer_pid(fd: i32) -> Option<u32> {
    // SAFETY: an all-zero ucred is valid; reading the option into it.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: reading SO_PEERCRED into a ucred of the right size.
    let r = unsafe {
        real::getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &mut len,
        )
    };
    (r == 0 && c.pid > 0).then_some(c.pid as u32)
}

fn recognise(fds: &[i32], origin: Origin) {
    // Numbers of one socket (dup2'd onto 0 and 1 by an inetd-style parent) share one entry.
    let mut seen: std::collections::HashMap<u64, Arc<Sock>> = std::collections::HashMap::new();
    for &fd in fds {
        if !is_tcp(fd) {
            continue;
        }
        if let Some(s) = inode(fd).and_then(|i| seen.get(&i)) {
            table::insert(fd, s.clone());
            continue;
        }
        let Some(m) = records() else {
            return;
        };
        let Some(entry) = entry_for(fd, &m, origin) else {
            continue;
        };
        table::insert(fd, entry.clone());
        if let Some(i) = inode(fd) {
            seen.insert(i, entry);
        }
    }
}

/// The table entry for TCP socket `fd` that came from `origin`, by its option record.
fn entry_for(fd: i32, m: &OptionRecords, origin: Origin) -> Option<Arc<Sock>> {
    let how = match origin {
        Origin::Exec => "inherited through exec".to_owned(),
        Origin::Received { from } => format!("received from process {from}"),
    };
    let st = m.state(borrowed(fd)).ok()?;
    if !st.marked() {
        return None;
    }
    let claim = m.claimed(borrowed(fd)).ok().flatten();
    Some(if listening_socket(fd) {
        let bound = sock_addr(fd, false);
        log::line(format_args!("fd {fd}: a listener {how} ({bound:?})"));
        Arc::new(Sock::Listener(Arc::new(Listener {
            stat: Mutex::new(None),
            bound,
            handed_off: Default::default(),
        })))
    } else if let Some(c) = claim {
        if !c.smc {
            return None;
        }
        Arc::new(Sock::Inherited)
    } else if st.connecting() {
        if st.capability() != smcr::option::Capability::PeerCapable {
            return None;
        }
        // A connect whose negotiation the process before us had begun (its worker did not
        // come along): what it sent is unknown, so neither side's CLC can go on, nor can the
        // bytes be plain TCP.
        log::line(format_args!(
            "fd {fd}: a connect {how} while its SMC-R negotiation ran: not usable (EIO)"
        ));
        Arc::new(Sock::Inherited)
    } else if st.capability() == smcr::option::Capability::PeerCapable {
        let peer = sock_addr(fd, true);
        let holder = match origin {
            // SAFETY: getppid has no preconditions.
            Origin::Exec => (unsafe { libc::getppid() }) as u32,
            Origin::Received { from } => from,
        };
        let acc = Settling::new(
            Role::Server {
                pid: holder,
                forks: 0,
                native_v6: peer.is_some_and(|p| smcr::v4_of(p).is_none()),
            },
            true,
            is_nonblocking(fd),
        );
        log::line(format_args!(
            "fd {fd}: an accepted connection from {peer:?} {how}: negotiated at its first use"
        ));
        Arc::new(Sock::Accepted(acc))
    } else {
        return None;
    })
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
