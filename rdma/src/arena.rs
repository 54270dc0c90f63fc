//! The memory of a *shared* protection domain ([`Arena`]): a sealed memfd holding the domain's
//! regions and a table of them (rkey, access, offset, length, address), so that a same-host peer
//! that maps it ([`PeerArena`]) checks an rkey before it copies, as a responder would. Used by
//! the region table (`mr`) to place regions and by the same-host transport (`samehost`) to
//! reach a peer's; below both.

use crate::access::{Access, AccessError};
use crate::locks::Mutex;
use crate::shm::Segment;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

/// Virtual size of an arena (pages are used only when touched).
pub(crate) const ARENA_BYTES: usize = 4 << 30;
const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"SMCRARN1");
const TABLE_AT: usize = 64;
const TABLE_SLOTS: usize = 16384;
const DESC: usize = 32;
const PROBES: usize = 64;
/// Region data starts here (after the table).
const DATA_AT: usize = 1 << 20;
const PAGE: usize = 4096;
const D_VALID: u64 = 1 << 63;
const D_TOMB: u64 = 1 << 62;

/// A shared protection domain's memory: a sealed memfd holding its regions and their table.
pub(crate) struct Arena {
    seg: Segment,
    alloc: Mutex<Alloc>,
}

struct Alloc {
    next: usize,
    free: Vec<(usize, usize)>,
}

impl Arena {
    pub(crate) fn create() -> io::Result<Arc<Self>> {
        let seg = Segment::create("smcr-arena", ARENA_BYTES)?;
        seg.u64_at(0).store(ARENA_MAGIC, Ordering::Release);
        Ok(Arc::new(Self {
            seg,
            alloc: Mutex::new(Alloc {
                next: DATA_AT,
                free: Vec::new(),
            }),
        }))
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }

    /// Zeroed, page-aligned room for `len` bytes: (offset, pointer).
    pub(crate) fn alloc(&self, len: usize) -> io::Result<(usize, NonNull<u8>)> {
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .filter(|s| *s <= ARENA_BYTES)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    "region larger than a shared memory arena",
                )
            })?;
        let mut a = self.alloc.lock();
        let off = if let Some(i) = a.free.iter().position(|&(_, l)| l >= size) {
            let (off, l) = a.free[i];
            if l == size {
                a.free.swap_remove(i);
            } else {
                a.free[i] = (off + size, l - size);
            }
            off
        } else {
            let off = a.next;
            if off.checked_add(size).is_none_or(|e| e > self.seg.len()) {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    "shared memory arena of the protection domain is full",
                ));
            }
            a.next = off + size;
            off
        };
        // SAFETY: `off + size` is inside the mapping.
        let ptr = unsafe { self.seg.base_ptr().add(off) };
        Ok((off, NonNull::new(ptr).expect("mapping is not null")))
    }

    /// Unpublishes `key` and gives `[off, off + len)` back (zeroed).
    pub(crate) fn release(&self, key: u32, off: usize, len: usize) {
        // `alloc` checked that this cannot overflow.
        let size = len.max(1).next_multiple_of(PAGE);
        let mut a = self.alloc.lock();
        if let Some(d) = self.find(&a, key) {
            self.seg.u64_at(d).store(D_TOMB, Ordering::Release);
        }
        self.seg.punch(off, size);
        a.free.push((off, size));
    }

    fn find(&self, _held: &Alloc, key: u32) -> Option<usize> {
        let h = (key >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Relaxed);
            if w == 0 {
                return None;
            }
            if w & D_VALID != 0 && w as u32 == key {
                return Some(d);
            }
        }
        None
    }

    /// Makes region `key` visible to peers.
    pub(crate) fn publish(
        &self,
        key: u32,
        access: Access,
        off: usize,
        len: usize,
        iova: u64,
    ) -> io::Result<()> {
        let _a = self.alloc.lock();
        let h = (key >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Relaxed);
            if w == 0 || w == D_TOMB {
                self.seg.u64_at(d + 8).store(off as u64, Ordering::Relaxed);
                self.seg.u64_at(d + 16).store(len as u64, Ordering::Relaxed);
                self.seg.u64_at(d + 24).store(iova, Ordering::Relaxed);
                let word = D_VALID | u64::from(access.bits() & 0xff) << 32 | u64::from(key);
                self.seg.u64_at(d).store(word, Ordering::Release);
                return Ok(());
            }
        }
        Err(io::Error::new(
            io::ErrorKind::OutOfMemory,
            "shared memory arena: region table full",
        ))
    }
}

/// A peer's arena, mapped here. Its table and sizes are untrusted.
pub(crate) struct PeerArena {
    /// The mapping (the same-host transport copies in and out of it at offsets `lookup` gave).
    pub(crate) seg: Segment,
}

impl PeerArena {
    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        let seg = Segment::open(fd)?;
        if seg.len() < DATA_AT || seg.u64_at(0).load(Ordering::Acquire) != ARENA_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a memory arena",
            ));
        }
        Ok(Self { seg })
    }

    /// The arena offset of `[va, va + len)` in the peer's region `rkey`, checked against the
    /// peer's table (key, rights, bounds) as the peer's responder would.
    pub(crate) fn lookup(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<usize, AccessError> {
        let h = (rkey >> 8) as usize;
        for i in 0..PROBES {
            let d = TABLE_AT + ((h + i) % TABLE_SLOTS) * DESC;
            let w = self.seg.u64_at(d).load(Ordering::Acquire);
            if w == 0 {
                break;
            }
            if w & D_VALID == 0 || w as u32 != rkey {
                continue;
            }
            let off = self.seg.u64_at(d + 8).load(Ordering::Relaxed);
            let rlen = self.seg.u64_at(d + 16).load(Ordering::Relaxed);
            let iova = self.seg.u64_at(d + 24).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.seg.u64_at(d).load(Ordering::Relaxed) != w {
                break; // changed while read: the region is going away
            }
            let access = Access::from_bits_truncate((w >> 32) as u32 & 0xff);
            if !access.contains(need) {
                return Err(AccessError::NotPermitted { need });
            }
            let inside = va
                .checked_sub(iova)
                .filter(|o| o.checked_add(len).is_some_and(|e| e <= rlen));
            let Some(rel) = inside else {
                return Err(AccessError::OutOfBounds { addr: va, len });
            };
            // The table itself may lie: the range must be inside the mapping.
            let start = off.checked_add(rel).filter(|s| *s >= DATA_AT as u64);
            return match start {
                Some(s)
                    if s.checked_add(len)
                        .is_some_and(|e| e <= self.seg.len() as u64) =>
                {
                    Ok(s as usize)
                }
                _ => Err(AccessError::BadKey(rkey)),
            };
        }
        Err(AccessError::BadKey(rkey))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::MrTable;

    fn peer_of(a: &Arena) -> PeerArena {
        PeerArena::open(a.fd().try_clone_to_owned().unwrap()).unwrap()
    }

    #[test]
    fn the_peer_table_checks_keys_rights_and_bounds() {
        let a = Arena::create().unwrap();
        let mrs = MrTable::new(3);
        let rw = mrs
            .register_in(
                1,
                10000,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                Some(&a),
            )
            .unwrap();
        let ro = mrs
            .register_in(1, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ, Some(&a))
            .unwrap();
        let p = peer_of(&a);
        let off = p
            .lookup(rw.key(), rw.addr() + 100, 9900, Access::REMOTE_WRITE)
            .unwrap();
        // The offset found is where the region's memory is: a byte written there shows up.
        unsafe { p.seg.copy_in_raw(off, [7u8].as_ptr(), 1) };
        let mut b = [0u8; 1];
        rw.read(100, &mut b);
        assert_eq!(b, [7]);
        assert_eq!(
            p.lookup(rw.key(), rw.addr() + 100, 9901, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds {
                addr: rw.addr() + 100,
                len: 9901
            })
        );
        assert!(matches!(
            p.lookup(rw.key(), rw.addr() - 1, 1, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            p.lookup(rw.key() ^ 1, rw.addr(), 1, Access::REMOTE_WRITE),
            Err(AccessError::BadKey(rw.key() ^ 1))
        );
        assert_eq!(
            p.lookup(ro.key(), ro.addr(), 1, Access::REMOTE_WRITE),
            Err(AccessError::NotPermitted {
                need: Access::REMOTE_WRITE
            })
        );
        assert!(
            p.lookup(ro.key(), ro.addr(), 4096, Access::REMOTE_READ)
                .is_ok()
        );
        // Deregistered: gone from the table, and its pages come back zeroed for the next one.
        let key = rw.key();
        assert!(mrs.deregister(key));
        drop(rw);
        assert_eq!(
            p.lookup(
                key,
                0x1000_0000 | u64::from(key) << 32,
                1,
                Access::REMOTE_WRITE
            ),
            Err(AccessError::BadKey(key))
        );
        let again = mrs
            .register_in(1, 8192, Access::REMOTE_WRITE, Some(&a))
            .unwrap();
        let mut z = [1u8; 200];
        again.read(0, &mut z);
        assert!(z.iter().all(|&x| x == 0), "reused memory is zeroed");
    }

    #[test]
    fn a_garbage_table_gives_errors_never_a_wild_access() {
        let a = Arena::create().unwrap();
        let p = peer_of(&a);
        // The peer scribbles over its own table: every lookup must stay inside the mapping.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for d in 0..PROBES * 4 {
            for w in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = if w == 0 { x | D_VALID } else { x };
                a.seg
                    .u64_at(TABLE_AT + d * DESC + w * 8)
                    .store(v, Ordering::Relaxed);
            }
        }
        for i in 0..PROBES * 4 {
            let w = a.seg.u64_at(TABLE_AT + i * DESC).load(Ordering::Relaxed);
            let key = w as u32;
            let iova = a
                .seg
                .u64_at(TABLE_AT + i * DESC + 24)
                .load(Ordering::Relaxed);
            for need in [Access::REMOTE_WRITE, Access::REMOTE_READ] {
                if let Ok(off) = p.lookup(key, iova, 64, need) {
                    assert!(off >= DATA_AT && off + 64 <= ARENA_BYTES, "{off:#x}");
                }
            }
        }
    }
}
