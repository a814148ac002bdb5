//! The state machine of `pgleader run`:
//!
//! ```text
//!   connecting ──► waiting for the lock ──► leading (command running) ──► stopping ──┐
//!       ▲                 │                        │                                 │
//!       └─────────────────┴────────────────────────┴─────────────────────────────────┘
//! ```
//!
//! One task owns the session, the job and the signal events; nothing is shared behind locks.
//! Each phase is one loop around one `select!` whose arms turn into events, handled by one
//! `match`: this file goes round the states, `supervisor/elect.rs` connects and waits for the
//! lock, `supervisor/lead.rs` leads and steps down. The supervisor sees the backend only
//! through the election's traits, and what it does while leading is its duty's
//! (`duty.rs`: a service, a single run, a schedule). With `--health-cmd`, it queues and leads
//! only while its health probe (`health.rs`) says it is healthy. The rules that matter most:
//!
//! - the command starts only after this session won the lock and took its fencing token (on
//!   PostgreSQL, a transaction id, which also proves a writable primary);
//! - a leader whose last successful check is `check-interval + check-timeout` old, or whose
//!   connection ended, is already stopping its command;
//! - stopping is: signal to the process group, `kill-timeout`, SIGKILL to the group, wait for
//!   the keeper to be reaped; the session is closed or the lock released only after that;
//! - a session whose acquisition was abandoned is closed, never reused;
//! - a keeper is parked (started, waiting) before the election, and again between a schedule's
//!   runs, so that winning costs the command's fork and exec only; a parked keeper exits by
//!   itself when pgleader does.

mod elect;
mod lead;

use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::election::backoff::Backoff;
use crate::election::ledger::LedgerError;
use crate::election::{Backend, Check, SessionError};
use crate::exit::{ChildStatus, Outcome};
use crate::operate::telemetry::Telemetry;
use crate::supervise::Settings;
use crate::supervise::duty::{Duty, Next};
use crate::supervise::health::Health;
use crate::supervise::hook;
use crate::supervise::inbox::Inbox;
use crate::supervise::inbox::SignalMeaning;
use crate::supervise::keeper::handle::{self, CommandLine, Job, Parked};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::signals::SignalEvent;
use crate::supervise::watchdog::Deadline;
use crate::time::for_people as fmt;

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

/// Runs the election loop on `backend` until the outcome is known or a fatal error occurs.
pub async fn run<B: Backend>(
    backend: B,
    settings: Settings,
    command: CommandLine,
    signals: UnboundedReceiver<SignalEvent>,
    telemetry: Telemetry,
) -> anyhow::Result<Outcome> {
    let duty = Duty::new(settings.schedule.clone(), telemetry.clone());
    let health = match settings.health.clone() {
        Some(check) => Health::start(check, telemetry.clone())?,
        None => Health::none(),
    };
    let mut supervisor = Supervisor {
        health,
        connect_deadline: duty.connect_deadline(),
        duty,
        inbox: Inbox::new(signals, telemetry, settings.stop_rules()),
        backend,
        settings,
        command,
        backoff: Backoff::default(),
        last_disturbance: None,
        parked: None,
        pre_start_failures: 0,
    };
    let outcome = supervisor.run().await;
    supervisor.dismiss_keeper().await;
    outcome
}

struct Supervisor<B: Backend> {
    backend: B,
    settings: Settings,
    /// What the leader runs.
    command: CommandLine,
    /// Signals, the shutdown state, the telemetry; and stopping the job.
    inbox: Inbox,
    /// What the leader does while it leads, and what one leadership leaves the next.
    duty: Duty,
    backoff: Backoff,
    /// When a session last ended, or a connection attempt last failed, other than by
    /// pgleader's own doing: a server restart, crash or failover looks like this from here.
    last_disturbance: Option<Instant>,
    /// When to stop retrying a connection (a scheduled --once).
    connect_deadline: Option<Instant>,
    /// The keeper started ahead of the next command, waiting (see `handle::Parked`).
    parked: Option<Ahead>,
    /// Whether this replica may queue and lead (`--health-cmd`).
    health: Health,
    /// `--pre-start` failures in a row: each doubles the time this replica sits out.
    pre_start_failures: u32,
}

/// A keeper started ahead of the next command: still being spawned, on a blocking thread so
/// that its fork and exec overlap with connecting and waiting for the lock, or parked.
enum Ahead {
    Spawning(tokio::task::JoinHandle<std::io::Result<Parked>>),
    Parked(Parked),
}

/// How waiting for the lock ended.
enum Acquired<S> {
    Won(S),
    Busy,
    /// The session broke while waiting; `stable` if it had been fine for a while.
    Lost {
        stable: bool,
    },
    /// The health probe turned unhealthy: the session was closed (a wait given up may have
    /// been granted).
    Unhealthy,
    Shutdown,
}

/// How a leadership ended.
enum Led {
    /// The command exited on its own (its leftovers were stopped, the lock released).
    Exited(ChildStatus),
    /// Leadership was lost; `status` is how the command ended if it had started.
    Lost { status: Option<ChildStatus> },
    /// pgleader was asked to shut down.
    Shutdown(Option<ChildStatus>),
    /// A planned handoff (--relinquish-after, --relinquish-schedule): the command was stopped
    /// and the lock released, for the next waiting replica.
    Relinquished(Option<ChildStatus>),
    /// `pgleader step-down` asked for a handoff: the command was stopped and the lock released,
    /// for the next waiting replica.
    SteppedDown(Option<ChildStatus>),
    /// `--schedule --once`: nothing for this timer to run; the lock was released.
    NothingToRun,
    /// `--schedule`: this replica disagrees with the fleet on the schedule; it released the
    /// lock so that a replica with the established schedule can lead.
    HandedOver,
    /// `--schedule`: the command had ended with this status, but the leadership ended before
    /// the ledger had the outcome (kept for the next session).
    Unrecorded(ChildStatus),
    /// `--pre-start` failed: the command never started, `--post-stop` ran, the lock was
    /// released.
    PreStartFailed,
    /// The health probe turned unhealthy: the command was stopped and the lock released.
    Unhealthy(Option<ChildStatus>),
}

impl Led {
    /// How the command ended, if it ran.
    fn status(&self) -> Option<ChildStatus> {
        match self {
            Led::Exited(status) | Led::Unrecorded(status) => Some(*status),
            Led::Lost { status }
            | Led::Shutdown(status)
            | Led::Relinquished(status)
            | Led::SteppedDown(status)
            | Led::Unhealthy(status) => *status,
            Led::NothingToRun | Led::HandedOver | Led::PreStartFailed => None,
        }
    }
}

enum WaitEvent {
    Done(Result<(), SessionError>),
    Ended(String),
    Signal(Option<SignalEvent>),
    Unhealthy,
}

enum LeadEvent {
    Duty(Next),
    CheckDue,
    CheckDone(Result<Check, SessionError>),
    Deadline,
    Relinquish,
    /// `pgleader step-down` asked, with this request id.
    StepDown(String),
    Ended(String),
    Signal(SignalMeaning),
    Report(Report),
    Unhealthy,
}

/// How a leadership is left: the lock released for the next waiter, or the session closed
/// (which frees the lock too, or finds it freed already).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Leave {
    Release,
    Close,
}

type CheckFuture = std::pin::Pin<Box<dyn Future<Output = Result<Check, SessionError>>>>;

impl<B: Backend> Supervisor<B> {
    async fn run(&mut self) -> anyhow::Result<Outcome> {
        let mut pause = Duration::ZERO;
        loop {
            if !pause.is_zero() {
                if self.connect_deadline.is_some_and(|at| Instant::now() >= at) {
                    bail!("gave up: a scheduled --once stops retrying after --catch-up");
                }
                debug!(event = "backoff", "reconnecting in {}", fmt(pause));
                if !self.inbox.pause(pause).await {
                    return Ok(Outcome::Shutdown);
                }
            }
            // Out of the election until the health probe passes: not even connected.
            if !self.health.is_healthy() && !self.health.sit_out(&mut self.inbox).await {
                return Ok(Outcome::Shutdown);
            }
            // Ready before it is needed: winning then costs the command's fork and exec only.
            // Its spawn runs while connecting.
            self.park_keeper().await;
            let Some(session) = self.connect().await? else {
                return Ok(Outcome::Shutdown);
            };
            let prepared = self
                .duty
                .prepare(&session, &self.settings.lock, self.settings.connect_timeout)
                .await;
            match prepared {
                Ok(()) => {}
                Err(LedgerError::Fatal(reason)) => bail!("{reason}"),
                Err(LedgerError::Query(reason) | LedgerError::Busy(reason)) => {
                    warn!(event = "ledger_failed", reason = %reason, "cannot prepare the ledger table; reconnecting");
                    self.last_disturbance = Some(Instant::now());
                    pause = self.backoff.next_delay();
                    continue;
                }
            }
            // Parked before queueing (started again if it died meanwhile).
            self.park_keeper().await;
            self.keeper_ready().await;
            let (session, granted) = match self.acquire(session).await? {
                Acquired::Won(session) => (session, Instant::now()),
                Acquired::Busy => return Ok(Outcome::Busy(self.settings.busy_exit_code)),
                Acquired::Shutdown => return Ok(Outcome::Shutdown),
                Acquired::Unhealthy => {
                    self.backoff.reset();
                    pause = Duration::ZERO;
                    continue;
                }
                Acquired::Lost { stable } => {
                    pause = self.pause_after_loss(stable);
                    continue;
                }
            };
            let led = self.lead(session, granted).await?;
            let once = self.settings.once;
            // Under --once a step-down ends the run as a loss does: the command did not finish.
            if once
                && matches!(
                    led,
                    Led::Lost { status: Some(_) }
                        | Led::SteppedDown(Some(_))
                        | Led::Unhealthy(Some(_))
                )
            {
                return Ok(Outcome::LostLeadership);
            }
            // A TERM or INT arrived, perhaps while the command was being stopped for another
            // reason: exit with the command's status, if one ran.
            if self.inbox.shutdown_requested.is_some() {
                return Ok(led.status().map_or(Outcome::Shutdown, Outcome::ChildExited));
            }
            match led {
                Led::Shutdown(status) => {
                    return Ok(status.map_or(Outcome::Shutdown, Outcome::ChildExited));
                }
                Led::Exited(status) if once => return Ok(Outcome::ChildExited(status)),
                Led::Exited(_) => {
                    self.inbox.telemetry.idle();
                    self.backoff.reset();
                    pause = Duration::ZERO;
                    let delay = self.settings.restart_delay;
                    if !delay.is_zero() {
                        info!(
                            event = "restart_delay",
                            "entering the election again in {} (--restart-delay)",
                            fmt(delay)
                        );
                        if !self.inbox.pause(delay).await {
                            return Ok(Outcome::Shutdown);
                        }
                    }
                }
                Led::Lost { status } => pause = self.pause_after_loss(status.is_some()),
                Led::Relinquished(_) | Led::Unhealthy(_) => {
                    self.backoff.reset();
                    pause = Duration::ZERO;
                }
                Led::Unrecorded(status) if once => {
                    warn!(event = "ledger_failed", status = %status, "the command ended ({status}) but the session ended before its outcome was recorded; the next leader will mark the run interrupted");
                    return Ok(Outcome::ChildExited(status));
                }
                Led::Unrecorded(_) => pause = self.pause_after_loss(true),
                Led::NothingToRun => return Ok(Outcome::Busy(self.settings.busy_exit_code)),
                Led::PreStartFailed => {
                    self.pre_start_failures = self.pre_start_failures.saturating_add(1);
                    let sit_out = hook::sit_out_after(self.pre_start_failures);
                    info!(
                        event = "sitting_out",
                        "entering the election again in {} (--pre-start failed {} time(s) in a row)",
                        fmt(sit_out),
                        self.pre_start_failures
                    );
                    self.backoff.reset();
                    pause = Duration::ZERO;
                    if !self.inbox.pause(sit_out).await {
                        return Ok(Outcome::Shutdown);
                    }
                }
                Led::SteppedDown(_) => {
                    // Not at once: the replica that waits behind wins meanwhile, and this one
                    // queues behind it.
                    self.backoff.reset();
                    pause = self.settings.check_interval;
                    info!(
                        event = "follower",
                        "stepped down; queueing again in {} (--check-interval)",
                        fmt(pause)
                    );
                }
                Led::HandedOver => {
                    // Back to the end of the queue, behind the replicas that agree with the
                    // established schedule; not at once, so that a lone pair cannot spin.
                    self.backoff.reset();
                    pause = self.settings.check_interval;
                }
            }
        }
    }

    fn pause_after_loss(&mut self, stable: bool) -> Duration {
        if stable {
            self.backoff.reset();
        }
        self.backoff.next_delay()
    }

    /// Makes sure a keeper waits, parked, for the next command, or is being started. A failure
    /// here is not fatal: starting the command tries again, and reports the error if it fails
    /// then.
    async fn park_keeper(&mut self) {
        if let Some(Ahead::Spawning(spawning)) = &self.parked
            && !spawning.is_finished()
        {
            return;
        }
        self.keeper_ready().await;
        if self.parked.is_some() {
            return;
        }
        let command = self.command.clone();
        let hooks = self.settings.hooks.clone();
        self.parked = Some(Ahead::Spawning(tokio::task::spawn_blocking(move || {
            Parked::spawn(&command, &hooks)
        })));
    }

    /// Waits until the keeper started ahead of time is parked (or known gone), so that a
    /// follower holds one before it queues: its spawn has overlapped with connecting by then.
    async fn keeper_ready(&mut self) {
        if let Some(parked) = self.take_parked().await {
            self.parked = Some(Ahead::Parked(parked));
        }
    }

    /// The parked keeper, once its spawn is over, if it still waits.
    async fn take_parked(&mut self) -> Option<Parked> {
        let parked = match self.parked.take()? {
            Ahead::Parked(parked) => parked,
            Ahead::Spawning(spawning) => match spawning.await {
                Ok(Ok(parked)) => {
                    debug!(
                        event = "keeper_parked",
                        pid = parked.pid().as_raw(),
                        "started a keeper for the next command"
                    );
                    parked
                }
                Ok(Err(err)) => {
                    warn!(event = "keeper_failed", reason = %err, "cannot start a keeper ahead of time; trying again when the command starts");
                    return None;
                }
                Err(err) => {
                    warn!(event = "keeper_failed", reason = %err, "cannot start a keeper ahead of time; trying again when the command starts");
                    return None;
                }
            },
        };
        Some(parked).filter(Parked::is_waiting)
    }

    /// Starts the command under the parked keeper (or a fresh one if none waits); the keeper
    /// holds `hold` (the session's sockets) until the job's tree is gone, and stops the tree by
    /// itself should the leadership's `deadline` pass unrenewed.
    async fn spawn(
        &mut self,
        env: &[(&'static str, String)],
        hold: &[crate::election::socket::Lent],
        deadline: &Deadline,
    ) -> anyhow::Result<Job> {
        let parked = self.take_parked().await;
        let (command, hooks) = (&self.command, &self.settings.hooks);
        let watch = Some((deadline, &Label::leader()));
        let spawned = Parked::start_or_fresh(parked, command, hooks, env, hold, watch)
            .context("cannot start the keeper process")?;
        self.backoff.reset();
        debug!(
            event = "spawned",
            pgid = spawned.pgid().as_raw(),
            "started the keeper"
        );
        Ok(spawned)
    }

    /// Lets the parked keeper go (it exits on end-of-file) and waits a moment for it, so that
    /// pgleader leaves nothing behind when it exits.
    async fn dismiss_keeper(&mut self) {
        let Some(parked) = self.take_parked().await else {
            return;
        };
        let pid = parked.pid();
        drop(parked);
        handle::await_let_go(vec![pid], Duration::from_secs(1)).await;
    }
}
