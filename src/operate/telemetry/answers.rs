//! What the HTTP routes answer from the published state: whether this instance leads
//! (`/leader`), whether it is healthy (`/healthz`), and the body of `/status`. `http.rs` serves
//! the routes and `metrics.rs` renders `/metrics`; this file holds the verdicts and the document,
//! plain functions of a snapshot that the tests below drive through the supervisor's hooks, with
//! no socket. It sits under `telemetry.rs` because it reads what does not change while pgleader
//! runs (the lock, the connection, the check deadline, the schedule, the shard count), which
//! the handle keeps to itself.

use std::time::Duration;

use jiff::Timestamp;
use serde_json::{Value, json};

use super::jobs::job_json;
use super::{
    CommandState, HealthState, HealthView, Role, Snapshot, Telemetry, command_json, rfc3339,
};
use crate::schedule::calendar::{self, Schedule};
use crate::schedule::{RunView, ScheduledOutcome};

impl Telemetry {
    /// Whether this instance leads, for `/leader`: it holds the lock and its command runs (or,
    /// with a schedule, holds the lock between runs too). `Err` says what it does instead.
    pub fn leads(&self, snapshot: &Snapshot) -> Result<(), String> {
        if self.inner.identity.crontab {
            // A crontab's replica leads while it owns a job, between runs too (as a schedule).
            return match snapshot.role {
                Role::Leader => Ok(()),
                Role::Follower => Err("follower: owns no job".to_owned()),
                role => Err(role.as_str().to_owned()),
            };
        }
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
            "jobs": identity.crontab.then(|| snapshot.jobs.iter().map(|job| job_json(job, now)).collect::<Vec<_>>()),
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;

    use crate::election::lock::LockKey;
    use crate::exit::ChildStatus;
    use crate::operate::metrics::{HealthResult, LossReason};
    use crate::operate::telemetry::{CommandView, Settings, ShardView};

    fn telemetry(scheduled: bool) -> Telemetry {
        Telemetry::new(Settings {
            lock: LockKey::from_name("nightly"),
            connection: "app@db:5432/app".into(),
            check_deadline: Duration::from_secs(3),
            schedule: scheduled
                .then(|| Schedule::parse("0 3 * * *", "Europe/Paris").expect("a schedule")),
            shards: None,
            health_check: false,
            crontab: false,
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
            crontab: false,
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
            crontab: false,
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
            delay: Duration::ZERO,
        });
        t.scheduled_run(RunView {
            scheduled_for: at,
            outcome: Some(ScheduledOutcome::Failed),
            exit_code: Some(3),
            attempt: None,
            claimed_at: None,
            ended_at: Some(at),
            host: None,
            delay: Duration::ZERO,
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
