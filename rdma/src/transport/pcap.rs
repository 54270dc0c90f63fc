//! A pcap writer for RoCE traffic, so Wireshark and tshark decode captures as
//! Ethernet/IPv4/UDP/InfiniBand. Records are Ethernet frames (as tcpdump writes them on a real
//! interface) with locally administered MAC addresses `02:00:a.b.c.d` made from the IPv4
//! addresses; the IPv4 and UDP headers are rebuilt the way Linux puts them on the wire for our
//! sends (DF, the identification the ICRC was computed with).
//! Enabled with `SMCR_RDMA_PCAP=<file>` or [`DeviceConfig::pcap`](crate::DeviceConfig::pcap).

use crate::wire::{IPV4_HEADER_LEN, IcrcHeaders, UDP_HEADER_LEN, emit_ipv4_udp};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

const LINKTYPE_ETHERNET: u32 = 1;
const ETH_LEN: usize = 14;

/// Writes captured packets to a pcap file.
pub struct PcapWriter<W: Write> {
    out: W,
}

impl PcapWriter<BufWriter<File>> {
    /// Creates (truncates) `path` and writes the file header.
    pub fn create(path: &Path) -> io::Result<Self> {
        Self::new(BufWriter::new(File::create(path)?))
    }
}

impl<W: Write> PcapWriter<W> {
    /// Writes the pcap file header to `out`.
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut h = [0u8; 24];
        h[0..4].copy_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes());
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        h[16..20].copy_from_slice(&65535u32.to_le_bytes());
        h[20..24].copy_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&h)?;
        Ok(Self { out })
    }

    /// Records one RoCE packet (`roce` = BTH … ICRC) with its IPv4/UDP headers.
    pub fn write_packet(&mut self, h: &IcrcHeaders, ttl: u8, roce: &[u8]) -> io::Result<()> {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let len = ETH_LEN + IPV4_HEADER_LEN + UDP_HEADER_LEN + roce.len();
        let mut rec = [0u8; 16 + ETH_LEN + IPV4_HEADER_LEN + UDP_HEADER_LEN];
        rec[0..4].copy_from_slice(&(ts.as_secs() as u32).to_le_bytes());
        rec[4..8].copy_from_slice(&ts.subsec_micros().to_le_bytes());
        rec[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        rec[12..16].copy_from_slice(&(len as u32).to_le_bytes());
        let eth = &mut rec[16..16 + ETH_LEN];
        eth[0..2].copy_from_slice(&[0x02, 0x00]);
        eth[2..6].copy_from_slice(&h.dst.octets());
        eth[6..8].copy_from_slice(&[0x02, 0x00]);
        eth[8..12].copy_from_slice(&h.src.octets());
        eth[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        emit_ipv4_udp(&mut rec[16 + ETH_LEN..], h, ttl, roce.len());
        self.out.write_all(&rec)?;
        self.out.write_all(roce)?;
        // Each record reaches the file at once: a preloaded process is never torn down
        // cleanly, and a capture must be complete while it runs (a debugging aid, not a
        // fast path: one write per packet).
        self.out.flush()
    }

    /// Flushes buffered records.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}
