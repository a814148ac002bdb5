//! The failover benchmark of issue 5: how fast pgleader hands over and notices faults, what an
//! idle candidate costs, and how it scales, side by side with `etcdctl lock` in the same run on
//! the same machine. It starts its own PostgreSQL (with the integration tests' harness) and its
//! own etcd, runs every scenario with real processes and real faults, and writes BENCHMARKS.md.
//! On Redis it compares pgleader with redis-py's `Lock` on one server (`redis_lock.rs`) and,
//! over a Redlock quorum of three servers, with npm `redlock` (`redlock.rs`).
//!
//! `cargo bench --bench failover` runs the full benchmark (20 runs per scenario, 60 s cost
//! windows, about a quarter of an hour) and updates BENCHMARKS.md at the repository's root.
//! `cargo bench --bench failover -- --quick` runs a few of each and writes its report under the
//! target directory; CI runs it so the benchmark cannot rot. Either mode exits non-zero when a
//! scenario produced no figures at all.

#[path = "../../tests/integration/harness/mod.rs"]
#[expect(
    dead_code,
    unused_imports,
    reason = "the benchmark uses part of the integration tests' harness; the rest is theirs"
)]
mod harness;

mod cron;
mod etcd;
mod figures;
mod http;
mod procfs;
mod redis_lock;
mod redlock;
mod report;
mod scenarios;
mod scheduled;
mod shards;
mod tools;
mod yacron;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use crate::etcd::Etcd;
use crate::harness::Cluster;
use crate::redis_lock::{PgleaderRedis, RedisPy};
use crate::report::Report;
use crate::tools::{
    PARTITION_ARGS, PREVIOUS_LABEL, PREVIOUS_REDIS_LABEL, Pgleader, STATIC_LABEL,
    STATIC_REDIS_LABEL, Tool, first_line,
};

const USAGE: &str = "usage: cargo bench --bench failover [-- [--quick] [--only http|redis|quorum|failover|shards|cron|scale] [--runs N] [--out PATH] [--static PATH] [--previous PATH]]
  --quick        a few runs per scenario and short windows (CI); the report goes under target/
  --only http    only scenario 9 (the HTTP endpoint) and the idle cost with --http; the report
                 goes under target/ (BENCHMARKS.md is written by full runs only)
  --only redis   only the Redis rows: pgleader on Redis beside redis-py's Lock (with --previous
                 or --static, beside that build's too); the report goes under target/
  --only quorum  only the Redlock rows: pgleader over three Redis servers beside npm redlock,
                 and pgleader on one server for comparison; the report goes under target/
  --only failover  only pgleader's kill -9, SIGTERM, step-down, frozen and start scenarios, the new
                 leader's steps and the idle cost (with --previous or --static, beside that
                 build's); the report goes under target/
  --only shards  only the shards' scenarios: kill -9 of a replica and a replica joining, for
                 K = 16 and 64 on 4 replicas, a replica's cost (with --previous or --static,
                 beside that build's), and the same fleet as K plain processes per replica; the
                 report goes under target/
  --only cron    only the crontab's scenarios (issue 37): 100 every-second jobs on 3 replicas
                 of `pgleader cron`, on PostgreSQL and on Redis (lateness over 60 s, or 10 s
                 with --quick; kill -9 of a replica, 20 runs or 5), and one host's cost as one
                 `pgleader cron` on either, as 100 `pgleader run --schedule` processes and as
                 yacron (pip-installed); beside the lateness, the machine's floor: the same
                 commands started by 3 spawners with no scheduler; then 14f; the report goes
                 under target/
  --only scale   only scenario 14f (issue 50): 1,000 idle jobs on 3 replicas of `pgleader
                 cron`, on PostgreSQL and on Redis: a replica's CPU and RSS at rest, a kill -9's
                 hand-over and a join's share; then 1,000 jobs every 10 s: the lateness of their
                 bursts beside the floor's, and the RSS above rest (with --previous, beside that
                 build's); the report goes under target/
  --runs N       runs per scenario (default 20, or 3 with --quick)
  --out PATH     where to write the report (default BENCHMARKS.md, or target/.../BENCHMARKS.quick.md)
  --static PATH  also run pgleader's failover, start-up, cost and shards' scenarios, on
                 PostgreSQL and on Redis, with this binary (the release's static one,
                 dist/pgleader-<version>-x86_64-linux), beside cargo's, scenario by scenario;
                 not with --only http or quorum
  --previous PATH  the same with a previous build of pgleader (a release build of an earlier
                 commit), to compare in one run; with --only quorum, its kill -9 over the three
                 servers beside this build's";

/// How much to run.
#[derive(Debug)]
struct Plan {
    quick: bool,
    /// Only the HTTP endpoint's scenarios (`--only http`).
    only_http: bool,
    /// Only the Redis rows (`--only redis`).
    only_redis: bool,
    /// Only the quorum's rows (`--only quorum`).
    only_quorum: bool,
    /// Only pgleader's failover, start and cost (`--only failover`).
    only_failover: bool,
    /// Only the shards' scenarios (`--only shards`).
    only_shards: bool,
    /// Only the crontab's scenarios (`--only cron`).
    only_cron: bool,
    /// `--only scale`: scenario 14f alone.
    only_scale: bool,
    /// Runs of each scenario whose runs take milliseconds.
    runs: usize,
    /// Runs of each scenario bound by a lease (seconds per run): the partition, and every
    /// peer scenario that waits for its TTL; also the failovers at each scale.
    lease_runs: usize,
    /// Runs of a peer scenario where nothing is expected to happen (each waits out a bound).
    never_runs: usize,
    /// Runs of pgleader's scenario that kills two of a quorum's three servers: each run after
    /// the first waits a lease (11 s) until the restarted servers vote again.
    restart_runs: usize,
    cost_window: Duration,
    scale_window: Duration,
    out: PathBuf,
    /// A second pgleader binary to measure beside cargo's (`--static`).
    static_binary: Option<PathBuf>,
    /// A previous build to measure beside cargo's (`--previous`).
    previous_binary: Option<PathBuf>,
}

impl Plan {
    fn from_args() -> Result<Plan, String> {
        let mut quick = false;
        let mut static_binary = None;
        let mut only_http = false;
        let mut only_redis = false;
        let mut only_failover = false;
        let mut only_shards = false;
        let mut only_cron = false;
        let mut only_scale = false;
        let mut previous_binary = None;
        let mut only_quorum = false;
        let mut runs = None;
        let mut out = None;
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--only" => match args.next().as_deref() {
                    Some("http") => only_http = true,
                    Some("redis") => only_redis = true,
                    Some("quorum") => only_quorum = true,
                    Some("failover") => only_failover = true,
                    Some("shards") => only_shards = true,
                    Some("cron") => only_cron = true,
                    Some("scale") => only_scale = true,
                    other => {
                        return Err(format!(
                            "--only {other:?}: the groups are http, redis, quorum, failover, \
                             shards, cron and scale"
                        ));
                    }
                },
                "--runs" => {
                    let value = args.next().ok_or("--runs needs a number")?;
                    runs = Some(
                        value
                            .parse::<usize>()
                            .ok()
                            .filter(|n| *n > 0)
                            .ok_or(format!("--runs {value}: not a positive number"))?,
                    );
                }
                "--out" => out = Some(PathBuf::from(args.next().ok_or("--out needs a path")?)),
                "--static" => {
                    let path = PathBuf::from(args.next().ok_or("--static needs a path")?);
                    if !path.is_file() {
                        return Err(format!(
                            "--static {}: no such file (scripts/release makes it)",
                            path.display()
                        ));
                    }
                    static_binary = Some(path);
                }
                "--previous" => {
                    let path = PathBuf::from(args.next().ok_or("--previous needs a path")?);
                    if !path.is_file() {
                        return Err(format!("--previous {}: no such file", path.display()));
                    }
                    previous_binary = Some(path);
                }
                // cargo bench passes --bench to every benchmark binary.
                "--bench" => {}
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        if (only_http && (static_binary.is_some() || previous_binary.is_some()))
            || ((only_quorum || only_cron || only_scale) && static_binary.is_some())
        {
            return Err(
                "--static and --previous measure the PostgreSQL, Redis and shards' rows (and \
                 --previous the quorum's kill -9 and the 1,000-job crontab's rows); --only http \
                 runs cargo's build alone, and --only quorum, cron and scale with --previous only"
                    .into(),
            );
        }
        let runs = runs.unwrap_or(if quick { 3 } else { 20 });
        Ok(Plan {
            static_binary,
            previous_binary,
            quick,
            only_http,
            only_redis,
            only_failover,
            only_shards,
            only_cron,
            only_scale,
            only_quorum,
            runs,
            lease_runs: if quick { 2 } else { runs },
            never_runs: if quick { 1 } else { 5.min(runs) },
            restart_runs: if quick { 1 } else { runs },
            cost_window: Duration::from_secs(if quick { 5 } else { 60 }),
            scale_window: Duration::from_secs(if quick { 2 } else { 10 }),
            out: out.unwrap_or_else(|| {
                if only_http {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.http.md")
                } else if only_redis {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.redis.md")
                } else if only_quorum {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.quorum.md")
                } else if only_failover {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.failover.md")
                } else if only_shards {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.shards.md")
                } else if only_cron {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.cron.md")
                } else if only_scale {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.scale.md")
                } else if quick {
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("BENCHMARKS.quick.md")
                } else {
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("BENCHMARKS.md")
                }
            }),
        })
    }
}

/// A pgleader binary measured beside cargo's (`--previous`, `--static`), and its rows' labels.
#[derive(Debug)]
struct Build {
    binary: PathBuf,
    /// On PostgreSQL.
    label: &'static str,
    /// On Redis.
    redis_label: &'static str,
}

impl Plan {
    /// The binaries to measure beside cargo's, in the order their rows follow its rows.
    fn other_builds(&self) -> Vec<Build> {
        [
            (&self.previous_binary, PREVIOUS_LABEL, PREVIOUS_REDIS_LABEL),
            (&self.static_binary, STATIC_LABEL, STATIC_REDIS_LABEL),
        ]
        .into_iter()
        .filter_map(|(binary, label, redis_label)| {
            Some(Build {
                binary: binary.clone()?,
                label,
                redis_label,
            })
        })
        .collect()
    }

    /// The other builds against `cluster`.
    fn other_pgleaders(&self, cluster: &Arc<Cluster>) -> Vec<Pgleader> {
        self.other_builds()
            .into_iter()
            .map(|build| Pgleader::with_binary(cluster.clone(), build.binary, build.label))
            .collect()
    }

    /// pgleader on the Redis `server`: cargo's build, then the other builds.
    fn pgleaders_on_redis(&self, server: &Arc<redis_lock::Server>) -> Vec<PgleaderRedis> {
        let mut pgleaders = vec![PgleaderRedis::new(server.clone())];
        pgleaders.extend(self.other_builds().into_iter().map(|build| {
            PgleaderRedis::with_binary(server.clone(), build.binary, build.redis_label)
        }));
        pgleaders
    }
}

fn main() -> ExitCode {
    // The benchmark re-invokes itself as the spawners of scenario 14's floor.
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some(cron::SPAWNER_ARG) {
        let index = args.next().unwrap_or_default();
        let jobs = args.next().unwrap_or_default();
        return cron::spawner(&index, &jobs, args.next().as_deref().unwrap_or("1"));
    }
    let plan = match Plan::from_args() {
        Ok(plan) => plan,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("bench: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if message.is_empty() { 0 } else { 2 });
        }
    };
    match run(&plan) {
        Ok(report) => {
            println!("{}", report.markdown());
            let missing = report.missing();
            if missing.is_empty() {
                eprintln!(
                    "bench: every scenario produced figures; report in {}",
                    plan.out.display()
                );
                ExitCode::SUCCESS
            } else {
                eprintln!("bench: these scenarios produced no figures:");
                for scenario in missing {
                    eprintln!("bench:   {scenario}");
                }
                ExitCode::FAILURE
            }
        }
        Err(err) => {
            eprintln!("bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(plan: &Plan) -> anyhow::Result<Report> {
    if plan.only_http {
        return run_http_only(plan);
    }
    if plan.only_redis {
        return run_redis_only(plan);
    }
    if plan.only_failover {
        return run_failover_only(plan);
    }
    if plan.only_quorum {
        return run_quorum_only(plan);
    }
    if plan.only_shards {
        return run_shards_only(plan);
    }
    if plan.only_cron {
        return run_cron_only(plan);
    }
    if plan.only_scale {
        return run_scale_only(plan);
    }
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    etcd::ensure_installed()?;
    redis_lock::ensure_redis_py()?;
    redlock::ensure_redlock()?;
    yacron::ensure_installed()?;
    eprintln!("bench: starting PostgreSQL, etcd and Redis (one server, and a quorum of three)");
    let cluster = bench_cluster("bench");
    let pgleader = Pgleader::new(cluster.clone());
    let others = plan.other_pgleaders(&cluster);
    let etcd = Etcd::start()?;
    let redis_server = Arc::new(redis_lock::Server::start()?);
    let quorum = redlock::Quorum::start()?;
    // pgleader's default restart fence is 1 + 2 + 5 + 1 = 9 s.
    eprintln!("bench: waiting until the server has been up 10 s, past pgleader's restart fence");
    pgleader.wait_until_server_is(Duration::from_secs(10))?;
    // The other binaries' rows come right after cargo's, in the same run.
    let mut pgleaders: Vec<&Pgleader> = vec![&pgleader];
    pgleaders.extend(&others);
    let mut tools: Vec<&dyn Tool> = pgleaders.iter().map(|p| *p as &dyn Tool).collect();
    tools.push(&etcd);

    let mut rows = Vec::new();
    let is_peer = |tool: &dyn Tool| !tool.label().starts_with(pgleader.label());
    for &tool in &tools {
        let runs = if is_peer(tool) {
            plan.lease_runs
        } else {
            plan.runs
        };
        rows.extend(scenarios::kill9(tool, runs));
    }
    rows.extend(scenarios::breakdown(
        &pgleader.with_extra(&["-v"]),
        plan.runs,
    ));
    for &tool in &tools {
        let runs = if is_peer(tool) {
            plan.never_runs
        } else {
            plan.runs
        };
        rows.extend(scenarios::sigterm(tool, runs, false));
    }
    for &tool in &tools {
        rows.extend(scenarios::sigterm(tool, plan.runs, true));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::step_down(*pgleader, plan.runs));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::end_session(
            *pgleader,
            plan.runs,
            "pg_terminate_backend",
        ));
    }
    rows.extend(scenarios::end_session(
        &etcd,
        plan.runs,
        "etcd: lease revoke",
    ));
    for &tool in &tools {
        rows.extend(scenarios::partition(tool, plan.lease_runs));
    }
    for &tool in &tools {
        rows.extend(scenarios::frozen(tool, plan.lease_runs));
    }
    for &tool in &tools {
        rows.extend(scenarios::start(tool, plan.runs));
    }
    let (redis_rows, redis_costs) = redis_scenarios(&redis_server, plan)?;
    rows.extend(redis_rows);
    let (quorum_rows, quorum_costs) = quorum_scenarios(&quorum, plan)?;
    rows.extend(quorum_rows);

    let mut costs = tools::idle_costs(&tools, plan.cost_window);
    costs.extend(http_cost(&pgleader, plan));
    costs.extend(redis_costs);
    costs.extend(quorum_costs);

    let mut scales = Vec::new();
    // At scale, the server's work dominates: cargo's binary only.
    for n in [10, 50, 100] {
        for tool in [&pgleader as &dyn Tool, &etcd] {
            scales.push(scenarios::scale(
                tool,
                n,
                plan.lease_runs,
                plan.scale_window,
            ));
        }
    }

    rows.push(scheduled::on_time(&pgleader, plan.runs));
    rows.push(scheduled::after_kill9(&pgleader, plan.runs));
    match scheduled::idle_cost(&pgleader, plan.cost_window) {
        Ok(cost) => costs.push(cost),
        Err(err) => eprintln!("bench:   failed: {err:#}"),
    }
    let timers = scheduled::timers(&pgleader, plan.runs).unwrap_or_else(|err| {
        eprintln!("bench:   the timers failed: {err:#}");
        Vec::new()
    });
    rows.extend(http::scrape(&pgleader, plan.runs * 10));
    rows.extend(http::leader_after_kill9(&pgleader, plan.runs));
    let (shard_rows, shard_costs, fleets) = shard_scenarios(&pgleaders, plan);
    rows.extend(shard_rows);
    costs.extend(shard_costs);
    let (cron_rows, crontab) = cron::scenarios(&pgleader, Some(&redis_server), &plan.cron());
    rows.extend(cron_rows);
    sort_by_scenario(&mut rows);

    let report = Report {
        quick: plan.quick,
        only: None,
        started,
        took: began.elapsed(),
        environment: environment(
            &pgleader,
            Some(&etcd),
            Some(&redis_server),
            plan.static_binary.as_deref(),
            plan.previous_binary.as_deref(),
        ),
        settings: settings(plan),
        rows,
        costs,
        scales,
        timers,
        fleets,
        crontab: Some(crontab),
    };
    written(report, plan)
}

/// pgleader against a PostgreSQL of its own, named `name`, once it accepts connections.
fn pgleader_on_own_server(name: &str) -> anyhow::Result<Pgleader> {
    eprintln!("bench: starting PostgreSQL");
    let pgleader = Pgleader::new(bench_cluster(name));
    pgleader.wait_until_server_is(Duration::from_secs(10))?;
    Ok(pgleader)
}

/// Scenario 9 and the idle cost with `--http` alone, against a server of its own.
fn run_http_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let pgleader = pgleader_on_own_server("bench-http")?;
    let mut rows = http::scrape(&pgleader, plan.runs * 10);
    rows.extend(http::leader_after_kill9(&pgleader, plan.runs));
    // Without --http too, in the same run, to compare.
    eprintln!("bench: 6. cost of an idle candidate (pgleader)");
    let mut costs = pgleader.cost(plan.cost_window).unwrap_or_else(|err| {
        eprintln!("bench:   failed: {err:#}");
        Vec::new()
    });
    costs.extend(http_cost(&pgleader, plan));
    let report = Report {
        only: Some("9 and the idle cost with --http"),
        took: began.elapsed(),
        environment: environment(&pgleader, None, None, None, None),
        rows,
        costs,
        ..partial_report(plan, started)
    };
    written(report, plan)
}

/// Writes the report where the plan says, and returns it.
fn written(report: Report, plan: &Plan) -> anyhow::Result<Report> {
    report
        .write(&plan.out)
        .with_context(|| format!("cannot write {}", plan.out.display()))?;
    Ok(report)
}

/// The Redis rows (issue 16): pgleader on Redis beside redis-py's Lock on one server, and what
/// an idle candidate of each costs.
fn redis_scenarios(
    server: &Arc<redis_lock::Server>,
    plan: &Plan,
) -> anyhow::Result<(Vec<figures::Row>, Vec<figures::Cost>)> {
    // With --previous or --static, their rows come right after cargo's, scenario by scenario.
    let pgleaders = plan.pgleaders_on_redis(server);
    let redis_py = RedisPy {
        server: server.clone(),
    };
    let mut tools: Vec<&dyn Tool> = pgleaders.iter().map(|p| p as &dyn Tool).collect();
    tools.push(&redis_py);
    server.wait_until_up(Duration::from_secs(10))?;
    let mut rows = Vec::new();
    for pgleader in &pgleaders {
        rows.extend(scenarios::kill9(pgleader, plan.runs));
    }
    rows.extend(scenarios::kill9(&redis_py, plan.lease_runs));
    for &tool in &tools {
        rows.extend(scenarios::sigterm(tool, plan.runs, false));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::step_down(pgleader, plan.runs));
    }
    for &tool in &tools {
        rows.extend(scenarios::key_deleted(tool, plan.runs));
    }
    for &tool in &tools {
        rows.extend(scenarios::start(tool, plan.runs));
    }
    Ok((rows, tools::idle_costs(&tools, plan.cost_window)))
}

/// The Redis rows alone (`--only redis`), with a PostgreSQL server for the environment's
/// versions only.
fn run_redis_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    redis_lock::ensure_redis_py()?;
    eprintln!("bench: starting Redis");
    let server = Arc::new(redis_lock::Server::start()?);
    let (mut rows, costs) = redis_scenarios(&server, plan)?;
    sort_by_scenario(&mut rows);
    let mut environment = environment_of_machine();
    environment.extend(previous_environment(plan.previous_binary.as_deref()));
    environment.extend(redis_environment(&server));
    let report = Report {
        only: Some(report::ONLY_REDIS),
        took: began.elapsed(),
        environment,
        rows,
        costs,
        ..partial_report(plan, started)
    };
    report
        .write(&plan.out)
        .with_context(|| format!("cannot write {}", plan.out.display()))?;
    Ok(report)
}

/// A report of some scenarios only (`--only`), without scale or timers: the caller fills in
/// what it measured.
fn partial_report(plan: &Plan, started: String) -> Report {
    Report {
        quick: plan.quick,
        only: None,
        started,
        took: Duration::ZERO,
        environment: Vec::new(),
        settings: settings(plan),
        rows: Vec::new(),
        costs: Vec::new(),
        scales: Vec::new(),
        timers: Vec::new(),
        fleets: Vec::new(),
        crontab: None,
    }
}

/// The quorum's rows (issue 17), once its servers have been up long enough to vote.
fn quorum_scenarios(
    quorum: &redlock::Quorum,
    plan: &Plan,
) -> anyhow::Result<(Vec<figures::Row>, Vec<figures::Cost>)> {
    quorum.wait_until_up(Duration::from_secs(10))?;
    Ok(redlock::scenarios(
        quorum,
        plan.runs,
        plan.lease_runs,
        &redlock::LossRuns {
            freeze: plan.lease_runs,
            kill: plan.restart_runs,
            peer: plan.never_runs,
        },
        plan.cost_window,
        plan.previous_binary.as_deref(),
    ))
}

/// The quorum's rows alone (`--only quorum`), with pgleader on one server beside them in the
/// same run for the rows that compare one server with three (start, graceful handoff).
fn run_quorum_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    redlock::ensure_redlock()?;
    eprintln!("bench: starting Redis (one server, and a quorum of three)");
    let server = Arc::new(redis_lock::Server::start()?);
    let quorum = redlock::Quorum::start()?;
    server.wait_until_up(Duration::from_secs(10))?;
    let on_one = PgleaderRedis::new(server.clone());
    let mut rows = scenarios::start(&on_one, plan.runs);
    rows.extend(scenarios::sigterm(&on_one, plan.runs, false));
    let (quorum_rows, costs) = quorum_scenarios(&quorum, plan)?;
    rows.extend(quorum_rows);
    sort_by_scenario(&mut rows);
    let mut environment = environment_of_machine();
    environment.push(("Redis", server.version()));
    environment.extend(redlock_environment());
    let report = Report {
        only: Some(report::ONLY_QUORUM),
        took: began.elapsed(),
        environment,
        rows,
        costs,
        ..partial_report(plan, started)
    };
    written(report, plan)
}

/// pgleader's kill -9, SIGTERM and start scenarios, the new leader's steps and the idle cost
/// (issue 18), beside a previous build (`--previous`) and the static binary (`--static`).
fn run_failover_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    eprintln!("bench: starting PostgreSQL");
    let cluster = bench_cluster("bench-failover");
    let pgleader = Pgleader::new(cluster.clone());
    let others = plan.other_pgleaders(&cluster);
    pgleader.wait_until_server_is(Duration::from_secs(10))?;
    let mut pgleaders = vec![&pgleader];
    pgleaders.extend(&others);
    let mut rows = Vec::new();
    // Interleaved by scenario, so that a slow moment of a shared machine does not fall on one
    // binary's rows only.
    for pgleader in &pgleaders {
        rows.extend(scenarios::kill9(*pgleader, plan.runs));
    }
    rows.extend(scenarios::breakdown(
        &pgleader.with_extra(&["-v"]),
        plan.runs,
    ));
    for pgleader in &pgleaders {
        rows.extend(scenarios::sigterm(*pgleader, plan.runs, false));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::step_down(*pgleader, plan.runs));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::frozen(*pgleader, plan.lease_runs));
    }
    for pgleader in &pgleaders {
        rows.extend(scenarios::start(*pgleader, plan.runs));
    }
    sort_by_scenario(&mut rows);
    let mut costs = Vec::new();
    for pgleader in &pgleaders {
        eprintln!("bench: 6. cost of an idle candidate ({})", pgleader.label());
        match pgleader.cost(plan.cost_window) {
            Ok(figures) => costs.extend(figures),
            Err(err) => eprintln!("bench:   failed: {err:#}"),
        }
    }
    let report = Report {
        quick: plan.quick,
        only: Some(report::ONLY_FAILOVER),
        started,
        took: began.elapsed(),
        environment: environment_on_postgres(&pgleader, plan),
        settings: settings(plan),
        rows,
        costs,
        scales: Vec::new(),
        timers: Vec::new(),
        fleets: Vec::new(),
        crontab: None,
    };
    report
        .write(&plan.out)
        .with_context(|| format!("cannot write {}", plan.out.display()))?;
    Ok(report)
}

/// Scenarios 11 to 13 (issue 28): a sharded fleet's failover and balance for K = 16 and 64,
/// what a replica costs, and the same fleet as K plain processes per replica. `pgleaders`:
/// cargo's build first, then the other builds, whose rows of 11 and 12 follow its rows, K by K;
/// 13 compares `--shards` with plain processes, with cargo's build only.
fn shard_scenarios(
    pgleaders: &[&Pgleader],
    plan: &Plan,
) -> (Vec<figures::Row>, Vec<figures::Cost>, Vec<figures::Fleet>) {
    let mut rows = Vec::new();
    let postgres: Vec<shards::Launcher> = pgleaders
        .iter()
        .map(|pgleader| shards::Launcher::postgres(pgleader))
        .collect();
    for k in [16, 64] {
        for launcher in &postgres {
            rows.extend(shards::kill9_and_join(launcher, k, plan.runs));
        }
    }
    // On one Redis server, where a dead replica is found by its watcher's question every
    // --check-interval (200 ms here, as in the Redis rows).
    match redis_lock::Server::start().and_then(|server| {
        // Past pgleader's restart fence, as in the Redis rows, for every build alike.
        server.wait_until_up(Duration::from_secs(10))?;
        Ok(Arc::new(server))
    }) {
        Ok(server) => {
            for pgleader in plan.pgleaders_on_redis(&server) {
                rows.extend(shards::kill9_and_join(
                    &pgleader.shard_launcher(),
                    16,
                    plan.runs,
                ));
            }
        }
        Err(err) => eprintln!("bench: no Redis server for the shards on Redis: {err:#}"),
    }
    let costs = shards::costs(pgleaders, &[16, 64], plan.cost_window);
    let fleets = pgleaders
        .first()
        .map(|pgleader| shards::by_hand(pgleader, 16))
        .unwrap_or_default();
    (rows, costs, fleets)
}

/// The shards' scenarios alone, against a server of their own.
fn run_shards_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let pgleader = pgleader_on_own_server("bench-shards")?;
    let others = plan.other_pgleaders(&pgleader.cluster);
    let mut pgleaders = vec![&pgleader];
    pgleaders.extend(&others);
    let (mut rows, costs, fleets) = shard_scenarios(&pgleaders, plan);
    sort_by_scenario(&mut rows);
    let report = Report {
        only: Some(report::ONLY_SHARDS),
        took: began.elapsed(),
        environment: environment_on_postgres(&pgleader, plan),
        rows,
        costs,
        fleets,
        ..partial_report(plan, started)
    };
    written(report, plan)
}

impl Plan {
    /// How much of the crontab's scenario 14 to run.
    fn cron(&self) -> cron::Plan {
        cron::Plan {
            window: Duration::from_secs(if self.quick { 10 } else { 60 }),
            kills: if self.quick { 5 } else { 20 },
            cost_window: Duration::from_secs(if self.quick { 3 } else { 10 }),
            builds: std::iter::once(cron::Build {
                binary: PathBuf::from(env!("CARGO_BIN_EXE_pgleader")),
                previous: false,
            })
            .chain(self.previous_binary.clone().map(|binary| cron::Build {
                binary,
                previous: true,
            }))
            .collect(),
            scale_runs: if self.quick { 2 } else { 5 },
            scale_window: Duration::from_secs(if self.quick { 10 } else { 30 }),
            scale_bursts: if self.quick { 2 } else { 3 },
        }
    }
}

/// The crontab's scenarios alone (`--only cron`), against a server of their own.
fn run_cron_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    yacron::ensure_installed()?;
    // Up long enough for pgleader's restart fence by the time its fleet starts, after the
    // costs on PostgreSQL.
    eprintln!("bench: starting Redis");
    let redis = redis_lock::Server::start()?;
    let pgleader = pgleader_on_own_server("bench-cron")?;
    let (mut rows, crontab) = cron::scenarios(&pgleader, Some(&redis), &plan.cron());
    sort_by_scenario(&mut rows);
    let mut environment = environment_on_postgres(&pgleader, plan);
    environment.push(("Redis", redis.version()));
    let report = Report {
        only: Some(report::ONLY_CRON),
        took: began.elapsed(),
        environment,
        rows,
        crontab: Some(crontab),
        ..partial_report(plan, started)
    };
    written(report, plan)
}

/// Scenario 14f alone (`--only scale`), against servers of its own.
fn run_scale_only(plan: &Plan) -> anyhow::Result<Report> {
    let began = Instant::now();
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    eprintln!("bench: starting Redis");
    let redis = redis_lock::Server::start()?;
    let pgleader = pgleader_on_own_server("bench-scale")?;
    let mut rows = cron::scale_scenarios(&pgleader, Some(&redis), &plan.cron());
    sort_by_scenario(&mut rows);
    let mut environment = environment_on_postgres(&pgleader, plan);
    environment.push(("Redis", redis.version()));
    let report = Report {
        only: Some(report::ONLY_SCALE),
        took: began.elapsed(),
        environment,
        rows,
        ..partial_report(plan, started)
    };
    written(report, plan)
}

/// The benchmark's PostgreSQL, durable as users run it (fsync and synchronous commits on): a
/// new leader's fencing token waits for a WAL flush, which is part of every takeover.
fn bench_cluster(name: &str) -> Arc<Cluster> {
    Arc::new(Cluster::with_options(
        name,
        harness::cluster::Options {
            durable: true,
            ..Default::default()
        },
    ))
}

/// An idle leader and follower with `--http` on and nobody asking.
fn http_cost(pgleader: &Pgleader, plan: &Plan) -> Vec<figures::Cost> {
    eprintln!("bench: 6. cost of an idle candidate (pgleader, --http on, not scraped)");
    pgleader
        .cost_with(
            plan.cost_window,
            &[http::HTTP],
            ["leader, --http", "follower, --http"],
        )
        .unwrap_or_else(|err| {
            eprintln!("bench:   failed: {err:#}");
            Vec::new()
        })
}

/// Scenario by scenario (by number: 2 before 10), pgleader first: the rows were produced tool
/// by tool, and the sort keeps their order within a scenario.
fn sort_by_scenario(rows: &mut [figures::Row]) {
    rows.sort_by_key(|row| {
        let id = row.scenario.split('.').next().unwrap_or_default();
        let digits = id.find(|c: char| !c.is_ascii_digit()).unwrap_or(id.len());
        (
            id[..digits].parse::<u32>().unwrap_or(u32::MAX),
            id[digits..].to_owned(),
        )
    });
}

/// A file's size in bytes, with MB beside it.
fn size(path: &Path) -> String {
    match std::fs::metadata(path) {
        Ok(meta) => format!(
            "{} bytes ({:.1} MB)",
            meta.len(),
            meta.len() as f64 / 1_000_000.0
        ),
        Err(err) => format!("unknown ({err})"),
    }
}

/// The size of `binary` once stripped of its symbols (a copy is stripped), if strip can run.
fn stripped_size(binary: &Path) -> Option<String> {
    let copy = std::env::temp_dir().join(format!("pgleader-bench-strip-{}", std::process::id()));
    let stripped = Command::new("strip")
        .arg("-o")
        .arg(&copy)
        .arg(binary)
        .status()
        .is_ok_and(|status| status.success());
    let size = stripped.then(|| size(&copy));
    let _ = std::fs::remove_file(&copy);
    size
}

/// The binaries' sizes, and with `--static` those of the other release artifacts beside it.
fn sizes(static_binary: Option<&Path>) -> Vec<(&'static str, String)> {
    let dynamic = Path::new(env!("CARGO_BIN_EXE_pgleader"));
    let mut sizes = vec![(
        "size, dynamic binary",
        format!(
            "{} as cargo builds it (release profile, with symbols){}",
            size(dynamic),
            stripped_size(dynamic)
                .map(|stripped| format!("; {stripped} stripped"))
                .unwrap_or_default()
        ),
    )];
    let Some(binary) = static_binary else {
        return sizes;
    };
    sizes.push((
        "size, static binary",
        format!("{} (stripped, as released)", size(binary)),
    ));
    let dist = binary.parent().unwrap_or(Path::new("."));
    let version = env!("CARGO_PKG_VERSION");
    for (label, name) in [
        (
            "size, tarball",
            format!("pgleader-{version}-x86_64-linux.tar.gz"),
        ),
        ("size, .deb", format!("pgleader_{version}-1_amd64.deb")),
        (
            "size, image",
            format!("pgleader-{version}-image.tar (one layer: the binary and the CA bundle)"),
        ),
    ] {
        let file = name.split(' ').next().unwrap_or_default();
        sizes.push((label, format!("{} {}", size(&dist.join(file)), name)));
    }
    sizes
}

fn environment(
    pgleader: &Pgleader,
    etcd: Option<&Etcd>,
    redis: Option<&redis_lock::Server>,
    static_binary: Option<&Path>,
    previous_binary: Option<&Path>,
) -> Vec<(&'static str, String)> {
    let mut environment = environment_of_machine();
    environment.push((
        "PostgreSQL",
        pgleader
            .server_version()
            .unwrap_or_else(|err| format!("unknown ({err})")),
    ));
    environment.push((
        "PostgreSQL durability",
        pgleader
            .durability()
            .unwrap_or_else(|err| format!("unknown ({err})")),
    ));
    environment.extend(previous_environment(previous_binary));
    if let Some(etcd) = etcd {
        let etcdctl = first_line(
            Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .arg("version"),
        );
        environment.push(("etcd", format!("{} ({etcdctl})", etcd.version)));
    }
    if let Some(redis) = redis {
        environment.extend(redis_environment(redis));
        environment.extend(redlock_environment());
    }
    environment.extend(sizes(static_binary));
    environment
}

/// The environment of a run on PostgreSQL alone, with the other builds (`--static`,
/// `--previous`) if given.
fn environment_on_postgres(pgleader: &Pgleader, plan: &Plan) -> Vec<(&'static str, String)> {
    environment(
        pgleader,
        None,
        None,
        plan.static_binary.as_deref(),
        plan.previous_binary.as_deref(),
    )
}

/// The previous build measured beside cargo's, if any.
fn previous_environment(previous: Option<&Path>) -> Option<(&'static str, String)> {
    previous.map(|previous| {
        (
            "previous build",
            format!("{} ({})", previous.display(), size(previous)),
        )
    })
}

/// The Redis server's and the peer's versions.
fn redis_environment(redis: &redis_lock::Server) -> Vec<(&'static str, String)> {
    vec![
        ("Redis", redis.version()),
        (
            "redis-py",
            format!(
                "{} (pip, into the target directory), {}",
                redis_lock::REDIS_PY_VERSION,
                RedisPy::python_version()
            ),
        ),
    ]
}

/// The Redlock peer's versions.
fn redlock_environment() -> Vec<(&'static str, String)> {
    vec![(
        "npm redlock",
        format!(
            "{} with ioredis {} (npm, into the target directory), Node.js {}",
            redlock::REDLOCK_VERSION,
            redlock::IOREDIS_VERSION,
            redlock::node_version()
        ),
    )]
}

/// The machine and pgleader's build.
fn environment_of_machine() -> Vec<(&'static str, String)> {
    let machine = procfs::Machine::read();
    let commit = Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "describe",
            "--always",
            "--dirty",
        ])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map_or_else(
            || "unknown".into(),
            |out| String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        );
    vec![
        ("CPU", machine.cpu),
        ("cores", machine.cores.to_string()),
        ("memory", machine.memory),
        ("kernel", format!("Linux {}", machine.kernel)),
        ("OS", machine.os),
        (
            "pgleader",
            format!("{} at {commit}, release build", env!("CARGO_PKG_VERSION")),
        ),
    ]
}

fn settings(plan: &Plan) -> Vec<(&'static str, String)> {
    vec![
        (
            "mode",
            format!(
                "{}: {} runs per scenario ({} for the partition, the failovers at scale and the peers' scenarios bound by their TTL, and pgleader's with two quorum servers frozen; {} where a peer is expected never to act; {} of pgleader's with two quorum servers killed, each waiting a lease for them to vote again); cost windows of {}; server CPU at scale over {}",
                if plan.quick { "quick" } else { "full" },
                plan.runs,
                plan.lease_runs,
                plan.never_runs,
                plan.restart_runs,
                figures::secs(plan.cost_window),
                figures::secs(plan.scale_window),
            ),
        ),
        (
            "pgleader",
            format!(
                "its defaults (--check-interval 1s, --check-timeout 2s, --kill-timeout 5s, --lease 10s, --restart-fence auto, which a server up for 10 s before the first run does not trigger), except the partitioned leader of scenario 4: {}",
                PARTITION_ARGS.join(" ")
            ),
        ),
        (
            "etcdctl lock",
            format!(
                "--ttl {} (etcdctl's default is 10), ETCDCTL_API=3, its defaults otherwise",
                etcd::TTL_SECONDS
            ),
        ),
        (
            "pgleader on Redis",
            format!(
                "`-d redis://127.0.0.1:PORT --lock-id N {}`, its defaults otherwise (--check-timeout 2s, --kill-timeout 5s, --lease 10s, which is the key's TTL, --restart-fence auto, which a server up for 10 s before the first run does not trigger); the idle cost also with the default --check-interval (1s)",
                redis_lock::CHECK_INTERVAL.replace('=', " ")
            ),
        ),
        (
            "redis-py Lock",
            format!(
                "redis-py {}'s `Lock(timeout={} s, sleep=0.1 s (its default), thread_local=False)` in the benchmark's leader loop (benches/failover/redis_py_leader.py): a blocking acquire, then `Lock.extend` every TTL/3; it sends SIGTERM to its command when an extension fails, and on SIGTERM stops its command and releases the key; nothing acts after a kill -9",
                redis_lock::REDIS_PY_VERSION,
                redis_lock::PEER_TTL_SECONDS
            ),
        ),
        (
            "Redis server",
            "redis-server of the benchmark's own on 127.0.0.1 (a free port), --save '' --appendonly no, its defaults otherwise; up for 10 s before its first run".into(),
        ),
    ]
    .into_iter()
    .chain(redlock::settings())
    .chain([
        (
            "the child",
            "`sh -c`: prints a line when it starts and another when it gets TERM, then exits at once; otherwise waits".into(),
        ),
        (
            "PostgreSQL server",
            "the test harness's throwaway cluster on 127.0.0.1, durable as users run it (fsync, synchronous_commit and full_page_writes at their default, on: a new leader's fencing token waits for a WAL flush), shared_buffers=32MB, max_connections=300; log_statement=all only during the cost window".into(),
        ),
        (
            "etcd server",
            format!(
                "single node on 127.0.0.1, default heartbeat (100 ms) and election timeout (1000 ms), {}",
                etcd::data_dir_note()
            ),
        ),
        (
            "crontab (14)",
            format!(
                "`pgleader cron --lock-id N FILE` with its defaults on PostgreSQL; on Redis `-d redis://127.0.0.1:PORT --lock-id N {} FILE`, as in the Redis rows (the benchmark's server, up for 10 s before its first replica), its defaults otherwise; FILE: `SHELL=/bin/bash` and {} jobs `j1`..`j{}`, each a `# pgleader: name=jN` line above `* * * * * * * echo c $PGLEADER_JOB $PGLEADER_SCHEDULED_TIME $EPOCHREALTIME` (at rest: `0 0 0 1 1 * *`); the plain processes: `pgleader run --lock-id N --schedule '* * * * * *'` (at rest `0 0 0 1 1 *`) `-- sh -c 'echo ...'`; yacron {}: one YAML file of the same jobs, every minute (`* * * * *`, its finest: it wakes once a minute), shell /bin/bash, RSS read 10 s after its start; statements counted in the server log (log_statement = all) from the processes' sessions; on Redis, the commands their connections sent, seen by MONITOR; the floor: the benchmark's binary re-invoked as {} spawners (`{} INDEX JOBS`), each sleeping until every whole second of the wall clock and then starting its {} or {} jobs' `bash -c 'echo c $PGLEADER_JOB $PGLEADER_SCHEDULED_TIME $EPOCHREALTIME'` with std::process::Command, over the fleets' window, before them, with no database and no keeper; 14c: the same fleets and floor with {} jobs, lateness only; 14f's burst: 1,000 jobs `*/10 * * * * * *` on 3 replicas at rest, 3 bursts (2 quick), RSS of each replica and its children from `/proc/PID/task/*/children` and each one's statm every 100 ms against one read halfway between bursts, and its floor: the same spawners with a period (`{} INDEX 1000 10`); with ping=: PostgreSQL's fleet with `PGLEADER_PING=http://127.0.0.1:PORT/ping/{{job}}`, a monitor of the benchmark's own (a thread per connection answering 200) receiving each run's start and success",
                redis_lock::CHECK_INTERVAL.replace('=', " "),
                cron::JOBS,
                cron::JOBS,
                yacron::VERSION,
                cron::REPLICAS,
                cron::SPAWNER_ARG,
                cron::JOBS / cron::REPLICAS,
                cron::JOBS.div_ceil(cron::REPLICAS),
                cron::LIGHT_JOBS,
                cron::SPAWNER_ARG,
            ),
        ),
        (
            "timing",
            "from just before the fault (kill(2), the pg_terminate_backend query or lease-revoke request on an open connection, the proxy freezing) to the moment a reader thread of the benchmark got the child's line from its pipe (Instant, monotonic); start: from just before spawning the tool; for the tools that poll (pgleader on Redis, redis-py's Lock, npm redlock) the fault comes after a random pause within the longest period they poll or renew on (200 ms; 1 s; 2.5 s), so that the fixed pauses of the benchmark do not pick the fault's phase".into(),
        ),
        ("CPU time", procfs::cpu_time_source().into()),
        (
            "old child stopped",
            "the old leader's child had exited within 1 s after the handoff (or after the handoff bound)".into(),
        ),
        (
            "faults at the server",
            "pgleader: pg_terminate_backend(leader's backend); etcd: revoking the leader's lease over the JSON gateway (etcd's way to end a client's session); Redis: DEL of the lock's key on an open connection (scenario 3b)".into(),
        ),
        (
            "partition",
            "a user-space TCP proxy between the leader and its server stops forwarding both ways (no RST, no FIN); the follower connects directly".into(),
        ),
        (
            "frozen",
            "SIGSTOP of the leading tool's own pid (not its child's, nor pgleader's keeper's), with the leader connected through an idle proxy so that it gets the partition's timings; SIGCONT once the run is observed".into(),
        ),
    ])
    .collect()
}
