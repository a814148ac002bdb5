//! The Redlock rows (issue 17): pgleader over a quorum of three `redis-server`s of the
//! benchmark's own (`-d redis://… ` three times) beside npm `redlock`, the Redlock client that
//! Node.js teams use, over the same three servers; and, in the same run, pgleader on one server
//! (`redis_lock.rs`) for the rows that compare one server with three.
//!
//! npm `redlock` is a library, not a command: `redlock_leader.js` beside this file is the
//! leader loop a user of it writes (`using` with its automatic extension, the command stopped
//! when the routine's signal aborts, a release on SIGTERM). The library and its Redis client
//! (ioredis) are installed with npm into a scratch directory under the target directory, never
//! into the repository.
//!
//! A quorum adds a fault one server does not have: losing the majority. Scenario 10 kills two
//! of the three servers (kill -9), scenario 10b freezes them (SIGSTOP, as a paused VM or a
//! partition that drops packets would); in both the leader must stop its command on its own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::figures::{Cost, Row, secs};
use crate::harness::{self, Proxy, unique_lock};
use crate::procfs;
use crate::redis_lock::{self, CHECK_INTERVAL, Counts, PEER_TTL_SECONDS, add_counts};
use crate::scenarios::{self, ServerFault};
use crate::tools::{
    self, Candidate, LockServer, PREVIOUS_QUORUM_LABEL, QUORUM_LABEL, REDLOCK_LABEL, SETTLE,
    SETUP_WAIT, Tool, Usage, child_script, first_line, peer_candidate, wait_queued,
};

/// The npm `redlock` release the peer runs, pinned so that runs compare: the 5.0 line, the
/// first with `using` and its automatic extension (npm's `latest` tag, 4.2.0, has neither).
pub const REDLOCK_VERSION: &str = "5.0.0-beta.2";

/// The ioredis release the peer's clients are, pinned too (redlock names no version of it).
pub const IOREDIS_VERSION: &str = "5.9.3";

/// How many servers the quorum has.
const SERVERS: usize = 3;

/// pgleader's lease, which is also how long a server must have been up before it votes.
const LEASE: Duration = Duration::from_secs(10);

/// pgleader's check bound at the benchmark's settings: `--check-interval 200ms` plus the
/// default `--check-timeout 2s`.
const CHECK_BOUND: Duration = Duration::from_millis(2200);

/// The leader loop around npm `redlock`.
const PEER_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/failover/redlock_leader.js"
);

/// Where npm installs the peer: the target directory, so a `cargo clean` removes it.
fn peer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("bench-peers")
        .join(format!(
            "redlock-{REDLOCK_VERSION}-ioredis-{IOREDIS_VERSION}"
        ))
}

/// Installs npm `redlock` and ioredis into [`peer_dir`] with npm, unless they are there.
pub fn ensure_redlock() -> anyhow::Result<()> {
    let dir = peer_dir();
    let installed = || {
        // redlock's `exports` hide its package.json from require(): read it as a file.
        Command::new("node")
            .env("NODE_PATH", dir.join("node_modules"))
            .args([
                "-e",
                "const [dir, r, i] = process.argv.slice(1); \
                 const version = (name) => JSON.parse(require('fs').readFileSync( \
                   `${dir}/node_modules/${name}/package.json`)).version.replace(/^v/, ''); \
                 require('redlock'); require('ioredis'); \
                 process.exit(version('redlock') === r && version('ioredis') === i ? 0 : 1)",
            ])
            .arg(&dir)
            .args([REDLOCK_VERSION, IOREDIS_VERSION])
            .output()
            .is_ok_and(|out| out.status.success())
    };
    if installed() {
        return Ok(());
    }
    eprintln!(
        "bench: installing redlock {REDLOCK_VERSION} and ioredis {IOREDIS_VERSION} with npm into {}",
        dir.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // A package.json of its own, so that npm installs here and not in an enclosing project.
    std::fs::write(dir.join("package.json"), "{\"private\": true}\n")?;
    let status = Command::new("npm")
        .args([
            "install",
            "--silent",
            "--no-audit",
            "--no-fund",
            "--no-update-notifier",
            "--prefix",
        ])
        .arg(&dir)
        .arg(format!("redlock@{REDLOCK_VERSION}"))
        .arg(format!("ioredis@{IOREDIS_VERSION}"))
        .status()
        .context("cannot run npm (Debian: apt-get install nodejs npm)")?;
    if !status.success() || !installed() {
        bail!(
            "npm could not install redlock@{REDLOCK_VERSION} and ioredis@{IOREDIS_VERSION} \
             into {} (node and npm are needed: Debian's nodejs and npm)",
            dir.display()
        );
    }
    Ok(())
}

/// Node.js's version, for the report.
pub fn node_version() -> String {
    first_line(Command::new("node").arg("--version"))
}

/// The benchmark's three Redis servers, and one connection of its own to the first (which no
/// scenario stops), so that no request of the benchmark pays for a connection set-up.
pub struct Quorum {
    servers: Vec<harness::Redis>,
    admin: Mutex<redis::Connection>,
}

impl Quorum {
    pub fn start() -> anyhow::Result<Quorum> {
        let servers: Vec<harness::Redis> = (0..SERVERS)
            .map(|i| harness::Redis::new(&format!("bench-quorum-{i}")))
            .collect();
        let admin = redis::Client::open(servers[0].url())?
            .get_connection()
            .context("cannot connect to the benchmark's first quorum server")?;
        Ok(Quorum {
            servers,
            admin: Mutex::new(admin),
        })
    }

    fn query<T: redis::FromRedisValue>(&self, command: &redis::Cmd) -> anyhow::Result<T> {
        let mut admin = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        Ok(command.query(&mut *admin)?)
    }

    fn urls(&self) -> Vec<String> {
        self.servers.iter().map(harness::Redis::url).collect()
    }

    /// Waits until every server has been up for more than `age` (by its own
    /// `uptime_in_seconds`, what pgleader's acquire script reads): a server younger than the
    /// lease refuses its vote, and one younger than the restart fence delays a new command.
    pub fn wait_until_up(&self, age: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + age + SETUP_WAIT;
        for server in &self.servers {
            loop {
                let uptime: u64 = server
                    .try_cli(&["INFO", "server"])
                    .map_err(anyhow::Error::msg)?
                    .lines()
                    .find_map(|line| line.trim().strip_prefix("uptime_in_seconds:")?.parse().ok())
                    .unwrap_or(0);
                if Duration::from_secs(uptime) > age {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("a quorum server has been up {uptime} s only, after waiting");
                }
                sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    /// Every server's pid, but the first's: the majority a fault takes away.
    fn majority_pids(&self) -> Vec<Pid> {
        self.pids()[1..]
            .iter()
            .map(|pid| Pid::from_raw(*pid))
            .collect()
    }
}

/// A proxy stands in front of the first server only; no scenario ends a session over a quorum.
impl LockServer for Quorum {
    fn pids(&self) -> Vec<i32> {
        self.servers.iter().map(harness::Redis::pid).collect()
    }

    fn port(&self) -> u16 {
        self.servers[0].port
    }

    fn end_session(&self, _leader_line: &str) -> anyhow::Result<Instant> {
        bail!("not measured over a quorum")
    }
}

/// What takes the majority away: two of the three servers killed (then started again, empty),
/// or frozen (then thawed).
pub struct LoseMajority<'a> {
    quorum: &'a Quorum,
    kill: bool,
    /// Before each run, wait until the servers vote again (for pgleader, after a restart).
    ready_at: Option<Duration>,
}

impl ServerFault for LoseMajority<'_> {
    fn prepare(&self) -> anyhow::Result<()> {
        match self.ready_at {
            Some(age) => self.quorum.wait_until_up(age),
            None => Ok(()),
        }
    }

    fn inject(&self) -> anyhow::Result<Instant> {
        let signal = if self.kill {
            Signal::SIGKILL
        } else {
            Signal::SIGSTOP
        };
        let pids = self.quorum.majority_pids();
        let fault = Instant::now();
        for pid in pids {
            kill(pid, signal).context("cannot signal a quorum server")?;
        }
        Ok(fault)
    }

    fn restore(&self) {
        for server in &self.quorum.servers[1..] {
            if self.kill {
                // Reaps the killed server, then starts it again (empty, `--save ''`).
                server.crash();
                server.start();
            } else {
                server.freeze(false);
            }
        }
    }
}

/// pgleader over the benchmark's three servers, with `--check-interval 200ms` as on one.
pub struct PgleaderQuorum<'a> {
    pub quorum: &'a Quorum,
    /// Which binary: cargo's build (None), or another one such as a previous build.
    pub binary: Option<&'a Path>,
    pub label: &'static str,
}

impl PgleaderQuorum<'_> {
    fn key(lock: i64) -> String {
        format!("pgleader:{{{lock}}}")
    }

    fn spawn(&self, tag: &str, lock: i64, options: &[&str]) -> Candidate {
        let mut command = tools::pgleader_binary(self.binary);
        // pgleader's own defaults, restart fence included (the harness turns it off for tests).
        command
            .env_remove("PGLEADER_RESTART_FENCE")
            .env("BENCH_REDIS_KEY", PgleaderQuorum::key(lock))
            .arg("run");
        for url in self.quorum.urls() {
            command.arg("-d").arg(url);
        }
        command
            .arg(format!("--lock-id={lock}"))
            .args(options)
            .args(["--", "sh", "-c", &child_script(tag)]);
        Candidate::spawn(tag, command)
    }
}

impl Tool for PgleaderQuorum<'_> {
    fn label(&self) -> &'static str {
        self.label
    }

    fn candidate(&self, tag: &str, lock: i64, _proxy: Option<&Proxy>) -> Candidate {
        self.spawn(tag, lock, &[CHECK_INTERVAL])
    }

    /// Every session subscribes to the lock's release channel on each server for as long as
    /// it lives, leader or follower: a quorum keeps no queue to count.
    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        let channel = format!("{}:released", PgleaderQuorum::key(lock));
        let (_, subscribers): (String, usize) = self
            .quorum
            .query(redis::cmd("PUBSUB").arg("NUMSUB").arg(&channel))?;
        Ok(subscribers)
    }

    fn server(&self) -> &dyn LockServer {
        self.quorum
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(10)
    }

    /// The leader renews, and a follower tries again, every check interval.
    fn poll_period(&self) -> Duration {
        Duration::from_millis(200)
    }

    fn why_never(&self) -> &'static str {
        "unexpected: a bug in pgleader or in the benchmark"
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        // Both check intervals in one window, each pair on a lock of its own.
        measure_costs(
            self.quorum,
            window,
            &[
                Pair {
                    tool: self,
                    spawn: &|tag, lock| self.spawn(tag, lock, &[CHECK_INTERVAL]),
                    roles: ["leader", "follower"],
                    keeper: true,
                },
                Pair {
                    tool: self,
                    spawn: &|tag, lock| self.spawn(tag, lock, &[]),
                    roles: [
                        "leader, default --check-interval (1 s)",
                        "follower, default --check-interval (1 s)",
                    ],
                    keeper: true,
                },
            ],
        )
    }
}

/// npm `redlock` in the benchmark's leader loop, over the same three servers.
pub struct Redlock<'a> {
    pub quorum: &'a Quorum,
}

impl Redlock<'_> {
    fn key(lock: i64) -> String {
        format!("bench-redlock:{lock}")
    }

    /// How long the loop takes, at most, to notice a lost majority when each failed command
    /// fails at once: the key's validity (one TTL after the last extension), then the
    /// extension's retry window (11 tries, 200 ± 100 ms apart).
    fn loss_bound() -> Duration {
        Duration::from_secs(PEER_TTL_SECONDS + 5)
    }
}

impl Tool for Redlock<'_> {
    fn label(&self) -> &'static str {
        REDLOCK_LABEL
    }

    fn candidate(&self, tag: &str, lock: i64, _proxy: Option<&Proxy>) -> Candidate {
        let key = Redlock::key(lock);
        let (urls, ttl) = (self.quorum.urls().join(" "), PEER_TTL_SECONDS.to_string());
        let modules = peer_dir().join("node_modules");
        peer_candidate(
            tag,
            "node",
            &[
                ("NODE_PATH", modules.as_os_str()),
                ("BENCH_REDIS_KEY", key.as_ref()),
            ],
            &[PEER_SCRIPT, &urls, &key, &ttl],
        )
    }

    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        // One connection per server and instance: the first server's are the candidates.
        let clients: String = self.quorum.query(redis::cmd("CLIENT").arg("LIST"))?;
        Ok(redis_lock::named_clients(&clients, &Redlock::key(lock)))
    }

    fn server(&self) -> &dyn LockServer {
        self.quorum
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(PEER_TTL_SECONDS + 5)
    }

    /// The leader extends 500 ms before the key's validity ends: every TTL − 0.5 s.
    fn poll_period(&self) -> Duration {
        Duration::from_secs(PEER_TTL_SECONDS) - Duration::from_millis(500)
    }

    fn why_never(&self) -> &'static str {
        "npm redlock aborts the routine's signal only once an extension has failed on a \
         majority and the key's validity is over, and its ioredis clients (defaults: no \
         command timeout, an offline queue) hold a command to a killed server for 20 \
         reconnection attempts (about 10 s) and to a frozen one until it answers again; by \
         hand, the command still ran 30 s after two servers were killed, and was stopped only \
         once two frozen servers were thawed (25 s later)"
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        measure_costs(
            self.quorum,
            window,
            &[Pair {
                tool: self,
                spawn: &|tag, lock| self.candidate(tag, lock, None),
                roles: ["leader", "follower"],
                keeper: false,
            }],
        )
    }
}

/// A leader and a follower measured together, on a lock of their own.
struct Pair<'a> {
    tool: &'a dyn Tool,
    spawn: &'a dyn Fn(&str, i64) -> Candidate,
    roles: [&'static str; 2],
    /// Whether the leader's only child is pgleader's keeper (the peer's child is the command).
    keeper: bool,
}

/// The idle cost of each pair: RSS and CPU of each process, and the commands it sent to each
/// server, told apart by the client ports `MONITOR` names (a script's commands belong to the
/// client whose script ran them). All pairs share one window.
fn measure_costs(quorum: &Quorum, window: Duration, pairs: &[Pair]) -> anyhow::Result<Vec<Cost>> {
    let mut running = Vec::new();
    for pair in pairs {
        let lock = unique_lock();
        let leader = (pair.spawn)("A", lock);
        leader
            .started(None, SETUP_WAIT)
            .with_context(|| format!("the leader never started\n{}", leader.dump()))?;
        let follower = (pair.spawn)("B", lock);
        wait_queued(pair.tool, lock, 2, SETUP_WAIT).with_context(|| follower.dump())?;
        running.push((leader, follower));
    }
    // The followers' first tries and the leaders' start stay out of the window.
    sleep(SETTLE * 3);
    let monitors: Vec<_> = quorum
        .servers
        .iter()
        .map(|server| {
            let port = server.port;
            std::thread::spawn(move || redis_lock::monitor(port, window))
        })
        .collect();
    let usages: Vec<_> = running
        .iter()
        .zip(pairs)
        .map(|((leader, follower), pair)| {
            let pids = [leader.pid(), follower.pid()];
            let keeper = procfs::children(leader.pid())
                .first()
                .copied()
                .filter(|_| pair.keeper);
            std::thread::spawn(move || Usage::measure(&pids, keeper, window))
        })
        .collect();
    let seen: Vec<BTreeMap<u16, Counts>> = monitors
        .into_iter()
        .map(|monitor| {
            monitor
                .join()
                .map_err(|_| anyhow::anyhow!("a MONITOR thread panicked"))?
        })
        .collect::<anyhow::Result<_>>()?;
    let mut costs = Vec::new();
    for (((leader, follower), pair), usage) in running.iter().zip(pairs).zip(usages) {
        let usage = usage
            .join()
            .map_err(|_| anyhow::anyhow!("a measuring thread panicked"))?;
        for (index, candidate) in [leader, follower].into_iter().enumerate() {
            let sent = PerServer::of(&seen, &procfs::tcp_ports(candidate.pid()), window);
            costs.push(usage.cost(
                index,
                pair.tool.label(),
                pair.roles[index],
                sent.mean(),
                sent.how(),
            ));
        }
    }
    Ok(costs)
}

/// What one candidate sent to each server, per second.
struct PerServer {
    /// Requests per second to each server.
    totals: Vec<f64>,
    /// Per server on average, by command: what it sent, and what its scripts ran.
    requests: BTreeMap<String, f64>,
    in_scripts: BTreeMap<String, f64>,
}

impl PerServer {
    fn of(seen: &[BTreeMap<u16, Counts>], ports: &[u16], window: Duration) -> PerServer {
        let (mut requests, mut in_scripts) = (BTreeMap::new(), BTreeMap::new());
        let mut totals = Vec::new();
        for server in seen {
            let mut total = 0;
            for port in ports {
                if let Some((sent, ran)) = server.get(port) {
                    total += sent.values().sum::<u64>();
                    add_counts(&mut requests, sent.clone());
                    add_counts(&mut in_scripts, ran.clone());
                }
            }
            totals.push(total as f64 / window.as_secs_f64());
        }
        let per_server = (seen.len() as f64).max(1.0) * window.as_secs_f64();
        let rate = |counts: BTreeMap<String, u64>| {
            counts
                .into_iter()
                .map(|(name, n)| (name, n as f64 / per_server))
                .collect()
        };
        PerServer {
            totals,
            requests: rate(requests),
            in_scripts: rate(in_scripts),
        }
    }

    fn mean(&self) -> f64 {
        self.totals.iter().sum::<f64>() / (self.totals.len() as f64).max(1.0)
    }

    /// "per server (each of 3) …", leaked into the report's `&'static str` (a handful per run).
    fn how(&self) -> &'static str {
        let list = |rates: &BTreeMap<String, f64>| {
            let list = rates
                .iter()
                .map(|(name, rate)| format!("{name} {rate:.1}/s"))
                .collect::<Vec<_>>()
                .join(", ");
            if list.is_empty() {
                "none".to_owned()
            } else {
                list
            }
        };
        let totals = self
            .totals
            .iter()
            .map(|rate| format!("{rate:.2}"))
            .collect::<Vec<_>>()
            .join(", ");
        Box::leak(
            format!(
                "requests per second to each of the 3 servers (the mean is the figure), seen by \
                 MONITOR and told apart by the candidate's client ports: {totals}; per server, \
                 sent: {}; run inside its scripts: {}",
                list(&self.requests),
                list(&self.in_scripts)
            )
            .into_boxed_str(),
        )
    }
}

/// Runs of the scenarios that lose the majority, by plan.
pub struct LossRuns {
    /// Runs with the servers frozen (no restart between runs).
    pub freeze: usize,
    /// Runs with the servers killed: each restarts them, and pgleader's next run waits until
    /// they vote again (one lease).
    pub kill: usize,
    /// The peer's runs of each, where it is expected never to stop its command.
    pub peer: usize,
}

/// The quorum's rows: start, graceful handoff, kill -9, the lost majority (killed and frozen),
/// and the idle costs, for pgleader over three servers and npm `redlock`. The servers must
/// have been up for a lease; the lost majority comes last, as it leaves them young.
pub fn scenarios(
    quorum: &Quorum,
    runs: usize,
    lease_runs: usize,
    loss: &LossRuns,
    cost_window: Duration,
    previous: Option<&Path>,
) -> (Vec<Row>, Vec<Cost>) {
    let pgleader = PgleaderQuorum {
        quorum,
        binary: None,
        label: QUORUM_LABEL,
    };
    let peer = Redlock { quorum };
    let tools = [&pgleader as &dyn Tool, &peer];
    let mut rows = Vec::new();
    for tool in tools {
        rows.extend(scenarios::start(tool, runs));
    }
    for tool in tools {
        rows.extend(scenarios::sigterm(tool, runs, false));
    }
    rows.extend(scenarios::kill9(&pgleader, runs));
    // A previous build's kill -9 right after this one's, in the same run (`--previous`).
    if let Some(binary) = previous {
        let previous = PgleaderQuorum {
            quorum,
            binary: Some(binary),
            label: PREVIOUS_QUORUM_LABEL,
        };
        rows.extend(scenarios::kill9(&previous, runs));
    }
    rows.extend(scenarios::kill9(&peer, lease_runs));
    let costs = tools::idle_costs(&tools, cost_window);
    for kill in [false, true] {
        let (id, scenario) = if kill {
            (
                "majority_killed",
                "10. two of three servers killed (kill -9): no majority left",
            )
        } else {
            (
                "majority_frozen",
                "10b. two of three servers frozen (SIGSTOP): no majority left",
            )
        };
        let fault = |ready_at| LoseMajority {
            quorum,
            kill,
            ready_at,
        };
        // A killed server comes back empty and young: pgleader's next run waits until the
        // servers vote again. The peer does not care how young a server is.
        rows.extend(scenarios::majority_lost(
            &pgleader,
            if kill { loss.kill } else { loss.freeze },
            id,
            scenario,
            CHECK_BOUND + Duration::from_secs(2),
            &fault(kill.then_some(LEASE + Duration::from_secs(1))),
        ));
        rows.extend(scenarios::majority_lost(
            &peer,
            loss.peer,
            id,
            scenario,
            Redlock::loss_bound(),
            &fault(None),
        ));
    }
    (rows, costs)
}

/// The quorum's settings, for the report.
pub fn settings() -> Vec<(&'static str, String)> {
    vec![
        (
            "pgleader on 3 Redis",
            format!(
                "`-d redis://127.0.0.1:P1 -d redis://127.0.0.1:P2 -d redis://127.0.0.1:P3 --lock-id N {}`, its defaults otherwise (--check-timeout 2s, --kill-timeout 5s, --lease 10s, which is the keys' TTL and how long a server must be up before it votes, --restart-fence auto); the idle cost also with the default --check-interval (1s)",
                CHECK_INTERVAL.replace('=', " ")
            ),
        ),
        (
            "npm redlock",
            format!(
                "redlock {REDLOCK_VERSION} over three ioredis {IOREDIS_VERSION} clients (their defaults), in the benchmark's leader loop (benches/failover/redlock_leader.js): `using([key], {} s, routine)` with its defaults (retryCount 10, retryDelay 200 ms, retryJitter 100 ms, driftFactor 0.01, automaticExtensionThreshold 500 ms), called again after each acquisition that gives up; the routine runs the command, sends it SIGTERM when the signal aborts (an extension failed past the key's validity); on SIGTERM the loop stops the command and `using` releases the key; nothing acts after a kill -9",
                PEER_TTL_SECONDS
            ),
        ),
        (
            "Redis quorum",
            "three redis-servers of the benchmark's own on 127.0.0.1 (free ports), --save '' --appendonly no, their defaults otherwise; up for 11 s before their first run (pgleader's lease: a younger server does not vote); scenario 10 kills servers 2 and 3 and starts them again, empty, after each run (pgleader's next run waits until they vote again); 10b stops them with SIGSTOP and thaws them after each run".into(),
        ),
        (
            "lost majority",
            format!(
                "from just before kill(2) of the two servers to the old child's line saying it got TERM; the leader alone, no follower; pgleader is given {} (its check bound, 2.2 s, and 2 s), the peer {}",
                secs(CHECK_BOUND + Duration::from_secs(2)),
                secs(Redlock::loss_bound())
            ),
        ),
    ]
}
