//! Many commands at once under one replica: a table of commands keyed by what each one is (a
//! shard's number under `--shards`; under `pgleader cron`, a crontab job's item, or a run that
//! goes on beside the next one), each started under a keeper of its own, stopped by the one
//! stop machine (`stop.rs`), reported on and signalled from one loop. The shard room
//! (`sharded/`) owns one table and serves both.
//!
//! The table decides nothing about who runs what: its owner (the roster's share, a crontab
//! job's schedule and overlap rule) inserts an entry when a command may run, says when it must
//! stop and what happens once its tree is gone ([`After`]), and how a command that exited
//! starts again ([`Restart`]: after `--restart-delay`, or at the job's next occurrence), and
//! drives the table from its own `select!`:
//! the table's reports ([`Commands::next_report`] into [`Commands::on_report`]), its timer
//! ([`Commands::next_timer`] into [`Commands::on_timer`]), SIGCHLD into [`Commands::reap`],
//! and after every event [`Commands::settle`], which says which commands are wholly gone.
//! Stopping one command never holds up the others: nothing here awaits a stop.

use std::collections::{BTreeMap, BTreeSet};
use std::task::{Context, Poll};
use std::time::Duration;

use jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::info;

use crate::exit::ChildStatus;
use crate::operate::telemetry::{CommandState, CommandView};
use crate::supervise::hook;
use crate::supervise::inbox;
use crate::supervise::keeper::handle::{CommandError, CommandLine, Job};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::ready::{Key, Ready};
use crate::supervise::stop::{Stop, StopRules};
use crate::time::for_people as fmt;

/// What happens to an entry once its command's whole tree is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum After {
    /// Removed, and handed to the owner to give away (a shard released for a replica short of
    /// its share).
    Give,
    /// Kept, and its command started again after `--restart-delay` (it exited on its own), or
    /// when its owner asks ([`Restart::WhenAsked`]).
    Restart,
    /// Removed: the lock is gone already, or the whole session is being left.
    Forget,
}

/// How an entry whose command's tree is gone was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Kept: its command starts again later.
    Restarting,
    /// Removed, for the owner to give away.
    Give,
    /// Removed.
    Gone,
}

/// When a command that exited on its own starts again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// After this delay (`--restart-delay`): a service, a shard.
    After(Duration),
    /// When the owner says so ([`Commands::start_now`]): a crontab job, at its next occurrence.
    WhenAsked,
}

/// Far enough ahead to mean "not until asked".
const NOT_UNTIL_ASKED: Duration = Duration::from_secs(100 * 365 * 86_400);

/// One command of the table, with what its owner knows of it (`item`).
#[derive(Debug)]
struct Entry<T> {
    item: T,
    /// How its log lines name it.
    label: Label,
    /// When its command may start: what the owner said, `--restart-delay` after it exited on
    /// its own, longer while its `--pre-start` keeps failing.
    start_at: Instant,
    /// `None` until the command starts.
    job: Option<Job>,
    /// Set once the command is being stopped, or has exited and what it left is.
    stopping: Option<Stopping>,
    /// Its command's last start and exit: what `/status` shows.
    started: Option<(i32, Timestamp)>,
    last_exit: Option<(ChildStatus, Timestamp)>,
    /// The last lines of its command's last run, when its keeper kept them (`--keep-output`),
    /// until its owner takes them.
    output: Option<Vec<u8>>,
    /// `--pre-start` failures in a row: the next try waits longer each time.
    pre_start_failures: u32,
}

impl<T> Entry<T> {
    /// The job and its stop, while one is under way.
    fn stop_under_way(&mut self) -> Option<(&Job, &mut Stop)> {
        match (&self.job, &mut self.stopping) {
            (
                Some(job),
                Some(Stopping {
                    stop: Some(stop), ..
                }),
            ) => Some((job, stop)),
            _ => None,
        }
    }
}

/// A stop under way, and what follows it.
#[derive(Debug)]
struct Stopping {
    after: After,
    /// `None` when the command never started: nothing to stop.
    stop: Option<Stop>,
}

/// The table.
#[derive(Debug)]
pub struct Commands<K: Key, T> {
    entries: BTreeMap<K, Entry<T>>,
    /// The kept output of the entries the last [`Commands::settle`] removed, for their owner
    /// to take right after it (see [`Commands::take_output`]).
    settled_output: BTreeMap<K, Vec<u8>>,
    rules: StopRules,
    kill_signal: Signal,
    restart: Restart,
    /// One more at every change of what [`Commands::views`] or an entry's item show: its
    /// readers publish again only when it moved, not at every turn of the loop.
    changes: u64,
    /// The entries with a command started or a stop under way (at least those): what the
    /// reports and settling look at, at every turn of the loop, rather than a crontab's
    /// thousand idle jobs.
    active: BTreeSet<K>,
    /// The active entries whose keeper may have a report: in a burst a replica runs hundreds
    /// of commands, and polling each one's reports at every turn of the loop cost more than
    /// the reports did (see `ready.rs`).
    reporting: Ready<K>,
}

impl<K: Key, T> Commands<K, T> {
    /// An empty table whose commands stop by `rules` with `kill_signal`, and start again as
    /// `restart` says after they exit on their own.
    pub fn new(rules: StopRules, kill_signal: Signal, restart: Restart) -> Self {
        Commands {
            entries: BTreeMap::new(),
            settled_output: BTreeMap::new(),
            rules,
            kill_signal,
            restart,
            changes: 0,
            active: BTreeSet::new(),
            reporting: Ready::default(),
        }
    }

    /// How many changes the table has seen (see `changes`).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Adds a command that may start at `start_at` (`None`: when asked, [`Commands::start_now`]),
    /// named in the log as `label`.
    pub fn insert(&mut self, key: K, label: Label, item: T, start_at: Option<Instant>) {
        let start_at = start_at.unwrap_or_else(|| Instant::now() + NOT_UNTIL_ASKED);
        self.changes += 1;
        self.active.remove(&key);
        self.entries.insert(
            key,
            Entry {
                item,
                label,
                start_at,
                job: None,
                stopping: None,
                started: None,
                last_exit: None,
                output: None,
                pre_start_failures: 0,
            },
        );
    }

    /// The last lines of the last run of `key`'s command, once settled, if its keeper kept
    /// them (`--keep-output`); those of an entry the settle removed only until the next one.
    pub fn take_output(&mut self, key: &K) -> Option<Vec<u8>> {
        match self.entries.get_mut(key) {
            Some(entry) => entry.output.take(),
            None => self.settled_output.remove(key),
        }
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// What the owner keeps of `key`'s entry.
    pub fn item_mut(&mut self, key: &K) -> Option<&mut T> {
        self.changes += 1;
        self.entries.get_mut(key).map(|entry| &mut entry.item)
    }

    /// Moves `from`'s entry, its command and any stop under way, to `to` (a key not in use):
    /// the owner keeps the command going under another key and frees `from` for a new one
    /// (a crontab job's run that goes on beside the next, `overlap=allow`).
    pub fn rekey(&mut self, from: &K, to: K) {
        if let Some(entry) = self.entries.remove(from) {
            self.changes += 1;
            if self.active.remove(from) {
                self.active.insert(to.clone());
                // Its keeper's reports wake the old key: polled under the new one from now.
                self.reporting.mark(to.clone());
            }
            self.entries.insert(to, entry);
        }
    }

    /// How the log names `key`'s command, as its owner said when it inserted it.
    pub fn label(&self, key: &K) -> Option<&Label> {
        self.entries.get(key).map(|entry| &entry.label)
    }

    /// Whether `key`'s command has been started (and not yet settled).
    pub fn is_started(&self, key: &K) -> bool {
        self.entries
            .get(key)
            .is_some_and(|entry| entry.job.is_some())
    }

    /// Lets `key`'s command start at the next [`Commands::on_timer`], unless it runs or is
    /// being stopped. False if it cannot start now.
    pub fn start_now(&mut self, key: &K) -> bool {
        match self.entries.get_mut(key) {
            Some(entry) if entry.job.is_none() && entry.stopping.is_none() => {
                entry.start_at = Instant::now();
                true
            }
            _ => false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every entry, in key order, with what follows its stop if one is under way.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &T, Option<After>)> {
        self.entries.iter().map(|(key, entry)| {
            (
                key,
                &entry.item,
                entry.stopping.as_ref().map(|stopping| stopping.after),
            )
        })
    }

    /// Starts stopping `key`'s command: the kill signal to its group, and so on by the stop
    /// machine's rules; once its tree is gone, `after`. A stop under way keeps going, and a
    /// `Forget` overrides what it was to be followed by: nothing is left to give, nothing to
    /// restart.
    pub fn stop(&mut self, key: &K, signal: Signal, after: After) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        self.changes += 1;
        if let Some(stopping) = &mut entry.stopping {
            if after == After::Forget {
                stopping.after = After::Forget;
            }
            return;
        }
        let stop = entry
            .job
            .as_ref()
            .map(|job| Stop::begin(job, signal, self.rules, entry.label.clone()));
        entry.stopping = Some(Stopping { after, stop });
        self.active.insert(key.clone());
    }

    /// Stops every command with `signal`.
    pub fn stop_all(&mut self, signal: Signal, after: After) {
        let keys: Vec<K> = self.entries.keys().cloned().collect();
        for key in keys {
            self.stop(&key, signal, after);
        }
    }

    /// Passes a signal on to every command's process group.
    pub fn forward(&self, signal: Signal) {
        inbox::forward(signal, self.entries.values().filter_map(|e| e.job.as_ref()));
    }

    /// Reaps every child that exited, telling the job whose keeper it was.
    pub fn reap(&mut self) {
        inbox::reap(self.entries.values_mut().filter_map(|e| e.job.as_mut()));
    }

    /// The first TERM or INT: every stop under way sends that signal instead
    /// (`Stop::retarget`).
    pub fn retarget(&mut self, signal: Signal) {
        for entry in self.entries.values_mut() {
            if let Some((job, stop)) = entry.stop_under_way() {
                stop.retarget(job, signal);
            }
        }
    }

    /// A second TERM or INT: every stop under way insists (`Stop::insist`).
    pub fn insist(&mut self, received: Signal) {
        for entry in self.entries.values_mut() {
            if let Some((job, stop)) = entry.stop_under_way() {
                stop.insist(job, received);
            }
        }
    }

    /// The next report from any command's keeper. Cancel-safe.
    ///
    /// Only the entries whose keeper woke them since are polled (and those just started),
    /// and the first active one besides: the runs of a session's keeper share its channel,
    /// which wakes only the run that polled it last, and that run may be gone by then; the
    /// first active entry's poll reads what the channel holds for every run (waking each run
    /// a report came for) and waits on it, so that some live run always does.
    pub async fn next_report(&mut self) -> (K, Report) {
        std::future::poll_fn(|cx| self.poll_next_report(cx)).await
    }

    /// A report already in, if any ([`Commands::next_report`] polled once, with the task's
    /// waker): a burst's reports are taken together.
    pub async fn report_now(&mut self) -> Option<(K, Report)> {
        std::future::poll_fn(|cx| match self.poll_next_report(cx) {
            Poll::Ready(report) => Poll::Ready(Some(report)),
            Poll::Pending => Poll::Ready(None),
        })
        .await
    }

    fn poll_next_report(&mut self, cx: &mut Context<'_>) -> Poll<(K, Report)> {
        let (reporting, entries) = (&mut self.reporting, &mut self.entries);
        let mut keys = reporting.take(cx);
        if let Some(first) = self.active.first()
            && keys.binary_search(first).is_err()
        {
            keys.push(first.clone());
        }
        for (n, key) in keys.iter().enumerate() {
            let waker = reporting.waker(key);
            if let Some(entry) = entries.get_mut(key)
                && let Some(job) = &mut entry.job
                && let Poll::Ready(report) = job.poll_report(&mut Context::from_waker(&waker))
            {
                // It may have more to say; those after it were not polled yet.
                reporting.put_back(keys[n..].iter().cloned());
                return Poll::Ready((key.clone(), report));
            }
        }
        Poll::Pending
    }

    /// A keeper's report about `key`'s command, `command` (`None` if its owner no longer knows
    /// it). An error means the command cannot be run at all.
    pub fn on_report(
        &mut self,
        key: &K,
        report: Report,
        command: Option<&CommandLine>,
    ) -> Result<(), CommandError> {
        let kill_signal = self.kill_signal;
        self.changes += 1;
        let Some(entry) = self.entries.get_mut(key) else {
            return Ok(());
        };
        let label = entry.label.clone();
        match report {
            Report::Started(pid) => {
                let command = command.map(|command| command.display().to_string());
                info!(
                    event = "child_started",
                    shard = label.shard,
                    job = label.job.as_deref(),
                    pid,
                    command = command.as_deref().unwrap_or("?"),
                    "started the command{}",
                    label.of()
                );
                entry.started = Some((pid, Timestamp::now()));
                entry.pre_start_failures = 0;
            }
            Report::SpawnFailed(errno) => {
                let program = command.map_or(label.name().as_ref(), |command| {
                    command.program().as_os_str()
                });
                return Err(CommandError::from_errno(program, errno));
            }
            // The keeper logged why; its post-stop runs next, and the command is tried again
            // later, 1s doubling up to a minute while its pre-start keeps failing.
            Report::PreStartFailed(_) => {
                entry.pre_start_failures = entry.pre_start_failures.saturating_add(1);
            }
            _ => {}
        }
        // Ended on its own, or its --pre-start failed: what it left in its group goes too;
        // the entry stays and its command starts again after --restart-delay.
        if entry.stopping.is_none()
            && let Some(job) = &entry.job
            && let Some((_, stop)) = Stop::after_end(job, report, kill_signal, self.rules, label)
        {
            entry.stopping = Some(Stopping {
                after: After::Restart,
                stop: Some(stop),
            });
            return Ok(());
        }
        if let Some((job, stop)) = entry.stop_under_way() {
            stop.on_report(job, report);
        }
        Ok(())
    }

    /// Starts the commands whose start time has come (when `may_start`), each through `start`,
    /// and moves stops along.
    pub fn on_timer(
        &mut self,
        may_start: bool,
        mut start: impl FnMut(&K, &T) -> anyhow::Result<Job>,
    ) -> anyhow::Result<()> {
        let now = Instant::now();
        for (key, entry) in &mut self.entries {
            if let Some((job, stop)) = entry.stop_under_way() {
                stop.on_timer(job, now);
            } else if may_start
                && entry.job.is_none()
                && entry.stopping.is_none()
                && entry.start_at <= now
            {
                self.changes += 1;
                entry.job = Some(start(key, &entry.item)?);
                self.active.insert(key.clone());
                self.reporting.mark(key.clone());
            }
        }
        Ok(())
    }

    /// The next moment a timer is due: a delayed start, a stop's next step.
    pub fn next_timer(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|entry| match (&entry.job, &entry.stopping) {
                (None, None) => Some(entry.start_at),
                (
                    _,
                    Some(Stopping {
                        stop: Some(stop), ..
                    }),
                ) => stop.next_timer(),
                _ => None,
            })
            .min()
    }

    /// Settles the entries whose commands are wholly gone: each is kept for a restart (unless
    /// `quiet`: the session is being left or pgleader shuts down), or removed. Returns each,
    /// with how its command ended if it ran, and how the log names it (its owner may have
    /// forgotten what it was by then: a job a reread removed).
    pub fn settle(&mut self, quiet: bool) -> Vec<(K, Option<ChildStatus>, Settled, Label)> {
        let now = Instant::now();
        self.settled_output.clear();
        let mut settled = Vec::new();
        let active: Vec<K> = self.active.iter().cloned().collect();
        for key in active {
            let Some(entry) = self.entries.get_mut(&key) else {
                self.active.remove(&key);
                continue;
            };
            let status = match (&mut entry.job, &mut entry.stopping) {
                (None, None) => {
                    self.active.remove(&key);
                    continue;
                }
                (None, Some(_)) => None,
                (Some(job), stopping) => {
                    // Its keeper vanished (killed from outside) without being stopped: what it
                    // left in its group goes, and the command starts again.
                    if stopping.is_none() {
                        if !job.is_finished() {
                            continue;
                        }
                        let stop = Stop::vanished(job, self.rules, entry.label.clone());
                        self.changes += 1;
                        *stopping = Some(Stopping {
                            after: After::Restart,
                            stop: Some(stop),
                        });
                    }
                    let Some(Stopping {
                        stop: Some(stop), ..
                    }) = stopping
                    else {
                        continue;
                    };
                    match stop.finish(job, now) {
                        Some(status) => Some(status),
                        None => continue,
                    }
                }
            };
            if let Some(status) = status {
                entry.started = None;
                entry.last_exit = Some((status, Timestamp::now()));
            }
            entry.output = entry.job.as_mut().and_then(Job::take_output);
            let after = entry.stopping.as_ref().map_or(After::Restart, |s| s.after);
            let outcome = match after {
                After::Restart if !quiet => {
                    entry.job = None;
                    entry.stopping = None;
                    self.active.remove(&key);
                    let label = entry.label.clone();
                    let restart_delay = match self.restart {
                        Restart::After(delay) => delay,
                        Restart::WhenAsked => {
                            entry.start_at = now + NOT_UNTIL_ASKED;
                            settled.push((key.clone(), status, Settled::Restarting, label));
                            continue;
                        }
                    };
                    if entry.pre_start_failures > 0 {
                        let sit_out = hook::sit_out_after(entry.pre_start_failures);
                        entry.start_at = now + sit_out;
                        label.info(
                            "sitting_out",
                            format_args!(
                                "trying {} again in {} (--pre-start failed {} time(s) in a row)",
                                label.name(),
                                fmt(sit_out),
                                entry.pre_start_failures
                            ),
                        );
                    } else {
                        entry.start_at = now + restart_delay;
                        if !restart_delay.is_zero() {
                            label.info(
                                "restart_delay",
                                format_args!(
                                    "starting the command{} again in {} (--restart-delay)",
                                    label.of(),
                                    fmt(restart_delay)
                                ),
                            );
                        }
                    }
                    Settled::Restarting
                }
                After::Give if !quiet => Settled::Give,
                _ => Settled::Gone,
            };
            settled.push((key.clone(), status, outcome, entry.label.clone()));
        }
        if !settled.is_empty() {
            self.changes += 1;
        }
        for (key, _, outcome, _) in &settled {
            if *outcome == Settled::Restarting {
                continue;
            }
            self.active.remove(key);
            self.reporting.forget(key);
            if let Some(entry) = self.entries.remove(key)
                && let Some(output) = entry.output
            {
                self.settled_output.insert(key.clone(), output);
            }
        }
        settled
    }

    /// What the HTTP endpoint shows of each command.
    pub fn views(&self) -> impl Iterator<Item = (&K, &T, CommandView)> {
        self.entries.iter().map(|(key, entry)| {
            let state = match (&entry.started, &entry.stopping) {
                (Some(_), Some(_)) => CommandState::Stopping,
                (Some(_), None) => CommandState::Running,
                (None, None) => CommandState::Waiting,
                (None, Some(_)) => CommandState::NotRunning,
            };
            let view = CommandView {
                state,
                pid: entry.started.map(|(pid, _)| pid),
                started_at: entry.started.map(|(_, at)| at),
                last_exit: entry.last_exit,
            };
            (key, &entry.item, view)
        })
    }
}
