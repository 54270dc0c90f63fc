//! RDMA devices behind rdma-core's libibverbs: RNICs and the kernel's soft-RoCE (`rdma_rxe`)
//! and soft-iWARP. The library is loaded at run time ([`sys::Lib::load`]); on a machine
//! without it or without devices nothing here is touched beyond one `readdir` of
//! [`sysfs::SYSFS_ROOT`].
//!
//! The objects mirror the engine's ([`crate::Device`] and friends) and take the same work
//! requests and give the same completions ([`SendWr`], [`RecvWr`], [`WorkCompletion`]), so
//! the protocol above does not depend on which kind of device carries a link.

mod dev;
pub mod sys;
pub mod sysfs;

mod qp;
pub use dev::VerbsInfo;
pub(crate) use dev::{Tracks, VerbsCq, VerbsDevice};
#[allow(unused_imports)]
use qp::*;
pub use qp::{Qp, RTS_RETRY_CNT, RTS_TIMEOUT, RtrAttr, RtsAttr};

use crate::Mtu;
use crate::rc::{
    PostError, QpCaps, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus, WorkCompletion, WrOpcode,
};
use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use sys::*;

/// libibverbs, loaded on first use; the error says why it is not there.
pub fn lib() -> Result<&'static Lib, &'static str> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(Lib::load).as_ref().map_err(|e| e.as_str())
}

fn last_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn rc_err(what: &str, rc: i32) -> io::Error {
    // Verbs calls return an errno value (positive) or -1 with errno set.
    let e = if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    };
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// An open device port (`ibv_open_device`).
pub struct Context {
    lib: &'static Lib,
    ctx: *mut ibv_context,
    name: String,
    port: u8,
}

// SAFETY: libibverbs objects may be used from any thread (the verbs API is thread-safe);
// the pointers are owned here and freed once, in Drop.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// What `ibv_query_port` says of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// Its active MTU.
    pub active_mtu: Option<Mtu>,
    /// GID table length.
    pub gid_tbl_len: i32,
}

impl Context {
    /// Opens device `name` (as `ibv_devices` lists it), using port `port`.
    pub fn open(name: &str, port: u8) -> io::Result<Arc<Self>> {
        let lib = lib().map_err(io::Error::other)?;
        // SAFETY: the list is freed below after the device is opened (opening keeps its own
        // reference); names are NUL-terminated.
        unsafe {
            let mut n = 0;
            let list = (lib.get_device_list)(&mut n);
            if list.is_null() {
                // ENOSYS: the kernel has no RDMA support at all.
                let e = io::Error::last_os_error();
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no RDMA device {name}: ibv_get_device_list: {e}"),
                ));
            }
            let mut found = std::ptr::null_mut();
            for i in 0..n.max(0) as usize {
                let d = *list.add(i);
                let nm = std::ffi::CStr::from_ptr((lib.get_device_name)(d));
                if nm.to_bytes() == name.as_bytes() {
                    found = d;
                    break;
                }
            }
            let ctx = if found.is_null() {
                std::ptr::null_mut()
            } else {
                (lib.open_device)(found)
            };
            let err = last_err("ibv_open_device");
            (lib.free_device_list)(list);
            if found.is_null() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no RDMA device {name}"),
                ));
            }
            if ctx.is_null() {
                return Err(err);
            }
            Ok(Arc::new(Self {
                lib,
                ctx,
                name: name.to_string(),
                port,
            }))
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The port used.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The port's state and MTU.
    pub fn port_attr(&self) -> io::Result<PortAttr> {
        let mut a = ibv_port_attr::default();
        // SAFETY: live context; `a` is larger than the compat layout the call fills.
        let rc = unsafe { (self.lib.query_port)(self.ctx, self.port, &mut a) };
        if rc != 0 {
            return Err(rc_err("ibv_query_port", rc));
        }
        Ok(PortAttr {
            active: a.state == IBV_PORT_ACTIVE,
            active_mtu: u8::try_from(a.active_mtu).ok().and_then(Mtu::from_enum),
            gid_tbl_len: a.gid_tbl_len,
        })
    }

    /// GID table entry `index` of the port.
    pub fn gid(&self, index: u32) -> io::Result<[u8; 16]> {
        let mut g = ibv_gid::default();
        // SAFETY: live context, valid out pointer.
        let rc = unsafe { (self.lib.query_gid)(self.ctx, self.port, index as i32, &mut g) };
        if rc != 0 {
            return Err(rc_err("ibv_query_gid", rc));
        }
        Ok(g.0)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, every child object holds an Arc of this, so none is left.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pd: *mut ibv_pd,
}
// SAFETY: see Context.
unsafe impl Send for Pd {}
// SAFETY: see Context.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn alloc(ctx: &Arc<Context>) -> io::Result<Arc<Self>> {
        // SAFETY: live context.
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(last_err("ibv_alloc_pd"));
        }
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            pd,
        }))
    }

    /// Registers `len` bytes of fresh zeroed memory (page-aligned, owned by the region).
    pub fn reg_mr(self: &Arc<Self>, len: usize, access: crate::Access) -> io::Result<Mr> {
        let len = len.max(1);
        // SAFETY: anonymous private mapping; checked below.
        let buf = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if buf == libc::MAP_FAILED {
            return Err(last_err("mmap for a memory region"));
        }
        let mut flags = 0;
        if access.contains(crate::Access::LOCAL_WRITE) {
            flags |= IBV_ACCESS_LOCAL_WRITE;
        }
        if access.contains(crate::Access::REMOTE_WRITE) {
            flags |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
        }
        if access.contains(crate::Access::REMOTE_READ) {
            flags |= IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: live PD, the mapping is ours and stays until Drop.
        let mr = unsafe { (self.ctx.lib.reg_mr)(self.pd, buf, len, flags) };
        if mr.is_null() {
            let e = last_err("ibv_reg_mr");
            // SAFETY: mapped above.
            unsafe { libc::munmap(buf, len) };
            return Err(e);
        }
        Ok(Mr {
            pd: self.clone(),
            mr,
            buf: buf.cast(),
            len,
            owner: None,
        })
    }

    /// Registers the memory of `of` again in this domain (a second link's own keys for the
    /// same buffer); the alias keeps `of` alive.
    pub fn reg_alias(self: &Arc<Self>, of: &Arc<Mr>, access: crate::Access) -> io::Result<Mr> {
        let mut flags = IBV_ACCESS_LOCAL_WRITE;
        if access.contains(crate::Access::REMOTE_WRITE) {
            flags |= IBV_ACCESS_REMOTE_WRITE;
        }
        if access.contains(crate::Access::REMOTE_READ) {
            flags |= IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: live PD; the memory stays mapped while the alias holds `of`.
        let mr = unsafe { (self.ctx.lib.reg_mr)(self.pd, of.buf.cast(), of.len, flags) };
        if mr.is_null() {
            return Err(last_err("ibv_reg_mr (alias)"));
        }
        Ok(Mr {
            pd: self.clone(),
            mr,
            buf: of.buf,
            len: of.len,
            owner: Some(of.clone()),
        })
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`; regions and QPs hold an Arc of this.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}

/// A registered memory region and the memory it owns.
pub struct Mr {
    pd: Arc<Pd>,
    mr: *mut ibv_mr,
    buf: *mut u8,
    len: usize,
    /// For an alias ([`Pd::reg_alias`]): the region that owns the memory.
    owner: Option<Arc<Self>>,
}
// SAFETY: see Context; the memory is accessed through raw copies only.
unsafe impl Send for Mr {}
// SAFETY: see Context.
unsafe impl Sync for Mr {}

impl Mr {
    /// The address peers write to (with [`Self::rkey`]).
    pub fn addr(&self) -> u64 {
        self.buf as u64
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live region.
        unsafe { (*self.mr).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live region.
        unsafe { (*self.mr).rkey }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty (never: at least one byte is registered).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A scatter/gather element over `[offset, offset + len)`.
    pub fn sge(&self, offset: usize, len: usize) -> crate::Sge {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "sge out of the region"
        );
        crate::Sge {
            addr: self.addr() + offset as u64,
            length: len as u32,
            lkey: self.lkey(),
        }
    }
    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len)
        );
        // SAFETY: in bounds (checked); the device may write concurrently, as with any RMB.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf.add(offset), data.len()) };
    }
    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.buf
    }
    /// Copies out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (checked).
        unsafe { std::ptr::copy_nonoverlapping(self.buf.add(offset), out.as_mut_ptr(), out.len()) };
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `reg_mr`/`reg_alias`; the owner unmaps, after deregistering
        // (its aliases hold it, so they are gone by then).
        unsafe {
            (self.pd.ctx.lib.dereg_mr)(self.mr);
            if self.owner.is_none() {
                libc::munmap(self.buf.cast(), self.len);
            }
        }
    }
}

/// A completion queue with its completion channel (a descriptor to wait on).
pub struct Cq {
    ctx: Arc<Context>,
    channel: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
}
// SAFETY: see Context.
unsafe impl Send for Cq {}
// SAFETY: see Context.
unsafe impl Sync for Cq {}

impl Cq {
    /// A CQ of `entries` entries with its own completion channel.
    pub fn create(ctx: &Arc<Context>, entries: u32) -> io::Result<Arc<Self>> {
        // SAFETY: live context; the channel is destroyed if the CQ cannot be made.
        unsafe {
            let ch = (ctx.lib.create_comp_channel)(ctx.ctx);
            if ch.is_null() {
                return Err(last_err("ibv_create_comp_channel"));
            }
            let cq = (ctx.lib.create_cq)(ctx.ctx, entries as i32, std::ptr::null_mut(), ch, 0);
            if cq.is_null() {
                let e = last_err("ibv_create_cq");
                (ctx.lib.destroy_comp_channel)(ch);
                return Err(e);
            }
            // Waits never block forever on a stale event: the descriptor is nonblocking.
            let fd = (*ch).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            Ok(Arc::new(Self {
                ctx: ctx.clone(),
                channel: ch,
                cq,
            }))
        }
    }

    /// Takes up to `out.len()` completions.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> io::Result<usize> {
        let mut raw = [ibv_wc::default(); 16];
        let want = out.len().min(raw.len());
        // SAFETY: live CQ, room for `want` entries.
        let n = unsafe { poll_cq(self.cq, want as i32, raw.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq failed ({n})")));
        }
        for (o, w) in out.iter_mut().zip(&raw[..n as usize]) {
            *o = from_wc(w);
        }
        Ok(n as usize)
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    pub fn req_notify(&self) -> io::Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { req_notify_cq(self.cq, false) };
        if rc != 0 {
            return Err(rc_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// The channel's descriptor: readable when an event is pending.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel lives as long as self.
        unsafe { BorrowedFd::borrow_raw(self.raw_fd()) }
    }

    fn raw_fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.channel).fd }
    }

    /// Takes and acknowledges pending channel events; whether there was one.
    pub fn take_events(&self) -> bool {
        let mut got = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut cx = std::ptr::null_mut();
            // SAFETY: live channel; nonblocking, so this returns -1 (EAGAIN) when none.
            let rc = unsafe { (self.ctx.lib.get_cq_event)(self.channel, &mut cq, &mut cx) };
            if rc != 0 {
                break;
            }
            got += 1;
        }
        if got > 0 {
            // SAFETY: acknowledges the events taken above.
            unsafe { (self.ctx.lib.ack_cq_events)(self.cq, got) };
        }
        got > 0
    }

    /// Waits up to `timeout` for completions and takes them: polls, arms, polls again, then
    /// sleeps on the channel.
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> io::Result<usize> {
        let until = std::time::Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.req_notify()?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            let mut p = libc::pollfd {
                fd: self.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe {
                libc::poll(
                    &mut p,
                    1,
                    left.as_millis().clamp(1, i32::MAX as u128) as i32,
                )
            };
            self.take_events();
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.take_events();
        // SAFETY: created in `create`; QPs using it hold an Arc of this.
        unsafe {
            (self.ctx.lib.destroy_cq)(self.cq);
            (self.ctx.lib.destroy_comp_channel)(self.channel);
        }
    }
}

#[cfg(test)]
mod tests;
