//! The scheduled duty: the items are jobs, and a replica runs the occurrences of the jobs it
//! owns, each occurrence once across the fleet. The jobs are a crontab's (`pgleader cron`), or
//! one per shard on one schedule (`pgleader run --schedule --shards K`); see `jobs.rs`.
//!
//! Owning a job is holding its item; whether an occurrence runs is the ledger's business, per
//! job (`jobs.rs`). An owned job sits in the room's table with no command between its runs:
//! its runs ask for a start when an occurrence is claimed ([`Ask::Runs`]), and its command
//! settles back to waiting when it ends (the table's `Restart::WhenAsked`). Around that:
//! keepers parked ahead of the occurrences (`parking.rs`), the runs kept aside under
//! `overlap=allow` (slots beside the job's own), `timeout=`, and a crontab's reread on SIGHUP.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::task::{Context, Poll};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::duty::{
    Duty, Held, Launch, Mood, Slot, Table, Then, Unready, keeper_failed, ledger_failed,
};
use super::jobs::Jobs;
use super::parking::{self, Parking};
use crate::config::CronOptions;
use crate::election::ledger::LedgerError;
use crate::election::lock::LockKey;
use crate::election::shards::{Holder, Items, Seen};
use crate::exit::ChildStatus;
use crate::operate::telemetry::{CommandState, CommandView, Telemetry};
use crate::schedule::Plan;
use crate::schedule::calendar::rfc3339;
use crate::schedule::clock::ServerClock;
use crate::schedule::crontab::Crontab;
use crate::schedule::runs::{MOST_AT_ONCE, RunsEvent};
use crate::supervise::Sharding;
use crate::supervise::commands::{After, Restart, Settled};
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::handle::{
    CommandError, CommandLine, Job, Parked, SessionKeeper, await_let_go,
};
use crate::supervise::keeper::output::tail_text;
use crate::supervise::label::Label;
use crate::supervise::watchdog::Deadline;
use crate::time::for_people as fmt;

/// The jobs, the runs of those owned here, and their parked keepers.
pub struct Scheduled<H: Holder> {
    jobs: Jobs<H::Ledger>,
    /// `--max-shards`.
    cap: Option<u32>,
    /// A crontab's `--drain-timeout`, where TERM drains (`None` inside: no bound).
    drain: Option<Option<Duration>>,
    parking: Parking,
    /// The keeper of every run of the session (`keeper/session.rs`), where the runs have no
    /// hooks; else each run has a keeper of its own, parked ahead of it.
    session_keeper: Option<SessionKeeper>,
    lock: LockKey,
    hooks: Hooks,
    telemetry: Telemetry,
    /// The table's commands as last published, each with its job's name: the room publishes
    /// after each of its events, and each changes a few commands at most (a run that starts
    /// or ends) or none (a roster read at rest), which a crontab of 1,000 jobs should not pay
    /// for by name. `None`: everything is published anew (at the start, and after a reread,
    /// which renames what is published).
    published: RefCell<Option<BTreeMap<Slot, (String, CommandView)>>>,
}

/// What the jobs wait for beside the room.
pub enum Ask {
    /// An owned job's runs ask for something.
    Runs(u32, RunsEvent),
    /// Keepers started ahead of their jobs' occurrences are ready.
    Parked(parking::Batch),
}

impl<H: Holder> Scheduled<H> {
    /// A crontab's jobs (`pgleader cron`).
    pub fn crontab(
        lock: LockKey,
        (crontab, options): (&Crontab, CronOptions),
        hooks: Hooks,
        telemetry: Telemetry,
    ) -> Result<Scheduled<H>, CommandError> {
        let jobs = Jobs::crontab(&lock, crontab, options.output, telemetry.clone())?;
        telemetry.jobs_defined(jobs.known());
        let mut duty = Scheduled::of(jobs, None, lock, hooks, telemetry);
        duty.drain = Some(options.drain_timeout);
        Ok(duty)
    }

    /// A job per shard, each running `command` at the occurrences of `plan` (`--schedule
    /// --shards`).
    pub fn shards(
        lock: LockKey,
        sharding: Sharding,
        (plan, command): (&Plan, &CommandLine),
        hooks: Hooks,
        telemetry: Telemetry,
    ) -> Scheduled<H> {
        let jobs = Jobs::shards(&lock, sharding.count, plan, command, telemetry.clone());
        Scheduled::of(jobs, sharding.cap, lock, hooks, telemetry)
    }

    fn of(
        jobs: Jobs<H::Ledger>,
        cap: Option<u32>,
        lock: LockKey,
        hooks: Hooks,
        telemetry: Telemetry,
    ) -> Scheduled<H> {
        Scheduled {
            jobs,
            cap,
            drain: None,
            parking: Parking::default(),
            session_keeper: None,
            lock,
            hooks,
            telemetry,
            published: RefCell::new(None),
        }
    }

    /// The name of the crontab job whose command stands in `slot`.
    fn name_of(&self, slot: Slot) -> Option<String> {
        self.jobs.definition(slot.item)?.label.job.clone()
    }

    /// The place of a run of `item` that goes on beside the next (`overlap=allow`): a free
    /// slot beside the job's own, if any is left.
    fn free_aside(table: &Table, item: u32) -> Option<Slot> {
        (1..MOST_AT_ONCE as u8)
            .map(|aside| Slot { item, aside })
            .find(|slot| !table.contains_key(slot))
    }

    /// A claimed occurrence: its run starts in the job's own slot, the run still going there
    /// moving aside first (`overlap=allow`).
    fn claimed(&mut self, item: u32, run: super::duty::Run, table: &mut Table) -> Then {
        let own = Slot::of(item);
        if table.is_started(&own)
            && let Some(aside) = Self::free_aside(table, item)
            && let Some(held) = table.item_mut(&own).cloned()
        {
            table.rekey(&own, aside);
            let fresh = Held { run: None, ..held };
            table.insert(own, self.jobs.label(item), fresh, None);
        }
        let Some(held) = table.item_mut(&own) else {
            return Then::Nothing;
        };
        held.run = Some(run);
        // Not while it is being stopped (given away, lost): the claim is taken back when its
        // runs are settled.
        if table.start_now(&own) {
            Then::Start(own)
        } else {
            Then::Nothing
        }
    }

    /// Stops the runs that have taken their job's `timeout=`: the stop signal, then SIGKILL
    /// after `--kill-timeout`, as any stop; the run is recorded as failed.
    fn stop_timed_out(&mut self, table: &mut Table, kill_signal: Signal) {
        let now = Instant::now();
        let due: Vec<Slot> = table
            .iter()
            .filter(|(_, held, after)| {
                after.is_none() && timeout_of(held).is_some_and(|at| at <= now)
            })
            .map(|(slot, _, _)| *slot)
            .collect();
        for slot in due {
            if let Some(run) = table.item_mut(&slot).and_then(|held| held.run.as_mut()) {
                run.timeout_at = None;
            }
            let label = self.jobs.label(slot.item);
            let timeout = self
                .jobs
                .definition(slot.item)
                .and_then(|definition| definition.timeout);
            warn!(event = "run_timed_out", lock = %self.lock, job = label.job.as_deref(), "the run of {} has taken its timeout={}; stopping it", label.name(), timeout.map_or_else(String::new, |timeout| fmt(timeout).to_string()));
            table.stop(&slot, kill_signal, After::Restart);
        }
    }

    /// A run that ended on its own: recorded; a run aside goes, a job removed by a reread is
    /// given up, one redefined starts its runs again under its new definition.
    async fn run_ended(
        &mut self,
        slot: Slot,
        status: Option<ChildStatus>,
        table: &mut Table,
        holder: &H,
        mood: Mood,
    ) {
        let item = slot.item;
        let run = table.item_mut(&slot).and_then(|held| held.run.as_mut());
        let occurrence = run
            .as_ref()
            .map(|run| (run.occurrence, run.asked.as_ref().map(|asked| asked.id)));
        if let Some(run) = run {
            run.timeout_at = None;
        }
        let output = table.take_output(&slot).map(|tail| tail_text(&tail));
        if let Some(status) = status {
            self.jobs.exited(item, occurrence, status, output);
        }
        if slot.is_aside() {
            // A run that went on aside is over: its entry goes.
            table.stop(&slot, mood.kill_signal, After::Forget);
        }
        if self.jobs.is_retired(item) {
            // Removed from the file, or drained: once its last run is over and recorded, it
            // goes.
            self.give_up_if_idle(item, table, mood).await;
        } else if !slot.is_aside() && self.jobs.take_redefinition(item) {
            let epoch = table.item_mut(&slot).map_or(0, |held| held.epoch);
            self.jobs.disown(item, None, mood.timeout).await;
            if let Some(clock) = self.jobs.clock() {
                self.jobs.own(item, holder, epoch, clock, Instant::now());
            }
        }
    }
}

impl<H: Holder> Scheduled<H> {
    /// Gives up a retired job once nothing of it runs (neither its own run nor one kept
    /// aside, whose runs hold its lock until they end): its runs are recorded, and its item
    /// is given away once settled.
    async fn give_up_if_idle(&mut self, item: u32, table: &mut Table, mood: Mood) {
        let own = Slot::of(item);
        let runs = table
            .iter()
            .any(|(slot, _, _)| slot.item == item && table.is_started(slot));
        if runs || !table.contains_key(&own) {
            return;
        }
        self.jobs.disown(item, None, mood.timeout).await;
        table.stop(&own, mood.kill_signal, After::Give);
    }
}

/// When a held command's run has taken its `timeout=`.
fn timeout_of(held: &Held) -> Option<Instant> {
    held.run.as_ref().and_then(|run| run.timeout_at)
}

impl<H: Holder> Duty<H> for Scheduled<H> {
    type Ask = Ask;

    fn items(&self) -> Items {
        self.jobs.items()
    }

    fn cap(&self) -> Option<u32> {
        self.cap
    }

    fn restart(&self) -> Restart {
        Restart::WhenAsked
    }

    fn rereads(&self) -> bool {
        self.jobs.is_crontab()
    }

    fn log_joined(&self, lock: &str, me: i32) {
        let count = self.jobs.items().len();
        if self.jobs.is_crontab() {
            info!(event = "joined", lock = %lock, backend_pid = me, jobs = count, "joined the replicas of this crontab, {count} jobs");
        } else {
            info!(event = "joined", lock = %lock, backend_pid = me, shards = count, "joined the replicas of this lock, {count} shards");
        }
    }

    async fn begin(
        &mut self,
        holder: &H,
        keepers: &Deadline,
        timeout: Duration,
    ) -> Result<(), Unready> {
        let lock = &self.lock;
        match tokio::time::timeout(timeout, holder.prepare_ledger()).await {
            Ok(Ok(location)) => {
                let fingerprint = crate::schedule::ledger_fingerprint(&location);
                self.jobs.set_own_ledger(fingerprint);
            }
            Ok(Err(LedgerError::Fatal(reason))) => return Err(Unready::Fatal(reason)),
            Ok(Err(err)) => {
                warn!(event = "ledger_failed", lock = %lock, reason = %err, "cannot prepare the ledger; joining again");
                return Err(Unready::Again);
            }
            Err(_) => {
                warn!(event = "ledger_failed", lock = %lock, "no answer while preparing the ledger; joining again");
                return Err(Unready::Again);
            }
        }
        if !self.hooks.any() {
            self.session_keeper = start_session_keeper(holder, keepers);
        }
        if self.session_keeper.is_none() {
            self.parking.keep_membership(&holder.lend_membership());
        }
        Ok(())
    }

    async fn end(&mut self) {
        // The jobs the session owned are no longer this replica's: nor their keepers.
        self.parking.dismiss().await;
        if let Some(keeper) = self.session_keeper.take() {
            await_let_go(vec![keeper.dismiss()], Duration::from_secs(1)).await;
        }
    }

    fn label(&self, item: u32) -> Label {
        self.jobs.label(item)
    }

    fn command(&self, slot: Slot) -> Option<&CommandLine> {
        let definition = self.jobs.definition(slot.item)?;
        Some(&definition.command)
    }

    fn start(&mut self, slot: Slot, held: &Held, launch: Launch<'_>) -> anyhow::Result<Job> {
        let item = slot.item;
        let (run, definition) = match (&held.run, self.jobs.definition(item)) {
            (Some(run), Some(definition)) => (run, definition),
            _ => anyhow::bail!("job {item} is not in the crontab"),
        };
        let command = &definition.command;
        let mut env: Vec<(&str, String)> = launch.env;
        let asked_by = run.asked.as_ref().map(|asked| asked.asked_by.as_str());
        env.extend(self.jobs.env(item, run.occurrence, run.attempt, asked_by));
        if let Some(keeper) = &mut self.session_keeper {
            let name = definition.label.job.as_deref().unwrap_or_default();
            match keeper.run(command, name, &env) {
                Ok(job) => return Ok(job),
                Err(err) => {
                    warn!(event = "keeper_failed", lock = %self.lock, reason = %err, "the session's keeper is gone; each command starts under a keeper of its own from now on");
                    self.session_keeper = None;
                }
            }
        }
        let mut hold = launch.hold;
        hold.extend(self.parking.membership_lent());
        let parked = self.parking.take(item, command);
        Parked::start_or_fresh(
            parked,
            command,
            &self.hooks,
            &env,
            &hold,
            Some(launch.watch),
        )
        .map_err(keeper_failed)
    }

    fn taken(
        &mut self,
        item: u32,
        holder: &H,
        epoch: i64,
        clock: ServerClock,
        not_before: Instant,
    ) -> (Label, Option<Instant>) {
        let label = self.jobs.label(item);
        let (lock, me) = (&self.lock, holder.id());
        info!(event = "leader", lock = %lock, job = label.job.as_deref(), epoch, backend_pid = me, "took {}", label.name());
        self.jobs.own(item, holder, epoch, clock, not_before);
        (label, None)
    }

    fn observed(&mut self, sent: Instant, received: Instant, seen: &Seen, me: i32) {
        self.jobs.observe_clock(sent, received, seen.server_time);
        self.jobs.note_disagreements(&seen.roster, me, &self.lock);
    }

    /// Parks keepers for the owned jobs falling due within their lead (`parking::AHEAD`, more
    /// when many fall due together; not for a job whose command runs, nor while the probe
    /// says unhealthy), lets go of those of jobs no longer owned (of every job once the
    /// replica is `quiet`: leaving, or shutting down), and wakes for the next job that will
    /// want one, or the next run's `timeout=`.
    fn plan(&mut self, table: &Table, quiet: bool, healthy: bool) -> Option<Instant> {
        // Under the session's keeper, nothing to park: no job is looked at.
        let parks = !quiet && self.session_keeper.is_none();
        let due = if parks {
            self.jobs
                .due()
                .map(|(item, due)| {
                    let idle = healthy && !table.is_started(&Slot::of(item));
                    (item, due.filter(|_| idle))
                })
                .collect()
        } else {
            Vec::new()
        };
        let park_at = self.parking.plan(due, &self.hooks);
        let run_timeout = table
            .iter()
            .filter(|(_, _, after)| after.is_none())
            .filter_map(|(_, held, _)| timeout_of(held))
            .min();
        match (park_at, run_timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// `asked <job>`: `pgleader cron run` asked for a run of the job by hand.
    fn heard(&mut self, word: &str) {
        if let Some(job) = word.strip_prefix("asked ") {
            self.jobs.asked(job);
        }
    }

    fn woken(&mut self, table: &mut Table, kill_signal: Signal) {
        self.stop_timed_out(table, kill_signal);
    }

    fn poll_ask(&mut self, cx: &mut Context<'_>, quiet: bool) -> Poll<Ask> {
        if !quiet && let Poll::Ready((item, event)) = self.jobs.poll_next(cx) {
            return Poll::Ready(Ask::Runs(item, event));
        }
        self.parking.poll_spawned(cx).map(Ask::Parked)
    }

    fn on_ask(&mut self, ask: Ask, table: &mut Table, kill_signal: Signal) -> Then {
        let (item, event) = match ask {
            Ask::Parked(batch) => {
                self.parking.park(batch);
                return Then::Nothing;
            }
            Ask::Runs(item, event) => (item, event),
        };
        let label = self.jobs.label(item);
        match event {
            RunsEvent::Start {
                occurrence,
                attempt,
                asked,
            } => {
                let run = super::duty::Run {
                    occurrence,
                    attempt,
                    timeout_at: None,
                    asked,
                };
                self.claimed(item, run, table)
            }
            RunsEvent::Disagree(reason) => {
                warn!(event = "schedule_mismatch", lock = %self.lock, job = label.job.as_deref(), "{}: {reason}", label.name());
                Then::Nothing
            }
            RunsEvent::Failed(err) => ledger_failed(err),
            RunsEvent::Replace { occurrence, asked } => {
                let what = if asked {
                    "a run asked by hand".to_owned()
                } else {
                    format!("the occurrence of {}", rfc3339(occurrence))
                };
                info!(event = "replacing_run", lock = %self.lock, job = label.job.as_deref(), "{what} of {} has come while its previous run still goes: stopping that run (overlap=replace)", label.name());
                table.stop(&Slot::of(item), kill_signal, After::Restart);
                Then::Nothing
            }
            RunsEvent::Done | RunsEvent::NothingToRun => Then::Nothing,
        }
    }

    fn started(&mut self, slot: Slot, table: &mut Table) {
        if !table.is_started(&slot) {
            return;
        }
        self.jobs.started(slot.item);
        let timeout = self
            .jobs
            .definition(slot.item)
            .and_then(|definition| definition.timeout);
        if let Some(run) = table.item_mut(&slot).and_then(|held| held.run.as_mut()) {
            run.timeout_at = timeout.map(|timeout| Instant::now() + timeout);
        }
    }

    async fn settled(
        &mut self,
        settled: &[(Slot, Option<ChildStatus>, Settled, Label)],
        table: &mut Table,
        holder: &H,
        mood: Mood,
    ) {
        for (slot, status, settled, _) in settled {
            match settled {
                Settled::Restarting => self.run_ended(*slot, *status, table, holder, mood).await,
                // A run aside is recorded with its job's runs (see above).
                _ if slot.is_aside() => {}
                // The job's next owner marks what ran here as interrupted.
                _ if mood.in_doubt => self.jobs.forget(slot.item),
                Settled::Give | Settled::Gone => {
                    let why = match settled {
                        Settled::Give => "its job moved to another replica",
                        _ if mood.shutting_down => "pgleader was shut down",
                        _ => "this replica no longer holds the job",
                    };
                    let stopped = Some((*status, why));
                    let output = table.take_output(slot).map(|tail| tail_text(&tail));
                    let item = slot.item;
                    self.jobs
                        .disown_with(item, stopped, output, mood.timeout)
                        .await;
                }
            }
        }
    }

    /// Rereads the crontab. Added jobs are shared out, removed ones no longer scheduled (a
    /// run in progress finishes first), changed ones follow their new definition from their
    /// next occurrence (after a run in progress), unchanged ones are not touched. A file that
    /// cannot be used is logged and the one read before keeps running.
    async fn reread(&mut self, table: &mut Table, holder: &H, mood: Mood) -> Option<Items> {
        let lock = self.lock.clone();
        let path = self.jobs.path()?.to_owned();
        self.published.replace(None);
        info!(event = "rereading", lock = %lock, "rereading the crontab {}", path.display());
        let reread = Crontab::read(&path)
            .map_err(|err| err.to_string())
            .and_then(|crontab| {
                // What the file may not mean to its author, said as at start.
                for warning in crontab.warnings(jiff::Timestamp::now()) {
                    warn!(event = "config", lock = %lock, "{warning}");
                }
                let reread = self.jobs.reread(&lock, crontab);
                reread.map_err(|err| err.to_string())
            });
        let reread = match reread {
            Ok(reread) => reread,
            Err(err) => {
                error!(event = "crontab_refused", lock = %lock, "{err}; the crontab read before keeps running");
                return None;
            }
        };
        let changes = &reread.changes;
        for (what, names) in [
            ("added", &changes.added),
            ("removed", &changes.removed),
            ("changed", &changes.changed),
        ] {
            for name in names {
                info!(event = "job_reread", lock = %lock, job = %name, change = what, "job {name} {what}");
            }
        }
        info!(event = "crontab_reread", lock = %lock, added = changes.added.len(), removed = changes.removed.len(), changed = changes.changed.len(), unchanged = changes.unchanged.len(), "reread the crontab: {} added, {} removed, {} changed, {} unchanged", changes.added.len(), changes.removed.len(), changes.changed.len(), changes.unchanged.len());
        for item in reread.removed {
            self.give_up_if_idle(item, table, mood).await;
        }
        for item in reread.changed {
            let slot = Slot::of(item);
            if table.is_started(&slot) {
                self.jobs.redefine_later(item);
                continue;
            }
            let epoch = table.item_mut(&slot).map_or(0, |held| held.epoch);
            self.jobs.disown(item, None, mood.timeout).await;
            if let Some(clock) = self.jobs.clock() {
                self.jobs.own(item, holder, epoch, clock, Instant::now());
            }
        }
        self.telemetry.jobs_defined(self.jobs.known());
        Some(self.jobs.items())
    }

    async fn drain(
        &mut self,
        table: &mut Table,
        _: &H,
        mood: Mood,
    ) -> Option<(Items, Option<Duration>)> {
        let timeout = self.drain?;
        for item in self.jobs.retire_all() {
            self.give_up_if_idle(item, table, mood).await;
        }
        Some((self.jobs.items(), timeout))
    }

    /// A crontab's jobs owned here by name (between two runs, a job's command is not
    /// running, not waiting): what changed since the last time, or everything anew.
    fn publish(&self, table: &Table, telemetry: &Telemetry) {
        if !self.jobs.is_crontab() {
            return;
        }
        let owned = table.views().filter_map(|(slot, _, mut command)| {
            if slot.is_aside() {
                return None;
            }
            if command.state == CommandState::Waiting {
                command.state = CommandState::NotRunning;
            }
            Some((*slot, command))
        });
        let mut published = self.published.borrow_mut();
        let Some(known) = published.as_mut() else {
            let now: BTreeMap<Slot, (String, CommandView)> = owned
                .filter_map(|(slot, command)| Some((slot, (self.name_of(slot)?, command))))
                .collect();
            telemetry.jobs_owned(now.values().cloned().collect());
            *published = Some(now);
            return;
        };
        let mut changes = Vec::new();
        let mut seen = 0;
        for (slot, command) in owned {
            match known.get_mut(&slot) {
                Some((_, was)) if *was == command => {}
                Some((name, was)) => {
                    *was = command.clone();
                    changes.push((name.clone(), Some(command)));
                }
                None => {
                    let Some(name) = self.name_of(slot) else {
                        continue;
                    };
                    changes.push((name.clone(), Some(command.clone())));
                    known.insert(slot, (name, command));
                }
            }
            seen += 1;
        }
        // Every slot seen is known now: any more known are gone from the table.
        if known.len() > seen {
            known.retain(|slot, (name, _)| {
                let kept = table.contains_key(slot);
                if !kept {
                    changes.push((name.clone(), None));
                }
                kept
            });
        }
        telemetry.jobs_owned_changed(changes);
    }
}

/// Starts the keeper of every run of the session, holding the session's sockets: with the
/// farewell of the replica's membership where the backend lends one (Redis), else as they are
/// (PostgreSQL frees the session's locks when the last copy closes). `None` if it cannot be
/// started: each run then gets a keeper of its own.
fn start_session_keeper<H: Holder>(holder: &H, keepers: &Deadline) -> Option<SessionKeeper> {
    let mut hold = holder.lend_membership();
    if hold.is_empty() {
        // Each item's farewell (Redis without a membership's, as over TLS) is not the
        // session's to say: the sockets alone.
        hold = holder
            .lend(0)
            .into_iter()
            .map(|lent| crate::election::socket::Lent::hold(lent.fd))
            .collect();
    }
    match SessionKeeper::start(&hold, Some(keepers)) {
        Ok(keeper) => Some(keeper),
        Err(err) => {
            warn!(event = "keeper_failed", reason = %err, "cannot start the session's keeper; each command starts under a keeper of its own");
            None
        }
    }
}
