//! Our sockets going to a program image that cannot negotiate (an `exec` whose environment
//! drops the library, a spawned program without it): made plain TCP before they leave, so no
//! peer is told we speak SMC-R when the program that reads cannot ([`handing_off`]).

use std::ffi::OsString;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use super::runtime::enabled;
use crate::fds::borrowed;
use crate::guard::Bypass;
use crate::sock::Sock;
use crate::{log, table};

/// This library's file name (`libsmcr.so`, `libsmcr_preload.so`), from the loader.
fn our_name() -> Option<&'static OsString> {
    static NAME: OnceLock<Option<OsString>> = OnceLock::new();
    NAME.get_or_init(|| {
        // SAFETY: an all-zero Dl_info is valid; dladdr fills it for an address of ours.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: the address of a function of this library.
        let r = unsafe { libc::dladdr(our_name as *const libc::c_void, &mut info) };
        if r == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated path the loader keeps.
        let path = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
        use std::os::unix::ffi::OsStrExt;
        Path::new(std::ffi::OsStr::from_bytes(path.to_bytes()))
            .file_name()
            .map(|n| n.to_os_string())
    })
    .as_ref()
}

/// At load: the library's own file name, found now (`dladdr`; see `hooks::exec::prepare`).
pub(crate) fn prepare() {
    let _ = our_name();
}

/// Whether a new image with `LD_PRELOAD` = `preload` loads this library (named in it, or in
/// `/etc/ld.so.preload`).
pub(crate) fn library_in(preload: Option<&str>) -> bool {
    let Some(ours) = our_name() else {
        // Unknown: as if it did (nothing is changed on a guess).
        return true;
    };
    let names = |list: &str| {
        list.split([' ', ':', '\n', '\t'])
            .filter(|w| !w.is_empty())
            .any(|w| Path::new(w).file_name() == Some(ours.as_os_str()))
    };
    preload.is_some_and(names)
        || std::fs::read_to_string("/etc/ld.so.preload").is_ok_and(|s| names(&s))
}

/// Before our sockets that an exec hands to an image that cannot negotiate (`why`) reach it: a
/// marked listener goes quiet (no SYN-ACK of its port offers SMC-R any more: its peers fall
/// back with PEERNOSMC; what this process still accepts on it is TCP, HANDOFF); an accepted
/// connection nobody settled yet is settled as TCP now (the peer's Proposal read and
/// declined, HANDOFF). A connection already running over SMC-R is close-on-exec for real.
/// `listen_fds`: the new environment's `LISTEN_FDS` (sockets at 3 and up are handed over).
pub(crate) fn handing_off(why: &str, listen_fds: i32) {
    if !enabled() {
        return;
    }
    let handed = |fd: i32| fd <= 2 || (3..3 + listen_fds.max(0)).contains(&fd);
    let socks: Vec<_> = table::inherited_by_exec()
        .into_iter()
        .filter(|(fd, _)| handed(*fd))
        .collect();
    if socks.is_empty() {
        return;
    }
    let _b = Bypass::new();
    for (fd, s) in socks {
        make_tcp(fd, &s, why);
    }
}

/// Before `sendmsg` passes `fds` over the Unix socket `on` (SCM_RIGHTS): when the process at
/// its other end does not run the library, our listeners and accepted connections not
/// settled yet among them are made plain TCP first, as for an exec without the library
/// ([`handing_off`]). A receiver that runs it recognises them itself (`shim::received`).
pub(crate) fn sending(on: i32, fds: &[i32]) {
    if !enabled() {
        return;
    }
    let ours: Vec<(i32, std::sync::Arc<Sock>)> = fds
        .iter()
        .filter_map(|&fd| table::get_any(fd).map(|s| (fd, s)))
        .filter(|(_, s)| matches!(**s, Sock::Listener(_) | Sock::Accepted(_)))
        .collect();
    if ours.is_empty() {
        return;
    }
    let _b = Bypass::new();
    let (why, runs) = match receiver_of(on) {
        Some(pid) if pid == std::process::id() => return,
        Some(pid) => (
            format!("process {pid}, which does not run smcr"),
            receiver_runs_library(on, pid),
        ),
        // Not found (no credentials, no netlink, not a child of ours): nothing is offered
        // on a guess.
        None => ("a process that cannot be told".to_owned(), false),
    };
    if runs {
        return;
    }
    for (fd, s) in &ours {
        make_tcp(*fd, s, &why);
    }
}

/// The process at the other end of Unix socket `on`: its credentials say, unless they name
/// this process — a socketpair carries its maker's on both ends (a primary that made one per
/// worker before forking it): then the child of ours that holds the other end (sock_diag
/// gives its inode, `/proc/self/task/*/children` the children).
fn receiver(on: i32) -> Option<u32> {
    let me = std::process::id();
    let pid = super::adopt::peer_pid(on)?;
    if pid != me {
        return Some(pid);
    }
    let peer = smcr::diag::unix_peer_inode(crate::fds::inode(on)?)?;
    let want = format!("socket:[{peer}]");
    // Our own end of a pair kept in this process: passing to ourselves.
    let holds = |p: u32| {
        std::fs::read_dir(format!("/proc/{p}/fd")).is_ok_and(|d| {
            d.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
        })
    };
    // A child holding the other end first: a primary that forgot to close its copy after
    // the fork would otherwise be taken for the reader, and a child without the library would
    // get sockets that offer SMC-R. Judging by the child at worst makes them TCP needlessly.
    let children: Vec<u32> = std::fs::read_dir("/proc/self/task")
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    children
        .into_iter()
        .find(|&c| holds(c))
        .or_else(|| holds(me).then_some(me))
}

/// Answers remembered for a second per key (a cluster's primary passes every connection over
/// the same channel: one look a second, not one per connection; a worker that execs another
/// image is looked at again soon). Only ever tried for (never waited on), so a child forked
/// while another thread held it is not stuck: it looks again.
struct Recent<K, V>(std::sync::Mutex<Vec<(K, V, std::time::Instant)>>);

impl<K: PartialEq + Copy, V: Copy> Recent<K, V> {
    const FOR: std::time::Duration = std::time::Duration::from_secs(1);

    const fn new() -> Self {
        Self(std::sync::Mutex::new(Vec::new()))
    }

    fn get_or(&self, key: K, look: impl FnOnce() -> V) -> V {
        let now = std::time::Instant::now();
        if let Ok(v) = self.0.try_lock()
            && let Some((_, r, _)) = v
                .iter()
                .find(|(k, _, at)| *k == key && now.duration_since(*at) < Self::FOR)
        {
            return *r;
        }
        let r = look();
        if let Ok(mut v) = self.0.try_lock() {
            v.retain(|(k, _, at)| *k != key && now.duration_since(*at) < Self::FOR);
            if v.len() < 256 {
                v.push((key, r, now));
            }
        }
        r
    }
}

/// [`receiver`] of Unix socket `on`, remembered per socket ([`Recent`]): for a socketpair it
/// reads the children's descriptors, which would otherwise cost every passed connection
/// (socket inode numbers are not reused within a second).
fn receiver_of(on: i32) -> Option<u32> {
    static SEEN: Recent<u64, Option<u32>> = Recent::new();
    match crate::fds::inode(on) {
        Some(ino) => SEEN.get_or(ino, || receiver(on)),
        None => receiver(on),
    }
}

/// [`runs_library`] for the peer `pid` of Unix socket `on`, remembered per socket
/// ([`Recent`]).
fn receiver_runs_library(on: i32, pid: u32) -> bool {
    static SEEN: Recent<(u64, u32), bool> = Recent::new();
    SEEN.get_or((crate::fds::inode(on).unwrap_or(0), pid), || {
        runs_library(pid)
    })
}

/// How long a process that was forked by one running the library, and has not exec'd since,
/// is given to exec before it is taken for a worker that stays (a prefork worker runs the
/// library); counted from its start, so a worker that stays costs this once, at most.
const EXEC_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The kernel's task flag "forked but not exec'd yet" (`PF_FORKNOEXEC`).
const PF_FORKNOEXEC: u64 = 0x40;

/// Whether process `pid` runs this library: its `/proc/PID/maps` names it, or it has just
/// exec'd with `LD_PRELOAD` naming it (the loader maps it in a moment). False when that cannot
/// be read (another user's process, as non-root): nothing is offered on a guess.
///
/// A child forked by a process that runs the library has it mapped until it execs, and the
/// image it execs may be without it (a worker started by fork and exec without `LD_PRELOAD`:
/// a listener sent to it before its exec reached a program that cannot negotiate, whose
/// clients then sent it CLC bytes). Such a child is given until [`EXEC_WAIT`] after its start
/// to exec, then judged by what it runs.
fn runs_library(pid: u32) -> bool {
    runs_library_within(pid, EXEC_WAIT)
}

/// [`runs_library`] with `exec_wait` for [`EXEC_WAIT`] (tests give it margins).
fn runs_library_within(pid: u32, exec_wait: std::time::Duration) -> bool {
    let Some(ours) = our_name().and_then(|n| n.to_str()) else {
        return true;
    };
    loop {
        // The flag before the maps: an exec replaces the mappings before it clears the flag,
        // so maps read after a flag that says "not exec'd" are the old image's or the new
        // one's (judged by it), never the old image's after a flag that says it exec'd.
        let state = fork_state(pid);
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            return false;
        };
        let mapped = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .any(|path| Path::new(path).file_name().and_then(|n| n.to_str()) == Some(ours));
        match state {
            Some((true, age)) if mapped && age < exec_wait => {
                std::thread::sleep((exec_wait - age).min(std::time::Duration::from_millis(2)));
            }
            _ => return mapped || preloads(pid, ours),
        }
    }
}

/// Whether `pid`'s environment has `LD_PRELOAD` naming library file `ours`.
fn preloads(pid: u32, ours: &str) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    env.split(|&b| b == 0)
        .filter_map(|v| v.strip_prefix(b"LD_PRELOAD="))
        .flat_map(|v| v.split(|&b| b == b' ' || b == b':'))
        .any(|lib| lib.rsplit(|&b| b == b'/').next() == Some(ours.as_bytes()))
}

/// `pid`'s "forked, not exec'd since" flag and its age, from `/proc/PID/stat`.
fn fork_state(pid: u32) -> Option<(bool, std::time::Duration)> {
    let stat = smcr::sys::proc_stat(pid)?;
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to fill.
    if tck <= 0 || unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    let now = std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
    let started = std::time::Duration::from_secs_f64(stat.start_ticks as f64 / tck as f64);
    Some((stat.flags & PF_FORKNOEXEC != 0, now.saturating_sub(started)))
}

/// Makes our socket `s` at `fd`, about to reach a program that cannot negotiate (`why`),
/// plain TCP: a marked listener goes quiet, an accepted connection nobody settled is declined
/// now (HANDOFF).
fn make_tcp(fd: i32, s: &Sock, why: &str) {
    match s {
        Sock::Listener(l) => {
            if l.handed_off.swap(true, Ordering::AcqRel) {
                return;
            }
            // The records without the runtime: a forked child about to exec has none of its
            // own, and making one (threads, a stats area) just for this would outlive it.
            let r = super::adopt::records().map(|m| m.quiet(borrowed(fd)));
            log::line(format_args!(
                "fd {fd}: a listener going to {why}: {}",
                match r {
                    Some(Ok(())) => "quiet (its peers fall back to TCP)".to_owned(),
                    Some(Err(e)) => format!("could not be made quiet: {e}"),
                    None => "no option program: it offers nothing".to_owned(),
                }
            ));
        }
        Sock::Accepted(acc) => {
            log::line(format_args!(
                "fd {fd}: an accepted connection going to {why}: settled as TCP first"
            ));
            acc.hand_off(fd);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::time::{Duration, Instant};

    /// A forked child that blocks until [`Child::go`], then execs `sleep 2` (or exits when
    /// `exec` is false): no timing decides which state a look finds it in.
    struct Child {
        pid: libc::pid_t,
        go: i32,
    }

    impl Child {
        fn fork(exec: bool) -> Self {
            let path = CString::new("/bin/sleep").unwrap();
            let arg = CString::new("2").unwrap();
            let argv = [path.as_ptr(), arg.as_ptr(), std::ptr::null()];
            let mut p = [0i32; 2];
            // SAFETY: a two-int array for pipe; the child only calls async-signal-safe
            // functions on memory prepared above.
            unsafe {
                assert_eq!(libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC), 0, "pipe");
                let pid = libc::fork();
                assert!(pid >= 0, "fork");
                if pid == 0 {
                    let mut b = 0u8;
                    libc::read(p[0], (&mut b as *mut u8).cast(), 1);
                    if exec {
                        libc::execv(path.as_ptr(), argv.as_ptr());
                    }
                    libc::_exit(0);
                }
                libc::close(p[0]);
                Self { pid, go: p[1] }
            }
        }

        fn go(&self) {
            // SAFETY: our pipe's write end.
            assert_eq!(unsafe { libc::write(self.go, b"g".as_ptr().cast(), 1) }, 1);
        }
    }

    impl Drop for Child {
        fn drop(&mut self) {
            // SAFETY: our own child and pipe.
            unsafe {
                libc::close(self.go);
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, std::ptr::null_mut(), 0);
            }
        }
    }

    #[test]
    fn a_fresh_fork_is_waited_for_until_it_execs_or_stays() {
        // Forked from this process (which maps the code of `our_name`), about to exec a
        // program without it: judged by what it execs, once it has. The wait is long enough
        // for any machine; the look returns as soon as the exec shows.
        let c = Child::fork(true);
        let (forked, _) = fork_state(c.pid as u32).expect("its stat");
        assert!(forked, "not exec'd yet");
        c.go();
        assert!(
            !runs_library_within(c.pid as u32, Duration::from_secs(60)),
            "sleep does not run the library"
        );
        assert_eq!(fork_state(c.pid as u32).map(|f| f.0), Some(false));
        drop(c);
        // A fork that stays the same image (a prefork worker) runs the library, decided once
        // its age passes the wait; later looks do not wait.
        let wait = Duration::from_millis(100);
        let c = Child::fork(false);
        assert!(runs_library_within(c.pid as u32, wait));
        let (forked, age) = fork_state(c.pid as u32).expect("its stat");
        assert!(
            forked && age >= wait,
            "decided only once it was {wait:?} old: {age:?}"
        );
        let t = Instant::now();
        assert!(runs_library_within(c.pid as u32, wait));
        assert!(t.elapsed() < wait, "no second wait");
        drop(c);
        // This process was exec'd: no fork flag.
        assert_eq!(fork_state(std::process::id()).map(|f| f.0), Some(false));
    }
}
