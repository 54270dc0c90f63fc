//! The two cgroup socket-option programs through which processes mark their sockets and read
//! the option program's record of them with plain `setsockopt`/`getsockopt` on a private
//! level — no `bpf(2)` in the application, which a service's seccomp filter forbids (systemd's
//! `SystemCallFilter=~@privileged` kills a process that calls it). Pure: builds instructions,
//! loads nothing.
//!
//! * `setsockopt(fd, SOL_SMCR, optname(id, OP_RECORD), &[u8; 8], 8)`: the socket's record
//!   (flags, then the claiming pid: [`super::SockOption`], [`super::Claim`]) becomes those 8
//!   bytes; `optname(id, OP_DELETE)` removes it; `optname(id, OP_QUIET)` also makes a
//!   listener's port quiet. The kernel's own handler is skipped (`optlen = -1`), so the call
//!   returns 0.
//! * `getsockopt(fd, SOL_SMCR, optname(id, OP_RECORD), buf, &8)`: the record (zeros when the
//!   socket has none); the program turns the kernel's refusal of the unknown level into
//!   success.
//!
//! Every other level and name passes untouched, for every socket of the machine. Without the
//! programs the kernel refuses the level (`ENOPROTOOPT`, `EOPNOTSUPP`): that is how a process
//! learns they are missing. A process reaches only the sockets it holds a descriptor of.
//!
//! `id` keeps installs apart: the machine's install (pins under [`super::DEFAULT_DIR`]) answers
//! id 0, and an install under another directory (a test's) answers an id derived from that
//! path ([`install_id`]), so that marking a socket for one never marks it for the other.

use std::path::Path;

use super::asm::{Asm, Insn, R0, R1, R2, R3, R4, R6, R7, R8, R10};

/// The private option level (`"SMCR"`), far from every `SOL_*` Linux defines (below 300).
pub const SOL_SMCR: i32 = 0x534d_4352;
/// The socket's record, 8 bytes (set or get).
pub const OP_RECORD: i32 = 1;
/// Remove the socket's record (set only).
pub const OP_DELETE: i32 = 2;
/// A listener about to reach a program that cannot negotiate: remove its record, and, when it
/// is a TCP listener, make its port quiet (its port leaves the listening map: no SYN-ACK from it carries the option until
/// a marked socket listens there again; docs/protocol.md) (set only).
pub const OP_QUIET: i32 = 3;

/// The option name of `op` for the install `id`.
pub const fn optname(id: u16, op: i32) -> i32 {
    ((id as i32) << 8) | op
}

/// The id of the install whose pins are under `dir`: 0 for the machine's
/// ([`super::DEFAULT_DIR`], also seen as [`super::MIRROR_DIR`]), else a 16-bit hash of the path
/// (never 0).
pub fn install_id(dir: &Path) -> u16 {
    if dir == Path::new(super::DEFAULT_DIR) || dir == Path::new(super::MIRROR_DIR) {
        return 0;
    }
    // FNV-1a, folded: stable across builds and processes.
    let mut h: u32 = 0x811c_9dc5;
    for b in dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    match ((h >> 16) ^ h) as u16 {
        0 => 1,
        id => id,
    }
}

// `struct bpf_sockopt` offsets (checked against the UAPI header with offsetof).
const CTX_SK: i16 = 0;
const CTX_OPTVAL: i16 = 8;
const CTX_OPTVAL_END: i16 = 16;
const CTX_LEVEL: i16 = 24;
const CTX_OPTNAME: i16 = 28;
const CTX_OPTLEN: i16 = 32;
const CTX_RETVAL: i16 = 36;

const HELPER_MAP_DELETE: i32 = 3;
const HELPER_SK_STORAGE_GET: i32 = 107;
const HELPER_SK_STORAGE_DELETE: i32 = 108;
const SK_STORAGE_GET_F_CREATE: i32 = 1;

/// The record's size, which both calls carry.
const RECORD: i32 = 8;

/// Emits: r2 = optval and falls through when it holds [`RECORD`] bytes, else jumps to `out`.
/// Clobbers r3, r4.
fn optval_or(a: &mut Asm, out: &str) {
    a.ldx_dw(R2, R6, CTX_OPTVAL)
        .ldx_dw(R3, R6, CTX_OPTVAL_END)
        .mov(R4, R2)
        .add_imm(R4, RECORD)
        .jgt(R4, R3, out);
}

/// `struct bpf_sock`'s `protocol`.
const SOCK_PROTOCOL: i16 = 12;
/// `struct bpf_sock`'s `src_port` (host order).
const SOCK_SRC_PORT: i16 = 44;
/// `struct bpf_sock`'s `state`.
const SOCK_STATE: i16 = 72;
const IPPROTO_TCP: i32 = 6;
const BPF_TCP_LISTEN: i32 = 10;
/// The `BPF_CGROUP_SETSOCKOPT` program for install `id`, with the sk_storage map `map_fd` and
/// the listening ports `ports_fd` built in.
pub(crate) fn set_program(map_fd: i32, ports_fd: i32, id: u16) -> Vec<Insn> {
    let mut a = Asm::default();
    a.mov(R6, R1)
        .ldx_w(R1, R6, CTX_LEVEL)
        .jne_imm(R1, SOL_SMCR, "out")
        .ldx_w(R7, R6, CTX_OPTNAME)
        .jeq_imm(R7, optname(id, OP_RECORD), "record")
        .jeq_imm(R7, optname(id, OP_DELETE), "delete")
        .jeq_imm(R7, optname(id, OP_QUIET), "quiet")
        .ja("out");

    // A short value is left to the kernel, which refuses the level (ENOPROTOOPT).
    a.label("record");
    optval_or(&mut a, "out");
    a.ldx_dw(R8, R2, 0)
        .ldx_dw(R2, R6, CTX_SK)
        .ld_map_fd(R1, map_fd)
        .mov_imm(R3, 0)
        .mov_imm(R4, SK_STORAGE_GET_F_CREATE)
        .call(HELPER_SK_STORAGE_GET)
        .jeq_imm(R0, 0, "out")
        .stx_dw(R0, 0, R8)
        .ja("done");

    // Only a TCP listener's port goes quiet: any other socket that happens to share the port
    // (an accepted one, a client's) just loses its record.
    a.label("quiet")
        .ldx_dw(R2, R6, CTX_SK)
        .ldx_w(R1, R2, SOCK_PROTOCOL)
        .jne_imm(R1, IPPROTO_TCP, "delete")
        .ldx_w(R1, R2, SOCK_STATE)
        .jne_imm(R1, BPF_TCP_LISTEN, "delete")
        .ldx_w(R7, R2, SOCK_SRC_PORT);
    super::prog::port_key(&mut a, R7);
    a.ld_map_fd(R1, ports_fd)
        .mov(R2, R10)
        .add_imm(R2, super::prog::STACK_PORT_KEY as i32)
        .call(HELPER_MAP_DELETE);

    a.label("delete")
        .ldx_dw(R2, R6, CTX_SK)
        .ld_map_fd(R1, map_fd)
        .call(HELPER_SK_STORAGE_DELETE);

    // optlen -1: handled here, the kernel's setsockopt is not called and the call returns 0.
    a.label("done").mov_imm(R1, -1).stx_w(R6, CTX_OPTLEN, R1);

    a.label("out").mov_imm(R0, 1).exit();
    a.finish().expect("the set program's labels are consistent")
}

/// The `BPF_CGROUP_GETSOCKOPT` program for install `id`, with the sk_storage map `map_fd` built
/// in.
pub(crate) fn get_program(map_fd: i32, id: u16) -> Vec<Insn> {
    let mut a = Asm::default();
    a.mov(R6, R1)
        .ldx_w(R1, R6, CTX_LEVEL)
        .jne_imm(R1, SOL_SMCR, "out")
        .ldx_w(R1, R6, CTX_OPTNAME)
        .jne_imm(R1, optname(id, OP_RECORD), "out")
        .ldx_dw(R2, R6, CTX_SK)
        .ld_map_fd(R1, map_fd)
        .mov_imm(R3, 0)
        .mov_imm(R4, 0)
        .call(HELPER_SK_STORAGE_GET)
        .mov_imm(R8, 0)
        .jeq_imm(R0, 0, "write")
        .ldx_dw(R8, R0, 0);

    // A buffer shorter than the record keeps the kernel's answer (EOPNOTSUPP).
    a.label("write");
    optval_or(&mut a, "out");
    a.stx_dw(R2, 0, R8)
        .mov_imm(R1, RECORD)
        .stx_w(R6, CTX_OPTLEN, R1)
        .mov_imm(R1, 0)
        .stx_w(R6, CTX_RETVAL, R1);

    a.label("out").mov_imm(R0, 1).exit();
    a.finish().expect("the get program's labels are consistent")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jumps_stay_inside(p: &[Insn]) {
        assert_eq!(p.last().unwrap().code, 0x95, "ends with exit");
        for (pc, i) in p.iter().enumerate() {
            if i.code & 0x07 == 0x05 && i.code != 0x85 && i.code != 0x95 {
                let target = pc as i64 + 1 + i.off as i64;
                assert!((0..p.len() as i64).contains(&target), "pc {pc}");
            }
        }
    }

    #[test]
    fn programs_build_name_their_map_and_their_install() {
        for p in [set_program(42, 42, 7), get_program(42, 7)] {
            jumps_stay_inside(&p);
            let maps: Vec<_> = p.iter().filter(|i| i.code == 0x18 && i.src == 1).collect();
            assert!(!maps.is_empty() && maps.iter().all(|i| i.imm == 42));
            // The level and this install's record name are compared; another install's are not.
            let compared = |v: i32| {
                p.iter()
                    .any(|i| matches!(i.code, 0x15 | 0x55) && i.imm == v)
            };
            assert!(compared(SOL_SMCR));
            assert!(compared(optname(7, OP_RECORD)));
            assert!(!compared(optname(0, OP_RECORD)));
        }
    }

    #[test]
    fn install_ids() {
        assert_eq!(install_id(Path::new(super::super::DEFAULT_DIR)), 0);
        assert_eq!(install_id(Path::new(super::super::MIRROR_DIR)), 0);
        let a = install_id(Path::new("/sys/fs/bpf/smcr-test-1-wire"));
        let b = install_id(Path::new("/sys/fs/bpf/smcr-test-2-wire"));
        assert!(a != 0 && b != 0 && a != b, "{a} {b}");
        assert_eq!(a, install_id(Path::new("/sys/fs/bpf/smcr-test-1-wire")));
        // Option names stay positive and distinct per operation.
        assert!(optname(u16::MAX, OP_DELETE) > 0);
        assert_ne!(optname(a, OP_RECORD), optname(a, OP_DELETE));
    }
}
