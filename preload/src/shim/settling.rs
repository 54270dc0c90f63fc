//! Making a connection being settled ([`Settling::new`], the type is `sock`'s): a connect's
//! counts as a negotiation of this process ([`NEGOTIATING`]) from the start, an accepted one
//! only once it starts (`accept`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::{Condvar, Mutex};

use super::runtime::NEGOTIATING;
use crate::pair::Pair;
use crate::sock::{Phase, Role, Settling, State};
use crate::table;

impl Settling {
    pub(super) fn new(role: Role, connected: bool, nonblock: bool) -> Arc<Self> {
        if matches!(role, Role::Client { .. }) {
            NEGOTIATING.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(Self {
            pair: Pair::new(connected),
            st: Mutex::new(Phase {
                state: match role {
                    Role::Client { .. } => State::Running,
                    Role::Server { .. } => State::Idle,
                },
                staged: Vec::new(),
                connected,
                shut_rd: false,
                shut_wr: false,
                settled: None,
                handed_off: false,
                shown: None,
                replaced: false,
            }),
            done: Condvar::new(),
            nonblock: AtomicBool::new(nonblock),
            role,
            runner: AtomicU32::new(table::pid()),
            shows_pair: AtomicBool::new(false),
        })
    }
}
