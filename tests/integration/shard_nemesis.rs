//! The nemesis with shards: 3 to 5 replicas run `--shards 8` and come and go while the test
//! injects a random sequence of faults (kill -9, SIGTERM, a replica leaving or joining,
//! pg_terminate_backend of a replica's holder session, a frozen proxy, a server restart; on
//! Redis, `CLIENT KILL` of the holder's connection instead, and also `DEL` of a shard's or a
//! member's key and the server frozen by SIGSTOP).
//! Every shard's command takes an exclusive `flock` on a file of its shard's for its whole
//! life (the kernel lets go of it only when the process is gone, kill -9 included) and reports
//! whether it found it taken: no two runs of one shard may overlap. Every shard runs again
//! after each fault, and once the faults stop the fleet is balanced.
//!
//! Seeded: the seed is printed on failure and can be replayed with PGLEADER_NEMESIS_SEED; the
//! rounds are PGLEADER_NEMESIS_ROUNDS (20 by default).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::harness::nemesis::{
    Mortal, announce_and_wait, collect_seen, kill_or_term, monotonic_ns, pgleader_run, run_child,
    seed_and_rounds, stop_and_wait,
};
use crate::harness::{Cluster, Proc, Proxy, Redis, Stream, WAIT, unique_lock};

const SHARDS: u32 = 8;

/// Not a test of its own: the command of the nemesis's replicas is this test binary,
/// re-executed to run only this function with PGLEADER_SHARD_NEMESIS set (to the directory
/// of the shards' lock files, and the replica's slot). It takes its shard's file lock, prints
/// its start and whether another run of the shard still held the lock, and waits to be
/// killed. In a normal test run it does nothing.
#[test]
fn shard_child_mode() {
    let Ok(setting) = std::env::var("PGLEADER_SHARD_NEMESIS") else {
        return;
    };
    let (dir, slot) = setting.rsplit_once(':').expect("DIR:SLOT");
    let started = monotonic_ns();
    let shard = std::env::var("PGLEADER_SHARD").unwrap_or_default();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(format!("{dir}/shard-{shard}.lock"))
        .expect("the shard's lock file");
    // SAFETY: flock on a descriptor this process owns; it lives as long as the process.
    let taken = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    } != 0;
    if taken {
        // Then wait for it, so that the run goes on as it would have.
        // SAFETY: as above.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
    }
    announce_and_wait(&format!(
        "shard-child slot={slot} shard={shard} pid={} started={started} overlap={taken}",
        std::process::id()
    ));
}

#[derive(Debug, Clone)]
struct Run {
    slot: usize,
    shard: u32,
    pid: i32,
    started: u64,
    died: Option<u64>,
    /// It found another run of its shard alive when it started.
    overlap: bool,
}

impl Mortal for Run {
    fn died_at(&mut self, at: u64) {
        self.died = Some(at);
    }
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill9,
    Term,
    Leave,
    Join,
    /// The server ends the holder's session or connection; pgleader lives on.
    Terminate,
    Freeze,
    Restart,
    /// Redis only: `DEL` of a shard's key or of a member's card under its holder.
    Delete,
    /// Redis only: the server stopped with SIGSTOP, then continued.
    FreezeServer,
}

const FAULTS: [Fault; 7] = [
    Fault::Kill9,
    Fault::Term,
    Fault::Leave,
    Fault::Join,
    Fault::Terminate,
    Fault::Freeze,
    Fault::Restart,
];

/// On Redis, drawn from besides [`FAULTS`].
const REDIS_ONLY_FAULTS: [Fault; 2] = [Fault::Delete, Fault::FreezeServer];

/// Besides the nemeses' quick checks, on PostgreSQL.
const TIMINGS: [&str; 3] = ["--wait-refresh=300ms", "--lease=2s", "--takeover-delay=0s"];

/// On Redis, besides the quick checks: the shortest lease pgleader accepts, as the single
/// lock's nemesis. Where the
/// server ends a replica's connection or deletes its keys while its pgleader lives on
/// (`CLIENT KILL`, `DEL`), the shards are free before the old commands have stopped: the
/// holder hears of a deleted key only at its next check, so the takeover delay is above
/// check-interval + check-timeout + kill-timeout.
const REDIS_TIMINGS: [&str; 2] = ["--lease=1700ms", "--takeover-delay=700ms"];

/// The server the fleet runs against.
enum Server {
    Postgres(Cluster),
    Redis(Redis),
}

struct Fleet {
    server: Server,
    /// Where the shards' lock files are.
    dir: std::path::PathBuf,
    lock: i64,
    proxies: Vec<Proxy>,
    replicas: Vec<Option<Proc>>,
    runs: Arc<Mutex<BTreeMap<i32, Run>>>,
    log: Vec<String>,
}

impl Fleet {
    fn spawn(&mut self, slot: usize) {
        let (url, timings): (String, &[&str]) = match &self.server {
            Server::Postgres(_) => (self.proxies[slot].url(), &TIMINGS),
            Server::Redis(_) => (
                format!("redis://127.0.0.1:{}", self.proxies[slot].port()),
                &REDIS_TIMINGS,
            ),
        };
        let mut command = pgleader_run(&format!("--lock-id={}", self.lock), timings);
        command
            .env("PGLEADER_DATABASE_URL", url)
            .env(
                "PGLEADER_SHARD_NEMESIS",
                format!("{}:{slot}", self.dir.display()),
            )
            .arg(format!("--shards={SHARDS}"));
        run_child(&mut command, "shard_nemesis::shard_child_mode");
        self.replicas[slot] = Some(Proc::spawn(&format!("replica {slot}"), command));
    }

    fn live(&self) -> Vec<usize> {
        (0..self.replicas.len())
            .filter(|slot| self.replicas[*slot].is_some())
            .collect()
    }

    /// Records the runs that appeared since the last call, each with a thread that notes its
    /// death.
    fn collect(&self) {
        collect_seen(
            "shard-child ",
            self.replicas.iter().flatten(),
            &self.runs,
            |pid, line| Run {
                slot: line.field("slot").parse().expect("slot"),
                shard: line.field("shard").parse().expect("shard"),
                pid,
                started: line.field("started").parse().expect("started"),
                died: None,
                overlap: line.field("overlap") == "true",
            },
        );
    }

    /// How many shards each live replica runs now.
    fn running(&self) -> BTreeMap<usize, Vec<u32>> {
        self.collect();
        let mut running: BTreeMap<usize, Vec<u32>> = self
            .live()
            .into_iter()
            .map(|slot| (slot, Vec::new()))
            .collect();
        for run in self.runs.lock().expect("runs").values() {
            if run.died.is_none()
                && let Some(shards) = running.get_mut(&run.slot)
            {
                shards.push(run.shard);
            }
        }
        running
    }

    /// Waits until every shard runs, and (with `balanced`) each live replica runs its share.
    fn wait_until(&self, balanced: bool, seed: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let running = self.running();
            let mut all: Vec<u32> = running.values().flatten().copied().collect();
            all.sort_unstable();
            let every = all == (0..SHARDS).collect::<Vec<_>>();
            let (low, high) = (
                SHARDS as usize / running.len().max(1),
                (SHARDS as usize).div_ceil(running.len().max(1)),
            );
            let even = running
                .values()
                .all(|shards| (low..=high).contains(&shards.len()));
            if every && (!balanced || even) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: not {} within {timeout:?}: {running:?}\n{}",
                if balanced {
                    "balanced"
                } else {
                    "every shard running"
                },
                self.report()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The id of a replica's holder session (PostgreSQL: its server process; Redis: its member
    /// id), from its log.
    fn holder_of(&self, slot: usize) -> Option<i32> {
        let replica = self.replicas[slot].as_ref()?;
        replica
            .lines(Stream::Stderr)
            .iter()
            .rev()
            .find(|line| line.contains("joined the replicas"))
            .and_then(|line| {
                line.split_whitespace()
                    .find_map(|word| word.strip_prefix("backend_pid="))
                    .and_then(|pid| pid.parse().ok())
            })
    }

    fn report(&self) -> String {
        let mut text = String::from("faults:\n");
        for line in &self.log {
            text.push_str(&format!("  {line}\n"));
        }
        text.push_str("runs (slot, shard, pid, started, died):\n");
        for run in self.runs.lock().expect("runs").values() {
            text.push_str(&format!(
                "  {} {} {} {} {:?}\n",
                run.slot, run.shard, run.pid, run.started, run.died
            ));
        }
        for replica in self.replicas.iter().flatten() {
            text.push_str(&replica.dump());
        }
        text
    }
}

#[test]
fn no_shard_ever_runs_twice_at_once_under_random_faults_and_the_fleet_is_balanced_after() {
    let cluster = Cluster::new("shard-nemesis");
    let dir = cluster.base.join("shard-locks");
    nemesis(Server::Postgres(cluster), dir, &FAULTS);
}

#[test]
fn on_redis_no_shard_ever_runs_twice_at_once_under_random_faults_and_the_fleet_is_balanced_after() {
    let redis = Redis::new("shard-nemesis");
    let dir = std::env::temp_dir().join(format!(
        "pgleader-redis-shard-locks-{}-{}",
        std::process::id(),
        unique_lock()
    ));
    let faults = [FAULTS.as_slice(), &REDIS_ONLY_FAULTS].concat();
    nemesis(Server::Redis(redis), dir, &faults);
}

fn nemesis(server: Server, dir: std::path::PathBuf, faults: &[Fault]) {
    let (seed, rounds, mut rng) = seed_and_rounds(20);
    let slots = 5;
    let port = match &server {
        Server::Postgres(cluster) => cluster.port,
        Server::Redis(redis) => redis.port,
    };
    let proxies: Vec<Proxy> = (0..slots).map(|_| Proxy::start(port)).collect();
    std::fs::create_dir_all(&dir).expect("the lock files' directory");
    // The children run as the user the tests run as; the cluster's directory may belong to
    // the server's own user.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let mut fleet = Fleet {
        dir,
        server,
        lock: unique_lock(),
        proxies,
        replicas: (0..slots).map(|_| None).collect(),
        runs: Arc::new(Mutex::new(BTreeMap::new())),
        log: vec![format!("seed {seed}, {rounds} rounds")],
    };
    for slot in 0..rng.usize(3..=5) {
        fleet.spawn(slot);
    }
    fleet.wait_until(true, seed, WAIT);

    for round in 0..rounds {
        let live = fleet.live();
        let target = live[rng.usize(..live.len())];
        let fault = faults[rng.usize(..faults.len())];
        fleet.log.push(format!(
            "round {round}: {fault:?} on replica {target} of {live:?}"
        ));
        match fault {
            Fault::Kill9 | Fault::Term => {
                let signal = kill_or_term(matches!(fault, Fault::Kill9));
                stop_and_wait(&mut fleet.replicas[target], signal);
                fleet.spawn(target);
            }
            Fault::Leave if live.len() > 3 => {
                stop_and_wait(&mut fleet.replicas[target], Signal::SIGTERM);
            }
            Fault::Join | Fault::Leave => {
                if let Some(free) = (0..slots).find(|slot| fleet.replicas[*slot].is_none()) {
                    fleet.spawn(free);
                }
            }
            Fault::Terminate => {
                if let Some(id) = fleet.holder_of(target) {
                    match &fleet.server {
                        Server::Postgres(cluster) => cluster.terminate_backend(id),
                        Server::Redis(redis) => {
                            let card = redis.try_cli(&[
                                "GET",
                                &format!("pgleader:{{{}}}:member:{id}", fleet.lock),
                            ]);
                            let client = card.as_deref().ok().and_then(|card| {
                                card.split(' ')
                                    .find_map(|word| word.strip_prefix("client="))
                            });
                            if let Some(client) = client {
                                let answer = redis.try_cli(&["CLIENT", "KILL", "ID", client]);
                                fleet
                                    .log
                                    .push(format!("  CLIENT KILL {client}: {answer:?}"));
                            }
                        }
                    }
                }
            }
            Fault::Freeze => fleet.proxies[target].freeze(),
            Fault::Restart => {
                match &fleet.server {
                    Server::Postgres(cluster) => cluster.stop(),
                    Server::Redis(redis) => redis.crash(),
                }
                std::thread::sleep(Duration::from_millis(rng.u64(200..1000)));
                match &fleet.server {
                    Server::Postgres(cluster) => cluster.start(),
                    Server::Redis(redis) => redis.start(),
                }
            }
            Fault::Delete => {
                if let Server::Redis(redis) = &fleet.server {
                    let key = match (rng.bool(), fleet.holder_of(target)) {
                        (true, Some(id)) => format!("pgleader:{{{}}}:member:{id}", fleet.lock),
                        _ => format!("pgleader:{{{}}}:shard:{}", fleet.lock, rng.u32(..SHARDS)),
                    };
                    let answer = redis.try_cli(&["DEL", &key]);
                    fleet.log.push(format!("  DEL {key}: {answer:?}"));
                }
            }
            Fault::FreezeServer => {
                if let Server::Redis(redis) = &fleet.server {
                    // Above check-interval + check-timeout (every replica loses), sometimes
                    // above the lease (the keys expire while the server is stopped).
                    let length = Duration::from_millis(rng.u64(700..3000));
                    fleet.log.push(format!("  frozen for {length:?}"));
                    redis.freeze(true);
                    std::thread::sleep(length);
                    redis.freeze(false);
                }
            }
        }
        // Frozen, a replica stops its commands at its deadline and the server frees its
        // shards after the lease; restarted, the restart fence holds every start back.
        fleet.wait_until(false, seed, WAIT);
        if matches!(fault, Fault::Freeze) {
            fleet.proxies[target].thaw();
        }
        // The experiment's own pace between faults, not a synchronisation.
        std::thread::sleep(Duration::from_millis(rng.u64(200..800)));
    }
    fleet.wait_until(true, seed, WAIT);

    fleet.collect();
    let report = fleet.report();
    let runs: Vec<Run> = fleet.runs.lock().expect("runs").values().cloned().collect();
    let overlaps: Vec<String> = runs
        .iter()
        .filter(|run| run.overlap)
        .map(|run| {
            format!(
                "shard {} on replica {} (pid {})",
                run.shard, run.slot, run.pid
            )
        })
        .collect();
    assert!(
        overlaps.is_empty(),
        "seed {seed}: these commands started while another run of their shard was alive: {overlaps:?}\n{report}"
    );
    eprintln!(
        "shard nemesis: seed {seed}, {rounds} rounds, {} runs of {SHARDS} shards, none overlapped",
        runs.len()
    );
    // Kept after a failure, for a look at what the runs left.
    let _ = std::fs::remove_dir_all(&fleet.dir);
}
