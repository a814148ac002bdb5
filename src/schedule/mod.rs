//! Scheduled jobs (`--schedule`): each occurrence of a cron schedule starts at most once
//! across the fleet, on the database server's clock, through failovers, restarts and clock
//! skew, and none is lost without a trace.
//!
//! The supervisor still elects the leader and owns the command; this module answers its one
//! question, "what is the next occurrence, and may I run it?", and records what became of
//! each: [`calendar`] computes occurrences, [`clock`] follows the server's clock, [`agreement`]
//! checks that the replicas agree on the schedule, and [`runs`] puts these together for one
//! leadership. The ledger that claims and records occurrences is the backend's, behind the
//! contract of `election/ledger.rs`, on the leader's own session; nothing here knows SQL.

pub mod agreement;
pub mod calendar;
pub mod clock;
pub mod crontab;
pub mod report;
pub mod runs;

use std::rc::Rc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::time::Instant;
use tracing::warn;

use crate::election::ledger::{Definition, LateFinish, Ledger, LedgerError};
use crate::election::lock::LockKey;
use calendar::Schedule;

/// Everything `--schedule` and its companion options configure (where the ledger lives is the
/// backend's business).
#[derive(Clone, Debug)]
pub struct Plan {
    pub schedule: Schedule,
    /// How late a missed occurrence may still run (`--catch-up`).
    pub catch_up: Duration,
    /// How many times an interrupted run is started again (`--retry-interrupted`).
    pub retry_interrupted: u32,
    /// `--once`: a timer's single run, rather than a service's every run.
    pub once: bool,
    /// How long to wait before trying again a ledger statement that was rolled back for
    /// waiting too long (the backend bounds each statement by about as much).
    pub busy_retry: Duration,
    /// A crontab job's name, for the `job` field of the log lines; `None` for `--schedule`.
    pub job: Option<String>,
    /// What an occurrence that comes while the previous run still goes does: it is skipped
    /// (`--schedule`, and a crontab job by default), it runs beside it (`overlap=allow`, up to
    /// [`runs::MOST_AT_ONCE`] runs at once), or it stops it (`overlap=replace`: the old run is
    /// recorded as interrupted).
    pub overlap: crontab::Overlap,
    /// Whether the latest occurrence of a definition the ledger has never recorded is caught
    /// up (`--schedule`: a timer started a moment late runs its occurrence), or the runs start
    /// from the next one (a crontab's job added or rescheduled, by a reread or a deploy, as
    /// cron and supercronic do). Catch-up is for a known definition's occurrences, missed
    /// while no replica could run them.
    pub catch_up_new: bool,
    /// A crontab job's `jitter=`: each occurrence starts [`jitter`] after it; zero for
    /// `--schedule`.
    pub jitter: Duration,
}

impl Plan {
    /// How long the start of the occurrence of `at` is put off.
    pub fn delay_of(&self, at: Timestamp) -> Duration {
        jitter(self.job.as_deref().unwrap_or_default(), at, self.jitter)
    }

    /// The definition the ledger records.
    pub fn definition(&self) -> Definition {
        Definition {
            expression: self.schedule.expression().to_owned(),
            timezone: self.schedule.timezone().to_owned(),
        }
    }
}

/// How long the start of job `job`'s occurrence of `at` is put off under `jitter=most`: less
/// than `most`, drawn from a hash of the job's name and the occurrence, so that whichever replica
/// runs it (after a takeover, a deploy) waits the same, and the jobs of one minute spread
/// over it rather than start at one instant.
pub fn jitter(job: &str, at: Timestamp, most: Duration) -> Duration {
    let most_ms = most.as_millis() as u64;
    if most_ms == 0 {
        return Duration::ZERO;
    }
    let drawn = LockKey::from_name(&format!("pgleader jitter {job} {}", calendar::rfc3339(at)))
        .key() as u64;
    Duration::from_millis(drawn % most_ms)
}

/// What became of one occurrence of a schedule (`--schedule`): the `outcome` label of
/// `pgleader_scheduled_runs_total`. All but `busy` are the outcomes the ledger records; each is
/// counted by the instance that recorded it, so the sum over the fleet matches the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduledOutcome {
    /// The command ran and exited 0.
    Succeeded,
    /// The command ran and exited otherwise.
    Failed,
    /// The run was stopped before it ended (shutdown, lost leadership), or its leader vanished
    /// while it ran (recorded by the next leader).
    Interrupted,
    /// Its time came while the previous run still ran.
    Skipped,
    /// It came while no leader could run it, longer ago than --catch-up.
    Missed,
    /// A timer (--once) found its occurrence claimed by another replica and did not run it.
    Busy,
    /// A crontab job the fleet pauses (`pgleader cron pause`): not run, and not missed.
    Paused,
}

impl ScheduledOutcome {
    /// The outcomes of `--schedule`'s occurrences (the `outcome` label's values).
    pub const OF_SCHEDULE: [ScheduledOutcome; 6] = [
        ScheduledOutcome::Succeeded,
        ScheduledOutcome::Failed,
        ScheduledOutcome::Interrupted,
        ScheduledOutcome::Skipped,
        ScheduledOutcome::Missed,
        ScheduledOutcome::Busy,
    ];

    pub const ALL: [ScheduledOutcome; 7] = [
        ScheduledOutcome::Succeeded,
        ScheduledOutcome::Failed,
        ScheduledOutcome::Interrupted,
        ScheduledOutcome::Skipped,
        ScheduledOutcome::Missed,
        ScheduledOutcome::Busy,
        ScheduledOutcome::Paused,
    ];

    /// The outcome of a ledger row (`skipped`, `missed`, ...); `None` for `running`.
    pub fn from_ledger(outcome: &str) -> Option<ScheduledOutcome> {
        ScheduledOutcome::ALL
            .into_iter()
            .find(|known| known.as_str() == outcome)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ScheduledOutcome::Succeeded => "succeeded",
            ScheduledOutcome::Failed => "failed",
            ScheduledOutcome::Interrupted => "interrupted",
            ScheduledOutcome::Skipped => "skipped",
            ScheduledOutcome::Missed => "missed",
            ScheduledOutcome::Busy => "busy",
            ScheduledOutcome::Paused => "paused",
        }
    }
}

/// One occurrence of the schedule as this instance saw it recorded, for `/status`.
#[derive(Clone, Debug, PartialEq)]
pub struct RunView {
    pub scheduled_for: Timestamp,
    /// `None` while it runs.
    pub outcome: Option<ScheduledOutcome>,
    pub exit_code: Option<i32>,
    pub attempt: Option<i32>,
    pub claimed_at: Option<Timestamp>,
    pub ended_at: Option<Timestamp>,
    /// The host of the pgleader that ran it.
    pub host: Option<String>,
    /// How long `jitter=` put its start off: its lateness counts from then.
    pub delay: Duration,
}

impl RunView {
    /// How late the run started after its occurrence (after the start `jitter=` put it off
    /// to), on the server's clock; `None` before it started.
    pub fn lateness(&self) -> Option<Duration> {
        let start = self
            .scheduled_for
            .checked_add(self.delay)
            .unwrap_or(self.scheduled_for);
        let late = self.claimed_at?.duration_since(start);
        Some(Duration::try_from(late).unwrap_or_default())
    }

    /// Takes a later report of the same occurrence (its outcome, when it ended) into this one,
    /// keeping what only the earlier said (the claim, the host).
    pub fn complete(&mut self, later: RunView) {
        self.outcome = later.outcome;
        self.exit_code = later.exit_code.or(self.exit_code);
        self.attempt = later.attempt.or(self.attempt);
        self.claimed_at = later.claimed_at.or(self.claimed_at);
        self.ended_at = later.ended_at.or(self.ended_at);
        self.host = later.host.or(self.host.take());
        if !later.delay.is_zero() {
            self.delay = later.delay;
        }
    }
}

/// Where runs and outcomes go for the HTTP endpoint (the supervisor passes its telemetry's).
#[derive(Clone)]
pub struct Publish(pub Rc<dyn Fn(RunView)>);

impl Publish {
    pub fn run(&self, run: RunView) {
        (self.0)(run);
    }
}

impl std::fmt::Debug for Publish {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Publish")
    }
}

/// What a new session learnt while preparing the ledger.
#[derive(Debug, Default)]
pub struct Prepared {
    /// A live replica of the lock that records its runs in another ledger.
    pub foreign_ledger: Option<String>,
    /// The fingerprint of this replica's ledger (its location, schema-qualified on
    /// PostgreSQL).
    pub ledger_fingerprint: String,
}

/// Prepares a new session's ledger, before the session joins the election: makes sure the
/// ledger can be used, records a run whose outcome the previous session could not (`late`),
/// looks for replicas that record the lock's runs in another ledger, and announces this
/// replica's schedule and ledger on its session.
pub async fn prepare<L: Ledger>(
    plan: &Plan,
    lock: &LockKey,
    ledger: &L,
    late: Option<&LateFinish>,
) -> Result<Prepared, LedgerError> {
    let location = ledger.prepare().await?;
    if let Some(late) = late {
        let recorded = ledger.finish_late(late).await?;
        let at = calendar::rfc3339(late.at);
        if recorded {
            warn!(event = "scheduled_run_finished", occurrence = %at, outcome = late.outcome, "recorded the outcome of the run of {at} ({}) late: the previous session ended first", late.outcome);
        } else {
            warn!(event = "ledger_conflict", occurrence = %at, "the run of {at} ended {} but could not be recorded: another leader has taken the occurrence over since", late.outcome);
        }
    }
    let own = ledger_fingerprint(&location);
    let live = ledger.participants().await?;
    let foreign = agreement::foreign_ledgers(&live, &own);
    let foreign_ledger = (!foreign.is_empty()).then(|| {
        let who: Vec<String> = foreign.iter().map(|p| p.describe_briefly()).collect();
        let text = format!(
            "{} record(s) this lock's runs in another ledger table than {location}; an occurrence could run once in each. Give every replica the same --ledger-table (and the same search_path)",
            who.join(", ")
        );
        warn!(event = "ledger_mismatch", lock = %lock, "{text}");
        text
    });
    ledger
        .announce(&format!("{}{own}", plan.schedule.fingerprint()))
        .await?;
    Ok(Prepared {
        foreign_ledger,
        ledger_fingerprint: own,
    })
}

/// Eight hex digits that identify where a ledger lives (on PostgreSQL, its schema-qualified
/// table), announced beside the schedule's fingerprint, so that replicas that would record one
/// lock's runs in two places notice each other.
pub fn ledger_fingerprint(location: &str) -> String {
    let key = LockKey::from_name(&format!("ledger {location}")).key();
    format!("{:08x}", (key as u64) as u32)
}

/// Why a timer (`--once`) that found the lock held does not run: another replica holds it to
/// run (or record as skipped) the occurrence this timer fired for, or a service leads.
pub async fn busy_reason<L: Ledger>(plan: &Plan, ledger: &L) -> String {
    let now: Option<Timestamp> = ledger.server_time().await.ok();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_is_the_same_for_an_occurrence_and_spreads_a_minute_of_jobs() {
        let at: Timestamp = "2026-11-28T03:00:00Z".parse().expect("instant");
        let most = Duration::from_secs(60);
        assert_eq!(jitter("report", at, most), jitter("report", at, most));
        assert_eq!(jitter("report", at, Duration::ZERO), Duration::ZERO);
        let next: Timestamp = "2026-11-28T03:01:00Z".parse().expect("instant");
        assert_ne!(jitter("report", at, most), jitter("report", next, most));
        // A hundred jobs of one occurrence: each within the bound, spread over it.
        let delays: Vec<Duration> = (0..100)
            .map(|job| jitter(&format!("j{job}"), at, most))
            .collect();
        assert!(delays.iter().all(|delay| *delay < most));
        let seconds: std::collections::HashSet<u64> =
            delays.iter().map(Duration::as_secs).collect();
        assert!(seconds.len() > 40, "{} distinct seconds", seconds.len());
    }
}
