use super::*;
use crate::rc::{QpAttr, QpCaps, QpState, RecvWr};
use crate::wire::Psn;

fn peer_of(a: &Arena) -> PeerArena {
    PeerArena::open(a.fd().try_clone_to_owned().unwrap()).unwrap()
}

#[test]
fn offers_round_trip_and_garbage_is_refused() {
    let o = Offer {
        to_qpn: 0x12_3456,
        from_qpn: 0xAB_CDEF,
        from: "10.1.2.3:4791".parse().unwrap(),
    };
    assert_eq!(Offer::parse(&o.emit()), Some(o));
    let good = o.emit();
    assert_eq!(Offer::parse(&good[..OFFER_LEN - 1]), None, "short");
    let mut long = good.to_vec();
    long.push(0);
    assert_eq!(Offer::parse(&long), None, "long");
    for i in 0..12 {
        let mut b = good;
        b[i] ^= 0x40;
        assert_eq!(Offer::parse(&b), None, "magic/version byte {i}");
    }
}

#[test]
fn the_peer_table_checks_keys_rights_and_bounds() {
    let a = Arena::create().unwrap();
    let mrs = MrTable::new(3);
    let rw = mrs
        .register_in(
            1,
            10000,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            Some(&a),
        )
        .unwrap();
    let ro = mrs
        .register_in(1, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ, Some(&a))
        .unwrap();
    let p = peer_of(&a);
    let off = p
        .lookup(rw.key(), rw.addr() + 100, 9900, Access::REMOTE_WRITE)
        .unwrap();
    // The offset found is where the region's memory is: a byte written there shows up.
    unsafe { p.seg.copy_in_raw(off, [7u8].as_ptr(), 1) };
    let mut b = [0u8; 1];
    rw.read(100, &mut b);
    assert_eq!(b, [7]);
    assert_eq!(
        p.lookup(rw.key(), rw.addr() + 100, 9901, Access::REMOTE_WRITE),
        Err(AccessError::OutOfBounds {
            addr: rw.addr() + 100,
            len: 9901
        })
    );
    assert!(matches!(
        p.lookup(rw.key(), rw.addr() - 1, 1, Access::REMOTE_WRITE),
        Err(AccessError::OutOfBounds { .. })
    ));
    assert_eq!(
        p.lookup(rw.key() ^ 1, rw.addr(), 1, Access::REMOTE_WRITE),
        Err(AccessError::BadKey(rw.key() ^ 1))
    );
    assert_eq!(
        p.lookup(ro.key(), ro.addr(), 1, Access::REMOTE_WRITE),
        Err(AccessError::NotPermitted {
            need: Access::REMOTE_WRITE
        })
    );
    assert!(
        p.lookup(ro.key(), ro.addr(), 4096, Access::REMOTE_READ)
            .is_ok()
    );
    // Deregistered: gone from the table, and its pages come back zeroed for the next one.
    let key = rw.key();
    assert!(mrs.deregister(key));
    drop(rw);
    assert_eq!(
        p.lookup(
            key,
            0x1000_0000 | u64::from(key) << 32,
            1,
            Access::REMOTE_WRITE
        ),
        Err(AccessError::BadKey(key))
    );
    let again = mrs
        .register_in(1, 8192, Access::REMOTE_WRITE, Some(&a))
        .unwrap();
    let mut z = [1u8; 200];
    again.read(0, &mut z);
    assert!(z.iter().all(|&x| x == 0), "reused memory is zeroed");
}

#[test]
fn a_garbage_table_gives_errors_never_a_wild_access() {
    let a = Arena::create().unwrap();
    let p = peer_of(&a);
    // The peer scribbles over its own table: every lookup must stay inside the mapping.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for d in 0..PROBES * 4 {
        for w in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = if w == 0 { x | D_VALID } else { x };
            a.seg
                .u64_at(TABLE_AT + d * DESC + w * 8)
                .store(v, Ordering::Relaxed);
        }
    }
    for i in 0..PROBES * 4 {
        let w = a.seg.u64_at(TABLE_AT + i * DESC).load(Ordering::Relaxed);
        let key = w as u32;
        let iova = a
            .seg
            .u64_at(TABLE_AT + i * DESC + 24)
            .load(Ordering::Relaxed);
        for need in [Access::REMOTE_WRITE, Access::REMOTE_READ] {
            if let Ok(off) = p.lookup(key, iova, 64, need) {
                assert!(off >= DATA_AT && off + 64 <= ARENA_BYTES, "{off:#x}");
            }
        }
    }
}

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
    let offer = Offer {
        to_qpn: 1,
        from_qpn: 2,
        from: "127.0.0.1:1".parse().unwrap(),
    };
    let with_bell = |bell: OwnedFd| {
        let fds = vec![
            arena.try_clone_to_owned().unwrap(),
            ring.try_clone_to_owned().unwrap(),
            bell,
            rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap(),
        ];
        PeerTx::new(&offer, fds, arena.try_clone_to_owned().unwrap())
    };
    let (_r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::NONBLOCK).unwrap();
    assert!(with_bell(w).is_err());
    // The same with an eventfd is accepted.
    let ev = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
    assert!(with_bell(ev).is_ok());
}
