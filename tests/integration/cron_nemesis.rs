//! The nemesis of a crontab across the fleet: four replicas run `pgleader cron` with five
//! every-second jobs against their own PostgreSQL cluster, each through a proxy of its own,
//! while the test injects a random sequence of faults: kill -9, SIGTERM, pg_terminate_backend
//! of a replica's holder session, a frozen proxy (a partition; the server frees its jobs after
//! the lease), a server restart, and a replica restarted with its clock 20 to 40 seconds off
//! (libfaketime). Every run appends its job and occurrence to a journal: no (job, occurrence)
//! may appear twice, and every job must run again after each fault.
//!
//! Seeded: the seed is printed on failure and can be replayed with PGLEADER_NEMESIS_SEED; the
//! rounds are PGLEADER_NEMESIS_ROUNDS (12 by default).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::crontab::File;
use crate::harness::nemesis::{QUICK, kill_or_term, seed_and_rounds, stop_and_wait};
use crate::harness::process::pid_field;
use crate::harness::{Cluster, Journal, Proc, Proxy, Stream, WAIT, pgleader, unique_lock};

const JOBS: usize = 5;
const SLOTS: usize = 4;
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Beside the nemesis' quick checks (600 ms from check to kill), the shortest lease they allow
/// and waits that refresh often: a partitioned replica's jobs move after the lease.
const TIMINGS: [&str; 2] = ["--lease=2s", "--wait-refresh=300ms"];

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill9,
    Term,
    Terminate,
    Freeze,
    Restart,
    Skew,
}

const FAULTS: [Fault; 6] = [
    Fault::Kill9,
    Fault::Term,
    Fault::Terminate,
    Fault::Freeze,
    Fault::Restart,
    Fault::Skew,
];

struct Fleet {
    cluster: Cluster,
    crontab: File,
    lock: i64,
    proxies: Vec<Proxy>,
    replicas: Vec<Option<Proc>>,
    /// Each slot's clock offset (libfaketime's FAKETIME), if any.
    skews: Vec<Option<String>>,
    journal: Journal,
    log: Vec<String>,
}

impl Fleet {
    fn spawn(&mut self, slot: usize) {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", self.proxies[slot].url())
            .env("SLOT", slot.to_string())
            .arg("cron")
            .arg(format!("--lock-id={}", self.lock))
            .args(QUICK)
            .args(TIMINGS)
            .arg(&self.crontab.0);
        if let Some(offset) = &self.skews[slot] {
            command.env("LD_PRELOAD", FAKETIME).env("FAKETIME", offset);
        }
        self.replicas[slot] = Some(Proc::spawn(&format!("replica {slot}"), command));
    }

    /// The runs in the journal: (job, occurrence) → the slots that started it.
    fn runs(&self) -> BTreeMap<(String, String), Vec<String>> {
        let mut runs: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for line in self.journal.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["start", job, at, slot] = words.as_slice() {
                runs.entry(((*job).to_owned(), (*at).to_owned()))
                    .or_default()
                    .push((*slot).to_owned());
            }
        }
        runs
    }

    /// Waits until every job has started a run recorded after `mark` journal lines.
    fn wait_for_every_job(&self, mark: usize, seed: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let started: std::collections::BTreeSet<String> = self.journal.lines()
                [mark.min(self.journal.lines().len())..]
                .iter()
                .filter_map(|line| line.strip_prefix("start "))
                .filter_map(|rest| rest.split_whitespace().next().map(str::to_owned))
                .collect();
            if started.len() == JOBS {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: only {started:?} ran again within {timeout:?}\n{}",
                self.report()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The session id of a replica's holder, from its log.
    fn holder_of(&self, slot: usize) -> Option<i32> {
        self.replicas[slot]
            .as_ref()?
            .lines(Stream::Stderr)
            .iter()
            .rev()
            .find(|line| line.contains("joined the replicas"))
            .map(|line| pid_field(line, "backend_pid"))
    }

    fn report(&self) -> String {
        let mut text = String::from("faults:\n");
        for line in &self.log {
            text.push_str(&format!("  {line}\n"));
        }
        for replica in self.replicas.iter().flatten() {
            text.push_str(&replica.dump());
        }
        text
    }
}

#[test]
fn under_random_faults_no_occurrence_of_any_job_runs_twice_and_every_job_runs_again() {
    assert!(
        Path::new(FAKETIME).is_file(),
        "{FAKETIME} is missing: the cron nemesis skews replicas' clocks with libfaketime (apt-get install faketime)"
    );
    let (seed, rounds, mut rng) = seed_and_rounds(12);
    let cluster = Cluster::new("cron-nemesis");
    let journal = Journal::new("cron-nemesis");
    let mut text = String::new();
    for n in 1..=JOBS {
        text.push_str(&format!(
            "# pgleader: name=j{n}\n* * * * * * * {}; sleep 0.3; {}\n",
            journal.append("start $PGLEADER_JOB $PGLEADER_SCHEDULED_TIME $SLOT"),
            journal.append("end $PGLEADER_JOB $PGLEADER_SCHEDULED_TIME $SLOT"),
        ));
    }
    let crontab = File::new("cron-nemesis", &text);
    // The journal is written by the jobs' commands, which run as the tests do.
    let proxies = (0..SLOTS).map(|_| Proxy::start(cluster.port)).collect();
    let mut fleet = Fleet {
        cluster,
        crontab,
        lock: unique_lock(),
        proxies,
        replicas: (0..SLOTS).map(|_| None).collect(),
        skews: vec![None, Some("+30s".into()), None, Some("-25s".into())],
        journal,
        log: vec![format!("seed {seed}, {rounds} rounds")],
    };
    for slot in 0..SLOTS {
        fleet.spawn(slot);
    }
    fleet.wait_for_every_job(0, seed, WAIT);

    for round in 0..rounds {
        let target = rng.usize(..SLOTS);
        let fault = FAULTS[rng.usize(..FAULTS.len())];
        fleet
            .log
            .push(format!("round {round}: {fault:?} on replica {target}"));
        match fault {
            Fault::Kill9 | Fault::Term => {
                stop_and_wait(
                    &mut fleet.replicas[target],
                    kill_or_term(matches!(fault, Fault::Kill9)),
                );
                fleet.spawn(target);
            }
            Fault::Terminate => {
                // The session the replica last said it joined with may be gone already (an
                // earlier fault; it is joining again): then this fault ends nothing.
                if let Some(id) = fleet.holder_of(target) {
                    fleet.cluster.terminate_backend_if_there(id);
                }
            }
            Fault::Freeze => fleet.proxies[target].freeze(),
            Fault::Restart => {
                fleet.cluster.stop();
                std::thread::sleep(Duration::from_millis(rng.u64(200..1000)));
                fleet.cluster.start();
            }
            Fault::Skew => {
                let offset = format!(
                    "{}{}s",
                    if rng.bool() { "+" } else { "-" },
                    rng.u32(20..=40)
                );
                fleet.log.push(format!("  clock {offset}"));
                stop_and_wait(&mut fleet.replicas[target], Signal::SIGTERM);
                fleet.skews[target] = Some(offset);
                fleet.spawn(target);
            }
        }
        // Every job runs again: elsewhere while a replica is frozen (after the lease).
        let mark = fleet.journal.lines().len();
        fleet.wait_for_every_job(mark, seed, WAIT);
        if matches!(fault, Fault::Freeze) {
            fleet.proxies[target].thaw();
        }
        // The experiment's own pace between faults, not a synchronisation.
        std::thread::sleep(Duration::from_millis(rng.u64(200..800)));
    }
    let mark = fleet.journal.lines().len();
    fleet.wait_for_every_job(mark, seed, WAIT);
    for slot in 0..SLOTS {
        stop_and_wait(&mut fleet.replicas[slot], Signal::SIGTERM);
    }

    let runs = fleet.runs();
    let twice: Vec<_> = runs.iter().filter(|(_, slots)| slots.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "seed {seed}: these occurrences ran more than once: {twice:?}\n{}",
        fleet.report()
    );
    eprintln!(
        "cron nemesis: seed {seed}, {rounds} rounds, {} runs of {JOBS} jobs, none twice",
        runs.len()
    );
}
