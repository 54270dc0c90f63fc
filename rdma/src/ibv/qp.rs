//! A verbs queue pair ([`Qp`]): state changes, posting, and the conversions between our work
//! requests and completions and libibverbs' structures.

#[allow(unused_imports)]
use super::*;

/// An RC queue pair.
pub struct Qp {
    pub(super) pd: Arc<Pd>,
    pub(super) _cqs: (Arc<Cq>, Arc<Cq>),
    pub(super) qp: *mut ibv_qp,
    pub(super) max_send_sge: u32,
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

/// The local ACK timeout exponent by default: 4.096 µs × 2^17 ≈ 537 ms per try.
pub const RTS_TIMEOUT: u8 = 17;

/// Retries by default. Not the kernel's 7 (smc_ib.c, `SMC_QP_RETRY_CNT`), which Linux's rxe
/// takes as "retry for ever": a queue pair whose path died would then never fail, and its link
/// would be found dead only by TEST LINK after the idle time (30 s), so a failover waited that
/// long. With 6, a path that stopped answering fails the queue pair after 7 tries of
/// [`RTS_TIMEOUT`] (about 3.8 s, on rxe and on hardware alike; our engine's budget is about
/// 6.3 s), and its link fails over or ends as any failed transport.
pub const RTS_RETRY_CNT: u8 = 6;

/// What the RTS transition takes (`None`: the defaults below).
#[derive(Debug, Clone, Copy, Default)]
pub struct RtsAttr {
    /// The first PSN we send.
    pub sq_psn: u32,
    /// Local ACK timeout exponent (`None`: [`RTS_TIMEOUT`]).
    pub timeout: Option<u8>,
    /// Retries (`None`: [`RTS_RETRY_CNT`]).
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

    pub(super) fn modify(&self, attr: &mut ibv_qp_attr, mask: i32, what: &str) -> io::Result<()> {
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
            timeout: r.timeout.unwrap_or(RTS_TIMEOUT),
            retry_cnt: r.retry_cnt.unwrap_or(RTS_RETRY_CNT),
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
pub(super) fn taken<T>(first: *const T, bad: *mut T, n: usize) -> usize {
    let (f, b) = (first as usize, bad as usize);
    let size = std::mem::size_of::<T>();
    if b >= f && b < f + n * size {
        (b - f) / size
    } else {
        0
    }
}

pub(super) fn post_result(rc: i32) -> Result<(), PostError> {
    match rc {
        0 => Ok(()),
        libc::ENOMEM => Err(PostError::QueueFull),
        libc::EINVAL => Err(PostError::InvalidState(crate::QpState::Error)),
        _ => Err(PostError::QueueFull),
    }
}

/// Our send request in libibverbs' form (pointers left for the caller).
pub(super) fn to_send_wr(w: &SendWr<'_>) -> ibv_send_wr {
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
pub(super) fn from_wc(w: &ibv_wc) -> WorkCompletion {
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
