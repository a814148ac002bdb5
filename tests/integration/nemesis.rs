//! The nemesis: several pgleaders compete for one lock while the test injects a random
//! sequence of faults (kill -9, SIGTERM, pg_terminate_backend, a frozen proxy, a server
//! restart). Every command records when it started (monotonic clock); the test records when it
//! died. No two run intervals may overlap, and some leader's command must run most of the time
//! the database is up.
//!
//! Seeded: the seed is printed on failure and can be replayed with PGLEADER_NEMESIS_SEED. The
//! number of rounds is PGLEADER_NEMESIS_ROUNDS (30 by default; docs/development.md shows a longer run).

use std::time::Duration;

use crate::harness::nemesis::{
    Chronicle, announce_run_and_wait, kill_or_term, monotonic_ns, pgleader_run, seed_and_rounds,
    stop_and_wait,
};
use crate::harness::{Cluster, Proxy, WAIT, unique_lock};

/// Not a test of its own: the command the nemesis's pgleaders run is this test binary,
/// re-executed to run only this function with PGLEADER_NEMESIS_SLOT set. It prints its start
/// (with the monotonic time) and then waits to be killed. In a normal test run it does
/// nothing.
#[test]
fn child_mode() {
    let Ok(slot) = std::env::var("PGLEADER_NEMESIS_SLOT") else {
        return;
    };
    announce_run_and_wait(CHILD, &slot, "");
}

/// How the child's line starts.
const CHILD: &str = "nemesis-child ";

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

// Besides the nemeses' quick checks: short turns of the followers' waits, so that faults land
// between two turns and in the middle of one, not only in the first.
const TIMINGS: [&str; 3] = [
    "--wait-refresh=300ms",
    "--lease=2s",
    "--takeover-delay=500ms",
];

struct Nemesis {
    cluster: Cluster,
    lock: i64,
    proxies: Vec<Proxy>,
    chronicle: Chronicle,
    /// (stopped, started) monotonic times of the server's downtimes.
    downtime: Vec<(u64, u64)>,
}

impl Nemesis {
    fn spawn(&mut self, slot: usize) {
        let mut command = pgleader_run(&format!("--lock-id={}", self.lock), &TIMINGS);
        command
            .env("PGLEADER_DATABASE_URL", self.proxies[slot].url())
            .env("PGLEADER_NEMESIS_SLOT", slot.to_string());
        self.chronicle.start(slot, command, "nemesis::child_mode");
    }
}

#[test]
fn no_two_commands_ever_run_at_once_under_random_faults() {
    let (seed, rounds, mut rng) = seed_and_rounds(30);
    let cluster = Cluster::new("nemesis");
    let count = rng.usize(3..=5);
    let proxies: Vec<Proxy> = (0..count).map(|_| Proxy::start(cluster.port)).collect();
    let mut nemesis = Nemesis {
        cluster,
        lock: unique_lock(),
        proxies,
        downtime: Vec::new(),
        chronicle: Chronicle::new(
            seed,
            format!("seed {seed}, {count} instances, {rounds} rounds"),
            count,
            CHILD,
            WAIT,
        ),
    };
    let began = monotonic_ns();
    for slot in 0..count {
        nemesis.spawn(slot);
    }
    let mut leader = nemesis.chronicle.wait_for_new_run(0);

    for round in 0..rounds {
        let fault = FAULTS[rng.usize(..FAULTS.len())];
        // Mostly the leader; now and then a follower, for kill -9 and SIGTERM.
        let target = match fault {
            Fault::Kill9 | Fault::Term if rng.u8(..5) == 0 => rng.usize(..count),
            _ => leader.slot,
        };
        nemesis.chronicle.note(format!(
            "round {round}: {fault:?} on instance {target} (leader {})",
            leader.slot
        ));
        let known = nemesis.chronicle.collect();
        let hits_leader = target == leader.slot || matches!(fault, Fault::Restart);
        match fault {
            Fault::Kill9 | Fault::Term => {
                let signal = kill_or_term(matches!(fault, Fault::Kill9));
                stop_and_wait(&mut nemesis.chronicle.instances.live[target], signal);
                nemesis.spawn(target);
            }
            Fault::Terminate => nemesis
                .cluster
                .terminate_backend(leader.backend.parse().expect("a backend pid")),
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
            leader = nemesis.chronicle.wait_for_new_run(known);
        }
        if matches!(fault, Fault::Freeze) {
            nemesis.proxies[target].thaw();
        }
        // Let the new leader run a while: the experiment's own pace, not a synchronisation.
        std::thread::sleep(Duration::from_millis(rng.u64(1000..2000)));
    }

    let (runs, share, report) = nemesis.chronicle.conclude(began, &nemesis.downtime);
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
