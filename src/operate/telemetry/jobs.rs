//! A crontab's jobs as one replica publishes them (`pgleader cron`): which jobs it knows, which
//! it owns and whether their commands run, and how each job's last run here went, for `/status`
//! and the per-job metrics.
//!
//! Five hooks, each called by the sharded room without waiting: [`Telemetry::jobs_defined`]
//! when the file is read (at start, and after a reread), [`Telemetry::jobs_owned`] (every
//! job's ownership, the first time the room publishes and after a reread) and
//! [`Telemetry::jobs_owned_changed`] (only what changed, after each of the room's other
//! events; each changes the snapshot, and wakes readers, only when the picture does),
//! [`Telemetry::jobs_defined_otherwise`] when the roster shows another member defining a job
//! otherwise (a rolling deploy half done) or agreeing again, and [`Telemetry::job_run`] from
//! each owned job's runs (the same `RunView` a `--schedule` leader publishes). Kept apart from
//! `telemetry.rs` because a job's state comes from two places, the room and the job's runs,
//! and is merged here by the job's name.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use serde_json::{Value, json};

use super::{CommandState, CommandView, Telemetry, command_json};
use crate::operate::metrics::JobMetrics;
use crate::schedule::calendar::{self, Schedule};
use crate::schedule::crontab::definition_hex;
use crate::schedule::{RunView, ScheduledOutcome};

/// A job this replica knows (or still runs after a reread removed it), as `/status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct JobView {
    pub name: String,
    /// `None` for a job a reread removed whose last run still goes on.
    pub schedule: Option<Schedule>,
    /// Whether this replica owns the job: it runs its occurrences.
    pub owned: bool,
    pub command: CommandView,
    /// The newest occurrence this replica claimed or recorded for it.
    pub last_run: Option<RunView>,
    /// When its last run here that succeeded ended.
    pub last_success: Option<Timestamp>,
    /// How this replica's file defines it (`CronJob::definition_marker`); `None` for a job a
    /// reread removed.
    pub definition: Option<u32>,
    /// The other members (their ids on the server) whose files define it otherwise.
    pub defined_otherwise_by: Vec<i32>,
}

impl JobView {
    fn new(name: &str, schedule: Option<Schedule>, definition: Option<u32>) -> JobView {
        JobView {
            name: name.to_owned(),
            schedule,
            definition,
            defined_otherwise_by: Vec::new(),
            owned: false,
            command: idle(),
            last_run: None,
            last_success: None,
        }
    }

    /// How late its last run started after its occurrence, on the server's clock.
    pub fn lateness(&self) -> Option<Duration> {
        self.last_run.as_ref()?.lateness()
    }
}

/// Sets whether `job` is owned here, with its command (`None`: not owned), keeping its last
/// exit when the new view knows none; true if that changed anything.
fn own(job: &mut JobView, command: Option<CommandView>, metrics: Option<&JobMetrics>) -> bool {
    let (is_owned, command) = match command {
        Some(command) => (true, command),
        None => (false, idle()),
    };
    let last_exit = command.last_exit.or(job.command.last_exit);
    let command = CommandView {
        last_exit,
        ..command
    };
    if job.owned == is_owned && job.command == command {
        return false;
    }
    if let Some(metrics) = metrics {
        metrics.set_owned(&job.name, is_owned, command.state == CommandState::Running);
    }
    job.owned = is_owned;
    job.command = command;
    true
}

fn idle() -> CommandView {
    CommandView {
        state: CommandState::NotRunning,
        pid: None,
        started_at: None,
        last_exit: None,
    }
}

impl Telemetry {
    /// The jobs of the file as read now, by name, schedule and definition: new ones are shown
    /// and their series start; those a reread removed go, unless this replica still runs them.
    pub fn jobs_defined(&self, defined: Vec<(String, Schedule, u32)>) {
        let metrics = self.inner.metrics.jobs.as_ref();
        let now = Timestamp::now();
        self.update(|s| {
            s.jobs.retain(|job| {
                let keep = job.owned || defined.iter().any(|(name, ..)| *name == job.name);
                if !keep && let Some(metrics) = metrics {
                    metrics.forget(&job.name);
                }
                keep
            });
            for job in &mut s.jobs {
                if !defined.iter().any(|(name, ..)| *name == job.name) {
                    job.definition = None;
                }
            }
            for (name, schedule, definition) in defined {
                let period = schedule.period_at(now);
                match s.jobs.iter_mut().find(|job| job.name == name) {
                    Some(job) if job.schedule.as_ref() == Some(&schedule) => {
                        job.definition = Some(definition);
                    }
                    Some(job) => {
                        job.definition = Some(definition);
                        if let Some(metrics) = metrics {
                            metrics.set_period(&name, period);
                        }
                        job.schedule = Some(schedule);
                    }
                    None => {
                        if let Some(metrics) = metrics {
                            metrics.define(&name, period);
                        }
                        s.jobs
                            .push(JobView::new(&name, Some(schedule), Some(definition)));
                    }
                }
            }
            s.jobs.sort_by(|a, b| a.name.cmp(&b.name));
        });
    }

    /// The jobs this replica owns now, by name, with their commands, every other job being
    /// owned no longer: the first time the room publishes, and after a reread. The snapshot
    /// changes (and readers wake) only when the picture does.
    pub fn jobs_owned(&self, owned: Vec<(String, CommandView)>) {
        let metrics = self.inner.metrics.jobs.as_ref();
        let owned: BTreeMap<String, CommandView> = owned.into_iter().collect();
        self.inner.state.send_if_modified(|s| {
            let mut changed = false;
            for job in &mut s.jobs {
                changed |= own(job, owned.get(&job.name).cloned(), metrics);
            }
            changed
        });
    }

    /// The jobs whose ownership or command changed since the last call, by name: each with
    /// its command now, or `None` when no longer owned here. After each of the room's events:
    /// only what changed is looked up (by name, in the sorted list), so a burst of a thousand
    /// runs costs each event its own jobs, not the whole file's.
    pub fn jobs_owned_changed(&self, changes: Vec<(String, Option<CommandView>)>) {
        if changes.is_empty() {
            return;
        }
        let metrics = self.inner.metrics.jobs.as_ref();
        self.inner.state.send_if_modified(|s| {
            let mut changed = false;
            for (name, command) in changes {
                if let Ok(at) = s.jobs.binary_search_by(|job| job.name.as_str().cmp(&name)) {
                    changed |= own(&mut s.jobs[at], command, metrics);
                }
            }
            changed
        });
    }

    /// The jobs another member defines otherwise than this replica's file, each with those
    /// members' ids (every job not listed agrees): after a roster read that changed it.
    pub fn jobs_defined_otherwise(&self, otherwise: BTreeMap<String, Vec<i32>>) {
        let metrics = self.inner.metrics.jobs.as_ref();
        self.inner.state.send_if_modified(|s| {
            let mut changed = false;
            for job in &mut s.jobs {
                let members = otherwise.get(&job.name).cloned().unwrap_or_default();
                if job.defined_otherwise_by == members {
                    continue;
                }
                if let Some(metrics) = metrics {
                    metrics.set_defined_otherwise(&job.name, !members.is_empty());
                }
                job.defined_otherwise_by = members;
                changed = true;
            }
            changed
        });
    }

    /// A ping of `job`'s to its monitor could not be delivered (`ping=`).
    pub fn ping_undelivered(&self, job: &str) {
        if let Some(metrics) = self.inner.metrics.jobs.as_ref() {
            metrics.ping_undelivered(job);
        }
    }

    /// An occurrence of `job` was claimed (no outcome yet) or its outcome recorded here.
    pub fn job_run(&self, job: &str, run: RunView) {
        let metrics = self.inner.metrics.jobs.as_ref();
        if let Some(metrics) = metrics {
            if let Some(outcome) = run.outcome {
                metrics.ran(job, outcome, run.ended_at.unwrap_or_else(Timestamp::now));
            } else if let Some(late) = run.lateness() {
                metrics.started(job, late);
            }
        }
        self.update(|s| {
            let at = match s
                .jobs
                .binary_search_by(|known| known.name.as_str().cmp(job))
            {
                Ok(at) => at,
                Err(_) => {
                    s.jobs.push(JobView::new(job, None, None));
                    s.jobs.sort_by(|a, b| a.name.cmp(&b.name));
                    s.jobs
                        .iter()
                        .position(|known| known.name == job)
                        .expect("just added")
                }
            };
            let view = &mut s.jobs[at];
            if run.outcome == Some(ScheduledOutcome::Succeeded) {
                view.last_success = run.ended_at.or(Some(Timestamp::now()));
            }
            match &mut view.last_run {
                // A later report of the same occurrence completes the earlier one.
                Some(known) if known.scheduled_for == run.scheduled_for => {
                    known.complete(run);
                }
                Some(known) if known.scheduled_for > run.scheduled_for => {}
                _ => view.last_run = Some(run),
            }
        });
    }
}

/// A job in `/status`: whether this replica owns it and runs it, its next occurrence after
/// `now` (on this host's clock; the owner starts it on the server's), its last run here.
pub fn job_json(job: &JobView, now: Timestamp) -> Value {
    json!({
        "name": job.name,
        "owned": job.owned,
        "command": command_json(&job.command),
        "schedule": job.schedule.as_ref().map(Schedule::expression),
        "timezone": job.schedule.as_ref().map(Schedule::timezone),
        "next_occurrence": job.schedule.as_ref().and_then(|s| s.next_after(now)).map(calendar::rfc3339),
        "last_run": job.last_run.as_ref().map(|run| json!({
            "scheduled_for": calendar::rfc3339(run.scheduled_for),
            "outcome": run.outcome.map_or("running", ScheduledOutcome::as_str),
            "exit_code": run.exit_code,
            "claimed_at": run.claimed_at.map(calendar::rfc3339),
            "ended_at": run.ended_at.map(calendar::rfc3339),
            "host": run.host,
            "lateness_seconds": job.lateness().map(|late| late.as_secs_f64()),
        })),
        "last_success": job.last_success.map(calendar::rfc3339),
        "definition": job.definition.map(definition_hex),
        "defined_otherwise_by": job.defined_otherwise_by,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jiff::{SignedDuration, Timestamp};

    use super::*;
    use crate::election::lock::LockKey;
    use crate::operate::telemetry::{Role, Settings};

    /// The telemetry of a `pgleader cron` replica.
    fn crontab_replica() -> Telemetry {
        Telemetry::new(Settings {
            lock: LockKey::from_name("app-cron"),
            connection: "app@db:5432/app".into(),
            check_deadline: Duration::from_secs(3),
            schedule: None,
            shards: None,
            health_check: false,
            crontab: true,
        })
    }

    fn every(seconds: u64) -> Schedule {
        Schedule::every(Duration::from_secs(seconds)).expect("every")
    }

    /// A command that runs as `pid`.
    fn running(pid: i32) -> CommandView {
        CommandView {
            state: CommandState::Running,
            pid: Some(pid),
            started_at: Some(Timestamp::now()),
            last_exit: None,
        }
    }

    #[test]
    fn a_crontab_replica_shows_its_jobs_and_their_series() {
        let t = crontab_replica();
        t.jobs_defined(vec![
            ("report".into(), every(60), 0x1a2b3c4d),
            ("backup".into(), every(5), 7),
        ]);
        t.following(10);
        t.shards_held(Vec::new(), 10);
        assert_eq!(t.leads(&t.snapshot()), Err("follower: owns no job".into()));
        t.jobs_owned(vec![("backup".into(), running(42))]);
        let at = Timestamp::from_second(1_800_000_000).expect("time");
        t.job_run(
            "backup",
            RunView {
                scheduled_for: at,
                outcome: None,
                exit_code: None,
                attempt: Some(1),
                claimed_at: Some(at + SignedDuration::from_millis(250)),
                ended_at: None,
                host: Some("web-1".into()),
                delay: Duration::ZERO,
            },
        );
        t.job_run(
            "backup",
            RunView {
                scheduled_for: at,
                outcome: Some(ScheduledOutcome::Succeeded),
                exit_code: Some(0),
                attempt: None,
                claimed_at: None,
                ended_at: Some(at + SignedDuration::from_secs(2)),
                host: None,
                delay: Duration::ZERO,
            },
        );
        let status = t.status_json(&t.snapshot(), Timestamp::now());
        let jobs = status["jobs"].as_array().expect("jobs");
        assert_eq!(jobs.len(), 2, "{status}");
        assert_eq!(jobs[0]["name"], "backup");
        assert_eq!(jobs[0]["owned"], true);
        assert_eq!(jobs[0]["command"]["pid"], 42);
        assert_eq!(jobs[0]["schedule"], "@every 5s");
        assert!(jobs[0]["next_occurrence"].is_string(), "{status}");
        assert_eq!(jobs[0]["last_run"]["outcome"], "succeeded");
        assert_eq!(jobs[0]["last_run"]["host"], "web-1");
        assert_eq!(jobs[0]["last_run"]["lateness_seconds"], 0.25);
        assert_eq!(jobs[1]["name"], "report");
        assert_eq!(jobs[1]["owned"], false);
        assert!(jobs[1]["last_run"].is_null());
        let metrics = t.render_metrics();
        for line in [
            "pgleader_job_owned{job=\"backup\",lock=\"app-cron\"} 1",
            "pgleader_job_owned{job=\"report\",lock=\"app-cron\"} 0",
            "pgleader_job_running{job=\"backup\",lock=\"app-cron\"} 1",
            "pgleader_job_runs_total{job=\"backup\",outcome=\"succeeded\",lock=\"app-cron\"} 1",
            "pgleader_job_runs_total{job=\"report\",outcome=\"failed\",lock=\"app-cron\"} 0",
            "pgleader_job_lateness_seconds{job=\"backup\",lock=\"app-cron\"} 0.25",
            "pgleader_job_last_success_timestamp_seconds{job=\"backup\",lock=\"app-cron\"} 1800000002",
            "pgleader_job_period_seconds{job=\"report\",lock=\"app-cron\"} 60",
        ] {
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
        assert!(!metrics.contains("pgleader_shard"), "{metrics}");
        // Another member defines backup otherwise, then agrees again.
        let mismatch = |t: &Telemetry| {
            let line = "pgleader_job_definition_mismatch{job=\"backup\",lock=\"app-cron\"} ";
            let metrics = t.render_metrics();
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(line))
                .map(str::to_owned)
        };
        assert_eq!(mismatch(&t).as_deref(), Some("0"));
        t.jobs_defined_otherwise(BTreeMap::from([("backup".into(), vec![77])]));
        let status = t.status_json(&t.snapshot(), Timestamp::now());
        assert_eq!(
            status["jobs"][0]["defined_otherwise_by"],
            json!([77]),
            "{status}"
        );
        assert_eq!(status["jobs"][0]["definition"], "00000007", "{status}");
        assert_eq!(
            status["jobs"][1]["defined_otherwise_by"],
            json!([]),
            "{status}"
        );
        assert_eq!(mismatch(&t).as_deref(), Some("1"));
        t.jobs_defined_otherwise(BTreeMap::new());
        assert_eq!(mismatch(&t).as_deref(), Some("0"));
        // A reread that removes a job it does not own: its series go.
        t.jobs_defined(vec![("backup".into(), every(5), 7)]);
        assert_eq!(t.snapshot().jobs.len(), 1);
        assert!(!t.render_metrics().contains("job=\"report\""));
        t.shards_held(Vec::new(), 10);
        assert_eq!(t.snapshot().role, Role::Follower);
    }

    #[test]
    fn changes_of_ownership_touch_only_the_jobs_named() {
        let t = crontab_replica();
        t.jobs_defined(vec![
            ("c".into(), every(60), 3),
            ("a".into(), every(60), 1),
            ("b".into(), every(60), 2),
        ]);
        let owned = |t: &Telemetry| -> Vec<(String, bool, Option<i32>)> {
            t.snapshot()
                .jobs
                .iter()
                .map(|job| (job.name.clone(), job.owned, job.command.pid))
                .collect()
        };
        t.jobs_owned(vec![("a".into(), idle()), ("c".into(), running(30))]);
        assert_eq!(
            owned(&t),
            [
                ("a".into(), true, None),
                ("b".into(), false, None),
                ("c".into(), true, Some(30))
            ]
        );
        // b is taken and runs, c is given away, a is left alone; an unknown name is ignored.
        let mut readers = t.subscribe();
        readers.borrow_and_update();
        t.jobs_owned_changed(vec![
            ("b".into(), Some(running(20))),
            ("c".into(), None),
            ("zz".into(), None),
        ]);
        assert_eq!(
            owned(&t),
            [
                ("a".into(), true, None),
                ("b".into(), true, Some(20)),
                ("c".into(), false, None)
            ]
        );
        assert!(readers.has_changed().expect("open"));
        // Nothing changed: the readers are not woken.
        readers.borrow_and_update();
        t.jobs_owned_changed(vec![("c".into(), None)]);
        t.jobs_owned_changed(Vec::new());
        assert!(!readers.has_changed().expect("open"));
        let metrics = t.render_metrics();
        for line in [
            "pgleader_job_owned{job=\"b\",lock=\"app-cron\"} 1",
            "pgleader_job_running{job=\"b\",lock=\"app-cron\"} 1",
            "pgleader_job_owned{job=\"c\",lock=\"app-cron\"} 0",
        ] {
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
    }
}
