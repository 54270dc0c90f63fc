//! Issue 8, faults on the wire: two network namespaces joined by veth; loss, duplication and
//! corruption made by nftables on the veth (this kernel has no netem), reordering and delay by
//! the engine's own fault injector. Under each, many connections and one large transfer
//! arrive intact (every byte checked against a pattern, both directions), and no reader waits
//! longer than the transport's timers allow.
//!
//! Sizes: CI moves 64 connections × 1 MiB and one 64 MiB transfer per case;
//! `SMCR_FAULT_FULL=1` moves the 64 × 16 MiB and 1 GiB (docs/reliability.md has the
//! results: every case passes at those sizes too).

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    NetPair, TestInstall, check_pattern, have_tool, in_netns, nft, privileged, send_pattern,
};
use smcr::{FaultConfig, Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

/// The longest a reader may wait for the next bytes. The transport retransmits after ~134 ms
/// (with backoff when the retransmission is lost too); with 5% loss in each direction a few
/// losses in a row happen, and the delay case adds its 20–25 ms each way. Far below the link's
/// probe and keepalive times: a stall this long means something waited for a timer it should
/// not have needed.
const MAX_STALL: Duration = Duration::from_secs(3);

/// `icrc_always`: the engines check every packet's ICRC, also from each other
/// (`SMCR_RDMA_ICRC=always`; by default two of our engines leave it out).
fn runtime(install: &TestInstall, faults: Option<FaultConfig>, icrc_always: bool) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.rdma_icrc_always = icrc_always;
    cfg.negotiation = Negotiation::TcpOption {
        dir: install.0.clone(),
    };
    cfg.faults = faults;
    // Two namespaces stand for two hosts: the RoCE path (not shared memory through the
    // host-wide rendezvous).
    cfg.same_host = false;
    Runtime::new(cfg)
}

struct Sizes {
    conns: u64,
    each: u64,
    big: u64,
}

fn sizes() -> Sizes {
    if std::env::var("SMCR_FAULT_FULL").as_deref() == Ok("1") {
        Sizes {
            conns: 64,
            each: 16 << 20,
            big: 1 << 30,
        }
    } else {
        Sizes {
            conns: 64,
            each: 1 << 20,
            big: 64 << 20,
        }
    }
}

/// What one case saw.
struct Outcome {
    bytes: u64,
    secs: f64,
    longest_wait: Duration,
    client: smcr::DeviceStats,
    server: smcr::DeviceStats,
}

impl Outcome {
    /// The longest either side's link waited for an acknowledgement.
    fn longest_stall(&self) -> Duration {
        Duration::from_micros(
            self.client
                .rc_longest_stall_us
                .max(self.server.rc_longest_stall_us),
        )
    }
}

fn stats_of(rt: &Runtime) -> smcr::DeviceStats {
    rt.device_stats()
        .into_iter()
        .map(|(_, s)| s)
        .next()
        .unwrap_or_default()
}

/// Every client connection sends its stream to the server, which checks it, answers with the
/// count and sends a stream back (1 MiB) that the client checks. The last connection is the
/// big one.
fn transfer(
    net: &NetPair,
    install: &TestInstall,
    port: u16,
    faults: Option<FaultConfig>,
) -> Outcome {
    transfer_with(net, install, port, faults, false)
}

fn transfer_with(
    net: &NetPair,
    install: &TestInstall,
    port: u16,
    faults: Option<FaultConfig>,
    icrc_always: bool,
) -> Outcome {
    let sz = sizes();
    let addr: SocketAddr = (net.addr_b, port).into();
    let (tx, rx) = mpsc::channel();
    let conns = sz.conns;
    let server = {
        let rt = runtime(install, faults, icrc_always);
        in_netns(&net.b, move || {
            let l = SmcListener::bind(&rt, addr).unwrap();
            tx.send(()).unwrap();
            let mut handles = Vec::new();
            for _ in 0..conns + 1 {
                let (mut s, _) = l.accept().unwrap();
                assert!(
                    matches!(s.mode(), Mode::SmcR { .. }),
                    "{:?} (server: {:?})",
                    s.mode(),
                    rt.problem()
                );
                handles.push(std::thread::spawn(move || {
                    let mut seed = [0u8; 8];
                    s.read_exact(&mut seed).unwrap();
                    let seed = u64::from_le_bytes(seed);
                    let (got, longest) = check_pattern(&mut s, seed);
                    s.write_all(&got.to_le_bytes()).unwrap();
                    send_pattern(&mut s, !seed, 1 << 20);
                    (got, longest)
                }));
            }
            let mut total = 0;
            let mut longest = Duration::ZERO;
            for h in handles {
                let (got, l) = h.join().unwrap();
                total += got;
                longest = longest.max(l);
            }
            let stats = stats_of(&rt);
            rt.shutdown();
            (total, longest, stats)
        })
    };
    rx.recv().unwrap();
    let rt = runtime(install, faults, icrc_always);
    let (each, big) = (sz.each, sz.big);
    let client = in_netns(&net.a, move || {
        let t0 = Instant::now();
        let mut handles = Vec::new();
        for i in 0..conns + 1 {
            let rt = rt.clone();
            handles.push(std::thread::spawn(move || {
                let (seed, total) = if i == conns { (999, big) } else { (i, each) };
                let mut c = SmcStream::connect(&rt, addr).unwrap();
                assert!(
                    matches!(c.mode(), Mode::SmcR { .. }),
                    "{:?} (client: {:?})",
                    c.mode(),
                    rt.problem()
                );
                c.write_all(&seed.to_le_bytes()).unwrap();
                send_pattern(&mut c, seed, total);
                let mut got = [0u8; 8];
                c.read_exact(&mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), total, "seed {seed}: count");
                let (back, longest) = check_pattern(&mut c, !seed);
                assert_eq!(back, 1 << 20, "seed {seed}: stream back");
                (total, longest)
            }));
        }
        let mut sum = 0;
        let mut longest = Duration::ZERO;
        for h in handles {
            let (n, l) = h.join().unwrap();
            sum += n;
            longest = longest.max(l);
        }
        let secs = t0.elapsed().as_secs_f64();
        let stats = stats_of(&rt);
        rt.shutdown();
        (sum, secs, longest, stats)
    });
    let (sent, secs, client_wait, client) = client.join().unwrap();
    let (received, server_wait, server) = server.join().unwrap();
    assert_eq!(sent, sz.conns * sz.each + sz.big);
    assert_eq!(received, sent, "bytes the server checked");
    Outcome {
        bytes: received,
        secs,
        longest_wait: client_wait.max(server_wait),
        client,
        server,
    }
}

/// Packets the rule in `ns` matched (its counter).
fn nft_matched(ns: &str) -> u64 {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "nft",
            "list",
            "table",
            "netdev",
            "smcr_fault",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A rule on each side's veth, for RoCE packets: `hook` is ingress or egress, `stmt` what
/// it does to them.
fn on_both(net: &NetPair, hook: &str, stmt: &str) {
    for (ns, dev) in [(&net.a, &net.veth_a), (&net.b, &net.veth_b)] {
        let stmt = stmt.replace("DEV", dev);
        nft(
            ns,
            &format!(
                "table netdev smcr_fault {{ chain c {{ type filter hook {hook} device \"{dev}\" priority 0; udp dport 4791 {stmt}; }}; }}"
            ),
        );
    }
}

/// The transport's recovery counters of both ends.
fn counts(o: &Outcome) -> String {
    let (c, s) = (&o.client, &o.server);
    format!(
        "{} NAKs, {} resent, {} probes, {} timeouts, {} kept ahead of a gap",
        c.tx_naks + s.tx_naks,
        c.tx_retransmits + s.tx_retransmits,
        c.rc_probes + s.rc_probes,
        c.rc_timeouts + s.rc_timeouts,
        c.rx_reordered + s.rx_reordered
    )
}

fn report(case: &str, o: &Outcome, note: &str) {
    eprintln!(
        "{case}: {} MiB intact in {:.2} s ({:.2} Gbit/s), longest wait for a read {:?}, \
         for an ACK {:?}; client tx {} rx {} icrc-errors {}, server tx {} rx {} icrc-errors \
         {}{note}",
        o.bytes >> 20,
        o.secs,
        o.bytes as f64 * 8.0 / o.secs / 1e9,
        o.longest_wait,
        o.longest_stall(),
        o.client.tx_packets,
        o.client.rx_packets,
        o.client.rx_icrc_errors,
        o.server.tx_packets,
        o.server.rx_packets,
        o.server.rx_icrc_errors,
    );
    assert!(
        o.longest_wait < MAX_STALL,
        "{case}: a reader waited {:?}",
        o.longest_wait
    );
}

/// One case at a time: the longest wait is measured, and two cases sharing the CPUs would
/// measure each other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup(test: &str) -> Option<(std::sync::MutexGuard<'static, ()>, TestInstall, NetPair)> {
    if !privileged(test) || !have_tool(test, "nft") {
        return None;
    }
    let turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    Some((turn, TestInstall::new(test), NetPair::new().unwrap()))
}

#[test]
fn one_percent_loss() {
    let Some((_turn, install, net)) = setup("loss1") else {
        return;
    };
    on_both(&net, "ingress", "numgen random mod 100 < 1 counter drop");
    let o = transfer(&net, &install, 7500, None);
    let dropped = nft_matched(&net.a) + nft_matched(&net.b);
    report(
        "1% loss",
        &o,
        &format!("; {dropped} packets dropped; {}", counts(&o)),
    );
    assert!(dropped > 0, "the rule dropped nothing");
}

#[test]
fn five_percent_loss() {
    let Some((_turn, install, net)) = setup("loss5") else {
        return;
    };
    on_both(&net, "ingress", "numgen random mod 100 < 5 counter drop");
    let o = transfer(&net, &install, 7501, None);
    let dropped = nft_matched(&net.a) + nft_matched(&net.b);
    report(
        "5% loss",
        &o,
        &format!("; {dropped} packets dropped; {}", counts(&o)),
    );
    assert!(dropped > 0, "the rule dropped nothing");
}

#[test]
fn duplication() {
    let Some((_turn, install, net)) = setup("dup") else {
        return;
    };
    // The copy leaves through the same device without passing the egress hook again.
    on_both(
        &net,
        "egress",
        "numgen random mod 100 < 3 counter dup to \"DEV\"",
    );
    let o = transfer(&net, &install, 7502, None);
    let duplicated = nft_matched(&net.a) + nft_matched(&net.b);
    report(
        "3% duplication",
        &o,
        &format!("; {duplicated} packets duplicated"),
    );
    assert!(duplicated > 0, "the rule duplicated nothing");
}

#[test]
fn corruption_is_caught_by_the_icrc() {
    let Some((_turn, install, net)) = setup("corrupt") else {
        return;
    };
    // Byte 24 of the UDP payload's packet (after the 8-byte UDP header: BTH 12 bytes, then
    // the RETH, the payload or, in an ACK, the AETH and ICRC): a field the ICRC covers in
    // every packet. Veth delivers without checking the UDP checksum, as a NIC that offloads
    // it would not catch a corruption past its own check either: the ICRC must.
    on_both(
        &net,
        "ingress",
        "numgen random mod 100 < 1 counter @th,192,8 set 0x5a",
    );
    // Two of our engines leave the ICRC out by default (the UDP checksum covers what TCP's
    // covers; a corruption past the NIC's check is caught by neither): checked on request.
    let o = transfer_with(&net, &install, 7503, None, true);
    let rewritten = nft_matched(&net.a) + nft_matched(&net.b);
    report(
        "1% corruption",
        &o,
        &format!("; {rewritten} packets rewritten"),
    );
    assert!(rewritten > 0, "the rule rewrote nothing");
    assert!(
        o.client.rx_icrc_errors + o.server.rx_icrc_errors > 0,
        "no corrupted packet was caught by the ICRC"
    );
}

/// Reordering by the engine's fault injector: `share` of the packets each side sends are held
/// back up to `delay`. The same transfer first runs without faults, in the same test, so the
/// goodput is compared like with like on whatever machine this is. That run goes through the
/// injector too (with a share too small to hold any packet back): the injector sends packet
/// by packet, without GSO, which alone costs about two thirds of the goodput here — the
/// measure of what reordering costs is the run that differs from it only by the reordering.
/// Returns the faulty run and its goodput as a share of the clean one.
fn reordered(
    net: &NetPair,
    install: &TestInstall,
    port: u16,
    case: &str,
    (share, delay, seed): (f64, Duration, u64),
) -> (Outcome, f64) {
    let f = FaultConfig {
        reorder: share,
        reorder_delay: delay,
        seed,
        ..FaultConfig::default()
    };
    let through = FaultConfig {
        reorder: f64::MIN_POSITIVE,
        ..f
    };
    let clean = transfer(net, install, port, Some(through));
    let o = transfer(net, install, port + 1, Some(f));
    let ratio = (o.bytes as f64 / o.secs) / (clean.bytes as f64 / clean.secs);
    let kept = o.client.rx_reordered + o.server.rx_reordered;
    let naks = o.client.tx_naks + o.server.tx_naks;
    let resent = o.client.tx_retransmits + o.server.tx_retransmits;
    let timeouts = o.client.rc_timeouts + o.server.rc_timeouts;
    let probes = o.client.rc_probes + o.server.rc_probes;
    report(
        case,
        &o,
        &format!(
            "; {:.0}% of the goodput without faults ({:.2} Gbit/s); {kept} packets kept ahead \
             of a gap, {naks} NAKs, {resent} resent, {probes} probes, {timeouts} timeouts",
            ratio * 100.0,
            clean.bytes as f64 * 8.0 / clean.secs / 1e9
        ),
    );
    assert!(kept > 0, "{case}: nothing was reordered");
    (o, ratio)
}

/// The longest a link may wait for an acknowledgement under reordering: a packet overtaken
/// by others is kept and placed, a missing one asked for again within a round trip, so no
/// timer's wait (the local ACK timeout is 134 ms). Measured on the link, not as a reader's
/// wait: 65 connections share one queue pair, so a reader also waits for the others' data
/// queued ahead of its own (up to 270 ms without any fault at 0.6 Gbit/s, the rate with the
/// fault injector on a slow machine).
const REORDER_MAX_WAIT: Duration = Duration::from_millis(100);

/// A mild reordering profile: goodput at least half of the run without it, and no link
/// waits longer than [`REORDER_MAX_WAIT`] for an acknowledgement.
fn mild_reordering(test: &str, port: u16, case: &str, profile: (f64, Duration, u64)) {
    let Some((_turn, install, net)) = setup(test) else {
        return;
    };
    let (o, ratio) = reordered(&net, &install, port, case, profile);
    assert!(ratio >= 0.5, "{case}: {:.0}% of the goodput", ratio * 100.0);
    assert!(
        o.longest_stall() <= REORDER_MAX_WAIT,
        "{case}: a link waited {:?} for an acknowledgement",
        o.longest_stall()
    );
    let timeouts = o.client.rc_timeouts + o.server.rc_timeouts;
    assert_eq!(timeouts, 0, "{case}: local ACK timeouts");
}

#[test]
fn reordering_1pct_up_to_1ms() {
    let case = "1% reordered (held up to 1 ms)";
    mild_reordering("reorder1", 7510, case, (0.01, Duration::from_millis(1), 11));
}

#[test]
fn reordering_5pct_up_to_2ms() {
    let case = "5% reordered (held up to 2 ms)";
    mild_reordering("reorder5", 7512, case, (0.05, Duration::from_millis(2), 12));
}

/// Heavy reordering: it completes intact (checked by the transfer), within the stall bound.
#[test]
fn reordering_20pct_up_to_10ms() {
    let Some((_turn, install, net)) = setup("reorder20") else {
        return;
    };
    let case = "20% reordered (held up to 10 ms)";
    reordered(
        &net,
        &install,
        7514,
        case,
        (0.2, Duration::from_millis(10), 13),
    );
}

#[test]
fn delay_with_jitter() {
    let Some((_turn, install, net)) = setup("delay") else {
        return;
    };
    let f = FaultConfig {
        delay: Duration::from_millis(20),
        jitter: Duration::from_millis(5),
        seed: 12,
        ..FaultConfig::default()
    };
    let o = transfer(&net, &install, 7505, Some(f));
    report("20 ms delay, 5 ms jitter", &o, "");
}
