//! The scheduled items of a sharded room, its jobs: a crontab's (`pgleader cron`), or each
//! shard of `--schedule --shards K` (a job per shard, all on the same schedule). The jobs are
//! the items the roster shares out, and a replica runs the occurrences of the jobs it owns.
//!
//! Owning a job is holding its item's lock; whether an occurrence may run is the ledger's
//! business, per job, on the holder session: each owned job has its own scheduled runs
//! ([`Runs`], the same rules as `--schedule`), whose claims succeed only while the session
//! holds that job's lock, so a job moved to another replica a moment ago is never run twice.
//! The room keeps each owned job in its table of commands (keyed by the item), with no command
//! until an occurrence is claimed; this file says which job an item is, builds its command
//! and environment, and waits on every owned job's runs at once.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use jiff::Timestamp;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::election::ledger::{Claimant, Ledger};
use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::election::shards::{Holder, Items, Listing, Roster};
use crate::exit::ChildStatus;
use crate::operate::pings::{Pinger, Target};
use crate::operate::telemetry::Telemetry;
use crate::schedule::calendar::{Schedule, rfc3339};
use crate::schedule::clock::ServerClock;
use crate::schedule::crontab::{Changes, CronJob, Crontab};
use crate::schedule::runs::{self, Runs, RunsEvent};
use crate::schedule::{Plan, Publish};
use crate::supervise::keeper::handle::{CommandError, CommandLine};
use crate::supervise::keeper::protocol::Output;
use crate::supervise::label::Label;
use crate::supervise::ready::Ready;

/// A job as this replica defines it.
#[derive(Debug)]
pub struct Definition {
    /// How the log names it: a crontab job by its name, a scheduled shard by its number.
    pub label: Label,
    /// Its schedule and how its runs go.
    pub plan: Plan,
    /// A crontab job's `SHELL -c COMMAND`; a shard's command.
    pub command: CommandLine,
    /// Its environment beside the leader's and the run's: the crontab's variables and
    /// `PGLEADER_JOB`, or `PGLEADER_SHARD` and `PGLEADER_SHARDS`.
    pub env: Vec<(String, String)>,
    /// How long a run may take (a crontab job's `timeout=`).
    pub timeout: Option<Duration>,
    /// The key its ledger rows are kept under: the fleet's lock and the job's name.
    pub key: LockKey,
    /// The monitor a crontab job's runs are pinged to (`ping=`).
    pub ping: Option<Target>,
}

/// What the disagreements were worked out from: this replica's listing and each other
/// member's markers, held so that their addresses stay theirs.
#[derive(Debug)]
struct Compared {
    listing: Arc<Listing>,
    members: Vec<MemberMarkers>,
}

/// A member's id, the jobs it knows and how it defines them.
type MemberMarkers = (i32, Option<Arc<BTreeSet<u32>>>, Arc<BTreeMap<u32, u32>>);

impl Compared {
    fn of(items: &Items, roster: &Roster, me: i32) -> Option<Compared> {
        let Items::Listed(listing) = items else {
            return None;
        };
        let members = roster.members.iter().filter(|member| member.id != me);
        Some(Compared {
            listing: Arc::clone(listing),
            members: members
                .map(|m| (m.id, m.knows.clone(), Arc::clone(&m.defines)))
                .collect(),
        })
    }

    /// Whether `other` holds the very same markers.
    fn same(&self, other: &Option<Compared>) -> bool {
        let Some(other) = other else {
            return false;
        };
        let same_knows =
            |a: &Option<Arc<BTreeSet<u32>>>, b: &Option<Arc<BTreeSet<u32>>>| match (a, b) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
        Arc::ptr_eq(&self.listing, &other.listing)
            && self.members.len() == other.members.len()
            && self
                .members
                .iter()
                .zip(&other.members)
                .all(|(a, b)| a.0 == b.0 && same_knows(&a.1, &b.1) && Arc::ptr_eq(&a.2, &b.2))
    }
}

/// The jobs this replica knows, and the runs of those it owns.
pub struct Jobs<L: Ledger> {
    /// The crontab as last read; `None` for scheduled shards.
    crontab: Option<Crontab>,
    /// What the roster shares out.
    items: Items,
    /// Every job of the file, and the jobs a reread removed whose last run is still going.
    definitions: BTreeMap<u32, Definition>,
    runs: BTreeMap<u32, Runs<L>>,
    /// Which owned jobs' runs want polling (`ready.rs`).
    ready: Ready<u32>,
    /// Owned jobs a reread removed: no occurrence is started any more; the run in progress
    /// finishes, then the job is given up.
    retired: BTreeSet<u32>,
    /// Owned jobs a reread changed while a run was going: their runs start again under the
    /// new definition once it has finished.
    redefined: BTreeSet<u32>,
    /// This replica's ledger, as the holder session's preparation fingerprinted it.
    own_ledger: String,
    /// Where a crontab's jobs' output goes.
    output: Output,
    /// The latest sample of the server's clock.
    clock: Option<ServerClock>,
    /// The sample the runs were last given: a check's sample goes to every run only once it
    /// moves their instants by a millisecond or more, not at every check (a thousand jobs).
    given: Option<ServerClock>,
    /// The jobs another member defines otherwise, with that member, as last logged.
    disagreeing: BTreeSet<(String, i32)>,
    /// The markers `disagreeing` was worked out from: this replica's listing and each other
    /// member's (shared, so that the same ones are told apart by address, at no cost).
    compared: Option<Compared>,
    /// Where each owned job's runs publish their claims and outcomes.
    telemetry: Telemetry,
    /// Sends the pings of the jobs that have a monitor, once one has.
    pinger: Option<Pinger>,
}

/// What a reread changed among the jobs this replica owns.
#[derive(Debug, Default)]
pub struct Reread {
    pub changes: Changes,
    /// Owned jobs the file no longer has.
    pub removed: Vec<u32>,
    /// Owned jobs whose definition changed.
    pub changed: Vec<u32>,
}

impl<L: Ledger> std::fmt::Debug for Jobs<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs")
            .field("jobs", &self.definitions.len())
            .field("owned", &self.runs.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<L: Ledger> Jobs<L> {
    /// The jobs of `crontab`, run for the fleet of `lock`, their runs published through
    /// `telemetry`.
    pub fn crontab(
        lock: &LockKey,
        crontab: &Crontab,
        output: Output,
        telemetry: Telemetry,
    ) -> Result<Jobs<L>, CommandError> {
        let mut jobs = Jobs::of(
            define(lock, crontab, output)?,
            listing(crontab),
            Some(crontab.clone()),
            telemetry,
        );
        jobs.output = output;
        Ok(jobs)
    }

    /// A job per shard of `count`, each running `command` on `plan`'s schedule, its runs
    /// kept in the ledger under the shard's own key.
    pub fn shards(
        lock: &LockKey,
        count: u32,
        plan: &Plan,
        command: &CommandLine,
        telemetry: Telemetry,
    ) -> Jobs<L> {
        let definitions = (0..count)
            .map(|shard| {
                // Named in the runs' log lines; and, as a crontab job's, its schedule is
                // checked against the ledger once, as its ownership begins (`Runs`).
                let plan = Plan {
                    job: Some(format!("shard {shard}")),
                    ..plan.clone()
                };
                let definition = Definition {
                    label: Label::shard(shard),
                    plan,
                    command: command.clone(),
                    env: vec![
                        ("PGLEADER_SHARD".into(), shard.to_string()),
                        ("PGLEADER_SHARDS".into(), count.to_string()),
                    ],
                    timeout: None,
                    key: job_key(lock, &format!("shard {shard}")),
                    ping: None,
                };
                (shard, definition)
            })
            .collect();
        Jobs::of(definitions, Items::Numbered(count), None, telemetry)
    }

    fn of(
        definitions: BTreeMap<u32, Definition>,
        items: Items,
        crontab: Option<Crontab>,
        telemetry: Telemetry,
    ) -> Jobs<L> {
        Jobs {
            telemetry,
            definitions,
            crontab,
            items,
            runs: BTreeMap::new(),
            ready: Ready::default(),
            retired: BTreeSet::new(),
            redefined: BTreeSet::new(),
            own_ledger: String::new(),
            output: Output::Inherited,
            clock: None,
            given: None,
            disagreeing: BTreeSet::new(),
            compared: None,
            pinger: None,
        }
    }

    /// Where the crontab is read from; `None` for scheduled shards.
    pub fn path(&self) -> Option<&std::path::Path> {
        Some(&self.crontab.as_ref()?.path)
    }

    /// Whether the jobs are a crontab's.
    pub fn is_crontab(&self) -> bool {
        self.crontab.is_some()
    }

    /// Takes a reread file's jobs for this replica's: added jobs are known from now on,
    /// unchanged ones are not touched; what changed among the owned ones is for the room to
    /// act on (see [`Reread`]).
    pub fn reread(&mut self, lock: &LockKey, crontab: Crontab) -> Result<Reread, CommandError> {
        let mut definitions = define(lock, &crontab, self.output)?;
        let changes = match &self.crontab {
            Some(before) => Changes::between(before, &crontab),
            None => Changes::default(),
        };
        let item_of = |name: &String| {
            self.definitions
                .iter()
                .find(|(_, definition)| definition.label.job.as_ref() == Some(name))
                .map(|(item, _)| *item)
        };
        let owned = |item: &u32| self.runs.contains_key(item);
        let removed: Vec<u32> = changes
            .removed
            .iter()
            .filter_map(item_of)
            .filter(owned)
            .collect();
        let changed: Vec<u32> = changes
            .changed
            .iter()
            .filter_map(item_of)
            .filter(owned)
            .collect();
        // A removed job's definition stays while its last run goes on.
        for item in &removed {
            if let Some(definition) = self.definitions.remove(item) {
                definitions.insert(*item, definition);
            }
            self.retired.insert(*item);
        }
        self.definitions = definitions;
        self.items = listing(&crontab);
        self.crontab = Some(crontab);
        Ok(Reread {
            changes,
            removed,
            changed,
        })
    }

    /// A drain (TERM under `pgleader cron`): every owned job is retired as a reread that
    /// removed it would (no occurrence starts any more; a run going on finishes, then the job
    /// is given up), and the fleet is told this replica knows no job, so that it deals every
    /// job to the others. Returns the owned jobs.
    pub fn retire_all(&mut self) -> Vec<u32> {
        let owned: Vec<u32> = self.runs.keys().copied().collect();
        self.retired.extend(owned.iter().copied());
        self.items = Items::Listed(Arc::new(Listing::default()));
        owned
    }

    /// Whether a reread removed `item` while this replica owned it.
    pub fn is_retired(&self, item: u32) -> bool {
        self.retired.contains(&item)
    }

    /// Marks `item`'s runs to start again under its new definition once its run has finished.
    pub fn redefine_later(&mut self, item: u32) {
        self.redefined.insert(item);
    }

    /// Whether `item`'s runs wait to start again under a new definition.
    pub fn take_redefinition(&mut self, item: u32) -> bool {
        self.redefined.remove(&item)
    }

    /// Every job of the file as last read, by name, schedule and definition (see
    /// `CronJob::definition_marker`): what `/status` lists.
    pub fn known(&self) -> Vec<(String, Schedule, u32)> {
        let jobs = self.crontab.iter().flat_map(|crontab| &crontab.jobs);
        jobs.map(|job| (job.name.clone(), job.when.clone(), job.definition_marker()))
            .collect()
    }

    /// The items the roster shares out: every job of this replica's file, with how it defines
    /// each; or the shards.
    pub fn items(&self) -> Items {
        self.items.clone()
    }

    /// Logs, once per job and member, that another member defines a job otherwise than this
    /// replica's file (a rolling deploy half done), and once more when they agree again; and
    /// publishes which members those are, per job, for `/status` and the metrics.
    pub fn note_disagreements(&mut self, roster: &Roster, me: i32, lock: &LockKey) {
        // Nothing to work out again while the markers are the very ones compared last (a
        // roster read keeps a member's markers until they change).
        let compared = Compared::of(&self.items, roster, me);
        if self
            .compared
            .as_ref()
            .is_some_and(|last| last.same(&compared))
        {
            return;
        }
        self.compared = compared;
        let now = self.disagreements(roster, me);
        if now == self.disagreeing {
            return;
        }
        // Published before the log says it, so that whoever reads the line finds it in
        // `/status` too.
        let mut by_job: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for (job, member) in &now {
            by_job.entry(job.clone()).or_default().push(*member);
        }
        self.telemetry.jobs_defined_otherwise(by_job);
        for (job, member) in now.difference(&self.disagreeing) {
            warn!(event = "job_definition_mismatch", lock = %lock, job = %job, member, "job {job} is defined otherwise by the replica of member {member} (its file differs from this one's: a rolling deploy?); whichever replica owns it runs it under its own definition, one at a time");
        }
        for (job, member) in self.disagreeing.difference(&now) {
            info!(event = "job_definition_agreed", lock = %lock, job = %job, member, "job {job} is no longer defined otherwise by the replica of member {member}");
        }
        self.disagreeing = now;
    }

    /// The jobs this replica owns or knows that another member defines otherwise: (job name,
    /// that member's id), from a roster. A member that knows a job and does not say this
    /// replica's definition of it defines it otherwise. Not the jobs it no longer shares out
    /// (all of them once it drains): it says no definition of those any more, and a roster
    /// read on PostgreSQL then carries none of the others' either.
    fn disagreements(&self, roster: &Roster, me: i32) -> BTreeSet<(String, i32)> {
        let mut found = BTreeSet::new();
        // The markers computed as the file was read: at every roster read, hashing each job's
        // definition again cost more than the read itself with 1,000 jobs.
        let Items::Listed(listing) = &self.items else {
            return found;
        };
        for (item, marker) in &listing.definitions {
            let Some(name) = self
                .definitions
                .get(item)
                .and_then(|d| d.label.job.as_ref())
            else {
                continue;
            };
            for member in roster.members.iter().filter(|member| member.id != me) {
                if member.knows(*item) && member.defines.get(item) != Some(marker) {
                    found.insert((name.clone(), member.id));
                }
            }
        }
        found
    }

    /// Where this replica's ledger lives (see `schedule::ledger_fingerprint`).
    pub fn set_own_ledger(&mut self, fingerprint: String) {
        self.own_ledger = fingerprint;
    }

    pub fn definition(&self, item: u32) -> Option<&Definition> {
        self.definitions.get(&item)
    }

    /// How the log names item `item`'s command.
    pub fn label(&self, item: u32) -> Label {
        match self.definitions.get(&item) {
            Some(definition) => definition.label.clone(),
            None => Label::shard(item),
        }
    }

    /// Starts owning `item`: its runs begin, claiming through `holder`'s ledger, with the fencing token
    /// `epoch`, the server's clock `clock`, and no start before `not_before`.
    pub fn own(
        &mut self,
        item: u32,
        holder: &impl Holder<Ledger = L>,
        epoch: i64,
        clock: ServerClock,
        not_before: Instant,
    ) {
        let Some(definition) = self.definitions.get(&item) else {
            return;
        };
        let plan = definition.plan.clone();
        let telemetry = self.telemetry.clone();
        let pings = definition.ping.clone().map(|target| {
            let pinger = self
                .pinger
                .get_or_insert_with(|| Pinger::new(telemetry.clone()));
            (pinger.clone(), target)
        });
        let publish = match definition.label.job.clone() {
            Some(name) => Publish(Rc::new(move |run| {
                if let Some((pinger, target)) = &pings {
                    pinger.run(&name, target, &run);
                }
                telemetry.job_run(&name, run);
            })),
            None => Publish(Rc::new(move |run| telemetry.scheduled_run(run))),
        };
        let start = runs::Start {
            claimant: Claimant {
                host: host_name(),
                pid: std::process::id() as i32,
                epoch,
            },
            clock,
            not_before,
            own_ledger: self.own_ledger.clone(),
            foreign_ledger_seen: None,
            publish,
            takes_asked: self.is_crontab(),
        };
        let Some(ledger) = holder.ledger(&definition.key, item, &plan.definition()) else {
            return;
        };
        self.runs
            .insert(item, Runs::new(plan, definition.key.clone(), ledger, start));
        self.ready.mark(item);
    }

    /// The next thing an owned job's runs ask for: only the jobs marked ready are polled
    /// (`ready.rs`), each with its own waker. Cancel-safe.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<(u32, RunsEvent)> {
        let ready = self.ready.take(cx);
        for (n, item) in ready.iter().copied().enumerate() {
            // No new occurrence for a removed job; its last run's outcome is recorded when it
            // is disowned.
            if self.retired.contains(&item) {
                continue;
            }
            let waker = self.ready.waker(&item);
            let Some(runs) = self.runs.get_mut(&item) else {
                continue;
            };
            if let Poll::Ready(event) = runs.poll_next(&mut Context::from_waker(&waker)) {
                // It may have more to say; those after it were not polled yet.
                self.ready.put_back(ready[n..].iter().copied());
                return Poll::Ready((item, event));
            }
        }
        Poll::Pending
    }

    /// Each owned job's item, with when its next occurrence is claimed and its command line
    /// where that is known and its definition holds (not removed or redefined by a reread).
    pub fn due(&self) -> impl Iterator<Item = (u32, Option<(Instant, &CommandLine)>)> {
        self.runs.iter().map(|(item, runs)| {
            let holds = !self.retired.contains(item) && !self.redefined.contains(item);
            let due = runs.due_at().filter(|_| holds).zip(
                self.definitions
                    .get(item)
                    .map(|definition| &definition.command),
            );
            (*item, due)
        })
    }

    /// Item `item`'s command started for its claimed occurrence.
    pub fn started(&mut self, item: u32) {
        if let Some(runs) = self.runs.get_mut(&item) {
            runs.started();
            self.ready.mark(item);
        }
    }

    /// Item `item`'s command exited on its own: its runs record how. `occurrence`: the run
    /// it ran for (when it was asked, and the request's number, for a run asked by hand).
    pub fn exited(
        &mut self,
        item: u32,
        occurrence: Option<(Timestamp, Option<i64>)>,
        status: ChildStatus,
        output: Option<String>,
    ) {
        if let Some(runs) = self.runs.get_mut(&item) {
            match occurrence {
                Some((at, asked)) => runs.exited_at(at, asked, status, output),
                None => runs.exited(status),
            }
            self.ready.mark(item);
        }
    }

    /// Someone asked for a run of job `name` by hand (`pgleader cron run`): if this replica
    /// owns it, its runs take the request.
    pub fn asked(&mut self, name: &str) {
        let owned = self.definitions.iter().find_map(|(item, definition)| {
            (definition.label.job.as_deref() == Some(name)).then_some(*item)
        });
        if let Some(item) = owned
            && let Some(runs) = self.runs.get_mut(&item)
        {
            runs.asked();
            self.ready.mark(item);
        }
    }

    /// A roster read, sent at `sent` and answered at `received`, read the server's clock.
    pub fn observe_clock(&mut self, sent: Instant, received: Instant, server: Timestamp) {
        let sample = ServerClock::sample(sent, received, server);
        self.clock = Some(sample);
        // A sample that moves the occurrences' instants by a millisecond or more since the
        // runs were last given one (a clock stepped, or drift adding up) goes to every run and
        // sets every timer again; a check's round trip alone does not.
        if self
            .given
            .is_none_or(|given| sample.moved_from(&given) >= Duration::from_millis(1))
        {
            for runs in self.runs.values_mut() {
                runs.observe_check(sent, received, server);
            }
            self.given = Some(sample);
            self.ready.mark_all(self.runs.keys().copied());
        }
    }

    /// The latest sample of the server's clock, for runs that start again.
    pub fn clock(&self) -> Option<ServerClock> {
        self.clock
    }

    /// Stops owning `item`: its ledger is brought up to date (a run that was stopped is
    /// recorded as interrupted, `stopped` saying how and why), bounded by `timeout`.
    pub async fn disown(
        &mut self,
        item: u32,
        stopped: Option<(Option<ChildStatus>, &str)>,
        timeout: Duration,
    ) {
        self.disown_with(item, stopped, None, timeout).await;
    }

    /// [`Jobs::disown`], the run that was stopped having printed `output` last.
    pub async fn disown_with(
        &mut self,
        item: u32,
        stopped: Option<(Option<ChildStatus>, &str)>,
        output: Option<String>,
        timeout: Duration,
    ) {
        self.ready.forget(&item);
        if let Some(mut runs) = self.runs.remove(&item) {
            runs.stopped_with(output);
            runs.settle(stopped, timeout).await;
        }
        self.forget_retired(item);
    }

    /// Once a removed job is no longer owned, its definition goes.
    fn forget_retired(&mut self, item: u32) {
        self.redefined.remove(&item);
        if self.retired.remove(&item) {
            self.definitions.remove(&item);
        }
    }

    /// Stops owning `item` without a word to the ledger (the session is lost or in doubt: the
    /// job's next owner marks what was running as interrupted).
    pub fn forget(&mut self, item: u32) {
        self.ready.forget(&item);
        self.runs.remove(&item);
        self.forget_retired(item);
    }

    /// The environment of item `item`'s command for the occurrence `occurrence`, beside the
    /// leader's: the crontab's variables for the job (`SHELL` and `CRON_TZ` among them, as cron
    /// passes them on) and `PGLEADER_JOB`, or the shard's; then the run's.
    pub fn env(
        &self,
        item: u32,
        occurrence: Timestamp,
        attempt: i32,
        asked_by: Option<&str>,
    ) -> Vec<(&str, String)> {
        let Some(definition) = self.definitions.get(&item) else {
            return Vec::new();
        };
        let mut env: Vec<(&str, String)> = definition
            .env
            .iter()
            .map(|(name, value)| (name.as_str(), value.clone()))
            .collect();
        env.push(("PGLEADER_SCHEDULED_TIME", rfc3339(occurrence)));
        env.push(("PGLEADER_ATTEMPT", attempt.to_string()));
        if let Some(asked_by) = asked_by {
            env.push(("PGLEADER_ASKED_BY", asked_by.to_owned()));
        }
        env
    }
}

/// Each job of `crontab`, by its item: its command, `SHELL -c LINE`, and its ledger key.
fn define(
    lock: &LockKey,
    crontab: &Crontab,
    output: Output,
) -> Result<BTreeMap<u32, Definition>, CommandError> {
    let mut definitions = BTreeMap::new();
    for job in &crontab.jobs {
        let argv: Vec<OsString> = vec![
            job.shell.clone().into(),
            "-c".into(),
            job.command.clone().into(),
        ];
        let command =
            CommandLine::resolve(argv, std::env::var_os("PATH").as_deref())?.with_output(output);
        let plan = Plan {
            schedule: job.when.clone(),
            catch_up: job.catch_up,
            retry_interrupted: 0,
            once: false,
            busy_retry: Duration::from_millis(500),
            job: Some(job.name.clone()),
            overlap: job.overlap,
            // A job added or rescheduled runs from its next occurrence, as in cron.
            catch_up_new: false,
            jitter: job.jitter.unwrap_or_default(),
        };
        let mut env = job.env.clone();
        env.push(("PGLEADER_JOB".into(), job.name.clone()));
        let definition = Definition {
            label: Label::job(&job.name),
            plan,
            command,
            env,
            timeout: job.timeout,
            key: job_key(lock, &job.name),
            ping: job.ping.clone(),
        };
        definitions.insert(job.item(), definition);
    }
    Ok(definitions)
}

/// The items a crontab's fleet shares out: every job of this replica's file, with how it
/// defines each.
fn listing(crontab: &Crontab) -> Items {
    let jobs = &crontab.jobs;
    Items::Listed(Arc::new(Listing {
        items: jobs.iter().map(CronJob::item).collect(),
        definitions: jobs
            .iter()
            .map(|job| (job.item(), job.definition_marker()))
            .collect(),
    }))
}

/// The key a job's ledger rows are kept under ([`LockKey::of_job`]).
pub fn job_key(lock: &LockKey, job: &str) -> LockKey {
    lock.of_job(job)
}
