//! The two roles: a *sink* that owns a ring buffer (an RMB) and a *source* that writes into it.
//!
//! Wire protocol of the SEND messages (little-endian, 32 bytes):
//! * source → sink `DATA  {seq, off, len, crc}`: `len` bytes at ring offset `off` were written;
//!   `crc` is their CRC-32. The sink checks it, folds the bytes into its running stream CRC and
//!   returns a credit.
//! * source → sink `END   {total, stream_crc}`; sink → source `DONE {ok, total, stream_crc}`.
//! * sink → source `CREDIT {consumed}`: bytes the sink has finished with.
//! * `PING`/`PONG` for the latency test.

use anyhow::{Context, Result, bail, ensure};
use rdma::*;
use std::io::Write;
use std::net::{SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

const MSG: usize = 32;
const RECVS: usize = 64;
const T_DATA: u32 = 1;
const T_END: u32 = 2;
const T_DONE: u32 = 3;
const T_CREDIT: u32 = 4;
const T_PING: u32 = 5;

/// What each side tells the other before the QPs connect.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint {
    /// Engine address (GID + UDP port).
    pub addr: SocketAddrV4,
    /// QP number.
    pub qpn: u32,
    /// Initial PSN.
    pub psn: u32,
    /// Ring buffer rkey (0 if none).
    pub rkey: u32,
    /// Ring buffer address.
    pub raddr: u64,
    /// Ring buffer length.
    pub rlen: u32,
}

impl Endpoint {
    fn to_line(self) -> String {
        format!(
            "{} {} {} {} {} {}\n",
            self.addr, self.qpn, self.psn, self.rkey, self.raddr, self.rlen
        )
    }
    fn parse(line: &str) -> Result<Self> {
        let f: Vec<&str> = line.split_whitespace().collect();
        ensure!(f.len() == 6, "bad endpoint line {line:?}");
        Ok(Self {
            addr: f[0].parse()?,
            qpn: f[1].parse()?,
            psn: f[2].parse()?,
            rkey: f[3].parse()?,
            raddr: f[4].parse()?,
            rlen: f[5].parse()?,
        })
    }
}

/// One side's RDMA resources, connected to the peer.
pub struct Conn {
    /// The device.
    pub dev: Device,
    /// The queue pair.
    pub qp: QueuePair,
    /// Send-side completions.
    pub scq: CompletionQueue,
    /// Receive-side completions.
    pub rcq: CompletionQueue,
    /// Our ring buffer (sink) or source buffer (source).
    pub buf: MemoryRegion,
    /// Buffers for outgoing SEND messages.
    msgs: MemoryRegion,
    /// Buffers for incoming SEND messages.
    rmsgs: MemoryRegion,
    /// The peer's endpoint.
    pub peer: Endpoint,
    next_msg: usize,
}

/// Options of a connection.
#[derive(Debug, Clone)]
pub struct Options {
    /// Local IPv4 address for the device.
    pub ip: std::net::Ipv4Addr,
    /// Path MTU.
    pub mtu: Mtu,
    /// Ring (RMB) size.
    pub ring: usize,
    /// Local ACK timeout code.
    pub timeout: u8,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ip: [127, 0, 0, 1].into(),
            mtu: Mtu::Mtu4096,
            ring: 8 << 20,
            timeout: 14,
        }
    }
}

impl Conn {
    /// Sets up resources and exchanges endpoints over `tcp`.
    pub fn establish(tcp: &mut TcpStream, o: &Options, sink: bool) -> Result<Self> {
        let dev = Device::open(DeviceConfig::new(SocketAddrV4::new(o.ip, 0)))
            .context("opening the RDMA device")?;
        let pd = dev.alloc_pd();
        let scq = dev.create_cq()?;
        let rcq = dev.create_cq()?;
        let caps = QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            ..QpCaps::default()
        };
        let qp = pd.create_qp(&scq, &rcq, caps, false)?;
        let access = if sink {
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        } else {
            Access::LOCAL_WRITE
        };
        let buf = pd.reg_mr(o.ring, access)?;
        let msgs = pd.reg_mr(MSG * 256, Access::LOCAL_WRITE)?;
        let rmsgs = pd.reg_mr(MSG * RECVS, Access::LOCAL_WRITE)?;
        let psn = std::process::id().wrapping_mul(2_654_435_761) & 0xFF_FFFF;
        let me = Endpoint {
            addr: dev.local_addr(),
            qpn: qp.qp_num(),
            psn,
            rkey: if sink { buf.rkey() } else { 0 },
            raddr: buf.addr(),
            rlen: o.ring as u32,
        };
        tcp.write_all(me.to_line().as_bytes())?;
        // Read the line byte by byte: buffering would swallow the barrier byte that follows.
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while b[0] != b'\n' {
            std::io::Read::read_exact(tcp, &mut b).context("reading the peer's endpoint")?;
            line.push(b[0]);
        }
        let peer = Endpoint::parse(std::str::from_utf8(&line)?)?;
        qp.modify(&QpAttr::state(QpState::Init))?;
        for i in 0..RECVS {
            qp.post_recv(&[RecvWr {
                wr_id: i as u64,
                sg_list: &[rmsgs.sge(i * MSG, MSG)],
            }])?;
        }
        qp.modify(&QpAttr {
            path_mtu: Some(o.mtu),
            dest_qp_num: Some(peer.qpn),
            rq_psn: Some(Psn::new(peer.psn)),
            av: Some(peer.addr),
            ..QpAttr::state(QpState::Rtr)
        })?;
        qp.modify(&QpAttr {
            sq_psn: Some(Psn::new(psn)),
            timeout: Some(o.timeout),
            ..QpAttr::state(QpState::Rts)
        })?;
        // Both QPs must be ready before data flows: a one-byte barrier over TCP.
        tcp.write_all(b"R")?;
        let mut b = [0u8; 1];
        std::io::Read::read_exact(tcp, &mut b)?;
        Ok(Self {
            dev,
            qp,
            scq,
            rcq,
            buf,
            msgs,
            rmsgs,
            peer,
            next_msg: 0,
        })
    }

    /// Sends a 32-byte control message; `signaled` asks for a completion.
    pub fn send_msg(&mut self, words: [u32; 8], signaled: bool) -> Result<()> {
        let slot = self.next_msg % 256;
        self.next_msg += 1;
        let mut b = [0u8; MSG];
        for (i, w) in words.iter().enumerate() {
            b[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        self.msgs.write(slot * MSG, &b);
        let flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        self.qp
            .post_send(&[SendWr {
                wr_id: u64::MAX,
                opcode: WrOpcode::Send,
                sg_list: &[self.msgs.sge(slot * MSG, MSG)],
                flags,
            }])
            .map_err(|e| anyhow::anyhow!("post_send: {e}"))
    }

    /// Waits for incoming control messages, reposting their buffers.
    pub fn recv_msgs(&self, out: &mut Vec<[u32; 8]>, timeout: Duration) -> Result<()> {
        let mut wcs = [WorkCompletion::EMPTY; 32];
        let n = self.rcq.wait(&mut wcs, Some(timeout))?;
        ensure!(
            n > 0,
            "no message from the peer within {timeout:?}\n  {}\n  device {:?}\n  faults {:?}",
            self.qp.summary(),
            self.dev.stats(),
            self.dev.fault_stats()
        );
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                bail!("receive completion failed: {}", wc.status.name());
            }
            let slot = wc.wr_id as usize;
            let mut b = [0u8; MSG];
            self.rmsgs.read(slot * MSG, &mut b);
            let mut w = [0u32; 8];
            for (i, x) in w.iter_mut().enumerate() {
                *x = u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
            }
            out.push(w);
            self.qp
                .post_recv(&[RecvWr {
                    wr_id: wc.wr_id,
                    sg_list: &[self.rmsgs.sge(slot * MSG, MSG)],
                }])
                .map_err(|e| anyhow::anyhow!("post_recv: {e}"))?;
        }
        Ok(())
    }

    /// Reaps send completions without waiting; fails on an error completion.
    pub fn reap_sends(&self) -> Result<()> {
        let mut wcs = [WorkCompletion::EMPTY; 32];
        loop {
            let n = self.scq.poll(&mut wcs);
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success {
                    bail!("send completion failed: {}", wc.status.name());
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }
}

/// Fills `out` with a deterministic pseudo-random stream position `pos` (u64 words).
pub fn fill(out: &mut [u8], seed: u64, pos: u64) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut z = seed ^ (pos + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// Result of a stream transfer, as seen by the source.
#[derive(Debug, Clone, Copy)]
pub struct StreamReport {
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// CRC-32 of the whole stream.
    pub crc: u32,
}

/// Source side of the stream: writes `total` bytes in `chunk`-byte RDMA WRITEs into the sink's
/// ring, each followed by a DATA message. With `verify`, the data is a fresh pseudo-random
/// stream and every chunk is checked by the sink; otherwise the buffer is reused as is.
pub fn run_source(c: &mut Conn, total: u64, chunk: usize, verify: bool) -> Result<StreamReport> {
    let ring = c.peer.rlen as u64;
    ensure!(
        chunk as u64 <= ring && ring.is_multiple_of(chunk as u64),
        "chunk must divide the ring"
    );
    let mut stream = crc32fast::Hasher::new();
    let mut sent = 0u64;
    let mut credited = 0u64;
    let mut seq = 0u32;
    let mut msgs = Vec::new();
    let window = ring.min(48 * chunk as u64);
    let mut tmp = vec![0u8; chunk];
    if !verify {
        fill(&mut tmp, 7, 0);
        for off in (0..c.buf.len()).step_by(chunk) {
            c.buf.write(off, &tmp[..chunk.min(c.buf.len() - off)]);
        }
    }
    let start = Instant::now();
    while sent < total {
        // When the window is full, wait until half of it is free (as TCP wakes a writer only
        // when a good part of its buffer is free), so that each wake-up carries much work.
        let resume = if sent - credited + chunk as u64 > window {
            window / 2
        } else {
            u64::MAX
        };
        while sent - credited > resume {
            msgs.clear();
            c.recv_msgs(&mut msgs, Duration::from_secs(30))?;
            for m in &msgs {
                ensure!(m[0] == T_CREDIT, "unexpected message type {}", m[0]);
                credited = u64::from(m[1]) | (u64::from(m[2]) << 32);
            }
            c.reap_sends()?;
        }
        let len = chunk.min((total - sent) as usize);
        let off = (sent % ring) as usize;
        let crc = if verify {
            fill(&mut tmp[..len], 0x5eed, sent / 8);
            c.buf.write(off, &tmp[..len]);
            stream.update(&tmp[..len]);
            crc32fast::hash(&tmp[..len])
        } else {
            0
        };
        c.qp.post_send(&[SendWr {
            wr_id: u64::from(seq),
            opcode: WrOpcode::RdmaWrite {
                remote_addr: c.peer.raddr + off as u64,
                rkey: c.peer.rkey,
            },
            sg_list: &[c.buf.sge(off, len)],
            flags: SendFlags::empty(),
        }])
        .map_err(|e| anyhow::anyhow!("post_send: {e}"))?;
        c.send_msg(
            [
                T_DATA,
                seq,
                off as u32,
                len as u32,
                crc,
                u32::from(verify),
                0,
                0,
            ],
            seq % 16 == 15,
        )?;
        seq = seq.wrapping_add(1);
        sent += len as u64;
    }
    let crc = stream.finalize();
    c.send_msg(
        [T_END, sent as u32, (sent >> 32) as u32, crc, 0, 0, 0, 0],
        true,
    )?;
    loop {
        msgs.clear();
        c.recv_msgs(&mut msgs, Duration::from_secs(60))?;
        if let Some(m) = msgs.iter().find(|m| m[0] == T_DONE) {
            let elapsed = start.elapsed();
            ensure!(
                m[1] == 1,
                "sink reports a mismatch: it counted {} bytes with CRC {:#010x}, we sent {sent} with {crc:#010x}",
                u64::from(m[2]) | u64::from(m[3]) << 32,
                m[4]
            );
            c.reap_sends()?;
            return Ok(StreamReport {
                bytes: sent,
                elapsed,
                crc,
            });
        }
    }
}

/// Sink side of the stream; returns the bytes received after checking every chunk and the
/// whole stream's CRC.
pub fn run_sink(c: &mut Conn) -> Result<u64> {
    let mut stream = crc32fast::Hasher::new();
    let mut got = 0u64;
    let mut expect_seq = 0u32;
    let mut msgs = Vec::new();
    let mut chunk = Vec::new();
    // Return credits once an eighth of the ring was consumed (SMC-R's rmbe_update_limit idea).
    let credit_every = u64::from(c.buf.len() as u32 / 8).max(1);
    let mut credited = 0u64;
    loop {
        msgs.clear();
        c.recv_msgs(&mut msgs, Duration::from_secs(60))?;
        for m in &msgs {
            match m[0] {
                T_DATA => {
                    ensure!(
                        m[1] == expect_seq,
                        "DATA {} arrived, expected {expect_seq}",
                        m[1]
                    );
                    expect_seq = expect_seq.wrapping_add(1);
                    let (off, len) = (m[2] as usize, m[3] as usize);
                    if m[5] == 1 {
                        chunk.resize(len, 0);
                        c.buf.read(off, &mut chunk);
                        let crc = crc32fast::hash(&chunk);
                        ensure!(
                            crc == m[4],
                            "chunk {} at ring offset {off}: CRC {crc:#010x}, source says {:#010x}",
                            m[1],
                            m[4]
                        );
                        stream.update(&chunk);
                    }
                    got += len as u64;
                }
                T_END => {
                    let total = u64::from(m[1]) | (u64::from(m[2]) << 32);
                    let crc = stream.clone().finalize();
                    let ok = total == got && (crc == m[3] || m[3] == 0);
                    c.send_msg(
                        [
                            T_DONE,
                            u32::from(ok),
                            got as u32,
                            (got >> 32) as u32,
                            crc,
                            0,
                            0,
                            0,
                        ],
                        true,
                    )?;
                    // Let the DONE message be acknowledged before the process exits.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut wcs = [WorkCompletion::EMPTY; 4];
                    while Instant::now() < deadline {
                        if c.scq.wait(&mut wcs, Some(Duration::from_millis(100)))? > 0 {
                            break;
                        }
                    }
                    if std::env::var_os("BENCH_DEBUG").is_some() {
                        eprintln!(
                            "sink device: {:?}\nsink responder: {:?}",
                            c.dev.stats(),
                            c.qp.responder_stats()
                        );
                    }
                    ensure!(
                        ok,
                        "stream mismatch: got {got} bytes CRC {crc:#010x}, source sent {total} CRC {:#010x}",
                        m[3]
                    );
                    return Ok(got);
                }
                t => bail!("unexpected message type {t}"),
            }
        }
        if got - credited >= credit_every {
            credited = got;
            c.send_msg(
                [T_CREDIT, got as u32, (got >> 32) as u32, 0, 0, 0, 0, 0],
                false,
            )?;
        }
        c.reap_sends()?;
    }
}

/// Ping-pong of SEND messages of `size` bytes; returns round-trip times.
pub fn run_ping(c: &mut Conn, iters: usize, warmup: usize) -> Result<Vec<Duration>> {
    let mut rtts = Vec::with_capacity(iters);
    let mut msgs = Vec::new();
    for i in 0..iters + warmup {
        let t = Instant::now();
        c.send_msg([T_PING, i as u32, 0, 0, 0, 0, 0, 0], false)?;
        msgs.clear();
        c.recv_msgs(&mut msgs, Duration::from_secs(10))?;
        ensure!(msgs.len() == 1 && msgs[0][1] == i as u32, "bad pong");
        if i >= warmup {
            rtts.push(t.elapsed());
        }
    }
    c.send_msg([T_END, 0, 0, 0, 0, 0, 0, 0], true)?;
    Ok(rtts)
}

/// Echo side of the ping-pong.
pub fn run_pong(c: &mut Conn) -> Result<()> {
    let mut msgs = Vec::new();
    loop {
        msgs.clear();
        c.recv_msgs(&mut msgs, Duration::from_secs(60))?;
        for m in msgs.clone() {
            match m[0] {
                T_PING => c.send_msg(m, false)?,
                T_END => return Ok(()),
                t => bail!("unexpected message type {t}"),
            }
        }
    }
}
