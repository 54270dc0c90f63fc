//! The CLC driver: both sides of the handshake over the TCP socket (`client_handshake`,
//! `server_handshake` with its `Reserved` token and RMB), the option verdict, declines, and
//! whether a link is possible from here.

#[allow(unused_imports)]
use super::*;
use crate::error::Unreachable;

/// What a server handshake holds in a group before its connection exists: the token it
/// reserved (counted against the group's connections; CDCs for it are held) and the RMB it
/// took. Dropped, it gives both back — the RMB to the group's pool, or its budget to the
/// runtime once the group is down — so no return path can forget one.
struct Reserved {
    lg: Arc<LinkGroup>,
    /// `None` once the connection holds it.
    token: Option<u32>,
    rmb: Option<Arc<rdma::MemoryRegion>>,
    /// A send buffer of the size the client's RMB is expected to have (ours for it), taken
    /// before the Accept: a device that cannot register one (RLIMIT_MEMLOCK on a verbs
    /// device) declines then, not after the Confirm, when only a reset is left.
    sndbuf: Option<Arc<rdma::MemoryRegion>>,
}

impl Reserved {
    pub(super) fn new(
        lg: &Arc<LinkGroup>,
        token: u32,
        rmb: Arc<rdma::MemoryRegion>,
        sndbuf: Arc<rdma::MemoryRegion>,
    ) -> Self {
        lg.reserve(token);
        Self {
            lg: lg.clone(),
            token: Some(token),
            rmb: Some(rmb),
            sndbuf: Some(sndbuf),
        }
    }

    pub(super) fn rmb(&self) -> &Arc<rdma::MemoryRegion> {
        self.rmb.as_ref().expect("held until into_conn")
    }

    /// The connection takes the token and the RMB (its `attach` ends the reservation). If it
    /// cannot be made, `make_conn` gave the RMB back and the token is released here.
    pub(super) fn into_conn(
        mut self,
        peer: &Endpoint,
        tcp: &Arc<TcpStream>,
    ) -> io::Result<Arc<ConnShared>> {
        let mut sndbuf = self.sndbuf.take().expect("held until into_conn");
        let want = peer.rmb_size.bytes() as usize;
        if sndbuf.len() != want {
            // The client's RMB has another size than ours for it (a kernel peer's): the
            // buffer must match it.
            self.lg.give_back_sndbuf(sndbuf);
            sndbuf = self.lg.take_sndbuf(want as u32)?;
        }
        let rmb = self.rmb.take().expect("held until into_conn");
        let token = self.token.expect("held until into_conn");
        let conn = make_conn(&self.lg, token, rmb, sndbuf, peer, tcp);
        self.token = None;
        Ok(conn)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(token) = self.token.take() {
            self.lg.unreserve(token);
        }
        if let Some(rmb) = self.rmb.take() {
            self.lg.give_back(rmb);
        }
        if let Some(b) = self.sndbuf.take() {
            self.lg.give_back_sndbuf(b);
        }
    }
}

/// The connection of `token` with its buffers (`sndbuf` as large as the peer's RMB).
pub(super) fn make_conn(
    lg: &Arc<LinkGroup>,
    token: u32,
    rmb: Arc<rdma::MemoryRegion>,
    sndbuf: Arc<rdma::MemoryRegion>,
    peer: &Endpoint,
    tcp: &Arc<TcpStream>,
) -> Arc<ConnShared> {
    let c = ConnShared::new(lg, token, rmb, sndbuf, peer);
    lg.attach(token, c.clone(), Some(tcp.clone()));
    c
}

impl SmcStream {
    pub(super) fn client_handshake(&mut self, rt: &Runtime) -> io::Result<()> {
        let local = local_v4(&self.tcp).expect("checked IPv4");
        let mtu = roce_mtu(path_mtu(&self.tcp));
        let mut hs = handshake::Client::new(
            rt.inner.cfg.handshake.clone(),
            Gid::from_ipv4(*local.ip()),
            Instant::now(),
        );
        let (negotiated, server) = match drive(&self.tcp, &mut hs, &mut self.timeline)? {
            Event::Accepted { negotiated, server } => (negotiated, server),
            Event::Fallback {
                reason, by_peer, ..
            } => {
                self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                return Ok(());
            }
            Event::Failed(e) => return Err(failed(e)),
            other => return Err(SetupError::Unexpected(format!("{other:?}")).into()),
        };
        let peer = server.endpoint;
        let size = match peer.gid.to_ipv4() {
            Some(ip) => rt.inner.rmb_size_for(ip),
            None => rt.inner.rmb_size(),
        };
        // No descriptor (EMFILE) or no thread left for the device or the group: declined with
        // MEM on the wire, recorded as NOFD or NOTHREAD.
        let short = std::cell::RefCell::new(None);
        let local_short = |e: &io::Error, other: DeclineReason| match short_of(e) {
            Some(r) => {
                *short.borrow_mut() = Some(r);
                DeclineReason::MEM
            }
            None => other,
        };
        type Taken = (
            Arc<LinkGroup>,
            Arc<rdma::MemoryRegion>,
            Arc<rdma::MemoryRegion>,
        );
        let setup = || -> Result<Taken, DeclineReason> {
            let lg = if server.first_contact {
                let dev = rt.inner.device(*local.ip()).map_err(|e| {
                    let r = local_short(&e, DeclineReason::NOSMCRDEV);
                    if r == DeclineReason::NOSMCRDEV {
                        rt.inner
                            .note(format!("the RoCE device could not be opened: {e}"));
                    }
                    r
                })?;
                // A device that cannot receive RoCE from elsewhere (another process owns the
                // port and no steering program shares it) serves only peers on this host.
                if let Some(ip) = peer.gid.to_ipv4()
                    && let Err(why) = link_possible(rt, &dev, &self.tcp, ip)
                {
                    rt.inner.note(why.to_string());
                    return Err(DeclineReason::NOSMCRDEV);
                }
                let mtu = crate::runtime::smaller_mtu(peer.mtu, mtu);
                let lg = LinkGroup::create(
                    &rt.inner,
                    dev,
                    link::Role::Client,
                    peer.gid,
                    server.peer_id,
                    mtu,
                )
                .map_err(|e| local_short(&e, DeclineReason::ERR_RDYLNK))?;
                lg.start(&peer, mtu, &negotiated, &rt.inner.cfg)
                    .map_err(|e| local_short(&e, DeclineReason::ERR_RDYLNK))?;
                rt.inner.add_group(lg.clone());
                lg
            } else {
                rt.inner
                    .find_group(
                        *local.ip(),
                        peer.gid,
                        link::Role::Client,
                        server.peer_id,
                        Some(peer.qpn),
                    )
                    .ok_or(DeclineReason::SYNCERR)?
            };
            let buffers = || {
                let rmb = lg.take_rmb(size.bytes())?;
                // Taken before the Confirm, so that a device that cannot register it (a verbs
                // device past RLIMIT_MEMLOCK) declines instead of resetting the connection.
                match lg.take_sndbuf(peer.rmb_size.bytes()) {
                    Ok(b) => Ok((rmb, b)),
                    Err(e) => {
                        lg.give_back(rmb);
                        rt.inner
                            .note(crate::runtime::pinning_note("send buffer", &e));
                        Err(DeclineReason::MEM)
                    }
                }
            };
            let (rmb, sndbuf) = match buffers() {
                Ok(b) => b,
                Err(reason) => {
                    if server.first_contact {
                        // The new group will have no connection: its link would wait for
                        // a CONFIRM LINK the server never sends (our Decline ends its side),
                        // holding its buffers (pinned, on a verbs device) until the wait
                        // ends. It ends now.
                        lg.fail(crate::group::GroupDown::Declined);
                    }
                    return Err(reason);
                }
            };
            if !server.first_contact && lg.confirm_rkey(&rmb).is_err() {
                // The peer does not answer on this group: it is dead to us.
                lg.give_back(rmb);
                lg.give_back_sndbuf(sndbuf);
                lg.terminate();
                return Err(DeclineReason::ERR_REGBUF);
            }
            Ok((lg, rmb, sndbuf))
        };
        let (lg, rmb, sndbuf) = match setup() {
            Ok(x) => x,
            Err(reason) => {
                hs.decline(reason).map_err(SetupError::from)?;
                let ev = drive(&self.tcp, &mut hs, &mut self.timeline)?;
                if let Event::Fallback {
                    reason, by_peer, ..
                } = ev
                {
                    self.mode = Mode::Tcp(match short.take() {
                        Some(r) if !by_peer => r,
                        _ => FallbackReason::Declined { reason, by_peer },
                    });
                    return Ok(());
                }
                return Err(SetupError::Unexpected(format!("{ev:?}")).into());
            }
        };
        let token = rt.inner.token();
        let local_ep = endpoint(&lg, &rmb, size, token);
        let conn = make_conn(&lg, token, rmb, sndbuf, &peer, &self.tcp);
        let finish = |s: &mut Self, hs: &mut handshake::Client| -> io::Result<()> {
            hs.confirm(&local_ep, &[], Instant::now())
                .map_err(SetupError::from)?;
            match drive(&s.tcp, hs, &mut s.timeline)? {
                Event::Confirmed => Ok(()),
                Event::Failed(e) => Err(failed(e)),
                other => Err(SetupError::Unexpected(format!("{other:?}")).into()),
            }
        };
        if let Err(e) = finish(self, &mut hs) {
            // Never used: detach it and keep its RMB for others (or free it with the group).
            lg.detach(token);
            lg.give_back(conn.rmb.clone());
            if server.first_contact {
                // Our Confirm never went out: the server never confirms the new group's link,
                // which would otherwise hold its buffers until the CONFIRM LINK wait ends
                // (Linux: `smc_conn_abort` → `smc_lgr_cleanup_early`).
                lg.abandon();
            }
            return Err(e);
        }
        let wait = CLIENT_CONFIRM_WAIT + Duration::from_secs(1);
        if server.first_contact && !await_first_link(self, &lg, &conn, &mut hs, wait)? {
            return Ok(());
        }
        self.mode = Mode::SmcR {
            first_contact: server.first_contact,
        };
        self.smc = Some(Smc { conn, lg });
        Ok(())
    }
}

/// Whether an error is the process (or the system) running out of descriptors.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The local reason when an error is the process running out of descriptors (NOFD) or of
/// threads (NOTHREAD): the peer is declined with MEM, as Linux does when it lacks memory.
pub(super) fn short_of(e: &io::Error) -> Option<FallbackReason> {
    if out_of_descriptors(e) {
        return Some(FallbackReason::NoDescriptors);
    }
    rdma::thread::no_thread(e).map(|why| FallbackReason::NoThread(why.to_string()))
}

/// Whether `dev` can run a link with the peer of `tcp` (at `peer_ip`): a device that cannot
/// receive RoCE from elsewhere serves peers on this host only, through shared memory, which
/// is only between processes of one user (or root): the peer's socket's owner says.
pub(super) fn link_possible(
    rt: &Runtime,
    dev: &crate::runtime::Dev,
    tcp: &TcpStream,
    peer_ip: std::net::Ipv4Addr,
) -> Result<(), Unreachable> {
    dev.reaches(peer_ip, rt.inner.cfg.same_host)?;
    if dev.reaches_remote() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if me == 0 {
        return Ok(());
    }
    match (tcp.local_addr(), tcp.peer_addr()) {
        (Ok(l), Ok(p)) => match crate::diag::peer_uid(l, p) {
            Some(uid) if uid != me && uid != 0 => Err(Unreachable::OtherUser { ip: dev.ip, uid }),
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Marks a socket for the TCP option (`connecting`: before `connect`); false when the option
/// program is unusable.
pub(super) fn mark(rt: &Runtime, sock: &Socket, connecting: bool) -> bool {
    match (&rt.inner.cfg.negotiation, &rt.inner.option) {
        (Negotiation::TcpOption { .. }, Ok(map)) => map.mark(sock.as_fd(), connecting).is_ok(),
        _ => false,
    }
}

/// After the TCP handshake: may the CLC handshake start?
pub(super) fn verdict(
    rt: &Runtime,
    tcp: &TcpStream,
    marked: bool,
    ipv4: bool,
) -> Result<(), FallbackReason> {
    if !ipv4 {
        return Err(FallbackReason::NotIpv4);
    }
    option_verdict(rt, tcp, marked)
}

/// Settles a connection whose CLC handshake we will not run as a fallback for `reason`: no CLC
/// byte when the peer did not offer SMC-R (that verdict is returned instead, or `NotIpv4` for
/// a native IPv6 peer), else a Decline with `wire` (a server reads the client's Proposal
/// first; a client sends it instead of its Proposal). The peer's own Decline, if it comes
/// first, is the reason returned.
pub(super) fn decline_exchange(
    rt: &Runtime,
    tcp: &TcpStream,
    marked: bool,
    server: bool,
    reason: FallbackReason,
    wire: DeclineReason,
    timeline: &mut Timeline,
) -> io::Result<FallbackReason> {
    let ipv4 = tcp.peer_addr().is_ok_and(|a| v4_of(a).is_some());
    let marked = marked
        || (server
            && matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok());
    let offered = option_verdict(rt, tcp, marked);
    timeline.mark(T_OPTION);
    if let Err(r) = offered {
        return Ok(if ipv4 { r } else { FallbackReason::NotIpv4 });
    }
    let cfg = rt.inner.cfg.handshake.clone();
    let ev = if server {
        let mut hs = handshake::Server::new(cfg, Instant::now());
        match drive(tcp, &mut hs, timeline)? {
            Event::Proposed { .. } => {
                hs.decline(wire).map_err(SetupError::from)?;
                drive(tcp, &mut hs, timeline)?
            }
            other => other,
        }
    } else {
        let mut hs = handshake::Client::declining(cfg, wire, Instant::now());
        drive(tcp, &mut hs, timeline)?
    };
    match ev {
        Event::Fallback {
            reason: r,
            by_peer: true,
            ..
        } => Ok(FallbackReason::Declined {
            reason: r,
            by_peer: true,
        }),
        Event::Fallback { .. } => Ok(reason),
        Event::Failed(e) => {
            rt.inner.handshake_failed();
            Err(failed(e))
        }
        other => {
            rt.inner.handshake_failed();
            Err(SetupError::Unexpected(format!("{other:?}")).into())
        }
    }
}

/// Whether the peer offered SMC-R (the option program's record), IPv4 or not.
pub(super) fn option_verdict(
    rt: &Runtime,
    tcp: &TcpStream,
    marked: bool,
) -> Result<(), FallbackReason> {
    match (&rt.inner.cfg.negotiation, &rt.inner.option) {
        (Negotiation::Assume, _) => Ok(()),
        (Negotiation::TcpOption { .. }, Err(e)) => Err(FallbackReason::NoBpf(e.clone())),
        (Negotiation::TcpOption { .. }, Ok(map)) => {
            if !marked {
                return Err(FallbackReason::NoBpf("could not mark the socket".into()));
            }
            match map.state(tcp.as_fd()).map(|s| s.capability()) {
                Ok(Capability::PeerCapable) => Ok(()),
                Ok(Capability::PeerNotCapable) => Err(FallbackReason::PeerNoSmc),
                Ok(_) => Err(FallbackReason::OptionNotObserved),
                Err(e) => Err(FallbackReason::NoBpf(e.to_string())),
            }
        }
    }
}

impl SmcStream {
    pub(super) fn negotiate_server(
        rt: &Runtime,
        tcp: TcpStream,
        peer: SocketAddr,
    ) -> io::Result<Self> {
        // The listener was marked (by SmcListener, or by the preload before listen()); the
        // accepted socket inherits the mark.
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        let mut s = Self::plain(tcp, Mode::Tcp(FallbackReason::PeerNoSmc));
        if v4_of(peer).is_none() {
            // A native IPv6 peer of a dual-stack listener: declined if it offered SMC-R (its
            // Proposal must not reach the application as data).
            let r = decline_exchange(
                rt,
                &s.tcp,
                marked,
                true,
                FallbackReason::NotIpv4,
                DeclineReason::NOSMCRDEV,
                &mut s.timeline,
            )?;
            s.mode = Mode::Tcp(r);
            s.record(rt, true);
            return Ok(s);
        }
        let verdict = verdict(rt, &s.tcp, marked, true);
        s.timeline.mark(T_OPTION);
        match verdict {
            Err(r) => s.mode = Mode::Tcp(r),
            Ok(()) => {
                if let Err(e) = s.server_handshake(rt) {
                    rt.inner.handshake_failed();
                    return Err(e);
                }
            }
        }
        s.record(rt, true);
        Ok(s)
    }

    pub(super) fn server_handshake(&mut self, rt: &Runtime) -> io::Result<()> {
        let local = local_v4(&self.tcp).expect("checked IPv4");
        let peer_ip = *v4_of(self.tcp.peer_addr()?)
            .ok_or_else(|| io::Error::other("not IPv4 (checked before)"))?
            .ip();
        let mtu = roce_mtu(path_mtu(&self.tcp));
        let mut hs = handshake::Server::new(rt.inner.cfg.handshake.clone(), Instant::now());
        let decline = |s: &mut Self, hs: &mut handshake::Server, reason| -> io::Result<()> {
            hs.decline(reason).map_err(SetupError::from)?;
            match drive(&s.tcp, hs, &mut s.timeline)? {
                Event::Fallback {
                    reason, by_peer, ..
                } => {
                    s.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                    Ok(())
                }
                ev => Err(SetupError::Unexpected(format!("{ev:?}")).into()),
            }
        };
        // No descriptor or no thread left for the device or the group: MEM on the wire, NOFD
        // or NOTHREAD recorded.
        let decline_short =
            |s: &mut Self, hs: &mut handshake::Server, r: FallbackReason| -> io::Result<()> {
                decline(s, hs, DeclineReason::MEM)?;
                if matches!(
                    s.mode,
                    Mode::Tcp(FallbackReason::Declined { by_peer: false, .. })
                ) {
                    s.mode = Mode::Tcp(r);
                }
                Ok(())
            };
        let (client_gid, client_id) = match drive(&self.tcp, &mut hs, &mut self.timeline)? {
            Event::Proposed {
                client_gid,
                client_id,
                ..
            } => (client_gid, client_id),
            Event::Fallback {
                reason, by_peer, ..
            } => {
                self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                return Ok(());
            }
            Event::Failed(e) => return Err(failed(e)),
            other => return Err(SetupError::Unexpected(format!("{other:?}")).into()),
        };
        // One handshake per client while it may create a link group (Linux's
        // smc_server_lgr_pending): concurrent first contacts would create two. A handshake that
        // reuses a group holds it only until its token is reserved in that group (which counts
        // against the group's connection limit): the CONFIRM RKEY and CLC round trips of a burst
        // of connections then overlap instead of queueing one after another (65 at once over a
        // 50 ms round trip used to exceed the client's 6 s Accept wait). Linux holds its lock
        // (for all clients) until the link is up or the Confirm is in.
        let pending = rt.inner.pending(true, peer_ip);
        let mut one_at_a_time = Some(pending.lock());
        let token = rt.inner.token();
        let size = match client_gid.to_ipv4() {
            Some(ip) => rt.inner.rmb_size_for(ip),
            None => rt.inner.rmb_size(),
        };
        // Groups found dead (their client did not answer CONFIRM RKEY) on the way: each is
        // ended, so the next look finds another one (or none); after a few, a new group (the
        // client's Accept wait has room for about two lost CONFIRM RKEY waits).
        let mut stale = 0;
        let (lg, first_contact, res) = loop {
            if one_at_a_time.is_none() {
                one_at_a_time = Some(pending.lock());
            }
            let existing = if stale >= 2 {
                None
            } else {
                rt.inner
                    .find_group(*local.ip(), client_gid, link::Role::Server, client_id, None)
            };
            let first_contact = existing.is_none();
            let lg = match existing {
                Some(lg) => lg,
                None => {
                    let dev = match rt.inner.device(*local.ip()) {
                        Ok(d) => d,
                        Err(e) => {
                            return match short_of(&e) {
                                Some(r) => decline_short(self, &mut hs, r),
                                None => {
                                    rt.inner
                                        .note(format!("the RoCE device could not be opened: {e}"));
                                    decline(self, &mut hs, DeclineReason::NOSMCRDEV)
                                }
                            };
                        }
                    };
                    // See the client's first contact: a local-only device serves this host.
                    if let Err(why) = link_possible(rt, &dev, &self.tcp, peer_ip) {
                        rt.inner.note(why.to_string());
                        return decline(self, &mut hs, DeclineReason::NOSMCRDEV);
                    }
                    match LinkGroup::create(
                        &rt.inner,
                        dev,
                        link::Role::Server,
                        client_gid,
                        client_id,
                        mtu,
                    ) {
                        Ok(lg) => lg,
                        Err(e) => {
                            return match short_of(&e) {
                                Some(r) => decline_short(self, &mut hs, r),
                                None => decline(self, &mut hs, DeclineReason::ERR_RDYLNK),
                            };
                        }
                    }
                }
            };
            let rmb = match lg.take_rmb(size.bytes()) {
                Ok(rmb) => rmb,
                Err(reason) => return decline(self, &mut hs, reason),
            };
            let res = match lg.take_sndbuf(size.bytes()) {
                Ok(b) => Reserved::new(&lg, token, rmb, b),
                Err(e) => {
                    lg.give_back(rmb);
                    rt.inner
                        .note(crate::runtime::pinning_note("send buffer", &e));
                    return decline(self, &mut hs, DeclineReason::MEM);
                }
            };
            if !first_contact {
                one_at_a_time = None;
                if lg.confirm_rkey(res.rmb()).is_err() {
                    // The client does not answer on this group (its side is gone: a process
                    // that died without DELETE LINK, or a link it already found dead): end it
                    // and offer this connection a new group as a first contact — nothing was
                    // sent yet, and the client's Accept wait (6 s) has room for the 2 s lost.
                    drop(res);
                    lg.terminate();
                    stale += 1;
                    continue;
                }
            }
            break (lg, first_contact, res);
        };
        // From here, any return before the connection exists gives the token and the RMB back
        // (`Reserved`'s drop).
        let local_ep = endpoint(&lg, res.rmb(), size, token);
        hs.accept(&local_ep, first_contact, Instant::now())
            .map_err(SetupError::from)?;
        let (negotiated, client) = match drive(&self.tcp, &mut hs, &mut self.timeline) {
            Ok(Event::Established { negotiated, client }) => (negotiated, client),
            other => {
                drop(res);
                return match other {
                    Ok(Event::Fallback {
                        reason,
                        by_peer,
                        out_of_sync,
                    }) => {
                        if out_of_sync && !first_contact {
                            // The client does not know the group we offered (Linux: SYNCERR);
                            // end it so its next connection is a first contact (a restarted
                            // client process on the same address is a new peer to us).
                            lg.terminate();
                        }
                        self.mode = Mode::Tcp(FallbackReason::Declined { reason, by_peer });
                        Ok(())
                    }
                    Ok(Event::Failed(e)) => Err(failed(e)),
                    Ok(ev) => Err(SetupError::Unexpected(format!("{ev:?}")).into()),
                    Err(e) => Err(e),
                };
            }
        };
        let peer = client.endpoint;
        if first_contact {
            let mtu = crate::runtime::smaller_mtu(peer.mtu, lg.mtu);
            if let Err(e) = lg.start(&peer, mtu, &negotiated, &rt.inner.cfg) {
                // Give back what was reserved; the group ends (its RMB budget with it).
                drop(res);
                lg.fail(crate::group::GroupDown::Start(e.to_string()));
                return Err(e);
            }
            rt.inner.add_group(lg.clone());
        }
        let conn = res.into_conn(&peer, &self.tcp)?;
        let wait = CONFIRM_WAIT + Duration::from_secs(1);
        if first_contact && !await_first_link(self, &lg, &conn, &mut hs, wait)? {
            return Ok(());
        }
        // A first contact's link is up: later handshakes of this client may reuse the group.
        drop(one_at_a_time);
        self.mode = Mode::SmcR { first_contact };
        self.smc = Some(Smc { conn, lg });
        Ok(())
    }
}
