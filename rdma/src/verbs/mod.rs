//! The objects applications use, named as in libibverbs: [`Device`], [`ProtectionDomain`],
//! [`MemoryRegion`], [`CompletionQueue`] and [`QueuePair`].
//!
//! ```no_run
//! use rdma::*;
//! let dev = Device::open(DeviceConfig::new("127.0.0.1:0".parse().unwrap()))?;
//! let pd = dev.alloc_pd();
//! let mr = pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let cq = dev.create_cq()?;
//! let qp = pd.create_qp(&cq, &cq, QpCaps::default(), false)?;
//! # let (peer_qpn, peer_psn, peer_addr) = (0, Psn::new(0), "127.0.0.1:4791".parse().unwrap());
//! qp.modify(&QpAttr::state(QpState::Init))?;
//! qp.modify(&QpAttr { path_mtu: Some(Mtu::Mtu1024), dest_qp_num: Some(peer_qpn),
//!     rq_psn: Some(peer_psn), av: Some(peer_addr), ..QpAttr::state(QpState::Rtr) })?;
//! qp.modify(&QpAttr { sq_psn: Some(Psn::new(1)), ..QpAttr::state(QpState::Rts) })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cq;
mod engine_qp;
mod mr;
mod qp;

pub use cq::CompletionQueue;
pub use mr::MemoryRegion;
pub use qp::QueuePair;
#[allow(unused_imports)]
use {cq::*, engine_qp::*, mr::*, qp::*};

use crate::device::{
    CqShared, DeviceConfig, DeviceStats, EngineGuard, QpShared, Shared, run_engine,
};
use crate::ibv::{self, VerbsCq, VerbsDevice};
use crate::locks::Mutex;
use crate::mem::{MemCq, MemDev, MemQp};
use crate::mr::{Access, Region};
use crate::rc::{
    ModifyError, PostError, QpAttr, QpCaps, QpState, RcQp, RecvWr, SendFlags, SendWr, Sge,
    WorkCompletion,
};
use crate::sched::{CqScheduler, EngineSched, SchedKind};
use crate::transport::fault::FaultStats;
use crate::transport::steer::PortMode;
use rustix::fd::{AsFd, BorrowedFd};
use std::io;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// An RDMA device: our engine (a UDP socket and the engine thread serving it), or a verbs
/// device (an RNIC or the kernel's soft-RoCE, through libibverbs: [`Device::open_verbs`]).
/// The objects made from either take the same requests and give the same completions.
#[derive(Clone)]
pub struct Device {
    kind: DevKind,
}

#[derive(Clone)]
enum DevKind {
    Engine(Arc<EngineGuard>),
    /// The device and its one protection domain (every [`Device::alloc_pd`] shares it: an
    /// rkey names one region either way).
    Verbs(Arc<VerbsDevice>, Arc<ibv::Pd>),
    /// A device of an in-memory fabric ([`crate::mem`]).
    Mem(Arc<MemDev>),
}

impl Device {
    /// Opens a device and starts its engine thread.
    pub fn open(cfg: DeviceConfig) -> io::Result<Self> {
        // The thread first: without one (`crate::thread::NoThread`) nothing is opened.
        let engine = crate::thread::claim()?;
        let shared = Shared::open(cfg)?;
        let s2 = shared.clone();
        let thread = engine.run("smcr-rdma".into(), move || run_engine(s2))?;
        Ok(Self {
            kind: DevKind::Engine(Arc::new(EngineGuard {
                shared,
                thread: Mutex::new(Some(thread)),
            })),
        })
    }

    /// Opens port `port` of the verbs device `name` for the local address `ip`, whose RoCE v2
    /// GID is the port's entry `gid_index` (see [`crate::ibv::sysfs::roce_v2_for`]). `alts`
    /// are other addresses of the port, with their entries, that queue pairs may send from
    /// (`QpAttr::src`): a link group's second path on the same device.
    pub fn open_verbs(
        name: &str,
        port: u8,
        gid_index: u32,
        ip: std::net::Ipv4Addr,
        alts: &[(std::net::Ipv4Addr, u32)],
    ) -> io::Result<Self> {
        let dev = VerbsDevice::open(name, port, gid_index, SocketAddrV4::new(ip, 4791), alts)?;
        let pd = dev.alloc_pd()?;
        Ok(Self {
            kind: DevKind::Verbs(dev, pd),
        })
    }

    /// Joins the in-memory `fabric` at `ip` ([`crate::mem`]): requests run when they are
    /// posted, between devices of this process only. For tests of what drives a device.
    pub fn open_mem(fabric: &Arc<crate::mem::Fabric>, ip: std::net::Ipv4Addr) -> io::Result<Self> {
        Ok(Self {
            kind: DevKind::Mem(MemDev::open(fabric, ip)?),
        })
    }

    /// In-memory devices ([`crate::mem`]) only: while `on`, posted send requests wait, and
    /// run (in order) when it is turned off, reading their local memory then, as a verbs
    /// device reads a request's buffers when it sends them, not when they are posted. For
    /// tests of what a caller does between posting and sending. No effect on other devices.
    pub fn defer_sends(&self, on: bool) {
        if let DevKind::Mem(m) = &self.kind {
            m.defer_sends(on);
        }
    }

    /// Send requests waiting while sends are deferred (see [`Self::defer_sends`]).
    pub fn deferred_sends(&self) -> usize {
        match &self.kind {
            DevKind::Mem(m) => m.deferred_sends(),
            _ => 0,
        }
    }

    /// The verbs device behind this one (`None`: our engine, or the in-memory one).
    pub fn verbs(&self) -> Option<ibv::VerbsInfo> {
        match &self.kind {
            DevKind::Engine(_) | DevKind::Mem(_) => None,
            DevKind::Verbs(v, _) => Some(v.info()),
        }
    }

    /// Whether this is a verbs device (not our engine).
    pub fn is_verbs(&self) -> bool {
        matches!(self.kind, DevKind::Verbs(..))
    }

    fn engine(&self) -> Option<&Arc<EngineGuard>> {
        match &self.kind {
            DevKind::Engine(g) => Some(g),
            DevKind::Verbs(..) | DevKind::Mem(_) => None,
        }
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        self.engine().map(|g| &g.shared)
    }

    /// The IPv4 address and UDP port peers send to: the RoCE port (4791) for a device that
    /// shares it ([`PortMode::Steered`]) or owns it, the configured port, or, local-only, the
    /// private port.
    pub fn local_addr(&self) -> SocketAddrV4 {
        match &self.kind {
            DevKind::Engine(g) => g.shared.local,
            DevKind::Verbs(v, _) => v.addr,
            DevKind::Mem(m) => m.local_addr(),
        }
    }

    /// The address of the device's own UDP socket (its QPN range's port when it shares the
    /// RoCE port). Packets sent there directly are accepted too.
    pub fn bound_addr(&self) -> SocketAddrV4 {
        self.shared()
            .map_or_else(|| self.local_addr(), |s| s.sock.local_addr())
    }

    /// How packets reach the device (see [`crate::transport::steer`]).
    pub fn mode(&self) -> PortMode {
        match &self.kind {
            DevKind::Engine(g) => g.shared.mode,
            DevKind::Verbs(..) => PortMode::Verbs,
            // Every device of the fabric reaches every other at its address.
            DevKind::Mem(_) => PortMode::Fixed,
        }
    }

    /// Whether peers on other hosts (which send to the RoCE port) reach the device: false
    /// when it is local-only (another process owns 4791 on its address and no steering program
    /// is attached). Same-host peers reach it through shared memory either way.
    pub fn reaches_remote(&self) -> bool {
        self.mode().reaches_remote()
    }

    /// The device's QPN range: each of its QPNs is `range << 12 | index`.
    pub fn qpn_range(&self) -> u32 {
        self.shared().map_or(0, |s| s.range)
    }

    /// The device's GID (`::ffff:` + its IPv4 address), as SMC-R puts it in CLC messages.
    pub fn gid(&self) -> [u8; 16] {
        match &self.kind {
            DevKind::Engine(g) => crate::device::gid_of(*g.shared.local.ip()),
            DevKind::Verbs(v, _) => v.gid,
            DevKind::Mem(m) => crate::device::gid_of(m.ip),
        }
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        match &self.kind {
            DevKind::Engine(g) => ProtectionDomain(PdKind::Engine {
                guard: g.clone(),
                id: g.shared.next_pd.fetch_add(1, Ordering::Relaxed),
                arena: None,
            }),
            DevKind::Verbs(v, pd) => ProtectionDomain(PdKind::Verbs(v.clone(), pd.clone())),
            DevKind::Mem(m) => ProtectionDomain(PdKind::Mem {
                dev: m.clone(),
                id: m.next_pd.fetch_add(1, Ordering::Relaxed),
            }),
        }
    }

    /// Allocates a protection domain whose memory regions live in shared memory (a sealed
    /// memfd of up to 4 GiB, used as regions are registered), so that its queue pairs can use
    /// the same-host transport with peers on this host and in this network namespace: an RDMA
    /// WRITE becomes a copy into the peer's region, a SEND an entry in a shared ring (see
    /// `docs/rdma.md`). Peers elsewhere are reached over UDP as usual. A same-host peer (of
    /// the same user) can reach every region of the domain, so use one domain per peer. On a
    /// verbs device this is [`Self::alloc_pd`] (the device reaches same-host peers itself).
    pub fn alloc_shared_pd(&self) -> io::Result<ProtectionDomain> {
        match &self.kind {
            DevKind::Engine(g) => Ok(ProtectionDomain(PdKind::Engine {
                guard: g.clone(),
                id: g.shared.next_pd.fetch_add(1, Ordering::Relaxed),
                arena: Some(crate::arena::Arena::create()?),
            })),
            DevKind::Verbs(..) | DevKind::Mem(_) => Ok(self.alloc_pd()),
        }
    }

    /// Creates a completion queue.
    pub fn create_cq(&self) -> io::Result<CompletionQueue> {
        Ok(CompletionQueue(match &self.kind {
            DevKind::Engine(g) => CqKind::Engine {
                shared: Arc::new(CqShared::new()?),
                guard: g.clone(),
            },
            DevKind::Verbs(v, _) => CqKind::Verbs(v.create_cq()?),
            DevKind::Mem(_) => CqKind::Mem(MemCq::new()?),
        }))
    }

    /// Counters.
    pub fn stats(&self) -> DeviceStats {
        self.shared().map(|s| s.stats()).unwrap_or_default()
    }

    /// Counters of the fault injector, when one is configured.
    pub fn fault_stats(&self) -> Option<FaultStats> {
        self.shared()?.fault_stats()
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("addr", &self.local_addr())
            .field("mode", &self.mode())
            .field("range", &self.qpn_range())
            .field("verbs", &self.verbs())
            .finish()
    }
}

/// A protection domain: memory regions and queue pairs of one domain only work together.
pub struct ProtectionDomain(PdKind);

enum PdKind {
    Engine {
        guard: Arc<EngineGuard>,
        id: u32,
        arena: Option<Arc<crate::arena::Arena>>,
    },
    Verbs(Arc<VerbsDevice>, Arc<ibv::Pd>),
    Mem {
        dev: Arc<MemDev>,
        id: u32,
    },
}

impl ProtectionDomain {
    /// Allocates `len` bytes of zeroed, page-aligned memory and registers it (`ibv_reg_mr`).
    pub fn reg_mr(&self, len: usize, access: Access) -> io::Result<MemoryRegion> {
        match &self.0 {
            PdKind::Engine { guard, id, arena } => {
                let region = guard
                    .shared
                    .mrs
                    .register_in(*id, len, access, arena.as_ref())?;
                Ok(MemoryRegion(MrKind::Engine(EngineMr {
                    region,
                    guard: guard.clone(),
                })))
            }
            PdKind::Verbs(_, pd) => Ok(MemoryRegion(MrKind::Verbs(Arc::new(
                pd.reg_mr(len, access)?,
            )))),
            PdKind::Mem { dev, id } => Ok(MemoryRegion(MrKind::Mem(MemMr {
                region: dev.mrs.register(*id, len, access)?,
                dev: dev.clone(),
            }))),
        }
    }

    /// Registers the memory of `mr` (of this or another device) again in this domain
    /// (`ibv_reg_mr` of an already registered buffer): a second link of an SMC-R link group
    /// reaches the same RMB with its own rkey. The alias keeps the memory alive; dropping it
    /// deregisters only its own key. Refused for memory of a shared (same-host) domain, and
    /// between our engine and a verbs device.
    pub fn reg_alias(&self, mr: &MemoryRegion, access: Access) -> io::Result<MemoryRegion> {
        match (&self.0, &mr.0) {
            (PdKind::Engine { arena: Some(_), .. }, _) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "aliases are registered in private domains only",
            )),
            (PdKind::Engine { guard, id, .. }, MrKind::Engine(m)) => {
                let region = guard.shared.mrs.register_alias(*id, &m.region, access)?;
                Ok(MemoryRegion(MrKind::Engine(EngineMr {
                    region,
                    guard: guard.clone(),
                })))
            }
            (PdKind::Verbs(_, pd), MrKind::Verbs(m)) => Ok(MemoryRegion(MrKind::Verbs(Arc::new(
                pd.reg_alias(m, access)?,
            )))),
            (PdKind::Mem { dev, id }, MrKind::Mem(m)) => Ok(MemoryRegion(MrKind::Mem(MemMr {
                region: dev.mrs.register_alias(*id, &m.region, access)?,
                dev: dev.clone(),
            }))),
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a region can only alias one of the same kind of device",
            )),
        }
    }

    /// Creates an RC queue pair in the RESET state (`ibv_create_qp`). With `sq_sig_all`, every
    /// send request produces a completion.
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        sq_sig_all: bool,
    ) -> io::Result<QueuePair> {
        let (guard, id, arena) = match (&self.0, &send_cq.0, &recv_cq.0) {
            (PdKind::Engine { guard, id, arena }, ..) => (guard, *id, arena),
            (PdKind::Verbs(dev, pd), CqKind::Verbs(s), CqKind::Verbs(r)) => {
                let qp = ibv::Qp::create(pd, &s.cq, &r.cq, &caps, sq_sig_all)?;
                let tracks = Arc::new(ibv::Tracks::default());
                s.track(qp.qp_num(), tracks.clone());
                r.track(qp.qp_num(), tracks.clone());
                return Ok(QueuePair(QpKind::Verbs(VerbsQp {
                    qp,
                    dev: dev.clone(),
                    state: Mutex::new(QpState::Reset),
                    send_cq: s.clone(),
                    recv_cq: r.clone(),
                    tracks,
                    sgid: std::sync::atomic::AtomicU8::new(dev.sgid_index),
                    sq_sig_all,
                    posting: Mutex::new(()),
                })));
            }
            (PdKind::Verbs(..), ..) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a verbs queue pair needs completion queues of its own device",
                ));
            }
            (PdKind::Mem { dev, id }, CqKind::Mem(s), CqKind::Mem(r)) => {
                return Ok(QueuePair(QpKind::Mem(dev.create_qp(
                    *id,
                    (s, r),
                    caps,
                    sq_sig_all,
                ))));
            }
            (PdKind::Mem { .. }, ..) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "an in-memory queue pair needs in-memory completion queues",
                ));
            }
        };
        let (
            CqKind::Engine {
                shared: send_cq, ..
            },
            CqKind::Engine {
                shared: recv_cq, ..
            },
        ) = (&send_cq.0, &recv_cq.0)
        else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an engine queue pair needs the engine's completion queues",
            ));
        };
        let shared = &guard.shared;
        let qpn = shared.alloc_qpn().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                "all 4095 QP numbers of the device's range are in use",
            )
        })?;
        let rc = RcQp::new(qpn, id, caps, sq_sig_all);
        let shm = match arena {
            Some(a) => Some(crate::samehost::ShmQp::new(a.clone())?),
            None => None,
        };
        let same_host = shm.is_some();
        let qp = Arc::new(QpShared::new(
            shared,
            rc,
            send_cq.clone(),
            recv_cq.clone(),
            shm,
        ));
        shared.qps.write().insert(qpn, qp.clone());
        if same_host {
            let mut list = recv_cq.shm_qps.lock();
            // (Pruned here too: polling, which prunes, skips CQs with no live ring.)
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&qp));
        }
        Ok(QueuePair(QpKind::Engine(EngineQp {
            qp,
            guard: guard.clone(),
        })))
    }
}
