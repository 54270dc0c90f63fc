//! The transmit path: a QP's packets built into scratch buffers, their ICRCs computed per
//! segment, and sent in GSO batches (or through the test middleware: capture, fault
//! injection).

use super::counters::bump;
use super::engine::FAULT_TIMER;
use super::{QpCore, Shared};
use crate::transport::fault::FaultInjector;
use crate::transport::udp::{MAX_DATAGRAM, MAX_GSO_SEGMENTS, UdpSocket};
use crate::wire::{self, BUNDLE_HEADER_LEN, BUNDLE_PREFIX_LEN, IcrcHeaders};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Instant;

/// Room after each packet's head in the scratch buffer for pad bytes and the ICRC.
const TRAILER: usize = 8;

/// The largest bundle: a standard Ethernet frame's UDP payload at most (a route with jumbo
/// frames gains little more from bundling, and its packets go in GSO batches anyway).
const MAX_BUNDLE: usize = 1472;

/// Room before each packet's head, to the peer that takes bundles: a bundle's header and the
/// packet's length.
const BUNDLE_ROOM: usize = BUNDLE_HEADER_LEN + BUNDLE_PREFIX_LEN;

struct Pending {
    head: usize,
    parts: crate::rc::TxParts,
}

/// Scratch space for one transmit pass: packet heads and trailers, the iovecs of its
/// batches, and the batches sealed but not sent yet.
pub(super) struct TxScratch {
    buf: Box<[u8]>,
    used: usize,
    bytes: usize,
    pkts: Vec<Pending>,
    iov: Vec<libc::iovec>,
    /// Sealed batches: their iovecs (a range of `iov`) and GSO segment size. A pass sends
    /// them together (`sendmmsg`): an answer and the ACK behind it, or a WRITE batch and a
    /// shorter CDC, leave in one system call.
    sealed: Vec<(std::ops::Range<usize>, Option<u16>)>,
    /// The pending packets form a bundle (one datagram, see [`crate::wire::parse_bundle`]),
    /// not a GSO batch; `bytes` is then the bundle's length.
    bundle: bool,
    /// Each sealed batch's bytes, contiguous (one buffer per entry of `sealed`, made when
    /// first needed).
    flat: Vec<Box<[u8]>>,
}

/// Sealed batches a pass keeps before it sends them.
const MAX_SEALED: usize = 4;

// SAFETY: the raw pointers inside are only used while the owning thread holds the QP lock.
unsafe impl Send for TxScratch {}

impl TxScratch {
    fn new() -> Self {
        Self {
            buf: vec![0u8; TX_BUF].into_boxed_slice(),
            used: 0,
            bytes: 0,
            pkts: Vec::with_capacity(MAX_GSO_SEGMENTS),
            iov: Vec::with_capacity(MAX_GSO_SEGMENTS * 7 * MAX_SEALED),
            sealed: Vec::with_capacity(MAX_SEALED),
            bundle: false,
            flat: Vec::new(),
        }
    }

    fn reset(&mut self) {
        self.used = 0;
        self.bytes = 0;
        self.pkts.clear();
        self.iov.clear();
        self.sealed.clear();
        self.bundle = false;
    }

    /// Seals the batch whose iovecs start at `iov_start`: its pieces (heads and trailers
    /// here, payloads in registered memory) are copied into one contiguous buffer, sent as one
    /// iovec. The kernel copies each iovec with a call of its own: three per 1 KiB packet cost
    /// it five times what one 64 KiB piece does, more than this copy out of warm caches (see
    /// docs/decisions.md, "Packets leave contiguous").
    fn seal(&mut self, iov_start: usize, seg: Option<u16>) {
        let k = self.sealed.len();
        if self.flat.len() <= k {
            self.flat.push(vec![0u8; MAX_DATAGRAM].into_boxed_slice());
        }
        let out = &mut self.flat[k];
        let mut at = 0;
        for v in &self.iov[iov_start..] {
            // SAFETY: the iovecs were built from live memory: `buf`, and registered memory the
            // (locked) QP's outstanding requests keep alive.
            let s = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            // A batch is at most a datagram (`has_room`, the bundle limit).
            out[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
        self.iov.truncate(iov_start);
        self.iov.push(libc::iovec {
            iov_base: out.as_mut_ptr().cast(),
            iov_len: at,
        });
        self.sealed.push((iov_start..iov_start + 1, seg));
    }

    /// Another packet (of at most 64 + 4096 bytes, and its head in the buffer) fits the batch.
    fn has_room(&self) -> bool {
        self.bytes + 4096 + 64 + TRAILER + BUNDLE_ROOM <= MAX_DATAGRAM
            && self.pkts.len() < MAX_GSO_SEGMENTS
            && self.used + 4096 + 64 + TRAILER + BUNDLE_ROOM <= self.buf.len()
    }
}

/// Size of a transmit scratch buffer: a full GSO batch plus one packet.
const TX_BUF: usize = MAX_DATAGRAM + 8192;

impl Shared {
    pub(super) fn transmit(&self, core: &mut QpCore, dst: SocketAddrV4, now: Instant) {
        let src = core.src.unwrap_or(*self.local.ip());
        let mut tx = self.tx_bufs.lock().pop().unwrap_or_else(TxScratch::new);
        tx.reset();
        let mut seg = 0;
        // To a peer that is our engine: no ICRC, and small packets that fit a datagram of the
        // path's largest packet size (headers, ICRC field) together go as one bundle.
        let ext = self.ext && core.peer_ext;
        let no_icrc = ext && core.peer_no_icrc && self.send_no_icrc;
        // A bundle fills what the interface carries (else the path MTU's largest packet).
        let limit = match core.rc.path_mtu() {
            Some(m) if ext => core.max_dgram.unwrap_or(m.bytes() + 32).min(MAX_BUNDLE),
            _ => 0,
        };
        let room = if ext { BUNDLE_ROOM } else { 0 };
        // Requests first, so that an ACK closes their batch; but once a batch had to be sent
        // full (bulk), what the responder has goes next instead of after the whole window.
        let mut req_first = true;
        loop {
            if !tx.has_room() {
                self.flush(&mut tx, seg, dst, src, now, no_icrc);
                req_first = false;
            }
            let at = tx.used + room;
            let Some(parts) = core
                .rc
                .poll_transmit_parts(now, &mut tx.buf[at..], req_first)
            else {
                break;
            };
            let len = parts.len();
            // Only packets of which two fit: full-size ones (bulk) go in GSO batches.
            if 2 * (BUNDLE_PREFIX_LEN + len) + BUNDLE_HEADER_LEN <= limit {
                if tx.pkts.len() == 1
                    && !tx.bundle
                    && BUNDLE_ROOM + seg + BUNDLE_PREFIX_LEN + len <= limit
                {
                    // A lone full-size packet and small ones behind it (the last of a
                    // message's WRITE, its CDC): one bundle, one datagram.
                    tx.bundle = true;
                    tx.bytes = BUNDLE_ROOM + seg;
                }
                if !tx.pkts.is_empty() && (!tx.bundle || tx.bytes + BUNDLE_PREFIX_LEN + len > limit)
                {
                    // After a GSO batch, or the bundle is full: a new bundle.
                    self.flush(&mut tx, seg, dst, src, now, no_icrc);
                }
                if tx.pkts.is_empty() {
                    tx.bundle = true;
                    tx.bytes = BUNDLE_HEADER_LEN;
                }
                tx.used = at + parts.head + TRAILER;
                tx.bytes += BUNDLE_PREFIX_LEN + len;
                tx.pkts.push(Pending { head: at, parts });
                continue;
            }
            if !tx.pkts.is_empty() && (tx.bundle || len > seg) {
                // A longer packet cannot follow in the same GSO batch (nor one join a bundle):
                // send the batch first.
                self.flush(&mut tx, seg, dst, src, now, no_icrc);
            }
            tx.used = at + parts.head + TRAILER;
            if tx.pkts.is_empty() {
                seg = len;
                tx.bundle = false;
            }
            tx.bytes += len;
            tx.pkts.push(Pending { head: at, parts });
            if len < seg || !self.cfg.gso {
                // A shorter packet ends a GSO batch (without GSO, each packet is one).
                self.flush(&mut tx, seg, dst, src, now, no_icrc);
            }
        }
        if !tx.pkts.is_empty() {
            self.flush(&mut tx, seg, dst, src, now, no_icrc);
        }
        self.send_sealed(&mut tx, dst, src);
        self.tx_bufs.lock().push(tx);
    }

    /// Sends the sealed batches, in one system call, and empties the scratch space.
    fn send_sealed(&self, tx: &mut TxScratch, dst: SocketAddrV4, src: Ipv4Addr) {
        if tx.sealed.is_empty() {
            tx.reset();
            return;
        }
        let pktinfo = (src != *self.local.ip()).then_some(src);
        let sock = self.sock_for(pktinfo);
        bump(&self.stats.tx_syscalls, 1);
        let failed = if let [(r, seg)] = &tx.sealed[..] {
            // SAFETY: the iovecs point at `tx.flat`, alive here.
            usize::from(unsafe { sock.send_iov(dst, None, &tx.iov[r.clone()], *seg) }.is_err())
        } else {
            // On the stack: no allocation per pass.
            let mut batches: [(&[libc::iovec], Option<u16>); MAX_SEALED] =
                [(&[], None); MAX_SEALED];
            for (b, (r, seg)) in batches.iter_mut().zip(&tx.sealed) {
                *b = (&tx.iov[r.clone()], *seg);
            }
            // SAFETY: as above.
            unsafe { sock.send_batches(dst, None, &batches[..tx.sealed.len()]) }
        };
        if failed > 0 {
            bump(&self.stats.tx_errors, failed as u64);
        }
        tx.reset();
    }

    fn icrc_headers(&self, src: Ipv4Addr, dst: SocketAddrV4, ip_id: u16) -> IcrcHeaders {
        IcrcHeaders {
            src,
            dst: *dst.ip(),
            ip_id,
            df: true,
            // The port we send from (the ICRC covers the real one), not the one we advertise.
            sport: self.sock.local_addr().port(),
            dport: dst.port(),
        }
    }

    /// Sends the pending packets (all `seg` bytes long but the last, or a bundle) and empties
    /// the batch. `no_icrc`: the peer takes packets without ICRC. Must be called with the QP
    /// still locked: payloads point into its registered memory.
    fn flush(
        &self,
        tx: &mut TxScratch,
        seg: usize,
        dst: SocketAddrV4,
        src: Ipv4Addr,
        now: Instant,
        no_icrc: bool,
    ) {
        if tx.pkts.is_empty() {
            // Nothing to seal (the scratch space ran out): send what is sealed.
            self.send_sealed(tx, dst, src);
            return;
        }
        if tx.bundle {
            if self.mw.is_some() {
                // The middleware works on this bundle alone: what was sealed goes first.
                self.send_sealed_keep(tx, dst, src);
            }
            self.seal_bundle(tx, dst, src, no_icrc);
            return;
        }
        // Each address has its socket (see `alt`).
        let pktinfo = (src != *self.local.ip()).then_some(src);
        let count = tx.pkts.len();
        let faults = self.mw.as_ref().is_some_and(|m| m.lock().faults.is_some());
        let gso = self.cfg.gso && count > 1 && !faults;
        if self.mw.is_some() {
            // The middleware works on this batch alone: what was sealed goes first.
            self.send_sealed_keep(tx, dst, src);
        }
        let iov_start = tx.iov.len();
        let buf_ptr = tx.buf.as_mut_ptr();
        for (i, p) in tx.pkts.iter().enumerate() {
            // Linux numbers the identification of GSO segments 0, 1, 2, …; a lone datagram from
            // our unconnected DF socket gets 0. The ICRC covers it, so compute it per segment.
            let id = if gso { i as u16 } else { 0 };
            let head_end = p.head + p.parts.head;
            // SAFETY: head and trailer areas are disjoint parts of `tx.buf`; payload pieces point
            // into registered memory kept alive by the (locked) QP's outstanding request.
            let (head, trailer) = unsafe {
                (
                    std::slice::from_raw_parts_mut(buf_ptr.add(p.head), p.parts.head),
                    std::slice::from_raw_parts_mut(buf_ptr.add(head_end), TRAILER),
                )
            };
            // Byte 4 is masked out of the ICRC: the mark costs a Linux peer nothing. Without
            // our extensions it carries none of their flags (the requester's ACK_NOW either).
            head[4] = if self.ext {
                head[4] | self.ext_flags(no_icrc)
            } else {
                head[4] & 0xC0
            };
            let mut parts: [&[u8]; 6] = [&[]; 6];
            parts[0] = head;
            let mut n = 1;
            // SAFETY: as above.
            for s in unsafe { p.parts.payload.slices() } {
                parts[n] = s;
                n += 1;
            }
            parts[n] = &[0u8; 3][..p.parts.pad];
            let icrc = if no_icrc {
                0
            } else {
                crate::wire::compute_icrc_vectored(&self.icrc_headers(src, dst, id), &parts[..=n])
            };
            trailer[..p.parts.pad].fill(0);
            trailer[p.parts.pad..p.parts.pad + 4].copy_from_slice(&icrc.to_le_bytes());
            parts[n] = &trailer[..p.parts.pad + 4];
            for s in &parts[..=n] {
                if !s.is_empty() {
                    tx.iov.push(libc::iovec {
                        iov_base: s.as_ptr() as *mut _,
                        iov_len: s.len(),
                    });
                }
            }
        }
        bump(&self.stats.tx_packets, count as u64);
        if no_icrc {
            bump(&self.stats.tx_no_icrc, count as u64);
        }
        if let Some(mw) = &self.mw {
            // Capture and fault injection work on contiguous copies of each packet.
            let mut flat = Vec::with_capacity(tx.bytes);
            for v in &tx.iov[iov_start..] {
                // SAFETY: the iovecs were built above from live memory.
                flat.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
            let mut mw = mw.lock();
            let mw = &mut *mw;
            let mut at = 0;
            for (i, p) in tx.pkts.iter().enumerate() {
                let pkt = &flat[at..at + p.parts.len()];
                at += p.parts.len();
                let id = if gso { i as u16 } else { 0 };
                if let Some(pc) = &mut mw.pcap {
                    let _ = pc.write_packet(&self.icrc_headers(src, dst, id), self.cfg.ttl, pkt);
                }
                if let Some(f) = &mut mw.faults {
                    f.process(now, dst, pktinfo, pkt.to_vec(), &mut mw.released);
                }
            }
            if mw.faults.is_some() {
                for r in mw.released.drain(..) {
                    self.send_raw(r.dst, r.src, &r.bytes, None);
                }
                if let Some(t) = mw.faults.as_ref().and_then(FaultInjector::next_due) {
                    self.schedule(t, FAULT_TIMER);
                }
                tx.reset();
                return;
            }
        }
        // Sealed: sent with the rest of the pass, unless the scratch space is full.
        tx.seal(iov_start, gso.then_some(seg as u16));
        tx.pkts.clear();
        tx.bytes = 0;
        if tx.sealed.len() >= MAX_SEALED
            || tx.used + 4096 + 64 + TRAILER + BUNDLE_ROOM > tx.buf.len()
        {
            self.send_sealed(tx, dst, src);
        }
    }

    /// What byte 4 of our packets' BTHs carries: the mark (and whether we take packets
    /// without ICRC), and whether this one has none.
    fn ext_flags(&self, no_icrc: bool) -> u8 {
        if !self.ext {
            return 0;
        }
        let mut f = wire::MARK;
        if self.take_no_icrc {
            f |= wire::TAKES_NO_ICRC;
        }
        if no_icrc {
            f |= wire::NO_ICRC;
        }
        f
    }

    /// Seals the pending packets as one bundle: its header and each packet's length go in the
    /// room left before the packets' heads, the ICRC fields are zero.
    fn seal_bundle(&self, tx: &mut TxScratch, dst: SocketAddrV4, src: Ipv4Addr, no_icrc: bool) {
        let iov_start = tx.iov.len();
        let buf_ptr = tx.buf.as_mut_ptr();
        let flags = self.ext_flags(no_icrc);
        let count = tx.pkts.len();
        for (i, p) in tx.pkts.iter().enumerate() {
            let start = p.head
                - if i == 0 {
                    BUNDLE_ROOM
                } else {
                    BUNDLE_PREFIX_LEN
                };
            let head_end = p.head + p.parts.head;
            let len = p.parts.len() as u16;
            // SAFETY: the room before each head (reserved by `transmit`), the head and its
            // trailer are disjoint parts of `tx.buf`; payload pieces point into registered
            // memory kept alive by the (locked) QP's outstanding request.
            let (head, trailer) = unsafe {
                (
                    std::slice::from_raw_parts_mut(buf_ptr.add(start), head_end - start),
                    std::slice::from_raw_parts_mut(buf_ptr.add(head_end), TRAILER),
                )
            };
            let bth = head.len() - p.parts.head;
            head[bth + 4] |= flags;
            if i == 0 {
                let qpn = u32::from_be_bytes([0, head[bth + 5], head[bth + 6], head[bth + 7]]);
                head[..BUNDLE_HEADER_LEN].copy_from_slice(&wire::bundle_header(qpn));
            }
            head[bth - BUNDLE_PREFIX_LEN..bth].copy_from_slice(&len.to_be_bytes());
            tx.iov.push(libc::iovec {
                iov_base: head.as_mut_ptr().cast(),
                iov_len: head.len(),
            });
            // SAFETY: as above.
            for s in unsafe { p.parts.payload.slices() } {
                if !s.is_empty() {
                    tx.iov.push(libc::iovec {
                        iov_base: s.as_ptr() as *mut _,
                        iov_len: s.len(),
                    });
                }
            }
            let t = p.parts.pad + crate::wire::ICRC_LEN;
            trailer[..t].fill(0);
            if !no_icrc {
                // As for a lone datagram (identification 0), over the packet alone.
                let mut parts: [&[u8]; 6] = [&[]; 6];
                parts[0] = &head[bth..];
                let mut n = 1;
                // SAFETY: as above.
                for s in unsafe { p.parts.payload.slices() } {
                    parts[n] = s;
                    n += 1;
                }
                parts[n] = &trailer[..p.parts.pad];
                let icrc = crate::wire::compute_icrc_vectored(
                    &self.icrc_headers(src, dst, 0),
                    &parts[..=n],
                );
                trailer[p.parts.pad..t].copy_from_slice(&icrc.to_le_bytes());
            }
            tx.iov.push(libc::iovec {
                iov_base: trailer.as_mut_ptr().cast(),
                iov_len: t,
            });
        }
        bump(&self.stats.tx_packets, count as u64);
        if no_icrc {
            bump(&self.stats.tx_no_icrc, count as u64);
        }
        bump(&self.stats.tx_bundles, 1);
        if let Some(mw) = &self.mw {
            // Fault injection (no capture: see `Shared::ext`) works on the whole datagram, as a path
            // drops, delays or duplicates it.
            let mut flat = Vec::with_capacity(tx.bytes);
            for v in &tx.iov[iov_start..] {
                // SAFETY: the iovecs were built above from live memory.
                flat.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
            tx.iov.truncate(iov_start);
            tx.pkts.clear();
            tx.bytes = 0;
            tx.bundle = false;
            let pktinfo = (src != *self.local.ip()).then_some(src);
            let mut mw = mw.lock();
            let mw = &mut *mw;
            if let Some(f) = &mut mw.faults {
                f.process(Instant::now(), dst, pktinfo, flat, &mut mw.released);
                for r in mw.released.drain(..) {
                    self.send_raw(r.dst, r.src, &r.bytes, None);
                }
                if let Some(t) = f.next_due() {
                    self.schedule(t, FAULT_TIMER);
                }
            }
            return;
        }
        tx.seal(iov_start, None);
        tx.pkts.clear();
        tx.bytes = 0;
        tx.bundle = false;
        if tx.sealed.len() >= MAX_SEALED
            || tx.used + 4096 + 64 + TRAILER + BUNDLE_ROOM > tx.buf.len()
        {
            self.send_sealed(tx, dst, src);
        }
    }

    /// [`Self::send_sealed`] while a batch is being built: keeps its packets (their heads
    /// stay where they are in the buffer; only the sealed iovecs go).
    fn send_sealed_keep(&self, tx: &mut TxScratch, dst: SocketAddrV4, src: Ipv4Addr) {
        if tx.sealed.is_empty() {
            return;
        }
        let (used, bytes) = (tx.used, tx.bytes);
        let pkts = std::mem::take(&mut tx.pkts);
        self.send_sealed(tx, dst, src);
        (tx.used, tx.bytes, tx.pkts) = (used, bytes, pkts);
    }

    /// The socket of local address `src` (`None`: the device's own).
    fn sock_for(&self, src: Option<Ipv4Addr>) -> &UdpSocket {
        src.and_then(|a| self.alt.iter().find(|(x, _)| *x == a))
            .map_or(&self.sock, |(_, s)| s)
    }

    fn send_raw(&self, dst: SocketAddrV4, src: Option<Ipv4Addr>, bytes: &[u8], gso: Option<u16>) {
        bump(&self.stats.tx_syscalls, 1);
        if self.sock_for(src).send(dst, None, bytes, gso).is_err() {
            bump(&self.stats.tx_errors, 1);
        }
    }

    pub(super) fn release_faulted(&self, now: Instant) {
        let Some(mw) = &self.mw else { return };
        let mut guard = mw.lock();
        let mw = &mut *guard;
        let Some(f) = &mut mw.faults else { return };
        f.release(now, &mut mw.released);
        let next = f.next_due();
        for r in mw.released.drain(..) {
            self.send_raw(r.dst, r.src, &r.bytes, None);
        }
        drop(guard);
        if let Some(t) = next {
            self.schedule(t, FAULT_TIMER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(s: &[u8]) -> libc::iovec {
        libc::iovec {
            iov_base: s.as_ptr() as *mut _,
            iov_len: s.len(),
        }
    }

    #[test]
    fn a_sealed_batch_is_its_pieces_in_order_in_one_iovec() {
        let mut tx = TxScratch::new();
        let (head, payload, trailer) = ([1u8; 40], [2u8; 1024], [0u8; 4]);
        for batch in 0..2u8 {
            let start = tx.iov.len();
            for _ in 0..3 {
                tx.iov.extend([iov(&head), iov(&payload), iov(&trailer)]);
            }
            tx.seal(start, Some(1068 + u16::from(batch)));
        }
        assert_eq!(tx.sealed.len(), 2);
        assert_eq!(tx.iov.len(), 2, "one iovec per batch");
        for (k, (r, seg)) in tx.sealed.iter().enumerate() {
            assert_eq!(*seg, Some(1068 + k as u16));
            assert_eq!(r.len(), 1);
            let v = tx.iov[r.start];
            assert_eq!(v.iov_len, 3 * 1068);
            // SAFETY: the iovec points into `tx.flat`, alive here.
            let got = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            let packet: Vec<u8> = [&head[..], &payload, &trailer].concat();
            assert_eq!(got, packet.repeat(3));
        }
        tx.reset();
        assert!(tx.sealed.is_empty() && tx.iov.is_empty());
    }
}
