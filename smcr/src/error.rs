//! Why an SMC-R connection failed, typed: what its application is told (once, as TCP reports
//! a reset) and what a caller can match on. The group's own reasons are [`GroupDown`].

use std::io;

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
    #[error("{0}")]
    Post(String),
    /// After a failover, the connection could not be moved to the other link.
    #[error("moving to another link: {0}")]
    Move(String),
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
            ConnFailure::Move("no SEND slot".into()).to_string(),
            "moving to another link: no SEND slot"
        );
    }
}
