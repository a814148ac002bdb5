//! Scheduled jobs (`--schedule`): each occurrence of a cron schedule starts at most once
//! across the fleet, on the database server's clock, through failovers, restarts and clock
//! skew, and none is lost without a trace.
//!
//! The supervisor still elects the leader and owns the command; this module answers its one
//! question, "what is the next occurrence, and may I run it?", and records what became of
//! each: [`calendar`] computes occurrences, [`clock`] follows the server's clock, [`ledger`]
//! claims and records them in a table on the leader's own session, [`agreement`] checks that
//! the replicas agree on the schedule, and [`runs`] puts these together for one leadership.

pub mod agreement;
pub mod calendar;
pub mod clock;
pub mod ledger;
pub mod report;
pub mod runs;

use std::time::Duration;

use calendar::Schedule;
use ledger::TableName;

/// Everything `--schedule` and its companion options configure.
#[derive(Clone, Debug)]
pub struct Plan {
    pub schedule: Schedule,
    /// How late a missed occurrence may still run (`--catch-up`).
    pub catch_up: Duration,
    /// How many times an interrupted run is started again (`--retry-interrupted`).
    pub retry_interrupted: u32,
    pub table: TableName,
    /// `--once`: a timer's single run, rather than a service's every run.
    pub once: bool,
}

/// How early a timer (`--once`) may fire, on the server's clock, and still wait for the
/// occurrence it was meant for: a host clock that runs ahead, or a timer that fires a little
/// early, must not make it run yesterday's occurrence or nothing at all.
pub const EARLY_WINDOW: Duration = Duration::from_secs(60);
