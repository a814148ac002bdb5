//! How a command is stopped: the one set of rules for every command pgleader runs, the single
//! leader's, a shard's and a crontab job's run (DESIGN.md, invariant 10), and, killed at once
//! and quietly, the health probe's (`Stop::kill_quietly`).
//!
//! The rules: the stop signal to the command's process group, then SIGCONT (a stopped command
//! must be able to act on it), sent again if the command starts only now (a signal sent to the
//! group before it existed reached just the keeper); once `--kill-timeout` runs out, or on a
//! second TERM/INT, SIGKILL to everything the command started, through the keeper; a keeper
//! that does not finish within [`KEEPER_GRACE`] has its group SIGKILLed directly; once the
//! keeper says the tree is gone and `--post-stop` runs, the kill timeout is over and the hook
//! has its own timeout (plus the keeper's grace); and a keeper killed from outside is not taken
//! at its word: the process table is read until no process of the group is left.
//!
//! [`Stop`] is a state machine that owns no task and no timer: its owner tells it what
//! happened (a report from the keeper, a timer that came due, a second TERM) and asks it when
//! its next timer is due and whether the command is wholly gone ([`Stop::finish`], asked again
//! after every event and at every timer). The single leader awaits it in a small loop
//! (`Inbox::stop`, through `Inbox::drive`); a table of many commands polls one per command from
//! its own loop (`commands.rs`), so that stopping one never holds up the others.
//!
//! The decisions around a stop are made here once, for every owner: a command that ended on
//! its own or whose `--pre-start` failed ([`Stop::after_end`], [`ended_by`]), a keeper that
//! vanished ([`Stop::vanished`]), a stop asked for ([`Stop::begin`]).

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::exit::ChildStatus;
use crate::supervise::keeper::handle::Job;
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::time::for_people as fmt;

/// How long the keeper may take to kill everything the command started before its process
/// group is SIGKILLed directly (which kills the keeper too).
pub const KEEPER_GRACE: Duration = Duration::from_secs(1);

/// How often the process table is read for what is left of a group whose keeper was killed
/// from outside.
const GROUP_RECHECK: Duration = Duration::from_millis(10);

/// How often a group that will not die is complained about.
const GROUP_WARNING_EVERY: Duration = Duration::from_secs(5);

/// The timings every stop follows: `--kill-timeout` and `--hook-timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopRules {
    pub kill_timeout: Duration,
    /// How long the keeper may run `--post-stop` once the command's tree is gone.
    pub hook_timeout: Duration,
}

/// A stop under way.
#[derive(Debug)]
pub struct Stop {
    label: Label,
    rules: StopRules,
    pgid: i32,
    /// The signal the command should have by now: sent again if it starts only now. Once it
    /// is SIGKILL, the stop has escalated.
    signal: Signal,
    /// When the kill timeout runs out; `None` once SIGKILL was sent or `--post-stop` runs.
    kill_at: Option<Instant>,
    /// The keeper said the tree is gone and runs `--post-stop`.
    post_stop: bool,
    /// When the keeper is given up on and its group SIGKILLed directly; `None` until SIGKILL
    /// or `--post-stop`, and once that was done.
    keeper_kill_at: Option<Instant>,
    /// When to read the process table again, for a group whose keeper was killed from outside.
    recheck_at: Option<Instant>,
    /// When such a group was first found alive, and when to complain about it next.
    alive_since: Option<(Instant, Instant)>,
    /// How the command ended, once a report (or the caller) said so.
    status: Option<ChildStatus>,
    /// Whether the command's end was logged (or known before the stop began).
    exit_logged: bool,
    /// The keeper stops the command by itself (the leadership's deadline passed while pgleader
    /// did not run): no stop signal of pgleader's, only the wait, and SIGKILL on a second
    /// TERM or INT.
    keeper_stops: bool,
    /// Nothing of this stop is logged above debug: its owner says what happened (the health
    /// probe's, [`Stop::kill_quietly`]).
    quiet: bool,
}

impl Stop {
    /// Begins stopping `job`: `signal` to its process group (SIGKILL through the keeper). The
    /// stop is logged, and so is the command's end.
    pub fn begin(job: &Job, signal: Signal, rules: StopRules, label: Label) -> Stop {
        Stop::new(job, signal, rules, label, None, true)
    }

    /// The command ended before any stop began, as the keeper's `report` says ([`ended_by`]):
    /// its end is logged (a failed `--pre-start` the keeper logged already), and what it left
    /// behind in its group is stopped with `signal`, by a stop that knows how it ended. `None`
    /// for a report that says no such thing.
    pub fn after_end(
        job: &Job,
        report: Report,
        signal: Signal,
        rules: StopRules,
        label: Label,
    ) -> Option<(ChildStatus, Stop)> {
        let ended = ended_by(report)?;
        if !matches!(report, Report::PreStartFailed(_)) {
            label.log_exited(ended);
        }
        Some((
            ended,
            Stop::new(job, signal, rules, label, Some(ended), false),
        ))
    }

    /// Clears up after a keeper that vanished (killed from outside) without being stopped:
    /// SIGKILL to what it left in its group, and the command's end logged once it is known.
    pub fn vanished(job: &Job, rules: StopRules, label: Label) -> Stop {
        Stop::new(job, Signal::SIGKILL, rules, label, None, false)
    }

    /// Kills what is left of a job whose end its owner reports itself (a health probe that
    /// timed out, or whose leftovers outlived it): SIGKILL to everything through the keeper,
    /// and its group SIGKILLed directly should the keeper not finish within [`KEEPER_GRACE`];
    /// then [`Stop::next_timer`] says `None`, and the owner may give up. Nothing is logged.
    pub fn kill_quietly(job: &Job, label: Label) -> Stop {
        let rules = StopRules {
            kill_timeout: Duration::ZERO,
            hook_timeout: Duration::ZERO,
        };
        let mut stop = Stop::new(job, Signal::SIGKILL, rules, label, None, false);
        stop.exit_logged = true;
        stop.quiet = true;
        stop
    }

    fn new(
        job: &Job,
        signal: Signal,
        rules: StopRules,
        label: Label,
        ended: Option<ChildStatus>,
        announce: bool,
    ) -> Stop {
        let pgid = job.pgid().as_raw();
        let now = Instant::now();
        // The keeper is told first, then the deadline read: of this stop and a keeper's own,
        // begun at once, exactly one signals the command (`watchdog.rs`). If the keeper stops
        // it already, by the same rules (its kill signal, its kill timeout, SIGKILL), a signal
        // of pgleader's now would be a second stop.
        if signal != Signal::SIGKILL {
            job.tell_stopping();
        }
        if signal != Signal::SIGKILL && job.keeper_stops_itself() {
            info!(
                event = "stopping",
                shard = label.shard,
                job = label.job.as_deref(),
                pgid,
                "the keeper stops the command{} by itself: pgleader did not run past its deadline",
                label.of(),
            );
            return Stop {
                label,
                rules,
                pgid,
                signal,
                kill_at: None,
                post_stop: false,
                // Its own kill timeout ran from before now; this is the fallback should the
                // keeper not finish.
                keeper_kill_at: Some(now + rules.kill_timeout + KEEPER_GRACE),
                recheck_at: None,
                alive_since: None,
                status: ended,
                exit_logged: ended.is_some(),
                keeper_stops: true,
                quiet: false,
            };
        }
        // Sent before the log line: the next leader waits for this command's end.
        send_stop_signal(job, signal);
        if announce {
            info!(
                event = "stopping",
                shard = label.shard,
                job = label.job.as_deref(),
                pgid,
                signal = signal.as_str(),
                "stopping the command{}: {} to its process group",
                label.of(),
                signal.as_str()
            );
        }
        let escalated = signal == Signal::SIGKILL;
        Stop {
            label,
            rules,
            pgid,
            signal,
            kill_at: (!escalated).then_some(now + rules.kill_timeout),
            post_stop: false,
            // A stop signal of SIGKILL went through the keeper already.
            keeper_kill_at: escalated.then_some(now + KEEPER_GRACE),
            recheck_at: None,
            alive_since: None,
            status: ended,
            exit_logged: ended.is_some(),
            keeper_stops: false,
            quiet: false,
        }
    }

    /// Whether SIGKILL went to everything the command started.
    fn escalated(&self) -> bool {
        self.signal == Signal::SIGKILL
    }

    /// The next moment [`Stop::on_timer`] has something to do.
    pub fn next_timer(&self) -> Option<Instant> {
        [self.kill_at, self.keeper_kill_at, self.recheck_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// Takes the steps whose time has come: SIGKILL once the kill timeout ran out, SIGKILL to
    /// the group of a keeper that did not finish.
    pub fn on_timer(&mut self, job: &Job, now: Instant) {
        if self.kill_at.is_some_and(|at| at <= now) && !job.is_finished() {
            self.label.warn_kill(
                self.pgid,
                None,
                format_args!(
                    "the command{} did not exit within {} (--kill-timeout); sending SIGKILL to everything it started",
                    self.label.of(),
                    fmt(self.rules.kill_timeout)
                ),
            );
            self.escalate(job);
        } else if self.keeper_kill_at.is_some_and(|at| at <= now) {
            if !self.quiet {
                self.label.warn_kill(
                    self.pgid,
                    None,
                    format_args!(
                        "the keeper{} did not finish; sending SIGKILL to the process group",
                        self.label.of()
                    ),
                );
            }
            job.kill_groups();
            self.keeper_kill_at = None;
        }
    }

    /// A report from the keeper while the command is being stopped.
    pub fn on_report(&mut self, job: &Job, report: Report) {
        match report {
            Report::Exited(_) | Report::Killed(_) => {
                let ended = *self.status.get_or_insert(status_of(report));
                if !std::mem::replace(&mut self.exit_logged, true) {
                    self.label.log_exited(ended);
                }
            }
            Report::Started(pid) => {
                debug!(
                    event = "child_started",
                    shard = self.label.shard,
                    job = self.label.job.as_deref(),
                    pid,
                    "the command started while being stopped"
                );
                // Under a keeper of its own the signal went to a group where only the keeper
                // was (it blocks signals); a session's keeper sends it after the start.
                if !self.keeper_stops && !job.signals_follow_start() {
                    send_stop_signal(job, self.signal);
                }
            }
            Report::PostStop(_) => {
                self.post_stop = true;
                self.kill_at = None;
                self.keeper_kill_at = Some(Instant::now() + self.rules.hook_timeout + KEEPER_GRACE);
            }
            // The keeper logged it; post-stop comes next.
            Report::PreStartFailed(_) => {
                self.status = self.status.or(ended_by(report));
                self.exit_logged = true;
            }
            // The keeper exits with 126/127 right after; its status stands for the command's.
            // `Done`: `job.is_finished()` now says so. `Expired`: the keeper stops the command
            // by itself, with a stop of pgleader's under way: that stop's rules stand.
            Report::SpawnFailed(_) | Report::Done(_) | Report::Expired(_) => {}
        }
    }

    /// The first TERM or INT arrived while the command was being stopped: unless SIGKILL went
    /// already, the command gets that signal instead.
    pub fn retarget(&mut self, job: &Job, signal: Signal) {
        if !self.escalated() && !self.keeper_stops {
            self.signal = signal;
            send_stop_signal(job, signal);
        }
    }

    /// A second TERM or INT: SIGKILL to everything at once; once that went, or while
    /// `--post-stop` runs, the keeper ends that too.
    pub fn insist(&mut self, job: &Job, received: Signal) {
        let what = if self.post_stop {
            "killing --post-stop"
        } else if self.escalated() {
            "SIGKILL was sent already; ending everything now"
        } else {
            "sending SIGKILL"
        };
        self.label.warn_kill(
            self.pgid,
            Some(received),
            format_args!("second shutdown signal: {what}"),
        );
        if self.escalated() || self.post_stop {
            let _ = job.abort();
        } else {
            self.escalate(job);
        }
    }

    /// How the command ended once nothing of it is left, else `None`: ask again after the next
    /// event or at the next timer. Without the keeper's word that nothing is left, this is
    /// where the group is SIGKILLed and the process table read again every 10 ms.
    pub fn finish(&mut self, job: &mut Job, now: Instant) -> Option<ChildStatus> {
        if !job.is_finished() {
            return None;
        }
        // The keeper's own word that nothing is left is enough; without it (the keeper was
        // killed from outside, its children reparented to init, or a killed process is stuck
        // in the kernel) the process table is read until the group is gone.
        if !job.reported_done() {
            if self.recheck_at.is_some_and(|at| at > now) {
                return None;
            }
            let members = job.group_members();
            if !members.is_empty() {
                let (since, warn_at) = self.alive_since.get_or_insert((now, now));
                if now >= *warn_at {
                    warn!(
                        event = "group_alive",
                        shard = self.label.shard,
                        job = self.label.job.as_deref(),
                        pgid = self.pgid,
                        "{} process(es) of the command's group are still alive after {} (pids {members:?}); sending SIGKILL and waiting before releasing the lock",
                        members.len(),
                        fmt(now.duration_since(*since))
                    );
                    *warn_at = now + GROUP_WARNING_EVERY;
                }
                job.kill_groups();
                // SIGKILL went to the group: the stop's own steps are over.
                (self.kill_at, self.keeper_kill_at) = (None, None);
                self.recheck_at = Some(now + GROUP_RECHECK);
                return None;
            }
        }
        debug!(
            event = "group_stopped",
            shard = self.label.shard,
            job = self.label.job.as_deref(),
            pgid = self.pgid,
            "the process group is gone"
        );
        let status = end_of(job, self.status);
        if !std::mem::replace(&mut self.exit_logged, true) {
            self.label.log_exited(status);
        }
        Some(status)
    }

    /// SIGKILL to everything the command started, through the keeper (or to the group
    /// directly if the keeper cannot be asked), and a grace for the keeper to finish.
    fn escalate(&mut self, job: &Job) {
        self.signal = Signal::SIGKILL;
        self.kill_at = None;
        send_stop_signal(job, Signal::SIGKILL);
        self.keeper_kill_at = Some(Instant::now() + KEEPER_GRACE);
    }
}

/// A stop signal for the command's process group, followed by SIGCONT so that a stopped
/// command can act on it (as systemd does). SIGKILL goes through the keeper instead, which
/// leads the group and could not survive it: it kills what the command started, wherever it
/// went, and then still runs `--post-stop`.
fn send_stop_signal(job: &Job, signal: Signal) {
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

/// How the command of a job that is wholly gone ended: as `known`, else as the keeper reported
/// it in a report not read yet, else as the keeper's own exit status says (a report sent just
/// before it was reaped may not be readable), else killed.
pub fn end_of(job: &mut Job, known: Option<ChildStatus>) -> ChildStatus {
    known
        .or_else(|| {
            job.remaining_reports()
                .into_iter()
                .find(|report| matches!(report, Report::Exited(_) | Report::Killed(_)))
                .map(status_of)
        })
        .or_else(|| job.keeper_status())
        .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL))
}

/// How the command ended, when the keeper's `report` says it ended before any stop began:
/// exited or killed on its own, or never run because its `--pre-start` failed (then its end
/// is the hook's code, at least 1: the keeper's own exit status would say 0).
pub fn ended_by(report: Report) -> Option<ChildStatus> {
    match report {
        Report::Exited(_) | Report::Killed(_) => Some(status_of(report)),
        Report::PreStartFailed(code) => Some(ChildStatus::Exited(code.max(1))),
        Report::Started(_)
        | Report::SpawnFailed(_)
        | Report::Done(_)
        | Report::PostStop(_)
        | Report::Expired(_) => None,
    }
}

/// How the command ended, from the keeper's report of its end.
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
        | Report::PostStop(_)
        | Report::Expired(_) => ChildStatus::Exited(0),
    }
}
