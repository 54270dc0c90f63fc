//! Small system helpers shared by the drivers (a leaf: depends on nothing of ours).

/// The inode of the socket at `fd` (as `/proc/PID/fd/N` shows it: `socket:[inode]`), if `fd`
/// is a socket.
pub fn socket_inode(fd: std::os::fd::RawFd) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat struct; an invalid fd is an error, not UB.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some(st.st_ino)
}

/// What `/proc/PID/stat` says of a process that we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// The kernel's task flags (field 9; e.g. `PF_FORKNOEXEC`, 0x40: forked, not exec'd).
    pub flags: u64,
    /// When it started, in clock ticks after boot (field 22).
    pub start_ticks: u64,
}

/// Process `pid`'s [`ProcStat`]; `None` when it is gone or its stat cannot be read.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    // After it: state (3), ppid, pgrp, session, tty_nr, tpgid, flags (9), …, starttime (22).
    let f: Vec<&str> = s[s.rfind(')')? + 1..].split_whitespace().collect();
    Some(ProcStat {
        flags: f.get(6)?.parse().ok()?,
        start_ticks: f.get(19)?.parse().ok()?,
    })
}
