//! The epoll registrations applications make for our descriptors. epoll watches open files, not
//! descriptor numbers, so when we put another file at an application's number (a pair in place
//! of a TCP socket, or the TCP socket back after a fallback) the registrations are moved: taken
//! off the old file, put on the new one with the application's events and data.
//!
//! One lock orders file swaps against the application's `epoll_ctl` on managed descriptors: an
//! `epoll_ctl` racing a swap either lands before it (and is moved) or after it (on the new
//! file), never on the old file unrecorded. Registrations are kept only while the number is
//! ours: a number handed back as plain TCP, or closed, has none left to be replayed later onto
//! an unrelated socket that reuses the number.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::{real, table};

type Regs = Vec<(i32, libc::epoll_event)>;

static REGS: Mutex<BTreeMap<i32, Regs>> = Mutex::new(BTreeMap::new());

/// The application's `epoll_ctl` (not bypassed).
pub(crate) fn ctl(epfd: i32, op: i32, fd: i32, ev: *mut libc::epoll_event) -> i32 {
    if table::get(fd).is_none() {
        // SAFETY: forwarding the application's arguments.
        return unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    }
    let mut m = REGS.lock();
    // SAFETY: as above.
    let r = unsafe { real::epoll_ctl()(epfd, op, fd, ev) };
    // Still ours once the lock is held: no swap can move the file before this is recorded.
    if r == 0 && table::get(fd).is_some() {
        let regs = m.entry(fd).or_default();
        regs.retain(|(e, _)| *e != epfd);
        if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
            // SAFETY: for ADD and MOD the application passes a valid event.
            regs.push((epfd, unsafe { *ev }));
        }
    }
    r
}

/// The application is closing `fd` (still open): with `unregister`, its registrations are
/// taken off the file first (see the close hook); either way they are forgotten.
pub(crate) fn closed(fd: i32, unregister: bool) {
    let mut m = REGS.lock();
    if let Some(regs) = m.remove(&fd)
        && unregister
    {
        for (ep, _) in regs {
            // SAFETY: removing a registration the application made on this number.
            unsafe { real::epoll_ctl()(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
        }
    }
}

/// `fd` is a new file or no longer ours: nothing recorded for it applies any more.
pub(crate) fn forget(fd: i32) {
    let mut m = REGS.lock();
    if !m.is_empty() {
        m.remove(&fd);
    }
}

/// Puts `file` at the application's number `fd` (dup3 with `flags`), moving the registrations
/// made for `fd` to it, then runs `then` (the table update) before any `epoll_ctl` on `fd` can
/// run; if `fd` is no longer ours afterwards, its registrations are dropped.
pub(crate) fn swap(fd: i32, file: i32, flags: i32, then: impl FnOnce()) -> std::io::Result<()> {
    let mut m = REGS.lock();
    let regs = m.get(&fd).cloned().unwrap_or_default();
    for (ep, _) in &regs {
        // SAFETY: removing a registration the application made.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    // SAFETY: putting a descriptor we own at the application's number.
    let r = unsafe { real::dup3()(file, fd, flags) };
    let err = std::io::Error::last_os_error();
    for (ep, ev) in &regs {
        let mut ev = *ev;
        // SAFETY: re-adding the application's registration with its events and data.
        unsafe { real::epoll_ctl()(*ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    }
    then();
    if table::get(fd).is_none() {
        m.remove(&fd);
    }
    if r < 0 { Err(err) } else { Ok(()) }
}
