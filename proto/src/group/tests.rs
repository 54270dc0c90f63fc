//! Two groups over an in-memory fabric with a virtual clock: every LLC message goes through
//! the codec; a path can be cut so that sends on it fail (the sender's queue pair gives up, as
//! after retry exhaustion) or vanish (nothing comes back, nothing fails: TEST LINK finds it).
//! No sleeps, no threads.

use super::*;
use clc::{Mac, QpMtu};
use llc::{AddLinkV2Ext, Llc, RkeyPair, Version};

use crate::link::{LLC_WAIT, TEST_LINK_TIME};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cut {
    No,
    /// Sends on the path fail at the sender.
    Fails,
    /// Sends on the path are lost silently.
    Blackhole,
}

struct End {
    g: GroupCore<u32>,
    last: u8,
    /// Every event, with when it happened.
    log: Vec<(Duration, GroupEvent)>,
    /// Every LLC message sent: path and type.
    sent: Vec<(usize, Llc)>,
    /// The driver cannot connect added links (e.g. the route is gone).
    refuse_connect: bool,
}

fn ids(last: u8, paths: usize) -> Vec<PathIds> {
    (0..paths)
        .map(|p| PathIds {
            gid: Gid::from_ipv4([10, 0, p as u8, last].into()),
            qpn: 0x100 * (p as u32 + 1) + u32::from(last),
        })
        .collect()
}

fn params(role: Role, last: u8, max_links: u8) -> LinkParams {
    let p = ids(last, 1)[0];
    LinkParams {
        role,
        version: Version::V2,
        mac: Mac([2, 0, 0, 0, 0, last]),
        gid: p.gid,
        qpn: p.qpn,
        link_id: if role == Role::Server { 1 } else { 0 },
        link_uid: [0, 0, 1, 1],
        max_links,
        max_conns: 255,
        test_link_time: Some(TEST_LINK_TIME),
    }
}

impl End {
    fn new(role: Role, last: u8, paths: usize, linger: Duration, t0: Instant) -> Self {
        let conns = LgrCore::new(255, 64, 4, 16, linger, t0);
        let mut g = GroupCore::new(role, ids(last, paths), conns);
        g.start(params(role, last, 2), t0);
        Self {
            g,
            last,
            log: Vec::new(),
            sent: Vec::new(),
            refuse_connect: false,
        }
    }

    /// Our side of a link on `path`, as the driver would build it.
    fn add_link_msg(&self, path: usize, link_id: u8) -> AddLink {
        let p = ids(self.last, 2)[path];
        AddLink {
            response: false,
            reject: false,
            reject_reason: 0,
            mac: Mac([2, 0, 0, 0, 0, self.last]),
            gid: p.gid,
            qpn: p.qpn,
            link_id,
            mtu: QpMtu::MTU_1024,
            initial_psn: 0x1000,
            v2: Some(AddLinkV2Ext {
                v2_direct: true,
                target_gid: p.gid,
                rkeys: vec![RkeyPair {
                    rkey: 7,
                    rkey_new: 7,
                    vaddr_new: 0x7000,
                }],
            }),
        }
    }

    /// What the driver does with each event.
    fn drive(&mut self, now: Instant, t: Duration) -> bool {
        let mut any = false;
        while let Some(ev) = self.g.poll_event() {
            any = true;
            self.log.push((t, ev.clone()));
            match ev {
                GroupEvent::PrepareAddLink { path, link_id } => {
                    let req = self.add_link_msg(path, link_id);
                    self.g.add_link_request(req, now);
                }
                GroupEvent::ConnectAdded { path, resp } => {
                    let ok = !self.refuse_connect;
                    self.g.added_link_connected(path, resp.link_id, ok, now);
                }
                GroupEvent::AnswerAddLink { path, req } => {
                    let resp = self.add_link_msg(path, req.link_id);
                    self.g.answer_add_link(path, Some(resp), now);
                }
                _ => {}
            }
        }
        any
    }

    fn events(&self) -> Vec<&GroupEvent> {
        self.log.iter().map(|(_, e)| e).collect()
    }

    fn count(&self, f: impl Fn(&GroupEvent) -> bool) -> usize {
        self.log.iter().filter(|(_, e)| f(e)).count()
    }

    fn sent_on(&self, path: usize, f: impl Fn(&Llc) -> bool) -> usize {
        self.sent.iter().filter(|(p, m)| *p == path && f(m)).count()
    }
}

struct Fabric {
    s: End,
    c: End,
    t0: Instant,
    now: Instant,
    cut: [Cut; 2],
}

fn bytes(m: &LlcMessage) -> Vec<u8> {
    let mut b = vec![0u8; m.buffer_len()];
    m.emit(&mut b);
    b
}

impl Fabric {
    fn new(
        server_paths: usize,
        client_paths: usize,
        server_linger: Duration,
        client_linger: Duration,
    ) -> Self {
        let t0 = Instant::now();
        let mut f = Self {
            s: End::new(Role::Server, 1, server_paths, server_linger, t0),
            c: End::new(Role::Client, 2, client_paths, client_linger, t0),
            t0,
            now: t0,
            cut: [Cut::No; 2],
        };
        f.settle();
        f
    }

    /// Two links up (server and client with two paths each).
    fn two_links() -> Self {
        let f = Self::new(2, 2, Duration::from_secs(600), Duration::from_secs(600));
        assert_eq!(f.s.g.links(), 2, "server: {:?}", f.s.events());
        assert_eq!(f.c.g.links(), 2, "client: {:?}", f.c.events());
        f
    }

    fn t(&self) -> Duration {
        self.now - self.t0
    }

    /// Runs both ends at the current time until nothing moves.
    fn settle(&mut self) {
        for _ in 0..1000 {
            let now = self.now;
            let t = self.t();
            let mut moved = false;
            for e in [&mut self.s, &mut self.c] {
                e.g.handle_timeout(now);
                moved |= e.drive(now, t);
            }
            moved |= self.carry(true);
            moved |= self.carry(false);
            if !moved {
                return;
            }
        }
        panic!("no quiescence");
    }

    /// Carries one end's queued LLC messages to the other (through the codec).
    fn carry(&mut self, from_server: bool) -> bool {
        let (a, b) = if from_server {
            (&mut self.s, &mut self.c)
        } else {
            (&mut self.c, &mut self.s)
        };
        let mut moved = false;
        while let Some((path, m)) = a.g.poll_transmit() {
            moved = true;
            a.sent.push((path, m.body.clone()));
            match self.cut[path] {
                Cut::No => b.g.handle_llc(path, &bytes(&m), self.now),
                Cut::Fails => a.g.transport_failed(path, "retry count exceeded"),
                Cut::Blackhole => {}
            }
        }
        moved
    }

    /// Advances the virtual clock by `d`, handling every timer due on the way.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            let next = [self.s.g.poll_timeout(), self.c.g.poll_timeout()]
                .into_iter()
                .flatten()
                .filter(|&t| t <= end)
                .min();
            match next {
                Some(t) => {
                    self.now = self.now.max(t);
                    self.settle();
                }
                None => break,
            }
            if self.now >= end {
                break;
            }
        }
        self.now = end;
        self.settle();
    }
}

const LONG: Duration = Duration::from_secs(600);

#[test]
fn first_link_comes_up_on_both_ends() {
    let f = Fabric::new(1, 1, LONG, LONG);
    assert!(f.s.g.is_up() && f.c.g.is_up());
    assert_eq!(f.s.events(), vec![&GroupEvent::Up { link_id: 1 }]);
    assert_eq!(f.c.events(), vec![&GroupEvent::Up { link_id: 1 }]);
    assert_eq!((f.s.g.links(), f.c.g.links()), (1, 1));
    assert_eq!(f.s.sent_on(0, |m| matches!(m, Llc::ConfirmLink(_))), 1);
    assert_eq!(f.c.sent_on(0, |m| matches!(m, Llc::ConfirmLink(_))), 1);
}

#[test]
fn server_adds_a_second_link_over_the_other_path() {
    let f = Fabric::two_links();
    // ADD LINK over the first link; CONFIRM LINK for the new one over the second path.
    assert_eq!(
        f.s.sent_on(0, |m| matches!(m, Llc::AddLink(a) if !a.response)),
        1
    );
    assert_eq!(
        f.c.sent_on(
            0,
            |m| matches!(m, Llc::AddLink(a) if a.response && !a.reject)
        ),
        1
    );
    assert_eq!(f.s.sent_on(1, |m| matches!(m, Llc::ConfirmLink(_))), 1);
    assert_eq!(f.c.sent_on(1, |m| matches!(m, Llc::ConfirmLink(_))), 1);
    assert!(f.s.events().contains(&&GroupEvent::SpareUp { link_id: 2 }));
    assert!(f.c.events().contains(&&GroupEvent::SpareUp { link_id: 2 }));
    assert_eq!(f.s.g.path_of_link(2), Some(1));
    assert_eq!(f.c.g.path_of_link(1), Some(0));
    assert_eq!(f.s.g.route(), (0, 0));
}

#[test]
fn a_client_without_a_second_path_rejects_and_the_server_retries_with_backoff() {
    let mut f = Fabric::new(2, 1, LONG, LONG);
    assert_eq!(
        f.c.sent_on(0, |m| matches!(m, Llc::AddLink(a) if a.reject)),
        1
    );
    assert_eq!(f.s.g.links(), 1);
    f.advance(Duration::from_secs(50));
    let tries: Vec<u64> =
        f.s.log
            .iter()
            .filter(|(_, e)| matches!(e, GroupEvent::PrepareAddLink { .. }))
            .map(|(t, _)| t.as_secs())
            .collect();
    // At once, then 3, 6, 12, 24 s after each refusal.
    assert_eq!(tries, vec![0, 3, 9, 21, 45]);
    assert!(f.s.g.down().is_none() && f.c.g.down().is_none());
}

#[test]
fn active_link_failure_fails_over_and_tells_the_peer_on_the_other_link() {
    let mut f = Fabric::two_links();
    f.cut[0] = Cut::Fails;
    // A data write on path 0 failed (the transport's retries ran out).
    f.s.g.transport_failed(0, "retry count exceeded");
    f.settle();
    assert_eq!(f.s.g.route(), (1, 1));
    assert_eq!(f.c.g.route(), (1, 1));
    assert!(f.s.events().contains(&&GroupEvent::PathError(0)));
    assert!(f.s.events().contains(&&GroupEvent::Failover {
        epoch: 1,
        active: 1,
        link_id: 2
    }));
    assert!(f.c.events().contains(&&GroupEvent::Failover {
        epoch: 1,
        active: 1,
        link_id: 2
    }));
    assert!(f.c.events().contains(&&GroupEvent::PathError(0)));
    // DELETE LINK (LOST_PATH) for link 1 went over path 1; the peer was told, so it sends none.
    assert_eq!(
        f.s.sent_on(
            1,
            |m| matches!(m, Llc::DeleteLink(d) if !d.response && d.link_id == 1
            && d.reason == DeleteLinkReason::LOST_PATH)
        ),
        1
    );
    assert_eq!(
        f.c.sent_on(1, |m| matches!(m, Llc::DeleteLink(d) if !d.response)),
        0
    );
    assert!(f.s.g.take_unmoved() && f.c.g.take_unmoved());
    assert_eq!((f.s.g.links(), f.c.g.links()), (1, 1));
    assert!(f.s.g.down().is_none() && f.c.g.down().is_none());
    assert_eq!(
        f.s.g.last_failover(),
        Some("RDMA transport failed: retry count exceeded")
    );
}

#[test]
fn the_server_heals_the_lost_path_with_backoff_then_resets_it() {
    let mut f = Fabric::two_links();
    f.cut[0] = Cut::Fails;
    f.s.g.transport_failed(0, "retry count exceeded");
    f.settle();
    f.advance(Duration::from_secs(80));
    let tries: Vec<u64> =
        f.s.log
            .iter()
            .filter(|(_, e)| matches!(e, GroupEvent::PrepareAddLink { path: 0, .. }))
            .map(|(t, _)| t.as_secs())
            .collect();
    // 3 s after the failover, then waits of 6, 12, 24, 30 s (the longest).
    assert_eq!(tries, vec![3, 9, 21, 45, 75]);
    // Each try's ADD LINK went over the surviving link; each lost link was deleted there.
    assert_eq!(
        f.s.sent_on(1, |m| matches!(m, Llc::AddLink(a) if !a.response)),
        5
    );
    assert_eq!(f.s.g.links(), 1);
    // The path is back: the next try (30 s later) brings a second link, and the backoff is
    // reset.
    f.cut[0] = Cut::No;
    f.advance(Duration::from_secs(30));
    assert_eq!((f.s.g.links(), f.c.g.links()), (2, 2));
    let ups = f.s.count(|e| matches!(e, GroupEvent::SpareUp { .. }));
    assert_eq!(ups, 2);
    assert_eq!(f.s.g.route(), (1, 1));
    // A second failover, back to path 0, heals after 3 s again.
    f.cut[1] = Cut::Fails;
    f.s.g.transport_failed(1, "retry count exceeded");
    f.settle();
    assert_eq!(f.s.g.route(), (2, 0));
    assert_eq!(f.c.g.route(), (2, 0));
    let at = f.t().as_secs();
    f.advance(Duration::from_secs(4));
    let last_try =
        f.s.log
            .iter()
            .rev()
            .find(|(_, e)| matches!(e, GroupEvent::PrepareAddLink { .. }))
            .map(|(t, _)| t.as_secs());
    assert_eq!(last_try, Some(at + 3));
}

#[test]
fn a_silent_path_is_found_by_test_link_and_the_group_fails_over() {
    let mut f = Fabric::two_links();
    f.cut[0] = Cut::Blackhole;
    // Idle for the TEST LINK time, then LLC_WAIT without an answer.
    f.advance(TEST_LINK_TIME + LLC_WAIT + Duration::from_millis(1));
    // Both ends asked on the spare too (idle as well), which answered: only path 0 is lost.
    assert_eq!(f.s.g.route().1, 1, "server: {:?}", f.s.events());
    assert_eq!(f.c.g.route().1, 1, "client: {:?}", f.c.events());
    assert!(f.s.g.down().is_none() && f.c.g.down().is_none());
}

#[test]
fn a_single_link_group_goes_down_when_test_link_is_unanswered() {
    let mut f = Fabric::new(1, 1, LONG, LONG);
    f.cut[0] = Cut::Blackhole;
    f.advance(TEST_LINK_TIME + LLC_WAIT + Duration::from_millis(1));
    let want = GroupDown::Link(DownReason::TestLinkTimeout(LLC_WAIT));
    assert_eq!(f.s.g.down(), Some(&want));
    assert!(f.s.events().contains(&&GroupEvent::Down(want.clone())));
    assert!(!f.s.g.orderly());
    assert_eq!(f.s.g.links(), 0);
    assert_eq!(f.s.g.poll_timeout(), None);
}

#[test]
fn linger_deletes_an_idle_group_and_the_peer_learns_it() {
    let mut f = Fabric::new(1, 1, Duration::from_secs(10), LONG);
    f.advance(Duration::from_secs(9));
    assert!(f.s.g.down().is_none());
    f.advance(Duration::from_secs(1));
    assert_eq!(
        f.s.g.down(),
        Some(&GroupDown::Link(DownReason::Local(
            DeleteLinkReason::PROG_INIT_TERM
        )))
    );
    assert!(f.s.g.orderly());
    assert_eq!(
        f.c.g.down(),
        Some(&GroupDown::Link(DownReason::PeerDeletedGroup(
            DeleteLinkReason::PROG_INIT_TERM
        )))
    );
    assert_eq!(
        f.s.sent_on(0, |m| matches!(m, Llc::DeleteLink(d) if d.all)),
        1
    );
}

#[test]
fn linger_waits_while_a_connection_is_attached() {
    let mut f = Fabric::new(1, 1, Duration::from_secs(10), LONG);
    let _ = f.s.g.conns.attach(5, 5);
    f.advance(Duration::from_secs(20));
    assert!(f.s.g.down().is_none());
    let _ = f.s.g.conns.detach(5, f.now);
    f.advance(Duration::from_secs(10));
    assert!(f.s.g.down().is_some());
}

#[test]
fn confirm_rkey_names_the_spare_link_and_is_answered() {
    let mut f = Fabric::two_links();
    let (key, backlog) = f.s.g.confirm_rkey(0x77, 0x7700, f.now).unwrap();
    assert_eq!(backlog, 1, "counts itself");
    f.settle();
    assert_eq!(f.s.g.take_rkey_result(key), Some(true));
    assert!(f.s.events().contains(&&GroupEvent::RkeyDone { key }));
    let seen = f.c.log.iter().find_map(|(_, e)| match e {
        GroupEvent::PeerConfirmedRkey { path, rkey } => Some((*path, *rkey)),
        _ => None,
    });
    let (path, rkey) = seen.expect("the client saw the CONFIRM RKEY");
    assert_eq!(path, 0);
    assert_eq!(rkey.num_additional, 1);
    assert_eq!((rkey.rtokens[1].link_id, rkey.rtokens[1].rkey), (2, 0x77));
    // DELETE RKEY is not waited for.
    assert!(f.s.g.delete_rkey(0x77, f.now));
    f.settle();
    assert_eq!(
        f.c.sent_on(0, |m| matches!(m, Llc::DeleteRkey(d) if d.response)),
        1
    );
}

#[test]
fn a_failover_gives_up_the_rkey_flows_of_the_failed_link() {
    let mut f = Fabric::two_links();
    f.cut[0] = Cut::Blackhole;
    let (key, _) = f.s.g.confirm_rkey(0x77, 0x7700, f.now).unwrap();
    f.settle();
    assert_eq!(f.s.g.take_rkey_result(key), None);
    f.s.g.transport_failed(0, "retry count exceeded");
    f.settle();
    assert_eq!(f.s.g.take_rkey_result(key), Some(false));
    // Asked again, it goes over the new active link and is answered.
    let (key, _) = f.s.g.confirm_rkey(0x77, 0x7700, f.now).unwrap();
    f.settle();
    assert_eq!(f.s.g.take_rkey_result(key), Some(true));
    assert_eq!(
        f.s.sent_on(1, |m| matches!(m, Llc::ConfirmRkey(c) if !c.response)),
        1
    );
}

#[test]
fn an_unanswered_rkey_flow_is_given_up_after_llc_wait() {
    let mut f = Fabric::new(1, 1, LONG, LONG);
    f.cut[0] = Cut::Blackhole;
    let (key, _) = f.s.g.confirm_rkey(0x77, 0x7700, f.now).unwrap();
    f.advance(LLC_WAIT - Duration::from_millis(1));
    assert_eq!(f.s.g.take_rkey_result(key), None);
    f.advance(Duration::from_millis(1));
    assert_eq!(f.s.g.take_rkey_result(key), Some(false));
}

#[test]
fn terminate_deletes_the_group_in_order() {
    let mut f = Fabric::two_links();
    f.s.g.terminate();
    assert!(!f.s.g.is_up());
    f.settle();
    assert!(f.s.g.orderly());
    assert!(matches!(
        f.s.g.down(),
        Some(GroupDown::Link(DownReason::Local(_)))
    ));
    assert!(matches!(
        f.c.g.down(),
        Some(GroupDown::Link(DownReason::PeerDeletedGroup(_)))
    ));
    assert_eq!(
        f.s.sent_on(0, |m| matches!(m, Llc::DeleteLink(d) if d.all)),
        1
    );
    // An rkey flow on a group that is down is refused.
    assert!(matches!(
        f.s.g.confirm_rkey(1, 2, f.now),
        Err(RkeyError::Down(_))
    ));
}

#[test]
fn an_added_link_that_cannot_be_connected_is_deleted_and_retried() {
    let t0 = Instant::now();
    let mut f = Fabric {
        s: End::new(Role::Server, 1, 2, LONG, t0),
        c: End::new(Role::Client, 2, 2, LONG, t0),
        t0,
        now: t0,
        cut: [Cut::No; 2],
    };
    f.s.refuse_connect = true;
    f.settle();
    assert_eq!(f.s.g.links(), 1);
    // The client set up its side and learns the link is gone (DELETE LINK over link 1).
    assert_eq!(
        f.s.sent_on(0, |m| matches!(m, Llc::DeleteLink(d) if d.link_id == 2)),
        1
    );
    assert_eq!(f.c.g.links(), 1);
    f.s.refuse_connect = false;
    f.advance(Duration::from_secs(3));
    assert_eq!((f.s.g.links(), f.c.g.links()), (2, 2));
    // Link ids go on (the failed one's is not reused at once).
    assert!(f.s.events().contains(&&GroupEvent::SpareUp { link_id: 3 }));
}

#[test]
fn the_driver_failing_the_group_keeps_the_first_reason() {
    let mut f = Fabric::new(1, 1, LONG, LONG);
    let first = f.s.g.fail(GroupDown::FirstLinkNotUp).clone();
    let again = f.s.g.fail(GroupDown::Start("later".into())).clone();
    assert_eq!(first, again);
    assert_eq!(first.to_string(), "the first link did not come up");
    assert!(!f.s.g.is_up());
    f.settle();
}

/// Log levels: an ended group (linger, exit, terminate) is an orderly end, a lost path or a
/// timeout is a failure.
#[test]
fn orderly_ends_are_told_from_failures() {
    use llc::DeleteLinkReason as R;
    assert!(GroupDown::Link(DownReason::PeerDeletedGroup(R::PROG_INIT_TERM)).orderly());
    assert!(GroupDown::Link(DownReason::Local(R::OP_INIT_TERM)).orderly());
    assert!(!GroupDown::Link(DownReason::PeerDeleted(R::LOST_PATH)).orderly());
    assert!(
        !GroupDown::Link(DownReason::TestLinkTimeout(std::time::Duration::from_secs(
            1
        )))
        .orderly()
    );
    assert!(!GroupDown::FirstLinkNotUp.orderly());
    // Ours, before its link came up: nothing failed.
    assert!(GroupDown::Declined.orderly());
}
