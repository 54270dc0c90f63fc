//! The measurements: ping-pong over AF_XDP, UDP and TCP, one-way throughput over AF_XDP and
//! UDP (with and without GSO/GRO).

#[allow(unused_imports)]
use super::*;

pub(super) fn percentiles(mut v: Vec<u64>) -> (f64, f64) {
    v.sort_unstable();
    let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize] as f64 / 1e3;
    (p(0.5), p(0.99))
}

/// How an end waits for a packet.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    Block,
    Busy,
}

pub(super) fn xdp_pingpong(
    net: &Net,
    cpus: [usize; 2],
    iters: usize,
    wait: Wait,
    attach: u32,
) -> Result<(f64, f64)> {
    let sg = false;
    let (ea, eb) = (net.endpoint(0), net.endpoint(1));
    let (ia, ib) = (net.ifindex[0], net.ifindex[1]);
    let stop = Arc::new(AtomicBool::new(false));
    let stop_b = stop.clone();
    // Waits for one frame; false on timeout.
    fn wait_one(x: &mut Xsk, wait: Wait, deadline: Instant) -> Result<bool> {
        loop {
            match wait {
                Wait::Block => {
                    if x.wait_rx(50)? {
                        return Ok(true);
                    }
                }
                Wait::Busy => {
                    if x.wait_rx(0)? {
                        return Ok(true);
                    }
                    std::hint::spin_loop();
                }
            }
            if Instant::now() > deadline {
                return Ok(false);
            }
        }
    }
    let (rtts, ()) = pair(
        cpus,
        move |bar| {
            let mut e = XdpEnd::open(ia, sg, attach)?;
            bar.wait()?;
            // Let B attach before the first frame.
            bar.wait()?;
            let mut rtts = Vec::with_capacity(iters);
            let mut lost = 0;
            for seq in 0..(iters + 1000) as u64 {
                let t = Instant::now();
                e.xsk.queue_tx(1, |_, buf| {
                    let n = xp::write_headers(buf, &ea, &eb, PING);
                    buf[xp::HEADERS..xp::HEADERS + 8].copy_from_slice(&seq.to_le_bytes());
                    n
                });
                e.xsk.kick()?;
                let mut got = false;
                while !got {
                    if !wait_one(&mut e.xsk, wait, t + Duration::from_millis(200))? {
                        lost += 1;
                        break;
                    }
                    e.xsk.recv(64, |f, _| {
                        got |= f.len() >= xp::HEADERS + 8
                            && f[xp::HEADERS..xp::HEADERS + 8] == seq.to_le_bytes();
                    });
                }
                if got && seq >= 1000 {
                    rtts.push(t.elapsed().as_nanos() as u64);
                }
            }
            stop.store(true, Ordering::Relaxed);
            ensure!(lost < 10, "AF_XDP ping-pong lost {lost} frames");
            Ok(rtts)
        },
        move |bar| {
            let mut e = XdpEnd::open(ib, sg, attach)?;
            bar.wait()?;
            bar.wait()?;
            let mut payload = [0u8; PING];
            while !stop_b.load(Ordering::Relaxed) {
                let far = Instant::now() + Duration::from_millis(50);
                if !wait_one(&mut e.xsk, wait, far)? {
                    continue;
                }
                let mut n = 0;
                e.xsk.recv(64, |f, _| {
                    if f.len() >= xp::HEADERS + PING {
                        payload.copy_from_slice(&f[xp::HEADERS..xp::HEADERS + PING]);
                        n += 1;
                    }
                });
                if n > 0 {
                    e.xsk.queue_tx(1, |_, buf| {
                        let n = xp::write_headers(buf, &eb, &ea, PING);
                        buf[xp::HEADERS..n].copy_from_slice(&payload);
                        n
                    });
                    e.xsk.kick()?;
                }
            }
            Ok(())
        },
    )?;
    Ok(percentiles(rtts))
}

pub(super) fn udp_addr(i: usize, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(IP[i]), port)
}

pub(super) fn udp_pingpong(cpus: [usize; 2], iters: usize, wait: Wait) -> Result<(f64, f64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop_b = stop.clone();
    let recv = move |s: &UdpSocket, b: &mut [u8]| -> std::io::Result<usize> {
        if wait == Wait::Block {
            return s.recv(b);
        }
        loop {
            match s.recv(b) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                r => return r,
            }
        }
    };
    let (rtts, ()) = pair(
        cpus,
        move |bar| {
            let s = UdpSocket::bind(udp_addr(0, UDP_PORT))?;
            s.connect(udp_addr(1, UDP_PORT))?;
            s.set_nonblocking(wait == Wait::Busy)?;
            bar.wait()?;
            let mut b = [0u8; PING];
            let mut rtts = Vec::with_capacity(iters);
            for i in 0..iters + 1000 {
                let t = Instant::now();
                s.send(&b)?;
                recv(&s, &mut b)?;
                if i >= 1000 {
                    rtts.push(t.elapsed().as_nanos() as u64);
                }
            }
            stop.store(true, Ordering::Relaxed);
            // Unblock B.
            s.send(&[])?;
            Ok(rtts)
        },
        move |bar| {
            let s = UdpSocket::bind(udp_addr(1, UDP_PORT))?;
            s.connect(udp_addr(0, UDP_PORT))?;
            s.set_nonblocking(wait == Wait::Busy)?;
            bar.wait()?;
            let mut b = [0u8; PING];
            loop {
                let n = recv(&s, &mut b)?;
                if stop_b.load(Ordering::Relaxed) || n == 0 {
                    return Ok(());
                }
                s.send(&b[..n])?;
            }
        },
    )?;
    Ok(percentiles(rtts))
}

pub(super) fn tcp_pingpong(cpus: [usize; 2], iters: usize) -> Result<(f64, f64)> {
    let (rtts, ()) = pair(
        cpus,
        move |bar| {
            bar.wait()?;
            let mut s = TcpStream::connect(udp_addr(1, TCP_PORT))?;
            s.set_nodelay(true)?;
            let mut b = [0u8; PING];
            let mut rtts = Vec::with_capacity(iters);
            for i in 0..iters + 1000 {
                let t = Instant::now();
                s.write_all(&b)?;
                s.read_exact(&mut b)?;
                if i >= 1000 {
                    rtts.push(t.elapsed().as_nanos() as u64);
                }
            }
            Ok(rtts)
        },
        move |bar| {
            let l = TcpListener::bind(udp_addr(1, TCP_PORT))?;
            bar.wait()?;
            let (mut s, _) = l.accept()?;
            s.set_nodelay(true)?;
            let mut b = [0u8; PING];
            while s.read_exact(&mut b).is_ok() {
                s.write_all(&b)?;
            }
            Ok(())
        },
    )?;
    Ok(percentiles(rtts))
}

/// Receiver-side counts, sampled by the main thread.
#[derive(Default)]
pub(super) struct Counts {
    pub(super) packets: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) stop: AtomicBool,
}

/// Runs sender `a` and receiver `b`, measures what B received over `secs` after a warm-up:
/// (Gbit/s of payload, Mpps).
pub(super) fn throughput(
    cpus: [usize; 2],
    secs: f64,
    a: impl FnOnce(&Gate, &Counts) -> Result<()> + Send + 'static,
    b: impl FnOnce(&Gate, &Counts) -> Result<()> + Send + 'static,
) -> Result<(f64, f64)> {
    let c = Arc::new(Counts::default());
    let (ca, cb, cm) = (c.clone(), c.clone(), c.clone());
    let sampler = std::thread::spawn(move || {
        // Warm-up, then the window.
        std::thread::sleep(Duration::from_millis(300));
        let (p0, b0, t0) = (
            cm.packets.load(Ordering::Relaxed),
            cm.bytes.load(Ordering::Relaxed),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_secs_f64(secs));
        let (p1, b1, el) = (
            cm.packets.load(Ordering::Relaxed),
            cm.bytes.load(Ordering::Relaxed),
            t0.elapsed().as_secs_f64(),
        );
        cm.stop.store(true, Ordering::Relaxed);
        (
            (b1 - b0) as f64 * 8.0 / el / 1e9,
            (p1 - p0) as f64 / el / 1e6,
        )
    });
    let r = pair(cpus, move |bar| a(bar, &ca), move |bar| b(bar, &cb));
    c.stop.store(true, Ordering::Relaxed);
    let v = sampler.join().map_err(|_| anyhow::anyhow!("sampler"))?;
    r?;
    Ok(v)
}

pub(super) fn xdp_throughput(
    net: &Net,
    cpus: [usize; 2],
    size: usize,
    secs: f64,
    attach: u32,
) -> Result<(f64, f64)> {
    // A copy-mode RX frame must fit a chunk less XDP_PACKET_HEADROOM (256); beyond, go
    // multi-buffer.
    let sg = xp::HEADERS + size > FRAME as usize - 256;
    let (ea, eb) = (net.endpoint(0), net.endpoint(1));
    let (ia, ib) = (net.ifindex[0], net.ifindex[1]);
    throughput(
        cpus,
        secs,
        move |bar, c| {
            let mut e = XdpEnd::open(ia, sg, attach)?;
            bar.wait()?;
            bar.wait()?;
            while !c.stop.load(Ordering::Relaxed) {
                let n = e
                    .xsk
                    .queue_tx(64, |_, buf| xp::write_headers(buf, &ea, &eb, size));
                if n == 0 {
                    std::thread::yield_now();
                }
                e.xsk.kick()?;
            }
            Ok(())
        },
        move |bar, c| {
            let mut e = XdpEnd::open(ib, sg, attach)?;
            bar.wait()?;
            bar.wait()?;
            while !c.stop.load(Ordering::Relaxed) {
                if !e.xsk.wait_rx(50)? {
                    continue;
                }
                let (mut p, mut b) = (0, 0);
                e.xsk.recv(64, |f, last| {
                    p += u64::from(last);
                    b += f.len() as u64;
                });
                // Payload bytes: frames less their headers.
                b -= p * xp::HEADERS as u64;
                c.packets.fetch_add(p, Ordering::Relaxed);
                c.bytes.fetch_add(b, Ordering::Relaxed);
            }
            let s = e.xsk.stats()?;
            if s.rx_dropped + s.rx_ring_full + s.rx_fill_ring_empty_descs > 0 && verbose() {
                eprintln!("  xsk rx stats: {s:?}");
            }
            Ok(())
        },
    )
}

pub(super) fn verbose() -> bool {
    std::env::var_os("BENCH_DEBUG").is_some()
}

pub(super) fn setsockopt_int(s: &UdpSocket, level: i32, opt: i32, v: i32) -> std::io::Result<()> {
    // SAFETY: an int option on our socket.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            opt,
            (&v as *const i32).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(super) const UDP_SEGMENT: i32 = 103;
pub(super) const UDP_GRO: i32 = 104;

/// Kernel UDP: `gso` false = sendmmsg of 64 datagrams, receiver recvmmsg; true = UDP_SEGMENT
/// sends of as many `size` segments as fit 64 KiB, receiver with UDP_GRO.
pub(super) fn udp_throughput(
    cpus: [usize; 2],
    size: usize,
    secs: f64,
    gso: bool,
) -> Result<(f64, f64)> {
    throughput(
        cpus,
        secs,
        move |bar, c| {
            let s = UdpSocket::bind(udp_addr(0, UDP_PORT))?;
            s.connect(udp_addr(1, UDP_PORT))?;
            bar.wait()?;
            if gso {
                setsockopt_int(&s, libc::SOL_UDP, UDP_SEGMENT, size as i32)?;
                let segs = (65507 - 8) / size;
                let buf = vec![0x5au8; segs * size];
                while !c.stop.load(Ordering::Relaxed) {
                    if let Err(e) = s.send(&buf) {
                        // ECONNREFUSED after the receiver closed, ENOBUFS under pressure.
                        if !c.stop.load(Ordering::Relaxed)
                            && e.raw_os_error() != Some(libc::ENOBUFS)
                        {
                            return Err(e.into());
                        }
                    }
                }
            } else {
                let buf = vec![0x5au8; size];
                let mut iov: Vec<libc::iovec> = (0..64)
                    .map(|_| libc::iovec {
                        iov_base: buf.as_ptr() as *mut _,
                        iov_len: size,
                    })
                    .collect();
                let mut msgs = mmsghdrs(&mut iov);
                while !c.stop.load(Ordering::Relaxed) {
                    // SAFETY: msgs point at iov entries that point at buf, all live.
                    let r = unsafe { libc::sendmmsg(s.as_raw_fd(), msgs.as_mut_ptr(), 64, 0) };
                    if r < 0 {
                        let e = std::io::Error::last_os_error();
                        if !c.stop.load(Ordering::Relaxed)
                            && e.raw_os_error() != Some(libc::ENOBUFS)
                        {
                            return Err(e.into());
                        }
                    }
                }
            }
            Ok(())
        },
        move |bar, c| {
            let s = UdpSocket::bind(udp_addr(1, UDP_PORT))?;
            setsockopt_int(&s, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 4 << 20)?;
            s.set_read_timeout(Some(Duration::from_millis(50)))?;
            if gso {
                setsockopt_int(&s, libc::SOL_UDP, UDP_GRO, 1)?;
            }
            bar.wait()?;
            if gso {
                let mut b = vec![0u8; 65536];
                while !c.stop.load(Ordering::Relaxed) {
                    if let Ok(n) = s.recv(&mut b) {
                        c.packets
                            .fetch_add(n.div_ceil(size) as u64, Ordering::Relaxed);
                        c.bytes.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            } else {
                let mut bufs = vec![0u8; 64 * size];
                let mut iov: Vec<libc::iovec> = bufs
                    .chunks_mut(size)
                    .map(|b| libc::iovec {
                        iov_base: b.as_mut_ptr().cast(),
                        iov_len: size,
                    })
                    .collect();
                let mut msgs = mmsghdrs(&mut iov);
                while !c.stop.load(Ordering::Relaxed) {
                    // SAFETY: msgs point at iov entries that point at bufs, all live.
                    let r = unsafe {
                        libc::recvmmsg(
                            s.as_raw_fd(),
                            msgs.as_mut_ptr(),
                            64,
                            libc::MSG_WAITFORONE,
                            std::ptr::null_mut(),
                        )
                    };
                    if r > 0 {
                        let b: u64 = msgs[..r as usize]
                            .iter()
                            .map(|m| u64::from(m.msg_len))
                            .sum();
                        c.packets.fetch_add(r as u64, Ordering::Relaxed);
                        c.bytes.fetch_add(b, Ordering::Relaxed);
                    }
                }
            }
            Ok(())
        },
    )
}
