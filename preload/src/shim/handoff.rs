//! Our sockets going to a program image that cannot negotiate (an `exec` whose environment
//! drops the library, a spawned program without it): made plain TCP before they leave, so no
//! peer is told we speak SMC-R when the program that reads cannot ([`handing_off`]).

use std::ffi::OsString;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use super::runtime::{enabled, runtime};
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
    let rt = runtime();
    for (fd, s) in socks {
        match &*s {
            Sock::Listener(l) => {
                if l.handed_off.swap(true, Ordering::AcqRel) {
                    continue;
                }
                let r = rt.option_records().map(|m| m.quiet(borrowed(fd)));
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
}
