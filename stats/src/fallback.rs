//! Why a connection is plain TCP: the reasons a socket falls back, their codes (Linux's
//! decline codes where they apply) and their words. Below the runtime, the stream, the stats
//! area and the metrics, which all name them.

use clc::DeclineReason;

/// Why a connection is plain TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackReason {
    /// The peer did not send the SMC-R TCP option (Linux: `PEERNOSMC`); no CLC byte was sent.
    PeerNoSmc,
    /// One side declined during the CLC handshake; both agreed to continue over TCP.
    Declined {
        /// The decline code (the peer's diagnosis if it declined, else ours).
        reason: DeclineReason,
        /// Whether the peer declined.
        by_peer: bool,
    },
    /// Local: the TCP option program is not usable here (not installed, no permission).
    NoBpf(String),
    /// Local: we marked the socket but the option program never saw its handshake.
    OptionNotObserved,
    /// Local: not IPv4 (SMC-Rv2 is IPv4 only); a dual-stack socket's IPv4 peer (v4-mapped) is
    /// IPv4.
    NotIpv4,
    /// Local: the process had no descriptor left for SMC-R within its `RLIMIT_NOFILE`
    /// (`rdma::fdzone`). The peer is declined (`MEM`) when it had offered SMC-R.
    NoDescriptors,
    /// Local: the connection was held by more than one process (inherited through `fork`)
    /// when it was first used; one SMC-R connection cannot be served to several processes.
    Shared,
    /// Local: SMC-R needed a thread (the device's engine, a link group's poller) and none
    /// could be had: no spare was parked (`rdma::thread`) and the program forbids new ones
    /// (`RLIMIT_NPROC`, a pids limit, a seccomp filter installed after start-up); the cause,
    /// in words. The peer is declined (`MEM`) when it had offered SMC-R.
    NoThread(String),
    /// Local: the socket went to a program image that cannot negotiate — an `exec` whose
    /// environment drops the library, a process without it (SCM_RIGHTS) — so it was made
    /// plain TCP before it left: a listener quiet (its peers fall back, PEERNOSMC), an accepted
    /// connection declined (`MEM` on the wire).
    HandedOff,
    /// Local: the server answered our CLC Proposal with bytes that are not CLC (or closed at
    /// it): the process reading its end had no record of the connection. The preload then
    /// connects again, unmarked, over plain TCP (`smcr::not_clc`).
    NotClc,
}

/// Codes of our local reasons, outside Linux's `SMC_CLC_DECL_*` space.
impl FallbackReason {
    /// Local code: the option program is not usable.
    pub const CODE_NO_BPF: u32 = 0x7f00_0001;
    /// Local code: marked, but the program did not see the handshake.
    pub const CODE_OPTION_NOT_OBSERVED: u32 = 0x7f00_0002;
    /// Local code: not an IPv4 connection.
    pub const CODE_NOT_IPV4: u32 = 0x7f00_0003;
    /// Local code: kept off SMC-R by the user's policy (`SMCR_INCLUDE`/`SMCR_EXCLUDE`, see
    /// `smcr::policy`); the preload applies it before the TCP handshake.
    pub const CODE_EXCLUDED: u32 = 0x7f00_0004;
    /// Local code: no descriptor left for SMC-R in the process's limit.
    pub const CODE_NO_FD: u32 = 0x7f00_0005;
    /// Local code: the connection was shared by several processes at its first use.
    pub const CODE_SHARED: u32 = 0x7f00_0006;
    /// Local code: no thread could be had for SMC-R.
    pub const CODE_NO_THREAD: u32 = 0x7f00_0007;
    /// Local code: handed to a program that cannot negotiate.
    pub const CODE_HANDED_OFF: u32 = 0x7f00_0008;
    /// Local code: the server answered the CLC Proposal with bytes that are not CLC
    /// (`smcr::not_clc`) — the process that reads the server's end had no record of the
    /// connection ([`FallbackReason::NotClc`]; a Rust API client's connect fails with it).
    pub const CODE_NOT_CLC: u32 = 0x7f00_0009;

    /// A numeric code: Linux's decline codes where they apply, ours (0x7f00_00xx) otherwise.
    pub fn code(&self) -> u32 {
        match self {
            Self::PeerNoSmc => DeclineReason::PEERNOSMC.0,
            Self::Declined { reason, .. } => reason.0,
            Self::NoBpf(_) => Self::CODE_NO_BPF,
            Self::OptionNotObserved => Self::CODE_OPTION_NOT_OBSERVED,
            Self::NotIpv4 => Self::CODE_NOT_IPV4,
            Self::NoDescriptors => Self::CODE_NO_FD,
            Self::Shared => Self::CODE_SHARED,
            Self::NoThread(_) => Self::CODE_NO_THREAD,
            Self::HandedOff => Self::CODE_HANDED_OFF,
            Self::NotClc => Self::CODE_NOT_CLC,
        }
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerNoSmc => write!(
                f,
                "peer did not offer SMC-R (PEERNOSMC {:#010x})",
                self.code()
            ),
            Self::Declined { reason, by_peer } => write!(
                f,
                "{} declined: {} ({:#010x})",
                if *by_peer { "peer" } else { "we" },
                reason.name().unwrap_or("unknown"),
                reason.0
            ),
            Self::NoBpf(why) => write!(f, "TCP option program unusable: {why}"),
            Self::OptionNotObserved => {
                write!(f, "TCP option program did not see the handshake")
            }
            Self::NotIpv4 => write!(f, "not IPv4"),
            Self::NoDescriptors => write!(
                f,
                "no descriptor left for SMC-R within RLIMIT_NOFILE (NOFD {:#010x})",
                self.code()
            ),
            Self::Shared => write!(
                f,
                "used by several processes (SHARED {:#010x})",
                self.code()
            ),
            Self::NoThread(why) => write!(
                f,
                "no thread for SMC-R: {why} (NOTHREAD {:#010x})",
                self.code()
            ),
            Self::HandedOff => write!(
                f,
                "handed to a program without smcr (HANDOFF {:#010x})",
                self.code()
            ),
            Self::NotClc => write!(
                f,
                "the server did not speak CLC: connected again over plain TCP (NOTCLC {:#010x})",
                self.code()
            ),
        }
    }
}
