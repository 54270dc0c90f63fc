//! SMC-R capability signalling: TCP option 254 (`fe 06 e2 d4 c3 d9`) in SYN and SYN-ACK, written
//! by a sock_ops eBPF program for the sockets we mark, exactly where Linux writes it.
//!
//! Two sides:
//! * [`install`] (root, once per machine, done by `smcr bpf install`, the launcher or a test):
//!   loads the program and its per-socket storage map, and two cgroup socket-option programs
//!   ([`sockopt`]) that let any process mark its sockets and read their records; attaches all
//!   three to the cgroup v2 root through bpf links and pins map and links under a bpffs
//!   directory ([`DEFAULT_DIR`], root-only) so they outlive the loader.
//! * [`OptionRecords`] (every process using SMC-R): [`OptionRecords::mark`]s a socket before
//!   `connect`/`listen`, and reads [`OptionRecords::state`] after the handshake to learn whether
//!   the peer sent the option — with `setsockopt`/`getsockopt` on a private level, which every
//!   service's system-call filter allows: the application never calls `bpf(2)` (a
//!   `SystemCallFilter=~@privileged` would kill it) and needs no pin, no capability and no
//!   view of bpffs. A process can only name sockets it holds.
//!
//! Programs in other cgroup hierarchies, network namespaces, mount namespaces and user
//! namespaces are covered: the attachment is at the cgroup v2 root, and the programs run for
//! every TCP socket in the cgroup tree whatever its namespaces.

pub(crate) mod asm;
mod claim;
mod prog;
pub mod sockopt;
pub(crate) mod sys;
#[doc(hidden)]
pub mod xdp;

use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub use claim::{CLAIMED_SMC, CLAIMED_TCP, CONNECTING, Claim};
pub use prog::{ESTABLISHED, MARKED, OPTION, PEER};

/// Where [`install`] pins by default.
pub const DEFAULT_DIR: &str = "/sys/fs/bpf/smcr";

/// The same pins seen through a bind mount of `/sys/fs/bpf` at `/run/smcr/bpf`, which
/// [`install`] makes: `ip netns exec` remounts `/sys` for the namespace (without the bpf
/// filesystem), while `/run` stays.
pub const MIRROR_DIR: &str = "/run/smcr/bpf/smcr";

/// The pin directory a process uses when none is configured: [`DEFAULT_DIR`], or its mirror
/// [`MIRROR_DIR`] when `/sys/fs/bpf` is not mounted where this process looks (a program
/// under `ip netns exec`).
pub fn default_dir() -> PathBuf {
    let default = Path::new(DEFAULT_DIR);
    if !default.join(MAP_PIN).exists() && Path::new(MIRROR_DIR).join(MAP_PIN).exists() {
        return PathBuf::from(MIRROR_DIR);
    }
    default.to_path_buf()
}

/// Makes `/sys/fs/bpf` visible at `/run/smcr/bpf` too (a bind mount; root), so programs
/// whose `/sys` is another one (`ip netns exec`) find the pins. Nothing when it is already.
pub fn ensure_mirror() -> io::Result<()> {
    let target = Path::new(MIRROR_DIR)
        .parent()
        .expect("the mirror has a parent")
        .to_path_buf();
    let mounts = mounts_of("bpf")?;
    if mounts.iter().any(|m| m == &target) {
        return Ok(());
    }
    fs::create_dir_all(&target)?;
    let src = c"/sys/fs/bpf";
    let dst = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid NUL-terminated strings; a bind mount of one directory onto another.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pin names (bpffs refuses names with a dot); the suffix changes whenever the program or the value layout does, so an old pin
/// is never used with a new layout.
const MAP_PIN: &str = "sk_opt_map_v1";
const PROG_PIN: &str = "sk_opt_prog_v4";
const LINK_PIN: &str = "sk_opt_link_v4";
/// The socket-option programs' links ([`sockopt`]).
const SET_LINK_PIN: &str = "sk_opt_set_link_v4";
const GET_LINK_PIN: &str = "sk_opt_get_link_v4";
/// The listening ports whose SYN-ACKs may offer SMC-R ([`prog`]).
const PORTS_PIN: &str = "sk_opt_ports_v1";
/// Pins of earlier programs, removed by [`install`] and [`uninstall`]: the new sock_ops
/// program would otherwise run beside an old one.
const LEGACY_PINS: [&str; 13] = [
    "sk_opt_link_v1",
    "sk_opt_prog_v1",
    "sk_opt_set_link_v1",
    "sk_opt_get_link_v1",
    "sk_opt_link_v2",
    "sk_opt_prog_v2",
    "sk_opt_set_link_v2",
    "sk_opt_get_link_v2",
    "sk_opt_quiet_v1",
    "sk_opt_link_v3",
    "sk_opt_prog_v3",
    "sk_opt_set_link_v3",
    "sk_opt_get_link_v3",
];

/// Name of the program and map as `bpftool` shows them.
const PROG_NAME: &str = "smcr_sk_opt";
const SET_PROG_NAME: &str = "smcr_sk_opt_set";
const GET_PROG_NAME: &str = "smcr_sk_opt_get";
const MAP_NAME: &str = "smcr_sk_opt";
const PORTS_MAP_NAME: &str = "smcr_ports";
/// The program is our own code; this licence string lets it use every helper it calls.
const LICENSE: &str = "Dual MIT/GPL";

/// Why the option machinery is unavailable. Each maps to a local fallback reason.
#[derive(Debug, thiserror::Error)]
pub enum OptionError {
    /// The caller may not use bpf(2) for this (`EPERM`/`EACCES`): not root for [`install`].
    #[error("no permission to use BPF ({what}): {source}")]
    NoPermission {
        /// The step that was refused.
        what: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// The programs are not installed: the private socket option of the install pinned at
    /// `path` is not answered (the kernel refuses the level).
    #[error(
        "the SMC-R option program is not installed (the install under {path} does not answer its socket option); run `smcr bpf install` as root"
    )]
    NotInstalled {
        /// The pin directory of the install that was looked for.
        path: PathBuf,
    },
    /// No cgroup v2 hierarchy is mounted, so there is nothing to attach to.
    #[error("no cgroup v2 hierarchy is mounted")]
    NoCgroup2,
    /// Another kernel error, with the step that failed (and the verifier log for a load).
    #[error("{what}: {source}")]
    Kernel {
        /// The step that failed.
        what: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
}

impl OptionError {
    fn from_io(what: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => Self::NoPermission { what, source },
            _ => Self::Kernel { what, source },
        }
    }
}

/// What [`install`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Installed {
    /// Loaded, attached to `cgroup` and pinned now.
    Fresh {
        /// The cgroup v2 directory the program is attached to.
        cgroup: PathBuf,
    },
    /// Already installed (by us earlier or by a concurrent installer); nothing changed.
    Present,
}

/// The program's record for one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SockOption(pub u32);

impl SockOption {
    /// We marked this socket (or the listener it was accepted from).
    pub fn marked(self) -> bool {
        self.0 & MARKED != 0
    }
    /// Marked by a process that connects with it (a client, not an accepted connection).
    pub fn connecting(self) -> bool {
        self.0 & CONNECTING != 0
    }
    /// The program saw the handshake of this marked socket complete.
    pub fn established(self) -> bool {
        self.0 & ESTABLISHED != 0
    }
    /// The peer's SYN or SYN-ACK carried the SMC-R option.
    pub fn peer(self) -> bool {
        self.0 & PEER != 0
    }
    /// The verdict after the TCP handshake.
    pub fn capability(self) -> Capability {
        match (self.marked(), self.established(), self.peer()) {
            (true, true, true) => Capability::PeerCapable,
            (true, true, false) => Capability::PeerNotCapable,
            (true, false, _) => Capability::NotObserved,
            (false, ..) => Capability::NotMarked,
        }
    }
}

/// Whether SMC-R may be tried on an established TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Both ends sent the option: the CLC handshake follows.
    PeerCapable,
    /// The peer did not send the option (Linux: fallback `PEERNOSMC`, no CLC bytes).
    PeerNotCapable,
    /// The socket was marked but the program never saw its handshake: it is not attached for
    /// this socket's cgroup, or was removed meanwhile.
    NotObserved,
    /// The socket was not marked.
    NotMarked,
}

/// The option program's per-socket records, as each process using SMC-R reaches them: socket
/// options on the private level [`sockopt::SOL_SMCR`], answered by the install's cgroup
/// programs. Holds no descriptor.
#[derive(Debug, Clone, Copy)]
pub struct OptionRecords {
    /// [`sockopt::install_id`] of the install.
    id: u16,
}

impl OptionRecords {
    /// The records of the install pinned under `dir` (normally [`DEFAULT_DIR`]), after
    /// checking that its programs answer (one `getsockopt` on a throwaway TCP socket); touches
    /// nothing under `dir`, which a sandboxed process may not see.
    pub fn open(dir: &Path) -> Result<Self, OptionError> {
        let me = Self {
            id: sockopt::install_id(dir),
        };
        let probe = raw::socket().map_err(|e| OptionError::from_io("open a probe socket", e))?;
        match me.record(probe.as_fd()) {
            Ok(_) => Ok(me),
            // The kernel's own answer for an unknown level (ip_getsockopt: EOPNOTSUPP;
            // setsockopt: ENOPROTOOPT).
            Err(OptionError::Kernel { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::ENOPROTOOPT)
                ) =>
            {
                Err(OptionError::NotInstalled {
                    path: dir.to_path_buf(),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Marks `sock` (before `connect` or `listen`) so the program writes the option for it;
    /// `connecting`: before `connect` (recorded as [`CONNECTING`], so that a program the
    /// socket reaches through `exec` knows it is the client's end).
    pub fn mark(&self, sock: BorrowedFd<'_>, connecting: bool) -> Result<(), OptionError> {
        let flags = if connecting {
            MARKED | CONNECTING
        } else {
            MARKED
        };
        let mut v = [0u8; 8];
        v[..4].copy_from_slice(&flags.to_ne_bytes());
        self.set_record(sock, &v)
            .map_err(|e| OptionError::from_io("mark the socket", e))
    }

    /// Removes the mark (and any record) from `sock`.
    pub fn unmark(&self, sock: BorrowedFd<'_>) -> Result<(), OptionError> {
        raw::setsockopt(
            sock,
            sockopt::SOL_SMCR,
            sockopt::optname(self.id, sockopt::OP_DELETE),
            &[0; 8],
        )
        .map_err(|e| OptionError::from_io("unmark the socket", e))
    }

    /// Makes listener `sock` quiet: its record goes, and no SYN-ACK from its port (in its
    /// network namespace) carries the option until a marked socket listens there again —
    /// before the listener reaches a program that cannot negotiate (an `exec` without the
    /// library, a process without it), so that no peer is told we speak SMC-R.
    pub fn quiet(&self, sock: BorrowedFd<'_>) -> Result<(), OptionError> {
        raw::setsockopt(
            sock,
            sockopt::SOL_SMCR,
            sockopt::optname(self.id, sockopt::OP_QUIET),
            &[0; 8],
        )
        .map_err(|e| OptionError::from_io("quiet the listener", e))
    }

    /// The program's record for `sock` (all flags clear when it has none).
    pub fn state(&self, sock: BorrowedFd<'_>) -> Result<SockOption, OptionError> {
        let v = self.record(sock)?;
        Ok(SockOption(u32::from_ne_bytes(
            v[..4].try_into().expect("4 bytes"),
        )))
    }

    /// The socket's 8-byte record (zeros when it has none).
    fn record(&self, sock: BorrowedFd<'_>) -> Result<[u8; 8], OptionError> {
        raw::getsockopt(
            sock,
            sockopt::SOL_SMCR,
            sockopt::optname(self.id, sockopt::OP_RECORD),
        )
        .map_err(|e| OptionError::from_io("read the socket's record", e))
    }

    fn set_record(&self, sock: BorrowedFd<'_>, v: &[u8; 8]) -> io::Result<()> {
        raw::setsockopt(
            sock,
            sockopt::SOL_SMCR,
            sockopt::optname(self.id, sockopt::OP_RECORD),
            v,
        )
    }
}

/// The three calls the records need, as raw system calls: inside the preload, libc's
/// `setsockopt`/`getsockopt`/`socket` are our own hooks.
mod raw {
    use std::io;
    use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

    fn check(r: libc::c_long) -> io::Result<libc::c_long> {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// A TCP socket to probe with (close-on-exec).
    pub(super) fn socket() -> io::Result<OwnedFd> {
        // SAFETY: socket(2) with constant arguments; the result is a new descriptor we own.
        let fd = check(unsafe {
            libc::syscall(
                libc::SYS_socket,
                libc::AF_INET,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
            )
        })?;
        // SAFETY: fd was just returned by socket(2) and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    pub(super) fn setsockopt(
        sock: BorrowedFd<'_>,
        level: i32,
        name: i32,
        value: &[u8; 8],
    ) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: value is valid for reads of its 8 bytes for the whole call.
        check(unsafe {
            libc::syscall(
                libc::SYS_setsockopt,
                sock.as_raw_fd(),
                level,
                name,
                value.as_ptr(),
                value.len() as libc::socklen_t,
            )
        })
        .map(drop)
    }

    pub(super) fn getsockopt(sock: BorrowedFd<'_>, level: i32, name: i32) -> io::Result<[u8; 8]> {
        use std::os::fd::AsRawFd;
        let mut v = [0u8; 8];
        let mut len = v.len() as libc::socklen_t;
        // SAFETY: v and len are valid for writes for the whole call; len says v's size.
        check(unsafe {
            libc::syscall(
                libc::SYS_getsockopt,
                sock.as_raw_fd(),
                level,
                name,
                v.as_mut_ptr(),
                &mut len,
            )
        })?;
        if len as usize != v.len() {
            return Err(io::Error::other(format!(
                "the option program returned {len} bytes, not 8"
            )));
        }
        Ok(v)
    }
}

/// Loads, attaches and pins the option program under `dir` unless it is already there. Needs
/// root (CAP_BPF + CAP_NET_ADMIN and write access to bpffs). Mounts bpffs on `/sys/fs/bpf` when
/// `dir` is below it and nothing is mounted there.
pub fn install(dir: &Path) -> Result<Installed, OptionError> {
    ensure_rendezvous_dir();
    let mirror = || {
        if dir.starts_with("/sys/fs/bpf") {
            // Best effort: without it, `smcr run` under `ip netns exec` does not see the pins
            // (the programs themselves serve every namespace).
            let _ = ensure_mirror();
        }
    };
    // An install from before the socket-option programs opened the map to every user; only
    // installers open it now.
    let restrict = || {
        let _ = fs::set_permissions(dir.join(MAP_PIN), fs::Permissions::from_mode(0o600));
    };
    if is_installed(dir) {
        mirror();
        restrict();
        return Ok(Installed::Present);
    }
    let _lock = lock_installs(dir)?;
    ensure_bpffs(dir)?;
    if is_installed(dir) {
        // Another installer finished while this one waited.
        mirror();
        restrict();
        return Ok(Installed::Present);
    }
    mirror();
    let cgroup = cgroup2_root()?.ok_or(OptionError::NoCgroup2)?;
    let cg = fs::File::open(&cgroup).map_err(|e| OptionError::from_io("open the cgroup", e))?;
    // Earlier programs detach as their links' pins go (programs started before keep working
    // with what they marked, as TCP when the new programs do not know their marks).
    for name in LEGACY_PINS {
        let _ = fs::remove_file(dir.join(name));
    }
    let mut fresh = false;
    if !dir.join(PORTS_PIN).exists() {
        // The map first: a user who may not make one leaves no directory behind.
        let q = sys::map_create(
            sys::BPF_MAP_TYPE_LRU_HASH,
            PORTS_MAP_NAME,
            prog::PORT_KEY_SIZE,
            prog::PORT_VALUE_SIZE,
            prog::PORT_ENTRIES,
        )
        .map_err(|e| OptionError::from_io("create the listening-ports map", e))?;
        match fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(OptionError::from_io("create the pin directory", e)),
        }
        match sys::obj_pin(q.as_raw_fd(), &dir.join(PORTS_PIN).to_string_lossy()) {
            Ok(()) => fresh = true,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(OptionError::from_io("pin the listening-ports map", e)),
        }
        let _ = fs::set_permissions(dir.join(PORTS_PIN), fs::Permissions::from_mode(0o600));
    }
    let ports = sys::obj_get(&dir.join(PORTS_PIN).to_string_lossy())
        .map_err(|e| OptionError::from_io("open the listening-ports map", e))?;
    if !(dir.join(LINK_PIN).exists() && dir.join(MAP_PIN).exists()) {
        fresh |= install_sock_ops(dir, &cg, ports.as_raw_fd())?;
    }
    restrict();
    // The pinned map, ours or a concurrent installer's: the socket-option programs must
    // serve the map the sock_ops program reads.
    let map = sys::obj_get(&dir.join(MAP_PIN).to_string_lossy())
        .map_err(|e| OptionError::from_io("open the pinned map", e))?;
    let id = sockopt::install_id(dir);
    let (map_fd, ports_fd) = (map.as_raw_fd(), ports.as_raw_fd());
    let sockopts: [(&str, u32, &str, Vec<asm::Insn>); 2] = [
        (
            SET_LINK_PIN,
            sys::BPF_CGROUP_SETSOCKOPT,
            SET_PROG_NAME,
            sockopt::set_program(map_fd, ports_fd, id),
        ),
        (
            GET_LINK_PIN,
            sys::BPF_CGROUP_GETSOCKOPT,
            GET_PROG_NAME,
            sockopt::get_program(map_fd, id),
        ),
    ];
    for (pin, hook, name, insns) in sockopts {
        if dir.join(pin).exists() {
            continue;
        }
        let prog = sys::prog_load_for(
            sys::BPF_PROG_TYPE_CGROUP_SOCKOPT,
            hook,
            name,
            &insns,
            LICENSE,
        )
        .map_err(|e| OptionError::from_io("load a socket-option program", e))?;
        let link = sys::link_create_cgroup(prog.as_raw_fd(), cg.as_raw_fd(), hook)
            .map_err(|e| OptionError::from_io("attach a socket-option program", e))?;
        match sys::obj_pin(link.as_raw_fd(), &dir.join(pin).to_string_lossy()) {
            Ok(()) => fresh = true,
            // A concurrent installer's is there; dropping ours detaches it.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(OptionError::from_io("pin a socket-option link", e)),
        }
    }
    Ok(if fresh {
        Installed::Fresh { cgroup }
    } else {
        Installed::Present
    })
}

/// Loads the sock_ops program and its map, attaches it to `cg` and pins both under `dir`;
/// false when a concurrent installer pinned its own first.
fn install_sock_ops(dir: &Path, cg: &fs::File, ports_fd: i32) -> Result<bool, OptionError> {
    let btf = sys::btf_load(&prog::btf()).map_err(|e| OptionError::from_io("load BTF", e))?;
    let map = sys::sk_storage_create(
        MAP_NAME,
        prog::VALUE_SIZE,
        btf.as_raw_fd(),
        prog::BTF_KEY_TYPE,
        prog::BTF_VALUE_TYPE,
    )
    .map_err(|e| OptionError::from_io("create the sk_storage map", e))?;
    let program = sys::prog_load_sock_ops(
        PROG_NAME,
        &prog::program(map.as_raw_fd(), ports_fd),
        LICENSE,
    )
    .map_err(|e| OptionError::from_io("load the sock_ops program", e))?;
    let link = sys::link_create_cgroup_sock_ops(program.as_raw_fd(), cg.as_raw_fd())
        .map_err(|e| OptionError::from_io("attach to the cgroup", e))?;

    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(OptionError::from_io("create the pin directory", e)),
    }
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
    // Remove leftovers of an interrupted install; the link pin is written last and marks a
    // complete one, and it is absent here.
    for name in [MAP_PIN, PROG_PIN] {
        let _ = fs::remove_file(dir.join(name));
    }
    let pin =
        |fd: &OwnedFd, name: &str| sys::obj_pin(fd.as_raw_fd(), &dir.join(name).to_string_lossy());
    pin(&map, MAP_PIN).map_err(|e| OptionError::from_io("pin the map", e))?;
    pin(&program, PROG_PIN).map_err(|e| OptionError::from_io("pin the program", e))?;
    match pin(&link, LINK_PIN) {
        Ok(()) => Ok(true),
        // A concurrent installer won; dropping our link detaches our copy.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(OptionError::from_io("pin the link", e)),
    }
}

/// Holds installs and uninstalls apart: two installers at once would otherwise each remove the
/// other's half-made pins and leave programs that serve different maps. An exclusive `flock`
/// on [`LOCK_FILE`] (root's, mode 0600: no other user can open it to hold installs up), taken
/// before bpffs may be mounted, so two first installers do not each lock their own mount; where
/// `/run` cannot hold it, on `dir`'s parent. Waits at most [`LOCK_WAIT`] (an install takes
/// milliseconds); released on drop.
fn lock_installs(dir: &Path) -> Result<fs::File, OptionError> {
    let run = Path::new(LOCK_FILE);
    let _ = run.parent().map(fs::create_dir_all);
    let f = match fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(run)
    {
        Ok(f) => f,
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)) => {
            return Err(OptionError::from_io("open the install lock", e));
        }
        Err(_) => fs::File::open(dir.parent().unwrap_or(dir))
            .map_err(|e| OptionError::from_io("open the install lock", e))?,
    };
    let until = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            _ => return Err(OptionError::from_io("take the install lock", e)),
        }
    }
}

/// Makes the directory of the host-wide same-host rendezvous ([`rdma::rendezvous_dir`]):
/// root's, mode 1777 like `/tmp` (any user's process binds its device's socket there; none
/// can remove another's). Best effort: without it, only peers in one network namespace
/// share memory.
fn ensure_rendezvous_dir() {
    let d = rdma::rendezvous_dir();
    if fs::create_dir_all(&d).is_ok()
        && fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir() && m.uid() == 0)
    {
        let _ = fs::set_permissions(&d, fs::Permissions::from_mode(0o1777));
    }
}

/// The install lock ([`lock_installs`]).
const LOCK_FILE: &str = "/run/smcr/install.lock";

/// How long an install waits for another to finish.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a complete install is pinned under `dir`.
pub fn is_installed(dir: &Path) -> bool {
    [LINK_PIN, MAP_PIN, SET_LINK_PIN, GET_LINK_PIN, PORTS_PIN]
        .iter()
        .all(|p| dir.join(p).exists())
}

/// Removes the pins under `dir`; each program is detached once no process holds its link.
/// Sockets that were marked keep working as plain TCP sockets.
pub fn uninstall(dir: &Path) -> Result<(), OptionError> {
    // Without a bpffs there is nothing pinned to remove.
    let _lock = lock_installs(dir).ok();
    let pins = [
        SET_LINK_PIN,
        GET_LINK_PIN,
        LINK_PIN,
        PROG_PIN,
        MAP_PIN,
        PORTS_PIN,
    ];
    for name in pins.into_iter().chain(LEGACY_PINS) {
        match fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(OptionError::from_io("remove a pin", e)),
        }
    }
    // Only ours lived there; leave the directory if someone else put something in it.
    let _ = fs::remove_dir(dir);
    Ok(())
}

/// Mount points of `fstype` from /proc/self/mountinfo (field 5 is the mount point; the
/// filesystem type follows the ` - ` separator).
fn mounts_of(fstype: &str) -> io::Result<Vec<PathBuf>> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_mounts(&info, fstype))
}

fn parse_mounts(info: &str, fstype: &str) -> Vec<PathBuf> {
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let ty = right.split_whitespace().next()?;
            let mount_point = left.split_whitespace().nth(4)?;
            (ty == fstype).then(|| PathBuf::from(unescape_mount(mount_point)))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal `\ooo`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup v2 root: the first cgroup2 mount (on hybrid systems it is `/sys/fs/cgroup/unified`).
fn cgroup2_root() -> Result<Option<PathBuf>, OptionError> {
    let mounts =
        mounts_of("cgroup2").map_err(|e| OptionError::from_io("read /proc/self/mountinfo", e))?;
    Ok(mounts.into_iter().next())
}

pub(crate) fn ensure_bpffs(dir: &Path) -> Result<(), OptionError> {
    let mounts =
        mounts_of("bpf").map_err(|e| OptionError::from_io("read /proc/self/mountinfo", e))?;
    let parent = dir.parent().unwrap_or(dir);
    if mounts.iter().any(|m| parent.starts_with(m)) {
        return Ok(());
    }
    let default = Path::new("/sys/fs/bpf");
    if !parent.starts_with(default) {
        return Err(OptionError::Kernel {
            what: "find a bpffs for the pins",
            source: io::Error::other(format!("{} is not on a bpf filesystem", parent.display())),
        });
    }
    let target = c"/sys/fs/bpf";
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let r = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(OptionError::from_io(
            "mount bpffs on /sys/fs/bpf",
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_verdicts() {
        assert_eq!(
            SockOption(MARKED | ESTABLISHED | PEER).capability(),
            Capability::PeerCapable
        );
        assert_eq!(
            SockOption(MARKED | ESTABLISHED).capability(),
            Capability::PeerNotCapable
        );
        assert_eq!(SockOption(MARKED).capability(), Capability::NotObserved);
        assert_eq!(SockOption(0).capability(), Capability::NotMarked);
    }

    #[test]
    fn missing_install_is_a_clear_error() {
        let dir = Path::new("/nonexistent/smcr-bpf");
        let e = OptionRecords::open(dir).unwrap_err();
        assert!(matches!(e, OptionError::NotInstalled { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("not installed") && text.contains("smcr bpf install"),
            "{text}"
        );
        assert!(!is_installed(dir));
    }

    #[test]
    fn mountinfo_parsing() {
        let info = "\
24 1 0:22 / /sys rw,nosuid - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
40 24 0:33 / /sys/fs/bpf rw - bpf bpf rw,mode=700
41 24 0:34 / /mnt/with\\040space rw - bpf bpf rw
";
        assert_eq!(
            parse_mounts(info, "cgroup2"),
            vec![PathBuf::from("/sys/fs/cgroup/unified")]
        );
        assert_eq!(
            parse_mounts(info, "bpf"),
            vec![
                PathBuf::from("/sys/fs/bpf"),
                PathBuf::from("/mnt/with space")
            ]
        );
        assert!(parse_mounts(info, "nfs").is_empty());
        assert!(parse_mounts("garbage\n\n - \n", "bpf").is_empty());
    }
}
