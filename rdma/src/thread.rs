//! The library's threads (engine, pollers, the TCP watch, acceptors, handshake workers), and
//! a reserve of parked ones.
//!
//! **Signals.** They block every signal a process can be sent, so the kernel delivers those to
//! the application's own threads: a program that counts on a signal interrupting its blocking
//! call (an `alarm` around `accept`, Python's signal handlers) or on its handler running on its
//! own thread keeps that when a preloaded library adds threads to it. Faults (SIGSEGV, SIGBUS,
//! SIGFPE, SIGILL, SIGTRAP, SIGSYS) stay unblocked: they belong to the thread that caused them.
//!
//! **The reserve.** Hardened programs forbid new threads once they are running: haproxy sets
//! `RLIMIT_NPROC` to 0 after binding its listeners, sandboxes filter `clone` (a filtered call
//! kills the process) or cap the tasks of a service (a cgroup pids limit). A library that
//! creates its threads on demand is then left without them. So [`spawn`] first hands its job
//! to a *spare*: a thread of ours parked with nothing to do (it sleeps on its own condition
//! variable, no timeout: no wake-up while idle). A thread whose job ends parks again while
//! fewer than the [target](set_target) are parked — always once a lock-down was seen — and
//! exits otherwise. [`reserve`] parks spares now (the preload does when its runtime starts and
//! just before the program lowers `RLIMIT_NPROC` or installs a seccomp filter: [`lock_down`]).
//! [`claim`] takes a thread for a job that must not fail to start later (a link group's
//! poller, claimed before the handshake commits to the group).
//!
//! A spare serves callers of its own network namespace only (a thread's own: `setns`), as a
//! thread created by the caller would. A thread is created only when no such spare is parked,
//! and not at all when the calling thread has more seccomp filters than the process had at
//! start (`procfs`): the job then fails
//! with [`NoThread`], which callers turn into a fallback to TCP (NOTHREAD), never into an
//! error of the program's call.
//!
//! **Fork.** A child has only the thread that forked: none of the parent's spares. The reserve
//! notes the process it belongs to and starts empty in a child (the parent's spares are
//! forgotten, not touched); its lock is taken across `fork` (`crate::forkhold`).

pub(crate) mod procfs;

use std::cell::Cell;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

/// The name of a parked spare (`top -H`, `/proc/PID/task/*/comm`).
const SPARE_NAME: &str = "smcr-spare";

/// The number of spares kept parked when nothing else was said ([`set_target`]).
pub const DEFAULT_TARGET: usize = 4;

/// How long a [`claim`] that finds no spare and may not create a thread waits for one
/// held by a handshake (a same-host handshake takes about a millisecond).
const CLAIM_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// How long [`reserve`] waits for another thread's fill to end (a thread is created in tens
/// of microseconds; a fork in the middle leaves a child's count reset, not waited for).
const FILL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Why no thread could be had for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoThread {
    /// The system refused one (the errno): `RLIMIT_NPROC`, a pids limit (systemd's
    /// `TasksMax=`), the system's thread limit, or memory.
    Refused(i32),
    /// The calling thread has more seccomp filters than the process had at start: the
    /// program's own lock-down, whose rules we cannot read (a forbidden `clone` would kill the
    /// process).
    Filtered {
        /// Filters at start (the service manager's).
        at_start: u32,
        /// Filters now.
        now: u32,
    },
    /// `/proc` could be read at start and cannot now (a chroot without it): whether a
    /// seccomp filter forbids `clone` cannot be told.
    CannotTell,
}

impl std::fmt::Display for NoThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(e) => write!(
                f,
                "the system refused a new thread ({}): RLIMIT_NPROC or a pids limit (TasksMax=)",
                io::Error::from_raw_os_error(*e)
            ),
            Self::Filtered { at_start, now } => write!(
                f,
                "a seccomp filter was installed after start-up ({at_start} filters at start, {now} now): a new thread could get the process killed"
            ),
            Self::CannotTell => f.write_str(
                "/proc is no longer readable (chroot?): whether a seccomp filter forbids new threads cannot be told",
            ),
        }
    }
}

impl std::error::Error for NoThread {}

impl From<NoThread> for io::Error {
    fn from(e: NoThread) -> Self {
        Self::other(e)
    }
}

/// The [`NoThread`] inside `e`, if that is why it failed.
pub fn no_thread(e: &io::Error) -> Option<&NoThread> {
    e.get_ref()?.downcast_ref::<NoThread>()
}

/// Runs `f` on a spare, or on a new thread when none is parked (named `name` either way):
/// for jobs the process cannot do without (as [`claim`]). Fails with [`NoThread`] when no
/// spare is parked, no thread may be created and no handshake gives one back in time.
pub fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    RESERVE.spawn(name, f)
}

/// [`spawn`] for a job that can do without a spare (a handshake, which its caller can run
/// itself): it takes one only while more than `keep` are parked (those are left for jobs that
/// cannot: the engine, a link group's poller), else it needs a new thread. While it runs, a
/// [`claim`] that finds no spare and may create no thread waits for its thread (briefly).
/// `keep` 0 is [`spawn`].
pub fn spawn_keeping<T: Send + 'static>(
    keep: usize,
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    RESERVE.spawn_keeping(keep, name, f)
}

/// A thread held for a job to come: a spare taken out of the reserve, a new one, or (when
/// none may be created) one a [`spawn_keeping`] job gives back within 250 ms. Dropping it
/// unused gives the thread back.
pub fn claim() -> io::Result<Claim> {
    RESERVE.claim()
}

/// Makes sure `n` spares are parked now (creating the missing ones while that is allowed);
/// returns how many are parked.
pub fn reserve(n: usize) -> usize {
    RESERVE.reserve(n)
}

/// How many spares a finished job's thread keeps parked (before a lock-down; after one,
/// every thread parks). 0: no reserve.
pub fn set_target(n: usize) {
    RESERVE.lock().target = n;
}

/// See [`set_target`].
pub fn target() -> usize {
    RESERVE.lock().target
}

/// The program is about to forbid new threads (it lowers `RLIMIT_NPROC`, installs a seccomp
/// filter): parks [`target`] + `extra` spares now (none when the target is 0), and from now on
/// every thread whose job ends parks instead of exiting. Returns how many are parked.
pub fn lock_down(extra: usize) -> usize {
    let n = {
        let mut p = RESERVE.lock();
        p.locked = true;
        if p.target == 0 { 0 } else { p.target + extra }
    };
    RESERVE.reserve(n)
}

/// Whether a lock-down was seen in this process (announced by [`lock_down`], or a creation
/// refused): a thread of ours is not to be given up.
pub fn locked() -> bool {
    RESERVE.lock().locked
}

/// Why the last creation of a thread was refused in this process, if one was.
pub fn last_refusal() -> Option<NoThread> {
    RESERVE.lock().refusal.clone()
}

/// Keeps a descriptor of `/proc` (once), so that whether a seccomp filter was added can still
/// be told after the program chroots (the preload calls it before `chroot`; the reserve does
/// before it creates its first thread).
pub fn keep_proc() {
    procfs::keep_proc();
}

/// Reads the process's seccomp state at start (call it as early as possible: the preload
/// does at load). Without this call, the first use of the reserve reads it.
pub fn note_start() {
    procfs::note_start();
}

/// What the reserve did in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Spares parked now.
    pub parked: usize,
    /// Threads created.
    pub created: u64,
    /// Jobs handed to a spare instead of a new thread.
    pub reused: u64,
    /// Creations refused ([`NoThread`]).
    pub refused: u64,
    /// A lock-down was seen: threads park instead of exiting.
    pub locked: bool,
}

/// See [`Counts`].
pub fn counts() -> Counts {
    RESERVE.counts()
}

/// Before a fork: the forking thread takes the reserve's lock (see [`crate::forkhold`]).
pub(crate) fn hold_for_fork() {
    crate::forkhold::hold_mutex(&RESERVE.pool);
}

/// A job's result, for its [`JoinHandle`].
enum Stage<T> {
    Waiting,
    Running(ThreadId),
    Done(std::thread::Result<T>),
    Taken,
}

struct Packet<T> {
    stage: Mutex<Stage<T>>,
    done: Condvar,
}

/// Waits for a job run by [`spawn`] or [`Claim::run`]: for the *job*, not the thread (which
/// parks again as a spare).
pub struct JoinHandle<T> {
    packet: Arc<Packet<T>>,
}

impl<T> JoinHandle<T> {
    /// Waits for the job to end: its result, or the payload of its panic (as
    /// `std::thread::JoinHandle::join`).
    pub fn join(self) -> std::thread::Result<T> {
        let mut st = self
            .packet
            .stage
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            match std::mem::replace(&mut *st, Stage::Taken) {
                Stage::Done(r) => return r,
                Stage::Taken => unreachable!("joined once"),
                other => {
                    *st = other;
                    st = self
                        .packet
                        .done
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Whether the job is running on the calling thread now (joining would wait for itself).
    pub fn is_running_here(&self) -> bool {
        let st = self
            .packet
            .stage
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        matches!(*st, Stage::Running(id) if id == std::thread::current().id())
    }

    /// Whether the job has ended.
    pub fn is_finished(&self) -> bool {
        let st = self
            .packet
            .stage
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        matches!(*st, Stage::Done(_) | Stage::Taken)
    }
}

impl<T> std::fmt::Debug for JoinHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinHandle")
            .field("finished", &self.is_finished())
            .finish()
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// `f` as a job named `name`, and the handle that waits for it. A panic of `f` ends the job
/// (its payload goes to `join`), not the thread.
fn package<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> (Job, JoinHandle<T>) {
    let packet = Arc::new(Packet {
        stage: Mutex::new(Stage::Waiting),
        done: Condvar::new(),
    });
    let theirs = packet.clone();
    let job: Job = Box::new(move || {
        name_self(&name);
        *theirs.stage.lock().unwrap_or_else(PoisonError::into_inner) =
            Stage::Running(std::thread::current().id());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        *theirs.stage.lock().unwrap_or_else(PoisonError::into_inner) = Stage::Done(r);
        theirs.done.notify_all();
    });
    (job, JoinHandle { packet })
}

thread_local! {
    /// The name this thread last gave itself (the kernel's 15 bytes), to skip a `prctl`
    /// that would change nothing.
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
}

/// Names the calling thread (`PR_SET_NAME`: at most 15 bytes are kept).
fn name_self(name: &str) {
    let mut n = [0u8; 16];
    let len = name.len().min(15);
    n[..len].copy_from_slice(&name.as_bytes()[..len]);
    if NAME.try_with(|c| c.replace(n)).is_ok_and(|old| old == n) {
        return;
    }
    // SAFETY: a NUL-terminated name of at most 16 bytes; changes only this thread's name.
    unsafe { libc::prctl(libc::PR_SET_NAME, n.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// What a parked thread is told.
enum Order {
    /// Nothing yet.
    Wait,
    /// A job; `true` for one that could have done without a spare ([`spawn_keeping`]).
    Run(Job, bool),
    Exit,
}

/// A thread of the reserve: it waits on its own condition variable for its next order.
struct Spare {
    order: Mutex<Order>,
    cond: Condvar,
    /// Its network namespace (its creator's), if known.
    netns: Option<u64>,
}

impl Spare {
    fn new(first: Order, netns: Option<u64>) -> Arc<Self> {
        Arc::new(Self {
            order: Mutex::new(first),
            cond: Condvar::new(),
            netns,
        })
    }

    /// Whether it may serve a caller in network namespace `ns` (unknown either side: yes).
    fn serves(&self, ns: Option<u64>) -> bool {
        self.netns.is_none() || ns.is_none() || self.netns == ns
    }

    fn tell(&self, o: Order) {
        *self.order.lock().unwrap_or_else(PoisonError::into_inner) = o;
        self.cond.notify_one();
    }

    /// Waits for a job (`None`: exit).
    fn next(&self) -> Option<(Job, bool)> {
        let mut o = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match std::mem::replace(&mut *o, Order::Wait) {
                Order::Run(j, transient) => return Some((j, transient)),
                Order::Exit => return None,
                Order::Wait => o = self.cond.wait(o).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }
}

struct Pool {
    /// The process these spares belong to (0: not used yet).
    pid: u32,
    parked: Vec<Arc<Spare>>,
    /// Spares [`Reserve::reserve`] is creating now (so that two fills do not both make them).
    filling: usize,
    target: usize,
    /// A lock-down was seen (announced, or a creation refused): threads park, never exit.
    locked: bool,
    /// Jobs running that could have done without a spare: their threads come back soon.
    transient: usize,
    /// Claims waiting for one of those ([`Reserve::claim`]).
    waiting: usize,
    /// Why the last creation was refused.
    refusal: Option<NoThread>,
    created: u64,
    reused: u64,
    refused: u64,
}

/// A reserve of spares (one per process: [`RESERVE`]; tests make their own).
pub(crate) struct Reserve {
    /// A `std` lock: held across `fork` (`crate::forkhold`).
    pool: Mutex<Pool>,
    /// Signalled when a fill ends (`Pool::filling` went down).
    filled: Condvar,
}

static RESERVE: Reserve = Reserve::new();

impl Reserve {
    pub(crate) const fn new() -> Self {
        Self {
            pool: Mutex::new(Pool {
                pid: 0,
                parked: Vec::new(),
                filling: 0,
                target: DEFAULT_TARGET,
                locked: false,
                transient: 0,
                waiting: 0,
                refusal: None,
                created: 0,
                reused: 0,
                refused: 0,
            }),
            filled: Condvar::new(),
        }
    }

    /// The pool, emptied first in a forked child (the parent's spares did not come along).
    fn lock(&self) -> MutexGuard<'_, Pool> {
        let mut p = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        let me = std::process::id();
        if p.pid != me {
            // Forgotten, not dropped: their locks may be held by threads of the parent.
            std::mem::forget(std::mem::take(&mut p.parked));
            p.filling = 0;
            p.transient = 0;
            p.waiting = 0;
            p.pid = me;
        }
        p
    }

    fn counts(&self) -> Counts {
        let p = self.lock();
        Counts {
            parked: p.parked.len(),
            created: p.created,
            reused: p.reused,
            refused: p.refused,
            locked: p.locked,
        }
    }

    /// A spare parked for the caller's network namespace `ns`, if more than `keep` are.
    fn take_parked(&self, keep: usize, ns: Option<u64>) -> Option<Arc<Spare>> {
        let mut p = self.lock();
        take_from(&mut p, keep, ns)
    }

    /// A job's thread is free again (`transient`: after such a job): parked (true) or told
    /// to exit.
    fn park(&self, s: &Arc<Spare>, transient: bool) -> bool {
        let mut p = self.lock();
        if transient {
            p.transient = p.transient.saturating_sub(1);
        }
        let home = procfs::home_netns();
        let elsewhere = s.netns.is_some() && home.is_some() && s.netns != home;
        let parked = p.locked || (p.parked.len() < p.target && !elsewhere);
        if parked {
            p.parked.push(s.clone());
        }
        if p.waiting > 0 {
            self.filled.notify_all();
        }
        parked
    }

    /// Creates a thread that starts with `first` (a job, or waiting), unless creating one is
    /// not safe or is refused.
    fn create(&'static self, name: &str, first: Order, ns: Option<u64>) -> io::Result<Arc<Spare>> {
        procfs::keep_proc();
        if let Err(why) = procfs::may_create() {
            return Err(self.refused(why).into());
        }
        // The new thread is in the caller's network namespace.
        let spare = Spare::new(first, ns);
        let theirs = spare.clone();
        match spawn_masked(name, move || self.serve(theirs)) {
            Ok(()) => {
                self.lock().created += 1;
                Ok(spare)
            }
            Err(e) => Err(self
                .refused(NoThread::Refused(e.raw_os_error().unwrap_or(libc::EAGAIN)))
                .into()),
        }
    }

    /// Notes a refused creation: the program forbids new threads, so none of ours exits.
    fn refused(&self, why: NoThread) -> NoThread {
        let mut p = self.lock();
        p.locked = true;
        p.refused += 1;
        p.refusal = Some(why.clone());
        why
    }

    /// A thread's life: jobs, parked in between, until it is not wanted any more.
    fn serve(&'static self, me: Arc<Spare>) {
        while let Some((job, transient)) = me.next() {
            job();
            name_self(SPARE_NAME);
            if !self.park(&me, transient) {
                return;
            }
        }
    }

    /// A job the process cannot do without: a spare, a new thread, or a thread a handshake
    /// gives back ([`Reserve::claim`]).
    fn spawn<T: Send + 'static>(
        &'static self,
        name: String,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        self.claim()?.run(name, f)
    }

    fn spawn_keeping<T: Send + 'static>(
        &'static self,
        keep: usize,
        name: String,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        if keep == 0 {
            return self.spawn(name, f);
        }
        let (job, handle) = package(name.clone(), f);
        self.lock().transient += 1;
        let ns = procfs::netns();
        if let Some(s) = self.take_parked(keep, ns) {
            s.tell(Order::Run(job, true));
            return Ok(handle);
        }
        self.create(&name, Order::Run(job, true), ns)
            .inspect_err(|_| {
                let mut p = self.lock();
                p.transient = p.transient.saturating_sub(1);
            })?;
        Ok(handle)
    }

    fn claim(&'static self) -> io::Result<Claim> {
        let ns = procfs::netns();
        let spare = match self.take_parked(0, ns) {
            Some(s) => s,
            None => match self.create(SPARE_NAME, Order::Wait, ns) {
                Ok(s) => s,
                Err(e) => self.wait_for_spare(ns).ok_or(e)?,
            },
        };
        Ok(Claim {
            spare: Some(spare),
            reserve: self,
            pid: std::process::id(),
        })
    }

    /// No spare and no new thread: one held by a job that could have done without it (a
    /// handshake) is waited for, at most [`CLAIM_WAIT`], so that the threads SMC-R cannot do
    /// without (an engine, a poller) come first.
    fn wait_for_spare(&self, ns: Option<u64>) -> Option<Arc<Spare>> {
        let deadline = std::time::Instant::now() + CLAIM_WAIT;
        let mut p = self.lock();
        p.waiting += 1;
        let got = loop {
            if let Some(s) = take_from(&mut p, 0, ns) {
                break Some(s);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if p.transient == 0 || left.is_zero() {
                break None;
            }
            p = self
                .filled
                .wait_timeout(p, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        p.waiting = p.waiting.saturating_sub(1);
        got
    }

    fn reserve(&'static self, n: usize) -> usize {
        let ns = procfs::netns();
        let need = {
            let mut p = self.lock();
            let need = n.saturating_sub(parked_for(&p, ns) + p.filling);
            p.filling += need;
            need
        };
        let mut left = need;
        while left > 0 {
            let made = self.create(SPARE_NAME, Order::Wait, ns);
            let mut p = self.lock();
            p.filling = p.filling.saturating_sub(1);
            left -= 1;
            match made {
                Ok(s) => p.parked.push(s),
                Err(_) => {
                    p.filling = p.filling.saturating_sub(left);
                    left = 0;
                }
            }
            if p.filling == 0 {
                self.filled.notify_all();
            }
        }
        // Another thread's fill under way (two threads of the program locking down at once):
        // waited for, so that no lock-down call of the program goes ahead of it.
        let deadline = std::time::Instant::now() + FILL_WAIT;
        let mut p = self.lock();
        while p.filling > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            p = self
                .filled
                .wait_timeout(p, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        parked_for(&p, ns)
    }
}

/// Spares parked for callers in network namespace `ns`.
fn parked_for(p: &Pool, ns: Option<u64>) -> usize {
    p.parked.iter().filter(|s| s.serves(ns)).count()
}

/// Takes the spare parked last for `ns`, if more than `keep` are parked for it.
fn take_from(p: &mut Pool, keep: usize, ns: Option<u64>) -> Option<Arc<Spare>> {
    if parked_for(p, ns) <= keep {
        return None;
    }
    let i = p.parked.iter().rposition(|s| s.serves(ns))?;
    p.reused += 1;
    Some(p.parked.remove(i))
}

/// A thread held for one job ([`claim`]).
pub struct Claim {
    spare: Option<Arc<Spare>>,
    reserve: &'static Reserve,
    pid: u32,
}

impl Claim {
    /// Runs `f` on the claimed thread, named `name`. Cannot fail in the process that claimed
    /// it; in a forked child (where that thread is not) the job needs a thread of its own.
    pub fn run<T: Send + 'static>(
        mut self,
        name: String,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        let spare = self.spare.take().expect("a claim runs once");
        if self.pid != std::process::id() {
            std::mem::forget(spare);
            return self.reserve.spawn(name, f);
        }
        let (job, handle) = package(name, f);
        spare.tell(Order::Run(job, false));
        Ok(handle)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let Some(s) = self.spare.take() else {
            return;
        };
        if self.pid != std::process::id() {
            std::mem::forget(s);
        } else if !self.reserve.park(&s, false) {
            s.tell(Order::Exit);
        }
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Claim")
    }
}

/// Creates a named thread with all but the fault signals blocked (set before it starts, so
/// none can reach it in between).
fn spawn_masked(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    // SAFETY (block): sigset operations on local sets; pthread_sigmask changes only this
    // thread's mask, restored before returning.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        for s in [
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGFPE,
            libc::SIGILL,
            libc::SIGTRAP,
            libc::SIGSYS,
        ] {
            libc::sigdelset(&mut all, s);
        }
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        // The new thread inherits the mask it is created with.
        let r = std::thread::Builder::new().name(name.into()).spawn(f);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        r.map(drop)
    }
}

#[cfg(test)]
mod tests;
