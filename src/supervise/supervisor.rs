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
//! `match`. The rules that matter most:
//!
//! - the command starts only after this session won the lock and proved it is on a writable
//!   primary (a transaction id was assigned);
//! - a leader whose last successful check is `check-interval + check-timeout` old, or whose
//!   connection ended, is already stopping its command;
//! - stopping is: signal to the process group, `kill-timeout`, SIGKILL to the group, wait for
//!   the keeper to be reaped; the session is closed or the lock released only after that;
//! - a session whose acquisition was abandoned is closed, never reused.

use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{debug, info, warn};

use crate::config::RunConfig;
use crate::config::host_name;
use crate::election::backoff::Backoff;
use crate::exit::{ChildStatus, Outcome};
use crate::operate::logging::for_people as fmt;
use crate::operate::notify;
use crate::operate::telemetry::{LossReason, Telemetry};
use crate::postgres::ledger::{Claimant, LateFinish, LedgerError};
use crate::postgres::session::{Check, Confirmation, ConnectError, Session, SessionError};
use crate::schedule::calendar::rfc3339;
use crate::schedule::clock::ServerClock;
use crate::schedule::runs::{self, Runs, RunsEvent};
use crate::schedule::{self, Prepared};
use crate::supervise::job::{self, CommandError, Job};
use crate::supervise::keeper::Report;
use crate::supervise::signals::SignalEvent;

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

/// How long the keeper may take to kill everything the command started before its process
/// group is SIGKILLed directly (which kills the keeper too).
const KEEPER_GRACE: Duration = Duration::from_secs(1);

/// A second TERM or INT sends SIGKILL at once, unless it follows the first this closely.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// Runs the election loop until the outcome is known or a fatal error occurs.
pub async fn run(
    config: RunConfig,
    signals: UnboundedReceiver<SignalEvent>,
    telemetry: Telemetry,
) -> anyhow::Result<Outcome> {
    // A timer's run is worth retrying for as long as its occurrence can still be caught up.
    let connect_deadline = config
        .schedule
        .as_ref()
        .filter(|plan| plan.once)
        .map(|plan| Instant::now() + plan.catch_up);
    Supervisor {
        config,
        signals,
        telemetry,
        backoff: Backoff::default(),
        shutdown_requested: None,
        last_disturbance: None,
        connect_deadline,
        late_finish: None,
        prepared: Prepared::default(),
        foreign_ledger_seen: None,
    }
    .run()
    .await
}

struct Supervisor {
    config: RunConfig,
    signals: UnboundedReceiver<SignalEvent>,
    /// Where the state goes for the HTTP endpoint; publishing never waits.
    telemetry: Telemetry,
    backoff: Backoff,
    /// When the first TERM or INT arrived: finish what is under way, then exit.
    shutdown_requested: Option<Instant>,
    /// When a session last ended, or a connection attempt last failed, other than by
    /// pgleader's own doing: a server restart, crash or failover looks like this from here.
    last_disturbance: Option<Instant>,
    /// When to stop retrying a connection (a scheduled --once).
    connect_deadline: Option<Instant>,
    /// With --schedule: how the last run ended, when the leadership ended before the ledger
    /// had it; recorded on the next session.
    late_finish: Option<LateFinish>,
    /// With --schedule: what preparing the current session found.
    prepared: Prepared,
    /// With --schedule: when a replica recording the lock's runs in another ledger table was
    /// last seen.
    foreign_ledger_seen: Option<Instant>,
}

/// How waiting for the lock ended.
enum Acquired {
    Won(Session),
    Busy,
    /// The session broke while waiting; `stable` if it had been fine for a while.
    Lost {
        stable: bool,
    },
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
    /// `--schedule --once`: nothing for this timer to run; the lock was released.
    NothingToRun,
    /// `--schedule`: this replica disagrees with the fleet on the schedule; it released the
    /// lock so that a replica with the established schedule can lead.
    HandedOver,
    /// `--schedule`: the command had ended with this status, but the leadership ended before
    /// the ledger had the outcome (kept for the next session).
    Unrecorded(ChildStatus),
}

impl Led {
    /// How the command ended, if it ran.
    fn status(&self) -> Option<ChildStatus> {
        match self {
            Led::Exited(status) | Led::Unrecorded(status) => Some(*status),
            Led::Lost { status } | Led::Shutdown(status) | Led::Relinquished(status) => *status,
            Led::NothingToRun | Led::HandedOver => None,
        }
    }
}

enum WaitEvent {
    Done(Result<(), SessionError>),
    Ended(String),
    Signal(Option<SignalEvent>),
}

enum LeadEvent {
    Start,
    CheckDue,
    CheckDone(Result<Check, SessionError>),
    Deadline,
    Relinquish,
    Runs(RunsEvent),
    Ended(String),
    Signal(Option<SignalEvent>),
    Report(Report),
}

enum StopEvent {
    GraceOver,
    KeeperStuck,
    Signal(Option<SignalEvent>),
    Report(Report),
}

type CheckFuture = std::pin::Pin<Box<dyn Future<Output = Result<Check, SessionError>>>>;

impl Supervisor {
    async fn run(&mut self) -> anyhow::Result<Outcome> {
        let mut pause = Duration::ZERO;
        loop {
            if !pause.is_zero() {
                if self.connect_deadline.is_some_and(|at| Instant::now() >= at) {
                    bail!("gave up: a scheduled --once stops retrying after --catch-up");
                }
                debug!(event = "backoff", "reconnecting in {}", fmt(pause));
                if !self.pause(pause).await {
                    return Ok(Outcome::Shutdown);
                }
            }
            let Some(session) = self.connect().await? else {
                return Ok(Outcome::Shutdown);
            };
            match self.prepare_ledger(&session).await {
                Ok(()) => {}
                Err(LedgerError::Fatal(reason)) => bail!("{reason}"),
                Err(LedgerError::Query(reason) | LedgerError::Busy(reason)) => {
                    warn!(event = "ledger_failed", reason = %reason, "cannot prepare the ledger table; reconnecting");
                    self.last_disturbance = Some(Instant::now());
                    pause = self.backoff.next_delay();
                    continue;
                }
            }
            let session = match self.acquire(session).await? {
                Acquired::Won(session) => session,
                Acquired::Busy => return Ok(Outcome::Busy(self.config.busy_exit_code)),
                Acquired::Shutdown => return Ok(Outcome::Shutdown),
                Acquired::Lost { stable } => {
                    pause = self.pause_after_loss(stable);
                    continue;
                }
            };
            let led = self.lead(session).await?;
            if self.config.once && matches!(led, Led::Lost { status: Some(_) }) {
                return Ok(Outcome::LostLeadership);
            }
            // A TERM or INT arrived, perhaps while the command was being stopped for another
            // reason: exit with the command's status, if one ran.
            if self.shutdown_requested.is_some() {
                return Ok(led.status().map_or(Outcome::Shutdown, Outcome::ChildExited));
            }
            match led {
                Led::Shutdown(status) => {
                    return Ok(status.map_or(Outcome::Shutdown, Outcome::ChildExited));
                }
                Led::Exited(status) => {
                    if self.config.once {
                        return Ok(Outcome::ChildExited(status));
                    }
                    self.telemetry.idle();
                    self.backoff.reset();
                    pause = Duration::ZERO;
                    if !self.config.restart_delay.is_zero() {
                        info!(
                            event = "restart_delay",
                            "entering the election again in {} (--restart-delay)",
                            fmt(self.config.restart_delay)
                        );
                        if !self.pause(self.config.restart_delay).await {
                            return Ok(Outcome::Shutdown);
                        }
                    }
                }
                Led::Lost { status } => {
                    pause = self.pause_after_loss(status.is_some());
                }
                Led::Relinquished(_) => {
                    self.backoff.reset();
                    pause = Duration::ZERO;
                }
                Led::Unrecorded(status) => {
                    if self.config.once {
                        warn!(event = "ledger_failed", status = %status, "the command ended ({status}) but the session ended before its outcome was recorded; the next leader will mark the run interrupted");
                        return Ok(Outcome::ChildExited(status));
                    }
                    pause = self.pause_after_loss(true);
                }
                Led::NothingToRun => return Ok(Outcome::Busy(self.config.busy_exit_code)),
                Led::HandedOver => {
                    // Back to the end of the queue, behind the replicas that agree with the
                    // established schedule; not at once, so that a lone pair cannot spin.
                    self.backoff.reset();
                    pause = self.config.check_interval;
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

    /// Connects, retrying transient failures with backoff. `None` means shut down.
    async fn connect(&mut self) -> anyhow::Result<Option<Session>> {
        notify::status(&format!("connecting to {}", self.config.connection));
        self.telemetry.connecting();
        loop {
            debug!(event = "connecting", server = %self.config.connection, "connecting");
            let (settings, application_name, lease) = (
                self.config.connection.clone(),
                self.config.application_name.clone(),
                self.config.lease,
            );
            let attempt =
                async move { Session::connect(&settings, &application_name, &lease).await };
            tokio::pin!(attempt);
            let result = loop {
                let event = tokio::select! {
                    result = &mut attempt => Ok(result),
                    event = self.signals.recv() => Err(event),
                };
                match event {
                    Ok(result) => break result,
                    Err(event) => {
                        if self.idle_signal(event) {
                            return Ok(None);
                        }
                    }
                }
            };
            let err = match result {
                Ok(session) => {
                    info!(
                        event = "connected",
                        server = %self.config.connection,
                        backend_pid = session.backend_pid(),
                        server_version = session.server_major(),
                        "connected"
                    );
                    return Ok(Some(session));
                }
                Err(err) => err,
            };
            let server = &self.config.connection;
            match err {
                ConnectError::Permanent(reason) => {
                    bail!(
                        "cannot connect to {server}: {reason}{}",
                        password_hint(&self.config, &reason)
                    );
                }
                err if self.config.no_wait && self.config.schedule.is_none() => {
                    bail!("cannot connect to {server}: {err} (--no-wait tries once)");
                }
                err if self.connect_deadline.is_some_and(|at| Instant::now() >= at) => {
                    bail!(
                        "cannot connect to {server}: {err} (a scheduled --once stops retrying after --catch-up)"
                    );
                }
                err => {
                    self.last_disturbance = Some(Instant::now());
                    let delay = self.backoff.next_delay();
                    self.telemetry.connect_failed(&err.to_string(), delay);
                    notify::status(&format!(
                        "cannot connect to {server}: {err}; retrying in {}",
                        fmt(delay)
                    ));
                    warn!(
                        event = "connect_failed",
                        server = %server,
                        reason = %err,
                        "cannot connect; retrying in {}",
                        fmt(delay)
                    );
                    if !self.pause(delay).await {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Waits for the lock on this session (or tries once under `--no-wait`).
    async fn acquire(&mut self, mut session: Session) -> anyhow::Result<Acquired> {
        let lock = self.config.lock.clone();
        if self.config.no_wait || self.config.schedule.as_ref().is_some_and(|plan| plan.once) {
            let attempt = tokio::time::timeout(
                self.config.connection.connect_timeout,
                session.try_lock(&lock),
            )
            .await
            .map_err(|_| anyhow::anyhow!("no answer from the server to pg_try_advisory_lock"))?;
            return match attempt {
                Ok(true) => Ok(Acquired::Won(session)),
                Ok(false) => {
                    let why = match &self.config.schedule {
                        Some(plan) => schedule::busy_reason(plan, &session.client()).await,
                        None => "--no-wait".to_owned(),
                    };
                    info!(
                        event = "busy",
                        lock = %lock,
                        exit_code = self.config.busy_exit_code,
                        "another instance holds the lock; exiting ({why})"
                    );
                    Ok(Acquired::Busy)
                }
                Err(err) => Err(err).context("cannot try the lock"),
            };
        }

        info!(
            event = "waiting",
            lock = %lock,
            backend_pid = session.backend_pid(),
            "waiting for the lock"
        );
        notify::following(&lock);
        self.telemetry.following(session.backend_pid());
        let started = Instant::now();
        let wait = session.wait_for_lock(&lock);
        tokio::pin!(wait);
        loop {
            // Biased: a grant that arrives with the connection's end is no grant at all.
            let event = tokio::select! {
                biased;
                reason = session.ended() => WaitEvent::Ended(reason),
                event = self.signals.recv() => WaitEvent::Signal(event),
                result = &mut wait => WaitEvent::Done(result),
            };
            let stable = started.elapsed() >= STABLE_SESSION;
            match event {
                WaitEvent::Done(Ok(())) => return Ok(Acquired::Won(session)),
                WaitEvent::Done(Err(err @ SessionError::Pooler { .. })) => return Err(err.into()),
                WaitEvent::Done(Err(SessionError::Query(reason))) | WaitEvent::Ended(reason) => {
                    self.last_disturbance = Some(Instant::now());
                    warn!(event = "session_lost", reason = %reason, "lost the session while waiting for the lock");
                    self.telemetry.session_lost(&reason);
                    notify::status(&format!(
                        "lost the session while waiting for the lock: {reason}"
                    ));
                    return Ok(Acquired::Lost { stable });
                }
                WaitEvent::Signal(event) => {
                    if self.idle_signal(event) {
                        // The lock may have been granted a moment ago; dropping the session
                        // closes it, which frees anything it holds.
                        drop(session);
                        return Ok(Acquired::Shutdown);
                    }
                }
            }
        }
    }

    /// Leads: fences, starts the command, checks the lock until something ends the leadership.
    async fn lead(&mut self, mut session: Session) -> anyhow::Result<Led> {
        let lock = self.config.lock.clone();
        let (interval, timeout) = (self.config.check_interval, self.config.check_timeout);

        // The fencing token. The server processes this statement after it was sent, so the
        // server keeps the session (and the lock) at least a lease past `sent`: a safe base
        // for the leader's own deadline.
        let sent = Instant::now();
        let fence = match tokio::time::timeout(timeout, session.fence()).await {
            Ok(Ok(fence)) => fence,
            Ok(Err(err)) => {
                warn!(event = "leadership_lost", lock = %lock, reason = %err, "won the lock but cannot take a fencing token; giving it up");
                return Ok(Led::Lost { status: None });
            }
            Err(_) => {
                warn!(event = "leadership_lost", lock = %lock, reason = "the fencing token query timed out", "won the lock but the server stopped answering; giving it up");
                return Ok(Led::Lost { status: None });
            }
        };
        let fence_received = Instant::now();
        let epoch = fence.epoch;
        info!(
            event = "leader",
            lock = %lock,
            backend_pid = session.backend_pid(),
            epoch,
            "became leader"
        );
        notify::leading(&lock, epoch, &self.config.command.display());
        self.telemetry.leading(epoch, session.backend_pid());

        // A server restart, the crash of any server process (after which the postmaster ends
        // every session) and a failover to a promoted standby all free every lock at once,
        // possibly before the previous leader has noticed. Its command is gone at most
        // --restart-fence (check-interval + check-timeout + kill-timeout + margin) later. The
        // server tells when it last started or reset; a failover shows only on this side, as
        // the loss of this pgleader's previous session, after which every session of the new
        // primary, this one included, is younger than the failover.
        let mut since_reset = fence.since_server_reset;
        if self
            .last_disturbance
            .is_some_and(|at| at.elapsed() < self.config.restart_fence)
        {
            since_reset = since_reset.min(session.age());
        }
        let restart_fence = self.config.restart_fence.saturating_sub(since_reset);
        let delay = self.config.takeover_delay.max(restart_fence);
        if !restart_fence.is_zero() && restart_fence >= self.config.takeover_delay {
            info!(
                event = "restart_fence",
                since_reset = %fmt(since_reset),
                "the server restarted, reset or failed over {} ago: starting the command in {} (--restart-fence), in case the previous leader's command still runs",
                fmt(since_reset),
                fmt(restart_fence)
            );
        } else if !delay.is_zero() {
            info!(
                event = "takeover_delay",
                "starting the command in {} (--takeover-delay)",
                fmt(delay)
            );
        }

        let mut deadline = sent + interval + timeout;
        let mut next_check = sent + interval;
        let mut check: Option<(Instant, CheckFuture)> = None;
        // With --schedule the command starts at its occurrences, which `runs` says when;
        // without, once the fences above are passed.
        let mut runs = self.config.schedule.clone().map(|plan| {
            let claimant = Claimant {
                host: host_name(),
                pid: std::process::id() as i32,
                epoch,
            };
            let start = runs::Start {
                claimant,
                clock: ServerClock::sample(sent, fence_received, fence.server_time),
                not_before: Instant::now() + delay,
                own_ledger: self.prepared.ledger_fingerprint.clone(),
                foreign_ledger_seen: self.foreign_ledger_seen,
                telemetry: self.telemetry.clone(),
            };
            Runs::new(plan, lock.clone(), session.client(), start)
        });
        let mut start_at = runs.is_none().then(|| Instant::now() + delay);
        let mut job: Option<Job> = None;
        let relinquish_at = self.relinquish_at();
        let mut last_status: Option<ChildStatus> = None;

        loop {
            // Biased: after a stall (SIGSTOP, a VM pause, a starved CPU) several arms are ready
            // at once, and the end of the leadership must win over everything, starting the
            // command above all.
            let event = tokio::select! {
                biased;
                reason = session.ended() => LeadEvent::Ended(reason),
                _ = sleep_until(deadline) => LeadEvent::Deadline,
                result = async { match &mut check { Some((_, future)) => future.await, None => std::future::pending().await } } => LeadEvent::CheckDone(result),
                event = self.signals.recv() => LeadEvent::Signal(event),
                report = async { match &mut job { Some(job) => job.next_report().await, None => std::future::pending().await } } => LeadEvent::Report(report),
                event = async { match &mut runs { Some(runs) => runs.next().await, None => std::future::pending().await } } => LeadEvent::Runs(event),
                _ = sleep_until(next_check), if check.is_none() => LeadEvent::CheckDue,
                _ = sleep_until(relinquish_at.map_or(deadline, |(at, _)| at)), if relinquish_at.is_some() => LeadEvent::Relinquish,
                _ = sleep_until(start_at.unwrap_or(deadline)), if start_at.is_some() => LeadEvent::Start,
            };
            let (loss, lost_reason) = match event {
                LeadEvent::Start if Instant::now() >= deadline => (
                    LossReason::CheckTimeout,
                    "the leadership expired before the command could start".to_owned(),
                ),
                LeadEvent::Start => {
                    start_at = None;
                    let env = self.child_env(session.backend_pid(), epoch, None);
                    job = Some(self.spawn(&env)?);
                    continue;
                }
                LeadEvent::Runs(RunsEvent::Start { .. }) if Instant::now() >= deadline => (
                    LossReason::CheckTimeout,
                    "the leadership expired before the command could start".to_owned(),
                ),
                LeadEvent::Runs(RunsEvent::Start {
                    occurrence,
                    attempt,
                }) => {
                    let env =
                        self.child_env(session.backend_pid(), epoch, Some((occurrence, attempt)));
                    job = Some(self.spawn(&env)?);
                    if let Some(runs) = &mut runs {
                        runs.started();
                    }
                    continue;
                }
                LeadEvent::Runs(RunsEvent::Done) => {
                    self.telemetry
                        .leadership_lost(LossReason::CommandExited, "the timer's run is over");
                    self.keep_from(runs.as_ref());
                    self.release(session).await;
                    return Ok(Led::Exited(
                        last_status.unwrap_or(ChildStatus::Signaled(Signal::SIGKILL)),
                    ));
                }
                LeadEvent::Runs(RunsEvent::NothingToRun) => {
                    self.telemetry
                        .leadership_lost(LossReason::Relinquished, "nothing for this timer to run");
                    self.keep_from(runs.as_ref());
                    self.release(session).await;
                    return Ok(Led::NothingToRun);
                }
                LeadEvent::Runs(RunsEvent::Disagree(reason)) => {
                    self.telemetry
                        .leadership_lost(LossReason::Relinquished, &reason);
                    self.step_down(
                        job.take(),
                        runs.as_mut(),
                        session,
                        "its replica disagrees on the schedule",
                    )
                    .await;
                    if self.config.once {
                        bail!("{reason}");
                    }
                    warn!(event = "schedule_mismatch", lock = %lock, "{reason}; handing the lock over");
                    return Ok(Led::HandedOver);
                }
                LeadEvent::Runs(RunsEvent::Failed(LedgerError::Fatal(reason))) => {
                    self.telemetry
                        .leadership_lost(LossReason::LedgerFailed, &reason);
                    self.step_down(
                        job.take(),
                        runs.as_mut(),
                        session,
                        "the ledger cannot be used",
                    )
                    .await;
                    bail!("{reason}");
                }
                LeadEvent::Runs(RunsEvent::Failed(
                    LedgerError::Query(reason) | LedgerError::Busy(reason),
                )) => (
                    LossReason::LedgerFailed,
                    format!("a ledger statement failed: {reason}"),
                ),
                LeadEvent::CheckDue => {
                    check = Some((Instant::now(), Box::pin(session.confirm(&lock))));
                    continue;
                }
                LeadEvent::CheckDone(result) => {
                    let sent = check.take().map_or_else(Instant::now, |(sent, _)| sent);
                    let held = matches!(
                        &result,
                        Ok(Check {
                            confirmation: Confirmation::Held,
                            ..
                        })
                    );
                    self.telemetry.check_completed(sent.elapsed(), held);
                    match result {
                        Ok(Check {
                            confirmation: Confirmation::Held,
                            server_time,
                        }) => {
                            debug!(event = "confirmed", lock = %lock, "the session still holds the lock");
                            if let Some(runs) = &mut runs {
                                runs.observe_check(sent, Instant::now(), server_time);
                            }
                            deadline = sent + interval + timeout;
                            next_check = sent + interval;
                            continue;
                        }
                        Ok(Check {
                            confirmation: Confirmation::NotHeld,
                            ..
                        }) => (
                            LossReason::NotHeld,
                            "the check found that this session no longer holds the lock".to_owned(),
                        ),
                        Err(err @ SessionError::Pooler { .. }) => {
                            self.telemetry
                                .leadership_lost(LossReason::CheckFailed, &err.to_string());
                            let status = self
                                .stop_if_running(job.take(), self.config.kill_signal)
                                .await;
                            drop(session);
                            log_final(status);
                            return Err(err.into());
                        }
                        Err(SessionError::Query(reason)) => (
                            LossReason::CheckFailed,
                            format!("the check failed: {reason}"),
                        ),
                    }
                }
                LeadEvent::Deadline => (
                    LossReason::CheckTimeout,
                    format!(
                        "no successful check for {} (--check-interval + --check-timeout)",
                        fmt(interval + timeout)
                    ),
                ),
                LeadEvent::Ended(reason) => (
                    LossReason::ConnectionEnded,
                    format!("the connection ended: {reason}"),
                ),
                LeadEvent::Relinquish => {
                    let why = relinquish_at.map_or("", |(_, why)| why);
                    info!(event = "relinquish", lock = %lock, "handing leadership over ({why})");
                    notify::status(&format!("handing leadership over ({why})"));
                    self.telemetry.leadership_lost(
                        LossReason::Relinquished,
                        &format!("handing over ({why})"),
                    );
                    let status = self.step_down(job.take(), None, session, why).await;
                    return Ok(Led::Relinquished(status));
                }
                LeadEvent::Signal(Some(SignalEvent::Shutdown(signal))) => {
                    self.shutdown_requested = Some(Instant::now());
                    info!(
                        event = "shutdown",
                        signal = signal.as_str(),
                        "shutting down"
                    );
                    notify::stopping(
                        "shutting down: stopping the command, then releasing the lock",
                    );
                    self.telemetry
                        .leadership_lost(LossReason::Shutdown, "shutting down");
                    let status = self.stop_if_running(job.take(), signal).await;
                    if let Some(runs) = &mut runs {
                        runs.settle(Some((status, "pgleader was shut down")), timeout)
                            .await;
                        self.keep_from(Some(runs));
                    }
                    self.release(session).await;
                    return Ok(Led::Shutdown(status));
                }
                LeadEvent::Signal(event) => {
                    if self.handle_signal(event, job.as_mut())
                        && let Some(status) = self.finish_vanished(job.as_mut())
                    {
                        if runs.is_none() {
                            self.telemetry
                                .leadership_lost(LossReason::CommandExited, "the command exited");
                        }
                        // The keeper is gone but what it left in its group may not be.
                        if let Some(job) = job.take() {
                            self.wait_until_group_gone(&job).await;
                        }
                        if let Some(runs) = &mut runs {
                            runs.exited(status);
                            last_status = Some(status);
                            continue;
                        }
                        self.release(session).await;
                        return Ok(Led::Exited(status));
                    }
                    continue;
                }
                LeadEvent::Report(report) => match report {
                    Report::Started(pid) => {
                        info!(event = "child_started", pid, command = %self.config.command.display(), "started the command");
                        self.telemetry.command_started(pid);
                        continue;
                    }
                    Report::SpawnFailed(errno) => {
                        let err = CommandError::from_errno(
                            self.config.command.program().as_os_str(),
                            errno,
                        );
                        self.telemetry
                            .leadership_lost(LossReason::CommandExited, &err.to_string());
                        let _ = self.stop_if_running(job.take(), Signal::SIGKILL).await;
                        if let Some(runs) = &mut runs {
                            // Recorded as failed, with 126 or 127, like a shell would report it.
                            runs.exited(ChildStatus::Exited(i32::from(err.exit_code())));
                            runs.settle(None, timeout).await;
                            self.keep_from(Some(runs));
                        }
                        self.release(session).await;
                        return Err(err.into());
                    }
                    Report::Exited(_) | Report::Killed(_) => {
                        let status = status_of(report);
                        info!(event = "child_exited", status = %status, exit_code = status.exit_code(), "the command exited");
                        self.telemetry.command_exited(status);
                        if runs.is_none() {
                            self.telemetry.leadership_lost(
                                LossReason::CommandExited,
                                &format!("the command exited ({status})"),
                            );
                        }
                        notify::status(&if runs.is_some() {
                            format!(
                                "the command exited ({status}); waiting for the next occurrence"
                            )
                        } else {
                            format!("the command exited ({status}); releasing the lock")
                        });
                        // Whatever the command left behind in its process group goes too, before
                        // the lock is released.
                        if let Some(job) = job.take() {
                            self.stop(job, self.config.kill_signal, Some(status), true)
                                .await;
                        }
                        // A scheduled leader keeps the lock between runs.
                        if let Some(runs) = &mut runs {
                            runs.exited(status);
                            last_status = Some(status);
                            continue;
                        }
                        self.release(session).await;
                        return Ok(Led::Exited(status));
                    }
                },
            };
            warn!(event = "leadership_lost", lock = %lock, reason = %lost_reason, "leadership lost");
            self.telemetry.leadership_lost(loss, &lost_reason);
            self.last_disturbance = Some(Instant::now());
            notify::status(&format!(
                "leadership lost ({lost_reason}); stopping the command"
            ));
            let status = self
                .stop_if_running(job.take(), self.config.kill_signal)
                .await;
            log_final(status);
            if let Some(runs) = &mut runs {
                // If the session still works, the ledger learns the truth now (a statement
                // that succeeds on it runs while it holds the lock); else the next leader
                // marks the run interrupted, and this replica records a finished run's outcome
                // on its next session.
                runs.settle(Some((status, lost_reason.as_str())), timeout / 2)
                    .await;
                self.keep_from(Some(runs));
            }
            // Closed only now: until the command is gone, the session keeps the lock (or the
            // server has already freed it, in which case closing changes nothing).
            drop(session);
            if status.is_none()
                && self.late_finish.is_some()
                && let Some(status) = last_status
            {
                return Ok(Led::Unrecorded(status));
            }
            return Ok(Led::Lost { status });
        }
    }

    /// Keeps what a leadership's runs leave for the next one: an outcome the ledger does not
    /// have yet, and when another ledger table was last seen.
    fn keep_from(&mut self, runs: Option<&Runs>) {
        if let Some(runs) = runs {
            self.late_finish = runs.unrecorded();
            self.foreign_ledger_seen = self.foreign_ledger_seen.max(runs.foreign_ledger_seen());
        }
    }

    /// Steps down on purpose: stops the command, brings the ledger up to date, releases the
    /// lock.
    async fn step_down(
        &mut self,
        job: Option<Job>,
        runs: Option<&mut Runs>,
        session: Session,
        why: &str,
    ) -> Option<ChildStatus> {
        let status = self.stop_if_running(job, self.config.kill_signal).await;
        log_final(status);
        if let Some(runs) = runs {
            runs.settle(Some((status, why)), self.config.check_timeout)
                .await;
            self.keep_from(Some(runs));
        }
        self.release(session).await;
        status
    }

    /// When a leadership that starts now is to be handed over, and which option asked for it.
    fn relinquish_at(&self) -> Option<(Instant, &'static str)> {
        let after = self
            .config
            .relinquish_after
            .map(|after| (Instant::now() + after, "--relinquish-after"));
        let scheduled = self
            .config
            .relinquish_schedule
            .as_ref()
            .and_then(|schedule| {
                let now = chrono::Local::now();
                let next = schedule.find_next_occurrence(&now, false).ok()?;
                let wait = (next - now).to_std().unwrap_or(Duration::ZERO);
                Some((Instant::now() + wait, "--relinquish-schedule"))
            });
        match (after, scheduled) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (one, other) => one.or(other),
        }
    }

    fn child_env(
        &self,
        backend_pid: i32,
        epoch: i64,
        scheduled: Option<(chrono::DateTime<chrono::Utc>, i32)>,
    ) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("PGLEADER_LOCK_ID", self.config.lock.key().to_string()),
            ("PGLEADER_BACKEND_PID", backend_pid.to_string()),
            ("PGLEADER_EPOCH", epoch.to_string()),
        ];
        if let Some(name) = self.config.lock.name() {
            env.push(("PGLEADER_LOCK_NAME", name.to_owned()));
        }
        if let Some((occurrence, attempt)) = scheduled {
            env.push(("PGLEADER_SCHEDULED_TIME", rfc3339(occurrence)));
            env.push(("PGLEADER_ATTEMPT", attempt.to_string()));
        }
        env
    }

    /// Starts the command under its keeper.
    fn spawn(&mut self, env: &[(&'static str, String)]) -> anyhow::Result<Job> {
        let spawned =
            Job::spawn(&self.config.command, env).context("cannot start the keeper process")?;
        self.backoff.reset();
        debug!(
            event = "spawned",
            pgid = spawned.pgid().as_raw(),
            "started the keeper"
        );
        Ok(spawned)
    }

    /// With --schedule: prepares a new session before it joins the election (see
    /// `schedule::prepare`), so that every replica reports a missing permission, not only the
    /// leader, and records the outcome a previous session could not.
    async fn prepare_ledger(&mut self, session: &Session) -> Result<(), LedgerError> {
        let Some(plan) = &self.config.schedule else {
            return Ok(());
        };
        let user_given = self.config.connection.application_name.clone();
        let name = |fingerprints: &str| {
            crate::config::scheduled_application_name(user_given.as_deref(), Some(fingerprints))
        };
        let client = session.client();
        let prepare = schedule::prepare(
            plan,
            &self.config.lock,
            &client,
            name,
            self.late_finish.as_ref(),
        );
        let prepared =
            match tokio::time::timeout(self.config.connection.connect_timeout, prepare).await {
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

    async fn stop_if_running(&mut self, job: Option<Job>, signal: Signal) -> Option<ChildStatus> {
        match job {
            Some(job) => Some(self.stop(job, signal, None, false).await),
            None => None,
        }
    }

    /// Stops a job: `signal` (and SIGCONT, for a stopped command) to its process group; once
    /// the kill timeout runs out, or on a second TERM/INT, the keeper SIGKILLs everything the
    /// command started. Returns once the keeper is reaped and no member of the group is left.
    /// `leftovers_only` when the command itself has exited already and only what it left
    /// behind is being stopped.
    async fn stop(
        &mut self,
        mut job: Job,
        signal: Signal,
        mut status: Option<ChildStatus>,
        leftovers_only: bool,
    ) -> ChildStatus {
        let pgid = job.pgid().as_raw();
        if !leftovers_only {
            info!(
                event = "stopping",
                pgid,
                signal = signal.as_str(),
                "stopping the command: {} to its process group",
                signal.as_str()
            );
        }
        // What the command should have received by now; sent again if it starts only now (a
        // signal sent to the group before it existed reached just the keeper).
        let mut current = signal;
        send_stop_signal(&job, current);
        let grace = sleep(self.config.kill_timeout);
        tokio::pin!(grace);
        let keeper_grace = sleep(Duration::MAX);
        tokio::pin!(keeper_grace);
        let (mut escalated, mut keeper_killed) = (false, false);
        while !job.is_finished() {
            let event = tokio::select! {
                _ = &mut grace, if !escalated => StopEvent::GraceOver,
                _ = &mut keeper_grace, if escalated && !keeper_killed => StopEvent::KeeperStuck,
                event = self.signals.recv() => StopEvent::Signal(event),
                report = job.next_report() => StopEvent::Report(report),
            };
            let escalate = match event {
                StopEvent::GraceOver => {
                    warn!(
                        event = "kill",
                        pgid,
                        "the command did not exit within {} (--kill-timeout); sending SIGKILL to everything it started",
                        fmt(self.config.kill_timeout)
                    );
                    true
                }
                StopEvent::KeeperStuck => {
                    warn!(
                        event = "kill",
                        pgid, "the keeper did not finish; sending SIGKILL to the process group"
                    );
                    let _ = job.signal(Signal::SIGKILL);
                    keeper_killed = true;
                    false
                }
                StopEvent::Signal(Some(SignalEvent::Shutdown(received))) => {
                    match self.shutdown_requested {
                        // `timeout(1)` and some process managers send the same TERM twice in a
                        // row (to the process and to its group); only a later one insists.
                        Some(first) if first.elapsed() < REPEAT_WINDOW => {
                            debug!(
                                event = "repeated_signal",
                                signal = received.as_str(),
                                "ignoring a repeated shutdown signal"
                            );
                            false
                        }
                        Some(_) => {
                            warn!(
                                event = "kill",
                                pgid,
                                signal = received.as_str(),
                                "second shutdown signal: sending SIGKILL"
                            );
                            true
                        }
                        None => {
                            self.shutdown_requested = Some(Instant::now());
                            info!(
                                event = "shutdown",
                                signal = received.as_str(),
                                "shutting down once the command has stopped"
                            );
                            notify::stopping("shutting down once the command has stopped");
                            self.telemetry.shutting_down();
                            if !escalated {
                                current = received;
                                send_stop_signal(&job, current);
                            }
                            false
                        }
                    }
                }
                StopEvent::Signal(event) => {
                    self.handle_signal(event, Some(&mut job));
                    false
                }
                StopEvent::Report(report) => {
                    match report {
                        Report::Exited(_) | Report::Killed(_) => {
                            let ended = status_of(report);
                            if !leftovers_only {
                                info!(event = "child_exited", status = %ended, exit_code = ended.exit_code(), "the command exited");
                            }
                            status.get_or_insert(ended);
                        }
                        // The keeper exits with 126/127 right after; its status stands for
                        // the command's.
                        Report::SpawnFailed(_) => {}
                        Report::Started(pid) => {
                            debug!(
                                event = "child_started",
                                pid, "the command started while being stopped"
                            );
                            send_stop_signal(&job, current);
                        }
                    }
                    false
                }
            };
            if escalate && !escalated {
                escalated = true;
                current = Signal::SIGKILL;
                if job.kill_everything().is_err() {
                    let _ = job.signal(Signal::SIGKILL);
                }
                keeper_grace.as_mut().reset(Instant::now() + KEEPER_GRACE);
            }
        }
        for report in job.remaining_reports() {
            if matches!(report, Report::Exited(_) | Report::Killed(_)) {
                status.get_or_insert(status_of(report));
            }
        }
        self.wait_until_group_gone(&job).await;
        debug!(event = "group_stopped", pgid, "the process group is gone");
        let status = status
            .or_else(|| job.keeper_status())
            .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL));
        if !leftovers_only {
            self.telemetry.command_exited(status);
        }
        status
    }

    /// Waits until no member of the job's process group is alive, SIGKILLing them meanwhile.
    /// Normally there is none by the time the keeper is reaped; there can be when the keeper was
    /// killed from outside (its children are then reparented to init), or when a killed
    /// process is stuck in the kernel (an NFS write) and dies only when the call returns.
    async fn wait_until_group_gone(&mut self, job: &Job) {
        let pgid = job.pgid().as_raw();
        let started = Instant::now();
        let mut next_warning = started;
        loop {
            let members = job.group_members();
            if members.is_empty() {
                return;
            }
            if Instant::now() >= next_warning {
                warn!(
                    event = "group_alive",
                    pgid,
                    "{} process(es) of the command's group are still alive after {} (pids {members:?}); sending SIGKILL and waiting before releasing the lock",
                    members.len(),
                    fmt(started.elapsed())
                );
                next_warning = Instant::now() + Duration::from_secs(5);
            }
            let _ = job.signal(Signal::SIGKILL);
            sleep(Duration::from_millis(10)).await;
        }
    }

    /// Handles a signal event while a job may run. Returns true if a child was reaped.
    fn handle_signal(&mut self, event: Option<SignalEvent>, job: Option<&mut Job>) -> bool {
        match event {
            Some(SignalEvent::Forward(signal)) => {
                if let Some(job) = job {
                    debug!(
                        event = "forward",
                        signal = signal.as_str(),
                        "passing the signal on to the command"
                    );
                    if let Err(err) = job.signal(signal) {
                        warn!(event = "signal_failed", reason = %err, "cannot pass the signal on");
                    }
                }
                false
            }
            Some(SignalEvent::ChildStateChanged) => {
                let mut job = job;
                for (pid, status) in job::reap_all() {
                    let ours = job.as_mut().is_some_and(|job| job.note_reaped(pid, status));
                    if !ours {
                        debug!(
                            event = "reaped",
                            pid = pid.as_raw(),
                            "reaped an orphaned process"
                        );
                    }
                }
                true
            }
            Some(SignalEvent::Shutdown(_)) | None => false,
        }
    }

    /// The keeper vanished without the supervisor stopping it (killed from outside): returns
    /// the command's status once the job is fully gone.
    fn finish_vanished(&mut self, job: Option<&mut Job>) -> Option<ChildStatus> {
        let job = job?;
        if !job.is_finished() {
            return None;
        }
        let status = job
            .remaining_reports()
            .into_iter()
            .find(|report| matches!(report, Report::Exited(_) | Report::Killed(_)))
            .map(status_of)
            .or_else(|| job.keeper_status())
            .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL));
        info!(event = "child_exited", status = %status, exit_code = status.exit_code(), "the command exited");
        self.telemetry.command_exited(status);
        Some(status)
    }

    /// Handles a signal while no command runs. Returns true if pgleader should shut down.
    fn idle_signal(&mut self, event: Option<SignalEvent>) -> bool {
        match event {
            Some(SignalEvent::Shutdown(signal)) => {
                self.shutdown_requested = Some(Instant::now());
                info!(
                    event = "shutdown",
                    signal = signal.as_str(),
                    "shutting down"
                );
                notify::stopping("shutting down");
                self.telemetry.shutting_down();
                true
            }
            None => true,
            other => {
                self.handle_signal(other, None);
                false
            }
        }
    }

    /// Sleeps, still answering signals. False if pgleader should shut down.
    async fn pause(&mut self, duration: Duration) -> bool {
        let until = sleep(duration);
        tokio::pin!(until);
        loop {
            let event = tokio::select! {
                _ = &mut until => return true,
                event = self.signals.recv() => event,
            };
            if self.idle_signal(event) {
                return false;
            }
        }
    }

    /// Releases the lock explicitly so the next waiter is granted it at once, then closes.
    async fn release(&mut self, session: Session) {
        let lock = self.config.lock.clone();
        match session.release(&lock, self.config.check_timeout).await {
            Ok(()) => info!(event = "released", lock = %lock, "released the lock"),
            Err(err) => {
                warn!(event = "release_failed", lock = %lock, reason = %err, "cannot release the lock explicitly; closing the session frees it")
            }
        }
    }
}

/// A stop signal for the command's process group, followed by SIGCONT so that a stopped
/// command can act on it (as systemd does).
fn send_stop_signal(job: &Job, signal: Signal) {
    if let Err(err) = job.signal(signal) {
        warn!(event = "signal_failed", pgid = job.pgid().as_raw(), reason = %err, "cannot signal the process group");
    }
    if !matches!(signal, Signal::SIGKILL | Signal::SIGCONT) {
        let _ = job.signal(Signal::SIGCONT);
    }
}

fn status_of(report: Report) -> ChildStatus {
    match report {
        Report::Killed(signal) => Signal::try_from(signal)
            .map(ChildStatus::Signaled)
            .unwrap_or(ChildStatus::Exited(128 + signal)),
        Report::Exited(code) => ChildStatus::Exited(code),
        Report::Started(_) | Report::SpawnFailed(_) => ChildStatus::Exited(0),
    }
}

fn log_final(status: Option<ChildStatus>) {
    if let Some(status) = status {
        debug!(event = "stopped", status = %status, "the command was stopped");
    }
}

fn password_hint(config: &RunConfig, reason: &str) -> String {
    if reason.contains("password") {
        match &config.connection.password_source {
            Some(source) => format!(" (the password came from {source})"),
            None => {
                " (no password was given: set one in ~/.pgpass, PGPASSWORD or the URL)".to_owned()
            }
        }
    } else {
        String::new()
    }
}
