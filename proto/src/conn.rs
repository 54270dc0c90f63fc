//! The data path of one SMC-R connection, sans-IO: cursors and flow control on both rings.
//!
//! We write into the peer's RMB with RDMA WRITE and tell it with a CDC message; the peer does
//! the same into ours. [`ConnCore`] keeps the four cursors and decides, exactly as Linux does
//! (wire spec §4.2–§4.4):
//!
//! * how much may be written now ([`ConnCore::space`]), where the bytes go in the peer RMB
//!   (one or two RDMA WRITEs, split at the ring's end) and the CDC that follows them
//!   ([`ConnCore::prepare_write`]), with "writing blocked" set when more data waits than fits
//!   (smc_tx.c, `smc_tx_rdma_writes()`);
//! * what a received CDC means ([`ConnCore::on_cdc`]): stale sequence numbers and backwards
//!   cursors are ignored as Linux ignores them (smc_cdc.c, `smc_cdc_rx_handler()`; smc_cdc.h,
//!   `smc_cdc_cursor_to_host()`); a peer that claims to have written more than our RMB holds,
//!   or to have consumed more than we wrote, is a protocol violation that ends the connection
//!   (our check: Linux takes the cursors as they come);
//! * when reading must return a consumer-cursor update to the peer ([`ConnCore::consume`]):
//!   only when the peer asked, or when enough was consumed (`rmbe_update_limit`) and the peer is
//!   short of space or blocked — no CDC per read (smc_tx.c, `smc_tx_consumer_update()`).

use cdc::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags, seq_before};

/// Linux's `SOCK_MIN_SNDBUF / 2` on x86-64, the floor of `rmbe_update_limit` (smc_core.c,
/// `smc_rmb_wnd_update_limit()`).
pub const MIN_UPDATE_LIMIT: u32 = 2304;

/// Why a peer's CDC ends the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    /// The producer cursor claims more unread data than our RMB holds.
    #[error("peer's producer cursor {prod} overruns our {size}-byte RMB (consumed up to {cons})")]
    ProducerOverrun {
        /// Cursor received.
        prod: Cursor,
        /// Our consumer cursor.
        cons: Cursor,
        /// RMB size.
        size: u32,
    },
    /// The consumer cursor claims the peer read more than we wrote.
    #[error("peer's consumer cursor {cons} is beyond what we wrote ({written})")]
    ConsumerBeyondWritten {
        /// Cursor received.
        cons: Cursor,
        /// Our producer cursor.
        written: Cursor,
    },
    /// A cursor count outside the ring.
    #[error("cursor {0} is outside the ring")]
    CursorOutOfRange(Cursor),
}

/// Where a write goes: up to two pieces of the peer's RMB (split at the end of the ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WritePlan {
    /// (offset in the peer RMB, length) pieces; the second is empty unless the ring wraps.
    pub pieces: [(u32, u32); 2],
    /// The peer should acknowledge the CDC at once: it is not expected to answer soon (see
    /// [`ConnCore::prepare_write`]). Otherwise its engine may hold the ACK for its answer to
    /// carry (rdma's `QpCaps::ack_delay`, `SendFlags::ACK_NOW`).
    pub ack_now: bool,
    /// The CDC to send after the RDMA WRITEs (on the same QP, so it lands after the data).
    pub cdc: CdcMessage,
    /// Bytes right after the last piece that are free in the peer's RMB (consumed, before the
    /// end of the ring): a WRITE may run on into them without touching unread data.
    pub slack: u32,
}

/// What moving a connection to another link of its group must redo (Linux's
/// `smc_switch_conns`/`smc_switch_cursor`, smc_core.c): WRITEs and CDCs in flight on the failed
/// link may or may not have arrived. Our send buffer mirrors the peer's RMB and keeps every
/// byte until the peer confirms consuming it, so everything past the peer's consumer cursor is
/// written again (bytes the peer already has are rewritten with the same values, at the same
/// places, before it may reuse them), then a CDC with the current cursors and close flags
/// follows.
/// Cursors are absolute and close flags sticky: that CDC carries whatever a lost one did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failover {
    /// Linux's validation CDC, first on the new link: only the `FAILOVER_VALIDATION` flag and
    /// the sequence number before the last CDC known to have completed (as Linux sends it:
    /// smc_cdc.c, `smcr_cdc_msg_send_validation()`); it takes no sequence number of its own.
    pub validation: CdcMessage,
    /// (offset, length) pieces of the peer's RMB, which are also the send buffer's, to write
    /// again on the new link.
    pub pieces: [(u32, u32); 2],
    /// The CDC after those WRITEs.
    pub cdc: CdcMessage,
}

/// What a received CDC changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RxUpdate {
    /// New bytes readable in our RMB.
    pub new_data: u32,
    /// Space freed in the peer's RMB.
    pub freed: u32,
    /// The CDC was older than one already taken and was ignored.
    pub stale: bool,
    /// The peer wants a consumer-cursor update now.
    pub update_requested: bool,
}

/// Cursors and flags of one connection.
#[derive(Debug, Clone)]
pub struct ConnCore {
    token_peer: u32,
    peer_rmb: u32,
    rmb: u32,
    /// How far we wrote into the peer's RMB.
    tx_prod: Cursor,
    /// How far the peer says it consumed (frees our space).
    peer_cons: Cursor,
    /// How far the peer wrote into our RMB.
    rx_prod: Cursor,
    /// How far our application read.
    rx_cons: Cursor,
    /// The consumer cursor we last told the peer.
    cons_sent: Cursor,
    seq_tx: u16,
    /// Sequence number of the last of our CDCs known to have reached the peer's queue pair.
    seq_done: Option<u16>,
    seq_rx: Option<u16>,
    peer_blocked: bool,
    /// Our last data CDC said our writer is blocked (a failover CDC says it again).
    blocked: bool,
    peer_wants_update: bool,
    local_flags: ConnStateFlags,
    peer_flags: ConnStateFlags,
    /// Bytes copied into the send buffer, not yet written to the peer (the next flush writes
    /// and announces them).
    staged: u32,
    /// Our data CDCs whose SEND has not completed (autocorking holds small writes while one
    /// is in flight).
    inflight: u32,
    /// Data came from the peer since our last data CDC: the exchange is a conversation.
    rx_since_tx: bool,
    /// We sent a data CDC.
    sent_data: bool,
    /// Our application closed the connection (the close or abort CDC is out).
    local_closed: bool,
    /// We shut down writing (PEER_DONE_WRITING sent).
    shut_wr: bool,
    /// Our application shut down reading.
    shut_rd: bool,
}

/// Readiness of a connection as poll/epoll report it for sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadyState {
    /// POLLIN: a read would not block.
    pub readable: bool,
    /// POLLOUT: a write would not block.
    pub writable: bool,
    /// POLLRDHUP: the peer will send no more.
    pub rdhup: bool,
    /// POLLHUP: both directions are finished (or the connection failed).
    pub hup: bool,
    /// POLLERR: the connection was reset (the peer aborted it, or it failed).
    pub error: bool,
    /// Counts arrivals of data (wrapping): a change while `readable` stays true is a new
    /// arrival, which edge-triggered epoll reports again for a socket.
    pub arrivals: u32,
}

/// Linux's SMC socket state (`enum smc_state`, net/smc/smc.h), as `smcss` shows it; the
/// numbers are Linux's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SmcState {
    /// Connected, neither side closed.
    Active = 1,
    /// Being set up.
    Init = 2,
    /// Both sides closed (or we closed after an abort).
    Closed = 7,
    /// Listening.
    Listen = 10,
    /// We shut down writing; the peer goes on.
    PeerCloseWait1 = 20,
    /// We closed; the peer goes on.
    PeerCloseWait2 = 21,
    /// The peer shut down writing; we go on.
    AppCloseWait1 = 22,
    /// The peer closed; we go on.
    AppCloseWait2 = 23,
    /// Both done writing, we shut down, the peer closed.
    AppFinCloseWait = 24,
    /// Both done writing, we closed, the peer only shut down.
    PeerFinCloseWait = 25,
    /// We aborted; waiting for the peer.
    PeerAbortWait = 26,
    /// Aborted (by the peer, or failed) while our application still holds it.
    ProcessAbort = 27,
}

impl SmcState {
    /// The state with Linux's number `n`.
    pub fn from_code(n: u64) -> Option<Self> {
        use SmcState::*;
        [
            Active,
            Init,
            Closed,
            Listen,
            PeerCloseWait1,
            PeerCloseWait2,
            AppCloseWait1,
            AppCloseWait2,
            AppFinCloseWait,
            PeerFinCloseWait,
            PeerAbortWait,
            ProcessAbort,
        ]
        .into_iter()
        .find(|s| *s as u64 == n)
    }

    /// The short name of smcss(8)'s manual page (`PEERCLW1`, …): the JSON schema's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Active => "ACTIVE",
            Self::Init => "INIT",
            Self::Closed => "CLOSED",
            Self::Listen => "LISTEN",
            Self::PeerCloseWait1 => "PEERCLW1",
            Self::PeerCloseWait2 => "PEERCLW2",
            Self::AppCloseWait1 => "APPCLW1",
            Self::AppCloseWait2 => "APPCLW2",
            Self::AppFinCloseWait => "APPFINCLW",
            Self::PeerFinCloseWait => "PEERFINCLW",
            Self::PeerAbortWait => "PEERABORTW",
            Self::ProcessAbort => "PROCESSABORT",
        }
    }

    /// The name `smcss` prints (`PEERCLOSEWAIT1`, …): the text tables'.
    pub fn smcss_name(self) -> &'static str {
        match self {
            Self::Active => "ACTIVE",
            Self::Init => "INIT",
            Self::Closed => "CLOSED",
            Self::Listen => "LISTEN",
            Self::PeerCloseWait1 => "PEERCLOSEWAIT1",
            Self::PeerCloseWait2 => "PEERCLOSEWAIT2",
            Self::AppCloseWait1 => "APPCLOSEWAIT1",
            Self::AppCloseWait2 => "APPCLOSEWAIT2",
            Self::AppFinCloseWait => "APPFINCLOSEWAIT1",
            Self::PeerFinCloseWait => "PEERFINCLOSEWAIT",
            Self::PeerAbortWait => "PEERABORTWAIT",
            Self::ProcessAbort => "PROCESSABORT",
        }
    }
}

impl ConnCore {
    /// Linux's SMC state of this connection now, from both sides' close flags; `failed`: the
    /// connection failed locally, `local_closed`: our application closed it (Linux's
    /// `smc_close_active`/`smc_close_passive_work` transitions, seen from their results). Linux
    /// also goes by the order of events: after close() it shows PEERCLW1 where this shows
    /// PEERCLW2, and after both shutdowns PEERCLW2 or APPCLW2 (by who went first) where this
    /// shows APPFINCLW.
    pub fn linux_state(&self, failed: bool) -> SmcState {
        let local_closed = self.local_closed;
        let (local, peer) = (self.local_flags, self.peer_flags);
        let closed = ConnStateFlags::PEER_CONN_CLOSED;
        let done = ConnStateFlags::PEER_DONE_WRITING | closed;
        if peer.contains(ConnStateFlags::PEER_CONN_ABORT) || failed {
            return if local_closed {
                SmcState::Closed
            } else {
                SmcState::ProcessAbort
            };
        }
        if local.contains(ConnStateFlags::PEER_CONN_ABORT) {
            return SmcState::PeerAbortWait;
        }
        match (local.intersects(done), peer.intersects(done)) {
            (false, false) => SmcState::Active,
            // We closed or shut down writing; the peer has not.
            (true, false) if local.contains(closed) => SmcState::PeerCloseWait2,
            (true, false) => SmcState::PeerCloseWait1,
            // The peer did; we have not.
            (false, true) if peer.contains(closed) => SmcState::AppCloseWait2,
            (false, true) => SmcState::AppCloseWait1,
            (true, true) if local.contains(closed) && peer.contains(closed) => SmcState::Closed,
            (true, true) if local.contains(closed) => SmcState::PeerFinCloseWait,
            (true, true) => SmcState::AppFinCloseWait,
        }
    }

    /// A connection whose peer gave `token_peer` (it goes into our CDCs), with the peer's RMB
    /// of `peer_rmb` bytes and ours of `rmb` bytes.
    pub fn new(token_peer: u32, peer_rmb: u32, rmb: u32) -> Self {
        Self {
            token_peer,
            peer_rmb,
            rmb,
            tx_prod: Cursor::default(),
            peer_cons: Cursor::default(),
            rx_prod: Cursor::default(),
            rx_cons: Cursor::default(),
            cons_sent: Cursor::default(),
            seq_tx: 0,
            seq_done: None,
            seq_rx: None,
            peer_blocked: false,
            blocked: false,
            peer_wants_update: false,
            local_flags: ConnStateFlags::empty(),
            peer_flags: ConnStateFlags::empty(),
            staged: 0,
            inflight: 0,
            rx_since_tx: false,
            sent_data: false,
            local_closed: false,
            shut_wr: false,
            shut_rd: false,
        }
    }

    /// Our application closed the connection.
    pub fn local_closed(&self) -> bool {
        self.local_closed
    }

    /// We shut down writing.
    pub fn shut_wr(&self) -> bool {
        self.shut_wr
    }

    /// Our application shut down reading.
    pub fn shut_rd(&self) -> bool {
        self.shut_rd
    }

    /// Our application shuts down reading (nothing is sent: SMC-R has no flag for it).
    pub fn shutdown_read(&mut self) {
        self.shut_rd = true;
    }

    /// Our application shuts down writing (after the staged bytes were flushed): the CDC
    /// with PEER_DONE_WRITING to send, or `None` if it already did (Linux:
    /// `smc_close_shutdown_write` → `smc_close_wr`, net/smc/smc_close.c).
    pub fn shutdown_write(&mut self) -> Option<CdcMessage> {
        if self.shut_wr {
            return None;
        }
        self.shut_wr = true;
        Some(self.close_flags(ConnStateFlags::PEER_DONE_WRITING))
    }

    /// Our application closes the connection (after the staged bytes were flushed): the CDC
    /// to send, or `None` if it already closed. Closing with unread data aborts, as Linux's
    /// `smc_close_final` (smc_close.c; and TCP's RST). SO_LINGER {on, 0} (`linger_zero`)
    /// aborts too, as TCP does; Linux's SMC then only skips waiting for unsent data.
    pub fn close(&mut self, linger_zero: bool) -> Option<CdcMessage> {
        if self.local_closed {
            return None;
        }
        self.local_closed = true;
        let flag = if self.readable() > 0 || linger_zero {
            ConnStateFlags::PEER_CONN_ABORT
        } else {
            ConnStateFlags::PEER_CONN_CLOSED
        };
        Some(self.close_flags(flag))
    }

    /// Whether a write of the staged bytes waits (autocorking, as Linux's `smc_should_autocork`
    /// in net/smc/smc_tx.c: while a CDC of ours is in flight, at most `limit` bytes are held
    /// back).
    pub fn corked(&self, limit: u32) -> bool {
        self.inflight > 0 && self.staged <= limit
    }

    /// Bytes staged: in the send buffer (or, on one host, already in the peer's RMB), not yet
    /// announced.
    pub fn staged(&self) -> u32 {
        self.staged
    }

    /// Our data CDCs whose SEND has not completed.
    pub fn inflight(&self) -> u32 {
        self.inflight
    }

    /// `n` more bytes are staged: copied into the send buffer at
    /// [`Self::stage_pieces`]`(self.staged(), n)`, or written there in the peer's RMB directly
    /// (same host). The next flush ([`Self::prepare_write`], [`Self::take_staged`]) announces
    /// them.
    pub fn stage(&mut self, n: u32) {
        self.staged += n;
    }

    /// The data CDC that [`Self::failover`] made was posted and completes later: it counts as
    /// in flight, as a flush's does ([`Self::take_staged`]).
    pub fn failover_cdc_posted(&mut self) {
        self.inflight += 1;
    }

    /// The staged bytes go out now (their CDC is in flight): how many.
    pub fn take_staged(&mut self) -> u32 {
        self.inflight += 1;
        std::mem::take(&mut self.staged)
    }

    /// A data CDC of ours completed (or was flushed): whether corked bytes should go now (as
    /// smc_cdc.c, `smc_cdc_tx_handler()`: the last one out sends what autocorking held).
    pub fn cdc_completed(&mut self) -> bool {
        self.inflight = self.inflight.saturating_sub(1);
        self.inflight == 0 && self.staged > 0
    }

    /// Both sides are done with the connection: we closed and the peer closed or aborted.
    pub fn both_closed(&self) -> bool {
        self.local_closed
            && self
                .peer_flags
                .intersects(ConnStateFlags::PEER_CONN_CLOSED | ConnStateFlags::PEER_CONN_ABORT)
    }

    /// What poll/epoll report now, as Linux's `smc_poll` (net/smc/af_smc.c) and TCP's for the
    /// same states. `failed`: the connection failed locally; `error_reported`:
    /// the application was told already (POLLERR once, as TCP's SO_ERROR); `arrivals`: the
    /// data-arrival count.
    pub fn readiness(&self, failed: bool, error_reported: bool, arrivals: u32) -> ReadyState {
        let pf = self.peer_flags;
        let gone = failed || pf.contains(ConnStateFlags::PEER_CONN_ABORT);
        let peer_done = gone
            || self.shut_rd
            || pf.intersects(ConnStateFlags::PEER_DONE_WRITING | ConnStateFlags::PEER_CONN_CLOSED);
        ReadyState {
            readable: self.readable() > 0 || peer_done,
            writable: self.space() > self.staged
                || gone
                || self.local_closed
                || pf.contains(ConnStateFlags::PEER_CONN_CLOSED),
            rdhup: peer_done,
            hup: gone || (peer_done && self.shut_wr),
            error: gone && !error_reported,
            arrivals,
        }
    }

    /// Linux's `rmbe_update_limit` for our RMB (smc_core.c, `smc_rmb_wnd_update_limit()`: a
    /// tenth of the RMB, at least [`MIN_UPDATE_LIMIT`]).
    pub fn update_limit(&self) -> u32 {
        (self.rmb / 10).max(MIN_UPDATE_LIMIT)
    }

    /// Bytes we may write into the peer's RMB now.
    pub fn space(&self) -> u32 {
        self.peer_rmb - Cursor::diff(self.peer_rmb, self.peer_cons, self.tx_prod).min(self.peer_rmb)
    }

    /// Where `n` more bytes go in the peer's RMB when `staged` bytes already wait in the send
    /// buffer, not yet announced (autocorking): up to two (offset, length) pieces. The send
    /// buffer mirrors the peer's RMB, so these are also the send-buffer offsets.
    pub fn stage_pieces(&self, staged: u32, n: u32) -> [(u32, u32); 2] {
        let off = (self.tx_prod.count + staged) % self.peer_rmb;
        let first = n.min(self.peer_rmb - off);
        [(off, first), (0, n - first)]
    }

    /// Bytes readable in our RMB.
    pub fn readable(&self) -> u32 {
        Cursor::diff(self.rmb, self.rx_cons, self.rx_prod)
    }

    /// The cursors and flags, for the stats area: our producer, the peer's consumer, the
    /// peer's producer, our consumer, our and the peer's connection-state flags.
    pub fn cursors(
        &self,
    ) -> (
        Cursor,
        Cursor,
        Cursor,
        Cursor,
        ConnStateFlags,
        ConnStateFlags,
    ) {
        (
            self.tx_prod,
            self.peer_cons,
            self.rx_prod,
            self.rx_cons,
            self.local_flags,
            self.peer_flags,
        )
    }

    /// The peer's close flags seen so far.
    pub fn peer_flags(&self) -> ConnStateFlags {
        self.peer_flags
    }

    /// Our close flags sent so far.
    pub fn local_flags(&self) -> ConnStateFlags {
        self.local_flags
    }

    fn next_cdc(&mut self, prod_flags: ProducerFlags) -> CdcMessage {
        // Every CDC carries our consumer cursor and so answers an update request (smc_cdc.c,
        // `smc_cdc_msg_send()`).
        self.seq_tx = self.seq_tx.wrapping_add(1);
        self.cons_sent = self.rx_cons;
        self.peer_wants_update = false;
        CdcMessage {
            seq: self.seq_tx,
            token: self.token_peer,
            prod: self.tx_prod,
            cons: self.rx_cons,
            prod_flags,
            conn_flags: self.local_flags,
        }
    }

    /// Plans writing `len` bytes (at most [`ConnCore::space`]) when `pending` bytes wait in
    /// total (`pending >= len`): where they go and the CDC announcing them.
    ///
    /// The CDC asks for its ACK at once ([`WritePlan::ack_now`]) unless the peer is likely to
    /// answer soon: when it is the first data we send (a request), or when data came from
    /// the peer since our last (a conversation: request, answer, request). Data we keep
    /// sending without hearing back (a stream), and a connection closing, get no answer to
    /// carry the ACK.
    pub fn prepare_write(&mut self, len: u32, pending: u32) -> WritePlan {
        let ack_now = (self.sent_data && !self.rx_since_tx) || !self.local_flags.is_empty();
        self.sent_data = true;
        self.rx_since_tx = false;
        let space = self.space();
        let len = len.min(space);
        let off = self.tx_prod.count;
        let first = len.min(self.peer_rmb - off);
        let pieces = [(off, first), (0, len - first)];
        let end = if len > first {
            len - first
        } else {
            off + first
        };
        let slack = (space - len).min(self.peer_rmb - end);
        self.tx_prod = self.tx_prod.advance(len, self.peer_rmb);
        // smc_tx.c, `smc_tx_rdma_writes()`: blocked when what waits fills the peer's space.
        self.blocked = pending >= space;
        let flags = if self.blocked {
            ProducerFlags::WRITE_BLOCKED
        } else {
            ProducerFlags::empty()
        };
        WritePlan {
            pieces,
            ack_now,
            cdc: self.next_cdc(flags),
            slack,
        }
    }

    /// Where the next `n` readable bytes are in our RMB: up to two (offset, length) pieces.
    pub fn read_pieces(&self, n: u32) -> [(u32, u32); 2] {
        let n = n.min(self.readable());
        let off = self.rx_cons.count;
        let first = n.min(self.rmb - off);
        [(off, first), (0, n - first)]
    }

    /// The application read `n` bytes; returns the CDC to send if Linux's rule (smc_tx.c,
    /// `smc_tx_consumer_update()`, called from smc_rx.c, `smc_rx_update_consumer()`) says the
    /// peer must hear about it now.
    pub fn consume(&mut self, n: u32) -> Option<CdcMessage> {
        let n = n.min(self.readable());
        self.rx_cons = self.rx_cons.advance(n, self.rmb);
        let to_confirm = Cursor::diff(self.rmb, self.cons_sent, self.rx_cons);
        // Space the peer believes it has: our RMB minus what it wrote and we have not confirmed.
        let peer_space =
            self.rmb - Cursor::diff(self.rmb, self.cons_sent, self.rx_prod).min(self.rmb);
        let send = self.peer_wants_update
            || (to_confirm > self.update_limit()
                && (peer_space <= self.rmb / 2 || self.peer_blocked));
        send.then(|| self.next_cdc(ProducerFlags::empty()))
    }

    /// A CDC with only our current state (close flags, cursors), e.g. on shutdown or when the
    /// peer asked for an update.
    pub fn control_cdc(&mut self) -> CdcMessage {
        self.next_cdc(ProducerFlags::empty())
    }

    /// Sets sticky close flags for our next CDCs (`PEER_DONE_WRITING` after shutdown(SHUT_WR),
    /// `PEER_CONN_CLOSED` on close, `PEER_CONN_ABORT` on abort) and returns the CDC to send.
    pub fn close_flags(&mut self, f: ConnStateFlags) -> CdcMessage {
        self.local_flags |= f;
        self.next_cdc(ProducerFlags::empty())
    }

    /// Our CDC with sequence number `seq` completed (the peer's queue pair took it).
    pub fn cdc_done(&mut self, seq: u16) {
        if self.seq_done.is_none_or(|d| seq_before(d, seq)) {
            self.seq_done = Some(seq);
        }
    }

    /// The connection moves to another link (see [`Failover`]).
    pub fn failover(&mut self) -> Failover {
        let validation = CdcMessage {
            // Linux records the sequence number before the increment (smc_cdc.c,
            // `smc_cdc_add_pending_send()`): one less than the last completed CDC's; 0 when
            // none completed.
            seq: self.seq_done.map_or(0, |d| d.wrapping_sub(1)),
            token: self.token_peer,
            prod: Cursor::default(),
            cons: Cursor::default(),
            prod_flags: ProducerFlags::FAILOVER_VALIDATION,
            conn_flags: ConnStateFlags::empty(),
        };
        let unconsumed = Cursor::diff(self.peer_rmb, self.peer_cons, self.tx_prod);
        let off = self.peer_cons.count;
        let first = unconsumed.min(self.peer_rmb - off);
        let pieces = [(off, first), (0, unconsumed - first)];
        // The peer takes each CDC's producer flags as our state now: a lost CDC's "writing
        // blocked" is said again.
        let cdc = self.next_cdc(if self.blocked {
            ProducerFlags::WRITE_BLOCKED
        } else {
            ProducerFlags::empty()
        });
        Failover {
            validation,
            pieces,
            cdc,
        }
    }

    /// Takes a CDC from the peer.
    pub fn on_cdc(&mut self, m: &CdcMessage) -> Result<RxUpdate, ConnError> {
        if m.prod_flags.contains(ProducerFlags::FAILOVER_VALIDATION) {
            // The peer moved this connection to another link. Linux aborts when the number is
            // newer than the last CDC it took (smc_cdc.c, `smc_cdc_msg_validate()`);
            // we need not: the peer's next CDC carries absolute cursors and sticky flags, so
            // nothing a lost CDC said is missing. Nothing else in it counts.
            return Ok(RxUpdate {
                stale: true,
                ..Default::default()
            });
        }
        // Older than the last one taken: dropped (smc_cdc.c, `smc_cdc_rx_handler()`).
        if let Some(last) = self.seq_rx
            && seq_before(m.seq, last)
        {
            return Ok(RxUpdate {
                stale: true,
                ..Default::default()
            });
        }
        if m.prod.count >= self.rmb {
            return Err(ConnError::CursorOutOfRange(m.prod));
        }
        if m.cons.count >= self.peer_rmb {
            return Err(ConnError::CursorOutOfRange(m.cons));
        }
        let mut up = RxUpdate::default();
        // A cursor that went back keeps its old value (smc_cdc.h, `smc_cdc_cursor_to_host()`).
        if !Cursor::moved_backwards(self.rx_prod, m.prod) {
            let new_data = Cursor::diff(self.rmb, self.rx_prod, m.prod);
            if self.readable() + new_data > self.rmb {
                return Err(ConnError::ProducerOverrun {
                    prod: m.prod,
                    cons: self.rx_cons,
                    size: self.rmb,
                });
            }
            up.new_data = new_data;
        }
        if !Cursor::moved_backwards(self.peer_cons, m.cons) {
            let freed = Cursor::diff(self.peer_rmb, self.peer_cons, m.cons);
            if freed > Cursor::diff(self.peer_rmb, self.peer_cons, self.tx_prod)
                && !(freed == self.peer_rmb && self.space() == 0)
            {
                return Err(ConnError::ConsumerBeyondWritten {
                    cons: m.cons,
                    written: self.tx_prod,
                });
            }
            up.freed = freed;
        }
        if up.new_data > 0 {
            self.rx_prod = m.prod;
            self.rx_since_tx = true;
        }
        if up.freed > 0 {
            self.peer_cons = m.cons;
        }
        self.seq_rx = Some(m.seq);
        self.peer_blocked = m.prod_flags.contains(ProducerFlags::WRITE_BLOCKED);
        if m.prod_flags.contains(ProducerFlags::CONS_CURS_UPD_REQ) {
            self.peer_wants_update = true;
            up.update_requested = true;
        }
        self.peer_flags |= m.conn_flags;
        Ok(up)
    }
}

#[cfg(test)]
mod tests;
