//! The figures of a crontab's jobs (`pgleader cron`), one series per job by its `job` label, so
//! that an alert can name the job that stopped succeeding or that nobody owns.
//!
//! Each replica reports every job its file defines, owned or not: `owned` is 0 on every replica
//! for a job nobody owns, so `max by (job)` over the fleet tells it; the runs, the last success
//! and the lateness are counted by the replica that ran the occurrence, so `sum by (job)` and
//! `max by (job)` over the fleet give the job's. A job's series exist from the moment the
//! replica knows it (the counters at 0, so that `increase()` sees the first run) and go when a
//! reread removes it. Apart from `metrics.rs` because these series come and go with the file,
//! where the others are fixed at start.

use std::time::Duration;

use jiff::Timestamp;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::register;
use crate::schedule::ScheduledOutcome;

/// The per-job families.
#[derive(Debug)]
pub struct JobMetrics {
    runs: IntCounterVec,
    last_success: GaugeVec,
    lateness: GaugeVec,
    running: IntGaugeVec,
    owned: IntGaugeVec,
    period: GaugeVec,
    known_since: GaugeVec,
    definition_mismatch: IntGaugeVec,
    pings_undelivered: IntCounterVec,
    paused: IntGaugeVec,
}

impl JobMetrics {
    pub fn new(registry: &Registry) -> JobMetrics {
        let gauge = |name: &str, help: &str| {
            let gauges = GaugeVec::new(Opts::new(name, help), &["job"]).expect("valid metric");
            register(registry, gauges.clone());
            gauges
        };
        let int_gauge = |name: &str, help: &str| {
            let gauges = IntGaugeVec::new(Opts::new(name, help), &["job"]).expect("valid metric");
            register(registry, gauges.clone());
            gauges
        };
        let runs = IntCounterVec::new(
            Opts::new(
                "job_runs_total",
                "Occurrences of the crontab job this replica recorded, by outcome (succeeded, failed, interrupted, skipped, missed, paused)",
            ),
            &["job", "outcome"],
        )
        .expect("valid metric");
        register(registry, runs.clone());
        let pings_undelivered = IntCounterVec::new(
            Opts::new(
                "job_pings_undelivered_total",
                "Pings of the job to its monitor (ping=) that this replica could not deliver: every attempt failed, or too many of the job's waited",
            ),
            &["job"],
        )
        .expect("valid metric");
        register(registry, pings_undelivered.clone());
        JobMetrics {
            pings_undelivered,
            paused: int_gauge(
                "job_paused",
                "1 while the job's occurrences are recorded as paused (pgleader cron pause), as the replica that owns it last found at an occurrence, else 0",
            ),
            runs,
            last_success: gauge(
                "job_last_success_timestamp_seconds",
                "When the job's last run on this replica ended with exit code 0, in seconds since the Unix epoch; 0 before its first here",
            ),
            lateness: gauge(
                "job_lateness_seconds",
                "How late the job's last run on this replica started after its occurrence, in seconds on the database server's clock",
            ),
            running: int_gauge(
                "job_running",
                "1 while the job's command runs on this replica, else 0",
            ),
            owned: int_gauge(
                "job_owned",
                "1 while this replica owns the job (runs its occurrences), else 0; max by (job) over the fleet is 0 for a job nobody owns",
            ),
            period: gauge(
                "job_period_seconds",
                "The time between two occurrences of the job (its next one and the one after, as this replica knew it), in seconds",
            ),
            known_since: gauge(
                "job_known_since_timestamp_seconds",
                "Since when this replica knows the job (its crontab defines it), in seconds since the Unix epoch",
            ),
            definition_mismatch: int_gauge(
                "job_definition_mismatch",
                "1 while another replica's crontab defines the job otherwise than this replica's (a rolling deploy half done), else 0",
            ),
        }
    }

    /// This replica knows `job` from now on: its series start, with its period.
    pub fn define(&self, job: &str, period: Option<Duration>) {
        for outcome in RECORDED {
            self.runs.with_label_values(&[job, outcome.as_str()]);
        }
        self.last_success.with_label_values(&[job]);
        self.lateness.with_label_values(&[job]);
        self.running.with_label_values(&[job]);
        self.owned.with_label_values(&[job]);
        self.definition_mismatch.with_label_values(&[job]);
        self.pings_undelivered.with_label_values(&[job]);
        self.paused.with_label_values(&[job]);
        self.set_period(job, period);
        self.known_since
            .with_label_values(&[job])
            .set(seconds(Timestamp::now()));
    }

    pub fn set_period(&self, job: &str, period: Option<Duration>) {
        self.period
            .with_label_values(&[job])
            .set(period.map_or(0.0, |period| period.as_secs_f64()));
    }

    /// A reread removed `job`: its series go.
    pub fn forget(&self, job: &str) {
        for outcome in RECORDED {
            let _ = self.runs.remove_label_values(&[job, outcome.as_str()]);
        }
        let _ = self.pings_undelivered.remove_label_values(&[job]);
        for gauges in [
            &self.last_success,
            &self.lateness,
            &self.period,
            &self.known_since,
        ] {
            let _ = gauges.remove_label_values(&[job]);
        }
        for gauges in [
            &self.running,
            &self.owned,
            &self.definition_mismatch,
            &self.paused,
        ] {
            let _ = gauges.remove_label_values(&[job]);
        }
    }

    pub fn set_owned(&self, job: &str, owned: bool, running: bool) {
        self.owned.with_label_values(&[job]).set(i64::from(owned));
        self.running
            .with_label_values(&[job])
            .set(i64::from(running));
    }

    /// Whether another replica defines `job` otherwise than this one.
    pub fn set_defined_otherwise(&self, job: &str, otherwise: bool) {
        self.definition_mismatch
            .with_label_values(&[job])
            .set(i64::from(otherwise));
    }

    /// An occurrence of `job` ended here with `outcome`, at `ended`.
    pub fn ran(&self, job: &str, outcome: ScheduledOutcome, ended: Timestamp) {
        self.runs.with_label_values(&[job, outcome.as_str()]).inc();
        self.paused
            .with_label_values(&[job])
            .set(i64::from(outcome == ScheduledOutcome::Paused));
        if outcome == ScheduledOutcome::Succeeded {
            self.last_success
                .with_label_values(&[job])
                .set(seconds(ended));
        }
    }

    /// A ping of `job`'s could not be delivered.
    pub fn ping_undelivered(&self, job: &str) {
        self.pings_undelivered.with_label_values(&[job]).inc();
    }

    /// An occurrence of `job` started `late` after its time.
    pub fn started(&self, job: &str, late: Duration) {
        self.paused.with_label_values(&[job]).set(0);
        self.lateness
            .with_label_values(&[job])
            .set(late.as_secs_f64());
    }
}

/// The outcomes a crontab job's run can have (`busy` is a timer's, `--once`).
const RECORDED: [ScheduledOutcome; 6] = [
    ScheduledOutcome::Succeeded,
    ScheduledOutcome::Failed,
    ScheduledOutcome::Interrupted,
    ScheduledOutcome::Skipped,
    ScheduledOutcome::Missed,
    ScheduledOutcome::Paused,
];

fn seconds(time: Timestamp) -> f64 {
    time.as_microsecond() as f64 / 1e6
}
