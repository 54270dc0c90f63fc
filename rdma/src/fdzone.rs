//! Where the engine's and the runtime's own descriptors go when they share a process with an
//! application that does not know about them (the preload shim).
//!
//! A program sees the descriptor numbers it is given (the lowest free one), sizes `select`
//! sets and connection tables by `RLIMIT_NOFILE`, and fails with EMFILE at its soft limit.
//! Our descriptors must not take its numbers, nor make it reach that limit sooner. Off by
//! default (a Rust program embedding the crates owns its table); [`enable`] turns it on for the
//! process, after which [`place`] moves each new descriptor of ours:
//!
//! * **Above the soft limit** when the hard limit allows (Debian's services and logins run with
//!   soft 1024 and a much higher hard limit): the soft limit is raised for the one
//!   `fcntl(F_DUPFD_CLOEXEC)` that moves the descriptor, then put back, so every number below
//!   the application's limit stays its own. Descriptors above the limit keep working; the limit
//!   only bounds the numbers new ones get.
//! * **Inside the limit** when soft and hard are equal (`ulimit -n 1024` sets both): into the
//!   top eighth of the range, `[soft - soft/8, soft)`. The application keeps seven eighths of
//!   its descriptors whatever we do; when our eighth is full, [`place`] fails with EMFILE and
//!   the caller leaves that connection plain TCP.
//!
//! The raise is process-wide for a few microseconds: a thread of the application that opens a
//! descriptor at that moment while every number below its limit is taken gets a number above
//! it instead of EMFILE. Our toggles are serialised; an application that changes its own limit
//! concurrently may see its change undone (a race we accept: programs set limits at start-up).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Mutex, PoisonError};

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

static ON: AtomicBool = AtomicBool::new(false);
/// Serialises our raises of the soft limit. A `std` lock, held across `fork`
/// (`crate::forkhold`): a child forked during a raise would keep the raised limit.
static RAISE: Mutex<()> = Mutex::new(());

/// Before a fork: the forking thread takes [`RAISE`] (the limit is the program's again).
pub(crate) fn hold_for_fork() {
    crate::forkhold::hold_mutex(&RAISE);
}
/// Descriptors placed, and placements refused, since start (diagnostics).
static PLACED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// How far above the soft limit a raise reaches (our descriptors' numbers there start at the
/// soft limit; this bounds how many we can hold above it).
const ABOVE_SPAN: u64 = 1 << 16;

/// Turns placement on for this process (idempotent).
pub fn enable() {
    ON.store(true, Ordering::Release);
}

/// Whether [`place`] moves descriptors.
pub fn enabled() -> bool {
    ON.load(Ordering::Acquire)
}

/// (placed, refused) so far.
pub fn counts() -> (u64, u64) {
    (
        PLACED.load(Ordering::Relaxed),
        REFUSED.load(Ordering::Relaxed),
    )
}

/// Where placement puts descriptors under the given limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zone {
    /// At or above `from` (the soft limit), raising the soft limit to `raise` for the move.
    Above {
        /// The soft limit: the first number of the zone.
        from: u64,
        /// The soft limit during the move.
        raise: u64,
    },
    /// In `[from, to)`: the top eighth of a limit the process cannot raise.
    Inside {
        /// First number of the zone.
        from: u64,
        /// The soft limit (the zone's end).
        to: u64,
    },
}

/// The zone for a soft and hard limit (`None` for "infinity" is `u64::MAX`).
pub fn zone(soft: u64, hard: u64) -> Zone {
    if hard > soft {
        Zone::Above {
            from: soft,
            raise: hard.min(soft.saturating_add(ABOVE_SPAN)),
        }
    } else {
        Zone::Inside {
            from: soft - (soft / 8).max(1).min(soft),
            to: soft,
        }
    }
}

/// The process's current zone.
pub fn current() -> Zone {
    let l = getrlimit(Resource::Nofile);
    let soft = l.current.unwrap_or(u64::MAX);
    let hard = l.maximum.unwrap_or(u64::MAX);
    zone(soft, hard)
}

/// Moves `fd` into our zone (close-on-exec) and closes the original; `fd` itself when
/// placement is off. EMFILE when the zone has no free number (the caller falls back).
pub fn place(fd: OwnedFd) -> io::Result<OwnedFd> {
    if !enabled() {
        return Ok(fd);
    }
    let r = place_copy(fd.as_fd());
    // The original closes either way: on failure nothing of ours may stay in the
    // application's numbers.
    drop(fd);
    r
}

/// A close-on-exec duplicate of `fd` in our zone (the original stays open); a plain duplicate
/// when placement is off.
pub fn place_copy(fd: impl AsFd) -> io::Result<OwnedFd> {
    let fd = fd.as_fd();
    if !enabled() {
        return Ok(rustix::io::fcntl_dupfd_cloexec(fd, 0)?);
    }
    let r = match current() {
        Zone::Above { from, raise } => {
            let _g = RAISE.lock().unwrap_or_else(PoisonError::into_inner);
            let l = getrlimit(Resource::Nofile);
            let soft = l.current.unwrap_or(u64::MAX);
            if soft != from {
                // Changed since we looked: look again under the lock.
                drop(_g);
                return place_copy(fd);
            }
            let raised = Rlimit {
                current: Some(raise),
                maximum: l.maximum,
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => {
                    let r = rustix::io::fcntl_dupfd_cloexec(fd, from as i32);
                    // Put back what the application had, whatever the move did.
                    let _ = setrlimit(Resource::Nofile, l);
                    r.map_err(io::Error::from)
                }
                // Not allowed after all (a hard limit lowered meanwhile): inside the limit.
                Err(_) => inside(fd, zone(soft, soft)),
            }
        }
        z @ Zone::Inside { .. } => inside(fd, z),
    };
    match &r {
        Ok(_) => PLACED.fetch_add(1, Ordering::Relaxed),
        Err(_) => REFUSED.fetch_add(1, Ordering::Relaxed),
    };
    r
}

fn inside(fd: std::os::fd::BorrowedFd<'_>, z: Zone) -> io::Result<OwnedFd> {
    let Zone::Inside { from, to } = z else {
        unreachable!("inside() takes an inside zone")
    };
    let n = rustix::io::fcntl_dupfd_cloexec(fd, from.min(i32::MAX as u64) as i32).map_err(|e| {
        // EINVAL: `from` is at or above the limit (a limit lowered meanwhile).
        if e == rustix::io::Errno::INVAL {
            io::Error::from_raw_os_error(libc::EMFILE)
        } else {
            io::Error::from(e)
        }
    })?;
    use std::os::fd::AsRawFd;
    if n.as_raw_fd() as u64 >= to {
        // Cannot happen below the limit; kept as a guard for a limit raised meanwhile.
        return Err(io::Error::from_raw_os_error(libc::EMFILE));
    }
    Ok(n)
}

/// [`place`] for a raw descriptor just made (taken over: closed on failure).
///
/// # Safety
/// `fd` is an open descriptor that nothing else owns.
pub unsafe fn place_raw(fd: std::os::fd::RawFd) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: per the caller.
    place(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_follow_the_limits() {
        // Debian's default for services and logins: soft 1024, a high hard limit.
        assert_eq!(
            zone(1024, 524_288),
            Zone::Above {
                from: 1024,
                raise: 1024 + ABOVE_SPAN
            }
        );
        assert_eq!(
            zone(1024, 1030),
            Zone::Above {
                from: 1024,
                raise: 1030
            }
        );
        // `ulimit -n N` sets both: the top eighth.
        assert_eq!(
            zone(1024, 1024),
            Zone::Inside {
                from: 896,
                to: 1024
            }
        );
        assert_eq!(zone(256, 256), Zone::Inside { from: 224, to: 256 });
        assert_eq!(zone(8, 8), Zone::Inside { from: 7, to: 8 });
        assert_eq!(zone(1, 1), Zone::Inside { from: 0, to: 1 });
        assert_eq!(
            zone(1024, u64::MAX),
            Zone::Above {
                from: 1024,
                raise: 1024 + ABOVE_SPAN
            }
        );
    }
}
