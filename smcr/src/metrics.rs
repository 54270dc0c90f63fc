//! The `metrics` facade, fed from the same events as the stats area, so that a program
//! embedding `smcr` can install any recorder (Prometheus exporter, statsd, …). Without a
//! recorder each call is one atomic load. Names (all with `mode` = `smcr` or `tcp` where it
//! applies):
//!
//! * `smcr_connections_total{mode}` (counter): connections negotiated.
//! * `smcr_first_contacts_total` (counter): connections that created a link group.
//! * `smcr_fallbacks_total{reason, code}` (counter): connections that stayed on TCP, by reason
//!   name and code (`0x…`).
//! * `smcr_handshake_failures_total` (counter): handshakes that failed with no fallback.
//! * `smcr_link_failovers_total` (counter): links that failed while their group had another
//!   (its connections moved there).
//! * `smcr_handshake_seconds{mode}` (histogram): from the TCP connection being up to the
//!   connection being usable (SMC-R: CONFIRM LINK included on a first contact).

use std::time::Duration;

use crate::FallbackReason;

/// A connection was negotiated: SMC-R when `fallback` is `None`.
pub(crate) fn connection(fallback: Option<&FallbackReason>, first_contact: bool, took: Duration) {
    let mode = if fallback.is_some() { "tcp" } else { "smcr" };
    metrics::counter!("smcr_connections_total", "mode" => mode).increment(1);
    metrics::histogram!("smcr_handshake_seconds", "mode" => mode).record(took.as_secs_f64());
    if first_contact {
        metrics::counter!("smcr_first_contacts_total").increment(1);
    }
    if let Some(r) = fallback {
        let code = r.code();
        metrics::counter!(
            "smcr_fallbacks_total",
            "reason" => crate::stats::reason(code).0,
            "code" => format!("{code:#010x}")
        )
        .increment(1);
    }
}

/// A handshake failed with no fallback.
pub(crate) fn handshake_failed() {
    metrics::counter!("smcr_handshake_failures_total").increment(1);
}

/// A link failed and its group's connections moved to the other link.
pub(crate) fn link_failover() {
    metrics::counter!("smcr_link_failovers_total").increment(1);
}
