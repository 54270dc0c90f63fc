//! The load: redis-benchmark runs, the writer of the known data set and its verifier.

#[allow(unused_imports)]
use super::*;

/// A client process under the shim, its stdin, stdout and stderr in files.
pub(super) struct Run {
    pub(super) child: Child,
    pub(super) out: PathBuf,
    pub(super) err: PathBuf,
    pub(super) started: Instant,
}

/// What a finished [`Run`] did (`status` None: it hung and was killed).
pub(super) struct Done {
    pub(super) status: Option<ExitStatus>,
    pub(super) stdout: Vec<u8>,
    pub(super) stderr: String,
    pub(super) secs: f64,
}

pub(super) struct Soak<'a> {
    pub(super) opt: &'a Options,
    pub(super) env: &'a Env,
    pub(super) log: PathBuf,
    pub(super) addr: String,
    pub(super) port: String,
    pub(super) seq: u32,
    pub(super) errors: Vec<String>,
    pub(super) rng: Rng,
    pub(super) verify_rounds: u32,
    pub(super) verify_keys: u64,
    pub(super) verify_mismatches: u64,
}

impl Soak<'_> {
    pub(super) fn file(&mut self, what: &str) -> PathBuf {
        self.seq += 1;
        self.env.work.join(format!("soak-{}-{what}", self.seq))
    }

    pub(super) fn error(&mut self, e: String) {
        eprintln!("  ERROR: {e}");
        self.errors.push(e);
    }

    /// Starts `prog args` on the client side, under the shim, connecting to the server at
    /// `host`, stdin from `input`.
    pub(super) fn spawn(
        &mut self,
        prog: &str,
        host: &str,
        args: &[&str],
        input: Option<&Path>,
    ) -> Result<Run> {
        let (out, err) = (self.file("out"), self.file("err"));
        let stdin = match input {
            Some(p) => Stdio::from(File::open(p)?),
            None => Stdio::null(),
        };
        let mut cmd = self.env.cmd(SETUP, false, prog);
        if self.opt.flap {
            let alt = if host == VERIFY_SERVER {
                ALT_VERIFY_CLIENT
            } else {
                ALT_CLIENT
            };
            cmd.env("SMCR_ALT_ADDRS", alt);
        }
        let child = cmd
            .env("SMCR_LOG", &self.log)
            .args(["-h", host, "-p", &self.port])
            .args(args)
            .stdin(stdin)
            .stdout(File::create(&out)?)
            .stderr(File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting {prog}"))?;
        Ok(Run {
            child,
            out,
            err,
            started: Instant::now(),
        })
    }

    /// Waits for `r` (killing it after `limit`), calling `tick` meanwhile.
    pub(super) fn wait(
        &mut self,
        mut r: Run,
        limit: Duration,
        mut tick: impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<Done> {
        let status = loop {
            if let Some(st) = r.child.try_wait()? {
                break Some(st);
            }
            if r.started.elapsed() > limit {
                // What the shim's stats areas say, for the report.
                let snap = smcr_tools::view::Snapshot::collect(&self.env.stats, None);
                let keep = std::env::temp_dir().join(format!(
                    "smcr-soak-{}-hang-{}.json",
                    std::process::id(),
                    r.child.id()
                ));
                if std::fs::write(&keep, smcr_tools::view::render_json(&snap)).is_ok() {
                    eprintln!("  hung: the stats areas are saved in {}", keep.display());
                }
                let _ = r.child.kill();
                let _ = r.child.wait();
                break None;
            }
            tick(self)?;
            std::thread::sleep(Duration::from_millis(50));
        };
        let d = Done {
            status,
            stdout: std::fs::read(&r.out)?,
            stderr: String::from_utf8_lossy(&std::fs::read(&r.err)?).into_owned(),
            secs: r.started.elapsed().as_secs_f64(),
        };
        let _ = std::fs::remove_file(&r.out);
        let _ = std::fs::remove_file(&r.err);
        Ok(d)
    }

    /// Runs a client to its end; an error (in the list) unless it exits 0 within the limit.
    pub(super) fn client(
        &mut self,
        what: &str,
        host: &str,
        prog: &str,
        args: &[&str],
        input: Option<&Path>,
    ) -> Result<Option<Done>> {
        let r = self.spawn(prog, host, args, input)?;
        let d = self.wait(r, RUN_LIMIT, |_| Ok(()))?;
        match d.status {
            None => self.error(format!(
                "{what}: hung, killed after {:.0} s",
                RUN_LIMIT.as_secs_f64()
            )),
            Some(st) if !st.success() => {
                self.error(format!("{what}: {st}: {}", d.stderr.trim()));
            }
            Some(_) => {
                // redis-cli reports a failed connection here and carries on with a new one.
                let noise = ["All data transferred", "Last reply received"];
                let err: Vec<&str> = d
                    .stderr
                    .lines()
                    .filter(|l| !l.trim().is_empty() && !noise.iter().any(|n| l.starts_with(n)))
                    .collect();
                if !err.is_empty() {
                    self.error(format!("{what}: {}", err.join(" / ")));
                }
                return Ok(Some(d));
            }
        }
        Ok(None)
    }

    /// Reads `keys` back with MGETs (`redis-cli --raw`, connecting to `host`) and compares
    /// them; returns the mismatches (the first few) and their count (None: redis-cli failed,
    /// an error in the list).
    pub(super) fn read_back(
        &mut self,
        what: &str,
        host: &str,
        keys: &[u32],
    ) -> Result<Option<(Vec<String>, u64)>> {
        let cmds = self.file("mget");
        {
            let mut f = std::io::BufWriter::new(File::create(&cmds)?);
            for chunk in keys.chunks(BATCH) {
                use std::io::Write;
                f.write_all(b"MGET")?;
                for k in chunk {
                    write!(f, " soak:{k}")?;
                }
                f.write_all(b"\n")?;
            }
        }
        let d = self.client(what, host, "redis-cli", &["--raw"], Some(&cmds))?;
        let _ = std::fs::remove_file(&cmds);
        let Some(d) = d else { return Ok(None) };
        let mut lines: Vec<&[u8]> = d.stdout.split(|b| *b == b'\n').collect();
        if lines.last() == Some(&&b""[..]) {
            lines.pop();
        }
        if lines.len() != keys.len() {
            self.error(format!(
                "{what}: {} lines for {} keys: {}",
                lines.len(),
                keys.len(),
                String::from_utf8_lossy(&d.stdout[..d.stdout.len().min(300)])
            ));
        }
        let mut bad = Vec::new();
        let mut n = 0;
        for (i, &k) in keys.iter().enumerate() {
            let got = lines.get(i).copied().unwrap_or_default();
            if got != value(self.opt.seed, k) {
                n += 1;
                if bad.len() < 5 {
                    bad.push(if got.is_empty() {
                        format!("soak:{k} missing")
                    } else {
                        format!(
                            "soak:{k} is {} bytes {:?}…, expected {} bytes",
                            got.len(),
                            String::from_utf8_lossy(&got[..got.len().min(24)]),
                            value(self.opt.seed, k).len()
                        )
                    });
                }
            }
        }
        Ok(Some((bad, n)))
    }

    /// One verifier round: a random sample of the data set.
    pub(super) fn verify(&mut self) -> Result<()> {
        let keys: Vec<u32> = (0..VERIFY_KEYS)
            .map(|_| self.rng.below(u64::from(self.opt.keys)) as u32)
            .collect();
        let Some((bad, n)) = self.read_back("verifier", VERIFY_SERVER, &keys)? else {
            return Ok(());
        };
        self.verify_rounds += 1;
        self.verify_keys += keys.len() as u64;
        self.verify_mismatches += n;
        if n > 0 {
            self.error(format!(
                "verifier: {n} of {} keys wrong: {bad:?}",
                keys.len()
            ));
        }
        Ok(())
    }

    /// A command through redis-cli; its output (None: it failed, an error in the list).
    pub(super) fn cli(&mut self, args: &[&str]) -> Result<Option<String>> {
        let what = format!("redis-cli {}", args.join(" "));
        let addr = self.addr.clone();
        let d = self.client(&what, &addr, "redis-cli", args, None)?;
        Ok(d.map(|d| String::from_utf8_lossy(&d.stdout).into_owned()))
    }
}

/// One redis-benchmark run's figures.
pub(super) struct BenchRun {
    pub(super) pipeline: u32,
    pub(super) size: u32,
    pub(super) end: f64,
    pub(super) secs: f64,
    /// `-n`: requests per test.
    pub(super) n: u64,
    /// Requests of the tests that finished.
    pub(super) requests: u64,
    /// (index in [`TESTS`], requests/s) of each test that finished.
    pub(super) rates: Vec<(usize, f64)>,
}

/// Requests/s of a set of tests, each with its `-n`: all their requests over all their time.
pub(super) fn aggregate(tests: impl Iterator<Item = (u64, f64)>) -> Option<f64> {
    let (reqs, secs) = tests.fold((0.0, 0.0), |(q, t), (n, r)| {
        (q + n as f64, t + n as f64 / r)
    });
    (secs > 0.0).then(|| reqs / secs)
}
