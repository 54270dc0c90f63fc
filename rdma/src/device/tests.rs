use super::ids::{GSO_IDS, IdCache, icrc_matches};
use crate::transport::steer;
use crate::wire::{IcrcHeaders, compute_icrc};
use std::net::Ipv4Addr;

/// A SEND-only packet whose ICRC was computed for `h` (segment `ip_id` of a batch).
fn packet(h: &IcrcHeaders) -> Vec<u8> {
    let mut p = vec![0u8; 12 + 16 + 4];
    p[0] = 0x04;
    p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
    p[5..8].copy_from_slice(&[0x2a, 0xb0, 0x07]);
    for (i, b) in p[12..28].iter_mut().enumerate() {
        *b = i as u8;
    }
    let icrc = compute_icrc(h, &p);
    let n = p.len();
    p[n - 4..].copy_from_slice(&icrc.to_le_bytes());
    p
}

/// The receive path's ICRC rule: a packet is checked with the destination port the sender
/// addressed — the RoCE port (steered to our own port on the way), else our socket's own
/// port (a sender that addressed it directly) — never with any other.
#[test]
fn icrc_is_checked_with_the_roce_port_then_the_socket_port() {
    let own = steer::port_of_range(0x2ab);
    let base = IcrcHeaders {
        src: Ipv4Addr::new(10, 0, 0, 1),
        dst: Ipv4Addr::new(10, 0, 0, 2),
        ip_id: 0,
        df: true,
        sport: 50123,
        dport: 0,
    };
    let mut ids = IdCache::default();
    let addressed = [steer::ROCE_PORT, own];
    for (sent_to, ok) in [
        (steer::ROCE_PORT, true), // a peer that sends to 4791: steered to us
        (own, true),              // a peer that addressed our port
        (own + 1, false),         // a third port: not ours
        (4790, false),
    ] {
        let p = packet(&IcrcHeaders {
            dport: sent_to,
            ..base
        });
        // What the receiver sees: the headers without the destination port.
        assert_eq!(
            icrc_matches(base, addressed, &p, &mut ids).is_some(),
            ok,
            "sent to {sent_to}"
        );
    }
    // Without the RoCE port in the rule (the old one: the socket's port only), a steered
    // packet fails: the receiver's port is not what the sender's ICRC covered.
    let steered = packet(&IcrcHeaders {
        dport: steer::ROCE_PORT,
        ..base
    });
    assert_eq!(icrc_matches(base, [own, own], &steered, &mut ids), None);
    // Identifications are found, GSO segment indices and others, for either port.
    for sent_to in [steer::ROCE_PORT, own] {
        for id in [5, 63, 64, 0x56d6, 0xffff] {
            let p = packet(&IcrcHeaders {
                dport: sent_to,
                ip_id: id,
                ..base
            });
            assert_eq!(
                icrc_matches(base, addressed, &p, &mut ids),
                Some(id),
                "{sent_to}"
            );
        }
    }
    // A corrupted byte fails with both.
    let mut bad = steered.clone();
    bad[20] ^= 0x10;
    assert_eq!(icrc_matches(base, addressed, &bad, &mut ids), None);
    // A fixed-port device has one port: checked once.
    let fixed = packet(&IcrcHeaders {
        dport: 40000,
        ..base
    });
    assert_eq!(
        icrc_matches(base, [40000, 40000], &fixed, &mut ids),
        Some(0)
    );
}

/// RoCE frames Linux 6.12's rxe sent to our engine (kernel-peer rig captures), with the
/// IPv4 identifications its per-destination counter gave them (0x3777…, 0x81b2…, 0xffb9…,
/// 0xb8c4…): what a UDP socket receives of each, and the identification it did not see.
fn kernel_frames() -> Vec<(IcrcHeaders, u16, Vec<u8>)> {
    let d = include_bytes!("../../tests/data/kernel-6.12-rxe-frames.pcap");
    let mut out = Vec::new();
    let mut off = 24;
    while off + 16 <= d.len() {
        let cl = u32::from_le_bytes(d[off + 8..off + 12].try_into().unwrap()) as usize;
        let f = &d[off + 16..off + 16 + cl];
        off += 16 + cl;
        let (ip, udp) = (&f[14..34], &f[34..]);
        let ulen = u16::from_be_bytes([udp[4], udp[5]]) as usize;
        let h = IcrcHeaders {
            src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            ip_id: 0, // not visible to the receiver
            df: ip[6] & 0x40 != 0,
            sport: u16::from_be_bytes([udp[0], udp[1]]),
            dport: 0, // replaced by the ports tried
        };
        out.push((h, u16::from_be_bytes([ip[4], ip[5]]), udp[8..ulen].to_vec()));
    }
    out
}

/// Linux rxe's datagrams pass with their identification hidden (it is solved, and comes
/// out as the one on the wire); with any single bit flipped — in the packet, its ICRC, or
/// the addresses and port the receiver supplies — they fail.
#[test]
fn kernel_rxe_datagrams_pass_and_any_single_bit_flip_fails() {
    let frames = kernel_frames();
    assert_eq!(frames.len(), 30);
    let mut ids = IdCache::default();
    let roce = [steer::ROCE_PORT; 2];
    let mut ids_seen = std::collections::BTreeSet::new();
    for (h, real_id, bytes) in &frames {
        assert_eq!(h.dst, Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(icrc_matches(*h, roce, bytes, &mut ids), Some(*real_id));
        ids_seen.insert(*real_id);
        let mut flipped = bytes.clone();
        for bit in 0..bytes.len() * 8 {
            if bit / 8 == 4 {
                continue; // BTH byte 4 (FECN, BECN, reserved): masked out of the ICRC
            }
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(
                icrc_matches(*h, roce, &flipped, &mut ids),
                None,
                "{} bytes from {real_id:#x}: bit {bit} flipped",
                bytes.len()
            );
            flipped[bit / 8] ^= 1 << (bit % 8);
        }
        for field in 0..80 {
            let mut g = *h;
            match field {
                0..32 => g.src = Ipv4Addr::from(u32::from(g.src) ^ 1 << field),
                32..64 => g.dst = Ipv4Addr::from(u32::from(g.dst) ^ 1 << (field - 32)),
                _ => g.sport ^= 1 << (field - 64),
            }
            assert_eq!(icrc_matches(g, roce, bytes, &mut ids), None, "{g:?}");
        }
    }
    assert!(ids_seen.iter().all(|&id| id >= GSO_IDS), "{ids_seen:x?}");
}

/// The socket hand-back's counting (`rx_take`/`rx_give`, see `DeviceConfig::rx_hold`) in the
/// order two waiting threads can produce: one lets go of the receive state, the other takes
/// it and turns the interest off before the first one's hand-back is set; both hand back.
/// When the hold is over the engine's interest is back (no count left behind).
#[test]
fn two_hand_backs_leave_no_count_behind() {
    let mut cfg = super::DeviceConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.rx_hold = std::time::Duration::from_millis(1);
    let dev = super::Shared::open(cfg).unwrap();
    let away = || *dev.receive.rx_away.lock();
    dev.rx_take(true); // thread 1 waits
    assert_eq!(away(), 1);
    dev.rx_take(true); // thread 2 takes the receive state before thread 1's hand-back is set
    assert_eq!(away(), 2);
    dev.rx_give(true); // thread 1's hand-back
    dev.rx_give(true); // thread 2's: one held count is enough
    assert_eq!(away(), 1);
    dev.rx_take(true); // a thread comes back: takes the held one, no system call
    assert_eq!(away(), 1);
    dev.rx_give(true);
    assert_eq!(away(), 1);
    // Nobody comes back: the hold's timer gives the socket to the engine thread.
    std::thread::sleep(std::time::Duration::from_millis(3));
    dev.rx_hold_due(std::time::Instant::now());
    assert_eq!(away(), 0);
    dev.stop();
}

/// A thread waiting on a CQ with the socket keeps the timers (the engine thread sleeps), unless
/// the CQ's spins keep losing the CPU (a busy machine): such a thread is often runnable but not
/// running, and the engine keeps the timers then. Both waits, the poller's and the driver's.
#[test]
fn a_waiter_keeps_the_timers_unless_its_spins_keep_losing_the_cpu() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    let dev = Arc::new(
        super::Shared::open(super::DeviceConfig::new("127.0.0.1:0".parse().unwrap())).unwrap(),
    );
    for driver in [false, true] {
        for busy in [false, true] {
            let cq = Arc::new(super::cq::CqShared::new().unwrap());
            if busy {
                for _ in 0..super::spin::LOST_IN_A_ROW {
                    cq.spin
                        .record(super::spin::Spun::Lost, dev.nanos(Instant::now()));
                }
            }
            let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (d, c, st) = (dev.clone(), cq.clone(), started.clone());
            let t = std::thread::spawn(move || {
                st.store(true, Ordering::SeqCst);
                let wait = Some(Duration::from_millis(600));
                if driver {
                    d.drive_wait(&c, wait)
                } else {
                    d.wait_cq(&c, wait)
                }
            });
            while !started.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            // Watched for 400 ms of the 600 ms wait (a loaded machine may start it late): a
            // keeper shows up, or never does.
            let until = Instant::now() + Duration::from_millis(400);
            let mut seen = 0;
            while Instant::now() < until && seen < u32::from(!busy) {
                seen = seen.max(dev.timers.keepers.load(Ordering::SeqCst));
                std::thread::sleep(Duration::from_millis(1));
            }
            seen = seen.max(dev.timers.keepers.load(Ordering::SeqCst));
            t.join().unwrap().unwrap();
            assert_eq!(seen, u32::from(!busy), "driver {driver}, busy {busy}");
            assert_eq!(dev.timers.keepers.load(Ordering::SeqCst), 0);
        }
    }
    dev.stop();
}
