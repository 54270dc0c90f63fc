//! Probe for issue 27 (an AF_XDP transport for the rdma engine): the XDP program that steers
//! RoCE v2 (UDP 4791) to AF_XDP sockets and passes everything else to the kernel, and a minimal
//! AF_XDP socket (UMEM, fill/completion/RX/TX rings) over libc. Used by `bench xdp` to measure;
//! not used by the engine.
//!
//! Constants are the UAPI ones (`linux/if_xdp.h`, `linux/bpf.h`, `linux/if_link.h`), checked
//! against Debian 12's headers.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

use super::asm::{Asm, Insn, R0, R1, R2, R3, R4, R5, R6};
use super::sys;

/// RoCE v2's UDP destination port.
pub const ROCE_PORT: u16 = 4791;

/// XDP return codes (`enum xdp_action`).
pub const XDP_ABORTED: u32 = 0;
/// Drop the frame.
pub const XDP_DROP: u32 = 1;
/// Hand the frame to the kernel's stack.
pub const XDP_PASS: u32 = 2;
/// Sent elsewhere (here: to the AF_XDP socket of the map).
pub const XDP_REDIRECT: u32 = 4;

/// `XDP_FLAGS_SKB_MODE`: generic XDP (runs on the skb, after it is built).
pub const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
/// `XDP_FLAGS_DRV_MODE`: native XDP (the driver runs it; veth does).
pub const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// `sockaddr_xdp.sxdp_flags`: force copy mode.
pub const XDP_COPY: u16 = 1 << 1;
/// Force zero-copy mode (refused when the driver has no AF_XDP zero-copy support).
pub const XDP_ZEROCOPY: u16 = 1 << 2;
/// Multi-buffer: a frame larger than a UMEM chunk spans several descriptors, all but the last
/// marked [`XDP_PKT_CONTD`] (Linux 6.6+; newer than Debian 12's header).
pub const XDP_USE_SG: u16 = 1 << 4;
/// `xdp_desc.options`: the packet continues in the next descriptor.
pub const XDP_PKT_CONTD: u32 = 1;

const AF_XDP: i32 = 44;
const SOL_XDP: i32 = 283;
const XDP_MMAP_OFFSETS: i32 = 1;
const XDP_RX_RING: i32 = 2;
const XDP_TX_RING: i32 = 3;
const XDP_UMEM_REG: i32 = 4;
const XDP_UMEM_FILL_RING: i32 = 5;
const XDP_UMEM_COMPLETION_RING: i32 = 6;
const XDP_STATISTICS: i32 = 7;
const XDP_OPTIONS: i32 = 8;
const XDP_OPTIONS_ZEROCOPY: u32 = 1;
const XDP_PGOFF_RX_RING: i64 = 0;
const XDP_PGOFF_TX_RING: i64 = 0x8000_0000;
const XDP_UMEM_PGOFF_FILL_RING: i64 = 0x1_0000_0000;
const XDP_UMEM_PGOFF_COMPLETION_RING: i64 = 0x1_8000_0000;

const HELPER_REDIRECT_MAP: i32 = 51;
// `struct xdp_md` offsets.
const MD_DATA: i16 = 0;
const MD_DATA_END: i16 = 4;
const MD_RX_QUEUE_INDEX: i16 = 16;

/// Ethernet + IPv4 (no options) + UDP.
pub const HEADERS: usize = 14 + 20 + 8;

/// The XDP program, with the XSKMAP `xskmap_fd` built in: an IPv4 (no IP options, not a
/// fragment) UDP datagram to port 4791 goes to `bpf_redirect_map(xskmap, rx_queue_index,
/// XDP_PASS)` — the socket of the receive queue, or the stack when that queue has none;
/// everything else `XDP_PASS`. RoCE v2 never carries IP options, so a 20-byte IP header is
/// all it has to parse.
pub(crate) fn program(xskmap_fd: i32) -> Vec<Insn> {
    let mut a = Asm::default();
    // The verifier wants every packet read proven below data_end: one check covers all 42
    // header bytes.
    a.mov(R6, R1)
        .ldx_w(R2, R6, MD_DATA)
        .ldx_w(R3, R6, MD_DATA_END)
        .mov(R4, R2)
        .add_imm(R4, HEADERS as i32)
        .jgt(R4, R3, "pass")
        // Loads are little-endian: network-order constants appear byte-swapped.
        .ldx_h(R5, R2, 12)
        .jne_imm(R5, 0x0008, "pass") // EtherType 0x0800
        .ldx_b(R5, R2, 14)
        .jne_imm(R5, 0x45, "pass") // version 4, IHL 5
        .ldx_b(R5, R2, 23)
        .jne_imm(R5, 17, "pass") // UDP
        .ldx_h(R5, R2, 20)
        .and_imm(R5, 0xff3f) // MF and fragment offset (0x3fff in network order)
        .jne_imm(R5, 0, "pass")
        .ldx_h(R5, R2, 36)
        .jne_imm(R5, i32::from(ROCE_PORT.swap_bytes()), "pass")
        .ld_map_fd(R1, xskmap_fd)
        .ldx_w(R2, R6, MD_RX_QUEUE_INDEX)
        .mov_imm(R3, XDP_PASS as i32)
        .call(HELPER_REDIRECT_MAP)
        .exit()
        .label("pass")
        .mov_imm(R0, XDP_PASS as i32)
        .exit();
    a.finish().expect("the XDP program's labels are consistent")
}

/// The loaded program and its XSKMAP (queue index → AF_XDP socket).
pub struct Steering {
    /// The XSKMAP.
    pub map: OwnedFd,
    /// The XDP program.
    pub prog: OwnedFd,
}

impl Steering {
    /// Creates the map (`queues` entries) and loads the program; a verifier rejection carries
    /// the kernel's log. `frags`: load it as multi-buffer aware (`BPF_F_XDP_HAS_FRAGS`), which
    /// native XDP on veth requires above an MTU of about a page.
    pub fn load(queues: u32, frags: bool) -> io::Result<Self> {
        let map = sys::map_create(sys::BPF_MAP_TYPE_XSKMAP, "smcr_xsk", 4, 4, queues)?;
        let prog = sys::prog_load_flags(
            sys::BPF_PROG_TYPE_XDP,
            "smcr_xdp_roce",
            &program(map.as_raw_fd()),
            "GPL",
            if frags { sys::BPF_F_XDP_HAS_FRAGS } else { 0 },
        )?;
        Ok(Self { map, prog })
    }

    /// Puts `xsk` in the map for receive queue `queue`.
    pub fn insert(&self, queue: u32, xsk: &Xsk) -> io::Result<()> {
        let fd = xsk.fd.as_raw_fd() as u32;
        sys::map_update(
            self.map.as_raw_fd(),
            &queue.to_ne_bytes(),
            &fd.to_ne_bytes(),
        )
    }

    /// Attaches the program to `ifindex` of the caller's network namespace with a bpf link
    /// (`XDP_FLAGS_DRV_MODE` or `XDP_FLAGS_SKB_MODE`); detached when the link is dropped.
    pub fn attach(&self, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
        sys::link_create_xdp(self.prog.as_raw_fd(), ifindex, flags)
    }

    /// Runs the program on `frame` (`BPF_PROG_TEST_RUN`, receive queue 0): its verdict.
    #[cfg(test)]
    fn test_run(&self, frame: &[u8]) -> io::Result<u32> {
        sys::prog_test_run(self.prog.as_raw_fd(), frame, 1).map(|(ret, _, _)| ret)
    }
}

/// A loaded program that passes everything: the peer of a native-XDP veth needs one for
/// `ndo_xdp_xmit` (frames redirected *into* the veth), not for what the probe does — kept
/// to measure that case too.
pub fn pass_program() -> io::Result<OwnedFd> {
    let mut a = Asm::default();
    a.mov_imm(R0, XDP_PASS as i32).exit();
    let insns = a.finish().expect("no labels");
    sys::prog_load(sys::BPF_PROG_TYPE_XDP, "smcr_xdp_pass", &insns, "GPL")
}

/// `struct xdp_desc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Desc {
    addr: u64,
    len: u32,
    options: u32,
}

/// One mmapped ring: a producer and a consumer index shared with the kernel, and `size`
/// entries of `T`. Indexes run freely (u32 wrap-around); `mask` picks the slot.
struct Ring<T> {
    map: *mut libc::c_void,
    map_len: usize,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    descs: *mut T,
    mask: u32,
    size: u32,
}

// SAFETY: the ring is owned by one Xsk; the pointers are into its private mapping.
unsafe impl<T> Send for Ring<T> {}

/// `struct xdp_ring_offset`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct RingOffset {
    producer: u64,
    consumer: u64,
    desc: u64,
    flags: u64,
}

/// `struct xdp_mmap_offsets`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct MmapOffsets {
    rx: RingOffset,
    tx: RingOffset,
    fr: RingOffset,
    cr: RingOffset,
}

impl<T> Ring<T> {
    fn map(fd: RawFd, off: &RingOffset, size: u32, pgoff: i64) -> io::Result<Self> {
        let map_len = off.desc as usize + size as usize * size_of::<T>();
        // SAFETY: a shared mapping of the ring the kernel made for this socket; its layout
        // comes from XDP_MMAP_OFFSETS.
        let map = unsafe {
            libc::mmap(
                ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let at = |o: u64| map.cast::<u8>().wrapping_add(o as usize);
        Ok(Self {
            map,
            map_len,
            producer: at(off.producer).cast(),
            consumer: at(off.consumer).cast(),
            descs: at(off.desc).cast(),
            mask: size - 1,
            size,
        })
    }
    fn prod(&self) -> &AtomicU32 {
        // SAFETY: points into the live mapping, 4-byte aligned (kernel layout).
        unsafe { &*self.producer }
    }
    fn cons(&self) -> &AtomicU32 {
        // SAFETY: as prod().
        unsafe { &*self.consumer }
    }
    /// Producer side (fill, TX): free slots.
    fn free(&self) -> u32 {
        let p = self.prod().load(Ordering::Relaxed);
        self.size - p.wrapping_sub(self.cons().load(Ordering::Acquire))
    }
    /// Producer side: writes `v` at `producer + i` (published by `submit`).
    fn put(&mut self, i: u32, v: T) {
        let at = self.prod().load(Ordering::Relaxed).wrapping_add(i) & self.mask;
        // SAFETY: at < size: inside the descriptor array.
        unsafe { self.descs.add(at as usize).write(v) }
    }
    fn submit(&mut self, n: u32) {
        let p = self.prod().load(Ordering::Relaxed);
        self.prod().store(p.wrapping_add(n), Ordering::Release);
    }
    /// Consumer side (RX, completion): entries ready.
    fn ready(&self) -> u32 {
        let c = self.cons().load(Ordering::Relaxed);
        self.prod().load(Ordering::Acquire).wrapping_sub(c)
    }
    /// Consumer side: the entry at `consumer + i` (released by `release`).
    fn get(&self, i: u32) -> T {
        let at = self.cons().load(Ordering::Relaxed).wrapping_add(i) & self.mask;
        // SAFETY: at < size; the kernel published it (Acquire in ready()).
        unsafe { self.descs.add(at as usize).read() }
    }
    fn release(&mut self, n: u32) {
        let c = self.cons().load(Ordering::Relaxed);
        self.cons().store(c.wrapping_add(n), Ordering::Release);
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// How an AF_XDP socket was bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Frames copied between the driver's buffers and the UMEM.
    Copy,
    /// The driver works in the UMEM itself.
    ZeroCopy,
}

/// `struct xdp_statistics` (the counters the probe prints).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    /// Dropped for other reasons.
    pub rx_dropped: u64,
    /// Bad descriptors on the fill ring.
    pub rx_invalid_descs: u64,
    /// Bad descriptors on the TX ring.
    pub tx_invalid_descs: u64,
    /// RX ring full.
    pub rx_ring_full: u64,
    /// Fill ring empty when a frame arrived.
    pub rx_fill_ring_empty_descs: u64,
    /// TX ring empty on a kick.
    pub tx_ring_empty_descs: u64,
}

/// An AF_XDP socket on one queue of one interface with its own UMEM. The UMEM's frames are
/// split in two: the first half circulates between the fill and RX rings, the second half
/// between TX and completion (a free list in between).
pub struct Xsk {
    fd: OwnedFd,
    umem: *mut u8,
    umem_len: usize,
    frame: u32,
    rx: Ring<Desc>,
    tx: Ring<Desc>,
    fill: Ring<u64>,
    comp: Ring<u64>,
    free_tx: Vec<u64>,
    /// The mode the kernel chose.
    pub mode: Mode,
}

// SAFETY: the UMEM and rings are private to this value; it moves between threads whole.
unsafe impl Send for Xsk {}

fn setsockopt<T>(fd: RawFd, opt: i32, v: &T) -> io::Result<()> {
    // SAFETY: v is a valid T for the size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            SOL_XDP,
            opt,
            (v as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn getsockopt<T: Default>(fd: RawFd, opt: i32) -> io::Result<T> {
    let mut v = T::default();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: v is writable for len bytes.
    let r = unsafe { libc::getsockopt(fd, SOL_XDP, opt, (&mut v as *mut T).cast(), &mut len) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(v)
    }
}

impl Xsk {
    /// Ring sizes (entries; powers of two).
    const RING: u32 = 1024;

    /// Opens a socket bound to `queue` of `ifindex` (caller's namespace) with `bind_flags`
    /// (`XDP_COPY`, `XDP_ZEROCOPY` or 0 = zero-copy if the driver can, else copy), a UMEM of
    /// `2 * RING` frames of `frame` bytes (2048 or 4096), and the fill ring full.
    pub fn open(ifindex: u32, queue: u32, bind_flags: u16, frame: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor we own.
        let fd: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) };
        let nframes = 2 * Self::RING;
        let umem_len = nframes as usize * frame as usize;
        // SAFETY: a fresh private anonymous mapping.
        let umem = unsafe {
            libc::mmap(
                ptr::null_mut(),
                umem_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if umem == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // From here the mapping is released by Drop, so build the value early; rings come
        // after registration (the kernel sizes them on setsockopt).
        #[repr(C)]
        #[derive(Default)]
        struct UmemReg {
            addr: u64,
            len: u64,
            chunk_size: u32,
            headroom: u32,
            flags: u32,
            tx_metadata_len: u32,
        }
        let reg = UmemReg {
            addr: umem as u64,
            len: umem_len as u64,
            chunk_size: frame,
            ..Default::default()
        };
        let unmap = |e: io::Error| {
            // SAFETY: the mapping made above, not yet owned by anything.
            unsafe { libc::munmap(umem, umem_len) };
            e
        };
        let raw = fd.as_raw_fd();
        // Debian 12's struct is 28 bytes padded to 32 (the last field is zero = none).
        setsockopt(raw, XDP_UMEM_REG, &reg).map_err(unmap)?;
        for opt in [
            XDP_UMEM_FILL_RING,
            XDP_UMEM_COMPLETION_RING,
            XDP_RX_RING,
            XDP_TX_RING,
        ] {
            setsockopt(raw, opt, &Self::RING).map_err(unmap)?;
        }
        let off: MmapOffsets = getsockopt(raw, XDP_MMAP_OFFSETS).map_err(unmap)?;
        let rings = (|| -> io::Result<_> {
            Ok((
                Ring::<Desc>::map(raw, &off.rx, Self::RING, XDP_PGOFF_RX_RING)?,
                Ring::<Desc>::map(raw, &off.tx, Self::RING, XDP_PGOFF_TX_RING)?,
                Ring::<u64>::map(raw, &off.fr, Self::RING, XDP_UMEM_PGOFF_FILL_RING)?,
                Ring::<u64>::map(raw, &off.cr, Self::RING, XDP_UMEM_PGOFF_COMPLETION_RING)?,
            ))
        })()
        .map_err(unmap)?;
        let (rx, tx, fill, comp) = rings;
        let mut x = Self {
            fd,
            umem: umem.cast(),
            umem_len,
            frame,
            rx,
            tx,
            fill,
            comp,
            free_tx: (Self::RING..nframes)
                .map(|i| u64::from(i) * u64::from(frame))
                .collect(),
            mode: Mode::Copy,
        };
        // Give the kernel the RX half before binding: frames can arrive at once.
        for i in 0..Self::RING {
            x.fill.put(i, u64::from(i) * u64::from(frame));
        }
        x.fill.submit(Self::RING);
        #[repr(C)]
        struct SockaddrXdp {
            family: u16,
            flags: u16,
            ifindex: u32,
            queue_id: u32,
            shared_umem_fd: u32,
        }
        let sa = SockaddrXdp {
            family: AF_XDP as u16,
            flags: bind_flags,
            ifindex,
            queue_id: queue,
            shared_umem_fd: 0,
        };
        // A socket closed just before on the same queue lets go of it from a work queue
        // (EBUSY until then): retry for up to a second.
        for tries in 0.. {
            // SAFETY: sa is a valid sockaddr_xdp.
            let r = unsafe {
                libc::bind(
                    raw,
                    (&sa as *const SockaddrXdp).cast(),
                    size_of::<SockaddrXdp>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) || tries == 100 {
                return Err(e);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let opts: u32 = getsockopt(raw, XDP_OPTIONS)?;
        x.mode = if opts & XDP_OPTIONS_ZEROCOPY != 0 {
            Mode::ZeroCopy
        } else {
            Mode::Copy
        };
        Ok(x)
    }

    /// The socket's descriptor (for poll).
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The kernel's drop counters.
    pub fn stats(&self) -> io::Result<Stats> {
        #[derive(Default)]
        #[repr(C)]
        struct S([u64; 6]);
        let s: S = getsockopt(self.fd.as_raw_fd(), XDP_STATISTICS)?;
        Ok(Stats {
            rx_dropped: s.0[0],
            rx_invalid_descs: s.0[1],
            tx_invalid_descs: s.0[2],
            rx_ring_full: s.0[3],
            rx_fill_ring_empty_descs: s.0[4],
            tx_ring_empty_descs: s.0[5],
        })
    }

    fn frame_mut(&mut self, addr: u64, len: usize) -> &mut [u8] {
        assert!(addr as usize + len <= self.umem_len);
        // SAFETY: inside the UMEM (checked); a TX frame is ours until its completion.
        unsafe { std::slice::from_raw_parts_mut(self.umem.add(addr as usize), len) }
    }

    /// Moves completed TX frames back to the free list.
    fn reclaim(&mut self) {
        let n = self.comp.ready();
        for i in 0..n {
            let a = self.comp.get(i);
            self.free_tx.push(a);
        }
        self.comp.release(n);
    }

    /// Queues up to `n` frames on the TX ring, each written by `fill(i, buf)` into its first
    /// UMEM chunk `buf`, which returns the frame's length. A length beyond a chunk (a socket
    /// bound with [`XDP_USE_SG`]) takes further chunks, left as they are (the probe's payload
    /// bytes do not matter). Returns how many frames were queued (limited by free chunks and
    /// ring space); nothing is sent before [`Self::kick`].
    pub fn queue_tx(&mut self, n: u32, mut fill: impl FnMut(u32, &mut [u8]) -> usize) -> u32 {
        self.reclaim();
        let frame = self.frame as usize;
        let mut slots = self.tx.free();
        let mut used = 0;
        let mut queued = 0;
        while queued < n && slots > 0 {
            let Some(addr) = self.free_tx.pop() else {
                break;
            };
            let len = fill(queued, self.frame_mut(addr, frame));
            let chunks = len.div_ceil(frame).max(1) as u32;
            if chunks > slots || chunks as usize - 1 > self.free_tx.len() {
                self.free_tx.push(addr);
                break;
            }
            let mut rest = len;
            let mut at = addr;
            for c in 0..chunks {
                let this = rest.min(frame);
                rest -= this;
                let more = c + 1 < chunks;
                let options = if more { XDP_PKT_CONTD } else { 0 };
                self.tx.put(
                    used,
                    Desc {
                        addr: at,
                        len: this as u32,
                        options,
                    },
                );
                used += 1;
                if more {
                    at = self.free_tx.pop().expect("counted above");
                }
            }
            slots -= chunks;
            queued += 1;
        }
        self.tx.submit(used);
        queued
    }

    /// Makes the kernel transmit what the TX ring holds: in copy mode it only does so inside
    /// a send call (`xsk_generic_xmit`, a bounded batch per call), so call until drained.
    pub fn kick(&mut self) -> io::Result<()> {
        while self.tx.ready_for_kernel() > 0 {
            // SAFETY: sendto with no data: the AF_XDP "transmit the TX ring" call.
            let r = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    ptr::null(),
                    0,
                    libc::MSG_DONTWAIT,
                    ptr::null(),
                    0,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // Busy device or full completion ring: make room, then retry.
                    Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS) => self.reclaim(),
                    _ => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Calls `f` with each received buffer (a frame from its Ethernet header on; with
    /// [`XDP_USE_SG`] a frame may take several, and `f`'s flag says whether this is the last
    /// of its frame), then hands the chunks back to the fill ring; returns how many buffers
    /// there were. Does not wait.
    pub fn recv(&mut self, max: u32, mut f: impl FnMut(&[u8], bool)) -> u32 {
        let n = self.rx.ready().min(max);
        if n == 0 {
            return 0;
        }
        let mask = !(u64::from(self.frame) - 1);
        for i in 0..n {
            let d = self.rx.get(i);
            assert!(d.addr as usize + d.len as usize <= self.umem_len);
            // SAFETY: the kernel gave us this frame (inside the UMEM, checked) until we put
            // it back on the fill ring below.
            let buf = unsafe {
                std::slice::from_raw_parts(self.umem.add(d.addr as usize), d.len as usize)
            };
            f(buf, d.options & XDP_PKT_CONTD == 0);
            // The fill ring has room: every RX frame came from it.
            self.fill.put(i, d.addr & mask);
        }
        self.rx.release(n);
        self.fill.submit(n);
        n
    }

    /// Sleeps in poll() until a frame is on the RX ring or `timeout_ms` passes.
    pub fn wait_rx(&self, timeout_ms: i32) -> io::Result<bool> {
        if self.rx.ready() > 0 {
            return Ok(true);
        }
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(self.rx.ready() > 0)
    }
}

impl Ring<Desc> {
    /// TX: descriptors published but not yet consumed by the kernel.
    fn ready_for_kernel(&self) -> u32 {
        self.prod()
            .load(Ordering::Relaxed)
            .wrapping_sub(self.cons().load(Ordering::Acquire))
    }
}

impl Drop for Xsk {
    fn drop(&mut self) {
        // The rings unmap themselves; the socket closes after this (field order is not
        // relied on: the kernel holds its own UMEM page references until the socket is gone).
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.umem.cast(), self.umem_len) };
    }
}

/// The addresses of one end, for building frames.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint {
    /// MAC address.
    pub mac: [u8; 6],
    /// IPv4 address.
    pub ip: [u8; 4],
    /// UDP port.
    pub port: u16,
}

/// Writes Ethernet + IPv4 + UDP headers for a `payload`-byte datagram from `src` to `dst`
/// into `buf[..HEADERS]`; returns the frame length. UDP checksum 0 (allowed for IPv4).
pub fn write_headers(buf: &mut [u8], src: &Endpoint, dst: &Endpoint, payload: usize) -> usize {
    let total = HEADERS + payload;
    buf[0..6].copy_from_slice(&dst.mac);
    buf[6..12].copy_from_slice(&src.mac);
    buf[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = &mut buf[14..34];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&((20 + 8 + payload) as u16).to_be_bytes());
    ip[4..6].copy_from_slice(&[0, 0]);
    ip[6..8].copy_from_slice(&[0x40, 0x00]); // DF
    ip[8] = 64;
    ip[9] = 17;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.ip);
    ip[16..20].copy_from_slice(&dst.ip);
    let sum = ip_checksum(ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let udp = &mut buf[34..42];
    udp[0..2].copy_from_slice(&src.port.to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
    total
}

/// The Internet checksum of an IPv4 header (its checksum field zero).
pub fn ip_checksum(h: &[u8]) -> u16 {
    let mut s: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        if rustix::process::geteuid().is_root() {
            return true;
        }
        eprintln!("SKIP: loading the XDP program needs root");
        false
    }

    fn udp_frame(dport: u16) -> Vec<u8> {
        let a = Endpoint {
            mac: [2, 0, 0, 0, 0, 1],
            ip: [10, 0, 0, 1],
            port: 50000,
        };
        let b = Endpoint {
            mac: [2, 0, 0, 0, 0, 2],
            ip: [10, 0, 0, 2],
            port: dport,
        };
        let mut f = vec![0u8; HEADERS + 100];
        write_headers(&mut f, &a, &b, 100);
        f
    }

    #[test]
    fn headers_have_a_valid_ip_checksum() {
        let f = udp_frame(ROCE_PORT);
        assert_eq!(ip_checksum(&f[14..34]), 0);
        assert_eq!(&f[36..38], &ROCE_PORT.to_be_bytes());
    }

    /// The kernel's verdicts (`BPF_PROG_TEST_RUN` on queue 0): RoCE goes to the socket of
    /// queue 0 when there is one (`XDP_REDIRECT`), to the stack when there is none (the
    /// `XDP_PASS` fallback of `bpf_redirect_map`); other UDP, fragments, ARP, IP options and
    /// runt frames always pass.
    #[test]
    fn roce_is_redirected_and_the_rest_passes() {
        if !root() {
            return;
        }
        let s = Steering::load(4, false).unwrap();
        let roce = udp_frame(ROCE_PORT);
        let other = udp_frame(4792);
        let mut frag = roce.clone();
        frag[14 + 6] = 0x20; // MF
        let mut options = roce.clone();
        options[14] = 0x46;
        let mut arp = roce.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        // Test runs need a frame of at least an Ethernet header.
        let runt = roce[..40].to_vec();
        let all_pass = |s: &Steering| {
            for (what, f) in [
                ("udp 4792", &other),
                ("fragment", &frag),
                ("ip options", &options),
                ("arp", &arp),
                ("runt", &runt),
            ] {
                assert_eq!(s.test_run(f).unwrap(), XDP_PASS, "{what}");
            }
        };
        assert_eq!(s.test_run(&roce).unwrap(), XDP_PASS, "no socket: pass");
        all_pass(&s);
        // An AF_XDP socket bound to loopback (copy mode works on any device) in the map.
        let x = match Xsk::open(1, 0, XDP_COPY, 2048) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("SKIP (redirect half): AF_XDP socket on lo: {e}");
                return;
            }
        };
        s.insert(0, &x).unwrap();
        assert_eq!(s.test_run(&roce).unwrap(), XDP_REDIRECT, "socket: redirect");
        all_pass(&s);
    }
}
