//! The nemesis: several pgleaders compete for one lock while the test injects a random
//! sequence of faults (kill -9, SIGTERM, pg_terminate_backend, a frozen proxy, a server
//! restart). Every command records when it started (monotonic clock); the test records when it
//! died. No two run intervals may overlap, and some leader's command must run most of the time
//! the database is up.
//!
//! Seeded: the seed is printed on failure and can be replayed with PGLEADER_NEMESIS_SEED. The
//! number of rounds is PGLEADER_NEMESIS_ROUNDS (30 by default; README.md shows a longer run).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::harness::{Cluster, Proc, Proxy, Stream, WAIT, pgleader, unique_lock, wait_gone};

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process of the machine.
pub(crate) fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill in.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Not a test of its own: the command the nemesis's pgleaders run is this test binary,
/// re-executed to run only this function with PGLEADER_NEMESIS_SLOT set. It prints its start
/// (with the monotonic time) and then waits to be killed. In a normal test run it does
/// nothing.
#[test]
fn child_mode() {
    let Ok(slot) = std::env::var("PGLEADER_NEMESIS_SLOT") else {
        return;
    };
    let started = monotonic_ns();
    let backend = std::env::var("PGLEADER_BACKEND_PID").unwrap_or_default();
    let epoch = std::env::var("PGLEADER_EPOCH").unwrap_or_default();
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(
        stdout,
        "nemesis-child slot={slot} pid={} started={started} backend={backend} epoch={epoch}",
        std::process::id()
    );
    let _ = stdout.flush();
    drop(stdout);
    loop {
        std::thread::park();
    }
}

/// One run of the command, as the test saw it.
#[derive(Debug, Clone)]
struct Run {
    slot: usize,
    pid: i32,
    backend: i32,
    started: u64,
    died: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill9,
    Term,
    Terminate,
    Freeze,
    Restart,
}

const FAULTS: [Fault; 5] = [
    Fault::Kill9,
    Fault::Term,
    Fault::Terminate,
    Fault::Freeze,
    Fault::Restart,
];

// Short turns of the followers' waits, so that faults land between two turns and in the
// middle of one, not only in the first.
const TIMINGS: [&str; 8] = [
    "--wait-refresh=300ms",
    "--check-interval=100ms",
    "--check-timeout=200ms",
    "--kill-timeout=300ms",
    "--lease=2s",
    "--takeover-delay=500ms",
    "--restart-fence=auto",
    "--restart-delay=0s",
];

struct Nemesis {
    cluster: Cluster,
    lock: i64,
    proxies: Vec<Proxy>,
    instances: Vec<Option<Proc>>,
    /// Every command run seen so far, by pid; deaths are filled in by watcher threads.
    runs: Arc<Mutex<BTreeMap<i32, Run>>>,
    /// (stopped, started) monotonic times of the server's downtimes.
    downtime: Vec<(u64, u64)>,
    log: Vec<String>,
}

impl Nemesis {
    fn spawn(&mut self, slot: usize) {
        let mut command: Command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", self.proxies[slot].url())
            .env("PGLEADER_NEMESIS_SLOT", slot.to_string())
            .arg("run")
            .arg(format!("--lock-id={}", self.lock))
            .args(TIMINGS)
            .arg("--")
            .arg(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "nemesis::child_mode",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ]);
        self.instances[slot] = Some(Proc::spawn(&format!("instance {slot}"), command));
    }

    /// Records runs that have appeared on the instances' output since the last call, and
    /// starts a watcher for each new command's death. Returns how many runs are known.
    fn collect(&self) -> usize {
        for instance in self.instances.iter().flatten() {
            for line in instance.lines(Stream::Stdout) {
                let Some(rest) = line.strip_prefix("nemesis-child ") else {
                    continue;
                };
                let field = |key: &str| -> String {
                    rest.split_whitespace()
                        .find_map(|word| word.strip_prefix(&format!("{key}=")))
                        .unwrap_or_default()
                        .to_owned()
                };
                let pid: i32 = field("pid").parse().expect("pid");
                let mut runs = self.runs.lock().expect("runs");
                if runs.contains_key(&pid) {
                    continue;
                }
                runs.insert(
                    pid,
                    Run {
                        slot: field("slot").parse().expect("slot"),
                        pid,
                        backend: field("backend").parse().expect("backend"),
                        started: field("started").parse().expect("started"),
                        died: None,
                    },
                );
                let watched = self.runs.clone();
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
        self.runs.lock().expect("runs").len()
    }

    /// Waits until a run beyond the first `known` has started; returns the newest run.
    fn wait_for_new_run(&self, known: usize, seed: u64) -> Run {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if self.collect() > known {
                let runs = self.runs.lock().expect("runs");
                return runs
                    .values()
                    .max_by_key(|run| run.started)
                    .cloned()
                    .expect("a run");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "seed {seed}: no leader within {WAIT:?} after the last fault\n{}",
                self.report()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn report(&self) -> String {
        let mut text = String::from("faults:\n");
        for line in &self.log {
            text.push_str(&format!("  {line}\n"));
        }
        text.push_str("runs (slot, pid, started, died):\n");
        for run in self.runs.lock().expect("runs").values() {
            text.push_str(&format!(
                "  {} {} {} {:?}\n",
                run.slot, run.pid, run.started, run.died
            ));
        }
        for instance in self.instances.iter().flatten() {
            text.push_str(&instance.dump());
        }
        text
    }
}

#[test]
fn no_two_commands_ever_run_at_once_under_random_faults() {
    let seed: u64 = std::env::var("PGLEADER_NEMESIS_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    let rounds: usize = std::env::var("PGLEADER_NEMESIS_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(30);
    let mut rng = fastrand::Rng::with_seed(seed);
    let cluster = Cluster::new("nemesis");
    let count = rng.usize(3..=5);
    let proxies: Vec<Proxy> = (0..count).map(|_| Proxy::start(cluster.port)).collect();
    let mut nemesis = Nemesis {
        cluster,
        lock: unique_lock(),
        proxies,
        instances: (0..count).map(|_| None).collect(),
        runs: Arc::new(Mutex::new(BTreeMap::new())),
        downtime: Vec::new(),
        log: vec![format!("seed {seed}, {count} instances, {rounds} rounds")],
    };
    let began = monotonic_ns();
    for slot in 0..count {
        nemesis.spawn(slot);
    }
    let mut leader = nemesis.wait_for_new_run(0, seed);

    for round in 0..rounds {
        let fault = FAULTS[rng.usize(..FAULTS.len())];
        // Mostly the leader; now and then a follower, for kill -9 and SIGTERM.
        let target = match fault {
            Fault::Kill9 | Fault::Term if rng.u8(..5) == 0 => rng.usize(..count),
            _ => leader.slot,
        };
        nemesis.log.push(format!(
            "round {round}: {fault:?} on instance {target} (leader {})",
            leader.slot
        ));
        let known = nemesis.collect();
        let hits_leader = target == leader.slot || matches!(fault, Fault::Restart);
        match fault {
            Fault::Kill9 | Fault::Term => {
                let signal = if matches!(fault, Fault::Kill9) {
                    Signal::SIGKILL
                } else {
                    Signal::SIGTERM
                };
                if let Some(instance) = nemesis.instances[target].take() {
                    instance.signal(signal);
                    instance.wait_exit();
                }
                nemesis.spawn(target);
            }
            Fault::Terminate => nemesis.cluster.terminate_backend(leader.backend),
            Fault::Freeze => nemesis.proxies[target].freeze(),
            Fault::Restart => {
                let stopped = monotonic_ns();
                nemesis.cluster.stop();
                std::thread::sleep(Duration::from_millis(rng.u64(200..1500)));
                nemesis.cluster.start();
                nemesis.downtime.push((stopped, monotonic_ns()));
            }
        }
        if hits_leader {
            leader = nemesis.wait_for_new_run(known, seed);
        }
        if matches!(fault, Fault::Freeze) {
            nemesis.proxies[target].thaw();
        }
        // Let the new leader run a while: the experiment's own pace, not a synchronisation.
        std::thread::sleep(Duration::from_millis(rng.u64(1000..2000)));
    }

    let ended = monotonic_ns();
    nemesis.collect();
    let mut runs: Vec<Run> = nemesis
        .runs
        .lock()
        .expect("runs")
        .values()
        .cloned()
        .collect();
    runs.sort_by_key(|run| run.started);
    let report = nemesis.report();
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
    }
    let running: u64 = runs
        .iter()
        .map(|run| run.died.unwrap_or(ended).min(ended) - run.started)
        .sum();
    let down: u64 = nemesis
        .downtime
        .iter()
        .map(|(stop, start)| start - stop)
        .sum();
    let up = ended - began - down;
    let share = running as f64 / up as f64;
    assert!(
        share > 0.5,
        "seed {seed}: a command ran only {:.0}% of the time the database was up\n{report}",
        share * 100.0
    );
    eprintln!(
        "nemesis: seed {seed}, {count} instances, {rounds} rounds, {} runs, a command ran {:.0}% of the time the database was up",
        runs.len(),
        share * 100.0
    );
}
