//! The listener and accept path: marking and listening, the kernel's connection handed over
//! at once, and the server side of the handshake run at the connection's first use
//! ([`Settling::start`]) in whichever process uses it, one holder deciding at a time
//! (`ClaimLock`), a connection several processes hold staying TCP.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smcr::{FallbackReason, Mode, Runtime, SmcStream};

use super::fork::{children_since, forks};
use super::outcome::Outcome;
use super::runtime::{NEGOTIATING, claim, describe, runtime, spares_to_keep};
use crate::fds::{borrowed, hide, hide_owned, inode, sock_addr, sockaddr_of};
use crate::guard::Bypass;
use crate::sock::{Listener, Role, Settling, Sock, State};
use crate::{log, real, table};

// glibc's (not in the libc crate); `PTHREAD_CANCEL_DISABLE` from <pthread.h>.
unsafe extern "C" {
    fn pthread_setcancelstate(state: libc::c_int, old: *mut libc::c_int) -> libc::c_int;
}
const PTHREAD_CANCEL_DISABLE: libc::c_int = 1;

/// Marks `fd` for the TCP option (before `listen`).
pub(crate) fn mark(fd: i32) -> bool {
    let _b = Bypass::new();
    runtime().mark(borrowed(fd))
}

/// After the application's `listen` on a marked socket: the number stays the listening
/// socket; the table says its connections may negotiate.
pub(crate) fn listening(fd: i32) {
    let _b = Bypass::new();
    let bound = sock_addr(fd, false);
    let stat = bound.and_then(|a| runtime().listener_record(a));
    table::insert(
        fd,
        Arc::new(Sock::Listener(Arc::new(Listener {
            stat: Mutex::new(stat),
            bound,
            handed_off: Default::default(),
        }))),
    );
}

/// The application's `accept4(fd, addr, len, flags)` on a marked listener: the kernel's
/// connection at once; one whose peer offered SMC-R negotiates at its first use.
pub(crate) fn accept(
    fd: i32,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    flags: i32,
) -> i32 {
    // SAFETY: an all-zero sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: accepting on the application's listener into our address buffer, with its flags.
    let c = unsafe { real::accept4()(fd, (&raw mut ss).cast(), &mut sl, flags) };
    if c < 0 {
        return c;
    }
    // SAFETY: the kernel filled `sl` bytes of `ss`; the caller's buffer as accept fills it.
    unsafe { copy_addr(&ss, sl, addr, len) };
    let e = crate::guard::errno();
    let _b = Bypass::new();
    crate::epoll::forget(c);
    let peer = sockaddr_of(&ss, sl);
    let listener = table::get_any(fd).and_then(|s| match &*s {
        Sock::Listener(l) => Some(l.clone()),
        _ => None,
    });
    let local = listener
        .as_ref()
        .and_then(|l| l.bound)
        .filter(|a| !a.ip().is_unspecified());
    let rt = runtime();
    let addrs = local.zip(peer);
    let verdict = if listener
        .as_ref()
        .is_some_and(|l| l.handed_off.load(Ordering::Acquire))
    {
        // Quiet since it went to a program without smcr: no peer was offered SMC-R.
        SmcStream::record_local(&rt, borrowed(c), true, FallbackReason::HandedOff);
        Err(FallbackReason::HandedOff)
    } else {
        SmcStream::accept_verdict(&rt, borrowed(c), addrs)
    };
    match verdict {
        Err(why) => {
            log::line(format_args!(
                "fd {fd} accept {peer:?}: {}",
                describe(&Mode::Tcp(why))
            ));
        }
        Ok(()) => {
            let acc = Settling::new(
                Role::Server {
                    pid: table::pid(),
                    forks: forks(),
                    native_v6: peer.is_some_and(|p| smcr::v4_of(p).is_none()),
                },
                true,
                flags & libc::SOCK_NONBLOCK != 0,
            );
            table::insert(c, Arc::new(Sock::Accepted(acc.clone())));
            // From a connect of this very process: negotiated now (the program may wait on its
            // end of the connection before it uses this one).
            if peer.is_some_and(|p| super::connect::own_connect(c, p)) {
                acc.start(c);
            }
        }
    }
    crate::guard::set_errno(e);
    c
}

/// Copies an accepted peer's address into the caller's buffer as accept(2) does: at most
/// `*len` bytes, and `*len` set to the address's full length.
///
/// # Safety
/// `addr`/`len` are null or the caller's valid buffer and length, as accept's contract says.
unsafe fn copy_addr(
    sa: &libc::sockaddr_storage,
    sl: libc::socklen_t,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) {
    if addr.is_null() || len.is_null() {
        return;
    }
    // SAFETY: per the contract, `len` is valid and `addr` has `*len` writable bytes.
    unsafe {
        let n = (*len).min(sl) as usize;
        std::ptr::copy_nonoverlapping(
            (sa as *const libc::sockaddr_storage).cast::<u8>(),
            addr.cast(),
            n,
        );
        *len = sl;
    }
}

impl Settling {
    /// The accepted connection at `fd` is about to go to a program that cannot negotiate:
    /// settled as TCP now, on this thread (the peer's Proposal read and declined, HANDOFF);
    /// one already being settled elsewhere is waited for (at most the CLC wait).
    pub(crate) fn hand_off(self: &Arc<Self>, fd: i32) {
        self.st.lock().handed_off = true;
        if !self.start_on(fd, true) {
            self.wait(Duration::from_secs(30));
        }
    }

    /// The application uses the connection at `fd`: an accepted one starts negotiating, in
    /// this process, on a worker (a connect's worker runs already). Whether it is settled.
    pub(crate) fn start(self: &Arc<Self>, fd: i32) -> bool {
        self.start_on(fd, false)
    }

    /// As [`Self::start`]; with `here` (the caller is a blocking read with no time limit,
    /// which would wait for the outcome anyway) the server's side runs on the calling
    /// thread: no hand-off to a worker and back, two context switches per connection fewer
    /// for a thread-per-connection server.
    pub(crate) fn start_on(self: &Arc<Self>, fd: i32, here: bool) -> bool {
        let mut st = self.st.lock();
        let me = table::pid();
        match st.state {
            State::Done => return true,
            State::Running if self.runner.load(Ordering::Acquire) == me => return false,
            State::Running => {
                // A copy forked while the parent negotiated: the parent records the outcome
                // on the socket; this process follows it.
                let parent = self.runner.swap(me, Ordering::AcqRel);
                drop(st);
                let _b = Bypass::new();
                let dup = hide(fd).ok();
                let me2 = self.clone();
                crate::workers::run(spares_to_keep(), move || me2.follow_runner(fd, dup, parent));
                return false;
            }
            State::Idle => {
                st.state = State::Running;
                self.runner.store(me, Ordering::Release);
                NEGOTIATING.fetch_add(1, Ordering::AcqRel);
            }
        }
        drop(st);
        let _b = Bypass::new();
        // Our duplicate, taken on the application's thread while `fd` is surely its socket.
        match hide(fd) {
            Ok(dup) if here => {
                // The reading thread is the application's: a pthread_cancel of it must not
                // unwind through the handshake (the read after it stays a cancellation point),
                // and a panic settles the connection as failed rather than leaving it
                // negotiating for ever (the caller's guard turns the read into EIO).
                let mut old = 0;
                // SAFETY: changes this thread's cancel state only; restored below.
                unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut old) };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.settle_accepted(fd, Some(dup))
                }));
                // SAFETY: as above.
                unsafe { pthread_setcancelstate(old, std::ptr::null_mut()) };
                if let Err(p) = r {
                    if self.st.lock().state != State::Done {
                        self.finish(fd, Outcome::Failed);
                    }
                    std::panic::resume_unwind(p);
                }
                true
            }
            Ok(dup) => {
                let me = self.clone();
                crate::workers::run(spares_to_keep(), move || me.settle_accepted(fd, Some(dup)));
                false
            }
            Err(_) => {
                // No room for it: settled here, on the application's number (NOFD).
                self.settle_accepted(fd, None);
                true
            }
        }
    }

    // -- the server side ------------------------------------------------------------------

    fn settle_accepted(&self, fd: i32, dup: Option<OwnedFd>) {
        let _b = Bypass::new();
        let rt = runtime();
        let outcome = self.accepted_outcome(&rt, fd, dup);
        self.finish(fd, outcome);
    }

    /// In a child forked while `parent` settled the connection: waits for the outcome the
    /// parent records on the socket (SMC-R there: not this process's to use; TCP: plain here
    /// too). A parent gone without recording one leaves a connection in an unknown state:
    /// not usable here either.
    fn follow_runner(&self, fd: i32, dup: Option<OwnedFd>, parent: u32) {
        let _b = Bypass::new();
        let rt = runtime();
        let sock = dup.as_ref().map_or(fd, AsRawFd::as_raw_fd);
        let outcome = loop {
            let c = rt
                .option_records()
                .and_then(|m| m.claimed(borrowed(sock)).ok().flatten());
            match c {
                Some(c) if c.smc && c.pid != table::pid() => break Outcome::Foreign,
                Some(c) => {
                    if c.pid != table::pid() {
                        SmcStream::record_follower(&rt, borrowed(fd), true);
                    }
                    break Outcome::Plain(dup);
                }
                None if !alive(parent) || rt.option_records().is_none() => {
                    log::line(format_args!(
                        "fd {fd}: inherited while process {parent} negotiated it, which \
                         recorded no outcome: not usable here"
                    ));
                    break Outcome::Foreign;
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        self.finish(fd, outcome);
    }

    fn accepted_outcome(&self, rt: &Runtime, fd: i32, dup: Option<OwnedFd>) -> Outcome {
        let Role::Server {
            pid,
            forks: at,
            native_v6,
        } = self.role
        else {
            unreachable!("an accepted connection")
        };
        let sock = dup.as_ref().map_or(fd, AsRawFd::as_raw_fd);
        // Another process may hold the socket and use it now too: one decides at a time, and
        // records the decision on the socket before the next looks (only one CLC answer may
        // reach the peer).
        let _lock = (pid != table::pid() || forks() != at)
            .then(|| inode(sock).and_then(ClaimLock::take))
            .flatten();
        // Settled by another holder already (it recorded it on the socket).
        if let Some(c) = rt
            .option_records()
            .and_then(|m| m.claimed(borrowed(sock)).ok().flatten())
        {
            log::line(format_args!(
                "fd {fd}: settled by process {} as {}",
                c.pid,
                if c.smc { "SMC-R" } else { "TCP" }
            ));
            return if c.smc && c.pid != table::pid() {
                Outcome::Foreign
            } else {
                if c.pid != table::pid() {
                    SmcStream::record_follower(rt, borrowed(fd), true);
                }
                Outcome::Plain(dup)
            };
        }
        let local = if self.st.lock().handed_off {
            Some(FallbackReason::HandedOff)
        } else if native_v6 {
            Some(FallbackReason::NotIpv4)
        } else if shared(pid, at, sock) {
            Some(FallbackReason::Shared)
        } else if dup.is_none() {
            Some(FallbackReason::NoDescriptors)
        } else {
            None
        };
        if let Some(reason) = local {
            let r = SmcStream::decline_local(rt, borrowed(sock), fd, true, true, reason);
            log::line(format_args!("fd {fd} accept: {r:?}"));
            claim(rt, borrowed(sock), false);
            return if r.is_ok() {
                Outcome::Plain(dup)
            } else {
                Outcome::Failed
            };
        }
        let tcp = TcpStream::from(dup.expect("checked above"));
        let peer = log::enabled().then(|| tcp.peer_addr().ok()).flatten();
        match SmcStream::from_accepted(rt, tcp) {
            Ok(s) => {
                log::line(format_args!(
                    "fd {fd} accept {peer:?}: {}",
                    describe(s.mode())
                ));
                let smc = matches!(s.mode(), Mode::SmcR { .. });
                claim(rt, borrowed(sock), smc);
                if smc {
                    Outcome::Smc(s)
                } else {
                    Outcome::Fallback(s)
                }
            }
            Err(e) => {
                // As Linux: a connection whose handshake failed is unusable; here the
                // application already holds it, so it sees it end.
                log::line(format_args!(
                    "fd {fd} accept {peer:?}: handshake failed: {e}"
                ));
                claim(rt, borrowed(sock), false);
                Outcome::Failed
            }
        }
    }
}

/// How long a connection held by several processes at its first use waits for the others to
/// let go (a forking server's parent closes its copy right after the fork) before it is
/// settled as TCP.
const SHARED_GRACE: Duration = Duration::from_millis(250);

/// Whether another process still holds the socket `fd` (after waiting [`SHARED_GRACE`] for
/// it to let go): the accepting process `pid`, for a child that inherited it; the children
/// forked since the `at`th fork, for the accepting process.
fn shared(pid: u32, at: u64, fd: i32) -> bool {
    let me = table::pid();
    let others: Vec<u32> = if pid != me {
        // SAFETY: getppid has no preconditions.
        let mut v = vec![pid, unsafe { libc::getppid() } as u32];
        v.dedup();
        v
    } else if forks() != at {
        children_since(at)
    } else {
        return false;
    };
    let Some(ino) = inode(fd) else { return false };
    let deadline = Instant::now() + SHARED_GRACE;
    loop {
        if !others.iter().any(|&p| p != me && holds(p, ino)) {
            return false;
        }
        if Instant::now() >= deadline {
            log::line(format_args!(
                "socket {ino} is held by processes {others:?} too: it stays TCP"
            ));
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An exclusive lock, across processes, on deciding an accepted connection: `flock` on a
/// file named by the socket's inode in `/dev/shm` (any user may make one there; a lock dies
/// with its process). The file is removed when the lock is let go, after the decision is on
/// the socket: a process that opened it before still gets the lock, and then reads the claim.
struct ClaimLock {
    _file: OwnedFd,
    path: std::ffi::CString,
}

impl ClaimLock {
    fn take(ino: u64) -> Option<Self> {
        let path = std::ffi::CString::new(format!("/dev/shm/smcr-claim-{ino}")).ok()?;
        // SAFETY: opening a file by a valid C string.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o666,
            )
        };
        if fd < 0 {
            log::line(format_args!(
                "socket {ino}: no claim lock ({}): deciding without it",
                io::Error::last_os_error()
            ));
            return None;
        }
        let file = hide_owned(fd).ok()?;
        // SAFETY: our descriptor; other users' processes may hold the socket too (umask).
        unsafe { libc::fchmod(file.as_raw_fd(), 0o666) };
        loop {
            // SAFETY: locking our descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                break;
            }
            if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return None;
            }
        }
        Some(Self { _file: file, path })
    }
}

impl Drop for ClaimLock {
    fn drop(&mut self) {
        // SAFETY: removing our lock file by name (another user's may stay: harmless).
        unsafe { libc::unlink(self.path.as_ptr()) };
    }
}

/// Whether process `pid` exists.
fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether process `pid` (alive) has the socket with inode `ino` open. A process whose
/// descriptors we may not read counts as holding it.
fn holds(pid: u32, ino: u64) -> bool {
    if !alive(pid) {
        return false;
    }
    let want = format!("socket:[{ino}]");
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        // Gone meanwhile, or not ours to look at.
        return std::path::Path::new(&format!("/proc/{pid}")).exists();
    };
    dir.flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
}
