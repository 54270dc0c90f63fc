//! libibverbs' structures and entry points, loaded at run time with `dlopen`, so that this
//! library loads and works on machines without rdma-core.
//!
//! The layouts are rdma-core's (`infiniband/verbs.h`, stable ABI since rdma-core v13); the
//! test `layouts_match_the_installed_header` compares every offset used here with the header
//! when it is installed. Functions that `verbs.h` defines inline (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) call through the context's ops table,
//! as the header does.
#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

/// `union ibv_gid`: 16 bytes, 8-aligned (it holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid(pub [u8; 16]);

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut Self,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` (network order) / `invalidate_rkey`.
    pub imm_data: u32,
    /// `wr.rdma.remote_addr`.
    pub remote_addr: u64,
    /// `wr.rdma.rkey`.
    pub rkey: u32,
    pub _wr_rest: [u32; 5],
    pub _qp_type: [u32; 2],
    pub _bind_mw_tso: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        // SAFETY: plain data; null pointers and zeros are the header's "unset".
        unsafe { std::mem::zeroed() }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut Self,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_port_attr` as the exported `ibv_query_port` fills it (the compat layout);
/// only the leading fields are read, the rest is room.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub _rest: [u8; 112],
}

impl Default for ibv_port_attr {
    fn default() -> Self {
        // SAFETY: plain data.
        unsafe { std::mem::zeroed() }
    }
}

/// The head of `struct ibv_context`: the device, then the ops table.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut c_void,
    /// `struct ibv_context_ops`: 8-byte function pointers.
    pub ops: [*const c_void; 32],
}

/// The head of `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// The head of `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
}

/// The head of `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
}

/// The head of `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
}

/// Opaque.
pub enum ibv_device {}
/// Opaque.
pub enum ibv_pd {}

// Indices into `ibv_context.ops` (offset in `struct ibv_context_ops` / 8); checked against
// the header.
pub const OPS_POLL_CQ: usize = 11;
pub const OPS_REQ_NOTIFY_CQ: usize = 12;
pub const OPS_POST_SEND: usize = 25;
pub const OPS_POST_RECV: usize = 26;

// enum values (verbs.h).
pub const IBV_QPT_RC: c_uint = 2;
pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_SQD: c_uint = 4;
pub const IBV_QPS_SQE: c_uint = 5;
pub const IBV_QPS_ERR: c_uint = 6;
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 8;
pub const IBV_QP_PKEY_INDEX: c_int = 16;
pub const IBV_QP_PORT: c_int = 32;
pub const IBV_QP_AV: c_int = 128;
pub const IBV_QP_PATH_MTU: c_int = 256;
pub const IBV_QP_TIMEOUT: c_int = 512;
pub const IBV_QP_RETRY_CNT: c_int = 1024;
pub const IBV_QP_RNR_RETRY: c_int = 2048;
pub const IBV_QP_RQ_PSN: c_int = 4096;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 8192;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 32768;
pub const IBV_QP_SQ_PSN: c_int = 65536;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 131072;
pub const IBV_QP_DEST_QPN: c_int = 1048576;
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_SEND_FENCE: c_uint = 1;
pub const IBV_SEND_SIGNALED: c_uint = 2;
pub const IBV_SEND_SOLICITED: c_uint = 4;
pub const IBV_SEND_INLINE: c_uint = 8;
pub const IBV_WC_SEND: c_uint = 0;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_RDMA_READ: c_uint = 2;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 129;
pub const IBV_WC_WITH_IMM: c_uint = 2;
pub const IBV_PORT_ACTIVE: c_uint = 4;

type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

macro_rules! entry_points {
    ($($field:ident = $sym:literal : fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The entry points, resolved once.
        pub struct Lib {
            $(#[doc = $sym] pub $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Lib {
            /// Resolves every entry point in the library `h`.
            ///
            /// # Safety
            /// `h` is a live `dlopen` handle of libibverbs (the types are verbs.h's).
            unsafe fn resolve(h: *mut c_void) -> Result<Self, String> {
                Ok(Self {
                    $($field: {
                        // SAFETY: NUL-terminated name, live handle.
                        let p = unsafe { libc::dlsym(h, concat!($sym, "\0").as_ptr().cast()) };
                        if p.is_null() {
                            return Err(format!("libibverbs.so.1 has no {}", $sym));
                        }
                        // SAFETY: the symbol is the function verbs.h declares with this type.
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(p)
                        }
                    },)*
                })
            }
        }
    };
}

entry_points! {
    get_device_list = "ibv_get_device_list": fn(*mut c_int) -> *mut *mut ibv_device;
    free_device_list = "ibv_free_device_list": fn(*mut *mut ibv_device);
    get_device_name = "ibv_get_device_name": fn(*mut ibv_device) -> *const c_char;
    open_device = "ibv_open_device": fn(*mut ibv_device) -> *mut ibv_context;
    close_device = "ibv_close_device": fn(*mut ibv_context) -> c_int;
    query_port = "ibv_query_port": fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    query_gid = "ibv_query_gid": fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    alloc_pd = "ibv_alloc_pd": fn(*mut ibv_context) -> *mut ibv_pd;
    dealloc_pd = "ibv_dealloc_pd": fn(*mut ibv_pd) -> c_int;
    reg_mr = "ibv_reg_mr": fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    dereg_mr = "ibv_dereg_mr": fn(*mut ibv_mr) -> c_int;
    create_comp_channel = "ibv_create_comp_channel": fn(*mut ibv_context) -> *mut ibv_comp_channel;
    destroy_comp_channel = "ibv_destroy_comp_channel": fn(*mut ibv_comp_channel) -> c_int;
    create_cq = "ibv_create_cq":
        fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    destroy_cq = "ibv_destroy_cq": fn(*mut ibv_cq) -> c_int;
    get_cq_event = "ibv_get_cq_event":
        fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ack_cq_events = "ibv_ack_cq_events": fn(*mut ibv_cq, c_uint);
    create_qp = "ibv_create_qp": fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    modify_qp = "ibv_modify_qp": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    destroy_qp = "ibv_destroy_qp": fn(*mut ibv_qp) -> c_int;
}

/// The library's name as rdma-core installs it (the runtime package, not `-dev`).
pub const SONAME: &CStr = c"libibverbs.so.1";

impl Lib {
    /// `dlopen`s libibverbs and resolves every entry point; an error names what was missing.
    pub fn load() -> Result<Self, String> {
        // SAFETY: NUL-terminated name. The handle is never closed (the providers it loads
        // register destructors), so the resolved pointers stay valid.
        let h = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(dlerror("dlopen libibverbs.so.1"));
        }
        // SAFETY: a live libibverbs handle.
        unsafe { Self::resolve(h) }
    }
}

fn dlerror(what: &str) -> String {
    // SAFETY: dlerror returns a thread-local string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return what.to_string();
    }
    // SAFETY: non-null, NUL-terminated.
    format!("{what}: {}", unsafe { CStr::from_ptr(e) }.to_string_lossy())
}

/// `ibv_poll_cq` (inline in verbs.h).
///
/// # Safety
/// `cq` is a live CQ of an open context; `wc` has room for `n` entries.
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller's; the ops slot is the provider's poll_cq.
    unsafe {
        let f: PollCq = std::mem::transmute((*(*cq).context).ops[OPS_POLL_CQ]);
        f(cq, n, wc)
    }
}

/// `ibv_req_notify_cq` (inline in verbs.h).
///
/// # Safety
/// `cq` is a live CQ of an open context.
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: bool) -> c_int {
    // SAFETY: the caller's.
    unsafe {
        let f: ReqNotifyCq = std::mem::transmute((*(*cq).context).ops[OPS_REQ_NOTIFY_CQ]);
        f(cq, solicited_only as c_int)
    }
}

/// `ibv_post_send` (inline in verbs.h).
///
/// # Safety
/// `qp` is a live QP; `wr` a valid chain whose SGEs name registered memory.
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: &mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller's.
    unsafe {
        let f: PostSend = std::mem::transmute((*(*qp).context).ops[OPS_POST_SEND]);
        f(qp, wr, bad)
    }
}

/// `ibv_post_recv` (inline in verbs.h).
///
/// # Safety
/// As [`post_send`].
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: &mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller's.
    unsafe {
        let f: PostRecv = std::mem::transmute((*(*qp).context).ops[OPS_POST_RECV]);
        f(qp, wr, bad)
    }
}
