//! The RoCE steering program: lets any number of processes per address run SMC-R, each on
//! its own UDP port, while Linux peers keep sending to 4791 (docs/rdma.md, *Sharing the RoCE
//! port*; the device side is [`rdma::transport::steer`]).
//!
//! A tc ingress program (assembled in `steer/prog.rs`, attached with tcx — Linux 6.6+) rewrites the
//! destination port of RoCE v2 datagrams addressed to 4791 to the port of the destination
//! QP's range, whose owner is the only process that bound it. It needs no map: the port is a
//! function of the QPN.
//!
//! * [`install`] (root; `smcr bpf install`): loads the program, pins it under the pin
//!   directory (`/sys/fs/bpf/smcr/steer_prog_v1`, next to the option program) and attaches it
//!   to `lo` and every Ethernet interface of the caller's network namespace, each through a
//!   tcx link pinned as `steer_link_v1_<netns inode>_<ifindex>` (so it outlives the installer,
//!   and a second attach on one interface is found and skipped).
//! * [`ensure_attached`]: what the runtime of a process with CAP_NET_ADMIN and CAP_BPF calls
//!   before it opens a device: attach on `lo` and on the interface holding the device's
//!   address, in the current namespace, if not attached there yet (see
//!   [`SteerAttach`]).
//! * [`uninstall`] removes the pins (program and links of every namespace; each link detaches
//!   when its pin goes); [`status`] reports them.
//!
//! Pinned links of a namespace that was deleted are dead (their interface is gone); every
//! attach removes such pins.

mod prog;

use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::option::sys;
pub use rdma::transport::steer::{
    FIRST_RANGE, LAST_RANGE, PortMode, RANGE_SHIFT, ROCE_PORT, STEER_BASE, steered_port,
};

/// The program's pin name (bpffs refuses names with a dot; the suffix changes with the
/// program).
pub const PROG_PIN: &str = "steer_prog_v1";
/// Link pins are `steer_link_v1_<netns inode>_<ifindex>`.
pub const LINK_PIN_PREFIX: &str = "steer_link_v1_";
/// The program's name, as `bpftool` shows it.
const PROG_NAME: &str = "smcr_steer";
/// Our own code; this licence string lets it use every helper it calls.
const LICENSE: &str = "Dual MIT/GPL";
/// `ARPHRD_ETHER` and `ARPHRD_LOOPBACK`: interfaces whose frames start with a 14-byte
/// Ethernet header, the only ones the program parses (and the only ones rxe runs on).
const ARPHRD_ETHER: u16 = 1;
const ARPHRD_LOOPBACK: u16 = 772;
/// `lo`'s interface index in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// Why steering could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    /// The caller may not do this (not root, or not allowed to open the pins).
    #[error("no permission to use BPF ({what}): {source}")]
    NoPermission {
        /// The step that was refused.
        what: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// The program is not pinned and was not to be loaded.
    #[error(
        "the RoCE steering program is not installed (no pin at {path}); run `smcr bpf install` as root"
    )]
    NotInstalled {
        /// The pin that is missing.
        path: PathBuf,
    },
    /// Another error, with the step that failed (and the verifier log for a load).
    #[error("{what}: {source}")]
    Kernel {
        /// The step that failed.
        what: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
}

impl SteerError {
    fn from_io(what: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => Self::NoPermission { what, source },
            _ => Self::Kernel { what, source },
        }
    }
}

impl From<crate::option::OptionError> for SteerError {
    fn from(e: crate::option::OptionError) -> Self {
        Self::Kernel {
            what: "find a bpffs for the pins",
            source: io::Error::other(e.to_string()),
        }
    }
}

/// Whether a runtime attaches the steering program in its network namespace before opening a
/// device on the RoCE port (only a process with CAP_NET_ADMIN and CAP_BPF can; others never
/// try). `SMCR_STEER_ATTACH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SteerAttach {
    /// Never (`off`).
    Off,
    /// When the program is pinned under the pin directory (`smcr bpf install` was run):
    /// attach that one where it is not attached yet (`pinned`, the default).
    Pinned,
    /// As `Pinned`, and load and pin the program first when it is not there (`load`).
    Load,
}

impl SteerAttach {
    /// Parses `off`, `pinned` or `load`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" | "0" | "no" => Some(Self::Off),
            "pinned" | "on" | "1" | "yes" => Some(Self::Pinned),
            "load" => Some(Self::Load),
            _ => None,
        }
    }
}

/// What happened on one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Attached now.
    Attached,
    /// Our pinned link was there already.
    AlreadyAttached,
    /// Not attached: the program does not parse this kind of interface.
    Skipped(String),
}

/// One interface of an attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// Interface name.
    pub ifname: String,
    /// Interface index.
    pub ifindex: u32,
    /// What was done.
    pub outcome: Outcome,
}

/// Loads, pins (under `dir`) and attaches the steering program to `lo` and every Ethernet
/// interface of the caller's network namespace, where it is not attached yet. Root.
pub fn install(dir: &Path) -> Result<Vec<Attachment>, SteerError> {
    let prog = program_fd(dir, true)?;
    let ns = netns_inode().map_err(|e| SteerError::from_io("read the network namespace", e))?;
    prune(dir);
    let mut out = Vec::new();
    for (ifname, ifindex) in interfaces() {
        let outcome = match arphrd(&ifname) {
            Ok(ARPHRD_ETHER | ARPHRD_LOOPBACK) => attach(dir, &prog, ns, ifindex)?,
            Ok(t) => Outcome::Skipped(format!("not Ethernet (type {t})")),
            Err(e) => Outcome::Skipped(e.to_string()),
        };
        out.push(Attachment {
            ifname,
            ifindex,
            outcome,
        });
    }
    Ok(out)
}

/// Attaches the program on `lo` and on the interface that holds `ip` (in the caller's network
/// namespace) where it is not attached yet. The program pinned under `dir` is used; when there
/// is none, it is loaded and pinned if `load`, else [`SteerError::NotInstalled`].
pub fn ensure_attached(
    dir: &Path,
    ip: Ipv4Addr,
    load: bool,
) -> Result<Vec<Attachment>, SteerError> {
    let prog = program_fd(dir, load)?;
    let ns = netns_inode().map_err(|e| SteerError::from_io("read the network namespace", e))?;
    let mut targets = vec![("lo".to_owned(), LOOPBACK_IFINDEX)];
    if !ip.is_loopback()
        && let Some((name, index)) = interface_of(ip)
        && index != LOOPBACK_IFINDEX
    {
        targets.push((name, index));
    }
    let mut out = Vec::new();
    let mut pruned = false;
    for (ifname, ifindex) in targets {
        let outcome = match arphrd(&ifname) {
            Ok(ARPHRD_ETHER | ARPHRD_LOOPBACK) => {
                if !pruned && !link_pin_live(dir, ns, ifindex) {
                    // About to attach: clear dead pins first (namespaces gone).
                    prune(dir);
                    pruned = true;
                }
                attach(dir, &prog, ns, ifindex)?
            }
            Ok(t) => Outcome::Skipped(format!("not Ethernet (type {t})")),
            Err(e) => Outcome::Skipped(e.to_string()),
        };
        out.push(Attachment {
            ifname,
            ifindex,
            outcome,
        });
    }
    Ok(out)
}

/// What a runtime does before opening a device on `ip` (the RoCE port): with `policy` not
/// [`SteerAttach::Off`] and the capabilities to attach, [`ensure_attached`]. Errors leave the
/// device to find out for itself (it probes whether packets are steered). Never under a
/// seccomp filter: `bpf(2)` is in systemd's `@privileged`, and a filtered call kills the
/// process (a root service under such a filter relies on `smcr bpf install` instead).
pub fn runtime_attach(policy: SteerAttach, dir: &Path, ip: Ipv4Addr) {
    if policy == SteerAttach::Off || !may_attach() || rdma::sandbox::filtered() {
        return;
    }
    let _ = ensure_attached(dir, ip, policy == SteerAttach::Load);
}

/// Whether this thread has CAP_NET_ADMIN and CAP_BPF (or CAP_SYS_ADMIN).
fn may_attach() -> bool {
    use rustix::thread::CapabilitySet as C;
    rustix::thread::capabilities(None).is_ok_and(|c| {
        c.effective.contains(C::NET_ADMIN) && c.effective.intersects(C::BPF | C::SYS_ADMIN)
    })
}

/// Removes the program's pin and every link pin under `dir` (each link detaches as its pin
/// goes); returns how many links were pinned. Processes running in steered mode lose the
/// packets of remote peers until it is installed again.
pub fn uninstall(dir: &Path) -> Result<usize, SteerError> {
    let mut links = 0;
    for (name, _) in link_pins(dir) {
        match fs::remove_file(dir.join(&name)) {
            Ok(()) => links += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(SteerError::from_io("remove a link pin", e)),
        }
    }
    match fs::remove_file(dir.join(PROG_PIN)) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(SteerError::from_io("remove the program pin", e)),
    }
    Ok(links)
}

/// A pinned link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkPin {
    /// The pin's file name.
    pub name: String,
    /// Network namespace inode and interface index from the name.
    pub netns: u64,
    /// See `netns`.
    pub ifindex: u32,
    /// The link is attached (its interface exists); `None`: could not be read (permissions).
    pub live: Option<bool>,
}

/// An interface of the caller's network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfStatus {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
    /// Our pinned link is attached here (`None`: could not be read).
    pub attached: Option<bool>,
    /// Programs attached at the interface's tcx ingress, ours included (`None`: could not
    /// be asked; needs CAP_NET_ADMIN).
    pub tcx_programs: Option<usize>,
}

/// What [`status`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The program is pinned.
    pub program: bool,
    /// The caller's network namespace inode.
    pub netns: u64,
    /// The interfaces of that namespace.
    pub interfaces: Vec<IfStatus>,
    /// Every link pin (all namespaces).
    pub links: Vec<LinkPin>,
}

/// The pins under `dir` and the interfaces of the caller's namespace with their attachment.
pub fn status(dir: &Path) -> Status {
    let netns = netns_inode().unwrap_or(0);
    let links: Vec<LinkPin> = link_pins(dir)
        .into_iter()
        .map(|(name, (ns, ifindex))| {
            let live = match sys::obj_get(&dir.join(&name).to_string_lossy()) {
                Ok(fd) => Some(link_live(&fd, ifindex)),
                Err(_) => None,
            };
            LinkPin {
                name,
                netns: ns,
                ifindex,
                live,
            }
        })
        .collect();
    let interfaces = interfaces()
        .into_iter()
        .map(|(name, ifindex)| {
            let pin = links
                .iter()
                .find(|l| l.netns == netns && l.ifindex == ifindex);
            IfStatus {
                name,
                ifindex,
                attached: match pin {
                    Some(l) => l.live,
                    None => Some(false),
                },
                tcx_programs: sys::tcx_ingress_prog_ids(ifindex).ok().map(|v| v.len()),
            }
        })
        .collect();
    Status {
        program: dir.join(PROG_PIN).exists(),
        netns,
        interfaces,
        links,
    }
}

/// The pinned program, loaded and pinned first if absent and `load`.
fn program_fd(dir: &Path, load: bool) -> Result<OwnedFd, SteerError> {
    let path = dir.join(PROG_PIN);
    let spath = path.to_string_lossy().into_owned();
    match sys::obj_get(&spath) {
        Ok(fd) => return Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            if !load {
                return Err(SteerError::NotInstalled { path });
            }
        }
        Err(e) => return Err(SteerError::from_io("open the pinned program", e)),
    }
    crate::option::ensure_bpffs(dir)?;
    match fs::create_dir(dir) {
        Ok(()) => {
            use std::os::unix::fs::PermissionsExt;
            let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(SteerError::from_io("create the pin directory", e)),
    }
    let fd = load_program()?;
    match sys::obj_pin(fd.as_raw_fd(), &spath) {
        Ok(()) => Ok(fd),
        // A concurrent loader won: use its copy, so that every attachment runs one program.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            sys::obj_get(&spath).map_err(|e| SteerError::from_io("open the pinned program", e))
        }
        Err(e) => Err(SteerError::from_io("pin the program", e)),
    }
}

/// Loads the steering program (not pinned).
pub(crate) fn load_program() -> Result<OwnedFd, SteerError> {
    sys::prog_load(
        sys::BPF_PROG_TYPE_SCHED_CLS,
        PROG_NAME,
        &prog::program(),
        LICENSE,
    )
    .map_err(|e| SteerError::from_io("load the steering program", e))
}

fn link_pin_name(ns: u64, ifindex: u32) -> String {
    format!("{LINK_PIN_PREFIX}{ns}_{ifindex}")
}

/// Whether our pinned link for (`ns`, `ifindex`) is attached.
fn link_pin_live(dir: &Path, ns: u64, ifindex: u32) -> bool {
    sys::obj_get(&dir.join(link_pin_name(ns, ifindex)).to_string_lossy())
        .is_ok_and(|fd| link_live(&fd, ifindex))
}

/// Attaches `prog` to the ingress of `ifindex` unless our pinned link is there already.
fn attach(dir: &Path, prog: &OwnedFd, ns: u64, ifindex: u32) -> Result<Outcome, SteerError> {
    let pin = dir.join(link_pin_name(ns, ifindex));
    let spin = pin.to_string_lossy().into_owned();
    if let Ok(fd) = sys::obj_get(&spin) {
        if link_live(&fd, ifindex) {
            return Ok(Outcome::AlreadyAttached);
        }
        // A namespace that reused a dead one's inode, or an interface gone and back.
        let _ = fs::remove_file(&pin);
    }
    let link = sys::link_create_tcx_ingress(prog.as_raw_fd(), ifindex)
        .map_err(|e| SteerError::from_io("attach to the interface (tcx ingress)", e))?;
    match sys::obj_pin(link.as_raw_fd(), &spin) {
        Ok(()) => Ok(Outcome::Attached),
        // A concurrent attacher won; dropping our link detaches our copy.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Outcome::AlreadyAttached),
        Err(e) => Err(SteerError::from_io("pin the link", e)),
    }
}

/// Whether `link` is a tcx link attached to `ifindex` (a link whose interface went away
/// reports index 0).
fn link_live(link: &OwnedFd, ifindex: u32) -> bool {
    // bpf_link_info: type, id, prog_id, then (8-aligned) tcx { ifindex, attach_type }.
    let Ok(info) = sys::obj_info::<64>(link.as_raw_fd()) else {
        return false;
    };
    let word = |at: usize| u32::from_ne_bytes(info[at..at + 4].try_into().expect("4 bytes"));
    word(0) == sys::BPF_LINK_TYPE_TCX && word(16) == ifindex && word(20) == sys::BPF_TCX_INGRESS
}

/// Removes link pins whose link is dead.
fn prune(dir: &Path) {
    for (name, (_, ifindex)) in link_pins(dir) {
        let path = dir.join(&name);
        if let Ok(fd) = sys::obj_get(&path.to_string_lossy())
            && !link_live(&fd, ifindex)
        {
            let _ = fs::remove_file(&path);
        }
    }
}

/// Link pins under `dir`: name, (netns inode, ifindex).
fn link_pins(dir: &Path) -> Vec<(String, (u64, u32))> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        let name = e.ok()?.file_name().into_string().ok()?;
        let key = parse_link_pin(&name)?;
        Some((name, key))
    })
    .collect()
}

fn parse_link_pin(name: &str) -> Option<(u64, u32)> {
    let (ns, ifindex) = name.strip_prefix(LINK_PIN_PREFIX)?.split_once('_')?;
    Some((ns.parse().ok()?, ifindex.parse().ok()?))
}

/// The inode of the calling thread's network namespace.
pub fn netns_inode() -> io::Result<u64> {
    Ok(rustix::fs::stat("/proc/thread-self/ns/net")?.st_ino)
}

/// The interfaces of the calling thread's network namespace: (name, index).
fn interfaces() -> Vec<(String, u32)> {
    // /proc/thread-self/net is the thread's namespace (unlike /sys/class/net, which is the
    // namespace of whoever mounted /sys).
    let Ok(text) = fs::read_to_string("/proc/thread-self/net/dev") else {
        return Vec::new();
    };
    text.lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_owned()))
        .filter_map(|n| ifindex(&n).ok().map(|i| (n, i)))
        .collect()
}

/// An `AF_INET` datagram socket for interface ioctls (not bound, not used for traffic).
fn ioctl_socket() -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    Ok(rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// `ioctl(fd, req, arg)` as a raw system call (inside the preload, libc's `ioctl` is a hook).
fn ioctl(fd: &OwnedFd, req: libc::c_ulong, arg: *mut u8) -> io::Result<()> {
    // SAFETY: `arg` points at a buffer the size the request expects (`struct ifreq` or
    // `struct ifconf`), alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_ioctl, fd.as_raw_fd(), req, arg) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `struct ifreq`: the name, then a 24-byte union.
const IFREQ_LEN: usize = 40;

fn ifreq(name: &str) -> io::Result<[u8; IFREQ_LEN]> {
    let mut r = [0u8; IFREQ_LEN];
    if name.is_empty() || name.len() >= 16 {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    r[..name.len()].copy_from_slice(name.as_bytes());
    Ok(r)
}

fn ifindex(name: &str) -> io::Result<u32> {
    let mut r = ifreq(name)?;
    ioctl(&ioctl_socket()?, libc::SIOCGIFINDEX, r.as_mut_ptr())?;
    Ok(u32::from_ne_bytes(r[16..20].try_into().expect("4 bytes")))
}

/// The interface's hardware type (`ARPHRD_*`).
fn arphrd(name: &str) -> io::Result<u16> {
    let mut r = ifreq(name)?;
    ioctl(&ioctl_socket()?, libc::SIOCGIFHWADDR, r.as_mut_ptr())?;
    Ok(u16::from_ne_bytes([r[16], r[17]]))
}

/// The interface that holds `ip` (`SIOCGIFCONF`: every IPv4 address of the namespace).
fn interface_of(ip: Ipv4Addr) -> Option<(String, u32)> {
    let sock = ioctl_socket().ok()?;
    let mut buf = vec![0u8; IFREQ_LEN * 256];
    // struct ifconf { int ifc_len; char *ifc_buf; } (the pointer 8-aligned).
    let mut conf = [0u8; 16];
    conf[..4].copy_from_slice(&(buf.len() as i32).to_ne_bytes());
    conf[8..16].copy_from_slice(&(buf.as_mut_ptr() as u64).to_ne_bytes());
    ioctl(&sock, libc::SIOCGIFCONF, conf.as_mut_ptr()).ok()?;
    let len =
        (i32::from_ne_bytes(conf[..4].try_into().expect("4 bytes")).max(0) as usize).min(buf.len());
    buf[..len].chunks_exact(IFREQ_LEN).find_map(|r| {
        // ifr_addr: sockaddr_in { family, port, addr }.
        let family = u16::from_ne_bytes([r[16], r[17]]);
        let addr = Ipv4Addr::new(r[20], r[21], r[22], r[23]);
        if family != libc::AF_INET as u16 || addr != ip {
            return None;
        }
        let end = r[..16].iter().position(|&b| b == 0).unwrap_or(16);
        let name = String::from_utf8_lossy(&r[..end]).into_owned();
        // An alias label ("eth0:1") names its device.
        let dev = name.split(':').next().unwrap_or(&name).to_owned();
        let index = ifindex(&dev).ok()?;
        Some((dev, index))
    })
}

/// Whether `ip` is an address of this host in the caller's network namespace.
pub fn on_this_host(ip: Ipv4Addr) -> bool {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .and_then(|s| rustix::net::bind(&s, &std::net::SocketAddr::from((ip, 0))))
    .is_ok()
}

/// Why a local-only device on `ip` cannot serve a peer on another host.
pub fn local_only_diagnosis(ip: Ipv4Addr) -> String {
    format!(
        "RoCE port {ROCE_PORT} on {ip} is owned by another process and no steering program is attached here; run `smcr bpf install` as root (for a network namespace: `smcr bpf install --netns NAME`)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pin_names_round_trip() {
        let n = link_pin_name(4026531840, 7);
        assert_eq!(n, "steer_link_v1_4026531840_7");
        assert_eq!(parse_link_pin(&n), Some((4026531840, 7)));
        assert_eq!(parse_link_pin("steer_prog_v1"), None);
        assert_eq!(parse_link_pin("steer_link_v1_x_1"), None);
        assert_eq!(parse_link_pin("sk_opt_link_v1"), None);
    }

    #[test]
    fn attach_policy_parses() {
        assert_eq!(SteerAttach::parse("off"), Some(SteerAttach::Off));
        assert_eq!(SteerAttach::parse("pinned"), Some(SteerAttach::Pinned));
        assert_eq!(SteerAttach::parse("load"), Some(SteerAttach::Load));
        assert_eq!(SteerAttach::parse("maybe"), None);
    }

    #[test]
    fn diagnosis_names_the_port_the_address_and_the_remedy() {
        let d = local_only_diagnosis(Ipv4Addr::new(10, 1, 2, 3));
        assert!(d.contains("4791") && d.contains("10.1.2.3"), "{d}");
        assert!(d.contains("smcr bpf install"), "{d}");
    }

    fn root(why: &str) -> bool {
        if rustix::process::geteuid().is_root() {
            return true;
        }
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "{why} needs root"
        );
        eprintln!("SKIP: {why} needs root");
        false
    }

    fn sum16(data: &[u8], mut acc: u32) -> u32 {
        for c in data.chunks(2) {
            acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        acc
    }

    fn fold(mut acc: u32) -> u16 {
        while acc > 0xffff {
            acc = (acc & 0xffff) + (acc >> 16);
        }
        acc as u16
    }

    /// An Ethernet frame: IPv4 (with `opts` option bytes, `frag` as the frag_off field), UDP
    /// from 40000 to `dport` with a real checksum (or 0), a BTH for `qpn` and 16 bytes.
    fn frame(qpn: u32, dport: u16, csum: bool, opts: usize, frag: u16, proto: u8) -> Vec<u8> {
        let (src, dst) = ([10, 0, 0, 1], [10, 0, 0, 2]);
        let mut roce = vec![0u8; 12 + 16 + 4];
        roce[0] = 0x04;
        roce[2..4].copy_from_slice(&0xffffu16.to_be_bytes());
        roce[4..8].copy_from_slice(&(qpn & 0xff_ffff).to_be_bytes());
        for (i, b) in roce[12..].iter_mut().enumerate() {
            *b = i as u8 * 7;
        }
        let udp_len = 8 + roce.len();
        let mut udp = vec![0u8; 8];
        udp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        udp[2..4].copy_from_slice(&dport.to_be_bytes());
        udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
        udp.extend_from_slice(&roce);
        if csum {
            let mut pseudo = Vec::new();
            pseudo.extend_from_slice(&src);
            pseudo.extend_from_slice(&dst);
            pseudo.extend_from_slice(&[0, 17]);
            pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
            let c = !fold(sum16(&udp, sum16(&pseudo, 0)));
            udp[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
        }
        let ihl = 20 + opts;
        let mut ip = vec![0u8; ihl];
        ip[0] = 0x40 | (ihl / 4) as u8;
        ip[2..4].copy_from_slice(&((ihl + udp_len) as u16).to_be_bytes());
        ip[6..8].copy_from_slice(&frag.to_be_bytes());
        ip[8] = 64;
        ip[9] = proto;
        ip[12..16].copy_from_slice(&src);
        ip[16..20].copy_from_slice(&dst);
        for b in &mut ip[20..] {
            *b = 1; // NOP options
        }
        let c = !fold(sum16(&ip, 0));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&udp);
        f
    }

    /// The UDP checksum of `f` (built by [`frame`]) verifies (or is 0).
    fn udp_checksum_ok(f: &[u8]) -> bool {
        let ihl = usize::from(f[14] & 0x0f) * 4;
        let udp = &f[14 + ihl..];
        if udp[6..8] == [0, 0] {
            return true;
        }
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&f[14 + 12..14 + 20]);
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        fold(sum16(udp, sum16(&pseudo, 0))) == 0xffff
    }

    /// The kernel runs the assembled program on crafted frames (`BPF_PROG_TEST_RUN`) and it
    /// does what [`steered_port`] says: the port of the QPN's range for RoCE to 4791, with the
    /// checksum still right (a zero one left zero), everything else untouched; always
    /// `TCX_NEXT`.
    #[test]
    fn the_kernel_runs_the_program_as_the_reference_says() {
        if !root("loading the steering program") {
            return;
        }
        let prog = load_program().unwrap();
        let qpns = [
            0, 1, 0x11, 0xfffff, 0x100000, 0x100fff, 0x101000, 0x101001, 0x2ab123, 0x7ff000,
            0xfff000, 0xfffffe, 0xffffff,
        ];
        let mut steered = 0;
        for &qpn in &qpns {
            for dport in [ROCE_PORT, 4792, 57601] {
                for csum in [true, false] {
                    for opts in [0, 4, 40] {
                        let f = frame(qpn, dport, csum, opts, 0x4000, 17);
                        let (ret, out, _) = sys::prog_test_run(prog.as_raw_fd(), &f, 1).unwrap();
                        assert_eq!(ret as i32, prog::TCX_NEXT);
                        assert_eq!(out.len(), f.len());
                        let at = 14 + 20 + opts;
                        let got = u16::from_be_bytes([out[at + 2], out[at + 3]]);
                        let want = if dport == ROCE_PORT {
                            steered_port(qpn).unwrap_or(ROCE_PORT)
                        } else {
                            dport
                        };
                        assert_eq!(
                            got, want,
                            "qpn {qpn:#x} dport {dport} csum {csum} opts {opts}"
                        );
                        if got != dport {
                            steered += 1;
                        }
                        assert!(
                            udp_checksum_ok(&out),
                            "qpn {qpn:#x} csum {csum} opts {opts}"
                        );
                        if !csum {
                            assert_eq!(out[at + 6..at + 8], [0, 0], "a zero checksum stays zero");
                        }
                        // Nothing but the port and the checksum changed.
                        let mut a = out.clone();
                        let mut b = f.clone();
                        for v in [&mut a, &mut b] {
                            v[at + 2..at + 4].fill(0);
                            v[at + 6..at + 8].fill(0);
                        }
                        assert_eq!(a, b);
                    }
                }
            }
        }
        assert_eq!(
            steered,
            7 * 2 * 3,
            "the 7 QPNs from range 0x101 up, steered"
        );
        // Not for us: fragments (MF, or an offset), not UDP, not IPv4, truncated.
        let q = 0x2ab123;
        for f in [
            frame(q, ROCE_PORT, true, 0, 0x2000, 17),
            frame(q, ROCE_PORT, true, 0, 0x0001, 17),
            frame(q, ROCE_PORT, true, 0, 0x4000, 6),
            {
                let mut f = frame(q, ROCE_PORT, true, 0, 0x4000, 17);
                f[12..14].copy_from_slice(&[0x86, 0xdd]);
                f
            },
            frame(q, ROCE_PORT, true, 0, 0x4000, 17)[..14 + 20 + 8 + 6].to_vec(),
        ] {
            let (ret, out, _) = sys::prog_test_run(prog.as_raw_fd(), &f, 1).unwrap();
            assert_eq!(ret as i32, prog::TCX_NEXT);
            assert_eq!(out, f);
        }
    }

    /// What the program costs a packet, measured by the kernel (`BPF_PROG_TEST_RUN`, a
    /// million runs): a TCP segment (passed after the IPv4 header is read), and a RoCE packet
    /// to 4791 (rewritten). `cargo test --profile ci -p smcr-bpf --lib program_cost -- --ignored
    /// --nocapture` (root).
    #[test]
    #[ignore = "a measurement"]
    fn program_cost() {
        if !root("loading the steering program") {
            return;
        }
        let prog = load_program().unwrap();
        let roce = frame(0x2ab123, ROCE_PORT, true, 0, 0x4000, 17);
        let mut tcp = frame(0x2ab123, 5201, true, 0, 0x4000, 6);
        tcp.resize(14 + 20 + 20 + 1448, 0);
        let udp = frame(0x2ab123, 5201, true, 0, 0x4000, 17);
        for (what, f) in [
            ("TCP segment", &tcp),
            ("UDP not RoCE", &udp),
            ("RoCE, steered", &roce),
        ] {
            let (_, _, ns) = sys::prog_test_run(prog.as_raw_fd(), f, 1_000_000).unwrap();
            eprintln!("{what}: {ns} ns per run");
        }
    }

    #[test]
    fn loopback_interfaces_are_listed() {
        let ifs = interfaces();
        assert!(
            ifs.iter().any(|(n, i)| n == "lo" && *i == LOOPBACK_IFINDEX),
            "{ifs:?}"
        );
        assert_eq!(arphrd("lo").unwrap(), ARPHRD_LOOPBACK);
        assert_eq!(
            interface_of(Ipv4Addr::LOCALHOST).map(|(n, _)| n).as_deref(),
            Some("lo")
        );
    }
}
