//! Scenario 14, a crontab across the fleet (issue 37): `pgleader cron` with 100 every-second
//! jobs on 3 replicas, on PostgreSQL and on one Redis server side by side. How late each run
//! starts after its occurrence, as the command sees it; whether any (job, occurrence) ran
//! twice; after kill -9 of a replica, how soon the others own its jobs and how late their next
//! occurrence runs; and what one host's crontab of 100 jobs costs as one `pgleader cron` (on
//! either backend), as 100 `pgleader run --schedule` processes (how it is done today) and, on
//! one host with no fleet, as yacron (`yacron.rs`), side by side in one run.
//!
//! Every job's command runs under bash and prints `c JOB OCCURRENCE $EPOCHREALTIME`: the
//! benchmark, the server and the replicas share one machine and so one wall clock, so the
//! lateness is the command's own start time minus its occurrence on the server's clock.
//!
//! Beside the fleets' lateness, the machine's floor: no scheduler, no server, no keeper, only
//! [`REPLICAS`] spawner processes (this binary re-invoked with [`SPAWNER_ARG`]), each starting
//! its 33 or 34 of the same bash commands at each second's instant, measured the same way over
//! the same window. Scenario 14c measures the same fleets and floor with [`LIGHT_JOBS`] jobs, a
//! load the benchmark's 2 cores carry, where the floor no longer hides pgleader's own part.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use chrono::{DateTime, SubsecRound, Utc};
use nix::sys::signal::Signal;

use crate::figures::{Crontab, CrontabCost, CrontabFleet, Figures, Row, ms};
use crate::harness::monitor::{Answer, Monitor};
use crate::harness::{self, Stream};
use crate::procfs;
use crate::redis_lock::{self, CHECK_INTERVAL};
use crate::tools::{Candidate, Pgleader, SETUP_WAIT, last_of, random_phase, run_command};
use crate::yacron::Yacron;

mod scale;
pub use scale::Build;

/// Jobs in every crontab of the scenario.
pub const JOBS: usize = 100;

/// Jobs of scenario 14c: the same fleet at a load this 2-core machine carries (the floor of
/// [`JOBS`] bash starts at one instant is some 30 ms here), to see pgleader's own lateness.
pub const LIGHT_JOBS: usize = 10;

/// Replicas of the fleet.
pub const REPLICAS: usize = 3;

/// The label of `pgleader cron`'s rows on PostgreSQL.
pub const CRON_LABEL: &str = "pgleader cron";

/// The label of `pgleader cron`'s rows on Redis.
pub const CRON_REDIS_LABEL: &str = "pgleader cron on Redis";

/// The id of a fleet's lateness (scenario 14).
pub const LATENESS_ROW: &str = "cron.lateness";

/// The id of a kill's takeover: from the kill to the others owning the killed replica's jobs.
pub const OWNED_ROW: &str = "cron.kill9.owned";

/// The id of the lateness of a killed replica's jobs' next occurrence.
const NEXT_ROW: &str = "cron.kill9.next";

/// The ids of the fleets' rows, in the order the report shows them, each backend's side by
/// side.
const FLEET_ROWS: [&str; 10] = [
    LATENESS_ROW,
    LIGHT_ROW,
    LIGHT_RAW_ROW,
    LIGHT_UNKEPT_ROW,
    LIGHT_PINGS_ROW,
    OWNED_ROW,
    NEXT_ROW,
    TERM_OWNED_ROW,
    TERM_NEXT_ROW,
    ASKED_ROW,
];

/// The id of how soon a run asked by hand (`pgleader cron run`) starts (scenario 14e).
pub const ASKED_ROW: &str = "cron.asked.start";

/// Scenario 14e's runs asked by hand that are measured, after one of each job to warm up.
const ASKS: usize = 30;

/// The id of a TERM's hand-over: from the TERM to the others owning the replica's idle jobs.
pub const TERM_OWNED_ROW: &str = "cron.term.owned";

/// The id of the lateness of a TERMed replica's idle jobs' next occurrence on the others.
const TERM_NEXT_ROW: &str = "cron.term.next";

/// Scenario 14d's job that runs across the TERM: every 5 s for 2 s, its start and end
/// printed apart from the other jobs' lines (`l` and `e`, which [`Run::parse`] skips).
const LONG_JOB: &str = "# pgleader: name=long\n*/5 * * * * * * echo l long $PGLEADER_SCHEDULED_TIME; sleep 2; echo e long $PGLEADER_SCHEDULED_TIME\n";

/// The id of the light fleets' lateness (scenario 14c).
pub const LIGHT_ROW: &str = "cron.light.lateness";

/// The id of the light fleet's lateness with the jobs' output as it is (`--passthrough-logs`),
/// beside the tagged lines of [`LIGHT_ROW`].
pub const LIGHT_RAW_ROW: &str = "cron.light.lateness.passthrough";

/// The id of the light fleet's lateness with every job pinging a monitor (`ping=`), beside
/// [`LIGHT_ROW`].
pub const LIGHT_PINGS_ROW: &str = "cron.light.lateness.pings";

/// The id of the light fleet's lateness with none of the runs' output kept for the ledger
/// (`--keep-output 0`), beside [`LIGHT_ROW`], which keeps the default 1 KiB.
pub const LIGHT_UNKEPT_ROW: &str = "cron.light.lateness.unkept";

/// The label of that row.
pub const CRON_UNKEPT_LABEL: &str = "pgleader cron --keep-output 0";

/// The label of the pings' row.
pub const CRON_PINGS_LABEL: &str = "pgleader cron, every job with ping= (a local monitor)";

/// The label of `pgleader cron --passthrough-logs`'s rows on PostgreSQL.
pub const CRON_RAW_LABEL: &str = "pgleader cron --passthrough-logs";

/// The id of the floor's row, shown after the fleets' lateness.
pub const FLOOR_ROW: &str = "cron.lateness.floor";

/// The id of the floor's row of scenario 14c, shown after the light fleets' lateness.
pub const LIGHT_FLOOR_ROW: &str = "cron.light.floor";

/// The tool of the floor's row: the machine, not a peer.
pub const FLOOR_LABEL: &str = "floor: no scheduler (this machine)";

/// The hidden argument that makes the benchmark's binary a spawner of the floor:
/// `SPAWNER_ARG INDEX JOBS`.
pub const SPAWNER_ARG: &str = "--cron-floor-spawner";

/// Every job's command, run by bash.
const JOB_COMMAND: &str = "echo c $PGLEADER_JOB $PGLEADER_SCHEDULED_TIME $EPOCHREALTIME";

/// Seven fields, seconds first: every second.
const EVERY_SECOND: &str = "* * * * * * *";

/// Seven fields: midnight on the 1st of January, so that no occurrence falls in a window.
const IDLE: &str = "0 0 0 1 1 * *";

/// How much of scenario 14 to run.
#[derive(Debug)]
pub struct Plan {
    /// Occurrences of every job whose lateness is measured (one per second).
    pub window: Duration,
    /// kill -9 runs.
    pub kills: usize,
    /// How long each way of running the crontab is measured at rest and busy.
    pub cost_window: Duration,
    /// The builds scenario 14f measures: cargo's, and `--previous`.
    pub builds: Vec<Build>,
    /// Scenario 14f's kill -9 and join runs.
    pub scale_runs: usize,
    /// How long scenario 14f measures a replica at rest.
    pub scale_window: Duration,
    /// Scenario 14f's bursts measured for each build.
    pub scale_bursts: usize,
}

/// Where the benchmark writes its crontabs.
fn scratch() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-cron")
}

/// A crontab of `jobs` jobs `j1`..`jN` on `schedule` (seven fields), run by bash.
fn crontab(name: &str, schedule: &str, jobs: usize) -> anyhow::Result<PathBuf> {
    crontab_with(name, schedule, jobs, "")
}

/// [`crontab`], with the lines of `more` after its jobs.
fn crontab_with(name: &str, schedule: &str, jobs: usize, more: &str) -> anyhow::Result<PathBuf> {
    let mut text = String::from("SHELL=/bin/bash\n");
    for n in 1..=jobs {
        text.push_str(&format!(
            "# pgleader: name=j{n}\n{schedule} {JOB_COMMAND}\n"
        ));
    }
    text.push_str(more);
    let dir = scratch();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}-{}.crontab", std::process::id()));
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// How a replica writes its jobs' output: as tagged log lines on stderr (the default), or as it
/// is on stdout (`--passthrough-logs`). [`runs_of`] reads either. `Pinged`: tagged, each job
/// also pinging a monitor of the benchmark's own (`PGLEADER_PING=`) at each start and end.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Tagged,
    Passthrough,
    Pinged,
    /// Tagged, keeping none of the runs' output for the ledger (`--keep-output 0`).
    NotKept,
}

/// Where a crontab's replicas keep their jobs: the benchmark's PostgreSQL, or its Redis server
/// with `--check-interval 200ms` as in the Redis rows (a killed replica is found by another's
/// watcher, which asks every check interval).
#[derive(Clone, Copy)]
enum Backend<'a> {
    Postgres(&'a Pgleader),
    Redis(&'a redis_lock::Server),
}

impl Backend<'_> {
    /// The label of its rows.
    fn label(self) -> &'static str {
        match self {
            Backend::Postgres(_) => CRON_LABEL,
            Backend::Redis(_) => CRON_REDIS_LABEL,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Backend::Postgres(_) => "PostgreSQL",
            Backend::Redis(_) => "Redis",
        }
    }

    fn url(self) -> String {
        match self {
            Backend::Postgres(pg) => pg.cluster.url(),
            Backend::Redis(server) => server.url(),
        }
    }

    /// Options beside pgleader's defaults.
    fn options(self) -> &'static [&'static str] {
        match self {
            Backend::Postgres(_) => &[],
            Backend::Redis(_) => &[CHECK_INTERVAL],
        }
    }

    /// Waits until a Redis server has been up long enough not to trigger pgleader's restart
    /// fence, as in the Redis rows.
    fn ready(self) -> anyhow::Result<()> {
        match self {
            Backend::Postgres(_) => Ok(()),
            Backend::Redis(server) => server.wait_until_up(Duration::from_secs(10)),
        }
    }
}

/// The `how` of one `pgleader cron`'s cost on `backend` (PostgreSQL or Redis).
pub fn cron_how(backend: &str) -> String {
    format!("one `pgleader cron` on {backend}, {JOBS} jobs")
}

/// `pgleader cron --lock-id=LOCK FILE` on `backend`, its jobs' output tagged.
fn replica(backend: Backend, tag: &str, lock: i64, file: &std::path::Path) -> Candidate {
    replica_with(backend, tag, lock, file, Output::Tagged)
}

/// [`replica`], its jobs' output written as `output` says.
fn replica_with(
    backend: Backend,
    tag: &str,
    lock: i64,
    file: &std::path::Path,
    output: Output,
) -> Candidate {
    let mut command = harness::pgleader();
    command
        .env_remove("PGLEADER_RESTART_FENCE")
        .env("PGLEADER_DATABASE_URL", backend.url())
        .arg("cron")
        .arg(format!("--lock-id={lock}"))
        .args(backend.options());
    match output {
        Output::Passthrough => {
            command.arg("--passthrough-logs");
        }
        Output::NotKept => {
            command.arg("--keep-output=0");
        }
        Output::Tagged | Output::Pinged => {}
    }
    command.arg(file);
    Candidate::spawn(tag, command)
}

/// One run of a job, as its command printed it.
#[derive(Debug, Clone)]
struct Run {
    job: String,
    occurrence: DateTime<Utc>,
    /// `$EPOCHREALTIME` when the command started.
    started: DateTime<Utc>,
}

impl Run {
    fn parse(line: &str) -> Option<Run> {
        let mut words = line.strip_prefix("c ")?.split_whitespace();
        let job = words.next()?.to_owned();
        let occurrence = DateTime::parse_from_rfc3339(words.next()?)
            .ok()?
            .with_timezone(&Utc);
        let epoch: f64 = words.next()?.parse().ok()?;
        let started = DateTime::from_timestamp_micros((epoch * 1e6).round() as i64)?;
        Some(Run {
            job,
            occurrence,
            started,
        })
    }

    fn late_ms(&self) -> f64 {
        (self.started - self.occurrence)
            .num_microseconds()
            .unwrap_or(i64::MAX) as f64
            / 1000.0
    }
}

/// Every run `candidate` printed so far.
fn runs_of(candidate: &Candidate) -> Vec<Run> {
    printed(candidate)
        .iter()
        .filter_map(|line| Run::parse(line))
        .collect()
}

/// What the jobs of `candidate` printed so far: their lines as they are on stdout, and the
/// text of their tagged log lines on stderr (between the level and the tag).
fn printed(candidate: &Candidate) -> Vec<String> {
    let tagged = candidate
        .lines(Stream::Stderr)
        .into_iter()
        .filter(|line| line.contains(" stream=stdout"))
        .filter_map(|line| {
            let (_, rest) = line.split_once(" INFO  ")?;
            Some(rest.rsplit_once(" job=")?.0.to_owned())
        });
    candidate
        .lines(Stream::Stdout)
        .into_iter()
        .chain(tagged)
        .collect()
}

/// Waits until every one of the `jobs` every-second jobs ran the latest whole second once and
/// each replica ran its share of them (33 or 34 of 100 on 3; with `others` jobs of another
/// schedule in the file, down to that many fewer); returns that second.
fn balanced(fleet: &[Candidate], jobs: usize, others: usize) -> anyhow::Result<DateTime<Utc>> {
    let deadline = Instant::now() + SETUP_WAIT;
    // The file's `others` jobs count in each replica's share: a replica that holds one has
    // as many every-second jobs fewer.
    let all = jobs + others;
    let (low, high) = (
        (all / fleet.len()).saturating_sub(others),
        all.div_ceil(fleet.len()),
    );
    loop {
        let second = (Utc::now() - chrono::Duration::milliseconds(1_200)).trunc_subsecs(0);
        let per_replica: Vec<usize> = fleet
            .iter()
            .map(|c| runs_of(c).iter().filter(|r| r.occurrence == second).count())
            .collect();
        let ran: BTreeSet<String> = fleet
            .iter()
            .flat_map(runs_of)
            .filter(|r| r.occurrence == second)
            .map(|r| r.job)
            .collect();
        if ran.len() == jobs
            && per_replica.iter().sum::<usize>() == jobs
            && per_replica.iter().all(|n| (low..=high).contains(n))
        {
            return Ok(second);
        }
        if Instant::now() > deadline {
            let dumps: Vec<String> = fleet.iter().map(|c| tail(&c.dump())).collect();
            bail!(
                "not balanced after {SETUP_WAIT:?}: {per_replica:?} runs per replica of {second}\n{}",
                dumps.join("\n")
            );
        }
        sleep(Duration::from_millis(250));
    }
}

/// The end of a candidate's dump: a crontab's replica prints a line per run.
fn tail(dump: &str) -> String {
    let lines: Vec<&str> = dump.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn row(
    id: &str,
    scenario: &str,
    tool: &'static str,
    measure: &'static str,
    figures: Figures,
    note: String,
) -> Row {
    Row {
        id: id.into(),
        scenario: scenario.into(),
        tool,
        measure,
        figures,
        old_child_stopped: None,
        note,
    }
}

/// "p99 X" for a row's note.
fn p99(figures: &Figures) -> String {
    figures
        .quantile(0.99)
        .map_or_else(String::new, |p| format!("p99 {}", ms(p)))
}

/// Scenario 14, yacron's rows among them: the costs at rest while yacron waits for its first
/// minute, then yacron's minute, then the costs with every job every second, then the fleet on
/// PostgreSQL and on `redis` (which can start just before: it is waited for).
pub fn scenarios(
    pg: &Pgleader,
    redis: Option<&redis_lock::Server>,
    plan: &Plan,
) -> (Vec<Row>, Crontab) {
    let mut rows = Vec::new();
    let mut crontab = Crontab::default();
    // yacron runs jobs on whole minutes only: it waits for its first minute while the costs at
    // rest (which CPU noise does not change) are measured.
    let yacron = Yacron::start(JOBS);
    if let Err(err) = &yacron {
        eprintln!("bench:   yacron failed to start: {err:#}");
    }
    crontab.costs.extend(all_costs(
        pg,
        redis,
        (IDLE, "0 0 0 1 1 *"),
        "idle",
        plan.cost_window,
    ));
    match yacron.and_then(Yacron::finish) {
        Ok((figures, note, cost)) => {
            rows.push(yacron_row(figures, note));
            crontab.costs.push(cost);
        }
        Err(err) => {
            eprintln!("bench:   yacron failed: {err:#}");
            let mut figures = Figures::default();
            figures.failure(format!("{err:#}").replace('\n', " "));
            rows.push(yacron_row(figures, String::new()));
        }
    }
    crontab.costs.extend(all_costs(
        pg,
        redis,
        (EVERY_SECOND, "* * * * * *"),
        "every second",
        plan.cost_window,
    ));
    // The floor first, on a machine as quiet as the fleets' (the servers up, idle).
    rows.push(floor(plan, JOBS));
    let backends: Vec<Backend> = std::iter::once(Backend::Postgres(pg))
        .chain(redis.map(Backend::Redis))
        .collect();
    for backend in &backends {
        let (fleet_rows, counts) = fleet(*backend, plan);
        rows.extend(fleet_rows);
        crontab.fleets.push(counts);
    }
    rows.push(floor(plan, LIGHT_JOBS));
    for backend in &backends {
        rows.push(light(*backend, plan, Output::Tagged));
    }
    for backend in &backends {
        rows.extend(drained(*backend, plan));
    }
    for backend in &backends {
        rows.push(asked(*backend));
    }
    // The jobs' lines as they are, and pings, beside the tagged ones (PostgreSQL's fleet).
    rows.push(light(backends[0], plan, Output::Passthrough));
    rows.push(light(backends[0], plan, Output::NotKept));
    rows.push(light(backends[0], plan, Output::Pinged));
    rows.extend(scale_scenarios(pg, redis, plan));
    // Each measure's rows side by side, PostgreSQL's first (the sort is stable), each floor
    // after its fleets' lateness; yacron's row, none of these, stays first.
    rows.sort_by_key(|row| {
        let floor = row.id == FLOOR_ROW || row.id == LIGHT_FLOOR_ROW;
        let id = match row.id.as_str() {
            FLOOR_ROW => LATENESS_ROW,
            LIGHT_FLOOR_ROW => LIGHT_PINGS_ROW,
            id => id,
        };
        (
            FLEET_ROWS.iter().position(|fleet_id| *fleet_id == id),
            floor,
        )
    });
    (rows, crontab)
}

/// Scenario 14f: a crontab of 1,000 idle jobs on each backend, with each build.
pub fn scale_scenarios(pg: &Pgleader, redis: Option<&redis_lock::Server>, plan: &Plan) -> Vec<Row> {
    let backends = std::iter::once(Backend::Postgres(pg)).chain(redis.map(Backend::Redis));
    let mut rows = Vec::new();
    // The floor first, on a machine as quiet as the fleets' (the servers up, idle); its row
    // after the bursts'.
    let floor = scale::burst_floor(plan.scale_bursts);
    for backend in backends {
        for build in &plan.builds {
            rows.extend(scale::rows(
                backend,
                build,
                plan.scale_runs,
                plan.scale_window,
            ));
            rows.push(scale::burst_row(backend, build, plan.scale_bursts));
        }
    }
    rows.push(floor);
    rows
}

/// One host's cost of [`JOBS`] jobs as one `pgleader cron` and as plain processes on
/// PostgreSQL, and as one `pgleader cron` on `redis`, on `schedules` (the crontab's seven
/// fields, `--schedule`'s six); a way that fails is left out, which the report's final check
/// names.
fn all_costs(
    pg: &Pgleader,
    redis: Option<&redis_lock::Server>,
    schedules: (&str, &str),
    load: &'static str,
    window: Duration,
) -> Vec<CrontabCost> {
    eprintln!("bench: 14. crontab: one host's cost, {JOBS} jobs, {load}");
    let on = pg.log_statements(true);
    let postgres = Backend::Postgres(pg);
    let mut costs = vec![
        on.and_then(|()| cron_cost(postgres, schedules.0, load, window, Output::Tagged)),
        plain_cost(pg, schedules.1, load, window),
    ];
    // Busy, the jobs' output as it is, beside the tagged lines.
    if load == "every second" {
        costs.push(cron_cost(
            postgres,
            schedules.0,
            load,
            window,
            Output::Passthrough,
        ));
    }
    if let Err(err) = pg.log_statements(false) {
        eprintln!("bench:   cannot turn the server's statement log off: {err:#}");
    }
    if let Some(server) = redis {
        let backend = Backend::Redis(server);
        costs.push(
            backend
                .ready()
                .and_then(|()| cron_cost(backend, schedules.0, load, window, Output::Tagged)),
        );
    }
    costs
        .into_iter()
        .filter_map(|cost| {
            cost.map_err(|err| eprintln!("bench:   failed: {err:#}"))
                .ok()
        })
        .collect()
}

/// yacron's lateness row.
fn yacron_row(figures: Figures, note: String) -> Row {
    row(
        "cron.yacron.lateness",
        &format!("14. crontab: {JOBS} jobs"),
        crate::yacron::LABEL,
        "from each occurrence to its command running ($EPOCHREALTIME); every minute: yacron wakes once a minute and cannot run every second; one host, no fleet",
        figures,
        note,
    )
}

/// Waits until `live` (a fleet's replicas, or the floor's spawners) ran every job the latest
/// whole second, each its share, then out `window` of occurrences after that second; returns
/// the lateness of every run in the window and a note: how many of the occurrences ran, p99.
fn lateness(
    live: &[Candidate],
    window: Duration,
    jobs: usize,
) -> anyhow::Result<(Figures, String)> {
    let settled = balanced(live, jobs, 0)?;
    let first = settled + chrono::Duration::seconds(1);
    let last = settled + chrono::Duration::from_std(window)?;
    let wait = (last + chrono::Duration::milliseconds(1_500) - Utc::now()).to_std()?;
    sleep(wait);
    let runs: Vec<Run> = live
        .iter()
        .flat_map(runs_of)
        .filter(|r| r.occurrence >= first && r.occurrence <= last)
        .collect();
    let mut late = Figures::default();
    for run in &runs {
        late.sample_ms(run.late_ms());
    }
    let pairs: BTreeSet<(&str, DateTime<Utc>)> = runs
        .iter()
        .map(|r| (r.job.as_str(), r.occurrence))
        .collect();
    let expected = jobs * window.as_secs() as usize;
    let note = format!(
        "{} runs of {expected} occurrences ({} s × {jobs} jobs); {}",
        pairs.len(),
        window.as_secs(),
        p99(&late)
    );
    eprintln!("bench:   lateness p50 {:?} ms, {note}", late.median());
    Ok((late, note))
}

/// The floor beside the fleets' lateness with `jobs` jobs: [`REPLICAS`] spawners (this binary
/// re-invoked with [`SPAWNER_ARG`]), each starting its share of the jobs' bash commands at each
/// second's instant, with no server and no keeper, over the fleets' window; its row's lateness
/// is what starting those processes costs on this machine.
fn floor(plan: &Plan, jobs: usize) -> Row {
    eprintln!(
        "bench: 14. crontab: the floor, {REPLICAS} spawners of {jobs} bash commands every second and no scheduler, {} of runs",
        crate::figures::secs(plan.window)
    );
    let mut spawners: Vec<Candidate> = Vec::new();
    let result = (|| -> anyhow::Result<(Figures, String)> {
        spawners = start_spawners(jobs, 1)?;
        lateness(&spawners, plan.window, jobs)
    })();
    let (figures, note) = result.unwrap_or_else(|err| {
        let mut figures = Figures::default();
        figures.failure(format!("{err:#}").replace('\n', " "));
        (figures, String::new())
    });
    let (low, high) = (jobs / REPLICAS, jobs.div_ceil(REPLICAS));
    row(
        if jobs == JOBS {
            FLOOR_ROW
        } else {
            LIGHT_FLOOR_ROW
        },
        &scenario_of(jobs),
        FLOOR_LABEL,
        "the machine's floor, not a peer: the same bash commands, each spawner process starting its share at each second's instant (std::process::Command, no database, no keeper); from each occurrence to its command running ($EPOCHREALTIME), every run in the window",
        figures,
        format!("{note}; {REPLICAS} spawners of {low} or {high} jobs each"),
    )
}

/// [`REPLICAS`] spawners of the floor (this binary re-invoked with [`SPAWNER_ARG`]), sharing
/// `jobs` jobs, each starting its share every `period` seconds.
fn start_spawners(jobs: usize, period: u64) -> anyhow::Result<Vec<Candidate>> {
    let binary = std::env::current_exe().context("cannot find the benchmark's binary")?;
    Ok((0..REPLICAS)
        .map(|i| {
            let mut command = harness::clean(Command::new(&binary));
            command
                .arg(SPAWNER_ARG)
                .arg(i.to_string())
                .arg(jobs.to_string())
                .arg(period.to_string());
            Candidate::spawn(&format!("F{i}"), command)
        })
        .collect())
}

/// Scenario 14c: the lateness of a fleet of [`LIGHT_JOBS`] every-second jobs on [`REPLICAS`]
/// replicas on `backend`, over the plan's window, their output written as `output` says.
fn light(backend: Backend, plan: &Plan, output: Output) -> Row {
    eprintln!(
        "bench: {}, on {}{}, {} of runs",
        scenario_of(LIGHT_JOBS),
        backend.name(),
        match output {
            Output::Tagged => "",
            Output::Passthrough => ", --passthrough-logs",
            Output::Pinged => ", ping= on every job",
            Output::NotKept => ", --keep-output 0",
        },
        crate::figures::secs(plan.window)
    );
    let result = (|| -> anyhow::Result<(Figures, String)> {
        backend.ready()?;
        let lock = harness::unique_lock();
        let monitor = (output == Output::Pinged).then(|| Monitor::start(Answer::Status(200)));
        let pings = monitor.as_ref().map_or_else(String::new, |monitor| {
            format!("PGLEADER_PING=http://{}/ping/{{job}}\n", monitor.address)
        });
        let file = crontab_with("light", EVERY_SECOND, LIGHT_JOBS, &pings)?;
        let live: Vec<Candidate> = (0..REPLICAS)
            .map(|i| replica_with(backend, &format!("L{i}"), lock, &file, output))
            .collect();
        let (figures, note) = lateness(&live, plan.window, LIGHT_JOBS)?;
        Ok(match monitor {
            Some(monitor) => {
                drop(live);
                let received = monitor.received().len();
                (
                    figures,
                    format!("{note}; the monitor received {received} pings"),
                )
            }
            None => (figures, note),
        })
    })();
    let (figures, note) = result.unwrap_or_else(|err| {
        let mut figures = Figures::default();
        figures.failure(format!("{err:#}").replace('\n', " "));
        (figures, String::new())
    });
    let (id, label) = match output {
        Output::Tagged => (LIGHT_ROW, backend.label()),
        Output::Passthrough => (LIGHT_RAW_ROW, CRON_RAW_LABEL),
        Output::Pinged => (LIGHT_PINGS_ROW, CRON_PINGS_LABEL),
        Output::NotKept => (LIGHT_UNKEPT_ROW, CRON_UNKEPT_LABEL),
    };
    row(
        id,
        &scenario_of(LIGHT_JOBS),
        label,
        "from each occurrence to its command running ($EPOCHREALTIME), every run in the window",
        figures,
        note,
    )
}

/// Scenario 14e: how soon a run asked by hand starts on its owner, on `backend`. A fleet of
/// [`REPLICAS`] replicas with [`LIGHT_JOBS`] jobs that never fall due in the window; one
/// `pgleader cron run` of each job first, not measured (the fleet settles meanwhile), then
/// [`ASKS`] of them one after the other, round the jobs. Each run prints the moment it was
/// asked (`PGLEADER_SCHEDULED_TIME`, the server's clock as the request was written) and its
/// start (`$EPOCHREALTIME`): the time from the one to the other, which the request's wake-up
/// (NOTIFY, PUBLISH), the owner's take and the keeper's start make up; the command's own start
/// and its wait for the run's end are not in it.
fn asked(backend: Backend) -> Row {
    eprintln!(
        "bench: 14e. crontab: {ASKS} runs asked by hand (pgleader cron run) of {LIGHT_JOBS} jobs on {REPLICAS} replicas, on {}",
        backend.name()
    );
    let result = (|| -> anyhow::Result<(Figures, String)> {
        backend.ready()?;
        let lock = harness::unique_lock();
        let file = crontab("asked", IDLE, LIGHT_JOBS)?;
        let live: Vec<Candidate> = (0..REPLICAS)
            .map(|i| replica(backend, &format!("H{i}"), lock, &file))
            .collect();
        for candidate in &live {
            candidate
                .logged("joined the replicas", SETUP_WAIT)
                .with_context(|| format!("a replica never joined\n{}", tail(&candidate.dump())))?;
        }
        let ask = |n: usize| -> anyhow::Result<()> {
            let job = format!("j{}", n % LIGHT_JOBS + 1);
            let mut command = harness::pgleader();
            command.env("PGLEADER_DATABASE_URL", backend.url()).args([
                "cron",
                "run",
                &format!("--lock-id={lock}"),
                &job,
            ]);
            let out = command.output().context("cannot run pgleader cron run")?;
            if !out.status.success() {
                bail!(
                    "pgleader cron run {job}: {}\n{}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        for n in 0..LIGHT_JOBS {
            ask(n)?;
        }
        let from = Utc::now();
        for n in 0..ASKS {
            ask(n)?;
        }
        let runs: Vec<Run> = live
            .iter()
            .flat_map(runs_of)
            .filter(|run| run.occurrence >= from)
            .collect();
        let mut late = Figures::default();
        for run in &runs {
            late.sample_ms(run.late_ms());
        }
        let note = format!("{} runs of {ASKS} asked; {}", runs.len(), p99(&late));
        eprintln!("bench:   started after p50 {:?} ms, {note}", late.median());
        Ok((late, note))
    })();
    let (figures, note) = result.unwrap_or_else(|err| {
        let mut figures = Figures::default();
        figures.failure(format!("{err:#}").replace('\n', " "));
        (figures, String::new())
    });
    row(
        ASKED_ROW,
        &format!(
            "14e. crontab: runs asked by hand (pgleader cron run), {LIGHT_JOBS} jobs, {REPLICAS} replicas"
        ),
        backend.label(),
        "from the request, on the server's clock, to its command running ($EPOCHREALTIME) on the job's owner, one request at a time",
        figures,
        note,
    )
}

/// The scenario of a fleet of `jobs` every-second jobs (14, or 14c at the light load).
fn scenario_of(jobs: usize) -> String {
    let number = if jobs == JOBS { "14" } else { "14c" };
    format!("{number}. crontab: {jobs} every-second jobs, {REPLICAS} replicas")
}

/// A spawner of the floor (`SPAWNER_ARG INDEX JOBS [PERIOD]`): starts the jobs `jN` of
/// `j1`..`jJOBS` with N - 1 ≡ INDEX modulo [`REPLICAS`] (33 or 34 of 100) as `bash -c`
/// [`JOB_COMMAND`] at every whole second of the wall clock (every PERIOD seconds, whole
/// multiples of it, given PERIOD), with the variables pgleader gives the command, its
/// output on this process's; it exits when its parent (the benchmark) is gone.
pub fn spawner(index: &str, count: &str, period: &str) -> ExitCode {
    let Some(index) = index.parse::<usize>().ok().filter(|i| *i < REPLICAS) else {
        eprintln!("{SPAWNER_ARG} {index:?}: not a replica's index below {REPLICAS}");
        return ExitCode::from(2);
    };
    let Ok(count) = count.parse::<usize>() else {
        eprintln!("{SPAWNER_ARG} {index} {count:?}: not a number of jobs");
        return ExitCode::from(2);
    };
    let Some(period) = period.parse::<u64>().ok().filter(|p| *p > 0) else {
        eprintln!("{SPAWNER_ARG} {index} {count} {period:?}: not a number of seconds");
        return ExitCode::from(2);
    };
    let jobs: Vec<String> = (1..=count)
        .filter(|n| (n - 1) % REPLICAS == index)
        .map(|n| format!("j{n}"))
        .collect();
    let parent = std::os::unix::process::parent_id();
    let mut running: Vec<Child> = Vec::new();
    while std::os::unix::process::parent_id() == parent {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let instant = Duration::from_secs((now.as_secs() / period + 1) * period);
        sleep(instant - now);
        let occurrence = DateTime::<Utc>::from_timestamp(instant.as_secs() as i64, 0)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        for job in &jobs {
            let started = Command::new("bash")
                .arg("-c")
                .arg(JOB_COMMAND)
                .env("PGLEADER_JOB", job)
                .env("PGLEADER_SCHEDULED_TIME", &occurrence)
                .spawn();
            match started {
                Ok(child) => running.push(child),
                Err(err) => eprintln!("cannot start {job}'s command: {err}"),
            }
        }
        // The runs that ended, this second's or earlier ones, once this second's are started.
        running.retain_mut(|child| !matches!(child.try_wait(), Ok(Some(_))));
    }
    ExitCode::SUCCESS
}

/// A fleet's rows on `backend`: lateness over a window, then kill -9 runs; and over its whole
/// life, the distinct (job, occurrence) pairs that ran and how many of them ran twice.
fn fleet(backend: Backend, plan: &Plan) -> (Vec<Row>, CrontabFleet) {
    let scenario = scenario_of(JOBS);
    let kill_scenario = format!("14b. crontab: kill -9 of one of {REPLICAS} replicas, {JOBS} jobs");
    eprintln!(
        "bench: {scenario}, on {}, {} of runs",
        backend.name(),
        crate::figures::secs(plan.window)
    );
    let (mut late, mut owned, mut next) =
        (Figures::default(), Figures::default(), Figures::default());
    let mut note = String::new();
    let mut missed_next = 0;
    let mut gone: Vec<Candidate> = Vec::new();
    let mut live: Vec<Candidate> = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        backend.ready()?;
        let lock = harness::unique_lock();
        let file = crontab("fleet", EVERY_SECOND, JOBS)?;
        for i in 0..REPLICAS {
            live.push(replica(backend, &format!("R{i}"), lock, &file));
        }
        (late, note) = lateness(&live, plan.window, JOBS)?;
        eprintln!(
            "bench: {kill_scenario}, on {}, {} runs",
            backend.name(),
            plan.kills
        );
        for run in 0..plan.kills {
            match kill_once(backend, &mut live, &mut gone, lock, &file, run) {
                Ok((taken, lateness, missed)) => {
                    owned.sample(taken);
                    for l in lateness {
                        next.sample_ms(l);
                    }
                    missed_next += missed;
                }
                Err(err) => {
                    owned.failure(format!("{err:#}").replace('\n', " "));
                    break;
                }
            }
        }
        Ok(())
    })();
    if let Err(err) = result {
        late.failure(format!("{err:#}").replace('\n', " "));
    }
    // Every run any replica printed, killed ones included.
    let mut count: BTreeMap<(String, DateTime<Utc>), usize> = BTreeMap::new();
    for run in live.iter().chain(&gone).flat_map(runs_of) {
        *count.entry((run.job, run.occurrence)).or_default() += 1;
    }
    let twice = count.values().filter(|n| **n > 1).count();
    let next_note = format!(
        "{}; {missed_next} next occurrences not run (claimed by the killed replica)",
        p99(&next)
    );
    let rows = vec![
        row(
            LATENESS_ROW,
            &scenario,
            backend.label(),
            "from each occurrence to its command running ($EPOCHREALTIME), every run in the window",
            late,
            format!(
                "{note}; {twice} (job, occurrence) ran twice of {} that ran",
                count.len()
            ),
        ),
        row(
            OWNED_ROW,
            &kill_scenario,
            backend.label(),
            "from the kill to the last \"took job\" line on the others for its jobs",
            owned,
            "the kill at a random moment of a second".into(),
        ),
        row(
            NEXT_ROW,
            &kill_scenario,
            backend.label(),
            "each of its jobs' first occurrence after the kill: from the occurrence to its command running",
            next,
            next_note,
        ),
    ];
    let counts = CrontabFleet {
        label: backend.label(),
        backend: backend.name(),
        runs: count.len(),
        twice,
    };
    (rows, counts)
}

/// Kills the replica `run` picks; returns when the others took its jobs (from the kill), the
/// lateness of each job's next occurrence, and how many of those did not run. A new replica
/// then joins and the fleet is balanced again.
fn kill_once(
    backend: Backend,
    live: &mut Vec<Candidate>,
    gone: &mut Vec<Candidate>,
    lock: i64,
    file: &std::path::Path,
    run: usize,
) -> anyhow::Result<(Duration, Vec<f64>, usize)> {
    let second = balanced(live, JOBS, 0)?;
    let victim = run % live.len();
    let orphaned = jobs_at(&live[victim], second);
    sleep(random_phase(Duration::from_secs(1)));
    let fault = Instant::now();
    let killed_at: DateTime<Utc> = SystemTime::now().into();
    live[victim].signal(Signal::SIGKILL);
    gone.push(live.remove(victim));
    let last = taken(live, &orphaned, fault, &gone[gone.len() - 1])?;
    let (lateness, missed, _) = next_runs(live, None, &orphaned, killed_at);
    eprintln!(
        "bench:   run {}: {} jobs owned elsewhere after {:.1} ms; next occurrence p50 {}",
        run + 1,
        orphaned.len(),
        last.as_secs_f64() * 1000.0,
        crate::figures::Summary::quantile(&lateness, 0.5).map_or_else(|| "–".into(), ms)
    );
    live.push(replica(backend, &format!("J{run}"), lock, file));
    Ok((last, lateness, missed))
}

/// The jobs `candidate` ran the occurrence `second` of.
fn jobs_at(candidate: &Candidate, second: DateTime<Utc>) -> Vec<String> {
    runs_of(candidate)
        .into_iter()
        .filter(|r| r.occurrence == second)
        .map(|r| r.job)
        .collect()
}

/// How long after `fault` the last of `jobs` was taken by one of `live` (its "took job" line);
/// an error, with the end of `left`'s output, if one was not within 10 s.
fn taken(
    live: &[Candidate],
    jobs: &[String],
    fault: Instant,
    left: &Candidate,
) -> anyhow::Result<Duration> {
    let needles: Vec<String> = jobs.iter().map(|job| format!("took job {job} ")).collect();
    let survivors: Vec<&Candidate> = live.iter().collect();
    last_of(
        &survivors,
        Stream::Stderr,
        &needles,
        fault,
        Duration::from_secs(10),
    )
    .map_err(|pending| anyhow::anyhow!("{pending:?} were never taken\n{}", tail(&left.dump())))
}

/// Once it has had a second to run: the lateness of each of `jobs`' first occurrence after
/// `fault` (the next whole second) on `live`, how many of them did not run there, and how many
/// of those `left` (the replica the fault hit, when it lives on: a TERM) ran itself.
fn next_runs(
    live: &[Candidate],
    left: Option<&Candidate>,
    jobs: &[String],
    fault: DateTime<Utc>,
) -> (Vec<f64>, usize, usize) {
    let next = fault.trunc_subsecs(0) + chrono::Duration::seconds(1);
    let wait = (next + chrono::Duration::milliseconds(2_500) - Utc::now()).to_std();
    sleep(wait.unwrap_or_default());
    let runs: Vec<Run> = live.iter().flat_map(runs_of).collect();
    let by_left: Vec<Run> = left.map(runs_of).unwrap_or_default();
    let (mut lateness, mut missed, mut ran_by_left) = (Vec::new(), 0, 0);
    for job in jobs {
        let of = |r: &&Run| &r.job == job && r.occurrence == next;
        match runs.iter().find(of) {
            Some(r) => lateness.push(r.late_ms()),
            None if by_left.iter().any(|r| of(&r)) => ran_by_left += 1,
            None => missed += 1,
        }
    }
    (lateness, missed, ran_by_left)
}

/// Scenario 14d: a TERM to the replica whose `long` job runs, [`LIGHT_JOBS`] every-second jobs
/// beside it on [`REPLICAS`] replicas on `backend`, `plan.kills` times: how soon the others own
/// its idle jobs, how late those jobs' next occurrence runs there, and whether the run going on
/// ended by itself (no signal: it prints its end) before the replica exited.
fn drained(backend: Backend, plan: &Plan) -> Vec<Row> {
    let scenario = format!(
        "14d. crontab: TERM of one of {REPLICAS} replicas while a 2 s run of its goes on, {LIGHT_JOBS} every-second jobs"
    );
    eprintln!(
        "bench: {scenario}, on {}, {} runs",
        backend.name(),
        plan.kills
    );
    let (mut owned, mut next) = (Figures::default(), Figures::default());
    let (mut ended, mut missed, mut ran_before) = (0, 0, 0);
    let mut live: Vec<Candidate> = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        backend.ready()?;
        let lock = harness::unique_lock();
        let file = crontab_with("drain", EVERY_SECOND, LIGHT_JOBS, LONG_JOB)?;
        for i in 0..REPLICAS {
            live.push(replica(backend, &format!("D{i}"), lock, &file));
        }
        for run in 0..plan.kills {
            let (taken, lateness, finished, not_run, ran_there) = term_once(&mut live, run)?;
            owned.sample(taken);
            lateness.into_iter().for_each(|l| next.sample_ms(l));
            ended += usize::from(finished);
            missed += not_run;
            ran_before += ran_there;
            live.push(replica(backend, &format!("J{run}"), lock, &file));
        }
        Ok(())
    })();
    if let Err(err) = result {
        owned.failure(format!("{err:#}").replace('\n', " "));
    }
    let next_note = format!(
        "{}; {missed} next occurrences not run ({ran_before} more run by the TERMed replica before it let the job go)",
        p99(&next)
    );
    vec![
        row(
            TERM_OWNED_ROW,
            &scenario,
            backend.label(),
            "from the TERM to the last \"took job\" line on the others for its idle jobs",
            owned,
            format!(
                "the run going on ended by itself, unsignalled, before the replica exited: {ended} of {} TERMs",
                plan.kills
            ),
        ),
        row(
            TERM_NEXT_ROW,
            &scenario,
            backend.label(),
            "each of its idle jobs' first occurrence after the TERM: from the occurrence to its command running",
            next,
            next_note,
        ),
    ]
}

/// One TERM of scenario 14d: once the fleet is balanced, waits for `long` to start, TERMs the
/// replica running it and measures (the hand-over, the next occurrences' lateness, whether the
/// run ended by itself, how many next occurrences ran nowhere and how many on the TERMed
/// replica itself); the TERMed replica leaves `live`.
fn term_once(
    live: &mut Vec<Candidate>,
    run: usize,
) -> anyhow::Result<(Duration, Vec<f64>, bool, usize, usize)> {
    // The long job is one of the file's jobs too.
    let second = balanced(live, LIGHT_JOBS, 1)?;
    let longs = |c: &Candidate| {
        printed(c)
            .iter()
            .filter(|l| l.starts_with("l long "))
            .count()
    };
    let before: Vec<usize> = live.iter().map(longs).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let owner = loop {
        if let Some(i) = (0..live.len()).find(|i| longs(&live[*i]) > before[*i]) {
            break i;
        }
        if Instant::now() > deadline {
            bail!("the long job did not start within 10 s");
        }
        sleep(Duration::from_millis(10));
    };
    let occurrence = printed(&live[owner])
        .into_iter()
        .rfind(|l| l.starts_with("l long "))
        .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .unwrap_or_default();
    let idle = jobs_at(&live[owner], second);
    sleep(random_phase(Duration::from_millis(500)));
    let fault = Instant::now();
    let termed_at: DateTime<Utc> = SystemTime::now().into();
    live[owner].signal(Signal::SIGTERM);
    let termed = live.remove(owner);
    let last = taken(live, &idle, fault, &termed)?;
    // The run going on prints its end, then the replica lets the job go and exits.
    let finished = termed
        .line(
            Stream::Stderr,
            "released every shard",
            1,
            None,
            Duration::from_secs(10),
        )
        .is_some()
        && printed(&termed).contains(&format!("e long {occurrence}"));
    let (lateness, missed, ran_before) = next_runs(live, Some(&termed), &idle, termed_at);
    eprintln!(
        "bench:   run {}: {} idle jobs owned elsewhere after {:.1} ms; the run going on {}",
        run + 1,
        idle.len(),
        last.as_secs_f64() * 1000.0,
        if finished {
            "ended by itself"
        } else {
            "did NOT end by itself"
        }
    );
    Ok((last, lateness, finished, missed, ran_before))
}

/// Sessions, memory and requests (statements on PostgreSQL, with the server's statement log
/// on; commands on Redis, seen by `MONITOR`) of processes `pids` (pgleader's) and their
/// keepers, over `window` from now.
fn measure(
    backend: Backend,
    how: String,
    load: &'static str,
    pids: &[i32],
    window: Duration,
) -> anyhow::Result<CrontabCost> {
    let (connections, sent) = match backend {
        Backend::Postgres(pg) => {
            let mut backends = Vec::new();
            for pid in pids {
                backends.extend(pg.backends_of(*pid)?);
            }
            let mark = pg.cluster.log().len();
            sleep(window);
            let statements = pg.statements_since(mark);
            let sent: u64 = backends.iter().filter_map(|b| statements.get(b)).sum();
            (backends.len(), sent as f64 / window.as_secs_f64())
        }
        Backend::Redis(server) => {
            let mut ports = Vec::new();
            for pid in pids {
                ports.extend(server.clients_of(*pid)?);
            }
            (ports.len(), server.requests_over(&ports, window)?)
        }
    };
    let keepers: Vec<i32> = pids.iter().flat_map(|pid| procfs::children(*pid)).collect();
    let rss: u64 = pids
        .iter()
        .chain(&keepers)
        .filter_map(|pid| procfs::rss_kib(*pid))
        .sum();
    Ok(CrontabCost {
        how,
        load,
        window,
        processes: pids.len(),
        keepers: keepers.len(),
        connections: Some(connections),
        rss_kib: rss,
        requests_per_second: Some(sent),
    })
}

/// One `pgleader cron` on `backend` owning all [`JOBS`] jobs on `schedule`, its jobs' output
/// written as `output` says.
fn cron_cost(
    backend: Backend,
    schedule: &str,
    load: &'static str,
    window: Duration,
    output: Output,
) -> anyhow::Result<CrontabCost> {
    let file = crontab("cost", schedule, JOBS)?;
    let cron = replica_with(backend, "C", harness::unique_lock(), &file, output);
    let how = match output {
        // The costs are measured without pings (no monitor here).
        Output::Tagged | Output::Pinged | Output::NotKept => cron_how(backend.name()),
        Output::Passthrough => format!(
            "one `pgleader cron --passthrough-logs` on {}, {JOBS} jobs",
            backend.name()
        ),
    };
    cron.line(Stream::Stderr, "took job ", JOBS, None, SETUP_WAIT)
        .with_context(|| format!("it never took its {JOBS} jobs\n{}", tail(&cron.dump())))?;
    sleep(Duration::from_secs(1));
    measure(backend, how, load, &[cron.pid()], window)
}

/// [`JOBS`] `pgleader run --schedule SCHEDULE` processes, one lock each, each leading.
fn plain_cost(
    pg: &Pgleader,
    schedule: &str,
    load: &'static str,
    window: Duration,
) -> anyhow::Result<CrontabCost> {
    let url = pg.cluster.url();
    let processes: Vec<Candidate> = (0..JOBS)
        .map(|n| {
            let command: Command = run_command(
                None,
                &url,
                harness::unique_lock(),
                &["--schedule", schedule],
                "echo c $PGLEADER_SCHEDULED_TIME",
            );
            Candidate::spawn(&format!("P{n}"), command)
        })
        .collect();
    for process in &processes {
        process
            .line(Stream::Stderr, "became leader", 1, None, SETUP_WAIT)
            .with_context(|| format!("one never led\n{}", tail(&process.dump())))?;
    }
    sleep(Duration::from_secs(1));
    let pids: Vec<i32> = processes.iter().map(Candidate::pid).collect();
    measure(
        Backend::Postgres(pg),
        format!("{JOBS} `pgleader run --schedule` processes on PostgreSQL"),
        load,
        &pids,
        window,
    )
}
