//! The device's counters: [`DeviceStats`] and the atomic words the engine bumps, kept in the
//! device's own memory or in words its user provides ([`CounterWords`]), and what each QP's
//! transport counted added to them.

use super::{QpCore, Shared};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Defines [`DeviceStats`] and its atomic twin from one list, so that their order (which is
/// the layout of [`CounterWords`]) cannot drift apart.
macro_rules! device_counters {
    ($( $(#[$doc:meta])* $name:ident, )*) => {
        /// Counters of a device (all monotonic).
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct DeviceStats {
            $( $(#[$doc])* pub $name: u64, )*
        }

        impl DeviceStats {
            /// The counters' names, in the order of [`Self::to_words`].
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name)),*];
            /// How many counters there are.
            pub const COUNT: usize = Self::NAMES.len();

            /// The counters in [`Self::NAMES`] order.
            pub fn to_words(&self) -> [u64; Self::COUNT] {
                [$(self.$name),*]
            }

            /// Counters from words in [`Self::NAMES`] order (missing ones are 0).
            pub fn from_words(w: &[u64]) -> Self {
                let mut it = w.iter().copied();
                Self { $( $name: it.next().unwrap_or(0), )* }
            }
        }

        /// The atomic counters a device bumps: laid out as [`DeviceStats::COUNT`] words.
        #[derive(Default)]
        #[repr(C)]
        pub(super) struct AtomicStats {
            $( pub(super) $name: AtomicU64, )*
        }

        impl AtomicStats {
            pub(super) fn load(&self) -> DeviceStats {
                DeviceStats { $( $name: self.$name.load(Ordering::Relaxed), )* }
            }
        }
    };
}

device_counters! {
    /// RoCE packets sent.
    tx_packets,
    /// `sendmsg` calls made.
    tx_syscalls,
    /// Sends the kernel refused.
    tx_errors,
    /// RoCE packets received.
    rx_packets,
    /// Receive system calls that returned data.
    rx_syscalls,
    /// Packets dropped because they did not parse.
    rx_malformed,
    /// Packets dropped because their ICRC was wrong.
    rx_icrc_errors,
    /// Packets for a QP number that does not exist.
    rx_unknown_qp,
    /// Packets from an address other than the QP's peer.
    rx_wrong_source,
    /// Packets whose IPv4 identification (solved from the ICRC) is not one our senders use:
    /// from a Linux rxe peer.
    rx_foreign_ip_id,
    /// Times an application thread woke the engine.
    engine_kicks,
    /// Same-host offers accepted (a peer's QP on this host sends to ours through shared
    /// memory).
    shm_offers,
    /// QPs failed because their shared memory was corrupt or refused an access.
    shm_faults,
    /// Request packets sent again (go-back-N after a NAK, a probe or a timeout).
    tx_retransmits,
    /// Early retransmissions: no ACK within the measured round trip (no retry spent).
    rc_probes,
    /// Early retransmissions found needless: the peer's ACK was late, not lost (the window
    /// cut undone, the next wait longer).
    rc_spurious_probes,
    /// Local ACK timeouts (a retry spent).
    rc_timeouts,
    /// Sequence-error NAKs received.
    rx_naks,
    /// RNR NAKs received (the peer had no receive posted).
    rx_rnr_naks,
    /// Sequence-error NAKs sent.
    tx_naks,
    /// RNR NAKs sent.
    tx_rnr_naks,
    /// Duplicate requests received (the peer resent what we had).
    rx_duplicates,
    /// Requests refused with a remote access error (bad rkey, range or rights).
    rx_access_errors,
    /// Times the engine thread woke (its socket, a kick, a timer): while threads wait on the
    /// socket they run the timers, and the engine looks only 5 ms after each deadline.
    engine_wakes,
    /// Request packets that came ahead of a gap (overtaken, or after a lost one) and were
    /// kept, then placed when the gap filled.
    rx_reordered,
    /// Datagrams sent that bundled small packets of one QP (to a peer that is our engine,
    /// see [`crate::wire::parse_bundle`]).
    tx_bundles,
    /// Bundles received.
    rx_bundles,
    /// Packets sent without an ICRC (to a peer that is our engine, see
    /// [`crate::wire::NO_ICRC`]).
    tx_no_icrc,
    /// The longest any QP waited for an acknowledgement while it had packets outstanding,
    /// in µs (the most, not a sum): a round trip or so when packets are overtaken or lost
    /// and asked for again; a timer's wait (the local ACK timeout) shows here.
    rc_longest_stall_us,
}

/// Words a device keeps its counters in, when its user provides them: smcr puts them in its
/// shared-memory stats area, so that `smc-stat` reads the engine's counters live from outside
/// the process. [`DeviceStats::NAMES`] gives the order.
pub trait CounterWords: Send + Sync {
    /// At least [`DeviceStats::COUNT`] words (a shorter slice is not used).
    fn words(&self) -> &[AtomicU64];
}

/// [`DeviceConfig::counters`](super::DeviceConfig::counters): someone else's [`CounterWords`].
#[derive(Clone)]
pub struct SharedCounters(pub Arc<dyn CounterWords>);

impl std::fmt::Debug for SharedCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedCounters")
    }
}

/// Where a device's counters are.
pub(super) enum Counters {
    Own(Box<AtomicStats>),
    Shared(Arc<dyn CounterWords>),
}

impl Counters {
    pub(super) fn new(shared: Option<&SharedCounters>) -> Self {
        match shared {
            Some(s) if s.0.words().len() >= DeviceStats::COUNT => Self::Shared(s.0.clone()),
            _ => Self::Own(Box::default()),
        }
    }
}

impl std::ops::Deref for Counters {
    type Target = AtomicStats;

    fn deref(&self) -> &AtomicStats {
        match self {
            Self::Own(b) => b,
            Self::Shared(s) => {
                let w = s.words();
                debug_assert!(w.len() >= DeviceStats::COUNT);
                // SAFETY: `AtomicStats` is `repr(C)` with `DeviceStats::COUNT` `AtomicU64`
                // fields, the layout of that many consecutive `AtomicU64`s, which `w` holds
                // (checked in `new`); it lives as long as `s`, which we hold.
                unsafe { &*w.as_ptr().cast::<AtomicStats>() }
            }
        }
    }
}

/// How many transport counters [`Shared::count_rc`] follows per QP.
pub(super) const RC_COUNTERS: usize = 11;

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Shared {
    /// Adds what the QP's transport counted since the last call to the device's counters.
    pub(super) fn count_rc(&self, core: &mut QpCore) {
        let (q, r) = (core.rc.requester_stats(), core.rc.responder_stats());
        let now = [
            q.retransmits,
            q.probes,
            q.spurious_probes,
            q.timeouts,
            q.naks,
            q.rnr_naks,
            r.nak_seq,
            r.rnr_nak,
            r.duplicates,
            r.access_errors,
            r.reordered,
        ];
        let st = &self.stats;
        let to = [
            &st.tx_retransmits,
            &st.rc_probes,
            &st.rc_spurious_probes,
            &st.rc_timeouts,
            &st.rx_naks,
            &st.rx_rnr_naks,
            &st.tx_naks,
            &st.tx_rnr_naks,
            &st.rx_duplicates,
            &st.rx_access_errors,
            &st.rx_reordered,
        ];
        st.rc_longest_stall_us
            .fetch_max(q.longest_stall_us, Ordering::Relaxed);
        for ((&n, old), c) in now.iter().zip(&mut core.counted).zip(to) {
            // A requester made anew (the QP reset and reused) counts from 0 again.
            let d = n.checked_sub(*old).unwrap_or(n);
            if d > 0 {
                bump(c, d);
            }
            *old = n;
        }
    }
}
