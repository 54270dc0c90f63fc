//! The engine's side of the same-host transport ([`crate::samehost`]): offers accepted on the
//! rendezvous and given to their QPs, peers that refuse an offer or go away, and the same-host
//! rings of a CQ's QPs polled by whoever waits on the CQ.

use super::counters::bump;
use super::cq::CqShared;
use super::{EV_OFFER, EV_OFFERED, EV_PEER, QpCore, Shared};
use crate::notify::Sleepers;
use crate::rc::RcQp;
use crate::samehost::{Msg, Nonce, ShmQp};
use rustix::event::epoll;
use rustix::fd::{AsFd, OwnedFd};
use std::io;
use std::net::SocketAddrV4;
use std::time::Instant;

/// An accepted rendezvous connection, by how far its exchange got.
pub(crate) struct Incoming {
    conn: OwnedFd,
    stage: Stage,
}

#[derive(Clone, Copy)]
enum Stage {
    /// Its hello is awaited.
    New,
    /// Hello read for our QP `qpn`, which does not know the pair's secret yet (not in RTS):
    /// answered when it gets there.
    Stashed {
        qpn: u32,
        from_qpn: u32,
        from: SocketAddrV4,
        a: Nonce,
    },
    /// Our challenge went; its offer (proof and descriptors) is awaited.
    Challenged {
        qpn: u32,
        from_qpn: u32,
        from: SocketAddrV4,
        a: Nonce,
        b: Nonce,
    },
}

impl Shared {
    /// Accepts connections on the rendezvous; their hellos are read when they arrive. Any
    /// user may connect: what decides is the proof (see [`crate::samehost`]).
    pub(super) fn accept_offers(&self) {
        let fs = self.rendezvous.fs.as_ref().map(|r| &r.fd);
        for l in self.rendezvous.local.iter().chain(fs) {
            self.accept_on(l);
        }
    }

    fn accept_on(&self, l: &OwnedFd) {
        while let Ok(c) = rustix::net::accept_with(
            l,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
        ) {
            if self.rendezvous.offers.lock().len() >= 256 {
                continue; // too many silent connections: dropped (that peer uses UDP)
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
                self.rendezvous.offers.lock().insert(
                    raw,
                    Incoming {
                        conn: c,
                        stage: Stage::New,
                    },
                );
            }
        }
    }

    /// Reads the next message of accepted connection `raw`'s exchange: a hello (challenged
    /// at once, or when its QP reaches RTS), then the offer, which goes to its QP if its proof
    /// holds. Anything else ends the connection (the peer's QP then uses UDP).
    pub(super) fn take_offer(&self, raw: i32) {
        let Some(mut inc) = self.rendezvous.offers.lock().remove(&raw) else {
            return;
        };
        let mut buf = [0u8; crate::samehost::MSG_LEN + 1];
        let (n, fds) = match crate::shm::recv_fds(inc.conn.as_fd(), &mut buf) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.rendezvous.offers.lock().insert(raw, inc);
                return;
            }
            Err(_) => (0, Vec::new()),
        };
        let msg = crate::samehost::Msg::parse(&buf[..n]);
        match (inc.stage, msg) {
            (
                Stage::New,
                Some(Msg::Hello {
                    to_qpn,
                    from_qpn,
                    from,
                    nonce,
                }),
            ) if fds.is_empty() => {
                let Some(qp) = self.lookup(to_qpn) else {
                    return self.end_incoming(&inc);
                };
                let core = qp.core.lock();
                // Only a QP of a shared domain that has no peer yet.
                let Some(shm) = core.shm.as_ref().filter(|s| !s.active) else {
                    return self.end_incoming(&inc);
                };
                inc.stage = Stage::Stashed {
                    qpn: to_qpn,
                    from_qpn,
                    from,
                    a: nonce,
                };
                if answer(&mut inc, &core.rc, core.av, shm) {
                    self.rendezvous.offers.lock().insert(raw, inc);
                } else {
                    self.end_incoming(&inc);
                }
            }
            (
                Stage::Challenged {
                    qpn,
                    from_qpn,
                    from,
                    a,
                    b,
                },
                Some(Msg::Offer { mac }),
            ) => {
                let _ = epoll::delete(&self.epoll, inc.conn.as_fd());
                let Some(qp) = self.lookup(qpn) else { return };
                let mut core = qp.core.lock();
                let QpCore { rc, av, shm, .. } = &mut *core;
                let Some(shm) = shm else { return };
                let proven = shm.as_responder(rc).is_some_and(|p| {
                    p.check(b'I', &a, &b, &mac)
                        && rc.dest_qp_num() == from_qpn
                        && av.map(|v| *v.ip()) == Some(*from.ip())
                });
                if !proven {
                    shm.fault = Some("a process at the rendezvous failed the pair's proof");
                    return;
                }
                let Ok(tx) = crate::samehost::PeerTx::new(from_qpn, from, fds, inc.conn) else {
                    return;
                };
                if shm.active {
                    // Already sending through shared memory to its peer: a second offer is
                    // refused.
                    return;
                }
                if epoll::add(
                    &self.epoll,
                    tx.conn.as_fd(),
                    epoll::EventData::new_u64(EV_PEER | u64::from(qpn)),
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
            _ => self.end_incoming(&inc),
        }
    }

    fn end_incoming(&self, inc: &Incoming) {
        let _ = epoll::delete(&self.epoll, inc.conn.as_fd());
    }

    /// QP `qpn` reached RTS: challenge the hellos that came for it before.
    pub(crate) fn answer_hellos(&self, qpn: u32, rc: &RcQp, av: Option<SocketAddrV4>, shm: &ShmQp) {
        let mut offers = self.rendezvous.offers.lock();
        let waiting: Vec<i32> = offers
            .iter()
            .filter(|(_, i)| matches!(i.stage, Stage::Stashed { qpn: q, .. } if q == qpn))
            .map(|(&k, _)| k)
            .collect();
        for k in waiting {
            let Some(mut inc) = offers.remove(&k) else {
                continue;
            };
            if answer(&mut inc, rc, av, shm) {
                offers.insert(k, inc);
            } else {
                self.end_incoming(&inc);
            }
        }
    }

    /// Something came on the connection QP `qpn`'s offer went on: the peer's challenge (its
    /// proof checked, our descriptors go with ours), or its end before its own offer came
    /// (the peer refused ours — another device, no shared memory, no proof — or is gone):
    /// then stop waiting for its offer and send the held requests over UDP.
    pub(super) fn offer_progress(&self, qpn: u32) {
        let Some(qp) = self.lookup(qpn) else { return };
        let mut core = qp.core.lock();
        let QpCore {
            rc, shm, recv_cq, ..
        } = &mut *core;
        let Some(shm) = shm else { return };
        let Some(c) = &shm.offered else { return };
        let mut buf = [0u8; crate::samehost::MSG_LEN + 1];
        let got = match crate::shm::recv_fds(c.as_fd(), &mut buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Ok((n, fds)) if n > 0 && fds.is_empty() => Msg::parse(&buf[..n]),
            _ => None,
        };
        if let (Some(Msg::Challenge { nonce: b, mac }), false) = (got, shm.offer_sent) {
            let pairing = shm.as_initiator(rc);
            if let (Some(p), Some(a)) = (pairing, shm.hello)
                && p.check(b'R', &a, &b, &mac)
            {
                let offer = Msg::Offer {
                    mac: p.mac(b'I', &a, &b),
                };
                let [arena, ring] = shm.offer_fds();
                let fds = [
                    arena,
                    ring,
                    recv_cq.event.as_fd(),
                    recv_cq.event_driver.as_fd(),
                ];
                if crate::shm::send_fds(c.as_fd(), &fds, &offer.emit()).is_ok() {
                    shm.offer_sent = true;
                    return;
                }
            } else {
                shm.fault = Some("the process at the peer's rendezvous failed the pair's proof");
            }
        }
        // Ended, refused, or a message out of turn.
        let _ = epoll::delete(&self.epoll, c.as_fd());
        if shm.tx.is_some() || shm.active {
            return; // the peer's offer came: its own connection tells when it goes
        }
        shm.offered = None;
        shm.live = None;
        shm.hello = None;
        shm.refused = true;
        self.drive(&mut core, Instant::now());
    }

    /// Watches the connection our QP `qpn`'s offer went on (see [`Self::offer_progress`]).
    pub(crate) fn watch_offer(&self, qpn: u32, conn: &OwnedFd) {
        let _ = epoll::add(
            &self.epoll,
            conn.as_fd(),
            epoll::EventData::new_u64(EV_OFFERED | u64::from(qpn)),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
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

/// Challenges a stashed hello once `rc` knows the pair's secret (RTS) and is the QP the hello
/// names as its peer; returns whether the connection goes on (still waiting, or challenged).
fn answer(inc: &mut Incoming, rc: &RcQp, av: Option<SocketAddrV4>, shm: &ShmQp) -> bool {
    let Stage::Stashed {
        qpn,
        from_qpn,
        from,
        a,
    } = inc.stage
    else {
        return true;
    };
    let Some(p) = shm.as_responder(rc) else {
        // Not in RTS yet (a QP being connected); one in the error state never answers.
        return matches!(
            rc.state(),
            crate::rc::QpState::Reset | crate::rc::QpState::Init | crate::rc::QpState::Rtr
        );
    };
    if rc.dest_qp_num() != from_qpn || av.map(|v| *v.ip()) != Some(*from.ip()) {
        return false;
    }
    if shm.offered.is_none() {
        // Our own offer could not reach the peer (its rendezvous not found from here) or was
        // ended: sharing takes both, so the peer's is refused now — it sends over UDP at once
        // instead of holding its requests for ours, which would not come (a CONFIRM LINK
        // response held that long missed the server's wait).
        return false;
    }
    let Ok(b) = crate::samehost::nonce() else {
        return false;
    };
    let challenge = Msg::Challenge {
        nonce: b,
        mac: p.mac(b'R', &a, &b),
    };
    if crate::samehost::send(inc.conn.as_fd(), &challenge).is_err() {
        return false;
    }
    inc.stage = Stage::Challenged {
        qpn,
        from_qpn,
        from,
        a,
        b,
    };
    true
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
                    pending |= crate::notify::waiting_bits(word) != 0 && shm.rx_pending(&core.rc);
                }
            }
            pending
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QP in RTS (QPN 9, peer 3) and its same-host state with the pair's PSNs.
    fn rts() -> (RcQp, ShmQp) {
        let rc = crate::samehost::tests::rts_qp(9, 3, 5, 7);
        let mut shm = ShmQp::new(crate::arena::Arena::create().unwrap()).unwrap();
        shm.rq_psn = Some(5);
        shm.sq_psn = Some(7);
        (rc, shm)
    }

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    /// Sharing takes both offers: a QP whose own offer did not reach its peer refuses the
    /// peer's (which then sends over UDP at once) instead of challenging it and leaving the
    /// peer to wait for an offer that will not come; with its own offer out, it challenges.
    #[test]
    fn a_qp_whose_own_offer_did_not_go_refuses_its_peers() {
        let (rc, mut shm) = rts();
        let from: SocketAddrV4 = "10.0.0.1:4791".parse().unwrap();
        let (ours, theirs) = seqpacket_pair();
        let mut inc = Incoming {
            conn: ours,
            stage: Stage::Stashed {
                qpn: 9,
                from_qpn: 3,
                from,
                a: [1; 16],
            },
        };
        assert!(!answer(&mut inc, &rc, Some(from), &shm), "refused");
        assert!(matches!(inc.stage, Stage::Stashed { .. }));
        shm.offered = Some(seqpacket_pair().0);
        assert!(answer(&mut inc, &rc, Some(from), &shm), "challenged");
        assert!(matches!(inc.stage, Stage::Challenged { .. }));
        let mut buf = [0u8; crate::samehost::MSG_LEN];
        let (n, _) = rustix::net::recv(&theirs, &mut buf, rustix::net::RecvFlags::empty()).unwrap();
        assert!(matches!(Msg::parse(&buf[..n]), Some(Msg::Challenge { .. })));
    }
}
