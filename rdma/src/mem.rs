//! An in-memory device: devices of one process joined by a [`Fabric`], with no packets, no
//! threads and no timers. A request runs when it is posted: an RDMA WRITE copies into the
//! peer's region (its rkey, range and rights checked as the engine checks them), a SEND
//! fills the peer's oldest receive request (or waits for the next one posted, as an RNR
//! retry would), and both completions are queued before `post_send` returns. What the
//! device layer of a program (a link group's poller, a driver) does with completions can so
//! be tested without a network, and without a sleep: nothing happens later than the call that
//! caused it, except what the test's own threads do.
//!
//! A device can also defer its sends ([`crate::Device::defer_sends`]): requests then wait
//! and run when the test says, reading their local memory only then, as a verbs device does
//! (it reads a request's buffers when it sends it, not when it is posted). A device can have
//! more than one address ([`Fabric::add_address`]), as a multi-homed port has.
//!
//! Errors are those of RC: a local key or range that is wrong fails the request with
//! `LocProtErr`, a remote one with `RemAccessErr` (and moves both queue pairs to the error
//! state); a peer that does not exist, or is not ready to receive, `RetryExcErr`, as
//! retransmissions to nobody would end. A QP in the error state flushes what it holds and
//! what is posted to it.
//!
//! ```
//! use rdma::*;
//! let fabric = mem::Fabric::new();
//! let a = Device::open_mem(&fabric, "10.0.0.1".parse().unwrap())?;
//! let b = Device::open_mem(&fabric, "10.0.0.2".parse().unwrap())?;
//! let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
//! let (ca, cb) = (a.create_cq()?, b.create_cq()?);
//! let src = pa.reg_mr(64, Access::LOCAL_WRITE)?;
//! let dst = pb.reg_mr(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let qa = pa.create_qp(&ca, &ca, QpCaps::default(), true)?;
//! let qb = pb.create_qp(&cb, &cb, QpCaps::default(), true)?;
//! for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
//!     q.modify(&QpAttr::state(QpState::Init))?;
//!     q.modify(&QpAttr { dest_qp_num: Some(peer.qp_num()), av: Some(dev.local_addr()),
//!         rq_psn: Some(Psn::new(0)), path_mtu: Some(Mtu::Mtu1024),
//!         ..QpAttr::state(QpState::Rtr) })?;
//!     q.modify(&QpAttr { sq_psn: Some(Psn::new(0)), ..QpAttr::state(QpState::Rts) })?;
//! }
//! src.write(0, b"hello");
//! qa.post_send(&[SendWr { wr_id: 7, sg_list: &[src.sge(0, 5)], flags: SendFlags::empty(),
//!     opcode: WrOpcode::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() } }])?;
//! let mut out = [0u8; 5];
//! dst.read(0, &mut out);
//! assert_eq!(&out, b"hello"); // in place when `post_send` returned
//! let mut wcs = [WorkCompletion::EMPTY; 4];
//! assert_eq!(ca.poll(&mut wcs), 1);
//! assert_eq!((wcs[0].wr_id, wcs[0].status), (7, WcStatus::Success));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::locks::Mutex;
use crate::mr::{Access, AccessError, MrTable};
use crate::rc::{
    ModifyError, PostError, QpAttr, QpCaps, QpState, RecvWr, SendFlags, SendWr, Sge, WcOpcode,
    WcStatus, WorkCompletion, WrOpcode,
};
use crate::signals::Signals;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The devices that reach each other, by address.
#[derive(Default)]
pub struct Fabric {
    devs: Mutex<HashMap<Ipv4Addr, Weak<MemDev>>>,
    seed: AtomicU32,
}

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn dev(&self, ip: Ipv4Addr) -> Option<Arc<MemDev>> {
        self.devs.lock().get(&ip).and_then(Weak::upgrade)
    }

    /// Gives the device at `of` a second address `ip` (peers reach its queue pairs there
    /// too). False if no live device is at `of`, or `ip` is taken.
    pub fn add_address(&self, of: Ipv4Addr, ip: Ipv4Addr) -> bool {
        let mut devs = self.devs.lock();
        let Some(dev) = devs.get(&of).filter(|d| d.strong_count() > 0).cloned() else {
            return false;
        };
        if devs.get(&ip).is_some_and(|d| d.strong_count() > 0) {
            return false;
        }
        devs.insert(ip, dev);
        true
    }
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ips: Vec<_> = self.devs.lock().keys().copied().collect();
        ips.sort();
        f.debug_struct("Fabric").field("devices", &ips).finish()
    }
}

/// One device on a fabric: its regions and queue pairs.
pub(crate) struct MemDev {
    pub(crate) ip: Ipv4Addr,
    fabric: Arc<Fabric>,
    pub(crate) mrs: MrTable,
    qps: Mutex<HashMap<u32, Weak<MemQp>>>,
    next_qpn: AtomicU32,
    pub(crate) next_pd: AtomicU32,
    /// While sends are deferred: the requests posted meanwhile, in order.
    deferred: Mutex<Option<Vec<DeferredWr>>>,
}

/// A send request posted while sends are deferred: what it names, not what it reads.
struct DeferredWr {
    qp: Arc<MemQp>,
    wr_id: u64,
    opcode: WrOpcode,
    sges: Vec<Sge>,
    flags: SendFlags,
}

impl MemDev {
    /// Joins `fabric` at `ip` (refused if a live device has it).
    pub(crate) fn open(fabric: &Arc<Fabric>, ip: Ipv4Addr) -> io::Result<Arc<Self>> {
        let mut devs = fabric.devs.lock();
        if devs.get(&ip).is_some_and(|d| d.strong_count() > 0) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{ip} is taken on this fabric"),
            ));
        }
        let seed = fabric.seed.fetch_add(0x9e37_79b9, Ordering::Relaxed);
        let dev = Arc::new(Self {
            ip,
            fabric: fabric.clone(),
            mrs: MrTable::new(seed ^ u32::from(ip)),
            qps: Mutex::new(HashMap::new()),
            // QP numbers of different devices differ too: a mistaken peer is not found.
            next_qpn: AtomicU32::new((u32::from(ip) & 0xff) << 12 | 0x11),
            next_pd: AtomicU32::new(1),
            deferred: Mutex::new(None),
        });
        devs.insert(ip, Arc::downgrade(&dev));
        Ok(dev)
    }

    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.ip, 4791)
    }

    pub(crate) fn create_qp(
        self: &Arc<Self>,
        pd: u32,
        (send_cq, recv_cq): (&Arc<MemCq>, &Arc<MemCq>),
        caps: QpCaps,
        sq_sig_all: bool,
    ) -> Arc<MemQp> {
        let qpn = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let qp = Arc::new(MemQp {
            qpn,
            pd,
            dev: self.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            caps,
            sq_sig_all,
            posting: Mutex::new(()),
            st: Mutex::new(QpSt {
                state: QpState::Reset,
                peer: None,
                recvs: VecDeque::new(),
                waiting: VecDeque::new(),
            }),
        });
        let mut qps = self.qps.lock();
        qps.retain(|_, w| w.strong_count() > 0);
        qps.insert(qpn, Arc::downgrade(&qp));
        qp
    }

    fn qp(&self, qpn: u32) -> Option<Arc<MemQp>> {
        self.qps.lock().get(&qpn).and_then(Weak::upgrade)
    }

    /// See [`crate::Device::defer_sends`].
    pub(crate) fn defer_sends(&self, on: bool) {
        if on {
            self.deferred.lock().get_or_insert_with(Vec::new);
            return;
        }
        let Some(held) = self.deferred.lock().take() else {
            return;
        };
        for d in held {
            let wr = SendWr {
                wr_id: d.wr_id,
                opcode: d.opcode,
                sg_list: &d.sges,
                flags: d.flags,
            };
            let _ = d.qp.execute(std::slice::from_ref(&wr));
        }
    }

    /// See [`crate::Device::deferred_sends`].
    pub(crate) fn deferred_sends(&self) -> usize {
        self.deferred.lock().as_ref().map_or(0, Vec::len)
    }
}

/// A completion queue of the fabric: posters queue into it.
pub(crate) struct MemCq {
    queue: Mutex<VecDeque<WorkCompletion>>,
    pub(crate) sig: Signals,
}

impl MemCq {
    pub(crate) fn new() -> io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            queue: Mutex::new(VecDeque::new()),
            sig: Signals::new()?,
        }))
    }

    fn push(&self, wc: WorkCompletion) {
        self.queue.lock().push_back(wc);
        self.sig.signal();
    }

    pub(crate) fn has_completions(&self) -> bool {
        !self.queue.lock().is_empty()
    }

    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut q = self.queue.lock();
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        n
    }

    pub(crate) fn wait_ready(&self, timeout: Option<Duration>) -> io::Result<bool> {
        self.sig.wait_ready(timeout, || self.has_completions())
    }
}

/// A message that reached a queue pair with no receive request posted: it takes the next.
struct Incoming {
    data: Vec<u8>,
    imm: Option<u32>,
    opcode: WcOpcode,
    /// Bytes the completion reports (a WRITE with immediate places its data, not here).
    byte_len: u32,
}

struct QpSt {
    state: QpState,
    /// The peer's address and QP number (from RTR on).
    peer: Option<(Ipv4Addr, u32)>,
    recvs: VecDeque<(u64, Vec<Sge>)>,
    waiting: VecDeque<Incoming>,
}

/// A queue pair of the fabric.
pub(crate) struct MemQp {
    pub(crate) qpn: u32,
    pd: u32,
    dev: Arc<MemDev>,
    send_cq: Arc<MemCq>,
    recv_cq: Arc<MemCq>,
    caps: QpCaps,
    sq_sig_all: bool,
    /// Held through a post: requests run, and complete, in the order they were posted.
    posting: Mutex<()>,
    st: Mutex<QpSt>,
}

impl MemQp {
    pub(crate) fn state(&self) -> QpState {
        self.st.lock().state
    }

    pub(crate) fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        use QpState::*;
        let mut st = self.st.lock();
        let (from, to) = (st.state, attr.qp_state);
        match (from, to) {
            (_, Reset) => {
                st.peer = None;
                st.recvs.clear();
                st.waiting.clear();
            }
            (Reset | Init, Init) | (Rtr | Rts, Rts) => {}
            (Init, Rtr) => {
                let qpn = attr
                    .dest_qp_num
                    .ok_or(ModifyError::MissingAttr("dest_qp_num"))?;
                let av = attr.av.ok_or(ModifyError::MissingAttr("av"))?;
                st.peer = Some((*av.ip(), qpn));
            }
            (_, Error) => {
                self.flush(&mut st);
            }
            _ => return Err(ModifyError::InvalidTransition { from, to }),
        }
        st.state = to;
        Ok(())
    }

    /// Into the error state: every receive request completes flushed.
    fn flush(&self, st: &mut QpSt) {
        st.state = QpState::Error;
        st.waiting.clear();
        for (wr_id, _) in st.recvs.drain(..) {
            self.recv_cq
                .push(wc(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, self.qpn));
        }
    }

    fn fail(&self) {
        let mut st = self.st.lock();
        if st.state != QpState::Error {
            self.flush(&mut st);
        }
    }

    pub(crate) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut st = self.st.lock();
        match st.state {
            QpState::Reset => return Err(PostError::InvalidState(QpState::Reset)),
            QpState::Error => {
                for w in wrs {
                    self.recv_cq.push(wc(
                        w.wr_id,
                        WcStatus::WrFlushErr,
                        WcOpcode::Recv,
                        0,
                        self.qpn,
                    ));
                }
                return Ok(());
            }
            _ => {}
        }
        for w in wrs {
            if st.recvs.len() >= self.caps.max_recv_wr as usize {
                return Err(PostError::QueueFull);
            }
            if w.sg_list.len() > self.caps.max_recv_sge as usize {
                return Err(PostError::TooManySge {
                    given: w.sg_list.len(),
                    max: self.caps.max_recv_sge as usize,
                });
            }
            st.recvs.push_back((w.wr_id, w.sg_list.to_vec()));
        }
        // Messages that came first take the new requests (an RNR retry that now succeeds).
        while !st.recvs.is_empty()
            && let Some(m) = st.waiting.pop_front()
        {
            self.place(&mut st, m);
        }
        Ok(())
    }

    /// Puts an incoming message into the oldest receive request (one is posted).
    fn place(&self, st: &mut QpSt, m: Incoming) {
        let Some((wr_id, sges)) = st.recvs.pop_front() else {
            st.waiting.push_front(m);
            return;
        };
        let mut at = 0;
        for s in &sges {
            if at == m.data.len() {
                break;
            }
            let n = (s.length as usize).min(m.data.len() - at);
            match self
                .dev
                .mrs
                .check(s.lkey, self.pd, s.addr, n as u64, Access::LOCAL_WRITE)
            {
                Ok((r, off)) => r.write(off, &m.data[at..at + n]),
                Err(_) => {
                    self.recv_cq
                        .push(wc(wr_id, WcStatus::LocProtErr, m.opcode, 0, self.qpn));
                    self.flush(st);
                    return;
                }
            }
            at += n;
        }
        if at < m.data.len() {
            self.recv_cq
                .push(wc(wr_id, WcStatus::LocLenErr, m.opcode, 0, self.qpn));
            self.flush(st);
            return;
        }
        let mut c = wc(wr_id, WcStatus::Success, m.opcode, m.byte_len, self.qpn);
        c.imm_data = m.imm;
        self.recv_cq.push(c);
    }

    /// Runs the requests in order; each completes (when signaled, or failed) before the
    /// next runs. Returns 0: no request is reported as run at posting (their completions
    /// are queued as on UDP, so [`SendFlags::SIGNAL_IF_DEFERRED`] counts as signaled).
    pub(crate) fn post_send(self: &Arc<Self>, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
        {
            let mut deferred = self.dev.deferred.lock();
            if let Some(held) = deferred.as_mut() {
                let state = self.state();
                if !matches!(state, QpState::Rts | QpState::Error) {
                    return Err(PostError::InvalidState(state));
                }
                for w in wrs {
                    if w.sg_list.len() > self.caps.max_send_sge as usize {
                        return Err(PostError::TooManySge {
                            given: w.sg_list.len(),
                            max: self.caps.max_send_sge as usize,
                        });
                    }
                }
                held.extend(wrs.iter().map(|w| DeferredWr {
                    qp: self.clone(),
                    wr_id: w.wr_id,
                    opcode: w.opcode,
                    sges: w.sg_list.to_vec(),
                    flags: w.flags,
                }));
                return Ok(0);
            }
        }
        self.execute(wrs)
    }

    /// Runs send requests now (see [`Self::post_send`]).
    fn execute(&self, wrs: &[SendWr<'_>]) -> Result<usize, PostError> {
        let _posting = self.posting.lock();
        let (state, peer) = {
            let st = self.st.lock();
            (st.state, st.peer)
        };
        match state {
            QpState::Rts => {}
            QpState::Error => {
                for w in wrs {
                    let op = op_of(w.opcode);
                    self.send_cq
                        .push(wc(w.wr_id, WcStatus::WrFlushErr, op, 0, self.qpn));
                }
                return Ok(0);
            }
            s => return Err(PostError::InvalidState(s)),
        }
        for w in wrs {
            if w.sg_list.len() > self.caps.max_send_sge as usize {
                return Err(PostError::TooManySge {
                    given: w.sg_list.len(),
                    max: self.caps.max_send_sge as usize,
                });
            }
        }
        for (i, w) in wrs.iter().enumerate() {
            let (status, len) = self.run(w, peer);
            let signaled = self.sq_sig_all
                || w.flags
                    .intersects(SendFlags::SIGNALED | SendFlags::SIGNAL_IF_DEFERRED);
            if status != WcStatus::Success {
                self.send_cq
                    .push(wc(w.wr_id, status, op_of(w.opcode), 0, self.qpn));
                self.fail();
                // What follows is flushed, as an RC QP in error flushes its queue.
                for w in &wrs[i + 1..] {
                    self.send_cq.push(wc(
                        w.wr_id,
                        WcStatus::WrFlushErr,
                        op_of(w.opcode),
                        0,
                        self.qpn,
                    ));
                }
                return Ok(0);
            }
            if signaled {
                self.send_cq
                    .push(wc(w.wr_id, status, op_of(w.opcode), len, self.qpn));
            }
        }
        Ok(0)
    }

    /// One request: its status and the bytes it moved.
    fn run(&self, w: &SendWr<'_>, peer: Option<(Ipv4Addr, u32)>) -> (WcStatus, u32) {
        let Some(to) = peer
            .and_then(|(ip, qpn)| self.dev.fabric.dev(ip)?.qp(qpn))
            .filter(|q| matches!(q.state(), QpState::Rtr | QpState::Rts))
        else {
            return (WcStatus::RetryExcErr, 0);
        };
        let len: u64 = w.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if len > 1 << 31 {
            return (WcStatus::LocLenErr, 0);
        }
        if let WrOpcode::RdmaRead { remote_addr, rkey } = w.opcode {
            let Ok((r, off)) = to.remote(rkey, remote_addr, len, Access::REMOTE_READ) else {
                return (WcStatus::RemAccessErr, 0);
            };
            let mut data = vec![0u8; len as usize];
            r.read(off, &mut data);
            return match self.scatter(w.sg_list, &data) {
                Ok(()) => (WcStatus::Success, len as u32),
                Err(_) => (WcStatus::LocProtErr, 0),
            };
        }
        let Ok(data) = self.gather(w.sg_list) else {
            return (WcStatus::LocProtErr, 0);
        };
        let incoming = match w.opcode {
            WrOpcode::Send | WrOpcode::SendWithImm(_) => Some(Incoming {
                byte_len: data.len() as u32,
                imm: match w.opcode {
                    WrOpcode::SendWithImm(i) => Some(i),
                    _ => None,
                },
                data,
                opcode: WcOpcode::Recv,
            }),
            WrOpcode::RdmaWrite { remote_addr, rkey }
            | WrOpcode::RdmaWriteWithImm {
                remote_addr, rkey, ..
            } => {
                let Ok((r, off)) = to.remote(rkey, remote_addr, len, Access::REMOTE_WRITE) else {
                    return (WcStatus::RemAccessErr, 0);
                };
                r.write(off, &data);
                match w.opcode {
                    WrOpcode::RdmaWriteWithImm { imm, .. } => Some(Incoming {
                        data: Vec::new(),
                        imm: Some(imm),
                        opcode: WcOpcode::RecvRdmaWithImm,
                        byte_len: len as u32,
                    }),
                    _ => None,
                }
            }
            WrOpcode::RdmaRead { .. } => unreachable!("handled above"),
        };
        if let Some(m) = incoming {
            let mut st = to.st.lock();
            if st.recvs.is_empty() {
                st.waiting.push_back(m);
            } else {
                to.place(&mut st, m);
            }
        }
        (WcStatus::Success, len as u32)
    }

    /// A peer's access to this QP's regions; a refused one moves this QP to the error state,
    /// as a responder that NAKs an access error does.
    fn remote(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<crate::Region>, usize), AccessError> {
        self.dev
            .mrs
            .check(rkey, self.pd, addr, len, need)
            .inspect_err(|_| self.fail())
    }

    fn gather(&self, sges: &[Sge]) -> Result<Vec<u8>, AccessError> {
        let mut out = Vec::new();
        for s in sges {
            let (r, off) = self.dev.mrs.check(
                s.lkey,
                self.pd,
                s.addr,
                u64::from(s.length),
                Access::empty(),
            )?;
            let at = out.len();
            out.resize(at + s.length as usize, 0);
            r.read(off, &mut out[at..]);
        }
        Ok(out)
    }

    fn scatter(&self, sges: &[Sge], data: &[u8]) -> Result<(), AccessError> {
        let mut at = 0;
        for s in sges {
            let n = (s.length as usize).min(data.len() - at);
            let (r, off) =
                self.dev
                    .mrs
                    .check(s.lkey, self.pd, s.addr, n as u64, Access::LOCAL_WRITE)?;
            r.write(off, &data[at..at + n]);
            at += n;
        }
        Ok(())
    }

    pub(crate) fn summary(&self) -> String {
        let st = self.st.lock();
        format!(
            "mem {} qpn {:#x} {:?} peer {:?} recvs {} waiting {}",
            self.dev.ip,
            self.qpn,
            st.state,
            st.peer,
            st.recvs.len(),
            st.waiting.len()
        )
    }
}

fn op_of(op: WrOpcode) -> WcOpcode {
    match op {
        WrOpcode::Send | WrOpcode::SendWithImm(_) => WcOpcode::Send,
        WrOpcode::RdmaWrite { .. } | WrOpcode::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
        WrOpcode::RdmaRead { .. } => WcOpcode::RdmaRead,
    }
}

fn wc(
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    qp_num: u32,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm_data: None,
        qp_num,
    }
}
