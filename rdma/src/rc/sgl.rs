//! Resolved scatter/gather lists: the memory a work request reads or writes.

use super::{PostError, Sge};
use crate::mr::{Access, MrTable, Region};
use std::sync::Arc;

#[derive(Clone)]
struct Seg {
    mr: Arc<Region>,
    offset: usize,
    len: usize,
}

/// Segments held inline: SMC-R's requests have one or two (a slot and a long-message buffer;
/// data and a zero pad), so posting allocates nothing.
const INLINE: usize = 2;

/// A scatter/gather list whose regions were checked when the request was posted. It keeps the
/// regions alive until the request completes.
#[derive(Clone, Default)]
pub(crate) struct SgList {
    inline: [Option<Seg>; INLINE],
    /// Segments beyond [`INLINE`] (none for SMC-R; no allocation while empty).
    more: Vec<Seg>,
    len: usize,
}

impl SgList {
    /// Resolves `sges` against `mrs`, requiring `need` on each region.
    pub(crate) fn resolve(
        mrs: &MrTable,
        pd: u32,
        sges: &[Sge],
        max_sge: usize,
        need: Access,
    ) -> Result<Self, PostError> {
        if sges.len() > max_sge {
            return Err(PostError::TooManySge {
                given: sges.len(),
                max: max_sge,
            });
        }
        let mut list = Self::default();
        let mut n = 0;
        let mut len = 0usize;
        for (index, sge) in sges.iter().enumerate() {
            if sge.length == 0 {
                continue;
            }
            let (mr, offset) = mrs
                .check(sge.lkey, pd, sge.addr, u64::from(sge.length), need)
                .map_err(|error| PostError::BadSge { index, error })?;
            len += sge.length as usize;
            let seg = Seg {
                mr,
                offset,
                len: sge.length as usize,
            };
            match list.inline.get_mut(n) {
                Some(slot) => *slot = Some(seg),
                None => list.more.push(seg),
            }
            n += 1;
        }
        if len > i32::MAX as usize {
            return Err(PostError::MessageTooLong);
        }
        list.len = len;
        Ok(list)
    }

    fn segs(&self) -> impl Iterator<Item = &Seg> {
        self.inline.iter().flatten().chain(&self.more)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Visits the pieces of `[at, at + n)` as (region, offset in region, length).
    fn pieces(&self, mut at: usize, mut n: usize, mut f: impl FnMut(&Region, usize, usize, usize)) {
        let mut done = 0;
        for s in self.segs() {
            if n == 0 {
                break;
            }
            if at >= s.len {
                at -= s.len;
                continue;
            }
            let take = (s.len - at).min(n);
            f(&s.mr, s.offset + at, take, done);
            done += take;
            n -= take;
            at = 0;
        }
    }

    /// Describes `[at, at + n)` as pieces of registered memory, for zero-copy transmission.
    pub(crate) fn slices(&self, at: usize, n: usize, out: &mut super::PayloadRef) {
        out.n = 0;
        self.pieces(at, n, |mr, off, take, _| {
            // SAFETY: `off + take` lies inside the region (checked at post time).
            let ptr = unsafe { mr.as_ptr().add(off) };
            if out.n < out.pieces.len() {
                out.pieces[out.n] = (ptr.cast_const(), take);
                out.n += 1;
            }
        });
    }

    /// Visits `[at, at + n)` as raw pieces (pointer, length, bytes before it), for copies to
    /// and from shared memory. The pointers are valid while the list lives.
    pub(crate) fn raw_pieces(&self, at: usize, n: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        self.pieces(at, n, |mr, off, take, done| {
            // SAFETY: `off + take` lies inside the region (checked at post time).
            f(unsafe { mr.as_ptr().add(off) }, take, done)
        });
    }

    /// Copies `out.len()` bytes starting at message offset `at` into `out`.
    pub(crate) fn gather(&self, at: usize, out: &mut [u8]) {
        let n = out.len();
        self.pieces(at, n, |mr, off, take, done| {
            mr.read(off, &mut out[done..done + take])
        });
    }

    /// Copies `data` into the list at message offset `at`. Callers ensure it fits.
    pub(crate) fn scatter(&self, at: usize, data: &[u8]) {
        self.pieces(at, data.len(), |mr, off, take, done| {
            mr.write(off, &data[done..done + take])
        });
    }
}
