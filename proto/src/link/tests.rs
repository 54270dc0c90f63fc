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
        Some(LinkEvent::Down(DownReason::PeerDeletedGroup(
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
        Some(LinkEvent::Down(DownReason::PeerDeletedGroup(
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

/// The second link the server of the reference capture offered (frame 13).
fn linux_add_link_request() -> AddLink {
    let gid = Gid::from_ipv4([10, 77, 0, 2].into());
    AddLink {
        response: false,
        reject: false,
        reject_reason: 0,
        mac: Mac([0x52, 0x54, 0, 0x77, 0, 2]),
        gid,
        qpn: 0x12,
        link_id: 2,
        mtu: clc::QpMtu::MTU_1024,
        initial_psn: 0x86e686,
        v2: Some(llc::AddLinkV2Ext {
            v2_direct: true,
            target_gid: gid,
            rkeys: vec![llc::RkeyPair {
                rkey: 0x3e3,
                rkey_new: 0x5ca,
                vaddr_new: 0xff3d_233f_8436_0000,
            }],
        }),
    }
}

#[test]
fn add_link_request_bytes_match_linux_and_the_flow_completes() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    assert!(s.add_link(linux_add_link_request(), now));
    assert!(
        !s.add_link(linux_add_link_request(), now),
        "one ADD LINK flow at a time"
    );
    assert!(
        !c.add_link(linux_add_link_request(), now),
        "the server runs ADD LINK"
    );
    let req = s.poll_transmit().unwrap();
    assert_eq!(
        bytes(&req),
        hex(
            "22580000525400770002000000000000000000000000ffff0a4d0002000012020386e6860000000000000000800000000000000000000000ffff0a4d000200000000000000000100000003e3000005caff3d233f84360000"
        ),
        "frame 13 of the reference capture"
    );
    // A client with an alternate path takes it to its driver...
    c.set_accept_add_link(true);
    c.handle_llc(&bytes(&req), now);
    assert_eq!(c.poll_transmit(), None, "no answer before the driver's");
    let Some(LinkEvent::PeerAddLink(got)) = c.poll_event() else {
        panic!("no PeerAddLink")
    };
    assert_eq!(got, linux_add_link_request());
    // ...which answers with its own new link and RMBs.
    let cgid = Gid::from_ipv4([10, 78, 0, 3].into());
    let resp = AddLink {
        mac: Mac([0x52, 0x54, 0, 0x78, 0, 3]),
        gid: cgid,
        qpn: 0x44,
        link_id: 0, // taken from the request
        initial_psn: 0x1234,
        v2: Some(llc::AddLinkV2Ext {
            v2_direct: true,
            target_gid: cgid,
            rkeys: vec![
                llc::RkeyPair {
                    rkey: 0x101,
                    rkey_new: 0x202,
                    vaddr_new: 0x3000,
                },
                llc::RkeyPair {
                    rkey: 0x111,
                    rkey_new: 0x222,
                    vaddr_new: 0x4000,
                },
            ],
        }),
        ..got
    };
    assert!(c.answer_add_link(Some(resp.clone())));
    assert!(!c.answer_add_link(None), "answered once");
    let answer = c.poll_transmit().unwrap();
    let b = bytes(&answer);
    assert_eq!(
        &b[..4],
        &[0x22, 72 + 32, 0, 0x80],
        "v2 length LE, response flag"
    );
    assert_eq!(b[31], 2, "the server's link id");
    assert_eq!(&b[70..72], &[2, 0], "two rkey entries, count in x86 order");
    s.handle_llc(&b, now);
    let Some(LinkEvent::AddLinkResult(Ok(r))) = s.poll_event() else {
        panic!("no result")
    };
    assert_eq!((r.qpn, r.link_id, r.gid), (0x44, 2, cgid));
    assert_eq!(r.v2.unwrap().rkeys, resp.v2.unwrap().rkeys);
    assert_eq!(
        s.poll_timeout(),
        Some(now + TEST_LINK_TIME),
        "nothing outstanding"
    );
}

#[test]
fn add_link_rejected_without_a_path_and_given_up_after_the_llc_wait() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    // No alternate path: rejected at once, as before.
    s.add_link(linux_add_link_request(), now);
    assert_eq!(pump(&mut s, &mut c, now), 1);
    assert_eq!(c.poll_event(), None);
    assert_eq!(pump(&mut c, &mut s, now), 1);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::AddLinkResult(Err(AddLinkRefused::Rejected)))
    );
    // The driver rejects: the same answer.
    c.set_accept_add_link(true);
    s.add_link(linux_add_link_request(), now);
    pump(&mut s, &mut c, now);
    assert!(matches!(c.poll_event(), Some(LinkEvent::PeerAddLink(_))));
    c.answer_add_link(None);
    pump(&mut c, &mut s, now);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::AddLinkResult(Err(AddLinkRefused::Rejected)))
    );
    // An unusable request (MTU 0, or our own link id) is rejected without asking the driver.
    for bad in [
        AddLink {
            mtu: clc::QpMtu::from_code(0),
            ..linux_add_link_request()
        },
        AddLink {
            link_id: c.params().link_id,
            ..linux_add_link_request()
        },
    ] {
        let m = LlcMessage {
            version: Version::V2,
            body: Llc::AddLink(bad),
        };
        c.handle_llc(&bytes(&m), now);
        assert_eq!(c.poll_event(), None);
        let Some(LlcMessage {
            body: Llc::AddLink(r),
            ..
        }) = c.poll_transmit()
        else {
            panic!()
        };
        assert!(r.response && r.reject);
    }
    // No answer: given up after the LLC wait; a stray late response is dropped.
    s.add_link(linux_add_link_request(), now);
    s.poll_transmit().unwrap();
    assert_eq!(s.poll_timeout(), Some(now + LLC_WAIT));
    s.handle_timeout(now + LLC_WAIT);
    assert_eq!(
        s.poll_event(),
        Some(LinkEvent::AddLinkResult(Err(AddLinkRefused::Timeout)))
    );
    let late = LlcMessage {
        version: Version::V2,
        body: Llc::AddLink(AddLink {
            response: true,
            ..linux_add_link_request()
        }),
    };
    let dropped = s.stats().dropped;
    s.handle_llc(&bytes(&late), now);
    assert_eq!((s.poll_event(), s.stats().dropped), (None, dropped + 1));
    assert_eq!(s.state(), LinkState::Active);
}

#[test]
fn an_added_link_confirms_like_the_first_with_linux_s_five_second_wait() {
    let now = Instant::now();
    let mut p_s = params(Role::Server);
    p_s.link_id = 2;
    p_s.qpn = 0x12;
    let mut p_c = params(Role::Client);
    p_c.link_id = 2; // learned from ADD LINK
    p_c.qpn = 0x44;
    let mut s = LinkCore::new_added(p_s, now);
    let mut c = LinkCore::new_added(p_c, now);
    assert_eq!(s.poll_timeout(), Some(now + ADDED_CONFIRM_WAIT));
    assert_eq!(c.poll_timeout(), Some(now + ADDED_CONFIRM_WAIT));
    let req = s.poll_transmit().unwrap();
    assert_eq!(&bytes(&req)[..4], &[0x21, 0x2c, 0, 0x03]);
    c.handle_llc(&bytes(&req), now);
    pump(&mut c, &mut s, now);
    assert!(
        matches!(s.poll_event(), Some(LinkEvent::Up { peer }) if peer.qpn == 0x44 && peer.link_id == 2)
    );
    assert!(matches!(c.poll_event(), Some(LinkEvent::Up { peer }) if peer.qpn == 0x12));
    // Unconfirmed: down after 5 s.
    let mut lone = LinkCore::new_added(p_s, now);
    lone.handle_timeout(now + ADDED_CONFIRM_WAIT);
    assert_eq!(
        lone.poll_event(),
        Some(LinkEvent::Down(DownReason::ConfirmTimeout(
            ADDED_CONFIRM_WAIT
        )))
    );
}

#[test]
fn delete_link_for_another_link_of_the_group_moves_it_and_keeps_this_one() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    s.set_group_links(&[2]);
    c.set_group_links(&[2]);
    s.delete_other_link(2, DeleteLinkReason::LOST_PATH);
    let m = s.poll_transmit().unwrap();
    assert_eq!(
        bytes(&m),
        hex(
            "242c002002000100000000000000000000000000000000000000000000000000000000000000000000000000"
        ),
        "Linux's DELETE LINK for one lost link: orderly, not ALL"
    );
    c.handle_llc(&bytes(&m), now);
    assert_eq!(
        c.poll_event(),
        Some(LinkEvent::PeerDeletedLink {
            link_id: 2,
            reason: DeleteLinkReason::LOST_PATH
        })
    );
    assert_eq!(
        bytes(&c.poll_transmit().unwrap()),
        hex(
            "242c00a002000000000000000000000000000000000000000000000000000000000000000000000000000000"
        ),
        "answered as Linux's client does (reason 0)"
    );
    assert_eq!(c.state(), LinkState::Active);
    // Link 2 is gone now: another DELETE LINK for it is NO_LINK.
    c.handle_llc(&bytes(&m), now);
    assert_eq!(c.poll_event(), None);
    let Some(LlcMessage {
        body: Llc::DeleteLink(d),
        ..
    }) = c.poll_transmit()
    else {
        panic!()
    };
    assert_eq!(d.reason, DeleteLinkReason::NO_LINK);
    // The response at the server changes nothing.
    pump(&mut c, &mut s, now);
    assert_eq!((s.poll_event(), s.state()), (None, LinkState::Active));
}

#[test]
fn confirm_rkey_for_two_links_carries_the_other_link_s_rtoken() {
    let now = Instant::now();
    let (mut s, mut c) = confirmed_pair(now);
    let other = llc::Rtoken {
        link_id: 2,
        rkey: 0x5ca,
        vaddr: 0xff3d_233f_8436_0000,
    };
    let id = s.confirm_rkey_links(0x3e3, 0x1000, &[other], now);
    let m = s.poll_transmit().unwrap();
    let b = bytes(&m);
    assert_eq!(&b[..5], &[0x26, 0x2c, 0, 0, 1], "one additional rtoken");
    assert_eq!(b[17], 2, "its link id");
    assert_eq!(&b[18..22], &0x5cau32.to_be_bytes());
    c.handle_llc(&b, now);
    let Some(LinkEvent::PeerConfirmedRkey(got)) = c.poll_event() else {
        panic!()
    };
    assert_eq!((got.num_additional, got.rtokens[1]), (1, other));
    pump(&mut c, &mut s, now);
    assert_eq!(s.poll_event(), Some(LinkEvent::RkeyDone { id, ok: true }));
}
