//! The shared runtime state (`Inner`): devices by address, link groups, tokens, the RMB
//! budget, handshake serialisation, fallback rows.

#[allow(unused_imports)]
use super::*;

impl Drop for Inner {
    /// The last handle is gone: delete the link groups (their pollers then stop).
    fn drop(&mut self) {
        for g in self.groups.get_mut().drain(..) {
            g.terminate();
        }
    }
}

impl Inner {
    /// Records why a connection could not have SMC-R here (see [`Runtime::problem`]).
    pub(crate) fn note(&self, why: String) {
        *self.problem.lock() = Some(why);
    }

    /// The RMB size connections use.
    pub(crate) fn rmb_size(&self) -> clc::RmbSize {
        clc::RmbSize::round_up(self.cfg.rmb_size.clamp(16 * 1024, 512 * 1024))
    }

    /// The RMB size for a connection with `peer`: the configured one, or larger (the
    /// same-host or remote size) while large RMBs hold at most a quarter of the budget — a
    /// few busy connections get room for bulk, many get Linux's size, and the budget is not
    /// spent on the first ones.
    pub(crate) fn rmb_size_for(&self, peer: Ipv4Addr) -> clc::RmbSize {
        let base = self.rmb_size();
        let want = if self.cfg.same_host && self.is_local(peer) {
            self.cfg.same_host_rmb_size
        } else {
            self.cfg.remote_rmb_size
        };
        let Some(want) = want else {
            return base;
        };
        let large = clc::RmbSize::round_up(want.clamp(16 * 1024, 512 * 1024));
        if large.bytes() <= base.bytes() {
            return base;
        }
        let used = *self.rmb_in_use.lock();
        if used + u64::from(large.bytes()) > self.rmb_budget() / 4 {
            return base;
        }
        large
    }

    /// Whether `ip` is an address of this host in our network namespace (it can be bound).
    pub(super) fn is_local(&self, ip: Ipv4Addr) -> bool {
        if let Some(&v) = self.local_addrs.lock().get(&ip) {
            return v;
        }
        // A raw socket call: inside the preload, libc's would be our own hook.
        let v = (|| -> io::Result<()> {
            use rustix::net::{AddressFamily, SocketFlags, SocketType};
            let s = rustix::net::socket_with(
                AddressFamily::INET,
                SocketType::DGRAM,
                SocketFlags::CLOEXEC,
                None,
            )?;
            rustix::net::bind(&s, &std::net::SocketAddr::from((ip, 0)))?;
            Ok(())
        })()
        .is_ok();
        self.local_addrs.lock().insert(ip, v);
        v
    }

    pub(crate) fn device(&self, ip: Ipv4Addr) -> io::Result<Arc<Dev>> {
        let mut devs = self.devices.lock();
        if let Some(d) = devs.get(&ip) {
            return Ok(d.clone());
        }
        if let Some(d) = self.verbs_device(ip, &devs)? {
            devs.insert(ip, d.clone());
            return Ok(d);
        }
        if self.cfg.roce_port == crate::steer::ROCE_PORT {
            // Root in its own network namespace: steer there, so that this process and the
            // others on the address all reach their peers (else the device finds out itself:
            // steered, owner of 4791, or local-only).
            let dir = match &self.cfg.negotiation {
                Negotiation::TcpOption { dir } => dir.as_path(),
                Negotiation::Assume => std::path::Path::new(crate::option::DEFAULT_DIR),
            };
            crate::steer::runtime_attach(self.cfg.steer_attach, dir, ip);
        }
        let mut dcfg = DeviceConfig::new(SocketAddrV4::new(ip, self.cfg.roce_port));
        dcfg.faults = self.cfg.faults;
        dcfg.icrc_always |= self.cfg.rdma_icrc_always;
        dcfg.ext &= self.cfg.rdma_ext;
        rdma::cork::set_enabled(self.cfg.cork);
        // A thread blocked in a read keeps the socket between its waits as long as an event
        // loop keeps its group (SMCR_HOLD_US).
        dcfg.rx_hold = self.cfg.app_hold;
        // Multi-homed: the second link of a group is a second queue pair of this device,
        // sending from an alternate address (same memory regions, same CQ). Each device gets
        // its own (the first configured one no other device has or is; none for a loopback
        // address, whose peers are on this host).
        let alt = (!ip.is_loopback())
            .then(|| {
                self.cfg
                    .alt_addrs
                    .iter()
                    .copied()
                    .find(|&a| a != ip && !devs.values().any(|d| d.ip == a || d.alt == Some(a)))
            })
            .flatten();
        dcfg.extra_addrs = alt.into_iter().collect();
        // The engine counts into our stats area, where smc-stat reads it.
        let counters = self.stats.as_ref().and_then(|area| {
            let slot = area.claim_dev()?;
            Some(Arc::new(DevCounters {
                area: area.clone(),
                slot,
            }))
        });
        dcfg.counters = counters
            .clone()
            .map(|c| rdma::SharedCounters(c as Arc<dyn rdma::CounterWords>));
        let (device, alt) = match Device::open(dcfg.clone()) {
            Ok(d) => (d, alt),
            // The alternate address cannot be had (not on this host, or another process has
            // its port): this address still runs SMC-R, on one link per group.
            Err(_) if alt.is_some() => {
                dcfg.extra_addrs.clear();
                (Device::open(dcfg)?, None)
            }
            Err(e) => return Err(e),
        };
        if let Some(c) = &counters {
            let mode = match device.mode() {
                rdma::transport::steer::PortMode::Steered => 1,
                rdma::transport::steer::PortMode::Owner => 2,
                rdma::transport::steer::PortMode::LocalOnly => 3,
                rdma::transport::steer::PortMode::Fixed => 4,
                rdma::transport::steer::PortMode::Verbs => 5,
            };
            c.area
                .set_dev(c.slot, device.local_addr(), mode, device.qpn_range());
        }
        let o = ip.octets();
        let d = Arc::new(Dev {
            ip,
            alt,
            device,
            // Locally administered, derived from the address: our "port" has no real MAC.
            mac: Mac([0x02, 0x00, o[0], o[1], o[2], o[3]]),
        });
        devs.insert(ip, d.clone());
        Ok(d)
    }

    /// The verbs device for `ip` (see [`crate::RdmaDevice`]): `None` for our engine.
    fn verbs_device(
        &self,
        ip: Ipv4Addr,
        devs: &HashMap<Ipv4Addr, Arc<Dev>>,
    ) -> io::Result<Option<Arc<Dev>>> {
        use crate::RdmaDevice;
        if self.cfg.rdma_device == RdmaDevice::Engine {
            return Ok(None);
        }
        let ports = rdma::ibv::sysfs::scan(std::path::Path::new(rdma::ibv::sysfs::SYSFS_ROOT));
        let Some((port, entry)) = rdma::ibv::sysfs::roce_v2_for(&ports, ip) else {
            if self.cfg.rdma_device == RdmaDevice::Verbs {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "no active RDMA device has a RoCE v2 GID for {ip} (SMCR_RDMA_DEVICE=verbs)"
                    ),
                ));
            }
            return Ok(None);
        };
        // A second path: the first configured alternate address with a RoCE v2 GID on the
        // same port (one protection domain and CQ serve both queue pairs) that no other
        // device has or is.
        let alt = self
            .cfg
            .alt_addrs
            .iter()
            .copied()
            .filter(|&a| a != ip && !devs.values().any(|d| d.ip == a || d.alt == Some(a)))
            .find_map(|a| {
                let (p, g) = rdma::ibv::sysfs::roce_v2_for(&ports, a)?;
                (p.device == port.device && p.port == port.port).then_some((a, g.index))
            });
        let alts: Vec<(Ipv4Addr, u32)> = alt.into_iter().collect();
        let opened = Device::open_verbs(&port.device, port.port, entry.index, ip, &alts)
            .map(|d| (d, alt.map(|(a, _)| a)))
            .or_else(|e| match alt {
                // The alternate's entry changed under us: one link per group.
                Some(_) => Device::open_verbs(&port.device, port.port, entry.index, ip, &[])
                    .map(|d| (d, None)),
                None => Err(e),
            });
        let (device, alt) = match opened {
            Ok(d) => d,
            Err(e) if self.cfg.rdma_device == RdmaDevice::Auto => {
                log::info!(
                    "{} port {} has {ip} but cannot be used ({e}): our engine serves it",
                    port.device,
                    port.port
                );
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.cap_pinning();
        log::info!(
            "{ip}: links on verbs device {} port {} (RoCE v2 GID index {}){}",
            port.device,
            port.port,
            entry.index,
            alt.map(|a| format!(", second paths from {a}"))
                .unwrap_or_default()
        );
        if let Some(area) = &self.stats
            && let Some(slot) = area.claim_dev()
        {
            area.set_dev(slot, device.local_addr(), 5, 0);
        }
        // The port's own MAC (the CLC carries it; RoCE v2 peers address by GID).
        let mac = entry
            .netdev
            .as_deref()
            .and_then(|nd| std::fs::read_to_string(format!("/sys/class/net/{nd}/address")).ok())
            .and_then(|t| parse_mac(t.trim()))
            .unwrap_or_else(|| {
                let o = ip.octets();
                Mac([0x02, 0x00, o[0], o[1], o[2], o[3]])
            });
        Ok(Some(Arc::new(Dev {
            ip,
            alt,
            device,
            mac,
        })))
    }

    /// The lock serialising handshakes of `role` with `peer`.
    pub(crate) fn pending(&self, server: bool, peer: Ipv4Addr) -> PendingLock {
        self.pending
            .lock()
            .entry((server, peer))
            .or_default()
            .clone()
    }

    pub(crate) fn token(&self) -> u32 {
        loop {
            let t = self.next_token.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t;
            }
        }
    }

    /// Reserves RMB memory against the budget.
    pub(crate) fn reserve_rmb(&self, bytes: u32) -> bool {
        let mut used = self.rmb_in_use.lock();
        if *used + u64::from(bytes) > self.rmb_budget() {
            return false;
        }
        *used += u64::from(bytes);
        true
    }

    /// The RMB budget: the configured one, or less where pinning is limited (see
    /// [`Self::cap_pinning`]).
    pub(crate) fn rmb_budget(&self) -> u64 {
        self.cfg
            .rmb_budget
            .min(self.pin_cap.load(Ordering::Relaxed))
    }

    /// A verbs device was opened: its registrations pin memory, counted against
    /// RLIMIT_MEMLOCK unless this process has CAP_IPC_LOCK. Each RMB has a send buffer of
    /// (about) its size, and the groups' own buffers take a little: RMBs get under half.
    fn cap_pinning(&self) {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: valid out pointer.
        let limited = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0
            && lim.rlim_cur != libc::RLIM_INFINITY;
        if !limited || has_ipc_lock() {
            return;
        }
        let cap = (lim.rlim_cur / 2).saturating_sub(256 * 1024);
        self.pin_cap.fetch_min(cap, Ordering::Relaxed);
        log::info!(
            "pinned memory is limited to {} KiB (RLIMIT_MEMLOCK): RMBs on RDMA devices get {} KiB; \
             connections beyond it stay TCP (raise `ulimit -l` or LimitMEMLOCK= for more)",
            lim.rlim_cur / 1024,
            cap / 1024
        );
    }

    pub(crate) fn release_rmb(&self, bytes: u32) {
        let mut used = self.rmb_in_use.lock();
        *used = used.saturating_sub(u64::from(bytes));
    }

    /// A live link group to the peer system `peer_id` at `peer_gid` where we have `role`,
    /// with room for a connection (client: the server's QPN must match the Accept).
    pub(crate) fn find_group(
        &self,
        local: Ipv4Addr,
        peer_gid: Gid,
        role: link::Role,
        peer_id: PeerId,
        peer_qpn: Option<u32>,
    ) -> Option<Arc<LinkGroup>> {
        let groups = self.groups.lock();
        groups
            .iter()
            .find(|g| {
                g.role == role
                    && g.dev.ip == local
                    && g.peer_id == peer_id
                    // A client finds the group by the link the server's Accept names (any
                    // of its links, as Linux's `smcr_lgr_match`); a server by the client's GID.
                    && match peer_qpn {
                        Some(q) => g.has_peer_link(peer_gid, q),
                        None => g.peer_gid == peer_gid,
                    }
                    && g.is_up()
                    && g.has_room()
            })
            .cloned()
    }

    /// Counts `code` among the process's codes (smc-stat's fallback counters) with no
    /// connection of its own: a failure whose cause has a code ([`crate::not_clc`]).
    pub(crate) fn count_code(&self, code: u32) {
        if let Some(a) = &self.stats {
            a.count_fallback(code);
        }
    }

    /// A handshake failed with no fallback (the connection was reset).
    pub(crate) fn handshake_failed(&self) {
        if let Some(a) = &self.stats {
            a.count(crate::stats::total::FAILED);
        }
        crate::metrics::handshake_failed();
    }

    /// Keeps a fallback socket's record until its descriptor is closed. Records whose
    /// descriptor is gone (closed, or the number now holds another file) are freed by a
    /// sweep of a few entries per call (`smc-stat` hides them meanwhile).
    pub(crate) fn keep_fallback_row(&self, st: crate::stats::StatSlot, fd: i32, ino: u64) {
        let mut f = self.fallback_rows.lock();
        let gone = |&(_, fd, ino): &(crate::stats::StatSlot, i32, u64)| {
            crate::sys::socket_inode(fd) != Some(ino)
        };
        let n = f.rows.len();
        if n > 0 {
            let mut i = f.next % n;
            for _ in 0..n.min(16) {
                if i >= f.rows.len() {
                    i = 0;
                }
                if gone(&f.rows[i]) {
                    f.rows.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            f.next = i;
        }
        f.rows.push((st, fd, ino));
    }

    pub(crate) fn add_group(&self, g: Arc<LinkGroup>) {
        let mut groups = self.groups.lock();
        groups.retain(|g| !g.is_down());
        groups.push(g);
    }
}

impl Runtime {
    /// How the device on local address `ip` receives (opening it as a handshake would): see
    /// [`crate::steer::PortMode`].
    pub fn device_mode(&self, ip: Ipv4Addr) -> io::Result<crate::steer::PortMode> {
        Ok(self.inner.device(ip)?.mode())
    }

    /// Whether the device on `local` (opened if needed) can run a link with a peer at
    /// `peer`; `Err` with the reason when it is local-only and the peer is elsewhere (what a
    /// handshake declines with `NOSMCRDEV`; see `Dev::reaches`).
    pub fn device_reaches(
        &self,
        local: Ipv4Addr,
        peer: Ipv4Addr,
    ) -> io::Result<Result<(), Unreachable>> {
        Ok(self
            .inner
            .device(local)?
            .reaches(peer, self.inner.cfg.same_host))
    }
}

impl Dev {
    /// How the device receives (see [`crate::steer::PortMode`]).
    pub(crate) fn mode(&self) -> crate::steer::PortMode {
        self.device.mode()
    }

    /// Whether the device can run a link with a peer at `peer`: always when peers elsewhere
    /// reach it; when it is local-only, only with a peer on this host (in this network
    /// namespace) through shared memory (`same_host`: [`crate::RuntimeConfig::same_host`]).
    /// `Err`: why not, for the log and the fallback record (decline with `NOSMCRDEV`).
    pub(crate) fn reaches(&self, peer: Ipv4Addr, same_host: bool) -> Result<(), Unreachable> {
        if self.reaches_remote() || (same_host && crate::steer::on_this_host(peer)) {
            Ok(())
        } else if same_host {
            Err(Unreachable::LocalOnly { ip: self.ip })
        } else {
            Err(Unreachable::SameHostOff { ip: self.ip })
        }
    }

    /// Whether peers on other hosts reach the device (false when it is local-only).
    pub(crate) fn reaches_remote(&self) -> bool {
        self.device.reaches_remote()
    }
}

/// `52:54:00:77:00:02` → its bytes.
fn parse_mac(s: &str) -> Option<Mac> {
    let mut m = [0u8; 6];
    let mut n = 0;
    for part in s.split(':') {
        *m.get_mut(n)? = u8::from_str_radix(part, 16).ok()?;
        n += 1;
    }
    (n == 6).then_some(Mac(m))
}

/// Whether this process may pin memory without limit (CAP_IPC_LOCK in its effective set).
fn has_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            let hex = t
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        // CAP_IPC_LOCK is capability 14 (linux/capability.h).
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

#[cfg(test)]
mod mac_tests {
    use super::*;

    #[test]
    fn macs_parse_as_sysfs_writes_them() {
        assert_eq!(
            parse_mac("52:54:00:77:00:02"),
            Some(Mac([0x52, 0x54, 0, 0x77, 0, 2]))
        );
        for bad in [
            "",
            "52:54:00:77:00",
            "52:54:00:77:00:02:03",
            "zz:54:00:77:00:02",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad:?}");
        }
    }
}
