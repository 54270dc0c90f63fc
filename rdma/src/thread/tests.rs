use super::*;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn tid() -> libc::pid_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// The name of this process's thread `t` (None: gone).
fn comm(t: libc::pid_t) -> Option<String> {
    std::fs::read_to_string(format!("/proc/self/task/{t}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

/// Waits (at most 5 s) for `f` to hold.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn mask() -> (i32, i32, i32) {
    // SAFETY: reading signal masks into local sets.
    unsafe {
        let mut m: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut m);
        (
            libc::sigismember(&m, libc::SIGALRM),
            libc::sigismember(&m, libc::SIGTERM),
            libc::sigismember(&m, libc::SIGSEGV),
        )
    }
}

#[test]
fn the_thread_blocks_signals_and_the_caller_keeps_its_mask() {
    static R: Reserve = Reserve::new();
    static S: Reserve = Reserve::new();
    let before = mask();
    let inside = R.spawn("t".into(), mask).unwrap().join().unwrap();
    assert_eq!(inside, (1, 1, 0));
    // A spare made ahead of its job too.
    S.reserve(1);
    let inside = S.spawn("t".into(), mask).unwrap().join().unwrap();
    assert_eq!(inside, (1, 1, 0));
    assert_eq!(S.counts().created, 1);
    assert_eq!(mask(), before);
}

#[test]
fn a_job_runs_on_a_parked_spare_named_for_it_which_parks_again() {
    static R: Reserve = Reserve::new();
    assert_eq!(R.reserve(1), 1);
    assert_eq!(R.counts().created, 1);
    let (tx, rx) = mpsc::channel();
    let (go, wait) = mpsc::channel::<()>();
    let h = R
        .spawn("smcr-test-job".into(), move || {
            tx.send(tid()).unwrap();
            wait.recv().unwrap();
            7
        })
        .unwrap();
    let t = rx.recv().unwrap();
    assert_eq!(comm(t).as_deref(), Some("smcr-test-job"));
    let c = R.counts();
    assert_eq!((c.created, c.reused, c.parked), (1, 1, 0));
    go.send(()).unwrap();
    assert_eq!(h.join().unwrap(), 7);
    // Parked again (the target is 4), under the spare's name.
    eventually("parked again", || R.counts().parked == 1);
    assert_eq!(comm(t).as_deref(), Some(SPARE_NAME));
    // The next job is that thread's: no thread created.
    let t2 = R.spawn("smcr-test-2".into(), tid).unwrap().join().unwrap();
    assert_eq!(t2, t);
    assert_eq!(R.counts().created, 1);
}

#[test]
fn a_thread_above_the_target_exits_unless_a_lock_down_was_seen() {
    static R: Reserve = Reserve::new();
    R.lock().target = 0;
    let t = R.spawn("smcr-test".into(), tid).unwrap().join().unwrap();
    eventually("the thread exits", || comm(t).is_none());
    assert_eq!(R.counts().parked, 0);
    // After a lock-down every thread parks, whatever the target.
    R.lock().locked = true;
    let t = R.spawn("smcr-test".into(), tid).unwrap().join().unwrap();
    eventually("parked", || R.counts().parked == 1);
    assert!(comm(t).is_some());
}

#[test]
fn join_waits_for_the_job_and_returns_its_panic() {
    static R: Reserve = Reserve::new();
    let h = R
        .spawn("smcr-test".into(), || {
            std::thread::sleep(Duration::from_millis(50));
            "done"
        })
        .unwrap();
    assert!(!h.is_finished());
    assert_eq!(h.join().unwrap(), "done");
    eventually("parked", || R.counts().parked == 1);
    // A panic ends the job, not the thread: it parks and serves the next one.
    let h = R
        .spawn("smcr-test".into(), || -> u32 { panic!("inside a job") })
        .unwrap();
    let e = h.join().unwrap_err();
    assert_eq!(e.downcast_ref::<&str>(), Some(&"inside a job"));
    eventually("parked after the panic", || R.counts().parked == 1);
    assert_eq!(R.spawn("t".into(), || 3).unwrap().join().unwrap(), 3);
    assert_eq!(R.counts().created, 1);
}

#[test]
fn a_job_knows_it_runs_on_the_calling_thread() {
    static R: Reserve = Reserve::new();
    let (tx, rx) = mpsc::channel::<JoinHandle<()>>();
    let (said, heard) = mpsc::channel();
    let h = R
        .spawn("smcr-test".into(), move || {
            let mine = rx.recv().unwrap();
            said.send(mine.is_running_here()).unwrap();
        })
        .unwrap();
    assert!(!h.is_running_here());
    tx.send(h).unwrap();
    assert!(heard.recv().unwrap());
}

#[test]
fn a_claimed_thread_runs_its_job_later_or_goes_back_unused() {
    static R: Reserve = Reserve::new();
    let c = R.claim().unwrap();
    assert_eq!(R.counts().created, 1);
    let h = c.run("smcr-test".into(), tid).unwrap();
    let t = h.join().unwrap();
    eventually("parked", || R.counts().parked == 1);
    // Claimed and dropped: back in the reserve, the same thread.
    drop(R.claim().unwrap());
    assert_eq!(R.counts().parked, 1);
    let c = R.claim().unwrap();
    assert_eq!(c.run("t".into(), tid).unwrap().join().unwrap(), t);
    assert_eq!(R.counts().created, 1);
}

#[test]
fn a_job_that_can_do_without_leaves_the_kept_spares() {
    static R: Reserve = Reserve::new();
    R.reserve(2);
    // Two parked, two to keep: a thread of its own.
    R.spawn_keeping(2, "t".into(), || ())
        .unwrap()
        .join()
        .unwrap();
    assert_eq!((R.counts().created, R.counts().reused), (3, 0));
    eventually("parked", || R.counts().parked == 3);
    // Three parked: it takes one.
    R.spawn_keeping(2, "t".into(), || ())
        .unwrap()
        .join()
        .unwrap();
    assert_eq!((R.counts().created, R.counts().reused), (3, 1));
    eventually("parked", || R.counts().parked == 3);
    // Where no thread may be created, it fails rather than take one of the kept ones.
    note_start();
    let refused = std::thread::spawn(|| {
        forbid_clone_here();
        R.spawn_keeping(3, "t".into(), || ()).map(drop).is_err()
    })
    .join()
    .unwrap();
    assert!(refused);
    assert_eq!(R.counts().parked, 3);
}

#[test]
fn the_reserve_is_filled_to_n_once() {
    static R: Reserve = Reserve::new();
    assert_eq!(R.reserve(3), 3);
    assert_eq!(R.reserve(2), 3);
    assert_eq!(R.reserve(3), 3);
    assert_eq!(R.counts().created, 3);
}

/// Counts this process's threads.
fn tasks() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Runs `f` in a forked child (one thread), which exits with its result; the child's code.
fn in_child(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    let mut fds = [0; 2];
    // SAFETY: a pipe for the child's message.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (r, w) = (fds[0], fds[1]);
    // SAFETY: the child only runs `f` and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let msg = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(())) => String::new(),
            Ok(Err(e)) => e,
            Err(_) => "panicked".into(),
        };
        // SAFETY: writing to our pipe, then leaving without running the parent's handlers.
        unsafe {
            libc::write(w, msg.as_ptr().cast(), msg.len());
            libc::_exit(if msg.is_empty() { 0 } else { 1 });
        }
    }
    // SAFETY: closing our copy of the write end.
    unsafe { libc::close(w) };
    let mut buf = vec![0u8; 4096];
    // SAFETY: reading the child's message into our buffer.
    let n = unsafe { libc::read(r, buf.as_mut_ptr().cast(), buf.len()) };
    let mut status = 0;
    // SAFETY: waiting for our child; closing our read end.
    unsafe {
        libc::waitpid(pid, &mut status, 0);
        libc::close(r);
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned())
    }
}

#[test]
fn a_forked_child_starts_with_an_empty_reserve_of_its_own() {
    static R: Reserve = Reserve::new();
    assert_eq!(R.reserve(2), 2);
    let child = in_child(|| {
        let check = |what: &str, ok: bool| if ok { Ok(()) } else { Err(what.to_owned()) };
        check("one thread in the child", tasks() == 1)?;
        check("none of the parent's spares", R.counts().parked == 0)?;
        check("a reserve of its own", R.reserve(2) == 2)?;
        check("two spares", tasks() == 3)?;
        // A job runs on a spare: no thread is created, and it parks again.
        let (tx, rx) = mpsc::channel();
        let (go, wait) = mpsc::channel::<()>();
        let h = R
            .spawn("smcr-test".into(), move || {
                tx.send(tasks()).unwrap();
                wait.recv().unwrap();
                tid()
            })
            .map_err(|e| e.to_string())?;
        check("no thread created for the job", rx.recv().unwrap() == 3)?;
        go.send(()).unwrap();
        let t = h.join().map_err(|_| "join".to_owned())?;
        check("ran in the child", comm(t).is_some())?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while R.counts().parked != 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        check("parked again", R.counts().parked == 2 && tasks() == 3)
    });
    assert_eq!(child, Ok(()));
    // The parent's reserve is untouched.
    assert_eq!(R.counts().parked, 2);
}

/// Installs, on the calling thread only, a seccomp filter that makes clone and clone3 fail
/// with EPERM (not kill: a test that got it wrong fails instead of dying).
fn forbid_clone_here() {
    const LD_NR: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        f(LD_NR, 0, 0, 0),
        f(JEQ, 2, 0, libc::SYS_clone as u32),
        f(JEQ, 1, 0, libc::SYS_clone3 as u32),
        f(RET, 0, 0, libc::SECCOMP_RET_ALLOW),
        f(RET, 0, 0, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut _,
    };
    // SAFETY: no_new_privs and a filter for this thread alone (no TSYNC); `fprog` lives
    // across the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                &fprog as *const libc::sock_fprog as libc::c_ulong,
                0,
                0
            ),
            0
        );
    }
}

#[test]
fn a_thread_with_a_filter_added_since_start_creates_none_but_uses_spares() {
    static R: Reserve = Reserve::new();
    note_start();
    let r = std::thread::spawn(|| {
        forbid_clone_here();
        // No spare: refused by our check, before any clone (the filter would say EPERM).
        let refused = R.spawn("smcr-test".into(), || ()).map(drop);
        let why = refused.as_ref().err().and_then(no_thread).cloned();
        let created = R.counts().created;
        (why, created)
    })
    .join()
    .unwrap();
    assert!(matches!(r.0, Some(NoThread::Filtered { .. })), "{r:?}");
    assert_eq!(r.1, 0);
    assert!(R.counts().locked);
    // A spare parked before the lock-down still serves a job of that thread.
    assert_eq!(R.reserve(1), 1);
    let ran = std::thread::spawn(|| {
        forbid_clone_here();
        R.spawn("smcr-test".into(), || 5)
            .map(|h| h.join().unwrap())
            .ok()
    })
    .join()
    .unwrap();
    assert_eq!(ran, Some(5));
    assert_eq!(R.counts().created, 1);
}

#[test]
fn a_claim_that_may_create_no_thread_waits_for_a_handshakes_thread() {
    static R: Reserve = Reserve::new();
    note_start();
    R.reserve(2);
    let (go, wait) = mpsc::channel::<()>();
    // A handshake on a spare (two parked, one kept), then the last spare claimed.
    let h = R
        .spawn_keeping(1, "smcr-test".into(), move || wait.recv().unwrap())
        .unwrap();
    let first = R.claim().unwrap();
    assert_eq!(R.counts().parked, 0);
    let claimed = std::thread::spawn(|| {
        forbid_clone_here();
        let t = Instant::now();
        let c = R.claim();
        (c.is_ok(), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(50));
    go.send(()).unwrap();
    h.join().unwrap();
    let (ok, waited) = claimed.join().unwrap();
    assert!(ok && waited >= Duration::from_millis(40), "{ok} {waited:?}");
    assert_eq!(R.counts().created, 2);
    drop(first);
    // Nothing transient running: refused at once.
    let c = std::thread::spawn(|| {
        forbid_clone_here();
        let t = Instant::now();
        let held: Vec<_> = std::iter::from_fn(|| R.claim().ok()).take(10).collect();
        (held.len(), t.elapsed())
    })
    .join()
    .unwrap();
    assert_eq!(c.0, 2);
    assert!(c.1 < CLAIM_WAIT, "{:?}", c.1);
}

/// This thread's network namespace.
fn my_netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino()
}

#[test]
fn a_spare_serves_only_callers_of_its_network_namespace() {
    static R: Reserve = Reserve::new();
    note_start();
    R.reserve(1);
    let here = my_netns();
    let r = std::thread::spawn(|| {
        // SAFETY: moves this thread alone into a new network namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return None;
        }
        let mine = my_netns();
        let theirs = R.spawn("t".into(), my_netns).unwrap().join().unwrap();
        Some((mine, theirs))
    })
    .join()
    .unwrap();
    let Some((mine, theirs)) = r else {
        eprintln!("SKIP: a network namespace needs root");
        return;
    };
    assert_ne!(mine, here);
    // Its job ran in its namespace, on a thread of its own, which then exited (not home);
    // the parked spare stayed.
    assert_eq!(theirs, mine);
    assert_eq!(R.counts().created, 2);
    assert_eq!(R.counts().parked, 1);
    // The spare serves this thread's namespace.
    assert_eq!(R.spawn("t".into(), my_netns).unwrap().join().unwrap(), here);
    assert_eq!(R.counts().created, 2);
}
