//! What the fallback codes mean (Linux's decline codes and ours) and what a user can do
//! about each.

/// Name and meaning of a fallback code: Linux's decline codes, and ours (0x7f00_00xx).
pub fn reason(code: u32) -> (&'static str, &'static str) {
    use crate::FallbackReason as F;
    match code {
        F::CODE_NO_BPF => ("NOBPF", "the TCP option program is not usable here"),
        F::CODE_OPTION_NOT_OBSERVED => (
            "OPTNOTSEEN",
            "the TCP option program did not see the handshake (socket outside its cgroup?)",
        ),
        F::CODE_NOT_IPV4 => (
            "NOTIPV4",
            "a native IPv6 connection (SMC-Rv2 runs over IPv4; a dual-stack socket's IPv4 peers are served)",
        ),
        F::CODE_EXCLUDED => ("EXCLUDED", "kept on TCP by SMCR_INCLUDE/SMCR_EXCLUDE"),
        F::CODE_NO_FD => (
            "NOFD",
            "no file descriptor left for SMC-R within the process's RLIMIT_NOFILE",
        ),
        F::CODE_SHARED => (
            "SHARED",
            "the connection was held by several processes (fork) when first used",
        ),
        F::CODE_NO_THREAD => (
            "NOTHREAD",
            "no thread could be created for SMC-R (RLIMIT_NPROC, a pids limit, or a seccomp filter installed after start-up) and the spare threads were in use",
        ),
        F::CODE_HANDED_OFF => (
            "HANDOFF",
            "the socket went to a program without smcr (an exec whose environment drops the library, a process without it), so it was made plain TCP first",
        ),
        F::CODE_NOT_CLC => (
            "NOTCLC",
            "the server answered our CLC Proposal with bytes that are not CLC, or closed at it (the process reading its end had no record of the connection: a program without smcr got the socket, or it lost its state); the preload connected again over plain TCP (a Rust API connect fails with it)",
        ),
        0 => ("OTHER", "codes beyond the area's counters"),
        c => {
            let r = clc::DeclineReason(c);
            (
                r.name().unwrap_or("UNKNOWN"),
                r.meaning().unwrap_or("unknown code"),
            )
        }
    }
}

/// What a user can do about a fallback code (one line).
pub fn remedy(code: u32) -> &'static str {
    use crate::FallbackReason as F;
    match code {
        F::CODE_NO_BPF => {
            "load the TCP option program and its socket-option programs: `smcr bpf install` as root, once per machine (smcr run does it as root; an older install lacks the socket-option programs: run it again)"
        }
        F::CODE_OPTION_NOT_OBSERVED => {
            "run the program inside the cgroup v2 hierarchy the option program is attached to (`smcr bpf status`)"
        }
        F::CODE_NOT_IPV4 => {
            "connect to the server's IPv4 address (a server listening on [::] serves it over SMC-R)"
        }
        F::CODE_EXCLUDED => {
            "adjust SMCR_INCLUDE / SMCR_EXCLUDE if this connection should use SMC-R"
        }
        F::CODE_NO_FD => {
            "raise the descriptor limit (`ulimit -n`, LimitNOFILE=): with a hard limit above the soft one smcr's descriptors take none of the program's, else it uses at most the top eighth of the limit"
        }
        F::CODE_SHARED => {
            "none needed (the connection works over TCP); have one process use each connection"
        }
        F::CODE_NO_THREAD => {
            "raise SMCR_SPARE_THREADS (threads parked before the program can lock itself down; a link group keeps one for its life, a handshake in progress one), or lift the lock-down (RLIMIT_NPROC, TasksMax=, clone in the seccomp filter)"
        }
        F::CODE_HANDED_OFF => {
            "keep the library in the environment of the program that gets the socket (e.g. `systemd-socket-activate -E LD_PRELOAD`, or start it with `smcr run`), or leave it on TCP"
        }
        F::CODE_NOT_CLC => {
            "on the server's host: keep smcr in every program that gets the server's sockets (exec, SCM_RIGHTS; smc-stat there shows HANDOFF where a socket went to a program without it), or leave that server on TCP (SMCR_EXCLUDE here)"
        }
        0x0101_0000 => {
            "the RMB budget is used up: lower the RMB size (smcr run --rmb-kib, SMCR_RMB_KIB)"
        }
        0x0201_0000 | 0x0202_0000 => {
            "check that RoCE v2 (UDP 4791) passes between the hosts (firewall, MTU)"
        }
        0x0300_0000 | 0x0307_0000 => {
            "give both interfaces addresses in a common subnet, or use SMC-Rv2 routing"
        }
        0x0301_0000 => "start the peer under smcr (`smcr run`), or exclude it with SMCR_EXCLUDE",
        0x0302_0000 => "SMC cannot run under IPsec: exclude the connection",
        0x0303_0000 | 0x0303_0002 => {
            "declined by a Linux peer: it shares none of our user EIDs (it offers SMC-Rv2 only with a UEID it has): set SMCR_UEID to one of its UEIDs (`smcr ueid show` there); ours: another process owns UDP 4791 on the local address and no steering program shares it: run `smcr bpf install` as root"
        }
        0x0303_0001 | 0x0303_0003 | 0x0303_0005 | 0x0303_0007 | 0x0309_0000 | 0x030d_0000 => {
            "SMC-D only: no action for SMC-R"
        }
        0x0303_0004 | 0x0303_0006 | 0x0303_0009 | 0x0304_0000 | 0x030c_0000 => {
            "the peer speaks another SMC version or mode: upgrade it to SMC-Rv2"
        }
        0x0303_0008 => "configure the same user EID on both sides (SMCR_UEID)",
        0x0303_000a | 0x0303_000b => "align the peers' max-links / max-connections settings",
        0x0305_0000 => "the peer uses RMBE eye catchers: not supported",
        0x0306_0000 => "do not use TCP_FASTOPEN on sockets meant for SMC-R",
        0x0308_0000 => "check the VLAN configuration of the interface",
        0x030a_0000 | 0x030b_0000 | 0x0400_0000 => {
            "transient: the link group was being replaced; retry (persisting: restart the peer)"
        }
        0x030e_0000 | 0x030f_0000 => {
            "make the peer reachable directly (same subnet) or fix the route"
        }
        0x0500_0000 => "see the peer's decline code (PEER column) and fix it there",
        0x0999_0000..=0x0999_0003 => {
            "internal error: see SMCR_LOG output; report it if it persists"
        }
        0 => "more distinct codes than the area counts: see individual rows",
        _ => "unknown code: see the peer's documentation",
    }
}
