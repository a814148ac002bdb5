//! The leading phase: fence, start the command when the duty says so, check the lock until
//! something ends the leadership, then step down, the one way every path takes (stop the
//! command's whole group, settle the ledger, release or close).

use anyhow::bail;
use nix::sys::signal::Signal;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use super::{CheckFuture, LeadEvent, Leave, Led, Supervisor};
use crate::election::ledger::LedgerError;
use crate::election::{Backend, Check, Confirmation, Session, SessionError};
use crate::exit::ChildStatus;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::schedule::calendar::rfc3339;
use crate::supervise::duty::{Next, Shift};
use crate::supervise::hook;
use crate::supervise::keeper::handle::{CommandError, Job};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::signals::SignalEvent;
use crate::supervise::stop::status_of;
use crate::supervise::watchdog::Deadline;
use crate::time::for_people as fmt;

impl<B: Backend> Supervisor<B> {
    /// Leads: fences, starts the command when the duty says so, checks the lock until
    /// something ends the leadership. `granted` is when the lock was won.
    pub(super) async fn lead(
        &mut self,
        mut session: B::Session,
        granted: Instant,
    ) -> anyhow::Result<Led> {
        let lock = self.settings.lock.clone();
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);

        // The fencing token. The server processes this request after it was sent, so the
        // server keeps the lock at least a lease past `sent`: a safe base for the leader's own
        // deadline.
        // Listening for step-down requests goes out beside it: no round trip of its own.
        let sent = Instant::now();
        let (mut requests, listening) = session.listen();
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
        let fence = match fenced {
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
            backend_pid = session.id(),
            epoch,
            "became leader"
        );
        notify::leading(&lock, epoch, &self.settings.command.display());
        self.inbox.telemetry.leading(epoch, session.id());
        let delay = self.settings.start_delay(
            self.last_disturbance,
            fence.since_server_reset,
            session.age(),
        );
        let mut shift = self.duty.begin(
            &session,
            &lock,
            &fence,
            (sent, fence_received),
            Instant::now() + delay,
        );

        let mut deadline = sent + interval + timeout;
        // The same deadline, shared with the command's keeper, which stops the tree by itself
        // should it pass unrenewed (pgleader stopped, hung or starved).
        let keepers = match Deadline::new(self.settings.deadline_terms(), deadline) {
            Ok(keepers) => keepers,
            Err(err) => {
                // Without it a frozen pgleader's command could outlive the lease: not leading.
                warn!(event = "leadership_lost", lock = %lock, reason = %err, "cannot share the leader's deadline with the command's keeper (memfd); giving the lock up");
                self.duty.end(&shift);
                self.release(session).await;
                return Ok(Led::Lost { status: None });
            }
        };
        let mut next_check = sent + interval;
        let mut check: Option<(Instant, CheckFuture)> = None;
        let mut job: Option<Job> = None;
        let relinquish_at = self.relinquish_at();
        let mut last_status: Option<ChildStatus> = None;
        // The first command's way from the grant to its exec, for the debug log.
        let mut timeline = Some(Timeline {
            granted,
            fenced: fence_received,
            handed: None,
        });

        'leading: loop {
            // Biased: after a stall (SIGSTOP, a VM pause, a starved CPU) several arms are ready
            // at once, and the end of the leadership must win over everything, starting the
            // command above all.
            let event = tokio::select! {
                biased;
                reason = session.ended() => LeadEvent::Ended(reason),
                _ = sleep_until(deadline) => LeadEvent::Deadline,
                result = async { match &mut check { Some((_, future)) => future.await, None => std::future::pending().await } } => LeadEvent::CheckDone(result),
                event = self.inbox.next_signal() => LeadEvent::Signal(event),
                report = async { match &mut job { Some(job) => job.next_report().await, None => std::future::pending().await } } => LeadEvent::Report(report),
                _ = sleep_until(next_check), if check.is_none() => LeadEvent::CheckDue,
                _ = sleep_until(relinquish_at.map_or(deadline, |(at, _)| at)), if relinquish_at.is_some() => LeadEvent::Relinquish,
                Some(request) = requests.recv() => LeadEvent::StepDown(request),
                () = self.health.turned_unhealthy() => LeadEvent::Unhealthy,
                next = shift.next() => LeadEvent::Duty(next),
            };
            let (status, leftovers) = 'exited: {
                let (loss, lost_reason) = match event {
                    LeadEvent::Duty(Next::Start(_))
                        if Instant::now() >= deadline || keepers.has_expired() =>
                    {
                        (
                            LossReason::CheckTimeout,
                            "the leadership expired before the command could start".to_owned(),
                        )
                    }
                    LeadEvent::Duty(Next::Start(scheduled)) => {
                        let env = self.child_env(session.id(), epoch, scheduled);
                        job = Some(self.spawn(&env, &session.lend(), &keepers).await?);
                        if let Some(timeline) = &mut timeline {
                            timeline.handed.get_or_insert_with(Instant::now);
                        }
                        shift.started();
                        continue 'leading;
                    }
                    LeadEvent::Duty(Next::Done) => {
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::CommandExited, "the timer's run is over");
                        self.step_down(None, &mut shift, session, None, Leave::Release)
                            .await;
                        return Ok(Led::Exited(
                            last_status.unwrap_or(ChildStatus::Signaled(Signal::SIGKILL)),
                        ));
                    }
                    LeadEvent::Duty(Next::NothingToRun) => {
                        self.inbox.telemetry.leadership_lost(
                            LossReason::Relinquished,
                            "nothing for this timer to run",
                        );
                        self.step_down(None, &mut shift, session, None, Leave::Release)
                            .await;
                        return Ok(Led::NothingToRun);
                    }
                    LeadEvent::Duty(Next::Disagree(reason)) => {
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::Relinquished, &reason);
                        let why = "its replica disagrees on the schedule";
                        self.step_down(job.take(), &mut shift, session, Some(why), Leave::Release)
                            .await;
                        if self.settings.once {
                            bail!("{reason}");
                        }
                        warn!(event = "schedule_mismatch", lock = %lock, "{reason}; handing the lock over");
                        return Ok(Led::HandedOver);
                    }
                    LeadEvent::Duty(Next::Failed(LedgerError::Fatal(reason))) => {
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::LedgerFailed, &reason);
                        let why = "the ledger cannot be used";
                        self.step_down(job.take(), &mut shift, session, Some(why), Leave::Release)
                            .await;
                        bail!("{reason}");
                    }
                    LeadEvent::Duty(Next::Failed(
                        LedgerError::Query(reason) | LedgerError::Busy(reason),
                    )) => (
                        LossReason::LedgerFailed,
                        format!("a ledger statement failed: {reason}"),
                    ),
                    LeadEvent::CheckDue => {
                        check = Some((Instant::now(), Box::pin(session.confirm())));
                        continue 'leading;
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
                        self.inbox.telemetry.check_completed(sent.elapsed(), held);
                        match result {
                            Ok(Check {
                                confirmation: Confirmation::Held,
                                server_time,
                            }) => {
                                debug!(event = "confirmed", lock = %lock, "the session still holds the lock");
                                shift.observe_check(sent, Instant::now(), server_time);
                                deadline = sent + interval + timeout;
                                next_check = sent + interval;
                                // Fails only if a keeper found the deadline past first: its
                                // command is stopping already.
                                if keepers.renew(deadline).is_ok() {
                                    continue 'leading;
                                }
                                (LossReason::CheckTimeout, keepers.lost_reason())
                            }
                            Ok(Check {
                                confirmation: Confirmation::NotHeld,
                                ..
                            }) => (
                                LossReason::NotHeld,
                                "the check found that this session no longer holds the lock"
                                    .to_owned(),
                            ),
                            Err(err @ SessionError::Unsafe(_)) => {
                                self.inbox
                                    .telemetry
                                    .leadership_lost(LossReason::CheckFailed, &err.to_string());
                                let kill_signal = self.settings.kill_signal;
                                let status =
                                    self.inbox.stop_if_running(job.take(), kill_signal).await;
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
                        self.inbox.telemetry.leadership_lost(
                            LossReason::Relinquished,
                            &format!("handing over ({why})"),
                        );
                        let status = self
                            .step_down(job.take(), &mut shift, session, Some(why), Leave::Release)
                            .await;
                        return Ok(Led::Relinquished(status));
                    }
                    LeadEvent::StepDown(request) => {
                        info!(event = "step_down", lock = %lock, request = %request, "asked to step down (pgleader step-down): stopping the command, then releasing the lock for the next waiting replica");
                        notify::status("stepping down on request");
                        self.inbox.telemetry.leadership_lost(
                            LossReason::SteppedDown,
                            &format!("asked to step down (request {request})"),
                        );
                        let why = "asked to step down";
                        let status = self
                            .step_down(job.take(), &mut shift, session, Some(why), Leave::Release)
                            .await;
                        return Ok(Led::SteppedDown(status));
                    }
                    LeadEvent::Unhealthy => {
                        let why = "the health probe failed (--health-cmd)";
                        warn!(event = "health_step_down", lock = %lock, "stepping down: {why}; not queueing again until it passes");
                        notify::status("unhealthy: stepping down until the health probe passes");
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::Unhealthy, why);
                        let status = self
                            .step_down(job.take(), &mut shift, session, Some(why), Leave::Release)
                            .await;
                        return Ok(Led::Unhealthy(status));
                    }
                    // A closed signal channel (nothing more can come) counts as a TERM.
                    LeadEvent::Signal(event @ (Some(SignalEvent::Shutdown(_)) | None)) => {
                        let signal = match event {
                            Some(SignalEvent::Shutdown(signal)) => signal,
                            _ => Signal::SIGTERM,
                        };
                        self.inbox.begin_shutdown(
                            signal,
                            "shutting down: stopping the command, then releasing the lock",
                        );
                        let status = self.inbox.stop_if_running(job.take(), signal).await;
                        shift
                            .settle(Some((status, "pgleader was shut down")), timeout)
                            .await;
                        self.step_down(None, &mut shift, session, None, Leave::Release)
                            .await;
                        return Ok(Led::Shutdown(status));
                    }
                    LeadEvent::Signal(event) => {
                        // A keeper killed from outside: the command is gone with it.
                        if self.inbox.handle_signal(event, job.as_mut())
                            && let Some(mut vanished) = job.take_if(|job| job.is_finished())
                        {
                            let status = self.inbox.vanished(&mut vanished);
                            // Whatever it left in its group is SIGKILLed: no keeper is left to
                            // stop it gracefully.
                            break 'exited (status, Some((vanished, Signal::SIGKILL)));
                        }
                        continue 'leading;
                    }
                    LeadEvent::Report(Report::Started(pid)) => {
                        if let Some(timeline) = timeline.take() {
                            timeline.log(Instant::now());
                        }
                        info!(event = "child_started", pid, command = %self.settings.command.display(), "started the command");
                        self.inbox.telemetry.command_started(pid);
                        self.pre_start_failures = 0;
                        continue 'leading;
                    }
                    LeadEvent::Report(Report::SpawnFailed(errno)) => {
                        let err = CommandError::from_errno(
                            self.settings.command.program().as_os_str(),
                            errno,
                        );
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::CommandExited, &err.to_string());
                        // The keeper runs --post-stop (undoing --pre-start), then exits.
                        let kill_signal = self.settings.kill_signal;
                        let _ = self.inbox.stop_if_running(job.take(), kill_signal).await;
                        // Recorded as failed, with 126 or 127, like a shell would report it.
                        shift.exited(ChildStatus::Exited(i32::from(err.exit_code())));
                        shift.settle(None, timeout).await;
                        self.step_down(None, &mut shift, session, None, Leave::Release)
                            .await;
                        return Err(err.into());
                    }
                    // Come after the command's end, which `Inbox::stop` below reads them after.
                    LeadEvent::Report(Report::Done(_) | Report::PostStop(_)) => continue 'leading,
                    // The keeper stops the command by itself: pgleader did not run past its
                    // deadline.
                    LeadEvent::Report(Report::Expired(_)) => {
                        (LossReason::CheckTimeout, keepers.lost_reason())
                    }
                    LeadEvent::Report(Report::PreStartFailed(code)) => {
                        let why = format!("its --pre-start failed ({})", hook::describe(code));
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::PreStartFailed, &why);
                        notify::status(&format!("{why}; releasing the lock"));
                        // The keeper runs --post-stop, then reports that nothing is left.
                        if let Some(job) = job.take() {
                            let kill_signal = self.settings.kill_signal;
                            // Stopped as a command that ended with its --pre-start.
                            let ended = ChildStatus::Exited(code.max(1));
                            self.inbox.stop(job, kill_signal, Some(ended)).await;
                        }
                        shift.settle(Some((None, &why)), timeout).await;
                        self.duty.end(&shift);
                        self.release(session).await;
                        return Ok(Led::PreStartFailed);
                    }
                    LeadEvent::Report(report) => {
                        let status = status_of(report);
                        self.inbox.command_exited(status);
                        let kill_signal = self.settings.kill_signal;
                        break 'exited (status, job.take().map(|job| (job, kill_signal)));
                    }
                };
                // Whatever pgleader heard first on waking, its keeper acted before it.
                let lost_reason = if keepers.has_expired() {
                    keepers.lost_reason()
                } else {
                    lost_reason
                };
                warn!(event = "leadership_lost", lock = %lock, reason = %lost_reason, "leadership lost");
                self.inbox.telemetry.leadership_lost(loss, &lost_reason);
                self.last_disturbance = Some(Instant::now());
                notify::status(&format!(
                    "leadership lost ({lost_reason}); stopping the command"
                ));
                // If the session still works, the ledger learns the truth now (a statement that
                // succeeds on it runs while it holds the lock); else the next leader marks the run
                // interrupted, and this replica records a finished run's outcome on its next
                // session. The session is closed only then: until the command is gone, it keeps
                // the lock (or the server has already freed it, in which case closing changes
                // nothing).
                let status = self
                    .step_down(
                        job.take(),
                        &mut shift,
                        session,
                        Some(&lost_reason),
                        Leave::Close,
                    )
                    .await;
                if status.is_none()
                    && self.duty.has_unrecorded()
                    && let Some(status) = last_status
                {
                    return Ok(Led::Unrecorded(status));
                }
                return Ok(Led::Lost { status });
            };
            // The command exited on its own.
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
            // Whatever it left behind in its process group goes too, before the lock is
            // released or the next occurrence runs.
            if let Some((job, signal)) = leftovers {
                self.inbox.stop(job, signal, Some(status)).await;
            }
            // A scheduled leader keeps the lock between runs, and parks a fresh keeper for the
            // next occurrence; unless a TERM came while the leftovers were being stopped.
            if !shift.exited(status) {
                self.release(session).await;
                return Ok(Led::Exited(status));
            }
            if self.inbox.shutdown_requested.is_some() {
                self.step_down(None, &mut shift, session, None, Leave::Release)
                    .await;
                return Ok(Led::Shutdown(None));
            }
            last_status = Some(status);
            // The stop (what the run left, its --post-stop) held no checks.
            if let Some(sent) = self.confirm_now(&session, &mut shift).await
                && keepers.renew(sent + interval + timeout).is_ok()
            {
                deadline = sent + interval + timeout;
                next_check = sent + interval;
            }
            self.park_keeper().await;
        }
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
