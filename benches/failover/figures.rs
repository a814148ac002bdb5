//! What the scenarios measure, below both the scenarios that fill it in and the report that
//! renders it: a scenario's figures per run and their summary (p50, p95, max), an idle
//! candidate's cost, a failover at scale, a sharded fleet, a schedule's runs per occurrence, and
//! how a duration reads in a cell.

use std::time::Duration;

/// What one scenario measured for one tool.
#[derive(Debug)]
pub struct Row {
    /// A stable key the targets refer to, such as `kill9.next`.
    pub id: String,
    pub scenario: String,
    pub tool: &'static str,
    pub measure: &'static str,
    pub figures: Figures,
    /// Of the runs where it was looked at: how many times the old leader's child was gone soon
    /// after the fault, and in how many runs this was checked.
    pub old_child_stopped: Option<(usize, usize)>,
    pub note: String,
}

/// One sample (milliseconds; a gap may be negative) per run in which the event happened;
/// `never` counts the runs in which it did not happen within `waited` (what a peer cannot do
/// shows up so, measured rather than assumed); `failures` the runs that went wrong in the
/// benchmark itself.
#[derive(Debug, Default)]
pub struct Figures {
    samples: Vec<f64>,
    never: usize,
    waited: Duration,
    failures: Vec<String>,
}

impl Figures {
    pub fn sample(&mut self, value: Duration) {
        self.sample_ms(value.as_secs_f64() * 1000.0);
    }

    pub fn sample_ms(&mut self, value: f64) {
        self.samples.push(value);
    }

    pub fn never(&mut self, bound: Duration) {
        self.never += 1;
        self.waited = self.waited.max(bound);
    }

    pub fn failure(&mut self, why: String) {
        self.failures.push(why);
    }

    /// Whether every run that completed saw the event never happen.
    pub fn only_never(&self) -> bool {
        self.samples.is_empty() && self.never > 0
    }

    /// Whether the scenario produced a result: figures, or an observed "never". Runs that all
    /// failed produce none.
    pub fn produced(&self) -> bool {
        !self.samples.is_empty() || (self.never > 0 && self.failures.is_empty())
    }

    pub fn median(&self) -> Option<f64> {
        Summary::of(&self.samples).map(|s| s.p50)
    }

    /// The `q` quantile (0 to 1) by nearest rank, for rows whose runs are many samples (a
    /// crontab's lateness, where p99 is asked for).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        Summary::quantile(&self.samples, q)
    }

    /// The cells runs, p50, p95, max, and a note on runs without figures.
    pub fn cells(&self) -> ([String; 4], String) {
        let runs = self.samples.len() + self.never + self.failures.len();
        let mut notes = Vec::new();
        if self.never > 0 {
            notes.push(format!(
                "{} of {runs} runs: never (waited {})",
                self.never,
                secs(self.waited)
            ));
        }
        if let Some(first) = self.failures.first() {
            notes.push(format!(
                "{} of {runs} runs failed, first: {first}",
                self.failures.len()
            ));
        }
        let cells = match Summary::of(&self.samples) {
            Some(s) => [runs.to_string(), ms(s.p50), ms(s.p95), ms(s.max)],
            None if self.never > 0 => [
                runs.to_string(),
                "n/a: never".into(),
                "–".into(),
                "–".into(),
            ],
            None => [runs.to_string(), "–".into(), "–".into(), "–".into()],
        };
        (cells, notes.join("; "))
    }
}

/// p50, p95 and max by the nearest-rank method: with 20 runs, p95 is the 19th value.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Option<Summary> {
        if samples.is_empty() {
            return None;
        }
        Some(Summary {
            p50: Summary::quantile(samples, 0.50)?,
            p95: Summary::quantile(samples, 0.95)?,
            max: Summary::quantile(samples, 1.0)?,
        })
    }

    /// The `q` quantile of `samples` by nearest rank.
    pub fn quantile(samples: &[f64], q: f64) -> Option<f64> {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
        sorted.get(rank.min(sorted.len()) - 1).copied()
    }
}

/// What an idle candidate costs, measured over a window.
#[derive(Debug)]
pub struct Cost {
    pub tool: &'static str,
    pub role: &'static str,
    pub window: Duration,
    pub rss_kib: Option<u64>,
    /// pgleader's keeper (a leader's runs the command, a follower's waits parked); `None`
    /// where there is none.
    pub keeper_rss_kib: Option<u64>,
    pub cpu: Duration,
    pub keeper_cpu: Option<Duration>,
    /// Statements or requests per second the server received from this candidate.
    pub requests_per_second: Option<f64>,
    pub requests_how: &'static str,
}

/// Failover with many candidates on one server, and the server's CPU while they wait.
#[derive(Debug)]
pub struct Scale {
    pub tool: &'static str,
    pub candidates: usize,
    pub failover: Figures,
    pub old_child_stopped: (usize, usize),
    /// The server's CPU time over the window, as a share of one core.
    pub server_cpu: Option<f64>,
    pub window: Duration,
}

/// One way of running K shards on R replicas, at rest (scenario 13).
#[derive(Debug, Default)]
pub struct Fleet {
    pub how: String,
    pub replicas: usize,
    pub shards: u32,
    pub pgleader_processes: usize,
    pub keepers: usize,
    /// Sessions on the server.
    pub connections: usize,
    pub pgleader_rss_kib: u64,
    pub keeper_rss_kib: u64,
    /// How many shards each replica runs.
    pub per_replica: Vec<usize>,
}

/// One host's crontab of 100 jobs, one way (scenario 14): what it costs over a window.
#[derive(Debug)]
pub struct CrontabCost {
    /// How the jobs run: `pgleader cron`, plain `pgleader run --schedule` processes, yacron.
    pub how: String,
    /// What the jobs do during the window: `idle` (no occurrence in it) or `every second`.
    pub load: &'static str,
    pub window: Duration,
    pub processes: usize,
    pub keepers: usize,
    /// Server sessions (`None` for a tool with no server).
    pub connections: Option<usize>,
    /// VmRSS of the tool's processes and keepers at the end of the window (a job's own
    /// command not counted).
    pub rss_kib: u64,
    /// What the server received from those sessions per second: statements on PostgreSQL,
    /// commands on Redis.
    pub requests_per_second: Option<f64>,
}

/// How many (job, occurrence) pairs one fleet of scenario 14 ran more than once.
#[derive(Debug)]
pub struct CrontabFleet {
    /// The label of the fleet's rows.
    pub label: &'static str,
    /// PostgreSQL or Redis.
    pub backend: &'static str,
    /// Distinct (job, occurrence) pairs that ran, over the whole fleet's life (kills included).
    pub runs: usize,
    /// Of those, how many ran more than once.
    pub twice: usize,
}

/// Scenario 14's figures that are not rows: the crontab's costs and, per backend, how many
/// (job, occurrence) pairs ran more than once.
#[derive(Debug, Default)]
pub struct Crontab {
    pub fleets: Vec<CrontabFleet>,
    pub costs: Vec<CrontabCost>,
}

/// The cost rows of scenario 12 start so.
pub const SHARDED_ROLE: &str = "sharded replica";

/// The cost row of scenario 8's idle scheduled leader.
pub const SCHEDULED_ROLE: &str = "scheduled leader, idle";

/// How many times a job ran per occurrence in one mode.
#[derive(Debug)]
pub struct TimerCount {
    pub mode: &'static str,
    pub occurrences: usize,
    pub once: usize,
    pub extra_runs: usize,
    pub missed: usize,
}

/// Milliseconds, or seconds from one second on.
pub fn ms(value: f64) -> String {
    if value.abs() >= 1000.0 {
        format!("{:.2} s", value / 1000.0)
    } else {
        format!("{value:.1} ms")
    }
}

/// Whole seconds, or minutes and seconds from one minute on.
pub fn secs(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs >= 60.0 {
        format!("{}m {:.0}s", (secs / 60.0).floor(), secs % 60.0)
    } else {
        format!("{secs:.0} s")
    }
}
