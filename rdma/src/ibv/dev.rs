//! A verbs device behind the crate's objects ([`crate::Device`] and friends): its completion
//! queues keep the engine's scheduling contract ([`crate::CqScheduler`]: an event descriptor
//! for pollers, a driver descriptor for a driving thread, kicks), so the runtime above does
//! not know which kind of device carries a link.
//!
//! One *pump* thread per device plays the engine thread's part: it sleeps on the completion
//! channels of the device's CQs and, when one fires, re-arms it and rings the CQ's event (or,
//! while a thread drives the CQ, its driver) descriptor. The completions themselves stay in
//! the device's CQ until a caller polls: the thread that waits does the work.

use super::{Context, Cq, Pd};
use crate::Mtu;
use crate::locks::Mutex;
use crate::rc::WorkCompletion;
use crate::signals::Signals;
use rustix::event::{EventfdFlags, epoll};
use rustix::fd::{BorrowedFd, OwnedFd};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// What a [`crate::Device`] on a verbs device knows of it.
pub(crate) struct VerbsDevice {
    pub(crate) ctx: Arc<Context>,
    /// The IPv4 address (and the RoCE port) its GID stands for.
    pub(crate) addr: SocketAddrV4,
    pub(crate) gid: [u8; 16],
    pub(crate) sgid_index: u8,
    /// Other addresses of the port a queue pair may send from (a second path: each has its
    /// own RoCE v2 GID entry), with their GID indexes.
    pub(crate) alts: Vec<(std::net::Ipv4Addr, u8)>,
    pub(crate) mtu: Mtu,
    pump: Arc<Pump>,
}

/// A verbs device's identity, for diagnostics and `smc-stat`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsInfo {
    /// The device's name (`rxe0`, `mlx5_0`).
    pub name: String,
    /// Its port.
    pub port: u8,
    /// The RoCE v2 GID entry used.
    pub gid_index: u8,
    /// The port's active MTU.
    pub mtu: Mtu,
}

impl VerbsDevice {
    /// Opens port `port` of device `name` for `addr`, whose RoCE v2 GID is entry
    /// `gid_index` (and for `alts`, other addresses with their entries), and starts its pump
    /// thread.
    pub(crate) fn open(
        name: &str,
        port: u8,
        gid_index: u32,
        addr: SocketAddrV4,
        alts: &[(std::net::Ipv4Addr, u32)],
    ) -> io::Result<Arc<Self>> {
        let ctx = Context::open(name, port)?;
        let attr = ctx.port_attr()?;
        if !attr.active {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("{name} port {port} is not ACTIVE"),
            ));
        }
        let gid = ctx.gid(gid_index)?;
        let checked = checked_alts(alts, |i| ctx.gid(i))
            .map_err(|e| io::Error::other(format!("{name} port {port}: {e}")))?;
        let pump = Pump::start(name)?;
        Ok(Arc::new(Self {
            ctx,
            addr,
            gid,
            sgid_index: gid_index8(gid_index)?,
            alts: checked,
            mtu: attr.active_mtu.unwrap_or(Mtu::Mtu1024),
            pump,
        }))
    }

    /// The GID index a queue pair sending from `ip` uses, if `ip` is one of ours.
    pub(crate) fn sgid_for(&self, ip: std::net::Ipv4Addr) -> Option<u8> {
        if ip == *self.addr.ip() {
            return Some(self.sgid_index);
        }
        self.alts.iter().find(|(a, _)| *a == ip).map(|&(_, i)| i)
    }

    pub(crate) fn info(&self) -> VerbsInfo {
        VerbsInfo {
            name: self.ctx.name().to_string(),
            port: self.ctx.port(),
            gid_index: self.sgid_index,
            mtu: self.mtu,
        }
    }

    pub(crate) fn alloc_pd(&self) -> io::Result<Arc<Pd>> {
        Pd::alloc(&self.ctx)
    }

    pub(crate) fn create_cq(&self) -> io::Result<Arc<VerbsCq>> {
        let cq = Cq::create(&self.ctx, 4096)?;
        let v = Arc::new(VerbsCq {
            cq,
            queue: Mutex::new(VecDeque::new()),
            sig: Signals::new()?,
            pump: Arc::downgrade(&self.pump),
            id: self.pump.next.fetch_add(1, Ordering::Relaxed),
            tracks: Mutex::new(HashMap::new()),
            pulling: Mutex::new(()),
        });
        self.pump.add(&v)?;
        Ok(v)
    }
}

impl Drop for VerbsDevice {
    fn drop(&mut self) {
        self.pump.stop();
    }
}

/// A GID index as address vectors carry it.
fn gid_index8(i: u32) -> io::Result<u8> {
    u8::try_from(i).map_err(|_| io::Error::other(format!("GID index {i} beyond 255")))
}

/// `alts` (addresses and their GID entries) checked against the table as `gid` reads it:
/// each entry must hold its address now (the table changes with the netdev's addresses).
pub(crate) fn checked_alts(
    alts: &[(std::net::Ipv4Addr, u32)],
    gid: impl Fn(u32) -> io::Result<[u8; 16]>,
) -> io::Result<Vec<(std::net::Ipv4Addr, u8)>> {
    // A plain loop: rustc 1.95 (and nightly 1.97) at opt-level 3 turned the
    // `map(..).collect::<io::Result<Vec<_>>>()` form of this into zeroed entries when `gid`
    // was `Context::gid` (a test in a guest with rxe found it: verbs::two_links_*).
    let mut checked = Vec::with_capacity(alts.len());
    for &(ip, i) in alts {
        if gid(i)? != crate::device::gid_of(ip) {
            return Err(io::Error::other(format!("GID {i} is not {ip}'s")));
        }
        checked.push((ip, gid_index8(i)?));
    }
    Ok(checked)
}

/// The thread that turns completion-channel events into the CQs' descriptors.
struct Pump {
    ep: OwnedFd,
    stop: OwnedFd,
    stopped: AtomicBool,
    cqs: Mutex<HashMap<u64, Weak<VerbsCq>>>,
    next: AtomicU64,
}

/// The epoll key of the stop descriptor (CQ ids start at 1).
const STOP: u64 = 0;

impl Pump {
    fn start(name: &str) -> io::Result<Arc<Self>> {
        let ep = crate::fdzone::place(epoll::create(epoll::CreateFlags::CLOEXEC)?)?;
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        let stop = crate::fdzone::place(rustix::event::eventfd(0, flags)?)?;
        epoll::add(
            &ep,
            &stop,
            epoll::EventData::new_u64(STOP),
            epoll::EventFlags::IN,
        )?;
        let p = Arc::new(Self {
            ep,
            stop,
            stopped: AtomicBool::new(false),
            cqs: Mutex::new(HashMap::new()),
            next: AtomicU64::new(STOP + 1),
        });
        let thread = crate::thread::claim()?;
        let p2 = p.clone();
        // Detached: it ends at `stop` (the device's drop), holding only its Arc.
        drop(thread.run(format!("smcr-{name}"), move || p2.run())?);
        Ok(p)
    }

    fn add(&self, cq: &Arc<VerbsCq>) -> io::Result<()> {
        self.cqs.lock().insert(cq.id, Arc::downgrade(cq));
        epoll::add(
            &self.ep,
            cq.cq.fd(),
            epoll::EventData::new_u64(cq.id),
            epoll::EventFlags::IN,
        )?;
        // Armed from the start: the first completion rings.
        cq.cq.req_notify()
    }

    fn remove(&self, cq: &VerbsCq) {
        self.cqs.lock().remove(&cq.id);
        let _ = epoll::delete(&self.ep, cq.cq.fd());
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&self.stop, &1u64.to_ne_bytes());
    }

    fn run(&self) {
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
        while !self.stopped.load(Ordering::SeqCst) {
            let Ok((events, _)) = epoll::wait(&self.ep, &mut buf, None) else {
                continue;
            };
            for e in events.iter() {
                let id = e.data.u64();
                if id == STOP {
                    continue;
                }
                let cq = self.cqs.lock().get(&id).and_then(Weak::upgrade);
                if let Some(cq) = cq {
                    cq.on_event();
                }
            }
        }
    }
}

/// A verbs CQ with the engine CQ's scheduling descriptors.
pub(crate) struct VerbsCq {
    pub(crate) cq: Arc<Cq>,
    /// Completions the pump took while re-arming (they came between the event and the arm).
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// Its descriptors and their scheduling.
    sig: Signals,
    pump: Weak<Pump>,
    id: u64,
    /// The requests of each queue pair using this CQ, by QP number.
    tracks: Mutex<HashMap<u32, Arc<Tracks>>>,
    /// Held while completions go from the device to `queue` (see `pull`).
    pulling: Mutex<()>,
}

/// The work requests of one queue pair that have not completed, in posting order (RC
/// completes each queue in order; the queue pair posts under a lock, so our order is the
/// device's).
///
/// Every send request goes to the device signaled, under an id of ours, so that what is
/// unfinished is known (the runtime drains a link before it fails the queue pair: a verbs
/// device flushes what it still holds). Completions of requests the caller posted unsignaled
/// are counted and dropped; the others, and every error, get the caller's id back.
#[derive(Default)]
pub(crate) struct Tracks {
    inner: Mutex<TrackInner>,
}

#[derive(Default)]
struct TrackInner {
    /// (our id, the caller's id, whether the caller gets its completion).
    sends: VecDeque<(u64, u64, bool)>,
    recvs: VecDeque<(u64, u64)>,
    next: u64,
}

/// Our ids of send requests carry this bit; receive requests' do not.
const SEND_BIT: u64 = 1 << 63;

impl Tracks {
    /// Our id for a send request (`deliver`: the caller asked for its completion).
    pub(crate) fn send(&self, user: u64, deliver: bool) -> u64 {
        let mut t = self.inner.lock();
        t.next = t.next.wrapping_add(1);
        let id = SEND_BIT | (t.next & !SEND_BIT);
        t.sends.push_back((id, user, deliver));
        id
    }

    /// Our id for a receive request.
    pub(crate) fn recv(&self, user: u64) -> u64 {
        let mut t = self.inner.lock();
        t.next = t.next.wrapping_add(1);
        let id = t.next & !SEND_BIT;
        t.recvs.push_back((id, user));
        id
    }

    /// Forgets the last `n` ids handed out for sends (`n` requests the device refused).
    pub(crate) fn unsend(&self, n: usize) {
        let mut t = self.inner.lock();
        for _ in 0..n {
            t.sends.pop_back();
        }
    }

    /// Forgets the last `n` receive ids.
    pub(crate) fn unrecv(&self, n: usize) {
        let mut t = self.inner.lock();
        for _ in 0..n {
            t.recvs.pop_back();
        }
    }

    /// Send requests not completed.
    pub(crate) fn unfinished(&self) -> usize {
        self.inner.lock().sends.len()
    }

    /// `wc` in the caller's terms: `Some(Some(wc))` for the caller, `Some(None)` counted and
    /// dropped, `None` not one of ours.
    pub(crate) fn complete(&self, wc: &WorkCompletion) -> Option<Option<WorkCompletion>> {
        let mut t = self.inner.lock();
        if wc.wr_id & SEND_BIT != 0 {
            // In order; anything ahead of it completed too (never, as all are signaled).
            while let Some(&(id, user, deliver)) = t.sends.front() {
                t.sends.pop_front();
                if id == wc.wr_id {
                    let ok = wc.status == crate::WcStatus::Success;
                    return Some((deliver || !ok).then_some(WorkCompletion { wr_id: user, ..*wc }));
                }
            }
            None
        } else {
            while let Some(&(id, user)) = t.recvs.front() {
                t.recvs.pop_front();
                if id == wc.wr_id {
                    return Some(Some(WorkCompletion { wr_id: user, ..*wc }));
                }
            }
            None
        }
    }
}

impl VerbsCq {
    /// The pump's part: take the channel's events, re-arm, keep what came meanwhile, and ring
    /// whoever sleeps on this CQ.
    fn on_event(&self) {
        self.cq.take_events();
        let _ = self.cq.req_notify();
        // A completion between the event and the arm raised no event: take it now.
        self.pull();
        self.signal();
    }

    /// Takes what the device has, gives each completion its caller's work request id back
    /// (see [`Tracks`]), and keeps those the caller gets in `queue`. Whether any is kept.
    fn pull(&self) -> bool {
        let mut buf = [WorkCompletion::EMPTY; 16];
        let mut any = false;
        // One puller at a time, from the device's poll to the queue: each queue pair's
        // completions must meet its `Tracks` in the order the device gave them.
        let _pulling = self.pulling.lock();
        loop {
            let n = match self.cq.poll(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    log::warn!("{e}");
                    break;
                }
            };
            let tracks = self.tracks.lock();
            let mut q = self.queue.lock();
            for wc in &buf[..n] {
                let t = tracks.get(&wc.qp_num);
                match t.and_then(|t| t.complete(wc)) {
                    Some(Some(mine)) => {
                        q.push_back(mine);
                        any = true;
                    }
                    // An unsignaled request's success: counted, not the caller's.
                    Some(None) => {}
                    // A queue pair destroyed meanwhile.
                    None => {}
                }
            }
        }
        any || !self.queue.lock().is_empty()
    }

    /// Registers the requests of queue pair `qpn` (its sends, if this is its send CQ; its
    /// receives, if its receive CQ).
    pub(crate) fn track(&self, qpn: u32, t: Arc<Tracks>) {
        self.tracks.lock().insert(qpn, t);
    }

    pub(crate) fn untrack(&self, qpn: u32) {
        self.tracks.lock().remove(&qpn);
    }

    fn signal(&self) {
        self.sig.signal();
    }

    /// Takes up to `out.len()` completions: those the pump kept, then the device's.
    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        if self.queue.lock().len() < out.len() {
            self.pull();
        }
        let mut q = self.queue.lock();
        let mut n = 0;
        while n < out.len() {
            let Some(wc) = q.pop_front() else { break };
            out[n] = wc;
            n += 1;
        }
        n
    }

    pub(crate) fn has_completions(&self) -> bool {
        // (The queue's guard must be gone before `pull` takes the lock again.)
        let queued = !self.queue.lock().is_empty();
        queued || self.pull()
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.sig.fd()
    }

    pub(crate) fn req_notify(&self) {
        self.sig.req_notify(|| self.has_completions());
    }

    pub(crate) fn ack_events(&self) {
        self.sig.ack_events();
    }

    /// [`crate::CompletionQueue::wait`]'s sleep: until the pump rings or `left` passes.
    pub(crate) fn sleep(&self, left: Option<Duration>) -> io::Result<()> {
        self.sig.sleep(left)
    }

    // The scheduler's side (see `crate::CqScheduler` for the contract).

    pub(crate) fn kick(&self) {
        self.sig.kick();
    }

    pub(crate) fn kick_driver(&self) {
        self.sig.kick_driver();
    }

    pub(crate) fn begin_drive(&self) {
        self.sig.begin_drive();
    }

    pub(crate) fn end_drive(&self) {
        self.sig.end_drive(|| self.has_completions());
    }

    pub(crate) fn driver_fd(&self) -> BorrowedFd<'_> {
        self.sig.driver_fd()
    }

    pub(crate) fn drive_sleep(&self, on: bool) -> bool {
        self.sig.drive_sleep(on, || self.has_completions())
    }

    pub(crate) fn drive_wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.sig.drive_wait(timeout, || self.has_completions())
    }

    pub(crate) fn driven(&self) -> bool {
        self.sig.driven()
    }

    pub(crate) fn wait_ready(&self, timeout: Option<Duration>) -> io::Result<bool> {
        self.sig.wait_ready(timeout, || self.has_completions())
    }
}

impl Drop for VerbsCq {
    fn drop(&mut self) {
        if let Some(p) = self.pump.upgrade() {
            p.remove(self);
        }
    }
}
