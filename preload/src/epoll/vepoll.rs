//! Epoll sets that we answer ourselves for SMC-R sockets ("virtual registrations").
//!
//! The kernel learns an SMC-R socket's readiness only through its pair (pair.rs), which costs
//! a system call at every change (a byte sent to make it readable, one drained when it is not).
//! When an application registers an SMC-R socket in an epoll set, we keep the registration
//! here instead of in the kernel: our `epoll_wait` hook computes the socket's events from the
//! connection's state (kept lock-free in the pair: `Pair::latest`, `Pair::rises`) with the
//! kernel's semantics — level-triggered, edge-triggered (a new event per rise of a requested
//! bit, per arrival for EPOLLIN), EPOLLONESHOT (silent until EPOLL_CTL_MOD), EPOLLERR and
//! EPOLLHUP always — and merges them with what the kernel reports for the set's other files.
//! The set still wakes a sleeping thread by itself: the link group's event descriptor is in
//! it (epoll/mod.rs), and a change made outside this set's `epoll_wait` (another thread's
//! handling, a shutdown, a failure) writes the set's `kick` eventfd.
//!
//! A set that the kernel must be able to answer for — polled, selected or put in another epoll
//! set — is handed back to the kernel (`to_kernel`): its registrations become kernel ones on
//! the pairs, which are then kept in step.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::Mutex;

use crate::pair::Pair;
use crate::real;

/// The event data of a set's kick eventfd (the low half is the set's descriptor).
pub(crate) const KICK_TAG: u64 = 0xA5C3_5A19_0000_0000;

struct Reg {
    fd: i32,
    pid: u32,
    pair: Arc<Pair>,
    events: u32,
    data: u64,
    /// `Pair::rises` when this registration last reported (edge-triggered).
    seen: [u32; 5],
    /// Report what is ready at the next look even without a new rise: after ADD and MOD the
    /// kernel queues a ready file at once.
    fresh: bool,
    /// False once an EPOLLONESHOT registration reported, until MOD.
    armed: bool,
    /// When it last reported ([`crate::pair::next_stamp`]): a level-triggered registration
    /// that stays ready goes behind the others, as the kernel requeues it at the tail.
    reported: u64,
}

struct Set {
    regs: Vec<Reg>,
    /// Where each registered descriptor is in `regs` (applications such as redis-benchmark
    /// modify a registration several times per request: no scan of the set for that).
    at: HashMap<i32, usize>,
    /// In the set (edge-triggered): written when a registered socket becomes ready outside
    /// this set's `epoll_wait`.
    kick: OwnedFd,
}

static SETS: Mutex<BTreeMap<i32, Set>> = Mutex::new(BTreeMap::new());
/// Sets the kernel answers for (polled, selected or nested): no virtual registrations.
static KERNEL: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());
static ANY: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The set this thread is in `epoll_wait` on (-1: none): what it makes ready there itself
    /// needs no kick. Const-initialised, no destructor.
    static WAITING_ON: Cell<i32> = const { Cell::new(-1) };
}

/// How many of this process's threads are in `epoll_wait` on each set, by descriptor modulo
/// the table's size (two sets in one slot only cost a kick for nothing). A kick with nobody
/// waiting is a system call for nothing, and the next wait returns at once for it:
/// redis-benchmark re-arms EPOLLOUT, ready at once, with EPOLL_CTL_MOD for every request, on
/// the thread that waits in the set. Only this process's threads count: a set shared with a
/// forked process reports each process only its own registrations (`Reg::pid`).
static WAITERS: [AtomicU32; 64] = [const { AtomicU32::new(0) }; 64];

fn waiters(epfd: i32) -> &'static AtomicU32 {
    &WAITERS[epfd as u32 as usize % WAITERS.len()]
}

/// Whether a thread of this process may be in `epoll_wait` on `epfd`. Called after the
/// readiness it would be kicked for was published: the fence pairs with the one in
/// [`Waiting::new`], so either this sees the waiter or the waiter's first look (after its
/// count) sees the readiness.
fn anyone_waits(epfd: i32) -> bool {
    std::sync::atomic::fence(Ordering::SeqCst);
    waiters(epfd).load(Ordering::Relaxed) > 0
}

/// Whether virtual registrations are used: unless `SMCR_VIRTUAL_EPOLL=off`. With application
/// driving the set also holds the groups' event descriptors; without it (`SMCR_APP_DRIVE=off`)
/// the groups' pollers handle the messages and a changed socket kicks the set.
pub(crate) fn on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| smcr::settings::flag("SMCR_VIRTUAL_EPOLL").unwrap_or(true))
}

/// At load: reads the setting ([`on`]) and hands [`kick`] to `wake`, through which pairs
/// wake the sets' waiters (a pair is below this module).
pub(crate) fn init() {
    let _ = on();
    crate::wake::kick_with(kick);
}

/// Whether `epfd` holds virtual registrations (cheap when none exist anywhere).
pub(crate) fn has(epfd: i32) -> bool {
    ANY.load(Ordering::Acquire) && SETS.lock().contains_key(&epfd)
}

/// Whether registrations in `epfd` may be ours (the kernel does not answer for the set).
pub(crate) fn takes(epfd: i32) -> bool {
    on() && !KERNEL.lock().contains(&epfd)
}

/// The application's `epoll_ctl(epfd, op, fd, ev)` for the SMC-R socket `fd` showing `pair`:
/// `Some(result)` if we took it (the kernel holds no registration of `fd` in `epfd`), `None`
/// if it is the kernel's to do. `kernel_has`: the kernel holds one already.
pub(crate) fn ctl(
    epfd: i32,
    op: i32,
    fd: i32,
    ev: *const libc::epoll_event,
    pair: &Arc<Pair>,
    kernel_has: bool,
) -> Option<i32> {
    if !on() || kernel_has || KERNEL.lock().contains(&epfd) {
        return None;
    }
    // Our own calls below (and the closes of descriptors we move) must not reach our hooks,
    // which take the lock held here.
    let _own = crate::guard::Bypass::new();
    let mut sets = SETS.lock();
    let known = sets.get(&epfd).is_some_and(|s| s.at.contains_key(&fd));
    let fail = |e: i32| {
        crate::guard::set_errno(e);
        Some(-1)
    };
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            if ev.is_null() {
                return fail(libc::EFAULT);
            }
            // SAFETY: for ADD and MOD the application passes an event.
            let ev = unsafe { *ev };
            if op == libc::EPOLL_CTL_ADD && known {
                return fail(libc::EEXIST);
            }
            if op == libc::EPOLL_CTL_MOD && !known {
                return fail(libc::ENOENT);
            }
            if ev.events & libc::EPOLLEXCLUSIVE as u32 != 0 && op == libc::EPOLL_CTL_MOD {
                return fail(libc::EINVAL);
            }
            let set = match sets.entry(epfd) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => match new_set(epfd) {
                    Ok(s) => {
                        ANY.store(true, Ordering::Release);
                        v.insert(s)
                    }
                    Err(e) => return fail(e.raw_os_error().unwrap_or(libc::EINVAL)),
                },
            };
            let seen = pair.rises();
            if let Some(r) = set.at.get(&fd).map(|&i| &mut set.regs[i]) {
                r.events = ev.events;
                r.data = ev.u64;
                r.seen = seen;
                r.fresh = true;
                r.armed = true;
            } else {
                set.at.insert(fd, set.regs.len());
                set.regs.push(Reg {
                    fd,
                    pid: crate::table::pid(),
                    pair: pair.clone(),
                    events: ev.events,
                    data: ev.u64,
                    seen,
                    fresh: true,
                    armed: true,
                    reported: crate::pair::next_stamp(),
                });
                pair.watched_by(epfd, true);
            }
            // Ready already: a thread sleeping in the set wakes, as the kernel wakes it when
            // a ready file is added.
            let want = ev.events | (libc::EPOLLERR | libc::EPOLLHUP) as u32;
            if events_of(pair.latest()) & want != 0 && anyone_waits(epfd) {
                let one = 1u64.to_ne_bytes();
                // SAFETY: 8 bytes into our eventfd.
                unsafe { real::write()(set.kick.as_raw_fd(), one.as_ptr().cast(), one.len()) };
            }
            Some(0)
        }
        libc::EPOLL_CTL_DEL => {
            if !known {
                // Not ours: the kernel answers (ENOENT, or it has one after all).
                return None;
            }
            let set = sets.get_mut(&epfd).expect("known");
            set.remove(fd);
            pair.watched_by(epfd, false);
            Some(0)
        }
        _ => fail(libc::EINVAL),
    }
}

impl Set {
    /// Takes `fd`'s registration out (the last one moves into its place).
    fn remove(&mut self, fd: i32) -> Option<Reg> {
        let i = self.at.remove(&fd)?;
        let r = self.regs.swap_remove(i);
        if let Some(moved) = self.regs.get(i) {
            self.at.insert(moved.fd, i);
        }
        Some(r)
    }
}

/// A set's kick eventfd, registered in it.
fn new_set(epfd: i32) -> std::io::Result<Set> {
    // Handed in at load already (see `init`): then only a check. Here too for a set made
    // before our constructor ran.
    crate::wake::kick_with(kick);
    // SAFETY: a new eventfd of ours.
    let k = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if k < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let kick = crate::fds::hide_owned(k)?;
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLET) as u32,
        u64: KICK_TAG | epfd as u32 as u64,
    };
    // SAFETY: registering our descriptor in the application's set (this also checks that
    // `epfd` is an epoll set).
    if unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_ADD, kick.as_raw_fd(), &mut ev) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Set {
        regs: Vec::new(),
        at: HashMap::new(),
        kick,
    })
}

/// Epoll bits of a packed state (see `Pair::latest`), and which of them each rise counter
/// belongs to.
const BITS: [u32; 5] = [
    (libc::EPOLLIN | libc::EPOLLRDNORM) as u32,
    (libc::EPOLLOUT | libc::EPOLLWRNORM) as u32,
    libc::EPOLLRDHUP as u32,
    libc::EPOLLHUP as u32,
    libc::EPOLLERR as u32,
];

pub(crate) fn events_of(state: u32) -> u32 {
    BITS.iter()
        .enumerate()
        .filter(|(i, _)| state & (1 << i) != 0)
        .fold(0, |m, (_, b)| m | b)
}

/// The events of `epfd`'s registrations that are ready, written to `out` (at most `max`);
/// returns how many. With `commit` false nothing is written and no edge-triggered or one-shot
/// state changes (a look before sleeping).
pub(crate) fn ready(epfd: i32, out: *mut libc::epoll_event, max: usize, commit: bool) -> usize {
    if max == 0 {
        return 0;
    }
    let me = crate::table::pid();
    let mut sets = SETS.lock();
    let Some(set) = sets.get_mut(&epfd) else {
        return 0;
    };
    // The ready registrations, in the order they became ready (as the kernel's ready list):
    // the first of their reported bits to rise, or their last report if that came later.
    ORDER.with(|o| {
        let mut order = o.borrow_mut();
        // A consistent look: no change in progress while it ran (a thread handling a link
        // group's messages makes A ready, then B; a look that read A before and B after
        // would report B alone). Retried a few times, then taken as it is.
        let mut looked = false;
        for _ in 0..8 {
            let Some(point) = crate::pair::quiet() else {
                std::thread::yield_now();
                continue;
            };
            order.clear();
            collect(set, me, &mut order);
            looked = true;
            if !crate::pair::changed_since(point) {
                break;
            }
        }
        if !looked {
            order.clear();
            collect(set, me, &mut order);
        }
        order.sort_unstable();
        let n = order.len().min(max);
        if commit {
            for (k, &(_, i, rep)) in order[..n].iter().enumerate() {
                let r = &mut set.regs[i];
                if r.events & libc::EPOLLET as u32 != 0 {
                    r.seen = r.pair.rises();
                }
                r.fresh = false;
                r.reported = crate::pair::next_stamp();
                if r.events & libc::EPOLLONESHOT as u32 != 0 {
                    r.armed = false;
                }
                // SAFETY: the caller's buffer has room for `max` events.
                unsafe {
                    out.add(k).write(libc::epoll_event {
                        events: rep,
                        u64: r.data,
                    })
                };
            }
        }
        n
    })
}

/// The ready registrations of `set` (of process `me`): (order key, index, events).
fn collect(set: &Set, me: u32, order: &mut Vec<(u64, usize, u32)>) {
    for (i, r) in set.regs.iter().enumerate() {
        if r.pid != me || !r.armed {
            continue;
        }
        let want = r.events | (libc::EPOLLERR | libc::EPOLLHUP) as u32;
        let state = r.pair.latest();
        let rep = events_of(state) & want;
        if rep == 0 {
            continue;
        }
        let et = r.events & libc::EPOLLET as u32 != 0;
        if et && !r.fresh {
            let rises = r.pair.rises();
            if !BITS
                .iter()
                .enumerate()
                .any(|(b, bits)| rep & bits != 0 && rises[b] != r.seen[b])
            {
                continue;
            }
        }
        let bits = (0..5)
            .filter(|&b| rep & BITS[b] != 0)
            .fold(0u32, |m, b| m | 1 << b);
        order.push((r.pair.ready_since(bits).max(r.reported), i, rep));
    }
}

thread_local! {
    /// [`ready`]'s list of ready registrations (kept: no allocation per call).
    static ORDER: std::cell::RefCell<Vec<(u64, usize, u32)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `fd` is closed or another file is at its number: its registrations go.
pub(crate) fn forget_fd(fd: i32) {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let mut sets = SETS.lock();
    for (epfd, set) in sets.iter_mut() {
        if let Some(r) = set.remove(fd) {
            r.pair.watched_by(*epfd, false);
        }
    }
}

/// The epoll descriptor `epfd` was closed: its registrations go with it.
pub(crate) fn closed_epfd(epfd: i32) {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let _own = crate::guard::Bypass::new();
    KERNEL.lock().remove(&epfd);
    let set = SETS.lock().remove(&epfd);
    if let Some(set) = set {
        for r in set.regs {
            r.pair.watched_by(epfd, false);
        }
    }
}

/// The kernel must answer for `epfd` from now on (it is polled, selected or nested in another
/// set): its registrations move onto the pairs, which are then kept in step.
pub(crate) fn to_kernel(epfd: i32) {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let _own = crate::guard::Bypass::new();
    KERNEL.lock().insert(epfd);
    let Some(set) = SETS.lock().remove(&epfd) else {
        return;
    };
    for r in set.regs {
        // An SMC-R connection gets its kernel pair at the number (our other sockets show
        // their TCP socket, which the kernel answers for itself).
        if let Some(p) = super::show_kernel(r.fd) {
            p.observe_epoll();
        }
        let mut ev = libc::epoll_event {
            events: r.events,
            u64: r.data,
        };
        // ONESHOT that already fired stays disarmed: registered without events.
        if !r.armed {
            ev.events &= !(libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
        }
        // SAFETY: the application's registration, now made in the kernel.
        if unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_ADD, r.fd, &mut ev) } == 0 {
            super::record(r.fd, epfd, ev);
        }
        r.pair.watched_by(epfd, false);
        crate::log::line(format_args!(
            "epoll set {epfd} is looked at through the kernel: fd {} registered there",
            r.fd
        ));
    }
    // The kick eventfd closes (dropped with the set) and leaves it.
}

/// `fd` (showing `pair` until now) is plain TCP from now on: its registrations of ours, in every
/// set, become the kernel's on the socket (with the application's events and data; a one-shot
/// registration that already fired stays disarmed). Adding a ready socket wakes the set's
/// waiters, as the kernel does.
pub(crate) fn to_kernel_fd(fd: i32, pair: &Arc<Pair>) {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let _own = crate::guard::Bypass::new();
    let mut sets = SETS.lock();
    for (epfd, set) in sets.iter_mut() {
        if !set
            .at
            .get(&fd)
            .is_some_and(|&i| Arc::ptr_eq(&set.regs[i].pair, pair))
        {
            continue;
        }
        let r = set.remove(fd).expect("present");
        pair.watched_by(*epfd, false);
        let mut ev = libc::epoll_event {
            events: r.events,
            u64: r.data,
        };
        if !r.armed {
            ev.events &= !(libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
        }
        // SAFETY: the application's registration, now made in the kernel.
        unsafe { real::epoll_ctl()(*epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
}

/// A registered socket became ready (a bit rose) on this thread: wakes the threads in
/// `epoll_wait` on `sets`, but the set this thread waits on (it looks when it returns). Pairs
/// call it through `wake` (see [`init`]).
pub(crate) fn kick(sets: &[i32]) {
    let mine = WAITING_ON.with(Cell::get);
    let _own = crate::guard::Bypass::new();
    let one = 1u64.to_ne_bytes();
    let guard = SETS.lock();
    for epfd in sets.iter().filter(|&&e| e != mine && anyone_waits(e)) {
        if let Some(s) = guard.get(epfd) {
            // SAFETY: 8 bytes into our eventfd.
            unsafe { real::write()(s.kick.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }
}

/// Marks this thread as waiting on `epfd` while it lives (counted in [`WAITERS`]). Made
/// before the wait's first look at the set's registrations.
pub(crate) struct Waiting {
    epfd: i32,
    before: i32,
}

impl Waiting {
    pub(crate) fn new(epfd: i32) -> Self {
        waiters(epfd).fetch_add(1, Ordering::Relaxed);
        // Pairs with the fence in `anyone_waits` (see there).
        std::sync::atomic::fence(Ordering::SeqCst);
        Self {
            epfd,
            before: WAITING_ON.with(|w| w.replace(epfd)),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING_ON.with(|w| w.set(self.before));
        waiters(self.epfd).fetch_sub(1, Ordering::Relaxed);
    }
}
