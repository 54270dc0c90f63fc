//! A connection's shared state under the driver (`ConnShared`, `ConnState`): staging and
//! corking writes, posting them on the group's active path (moving after a failover), CDCs
//! received, readiness, failure and release.

#[allow(unused_imports)]
use super::*;

/// Counters of an SMC-R stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Bytes written into the peer's RMB and announced.
    pub bytes_sent: u64,
    /// Bytes read by the application.
    pub bytes_received: u64,
    /// CDCs that announced data (fewer than writes when autocorking coalesced them).
    pub data_cdcs: u64,
    /// `write` calls that moved bytes.
    pub writes: u64,
    /// Times the connection moved to another link of its group (a link failed).
    pub failovers: u64,
}

/// One SMC-R connection's shared state (the stream holds it; so does the link group until
/// both sides closed, because the peer may still write into our RMB until it has seen our
/// close).
pub(crate) struct ConnShared {
    pub(crate) token: u32,
    pub(crate) rmb: Arc<MemoryRegion>,
    pub(crate) sndbuf: Arc<MemoryRegion>,
    pub(crate) core: Mutex<ConnState>,
    pub(crate) cond: Condvar,
    /// Counts [`ConnShared::wake`]s: a thread that checked its condition and then drives the
    /// group instead of waiting on `cond` learns from it that the condition may have changed
    /// in between.
    pub(crate) wakes: std::sync::atomic::AtomicU64,
    /// The group, to wake its blocking driver when something other than a completion changes
    /// this connection (a shutdown or abort by another thread, the group failing).
    pub(crate) lg: Weak<LinkGroup>,
    /// Two eventfds, for readers and for writers, made readable at every state change (data,
    /// space, close, failure); created on demand for poll/epoll and async users. Two, because
    /// a reactor keeps one waiter per fd and direction.
    pub(crate) events: [std::sync::OnceLock<OwnedFd>; 2],
    /// Told the readiness an application would see (the preload's fd), at every change.
    pub(crate) readiness: std::sync::OnceLock<Box<dyn Readiness>>,
}

/// What `poll` should report for a connection, kept current by the connection (under its
/// lock, so updates arrive in order). The preload implements it with a socket whose kernel
/// readiness it controls.
pub trait Readiness: Send + Sync {
    /// The state changed: readable (data, EOF or error), writable (space, or an error to
    /// report), read side hung up (peer done writing or gone), fully hung up.
    fn update(&self, state: ReadyState);
}

pub use crate::conn::ReadyState;

pub(crate) struct ConnState {
    pub(crate) core: ConnCore,
    pub(crate) failed: Option<ConnFailure>,
    pub(crate) released: bool,
    /// The peer's RMB as the path we last wrote on reaches it (see [`crate::rtokens`]).
    pub(crate) peer: crate::rtokens::PeerRmb,
    /// Counters.
    pub(crate) stats: ConnStats,
    /// A reset (peer abort or failure) was reported to the application once; later reads
    /// give EOF and writes EPIPE, as for a TCP socket whose error was collected.
    pub(crate) reset_reported: bool,
    /// What the readiness sink was last told.
    pub(crate) reported: Option<ReadyState>,
    /// Data arrivals (see [`ReadyState::arrivals`]).
    pub(crate) arrivals: u32,
    /// The connection's record in the stats area, while the stream holds it (cleared under
    /// this lock before the record is freed, so no late update lands in a reused slot).
    pub(crate) stat: Option<StatRef>,
    /// The group's failover epoch this connection last moved at (see [`ConnShared::route`]).
    pub(crate) epoch: u32,
}

/// Where a connection publishes its cursors and state.
pub(crate) struct StatRef {
    pub(crate) area: Arc<crate::stats::Area>,
    pub(crate) slot: usize,
    /// When negotiation began (stage times are offsets from it).
    pub(crate) start: Instant,
    /// The first write's time is recorded (later writes need no clock read and no atomic
    /// read-modify-write on the shared record).
    pub(crate) wrote: bool,
}

impl ConnState {
    /// Linux's SMC state for this connection now (`enum smc_state`).
    pub(crate) fn linux_state(&self) -> u64 {
        self.core.linux_state(self.failed.is_some()) as u64
    }

    /// Publishes cursors, flags and state to the stats area (cheap relaxed stores).
    pub(crate) fn publish(&self) {
        use crate::stats::conn::live;
        let Some(st) = &self.stat else { return };
        let (tp, pc, rp, rc, lf, pf) = self.core.cursors();
        let w = |c: cdc::Cursor| u64::from(c.wrap) << 32 | u64::from(c.count);
        st.area.set_live(st.slot, live::TX_PROD, w(tp));
        st.area.set_live(st.slot, live::PEER_CONS, w(pc));
        st.area.set_live(st.slot, live::RX_PROD, w(rp));
        st.area.set_live(st.slot, live::RX_CONS, w(rc));
        st.area.set_live(
            st.slot,
            live::FLAGS,
            u64::from(lf.bits()) | u64::from(pf.bits()) << 8 | self.linux_state() << 16,
        );
    }

    /// The reset to report, once: the peer aborted or the connection failed, and the
    /// application has not been told yet (later calls see EOF / EPIPE, as TCP after its
    /// error was collected).
    pub(crate) fn take_reset(&mut self) -> Option<io::Error> {
        if self.reset_reported {
            return None;
        }
        let why = if let Some(f) = &self.failed {
            f.to_string()
        } else if self
            .core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_ABORT)
        {
            "peer aborted the connection".to_owned()
        } else {
            return None;
        };
        self.reset_reported = true;
        Some(io::Error::new(io::ErrorKind::ConnectionReset, why))
    }
}

impl ConnShared {
    /// The connection of `token` on `lg` with its buffers (`sndbuf` as large as the peer's
    /// RMB), to the peer's end `peer` as its Accept or Confirm gave it; not attached yet.
    pub(crate) fn new(
        lg: &Arc<LinkGroup>,
        token: u32,
        rmb: Arc<MemoryRegion>,
        sndbuf: Arc<MemoryRegion>,
        peer: &handshake::Endpoint,
    ) -> Arc<Self> {
        let rmb_len = rmb.len() as u32;
        Arc::new(Self {
            token,
            rmb,
            sndbuf,
            core: Mutex::new(ConnState {
                // The key is for the peer's link of this connection, named by its QPN.
                peer: crate::rtokens::PeerRmb {
                    vaddr: peer.rmb_vaddr,
                    rkey: peer.rmb_rkey,
                    path: lg.path_of_peer_qpn(peer.qpn),
                },
                core: ConnCore::new(peer.token, peer.rmb_size.bytes(), rmb_len),
                failed: None,
                released: false,
                stats: ConnStats::default(),
                reset_reported: false,
                reported: None,
                arrivals: 0,
                stat: None,
                epoch: lg.route().0,
            }),
            cond: Condvar::new(),
            wakes: std::sync::atomic::AtomicU64::new(0),
            lg: Arc::downgrade(lg),
            events: [std::sync::OnceLock::new(), std::sync::OnceLock::new()],
            readiness: std::sync::OnceLock::new(),
        })
    }

    /// Most bytes held back while a CDC is in flight (Linux: min(sndbuf/2, autocorking_size
    /// 64 KiB)).
    pub(crate) fn cork_limit(&self) -> u32 {
        ((self.sndbuf.len() / 2) as u32).min(64 * 1024)
    }

    /// Waits for a change of this connection (data, room, a close, a failure), the caller
    /// holding its lock `s`: as the group's blocking driver if no other thread is (it then
    /// takes and handles the group's completions itself, see [`LinkGroup::drive_blocked`]),
    /// else on the condition variable, which that driver or the poller signals. `WouldBlock`
    /// if `nonblocking`, or when `deadline` passed with nothing new.
    pub(crate) fn wait(
        &self,
        lg: &Arc<LinkGroup>,
        s: &mut parking_lot::MutexGuard<'_, ConnState>,
        nonblocking: bool,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        if nonblocking {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // What this thread corked goes before it sleeps (rdma::cork).
        rdma::cork::end();
        if lg.claim_blocking_driver() {
            let seen = self.wakes.load(Ordering::Acquire);
            let changed = || self.wakes.load(Ordering::Acquire) != seen;
            parking_lot::MutexGuard::unlocked(s, || lg.drive_blocked(deadline, changed));
            // Woken by the group's next completions, handled on this thread; the caller checks
            // its condition again (a deadline passed with nothing new is a time-out).
            if !changed() && deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
            }
            return Ok(());
        }
        match deadline {
            Some(d) => {
                if self.cond.wait_until(s, d).timed_out() {
                    return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
                }
            }
            None => self.cond.wait(s),
        }
        Ok(())
    }

    /// Writes and announces the staged bytes (one or two RDMA WRITEs and a CDC); `pending` is
    /// what the writer has in all (for the "writing blocked" flag).
    pub(crate) fn flush_locked(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        pending: u32,
        poller: bool,
    ) -> Result<(), PostFailure> {
        self.flush_staged(s, lg, pending, poller, false)
    }

    /// Writes the staged bytes (unless `written`: already in the peer's RMB, see
    /// [`Self::write_direct`]) and announces them with a CDC.
    pub(super) fn flush_staged(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        pending: u32,
        poller: bool,
        written: bool,
    ) -> Result<(), PostFailure> {
        let staged = s.core.staged();
        if staged == 0 {
            return Ok(());
        }
        // The slot first: once the cursor has advanced, the CDC must go out.
        let slot = lg.take_slot(poller, self.token)?;
        let path = self.route(s, lg, slot, poller)?;
        let plan = s.core.prepare_write(staged, pending.max(staged));
        let (pieces, n) = nonempty(plan.pieces, !written);
        s.stats.bytes_sent += u64::from(staged);
        s.stats.data_cdcs += 1;
        if let Some(st) = s.stat.as_mut().filter(|st| !st.wrote) {
            st.wrote = true;
            let at = st.start.elapsed().as_nanos().max(1) as u64;
            st.area
                .set_live_once(st.slot, crate::stats::conn::live::FIRST_WRITE, at);
        }
        s.core.take_staged();
        s.publish();
        let writes = DataWrites {
            sndbuf: &self.sndbuf,
            pieces: &pieces[..n],
            peer: lg.peer_rmb(&mut s.peer, path),
            slack: plan.slack,
        };
        if lg.post_data(path, &writes, slot, &plan.cdc, plan.ack_now)? {
            // Completed when posted (same host): no completion will say so.
            let _ = s.core.cdc_completed();
        }
        Ok(())
    }

    /// The path this connection posts on now, holding `slot` (a SEND slot the caller took
    /// first, so the answer is still true when it posts). After a failover (a new epoch), the
    /// connection first moves there (under its lock, before anything else of it is posted
    /// there): Linux's validation CDC, every byte the peer has not consumed written again,
    /// then a CDC with the current cursors (see [`ConnCore::failover`]). A CDC of ours that
    /// announced bytes lost with the failed link can then never arrive before those bytes. A
    /// failed connection moves too (its abort or close CDC announces the same cursors); a
    /// released one posts nothing (its buffers may serve another connection). On an error
    /// `slot` is given back and the connection has failed.
    pub(crate) fn route(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        slot: usize,
        poller: bool,
    ) -> Result<usize, PostFailure> {
        let (epoch, path) = lg.route();
        if s.epoch == epoch {
            return Ok(path);
        }
        if s.released {
            lg.put_back(slot);
            return Err(PostFailure::Released);
        }
        if s.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_ABORT)
        {
            // The peer aborted: its RMB may already serve another of its connections, so
            // nothing is written again (Linux re-points such connections without a rewrite).
            s.epoch = epoch;
            return Ok(path);
        }
        let moved = (|| -> Result<(), PostFailure> {
            let second = lg.take_slot(poller, 0)?;
            let third = match lg.take_slot(poller, self.token) {
                Ok(x) => x,
                Err(e) => {
                    lg.put_back(second);
                    return Err(e);
                }
            };
            let f = s.core.failover();
            if let Err(e) = lg.post_cdc(path, second, &f.validation) {
                lg.put_back(third);
                return Err(e);
            }
            let (pieces, n) = nonempty(f.pieces, true);
            let writes = DataWrites {
                sndbuf: &self.sndbuf,
                pieces: &pieces[..n],
                peer: lg.peer_rmb(&mut s.peer, path),
                slack: 0,
            };
            if !lg.post_data(path, &writes, third, &f.cdc, true)? {
                s.core.failover_cdc_posted();
            }
            Ok(())
        })();
        match moved {
            Ok(()) => {
                // Moved: only now may its other messages go to this path.
                s.epoch = epoch;
                s.stats.failovers += 1;
                Ok(path)
            }
            Err(PostFailure::NoSlot) => {
                lg.put_back(slot);
                Err(PostFailure::NoSlot)
            }
            Err(e) => {
                lg.put_back(slot);
                s.failed.get_or_insert_with(|| ConnFailure::Move(e.clone()));
                s.publish();
                Err(e)
            }
        }
    }

    /// Sends a CDC of this connection (`m`, made under the same lock) on its path.
    pub(crate) fn send_ctl(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        m: &CdcMessage,
        poller: bool,
    ) -> Result<(), PostFailure> {
        let slot = lg.take_slot(poller, 0)?;
        let path = self.route(s, lg, slot, poller)?;
        lg.post_cdc(path, slot, m).map(drop)
    }

    /// Same-host links: writes `buf` straight into the peer's RMB where the next staged bytes
    /// would go (the peer reads nothing past the producer cursor we announced, and `buf` fits
    /// the free space) and announces it, with no copy through the send buffer. Returns false
    /// (nothing announced) when that cannot be done: bytes already staged or a CDC in flight
    /// (order), or a link on UDP.
    pub(crate) fn write_direct(
        &self,
        s: &mut ConnState,
        lg: &LinkGroup,
        buf: &[u8],
        pending: u32,
    ) -> io::Result<bool> {
        if s.core.staged() != 0 || s.core.inflight() != 0 || !lg.same_host() {
            return Ok(false);
        }
        let n = buf.len() as u32;
        let mut at = 0usize;
        for (off, len) in s.core.stage_pieces(0, n) {
            if len == 0 {
                continue;
            }
            let piece = &buf[at..at + len as usize];
            // Same-host groups have one path.
            if !lg.paths[0]
                .qp
                .write_direct(piece, s.peer.vaddr + u64::from(off), s.peer.rkey)
            {
                return Ok(false);
            }
            at += len as usize;
        }
        s.core.stage(n);
        self.flush_staged(s, lg, pending, false, true)?;
        Ok(true)
    }

    /// A data CDC of ours completed: when none is left in flight, post what was corked.
    pub(super) fn on_sent(&self, lg: &LinkGroup) {
        let mut s = self.core.lock();
        if s.core.cdc_completed() {
            drop(s);
            self.flush_corked(lg);
        }
    }

    pub(super) fn flush_corked(&self, lg: &LinkGroup) {
        let mut s = self.core.lock();
        if s.failed.is_some() || s.core.inflight() > 0 {
            return;
        }
        let pending = s.core.staged();
        match self.flush_locked(&mut s, lg, pending, true) {
            Ok(()) => {}
            Err(PostFailure::NoSlot) => {
                lg.st.lock().g.conns.defer_flush(self.token);
            }
            Err(e) => {
                s.failed.get_or_insert(ConnFailure::Post(e));
                s.publish();
                drop(s);
                self.wake();
            }
        }
    }

    /// Ends the connection because of the peer (bad cursors, urgent data): an abort CDC tells
    /// it, our application gets `ConnectionReset` with `why`.
    pub(crate) fn abort(&self, s: &mut ConnState, lg: &LinkGroup, why: ConnFailure) {
        s.failed = Some(why);
        let cdc = s.core.close_flags(ConnStateFlags::PEER_CONN_ABORT);
        s.publish();
        let _ = self.send_ctl(s, lg, &cdc, true);
    }

    pub(super) fn on_cdc(&self, lg: &LinkGroup, m: &CdcMessage) {
        let mut s = self.core.lock();
        if s.failed.is_some() {
            return;
        }
        if m.prod_flags
            .intersects(ProducerFlags::URG_DATA_PENDING | ProducerFlags::URG_DATA_PRESENT)
        {
            // Delivering the urgent byte inline would corrupt the stream for a program that
            // asked for it out of band: refuse clearly instead.
            self.abort(&mut s, lg, ConnFailure::UrgentData);
            drop(s);
            self.wake();
            return;
        }
        let before = s.core.readable();
        match s.core.on_cdc(m) {
            Ok(u) => {
                let now = s.core.readable();
                if now > before {
                    s.arrivals = s.arrivals.wrapping_add(1);
                    // Data that left no room in our RMB: the peer's next write waits for our
                    // reader (Linux's SMC_STAT_RMB_RX_FULL).
                    if now as usize >= self.rmb.len()
                        && let Some(st) = &s.stat
                    {
                        st.area
                            .count_conn(st.slot, crate::stats::conn::counter::RX_FULL);
                    }
                }
                if u.update_requested {
                    let cdc = s.core.control_cdc();
                    // The poller must not wait; a missed update is re-requested by the peer.
                    let _ = self.send_ctl(&mut s, lg, &cdc, true);
                }
            }
            Err(e) => {
                self.abort(&mut s, lg, ConnFailure::Protocol(e));
            }
        }
        s.publish();
        let both_closed = s.core.both_closed();
        drop(s);
        self.wake();
        if both_closed {
            self.release(lg);
        }
    }

    pub(super) fn fail(&self, reason: &GroupDown) {
        let mut s = self.core.lock();
        s.failed
            .get_or_insert_with(|| ConnFailure::Group(reason.clone()));
        s.publish();
        drop(s);
        self.wake();
    }

    /// Tells the readiness sink the current state if it changed (caller holds the lock).
    pub(crate) fn report(&self, s: &mut ConnState) {
        let Some(sink) = self.readiness.get() else {
            return;
        };
        let now = s
            .core
            .readiness(s.failed.is_some(), s.reset_reported, s.arrivals);
        if s.reported != Some(now) {
            s.reported = Some(now);
            sink.update(now);
        }
    }

    /// Wakes blocked readers and writers and signals the readiness fds.
    pub(crate) fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::AcqRel);
        if let Some(lg) = self.lg.upgrade() {
            lg.kick_blocking_driver();
        }
        if self.readiness.get().is_some() {
            let mut s = self.core.lock();
            self.report(&mut s);
        }
        self.cond.notify_all();
        for fd in self.events.iter().filter_map(std::sync::OnceLock::get) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes from a valid buffer to our eventfd; a full counter
            // (EAGAIN) already means "readable".
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }

    /// The readiness eventfd, created on first use (non-blocking, close-on-exec). It starts
    /// readable, so a first poll always tries the operation.
    pub(crate) fn readiness_fd(&self, write: bool) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::{AsFd, FromRawFd};
        let slot = &self.events[usize::from(write)];
        if slot.get().is_none() {
            // SAFETY: eventfd has no memory preconditions; the result is checked.
            let fd = unsafe { libc::eventfd(1, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a new fd nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // A concurrent caller may have won; its fd is kept, ours dropped.
            let _ = slot.set(fd);
        }
        Ok(slot.get().expect("set above").as_fd())
    }

    /// The application closed the connection: what is staged goes, then the close (or the
    /// abort: unread data, or SO_LINGER {on, 0} as `linger_zero` says, asked only when it
    /// matters); released once the peer closed too (here, or when its close comes).
    pub(crate) fn close(&self, lg: &LinkGroup, linger_zero: impl FnOnce() -> bool) {
        let mut s = self.core.lock();
        // Our stats record is freed after this (the stream's field drop): no update may
        // follow.
        s.stat = None;
        if !s.core.local_closed() {
            let staged = s.core.staged();
            let _ = self.flush_locked(&mut s, lg, staged, false);
            let linger_zero = s.core.readable() == 0 && linger_zero();
            if let Some(cdc) = s.core.close(linger_zero) {
                let _ = self.send_ctl(&mut s, lg, &cdc, false);
            }
        }
        let peer = s.core.peer_flags();
        let peer_gone = peer
            .intersects(ConnStateFlags::PEER_CONN_CLOSED | ConnStateFlags::PEER_CONN_ABORT)
            || s.failed.is_some();
        // The peer closed first and neither side aborted: ours is the passive close.
        let passive = peer.contains(ConnStateFlags::PEER_CONN_CLOSED)
            && !peer.contains(ConnStateFlags::PEER_CONN_ABORT)
            && s.failed.is_none()
            && !s
                .core
                .local_flags()
                .contains(ConnStateFlags::PEER_CONN_ABORT);
        drop(s);
        if passive {
            self.release_passive(lg);
        } else if peer_gone {
            self.release(lg);
        }
    }

    /// Detaches from the link group and gives the buffers back to it (once).
    pub(crate) fn release(&self, lg: &LinkGroup) {
        self.release_as(lg, false);
    }

    /// [`Self::release`] of a connection whose peer closed first (an orderly close): its
    /// TCP socket waits for the peer's to close (see [`LinkGroup::detach`]).
    pub(crate) fn release_passive(&self, lg: &LinkGroup) {
        self.release_as(lg, true);
    }

    fn release_as(&self, lg: &LinkGroup, passive: bool) {
        let mut s = self.core.lock();
        if s.released {
            return;
        }
        s.released = true;
        drop(s);
        lg.release_conn(self.token, passive, &self.rmb, &self.sndbuf);
    }
}

/// The non-empty pieces of a write (at most two: the ring wraps once), in order, on the
/// stack (no allocation per write); none unless `any`.
fn nonempty(pieces: [(u32, u32); 2], any: bool) -> ([(u32, u32); 2], usize) {
    let mut out = [(0, 0); 2];
    let mut n = 0;
    for p in pieces {
        if any && p.1 > 0 {
            out[n] = p;
            n += 1;
        }
    }
    (out, n)
}
