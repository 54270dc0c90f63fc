//! Which connections may use SMC-R: `SMCR_INCLUDE` and `SMCR_EXCLUDE`, each a comma-separated
//! list of rules. A rule is a port (`6379`), a port range (`8000-8100`), an IPv4 address or
//! network (`10.1.2.3`, `10.0.0.0/8`), or a network with ports (`10.0.0.0/8:6379`,
//! `127.0.0.2:8000-8100`). A connection uses SMC-R when it matches some include rule (or no
//! include list is given) and no exclude rule. Clients match their destination; listeners
//! their bound address and port (a listener on 0.0.0.0 is matched by port-only rules and by
//! networks containing 0.0.0.0).
//!
//! Typical use: exclude short-lived connections, whose setup cost SMC-R does not repay
//! (`SMCR_EXCLUDE=53,80,443`), or restrict SMC-R to one service (`SMCR_INCLUDE=6379`).

use std::net::{Ipv4Addr, SocketAddrV4};

/// One rule: an optional network and an optional port range (at least one of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    net: Option<(u32, u8)>,
    ports: Option<(u16, u16)>,
}

impl Rule {
    fn matches(&self, a: SocketAddrV4) -> bool {
        let net_ok = self.net.is_none_or(|(base, prefix)| {
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            u32::from(*a.ip()) & mask == base & mask
        });
        let port_ok = self
            .ports
            .is_none_or(|(lo, hi)| (lo..=hi).contains(&a.port()));
        net_ok && port_ok
    }
}

/// A rule list that did not parse: which variable, which entry, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// `SMCR_INCLUDE` or `SMCR_EXCLUDE` (or the caller's name for the list).
    pub list: String,
    /// The offending entry.
    pub entry: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: bad entry {:?}: {} (rules: PORT, LO-HI, A.B.C.D[/N][:PORT[-HI]])",
            self.list, self.entry, self.why
        )
    }
}

impl std::error::Error for PolicyError {}

/// The include and exclude lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    include: Option<Vec<Rule>>,
    exclude: Vec<Rule>,
}

impl Policy {
    /// From `SMCR_INCLUDE` and `SMCR_EXCLUDE` (unset or empty: no rule).
    pub fn from_env() -> Result<Self, PolicyError> {
        let get = |k: &str| crate::env::var(k).filter(|v| !v.trim().is_empty());
        Self::parse(
            get("SMCR_INCLUDE").as_deref(),
            get("SMCR_EXCLUDE").as_deref(),
        )
    }

    /// From the two lists' texts.
    pub fn parse(include: Option<&str>, exclude: Option<&str>) -> Result<Self, PolicyError> {
        Ok(Self {
            include: include.map(|s| parse_list("SMCR_INCLUDE", s)).transpose()?,
            exclude: match exclude {
                Some(s) => parse_list("SMCR_EXCLUDE", s)?,
                None => Vec::new(),
            },
        })
    }

    /// Whether a connection to (or a listener on) `a` may use SMC-R.
    pub fn allows(&self, a: SocketAddrV4) -> bool {
        self.include
            .as_ref()
            .is_none_or(|r| r.iter().any(|r| r.matches(a)))
            && !self.exclude.iter().any(|r| r.matches(a))
    }

    /// Whether any rule is set.
    pub fn is_empty(&self) -> bool {
        self.include.is_none() && self.exclude.is_empty()
    }
}

fn parse_list(list: &str, text: &str) -> Result<Vec<Rule>, PolicyError> {
    text.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            parse_rule(e).map_err(|why| PolicyError {
                list: list.to_owned(),
                entry: e.to_owned(),
                why,
            })
        })
        .collect()
}

fn parse_rule(e: &str) -> Result<Rule, &'static str> {
    let (net, ports) = if e.contains('.') {
        match e.split_once(':') {
            Some((n, p)) => (Some(n), Some(p)),
            None => (Some(e), None),
        }
    } else {
        (None, Some(e))
    };
    let net = net
        .map(|n| {
            let (ip, prefix) = match n.split_once('/') {
                Some((ip, p)) => (
                    ip,
                    p.parse::<u8>()
                        .ok()
                        .filter(|&p| p <= 32)
                        .ok_or("prefix must be 0..=32")?,
                ),
                None => (n, 32),
            };
            let ip: Ipv4Addr = ip.parse().map_err(|_| "not an IPv4 address")?;
            Ok::<_, &'static str>((u32::from(ip), prefix))
        })
        .transpose()?;
    let ports = ports
        .map(|p| {
            let port = |s: &str| s.parse::<u16>().map_err(|_| "not a port (0..=65535)");
            let (lo, hi) = match p.split_once('-') {
                Some((lo, hi)) => (port(lo)?, port(hi)?),
                None => (port(p)?, port(p)?),
            };
            if lo > hi {
                return Err("port range runs backwards");
            }
            Ok((lo, hi))
        })
        .transpose()?;
    Ok(Rule { net, ports })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddrV4 {
        s.parse().unwrap()
    }

    #[test]
    fn no_rules_allow_everything() {
        let p = Policy::parse(None, None).unwrap();
        assert!(p.is_empty());
        assert!(p.allows(a("10.0.0.1:80")));
    }

    #[test]
    fn exclude_ports_ranges_and_networks() {
        let p = Policy::parse(None, Some("53, 8000-8100,10.0.0.0/8,192.168.1.5:6379")).unwrap();
        assert!(!p.allows(a("1.2.3.4:53")));
        assert!(!p.allows(a("1.2.3.4:8000")));
        assert!(!p.allows(a("1.2.3.4:8100")));
        assert!(p.allows(a("1.2.3.4:8101")));
        assert!(!p.allows(a("10.200.0.1:22")));
        assert!(p.allows(a("11.0.0.1:22")));
        assert!(!p.allows(a("192.168.1.5:6379")));
        assert!(p.allows(a("192.168.1.5:6380")));
        assert!(p.allows(a("192.168.1.6:6379")));
    }

    #[test]
    fn include_limits_and_exclude_wins() {
        let p = Policy::parse(Some("6379,127.0.0.0/8:9000-9010"), Some("127.0.0.9")).unwrap();
        assert!(p.allows(a("1.2.3.4:6379")));
        assert!(!p.allows(a("1.2.3.4:6380")));
        assert!(p.allows(a("127.0.0.2:9005")));
        assert!(!p.allows(a("10.0.0.2:9005")));
        assert!(!p.allows(a("127.0.0.9:6379")));
        // A /0 network and a wildcard listener.
        let p = Policy::parse(None, Some("0.0.0.0/0:22")).unwrap();
        assert!(!p.allows(a("0.0.0.0:22")));
        assert!(p.allows(a("0.0.0.0:23")));
    }

    #[test]
    fn bad_entries_are_named() {
        for (text, why) in [
            ("70000", "not a port (0..=65535)"),
            ("9-3", "port range runs backwards"),
            ("10.0.0.0/33", "prefix must be 0..=32"),
            ("10.0.0/8", "not an IPv4 address"),
            ("10.0.0.1:x", "not a port (0..=65535)"),
            ("web", "not a port (0..=65535)"),
        ] {
            let e = Policy::parse(None, Some(&format!("80,{text}"))).unwrap_err();
            assert_eq!((e.entry.as_str(), e.why), (text, why));
            assert!(e.to_string().contains("SMCR_EXCLUDE"));
        }
    }
}
