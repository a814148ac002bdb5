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
//!
//! A crontab may hold a thousand jobs: a series of the `prometheus` crate's own families keeps
//! its name, help and label pairs for itself (about 9 KiB of RSS a job over the fifteen
//! series), so the jobs' figures are a small table of numbers instead, written out as series
//! only when `/metrics` is read (a collector of our own; the exposition is the same).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jiff::Timestamp;
use prometheus::Registry;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

use super::register;
use crate::schedule::ScheduledOutcome;

/// The per-job figures, shared with the registry's collector.
#[derive(Debug)]
pub struct JobMetrics {
    table: Arc<Table>,
}

/// Every known job's figures, by name.
#[derive(Debug, Default)]
struct Table {
    jobs: Mutex<BTreeMap<Box<str>, Figures>>,
}

/// One job's figures: what its fifteen series read.
#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    /// By outcome, in the order of `RECORDED`.
    runs: [u64; RECORDED.len()],
    pings_undelivered: u64,
    last_success: f64,
    lateness: f64,
    period: f64,
    known_since: f64,
    running: bool,
    owned: bool,
    definition_mismatch: bool,
    paused: bool,
}

/// A family of one series per job: its name, help, type and how a job's figures give its value.
struct Family {
    name: &'static str,
    help: &'static str,
    counter: bool,
    value: fn(&Figures) -> f64,
}

/// The runs by outcome: one series per job and outcome.
const RUNS: (&str, &str) = (
    "job_runs_total",
    "Occurrences of the crontab job this replica recorded, by outcome (succeeded, failed, interrupted, skipped, missed, paused)",
);

const FAMILIES: [Family; 9] = [
    Family {
        name: "job_pings_undelivered_total",
        help: "Pings of the job to its monitor (ping=) that this replica could not deliver: every attempt failed, or too many of the job's waited",
        counter: true,
        value: |figures| figures.pings_undelivered as f64,
    },
    Family {
        name: "job_paused",
        help: "1 while the job's occurrences are recorded as paused (pgleader cron pause), as the replica that owns it last found at an occurrence, else 0",
        counter: false,
        value: |figures| flag(figures.paused),
    },
    Family {
        name: "job_last_success_timestamp_seconds",
        help: "When the job's last run on this replica ended with exit code 0, in seconds since the Unix epoch; 0 before its first here",
        counter: false,
        value: |figures| figures.last_success,
    },
    Family {
        name: "job_lateness_seconds",
        help: "How late the job's last run on this replica started after its occurrence, in seconds on the database server's clock",
        counter: false,
        value: |figures| figures.lateness,
    },
    Family {
        name: "job_running",
        help: "1 while the job's command runs on this replica, else 0",
        counter: false,
        value: |figures| flag(figures.running),
    },
    Family {
        name: "job_owned",
        help: "1 while this replica owns the job (runs its occurrences), else 0; max by (job) over the fleet is 0 for a job nobody owns",
        counter: false,
        value: |figures| flag(figures.owned),
    },
    Family {
        name: "job_period_seconds",
        help: "The time between two occurrences of the job (its next one and the one after, as this replica knew it), in seconds",
        counter: false,
        value: |figures| figures.period,
    },
    Family {
        name: "job_known_since_timestamp_seconds",
        help: "Since when this replica knows the job (its crontab defines it), in seconds since the Unix epoch",
        counter: false,
        value: |figures| figures.known_since,
    },
    Family {
        name: "job_definition_mismatch",
        help: "1 while another replica's crontab defines the job otherwise than this replica's (a rolling deploy half done), else 0",
        counter: false,
        value: |figures| flag(figures.definition_mismatch),
    },
];

impl JobMetrics {
    pub fn new(registry: &Registry) -> JobMetrics {
        let table = Arc::new(Table::default());
        let descs = FAMILIES
            .iter()
            .map(|family| (family.name, family.help, vec!["job".to_owned()]))
            .chain([(RUNS.0, RUNS.1, vec!["job".to_owned(), "outcome".to_owned()])])
            .map(|(name, help, labels)| {
                Desc::new(name.to_owned(), help.to_owned(), labels, HashMap::new())
                    .expect("valid metric")
            })
            .collect();
        register(
            registry,
            Collect {
                table: Arc::clone(&table),
                descs,
            },
        );
        JobMetrics { table }
    }

    fn update(&self, job: &str, change: impl FnOnce(&mut Figures)) {
        if let Some(figures) = self.table.lock().get_mut(job) {
            change(figures);
        }
    }

    /// This replica knows `job` from now on: its series start, with its period.
    pub fn define(&self, job: &str, period: Option<Duration>) {
        let mut jobs = self.table.lock();
        let figures = jobs.entry(job.into()).or_default();
        figures.known_since = seconds(Timestamp::now());
        figures.period = period_seconds(period);
    }

    /// `job`'s period changed (a reread rescheduled it); a job whose series went meanwhile
    /// (removed, then defined again while this replica still ran it) gets them back.
    pub fn set_period(&self, job: &str, period: Option<Duration>) {
        let mut jobs = self.table.lock();
        let figures = jobs.entry(job.into()).or_insert_with(|| Figures {
            known_since: seconds(Timestamp::now()),
            ..Figures::default()
        });
        figures.period = period_seconds(period);
    }

    /// A reread removed `job`: its series go.
    pub fn forget(&self, job: &str) {
        self.table.lock().remove(job);
    }

    pub fn set_owned(&self, job: &str, owned: bool, running: bool) {
        self.update(job, |figures| {
            figures.owned = owned;
            figures.running = running;
        });
    }

    /// Whether another replica defines `job` otherwise than this one.
    pub fn set_defined_otherwise(&self, job: &str, otherwise: bool) {
        self.update(job, |figures| figures.definition_mismatch = otherwise);
    }

    /// An occurrence of `job` ended here with `outcome`, at `ended`.
    pub fn ran(&self, job: &str, outcome: ScheduledOutcome, ended: Timestamp) {
        self.update(job, |figures| {
            if let Some(at) = RECORDED.iter().position(|recorded| *recorded == outcome) {
                figures.runs[at] += 1;
            }
            figures.paused = outcome == ScheduledOutcome::Paused;
            if outcome == ScheduledOutcome::Succeeded {
                figures.last_success = seconds(ended);
            }
        });
    }

    /// A ping of `job`'s could not be delivered.
    pub fn ping_undelivered(&self, job: &str) {
        self.update(job, |figures| figures.pings_undelivered += 1);
    }

    /// An occurrence of `job` started `late` after its time.
    pub fn started(&self, job: &str, late: Duration) {
        self.update(job, |figures| {
            figures.paused = false;
            figures.lateness = late.as_secs_f64();
        });
    }
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Box<str>, Figures>> {
        // A panic while holding it leaves numbers, not a broken invariant: read on.
        self.jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The registry's side of the table: the series, written out when `/metrics` is read.
struct Collect {
    table: Arc<Table>,
    descs: Vec<Desc>,
}

impl Collector for Collect {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Copied out first, so that a scrape holds the lock for a copy, not for the formatting.
        let jobs: Vec<(Box<str>, Figures)> = self
            .table
            .lock()
            .iter()
            .map(|(job, figures)| (job.clone(), *figures))
            .collect();
        let mut families: Vec<MetricFamily> = FAMILIES
            .iter()
            .map(|family| {
                let series = jobs
                    .iter()
                    .map(|(job, figures)| {
                        series(&[("job", job)], family.counter, (family.value)(figures))
                    })
                    .collect();
                family_of(family.name, family.help, family.counter, series)
            })
            .collect();
        let runs = jobs
            .iter()
            .flat_map(|(job, figures)| {
                RECORDED
                    .iter()
                    .zip(figures.runs)
                    .map(move |(outcome, runs)| {
                        series(
                            &[("job", job), ("outcome", outcome.as_str())],
                            true,
                            runs as f64,
                        )
                    })
            })
            .collect();
        families.push(family_of(RUNS.0, RUNS.1, true, runs));
        families
    }
}

fn family_of(name: &str, help: &str, counter: bool, series: Vec<Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(name.to_owned());
    family.set_help(help.to_owned());
    family.set_field_type(if counter {
        MetricType::COUNTER
    } else {
        MetricType::GAUGE
    });
    family.set_metric(series);
    family
}

fn series(labels: &[(&str, &str)], counter: bool, value: f64) -> Metric {
    let mut metric = Metric::from_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name((*name).to_owned());
                pair.set_value((*value).to_owned());
                pair
            })
            .collect(),
    );
    if counter {
        let mut counter = Counter::default();
        counter.set_value(value);
        metric.set_counter(counter);
    } else {
        let mut gauge = Gauge::default();
        gauge.set_value(value);
        metric.set_gauge(gauge);
    }
    metric
}

fn flag(set: bool) -> f64 {
    f64::from(u8::from(set))
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

/// A period as its series reads it: 0 when the schedule has none.
fn period_seconds(period: Option<Duration>) -> f64 {
    period.map_or(0.0, |period| period.as_secs_f64())
}

fn seconds(time: Timestamp) -> f64 {
    time.as_microsecond() as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::lock::LockKey;
    use crate::operate::metrics::Metrics;

    /// The exposition of two jobs, one of them forgotten again and a third with a name to escape,
    /// with `known_since` (the clock at `define`) masked.
    fn exposition() -> String {
        let metrics = Metrics::new(&LockKey::from_name("fleet"), false, None, false, true);
        let jobs = metrics
            .jobs
            .as_ref()
            .expect("a crontab's metrics have jobs");
        jobs.define("b\"ackup", Some(Duration::from_secs(60)));
        jobs.define("gone", None);
        jobs.define("a", None);
        jobs.forget("gone");
        jobs.set_period("a", Some(Duration::from_millis(1500)));
        jobs.set_owned("b\"ackup", true, true);
        jobs.set_defined_otherwise("a", true);
        jobs.started("b\"ackup", Duration::from_millis(42));
        jobs.ran(
            "b\"ackup",
            ScheduledOutcome::Succeeded,
            Timestamp::from_millisecond(1_700_000_000_250).expect("a valid instant"),
        );
        jobs.ran("a", ScheduledOutcome::Paused, Timestamp::UNIX_EPOCH);
        jobs.ran("a", ScheduledOutcome::Paused, Timestamp::UNIX_EPOCH);
        jobs.ping_undelivered("a");
        metrics
            .render()
            .lines()
            .filter(|line| line.contains("job"))
            .map(
                |line| match line.split_once("known_since_timestamp_seconds{") {
                    Some((name, labels)) => {
                        let (labels, value) = labels.rsplit_once(' ').expect("a value");
                        let recent = value.parse::<f64>().expect("a number") > 1.7e9;
                        format!("{name}known_since_timestamp_seconds{{{labels} {recent}\n")
                    }
                    None => format!("{line}\n"),
                },
            )
            .collect()
    }

    #[test]
    fn the_per_job_series_read_as_they_always_have() {
        assert_eq!(exposition(), EXPOSITION);
    }

    const EXPOSITION: &str = r#"# HELP pgleader_job_definition_mismatch 1 while another replica's crontab defines the job otherwise than this replica's (a rolling deploy half done), else 0
# TYPE pgleader_job_definition_mismatch gauge
pgleader_job_definition_mismatch{job="a",lock="fleet"} 1
pgleader_job_definition_mismatch{job="b\"ackup",lock="fleet"} 0
# HELP pgleader_job_known_since_timestamp_seconds Since when this replica knows the job (its crontab defines it), in seconds since the Unix epoch
# TYPE pgleader_job_known_since_timestamp_seconds gauge
pgleader_job_known_since_timestamp_seconds{job="a",lock="fleet"} true
pgleader_job_known_since_timestamp_seconds{job="b\"ackup",lock="fleet"} true
# HELP pgleader_job_last_success_timestamp_seconds When the job's last run on this replica ended with exit code 0, in seconds since the Unix epoch; 0 before its first here
# TYPE pgleader_job_last_success_timestamp_seconds gauge
pgleader_job_last_success_timestamp_seconds{job="a",lock="fleet"} 0
pgleader_job_last_success_timestamp_seconds{job="b\"ackup",lock="fleet"} 1700000000.25
# HELP pgleader_job_lateness_seconds How late the job's last run on this replica started after its occurrence, in seconds on the database server's clock
# TYPE pgleader_job_lateness_seconds gauge
pgleader_job_lateness_seconds{job="a",lock="fleet"} 0
pgleader_job_lateness_seconds{job="b\"ackup",lock="fleet"} 0.042
# HELP pgleader_job_owned 1 while this replica owns the job (runs its occurrences), else 0; max by (job) over the fleet is 0 for a job nobody owns
# TYPE pgleader_job_owned gauge
pgleader_job_owned{job="a",lock="fleet"} 0
pgleader_job_owned{job="b\"ackup",lock="fleet"} 1
# HELP pgleader_job_paused 1 while the job's occurrences are recorded as paused (pgleader cron pause), as the replica that owns it last found at an occurrence, else 0
# TYPE pgleader_job_paused gauge
pgleader_job_paused{job="a",lock="fleet"} 1
pgleader_job_paused{job="b\"ackup",lock="fleet"} 0
# HELP pgleader_job_period_seconds The time between two occurrences of the job (its next one and the one after, as this replica knew it), in seconds
# TYPE pgleader_job_period_seconds gauge
pgleader_job_period_seconds{job="a",lock="fleet"} 1.5
pgleader_job_period_seconds{job="b\"ackup",lock="fleet"} 60
# HELP pgleader_job_pings_undelivered_total Pings of the job to its monitor (ping=) that this replica could not deliver: every attempt failed, or too many of the job's waited
# TYPE pgleader_job_pings_undelivered_total counter
pgleader_job_pings_undelivered_total{job="a",lock="fleet"} 1
pgleader_job_pings_undelivered_total{job="b\"ackup",lock="fleet"} 0
# HELP pgleader_job_running 1 while the job's command runs on this replica, else 0
# TYPE pgleader_job_running gauge
pgleader_job_running{job="a",lock="fleet"} 0
pgleader_job_running{job="b\"ackup",lock="fleet"} 1
# HELP pgleader_job_runs_total Occurrences of the crontab job this replica recorded, by outcome (succeeded, failed, interrupted, skipped, missed, paused)
# TYPE pgleader_job_runs_total counter
pgleader_job_runs_total{job="a",outcome="failed",lock="fleet"} 0
pgleader_job_runs_total{job="a",outcome="interrupted",lock="fleet"} 0
pgleader_job_runs_total{job="a",outcome="missed",lock="fleet"} 0
pgleader_job_runs_total{job="a",outcome="paused",lock="fleet"} 2
pgleader_job_runs_total{job="a",outcome="skipped",lock="fleet"} 0
pgleader_job_runs_total{job="a",outcome="succeeded",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="failed",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="interrupted",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="missed",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="paused",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="skipped",lock="fleet"} 0
pgleader_job_runs_total{job="b\"ackup",outcome="succeeded",lock="fleet"} 1
"#;
}
