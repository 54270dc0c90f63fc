//! tokio versions of the streams (feature `tokio`): [`AsyncSmcStream`] implements
//! `AsyncRead`/`AsyncWrite`. An SMC-R stream registers its two readiness eventfds (one for
//! readers, one for writers, each readable at every state change) with tokio's reactor and runs
//! the ordinary non-blocking operations; a stream that fell back is a plain
//! `tokio::net::TcpStream`. Negotiation itself (TCP handshake, CLC, link setup) runs off the
//! runtime's worker threads: a client's on tokio's blocking pool, a server's on the listener's
//! handshake threads.
//!
//! [`AsyncSmcListener::accept`] is cancel-safe: the listener's background acceptor puts each
//! negotiated connection into a queue the listener owns, and `accept` only takes from it, so
//! an `accept` future dropped in a `tokio::select!` loses no connection.
//!
//! ```no_run
//! use smcr::tokio::AsyncSmcListener;
//! use smcr::{Runtime, RuntimeConfig};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # async fn run() -> std::io::Result<()> {
//! let rt = Runtime::new(RuntimeConfig::new());
//! let listener = AsyncSmcListener::bind(&rt, "0.0.0.0:7878").await?;
//! loop {
//!     let (mut stream, peer) = listener.accept().await?;
//!     tokio::spawn(async move {
//!         let mut buf = [0u8; 4096];
//!         while let Ok(n) = stream.read(&mut buf).await {
//!             if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
//!                 break;
//!             }
//!         }
//!         eprintln!("{peer} done ({:?})", stream.mode());
//!     });
//! }
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stream::Acceptor;
use crate::{Mode, Runtime, SmcStream};

/// The readiness fd as tokio's reactor sees it (borrowed from the stream, which outlives it).
struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

enum Inner {
    Tcp(tokio::net::TcpStream),
    Smc {
        // Field order: the registrations go before the stream that owns the fds.
        readable: AsyncFd<EventFd>,
        writable: AsyncFd<EventFd>,
        stream: SmcStream,
    },
}

/// An [`SmcStream`] for tokio.
pub struct AsyncSmcStream {
    inner: Inner,
    mode: Mode,
}

impl AsyncSmcStream {
    /// Connects and negotiates like [`SmcStream::connect`]: to the first of `addr`'s
    /// addresses that accepts a TCP connection.
    pub async fn connect(rt: &Runtime, addr: impl tokio::net::ToSocketAddrs) -> io::Result<Self> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in tokio::net::lookup_host(addr).await? {
            let rt = rt.clone();
            match tokio::task::spawn_blocking(move || SmcStream::connect(&rt, a))
                .await
                .map_err(io::Error::other)?
            {
                Ok(s) => return Self::from_std(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Wraps a negotiated stream (must be called inside a tokio runtime).
    pub fn from_std(s: SmcStream) -> io::Result<Self> {
        let mode = s.mode().clone();
        s.set_nonblocking(true)?;
        match s.into_tcp() {
            Ok(tcp) => Ok(Self {
                inner: Inner::Tcp(tokio::net::TcpStream::from_std(tcp)?),
                mode,
            }),
            Err(stream) => {
                let register = |write: bool| -> io::Result<AsyncFd<EventFd>> {
                    let fd = stream.readiness_fd(write)?.as_raw_fd();
                    // SAFETY: the eventfd belongs to the connection, which `stream` keeps
                    // alive; registrations drop before the stream (field order of `Smc`).
                    Ok(unsafe {
                        AsyncFd::register_with_interest(EventFd(fd), tokio::io::Interest::READABLE)
                    }?)
                };
                let (readable, writable) = (register(false)?, register(true)?);
                Ok(Self {
                    inner: Inner::Smc {
                        readable,
                        writable,
                        stream,
                    },
                    mode,
                })
            }
        }
    }

    /// SMC-R or TCP, with the fallback reason.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// The peer's address (of the TCP connection).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Tcp(t) => t.peer_addr(),
            Inner::Smc { stream, .. } => stream.peer_addr(),
        }
    }

    /// Our address (of the TCP connection).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Tcp(t) => t.local_addr(),
            Inner::Smc { stream, .. } => stream.local_addr(),
        }
    }

    /// Sets `TCP_NODELAY`; see [`SmcStream::set_nodelay`] for what it means over SMC-R.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(t) => t.set_nodelay(on),
            Inner::Smc { stream, .. } => stream.set_nodelay(on),
        }
    }

    /// `TCP_NODELAY` of the TCP connection.
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Tcp(t) => t.nodelay(),
            Inner::Smc { stream, .. } => stream.nodelay(),
        }
    }
}

impl std::fmt::Debug for AsyncSmcStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("AsyncSmcStream");
        if let Ok(a) = self.local_addr() {
            d.field("local", &a);
        }
        if let Ok(a) = self.peer_addr() {
            d.field("peer", &a);
        }
        d.field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl AsFd for AsyncSmcStream {
    /// The TCP connection's descriptor (see [`SmcStream`]'s).
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.inner {
            Inner::Tcp(t) => t.as_fd(),
            Inner::Smc { stream, .. } => stream.as_fd(),
        }
    }
}

impl AsRawFd for AsyncSmcStream {
    /// The TCP connection's descriptor.
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

/// Empties the eventfd so the next state change makes it readable again.
fn drain(fd: RawFd) {
    let mut b = [0u8; 8];
    // SAFETY: reading at most 8 bytes into a valid buffer from our non-blocking eventfd.
    unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
}

/// Runs a non-blocking operation until it does not report `WouldBlock`, waiting on the
/// readiness fd in between. Draining before each attempt means a change after the attempt
/// always wakes us again.
fn poll_op<T>(
    ready: &AsyncFd<EventFd>,
    cx: &mut Context<'_>,
    mut op: impl FnMut() -> io::Result<T>,
) -> Poll<io::Result<T>> {
    loop {
        let mut guard = ready!(ready.poll_read_ready(cx))?;
        drain(ready.get_ref().0);
        match op() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
            r => return Poll::Ready(r),
        }
    }
}

impl AsyncRead for AsyncSmcStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Tcp(t) => Pin::new(t).poll_read(cx, buf),
            Inner::Smc {
                readable, stream, ..
            } => {
                let n = ready!(poll_op(readable, cx, || io::Read::read(
                    stream,
                    buf.initialize_unfilled()
                )))?;
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for AsyncSmcStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().inner {
            Inner::Tcp(t) => Pin::new(t).poll_write(cx, data),
            Inner::Smc {
                writable, stream, ..
            } => poll_op(writable, cx, || io::Write::write(stream, data)),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Tcp(t) => Pin::new(t).poll_flush(cx),
            Inner::Smc { stream, .. } => Poll::Ready(io::Write::flush(stream)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Tcp(t) => Pin::new(t).poll_shutdown(cx),
            Inner::Smc { stream, .. } => Poll::Ready(stream.shutdown(std::net::Shutdown::Write)),
        }
    }
}

/// An [`SmcListener`](crate::SmcListener) for tokio.
///
/// Its background acceptor negotiates each connection off the runtime's threads and queues
/// the finished ones; [`accept`](Self::accept) takes the next from that queue.
pub struct AsyncSmcListener {
    /// Field order: the queue's receiver goes first, then the acceptor stops.
    ready: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<(SmcStream, SocketAddr)>>,
    acceptor: Acceptor,
}

impl AsyncSmcListener {
    /// Binds like [`SmcListener::bind`](crate::SmcListener::bind): on the first of `addr`'s
    /// addresses that can be bound.
    pub async fn bind(rt: &Runtime, addr: impl tokio::net::ToSocketAddrs) -> io::Result<Self> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr).await?.collect();
        let (tx, ready) = tokio::sync::mpsc::unbounded_channel();
        let acceptor = Acceptor::spawn(rt, addrs.as_slice(), move |s, peer| {
            // Fails only when the listener is gone: the connection closes.
            let _ = tx.send((s, peer));
        })?;
        Ok(Self {
            ready: tokio::sync::Mutex::new(ready),
            acceptor,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.acceptor.local_addr())
    }

    /// The next negotiated connection (SMC-R or TCP).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: connections wait in the listener's queue until an `accept` takes one,
    /// and taking one cannot be interrupted, so dropping this future (a `tokio::select!`
    /// branch that lost) never loses a connection.
    pub async fn accept(&self) -> io::Result<(AsyncSmcStream, SocketAddr)> {
        // Both awaits are cancel-safe (`Mutex::lock`, `UnboundedReceiver::recv`); after
        // `recv` returns nothing awaits.
        let (s, peer) = self
            .ready
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| io::Error::other("the listener's acceptor stopped"))?;
        Ok((AsyncSmcStream::from_std(s)?, peer))
    }
}

impl AsFd for AsyncSmcListener {
    /// The listening TCP socket's descriptor: for socket options.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.acceptor.fd()
    }
}

impl AsRawFd for AsyncSmcListener {
    /// The listening TCP socket's descriptor.
    fn as_raw_fd(&self) -> RawFd {
        self.acceptor.fd().as_raw_fd()
    }
}

impl std::fmt::Debug for AsyncSmcListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSmcListener")
            .field("local", &self.acceptor.local_addr())
            .finish_non_exhaustive()
    }
}
