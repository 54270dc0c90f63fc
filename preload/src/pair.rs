//! Readiness: a connection's readiness as our poll, select and epoll hooks report it
//! ([`Pair`]), with the kernel socketpair that shows it when the kernel must answer for the
//! socket, and the sink through which `smcr` updates it ([`PairSink`]). A leaf: it wakes the
//! waiters of our epoll sets and poll calls through `wake`, and knows nothing of the sockets
//! that hold it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::fds::hide;
use crate::guard::Bypass;
use crate::{real, wake};

/// A connection's readiness as our poll, select and epoll hooks report it: the latest state,
/// packed, and how often each bit rose (edge-triggered registrations report again when one of
/// theirs moved), read without a lock.
///
/// When the kernel must answer for the socket (an epoll set that is polled, selected or
/// nested, or our epoll off), the application's number gets one end of a Unix socketpair
/// whose readiness we set ([`Pair::kernel_end`]): readable while bytes wait in its receive
/// queue (one more per arrival, so edge-triggered epoll fires again) or once our end shut
/// down writing (EOF, RDHUP); not writable while its send side is filled (through our duplicate
/// of it) until the kernel refuses more; hung up when our end shut down both ways; reset
/// (EPOLLERR, ECONNRESET) when our end closes holding unread bytes. Kept in step only while
/// the kernel may be asked.
pub(crate) struct Pair {
    st: Mutex<PairState>,
    /// The connection's latest state, packed (bit 0 readable, 1 writable, 2 read side hung
    /// up, 3 hung up, 4 error).
    latest: AtomicU32,
    /// How often each of those bits rose (the readable one also at each new arrival).
    rises: [AtomicU32; 5],
    /// When each of those bits last rose from clear ([`next_stamp`]'s order across all
    /// sockets of the process): our epoll reports ready sockets in that order, as the
    /// kernel's ready list does — a program that wrote on A, then on B, sees A first.
    since: [AtomicU64; 5],
    /// Epoll sets that hold the socket as a registration of ours (epoll/vepoll.rs): a bit that
    /// rises wakes their waiters.
    watched: Mutex<Vec<i32>>,
    /// poll/select calls in progress that answer for the socket themselves (poll.rs), by the
    /// waker eventfd of their thread: a bit that rises on another thread wakes them there
    /// (the link group's descriptor cannot: a thread that handled the group's messages may
    /// drain it before the waiting one looks).
    pollers: Mutex<Vec<i32>>,
    /// The connection's link group, to wake those calls (set when SMC-R is up).
    pub(crate) driver: OnceLock<smcr::Driver>,
}

struct PairState {
    /// What the kernel pair shows (what was last applied to it).
    cur: smcr::ReadyState,
    /// The connection's latest state.
    want: smcr::ReadyState,
    /// poll/select calls looking at the kernel pair (our hooks count them), plus `epoll` for
    /// good once a kernel epoll set holds it.
    observers: u32,
    epoll: bool,
    /// The socketpair, once the kernel must answer for the socket.
    kernel: Option<KernelPair>,
    /// The reset is showing as EPOLLERR and nobody collected it yet.
    error_pending: bool,
}

struct KernelPair {
    /// A duplicate of the application's end (same open file), for draining and filling.
    app_dup: OwnedFd,
    /// Our end (non-blocking); gone once the connection was reset.
    ours: Option<OwnedFd>,
}

/// Readiness changes of the process begun and finished: a look at several sockets' states
/// (our epoll) that saw none in progress at its start and none begun by its end saw them all
/// at one moment — never a socket made ready after another one it missed.
static STARTED: AtomicU64 = AtomicU64::new(1);
static FINISHED: AtomicU64 = AtomicU64::new(1);

/// Begins a change; its number orders it among the process's changes (see [`Pair::since`]).
fn begin_change() -> u64 {
    STARTED.fetch_add(1, Ordering::SeqCst)
}

fn end_change() {
    FINISHED.fetch_add(1, Ordering::SeqCst);
}

/// The next number of the process-wide order of readiness changes.
pub(crate) fn next_stamp() -> u64 {
    let s = begin_change();
    end_change();
    s
}

/// A point with no readiness change in progress (to pass to [`changed_since`]), or `None`.
pub(crate) fn quiet() -> Option<u64> {
    let f = FINISHED.load(Ordering::SeqCst);
    let s = STARTED.load(Ordering::SeqCst);
    (s == f).then_some(s)
}

/// Whether a change began since `point`.
pub(crate) fn changed_since(point: u64) -> bool {
    STARTED.load(Ordering::SeqCst) != point
}

impl Pair {
    /// Readiness starting not readable, and writable or not.
    pub(crate) fn new(writable: bool) -> Arc<Self> {
        let s = smcr::ReadyState {
            writable,
            ..Default::default()
        };
        Arc::new(Self {
            latest: AtomicU32::new(pack(s)),
            rises: Default::default(),
            since: Default::default(),
            watched: Mutex::new(Vec::new()),
            pollers: Mutex::new(Vec::new()),
            driver: OnceLock::new(),
            st: Mutex::new(PairState {
                cur: s,
                want: s,
                observers: 0,
                epoll: false,
                kernel: None,
                error_pending: false,
            }),
        })
    }

    /// Whether the kernel pair exists (the application's number shows it).
    pub(crate) fn has_kernel(&self) -> bool {
        self.st.lock().kernel.is_some()
    }

    /// Makes the kernel socketpair, showing the current state; returns the application's end
    /// for the caller to put at the application's number(s). `None` when it exists already.
    pub(crate) fn kernel_end(&self) -> io::Result<Option<OwnedFd>> {
        let mut st = self.st.lock();
        if st.kernel.is_some() {
            return Ok(None);
        }
        let _b = Bypass::new();
        let last = || io::Error::last_os_error();
        // SAFETY: plain descriptor calls on descriptors we create.
        let (app, ours) = unsafe {
            let mut sv = [0; 2];
            if libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                sv.as_mut_ptr(),
            ) != 0
            {
                return Err(last());
            }
            (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]))
        };
        // Small buffers: filling the application's end takes a few kilobytes.
        let one: libc::c_int = 1;
        // SAFETY: setting options and flags on our new descriptors.
        unsafe {
            real::setsockopt()(
                app.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&one as *const libc::c_int).cast(),
                4,
            );
            real::fcntl()(
                ours.as_raw_fd(),
                libc::F_SETFL,
                libc::O_NONBLOCK as libc::c_ulong,
            );
        }
        let ours = smcr::fdzone::place(ours)?;
        let app_dup = hide(app.as_raw_fd())?;
        st.kernel = Some(KernelPair {
            app_dup,
            ours: Some(ours),
        });
        // A fresh pair shows writable, not readable: bring it to the latest state.
        st.cur = smcr::ReadyState {
            writable: true,
            ..Default::default()
        };
        st.observers += 1;
        self.apply(&mut st);
        st.observers -= 1;
        Ok(Some(app))
    }

    /// The connection's state changed: shown through our hooks at once, and through the
    /// kernel pair while someone may look there.
    pub(crate) fn set(&self, now: smcr::ReadyState) {
        let mut st = self.st.lock();
        let before = st.want;
        st.want = now;
        let (old, new) = (pack(before), pack(now));
        let stamp = begin_change();
        let risen = new & !old;
        for (b, s) in self.since.iter().enumerate() {
            if risen & (1 << b) != 0 {
                s.store(stamp, Ordering::Release);
            }
        }
        self.latest.store(new, Ordering::Release);
        let mut rose = risen;
        if now.readable && now.arrivals != before.arrivals {
            rose |= 1;
        }
        for (b, r) in self.rises.iter().enumerate() {
            if rose & (1 << b) != 0 {
                r.fetch_add(1, Ordering::AcqRel);
            }
        }
        end_change();
        if st.kernel.is_some() && (st.observers > 0 || st.epoll || !lazy()) {
            self.apply(&mut st);
        }
        drop(st);
        if rose != 0 {
            self.wake();
        }
    }

    /// Wakes whoever waits on the socket through our hooks.
    fn wake(&self) {
        // Copied out, so no set is woken under the lock; on the stack, as a socket is nearly
        // always in one or two sets (a heap copy would be an allocation per arrival).
        let mut few = [0i32; 4];
        let many;
        let w = self.watched.lock();
        let sets: &[i32] = if w.len() <= few.len() {
            few[..w.len()].copy_from_slice(&w);
            &few[..w.len()]
        } else {
            many = w.clone();
            &many
        };
        drop(w);
        if !sets.is_empty() {
            wake::epoll_sets(sets);
        }
        let pollers = self.pollers.lock();
        if !pollers.is_empty() {
            wake::pollers(&pollers);
        }
    }
    /// The packed latest state (see [`Pair::latest`]).
    pub(crate) fn latest(&self) -> u32 {
        self.latest.load(Ordering::Acquire)
    }

    /// When the first of `bits` (packed-state bits) that is set rose from clear (see
    /// [`Pair::since`]).
    pub(crate) fn ready_since(&self, bits: u32) -> u64 {
        (0..5)
            .filter(|b| bits & (1 << b) != 0)
            .map(|b| self.since[b].load(Ordering::Acquire))
            .min()
            .unwrap_or(0)
    }

    /// The rise counters (see [`Pair::rises`]).
    pub(crate) fn rises(&self) -> [u32; 5] {
        std::array::from_fn(|b| self.rises[b].load(Ordering::Acquire))
    }

    /// A poll or select call on the thread whose waker is `fd` answers for the socket
    /// (`on`), or no longer does.
    pub(crate) fn polled_by(&self, fd: i32, on: bool) {
        let mut p = self.pollers.lock();
        if on {
            p.push(fd);
        } else if let Some(i) = p.iter().position(|&w| w == fd) {
            p.swap_remove(i);
        }
    }

    /// The connection's link group, once it is SMC-R (its descriptor wakes poll calls).
    pub(crate) fn driver(&self) -> Option<&smcr::Driver> {
        self.driver.get()
    }

    /// The connection became SMC-R ([`Self::driver`] set): the poll and select calls in
    /// progress that answer for it are woken, so that they drive its link group from now on
    /// (else its arrivals reach them through the group's poller, one wake-up later).
    pub(crate) fn driver_set(&self) {
        let pollers = self.pollers.lock();
        if !pollers.is_empty() {
            wake::pollers(&pollers);
        }
    }

    /// The epoll set `epfd` holds (`on`) or no longer holds a registration of ours for the
    /// socket.
    pub(crate) fn watched_by(&self, epfd: i32, on: bool) {
        let mut w = self.watched.lock();
        if on {
            w.push(epfd);
        } else if let Some(i) = w.iter().position(|&e| e == epfd) {
            w.swap_remove(i);
        }
    }

    /// The epoll sets holding registrations of ours for the socket.
    pub(crate) fn watchers(&self) -> Vec<i32> {
        self.watched.lock().clone()
    }

    /// A poll or select is about to look at the kernel pair (`true`), or is done (`false`).
    pub(crate) fn observe(&self, on: bool) {
        let mut st = self.st.lock();
        if on {
            st.observers += 1;
            self.apply(&mut st);
        } else {
            st.observers = st.observers.saturating_sub(1);
        }
    }

    /// A kernel epoll set holds the pair: kept in step from now on.
    pub(crate) fn observe_epoll(&self) {
        let mut st = self.st.lock();
        if !st.epoll {
            st.epoll = true;
            self.apply(&mut st);
        }
    }

    /// Makes the kernel pair (if any) show `want`.
    fn apply(&self, st: &mut PairState) {
        let _b = Bypass::new();
        let (cur, now) = (st.cur, st.want);
        if cur == now {
            return;
        }
        let Some(k) = st.kernel.as_mut() else {
            return;
        };
        st.cur = now;
        let Some(o) = k.ours.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        let a = k.app_dup.as_raw_fd();
        let mut buf = [0u8; 1024];
        // SAFETY (all calls below): descriptors we own; MSG_DONTWAIT so the application's
        // O_NONBLOCK (shared with `app_dup`) never makes us block.
        unsafe {
            if !cur.rdhup {
                if now.readable && (!cur.readable || now.arrivals != cur.arrivals) {
                    // Readable, or a new arrival while readable: a wake-up for epoll (ET).
                    real::send()(o, b"r".as_ptr().cast(), 1, libc::MSG_DONTWAIT);
                } else if !now.readable && cur.readable {
                    drain(a, &mut buf);
                }
            }
            if now.writable != cur.writable {
                if now.writable {
                    drain(o, &mut buf);
                } else {
                    while real::send()(a, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) > 0 {}
                }
            }
            if now.error && !cur.error {
                // A byte left unread in `ours`, then `ours` closed: the kernel marks `app`
                // ECONNRESET (EPOLLERR) and hung up, with EPOLLIN and EPOLLOUT, as a reset
                // TCP socket shows.
                real::send()(a, b"e".as_ptr().cast(), 1, libc::MSG_DONTWAIT);
                k.ours = None;
                st.error_pending = true;
                return;
            }
            if now.rdhup && !cur.rdhup {
                real::shutdown()(o, libc::SHUT_WR);
            }
            if now.hup && !cur.hup {
                real::shutdown()(o, libc::SHUT_RD);
            }
        }
    }

    /// The application collected the reset (a read or write failed with it, or SO_ERROR):
    /// EPOLLERR stops, as for a TCP socket. Returns whether it was still pending.
    pub(crate) fn take_error(&self) -> bool {
        let mut st = self.st.lock();
        if st.want.error {
            // Collected: no EPOLLERR from now on, whether the kernel showed it yet or not.
            st.want.error = false;
            self.latest.store(pack(st.want), Ordering::Release);
        }
        if !std::mem::replace(&mut st.error_pending, false) {
            return false;
        }
        if let Some(k) = &st.kernel {
            clear_so_error(k.app_dup.as_raw_fd());
        }
        true
    }
}

/// A state packed as [`Pair::latest`] keeps it.
fn pack(s: smcr::ReadyState) -> u32 {
    u32::from(s.readable)
        | u32::from(s.writable) << 1
        | u32::from(s.rdhup) << 2
        | u32::from(s.hup) << 3
        | u32::from(s.error) << 4
}

/// Reads (and so clears) SO_ERROR of `fd`.
fn clear_so_error(fd: i32) {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reading SO_ERROR of our descriptor into an int.
    unsafe {
        real::getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut err as *mut libc::c_int).cast(),
            &mut len,
        )
    };
}

/// Whether kernel pairs are kept in step only while someone may look at them
/// (`SMCR_LAZY_PAIR=off` keeps them in step at every change).
pub(crate) fn lazy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| smcr::settings::flag("SMCR_LAZY_PAIR").unwrap_or(true))
}

/// Empties the receive queue of `fd` (ours, non-blocking calls). Every sender holds the
/// pair's lock, as the caller does, so a short read means the queue is empty.
fn drain(fd: i32, buf: &mut [u8]) {
    loop {
        // SAFETY: receiving into our buffer from our descriptor, never blocking.
        let n = unsafe { real::recv()(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < buf.len() as isize {
            return;
        }
    }
}

/// The connection's readiness, through the pair, with its [`Gate`].
pub(crate) struct PairSink(pub(crate) Arc<Pair>, pub(crate) Arc<Gate>);

impl smcr::Readiness for PairSink {
    fn update(&self, now: smcr::ReadyState) {
        self.1.show(&self.0, now);
    }
}

/// Holds back writability while what the application wrote before the connection settled
/// (its preamble) waits for room in the peer's buffer: those bytes fill the send buffer as
/// they would TCP's, and a write now would have to wait for them — a non-blocking one would
/// say EAGAIN right after EPOLLOUT, and an edge-triggered program would then wait for an edge
/// that may never come. Closed when the preamble must wait, opened once it is out: the latest
/// state shows, writable rising then.
pub(crate) struct Gate {
    open: std::sync::atomic::AtomicBool,
    /// The connection's latest state (what shows once open).
    last: Mutex<Option<smcr::ReadyState>>,
}

impl Gate {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            open: std::sync::atomic::AtomicBool::new(true),
            last: Mutex::new(None),
        })
    }

    /// The preamble waits for room: not writable until [`Gate::open`].
    pub(crate) fn close(&self, pair: &Pair) {
        let last = self.last.lock();
        self.open.store(false, Ordering::Release);
        if let Some(now) = *last {
            pair.set(Self::held(now));
        }
    }

    /// What shows of `now` while closed.
    fn held(now: smcr::ReadyState) -> smcr::ReadyState {
        smcr::ReadyState {
            writable: now.writable && (now.error || now.hup),
            ..now
        }
    }

    /// The connection's state `now`, shown on `pair` (not writable while closed, unless the
    /// connection failed or hung up: a write must then find out).
    pub(crate) fn show(&self, pair: &Pair, now: smcr::ReadyState) {
        let mut last = self.last.lock();
        *last = Some(now);
        pair.set(if self.open.load(Ordering::Acquire) {
            now
        } else {
            Self::held(now)
        });
    }

    /// The preamble is out: the latest state shows as it is from now on.
    pub(crate) fn open(&self, pair: &Pair) {
        if self.open.load(Ordering::Acquire) {
            return;
        }
        let last = self.last.lock();
        self.open.store(true, Ordering::Release);
        if let Some(now) = *last {
            pair.set(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(writable: bool) -> smcr::ReadyState {
        smcr::ReadyState {
            writable,
            ..Default::default()
        }
    }

    /// While the preamble waits for room the connection shows not writable, whatever its
    /// state; once it is out, the latest state shows and writable rises (a new edge).
    #[test]
    fn a_closed_gate_holds_writability_back_until_opened() {
        let pair = Pair::new(false);
        let gate = Gate::new();
        gate.show(&pair, state(true));
        assert_eq!(pair.latest() & 2, 2, "open: shown as it is");
        gate.close(&pair);
        assert_eq!(pair.latest() & 2, 0, "closed: not writable");
        gate.show(&pair, state(true));
        assert_eq!(
            pair.latest() & 2,
            0,
            "a change while closed: still not writable"
        );
        let rises = pair.rises()[1];
        gate.open(&pair);
        assert_eq!(pair.latest() & 2, 2, "opened: the latest state");
        assert_eq!(pair.rises()[1], rises + 1, "writable rose");
        gate.open(&pair);
        assert_eq!(pair.rises()[1], rises + 1, "opened once");
    }

    /// A failed or hung-up connection shows writable through a closed gate: a write must
    /// find out.
    #[test]
    fn a_closed_gate_lets_a_failure_show() {
        let pair = Pair::new(false);
        let gate = Gate::new();
        gate.close(&pair);
        gate.show(
            &pair,
            smcr::ReadyState {
                writable: true,
                error: true,
                ..Default::default()
            },
        );
        assert_eq!(pair.latest() & (2 | 16), 2 | 16);
    }
}
