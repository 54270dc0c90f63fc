//! The offer: how a QP gives its same-host peer its arena, ring and doorbells, over the peer
//! device's rendezvous (an abstract Unix socket), and how each side proves it is the other end
//! of the queue pair before any descriptor changes hands.
//!
//! The exchange, on one seqpacket connection from the offering QP (the initiator) to the
//! rendezvous of its peer's device (the responder):
//!
//! 1. `HELLO` {the peer's QPN, ours, our address, nonce A} — no descriptors;
//! 2. `CHALLENGE` {nonce B, MAC("R", A, B)} — sent once the peer QP is in RTS;
//! 3. `OFFER` {MAC("I", A, B)} with the four descriptors.
//!
//! The MAC is SipHash-2-4 (128-bit output) keyed by the pair's QPNs and starting PSNs
//! ([`Pairing`]). The two PSNs are 48 random bits that travelled only inside the CLC handshake
//! on the TCP connection and in RoCE headers, which no unprivileged process can read; so a
//! process of any user that squats a rendezvous name, or connects to ours, learns nothing and
//! is refused. That proof, not the peer's user, decides: a peer of another user gets its own
//! link group's regions and ring, as over the wire.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Names the layout of what is shared too: a peer of another layout is refused (and the pair
/// uses UDP). 3: the rings' waiting word is 64 bits.
const MAGIC: [u8; 8] = *b"SMCRSHO3";
/// Every message of the exchange has this length.
pub(crate) const MSG_LEN: usize = 48;
const K_HELLO: u32 = 1;
const K_CHALLENGE: u32 = 2;
const K_OFFER: u32 = 3;

pub(crate) type Nonce = [u8; 16];
pub(crate) type Mac = [u8; 16];

/// A message of the offer exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Msg {
    Hello {
        /// The QP the offer is for (the responder's QPN).
        to_qpn: u32,
        /// The offering QP.
        from_qpn: u32,
        /// The offering device's address.
        from: SocketAddrV4,
        nonce: Nonce,
    },
    Challenge {
        nonce: Nonce,
        mac: Mac,
    },
    Offer {
        mac: Mac,
    },
}

impl Msg {
    pub(crate) fn emit(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[..8].copy_from_slice(&MAGIC);
        match *self {
            Self::Hello {
                to_qpn,
                from_qpn,
                from,
                nonce,
            } => {
                b[8..12].copy_from_slice(&K_HELLO.to_le_bytes());
                b[12..16].copy_from_slice(&to_qpn.to_le_bytes());
                b[16..20].copy_from_slice(&from_qpn.to_le_bytes());
                b[20..24].copy_from_slice(&from.ip().octets());
                b[24..26].copy_from_slice(&from.port().to_le_bytes());
                b[32..48].copy_from_slice(&nonce);
            }
            Self::Challenge { nonce, mac } => {
                b[8..12].copy_from_slice(&K_CHALLENGE.to_le_bytes());
                b[16..32].copy_from_slice(&nonce);
                b[32..48].copy_from_slice(&mac);
            }
            Self::Offer { mac } => {
                b[8..12].copy_from_slice(&K_OFFER.to_le_bytes());
                b[32..48].copy_from_slice(&mac);
            }
        }
        b
    }

    /// Never panics: anything but an exact message of the exchange is `None`.
    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        if b.len() != MSG_LEN || b[..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let arr16 = |i: usize| -> [u8; 16] {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[i..i + 16]);
            a
        };
        match u32_at(8) {
            K_HELLO => Some(Self::Hello {
                to_qpn: u32_at(12),
                from_qpn: u32_at(16),
                from: SocketAddrV4::new(
                    Ipv4Addr::new(b[20], b[21], b[22], b[23]),
                    u16::from_le_bytes([b[24], b[25]]),
                ),
                nonce: arr16(32),
            }),
            K_CHALLENGE => Some(Self::Challenge {
                nonce: arr16(16),
                mac: arr16(32),
            }),
            K_OFFER => Some(Self::Offer { mac: arr16(32) }),
            _ => None,
        }
    }
}

/// What both QPs of a pair know and nobody else does: their QPNs and starting PSNs, seen from
/// the initiator (the QP whose offer this is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pairing {
    pub(crate) initiator_qpn: u32,
    pub(crate) responder_qpn: u32,
    pub(crate) initiator_psn: u32,
    pub(crate) responder_psn: u32,
}

impl Pairing {
    /// The proof of the side `role` (`b'R'` responder, `b'I'` initiator) for these nonces.
    pub(crate) fn mac(&self, role: u8, a: &Nonce, b: &Nonce) -> Mac {
        use siphasher::sip128::Hasher128;
        use std::hash::Hasher;
        let mut key = [0u8; 16];
        key[..4].copy_from_slice(&self.initiator_qpn.to_le_bytes());
        key[4..8].copy_from_slice(&self.responder_qpn.to_le_bytes());
        key[8..12].copy_from_slice(&self.initiator_psn.to_le_bytes());
        key[12..16].copy_from_slice(&self.responder_psn.to_le_bytes());
        let mut h = siphasher::sip128::SipHasher24::new_with_key(&key);
        h.write(b"smcr same-host offer");
        h.write(&[role]);
        h.write(a);
        h.write(b);
        h.finish128().as_bytes()
    }

    /// Whether `mac` is the proof of `role` (without an early exit on the first difference).
    pub(crate) fn check(&self, role: u8, a: &Nonce, b: &Nonce, mac: &Mac) -> bool {
        let want = self.mac(role, a, b);
        want.iter().zip(mac).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
    }
}

/// 16 random bytes (`getrandom`), or an error: a guessable nonce would let a squatter replay.
pub(crate) fn nonce() -> io::Result<Nonce> {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), libc::GRND_NONBLOCK) };
    if n == b.len() as isize {
        Ok(b)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The process at the other end of a rendezvous connection (SO_PEERCRED, as seen from our
/// user namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its effective user (the overflow uid when unmapped in our user namespace).
    pub uid: u32,
    /// Its process id (0 when it is in a PID namespace we cannot see into).
    pub pid: i32,
}

pub(crate) fn peer_cred(conn: BorrowedFd<'_>) -> Option<PeerCred> {
    rustix::net::sockopt::socket_peercred(conn)
        .ok()
        .map(|c| PeerCred {
            uid: c.uid.as_raw(),
            pid: c.pid.as_raw_nonzero().get(),
        })
}

/// The abstract Unix socket name of the device at `ip` whose QPNs are in `range` (per network
/// namespace): a peer finds it from our address and the QPN it sends to.
fn rendezvous_name(ip: Ipv4Addr, range: u32) -> String {
    format!("smcr-rdma/{ip}/{range:03x}")
}

fn rendezvous_addr(ip: Ipv4Addr, range: u32) -> rustix::net::SocketAddrUnix {
    rustix::net::SocketAddrUnix::new_abstract_name(rendezvous_name(ip, range).as_bytes())
        .expect("short name")
}

/// Binds the rendezvous socket of the device at `ip` with QPN range `range` (non-blocking
/// listener). EADDRINUSE: another device of this namespace has the range.
pub(crate) fn listen(ip: Ipv4Addr, range: u32) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = crate::fdzone::place(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)?;
    rustix::net::bind(&fd, &rendezvous_addr(ip, range))?;
    rustix::net::listen(&fd, 64)?;
    Ok(fd)
}

/// The directory of the host-wide rendezvous sockets (`SMCR_RENDEZVOUS_DIR`, default
/// [`RENDEZVOUS_DIR`]): made by `smcr bpf install` (root's, mode 1777 like `/tmp`); a
/// container gets it bind-mounted. A device binds `<ip>-<range>` there as well as its abstract
/// name, so that a peer in another network namespace of this host finds it.
pub fn rendezvous_dir() -> PathBuf {
    crate::env::var("SMCR_RENDEZVOUS_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(RENDEZVOUS_DIR), PathBuf::from)
}

/// Where [`rendezvous_dir`] is unless the environment says otherwise.
pub const RENDEZVOUS_DIR: &str = "/run/smcr/rdv";

/// How many names a device may bind in [`rendezvous_dir`]: `<ip>-<range>`, then
/// `<ip>-<range>.1` … A name left by a process that died belongs to that process's user; in the
/// directory (sticky, like `/tmp`) no other user may remove it, so a later device of another
/// user with the same address and QPN range takes the next name, and peers try the names in
/// order, past the dead ones.
const FS_NAMES: usize = 4;

fn fs_path(dir: &Path, ip: Ipv4Addr, range: u32, i: usize) -> PathBuf {
    match i {
        0 => dir.join(format!("{ip}-{range:03x}")),
        i => dir.join(format!("{ip}-{range:03x}.{i}")),
    }
}

/// A device's socket in [`rendezvous_dir`] (removed with it, and at the process's exit).
pub(crate) struct FsRendezvous {
    pub(crate) fd: OwnedFd,
    path: PathBuf,
}

impl FsRendezvous {
    /// The name it has (tests).
    #[cfg(test)]
    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FsRendezvous {
    fn drop(&mut self) {
        at_exit::forget(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds the host-wide rendezvous of the device at `ip` with QPN range `range`, where the
/// directory exists and lets us: `None` for a loopback address (which no other namespace
/// reaches), without the directory, or when a live device of another namespace has the name
/// (then peers that find it there are refused by its proof, and use UDP).
pub(crate) fn listen_fs(ip: Ipv4Addr, range: u32) -> Option<FsRendezvous> {
    if ip.is_loopback() || ip.is_unspecified() {
        return None;
    }
    listen_fs_in(&rendezvous_dir(), ip, range)
}

/// [`listen_fs`] in `dir`: the first of the device's names that is free, or left by a process
/// that died — removed when its owner lets us, else passed over (the peer passes it too, as
/// nobody answers there).
fn listen_fs_in(dir: &Path, ip: Ipv4Addr, range: u32) -> Option<FsRendezvous> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let socket = || {
        rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
    };
    for i in 0..FS_NAMES {
        let path = fs_path(dir, ip, range, i);
        let addr = rustix::net::SocketAddrUnix::new(&path).ok()?;
        // Twice: once more after removing a dead one's name.
        for _ in 0..2 {
            let fd = crate::fdzone::place(socket().ok()?).ok()?;
            match rustix::net::bind(&fd, &addr) {
                Ok(()) => {
                    // Any user's peer connects (connecting needs write permission on the file).
                    let _ = rustix::fs::chmod(&path, rustix::fs::Mode::from_raw_mode(0o777));
                    rustix::net::listen(&fd, 64).ok()?;
                    at_exit::remove(&path);
                    return Some(FsRendezvous { fd, path });
                }
                Err(rustix::io::Errno::ADDRINUSE) => {
                    let probe = socket().ok()?;
                    if rustix::net::connect(&probe, &addr) != Err(rustix::io::Errno::CONNREFUSED) {
                        return None; // alive (or not a socket we may judge)
                    }
                    if std::fs::remove_file(&path).is_err() {
                        break; // another user's dead name: the next one
                    }
                }
                Err(_) => return None,
            }
        }
    }
    None
}

/// Connects to the rendezvous of the device at `peer` that owns QPNs of `range` and says
/// `hello`. Returns the connection (kept open: the peer's challenge comes on it, and closing
/// it tells the peer we are gone), or `None` when the peer is not reachable this way.
pub(crate) fn send_hello(peer: Ipv4Addr, range: u32, hello: &Msg) -> Option<OwnedFd> {
    // In our network namespace first; then across namespaces, through the host-wide one.
    let fd = match connect_abstract(peer, range) {
        Some(fd) => fd,
        None if peer.is_loopback() => return None,
        None => connect_fs_in(&rendezvous_dir(), peer, range)?,
    };
    send(fd.as_fd(), hello).ok()?;
    Some(fd)
}

fn unix_socket() -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .ok()
    .and_then(|fd| crate::fdzone::place(fd).ok())
}

fn connect_abstract(peer: Ipv4Addr, range: u32) -> Option<OwnedFd> {
    let fd = unix_socket()?;
    rustix::net::connect(&fd, &rendezvous_addr(peer, range))
        .ok()
        .map(|()| fd)
}

/// Connects to the first of the device's names in `dir` where a process listens: a name
/// nobody answers at (a dead process's) is passed over, a missing one ends the search.
fn connect_fs_in(dir: &Path, peer: Ipv4Addr, range: u32) -> Option<OwnedFd> {
    for i in 0..FS_NAMES {
        let addr = rustix::net::SocketAddrUnix::new(fs_path(dir, peer, range, i)).ok()?;
        let fd = unix_socket()?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => return Some(fd),
            Err(rustix::io::Errno::CONNREFUSED) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// The process's names in [`rendezvous_dir`] are removed when it exits (`atexit`): a name
/// left behind stays the dead process's user's, which other users cannot take over (see
/// [`FS_NAMES`]). A process killed by a signal still leaves its names.
mod at_exit {
    use parking_lot::Mutex;
    use std::path::{Path, PathBuf};

    /// Names bound by this process (pid): a forked child inherits the list, not the names.
    static NAMES: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());

    pub(super) fn remove(path: &Path) {
        static REGISTERED: std::sync::Once = std::sync::Once::new();
        REGISTERED.call_once(|| {
            // SAFETY: registering a function without arguments that only unlinks files.
            unsafe { libc::atexit(at_exit) };
        });
        NAMES.lock().push((std::process::id(), path.to_owned()));
    }

    pub(super) fn forget(path: &Path) {
        NAMES.lock().retain(|(_, p)| p != path);
    }

    extern "C" fn at_exit() {
        // Not waiting for a thread that holds the list at exit (it is about to end anyway).
        let Some(names) = NAMES.try_lock() else {
            return;
        };
        let me = std::process::id();
        for (pid, p) in names.iter() {
            if *pid == me {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Sends a message without descriptors (a whole seqpacket record, or an error).
pub(crate) fn send(conn: BorrowedFd<'_>, m: &Msg) -> io::Result<()> {
    let b = m.emit();
    let n = rustix::net::send(conn, &b, rustix::net::SendFlags::NOSIGNAL)?;
    if n == b.len() {
        Ok(())
    } else {
        Err(io::ErrorKind::WriteZero.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name in the rendezvous directory left by a dead process of another user (which the
    /// sticky directory keeps theirs) is passed over: the device binds the next name, and a
    /// peer finds it there; a dead name of our own is taken over.
    #[test]
    fn a_dead_name_of_another_user_is_passed_over() {
        use std::os::unix::fs::PermissionsExt;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: needs root (a file of another user in a sticky directory)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("smcr-rdv-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let (ip, range) = (Ipv4Addr::new(10, 1, 2, 3), 0x5a5);
        // A dead process of root's: its socket file stays, nobody listens.
        let dead = rustix::net::socket(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            None,
        )
        .unwrap();
        let name0 = rustix::net::SocketAddrUnix::new(fs_path(&dir, ip, range, 0)).unwrap();
        rustix::net::bind(&dead, &name0).unwrap();
        drop(dead);
        // As a device leaves its names: any user may connect.
        std::fs::set_permissions(
            fs_path(&dir, ip, range, 0),
            PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        // As nobody (this thread only: the raw system call, not glibc's process-wide one).
        let d = dir.clone();
        let (path, found) = std::thread::spawn(move || {
            // SAFETY: changes the calling thread's credentials only.
            let r = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
            assert_eq!(r, 0, "setresuid: {}", io::Error::last_os_error());
            let r = listen_fs_in(&d, ip, range).expect("the next name");
            let _c = connect_fs_in(&d, ip, range).expect("found past the dead name");
            let accepted = rustix::net::accept(&r.fd).is_ok();
            (r.path().to_owned(), accepted)
        })
        .join()
        .unwrap();
        assert_eq!(path, fs_path(&dir, ip, range, 1));
        assert!(
            found,
            "the peer's connection reached the device at the next name"
        );
        assert!(!path.exists(), "the name is removed with its rendezvous");
        // Root's own dead name is taken over (removed and bound again).
        let r = listen_fs_in(&dir, ip, range).unwrap();
        assert_eq!(r.path(), fs_path(&dir, ip, range, 0));
        // No device at all: nothing to connect to.
        drop(r);
        assert!(connect_fs_in(&dir, ip, range).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let msgs = [
            Msg::Hello {
                to_qpn: 0x12_3456,
                from_qpn: 0xab_cdef,
                from: "10.1.2.3:4791".parse().unwrap(),
                nonce: [7; 16],
            },
            Msg::Challenge {
                nonce: [1; 16],
                mac: [2; 16],
            },
            Msg::Offer { mac: [3; 16] },
        ];
        for m in msgs {
            let b = m.emit();
            assert_eq!(Msg::parse(&b), Some(m));
            assert_eq!(Msg::parse(&b[..MSG_LEN - 1]), None);
            let mut bad = b;
            bad[0] ^= 1;
            assert_eq!(Msg::parse(&bad), None);
            let mut kind = b;
            kind[8] = 9;
            assert_eq!(Msg::parse(&kind), None);
        }
    }

    #[test]
    fn a_proof_depends_on_every_secret_and_the_role() {
        let p = Pairing {
            initiator_qpn: 0x40_0001,
            responder_qpn: 0x80_0002,
            initiator_psn: 0x12_3456,
            responder_psn: 0x65_4321,
        };
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let m = p.mac(b'R', &a, &b);
        assert!(p.check(b'R', &a, &b, &m));
        assert!(
            !p.check(b'I', &a, &b, &m),
            "a responder's proof is not an initiator's"
        );
        assert!(!p.check(b'R', &b, &a, &m));
        for q in [
            Pairing {
                initiator_psn: p.initiator_psn ^ 1,
                ..p
            },
            Pairing {
                responder_psn: p.responder_psn ^ 0x80_0000,
                ..p
            },
            Pairing {
                responder_qpn: p.responder_qpn + 1,
                ..p
            },
        ] {
            assert!(!q.check(b'R', &a, &b, &m));
        }
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
