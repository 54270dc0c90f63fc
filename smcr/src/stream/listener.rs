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

impl SmcListener {
    /// Binds and listens on `addr`, marked for the SMC-R option.
    pub fn bind(rt: &Runtime, addr: SocketAddr) -> io::Result<Self> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        // A dual-stack [::] listener serves IPv4 peers through v4-mapped addresses: marked too
        // (a native IPv6 peer's connection falls back, NOTIPV4).
        if addr.is_ipv4() || matches!(addr, SocketAddr::V6(a) if !a.ip().is_loopback()) {
            mark(rt, &sock, false);
        }
        sock.bind(&addr.into())?;
        sock.listen(1024)?;
        let tcp: TcpListener = sock.into();
        let local = tcp.local_addr()?;
        let wake = tcp.try_clone()?;
        let stat = rt.listener_record(local);
        let (tx, ready) = std::sync::mpsc::channel();
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
                let (rt, tx) = (rt.clone(), tx.clone());
                let _ = rdma::thread::spawn("smcr-handshake".into(), move || {
                    if let Ok(s) = SmcStream::negotiate_server(&rt, tcp, peer) {
                        let _ = tx.send((s, peer));
                    }
                });
            }
        })?;
        Ok(Self {
            local,
            wake,
            ready: parking_lot::Mutex::new(ready),
            nonblocking: false,
            _stat: stat,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Non-blocking mode: `accept` fails with `WouldBlock` when no connection is ready.
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }

    /// The next connection whose negotiation has finished.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        if self.nonblocking {
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
}

impl Drop for SmcListener {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid listening socket; SHUT_RD makes the blocked accept() return.
        unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RD) };
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
