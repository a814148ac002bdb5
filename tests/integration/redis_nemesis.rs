//! The Redis nemesis: three pgleaders compete for one key on one `redis-server` (two of them
//! through proxies that can freeze traffic) while the test injects a seeded random sequence of
//! the faults Redis can suffer: kill -9 and SIGTERM of a pgleader, `CLIENT KILL` of the leader's
//! connection, `DEL` and `FLUSHALL` of the key, the server frozen by SIGSTOP and by
//! `DEBUG SLEEP`, a restart that kept nothing, and a partition of the leader (its proxy stops
//! forwarding), healed after a new leader runs or, briefly, before its key expires.
//!
//! Every command records its start on the monotonic clock; the test records its death. No two
//! run intervals may overlap, fencing tokens must grow from each run to the next, and a new
//! leader must appear after every fault that removed the old one.
//!
//! Where the server ends a session whose pgleader lives on (CLIENT KILL, DEL, FLUSHALL, a
//! restart), the lock is free before the old command has stopped: --takeover-delay, above the
//! kill timeout, is what keeps those apart, so the nemesis sets it. Half the commands ignore
//! SIGTERM, so that stopping them takes the whole kill timeout. A frozen proxy does not make the
//! server drop the leader's connection (the proxy's kernel still holds it open), so nothing but
//! the key's TTL (--lease) frees the lock: the partitioned leader must have stopped its command
//! before then on its own clock. That is exactly what the partition fault checks.
//!
//! Seeded: the seed is printed on failure and can be replayed with PGLEADER_NEMESIS_SEED (the
//! same faults in the same order; the machine's timing differs). The number of rounds is
//! PGLEADER_NEMESIS_ROUNDS (12 by default: the first ten are every fault once, in a seeded
//! order). PGLEADER_NEMESIS_FAULTS=Partition,Del (the names below) draws from those only.

use std::process::Command;
use std::time::Duration;

use crate::harness::nemesis::{
    Chronicle, announce_run_and_wait, faults_to_draw, kill_or_term, monotonic_ns, pgleader_run,
    seed_and_rounds,
};
use crate::harness::{Proxy, Redis, WAIT, unique_lock};

/// Not a test of its own: the command the nemesis's pgleaders run is this test binary,
/// re-executed to run only this function with PGLEADER_REDIS_NEMESIS_SLOT set. It prints its
/// start (with the monotonic time, the session's client id and the fencing token), ignores
/// SIGTERM if PGLEADER_REDIS_NEMESIS_STUBBORN=1 (so only the SIGKILL after --kill-timeout ends
/// it), and waits to be killed. In a normal test run it does nothing.
#[test]
fn child_mode() {
    let Ok(slot) = std::env::var("PGLEADER_REDIS_NEMESIS_SLOT") else {
        return;
    };
    let stubborn = std::env::var("PGLEADER_REDIS_NEMESIS_STUBBORN").is_ok_and(|v| v == "1");
    if stubborn {
        // SAFETY: SIG_IGN is a valid disposition for SIGTERM; no handler code runs.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    }
    announce_run_and_wait(CHILD, &slot, &format!(" stubborn={stubborn}"));
}

/// How the child's line starts (the quorum nemesis runs the same child).
pub(crate) const CHILD: &str = "redis-nemesis-child ";

/// Starts instance `slot` of a Redis nemesis (this one's or the quorum's): its pgleader's
/// `command`, which runs [`child_mode`], SIGTERM ignored if `stubborn`.
pub(crate) fn start_child(
    chronicle: &mut Chronicle,
    slot: usize,
    stubborn: bool,
    mut command: Command,
) {
    command
        .env("PGLEADER_REDIS_NEMESIS_SLOT", slot.to_string())
        .env(
            "PGLEADER_REDIS_NEMESIS_STUBBORN",
            if stubborn { "1" } else { "0" },
        );
    chronicle.start(slot, command, "redis_nemesis::child_mode");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// kill -9 of a pgleader (mostly the leader's).
    Kill9,
    /// SIGTERM of a pgleader (mostly the leader's): a graceful handover.
    Term,
    /// `CLIENT KILL ID` of the leader's connection: the server ends it, pgleader lives on.
    ClientKill,
    /// `DEL` of the key under the leader.
    Del,
    /// `FLUSHALL`: the key, the wake lists, everything.
    FlushAll,
    /// The server stopped with SIGSTOP, then continued.
    Sigstop,
    /// The server busy in `DEBUG SLEEP`: it answers nothing, yet its sockets look alive.
    DebugSleep,
    /// The server killed and started again, empty (no RDB, no AOF).
    Restart,
    /// The leader's proxy stops forwarding (a follower's, when the leader has none) until a
    /// new leader runs.
    Partition,
    /// The leader's proxy stops forwarding for less than the lease, long enough for the leader
    /// to give up: its renewals, held in the proxy, reach the server after it has stopped its
    /// command, while its key still lives.
    BriefPartition,
}

const FAULTS: [Fault; 10] = [
    Fault::Kill9,
    Fault::Term,
    Fault::ClientKill,
    Fault::Del,
    Fault::FlushAll,
    Fault::Sigstop,
    Fault::DebugSleep,
    Fault::Restart,
    Fault::Partition,
    Fault::BriefPartition,
];

/// How many pgleaders compete; slot 0 talks to the server directly, the others through proxies.
const INSTANCES: usize = 3;

/// Besides the nemeses' quick checks: the lease is the shortest pgleader accepts
/// (check-interval + check-timeout + kill-timeout + 1 s, plus 1 % for a fast server clock:
/// 1616 ms), so a partitioned leader has no more slack than the documented rule gives it. The
/// takeover delay is above the kill timeout.
const TIMINGS: [&str; 2] = ["--lease=1700ms", "--takeover-delay=500ms"];

/// How long a server freeze lasts: always well above check-interval + check-timeout (so the
/// leader surely loses), sometimes below the lease (the key survives the freeze), sometimes
/// above it (the key expires while the server is stopped).
fn freeze_for(rng: &mut fastrand::Rng) -> Duration {
    Duration::from_millis(rng.u64(700..3000))
}

struct Nemesis {
    redis: Redis,
    lock: String,
    /// `proxies[slot]` is the proxy of that instance, if it has one.
    proxies: Vec<Option<Proxy>>,
    chronicle: Chronicle,
    /// (stopped, answering again) monotonic times of the server's downtimes and freezes.
    downtime: Vec<(u64, u64)>,
}

impl Nemesis {
    fn url(&self, slot: usize) -> String {
        match &self.proxies[slot] {
            Some(proxy) => format!("redis://127.0.0.1:{}", proxy.port()),
            None => self.redis.url(),
        }
    }

    fn key(&self) -> String {
        format!("pgleader:{{{}}}", self.lock)
    }

    fn spawn(&mut self, slot: usize, stubborn: bool) {
        let mut command = pgleader_run(&format!("--lock={}", self.lock), &TIMINGS);
        command.env("PGLEADER_DATABASE_URL", self.url(slot));
        start_child(&mut self.chronicle, slot, stubborn, command);
    }
}

#[test]
fn no_two_commands_ever_run_at_once_under_random_redis_faults() {
    let (seed, rounds, mut rng) = seed_and_rounds(12);
    let faults = faults_to_draw(&FAULTS);
    // Every fault once, in a seeded order, then any.
    let mut plan = faults.clone();
    rng.shuffle(&mut plan);
    let redis = Redis::new("nemesis");
    let proxies = (0..INSTANCES)
        .map(|slot| (slot > 0).then(|| Proxy::start(redis.port)))
        .collect();
    let mut nemesis = Nemesis {
        lock: format!("nemesis-{}", unique_lock()),
        redis,
        proxies,
        downtime: Vec::new(),
        chronicle: Chronicle::new(
            seed,
            format!(
                "seed {seed}, {INSTANCES} instances (1 and 2 through proxies), {rounds} rounds"
            ),
            INSTANCES,
            CHILD,
            WAIT,
        ),
    };
    let began = monotonic_ns();
    for slot in 0..INSTANCES {
        let stubborn = rng.bool();
        nemesis.spawn(slot, stubborn);
    }
    nemesis.chronicle.wait_for_new_run(0);

    for round in 0..rounds {
        let fault = plan
            .get(round)
            .copied()
            .unwrap_or_else(|| faults[rng.usize(..faults.len())]);
        let leader = nemesis.chronicle.leader();
        let behind_proxy = nemesis.proxies[leader.slot].is_some();
        // Mostly the leader; now and then a follower, for kill -9 and SIGTERM; a follower's
        // proxy when the leader has none.
        let target = match fault {
            Fault::Kill9 | Fault::Term if rng.u8(..5) == 0 => rng.usize(..INSTANCES),
            Fault::Partition | Fault::BriefPartition if !behind_proxy => rng.usize(1..INSTANCES),
            _ => leader.slot,
        };
        let server_wide = matches!(fault, Fault::Sigstop | Fault::DebugSleep | Fault::Restart);
        let hits_leader = server_wide || target == leader.slot;
        nemesis.chronicle.note(format!(
            "round {round}: {fault:?} on instance {target} (leader {}, client {}, epoch {})",
            leader.slot, leader.backend, leader.epoch
        ));
        let known = nemesis.chronicle.collect();
        match fault {
            Fault::Kill9 | Fault::Term => {
                nemesis
                    .chronicle
                    .stop(target, kill_or_term(fault == Fault::Kill9));
                let stubborn = rng.bool();
                nemesis.spawn(target, stubborn);
            }
            Fault::ClientKill => {
                let answer = nemesis
                    .redis
                    .try_cli(&["CLIENT", "KILL", "ID", &leader.backend]);
                nemesis.chronicle.note(format!("  CLIENT KILL: {answer:?}"));
            }
            Fault::Del => {
                let answer = nemesis.redis.try_cli(&["DEL", &nemesis.key()]);
                nemesis.chronicle.note(format!("  DEL: {answer:?}"));
            }
            Fault::FlushAll => {
                let answer = nemesis.redis.try_cli(&["FLUSHALL"]);
                nemesis.chronicle.note(format!("  FLUSHALL: {answer:?}"));
            }
            Fault::Sigstop => {
                let length = freeze_for(&mut rng);
                nemesis.chronicle.note(format!("  stopped for {length:?}"));
                let stopped = monotonic_ns();
                nemesis.redis.freeze(true);
                nemesis.chronicle.pause(length);
                nemesis.redis.freeze(false);
                nemesis.downtime.push((stopped, monotonic_ns()));
            }
            Fault::DebugSleep => {
                let length = freeze_for(&mut rng);
                nemesis.chronicle.note(format!("  DEBUG SLEEP {length:?}"));
                let stopped = monotonic_ns();
                nemesis.chronicle.debug_sleep(&nemesis.redis, length);
                nemesis.downtime.push((stopped, monotonic_ns()));
            }
            Fault::Restart => {
                let length = Duration::from_millis(rng.u64(200..1500));
                nemesis.chronicle.note(format!("  down for {length:?}"));
                let stopped = monotonic_ns();
                nemesis.redis.crash();
                nemesis.chronicle.pause(length);
                nemesis.redis.start();
                nemesis.downtime.push((stopped, monotonic_ns()));
            }
            Fault::Partition => {
                nemesis.proxies[target]
                    .as_ref()
                    .expect("a proxied instance")
                    .freeze();
            }
            Fault::BriefPartition => {
                // Above check-interval + check-timeout, below the lease.
                let length = Duration::from_millis(rng.u64(600..1500));
                nemesis.chronicle.note(format!("  cut off for {length:?}"));
                let proxy = nemesis.proxies[target]
                    .as_ref()
                    .expect("a proxied instance");
                proxy.freeze();
                nemesis.chronicle.pause(length);
                proxy.thaw();
            }
        }
        if hits_leader {
            let next = nemesis.chronicle.wait_for_new_run(known);
            nemesis
                .chronicle
                .note(format!("  new leader: {}", next.as_leader()));
        }
        // Let the leader run a while: the experiment's own pace, not a synchronisation. A
        // partitioned follower stays cut off meanwhile, and its stale commands arrive after.
        nemesis
            .chronicle
            .pause(Duration::from_millis(rng.u64(500..1500)));
        if fault == Fault::Partition {
            nemesis.proxies[target]
                .as_ref()
                .expect("a proxied instance")
                .thaw();
        }
    }

    let (runs, share, _) = nemesis.chronicle.conclude(began, &nemesis.downtime);
    eprintln!("{}", nemesis.chronicle.log.join("\n"));
    eprintln!(
        "redis nemesis: seed {seed}, {rounds} rounds, {} runs, a command ran {:.0}% of the time the server answered",
        runs.len(),
        share * 100.0
    );
}
