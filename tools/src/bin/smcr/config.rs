//! `smcr config`, `smcr ueid` and `smcr generate`: the settings file, the user EIDs and the
//! generated files (completions, man page).

#[allow(unused_imports)]
use super::*;

/// `smcr config`: every setting's value for a program started from here, and its source;
/// `--list`: every setting.
pub(super) fn config(a: ConfigArgs) -> ExitCode {
    if a.list {
        for s in settings::SETTINGS {
            let takes = match s.kind {
                settings::Kind::Choice(words) => words.join(", "),
                k => k.expected().to_owned(),
            };
            println!("{} ({})", s.key, s.var);
            println!("    {}", s.about);
            println!("    takes: {takes}; default: {}", s.default);
        }
        return ExitCode::SUCCESS;
    }
    let given = a.file.map(|f| f.display().to_string());
    let lookup = |k: &str| match (k, &given) {
        (settings::FILE_VAR, Some(f)) => Some(f.clone()),
        _ => env(k),
    };
    let file = match settings::read_file(&lookup) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("smcr config: {e}");
            return ExitCode::FAILURE;
        }
    };
    let effective = match settings::resolve(&lookup, file.as_ref()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("smcr config: {e}");
            return ExitCode::FAILURE;
        }
    };
    match (&file, settings::file_path(&lookup)) {
        (Some(f), _) => println!(
            "configuration file: {} ({} setting(s))",
            f.path.display(),
            f.entries.len()
        ),
        (None, None) => println!("configuration file: none ({}=off)", settings::FILE_VAR),
        (None, Some((p, _))) => {
            println!("configuration file: none ({} does not exist)", p.display())
        }
    }
    let width = settings::SETTINGS
        .iter()
        .map(|s| s.key.len())
        .max()
        .unwrap_or(0);
    let vwidth = effective
        .iter()
        .map(|e| e.value.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(5, 40);
    println!("{:<width$}  {:<vwidth$}  FROM", "SETTING", "VALUE");
    for e in &effective {
        let from = match &e.origin {
            settings::Origin::Env => e.setting.var.to_owned(),
            o => o.to_string(),
        };
        println!("{:<width$}  {:<vwidth$}  {from}", e.setting.key, e.value);
    }
    ExitCode::SUCCESS
}

/// `smcr ueid show|add|del|flush`. Show: what a program started from here offers (SMCR_UEID,
/// else the file's smcr.ueid, else the default). The others edit smcr.ueid in the
/// configuration file (Linux keeps its UEIDs in a table of the kernel; ours are this file's).
pub(super) fn ueid(action: UeidAction) -> ExitCode {
    let (file, edit): (Option<PathBuf>, Box<UeidEdit>) = match action {
        UeidAction::Show => return ueid_show(),
        UeidAction::Add { ueid, file } => (
            file,
            Box::new(move |list| {
                // As smc-tools: the UEID is kept in upper case.
                let u = ueid.trim().to_ascii_uppercase();
                clc::Eid::new(&u).map_err(|e| format!("{u:?}: {e}"))?;
                if list.contains(&u) {
                    return Err(format!("{u} is there already"));
                }
                if list.len() >= MAX_UEIDS {
                    return Err(format!(
                        "there are {MAX_UEIDS} already, the most Linux takes"
                    ));
                }
                list.push(u);
                Ok(())
            }),
        ),
        UeidAction::Del { ueid, file } => (
            file,
            Box::new(move |list| {
                let u = ueid.trim().to_ascii_uppercase();
                let before = list.len();
                list.retain(|x| *x != u);
                if list.len() == before {
                    return Err(format!("{u} is not there"));
                }
                Ok(())
            }),
        ),
        UeidAction::Flush { file } => (
            file,
            Box::new(|list| {
                list.clear();
                Ok(())
            }),
        ),
    };
    let path = file.unwrap_or_else(|| match settings::file_path(&env) {
        Some((p, _)) => p,
        None => PathBuf::from(settings::DEFAULT_FILE),
    });
    match edit_ueids(&path, &*edit) {
        Ok(list) => {
            eprintln!(
                "smcr ueid: {}: smcr.ueid = [{}]{}",
                path.display(),
                list.join(", "),
                if list.is_empty() {
                    " (removed: programs offer the default)"
                } else {
                    ""
                }
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("smcr ueid: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

/// A change to the UEID list (refused with a reason).
type UeidEdit = dyn Fn(&mut Vec<String>) -> Result<(), String>;

/// Linux's `SMC_MAX_UEID`.
pub(super) const MAX_UEIDS: usize = 4;

/// Applies `edit` to smcr.ueid of the file at `path` (created if missing), keeping the rest of
/// the file as it is; the result must be a valid configuration. Returns the new list.
pub(super) fn edit_ueids(
    path: &Path,
    edit: &dyn Fn(&mut Vec<String>) -> Result<(), String>,
) -> Result<Vec<String>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e.to_string()),
    };
    settings::File::parse(path, &text).map_err(|e| format!("not changed: {e}"))?;
    let mut doc: toml_edit::DocumentMut = text.parse().map_err(|e| format!("{e}"))?;
    let mut list: Vec<String> = match doc.get("smcr").and_then(|t| t.get("ueid")) {
        None => Vec::new(),
        Some(v) => match (v.as_array(), v.as_str()) {
            (Some(a), _) => a
                .iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect(),
            (_, Some(s)) => s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            _ => Vec::new(),
        },
    };
    edit(&mut list)?;
    if list.is_empty() {
        if let Some(t) = doc.get_mut("smcr").and_then(|t| t.as_table_like_mut()) {
            t.remove("ueid");
        }
    } else {
        if doc.get("smcr").is_none() {
            doc["smcr"] = toml_edit::table();
        }
        doc["smcr"]["ueid"] = toml_edit::value(toml_edit::Array::from_iter(list.iter()));
    }
    let out = doc.to_string();
    settings::File::parse(path, &out).map_err(|e| format!("not changed: the result: {e}"))?;
    // A whole new file or none: written aside, then renamed over.
    let tmp = path.with_extension("toml.smcr-new");
    std::fs::write(&tmp, out).map_err(|e| e.to_string())?;
    if let Ok(m) = std::fs::metadata(path) {
        let _ = std::fs::set_permissions(&tmp, m.permissions());
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        e.to_string()
    })?;
    Ok(list)
}

/// `smcr ueid show`.
pub(super) fn ueid_show() -> ExitCode {
    let (set, from) = match env("SMCR_UEID") {
        Some(v) => (Some(v), "SMCR_UEID".to_owned()),
        None => match settings::read_file(&env) {
            Ok(Some(f)) => match f.get("SMCR_UEID") {
                Some(e) => (
                    Some(e.value.clone()),
                    format!("{}:{}", f.path.display(), e.line),
                ),
                None => (None, String::new()),
            },
            Ok(None) => (None, String::new()),
            Err(e) => {
                eprintln!("smcr ueid: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let mut ueids = Vec::new();
    let mut bad = false;
    if let Some(list) = &set {
        for u in list.split(',').map(str::trim) {
            match clc::Eid::new(u) {
                Ok(e) => ueids.push(e.to_string()),
                Err(e) => {
                    bad = true;
                    eprintln!("smcr ueid: ignoring {u:?} in {from}: {e}")
                }
            }
        }
    }
    if bad {
        eprintln!("smcr ueid: a program started with it stays TCP (`smcr config` names it)");
    }
    let source = if ueids.is_empty() {
        ueids.push(smcr::runtime::DEFAULT_UEID.to_owned());
        if set.is_some() {
            format!("default: {from} has no valid UEID")
        } else {
            "default: neither SMCR_UEID nor smcr.ueid in the configuration file is set".to_owned()
        }
    } else {
        from
    };
    for u in &ueids {
        println!("{u}");
    }
    eprintln!("({source})");
    ExitCode::SUCCESS
}

/// `smcr generate man DIR` / `smcr generate completions SHELL DIR`.
pub(super) fn generate(what: Generate) -> std::io::Result<()> {
    let cmd = Cli::command();
    match what {
        Generate::Man { dir } => {
            std::fs::create_dir_all(&dir)?;
            clap_mangen::generate_to(cmd, &dir)
        }
        Generate::Completions { shell, dir } => {
            std::fs::create_dir_all(&dir)?;
            let mut cmd = cmd;
            let path = clap_complete::generate_to(shell, &mut cmd, "smcr", &dir)?;
            println!("{}", path.display());
            Ok(())
        }
    }
}
