//! Stateful: arbitrary packets into a connected RC queue pair (with receives and sends posted,
//! registered memory the packets aim at), and arbitrary LLC messages into a link, interleaved
//! with transmits, completions and timers. Nothing panics; the QP stays in RTS or goes to the
//! error state; a region outside the target is never written; the link is active or down.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdma::rc::RcQp;
use rdma::wire::{Aeth, AtomicEth, BthRepr, NakCode, Opcode, PacketRepr, Reth, Syndrome};
use rdma::{Access, MrTable, Mtu, Psn, QpAttr, QpCaps, QpState, RecvWr, SendFlags, SendWr, Sge};
use smcr::link::{LinkCore, LinkEvent, LinkParams, Role};
use std::time::{Duration, Instant};

const PD: u32 = 1;
const PEER_QPN: u32 = 0x12;
const PEER_PSN: u32 = 200;

/// Reads the fuzz input front to back; zeros once it is used up.
struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn sge(r: &rdma::Region, off: usize, len: usize) -> Sge {
    Sge {
        addr: r.addr() + off as u64,
        length: len as u32,
        lkey: r.key(),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let mut now = Instant::now();
    let mrs = MrTable::new(0x11);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let rmb = mrs.register(PD, 1024, all).unwrap();
    let canary = mrs.register(PD, 256, Access::LOCAL_WRITE).unwrap();
    canary.write(0, &[0xA5; 256]);
    let src = mrs.register(PD, 1024, Access::LOCAL_WRITE).unwrap();
    let rbuf = mrs.register(PD, 512, Access::LOCAL_WRITE).unwrap();
    let mut qp = RcQp::new(0x11, PD, QpCaps::default(), false);
    qp.modify(&QpAttr::state(QpState::Init)).unwrap();
    qp.modify(&QpAttr {
        path_mtu: Some(Mtu::Mtu256),
        dest_qp_num: Some(PEER_QPN),
        rq_psn: Some(Psn::new(PEER_PSN)),
        min_rnr_timer: Some(1),
        ..QpAttr::state(QpState::Rtr)
    })
    .unwrap();
    qp.modify(&QpAttr {
        sq_psn: Some(Psn::new(100)),
        timeout: Some(12),
        retry_cnt: Some(7),
        ..QpAttr::state(QpState::Rts)
    })
    .unwrap();
    let mut link = LinkCore::new(
        LinkParams {
            role: Role::Client,
            version: llc::Version::V2,
            mac: clc::Mac([2, 0, 0, 0, 0, 1]),
            gid: clc::Gid::from_ipv4([10, 0, 0, 1].into()),
            qpn: 0x11,
            link_id: 0,
            link_uid: [0; 4],
            max_links: 2,
            max_conns: 255,
            test_link_time: Some(Duration::from_secs(30)),
        },
        now,
    );
    // A client with an alternate path in a group of several links: ADD LINK requests reach
    // the driver (answered below), DELETE LINK for links 2 and 3 is the group's.
    link.set_accept_add_link(true);
    link.set_group_links(&[2, 3]);
    let payload = [0xCCu8; 600];
    let mut buf = vec![0u8; 4096];
    let mut ids = 0u64;
    while !inp.empty() {
        match inp.u8() % 8 {
            // A well-formed packet with fuzzed fields, aimed near what the QP expects.
            0 | 1 => {
                let op = Opcode(inp.u8() % 0x18);
                if !op.is_supported() {
                    continue;
                }
                let k = inp.u8();
                let psn = Psn::new(if k < 200 {
                    PEER_PSN.wrapping_add(u32::from(k % 16))
                } else {
                    inp.u32()
                });
                let va = match inp.u8() % 4 {
                    0 => rmb.addr(),
                    1 => rmb.addr() + u64::from(inp.u16() % 2048),
                    2 => u64::from(inp.u32()) << 8,
                    _ => rmb.addr().wrapping_sub(u64::from(inp.u8())),
                };
                let rkey = if inp.u8() < 200 { rmb.key() } else { inp.u32() };
                let syndrome = match inp.u8() % 4 {
                    0 => Syndrome::ACK,
                    1 => Syndrome::RnrNak { timer: inp.u8() % 32 },
                    2 => Syndrome::Nak(NakCode::PsnSequenceError),
                    _ => Syndrome::Nak(NakCode::RemoteAccessError),
                };
                let plen = if op.has_payload() {
                    usize::from(inp.u16()) % payload.len()
                } else {
                    0
                };
                let r = PacketRepr {
                    bth: BthRepr {
                        ack_req: inp.u8() & 1 == 1,
                        ..BthRepr::new(op, 0x11, psn)
                    },
                    reth: Some(Reth {
                        va,
                        rkey,
                        len: u32::from(inp.u16()),
                    }),
                    atomic_eth: Some(AtomicEth {
                        va,
                        rkey,
                        swap_add: 1,
                        compare: 2,
                    }),
                    aeth: Some(Aeth {
                        syndrome,
                        msn: inp.u32() & 0xFF_FFFF,
                    }),
                    atomic_ack_eth: Some(0),
                    imm: Some(1),
                    ieth: Some(2),
                    payload: &payload[..plen],
                };
                let mut bytes = vec![0u8; r.buffer_len()];
                r.emit(&mut bytes);
                if let Ok(p) = PacketRepr::parse_bytes(&bytes) {
                    qp.handle_packet(now, &p, &mrs);
                }
            }
            // Raw bytes as a packet.
            2 => {
                let n = usize::from(inp.u8()) * 2;
                let raw = inp.bytes(n).to_vec();
                if let Ok(p) = PacketRepr::parse_bytes(&raw) {
                    qp.handle_packet(now, &p, &mrs);
                }
            }
            3 => {
                ids += 1;
                let off = usize::from(inp.u8()) % 512;
                let _ = qp.post_recv(
                    &RecvWr {
                        wr_id: ids,
                        sg_list: &[sge(&rbuf, off, 512 - off)],
                    },
                    &mrs,
                );
            }
            4 => {
                ids += 1;
                let len = usize::from(inp.u16()) % 1024;
                let opcode = match inp.u8() % 3 {
                    0 => rdma::WrOpcode::Send,
                    1 => rdma::WrOpcode::RdmaWrite {
                        remote_addr: u64::from(inp.u32()),
                        rkey: inp.u32(),
                    },
                    _ => rdma::WrOpcode::RdmaRead {
                        remote_addr: u64::from(inp.u32()),
                        rkey: inp.u32(),
                    },
                };
                let flags = match inp.u8() % 3 {
                    0 => SendFlags::SIGNALED,
                    1 => SendFlags::SIGNALED | SendFlags::EXPEDITE,
                    _ => SendFlags::empty(),
                };
                let _ = qp.post_send(
                    &SendWr {
                        wr_id: ids,
                        opcode,
                        sg_list: &[sge(&src, 0, len)],
                        flags,
                    },
                    &mrs,
                );
            }
            5 => {
                while qp.poll_transmit(now, &mut buf).is_some() {}
                while qp.poll_completion().is_some() {}
            }
            6 => {
                now += Duration::from_millis(u64::from(inp.u8()) * 4);
                qp.handle_timeout(now);
                link.handle_timeout(now);
                while let Some(ev) = link.poll_event() {
                    if let LinkEvent::PeerAddLink(a) = ev {
                        link.answer_add_link(Some(a));
                    }
                }
                while link.poll_transmit().is_some() {}
            }
            // An LLC message (any bytes) into the link.
            _ => {
                let n = usize::from(inp.u8() % 100) + 1;
                let m = inp.bytes(n).to_vec();
                link.handle_llc(&m, now);
                while let Some(ev) = link.poll_event() {
                    if let LinkEvent::PeerAddLink(a) = ev {
                        link.answer_add_link(Some(a));
                    }
                }
                while link.poll_transmit().is_some() {}
            }
        }
    }
    assert!(matches!(qp.state(), QpState::Rts | QpState::Error), "{:?}", qp.state());
    let mut c = [0u8; 256];
    canary.read(0, &mut c);
    assert!(c.iter().all(|&b| b == 0xA5), "a region no packet may reach was written");
});
