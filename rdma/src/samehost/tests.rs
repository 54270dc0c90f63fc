use super::*;
use crate::rc::{QpAttr, QpCaps, QpState, RecvWr};
use crate::wire::Psn;
use std::sync::atomic::Ordering;

/// A QP in RTR with `n` posted receives of 256 bytes, and a producer on its inbound ring.
fn consumer(n: u64) -> (RcQp, ShmQp, MrTable, Arc<crate::mr::Region>, Ring) {
    let a = Arena::create().unwrap();
    let mrs = MrTable::new(5);
    let buf = mrs
        .register_in(1, 4096, Access::LOCAL_WRITE, Some(&a))
        .unwrap();
    let mut rc = RcQp::new(9, 1, QpCaps::default(), false);
    rc.modify(&QpAttr::state(QpState::Init)).unwrap();
    for i in 0..n {
        rc.post_recv(
            &RecvWr {
                wr_id: i,
                sg_list: &[crate::rc::Sge {
                    addr: buf.addr() + i * 256,
                    length: 256,
                    lkey: buf.key(),
                }],
            },
            &mrs,
        )
        .unwrap();
    }
    rc.modify(&QpAttr {
        path_mtu: Some(crate::rc::Mtu::Mtu1024),
        dest_qp_num: Some(3),
        rq_psn: Some(Psn::new(0)),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    let shm = ShmQp::new(a).unwrap();
    let prod = Ring::attach(shm.inbound_seg.clone(), 0).unwrap();
    (rc, shm, mrs, buf, prod)
}

/// A QP `qpn` in RTS towards `dest`, with those starting PSNs.
pub(crate) fn rts_qp(qpn: u32, dest: u32, rq_psn: u32, sq_psn: u32) -> RcQp {
    let mut rc = RcQp::new(qpn, 1, QpCaps::default(), false);
    rc.modify(&QpAttr::state(QpState::Init)).unwrap();
    rc.modify(&QpAttr {
        path_mtu: Some(crate::rc::Mtu::Mtu1024),
        dest_qp_num: Some(dest),
        rq_psn: Some(Psn::new(rq_psn)),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    rc.modify(&QpAttr {
        sq_psn: Some(Psn::new(sq_psn)),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
    rc
}

fn entry(op: u8, flags: u8, imm: u32, total: u32, data: &[u8]) -> Vec<u8> {
    let mut e = vec![op, flags, 0, 0];
    e.extend_from_slice(&imm.to_le_bytes());
    e.extend_from_slice(&total.to_le_bytes());
    e.extend_from_slice(data);
    e
}

#[test]
fn ring_entries_become_receive_completions() {
    let (mut rc, mut shm, _mrs, buf, prod) = consumer(2);
    prod.push(&entry(E_SEND, F_FIRST, 0, 6, b"hel")).unwrap();
    prod.push(&entry(E_SEND, F_LAST, 0, 6, b"lo!")).unwrap();
    prod.push(&entry(E_WRITE_IMM, F_FIRST | F_LAST, 77, 5000, b""))
        .unwrap();
    assert_eq!(shm.receive(&mut rc).unwrap(), 2);
    let (_, w1) = rc.poll_completion().unwrap();
    assert_eq!((w1.wr_id, w1.byte_len, w1.opcode), (0, 6, WcOpcode::Recv));
    let (_, w2) = rc.poll_completion().unwrap();
    assert_eq!(
        (w2.wr_id, w2.byte_len, w2.opcode, w2.imm_data),
        (1, 5000, WcOpcode::RecvRdmaWithImm, Some(77))
    );
    let mut m = [0u8; 6];
    buf.read(0, &mut m);
    assert_eq!(&m, b"hello!");
    // No receive left: the next message waits in the ring.
    prod.push(&entry(E_SEND, F_FIRST | F_LAST, 0, 1, b"x"))
        .unwrap();
    assert_eq!(shm.receive(&mut rc).unwrap(), 0);
    assert!(!shm.rx_pending(&rc));
}

#[test]
fn malformed_ring_entries_fail_the_qp_instead_of_panicking() {
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("short", vec![vec![1, 3, 0]]),
        ("unknown op", vec![entry(9, F_FIRST | F_LAST, 0, 1, b"x")]),
        (
            "continuation first",
            vec![entry(E_SEND, F_LAST, 0, 1, b"x")],
        ),
        (
            "nested start",
            vec![
                entry(E_SEND, F_FIRST, 0, 4, b"ab"),
                entry(E_SEND, F_FIRST, 0, 4, b"cd"),
            ],
        ),
        (
            "longer than announced",
            vec![entry(E_SEND, F_FIRST | F_LAST, 0, 1, b"xy")],
        ),
        (
            "shorter than announced",
            vec![entry(E_SEND, F_FIRST | F_LAST, 0, 3, b"xy")],
        ),
        (
            "too long for the buffer",
            vec![entry(E_SEND, F_FIRST, 0, 100_000, b"x")],
        ),
        (
            "op changes mid-message",
            vec![
                entry(E_SEND, F_FIRST, 0, 4, b"ab"),
                entry(E_SEND_IMM, F_LAST, 0, 4, b"cd"),
            ],
        ),
        (
            "write-imm with data",
            vec![entry(E_WRITE_IMM, F_FIRST | F_LAST, 0, 4, b"ab")],
        ),
    ];
    for (name, entries) in cases {
        let (mut rc, mut shm, _mrs, _buf, prod) = consumer(4);
        for e in &entries {
            prod.push(e).unwrap();
        }
        assert!(shm.receive(&mut rc).is_err(), "{name}");
    }
    // A producer cursor far beyond the ring.
    let (mut rc, mut shm, _mrs, _buf, _prod) = consumer(1);
    shm.inbound_seg.u64_at(64).store(1 << 40, Ordering::Relaxed);
    assert!(shm.receive(&mut rc).is_err(), "cursor");
}

#[test]
fn an_offer_with_a_pipe_for_a_doorbell_is_refused() {
    let a = Arena::create().unwrap();
    let shm = ShmQp::new(a.clone()).unwrap();
    let [arena, ring] = shm.offer_fds();
    let with_bell = |bell: OwnedFd| {
        let fds = vec![
            arena.try_clone_to_owned().unwrap(),
            ring.try_clone_to_owned().unwrap(),
            bell,
            rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap(),
        ];
        PeerTx::new(
            2,
            "127.0.0.1:1".parse().unwrap(),
            fds,
            arena.try_clone_to_owned().unwrap(),
        )
    };
    let (_r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::NONBLOCK).unwrap();
    assert!(with_bell(w).is_err());
    // The same with an eventfd is accepted.
    let ev = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
    assert!(with_bell(ev).is_ok());
}

/// The producer rings the consumer's doorbell once per waiting word the consumer publishes:
/// three messages to a consumer asleep ring once; a consumer that woke and sleeps again (a new
/// word, the same bits) is rung again; an awake consumer is not rung.
#[test]
fn a_producer_rings_once_per_published_waiting_word() {
    use crate::notify::WAIT_EVENT;
    use rustix::event::{EventfdFlags, eventfd};
    let (_rc, c, _mrs, _buf, _prod) = consumer(0);
    let bell = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
    let [arena, ring] = c.offer_fds();
    let fds = vec![
        arena.try_clone_to_owned().unwrap(),
        ring.try_clone_to_owned().unwrap(),
        bell.try_clone().unwrap(),
        eventfd(0, EventfdFlags::NONBLOCK).unwrap(),
    ];
    let conn = arena.try_clone_to_owned().unwrap();
    let tx = PeerTx::new(9, "127.0.0.1:1".parse().unwrap(), fds, conn).unwrap();
    // The producer: a QP in RTS with a registered source buffer.
    let a = Arena::create().unwrap();
    let mrs = MrTable::new(6);
    let src = mrs
        .register_in(1, 64, Access::LOCAL_WRITE, Some(&a))
        .unwrap();
    let mut rc = rts_qp(3, 9, 0, 0);
    let mut p = ShmQp::new(a).unwrap();
    p.tx = Some(tx);
    let sge = [crate::rc::Sge {
        addr: src.addr(),
        length: 8,
        lkey: src.key(),
    }];
    // One write of the application: a SEND, then the end of its drive rings.
    let mut send = || {
        let wr = crate::rc::SendWr {
            wr_id: 1,
            opcode: WrOpcode::Send,
            sg_list: &sge,
            flags: crate::rc::SendFlags::empty(),
        };
        assert!(p.post(&mut rc, &wr, &mrs).unwrap(), "ran at once");
        p.ring_bell();
    };
    let rung = || {
        let mut b = [0u8; 8];
        rustix::io::read(&bell, &mut b).map_or(0, |_| u64::from_ne_bytes(b))
    };
    let word = |n: u64, bits: u32| n << 2 | u64::from(bits);
    c.set_waiting(word(1, WAIT_EVENT));
    for _ in 0..3 {
        send();
    }
    assert_eq!(rung(), 1, "three messages to one sleep ring once");
    c.set_waiting(word(2, 0));
    c.set_waiting(word(3, WAIT_EVENT));
    send();
    send();
    assert_eq!(rung(), 1, "asleep again: rung again, once");
    c.set_waiting(word(4, 0));
    send();
    assert_eq!(rung(), 0, "awake: not rung");
}
