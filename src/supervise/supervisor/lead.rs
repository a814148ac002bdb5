//! The leading phase: fence, start the command when the duty says so, check the lock until
//! something ends the leadership, then step down, the one way every path takes (stop the
//! command's whole group, settle the ledger, release or close).

use std::ops::ControlFlow;

use anyhow::bail;
use nix::sys::signal::Signal;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use super::{CheckFuture, LeadEvent, Leave, Led, Supervisor};
use crate::election::ledger::LedgerError;
use crate::election::step_down::Requests;
use crate::election::{Backend, Check, Confirmation, Fence, Session, SessionError};
use crate::exit::ChildStatus;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::schedule::calendar::rfc3339;
use crate::supervise::duty::{Next, Shift};
use crate::supervise::hook;
use crate::supervise::inbox::SignalMeaning;
use crate::supervise::keeper::handle::{CommandError, Job};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::stop::Stop;
use crate::supervise::watchdog::Deadline;
use crate::time::for_people as fmt;

/// What one leadership keeps from one event to the next.
struct Leading {
    epoch: i64,
    /// When the leadership ends without a successful check; each one moves it on, and the
    /// command's keeper watches the same one (`keepers`).
    deadline: Instant,
    keepers: Deadline,
    next_check: Instant,
    /// The check under way, and when it was sent.
    check: Option<(Instant, CheckFuture)>,
    job: Option<Job>,
    /// `pgleader step-down` requests.
    requests: Requests,
    /// When this leadership is to be handed over, and which option asked for it.
    relinquish_at: Option<(Instant, &'static str)>,
    /// How a scheduled leader's last run ended.
    last_status: Option<ChildStatus>,
    /// The first command's way from the grant to its exec, for the debug log.
    timeline: Option<Timeline>,
}

/// What an event while leading leads to.
enum Step<S> {
    /// Leading goes on.
    Lead(S),
    /// The leadership is lost, for this reason: the command is stopped, the session closed.
    Lost(S, LossReason, String),
    /// The command ended on its own (or its keeper vanished), with the stop of what it left
    /// (boxed: a stop is large beside the rest).
    Exited(S, ChildStatus, Option<Box<(Job, Stop)>>),
    /// The leadership is over; it was stepped down from already.
    Over(Led),
}

impl<B: Backend> Supervisor<B> {
    /// Leads: fences, starts the command when the duty says so, checks the lock until
    /// something ends the leadership. `granted` is when the lock was won.
    pub(super) async fn lead(
        &mut self,
        mut session: B::Session,
        granted: Instant,
    ) -> anyhow::Result<Led> {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        // The server processes the fencing request after it was sent, so the server keeps the
        // lock at least a lease past `sent`: a safe base for the leader's own deadline.
        let sent = Instant::now();
        let Some((fence, requests)) = self.take_fence(&mut session).await else {
            return Ok(Led::Lost { status: None });
        };
        let fenced = Instant::now();
        let epoch = fence.epoch;
        let lock = &self.settings.lock;
        info!(
            event = "leader",
            lock = %lock,
            backend_pid = session.id(),
            epoch,
            "became leader"
        );
        notify::leading(lock, epoch, &self.command.display());
        self.inbox.telemetry.leading(epoch, session.id());
        let delay = self.settings.start_delay(
            self.last_disturbance,
            fence.since_server_reset,
            session.age(),
        );
        let mut shift = self.duty.begin(
            &session,
            &self.settings.lock,
            &fence,
            (sent, fenced),
            Instant::now() + delay,
        );
        // The same deadline, shared with the command's keeper, which stops the tree by itself
        // should it pass unrenewed (pgleader stopped, hung or starved).
        let keepers = match Deadline::new(self.settings.deadline_terms(), sent + interval + timeout)
        {
            Ok(keepers) => keepers,
            Err(err) => {
                // Without it a frozen pgleader's command could outlive the lease: not leading.
                warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %err, "cannot share the leader's deadline with the command's keeper (memfd); giving the lock up");
                self.duty.end(&shift);
                self.release(session).await;
                return Ok(Led::Lost { status: None });
            }
        };
        let mut leading = Leading {
            epoch,
            deadline: sent + interval + timeout,
            keepers,
            next_check: sent + interval,
            check: None,
            job: None,
            requests,
            relinquish_at: self.relinquish_at(),
            last_status: None,
            timeline: Some(Timeline {
                granted,
                fenced,
                handed: None,
            }),
        };
        loop {
            let event = self
                .next_event(&mut session, &mut leading, &mut shift)
                .await;
            session = match self
                .on_event(event, session, &mut leading, &mut shift)
                .await?
            {
                Step::Lead(session) => session,
                Step::Lost(session, loss, reason) => {
                    return Ok(self
                        .lose(session, loss, reason, &mut leading, &mut shift)
                        .await);
                }
                Step::Exited(session, status, leftovers) => match self
                    .after_exit(session, status, leftovers, &mut leading, &mut shift)
                    .await
                {
                    ControlFlow::Continue(session) => session,
                    ControlFlow::Break(led) => return Ok(led),
                },
                Step::Over(led) => return Ok(led),
            };
        }
    }

    /// Takes the fencing token and listens for step-down requests, both in one round trip.
    /// `None` (logged) if the token cannot be had: the lock is given up.
    async fn take_fence(&mut self, session: &mut B::Session) -> Option<(Fence, Requests)> {
        let lock = &self.settings.lock;
        let timeout = self.settings.check_timeout;
        let (requests, listening) = session.listen();
        let (fenced, listened) =
            tokio::join!(tokio::time::timeout(timeout, session.fence()), async {
                tokio::time::timeout(timeout, listening).await
            });
        match listened {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                warn!(event = "step_down_deaf", lock = %lock, reason = %err, "cannot listen for step-down requests; pgleader step-down will not reach this leader")
            }
            Err(_) => {
                warn!(event = "step_down_deaf", lock = %lock, "no answer to the subscription for step-down requests; pgleader step-down will not reach this leader")
            }
        }
        match fenced {
            Ok(Ok(fence)) => Some((fence, requests)),
            Ok(Err(err)) => {
                warn!(event = "leadership_lost", lock = %lock, reason = %err, "won the lock but cannot take a fencing token; giving it up");
                None
            }
            Err(_) => {
                warn!(event = "leadership_lost", lock = %lock, reason = "the fencing token query timed out", "won the lock but the server stopped answering; giving it up");
                None
            }
        }
    }

    /// The next thing that happens while leading. Biased: after a stall (SIGSTOP, a VM pause,
    /// a starved CPU) several arms are ready at once, and the end of the leadership must win
    /// over everything, starting the command above all.
    async fn next_event(
        &mut self,
        session: &mut B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> LeadEvent {
        let Leading {
            deadline,
            next_check,
            check,
            job,
            requests,
            relinquish_at,
            ..
        } = leading;
        let (deadline, next_check, relinquish_at) = (*deadline, *next_check, *relinquish_at);
        tokio::select! {
            biased;
            reason = session.ended() => LeadEvent::Ended(reason),
            _ = sleep_until(deadline) => LeadEvent::Deadline,
            result = async { match check { Some((_, future)) => future.await, None => std::future::pending().await } } => LeadEvent::CheckDone(result),
            event = self.inbox.next_signal() => LeadEvent::Signal(self.inbox.meaning(event)),
            report = async { match job { Some(job) => job.next_report().await, None => std::future::pending().await } } => LeadEvent::Report(report),
            _ = sleep_until(next_check), if check.is_none() => LeadEvent::CheckDue,
            _ = sleep_until(relinquish_at.map_or(deadline, |(at, _)| at)), if relinquish_at.is_some() => LeadEvent::Relinquish,
            Some(request) = requests.recv() => LeadEvent::StepDown(request),
            () = self.health.turned_unhealthy() => LeadEvent::Unhealthy,
            next = shift.next() => LeadEvent::Duty(next),
        }
    }

    /// What `event` does to the leadership.
    async fn on_event(
        &mut self,
        event: LeadEvent,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> anyhow::Result<Step<B::Session>> {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let lock = self.settings.lock.clone();
        Ok(match event {
            LeadEvent::Duty(next) => return self.on_duty(next, session, leading, shift).await,
            LeadEvent::CheckDue => {
                leading.check = Some((Instant::now(), Box::pin(session.confirm())));
                Step::Lead(session)
            }
            LeadEvent::CheckDone(result) => {
                return self.on_check(result, session, leading, shift).await;
            }
            LeadEvent::Deadline => Step::Lost(
                session,
                LossReason::CheckTimeout,
                format!(
                    "no successful check for {} (--check-interval + --check-timeout)",
                    fmt(interval + timeout)
                ),
            ),
            LeadEvent::Ended(reason) => Step::Lost(
                session,
                LossReason::ConnectionEnded,
                format!("the connection ended: {reason}"),
            ),
            LeadEvent::Relinquish => {
                let why = leading.relinquish_at.map_or("", |(_, why)| why);
                info!(event = "relinquish", lock = %lock, "handing leadership over ({why})");
                notify::status(&format!("handing leadership over ({why})"));
                let reason = format!("handing over ({why})");
                let loss = (LossReason::Relinquished, reason.as_str());
                let status = self.hand_over(loss, why, session, leading, shift).await;
                Step::Over(Led::Relinquished(status))
            }
            LeadEvent::StepDown(request) => {
                info!(event = "step_down", lock = %lock, request = %request, "asked to step down (pgleader step-down): stopping the command, then releasing the lock for the next waiting replica");
                notify::status("stepping down on request");
                let reason = format!("asked to step down (request {request})");
                let loss = (LossReason::SteppedDown, reason.as_str());
                let why = "asked to step down";
                let status = self.hand_over(loss, why, session, leading, shift).await;
                Step::Over(Led::SteppedDown(status))
            }
            LeadEvent::Unhealthy => {
                let why = "the health probe failed (--health-cmd)";
                warn!(event = "health_step_down", lock = %lock, "stepping down: {why}; not queueing again until it passes");
                notify::status("unhealthy: stepping down until the health probe passes");
                let loss = (LossReason::Unhealthy, why);
                let status = self.hand_over(loss, why, session, leading, shift).await;
                Step::Over(Led::Unhealthy(status))
            }
            LeadEvent::Signal(meaning) => self.on_signal(meaning, session, leading, shift).await,
            LeadEvent::Report(report) => {
                return self.on_report(report, session, leading, shift).await;
            }
        })
    }

    /// What the duty says: start the command, or the leadership's end.
    async fn on_duty(
        &mut self,
        next: Next,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> anyhow::Result<Step<B::Session>> {
        Ok(match next {
            Next::Start(_)
                if Instant::now() >= leading.deadline || leading.keepers.has_expired() =>
            {
                Step::Lost(
                    session,
                    LossReason::CheckTimeout,
                    "the leadership expired before the command could start".to_owned(),
                )
            }
            Next::Start(scheduled) => {
                let env = self.child_env(session.id(), leading.epoch, scheduled);
                leading.job = Some(self.spawn(&env, &session.lend(), &leading.keepers).await?);
                if let Some(timeline) = &mut leading.timeline {
                    timeline.handed.get_or_insert_with(Instant::now);
                }
                shift.started();
                Step::Lead(session)
            }
            Next::Done => {
                self.inbox
                    .telemetry
                    .leadership_lost(LossReason::CommandExited, "the timer's run is over");
                self.step_down(None, shift, session, None, Leave::Release)
                    .await;
                Step::Over(Led::Exited(
                    leading
                        .last_status
                        .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL)),
                ))
            }
            Next::NothingToRun => {
                self.inbox
                    .telemetry
                    .leadership_lost(LossReason::Relinquished, "nothing for this timer to run");
                self.step_down(None, shift, session, None, Leave::Release)
                    .await;
                Step::Over(Led::NothingToRun)
            }
            Next::Disagree(reason) => {
                let why = "its replica disagrees on the schedule";
                let loss = (LossReason::Relinquished, reason.as_str());
                self.hand_over(loss, why, session, leading, shift).await;
                if self.settings.once {
                    bail!("{reason}");
                }
                warn!(event = "schedule_mismatch", lock = %self.settings.lock, "{reason}; handing the lock over");
                Step::Over(Led::HandedOver)
            }
            Next::Failed(LedgerError::Fatal(reason)) => {
                let why = "the ledger cannot be used";
                let loss = (LossReason::LedgerFailed, reason.as_str());
                self.hand_over(loss, why, session, leading, shift).await;
                bail!("{reason}");
            }
            Next::Failed(LedgerError::Query(reason) | LedgerError::Busy(reason)) => Step::Lost(
                session,
                LossReason::LedgerFailed,
                format!("a ledger statement failed: {reason}"),
            ),
        })
    }

    /// A check's answer: the deadline moves on, or the leadership is lost.
    async fn on_check(
        &mut self,
        result: Result<Check, SessionError>,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> anyhow::Result<Step<B::Session>> {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let sent = leading
            .check
            .take()
            .map_or_else(Instant::now, |(sent, _)| sent);
        let held = matches!(
            &result,
            Ok(Check {
                confirmation: Confirmation::Held,
                ..
            })
        );
        self.inbox.telemetry.check_completed(sent.elapsed(), held);
        Ok(match result {
            Ok(Check {
                confirmation: Confirmation::Held,
                server_time,
            }) => {
                debug!(event = "confirmed", lock = %self.settings.lock, "the session still holds the lock");
                shift.observe_check(sent, Instant::now(), server_time);
                leading.deadline = sent + interval + timeout;
                leading.next_check = sent + interval;
                // Fails only if a keeper found the deadline past first: its command is
                // stopping already.
                if leading.keepers.renew(leading.deadline).is_ok() {
                    Step::Lead(session)
                } else {
                    let reason = leading.keepers.lost_reason();
                    Step::Lost(session, LossReason::CheckTimeout, reason)
                }
            }
            Ok(Check {
                confirmation: Confirmation::NotHeld,
                ..
            }) => Step::Lost(
                session,
                LossReason::NotHeld,
                "the check found that this session no longer holds the lock".to_owned(),
            ),
            Err(err @ SessionError::Unsafe(_)) => {
                self.inbox
                    .telemetry
                    .leadership_lost(LossReason::CheckFailed, &err.to_string());
                let kill_signal = self.settings.kill_signal;
                let status = self
                    .inbox
                    .stop_if_running(leading.job.take(), kill_signal)
                    .await;
                drop(session);
                log_final(status);
                return Err(err.into());
            }
            Err(SessionError::Query(reason)) => Step::Lost(
                session,
                LossReason::CheckFailed,
                format!("the check failed: {reason}"),
            ),
        })
    }

    /// A signal while leading: a shutdown, or one for the command (a keeper killed from
    /// outside shows here, on the reap: the command is gone with it).
    async fn on_signal(
        &mut self,
        meaning: SignalMeaning,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> Step<B::Session> {
        if let SignalMeaning::Shutdown(signal, _) = meaning {
            self.inbox.begin_shutdown(
                signal,
                "shutting down: stopping the command, then releasing the lock",
            );
            let status = self.inbox.stop_if_running(leading.job.take(), signal).await;
            shift
                .settle(
                    Some((status, "pgleader was shut down")),
                    self.settings.check_timeout,
                )
                .await;
            self.step_down(None, shift, session, None, Leave::Release)
                .await;
            return Step::Over(Led::Shutdown(status));
        }
        if self.inbox.on_job_signal(meaning, leading.job.as_mut())
            && let Some(vanished) = leading.job.take_if(|job| job.is_finished())
        {
            // Whatever it left in its group is SIGKILLed: no keeper is left to stop it
            // gracefully.
            let stop = Stop::vanished(&vanished, self.inbox.rules, Label::leader());
            let status = self.inbox.drive(vanished, stop).await;
            self.inbox.telemetry.command_exited(status);
            return Step::Exited(session, status, None);
        }
        Step::Lead(session)
    }

    /// A report from the command's keeper.
    async fn on_report(
        &mut self,
        report: Report,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> anyhow::Result<Step<B::Session>> {
        let timeout = self.settings.check_timeout;
        let kill_signal = self.settings.kill_signal;
        Ok(match report {
            Report::Started(pid) => {
                if let Some(timeline) = leading.timeline.take() {
                    timeline.log(Instant::now());
                }
                info!(event = "child_started", pid, command = %self.command.display(), "started the command");
                self.inbox.telemetry.command_started(pid);
                self.pre_start_failures = 0;
                Step::Lead(session)
            }
            Report::SpawnFailed(errno) => {
                let err = CommandError::from_errno(self.command.program().as_os_str(), errno);
                self.inbox
                    .telemetry
                    .leadership_lost(LossReason::CommandExited, &err.to_string());
                // The keeper runs --post-stop (undoing --pre-start), then exits.
                let _ = self
                    .inbox
                    .stop_if_running(leading.job.take(), kill_signal)
                    .await;
                // Recorded as failed, with 126 or 127, like a shell would report it.
                shift.exited(ChildStatus::Exited(i32::from(err.exit_code())));
                shift.settle(None, timeout).await;
                self.step_down(None, shift, session, None, Leave::Release)
                    .await;
                return Err(err.into());
            }
            // Come after the command's end, which the stop of what it left reads them after.
            Report::Done(_) | Report::PostStop(_) => Step::Lead(session),
            // The keeper stops the command by itself: pgleader did not run past its deadline.
            Report::Expired(_) => Step::Lost(
                session,
                LossReason::CheckTimeout,
                leading.keepers.lost_reason(),
            ),
            Report::PreStartFailed(code) => {
                let why = format!("its --pre-start failed ({})", hook::describe(code));
                self.inbox
                    .telemetry
                    .leadership_lost(LossReason::PreStartFailed, &why);
                notify::status(&format!("{why}; releasing the lock"));
                // The keeper runs --post-stop, then reports that nothing is left.
                if let Some(job) = leading.job.take()
                    && let Some((_, stop)) = Stop::after_end(
                        &job,
                        report,
                        kill_signal,
                        self.inbox.rules,
                        Label::leader(),
                    )
                {
                    self.inbox.drive(job, stop).await;
                }
                shift.settle(Some((None, &why)), timeout).await;
                self.duty.end(shift);
                self.release(session).await;
                Step::Over(Led::PreStartFailed)
            }
            Report::Exited(_) | Report::Killed(_) => {
                let rules = self.inbox.rules;
                let Some((status, stop)) = leading.job.as_ref().and_then(|job| {
                    Stop::after_end(job, report, kill_signal, rules, Label::leader())
                }) else {
                    return Ok(Step::Lead(session));
                };
                self.inbox.telemetry.command_exited(status);
                Step::Exited(
                    session,
                    status,
                    leading.job.take().map(|job| Box::new((job, stop))),
                )
            }
        })
    }

    /// The leadership is lost: logged, published, and stepped down from, closing the session.
    async fn lose(
        &mut self,
        session: B::Session,
        loss: LossReason,
        lost_reason: String,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> Led {
        // Whatever pgleader heard first on waking, its keeper acted before it.
        let lost_reason = if leading.keepers.has_expired() {
            leading.keepers.lost_reason()
        } else {
            lost_reason
        };
        warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %lost_reason, "leadership lost");
        self.inbox.telemetry.leadership_lost(loss, &lost_reason);
        self.last_disturbance = Some(Instant::now());
        notify::status(&format!(
            "leadership lost ({lost_reason}); stopping the command"
        ));
        // If the session still works, the ledger learns the truth now (a statement that
        // succeeds on it runs while it holds the lock); else the next leader marks the run
        // interrupted, and this replica records a finished run's outcome on its next session.
        // The session is closed only then: until the command is gone, it keeps the lock (or
        // the server has already freed it, in which case closing changes nothing).
        let status = self
            .step_down(
                leading.job.take(),
                shift,
                session,
                Some(&lost_reason),
                Leave::Close,
            )
            .await;
        if status.is_none()
            && self.duty.has_unrecorded()
            && let Some(status) = leading.last_status
        {
            return Led::Unrecorded(status);
        }
        Led::Lost { status }
    }

    /// The command exited on its own: what it left behind is stopped; then the lock is
    /// released, or a scheduled leader keeps it for the next occurrence (`Continue`).
    async fn after_exit(
        &mut self,
        session: B::Session,
        status: ChildStatus,
        leftovers: Option<Box<(Job, Stop)>>,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> ControlFlow<Led, B::Session> {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let scheduled = shift.is_scheduled();
        if !scheduled {
            self.inbox.telemetry.leadership_lost(
                LossReason::CommandExited,
                &format!("the command exited ({status})"),
            );
        }
        notify::status(&if scheduled {
            format!("the command exited ({status}); waiting for the next occurrence")
        } else {
            format!("the command exited ({status}); releasing the lock")
        });
        // Whatever it left behind in its process group goes too, before the lock is released
        // or the next occurrence runs.
        if let Some(leftovers) = leftovers {
            let (job, stop) = *leftovers;
            self.inbox.drive(job, stop).await;
        }
        // A scheduled leader keeps the lock between runs, and parks a fresh keeper for the
        // next occurrence; unless a TERM came while the leftovers were being stopped.
        if !shift.exited(status) {
            self.release(session).await;
            return ControlFlow::Break(Led::Exited(status));
        }
        if self.inbox.shutdown_requested.is_some() {
            self.step_down(None, shift, session, None, Leave::Release)
                .await;
            return ControlFlow::Break(Led::Shutdown(None));
        }
        leading.last_status = Some(status);
        // The stop (what the run left, its --post-stop) held no checks.
        if let Some(sent) = self.confirm_now(&session, shift).await
            && leading.keepers.renew(sent + interval + timeout).is_ok()
        {
            leading.deadline = sent + interval + timeout;
            leading.next_check = sent + interval;
        }
        self.park_keeper().await;
        ControlFlow::Continue(session)
    }

    /// Ends a leadership on purpose, with the command running or not: published as lost
    /// (`loss`: why, for the telemetry), then stepped down from, a stopped run recorded as
    /// interrupted for `why`, and the lock released.
    async fn hand_over(
        &mut self,
        (loss, reason): (LossReason, &str),
        why: &str,
        session: B::Session,
        leading: &mut Leading,
        shift: &mut Shift<B::Session>,
    ) -> Option<ChildStatus> {
        self.inbox.telemetry.leadership_lost(loss, reason);
        self.step_down(
            leading.job.take(),
            shift,
            session,
            Some(why),
            Leave::Release,
        )
        .await
    }

    /// Ends a leadership on purpose or after its loss, the one way every path takes: stops the
    /// command (if `job`), brings the ledger up to date (recording a stopped run as interrupted
    /// for `why`), keeps what the next leadership needs, then releases the lock or closes the
    /// session, never before the command's whole process group is gone.
    async fn step_down(
        &mut self,
        job: Option<Job>,
        shift: &mut Shift<B::Session>,
        session: B::Session,
        why: Option<&str>,
        leave: Leave,
    ) -> Option<ChildStatus> {
        let status = self
            .inbox
            .stop_if_running(job, self.settings.kill_signal)
            .await;
        log_final(status);
        if let Some(why) = why {
            let timeout = match leave {
                Leave::Release => self.settings.check_timeout,
                // The session is in doubt: less time for the ledger.
                Leave::Close => self.settings.check_timeout / 2,
            };
            shift.settle(Some((status, why)), timeout).await;
        }
        self.duty.end(shift);
        match leave {
            Leave::Release => self.release(session).await,
            Leave::Close => drop(session),
        }
        status
    }

    /// Confirms the lock at once, out of turn: after a stop between a schedule's runs (what a
    /// run left behind, its `--post-stop`), which may outlast the deadline while no check is
    /// sent. When the lock is still held, returns when the check was sent, the new base of the
    /// deadline; otherwise the deadline stands, and the loop finds the loss.
    async fn confirm_now(
        &mut self,
        session: &B::Session,
        shift: &mut Shift<B::Session>,
    ) -> Option<Instant> {
        let sent = Instant::now();
        let result = tokio::time::timeout(self.settings.check_timeout, session.confirm()).await;
        let Ok(Ok(Check {
            confirmation: Confirmation::Held,
            server_time,
        })) = result
        else {
            return None;
        };
        self.inbox.telemetry.check_completed(sent.elapsed(), true);
        shift.observe_check(sent, Instant::now(), server_time);
        Some(sent)
    }

    /// When a leadership that starts now is to be handed over, and which option asked for it.
    fn relinquish_at(&self) -> Option<(Instant, &'static str)> {
        let after = self
            .settings
            .relinquish_after
            .map(|after| (Instant::now() + after, "--relinquish-after"));
        let scheduled = self
            .settings
            .relinquish_schedule
            .as_ref()
            .and_then(|schedule| {
                let now = jiff::Zoned::now();
                let next = schedule.find_next_occurrence(&now, false).ok()?;
                let wait = crate::time::elapsed(now.timestamp(), next.timestamp());
                Some((Instant::now() + wait, "--relinquish-schedule"))
            });
        match (after, scheduled) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (one, other) => one.or(other),
        }
    }

    fn child_env(
        &self,
        session_id: i32,
        epoch: i64,
        scheduled: Option<(jiff::Timestamp, i32)>,
    ) -> Vec<(&'static str, String)> {
        let mut env = self.settings.leader_env(session_id, epoch);
        if let Some((occurrence, attempt)) = scheduled {
            env.push(("PGLEADER_SCHEDULED_TIME", rfc3339(occurrence)));
            env.push(("PGLEADER_ATTEMPT", attempt.to_string()));
        }
        env
    }

    /// Releases the lock explicitly so the next waiter is granted it at once, then closes.
    async fn release(&mut self, session: B::Session) {
        let lock = &self.settings.lock;
        match session.release(self.settings.check_timeout).await {
            Ok(()) => info!(event = "released", lock = %lock, "released the lock"),
            Err(err) => {
                warn!(event = "release_failed", lock = %lock, reason = %err, "cannot release the lock explicitly; closing the session frees it")
            }
        }
    }
}

/// When the first command of a leadership got past each step: the lock granted, the fencing
/// token in hand (durable on the server; on PostgreSQL a follower's grant brings it, and the
/// step is the round trip that bases the leader's deadline), the keeper handed what it needs,
/// and (when logged) the keeper's report that the command was executed. Under a takeover
/// delay, a restart fence or a schedule, the wait shows between the fence and the keeper.
struct Timeline {
    granted: Instant,
    fenced: Instant,
    handed: Option<Instant>,
}

impl Timeline {
    /// Logs the steps at debug level.
    fn log(self, executed: Instant) {
        let Some(handed) = self.handed else {
            return;
        };
        let ms =
            |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
        debug!(
            event = "start_timeline",
            fence_ms = ms(self.granted, self.fenced),
            keeper_ms = ms(self.fenced, handed),
            exec_ms = ms(handed, executed),
            total_ms = ms(self.granted, executed),
            "from the lock granted to the command executed"
        );
    }
}

fn log_final(status: Option<ChildStatus>) {
    if let Some(status) = status {
        debug!(event = "stopped", status = %status, "the command was stopped");
    }
}
