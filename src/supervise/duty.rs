//! What a leader does while it leads, apart from keeping the leadership: run the command as a
//! service (the supervisor restarts it after it exits), run it once (`--once`), or run it at the
//! occurrences of a schedule (`--schedule`, with its ledger). The supervisor asks its duty one
//! question in its event loop, "what next?" ([`Shift::next`]), and tells it when the command
//! started and ended; everything about schedules and ledgers stays behind this file.
//!
//! A [`Duty`] lasts as long as pgleader: it keeps what one leadership leaves for the next (an
//! outcome the ledger did not get, when another ledger was last seen). A [`Shift`] is one
//! leadership's part of it.

use std::rc::Rc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::time::{Instant, sleep_until};

use crate::election::ledger::{Claimant, LateFinish, LedgerError};
use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::election::{Fence, Session};
use crate::exit::ChildStatus;
use crate::operate::telemetry::Telemetry;
use crate::schedule::clock::ServerClock;
use crate::schedule::runs::{self, Runs, RunsEvent};
use crate::schedule::{self, Plan, Prepared, Publish};

/// The duty across leaderships.
#[derive(Debug)]
pub struct Duty {
    plan: Option<Plan>,
    telemetry: Telemetry,
    /// With a schedule: how the last run ended, when the leadership ended before the ledger had
    /// it; recorded on the next session.
    late_finish: Option<LateFinish>,
    /// With a schedule: what preparing the current session found.
    prepared: Prepared,
    /// With a schedule: when a replica recording the lock's runs in another ledger was last
    /// seen.
    foreign_ledger_seen: Option<Instant>,
}

/// What the leader is to do next.
#[derive(Debug)]
pub enum Next {
    /// Start the command; for a scheduled run, its occurrence and attempt.
    Start(Option<(Timestamp, i32)>),
    /// `--schedule --once`: the run is over and recorded; exit with the command's status.
    Done,
    /// `--schedule --once`: nothing for this timer to run; exit with `--busy-exit-code`.
    NothingToRun,
    /// `--schedule`: this replica disagrees with the fleet on the schedule; hand the lock over.
    Disagree(String),
    /// `--schedule`: a ledger statement failed for good (`Fatal`) or the session is in trouble.
    Failed(LedgerError),
}

/// One leadership's part of the duty.
#[derive(Debug)]
pub enum Shift<S: Session> {
    /// Start the command once, at `start_at` (after the takeover delay and restart fence).
    Command { start_at: Option<Instant> },
    /// Run the schedule's occurrences.
    Scheduled(Box<Runs<S::Ledger>>),
}

impl Duty {
    pub fn new(plan: Option<Plan>, telemetry: Telemetry) -> Duty {
        Duty {
            plan,
            telemetry,
            late_finish: None,
            prepared: Prepared::default(),
            foreign_ledger_seen: None,
        }
    }

    /// Whether the leader keeps the lock between runs (a schedule) rather than releasing it when
    /// the command exits.
    pub fn is_scheduled(&self) -> bool {
        self.plan.is_some()
    }

    /// Whether this is a timer's run (`--schedule --once`).
    pub fn is_timer(&self) -> bool {
        self.plan.as_ref().is_some_and(|plan| plan.once)
    }

    /// Until when an unreachable server is retried: a timer's run is worth retrying for as long
    /// as its occurrence can still be caught up.
    pub fn connect_deadline(&self) -> Option<Instant> {
        self.plan
            .as_ref()
            .filter(|plan| plan.once)
            .map(|plan| Instant::now() + plan.catch_up)
    }

    /// Whether the last run's outcome is still to be recorded.
    pub fn has_unrecorded(&self) -> bool {
        self.late_finish.is_some()
    }

    /// Prepares a new session before it joins the election (see `schedule::prepare`), so that
    /// every replica reports a missing permission, not only the leader, and records the outcome
    /// a previous session could not. Nothing to do without a schedule.
    pub async fn prepare<S: Session>(
        &mut self,
        session: &S,
        lock: &LockKey,
        timeout: Duration,
    ) -> Result<(), LedgerError> {
        let Some(plan) = &self.plan else {
            return Ok(());
        };
        let ledger = session.ledger(&plan.definition());
        let prepare = schedule::prepare(plan, lock, &ledger, self.late_finish.as_ref());
        let prepared = match tokio::time::timeout(timeout, prepare).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(LedgerError::Query(
                    "no answer while preparing the ledger table".into(),
                ));
            }
        };
        self.late_finish = None;
        if prepared.foreign_ledger.is_some() {
            self.foreign_ledger_seen = Some(Instant::now());
        }
        self.prepared = prepared;
        Ok(())
    }

    /// Why a try-once found the lock held, for the log.
    pub async fn busy_reason<S: Session>(&self, session: &S) -> String {
        match &self.plan {
            Some(plan) => schedule::busy_reason(plan, &session.ledger(&plan.definition())).await,
            None => "--no-wait".to_owned(),
        }
    }

    /// A new leadership's shift: `fence` was received at `received` for a request sent at
    /// `sent`; the command may start at `not_before`.
    pub fn begin<S: Session>(
        &self,
        session: &S,
        lock: &LockKey,
        fence: &Fence,
        (sent, received): (Instant, Instant),
        not_before: Instant,
    ) -> Shift<S> {
        let Some(plan) = &self.plan else {
            return Shift::Command {
                start_at: Some(not_before),
            };
        };
        let telemetry = self.telemetry.clone();
        let start = runs::Start {
            claimant: Claimant {
                host: host_name(),
                pid: std::process::id() as i32,
                epoch: fence.epoch,
            },
            clock: ServerClock::sample(sent, received, fence.server_time),
            not_before,
            own_ledger: self.prepared.ledger_fingerprint.clone(),
            foreign_ledger_seen: self.foreign_ledger_seen,
            publish: Publish(Rc::new(move |run| telemetry.scheduled_run(run))),
            takes_asked: false,
        };
        let ledger = session.ledger(&plan.definition());
        Shift::Scheduled(Box::new(Runs::new(
            plan.clone(),
            lock.clone(),
            ledger,
            start,
        )))
    }

    /// Keeps what a leadership's shift leaves for the next one: an outcome the ledger does not
    /// have yet, and when another ledger was last seen.
    pub fn end<S: Session>(&mut self, shift: &Shift<S>) {
        if let Shift::Scheduled(runs) = shift {
            self.late_finish = runs.unrecorded();
            self.foreign_ledger_seen = self.foreign_ledger_seen.max(runs.foreign_ledger_seen());
        }
    }
}

impl<S: Session> Shift<S> {
    /// What to do next. Cancel-safe: nothing is lost when the future is dropped.
    pub async fn next(&mut self) -> Next {
        match self {
            Shift::Command { start_at } => match *start_at {
                Some(at) => {
                    // A timer, even one already due, fires on the runtime's next millisecond
                    // tick: without a delay to wait out, start now.
                    if at > Instant::now() {
                        sleep_until(at).await;
                    }
                    *start_at = None;
                    Next::Start(None)
                }
                None => std::future::pending().await,
            },
            Shift::Scheduled(runs) => match runs.next().await {
                RunsEvent::Start {
                    occurrence,
                    attempt,
                    ..
                } => Next::Start(Some((occurrence, attempt))),
                RunsEvent::Done => Next::Done,
                RunsEvent::NothingToRun => Next::NothingToRun,
                RunsEvent::Disagree(reason) => Next::Disagree(reason),
                // Only a crontab job with overlap=replace asks for it; --schedule skips.
                RunsEvent::Replace { .. } => unreachable!("--schedule never replaces a run"),
                RunsEvent::Failed(err) => Next::Failed(err),
            },
        }
    }

    pub fn is_scheduled(&self) -> bool {
        matches!(self, Shift::Scheduled(_))
    }

    /// The command started.
    pub fn started(&mut self) {
        if let Shift::Scheduled(runs) = self {
            runs.started();
        }
    }

    /// The command exited on its own. True if the leader keeps the lock for the next run.
    pub fn exited(&mut self, status: ChildStatus) -> bool {
        match self {
            Shift::Command { .. } => false,
            Shift::Scheduled(runs) => {
                runs.exited(status);
                true
            }
        }
    }

    /// A successful check, sent at `sent`, answered at `received`, read the server's clock.
    pub fn observe_check(&mut self, sent: Instant, received: Instant, server: Timestamp) {
        if let Shift::Scheduled(runs) = self {
            runs.observe_check(sent, received, server);
        }
    }

    /// Brings the ledger up to date before the lock is released (see `Runs::settle`); bounded
    /// by `timeout`.
    pub async fn settle(
        &mut self,
        stopped: Option<(Option<ChildStatus>, &str)>,
        timeout: Duration,
    ) {
        if let Shift::Scheduled(runs) = self {
            runs.settle(stopped, timeout).await;
        }
    }
}
