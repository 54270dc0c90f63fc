//! Two RC queue pairs joined by an in-memory lossy link with a virtual clock (quinn's `Pair`
//! idea): no sockets, no sleeping.

use super::*;
use crate::mr::{Access, MrTable, Region};
use crate::wire::{Opcode, PacketRepr, Psn};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}

#[derive(Default, Clone, Copy)]
struct Faults {
    drop: f64,
    dup: f64,
    reorder: f64,
    /// Share of packets held back for a random time up to `hold_max` (as the engine's fault
    /// injector does), in virtual time.
    hold: f64,
    hold_max: Duration,
}

struct Host {
    qp: RcQp,
    mrs: MrTable,
    sent: Vec<Vec<u8>>,
    completions: Vec<(CqSide, WorkCompletion)>,
}

struct Pair {
    a: Host,
    b: Host,
    now: Instant,
    rng: Rng,
    faults: Faults,
    /// When set, everything sent by the side is dropped.
    blackhole_a: bool,
    blackhole_b: bool,
    delivered: usize,
    /// Packets held back: when they arrive, from which side, the bytes.
    held: Vec<(Instant, bool, Vec<u8>)>,
    /// Packets each side may send per 10 µs step (the link's bandwidth; 0: unlimited).
    per_step: usize,
}

const PD: u32 = 1;

fn host(qpn: u32, caps: QpCaps) -> Host {
    Host {
        qp: RcQp::new(qpn, PD, caps, false),
        mrs: MrTable::new(qpn),
        sent: vec![],
        completions: vec![],
    }
}

impl Pair {
    fn new(mtu: Mtu, a_psn: u32, b_psn: u32) -> Self {
        Self::with(
            mtu,
            a_psn,
            b_psn,
            QpCaps::default(),
            QpAttr::state(QpState::Rts),
        )
    }

    fn with(mtu: Mtu, a_psn: u32, b_psn: u32, caps: QpCaps, rts: QpAttr) -> Self {
        let mut p = Self {
            a: host(0x11, caps),
            b: host(0x12, caps),
            now: Instant::now(),
            rng: Rng(42),
            faults: Faults::default(),
            blackhole_a: false,
            blackhole_b: false,
            delivered: 0,
            held: Vec::new(),
            per_step: 0,
        };
        for (me, peer, my_psn, peer_psn) in [
            (&mut p.a, 0x12, a_psn, b_psn),
            (&mut p.b, 0x11, b_psn, a_psn),
        ] {
            me.qp.modify(&QpAttr::state(QpState::Init)).unwrap();
            me.qp
                .modify(&QpAttr {
                    path_mtu: Some(mtu),
                    dest_qp_num: Some(peer),
                    rq_psn: Some(Psn::new(peer_psn)),
                    min_rnr_timer: Some(1),
                    ..QpAttr::state(QpState::Rtr)
                })
                .unwrap();
            me.qp
                .modify(&QpAttr {
                    sq_psn: Some(Psn::new(my_psn)),
                    timeout: Some(rts.timeout.unwrap_or(12)),
                    ..rts
                })
                .unwrap();
        }
        p
    }

    fn mr(h: &Host, len: usize) -> Arc<Region> {
        h.mrs
            .register(
                PD,
                len,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap()
    }

    /// Moves packets until both sides are quiet and no timer is pending (or `limit` steps).
    fn run(&mut self, limit: usize) {
        let mut buf = vec![0u8; 8192];
        let mut wire: VecDeque<(bool, Vec<u8>)> = VecDeque::new();
        for _ in 0..limit {
            let mut progressed = false;
            for from_a in [true, false] {
                let h = if from_a { &mut self.a } else { &mut self.b };
                let mut budget = if self.per_step == 0 {
                    usize::MAX
                } else {
                    self.per_step
                };
                while budget > 0
                    && let Some(n) = h.qp.poll_transmit(self.now, &mut buf)
                {
                    budget -= 1;
                    progressed = true;
                    h.sent.push(buf[..n].to_vec());
                    let black = if from_a {
                        self.blackhole_a
                    } else {
                        self.blackhole_b
                    };
                    if black || self.rng.chance(self.faults.drop) {
                        continue;
                    }
                    if self.rng.chance(self.faults.dup) {
                        wire.push_back((from_a, buf[..n].to_vec()));
                    }
                    if self.rng.chance(self.faults.hold) {
                        let max = self.faults.hold_max.as_nanos() as u64;
                        let d = Duration::from_nanos(self.rng.next() % max.max(1));
                        self.held.push((self.now + d, from_a, buf[..n].to_vec()));
                        continue;
                    }
                    if self.rng.chance(self.faults.reorder) && !wire.is_empty() {
                        let at = (self.rng.next() as usize) % wire.len();
                        wire.insert(at, (from_a, buf[..n].to_vec()));
                    } else {
                        wire.push_back((from_a, buf[..n].to_vec()));
                    }
                }
            }
            let now = self.now;
            for (_, from_a, bytes) in self.held.extract_if(.., |(t, _, _)| *t <= now) {
                wire.push_back((from_a, bytes));
            }
            while let Some((from_a, bytes)) = wire.pop_front() {
                progressed = true;
                self.delivered += 1;
                let to = if from_a { &mut self.b } else { &mut self.a };
                let pkt = PacketRepr::parse_bytes(&bytes).expect("engine emits valid packets");
                to.qp.handle_packet(self.now, &pkt, &to.mrs);
            }
            for h in [&mut self.a, &mut self.b] {
                while let Some(c) = h.qp.poll_completion() {
                    h.completions.push(c);
                }
            }
            if !progressed {
                let held = self.held.iter().map(|h| h.0).min();
                let next = [self.a.qp.poll_timeout(), self.b.qp.poll_timeout(), held]
                    .into_iter()
                    .flatten()
                    .min();
                match next {
                    Some(t) => {
                        self.now = self.now.max(t);
                        self.a.qp.handle_timeout(self.now);
                        self.b.qp.handle_timeout(self.now);
                    }
                    None => return,
                }
            } else {
                self.now += Duration::from_micros(10);
                // Timers run when due, as the engine runs them, not only when all is quiet.
                for h in [&mut self.a, &mut self.b] {
                    if h.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                        h.qp.handle_timeout(self.now);
                    }
                }
            }
        }
        panic!("did not settle in {limit} steps");
    }
}

fn sge(mr: &Region, off: usize, len: usize) -> Sge {
    Sge {
        addr: mr.addr() + off as u64,
        length: len as u32,
        lkey: mr.key(),
    }
}

/// Posts an RDMA WRITE of the first `len` bytes of `src` to the start of `dst` on `h`'s QP.
fn post_write(
    h: &mut Host,
    wr_id: u64,
    (src, dst, len): (&Region, &Region, usize),
    flags: SendFlags,
) {
    h.qp.post_send(
        &SendWr {
            wr_id,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: dst.addr(),
                rkey: dst.key(),
            },
            sg_list: &[sge(src, 0, len)],
            flags,
        },
        &h.mrs,
    )
    .unwrap();
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn contents(mr: &Region, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    mr.read(off, &mut v);
    v
}

#[test]
fn send_small_message() {
    let mut p = Pair::new(Mtu::Mtu1024, 100, 200);
    let src = Pair::mr(&p.a, 64);
    let dst = Pair::mr(&p.b, 64);
    src.write(0, b"hello, world");
    p.b.qp
        .post_recv(
            &RecvWr {
                wr_id: 7,
                sg_list: &[sge(&dst, 0, 64)],
            },
            &p.b.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, 0, 12)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(100);
    assert_eq!(contents(&dst, 0, 12), b"hello, world");
    assert_eq!(
        p.b.completions,
        vec![(
            CqSide::Recv,
            WorkCompletion {
                wr_id: 7,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len: 12,
                imm_data: None,
                qp_num: 0x12
            }
        )]
    );
    assert_eq!(p.a.completions.len(), 1);
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
    // One SEND_ONLY with AckReq, one ACK back.
    assert_eq!(p.a.sent.len(), 1);
    assert_eq!(p.a.sent[0][0], Opcode::SEND_ONLY.0);
    assert_eq!(p.b.sent.len(), 1);
    assert_eq!(p.b.sent[0][0], Opcode::ACKNOWLEDGE.0);
}

#[test]
fn multi_packet_write_segments_at_the_mtu_and_psns_wrap() {
    let mut p = Pair::new(Mtu::Mtu256, 0xFF_FFFE, 5);
    let len = 256 * 5 + 17;
    let src = Pair::mr(&p.a, len);
    let dst = Pair::mr(&p.b, 4096);
    let data = pattern(3, len);
    src.write(0, &data);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 9,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: dst.addr() + 100,
                    rkey: dst.key(),
                },
                sg_list: &[sge(&src, 0, len)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(100);
    assert_eq!(contents(&dst, 100, len), data);
    assert_eq!(
        contents(&dst, 0, 100),
        vec![0; 100],
        "nothing before the target range"
    );
    assert_eq!(
        contents(&dst, 100 + len, 50),
        vec![0; 50],
        "nothing after it"
    );
    let ops: Vec<u8> = p.a.sent.iter().map(|s| s[0]).collect();
    assert_eq!(ops, [6, 7, 7, 7, 7, 8]);
    let psns: Vec<u32> =
        p.a.sent
            .iter()
            .map(|s| crate::wire::Packet::new_unchecked(&s[..]).psn().value())
            .collect();
    assert_eq!(psns, [0xFF_FFFE, 0xFF_FFFF, 0, 1, 2, 3]);
    assert_eq!(p.a.completions.len(), 1);
    assert!(
        p.b.completions.is_empty(),
        "a plain WRITE consumes no receive"
    );
}

#[test]
fn sges_gather_and_scatter_across_regions() {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let s1 = Pair::mr(&p.a, 300);
    let s2 = Pair::mr(&p.a, 300);
    s1.write(0, &pattern(1, 300));
    s2.write(0, &pattern(2, 300));
    let d1 = Pair::mr(&p.b, 100);
    let d2 = Pair::mr(&p.b, 1000);
    p.b.qp
        .post_recv(
            &RecvWr {
                wr_id: 1,
                sg_list: &[sge(&d1, 0, 100), sge(&d2, 0, 1000)],
            },
            &p.b.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 2,
                opcode: WrOpcode::SendWithImm(0xabcd),
                sg_list: &[sge(&s1, 50, 250), sge(&s2, 0, 300)],
                flags: SendFlags::empty(),
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(100);
    let mut expect = pattern(1, 300)[50..].to_vec();
    expect.extend(pattern(2, 300));
    let mut got = contents(&d1, 0, 100);
    got.extend(contents(&d2, 0, 450));
    assert_eq!(got, expect);
    assert_eq!(p.b.completions[0].1.imm_data, Some(0xabcd));
    assert_eq!(p.b.completions[0].1.byte_len, 550);
    assert!(p.a.completions.is_empty(), "unsignaled send: no completion");
    assert_eq!(p.a.qp.send_queue_len(), 0, "but it was retired");
}

#[test]
fn rdma_read_multi_packet() {
    let mut p = Pair::new(Mtu::Mtu512, 10, 20);
    let remote = Pair::mr(&p.b, 5000);
    let data = pattern(9, 5000);
    remote.write(0, &data);
    let local = Pair::mr(&p.a, 5000);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 3,
                opcode: WrOpcode::RdmaRead {
                    remote_addr: remote.addr(),
                    rkey: remote.key(),
                },
                sg_list: &[sge(&local, 0, 5000)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(100);
    assert_eq!(contents(&local, 0, 5000), data);
    assert_eq!(p.a.completions[0].1.opcode, WcOpcode::RdmaRead);
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
}

#[test]
fn lossy_link_delivers_everything_in_order() {
    for seed in 0..4 {
        let mut p = Pair::new(Mtu::Mtu256, 0xFF_FF00, 0x7F_FFF0);
        p.rng = Rng(seed);
        p.faults = Faults {
            drop: 0.1,
            dup: 0.05,
            reorder: 0.1,
            ..Faults::default()
        };
        let n = 40;
        let len = 1000;
        let src = Pair::mr(&p.a, n * len);
        let dst = Pair::mr(&p.b, n * len);
        let recv = Pair::mr(&p.b, n * 64);
        let data = pattern(seed as u8, n * len);
        src.write(0, &data);
        for i in 0..n {
            p.b.qp
                .post_recv(
                    &RecvWr {
                        wr_id: 1000 + i as u64,
                        sg_list: &[sge(&recv, i * 64, 64)],
                    },
                    &p.b.mrs,
                )
                .unwrap();
        }
        for i in 0..n {
            let w = SendWr {
                wr_id: i as u64,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: dst.addr() + (i * len) as u64,
                    rkey: dst.key(),
                },
                sg_list: &[sge(&src, i * len, len)],
                flags: if i % 3 == 0 {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::empty()
                },
            };
            p.a.qp.post_send(&w, &p.a.mrs).unwrap();
            // A SEND after each WRITE, as SMC-R's CDC follows its data.
            let s = SendWr {
                wr_id: 5000 + i as u64,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, i * len, 8)],
                flags: SendFlags::SIGNALED,
            };
            p.a.qp.post_send(&s, &p.a.mrs).unwrap();
        }
        p.run(100_000);
        assert_eq!(contents(&dst, 0, n * len), data, "seed {seed}");
        let send_ids: Vec<u64> = p.a.completions.iter().map(|c| c.1.wr_id).collect();
        let mut expect = vec![];
        for i in 0..n as u64 {
            if i % 3 == 0 {
                expect.push(i);
            }
            expect.push(5000 + i);
        }
        assert_eq!(send_ids, expect, "completions in posting order");
        assert!(
            p.a.completions
                .iter()
                .all(|c| c.1.status == WcStatus::Success)
        );
        let recv_ids: Vec<u64> = p.b.completions.iter().map(|c| c.1.wr_id).collect();
        assert_eq!(
            recv_ids,
            (1000..1000 + n as u64).collect::<Vec<_>>(),
            "each SEND delivered once"
        );
        for i in 0..n {
            assert_eq!(contents(&recv, i * 64, 8), data[i * len..i * len + 8]);
        }
        let st = p.b.qp.responder_stats();
        eprintln!("seed {seed}: delivered {} packets, {st:?}", p.delivered);
        assert!(st.nak_seq > 0 && st.duplicates > 0);
    }
}

#[test]
fn lost_acks_are_recovered_by_timeout_and_duplicates_reacked() {
    let mut p = Pair::new(Mtu::Mtu1024, 1, 1);
    let src = Pair::mr(&p.a, 100);
    let dst = Pair::mr(&p.b, 100);
    p.blackhole_b = true; // every ACK is lost
    post_write(&mut p.a, 1, (&src, &dst, 100), SendFlags::SIGNALED);
    let start = p.now;
    // Let two retransmissions happen, then heal the link.
    let mut buf = vec![0u8; 2048];
    while p.a.sent.len() < 3 {
        if let Some(n) = p.a.qp.poll_transmit(p.now, &mut buf) {
            p.a.sent.push(buf[..n].to_vec());
            let pkt = PacketRepr::parse_bytes(&buf[..n]).unwrap();
            p.b.qp.handle_packet(p.now, &pkt, &p.b.mrs);
            while p.b.qp.poll_transmit(p.now, &mut buf).is_some() {}
        } else {
            p.now = p.a.qp.poll_timeout().unwrap();
            p.a.qp.handle_timeout(p.now);
        }
    }
    assert_eq!(p.b.qp.responder_stats().duplicates, 2);
    // Backoff: the second retransmission waited twice as long as the first.
    assert!(p.now - start >= timeout_duration(12).unwrap() * 3);
    let waited = p.now - start;
    p.blackhole_b = false;
    p.run(100);
    assert_eq!(p.a.completions.len(), 1);
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
    // The timers' wait is the stall the requester reports.
    let stall = Duration::from_micros(p.a.qp.requester_stats().longest_stall_us);
    assert!(stall >= waited, "{stall:?} < {waited:?}");
}

#[test]
fn on_a_clean_link_the_longest_stall_is_a_round_trip() {
    let mut p = Pair::new(Mtu::Mtu1024, 1, 1);
    let src = Pair::mr(&p.a, 64 << 10);
    let dst = Pair::mr(&p.b, 64 << 10);
    for i in 0..4 {
        post_write(&mut p.a, i, (&src, &dst, 64 << 10), SendFlags::SIGNALED);
    }
    p.run(10_000);
    assert_eq!(p.a.completions.len(), 4);
    // Each step of `run` is 10 µs: an ACK comes a step or two after its request.
    let stall = p.a.qp.requester_stats().longest_stall_us;
    assert!((1..=100).contains(&stall), "{stall} µs");
}

#[test]
fn retry_exhaustion_fails_with_retry_exc_err_and_flushes() {
    let rts = QpAttr {
        retry_cnt: Some(3),
        ..QpAttr::state(QpState::Rts)
    };
    let mut p = Pair::with(Mtu::Mtu1024, 1, 1, QpCaps::default(), rts);
    let src = Pair::mr(&p.a, 100);
    p.blackhole_a = true;
    for id in 1..=3 {
        p.a.qp
            .post_send(
                &SendWr {
                    wr_id: id,
                    opcode: WrOpcode::Send,
                    sg_list: &[sge(&src, 0, 10)],
                    flags: SendFlags::SIGNALED,
                },
                &p.a.mrs,
            )
            .unwrap();
    }
    p.run(1000);
    let st: Vec<(u64, WcStatus)> =
        p.a.completions
            .iter()
            .map(|c| (c.1.wr_id, c.1.status))
            .collect();
    assert_eq!(
        st,
        [
            (1, WcStatus::RetryExcErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(p.a.qp.state(), QpState::Error);
    // 3 packets, then 3 retransmission rounds of all 3.
    assert_eq!(p.a.sent.len(), 3 * 4);
    // Posting in the error state completes at once with a flush error.
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 4,
                opcode: WrOpcode::Send,
                sg_list: &[],
                flags: SendFlags::empty(),
            },
            &p.a.mrs,
        )
        .unwrap();
    assert_eq!(
        p.a.qp.poll_completion().unwrap().1.status,
        WcStatus::WrFlushErr
    );
}

#[test]
fn rnr_nak_then_recv_posted_completes() {
    let mut p = Pair::new(Mtu::Mtu1024, 1, 1);
    let src = Pair::mr(&p.a, 100);
    let dst = Pair::mr(&p.b, 100);
    src.write(0, b"late");
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, 0, 4)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    let mut buf = vec![0u8; 2048];
    let n = p.a.qp.poll_transmit(p.now, &mut buf).unwrap();
    p.b.qp.handle_packet(
        p.now,
        &PacketRepr::parse_bytes(&buf[..n]).unwrap(),
        &p.b.mrs,
    );
    let n = p.b.qp.poll_transmit(p.now, &mut buf).unwrap();
    let nak = PacketRepr::parse_bytes(&buf[..n]).unwrap();
    assert_eq!(
        nak.aeth.unwrap().syndrome,
        crate::wire::Syndrome::RnrNak { timer: 1 }
    );
    p.a.qp.handle_packet(p.now, &nak, &p.a.mrs);
    assert!(
        p.a.qp.poll_transmit(p.now, &mut buf).is_none(),
        "waits out the RNR timer"
    );
    assert_eq!(p.b.qp.responder_stats().rnr_nak, 1);
    p.b.qp
        .post_recv(
            &RecvWr {
                wr_id: 2,
                sg_list: &[sge(&dst, 0, 100)],
            },
            &p.b.mrs,
        )
        .unwrap();
    p.run(100);
    assert_eq!(contents(&dst, 0, 4), b"late");
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
}

#[test]
fn rnr_retry_exhaustion() {
    let rts = QpAttr {
        rnr_retry: Some(2),
        ..QpAttr::state(QpState::Rts)
    };
    let mut p = Pair::with(Mtu::Mtu1024, 1, 1, QpCaps::default(), rts);
    let src = Pair::mr(&p.a, 100);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, 0, 4)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(1000);
    assert_eq!(p.a.completions[0].1.status, WcStatus::RnrRetryExcErr);
    assert_eq!(p.b.qp.responder_stats().rnr_nak, 3);
    assert_eq!(p.a.qp.state(), QpState::Error);
}

fn write_expecting_access_error(
    remote_addr: impl Fn(&Region) -> u64,
    rkey: impl Fn(&Region) -> u32,
    access: Access,
) {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let src = Pair::mr(&p.a, 1000);
    src.write(0, &[0xEE; 1000]);
    let victim = p.b.mrs.register(PD, 4096, Access::LOCAL_WRITE).unwrap();
    let target = p.b.mrs.register(PD, 512, access).unwrap();
    p.b.qp
        .post_recv(
            &RecvWr {
                wr_id: 5,
                sg_list: &[sge(&victim, 0, 64)],
            },
            &p.b.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: remote_addr(&target),
                    rkey: rkey(&target),
                },
                sg_list: &[sge(&src, 0, 1000)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 2,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, 0, 4)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    p.run(1000);
    let st: Vec<(u64, WcStatus)> =
        p.a.completions
            .iter()
            .map(|c| (c.1.wr_id, c.1.status))
            .collect();
    assert_eq!(st, [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]);
    assert_eq!(contents(&target, 0, 512), vec![0; 512], "target untouched");
    assert_eq!(
        contents(&victim, 0, 4096),
        vec![0; 4096],
        "neighbour untouched"
    );
    assert_eq!(p.b.qp.state(), QpState::Error);
    assert_eq!(
        p.b.completions,
        vec![(
            CqSide::Recv,
            WorkCompletion {
                wr_id: 5,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm_data: None,
                qp_num: 0x12
            }
        )]
    );
    assert_eq!(p.b.qp.responder_stats().access_errors, 1);
    // The NAK was the remote-access-error syndrome.
    let nak =
        p.b.sent
            .iter()
            .map(|s| PacketRepr::parse_bytes(s).unwrap())
            .find(|r| {
                r.aeth
                    .is_some_and(|a| a.syndrome != crate::wire::Syndrome::ACK)
            })
            .unwrap();
    assert_eq!(
        nak.aeth.unwrap().syndrome,
        crate::wire::Syndrome::Nak(crate::wire::NakCode::RemoteAccessError)
    );
}

#[test]
fn wrong_rkey_write_is_refused() {
    write_expecting_access_error(|m| m.addr(), |m| m.key() ^ 0x80, Access::REMOTE_WRITE);
}

#[test]
fn out_of_bounds_write_is_refused() {
    // 1000 bytes at offset 0 of a 512-byte region: the first packet would fit, the message not.
    write_expecting_access_error(|m| m.addr(), |m| m.key(), Access::REMOTE_WRITE);
}

#[test]
fn write_before_region_start_is_refused() {
    write_expecting_access_error(|m| m.addr() - 256, |m| m.key(), Access::REMOTE_WRITE);
}

#[test]
fn write_without_remote_write_right_is_refused() {
    write_expecting_access_error(
        |m| m.addr(),
        |m| m.key(),
        Access::LOCAL_WRITE | Access::REMOTE_READ,
    );
}

#[test]
fn duplicate_read_is_reexecuted() {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let remote = Pair::mr(&p.b, 600);
    remote.write(0, &pattern(4, 600));
    let local = Pair::mr(&p.a, 600);
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::RdmaRead {
                    remote_addr: remote.addr(),
                    rkey: remote.key(),
                },
                sg_list: &[sge(&local, 0, 600)],
                flags: SendFlags::SIGNALED,
            },
            &p.a.mrs,
        )
        .unwrap();
    // Deliver the request twice; lose the first set of responses.
    let mut buf = vec![0u8; 2048];
    let n = p.a.qp.poll_transmit(p.now, &mut buf).unwrap();
    let req = buf[..n].to_vec();
    p.b.qp
        .handle_packet(p.now, &PacketRepr::parse_bytes(&req).unwrap(), &p.b.mrs);
    let mut first = 0;
    while p.b.qp.poll_transmit(p.now, &mut buf).is_some() {
        first += 1;
    }
    assert_eq!(first, 3);
    p.b.qp
        .handle_packet(p.now, &PacketRepr::parse_bytes(&req).unwrap(), &p.b.mrs);
    assert_eq!(p.b.qp.responder_stats().duplicates, 1);
    p.run(100);
    assert_eq!(contents(&local, 0, 600), pattern(4, 600));
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
}

/// A WRITE of six packets from `a` to `b` (MTU 256); returns its packets (PSN 1–6) and the
/// destination region.
fn six_packet_write(p: &mut Pair) -> (Vec<Vec<u8>>, Arc<Region>) {
    let src = Pair::mr(&p.a, 256 * 6);
    src.write(0, &pattern(9, 256 * 6));
    let dst = Pair::mr(&p.b, 256 * 6);
    post_write(&mut p.a, 1, (&src, &dst, 256 * 6), SendFlags::SIGNALED);
    let mut buf = vec![0u8; 2048];
    let mut pkts = vec![];
    while let Some(n) = p.a.qp.poll_transmit(p.now, &mut buf) {
        pkts.push(buf[..n].to_vec());
    }
    assert_eq!(pkts.len(), 6);
    (pkts, dst)
}

fn deliver(to: &mut Host, now: Instant, pkt: &[u8]) {
    to.qp
        .handle_packet(now, &PacketRepr::parse_bytes(pkt).unwrap(), &to.mrs);
}

/// What `h` sends now: (PSN, AETH) of each packet.
fn drain_tx(h: &mut Host, now: Instant) -> Vec<(u32, Option<crate::wire::Aeth>)> {
    let mut buf = vec![0u8; 2048];
    let mut out = vec![];
    while let Some(n) = h.qp.poll_transmit(now, &mut buf) {
        let r = PacketRepr::parse_bytes(&buf[..n]).unwrap();
        h.sent.push(buf[..n].to_vec());
        out.push((r.bth.psn.value(), r.aeth));
    }
    out
}

fn nak_seq() -> crate::wire::Syndrome {
    crate::wire::Syndrome::Nak(crate::wire::NakCode::PsnSequenceError)
}

/// A packet overtaken by later ones within the reorder allowance costs nothing: the later
/// ones are kept, placed when it comes, and acknowledged at once; no NAK, nothing resent.
#[test]
fn a_packet_overtaken_within_the_allowance_is_placed_without_a_nak() {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let (pkts, dst) = six_packet_write(&mut p);
    for i in [0, 1, 3, 4, 5] {
        deliver(&mut p.b, p.now, &pkts[i]);
    }
    assert!(drain_tx(&mut p.b, p.now).is_empty(), "no NAK yet");
    let due = p.b.qp.poll_timeout().expect("the gap's NAK is timed");
    assert!(due > p.now);
    p.now += responder::DEFAULT_ALLOWANCE / 2;
    p.b.qp.handle_timeout(p.now);
    deliver(&mut p.b, p.now, &pkts[2]);
    let out = drain_tx(&mut p.b, p.now);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, 6, "everything acknowledged at once");
    assert!(matches!(
        out[0].1.unwrap().syndrome,
        crate::wire::Syndrome::Ack { .. }
    ));
    assert_eq!(contents(&dst, 0, 256 * 6), pattern(9, 256 * 6));
    let st = p.b.qp.responder_stats();
    assert_eq!((st.nak_seq, st.reordered), (0, 3));
    assert_eq!(p.b.qp.poll_timeout(), None, "no gap left");
    let ack = p.b.sent.last().unwrap().clone();
    deliver(&mut p.a, p.now, &ack);
    p.run(100);
    assert_eq!(p.a.completions.len(), 1);
    assert_eq!(p.a.qp.requester_stats().retransmits, 0);
}

/// A gap that outlives the allowance is NAKed once; our requester resends only the missing
/// packet, which completes the message (the rest was kept), and sends nothing again.
#[test]
fn a_lost_packet_is_naked_after_the_allowance_and_only_it_is_resent() {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let (pkts, dst) = six_packet_write(&mut p);
    for (i, pk) in pkts.iter().enumerate() {
        if i != 2 {
            deliver(&mut p.b, p.now, pk);
        }
    }
    let due = p.b.qp.poll_timeout().unwrap();
    p.now = due;
    p.b.qp.handle_timeout(p.now);
    let out = drain_tx(&mut p.b, p.now);
    assert_eq!(out.len(), 1, "one NAK");
    assert_eq!((out[0].0, out[0].1.unwrap().syndrome), (3, nak_seq()));
    let nak = p.b.sent.last().unwrap().clone();
    deliver(&mut p.a, p.now, &nak);
    let resent = drain_tx(&mut p.a, p.now);
    assert_eq!(resent.iter().map(|r| r.0).collect::<Vec<_>>(), [3]);
    let again = p.a.sent.last().unwrap().clone();
    assert!(PacketRepr::parse_bytes(&again).unwrap().bth.ack_req);
    deliver(&mut p.b, p.now, &again);
    let ack = drain_tx(&mut p.b, p.now);
    assert_eq!(ack.iter().map(|r| r.0).collect::<Vec<_>>(), [6]);
    let ack = p.b.sent.last().unwrap().clone();
    deliver(&mut p.a, p.now, &ack);
    assert!(drain_tx(&mut p.a, p.now).is_empty(), "nothing else resent");
    assert_eq!(contents(&dst, 0, 256 * 6), pattern(9, 256 * 6));
    assert_eq!(p.a.qp.requester_stats().retransmits, 1);
    assert_eq!(p.b.qp.responder_stats().nak_seq, 1);
    while let Some(c) = p.a.qp.poll_completion() {
        p.a.completions.push(c);
    }
    assert_eq!(p.a.completions.len(), 1);
    assert_eq!(p.a.completions[0].1.status, WcStatus::Success);
}

/// Against a go-back-N responder (Linux rxe, RNICs: what follows a gap is dropped), the
/// acknowledgement of the resent packet says only that one arrived: the rest follows then.
#[test]
fn after_a_nak_a_go_back_n_peer_gets_the_rest_once_the_first_is_acknowledged() {
    let mut p = Pair::new(Mtu::Mtu256, 1, 1);
    let (pkts, _dst) = six_packet_write(&mut p);
    let ack = |psn: u32, syndrome| PacketRepr {
        bth: crate::wire::BthRepr::new(Opcode::ACKNOWLEDGE, 0x11, Psn::new(psn)),
        aeth: Some(crate::wire::Aeth { syndrome, msn: 0 }),
        ..PacketRepr::parse_bytes(&pkts[0]).unwrap()
    };
    p.a.qp.handle_packet(p.now, &ack(3, nak_seq()), &p.a.mrs);
    let r: Vec<u32> = drain_tx(&mut p.a, p.now).iter().map(|r| r.0).collect();
    assert_eq!(r, [3], "the missing packet first");
    p.now += Duration::from_micros(30);
    p.a.qp
        .handle_packet(p.now, &ack(3, crate::wire::Syndrome::ACK), &p.a.mrs);
    let r: Vec<u32> = drain_tx(&mut p.a, p.now).iter().map(|r| r.0).collect();
    assert_eq!(r, [4, 5, 6], "then the rest, as go-back-N");
}

/// Ahead of a gap only a bounded amount is kept: past the byte budget the gap is NAKed at
/// once and later packets are dropped (plain go-back-N), and the transfer still completes.
#[test]
fn what_is_kept_ahead_of_a_gap_is_bounded() {
    let mut p = Pair::new(Mtu::Mtu4096, 1, 1);
    let n = responder::REORDER_BYTES / 4096 + 8;
    let len = 4096 * n;
    let src = Pair::mr(&p.a, len);
    src.write(0, &pattern(3, len));
    let dst = Pair::mr(&p.b, len);
    // A first transfer opens the congestion window wide enough for all of the second.
    for wr_id in [7, 8] {
        post_write(&mut p.a, wr_id, (&src, &dst, len), SendFlags::empty());
        p.run(100_000);
    }
    dst.write(0, &vec![0; len]);
    post_write(&mut p.a, 1, (&src, &dst, len), SendFlags::SIGNALED);
    let mut buf = vec![0u8; 8192];
    let mut pkts = vec![];
    while let Some(n) = p.a.qp.poll_transmit(p.now, &mut buf) {
        pkts.push(buf[..n].to_vec());
    }
    // The window may hold back part of the message: what went, minus its first packet.
    assert!(
        pkts.len() > responder::REORDER_BYTES / 4096,
        "{}",
        pkts.len()
    );
    for pk in &pkts[1..] {
        deliver(&mut p.b, p.now, pk);
    }
    let st = p.b.qp.responder_stats();
    assert_eq!(st.reordered as usize, responder::REORDER_BYTES / 4096);
    assert!(st.nak_seq >= 1, "NAKed once the budget was spent");
    p.run(100_000);
    assert_eq!(contents(&dst, 0, len), pattern(3, len));
    assert_eq!(p.a.completions.len(), 1);
}

#[test]
fn state_machine_rules() {
    let mut qp = RcQp::new(5, PD, QpCaps::default(), false);
    let mrs = MrTable::new(1);
    assert_eq!(
        qp.modify(&QpAttr::state(QpState::Rts)),
        Err(ModifyError::InvalidTransition {
            from: QpState::Reset,
            to: QpState::Rts
        })
    );
    assert_eq!(
        qp.post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::Send,
                sg_list: &[],
                flags: SendFlags::empty()
            },
            &mrs
        ),
        Err(PostError::InvalidState(QpState::Reset))
    );
    qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    assert_eq!(
        qp.modify(&QpAttr::state(QpState::Rtr)),
        Err(ModifyError::MissingAttr("path_mtu"))
    );
    let m = mrs.register(PD, 10, Access::empty()).unwrap();
    assert!(matches!(
        qp.post_recv(
            &RecvWr {
                wr_id: 1,
                sg_list: &[sge(&m, 0, 10)]
            },
            &mrs
        ),
        Err(PostError::BadSge {
            index: 0,
            error: crate::AccessError::NotPermitted { .. }
        })
    ));
    let other_pd = mrs.register(PD + 1, 10, Access::LOCAL_WRITE).unwrap();
    assert!(matches!(
        qp.post_recv(
            &RecvWr {
                wr_id: 1,
                sg_list: &[sge(&other_pd, 0, 10)]
            },
            &mrs
        ),
        Err(PostError::BadSge {
            error: crate::AccessError::WrongPd,
            ..
        })
    ));
    let ok = mrs.register(PD, 10, Access::LOCAL_WRITE).unwrap();
    qp.post_recv(
        &RecvWr {
            wr_id: 9,
            sg_list: &[sge(&ok, 0, 10)],
        },
        &mrs,
    )
    .unwrap();
    qp.modify(&QpAttr::state(QpState::Error)).unwrap();
    assert_eq!(qp.poll_completion().unwrap().1.status, WcStatus::WrFlushErr);
    qp.modify(&QpAttr::state(QpState::Reset)).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
}

/// Arbitrary (well-formed) packets thrown at a connected QP: no panic, no access outside the
/// registered regions, and the QP either keeps working or fails cleanly.
#[test]
fn arbitrary_packets_into_a_live_qp() {
    use crate::wire::{Aeth, AtomicEth, BthRepr, NakCode, Reth, Syndrome};
    let mut rng = Rng(99);
    for round in 0..200 {
        let mut p = Pair::new(Mtu::Mtu256, 100, 200);
        let rmb = Pair::mr(&p.b, 1024);
        let src = Pair::mr(&p.b, 1024);
        let rbuf = Pair::mr(&p.b, 300);
        for i in 0..4 {
            p.b.qp
                .post_recv(
                    &RecvWr {
                        wr_id: i,
                        sg_list: &[sge(&rbuf, 0, 300)],
                    },
                    &p.b.mrs,
                )
                .unwrap();
        }
        p.b.qp
            .post_send(
                &SendWr {
                    wr_id: 1,
                    opcode: WrOpcode::Send,
                    sg_list: &[sge(&src, 0, 600)],
                    flags: SendFlags::SIGNALED,
                },
                &p.b.mrs,
            )
            .unwrap();
        let mut buf = vec![0u8; 2048];
        while p.b.qp.poll_transmit(p.now, &mut buf).is_some() {}
        let payload = vec![0xCCu8; 300];
        for _ in 0..300 {
            let op = Opcode((rng.next() % 0x18) as u8);
            if !op.is_supported() {
                continue;
            }
            let psn = Psn::new(if rng.chance(0.7) {
                200u32.wrapping_add((rng.next() % 8) as u32)
            } else {
                rng.next() as u32
            });
            let plen = if op.has_payload() {
                (rng.next() % 300) as usize
            } else {
                0
            };
            let va = match rng.next() % 4 {
                0 => rmb.addr(),
                1 => rmb.addr() + rng.next() % 2048,
                2 => rng.next(),
                _ => rmb.addr().wrapping_sub(rng.next() % 64),
            };
            let rkey = if rng.chance(0.8) {
                rmb.key()
            } else {
                rng.next() as u32
            };
            let syndrome = match rng.next() % 4 {
                0 => Syndrome::ACK,
                1 => Syndrome::RnrNak {
                    timer: (rng.next() % 32) as u8,
                },
                2 => Syndrome::Nak(NakCode::PsnSequenceError),
                _ => Syndrome::Nak(NakCode::RemoteAccessError),
            };
            let r = PacketRepr {
                bth: BthRepr {
                    ack_req: rng.chance(0.5),
                    ..BthRepr::new(op, 0x12, psn)
                },
                reth: Some(Reth {
                    va,
                    rkey,
                    len: (rng.next() % 2000) as u32,
                }),
                atomic_eth: Some(AtomicEth {
                    va,
                    rkey,
                    swap_add: 1,
                    compare: 2,
                }),
                aeth: Some(Aeth {
                    syndrome,
                    msn: rng.next() as u32 & 0xFF_FFFF,
                }),
                atomic_ack_eth: Some(0),
                imm: Some(1),
                ieth: Some(2),
                payload: &payload[..plen],
            };
            let mut bytes = vec![0u8; r.buffer_len()];
            r.emit(&mut bytes);
            let parsed = PacketRepr::parse_bytes(&bytes).unwrap();
            p.b.qp.handle_packet(p.now, &parsed, &p.b.mrs);
            while p.b.qp.poll_transmit(p.now, &mut buf).is_some() {}
            while p.b.qp.poll_completion().is_some() {}
            p.now += Duration::from_millis(1);
            p.b.qp.handle_timeout(p.now);
        }
        // Whatever happened, memory outside the regions was not touched (a region is only ever
        // written within bounds, checked by `Region::write`'s assertion) and the QP is coherent.
        assert!(
            matches!(p.b.qp.state(), QpState::Rts | QpState::Error),
            "round {round}"
        );
    }
}

#[test]
fn completions_pushed_outside_the_packet_path_queue_behind_the_packet_ones() {
    // The same-host transport pushes receive completions itself; one received over UDP just
    // before the switch (still in the responder's queue) must be handed out first.
    let mut p = Pair::new(Mtu::Mtu1024, 100, 200);
    let src = Pair::mr(&p.a, 64);
    let dst = Pair::mr(&p.b, 64);
    for id in [7, 8] {
        p.b.qp
            .post_recv(
                &RecvWr {
                    wr_id: id,
                    sg_list: &[sge(&dst, 0, 64)],
                },
                &p.b.mrs,
            )
            .unwrap();
    }
    p.a.qp
        .post_send(
            &SendWr {
                wr_id: 1,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, 0, 12)],
                flags: SendFlags::empty(),
            },
            &p.a.mrs,
        )
        .unwrap();
    let mut buf = vec![0u8; 8192];
    let n = p.a.qp.poll_transmit(p.now, &mut buf).unwrap();
    let pkt = PacketRepr::parse_bytes(&buf[..n]).unwrap();
    p.b.qp.handle_packet(p.now, &pkt, &p.b.mrs);
    let second = p.b.qp.take_recv().unwrap();
    p.b.qp.push_completion(
        CqSide::Recv,
        WorkCompletion {
            wr_id: second.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 3,
            imm_data: None,
            qp_num: 0x12,
        },
    );
    let order: Vec<u64> = std::iter::from_fn(|| p.b.qp.poll_completion())
        .map(|(_, c)| c.wr_id)
        .collect();
    assert_eq!(order, [7, 8]);
}

#[test]
fn an_expedited_send_overtakes_requests_that_have_not_started() {
    for seed in 0..4 {
        let mut p = Pair::new(Mtu::Mtu256, 0xFF_FFF0, 0x10);
        p.rng = Rng(seed);
        p.faults = Faults {
            drop: 0.05,
            dup: 0.02,
            reorder: 0.05,
            ..Faults::default()
        };
        let n = 20;
        let len = 1000; // four packets at MTU 256
        let src = Pair::mr(&p.a, n * len + 64);
        let dst = Pair::mr(&p.b, n * len);
        let recv = Pair::mr(&p.b, (n + 1) * 64);
        let data = pattern(seed as u8, n * len);
        src.write(0, &data);
        src.write(n * len, b"URGENT!!");
        for i in 0..=n {
            p.b.qp
                .post_recv(
                    &RecvWr {
                        wr_id: 1000 + i as u64,
                        sg_list: &[sge(&recv, i * 64, 64)],
                    },
                    &p.b.mrs,
                )
                .unwrap();
        }
        for i in 0..n {
            let w = SendWr {
                wr_id: i as u64,
                opcode: WrOpcode::RdmaWrite {
                    remote_addr: dst.addr() + (i * len) as u64,
                    rkey: dst.key(),
                },
                sg_list: &[sge(&src, i * len, len)],
                flags: SendFlags::empty(),
            };
            p.a.qp.post_send(&w, &p.a.mrs).unwrap();
            let s = SendWr {
                wr_id: 5000 + i as u64,
                opcode: WrOpcode::Send,
                sg_list: &[sge(&src, i * len, 8)],
                flags: SendFlags::SIGNALED,
            };
            p.a.qp.post_send(&s, &p.a.mrs).unwrap();
        }
        // Six packets leave: WRITE 0 (4), SEND 0, and the first packet of WRITE 1, which has
        // therefore started; SEND 1 and everything after it have not.
        let mut buf = vec![0u8; 8192];
        for _ in 0..6 {
            let k = p.a.qp.poll_transmit(p.now, &mut buf).unwrap();
            let pkt = PacketRepr::parse_bytes(&buf[..k]).unwrap();
            p.b.qp.handle_packet(p.now, &pkt, &p.b.mrs);
        }
        let urgent = SendWr {
            wr_id: 9999,
            opcode: WrOpcode::Send,
            sg_list: &[sge(&src, n * len, 8)],
            flags: SendFlags::SIGNALED | SendFlags::EXPEDITE,
        };
        p.a.qp.post_send(&urgent, &p.a.mrs).unwrap();
        p.run(100_000);
        assert_eq!(contents(&dst, 0, n * len), data, "seed {seed}: data intact");
        // What each receive got: SEND 0, the expedited one, then SEND 1.. in order.
        assert_eq!(contents(&recv, 0, 8), data[..8], "seed {seed}");
        assert_eq!(contents(&recv, 64, 8), b"URGENT!!", "seed {seed}: overtook");
        for i in 1..n {
            assert_eq!(
                contents(&recv, (i + 1) * 64, 8),
                data[i * len..i * len + 8],
                "seed {seed}: SEND {i}"
            );
        }
        let ids: Vec<u64> = p.a.completions.iter().map(|c| c.1.wr_id).collect();
        let mut want = vec![5000, 9999];
        want.extend(5001..5000 + n as u64);
        assert_eq!(ids, want, "seed {seed}: completions in wire order");
        assert!(
            p.a.completions
                .iter()
                .all(|c| c.1.status == WcStatus::Success)
        );
    }
}

/// A peer whose ACKs come late (a slow responder: Linux rxe under load, a qemu guest). The
/// early retransmission waits from the last packet that asked for an ACK, not from the first
/// packet of a long message; one that fires anyway is found needless when the ACK covers
/// packets not yet sent again (counted, the window cut undone, the next wait longer).
#[test]
fn early_retransmission_waits_for_the_last_packet_and_spurious_ones_are_undone() {
    let mut p = Pair::new(Mtu::Mtu1024, 100, 200);
    let src = Pair::mr(&p.a, 64 * 1024);
    let dst = Pair::mr(&p.b, 64 * 1024);
    src.write(0, &pattern(7, 64 * 1024));
    let post = |p: &mut Pair, id: u64, len: usize| {
        post_write(&mut p.a, id, (&src, &dst, len), SendFlags::SIGNALED);
    };
    // A few small round trips of 20 µs: the round-trip estimate is small (probe after 500 µs).
    for id in 0..8 {
        post(&mut p, id, 100);
        p.run(100);
    }
    let stats = |p: &Pair| p.a.qp.requester_stats();
    assert_eq!(stats(&p).probes, 0);
    // One 64 KiB WRITE, its packets leaving 20 µs apart (1.3 ms for the 64), each delivered
    // at once; the peer's ACKs are held `ack_delay` after the last packet left.
    let mut buf = vec![0u8; 8192];
    // `resend`: whether the sender may send again before the ACKs come (else it is stalled,
    // as behind a full socket buffer).
    let mut long_write = |p: &mut Pair, id: u64, ack_delay: Duration, resend: bool| -> usize {
        post(p, id, 64 * 1024);
        let mut acks: Vec<Vec<u8>> = Vec::new();
        let mut sent = 0;
        let mut last_sent = p.now;
        let mut resent = 0;
        loop {
            p.a.qp.handle_timeout(p.now);
            let may = sent < 64 || resend;
            if let Some(n) = may.then(|| p.a.qp.poll_transmit(p.now, &mut buf)).flatten() {
                let pkt = PacketRepr::parse_bytes(&buf[..n]).unwrap();
                if sent < 64 {
                    sent += 1;
                    last_sent = p.now;
                } else {
                    resent += 1;
                }
                p.b.qp.handle_packet(p.now, &pkt, &p.b.mrs);
                while let Some(m) = p.b.qp.poll_transmit(p.now, &mut buf) {
                    acks.push(buf[..m].to_vec());
                }
            }
            if sent == 64 && p.now >= last_sent + ack_delay {
                for a in acks.drain(..) {
                    let pkt = PacketRepr::parse_bytes(&a).unwrap();
                    p.a.qp.handle_packet(p.now, &pkt, &p.a.mrs);
                }
                p.run(1000);
                return resent;
            }
            p.now += Duration::from_micros(20);
        }
    };
    // ACKs 300 µs after the last packet: 1.6 ms after the first, well past the 500 µs probe
    // interval had it been counted from there; counted from the last packet, nothing fires.
    let resent = long_write(&mut p, 10, Duration::from_micros(300), true);
    assert_eq!((stats(&p).probes, resent), (0, 0), "{:?}", stats(&p));
    // ACKs 3 ms late: the probe fires and sends the message again; the late ACK comes, then
    // the peer's ACKs of the duplicates: it had the first copies. Needless, counted as such.
    let resent = long_write(&mut p, 11, Duration::from_millis(3), true);
    let s = stats(&p);
    assert_eq!(s.probes, 1, "{s:?}");
    assert_eq!(s.spurious_probes, 1, "{s:?}");
    assert!(resent > 0, "the probe sent packets again");
    // The next time the same lateness is waited out: no probe.
    let resent = long_write(&mut p, 12, Duration::from_millis(3), true);
    let s = stats(&p);
    assert_eq!((s.probes, s.spurious_probes, resent), (1, 1, 0), "{s:?}");
    // Later still (10 ms), with the sender unable to send again before the ACK: the ACK
    // covers packets the probe has not resent, which tells the same.
    let resent = long_write(&mut p, 13, Duration::from_millis(10), false);
    let s = stats(&p);
    assert_eq!((s.probes, s.spurious_probes, resent), (2, 2, 0), "{s:?}");
    assert_eq!(contents(&dst, 0, 64 * 1024), pattern(7, 64 * 1024));
    assert_eq!(
        p.a.completions.len(),
        12,
        "8 small and 4 long WRITEs completed"
    );
}

/// `QpCaps::ack_delay`: the ACK of a SEND waits for the receiver's own next request and leaves
/// right after it in the same transmit pass; unanswered, it leaves alone when the delay is over.
#[test]
fn a_held_ack_rides_with_the_answer_or_leaves_when_its_wait_is_over() {
    let caps = QpCaps {
        ack_delay: Some(Duration::from_micros(200)),
        ..QpCaps::default()
    };
    let mut p = Pair::with(Mtu::Mtu1024, 100, 200, caps, QpAttr::state(QpState::Rts));
    let (sa, da) = (Pair::mr(&p.a, 64), Pair::mr(&p.a, 64));
    let (sb, db) = (Pair::mr(&p.b, 64), Pair::mr(&p.b, 64));
    let recv = |h: &mut Host, id: u64, mr: &Region| {
        let wr = RecvWr {
            wr_id: id,
            sg_list: &[sge(mr, 0, 64)],
        };
        h.qp.post_recv(&wr, &h.mrs).unwrap();
    };
    let send_with = |h: &mut Host, id: u64, mr: &Region, flags: SendFlags| {
        let wr = SendWr {
            wr_id: id,
            opcode: WrOpcode::Send,
            sg_list: &[sge(mr, 0, 8)],
            flags: SendFlags::SIGNALED | flags,
        };
        h.qp.post_send(&wr, &h.mrs).unwrap();
    };
    let send = |h: &mut Host, id: u64, mr: &Region| send_with(h, id, mr, SendFlags::empty());
    // One packet from `from` to `to`, if `from` has one, marked as our device marks it when
    // `mark`: its opcode.
    let hop_marked = |from: &mut Host, to: &mut Host, now: Instant, mark: bool| -> Option<u8> {
        let mut buf = vec![0u8; 8192];
        let n = from.qp.poll_transmit(now, &mut buf)?;
        if mark {
            buf[4] |= crate::wire::MARK;
        }
        let pkt = PacketRepr::parse_bytes(&buf[..n]).unwrap();
        to.qp.handle_packet(now, &pkt, &to.mrs);
        Some(buf[0])
    };
    let hop = |from: &mut Host, to: &mut Host, now: Instant| hop_marked(from, to, now, true);
    recv(&mut p.b, 1, &db);
    recv(&mut p.a, 2, &da);
    send(&mut p.a, 10, &sa);
    let t0 = p.now;
    assert_eq!(hop(&mut p.a, &mut p.b, t0), Some(Opcode::SEND_ONLY.0));
    // B holds its ACK, and says when it will send it anyway.
    assert_eq!(hop(&mut p.b, &mut p.a, t0), None);
    assert_eq!(p.b.qp.poll_timeout(), Some(t0 + Duration::from_micros(200)));
    // B answers: the answer, then the ACK, in one pass.
    let t1 = t0 + Duration::from_micros(5);
    send(&mut p.b, 20, &sb);
    assert_eq!(hop(&mut p.b, &mut p.a, t1), Some(Opcode::SEND_ONLY.0));
    assert_eq!(hop(&mut p.b, &mut p.a, t1), Some(Opcode::ACKNOWLEDGE.0));
    assert_eq!(hop(&mut p.b, &mut p.a, t1), None);
    let done: Vec<_> = std::iter::from_fn(|| p.a.qp.poll_completion()).collect();
    assert!(
        done.iter()
            .any(|(s, c)| *s == CqSide::Send && c.wr_id == 10),
        "A's SEND acknowledged: {done:?}"
    );
    // A does not answer: its ACK of B's SEND waits 200 µs, then leaves alone.
    assert_eq!(hop(&mut p.a, &mut p.b, t1), None);
    let due = p.a.qp.poll_timeout().unwrap();
    assert_eq!(due, t1 + Duration::from_micros(200));
    assert_eq!(
        hop(&mut p.a, &mut p.b, due - Duration::from_micros(1)),
        None
    );
    assert_eq!(hop(&mut p.a, &mut p.b, due), Some(Opcode::ACKNOWLEDGE.0));
    assert_eq!(p.a.qp.poll_timeout(), None, "nothing left to wait for");
    let done: Vec<_> = std::iter::from_fn(|| p.b.qp.poll_completion()).collect();
    assert!(
        done.iter()
            .any(|(s, c)| *s == CqSide::Send && c.wr_id == 20)
    );
    // A SEND that asks for its ACK at once (nobody answers a close) gets it at once.
    let t2 = due + Duration::from_micros(10);
    recv(&mut p.b, 3, &db);
    send_with(&mut p.a, 11, &sa, SendFlags::ACK_NOW);
    assert_eq!(hop(&mut p.a, &mut p.b, t2), Some(Opcode::SEND_ONLY.0));
    assert_eq!(hop(&mut p.b, &mut p.a, t2), Some(Opcode::ACKNOWLEDGE.0));
    // A peer that is not our engine (no mark: rxe, an RNIC) is never kept waiting.
    recv(&mut p.b, 4, &db);
    send(&mut p.a, 12, &sa);
    assert_eq!(
        hop_marked(&mut p.a, &mut p.b, t2, false),
        Some(Opcode::SEND_ONLY.0)
    );
    assert_eq!(hop(&mut p.b, &mut p.a, t2), Some(Opcode::ACKNOWLEDGE.0));
    let done: Vec<_> = std::iter::from_fn(|| p.a.qp.poll_completion()).collect();
    for id in [11, 12] {
        assert!(
            done.iter()
                .any(|(s, c)| *s == CqSide::Send && c.wr_id == id),
            "{id}: {done:?}"
        );
    }
}

/// A long transfer through a link that holds back a share of the packets (each way) for up to
/// a few milliseconds, as a multi-path network reorders: everything arrives intact, without a
/// timeout, in a virtual time close to the same transfer without faults.
#[test]
fn held_back_packets_cost_little() {
    let mut times = vec![];
    for (hold, max) in [(0.0, 0), (0.01, 1), (0.05, 2), (0.2, 10)] {
        let mut p = Pair::new(Mtu::Mtu1024, 5, 9);
        p.rng = Rng(7);
        p.faults = Faults {
            hold,
            hold_max: Duration::from_millis(max),
            ..Faults::default()
        };
        // 32 packets of 1 KiB per 10 µs: about 26 Gbit/s.
        p.per_step = 32;
        let (n, len) = (128, 128 * 1024);
        let src = Pair::mr(&p.a, len);
        src.write(0, &pattern(5, len));
        let dst = Pair::mr(&p.b, len);
        let t0 = p.now;
        for i in 0..n {
            post_write(&mut p.a, i, (&src, &dst, len), SendFlags::SIGNALED);
        }
        p.run(10_000_000);
        assert_eq!(p.a.completions.len(), n as usize);
        assert!(
            p.a.completions
                .iter()
                .all(|c| c.1.status == WcStatus::Success)
        );
        assert_eq!(contents(&dst, 0, len), pattern(5, len));
        let st = p.a.qp.requester_stats();
        let r = p.b.qp.responder_stats();
        let t = p.now - t0;
        eprintln!(
            "hold {hold} up to {max} ms: {t:?}; resent {} probes {} timeouts {} naks {}; kept {}",
            st.retransmits, st.probes, st.timeouts, r.nak_seq, r.reordered
        );
        assert_eq!(st.timeouts, 0, "hold {hold}");
        times.push(t);
    }
    // The clean run's time is bounded by the simulation's 10 µs step per exchange; reordering
    // adds at most a few of its delays.
    for t in &times[1..3] {
        assert!(*t < times[0] * 2 + Duration::from_millis(20), "{times:?}");
    }
}
