//! Model check (loom) of the wake-up handshakes: no lost wake-up in any interleaving (and any
//! value the memory orderings let a load see). A CQ here is what `device::cq` has around
//! [`Notify`]: the queue under a mutex, the two eventfds as counters, and one same-host ring of
//! one entry whose doorbells are those eventfds. Every thread does what the production
//! callers do, through the same functions.
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p rdma --release --lib notify::model` explores up to
//! [`PREEMPTIONS`] preemptions per execution (seconds; `LOOM_MAX_PREEMPTIONS=N` sets another
//! bound: 100 is exhaustive, and takes minutes).

use super::sync::Mutex;
use super::*;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use loom::thread;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

/// The preemption bound without `LOOM_MAX_PREEMPTIONS`.
const PREEMPTIONS: usize = 5;

/// Runs `f` in every interleaving up to the preemption bound.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound.get_or_insert(PREEMPTIONS);
    b.check(f);
}

struct Cq {
    queue: Mutex<VecDeque<u32>>,
    notify: Notify,
    /// The notification eventfd (a counter: a write before the sleep still wakes it).
    event: AtomicU64,
    /// The driver eventfd.
    event_driver: AtomicU64,
    ring: Ring,
}

/// A same-host ring into the CQ's QP: counts, the consumer's waiting word, two entries.
struct Ring {
    tail: AtomicU64,
    head: AtomicU64,
    waiting: AtomicU64,
    slots: [UnsafeCell<u32>; 2],
}

impl Cq {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(VecDeque::new()),
            notify: Notify::new(),
            event: AtomicU64::new(0),
            event_driver: AtomicU64::new(0),
            ring: Ring {
                tail: AtomicU64::new(0),
                head: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
                slots: [UnsafeCell::new(0), UnsafeCell::new(0)],
            },
        })
    }

    /// `CqShared::push`.
    fn push(&self, wc: u32) {
        self.queue.lock().push_back(wc);
        if let Some(w) = self.notify.after_push() {
            self.signal(w);
        }
    }

    /// `CqShared::signal`: an eventfd write, which the kernel orders before the poll or read
    /// that sees it (Release here, Acquire in [`Self::woken`]).
    fn signal(&self, w: Wake) {
        match w {
            Wake::Event => self.event.fetch_add(1, Release),
            Wake::Driver => self.event_driver.fetch_add(1, Release),
        };
    }

    /// A sleeper's look at its descriptor (its `poll`, then the `read` of the eventfd).
    fn woken(&self, driver: bool) -> u64 {
        if driver {
            self.event_driver.load(Acquire)
        } else {
            self.event.load(Acquire)
        }
    }

    fn empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    fn take(&self) -> bool {
        self.queue.lock().pop_front().is_some()
    }

    /// `Shared::shm_sleepers`: who sleeps changes, the ring learns the waiting word; whether
    /// the ring holds something deliverable.
    fn sleepers(&self, change: impl FnOnce(&mut Sleepers)) -> bool {
        self.notify.sleepers(change, |word| {
            ring_set_waiting(&self.ring.waiting, word);
            waiting_bits(word) != 0 && !ring_is_empty(&self.ring.tail, &self.ring.head)
        })
    }

    /// A ring consumer (a driver, or a poller) says it sleeps: whether something is there
    /// already (`Shared::drive_sleep(true)`, or the poller's register in `Shared::wait_cq`).
    fn register(&self, as_driver: bool) -> bool {
        if as_driver {
            self.sleepers(|s| s.drivers += 1)
        } else {
            self.sleepers(|s| s.event += 1)
        }
    }

    /// `Shared::shm_pending`.
    fn ring_pending(&self) -> bool {
        !ring_is_empty(&self.ring.tail, &self.ring.head)
    }

    /// The same-host producer (`Ring::push_word`, then `ShmQp::ring_bell`): writes the first
    /// entry, publishes it, rings the doorbells the waiting word names.
    fn produce(&self) {
        self.produce_at(0, &mut 0);
    }

    /// As [`Self::produce`], for entry `n` (0, then 1), with the producer's memory of the word
    /// it rang for (`ShmQp::rang`).
    fn produce_at(&self, n: usize, rang: &mut u64) {
        self.ring.slots[n].with_mut(|p| unsafe { *p = 7 + n as u32 });
        let word = ring_published(&self.ring.tail, n as u64 + 1, &self.ring.waiting);
        let bells = doorbells(word, rang);
        if bells & WAIT_EVENT != 0 {
            self.signal(Wake::Event);
        }
        if bells & WAIT_DRIVER != 0 {
            self.signal(Wake::Driver);
        }
    }

    /// The consumer takes the ring's entries if they are there (each must be complete);
    /// whether it took any.
    fn consume(&self) -> bool {
        self.consume_all() > 0
    }

    /// As [`Self::consume`]; how many it took.
    fn consume_all(&self) -> usize {
        let tail = self.ring.tail.load(Acquire);
        let head = self.ring.head.load(Relaxed);
        for n in head..tail {
            let v = self.ring.slots[n as usize].with(|p| unsafe { *p });
            assert_eq!(v, 7 + n as u32, "a published entry is complete");
        }
        self.ring.head.store(tail, Release);
        (tail - head) as usize
    }

    /// `Shared::begin_drive`.
    fn begin_drive(&self) {
        if self.notify.begin_drive() {
            self.sleepers(|_| {});
        }
    }

    /// `Shared::end_drive`.
    fn end_drive(&self) {
        let wake = self.notify.end_drive(|last| {
            if !last {
                return !self.empty() || self.ring_pending();
            }
            let pending = self.sleepers(|_| {});
            pending || !self.empty()
        });
        if let Some(w) = wake {
            self.signal(w);
        }
    }

    /// A poller about to sleep on the notification descriptor (`Shared::wait_cq`): whether
    /// it sleeps.
    fn poller_sleeps(&self) -> bool {
        self.notify
            .event_sleep(|| self.sleepers(|s| s.event += 1), || self.empty())
    }

    /// A driver about to sleep on the driver descriptor (`Shared::drive_sleep(true)`).
    fn driver_sleeps(&self) -> bool {
        self.notify
            .driver_sleep(|| self.sleepers(|s| s.drivers += 1), || self.empty())
    }

    fn events(&self) -> (u64, u64) {
        (self.event.load(Relaxed), self.event_driver.load(Relaxed))
    }
}

/// (a) A poller arms, registers and looks at the queue while a completion is pushed (no
/// drive): it sees the completion, or the notification descriptor is signalled.
#[test]
fn poller_sees_a_completion_or_is_signalled() {
    model(|| {
        let cq = Cq::new();
        let c = cq.clone();
        let pusher = thread::spawn(move || c.push(1));
        let slept = cq.poller_sleeps();
        pusher.join().unwrap();
        let (event, driver) = cq.events();
        assert!(!slept || event >= 1, "lost wake-up: the poller sleeps on");
        assert_eq!(driver, 0, "no driver: its descriptor stays quiet");
    });
}

/// (b) A drive begins and ends (taking what it finds in between) while a completion is
/// pushed and a poller goes to sleep: the driver took the completion, or the poller saw it,
/// or the poller is signalled (by the push, or by the end of the drive that left it).
#[test]
fn a_drive_takes_a_completion_or_hands_it_over() {
    model(|| {
        let cq = Cq::new();
        let (c1, c2) = (cq.clone(), cq.clone());
        let driver = thread::spawn(move || {
            c1.begin_drive();
            let took = c1.take();
            c1.end_drive();
            took
        });
        let pusher = thread::spawn(move || c2.push(1));
        let slept = cq.poller_sleeps();
        let took = driver.join().unwrap();
        pusher.join().unwrap();
        let (event, driver) = cq.events();
        assert!(
            took || !slept || event >= 1,
            "lost wake-up: left behind by the drive"
        );
        assert_eq!(driver, 0, "no driver slept: its descriptor stays quiet");
    });
}

/// (b) A driver about to sleep while a completion is pushed: it sees it, or its descriptor
/// is signalled; the poller's is not (the driver covers the queue).
#[test]
fn a_driver_sees_a_completion_or_is_signalled() {
    model(|| {
        let cq = Cq::new();
        cq.begin_drive();
        let c = cq.clone();
        let pusher = thread::spawn(move || c.push(1));
        let slept = cq.driver_sleeps();
        pusher.join().unwrap();
        let (event, driver) = cq.events();
        assert!(!slept || driver == 1, "lost wake-up: the driver sleeps on");
        assert_eq!(event, 0, "driven: only the driver is signalled");
    });
}

/// (c) The same-host doorbell: the consumer (a poller, or a driver) publishes its waiting
/// word and looks at the ring while the producer writes an entry and reads the word: the
/// consumer sees the entry (complete), or the producer rings that sleeper's doorbell.
#[test]
fn a_ring_consumer_sees_the_entry_or_is_rung() {
    for as_driver in [false, true] {
        model(move || {
            let cq = Cq::new();
            if as_driver {
                cq.begin_drive();
            }
            let c = cq.clone();
            let producer = thread::spawn(move || c.produce());
            let pending = cq.register(as_driver);
            let saw = pending && cq.consume();
            producer.join().unwrap();
            let (event, driver) = cq.events();
            let rung = if as_driver { driver } else { event };
            assert!(
                saw || rung == 1,
                "lost wake-up: the ring's consumer sleeps on"
            );
            assert!(
                saw || cq.consume(),
                "the entry is there once the producer is done"
            );
        });
    }
}

/// (c) Doorbells rung once per word: the producer writes two entries one after the other
/// while the consumer (a poller, or a driver) sleeps, is rung, wakes and looks again. The
/// producer does not ring again for the word it rang for (`doorbells`); the consumer gets
/// both entries all the same, and never sleeps on with an entry it was not rung for.
#[test]
fn a_consumer_rung_once_per_word_loses_no_entry() {
    for as_driver in [false, true] {
        model(move || {
            let cq = Cq::new();
            if as_driver {
                cq.begin_drive();
            }
            let done = Arc::new(AtomicBool::new(false));
            let (c, d) = (cq.clone(), done.clone());
            let producer = thread::spawn(move || {
                let mut rang = 0;
                c.produce_at(0, &mut rang);
                c.produce_at(1, &mut rang);
                d.store(true, SeqCst);
            });
            let (mut got, mut seen) = (0, 0);
            while got < 2 {
                let pending = cq.register(as_driver);
                if !pending {
                    // Asleep until the doorbell rings.
                    loop {
                        let r = cq.woken(as_driver);
                        if r > seen {
                            seen = r;
                            break;
                        }
                        assert!(
                            !(done.load(SeqCst) && cq.woken(as_driver) == seen),
                            "lost wake-up: asleep with {} entries unseen",
                            2 - got
                        );
                        thread::yield_now();
                    }
                }
                cq.sleepers(if as_driver {
                    Sleepers::driver_woke
                } else {
                    Sleepers::event_woke
                });
                got += cq.consume_all();
            }
            producer.join().unwrap();
        });
    }
}

/// (b) and (c) together: a poller goes to sleep while the CQ is driven, a ring entry arrives
/// (its producer sees no poller in the waiting word: the drive covers it), and the drive ends
/// without taking it: the end of the drive signals the poller, or the producer rang it, or the
/// poller saw the entry.
#[test]
fn a_ring_entry_during_a_drive_is_handed_over() {
    model(|| {
        let cq = Cq::new();
        cq.begin_drive();
        let (c1, c2) = (cq.clone(), cq.clone());
        let driver = thread::spawn(move || c1.end_drive());
        let producer = thread::spawn(move || c2.produce());
        let slept = cq.poller_sleeps();
        driver.join().unwrap();
        producer.join().unwrap();
        let (event, _) = cq.events();
        assert!(
            !slept || event >= 1,
            "lost wake-up: the ring entry waits unseen"
        );
    });
}

/// (d) A ring joins the CQ while a poller registers. The joiner is a QP whose offer is about to
/// leave: under its QP's lock it counts itself live (`samehost::Live`), then sets its waiting
/// word from [`Notify::published`]; then its peer writes an entry. The poller's publish skips
/// the rings while none is live (`Shared::shm_sleepers`), else sets their words under each
/// QP's lock. The producer rings the poller, or the poller sees the entry.
#[test]
fn a_ring_that_joins_while_a_poller_registers_rings_it() {
    model(|| {
        let cq = Cq::new();
        let live = Arc::new(AtomicUsize::new(0));
        let core = Arc::new(Mutex::new(()));
        let (c, l, k) = (cq.clone(), live.clone(), core.clone());
        let joiner = thread::spawn(move || {
            {
                let _qp = k.lock();
                l.fetch_add(1, SeqCst);
                ring_set_waiting(&c.ring.waiting, c.notify.published());
            }
            c.produce();
        });
        let slept = cq.notify.event_sleep(
            || {
                cq.notify.sleepers(
                    |s| s.event += 1,
                    |word| {
                        if live.load(Relaxed) == 0 {
                            return false;
                        }
                        let _qp = core.lock();
                        ring_set_waiting(&cq.ring.waiting, word);
                        waiting_bits(word) != 0 && !ring_is_empty(&cq.ring.tail, &cq.ring.head)
                    },
                )
            },
            || cq.empty(),
        );
        joiner.join().unwrap();
        let (event, _) = cq.events();
        assert!(
            !slept || event >= 1,
            "lost wake-up: the joining ring's entry waits unseen"
        );
    });
}

/// The device socket and its receive state, as `device::rx` has them: packets waiting in the
/// kernel (a counter), the receive state (a try-lock) and [`RxWanted`].
struct Sock {
    pending: AtomicUsize,
    rx: Mutex<()>,
    wanted: RxWanted,
}

impl Sock {
    /// `receive_now`: want, try to take, drain, let go, look for a want that came meanwhile.
    fn receive_now(&self) {
        loop {
            self.wanted.want();
            let Some(g) = self.rx.try_lock() else {
                return; // left to the holder
            };
            self.wanted.served();
            self.pending.store(0, SeqCst);
            drop(g);
            if !self.wanted.after_release() {
                return;
            }
        }
    }
}

/// (e) A thread holds the receive state (the engine thread, or a driver in `drive_wait`:
/// `rx_try`), drains the socket and lets go (`RxGuard`'s drop: `rx_recheck`); meanwhile a
/// packet arrives and its edge wakes another thread (an event loop watching the socket, or
/// `CqScheduler::receive`), which finds the state taken and leaves the packet to the holder.
/// Someone receives it: nobody would be woken for it again.
#[test]
fn a_packet_left_to_the_receive_state_holder_is_received() {
    model(|| {
        let sock = Arc::new(Sock {
            pending: AtomicUsize::new(0),
            rx: Mutex::new(()),
            wanted: RxWanted::new(),
        });
        let s = sock.clone();
        let holder = thread::spawn(move || {
            if let Some(g) = s.rx.try_lock() {
                s.pending.store(0, SeqCst);
                drop(g);
                if s.wanted.after_release() {
                    s.receive_now();
                }
            }
        });
        sock.pending.fetch_add(1, SeqCst);
        sock.receive_now();
        holder.join().unwrap();
        assert_eq!(
            sock.pending.load(SeqCst),
            0,
            "lost: a packet waits on the socket and nobody will receive it"
        );
    });
}
