//! The engine's side of the same-host transport ([`crate::samehost`]): offers accepted on the
//! rendezvous and given to their QPs, peers that refuse an offer or go away, and the same-host
//! rings of a CQ's QPs polled by whoever waits on the CQ.

use super::counters::bump;
use super::cq::CqShared;
use super::{EV_OFFER, EV_OFFERED, EV_PEER, QpCore, Shared};
use crate::notify::Sleepers;
use rustix::event::epoll;
use rustix::fd::{AsFd, OwnedFd};
use std::io;
use std::time::Instant;

impl Shared {
    /// Accepts connections on the rendezvous; their offers are read when they arrive.
    pub(super) fn accept_offers(&self) {
        let Some(l) = &self.rendezvous else { return };
        while let Ok(c) = rustix::net::accept_with(
            l,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
        ) {
            if !crate::samehost::trusted(c.as_fd()) || self.offers.lock().len() >= 256 {
                continue; // another user, or too many silent connections: dropped (UDP)
            }
            let Ok(c) = crate::fdzone::place(c) else {
                continue; // no room for it: the peer's QP stays on UDP
            };
            use std::os::fd::AsRawFd;
            let raw = c.as_raw_fd();
            if epoll::add(
                &self.epoll,
                c.as_fd(),
                epoll::EventData::new_u64(EV_OFFER | u64::from(raw as u32)),
                epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
            )
            .is_ok()
            {
                self.offers.lock().insert(raw, c);
            }
        }
    }

    /// Reads the offer on accepted connection `raw` and gives it to its QP.
    pub(super) fn take_offer(&self, raw: i32) {
        let Some(conn) = self.offers.lock().remove(&raw) else {
            return;
        };
        let mut buf = [0u8; crate::samehost::OFFER_LEN + 1];
        let (n, fds) = match crate::shm::recv_fds(conn.as_fd(), &mut buf) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.offers.lock().insert(raw, conn);
                return;
            }
            Err(_) => return,
        };
        let _ = epoll::delete(&self.epoll, conn.as_fd());
        let Some(offer) = crate::samehost::Offer::parse(&buf[..n]) else {
            return;
        };
        let Some(qp) = self.lookup(offer.to_qpn) else {
            return;
        };
        let Ok(tx) = crate::samehost::PeerTx::new(&offer, fds, conn) else {
            return;
        };
        let mut core = qp.core.lock();
        let Some(shm) = &mut core.shm else { return };
        if shm.active {
            // Already sending through shared memory to its peer: a second offer is refused.
            return;
        }
        if epoll::add(
            &self.epoll,
            tx.conn.as_fd(),
            epoll::EventData::new_u64(EV_PEER | u64::from(offer.to_qpn)),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        )
        .is_err()
        {
            return;
        }
        // A newer offer replaces an older one (the peer QP was recreated).
        shm.tx = Some(tx);
        bump(&self.stats.shm_offers, 1);
        self.drive(&mut core, Instant::now());
    }

    /// The connection QP `qpn`'s offer went on hung up. Before the peer's offer came, the peer
    /// refused ours (another user, no shared memory, not that QP) or is gone: stop waiting
    /// for its offer, send the held requests over UDP.
    pub(super) fn offer_refused(&self, qpn: u32) {
        let Some(qp) = self.lookup(qpn) else { return };
        let mut core = qp.core.lock();
        let Some(shm) = &mut core.shm else { return };
        if let Some(c) = &shm.offered {
            let _ = epoll::delete(&self.epoll, c.as_fd());
        }
        if shm.tx.is_some() || shm.active {
            return; // the peer's offer came: its own connection tells when it goes
        }
        shm.offered = None;
        shm.live = None;
        self.drive(&mut core, Instant::now());
    }

    /// Watches the connection our QP `qpn`'s offer went on (see [`Self::offer_refused`]).
    pub(crate) fn watch_offer(&self, qpn: u32, conn: &OwnedFd) {
        let _ = epoll::add(
            &self.epoll,
            conn.as_fd(),
            epoll::EventData::new_u64(EV_OFFERED | u64::from(qpn)),
            epoll::EventFlags::RDHUP,
        );
    }

    /// The peer of QP `qpn` went away (its offer's connection closed): deliver what it left
    /// in our ring, then fail the QP so its user learns at once.
    pub(super) fn peer_gone(&self, qpn: u32) {
        let Some(qp) = self.lookup(qpn) else { return };
        let mut core = qp.core.lock();
        let QpCore { rc, shm, .. } = &mut *core;
        let Some(shm) = shm else { return };
        let Some(tx) = &shm.tx else { return };
        let _ = epoll::delete(&self.epoll, tx.conn.as_fd());
        let _ = shm.receive(rc);
        rc.fail();
        shm.disconnect(Some(rc));
        self.drive(&mut core, Instant::now());
    }
}

impl Shared {
    /// Delivers what the same-host rings of `cq`'s QPs hold (and sends what waits for ring
    /// space), on the calling thread.
    pub(crate) fn shm_poll(&self, cq: &CqShared) {
        if !cq.has_live_rings() {
            return;
        }
        let mut list = cq.shm_qps.lock();
        list.retain(|w| w.strong_count() > 0);
        let now = Instant::now();
        for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
            let mut core = qp.core.lock();
            if core.shm.as_ref().is_some_and(|s| s.rx_pending(&core.rc)) {
                self.drive(&mut core, now);
            }
        }
    }

    /// Whether every QP of `cq` receives through shared memory (and there is one).
    pub(crate) fn shm_only(&self, cq: &CqShared) -> bool {
        if !cq.has_live_rings() {
            return false;
        }
        let list = cq.shm_qps.lock();
        let mut any = false;
        for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
            if !qp.core.lock().shm.as_ref().is_some_and(|s| s.active) {
                return false;
            }
            any = true;
        }
        any
    }

    /// Whether a ring of `cq` holds something deliverable.
    pub(super) fn shm_pending(&self, cq: &CqShared) -> bool {
        if !cq.has_live_rings() {
            return false;
        }
        let list = cq.shm_qps.lock();
        list.iter().filter_map(std::sync::Weak::upgrade).any(|qp| {
            let core = qp.core.lock();
            core.shm.as_ref().is_some_and(|s| s.rx_pending(&core.rc))
        })
    }

    /// Changes who sleeps on `cq` and tells the producers of its rings (their waiting words);
    /// returns whether something can be delivered already (then do not sleep).
    pub(crate) fn shm_sleepers(&self, cq: &CqShared, change: impl FnOnce(&mut Sleepers)) -> bool {
        cq.notify.sleepers(change, |word| {
            if !cq.has_live_rings() {
                return false; // a ring that joins reads the word itself (Notify::published)
            }
            let list = cq.shm_qps.lock();
            let mut pending = false;
            for qp in list.iter().filter_map(std::sync::Weak::upgrade) {
                let core = qp.core.lock();
                if let Some(shm) = &core.shm {
                    shm.set_waiting(word);
                    pending |= word != 0 && shm.rx_pending(&core.rc);
                }
            }
            pending
        })
    }
}
