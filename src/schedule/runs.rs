//! One leadership's scheduled runs: when the next occurrence is due on the server's clock,
//! whether this leader may run it, and what became of it.
//!
//! The supervisor polls [`Runs::next`] in its event loop, next to its checks and signals, and
//! acts on what comes out: start the command for an occurrence, hand the lock over, exit. It
//! tells [`Runs`] when the command has ended. Everything here happens on the leader's own
//! session, one ledger statement at a time, so the lock orders every claim.
//!
//! The rules, in order of time:
//!
//! - on winning: runs left `running` by earlier leaders are marked interrupted, the replicas'
//!   agreement on the schedule is checked, and the most recent occurrence is run if it is no
//!   older than `--catch-up` and nobody claimed it (recorded as `missed` if it is older);
//! - a service then waits for each next occurrence and runs it; one that comes while the
//!   previous run is still going is recorded as `skipped`;
//! - a timer (`--once`) runs the occurrence it was started for (the most recent one, or one
//!   that is less than a minute away on the server's clock) and exits.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::{Instant, sleep_until};
use tokio_postgres::Client;
use tracing::{debug, info, warn};

use crate::election::lock::LockKey;
use crate::exit::ChildStatus;
use crate::operate::telemetry::{RunView, ScheduledOutcome, Telemetry};
use crate::schedule::agreement::{self, Verdict};
use crate::schedule::calendar::{Schedule, rfc3339};
use crate::schedule::clock::ServerClock;
use crate::schedule::ledger::{Claim, Claimant, Ledger, LedgerError};
use crate::schedule::{EARLY_WINDOW, Plan};

/// What the supervisor is to do.
#[derive(Debug)]
pub enum RunsEvent {
    /// Start the command for this occurrence (`attempt` > 1 for a retried interrupted run).
    Start {
        occurrence: DateTime<Utc>,
        attempt: i32,
    },
    /// `--once`: the run is over and recorded; exit with the command's status.
    Done,
    /// `--once`: there is nothing for this timer to run (claimed elsewhere, or nothing due);
    /// exit with `--busy-exit-code`.
    NothingToRun,
    /// The replicas disagree on the schedule and this one must not run its version.
    Disagree(String),
    /// A ledger statement failed.
    Failed(LedgerError),
}

/// The occurrence a command runs for.
#[derive(Clone, Copy, Debug)]
struct Run {
    at: DateTime<Utc>,
    attempt: i32,
}

enum Step {
    Begin,
    Claim(DateTime<Utc>),
    Record {
        at: DateTime<Utc>,
        outcome: &'static str,
        detail: String,
    },
    Finish {
        at: DateTime<Utc>,
        outcome: &'static str,
        exit_code: Option<i32>,
    },
}

enum Done {
    Began(Result<Verdict, LedgerError>),
    Claimed {
        at: DateTime<Utc>,
        result: Result<ClaimResult, LedgerError>,
        clock: ServerClock,
    },
    Recorded {
        at: DateTime<Utc>,
        outcome: &'static str,
        detail: String,
        result: Result<bool, LedgerError>,
    },
    Finished {
        at: DateTime<Utc>,
        result: Result<bool, LedgerError>,
    },
}

enum ClaimResult {
    Disagree(String),
    Claim(Claim, Verdict),
}

type Pending = Pin<Box<dyn Future<Output = Done>>>;

/// The scheduled runs of one leadership.
pub struct Runs {
    plan: Plan,
    ledger: Ledger,
    lock: LockKey,
    client: Arc<Client>,
    claimant: Claimant,
    clock: ServerClock,
    /// No claim before this (the restart fence and --takeover-delay).
    not_before: Instant,
    op: Option<Pending>,
    queue: VecDeque<Step>,
    due: Option<DateTime<Utc>>,
    /// The claim of `due` waits until then: the server said it was early.
    early_until: Option<Instant>,
    running: Option<Run>,
    /// Emitted once the queue has drained.
    closing: Option<RunsEvent>,
    /// The first claim of a service's leadership only probes the latest occurrence: that it
    /// was already run is no news.
    probing: bool,
    warned: Option<String>,
    /// Where claims and outcomes are published for the HTTP endpoint.
    telemetry: Telemetry,
}

impl std::fmt::Debug for Runs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runs")
            .field("due", &self.due)
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

impl Runs {
    /// The runs of a leadership that has just begun: `clock` is a sample taken on the
    /// session, `not_before` when the command may start at the earliest.
    pub fn new(
        plan: Plan,
        lock: LockKey,
        client: Arc<Client>,
        claimant: Claimant,
        clock: ServerClock,
        not_before: Instant,
        telemetry: Telemetry,
    ) -> Runs {
        let ledger = Ledger::new(plan.table.clone(), lock.clone(), plan.schedule.clone());
        let offset = clock.host_offset_seconds();
        if offset.abs() >= 1.0 {
            info!(
                event = "clock_offset",
                offset_seconds = format!("{offset:+.3}"),
                "this host's clock is {:.3} s {} the database server's; the schedule follows the server's clock",
                offset.abs(),
                if offset > 0.0 { "ahead of" } else { "behind" }
            );
        }
        let mut queue = VecDeque::new();
        queue.push_back(Step::Begin);
        Runs {
            plan,
            ledger,
            lock,
            client,
            claimant,
            clock,
            not_before,
            op: None,
            queue,
            due: None,
            early_until: None,
            running: None,
            closing: None,
            probing: false,
            warned: None,
            telemetry,
        }
    }

    /// A newer sample of the server's clock (from a leader's check).
    pub fn observe_clock(&mut self, clock: ServerClock) {
        self.clock = clock;
    }

    /// The occurrence the running command was started for.
    pub fn running_occurrence(&self) -> Option<DateTime<Utc>> {
        self.running.map(|run| run.at)
    }

    /// The next occurrence this leader waits for.
    pub fn next_occurrence(&self) -> Option<DateTime<Utc>> {
        self.due
    }

    /// The next thing for the supervisor to do. Cancel-safe: a statement in flight stays in
    /// flight when the future is dropped.
    pub async fn next(&mut self) -> RunsEvent {
        loop {
            if let Some(op) = self.op.as_mut() {
                let done = op.await;
                self.op = None;
                if let Some(event) = self.on_done(done) {
                    return event;
                }
                continue;
            }
            if let Some(step) = self.queue.pop_front() {
                self.op = Some(self.launch(step));
                continue;
            }
            if let Some(event) = self.closing.take() {
                return event;
            }
            let Some(at) = self.due else {
                return std::future::pending().await;
            };
            let mut wake = self.clock.instant_of(at);
            if self.running.is_none() {
                wake = wake.max(self.not_before);
                if let Some(until) = self.early_until {
                    wake = wake.max(until);
                }
            }
            sleep_until(wake).await;
            self.on_due(at);
        }
    }

    /// The command ended on its own: record how.
    pub fn exited(&mut self, status: ChildStatus) {
        let Some(run) = self.running.take() else {
            return;
        };
        let succeeded = status == ChildStatus::Exited(0);
        let outcome = if succeeded { "succeeded" } else { "failed" };
        let next = self.due.filter(|_| !self.plan.once).map(rfc3339);
        if succeeded {
            info!(event = "scheduled_run_finished", occurrence = %rfc3339(run.at), attempt = run.attempt, outcome, exit_code = status.exit_code(), next = next.as_deref().unwrap_or("none"), "the run of {} succeeded", rfc3339(run.at));
        } else {
            warn!(event = "scheduled_run_finished", occurrence = %rfc3339(run.at), attempt = run.attempt, outcome, status = %status, exit_code = status.exit_code(), next = next.as_deref().unwrap_or("none"), "the run of {} failed ({status})", rfc3339(run.at));
        }
        self.queue.push_back(Step::Finish {
            at: run.at,
            outcome,
            exit_code: Some(i32::from(status.exit_code())),
        });
        self.publish(run.at, outcome, Some(i32::from(status.exit_code())));
        if self.plan.once {
            self.due = None;
            self.closing = Some(RunsEvent::Done);
        }
    }

    /// The command was stopped before it ended (shutdown, a handover): record the run as
    /// interrupted while the session still holds the lock. Bounded by `timeout`.
    pub async fn interrupted(&mut self, status: Option<ChildStatus>, why: &str, timeout: Duration) {
        self.op = None;
        self.queue.clear();
        let Some(run) = self.running.take() else {
            return;
        };
        warn!(event = "scheduled_run_interrupted", occurrence = %rfc3339(run.at), reason = why, "the run of {} was interrupted: {why}", rfc3339(run.at));
        let exit_code = status.map(|status| i32::from(status.exit_code()));
        self.publish(run.at, "interrupted", exit_code);
        let finish = self.ledger.finish(
            &self.client,
            run.at,
            self.claimant.epoch,
            "interrupted",
            exit_code,
            Some(why),
        );
        match tokio::time::timeout(timeout, finish).await {
            Ok(Ok(_)) => {}
            Ok(Err(err)) => {
                warn!(event = "ledger_failed", reason = %err, "cannot record the interrupted run; the next leader will")
            }
            Err(_) => {
                warn!(
                    event = "ledger_failed",
                    "no answer recording the interrupted run; the next leader will"
                )
            }
        }
    }

    fn on_due(&mut self, at: DateTime<Utc>) {
        self.due = None;
        match self.running {
            Some(run) => {
                self.queue.push_back(Step::Record {
                    at,
                    outcome: "skipped",
                    detail: format!("the run of {} was still going", rfc3339(run.at)),
                });
                self.due = self.after(at);
            }
            None => self.queue.push_back(Step::Claim(at)),
        }
    }

    /// The next occurrence after `at`, and after now: a late run does not queue up the
    /// occurrences that passed meanwhile.
    fn after(&self, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.schedule().next_after(at.max(self.clock.now()))
    }

    fn schedule(&self) -> &Schedule {
        &self.plan.schedule
    }

    /// Publishes the outcome the ledger records for the occurrence of `at`.
    fn publish(&self, at: DateTime<Utc>, outcome: &str, exit_code: Option<i32>) {
        self.telemetry.scheduled_run(RunView {
            scheduled_for: at,
            outcome: ScheduledOutcome::from_ledger(outcome),
            exit_code,
            attempt: None,
            claimed_at: None,
            ended_at: Some(self.clock.now()),
            host: None,
        });
    }

    fn launch(&mut self, step: Step) -> Pending {
        let (client, ledger) = (self.client.clone(), self.ledger.clone());
        let claimant = self.claimant.clone();
        match step {
            Step::Begin => {
                let (lock, clock, once) = (self.lock.clone(), self.clock, self.plan.once);
                let telemetry = self.telemetry.clone();
                Box::pin(async move {
                    let result = async {
                        for (at, host, pid) in ledger.interrupt_stale(&client).await? {
                            telemetry.scheduled_run(RunView {
                                scheduled_for: at,
                                outcome: Some(ScheduledOutcome::Interrupted),
                                exit_code: None,
                                attempt: None,
                                claimed_at: None,
                                ended_at: Some(clock.now()),
                                host: host.clone(),
                            });
                            warn!(
                                event = "scheduled_run_interrupted",
                                occurrence = %rfc3339(at),
                                "the run of {} (by pgleader pid {} on {}) was interrupted: its leader lost the lock while it ran",
                                rfc3339(at),
                                pid.map_or("?".to_owned(), |pid| pid.to_string()),
                                host.as_deref().unwrap_or("?")
                            );
                        }
                        agree(&client, &ledger, &lock, &clock, once).await
                    }
                    .await;
                    Done::Began(result)
                })
            }
            Step::Claim(at) => {
                let (lock, clock, once) = (self.lock.clone(), self.clock, self.plan.once);
                let retries = i32::try_from(self.plan.retry_interrupted).unwrap_or(i32::MAX);
                Box::pin(async move {
                    let sent = Instant::now();
                    let result = async {
                        let verdict = agree(&client, &ledger, &lock, &clock, once).await?;
                        if let Verdict::Disagree { reason } = verdict {
                            return Ok(ClaimResult::Disagree(reason));
                        }
                        let claim = ledger.claim(&client, at, &claimant, retries).await?;
                        Ok(ClaimResult::Claim(claim, verdict))
                    }
                    .await;
                    let clock = match &result {
                        Ok(ClaimResult::Claim(Claim::Early { server_now }, _)) => {
                            ServerClock::sample(sent, Instant::now(), *server_now)
                        }
                        _ => clock,
                    };
                    Done::Claimed { at, result, clock }
                })
            }
            Step::Record {
                at,
                outcome,
                detail,
            } => Box::pin(async move {
                let result = ledger
                    .record(&client, at, outcome, &detail, &claimant)
                    .await;
                Done::Recorded {
                    at,
                    outcome,
                    detail,
                    result,
                }
            }),
            Step::Finish {
                at,
                outcome,
                exit_code,
            } => Box::pin(async move {
                let result = ledger
                    .finish(&client, at, claimant.epoch, outcome, exit_code, None)
                    .await;
                Done::Finished { at, result }
            }),
        }
    }

    fn on_done(&mut self, done: Done) -> Option<RunsEvent> {
        match done {
            Done::Began(Err(err))
            | Done::Claimed {
                result: Err(err), ..
            }
            | Done::Recorded {
                result: Err(err), ..
            }
            | Done::Finished {
                result: Err(err), ..
            } => Some(RunsEvent::Failed(err)),
            Done::Began(Ok(verdict)) => {
                if let Some(event) = self.note_verdict(verdict) {
                    return Some(event);
                }
                self.plan_first();
                None
            }
            Done::Claimed {
                at,
                result: Ok(result),
                clock,
            } => {
                self.clock = clock;
                let probing = std::mem::replace(&mut self.probing, false);
                let (claim, verdict) = match result {
                    ClaimResult::Disagree(reason) => return Some(RunsEvent::Disagree(reason)),
                    ClaimResult::Claim(claim, verdict) => (claim, verdict),
                };
                if let Some(event) = self.note_verdict(verdict) {
                    return Some(event);
                }
                self.on_claim(at, claim, probing)
            }
            Done::Recorded {
                at,
                outcome,
                detail,
                result: Ok(recorded),
            } => {
                if recorded {
                    self.publish(at, outcome, None);
                    warn!(event = "occurrence_not_run", occurrence = %rfc3339(at), outcome, reason = %detail, "the occurrence of {} was {outcome}: {detail}", rfc3339(at));
                } else {
                    debug!(event = "occurrence_not_run", occurrence = %rfc3339(at), outcome, "the occurrence of {} is already recorded", rfc3339(at));
                }
                None
            }
            Done::Finished {
                at,
                result: Ok(updated),
            } => {
                if !updated {
                    warn!(event = "ledger_conflict", occurrence = %rfc3339(at), "the ledger row of {} was no longer this leader's to update", rfc3339(at));
                }
                None
            }
        }
    }

    fn on_claim(&mut self, at: DateTime<Utc>, claim: Claim, probing: bool) -> Option<RunsEvent> {
        match claim {
            Claim::Claimed { attempt } => {
                self.early_until = None;
                self.running = Some(Run { at, attempt });
                self.telemetry.scheduled_run(RunView {
                    scheduled_for: at,
                    outcome: None,
                    exit_code: None,
                    attempt: Some(attempt),
                    claimed_at: Some(self.clock.now()),
                    ended_at: None,
                    host: Some(self.claimant.host.clone()),
                });
                self.due = self.after(at);
                let late = (self.clock.now() - at).to_std().unwrap_or(Duration::ZERO);
                info!(
                    event = "scheduled_run",
                    occurrence = %rfc3339(at),
                    attempt,
                    late_ms = late.as_millis() as u64,
                    "running the occurrence of {}{}",
                    rfc3339(at),
                    if attempt > 1 { format!(" again (attempt {attempt}, --retry-interrupted)") } else { String::new() }
                );
                Some(RunsEvent::Start {
                    occurrence: at,
                    attempt,
                })
            }
            Claim::Early { server_now } => {
                let ahead = (at - server_now).to_std().unwrap_or(Duration::ZERO);
                debug!(event = "early", occurrence = %rfc3339(at), "the server's clock has not reached the occurrence yet; waiting {} more", humantime::format_duration(ahead));
                self.early_until = Some(Instant::now() + ahead.max(Duration::from_millis(1)));
                self.due = Some(at);
                None
            }
            other => {
                let why = match &other {
                    Claim::Taken { outcome } if outcome == "interrupted" => {
                        "it was interrupted, and --retry-interrupted allows no more attempts"
                            .to_owned()
                    }
                    Claim::Taken { outcome } => format!("it is already claimed ({outcome})"),
                    _ => "a later occurrence is already recorded".to_owned(),
                };
                if self.plan.once {
                    info!(event = "occurrence_taken", occurrence = %rfc3339(at), "not running the occurrence of {}: {why}", rfc3339(at));
                    self.publish(at, "busy", None);
                    self.due = None;
                    return Some(RunsEvent::NothingToRun);
                }
                let interrupted =
                    matches!(&other, Claim::Taken { outcome } if outcome == "interrupted");
                if probing && !interrupted {
                    debug!(event = "occurrence_taken", occurrence = %rfc3339(at), "the occurrence of {} needs no catching up: {why}", rfc3339(at));
                } else {
                    info!(event = "occurrence_taken", occurrence = %rfc3339(at), "not running the occurrence of {}: {why}", rfc3339(at));
                }
                self.due = self.after(at);
                None
            }
        }
    }

    /// Logs what the agreement check found; a disagreement ends the runs.
    fn note_verdict(&mut self, verdict: Verdict) -> Option<RunsEvent> {
        match verdict {
            Verdict::Disagree { reason } => Some(RunsEvent::Disagree(reason)),
            Verdict::Adopt { change } => {
                warn!(event = "schedule_changed", lock = %self.lock, "{change}");
                None
            }
            Verdict::Agree {
                warning: Some(warning),
            } => {
                if self.warned.as_deref() != Some(warning.as_str()) {
                    warn!(event = "schedule_mismatch", lock = %self.lock, "{warning}");
                    self.warned = Some(warning);
                }
                None
            }
            Verdict::Agree { warning: None } | Verdict::Undecided { .. } => None,
        }
    }

    /// What a new leadership does first: catch up the latest occurrence if it may, or record
    /// it as missed; then wait for the next one (a timer: only its own).
    fn plan_first(&mut self) {
        let now = self.clock.now();
        let schedule = self.schedule();
        let latest = schedule.latest_at_or_before(now);
        let next = schedule.next_after(now);
        let age = |at: DateTime<Utc>| (now - at).to_std().unwrap_or(Duration::ZERO);
        let catch_up = self.plan.catch_up;
        if self.plan.once
            && let Some(next) = next
        {
            let ahead = (next - now).to_std().unwrap_or(Duration::ZERO);
            let half_gap = latest
                .and_then(|latest| (next - latest).to_std().ok())
                .or_else(|| schedule.gap_after(next))
                .map_or(EARLY_WINDOW, |gap| gap / 2);
            let nearer = latest.is_none_or(|latest| ahead < age(latest));
            if ahead <= EARLY_WINDOW.min(half_gap) && nearer {
                info!(event = "waiting_for_occurrence", occurrence = %rfc3339(next), "waiting {} for the occurrence of {} on the server's clock", fmt(ahead), rfc3339(next));
                self.due = Some(next);
                return;
            }
        }
        match latest {
            Some(latest) if age(latest) <= catch_up => {
                self.probing = !self.plan.once;
                self.due = Some(latest);
            }
            Some(latest) => {
                self.queue.push_back(Step::Record {
                    at: latest,
                    outcome: "missed",
                    detail: format!(
                        "no leader could run it until {} later, more than --catch-up {}",
                        fmt(age(latest)),
                        fmt(catch_up)
                    ),
                });
                self.due = if self.plan.once { None } else { next };
            }
            None => self.due = if self.plan.once { None } else { next },
        }
        if self.plan.once && self.due.is_none() {
            info!(event = "nothing_due", "no occurrence is due for this timer");
            self.closing = Some(RunsEvent::NothingToRun);
        } else if let Some(at) = self.due {
            debug!(event = "next_occurrence", occurrence = %rfc3339(at), "next occurrence: {}", rfc3339(at));
        }
    }
}

/// Checks the replicas' agreement on the schedule, on the leader's session.
async fn agree(
    client: &Client,
    ledger: &Ledger,
    lock: &LockKey,
    clock: &ServerClock,
    once: bool,
) -> Result<Verdict, LedgerError> {
    let newest = ledger.newest(client).await?;
    let live = agreement::participants(client, lock).await?;
    let schedule = ledger.schedule();
    let verdict = agreement::judge(
        schedule.expression(),
        schedule.timezone(),
        newest.as_ref(),
        &live,
        once,
    );
    let Verdict::Undecided { established } = &verdict else {
        return Ok(verdict);
    };
    let still_used = match Schedule::parse(&established.0, &established.1) {
        Ok(old) => match old.latest_at_or_before(clock.now()) {
            Some(at) => ledger.has(client, at).await?,
            None => false,
        },
        // A definition this version cannot read is not one any replica of it runs.
        Err(_) => false,
    };
    Ok(agreement::settle(
        schedule.expression(),
        schedule.timezone(),
        established,
        still_used,
    ))
}

fn fmt(duration: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(duration.as_millis() as u64))
}
