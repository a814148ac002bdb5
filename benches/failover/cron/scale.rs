//! Scenario 14f, a crontab of 1,000 jobs (issue 50): [`SCALE_JOBS`] jobs that never fall due on
//! [`REPLICAS`] replicas, on PostgreSQL and on Redis, with cargo's build and, given
//! `--previous`, that build beside it in the same run. What a replica costs at rest (CPU per
//! second and RSS, read from `/proc` over the cost window once no job has moved for a while),
//! how soon the others own the jobs of a replica killed -9 (each of its jobs' "took job" line
//! elsewhere), and how soon a replica that joins holds its share (its share's "took job" lines).
//!
//! The burst of 1,000 occurrences at one instant is not measured here yet.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;

use super::{Backend, IDLE, REPLICAS, crontab, row, tail, taken};
use crate::figures::{Figures, Row};
use crate::harness::{self, Stream};
use crate::procfs;
use crate::tools::{Candidate, SETUP_WAIT};

/// Jobs in the crontab of scenario 14f.
pub const SCALE_JOBS: usize = 1_000;

/// The id of a replica's CPU at rest.
pub const REST_ROW: &str = "cron.scale.rest";
/// The id of a kill -9's hand-over.
pub const KILLED_ROW: &str = "cron.scale.kill9";
/// The id of a join's share.
pub const JOINED_ROW: &str = "cron.scale.join";

/// The labels of a previous build's rows (`--previous`).
pub const PREVIOUS_LABEL: &str = "pgleader cron previous";
pub const PREVIOUS_REDIS_LABEL: &str = "pgleader cron previous on Redis";

/// No "took job" or "released job" line for this long: the fleet is at rest.
const QUIET: Duration = Duration::from_secs(3);

/// A build measured: its binary, and whether it is cargo's.
#[derive(Debug)]
pub struct Build {
    pub binary: PathBuf,
    pub previous: bool,
}

impl Build {
    fn label(&self, backend: Backend) -> &'static str {
        match (self.previous, backend) {
            (false, _) => backend.label(),
            (true, Backend::Postgres(_)) => PREVIOUS_LABEL,
            (true, Backend::Redis(_)) => PREVIOUS_REDIS_LABEL,
        }
    }
}

/// Scenario 14f's rows for `build` on `backend`: `kills` kill -9 and join runs after the cost
/// at rest, measured over `window`.
pub fn rows(backend: Backend, build: &Build, kills: usize, window: Duration) -> Vec<Row> {
    let label = build.label(backend);
    eprintln!("bench: 14f. crontab: {SCALE_JOBS} idle jobs on {REPLICAS} replicas, {label}");
    let (mut rest, mut killed, mut joined) = Default::default();
    let mut note = String::new();
    if let Err(err) = measure(
        backend,
        build,
        (kills, window),
        (&mut rest, &mut killed, &mut joined),
        &mut note,
    ) {
        eprintln!("bench:   failed: {err:#}");
        let why = format!("{err:#}").replace('\n', " ");
        for figures in [&mut rest, &mut killed, &mut joined] {
            if !figures.produced() {
                figures.failure(why.clone());
            }
        }
    }
    let scenario = format!("14f. crontab: {SCALE_JOBS} idle jobs, {REPLICAS} replicas");
    vec![
        row(
            REST_ROW,
            &scenario,
            label,
            "CPU per second of wall-clock time, each replica at rest (read as ms of CPU)",
            rest,
            note,
        ),
        row(
            KILLED_ROW,
            &scenario,
            label,
            "from kill -9 of a replica to every one of its jobs owned by another",
            killed,
            String::new(),
        ),
        row(
            JOINED_ROW,
            &scenario,
            label,
            "from a replica's start to it holding its share",
            joined,
            String::new(),
        ),
    ]
}

fn measure(
    backend: Backend,
    build: &Build,
    (kills, window): (usize, Duration),
    (rest, killed, joined): (&mut Figures, &mut Figures, &mut Figures),
    note: &mut String,
) -> anyhow::Result<()> {
    backend.ready()?;
    let lock = harness::unique_lock();
    let file = crontab("scale", IDLE, SCALE_JOBS)?;
    let start = |tag: &str| replica(backend, &build.binary, tag, lock, &file);
    let mut live: Vec<Candidate> = (0..REPLICAS).map(|i| start(&format!("S{i}"))).collect();
    let mut gone = Vec::new();
    at_rest(&live)?;
    let before: Vec<Duration> = live.iter().map(|c| cpu(c.pid())).collect();
    let began = Instant::now();
    sleep(window);
    let elapsed = began.elapsed();
    let mut rss = Vec::new();
    for (candidate, before) in live.iter().zip(before) {
        let used = cpu(candidate.pid()).saturating_sub(before);
        rest.sample_ms(used.as_secs_f64() * 1000.0 / elapsed.as_secs_f64());
        rss.push(procfs::rss_kib(candidate.pid()).unwrap_or(0) / 1024);
    }
    rss.sort_unstable();
    *note = format!(
        "over {}; RSS per replica {} MiB",
        humantime::format_duration(window),
        rss.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    eprintln!("bench:   at rest: {:?} ms/s; {note}", rest.median());
    for run in 0..kills {
        let victim = live.remove(run % live.len());
        let orphaned = held(&victim);
        let fault = Instant::now();
        victim.signal(Signal::SIGKILL);
        gone.push(victim);
        let last = taken(&live, &orphaned, fault, &gone[gone.len() - 1])?;
        killed.sample(last);
        at_rest(&live)?;
        let spawned = Instant::now();
        let joiner = start(&format!("J{run}"));
        let share = SCALE_JOBS / REPLICAS;
        let (_, at) = joiner
            .line(Stream::Stderr, "took job ", share, None, SETUP_WAIT)
            .with_context(|| format!("it never took {share} jobs\n{}", tail(&joiner.dump())))?;
        joined.sample(at.duration_since(spawned));
        eprintln!(
            "bench:   run {}: {} jobs owned elsewhere after {:.1} ms; a joiner held its share after {:.1} ms",
            run + 1,
            orphaned.len(),
            last.as_secs_f64() * 1000.0,
            at.duration_since(spawned).as_secs_f64() * 1000.0
        );
        live.push(joiner);
        at_rest(&live)?;
    }
    Ok(())
}

/// `binary cron --lock-id=LOCK FILE` on `backend`.
fn replica(backend: Backend, binary: &Path, tag: &str, lock: i64, file: &Path) -> Candidate {
    let mut command = harness::clean(Command::new(binary));
    command
        .env_remove("PGLEADER_RESTART_FENCE")
        .env("PGLEADER_DATABASE_URL", backend.url())
        .arg("cron")
        .arg(format!("--lock-id={lock}"))
        .args(backend.options())
        .arg(file);
    Candidate::spawn(tag, command)
}

/// The jobs `candidate` holds, by its "took job" and "released job" lines since it last lost
/// every one.
fn held(candidate: &Candidate) -> Vec<String> {
    let mut jobs = std::collections::BTreeSet::new();
    for line in candidate.lines(Stream::Stderr) {
        let job = |needle: &str| {
            line.split_once(needle)
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .map(str::to_owned)
        };
        // A session lost: nothing is held any more, and no job line says so.
        if line.contains("lost every shard") {
            jobs.clear();
        } else if let Some(job) = job("took job ") {
            jobs.insert(job);
        } else if let Some(job) = job("released job ") {
            jobs.remove(&job);
        }
    }
    jobs.into_iter().collect()
}

/// Waits until every job is held, each replica holds its share, and no job has moved for
/// [`QUIET`].
fn at_rest(live: &[Candidate]) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETUP_WAIT;
    let (low, high) = (SCALE_JOBS / live.len(), SCALE_JOBS.div_ceil(live.len()));
    let mut last = (Vec::new(), Instant::now());
    loop {
        let shares: Vec<usize> = live.iter().map(|c| held(c).len()).collect();
        if shares != last.0 {
            last = (shares.clone(), Instant::now());
        }
        let balanced = shares.iter().sum::<usize>() == SCALE_JOBS
            && shares.iter().all(|n| (low..=high).contains(n));
        if balanced && last.1.elapsed() >= QUIET {
            return Ok(());
        }
        if Instant::now() > deadline {
            let dumps: Vec<String> = live.iter().map(|c| tail(&c.dump())).collect();
            bail!(
                "not at rest after {SETUP_WAIT:?}: {shares:?} jobs per replica\n{}",
                dumps.join("\n")
            );
        }
        sleep(Duration::from_millis(200));
    }
}

fn cpu(pid: i32) -> Duration {
    procfs::cpu_time(pid).unwrap_or_default()
}
