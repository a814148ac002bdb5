//! What the supervisor hears besides the backend, and what it does to the command in answer:
//! the signal events and what each means ([`SignalMeaning`]: TERM and INT to shut down, HUP
//! under `pgleader cron` to reread the crontab, CHLD to reap, others to pass on), and the
//! single leader's way of stopping its job: awaiting the stop machine (`stop.rs`) step by step.
//!
//! The [`Inbox`] owns the signal channel and remembers when a shutdown was asked for, so that a
//! second TERM can escalate to SIGKILL wherever it arrives: while the command runs, while it is
//! being stopped, or while pgleader waits. Every room reads signals through it
//! ([`Inbox::meaning`], the one place that says which signal means what), and whoever runs many
//! commands at once (`commands.rs`) passes signals on and reaps through the same two functions
//! ([`forward`], [`reap`]).

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{debug, info, warn};

use crate::exit::ChildStatus;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::Telemetry;
use crate::supervise::keeper::handle::{self, Job};
use crate::supervise::label::Label;
use crate::supervise::signals::SignalEvent;
use crate::supervise::stop::{Stop, StopRules};

/// A second TERM or INT sends SIGKILL at once, unless it follows the first this closely.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// What a TERM or INT asks for, given the ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// The first: finish what is under way, then exit.
    First,
    /// The same signal again at once (`timeout(1)` and some process managers send TERM to the
    /// process and to its group): nothing more.
    Repeated,
    /// A later one: kill now.
    Insist,
}

/// What a signal event means to pgleader, whatever it is doing: the one reading of signals
/// ([`Inbox::meaning`]) that the single leader, a stop under way and the shard room all act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalMeaning {
    /// TERM or INT, or the signal channel's end before any shutdown was asked for (nothing more
    /// can come: taken as a TERM); with what it asks for given the ones before it.
    Shutdown(Signal, Shutdown),
    /// HUP or USR2 under `pgleader cron`: reread the crontab (remembered in
    /// [`Inbox::reread_requested`]).
    Reread,
    /// Pass it on to the commands' process groups.
    Forward(Signal),
    /// A child changed state: reap.
    Reap,
    /// The signal channel ended after a shutdown was asked for: nothing more can come.
    Closed,
}

/// The signal events, the shutdown state, and where transitions are published.
#[derive(Debug)]
pub struct Inbox {
    signals: UnboundedReceiver<SignalEvent>,
    /// False once the signal channel has closed (which means: shut down).
    signals_open: bool,
    /// When the first TERM or INT arrived: finish what is under way, then exit.
    pub shutdown_requested: Option<Instant>,
    /// Where the state goes for the HTTP endpoint; publishing never waits.
    pub telemetry: Telemetry,
    /// `--kill-timeout` and `--hook-timeout`, for every stop.
    pub rules: StopRules,
    /// `pgleader cron`: HUP and USR2 (supercronic's reload) reread the crontab rather than being
    /// passed on.
    pub rereads: bool,
    /// A HUP that asks for a reread came and is not acted on yet.
    pub reread_requested: bool,
}

impl Inbox {
    pub fn new(
        signals: UnboundedReceiver<SignalEvent>,
        telemetry: Telemetry,
        rules: StopRules,
    ) -> Inbox {
        Inbox {
            signals,
            signals_open: true,
            shutdown_requested: None,
            telemetry,
            rules,
            rereads: false,
            reread_requested: false,
        }
    }

    /// The next signal event; `None` once, when the channel closes (nothing more can come: no
    /// second TERM, no SIGCHLD), and never anything after that. Cancel-safe.
    pub async fn next_signal(&mut self) -> Option<SignalEvent> {
        if !self.signals_open {
            return std::future::pending().await;
        }
        let event = self.signals.recv().await;
        self.signals_open = event.is_some();
        event
    }

    /// What `event` means (see [`SignalMeaning`]); the first TERM or INT and a HUP asking for
    /// a reread are remembered.
    pub fn meaning(&mut self, event: Option<SignalEvent>) -> SignalMeaning {
        match event {
            Some(SignalEvent::Shutdown(received)) => {
                SignalMeaning::Shutdown(received, self.shutdown_signal(received))
            }
            None if self.shutdown_requested.is_none() => {
                SignalMeaning::Shutdown(Signal::SIGTERM, self.shutdown_signal(Signal::SIGTERM))
            }
            None => SignalMeaning::Closed,
            Some(SignalEvent::Forward(Signal::SIGHUP | Signal::SIGUSR2)) if self.rereads => {
                self.reread_requested = true;
                SignalMeaning::Reread
            }
            // Only a crontab is watched (`--inotify`), and a crontab rereads.
            Some(SignalEvent::CrontabChanged) => {
                self.reread_requested = true;
                SignalMeaning::Reread
            }
            Some(SignalEvent::Forward(signal)) => SignalMeaning::Forward(signal),
            Some(SignalEvent::ChildStateChanged) => SignalMeaning::Reap,
        }
    }

    /// What a TERM or INT asks for, given the ones before it; the first is remembered.
    fn shutdown_signal(&mut self, received: Signal) -> Shutdown {
        match self.shutdown_requested {
            Some(first) if first.elapsed() < REPEAT_WINDOW => {
                debug!(
                    event = "repeated_signal",
                    signal = received.as_str(),
                    "ignoring a repeated shutdown signal"
                );
                Shutdown::Repeated
            }
            Some(_) => Shutdown::Insist,
            None => {
                self.shutdown_requested = Some(Instant::now());
                Shutdown::First
            }
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

    /// The first TERM or INT while not leading, or while the command is being stopped
    /// already: logged as `what` happens next, told to systemd and published.
    fn note_shutdown(&mut self, signal: Signal, what: &str) {
        info!(event = "shutdown", signal = signal.as_str(), "{what}");
        notify::stopping(what);
        self.telemetry.shutting_down();
    }

    /// Stops a job if there is one; its status if it ran.
    pub async fn stop_if_running(
        &mut self,
        job: Option<Job>,
        signal: Signal,
    ) -> Option<ChildStatus> {
        match job {
            Some(job) => Some(self.stop(job, signal).await),
            None => None,
        }
    }

    /// Stops a job by the stop machine's rules (`stop.rs`) and publishes how its command
    /// ended. Returns once nothing of the job is left.
    pub async fn stop(&mut self, job: Job, signal: Signal) -> ChildStatus {
        let stop = Stop::begin(&job, signal, self.rules, Label::leader());
        let status = self.drive(job, stop).await;
        self.telemetry.command_exited(status);
        status
    }

    /// Awaits each step of a stop until nothing of the job is left, and answers signals
    /// meanwhile: a first TERM/INT becomes the stop signal, a second one insists.
    pub async fn drive(&mut self, mut job: Job, mut stop: Stop) -> ChildStatus {
        loop {
            if let Some(status) = stop.finish(&mut job, Instant::now()) {
                return status;
            }
            let timer = stop.next_timer();
            tokio::select! {
                _ = async { match timer { Some(at) => sleep_until(at).await, None => std::future::pending().await } } => {
                    stop.on_timer(&job, Instant::now());
                }
                event = self.next_signal() => match self.meaning(event) {
                    SignalMeaning::Shutdown(received, Shutdown::First) => {
                        self.note_shutdown(received, "shutting down once the command has stopped");
                        stop.retarget(&job, received);
                    }
                    SignalMeaning::Shutdown(received, Shutdown::Insist) => stop.insist(&job, received),
                    meaning => {
                        self.on_job_signal(meaning, Some(&mut job));
                    }
                },
                report = job.next_report() => stop.on_report(&job, report),
            }
        }
    }

    /// Does what a signal that is no shutdown means while `job` may run: passes it on, or
    /// reaps. Returns true if a child was reaped.
    pub fn on_job_signal(&mut self, meaning: SignalMeaning, job: Option<&mut Job>) -> bool {
        match meaning {
            SignalMeaning::Forward(signal) => {
                forward(signal, job.into_iter().map(|job| &*job));
                false
            }
            SignalMeaning::Reap => {
                reap(job.into_iter());
                true
            }
            SignalMeaning::Shutdown(..) | SignalMeaning::Reread | SignalMeaning::Closed => false,
        }
    }

    /// Handles a signal while no command runs. Returns true if pgleader should shut down.
    pub fn idle_signal(&mut self, event: Option<SignalEvent>) -> bool {
        match self.meaning(event) {
            SignalMeaning::Shutdown(signal, _) => {
                self.shutdown_requested = Some(Instant::now());
                self.note_shutdown(signal, "shutting down");
                true
            }
            SignalMeaning::Closed => true,
            meaning => {
                self.on_job_signal(meaning, None);
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
                event = self.next_signal() => event,
            };
            if self.idle_signal(event) {
                return false;
            }
        }
    }
}

/// Passes a signal on to the process group of each job.
pub fn forward<'a>(signal: Signal, jobs: impl Iterator<Item = &'a Job>) {
    for job in jobs {
        debug!(
            event = "forward",
            signal = signal.as_str(),
            pgid = job.pgid().as_raw(),
            "passing the signal on to the command"
        );
        if let Err(err) = job.signal(signal) {
            warn!(event = "signal_failed", reason = %err, "cannot pass the signal on");
        }
    }
}

/// Reaps every child that exited, telling the job whose keeper it was.
pub fn reap<'a>(jobs: impl Iterator<Item = &'a mut Job>) {
    let mut jobs: Vec<&mut Job> = jobs.collect();
    for (pid, status) in handle::reap_all() {
        let ours = jobs.iter_mut().any(|job| job.note_reaped(pid, status));
        if !ours {
            debug!(
                event = "reaped",
                pid = pid.as_raw(),
                "reaped an orphaned process"
            );
        }
    }
}
