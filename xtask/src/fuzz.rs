//! `cargo xtask fuzz`: the libFuzzer targets of `tests/fuzz`, built with the coverage
//! instrumentation cargo-fuzz adds (on the stable toolchain: the `-C` options it uses are
//! stable, and `--target` keeps them off build scripts and proc macros), each run for a
//! while from its corpus. A crash fails the task and names the input, to be kept in
//! `tests/fuzz/regressions/<target>/` beside its fix (`tests/tests/fuzz_corpus.rs` replays
//! it). `--merge` adds what found new coverage to the committed corpus.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};

use crate::{root, run, step};

/// cargo-fuzz's instrumentation (`cargo fuzz build --sanitizer none`).
const RUSTFLAGS: &str = "-Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    --cfg fuzzing";

pub struct Options {
    pub seconds: u64,
    /// Targets at once (each is one process on one core).
    pub jobs: usize,
    pub merge: bool,
    pub targets: Vec<String>,
}

/// What one target's run showed.
struct Outcome {
    target: String,
    runs: u64,
    per_second: u64,
    coverage: u64,
    features: u64,
    corpus: u64,
    crashes: Vec<PathBuf>,
}

fn fuzz_dir() -> PathBuf {
    root().join("tests/fuzz")
}

fn work_dir() -> PathBuf {
    root().join("target/fuzz")
}

/// The targets, as `tests/fuzz/fuzz_targets/*.rs` names them.
fn all_targets() -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))?
        .flatten()
        .filter_map(|e| {
            e.path()
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    Ok(names)
}

fn host_triple() -> Result<String> {
    let out = Command::new("rustc").arg("-vV").output()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .context("rustc -vV names no host")
}

/// Builds every target; returns where the binaries are.
pub fn build() -> Result<PathBuf> {
    let triple = host_triple()?;
    step("fuzz: building the targets with coverage instrumentation");
    run(Command::new("cargo")
        .current_dir(fuzz_dir())
        .env("RUSTFLAGS", RUSTFLAGS)
        .args(["build", "--release", "--bins", "--target", &triple])
        .arg("--target-dir")
        .arg(work_dir()))?;
    Ok(work_dir().join(triple).join("release"))
}

pub fn fuzz(o: &Options) -> Result<()> {
    let all = all_targets()?;
    let targets = if o.targets.is_empty() {
        all.clone()
    } else {
        for t in &o.targets {
            if !all.contains(t) {
                bail!("no fuzz target {t:?}; there are: {}", all.join(", "));
            }
        }
        o.targets.clone()
    };
    let bin = build()?;
    let started = Instant::now();
    let mut outcomes = Vec::new();
    for batch in targets.chunks(o.jobs.max(1)) {
        step(&format!(
            "fuzz: {} for {} s each",
            batch.join(", "),
            o.seconds
        ));
        let children: Vec<(String, Child)> = batch
            .iter()
            .map(|t| start(&bin, t, o.seconds).map(|c| (t.clone(), c)))
            .collect::<Result<_>>()?;
        for (target, mut child) in children {
            let status = child.wait()?;
            let o = outcome(&target)?;
            // A fuzzer that stopped on an error of its own (no artifact) or ran nothing.
            if o.crashes.is_empty() && (!status.success() || o.runs == 0) {
                bail!(
                    "the {target} fuzzer ended with {status} after {} runs (log: {})",
                    o.runs,
                    log_path(&target).display()
                );
            }
            outcomes.push(o);
        }
    }
    if o.merge {
        for t in &targets {
            merge(&bin, t)?;
        }
    }
    report(&outcomes, started.elapsed().as_secs());
    let crashed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.crashes.is_empty()).collect();
    if !crashed.is_empty() {
        for o in &crashed {
            for c in &o.crashes {
                eprintln!(
                    "xtask: {} crashed on {} (log: {}); keep it in tests/fuzz/regressions/{}/ with the fix",
                    o.target,
                    c.display(),
                    log_path(&o.target).display(),
                    o.target
                );
            }
        }
        bail!("{} fuzz target(s) crashed", crashed.len());
    }
    Ok(())
}

fn log_path(target: &str) -> PathBuf {
    work_dir().join("logs").join(format!("{target}.log"))
}

fn artifacts(target: &str) -> PathBuf {
    work_dir().join("artifacts").join(target)
}

/// Starts `target` for `seconds`: new inputs go to `target/fuzz/corpus/<target>`, read
/// beside the committed corpus and regressions; crashes to `target/fuzz/artifacts`.
fn start(bin: &Path, target: &str, seconds: u64) -> Result<Child> {
    let corpus = work_dir().join("corpus").join(target);
    let found = artifacts(target);
    for dir in [&corpus, &found, &work_dir().join("logs")] {
        std::fs::create_dir_all(dir)?;
    }
    // Crashes of an earlier run are not this run's.
    for old in std::fs::read_dir(&found)?.flatten() {
        let _ = std::fs::remove_file(old.path());
    }
    let log = std::fs::File::create(log_path(target))?;
    let mut cmd = Command::new(bin.join(target));
    cmd.arg(&corpus);
    for seeds in ["corpus", "regressions"] {
        let dir = fuzz_dir().join(seeds).join(target);
        if dir.is_dir() {
            cmd.arg(dir);
        }
    }
    cmd.arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg("-timeout=10")
        .arg("-rss_limit_mb=2048")
        .arg(format!("-artifact_prefix={}/", found.display()))
        .stdout(Stdio::null())
        .stderr(log);
    cmd.spawn()
        .with_context(|| format!("starting the {target} fuzzer"))
}

/// Reads a finished run's log: libFuzzer's last status line and final stats.
fn outcome(target: &str) -> Result<Outcome> {
    let log = std::fs::read_to_string(log_path(target))?;
    let stat = |name: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // "#12345	REDUCE cov: 812 ft: 2101 corp: 301/22Kb ..."
    let last = log
        .lines()
        .rev()
        .find(|l| l.starts_with('#') && l.contains("cov: "))
        .unwrap_or_default();
    let after = |key: &str| {
        last.split(key)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let crashes = std::fs::read_dir(artifacts(target))?
        .flatten()
        .map(|e| e.path())
        .collect();
    Ok(Outcome {
        target: target.to_string(),
        runs: stat("number_of_executed_units"),
        per_second: stat("average_exec_per_sec"),
        coverage: after("cov: "),
        features: after("ft: "),
        corpus: after("corp: "),
        crashes,
    })
}

/// Adds the inputs of this run that reach new coverage to the committed corpus.
fn merge(bin: &Path, target: &str) -> Result<()> {
    let committed = fuzz_dir().join("corpus").join(target);
    std::fs::create_dir_all(&committed)?;
    let status = Command::new(bin.join(target))
        .arg("-merge=1")
        .arg(&committed)
        .arg(work_dir().join("corpus").join(target))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("merging the {target} corpus failed ({status})");
    }
    let n = std::fs::read_dir(&committed)?.count();
    step(&format!(
        "fuzz: {target}: {n} inputs in {}",
        committed.display()
    ));
    Ok(())
}

fn report(outcomes: &[Outcome], seconds: u64) {
    step(&format!("fuzz: {} targets in {seconds} s", outcomes.len()));
    println!("| target | runs | runs/s | coverage (edges) | features | corpus | crashes |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for o in outcomes {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            o.target,
            o.runs,
            o.per_second,
            o.coverage,
            o.features,
            o.corpus,
            o.crashes.len()
        );
    }
}
