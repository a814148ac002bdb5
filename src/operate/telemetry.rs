//! What pgleader publishes about itself for the HTTP endpoint (`--http`): a small state value
//! (role, epoch, since when, last check, the command, the schedule) and the Prometheus
//! counters.
//!
//! The supervisor calls one method per transition and never waits: the state goes out through a
//! `tokio::sync::watch` channel, whose latest value readers clone, and the counters are atomics.
//! Nothing a reader does (a slow client, a stuck scrape) can hold up a check, a stop or a
//! handoff: the only lock is the channel's, held for the time of a field update or a clone,
//! never across an `.await`.

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::exit::ChildStatus;
use crate::operate::metrics::{CommandOutcome, HealthResult, LossReason, Metrics};
use crate::schedule::calendar::{self, Schedule};
use crate::schedule::{RunView, ScheduledOutcome};

/// What this instance is doing in the election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Connecting, or reconnecting after a failure.
    Connecting,
    /// Connected and queued for the lock.
    Follower,
    /// Holds the lock and has its fencing token.
    Leader,
    /// Leadership is ending: the command is being stopped, the lock released.
    SteppingDown,
    /// Between two leaderships by choice: the command exited, `--restart-delay` runs; or out
    /// of the election until the health probe passes (`--health-cmd`).
    Idle,
    /// TERM or INT arrived: stopping the command, releasing the lock, exiting.
    ShuttingDown,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Connecting => "connecting",
            Role::Follower => "follower",
            Role::Leader => "leader",
            Role::SteppingDown => "stepping_down",
            Role::Idle => "idle",
            Role::ShuttingDown => "shutting_down",
        }
    }
}

/// How many runs `/status` shows.
pub const RUNS_SHOWN: usize = 10;

/// The command's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandState {
    NotRunning,
    /// Leading, but --takeover-delay or --restart-fence holds the start back.
    Waiting,
    Running,
    /// The stop signal went out; waiting for everything it started to exit.
    Stopping,
}

impl CommandState {
    pub fn as_str(self) -> &'static str {
        match self {
            CommandState::NotRunning => "not_running",
            CommandState::Waiting => "waiting",
            CommandState::Running => "running",
            CommandState::Stopping => "stopping",
        }
    }
}

/// The command, as `/status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandView {
    pub state: CommandState,
    pub pid: Option<i32>,
    pub started_at: Option<Timestamp>,
    /// How the last run ended, and when.
    pub last_exit: Option<(ChildStatus, Timestamp)>,
}

/// The health probe's verdict (`--health-cmd`), Docker's states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthState {
    /// No probe has passed yet: the replica does not queue.
    Starting,
    Healthy,
    /// `--health-retries` failures in a row, and no pass since: the replica does not queue or
    /// lead.
    Unhealthy,
}

impl HealthState {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Starting => "starting",
            HealthState::Healthy => "healthy",
            HealthState::Unhealthy => "unhealthy",
        }
    }
}

/// The health probe, as `/status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthView {
    pub state: HealthState,
    pub consecutive_failures: u32,
    /// When the last probe ended.
    pub last_check: Option<Timestamp>,
    /// When the last failing probe ended, and why it failed.
    pub last_failure: Option<(Timestamp, String)>,
}

/// The published state: what `/leader`, `/healthz` and `/status` answer from.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub role: Role,
    /// When the current role began.
    pub since: Timestamp,
    /// Why this instance is not healthy (a failed connection, a lost leadership), if it is not.
    pub problem: Option<String>,
    /// The current session's server process.
    pub backend_pid: Option<i32>,
    /// The fencing token of the current leadership, or of the last one.
    pub epoch: Option<i64>,
    /// The last time the leader's session proved it holds the lock (winning it, or a check).
    pub last_check: Option<Timestamp>,
    pub command: CommandView,
    /// With a schedule: the runs this instance claimed or recorded, newest first.
    pub runs: Vec<RunView>,
    /// With `--shards`: the shards this replica holds, by number.
    pub shards: Vec<ShardView>,
    /// With `--health-cmd`: the probe's state.
    pub health: Option<HealthView>,
}

/// A shard this replica holds, as `/status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardView {
    pub shard: u32,
    /// The fencing token of this hold.
    pub epoch: i64,
    /// When this replica took it.
    pub since: Timestamp,
    pub command: CommandView,
}

/// What does not change while pgleader runs.
#[derive(Debug)]
struct Identity {
    lock: LockKey,
    /// `user@host:port/db`: never a password.
    connection: String,
    pid: u32,
    host: String,
    /// A leader whose last check is older than this is not healthy.
    check_deadline: Duration,
    schedule: Option<Schedule>,
    /// `--shards K`.
    shards: Option<u32>,
}

/// The handle the supervisor publishes through and the HTTP server reads from. Clones share
/// the same state.
#[derive(Clone, Debug)]
pub struct Telemetry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    identity: Identity,
    state: watch::Sender<Snapshot>,
    metrics: Metrics,
}

/// The settings the published state depends on.
#[derive(Debug)]
pub struct Settings {
    pub lock: LockKey,
    /// Shown in `/status`: the redacted `user@host:port/db`.
    pub connection: String,
    /// --check-interval + --check-timeout.
    pub check_deadline: Duration,
    /// The schedule (`--schedule`) that drives the command, if one does: `/leader` then
    /// answers 200 while the lock is held, between runs too, and the scheduled-run counters
    /// exist.
    pub schedule: Option<Schedule>,
    /// The shard count (`--shards`), if the lock is sharded: `/leader` then answers 200 while
    /// the command of at least one shard runs here, and the per-shard metrics exist.
    pub shards: Option<u32>,
    /// Whether a health probe runs (`--health-cmd`): `/healthz` and `/status` then show it,
    /// and its metrics exist.
    pub health_check: bool,
}

impl Telemetry {
    pub fn new(settings: Settings) -> Telemetry {
        let host = host_name();
        let metrics = Metrics::new(
            &settings.lock,
            settings.schedule.is_some(),
            settings.shards,
            settings.health_check,
        );
        let (state, _) = watch::channel(Snapshot {
            role: Role::Connecting,
            since: Timestamp::now(),
            problem: None,
            backend_pid: None,
            epoch: None,
            last_check: None,
            command: CommandView {
                state: CommandState::NotRunning,
                pid: None,
                started_at: None,
                last_exit: None,
            },
            runs: Vec::new(),
            shards: Vec::new(),
            health: settings.health_check.then_some(HealthView {
                state: HealthState::Starting,
                consecutive_failures: 0,
                last_check: None,
                last_failure: None,
            }),
        });
        Telemetry {
            inner: Arc::new(Inner {
                identity: Identity {
                    lock: settings.lock,
                    connection: settings.connection,
                    pid: std::process::id(),
                    host,
                    check_deadline: settings.check_deadline,
                    schedule: settings.schedule,
                    shards: settings.shards,
                },
                state,
                metrics,
            }),
        }
    }

    /// A copy of the current state.
    pub fn snapshot(&self) -> Snapshot {
        self.inner.state.borrow().clone()
    }

    /// A receiver that sees every new state (`changed()`), for readers that wait.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.inner.state.subscribe()
    }

    /// The Prometheus text exposition of the counters.
    pub fn render_metrics(&self) -> String {
        self.inner.metrics.render()
    }

    // The supervisor's hooks, one per transition.

    /// Connecting (again).
    pub fn connecting(&self) {
        self.update(|s| s.enter(Role::Connecting));
    }

    /// A connection attempt failed; another follows after `retry_in`.
    pub fn connect_failed(&self, reason: &str, retry_in: Duration) {
        self.inner.metrics.connection_failures.inc();
        let problem = format!(
            "cannot connect: {reason}; retrying in {}",
            humantime::format_duration(Duration::from_millis(retry_in.as_millis() as u64))
        );
        self.update(|s| {
            s.enter(Role::Connecting);
            s.problem = Some(problem);
        });
    }

    /// Connected and queued for the lock.
    pub fn following(&self, backend_pid: i32) {
        self.update(|s| {
            s.enter(Role::Follower);
            s.backend_pid = Some(backend_pid);
        });
    }

    /// The session broke while waiting for the lock; reconnecting follows.
    pub fn session_lost(&self, reason: &str) {
        let problem = format!("lost the session while waiting for the lock: {reason}");
        self.update(|s| {
            s.enter(Role::Connecting);
            s.problem = Some(problem);
        });
    }

    /// Won the lock and took the fencing token `epoch`.
    pub fn leading(&self, epoch: i64, backend_pid: i32) {
        let metrics = &self.inner.metrics;
        metrics.is_leader.set(1);
        metrics.epoch.set(epoch);
        metrics.acquired.inc();
        let now = Timestamp::now();
        metrics.last_check.set(timestamp(now));
        let scheduled = self.inner.identity.schedule.is_some();
        self.update(|s| {
            s.enter(Role::Leader);
            s.epoch = Some(epoch);
            s.backend_pid = Some(backend_pid);
            s.last_check = Some(now);
            if !scheduled {
                s.command.state = CommandState::Waiting;
            }
        });
    }

    /// The command started with this pid.
    pub fn command_started(&self, pid: i32) {
        self.inner.metrics.command_running.set(1);
        self.update(|s| {
            s.command.state = CommandState::Running;
            s.command.pid = Some(pid);
            s.command.started_at = Some(Timestamp::now());
        });
    }

    /// A check came back after `took`; `held` if it confirmed the lock.
    pub fn check_completed(&self, took: Duration, held: bool) {
        let metrics = &self.inner.metrics;
        metrics.check_duration.observe(took.as_secs_f64());
        if held {
            let now = Timestamp::now();
            metrics.last_check.set(timestamp(now));
            self.update(|s| s.last_check = Some(now));
        }
    }

    /// The leadership ended, for `reason` (`detail` says more); the command is being stopped.
    pub fn leadership_lost(&self, reason: LossReason, detail: &str) {
        let metrics = &self.inner.metrics;
        metrics.is_leader.set(0);
        metrics.lost.with_label_values(&[reason.as_str()]).inc();
        let role = match reason {
            LossReason::Shutdown => Role::ShuttingDown,
            _ => Role::SteppingDown,
        };
        let problem = format!("leadership ended: {detail}");
        self.update(|s| {
            s.enter(role);
            s.problem = Some(problem);
            if s.command.state == CommandState::Running {
                s.command.state = CommandState::Stopping;
            } else if s.command.state == CommandState::Waiting {
                s.command.state = CommandState::NotRunning;
            }
        });
    }

    /// The command exited (on its own, or stopped).
    pub fn command_exited(&self, status: ChildStatus) {
        let metrics = &self.inner.metrics;
        metrics.command_running.set(0);
        metrics
            .command_exits
            .with_label_values(&[CommandOutcome::of(status).as_str()])
            .inc();
        self.update(|s| {
            s.command.state = CommandState::NotRunning;
            s.command.pid = None;
            s.command.last_exit = Some((status, Timestamp::now()));
        });
    }

    /// Released the lock after the command exited; waiting --restart-delay.
    pub fn idle(&self) {
        self.update(|s| s.enter(Role::Idle));
    }

    /// TERM or INT arrived.
    pub fn shutting_down(&self) {
        self.update(|s| {
            if s.role != Role::ShuttingDown {
                s.enter(Role::ShuttingDown);
            }
        });
    }

    // The health probe's hook.

    /// A health probe ended with `result`; `view` is the state it leaves.
    pub fn health_probed(&self, view: HealthView, result: HealthResult) {
        if let Some(health) = &self.inner.metrics.health {
            health.checks.with_label_values(&[result.as_str()]).inc();
            health.ok.set(i64::from(view.state == HealthState::Healthy));
            health
                .consecutive_failures
                .set(i64::from(view.consecutive_failures));
        }
        self.update(|s| s.health = Some(view));
    }

    // The sharded room's hooks.

    /// Took shard `shard` with the fencing token `epoch`.
    pub fn shard_taken(&self, shard: u32, epoch: i64) {
        let metrics = &self.inner.metrics;
        metrics.acquired.inc();
        metrics.epoch.set(epoch);
        if let Some(shards) = &metrics.shards {
            let label = shard.to_string();
            shards.acquired.with_label_values(&[&label]).inc();
            shards.epoch.with_label_values(&[&label]).set(epoch);
        }
    }

    /// A shard's command ended (on its own, or stopped).
    pub fn shard_command_exited(&self, status: ChildStatus) {
        self.inner
            .metrics
            .command_exits
            .with_label_values(&[CommandOutcome::of(status).as_str()])
            .inc();
    }

    /// The shards held here now, by number: the room's whole picture after each event. A
    /// replica that holds one leads, for the role; the snapshot changes (and readers wake), and
    /// the per-shard gauges of the shards that changed are set, only when the picture does.
    pub fn shards_held(&self, held: Vec<ShardView>, backend_pid: i32) {
        let metrics = &self.inner.metrics;
        self.inner.state.send_if_modified(|s| {
            let role = match s.role {
                Role::ShuttingDown => Role::ShuttingDown,
                // Every shard lost: stepping down until the last command is gone.
                Role::SteppingDown if !held.is_empty() => Role::SteppingDown,
                _ if held.is_empty() => Role::Follower,
                _ => Role::Leader,
            };
            if s.shards == held && s.role == role && s.backend_pid == Some(backend_pid) {
                return false;
            }
            let running = |view: &ShardView| i64::from(view.command.state == CommandState::Running);
            metrics.command_running.set(held.iter().map(running).sum());
            metrics.is_leader.set(i64::from(role == Role::Leader));
            if let Some(shards) = &metrics.shards {
                shards.held_count.set(held.len() as i64);
                // What changed: the shards of the old picture, then those of the new.
                for view in &s.shards {
                    let label = view.shard.to_string();
                    shards.held.with_label_values(&[&label]).set(0);
                    shards.running.with_label_values(&[&label]).set(0);
                }
                for view in &held {
                    let label = view.shard.to_string();
                    shards.held.with_label_values(&[&label]).set(1);
                    shards
                        .running
                        .with_label_values(&[&label])
                        .set(running(view));
                }
            }
            if role != s.role && role == Role::Leader {
                s.last_check = Some(Timestamp::now());
            }
            s.enter(role);
            s.backend_pid = Some(backend_pid);
            s.epoch = held.iter().map(|shard| shard.epoch).max().or(s.epoch);
            s.shards = held;
            true
        });
    }

    // The scheduler's hooks.

    /// An occurrence was claimed (no outcome yet) or its outcome recorded: counted once it
    /// has an outcome, and shown by `/status` (a later report of the same occurrence updates
    /// the earlier one).
    pub fn scheduled_run(&self, run: RunView) {
        if let (Some(outcome), Some(runs)) = (run.outcome, &self.inner.metrics.scheduled_runs) {
            runs.with_label_values(&[outcome.as_str()]).inc();
        }
        self.update(|s| {
            match s
                .runs
                .iter_mut()
                .find(|known| known.scheduled_for == run.scheduled_for)
            {
                Some(known) => {
                    known.outcome = run.outcome;
                    known.exit_code = run.exit_code.or(known.exit_code);
                    known.attempt = run.attempt.or(known.attempt);
                    known.claimed_at = run.claimed_at.or(known.claimed_at);
                    known.ended_at = run.ended_at.or(known.ended_at);
                    known.host = run.host.or(known.host.take());
                }
                None => {
                    s.runs.insert(0, run);
                    s.runs
                        .sort_by_key(|run| std::cmp::Reverse(run.scheduled_for));
                    s.runs.truncate(RUNS_SHOWN);
                }
            }
        });
    }

    fn update(&self, change: impl FnOnce(&mut Snapshot)) {
        // send_modify stores the value even when nobody subscribes.
        self.inner.state.send_modify(change);
    }

    // What the HTTP routes answer.

    /// Whether this instance leads, for `/leader`: it holds the lock and its command runs (or,
    /// with a schedule, holds the lock between runs too). `Err` says what it does instead.
    pub fn leads(&self, snapshot: &Snapshot) -> Result<(), String> {
        if self.inner.identity.shards.is_some() {
            // Sharded: a replica leads while the command of at least one shard runs here.
            return match snapshot.role {
                Role::Leader
                    if snapshot
                        .shards
                        .iter()
                        .any(|shard| shard.command.state == CommandState::Running) =>
                {
                    Ok(())
                }
                Role::Leader => Err(
                    "holds shards, but none of their commands has started yet (--takeover-delay, --restart-fence, --restart-delay)"
                        .to_owned(),
                ),
                Role::Follower => Err("follower: holds no shard".to_owned()),
                role => Err(role.as_str().to_owned()),
            };
        }
        match (snapshot.role, snapshot.command.state) {
            (Role::Leader, CommandState::Running) => Ok(()),
            (Role::Leader, _) if self.inner.identity.schedule.is_some() => Ok(()),
            (Role::Leader, _) => Err(
                "leader, but the command has not started yet (--takeover-delay, --restart-fence)"
                    .to_owned(),
            ),
            (role, _) => Err(role.as_str().to_owned()),
        }
    }

    /// Whether this instance is healthy, for `/healthz`: following, leading with a recent
    /// successful check, or idle between leaderships; and with `--health-cmd`, its probe has
    /// passed and not failed `--health-retries` times in a row since. `Err` says why not.
    pub fn health(&self, snapshot: &Snapshot, now: Timestamp) -> Result<(), String> {
        if let Some(probe) = &snapshot.health {
            match probe.state {
                HealthState::Healthy => {}
                HealthState::Starting => {
                    return Err(
                        "starting: the health probe (--health-cmd) has not passed yet".to_owned(),
                    );
                }
                HealthState::Unhealthy => {
                    let last = probe
                        .last_failure
                        .as_ref()
                        .map_or("", |(_, reason)| reason.as_str());
                    return Err(format!(
                        "unhealthy: the health probe (--health-cmd) failed {} times in a row (last: {last})",
                        probe.consecutive_failures
                    ));
                }
            }
        }
        let deadline = self.inner.identity.check_deadline;
        match snapshot.role {
            Role::Follower | Role::Idle => Ok(()),
            Role::Leader => {
                let since = snapshot.last_check.unwrap_or(snapshot.since);
                let age = crate::time::elapsed(since, now);
                if age <= deadline {
                    Ok(())
                } else {
                    Err(format!(
                        "no successful check for {}",
                        humantime::format_duration(Duration::from_millis(age.as_millis() as u64))
                    ))
                }
            }
            Role::Connecting => Err(snapshot
                .problem
                .clone()
                .unwrap_or_else(|| "connecting".to_owned())),
            Role::SteppingDown | Role::ShuttingDown => Err(snapshot
                .problem
                .clone()
                .unwrap_or_else(|| snapshot.role.as_str().to_owned())),
        }
    }

    /// The body of `/status`.
    pub fn status_json(&self, snapshot: &Snapshot, now: Timestamp) -> Value {
        let identity = &self.inner.identity;
        let health = self.health(snapshot, now);
        let command = &snapshot.command;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "role": snapshot.role.as_str(),
            "since": rfc3339(snapshot.since),
            "leader": self.leads(snapshot).is_ok(),
            "healthy": health.is_ok(),
            "problem": health.err(),
            "lock": {"key": identity.lock.key(), "name": identity.lock.name()},
            "connection": identity.connection,
            "pid": identity.pid,
            "host": identity.host,
            "backend_pid": snapshot.backend_pid,
            "epoch": snapshot.epoch,
            "last_check": snapshot.last_check.map(rfc3339),
            "health": snapshot.health.as_ref().map(health_json),
            "command": command_json(command),
            "schedule": identity.schedule.as_ref().map(|schedule| schedule_json(schedule, &snapshot.runs, now)),
            "shards": identity.shards.map(|count| json!({
                "count": count,
                "held": snapshot.shards.iter().map(|shard| json!({
                    "shard": shard.shard,
                    "epoch": shard.epoch,
                    "since": rfc3339(shard.since),
                    "command": command_json(&shard.command),
                })).collect::<Vec<_>>(),
            })),
        })
    }
}

impl Snapshot {
    fn enter(&mut self, role: Role) {
        if self.role != role {
            self.role = role;
            self.since = Timestamp::now();
        }
        if matches!(role, Role::Follower | Role::Leader | Role::Idle) {
            self.problem = None;
        }
    }
}

fn health_json(health: &HealthView) -> Value {
    json!({
        "state": health.state.as_str(),
        "consecutive_failures": health.consecutive_failures,
        "last_check": health.last_check.map(rfc3339),
        "last_failure": health.last_failure.as_ref().map(|(at, reason)| json!({
            "at": rfc3339(*at),
            "reason": reason,
        })),
    })
}

fn command_json(command: &CommandView) -> Value {
    json!({
        "state": command.state.as_str(),
        "pid": command.pid,
        "started_at": command.started_at.map(rfc3339),
        "last_exit": command.last_exit.map(|(status, at)| json!({
            "status": status.to_string(),
            "exit_code": status.exit_code(),
            "at": rfc3339(at),
        })),
    })
}

/// The schedule, its next occurrence after `now` on this host's clock (the leader starts it on
/// the server's), and the runs this instance saw.
fn schedule_json(schedule: &Schedule, runs: &[RunView], now: Timestamp) -> Value {
    json!({
        "expression": schedule.expression(),
        "timezone": schedule.timezone(),
        "next_occurrence": schedule.next_after(now).map(calendar::rfc3339),
        "last_runs": runs.iter().map(|run| json!({
            "scheduled_for": calendar::rfc3339(run.scheduled_for),
            "outcome": run.outcome.map_or("running", ScheduledOutcome::as_str),
            "exit_code": run.exit_code,
            "attempt": run.attempt,
            "claimed_at": run.claimed_at.map(calendar::rfc3339),
            "ended_at": run.ended_at.map(calendar::rfc3339),
            "host": run.host,
        })).collect::<Vec<_>>(),
    })
}

/// RFC 3339 in UTC, to the millisecond: `2026-11-21T07:58:38.088Z`.
pub fn rfc3339(time: Timestamp) -> String {
    crate::time::rfc3339_millis(time)
}

/// Seconds since the Unix epoch, as Prometheus timestamps are.
fn timestamp(time: Timestamp) -> f64 {
    time.as_microsecond() as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;

    fn telemetry(scheduled: bool) -> Telemetry {
        Telemetry::new(Settings {
            lock: LockKey::from_name("nightly"),
            connection: "app@db:5432/app".into(),
            check_deadline: Duration::from_secs(3),
            schedule: scheduled
                .then(|| Schedule::parse("0 3 * * *", "Europe/Paris").expect("a schedule")),
            shards: None,
            health_check: false,
        })
    }

    #[test]
    fn leads_only_while_the_command_runs_unless_scheduled() {
        let t = telemetry(false);
        assert!(t.leads(&t.snapshot()).is_err());
        t.following(10);
        assert_eq!(t.leads(&t.snapshot()), Err("follower".to_owned()));
        t.leading(7, 10);
        assert!(t.leads(&t.snapshot()).is_err(), "fenced, not started yet");
        t.command_started(42);
        assert_eq!(t.leads(&t.snapshot()), Ok(()));
        t.leadership_lost(LossReason::ConnectionEnded, "the connection ended");
        assert!(t.leads(&t.snapshot()).is_err());
        assert_eq!(t.snapshot().command.state, CommandState::Stopping);

        let s = telemetry(true);
        s.leading(8, 11);
        assert_eq!(
            s.leads(&s.snapshot()),
            Ok(()),
            "a schedule leads between runs"
        );
    }

    #[test]
    fn a_sharded_replica_leads_while_a_shard_s_command_runs() {
        let t = Telemetry::new(Settings {
            lock: LockKey::from_name("orders"),
            connection: "app@db:5432/app".into(),
            check_deadline: Duration::from_secs(3),
            schedule: None,
            shards: Some(4),
            health_check: false,
        });
        t.following(10);
        t.shards_held(Vec::new(), 10);
        assert_eq!(
            t.leads(&t.snapshot()),
            Err("follower: holds no shard".to_owned())
        );
        let shard = |shard: u32, state: CommandState| ShardView {
            shard,
            epoch: 7,
            since: Timestamp::now(),
            command: CommandView {
                state,
                pid: None,
                started_at: None,
                last_exit: None,
            },
        };
        t.shard_taken(2, 7);
        t.shards_held(vec![shard(2, CommandState::Waiting)], 10);
        assert_eq!(t.snapshot().role, Role::Leader);
        assert!(t.leads(&t.snapshot()).is_err(), "held, not started yet");
        t.shards_held(
            vec![
                shard(1, CommandState::Waiting),
                shard(2, CommandState::Running),
            ],
            10,
        );
        assert_eq!(t.leads(&t.snapshot()), Ok(()));
        let status = t.status_json(&t.snapshot(), Timestamp::now());
        assert_eq!(status["shards"]["count"], 4);
        assert_eq!(status["shards"]["held"][1]["shard"], 2, "{status}");
        assert_eq!(status["shards"]["held"][1]["command"]["state"], "running");
        let metrics = t.render_metrics();
        for line in [
            "pgleader_shards_held{lock=\"orders\"} 2",
            "pgleader_shard_held{shard=\"2\",lock=\"orders\"} 1",
            "pgleader_shard_held{shard=\"3\",lock=\"orders\"} 0",
            "pgleader_shard_command_running{shard=\"1\",lock=\"orders\"} 0",
            "pgleader_shard_command_running{shard=\"2\",lock=\"orders\"} 1",
            "pgleader_shard_epoch{shard=\"2\",lock=\"orders\"} 7",
            "pgleader_shard_acquired_total{shard=\"2\",lock=\"orders\"} 1",
            "pgleader_command_running{lock=\"orders\"} 1",
        ] {
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
        t.shards_held(Vec::new(), 10);
        assert_eq!(t.snapshot().role, Role::Follower);
    }

    #[test]
    fn health_follows_the_role_and_the_last_check() {
        let t = telemetry(false);
        let now = Timestamp::now();
        assert_eq!(t.health(&t.snapshot(), now), Err("connecting".to_owned()));
        t.connect_failed("connection refused", Duration::from_millis(400));
        let err = t.health(&t.snapshot(), now).expect_err("unhealthy");
        assert!(
            err.contains("connection refused") && err.contains("400ms"),
            "{err}"
        );
        t.following(10);
        assert_eq!(t.health(&t.snapshot(), Timestamp::now()), Ok(()));
        t.leading(7, 10);
        let snapshot = t.snapshot();
        assert_eq!(t.health(&snapshot, Timestamp::now()), Ok(()));
        let later = Timestamp::now() + jiff::SignedDuration::from_secs(5);
        let err = t.health(&snapshot, later).expect_err("stale check");
        assert!(err.starts_with("no successful check for"), "{err}");
        t.check_completed(Duration::from_millis(2), true);
        t.leadership_lost(LossReason::NotHeld, "not held");
        assert!(t.health(&t.snapshot(), Timestamp::now()).is_err());
        t.idle();
        assert_eq!(t.health(&t.snapshot(), Timestamp::now()), Ok(()));
    }

    #[test]
    fn the_health_probe_gates_healthz_and_shows_in_the_status_and_metrics() {
        let t = Telemetry::new(Settings {
            lock: LockKey::from_name("nightly"),
            connection: "app@db:5432/app".into(),
            check_deadline: Duration::from_secs(3),
            schedule: None,
            shards: None,
            health_check: true,
        });
        t.following(10);
        let err = t
            .health(&t.snapshot(), Timestamp::now())
            .expect_err("starting");
        assert!(err.starts_with("starting:"), "{err}");
        let passed = |failures| HealthView {
            state: HealthState::Healthy,
            consecutive_failures: failures,
            last_check: Some(Timestamp::now()),
            last_failure: None,
        };
        t.health_probed(passed(0), HealthResult::Passed);
        assert_eq!(t.health(&t.snapshot(), Timestamp::now()), Ok(()));
        let at = Timestamp::now();
        t.health_probed(
            HealthView {
                state: HealthState::Unhealthy,
                consecutive_failures: 3,
                last_check: Some(at),
                last_failure: Some((at, "timed out after 5s".to_owned())),
            },
            HealthResult::TimedOut,
        );
        let err = t
            .health(&t.snapshot(), Timestamp::now())
            .expect_err("unhealthy");
        assert_eq!(
            err,
            "unhealthy: the health probe (--health-cmd) failed 3 times in a row (last: timed out after 5s)"
        );
        let status = t.status_json(&t.snapshot(), Timestamp::now());
        assert_eq!(status["healthy"], false);
        assert_eq!(status["health"]["state"], "unhealthy", "{status}");
        assert_eq!(status["health"]["consecutive_failures"], 3);
        assert_eq!(
            status["health"]["last_failure"]["reason"],
            "timed out after 5s"
        );
        let metrics = t.render_metrics();
        for line in [
            "pgleader_health_ok{lock=\"nightly\"} 0",
            "pgleader_health_consecutive_failures{lock=\"nightly\"} 3",
            "pgleader_health_checks_total{result=\"passed\",lock=\"nightly\"} 1",
            "pgleader_health_checks_total{result=\"timed_out\",lock=\"nightly\"} 1",
            "pgleader_health_checks_total{result=\"failed\",lock=\"nightly\"} 0",
        ] {
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
        let plain = telemetry(false);
        let status = plain.status_json(&plain.snapshot(), Timestamp::now());
        assert!(status["health"].is_null(), "{status}");
    }

    #[test]
    fn the_status_shows_the_command_and_the_schedule_without_secrets() {
        let t = telemetry(true);
        t.leading(7, 10);
        t.command_started(42);
        t.command_exited(ChildStatus::Signaled(Signal::SIGTERM));
        let at = Timestamp::now();
        t.scheduled_run(RunView {
            scheduled_for: at,
            outcome: None,
            exit_code: None,
            attempt: Some(1),
            claimed_at: Some(at),
            ended_at: None,
            host: Some("web-1".into()),
        });
        t.scheduled_run(RunView {
            scheduled_for: at,
            outcome: Some(ScheduledOutcome::Failed),
            exit_code: Some(3),
            attempt: None,
            claimed_at: None,
            ended_at: Some(at),
            host: None,
        });
        let status = t.status_json(&t.snapshot(), Timestamp::now());
        assert_eq!(status["role"], "leader");
        assert_eq!(status["epoch"], 7);
        assert_eq!(status["lock"]["name"], "nightly");
        assert_eq!(status["connection"], "app@db:5432/app");
        assert_eq!(status["command"]["state"], "not_running");
        assert_eq!(status["command"]["last_exit"]["exit_code"], 143);
        assert_eq!(status["schedule"]["timezone"], "Europe/Paris");
        let runs = status["schedule"]["last_runs"].as_array().expect("runs");
        assert_eq!(runs.len(), 1, "{status}");
        assert_eq!(runs[0]["outcome"], "failed");
        assert_eq!(runs[0]["exit_code"], 3);
        assert_eq!(runs[0]["host"], "web-1", "the claim's host is kept");
        assert!(
            status["schedule"]["next_occurrence"].is_string(),
            "{status}"
        );
        let text = t.render_metrics();
        assert!(
            text.lines()
                .any(|line| line.starts_with("pgleader_scheduled_runs_total{")
                    && line.contains(r#"outcome="failed""#)
                    && line.ends_with("} 1")),
            "{text}"
        );
    }
}
