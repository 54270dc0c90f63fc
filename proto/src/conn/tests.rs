//! Two connection cores exchanging CDCs in memory, with the RMBs simulated as byte vectors.

use super::*;
use proptest::prelude::*;

struct End {
    core: ConnCore,
    rmb: Vec<u8>,
}

/// One side writes `data` as far as space allows into the other's RMB; returns bytes written.
fn write(from: &mut End, to: &mut End, data: &[u8]) -> usize {
    let n = (data.len() as u32).min(from.core.space());
    if n == 0 {
        return 0;
    }
    let plan = from.core.prepare_write(n, data.len() as u32);
    let mut at = 0usize;
    for (off, len) in plan.pieces {
        let (off, len) = (off as usize, len as usize);
        to.rmb[off..off + len].copy_from_slice(&data[at..at + len]);
        at += len;
    }
    assert_eq!(at, n as usize);
    // The slack is free: scribbling over it must not change what the reader gets.
    let end = match plan.pieces {
        [(_, _), (o, l)] if l > 0 => (o + l) as usize,
        [(o, l), _] => (o + l) as usize,
    };
    to.rmb[end..end + plan.slack as usize].fill(0xEE);
    let up = to
        .core
        .on_cdc(&CdcMessage::parse(&plan.cdc.to_bytes()).unwrap())
        .unwrap();
    assert_eq!(up.new_data, n);
    n as usize
}

/// The reader takes up to `max` bytes; consumer updates go back to the writer.
fn read(me: &mut End, peer: &mut End, max: usize, out: &mut Vec<u8>) -> Option<CdcMessage> {
    let n = (max as u32).min(me.core.readable());
    for (off, len) in me.core.read_pieces(n) {
        out.extend_from_slice(&me.rmb[off as usize..(off + len) as usize]);
    }
    let cdc = me.core.consume(n);
    if let Some(c) = &cdc {
        peer.core.on_cdc(c).unwrap();
    }
    cdc
}

fn pair(rmb_a: u32, rmb_b: u32) -> (End, End) {
    (
        End {
            core: ConnCore::new(2, rmb_b, rmb_a),
            rmb: vec![0; rmb_a as usize],
        },
        End {
            core: ConnCore::new(1, rmb_a, rmb_b),
            rmb: vec![0; rmb_b as usize],
        },
    )
}

#[test]
fn test_write_wraps_into_two_pieces() {
    let (mut a, mut b) = pair(16384, 16384);
    let data: Vec<u8> = (0..20000u32).map(|i| i as u8).collect();
    assert_eq!(write(&mut a, &mut b, &data[..10000]), 10000);
    let mut got = vec![];
    read(&mut b, &mut a, 10000, &mut got);
    let plan_space = a.core.space();
    assert_eq!(
        plan_space, 16384,
        "the update limit (2304) was passed and space was short"
    );
    let plan = a.core.prepare_write(10000, 10000);
    assert_eq!(plan.pieces, [(10000, 6384), (0, 3616)]);
    assert_eq!(plan.cdc.prod, Cursor::new(1, 3616));
    assert_eq!(plan.cdc.seq, 2);
}

#[test]
fn test_consumer_updates_follow_linux_rule() {
    let (mut a, mut b) = pair(65536, 65536);
    let data = vec![7u8; 30000];
    write(&mut a, &mut b, &data);
    let mut got = vec![];
    // Small reads: the peer still has more than half the RMB free → no CDC.
    assert_eq!(read(&mut b, &mut a, 1000, &mut got), None);
    assert_eq!(b.core.update_limit(), 6553);
    // Fill more: the peer's free space drops to <= half.
    write(&mut a, &mut b, &vec![8u8; 10000]);
    assert_eq!(
        read(&mut b, &mut a, 5000, &mut got),
        None,
        "only 6000 to confirm, below the limit"
    );
    let cdc = read(&mut b, &mut a, 1000, &mut got).expect("7000 > 6553 and space <= half");
    assert_eq!(cdc.cons, Cursor::new(0, 7000));
    assert_eq!(a.core.space(), 65536 - 40000 + 7000);
}

#[test]
fn test_blocked_writer_gets_an_update() {
    let (mut a, mut b) = pair(16384, 16384);
    let data = vec![1u8; 40000];
    assert_eq!(write(&mut a, &mut b, &data), 16384);
    assert_eq!(a.core.space(), 0);
    let mut got = vec![];
    let cdc = read(&mut b, &mut a, 3000, &mut got).expect("writer blocked, 3000 > 2304");
    assert_eq!(cdc.cons.count, 3000);
    assert_eq!(a.core.space(), 3000);
}

#[test]
fn test_requested_update_and_close_flags() {
    let (mut a, mut b) = pair(65536, 65536);
    write(&mut a, &mut b, &[1, 2, 3]);
    let mut req = a.core.control_cdc();
    req.prod_flags |= ProducerFlags::CONS_CURS_UPD_REQ;
    let up = b.core.on_cdc(&req).unwrap();
    assert!(up.update_requested);
    let mut got = vec![];
    assert!(
        read(&mut b, &mut a, 1, &mut got).is_some(),
        "asked for: sent at once"
    );
    assert!(read(&mut b, &mut a, 1, &mut got).is_none(), "once");
    let fin = a.core.close_flags(ConnStateFlags::PEER_DONE_WRITING);
    b.core.on_cdc(&fin).unwrap();
    assert!(
        b.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_DONE_WRITING)
    );
    let later = a.core.control_cdc();
    assert!(
        later.conn_flags.contains(ConnStateFlags::PEER_DONE_WRITING),
        "sticky"
    );
}

#[test]
fn test_stale_and_hostile_cdcs() {
    let (mut a, mut b) = pair(16384, 16384);
    write(&mut a, &mut b, &[0; 100]);
    let first = CdcMessage {
        seq: 1,
        ..a.core.control_cdc()
    };
    let up = b.core.on_cdc(&CdcMessage { seq: 0, ..first }).unwrap();
    assert!(up.stale, "older sequence number ignored");
    // Backwards producer: ignored, not an error.
    let back = CdcMessage {
        seq: 5,
        prod: Cursor::new(0, 50),
        ..first
    };
    assert_eq!(b.core.on_cdc(&back).unwrap().new_data, 0);
    assert_eq!(b.core.readable(), 100);
    // Overrun: claims a whole ring more than fits.
    let over = CdcMessage {
        seq: 6,
        prod: Cursor::new(1, 200),
        ..first
    };
    assert!(matches!(
        b.core.on_cdc(&over),
        Err(ConnError::ProducerOverrun { .. })
    ));
    let out = CdcMessage {
        seq: 7,
        prod: Cursor::new(0, 16384),
        ..first
    };
    assert_eq!(
        b.core.on_cdc(&out),
        Err(ConnError::CursorOutOfRange(Cursor::new(0, 16384)))
    );
    // The peer claims to have consumed what we never wrote.
    let cons = CdcMessage {
        seq: 8,
        prod: Cursor::new(0, 100),
        cons: Cursor::new(0, 200),
        ..first
    };
    assert!(matches!(
        a.core.on_cdc(&cons),
        Err(ConnError::ConsumerBeyondWritten { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any interleaving of writes and reads of any sizes moves the stream intact, both ways,
    /// without deadlock, across many ring wraps.
    #[test]
    fn prop_stream_arrives_intact(
        rmb_a in prop::sample::select(vec![16384u32, 32768, 65536]),
        rmb_b in prop::sample::select(vec![16384u32, 32768, 65536]),
        ops in prop::collection::vec((any::<bool>(), 1usize..40000), 1..200),
    ) {
        let (mut a, mut b) = pair(rmb_a, rmb_b);
        let total = 300_000usize;
        let src: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got) = (0usize, Vec::new());
        let mut steps = ops.into_iter().cycle();
        let mut idle = 0;
        while got.len() < total {
            let (is_write, n) = steps.next().unwrap();
            let before = (sent, got.len());
            if is_write {
                let end = (sent + n).min(total);
                sent += write(&mut a, &mut b, &src[sent..end]);
            } else {
                read(&mut b, &mut a, n, &mut got);
            }
            if (sent, got.len()) == before {
                idle += 1;
                // A blocked writer with a reader that never hears of space would hang: the
                // reader must always be able to drain, and updates must free the writer.
                if idle > 100 {
                    // The op sequence alone makes no progress (e.g. only reads): one write of
                    // what fits and one full read must always move data.
                    prop_assert!(a.core.space() > 0 || b.core.readable() > 0, "stuck");
                    let end = (sent + 65536).min(total);
                    sent += write(&mut a, &mut b, &src[sent..end]);
                    read(&mut b, &mut a, usize::MAX, &mut got);
                    idle = 0;
                }
            } else {
                idle = 0;
            }
        }
        prop_assert_eq!(&got[..], &src[..]);
    }
}

#[test]
fn staged_bytes_continue_where_the_announced_ones_end() {
    let mut c = ConnCore::new(1, 100, 100);
    assert_eq!(c.stage_pieces(0, 30), [(0, 30), (0, 0)]);
    let _ = c.prepare_write(90, 90);
    // 90 announced; 5 staged; 20 more wrap at the end of the 100-byte ring.
    assert_eq!(c.stage_pieces(5, 20), [(95, 5), (0, 15)]);
    // Flushing the 5 staged later plans exactly those bytes.
    assert_eq!(c.prepare_write(5, 5).pieces[0], (90, 5));
}

#[test]
fn the_slack_after_a_write_is_free_space_up_to_the_end_of_the_ring() {
    let mut c = ConnCore::new(1, 100, 100);
    // Empty ring: after 10 bytes at 0, 90 are free up to the end.
    assert_eq!(c.prepare_write(10, 10).slack, 90);
    // 10 unread; 85 more end at 95: 5 left before the end of the ring.
    assert_eq!(c.prepare_write(85, 85).slack, 5);
    // The ring is full now: nothing after the data is free.
    c.peer_cons = Cursor::new(0, 95);
    // 95 consumed, 0 unread: 10 bytes wrap (5 at 95, 5 at 0) and leave 90 free, but only up
    // to the unread data's start at 95 — after the second piece, 90 bytes.
    let p = c.prepare_write(10, 10);
    assert_eq!(p.pieces, [(95, 5), (0, 5)]);
    assert_eq!(p.slack, 90);
    // 10 unread (95..100, 0..5); space 90; writing 88 leaves 2 before unread data.
    let p = c.prepare_write(88, 88);
    assert_eq!(p.pieces, [(5, 88), (0, 0)]);
    assert_eq!(p.slack, 2);
}

/// One direction of a link: WRITEs (bytes at RMB offsets) and CDCs in order.
enum Wire {
    Write(u32, Vec<u8>),
    Cdc(CdcMessage),
}

/// A sender whose send buffer mirrors the peer's RMB, as the runtime's does.
struct Sender {
    core: ConnCore,
    sndbuf: Vec<u8>,
}

fn send_failover_plan(s: &mut Sender, link: &mut std::collections::VecDeque<Wire>) {
    let f = s.core.failover();
    assert!(
        f.validation
            .prod_flags
            .contains(ProducerFlags::FAILOVER_VALIDATION)
    );
    link.push_back(Wire::Cdc(f.validation));
    for (off, len) in f.pieces {
        if len > 0 {
            let b = s.sndbuf[off as usize..(off + len) as usize].to_vec();
            link.push_back(Wire::Write(off, b));
        }
    }
    link.push_back(Wire::Cdc(f.cdc));
}

/// `a` writes up to `n` more bytes of `src` (from `sent`) as far as space allows: into its send
/// buffer, and as WRITEs and a CDC onto the link. Returns the new `sent`.
fn send_some(
    a: &mut Sender,
    to_b: &mut std::collections::VecDeque<Wire>,
    src: &[u8],
    sent: usize,
    n: usize,
) -> usize {
    let n = (n.min(src.len() - sent) as u32).min(a.core.space());
    if n == 0 {
        return sent;
    }
    let plan = a.core.prepare_write(n, n);
    let mut at = sent;
    for (off, len) in plan.pieces {
        let (o, l) = (off as usize, len as usize);
        a.sndbuf[o..o + l].copy_from_slice(&src[at..at + l]);
        if l > 0 {
            to_b.push_back(Wire::Write(off, src[at..at + l].to_vec()));
        }
        at += l;
    }
    to_b.push_back(Wire::Cdc(plan.cdc));
    at
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The link under a connection fails any number of times with WRITEs and CDCs in flight in
    /// both directions (the first WRITE possibly half delivered); each time both ends move to
    /// a new link with `failover()`. The stream arrives intact, in order, nothing twice, and
    /// no CDC is refused.
    #[test]
    fn prop_failover_with_anything_in_flight_loses_nothing(
        rmb in prop::sample::select(vec![16384u32, 65536]),
        ops in prop::collection::vec((0u8..6, 1usize..30000), 1..300),
    ) {
        use std::collections::VecDeque;
        let mut a = Sender {
            core: ConnCore::new(2, rmb, rmb),
            sndbuf: vec![0; rmb as usize],
        };
        let mut b = End {
            core: ConnCore::new(1, rmb, rmb),
            rmb: vec![0; rmb as usize],
        };
        let total = 400_000usize;
        let src: Vec<u8> = (0..total).map(|i| (i * 13 + i / 509) as u8).collect();
        let (mut sent, mut got) = (0usize, Vec::new());
        let (mut to_b, mut to_a) = (VecDeque::new(), VecDeque::<Wire>::new());
        let mut steps = ops.into_iter().cycle();
        let mut guard = 0;
        while got.len() < total {
            guard += 1;
            prop_assert!(guard < 200_000, "no progress");
            let (op, n) = steps.next().unwrap();
            match op {
                // Write what fits: bytes into the send buffer, WRITEs and the CDC on the link.
                0 | 1 => sent = send_some(&mut a, &mut to_b, &src, sent, n),
                // Deliver to b: WRITEs land, CDCs are taken (their completion seen by a).
                2 => {
                    for _ in 0..(n % 7 + 1) {
                        match to_b.pop_front() {
                            Some(Wire::Write(off, bytes)) => {
                                b.rmb[off as usize..off as usize + bytes.len()]
                                    .copy_from_slice(&bytes);
                            }
                            Some(Wire::Cdc(m)) => {
                                b.core.on_cdc(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
                                a.core.cdc_done(m.seq);
                            }
                            None => break,
                        }
                    }
                }
                // b reads; its consumer updates travel back.
                3 => {
                    let k = (n as u32).min(b.core.readable());
                    for (off, len) in b.core.read_pieces(k) {
                        got.extend_from_slice(&b.rmb[off as usize..(off + len) as usize]);
                    }
                    if let Some(c) = b.core.consume(k) {
                        to_a.push_back(Wire::Cdc(c));
                    }
                }
                // Deliver to a.
                4 => {
                    while let Some(Wire::Cdc(m)) = to_a.pop_front() {
                        a.core.on_cdc(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                }
                // The link fails: everything in flight is gone, except maybe part of the
                // first WRITE; both ends move to a new link.
                _ => {
                    if let Some(Wire::Write(off, bytes)) = to_b.front() {
                        let part = n % (bytes.len() + 1);
                        b.rmb[*off as usize..*off as usize + part].copy_from_slice(&bytes[..part]);
                    }
                    to_b.clear();
                    to_a.clear();
                    send_failover_plan(&mut a, &mut to_b);
                    let f = b.core.failover();
                    prop_assert_eq!(f.pieces[0].1 + f.pieces[1].1, 0, "b wrote nothing");
                    to_a.push_back(Wire::Cdc(f.cdc));
                }
            }
            // Keep the stream moving when the ops alone would not.
            if guard % 50 == 0 {
                sent = send_some(&mut a, &mut to_b, &src, sent, 65536);
                while let Some(w) = to_b.pop_front() {
                    match w {
                        Wire::Write(off, bytes) => b.rmb[off as usize..off as usize + bytes.len()]
                            .copy_from_slice(&bytes),
                        Wire::Cdc(m) => {
                            b.core.on_cdc(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
                            a.core.cdc_done(m.seq);
                        }
                    }
                }
                let k = b.core.readable();
                for (off, len) in b.core.read_pieces(k) {
                    got.extend_from_slice(&b.rmb[off as usize..(off + len) as usize]);
                }
                if let Some(c) = b.core.consume(k) {
                    to_a.push_back(Wire::Cdc(c));
                }
                while let Some(Wire::Cdc(m)) = to_a.pop_front() {
                    a.core.on_cdc(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                if a.core.space() == 0 && b.core.readable() == 0 {
                    // Only a lost consumer update can leave the writer without space: the
                    // next failover (or update) frees it.
                    let c = b.core.control_cdc();
                    a.core.on_cdc(&c).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
        }
        prop_assert!(got.len() == total);
        prop_assert!(got == src, "stream differs");
    }
}

#[test]
fn failover_validation_carries_the_sequence_before_the_last_completed_cdc_and_is_not_data() {
    let (mut a, mut b) = pair(65536, 65536);
    let f = a.core.failover();
    assert_eq!(f.validation.seq, 0, "none completed");
    assert_eq!(f.pieces, [(0, 0), (0, 0)]);
    let data = vec![7u8; 1000];
    write(&mut a, &mut b, &data);
    a.core.cdc_done(1);
    a.core.cdc_done(3);
    a.core.cdc_done(2); // completions are reported in order; an older one changes nothing
    let f = a.core.failover();
    assert_eq!(
        f.validation.seq, 2,
        "Linux's number: one before the last completed"
    );
    assert_eq!(f.validation.token, 2);
    assert_eq!(f.validation.prod, Cursor::default());
    assert_eq!(
        f.pieces,
        [(0, 1000), (0, 0)],
        "unconsumed bytes are written again"
    );
    // The validation changes nothing at the receiver, even with a number from the future.
    let before = b.core.cursors();
    let mut v = f.validation;
    v.seq = 500;
    v.prod = Cursor::new(0, 5000);
    assert!(b.core.on_cdc(&v).unwrap().stale);
    assert_eq!(b.core.cursors(), before);
    // The CDC after the rewrite is an ordinary one with the current cursors.
    let up = b.core.on_cdc(&f.cdc).unwrap();
    assert_eq!((up.new_data, up.stale), (0, false));
}

#[test]
fn a_failover_cdc_says_again_that_the_writer_is_blocked() {
    let (mut a, mut b) = pair(16384, 16384);
    // Not blocked: the failover CDC says so.
    write(&mut a, &mut b, &[1u8; 100]);
    assert!(
        !a.core
            .failover()
            .cdc
            .prod_flags
            .contains(ProducerFlags::WRITE_BLOCKED)
    );
    // Blocked (more pending than space): the CDC that said so may be lost with the link, and
    // the peer takes each CDC's flags as the writer's state now.
    write(&mut a, &mut b, &[1u8; 40000]);
    assert_eq!(a.core.space(), 0);
    let f = a.core.failover();
    assert!(f.cdc.prod_flags.contains(ProducerFlags::WRITE_BLOCKED));
    b.core.on_cdc(&f.cdc).unwrap();
    let mut got = vec![];
    assert!(
        read(&mut b, &mut a, 3000, &mut got).is_some(),
        "the reader answers the blocked writer"
    );
}

#[test]
fn linux_state_follows_both_sides_close_flags() {
    use cdc::ConnStateFlags as F;
    let mut c = ConnCore::new(1, 65536, 65536);
    assert_eq!(c.linux_state(false), SmcState::Active);
    assert_eq!(c.linux_state(true), SmcState::ProcessAbort);
    // We shut down writing, then closed.
    let _ = c.shutdown_write();
    assert_eq!(c.linux_state(false), SmcState::PeerCloseWait1);
    let _ = c.close(false);
    assert_eq!(c.linux_state(false), SmcState::PeerCloseWait2);
    // Failed after our close: CLOSED.
    assert_eq!(c.linux_state(true), SmcState::Closed);
    // Numbers and names are Linux's and smcss's.
    assert_eq!(SmcState::PeerCloseWait2 as u8, 21);
    assert_eq!(SmcState::from_code(21), Some(SmcState::PeerCloseWait2));
    assert_eq!(SmcState::from_code(3), None);
    assert_eq!(SmcState::AppFinCloseWait.name(), "APPFINCLW");
    assert_eq!(SmcState::AppFinCloseWait.smcss_name(), "APPFINCLOSEWAIT1");
    assert_eq!(SmcState::PeerCloseWait1.smcss_name(), "PEERCLOSEWAIT1");
    let mut d = ConnCore::new(1, 65536, 65536);
    let _ = d.close_flags(F::PEER_CONN_ABORT);
    assert_eq!(d.linux_state(false), SmcState::PeerAbortWait);
}

#[test]
fn close_aborts_with_unread_data_or_linger_zero_and_only_once() {
    use cdc::ConnStateFlags as F;
    let mut a = ConnCore::new(1, 65536, 65536);
    let cdc = a.close(false).expect("first close");
    assert!(cdc.conn_flags.contains(F::PEER_CONN_CLOSED));
    assert!(!cdc.conn_flags.contains(F::PEER_CONN_ABORT));
    assert!(a.local_closed());
    assert_eq!(a.close(false), None, "closed once");
    // SO_LINGER {on, 0}: an abort, as TCP's RST.
    let mut b = ConnCore::new(1, 65536, 65536);
    assert!(
        b.close(true)
            .unwrap()
            .conn_flags
            .contains(F::PEER_CONN_ABORT)
    );
    // Unread data: an abort too (Linux's smc_close_final).
    let (mut tx, mut rx) = (
        ConnCore::new(2, 65536, 65536),
        ConnCore::new(1, 65536, 65536),
    );
    let plan = tx.prepare_write(10, 10);
    rx.on_cdc(&plan.cdc).unwrap();
    assert_eq!(rx.readable(), 10);
    assert!(
        rx.close(false)
            .unwrap()
            .conn_flags
            .contains(F::PEER_CONN_ABORT)
    );
}

#[test]
fn shutdown_write_once_then_close_and_readiness() {
    use cdc::ConnStateFlags as F;
    let (mut a, mut b) = (
        ConnCore::new(2, 65536, 65536),
        ConnCore::new(1, 65536, 65536),
    );
    let r = b.readiness(false, false, 0);
    assert!(!r.readable && r.writable && !r.rdhup && !r.hup && !r.error);
    let fin = a.shutdown_write().expect("first shutdown");
    assert!(fin.conn_flags.contains(F::PEER_DONE_WRITING));
    assert_eq!(a.shutdown_write(), None);
    b.on_cdc(&fin).unwrap();
    // The peer will send no more: readable (EOF) and RDHUP, not HUP while we may write.
    let r = b.readiness(false, false, 0);
    assert!(r.readable && r.rdhup && !r.hup && r.writable);
    b.shutdown_read();
    assert!(b.shut_rd());
    let _ = b.shutdown_write();
    assert!(b.readiness(false, false, 0).hup);
    // A failure: everything ready, the error once.
    let c = ConnCore::new(1, 65536, 65536);
    let r = c.readiness(true, false, 3);
    assert!(r.readable && r.writable && r.hup && r.error && r.arrivals == 3);
    assert!(!c.readiness(true, true, 3).error, "reported once");
    // Both closed: ours and the peer's.
    let mut d = ConnCore::new(1, 65536, 65536);
    let mut e = ConnCore::new(2, 65536, 65536);
    let _ = d.close(false);
    assert!(!d.both_closed());
    d.on_cdc(&e.close(false).unwrap()).unwrap();
    assert!(d.both_closed());
    assert_eq!(d.linux_state(false), SmcState::Closed);
}

#[test]
fn autocorking_holds_small_writes_while_a_cdc_is_in_flight() {
    let mut c = ConnCore::new(1, 65536, 65536);
    c.staged = 100;
    assert!(!c.corked(1000), "nothing in flight: goes at once");
    assert_eq!(c.take_staged(), 100);
    assert_eq!((c.staged, c.inflight), (0, 1));
    c.staged = 100;
    assert!(c.corked(1000));
    assert!(!c.corked(99), "more than the limit goes");
    assert!(c.cdc_completed(), "completion: the corked bytes go");
    assert_eq!(c.inflight, 0);
    c.staged = 0;
    c.inflight = 1;
    assert!(!c.cdc_completed(), "nothing corked");
}

/// `WritePlan::ack_now`: the peer may hold the ACK of a request (the first data) and of data
/// that follows data from the peer (a conversation); data sent again without hearing back (a
/// stream) and data of a closing connection ask for the ACK at once.
#[test]
fn a_write_asks_for_its_ack_at_once_unless_an_answer_is_likely() {
    let (mut a, mut b) = (
        ConnCore::new(1, 65536, 65536),
        ConnCore::new(2, 65536, 65536),
    );
    let plan = a.prepare_write(10, 10);
    assert!(!plan.ack_now, "a request: its answer carries the ACK");
    b.on_cdc(&plan.cdc).unwrap();
    let plan = a.prepare_write(10, 10);
    assert!(plan.ack_now, "more data without hearing back: a stream");
    b.on_cdc(&plan.cdc).unwrap();
    // B answers: its first data, then a reply to A.
    let answer = b.prepare_write(5, 5);
    assert!(!answer.ack_now);
    a.on_cdc(&answer.cdc).unwrap();
    assert!(!a.prepare_write(10, 10).ack_now, "a conversation");
    // A CDC without new data (a cursor update) is not an answer.
    let update = b.control_cdc();
    a.on_cdc(&update).unwrap();
    assert!(a.prepare_write(10, 10).ack_now);
    let _ = a.shutdown_write();
    a.on_cdc(&b.prepare_write(5, 5).cdc).unwrap();
    assert!(
        a.prepare_write(0, 0).ack_now,
        "closing: nothing will answer"
    );
}
