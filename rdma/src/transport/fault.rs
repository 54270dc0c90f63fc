//! A seeded fault injector for outgoing packets (smoltcp's `FaultInjector` idea): drop,
//! duplicate, reorder, corrupt and delay, deterministic for a given seed.
//!
//! It is configured with [`FaultConfig`], in code or from the `SMCR_RDMA_FAULTS` environment
//! variable, e.g. `drop=5%,dup=1%,reorder=5%,corrupt=1%,delay=2ms,jitter=1ms,seed=7`.
//! Corruption flips one bit *after* the ICRC was computed, so the receiver's ICRC check must
//! catch it. Reordering holds a packet back by up to `reorder_delay` so later ones overtake it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddrV4;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// What the fault injector does, as probabilities in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    /// Probability that a packet is dropped.
    pub drop: f64,
    /// Probability that a packet is sent twice.
    pub duplicate: f64,
    /// Probability that a packet is held back so that later ones overtake it.
    pub reorder: f64,
    /// Probability that one bit of a packet is flipped.
    pub corrupt: f64,
    /// Fixed delay added to every packet.
    pub delay: Duration,
    /// Random extra delay, uniform in `[0, jitter]`. It varies the delay as a queue on the
    /// path would, without reordering: a packet never leaves before the one sent before it
    /// (reordering is `reorder`'s; go-back-N RC over a path that reorders most packets
    /// retransmits most of them).
    pub jitter: Duration,
    /// How long a reordered packet is held back (uniform in `[0, reorder_delay]`).
    pub reorder_delay: Duration,
    /// Seed of the pseudo-random generator.
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            drop: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            reorder_delay: Duration::from_micros(500),
            seed: 1,
        }
    }
}

impl FaultConfig {
    /// Whether any fault is configured.
    pub fn is_active(&self) -> bool {
        self.drop > 0.0
            || self.duplicate > 0.0
            || self.reorder > 0.0
            || self.corrupt > 0.0
            || !self.delay.is_zero()
            || !self.jitter.is_zero()
    }

    /// Reads `SMCR_RDMA_FAULTS`, if set.
    pub fn from_env() -> Option<Result<Self, String>> {
        crate::env::var("SMCR_RDMA_FAULTS").map(|s| s.parse())
    }
}

fn parse_prob(v: &str) -> Result<f64, String> {
    let (num, scale) = match v.strip_suffix('%') {
        Some(n) => (n, 100.0),
        None => (v, 1.0),
    };
    let p = num
        .parse::<f64>()
        .map_err(|_| format!("bad probability {v:?}"))?
        / scale;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("probability {v:?} is outside 0..=1"))
    }
}

fn parse_duration(v: &str) -> Result<Duration, String> {
    let (num, unit) = v
        .find(|c: char| c.is_ascii_alphabetic())
        .map_or((v, "ms"), |i| v.split_at(i));
    let n: f64 = num.parse().map_err(|_| format!("bad duration {v:?}"))?;
    let secs = match unit {
        "s" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        _ => return Err(format!("bad duration unit in {v:?} (use s, ms or us)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| format!("bad duration {v:?}"))
}

impl FromStr for FaultConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Self::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("expected key=value, got {item:?}"))?;
            match k {
                "drop" => c.drop = parse_prob(v)?,
                "dup" | "duplicate" => c.duplicate = parse_prob(v)?,
                "reorder" => c.reorder = parse_prob(v)?,
                "corrupt" => c.corrupt = parse_prob(v)?,
                "delay" => c.delay = parse_duration(v)?,
                "jitter" => c.jitter = parse_duration(v)?,
                "reorder_delay" => c.reorder_delay = parse_duration(v)?,
                "seed" => c.seed = v.parse().map_err(|_| format!("bad seed {v:?}"))?,
                _ => {
                    return Err(format!(
                        "unknown fault {k:?} (drop, dup, reorder, corrupt, delay, jitter, reorder_delay, seed)"
                    ));
                }
            }
        }
        Ok(c)
    }
}

/// Counters of injected faults.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultStats {
    /// Packets that went through the injector.
    pub packets: u64,
    /// Dropped.
    pub dropped: u64,
    /// Duplicated.
    pub duplicated: u64,
    /// Held back for reordering.
    pub reordered: u64,
    /// Corrupted.
    pub corrupted: u64,
}

/// A packet released by the injector for sending.
pub(crate) struct Release {
    pub(crate) dst: SocketAddrV4,
    /// The source address the packet's ICRC was computed with (multi-homed devices).
    pub(crate) src: Option<std::net::Ipv4Addr>,
    pub(crate) bytes: Vec<u8>,
}

pub(crate) struct FaultInjector {
    cfg: FaultConfig,
    state: u64,
    seq: u64,
    held: BinaryHeap<Reverse<(Instant, u64, Held)>>,
    /// When the last packet not picked for reordering is due: the next one is not due
    /// before it (jitter keeps the order).
    last_due: Option<Instant>,
    pub(crate) stats: FaultStats,
}

struct Held(SocketAddrV4, Option<std::net::Ipv4Addr>, Vec<u8>);
impl PartialEq for Held {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl FaultInjector {
    pub(crate) fn new(cfg: FaultConfig) -> Self {
        Self {
            cfg,
            state: cfg.seed,
            seq: 0,
            held: BinaryHeap::new(),
            last_due: None,
            stats: FaultStats::default(),
        }
    }

    /// Whether it flips bits (see [`FaultConfig::corrupt`]).
    pub(crate) fn corrupts(&self) -> bool {
        self.cfg.corrupt > 0.0
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn uniform(&mut self, max: Duration) -> Duration {
        if max.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(self.next() % (max.as_nanos() as u64 + 1))
        }
    }

    /// Takes an outgoing packet; returns the packets to send now (0, 1 or 2), and holds others.
    pub(crate) fn process(
        &mut self,
        now: Instant,
        dst: SocketAddrV4,
        src: Option<std::net::Ipv4Addr>,
        mut bytes: Vec<u8>,
        out: &mut Vec<Release>,
    ) {
        self.stats.packets += 1;
        if self.chance(self.cfg.drop) {
            self.stats.dropped += 1;
            return;
        }
        if self.chance(self.cfg.corrupt) && !bytes.is_empty() {
            self.stats.corrupted += 1;
            let bit = self.next() as usize % (bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
        }
        let copies = if self.chance(self.cfg.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for c in 0..copies {
            let mut delay = self.cfg.delay + self.uniform(self.cfg.jitter);
            if !self.cfg.jitter.is_zero()
                && let Some(last) = self.last_due
            {
                delay = delay.max(last.saturating_duration_since(now));
            }
            if c == 0 && self.chance(self.cfg.reorder) {
                self.stats.reordered += 1;
                delay += self
                    .uniform(self.cfg.reorder_delay)
                    .max(Duration::from_micros(1));
            } else {
                self.last_due = Some(now + delay);
            }
            let pkt = if c + 1 == copies {
                std::mem::take(&mut bytes)
            } else {
                bytes.clone()
            };
            if delay.is_zero() && self.held.is_empty() {
                out.push(Release {
                    dst,
                    src,
                    bytes: pkt,
                });
            } else {
                self.seq += 1;
                self.held
                    .push(Reverse((now + delay, self.seq, Held(dst, src, pkt))));
            }
        }
        self.release(now, out);
    }

    /// Releases held packets whose time has come.
    pub(crate) fn release(&mut self, now: Instant, out: &mut Vec<Release>) {
        while let Some(Reverse((t, _, _))) = self.held.peek() {
            if *t > now {
                break;
            }
            let Reverse((_, _, Held(dst, src, bytes))) = self.held.pop().expect("peeked");
            out.push(Release { dst, src, bytes });
        }
    }

    /// When the next held packet is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.held.peek().map(|Reverse((t, _, _))| *t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_environment_syntax() {
        let c: FaultConfig =
            "drop=5%,dup=0.01,reorder=5%,corrupt=1%,delay=20ms,jitter=500us,seed=9"
                .parse()
                .unwrap();
        assert_eq!(c.drop, 0.05);
        assert_eq!(c.duplicate, 0.01);
        assert_eq!(c.delay, Duration::from_millis(20));
        assert_eq!(c.jitter, Duration::from_micros(500));
        assert_eq!(c.seed, 9);
        assert!(c.is_active());
        assert!("drop=150%".parse::<FaultConfig>().is_err());
        assert!("bogus=1".parse::<FaultConfig>().is_err());
        assert!("delay=3h".parse::<FaultConfig>().is_err());
        assert!(!FaultConfig::default().is_active());
    }

    #[test]
    fn rates_and_determinism() {
        let cfg = FaultConfig {
            drop: 0.1,
            duplicate: 0.1,
            reorder: 0.1,
            corrupt: 0.1,
            ..FaultConfig::default()
        };
        let run = || {
            let mut f = FaultInjector::new(cfg);
            let t0 = Instant::now();
            let dst = SocketAddrV4::new([127, 0, 0, 1].into(), 1);
            let mut out = vec![];
            for i in 0..10_000u32 {
                f.process(t0, dst, None, i.to_be_bytes().to_vec(), &mut out);
            }
            f.release(t0 + Duration::from_secs(1), &mut out);
            (f.stats, out.len())
        };
        let (a, n) = run();
        assert_eq!(run(), (a, n), "same seed, same faults");
        for x in [a.dropped, a.duplicated, a.corrupted] {
            assert!((800..1200).contains(&x), "{a:?}");
        }
        assert_eq!(n as u64, a.packets - a.dropped + a.duplicated);
    }

    #[test]
    fn jitter_varies_the_delay_but_keeps_the_order() {
        let cfg = FaultConfig {
            delay: Duration::from_millis(20),
            jitter: Duration::from_millis(5),
            ..FaultConfig::default()
        };
        let mut f = FaultInjector::new(cfg);
        let t0 = Instant::now();
        let dst = SocketAddrV4::new([127, 0, 0, 1].into(), 1);
        let mut out = vec![];
        for i in 0..1000u32 {
            // One packet every 10 us: far closer than the jitter.
            f.process(
                t0 + Duration::from_micros(10 * u64::from(i)),
                dst,
                None,
                i.to_be_bytes().to_vec(),
                &mut out,
            );
        }
        assert!(out.is_empty(), "nothing before the delay");
        f.release(t0 + Duration::from_millis(20), &mut out);
        let early = out.len();
        assert!(early < 1000, "the delay holds them");
        f.release(t0 + Duration::from_secs(1), &mut out);
        let order: Vec<u32> = out
            .iter()
            .map(|r| u32::from_be_bytes(r.bytes[..4].try_into().unwrap()))
            .collect();
        assert_eq!(
            order,
            (0..1000).collect::<Vec<_>>(),
            "jitter reordered packets"
        );
    }
}
