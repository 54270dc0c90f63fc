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

pub use dev::VerbsInfo;
pub(crate) use dev::{Tracks, VerbsCq, VerbsDevice};

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

/// An RC queue pair.
pub struct Qp {
    pd: Arc<Pd>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    qp: *mut ibv_qp,
    max_send_sge: u32,
}
// SAFETY: see Context.
unsafe impl Send for Qp {}
// SAFETY: see Context.
unsafe impl Sync for Qp {}

/// What the RTR transition needs of the peer (RoCE v2: the GIDs name the path).
#[derive(Debug, Clone, Copy)]
pub struct RtrAttr {
    /// The peer's QP number.
    pub dest_qpn: u32,
    /// The first PSN the peer will send.
    pub rq_psn: u32,
    /// The path MTU.
    pub mtu: Mtu,
    /// The peer's GID.
    pub dgid: [u8; 16],
    /// Our GID's index (a RoCE v2 entry).
    pub sgid_index: u8,
    /// IP TTL (hop limit) of our packets.
    pub hop_limit: u8,
    /// The RNR NAK timer to advertise (`None`: SMC-R's 5).
    pub min_rnr_timer: Option<u8>,
}

/// What the RTS transition takes (`None`: SMC-R's values).
#[derive(Debug, Clone, Copy, Default)]
pub struct RtsAttr {
    /// The first PSN we send.
    pub sq_psn: u32,
    /// Local ACK timeout exponent (`None`: 14).
    pub timeout: Option<u8>,
    /// Retries (`None`: 7).
    pub retry_cnt: Option<u8>,
    /// RNR retries (`None`: 7, infinite).
    pub rnr_retry: Option<u8>,
}

impl Qp {
    /// `ibv_create_qp` (RC) in RESET.
    pub fn create(
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        caps: &QpCaps,
        sq_sig_all: bool,
    ) -> io::Result<Self> {
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.cq,
            recv_cq: recv_cq.cq,
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: sq_sig_all as i32,
        };
        // SAFETY: live PD and CQs (kept alive by this QP).
        let qp = unsafe { (pd.ctx.lib.create_qp)(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(last_err("ibv_create_qp"));
        }
        Ok(Self {
            pd: pd.clone(),
            _cqs: (send_cq.clone(), recv_cq.clone()),
            qp,
            max_send_sge: init.cap.max_send_sge,
        })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: i32, what: &str) -> io::Result<()> {
        // SAFETY: live QP, valid attributes.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(rc_err(what, rc));
        }
        Ok(())
    }

    /// RESET → INIT, peers allowed to WRITE (and READ when `remote_read`).
    pub fn to_init(&self, remote_read: bool) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            port_num: self.pd.ctx.port,
            qp_access_flags: (IBV_ACCESS_LOCAL_WRITE
                | IBV_ACCESS_REMOTE_WRITE
                | if remote_read {
                    IBV_ACCESS_REMOTE_READ
                } else {
                    0
                }) as u32,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp to INIT",
        )
    }

    /// INIT → RTR towards the peer.
    pub fn to_rtr(&self, r: &RtrAttr) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: r.mtu as u32,
            dest_qp_num: r.dest_qpn,
            rq_psn: r.rq_psn & 0xff_ffff,
            max_dest_rd_atomic: 1,
            // SMC-R's value (the kernel's smc_ib_modify_qp_rtr).
            min_rnr_timer: r.min_rnr_timer.unwrap_or(5),
            ah_attr: ibv_ah_attr {
                grh: ibv_global_route {
                    dgid: ibv_gid(r.dgid),
                    sgid_index: r.sgid_index,
                    hop_limit: r.hop_limit,
                    ..Default::default()
                },
                is_global: 1,
                port_num: self.pd.ctx.port,
                ..Default::default()
            },
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp to RTR",
        )
    }

    /// RTR → RTS.
    pub fn to_rts(&self, r: &RtsAttr) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: r.sq_psn & 0xff_ffff,
            // SMC-R's values (the kernel's smc_ib_modify_qp_rts).
            timeout: r.timeout.unwrap_or(14),
            retry_cnt: r.retry_cnt.unwrap_or(7),
            rnr_retry: r.rnr_retry.unwrap_or(7),
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp to RTS",
        )
    }

    /// Back to RESET (from any state).
    pub fn to_reset(&self) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RESET,
            ..Default::default()
        };
        self.modify(&mut a, IBV_QP_STATE, "ibv_modify_qp to RESET")
    }

    /// Into ERROR: outstanding requests complete flushed.
    pub fn to_error(&self) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut a, IBV_QP_STATE, "ibv_modify_qp to ERROR")
    }

    /// Posts send requests, in order.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.post_send_counted(wrs).map_err(|(_, e)| e)
    }

    /// As [`Self::post_send`]; an error says how many requests the device took before it.
    pub fn post_send_counted(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostError)> {
        let mut sges: Vec<ibv_sge> = Vec::new();
        let mut raw: Vec<ibv_send_wr> = Vec::with_capacity(wrs.len());
        for w in wrs {
            if w.sg_list.len() > self.max_send_sge as usize {
                return Err((
                    0,
                    PostError::TooManySge {
                        given: w.sg_list.len(),
                        max: self.max_send_sge as usize,
                    },
                ));
            }
            sges.extend(w.sg_list.iter().map(|s| ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }));
            raw.push(to_send_wr(w));
        }
        // Pointers last: the vectors no longer grow.
        let mut at = 0;
        let n = raw.len();
        for (i, w) in wrs.iter().enumerate() {
            raw[i].sg_list = if w.sg_list.is_empty() {
                std::ptr::null_mut()
            } else {
                sges[at..].as_mut_ptr()
            };
            at += w.sg_list.len();
            raw[i].next = if i + 1 < n {
                // SAFETY: in bounds.
                unsafe { raw.as_mut_ptr().add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        if n == 0 {
            return Ok(());
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; the chain and its SGEs live until the call returns (the provider
        // copies them into its queue).
        let rc = unsafe { post_send(self.qp, raw.as_mut_ptr(), &mut bad) };
        post_result(rc).map_err(|e| (taken(raw.as_ptr(), bad, n), e))
    }

    /// Posts receive requests.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.post_recv_counted(wrs).map_err(|(_, e)| e)
    }

    /// As [`Self::post_recv`]; an error says how many requests the device took before it.
    pub fn post_recv_counted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, PostError)> {
        let mut sges: Vec<ibv_sge> = wrs
            .iter()
            .flat_map(|w| w.sg_list.iter())
            .map(|s| ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        let n = wrs.len();
        let mut raw: Vec<ibv_recv_wr> = Vec::with_capacity(n);
        let mut at = 0;
        for w in wrs {
            raw.push(ibv_recv_wr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: if w.sg_list.is_empty() {
                    std::ptr::null_mut()
                } else {
                    sges[at..].as_mut_ptr()
                },
                num_sge: w.sg_list.len() as i32,
            });
            at += w.sg_list.len();
        }
        for i in 0..n.saturating_sub(1) {
            // SAFETY: in bounds.
            raw[i].next = unsafe { raw.as_mut_ptr().add(i + 1) };
        }
        if n == 0 {
            return Ok(());
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: as post_send.
        let rc = unsafe { post_recv(self.qp, raw.as_mut_ptr(), &mut bad) };
        post_result(rc).map_err(|e| (taken(raw.as_ptr(), bad, n), e))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `create`.
        unsafe { (self.pd.ctx.lib.destroy_qp)(self.qp) };
    }
}

/// How many requests of a chain starting at `first` the device took before `bad` (all of
/// them when `bad` is not in the chain).
fn taken<T>(first: *const T, bad: *mut T, n: usize) -> usize {
    let (f, b) = (first as usize, bad as usize);
    let size = std::mem::size_of::<T>();
    if b >= f && b < f + n * size {
        (b - f) / size
    } else {
        0
    }
}

fn post_result(rc: i32) -> Result<(), PostError> {
    match rc {
        0 => Ok(()),
        libc::ENOMEM => Err(PostError::QueueFull),
        libc::EINVAL => Err(PostError::InvalidState(crate::QpState::Error)),
        _ => Err(PostError::QueueFull),
    }
}

/// Our send request in libibverbs' form (pointers left for the caller).
fn to_send_wr(w: &SendWr<'_>) -> ibv_send_wr {
    let mut r = ibv_send_wr {
        wr_id: w.wr_id,
        num_sge: w.sg_list.len() as i32,
        ..Default::default()
    };
    let (op, imm, remote) = match w.opcode {
        WrOpcode::Send => (IBV_WR_SEND, 0, None),
        WrOpcode::SendWithImm(i) => (IBV_WR_SEND_WITH_IMM, i, None),
        WrOpcode::RdmaWrite { remote_addr, rkey } => {
            (IBV_WR_RDMA_WRITE, 0, Some((remote_addr, rkey)))
        }
        WrOpcode::RdmaWriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => (IBV_WR_RDMA_WRITE_WITH_IMM, imm, Some((remote_addr, rkey))),
        WrOpcode::RdmaRead { remote_addr, rkey } => {
            (IBV_WR_RDMA_READ, 0, Some((remote_addr, rkey)))
        }
    };
    r.opcode = op;
    // Immediate data travels in network order (`__be32`).
    r.imm_data = imm.to_be();
    if let Some((a, k)) = remote {
        r.remote_addr = a;
        r.rkey = k;
    }
    let mut f = 0;
    // Our SIGNAL_IF_DEFERRED is SIGNALED on a device that never runs a request when posted.
    if w.flags
        .intersects(SendFlags::SIGNALED | SendFlags::SIGNAL_IF_DEFERRED)
    {
        f |= IBV_SEND_SIGNALED;
    }
    if w.flags.contains(SendFlags::SOLICITED) {
        f |= IBV_SEND_SOLICITED;
    }
    r.send_flags = f;
    r
}

/// A libibverbs completion in our form.
fn from_wc(w: &ibv_wc) -> WorkCompletion {
    let status = match w.status {
        0 => WcStatus::Success,
        1 => WcStatus::LocLenErr,
        4 => WcStatus::LocProtErr,
        5 => WcStatus::WrFlushErr,
        7 => WcStatus::BadRespErr,
        9 => WcStatus::RemInvReqErr,
        10 => WcStatus::RemAccessErr,
        11 => WcStatus::RemOpErr,
        12 => WcStatus::RetryExcErr,
        13 => WcStatus::RnrRetryExcErr,
        s => WcStatus::DeviceErr(s),
    };
    let opcode = match w.opcode {
        IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        IBV_WC_RECV => WcOpcode::Recv,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Send,
    };
    WorkCompletion {
        wr_id: w.wr_id,
        status,
        opcode,
        byte_len: w.byte_len,
        imm_data: (w.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data)),
        qp_num: w.qp_num,
    }
}

#[cfg(test)]
mod tests;
