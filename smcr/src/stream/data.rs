//! An `SmcStream`'s data path: reading and writing (blocking, non-blocking, with timeouts),
//! shutdown and abort, and the wait for the peer or the link group.

#[allow(unused_imports)]
use super::*;

impl SmcStream {
    /// Posts what autocorking holds back (SMC-R); nothing to do over TCP.
    pub(super) fn flush_staged(&self) -> io::Result<()> {
        if let Some(smc) = &self.smc {
            let mut s = smc.conn.core.lock();
            let staged = s.core.staged();
            smc.conn.flush_locked(&mut s, &smc.lg, staged, false)?;
        }
        Ok(())
    }

    /// Shuts down reading, writing or both. Writing: the peer reads EOF after our data.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let Some(smc) = &self.smc else {
            return self.tcp.shutdown(how);
        };
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            let mut s = smc.conn.core.lock();
            s.core.shutdown_read();
            smc.conn.report(&mut s);
            drop(s);
            smc.conn.wake();
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            let mut s = smc.conn.core.lock();
            if s.core.shut_wr() {
                return Ok(());
            }
            let staged = s.core.staged();
            smc.conn.flush_locked(&mut s, &smc.lg, staged, false)?;
            if let Some(cdc) = s.core.shutdown_write() {
                s.publish();
                smc.conn.send_ctl(&mut s, &smc.lg, &cdc, false)?;
            }
            smc.conn.report(&mut s);
        }
        Ok(())
    }

    /// Ends the connection at once: the peer is told (an abort CDC, which it reports as
    /// `ConnectionReset`), and our own reads and writes fail with `ConnectionReset` carrying
    /// `why`. For callers that can no longer trust the connection (the preload after a panic
    /// in a call on it). A TCP-mode stream is shut down both ways.
    pub fn abort(&self, why: &str) {
        let Some(smc) = &self.smc else {
            let _ = self.tcp.shutdown(Shutdown::Both);
            return;
        };
        let mut s = smc.conn.core.lock();
        if s.failed.is_none() {
            smc.conn
                .abort(&mut s, &smc.lg, ConnFailure::Aborted(why.to_owned()));
            smc.conn.report(&mut s);
        }
        drop(s);
        smc.conn.wake();
    }

    /// Takes a reset not yet reported (for SO_ERROR, which reports it once): `true` if there
    /// was one. A TCP-mode stream: `false` (the socket keeps its own error).
    pub fn take_reset(&self) -> bool {
        let Some(smc) = &self.smc else {
            return false;
        };
        let mut s = smc.conn.core.lock();
        let taken = s.take_reset().is_some();
        if taken {
            smc.conn.report(&mut s);
        }
        taken
    }

    pub(super) fn deadline(t: Option<Duration>) -> Option<Instant> {
        t.map(|t| Instant::now() + t)
    }

    /// Reads from an SMC-R stream with per-call blocking (the preload passes the
    /// application's O_NONBLOCK and SO_RCVTIMEO); `peek` leaves the data in place (MSG_PEEK).
    /// On a TCP-mode stream this reads the TCP socket.
    pub fn recv(&self, buf: &mut [u8], peek: bool, how: Blocking) -> io::Result<usize> {
        let r = if self.smc.is_none() {
            (&*self.tcp).read(buf)
        } else {
            self.smc_read(buf, peek, how)
        };
        if peek { r } else { self.counted(r, false) }
    }

    /// Writes to an SMC-R stream with per-call blocking; on a TCP-mode stream, to the socket.
    pub fn send(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        let r = if self.smc.is_none() {
            (&*self.tcp).write(buf)
        } else {
            self.smc_write(buf, how)
        };
        self.counted(r, true)
    }

    pub(super) fn how(&self, timeout: Option<Duration>) -> Blocking {
        if self.nonblocking.load(std::sync::atomic::Ordering::Relaxed) {
            Blocking::No
        } else {
            Blocking::Yes(timeout)
        }
    }

    pub(super) fn smc_read(&self, buf: &mut [u8], peek: bool, how: Blocking) -> io::Result<usize> {
        let smc = self.smc.as_ref().expect("SMC-R mode");
        if buf.is_empty() {
            return Ok(0);
        }
        let (nonblocking, deadline) = match how {
            Blocking::No => (true, None),
            Blocking::Yes(t) => (false, Self::deadline(t)),
        };
        let mut s = smc.conn.core.lock();
        loop {
            let readable = s.core.readable();
            if readable > 0 {
                let n = readable.min(buf.len().min(u32::MAX as usize) as u32);
                let mut at = 0usize;
                for (off, len) in s.core.read_pieces(n) {
                    let len = len as usize;
                    if len > 0 {
                        smc.conn.rmb.read(off as usize, &mut buf[at..at + len]);
                        at += len;
                    }
                }
                s.stats.bytes_received += u64::from(n);
                if peek {
                    return Ok(n as usize);
                }
                if let Some(cdc) = s.core.consume(n) {
                    // The bytes are in `buf` and consumed: they are returned even if the
                    // update cannot go (a peer that closed and deleted the link group before
                    // we read its last bytes); a dead link shows on the next call.
                    let _ = smc.conn.send_ctl(&mut s, &smc.lg, &cdc, false);
                }
                s.publish();
                smc.conn.report(&mut s);
                return Ok(n as usize);
            }
            let pf = s.core.peer_flags();
            if s.core.shut_rd() {
                return Ok(0);
            }
            // A peer that finished cleanly gives EOF even if the link goes away afterwards
            // (its process exits and deletes the link group right after closing): checked
            // before a local failure, which would otherwise turn the clean end into a reset.
            // So does a reset already reported.
            if s.reset_reported
                || (pf.intersects(
                    ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED,
                ) && !pf.contains(ConnStateFlags::PEER_CONN_ABORT))
            {
                return Ok(0);
            }
            if let Some(e) = s.take_reset() {
                return Err(e);
            }
            smc.conn.wait(&smc.lg, &mut s, nonblocking, deadline)?;
        }
    }

    pub(super) fn smc_write(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        let smc = self.smc.as_ref().expect("SMC-R mode");
        if buf.is_empty() {
            return Ok(0);
        }
        let (nonblocking, deadline) = match how {
            Blocking::No => (true, None),
            Blocking::Yes(t) => (false, Self::deadline(t)),
        };
        let mut s = smc.conn.core.lock();
        let mut found_full = false;
        loop {
            if let Some(e) = s.take_reset() {
                return Err(e);
            }
            let pf = s.core.peer_flags();
            if pf.intersects(ConnStateFlags::PEER_CONN_CLOSED | ConnStateFlags::PEER_CONN_ABORT)
                || s.core.local_closed()
                || s.core.shut_wr()
                || s.reset_reported
            {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    format!(
                        "the connection is closed (token {:#x}, peer flags {:?}, local close {})",
                        smc.conn.token,
                        pf,
                        s.core.local_closed()
                    ),
                ));
            }
            let avail = s.core.space().saturating_sub(s.core.staged());
            if avail > 0 {
                let want = buf.len().min(u32::MAX as usize) as u32;
                let n = want.min(avail);
                // On one host, straight into the peer's RMB when nothing waits before it.
                if smc
                    .conn
                    .write_direct(&mut s, &smc.lg, &buf[..n as usize], want)?
                {
                    s.stats.writes += 1;
                    smc.conn.report(&mut s);
                    return Ok(n as usize);
                }
                let mut at = 0usize;
                for (off, len) in s.core.stage_pieces(s.core.staged(), n) {
                    if len > 0 {
                        smc.conn
                            .sndbuf
                            .write(off as usize, &buf[at..at + len as usize]);
                        at += len as usize;
                    }
                }
                s.core.stage(n);
                s.stats.writes += 1;
                // Autocorking as Linux: while a CDC of ours is in flight, small writes wait in
                // the send buffer and go out together when it completes; a lone write (nothing
                // in flight) goes at once.
                if !s.core.corked(smc.conn.cork_limit()) {
                    let pending = s.core.staged() + (want - n);
                    smc.conn.flush_locked(&mut s, &smc.lg, pending, false)?;
                }
                smc.conn.report(&mut s);
                return Ok(n as usize);
            }
            // Once per call, however often it wakes to find the buffer still full.
            if !std::mem::replace(&mut found_full, true)
                && let Some(st) = &s.stat
            {
                use crate::stats::conn::counter;
                st.area.count_conn(st.slot, counter::TX_FULL);
                if s.core.space() == 0 {
                    st.area.count_conn(st.slot, counter::TX_FULL_PEER);
                }
            }
            smc.conn.wait(&smc.lg, &mut s, nonblocking, deadline)?;
        }
    }
}

/// Whether an operation may wait, and how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocking {
    /// Fail with `WouldBlock` instead of waiting.
    No,
    /// Wait, at most this long (`None`: as long as it takes).
    Yes(Option<Duration>),
}

impl Read for &SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let r = if self.smc.is_some() {
            let t = self.timeout(0);
            self.smc_read(buf, false, self.how(t))
        } else {
            (&*self.tcp).read(buf)
        };
        self.counted(r, false)
    }
}

impl Write for &SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let r = if self.smc.is_some() {
            let t = self.timeout(1);
            self.smc_write(buf, self.how(t))
        } else {
            (&*self.tcp).write(buf)
        };
        self.counted(r, true)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_staged()
    }
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}
