//! poll/ppoll/select/pselect on our sockets. They would work without us (the application's
//! number is a socketpair end whose readiness we set), but then every message passes the
//! device's engine thread and the group's poller before the waiting thread wakes. Here, as in
//! `epoll_wait` (epoll/mod.rs), the thread in the call watches its link groups' descriptors (and
//! their UDP socket) along with the application's, and handles what arrives itself: one
//! wake-up per message instead of two or three.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use libc::pollfd;

use crate::epoll::{Asleep, app_drive, left};
use crate::pair::Pair;
use crate::sock::Sock;
use crate::{guard, table, wake};

thread_local! {
    /// The extended poll array, kept between calls (no allocation per wait). It has a
    /// destructor: read with `try_with` only.
    static BUF: Cell<Vec<pollfd>> = const { Cell::new(Vec::new()) };
}

/// The sockets of ours among a poll's or select's descriptors (SMC-R connections, and
/// connections being settled), and the link groups of the connections (each once). The call
/// answers for these sockets itself (`run`): this thread's waker wakes it for a change made on
/// another thread and, with application driving, the call also drives the groups (their
/// descriptors wake it for arrivals, and it handles them). Only without application driving
/// and without a waker (no descriptor for one) does the kernel answer (SMC-R connections show
/// their kernel pair, kept in step while the value lives).
pub(crate) struct Ours {
    pub(crate) drivers: Vec<smcr::Driver>,
    /// Each socket, and whether the call answers for it (`polled`) or the kernel does.
    socks: Vec<(std::sync::Arc<Pair>, bool)>,
    /// The call answers for sockets of ours.
    pub(crate) virt: bool,
    /// The call drives the link groups of its connections (application driving).
    drive: bool,
    pub(crate) waker: Option<i32>,
}

impl Drop for Ours {
    fn drop(&mut self) {
        for (p, polled) in &self.socks {
            match (polled, self.waker) {
                (true, Some(w)) => p.polled_by(w, false),
                (true, None) => {}
                (false, _) => p.observe(false),
            }
        }
    }
}

/// [`Ours`] for the descriptors `fds`; `None` if none is an SMC-R connection of this process.
pub(crate) fn ours(fds: impl Iterator<Item = i32>) -> Option<Ours> {
    let drive = app_drive();
    let mut out = Ours {
        drivers: Vec::new(),
        socks: Vec::new(),
        virt: drive,
        drive,
        waker: None,
    };
    let mut asked = false;
    for fd in fds {
        if crate::epoll::vepoll::has(fd) {
            // An epoll set with registrations of ours, polled: the kernel must answer for it.
            crate::epoll::vepoll::to_kernel(fd);
        }
        let Some(sock) = table::get(fd) else { continue };
        let Some(pair) = sock.pair().cloned() else {
            continue;
        };
        if !asked {
            // Taken once per call, when a socket of ours is first among the descriptors.
            asked = true;
            out.waker = wake::waker();
            out.virt |= out.waker.is_some();
        }
        if !out.virt {
            // The kernel answers: an SMC-R connection shows its kernel pair (the others their
            // TCP socket, which the kernel answers for).
            if let Some(p) = crate::epoll::show_kernel(fd) {
                p.observe(true);
                out.socks.push((p, false));
            }
            continue;
        }
        match &*sock {
            Sock::Smc(c) if drive => {
                if let Some(d) = c.stream.driver()
                    && !out.drivers.iter().any(|o| o.id() == d.id())
                {
                    out.drivers.push(d);
                }
            }
            Sock::Accepted(a) => {
                // Waited on: negotiated now, on a worker of this process.
                guard::guarded((), || {
                    a.start(fd);
                });
            }
            _ => {}
        }
        if let Some(w) = out.waker {
            pair.polled_by(w, true);
        }
        out.socks.push((pair, true));
    }
    if out.socks.is_empty() {
        return None;
    }
    say_driven(&out.drivers);
    Some(out)
}

/// Says once per group which waits drive groups (for the log).
fn say_driven(out: &[smcr::Driver]) {
    // Said once per group: which waits drive groups (the last one said is checked without
    // the lock).
    static LAST: AtomicU64 = AtomicU64::new(0);
    static SAID: parking_lot::Mutex<Vec<u64>> = parking_lot::Mutex::new(Vec::new());
    for d in out {
        let tag = d.id().wrapping_add(1);
        if LAST.swap(tag, Ordering::Relaxed) == tag {
            continue;
        }
        let mut said = SAID.lock();
        if !said.contains(&tag) && said.len() < 256 {
            said.push(tag);
            drop(said);
            crate::log::line(format_args!(
                "poll/select now drives link group {} (application-driven)",
                d.id()
            ));
        }
    }
}

/// The application's poll on `fds` (`call(array, timeout)` runs the real one) with our sockets
/// among them (`ours`): the link groups' descriptors are watched too and what they bring is
/// handled here; the application sees only its own entries and the count of those ready.
pub(crate) fn wait(
    fds: &mut [pollfd],
    ours: &Ours,
    timeout_ms: i32,
    mut call: impl FnMut(&mut [pollfd], i32) -> i32,
) -> i32 {
    let deadline =
        (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    let mut t = timeout_ms;
    // Taken out while in use: a signal handler polling inside this poll finds it empty and
    // grows its own.
    let mut buf = BUF.try_with(Cell::take).unwrap_or_default();
    let n = run(fds, ours, &mut t, deadline, &mut buf, &mut call);
    let _ = BUF.try_with(|b| b.set(buf));
    n
}

fn run(
    fds: &mut [pollfd],
    ours_: &Ours,
    t: &mut i32,
    deadline: Option<Instant>,
    buf: &mut Vec<pollfd>,
    call: &mut impl FnMut(&mut [pollfd], i32) -> i32,
) -> i32 {
    let mut ds_own = ours_.drivers.clone();
    let n_app = fds.len();
    // Our sockets among the entries: with application driving, their events come from the
    // connections' state, and the kernel does not look at them (their entries go to it as
    // -1, which it skips).
    let pairs: Vec<Option<std::sync::Arc<Pair>>> = if !ours_.virt {
        Vec::new()
    } else {
        fds.iter().map(|p| pair_of(p.fd)).collect()
    };
    let kick = ours_.waker.filter(|_| !pairs.is_empty());
    let _polling = wake::Polling::new();
    loop {
        // A connection settled meanwhile (SMC-R now) is woken through its group from now on.
        for p in pairs.iter().flatten().filter(|_| ours_.drive) {
            if let Some(d) = p.driver()
                && !ds_own.iter().any(|o| o.id() == d.id())
            {
                ds_own.push(d.clone());
            }
        }
        let ds = &ds_own[..];
        buf.clear();
        buf.extend(fds.iter().enumerate().map(|(i, p)| {
            if pairs.get(i).is_some_and(Option::is_some) {
                pollfd {
                    fd: -1,
                    events: 0,
                    revents: 0,
                }
            } else {
                *p
            }
        }));
        // The groups' descriptors follow the application's entries: first each group's event
        // descriptor, then each distinct UDP socket.
        let mut asleep = Asleep(Vec::new());
        let mut handled = false;
        let mut rxs: Vec<i32> = Vec::new();
        {
            let _own = guard::Bypass::new();
            if *t == 0 {
                // A poll that does not sleep: what arrived is handled first (the group stays
                // held, see `smcr::RuntimeConfig::app_hold`, so nobody else drains its socket).
                handle(
                    ds,
                    &ds.iter()
                        .filter_map(smcr::Driver::rx_fd)
                        .collect::<Vec<_>>(),
                );
            } else {
                for d in ds {
                    let rx = d.rx_fd();
                    match d.sleep_begin(rx.is_some()) {
                        Some(true) => asleep.0.push(d.clone()),
                        Some(false) => handled = true,
                        None => continue,
                    }
                    buf.push(pollfd {
                        fd: d.fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    if let Some(s) = rx
                        && !rxs.contains(&s)
                    {
                        rxs.push(s);
                    }
                }
            }
        }
        let groups = buf.len();
        buf.extend(rxs.iter().map(|&fd| pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        // This thread's waker last: a change made on another thread wakes the call.
        if let Some(k) = kick {
            buf.push(pollfd {
                fd: k,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let rx_end = buf.len() - usize::from(kick.is_some());
        // Ours ready already (looked at once the groups are driven: what changes from now on
        // wakes the call): no sleep.
        let pending = fds
            .iter()
            .zip(&pairs)
            .any(|(p, o)| o.as_ref().is_some_and(|o| revents_of(o, p.events) != 0));
        let slept = Instant::now();
        let n = call(buf, if handled || pending { 0 } else { *t });
        // What follows may touch errno (futex waits in locks): the application sees the real
        // call's.
        let errno = std::io::Error::last_os_error().raw_os_error();
        let mut ours = handled;
        {
            let _own = guard::Bypass::new();
            let slept = slept.elapsed();
            for d in asleep.0.drain(..) {
                let woken = buf[n_app..groups]
                    .iter()
                    .any(|p| p.fd == d.fd() && p.revents != 0);
                d.sleep_end(slept, woken);
            }
            if n > 0 {
                for p in &buf[n_app..groups] {
                    if p.revents != 0 {
                        ours = true;
                        drain(p.fd);
                    }
                }
                let fired: Vec<i32> = buf[groups..rx_end]
                    .iter()
                    .filter(|p| p.revents != 0)
                    .map(|p| p.fd)
                    .collect();
                if kick.is_some() && buf[rx_end].revents != 0 {
                    ours = true;
                    drain(buf[rx_end].fd);
                }
                if ours || !fired.is_empty() {
                    ours = true;
                    handle(ds, &fired);
                }
            }
        }
        if n < 0 {
            if let Some(e) = errno {
                guard::set_errno(e);
            }
            return n;
        }
        let mut ready = 0;
        for (i, a) in fds.iter_mut().enumerate() {
            a.revents = match pairs.get(i) {
                Some(Some(p)) => revents_of(p, a.events),
                _ => buf[i].revents,
            };
            ready += i32::from(a.revents != 0);
        }
        if ready > 0 || *t == 0 || (n == 0 && !ours && !pending) {
            // Something for the application, or the time is up.
            return ready;
        }
        // Only our descriptors fired and nothing is ready: wait on for what is left.
        *t = left(deadline).unwrap_or(-1);
        if *t == 0 {
            return 0;
        }
    }
}

/// The readiness of `fd` if it is a socket of ours this process answers for (an SMC-R
/// connection, or one being settled).
fn pair_of(fd: i32) -> Option<std::sync::Arc<Pair>> {
    table::get(fd)?.pair().cloned()
}

/// The poll events of a socket in `state`'s pair, for a request of `events` (POLLERR and
/// POLLHUP always): the epoll bits are poll's (POLLIN = EPOLLIN, and so on).
fn revents_of(pair: &Pair, events: i16) -> i16 {
    let want = (events as u16 as u32) | (libc::POLLERR | libc::POLLHUP) as u32;
    (crate::epoll::vepoll::events_of(pair.latest()) & want) as i16
}

/// Handles what woke the wait: the UDP sockets in `fired` are received from (once each, by
/// a group arriving on it), every group's completions are taken.
fn handle(ds: &[smcr::Driver], fired: &[i32]) {
    let mut done: Vec<i32> = Vec::new();
    for d in ds {
        match d.rx_fd() {
            Some(s) if fired.contains(&s) && !done.contains(&s) => {
                done.push(s);
                d.receive();
            }
            _ => {
                d.progress();
            }
        }
    }
}

/// Empties a group's event descriptor (poll is level-triggered; it is non-blocking).
fn drain(fd: i32) {
    let mut b = [0u8; 8];
    // SAFETY: reading 8 bytes from our own eventfd into a local buffer.
    unsafe { crate::real::read()(fd, b.as_mut_ptr().cast(), b.len()) };
}

/// The application's select (`pselect` with `sigmask`) as a poll through [`wait`], when a
/// descriptor in its sets is one of our connections; `None`: none is, call the real one.
pub(crate) fn select(
    nfds: i32,
    sets: [*mut libc::fd_set; 3],
    timeout_ms: i32,
    call: impl FnMut(&mut [pollfd], i32) -> i32,
) -> Option<i32> {
    let nfds = nfds.clamp(0, libc::FD_SETSIZE as i32);
    let isset = |set: *mut libc::fd_set, fd: i32| {
        // SAFETY: a non-null set is the caller's fd_set, and fd < FD_SETSIZE.
        !set.is_null() && unsafe { libc::FD_ISSET(fd, set) }
    };
    let asked = |fd: i32| sets.iter().any(|&s| isset(s, fd));
    let ours = ours((0..nfds).filter(|&fd| asked(fd)))?;
    let mut fds: Vec<pollfd> = (0..nfds)
        .filter_map(|fd| {
            let mut events = 0;
            if isset(sets[0], fd) {
                events |= libc::POLLIN;
            }
            if isset(sets[1], fd) {
                events |= libc::POLLOUT;
            }
            if isset(sets[2], fd) {
                events |= libc::POLLPRI;
            }
            (events != 0).then_some(pollfd {
                fd,
                events,
                revents: 0,
            })
        })
        .collect();
    let n = wait(&mut fds, &ours, timeout_ms, call);
    drop(ours);
    if n < 0 {
        return Some(n);
    }
    if fds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        guard::set_errno(libc::EBADF);
        return Some(-1);
    }
    for s in sets.iter().filter(|s| !s.is_null()) {
        // SAFETY: clearing the caller's set.
        unsafe { libc::FD_ZERO(*s) };
    }
    // As the kernel's select: hang-up and error count as readable, error as writable.
    let mut count = 0;
    for p in &fds {
        let r = p.revents;
        let hits = [
            (libc::POLLIN | libc::POLLHUP | libc::POLLERR, libc::POLLIN),
            (libc::POLLOUT | libc::POLLERR, libc::POLLOUT),
            (libc::POLLPRI, libc::POLLPRI),
        ];
        for (i, (mask, want)) in hits.into_iter().enumerate() {
            if p.events & want != 0 && r & mask != 0 {
                // SAFETY: setting a bit of the caller's set (it asked for this descriptor).
                unsafe { libc::FD_SET(p.fd, sets[i]) };
                count += 1;
            }
        }
    }
    Some(count)
}
