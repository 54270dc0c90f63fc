//! `SmcListener`: a listening socket whose accepted connections negotiate SMC-R off the
//! accepting thread.

#[allow(unused_imports)]
use super::*;

/// What the acceptor does after a failed `accept`.
#[derive(Debug, PartialEq)]
enum AcceptError {
    /// At once: a signal, or a connection that went before it was taken.
    Retry,
    /// After a pause: the process or system is out of descriptors or memory.
    Later,
    /// Never again: the listener was shut down or is not a listener.
    Stop,
}

fn accept_error(e: &io::Error) -> AcceptError {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptError::Later,
        Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT) => {
            AcceptError::Stop
        }
        // EINTR, ECONNABORTED, EPROTO, EPERM (a firewall rule), and the pending network
        // errors accept(2) may pass on: that connection is lost, the listener is fine.
        _ => AcceptError::Retry,
    }
}

type Deliver = Arc<dyn Fn(SmcStream, SocketAddr) + Send + Sync>;

/// An accepted connection waiting for the thread that negotiates it (taken once).
type Pending = Arc<rdma::locks::Mutex<Option<(TcpStream, SocketAddr)>>>;

/// Negotiates the server side of the connection in `job` (if no one took it) and delivers it.
fn handshake(rt: &Runtime, deliver: &Deliver, job: &Pending) {
    let taken = job.lock().take();
    if let Some((tcp, peer)) = taken
        && let Ok(s) = SmcStream::negotiate_server(rt, tcp, peer)
    {
        deliver(s, peer);
    }
}

/// A listening socket's background acceptor: takes TCP connections, negotiates each on a
/// thread of its own and hands the finished streams to `deliver`. Stops when dropped.
pub(crate) struct Acceptor {
    local: SocketAddr,
    /// A duplicate of the listening socket, to wake the acceptor with shutdown() on drop.
    wake: TcpListener,
    _stat: Option<ListenerRecord>,
}

impl Acceptor {
    /// Binds and listens on the first of `addrs` that can be bound (marked for the SMC-R
    /// option); every negotiated connection goes to `deliver`.
    pub(crate) fn spawn(
        rt: &Runtime,
        addrs: impl ToSocketAddrs,
        deliver: impl Fn(SmcStream, SocketAddr) + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to bind to");
        for addr in addrs.to_socket_addrs()? {
            match Self::listen(rt, addr) {
                Ok(tcp) => return Self::run(rt, tcp, Arc::new(deliver)),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn listen(rt: &Runtime, addr: SocketAddr) -> io::Result<TcpListener> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        // A dual-stack [::] listener serves IPv4 peers through v4-mapped addresses: marked too
        // (a native IPv6 peer's connection falls back, NOTIPV4).
        if addr.is_ipv4() || matches!(addr, SocketAddr::V6(a) if !a.ip().is_loopback()) {
            mark(rt, &sock, false);
        }
        sock.bind(&addr.into())?;
        sock.listen(1024)?;
        Ok(sock.into())
    }

    fn run(
        rt: &Runtime,
        tcp: TcpListener,
        deliver: Arc<dyn Fn(SmcStream, SocketAddr) + Send + Sync>,
    ) -> io::Result<Self> {
        let local = tcp.local_addr()?;
        let wake = tcp.try_clone()?;
        let stat = rt.listener_record(local);
        let rt = rt.clone();
        rdma::thread::spawn("smcr-accept".into(), move || {
            loop {
                let (tcp, peer) = match tcp.accept() {
                    Ok(x) => x,
                    Err(e) => match accept_error(&e) {
                        AcceptError::Retry => continue,
                        // Out of descriptors or memory: the connection waits in the kernel's
                        // backlog (as it would for a TCP server) until some are freed.
                        AcceptError::Later => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        // The listener was shut down (dropped) or is broken.
                        AcceptError::Stop => return,
                    },
                };
                // On a thread of its own; without one (a program that forbids new threads, no
                // spare left) here, rather than dropping the connection.
                let job = Arc::new(rdma::locks::Mutex::new(Some((tcp, peer))));
                let (theirs, rt2, deliver2) = (job.clone(), rt.clone(), deliver.clone());
                let spawned = rdma::thread::spawn("smcr-handshake".into(), move || {
                    handshake(&rt2, &deliver2, &theirs)
                });
                if spawned.is_err() {
                    handshake(&rt, &deliver, &job);
                }
            }
        })?;
        Ok(Self {
            local,
            wake,
            _stat: stat,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The listening socket (the duplicate `wake`).
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.wake.as_fd()
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid listening socket; SHUT_RD makes the blocked accept() return.
        unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RD) };
    }
}

impl SmcListener {
    /// Binds and listens on `addr` (the first of its addresses that can be bound), marked
    /// for the SMC-R option.
    pub fn bind(rt: &Runtime, addr: impl ToSocketAddrs) -> io::Result<Self> {
        let (tx, ready) = std::sync::mpsc::channel();
        let acceptor = Acceptor::spawn(rt, addr, move |s, peer| {
            let _ = tx.send((s, peer));
        })?;
        Ok(Self {
            acceptor,
            ready: rdma::locks::Mutex::new(ready),
            nonblocking: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.acceptor.local_addr())
    }

    /// Non-blocking mode: `accept` fails with `WouldBlock` when no connection is ready.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The next connection whose negotiation has finished.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        if self.nonblocking.load(std::sync::atomic::Ordering::Relaxed) {
            self.ready.lock().try_recv().map_err(|e| match e {
                std::sync::mpsc::TryRecvError::Empty => io::ErrorKind::WouldBlock.into(),
                std::sync::mpsc::TryRecvError::Disconnected => {
                    io::Error::other("the listener's acceptor stopped")
                }
            })
        } else {
            self.ready
                .lock()
                .recv()
                .map_err(|_| io::Error::other("the listener's acceptor stopped"))
        }
    }

    /// An iterator over the connections as they are accepted, like
    /// [`TcpListener::incoming`]: it never ends (each item is [`Self::accept`]'s result
    /// without the peer address).
    pub fn incoming(&self) -> Incoming<'_> {
        Incoming { listener: self }
    }
}

/// The iterator of [`SmcListener::incoming`].
#[derive(Debug)]
pub struct Incoming<'a> {
    listener: &'a SmcListener,
}

impl Iterator for Incoming<'_> {
    type Item = io::Result<SmcStream>;

    fn next(&mut self) -> Option<io::Result<SmcStream>> {
        Some(self.listener.accept().map(|(s, _)| s))
    }
}

impl std::fmt::Debug for SmcListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmcListener")
            .field("local", &self.acceptor.local_addr())
            .field(
                "nonblocking",
                &self.nonblocking.load(std::sync::atomic::Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl std::os::fd::AsFd for SmcListener {
    /// The listening TCP socket's descriptor (a duplicate of the one the background acceptor
    /// accepts on): for socket options.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.acceptor.fd()
    }
}

impl std::os::fd::AsRawFd for SmcListener {
    /// The listening TCP socket's descriptor (see [`AsFd`](std::os::fd::AsFd)).
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.acceptor.fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_acceptor_outlives_what_accept_can_report_for_one_connection_or_a_shortage() {
        let e = |n| io::Error::from_raw_os_error(n);
        for n in [
            libc::EINTR,
            libc::ECONNABORTED,
            libc::EPROTO,
            libc::EPERM,
            libc::ETIMEDOUT,
        ] {
            assert_eq!(accept_error(&e(n)), AcceptError::Retry, "{n}");
        }
        for n in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert_eq!(accept_error(&e(n)), AcceptError::Later, "{n}");
        }
        for n in [libc::EINVAL, libc::EBADF, libc::ENOTSOCK] {
            assert_eq!(accept_error(&e(n)), AcceptError::Stop, "{n}");
        }
    }
}
