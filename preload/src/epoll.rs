//! The epoll registrations applications make for our descriptors. epoll watches open files, not
//! descriptor numbers, so when we put another file at an application's number (a pair in place
//! of a TCP socket, or the TCP socket back after a fallback) the registrations are moved: taken
//! off the old file, put on the new one with the application's events and data.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::real;

type Regs = Vec<(i32, libc::epoll_event)>;

static REGS: Mutex<BTreeMap<i32, Regs>> = Mutex::new(BTreeMap::new());

/// Records an `epoll_ctl` the application made on one of our descriptors.
pub(crate) fn record(epfd: i32, op: i32, fd: i32, ev: *const libc::epoll_event) {
    let mut m = REGS.lock();
    let regs = m.entry(fd).or_default();
    regs.retain(|(e, _)| *e != epfd);
    if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
        // SAFETY: for ADD and MOD the application passes a valid event.
        regs.push((epfd, unsafe { *ev }));
    }
}

/// The application closed `fd` (the registrations went with the file).
pub(crate) fn forget(fd: i32) {
    REGS.lock().remove(&fd);
}

/// Takes `fd`'s registrations off the file currently at `fd`; returns them for [`attach`].
pub(crate) fn detach(fd: i32) -> Regs {
    let regs = REGS.lock().get(&fd).cloned().unwrap_or_default();
    for (ep, _) in &regs {
        // SAFETY: removing a registration the application made.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    regs
}

/// Puts registrations back, now on the file at `fd`.
pub(crate) fn attach(fd: i32, regs: &Regs) {
    for (ep, ev) in regs {
        let mut ev = *ev;
        // SAFETY: re-adding the application's registration with its events and data.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
}
