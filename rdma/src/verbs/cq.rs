//! [`CompletionQueue`]: completions of our engine's queue pairs or of a verbs device's.

#[allow(unused_imports)]
use super::*;

/// A completion queue. Poll it with [`Self::poll`]; to sleep until completions arrive, call
/// [`Self::req_notify`], poll once more, then wait for [`Self::fd`] to become readable (or just
/// call [`Self::wait`]).
pub struct CompletionQueue(pub(super) CqKind);

pub(super) enum CqKind {
    Engine {
        shared: Arc<CqShared>,
        guard: Arc<EngineGuard>,
    },
    Verbs(Arc<VerbsCq>),
    Mem(Arc<MemCq>),
}

impl CompletionQueue {
    /// Takes up to `out.len()` completions (`ibv_poll_cq`).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.poll(out),
            CqKind::Mem(m) => return m.poll(out),
        };
        guard.shared.shm_poll(shared);
        let mut q = shared.queue.lock();
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        n
    }

    /// Arms the notification: the next completion makes [`Self::fd`] readable
    /// (`ibv_req_notify_cq`).
    pub fn req_notify(&self) {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.req_notify(),
            CqKind::Mem(m) => return m.sig.req_notify(|| m.has_completions()),
        };
        shared.notify.arm();
        // Same-host producers write the eventfd only for a consumer that says it sleeps.
        guard.shared.shm_sleepers(shared, |s| s.notify = true);
    }

    /// The notification file descriptor, for poll/epoll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.0 {
            CqKind::Engine { shared, .. } => shared.event.as_fd(),
            CqKind::Verbs(v) => v.fd(),
            CqKind::Mem(m) => m.sig.fd(),
        }
    }

    /// Clears the notification fd after it fired (`ibv_get_cq_event` + `ibv_ack_cq_events`).
    pub fn ack_events(&self) {
        let (shared, guard) = match &self.0 {
            CqKind::Engine { shared, guard } => (shared, guard),
            CqKind::Verbs(v) => return v.ack_events(),
            CqKind::Mem(m) => return m.sig.ack_events(),
        };
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&shared.event, &mut b);
        guard.shared.shm_sleepers(shared, |s| s.notify = false);
    }

    /// The scheduling of this CQ's completions among threads: smcr's extension, apart from
    /// the verbs (see [`CqScheduler`]).
    pub fn scheduler(&self) -> CqScheduler {
        CqScheduler(match &self.0 {
            CqKind::Engine { shared, guard } => SchedKind::Engine(EngineSched {
                shared: shared.clone(),
                guard: guard.clone(),
            }),
            CqKind::Verbs(v) => SchedKind::Verbs(v.clone()),
            CqKind::Mem(m) => SchedKind::Mem(m.clone()),
        })
    }

    /// Polls, sleeping until at least one completion arrives or `timeout` passes. While it
    /// sleeps, the calling thread receives and handles the device's packets itself when no other
    /// thread does (so no hand-off between threads is paid per completion).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> io::Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(0);
            }
            match &self.0 {
                CqKind::Engine { shared, guard } => guard.shared.wait_cq(shared, left)?,
                CqKind::Verbs(v) => v.sleep(left)?,
                CqKind::Mem(m) => m.sig.sleep(left)?,
            }
        }
    }
}
