//! What happens to a socket of ours, call by call. The hooks (`hooks`) only decide whether a
//! descriptor is ours and translate arguments; the SMC-R work is `smcr`'s.
//!
//! The application's number always holds the real TCP socket (a connected one, or the
//! listening one): `fstat`, socket options, addresses, `fork` and `exec` see what they would
//! without us. What makes a connection SMC-R is our table entry for the number; our own
//! duplicate of the TCP socket lives out of the application's numbers (`smcr::fdzone`), one
//! descriptor per connection. Readiness is answered by our poll, select and epoll hooks from
//! the connection's state; only when the kernel itself must answer for the socket (an epoll
//! set that is polled or nested, `SMCR_VIRTUAL_EPOLL=off`) does the number get a socketpair
//! end whose readiness we set (`Pair`).
//!
//! Life of a socket:
//! * `socket(AF_INET or AF_INET6, SOCK_STREAM)` → `Sock::Inet`.
//! * `connect`: our duplicate is taken first (no room: the socket stays unmarked, plain TCP
//!   with NOFD), then the socket is marked for the TCP option and connected. The call returns
//!   as TCP's does (a blocking one once the TCP handshake is done, a non-blocking one with
//!   EINPROGRESS); `Sock::Pending` while a worker negotiates: writes are staged, reads wait
//!   for the outcome. The server's half may run only once its program uses the connection
//!   (see `accept`), which may be after this program made other connections or, for a
//!   listener of this very program, accepted this one.
//! * `listen`: marked first; the socket stays at the application's number and listens as
//!   usual (`Sock::Listener`), in this process and in every process that inherits it
//!   (prefork servers: each worker accepts on it itself).
//! * `accept` (in whichever process calls it): the kernel's connection is returned at once.
//!   A peer that sent no SMC-R option is plain TCP from then on. One that did becomes
//!   `Sock::Accepted`: the server side of the CLC handshake runs in the process that first
//!   uses the socket (reads, writes, waits on it) — the accepting process, or the child it
//!   forked for the connection (PostgreSQL, inetd-style servers) — so that the process using
//!   the connection owns its SMC-R state. A connection several processes hold at that moment
//!   stays TCP (SHARED), settled before any byte of the application's.
//! * Whichever process settles a connection records it in the socket's option record
//!   (`smcr::option::Claim`), so every other holder learns it from the socket itself.
//!
//! Where it is: the types a number of ours holds — `Sock` and the SMC-R connection (`SmcFd`),
//! a connection not settled yet (`Settling`), all in `sock`, and their readiness (`Pair`,
//! `pair`) — sit below the table and know nothing of the paths that make them, which are
//! here: `connect` (a connect of ours), `accept` (listening and accepting, the server side of
//! the handshake), `outcome` (how a connection being settled ends), `adopt` (sockets inherited
//! through exec), `settling` (making a connection being settled). Below those: `runtime` (the
//! process's runtime, its end, the settings), `numbers` (what the application's numbers show:
//! untracking, close-on-exec, O_NONBLOCK) and `fork` (fork tracking). Below this module: the
//! epoll registrations it moves when a number's file changes or a connection settles
//! (`epoll`), the handshake threads (`workers`), the table, and the descriptor helpers
//! (`fds`). This module only re-exports what the hooks use.

mod accept;
mod adopt;
mod connect;
mod fork;
mod handoff;
mod numbers;
mod outcome;
mod reconnect;
pub(crate) mod relay;
mod runtime;
mod settling;

pub(crate) use accept::{accept, listening, mark};
pub(crate) use adopt::{adopt, received};
pub(crate) use connect::{
    ConnectPlan, connect_async, connecting, debug_pause, plain_connect, plan_connect,
};
pub(crate) use fork::{forked, forked_child};
pub(crate) use handoff::{handing_off, library_in, prepare as prepare_handoff, sending};
pub(crate) use numbers::{exclude, set_nonblock, tcp_fd, unsupported_option, untrack};
pub(crate) use runtime::{
    at_exit, before_chroot, before_exec, enabled, exec_failed, init_settings, locking_down,
    policy_allows,
};

/// Before a fork: the forking thread takes the shim's process-wide locks (see `forkhold`;
/// none of them is taken while another is held).
pub(crate) fn hold_for_fork() {
    connect::hold_for_fork();
    fork::hold_for_fork();
    runtime::hold_for_fork();
}
