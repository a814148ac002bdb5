//! What every nemesis shares: the machine's monotonic clock, the runs of the command as the test
//! saw them (each start from the command's own line, each death from a pidfd), the check that no
//! two ran at once and that fencing tokens grow, and the [`Chronicle`] of an experiment as it
//! goes on.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::{Proc, Redis, Stream, WAIT, wait_gone};

/// What every nemesis gives its pgleaders (`run` and `cron` alike): quick checks
/// (check-interval + check-timeout + kill-timeout is 600 ms, which makes 1616 ms the shortest
/// lease pgleader accepts), behind the restart fence. Each nemesis adds its lease and takeover
/// delay.
pub const QUICK: [&str; 4] = [
    "--check-interval=100ms",
    "--check-timeout=200ms",
    "--kill-timeout=300ms",
    "--restart-fence=auto",
];

/// `pgleader run` as a nemesis runs it: its `lock` argument (`--lock=` or `--lock-id=`), the
/// quick checks, a command that starts again at once, and the nemesis' `timings`. The nemesis adds its environment and its servers,
/// and [`run_child`] the command.
pub fn pgleader_run(lock: &str, timings: &[&str]) -> Command {
    let mut command = super::pgleader();
    command
        .arg("run")
        .arg(lock)
        .args(QUICK)
        .arg("--restart-delay=0s")
        .args(timings);
    command
}

/// Ends a nemesis' pgleader `command` with the command it runs: this test binary again, running
/// only the child test `test`, which prints its start and waits to be killed.
pub fn run_child(command: &mut Command, test: &str) {
    command
        .arg("--")
        .arg(std::env::current_exe().expect("the test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1", "-q"]);
}

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

/// The seed (PGLEADER_NEMESIS_SEED replays one), the number of rounds
/// (PGLEADER_NEMESIS_ROUNDS, else `default_rounds`), and the generator it seeds.
pub fn seed_and_rounds(default_rounds: usize) -> (u64, usize, fastrand::Rng) {
    let seed = env_number("PGLEADER_NEMESIS_SEED").unwrap_or_else(|| fastrand::u64(..));
    (
        seed,
        env_number("PGLEADER_NEMESIS_ROUNDS").unwrap_or(default_rounds),
        fastrand::Rng::with_seed(seed),
    )
}

/// The faults a nemesis draws from: those PGLEADER_NEMESIS_FAULTS names (their Debug names,
/// comma-separated), if set, else `all`.
pub fn faults_to_draw<F: Copy + std::fmt::Debug>(all: &[F]) -> Vec<F> {
    match std::env::var("PGLEADER_NEMESIS_FAULTS") {
        Ok(names) => names
            .split(',')
            .map(|name| {
                *all.iter()
                    .find(|fault| format!("{fault:?}") == name.trim())
                    .unwrap_or_else(|| panic!("no fault {name:?}; the faults: {all:?}"))
            })
            .collect(),
        Err(_) => all.to_vec(),
    }
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

impl Run {
    /// The instance, its session's client id and its fencing token, for the record.
    pub fn as_leader(&self) -> String {
        format!(
            "instance {} (client {}, epoch {})",
            self.slot, self.backend, self.epoch
        )
    }
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
    collect_seen(prefix, instances, runs, |pid, line| Run {
        slot: line.field("slot").parse().expect("slot"),
        pid,
        backend: line.field("backend"),
        epoch: line
            .field("epoch")
            .parse()
            .unwrap_or_else(|_| panic!("seed {seed}: no PGLEADER_EPOCH in {:?}", line.line)),
        started: line.field("started").parse().expect("started"),
        died: None,
    })
}

/// A line a nemesis' child printed when it started: `<prefix>key=value key=value ...`.
pub struct ChildLine<'a> {
    pub line: &'a str,
    rest: &'a str,
}

impl ChildLine<'_> {
    /// The value of `key`, empty if the line has none.
    pub fn field(&self, key: &str) -> String {
        self.rest
            .split_whitespace()
            .find_map(|word| word.strip_prefix(&format!("{key}=")))
            .unwrap_or_default()
            .to_owned()
    }
}

/// A run whose death a watcher thread notes.
pub trait Mortal: Send + 'static {
    fn died_at(&mut self, at: u64);
}

impl Mortal for Run {
    fn died_at(&mut self, at: u64) {
        self.died = Some(at);
    }
}

/// Records, by pid, the runs (as `parse` reads them) that have appeared on these instances'
/// output (lines that start with `prefix`) since the last call, and starts a watcher for each
/// new command's death. Returns how many runs are known.
pub fn collect_seen<'a, R: Mortal>(
    prefix: &str,
    instances: impl Iterator<Item = &'a Proc>,
    runs: &Arc<Mutex<BTreeMap<i32, R>>>,
    parse: impl Fn(i32, &ChildLine) -> R,
) -> usize {
    for instance in instances {
        for line in instance.lines(Stream::Stdout) {
            let Some(rest) = line.strip_prefix(prefix) else {
                continue;
            };
            let child = ChildLine { line: &line, rest };
            let pid: i32 = child.field("pid").parse().expect("pid");
            let mut known = runs.lock().expect("runs");
            if known.contains_key(&pid) {
                continue;
            }
            known.insert(pid, parse(pid, &child));
            // A pidfd turns readable the moment the process exits (not when it is reaped).
            // One opened after the exit fails with ESRCH, and the death is then recorded
            // late: never earlier than it was, so it can only make an overlap look bigger.
            let watched = runs.clone();
            std::thread::spawn(move || {
                if wait_gone(pid, Duration::from_secs(3600)) {
                    let died = monotonic_ns();
                    if let Some(run) = watched.lock().expect("runs").get_mut(&pid) {
                        run.died_at(died);
                    }
                }
            });
        }
    }
    runs.lock().expect("runs").len()
}

/// What a nemesis' child does once it has started: prints `line` (its start, as
/// [`collect_seen`] reads it) and waits to be killed.
pub fn announce_and_wait(line: &str) -> ! {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
    drop(stdout);
    loop {
        std::thread::park();
    }
}

/// What the child of a single lock's nemesis does: prints its start as [`collect_runs`] reads
/// it (`prefix`, its `slot`, pid, the monotonic time, its session's client id and its fencing
/// token, then `extra`) and waits to be killed.
pub fn announce_run_and_wait(prefix: &str, slot: &str, extra: &str) -> ! {
    let started = monotonic_ns();
    let backend = std::env::var("PGLEADER_BACKEND_PID").unwrap_or_default();
    let epoch = std::env::var("PGLEADER_EPOCH").unwrap_or_default();
    announce_and_wait(&format!(
        "{prefix}slot={slot} pid={} started={started} backend={backend} epoch={epoch}{extra}",
        std::process::id()
    ))
}

/// The signal of a kill -9 fault (`kill`), else of a SIGTERM one.
pub fn kill_or_term(kill: bool) -> Signal {
    if kill {
        Signal::SIGKILL
    } else {
        Signal::SIGTERM
    }
}

/// Stops the instance in `slot`, if there is one, with `signal`, and waits for its exit.
pub fn stop_and_wait(slot: &mut Option<Proc>, signal: Signal) {
    if let Some(instance) = slot.take() {
        instance.signal(signal);
        instance.wait_exit();
    }
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

/// The pgleaders a nemesis started: the one running in each slot, and those a fault stopped,
/// whose output still counts and goes into the report.
pub struct Instances {
    pub live: Vec<Option<Proc>>,
    pub retired: Vec<Proc>,
}

impl Instances {
    /// `slots` slots, none started yet.
    pub fn new(slots: usize) -> Instances {
        Instances {
            live: (0..slots).map(|_| None).collect(),
            retired: Vec::new(),
        }
    }

    /// Every pgleader started, the retired ones first.
    pub fn all(&self) -> Vec<&Proc> {
        self.retired
            .iter()
            .chain(self.live.iter().flatten())
            .collect()
    }
}

/// A nemesis' experiment as it goes on: the pgleaders it started, the runs of their command
/// it saw (from the lines its children print, which start with `prefix`), what it did (its
/// first line says how it was set up), and the seed that replays it. It collects the runs,
/// waits for what a step needs, and names the leader.
pub struct Chronicle {
    pub instances: Instances,
    pub runs: Runs,
    pub log: Vec<String>,
    pub seed: u64,
    prefix: &'static str,
    /// How long a new leader's command may take to appear after a fault.
    new_leader_bound: Duration,
}

impl Chronicle {
    /// An experiment replayed by `seed`, set up as `setup` says, over `slots` pgleaders whose
    /// children's lines start with `prefix`; after a fault, a new leader must run within
    /// `new_leader_bound`.
    pub fn new(
        seed: u64,
        setup: String,
        slots: usize,
        prefix: &'static str,
        new_leader_bound: Duration,
    ) -> Chronicle {
        Chronicle {
            instances: Instances::new(slots),
            runs: Runs::default(),
            log: vec![setup],
            seed,
            prefix,
            new_leader_bound,
        }
    }

    /// Starts instance `slot`: its pgleader's `command`, which runs the child test `child`.
    pub fn start(&mut self, slot: usize, mut command: Command, child: &str) {
        run_child(&mut command, child);
        self.instances.live[slot] = Some(Proc::spawn(&format!("instance {slot}"), command));
    }

    /// Writes down what the nemesis did.
    pub fn note(&mut self, line: String) {
        self.log.push(line);
    }

    /// Records runs that have appeared on the instances' output since the last call, and
    /// starts a watcher for each new command's death. Returns how many runs are known.
    pub fn collect(&self) -> usize {
        collect_runs(
            self.prefix,
            self.instances.all().into_iter(),
            &self.runs,
            self.seed,
        )
    }

    /// Stops the instance in `slot`, if there is one, with `signal`, collecting what it prints
    /// meanwhile, and notes how it exited.
    pub fn stop(&mut self, slot: usize, signal: Signal) {
        let Some(instance) = self.instances.live[slot].take() else {
            return;
        };
        instance.signal(signal);
        // Retired first, so that what it prints while it stops is still collected.
        self.instances.retired.push(instance);
        let instance = self.instances.retired.last().expect("just retired");
        self.collect_until(&format!("the exit of instance {slot}"), WAIT, || {
            instance.has_exited()
        });
        let status = instance.wait_exit();
        self.note(format!("  instance {slot}: {status}"));
    }

    /// The faults, the runs and every instance's output, for a failure message.
    pub fn report(&self) -> String {
        let mut text = String::from("faults:\n");
        for line in &self.log {
            text.push_str(&format!("  {line}\n"));
        }
        text.push_str("runs (slot, pid, client, epoch, started, died):\n");
        let mut runs: Vec<Run> = self.runs.lock().expect("runs").values().cloned().collect();
        runs.sort_by_key(|run| run.started);
        for run in runs {
            text.push_str(&format!(
                "  {} {} {} {} {} {:?}\n",
                run.slot, run.pid, run.backend, run.epoch, run.started, run.died
            ));
        }
        for instance in self.instances.all() {
            text.push_str(&instance.dump());
        }
        text
    }

    /// Keeps collecting runs (every 10 ms, so that a death is watched from the start) until
    /// `done` says so; fails the test after `timeout`, saying `what` was awaited.
    pub fn collect_until(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        loop {
            self.collect();
            if done() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "seed {}: {what} not within {timeout:?}\n{}",
                self.seed,
                self.report()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The experiment's own pace (how long a leader runs, how long a freeze lasts), not a
    /// stand-in for an event: runs are collected meanwhile.
    pub fn pause(&self, length: Duration) {
        let end = Instant::now() + length;
        self.collect_until("a pause", length + WAIT, || Instant::now() >= end);
    }

    /// Runs a blocking step (`DEBUG SLEEP`, a server's restart) on another thread, collecting
    /// runs meanwhile.
    pub fn during<T: Send>(&self, step: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|scope| {
            let handle = scope.spawn(step);
            self.collect_until("a blocking step's end", WAIT, || handle.is_finished());
            handle.join().expect("the step's thread")
        })
    }

    /// The newest run whose command still runs, waiting up to the new leader's bound
    /// for one.
    pub fn leader(&self) -> Run {
        let mut found = None;
        self.collect_until("a running command", self.new_leader_bound, || {
            found = self
                .runs
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

    /// Waits up to the new leader's bound until a run beyond the first `known` has
    /// started; returns the newest run.
    pub fn wait_for_new_run(&self, known: usize) -> Run {
        self.collect_until(
            "a new leader's command after the fault",
            self.new_leader_bound,
            || self.runs.lock().expect("runs").len() > known,
        );
        self.newest()
    }

    /// Keeps `redis` busy in `DEBUG SLEEP` for `length` (it answers nothing, yet its sockets
    /// look alive), collecting runs meanwhile.
    pub fn debug_sleep(&self, redis: &Redis, length: Duration) {
        let seconds = format!("{:.3}", length.as_secs_f64());
        let answer = self.during(|| redis.try_cli(&["DEBUG", "SLEEP", &seconds]));
        assert_eq!(
            answer.as_deref(),
            Ok("OK"),
            "seed {}: DEBUG SLEEP (the harness starts redis-server with \
             --enable-debug-command local)",
            self.seed
        );
    }

    /// Ends the experiment that began at `began`: collects the last runs and checks that no two
    /// overlapped and that the fencing tokens grew. Returns the runs, the share of the time (less
    /// the server's `downtime`) during which a command ran, and the report.
    pub fn conclude(&self, began: u64, downtime: &[(u64, u64)]) -> (Vec<Run>, f64, String) {
        let ended = monotonic_ns();
        self.collect();
        let report = self.report();
        let runs = assert_one_at_a_time(&self.runs, ended, self.seed, &report);
        let share = running_share(&runs, began, ended, downtime);
        (runs, share, report)
    }

    /// The run that started last.
    pub fn newest(&self) -> Run {
        self.runs
            .lock()
            .expect("runs")
            .values()
            .max_by_key(|run| run.started)
            .cloned()
            .expect("a run")
    }
}
