//! A link group's driver, part 4: carrying out the group's events (`GroupEvent`: queue
//! pairs, failover, ADD LINK setup), moving connections after a failover, buffers and rkey
//! flows, failing, draining and deleting the group.

#[allow(unused_imports)]
use super::*;

impl LinkGroup {
    /// Runs the group's timers and handles what its links reported (a failover, an added
    /// link, the group down: see [`GroupEvent`]), then sends what their LLC queued.
    pub(super) fn run_links(&self, st: &mut LgState, now: Instant) {
        if self.paths.len() > 1 && self.same_host_now() {
            st.g.set_same_host();
        }
        st.g.handle_timeout(now);
        self.on_group_events(st, now);
        self.flush_llc(st);
    }

    /// Carries out what the group's state machine asks for (queue pairs to stop or connect,
    /// a failover to publish, waiters to wake).
    pub(super) fn on_group_events(&self, st: &mut LgState, now: Instant) {
        while let Some(ev) = st.g.poll_event() {
            match ev {
                GroupEvent::Up { link_id } => {
                    log::info!(
                        "link group {} ({}): link {link_id} up (CONFIRM LINK done)",
                        self.id,
                        self.peer_text()
                    );
                    self.link_id.store(u32::from(link_id), Ordering::Relaxed);
                    self.publish(crate::stats::lg::LINK_ACTIVE);
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.links_confirmed.fetch_add(1, Ordering::Relaxed);
                    }
                    self.cond.notify_all();
                }
                GroupEvent::SpareUp { .. } => {
                    log::info!(
                        "link group {} ({}): second link up (ADD LINK done)",
                        self.id,
                        self.peer_text()
                    );
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.links_confirmed.fetch_add(1, Ordering::Relaxed);
                    }
                    // (Whoever waits for the group's links.)
                    self.cond.notify_all();
                }
                GroupEvent::RkeyDone { .. } => {
                    self.cond.notify_all();
                }
                GroupEvent::PeerConfirmedRkey { path, rkey } => {
                    // A new RMB's key on each link (Linux's differ per link).
                    self.rtokens
                        .lock()
                        .confirm(path, &rkey, |id| st.g.path_of_link(id));
                }
                GroupEvent::PeerDeletedRkeys { path, rkeys } => {
                    self.rtokens.lock().delete(path, &rkeys);
                }
                GroupEvent::PathError(path) => {
                    log::warn!(
                        "link group {} ({}): path {path} failed; its queue pair is stopped",
                        self.id,
                        self.peer_text()
                    );
                    if let Some(p) = self.paths.get(path) {
                        let _ = p.qp.modify(&QpAttr::state(QpState::Error));
                    }
                    self.cond.notify_all();
                }
                GroupEvent::PrepareAddLink { path, link_id } => {
                    let req = match self.rkey_pairs(st) {
                        None => Err("too many RMBs for one ADD LINK".to_string()),
                        Some(rkeys) => match self.paths[path].reset(&self.slots.recv_mr) {
                            Ok(()) => Ok(self.add_link_msg(path, link_id, self.mtu, rkeys)),
                            Err(e) => Err(format!("queue pair not reset: {e}")),
                        },
                    };
                    match req {
                        Ok(req) => st.g.add_link_request(req, now),
                        Err(why) => {
                            log::info!(
                                "link group {} ({}): no ADD LINK on path {path} now: {why}",
                                self.id,
                                self.peer_text()
                            );
                            st.g.add_link_failed(now)
                        }
                    }
                }
                GroupEvent::ConnectAdded { path, resp } => {
                    let mtu = smaller_mtu(resp.mtu, self.mtu);
                    let ok = match resp.gid.to_ipv4() {
                        None => Err("the peer's GID is no IPv4 address".to_string()),
                        Some(ip) => self.paths[path]
                            .connect(ip, resp.qpn, resp.initial_psn, mtu, self.peer_port(), true)
                            .map_err(|e| e.to_string()),
                    };
                    if let Err(why) = &ok {
                        log::info!(
                            "link group {} ({}): the added link on path {path} not connected: {why}",
                            self.id,
                            self.peer_text()
                        );
                    }
                    let ok = ok.is_ok();
                    if ok {
                        self.learn_rkeys(path, resp.v2.as_ref());
                    }
                    st.g.added_link_connected(path, resp.link_id, ok, now);
                }
                GroupEvent::AnswerAddLink { path, req } => {
                    let mtu = smaller_mtu(req.mtu, self.mtu);
                    let rkeys = self.rkey_pairs(st);
                    let set_up = match (&rkeys, req.gid.to_ipv4()) {
                        (None, _) => Err("too many RMBs for one ADD LINK".to_string()),
                        (_, None) => Err("the peer's GID is no IPv4 address".to_string()),
                        (Some(_), Some(ip)) => {
                            let p = &self.paths[path];
                            p.reset(&self.slots.recv_mr)
                                .and_then(|()| {
                                    p.connect(
                                        ip,
                                        req.qpn,
                                        req.initial_psn,
                                        mtu,
                                        self.peer_port(),
                                        true,
                                    )
                                })
                                .map_err(|e| e.to_string())
                        }
                    };
                    if let Err(why) = &set_up {
                        log::info!(
                            "link group {} ({}): ADD LINK on path {path} refused: {why}",
                            self.id,
                            self.peer_text()
                        );
                    }
                    let set_up = set_up.is_ok();
                    let resp = match (rkeys, set_up) {
                        (Some(rkeys), true) => {
                            self.learn_rkeys(path, req.v2.as_ref());
                            Some(self.add_link_msg(path, req.link_id, mtu, rkeys))
                        }
                        _ => None,
                    };
                    st.g.answer_add_link(path, resp, now);
                }
                GroupEvent::Failover {
                    epoch,
                    active,
                    link_id,
                } => {
                    log::warn!(
                        "link group {} ({}): failover to link {link_id} (path {active}, epoch {epoch})",
                        self.id,
                        self.peer_text()
                    );
                    self.link_id.store(u32::from(link_id), Ordering::Relaxed);
                    self.route
                        .store(u64::from(epoch) << 8 | active as u64, Ordering::Release);
                    if let Some(rt) = self.runtime.upgrade() {
                        rt.failovers.fetch_add(1, Ordering::Relaxed);
                        if let Some(a) = &rt.stats {
                            a.count(crate::stats::total::LINK_FAILOVERS);
                        }
                    }
                    crate::metrics::link_failover();
                    self.publish(crate::stats::lg::LINK_ACTIVE);
                }
                // `handle` fails the group and its connections once it is down.
                GroupEvent::Down(_) => {}
            }
        }
    }

    /// Our RMBs (in use and pooled) as ADD LINK's rkey entries: the same key and address on
    /// both links (one protection domain). `None` when they do not fit one message.
    pub(super) fn rkey_pairs(&self, st: &LgState) -> Option<Vec<llc::RkeyPair>> {
        let mut pairs: Vec<llc::RkeyPair> =
            st.g.conns
                .conns()
                .iter()
                .map(|c| c.rmb.clone())
                .chain(st.rmb_pool.iter().cloned())
                .map(|m| llc::RkeyPair {
                    rkey: m.rkey(),
                    rkey_new: m.rkey(),
                    vaddr_new: m.addr(),
                })
                .collect();
        pairs.sort_by_key(|p| p.rkey);
        pairs.dedup_by_key(|p| p.rkey);
        (pairs.len() <= ADD_LINK_MAX_RKEYS).then_some(pairs)
    }

    /// The peer's RMB keys on the link being added on `spare`, from its ADD LINK.
    pub(super) fn learn_rkeys(&self, spare: usize, v2: Option<&llc::AddLinkV2Ext>) {
        if let Some(x) = v2 {
            self.rtokens.lock().add_link(1 - spare, spare, &x.rkeys);
        }
    }

    /// ADD LINK for our side of a link on `path` (its address, QP and PSN), with `rkeys` (the
    /// request; `LinkCore` marks an answer as the response).
    pub(super) fn add_link_msg(
        &self,
        path: usize,
        link_id: u8,
        mtu: QpMtu,
        rkeys: Vec<llc::RkeyPair>,
    ) -> llc::AddLink {
        let p = &self.paths[path];
        let gid = Gid::from_ipv4(p.src);
        llc::AddLink {
            response: false,
            reject: false,
            reject_reason: 0,
            mac: self.dev.mac,
            gid,
            qpn: p.qp.qp_num(),
            link_id,
            mtu,
            initial_psn: p.psn.load(Ordering::Relaxed),
            v2: Some(llc::AddLinkV2Ext {
                v2_direct: true,
                target_gid: gid,
                rkeys,
            }),
        }
    }

    /// The peer's RoCE port.
    pub(super) fn peer_port(&self) -> u16 {
        self.runtime.upgrade().map_or(4791, |rt| rt.cfg.roce_port)
    }

    /// After a failover: every connection moves to the active link (one that cannot now —
    /// no SEND slot — is tried again at the next completion, and moves itself before it
    /// posts anything).
    pub(super) fn move_conns(&self) {
        let conns = self.st.lock().g.conns.conns();
        let mut left = false;
        let epoch = self.route().0;
        for c in conns {
            // A thread holding the connection may be waiting for a SEND slot, which only the
            // driver (us) frees: never wait for it here; it moves itself before it posts.
            let Some(mut s) = c.core.try_lock() else {
                left = true;
                continue;
            };
            if s.released || s.epoch == epoch {
                continue;
            }
            // `route` wants a slot held for the caller's own message; there is none here.
            let moved = self.take_slot(true, 0).and_then(|slot| {
                c.route(&mut s, self, slot, true)
                    .map(|_| self.put_back(slot))
            });
            match moved {
                Ok(()) => {}
                Err(PostFailure::NoSlot) => left = true,
                Err(_) => {
                    // `route` recorded why.
                    drop(s);
                    c.wake();
                }
            }
        }
        if left {
            self.st.lock().g.set_unmoved();
        }
    }

    /// An RMB of `size` bytes for a new connection: a free one from the pool, else a new
    /// registration within the runtime's budget.
    pub(crate) fn take_rmb(&self, size: u32) -> Result<Arc<MemoryRegion>, clc::DeclineReason> {
        {
            let mut st = self.st.lock();
            if let Some(i) = st
                .rmb_pool
                .iter()
                .position(|m| m.len() == size as usize && Arc::strong_count(m) == 1)
            {
                return Ok(st.rmb_pool.swap_remove(i));
            }
        }
        let rt = self.runtime.upgrade().ok_or(clc::DeclineReason::INTERR)?;
        if !rt.reserve_rmb(size) {
            return Err(clc::DeclineReason::MEM);
        }
        match self
            .slots
            .pd
            .reg_mr(size as usize, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        {
            Ok(mr) => Ok(Arc::new(mr)),
            Err(e) => {
                rt.release_rmb(size);
                rt.note(pinning_note("RMB", &e));
                Err(clc::DeclineReason::MEM)
            }
        }
    }

    /// A send buffer of `size` bytes (the peer's RMB size), pooled like RMBs.
    pub(crate) fn take_sndbuf(&self, size: u32) -> io::Result<Arc<MemoryRegion>> {
        {
            let mut st = self.st.lock();
            if let Some(i) = st
                .sndbuf_pool
                .iter()
                .position(|m| m.len() == size as usize && Arc::strong_count(m) == 1)
            {
                return Ok(st.sndbuf_pool.swap_remove(i));
            }
        }
        Ok(Arc::new(
            self.slots.pd.reg_mr(size as usize, Access::LOCAL_WRITE)?,
        ))
    }

    /// Announces a connection's RMB on this existing group with CONFIRM RKEY and waits for the
    /// peer's answer, as Linux does before its Accept/Confirm (`smcr_lgr_reg_rmbs`).
    pub(crate) fn confirm_rkey(&self, rmb: &MemoryRegion) -> io::Result<()> {
        loop {
            let epoch = self.route().0;
            match self.confirm_rkey_once(rmb) {
                // The link it went on failed meanwhile (the group survived on the other):
                // ask again there.
                Err(_) if self.route().0 != epoch && !self.is_down() => {}
                r => return r,
            }
        }
    }

    pub(super) fn confirm_rkey_once(&self, rmb: &MemoryRegion) -> io::Result<()> {
        let mut guard = self.st.lock();
        if guard.confirmed.contains(&rmb.rkey()) {
            // A pooled RMB the peer still knows (`rkey_reuse`).
            return Ok(());
        }
        if self.rkey_reuse && self.peer_is_our_engine() {
            // The peer is our engine (it proved it for shared memory), whose RMBs keep one key
            // on every link: what CONFIRM RKEY would tell it, the CLC message it gets anyway
            // carries (`rtokens`: every translation is the identity), and an ADD LINK lists
            // all our RMBs. Counted as confirmed, so that its end sends no DELETE RKEY either.
            // (A burst of connections paid one serialised LLC round trip each, both sides.)
            guard.confirmed.insert(rmb.rkey());
            return Ok(());
        }
        let st = &mut *guard;
        // The link answers every request (the peer's answer, its LLC_WAIT timer once sent,
        // or the link going down), one request at a time: ours may wait behind the others
        // (many connections set up at once over a slow path). The deadline only bounds a
        // bug. (Was LLC_WAIT + 1 s from now: 65 connections at once over a 20 ms path timed
        // out in the queue and deleted a healthy group.)
        let (id, backlog) = match st.g.confirm_rkey(rmb.rkey(), rmb.addr(), self.clock.now()) {
            Ok(started) => started,
            Err(RkeyError::NoLink) => return Err(SetupError::LinkNotStarted.into()),
            Err(RkeyError::Down(why)) => return Err(SetupError::Group(why).into()),
        };
        self.count_rkey_request();
        self.flush_llc(st);
        let deadline = Instant::now() + link::LLC_WAIT * backlog + Duration::from_secs(1);
        loop {
            if let Some(ok) = guard.g.take_rkey_result(id) {
                return if ok {
                    if self.rkey_reuse {
                        guard.confirmed.insert(rmb.rkey());
                    }
                    Ok(())
                } else {
                    Err(SetupError::RkeyRefused.into())
                };
            }
            if let Some(r) = guard.g.down() {
                return Err(SetupError::Group(r.clone()).into());
            }
            if self.cond.wait_until(&mut guard, deadline).timed_out() {
                guard.g.forget_rkey(id);
                return Err(SetupError::RkeyTimeout.into());
            }
        }
    }

    /// Whether a path's peer proved itself for shared memory: only our engine makes that
    /// exchange.
    fn peer_is_our_engine(&self) -> bool {
        self.paths.iter().any(|p| p.qp.peer_is_our_engine())
    }

    pub(super) fn count_rkey_request(&self) {
        if let Some(rt) = self.runtime.upgrade() {
            rt.rkey_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An RMB taken for a connection whose setup failed: back to the pool, or its budget back
    /// to the runtime when the group is not usable.
    pub(crate) fn give_back(&self, rmb: Arc<MemoryRegion>) {
        let mut st = self.st.lock();
        if st.g.link_params().is_some() && st.g.down().is_none() {
            st.rmb_pool.push(rmb);
        } else if let Some(rt) = self.runtime.upgrade() {
            rt.release_rmb(rmb.len() as u32);
        }
    }

    /// A send buffer taken for a connection that was not made: kept for later ones while
    /// the group lives.
    pub(crate) fn give_back_sndbuf(&self, sndbuf: Arc<MemoryRegion>) {
        let mut st = self.st.lock();
        if st.g.link_params().is_some() && st.g.down().is_none() {
            st.sndbuf_pool.push(sndbuf);
        }
    }

    /// Connection `token` is gone (see [`ConnShared::release`]): it leaves the group, and its
    /// buffers stay for later connections (its RMB's rkey withdrawn with DELETE RKEY, not
    /// waited for, unless the peer keeps it: `rkey_reuse`), in one step under the group's
    /// lock: whoever finds the connection gone finds its buffers back. `passive`: see
    /// [`Self::detach`].
    pub(super) fn release_conn(
        &self,
        token: u32,
        passive: bool,
        rmb: &Arc<MemoryRegion>,
        sndbuf: &Arc<MemoryRegion>,
    ) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        st.g.conns.detach(token, self.clock.now());
        let w = st.watch.remove(&token);
        self.publish_conns(st);
        if st.g.down().is_some() {
            if let Some(rt) = self.runtime.upgrade() {
                rt.release_rmb(rmb.len() as u32);
            }
        } else {
            if self.rkey_reuse && !st.confirmed.contains(&rmb.rkey()) && self.peer_is_our_engine() {
                // (The first contact's RMB.) Our engine keeps it as it keeps a confirmed one.
                st.confirmed.insert(rmb.rkey());
            }
            if !st.confirmed.contains(&rmb.rkey()) && st.g.delete_rkey(rmb.rkey(), self.clock.now())
            {
                self.count_rkey_request();
            }
            self.flush_llc(st);
            st.rmb_pool.push(rmb.clone());
            st.sndbuf_pool.push(sndbuf.clone());
        }
        self.cond.notify_all();
        drop(guard);
        match w {
            Some(w) if passive => w.close_after_peer(),
            _ => drop(w),
        }
    }

    /// The peer, for log lines: its first path's address.
    pub(super) fn peer_text(&self) -> String {
        let ip = self.paths[0].peer_ip.load(Ordering::Relaxed);
        format!("peer {}", std::net::Ipv4Addr::from(ip))
    }

    /// Marks the group down and fails every connection on it. The connections learn the
    /// group's first reason (a later one is the same failure seen again).
    pub(crate) fn fail(&self, reason: GroupDown) {
        let first = !self.down.swap(true, Ordering::AcqRel);
        self.publish(crate::stats::lg::LINK_INACTIVE);
        let (conns, reason) = {
            let mut st = self.st.lock();
            let reason = st.g.fail(reason).clone();
            if first {
                let level = if reason.orderly() {
                    log::Level::Info
                } else {
                    log::Level::Warn
                };
                log::log!(
                    level,
                    "link group {} ({}) down: {reason}",
                    self.id,
                    self.peer_text()
                );
            }
            self.cond.notify_all();
            if let Some(rt) = self.runtime.upgrade() {
                for mr in st.rmb_pool.drain(..) {
                    rt.release_rmb(mr.len() as u32);
                }
            }
            st.sndbuf_pool.clear();
            let conns = st.g.conns.drain();
            self.publish_conns(&st);
            (conns, reason)
        };
        if let Some(s) = &self.stat {
            s.release();
        }
        for c in conns {
            c.fail(&reason);
            // A connection its application already closed waits for the peer's close to be
            // released; that will not come now: release it here, or its RMB's share of the
            // budget would stay counted for good (the stream is gone, nobody else will).
            let closed = c.core.lock().core.local_closed();
            if closed {
                c.release(self);
            }
        }
        let orderly = self.st.lock().g.orderly();
        for (i, p) in self.paths.iter().enumerate() {
            // After our own DELETE LINK the active link still delivers what was posted
            // (`finish`); every other queue pair stops now.
            if !orderly || i != self.active() {
                let _ = p.qp.modify(&QpAttr::state(QpState::Error));
            }
        }
    }

    /// The poller's last act: after our own DELETE LINK, waits (bounded by the transport's
    /// retries) until the peer has acknowledged everything posted, so closing a connection
    /// and deleting the group right after it (a process that ends) loses nothing in flight;
    /// then the queue pair fails.
    pub(super) fn finish(self: &Arc<Self>) {
        if self.st.lock().g.orderly() {
            let deadline = Instant::now() + DRAIN_WAIT;
            let qp = self.qp();
            self.wait(deadline, |_| {
                qp.unfinished_sends() == 0 || qp.state() == QpState::Error
            });
        }
        for p in &self.paths {
            let _ = p.qp.modify(&QpAttr::state(QpState::Error));
        }
    }

    /// Whether every request posted on the group's queue pairs is acknowledged (or can never
    /// be: the queue pair failed).
    pub(super) fn sends_done(&self) -> bool {
        self.paths
            .iter()
            .all(|p| p.qp.unfinished_sends() == 0 || p.qp.state() == QpState::Error)
    }

    /// Whether the connections hold nothing more to write and all that was sent is
    /// acknowledged.
    pub(super) fn drained(&self) -> bool {
        let conns = self.st.lock().g.conns.conns();
        conns.iter().all(|c| {
            let s = c.core.lock();
            s.core.staged() == 0 && s.core.inflight() == 0
        }) && self.sends_done()
    }

    /// Whether every connection's peer has closed (or aborted) too: its last CDC is in.
    pub(super) fn peers_closed(&self) -> bool {
        let conns = self.st.lock().g.conns.conns();
        conns.iter().all(|c| {
            let s = c.core.lock();
            matches!(
                s.core.linux_state(false),
                crate::conn::SmcState::Closed | crate::conn::SmcState::ProcessAbort
            )
        })
    }

    /// Drives the group until `done` holds, the group is down with nothing left unsent, or
    /// `deadline` passed. No polling: each pass sleeps as a blocked reader does
    /// ([`Self::drive_blocked`]) until a completion arrives — the last SEND's acknowledgement,
    /// the peer's closing CDC — receiving from the device's socket itself unless an event loop
    /// watches it. Such an event loop may be this very thread (a process ending from its loop)
    /// or one busy elsewhere, so each pass also takes what waits on the socket
    /// (`CqScheduler::receive`, which never blocks); a hold of this group ends when the group
    /// goes down (`release_hold`), those of other groups when their pollers take them back.
    pub(super) fn wait(self: &Arc<Self>, deadline: Instant, done: impl Fn(&Self) -> bool) {
        rdma::cork::end();
        loop {
            self.drive.sched.receive();
            self.progress();
            if done(self) || (self.is_down() && self.sends_done()) || Instant::now() >= deadline {
                return;
            }
            self.drive_blocked(Some(deadline), || done(self));
        }
    }

    /// Detaches connection `token`, one whose setup did not complete (a connection that ends
    /// is released with [`Self::release_conn`]); the link group stays (lingers) for later
    /// connections. Its TCP socket's watch ends with it: nothing was exchanged over SMC-R,
    /// so no close order is kept.
    pub(crate) fn detach(&self, token: u32) {
        let mut st = self.st.lock();
        st.g.conns.detach(token, self.clock.now());
        let w = st.watch.remove(&token);
        self.publish_conns(&st);
        drop(st);
        drop(w);
    }

    /// Gives up a new group whose first link did not come up. A client's fails here and now,
    /// its RMBs freed: the server never confirmed it (Linux: `smc_lgr_cleanup_early`). A
    /// server's is deleted (DELETE LINK): the client's link may be up while ours is not (its
    /// CONFIRM LINK response lost), and its connection must fail now, not at its keepalive.
    /// A group that came up after all is deleted as usual.
    pub(crate) fn abandon(&self) {
        if self.st.lock().g.is_up() || self.role == link::Role::Server {
            self.terminate();
        } else {
            self.fail(GroupDown::FirstLinkNotUp);
        }
    }

    /// Deletes the link group (DELETE LINK to the peer) and stops its poller.
    pub(crate) fn terminate(&self) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        // No new connection may pick this group from now on.
        st.g.terminate();
        self.flush_llc(st);
    }
}

impl crate::tcpwatch::HangUp for LinkGroup {
    /// The TCP connection under `token` hung up (seen by `tcpwatch`): unless the connection
    /// closed meanwhile, the link is probed (TEST LINK): a peer whose process died does not
    /// answer, and the group fails.
    fn tcp_hung_up(&self, token: u32) {
        let mut guard = self.st.lock();
        let st = &mut *guard;
        if st.watch.remove(&token).is_none() {
            return;
        }
        st.g.probe(self.clock.now());
        self.flush_llc(st);
        drop(guard);
        // The poller, asleep on its long timer, learns the probe's deadline.
        self.drive.sched.kick();
    }
}

/// What a failed registration of a connection buffer (`what`) says (a verbs device counts what it pins
/// against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK).
pub(crate) fn pinning_note(what: &str, e: &io::Error) -> String {
    let mut why = format!("no {what} could be registered ({e}): connections decline with MEM");
    if e.raw_os_error() == Some(libc::ENOMEM) {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: valid out pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0
            && lim.rlim_cur != libc::RLIM_INFINITY
        {
            why += &format!(
                "; pinned memory is limited to {} KiB (RLIMIT_MEMLOCK): raise it (`ulimit -l`, \
                 systemd's LimitMEMLOCK=) for more connections over the RDMA device",
                lim.rlim_cur / 1024
            );
        }
    }
    why
}
