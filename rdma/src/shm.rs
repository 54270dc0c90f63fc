//! Building blocks of the same-host transport (issue 7): when both ends of a queue pair run on
//! one host, an RDMA WRITE can be a copy straight into the peer's memory region and a SEND an
//! entry in a ring both processes map, with no UDP, no ICRC and no kernel copy. Here:
//!
//! * [`Segment`]: memory backed by a memfd, mapped shared, whose descriptor can be handed to
//!   another process;
//! * [`send_fd`] / [`recv_fd`]: handing a descriptor over a Unix socket (SCM_RIGHTS);
//! * [`Ring`]: a single-producer single-consumer ring of messages in a segment, with a
//!   doorbell (futex) so that a consumer sleeps without spinning and a producer wakes it only
//!   when it sleeps.
//!
//! The peer process can write anything anywhere in a shared segment, so everything read from
//! one is untrusted: the ring checks its header, its cursors and every length, and reports a
//! [`RingError::Corrupt`] instead of trusting them; payloads are copied out before use. Data
//! is moved with raw-pointer copies and control words with atomics (the other process is
//! outside Rust's memory model either way).
//!
//! Not wired into the device yet: the queue pair's same-host path (memory regions allocated in
//! segments, exchanged by rkey; WRITE as a copy; SEND through a ring) is the next step.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Memory shared between processes: a memfd mapped read-write and shared.
#[derive(Debug)]
pub struct Segment {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is only accessed through raw-pointer copies and atomics; it stays valid
// until drop.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// A new zeroed segment of `len` bytes (rounded up to whole pages by the kernel).
    pub fn create(name: &str, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty segment"));
        }
        let fd = crate::fdzone::place(rustix::fs::memfd_create(
            name,
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // Its size is final: a peer that shrank it would make our next access a SIGBUS.
        rustix::fs::fcntl_add_seals(
            &fd,
            rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL,
        )?;
        Self::map(fd, len)
    }

    /// Maps a segment received from another process (its size is the file's).
    pub fn open(fd: OwnedFd) -> io::Result<Self> {
        let st = rustix::fs::fstat(&fd)?;
        // Only a segment whose size cannot change under us (see `create`).
        let sealed = rustix::fs::fcntl_get_seals(&fd)
            .is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK));
        if !sealed || st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size <= 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a memory segment",
            ));
        }
        Self::map(fd, st.st_size as usize)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a fresh shared mapping of the whole file; unmapped in drop.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a segment has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to hand to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The first byte of the mapping.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copies `data` in at `off`; `false` (nothing written) if it does not fit.
    pub fn write(&self, off: usize, data: &[u8]) -> bool {
        if off.checked_add(data.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds (checked); the source is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
        true
    }

    /// Copies out `out.len()` bytes at `off`; `false` if out of bounds.
    pub fn read(&self, off: usize, out: &mut [u8]) -> bool {
        if off.checked_add(out.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds (checked); the destination is ours.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
        true
    }

    /// Copies `n` bytes from `src` into the segment at `off`; `false` if out of bounds.
    ///
    /// # Safety
    /// `src` must be valid for reads of `n` bytes.
    pub(crate) unsafe fn copy_in_raw(&self, off: usize, src: *const u8, n: usize) -> bool {
        if off.checked_add(n).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds (checked); the caller vouches for `src`.
        unsafe { std::ptr::copy_nonoverlapping(src, self.ptr.add(off), n) };
        true
    }

    /// Copies `n` bytes at `off` out to `dst`; `false` if out of bounds.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `n` bytes.
    pub(crate) unsafe fn copy_out_raw(&self, off: usize, dst: *mut u8, n: usize) -> bool {
        if off.checked_add(n).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst, n) };
        true
    }

    /// Gives the pages of `[off, off + len)` back to the system; they read as zeroes after.
    pub(crate) fn punch(&self, off: usize, len: usize) {
        let _ = rustix::fs::fallocate(
            &self.fd,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            off as u64,
            len as u64,
        );
    }

    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "control word out of bounds"
        );
        // SAFETY: aligned (mappings are page-aligned, offsets multiples of 8) and in bounds.
        unsafe { &*self.ptr.add(off).cast::<AtomicU64>() }
    }

    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "control word out of bounds"
        );
        // SAFETY: as above.
        unsafe { &*self.ptr.add(off).cast::<AtomicU32>() }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// Sends `fd` with `data` (at least one byte) over a Unix stream or datagram socket.
pub fn send_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    send_fds(sock, &[fd], data)
}

/// Sends up to four descriptors with `data` (at least one byte) in one message.
pub fn send_fds(sock: BorrowedFd<'_>, fds: &[BorrowedFd<'_>], data: &[u8]) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::mem::MaybeUninit;
    if data.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a descriptor travels with at least one byte",
        ));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if fds.len() > 4 || !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("control buffer too small"));
    }
    let n = rustix::net::sendmsg(
        sock,
        &[io::IoSlice::new(data)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if n != data.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short send with a descriptor",
        ));
    }
    Ok(())
}

/// Receives bytes into `buf` and the descriptor sent with them, if any (a message carrying
/// more than one descriptor is refused: the extra ones are closed).
pub fn recv_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let (n, mut got) = recv_fds(sock, buf)?;
    if got.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more than one descriptor in a message",
        ));
    }
    Ok((n, got.pop()))
}

/// Receives bytes into `buf` and up to four descriptors sent with them (never blocks longer
/// than the socket does). A message whose descriptors were cut off (more than four) is an
/// error; the ones that did arrive are closed.
pub fn recv_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(
        sock,
        &mut [io::IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut got: Vec<OwnedFd> = Vec::new();
    let mut placed = Ok(());
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for fd in fds {
                // Out of the application's numbers too; one that cannot be placed fails the
                // message (the others close).
                match crate::fdzone::place(fd) {
                    Ok(fd) => got.push(fd),
                    Err(e) => placed = Err(e),
                }
            }
        }
    }
    placed?;
    if r.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "descriptors cut off (control data truncated)",
        ));
    }
    Ok((r.bytes, got))
}

/// What can go wrong with a [`Ring`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// No free slot (the consumer is behind).
    #[error("ring full")]
    Full,
    /// The message does not fit in a slot.
    #[error("message of {0} bytes does not fit a slot")]
    TooLong(usize),
    /// The shared memory does not hold a sane ring (the peer wrote garbage into it).
    #[error("corrupt ring: {0}")]
    Corrupt(&'static str),
}

/// `SMCRRNG2` (2: a 64-bit waiting word).
const RING_MAGIC: u64 = u64::from_le_bytes(*b"SMCRRNG2");
const R_MAGIC: usize = 0;
const R_SLOTS: usize = 8;
const R_SLOT_SIZE: usize = 16;
const R_TAIL: usize = 64; // producer's count, its own cache line
const R_HEAD: usize = 128; // consumer's count
const R_WAITING: usize = 192; // consumer asleep (u64: doorbell bits, publish count)
const R_DOORBELL: usize = 200; // futex word (u32)
const R_SLOTS_AT: usize = 256;
/// Each slot starts with the message length (u32).
const SLOT_HDR: usize = 4;

/// A single-producer single-consumer ring of messages in a [`Segment`] (one process pushes,
/// the other pops). A consumer with nothing to do sleeps on a futex in the segment; the
/// producer rings it only when the consumer said it sleeps.
pub struct Ring {
    seg: std::sync::Arc<Segment>,
    base: usize,
    slots: u64,
    slot_size: usize,
}

impl Ring {
    /// Bytes a ring of `slots` slots of `slot_size` bytes needs (`slot_size` includes a
    /// 4-byte length; both powers of two). Saturates for absurd sizes (which then do not fit).
    pub fn bytes(slots: usize, slot_size: usize) -> usize {
        slots.saturating_mul(slot_size).saturating_add(R_SLOTS_AT)
    }

    /// Lays out a new, empty ring at `base` in `seg`.
    pub fn create(
        seg: std::sync::Arc<Segment>,
        base: usize,
        slots: usize,
        slot_size: usize,
    ) -> Result<Self, RingError> {
        // The same limits `attach` checks, so a ring we make can be attached.
        if !slots.is_power_of_two()
            || !slot_size.is_power_of_two()
            || !(8..=1 << 20).contains(&slot_size)
            || slots > 1 << 24
        {
            return Err(RingError::Corrupt(
                "slot count and size must be powers of two",
            ));
        }
        if !base.is_multiple_of(64)
            || base
                .checked_add(Self::bytes(slots, slot_size))
                .is_none_or(|end| end > seg.len())
        {
            return Err(RingError::Corrupt("ring does not fit the segment"));
        }
        seg.u64_at(base + R_SLOTS)
            .store(slots as u64, Ordering::Relaxed);
        seg.u64_at(base + R_SLOT_SIZE)
            .store(slot_size as u64, Ordering::Relaxed);
        seg.u64_at(base + R_TAIL).store(0, Ordering::Relaxed);
        seg.u64_at(base + R_HEAD).store(0, Ordering::Relaxed);
        seg.u64_at(base + R_MAGIC)
            .store(RING_MAGIC, Ordering::Release);
        Self::attach(seg, base)
    }

    /// Attaches to a ring another process laid out at `base` (its header is checked).
    pub fn attach(seg: std::sync::Arc<Segment>, base: usize) -> Result<Self, RingError> {
        if !base.is_multiple_of(64) || base.checked_add(R_SLOTS_AT).is_none_or(|e| e > seg.len()) {
            return Err(RingError::Corrupt("ring header out of the segment"));
        }
        if seg.u64_at(base + R_MAGIC).load(Ordering::Acquire) != RING_MAGIC {
            return Err(RingError::Corrupt("no ring magic"));
        }
        let slots = seg.u64_at(base + R_SLOTS).load(Ordering::Relaxed);
        let slot_size = seg.u64_at(base + R_SLOT_SIZE).load(Ordering::Relaxed);
        if !slots.is_power_of_two()
            || !slot_size.is_power_of_two()
            || !(8..=1 << 20).contains(&slot_size)
            || slots > 1 << 24
        {
            return Err(RingError::Corrupt("bad slot count or size"));
        }
        let (slots_n, size) = (slots as usize, slot_size as usize);
        if base
            .checked_add(Self::bytes(slots_n, size))
            .is_none_or(|end| end > seg.len())
        {
            return Err(RingError::Corrupt("ring does not fit the segment"));
        }
        Ok(Self {
            seg,
            base,
            slots,
            slot_size: size,
        })
    }

    /// Largest message.
    pub fn max_message(&self) -> usize {
        self.slot_size - SLOT_HDR
    }

    fn tail(&self) -> &AtomicU64 {
        self.seg.u64_at(self.base + R_TAIL)
    }

    fn head(&self) -> &AtomicU64 {
        self.seg.u64_at(self.base + R_HEAD)
    }

    fn slot(&self, n: u64) -> usize {
        self.base + R_SLOTS_AT + (n & (self.slots - 1)) as usize * self.slot_size
    }

    /// Producer: appends `msg`, and rings the doorbell if the consumer sleeps.
    pub fn push(&self, msg: &[u8]) -> Result<(), RingError> {
        if self.push_quiet(msg)? {
            let bell = self.seg.u32_at(self.base + R_DOORBELL);
            bell.fetch_add(1, Ordering::Release);
            // Shared (not PRIVATE): the sleeper is another process.
            let _ = rustix::thread::futex::wake(bell, rustix::thread::futex::Flags::empty(), 1);
        }
        Ok(())
    }

    /// Producer: appends `msg` without ringing; returns whether the consumer said it sleeps
    /// (then the caller wakes it by its own means, e.g. an eventfd).
    pub fn push_quiet(&self, msg: &[u8]) -> Result<bool, RingError> {
        self.push_word(msg)
            .map(|w| crate::notify::waiting_bits(w) != 0)
    }

    /// Producer: like [`Ring::push_quiet`], but returns the consumer's whole waiting word (a
    /// consumer with several kinds of sleepers says which of them sleep, bit by bit; see
    /// [`Ring::set_waiting_word`]).
    pub fn push_word(&self, msg: &[u8]) -> Result<u64, RingError> {
        if msg.len() > self.max_message() {
            return Err(RingError::TooLong(msg.len()));
        }
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.slots {
            return Err(RingError::Corrupt("consumer cursor ahead of the producer"));
        }
        if used == self.slots {
            return Err(RingError::Full);
        }
        let at = self.slot(tail);
        self.seg.write(at, &(msg.len() as u32).to_le_bytes());
        self.seg.write(at + SLOT_HDR, msg);
        // Either the consumer (`wait`/`set_waiting`) sees the new tail, or we see its waiting
        // word: the doorbell handshake, model-checked in `crate::notify`.
        Ok(crate::notify::ring_published(
            self.tail(),
            tail.wrapping_add(1),
            self.seg.u64_at(self.base + R_WAITING),
        ))
    }

    /// Consumer: says whether it is about to sleep (producers then wake it). After setting
    /// it, check [`Ring::is_empty`] once more before sleeping.
    pub fn set_waiting(&self, on: bool) {
        self.set_waiting_word(u64::from(on));
    }

    /// Consumer: sets the waiting word (its low bits set: someone sleeps; producers read it
    /// back from [`Ring::push_word`]). Check [`Ring::is_empty`] afterwards, as for
    /// `set_waiting`.
    pub fn set_waiting_word(&self, word: u64) {
        crate::notify::ring_set_waiting(self.seg.u64_at(self.base + R_WAITING), word);
    }

    /// Consumer: copies the next message into `out` and returns its length, or `None` when
    /// the ring is empty. `out` must hold [`Ring::max_message`] bytes.
    pub fn pop(&self, out: &mut [u8]) -> Result<Option<usize>, RingError> {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used == 0 {
            return Ok(None);
        }
        if used > self.slots {
            return Err(RingError::Corrupt("producer cursor beyond the ring"));
        }
        let at = self.slot(head);
        let mut len = [0u8; SLOT_HDR];
        self.seg.read(at, &mut len);
        let len = u32::from_le_bytes(len) as usize;
        if len > self.max_message() {
            return Err(RingError::Corrupt("message length beyond its slot"));
        }
        if len > out.len() {
            return Err(RingError::TooLong(len));
        }
        self.seg.read(at + SLOT_HDR, &mut out[..len]);
        self.head().store(head.wrapping_add(1), Ordering::Release);
        Ok(Some(len))
    }

    /// Whether a message is waiting.
    pub fn is_empty(&self) -> bool {
        crate::notify::ring_is_empty(self.tail(), self.head())
    }

    /// Consumer: like [`Ring::wait`], but first polls for up to `spin` (a message that comes
    /// within it costs no sleep and no wake-up; on a machine with few cores the spinning takes
    /// CPU from the producer, so keep it short or zero).
    pub fn wait_spinning(&self, spin: Duration, timeout: Option<Duration>) -> io::Result<()> {
        if !spin.is_zero() {
            let until = Instant::now() + spin;
            let mut n = 0u32;
            while self.is_empty() {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n.is_multiple_of(64) && Instant::now() >= until {
                    break;
                }
            }
            if !self.is_empty() {
                return Ok(());
            }
        }
        self.wait(timeout)
    }

    /// Consumer: sleeps until a message is pushed or `timeout` passes (spurious returns are
    /// possible: pop again).
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        let waiting = self.seg.u64_at(self.base + R_WAITING);
        let bell = self.seg.u32_at(self.base + R_DOORBELL);
        let seen = bell.load(Ordering::Acquire);
        crate::notify::ring_set_waiting(waiting, 1);
        if !self.is_empty() {
            waiting.store(0, Ordering::Relaxed);
            return Ok(());
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let ts = deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            rustix::thread::futex::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            }
        });
        let r = rustix::thread::futex::wait(
            bell,
            rustix::thread::futex::Flags::empty(),
            seen,
            ts.as_ref(),
        );
        waiting.store(0, Ordering::Relaxed);
        match r {
            Ok(()) => Ok(()),
            // The bell rang before we slept, the time is up, or a signal came: the caller
            // pops and decides.
            Err(e)
                if e == rustix::io::Errno::AGAIN
                    || e == rustix::io::Errno::TIMEDOUT
                    || e == rustix::io::Errno::INTR =>
            {
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests;
