//! The table of settings: every `SMCR_*` variable with its file key, kind, default and
//! meaning, and the Linux `net.smc` sysctls a file may name that have no setting.

use super::{Kind, Setting};

const ON: &str = "on";

/// Every setting of a process running smcr (the launcher's own `SMCR_LIB` and the tests'
/// variables are not settings of a process).
pub static SETTINGS: &[Setting] = &[
    Setting {
        key: "smcr.disable",
        var: "SMCR_DISABLE",
        kind: Kind::Flag,
        default: "off",
        about: "every socket of the process stays TCP",
    },
    Setting {
        key: "smcr.negotiation",
        var: "SMCR_NEGOTIATION",
        kind: Kind::Choice(&["option", "assume"]),
        default: "option",
        about: "how capability is learned: the TCP option (option program), or assumed (both ends run smcr)",
    },
    Setting {
        key: "smcr.bpf_dir",
        var: "SMCR_BPF_DIR",
        kind: Kind::Path,
        default: crate::option::DEFAULT_DIR,
        about: "the option program's pin directory",
    },
    Setting {
        key: "net.smc.rmem",
        var: "SMCR_RMB_KIB",
        kind: Kind::RmemBytes,
        default: "per path: smcr.same_host_rmb_kib, smcr.remote_rmb_kib",
        about: "receive buffer (RMB) of every connection (the variable in KiB)",
    },
    Setting {
        key: "smcr.same_host_rmb_kib",
        var: "SMCR_SAME_HOST_RMB_KIB",
        kind: Kind::Whole("KiB, a whole number"),
        default: "512",
        about: "RMB of connections to an address of this host",
    },
    Setting {
        key: "smcr.remote_rmb_kib",
        var: "SMCR_REMOTE_RMB_KIB",
        kind: Kind::Whole("KiB, a whole number"),
        default: "512",
        about: "RMB of connections to other hosts",
    },
    Setting {
        key: "smcr.roce_port",
        var: "SMCR_ROCE_PORT",
        kind: Kind::Port,
        default: "4791",
        about: "UDP port of the RoCE v2 engine",
    },
    Setting {
        key: "smcr.steer_attach",
        var: "SMCR_STEER_ATTACH",
        // The words `SteerAttach::parse` takes (the on/off spellings of a flag too).
        kind: Kind::Choice(&["pinned", "on", "1", "yes", "load", "off", "0", "no"]),
        default: "pinned",
        about: "attach the RoCE steering program in the namespace (root): when pinned, load it too, or never",
    },
    Setting {
        key: "smcr.ueid",
        var: "SMCR_UEID",
        kind: Kind::Ueids,
        default: crate::runtime::DEFAULT_UEID,
        about: "user EIDs offered in SMC-Rv2 (a Linux peer needs one of its `smcr ueid show`)",
    },
    Setting {
        key: "smcr.same_host",
        var: "SMCR_SAME_HOST",
        kind: Kind::Flag,
        default: ON,
        about: "links to peers on this host move data through shared memory",
    },
    Setting {
        key: "smcr.rdma_device",
        var: "SMCR_RDMA_DEVICE",
        kind: Kind::Choice(&["auto", "engine", "verbs"]),
        default: "auto",
        about: "what carries links: the verbs device (RNIC, rxe) whose RoCE v2 GID holds the address, else our engine (auto); our engine; a verbs device only",
    },
    Setting {
        key: "smcr.rendezvous_dir",
        var: "SMCR_RENDEZVOUS_DIR",
        kind: Kind::Path,
        default: rdma::RENDEZVOUS_DIR,
        about: "where same-host peers in other network namespaces find each other (smcr bpf install makes it; bind-mount it into containers)",
    },
    Setting {
        key: "smcr.write_pad",
        var: "SMCR_WRITE_PAD",
        kind: Kind::Flag,
        default: ON,
        about: "lengthen short WRITEs on UDP links so they share a datagram with their CDC",
    },
    Setting {
        key: "smcr.rkey_reuse",
        var: "SMCR_RKEY_REUSE",
        kind: Kind::Flag,
        default: ON,
        about: "a pooled RMB keeps its confirmed rkey (off: Linux's CONFIRM/DELETE RKEY per connection)",
    },
    Setting {
        key: "smcr.hold_us",
        var: "SMCR_HOLD_US",
        kind: Kind::Whole("microseconds, a whole number"),
        default: "1000",
        about: "how long an epoll loop keeps its link group, and a blocked reader the RoCE socket, between two waits",
    },
    Setting {
        key: "smcr.ack_delay_us",
        var: "SMCR_ACK_DELAY_US",
        kind: Kind::WholeUpTo("microseconds, a whole number, at most 400; 0: off", 400),
        default: "200",
        about: "how long the ACK of a received message may wait to leave with our answer (UDP links to a peer that is smcr)",
    },
    Setting {
        key: "smcr.alt_addrs",
        var: "SMCR_ALT_ADDRS",
        kind: Kind::Addrs,
        default: "none (one link per group)",
        about: "local addresses on a second path: link groups get a second link over them",
    },
    Setting {
        key: "net.smc.smcr_testlink_time",
        var: "SMCR_TESTLINK_TIME",
        kind: Kind::Whole("seconds, a whole number; 0: off"),
        default: "30",
        about: "seconds of link idleness before a TEST LINK",
    },
    Setting {
        key: "smcr.lgr_linger",
        var: "SMCR_LGR_LINGER",
        kind: Kind::Whole("seconds, a whole number"),
        default: "600",
        about: "seconds a link group without connections is kept before DELETE LINK",
    },
    Setting {
        key: "smcr.exit_drain_ms",
        var: "SMCR_EXIT_DRAIN_MS",
        kind: Kind::Whole("milliseconds, a whole number"),
        default: "2000",
        about: "how long exit() waits for unacknowledged data and DELETE LINK",
    },
    Setting {
        key: "smcr.stats_dir",
        var: "SMCR_STATS_DIR",
        kind: Kind::DirOrOff,
        default: crate::stats::DEFAULT_DIR,
        about: "where the process's stats area goes (smc-stat reads it); off: none",
    },
    Setting {
        key: "smcr.include",
        var: "SMCR_INCLUDE",
        kind: Kind::Rules,
        default: "none (every destination)",
        about: "use SMC-R only for these destinations and listeners",
    },
    Setting {
        key: "smcr.exclude",
        var: "SMCR_EXCLUDE",
        kind: Kind::Rules,
        default: "none",
        about: "never use SMC-R for these",
    },
    Setting {
        key: "smcr.log",
        var: "SMCR_LOG",
        kind: Kind::Path,
        default: "none",
        about: "log file: one line per connection, and smcr's and rdma's log records",
    },
    Setting {
        key: "smcr.log_level",
        var: "SMCR_LOG_LEVEL",
        kind: Kind::LogLevel,
        default: "info",
        about: "the least level of the log records written",
    },
    Setting {
        key: "smcr.spin_us",
        var: "SMCR_SPIN_US",
        kind: Kind::Whole("microseconds, a whole number (at most 10000 is used)"),
        default: "15",
        about: "how long a blocked thread polls (same-host rings, its RoCE socket) before it sleeps",
    },
    Setting {
        key: "smcr.spare_threads",
        var: "SMCR_SPARE_THREADS",
        kind: Kind::WholeUpTo("threads, a whole number, at most 256; 0: none", 256),
        default: "4",
        about: "threads kept parked for SMC-R, ready when the program forbids new ones (RLIMIT_NPROC, a seccomp filter, a pids limit)",
    },
    Setting {
        key: "smcr.app_drive",
        var: "SMCR_APP_DRIVE",
        kind: Kind::Flag,
        default: ON,
        about: "a thread in epoll_wait/poll/select handles its link group's messages itself",
    },
    Setting {
        key: "smcr.lazy_pair",
        var: "SMCR_LAZY_PAIR",
        kind: Kind::Flag,
        default: ON,
        about: "a socket's readiness pair is brought in step only when someone looks",
    },
    Setting {
        key: "smcr.virtual_epoll",
        var: "SMCR_VIRTUAL_EPOLL",
        kind: Kind::Flag,
        default: ON,
        about: "SMC-R sockets in epoll sets are answered for in user space",
    },
    Setting {
        key: "smcr.rdma_pcap",
        var: "SMCR_RDMA_PCAP",
        kind: Kind::Path,
        default: "none",
        about: "capture the RoCE engine's packets to this pcap file",
    },
    Setting {
        key: "smcr.cork",
        var: "SMCR_CORK",
        kind: Kind::Flag,
        default: ON,
        about: "an event loop's writes after an epoll_wait leave together when it calls in again (UDP links)",
    },
    Setting {
        key: "smcr.rdma_ext",
        var: "SMCR_RDMA_EXT",
        kind: Kind::Flag,
        default: ON,
        about: "the RoCE engine bundles small packets to a peer that is our engine, and leaves out the ICRC where both allow",
    },
    Setting {
        key: "smcr.rdma_icrc",
        var: "SMCR_RDMA_ICRC",
        kind: Kind::Choice(&["peer", "always"]),
        default: "peer",
        about: "`always`: check the ICRC of every packet, also from our own engines (which then compute it)",
    },
    Setting {
        key: "smcr.rdma_faults",
        var: "SMCR_RDMA_FAULTS",
        kind: Kind::Faults,
        default: "none",
        about: "faults the RoCE engine injects into what it sends (tests)",
    },
];

/// Linux `net.smc` sysctls a file may name that smcr has no setting for, and why.
pub(super) const NOT_SETTINGS: &[(&str, &str)] = &[
    (
        "net.smc.wmem",
        "the send buffer is always as large as the peer's RMB (set net.smc.rmem on the peer)",
    ),
    (
        "net.smc.autocorking_size",
        "fixed: half the send buffer, at most 64 KiB",
    ),
    (
        "net.smc.smcr_max_links_per_lgr",
        "1, or 2 with smcr.alt_addrs (a second path)",
    ),
    ("net.smc.smcr_max_conns_per_lgr", "fixed at 255"),
    (
        "net.smc.smcr_buf_type",
        "every RMB is one mapping (virtually contiguous)",
    ),
    ("net.smc.limit_smc_hs", "handshakes are not limited"),
];
