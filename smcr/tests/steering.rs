//! The steering program as the runtime uses it: a root runtime attaches it in its own network
//! namespace (or finds it pinned), and without it a second runtime of an address is local-only
//! and names the remedy. The program itself is tested in `bpf/src/steer.rs`.

mod common;

use std::fs;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use smcr::error::Unreachable;
use smcr::steer::{PortMode, SteerAttach, local_only_diagnosis, netns_inode, status, uninstall};
use smcr::{Negotiation, Runtime, RuntimeConfig};

/// Runs `f` in a new network namespace with `lo` up (deleted afterwards).
fn in_new_netns<T: Send + 'static>(tag: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let name = format!("smcr-steer-{}-{tag}", std::process::id());
    let ip = |args: &[&str]| {
        let st = std::process::Command::new("ip")
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&["netns", "add", &name]);
    ip(&["-n", &name, "link", "set", "lo", "up"]);
    let path = format!("/var/run/netns/{name}");
    let r = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a namespace descriptor; CLONE_NEWNET switches only this thread.
        assert_eq!(
            unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) },
            0
        );
        f()
    })
    .join();
    ip(&["netns", "del", &name]);
    r.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn runtime(dir: &Path, attach: SteerAttach) -> Runtime {
    let mut cfg = RuntimeConfig::new();
    cfg.negotiation = Negotiation::TcpOption { dir: dir.into() };
    cfg.stats_dir = None;
    cfg.steer_attach = attach;
    Runtime::new(cfg)
}

/// A root runtime in a namespace without steering attaches it (policy `load`) before it
/// opens its device, which is then steered; `pinned` finds it there in the next namespace
/// and attaches it too, and a second runtime of the namespace is steered as well.
#[test]
fn a_root_runtime_attaches_steering_in_its_namespace() {
    if !common::privileged("a_root_runtime_attaches_steering_in_its_namespace") {
        return;
    }
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/smcr-steer-unit-{}",
        std::process::id()
    ));
    let d = dir.clone();
    let r = std::panic::catch_unwind(move || {
        in_new_netns("load", {
            let d = d.clone();
            move || {
                let rt = runtime(&d, SteerAttach::Load);
                assert_eq!(
                    rt.device_mode(Ipv4Addr::LOCALHOST).unwrap(),
                    PortMode::Steered
                );
                let ns = netns_inode().unwrap();
                // Our pinned link on this namespace's loopback (ifindex 1) is attached.
                assert!(
                    status(&d)
                        .links
                        .iter()
                        .any(|l| l.netns == ns && l.ifindex == 1 && l.live == Some(true)),
                    "{:?}",
                    status(&d)
                );
                let rt2 = runtime(&d, SteerAttach::Off);
                assert_eq!(
                    rt2.device_mode(Ipv4Addr::LOCALHOST).unwrap(),
                    PortMode::Steered
                );
                let remote = Ipv4Addr::new(192, 0, 2, 1);
                assert_eq!(
                    rt2.device_reaches(Ipv4Addr::LOCALHOST, remote).unwrap(),
                    Ok(())
                );
            }
        });
        in_new_netns("pinned", move || {
            let rt = runtime(&d, SteerAttach::Pinned);
            assert_eq!(
                rt.device_mode(Ipv4Addr::LOCALHOST).unwrap(),
                PortMode::Steered
            );
        });
    });
    let _ = uninstall(&dir);
    let _ = fs::remove_dir(&dir);
    r.unwrap_or_else(|e| std::panic::resume_unwind(e));
}

/// Without steering (policy `off`, nothing pinned): the first runtime of an address owns
/// 4791, the next is local-only — it serves a peer on this host, and declines one
/// elsewhere with the diagnosis that names the remedy.
#[test]
fn a_local_only_runtime_refuses_remote_peers_with_the_remedy() {
    if !common::privileged("a_local_only_runtime_refuses_remote_peers_with_the_remedy") {
        return;
    }
    in_new_netns("local", || {
        let dir = Path::new("/nonexistent/smcr");
        let lo = Ipv4Addr::LOCALHOST;
        let first = runtime(dir, SteerAttach::Pinned);
        assert_eq!(first.device_mode(lo).unwrap(), PortMode::Owner);
        let second = runtime(dir, SteerAttach::Off);
        assert_eq!(second.device_mode(lo).unwrap(), PortMode::LocalOnly);
        assert_eq!(second.device_reaches(lo, lo).unwrap(), Ok(()));
        let why = second
            .device_reaches(lo, Ipv4Addr::new(192, 0, 2, 1))
            .unwrap()
            .unwrap_err();
        assert_eq!(why, Unreachable::LocalOnly { ip: lo });
        assert_eq!(why.to_string(), local_only_diagnosis(lo));
        assert_eq!(
            first
                .device_reaches(lo, Ipv4Addr::new(192, 0, 2, 1))
                .unwrap(),
            Ok(())
        );
    });
}
