//! Scenario 14f, a crontab of 1,000 jobs (issue 50): [`SCALE_JOBS`] jobs that never fall due on
//! [`REPLICAS`] replicas, on PostgreSQL and on Redis, with cargo's build and, given
//! `--previous`, that build beside it in the same run. What a replica costs at rest (CPU per
//! second and RSS, read from `/proc` over the cost window once no job has moved for a while),
//! how soon the others own the jobs of a replica killed -9 (each of its jobs' "took job" line
//! elsewhere), and how soon a replica that joins holds its share (its share's "took job" lines).
//!
//! Then the burst: the same number of jobs, each every [`BURST_PERIOD`] seconds, all at one
//! instant, on a fleet at rest. How late each run starts (as scenario 14 measures it), beside
//! the machine's floor for as many bash starts at those instants ([`burst_floor`]), and how
//! much resident memory each replica's pgleader and its keepers take above what they took at
//! rest, read every [`SAMPLE_EVERY`] through each burst.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;

use chrono::{DateTime, Utc};

use super::{
    Backend, FLOOR_LABEL, IDLE, REPLICAS, crontab, p99, row, runs_of, start_spawners, tail, taken,
};
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

/// The id of a burst's lateness.
pub const BURST_ROW: &str = "cron.scale.burst";
/// The id of the floor beside it.
pub const BURST_FLOOR_ROW: &str = "cron.scale.burst.floor";

/// Every job of the burst's crontab falls due every this many seconds, all at one instant.
const BURST_PERIOD: i64 = 10;
/// The burst's schedule (seven fields), every [`BURST_PERIOD`] seconds.
const BURST: &str = "*/10 * * * * * *";
/// How often the replicas' memory is read during the bursts.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

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

/// The scenario of the burst's rows.
fn burst_scenario() -> String {
    format!(
        "14f. crontab: a burst, {SCALE_JOBS} jobs every {BURST_PERIOD} s at one instant, {REPLICAS} replicas"
    )
}

/// The burst's row for `build` on `backend`: `bursts` bursts of a fleet at rest.
pub fn burst_row(backend: Backend, build: &Build, bursts: usize) -> Row {
    let label = build.label(backend);
    eprintln!("bench: {}, {label}", burst_scenario());
    let mut late = Figures::default();
    let result = (|| -> anyhow::Result<String> {
        backend.ready()?;
        let lock = harness::unique_lock();
        let file = crontab("burst", BURST, SCALE_JOBS)?;
        let live: Vec<Candidate> = (0..REPLICAS)
            .map(|i| replica(backend, &build.binary, &format!("B{i}"), lock, &file))
            .collect();
        at_rest(&live)?;
        let (runs, memory) = measure_bursts(&live, bursts, &mut late)?;
        Ok(format!("{runs}; {memory}"))
    })();
    let note = result.unwrap_or_else(|err| {
        eprintln!("bench:   failed: {err:#}");
        late.failure(format!("{err:#}").replace('\n', " "));
        String::new()
    });
    row(
        BURST_ROW,
        &burst_scenario(),
        label,
        "from each occurrence to its command running ($EPOCHREALTIME), every run of the bursts",
        late,
        note,
    )
}

/// The floor beside the bursts: [`REPLICAS`] spawners of the benchmark's own (as scenario
/// 14's floor), each starting its share of the same number of bash commands at the same
/// instants, with no server, no scheduler and no keeper.
pub fn burst_floor(bursts: usize) -> Row {
    eprintln!("bench: {}, the floor", burst_scenario());
    let mut late = Figures::default();
    let mut spawners: Vec<Candidate> = Vec::new();
    let result = (|| -> anyhow::Result<String> {
        spawners = start_spawners(SCALE_JOBS, BURST_PERIOD as u64)?;
        Ok(measure_bursts(&spawners, bursts, &mut late)?.0)
    })();
    let note = result.unwrap_or_else(|err| {
        late.failure(format!("{err:#}").replace('\n', " "));
        String::new()
    });
    row(
        BURST_FLOOR_ROW,
        &burst_scenario(),
        FLOOR_LABEL,
        "the machine's floor, not a peer: the same bash commands, each spawner process starting its share at each burst's instant (std::process::Command, no database, no keeper); from each occurrence to its command running ($EPOCHREALTIME)",
        late,
        note,
    )
}

/// Measures the next `bursts` bursts of `live` (a fleet at rest, or the floor's spawners):
/// each run's lateness into `late`, and what each process and its children held in resident
/// memory above what they held halfway between two bursts. Returns a note on the runs and one
/// on the memory.
fn measure_bursts(
    live: &[Candidate],
    bursts: usize,
    late: &mut Figures,
) -> anyhow::Result<(String, String)> {
    let period = chrono::Duration::seconds(BURST_PERIOD);
    let instant_after = |at: DateTime<Utc>| {
        let secs = (at.timestamp() / BURST_PERIOD + 1) * BURST_PERIOD;
        DateTime::<Utc>::from_timestamp(secs, 0).unwrap_or(at)
    };
    // At rest: halfway between two instants, every run of the last one long over.
    let halfway = instant_after(Utc::now()) - period / 2;
    let halfway = if halfway < Utc::now() {
        halfway + period
    } else {
        halfway
    };
    sleep((halfway - Utc::now()).to_std().unwrap_or_default());
    let rest: Vec<u64> = live
        .iter()
        .map(|c| procfs::tree_rss_kib(c.pid()).0)
        .collect();
    let first = instant_after(Utc::now() + chrono::Duration::seconds(1));
    let last = first + period * (bursts as i32 - 1);
    let end = last + chrono::Duration::seconds(4);
    // Each process's highest reading in each burst's period (from a second before its
    // instant), and the most children it had at once.
    let mut peak = vec![vec![0u64; bursts]; live.len()];
    let mut children = 0;
    while Utc::now() < end {
        let since = Utc::now() - first + chrono::Duration::seconds(1);
        let burst = (since.num_milliseconds().max(0) / (BURST_PERIOD * 1000)) as usize;
        let burst = burst.min(bursts - 1);
        for (i, candidate) in live.iter().enumerate() {
            let (kib, processes) = procfs::tree_rss_kib(candidate.pid());
            peak[i][burst] = peak[i][burst].max(kib);
            children = children.max(processes);
        }
        sleep(SAMPLE_EVERY);
    }
    let instants: Vec<DateTime<Utc>> = (0..bursts).map(|b| first + period * b as i32).collect();
    let runs: Vec<super::Run> = live
        .iter()
        .flat_map(runs_of)
        .filter(|r| instants.contains(&r.occurrence))
        .collect();
    for run in &runs {
        late.sample_ms(run.late_ms());
    }
    let mut count: std::collections::BTreeMap<(&str, DateTime<Utc>), usize> = Default::default();
    for run in &runs {
        *count.entry((run.job.as_str(), run.occurrence)).or_default() += 1;
    }
    let twice = count.values().filter(|n| **n > 1).count();
    let runs_note = format!(
        "{} of {} occurrences ran ({bursts} bursts × {SCALE_JOBS} jobs), {twice} twice; {}",
        count.len(),
        bursts * SCALE_JOBS,
        p99(late)
    );
    let mut above: Vec<u64> = peak
        .iter()
        .zip(&rest)
        .flat_map(|(peaks, rest)| peaks.iter().map(move |p| p.saturating_sub(*rest) / 1024))
        .collect();
    above.sort_unstable();
    let memory_note = format!(
        "RSS of each replica's pgleader and keepers above rest ({} MiB at rest), a reading per replica and burst: median {} MiB, highest {} MiB; up to {children} keepers at once",
        rest.iter()
            .map(|kib| (kib / 1024).to_string())
            .collect::<Vec<_>>()
            .join(", "),
        above.get(above.len() / 2).copied().unwrap_or(0),
        above.last().copied().unwrap_or(0),
    );
    eprintln!(
        "bench:   lateness p50 {:?} ms; {runs_note}; {memory_note}",
        late.median()
    );
    Ok((runs_note, memory_note))
}
