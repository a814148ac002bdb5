//! The quorum nemesis: three pgleaders elect over three (or five) independent `redis-server`s
//! with Redlock, each pgleader reaching each server either directly or through a proxy of its
//! own that can freeze traffic, while the test injects a seeded random sequence of faults: kill -9
//! and SIGTERM of a pgleader, `CLIENT KILL` of a pgleader's connections on some servers, `DEL`
//! and `FLUSHALL` of the key on one server, one server killed and restarted empty, one server
//! frozen by SIGSTOP or by `DEBUG SLEEP`, a pgleader cut by its frozen proxies from enough
//! servers to lose its majority, and rounds where a majority of the servers is lost (killed, or
//! stopped) for a while, and a pgleader's wall clock jumped forwards or backwards by up to two
//! hours (every pgleader runs under libfaketime, its monotonic clock left alone, as a wall-clock
//! step by NTP or a resumed VM leaves it).
//!
//! The commands are the Redis nemesis's (`redis_nemesis::child_mode`): each records its start on
//! the monotonic clock and its fencing token; the test records its death. No two run intervals
//! may overlap, and the fencing token must grow from each run to the next. After every fault
//! that removed the leader while a majority of the servers could vote, a new leader's command
//! must run within [`NEW_LEADER`]; at the start of every round some command must run within the
//! same bound. In a majority-lost round the leader's command must stop within [`STOP`] and no
//! command may start until the majority is back.
//!
//! At most one server is down, frozen or restarted at a time, except in the majority-lost rounds:
//! a server restarted less than a lease ago refuses its vote (the delayed restart), so before the
//! test hits a server it waits until every other server votes again. Where the servers end the
//! session of a pgleader that lives on (`CLIENT KILL`, `DEL`, `FLUSHALL`, a restart), the lock is
//! free before the old command has stopped: --takeover-delay, above the kill timeout, keeps those
//! apart, as in the Redis nemesis. Half the commands ignore SIGTERM.
//!
//! Seeded: the seed is printed at the start and on failure, and PGLEADER_NEMESIS_SEED replays it
//! (the same faults in the same order; the machine's timing differs). PGLEADER_NEMESIS_ROUNDS
//! sets the number of rounds (by default every fault once over three servers, and six rounds
//! over five), and PGLEADER_NEMESIS_FAULTS=Partition,MajorityLost draws from those only.

use std::time::Duration;

use crate::harness::nemesis::{
    Chronicle, Run, assert_one_at_a_time, faults_to_draw, kill_or_term, monotonic_ns, pgleader_run,
    seed_and_rounds,
};
use crate::harness::{Proxy, Redis, WAIT, unique_lock};
use crate::quorum::wait_older_than;
use crate::redis_nemesis::start_child;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// kill -9 of a pgleader (mostly the leader's).
    Kill9,
    /// SIGTERM of a pgleader (mostly the leader's): a graceful handover.
    Term,
    /// `CLIENT KILL` of a pgleader's connections (mostly the leader's) on one or more servers.
    ClientKill,
    /// `DEL` of the key on one server.
    Del,
    /// `FLUSHALL` on one server: the key, the epoch counter, the wake lists, everything.
    FlushAll,
    /// One server killed and started again, empty (no RDB, no AOF): it refuses its vote for a
    /// lease.
    Restart,
    /// One server stopped with SIGSTOP, then continued.
    Sigstop,
    /// One server busy in `DEBUG SLEEP`: it answers nothing, yet its sockets look alive.
    DebugSleep,
    /// A pgleader (mostly the leader) cut from enough servers to lose its majority by freezing
    /// its proxies to them (no FIN, no RST: its connections stay open on the servers, so only
    /// the keys' TTL frees them), until a new leader runs.
    Partition,
    /// A majority of the servers killed (and restarted empty) or stopped (and continued): the
    /// leader's command must stop and no other may start until the majority is back.
    MajorityLost,
    /// A pgleader's (mostly the leader's) wall clock jumps, forwards or backwards.
    ClockJump,
}

const FAULTS: [Fault; 11] = [
    Fault::Kill9,
    Fault::Term,
    Fault::ClientKill,
    Fault::Del,
    Fault::FlushAll,
    Fault::Restart,
    Fault::Sigstop,
    Fault::DebugSleep,
    Fault::Partition,
    Fault::MajorityLost,
    Fault::ClockJump,
];

/// libfaketime, which moves each pgleader's wall clock by the offset in a file of its own.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// How many pgleaders compete. Instance `s` reaches server `s` directly and every other server
/// through a proxy of its own, so that each can be cut from a majority.
const INSTANCES: usize = 3;

/// As in the Redis nemesis, besides the quick checks: the shortest lease pgleader accepts for
/// them (1616 ms), and a takeover delay above the kill timeout.
const TIMINGS: [&str; 2] = ["--lease=1700ms", "--takeover-delay=500ms"];
const LEASE: Duration = Duration::from_millis(1700);

/// How soon the leader's command must be gone once the majority is lost: check-interval +
/// check-timeout + kill-timeout (600 ms), with room for a loaded machine, and still below the
/// time a cut-off leader's keys take to expire elsewhere (the lease) plus the takeover delay.
const STOP: Duration = Duration::from_millis(2_000);

/// How soon a new leader's command must run after a fault that removed the old one, counted from
/// when a majority can vote again: the lease (a cut-off leader's keys expire), a restarted
/// server's refusal (a lease, in whole seconds of its uptime), the reconnection backoff's cap
/// (2 s) and the takeover delay, with room for a loaded machine.
const NEW_LEADER: Duration = Duration::from_secs(10);

/// How long a server freeze lasts: above check-interval + check-timeout, sometimes below the
/// lease (the key survives it), sometimes above (the key expires while the server is stopped).
fn freeze_for(rng: &mut fastrand::Rng) -> Duration {
    Duration::from_millis(rng.u64(700..3000))
}

struct Nemesis {
    servers: Vec<Redis>,
    lock: String,
    /// `proxies[slot][server]`: that instance's proxy to that server, if it has one.
    proxies: Vec<Vec<Option<Proxy>>>,
    /// `clocks[slot]`: the file that holds that instance's wall-clock offset.
    clocks: Vec<std::path::PathBuf>,
    chronicle: Chronicle,
}

impl Nemesis {
    fn quorum(&self) -> usize {
        self.servers.len() / 2 + 1
    }

    /// How many servers an instance must lose to lose its majority.
    fn to_lose(&self) -> usize {
        self.servers.len() - self.quorum() + 1
    }

    fn url(&self, slot: usize, server: usize) -> String {
        match &self.proxies[slot][server] {
            Some(proxy) => format!("redis://127.0.0.1:{}", proxy.port()),
            None => self.servers[server].url(),
        }
    }

    fn key(&self) -> String {
        format!("pgleader:{{{}}}", self.lock)
    }

    fn spawn(&mut self, slot: usize, stubborn: bool) {
        let mut command = pgleader_run(&format!("--lock={}", self.lock), &TIMINGS);
        command
            .env("LD_PRELOAD", FAKETIME)
            .env("FAKETIME_TIMESTAMP_FILE", &self.clocks[slot])
            .env("FAKETIME_NO_CACHE", "1")
            .env("DONT_FAKE_MONOTONIC", "1");
        for server in 0..self.servers.len() {
            command.args(["-d", &self.url(slot, server)]);
        }
        // The Redis nemesis' child: it prints what the runs are collected from.
        start_child(&mut self.chronicle, slot, stubborn, command);
    }

    /// Whether a server votes: up for more than the lease (by the uptime the acquire script
    /// reads). A stopped or dead server does not.
    fn votes(&self, server: usize) -> bool {
        self.servers[server]
            .try_cli(&["INFO", "server"])
            .ok()
            .and_then(|info| {
                info.lines().find_map(|line| {
                    line.trim()
                        .strip_prefix("uptime_in_seconds:")?
                        .parse::<u64>()
                        .ok()
                })
            })
            .is_some_and(|uptime| Duration::from_secs(uptime) > LEASE)
    }

    /// Waits until every server but `except` votes, so that hitting `except` leaves a majority
    /// (at most one server of three down or restarted at a time).
    fn settle(&self, except: &[usize]) {
        let others: Vec<usize> = (0..self.servers.len())
            .filter(|server| !except.contains(server))
            .collect();
        self.chronicle
            .collect_until("the other servers' votes", WAIT, || {
                others.iter().all(|server| self.votes(*server))
            });
    }

    /// `CLIENT KILL` of every connection of the pgleader with this pid on this server (they
    /// are named `<label>:<pid>@<host>`); how many were killed.
    fn client_kill(&self, server: usize, pid: i32) -> usize {
        let Ok(list) = self.servers[server].try_cli(&["CLIENT", "LIST"]) else {
            return 0;
        };
        let needle = format!(":{pid}@");
        let ids: Vec<String> = list
            .lines()
            .filter(|line| {
                line.split_whitespace()
                    .any(|field| field.starts_with("name=") && field.contains(&needle))
            })
            .filter_map(|line| {
                line.split_whitespace()
                    .find_map(|field| field.strip_prefix("id="))
                    .map(str::to_owned)
            })
            .collect();
        ids.iter()
            .filter(|id| {
                self.servers[server]
                    .try_cli(&["CLIENT", "KILL", "ID", id])
                    .is_ok()
            })
            .count()
    }

    fn instance_pid(&self, slot: usize) -> i32 {
        self.chronicle.instances.live[slot]
            .as_ref()
            .expect("a running instance")
            .pid
            .as_raw()
    }
}

/// Up to `n` distinct items of `from`, in a seeded order.
fn pick(rng: &mut fastrand::Rng, from: &[usize], n: usize) -> Vec<usize> {
    let mut from = from.to_vec();
    rng.shuffle(&mut from);
    from.truncate(n);
    from.sort_unstable();
    from
}

fn nemesis(server_count: usize, default_rounds: usize) {
    let (seed, rounds, mut rng) = seed_and_rounds(default_rounds);
    eprintln!(
        "quorum nemesis over {server_count} servers: seed {seed} (PGLEADER_NEMESIS_SEED={seed} replays it), {rounds} rounds"
    );
    assert!(
        std::path::Path::new(FAKETIME).is_file(),
        "{FAKETIME} is missing: the quorum nemesis jumps pgleaders' wall clocks with libfaketime \
         (apt-get install faketime)"
    );
    let faults = faults_to_draw(&FAULTS);
    // Every fault once, in a seeded order, then any.
    let mut plan = faults.clone();
    rng.shuffle(&mut plan);

    let servers: Vec<Redis> = (0..server_count)
        .map(|i| Redis::new(&format!("quorum-nemesis-{i}")))
        .collect();
    let proxies = (0..INSTANCES)
        .map(|slot| {
            servers
                .iter()
                .enumerate()
                .map(|(server, redis)| (server != slot).then(|| Proxy::start(redis.port)))
                .collect()
        })
        .collect();
    let lock = format!("quorum-nemesis-{}", unique_lock());
    let clocks: Vec<std::path::PathBuf> = (0..INSTANCES)
        .map(|slot| {
            let clock = std::env::temp_dir().join(format!("pgleader-clock-{lock}-{slot}"));
            std::fs::write(&clock, "+0\n").expect("write a clock file");
            clock
        })
        .collect();
    let mut nemesis = Nemesis {
        clocks,
        lock,
        servers,
        proxies,
        chronicle: Chronicle::new(
            seed,
            format!(
                "seed {seed}, {INSTANCES} instances over {server_count} servers (instance s reaches \
             server s directly, the others through its proxies), {rounds} rounds"
            ),
            INSTANCES,
            crate::redis_nemesis::CHILD,
            // Long enough for a majority to come back and a lease to pass.
            NEW_LEADER,
        ),
    };
    let all: Vec<usize> = (0..server_count).collect();
    // A server younger than the lease refuses its vote: the first leader needs old servers.
    for redis in &nemesis.servers {
        wait_older_than(redis, LEASE);
    }
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
        // Mostly the leader; now and then a follower.
        let target = match fault {
            Fault::Kill9
            | Fault::Term
            | Fault::ClientKill
            | Fault::Partition
            | Fault::ClockJump
                if rng.u8(..5) == 0 =>
            {
                rng.usize(..INSTANCES)
            }
            _ => leader.slot,
        };
        let server = rng.usize(..server_count);
        nemesis.chronicle.note(format!(
            "round {round}: {fault:?} (leader: instance {}, client {}, epoch {})",
            leader.slot, leader.backend, leader.epoch
        ));
        let known = nemesis.chronicle.collect();
        // Whether the fault surely ends the leader's leadership (it may end it in other rounds
        // too, when an earlier fault left it with a bare majority: that is allowed).
        let mut hits_leader = false;
        // Proxies to thaw once a new leader runs.
        let mut frozen: Vec<(usize, usize)> = Vec::new();
        match fault {
            Fault::Kill9 | Fault::Term => {
                let signal = kill_or_term(fault == Fault::Kill9);
                nemesis.chronicle.note(format!("  on instance {target}"));
                nemesis.chronicle.stop(target, signal);
                let stubborn = rng.bool();
                nemesis.spawn(target, stubborn);
                hits_leader = target == leader.slot;
            }
            Fault::ClientKill => {
                let count = rng.usize(1..=server_count);
                let on = pick(&mut rng, &all, count);
                let pid = nemesis.instance_pid(target);
                let killed: Vec<usize> = on
                    .iter()
                    .map(|server| nemesis.client_kill(*server, pid))
                    .collect();
                nemesis.chronicle.note(format!(
                    "  instance {target}'s connections on servers {on:?}: {killed:?} killed"
                ));
                // Not surely a loss even when a majority of its connections is killed: a leader
                // connects again and sets its key again where it is still its own, and may do so
                // before the last kill lands. Either way is fine; the next round's start checks
                // that someone leads.
            }
            Fault::Del => {
                let answer = nemesis.servers[server].try_cli(&["DEL", &nemesis.key()]);
                nemesis
                    .chronicle
                    .note(format!("  DEL on server {server}: {answer:?}"));
            }
            Fault::FlushAll => {
                let answer = nemesis.servers[server].try_cli(&["FLUSHALL"]);
                nemesis
                    .chronicle
                    .note(format!("  FLUSHALL on server {server}: {answer:?}"));
            }
            Fault::Restart => {
                nemesis.settle(&[server]);
                let length = Duration::from_millis(rng.u64(200..1500));
                nemesis
                    .chronicle
                    .note(format!("  server {server} down for {length:?}"));
                nemesis.servers[server].crash();
                nemesis.chronicle.pause(length);
                let redis = &nemesis.servers[server];
                nemesis.chronicle.during(|| redis.start());
            }
            // A server frozen, stopped by SIGSTOP or busy in DEBUG SLEEP.
            Fault::Sigstop | Fault::DebugSleep => {
                nemesis.settle(&[server]);
                let length = freeze_for(&mut rng);
                let redis = &nemesis.servers[server];
                if fault == Fault::Sigstop {
                    let stopped = format!("  server {server} stopped for {length:?}");
                    nemesis.chronicle.note(stopped);
                    redis.freeze(true);
                    nemesis.chronicle.pause(length);
                    redis.freeze(false);
                } else {
                    let slept = format!("  DEBUG SLEEP {length:?} on server {server}");
                    nemesis.chronicle.note(slept);
                    nemesis.chronicle.debug_sleep(redis, length);
                }
            }
            Fault::Partition => {
                let proxied: Vec<usize> = all.iter().copied().filter(|s| *s != target).collect();
                let cut = pick(&mut rng, &proxied, nemesis.to_lose());
                nemesis
                    .chronicle
                    .note(format!("  instance {target} cut from servers {cut:?}"));
                for server in &cut {
                    nemesis.proxies[target][*server]
                        .as_ref()
                        .expect("a proxy")
                        .freeze();
                    frozen.push((target, *server));
                }
                hits_leader = target == leader.slot;
            }
            Fault::ClockJump => {
                // Minutes, up to two hours, either way: far beyond the lease and the checks.
                let minutes = rng.i64(1..=120) * if rng.bool() { 1 } else { -1 };
                nemesis.chronicle.note(format!(
                    "  instance {target}'s wall clock set {minutes:+} min from the real one"
                ));
                std::fs::write(&nemesis.clocks[target], format!("{minutes:+}m\n"))
                    .expect("jump the clock");
            }
            Fault::MajorityLost => {
                nemesis.settle(&[]);
                let lost = pick(&mut rng, &all, nemesis.to_lose());
                let crash = rng.bool();
                let length = Duration::from_millis(rng.u64(300..1500));
                nemesis.chronicle.note(format!(
                    "  servers {lost:?} {} ({length:?} after the command's end)",
                    if crash { "killed" } else { "stopped" }
                ));
                let lost_at = monotonic_ns();
                for server in &lost {
                    if crash {
                        nemesis.servers[*server].crash();
                    } else {
                        nemesis.servers[*server].freeze(true);
                    }
                }
                let pid = leader.pid;
                nemesis.chronicle.collect_until(
                    "the end of the leader's command once the majority was lost",
                    STOP,
                    || {
                        nemesis
                            .chronicle
                            .runs
                            .lock()
                            .expect("runs")
                            .get(&pid)
                            .is_some_and(|run| run.died.is_some())
                    },
                );
                nemesis.chronicle.pause(length);
                let started: Vec<Run> = nemesis
                    .chronicle
                    .runs
                    .lock()
                    .expect("runs")
                    .values()
                    .filter(|run| run.started > lost_at)
                    .cloned()
                    .collect();
                assert!(
                    started.is_empty(),
                    "seed {seed}: a command started without a majority: {started:?}\n{}",
                    nemesis.chronicle.report()
                );
                for server in &lost {
                    if crash {
                        let redis = &nemesis.servers[*server];
                        nemesis.chronicle.during(|| redis.start());
                    } else {
                        nemesis.servers[*server].freeze(false);
                    }
                }
                hits_leader = true;
            }
        }
        if hits_leader {
            let next = nemesis.chronicle.wait_for_new_run(known);
            nemesis
                .chronicle
                .note(format!("  new leader: {}", next.as_leader()));
        } else if nemesis.chronicle.collect() > known {
            let next = nemesis.chronicle.newest();
            nemesis.chronicle.note(format!(
                "  leader now: instance {} (epoch {})",
                next.slot, next.epoch
            ));
        }
        // Let the leader run a while: the experiment's own pace, not a synchronisation. A
        // cut-off pgleader stays cut off meanwhile, and its held commands arrive after.
        nemesis
            .chronicle
            .pause(Duration::from_millis(rng.u64(500..1500)));
        for (slot, server) in frozen {
            nemesis.proxies[slot][server]
                .as_ref()
                .expect("a proxy")
                .thaw();
        }
    }

    let ended = monotonic_ns();
    nemesis.chronicle.collect();
    for clock in &nemesis.clocks {
        let _ = std::fs::remove_file(clock);
    }
    let report = nemesis.chronicle.report();
    let runs = assert_one_at_a_time(&nemesis.chronicle.runs, ended, seed, &report);
    eprintln!("{}", nemesis.chronicle.log.join("\n"));
    eprintln!(
        "quorum nemesis: seed {seed}, {server_count} servers, {rounds} rounds, {} runs, no overlap",
        runs.len()
    );
}

#[test]
fn no_two_commands_ever_run_at_once_over_three_servers_under_random_faults() {
    nemesis(3, FAULTS.len());
}

#[test]
fn no_two_commands_ever_run_at_once_over_five_servers_under_random_faults() {
    nemesis(5, 6);
}
