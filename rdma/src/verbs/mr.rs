//! [`MemoryRegion`]: registered memory on our engine or a verbs device.

#[allow(unused_imports)]
use super::*;

/// Registered memory. Peers reach it through [`Self::rkey`] and [`Self::addr`]; local work
/// requests through [`Self::lkey`]. Deregistered when dropped.
pub struct MemoryRegion(pub(super) MrKind);

pub(super) enum MrKind {
    Engine(EngineMr),
    /// Shared with its aliases.
    Verbs(Arc<ibv::Mr>),
    Mem(MemMr),
}

/// A region of an in-memory device; deregistered when dropped.
pub(super) struct MemMr {
    pub(super) region: Arc<Region>,
    pub(super) dev: Arc<MemDev>,
}

impl Drop for MemMr {
    fn drop(&mut self) {
        self.dev.mrs.deregister(self.region.key());
    }
}

/// An engine region; deregistered when dropped.
pub(super) struct EngineMr {
    pub(super) region: Arc<Region>,
    pub(super) guard: Arc<EngineGuard>,
}

impl Drop for EngineMr {
    fn drop(&mut self) {
        self.guard.shared.mrs.deregister(self.region.key());
    }
}

impl MemoryRegion {
    /// The address of the first byte, in the address space work requests and peers use.
    pub fn addr(&self) -> u64 {
        match &self.0 {
            MrKind::Engine(m) => m.region.addr(),
            MrKind::Mem(m) => m.region.addr(),
            MrKind::Verbs(m) => m.addr(),
        }
    }
    /// The local key.
    pub fn lkey(&self) -> u32 {
        match &self.0 {
            MrKind::Engine(m) => m.region.key(),
            MrKind::Mem(m) => m.region.key(),
            MrKind::Verbs(m) => m.lkey(),
        }
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        match &self.0 {
            MrKind::Engine(m) => m.region.key(),
            MrKind::Mem(m) => m.region.key(),
            MrKind::Verbs(m) => m.rkey(),
        }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            MrKind::Engine(m) => m.region.len(),
            MrKind::Mem(m) => m.region.len(),
            MrKind::Verbs(m) => m.len(),
        }
    }
    /// The region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A scatter/gather element for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + offset as u64,
            length: len as u32,
            lkey: self.lkey(),
        }
    }
    /// Copies `data` into the region at `offset`. Panics if it does not fit.
    pub fn write(&self, offset: usize, data: &[u8]) {
        match &self.0 {
            MrKind::Engine(m) => m.region.write(offset, data),
            MrKind::Mem(m) => m.region.write(offset, data),
            MrKind::Verbs(m) => m.write(offset, data),
        }
    }
    /// Copies from the region at `offset` into `out`. Panics if out of range.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        match &self.0 {
            MrKind::Engine(m) => m.region.read(offset, out),
            MrKind::Mem(m) => m.region.read(offset, out),
            MrKind::Verbs(m) => m.read(offset, out),
        }
    }
    /// Pointer to the first byte (see [`Region::as_ptr`] for the rules).
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.0 {
            MrKind::Engine(m) => m.region.as_ptr(),
            MrKind::Mem(m) => m.region.as_ptr(),
            MrKind::Verbs(m) => m.as_ptr(),
        }
    }
}
