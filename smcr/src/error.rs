//! The drivers' errors, typed: why an SMC-R connection failed ([`ConnFailure`]: what its
//! application is told, once, as TCP reports a reset) and why setting one up or running a
//! group's control flow failed ([`SetupError`]). Each maps to an `io::Error` kind in one place
//! (`to_io`, `From`); the group's own reasons are [`GroupDown`].

use std::io;
use std::net::Ipv4Addr;

use crate::conn::ConnError;
use crate::group::GroupDown;

/// Why a connection failed. Every variant reaches the application as `ConnectionReset`
/// (ECONNRESET), the error TCP gives for a connection that broke; the text says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnFailure {
    /// Its link group went down (no link left, deleted by the peer, …).
    #[error(transparent)]
    Group(#[from] GroupDown),
    /// The peer's CDC broke the protocol (cursors beyond the ring or what was written); we
    /// aborted the connection.
    #[error("peer broke the CDC protocol: {0}")]
    Protocol(ConnError),
    /// The peer sent urgent data (MSG_OOB), which we refuse rather than corrupt the stream.
    #[error("the peer sent urgent data (MSG_OOB), which smcr does not support")]
    UrgentData,
    /// Posting the connection's writes or CDCs failed.
    #[error(transparent)]
    Post(PostFailure),
    /// After a failover, the connection could not be moved to the other link.
    #[error("moving to another link: {0}")]
    Move(PostFailure),
    /// Aborted by its owner (the preload, after a panic in a call on it).
    #[error("{0}")]
    Aborted(String),
}

impl ConnFailure {
    /// The error the application gets.
    pub fn to_io(&self) -> io::Error {
        io::Error::new(io::ErrorKind::ConnectionReset, self.to_string())
    }
}

/// Why a connection's message (data with its CDC, a control CDC, or what a failover moves)
/// was not posted. [`Self::NoSlot`] is a wait, not a failure; every other variant fails the
/// connection ([`ConnFailure::Post`], [`ConnFailure::Move`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostFailure {
    /// No SEND slot free for the poller, which must not wait for one: tried again when a
    /// SEND completes.
    #[error("no SEND slot for the poller")]
    NoSlot,
    /// The link group is down.
    #[error(transparent)]
    Group(GroupDown),
    /// The queue pair refused the request.
    #[error("post_send: {0:?}")]
    Refused(rdma::PostError),
    /// A write of more than two pieces (the ring wraps at most once: a bug).
    #[error("a write of more than two pieces")]
    TooManyPieces,
    /// The connection was released; its buffers may serve another connection.
    #[error("the connection is gone")]
    Released,
}

impl From<PostFailure> for io::Error {
    /// The one place a post's failure becomes what a caller of the socket API sees:
    /// `WouldBlock` for a wait, else `ConnectionReset`, as TCP reports a broken connection.
    fn from(e: PostFailure) -> Self {
        let kind = match e {
            PostFailure::NoSlot => io::ErrorKind::WouldBlock,
            _ => io::ErrorKind::ConnectionReset,
        };
        Self::new(kind, e)
    }
}

/// Why a device cannot run a link with a peer: the handshake declines with `NOSMCRDEV`, and
/// the text is what the log and the fallback record say.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// The device on `ip` is local-only (another process owns the RoCE port, steering is not
    /// attached) and the peer is on another host.
    #[error("{}", crate::steer::local_only_diagnosis(*ip))]
    LocalOnly {
        /// The device's address.
        ip: Ipv4Addr,
    },
    /// As [`Self::LocalOnly`], with the same-host transport turned off.
    #[error(
        "{} (and the same-host transport is off: SMCR_SAME_HOST=off)",
        crate::steer::local_only_diagnosis(*ip)
    )]
    SameHostOff {
        /// The device's address.
        ip: Ipv4Addr,
    },
    /// The device is local-only and the peer on this host runs as another user, whom shared
    /// memory does not serve.
    #[error(
        "{}; the peer runs as another user (uid {uid}) and shared memory only serves processes of one user",
        crate::steer::local_only_diagnosis(*ip)
    )]
    OtherUser {
        /// The device's address.
        ip: Ipv4Addr,
        /// The peer's user.
        uid: u32,
    },
}

/// Why setting a connection up (the CLC driver, the link, an rkey flow) or a group's control
/// flow failed. The texts are those the drivers always gave.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The CLC handshake failed (timeout, the peer closed, a malformed or unexpected message).
    #[error(transparent)]
    Handshake(#[from] crate::handshake::Error),
    /// A handshake step was called out of order (a bug).
    #[error(transparent)]
    State(#[from] crate::handshake::StateError),
    /// The handshake produced an event this step cannot use (a bug, or a peer out of order).
    #[error("unexpected {0}")]
    Unexpected(String),
    /// The handshake neither wants bytes nor has an event.
    #[error("CLC handshake stalled")]
    Stalled,
    /// Setting a queue pair up failed (`what`: the step).
    #[error("{0}")]
    QueuePair(String),
    /// The peer's GID is not an IPv4-mapped address (RoCE v2 over IPv4 only).
    #[error("peer GID is not IPv4-mapped")]
    PeerGidNotIpv4,
    /// The group has no link yet.
    #[error("link not started")]
    LinkNotStarted,
    /// The first link was not confirmed in time.
    #[error("link not confirmed in time")]
    LinkTimeout,
    /// The peer closed or declined on the TCP connection while the first link came up.
    #[error("the peer closed or declined on the TCP connection while the link came up")]
    PeerGaveUp,
    /// The peer refused our CONFIRM RKEY, or the link gave up waiting for its answer.
    #[error("CONFIRM RKEY refused or unanswered")]
    RkeyRefused,
    /// Our CONFIRM RKEY waited behind others past its bound.
    #[error("CONFIRM RKEY unanswered")]
    RkeyTimeout,
    /// The group went down meanwhile.
    #[error(transparent)]
    Group(#[from] GroupDown),
}

impl From<SetupError> for io::Error {
    fn from(e: SetupError) -> Self {
        use crate::handshake::Error as H;
        let kind = match &e {
            SetupError::Handshake(H::Timeout { .. }) => io::ErrorKind::TimedOut,
            SetupError::Handshake(H::PeerClosed) => io::ErrorKind::ConnectionReset,
            SetupError::Handshake(_) => io::ErrorKind::InvalidData,
            SetupError::LinkTimeout | SetupError::RkeyTimeout => io::ErrorKind::TimedOut,
            SetupError::PeerGaveUp | SetupError::Group(_) => io::ErrorKind::ConnectionAborted,
            _ => io::ErrorKind::Other,
        };
        Self::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::DownReason;

    #[test]
    fn failures_read_as_before_and_reach_the_application_as_resets() {
        let g = ConnFailure::from(GroupDown::Link(DownReason::TestLinkTimeout(
            std::time::Duration::from_secs(2),
        )));
        assert_eq!(g.to_string(), "link down: TEST LINK unanswered for 2s");
        assert_eq!(g.to_io().kind(), io::ErrorKind::ConnectionReset);
        assert!(matches!(g, ConnFailure::Group(GroupDown::Link(_))));
        assert_eq!(
            ConnFailure::Move(PostFailure::Refused(rdma::PostError::QueueFull)).to_string(),
            "moving to another link: post_send: QueueFull"
        );
        let e = ConnFailure::Post(PostFailure::Group(GroupDown::PeerLostPath));
        assert_eq!(e.to_io().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(
            io::Error::from(PostFailure::NoSlot).kind(),
            io::ErrorKind::WouldBlock
        );
        assert_eq!(
            io::Error::from(PostFailure::Released).kind(),
            io::ErrorKind::ConnectionReset
        );
    }

    #[test]
    fn setup_errors_map_to_one_kind_each() {
        let e = |s: SetupError| io::Error::from(s).kind();
        assert_eq!(e(SetupError::LinkTimeout), io::ErrorKind::TimedOut);
        assert_eq!(e(SetupError::PeerGaveUp), io::ErrorKind::ConnectionAborted);
        assert_eq!(
            e(SetupError::Handshake(crate::handshake::Error::PeerClosed)),
            io::ErrorKind::ConnectionReset
        );
        assert_eq!(
            e(SetupError::Group(GroupDown::FirstLinkNotUp)),
            io::ErrorKind::ConnectionAborted
        );
        assert_eq!(e(SetupError::Stalled), io::ErrorKind::Other);
        let typed = io::Error::from(SetupError::RkeyRefused);
        assert!(
            typed
                .get_ref()
                .unwrap()
                .downcast_ref::<SetupError>()
                .is_some()
        );
        assert_eq!(typed.to_string(), "CONFIRM RKEY refused or unanswered");
    }
}
