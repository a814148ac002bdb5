//! The ledger's boundary: what a backend must give scheduled jobs (`--schedule`) so that each
//! occurrence starts at most once across the fleet.
//!
//! A ledger is a record of one lock's occurrences, kept by the backend that elects its leader,
//! and reached through the leader's own session ([`crate::election::Session::ledger`]). The
//! scheduler (`schedule/runs.rs`) decides what to claim and when; the ledger only has to
//! remember, and to refuse what must be refused. Every backend's ledger must guarantee:
//!
//! 1. **A claim succeeds only while the claimant holds the leadership that its fencing token
//!    names.** The check is part of the claim itself, on the server, in one atomic step (on
//!    PostgreSQL: the claim's statement requires that its session holds the advisory lock; on
//!    Redis: the claim's script requires that the lock's key still holds this leadership's
//!    value). A leader that lost the lock a moment ago gets [`Claim::NotLeader`], never a claim.
//! 2. An occurrence is claimed at most once (a retry of an interrupted run, within
//!    `--retry-interrupted`, increments its attempt), never before the server's clock has
//!    reached it ([`Claim::Early`]), and never at or before an occurrence already recorded
//!    ([`Claim::Superseded`]): a clock that steps back, or pruning, cannot bring one back.
//! 3. Outcomes are recorded only on the row of the leadership (epoch) that claimed it, so a
//!    late writer cannot overwrite a newer leader's run.
//! 4. History is readable (newest first) by anyone, leader or not, for `status`.
//!
//! Statements are bounded by the backend: none may hold up the leader's checks, which share the
//! session, past their deadline. One that waited too long is rolled back and reported as
//! [`LedgerError::Busy`], so that the scheduler tries it again, still leading.

use std::time::Duration;

use jiff::Timestamp;
use thiserror::Error;

use crate::election::participant::Participant;

/// How many rows of each lock a ledger keeps.
pub const KEEP: i64 = 100;

/// A ledger failure, sorted by what the leader does about it.
#[derive(Debug, Error)]
pub enum LedgerError {
    /// Retrying cannot help: no permission, no table, a table of another shape. pgleader exits.
    #[error("{0}")]
    Fatal(String),
    /// The statement waited too long (a lock held on the table, a statement timeout) or lost a
    /// serialization race, and was rolled back: try again a little later, still leading.
    #[error("{0}")]
    Busy(String),
    /// The session itself is in trouble: leadership is in doubt.
    #[error("{0}")]
    Query(String),
}

/// A schedule's definition as the ledger records it: the canonical expression and the IANA
/// time zone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Definition {
    pub expression: String,
    pub timezone: String,
}

impl Definition {
    /// Whether `entry` was recorded under this definition.
    pub fn is_of(&self, entry: &Entry) -> bool {
        entry.schedule == self.expression && entry.timezone == self.timezone
    }
}

/// Who claims: this pgleader, in the leadership its fencing token names.
#[derive(Clone, Debug)]
pub struct Claimant {
    pub host: String,
    pub pid: i32,
    pub epoch: i64,
}

/// A row of the ledger, newest first when read.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub scheduled_for: Timestamp,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub attempt: i32,
    pub claimed_at: Timestamp,
    pub ended_at: Option<Timestamp>,
    pub host: Option<String>,
    pub pid: Option<i32>,
    /// The claiming session's id on the server (PostgreSQL's backend pid).
    pub backend_pid: Option<i32>,
    pub epoch: Option<i64>,
    pub detail: Option<String>,
    pub schedule: String,
    pub timezone: String,
    /// The last lines the run printed, when they were kept (`--keep-output`).
    pub output: Option<String>,
}

/// A crontab job as the ledger knows it (`pgleader status` of a crontab fleet): its name, its
/// newest row, and when its last successful run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct JobEntry {
    pub name: String,
    pub newest: Entry,
    pub last_success: Option<Timestamp>,
}

/// How a run ended, kept by a leader whose session ended before it could record it.
#[derive(Clone, Debug, PartialEq)]
pub struct LateFinish {
    pub at: Timestamp,
    pub epoch: i64,
    pub attempt: i32,
    pub outcome: &'static str,
    pub exit_code: Option<i32>,
    pub ended_at: Timestamp,
    /// The last lines the run printed, when they were kept (`--keep-output`).
    pub output: Option<String>,
}

/// A run of a crontab job asked for by hand (`pgleader cron run`), as its owner takes it:
/// the request's number, when it was asked (on the server's clock) and by whom (`user@host`).
/// It is recorded beside the job's ledger, never as one of its occurrences.
#[derive(Clone, Debug, PartialEq)]
pub struct Asked {
    pub id: i64,
    pub asked_at: Timestamp,
    pub asked_by: String,
}

/// A request to run a job by hand, as `pgleader cron run` and `status --job` read it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AskedEntry {
    pub id: i64,
    pub asked_at: Option<Timestamp>,
    pub asked_by: String,
    /// `asked` (no owner took it yet), `running`, `succeeded`, `failed`, `skipped` (a run of
    /// the job went on under `overlap=skip`) or `interrupted`.
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub started_at: Option<Timestamp>,
    pub ended_at: Option<Timestamp>,
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub detail: Option<String>,
    pub output: Option<String>,
}

impl AskedEntry {
    /// Whether the run is over (or will never start).
    pub fn is_settled(&self) -> bool {
        !matches!(self.outcome.as_str(), "asked" | "running")
    }
}

/// How a run asked by hand ended, recorded on its request (only by the leadership, `epoch`,
/// that took it).
#[derive(Clone, Debug, PartialEq)]
pub struct AskedFinish {
    pub id: i64,
    pub epoch: i64,
    pub outcome: &'static str,
    pub exit_code: Option<i32>,
    pub detail: Option<String>,
    pub output: Option<String>,
}

/// A run an earlier leader left `running`: its occurrence, and the host and pid of the pgleader
/// that ran it.
pub type StaleRun = (Timestamp, Option<String>, Option<i32>);

/// What a claim found.
#[derive(Clone, Debug, PartialEq)]
pub enum Claim {
    /// The occurrence is ours to run; `attempt` is 1, or more for a retried interrupted run.
    Claimed { attempt: i32 },
    /// Already claimed (by anyone, this replica included): its outcome so far.
    Taken { outcome: String },
    /// A later occurrence is already recorded: this one will never run.
    Superseded,
    /// The server's clock has not reached the occurrence yet; it says `server_now`.
    Early { server_now: Timestamp },
    /// This session does not hold the lock (any more): nothing was written.
    NotLeader,
    /// A crontab job the fleet pauses (`pgleader cron pause`): the occurrence was recorded as
    /// `paused`, with `detail` (who paused it, and when), and is not to run.
    Paused { detail: String },
}

/// The ledger of one lock and one schedule definition, reached through one session. Cheap to
/// clone; the futures it returns own what they need, so a statement in flight survives the
/// scheduler's select loop.
pub trait Ledger: Clone + 'static {
    /// Makes sure the ledger can be used by this replica (creating its storage when missing),
    /// and says where it lives (PostgreSQL: the schema-qualified table), so that replicas
    /// recording one lock's runs in two places notice each other.
    fn prepare(&self) -> impl Future<Output = Result<String, LedgerError>>;

    /// Announces this replica's schedule and ledger fingerprints (`<schedule><ledger>`, hex) on
    /// its session, where the other replicas' [`Ledger::participants`] read them.
    fn announce(&self, fingerprints: &str) -> impl Future<Output = Result<(), LedgerError>>;

    /// The other sessions that hold or wait for the lock.
    fn participants(&self) -> impl Future<Output = Result<Vec<Participant>, LedgerError>>;

    /// The server's clock now.
    fn server_time(&self) -> impl Future<Output = Result<Timestamp, LedgerError>>;

    /// Marks the runs earlier leaders left `running` as interrupted (only the holder can be
    /// running anything) and returns them: occurrence, host, pid. A claim of an occurrence the
    /// server's clock will not reach for 100 ms more (claimed ahead, its command not started: it
    /// starts at the instant) is taken back instead, so that the new holder claims and runs it.
    /// Not one nearer: a claimant whose session the server ended (pg_terminate_backend, a
    /// CLIENT KILL) and that has not heard of it yet would start it at the instant beside the
    /// new holder's run; 100 ms is that moment's allowance.
    fn interrupt_stale(&self) -> impl Future<Output = Result<Vec<StaleRun>, LedgerError>>;

    /// The newest `limit` rows of this lock, whatever their definition.
    fn recent(&self, limit: i64) -> impl Future<Output = Result<Vec<Entry>, LedgerError>>;

    /// Whether a row exists for this occurrence.
    fn has(&self, at: Timestamp) -> impl Future<Output = Result<bool, LedgerError>>;

    /// Claims an occurrence for this leadership, or says why not. `retries` is how many times an
    /// interrupted run may be started again. The claim lands once the server's clock has
    /// reached `ahead` before `at` (a crontab job's, so that its command can start at the
    /// instant rather than a round trip after it: `schedule/runs.rs`), and its `claimed_at` is
    /// never before `at`.
    fn claim(
        &self,
        at: Timestamp,
        ahead: Duration,
        claimant: &Claimant,
        retries: i32,
    ) -> impl Future<Output = Result<Claim, LedgerError>>;

    /// Records how a claimed run ended, and prunes old rows (keeping [`KEEP`]). False if the row
    /// was no longer this leadership's to update.
    fn finish(
        &self,
        finish: &LateFinish,
        detail: Option<&str>,
    ) -> impl Future<Output = Result<bool, LedgerError>>;

    /// Records, on a later session (not necessarily leading), how a run ended whose leader lost
    /// its session before it could. False if the row had moved on (retried by another leader).
    fn finish_late(&self, late: &LateFinish) -> impl Future<Output = Result<bool, LedgerError>>;

    /// Takes back a claim whose command never started, so that the next leader may still run
    /// it.
    fn unclaim(&self, at: Timestamp, epoch: i64) -> impl Future<Output = Result<(), LedgerError>>;

    /// Takes the oldest request to run this crontab job by hand (`pgleader cron run`) that no
    /// owner took yet, in one atomic step that succeeds only while this session holds the
    /// job, so that a request is consumed once. `skip`: a run of the job goes on and its
    /// `overlap=skip` refuses another, so the request is recorded as `skipped` with this
    /// detail instead. `None` where no request waits (or the backend keeps none).
    fn take_asked(
        &self,
        claimant: &Claimant,
        skip: Option<&str>,
    ) -> impl Future<Output = Result<Option<Asked>, LedgerError>> {
        let _ = (claimant, skip);
        async { Ok(None) }
    }

    /// Records how a run asked by hand ended, on its request, if that leadership took it.
    fn finish_asked(
        &self,
        finish: &AskedFinish,
    ) -> impl Future<Output = Result<bool, LedgerError>> {
        let _ = finish;
        async { Ok(false) }
    }

    /// Marks the runs asked by hand that earlier owners of the job left `running` as
    /// interrupted, while this session holds the job: they are never started again. How many.
    fn interrupt_stale_asked(&self) -> impl Future<Output = Result<u64, LedgerError>> {
        async { Ok(0) }
    }

    /// Records an occurrence that did not run (`skipped`, `missed`), unless it or a later one is
    /// already recorded. True if recorded.
    fn record(
        &self,
        at: Timestamp,
        outcome: &str,
        detail: &str,
        claimant: &Claimant,
    ) -> impl Future<Output = Result<bool, LedgerError>>;
}
