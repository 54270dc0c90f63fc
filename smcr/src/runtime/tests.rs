//! The link-group and connection drivers over the in-memory device ([`rdma::mem`]): two
//! runtimes of this process, each with a group on its own device of one fabric, driven by
//! their pollers as in a program. No network and no sleep: a request runs when it is posted,
//! and every wait here is for a condition the drivers signal (a group's or a connection's
//! condition variable), bounded by a deadline only a bug reaches. The groups' timers run on a
//! clock the test moves (`clock::Clock::manual`), so a timer's expiry is a step of the test.

use super::*;
use connection::ConnState;
use rdma::mem::Fabric;

/// Only a bug waits this long.
const BUG: Duration = Duration::from_secs(30);

struct Side {
    rt: Runtime,
    lg: Arc<LinkGroup>,
}

fn config() -> RuntimeConfig {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.stats_dir = None;
    cfg.same_host = false;
    cfg
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, 0, last)
}

/// A runtime with a device at `me` on `fabric` and a new group to `peer`.
fn side(fabric: &Arc<Fabric>, me: Ipv4Addr, peer: Ipv4Addr, role: link::Role) -> Side {
    side_with(fabric, (me, peer, role), config(), clock::Clock::default())
}

fn side_with(
    fabric: &Arc<Fabric>,
    (me, peer, role): (Ipv4Addr, Ipv4Addr, link::Role),
    cfg: RuntimeConfig,
    clock: clock::Clock,
) -> Side {
    let alt = cfg.alt_addrs.first().copied();
    let rt = Runtime::with_clock(cfg, clock);
    let o = me.octets();
    let dev = Arc::new(Dev {
        ip: me,
        alt,
        device: Device::open_mem(fabric, me).unwrap(),
        mac: Mac([0x02, 0x00, o[0], o[1], o[2], o[3]]),
    });
    // A second address (a two-path group) is the device's on the fabric too.
    if let Some(a) = alt {
        assert!(fabric.add_address(me, a), "{a} taken");
    }
    rt.inner.devices.lock().insert(me, dev.clone());
    let lg = LinkGroup::create(
        &rt.inner,
        dev,
        role,
        Gid::from_ipv4(peer),
        PeerId([o[3]; 8]),
        QpMtu::MTU_1024,
    )
    .unwrap();
    rt.inner.add_group(lg.clone());
    Side { rt, lg }
}

/// `s`'s end as its CLC message would carry it, with connection `conn` (token and RMB).
fn endpoint(s: &Side, conn: Option<(u32, &MemoryRegion)>) -> handshake::Endpoint {
    let (gid, mac, qpn, initial_psn, mtu) = s.lg.local_endpoint();
    handshake::Endpoint {
        gid,
        mac,
        qpn,
        initial_psn,
        mtu,
        rmb_rkey: conn.map_or(0, |c| c.1.rkey()),
        rmb_vaddr: conn.map_or(0, |c| c.1.addr()),
        rmb_size: clc::RmbSize::DEFAULT,
        token: conn.map_or(0, |c| c.0),
    }
}

fn negotiated() -> handshake::Negotiated {
    handshake::Negotiated {
        version: 2,
        eid: clc::Eid::new(DEFAULT_UEID).unwrap(),
        release: 1,
        max_conns: 255,
        max_links: 1,
        feature_mask: 0,
    }
}

/// Waits on `lg`'s condition until `done`.
fn until(lg: &LinkGroup, what: &str, done: impl Fn(&LinkGroup, &LgState) -> bool) {
    let deadline = Instant::now() + BUG;
    let mut st = lg.st.lock();
    while !done(lg, &st) {
        let timed_out = lg.cond.wait_until(&mut st, deadline).timed_out();
        assert!(!timed_out || done(lg, &st), "{what}: not within {BUG:?}");
    }
}

/// Waits on `c`'s condition until `done`.
fn until_conn(c: &ConnShared, what: &str, done: impl Fn(&ConnState) -> bool) {
    let deadline = Instant::now() + BUG;
    let mut s = c.core.lock();
    while !done(&s) {
        let timed_out = c.cond.wait_until(&mut s, deadline).timed_out();
        assert!(!timed_out || done(&s), "{what}: not within {BUG:?}");
    }
}

/// A client and a server group with their first link up (CONFIRM LINK done), started in the
/// order SMC-R starts them: the client's queue pair is ready when the server's request comes.
fn up(fabric: &Arc<Fabric>) -> (Side, Side) {
    let c = side(fabric, ip(1), ip(2), link::Role::Client);
    let s = side(fabric, ip(2), ip(1), link::Role::Server);
    start(c, s)
}

fn start(c: Side, s: Side) -> (Side, Side) {
    start_links(c, s, 1)
}

/// As [`start`], with `max_links` negotiated.
fn start_links(c: Side, s: Side, max_links: u8) -> (Side, Side) {
    let n = handshake::Negotiated {
        max_links,
        ..negotiated()
    };
    for (x, peer) in [(&c, &s), (&s, &c)] {
        let cfg = &x.rt.inner.cfg;
        x.lg.start(&endpoint(peer, None), QpMtu::MTU_1024, &n, cfg)
            .unwrap();
    }
    for x in [&c, &s] {
        until(&x.lg, "link up", |lg, st| st.g.is_up() || lg.is_down());
        assert!(x.lg.is_up(), "{:?}", x.lg.st.lock().g.down());
    }
    (c, s)
}

/// A connection on each side, as the CLC exchange sets them up: each with an RMB of the
/// default size and a send buffer as large as the peer's.
fn connect(c: &Side, s: &Side) -> (Arc<ConnShared>, Arc<ConnShared>) {
    let size = clc::RmbSize::DEFAULT.bytes();
    let (tc, ts) = (c.rt.inner.token(), s.rt.inner.token());
    let (rmb_c, rmb_s) = (c.lg.take_rmb(size).unwrap(), s.lg.take_rmb(size).unwrap());
    let (snd_c, snd_s) = (
        c.lg.take_sndbuf(size).unwrap(),
        s.lg.take_sndbuf(size).unwrap(),
    );
    let (ep_c, ep_s) = (
        endpoint(c, Some((tc, &rmb_c))),
        endpoint(s, Some((ts, &rmb_s))),
    );
    let cc = ConnShared::new(&c.lg, tc, rmb_c, snd_c, &ep_s);
    let cs = ConnShared::new(&s.lg, ts, rmb_s, snd_s, &ep_c);
    for (x, conn, t) in [(c, &cc, tc), (s, &cs, ts)] {
        x.lg.reserve(t);
        x.lg.attach(t, conn.clone(), None);
    }
    (cc, cs)
}

/// Writes all of `data` as the stream's `write` does (staged into the send buffer, then an
/// RDMA WRITE and a CDC), waiting for room in the peer's RMB as the stream does: as the
/// group's blocking driver when no other thread is, taking its completions itself.
fn write_all(c: &ConnShared, lg: &Arc<LinkGroup>, mut data: &[u8]) {
    let deadline = Instant::now() + BUG;
    let mut s = c.core.lock();
    while !data.is_empty() {
        assert!(s.failed.is_none(), "{:?}", s.failed);
        let avail = s.core.space().saturating_sub(s.core.staged());
        if avail == 0 {
            c.wait(lg, &mut s, false, Some(deadline)).expect("room");
            continue;
        }
        let n = avail.min(data.len() as u32);
        let mut at = 0;
        for (off, len) in s.core.stage_pieces(s.core.staged(), n) {
            c.sndbuf.write(off as usize, &data[at..at + len as usize]);
            at += len as usize;
        }
        s.core.stage(n);
        let pending = s.core.staged();
        c.flush_locked(&mut s, lg, pending, false).unwrap();
        data = &data[n as usize..];
    }
}

/// Reads `n` bytes as the stream's `read` does (out of the RMB, then a CDC with the new
/// consumer cursor when the peer needs room), waiting as the stream does.
fn read_exact(c: &ConnShared, lg: &Arc<LinkGroup>, n: usize) -> Vec<u8> {
    let deadline = Instant::now() + BUG;
    let mut out = Vec::with_capacity(n);
    let mut s = c.core.lock();
    while out.len() < n {
        assert!(s.failed.is_none(), "{:?}", s.failed);
        if s.core.readable() == 0 {
            c.wait(lg, &mut s, false, Some(deadline)).expect("data");
            continue;
        }
        let k = s.core.readable().min((n - out.len()) as u32);
        for (off, len) in s.core.read_pieces(k) {
            let at = out.len();
            out.resize(at + len as usize, 0);
            c.rmb.read(off as usize, &mut out[at..]);
        }
        if let Some(cdc) = s.core.consume(k) {
            c.send_ctl(&mut s, lg, &cdc, false).unwrap();
        }
    }
    out
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn the_first_link_comes_up_with_confirm_link() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    for x in [&c, &s] {
        assert_eq!(x.rt.links_confirmed(), 1);
        assert_eq!(x.rt.group_links(), [1]);
        assert!(
            x.lg.qp().summary().starts_with("mem "),
            "{}",
            x.lg.qp().summary()
        );
    }
}

#[test]
fn bytes_cross_in_both_directions_through_rmbs_smaller_than_the_stream() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let (cc, cs) = connect(&c, &s);
    // Four RMBs' worth each way: the writer waits for the reader's consumer updates.
    let len = 4 * clc::RmbSize::DEFAULT.bytes() as usize + 1234;
    let (up_data, down_data) = (pattern(len, 1), pattern(len, 2));
    let reader = {
        let (cs, lg) = (cs.clone(), s.lg.clone());
        std::thread::spawn(move || read_exact(&cs, &lg, len))
    };
    write_all(&cc, &c.lg, &up_data);
    assert!(reader.join().unwrap() == up_data, "client to server");
    let reader = {
        let (cc, lg) = (cc.clone(), c.lg.clone());
        std::thread::spawn(move || read_exact(&cc, &lg, len))
    };
    write_all(&cs, &s.lg, &down_data);
    assert!(reader.join().unwrap() == down_data, "server to client");
    let st = cc.core.lock().stats;
    assert_eq!(st.bytes_sent, len as u64);
    assert!(st.data_cdcs >= 5, "{st:?}");
}

#[test]
fn a_later_rmb_is_announced_with_confirm_rkey() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let rmb = c.lg.take_rmb(clc::RmbSize::DEFAULT.bytes()).unwrap();
    c.lg.confirm_rkey(&rmb).unwrap();
    assert_eq!(c.rt.rkey_requests(), 1);
    // The server learned the key: it reaches the RMB with it on its (only) link.
    let mut peer = crate::rtokens::PeerRmb {
        vaddr: rmb.addr(),
        rkey: rmb.rkey(),
        path: 0,
    };
    assert_eq!(s.lg.peer_rmb(&mut peer, 0), (rmb.addr(), rmb.rkey()));
}

#[test]
fn a_peer_that_deletes_the_group_fails_its_connections_with_the_reason() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let (cc, _cs) = connect(&c, &s);
    s.lg.terminate();
    until(&c.lg, "group down", |lg, _| lg.is_down());
    let why = c.lg.st.lock().g.down().cloned().unwrap();
    // Deleting a group is DELETE LINK with the "delete all" flag, for a program's end.
    assert!(
        matches!(
            why,
            GroupDown::Link(link::DownReason::PeerDeletedGroup(
                llc::DeleteLinkReason::PROG_INIT_TERM
            ))
        ),
        "{why}"
    );
    assert!(why.orderly());
    until_conn(&cc, "connection failed", |s| s.failed.is_some());
    let failed = cc.core.lock().failed.clone().unwrap();
    assert!(failed.to_string().contains("DELETE LINK"), "{failed}");
}

#[test]
fn a_write_to_a_wrong_rkey_fails_the_link_not_the_process() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let (cc, cs) = connect(&c, &s);
    // A peer that announced a key it does not have: the WRITE is refused by its device.
    cc.core.lock().peer.rkey ^= 0x5a00;
    let mut g = cc.core.lock();
    g.core.stage(100);
    let staged = g.core.staged();
    let _ = cc.flush_locked(&mut g, &c.lg, staged, false);
    drop(g);
    for x in [&c, &s] {
        until(&x.lg, "group down", |lg, _| lg.is_down());
    }
    let why = c.lg.st.lock().g.down().cloned().unwrap();
    assert!(why.to_string().contains("RDMA transport failed"), "{why}");
    for conn in [&cc, &cs] {
        until_conn(conn, "connection failed", |s| s.failed.is_some());
    }
    // The runtime carries on: a new group on a new pair of devices comes up.
    let fabric2 = Fabric::new();
    up(&fabric2);
}

#[test]
fn an_orderly_close_releases_both_ends_and_their_buffers_go_back_to_the_pools() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let (cc, cs) = connect(&c, &s);
    write_all(&cc, &c.lg, b"last words");
    cc.close(&c.lg, || false);
    // The server reads what came before the close, then sees it.
    assert_eq!(read_exact(&cs, &s.lg, 10), b"last words");
    until_conn(&cs, "peer closed", |s| {
        s.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_CLOSED)
    });
    cs.close(&s.lg, || false);
    for (x, conn) in [(&c, &cc), (&s, &cs)] {
        until(&x.lg, "connection detached", |_, st| st.g.conns.is_empty());
        assert!(conn.core.lock().released);
        assert!(conn.core.lock().failed.is_none());
        // The RMB and send buffer wait in the pools for the group's next connection.
        let st = x.lg.st.lock();
        assert_eq!((st.rmb_pool.len(), st.sndbuf_pool.len()), (1, 1));
    }
    // The group lingers, up, for later connections.
    assert!(c.lg.is_up() && s.lg.is_up());
}

#[test]
fn closing_with_unread_data_aborts_and_the_peer_sees_a_reset() {
    let fabric = Fabric::new();
    let (c, s) = up(&fabric);
    let (cc, cs) = connect(&c, &s);
    write_all(&cs, &s.lg, b"never read");
    until_conn(&cc, "data", |s| s.core.readable() == 10);
    cc.close(&c.lg, || false);
    until_conn(&cs, "abort", |s| {
        s.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_ABORT)
    });
    let mut g = cs.core.lock();
    let e = g.take_reset().expect("a reset to report");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    assert!(g.take_reset().is_none(), "reported once");
}

/// Both groups on `clock`, configured by `tune` (client, server).
fn up_on(
    fabric: &Arc<Fabric>,
    clock: &clock::Clock,
    tune: impl Fn(&mut RuntimeConfig, link::Role),
) -> (Side, Side) {
    let mut sides = [link::Role::Client, link::Role::Server].map(|role| {
        let mut cfg = config();
        tune(&mut cfg, role);
        let (me, peer) = match role {
            link::Role::Client => (ip(1), ip(2)),
            link::Role::Server => (ip(2), ip(1)),
        };
        Some(side_with(fabric, (me, peer, role), cfg, clock.clone()))
    });
    start(sides[0].take().unwrap(), sides[1].take().unwrap())
}

/// Runs what is due on the group's clock, and handles what its queue holds, on this thread
/// under the group's driver lock, as its poller would (after the poller's batch, if it is
/// handling one).
fn tick(x: &Side) {
    {
        let _driver = x.lg.drive.driver.lock();
        x.lg.handle(&[]);
    }
    x.lg.handle_queued();
}

#[test]
fn test_link_keeps_an_idle_link_up_and_one_unanswered_ends_it() {
    let fabric = Fabric::new();
    let clock = clock::Clock::manual();
    // Only the client probes; neither side lingers out during the test.
    let (c, s) = up_on(&fabric, &clock, |cfg, role| {
        cfg.linger = Duration::from_secs(3600);
        if role == link::Role::Server {
            cfg.test_link_time = None;
        }
    });
    let idle = c.rt.inner.cfg.test_link_time.expect("on by default");
    // Idle for the keepalive time: the client asks, the server answers.
    clock.advance(idle);
    tick(&c);
    assert_eq!(c.lg.test_links_sent(), 1);
    tick(&s);
    tick(&c);
    clock.advance(link::LLC_WAIT * 2);
    tick(&c);
    assert!(c.lg.is_up() && s.lg.is_up());
    // The server stops taking its completions (a driver that never comes back): the next
    // request goes unanswered, and the client's link ends after the LLC wait, not before.
    s.lg.drive.sched.begin_drive();
    clock.advance(idle);
    tick(&c);
    assert_eq!(c.lg.test_links_sent(), 2);
    clock.advance(link::LLC_WAIT - Duration::from_millis(1));
    tick(&c);
    assert!(c.lg.is_up(), "{:?}", c.lg.st.lock().g.down());
    clock.advance(Duration::from_millis(2));
    tick(&c);
    until(&c.lg, "group down", |lg, _| lg.is_down());
    let why = c.lg.st.lock().g.down().cloned().unwrap();
    assert!(
        matches!(why, GroupDown::Link(link::DownReason::TestLinkTimeout(_))),
        "{why}"
    );
    s.lg.drive.sched.end_drive();
}

#[test]
fn an_idle_group_is_deleted_after_its_linger_and_a_busy_one_is_not() {
    let fabric = Fabric::new();
    let clock = clock::Clock::manual();
    let linger = Duration::from_secs(10);
    let (c, s) = up_on(&fabric, &clock, |cfg, _| {
        cfg.linger = linger;
        cfg.test_link_time = None;
    });
    // A connection keeps the group however long it lasts.
    let (cc, cs) = connect(&c, &s);
    clock.advance(linger * 3);
    tick(&c);
    tick(&s);
    assert!(c.lg.is_up() && s.lg.is_up());
    // Closed on both sides: the linger starts then.
    cc.close(&c.lg, || false);
    until_conn(&cs, "peer closed", |s| {
        s.core
            .peer_flags()
            .contains(ConnStateFlags::PEER_CONN_CLOSED)
    });
    cs.close(&s.lg, || false);
    until(&c.lg, "released", |_, st| st.g.conns.is_empty());
    clock.advance(linger - Duration::from_millis(1));
    tick(&c);
    assert!(c.lg.is_up());
    clock.advance(Duration::from_millis(2));
    tick(&c);
    for x in [&c, &s] {
        until(&x.lg, "group deleted", |lg, _| lg.is_down());
        let why = x.lg.st.lock().g.down().cloned().unwrap();
        assert!(why.orderly(), "{why}");
    }
}

/// Whether `fd` (an eventfd) is readable within `ms` milliseconds.
fn signalled(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut p = [PollFd::new(&fd, PollFlags::IN)];
    let t = Timespec {
        tv_sec: i64::from(ms / 1000),
        tv_nsec: i64::from(ms % 1000) * 1_000_000,
    };
    poll(&mut p, Some(&t)).unwrap() == 1
}

/// An event loop's wait (`sleep_begin`, its own poll on the group's descriptor, `sleep_end`)
/// handles what woke it before its drive ends. A drive that ended with it still queued would
/// signal the descriptor again, and the loop's next wait would return at once for nothing: a
/// system call and a pass of the loop per message of a busy stream.
#[test]
fn an_event_loop_wait_handles_what_woke_it_and_leaves_no_signal_behind() {
    let fabric = Fabric::new();
    // No timer falls due: the pollers never take the driver lock meanwhile.
    let clock = clock::Clock::manual();
    let (c, s) = up_on(&fabric, &clock, |_, _| {});
    let (cc, cs) = connect(&c, &s);
    let fd = s.lg.event_fd();
    for round in 0..5u8 {
        // (A completion still queued from before is handled, and the wait starts again.)
        let mut tries = 0;
        while !s.lg.sleep_begin(false) {
            tries += 1;
            assert!(tries < 100, "the group never goes to sleep");
        }
        // A batch the poller took before the group was driven ends first; from then on it
        // leaves the driver lock alone (driven, no timer due), so the wait's handling gets it.
        drop(s.lg.drive.driver.lock());
        write_all(&cc, &c.lg, &pattern(100, round));
        assert!(
            signalled(fd, 30_000),
            "round {round}: the CDC woke the loop"
        );
        let mut b = [0u8; 8];
        let _ = rustix::io::read(fd, &mut b);
        s.lg.sleep_end(Duration::ZERO, true);
        assert_eq!(
            cs.core.lock().core.readable(),
            100,
            "round {round}: handled"
        );
        assert!(
            !signalled(fd, 0),
            "round {round}: the descriptor signalled for what the wait handled"
        );
        assert_eq!(read_exact(&cs, &s.lg, 100), pattern(100, round));
    }
}

/// Whether the group's poller sleeps past `beyond` from now (its next look at the hold).
fn poller_sleeps_past(lg: &LinkGroup, beyond: Duration) -> bool {
    lg.drive
        .hold
        .lock()
        .poller_until
        .is_some_and(|t| t > Instant::now() + beyond)
}

/// Waits until the group's poller is idle: the group not held, the poller on its long timer.
fn until_the_poller_idles(lg: &LinkGroup) {
    let deadline = Instant::now() + BUG;
    while lg.drive.hold.lock().held || !poller_sleeps_past(lg, Duration::from_secs(5)) {
        assert!(Instant::now() < deadline, "the poller never idles");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The server holds its group for 2 s after a wait (1 ms by default): the poller's watch of
/// the hold, which the tests look for, then lasts that long instead of a millisecond that a
/// loaded machine's test thread can sleep through (the poller takes the group back and goes
/// to its long timer again).
fn long_hold(cfg: &mut RuntimeConfig, role: link::Role) {
    if role == link::Role::Server {
        cfg.app_hold = Duration::from_secs(2);
    }
}

/// Waits until the poller looks at the hold again (it no longer sleeps past `beyond`). A kick
/// is immediate: seconds are for a slow machine.
fn until_the_poller_watches(lg: &LinkGroup, beyond: Duration, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while poller_sleeps_past(lg, beyond) {
        assert!(
            Instant::now() < deadline,
            "{what}: the poller still sleeps on its long timer"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A wait that takes the hold while the poller sleeps on its long timer (the group was not
/// held), and whose spin catches something, makes the poller look at the hold again: that
/// return has no `hold_woke`. Otherwise a holder that does not come back to the group — its
/// next wait is on other descriptors — leaves what arrives next unhandled until that timer
/// (30 s): a Python client lost an echo that way in the leak test.
#[test]
fn a_wait_that_takes_the_hold_and_catches_something_wakes_a_poller_on_its_long_timer() {
    let fabric = Fabric::new();
    // No timer falls due: the poller's long timer is the one of an idle group.
    let clock = clock::Clock::manual();
    let (c, s) = up_on(&fabric, &clock, long_hold);
    let (cc, cs) = connect(&c, &s);
    until_the_poller_idles(&s.lg);
    // Driven meanwhile, the group's arrivals signal only the driver descriptor: the CDC
    // waits for the wait's spin, and the poller is not woken for it.
    s.lg.drive.sched.begin_drive();
    write_all(&cc, &c.lg, &pattern(100, 7));
    assert!(signalled(s.lg.event_fd(), 30_000), "the CDC arrived");
    assert!(!s.lg.sleep_begin(false), "the spin caught the CDC");
    assert_eq!(cs.core.lock().core.readable(), 100, "handled by the wait");
    until_the_poller_watches(
        &s.lg,
        s.lg.drive.hold_for + Duration::from_secs(1),
        "caught",
    );
    s.lg.drive.sched.end_drive();
    assert_eq!(read_exact(&cs, &s.lg, 100), pattern(100, 7));
}

/// A wait that takes the hold and sleeps leaves the poller on its long timer (the holder is
/// signalled for arrivals itself; waking the poller as the loop goes to sleep costs a
/// scheduler slice beside busy threads) and makes it look at the hold when it wakes.
#[test]
fn a_wait_that_takes_the_hold_and_sleeps_wakes_a_poller_on_its_long_timer_when_it_wakes() {
    let fabric = Fabric::new();
    let clock = clock::Clock::manual();
    let (_c, s) = up_on(&fabric, &clock, long_hold);
    until_the_poller_idles(&s.lg);
    assert!(s.lg.sleep_begin(false), "nothing arrived: the loop sleeps");
    // (A kick clears `poller_until` at once, under the hold's lock.)
    assert!(
        poller_sleeps_past(&s.lg, Duration::from_secs(5)),
        "the poller was woken as the loop went to sleep"
    );
    s.lg.sleep_end(Duration::ZERO, false);
    // Back from its sleep with the hold, the holder may go elsewhere: the poller watches.
    until_the_poller_watches(&s.lg, s.lg.drive.hold_for + Duration::from_secs(1), "woke");
}

/// A client and a server group with two paths each (second addresses on the fabric), both
/// links up, on `clock`; no TEST LINK, no linger.
fn two_links(fabric: &Arc<Fabric>, clock: &clock::Clock) -> (Side, Side) {
    let [c, s] = [
        (ip(1), ip(2), ip(11), link::Role::Client),
        (ip(2), ip(1), ip(12), link::Role::Server),
    ]
    .map(|(me, peer, alt, role)| {
        let mut cfg = config();
        cfg.linger = Duration::from_secs(3600);
        cfg.test_link_time = None;
        cfg.alt_addrs = vec![alt];
        side_with(fabric, (me, peer, role), cfg, clock.clone())
    });
    let (c, s) = start_links(c, s, 2);
    for x in [&c, &s] {
        until(&x.lg, "second link up", |_, st| st.g.spare_up());
    }
    (c, s)
}

#[test]
fn a_long_llc_message_holds_its_paths_buffer_until_its_send_completes() {
    let fabric = Fabric::new();
    let clock = clock::Clock::manual();
    let (c, s) = two_links(&fabric, &clock);
    // Two TEST LINK requests padded past a slot (the peer reads a TEST LINK's head only).
    let m = llc::LlcMessage {
        version: llc::Version::V2,
        body: llc::Llc::TestLink(llc::TestLink {
            response: false,
            user_data: [7; 16],
        }),
    };
    let mut long = vec![0u8; 300];
    m.emit(&mut long[..m.buffer_len()]);
    let path = c.lg.active();
    // A slot and the post, under the group's lock as the driver posts.
    let post = || {
        let st = &mut *c.lg.st.lock();
        let Slot::Got(slot) = st.g.conns.take_slot(true) else {
            panic!("no slot")
        };
        (slot, c.lg.post_long_llc(path, slot, &long))
    };
    c.lg.dev.device.defer_sends(true);
    post().1.unwrap();
    let (second, busy) = post();
    assert_eq!(busy.unwrap_err().kind(), io::ErrorKind::WouldBlock);
    c.lg.put_back(second);
    // Sent and completed: the buffer is free for the next one; the link stays up.
    c.lg.dev.device.defer_sends(false);
    until(&c.lg, "first SEND completed", |lg, _| {
        lg.paths[path].big_tx_slot.load(Ordering::Acquire) == 0
    });
    post().1.unwrap();
    until(&c.lg, "third SEND completed", |lg, _| {
        lg.paths[path].big_tx_slot.load(Ordering::Acquire) == 0
    });
    for x in [&c, &s] {
        assert!(
            x.lg.is_up() && x.lg.links() == 2,
            "{:?}",
            x.lg.st.lock().g.down()
        );
    }
}

/// A device that reads a request's memory when it sends it (every verbs device; rxe from a
/// work queue, after `ibv_post_send` returned) got an ADD LINK whose rkey list, beyond its
/// SEND slot, sat in a buffer deregistered right after posting: the request failed
/// (`LOC_PROT_ERR`, rxe reports a flush) and with it the active link and the group, at a
/// heal's ADD LINK with more RMBs than one slot holds.
#[test]
fn an_add_link_longer_than_a_slot_survives_a_device_that_reads_it_late() {
    let fabric = Fabric::new();
    let clock = clock::Clock::manual();
    let (c, s) = two_links(&fabric, &clock);
    // Eight connections: ADD LINK then lists more rkeys than one SEND slot holds.
    let conns: Vec<_> = (0..8).map(|_| connect(&c, &s)).collect();
    // The server's spare fails; it heals after its wait, with the long ADD LINK.
    {
        let mut st = s.lg.st.lock();
        let spare = 1 - st.g.route().1;
        st.g.transport_failed(spare, "test");
    }
    tick(&s);
    for x in [&c, &s] {
        until(&x.lg, "second link gone", |_, st| !st.g.spare_up());
    }
    s.lg.dev.device.defer_sends(true);
    clock.advance(smcr_proto::group::HEAL_MAX);
    tick(&s);
    assert!(s.lg.dev.device.deferred_sends() >= 1, "ADD LINK posted");
    s.lg.dev.device.defer_sends(false);
    for x in [&s, &c] {
        until(&x.lg, "second link up again", |lg, st| {
            st.g.spare_up() || lg.is_down()
        });
        assert!(x.lg.is_up(), "{:?}", x.lg.st.lock().g.down());
        assert_eq!(x.lg.links(), 2);
    }
    // Every connection still carries data, over the active link.
    for (i, (cc, cs)) in conns.iter().enumerate() {
        let data = pattern(1000, i as u8);
        write_all(cc, &c.lg, &data);
        assert_eq!(read_exact(cs, &s.lg, data.len()), data);
    }
}
