//! A hostile peer (issue 8): an SMC-R client built from our own crates that misbehaves on
//! purpose over a real link (two namespaces, RoCE v2 over UDP) — RDMA WRITEs with a wrong rkey
//! or outside the RMB, CDC cursors beyond the RMB or moving backwards, LLC for links that do
//! not exist or out of turn, CLC messages with bad fields. Each must end that connection or
//! that link with an error on the server, and leave the server's other peer (a third
//! namespace, its own link group) untouched. Needs feature `hostile` (SmcStream::hostile_*).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{NetPair, TestInstall, Third, in_netns, privileged, wait_until};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

const PORT: u16 = 7500;

struct Setup {
    net: NetPair,
    _third: Third,
    /// Kept: the good peer's link groups end with its last handle.
    _good_rt: Runtime,
    install: TestInstall,
    server_rt: Runtime,
    accepted: mpsc::Receiver<SmcStream>,
    /// The well-behaved peer's connection, both ends.
    good: (SmcStream, SmcStream),
}

fn runtime(install: &TestInstall) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    cfg.remote_rmb_size = None; // 64 KiB RMBs
    // Two namespaces stand for two hosts: the RoCE path (not shared memory through the
    // host-wide rendezvous).
    cfg.same_host = false;
    Runtime::new(cfg)
}

impl Setup {
    fn new(tag: &str) -> Self {
        let install = TestInstall::new(tag);
        let net = NetPair::new().unwrap();
        let third = Third::new(&net).unwrap();
        let server_rt = runtime(&install);
        let (tx, accepted) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        {
            let rt = server_rt.clone();
            in_netns(&net.b, move || {
                let l = SmcListener::bind(&rt, (std::net::Ipv4Addr::UNSPECIFIED, PORT)).unwrap();
                ready_tx.send(()).unwrap();
                while let Ok((s, _)) = l.accept() {
                    if tx.send(s).is_err() {
                        return;
                    }
                }
            });
        }
        ready.recv().unwrap();
        let good_rt = runtime(&install);
        let to: SocketAddr = (third.addr_b2, PORT).into();
        let rt = good_rt.clone();
        let c = in_netns(&third.c, move || SmcStream::connect(&rt, to).unwrap())
            .join()
            .unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let s = accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        let mut me = Self {
            net,
            _third: third,
            _good_rt: good_rt,
            install,
            server_rt,
            accepted,
            good: (c, s),
        };
        me.good_still_works("first");
        me
    }

    /// A hostile runtime's connection to the server, and the server's end of it.
    fn hostile(&self, rt: &Runtime) -> (SmcStream, SmcStream) {
        let rt = rt.clone();
        let to: SocketAddr = (self.net.addr_b, PORT).into();
        let c = in_netns(&self.net.a, move || SmcStream::connect(&rt, to).unwrap())
            .join()
            .unwrap();
        assert!(matches!(c.mode(), Mode::SmcR { .. }), "{:?}", c.mode());
        let s = self.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        (c, s)
    }

    /// The other peer's connection echoes a message intact.
    fn good_still_works(&mut self, what: &str) {
        echo(&mut self.good.0, &mut self.good.1, what.as_bytes());
    }

    /// Waits until the server has `n` link groups.
    fn server_groups(&self, n: usize) {
        let waited = wait_until(Duration::from_secs(8), || self.server_rt.link_groups() == n);
        assert_eq!(
            self.server_rt.link_groups(),
            n,
            "server link groups after {waited:?}"
        );
    }
}

/// `msg` from `c` to `s` and back.
fn echo(c: &mut SmcStream, s: &mut SmcStream, msg: &[u8]) {
    c.write_all(msg).unwrap();
    let mut b = vec![0u8; msg.len()];
    s.read_exact(&mut b).unwrap();
    assert_eq!(b, msg);
    s.write_all(&b).unwrap();
    c.read_exact(&mut b).unwrap();
    assert_eq!(b, msg);
}

/// A read on `s` fails (the connection ended with an error) within `within`; the error.
fn fails_within(s: &mut SmcStream, within: Duration) -> std::io::Error {
    s.set_read_timeout(Some(within)).unwrap();
    let t = Instant::now();
    loop {
        match s.read(&mut [0u8; 4096]) {
            Ok(0) => panic!("EOF instead of an error"),
            Ok(_) => continue, // earlier, legitimate bytes
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("no error after {:?}", t.elapsed())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return e,
        }
    }
}

/// RDMA WRITEs the server never allowed: a wrong rkey, past the end of the RMB, before its
/// start, and straddling its end. The server's responder refuses each before a byte lands
/// (NAK, remote access error), its QP fails, and with it that link group only: both ends'
/// connections on it get an error; the other peer goes on.
#[test]
fn writes_outside_what_was_granted_end_that_link_only() {
    if !privileged("hostile writes") {
        return;
    }
    let mut s = Setup::new("hwrite");
    let bad = runtime(&s.install);
    const RMB: i64 = 64 * 1024;
    for (what, offset, len, rkey) in [
        ("a wrong rkey", 0, 1024, Some(0x0bad_0bad)),
        ("past the end", RMB, 1024, None),
        ("before the start", -4096, 1024, None),
        ("straddling the end", RMB - 16, 1024, None),
    ] {
        let (mut h, mut hs) = s.hostile(&bad);
        echo(&mut h, &mut hs, b"legitimate first");
        s.server_groups(2);
        let t = Instant::now();
        h.hostile_write(offset, len, 0xee, rkey).unwrap();
        let server_saw = fails_within(&mut hs, Duration::from_secs(5));
        let hostile_saw = fails_within(&mut h, Duration::from_secs(5));
        eprintln!(
            "{what}: server {:?} \"{server_saw}\", hostile {:?} \"{hostile_saw}\" after {:?}",
            server_saw.kind(),
            hostile_saw.kind(),
            t.elapsed()
        );
        assert_eq!(server_saw.kind(), ErrorKind::ConnectionReset, "{what}");
        drop((h, hs));
        s.server_groups(1);
        s.good_still_works(what);
    }
    let st = s.server_rt.device_stats();
    eprintln!("server devices: {st:?}");
}

/// CDC messages with cursors the server cannot honour: outside the ring, claiming more
/// unread bytes than the RMB holds, claiming the server's bytes were read before they were
/// written. Each ends that connection with an error naming the cursor; the hostile peer's
/// other connection on the same link group and the other peer go on. A producer moving
/// backwards (a stale update) is ignored and loses nothing.
#[test]
fn impossible_cdc_cursors_end_that_connection_only() {
    if !privileged("hostile cdc") {
        return;
    }
    use cdc::Cursor;
    let mut s = Setup::new("hcdc");
    let bad = runtime(&s.install);
    let (mut other, mut other_s) = s.hostile(&bad);
    echo(
        &mut other,
        &mut other_s,
        b"a bystander on the same link group",
    );
    // A stale producer: ignored, the stream stays intact.
    let (mut h, mut hs) = s.hostile(&bad);
    echo(&mut h, &mut hs, b"sixteen bytes...");
    h.hostile_cdc(|m| m.prod = Cursor::new(0, 0)).unwrap();
    echo(&mut h, &mut hs, b"after a stale producer cursor");
    type Change = fn(&mut cdc::CdcMessage);
    let cases: [(&str, Change); 3] = [
        ("a producer outside the ring", |m| {
            m.prod = Cursor::new(m.prod.wrap, 70_000)
        }),
        ("a producer a whole ring ahead", |m| {
            m.prod = Cursor::new(m.prod.wrap.wrapping_add(1), m.prod.count + 100)
        }),
        ("a consumer beyond what the server wrote", |m| {
            m.cons = Cursor::new(m.cons.wrap, m.cons.count + 5000)
        }),
    ];
    for (what, f) in cases {
        let (mut h, mut hs) = s.hostile(&bad);
        echo(&mut h, &mut hs, b"legitimate first");
        h.hostile_cdc(f).unwrap();
        let e = fails_within(&mut hs, Duration::from_secs(5));
        eprintln!("{what}: server {:?} \"{e}\"", e.kind());
        assert!(e.to_string().contains("cursor"), "{what}: {e}");
        // The link and the bystander are fine.
        echo(&mut other, &mut other_s, what.as_bytes());
        s.good_still_works(what);
    }
    s.server_groups(2);
}

/// LLC messages out of place: DELETE LINK for a link the group does not have (answered
/// NO_LINK, nothing deleted), ADD LINK (rejected: one link per group), a flood of 20 000
/// SENDs of an unknown LLC type (dropped, counted) — the link keeps working through all of
/// them; then CONFIRM LINK on a confirmed link, a protocol violation: the server deletes the
/// link group (PROT_VIOL) and the hostile peer's connections fail, the other peer's do not.
#[test]
fn llc_out_of_place_is_answered_dropped_or_ends_the_link() {
    if !privileged("hostile llc") {
        return;
    }
    use llc::{AddLink, ConfirmLink, DeleteLink, DeleteLinkReason, Llc, LlcMessage, Version};
    let emit = |body: Llc| {
        let m = LlcMessage {
            version: Version::V2,
            body,
        };
        let mut b = vec![0u8; m.buffer_len()];
        m.emit(&mut b);
        b
    };
    let mut s = Setup::new("hllc");
    let bad = runtime(&s.install);
    let (mut h, mut hs) = s.hostile(&bad);
    echo(&mut h, &mut hs, b"legitimate first");
    h.hostile_send(&emit(Llc::DeleteLink(DeleteLink {
        response: false,
        all: false,
        orderly: false,
        link_id: 99,
        reason: DeleteLinkReason::LOST_PATH,
    })))
    .unwrap();
    echo(&mut h, &mut hs, b"after DELETE LINK for link 99");
    h.hostile_send(&emit(Llc::AddLink(AddLink {
        response: false,
        reject: false,
        reject_reason: 0,
        mac: clc::Mac([2, 0, 1, 2, 3, 4]),
        gid: clc::Gid::from_ipv4(std::net::Ipv4Addr::new(10, 77, 0, 9)),
        qpn: 0x1234,
        link_id: 2,
        mtu: clc::QpMtu::MTU_1024,
        initial_psn: 1,
        v2: None,
    })))
    .unwrap();
    echo(&mut h, &mut hs, b"after ADD LINK");
    let mut unknown = [0u8; 44];
    unknown[0] = 0x2a; // v2, type 0xa: none
    unknown[1] = 44;
    let t = Instant::now();
    for _ in 0..20_000 {
        h.hostile_send(&unknown).unwrap();
    }
    eprintln!("20 000 unknown LLC SENDs posted in {:?}", t.elapsed());
    echo(&mut h, &mut hs, b"after a flood");
    s.good_still_works("after a flood");
    s.server_groups(2);
    // Out of turn: the link is confirmed.
    h.hostile_send(&emit(Llc::ConfirmLink(ConfirmLink {
        response: false,
        no_rmbe_eyecatcher: 3,
        mac: clc::Mac([2, 0, 1, 2, 3, 4]),
        gid: clc::Gid::from_ipv4(std::net::Ipv4Addr::new(10, 77, 0, 1)),
        qpn: 0x1234,
        link_id: 1,
        link_uid: [0; 4],
        max_links: 1,
        max_conns: 255,
    })))
    .unwrap();
    let e = fails_within(&mut hs, Duration::from_secs(5));
    eprintln!("CONFIRM LINK out of turn: server {:?} \"{e}\"", e.kind());
    assert!(e.to_string().contains("violation"), "{e}");
    let e = fails_within(&mut h, Duration::from_secs(5));
    eprintln!("... and the hostile peer {:?} \"{e}\"", e.kind());
    drop((h, hs));
    s.server_groups(1);
    s.good_still_works("after the violation");
}

/// CLC Proposals with a bad eyecatcher, length, version, type or trailer: the server answers
/// with a Decline or closes, within its CLC wait (6 s: a length promising more bytes than come
/// is only found out then), never hangs or crashes, and serves the next client (over SMC-R)
/// and the other peer as before. A version above 2 is not an error (a future SMC proposing):
/// the server answers as v2.
#[test]
fn malformed_clc_proposals_are_refused_and_the_server_goes_on() {
    if !privileged("hostile clc") {
        return;
    }
    use smcr::handshake::Client;
    use std::os::fd::AsFd;
    let mut s = Setup::new("hclc");
    let bad = runtime(&s.install);
    let proposal = Client::new(
        RuntimeConfig::new().handshake,
        clc::Gid::from_ipv4(s.net.addr_a),
        Instant::now(),
    )
    .poll_transmit()
    .unwrap();
    assert_eq!(&proposal[..4], &[0xe2, 0xd4, 0xc3, 0xd9]);
    let n = proposal.len();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("eyecatcher", {
            let mut b = proposal.clone();
            b[0] = 0x00;
            b
        }),
        ("length 0xffff", {
            let mut b = proposal.clone();
            b[5..7].copy_from_slice(&0xffffu16.to_be_bytes());
            b
        }),
        ("length 8", {
            let mut b = proposal.clone();
            b[5..7].copy_from_slice(&8u16.to_be_bytes());
            b
        }),
        ("length one short", {
            let mut b = proposal.clone();
            b[5..7].copy_from_slice(&(n as u16 - 1).to_be_bytes());
            b
        }),
        ("version 0", {
            let mut b = proposal.clone();
            b[7] &= 0x0f;
            b
        }),
        ("version 15", {
            let mut b = proposal.clone();
            b[7] |= 0xf0;
            b
        }),
        ("type 9", {
            let mut b = proposal.clone();
            b[4] = 9;
            b
        }),
        ("trailer", {
            let mut b = proposal.clone();
            b[n - 1] ^= 0xff;
            b
        }),
        ("garbage after a valid Proposal", {
            let mut b = proposal.clone();
            b.extend_from_slice(&[0xab; 4000]);
            b
        }),
        ("truncated, then EOF", proposal[..n / 2].to_vec()),
    ];
    let to: SocketAddr = (s.net.addr_b, PORT).into();
    for (what, bytes) in cases {
        let rt = bad.clone();
        let t = Instant::now();
        let answer = in_netns(&s.net.a, move || {
            let sock =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            assert!(rt.mark(sock.as_fd()));
            sock.connect(&to.into()).unwrap();
            let mut tcp: std::net::TcpStream = sock.into();
            tcp.set_read_timeout(Some(Duration::from_secs(45))).unwrap();
            tcp.write_all(&bytes).unwrap();
            if what.starts_with("truncated") {
                tcp.shutdown(std::net::Shutdown::Write).unwrap();
            }
            let mut got = Vec::new();
            match tcp.read_to_end(&mut got) {
                Ok(_) => Ok(got),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(got),
                Err(e) => Err(e),
            }
        })
        .join()
        .unwrap();
        let answer = answer.unwrap_or_else(|e| panic!("{what}: no answer, no close: {e}"));
        let decline =
            answer.len() >= 8 && answer[..4] == [0xe2, 0xd4, 0xc3, 0xd9] && answer[4] == 4;
        eprintln!(
            "{what}: {} after {:?}",
            if decline {
                format!(
                    "Decline, reason {:#010x}",
                    u32::from_be_bytes(answer[16..20].try_into().unwrap_or_default())
                )
            } else {
                format!("closed after {} bytes", answer.len())
            },
            t.elapsed()
        );
        // A higher version is a future SMC's: the server answers as v2 (an Accept), and
        // closes when no Confirm follows; garbage after a valid Proposal is a bad Confirm.
        // A malformed message otherwise closes the connection without a Decline (Linux: a
        // negative reason, no fallback possible).
        let accept = answer.len() >= 8 && answer[..4] == [0xe2, 0xd4, 0xc3, 0xd9] && answer[4] == 2;
        assert!(
            decline
                || answer.is_empty()
                || (matches!(what, "version 15" | "garbage after a valid Proposal") && accept),
            "{what}: {answer:02x?}"
        );
        // Within the CLC wait; after an Accept, the server waits for the Confirm in rounds
        // up to OWED_WAIT_MAX (a client may be writing over RDMA already).
        let bound = if accept {
            smcr::handshake::OWED_WAIT_MAX + Duration::from_secs(2)
        } else {
            Duration::from_secs(7)
        };
        assert!(t.elapsed() < bound, "{what}: {:?}", t.elapsed());
        // The server goes on: the other peer, and a well-formed connection from this one.
        s.good_still_works(what);
        while let Ok(extra) = s.accepted.try_recv() {
            // A declined connection may surface as a TCP one (it fell back).
            assert!(matches!(extra.mode(), Mode::Tcp(_)), "{what}");
        }
        let (mut h, mut hs) = s.hostile(&bad);
        echo(&mut h, &mut hs, what.as_bytes());
    }
}
