//! Two network namespaces joined by a veth pair, and a server for the demos' and benches'
//! streams: what `smc-demo two-ns` and `bench smc` stand on.

use anyhow::{Result, ensure};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::Command;

/// The read and write size of [`serve`]'s bulk sinks.
pub const CHUNK: usize = 64 << 10;

/// Runs a command; an error with its stderr when it fails.
pub fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    ensure!(
        out.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Two namespaces joined by veth (10.78.0.1 and 10.78.0.2), deleted on drop.
pub struct Net {
    /// First namespace (10.78.0.1).
    pub a: String,
    /// Second namespace (10.78.0.2).
    pub b: String,
}

impl Net {
    /// Creates both namespaces and the veth pair.
    pub fn new() -> Result<Self> {
        let pid = std::process::id();
        let n = Self {
            a: format!("smcr-bench-{pid}-a"),
            b: format!("smcr-bench-{pid}-b"),
        };
        let (va, vb) = (format!("vb{pid}a"), format!("vb{pid}b"));
        run(&["ip", "netns", "add", &n.a])?;
        run(&["ip", "netns", "add", &n.b])?;
        run(&[
            "ip", "link", "add", &va, "netns", &n.a, "type", "veth", "peer", "name", &vb, "netns",
            &n.b,
        ])?;
        for (ns, dev, ip) in [(&n.a, &va, "10.78.0.1/24"), (&n.b, &vb, "10.78.0.2/24")] {
            run(&["ip", "-n", ns, "addr", "add", ip, "dev", dev])?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(n)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.a]);
        let _ = run(&["ip", "netns", "del", &self.b]);
    }
}

/// Moves the calling thread into network namespace `ns`.
pub fn enter_netns(ns: &str) -> Result<()> {
    let f = File::open(format!("/var/run/netns/{ns}"))?;
    // SAFETY: a valid namespace fd; affects the calling thread only.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    ensure!(r == 0, "setns {ns}: {}", std::io::Error::last_os_error());
    Ok(())
}

/// Serves one connection; its first byte says what for: `B` bulk sink (replies the byte count),
/// `C` bulk sink with CRC-32 (replies count and CRC), `P` 64-byte ping-pong, `E` 1-byte echo.
pub fn serve(mut s: impl Read + Write) -> std::io::Result<()> {
    let mut kind = [0u8; 1];
    s.read_exact(&mut kind)?;
    match kind[0] {
        b'B' => {
            let mut buf = vec![0u8; CHUNK];
            let mut n = 0u64;
            loop {
                let r = s.read(&mut buf)?;
                if r == 0 {
                    break;
                }
                n += r as u64;
            }
            s.write_all(&n.to_le_bytes())?;
        }
        b'C' => {
            let mut buf = vec![0u8; CHUNK];
            let (mut n, mut crc) = (0u64, crc32fast::Hasher::new());
            loop {
                let r = s.read(&mut buf)?;
                if r == 0 {
                    break;
                }
                crc.update(&buf[..r]);
                n += r as u64;
            }
            s.write_all(&n.to_le_bytes())?;
            s.write_all(&crc.finalize().to_le_bytes())?;
        }
        b'P' => {
            let mut b = [0u8; 64];
            while s.read_exact(&mut b).is_ok() {
                s.write_all(&b)?;
            }
        }
        b'E' => s.write_all(b"E")?,
        _ => {}
    }
    Ok(())
}
