//! A peer that misbehaves on purpose (feature `hostile`, for tests only): what a buggy or
//! malicious SMC-R implementation could put on the wire over an established link, so that
//! tests can check what the other end makes of it. Never enabled in the preload.

use std::io;

use rdma::{SendFlags, SendWr, WrOpcode};

use crate::stream::SmcStream;

impl SmcStream {
    /// Posts an RDMA WRITE of `len` bytes of `fill` to `offset` bytes from the start of the
    /// peer's RMB for this connection (negative: before it), with `rkey` instead of the one
    /// the peer gave; no CDC announces it.
    pub fn hostile_write(
        &self,
        offset: i64,
        len: usize,
        fill: u8,
        rkey: Option<u32>,
    ) -> io::Result<()> {
        let (conn, lg) = self.smc_parts().ok_or(io::ErrorKind::Unsupported)?;
        let peer = conn.core.lock().peer;
        let len = len.min(conn.sndbuf.len());
        conn.sndbuf.write(0, &vec![fill; len]);
        let sge = [conn.sndbuf.sge(0, len)];
        let wr = SendWr {
            wr_id: u64::MAX,
            opcode: WrOpcode::RdmaWrite {
                remote_addr: peer.vaddr.wrapping_add_signed(offset),
                rkey: rkey.unwrap_or(peer.rkey),
            },
            sg_list: &sge,
            flags: SendFlags::empty(),
        };
        lg.qp()
            .post_send(&[wr])
            .map_err(|e| io::Error::other(format!("{e:?}")))
    }

    /// Posts `bytes` (at most 44, an LLC or CDC message as the peer will parse it) as a SEND on
    /// this connection's link.
    pub fn hostile_send(&self, bytes: &[u8]) -> io::Result<()> {
        let (_, lg) = self.smc_parts().ok_or(io::ErrorKind::Unsupported)?;
        lg.post_raw_send(bytes)
    }

    /// The CDC message this connection would send next (its token and sequence number right),
    /// changed by `f`, then posted as a SEND.
    pub fn hostile_cdc(&self, f: impl FnOnce(&mut cdc::CdcMessage)) -> io::Result<()> {
        let (conn, _) = self.smc_parts().ok_or(io::ErrorKind::Unsupported)?;
        let mut m = conn.core.lock().core.control_cdc();
        f(&mut m);
        let mut b = [0u8; cdc::CDC_LEN];
        m.emit(&mut b);
        self.hostile_send(&b)
    }
}
