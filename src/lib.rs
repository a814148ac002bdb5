//! pgleader runs a command on exactly one replica of a service: the one whose PostgreSQL
//! session holds an advisory lock. It stops the command the moment that replica is no longer
//! the leader, and goes back into the election.
//!
//! The binary (`main.rs`) parses the command line and calls [`execute`]; the modules below
//! each own one concern. DESIGN.md in the repository's shared notes lists the invariants the
//! code keeps and the tests that prove them.

pub mod cli;
pub mod config;
pub mod election;
pub mod exit;
pub mod operate;
pub mod postgres;
pub mod schedule;
pub mod supervise;

use anyhow::Context;
use tracing::warn;

use crate::cli::{Command, RunArgs, StatusArgs};
use crate::config::{RunConfig, UsageError};
use crate::operate::telemetry::{self, Telemetry};
use crate::operate::{http, notify, status, watch};
use crate::postgres::conninfo::ProcessEnvironment;
use crate::supervise::job::CommandError;
use crate::supervise::{signals, supervisor};

/// Runs a subcommand to its end and returns the exit code. Must run inside a tokio runtime
/// whose thread lives as long as the process.
pub async fn execute(command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Run(args) => run(*args).await,
        Command::Status(args) => status(args).await,
    }
}

async fn run(args: RunArgs) -> anyhow::Result<u8> {
    // Listen first: from here on TERM and INT are pgleader's to handle.
    let signals = signals::listen().context("cannot listen for signals")?;
    let (config, warnings) = RunConfig::from_args(args, &ProcessEnvironment)?;
    for warning in warnings {
        warn!(event = "config", "{warning}");
    }
    let telemetry = Telemetry::new(telemetry::Settings {
        lock: config.lock.clone(),
        connection: config.connection.to_string(),
        check_deadline: config.check_interval + config.check_timeout,
        schedule: config.schedule.as_ref().map(|plan| plan.schedule.clone()),
    });
    // Bound before the election: a port that is taken stops pgleader before it can win.
    if let Some(address) = config.http {
        http::spawn(http::bind(address).await?, telemetry.clone());
    }
    notify::init();
    let outcome = supervisor::run(config, signals, telemetry).await?;
    Ok(outcome.exit_code())
}

async fn status(args: StatusArgs) -> anyhow::Result<u8> {
    let lock = config::lock_key(&args.lock, &ProcessEnvironment)?;
    let connection = config::connection(&args.connection, &ProcessEnvironment)?;
    for warning in connection.warnings {
        warn!(event = "config", "{warning}");
    }
    let ledger = config::ledger_table(&args.ledger)?;
    if args.watch {
        return watch::watch(&lock, &connection.settings, args.json).await;
    }
    let status = status::read(&lock, &connection.settings, &ledger).await?;
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
    if err.downcast_ref::<UsageError>().is_some() {
        exit::USAGE
    } else if let Some(err) = err.downcast_ref::<CommandError>() {
        err.exit_code()
    } else {
        exit::FAILURE
    }
}
