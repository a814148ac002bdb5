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
pub mod report;
pub mod runs;

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_postgres::types::Type;
use tracing::warn;

use crate::election::lock::LockKey;
use crate::postgres::ledger::{LateFinish, Ledger, LedgerError, TableName, table_fingerprint};
use crate::postgres::session::describe;
use calendar::Schedule;

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
    /// How long a ledger statement may wait (for a lock on the table, a synchronous standby)
    /// before it is rolled back and tried again: well under --check-timeout, so that the
    /// leader's checks, which share its session, are not held up past their deadline.
    pub statement_timeout: Duration,
}

/// What a new session learnt while preparing the ledger.
#[derive(Debug, Default)]
pub struct Prepared {
    /// A live replica of the lock that records its runs in another ledger table.
    pub foreign_ledger: Option<String>,
    /// The fingerprint of this replica's ledger table (schema-qualified).
    pub ledger_fingerprint: String,
}

/// Prepares a new session, before it joins the election: makes sure the ledger table exists
/// and may be used, records a run whose outcome the previous session could not (`late`),
/// looks for replicas that record the lock's runs in another table, and announces this
/// replica's schedule and ledger in its `application_name`.
pub async fn prepare(
    plan: &Plan,
    lock: &LockKey,
    client: &Client,
    application_name: impl Fn(&str) -> String,
    late: Option<&LateFinish>,
) -> Result<Prepared, LedgerError> {
    let ledger = Ledger::new(plan.table.clone(), lock.clone(), plan.schedule.clone());
    let qualified = ledger.prepare(client).await?;
    if let Some(late) = late {
        let recorded = ledger.finish_late(client, late).await?;
        let at = calendar::rfc3339(late.at);
        if recorded {
            warn!(event = "scheduled_run_finished", occurrence = %at, outcome = late.outcome, "recorded the outcome of the run of {at} ({}) late: the previous session ended first", late.outcome);
        } else {
            warn!(event = "ledger_conflict", occurrence = %at, "the run of {at} ended {} but could not be recorded: another leader has taken the occurrence over since", late.outcome);
        }
    }
    let own = table_fingerprint(&qualified);
    let live = agreement::participants(client, lock).await?;
    let foreign = agreement::foreign_ledgers(&live, &own);
    let foreign_ledger = (!foreign.is_empty()).then(|| {
        let who: Vec<String> = foreign.iter().map(|p| p.describe()).collect();
        let text = format!(
            "{} record(s) this lock's runs in another ledger table than {qualified}; an occurrence could run once in each. Give every replica the same --ledger-table (and the same search_path)",
            who.join(", ")
        );
        warn!(event = "ledger_mismatch", lock = %lock, "{text}");
        text
    });
    let name = application_name(&format!("{}{own}", plan.schedule.fingerprint()));
    client
        .query_typed(
            "SELECT pg_catalog.set_config('application_name', $1, false)",
            &[(&name, Type::TEXT)],
        )
        .await
        .map_err(|err| LedgerError::Query(describe(&err)))?;
    Ok(Prepared {
        foreign_ledger,
        ledger_fingerprint: own,
    })
}

/// Why a timer (`--once`) that found the lock held does not run: another replica holds it to
/// run (or record as skipped) the occurrence this timer fired for, or a service leads.
pub async fn busy_reason(plan: &Plan, client: &Client) -> String {
    let now = client
        .query_typed_one("SELECT pg_catalog.clock_timestamp()", &[])
        .await
        .ok()
        .map(|row| row.get::<_, chrono::DateTime<chrono::Utc>>(0));
    match now.and_then(|now| plan.schedule.latest_at_or_before(now)) {
        Some(at) => format!(
            "the holder runs the occurrence of {}, or records it as skipped while an earlier run goes on",
            calendar::rfc3339(at)
        ),
        None => "the holder runs this schedule".to_owned(),
    }
}

/// When a replica last saw another ledger table used for its lock: until `--catch-up` has
/// passed since, it does not catch up occurrences that came before it led, which the other
/// replica may have run (and recorded where this one cannot see).
pub fn foreign_ledger_blocks_catch_up(seen: Option<Instant>, catch_up: Duration) -> bool {
    seen.is_some_and(|at| at.elapsed() < catch_up)
}

/// How early a timer (`--once`) may fire, on the server's clock, and still wait for the
/// occurrence it was meant for: a host clock that runs ahead, or a timer that fires a little
/// early, must not make it run yesterday's occurrence or nothing at all.
pub const EARLY_WINDOW: Duration = Duration::from_secs(60);
