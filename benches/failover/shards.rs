//! Shards (issue 28): a fleet of R replicas running `--shards K`, measured the way the issue
//! asks. kill -9 of a replica → every shard it ran runs on another one; a replica joins → the
//! fleet is balanced (each replica runs K/R, rounded down or up); what a replica at its share
//! costs against K; and the same work built the way users build it today, K plain pgleader
//! processes per replica, one lock per shard, side by side.
//!
//! A shard's command prints `<tag> started shard=N` and becomes a sleep; a replica's running
//! shards are those whose start it printed and whose exit it has not logged.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;

use crate::figures::{Cost, Figures, Fleet, Row, SHARDED_ROLE};
use crate::harness::{self, Stream};
use crate::procfs::{self, CpuMeter};
use crate::tools::{Candidate, Pgleader, SETTLE, SETUP_WAIT, Tool, last_of};

/// The fleet's size in every scenario.
pub const REPLICAS: usize = 4;

/// A replica's command: one line, then a sleep that TERM ends.
fn shard_child(tag: &str) -> String {
    format!("echo {tag} started shard=$PGLEADER_SHARD; exec sleep 1000")
}

/// `pgleader run` for a lock, with options, running a script.
pub type CommandFor<'a> = Box<dyn Fn(i64, &[&str], &str) -> Command + 'a>;

/// How the replicas of one backend are started: `pgleader run --lock-id LOCK OPTIONS -- sh -c
/// SCRIPT` against its server.
pub struct Launcher<'a> {
    /// The backend's label in the tables.
    pub label: &'static str,
    pub command: CommandFor<'a>,
    /// How long a takeover may take before the run counts as failed.
    pub handoff_bound: Duration,
    /// Options every replica of this backend gets.
    pub options: &'static [&'static str],
}

impl<'a> Launcher<'a> {
    /// pgleader on the benchmark's PostgreSQL, with its defaults.
    pub fn postgres(pgleader: &'a Pgleader) -> Launcher<'a> {
        Launcher {
            label: pgleader.label(),
            command: Box::new(|lock, options, script| pgleader.command(lock, options, script)),
            handoff_bound: pgleader.handoff_bound(),
            options: &[],
        }
    }
}

/// One replica of a sharded fleet.
struct Replica {
    candidate: Candidate,
}

impl Replica {
    fn start(launcher: &Launcher, tag: &str, lock: i64, shards: u32) -> Replica {
        let mut options = vec![format!("--shards={shards}")];
        options.extend(launcher.options.iter().map(|option| option.to_string()));
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        let command = (launcher.command)(lock, &options, &shard_child(tag));
        Replica {
            candidate: Candidate::spawn(tag, command),
        }
    }

    /// The shards whose command runs here now.
    fn running(&self) -> BTreeSet<u32> {
        let mut running = BTreeMap::<u32, i32>::new();
        for line in self.candidate.lines(Stream::Stdout) {
            if let Some(shard) = shard_in(&line, "shard=") {
                *running.entry(shard).or_default() += 1;
            }
        }
        for line in self.candidate.lines(Stream::Stderr) {
            if line.contains("the command of shard")
                && line.contains("exited")
                && let Some(shard) = shard_in(&line, "shard=")
            {
                *running.entry(shard).or_default() -= 1;
            }
        }
        running
            .into_iter()
            .filter(|(_, count)| *count > 0)
            .map(|(shard, _)| shard)
            .collect()
    }
}

fn shard_in(line: &str, key: &str) -> Option<u32> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key))
        .and_then(|value| value.parse().ok())
}

/// Waits until the fleet runs every shard once and each replica its share; returns when.
fn balanced(fleet: &[Replica], shards: u32, timeout: Duration) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + timeout;
    let (low, high) = (
        shards as usize / fleet.len(),
        (shards as usize).div_ceil(fleet.len()),
    );
    loop {
        let running: Vec<BTreeSet<u32>> = fleet.iter().map(Replica::running).collect();
        let total: usize = running.iter().map(BTreeSet::len).sum();
        let union: BTreeSet<u32> = running.iter().flatten().copied().collect();
        if total == shards as usize
            && union.len() == shards as usize
            && running.iter().all(|r| (low..=high).contains(&r.len()))
        {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            let counts: Vec<usize> = running.iter().map(BTreeSet::len).collect();
            let dumps: Vec<String> = fleet.iter().map(|r| r.candidate.dump()).collect();
            bail!(
                "not balanced after {timeout:?}: {counts:?} shards per replica, {total} running, \
                 {} distinct\n{}",
                union.len(),
                dumps.join("\n")
            );
        }
        sleep(Duration::from_millis(2));
    }
}

/// Starts a balanced fleet of `REPLICAS` replicas.
fn fleet(launcher: &Launcher, lock: i64, shards: u32) -> anyhow::Result<Vec<Replica>> {
    let mut fleet = Vec::new();
    for i in 0..REPLICAS {
        fleet.push(Replica::start(launcher, &format!("R{i}"), lock, shards));
        balanced(&fleet, shards, SETUP_WAIT)?;
    }
    Ok(fleet)
}

/// kill -9 of a replica → every shard it ran runs elsewhere; then a new replica joins → the
/// fleet is balanced again. Two rows per K, from the same runs.
pub fn kill9_and_join(launcher: &Launcher, shards: u32, runs: usize) -> Vec<Row> {
    let scenario_kill = format!("11. shards: kill -9 of one of {REPLICAS} replicas, K = {shards}");
    let scenario_join = format!(
        "11b. shards: a replica joins {} others, K = {shards}",
        REPLICAS - 1
    );
    eprintln!("bench: {scenario_kill}, and {scenario_join}");
    let (mut taken, mut joined) = (Figures::default(), Figures::default());
    let result = (|| -> anyhow::Result<()> {
        let lock = harness::unique_lock();
        let mut fleet = fleet(launcher, lock, shards)?;
        sleep(SETTLE);
        for run in 0..runs {
            let victim = run % fleet.len();
            let orphaned = fleet[victim].running();
            let fault = Instant::now();
            fleet[victim].candidate.signal(Signal::SIGKILL);
            let gone = fleet.remove(victim);
            // Each orphaned shard's first start on another replica after the fault (the
            // moment its line arrived, which polling here does not change).
            let needles: Vec<String> = orphaned
                .iter()
                .map(|shard| format!("started shard={shard}"))
                .collect();
            let survivors: Vec<&Candidate> = fleet.iter().map(|r| &r.candidate).collect();
            let last = last_of(
                &survivors,
                Stream::Stdout,
                &needles,
                fault,
                launcher.handoff_bound,
            )
            .map_err(|pending| {
                anyhow::anyhow!("{pending:?} never ran again\n{}", gone.candidate.dump())
            })?;
            if last > Duration::from_millis(500) && std::env::var_os("SHARDS_DEBUG").is_some() {
                eprintln!("SLOW orphaned={orphaned:?}");
                for replica in &fleet {
                    eprintln!("{}", replica.candidate.dump());
                }
            }
            taken.sample(last);
            eprintln!(
                "bench:   K = {shards} run {}/{runs}: {} shards ran elsewhere after {:.1} ms",
                run + 1,
                orphaned.len(),
                last.as_secs_f64() * 1000.0
            );
            drop(gone);
            sleep(SETTLE);
            let started = Instant::now();
            fleet.push(Replica::start(launcher, &format!("J{run}"), lock, shards));
            let at = balanced(&fleet, shards, SETUP_WAIT)?;
            if at - started > Duration::from_secs(1) && std::env::var_os("SHARDS_DEBUG").is_some() {
                eprintln!("SLOW JOIN");
                for replica in &fleet {
                    eprintln!("{}", replica.candidate.dump());
                }
            }
            joined.sample(at - started);
            sleep(SETTLE);
        }
        Ok(())
    })();
    if let Err(err) = result {
        taken.failure(format!("{err:#}").replace('\n', " "));
        joined.failure(format!("{err:#}").replace('\n', " "));
    }
    vec![
        Row {
            id: format!("shards.kill9.{shards}"),
            scenario: scenario_kill,
            tool: launcher.label,
            measure: "every shard it ran runs on another replica",
            figures: taken,
            old_child_stopped: None,
            note: String::new(),
        },
        Row {
            id: format!("shards.join.{shards}"),
            scenario: scenario_join,
            tool: launcher.label,
            measure: "balanced: its share runs on it, the surplus stopped elsewhere",
            figures: joined,
            old_child_stopped: None,
            note: "from the new pgleader's start, its connecting included".into(),
        },
    ]
}

/// What a replica at its share costs, for each K and each of `pgleaders` (binaries side by
/// side, K by K): its pgleader and its keepers (one per shard it runs), and the statements the
/// server gets from its sessions.
pub fn costs(pgleaders: &[&Pgleader], shards: &[u32], window: Duration) -> Vec<Cost> {
    let mut costs = Vec::new();
    for &k in shards {
        for pgleader in pgleaders {
            eprintln!(
                "bench: 12. cost of a sharded replica at its share, K = {k} ({})",
                pgleader.label()
            );
            match cost(pgleader, k, window) {
                Ok(cost) => costs.push(cost),
                Err(err) => eprintln!("bench:   failed: {err:#}"),
            }
        }
    }
    costs
}

fn cost(pgleader: &Pgleader, shards: u32, window: Duration) -> anyhow::Result<Cost> {
    pgleader.log_statements(true)?;
    let measured = (|| {
        let lock = harness::unique_lock();
        let fleet = fleet(&Launcher::postgres(pgleader), lock, shards)?;
        sleep(SETTLE * 3);
        let replica = &fleet[0];
        let pid = replica.candidate.pid();
        let backends = pgleader.backends_of(pid)?;
        let keepers = procfs::children(pid);
        let log_mark = pgleader.cluster.log().len();
        let meter = CpuMeter::start(&[pid]);
        let keeper_meter = CpuMeter::start(&keepers);
        sleep(window);
        let cpu = meter.used(&[pid]);
        let keeper_cpu = keeper_meter.used(&keepers);
        let statements = pgleader.statements_since(log_mark);
        let sent: u64 = backends.iter().filter_map(|b| statements.get(b)).sum();
        let keeper_rss: u64 = keepers.iter().filter_map(|k| procfs::rss_kib(*k)).sum();
        Ok(Cost {
            tool: pgleader.label(),
            role: role(shards),
            window,
            rss_kib: procfs::rss_kib(pid),
            keeper_rss_kib: Some(keeper_rss),
            cpu,
            keeper_cpu: Some(keeper_cpu),
            requests_per_second: Some(sent as f64 / window.as_secs_f64()),
            requests_how: "statements in the server log from its two sessions (holder, watcher)",
        })
    })();
    pgleader.log_statements(false)?;
    measured
}

/// The cost row's role: [`SHARDED_ROLE`], and which share.
fn role(shards: u32) -> &'static str {
    const ROLES: [(u32, &str); 2] = [
        (16, "sharded replica, 4 of K = 16 (keepers: its 4)"),
        (64, "sharded replica, 16 of K = 64 (keepers: its 16)"),
    ];
    debug_assert!(ROLES.iter().all(|(_, role)| role.starts_with(SHARDED_ROLE)));
    ROLES
        .iter()
        .find(|(k, _)| *k == shards)
        .map_or(SHARDED_ROLE, |(_, role)| role)
}

/// The same fleet two ways: `--shards K` on each replica, and K plain pgleader processes per
/// replica (one lock per shard, started replica after replica, as users do it today).
pub fn by_hand(pgleader: &Pgleader, shards: u32) -> Vec<Fleet> {
    eprintln!(
        "bench: 13. {REPLICAS} replicas, K = {shards}: --shards beside K plain processes each"
    );
    let mut fleets = Vec::new();
    match sharded_fleet(pgleader, shards) {
        Ok(fleet) => fleets.push(fleet),
        Err(err) => eprintln!("bench:   --shards failed: {err:#}"),
    }
    match plain_fleet(pgleader, shards) {
        Ok(fleet) => fleets.push(fleet),
        Err(err) => eprintln!("bench:   plain processes failed: {err:#}"),
    }
    fleets
}

fn sharded_fleet(pgleader: &Pgleader, shards: u32) -> anyhow::Result<Fleet> {
    let lock = harness::unique_lock();
    let fleet = fleet(&Launcher::postgres(pgleader), lock, shards)?;
    sleep(SETTLE);
    let pids: Vec<i32> = fleet.iter().map(|r| r.candidate.pid()).collect();
    Ok(Fleet {
        how: format!("--shards {shards} on each replica"),
        replicas: REPLICAS,
        shards,
        per_replica: fleet.iter().map(|r| r.running().len()).collect(),
        ..measure_fleet(pgleader, &pids)?
    })
}

fn plain_fleet(pgleader: &Pgleader, shards: u32) -> anyhow::Result<Fleet> {
    let base = harness::unique_lock() * 10_000;
    for _ in 0..shards {
        harness::unique_lock();
    }
    let mut replicas: Vec<Vec<Candidate>> = Vec::new();
    for r in 0..REPLICAS {
        let mut processes = Vec::new();
        for shard in 0..shards {
            let command = pgleader.command(
                base + i64::from(shard),
                &[],
                &format!("echo P{r} started shard={shard}; exec sleep 1000"),
            );
            processes.push(Candidate::spawn(&format!("P{r}.{shard}"), command));
        }
        // Every one of them running or queued before the next replica starts.
        for (shard, process) in processes.iter().enumerate() {
            let needle = if r == 0 {
                " started "
            } else {
                "waiting for the lock"
            };
            let stream = if r == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            process
                .line(stream, needle, 1, None, SETUP_WAIT)
                .with_context(|| format!("replica {r}, shard {shard}: {}", process.dump()))?;
        }
        replicas.push(processes);
    }
    sleep(SETTLE);
    let pids: Vec<i32> = replicas.iter().flatten().map(Candidate::pid).collect();
    let per_replica = replicas
        .iter()
        .map(|processes| {
            processes
                .iter()
                .filter(|p| !p.lines(Stream::Stdout).is_empty())
                .count()
        })
        .collect();
    Ok(Fleet {
        how: format!("{shards} plain pgleader processes on each replica, one lock per shard"),
        replicas: REPLICAS,
        shards,
        per_replica,
        ..measure_fleet(pgleader, &pids)?
    })
}

/// Processes, server sessions and memory of a fleet of pgleader processes `pids`.
fn measure_fleet(pgleader: &Pgleader, pids: &[i32]) -> anyhow::Result<Fleet> {
    let keepers: Vec<i32> = pids.iter().flat_map(|pid| procfs::children(*pid)).collect();
    let mut connections = 0;
    for pid in pids {
        connections += pgleader.backends_of(*pid)?.len();
    }
    let rss = |pids: &[i32]| {
        pids.iter()
            .filter_map(|pid| procfs::rss_kib(*pid))
            .sum::<u64>()
    };
    Ok(Fleet {
        how: String::new(),
        replicas: 0,
        shards: 0,
        pgleader_processes: pids.len(),
        keepers: keepers.len(),
        connections,
        pgleader_rss_kib: rss(pids),
        keeper_rss_kib: rss(&keepers),
        per_replica: Vec::new(),
    })
}
