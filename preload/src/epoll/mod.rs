//! The epoll registrations applications make for our descriptors. epoll watches open files, not
//! descriptor numbers, so when we put another file at an application's number (a pair in place
//! of a TCP socket, or the TCP socket back after a fallback) the registrations are moved: taken
//! off the old file, put on the new one with the application's events and data.
//!
//! One lock orders file swaps against the application's `epoll_ctl` on managed descriptors: an
//! `epoll_ctl` racing a swap either lands before it (and is moved) or after it (on the new
//! file), never on the old file unrecorded. Registrations are kept only while the number is
//! ours: a number handed back as plain TCP, or closed, has none left to be replayed later onto
//! an unrelated socket that reuses the number.
//!
//! Also here: the kernel's view of a connection (`show_kernel`: its pair at the number, the
//! registrations moved onto it), the link groups' descriptors in the application's sets
//! (application driving), the application's `epoll_ctl` and `epoll_wait`, and the sets we
//! answer ourselves (`vepoll`). Below the socket machinery (`shim`), which drops a number's
//! registrations when it stops being ours and moves them when a connection settles; what a
//! wait asks of the machinery (an accepted connection starts negotiating) is handed in by the
//! hook (`ctl`'s `start`).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::guard::Bypass;
use crate::pair::Pair;
use crate::sock::{Settling, Sock};
use crate::{log, real, table};

pub(crate) mod vepoll;

/// Link groups whose event descriptor an application's epoll set watches, by (epoll
/// descriptor, group id): when it fires, the thread in `epoll_wait` handles what arrived
/// itself (`smcr::Driver`), so the message that makes a socket readable costs one wake-up
/// (that thread's) instead of two (the group's poller, then the application).
///
/// The value: the registering process, the driver, and the group's UDP socket if the set
/// watches it too (`RXS`).
static DRIVERS: Mutex<BTreeMap<(i32, u64), Driven>> = Mutex::new(BTreeMap::new());
type Driven = (u32, smcr::Driver, Option<i32>);
static ANY_DRIVER: AtomicBool = AtomicBool::new(false);
/// The high half of the event data we register group descriptors with (the low half is the
/// group id); an application's own data matching it *and* a known group is not expected.
const TAG: u64 = 0xA5C3_5A17_0000_0000;
/// UDP sockets of link groups that an application's epoll set watches, by (epoll descriptor,
/// socket descriptor), with the registering process: while a thread sleeps in that set and
/// holds the group, an arriving packet wakes it directly, not the device's engine thread
/// first (see `smcr::Driver::sleep_begin`). Registered with `RX_TAG | socket`.
static RXS: Mutex<BTreeMap<(i32, i32), u32>> = Mutex::new(BTreeMap::new());
const RX_TAG: u64 = 0xA5C3_5A18_0000_0000;

type Regs = Vec<(i32, libc::epoll_event)>;

static REGS: Mutex<BTreeMap<i32, Regs>> = Mutex::new(BTreeMap::new());

/// The application's `epoll_ctl` (not bypassed). `start`: what an accepted connection not
/// negotiated yet does when a set of ours first holds it (it starts negotiating).
pub(crate) fn ctl(
    epfd: i32,
    op: i32,
    fd: i32,
    ev: *mut libc::epoll_event,
    start: impl FnOnce(&Arc<Settling>),
) -> i32 {
    if op == libc::EPOLL_CTL_ADD && vepoll::has(fd) {
        // An epoll set of ours nested in another: the kernel must answer for it.
        vepoll::to_kernel(fd);
    }
    let Some(sock) = table::get(fd) else {
        // SAFETY: forwarding the application's arguments.
        return unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    };
    MANAGED.store(true, Ordering::Release);
    if let Some(pair) = sock.pair() {
        let kernel_has = REGS
            .lock()
            .get(&fd)
            .is_some_and(|r| r.iter().any(|(e, _)| *e == epfd));
        if let Some(r) = vepoll::ctl(epfd, op, fd, ev, pair, kernel_has) {
            if r != 0 || op == libc::EPOLL_CTL_DEL {
                return r;
            }
            match &*sock {
                Sock::Smc(c) => {
                    if !app_drive() || drive_stream(epfd, &c.stream) {
                        return r;
                    }
                    // Application-driven, a set wakes for a group through the group's
                    // descriptor; without it in the set the kernel keeps this one. (Without
                    // application driving the group's poller handles the messages and the
                    // socket's change kicks the set.)
                    let _ = vepoll::ctl(epfd, libc::EPOLL_CTL_DEL, fd, ev, pair, false);
                }
                Sock::Accepted(a) => {
                    // Waited on: negotiated now, on a worker of this process (its settling
                    // wakes the set through our kick).
                    crate::guard::guarded((), || {
                        start(a);
                    });
                    return r;
                }
                _ => return r,
            }
        }
    }
    let paired = matches!(&*sock, Sock::Smc(_) | Sock::Accepted(_) | Sock::Pending(_));
    drop(sock);
    let shown = if paired && op != libc::EPOLL_CTL_DEL {
        // The kernel answers for this registration: the number shows the connection's
        // kernel pair from now on (also while it settles, see `show_settling`).
        show_kernel(fd)
    } else {
        None
    };
    let mut m = REGS.lock();
    // SAFETY: as above.
    let r = unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    // Still ours once the lock is held: no swap can move the file before this is recorded.
    if r == 0 && table::get(fd).is_some() {
        let regs = m.entry(fd).or_default();
        regs.retain(|(e, _)| *e != epfd);
        if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
            // SAFETY: for ADD and MOD the application passes a valid event.
            regs.push((epfd, unsafe { *ev }));
        }
    }
    drop(m);
    if r == 0 && op != libc::EPOLL_CTL_DEL {
        if let Some(p) = shown {
            // The kernel reports the pair to this set from now on: keep it in step.
            p.observe_epoll();
        }
        drive_with(epfd, fd);
    }
    r
}

/// Records a kernel registration of `fd` in `epfd` (made by us for the application).
pub(crate) fn record(fd: i32, epfd: i32, ev: libc::epoll_event) {
    let mut m = REGS.lock();
    let regs = m.entry(fd).or_default();
    regs.retain(|(e, _)| *e != epfd);
    regs.push((epfd, ev));
}

/// `fd` just became an SMC-R connection with readiness `pair`: the kernel registrations the
/// application made for it (on the TCP socket, before it connected) become ours where they
/// can (see `vepoll`); for the rest the number gets the connection's kernel pair.
pub(crate) fn virtualize(fd: i32, pair: &Arc<Pair>) {
    let mut m = REGS.lock();
    let Some(regs) = m.remove(&fd) else {
        return;
    };
    let mut kept = Vec::new();
    for (epfd, ev) in regs {
        if !vepoll::takes(epfd) {
            // The kernel answers for the set: the registration stays (on the pair, if the
            // number shows it already: made again, an edge-triggered one would fire again).
            kept.push((epfd, ev));
            continue;
        }
        // SAFETY: taking the application's registration out of the kernel (it is re-made
        // as ours, or put back).
        unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
        let ours = vepoll::ctl(epfd, libc::EPOLL_CTL_ADD, fd, &ev, pair, false) == Some(0)
            && (!app_drive() || drive_with(epfd, fd));
        if !ours {
            let _ = vepoll::ctl(epfd, libc::EPOLL_CTL_DEL, fd, &ev, pair, false);
            let mut e = ev;
            // SAFETY: putting the application's registration back.
            unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_ADD, fd, &mut e) };
            kept.push((epfd, ev));
        }
    }
    if !kept.is_empty() {
        m.insert(fd, kept);
        drop(m);
        // (Moves the registrations just recorded onto the pair.)
        if let Some(p) = show_kernel(fd) {
            p.observe_epoll();
        }
    }
}

/// Whether application threads waiting in epoll, poll or select handle their link groups'
/// messages themselves: on unless `SMCR_APP_DRIVE=off`.
pub(crate) fn app_drive() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| smcr::settings::flag("SMCR_APP_DRIVE").unwrap_or(true))
}

/// Adds the event descriptor of `fd`'s link group to `epfd` (once per group and set);
/// whether the set holds it.
pub(crate) fn drive_with(epfd: i32, fd: i32) -> bool {
    if !app_drive() {
        return false;
    }
    let Some(sock) = table::get(fd) else {
        return false;
    };
    let Sock::Smc(c) = &*sock else {
        return false;
    };
    drive_stream(epfd, &c.stream)
}

/// [`drive_with`] for a connection in hand.
fn drive_stream(epfd: i32, stream: &smcr::SmcStream) -> bool {
    if !app_drive() {
        return false;
    }
    let Some(id) = stream.group_id() else {
        return false;
    };
    let mut m = DRIVERS.lock();
    let key = (epfd, id);
    if m.contains_key(&key) {
        return true;
    }
    let Some(d) = stream.driver() else {
        return false;
    };
    let rx = d.rx_fd().filter(|&s| watch_rx(epfd, s));
    let mut ev = libc::epoll_event {
        // Edge-triggered (nobody needs to drain it) and exclusive: when several threads wait on
        // sets holding it, one is woken, and it handles the whole group.
        events: (libc::EPOLLIN | libc::EPOLLET | libc::EPOLLEXCLUSIVE) as u32,
        u64: TAG | (d.id() & 0xffff_ffff),
    };
    // SAFETY: registering a descriptor of ours in the application's epoll set.
    let r = unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_ADD, d.fd(), &mut ev) };
    if r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
        log::line(format_args!(
            "epoll set {epfd} now wakes for link group {} (application-driven)",
            key.1
        ));
        m.insert(key, (table::pid(), d, rx));
        ANY_DRIVER.store(true, Ordering::Release);
        true
    } else {
        false
    }
}

/// Adds a link group's UDP socket to `epfd` (once per socket and set); false if it could not.
fn watch_rx(epfd: i32, sock: i32) -> bool {
    let mut m = RXS.lock();
    if m.contains_key(&(epfd, sock)) {
        return true;
    }
    let mut ev = libc::epoll_event {
        // Edge-triggered: whoever is woken drains the socket; exclusive as for the groups.
        events: (libc::EPOLLIN | libc::EPOLLET | libc::EPOLLEXCLUSIVE) as u32,
        u64: RX_TAG | sock as u32 as u64,
    };
    // SAFETY: registering a descriptor of ours in the application's epoll set.
    let r = unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_ADD, sock, &mut ev) };
    if r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
        log::line(format_args!(
            "epoll set {epfd} now watches the RoCE socket (application-driven receive)"
        ));
        m.insert((epfd, sock), table::pid());
        true
    } else {
        false
    }
}

/// Whether any epoll set watches a link group.
pub(crate) fn driven() -> bool {
    ANY_DRIVER.load(Ordering::Acquire)
}

/// Set once a descriptor of ours was registered in an epoll set: from then on `epoll_wait`
/// goes through `wait` (which takes our own events out of what the kernel reports), even
/// before a link group is there.
static MANAGED: AtomicBool = AtomicBool::new(false);

/// Whether `epoll_wait` must go through `wait` (else it is passed through).
pub(crate) fn managed() -> bool {
    MANAGED.load(Ordering::Acquire) || driven()
}

/// An epoll descriptor was closed: its group registrations went with it.
pub(crate) fn closed_epfd(epfd: i32) {
    vepoll::closed_epfd(epfd);
    if driven() {
        DRIVERS.lock().retain(|(e, _), _| *e != epfd);
        RXS.lock().retain(|(e, _), _| *e != epfd);
    }
}

/// The application's `epoll_wait` on `epfd` for at most `maxevents` events (`call(buffer,
/// max, timeout)` runs the real one): events of our group descriptors are handled here and
/// taken out of the result, and the set's registrations of ours (`vepoll`) add theirs; if
/// only ours came and nothing is ready, the wait goes on for the rest of the timeout.
///
/// A thread whose wait returns events is corked (`smcr::cork`): the replies it writes on UDP
/// links until it calls in again (this wait's next call first) leave together.
pub(crate) fn wait(
    epfd: i32,
    events: *mut libc::epoll_event,
    maxevents: i32,
    timeout_ms: i32,
    call: impl FnMut(*mut libc::epoll_event, i32, i32) -> i32,
) -> i32 {
    smcr::cork::end();
    let r = wait_events(epfd, events, maxevents, timeout_ms, call);
    if r > 0 {
        smcr::cork::begin();
    }
    r
}

fn wait_events(
    epfd: i32,
    events: *mut libc::epoll_event,
    maxevents: i32,
    timeout_ms: i32,
    mut call: impl FnMut(*mut libc::epoll_event, i32, i32) -> i32,
) -> i32 {
    let deadline =
        (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    let mut t = timeout_ms;
    let max = maxevents.max(0) as usize;
    let _waiting = vepoll::Waiting::new(epfd);
    loop {
        let virt = vepoll::has(epfd);
        // The groups this set wakes for: while we sleep, their completions wake us (not their
        // pollers); what came before we got here is handled first, then we only look.
        let mut asleep = Asleep(Vec::new());
        let mut handled = false;
        {
            let _own = crate::guard::Bypass::new();
            let mut gone = Vec::new();
            for (id, d, rx) in own_drivers(epfd) {
                if t == 0 {
                    // A loop that polls without sleeping handles what arrived (and keeps the
                    // group held, see `smcr::RuntimeConfig::app_hold`). It receives too: while
                    // it holds the group, nobody else drains the socket.
                    if rx.is_some() {
                        d.receive();
                    } else {
                        d.progress();
                    }
                    continue;
                }
                match d.sleep_begin(rx.is_some()) {
                    Some(true) => asleep.0.push(d),
                    Some(false) => handled = true,
                    None => gone.push(id),
                }
            }
            forget_groups(epfd, &gone);
        }
        // Our registrations that are ready already: no sleep, and room kept for them. (Looked
        // at once the groups are driven: what changes from now on wakes the set.)
        let pending = if virt && max > 0 {
            vepoll::ready(epfd, std::ptr::null_mut(), max, false)
        } else {
            0
        };
        let kmax = if pending > 0 {
            (max - pending.min(max - 1)) as i32
        } else {
            maxevents
        };
        let slept = Instant::now();
        let n = call(events, kmax, if handled || pending > 0 { 0 } else { t });
        // What follows may touch errno (futex waits in locks): the application sees the
        // real call's.
        let errno = std::io::Error::last_os_error().raw_os_error();
        if !asleep.0.is_empty() {
            let slept = slept.elapsed();
            // SAFETY: the kernel filled `n` events at `events` (none if n <= 0).
            let evs = unsafe { std::slice::from_raw_parts(events, n.max(0) as usize) };
            let _own = crate::guard::Bypass::new();
            for d in asleep.0.drain(..) {
                let woken = evs.iter().any(|e| e.u64 == TAG | (d.id() & 0xffff_ffff));
                d.sleep_end(slept, woken);
            }
        }
        if n < 0 {
            if let Some(e) = errno {
                crate::guard::set_errno(e);
            }
            return n;
        }
        // SAFETY: the kernel filled `n` events at `events`.
        let evs = unsafe { std::slice::from_raw_parts_mut(events, n as usize) };
        let mut kept = 0;
        let mut ours = false;
        for i in 0..evs.len() {
            let data = evs[i].u64;
            if data & 0xffff_ffff_0000_0000 == vepoll::KICK_TAG && data as u32 as i32 == epfd {
                // A registration of ours became ready elsewhere: looked at below.
                ours = true;
                continue;
            }
            if data & 0xffff_ffff_0000_0000 == RX_TAG {
                let sock = data as u32 as i32;
                let pid = RXS.lock().get(&(epfd, sock)).copied();
                if let Some(pid) = pid {
                    ours = true;
                    // A forked child sharing the set leaves the parent's socket alone and
                    // passes the (exclusive) wake-up on.
                    if pid == table::pid() {
                        receive(epfd, sock);
                    } else {
                        pass_on_rx(epfd, sock);
                    }
                    continue;
                }
            }
            if data & 0xffff_ffff_0000_0000 == TAG {
                let d = DRIVERS.lock().get(&(epfd, data & 0xffff_ffff)).cloned();
                if let Some((pid, d, rx)) = d {
                    ours = true;
                    // A forked child sharing the epoll set must not take the parent's
                    // messages: it passes the event on (the registration is exclusive, so
                    // this wake-up may have been the parent's only one).
                    if pid == table::pid() {
                        let _own = crate::guard::Bypass::new();
                        // With the socket watched too, this may be a child's pass-on of its
                        // wake-up: receive as well.
                        let alive = if rx.is_some() {
                            d.receive()
                        } else {
                            d.progress()
                        };
                        if !alive {
                            DRIVERS.lock().remove(&(epfd, data & 0xffff_ffff));
                        }
                    } else {
                        let one = 1u64.to_ne_bytes();
                        // SAFETY: 8 bytes to the group's eventfd, inherited from the parent.
                        unsafe { real::write()(d.fd(), one.as_ptr().cast(), one.len()) };
                    }
                    continue;
                }
            }
            evs[kept] = evs[i];
            kept += 1;
        }
        // (A registration of ours may have appeared while we slept: a connect installed.)
        let nv = if virt || ours {
            // SAFETY: `events` has room for `maxevents`; `kept` of them are used.
            vepoll::ready(epfd, unsafe { events.add(kept) }, max - kept, true)
        } else {
            0
        };
        if kept + nv > 0 {
            return (kept + nv) as i32;
        }
        if t == 0 || (n == 0 && !handled && pending == 0 && !ours) {
            // Nothing, and the time is up.
            return 0;
        }
        // Only our wake-ups, or what we handled made nothing ready here: wait on for what is
        // left of the timeout.
        t = match left(deadline) {
            Some(0) => return 0,
            Some(ms) => ms,
            None => -1,
        };
    }
}

/// `sock`, watched by `epfd`, fired: receives what waits there and handles what it brought
/// for every group the set drives.
fn receive(epfd: i32, sock: i32) {
    let _own = crate::guard::Bypass::new();
    let mut received = false;
    let mut gone = Vec::new();
    for (id, d, rx) in own_drivers(epfd) {
        let alive = if !received && rx == Some(sock) {
            received = d.receive();
            received
        } else {
            d.progress()
        };
        if !alive {
            gone.push(id);
        }
    }
    forget_groups(epfd, &gone);
    if !received {
        // No group of this set arrives on the socket any more: stop watching it (a set
        // woken for packets it cannot drain would be woken for nothing, or swallow the
        // wake-up of another set).
        if RXS.lock().remove(&(epfd, sock)).is_some() {
            // SAFETY: removing our own registration from the application's set.
            unsafe { real::epoll_ctl()(epfd, libc::EPOLL_CTL_DEL, sock, std::ptr::null_mut()) };
        }
    }
}

/// The groups `epfd` drives for this process: (group id, driver, watched socket).
fn own_drivers(epfd: i32) -> Vec<(u64, smcr::Driver, Option<i32>)> {
    let me = table::pid();
    DRIVERS
        .lock()
        .range((epfd, 0)..=(epfd, u64::MAX))
        .filter(|(_, (pid, _, _))| *pid == me)
        .map(|(k, (_, d, rx))| (k.1, d.clone(), *rx))
        .collect()
}

/// Drops the entries of groups found gone.
fn forget_groups(epfd: i32, ids: &[u64]) {
    if !ids.is_empty() {
        let mut m = DRIVERS.lock();
        for id in ids {
            m.remove(&(epfd, *id));
        }
    }
}

/// A forked child sharing `epfd` was woken for the parent's socket `sock`: it passes the
/// wake-up on to the parent through the group descriptors watching it (inherited eventfds;
/// the parent drains the socket when one fires, see `wait`).
fn pass_on_rx(epfd: i32, sock: i32) {
    let fds: Vec<i32> = DRIVERS
        .lock()
        .range((epfd, 0)..=(epfd, u64::MAX))
        .filter(|(_, (_, _, rx))| *rx == Some(sock))
        .map(|(_, (_, d, _))| d.fd())
        .collect();
    let one = 1u64.to_ne_bytes();
    for fd in fds {
        // SAFETY: 8 bytes to a group's eventfd, inherited from the parent.
        unsafe { real::write()(fd, one.as_ptr().cast(), one.len()) };
    }
}

/// Drivers between `sleep_begin` and `sleep_end`; a panic on the way ends their sleeps too
/// (a group left driven would never be handled by its poller again).
pub(crate) struct Asleep(pub(crate) Vec<smcr::Driver>);

impl Drop for Asleep {
    fn drop(&mut self) {
        for d in self.0.drain(..) {
            d.sleep_end(Duration::ZERO, false);
        }
    }
}

/// Milliseconds left until `deadline` (at least 1 unless it passed), `None` without one.
pub(crate) fn left(deadline: Option<Instant>) -> Option<i32> {
    deadline.map(|d| {
        let left = d.saturating_duration_since(Instant::now());
        if left.is_zero() {
            0
        } else {
            left.as_millis().clamp(1, i32::MAX as u128) as i32
        }
    })
}

/// The application is closing `fd` (still open): with `unregister`, its registrations are
/// taken off the file first (see the close hook); either way they are forgotten.
pub(crate) fn closed(fd: i32, unregister: bool) {
    vepoll::forget_fd(fd);
    let mut m = REGS.lock();
    if let Some(regs) = m.remove(&fd)
        && unregister
    {
        for (ep, _) in regs {
            // SAFETY: removing a registration the application made on this number.
            unsafe { real::epoll_ctl()(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
        }
    }
}

/// `fd` is a new file or no longer ours: nothing recorded for it applies any more.
pub(crate) fn forget(fd: i32) {
    vepoll::forget_fd(fd);
    let mut m = REGS.lock();
    if !m.is_empty() {
        m.remove(&fd);
    }
}

/// Puts `file` at the application's number `fd` (dup3 with `flags`), moving the registrations
/// made for `fd` to it, then runs `then` (the table update) before any `epoll_ctl` on `fd` can
/// run; if `fd` is no longer ours afterwards, its registrations are dropped. Nothing happens
/// unless `still()` says, under the lock, that the number still shows what the caller means
/// (a close removes the number's entry first, then takes this lock: a number closed and
/// reused meanwhile is left alone).
pub(crate) fn swap(
    fd: i32,
    file: i32,
    flags: i32,
    still: impl FnOnce() -> bool,
    then: impl FnOnce(),
) -> std::io::Result<()> {
    let mut m = REGS.lock();
    if !still() {
        return Err(std::io::Error::from_raw_os_error(libc::EBADF));
    }
    let regs = m.get(&fd).cloned().unwrap_or_default();
    for (ep, _) in &regs {
        // SAFETY: removing a registration the application made.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    // SAFETY: putting a descriptor we own at the application's number.
    let r = unsafe { real::dup3()(file, fd, flags) };
    let err = std::io::Error::last_os_error();
    for (ep, ev) in &regs {
        let mut ev = *ev;
        // SAFETY: re-adding the application's registration with its events and data.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
    then();
    if table::get(fd).is_none() {
        m.remove(&fd);
    }
    drop(m);
    for (ep, _) in &regs {
        drive_with(*ep, fd);
    }
    if r < 0 { Err(err) } else { Ok(()) }
}

/// The kernel must answer for the socket at `fd` (an epoll set of the kernel's, a poll of the
/// kernel's): for an SMC-R connection, the number gets its kernel pair (made now if needed),
/// kept in step from then on. Other sockets of ours show their TCP socket, whose readiness the
/// kernel reports itself. Returns the socket's pair if the number shows one.
pub(crate) fn show_kernel(fd: i32) -> Option<Arc<Pair>> {
    let sock = table::get(fd)?;
    let c = match &*sock {
        Sock::Smc(c) => c,
        Sock::Accepted(a) | Sock::Pending(a) => return show_settling(fd, &sock, a),
        _ => return None,
    };
    let pair = c.pair.clone();
    let _b = Bypass::new();
    if let Some(app) = kernel_end(fd, &pair)? {
        put_pair(&sock, &app, c.nonblock.load(Ordering::Relaxed));
    }
    Some(pair)
}

/// `pair`'s kernel socketpair, made now: its application end (`Ok(None)`: made before);
/// `None` if it could not be made (logged).
fn kernel_end(fd: i32, pair: &Pair) -> Option<Option<OwnedFd>> {
    pair.kernel_end()
        .map_err(|e| {
            log::line(format_args!(
                "fd {fd}: no socketpair for the kernel's view of the connection: {e}"
            ))
        })
        .ok()
}

/// Puts `app`, the application's end of a connection's new kernel pair, at every number
/// showing `sock` (dup'd numbers share it), with the application's O_NONBLOCK; how many show
/// it now.
fn put_pair(sock: &Arc<Sock>, app: &OwnedFd, nonblock: bool) -> usize {
    crate::fds::set_nonblocking(app.as_raw_fd(), nonblock);
    let mut shown = 0;
    for n in table::numbers_of(sock) {
        match replace(n, app.as_raw_fd(), sock, || {}) {
            Ok(()) => shown += 1,
            Err(e) => log::line(format_args!("fd {n}: could not show readiness: {e}")),
        }
    }
    shown
}

/// [`show_kernel`] for a connection not settled yet (an accepted one starts negotiating now):
/// until it settles, its numbers show its pair (not readable, writable once TCP is connected:
/// a TCP connection with nothing received yet) instead of the TCP socket, where the peer's
/// CLC messages would read as data. Settled as SMC-R the pair stays; as TCP the numbers get
/// the socket back (`shim::outcome`). `None` when the numbers show a TCP socket (it settled
/// as TCP, or no descriptor was left for the pair).
fn show_settling(fd: i32, sock: &Arc<Sock>, a: &Arc<Settling>) -> Option<Arc<Pair>> {
    crate::guard::guarded((), || {
        a.start(fd);
    });
    let _b = Bypass::new();
    let mut st = a.st.lock();
    if st.state == crate::sock::State::Done {
        drop(st);
        // Settled meanwhile: shown as what it became.
        return match table::get(fd) {
            Some(now) if !Arc::ptr_eq(&now, sock) => show_kernel(fd),
            _ => None,
        };
    }
    if st.shown.is_some() {
        return Some(a.pair.clone());
    }
    if st.replaced {
        return None;
    }
    // Taken while the number surely is the TCP socket (the settling lock keeps the outcome
    // from swapping it meanwhile).
    let tcp = crate::fds::hide(fd).ok()?;
    let app = kernel_end(fd, &a.pair)??;
    if put_pair(sock, &app, a.nonblock.load(Ordering::Relaxed)) == 0 {
        return None;
    }
    st.shown = Some(Arc::new(tcp));
    a.shows_pair.store(true, Ordering::Release);
    Some(a.pair.clone())
}

/// Puts `file` at the application's number `fd`, moving the epoll registrations the
/// application made for `fd` to the new file; `then` (the table update) runs before the
/// application's next `epoll_ctl` on `fd` ([`swap`]). A pair (`ours`) is always
/// close-on-exec, the flag the application set being kept as its view.
fn replace(fd: i32, file: i32, sock: &Arc<Sock>, then: impl FnOnce()) -> io::Result<()> {
    let cloexec = table::app_cloexec(fd);
    table::set_cloexec_view(fd, cloexec);
    let still = || table::get_any(fd).is_some_and(|s| Arc::ptr_eq(&s, sock));
    swap(fd, file, libc::O_CLOEXEC, still, then)
}
