//! 24-bit packet sequence numbers with serial-number arithmetic.
//!
//! PSNs wrap at 2^24. `a` is *after* `b` when `(a - b) mod 2^24` lies in `(0, 2^23)`
//! (wire-spec §6.5; rxe computes `(int32)((a - b) << 8)`), so comparisons are only meaningful
//! between PSNs less than 2^23 apart — which the requester's window guarantees.

use core::fmt;

/// A 24-bit packet sequence number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// Mask of the 24 significant bits.
    pub const MASK: u32 = 0x00FF_FFFF;

    /// A PSN from the low 24 bits of `v` (higher bits are discarded).
    pub const fn new(v: u32) -> Self {
        Self(v & Self::MASK)
    }

    /// The 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// This PSN advanced by `n` packets, wrapping at 2^24.
    #[must_use]
    pub const fn add(self, n: u32) -> Self {
        Self::new(self.0.wrapping_add(n))
    }

    /// This PSN moved back by `n` packets, wrapping at 2^24.
    #[must_use]
    pub const fn sub(self, n: u32) -> Self {
        Self::new(self.0.wrapping_sub(n))
    }

    /// Signed distance `self - other` in packets, in `[-2^23, 2^23)`.
    pub const fn diff(self, other: Self) -> i32 {
        // Shift the 24-bit difference into the top of an i32 and back to sign-extend it.
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// `self` comes strictly after `other`.
    pub const fn is_after(self, other: Self) -> bool {
        self.diff(other) > 0
    }

    /// `self` comes strictly before `other`.
    pub const fn is_before(self, other: Self) -> bool {
        self.diff(other) < 0
    }

    /// `self` lies in the half-open window `[start, start + len)`.
    pub const fn in_window(self, start: Self, len: u32) -> bool {
        (self.0.wrapping_sub(start.0) & Self::MASK) < len
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({:#08x})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_at_24_bits() {
        assert_eq!(Psn::new(0xFF_FFFF).add(1), Psn::new(0));
        assert_eq!(Psn::new(0).sub(1), Psn::new(0xFF_FFFF));
        assert_eq!(Psn::new(0x1FF_FFFF).value(), 0xFF_FFFF);
        assert!(Psn::new(0).is_after(Psn::new(0xFF_FFFF)));
        assert_eq!(Psn::new(2).diff(Psn::new(0xFF_FFFE)), 4);
        assert_eq!(Psn::new(0xFF_FFFE).diff(Psn::new(2)), -4);
    }

    #[test]
    fn half_range_is_the_boundary() {
        let a = Psn::new(0);
        assert!(a.add(0x7F_FFFF).is_after(a));
        assert!(!a.add(0x80_0000).is_after(a));
        assert_eq!(a.add(0x80_0000).diff(a), -0x80_0000);
    }

    proptest! {
        #[test]
        fn add_then_diff_is_identity(start in 0u32..=0xFF_FFFF, n in 0u32..0x80_0000) {
            let a = Psn::new(start);
            prop_assert_eq!(a.add(n).diff(a), n as i32);
            prop_assert_eq!(a.diff(a.add(n)), -(n as i32));
        }

        #[test]
        fn add_sub_inverse(start in 0u32..=0xFF_FFFF, n in any::<u32>()) {
            let a = Psn::new(start);
            prop_assert_eq!(a.add(n).sub(n), a);
        }

        #[test]
        fn ordering_is_antisymmetric_and_transitive(a in 0u32..=0xFF_FFFF, x in 1u32..0x40_0000, y in 1u32..0x40_0000) {
            let a = Psn::new(a);
            let b = a.add(x);
            let c = b.add(y);
            prop_assert!(b.is_after(a) && !a.is_after(b) && a.is_before(b));
            prop_assert!(c.is_after(a));
            prop_assert!(a.add(x).in_window(a, x + 1));
            prop_assert!(!a.add(x).in_window(a, x));
        }

        #[test]
        fn value_always_fits(v in any::<u32>(), n in any::<u32>()) {
            prop_assert!(Psn::new(v).add(n).value() <= Psn::MASK);
        }
    }
}
