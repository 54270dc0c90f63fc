//! What the kernel says about the calling thread, from `/proc/thread-self`: its seccomp
//! filters, and its network namespace.
//!
//! Whether creating a thread could kill the process: a seccomp filter that forbids `clone`
//! kills on the call (systemd's and libseccomp's default action), so we must know before we
//! make it. A filter present when the library started is the service manager's (systemd's
//! `@system-service` allows `clone`); one added later is the program's own lock-down, whose
//! rules we cannot read, so from then on no thread is created. The calling thread's
//! `Seccomp_filters:` in its `status` counts its filters (the new thread would inherit them);
//! it is read only when a thread must be created.
//!
//! The network namespace is a thread's own (`setns` changes the caller's only; the Rust API's
//! users run a runtime's threads inside one): a spare made in one namespace would open its
//! job's sockets in the wrong one, so spares are handed only to callers of their namespace.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use super::NoThread;

/// A thread's seccomp state, from its `/proc/…/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct State {
    /// `Seccomp:`: 0 off, 1 strict, 2 filter.
    pub(crate) mode: u32,
    /// `Seccomp_filters:` (Linux 5.9 and later).
    pub(crate) filters: Option<u32>,
}

impl State {
    /// Packed into one word (for an atomic), never 0.
    fn pack(self) -> u64 {
        1 << 63 | u64::from(self.mode) << 32 | u64::from(self.filters.map_or(u32::MAX, |f| f))
    }

    fn unpack(w: u64) -> Option<Self> {
        (w != 0 && w != NONE).then(|| Self {
            mode: (w >> 32) as u32 & 0x7fff_ffff,
            filters: Some(w as u32).filter(|&f| f != u32::MAX),
        })
    }
}

/// Parses the `Seccomp:` and `Seccomp_filters:` lines of a status file.
pub(crate) fn parse(status: &str) -> Option<State> {
    let field = |name: &str| {
        status.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(':')?
                .trim()
                .parse::<u32>()
                .ok()
        })
    };
    Some(State {
        mode: field("Seccomp")?,
        filters: field("Seccomp_filters"),
    })
}

/// Whether creating a thread is safe now (`now`) given the state at start (`start`).
pub(crate) fn decide(start: Option<State>, now: Option<State>) -> Result<(), NoThread> {
    // Nothing could be read at start (no /proc): nothing to compare with; as before.
    let Some(start) = start else {
        return Ok(());
    };
    let Some(now) = now else {
        // It could be read then and cannot now (a chroot without /proc): whether a filter
        // came meanwhile is unknown, and guessing wrong kills the process.
        return Err(NoThread::CannotTell);
    };
    let added = match (start.filters, now.filters) {
        (Some(a), Some(b)) => b > a,
        // An older kernel counts no filters: only off → filtering shows.
        _ => now.mode != start.mode,
    };
    if added {
        return Err(NoThread::Filtered {
            at_start: start.filters.unwrap_or(0),
            now: now.filters.unwrap_or(1),
        });
    }
    Ok(())
}

/// The state at start, packed; 0: not read yet, [`NONE`]: could not be read.
static START: AtomicU64 = AtomicU64::new(0);
const NONE: u64 = 1;

/// Our descriptor of `/proc` (-1: none yet, -2: could not be opened), and its device and
/// inode: `thread-self/status` under it can still be read after the program chroots, and a
/// program that closed it (a daemon closing every descriptor) is noticed.
static PROC_FD: AtomicI32 = AtomicI32::new(-1);
static PROC_ID: AtomicU64 = AtomicU64::new(0);

/// Reads the state at start, if not read yet (the preload library does at load, before the
/// program's `main`; otherwise the first use of the reserve does).
pub(crate) fn note_start() {
    if START.load(Ordering::Acquire) == 0 {
        let w = read_now().map_or(NONE, State::pack);
        if START
            .compare_exchange(0, w, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            HOME.store(netns().unwrap_or(0), Ordering::Release);
        }
    }
}

/// The network namespace the process started in (0: unknown).
static HOME: AtomicU64 = AtomicU64::new(0);

/// The network namespace the process started in, if known: where spares are kept (a thread
/// that ran a job in another one, a thread's own `setns`, exits after it instead, so that a
/// namespace the program is done with is not kept alive by a parked thread of ours).
pub(crate) fn home_netns() -> Option<u64> {
    Some(HOME.load(Ordering::Acquire)).filter(|&n| n != 0)
}

/// Opens our descriptor of `/proc` (once; out of the application's numbers, see
/// `crate::fdzone`), so that the check still works after a chroot.
pub(crate) fn keep_proc() {
    if PROC_FD.load(Ordering::Acquire) != -1 {
        return;
    }
    let opened = rustix::fs::open(
        "/proc",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(std::io::Error::from)
    .and_then(crate::fdzone::place);
    let Ok(fd) = opened else {
        let _ = PROC_FD.compare_exchange(-1, -2, Ordering::AcqRel, Ordering::Acquire);
        return;
    };
    let Ok(st) = rustix::fs::fstat(&fd) else {
        return;
    };
    PROC_ID.store(id(&st), Ordering::Release);
    let raw = fd.as_raw_fd();
    if PROC_FD
        .compare_exchange(-1, raw, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        std::mem::forget(fd);
    }
}

fn id(st: &rustix::fs::Stat) -> u64 {
    st.st_dev << 32 ^ st.st_ino
}

/// The calling thread's state now.
pub(crate) fn read_now() -> Option<State> {
    let mut s = String::new();
    let raw = PROC_FD.load(Ordering::Acquire);
    if raw >= 0 {
        // SAFETY: borrowed only for these calls; `fstat` tells whether it is still ours.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
        let ours =
            rustix::fs::fstat(dir).is_ok_and(|st| id(&st) == PROC_ID.load(Ordering::Acquire));
        if ours
            && let Ok(f) = rustix::fs::openat(
                dir,
                "thread-self/status",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            && std::fs::File::from(f).read_to_string(&mut s).is_ok()
        {
            return parse(&s);
        }
    }
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| parse(&s))
}

/// The calling thread's network namespace (its nsfs inode), if it can be read.
pub(crate) fn netns() -> Option<u64> {
    let raw = PROC_FD.load(Ordering::Acquire);
    if raw >= 0 {
        // SAFETY: as in `read_now`.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
        if rustix::fs::fstat(dir).is_ok_and(|st| id(&st) == PROC_ID.load(Ordering::Acquire))
            && let Ok(st) =
                rustix::fs::statat(dir, "thread-self/ns/net", rustix::fs::AtFlags::empty())
        {
            return Some(st.st_ino);
        }
    }
    rustix::fs::stat("/proc/thread-self/ns/net")
        .ok()
        .map(|st| st.st_ino)
}

/// Whether the calling thread may create a thread (see the module docs).
pub(crate) fn may_create() -> Result<(), NoThread> {
    note_start();
    decide(State::unpack(START.load(Ordering::Acquire)), read_now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(mode: u32, filters: Option<u32>) -> Option<State> {
        Some(State { mode, filters })
    }

    #[test]
    fn the_status_lines_are_read() {
        let s = "Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t3\nSpeculation_Store_Bypass:\tthread\n";
        assert_eq!(parse(s), st(2, Some(3)));
        assert_eq!(parse("Seccomp:\t0\n"), st(0, None));
        assert_eq!(parse("Name:\tx\n"), None);
    }

    #[test]
    fn only_a_filter_added_after_start_forbids_a_thread() {
        // The service manager's filter at start, none added: allowed.
        assert_eq!(decide(st(2, Some(1)), st(2, Some(1))), Ok(()));
        assert_eq!(decide(st(0, Some(0)), st(0, Some(0))), Ok(()));
        // One added by the program.
        assert_eq!(
            decide(st(2, Some(1)), st(2, Some(2))),
            Err(NoThread::Filtered {
                at_start: 1,
                now: 2
            })
        );
        assert!(decide(st(0, Some(0)), st(2, Some(1))).is_err());
        // No counts (old kernel): off → filtering.
        assert!(decide(st(0, None), st(2, None)).is_err());
        assert_eq!(decide(st(2, None), st(2, None)), Ok(()));
        // Unreadable now, readable at start: cannot tell, refused.
        assert_eq!(decide(st(0, Some(0)), None), Err(NoThread::CannotTell));
        // Never readable: as before.
        assert_eq!(decide(None, None), Ok(()));
    }

    #[test]
    fn a_state_survives_packing() {
        for s in [st(0, Some(0)), st(2, Some(7)), st(2, None), st(1, None)] {
            assert_eq!(State::unpack(s.unwrap().pack()), s);
        }
        assert_eq!(State::unpack(0), None);
        assert_eq!(State::unpack(NONE), None);
    }
}
