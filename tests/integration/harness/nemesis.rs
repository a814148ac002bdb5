//! What every nemesis shares: the machine's monotonic clock, the runs of the command as the test
//! saw them (each start from the command's own line, each death from a pidfd), the check that no
//! two ran at once and that fencing tokens grow, and the [`Watch`] a nemesis keeps while its
//! experiment goes on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Proc, Stream, WAIT, wait_gone};

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process of the machine.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill in.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// A number from the environment (PGLEADER_NEMESIS_SEED, PGLEADER_NEMESIS_ROUNDS), if set.
pub fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
}

/// The seed (PGLEADER_NEMESIS_SEED replays one) and the number of rounds
/// (PGLEADER_NEMESIS_ROUNDS, else `default_rounds`).
pub fn seed_and_rounds(default_rounds: usize) -> (u64, usize) {
    (
        env_number("PGLEADER_NEMESIS_SEED").unwrap_or_else(|| fastrand::u64(..)),
        env_number("PGLEADER_NEMESIS_ROUNDS").unwrap_or(default_rounds),
    )
}

/// One run of the command, as the test saw it.
#[derive(Debug, Clone)]
pub struct Run {
    pub slot: usize,
    pub pid: i32,
    /// The leader session's client id (`CLIENT KILL ID` takes it).
    pub backend: String,
    pub epoch: i64,
    pub started: u64,
    pub died: Option<u64>,
}

/// Every command run seen so far, by pid; deaths are filled in by watcher threads.
pub type Runs = Arc<Mutex<BTreeMap<i32, Run>>>;

/// Records the runs that have appeared on these instances' output (lines that start with
/// `prefix`) since the last call, and starts a watcher for each new command's death. Returns how
/// many runs are known.
pub fn collect_runs<'a>(
    prefix: &str,
    instances: impl Iterator<Item = &'a Proc>,
    runs: &Runs,
    seed: u64,
) -> usize {
    for instance in instances {
        for line in instance.lines(Stream::Stdout) {
            let Some(rest) = line.strip_prefix(prefix) else {
                continue;
            };
            let field = |key: &str| -> String {
                rest.split_whitespace()
                    .find_map(|word| word.strip_prefix(&format!("{key}=")))
                    .unwrap_or_default()
                    .to_owned()
            };
            let pid: i32 = field("pid").parse().expect("pid");
            let mut known = runs.lock().expect("runs");
            if known.contains_key(&pid) {
                continue;
            }
            known.insert(
                pid,
                Run {
                    slot: field("slot").parse().expect("slot"),
                    pid,
                    backend: field("backend"),
                    epoch: field("epoch")
                        .parse()
                        .unwrap_or_else(|_| panic!("seed {seed}: no PGLEADER_EPOCH in {line:?}")),
                    started: field("started").parse().expect("started"),
                    died: None,
                },
            );
            // A pidfd turns readable the moment the process exits (not when it is reaped).
            // One opened after the exit fails with ESRCH, and the death is then recorded
            // late: never earlier than it was, so it can only make an overlap look bigger.
            let watched = runs.clone();
            std::thread::spawn(move || {
                if wait_gone(pid, Duration::from_secs(3600)) {
                    let died = monotonic_ns();
                    if let Some(run) = watched.lock().expect("runs").get_mut(&pid) {
                        run.died = Some(died);
                    }
                }
            });
        }
    }
    runs.lock().expect("runs").len()
}

/// The runs, by start: fails the test if two overlap (a run still going at `ended` counts as
/// running until then) or if a fencing token does not grow from one run to the next.
pub fn assert_one_at_a_time(runs: &Runs, ended: u64, seed: u64, report: &str) -> Vec<Run> {
    let mut runs: Vec<Run> = runs.lock().expect("runs").values().cloned().collect();
    runs.sort_by_key(|run| run.started);
    for pair in runs.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        let before_ended = before.died.unwrap_or(ended);
        assert!(
            after.started > before_ended,
            "seed {seed}: the command of instance {} (pid {}) started {} µs before the one of instance {} (pid {}) died\n{report}",
            after.slot,
            after.pid,
            (before_ended - after.started) / 1000,
            before.slot,
            before.pid,
        );
        assert!(
            after.epoch > before.epoch,
            "seed {seed}: fencing token {} (instance {}, pid {}) after {} (instance {}, pid {})\n{report}",
            after.epoch,
            after.slot,
            after.pid,
            before.epoch,
            before.slot,
            before.pid,
        );
    }
    runs
}

/// The share of the time between `began` and `ended`, less the server's `downtime` (stopped,
/// started), during which some run's command ran.
pub fn running_share(runs: &[Run], began: u64, ended: u64, downtime: &[(u64, u64)]) -> f64 {
    let running: u64 = runs
        .iter()
        .map(|run| run.died.unwrap_or(ended).min(ended) - run.started)
        .sum();
    let down: u64 = downtime.iter().map(|(stop, start)| start - stop).sum();
    running as f64 / (ended - began - down) as f64
}

/// A nemesis' record: the runs it saw, what it did (its first line says how it was set up),
/// and the seed that replays it.
pub struct Chronicle {
    pub runs: Runs,
    pub log: Vec<String>,
    pub seed: u64,
}

impl Chronicle {
    /// A record of an experiment replayed by `seed`, set up as `setup` says.
    pub fn new(seed: u64, setup: String) -> Chronicle {
        Chronicle {
            runs: Runs::default(),
            log: vec![setup],
            seed,
        }
    }
}

/// What a nemesis does while their experiment goes on:
/// collect the instances' runs, wait for what a step needs, and name the leader. Each nemesis
/// says how it collects, reports, and how long a new leader may take.
pub trait Watch {
    /// Records runs that have appeared on the instances' output since the last call, and
    /// starts a watcher for each new command's death. Returns how many runs are known.
    fn collect(&self) -> usize;
    /// What the experiment has seen and done so far.
    fn chronicle(&self) -> &Chronicle;
    fn runs(&self) -> &Runs {
        &self.chronicle().runs
    }
    fn seed(&self) -> u64 {
        self.chronicle().seed
    }
    /// What the nemesis did, in order.
    fn faults(&self) -> &[String] {
        &self.chronicle().log
    }
    /// Every pgleader it started, the retired ones first.
    fn instances(&self) -> Vec<&Proc>;
    /// How long a new leader's command may take to appear after a fault.
    fn new_leader_bound(&self) -> Duration;

    /// The faults, the runs and every instance's output, for a failure message.
    fn report(&self) -> String {
        let mut text = String::from("faults:\n");
        for line in self.faults() {
            text.push_str(&format!("  {line}\n"));
        }
        text.push_str("runs (slot, pid, client, epoch, started, died):\n");
        let mut runs: Vec<Run> = self
            .runs()
            .lock()
            .expect("runs")
            .values()
            .cloned()
            .collect();
        runs.sort_by_key(|run| run.started);
        for run in runs {
            text.push_str(&format!(
                "  {} {} {} {} {} {:?}\n",
                run.slot, run.pid, run.backend, run.epoch, run.started, run.died
            ));
        }
        for instance in self.instances() {
            text.push_str(&instance.dump());
        }
        text
    }

    /// Keeps collecting runs (every 10 ms, so that a death is watched from the start) until
    /// `done` says so; fails the test after `timeout`, saying `what` was awaited.
    fn collect_until(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        loop {
            self.collect();
            if done() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "seed {}: {what} not within {timeout:?}\n{}",
                self.seed(),
                self.report()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The experiment's own pace (how long a leader runs, how long a freeze lasts), not a
    /// stand-in for an event: runs are collected meanwhile.
    fn pause(&self, length: Duration) {
        let end = Instant::now() + length;
        self.collect_until("a pause", length + WAIT, || Instant::now() >= end);
    }

    /// Runs a blocking step (`DEBUG SLEEP`, a server's restart) on another thread, collecting
    /// runs meanwhile.
    fn during<T: Send>(&self, step: impl FnOnce() -> T + Send) -> T
    where
        Self: Sync,
    {
        std::thread::scope(|scope| {
            let handle = scope.spawn(step);
            self.collect_until("a blocking step's end", WAIT, || handle.is_finished());
            handle.join().expect("the step's thread")
        })
    }

    /// The newest run whose command still runs, waiting up to [`Watch::new_leader_bound`]
    /// for one.
    fn leader(&self) -> Run {
        let mut found = None;
        self.collect_until("a running command", self.new_leader_bound(), || {
            found = self
                .runs()
                .lock()
                .expect("runs")
                .values()
                .filter(|run| run.died.is_none())
                .max_by_key(|run| run.started)
                .cloned();
            found.is_some()
        });
        found.expect("a run")
    }

    /// Waits up to [`Watch::new_leader_bound`] until a run beyond the first `known` has
    /// started; returns the newest run.
    fn wait_for_new_run(&self, known: usize) -> Run {
        self.collect_until(
            "a new leader's command after the fault",
            self.new_leader_bound(),
            || self.runs().lock().expect("runs").len() > known,
        );
        self.newest()
    }

    /// The run that started last.
    fn newest(&self) -> Run {
        self.runs()
            .lock()
            .expect("runs")
            .values()
            .max_by_key(|run| run.started)
            .cloned()
            .expect("a run")
    }
}
