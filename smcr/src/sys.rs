//! Small system helpers shared by the drivers (a leaf: depends on nothing of ours).

/// The inode of the socket at `fd` (as `/proc/PID/fd/N` shows it: `socket:[inode]`), if `fd`
/// is a socket.
pub(crate) fn socket_inode(fd: std::os::fd::RawFd) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat struct; an invalid fd is an error, not UB.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some(st.st_ino)
}
