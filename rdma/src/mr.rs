//! Memory regions: registered memory, its keys, access rights and bounds.
//!
//! Every access the engine makes on behalf of a peer goes through [`MrTable::check`], which
//! checks the rkey (index *and* the random key byte), the protection domain, the access rights
//! and the address range before handing out the region. Nothing outside a region is ever
//! touched. Regions are reference counted, so deregistering one while a packet is being placed
//! into it cannot free memory under the engine.

use crate::locks::RwLock;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

// Defined in a leaf module so that the same-host arenas (`crate::arena`), in which this table
// places the regions of shared protection domains, use them without depending on this module.
pub use crate::access::{Access, AccessError};

/// Page-aligned, zeroed anonymous memory owned by a region.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory; concurrent access is coordinated by the RDMA protocol
// (as with DMA memory) and all copies go through raw pointers, never through references.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> std::io::Result<Self> {
        let map_len = len.max(1);
        // SAFETY: a fresh private anonymous mapping, not aliasing anything.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(std::io::ErrorKind::OutOfMemory)?;
        Ok(Self { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping and nobody can reach it any more.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len.max(1));
        }
    }
}

/// Where a region's bytes live.
enum Memory {
    /// Private anonymous memory.
    Private(Mapping),
    /// Another region's bytes (the same buffer registered again, e.g. on a second device for
    /// a second link): kept alive by this region.
    Alias(Arc<Region>),
    /// A slice of a protection domain's shared arena (same-host peers map it).
    Arena {
        arena: Arc<crate::arena::Arena>,
        key: u32,
        ptr: NonNull<u8>,
        off: usize,
        len: usize,
    },
}

// SAFETY: as for `Mapping`: plain memory reached through raw pointers only.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    fn ptr(&self) -> NonNull<u8> {
        match self {
            Self::Private(m) => m.ptr,
            Self::Alias(r) => r.mem.ptr(),
            Self::Arena { ptr, .. } => *ptr,
        }
    }
    fn len(&self) -> usize {
        match self {
            Self::Private(m) => m.len,
            Self::Alias(r) => r.mem.len(),
            Self::Arena { len, .. } => *len,
        }
    }
}

/// A registered region: memory, key, protection domain, address and rights. Shared by the
/// application's [`MemoryRegion`](crate::MemoryRegion) handle and the engine.
pub struct Region {
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) iova: u64,
    pub(crate) access: Access,
    mem: Memory,
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Self::Arena {
            arena,
            key,
            off,
            len,
            ..
        } = self
        {
            arena.release(*key, *off, *len);
        }
    }
}

impl core::fmt::Debug for Region {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Region")
            .field("key", &format_args!("{:#010x}", self.key))
            .field("pd", &self.pd)
            .field("addr", &format_args!("{:#x}", self.iova))
            .field("len", &self.mem.len())
            .field("access", &self.access)
            .finish()
    }
}

impl Region {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// The region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    /// The key (local and remote keys are the same number, as in rxe).
    pub fn key(&self) -> u32 {
        self.key
    }

    /// The address of the region's first byte in the addresses work requests use.
    pub fn addr(&self) -> u64 {
        self.iova
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Offset of `[addr, addr + len)` inside the region, if it lies entirely inside.
    pub fn offset_of(&self, addr: u64, len: u64) -> Result<usize, AccessError> {
        let off = addr.checked_sub(self.iova);
        match off {
            Some(off)
                if off
                    .checked_add(len)
                    .is_some_and(|end| end <= self.len() as u64) =>
            {
                Ok(off as usize)
            }
            _ => Err(AccessError::OutOfBounds { addr, len }),
        }
    }

    /// Copies `data` into the region at byte `offset`.
    ///
    /// Panics if the range is outside the region: callers check with [`Self::offset_of`] first.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len())
        );
        // SAFETY: in bounds (checked above); raw copies, no reference to the shared memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.mem.ptr().as_ptr().add(offset),
                data.len(),
            );
        }
    }

    /// Copies bytes from the region at `offset` into `out`. Panics if out of bounds.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|e| e <= self.len())
        );
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mem.ptr().as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
    }

    /// Pointer to the first byte. The memory may be written by the engine at any time while
    /// the region is registered; access it only through raw pointers or the copy methods.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr().as_ptr()
    }
}

/// All memory regions of a device, indexed by key.
///
/// A key is `index << 8 | tag`, where the tag is a per-registration pseudo-random byte (as in
/// Linux rxe), so a stale or guessed key is refused even when its index is reused.
pub struct MrTable {
    slots: RwLock<Vec<Option<Arc<Region>>>>,
    tag_seed: AtomicU32,
}

impl MrTable {
    /// An empty table; `seed` varies the key tags.
    pub fn new(seed: u32) -> Self {
        Self {
            slots: RwLock::new(vec![None]),
            tag_seed: AtomicU32::new(seed | 1),
        }
    }

    fn next_tag(&self) -> u8 {
        // xorshift32 stepped atomically; tags only need to differ between registrations.
        let mut x = self.tag_seed.load(Ordering::Relaxed);
        loop {
            let mut y = x;
            y ^= y << 13;
            y ^= y >> 17;
            y ^= y << 5;
            match self
                .tag_seed
                .compare_exchange_weak(x, y, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return (y >> 8) as u8,
                Err(cur) => x = cur,
            }
        }
    }

    /// Allocates and registers `len` bytes of zeroed memory in protection domain `pd`.
    pub fn register(&self, pd: u32, len: usize, access: Access) -> std::io::Result<Arc<Region>> {
        self.register_in(pd, len, access, None)
    }

    /// As [`Self::register`], with the memory taken from `arena` when given (a shared
    /// protection domain's memory, which same-host peers map).
    pub(crate) fn register_in(
        &self,
        pd: u32,
        len: usize,
        access: Access,
        arena: Option<&Arc<crate::arena::Arena>>,
    ) -> std::io::Result<Arc<Region>> {
        // Only what peers may reach goes where a same-host peer maps: a region without a
        // remote right (send buffers, message slots) stays private, as it is to a peer over
        // the wire.
        let remote = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let arena = arena.filter(|_| access.intersects(remote));
        self.insert_with(|key, iova| {
            let mem = match arena {
                None => Memory::Private(Mapping::new(len)?),
                Some(a) => {
                    let (off, ptr) = a.alloc(len)?;
                    let mem = Memory::Arena {
                        arena: a.clone(),
                        key,
                        ptr,
                        off,
                        len,
                    };
                    // On failure `mem` is dropped, which gives the range back.
                    a.publish(key, access, off, len, iova)?;
                    mem
                }
            };
            Ok(Region {
                key,
                pd,
                iova,
                access,
                mem,
            })
        })
    }

    /// Takes a free slot and fills it with the region `make` builds for the slot's key and
    /// IOVA (the address peers see: a per-region base that reveals nothing about ours).
    fn insert_with(
        &self,
        make: impl FnOnce(u32, u64) -> std::io::Result<Region>,
    ) -> std::io::Result<Arc<Region>> {
        let tag = self.next_tag();
        let mut slots = self.slots.write();
        let index = match slots.iter().skip(1).position(Option::is_none) {
            Some(i) => i + 1,
            None => {
                if slots.len() >= 1 << 24 {
                    return Err(std::io::ErrorKind::OutOfMemory.into());
                }
                slots.push(None);
                slots.len() - 1
            }
        };
        let key = ((index as u32) << 8) | u32::from(tag);
        let mr = Arc::new(make(key, (u64::from(key) << 32) | 0x1000_0000)?);
        slots[index] = Some(mr.clone());
        Ok(mr)
    }

    /// Registers the bytes of `of` (a region of any device) again, in protection domain `pd`
    /// of this table, with its own key and address (`ibv_reg_mr` of an already registered
    /// buffer): what arrives through either key lands in the same memory. Only private memory:
    /// a shared arena's regions are reachable by same-host peers of that domain alone.
    pub fn register_alias(
        &self,
        pd: u32,
        of: &Arc<Region>,
        access: Access,
    ) -> std::io::Result<Arc<Region>> {
        if matches!(of.mem, Memory::Arena { .. }) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "a shared-memory region cannot be registered again in another domain",
            ));
        }
        // An alias of an alias is an alias of the owner.
        let owner = match &of.mem {
            Memory::Alias(o) => o.clone(),
            _ => of.clone(),
        };
        self.insert_with(|key, iova| {
            Ok(Region {
                key,
                pd,
                iova,
                access,
                mem: Memory::Alias(owner),
            })
        })
    }

    /// Removes a region; in-flight users keep it alive until they finish.
    pub fn deregister(&self, key: u32) -> bool {
        let mut slots = self.slots.write();
        match slots.get_mut((key >> 8) as usize) {
            Some(slot) if slot.as_ref().is_some_and(|m| m.key == key) => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    /// The region with this key.
    pub fn get(&self, key: u32) -> Option<Arc<Region>> {
        let slots = self.slots.read();
        slots
            .get((key >> 8) as usize)?
            .as_ref()
            .filter(|m| m.key == key)
            .cloned()
    }

    /// Looks up a region for an access of `len` bytes at `addr` needing `need`, in `pd`.
    /// Returns the region and the byte offset of `addr` inside it.
    pub fn check(
        &self,
        key: u32,
        pd: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Region>, usize), AccessError> {
        let mr = self.get(key).ok_or(AccessError::BadKey(key))?;
        if mr.pd != pd {
            return Err(AccessError::WrongPd);
        }
        if !mr.access.contains(need) {
            return Err(AccessError::NotPermitted { need });
        }
        let off = mr.offset_of(addr, len)?;
        Ok((mr, off))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_bounds_rights_and_pd_are_checked() {
        let t = MrTable::new(7);
        let mr = t
            .register(1, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let base = mr.iova;
        assert!(t.check(mr.key, 1, base, 4096, Access::REMOTE_WRITE).is_ok());
        assert_eq!(
            t.check(mr.key, 1, base + 4000, 97, Access::REMOTE_WRITE)
                .unwrap_err(),
            AccessError::OutOfBounds {
                addr: base + 4000,
                len: 97
            }
        );
        assert!(matches!(
            t.check(mr.key, 1, base - 1, 1, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.check(mr.key, 1, u64::MAX, 2, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            t.check(mr.key, 2, base, 1, Access::REMOTE_WRITE)
                .unwrap_err(),
            AccessError::WrongPd
        );
        assert_eq!(
            t.check(mr.key, 1, base, 1, Access::REMOTE_READ)
                .unwrap_err(),
            AccessError::NotPermitted {
                need: Access::REMOTE_READ
            }
        );
        assert_eq!(
            t.check(mr.key ^ 1, 1, base, 1, Access::REMOTE_WRITE)
                .unwrap_err(),
            AccessError::BadKey(mr.key ^ 1)
        );
        assert!(t.deregister(mr.key));
        assert!(t.get(mr.key).is_none());
        let again = t.register(1, 16, Access::REMOTE_WRITE).unwrap();
        assert_eq!(again.key >> 8, mr.key >> 8, "index reused");
        assert_ne!(
            again.key, mr.key,
            "tag differs, so the old key stays invalid"
        );
        mr.write(4090, &[1, 2, 3, 4, 5, 6]);
        let mut out = [0u8; 6];
        mr.read(4090, &mut out);
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
    }
}
