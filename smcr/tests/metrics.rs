//! The `metrics` facade: a program embedding smcr installs a recorder and sees connections,
//! fallbacks (with their reason) and handshake times. Its own test binary: a recorder is
//! process-global.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use smcr::{Mode, Negotiation, Runtime, RuntimeConfig, SmcListener, SmcStream};

/// Counters and histogram samples by `name{label=value,...}`.
#[derive(Default)]
struct Seen {
    counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
    samples: Mutex<HashMap<String, Arc<Mutex<Vec<f64>>>>>,
}

fn key_text(k: &Key) -> String {
    let mut labels: Vec<String> = k
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", k.name(), labels.join(","))
}

struct Counting(AtomicU64Ref);
struct AtomicU64Ref(Arc<AtomicU64>);
impl metrics::CounterFn for Counting {
    fn increment(&self, v: u64) {
        self.0.0.fetch_add(v, Ordering::Relaxed);
    }
    fn absolute(&self, v: u64) {
        self.0.0.store(v, Ordering::Relaxed);
    }
}
struct Sampling(Arc<Mutex<Vec<f64>>>);
impl metrics::HistogramFn for Sampling {
    fn record(&self, v: f64) {
        self.0.lock().unwrap().push(v);
    }
}

struct Rec(Arc<Seen>);
impl Recorder for Rec {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let c = self
            .0
            .counters
            .lock()
            .unwrap()
            .entry(key_text(key))
            .or_default()
            .clone();
        Counter::from_arc(Arc::new(Counting(AtomicU64Ref(c))))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let h = self
            .0
            .samples
            .lock()
            .unwrap()
            .entry(key_text(key))
            .or_default()
            .clone();
        Histogram::from_arc(Arc::new(Sampling(h)))
    }
}

#[test]
fn connections_fallbacks_and_handshake_times_reach_the_recorder() {
    let seen = Arc::new(Seen::default());
    metrics::set_global_recorder(Rec(seen.clone())).unwrap();
    let count = |k: &str| {
        seen.counters
            .lock()
            .unwrap()
            .get(k)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    };
    // SMC-R (assume: both ends are ours) …
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::Assume;
    cfg.roce_port = 24000 + (std::process::id() % 1000) as u16;
    cfg.stats_dir = None; // the facade works without the stats area
    let rt = Runtime::new(cfg.clone());
    let l = SmcListener::bind(&rt, "127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    });
    let mut c = SmcStream::connect(&rt, addr).unwrap();
    assert!(matches!(c.mode(), Mode::SmcR { .. }));
    c.write_all(b"ping").unwrap();
    c.read_exact(&mut [0u8; 4]).unwrap();
    // … and a fallback: the option program is missing (NOBPF) on this client runtime.
    cfg.negotiation = Negotiation::TcpOption {
        dir: "/nonexistent/smcr-metrics-test".into(),
    };
    cfg.roce_port += 1;
    let plain = Runtime::new(cfg);
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut p = SmcStream::connect(&plain, tcp.local_addr().unwrap()).unwrap();
    assert!(matches!(p.mode(), Mode::Tcp(_)), "{:?}", p.mode());
    p.write_all(b"pong").unwrap();
    tcp.accept().unwrap().0.read_exact(&mut [0u8; 4]).unwrap();
    server.join().unwrap();
    // Client and server SMC-R; the client's TCP.
    assert_eq!(count("smcr_connections_total{mode=smcr}"), 2);
    assert_eq!(count("smcr_connections_total{mode=tcp}"), 1);
    assert_eq!(count("smcr_first_contacts_total{}"), 2);
    assert_eq!(count("smcr_handshake_failures_total{}"), 0);
    assert_eq!(
        count("smcr_fallbacks_total{code=0x7f000001,reason=NOBPF}"),
        1,
        "{:?}",
        seen.counters.lock().unwrap().keys().collect::<Vec<_>>()
    );
    let samples = seen.samples.lock().unwrap();
    let smcr = samples["smcr_handshake_seconds{mode=smcr}"]
        .lock()
        .unwrap()
        .clone();
    assert_eq!(smcr.len(), 2);
    assert!(smcr.iter().all(|&s| s > 0.0 && s < 10.0), "{smcr:?}");
    drop(samples);
    rt.shutdown();
}
