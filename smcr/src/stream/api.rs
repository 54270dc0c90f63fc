//! The public `SmcStream`: making one (connect, accepted sockets, fallbacks), reading,
//! writing, shutdown, close, timeouts, and what the preload asks of it.

#[allow(unused_imports)]
use super::*;

impl SmcStream {
    /// The connection and its link group, when SMC-R.
    #[cfg(feature = "hostile")]
    pub(crate) fn smc_parts(&self) -> Option<(&Arc<ConnShared>, &Arc<LinkGroup>)> {
        self.smc.as_ref().map(|s| (&s.conn, &s.lg))
    }

    /// Connects to `addr` (the first address that accepts a TCP connection), then negotiates
    /// SMC-R; falls back to TCP as Linux would.
    pub fn connect(rt: &Runtime, addr: impl ToSocketAddrs) -> io::Result<Self> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(rt, a) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub(super) fn connect_one(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        let marked = v4_of(addr).is_some() && mark(rt, &sock, true);
        sock.connect(&addr.into())?;
        let r = Self::from_connected(rt, sock.into(), marked);
        if let Err(e) = &r
            && not_clc(e)
        {
            rt.count_code(FallbackReason::CODE_NOT_CLC);
        }
        r
    }

    /// Negotiates on a TCP connection the caller connected (`marked`: the socket was marked
    /// with [`Runtime::mark`] before `connect`). Used by the preload shim, whose application
    /// creates and connects the socket itself.
    pub fn from_connected(rt: &Runtime, tcp: TcpStream, marked: bool) -> io::Result<Self> {
        let ipv4 = v4_of(tcp.peer_addr()?).is_some();
        let mut s = Self::plain(tcp, Mode::Tcp(FallbackReason::PeerNoSmc));
        let verdict = verdict(rt, &s.tcp, marked, ipv4);
        s.timeline.mark(T_OPTION);
        match verdict {
            Err(reason) => s.mode = Mode::Tcp(reason),
            Ok(()) => {
                if let Err(e) = s.client_handshake(rt) {
                    rt.inner.handshake_failed();
                    return Err(e);
                }
            }
        }
        s.record(rt, false);
        Ok(s)
    }

    /// Negotiates, as the server, on a TCP connection accepted from a listener that was
    /// marked with [`Runtime::mark`] before `listen`. Blocks for the handshake.
    pub fn from_accepted(rt: &Runtime, tcp: TcpStream) -> io::Result<Self> {
        let peer = tcp.peer_addr()?;
        Self::negotiate_server(rt, tcp, peer)
    }

    /// For an acceptor, before any handshake: when the accepted connection (from a listener
    /// marked with [`Runtime::mark`]) cannot negotiate — its peer sent no SMC-R option, it is
    /// not IPv4, the option program is unusable — the TCP-mode stream at once (recorded and
    /// counted like any fallback). Otherwise `tcp` comes back for [`SmcStream::from_accepted`],
    /// which blocks for the CLC handshake. Lets an acceptor serve plain peers inline, without
    /// a thread per connection.
    pub fn accept_fallback(rt: &Runtime, tcp: TcpStream) -> Result<Self, TcpStream> {
        let Ok(peer) = tcp.peer_addr() else {
            return Err(tcp);
        };
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        // A native IPv6 peer that offered SMC-R goes to the handshake too (to be declined).
        match option_verdict(rt, &tcp, marked) {
            Ok(()) => Err(tcp),
            Err(r) => {
                let r = if v4_of(peer).is_some() {
                    r
                } else {
                    FallbackReason::NotIpv4
                };
                let mut s = Self::plain(tcp, Mode::Tcp(r));
                s.timeline.mark(T_OPTION);
                s.record(rt, true);
                Ok(s)
            }
        }
    }

    /// For an acceptor that leaves each accepted socket where `accept` put it (the preload:
    /// at the application's new descriptor `fd`): `Ok` when the peer may negotiate (then
    /// hand the socket to [`SmcStream::from_accepted`]); otherwise the fallback is recorded
    /// and counted as [`SmcStream::hand_over`] records one (the row stays with `fd`) and its
    /// reason comes back. The socket is not touched either way. `fd` must be an accepted IPv4
    /// TCP socket of a listener marked with [`Runtime::mark`].
    /// `addrs` (local, peer), when the caller knows them, spare two system calls.
    pub fn accept_verdict(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        addrs: Option<(SocketAddr, SocketAddr)>,
    ) -> Result<(), FallbackReason> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let marked = matches!(rt.inner.cfg.negotiation, Negotiation::TcpOption { .. })
            && rt.inner.option.is_ok();
        // The option decides: a native IPv6 peer that offered SMC-R still needs our Decline
        // (the caller's handshake, with `NotIpv4`); one that did not is plain TCP at once.
        let reason = match option_verdict(rt, &tcp, marked) {
            Ok(()) => return Ok(()),
            Err(r) => {
                let peer = addrs.map_or_else(|| tcp.peer_addr(), |(_, p)| Ok(p));
                if peer.is_ok_and(|p| v4_of(p).is_none()) {
                    FallbackReason::NotIpv4
                } else {
                    r
                }
            }
        };
        let mut timeline = Timeline::new();
        timeline.mark(T_OPTION);
        let mode = Mode::Tcp(reason.clone());
        let addrs = || {
            addrs.map_or_else(
                || (tcp.local_addr(), tcp.peer_addr()),
                |(l, p)| (Ok(l), Ok(p)),
            )
        };
        if let Some(st) = record_row(rt, addrs, &mode, &timeline, None, true) {
            keep_row(rt, st, fd.as_raw_fd());
        }
        Err(reason)
    }

    /// For a caller that cannot give a connection SMC-R resources (the preload when the
    /// process has no descriptor left: [`FallbackReason::NoDescriptors`]): settles it as a
    /// fallback on the TCP connection `fd` itself (the application's socket, borrowed for the
    /// call) — without a CLC byte when the peer did not offer SMC-R (that verdict is recorded
    /// instead), else with a Decline (`MEM` on the wire, Linux's code for a shortage of
    /// resources; a server reads the client's Proposal first). The row is recorded with the
    /// local reason and stays with `row_at` (the application's number of the same socket) as
    /// [`SmcStream::hand_over`] leaves it. Returns the reason recorded; an error when the
    /// handshake failed (the connection is unusable).
    pub fn decline_local(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        row_at: std::os::fd::RawFd,
        marked: bool,
        server: bool,
        reason: FallbackReason,
    ) -> io::Result<FallbackReason> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let mut timeline = Timeline::new();
        let recorded = decline_exchange(
            rt,
            &tcp,
            marked,
            server,
            reason,
            DeclineReason::MEM,
            &mut timeline,
        )?;
        let mode = Mode::Tcp(recorded.clone());
        if let Some(st) = record_row(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &mode,
            &timeline,
            None,
            server,
        ) {
            keep_row(rt, st, row_at);
        }
        Ok(recorded)
    }

    /// Records a connection that stays TCP for a local `reason` decided before any CLC byte
    /// (the peer never offered SMC-R, or was never marked): its row stays with `fd` as
    /// [`SmcStream::hand_over`] leaves it. For the preload's own decisions (native IPv6 peers, `NoDescriptors`
    /// before marking).
    pub fn record_local(
        rt: &Runtime,
        fd: std::os::fd::BorrowedFd<'_>,
        server: bool,
        reason: FallbackReason,
    ) {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let mut timeline = Timeline::new();
        timeline.mark(T_OPTION);
        if let Some(st) = record_row(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &Mode::Tcp(reason),
            &timeline,
            None,
            server,
        ) {
            keep_row(rt, st, fd.as_raw_fd());
        }
    }

    /// Shows a connection that another process holding it too settled as TCP (this process
    /// inherited it): its row, reason [`FallbackReason::Shared`], stays with `fd` as
    /// [`SmcStream::hand_over`] leaves it; not counted in the totals (the settling process
    /// counted it).
    pub fn record_follower(rt: &Runtime, fd: std::os::fd::BorrowedFd<'_>, server: bool) {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a view of the caller's socket for this call only; never dropped (closed).
        let tcp = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd.as_raw_fd()) });
        let timeline = Timeline::new();
        if let Some(st) = record_row_counted(
            rt,
            || (tcp.local_addr(), tcp.peer_addr()),
            &Mode::Tcp(FallbackReason::Shared),
            &timeline,
            None,
            server,
            false,
        ) {
            keep_row(rt, st, fd.as_raw_fd());
        }
    }

    /// The TCP connection underneath (for addresses and socket options; after SMC-R is
    /// established no data goes over it).
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Installs the sink that is told this connection's poll readiness at every change (the
    /// preload's application-facing socket); it is told the current state at once. Only the
    /// first call installs a sink.
    pub fn set_readiness(&self, sink: Box<dyn crate::runtime::Readiness>) {
        if let Some(smc) = &self.smc
            && smc.conn.readiness.set(sink).is_ok()
        {
            let mut s = smc.conn.core.lock();
            smc.conn.report(&mut s);
        }
    }

    /// Bytes that a read would return now (FIONREAD).
    pub fn readable_bytes(&self) -> usize {
        match &self.smc {
            Some(smc) => smc.conn.core.lock().core.readable() as usize,
            None => 0,
        }
    }

    pub(super) fn plain(tcp: TcpStream, mode: Mode) -> Self {
        Self {
            tcp: Arc::new(tcp),
            smc: None,
            mode,
            stat: None,
            timeline: Box::new(Timeline::new()),
            timeouts: Default::default(),
            nonblocking: Default::default(),
            handles: Some(Arc::new(())),
        }
    }

    /// Another handle to this connection, like [`TcpStream::try_clone`]: both read and
    /// write the same connection (a byte goes to one reader), share its timeouts and
    /// non-blocking mode, and the connection is closed when the last handle is dropped.
    ///
    /// ```no_run
    /// # fn main() -> std::io::Result<()> {
    /// use std::io::{BufRead, BufReader, Write};
    /// use smcr::{Runtime, RuntimeConfig, SmcStream};
    ///
    /// let rt = Runtime::new(RuntimeConfig::from_env());
    /// let mut writer = SmcStream::connect(&rt, "127.0.0.1:7000")?;
    /// let reader = BufReader::new(writer.try_clone()?);
    /// std::thread::spawn(move || {
    ///     for line in reader.lines() {
    ///         println!("{}", line.unwrap());
    ///     }
    /// });
    /// writer.write_all(b"hello\n")?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            tcp: self.tcp.clone(),
            smc: self.smc.clone(),
            mode: self.mode.clone(),
            stat: self.stat.clone(),
            timeline: self.timeline.clone(),
            timeouts: self.timeouts.clone(),
            nonblocking: self.nonblocking.clone(),
            handles: self.handles.clone(),
        })
    }

    /// Puts the negotiated connection into the runtime's stats area, counts it, and feeds
    /// the `metrics` facade.
    pub(super) fn record(&mut self, rt: &Runtime, server: bool) {
        self.stat = record_row(
            rt,
            || (self.tcp.local_addr(), self.tcp.peer_addr()),
            &self.mode,
            &self.timeline,
            self.smc.as_ref(),
            server,
        )
        .map(Arc::new);
    }

    /// The application keeps this connection's TCP socket at descriptor `fd` (a fallback: the
    /// stream's own duplicate closes now). Its row in the stats area stays, with the
    /// descriptor and the socket's inode, until that descriptor is found closed (`smc-stat`
    /// reads the socket's byte counts from the kernel). For the preload shim.
    pub fn hand_over(mut self, rt: &Runtime, fd: std::os::fd::RawFd) {
        // With other handles (try_clone) the row goes with the last of them instead.
        if let Some(st) = self.stat.take().and_then(|s| Arc::try_unwrap(s).ok()) {
            keep_row(rt, st, fd);
        }
    }

    /// Counts bytes moved in the stats area, and for SMC-R the request in its size bucket
    /// (cursors are published under the connection's lock where they change: reads, writes,
    /// CDCs).
    pub(super) fn counted(&self, r: io::Result<usize>, sent: bool) -> io::Result<usize> {
        if let (Ok(n), Some(st)) = (&r, &self.stat) {
            let n = *n as u64;
            if sent {
                st.area.add_bytes(st.slot, n, 0);
            } else {
                st.area.add_bytes(st.slot, 0, n);
            }
            if self.smc.is_some() {
                st.area.count_request(st.slot, sent, n);
            }
        }
        r
    }

    /// SMC-R or TCP, with the fallback reason.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// The id of the link group this connection runs on (`None` for TCP): what
    /// [`Driver::id`] would say, without making one.
    pub fn group_id(&self) -> Option<u64> {
        self.smc.as_ref().map(|smc| u64::from(smc.lg.id))
    }

    /// What an application thread needs to do this connection's link-group work itself
    /// (`None` for a plain TCP connection). See [`Driver`].
    pub fn driver(&self) -> Option<Driver> {
        let smc = self.smc.as_ref()?;
        use std::os::fd::AsRawFd;
        Some(Driver {
            fd: smc.lg.event_fd().as_raw_fd(),
            id: u64::from(smc.lg.id),
            lg: Arc::downgrade(&smc.lg),
        })
    }

    /// Counters of an SMC-R stream (`None` for TCP).
    pub fn stats(&self) -> Option<ConnStats> {
        self.smc.as_ref().map(|smc| smc.conn.core.lock().stats)
    }

    /// A file descriptor for poll/epoll, for readers (`write` false) or writers: it becomes
    /// readable whenever the stream's state may have changed (data arrived, space freed,
    /// closed, failed). Read it (8 bytes) to re-arm, then retry the operation in non-blocking
    /// mode. For a TCP-mode stream this is the TCP socket itself (wait for POLLIN or POLLOUT).
    pub fn readiness_fd(&self, write: bool) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        match &self.smc {
            Some(smc) => smc.conn.readiness_fd(write),
            None => Ok(self.tcp.as_fd()),
        }
    }

    /// The TCP stream of a connection that fell back (the same socket, under a duplicated
    /// descriptor), or the stream itself when it is SMC-R.
    pub fn into_tcp(self) -> Result<TcpStream, Self> {
        if self.smc.is_some() {
            return Err(self);
        }
        match self.tcp.try_clone() {
            Ok(tcp) => Ok(tcp),
            Err(_) => Err(self),
        }
    }

    /// The peer's address (of the TCP connection).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Our address (of the TCP connection).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Read timeout (`None`: block); a zero duration is an error, as for
    /// [`TcpStream::set_read_timeout`]. A read that times out fails with `WouldBlock`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(t)?;
        self.set_timeout(0, t);
        Ok(())
    }

    /// Write timeout (`None`: block); a zero duration is an error.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)?;
        self.set_timeout(1, t);
        Ok(())
    }

    fn set_timeout(&self, which: usize, t: Option<Duration>) {
        // Zero is refused by the TCP socket first; 0 stands for none.
        let ns = t.map_or(0, |t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
        self.timeouts[which].store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn timeout(&self, which: usize) -> Option<Duration> {
        match self.timeouts[which].load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// The read timeout set by [`Self::set_read_timeout`].
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.timeout(0))
    }

    /// The write timeout set by [`Self::set_write_timeout`].
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.timeout(1))
    }

    /// Non-blocking mode: reads and writes that would wait fail with `WouldBlock`.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nonblocking(on)?;
        self.nonblocking
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Sets `TCP_NODELAY` on the TCP connection. Over TCP (a fallback) it means what it
    /// means for [`TcpStream`]. Over SMC-R no data goes over the TCP connection; the data
    /// path has no Nagle delay but *autocorks* as Linux's SMC-R does: while a CDC of ours is
    /// still in flight, small writes wait in the send buffer and go out together when it
    /// completes (a lone write goes at once), so nothing waits for a timer. Setting it also
    /// posts what autocorking holds now, as Linux does for `TCP_NODELAY` on an SMC socket.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)?;
        if on {
            self.flush_staged()?;
        }
        Ok(())
    }

    /// `TCP_NODELAY` of the TCP connection (see [`Self::set_nodelay`]).
    pub fn nodelay(&self) -> io::Result<bool> {
        self.tcp.nodelay()
    }
}

impl std::fmt::Debug for SmcStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("SmcStream");
        if let Ok(a) = self.tcp.local_addr() {
            d.field("local", &a);
        }
        if let Ok(a) = self.tcp.peer_addr() {
            d.field("peer", &a);
        }
        d.field("mode", &self.mode);
        if let Some(id) = self.group_id() {
            d.field("link_group", &id);
        }
        d.finish_non_exhaustive()
    }
}

impl std::os::fd::AsFd for SmcStream {
    /// The TCP connection's descriptor: for socket options and addresses. Over SMC-R no data
    /// goes over it (read and write the stream; wait on [`SmcStream::readiness_fd`]).
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tcp.as_fd()
    }
}

impl std::os::fd::AsRawFd for SmcStream {
    /// The TCP connection's descriptor (see [`AsFd`](std::os::fd::AsFd)).
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&*self.tcp)
    }
}

impl Drop for SmcStream {
    fn drop(&mut self) {
        // Another handle (try_clone) still uses the connection: exactly one drop sees none.
        if self.handles.take().and_then(Arc::into_inner).is_none() {
            return;
        }
        let Some(smc) = self.smc.take() else {
            return;
        };
        smc.conn.close(&smc.lg, || linger_zero(&self.tcp));
    }
}
