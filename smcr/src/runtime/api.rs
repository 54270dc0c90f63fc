//! `Runtime`: the public handle — creation, marking sockets, ending, diagnostics.

#[allow(unused_imports)]
use super::*;

impl Runtime {
    /// A runtime with `cfg`. With TCP-option negotiation, the option records are probed now; if
    /// that fails every connection falls back to TCP with the reason (see [`crate::Mode`]).
    pub fn new(cfg: RuntimeConfig) -> Self {
        Self::with_clock(cfg, clock::Clock::default())
    }

    /// [`Self::new`] with the link groups' timers on `clock`.
    pub(super) fn with_clock(mut cfg: RuntimeConfig, clock: clock::Clock) -> Self {
        if !cfg.alt_addrs.is_empty() {
            // A second path: offer two links per group (Linux's default); without one, a
            // single link, so peers never try to add a link we could not run.
            cfg.handshake.max_links = cfg.handshake.max_links.max(2);
        }
        // No area is no accelerator failure: smc-stat just does not see this process.
        // Areas of processes that are gone (the preload's runtime is never dropped) are
        // removed by whoever starts next.
        let cfg_stats = cfg
            .stats_dir
            .as_deref()
            .and_then(|d| {
                crate::stats::clean_stale(d);
                crate::stats::Area::create_anywhere(d, STATS_CONN_SLOTS, STATS_LG_SLOTS).ok()
            })
            .map(Arc::new);
        let option = match &cfg.negotiation {
            Negotiation::TcpOption { dir } => OptionRecords::open(dir).map_err(|e| e.to_string()),
            Negotiation::Assume => Err("not used".into()),
        };
        if let (Negotiation::TcpOption { .. }, Err(_), Some(a)) =
            (&cfg.negotiation, &option, &cfg_stats)
        {
            a.set_unavailable(crate::FallbackReason::CODE_NO_BPF);
        }
        Self {
            inner: Arc::new(Inner {
                cfg,
                option,
                devices: Mutex::new(HashMap::new()),
                groups: Mutex::new(Vec::new()),
                next_token: AtomicU32::new(random_u32() | 1),
                next_lgr: AtomicU32::new(1),
                rmb_in_use: Mutex::new(0),
                pin_cap: AtomicU64::new(u64::MAX),
                links_confirmed: AtomicU32::new(0),
                failovers: AtomicU32::new(0),
                rkey_requests: AtomicU32::new(0),
                pending: Mutex::new(HashMap::new()),
                stats: cfg_stats,
                fallback_rows: Mutex::new(FallbackRows::default()),
                local_addrs: Mutex::new(HashMap::new()),
                problem: Mutex::new(None),
                clock,
            }),
        }
    }

    /// Counts `code` among the process's codes (smc-stat's fallback counters) for a
    /// connection that has no row of its own (a failure whose cause has a code).
    pub fn count_code(&self, code: u32) {
        self.inner.count_code(code);
    }

    /// The shared-memory stats area of this runtime (see [`crate::stats`]), if any.
    pub fn stats_path(&self) -> Option<&std::path::Path> {
        self.inner.stats.as_deref().map(crate::stats::Area::path)
    }

    /// The settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.cfg
    }

    /// Marks a TCP socket for the SMC-R option (before `listen`); false when the option
    /// program is unusable or negotiation does not use it.
    pub fn mark(&self, sock: std::os::fd::BorrowedFd<'_>) -> bool {
        self.mark_as(sock, false)
    }

    /// [`Runtime::mark`] before `connect` (the record says the socket is a client's).
    pub fn mark_connecting(&self, sock: std::os::fd::BorrowedFd<'_>) -> bool {
        self.mark_as(sock, true)
    }

    pub(super) fn mark_as(&self, sock: std::os::fd::BorrowedFd<'_>, connecting: bool) -> bool {
        match (&self.inner.cfg.negotiation, &self.inner.option) {
            (Negotiation::TcpOption { .. }, Ok(map)) => map.mark(sock, connecting).is_ok(),
            (Negotiation::Assume, _) => true,
            _ => false,
        }
    }

    /// Why SMC-R cannot be negotiated at all here (the TCP option program is not installed or
    /// not usable by this user), to tell the user once; `None` when it can.
    pub fn negotiation_problem(&self) -> Option<&str> {
        match (&self.inner.cfg.negotiation, &self.inner.option) {
            (Negotiation::TcpOption { .. }, Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Why SMC-R could not be had for the last connection declined for a local condition
    /// (e.g. a device that cannot receive RoCE from other hosts), if any.
    pub fn problem(&self) -> Option<String> {
        self.inner.problem.lock().clone()
    }

    /// Threads this runtime will need for its first SMC-R connection and does not run yet:
    /// the device's engine (until one is open) and the TCP hang-up watch (until it runs in
    /// this process). The preload parks that many spares beyond `SMCR_SPARE_THREADS` before
    /// the program forbids new threads.
    pub fn threads_to_come(&self) -> usize {
        usize::from(self.inner.devices.lock().is_empty()) + usize::from(!crate::tcpwatch::runs())
    }

    /// Link groups currently alive.
    pub fn link_groups(&self) -> usize {
        self.inner
            .groups
            .lock()
            .iter()
            .filter(|g| !g.is_down())
            .count()
    }

    /// The end of the process (the preload calls it at `exit`, after closing the program's
    /// connections as the kernel would): waits, up to `limit` in all, until what the
    /// connections still hold is written and acknowledged, then deletes every link group
    /// (DELETE LINK, as Linux does when it ends its groups) and waits for the peers to
    /// acknowledge that too. Without it a peer learns of our end only from TEST LINK (Linux:
    /// 30 s and retries), and data not yet acknowledged on the wire is lost.
    pub fn end(&self) {
        self.end_within(self.inner.cfg.exit_drain);
    }

    /// [`Self::end`] with another bound (plus at most 200 ms, `DELETE_LINK_GRACE`, for the DELETE
    /// LINKs when the drain used it all).
    pub fn end_within(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let groups: Vec<Arc<LinkGroup>> = self.inner.groups.lock().clone();
        for g in &groups {
            g.wait(deadline, |g| g.drained());
        }
        // On a verbs device: a peer answers our closes with its own (at once, for a program
        // that reads EOF and closes), its device resends that CDC until it is acknowledged,
        // and the kernel's close waits for that (forever over rxe, which takes SMC-R's retry
        // count 7 for infinite) — but our queue pair dies with the process. Stay a moment for
        // those answers. (Our engine's links go on as before: the DELETE LINK right after the
        // drain ends the peer's connections as a reset would.)
        let settle = deadline.min(Instant::now() + PEER_CLOSE_WAIT);
        for g in groups.iter().filter(|g| g.dev.device.is_verbs()) {
            g.wait(settle, |g| g.peers_closed());
        }
        // The groups go; the stats area stays (unlike `shutdown`), so that what the process
        // did can still be read after it ended, until smc-stat finds the area stale.
        self.delete_groups();
        // The DELETE LINKs get a moment to leave even when the drain used the whole budget
        // (one behind a full send window waits for ACKs the engine must still receive);
        // otherwise the peer keeps the group until its TEST LINK gives up.
        let deadline = deadline.max(Instant::now() + DELETE_LINK_GRACE);
        for g in &groups {
            g.wait(deadline, |g| g.sends_done());
        }
    }

    /// Removes the stats area's file, so readers stop finding it (the process is about to
    /// become another program image, which never updates it again).
    pub fn unlink_stats(&self) {
        if let Some(a) = &self.inner.stats {
            a.unlink();
        }
    }

    /// Deletes every link group (DELETE LINK to the peers); their connections fail.
    pub fn shutdown(&self) {
        self.delete_groups();
        // Threads may still hold the runtime for a while; its stats are over now.
        self.unlink_stats();
    }

    /// Deletes every link group (DELETE LINK to the peers).
    pub(super) fn delete_groups(&self) {
        let groups: Vec<_> = self.inner.groups.lock().drain(..).collect();
        for g in groups {
            g.terminate();
        }
    }

    /// A multi-line description of devices and link groups, for diagnostics.
    pub fn debug_summary(&self) -> String {
        let mut out = String::new();
        for (ip, d) in self.inner.devices.lock().iter() {
            out += &format!("device {ip}: {:?}\n", d.device.stats());
        }
        for g in self.inner.groups.lock().iter() {
            let st = g.st.lock();
            out += &format!(
                "link group {} {:?} peer {:?} up={} down={:?} spare_up={} last_failover={:?} \
                 conns={} free_slots={}\n  {}\n",
                g.id,
                g.role,
                g.peer_gid.to_ipv4(),
                st.g.is_up(),
                st.g.down(),
                st.g.spare_up(),
                st.g.last_failover(),
                st.g.conns.len(),
                st.g.conns.free_slots(),
                g.paths
                    .iter()
                    .map(|p| p.qp.summary())
                    .collect::<Vec<_>>()
                    .join("\n  ")
            );
        }
        out
    }

    /// The number of usable links of each live link group (1, or 2 with a second path).
    pub fn group_links(&self) -> Vec<usize> {
        self.inner
            .groups
            .lock()
            .iter()
            .filter(|g| !g.is_down())
            .map(|g| g.links())
            .collect()
    }

    /// TEST LINK keepalives sent by the active links of the live groups.
    pub fn test_links_sent(&self) -> u64 {
        self.inner
            .groups
            .lock()
            .iter()
            .map(|g| g.test_links_sent())
            .sum()
    }

    /// Times a link failed and its group's connections moved to the other link.
    pub fn failovers(&self) -> u32 {
        self.inner.failovers.load(Ordering::Relaxed)
    }

    /// Bytes of RMB memory the runtime holds (connections' RMBs and the pooled ones), counted
    /// against [`RuntimeConfig::rmb_budget`].
    pub fn rmb_in_use(&self) -> u64 {
        *self.inner.rmb_in_use.lock()
    }

    /// The device behind each local address this runtime opened: `None` for our engine, the
    /// verbs device's name (`rxe0`, `mlx5_0`) otherwise.
    pub fn devices(&self) -> Vec<(Ipv4Addr, Option<String>)> {
        self.inner
            .devices
            .lock()
            .iter()
            .map(|(ip, d)| (*ip, d.device.verbs().map(|v| v.name)))
            .collect()
    }

    /// The counters of each RoCE device (local address) this runtime opened.
    pub fn device_stats(&self) -> Vec<(Ipv4Addr, rdma::DeviceStats)> {
        self.inner
            .devices
            .lock()
            .iter()
            .map(|(ip, d)| (*ip, d.device.stats()))
            .collect()
    }

    /// Link confirmations (CONFIRM LINK exchanges, first links and added ones) so far.
    pub fn links_confirmed(&self) -> u32 {
        self.inner.links_confirmed.load(Ordering::Relaxed)
    }

    /// CONFIRM RKEY and DELETE RKEY requests sent so far (LLC round trips a connection's
    /// setup or end cost; see [`RuntimeConfig::rkey_reuse`]).
    pub fn rkey_requests(&self) -> u32 {
        self.inner.rkey_requests.load(Ordering::Relaxed)
    }
}

/// How long [`Runtime::end_within`] waits at least for the DELETE LINKs to be acknowledged.
const DELETE_LINK_GRACE: Duration = Duration::from_millis(200);

/// How long the end of the process waits for peers on a verbs device to answer its closes (see
/// `end_within`): a round trip and the peer program's reaction, not its idle time.
const PEER_CLOSE_WAIT: Duration = Duration::from_millis(300);

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cfg = &self.inner.cfg;
        f.debug_struct("Runtime")
            .field("negotiation", &cfg.negotiation)
            .field("option_program", &self.inner.option.is_ok())
            .field("roce_port", &cfg.roce_port)
            .field("link_groups", &self.link_groups())
            .finish_non_exhaustive()
    }
}
