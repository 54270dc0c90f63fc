//! A link group's driver, part 3: who handles completions and when — the poller thread,
//! holds (an application thread driving the group instead of the poller), sleeping and
//! waking, and `handle`, which feeds completions to `GroupCore` and the connections.

#[allow(unused_imports)]
use super::*;

impl LinkGroup {
    pub(super) fn poll_loop(self: Arc<Self>) {
        let mut wcs = [WorkCompletion::EMPTY; 64];
        loop {
            let wait = {
                let next = self.st.lock().g.poll_timeout();
                // Nothing is due: sleep until something arrives (an idle program uses no
                // CPU); the cap only bounds what a missed wake-up could cost.
                let wait = next.map_or(IDLE_WAIT, |t| {
                    t.saturating_duration_since(self.clock.now()).min(IDLE_WAIT)
                });
                self.check_hold(wait)
            };
            // Sleep without taking completions: an application thread may take and handle
            // them first (`progress`), always under the driver lock, so they stay in order.
            if let Err(e) = self.drive.sched.wait_ready(Some(wait)) {
                self.fail(GroupDown::CompletionQueue(e.to_string()));
                self.release_hold();
                return;
            }
            // While an application thread drives the group, what arrives is its to take (it is
            // signalled, and sleeps until then): only the timers are ours. Woken with none due
            // (a kick: a holder came back), only the wait is recomputed, without the driver
            // lock: a driver's `progress` must not find it taken for nothing.
            if self.drive.sched.driven() && !self.timers_due(self.clock.now()) {
                continue;
            }
            let driver = self.drive.driver.lock();
            let n = if self.drive.sched.driven() {
                0
            } else {
                self.drive.cq.poll(&mut wcs)
            };
            if self.handle(&wcs[..n]) {
                drop(driver);
                self.release_hold();
                self.finish();
                return;
            }
        }
    }

    /// Whether one of the poller's timers (the link's, the linger) is due at `now`.
    pub(super) fn timers_due(&self, now: Instant) -> bool {
        self.st.lock().g.poll_timeout().is_some_and(|t| t <= now)
    }

    /// The poller stops (the group failed or was deleted): nobody will take the hold back, so
    /// it ends now; the device socket goes back to the engine thread for the other groups.
    pub(super) fn release_hold(&self) {
        let mut h = self.drive.hold.lock();
        if std::mem::take(&mut h.rx) {
            self.drive.sched.delegate_rx(false);
        }
        if std::mem::take(&mut h.held) {
            drop(h);
            self.drive.sched.end_drive();
        }
    }

    /// The completion queue's driver descriptor (see [`crate::Driver`]).
    pub(crate) fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.drive.sched.driver_fd()
    }

    /// The device socket the group's packets arrive on, unless it uses shared memory only
    /// (see [`crate::Driver::rx_fd`]).
    pub(crate) fn rx_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        // Without the hold the socket stays with the engine thread: a watcher would only race
        // it for packets.
        if self.drive.hold_for.is_zero() {
            return None;
        }
        self.drive.sched.rx_fd()
    }

    /// Receives what waits on the device socket, then handles the group's completions (see
    /// [`crate::Driver::receive`]).
    pub(crate) fn receive(self: &Arc<Self>) {
        // (A group on shared memory has nothing on the socket: no system call for nothing.)
        if !self.same_host() {
            self.drive.sched.receive();
        }
        self.progress();
    }

    /// For a thread about to sleep in its own wait on [`Self::event_fd`] (an epoll set):
    /// starts a drive and says it sleeps. `false`: something is there already — it was
    /// handled and the drive ended; check readiness without sleeping. Either way the group
    /// stays held for the thread's next wait (see [`Hold`]).
    ///
    /// `rx`: the caller's wait also watches [`Self::rx_fd`] (edge-triggered) and calls
    /// [`Self::receive`] when it fires; then the group's packets wake it directly.
    pub(crate) fn sleep_begin(self: &Arc<Self>, rx: bool) -> bool {
        self.drive.sched.begin_drive();
        let hold = !self.drive.hold_for.is_zero();
        let mut fresh = false;
        if hold {
            let mut h = self.drive.hold.lock();
            // A group that is down has no poller left to take a hold back (`release_hold`);
            // read under the hold's lock, which `release_hold` takes after the group went down.
            if !self.down.load(Ordering::Acquire) {
                if !h.held {
                    h.held = true;
                    fresh = true;
                    self.drive.sched.begin_drive();
                }
                if rx && !h.rx && !self.same_host() {
                    h.rx = true;
                    self.drive.sched.delegate_rx(true);
                }
            }
            h.last = Instant::now();
        }
        // The spin comes before the loop counts as asleep: a poller that looked meanwhile
        // would go to its long timer and have to be kicked when the spin catches something
        // (a wake-up of the poller per message of a busy stream).
        if self.drive.sched.drive_spin(rx) {
            if fresh {
                // The poller may have gone to its long timer while the group was not held,
                // and this return has no `hold_woke`: it must watch the hold now, or a holder
                // that does not come back (its next wait drives another group) leaves what
                // arrives next unhandled until that timer. (A wait that sleeps kicks it when
                // it wakes; kicking it here too would wake it as the loop goes to sleep.)
                self.poller_watches(&mut self.drive.hold.lock(), Instant::now());
            }
            self.progress();
            self.drive.sched.end_drive();
            return false;
        }
        if hold {
            self.drive.hold.lock().sleeping += 1;
        }
        if self.drive.sched.drive_sleep(true) {
            self.hold_woke();
            // Handled within the drive: ending it with completions left would signal this
            // thread's own next wait for nothing.
            self.progress();
            self.drive.sched.end_drive();
            return false;
        }
        true
    }

    /// Ends what [`Self::sleep_begin`] started (after the wait returned).
    pub(crate) fn sleep_end(self: &Arc<Self>, slept: Duration, woken: bool) {
        self.drive.sched.drive_sleep(false);
        if woken {
            self.drive.sched.drive_woke_after(slept);
        }
        self.hold_woke();
        // What woke the wait is handled now, within the drive: a drive that ends with it left
        // signals the drivers, i.e. this thread's own next wait, for nothing (a system call
        // and a wait that returns at once, per wake-up).
        self.progress();
        self.drive.sched.end_drive();
    }

    /// A holder's sleep ended: the poller, if it went to its long timer meanwhile, must watch
    /// the hold again.
    pub(super) fn hold_woke(&self) {
        if self.drive.hold_for.is_zero() {
            return;
        }
        let mut h = self.drive.hold.lock();
        h.sleeping = h.sleeping.saturating_sub(1);
        self.poller_watches(&mut h, Instant::now());
    }

    /// Kicks the poller if it sleeps past `hold_for` from `now`: it looks at the hold again
    /// (`check_hold`). Under the hold lock (`h`), which `check_hold` sets `poller_until` under.
    fn poller_watches(&self, h: &mut Hold, now: Instant) {
        if h.seen(now, self.drive.hold_for) {
            self.drive.sched.kick();
        }
    }

    /// The poller's look at the hold before it sleeps for at most `wait` (`Hold::look`): takes
    /// the group back from holders away longer than `hold_for`; returns how long to sleep.
    pub(super) fn check_hold(&self, wait: Duration) -> Duration {
        if self.drive.hold_for.is_zero() {
            return wait;
        }
        let mut h = self.drive.hold.lock();
        let look = h.look(Instant::now(), wait, self.drive.hold_for);
        if look.taken_back {
            if look.rx_back {
                self.drive.sched.delegate_rx(false);
            }
            // What arrived meanwhile is signalled to the poller (us) now.
            self.drive.sched.end_drive();
        }
        look.wait
    }

    /// A thread blocked in a read or write (until `deadline`) waits for the group's next
    /// completions and handles them itself, so the message it waits for costs one wake-up (its
    /// own) instead of two (the poller's, then its own). Returns false if another thread is
    /// the blocking driver already (then wait on the condition variable: it handles ours too).
    ///
    /// `changed` says whether the caller's condition may have changed since it checked it
    /// (another thread handled something for it meanwhile): then it does not sleep.
    ///
    /// Call it only after [`Self::claim_blocking_driver`] returned true (it gives the claim
    /// back): the claim is taken while the caller still holds its connection's lock, so a
    /// thread that does not get it waits on its condition variable without a gap in which a
    /// wake-up could pass unseen.
    pub(crate) fn drive_blocked(
        self: &Arc<Self>,
        deadline: Option<Instant>,
        changed: impl Fn() -> bool,
    ) {
        /// Ends the drive and gives the role back however this function is left (a panic in
        /// `handle` must not leave the group driven: the poller would never take completions).
        struct Drive<'a>(&'a LinkGroup);
        impl Drop for Drive<'_> {
            fn drop(&mut self) {
                self.0.drive.sched.end_drive();
                self.0.drive.blocking_driver.store(false, Ordering::Release);
                DRIVING.with(|d| d.set(false));
            }
        }
        DRIVING.with(|d| d.set(true));
        self.drive.sched.begin_drive();
        let _drive = Drive(self);
        // The poller takes no new batch now; waiting for the driver lock lets it finish the
        // one it may be handling, so `changed` sees its effect.
        self.handle_queued();
        if !changed() {
            // Capped: a wake-up lost to a bug would cost a second, not the connection.
            let cap = Duration::from_secs(1);
            let timeout = deadline.map_or(cap, |d| {
                d.saturating_duration_since(Instant::now()).min(cap)
            });
            // An error of the CQ wait is the poller's to report; this thread just goes on.
            let _ = self.drive.sched.drive_wait(Some(timeout));
            self.handle_queued();
        }
    }

    /// Wakes whoever sleeps on the group's driver descriptor (see [`crate::Driver::kick`]).
    pub(crate) fn kick_drivers(&self) {
        self.drive.sched.kick_driver();
    }

    /// Wakes the blocking driver, if there is one and it is not this thread's own handling
    /// (its sleep ends; it re-checks its condition).
    pub(crate) fn kick_blocking_driver(&self) {
        if self.drive.blocking_driver.load(Ordering::Acquire) && !DRIVING.with(|d| d.get()) {
            self.drive.sched.kick_driver();
        }
    }

    /// Claims the group's blocking driver role (see [`Self::drive_blocked`]); false if another
    /// thread has it or the group is down.
    pub(crate) fn claim_blocking_driver(&self) -> bool {
        !self.down.load(Ordering::Acquire)
            && !self.drive.blocking_driver.swap(true, Ordering::AcqRel)
    }

    /// Takes and handles what the completion queue holds, under the driver lock.
    pub(super) fn handle_queued(self: &Arc<Self>) {
        let _driver = self.drive.driver.lock();
        self.handle_batches(usize::MAX);
    }

    /// Takes and handles up to `batches` batches of completions (the driver lock held);
    /// stops early when the queue is empty or the group failed.
    pub(super) fn handle_batches(self: &Arc<Self>, batches: usize) {
        let mut wcs = [WorkCompletion::EMPTY; 64];
        for _ in 0..batches {
            let n = self.drive.cq.poll(&mut wcs);
            if n == 0 || self.handle(&wcs[..n]) {
                return;
            }
        }
    }

    /// Handles what an application thread finds in the completion queue, if no other thread
    /// is doing so (never blocks): the CDC that makes its socket readable is then handled
    /// on its own thread, without waiting for the poller to wake.
    pub(crate) fn progress(self: &Arc<Self>) {
        if !self.drive.hold_for.is_zero() {
            // A loop came by (an `epoll_wait` that does not sleep, too): the hold stays.
            let mut h = self.drive.hold.lock();
            if h.held {
                h.last = Instant::now();
            }
        }
        let Some(_driver) = self.drive.driver.try_lock() else {
            return;
        };
        self.handle_batches(16);
    }

    /// Handles completions (CDCs, LLC messages, SEND completions), runs the link's timers and
    /// wakes connections. Called with the driver lock held. Returns true once the group failed.
    pub(super) fn handle(self: &Arc<Self>, wcs: &[WorkCompletion]) -> bool {
        if !self.shown_shm.load(Ordering::Relaxed) && self.same_host_now() {
            // The switch to shared memory happens once the first UDP exchanges are
            // acknowledged: show it (whichever thread handles completions then).
            self.shown_shm.store(true, Ordering::Relaxed);
            let up = self.st.lock().g.is_up();
            self.publish(if up {
                crate::stats::lg::LINK_ACTIVE
            } else {
                crate::stats::lg::LINK_ACTIVATING
            });
        }
        let now = self.clock.now();
        // The thread's scratch lists (kept between calls: no allocation per batch).
        // (Not there during the thread's exit, e.g. the program's `exit()` ending our groups on
        // its main thread after its thread-locals went: then fresh ones.)
        let (mut cdcs, mut sent) = SCRATCH.try_with(std::cell::Cell::take).unwrap_or_default();
        // Connections whose data CDC's SEND completed (with its sequence number) or was
        // flushed by a failed link (none).
        let unmoved = {
            let mut guard = self.st.lock();
            let st = &mut *guard;
            // Receive slots to post again: once per batch and path (one lock and drive of
            // the queue pair) rather than per message, at most a quarter of the RECV_SLOTS at
            // a time, so the peer never waits for one meanwhile.
            let mut repost = Reposts::new();
            for wc in wcs {
                let path = self.path_of(wc.qp_num);
                if wc.status != WcStatus::Success {
                    if st.g.is_live(path) {
                        st.g.transport_failed(path, &self.failure_cause(path, wc.status));
                    }
                    // A SEND flushed by a failed link frees its slot (and its connection's
                    // count of CDCs in flight); a surviving link carries on. Known by its
                    // `wr_id`: an error completion's opcode is undefined (see RECV_TAG).
                    if wc.wr_id & RECV_TAG == 0 && (wc.wr_id as usize) < SEND_SLOTS {
                        self.sent_on(path, wc.wr_id as usize);
                        if let Some(c) = st.g.conns.complete(wc.wr_id as usize) {
                            sent.push((c, None));
                        }
                        self.cond.notify_all();
                    }
                    continue;
                }
                match wc.opcode {
                    WcOpcode::Recv => {
                        let slot = (wc.wr_id & !RECV_TAG) as usize;
                        let p = &self.paths[path];
                        let len = (wc.byte_len as usize).min(SLOT);
                        let mut b = [0u8; SLOT];
                        self.slots.recv_mr.read(slot * SLOT, &mut b[..len]);
                        // An LLC message longer than a slot (ADD LINK with many rkeys).
                        let long = match &p.big {
                            Some(big) if wc.byte_len as usize > SLOT => {
                                let n = (wc.byte_len as usize).min(LLC_MAX);
                                let mut v = vec![0u8; n];
                                v[..SLOT].copy_from_slice(&b);
                                big.read(0, &mut v[SLOT..]);
                                Some(v)
                            }
                            _ => None,
                        };
                        repost.add(self, path, slot);
                        if b[0] == cdc::CDC_TYPE {
                            // CDCs count on any link (Linux accepts them on each).
                            st.g.note_activity(path, now);
                            match CdcMessage::parse(&b[..len]) {
                                // Linux drops CDCs for unknown tokens too.
                                Ok(m) => {
                                    if let Route::Conn(c) = st.g.conns.route(m) {
                                        cdcs.push((c, m));
                                    }
                                }
                                Err(_) => st.g.bad_cdc(now),
                            }
                        } else {
                            st.g.handle_llc(path, long.as_deref().unwrap_or(&b[..len]), now);
                        }
                    }
                    WcOpcode::Send => {
                        let slot = wc.wr_id as usize;
                        self.sent_on(path, slot);
                        if let Some(c) = st.g.conns.complete(slot) {
                            // A data CDC: its sequence number is what a failover validates
                            // (groups that can fail over only).
                            let seq = (self.paths.len() > 1).then(|| {
                                let mut b = [0u8; cdc::CDC_LEN];
                                self.slots.send_mr.read(slot * SLOT, &mut b);
                                CdcMessage::parse(&b).ok().map(|m| m.seq)
                            });
                            sent.push((c, seq.flatten()));
                        }
                        self.cond.notify_all();
                    }
                    _ => {}
                }
            }
            repost.flush(self);
            // (The linger timer too: the group's state machine deletes an idle group.)
            self.run_links(st, now);
            st.g.take_unmoved()
        };
        for (c, m) in cdcs.drain(..) {
            c.on_cdc(self, &m);
        }
        let retry: Vec<Arc<ConnShared>> = { self.st.lock().g.conns.take_deferred() };
        for (c, seq) in sent.drain(..) {
            if let Some(seq) = seq {
                c.core.lock().core.cdc_done(seq);
            }
            c.on_sent(self);
        }
        let _ = SCRATCH.try_with(|s| s.set((cdcs, sent)));
        for c in retry {
            c.flush_corked(self);
        }
        if unmoved {
            // A link failed: its requests were flushed into the completion queue. Take them
            // first (their SEND slots, the connections' counts, what completed before), then
            // move every connection to the surviving link.
            let mut more = [WorkCompletion::EMPTY; 64];
            loop {
                let n = self.drive.cq.poll(&mut more);
                if n == 0 {
                    break;
                }
                if self.handle(&more[..n]) {
                    return true;
                }
            }
            self.move_conns();
        }
        let down = self.st.lock().g.down().cloned();
        if let Some(r) = down {
            self.fail(r);
            return true;
        }
        false
    }
}

/// Receive slots taken by a batch, to post again together (see `handle`): a run of one
/// path's slots (a batch is usually all one link's), posted when it is full or the path
/// changes.
struct Reposts {
    path: usize,
    slots: [usize; Path::POST_MAX],
    n: usize,
}

impl Reposts {
    fn new() -> Self {
        Self {
            path: 0,
            slots: [0; Path::POST_MAX],
            n: 0,
        }
    }

    /// Slot `slot` of path `path` was read: it goes back.
    fn add(&mut self, lg: &LinkGroup, path: usize, slot: usize) {
        if self.n == Path::POST_MAX || (self.n > 0 && path != self.path) {
            self.flush(lg);
        }
        self.path = path;
        self.slots[self.n] = slot;
        self.n += 1;
    }

    /// Posts the run.
    fn flush(&mut self, lg: &LinkGroup) {
        if self.n > 0 {
            let _ = lg.paths[self.path].post_recvs(&lg.slots.recv_mr, &self.slots[..self.n]);
            self.n = 0;
        }
    }
}

/// CDCs received and SENDs completed in one batch, by connection.
type Batch = (
    Vec<(Arc<ConnShared>, CdcMessage)>,
    Vec<(Arc<ConnShared>, Option<u16>)>,
);

thread_local! {
    /// `handle`'s lists, reused by each thread that handles completions (emptied before they
    /// are put back, so they hold no connection).
    static SCRATCH: std::cell::Cell<Batch> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}
