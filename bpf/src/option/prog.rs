//! The sock_ops program that puts the SMC-R capability option into SYN and SYN-ACK, and the BTF
//! describing its per-socket storage. Pure: builds bytes, loads nothing.
//!
//! What it does, by `skops->op` (include/uapi/linux/bpf.h):
//! * `TCP_CONNECT_CB` (a socket connects) and `TCP_LISTEN_CB` (a socket listens): when the
//!   socket's storage says [`MARKED`], turn on the header-option callbacks for it. A marked
//!   listener also gets `TCP_SAVE_SYN`, so the SYN is still readable when the child is
//!   established and when a SYN-ACK is retransmitted.
//! * `HDR_OPT_LEN_CB` / `WRITE_HDR_OPT_CB`: reserve and write `fe 06 e2 d4 c3 d9` into a SYN, and
//!   into a SYN-ACK only when the SYN carried those bytes and the SYN-ACK is not a SYN cookie —
//!   what Linux does (wire-spec §1.2). Callbacks only run for sockets whose flag was turned on.
//! * `ACTIVE_ESTABLISHED_CB` / `PASSIVE_ESTABLISHED_CB`: for marked sockets, record
//!   [`ESTABLISHED`] and, when the SYN-ACK (client) or the SYN (server) carried the option,
//!   [`PEER`] — on the server only while the port is still in the listening map, so that a
//!   SYN-ACK that went without the option never leaves a server expecting CLC; then turn the
//!   header callbacks off so data packets pay nothing.
//!
//! * The SYN-ACK callbacks run on the request socket, which has no storage: what they can look
//!   up is the listener's port. So a marked socket that starts to listen puts its port, in its
//!   network namespace, in the *listening* map, and a SYN-ACK carries the option only from a
//!   port there (and only this install's: with several installs, each answers for the
//!   listeners it marked). A listener handed to a program image that cannot negotiate (an
//!   `exec` that drops the library, a process without it) is made *quiet*:
//!   [`crate::option::sockopt`]'s set program takes its port out, and its SYN-ACKs offer
//!   nothing. A SYN carries the option only for a socket marked in this install's map.
//!
//! Listener marks reach accepted sockets because the map is created with `BPF_F_CLONE`.

use super::asm::{Asm, Insn, R0, R1, R2, R3, R4, R5, R6, R7, R8, R10};

/// Storage flag set by the application: this socket takes part in SMC-R negotiation.
pub const MARKED: u32 = 1 << 0;
/// Set by the program: the peer's SYN (we listen) or SYN-ACK (we connect) carried the option.
pub const PEER: u32 = 1 << 1;
/// Set by the program: it saw this marked socket's handshake complete.
pub const ESTABLISHED: u32 = 1 << 2;

/// The option: kind 254, length 6, magic `E2 D4 C3 D9` (wire-spec §1.1). Linux puts its two
/// padding NOPs before it; `bpf_store_hdr_opt` only stores whole options and the kernel pads
/// after the last one, so ours arrive as `fe 06 e2 d4 c3 d9 01 01` — the same option to any
/// receiver (docs/protocol.md).
pub const OPTION: [u8; 6] = [0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9];

// `struct bpf_sock_ops` offsets (checked against the UAPI header with offsetof).
const CTX_OP: i16 = 0;
const CTX_ARGS0: i16 = 4;
const CTX_CB_FLAGS: i16 = 84;
const CTX_SK: i16 = 184;
const CTX_SKB_TCP_FLAGS: i16 = 212;
const CTX_LOCAL_PORT: i16 = 68;

// `enum bpf_sock_ops_op`.
const OP_TCP_CONNECT_CB: i32 = 3;
const OP_ACTIVE_ESTABLISHED_CB: i32 = 4;
const OP_PASSIVE_ESTABLISHED_CB: i32 = 5;
const OP_TCP_LISTEN_CB: i32 = 11;
const OP_HDR_OPT_LEN_CB: i32 = 14;
const OP_WRITE_HDR_OPT_CB: i32 = 15;

const CB_FLAG_WRITE_HDR_OPT: i32 = 1 << 6;
const WRITE_HDR_SYNACK_COOKIE: i32 = 2;
const LOAD_HDR_OPT_TCP_SYN: i32 = 1;
const TCPHDR_SYN: i32 = 0x02;
const TCPHDR_ACK: i32 = 0x10;
const SOL_TCP: i32 = 6;
const TCP_SAVE_SYN: i32 = 27;

// Helper function numbers (`___BPF_FUNC_MAPPER`).
const HELPER_MAP_LOOKUP: i32 = 1;
const HELPER_MAP_UPDATE: i32 = 2;
const HELPER_SETSOCKOPT: i32 = 49;
const HELPER_GET_NETNS_COOKIE: i32 = 122;
const HELPER_SOCK_OPS_CB_FLAGS_SET: i32 = 59;
const HELPER_SK_STORAGE_GET: i32 = 107;
const HELPER_LOAD_HDR_OPT: i32 = 142;
const HELPER_STORE_HDR_OPT: i32 = 143;
const HELPER_RESERVE_HDR_OPT: i32 = 144;

// Stack slots.
const STACK_OPTION: i16 = -8;
const STACK_ONE: i16 = -16;
/// The listening map's key ([`PORT_KEY_SIZE`] bytes): the network namespace's cookie, the port.
pub(crate) const STACK_PORT_KEY: i16 = -32;
/// The listening map's value slot.
const STACK_PORT_VALUE: i16 = -40;

/// Listening map: key `{ u64 netns cookie; u32 port (host order); u32 zero }`, value a u32.
pub(crate) const PORT_KEY_SIZE: u32 = 16;
pub(crate) const PORT_VALUE_SIZE: u32 = 4;
/// Entries. LRU: when a host has more marked listening ports than this, the least recently
/// used ones lose their option (their peers fall back to TCP, never worse); a closed
/// listener's entry stays until then, harmless (only a socket marked here makes SYN-ACKs
/// with the callbacks that look).
pub(crate) const PORT_ENTRIES: u32 = 16384;

/// Emits: the listening-map key of this context's network namespace and `port` (a register)
/// at [`STACK_PORT_KEY`]; r1 = the context (r6) for the cookie. Clobbers r0-r5.
pub(crate) fn port_key(a: &mut Asm, port: super::asm::Reg) {
    a.stx_w(R10, STACK_PORT_KEY + 8, port)
        .st_w(R10, STACK_PORT_KEY + 12, 0)
        .mov(R1, R6)
        .call(HELPER_GET_NETNS_COOKIE)
        .stx_dw(R10, STACK_PORT_KEY, R0);
}

/// Emits: r0 = this socket's storage, or jump to `out` when the socket is not a full socket or
/// has no storage or is not marked. Clobbers r1-r5.
fn storage_or(a: &mut Asm, map_fd: i32, out: &str) {
    a.ldx_dw(R2, R6, CTX_SK)
        .jeq_imm(R2, 0, out)
        .ld_map_fd(R1, map_fd)
        .mov_imm(R3, 0)
        .mov_imm(R4, 0)
        .call(HELPER_SK_STORAGE_GET)
        .jeq_imm(R0, 0, out)
        .ldx_w(R1, R0, 0)
        .and_imm(R1, MARKED as i32)
        .jeq_imm(R1, 0, out);
}

/// Emits: for a SYN-ACK, jump to `out` unless it may carry the option (not a cookie, the SYN
/// carried it, and its port is one of this install's listening ports); for a SYN, jump to
/// `out` unless its socket is marked in this install's map, else to `go`; for anything else,
/// jump to `out`.
fn only_syn_or_echo(a: &mut Asm, map_fd: i32, ports_fd: i32, out: &str, go: &str) {
    let syn = format!("{go}_syn");
    a.ldx_w(R1, R6, CTX_SKB_TCP_FLAGS)
        .mov(R2, R1)
        .and_imm(R2, TCPHDR_SYN)
        .jeq_imm(R2, 0, out)
        .and_imm(R1, TCPHDR_ACK)
        .jeq_imm(R1, 0, &syn)
        .ldx_w(R1, R6, CTX_ARGS0)
        .jeq_imm(R1, WRITE_HDR_SYNACK_COOKIE, out)
        .mov(R1, R6)
        .mov(R2, R10)
        .add_imm(R2, STACK_OPTION as i32)
        .mov_imm(R3, OPTION.len() as i32)
        .mov_imm(R4, LOAD_HDR_OPT_TCP_SYN)
        .call(HELPER_LOAD_HDR_OPT)
        .jslt_imm(R0, 0, out)
        .ldx_w(R7, R6, CTX_LOCAL_PORT);
    port_key(a, R7);
    a.ld_map_fd(R1, ports_fd)
        .mov(R2, R10)
        .add_imm(R2, STACK_PORT_KEY as i32)
        .call(HELPER_MAP_LOOKUP)
        .jeq_imm(R0, 0, out)
        .ja(go);
    a.label(&syn);
    storage_or(a, map_fd, out);
    a.ja(go);
}

/// Emits the established handler: record the peer's option and turn the callbacks off. With
/// `ports_fd` (the passive side), the peer counts only when its SYN carried the option *and*
/// the port is still in the listening map — the test the SYN-ACK passed to carry ours. A SYN
/// with the option answered by a SYN-ACK without it (a quiet or evicted port) is plain TCP on
/// both ends.
fn established(a: &mut Asm, map_fd: i32, ports_fd: Option<i32>, load_flags: i32, name: &str) {
    let clear = format!("{name}_clear");
    storage_or(a, map_fd, "out");
    a.mov(R8, R0)
        .ldx_w(R1, R8, 0)
        .or_imm(R1, ESTABLISHED as i32)
        .stx_w(R8, 0, R1)
        .mov(R1, R6)
        .mov(R2, R10)
        .add_imm(R2, STACK_OPTION as i32)
        .mov_imm(R3, OPTION.len() as i32)
        .mov_imm(R4, load_flags)
        .call(HELPER_LOAD_HDR_OPT)
        .jslt_imm(R0, 0, &clear);
    if let Some(ports_fd) = ports_fd {
        a.ldx_w(R7, R6, CTX_LOCAL_PORT);
        port_key(a, R7);
        a.ld_map_fd(R1, ports_fd)
            .mov(R2, R10)
            .add_imm(R2, STACK_PORT_KEY as i32)
            .call(HELPER_MAP_LOOKUP)
            .jeq_imm(R0, 0, &clear);
    }
    a.ldx_w(R1, R8, 0)
        .or_imm(R1, PEER as i32)
        .stx_w(R8, 0, R1)
        .label(&clear)
        .ldx_w(R2, R6, CTX_CB_FLAGS)
        .and_imm(R2, !CB_FLAG_WRITE_HDR_OPT)
        .mov(R1, R6)
        .call(HELPER_SOCK_OPS_CB_FLAGS_SET)
        .ja("out");
}

/// The program's instructions, with `map_fd` (the sk_storage map) and `ports_fd` (the
/// listening ports) built in.
pub(crate) fn program(map_fd: i32, ports_fd: i32) -> Vec<Insn> {
    let option = u64::from_le_bytes([
        OPTION[0], OPTION[1], OPTION[2], OPTION[3], OPTION[4], OPTION[5], 0, 0,
    ]);
    let mut a = Asm::default();
    a.mov(R6, R1)
        .ldx_w(R7, R6, CTX_OP)
        .ld_imm64(R1, option)
        .stx_dw(R10, STACK_OPTION, R1)
        .jeq_imm(R7, OP_TCP_CONNECT_CB, "connect")
        .jeq_imm(R7, OP_TCP_LISTEN_CB, "listen")
        .jeq_imm(R7, OP_HDR_OPT_LEN_CB, "hdr_len")
        .jeq_imm(R7, OP_WRITE_HDR_OPT_CB, "hdr_write")
        .jeq_imm(R7, OP_ACTIVE_ESTABLISHED_CB, "active")
        .jeq_imm(R7, OP_PASSIVE_ESTABLISHED_CB, "passive")
        .ja("out");

    a.label("listen");
    storage_or(&mut a, map_fd, "out");
    // Its SYN-ACKs may carry the option (the port's entry; it goes when made quiet).
    a.ldx_w(R7, R6, CTX_LOCAL_PORT);
    port_key(&mut a, R7);
    a.st_w(R10, STACK_PORT_VALUE, 1)
        .ld_map_fd(R1, ports_fd)
        .mov(R2, R10)
        .add_imm(R2, STACK_PORT_KEY as i32)
        .mov(R3, R10)
        .add_imm(R3, STACK_PORT_VALUE as i32)
        .mov_imm(R4, 0)
        .call(HELPER_MAP_UPDATE);
    a.st_w(R10, STACK_ONE, 1)
        .mov(R1, R6)
        .mov_imm(R2, SOL_TCP)
        .mov_imm(R3, TCP_SAVE_SYN)
        .mov(R4, R10)
        .add_imm(R4, STACK_ONE as i32)
        .mov_imm(R5, 4)
        .call(HELPER_SETSOCKOPT)
        .ja("enable");

    a.label("connect");
    storage_or(&mut a, map_fd, "out");
    a.label("enable")
        .ldx_w(R2, R6, CTX_CB_FLAGS)
        .or_imm(R2, CB_FLAG_WRITE_HDR_OPT)
        .mov(R1, R6)
        .call(HELPER_SOCK_OPS_CB_FLAGS_SET)
        .ja("out");

    a.label("hdr_len");
    only_syn_or_echo(&mut a, map_fd, ports_fd, "out", "reserve");
    a.label("reserve")
        .mov(R1, R6)
        .mov_imm(R2, OPTION.len() as i32)
        .mov_imm(R3, 0)
        .call(HELPER_RESERVE_HDR_OPT)
        .ja("out");

    a.label("hdr_write");
    only_syn_or_echo(&mut a, map_fd, ports_fd, "out", "store");
    a.label("store")
        .mov(R1, R6)
        .mov(R2, R10)
        .add_imm(R2, STACK_OPTION as i32)
        .mov_imm(R3, OPTION.len() as i32)
        .mov_imm(R4, 0)
        .call(HELPER_STORE_HDR_OPT)
        .ja("out");

    a.label("active");
    established(&mut a, map_fd, None, 0, "active");
    a.label("passive");
    established(
        &mut a,
        map_fd,
        Some(ports_fd),
        LOAD_HDR_OPT_TCP_SYN,
        "passive",
    );

    a.label("out").mov_imm(R0, 1).exit();
    a.finish()
        .expect("the option program's labels are consistent")
}

/// BTF type id of the map key (`int`, a socket fd).
pub(crate) const BTF_KEY_TYPE: u32 = 1;
/// BTF type id of the map value (`struct smcr_sk_opt`).
pub(crate) const BTF_VALUE_TYPE: u32 = 3;
/// Size of the map value: `{ u32 flags; u32 reserved; }`.
pub(crate) const VALUE_SIZE: u32 = 8;

/// The BTF blob sk_storage maps require (the kernel checks the key is a 32-bit int):
/// `[1] int`, `[2] unsigned int`, `[3] struct smcr_sk_opt { flags; reserved; }`.
pub(crate) fn btf() -> Vec<u8> {
    const KIND_INT: u32 = 1;
    const KIND_STRUCT: u32 = 4;
    const INT_SIGNED: u32 = 1;
    let strings = b"\0int\0unsigned int\0smcr_sk_opt\0flags\0reserved\0";
    let name = |s: &str| -> u32 {
        let needle = format!("\0{s}\0");
        let pos = strings
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .expect("name is in the string table");
        pos as u32 + 1
    };
    let mut types: Vec<u32> = Vec::new();
    // [1] int: name, info, size, encoding|offset|bits.
    types.extend([name("int"), KIND_INT << 24, 4, (INT_SIGNED << 24) | 32]);
    // [2] unsigned int.
    types.extend([name("unsigned int"), KIND_INT << 24, 4, 32]);
    // [3] struct smcr_sk_opt, 2 members of type [2] at bit offsets 0 and 32.
    types.extend([name("smcr_sk_opt"), (KIND_STRUCT << 24) | 2, VALUE_SIZE]);
    types.extend([name("flags"), 2, 0]);
    types.extend([name("reserved"), 2, 32]);
    let type_bytes: Vec<u8> = types.iter().flat_map(|w| w.to_le_bytes()).collect();

    let mut out = Vec::new();
    out.extend(0xeb9f_u16.to_le_bytes()); // magic
    out.push(1); // version
    out.push(0); // flags
    out.extend(24u32.to_le_bytes()); // hdr_len
    out.extend(0u32.to_le_bytes()); // type_off
    out.extend((type_bytes.len() as u32).to_le_bytes());
    out.extend((type_bytes.len() as u32).to_le_bytes()); // str_off
    out.extend((strings.len() as u32).to_le_bytes());
    out.extend(type_bytes);
    out.extend(strings);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_builds_and_ends_with_exit() {
        let p = program(42, 43);
        eprintln!("{} instructions", p.len());
        assert!(p.len() < 250, "{} instructions", p.len());
        assert_eq!(p.last().unwrap().code, 0x95);
        // Every map load names our fd.
        let map_loads: Vec<_> = p.iter().filter(|i| i.code == 0x18 && i.src == 1).collect();
        assert!(!map_loads.is_empty());
        assert!(map_loads.iter().all(|i| i.imm == 42 || i.imm == 43));
        // No jump leaves the program.
        for (pc, i) in p.iter().enumerate() {
            if i.code & 0x07 == 0x05 && i.code != 0x85 && i.code != 0x95 {
                let target = pc as i64 + 1 + i.off as i64;
                assert!((0..p.len() as i64).contains(&target), "pc {pc}");
            }
        }
    }

    #[test]
    fn option_constant_in_the_program_is_the_linux_option() {
        let p = program(3, 4);
        // ld_imm64 r1: low word, then high word.
        let lo = p[2].imm as u32;
        let hi = p[3].imm as u32;
        let v = (u64::from(hi) << 32) | u64::from(lo);
        assert_eq!(&v.to_le_bytes()[..6], &OPTION);
    }

    #[test]
    fn btf_layout() {
        let b = btf();
        assert_eq!(&b[..4], &[0x9f, 0xeb, 1, 0]);
        let type_len = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
        let str_off = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
        let str_len = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
        assert_eq!(type_len, 4 * (4 + 4 + 3 + 3 + 3));
        assert_eq!(str_off, type_len);
        assert_eq!(b.len(), 24 + type_len + str_len);
        assert_eq!(
            b[24 + str_off],
            0,
            "string table starts with the empty name"
        );
    }
}
