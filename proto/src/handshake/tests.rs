//! Both ends driven in memory with an explicit clock.

use super::*;
use std::net::Ipv4Addr;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ueid() -> Eid {
    Eid::new("SMC-KERNEL-PEER").unwrap()
}

fn cfg(id: u8, host: &str) -> Config {
    Config::new(
        PeerId([0xe4, 0x1b, 0x52, 0x54, 0, 0x77, 0, id]),
        vec![ueid()],
        host,
    )
}

fn gid(last: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 77, 0, last))
}

fn endpoint(last: u8, token: u32) -> Endpoint {
    Endpoint {
        gid: gid(last),
        mac: Mac([0x52, 0x54, 0, 0x77, 0, last]),
        qpn: 0x11,
        initial_psn: 0x1000 + u32::from(last),
        mtu: QpMtu::MTU_1024,
        rmb_rkey: 0x300 + u32::from(last),
        rmb_vaddr: 0x1_0000_0000 * u64::from(last),
        rmb_size: RmbSize::DEFAULT,
        token,
    }
}

/// Moves every pending transmission of one side into the other, byte by byte when `trickle`,
/// and returns the sizes of the CLC messages moved.
fn deliver_to_server(c: &mut Client, s: &mut Server, sizes: &mut Vec<usize>) {
    while let Some(b) = c.poll_transmit() {
        sizes.push(b.len());
        let mut off = 0;
        while off < b.len() {
            let n = s.handle_data(&b[off..off + 1]);
            assert_eq!(n, 1, "server takes the whole message, byte by byte");
            off += n;
        }
    }
}

fn deliver_to_client(s: &mut Server, c: &mut Client, sizes: &mut Vec<usize>) {
    while let Some(b) = s.poll_transmit() {
        sizes.push(b.len());
        assert_eq!(c.handle_data(&b), b.len());
    }
}

#[test]
fn test_first_contact_like_linux() {
    let t0 = Instant::now();
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let mut sizes = vec![];
    deliver_to_server(&mut c, &mut s, &mut sizes);
    let Some(Event::Proposed {
        negotiated,
        client_gid,
        client_id,
    }) = s.poll_event()
    else {
        panic!()
    };
    assert_eq!(client_gid, gid(3));
    assert_eq!(client_id, cfg(3, "B").peer_id);
    assert_eq!(
        (
            negotiated.release,
            negotiated.max_conns,
            negotiated.max_links
        ),
        (1, 255, 1)
    );
    assert_eq!(negotiated.eid, ueid());
    s.accept(&endpoint(2, 1), true, t0).unwrap();
    deliver_to_client(&mut s, &mut c, &mut sizes);
    let Some(Event::Accepted {
        negotiated: n2,
        server,
    }) = c.poll_event()
    else {
        panic!()
    };
    assert_eq!(n2, negotiated);
    assert_eq!(server.endpoint, endpoint(2, 1));
    assert!(server.first_contact);
    assert_eq!(server.hostname.unwrap().to_string(), "A");
    c.confirm(&endpoint(3, 1), &[], t0).unwrap();
    assert_eq!(c.poll_event(), Some(Event::Confirmed));
    deliver_to_server(&mut c, &mut s, &mut sizes);
    let Some(Event::Established {
        negotiated: n3,
        client,
    }) = s.poll_event()
    else {
        panic!()
    };
    assert_eq!(n3, negotiated);
    assert_eq!(client.endpoint, endpoint(3, 1));
    assert_eq!(client.gids, [gid(3)]);
    // The same message sizes as the Linux 6.12 session in testdata/.
    assert_eq!(sizes, [156, 160, 180]);
    assert_eq!(
        (c.wants(), s.wants()),
        (0, 0),
        "nothing more is read as CLC"
    );
    assert_eq!((c.poll_timeout(), s.poll_timeout()), (None, None));
}

#[test]
fn test_reused_link_group() {
    let t0 = Instant::now();
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let mut sizes = vec![];
    deliver_to_server(&mut c, &mut s, &mut sizes);
    assert!(matches!(s.poll_event(), Some(Event::Proposed { .. })));
    s.accept(&endpoint(2, 2), false, t0).unwrap();
    deliver_to_client(&mut s, &mut c, &mut sizes);
    let Some(Event::Accepted { server, .. }) = c.poll_event() else {
        panic!()
    };
    assert!(!server.first_contact);
    c.confirm(&endpoint(3, 2), &[], t0).unwrap();
    deliver_to_server(&mut c, &mut s, &mut sizes);
    assert!(
        matches!(s.poll_event(), Some(Event::Established { client, .. }) if !client.first_contact)
    );
    assert_eq!(sizes, [156, 108, 108], "as the kernel's second connection");
}

/// The Proposal a Linux 6.12 client sent (testdata capture, frame 4).
const LINUX_PROPOSAL: &str =
    "e2d4c3d9 01009c22 00000000 00000000 00000000 00000000 00000000 00000000
    00000000 00000000 00000000 00000000 0000001c 00000000 00000000 00000000 00000000 00000000
    00000000 00000000 01000010 00000000 00000000 00000000 0000ffff 0a4d0003 ff020001 00000000
    00000000 00000000 534d432d 4b45524e 454c2d50 45455220 20202020 20202020 20202020 20202020
    e2d4c3d9";

/// The Accept a Linux 6.12 server sent (testdata capture, frame 6).
const LINUX_ACCEPT: &str = "e2d4c3d9 0200a028 e41b5254 00770002 00000000 00000000 0000ffff 0a4d0002
    52540077 00020000 11000003 e3010000 00012300 ff3d233f 84360000 003600a1 534d432d 4b45524e
    454c2d50 45455220 20202020 20202020 20202020 20202020 00000000 00000000 80210000 41202020
    20202020 20202020 20202020 20202020 20202020 20202020 20202020 ff020001 00000000 00000000
    00000000 e2d4c3d9";

#[test]
fn test_server_accepts_a_linux_proposal() {
    let t0 = Instant::now();
    let mut s = Server::new(cfg(2, "A"), t0);
    let p = hex(LINUX_PROPOSAL);
    assert_eq!(s.handle_data(&p), 156);
    let Some(Event::Proposed {
        negotiated,
        client_gid,
        client_id,
    }) = s.poll_event()
    else {
        panic!()
    };
    assert_eq!(client_gid, gid(3));
    // A v2-only Linux Proposal leaves the system ID zero.
    assert_eq!(client_id, PeerId([0; 8]));
    // Linux offered max_links 2; we take the minimum, 1, so it will not wait for ADD LINK.
    assert_eq!(
        (
            negotiated.max_links,
            negotiated.max_conns,
            negotiated.release
        ),
        (1, 255, 1)
    );
    assert_eq!(negotiated.feature_mask, 0);
}

#[test]
fn test_client_takes_a_linux_accept() {
    let t0 = Instant::now();
    let mut cf = cfg(3, "B");
    cf.max_links = 2;
    let mut c = Client::new(cf, gid(3), t0);
    c.poll_transmit().unwrap();
    let a = hex(LINUX_ACCEPT);
    assert_eq!(c.handle_data(&a), 160);
    let Some(Event::Accepted { negotiated, server }) = c.poll_event() else {
        panic!()
    };
    assert_eq!((negotiated.max_links, negotiated.max_conns), (2, 255));
    assert_eq!(
        (
            server.endpoint.qpn,
            server.endpoint.rmb_rkey,
            server.endpoint.token
        ),
        (0x11, 0x3e3, 1)
    );
    assert_eq!(server.endpoint.initial_psn, 0x3600a1);

    // A client that supports one link refuses the Linux server's max_links 2.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    c.poll_transmit().unwrap();
    c.handle_data(&a);
    assert_eq!(
        c.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::MAXLINKERR,
            by_peer: false,
            out_of_sync: false
        })
    );
    let d = c.poll_transmit().unwrap();
    assert_eq!(d.len(), 44, "v2 Decline");
}

#[test]
fn test_no_common_ueid_falls_back_on_both_sides() {
    let t0 = Instant::now();
    let mut other = cfg(3, "B");
    other.ueids = vec![Eid::new("SOMETHING-ELSE").unwrap()];
    let mut c = Client::new(other, gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let mut sizes = vec![];
    deliver_to_server(&mut c, &mut s, &mut sizes);
    assert_eq!(
        s.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::NOUEID,
            by_peer: false,
            out_of_sync: false
        })
    );
    // The Decline, then application bytes in the same TCP stream: the client takes only the
    // Decline and leaves the rest to the application.
    let mut stream = s.poll_transmit().unwrap();
    let decline_len = stream.len();
    stream.extend_from_slice(b"+OK application data\r\n");
    let used = c.handle_data(&stream);
    assert_eq!(used, decline_len);
    assert_eq!(
        c.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::NOUEID,
            by_peer: true,
            out_of_sync: false
        })
    );
    assert_eq!(c.wants(), 0);
    assert_eq!(c.handle_data(b"more"), 0);
}

#[test]
fn test_server_declines_after_proposal() {
    let t0 = Instant::now();
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let mut sizes = vec![];
    deliver_to_server(&mut c, &mut s, &mut sizes);
    s.poll_event().unwrap();
    s.decline(DeclineReason::MEM).unwrap();
    assert!(
        s.accept(&endpoint(2, 1), true, t0).is_err(),
        "no accept after a decline"
    );
    deliver_to_client(&mut s, &mut c, &mut sizes);
    assert_eq!(
        c.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::MEM,
            by_peer: true,
            out_of_sync: false
        })
    );
}

#[test]
fn test_client_syncerr_terminates_server_link_group() {
    let t0 = Instant::now();
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let mut sizes = vec![];
    deliver_to_server(&mut c, &mut s, &mut sizes);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 2), false, t0).unwrap();
    deliver_to_client(&mut s, &mut c, &mut sizes);
    c.poll_event().unwrap();
    // The client has no such link group.
    c.decline(DeclineReason::SYNCERR).unwrap();
    deliver_to_server(&mut c, &mut s, &mut sizes);
    assert_eq!(
        s.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::SYNCERR,
            by_peer: true,
            out_of_sync: true
        })
    );
}

fn proposal_of(c: &mut Client) -> Vec<u8> {
    c.poll_transmit().unwrap()
}

#[test]
fn test_a_late_accept_or_proposal_is_waited_for_in_rounds_without_a_decline() {
    let t0 = Instant::now();
    // The client: no Decline on a timeout (it could cross the server's answer); the Accept
    // 20 s late is taken and the handshake goes on.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    let proposal = c.poll_transmit().unwrap();
    assert_eq!(c.poll_timeout(), Some(t0 + CLC_WAIT_TIME));
    let mut t = t0;
    for _ in 0..3 {
        t += CLC_WAIT_TIME;
        c.handle_timeout(t);
        assert_eq!((c.poll_event(), c.poll_transmit()), (None, None));
    }
    s.handle_data(&proposal);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), true, t).unwrap();
    deliver_to_client(&mut s, &mut c, &mut vec![]);
    assert!(matches!(c.poll_event(), Some(Event::Accepted { .. })));
    // By default the client waits for the Accept as long as TCP is up (our servers answer
    // at the application's first use of the connection): an hour of rounds, then it comes.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let proposal = c.poll_transmit().unwrap();
    let mut t = t0;
    while t < t0 + Duration::from_secs(3600) {
        t = c.poll_timeout().expect("still waiting");
        c.handle_timeout(t);
        assert_eq!((c.poll_event(), c.poll_transmit()), (None, None));
    }
    let mut s = Server::new(cfg(2, "A"), t);
    s.handle_data(&proposal);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), true, t).unwrap();
    deliver_to_client(&mut s, &mut c, &mut vec![]);
    assert!(matches!(c.poll_event(), Some(Event::Accepted { .. })));
    // With a limit (`accept_wait_max`): nothing for that long fails, still without a Decline.
    let mut limited = cfg(3, "B");
    limited.accept_wait_max = Some(OWED_WAIT_MAX);
    let mut c = Client::new(limited, gid(3), t0);
    c.poll_transmit().unwrap();
    let mut t = t0;
    while c.poll_event().is_none() {
        t += CLC_WAIT_TIME;
        assert!(t <= t0 + OWED_WAIT_MAX + CLC_WAIT_TIME, "gives up in time");
        c.handle_timeout(t);
        assert_eq!(c.poll_transmit(), None, "no Decline");
    }
    assert!(t >= t0 + OWED_WAIT_MAX);
    // Part of an Accept that then stalls is a broken peer: fail at the end of the round.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    c.poll_transmit().unwrap();
    let mut s = Server::new(cfg(2, "A"), t0);
    s.handle_data(&proposal);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), true, t0).unwrap();
    let accept = s.poll_transmit().unwrap();
    c.handle_data(&accept[..20]);
    c.handle_timeout(t0 + CLC_WAIT_TIME);
    assert_eq!(
        c.poll_event(),
        Some(Event::Failed(Error::Timeout {
            waiting_for: MsgType::Accept,
            waited: CLC_WAIT_TIME
        }))
    );
    // The server: a Proposal 18 s late is taken; a partial one fails at the end of its round.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    for k in 1..=3 {
        s.handle_timeout(t0 + k * CLC_WAIT_TIME);
        assert_eq!((s.poll_event(), s.poll_transmit()), (None, None));
    }
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    assert!(matches!(s.poll_event(), Some(Event::Proposed { .. })));
    let mut s = Server::new(cfg(2, "A"), t0);
    s.handle_data(&proposal[..proposal.len() - 1]);
    s.handle_timeout(t0 + CLC_WAIT_TIME);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Failed(Error::Timeout { .. }))
    ));
    assert_eq!(s.poll_transmit(), None);
}

#[test]
fn test_the_server_waits_for_the_confirm_in_rounds() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(1);
    // The client may already be writing over RDMA (reused group): no fallback, no giving up
    // while it may still come; a Confirm 19 s late is taken.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), false, t1).unwrap();
    deliver_to_client(&mut s, &mut c, &mut vec![]);
    c.poll_event().unwrap();
    let mut t = t1;
    for _ in 0..3 {
        t += CLC_WAIT_TIME;
        s.handle_timeout(t);
        assert_eq!((s.poll_event(), s.poll_transmit()), (None, None));
        assert_eq!(s.poll_timeout(), Some(t + CLC_WAIT_TIME));
    }
    c.confirm(&endpoint(3, 2), &[], t0).unwrap();
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    assert!(matches!(s.poll_event(), Some(Event::Established { .. })));
    // Nothing for OWED_WAIT_MAX after the Accept: fail, no Decline.
    let mut s = Server::new(cfg(2, "A"), t0);
    s.handle_data(&proposal_of(&mut Client::new(cfg(3, "B"), gid(3), t0)));
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), false, t1).unwrap();
    s.poll_transmit().unwrap();
    let mut t = t1;
    while s.poll_event().is_none() {
        t += CLC_WAIT_TIME;
        assert!(t <= t1 + OWED_WAIT_MAX + CLC_WAIT_TIME, "gives up in time");
        s.handle_timeout(t);
        assert_eq!(s.poll_transmit(), None, "no Decline");
    }
    assert!(t >= t1 + OWED_WAIT_MAX);
}

/// Client and server through a first-contact Confirm, events taken.
fn confirmed_first_contact(t0: Instant) -> (Client, Server) {
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), true, t0).unwrap();
    deliver_to_client(&mut s, &mut c, &mut vec![]);
    c.poll_event().unwrap();
    c.confirm(&endpoint(3, 1), &[], t0).unwrap();
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    assert_eq!(c.poll_event(), Some(Event::Confirmed));
    assert!(matches!(s.poll_event(), Some(Event::Established { .. })));
    (c, s)
}

#[test]
fn test_first_link_failure_the_server_declines_timeout_cl_and_the_client_follows() {
    let t0 = Instant::now();
    let (mut c, mut s) = confirmed_first_contact(t0);
    // The server's CONFIRM LINK wait (2 s) ends first; it listens 1 s for a Decline.
    let ts = t0 + crate::link::CONFIRM_WAIT;
    s.link_failed(ts).unwrap();
    assert_eq!(s.poll_timeout(), Some(ts + CLC_WAIT_TIME_SHORT));
    assert!(s.wants() > 0);
    // The client's link fails early (the server ended the group): it listens until 1 s
    // after its own 4 s wait, so the server's Decline (at 3 s) is in time.
    let tc = t0 + Duration::from_millis(2100);
    c.link_failed(tc).unwrap();
    assert_eq!(
        c.poll_timeout(),
        Some(t0 + crate::link::CLIENT_CONFIRM_WAIT + CLC_WAIT_TIME_SHORT)
    );
    s.handle_timeout(ts + CLC_WAIT_TIME_SHORT);
    assert_eq!(
        s.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::TIMEOUT_CL,
            by_peer: false,
            out_of_sync: false
        })
    );
    deliver_to_client(&mut s, &mut c, &mut vec![]);
    assert_eq!(
        c.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::TIMEOUT_CL,
            by_peer: true,
            out_of_sync: false
        })
    );
    assert_eq!(
        c.poll_transmit(),
        None,
        "the client sends no Decline of its own"
    );

    // A silent server: the client declines itself once its window ends.
    let (mut c, mut s) = confirmed_first_contact(t0);
    c.link_failed(t0 + crate::link::CLIENT_CONFIRM_WAIT)
        .unwrap();
    c.handle_timeout(t0 + crate::link::CLIENT_CONFIRM_WAIT + CLC_WAIT_TIME_SHORT);
    assert_eq!(
        c.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::TIMEOUT_CL,
            by_peer: false,
            out_of_sync: false
        })
    );
    // A server still listening takes it as the peer's.
    s.link_failed(t0 + crate::link::CONFIRM_WAIT).unwrap();
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Fallback { by_peer: true, .. })
    ));

    // Only after a first-contact Confirm.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    assert!(c.link_failed(t0).is_err());
    let mut s = Server::new(cfg(2, "A"), t0);
    assert!(s.link_failed(t0).is_err());
    // EOF while listening fails.
    let (mut c, _) = confirmed_first_contact(t0);
    c.link_failed(t0).unwrap();
    c.handle_eof();
    assert_eq!(c.poll_event(), Some(Event::Failed(Error::PeerClosed)));
}

#[test]
fn test_protocol_errors_fail() {
    let t0 = Instant::now();
    // Not CLC at all.
    let mut s = Server::new(cfg(2, "A"), t0);
    assert_eq!(s.handle_data(b"GET / HTTP/1.1\r\n"), 8);
    assert!(matches!(
        s.poll_event(),
        Some(Event::Failed(Error::Malformed(clc::Error::BadEyecatcher(
            _
        ))))
    ));
    // A Confirm where a Proposal belongs.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s0 = Server::new(cfg(2, "A"), t0);
    deliver_to_server(&mut c, &mut s0, &mut vec![]);
    s0.poll_event().unwrap();
    s0.accept(&endpoint(2, 1), true, t0).unwrap();
    let accept = s0.poll_transmit().unwrap();
    let mut s = Server::new(cfg(2, "A"), t0);
    s.handle_data(&accept);
    assert_eq!(
        s.poll_event(),
        Some(Event::Failed(Error::Unexpected {
            expected: MsgType::Proposal,
            got: MsgType::Accept
        }))
    );
    // EOF.
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    c.handle_eof();
    assert_eq!(c.poll_event(), Some(Event::Failed(Error::PeerClosed)));
}

#[test]
fn test_confirm_feature_mismatch_is_declined() {
    let t0 = Instant::now();
    let mut c = Client::new(cfg(3, "B"), gid(3), t0);
    let mut s = Server::new(cfg(2, "A"), t0);
    deliver_to_server(&mut c, &mut s, &mut vec![]);
    s.poll_event().unwrap();
    s.accept(&endpoint(2, 1), true, t0).unwrap();
    let accept = s.poll_transmit().unwrap();
    c.handle_data(&accept);
    c.poll_event().unwrap();
    c.confirm(&endpoint(3, 1), &[], t0).unwrap();
    let confirm = c.poll_transmit().unwrap();
    // Tamper with the echoed max_conns (FCE byte 36 at offset 104 + 36).
    let mut m = Message::parse(&confirm).unwrap();
    if let Message::AcceptConfirm(a) = &mut m
        && let AcceptBody::SmcR(r) = &mut a.body
    {
        r.v2.as_mut().unwrap().fce.as_mut().unwrap().max_conns = 100;
    }
    s.handle_data(&m.to_vec());
    assert_eq!(
        s.poll_event(),
        Some(Event::Fallback {
            reason: DeclineReason::MAXCONNERR,
            by_peer: false,
            out_of_sync: false
        })
    );
}

#[test]
fn test_unsupported_proposals_get_linux_codes() {
    let t0 = Instant::now();
    let base = Message::parse(&hex(LINUX_PROPOSAL)).unwrap();
    let Message::Proposal(p) = base else { panic!() };
    let run = |p: &Proposal| {
        let mut s = Server::new(cfg(2, "A"), t0);
        s.handle_data(&Message::Proposal(p.clone()).to_vec());
        match s.poll_event() {
            Some(Event::Fallback {
                reason,
                by_peer: false,
                ..
            }) => reason,
            e => panic!("{e:?}"),
        }
    };
    let mut v2_no_ext = p.clone();
    v2_no_ext.v2 = None;
    assert_eq!(run(&v2_no_ext), DeclineReason::NOV2EXT);
    let mut few_conns = p.clone();
    few_conns.v2.as_mut().unwrap().max_conns = 8;
    assert_eq!(run(&few_conns), DeclineReason::MAXCONNERR);
    let mut no_links = p.clone();
    no_links.v2.as_mut().unwrap().max_links = 0;
    assert_eq!(run(&no_links), DeclineReason::MAXLINKERR);
    let mut v1_only = p.clone();
    v1_only.typev1 = SmcType::R;
    v1_only.typev2 = SmcType::None;
    v1_only.v2 = None;
    v1_only.prefix = Some(clc::IpPrefixArea {
        ipv4_subnet: Ipv4Addr::new(10, 77, 0, 0),
        ipv4_prefix_len: 24,
        ipv6: vec![],
    });
    assert_eq!(run(&v1_only), DeclineReason::NOSMCRDEV);
    // Release 0 (v2.0 peer): limits are not negotiated, and not checked.
    let mut r0 = p.clone();
    r0.v2.as_mut().unwrap().release = 0;
    r0.v2.as_mut().unwrap().max_conns = 0;
    let mut s = Server::new(cfg(2, "A"), t0);
    s.handle_data(&Message::Proposal(r0).to_vec());
    assert!(
        matches!(s.poll_event(), Some(Event::Proposed { negotiated, .. }) if negotiated.release == 0)
    );
}
