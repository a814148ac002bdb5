//! What the supervisor hears besides the backend, and what it does to the command in answer:
//! the signal events (TERM and INT to shut down, others to pass on, CHLD to reap), and stopping
//! a job (the stop signal to its process group, `--kill-timeout`, SIGKILL through the keeper,
//! and waiting until no process of the group is left).
//!
//! The [`Inbox`] owns the signal channel and remembers when a shutdown was asked for, so that a
//! second TERM can escalate to SIGKILL wherever it arrives: while the command runs, while it is
//! being stopped, or while pgleader waits.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep};
use tracing::{debug, info, warn};

use crate::exit::ChildStatus;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::Telemetry;
use crate::supervise::job::{self, Job};
use crate::supervise::keeper::Report;
use crate::supervise::signals::SignalEvent;
use crate::time::for_people as fmt;

/// How long the keeper may take to kill everything the command started before its process
/// group is SIGKILLed directly (which kills the keeper too).
pub const KEEPER_GRACE: Duration = Duration::from_secs(1);

/// A second TERM or INT sends SIGKILL at once, unless it follows the first this closely.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

enum StopEvent {
    GraceOver,
    KeeperStuck,
    Signal(Option<SignalEvent>),
    Report(Report),
}

/// The signal events, the shutdown state, and where transitions are published.
#[derive(Debug)]
pub struct Inbox {
    pub signals: UnboundedReceiver<SignalEvent>,
    /// When the first TERM or INT arrived: finish what is under way, then exit.
    pub shutdown_requested: Option<Instant>,
    /// Where the state goes for the HTTP endpoint; publishing never waits.
    pub telemetry: Telemetry,
    /// `--kill-timeout`.
    pub kill_timeout: Duration,
    /// `--hook-timeout`: how long the keeper may run `--post-stop` once the command's tree is
    /// gone.
    pub hook_timeout: Duration,
}

impl Inbox {
    pub fn new(
        signals: UnboundedReceiver<SignalEvent>,
        telemetry: Telemetry,
        kill_timeout: Duration,
        hook_timeout: Duration,
    ) -> Inbox {
        Inbox {
            signals,
            shutdown_requested: None,
            telemetry,
            kill_timeout,
            hook_timeout,
        }
    }

    /// The first TERM or INT while leading: remembered, logged, told to systemd (`what`
    /// happens next) and published.
    pub fn begin_shutdown(&mut self, signal: Signal, what: &str) {
        self.shutdown_requested = Some(Instant::now());
        info!(
            event = "shutdown",
            signal = signal.as_str(),
            "shutting down"
        );
        notify::stopping(what);
        self.telemetry
            .leadership_lost(LossReason::Shutdown, "shutting down");
    }

    /// Stops a job if there is one; its status if it ran.
    pub async fn stop_if_running(
        &mut self,
        job: Option<Job>,
        signal: Signal,
    ) -> Option<ChildStatus> {
        match job {
            Some(job) => Some(self.stop(job, signal, None, false).await),
            None => None,
        }
    }

    /// Stops a job: `signal` (and SIGCONT, for a stopped command) to its process group; once
    /// the kill timeout runs out, or on a second TERM/INT, the keeper SIGKILLs everything the
    /// command started. Returns once the keeper has reported that nothing is left or, without
    /// that report (it was killed from outside), once it is reaped and no member of the group
    /// is left.
    /// `leftovers_only` when the command itself has exited already and only what it left
    /// behind is being stopped.
    pub async fn stop(
        &mut self,
        mut job: Job,
        signal: Signal,
        mut status: Option<ChildStatus>,
        leftovers_only: bool,
    ) -> ChildStatus {
        let pgid = job.pgid().as_raw();
        // What the command should have received by now; sent again if it starts only now (a
        // signal sent to the group before it existed reached just the keeper). Sent before the
        // log line: the next leader waits for this command's end.
        let mut current = signal;
        send_stop_signal(&job, current);
        if !leftovers_only {
            info!(
                event = "stopping",
                pgid,
                signal = signal.as_str(),
                "stopping the command: {} to its process group",
                signal.as_str()
            );
        }
        let grace = sleep(self.kill_timeout);
        tokio::pin!(grace);
        let keeper_grace = sleep(Duration::MAX);
        tokio::pin!(keeper_grace);
        // A stop signal of SIGKILL went through the keeper already (see `send_stop_signal`).
        let (mut escalated, mut keeper_killed) = (signal == Signal::SIGKILL, false);
        if escalated {
            keeper_grace.as_mut().reset(Instant::now() + KEEPER_GRACE);
        }
        // The keeper said the tree is gone and `--post-stop` runs: the kill timeout is over,
        // the hook has a timeout of its own.
        let mut post_stop = false;
        while !job.is_finished() {
            let event = tokio::select! {
                _ = &mut grace, if !escalated && !post_stop => StopEvent::GraceOver,
                _ = &mut keeper_grace, if (escalated || post_stop) && !keeper_killed => StopEvent::KeeperStuck,
                event = self.signals.recv() => StopEvent::Signal(event),
                report = job.next_report() => StopEvent::Report(report),
            };
            let escalate = match event {
                StopEvent::GraceOver => {
                    warn!(
                        event = "kill",
                        pgid,
                        "the command did not exit within {} (--kill-timeout); sending SIGKILL to everything it started",
                        fmt(self.kill_timeout)
                    );
                    true
                }
                StopEvent::KeeperStuck => {
                    warn!(
                        event = "kill",
                        pgid, "the keeper did not finish; sending SIGKILL to the process group"
                    );
                    job.kill_groups();
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
                        Some(_) if post_stop => {
                            warn!(
                                event = "kill",
                                pgid,
                                signal = received.as_str(),
                                "second shutdown signal: killing --post-stop"
                            );
                            let _ = job.abort();
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
                        // `job.is_finished()` now says so.
                        Report::Done(_) => {}
                        // The keeper logged it; post-stop comes next.
                        Report::PreStartFailed(_) => {}
                        Report::PostStop(_) => {
                            post_stop = true;
                            keeper_grace
                                .as_mut()
                                .reset(Instant::now() + self.hook_timeout + KEEPER_GRACE);
                        }
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
                    job.kill_groups();
                }
                keeper_grace.as_mut().reset(Instant::now() + KEEPER_GRACE);
            }
        }
        for report in job.remaining_reports() {
            if matches!(report, Report::Exited(_) | Report::Killed(_)) {
                status.get_or_insert(status_of(report));
            }
        }
        // The keeper's own word that nothing is left is enough; without it (the keeper was
        // killed from outside), the process table is read until the group is gone.
        if !job.reported_done() {
            self.wait_until_group_gone(&job).await;
        }
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
    pub async fn wait_until_group_gone(&mut self, job: &Job) {
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
            job.kill_groups();
            sleep(Duration::from_millis(10)).await;
        }
    }

    /// Handles a signal event while a job may run. Returns true if a child was reaped.
    pub fn handle_signal(&mut self, event: Option<SignalEvent>, job: Option<&mut Job>) -> bool {
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
    pub fn finish_vanished(&mut self, job: Option<&mut Job>) -> Option<ChildStatus> {
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
    pub fn idle_signal(&mut self, event: Option<SignalEvent>) -> bool {
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
    pub async fn pause(&mut self, duration: Duration) -> bool {
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
}

/// A stop signal for the command's process group, followed by SIGCONT so that a stopped
/// command can act on it (as systemd does). SIGKILL goes through the keeper instead, which
/// leads the group and could not survive it: it kills what the command started, wherever it
/// went, and then still runs `--post-stop`.
pub fn send_stop_signal(job: &Job, signal: Signal) {
    if signal == Signal::SIGKILL {
        if job.kill_everything().is_err() {
            job.kill_groups();
        }
        return;
    }
    if let Err(err) = job.signal(signal) {
        warn!(event = "signal_failed", pgid = job.pgid().as_raw(), reason = %err, "cannot signal the process group");
    }
    if signal != Signal::SIGCONT {
        let _ = job.signal(Signal::SIGCONT);
    }
}

pub fn status_of(report: Report) -> ChildStatus {
    match report {
        Report::Killed(signal) => Signal::try_from(signal)
            .map(ChildStatus::Signaled)
            .unwrap_or(ChildStatus::Exited(128 + signal)),
        Report::Exited(code) => ChildStatus::Exited(code),
        Report::Started(_)
        | Report::SpawnFailed(_)
        | Report::Done(_)
        | Report::PreStartFailed(_)
        | Report::PostStop(_) => ChildStatus::Exited(0),
    }
}
