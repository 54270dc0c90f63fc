//! The wake-up handshakes between a thread about to sleep and a completion (or a same-host
//! ring entry) that arrives meanwhile, and nothing else: the decisions and their memory
//! orderings, without descriptors, queues or rings. The callers (`device`, `shm`) keep the
//! I/O: they are told which descriptor to signal ([`Wake`]), and the queue, the rings and the
//! registering of sleepers are closures.
//!
//! Each handshake is a store-buffering pair: the sleeper publishes that it sleeps, then looks
//! for work; the producer publishes the work, then looks for a sleeper. Either the sleeper
//! finds the work or the producer finds the sleeper (and signals it). Under `cfg(loom)` the
//! synchronisation types are loom's and `notify/model.rs` checks these functions in every
//! interleaving: `RUSTFLAGS="--cfg loom" cargo test -p rdma --release --lib notify::model`
//! (docs/architecture.md, "Wake-up handshakes, model-checked").

use std::sync::atomic::Ordering;
use sync::{AtomicBool, AtomicU32, AtomicU64, Mutex, fence};

/// The synchronisation types: loom's under `cfg(loom)`, std's and parking_lot's otherwise.
mod sync {
    #[cfg(loom)]
    pub(super) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, fence};
    #[cfg(not(loom))]
    pub(super) use parking_lot::Mutex;
    #[cfg(not(loom))]
    pub(super) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, fence};

    /// loom's mutex with parking_lot's `lock` (no poisoning).
    #[cfg(loom)]
    pub(super) struct Mutex<T>(loom::sync::Mutex<T>);

    #[cfg(loom)]
    impl<T> Mutex<T> {
        pub(super) fn new(t: T) -> Self {
            Self(loom::sync::Mutex::new(t))
        }

        pub(super) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            self.0.lock().expect("a model thread panicked")
        }

        pub(super) fn try_lock(&self) -> Option<loom::sync::MutexGuard<'_, T>> {
            self.0.try_lock().ok()
        }
    }
}

/// Waiting-word bit: the consumer's CQ notification descriptor has a sleeper (its poller).
pub(crate) const WAIT_EVENT: u32 = 1;
/// Waiting-word bit: a driver (an application thread handling completions itself) sleeps on
/// the CQ's driver descriptor.
pub(crate) const WAIT_DRIVER: u32 = 2;
/// The waiting word's doorbell bits; above them, a count of the words published.
const WAIT_BITS: u64 = 3;

/// The doorbell bits of a waiting word ([`WAIT_EVENT`], [`WAIT_DRIVER`]).
#[inline]
pub(crate) fn waiting_bits(word: u64) -> u32 {
    (word & WAIT_BITS) as u32
}

/// Which of a CQ's descriptors to signal (write 1 to the eventfd).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The notification descriptor (a poller, an `ibv_req_notify_cq` user).
    Event,
    /// The driver descriptor.
    Driver,
}

/// Who sleeps on a CQ, for the waiting words of its same-host rings (see [`Notify`]).
#[derive(Default)]
pub(crate) struct Sleepers {
    /// Threads asleep on the notification descriptor (a poller).
    pub(crate) event: u32,
    /// An `ibv_req_notify_cq` user armed the notification descriptor.
    pub(crate) notify: bool,
    /// Drivers asleep on the driver descriptor.
    pub(crate) drivers: u32,
    /// Waiting words published so far (each one is new: see [`doorbells`]).
    words: u64,
}

impl Sleepers {
    pub(crate) fn event_woke(&mut self) {
        self.event = self.event.saturating_sub(1);
    }

    pub(crate) fn driver_woke(&mut self) {
        self.drivers = self.drivers.saturating_sub(1);
    }
}

/// A completion queue's wake-up state.
///
/// Two kinds of sleepers wait for completions, each on its own descriptor so that a
/// completion wakes one of them, not both: *drivers* (application threads that handle
/// completions themselves while they wait) on the driver descriptor, and everyone else (a
/// poller thread, `ibv_req_notify_cq` users) on the notification descriptor. While a driver is
/// at work the others are not signalled: the driver covers the queue, and the end of the last
/// drive signals what it leaves behind.
pub(crate) struct Notify {
    /// The notification descriptor wants a signal (a sleeper armed it).
    armed: AtomicBool,
    /// A driver sleeps: the driver descriptor wants a signal.
    armed_driver: AtomicBool,
    /// Threads between `begin_drive` and `end_drive`.
    drivers: AtomicU32,
    /// Set by a kick: a poller that wakes returns to recompute its timers rather than
    /// sleeping on to its old deadline.
    kicked: AtomicBool,
    /// Who sleeps, for the waiting words of the same-host rings.
    sleepers: Mutex<Sleepers>,
    /// The waiting word last published (see [`Self::published`]).
    published: AtomicU64,
}

impl Notify {
    pub(crate) fn new() -> Self {
        Self {
            armed: AtomicBool::new(false),
            armed_driver: AtomicBool::new(false),
            drivers: AtomicU32::new(0),
            kicked: AtomicBool::new(false),
            sleepers: Mutex::new(Sleepers::default()),
            published: AtomicU64::new(0),
        }
    }

    /// A completion was queued (and the queue's lock released): the descriptor to signal, if
    /// any. A driver at work covers the queue: only it is signalled (if it sleeps). Ordering:
    /// [`Self::end_drive`] lowers `drivers` before it looks at the queue, under the queue's
    /// lock, so either it sees this completion or we see `drivers` at 0; a sleeper arms before
    /// it looks at the queue, so either it sees the completion or we see it armed.
    #[inline]
    pub(crate) fn after_push(&self) -> Option<Wake> {
        if self.drivers.load(Ordering::SeqCst) > 0 {
            self.armed_driver
                .swap(false, Ordering::AcqRel)
                .then_some(Wake::Driver)
        } else {
            self.armed
                .swap(false, Ordering::AcqRel)
                .then_some(Wake::Event)
        }
    }

    /// A thread will sleep on the notification descriptor (or an `ibv_req_notify_cq` user
    /// armed it): the next completion signals it. Look at the queue afterwards.
    #[inline]
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// The sleeper on the notification descriptor woke: completions this thread produces
    /// itself need no signal.
    #[inline]
    pub(crate) fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// A thread is about to sleep on the notification descriptor (not a driver): arms it, runs
    /// `register` (says who sleeps: [`Self::sleepers`]; returns whether something in the rings
    /// is deliverable already), and returns whether to sleep: always while the queue is driven
    /// (what is there is the driver's, and the end of the drive signals what it leaves), else
    /// if nothing is deliverable and `empty()` (the queue, looked at under its lock).
    pub(crate) fn event_sleep(
        &self,
        register: impl FnOnce() -> bool,
        empty: impl FnOnce() -> bool,
    ) -> bool {
        self.arm();
        let pending = register();
        self.driven() || (!pending && empty())
    }

    /// A driver is about to sleep on the driver descriptor: runs `register` (it counts itself
    /// among the sleepers, [`Self::sleepers`], which arms the driver descriptor; returns whether
    /// something in the rings is deliverable already), and returns whether to sleep: if nothing
    /// is deliverable and `empty()`.
    pub(crate) fn driver_sleep(
        &self,
        register: impl FnOnce() -> bool,
        empty: impl FnOnce() -> bool,
    ) -> bool {
        let pending = register();
        !pending && empty()
    }

    /// Whether a thread is between `begin_drive` and `end_drive`.
    #[inline]
    pub(crate) fn driven(&self) -> bool {
        self.drivers.load(Ordering::SeqCst) > 0
    }

    /// A thread starts driving; returns whether it is the first (then tell the rings: their
    /// waiting word loses [`WAIT_EVENT`]).
    #[inline]
    pub(crate) fn begin_drive(&self) -> bool {
        self.drivers.fetch_add(1, Ordering::SeqCst) == 0
    }

    /// A thread stops driving. `left(last)` says whether completions are left behind (in the
    /// queue, under its lock, or deliverable in the rings); with `last` (no driver remains) it
    /// first tells the rings ([`Self::sleepers`]), whose waiting word gets [`WAIT_EVENT`] back.
    /// Returns the descriptor to signal: the other drivers' if some remain and something is
    /// left (they must look), else the notification descriptor's if something is left and it
    /// is armed.
    pub(crate) fn end_drive(&self, left: impl FnOnce(bool) -> bool) -> Option<Wake> {
        if self.drivers.fetch_sub(1, Ordering::SeqCst) != 1 {
            return left(false).then_some(Wake::Driver);
        }
        (left(true) && self.armed.swap(false, Ordering::AcqRel)).then_some(Wake::Event)
    }

    /// Changes who sleeps, under the sleepers' lock: arms the driver descriptor while a driver
    /// sleeps, and passes the new waiting word to `publish` (still under the lock: the rings
    /// see the words in order), which stores it in the rings' waiting words
    /// ([`ring_set_waiting`]) and returns whether something there is deliverable.
    pub(crate) fn sleepers<R>(
        &self,
        change: impl FnOnce(&mut Sleepers),
        publish: impl FnOnce(u64) -> R,
    ) -> R {
        let mut s = self.sleepers.lock();
        change(&mut s);
        self.armed_driver.store(s.drivers > 0, Ordering::SeqCst);
        s.words += 1;
        let word = self.waiting_word(&s);
        self.published.store(word, Ordering::Relaxed);
        // Pairs with the fence in `published`: `publish` looks at who has rings after it.
        fence(Ordering::SeqCst);
        publish(word)
    }

    /// The waiting word last passed to a `publish` of [`Self::sleepers`], for a ring that
    /// joins without the sleepers' lock. Store-buffering pair with `publish`'s look at who
    /// has rings: the joining ring first counts itself, then (fence) reads this word; a
    /// `sleepers` call stores the word, then (fence) looks at the count. Either it sees the new
    /// ring (and, serialised behind the joiner's QP lock, stores its word there last) or the
    /// joiner reads its word (model: `notify::model`, a ring that joins).
    pub(crate) fn published(&self) -> u64 {
        fence(Ordering::SeqCst);
        self.published.load(Ordering::Relaxed)
    }

    /// The waiting word the same-host producers see: [`WAIT_DRIVER`] while a driver sleeps,
    /// [`WAIT_EVENT`] while someone sleeps on the notification descriptor and no drive is on;
    /// above these bits, the count of words published, so that no two words are alike.
    #[inline]
    fn waiting_word(&self, s: &Sleepers) -> u64 {
        let mut w = 0;
        if s.drivers > 0 {
            w |= WAIT_DRIVER;
        }
        if (s.event > 0 || s.notify) && !self.driven() {
            w |= WAIT_EVENT;
        }
        u64::from(w) | s.words << 2
    }

    /// Before a kick's write to the notification descriptor: the sleeper it wakes learns why
    /// ([`Self::take_kick`]).
    #[inline]
    pub(crate) fn kick(&self) {
        self.kicked.store(true, Ordering::SeqCst);
    }

    /// Whether a kick came since the last call.
    #[inline]
    pub(crate) fn take_kick(&self) -> bool {
        self.kicked.swap(false, Ordering::SeqCst)
    }
}

/// The device socket's receive state is one thread's at a time (a try-lock). A thread woken
/// by the socket (edge-triggered: nobody is woken again for the packets there now) that finds
/// it taken leaves those packets to its holder, which receives again after letting go. A
/// store-buffering pair: the wanting thread publishes its want, then tries the lock; the
/// holder unlocks, then reads the want. Either the wanting thread gets the lock or the
/// holder sees the want.
pub(crate) struct RxWanted(AtomicBool);

impl RxWanted {
    pub(crate) fn new() -> Self {
        Self(AtomicBool::new(false))
    }

    /// Before trying to take the receive state.
    pub(crate) fn want(&self) {
        self.0.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The receive state was taken: the wants so far are served by what the taker receives.
    pub(crate) fn served(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// After unlocking the receive state: whether a thread wanted it meanwhile (then receive
    /// again, [`Self::want`] first).
    pub(crate) fn after_release(&self) -> bool {
        fence(Ordering::SeqCst);
        self.0.load(Ordering::SeqCst)
    }
}

/// An atomic word of a same-host ring (std's, in a shared segment; loom's in the model), for
/// the doorbell handshake ([`ring_published`], [`ring_set_waiting`]).
pub(crate) trait Word {
    type V: Copy + PartialEq;
    fn load(&self, order: Ordering) -> Self::V;
    fn store(&self, v: Self::V, order: Ordering);
    /// A fence of the same kind (std's or loom's).
    fn fence(order: Ordering);
}

macro_rules! word {
    ($atomic:ty, $v:ty, $fence:path) => {
        impl Word for $atomic {
            type V = $v;
            #[inline]
            fn load(&self, order: Ordering) -> $v {
                <$atomic>::load(self, order)
            }
            #[inline]
            fn store(&self, v: $v, order: Ordering) {
                <$atomic>::store(self, v, order)
            }
            #[inline]
            fn fence(order: Ordering) {
                $fence(order)
            }
        }
    };
}

word!(std::sync::atomic::AtomicU64, u64, std::sync::atomic::fence);
#[cfg(loom)]
word!(
    loom::sync::atomic::AtomicU64,
    u64,
    loom::sync::atomic::fence
);

/// A same-host ring's producer wrote the entry at `tail - 1`: publishes the producer count
/// `tail`, then reads the consumer's waiting word (its bits name the doorbells to ring; see
/// [`doorbells`]).
pub(crate) fn ring_published<T, W>(count: &T, tail: u64, waiting: &W) -> u64
where
    T: Word<V = u64>,
    W: Word<V = u64>,
{
    count.store(tail, Ordering::Release);
    // Pairs with the consumer's fence in `ring_set_waiting`: either it sees the new tail, or
    // we see its waiting word.
    T::fence(Ordering::SeqCst);
    waiting.load(Ordering::Relaxed)
}

/// A same-host ring's consumer says who of it sleeps (no bit: nobody). Look at the ring
/// ([`ring_is_empty`]) afterwards, before sleeping.
pub(crate) fn ring_set_waiting<W: Word<V = u64>>(waiting: &W, word: u64) {
    waiting.store(word, Ordering::Relaxed);
    W::fence(Ordering::SeqCst);
}

/// The doorbells a producer rings for the waiting word it read after publishing an entry
/// ([`ring_published`]): the word's bits, unless it rang them for this very word already
/// (`rang`, the producer's memory). The consumer publishes a new word on every wake-up and
/// before every sleep, and looks at the ring after each; so while the word is the one rung
/// for, its sleeper is yet to wake (and will look), or woke and will look after its next
/// publish. Either way it sees the entry: ringing again would only cost a system call, which
/// at `redis-benchmark -P 16` was four in five of the server's doorbells.
#[inline]
pub(crate) fn doorbells(word: u64, rang: &mut u64) -> u32 {
    let bits = waiting_bits(word);
    if bits == 0 || word == *rang {
        return 0;
    }
    *rang = word;
    bits
}

/// Whether a same-host ring is empty, from its consumer (the entries before `tail` are
/// visible when it says no).
pub(crate) fn ring_is_empty<T: Word<V = u64>>(tail: &T, head: &T) -> bool {
    tail.load(Ordering::Acquire) == head.load(Ordering::Relaxed)
}

#[cfg(all(test, loom))]
mod model;
