//! Decline / fallback reason codes (`SMC_CLC_DECL_*` in Linux's net/smc/smc_clc.h).

use core::fmt;

/// A CLC decline reason ("peer diagnosis"), as carried in a Decline and recorded on fallback.
/// Known codes have a Linux name and a meaning; unknown codes are kept as they are (peers may
/// send newer ones, and the field is informational).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeclineReason(pub u32);

macro_rules! reasons {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $text:literal; )*) => {
        impl DeclineReason {
            $( $(#[$doc])* pub const $name: Self = Self($code); )*

            /// Every code Linux defines, in numeric order.
            pub const ALL: &'static [Self] = &[$( Self::$name ),*];

            /// Linux's name without the `SMC_CLC_DECL_` prefix, e.g. `"NOSMCRDEV"`.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( $code => Some(stringify!($name)), )*
                    _ => None,
                }
            }

            /// A one-line meaning, for people.
            pub fn meaning(self) -> Option<&'static str> {
                match self.0 {
                    $( $code => Some($text), )*
                    _ => None,
                }
            }
        }
    };
}

reasons! {
    /// Insufficient memory resources.
    MEM = 0x0101_0000, "insufficient memory resources";
    /// Timed out waiting for CONFIRM LINK.
    TIMEOUT_CL = 0x0201_0000, "timeout waiting for the LLC CONFIRM LINK";
    /// Timed out waiting for ADD LINK (historic).
    TIMEOUT_AL = 0x0202_0000, "timeout waiting for the LLC ADD LINK";
    /// Configuration error.
    CNFERR = 0x0300_0000, "configuration error (e.g. no IP prefix for the interface)";
    /// The peer did not offer SMC (local only, never sent).
    PEERNOSMC = 0x0301_0000, "peer did not indicate SMC (no TCP option 254)";
    /// IPsec is used on the connection.
    IPSEC = 0x0302_0000, "IPsec in use on the connection";
    /// No SMC device.
    NOSMCDEV = 0x0303_0000, "no SMC device found (R or D)";
    /// No SMC-D device.
    NOSMCDDEV = 0x0303_0001, "no SMC-D device found";
    /// No SMC-R device.
    NOSMCRDEV = 0x0303_0002, "no SMC-R device found";
    /// No ISMv2 support.
    NOISM2SUPP = 0x0303_0003, "hardware has no ISMv2 support";
    /// No CLC v2 extension.
    NOV2EXT = 0x0303_0004, "peer sent no CLC v2 extension";
    /// No SMC-Dv2 extension.
    NOV2DEXT = 0x0303_0005, "peer sent no SMC-Dv2 extension";
    /// No system EID.
    NOSEID = 0x0303_0006, "peer sent no SEID";
    /// No SMC-Dv2 device.
    NOSMCD2DEV = 0x0303_0007, "no SMC-Dv2 device found";
    /// No (matching) user EID.
    NOUEID = 0x0303_0008, "peer sent no UEID or none that matches ours";
    /// Release negotiation failed.
    RELEASEERR = 0x0303_0009, "SMC release negotiation failed";
    /// max_conns negotiation failed.
    MAXCONNERR = 0x0303_000a, "max-connections negotiation failed";
    /// max_links negotiation failed.
    MAXLINKERR = 0x0303_000b, "max-links negotiation failed";
    /// Modes do not match.
    MODEUNSUPP = 0x0304_0000, "SMC modes do not match (R or D, v1 or v2)";
    /// Peer uses RMBE eye catchers.
    RMBE_EC = 0x0305_0000, "peer uses RMBE eye catchers";
    /// Unsupported socket option (TCP fast open).
    OPTUNSUPP = 0x0306_0000, "socket option not supported (TCP fast open)";
    /// IP prefix mismatch.
    DIFFPREFIX = 0x0307_0000, "IP prefix / subnet mismatch";
    /// VLAN lookup failed.
    GETVLANERR = 0x0308_0000, "cannot get the VLAN ID of the IP device";
    /// VLAN registration on ISM failed.
    ISMVLANERR = 0x0309_0000, "cannot register the VLAN ID on the ISM device";
    /// No active link in the link group.
    NOACTLINK = 0x030a_0000, "no active SMC-R link in the link group";
    /// Link named by the server not found.
    NOSRVLINK = 0x030b_0000, "SMC-R link from the server not found";
    /// Version mismatch.
    VERSMISMAT = 0x030c_0000, "SMC version mismatch";
    /// SMC-D DMB limit.
    MAX_DMB = 0x030d_0000, "SMC-D DMB limit exceeded";
    /// No route to the peer's RoCE v2 GID.
    NOROUTE = 0x030e_0000, "SMC-Rv2: no route to the peer";
    /// Direct/indirect mismatch.
    NOINDIRECT = 0x030f_0000, "SMC-Rv2: direct/indirect route mismatch";
    /// Link groups out of sync (sent with the out-of-sync flag).
    SYNCERR = 0x0400_0000, "synchronisation error (link groups out of sync)";
    /// The peer declined (local bookkeeping only, never sent).
    PEERDECL = 0x0500_0000, "peer declined during the handshake";
    /// Internal error.
    INTERR = 0x0999_0000, "internal error";
    /// rtoken handling failed.
    ERR_RTOK = 0x0999_0001, "rtoken handling failed";
    /// Bringing the link up failed.
    ERR_RDYLNK = 0x0999_0002, "bringing the link (QP) to ready failed";
    /// Registering RDMA buffers failed.
    ERR_REGBUF = 0x0999_0003, "registering RDMA buffers failed";
}

impl DeclineReason {
    /// Codes that Linux records locally but never puts on the wire.
    pub fn is_local_only(self) -> bool {
        matches!(self, Self::PEERNOSMC | Self::PEERDECL)
    }

    /// The class of a code: its top byte (1 resources, 2 timeouts, 3 configuration/negotiation,
    /// 4 synchronisation, 5 peer declined, 9 internal).
    pub fn class(self) -> u8 {
        (self.0 >> 24) as u8
    }
}

impl fmt::Display for DeclineReason {
    /// `0x03030002 NOSMCRDEV (no SMC-R device found)`; unknown codes print as `0x... (unknown)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.name(), self.meaning()) {
            (Some(n), Some(m)) => write!(f, "{:#010x} {n} ({m})", self.0),
            _ => write!(f, "{:#010x} (unknown reason code)", self.0),
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn test_codes_are_linux_values() {
        assert_eq!(
            DeclineReason::ALL.len(),
            36,
            "every SMC_CLC_DECL_* of mainline smc_clc.h"
        );
        assert!(
            DeclineReason::ALL.windows(2).all(|w| w[0] < w[1]),
            "sorted and unique"
        );
        assert_eq!(DeclineReason::NOSMCRDEV.0, 0x0303_0002);
        assert_eq!(DeclineReason::SYNCERR.0, 0x0400_0000);
        assert_eq!(DeclineReason::ERR_REGBUF.0, 0x0999_0003);
        for r in DeclineReason::ALL {
            assert!(r.name().is_some() && r.meaning().is_some());
        }
    }

    #[test]
    fn test_display_and_unknown() {
        assert_eq!(
            DeclineReason::NOSMCRDEV.to_string(),
            "0x03030002 NOSMCRDEV (no SMC-R device found)"
        );
        let u = DeclineReason(0x0303_000c);
        assert_eq!(u.name(), None);
        assert_eq!(u.to_string(), "0x0303000c (unknown reason code)");
        assert_eq!(u.class(), 3);
        assert!(DeclineReason::PEERNOSMC.is_local_only());
        assert!(!DeclineReason::NOUEID.is_local_only());
    }
}
