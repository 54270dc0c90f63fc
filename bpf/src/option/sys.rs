//! The handful of bpf(2) commands the option and steering programs' installers need, over
//! `libc::syscall` (processes running SMC-R make none: see `option::sockopt`).
//!
//! `union bpf_attr` is passed as a zeroed 144-byte buffer with the fields of one command written
//! at their UAPI offsets (checked with offsetof against /usr/include/linux/bpf.h); the kernel
//! accepts a larger buffer as long as the bytes it does not know are zero.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use super::asm::Insn;

const ATTR_SIZE: usize = 144;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
#[cfg(test)]
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_SK_STORAGE: u32 = 24;
/// `BPF_MAP_TYPE_XSKMAP`: AF_XDP sockets by receive queue (the XDP probe).
pub(crate) const BPF_MAP_TYPE_XSKMAP: u32 = 17;
/// `BPF_MAP_TYPE_LRU_HASH`: the quiet ports.
pub(crate) const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
/// `BPF_PROG_TYPE_XDP`.
pub(crate) const BPF_PROG_TYPE_XDP: u32 = 6;
/// `BPF_XDP` (`enum bpf_attach_type`): an XDP program attached through a bpf link.
pub(crate) const BPF_XDP: u32 = 37;
const BPF_PROG_TYPE_SOCK_OPS: u32 = 13;
/// `BPF_PROG_TYPE_SCHED_CLS`: a tc classifier (the steering program).
pub(crate) const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_TCX_INGRESS` (`enum bpf_attach_type`, Linux 6.6+; newer than Debian 12's headers:
/// checked against the kernel's UAPI header).
pub(crate) const BPF_TCX_INGRESS: u32 = 46;
/// `BPF_LINK_TYPE_TCX`.
pub(crate) const BPF_LINK_TYPE_TCX: u32 = 11;
const BPF_CGROUP_SOCK_OPS: u32 = 3;
/// `BPF_PROG_TYPE_CGROUP_SOCKOPT`.
pub(crate) const BPF_PROG_TYPE_CGROUP_SOCKOPT: u32 = 25;
/// `BPF_CGROUP_GETSOCKOPT` (`enum bpf_attach_type`).
pub(crate) const BPF_CGROUP_GETSOCKOPT: u32 = 21;
/// `BPF_CGROUP_SETSOCKOPT`.
pub(crate) const BPF_CGROUP_SETSOCKOPT: u32 = 22;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_CLONE: u32 = 1 << 9;

struct Attr([u8; ATTR_SIZE]);

impl Attr {
    fn new() -> Self {
        Self([0; ATTR_SIZE])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn bytes(&mut self, off: usize, v: &[u8]) -> &mut Self {
        self.0[off..off + v.len()].copy_from_slice(v);
        self
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: attr is a valid, writable buffer of ATTR_SIZE bytes for the whole call; every
    // pointer stored in it by the callers points to memory that outlives the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.0.as_mut_ptr(),
            ATTR_SIZE as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn bpf_fd(cmd: libc::c_long, attr: &mut Attr) -> io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: these commands return a new file descriptor that nothing else owns.
    rdma::fdzone::place(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Loads BTF; on failure the kernel's log is returned in the error.
pub(crate) fn btf_load(blob: &[u8]) -> io::Result<OwnedFd> {
    let mut log = vec![0u8; 4096];
    let mut a = Attr::new();
    a.u64(0, blob.as_ptr() as u64)
        .u64(8, log.as_mut_ptr() as u64)
        .u32(16, blob.len() as u32)
        .u32(20, log.len() as u32)
        .u32(24, 1);
    bpf_fd(BPF_BTF_LOAD, &mut a).map_err(|e| with_log(e, &log))
}

/// Creates the sk_storage map: key a socket fd, value `value_size` bytes, cloned to accepted
/// sockets.
pub(crate) fn sk_storage_create(
    name: &str,
    value_size: u32,
    btf_fd: RawFd,
    key_type: u32,
    value_type: u32,
) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, BPF_MAP_TYPE_SK_STORAGE)
        .u32(4, 4)
        .u32(8, value_size)
        .u32(12, 0)
        .u32(16, BPF_F_NO_PREALLOC | BPF_F_CLONE)
        .bytes(28, &name16(name))
        .u32(48, btf_fd as u32)
        .u32(52, key_type)
        .u32(56, value_type);
    bpf_fd(BPF_MAP_CREATE, &mut a)
}

/// Loads a sock_ops program; on failure the verifier's log is returned in the error.
pub(crate) fn prog_load_sock_ops(name: &str, insns: &[Insn], license: &str) -> io::Result<OwnedFd> {
    prog_load(BPF_PROG_TYPE_SOCK_OPS, name, insns, license)
}

/// Loads a program of type `prog_type`; on failure the verifier's log is returned in the
/// error.
pub(crate) fn prog_load(
    prog_type: u32,
    name: &str,
    insns: &[Insn],
    license: &str,
) -> io::Result<OwnedFd> {
    prog_load_flags(prog_type, name, insns, license, 0)
}

/// Loads a program that the kernel checks against the hook it will be attached to
/// (`expected_attach_type`, e.g. [`BPF_CGROUP_SETSOCKOPT`]).
pub(crate) fn prog_load_for(
    prog_type: u32,
    attach_type: u32,
    name: &str,
    insns: &[Insn],
    license: &str,
) -> io::Result<OwnedFd> {
    prog_load_attr(prog_type, name, insns, license, 0, attach_type)
}

/// `BPF_F_XDP_HAS_FRAGS`: the XDP program copes with multi-buffer frames (it reads only the
/// first buffer, between data and data_end).
pub(crate) const BPF_F_XDP_HAS_FRAGS: u32 = 1 << 5;

/// [`prog_load`] with `prog_flags` (`BPF_F_*`).
pub(crate) fn prog_load_flags(
    prog_type: u32,
    name: &str,
    insns: &[Insn],
    license: &str,
    prog_flags: u32,
) -> io::Result<OwnedFd> {
    prog_load_attr(prog_type, name, insns, license, prog_flags, 0)
}

fn prog_load_attr(
    prog_type: u32,
    name: &str,
    insns: &[Insn],
    license: &str,
    prog_flags: u32,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let code: Vec<u8> = insns.iter().flat_map(|i| i.encode()).collect();
    let license = CString::new(license).expect("license has no NUL");
    let mut log = vec![0u8; 256 * 1024];
    let mut a = Attr::new();
    a.u32(0, prog_type)
        .u32(4, insns.len() as u32)
        .u64(8, code.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .u32(44, prog_flags)
        .bytes(48, &name16(name))
        .u32(68, attach_type);
    // The verifier gives up with EAGAIN when a signal is pending for the loading thread (a
    // SIGCHLD in a program that runs children, say): try again, as libbpf does.
    let mut tries = 0;
    loop {
        match bpf_fd(BPF_PROG_LOAD, &mut a) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && tries < 5 => tries += 1,
            r => return r.map_err(|e| with_log(e, &log)),
        }
    }
}

/// Attaches a sock_ops program to a cgroup through a bpf link (multi-attach: other sock_ops
/// programs keep running).
pub(crate) fn link_create_cgroup_sock_ops(prog: RawFd, cgroup: RawFd) -> io::Result<OwnedFd> {
    link_create_cgroup(prog, cgroup, BPF_CGROUP_SOCK_OPS)
}

/// Attaches a cgroup program at hook `attach_type` through a bpf link (multi-attach).
pub(crate) fn link_create_cgroup(
    prog: RawFd,
    cgroup: RawFd,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, prog as u32)
        .u32(4, cgroup as u32)
        .u32(8, attach_type);
    bpf_fd(BPF_LINK_CREATE, &mut a)
}

/// Attaches a tc program to the ingress of interface `ifindex` (of the caller's network
/// namespace) through a tcx link, after the programs already there (Linux 6.6+).
pub(crate) fn link_create_tcx_ingress(prog: RawFd, ifindex: u32) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, prog as u32)
        .u32(4, ifindex)
        .u32(8, BPF_TCX_INGRESS);
    bpf_fd(BPF_LINK_CREATE, &mut a)
}

/// Attaches an XDP program to interface `ifindex` (of the caller's network namespace) through a
/// bpf link; `flags` are `XDP_FLAGS_*` (`XDP_FLAGS_DRV_MODE` = native, `XDP_FLAGS_SKB_MODE` =
/// generic). Detached when the last descriptor of the link closes.
pub(crate) fn link_create_xdp(prog: RawFd, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, prog as u32)
        .u32(4, ifindex)
        .u32(8, BPF_XDP)
        .u32(12, flags);
    bpf_fd(BPF_LINK_CREATE, &mut a)
}

/// Creates a map of type `map_type` without BTF (key and value sizes in bytes).
pub(crate) fn map_create(
    map_type: u32,
    name: &str,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, map_type)
        .u32(4, key_size)
        .u32(8, value_size)
        .u32(12, max_entries)
        .bytes(28, &name16(name));
    bpf_fd(BPF_MAP_CREATE, &mut a)
}

/// Writes `value` at `key` in `map` (`BPF_ANY`).
pub(crate) fn map_update(map: RawFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut a = Attr::new();
    a.u32(0, map as u32)
        .u64(8, key.as_ptr() as u64)
        .u64(16, value.as_ptr() as u64)
        .u64(24, 0);
    bpf(BPF_MAP_UPDATE_ELEM, &mut a).map(drop)
}

/// `bpf_obj_get_info_by_fd`: the first `N` bytes of the object's info struct
/// (`bpf_prog_info`, `bpf_link_info`, …).
pub(crate) fn obj_info<const N: usize>(fd: RawFd) -> io::Result<[u8; N]> {
    let mut info = [0u8; N];
    let mut a = Attr::new();
    a.u32(0, fd as u32)
        .u32(4, N as u32)
        .u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    Ok(info)
}

/// The ids of the programs attached at the tcx ingress of `ifindex` (up to 64).
pub(crate) fn tcx_ingress_prog_ids(ifindex: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut a = Attr::new();
    a.u32(0, ifindex)
        .u32(4, BPF_TCX_INGRESS)
        .u64(16, ids.as_mut_ptr() as u64)
        .u32(24, ids.len() as u32);
    bpf(BPF_PROG_QUERY, &mut a)?;
    let n = u32::from_ne_bytes(a.0[24..28].try_into().expect("4 bytes")) as usize;
    Ok(ids[..n.min(ids.len())].to_vec())
}

#[cfg(test)]
/// Runs `prog` `repeat` times on the frame `data` (`BPF_PROG_TEST_RUN`): its return value,
/// the frame as it left the program, and the mean time of a run in nanoseconds.
pub(crate) fn prog_test_run(
    prog: RawFd,
    data: &[u8],
    repeat: u32,
) -> io::Result<(u32, Vec<u8>, u32)> {
    let mut out = vec![0u8; data.len() + 256];
    let mut a = Attr::new();
    a.u32(0, prog as u32)
        .u32(8, data.len() as u32)
        .u32(12, out.len() as u32)
        .u64(16, data.as_ptr() as u64)
        .u64(24, out.as_mut_ptr() as u64)
        .u32(32, repeat.max(1));
    bpf(BPF_PROG_TEST_RUN, &mut a)?;
    let word = |at: usize| u32::from_ne_bytes(a.0[at..at + 4].try_into().expect("4 bytes"));
    let (retval, n, duration) = (word(4), word(12) as usize, word(36));
    out.truncate(n);
    Ok((retval, out, duration))
}

/// Pins a bpf object at `path` on a bpffs.
pub(crate) fn obj_pin(fd: RawFd, path: &str) -> io::Result<()> {
    let path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut a = Attr::new();
    a.u64(0, path.as_ptr() as u64).u32(8, fd as u32);
    bpf(BPF_OBJ_PIN, &mut a).map(drop)
}

/// Opens a pinned bpf object.
pub(crate) fn obj_get(path: &str) -> io::Result<OwnedFd> {
    let path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut a = Attr::new();
    a.u64(0, path.as_ptr() as u64);
    bpf_fd(BPF_OBJ_GET, &mut a)
}

fn name16(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    let n = name.len().min(15);
    out[..n].copy_from_slice(&name.as_bytes()[..n]);
    out
}

fn with_log(e: io::Error, log: &[u8]) -> io::Error {
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    if text.trim().is_empty() {
        e
    } else {
        // Keep the tail: the verifier's reason is at the end of its log.
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        io::Error::new(e.kind(), format!("{e}; kernel log (last lines):\n{tail}"))
    }
}
