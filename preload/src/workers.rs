//! Threads for handshakes: each handshake runs on a thread of its own (a client that stalls in
//! CLC must not hold up the others; only a server connection first used by a blocking read
//! runs on that reading thread, which would wait for it anyway), but a thread that finished one waits a while
//! for the next instead of exiting, so a steady stream of connections does not pay a thread
//! creation and exit each (about a hundred microseconds of system calls on these machines).
//! A worker's thread comes from the library's reserve of spare threads (`smcr::thread`) when
//! more than the runtime may still need are parked, and goes back there when the worker
//! exits: a program that forbids new threads (haproxy's `RLIMIT_NPROC` 0) still gets its
//! handshakes off its own threads while spares last, and never at the cost of the threads
//! SMC-R cannot do without (the engine, a link group's poller).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, MutexGuard, PoisonError};
use std::time::Duration;

use parking_lot::Mutex;

use crate::forkhold::{self, Held};

type Job = Box<dyn FnOnce() + Send>;

/// How long an idle worker waits for more work before it exits.
const IDLE: Duration = Duration::from_secs(2);

struct State {
    jobs: VecDeque<Job>,
    /// Workers waiting for a job (some may be about to take one already queued).
    idle: usize,
    /// The process these workers belong to: a forked child has none of them.
    pid: u32,
    /// Wake-ups of idle workers that found no job (another took it): each a context switch.
    idle_wakes: u64,
}

/// `std` locks: the state is held across `fork` (`forkhold`).
static STATE: std::sync::Mutex<State> = std::sync::Mutex::new(State {
    jobs: VecDeque::new(),
    idle: 0,
    pid: 0,
    idle_wakes: 0,
});
static COND: Condvar = Condvar::new();

fn state() -> Held<MutexGuard<'static, State>> {
    forkhold::lock(&STATE)
}

/// Before a fork: the forking thread takes the workers' state (see `forkhold`).
pub(crate) fn hold_for_fork() {
    forkhold::hold_mutex(&STATE);
}

/// Runs `job` on an idle worker, or on a new one if none is free (on a spare thread if more
/// than `keep` are parked).
pub(crate) fn run(keep: usize, job: impl FnOnce() + Send + 'static) {
    let me = crate::table::pid();
    let mut st = state();
    if st.pid != me {
        // Forked: the parent's workers (and their queue) did not come along.
        st.jobs.clear();
        st.idle = 0;
        st.pid = me;
    }
    if st.idle > st.jobs.len() {
        st.jobs.push_back(Box::new(job));
        drop(st);
        // One of them: each woken worker costs a context switch, and a burst of connects
        // finds dozens idle. std's condition variable is a bare futex word (no list of
        // waiters in our memory), so after a fork it holds none of the parent's workers to
        // take this notification.
        COND.notify_one();
        return;
    }
    drop(st);
    // The job waits for a thread to take it (a failed spawn takes it back: it runs here).
    let slot = std::sync::Arc::new(Mutex::new(Some(Box::new(job) as Job)));
    let theirs = slot.clone();
    let spawned = smcr::thread::spawn_keeping(keep, "smcr-handshake".into(), move || {
        let _b = crate::guard::Bypass::new();
        let job = theirs.lock().take();
        if let Some(job) = job {
            job();
        }
        worker();
    });
    if let Err(e) = spawned {
        // No thread (the program forbids new ones, no spare beyond `keep`): the handshake runs
        // on the caller's thread rather than never. Said once per process (it then holds for
        // every handshake that finds no spare).
        static SAID: AtomicU32 = AtomicU32::new(0);
        if SAID.swap(me, Ordering::Relaxed) != me {
            crate::log::line(format_args!(
                "no thread for a handshake ({e}): it runs on the calling thread (so do later ones that find no spare)"
            ));
        }
        let job = slot.lock().take();
        if let Some(job) = job {
            let _b = crate::guard::Bypass::new();
            job();
        }
    }
}

/// A worker after its first job: takes queued jobs until none came for [`IDLE`].
fn worker() {
    loop {
        let job = {
            // The condition variable needs the plain guard; counted as held all the same.
            let _holding = forkhold::Holding::new();
            // Once the program forbids new threads, a finished worker gives its thread back
            // to the reserve at once: an engine or a poller may need it.
            let idle = if smcr::thread::locked() {
                Duration::ZERO
            } else {
                IDLE
            };
            let mut st = STATE.lock().unwrap_or_else(PoisonError::into_inner);
            st.idle += 1;
            let deadline = std::time::Instant::now() + idle;
            loop {
                if let Some(j) = st.jobs.pop_front() {
                    st.idle -= 1;
                    break Some(j);
                }
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let (g, t) = COND
                    .wait_timeout(st, left)
                    .unwrap_or_else(PoisonError::into_inner);
                st = g;
                if st.jobs.is_empty() {
                    if t.timed_out() {
                        st.idle -= 1;
                        break None;
                    }
                    st.idle_wakes += 1;
                }
            }
        };
        match job {
            Some(j) => j(),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn tid() -> libc::pid_t {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() }
    }

    /// The workers are the process's: one test at a time.
    static ONE: Mutex<()> = Mutex::new(());

    fn wait_idle(n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while state().idle < n {
            assert!(std::time::Instant::now() < deadline, "workers never idle");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_job_wakes_one_idle_worker_not_all() {
        let _one = ONE.lock();
        // Six workers, then idle (a burst of connects leaves dozens so).
        const K: usize = 6;
        let (tx, rx) = mpsc::channel();
        let (go, wait) = std::sync::mpsc::sync_channel::<()>(0);
        let wait = std::sync::Arc::new(Mutex::new(wait));
        // Another test's idle workers leave after [`IDLE`].
        let deadline = std::time::Instant::now() + IDLE * 3;
        while state().idle > 0 {
            assert!(std::time::Instant::now() < deadline, "idle workers stay");
            std::thread::sleep(Duration::from_millis(10));
        }
        for _ in 0..K {
            let (t, w) = (tx.clone(), wait.clone());
            run(0, move || {
                t.send(()).unwrap();
                let _ = w.lock().recv();
            });
        }
        for _ in 0..K {
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
        }
        for _ in 0..K {
            go.send(()).unwrap();
        }
        wait_idle(K);
        let woke = state().idle_wakes;
        // Jobs one after another: each should wake one worker, which takes it.
        const JOBS: u64 = 20;
        for _ in 0..JOBS {
            let t = tx.clone();
            run(0, move || t.send(()).unwrap());
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
            wait_idle(K);
        }
        let idle_wakes = state().idle_wakes - woke;
        // (Was every idle worker per job: about (K - 1) * JOBS.)
        assert!(
            idle_wakes < JOBS,
            "{idle_wakes} wake-ups for nothing over {JOBS} jobs"
        );
    }

    #[test]
    fn a_finished_worker_takes_the_next_job_and_a_busy_one_does_not_block_others() {
        let _one = ONE.lock();
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        run(0, move || t.send(tid()).unwrap());
        let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        // Wait until that worker is idle again, then the next job is its.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while state().idle == 0 {
            assert!(std::time::Instant::now() < deadline, "worker never idle");
            std::thread::sleep(Duration::from_millis(1));
        }
        let t = tx.clone();
        run(0, move || t.send(tid()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), first);

        // A job that blocks (a client stalled in CLC) keeps its worker: the next runs anyway.
        let (release, blocked) = mpsc::channel::<()>();
        let t = tx.clone();
        run(0, move || {
            t.send(tid()).unwrap();
            blocked.recv().unwrap();
        });
        let busy = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let t = tx.clone();
        run(0, move || t.send(tid()).unwrap());
        let other = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_ne!(other, busy, "ran beside the blocked job");
        release.send(()).unwrap();
    }
}
