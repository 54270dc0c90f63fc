//! A link group's driver, part 1: queue pairs per path (`Path`), creating and starting a
//! group, its stats record, accessors, waiting for the first link, reserving tokens,
//! attaching connections and SEND slots.

#[allow(unused_imports)]
use super::*;

impl Path {
    /// Sets the path up anew (a link added on it): a new initial PSN, the queue pair reset to
    /// INIT with every receive slot posted.
    pub(super) fn reset(&self, recv_mr: &MemoryRegion) -> io::Result<()> {
        self.psn.store(random_u32() & 0xff_ffff, Ordering::Relaxed);
        self.init(recv_mr)
    }

    /// Resets the queue pair to INIT with every receive slot posted.
    pub(super) fn init(&self, recv_mr: &MemoryRegion) -> io::Result<()> {
        self.qp
            .modify(&QpAttr::state(QpState::Reset))
            .and_then(|()| self.qp.modify(&QpAttr::state(QpState::Init)))
            .map_err(|e| SetupError::QueuePair(format!("QP to INIT: {e:?}")))?;
        // A reset drops what was posted, without completions: the long-message buffer is free.
        self.big_tx_slot.store(0, Ordering::Release);
        let all: Vec<usize> = (self.base..self.base + RECV_SLOTS).collect();
        self.post_recvs(recv_mr, &all)
            .map_err(|e| SetupError::QueuePair(format!("post_recv: {e:?}")).into())
    }

    /// The most receive slots one `post_recv` call of [`Self::post_recvs`] takes.
    pub(super) const POST_MAX: usize = RECV_SLOTS / 4;

    /// Posts receive slots `slots`, each with the buffer for longer LLC messages after it,
    /// [`Self::POST_MAX`] per call.
    pub(super) fn post_recvs(
        &self,
        recv_mr: &MemoryRegion,
        slots: &[usize],
    ) -> Result<(), rdma::PostError> {
        let big = self.big.as_ref().map(|b| b.sge(0, LLC_MAX - SLOT));
        let n = if big.is_some() { 2 } else { 1 };
        let unused = rdma::Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        for slots in slots.chunks(Self::POST_MAX) {
            let sges: [[rdma::Sge; 2]; Self::POST_MAX] =
                std::array::from_fn(|i| match slots.get(i) {
                    Some(&s) => {
                        let first = recv_mr.sge(s * SLOT, SLOT);
                        [first, big.unwrap_or(first)]
                    }
                    None => [unused; 2],
                });
            let wrs: [RecvWr<'_>; Self::POST_MAX] = std::array::from_fn(|i| RecvWr {
                wr_id: RECV_TAG | slots.get(i).copied().unwrap_or(0) as u64,
                sg_list: &sges[i][..n],
            });
            self.qp.post_recv(&wrs[..slots.len()])?;
        }
        Ok(())
    }

    /// Connects the queue pair to the peer's (`peer_qpn` at `peer_ip`, starting at
    /// `peer_psn`): RTR, then RTS.
    pub(super) fn connect(
        &self,
        peer_ip: Ipv4Addr,
        peer_qpn: u32,
        peer_psn: u32,
        mtu: QpMtu,
        port: u16,
        pin: bool,
    ) -> io::Result<()> {
        self.peer_qpn.store(peer_qpn, Ordering::Relaxed);
        self.peer_ip.store(u32::from(peer_ip), Ordering::Relaxed);
        self.qp
            .modify(&QpAttr {
                path_mtu: Some(rdma_mtu(mtu)),
                dest_qp_num: Some(peer_qpn),
                rq_psn: Some(Psn::new(peer_psn)),
                av: Some(SocketAddrV4::new(peer_ip, port)),
                // On a multi-homed device every path names its source (the ICRC covers it).
                src: pin.then_some(self.src),
                ..QpAttr::state(QpState::Rtr)
            })
            .map_err(|e| SetupError::QueuePair(format!("QP to RTR: {e:?}")))?;
        self.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(self.psn.load(Ordering::Relaxed))),
                ..QpAttr::state(QpState::Rts)
            })
            .map_err(|e| SetupError::QueuePair(format!("QP to RTS: {e:?}")).into())
    }
}

impl LinkGroup {
    /// Creates the QP (in INIT, receives posted) for a new link group.
    pub(crate) fn create(
        rt: &Arc<Inner>,
        dev: Arc<Dev>,
        role: link::Role,
        peer_gid: Gid,
        peer_id: PeerId,
        mtu: QpMtu,
    ) -> io::Result<Arc<Self>> {
        let poller = rdma::thread::claim()?;
        let cq = dev.device.create_cq()?;
        let caps = QpCaps {
            max_send_wr: 4096,
            max_recv_wr: RECV_SLOTS as u32,
            // Only our extensions tell a peer that holds from one that does not.
            ack_delay: rt.cfg.ack_delay.filter(|_| rt.cfg.rdma_ext),
            ..QpCaps::default()
        };
        let pd = if rt.cfg.same_host {
            dev.device.alloc_shared_pd()?
        } else {
            dev.device.alloc_pd()
        };
        // A second path only over UDP between our addresses (a same-host group has one).
        let alt = dev
            .alt
            .filter(|_| !(rt.cfg.same_host && rt.is_local(peer_gid.to_ipv4().unwrap_or(dev.ip))));
        let srcs: Vec<Ipv4Addr> = std::iter::once(dev.ip).chain(alt).collect();
        let recv_mr = pd.reg_mr(SLOT * RECV_SLOTS * srcs.len(), Access::LOCAL_WRITE)?;
        // One slot more than are handed out: it stays zero (see `ZERO_SLOT`).
        let send_mr = pd.reg_mr(SLOT * (SEND_SLOTS + 1), Access::LOCAL_WRITE)?;
        let mut paths = Vec::new();
        for (i, &src) in srcs.iter().enumerate() {
            let path = Path {
                qp: pd.create_qp(&cq, &cq, caps, false)?,
                base: i * RECV_SLOTS,
                big: if srcs.len() > 1 {
                    Some(pd.reg_mr(LLC_MAX - SLOT, Access::LOCAL_WRITE)?)
                } else {
                    None
                },
                big_tx: if srcs.len() > 1 {
                    Some(pd.reg_mr(LLC_MAX - SLOT, Access::LOCAL_WRITE)?)
                } else {
                    None
                },
                big_tx_slot: AtomicUsize::new(0),
                src,
                psn: AtomicU32::new(random_u32() & 0xff_ffff),
                peer_qpn: AtomicU32::new(0),
                peer_ip: AtomicU32::new(0),
            };
            path.init(&recv_mr)?;
            paths.push(path);
        }
        let path_ids = paths
            .iter()
            .map(|p| PathIds {
                gid: Gid::from_ipv4(p.src),
                qpn: p.qp.qp_num(),
            })
            .collect();
        Ok(Arc::new(Self {
            id: rt.next_lgr.fetch_add(1, Ordering::Relaxed),
            role,
            dev,
            paths,
            rtokens: Mutex::new(crate::rtokens::PeerRtokens::default()),
            route: AtomicU64::new(0),
            link_id: AtomicU32::new(1),
            drive: Drive {
                sched: cq.scheduler(),
                cq,
                poller: Mutex::new(Some(poller)),
                driver: Mutex::new(()),
                blocking_driver: AtomicBool::new(false),
                hold: Mutex::new(Hold::new(Instant::now())),
                hold_for: rt.cfg.app_hold,
            },
            write_pad: rt.cfg.write_pad,
            rkey_reuse: rt.cfg.rkey_reuse,
            shown_shm: AtomicBool::new(false),
            slots: Slots {
                pd,
                recv_mr,
                send_mr,
            },
            peer_gid,
            peer_id,
            mtu,
            st: Mutex::new(LgState {
                g: GroupCore::new(
                    role,
                    path_ids,
                    LgrCore::new(
                        255,
                        SEND_SLOTS,
                        POLLER_RESERVE,
                        RECV_SLOTS,
                        rt.cfg.linger,
                        rt.clock.now(),
                    ),
                ),
                watch: HashMap::new(),
                rmb_pool: Vec::new(),
                sndbuf_pool: Vec::new(),
                confirmed: HashSet::new(),
            }),
            cond: Condvar::new(),
            clock: rt.clock.clone(),
            down: AtomicBool::new(false),
            runtime: Arc::downgrade(rt),
            stat: rt.stats.as_ref().and_then(|area| {
                area.count(crate::stats::total::LINK_GROUPS);
                Some(LgStat {
                    area: area.clone(),
                    slot: area.claim_lg()?,
                    released: Mutex::new(false),
                    since: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as u64),
                })
            }),
        }))
        .inspect(|g| g.publish(crate::stats::lg::LINK_ACTIVATING))
    }

    /// Writes this group's record in the stats area with link state `state`.
    pub(super) fn publish(&self, state: u64) {
        use crate::stats::lg;
        let Some(st) = &self.stat else { return };
        let released = st.released.lock();
        if *released {
            return; // the slot may be another group's now
        }
        // Once down, always shown down (a late ACTIVE from the poller must not win).
        let state = if self.is_down() {
            lg::LINK_INACTIVE
        } else {
            state
        };
        let gid = |g: &Gid| {
            [
                u64::from_be_bytes(g.0[..8].try_into().expect("8 bytes")),
                u64::from_be_bytes(g.0[8..].try_into().expect("8 bytes")),
            ]
        };
        let mut rec = crate::stats::LgRecord::default();
        rec.words[lg::IN_USE] = 1;
        let role = match self.role {
            link::Role::Client => lg::ROLE_CLIENT,
            link::Role::Server => lg::ROLE_SERVER,
        };
        let link_id = u64::from(self.link_id.load(Ordering::Relaxed));
        rec.words[lg::ID] = u64::from(self.id) | role << 32 | link_id << 40 | state << 48;
        let (ours, _, qpn, _, _) = self.local_endpoint();
        let path = &self.paths[self.active()];
        let peer_gid = match path.peer_ip.load(Ordering::Relaxed) {
            0 => self.peer_gid,
            ip => Gid::from_ipv4(Ipv4Addr::from(ip)),
        };
        rec.words[lg::GID..lg::GID + 2].copy_from_slice(&gid(&ours));
        rec.words[lg::PEER_GID..lg::PEER_GID + 2].copy_from_slice(&gid(&peer_gid));
        rec.words[lg::QPNS] =
            u64::from(qpn) | u64::from(path.peer_qpn.load(Ordering::Relaxed)) << 32;
        rec.words[lg::PEER_SYSTEM] = u64::from_be_bytes(self.peer_id.0);
        rec.words[lg::SINCE] = st.since;
        rec.words[lg::MTU] = u64::from(self.mtu.bytes().unwrap_or(0));
        // Sticky: a same-host link whose peer went away (its offer closed) still shows what
        // it ran on, not UDP.
        rec.words[lg::TRANSPORT] = if self.same_host_now() {
            lg::TRANSPORT_SHM
        } else if self.dev.device.is_verbs() {
            lg::TRANSPORT_VERBS
        } else {
            lg::TRANSPORT_UDP
        };
        rec.words[lg::PEER_PROC] = match path.qp.same_host_peer() {
            Some(c) => {
                lg::PEER_PROC_KNOWN | u64::from(c.pid as u32 & 0x7fff_ffff) << 32 | u64::from(c.uid)
            }
            None => 0,
        };
        rec.words[lg::SAME_HOST] = path.qp.same_host_state().code();
        st.area.write_lg(st.slot, &rec);
    }

    /// Publishes the number of connections on the group (caller holds `st`).
    pub(super) fn publish_conns(&self, st: &LgState) {
        if let Some(s) = &self.stat {
            let released = s.released.lock();
            if !*released {
                s.area.set_lg_conns(s.slot, st.g.conns.len() as u64);
            }
        }
    }

    /// Our side of the active link as CLC carries it.
    pub(crate) fn local_endpoint(&self) -> (Gid, Mac, u32, u32, QpMtu) {
        let p = &self.paths[self.active()];
        (
            Gid::from_ipv4(p.src),
            self.dev.mac,
            p.qp.qp_num(),
            p.psn.load(Ordering::Relaxed),
            self.mtu,
        )
    }

    /// The active path and the failover epoch.
    pub(crate) fn route(&self) -> (u32, usize) {
        let r = self.route.load(Ordering::Acquire);
        ((r >> 8) as u32, (r & 0xff) as usize)
    }

    /// The peer RMB `rmb` as `path` reaches it, as `(vaddr, rkey)` for an RDMA WRITE there;
    /// `rmb` keeps the answer (a connection moves to the path once).
    pub(crate) fn peer_rmb(&self, rmb: &mut crate::rtokens::PeerRmb, path: usize) -> (u64, u32) {
        if rmb.path != path {
            *rmb = self.rtokens.lock().on(*rmb, path);
        }
        (rmb.vaddr, rmb.rkey)
    }

    /// The path whose peer queue pair is `qpn` (a connection's CLC messages name its link by
    /// it; its rkey is for that link); the active one when none is.
    pub(crate) fn path_of_peer_qpn(&self, qpn: u32) -> usize {
        self.paths
            .iter()
            .position(|p| p.peer_qpn.load(Ordering::Relaxed) == qpn)
            .unwrap_or_else(|| self.active())
    }

    /// The active path.
    pub(crate) fn active(&self) -> usize {
        self.route().1
    }

    /// The active path's queue pair.
    pub(crate) fn qp(&self) -> &QueuePair {
        &self.paths[self.active()].qp
    }

    /// TEST LINK requests the active link sent.
    pub(crate) fn test_links_sent(&self) -> u64 {
        self.st
            .lock()
            .g
            .link_stats()
            .map_or(0, |s| s.test_links_sent)
    }

    /// Usable links (1, or 2 while the spare is confirmed; 0 once down).
    pub(crate) fn links(&self) -> usize {
        self.st.lock().g.links()
    }

    /// Whether the peer's QP `qpn` at `gid` is one of this group's live links.
    pub(crate) fn has_peer_link(&self, gid: Gid, qpn: u32) -> bool {
        let Some(ip) = gid.to_ipv4() else {
            return false;
        };
        let st = self.st.lock();
        let active = self.active();
        self.paths.iter().enumerate().any(|(i, p)| {
            (i == active || st.g.spare_up())
                && p.peer_qpn.load(Ordering::Relaxed) == qpn
                && p.peer_ip.load(Ordering::Relaxed) == u32::from(ip)
        })
    }

    /// The path whose queue pair is `qpn`.
    pub(super) fn path_of(&self, qpn: u32) -> usize {
        self.paths
            .iter()
            .position(|p| p.qp.qp_num() == qpn)
            .unwrap_or(0)
    }

    /// Connects the QP to the peer (RTR, RTS) and starts the LLC conversation and the poller.
    pub(crate) fn start(
        self: &Arc<Self>,
        peer: &handshake::Endpoint,
        mtu: QpMtu,
        negotiated: &handshake::Negotiated,
        cfg: &RuntimeConfig,
    ) -> io::Result<()> {
        let (peer_qpn, peer_psn) = (peer.qpn, peer.initial_psn);
        let (max_links, max_conns) = (negotiated.max_links, negotiated.max_conns);
        let peer_ip = self.peer_gid.to_ipv4().ok_or(SetupError::PeerGidNotIpv4)?;
        self.paths[0].connect(
            peer_ip,
            peer_qpn,
            peer_psn,
            mtu,
            cfg.roce_port,
            self.paths.len() > 1,
        )?;
        self.publish(crate::stats::lg::LINK_ACTIVATING);
        let (gid, mac, qpn, _, _) = self.local_endpoint();
        let now = self.clock.now();
        let params = LinkParams {
            role: self.role,
            version: Version::V2,
            mac,
            gid,
            qpn,
            link_id: 1,
            link_uid: [
                0,
                (self.id >> 16) as u8,
                (self.id >> 8) as u8,
                self.id as u8,
            ],
            max_links,
            max_conns,
            test_link_time: cfg.test_link_time,
        };
        {
            let mut st = self.st.lock();
            st.g.start(params, now);
            self.flush_llc(&mut st);
        }
        let me = self.clone();
        let name = format!("smcr-lgr-{}", self.id);
        match self.drive.poller.lock().take() {
            Some(claim) => claim.run(name, move || me.poll_loop())?,
            None => rdma::thread::spawn(name, move || me.poll_loop())?,
        };
        Ok(())
    }

    pub(crate) fn is_up(&self) -> bool {
        self.st.lock().g.is_up() && !self.is_down()
    }

    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    pub(super) fn has_room(&self) -> bool {
        self.st.lock().g.conns.has_room()
    }

    /// Waits until the link is confirmed, or fails.
    pub(crate) fn wait_up(&self, timeout: Duration, tcp: &std::net::TcpStream) -> io::Result<()> {
        // The peer sends nothing on the TCP connection while the link comes up, except a
        // Decline (it gave up) or its close: look every slice, so a peer that gave up or died
        // ends the wait at once instead of at the deadline.
        const SLICE: Duration = Duration::from_millis(20);
        let deadline = Instant::now() + timeout;
        let mut st = self.st.lock();
        loop {
            if let Some(r) = st.g.down() {
                return Err(SetupError::Group(r.clone()).into());
            }
            if st.g.is_up() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(SetupError::LinkTimeout.into());
            }
            let _ = self.cond.wait_until(&mut st, deadline.min(now + SLICE));
            if !st.g.is_up()
                && st.g.down().is_none()
                && parking_lot::MutexGuard::unlocked(&mut st, || tcp_has_input(tcp))
            {
                return Err(SetupError::PeerGaveUp.into());
            }
        }
    }

    /// Reserves `token` before it is sent in an Accept (see `LgState::early`).
    pub(crate) fn reserve(&self, token: u32) {
        self.st.lock().g.conns.promise(token);
    }

    /// Forgets a reserved token whose handshake did not complete.
    pub(crate) fn unreserve(&self, token: u32) {
        self.st.lock().g.conns.unpromise(token);
    }

    pub(crate) fn attach(
        self: &Arc<Self>,
        token: u32,
        c: Arc<ConnShared>,
        tcp: Option<Arc<std::net::TcpStream>>,
    ) {
        let watched = tcp.map(|fd| crate::tcpwatch::watch(self, token, fd));
        let early = {
            let mut st = self.st.lock();
            if let Some(w) = watched {
                st.watch.insert(token, w);
            }
            if let Some(why) = st.g.down() {
                // The group ended while this connection was set up (another handshake found it
                // dead, or it failed): its drain is over, so fail the connection here, or a
                // reader would wait for ever and its RMB stay counted.
                let why = why.clone();
                drop(st);
                c.fail(&why);
                return;
            }
            let early = st.g.conns.attach(token, c.clone());
            self.publish_conns(&st);
            early
        };
        for m in early {
            c.on_cdc(self, &m);
        }
    }

    /// A SEND slot (waits for one unless `poller`: the poller never waits and gets the
    /// reserve), for connection `owner` (a token; 0: none), whose completion handler hears of
    /// the SEND (named now, under the lock the slot is taken with: on UDP the completion may
    /// be handled before `post_send` returns).
    pub(crate) fn take_slot(&self, poller: bool, owner: u32) -> Result<usize, PostFailure> {
        Ok({
            let mut st = self.st.lock();
            loop {
                if let Some(r) = st.g.down() {
                    return Err(PostFailure::Group(r.clone()));
                }
                if let Slot::Got(slot) = st.g.conns.take_slot(poller) {
                    st.g.conns.set_owner(slot, owner);
                    break slot;
                }
                if poller {
                    return Err(PostFailure::NoSlot);
                }
                self.cond.wait(&mut st);
            }
        })
    }
}
