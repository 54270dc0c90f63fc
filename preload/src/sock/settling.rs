//! A connection whose SMC-R negotiation is not settled yet ([`Settling`]): its phase, what the
//! application staged meanwhile, and the waits on it. The methods that make and settle it live
//! with the paths that do (in `shim`): `new` in `settling`, `start` and the server side in
//! `accept`, `finish` in `outcome`.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Sock;
use crate::pair::Pair;

/// The most a connection being settled takes from writes before it is settled (as a new TCP
/// connection's send buffer takes them before the peer acknowledges anything).
const STAGE_MAX: usize = 64 * 1024;

/// A connection whose SMC-R negotiation is not settled yet: a non-blocking connect finishing
/// on a worker ([`Sock::Pending`]), or an accepted connection negotiated at its first use
/// ([`Sock::Accepted`]). To the application it is a connected TCP socket (once the TCP
/// handshake is done): writes are staged here (up to [`STAGE_MAX`]) and go out, in order,
/// over whatever the connection settles on; reads wait for it (or say EAGAIN).
pub(crate) struct Settling {
    /// Readiness while settling: writable once TCP is connected and while the stage has room,
    /// never readable; carried over to the SMC-R connection.
    pub(crate) pair: Arc<Pair>,
    pub(crate) st: Mutex<Phase>,
    pub(crate) done: Condvar,
    /// The application's O_NONBLOCK (kept by the fcntl and ioctl hooks).
    pub(crate) nonblock: AtomicBool,
    pub(crate) role: Role,
    /// The process whose worker (or reading thread) settles it (once [`State::Running`]): a
    /// child that forked meanwhile holds a copy saying Running with no worker of its own.
    pub(crate) runner: AtomicU32,
    /// The numbers show the pair's kernel end, not the TCP socket ([`Phase::shown`]); read
    /// without the lock by the close-on-exec hooks.
    pub(crate) shows_pair: AtomicBool,
}

pub(crate) struct Phase {
    pub(crate) state: State,
    /// The application shut reading or writing down before the connection was settled: done
    /// once it is (writing: after what was staged).
    pub(crate) shut_rd: bool,
    pub(crate) shut_wr: bool,
    /// What the numbers showing the connection became (`None`: plain TCP, no entry): a number
    /// that copied the settling entry meanwhile (`dup` racing the install) takes it on its next
    /// call.
    pub(crate) settled: Option<Arc<Sock>>,
    /// The TCP handshake is done.
    pub(crate) connected: bool,
    /// What the application wrote before the connection was settled.
    pub(crate) staged: Vec<u8>,
    /// The connection is about to go to a program that cannot negotiate: settled as TCP
    /// (HANDOFF), the peer declined.
    pub(crate) handed_off: bool,
    /// Our duplicate of the TCP socket while the numbers show the pair instead (the kernel
    /// answers for the readiness of a connection being settled: the peer's CLC messages on
    /// the TCP socket would read as data): what socket calls reach meanwhile, and
    /// what the numbers get back if the connection settles as TCP.
    pub(crate) shown: Option<Arc<OwnedFd>>,
    /// The numbers got a new plain connection (`shim::reconnect`): the pair is not shown
    /// again.
    pub(crate) replaced: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum State {
    /// Accepted, not used yet: nothing started.
    Idle,
    Running,
    Done,
}

pub(crate) enum Role {
    Client {
        /// Our address: a listener of this process that accepts the connection negotiates
        /// its side at once (the program may wait on this end before using that one).
        local: Option<SocketAddr>,
    },
    Server {
        /// The process that accepted it, and how many forks it had made by then: a holder
        /// whose pid differs, or that forked since, may share the socket with another
        /// process.
        pid: u32,
        forks: u64,
        /// A native IPv6 peer (dual-stack listener): declined, NOTIPV4.
        native_v6: bool,
    },
}

/// What a write to a connection being settled did.
pub(crate) enum Staged {
    /// Took this many bytes.
    Took(usize),
    /// Settled meanwhile: write where the connection is now.
    Settled,
    /// Full, and the call must not wait.
    WouldBlock,
    /// Writing was shut down (EPIPE).
    Shut,
}

impl Settling {
    /// The local address of a connect being settled (`None` for an accepted connection).
    pub(crate) fn client_local(&self) -> Option<SocketAddr> {
        match self.role {
            Role::Client { local } => local,
            Role::Server { .. } => None,
        }
    }

    /// The application closes a number of this connection: `remove` runs under the lock that
    /// settling takes (see [`Settling::finish`]).
    pub(crate) fn closing(&self, remove: impl FnOnce()) {
        let _st = self.st.lock();
        remove();
    }

    /// Whether settled; then the entry a number that still shows this settling entry gets
    /// (`None`: plain TCP, no entry).
    pub(crate) fn outcome(&self) -> Option<Option<Arc<Sock>>> {
        let st = self.st.lock();
        (st.state == State::Done).then(|| st.settled.clone())
    }

    /// The application shuts the connection down before it is settled: recorded (done once it
    /// is settled, writing after what was staged), `true`; `false` when it is settled already.
    pub(crate) fn shutdown(&self, how: std::net::Shutdown) -> bool {
        use std::net::Shutdown;
        let mut st = self.st.lock();
        if st.state == State::Done {
            return false;
        }
        st.shut_rd |= matches!(how, Shutdown::Read | Shutdown::Both);
        st.shut_wr |= matches!(how, Shutdown::Write | Shutdown::Both);
        if st.shut_wr {
            // No more writes: not writable (EPIPE) from now on, as TCP shows it.
            drop(st);
            self.pair.set(smcr::ReadyState {
                writable: true,
                ..Default::default()
            });
        }
        true
    }

    /// Our duplicate of the TCP socket while the numbers show the pair (see [`Phase::shown`]):
    /// socket calls on the numbers reach it (held for the call).
    pub(crate) fn shown_socket(&self) -> Option<Arc<OwnedFd>> {
        if !self.shows_pair.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        self.st.lock().shown.clone()
    }

    /// An accepted connection whose negotiation has not started.
    pub(crate) fn idle_server(&self) -> bool {
        matches!(self.role, Role::Server { .. }) && self.st.lock().state == State::Idle
    }

    /// Reading was shut down before the connection settled: reads say EOF.
    pub(crate) fn read_shut(&self) -> bool {
        self.st.lock().shut_rd
    }

    /// Waits until settled, at most `limit`; whether it is.
    pub(crate) fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut st = self.st.lock();
        while st.state != State::Done {
            if self.done.wait_until(&mut st, deadline).timed_out() {
                return st.state == State::Done;
            }
        }
        true
    }

    /// Whether the TCP handshake is done (a connect asked again says EISCONN).
    pub(crate) fn tcp_connected(&self) -> bool {
        let st = self.st.lock();
        st.state == State::Done || st.connected
    }

    /// TCP is connected: writable while the stage has room.
    pub(crate) fn connected(&self) {
        let mut st = self.st.lock();
        st.connected = true;
        if st.state != State::Done {
            self.pair.set(smcr::ReadyState {
                writable: st.staged.len() < STAGE_MAX,
                ..Default::default()
            });
        }
    }

    /// The application writes `buf`: staged while there is room. `wait`: a blocking call,
    /// which waits (at most that long: SO_SNDTIMEO) for the connection to settle when the
    /// stage is full.
    pub(crate) fn stage(&self, buf: &[u8], wait: Option<Duration>) -> Staged {
        // (A wait that does not fit an Instant is one without end.)
        let deadline = wait.map(|w| Instant::now().checked_add(w));
        let mut st = self.st.lock();
        loop {
            if st.state == State::Done {
                return Staged::Settled;
            }
            if st.shut_wr {
                return Staged::Shut;
            }
            let room = STAGE_MAX.saturating_sub(st.staged.len());
            if room > 0 && self.pair.latest() & 2 != 0 {
                let n = room.min(buf.len());
                st.staged.extend_from_slice(&buf[..n]);
                if st.staged.len() >= STAGE_MAX {
                    // Full: not writable until it settles.
                    self.pair.set(smcr::ReadyState::default());
                }
                return Staged::Took(n);
            }
            match deadline {
                None => return Staged::WouldBlock,
                Some(None) => self.done.wait(&mut st),
                Some(Some(d)) => {
                    if self.done.wait_until(&mut st, d).timed_out() && st.state != State::Done {
                        return Staged::WouldBlock;
                    }
                }
            }
        }
    }
}
