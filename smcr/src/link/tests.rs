use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn bytes(m: &LlcMessage) -> Vec<u8> {
    let mut b = vec![0u8; m.buffer_len()];
    m.emit(&mut b);
    b
}

/// The two ends of the reference capture (../shared/reference, frames 9 and 11).
fn params(role: Role) -> LinkParams {
    let (last, link_id, uid) = match role {
        Role::Server => (2, 1, [0, 0, 1, 1]),
        Role::Client => (3, 0, [0; 4]),
    };
    LinkParams {
        role,
        version: Version::V2,
        mac: Mac([0x52, 0x54, 0, 0x77, 0, last]),
        gid: Gid::from_ipv4([10, 77, 0, last].into()),
        qpn: 0x11,
        link_id,
        link_uid: uid,
        max_links: 2,
        max_conns: 255,
        test_link_time: Some(TEST_LINK_TIME),
    }
}

/// Moves every queued message from `a` to `b` through the codec.
fn pump(a: &mut LinkCore, b: &mut LinkCore, now: Instant) -> usize {
    let mut n = 0;
    while let Some(m) = a.poll_transmit() {
        b.handle_llc(&bytes(&m), now);
        n += 1;
    }
    n
}

fn confirmed_pair(now: Instant) -> (LinkCore, LinkCore) {
    let mut s = LinkCore::new(params(Role::Server), now);
    let mut c = LinkCore::new(params(Role::Client), now);
    assert_eq!(pump(&mut s, &mut c, now), 1);
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert!(matches!(s.poll_event(), Some(LinkEvent::Up { .. })));
    assert!(matches!(c.poll_event(), Some(LinkEvent::Up { .. })));
    (s, c)
}

#[test]
fn confirm_link_bytes_match_linux() {
    let now = Instant::now();
    let mut s = LinkCore::new(params(Role::Server), now);
    let req = s.poll_transmit().unwrap();
    assert_eq!(
        bytes(&req),
        hex(
            "212c000352540077000200000000000000000000ffff0a4d0002000011010000010102ff0000000000000000"
        )
    );
    let mut c = LinkCore::new(params(Role::Client), now);
    c.handle_llc(&bytes(&req), now);
    let resp = c.poll_transmit().unwrap();
    assert_eq!(
        bytes(&resp),
        hex(
            "212c008352540077000300000000000000000000ffff0a4d0003000011010000010102ff0000000000000000"
        )
    );
    assert_eq!(c.state(), LinkState::Active);
    assert_eq!(c.params().link_id, 1);
    assert_eq!(c.params().link_uid, [0, 0, 1, 1]);
    let Some(LinkEvent::Up { peer }) = c.poll_event() else {
        panic!("client not up")
    };
    assert_eq!(peer.qpn, 0x11);
    s.handle_llc(&bytes(&resp), now);
    assert_eq!(s.state(), LinkState::Active);
    assert_eq!(s.peer().unwrap().gid, params(Role::Client).gid);
}

#[test]
fn answers_match_linux_for_add_link_confirm_rkey_delete_rkey() {
    let now = Instant::now();
    let (_s, mut c) = confirmed_pair(now);
    // ADD LINK request (frame 13) → reject (frame 15).
    c.handle_llc(&hex("22580000525400770002000000000000000000000000ffff0a4d0002000012020386e6860000000000000000800000000000000000000000ffff0a4d000200000000000000000100000003e3000005caff3d233f84360000"), now);
    assert_eq!(
        bytes(&c.poll_transmit().unwrap()),
        hex(
            "222c00c0525400770002000000000000000000000000ffff0a4d0002000012020386e6860000000000000000"
        )
    );
    assert_eq!(c.stats().add_links_rejected, 1);
    // CONFIRM RKEY request (frame 202) → response (frame 204).
    c.handle_llc(&hex("262c000000000003e3ff3d233f84360000000000000000000000000000000000000000000000000000000000"), now);
    assert_eq!(
        bytes(&c.poll_transmit().unwrap()),
        hex(
            "262c008000000003e3ff3d233f84360000000000000000000000000000000000000000000000000000000000"
        )
    );
    assert!(matches!(
        c.poll_event(),
        Some(LinkEvent::PeerConfirmedRkey(_))
    ));
    // DELETE RKEY request (frame 190) → response (frame 192).
    c.handle_llc(&hex("292c000001000000000003e30000000000000000000000000000000000000000000000000000000000000000"), now);
    assert_eq!(
        bytes(&c.poll_transmit().unwrap()),
        hex(
            "292c008001000000000000000000000000000000000000000000000000000000000000000000000000000000"
        )
    );
    assert_eq!(
        c.poll_event(),
        Some(LinkEvent::PeerDeletedRkeys(vec![0x3e3]))
    );
    assert_eq!(c.state(), LinkState::Active);
}

#[test]
fn keepalive_sends_test_link_and_peer_answers() {
    let t0 = Instant::now();
    let (mut s, mut c) = confirmed_pair(t0);
    assert_eq!(s.poll_timeout(), Some(t0 + TEST_LINK_TIME));
    // Activity postpones the keepalive.
    let t1 = t0 + Duration::from_secs(10);
    s.note_activity(t1);
    s.handle_timeout(t0 + TEST_LINK_TIME);
    assert!(s.poll_transmit().is_none());
    let t2 = t1 + TEST_LINK_TIME;
    s.handle_timeout(t2);
    assert_eq!(s.stats().test_links_sent, 1);
    assert_eq!(pump(&mut s, &mut c, t2), 1);
    assert_eq!(pump(&mut c, &mut s, t2), 1, "client answers TEST LINK");
    s.handle_timeout(t2 + LLC_WAIT);
    assert_eq!(s.state(), LinkState::Active);
    assert!(s.poll_event().is_none());
}

#[test]
fn unanswered_test_link_takes_the_link_down() {
    let t0 = Instant::now();
    let (mut s, _c) = confirmed_pair(t0);
    let t1 = t0 + TEST_LINK_TIME;
    s.handle_timeout(t1);
    assert!(s.poll_transmit().is_some());
    s.handle_timeout(t1 + LLC_WAIT - Duration::from_millis(1));
    assert_eq!(s.state(), LinkState::Active);
    s.handle_timeout(t1 + LLC_WAIT);
    assert_eq!(s.state(), LinkState::Down);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::Down(DownReason::TestLinkTimeout(LLC_WAIT)))
    );
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn confirm_timeout_on_both_sides_the_client_waits_twice_as_long() {
    let t0 = Instant::now();
    let mut s = LinkCore::new(params(Role::Server), t0);
    let mut c = LinkCore::new(params(Role::Client), t0);
    assert_eq!(CLIENT_CONFIRM_WAIT, 2 * CONFIRM_WAIT);
    for (l, wait) in [(&mut s, CONFIRM_WAIT), (&mut c, CLIENT_CONFIRM_WAIT)] {
        assert_eq!(l.poll_timeout(), Some(t0 + wait));
        l.handle_timeout(t0 + wait - Duration::from_millis(1));
        assert_eq!(l.poll_event(), None, "not before its wait");
        l.handle_timeout(t0 + wait);
        assert_eq!(
            l.poll_event(),
            Some(LinkEvent::Down(DownReason::ConfirmTimeout(wait)))
        );
        assert!(l.poll_transmit().is_none());
    }
}

#[test]
fn malformed_llc_is_a_violation_unknown_type_is_dropped() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    // Unknown v2 type 0x2f: dropped, link stays up.
    let mut unknown = vec![0u8; 44];
    unknown[0] = 0x2f;
    unknown[1] = 44;
    c.handle_llc(&unknown, now);
    assert_eq!(c.state(), LinkState::Active);
    assert_eq!(c.stats().dropped, 1);
    // Too short: violation, DELETE LINK (ALL, PROT_VIOL) goes to the peer.
    c.handle_llc(&[0x27, 0x2c, 0], now);
    assert_eq!(c.state(), LinkState::Down);
    assert!(matches!(
        c.poll_event(),
        Some(LinkEvent::Down(DownReason::ProtocolViolation(_)))
    ));
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::Down(DownReason::PeerDeleted(
            DeleteLinkReason::PROT_VIOL
        )))
    );
    // v1 message on a v2 link group: violation too.
    let (_s, mut c) = confirmed_pair(now);
    let mut v1 = vec![0u8; 44];
    v1[0] = 7;
    v1[1] = 44;
    c.handle_llc(&v1, now);
    assert_eq!(c.state(), LinkState::Down);
}

#[test]
fn anything_but_confirm_link_first_is_a_violation() {
    let now = Instant::now();
    let mut c = LinkCore::new(params(Role::Client), now);
    let test = LlcMessage {
        version: Version::V2,
        body: Llc::TestLink(TestLink {
            response: false,
            user_data: [0; 16],
        }),
    };
    c.handle_llc(&bytes(&test), now);
    assert_eq!(c.state(), LinkState::Down);
    // A server must not accept a CONFIRM LINK response for another link id.
    let mut s = LinkCore::new(params(Role::Server), now);
    let _ = s.poll_transmit();
    let mut p = params(Role::Client);
    p.link_id = 9;
    let bad = LlcMessage {
        version: Version::V2,
        body: Llc::ConfirmLink(ConfirmLink {
            response: true,
            no_rmbe_eyecatcher: 3,
            mac: p.mac,
            gid: p.gid,
            qpn: p.qpn,
            link_id: 9,
            link_uid: [0; 4],
            max_links: 1,
            max_conns: 255,
        }),
    };
    s.handle_llc(&bytes(&bad), now);
    assert_eq!(s.state(), LinkState::Down);
}

#[test]
fn deletes_local_and_remote() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    c.delete(DeleteLinkReason::PROG_INIT_TERM, true);
    assert_eq!(
        c.poll_event(),
        Some(LinkEvent::Down(DownReason::Local(
            DeleteLinkReason::PROG_INIT_TERM
        )))
    );
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::Down(DownReason::PeerDeleted(
            DeleteLinkReason::PROG_INIT_TERM
        )))
    );
    // DELETE LINK of the whole group is not answered; the link is down and silent.
    assert!(s.poll_transmit().is_none());
    s.handle_llc(&[0x27, 0x2c, 0], now);
    assert!(s.poll_transmit().is_none());
}

#[test]
fn transport_failure_is_reported_once() {
    let now = Instant::now();
    let (mut s, _c) = confirmed_pair(now);
    s.transport_failed("retry exhausted");
    s.transport_failed("again");
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::Down(DownReason::Transport(
            "retry exhausted".into()
        )))
    );
    assert!(s.poll_event().is_none());
}

#[test]
fn probe_detects_a_dead_peer_and_spares_a_live_one() {
    let t0 = Instant::now();
    let (mut s, mut c) = confirmed_pair(t0);
    s.probe(t0);
    s.probe(t0); // one outstanding at a time
    assert_eq!(s.stats().test_links_sent, 1);
    assert_eq!(pump(&mut s, &mut c, t0), 1);
    assert_eq!(pump(&mut c, &mut s, t0), 1);
    s.handle_timeout(t0 + LLC_WAIT);
    assert_eq!(s.state(), LinkState::Active);
    // Now nobody answers.
    let t1 = t0 + Duration::from_secs(1);
    s.probe(t1);
    s.handle_timeout(t1 + LLC_WAIT);
    assert_eq!(s.state(), LinkState::Down);
}

#[test]
fn rkey_flows_match_linux_and_complete_in_order() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    // The reference session's CONFIRM RKEY request (frame 202) and DELETE RKEY (frame 190).
    let a = s.confirm_rkey(0x3e3, 0xff3d_233f_8436_0000, now);
    let b = s.delete_rkey(0x3e3, now);
    let req = s.poll_transmit().unwrap();
    assert_eq!(
        bytes(&req),
        hex(
            "262c000000000003e3ff3d233f84360000000000000000000000000000000000000000000000000000000000"
        )
    );
    assert!(s.poll_transmit().is_none(), "one rkey flow at a time");
    c.handle_llc(&bytes(&req), now);
    assert!(matches!(
        c.poll_event(),
        Some(LinkEvent::PeerConfirmedRkey(_))
    ));
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::RkeyDone { id: a, ok: true })
    );
    let req = s.poll_transmit().unwrap();
    assert_eq!(
        bytes(&req),
        hex(
            "292c000001000000000003e30000000000000000000000000000000000000000000000000000000000000000"
        )
    );
    c.handle_llc(&bytes(&req), now);
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::RkeyDone { id: b, ok: true })
    );
    // Unanswered: fails after LLC_WAIT, the next request goes out.
    let d = s.confirm_rkey(7, 0, now);
    let e = s.confirm_rkey(8, 0, now);
    assert!(s.poll_transmit().is_some());
    assert_eq!(s.poll_timeout(), Some(now + LLC_WAIT));
    s.handle_timeout(now + LLC_WAIT);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::RkeyDone { id: d, ok: false })
    );
    assert!(s.poll_transmit().is_some());
    // Link down: the outstanding one fails too.
    s.transport_failed("gone");
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::RkeyDone { id: e, ok: false })
    );
}

#[test]
fn delete_link_for_a_link_we_do_not_have_is_answered_no_link_and_deletes_nothing() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    let ours = c.params().link_id;
    for (link_id, all) in [(ours.wrapping_add(7), false), (ours, false)] {
        let req = LlcMessage {
            version: Version::V2,
            body: Llc::DeleteLink(DeleteLink {
                response: false,
                all,
                orderly: false,
                link_id,
                reason: DeleteLinkReason::LOST_PATH,
            }),
        };
        c.handle_llc(&bytes(&req), now);
        let Some(LlcMessage {
            body: Llc::DeleteLink(answer),
            ..
        }) = c.poll_transmit()
        else {
            panic!("no answer");
        };
        assert!(answer.response);
        assert_eq!(answer.link_id, link_id);
        if link_id == ours {
            // Our own link: deleted, the answer carries the request's reason.
            assert_eq!(answer.reason, DeleteLinkReason::LOST_PATH);
            assert_eq!(c.state(), LinkState::Down);
        } else {
            assert_eq!(answer.reason, DeleteLinkReason::NO_LINK);
            assert_eq!(c.state(), LinkState::Active);
            assert_eq!(c.poll_event(), None);
            // Still in business: TEST LINK answered.
            s.probe(now);
            assert_eq!(pump(&mut s, &mut c, now), 1);
            assert_eq!(pump(&mut c, &mut s, now), 1);
        }
    }
}
