//! The stats records of connections and fallback sockets (what `smc-stat` shows).

#[allow(unused_imports)]
use super::*;

/// Leaves a fallback's stats row with the socket at `fd` (see [`SmcStream::hand_over`]).
pub(super) fn keep_row(rt: &Runtime, st: StatSlot, fd: std::os::fd::RawFd) {
    let (Some(ino), Ok(Some(mut rec))) = (crate::sys::socket_inode(fd), st.area.read_conn(st.slot))
    else {
        return;
    };
    rec.words[crate::stats::conn::FD] = fd as u64 + 1;
    rec.words[crate::stats::conn::INODE] = ino;
    st.area.write_conn(st.slot, &rec);
    rt.inner.keep_fallback_row(st, fd, ino);
}

/// Counts a negotiated connection and writes its row in the stats area (the connection's
/// cursors publish into it from then on); the row's slot, while the area has room.
pub(super) fn record_row(
    rt: &Runtime,
    addrs: impl FnOnce() -> (io::Result<SocketAddr>, io::Result<SocketAddr>),
    mode: &Mode,
    timeline: &Timeline,
    smc: Option<&Smc>,
    server: bool,
) -> Option<StatSlot> {
    record_row_counted(rt, addrs, mode, timeline, smc, server, true)
}

/// [`record_row`]; `count`: the connection counts in the totals and metrics (once per
/// connection: a process showing a connection another one counted does not count it again).
pub(super) fn record_row_counted(
    rt: &Runtime,
    addrs: impl FnOnce() -> (io::Result<SocketAddr>, io::Result<SocketAddr>),
    mode: &Mode,
    timeline: &Timeline,
    smc: Option<&Smc>,
    server: bool,
    count: bool,
) -> Option<StatSlot> {
    use crate::stats::{conn, total};
    let handshake = timeline.start.elapsed();
    match mode {
        _ if !count => {}
        Mode::SmcR { first_contact } => {
            crate::metrics::connection(None, *first_contact, handshake);
        }
        Mode::Tcp(r) => crate::metrics::connection(Some(r), false, handshake),
    }
    // The `log` facade hears of each settled connection: a decline (either side) or another
    // local reason at INFO, a peer that offered no SMC-R (the common case, like SMC-R itself)
    // at DEBUG. No "TCP:" in the text: that is the preload's own per-connection line.
    let level = match mode {
        Mode::Tcp(FallbackReason::PeerNoSmc) | Mode::SmcR { .. } => log::Level::Debug,
        Mode::Tcp(_) => log::Level::Info,
    };
    let logged = count && log::log_enabled!(level);
    if rt.inner.stats.is_none() && !logged {
        return None;
    }
    let (local, peer) = addrs();
    if logged {
        let (l, p) = (
            local.as_ref().map_or("?".into(), ToString::to_string),
            peer.as_ref().map_or("?".into(), ToString::to_string),
        );
        let role = if server { "server" } else { "client" };
        match mode {
            Mode::SmcR { first_contact } => log::log!(
                level,
                "connection {l} -> {p} ({role}) runs SMC-R{}",
                if *first_contact {
                    ", first contact"
                } else {
                    ""
                }
            ),
            Mode::Tcp(r) => log::log!(level, "connection {l} -> {p} ({role}) stays on TCP, {r}"),
        }
    }
    let area = rt.inner.stats.as_ref()?;
    let mut rec = crate::stats::ConnRecord::default();
    rec.words[conn::IN_USE] = 1;
    put_addr(&mut rec, local.ok(), false);
    put_addr(&mut rec, peer.ok(), true);
    let mode = match mode {
        Mode::SmcR { first_contact } => {
            if count {
                area.count(total::SMCR);
                if *first_contact {
                    area.count(total::FIRST_CONTACT);
                }
            }
            conn::MODE_SMCR
        }
        Mode::Tcp(r) => {
            if count {
                area.count(total::TCP);
                area.count_fallback(r.code());
            }
            let peer = match r {
                FallbackReason::Declined {
                    reason,
                    by_peer: true,
                } => u64::from(reason.0),
                _ => 0,
            };
            rec.words[conn::REASON] = u64::from(r.code()) | peer << 32;
            conn::MODE_TCP
        }
    };
    rec.words[conn::STATE] = conn::STATE_ACTIVE | u64::from(server) << 8 | mode << 16;
    if let Some(smc) = smc {
        rec.words[conn::SIZES] = smc.conn.rmb.len() as u64 | (smc.conn.sndbuf.len() as u64) << 32;
        rec.words[conn::IDS] = u64::from(smc.conn.token) | u64::from(smc.lg.id) << 32;
    }
    rec.words[conn::SINCE] = timeline.unix_ns;
    rec.words[conn::T_OPTION..=conn::T_LINK].copy_from_slice(&timeline.at);
    let slot = area.claim_conn()?;
    area.write_conn(slot, &rec);
    if let Some(smc) = smc {
        let mut s = smc.conn.core.lock();
        s.stat = Some(crate::runtime::StatRef {
            area: area.clone(),
            slot,
            start: timeline.start,
            wrote: false,
        });
        s.publish();
    }
    Some(StatSlot {
        area: area.clone(),
        slot,
    })
}

/// Writes an address into a record: IPv4 (or v4-mapped) in `LOCAL`/`PEER`, a native IPv6 one
/// in `LOCAL6`/`PEER6` with its `FAMILY` bit (the port stays in `LOCAL`/`PEER`).
pub(super) fn put_addr(rec: &mut crate::stats::ConnRecord, a: Option<SocketAddr>, peer: bool) {
    use crate::stats::conn;
    let Some(a) = a else { return };
    let (word, word6, bit) = if peer {
        (conn::PEER, conn::PEER6, 2)
    } else {
        (conn::LOCAL, conn::LOCAL6, 1)
    };
    match (v4_of(a), a) {
        (Some(v4), _) => {
            rec.words[word] = u64::from(u32::from(*v4.ip())) << 16 | u64::from(v4.port());
        }
        (None, SocketAddr::V6(v6)) => {
            let o = v6.ip().octets();
            rec.words[word] = u64::from(v6.port());
            rec.words[word6] = u64::from_be_bytes(o[..8].try_into().expect("8 bytes"));
            rec.words[word6 + 1] = u64::from_be_bytes(o[8..].try_into().expect("8 bytes"));
            rec.words[conn::FAMILY] |= bit;
        }
        (None, SocketAddr::V4(_)) => {}
    }
}
