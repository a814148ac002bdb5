//! The Prometheus metrics of `/metrics`, in the classic text exposition format (version 0.0.4),
//! which every Prometheus server, `promtool check metrics` and a person with curl can read.
//!
//! The `prometheus` crate keeps the values (atomics: the supervisor updates them without a
//! lock) and writes the format, escaping included. Every series carries the `lock` label, so
//! that the metrics of several locks, or of every replica of one, can be summed per lock: the
//! lock's name with `--lock`, its key with `--lock-id`. Labels with a value per event (reasons,
//! outcomes) take their values from small fixed sets, all present from the start at 0, so that
//! `rate()` and `increase()` see the first event.

mod jobs;

use std::collections::HashMap;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder, core::Collector,
};

use crate::election::lock::LockKey;
use crate::exit::ChildStatus;
use crate::schedule::ScheduledOutcome;
pub use jobs::JobMetrics;

/// The content type of the classic text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Check durations: a check is one round trip to the server, normally a millisecond or two;
/// --check-timeout (2 s by default) bounds it.
const CHECK_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Why a leadership ended: the `reason` label of `pgleader_leadership_lost_total`, a small
/// fixed set so that the metric's series stay few.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReason {
    /// The session's connection ended (terminated, server restart, network reset).
    ConnectionEnded,
    /// A check returned an error.
    CheckFailed,
    /// No successful check for --check-interval + --check-timeout.
    CheckTimeout,
    /// A check found that the session no longer holds the lock.
    NotHeld,
    /// The command exited on its own (or could not start).
    CommandExited,
    /// A planned handoff (--relinquish-after, --relinquish-schedule), or the lock given up
    /// because the replicas disagree on the schedule or a timer had nothing to run.
    Relinquished,
    /// `pgleader step-down` asked this leader to hand over.
    SteppedDown,
    /// A statement on the schedule's ledger failed.
    LedgerFailed,
    /// TERM or INT.
    Shutdown,
    /// The health probe (`--health-cmd`) failed `--health-retries` times in a row.
    Unhealthy,
    /// `--pre-start` failed or timed out: the command never started.
    PreStartFailed,
}

impl LossReason {
    pub const ALL: [LossReason; 11] = [
        LossReason::ConnectionEnded,
        LossReason::CheckFailed,
        LossReason::CheckTimeout,
        LossReason::NotHeld,
        LossReason::CommandExited,
        LossReason::Relinquished,
        LossReason::SteppedDown,
        LossReason::LedgerFailed,
        LossReason::Shutdown,
        LossReason::Unhealthy,
        LossReason::PreStartFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::ConnectionEnded => "connection_ended",
            LossReason::CheckFailed => "check_failed",
            LossReason::CheckTimeout => "check_timeout",
            LossReason::NotHeld => "not_held",
            LossReason::CommandExited => "command_exited",
            LossReason::Relinquished => "relinquished",
            LossReason::SteppedDown => "stepped_down",
            LossReason::LedgerFailed => "ledger_failed",
            LossReason::Shutdown => "shutdown",
            LossReason::Unhealthy => "unhealthy",
            LossReason::PreStartFailed => "pre_start_failed",
        }
    }
}

/// How the command ended: the `outcome` label of `pgleader_command_exits_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandOutcome {
    /// Exit code 0.
    Succeeded,
    /// Another exit code.
    Failed,
    /// Killed by a signal (also when pgleader stopped it and it died of the signal).
    Signaled,
}

impl CommandOutcome {
    pub const ALL: [CommandOutcome; 3] = [
        CommandOutcome::Succeeded,
        CommandOutcome::Failed,
        CommandOutcome::Signaled,
    ];

    pub fn of(status: ChildStatus) -> CommandOutcome {
        match status {
            ChildStatus::Exited(0) => CommandOutcome::Succeeded,
            ChildStatus::Exited(_) => CommandOutcome::Failed,
            ChildStatus::Signaled(_) => CommandOutcome::Signaled,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CommandOutcome::Succeeded => "succeeded",
            CommandOutcome::Failed => "failed",
            CommandOutcome::Signaled => "signaled",
        }
    }
}

/// How one health probe ended: the `result` label of `pgleader_health_checks_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthResult {
    /// Exit code 0.
    Passed,
    /// Another exit code, death by a signal, or a probe that could not start.
    Failed,
    /// Killed at --health-timeout.
    TimedOut,
}

impl HealthResult {
    pub const ALL: [HealthResult; 3] = [
        HealthResult::Passed,
        HealthResult::Failed,
        HealthResult::TimedOut,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HealthResult::Passed => "passed",
            HealthResult::Failed => "failed",
            HealthResult::TimedOut => "timed_out",
        }
    }
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub is_leader: IntGauge,
    pub epoch: IntGauge,
    pub acquired: IntCounter,
    pub lost: IntCounterVec,
    /// Seconds since the Unix epoch (a float gauge: the crate's `Gauge` is f64).
    pub last_check: prometheus::Gauge,
    pub check_duration: Histogram,
    pub command_running: IntGauge,
    pub command_exits: IntCounterVec,
    pub connection_failures: IntCounter,
    pub scheduled_runs: Option<IntCounterVec>,
    /// With `--shards K`: the per-shard families.
    pub shards: Option<ShardMetrics>,
    /// With `--health-cmd`: the probe's families.
    pub health: Option<HealthMetrics>,
    /// Under `pgleader cron`: the per-job families.
    pub jobs: Option<JobMetrics>,
}

/// The health probe's figures (`--health-cmd`): whether this replica counts as healthy (and
/// may queue and lead), its probes by result, and its failures in a row.
#[derive(Debug)]
pub struct HealthMetrics {
    pub ok: IntGauge,
    pub checks: IntCounterVec,
    pub consecutive_failures: IntGauge,
}

/// The figures of a sharded lock (`--shards K`): per replica, how many shards it holds; per
/// shard (the `shard` label, `0` to `K-1`, every value present from the start), whether this
/// replica holds it, its fencing token here, whether its command runs here and how often this
/// replica took it. Summed over the replicas, `pgleader_shard_held` is 1 for every shard.
#[derive(Debug)]
pub struct ShardMetrics {
    pub held_count: IntGauge,
    pub held: IntGaugeVec,
    pub epoch: IntGaugeVec,
    pub running: IntGaugeVec,
    pub acquired: IntCounterVec,
}

impl Metrics {
    /// The metric families for `lock`; the scheduled-run counter only when a schedule is set,
    /// the health families only with a health probe, the per-job ones only for a crontab.
    pub fn new(
        lock: &LockKey,
        scheduled: bool,
        shards: Option<u32>,
        health: bool,
        crontab: bool,
    ) -> Metrics {
        let lock_label = lock
            .name()
            .map_or_else(|| lock.key().to_string(), str::to_owned);
        let labels = HashMap::from([("lock".to_owned(), lock_label)]);
        let registry = Registry::new_custom(Some("pgleader".to_owned()), Some(labels))
            .expect("the prefix and the lock label are valid");

        let info = IntGaugeVec::new(
            Opts::new(
                "info",
                "Always 1; its labels say which pgleader version runs and for which lock key and name",
            ),
            &["version", "lock_key", "lock_name"],
        )
        .expect("valid metric");
        info.with_label_values(&[
            env!("CARGO_PKG_VERSION"),
            &lock.key().to_string(),
            lock.name().unwrap_or(""),
        ])
        .set(1);
        register(&registry, info);

        let is_leader = gauge(
            &registry,
            "is_leader",
            "1 while this instance holds the lock as leader, else 0",
        );
        let epoch = gauge(
            &registry,
            "epoch",
            "The fencing token (PGLEADER_EPOCH) of this instance's current or last leadership; 0 before its first",
        );
        let acquired = counter(
            &registry,
            "leadership_acquired_total",
            "Leaderships this instance won (the lock granted and a fencing token taken)",
        );
        let lost = counter_vec(
            &registry,
            "leadership_lost_total",
            "Leaderships of this instance that ended, by reason",
            "reason",
            LossReason::ALL.map(LossReason::as_str),
        );
        let last_check = prometheus::Gauge::new(
            "last_check_success_timestamp_seconds",
            "When this instance last proved, as leader, that its session holds the lock (winning it or a check), in seconds since the Unix epoch; 0 before",
        )
        .expect("valid metric");
        register(&registry, last_check.clone());
        let check_duration = Histogram::with_opts(
            HistogramOpts::new(
                "check_duration_seconds",
                "How long the leader's ownership checks took, failed ones included",
            )
            .buckets(CHECK_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        register(&registry, check_duration.clone());
        let command_running = gauge(
            &registry,
            "command_running",
            "1 while the command runs on this instance, else 0; with --shards, how many shards' commands run here",
        );
        let command_exits = counter_vec(
            &registry,
            "command_exits_total",
            "Runs of the command that ended, by outcome: succeeded (exit 0), failed (another exit code), signaled (killed by a signal)",
            "outcome",
            CommandOutcome::ALL.map(CommandOutcome::as_str),
        );
        let connection_failures = counter(
            &registry,
            "connection_failures_total",
            "Connection attempts to PostgreSQL that failed (each is retried with backoff)",
        );
        let scheduled_runs = scheduled.then(|| {
            counter_vec(
                &registry,
                "scheduled_runs_total",
                "Occurrences of the schedule, by outcome",
                "outcome",
                ScheduledOutcome::OF_SCHEDULE.map(ScheduledOutcome::as_str),
            )
        });
        let shards = shards.map(|count| ShardMetrics::new(&registry, count));
        let health = health.then(|| HealthMetrics {
            ok: gauge(
                &registry,
                "health_ok",
                "1 while the health probe (--health-cmd) counts this replica healthy, so that it may queue and lead; 0 before its first pass and once it failed --health-retries times in a row",
            ),
            checks: counter_vec(
                &registry,
                "health_checks_total",
                "Health probes that ended, by result: passed (exit 0), failed (another exit code, a signal, or it could not start), timed_out (killed at --health-timeout)",
                "result",
                HealthResult::ALL.map(HealthResult::as_str),
            ),
            consecutive_failures: gauge(
                &registry,
                "health_consecutive_failures",
                "The health probe's failures in a row; 0 after a pass",
            ),
        });
        let jobs = crontab.then(|| JobMetrics::new(&registry));
        Metrics {
            registry,
            is_leader,
            epoch,
            acquired,
            lost,
            last_check,
            check_duration,
            command_running,
            command_exits,
            connection_failures,
            scheduled_runs,
            shards,
            health,
            jobs,
        }
    }

    /// The exposition, sorted by metric name.
    pub fn render(&self) -> String {
        let mut out = Vec::with_capacity(4096);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("writing to memory does not fail");
        String::from_utf8(out).expect("the exposition is UTF-8")
    }
}

impl ShardMetrics {
    fn new(registry: &Registry, count: u32) -> ShardMetrics {
        gauge(
            registry,
            "shards",
            "The lock's shard count (--shards): how many numbered instances of the command the replicas run between them",
        )
        .set(i64::from(count));
        let labels: Vec<String> = (0..count).map(|shard| shard.to_string()).collect();
        let per_shard_gauge = |name: &str, help: &str| {
            let gauges = IntGaugeVec::new(Opts::new(name, help), &["shard"]).expect("valid metric");
            for label in &labels {
                gauges.with_label_values(&[label]);
            }
            register(registry, gauges.clone());
            gauges
        };
        let held = per_shard_gauge("shard_held", "1 while this replica holds the shard, else 0");
        let epoch = per_shard_gauge(
            "shard_epoch",
            "The fencing token (PGLEADER_EPOCH) of this replica's current or last hold of the shard; 0 before its first",
        );
        let running = per_shard_gauge(
            "shard_command_running",
            "1 while the shard's command runs on this replica, else 0",
        );
        let acquired = IntCounterVec::new(
            Opts::new(
                "shard_acquired_total",
                "How often this replica took the shard (the lock granted and a fencing token taken)",
            ),
            &["shard"],
        )
        .expect("valid metric");
        for label in &labels {
            acquired.with_label_values(&[label]);
        }
        register(registry, acquired.clone());
        ShardMetrics {
            held_count: gauge(
                registry,
                "shards_held",
                "How many shards this replica holds",
            ),
            held,
            epoch,
            running,
            acquired,
        }
    }
}

fn register(registry: &Registry, metric: impl Collector + 'static) {
    registry
        .register(Box::new(metric))
        .expect("each metric is registered once");
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let gauge = IntGauge::new(name, help).expect("valid metric");
    register(registry, gauge.clone());
    gauge
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let counter = IntCounter::new(name, help).expect("valid metric");
    register(registry, counter.clone());
    counter
}

/// A counter with one label, every value of which exists from the start.
fn counter_vec<const N: usize>(
    registry: &Registry,
    name: &str,
    help: &str,
    label: &str,
    values: [&str; N],
) -> IntCounterVec {
    let counters = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric");
    for value in values {
        counters.with_label_values(&[value]);
    }
    register(registry, counters.clone());
    counters
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_carries_the_lock_and_the_counters_start_at_zero() {
        let metrics = Metrics::new(
            &LockKey::from_name("nightly \"report\""),
            false,
            None,
            false,
            false,
        );
        metrics.is_leader.set(1);
        let text = metrics.render();
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            assert!(line.contains(r#"lock="nightly \"report\"""#), "{line}");
        }
        assert!(text.contains("pgleader_is_leader{"), "{text}");
        assert!(
            text.lines()
                .any(|line| line.starts_with("pgleader_leadership_lost_total{")
                    && line.contains(r#"reason="check_timeout""#)
                    && line.ends_with("} 0")),
            "{text}"
        );
        assert!(
            text.contains("lock_key=\"") && text.contains("version=\""),
            "{text}"
        );
        assert!(!text.contains("scheduled_runs"), "{text}");
        assert!(!text.contains("pgleader_health_"), "{text}");
    }

    #[test]
    fn the_scheduled_runs_exist_only_with_a_schedule() {
        let metrics = Metrics::new(&LockKey::from_id(-5), true, None, false, false);
        let text = metrics.render();
        assert!(
            text.contains(r#"pgleader_scheduled_runs_total{outcome="missed",lock="-5"} 0"#),
            "{text}"
        );
    }
}
