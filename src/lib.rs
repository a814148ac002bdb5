//! pgleader runs a command on exactly one replica of a service: the one whose session holds
//! the lock, a PostgreSQL advisory lock or a Redis key (on one server, or a Redlock quorum).
//! It stops the command the moment that replica is no longer the leader, and goes back into
//! the election. `pgleader run` runs it as a service, once (`--once`), on a schedule
//! (`--schedule`), or once per shard with every replica running its share (`--shards`);
//! `pgleader cron` shares a crontab's jobs out among the replicas; `status` and `step-down`
//! ask a running fleet.
//!
//! The binary (`main.rs`) parses the command line and calls [`execute`]; the modules below
//! each own one concern, on floors that import only downwards:
//!
//! - [`time`], [`exit`], [`cli`], [`environment`], [`percent`]: leaves;
//! - [`election`]: the boundary every backend implements (traits, the lock's key, the lease
//!   rule, backoff, participants, the ledger's contract);
//! - [`schedule`]: cron on the server's clock, catch-up, agreement, the crontab's reader (no
//!   backend types);
//! - [`postgres`], [`redis`]: the backends, siblings that never import each other;
//! - [`operate`]: logs, notify, telemetry, metrics, HTTP, `status` (and `--watch`), `step-down`,
//!   `cron --check`, docs;
//! - [`supervise`]: the single leader's state machine and duty, the shard room (`--shards`,
//!   `pgleader cron`), the stop machine, the job and its keeper, hooks, the health probe,
//!   signals;
//! - [`config`]: validated settings, and which backend they name; then this file.
//!
//! DESIGN.md in the repository's shared notes lists the invariants the code keeps and the tests
//! that prove them.

pub mod cli;
pub mod config;
pub mod election;
pub mod environment;
pub mod exit;
pub mod operate;
pub mod percent;
pub mod postgres;
pub mod redis;
pub mod schedule;
pub mod supervise;
pub mod time;

use anyhow::Context;
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use crate::cli::{Command, CronAction, CronArgs, CronRunArgs, RunArgs, StatusArgs, StepDownArgs};
use crate::config::{Database, Elector, RunConfig, UsageError, Work};
use crate::election::lock::LockKey;
use crate::election::shards::JoinError;
use crate::election::{Backend, ConnectError};
use crate::environment::ProcessEnvironment;
use crate::operate::step_down::Refused;
use crate::operate::telemetry::{self, Telemetry};
use crate::operate::{crontab_check, http, notify, status, watch};
use crate::postgres::PgBackend;
use crate::redis::RedisBackend;
use crate::redis::quorum::QuorumBackend;
use crate::schedule::crontab::Crontab;
use crate::supervise::keeper::handle::{CommandError, CommandLine};
use crate::supervise::sharded::Fleet;
use crate::supervise::signals::SignalEvent;
use crate::supervise::{file_watch, sharded, signals, supervisor};

/// Runs a subcommand to its end and returns the exit code. Must run inside a tokio runtime
/// whose thread lives as long as the process.
pub async fn execute(command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Run(args) => run(*args).await,
        Command::Status(args) => status(args).await,
        Command::StepDown(args) => step_down(args).await,
        Command::Cron(args) => cron(*args).await,
    }
}

/// `pgleader cron`: `--check` reads the crontab and says what it would run; otherwise this
/// replica runs its share of the crontab's jobs.
async fn cron(mut args: CronArgs) -> anyhow::Result<u8> {
    if let Some(action) = args.action.take() {
        return cron_action(action).await;
    }
    let path = args.crontab.clone().context("no crontab given")?;
    let crontab = Crontab::read(&path).map_err(|err| UsageError(err.to_string()))?;
    if !args.check {
        // Listen first: from here on TERM and INT are pgleader's to handle.
        let (events, signals) = signals::listen().context("cannot listen for signals")?;
        if args.inotify {
            file_watch::spawn(path, events)
                .context("cannot watch the crontab for changes (--inotify)")?;
        }
        // What the file may not mean to its author is said at start too, not only by --check.
        let notes = crontab.warnings(jiff::Timestamp::now());
        let (config, mut warnings) = RunConfig::for_cron(args, crontab, &ProcessEnvironment)?;
        warnings.extend(notes);
        let code = supervise(config, warnings, signals).await;
        // A drained run's end, still queued for its monitor, is sent before the replica goes.
        operate::pings::drain(operate::pings::DRAIN).await;
        return code;
    }
    let from = match &args.from {
        Some(text) => text.parse::<jiff::Timestamp>().map_err(|err| {
            UsageError(format!(
                "--from {text:?}: {err} (expected an RFC 3339 instant such as 2027-03-27T12:00:00Z)"
            ))
        })?,
        None => jiff::Timestamp::now(),
    };
    print!("{}", crontab_check::report(&crontab, from, args.next));
    Ok(exit::SUCCESS)
}

async fn run(args: RunArgs) -> anyhow::Result<u8> {
    // Listen first: from here on TERM and INT are pgleader's to handle.
    let (_, signals) = signals::listen().context("cannot listen for signals")?;
    let (config, warnings) = RunConfig::from_args(args, &ProcessEnvironment)?;
    supervise(config, warnings, signals).await
}

/// Runs a replica as `config` says: the single leader's supervisor, or the sharded room (for
/// shards or a crontab's jobs).
async fn supervise(
    config: RunConfig,
    warnings: Vec<String>,
    signals: UnboundedReceiver<SignalEvent>,
) -> anyhow::Result<u8> {
    for warning in warnings {
        warn!(event = "config", "{warning}");
    }
    let settings = &config.supervision;
    let telemetry = Telemetry::new(telemetry::Settings {
        lock: settings.lock.clone(),
        connection: config.backend.to_string(),
        check_deadline: settings.check_interval + settings.check_timeout,
        schedule: settings.schedule.as_ref().map(|plan| plan.schedule.clone()),
        shards: settings.shards.map(|sharding| sharding.count),
        health_check: settings.health.is_some(),
        crontab: matches!(config.work, Work::Crontab(..)),
    });
    // Checked before the election: a system that refuses the keepers' shared deadline (no
    // memfd) stops pgleader before it can win, rather than at every win.
    crate::supervise::watchdog::probe()
        .context("cannot share a deadline with the keepers (memfd_create and mmap)")?;
    // Bound before the election: a port that is taken stops pgleader before it can win.
    if let Some(address) = config.http {
        http::spawn(http::bind(address).await?, telemetry.clone());
    }
    notify::init();
    let shards = config.supervision.shards;
    let settings = config.supervision;
    let role = match (config.work, shards) {
        (Work::Crontab(crontab, options), _) => Role::Fleet(Fleet::Crontab(crontab, options)),
        (Work::Command(command), Some(sharding)) => Role::Fleet(Fleet::Shards(sharding, command)),
        (Work::Command(command), None) => Role::Leader(command),
    };
    let outcome = match (config.backend, role) {
        (Elector::Postgres(backend), Role::Leader(command)) => {
            supervisor::run(backend, settings, command, signals, telemetry).await?
        }
        (Elector::Postgres(backend), Role::Fleet(fleet)) => {
            sharded::run(backend, settings, fleet, signals, telemetry).await?
        }
        (Elector::Redis(backend), Role::Leader(command)) => {
            supervisor::run(backend, settings, command, signals, telemetry).await?
        }
        (Elector::Redis(backend), Role::Fleet(fleet)) => {
            sharded::run(backend, settings, fleet, signals, telemetry).await?
        }
        (Elector::Quorum(backend), Role::Leader(command)) => {
            supervisor::run(backend, settings, command, signals, telemetry).await?
        }
        // Refused while the configuration was read.
        (Elector::Quorum(_), Role::Fleet(_)) => {
            anyhow::bail!("a sharded lock or a crontab cannot run on a Redlock quorum")
        }
    };
    Ok(outcome.exit_code())
}

/// What a replica is: the single leader's candidate for its command, or one of a fleet's
/// replicas sharing items out.
enum Role {
    Leader(CommandLine),
    Fleet(Fleet),
}

/// `pgleader cron run`: a job run once, now, by hand.
async fn cron_run(args: CronRunArgs) -> anyhow::Result<u8> {
    let lock = config::lock_key(&args.lock, &ProcessEnvironment)?;
    check_job_name(&args.job, "")?;
    let (job, wait) = (args.job.as_str(), !args.no_wait);
    let database = config::database(&args.connection, &ProcessEnvironment)?;
    config::no_ledger_table_on_redis(&args.ledger, &database)?;
    match database {
        Database::Postgres(connection) => {
            let backend = postgres_to_read(connection, &lock, &args.ledger)?;
            operate::run_now::run_now(&lock, &backend, job, wait).await
        }
        Database::Redis(server) => {
            let backend = RedisBackend::for_status(server, lock.clone());
            operate::run_now::run_now(&lock, &backend, job, wait).await
        }
        Database::Quorum(_) => Err(UsageError(
            "a crontab cannot run on a Redlock quorum, so none of its jobs can be run there"
                .to_owned(),
        )
        .into()),
    }
}

/// `pgleader cron run|pause|resume`: a run asked by hand, a fleet's pause.
async fn cron_action(action: CronAction) -> anyhow::Result<u8> {
    let (args, pause) = match action {
        CronAction::Run(args) => return cron_run(args).await,
        CronAction::Pause(args) => (args, true),
        CronAction::Resume(args) => (args, false),
    };
    let lock = config::lock_key(&args.lock, &ProcessEnvironment)?;
    let job = args.job.as_deref().filter(|_| !args.all);
    if let Some(job) = job {
        check_job_name(job, "")?;
    }
    let database = config::database(&args.connection, &ProcessEnvironment)?;
    config::no_ledger_table_on_redis(&args.ledger, &database)?;
    match database {
        Database::Postgres(connection) => {
            let backend = postgres_to_read(connection, &lock, &args.ledger)?;
            operate::pause::pause_or_resume(&lock, &backend, job, pause).await
        }
        Database::Redis(server) => {
            let backend = RedisBackend::for_status(server, lock.clone());
            operate::pause::pause_or_resume(&lock, &backend, job, pause).await
        }
        Database::Quorum(_) => Err(UsageError(
            "a crontab cannot run on a Redlock quorum, so none of its jobs can be paused there"
                .to_owned(),
        )
        .into()),
    }
}

/// A job name given on the command line (`what` says where), or a usage error.
fn check_job_name(job: &str, what: &str) -> Result<(), UsageError> {
    crate::schedule::crontab::job_name(job)
        .map(|_| ())
        .map_err(|_| {
            UsageError(format!(
                "{what}{job:?}: a job name is 1 to 64 letters, digits, '-', '_' or '.'"
            ))
        })
}

/// The PostgreSQL backend of a command that reads (and asks) rather than leads: status,
/// step-down, pause; the connection's warnings said first.
fn postgres_to_read(
    connection: config::Connection,
    lock: &LockKey,
    ledger: &cli::LedgerArgs,
) -> anyhow::Result<PgBackend> {
    for warning in connection.warnings {
        warn!(event = "config", "{warning}");
    }
    let table = config::ledger_table(ledger)?;
    Ok(PgBackend::for_status(
        connection.settings,
        lock.clone(),
        table,
    ))
}

async fn status(args: StatusArgs) -> anyhow::Result<u8> {
    let lock = config::lock_key(&args.lock, &ProcessEnvironment)?;
    if let Some(job) = &args.job {
        check_job_name(job, "--job ")?;
    }
    let database = config::database(&args.connection, &ProcessEnvironment)?;
    config::no_ledger_table_on_redis(&args.ledger, &database)?;
    match database {
        Database::Postgres(connection) => {
            let backend = postgres_to_read(connection, &lock, &args.ledger)?;
            show_status(&lock, &backend, &args).await
        }
        Database::Redis(server) => {
            let backend = RedisBackend::for_status(server, lock.clone());
            show_status(&lock, &backend, &args).await
        }
        Database::Quorum(servers) => {
            let backend = QuorumBackend::for_status(servers, lock.clone());
            show_status(&lock, &backend, &args).await
        }
    }
}

async fn step_down(args: StepDownArgs) -> anyhow::Result<u8> {
    if let Some(to) = &args.to {
        return Err(UsageError(format!(
            "--to {to}: a step-down cannot pick the next leader. The server grants a released \
             lock to whichever replica waits first, and steering it to one replica would mean \
             stopping the others from waiting; pgleader does not do that at the risk of ever \
             running the command twice. Step down without --to, or stop the replicas that are \
             not to lead"
        ))
        .into());
    }
    let lock = config::lock_key(&args.lock, &ProcessEnvironment)?;
    let database = config::database(&args.connection, &ProcessEnvironment)?;
    let timeout = args.timeout;
    match database {
        Database::Postgres(connection) => {
            let no_ledger = cli::LedgerArgs { ledger_table: None };
            let backend = postgres_to_read(connection, &lock, &no_ledger)?;
            operate::step_down::step_down(&lock, &backend, timeout).await
        }
        Database::Redis(server) => {
            let backend = RedisBackend::for_status(server, lock.clone());
            operate::step_down::step_down(&lock, &backend, timeout).await
        }
        Database::Quorum(_) => Err(UsageError(
            "step-down is not available on a Redlock quorum: its leader does not listen for \
             requests. Stop the leader (TERM) instead: its command is stopped and the lock \
             released for the next replica"
                .to_owned(),
        )
        .into()),
    }
}

/// `status` or `status --watch` through one backend.
async fn show_status<B: Backend>(
    lock: &LockKey,
    backend: &B,
    args: &StatusArgs,
) -> anyhow::Result<u8> {
    if args.watch {
        return watch::watch(lock, backend, args.json).await;
    }
    let observer = backend
        .observe()
        .await
        .with_context(|| format!("cannot connect to {backend}"))?;
    if let Some(job) = &args.job {
        let runs = status::JobRuns::read(lock, job, &observer).await?;
        let text = if args.json {
            format!("{}\n", runs.to_json())
        } else {
            runs.to_text()
        };
        let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
        // No run recorded: nothing there, as for a free lock.
        return Ok(if runs.runs.is_empty() && runs.asked.is_empty() {
            exit::LOCK_FREE
        } else {
            exit::SUCCESS
        });
    }
    let status = status::read(lock, &observer).await?;
    let text = if args.json {
        format!("{}\n", status.to_json())
    } else {
        status.to_text()
    };
    // A reader that went away (`| head`) is no reason to panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(if status.is_held() {
        exit::SUCCESS
    } else {
        exit::LOCK_FREE
    })
}

/// The exit code for an error: 2 for usage errors, 126/127 for a command that cannot run,
/// 1 for everything else.
pub fn exit_code_of(err: &anyhow::Error) -> u8 {
    if err.downcast_ref::<UsageError>().is_some()
        || err.downcast_ref::<Refused>().is_some()
        || matches!(
            err.downcast_ref::<JoinError>(),
            Some(JoinError::Mismatch(_))
        )
        || matches!(
            err.downcast_ref::<ConnectError>(),
            Some(ConnectError::Conflict(_))
        )
    {
        exit::USAGE
    } else if let Some(err) = err.downcast_ref::<CommandError>() {
        err.exit_code()
    } else {
        exit::FAILURE
    }
}
