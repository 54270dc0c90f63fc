//! One configuration for every process running smcr: each setting, where it may come from, and
//! how it is checked.
//!
//! A setting has a name in the configuration file ([`DEFAULT_FILE`], or the file
//! `SMCR_CONFIG` names) and an `SMCR_*` environment variable. The environment wins over the
//! file, the file over the default. Where Linux has a `net.smc` sysctl for the same thing the
//! file takes its name and unit (`net.smc.rmem` in bytes, `net.smc.smcr_testlink_time` in
//! seconds); the others live under `[smcr]`. [`SETTINGS`] is the one list: the file parser,
//! the checks at start, `smcr config` and docs/running.md follow it.
//!
//! The preload reads the file when it is loaded ([`load_process`]) and hands its values to
//! the process's snapshot of settings ([`crate::env`]): every reader in every crate then sees
//! the file's values where the environment sets none. Then [`check_process`] validates every
//! setting; one that does not parse leaves the whole process on TCP, named in the log
//! (which setting the user meant cannot be guessed). `smcr run` refuses to start a program
//! with such a setting instead.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use toml::de::{DeTable, DeValue};

/// The configuration file read when `SMCR_CONFIG` does not name another one (a missing one is
/// no error: every setting then has its default or the environment's value).
pub const DEFAULT_FILE: &str = "/etc/smcr.toml";

/// The variable naming the configuration file (`off`: read none).
pub const FILE_VAR: &str = "SMCR_CONFIG";

/// What a setting takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On or off.
    Flag,
    /// A whole number (the unit in words).
    Whole(&'static str),
    /// A whole number up to a limit (the unit and limit in words, the limit).
    WholeUpTo(&'static str, u64),
    /// `net.smc.rmem`: bytes in the file, KiB in the variable (rounded up).
    RmemBytes,
    /// A UDP port, 1..=65535.
    Port,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A list of user EIDs.
    Ueids,
    /// A list of IPv4 addresses.
    Addrs,
    /// A list of include/exclude rules ([`crate::policy`]).
    Rules,
    /// A path.
    Path,
    /// A directory, or `off`.
    DirOrOff,
    /// A `log` level.
    LogLevel,
    /// The RoCE engine's fault injection (tests).
    Faults,
}

impl Kind {
    /// What a value must look like (for errors and `smcr config --list`).
    pub fn expected(self) -> &'static str {
        match self {
            Self::Flag => "on or off (also 1/0, yes/no, true/false)",
            Self::Whole(unit) | Self::WholeUpTo(unit, _) => unit,
            Self::RmemBytes => "bytes, a whole number (at least 16384)",
            Self::Port => "a UDP port, 1-65535",
            Self::Choice(_) => "one of the words listed by `smcr config --list`",
            Self::Ueids => "UEIDs: 1 to 32 of A-Z, 0-9, . and - (a list, or comma-separated)",
            Self::Addrs => "IPv4 addresses (a list, or comma-separated)",
            Self::Rules => {
                "rules: PORT, LO-HI, A.B.C.D[/N][:PORT[-HI]] (a list, or comma-separated)"
            }
            Self::Path => "a path",
            Self::DirOrOff => "a directory, or off",
            Self::LogLevel => "off, error, warn, info, debug or trace",
            Self::Faults => "drop=P,dup=P,reorder=P,corrupt=P,delay=MS,jitter=MS,seed=N",
        }
    }

    /// Whether the file may give a list (joined with commas for the variable).
    fn is_list(self) -> bool {
        matches!(self, Self::Ueids | Self::Addrs | Self::Rules)
    }
}

/// One setting.
#[derive(Debug, PartialEq, Eq)]
pub struct Setting {
    /// Its name in the configuration file (a dotted TOML key).
    pub key: &'static str,
    /// Its environment variable.
    pub var: &'static str,
    /// What it takes.
    pub kind: Kind,
    /// Its default, in words.
    pub default: &'static str,
    /// What it does.
    pub about: &'static str,
}

mod table;
use table::NOT_SETTINGS;
pub use table::SETTINGS;

/// The setting named `name`: a file key or a variable.
pub fn find(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.key == name || s.var == name)
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Nobody set it.
    Default,
    /// The configuration file, at this line (1-based).
    File {
        /// The file.
        path: PathBuf,
        /// The line of the entry.
        line: usize,
    },
    /// The environment.
    Env,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::File { path, line } => write!(f, "{}:{line}", path.display()),
            Self::Env => f.write_str("environment"),
        }
    }
}

/// A configuration that cannot be used, naming what is wrong and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    /// A value that does not parse.
    #[error("{}", value_error(.setting, .origin, .value))]
    Value {
        /// The setting.
        setting: &'static Setting,
        /// Where the value came from.
        origin: Origin,
        /// The value as given (in the file: as TOML would print it).
        value: String,
    },
    /// A key in the file that is no setting.
    #[error("{}:{line}: {key} is not a setting of smcr ({why})", path.display())]
    Unknown {
        /// The file.
        path: PathBuf,
        /// The line of the entry.
        line: usize,
        /// The key.
        key: String,
        /// Why it is not (a Linux sysctl we do not have), or where the settings are listed.
        why: String,
    },
    /// The file is not TOML.
    #[error("{}:{line}: not valid TOML: {message}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// Where the parser stopped.
        line: usize,
        /// What it says.
        message: String,
    },
    /// The file cannot be read.
    #[error("{}: cannot be read: {error}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        error: String,
    },
}

fn value_error(s: &Setting, origin: &Origin, value: &str) -> String {
    let expected = match (s.kind, origin) {
        (Kind::Choice(words), _) => words.join(", "),
        // The variable of net.smc.rmem is in KiB.
        (Kind::RmemBytes, Origin::Env) => "KiB, a whole number".to_owned(),
        (k, _) => k.expected().to_owned(),
    };
    match origin {
        Origin::File { path, line } => format!(
            "{}:{line}: {} = {value} is not valid ({expected})",
            path.display(),
            s.key
        ),
        _ => format!("{}={value:?} is not valid ({expected})", s.var),
    }
}

/// One entry of a configuration file: the setting, its value as the variable takes it, its
/// value as written, and its line.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The setting.
    pub setting: &'static Setting,
    /// The value in the variable's form (lists joined with commas, booleans `on`/`off`,
    /// `net.smc.rmem` in KiB).
    pub value: String,
    /// The value as written in the file.
    pub written: String,
    /// Its line (1-based).
    pub line: usize,
}

/// A configuration file, read and checked.
#[derive(Debug, Clone)]
pub struct File {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its entries, in the order of the file.
    pub entries: Vec<Entry>,
}

impl File {
    /// The file's value for the variable `var`.
    pub fn get(&self, var: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.setting.var == var)
    }

    /// The values by variable name (what [`crate::env::snapshot_over`] takes).
    pub fn vars(&self) -> HashMap<String, String> {
        self.entries
            .iter()
            .map(|e| (e.setting.var.to_owned(), e.value.clone()))
            .collect()
    }

    /// Parses `text` (read from `path`): a TOML document whose keys are settings' file names
    /// (`net.smc.rmem = 524288`, or `rmem = 524288` under `[net.smc]`). Every entry is
    /// checked: an unknown key or a value that does not parse is an error naming its line (a
    /// key given twice is not TOML: each setting has one key, and the parser refuses it).
    pub fn parse(path: &Path, text: &str) -> Result<Self, SettingError> {
        let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        let doc = DeTable::parse(text).map_err(|e| SettingError::Syntax {
            path: path.to_owned(),
            line: e.span().map_or(1, |s| line_of(s.start)),
            message: e.message().trim().to_owned(),
        })?;
        let mut leaves = Vec::new();
        flatten(String::new(), doc.get_ref(), &mut leaves);
        leaves.sort_by_key(|l| l.2);
        let mut entries: Vec<Entry> = Vec::new();
        for (key, value, offset) in leaves {
            let line = line_of(offset);
            let Some(setting) = SETTINGS.iter().find(|s| s.key == key) else {
                let why = match NOT_SETTINGS.iter().find(|(k, _)| *k == key) {
                    Some((_, why)) => format!("Linux's sysctl has no counterpart here: {why}"),
                    None => "`smcr config --list` lists the settings".to_owned(),
                };
                return Err(SettingError::Unknown {
                    path: path.to_owned(),
                    line,
                    key,
                    why,
                });
            };
            let bad = |written: String| SettingError::Value {
                setting,
                origin: Origin::File {
                    path: path.to_owned(),
                    line,
                },
                value: written,
            };
            let written = show(value);
            let as_var = to_var_form(setting.kind, value).ok_or_else(|| bad(written.clone()))?;
            check(setting, &as_var).map_err(|()| bad(written.clone()))?;
            entries.push(Entry {
                setting,
                value: as_var,
                written,
                line,
            });
        }
        Ok(Self {
            path: path.to_owned(),
            entries,
        })
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> Result<Self, SettingError> {
        let text = std::fs::read_to_string(path).map_err(|e| SettingError::Unreadable {
            path: path.to_owned(),
            error: e.to_string(),
        })?;
        Self::parse(path, &text)
    }
}

/// The leaves of a TOML table as (dotted key, value, byte offset of the key).
fn flatten<'a>(
    prefix: String,
    t: &'a DeTable<'_>,
    out: &mut Vec<(String, &'a DeValue<'a>, usize)>,
) {
    for (k, v) in t.iter() {
        let key = if prefix.is_empty() {
            k.get_ref().to_string()
        } else {
            format!("{prefix}.{}", k.get_ref())
        };
        match v.get_ref() {
            DeValue::Table(inner) => flatten(key, inner, out),
            value => out.push((key, value, k.span().start)),
        }
    }
}

/// A TOML value as it was written (near enough for an error message).
fn show(v: &DeValue<'_>) -> String {
    match v {
        DeValue::String(s) => format!("{s:?}"),
        DeValue::Integer(i) => i.to_string(),
        DeValue::Float(f) => f.to_string(),
        DeValue::Boolean(b) => b.to_string(),
        DeValue::Datetime(d) => d.to_string(),
        DeValue::Array(a) => format!(
            "[{}]",
            a.iter()
                .map(|v| show(v.get_ref()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        DeValue::Table(_) => "{...}".to_owned(),
    }
}

/// A file value in the form the variable takes, if its TOML type fits the setting.
fn to_var_form(kind: Kind, v: &DeValue<'_>) -> Option<String> {
    let scalar = |v: &DeValue<'_>| match v {
        DeValue::String(s) => Some(s.to_string()),
        DeValue::Integer(i) if i.radix() == 10 => Some(i.as_str().to_owned()),
        DeValue::Integer(i) => u64::from_str_radix(i.as_str(), i.radix())
            .ok()
            .map(|n| n.to_string()),
        DeValue::Boolean(b) if kind == Kind::Flag => Some(if *b { "on" } else { "off" }.into()),
        _ => None,
    };
    match (kind, v) {
        (Kind::RmemBytes, v) => {
            let bytes: u64 = scalar(v)?.trim().parse().ok()?;
            (bytes >= 16 * 1024).then(|| bytes.div_ceil(1024).to_string())
        }
        (k, DeValue::Array(items)) if k.is_list() => items
            .iter()
            .map(|i| match i.get_ref() {
                DeValue::String(s) if !s.contains(',') => Some(s.to_string()),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(|v| v.join(",")),
        (_, v) => scalar(v),
    }
}

/// Whether `value` (in the variable's form) is one `setting` takes.
fn check(setting: &Setting, value: &str) -> Result<(), ()> {
    let v = value.trim();
    let list = || v.split(',').map(str::trim).filter(|e| !e.is_empty());
    let ok = match setting.kind {
        Kind::Flag => crate::runtime::config_flag(v).is_some(),
        Kind::Whole(_) | Kind::RmemBytes => v.parse::<u64>().is_ok(),
        Kind::WholeUpTo(_, max) => v.parse::<u64>().is_ok_and(|n| n <= max),
        Kind::Port => v.parse::<u16>().is_ok_and(|p| p != 0),
        Kind::Choice(words) => words.contains(&v),
        Kind::Ueids => list().all(|u| clc::Eid::new(u).is_ok()),
        Kind::Addrs => list().all(|a| a.parse::<std::net::Ipv4Addr>().is_ok()),
        Kind::Rules => crate::policy::Policy::parse(Some(v), None).is_ok(),
        Kind::Path | Kind::DirOrOff => true,
        Kind::LogLevel => v.parse::<log::LevelFilter>().is_ok(),
        Kind::Faults => v.parse::<rdma::FaultConfig>().is_ok(),
    };
    if ok { Ok(()) } else { Err(()) }
}

/// The file a process reads: `SMCR_CONFIG`'s (`off`: none), else [`DEFAULT_FILE`] if it
/// exists. `get` reads the environment.
pub fn file_path(get: &dyn Fn(&str) -> Option<String>) -> Option<(PathBuf, bool)> {
    match get(FILE_VAR).filter(|p| !p.trim().is_empty()) {
        Some(p) if p.trim() == "off" => None,
        Some(p) => Some((PathBuf::from(p), true)),
        None => Some((PathBuf::from(DEFAULT_FILE), false)),
    }
}

/// Reads the configuration file `get`'s environment names (or the default one): `Ok(None)`
/// when there is none to read (a default file that does not exist).
pub fn read_file(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<File>, SettingError> {
    match file_path(get) {
        None => Ok(None),
        Some((p, false)) if !p.exists() => Ok(None),
        Some((p, _)) => File::read(&p).map(Some),
    }
}

/// A setting's value in effect and where it came from.
#[derive(Debug, Clone)]
pub struct Effective {
    /// The setting.
    pub setting: &'static Setting,
    /// Its value as given (the variable's text, the file's TOML), or the default in words.
    pub value: String,
    /// Where it came from.
    pub origin: Origin,
}

/// Every setting's value in effect for `env` (the environment's `SMCR_*` values) over `file`,
/// checked: the first that does not parse is the error.
pub fn resolve(
    env: &dyn Fn(&str) -> Option<String>,
    file: Option<&File>,
) -> Result<Vec<Effective>, SettingError> {
    let mut out = Vec::with_capacity(SETTINGS.len());
    for s in SETTINGS {
        let e = match env(s.var).filter(|v| !v.trim().is_empty()) {
            Some(v) => {
                if check(s, &v).is_err() {
                    return Err(SettingError::Value {
                        setting: s,
                        origin: Origin::Env,
                        value: v,
                    });
                }
                Effective {
                    setting: s,
                    value: v,
                    origin: Origin::Env,
                }
            }
            None => match file.and_then(|f| f.get(s.var).map(|e| (f, e))) {
                Some((f, e)) => Effective {
                    setting: s,
                    value: e.written.clone(),
                    origin: Origin::File {
                        path: f.path.clone(),
                        line: e.line,
                    },
                },
                None => Effective {
                    setting: s,
                    value: s.default.to_owned(),
                    origin: Origin::Default,
                },
            },
        };
        out.push(e);
    }
    Ok(out)
}

/// An on/off setting of the process ([`crate::env::var`]): `None` when unset or not a flag
/// (a value [`check_process`] refuses).
pub fn flag(var: &str) -> Option<bool> {
    crate::runtime::config_flag(&crate::env::var(var)?)
}

/// `SMCR_SPARE_THREADS` of the process ([`crate::env::var`]): how many threads the preload
/// keeps parked (`rdma::thread`); the default when unset (or refused by [`check_process`]).
pub fn spare_threads() -> usize {
    crate::env::var("SMCR_SPARE_THREADS")
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n <= 256)
        .unwrap_or(rdma::thread::DEFAULT_TARGET)
}

/// A setting's value for a tool (`smcr`, `smc-stat`) that follows the programs' settings:
/// the environment's, else the configuration file's (a file that cannot be used is left
/// out here: `smcr config` names its problem).
pub fn for_tools(var: &str) -> Option<String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    env(var).or_else(|| {
        let file = read_file(&env).ok()??;
        file.get(var).map(|e| e.value.clone())
    })
}

/// What [`load_process`] found: the file (if any) or the error that made it unusable.
static LOADED: OnceLock<Result<Option<File>, SettingError>> = OnceLock::new();

/// Reads the process's configuration file and takes its snapshot of settings (once; the
/// preload calls it when it is loaded). A file that cannot be used is not read at all: the
/// error is kept for [`check_process`].
pub fn load_process() {
    let loaded = LOADED.get_or_init(|| read_file(&|k| std::env::var(k).ok()));
    crate::env::snapshot_over(match loaded {
        Ok(Some(f)) => f.vars(),
        _ => HashMap::new(),
    });
}

/// Whether the process's configuration can be used: the file read by [`load_process`] and
/// every setting of the snapshot (environment over file). The first problem is the error.
pub fn check_process() -> Result<(), SettingError> {
    let file = match LOADED.get() {
        Some(Err(e)) => return Err(e.clone()),
        Some(Ok(f)) => f.as_ref(),
        None => None,
    };
    resolve(
        &|k| {
            crate::env::from_environment(k)
                .then(|| crate::env::var(k))
                .flatten()
        },
        file,
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<File, SettingError> {
        File::parse(Path::new("/etc/smcr.toml"), text)
    }

    fn env(vars: &[(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        let vars = vars.to_vec();
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn every_setting_has_one_key_and_one_variable() {
        for (i, s) in SETTINGS.iter().enumerate() {
            assert!(s.var.starts_with("SMCR_"), "{}", s.var);
            assert!(s.key.starts_with("smcr.") || s.key.starts_with("net.smc."));
            assert!(
                SETTINGS[i + 1..]
                    .iter()
                    .all(|o| o.key != s.key && o.var != s.var),
                "{} twice",
                s.key
            );
        }
    }

    #[test]
    fn a_file_takes_both_spellings_of_a_key_and_converts_values() {
        let f = parse(
            "# comment\n\
             net.smc.rmem = 131072\n\
             net.smc.smcr_testlink_time = 0\n\
             [smcr]\n\
             ueid = [\"SMC-A\", \"SMC-B\"]\n\
             same_host = false\n\
             roce_port = 4800\n",
        )
        .unwrap();
        let v = f.vars();
        assert_eq!(v["SMCR_RMB_KIB"], "128");
        assert_eq!(v["SMCR_UEID"], "SMC-A,SMC-B");
        assert_eq!(v["SMCR_SAME_HOST"], "off");
        assert_eq!(v["SMCR_ROCE_PORT"], "4800");
        assert_eq!(v["SMCR_TESTLINK_TIME"], "0");
        assert_eq!(f.get("SMCR_UEID").unwrap().line, 5);
        assert_eq!(f.get("SMCR_TESTLINK_TIME").unwrap().line, 3);
        // A section works as well as a dotted key.
        let f = parse("[net.smc]\nrmem = 65536\n").unwrap();
        assert_eq!(f.vars()["SMCR_RMB_KIB"], "64");
        // rmem rounds up to whole KiB, as Linux rounds a buffer size up.
        assert_eq!(
            parse("net.smc.rmem = 20000").unwrap().vars()["SMCR_RMB_KIB"],
            "20"
        );
    }

    /// Each kind of bad entry is refused naming the file, its line and the key.
    #[test]
    fn each_kind_of_bad_entry_is_named_with_its_line() {
        for (text, line, needle) in [
            (
                "\nnet.smc.rmem = \"64k\"",
                2,
                "net.smc.rmem = \"64k\" is not valid (bytes",
            ),
            ("net.smc.rmem = 4096", 1, "net.smc.rmem = 4096 is not valid"),
            (
                "smcr.roce_port = 70000",
                1,
                "smcr.roce_port = 70000 is not valid (a UDP port",
            ),
            ("smcr.roce_port = 0", 1, "smcr.roce_port = 0"),
            (
                "smcr.same_host = \"maybe\"",
                1,
                "smcr.same_host = \"maybe\" is not valid (on or off",
            ),
            ("smcr.same_host = 2", 1, "smcr.same_host = 2"),
            ("smcr.negotiation = \"perhaps\"", 1, "(option, assume)"),
            (
                "smcr.ueid = [\"lower\"]",
                1,
                "smcr.ueid = [\"lower\"] is not valid (UEIDs",
            ),
            ("smcr.ueid = [1]", 1, "smcr.ueid = [1]"),
            ("smcr.alt_addrs = \"fe80::1\"", 1, "IPv4 addresses"),
            ("smcr.include = [\"10.0.0.0/33\"]", 1, "smcr.include"),
            (
                "smcr.lgr_linger = 1.5",
                1,
                "smcr.lgr_linger = 1.5 is not valid (seconds",
            ),
            ("smcr.hold_us = -5", 1, "smcr.hold_us = -5"),
            (
                "smcr.ack_delay_us = 500",
                1,
                "smcr.ack_delay_us = 500 is not valid (microseconds",
            ),
            ("smcr.log_level = \"loud\"", 1, "(off, error, warn"),
            ("smcr.rdma_faults = \"drop=2\"", 1, "smcr.rdma_faults"),
            ("[smcr]\nspin_us = true", 2, "smcr.spin_us = true"),
            (
                "\n\nsmcr.nonsense = 1",
                3,
                "smcr.nonsense is not a setting of smcr",
            ),
            (
                "net.smc.wmem = 65536",
                1,
                "Linux's sysctl has no counterpart here: the send buffer",
            ),
            (
                "smcr.roce_port = 1\n[smcr]\nroce_port = 2",
                2,
                "not valid TOML",
            ),
            (
                "smcr.roce_port = 4800\nsmcr.hold_us = 1\nsmcr = 3",
                3,
                "not valid TOML",
            ),
            ("smcr.roce_port = = 3", 1, "not valid TOML"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("/etc/smcr.toml:{line}: ")) && e.contains(needle),
                "{text:?}: {e}"
            );
        }
        let e = File::read(Path::new("/nonexistent/smcr.toml")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/smcr.toml: cannot be read"),
            "{e}"
        );
    }

    /// Environment over file over default; each value says where it came from.
    #[test]
    fn the_environment_wins_over_the_file_over_the_default() {
        let f = parse("smcr.roce_port = 4800\nsmcr.hold_us = 5\n").unwrap();
        let eff = resolve(&env(&[("SMCR_HOLD_US", "7")]), Some(&f)).unwrap();
        let get = |var: &str| eff.iter().find(|e| e.setting.var == var).unwrap();
        assert_eq!(get("SMCR_HOLD_US").value, "7");
        assert_eq!(get("SMCR_HOLD_US").origin, Origin::Env);
        assert_eq!(get("SMCR_ROCE_PORT").value, "4800");
        assert_eq!(
            get("SMCR_ROCE_PORT").origin,
            Origin::File {
                path: "/etc/smcr.toml".into(),
                line: 1
            }
        );
        assert_eq!(get("SMCR_LGR_LINGER").value, "600");
        assert_eq!(get("SMCR_LGR_LINGER").origin, Origin::Default);
        // And the runtime built from the layered values takes them.
        let vars = f.vars();
        let lookup = |k: &str| env(&[("SMCR_HOLD_US", "7")])(k).or_else(|| vars.get(k).cloned());
        let cfg = crate::RuntimeConfig::from_lookup(&lookup, true).unwrap();
        assert_eq!(cfg.roce_port, 4800);
        assert_eq!(cfg.app_hold, std::time::Duration::from_micros(7));
    }

    #[test]
    fn a_bad_variable_is_named_even_over_a_good_file_value() {
        let f = parse("smcr.write_pad = true").unwrap();
        let e = resolve(&env(&[("SMCR_WRITE_PAD", "2")]), Some(&f)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "SMCR_WRITE_PAD=\"2\" is not valid (on or off (also 1/0, yes/no, true/false))"
        );
    }

    /// Every spelling the runtime takes passes the check at start, and the runtime takes
    /// every spelling the check lets through (no value refused by one and used by the other).
    #[test]
    fn the_check_and_the_runtime_take_the_same_steering_words() {
        for w in [
            "pinned",
            "on",
            "1",
            "yes",
            "load",
            "off",
            "0",
            "no",
            "sometimes",
        ] {
            let checked = resolve(&env(&[("SMCR_STEER_ATTACH", w)]), None).is_ok();
            let parsed = crate::steer::SteerAttach::parse(w).is_some();
            assert_eq!(checked, parsed, "{w}");
        }
    }

    #[test]
    fn which_file_is_read() {
        assert_eq!(file_path(&env(&[])), Some((DEFAULT_FILE.into(), false)));
        assert_eq!(file_path(&env(&[("SMCR_CONFIG", "off")])), None);
        assert_eq!(
            file_path(&env(&[("SMCR_CONFIG", "/x.toml")])),
            Some(("/x.toml".into(), true))
        );
        // A named file that is missing is an error; the default one missing is none.
        assert!(read_file(&env(&[("SMCR_CONFIG", "/nonexistent.toml")])).is_err());
        if !Path::new(DEFAULT_FILE).exists() {
            assert!(read_file(&env(&[])).unwrap().is_none());
        }
    }
}
