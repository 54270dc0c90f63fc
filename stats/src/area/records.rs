//! The records in an area: devices, connections and link groups (claimed, written under
//! their sequence lock, read consistently, freed), the totals and the fallback counters.

use super::*;

impl Area {
    pub(super) fn conn(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < self.conn_slots(), "connection slot out of range");
        let at = HEADER_WORDS + slot * CONN_WORDS;
        &self.slice()[at..at + CONN_WORDS]
    }

    pub(super) fn lg(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < self.lg_slots(), "link-group slot out of range");
        let at = HEADER_WORDS + self.conn_slots() * CONN_WORDS + slot * LG_WORDS;
        &self.slice()[at..at + LG_WORDS]
    }

    pub(super) fn dev(&self, slot: usize) -> &[AtomicU64] {
        assert!(slot < DEV_SLOTS, "device slot out of range");
        let at = HEADER_WORDS
            + self.conn_slots() * CONN_WORDS
            + self.lg_slots() * LG_WORDS
            + slot * DEV_WORDS;
        &self.slice()[at..at + DEV_WORDS]
    }

    /// Claims a free device slot; `None` when all are taken.
    pub fn claim_dev(&self) -> Option<usize> {
        (0..DEV_SLOTS).find(|&i| claim(self.dev(i)))
    }

    /// The counter words of device slot `slot`, for the engine to bump
    /// ([`rdma::CounterWords`]).
    pub fn dev_counters(&self, slot: usize) -> &[AtomicU64] {
        &self.dev(slot)[D_COUNTERS..D_COUNTERS + rdma::DeviceStats::COUNT]
    }

    /// Records what device slot `slot` is: its address, mode code ([`dev::MODE`]) and range.
    pub fn set_dev(&self, slot: usize, addr: std::net::SocketAddrV4, mode: u64, range: u32) {
        let r = self.dev(slot);
        r[dev::ADDR].store(
            u64::from(u32::from(*addr.ip())) << 16 | u64::from(addr.port()),
            Ordering::Relaxed,
        );
        r[dev::MODE].store(mode | u64::from(range & 0xFFFF) << 8, Ordering::Relaxed);
    }

    /// Frees a device slot (its counters zeroed for the next device).
    pub fn release_dev(&self, slot: usize) {
        let r = self.dev(slot);
        for w in &r[2..] {
            w.store(0, Ordering::Relaxed);
        }
        r[1].store(0, Ordering::Release);
    }

    /// Device slot `slot`, or `None` if it is free. Counters are read one by one (each is
    /// monotonic; no lock).
    pub fn read_dev(&self, slot: usize) -> Option<DevRecord> {
        let r = self.dev(slot);
        if r[1].load(Ordering::Acquire) == 0 {
            return None;
        }
        let a = r[dev::ADDR].load(Ordering::Relaxed);
        let m = r[dev::MODE].load(Ordering::Relaxed);
        let words: Vec<u64> = r[D_COUNTERS..D_COUNTERS + rdma::DeviceStats::COUNT]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        Some(DevRecord {
            addr: std::net::SocketAddrV4::new(((a >> 16) as u32).into(), a as u16),
            mode: dev::MODE_NAMES
                .get((m & 0xFF) as usize)
                .copied()
                .unwrap_or("?"),
            range: ((m >> 8) & 0xFFFF) as u32,
            stats: rdma::DeviceStats::from_words(&words),
        })
    }

    /// Claims a free connection slot (its `in_use` word 0 → 1); `None` when all are taken.
    pub fn claim_conn(&self) -> Option<usize> {
        let n = self.conn_slots();
        let start = self.next_conn.load(Ordering::Relaxed);
        let i = (0..n).map(|k| (start + k) % n).find(|&i| {
            let r = self.conn(i);
            claim(r)
                .then(|| {
                    r[C_BYTES_SENT].store(0, Ordering::Relaxed);
                    r[C_BYTES_RECEIVED].store(0, Ordering::Relaxed);
                    for w in &r[C_LIVE..C_LIVE + conn::live::COUNT] {
                        w.store(0, Ordering::Relaxed);
                    }
                    for w in &r[C_COUNTERS..C_COUNTERS + conn::counter::COUNT] {
                        w.store(0, Ordering::Relaxed);
                    }
                })
                .is_some()
        })?;
        self.next_conn.store(i + 1, Ordering::Relaxed);
        Some(i)
    }

    /// Writes a connection's locked fields (`rec.words[0]`, `in_use`, must stay non-zero).
    pub fn write_conn(&self, slot: usize, rec: &ConnRecord) {
        seq_write(self.conn(slot), &rec.words);
    }

    /// Adds to a connection's byte counters.
    pub fn add_bytes(&self, slot: usize, sent: u64, received: u64) {
        let r = self.conn(slot);
        if sent > 0 {
            r[C_BYTES_SENT].fetch_add(sent, Ordering::Relaxed);
        }
        if received > 0 {
            r[C_BYTES_RECEIVED].fetch_add(received, Ordering::Relaxed);
        }
    }

    /// Counts a read (`sent` false) or write that moved `bytes` (none: not a request that
    /// moved data, not counted) in its size bucket.
    pub fn count_request(&self, slot: usize, sent: bool, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let base = if sent {
            conn::counter::TX_REQS
        } else {
            conn::counter::RX_REQS
        };
        self.conn(slot)[C_COUNTERS + base + super::bucket(bytes)].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds one to a connection's [`conn::counter`] word (the buffer-full counts).
    pub fn count_conn(&self, slot: usize, which: usize) {
        assert!(which < conn::counter::COUNT, "no such counter");
        self.conn(slot)[C_COUNTERS + which].fetch_add(1, Ordering::Relaxed);
    }

    /// Stores one of a connection's [`conn::live`] words.
    pub fn set_live(&self, slot: usize, word: usize, value: u64) {
        self.conn(slot)[C_LIVE + word].store(value, Ordering::Relaxed);
    }

    /// Stores a live word if it is still 0 (first-time events).
    pub fn set_live_once(&self, slot: usize, word: usize, value: u64) {
        let _ = self.conn(slot)[C_LIVE + word].compare_exchange(
            0,
            value,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Frees a slot (a reader then sees it empty); its bytes, requests, buffer-full counts
    /// and (an SMC-R connection's) buffer sizes go to the process totals first, between two
    /// counters [`Area::read_consistent`] checks.
    pub fn release_conn(&self, slot: usize) {
        self.next_conn.store(slot, Ordering::Relaxed);
        let h = self.slice();
        h[H_RELEASING].fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        let r = self.conn(slot);
        self.count_n(total::BYTES_SENT, r[C_BYTES_SENT].load(Ordering::Relaxed));
        self.count_n(
            total::BYTES_RECEIVED,
            r[C_BYTES_RECEIVED].load(Ordering::Relaxed),
        );
        for i in 0..conn::counter::COUNT {
            self.count_n(
                total::COUNTERS + i,
                r[C_COUNTERS + i].load(Ordering::Relaxed),
            );
        }
        // The sizes are set once, before the stream is handed out: no lock needed to read.
        let sizes = r[C_FIELDS + conn::SIZES].load(Ordering::Relaxed);
        let smcr =
            r[C_FIELDS + conn::STATE].load(Ordering::Relaxed) >> 16 & 0xff == conn::MODE_SMCR;
        if smcr && sizes != 0 {
            self.count_n(total::RX_BUFS + super::bucket(sizes & 0xffff_ffff), 1);
            self.count_n(total::TX_BUFS + super::bucket(sizes >> 32), 1);
        }
        // Zeroed before the slot is free, not when claimed again: a reader must never see a
        // claimed slot still holding counts that are in the totals already.
        for w in &r[C_BYTES_SENT..CONN_WORDS] {
            w.store(0, Ordering::Relaxed);
        }
        seq_free(r, C_BYTES_SENT);
        h[H_RELEASED].fetch_add(1, Ordering::Release);
    }

    /// Runs `read` (a reading of the totals and the records) again until no record was
    /// being freed while it ran: otherwise a connection closing meanwhile could be counted
    /// in neither place or in both, and a sum of the two that should only grow would not.
    /// Gives up after a while (a writer that died mid-release) and returns the last reading.
    pub fn read_consistent<T>(&self, mut read: impl FnMut() -> T) -> T {
        let h = self.slice();
        for attempt in 0..1000 {
            let started = h[H_RELEASING].load(Ordering::Acquire);
            let done = h[H_RELEASED].load(Ordering::Acquire);
            let v = read();
            // Had `read` seen any write of a release that began after our first load, it
            // would see that release's start below.
            fence(Ordering::Acquire);
            if started == done && h[H_RELEASING].load(Ordering::Relaxed) == started {
                return v;
            }
            if attempt % 16 == 15 {
                std::thread::yield_now();
            }
        }
        read()
    }

    /// A consistent copy of a slot, or `None` if it is free. Retries while a writer is in
    /// the middle of an update, yielding the CPU now and then (a writer preempted
    /// mid-update needs it back to finish), for at most [`READ_PATIENCE`]: a writer that
    /// died mid-update leaves the slot unreadable, reported as an error.
    pub fn read_conn(&self, slot: usize) -> io::Result<Option<ConnRecord>> {
        let r = self.conn(slot);
        let mut rec = ConnRecord::default();
        if !seq_read(r, &mut rec.words).map_err(|()| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("connection slot {slot} stays mid-update"),
            )
        })? {
            return Ok(None);
        }
        rec.bytes_sent = r[C_BYTES_SENT].load(Ordering::Relaxed);
        rec.bytes_received = r[C_BYTES_RECEIVED].load(Ordering::Relaxed);
        for (i, w) in rec.live.iter_mut().enumerate() {
            *w = r[C_LIVE + i].load(Ordering::Relaxed);
        }
        for (i, w) in rec.counters.iter_mut().enumerate() {
            *w = r[C_COUNTERS + i].load(Ordering::Relaxed);
        }
        Ok(Some(rec))
    }

    /// Claims a free link-group slot.
    pub fn claim_lg(&self) -> Option<usize> {
        (0..self.lg_slots()).find(|&i| {
            let r = self.lg(i);
            claim(r)
                .then(|| r[L_CONNS].store(0, Ordering::Relaxed))
                .is_some()
        })
    }

    /// Writes a link group's locked fields.
    pub fn write_lg(&self, slot: usize, rec: &LgRecord) {
        seq_write(self.lg(slot), &rec.words);
    }

    /// Sets a link group's connection count.
    pub fn set_lg_conns(&self, slot: usize, n: u64) {
        self.lg(slot)[L_CONNS].store(n, Ordering::Relaxed);
    }

    /// Frees a link-group slot.
    pub fn release_lg(&self, slot: usize) {
        seq_free(self.lg(slot), L_CONNS);
    }

    /// A consistent copy of a link-group slot, or `None` if it is free (see
    /// [`Area::read_conn`]).
    pub fn read_lg(&self, slot: usize) -> io::Result<Option<LgRecord>> {
        let r = self.lg(slot);
        let mut rec = LgRecord::default();
        if !seq_read(r, &mut rec.words).map_err(|()| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("link-group slot {slot} stays mid-update"),
            )
        })? {
            return Ok(None);
        }
        rec.conns = r[L_CONNS].load(Ordering::Relaxed);
        Ok(Some(rec))
    }

    /// Adds one to a process counter ([`total`]).
    pub fn count(&self, which: usize) {
        self.count_n(which, 1);
    }

    pub(super) fn count_n(&self, which: usize, n: u64) {
        assert!(which < total::COUNT, "no such total");
        if n > 0 {
            self.slice()[H_TOTALS + which].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The process counters, indexed by [`total`].
    pub fn totals(&self) -> [u64; total::COUNT] {
        let h = self.slice();
        std::array::from_fn(|i| h[H_TOTALS + i].load(Ordering::Relaxed))
    }

    /// Counts one fallback with `code`. Codes beyond [`FALLBACK_CODES`] distinct ones are
    /// counted under code 0 ("other").
    pub fn count_fallback(&self, code: u32) {
        let h = self.slice();
        let key = u64::from(code) | 1 << 32; // never 0: 0 marks a free pair
        // The last pair is kept for code 0 ("other"), so it always has room.
        let pairs = if code == 0 {
            FALLBACK_CODES - 1..FALLBACK_CODES
        } else {
            0..FALLBACK_CODES - 1
        };
        for i in pairs {
            let k = &h[H_FALLBACKS + 2 * i];
            let cur = k.load(Ordering::Acquire);
            let owned = cur == key
                || (cur == 0
                    && match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => true,
                        Err(now) => now == key,
                    });
            if owned {
                h[H_FALLBACKS + 2 * i + 1].fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if code != 0 {
            self.count_fallback(0);
        }
    }

    /// The fallback counters, by code.
    pub fn fallbacks(&self) -> Vec<(u32, u64)> {
        let h = self.slice();
        (0..FALLBACK_CODES)
            .filter_map(|i| {
                let k = h[H_FALLBACKS + 2 * i].load(Ordering::Acquire);
                let n = h[H_FALLBACKS + 2 * i + 1].load(Ordering::Relaxed);
                (k != 0 && n != 0).then_some((k as u32, n))
            })
            .collect()
    }

    /// Records that SMC-R is unavailable to the whole process, with the fallback code (e.g.
    /// NOBPF): its connections then never reach the negotiation and have no rows.
    pub fn set_unavailable(&self, code: u32) {
        self.slice()[H_UNAVAILABLE].store(u64::from(code), Ordering::Relaxed);
    }

    /// The code set by [`Area::set_unavailable`] (0: SMC-R is available).
    pub fn unavailable(&self) -> u32 {
        self.slice()[H_UNAVAILABLE].load(Ordering::Relaxed) as u32
    }

    /// The reset epoch (bumped by each reset of the counters).
    pub fn reset_epoch(&self) -> u64 {
        self.slice()[H_RESET_EPOCH].load(Ordering::Relaxed)
    }

    /// Zeroes the process counters, the fallback counters and the open connections' request
    /// and buffer-full counters (not the rest of their records, which describe sockets that
    /// exist, nor their bytes, which the socket table shows), and bumps the reset epoch. Needs an
    /// area opened with [`Area::open_rw`] (or our own). Increments racing with the reset
    /// land before or after it, never lost in between (each counter is swapped, not stored).
    pub fn reset(&self) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "stats area opened read-only",
            ));
        }
        let h = self.slice();
        for w in &h[H_TOTALS..H_TOTALS + total::COUNT] {
            w.swap(0, Ordering::Relaxed);
        }
        for i in 0..FALLBACK_CODES {
            h[H_FALLBACKS + 2 * i + 1].swap(0, Ordering::Relaxed);
        }
        for slot in 0..self.conn_slots() {
            for w in &self.conn(slot)[C_COUNTERS..C_COUNTERS + conn::counter::COUNT] {
                w.swap(0, Ordering::Relaxed);
            }
        }
        h[H_RESET_EPOCH].fetch_add(1, Ordering::Release);
        Ok(())
    }
}
