//! What pgleader publishes about itself for the HTTP endpoint (`--http`): a small state value
//! (role, epoch, since when, last check, the command, the schedule) and the Prometheus
//! counters. What the routes answer from it is `telemetry/answers.rs`.
//!
//! The supervisor calls one method per transition and never waits: the state goes out through a
//! `tokio::sync::watch` channel, whose latest value readers clone, and the counters are atomics.
//! Nothing a reader does (a slow client, a stuck scrape) can hold up a check, a stop or a
//! handoff: the only lock is the channel's, held for the time of a field update or a clone,
//! never across an `.await`.

mod answers;
mod jobs;

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::exit::ChildStatus;
use crate::operate::metrics::{CommandOutcome, HealthResult, LossReason, Metrics};
use crate::schedule::RunView;
use crate::schedule::calendar::Schedule;
pub use jobs::JobView;

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
    /// Under `pgleader cron`: the jobs this replica knows, by name.
    pub jobs: Vec<JobView>,
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
    /// `pgleader cron`.
    crontab: bool,
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
    /// Whether the replica runs a crontab (`pgleader cron`): `/leader` then answers 200 while
    /// it owns a job, `/status` lists the jobs, and the per-job metrics exist.
    pub crontab: bool,
}

impl Telemetry {
    pub fn new(settings: Settings) -> Telemetry {
        let host = host_name();
        let metrics = Metrics::new(
            &settings.lock,
            settings.schedule.is_some(),
            settings.shards,
            settings.health_check,
            settings.crontab,
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
            jobs: Vec::new(),
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
                    crontab: settings.crontab,
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
                    known.complete(run);
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

/// The command as `/status` shows it, for a single leader, a shard or a crontab job.
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

/// RFC 3339 in UTC, to the millisecond: `2026-11-21T07:58:38.088Z`.
pub fn rfc3339(time: Timestamp) -> String {
    crate::time::rfc3339_millis(time)
}

/// Seconds since the Unix epoch, as Prometheus timestamps are.
fn timestamp(time: Timestamp) -> f64 {
    time.as_microsecond() as f64 / 1e6
}
