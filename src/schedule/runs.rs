//! One leadership's scheduled runs: when the next occurrence is due on the server's clock,
//! whether this leader may run it, and what became of it.
//!
//! The supervisor polls [`Runs::next`] in its event loop, next to its checks and signals, and
//! acts on what comes out: start the command for an occurrence, hand the lock over, exit. It
//! tells [`Runs`] when the command started and ended, and asks it to settle the ledger before
//! it releases the lock. Everything here happens through the backend's ledger on the leader's
//! own session (`election/ledger.rs`), one statement at a time, and every claim succeeds only
//! while that session leads. Each statement is bounded by the backend (a lock held on the
//! table, a synchronous standby away): the checks share the session and must not be held up
//! past their deadline. A statement that waited too long was rolled back ([`LedgerError::Busy`])
//! and is tried again a moment later, still leading.
//!
//! The rules, in order of time:
//!
//! - on winning: runs left `running` by earlier leaders are marked interrupted, the replicas'
//!   agreement on the schedule is checked, and the most recent occurrence is run if it is no
//!   older than `--catch-up` and nobody claimed it (recorded as `missed` if it is older);
//!   occurrences passed over before it are logged and recorded, never silently dropped;
//! - a service then waits for each next occurrence and runs it; one that comes while the
//!   previous run is still going is recorded as `skipped`; a leader held back (restart fence,
//!   `--takeover-delay`) or stalled runs the most recent occurrence when it can, and records
//!   the ones it passed over;
//! - a timer (`--once`) runs the occurrence it was started for (the most recent one, or one
//!   that is less than a minute away on the server's clock) and exits.
//!
//! Which occurrence runs when a leadership begins or wakes late, and how the ones passed over
//! are recorded, is `runs/catch_up.rs`.
//!
//! A job of a crontab or of scheduled shards claims its occurrence a moment ahead of it
//! ([`CLAIM_AHEAD`]) and starts its command at the instant: a thousand jobs due at once share
//! their replica's session, and their claims, sent at the instant, came back a few hundred
//! milliseconds after it. The claim lands once the server's clock has reached the lead (the
//! ledger refuses it earlier) and records the occurrence as its `claimed_at`; the command starts
//! when this host's mapping of the server's clock says the instant has come, plus half the
//! round trip of the sample it maps with, so never before it on the server's clock. A claim
//! whose command has not started yet is taken back when the job goes (a hand-over, a drain, a
//! loss: `settle`), and by the next holder when the claimant died (`interrupt_stale`, for an
//! occurrence still 100 ms away or more): the occurrence then runs on its next owner, on time.
//! Not for `--schedule` (one job, no burst) nor while a run goes on (`overlap=` decides at the
//! instant), nor under `jitter=`. A run asked by hand meanwhile waits for the claimed run to
//! start, and its `overlap=` decides then.

mod catch_up;

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use jiff::Timestamp;
use tokio::time::{Instant, Sleep, sleep_until};
use tracing::{debug, info, warn};

use crate::election::ledger::{
    Asked, AskedFinish, Claim, Claimant, LateFinish, Ledger, LedgerError,
};
use crate::election::lock::LockKey;
use crate::exit::ChildStatus;
use crate::schedule::agreement::{Agreement, Verdict, agree};
use crate::schedule::calendar::{Schedule, rfc3339};
use crate::schedule::clock::ServerClock;
use crate::schedule::crontab::Overlap;
use crate::schedule::{Plan, Publish, RunView, ScheduledOutcome};
use crate::time::for_people;

/// The most runs of one job that go at once under `overlap=allow`: an occurrence that comes
/// while as many run is skipped.
pub const MOST_AT_ONCE: usize = 4;

/// How long before its occurrence a crontab job's claim is sent, at most: it covers the claims
/// of a thousand jobs due at once, which came back up to about 300 ms after they were sent on
/// the benchmark's 2 cores. At most a quarter of the time to the occurrence after it.
pub const CLAIM_AHEAD: Duration = Duration::from_millis(500);

/// What the supervisor is to do.
#[derive(Debug)]
pub enum RunsEvent {
    /// Start the command for this occurrence (`attempt` > 1 for a retried interrupted run);
    /// or, with `asked`, for a run asked by hand (`pgleader cron run`), `occurrence` being
    /// when it was asked.
    Start {
        occurrence: Timestamp,
        attempt: i32,
        asked: Option<Asked>,
    },
    /// `--once`: the run is over and recorded; exit with the command's status.
    Done,
    /// `--once`: there is nothing for this timer to run (claimed elsewhere, or nothing due);
    /// exit with `--busy-exit-code`.
    NothingToRun,
    /// The replicas disagree on the schedule and this one must not run its version.
    Disagree(String),
    /// `overlap=replace`: the occurrence `occurrence` has come (or, `asked`, a run asked by
    /// hand then) while the previous run still goes; stop that run ([`Runs::exited`] then
    /// records it as interrupted and starts this one).
    Replace { occurrence: Timestamp, asked: bool },
    /// A ledger statement failed for good (`Fatal`) or the session is in trouble (`Query`).
    Failed(LedgerError),
}

/// The occurrence a command runs for.
#[derive(Clone, Copy, Debug)]
struct Run {
    at: Timestamp,
    attempt: i32,
    /// Whether the command was started (a claim can be followed by a refusal to start).
    started: bool,
    /// A run asked by hand: its request's number (`at` is when it was asked).
    asked: Option<i64>,
}

impl Run {
    /// How the log and the ledger name it: "the run of OCCURRENCE", or "the run asked by hand
    /// (request N)".
    fn describe(&self) -> String {
        match self.asked {
            Some(id) => format!("the run asked by hand (request {id})"),
            None => format!("the run of {}", rfc3339(self.at)),
        }
    }

    /// The run of a claimed occurrence.
    fn of(at: Timestamp, attempt: i32) -> Run {
        Run {
            at,
            attempt,
            started: false,
            asked: None,
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Begin,
    Claim(Timestamp),
    Record {
        at: Timestamp,
        outcome: &'static str,
        detail: String,
    },
    Finish(LateFinish),
    /// Takes the oldest run asked by hand; `skip` says why it is recorded as skipped instead
    /// (filled in as the statement is sent, from the runs going on then).
    TakeAsked {
        skip: Option<String>,
    },
    FinishAsked(AskedFinish),
}

enum Done {
    Began(Result<Began, LedgerError>),
    Claimed(Result<(ClaimResult, Option<ServerClock>), LedgerError>),
    Recorded(Result<bool, LedgerError>),
    Finished(Result<bool, LedgerError>),
    Taken(Result<Option<Asked>, LedgerError>),
}

struct Began {
    agreement: Agreement,
    /// The newest occurrence the ledger records for the lock.
    newest: Option<Timestamp>,
}

enum ClaimResult {
    Disagree(String),
    Claim(Claim, Agreement),
}

type Pending = Pin<Box<dyn Future<Output = Done>>>;

/// The scheduled runs of one leadership.
pub struct Runs<L: Ledger> {
    plan: Plan,
    ledger: L,
    lock: LockKey,
    claimant: Claimant,
    clock: ServerClock,
    /// The fingerprint of this replica's ledger table.
    own_ledger: String,
    /// No claim before this (the restart fence and --takeover-delay).
    not_before: Instant,
    op: Option<(Step, Pending)>,
    queue: VecDeque<Step>,
    /// The head of the queue waits until then: its statement timed out.
    paused_until: Option<Instant>,
    due: Option<Timestamp>,
    /// The claim of `due` waits until then: the server said it was early.
    early_until: Option<Instant>,
    running: Option<Run>,
    /// `overlap=allow`: earlier runs still going beside `running`.
    aside: Vec<Run>,
    /// `overlap=replace`: the running command is being stopped for this occurrence.
    replacing: Option<Timestamp>,
    /// `overlap=replace`: the run asked by hand that starts once the running command is gone.
    replacing_for: Option<(Run, Asked)>,
    /// Whether the job takes runs asked by hand (a crontab's).
    takes_asked: bool,
    /// Said at the next poll.
    ask: Option<RunsEvent>,
    /// The last lines of the run going on, once it was stopped with its job (`--keep-output`),
    /// for its row as interrupted.
    stopped_output: Option<String>,
    /// How the last run ended, until the ledger has it.
    finishing: Option<LateFinish>,
    /// Emitted once the queue has drained.
    closing: Option<RunsEvent>,
    /// The first claim of a service's leadership only probes the latest occurrence: that it
    /// was already run is no news.
    probing: bool,
    warned: Option<String>,
    /// When a replica recording the lock's runs in another ledger table was last seen.
    foreign_ledger_seen: Option<Instant>,
    /// Where runs and outcomes are published for the HTTP endpoint.
    publish: Publish,
    /// What [`Runs::poll_next`] waits on: the next occurrence, or the end of a pause.
    timer: Pin<Box<Sleep>>,
    /// A claim made ahead of its occurrence, whose command starts at this instant.
    holding: Option<Pin<Box<Sleep>>>,
    /// The lead of the claim of an occurrence ([`Runs::ahead_of`]), as last worked out.
    ahead: std::cell::Cell<Option<(Timestamp, Duration)>>,
}

impl<L: Ledger> std::fmt::Debug for Runs<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runs")
            .field("due", &self.due)
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

/// Where a leadership's runs start from.
#[derive(Debug)]
pub struct Start {
    pub claimant: Claimant,
    /// A sample of the server's clock taken on the session.
    pub clock: ServerClock,
    /// When the command may start at the earliest.
    pub not_before: Instant,
    /// This replica's ledger table, as [`super::prepare`] fingerprinted it.
    pub own_ledger: String,
    /// When this replica last saw another ledger table in use for the lock.
    pub foreign_ledger_seen: Option<Instant>,
    /// Where runs and outcomes are published for the HTTP endpoint.
    pub publish: Publish,
    /// Whether the job takes runs asked by hand (`pgleader cron run`): a crontab's.
    pub takes_asked: bool,
}

impl<L: Ledger> Runs<L> {
    /// The runs of a leadership that has just begun.
    pub fn new(plan: Plan, lock: LockKey, ledger: L, start: Start) -> Runs<L> {
        let offset = start.clock.host_offset_seconds();
        if offset.abs() >= 1.0 {
            info!(
                event = "clock_offset",
                job = plan.job.as_deref(),
                offset_seconds = format!("{offset:+.3}"),
                "this host's clock is {:.3} s {} the database server's; the schedule follows the server's clock",
                offset.abs(),
                if offset > 0.0 { "ahead of" } else { "behind" }
            );
        }
        Runs {
            plan,
            ledger,
            lock,
            claimant: start.claimant,
            clock: start.clock,
            own_ledger: start.own_ledger,
            not_before: start.not_before,
            op: None,
            queue: VecDeque::from([Step::Begin]),
            paused_until: None,
            due: None,
            early_until: None,
            running: None,
            aside: Vec::new(),
            replacing: None,
            replacing_for: None,
            takes_asked: start.takes_asked,
            ask: None,
            finishing: None,
            stopped_output: None,
            closing: None,
            probing: false,
            warned: None,
            foreign_ledger_seen: start.foreign_ledger_seen,
            publish: start.publish,
            timer: Box::pin(sleep_until(Instant::now())),
            holding: None,
            ahead: std::cell::Cell::new(None),
        }
    }

    /// A check's sample of the server's clock: the query was sent at `sent`, its answer came
    /// at `received`, and the server's clock said `server`.
    pub fn observe_check(&mut self, sent: Instant, received: Instant, server: Timestamp) {
        self.observe_clock(ServerClock::sample(sent, received, server));
    }

    fn observe_clock(&mut self, clock: ServerClock) {
        if clock.is_newer_than(&self.clock) {
            self.clock = clock;
        }
    }

    /// Someone asked for a run by hand (`pgleader cron run`): the oldest request is taken
    /// once the statements queued before are through.
    pub fn asked(&mut self) {
        let queued = self
            .queue
            .iter()
            .any(|step| matches!(step, Step::TakeAsked { .. }));
        if self.takes_asked && !queued {
            self.queue.push_back(Step::TakeAsked { skip: None });
        }
    }

    /// The command for the claimed occurrence started.
    pub fn started(&mut self) {
        if let Some(run) = &mut self.running {
            run.started = true;
            if run.asked.is_some() {
                return;
            }
            self.publish.run(RunView {
                scheduled_for: run.at,
                outcome: None,
                exit_code: None,
                attempt: Some(run.attempt),
                claimed_at: Some(self.clock.now()),
                ended_at: None,
                host: Some(self.claimant.host.clone()),
                delay: self.plan.delay_of(run.at),
            });
        }
    }

    /// Publishes an outcome this leader decided for the occurrence of `at` (each is counted
    /// once, here, whenever the ledger gets it).
    fn publish(&self, at: Timestamp, outcome: &str, exit_code: Option<i32>) {
        self.publish.run(RunView {
            scheduled_for: at,
            outcome: ScheduledOutcome::from_ledger(outcome),
            exit_code,
            attempt: None,
            claimed_at: None,
            ended_at: Some(self.clock.now()),
            host: None,
            delay: Duration::ZERO,
        });
    }

    /// The occurrence the running command was started for.
    pub fn running_occurrence(&self) -> Option<Timestamp> {
        self.running.map(|run| run.at)
    }

    /// The next occurrence this leader waits for.
    pub fn next_occurrence(&self) -> Option<Timestamp> {
        self.due
    }

    /// When the next occurrence's claim is to be sent, on this host's clock, if one waits.
    pub fn due_at(&self) -> Option<Instant> {
        let due = self.due.filter(|_| self.replacing.is_none())?;
        Some(self.wake_for(due))
    }

    /// How the last run ended, if the ledger does not have it yet: the supervisor keeps it
    /// for its next session when the leadership ends first.
    pub fn unrecorded(&self) -> Option<LateFinish> {
        self.finishing.clone()
    }

    /// When this leadership last saw a replica that records the lock's runs elsewhere.
    pub fn foreign_ledger_seen(&self) -> Option<Instant> {
        self.foreign_ledger_seen
    }

    /// The next thing for the supervisor to do. Cancel-safe: a statement in flight stays in
    /// flight when the future is dropped, and nothing is lost between its answer and the
    /// event it leads to.
    pub async fn next(&mut self) -> RunsEvent {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// [`Runs::next`] as a poll, so that a table of many runs (a crontab's jobs) can wait on
    /// them all at once: the statement in flight and the timer live in `self`, so a poll that
    /// returns pending keeps its wake-up.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<RunsEvent> {
        loop {
            // Before the statement in flight: a claimed occurrence starts at its instant.
            if let Some(hold) = self.holding.as_mut()
                && hold.as_mut().poll(cx).is_ready()
            {
                self.holding = None;
                if let Some(event) = self.start_claimed() {
                    return Poll::Ready(event);
                }
            }
            if let Some((_, op)) = self.op.as_mut() {
                let done = ready!(op.as_mut().poll(cx));
                let (step, _) = self.op.take().expect("the statement in flight");
                if let Some(event) = self.on_done(step, done) {
                    return Poll::Ready(event);
                }
                continue;
            }
            // overlap=replace: the run asked by hand starts once the one it replaces is gone.
            if self.running.is_none()
                && let Some((run, asked)) = self.replacing_for.take()
            {
                self.running = Some(run);
                return Poll::Ready(RunsEvent::Start {
                    occurrence: run.at,
                    attempt: 1,
                    asked: Some(asked),
                });
            }
            let paused = self.paused_until.filter(|until| *until > Instant::now());
            // A run asked by hand meets the claimed occurrence's run once it started: its
            // overlap= then decides as for any run going on (the hold's timer wakes this).
            let asked_waits = self.holding.is_some()
                && matches!(self.queue.front(), Some(Step::TakeAsked { .. }));
            if paused.is_none()
                && !asked_waits
                && let Some(step) = self.queue.pop_front()
            {
                // A claim queued while nothing ran, now beside a run asked by hand taken
                // since: the job's overlap= decides, as for an occurrence due beside a run.
                if let Step::Claim(at) = step
                    && self.running.is_some()
                {
                    self.on_due(at);
                    continue;
                }
                let step = self.prepared(step);
                let pending = self.launch(step.clone());
                self.op = Some((step, pending));
                continue;
            }
            if self.queue.is_empty()
                && let Some(event) = self.closing.take()
            {
                return Poll::Ready(event);
            }
            if let Some(event) = self.ask.take() {
                return Poll::Ready(event);
            }
            // While a run is being replaced, its successor waits for it to be gone.
            let due = self
                .due
                .filter(|_| self.replacing.is_none())
                .map(|at| (at, self.wake_for(at)));
            let wake = match (paused, due) {
                (None, None) => return Poll::Pending,
                (Some(pause), Some((_, due))) => pause.min(due),
                (Some(pause), None) => pause,
                (None, Some((_, due))) => due,
            };
            if self.timer.deadline() != wake {
                self.timer.as_mut().reset(wake);
            }
            ready!(self.timer.as_mut().poll(cx));
            if let Some((at, due)) = due
                && due <= Instant::now()
            {
                self.on_due(at);
            }
        }
    }

    /// When to act on the occurrence `at`: its claim goes out [`Runs::ahead_of`] it.
    fn wake_for(&self, at: Timestamp) -> Instant {
        // jitter=: the occurrence's start is put off, the same on every replica.
        let mut wake = self.clock.instant_of(at) + self.plan.delay_of(at);
        if self.running.is_none() {
            wake = wake.checked_sub(self.ahead_of(at)).unwrap_or(wake);
            wake = wake.max(self.not_before);
            if let Some(until) = self.early_until {
                wake = wake.max(until);
            }
        }
        wake
    }

    /// How long before the occurrence of `at` its claim may land: [`CLAIM_AHEAD`], at most a
    /// quarter of the time to the occurrence after it; nothing for `--schedule`, for a timer,
    /// under `jitter=` (the occurrences are spread already), or while a run goes on (whether
    /// the occurrence runs beside it is decided at the instant).
    fn ahead_of(&self, at: Timestamp) -> Duration {
        if self.plan.job.is_none() || self.plan.once || self.running.is_some() {
            return Duration::ZERO;
        }
        if let Some((known, ahead)) = self.ahead.get()
            && known == at
        {
            return ahead;
        }
        let gap = self
            .schedule()
            .next_after(at)
            .and_then(|next| Duration::try_from(next.duration_since(at)).ok());
        let ahead = match gap {
            Some(gap) if self.plan.delay_of(at).is_zero() => CLAIM_AHEAD.min(gap / 4),
            _ => Duration::ZERO,
        };
        self.ahead.set(Some((at, ahead)));
        ahead
    }

    /// The claimed run starts: its command, now that its instant has come.
    fn start_claimed(&mut self) -> Option<RunsEvent> {
        let run = self
            .running
            .filter(|run| !run.started && run.asked.is_none())?;
        let at = run.at;
        // From the start jitter= put it off to.
        let late = crate::time::elapsed(self.start_of(at), self.clock.now());
        info!(
            event = "scheduled_run", job = self.plan.job.as_deref(),
            occurrence = %rfc3339(at),
            attempt = run.attempt,
            late_ms = late.as_millis() as u64,
            "running the occurrence of {}{}",
            rfc3339(at),
            if run.attempt > 1 { format!(" again (attempt {}, --retry-interrupted)", run.attempt) } else { String::new() }
        );
        Some(RunsEvent::Start {
            occurrence: at,
            attempt: run.attempt,
            asked: None,
        })
    }

    /// The last lines of the run going on, which its job's stop ended: recorded with it as
    /// interrupted when [`Runs::settle`] follows.
    pub fn stopped_with(&mut self, output: Option<String>) {
        self.stopped_output = output;
    }

    /// The command of the run of `at` (`asked`: the run asked by hand of that number) ended
    /// on its own (`overlap=allow`: one of several): record how, with the last lines it
    /// printed (`output`) if they were kept.
    pub fn exited_at(
        &mut self,
        at: Timestamp,
        asked: Option<i64>,
        status: ChildStatus,
        output: Option<String>,
    ) {
        let this = |run: &Run| run.at == at && run.asked == asked;
        if self.running.as_ref().is_some_and(this) {
            self.running_exited(status, output);
        } else if let Some(aside) = self.aside.iter().position(this) {
            let run = self.aside.remove(aside);
            self.record_exit(run, status, output);
        } else {
            debug!(event = "run_unknown", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "a run of {} ended that these runs do not know (already recorded)", rfc3339(at));
        }
    }

    /// The command ended on its own: record how.
    pub fn exited(&mut self, status: ChildStatus) {
        self.running_exited(status, None);
    }

    /// The run going on ended on its own: record how, with its `output`.
    fn running_exited(&mut self, status: ChildStatus, output: Option<String>) {
        if let Some(run) = self.running.take() {
            self.record_exit(run, status, output);
        }
    }

    /// Records how `run` ended, with the last lines it printed (`output`) if they were kept.
    fn record_exit(&mut self, run: Run, status: ChildStatus, output: Option<String>) {
        let succeeded = status == ChildStatus::Exited(0);
        if let Some(id) = run.asked {
            // overlap=replace: stopped for another run, asked by hand or an occurrence.
            let replaced = self.replacing.take().map(|by| match &self.replacing_for {
                Some(_) => "replaced by a run asked by hand (overlap=replace)".to_owned(),
                None => format!(
                    "replaced by the occurrence of {} (overlap=replace)",
                    rfc3339(by)
                ),
            });
            let outcome = match &replaced {
                Some(_) => "interrupted",
                None if succeeded => "succeeded",
                None => "failed",
            };
            info!(event = "asked_run_finished", job = self.plan.job.as_deref(), request = id, outcome, status = %status, exit_code = status.exit_code(), "the run asked by hand (request {id}) {outcome} ({status})");
            self.queue.push_back(Step::FinishAsked(AskedFinish {
                id,
                epoch: self.claimant.epoch,
                outcome,
                exit_code: Some(i32::from(status.exit_code())),
                detail: replaced,
                output,
            }));
            return;
        }
        let replaced = self.replacing.take();
        let outcome = match replaced {
            Some(_) => "interrupted",
            None if succeeded => "succeeded",
            None => "failed",
        };
        let next = self.due.filter(|_| !self.plan.once).map(rfc3339);
        let next = next.as_deref().unwrap_or("none");
        let at = rfc3339(run.at);
        if let Some(by) = replaced {
            let by = match &self.replacing_for {
                Some((_, asked)) => format!("a run asked by hand by {}", asked.asked_by),
                None => format!("the occurrence of {}", rfc3339(by)),
            };
            warn!(event = "scheduled_run_interrupted", job = self.plan.job.as_deref(), occurrence = %at, attempt = run.attempt, outcome, status = %status, next, "the run of {at} was replaced by {by} (overlap=replace)");
        } else if succeeded {
            info!(event = "scheduled_run_finished", job = self.plan.job.as_deref(), occurrence = %at, attempt = run.attempt, outcome, exit_code = status.exit_code(), next, "the run of {at} succeeded");
        } else {
            warn!(event = "scheduled_run_finished", job = self.plan.job.as_deref(), occurrence = %at, attempt = run.attempt, outcome, status = %status, exit_code = status.exit_code(), next, "the run of {at} failed ({status})");
        }
        let finish = LateFinish {
            at: run.at,
            epoch: self.claimant.epoch,
            attempt: run.attempt,
            outcome,
            exit_code: Some(i32::from(status.exit_code())),
            ended_at: self.clock.now(),
            output,
        };
        self.publish(run.at, outcome, finish.exit_code);
        self.finishing = Some(finish.clone());
        self.queue.push_back(Step::Finish(finish));
        if self.plan.once {
            self.due = None;
            self.closing = Some(RunsEvent::Done);
        }
    }

    /// Brings the ledger up to date before the lock is released (shutdown, a handover, an
    /// error): the statement in flight is awaited (a claim that went through but whose command
    /// never started is taken back), outcomes still queued are recorded, and a run the
    /// supervisor stopped (`stopped`: the command's status, and why) is recorded as
    /// interrupted. Bounded by `timeout`; what does not make it is left to the next leader.
    pub async fn settle(
        &mut self,
        stopped: Option<(Option<ChildStatus>, &str)>,
        timeout: Duration,
    ) {
        // A claimed run waiting for its instant never started: its claim is taken back below.
        self.holding = None;
        let work = async {
            if let Some((step, op)) = self.op.take() {
                let done = op.await;
                match (step, done) {
                    (
                        Step::Claim(at),
                        Done::Claimed(Ok((ClaimResult::Claim(Claim::Claimed { attempt }, _), _))),
                    ) => {
                        self.running = Some(Run::of(at, attempt));
                    }
                    (Step::Finish(_), Done::Finished(Ok(true))) => self.finishing = None,
                    // Taken, never started: recorded as interrupted below.
                    (Step::TakeAsked { skip: None }, Done::Taken(Ok(Some(asked)))) => {
                        self.aside.push(Run {
                            asked: Some(asked.id),
                            ..Run::of(asked.asked_at, 1)
                        });
                    }
                    _ => {}
                }
            }
            for step in std::mem::take(&mut self.queue) {
                match step {
                    Step::Finish(finish) => {
                        let done = self.ledger.finish(&finish, None).await;
                        if matches!(done, Ok(true)) {
                            self.finishing = None;
                        }
                    }
                    Step::Record {
                        at,
                        outcome,
                        detail,
                    } => {
                        let recorded = self
                            .ledger
                            .record(at, outcome, &detail, &self.claimant)
                            .await;
                        if matches!(recorded, Ok(true)) {
                            self.publish(at, outcome, None);
                        }
                    }
                    Step::FinishAsked(finish) => {
                        let _ = self.ledger.finish_asked(&finish).await;
                    }
                    Step::Begin | Step::Claim(_) | Step::TakeAsked { .. } => {}
                }
            }
            if let Some((run, _)) = self.replacing_for.take() {
                self.aside.push(run);
            }
            // Runs still going aside (`overlap=allow`) were stopped too.
            for run in std::mem::take(&mut self.aside) {
                self.record_interrupted(run, stopped, None).await;
            }
            if let Some(run) = self.running.take() {
                let output = self.stopped_output.take();
                self.record_interrupted(run, stopped, output).await;
            }
        };
        if tokio::time::timeout(timeout, work).await.is_err() {
            warn!(
                event = "ledger_failed",
                job = self.plan.job.as_deref(),
                "no answer while settling the ledger; the next leader will record what is missing"
            );
        }
    }

    /// Records a run that was stopped as interrupted (`stopped`: its command's status, and
    /// why), or takes its claim back when its command never started.
    async fn record_interrupted(
        &mut self,
        run: Run,
        stopped: Option<(Option<ChildStatus>, &str)>,
        output: Option<String>,
    ) {
        if let Some(id) = run.asked {
            let why = match stopped {
                _ if !run.started => "its replica stopped before starting it",
                Some((_, why)) => why,
                None => "its leader stepped down",
            };
            warn!(
                event = "asked_run_interrupted",
                job = self.plan.job.as_deref(),
                request = id,
                reason = why,
                "the run asked by hand (request {id}) was interrupted: {why}"
            );
            let finish = AskedFinish {
                id,
                epoch: self.claimant.epoch,
                outcome: "interrupted",
                exit_code: stopped
                    .and_then(|(status, _)| status)
                    .filter(|_| run.started)
                    .map(|status| i32::from(status.exit_code())),
                detail: Some(why.to_owned()),
                output,
            };
            if let Err(err) = self.ledger.finish_asked(&finish).await {
                warn!(event = "ledger_failed", job = self.plan.job.as_deref(), reason = %err, "cannot record the interrupted run asked by hand; the job's next owner will");
            }
            return;
        }
        let at = rfc3339(run.at);
        if !run.started {
            debug!(event = "unclaimed", job = self.plan.job.as_deref(), occurrence = %at, "taking back the claim of {at}: its command never started");
            let _ = self.ledger.unclaim(run.at, self.claimant.epoch).await;
            return;
        }
        let (status, why) = stopped.unwrap_or((None, "its leader stepped down"));
        warn!(event = "scheduled_run_interrupted", job = self.plan.job.as_deref(), occurrence = %at, reason = why, "the run of {at} was interrupted: {why}");
        let finish = LateFinish {
            at: run.at,
            epoch: self.claimant.epoch,
            attempt: run.attempt,
            outcome: "interrupted",
            exit_code: status.map(|status| i32::from(status.exit_code())),
            ended_at: self.clock.now(),
            output,
        };
        match self.ledger.finish(&finish, Some(why)).await {
            Ok(_) => self.publish(run.at, finish.outcome, finish.exit_code),
            Err(err) => {
                warn!(event = "ledger_failed", job = self.plan.job.as_deref(), reason = %err, "cannot record the interrupted run; the next leader will")
            }
        }
    }

    fn schedule(&self) -> &Schedule {
        &self.plan.schedule
    }

    fn launch(&mut self, step: Step) -> Pending {
        let ledger = self.ledger.clone();
        let claimant = self.claimant.clone();
        let (clock, once) = (self.clock, self.plan.once);
        let own_ledger = self.own_ledger.clone();
        match step {
            Step::Begin => {
                let publish = self.publish.clone();
                let schedule = self.plan.schedule.clone();
                let job = self.plan.job.clone();
                let (catch_up_new, definition) = (self.plan.catch_up_new, self.plan.definition());
                let takes_asked = self.takes_asked;
                Box::pin(async move {
                    let result = async {
                        if takes_asked {
                            let stale = ledger.interrupt_stale_asked().await?;
                            if stale > 0 {
                                warn!(event = "asked_run_interrupted", job = job.as_deref(), runs = stale, "{stale} run(s) asked by hand were interrupted: the job's previous owner lost it while they ran");
                            }
                        }
                        for (at, host, pid) in ledger.interrupt_stale().await? {
                            publish.run(RunView {
                                scheduled_for: at,
                                outcome: Some(ScheduledOutcome::Interrupted),
                                exit_code: None,
                                attempt: None,
                                claimed_at: None,
                                ended_at: Some(clock.now()),
                                host: host.clone(),
                                delay: Duration::ZERO,
                            });
                            warn!(
                                event = "scheduled_run_interrupted", job = job.as_deref(),
                                occurrence = %rfc3339(at),
                                "the run of {} (by pgleader pid {} on {}) was interrupted: its leader lost the lock while it ran",
                                rfc3339(at),
                                pid.map_or("?".to_owned(), |pid| pid.to_string()),
                                host.as_deref().unwrap_or("?")
                            );
                        }
                        let newest = ledger.recent(1).await?.into_iter().next();
                        // Under another definition (a rescheduled crontab job), the fleet never
                        // knew this one: nothing of it was missed.
                        let newest = newest
                            .filter(|entry| catch_up_new || definition.is_of(entry))
                            .map(|entry| entry.scheduled_for);
                        let agreement = agree(&ledger, &schedule, &clock, once, &own_ledger).await?;
                        Ok(Began { agreement, newest })
                    }
                    .await;
                    Done::Began(result)
                })
            }
            Step::Claim(at) => {
                let retries = i32::try_from(self.plan.retry_interrupted).unwrap_or(i32::MAX);
                let ahead = self.ahead_of(at);
                let schedule = self.plan.schedule.clone();
                // A crontab job is checked once, as its ownership begins: nobody holds or waits
                // for a job's key (no live replica can speak for another definition), and only
                // its owner writes its rows, so nothing the check reads can change while it
                // owns the job. Before each claim it cost a round trip on the session that
                // every one of a second's claims shares.
                let checked = self.plan.job.is_some();
                Box::pin(async move {
                    let result = async {
                        let agreement = if checked {
                            Agreement::settled()
                        } else {
                            agree(&ledger, &schedule, &clock, once, &own_ledger).await?
                        };
                        if let Verdict::Disagree { reason } = agreement.verdict {
                            return Ok((ClaimResult::Disagree(reason), None));
                        }
                        let sent = Instant::now();
                        let claim = ledger.claim(at, ahead, &claimant, retries).await?;
                        let sample = match &claim {
                            Claim::Early { server_now } => {
                                Some(ServerClock::sample(sent, Instant::now(), *server_now))
                            }
                            _ => None,
                        };
                        Ok((ClaimResult::Claim(claim, agreement), sample))
                    }
                    .await;
                    Done::Claimed(result)
                })
            }
            Step::Record {
                at,
                outcome,
                detail,
            } => Box::pin(async move {
                Done::Recorded(ledger.record(at, outcome, &detail, &claimant).await)
            }),
            Step::Finish(finish) => {
                Box::pin(async move { Done::Finished(ledger.finish(&finish, None).await) })
            }
            Step::TakeAsked { skip } => {
                Box::pin(
                    async move { Done::Taken(ledger.take_asked(&claimant, skip.as_deref()).await) },
                )
            }
            Step::FinishAsked(finish) => {
                Box::pin(async move { Done::Finished(ledger.finish_asked(&finish).await) })
            }
        }
    }

    /// `step` as it is sent: a run asked by hand is skipped when the job's `overlap=` refuses
    /// another run beside those going on now.
    fn prepared(&self, step: Step) -> Step {
        let Step::TakeAsked { .. } = step else {
            return step;
        };
        let going = self.running.map(|run| run.describe());
        let replacing = self.replacing.is_some() || self.replacing_for.is_some();
        let skip = match (self.plan.overlap, going) {
            (Overlap::Skip, Some(going)) => Some(format!("{going} was still going (overlap=skip)")),
            (Overlap::Allow, Some(_)) if self.aside.len() + 1 >= MOST_AT_ONCE => Some(format!(
                "{MOST_AT_ONCE} runs of the job were going, the most overlap=allow starts"
            )),
            (Overlap::Replace, _) if replacing => {
                Some("a run going on was being replaced already (overlap=replace)".to_owned())
            }
            _ => None,
        };
        Step::TakeAsked { skip }
    }

    fn on_done(&mut self, step: Step, done: Done) -> Option<RunsEvent> {
        let failed = match &done {
            Done::Began(Err(err))
            | Done::Claimed(Err(err))
            | Done::Recorded(Err(err))
            | Done::Finished(Err(err))
            | Done::Taken(Err(err)) => Some(err),
            _ => None,
        };
        if let Some(LedgerError::Busy(reason)) = failed {
            // Rolled back: the same statement again, a moment later.
            let retry = self.plan.busy_retry.max(Duration::from_millis(100));
            warn!(event = "ledger_busy", job = self.plan.job.as_deref(), reason = %reason, "a ledger statement waited too long and was rolled back; trying again in {}", for_people(retry));
            self.queue.push_front(step);
            self.paused_until = Some(Instant::now() + retry);
            return None;
        }
        match done {
            Done::Began(Err(err))
            | Done::Claimed(Err(err))
            | Done::Recorded(Err(err))
            | Done::Finished(Err(err))
            | Done::Taken(Err(err)) => Some(RunsEvent::Failed(err)),
            Done::Taken(Ok(None)) => None,
            Done::Taken(Ok(Some(asked))) => {
                let Step::TakeAsked { skip } = step else {
                    return None;
                };
                self.on_taken(asked, skip)
            }
            Done::Began(Ok(began)) => {
                if let Some(event) = self.note_agreement(began.agreement) {
                    return Some(event);
                }
                self.plan_first(began.newest);
                // Runs asked by hand before this owner took the job.
                self.asked();
                None
            }
            Done::Claimed(Ok((result, sample))) => {
                if let Some(sample) = sample {
                    self.observe_clock(sample);
                }
                let Step::Claim(at) = step else {
                    return None;
                };
                let probing = std::mem::replace(&mut self.probing, false);
                let (claim, agreement) = match result {
                    ClaimResult::Disagree(reason) => return Some(RunsEvent::Disagree(reason)),
                    ClaimResult::Claim(claim, agreement) => (claim, agreement),
                };
                if let Some(event) = self.note_agreement(agreement) {
                    return Some(event);
                }
                self.on_claim(at, claim, probing)
            }
            Done::Recorded(Ok(recorded)) => {
                if let Step::Record {
                    at,
                    outcome,
                    detail,
                } = step
                {
                    if recorded {
                        self.publish(at, outcome, None);
                        warn!(event = "occurrence_not_run", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), outcome, reason = %detail, "the occurrence of {} was {outcome}: {detail}", rfc3339(at));
                    } else {
                        debug!(event = "occurrence_not_run", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), outcome, "the occurrence of {} is already recorded", rfc3339(at));
                    }
                }
                None
            }
            // A run asked by hand's end (`FinishAsked`) leaves the occurrence run's alone.
            Done::Finished(Ok(updated)) => {
                if let Step::Finish(finish) = step {
                    self.finishing = None;
                    if !updated {
                        warn!(event = "ledger_conflict", job = self.plan.job.as_deref(), occurrence = %rfc3339(finish.at), "the ledger row of {} was no longer this leader's to update", rfc3339(finish.at));
                    }
                }
                None
            }
        }
    }

    fn on_claim(&mut self, at: Timestamp, claim: Claim, probing: bool) -> Option<RunsEvent> {
        match claim {
            Claim::Claimed { attempt } => {
                self.early_until = None;
                self.running = Some(Run::of(at, attempt));
                self.due = self.after(at);
                // Claimed ahead: the command starts at the instant, and not before it on the
                // server's clock (the mapping is right to within half its round trip).
                let start = self.clock.instant_of(self.start_of(at)) + self.clock.round_trip() / 2;
                if start > Instant::now() {
                    self.holding = Some(Box::pin(sleep_until(start)));
                    return None;
                }
                self.start_claimed()
            }
            Claim::Early { server_now } => {
                let from = at
                    .checked_sub(
                        jiff::SignedDuration::try_from(self.ahead_of(at)).unwrap_or_default(),
                    )
                    .unwrap_or(at);
                let ahead = crate::time::elapsed(server_now, from);
                debug!(event = "early", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "the server's clock has not reached the occurrence yet; waiting {} more", for_people(ahead));
                self.early_until = Some(Instant::now() + ahead.max(Duration::from_millis(1)));
                self.due = Some(at);
                None
            }
            Claim::Paused { detail } => {
                // Once per pause in the log, not at every occurrence of an every-second job.
                let text = format!(
                    "job paused: its occurrences are recorded as paused ({detail}) until pgleader cron resume"
                );
                if self.warned.as_deref() != Some(text.as_str()) {
                    info!(event = "job_paused", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "not running the occurrence of {}: {text}", rfc3339(at));
                    self.warned = Some(text);
                }
                self.publish(at, "paused", None);
                self.due = self.after(at);
                None
            }
            Claim::NotLeader => {
                warn!(event = "ledger_conflict", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "the claim of {} was refused: this session no longer holds the lock", rfc3339(at));
                Some(RunsEvent::Failed(LedgerError::Query(
                    "the ledger refused a claim: this session no longer holds the lock".to_owned(),
                )))
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
                let interrupted =
                    matches!(&other, Claim::Taken { outcome } if outcome == "interrupted");
                if self.plan.once {
                    info!(event = "occurrence_taken", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "not running the occurrence of {}: {why}", rfc3339(at));
                    self.publish(at, "busy", None);
                    self.due = None;
                    return Some(RunsEvent::NothingToRun);
                }
                if probing && !interrupted {
                    debug!(event = "occurrence_taken", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "the occurrence of {} needs no catching up: {why}", rfc3339(at));
                } else {
                    info!(event = "occurrence_taken", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "not running the occurrence of {}: {why}", rfc3339(at));
                }
                self.due = self.after(at);
                None
            }
        }
    }

    /// A run asked by hand was taken (`skip`: recorded as skipped instead): it starts now,
    /// beside the runs going on (`overlap=allow`) or once the one going on is stopped
    /// (`overlap=replace`). The next request, if any, is taken after it.
    fn on_taken(&mut self, asked: Asked, skip: Option<String>) -> Option<RunsEvent> {
        self.asked();
        let job = self.plan.job.as_deref();
        if let Some(why) = skip {
            info!(event = "asked_run_skipped", job, request = asked.id, asked_by = %asked.asked_by, "not running the run asked by hand by {} (request {}): {why}", asked.asked_by, asked.id);
            return None;
        }
        let run = Run {
            asked: Some(asked.id),
            ..Run::of(asked.asked_at, 1)
        };
        let late = crate::time::elapsed(asked.asked_at, self.clock.now());
        info!(event = "asked_run", job, request = asked.id, asked_by = %asked.asked_by, late_ms = late.as_millis() as u64, "running the job by hand, as {} asked at {} (request {})", asked.asked_by, rfc3339(asked.asked_at), asked.id);
        if self.running.is_some() {
            if self.plan.overlap == Overlap::Replace {
                self.replacing = Some(asked.asked_at);
                self.replacing_for = Some((run, asked.clone()));
                return Some(RunsEvent::Replace {
                    occurrence: asked.asked_at,
                    asked: true,
                });
            }
            // overlap=allow (a refusal was recorded as skipped): the run going on goes aside.
            self.aside.extend(self.running.take());
        }
        self.running = Some(run);
        Some(RunsEvent::Start {
            occurrence: asked.asked_at,
            attempt: 1,
            asked: Some(asked),
        })
    }

    /// The next occurrence after `at`, and after now: a late run does not queue up the
    /// occurrences that passed meanwhile (they are recorded as they come due).
    fn after(&self, at: Timestamp) -> Option<Timestamp> {
        self.schedule().next_after(at.max(self.clock.now()))
    }

    /// Logs what the agreement check found; a disagreement ends the runs.
    fn note_agreement(&mut self, agreement: Agreement) -> Option<RunsEvent> {
        if let Some(foreign) = agreement.foreign_ledger {
            self.foreign_ledger_seen = Some(Instant::now());
            self.warn_once("ledger_mismatch", foreign);
        }
        match agreement.verdict {
            Verdict::Disagree { reason } => Some(RunsEvent::Disagree(reason)),
            Verdict::Adopt { change } => {
                warn!(event = "schedule_changed", job = self.plan.job.as_deref(), lock = %self.lock, "{change}");
                None
            }
            Verdict::Agree {
                warning: Some(warning),
            } => {
                self.warn_once("schedule_mismatch", warning);
                None
            }
            Verdict::Agree { warning: None } | Verdict::Undecided { .. } => None,
        }
    }

    fn warn_once(&mut self, event: &'static str, text: String) {
        if self.warned.as_deref() != Some(text.as_str()) {
            warn!(event, job = self.plan.job.as_deref(), lock = %self.lock, "{text}");
            self.warned = Some(text);
        }
    }
}
