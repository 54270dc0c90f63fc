//! One RC queue pair between two hosts, on a verbs device (libibverbs: an RNIC or the
//! kernel's rxe) or on our engine, each side its own choice, through the same objects
//! (`Device::open_verbs` or `Device::open`): the check that the two kinds of device speak the
//! same RoCE v2 wire (`scripts/kernel-interop.sh`, part V).
//!
//! ```text
//! ibv_rc serve ADDR:PORT   [--engine] [--bytes N]
//! ibv_rc connect ADDR:PORT [--engine] [--bytes N]
//! ```
//! The two sides meet over TCP, trade QP number, PSN, GID, MTU and a region's address and
//! rkey, then each RDMA WRITEs N bytes (a pattern of its own) into the other's region in
//! 64 KiB requests and SENDs a message that says so; each checks every byte it was given and
//! says `OK` with the device it used. Without `--engine` the device is the verbs device
//! whose RoCE v2 GID holds the TCP connection's local address, as SMC-R picks one.

use rdma::ibv::sysfs;
use rdma::*;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const CHUNK: usize = 64 << 10;

/// One side: a device of either kind, through the crate's one set of objects. Its region:
/// the peer writes into the first half, the second half holds what this side writes.
struct Side {
    dev: Device,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    msg: MemoryRegion,
    mtu: Mtu,
}

impl Side {
    fn open(local: Ipv4Addr, engine: bool, len: usize) -> Result<Self, String> {
        let e = |e: std::io::Error| e.to_string();
        let dev = if engine {
            // On the RoCE port as the runtime opens it: through the steering program when
            // one is attached to the namespace (a runtime there attached it), else owning it.
            Device::open(DeviceConfig::new(SocketAddrV4::new(local, 4791)))
                .map_err(|x| format!("our engine on {local}: {x}"))?
        } else {
            let ports = sysfs::scan(std::path::Path::new(sysfs::SYSFS_ROOT));
            let (port, entry) = sysfs::roce_v2_for(&ports, local)
                .ok_or_else(|| format!("no active RDMA device has a RoCE v2 GID for {local}"))?;
            Device::open_verbs(&port.device, port.port, entry.index, local, &[]).map_err(e)?
        };
        let mtu = dev.verbs().map_or(Mtu::Mtu1024, |v| v.mtu);
        let caps = QpCaps {
            max_send_wr: 256,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let pd = dev.alloc_pd();
        let acc = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let mr = pd.reg_mr(2 * len, acc).map_err(e)?;
        let msg = pd.reg_mr(4096, acc).map_err(e)?;
        let cq = dev.create_cq().map_err(e)?;
        let qp = pd.create_qp(&cq, &cq, caps, false).map_err(e)?;
        qp.modify(&QpAttr::state(QpState::Init))
            .map_err(|x| x.to_string())?;
        Ok(Self {
            dev,
            cq,
            qp,
            mr,
            msg,
            mtu,
        })
    }

    fn describe(&self) -> String {
        match self.dev.verbs() {
            Some(v) => format!(
                "verbs device {} port {} (GID index {}, MTU {})",
                v.name,
                v.port,
                v.gid_index,
                v.mtu.bytes()
            ),
            None => "our engine (RoCE v2 over UDP)".to_string(),
        }
    }

    fn info(&self, psn: u32) -> String {
        format!(
            "{} {psn} {} {} {} {}\n",
            self.qp.qp_num(),
            sysfs::format_gid(&self.dev.gid()),
            self.mtu as u8,
            self.mr.addr(),
            self.mr.rkey()
        )
    }

    fn connect(&self, peer: &Peer, my_psn: u32, mtu: Mtu) -> Result<(), String> {
        let g = peer.gid;
        let ip = Ipv4Addr::new(g[12], g[13], g[14], g[15]);
        self.qp
            .modify(&QpAttr {
                path_mtu: Some(mtu),
                dest_qp_num: Some(peer.qpn),
                rq_psn: Some(Psn::new(peer.psn)),
                av: Some(SocketAddrV4::new(ip, 4791)),
                ..QpAttr::state(QpState::Rtr)
            })
            .map_err(|e| e.to_string())?;
        self.qp
            .modify(&QpAttr {
                sq_psn: Some(Psn::new(my_psn)),
                ..QpAttr::state(QpState::Rts)
            })
            .map_err(|e| e.to_string())
    }

    fn post_recv(&self) -> Result<(), String> {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: 900,
                sg_list: &[self.msg.sge(0, 4096)],
            }])
            .map_err(|e| format!("post_recv: {e}"))
    }

    /// WRITEs `len` bytes of the own half into the peer's, then SENDs "DONE len".
    fn send_all(&self, peer: &Peer, len: usize) -> Result<(), String> {
        let mut off = 0;
        let mut id = 0;
        while off < len {
            let n = CHUNK.min(len - off);
            self.qp
                .post_send(&[SendWr {
                    wr_id: id,
                    opcode: WrOpcode::RdmaWrite {
                        remote_addr: peer.addr + off as u64,
                        rkey: peer.rkey,
                    },
                    sg_list: &[self.mr.sge(len + off, n)],
                    flags: SendFlags::SIGNALED,
                }])
                .map_err(|e| format!("post WRITE at {off}: {e}"))?;
            self.expect(
                |c| c.opcode == WcOpcode::RdmaWrite && c.wr_id == id,
                "WRITE",
            )?;
            off += n;
            id += 1;
        }
        let note = format!("DONE {len}");
        self.msg.write(0, note.as_bytes());
        self.qp
            .post_send(&[SendWr {
                wr_id: 800,
                opcode: WrOpcode::Send,
                sg_list: &[self.msg.sge(0, note.len())],
                flags: SendFlags::SIGNALED,
            }])
            .map_err(|e| format!("post SEND: {e}"))
    }

    fn next(&self) -> Result<WorkCompletion, String> {
        let mut wc = [WorkCompletion::EMPTY];
        let n = self
            .cq
            .wait(&mut wc, Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("no completion in 30 s".into());
        }
        if wc[0].status != WcStatus::Success {
            return Err(format!("completion {:?}", wc[0]));
        }
        Ok(wc[0])
    }

    fn expect(&self, f: impl Fn(&WorkCompletion) -> bool, what: &str) -> Result<(), String> {
        // Receive completions that come meanwhile are kept for later.
        loop {
            let c = self.next()?;
            if f(&c) {
                return Ok(());
            }
            if c.opcode == WcOpcode::Recv {
                PENDING_RECV.with(|p| p.set(Some(c.byte_len)));
                continue;
            }
            if c.opcode == WcOpcode::Send {
                continue;
            }
            return Err(format!("expected a {what} completion, got {c:?}"));
        }
    }

    fn wait_note(&self) -> Result<String, String> {
        let len = match PENDING_RECV.with(|p| p.take()) {
            Some(l) => l,
            None => loop {
                let c = self.next()?;
                if c.opcode == WcOpcode::Recv {
                    break c.byte_len;
                }
            },
        };
        let mut b = vec![0; len as usize];
        self.msg.read(0, &mut b);
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

thread_local! {
    static PENDING_RECV: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

struct Peer {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    mtu: u8,
    addr: u64,
    rkey: u32,
}

fn parse_peer(l: &str) -> Result<Peer, String> {
    let f: Vec<&str> = l.split_whitespace().collect();
    if f.len() != 6 {
        return Err(format!("bad peer line {l:?}"));
    }
    let num = |s: &str| s.parse::<u64>().map_err(|e| format!("{s:?}: {e}"));
    Ok(Peer {
        qpn: num(f[0])? as u32,
        psn: num(f[1])? as u32,
        gid: sysfs::parse_gid(f[2]).ok_or_else(|| format!("bad GID {:?}", f[2]))?,
        mtu: num(f[3])? as u8,
        addr: num(f[4])?,
        rkey: num(f[5])? as u32,
    })
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn run(stream: TcpStream, engine: bool, len: usize, seed: u8) -> Result<String, String> {
    let SocketAddr::V4(local) = stream.local_addr().map_err(|e| e.to_string())? else {
        return Err("IPv4 only".into());
    };
    let side = Side::open(*local.ip(), engine, len)?;
    side.mr.write(len, &pattern(seed, len));
    side.post_recv()?;
    let psn = u32::from_ne_bytes(std::array::from_fn(|i| pattern(seed, 4 + i)[i + 1])) & 0xff_ffff;
    let mut w = stream.try_clone().map_err(|e| e.to_string())?;
    w.write_all(side.info(psn).as_bytes())
        .map_err(|e| e.to_string())?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    let peer = parse_peer(&line)?;
    let mtu = Mtu::from_enum(peer.mtu.min(side.mtu as u8)).ok_or("bad MTU")?;
    side.connect(&peer, psn, mtu)?;
    // Both sides are ready to receive before either writes.
    w.write_all(b"READY\n").map_err(|e| e.to_string())?;
    line.clear();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    if line.trim() != "READY" {
        return Err(format!("peer said {line:?}"));
    }
    let t = Instant::now();
    side.send_all(&peer, len)?;
    let note = side.wait_note()?;
    let took = t.elapsed();
    if note != format!("DONE {len}") {
        return Err(format!("the peer's message was {note:?}"));
    }
    let mut got = vec![0; len];
    side.mr.read(0, &mut got);
    let want = pattern(seed ^ 0x5a, len);
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let zero = got[i..].iter().take_while(|&&b| b == 0).count();
        return Err(format!(
            "byte {i} of {len} the peer wrote differs ({bad} bytes differ; {zero} zero bytes from there; got {:?}, want {:?})",
            &got[i..(i + 8).min(len)],
            &want[i..(i + 8).min(len)]
        ));
    }
    // Neither side tears its QP down while the other may still wait for an ACK.
    w.write_all(b"BYE\n").map_err(|e| e.to_string())?;
    line.clear();
    let _ = r.read_line(&mut line);
    Ok(format!(
        "OK {len} bytes each way intact (WRITE + SEND) in {:.1} ms on {}, peer QP {} GID {}",
        took.as_secs_f64() * 1e3,
        side.describe(),
        peer.qpn,
        sysfs::format_gid(&peer.gid)
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let engine = args.iter().any(|a| a == "--engine");
    let len = args
        .iter()
        .position(|a| a == "--bytes")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(4usize << 20);
    let (mode, addr) = match (args.first(), args.get(1)) {
        (Some(m), Some(a)) => (m.as_str(), a.as_str()),
        _ => {
            eprintln!("usage: ibv_rc serve|connect ADDR:PORT [--engine] [--bytes N]");
            std::process::exit(2);
        }
    };
    let r = match mode {
        "serve" => TcpListener::bind(addr)
            .and_then(|l| {
                println!("listening on {addr}");
                l.accept()
            })
            .map_err(|e| e.to_string())
            .and_then(|(s, _)| run(s, engine, len, 0x5a)),
        "connect" => TcpStream::connect(addr)
            .map_err(|e| e.to_string())
            .and_then(|s| run(s, engine, len, 0)),
        _ => Err(format!("unknown mode {mode}")),
    };
    match r {
        Ok(s) => println!("{s}"),
        Err(e) => {
            println!("FAIL {e}");
            std::process::exit(1);
        }
    }
}
