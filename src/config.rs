//! The validated settings of `pgleader run` and `pgleader status`, built from the command line
//! and the environment. Everything that can be refused is refused here, before any connection
//! is made: a bad value is a usage error (exit 2), a command that cannot run is 126 or 127.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;

use crate::cli::{ConnectionArgs, CronArgs, LedgerArgs, LockArgs, RestartFence, RunArgs};
use crate::election::lease::{Lease, StopTimings};
use crate::election::lock::LockKey;
use crate::election::majority::Majority;
use crate::election::participant;
use crate::environment::Environment;
use crate::postgres::PgBackend;
use crate::postgres::conninfo::{self, ConnSettings};
use crate::postgres::ledger::TableName;
use crate::redis::RedisBackend;
use crate::redis::quorum::QuorumBackend;
use crate::redis::url::{RedisServer, is_redis_url};
use crate::schedule::Plan;
use crate::schedule::calendar::Schedule;
use crate::schedule::crontab::Crontab;
use crate::supervise::health::HealthCheck;
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::handle::CommandLine;
use crate::supervise::keeper::protocol::Output;
use crate::supervise::{Settings, Sharding};

/// A usage error: the message says what is wrong; pgleader exits with 2.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Everything `pgleader run` needs: the backend it elects through, what the supervisor does,
/// and where the HTTP endpoint listens.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub backend: Elector,
    pub supervision: Settings,
    /// Where to serve /leader, /healthz, /status and /metrics, if anywhere.
    pub http: Option<SocketAddr>,
    /// What runs: the command, or a crontab's jobs.
    pub work: Work,
}

/// What a replica runs.
#[derive(Debug, Clone)]
pub enum Work {
    /// `pgleader run`: the command, once across the fleet, or once per shard (`--shards`).
    Command(CommandLine),
    /// `pgleader cron`: the crontab whose jobs the fleet shares out, each job its own command;
    /// and how the replica runs it.
    Crontab(Crontab, CronOptions),
}

/// How a replica of `pgleader cron` runs its crontab, beyond what the file says.
#[derive(Debug, Clone, Copy, Default)]
pub struct CronOptions {
    /// How long a TERM's drain may last (`--drain-timeout`); none by default.
    pub drain_timeout: Option<Duration>,
    /// Where the jobs' output goes: log lines naming the job, or as it is
    /// (`--passthrough-logs`).
    pub output: Output,
}

/// The backend a URL's scheme chose, configured. `lib.rs` matches it once and runs the
/// supervisor (generic over the backend) in each arm.
#[derive(Debug, Clone)]
pub enum Elector {
    Postgres(PgBackend),
    Redis(RedisBackend),
    Quorum(QuorumBackend),
}

impl std::fmt::Display for Elector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Elector::Postgres(backend) => backend.fmt(f),
            Elector::Redis(backend) => backend.fmt(f),
            Elector::Quorum(backend) => backend.fmt(f),
        }
    }
}

/// A resolved connection and the warnings its resolution produced.
#[derive(Debug)]
pub struct Connection {
    pub settings: ConnSettings,
    pub warnings: Vec<String>,
}

/// The server a URL names: PostgreSQL (by default) or Redis (`redis://`, `rediss://`), or the
/// Redis servers of a quorum.
#[derive(Debug)]
pub enum Database {
    Postgres(Connection),
    Redis(RedisServer),
    Quorum(Vec<RedisServer>),
}

impl Database {
    /// How long one step of connecting may take.
    fn connect_timeout(&self) -> std::time::Duration {
        match self {
            Database::Postgres(connection) => connection.settings.connect_timeout,
            Database::Redis(server) => server.connect_timeout,
            Database::Quorum(servers) => servers
                .iter()
                .map(|server| server.connect_timeout)
                .max()
                .unwrap_or(REDIS_CONNECT_TIMEOUT),
        }
    }

    /// The name the user gave pgleader's sessions (PostgreSQL's `application_name`).
    fn application_name(&self) -> Option<&str> {
        match self {
            Database::Postgres(connection) => connection.settings.application_name.as_deref(),
            Database::Redis(_) | Database::Quorum(_) => None,
        }
    }
}

/// How long one step of connecting to Redis may take (TCP, TLS, the handshake).
pub const REDIS_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl RunConfig {
    /// Validates the arguments. The command is looked up last, so that a usage error is
    /// reported as one even when the command is also wrong.
    pub fn from_args(
        args: RunArgs,
        env: &dyn Environment,
    ) -> anyhow::Result<(RunConfig, Vec<String>)> {
        Self::build(args, env, None)
    }

    /// Validates `pgleader cron`'s arguments for `crontab`: what a replica of a fleet is
    /// given, as `run` takes it, and nothing that `cron` does not do yet.
    pub fn for_cron(
        args: CronArgs,
        crontab: Crontab,
        env: &dyn Environment,
    ) -> anyhow::Result<(RunConfig, Vec<String>)> {
        let options = CronOptions {
            drain_timeout: args.drain_timeout,
            output: if args.passthrough_logs {
                Output::Inherited
            } else {
                Output::Tagged {
                    keep: args.keep_output,
                }
            },
        };
        let run = RunArgs {
            replica: args.replica,
            once: false,
            no_wait: false,
            busy_exit_code: 0,
            restart_delay: std::time::Duration::ZERO,
            relinquish_after: None,
            relinquish_schedule: None,
            schedule: None,
            schedule_timezone: "UTC".into(),
            catch_up: std::time::Duration::ZERO,
            retry_interrupted: 0,
            shards: None,
            max_shards: None,
            // Each job's command is its own (`SHELL -c LINE`).
            command: Vec::new(),
        };
        let (config, warnings) = Self::build(run, env, Some((crontab, options)))?;
        if matches!(config.backend, Elector::Quorum(_)) {
            return Err(UsageError(
                "a crontab across the fleet cannot run on a Redlock quorum: each job's owner \
                 and each replica's end would have to be agreed by a majority of the servers, \
                 which is not built (as for --shards); use PostgreSQL or one Redis server, or \
                 one pgleader run --schedule per job on the quorum"
                    .into(),
            )
            .into());
        }
        Ok((config, warnings))
    }

    /// [`RunConfig::from_args`]; with a `crontab` its jobs run rather than a command, and a
    /// ledger is kept whether or not `--schedule` asks for one.
    fn build(
        args: RunArgs,
        env: &dyn Environment,
        crontab: Option<(Crontab, CronOptions)>,
    ) -> anyhow::Result<(RunConfig, Vec<String>)> {
        let lock = lock_key(&args.replica.lock, env)?;
        let database = database(&args.replica.connection, env)?;
        let lease = Lease::new(args.replica.lease);
        let hooks = Hooks {
            pre_start: args.replica.pre_start.clone(),
            post_stop: args.replica.post_stop.clone(),
            timeout: args.replica.hook_timeout,
        };
        let stop = StopTimings {
            check_interval: args.replica.check_interval,
            check_timeout: args.replica.check_timeout,
            kill_timeout: args.replica.kill_timeout,
            // Pre-start is stopped like the command; only post-stop runs after the kill timeout.
            hook_timeout: hooks.post_stop.is_some().then_some(hooks.timeout),
        };
        match &database {
            Database::Postgres(_) => lease.validate(&stop),
            Database::Redis(_) | Database::Quorum(_) => lease.validate_ttl(&stop),
        }
        .map_err(UsageError)?;
        no_ledger_table_on_redis(&args.replica.ledger, &database)?;
        let shards = sharding(&args, &database)?;
        let health = health_check(&args)?;
        let schedule = match &args.schedule {
            Some(expression) => Some(Plan {
                schedule: Schedule::parse(expression, &args.schedule_timezone)
                    .map_err(|err| UsageError(format!("--schedule: {err}")))?,
                catch_up: args.catch_up,
                retry_interrupted: args.retry_interrupted,
                once: args.once || args.no_wait,
                busy_retry: args.replica.check_timeout / 2,
                job: None,
                overlap: crate::schedule::crontab::Overlap::Skip,
                catch_up_new: true,
                jitter: Duration::ZERO,
            }),
            None => None,
        };
        // Without a schedule there is no ledger, and --ledger-table is not looked at.
        let table = match &schedule {
            Some(_) => ledger_table(&args.replica.ledger)?,
            None if crontab.is_some() => ledger_table(&args.replica.ledger)?,
            None => TableName::default(),
        };
        let work = match crontab {
            Some((crontab, options)) => Work::Crontab(crontab, options),
            None => Work::Command(CommandLine::resolve(
                args.command,
                env.var_os("PATH").as_deref(),
            )?),
        };
        let session_name = participant::label(
            database.application_name(),
            schedule
                .as_ref()
                .map(|plan| plan.schedule.fingerprint())
                .as_deref(),
        );
        let connect_timeout = database.connect_timeout();
        // A leader's ledger statements share its session with the checks: well under
        // --check-timeout, so that a check is never held up past its deadline.
        let ledger_statement_timeout = args.replica.check_timeout / 2;
        let supervision = Settings {
            session_name,
            once: args.once || args.no_wait,
            no_wait: args.no_wait,
            busy_exit_code: args.busy_exit_code,
            check_interval: args.replica.check_interval,
            check_timeout: args.replica.check_timeout,
            kill_signal: args.replica.kill_signal,
            kill_timeout: args.replica.kill_timeout,
            restart_delay: args.restart_delay,
            takeover_delay: args.replica.takeover_delay,
            relinquish_after: args.relinquish_after,
            relinquish_schedule: args.relinquish_schedule,
            schedule,
            connect_timeout,
            shards,
            health,
            restart_fence: match args.replica.restart_fence {
                RestartFence::Fixed(duration) => duration,
                RestartFence::Auto => stop.total() + crate::election::lease::MARGIN,
            },
            hooks,
            lock: lock.clone(),
        };
        let (backend, warnings) = match database {
            Database::Postgres(connection) => (
                Elector::Postgres(PgBackend::new(
                    connection.settings,
                    lock,
                    lease,
                    table,
                    ledger_statement_timeout,
                    args.replica.wait_refresh,
                )),
                connection.warnings,
            ),
            Database::Redis(server) => (
                Elector::Redis(RedisBackend {
                    server,
                    lock,
                    lease,
                    poll: args.replica.check_interval,
                    ledger_timeout: ledger_statement_timeout,
                    user_name: None,
                }),
                Vec::new(),
            ),
            Database::Quorum(servers) => {
                let warnings = if servers.len() % 2 == 0 {
                    vec![format!(
                        "a quorum of {} servers needs {} of them, as many as one of {} would: \
                         an even count adds a server without adding tolerance",
                        servers.len(),
                        Majority::of(servers.len()).need(),
                        servers.len() + 1
                    )]
                } else {
                    Vec::new()
                };
                (
                    Elector::Quorum(QuorumBackend {
                        servers,
                        lock,
                        lease,
                        poll: args.replica.check_interval,
                        ledger_timeout: ledger_statement_timeout,
                        user_name: None,
                    }),
                    warnings,
                )
            }
        };
        let config = RunConfig {
            backend,
            supervision,
            http: args.replica.http,
            work,
        };
        Ok((config, warnings))
    }
}

/// `--health-cmd` and its companions, or why they cannot be used with what else was asked for.
fn health_check(args: &RunArgs) -> Result<Option<HealthCheck>, UsageError> {
    let Some(command) = &args.replica.health_cmd else {
        return Ok(None);
    };
    if args.no_wait || (args.once && args.schedule.is_some()) {
        let what = if args.no_wait {
            "--no-wait"
        } else {
            "--schedule --once"
        };
        return Err(UsageError(format!(
            "--health-cmd cannot be used with {what}: it tries the lock once, with no probe \
             interval to wait through; gate it in the shell instead: CHECK && pgleader run ..."
        )));
    }
    Ok(Some(HealthCheck {
        command: command.clone(),
        interval: args.replica.health_interval,
        timeout: args.replica.health_timeout,
        retries: args.replica.health_retries,
    }))
}

/// `--shards` and `--max-shards`, or why they cannot be used together with what else was
/// asked for.
fn sharding(args: &RunArgs, database: &Database) -> Result<Option<Sharding>, UsageError> {
    let Some(count) = args.shards else {
        return Ok(None);
    };
    let refuse = |what: &str, why: &str| {
        Err(UsageError(format!(
            "--shards cannot be used with {what}: {why}"
        )))
    };
    match database {
        Database::Postgres(_) | Database::Redis(_) => {}
        Database::Quorum(_) => {
            return refuse(
                "a Redlock quorum",
                "each shard's lock and each replica's end would have to be agreed by a \
                 majority of the servers, which is not built; use PostgreSQL or one Redis \
                 server",
            );
        }
    }
    if args.once || args.no_wait {
        return refuse(
            if args.no_wait { "--no-wait" } else { "--once" },
            "a replica's share of the shards changes as replicas come and go, so there is no \
             single run to wait for and exit with; run it as a service",
        );
    }
    if args.relinquish_after.is_some() || args.relinquish_schedule.is_some() {
        return refuse(
            "--relinquish-after or --relinquish-schedule",
            "shards already move between replicas to keep the fleet balanced; to move them off \
             a replica, stop it (TERM): its shards run elsewhere within milliseconds",
        );
    }
    Ok(Some(Sharding {
        count,
        cap: args.max_shards,
    }))
}

/// The lock from `--lock-id` or `--lock`, else from PGLEADER_LOCK_ID or PGLEADER_LOCK.
pub fn lock_key(args: &LockArgs, env: &dyn Environment) -> Result<LockKey, UsageError> {
    match (&args.lock_id, &args.lock_name) {
        (Some(id), None) => return Ok(LockKey::from_id(*id)),
        (None, Some(name)) => return Ok(LockKey::from_name(name)),
        (Some(_), Some(_)) => {
            return Err(UsageError(
                "give either --lock-id or --lock, not both".into(),
            ));
        }
        (None, None) => {}
    }
    match (env.var("PGLEADER_LOCK_ID"), env.var("PGLEADER_LOCK")) {
        (Some(id), None) => id.trim().parse().map(LockKey::from_id).map_err(|_| {
            UsageError(format!(
                "PGLEADER_LOCK_ID={id:?} is not a signed 64-bit integer"
            ))
        }),
        (None, Some(name)) => Ok(LockKey::from_name(&name)),
        (Some(_), Some(_)) => Err(UsageError(
            "both PGLEADER_LOCK_ID and PGLEADER_LOCK are set; set only one".into(),
        )),
        (None, None) => Err(UsageError(
            "which lock? give --lock-id <ID> or --lock <NAME>".into(),
        )),
    }
}

/// The server of `--database-url` (or PGLEADER_DATABASE_URL), else DATABASE_URL, else the PG*
/// variables alone: Redis for a `redis://` or `rediss://` URL (with REDISCLI_AUTH as the
/// password when the URL has none), PostgreSQL otherwise.
pub fn database(args: &ConnectionArgs, env: &dyn Environment) -> Result<Database, UsageError> {
    // PGLEADER_DATABASE_URL arrives as one value: several Redis URLs in it are separated by
    // spaces (a PostgreSQL key=value string has spaces of its own, so only Redis URLs split).
    let mut urls = args.database_url.clone();
    if let [single] = urls.as_slice() {
        let words: Vec<&str> = single.split_whitespace().collect();
        if words.len() > 1 && words.iter().all(|word| is_redis_url(word)) {
            urls = words.into_iter().map(str::to_owned).collect();
        }
    }
    if urls.len() > 1 {
        return quorum(&urls, env).map(Database::Quorum);
    }
    let (text, source) = match urls.pop() {
        Some(url) => (Some(url), "--database-url"),
        None => match env.var("DATABASE_URL") {
            Some(url) => (Some(url), "DATABASE_URL"),
            None => (None, "the PG* environment"),
        },
    };
    if let Some(url) = text.as_deref().filter(|url| is_redis_url(url)) {
        let server = RedisServer::parse(url, env.var("REDISCLI_AUTH"), REDIS_CONNECT_TIMEOUT)
            .map_err(|err| UsageError(format!("{source}: {err}")))?;
        return Ok(Database::Redis(server));
    }
    let (settings, warnings) = conninfo::resolve(text.as_deref(), env)
        .map_err(|err| UsageError(format!("{source}: {err}")))?;
    Ok(Database::Postgres(Connection { settings, warnings }))
}

/// The servers of a Redlock quorum: three or more Redis URLs.
fn quorum(urls: &[String], env: &dyn Environment) -> Result<Vec<RedisServer>, UsageError> {
    if let Some(other) = urls.iter().find(|url| !is_redis_url(url)) {
        let shown = if other.contains("://") {
            other.split("://").next().unwrap_or_default().to_owned() + "://"
        } else {
            "a key=value string".to_owned()
        };
        return Err(UsageError(format!(
            "--database-url given {} times names a quorum of Redis servers, and each must be a \
             redis:// or rediss:// URL, not {shown}",
            urls.len()
        )));
    }
    if urls.len() < 3 {
        return Err(UsageError(format!(
            "a quorum needs at least three Redis servers, not {}: with two, losing either one \
             stops every leader, which is worse than one server. Give one server, or three or more",
            urls.len()
        )));
    }
    let mut servers = Vec::with_capacity(urls.len());
    for (number, url) in urls.iter().enumerate() {
        let server = RedisServer::parse(url, env.var("REDISCLI_AUTH"), REDIS_CONNECT_TIMEOUT)
            .map_err(|err| UsageError(format!("--database-url #{}: {err}", number + 1)))?;
        if servers.contains(&server) {
            return Err(UsageError(format!(
                "--database-url #{}: {server} is given twice; a quorum needs independent servers",
                number + 1
            )));
        }
        servers.push(server);
    }
    Ok(servers)
}

/// Refuses `--ledger-table` on Redis, where it has no meaning.
pub fn no_ledger_table_on_redis(args: &LedgerArgs, database: &Database) -> Result<(), UsageError> {
    if matches!(database, Database::Postgres(_)) || args.ledger_table.is_none() {
        return Ok(());
    }
    Err(UsageError(
        "--ledger-table has no meaning on Redis: the ledger lives in the lock's own keys \
         (pgleader:{NAME}:runs and :rows)"
            .into(),
    ))
}

/// The ledger table of `--ledger-table` (pgleader_ledger when not given).
pub fn ledger_table(args: &LedgerArgs) -> Result<TableName, UsageError> {
    match &args.ledger_table {
        Some(text) => {
            TableName::parse(text).map_err(|err| UsageError(format!("--ledger-table: {err}")))
        }
        None => Ok(TableName::default()),
    }
}
