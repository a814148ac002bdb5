//! The validated settings of `pgleader run` and `pgleader status`, built from the command line
//! and the environment. Everything that can be refused is refused here, before any connection
//! is made: a bad value is a usage error (exit 2), a command that cannot run is 126 or 127.

use std::net::SocketAddr;
use std::time::Duration;

use nix::sys::signal::Signal;
use thiserror::Error;

use crate::cli::{ConnectionArgs, LedgerArgs, LockArgs, RestartFence, RunArgs};
use crate::election::lease::Lease;
use crate::election::lock::LockKey;
use crate::postgres::conninfo::{self, ConnSettings, Environment};
use crate::postgres::ledger::TableName;
use crate::schedule::Plan;
use crate::schedule::calendar::Schedule;
use crate::supervise::job::CommandLine;

/// A usage error: the message says what is wrong; pgleader exits with 2.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Everything `pgleader run` needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub lock: LockKey,
    pub connection: ConnSettings,
    /// What pg_stat_activity shows for pgleader's sessions.
    pub application_name: String,
    pub command: CommandLine,
    pub once: bool,
    pub no_wait: bool,
    pub busy_exit_code: u8,
    pub check_interval: Duration,
    pub check_timeout: Duration,
    pub kill_signal: Signal,
    pub kill_timeout: Duration,
    pub restart_delay: Duration,
    pub lease: Lease,
    pub takeover_delay: Duration,
    /// See `--restart-fence`; already resolved from `auto`.
    pub restart_fence: Duration,
    pub relinquish_after: Option<Duration>,
    pub relinquish_schedule: Option<croner::Cron>,
    /// `--schedule` and its companions.
    pub schedule: Option<Plan>,
    /// Where to serve /leader, /healthz, /status and /metrics, if anywhere.
    pub http: Option<SocketAddr>,
}

/// A resolved connection and the warnings its resolution produced.
#[derive(Debug)]
pub struct Connection {
    pub settings: ConnSettings,
    pub warnings: Vec<String>,
}

impl RunConfig {
    /// Validates the arguments. The command is looked up last, so that a usage error is
    /// reported as one even when the command is also wrong.
    pub fn from_args(
        args: RunArgs,
        env: &dyn Environment,
    ) -> anyhow::Result<(RunConfig, Vec<String>)> {
        let lock = lock_key(&args.lock, env)?;
        let connection = connection(&args.connection, env)?;
        let lease = Lease::new(args.lease);
        lease
            .validate(args.check_interval, args.check_timeout, args.kill_timeout)
            .map_err(UsageError)?;
        let schedule = match &args.schedule {
            Some(expression) => Some(Plan {
                schedule: Schedule::parse(expression, &args.schedule_timezone)
                    .map_err(|err| UsageError(format!("--schedule: {err}")))?,
                catch_up: args.catch_up,
                retry_interrupted: args.retry_interrupted,
                table: ledger_table(&args.ledger)?,
                once: args.once || args.no_wait,
                statement_timeout: args.check_timeout / 2,
            }),
            None => None,
        };
        let command = CommandLine::resolve(args.command, std::env::var_os("PATH").as_deref())?;
        let config = RunConfig {
            lock,
            application_name: scheduled_application_name(
                connection.settings.application_name.as_deref(),
                schedule
                    .as_ref()
                    .map(|plan| plan.schedule.fingerprint())
                    .as_deref(),
            ),
            connection: connection.settings,
            command,
            once: args.once || args.no_wait,
            no_wait: args.no_wait,
            busy_exit_code: args.busy_exit_code,
            check_interval: args.check_interval,
            check_timeout: args.check_timeout,
            kill_signal: args.kill_signal,
            kill_timeout: args.kill_timeout,
            restart_delay: args.restart_delay,
            lease,
            takeover_delay: args.takeover_delay,
            relinquish_after: args.relinquish_after,
            relinquish_schedule: args.relinquish_schedule,
            schedule,
            http: args.http,
            restart_fence: match args.restart_fence {
                RestartFence::Fixed(duration) => duration,
                RestartFence::Auto => {
                    args.check_interval
                        + args.check_timeout
                        + args.kill_timeout
                        + crate::election::lease::MARGIN
                }
            },
        };
        Ok((config, connection.warnings))
    }
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

/// The connection from `--database-url` (or PGLEADER_DATABASE_URL), else DATABASE_URL, else
/// the PG* variables alone.
pub fn connection(args: &ConnectionArgs, env: &dyn Environment) -> Result<Connection, UsageError> {
    let (text, source) = match &args.database_url {
        Some(url) => (Some(url.clone()), "--database-url"),
        None => match env.var("DATABASE_URL") {
            Some(url) => (Some(url), "DATABASE_URL"),
            None => (None, "the PG* environment"),
        },
    };
    let (settings, warnings) = conninfo::resolve(text.as_deref(), env)
        .map_err(|err| UsageError(format!("{source}: {err}")))?;
    Ok(Connection { settings, warnings })
}

/// This host's name, as pgleader shows it in `application_name` and the ledger.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|name| name.into_string().ok())
        .unwrap_or_else(|| "unknown".into())
}

/// The ledger table of `--ledger-table`.
pub fn ledger_table(args: &LedgerArgs) -> Result<TableName, UsageError> {
    TableName::parse(&args.ledger_table).map_err(|err| UsageError(format!("--ledger-table: {err}")))
}

/// `<name>:<pid>@<host>`, where name is the user's application_name or "pgleader"; at most 63
/// bytes, the server's limit. A scheduled pgleader adds its schedule's fingerprint to the name
/// (`pgleader#1a2b3c4d:<pid>@<host>`), so that a leader can tell whether the replicas waiting
/// behind it agree with it on the schedule.
pub fn application_name(user_given: Option<&str>) -> String {
    scheduled_application_name(user_given, None)
}

/// [`application_name`] with a schedule's fingerprint.
pub fn scheduled_application_name(user_given: Option<&str>, fingerprint: Option<&str>) -> String {
    let host = host_name();
    let mut prefix = user_given.unwrap_or("pgleader").to_owned();
    if let Some(fingerprint) = fingerprint {
        // The fingerprint must survive the cut at 63 bytes.
        let mut cut = prefix.len().min(32);
        while !prefix.is_char_boundary(cut) {
            cut -= 1;
        }
        prefix.truncate(cut);
        prefix = format!("{prefix}#{fingerprint}");
    }
    let mut name = format!("{prefix}:{}@{}", std::process::id(), host);
    if name.len() > 63 {
        let mut cut = 63;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_application_name_fits_the_servers_limit() {
        let name = application_name(Some(&"x".repeat(80)));
        assert_eq!(name.len(), 63);
        let name = application_name(None);
        assert!(
            name.starts_with(&format!("pgleader:{}@", std::process::id())),
            "{name}"
        );
    }
}
