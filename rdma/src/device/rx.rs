//! The receive path: the receive state (taken by the engine thread or by an application thread
//! waiting for completions), draining a socket in batches, and handing each packet to its QP.

use super::counters::bump;
use super::ids::{GSO_IDS, IdCache, icrc_matches};
use super::{EV_SOCK, QpShared, Shared, drain_eventfd};
use crate::transport::steer;
use crate::transport::udp::{RecvBatch, UdpSocket};
use crate::wire::{self, IcrcHeaders, Packet, PacketRepr};
use rustix::event::epoll;
use rustix::fd::AsFd;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The receive state, taken. A watcher of the socket woken edge-triggered
/// ([`crate::CompletionQueue::receive`]) that finds it taken leaves what came to its holder:
/// letting go, the holder receives again if such a watcher came by (else those packets would
/// wait for the next one to arrive).
pub(super) struct RxGuard<'a> {
    shared: &'a Shared,
    g: Option<parking_lot::MutexGuard<'a, RxState>>,
}

impl std::ops::Deref for RxGuard<'_> {
    type Target = RxState;
    fn deref(&self) -> &RxState {
        self.g.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for RxGuard<'_> {
    fn deref_mut(&mut self) -> &mut RxState {
        self.g.as_mut().expect("held until drop")
    }
}

impl Drop for RxGuard<'_> {
    fn drop(&mut self) {
        drop(self.g.take());
        self.shared.rx_recheck();
    }
}

/// Receive state: whoever holds it (the engine thread, or an application thread waiting for
/// completions) reads the socket.
pub(crate) struct RxState {
    batch: RecvBatch,
    dirty: Vec<Arc<QpShared>>,
    ids: IdCache,
}

impl RxState {
    pub(super) fn new() -> Self {
        Self {
            batch: RecvBatch::new(RX_BATCH),
            dirty: Vec::new(),
            ids: IdCache::default(),
        }
    }
}

const RX_BATCH: usize = 8;

/// The QP the last packet went to, kept locked for the packets behind it (a GRO batch is
/// mostly one QP's: a lock and an unlock per packet were half of `receive`'s own time), and
/// the packets counted, added to the device's counter once.
type RawGuard = <parking_lot::RawMutex as parking_lot::lock_api::RawMutex>::Guard;

struct RxRun<'a> {
    shared: &'a Shared,
    qp: Option<Arc<QpShared>>,
    /// `qp`'s core is locked by this run (`lock` below): the acquisition, given back by
    /// `release` (also on drop).
    locked: Option<RawGuard>,
    packets: u64,
}

impl<'a> RxRun<'a> {
    fn new(shared: &'a Shared) -> Self {
        Self {
            shared,
            qp: None,
            locked: None,
            packets: 0,
        }
    }

    /// QP `qpn`'s core, locked (kept locked for the next packet); `None`: no such QP.
    fn lock(&mut self, qpn: u32) -> Option<(&Arc<QpShared>, &mut super::QpCore)> {
        if self.qp.as_ref().is_none_or(|q| q.qpn != qpn) {
            // Unlocked before the lookup: no QP lock is held while taking the table's.
            self.release();
            self.qp = self.shared.lookup(qpn);
        }
        let qp = self.qp.as_ref()?;
        if self.locked.is_none() {
            crate::locks::note();
            // SAFETY: paired with the unlock in `release`, which runs before `qp` changes and
            // on drop (unwinding included).
            self.locked = Some(parking_lot::lock_api::RawMutex::lock(unsafe {
                qp.core.raw()
            }));
        }
        // SAFETY: the lock is held (above) and only reached through `&mut self`.
        Some((qp, unsafe { &mut *qp.core.data_ptr() }))
    }

    fn release(&mut self) {
        if let Some(g) = self.locked.take()
            && let Some(qp) = &self.qp
        {
            // SAFETY: locked by `lock` (the acquisition `g`) and not unlocked since.
            unsafe { parking_lot::lock_api::RawMutex::unlock(qp.core.raw(), g) };
        }
    }
}

impl Drop for RxRun<'_> {
    fn drop(&mut self) {
        self.release();
        bump(&self.shared.stats.rx_packets, self.packets);
    }
}

impl Shared {
    /// Reads and handles what waits on the socket, up to `rounds` recvmmsg calls; returns how
    /// many datagrams were handled.
    pub(super) fn rx_drain(&self, rx: &mut RxState, rounds: usize) -> usize {
        self.rx_drain_from(&self.sock, *self.local.ip(), rx, rounds)
    }

    /// [`Self::rx_drain`] for socket `sock`, whose datagrams are addressed to `to`.
    pub(super) fn rx_drain_from(
        &self,
        sock: &UdpSocket,
        to: Ipv4Addr,
        rx: &mut RxState,
        rounds: usize,
    ) -> usize {
        let gro = sock.gro();
        let own = sock.local_addr().port();
        let mut total = 0;
        for _ in 0..rounds {
            let n = match rx.batch.recv(sock) {
                Ok(n) if n > 0 => n,
                _ => break,
            };
            total += n;
            bump(&self.stats.rx_syscalls, 1);
            let now = Instant::now();
            let mut run = RxRun::new(self);
            let RxState { batch, dirty, ids } = rx;
            for i in 0..n {
                let d = batch.get(i, gro);
                let seg = d.segment.unwrap_or(d.data.len()).max(1);
                for (k, chunk) in d.data.chunks(seg).enumerate() {
                    let at = (d.to.unwrap_or(to), own);
                    if !(self.ext && wire::is_bundle(chunk)) {
                        let id = Some(k as u16).filter(|_| self.checks_icrc(chunk));
                        receive(self, now, d.from, at, chunk, id, &mut run, dirty, ids);
                        continue;
                    }
                    let Ok(bundle) = wire::parse_bundle(chunk) else {
                        bump(&self.stats.rx_malformed, 1);
                        continue;
                    };
                    bump(&self.stats.rx_bundles, 1);
                    for pkt in bundle {
                        let Ok(pkt) = pkt else {
                            // What came before the defect was handled; the rest is lost.
                            bump(&self.stats.rx_malformed, 1);
                            break;
                        };
                        let id = Some(0).filter(|_| self.checks_icrc(pkt));
                        receive(self, now, d.from, at, pkt, id, &mut run, dirty, ids);
                    }
                }
            }
            drop(run);
            for qp in dirty.drain(..) {
                let mut core = qp.core.lock();
                self.drive(&mut core, now);
            }
            if n < RX_BATCH {
                break;
            }
        }
        total
    }

    /// Whether a packet's ICRC is checked: always, unless the sender (our engine) left it out
    /// (`wire::NO_ICRC`) and we take that.
    fn checks_icrc(&self, pkt: &[u8]) -> bool {
        !(self.take_no_icrc
            && wire::has_flag(pkt, wire::NO_ICRC)
            && wire::has_flag(pkt, wire::MARK))
    }

    /// Turns the engine thread's interest in the socket on or off. An application thread that
    /// receives for itself turns it off, so that the engine is not woken (on the other core) by
    /// packets the application thread handles anyway.
    ///
    /// Counted: each `false` (a thread that receives, an event loop that holds a group and
    /// watches the socket itself, see [`Self::delegate_rx`]) needs its `true`; the interest
    /// is back when none is left.
    pub(super) fn engine_rx_interest(&self, on: bool) {
        let mut away = self.receive.rx_away.lock();
        if on {
            *away = away.saturating_sub(1);
            if *away > 0 {
                return;
            }
        } else {
            *away += 1;
            if *away > 1 {
                return;
            }
        }
        let flags = if on {
            epoll::EventFlags::IN
        } else {
            epoll::EventFlags::empty()
        };
        let _ = epoll::modify(
            &self.epoll,
            self.sock.fd().as_fd(),
            epoll::EventData::new_u64(EV_SOCK),
            flags,
        );
    }

    /// A thread about to wait on the socket takes it from the engine thread: the hand-back
    /// its previous wait left (see [`Self::rx_give`]) costs nothing, else the engine's
    /// interest goes off. `keep_timers`: it also keeps the timers meanwhile (see
    /// [`Self::timer_keeper`]; [`Self::rx_give`] is told the same).
    pub(super) fn rx_take(&self, keep_timers: bool) {
        if keep_timers {
            self.timer_keeper(true);
        }
        if !self.receive.rx_sticky.swap(false, Ordering::SeqCst) {
            self.engine_rx_interest(false);
        }
    }

    /// A waiting thread takes the socket (`true`) or gives it back: while it holds it, it
    /// also runs the due timers and bounds its sleeps by the next one, and the engine thread
    /// sleeps until [`TIMER_GRACE`](super::engine::TIMER_GRACE) after the next deadline (until
    /// that long after the last such thread let go).
    pub(super) fn timer_keeper(&self, on: bool) {
        if on {
            self.timers.keepers.fetch_add(1, Ordering::SeqCst);
        } else {
            self.timers
                .kept_at
                .store(self.nanos(Instant::now()), Ordering::Relaxed);
            self.timers.keepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A thread's wait is over: the socket goes back to the engine thread, at once, or with
    /// [`DeviceConfig::rx_hold`](super::DeviceConfig::rx_hold) only when the thread has not
    /// come back for it by then (the engine's `RX_HOLD_TIMER`).
    pub(super) fn rx_give(&self, kept_timers: bool) {
        if kept_timers {
            self.timer_keeper(false);
        }
        if self.cfg.rx_hold.is_zero() {
            self.engine_rx_interest(true);
            return;
        }
        let until = Instant::now() + self.cfg.rx_hold;
        self.receive
            .rx_sticky_until
            .store(self.nanos(until), Ordering::SeqCst);
        if self.receive.rx_sticky.swap(true, Ordering::SeqCst) {
            // Another thread's hand-back is held already (it let go of the receive state, we
            // took it before its hand-back was set, and turned the interest off a second
            // time): one held count is enough, ours goes back.
            self.engine_rx_interest(true);
        }
        if !self.receive.rx_sticky_armed.swap(true, Ordering::SeqCst) {
            self.schedule(until, super::engine::RX_HOLD_TIMER);
        }
    }

    /// The engine's `RX_HOLD_TIMER`: the hand-back ends unless its thread came back (then it
    /// was extended: look again then).
    pub(super) fn rx_hold_due(&self, now: Instant) {
        self.receive.rx_sticky_armed.store(false, Ordering::SeqCst);
        if !self.receive.rx_sticky.load(Ordering::SeqCst) {
            return;
        }
        let until = self.receive.rx_sticky_until.load(Ordering::SeqCst);
        if self.nanos(now) < until {
            if !self.receive.rx_sticky_armed.swap(true, Ordering::SeqCst) {
                let at = self.base + std::time::Duration::from_nanos(until);
                self.schedule(at, super::engine::RX_HOLD_TIMER);
            }
            return;
        }
        if self.receive.rx_sticky.swap(false, Ordering::SeqCst) {
            self.engine_rx_interest(true);
        }
    }

    /// See [`crate::CqScheduler::delegate_rx`].
    pub(crate) fn delegate_rx(&self, on: bool) {
        if on {
            if self.receive.delegated.fetch_add(1, Ordering::SeqCst) == 0 {
                let _ = rustix::io::write(&self.receive.rx_yield, &1u64.to_ne_bytes());
            }
        } else if self.receive.delegated.fetch_sub(1, Ordering::SeqCst) == 1 {
            drain_eventfd(&self.receive.rx_yield);
        }
        self.engine_rx_interest(!on);
    }

    /// See [`crate::CompletionQueue::receive`]: drains the socket (the watcher is woken
    /// edge-triggered, so what is left would wake nobody).
    pub(crate) fn receive_now(&self) -> usize {
        let mut total = 0;
        loop {
            self.receive.rx_wanted.want();
            // Taken: its holder receives again once it lets go.
            let Some(mut rx) = self.receive.rx.try_lock() else {
                return total;
            };
            self.receive.rx_wanted.served();
            total += self.rx_drain(&mut rx, usize::MAX);
            drop(rx);
            if !self.receive.rx_wanted.after_release() {
                return total;
            }
        }
    }

    /// Takes the receive state if free (see [`RxGuard`]).
    pub(super) fn rx_try(&self) -> Option<RxGuard<'_>> {
        self.receive.rx.try_lock().map(|g| RxGuard {
            shared: self,
            g: Some(g),
        })
    }

    /// After letting go of the receive state: a thread that wanted it meanwhile (woken by
    /// the socket, edge-triggered) left its packets to us.
    fn rx_recheck(&self) -> usize {
        // (Not while unwinding: a second panic would abort.)
        if self.receive.rx_wanted.after_release() && !std::thread::panicking() {
            self.receive_now()
        } else {
            0
        }
    }
}

/// Handles one packet. `ip_id`: the IPv4 identification its ICRC was computed with (the GSO
/// segment's index, the first one tried); `None`: the ICRC is not checked (a packet of our
/// engine that said so, see [`wire::NO_ICRC`]; the UDP checksum covered it).
#[allow(clippy::too_many_arguments)] // one packet and the receive loop's scratch state
fn receive(
    shared: &Shared,
    now: Instant,
    from: SocketAddrV4,
    (to, own_port): (Ipv4Addr, u16),
    bytes: &[u8],
    ip_id: Option<u16>,
    run: &mut RxRun<'_>,
    dirty: &mut Vec<Arc<QpShared>>,
    ids: &mut IdCache,
) {
    let st = &shared.stats;
    if steer::is_probe(bytes) {
        return; // a device's steering probe (ours, late, or another's while we own 4791)
    }
    run.packets += 1;
    let h = IcrcHeaders {
        src: *from.ip(),
        dst: to,
        ip_id: ip_id.unwrap_or(0),
        df: true,
        sport: from.port(),
        // As addressed by the sender (before steering), not our socket's port.
        dport: shared.addressed,
    };
    let capture = |id: Option<u16>| {
        if let Some(mw) = &shared.mw
            && let Some(p) = &mut mw.lock().pcap
        {
            // With the identification the ICRC was computed with, when it was found.
            let h = IcrcHeaders {
                ip_id: id.unwrap_or(h.ip_id),
                ..h
            };
            let _ = p.write_packet(&h, shared.cfg.ttl, bytes);
        }
    };
    let Ok(pkt) = Packet::new_checked(bytes) else {
        capture(None);
        bump(&st.rx_malformed, 1);
        return;
    };
    let id = if ip_id.is_some() {
        let Some(id) = icrc_matches(h, [shared.addressed, own_port], bytes, ids) else {
            capture(None);
            bump(&st.rx_icrc_errors, 1);
            return;
        };
        id
    } else {
        0
    };
    capture(Some(id));
    if id >= GSO_IDS {
        // Not a GSO segment index: a sender numbering its datagrams like Linux rxe does.
        bump(&st.rx_foreign_ip_id, 1);
    }
    let Ok(repr) = PacketRepr::parse(&pkt) else {
        bump(&st.rx_malformed, 1);
        return;
    };
    let qpn = repr.bth.dest_qp;
    let Some((qp, core)) = run.lock(qpn) else {
        bump(&st.rx_unknown_qp, 1);
        return;
    };
    // rxe accepts a packet only from the QP's peer address (Linux peers vary the source port).
    if core.av.is_none_or(|av| av.ip() != from.ip()) {
        bump(&st.rx_wrong_source, 1);
        return;
    }
    if shared.ext && wire::has_flag(bytes, wire::MARK) {
        // Our engine: a held ACK (QpCaps::ack_delay, smcr's SMCR_ACK_DELAY_US) rides in the
        // answer's bundle at no cost.
        core.peer_ext = true;
        core.peer_no_icrc = wire::has_flag(bytes, wire::TAKES_NO_ICRC);
    }
    core.rc.handle_packet(now, &repr, &shared.mrs);
    if core.rc.holds_ack() {
        super::held::note(qp);
    }
    if !dirty.iter().any(|d| Arc::ptr_eq(d, qp)) {
        dirty.push(qp.clone());
    }
}
