//! tokio versions of the streams (feature `tokio`): [`AsyncSmcStream`] implements
//! `AsyncRead`/`AsyncWrite`. An SMC-R stream registers its two readiness eventfds (one for
//! readers, one for writers, each readable at every state change) with tokio's reactor and runs
//! the ordinary non-blocking operations; a stream that fell back is a plain
//! `tokio::net::TcpStream`. Negotiation itself (TCP handshake, CLC, link setup) runs on tokio's
//! blocking pool.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::{Mode, Runtime, SmcListener, SmcStream};

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
    /// Connects and negotiates like [`SmcStream::connect`].
    pub async fn connect(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        let rt = rt.clone();
        let s = tokio::task::spawn_blocking(move || SmcStream::connect(&rt, addr))
            .await
            .map_err(io::Error::other)??;
        Self::from_std(s)
    }

    /// Wraps a negotiated stream (must be called inside a tokio runtime).
    pub fn from_std(mut s: SmcStream) -> io::Result<Self> {
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

/// An [`SmcListener`] for tokio.
pub struct AsyncSmcListener {
    inner: std::sync::Arc<SmcListener>,
}

impl AsyncSmcListener {
    /// Binds like [`SmcListener::bind`].
    pub fn bind(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        Ok(Self {
            inner: std::sync::Arc::new(SmcListener::bind(rt, addr)?),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The next negotiated connection.
    pub async fn accept(&self) -> io::Result<(AsyncSmcStream, SocketAddr)> {
        let l = self.inner.clone();
        let (s, peer) = tokio::task::spawn_blocking(move || l.accept())
            .await
            .map_err(io::Error::other)??;
        Ok((AsyncSmcStream::from_std(s)?, peer))
    }
}
