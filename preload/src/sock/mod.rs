//! The entry a number of ours holds ([`Sock`]) and what it points to: an SMC-R connection
//! ([`SmcFd`]: its stream, O_NONBLOCK, timeouts, and the preamble written before it was
//! settled), a marked listener ([`Listener`]) and a connection not settled yet ([`Settling`],
//! `settling`). Leaf types, below the table that holds them: they know the readiness
//! ([`Pair`]), none of the paths that make them (`shim`).

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smcr::{Blocking, SmcStream};

use crate::pair::Pair;
use crate::real;

mod settling;

pub(crate) use settling::{Phase, Role, Settling, Staged, State};

/// A socket the shim manages.
pub(crate) enum Sock {
    /// A TCP socket (IPv4, or IPv6 that may reach IPv4 peers), not connected or listening yet.
    Inet,
    /// A marked listening socket (at the application's number, shared by every process that
    /// holds it).
    Listener(Arc<Listener>),
    /// A non-blocking connect (or one to a listener of this process) being completed and
    /// negotiated in the background.
    Pending(Arc<Settling>),
    /// An accepted connection whose peer offered SMC-R: negotiated at its first use.
    Accepted(Arc<Settling>),
    /// An SMC-R connection.
    Smc(SmcFd),
    /// An SMC-R connection (or a connect in progress) of another process, inherited through
    /// fork: the child may close it (nothing is sent) but not use it (EIO).
    Inherited,
}

impl Sock {
    /// Whether the entry belongs to the process that made it only (a forked child's copy is
    /// [`Sock::Inherited`]); listeners, accepted connections not negotiated yet and plain
    /// sockets are any holder's.
    pub(crate) fn per_process(&self) -> bool {
        matches!(self, Self::Smc(_) | Self::Pending(_))
    }

    /// The readiness this socket shows through our hooks, if it is ours to answer for.
    pub(crate) fn pair(&self) -> Option<&Arc<Pair>> {
        match self {
            Self::Smc(c) => Some(&c.pair),
            Self::Pending(p) => Some(&p.pair),
            Self::Accepted(a) => Some(&a.pair),
            _ => None,
        }
    }
}

/// Whether the number's close-on-exec flag is the application's view only: an SMC-R
/// connection, or a connect being negotiated (its worker would not survive the exec), is
/// close-on-exec for real (an exec'd image could not serve it: it arrives closed rather than
/// silent), whatever the program sets; one that settles as TCP gets the flag of the view. So
/// is an accepted connection being settled while its numbers show its pair.
pub(crate) fn cloexec_managed(s: &Sock) -> bool {
    match s {
        Sock::Smc(_) | Sock::Pending(_) => true,
        Sock::Accepted(a) => a.shows_pair.load(std::sync::atomic::Ordering::Acquire),
        _ => false,
    }
}

/// An SMC-R connection at an application descriptor.
pub(crate) struct SmcFd {
    pub(crate) stream: SmcStream,
    /// The application's O_NONBLOCK.
    pub(crate) nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in microseconds (0: none).
    pub(crate) rcvtimeo_us: AtomicU64,
    pub(crate) sndtimeo_us: AtomicU64,
    /// The connection's readiness as our hooks report it (and the kernel pair, if any).
    pub(crate) pair: Arc<Pair>,
    /// What the application wrote before the connection was settled, not sent yet: it goes
    /// before anything written later (the settling worker sends it right after installing
    /// the connection; a write that comes first sends it itself).
    preamble: Mutex<Vec<u8>>,
    /// The preamble is sent (the usual case: no lock on the way to a send).
    preamble_sent: AtomicBool,
    /// Holds writability back until the preamble is sent.
    pub(crate) gate: Arc<crate::pair::Gate>,
    /// A shutdown of writing asked for while the preamble was still going: done right after
    /// it (once: whoever swaps it out does it).
    shut_after: AtomicBool,
}

impl SmcFd {
    /// Sends the preamble, if any is left: all of it, waiting as `how` says (as a send
    /// waits for room: without end, or until SO_SNDTIMEO), or what fits now (else
    /// WouldBlock while some is left).
    pub(crate) fn flush_preamble(&self, how: Blocking) -> io::Result<()> {
        if self.preamble_sent.load(Ordering::Acquire) {
            return Ok(());
        }
        let until = Until::new(how);
        let busy = || io::Error::from(io::ErrorKind::WouldBlock);
        let mut p = match how {
            Blocking::No => self.preamble.try_lock().ok_or_else(busy)?,
            Blocking::Yes(None) => self.preamble.lock(),
            Blocking::Yes(Some(t)) => self.preamble.try_lock_for(t).ok_or_else(busy)?,
        };
        while !p.is_empty() {
            let how = until.left().ok_or_else(busy)?;
            let n = match self.stream.send(&p, Blocking::No) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && how != Blocking::No => {
                    // It waits for room: the application sees the connection not writable
                    // until it is out (see `Gate`).
                    self.gate.close(&self.pair);
                    self.stream.send(&p, how)?
                }
                r => r?,
            };
            p.drain(..n);
        }
        // SeqCst with `shutdown`'s: one of the two sees the other's flag (Dekker), so the
        // queued end of writing is done exactly once.
        self.preamble_sent.store(true, Ordering::SeqCst);
        drop(p);
        self.gate.open(&self.pair);
        if self.shut_after.swap(false, Ordering::SeqCst) {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }

    /// The application's shutdown: at once, but the end of writing waits (without blocking
    /// the caller) for a preamble still going, as TCP queues its FIN after the data.
    pub(crate) fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        use std::net::Shutdown;
        if self.preamble_sent.load(Ordering::SeqCst) || how == Shutdown::Read {
            return self.stream.shutdown(how);
        }
        if how == Shutdown::Both {
            self.stream.shutdown(Shutdown::Read)?;
        }
        self.shut_after.store(true, Ordering::SeqCst);
        // Sent meanwhile: then it is ours to do (exactly once).
        if self.preamble_sent.load(Ordering::SeqCst)
            && self.shut_after.swap(false, Ordering::SeqCst)
        {
            return self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    fn blocking(&self, dontwait: bool, timeo: &AtomicU64) -> Blocking {
        if dontwait || self.nonblock.load(Ordering::Relaxed) {
            Blocking::No
        } else {
            match timeo.load(Ordering::Relaxed) {
                0 => Blocking::Yes(None),
                us => Blocking::Yes(Some(Duration::from_micros(us))),
            }
        }
    }

    pub(crate) fn recv(&self, buf: &mut [u8], flags: i32) -> io::Result<usize> {
        let r = self.recv_inner(buf, flags);
        self.collect(r)
    }

    fn recv_inner(&self, buf: &mut [u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.rcvtimeo_us);
        let peek = flags & libc::MSG_PEEK != 0;
        if flags & libc::MSG_WAITALL != 0 && !peek {
            // Until the buffer is full, EOF, or an error or the timeout after some data; one
            // SO_RCVTIMEO bounds the whole call, as for TCP.
            let until = Until::new(how);
            let mut got = 0;
            while got < buf.len() {
                let Some(how) = until.left() else { break };
                match self.stream.recv(&mut buf[got..], false, how) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(_) if got > 0 => break,
                    Err(e) => return Err(e),
                }
            }
            return if got == 0 && !buf.is_empty() && until.left().is_none() {
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                Ok(got)
            };
        }
        self.stream.recv(buf, peek, how)
    }

    /// A blocking send takes all of `buf` (TCP returns short only on SO_SNDTIMEO, a signal or
    /// an error after some bytes); a non-blocking one what fits.
    fn send_all(&self, buf: &[u8], how: Blocking) -> io::Result<usize> {
        if matches!(how, Blocking::No) {
            return self.stream.send(buf, how);
        }
        let until = Until::new(how);
        let mut done = 0;
        while done < buf.len() {
            let Some(how) = until.left() else { break };
            match self.stream.send(&buf[done..], how) {
                Ok(n) => done += n,
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            }
        }
        if done == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(done)
    }

    /// A reset reported to the application is collected: the socket stops showing EPOLLERR.
    fn collect<T>(&self, r: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &r
            && e.kind() == io::ErrorKind::ConnectionReset
        {
            self.pair.take_error();
        }
        r
    }

    pub(crate) fn send(&self, buf: &[u8], flags: i32) -> io::Result<usize> {
        let how = self.blocking(flags & libc::MSG_DONTWAIT != 0, &self.sndtimeo_us);
        let r = self
            .flush_preamble(how)
            .and_then(|()| self.send_all(buf, how));
        let r = self.collect(r);
        if let Err(e) = &r
            && e.kind() == io::ErrorKind::BrokenPipe
            && flags & libc::MSG_NOSIGNAL == 0
        {
            // As a socket would: SIGPIPE unless MSG_NOSIGNAL (the default action ends the
            // program, as it would with TCP).
            // SAFETY: raise has no preconditions.
            unsafe { libc::raise(libc::SIGPIPE) };
        }
        r
    }
}

/// One deadline for a whole blocking call made of several waits.
struct Until(Option<Option<Instant>>);

impl Until {
    fn new(how: Blocking) -> Self {
        Self(match how {
            Blocking::No => None,
            Blocking::Yes(t) => Some(t.map(|t| Instant::now() + t)),
        })
    }

    /// How the next wait may block; `None` once the deadline passed.
    fn left(&self) -> Option<Blocking> {
        match self.0 {
            None => Some(Blocking::No),
            Some(None) => Some(Blocking::Yes(None)),
            Some(Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                (!left.is_zero()).then_some(Blocking::Yes(Some(left)))
            }
        }
    }
}

/// An SMC-R connection to show through `pair`.
pub(crate) fn smc_fd(
    stream: SmcStream,
    nonblock: bool,
    pair: Arc<Pair>,
    preamble: Vec<u8>,
) -> Arc<Sock> {
    // Timeouts the application set before the connection was ours (kept by the socket).
    let timeo = |name| {
        // SAFETY: an all-zero timeval is valid; the kernel fills at most `len` bytes.
        let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
        // SAFETY: reading a timeval option of our socket.
        let r = unsafe {
            real::getsockopt()(
                stream.tcp().as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&raw mut tv).cast(),
                &mut len,
            )
        };
        if r == 0 {
            tv.tv_sec.max(0) as u64 * 1_000_000 + tv.tv_usec.max(0) as u64
        } else {
            0
        }
    };
    let (rcv, snd) = (timeo(libc::SO_RCVTIMEO), timeo(libc::SO_SNDTIMEO));
    Arc::new(Sock::Smc(SmcFd {
        stream,
        nonblock: AtomicBool::new(nonblock),
        rcvtimeo_us: AtomicU64::new(rcv),
        sndtimeo_us: AtomicU64::new(snd),
        pair,
        preamble_sent: AtomicBool::new(preamble.is_empty()),
        gate: crate::pair::Gate::new(),
        preamble: Mutex::new(preamble),
        shut_after: AtomicBool::new(false),
    }))
}

/// A marked listening socket: at the application's number, shared by every process that
/// holds it. Accepting needs nothing of ours but the option program's verdict per connection.
pub(crate) struct Listener {
    /// Its row in the stats area of the process that listened (`smc-stat -l`), until that
    /// process closes it.
    pub(crate) stat: Mutex<Option<smcr::ListenerRecord>>,
    /// The address it is bound to (`0.0.0.0`/`::` for every address).
    pub(crate) bound: Option<SocketAddr>,
    /// Made quiet before it went to a program that cannot negotiate (`shim::handing_off`):
    /// what this process still accepts on it is plain TCP (HANDOFF).
    pub(crate) handed_off: std::sync::atomic::AtomicBool,
}

impl Listener {
    /// The application closed the listener in the process that made the entry.
    pub(crate) fn close(&self) {
        self.stat.lock().take();
    }
}
