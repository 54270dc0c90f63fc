//! RDMA devices as the kernel lists them under `/sys/class/infiniband` (the same place
//! rdma-core and smc-tools' `smc_rnics` read): ports, their state, and their GID tables with
//! each entry's type and network device. Reading needs no library, so a machine without
//! rdma-core or without devices pays one failed `readdir`.

use std::net::Ipv4Addr;
use std::path::Path;

/// Where the kernel lists RDMA devices.
pub const SYSFS_ROOT: &str = "/sys/class/infiniband";

/// What a GID table entry is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// RoCE v2: RoCE over UDP/IP (what SMC-R uses, and our engine speaks).
    RoceV2,
    /// RoCE v1 or InfiniBand.
    RoceV1,
    /// A type this code does not know.
    Other,
}

/// One used entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index (`sgid_index` in an address vector).
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// Its type.
    pub kind: GidKind,
    /// The network device it belongs to.
    pub netdev: Option<String>,
}

impl GidEntry {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`, how RoCE v2 names IPv4).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        let g = &self.gid;
        (g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff)
            .then(|| Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    }
}

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// The device's name (`rxe0`, `mlx5_0`).
    pub device: String,
    /// The port number (from 1).
    pub port: u8,
    /// The port's state word (`ACTIVE`, `DOWN`, ...), from `4: ACTIVE`.
    pub state: String,
    /// `Ethernet` for RoCE, `InfiniBand` otherwise.
    pub link_layer: String,
    /// The used GID table entries.
    pub gids: Vec<GidEntry>,
}

impl PortInfo {
    /// Whether the port can carry traffic.
    pub fn is_active(&self) -> bool {
        self.state == "ACTIVE"
    }
}

/// The ports of every RDMA device under `root` (normally [`SYSFS_ROOT`]), sorted by device
/// and port. Unreadable or malformed entries are left out, never an error: no devices is the
/// common case.
pub fn scan(root: &Path) -> Vec<PortInfo> {
    let mut out = Vec::new();
    let Ok(devs) = std::fs::read_dir(root) else {
        return out;
    };
    let mut names: Vec<String> = devs
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    for dev in names {
        let ports_dir = root.join(&dev).join("ports");
        let Ok(ports) = std::fs::read_dir(&ports_dir) else {
            continue;
        };
        let mut nums: Vec<u8> = ports
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        nums.sort_unstable();
        for port in nums {
            let p = ports_dir.join(port.to_string());
            let read = |f: &str| {
                std::fs::read_to_string(p.join(f))
                    .map(|s| s.trim().to_string())
                    .unwrap_or_default()
            };
            let state = parse_state(&read("state"));
            let link_layer = read("link_layer");
            let mut gids = Vec::new();
            if let Ok(list) = std::fs::read_dir(p.join("gids")) {
                let mut idx: Vec<u32> = list
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect();
                idx.sort_unstable();
                for i in idx {
                    let Some(gid) = parse_gid(&read(&format!("gids/{i}"))) else {
                        continue;
                    };
                    // An unused entry is all zeros (and its type file fails to read).
                    if gid == [0; 16] {
                        continue;
                    }
                    let kind = parse_kind(&read(&format!("gid_attrs/types/{i}")));
                    let nd = read(&format!("gid_attrs/ndevs/{i}"));
                    gids.push(GidEntry {
                        index: i,
                        gid,
                        kind,
                        netdev: (!nd.is_empty()).then_some(nd),
                    });
                }
            }
            out.push(PortInfo {
                device: dev.clone(),
                port,
                state,
                link_layer,
                gids,
            });
        }
    }
    out
}

/// The active RoCE v2 port and GID entry that carry `addr`, as the kernel's SMC-R picks a
/// device for a connection's local address.
pub fn roce_v2_for(ports: &[PortInfo], addr: Ipv4Addr) -> Option<(&PortInfo, &GidEntry)> {
    ports
        .iter()
        .filter(|p| p.is_active() && p.link_layer == "Ethernet")
        .find_map(|p| {
            p.gids
                .iter()
                .find(|g| g.kind == GidKind::RoceV2 && g.ipv4() == Some(addr))
                .map(|g| (p, g))
        })
}

/// `4: ACTIVE` → `ACTIVE`.
fn parse_state(s: &str) -> String {
    s.split_once(':')
        .map(|(_, w)| w.trim())
        .unwrap_or(s)
        .to_string()
}

fn parse_kind(s: &str) -> GidKind {
    match s {
        "RoCE v2" => GidKind::RoceV2,
        "IB/RoCE v1" | "RoCE v1" | "IB" => GidKind::RoceV1,
        _ => GidKind::Other,
    }
}

/// `fe80:0000:0000:0000:5054:00ff:fe77:0002` → 16 bytes.
pub fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let mut n = 0;
    for part in s.trim().split(':') {
        if n == 8 || part.len() != 4 {
            return None;
        }
        let v = u16::from_str_radix(part, 16).ok()?;
        out[n * 2..n * 2 + 2].copy_from_slice(&v.to_be_bytes());
        n += 1;
    }
    (n == 8).then_some(out)
}

/// 16 bytes → `fe80:0000:...` (as sysfs writes it).
pub fn format_gid(g: &[u8; 16]) -> String {
    g.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> tempdir::Dir {
        tempdir::Dir::new()
    }

    /// A minimal temporary directory (no extra crate).
    mod tempdir {
        pub(super) struct Dir(pub(super) std::path::PathBuf);
        impl Dir {
            pub(super) fn new() -> Self {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "rdma-sysfs-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Self(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn put(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// As rxe0 shows itself in the kernel-peer guests (10.77.0.2 on eth0).
    fn rxe(root: &Path, dev: &str, state: &str, ip_hex: &str) {
        let b = format!("{dev}/ports/1");
        put(root, &format!("{b}/state"), state);
        put(root, &format!("{b}/link_layer"), "Ethernet\n");
        put(
            root,
            &format!("{b}/gids/0"),
            "fe80:0000:0000:0000:5054:00ff:fe77:0002\n",
        );
        put(root, &format!("{b}/gid_attrs/types/0"), "IB/RoCE v1\n");
        put(root, &format!("{b}/gid_attrs/ndevs/0"), "eth0\n");
        put(
            root,
            &format!("{b}/gids/1"),
            "fe80:0000:0000:0000:5054:00ff:fe77:0002\n",
        );
        put(root, &format!("{b}/gid_attrs/types/1"), "RoCE v2\n");
        put(root, &format!("{b}/gid_attrs/ndevs/1"), "eth0\n");
        put(
            root,
            &format!("{b}/gids/2"),
            &format!("0000:0000:0000:0000:0000:ffff:{ip_hex}\n"),
        );
        put(root, &format!("{b}/gid_attrs/types/2"), "IB/RoCE v1\n");
        put(
            root,
            &format!("{b}/gids/3"),
            &format!("0000:0000:0000:0000:0000:ffff:{ip_hex}\n"),
        );
        put(root, &format!("{b}/gid_attrs/types/3"), "RoCE v2\n");
        put(root, &format!("{b}/gid_attrs/ndevs/3"), "eth0\n");
        put(
            root,
            &format!("{b}/gids/4"),
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        );
    }

    #[test]
    fn finds_the_roce_v2_gid_of_an_address() {
        let d = tree();
        rxe(&d.0, "rxe0", "4: ACTIVE\n", "0a4d:0002");
        rxe(&d.0, "rxe1", "1: DOWN\n", "0a4d:0003");
        let ports = scan(&d.0);
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[0].device, "rxe0");
        assert_eq!(ports[0].state, "ACTIVE");
        assert_eq!(ports[0].gids.len(), 4, "the zero entry is unused");
        let (p, g) = roce_v2_for(&ports, Ipv4Addr::new(10, 77, 0, 2)).unwrap();
        assert_eq!((p.device.as_str(), g.index), ("rxe0", 3));
        assert_eq!(g.netdev.as_deref(), Some("eth0"));
        // The v1 entry of the same address is not taken; a port that is down is not either.
        assert!(roce_v2_for(&ports, Ipv4Addr::new(10, 77, 0, 3)).is_none());
        assert!(roce_v2_for(&ports, Ipv4Addr::new(10, 77, 0, 9)).is_none());
    }

    #[test]
    fn no_devices_and_bad_files_are_not_errors() {
        let d = tree();
        assert!(scan(&d.0.join("absent")).is_empty());
        put(&d.0, "bad0/ports/1/gids/0", "not a gid\n");
        put(&d.0, "bad0/ports/x/state", "4: ACTIVE\n");
        let ports = scan(&d.0);
        assert_eq!(ports.len(), 1);
        assert!(ports[0].gids.is_empty());
    }

    #[test]
    fn gid_text_round_trips() {
        let s = "fe80:0000:0000:0000:5054:00ff:fe77:0002";
        assert_eq!(format_gid(&parse_gid(s).unwrap()), s);
        for bad in [
            "",
            "fe80",
            "fe80:0:0:0:0:0:0:1",
            "zz80:0000:0000:0000:5054:00ff:fe77:0002",
        ] {
            assert_eq!(parse_gid(bad), None, "{bad:?}");
        }
    }
}
