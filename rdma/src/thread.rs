//! Threads of the library (engine, pollers, acceptors, handshake workers) block every signal
//! a process can be sent, so the kernel delivers those to the application's own threads: a
//! program that counts on a signal interrupting its blocking call (an `alarm` around
//! `accept`, Python's signal handlers) or on its handler running on its own thread keeps
//! that when a preloaded library adds threads to it. Faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL,
//! SIGTRAP, SIGSYS) stay unblocked: they belong to the thread that caused them.

use std::io;

/// Spawns a named thread with all but the fault signals blocked (set before it starts, so
/// none can reach it in between).
pub fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<std::thread::JoinHandle<T>> {
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
        let r = std::thread::Builder::new().name(name).spawn(f);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        r
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_thread_blocks_signals_and_the_caller_keeps_its_mask() {
        // SAFETY: reading signal masks into local sets.
        let mask = || unsafe {
            let mut m: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut m);
            (
                libc::sigismember(&m, libc::SIGALRM),
                libc::sigismember(&m, libc::SIGTERM),
                libc::sigismember(&m, libc::SIGSEGV),
            )
        };
        let before = mask();
        let inside = super::spawn("t".into(), mask).unwrap().join().unwrap();
        assert_eq!(inside, (1, 1, 0));
        assert_eq!(mask(), before);
    }
}
