//! A link group's bookkeeping, sans-IO: its connections by alert token, tokens promised in an
//! Accept whose CDCs must wait for the connection, the SEND slots the link's LLC and CDC
//! messages go out of (with the poller's reserve and which connection each data CDC belongs
//! to), and the linger timer that deletes an idle group. Generic over the connection handle `C`
//! so it is tested without queue pairs; the driver (`runtime`) holds it under the group's lock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cdc::CdcMessage;

/// Where a received CDC goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Route<C> {
    /// To this connection.
    Conn(C),
    /// Held for a connection whose handshake is finishing. Linux registers the token before
    /// its Accept goes out (smc_core.c, `smc_conn_create()`), so early CDCs find the
    /// connection; we hold them until it attaches.
    Held,
    /// Unknown token, or the hold queue is full: dropped (Linux drops these too: smc_cdc.c,
    /// `smc_cdc_rx_handler()`).
    Dropped,
}

/// What [`LgrCore::take_slot`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// This slot is now in use.
    Got(usize),
    /// None free beyond the poller's reserve: an application thread waits for a completion
    /// (as process context waits in smc_wr.c, `smc_wr_tx_get_free_slot()`).
    Wait,
}

/// The bookkeeping of one link group.
#[derive(Debug)]
pub struct LgrCore<C> {
    max_conns: usize,
    conns: HashMap<u32, C>,
    held: HashMap<u32, Vec<CdcMessage>>,
    max_held: usize,
    idle_since: Option<Instant>,
    linger: Duration,
    free: Vec<usize>,
    owner: Vec<u32>,
    /// Slots handed out and not completed: a completion of a slot not in use (a stray or
    /// repeated one) must not free it a second time, or two messages would share it.
    busy: Vec<bool>,
    reserve: usize,
    needs_flush: Vec<u32>,
}

impl<C: Clone> LgrCore<C> {
    /// A group for up to `max_conns` connections with `slots` SEND slots (`reserve` of them
    /// only for the poller), holding at most `max_held` early CDCs per promised token, deleted
    /// after `linger` without connections (Linux: smc_core.c, `smc_lgr_schedule_free_work()`,
    /// `SMC_LGR_FREE_DELAY_SERV` 600 s, the client's `SMC_LGR_FREE_DELAY_CLNT` 10 s more so the
    /// server's group goes first). It counts as idle from `now` until a connection attaches.
    pub fn new(
        max_conns: usize,
        slots: usize,
        reserve: usize,
        max_held: usize,
        linger: Duration,
        now: Instant,
    ) -> Self {
        Self {
            max_conns,
            conns: HashMap::new(),
            held: HashMap::new(),
            max_held,
            idle_since: Some(now),
            linger,
            free: (0..slots).rev().collect(),
            owner: vec![0; slots],
            busy: vec![false; slots],
            reserve,
            needs_flush: Vec::new(),
        }
    }

    /// Connections attached.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// No connection attached.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Whether another connection may join (attached plus promised below `max_conns`; Linux's
    /// server checks `max_conns` and `SMC_RMBS_PER_LGR_MAX`, 255, in smc_core.c,
    /// `smc_conn_create()`, its client neither).
    pub fn has_room(&self) -> bool {
        self.conns.len() + self.held.len() < self.max_conns
    }

    /// Changes the limit (negotiated when the link starts).
    pub fn set_max_conns(&mut self, n: usize) {
        self.max_conns = n.max(1);
    }

    /// A token is about to go out in an Accept: CDCs for it are held until it attaches.
    pub fn promise(&mut self, token: u32) {
        self.held.insert(token, Vec::new());
    }

    /// The handshake behind a promised token failed.
    pub fn unpromise(&mut self, token: u32) {
        self.held.remove(&token);
    }

    /// Attaches a connection (which stops the linger, as `smc_conn_create()` cancels the free
    /// work); returns the CDCs held for it, in arrival order.
    pub fn attach(&mut self, token: u32, c: C) -> Vec<CdcMessage> {
        self.conns.insert(token, c);
        self.idle_since = None;
        self.held.remove(&token).unwrap_or_default()
    }

    /// Detaches a connection; the group turns idle when it was the last (smc_core.c,
    /// `smc_conn_free()`).
    pub fn detach(&mut self, token: u32, now: Instant) -> Option<C> {
        let c = self.conns.remove(&token);
        if self.conns.is_empty() && self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
        c
    }

    /// Removes every connection (the link went down).
    pub fn drain(&mut self) -> Vec<C> {
        self.held.clear();
        self.conns.drain().map(|(_, c)| c).collect()
    }

    /// Every attached connection.
    pub fn conns(&self) -> Vec<C> {
        self.conns.values().cloned().collect()
    }

    /// The connection a received CDC is for.
    pub fn route(&mut self, m: CdcMessage) -> Route<C> {
        if let Some(c) = self.conns.get(&m.token) {
            return Route::Conn(c.clone());
        }
        match self.held.get_mut(&m.token) {
            Some(q) if q.len() < self.max_held => {
                q.push(m);
                Route::Held
            }
            _ => Route::Dropped,
        }
    }

    /// The connection with `token`.
    pub fn get(&self, token: u32) -> Option<&C> {
        self.conns.get(&token)
    }

    /// When the linger timer will delete the group, if it runs (no connections, nothing held).
    pub fn linger_deadline(&self) -> Option<Instant> {
        if !self.conns.is_empty() || !self.held.is_empty() {
            return None;
        }
        self.idle_since.map(|t| t + self.linger)
    }

    /// Whether the idle group's linger time is over (nothing attached or promised).
    pub fn linger_expired(&self, now: Instant) -> bool {
        self.conns.is_empty()
            && self.held.is_empty()
            && self.idle_since.is_some_and(|t| now >= t + self.linger)
    }

    /// A SEND slot; the poller may use the reserve, application threads may not.
    pub fn take_slot(&mut self, poller: bool) -> Slot {
        let keep = if poller { 0 } else { self.reserve };
        if self.free.len() > keep {
            let s = self.free.pop().expect("checked");
            self.owner[s] = 0;
            self.busy[s] = true;
            Slot::Got(s)
        } else {
            Slot::Wait
        }
    }

    /// A slot for the poller's LLC messages, without touching the bookkeeping of owners.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Records that `slot` carries a data CDC of connection `token`.
    pub fn set_owner(&mut self, slot: usize, token: u32) {
        self.owner[slot] = token;
    }

    /// A SEND completed: frees its slot and returns the connection whose data CDC it was (its
    /// completion handler, smc_cdc.c, `smc_cdc_tx_handler()`).
    pub fn complete(&mut self, slot: usize) -> Option<C> {
        if !std::mem::take(self.busy.get_mut(slot)?) {
            return None;
        }
        let owner = std::mem::take(&mut self.owner[slot]);
        self.free.push(slot);
        (owner != 0)
            .then(|| self.conns.get(&owner).cloned())
            .flatten()
    }

    /// Returns a slot taken but not used.
    pub fn put_back(&mut self, slot: usize) {
        if self.busy.get_mut(slot).is_some_and(std::mem::take) {
            self.owner[slot] = 0;
            self.free.push(slot);
        }
    }

    /// A connection's corked data waits for a slot the poller could not get (Linux queues the
    /// connection's `tx_work` with `SMC_TX_WORK_DELAY`, 0: smc_tx.c, `smcr_tx_sndbuf_nonempty()`).
    pub fn defer_flush(&mut self, token: u32) {
        if !self.needs_flush.contains(&token) {
            self.needs_flush.push(token);
        }
    }

    /// The connections whose corked data should be retried now.
    pub fn take_deferred(&mut self) -> Vec<C> {
        let tokens = std::mem::take(&mut self.needs_flush);
        tokens
            .iter()
            .filter_map(|t| self.conns.get(t).cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cdc::{ConnStateFlags, Cursor, ProducerFlags};

    fn cdc(token: u32, seq: u16) -> CdcMessage {
        CdcMessage {
            seq,
            token,
            prod: Cursor::default(),
            cons: Cursor::default(),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        }
    }

    fn core(now: Instant) -> LgrCore<&'static str> {
        LgrCore::new(2, 4, 1, 2, Duration::from_secs(600), now)
    }

    #[test]
    fn cdcs_for_promised_tokens_wait_for_the_connection() {
        let now = Instant::now();
        let mut g = core(now);
        g.promise(7);
        assert_eq!(g.route(cdc(7, 1)), Route::Held);
        assert_eq!(g.route(cdc(7, 2)), Route::Held);
        assert_eq!(g.route(cdc(7, 3)), Route::Dropped, "hold queue is bounded");
        assert_eq!(g.route(cdc(8, 1)), Route::Dropped, "unknown token");
        let held = g.attach(7, "seven");
        assert_eq!(held.iter().map(|m| m.seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(g.route(cdc(7, 4)), Route::Conn("seven"));
        // A failed handshake forgets its promise.
        g.promise(9);
        g.unpromise(9);
        assert_eq!(g.route(cdc(9, 1)), Route::Dropped);
    }

    #[test]
    fn room_counts_attached_and_promised() {
        let now = Instant::now();
        let mut g = core(now);
        g.attach(1, "a");
        assert!(g.has_room());
        g.promise(2);
        assert!(!g.has_room());
        g.unpromise(2);
        g.set_max_conns(1);
        assert!(!g.has_room());
    }

    #[test]
    fn linger_starts_when_the_last_connection_leaves() {
        let t0 = Instant::now();
        let linger = Duration::from_secs(600);
        let mut g = core(t0);
        // Never used: idle from creation.
        assert!(!g.linger_expired(t0 + linger - Duration::from_secs(1)));
        assert!(g.linger_expired(t0 + linger));
        g.attach(1, "a");
        g.attach(2, "b");
        assert!(!g.linger_expired(t0 + 2 * linger));
        let t1 = t0 + Duration::from_secs(5);
        g.detach(1, t1);
        assert!(!g.linger_expired(t1 + 2 * linger), "one left");
        let t2 = t1 + Duration::from_secs(5);
        assert_eq!(g.detach(2, t2), Some("b"));
        assert!(!g.linger_expired(t2 + linger - Duration::from_secs(1)));
        assert!(g.linger_expired(t2 + linger));
        // A promised token keeps it.
        g.promise(3);
        assert!(!g.linger_expired(t2 + 2 * linger));
    }

    #[test]
    fn slots_reserve_and_owners() {
        let now = Instant::now();
        let mut g = core(now);
        g.attach(5, "five");
        let mut got = Vec::new();
        while let Slot::Got(s) = g.take_slot(false) {
            got.push(s);
        }
        assert_eq!(got.len(), 3, "one of four kept for the poller");
        let Slot::Got(p) = g.take_slot(true) else {
            panic!("the poller gets the reserve")
        };
        assert_eq!(g.take_slot(true), Slot::Wait);
        g.set_owner(got[0], 5);
        assert_eq!(g.complete(got[0]), Some("five"));
        assert_eq!(g.complete(got[1]), None, "not a data CDC");
        g.put_back(p);
        assert_eq!(g.free_slots(), 3);
        assert_eq!(g.complete(99), None, "unknown slot ignored");
        // A slot completed twice (a stray completion) is freed once: never handed out to two.
        assert_eq!(g.complete(got[0]), None);
        g.put_back(p);
        assert_eq!(g.free_slots(), 3);
        g.defer_flush(5);
        g.defer_flush(5);
        g.defer_flush(6);
        assert_eq!(g.take_deferred(), ["five"]);
        assert!(g.take_deferred().is_empty());
        assert_eq!(g.drain(), ["five"]);
        assert!(g.is_empty());
    }
}
