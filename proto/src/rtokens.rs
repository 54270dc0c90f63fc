//! The peer's RMBs as each path of a link group reaches them (sans-IO).
//!
//! Linux registers an RMB on each link apart, so one RMB has an rkey (and may have an address)
//! per link: the CLC handshake gives the one for the connection's link, ADD LINK the new link's
//! for every RMB the peer has, CONFIRM RKEY a new RMB's for every link. Our own RMBs keep one
//! key on both links (one protection domain), so between our processes every translation is
//! the identity. A connection writes with the key of the path it posts on: [`PeerRtokens::on`].

use llc::{ConfirmRkey, RkeyPair};

/// A peer RMB as a connection addresses it: address, rkey and the path they are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRmb {
    /// Virtual address of the RMB on `path`.
    pub vaddr: u64,
    /// rkey of the RMB on `path`.
    pub rkey: u32,
    /// The path (0 or 1) the key is for.
    pub path: usize,
}

/// One peer RMB: per path, its rkey and (when known) address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry([Option<(u32, Option<u64>)>; 2]);

/// What the peer told us of its RMBs' keys per path.
#[derive(Debug, Default)]
pub struct PeerRtokens {
    rmbs: Vec<Entry>,
}

impl PeerRtokens {
    /// Whether nothing was learnt (every translation is the identity).
    pub fn is_empty(&self) -> bool {
        self.rmbs.is_empty()
    }

    fn find(&self, path: usize, rkey: u32) -> Option<usize> {
        self.rmbs
            .iter()
            .position(|e| e.0[path].is_some_and(|(k, _)| k == rkey))
    }

    /// ADD LINK's rkey entries: each RMB the peer knows on path `old` by `rkey` is reached on
    /// path `new` by `rkey_new` at `vaddr_new`. A new link on a path replaces what an earlier
    /// one there had.
    pub fn add_link(&mut self, old: usize, new: usize, pairs: &[RkeyPair]) {
        for e in &mut self.rmbs {
            e.0[new] = None;
        }
        for p in pairs {
            let i = match self.find(old, p.rkey) {
                Some(i) => i,
                None => {
                    let mut e = Entry::default();
                    e.0[old] = Some((p.rkey, None));
                    self.rmbs.push(e);
                    self.rmbs.len() - 1
                }
            };
            self.rmbs[i].0[new] = Some((p.rkey_new, Some(p.vaddr_new)));
        }
        // An RMB known on one path only translates as the identity anyway.
        self.rmbs.retain(|e| e.0.iter().flatten().count() > 1);
    }

    /// CONFIRM RKEY from the peer, received on path `on`: slot 0 is that path's key, further
    /// slots name their link, which `path_of` maps to a path (`None`: not one of ours).
    pub fn confirm(&mut self, on: usize, c: &ConfirmRkey, path_of: impl Fn(u8) -> Option<usize>) {
        let mut e = Entry::default();
        e.0[on] = Some((c.rtokens[0].rkey, Some(c.rtokens[0].vaddr)));
        let n = usize::from(c.num_additional).min(2);
        for t in &c.rtokens[1..=n] {
            if let Some(p) = path_of(t.link_id).filter(|&p| p != on) {
                e.0[p] = Some((t.rkey, Some(t.vaddr)));
            }
        }
        if e.0.iter().flatten().count() < 2 {
            return; // one link: the CLC key is all there is
        }
        match self.find(on, c.rtokens[0].rkey) {
            Some(i) => self.rmbs[i] = e,
            None => self.rmbs.push(e),
        }
    }

    /// DELETE RKEY from the peer, received on path `on`: those RMBs are gone.
    pub fn delete(&mut self, on: usize, rkeys: &[u32]) {
        self.rmbs
            .retain(|e| !e.0[on].is_some_and(|(k, _)| rkeys.contains(&k)));
    }

    /// How a connection that knows its peer RMB as `rmb` reaches it on `path`: the same
    /// when nothing else was learnt (our peers, or a single link).
    pub fn on(&self, rmb: PeerRmb, path: usize) -> PeerRmb {
        if rmb.path == path {
            return rmb;
        }
        let found = self
            .find(rmb.path, rmb.rkey)
            .and_then(|i| self.rmbs[i].0[path]);
        match found {
            Some((rkey, vaddr)) => PeerRmb {
                vaddr: vaddr.unwrap_or(rmb.vaddr),
                rkey,
                path,
            },
            None => PeerRmb { path, ..rmb },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llc::Rtoken;

    fn rmb(vaddr: u64, rkey: u32, path: usize) -> PeerRmb {
        PeerRmb { vaddr, rkey, path }
    }

    #[test]
    fn without_per_link_keys_every_path_uses_the_clc_key() {
        let mut t = PeerRtokens::default();
        assert_eq!(t.on(rmb(0x1000, 7, 0), 1), rmb(0x1000, 7, 1));
        // Our peers' ADD LINK: the same key and address on the new link.
        t.add_link(
            0,
            1,
            &[RkeyPair {
                rkey: 7,
                rkey_new: 7,
                vaddr_new: 0x1000,
            }],
        );
        assert_eq!(t.on(rmb(0x1000, 7, 0), 1), rmb(0x1000, 7, 1));
        assert_eq!(t.on(rmb(0x1000, 7, 1), 0), rmb(0x1000, 7, 0));
    }

    #[test]
    fn a_linux_add_link_gives_each_rmb_its_key_on_the_new_path_and_back() {
        let mut t = PeerRtokens::default();
        t.add_link(
            0,
            1,
            &[
                RkeyPair {
                    rkey: 0x307,
                    rkey_new: 0x1a07,
                    vaddr_new: 0x9000,
                },
                RkeyPair {
                    rkey: 0x308,
                    rkey_new: 0x1b08,
                    vaddr_new: 0xa000,
                },
            ],
        );
        let a = rmb(0x30710000000, 0x307, 0);
        assert_eq!(t.on(a, 1), rmb(0x9000, 0x1a07, 1));
        // A connection set up on the new path (its CLC key is that path's) goes back too; the
        // old path's address was never told: the connection's own is kept.
        assert_eq!(t.on(rmb(0xa000, 0x1b08, 1), 0), rmb(0xa000, 0x308, 0));
        assert_eq!(t.on(rmb(0x1, 0x999, 0), 1), rmb(0x1, 0x999, 1), "unknown");
        // The link on path 1 is replaced: its old keys are gone.
        t.add_link(
            0,
            1,
            &[RkeyPair {
                rkey: 0x307,
                rkey_new: 0x2c07,
                vaddr_new: 0xb000,
            }],
        );
        assert_eq!(t.on(a, 1), rmb(0xb000, 0x2c07, 1));
        assert_eq!(t.on(rmb(0, 0x308, 0), 1), rmb(0, 0x308, 1));
        t.delete(0, &[0x307]);
        assert!(t.is_empty());
    }

    #[test]
    fn confirm_rkey_names_the_other_links_by_id() {
        let mut t = PeerRtokens::default();
        let tok = |link_id, rkey, vaddr| Rtoken {
            link_id,
            rkey,
            vaddr,
        };
        let c = ConfirmRkey {
            response: false,
            negative: false,
            retry: false,
            num_additional: 1,
            rtokens: [tok(0, 0x40, 0x4000), tok(2, 0x41, 0x5000), tok(0, 0, 0)],
        };
        // Received on path 1; link 2 is on path 0.
        t.confirm(1, &c, |id| (id == 2).then_some(0));
        assert_eq!(t.on(rmb(0x4000, 0x40, 1), 0), rmb(0x5000, 0x41, 0));
        assert_eq!(t.on(rmb(0x5000, 0x41, 0), 1), rmb(0x4000, 0x40, 1));
        // A link id that is not ours is ignored; one key alone is nothing to learn.
        let mut u = PeerRtokens::default();
        u.confirm(1, &c, |_| None);
        assert!(u.is_empty());
    }
}
