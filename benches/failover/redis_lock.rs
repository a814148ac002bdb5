//! The Redis rows (issue 16): pgleader on Redis (`-d redis://`) beside redis-py's `Lock`, the
//! lock many Python teams pick today, against one `redis-server` of the benchmark's own (a free
//! port on 127.0.0.1, `--save '' --appendonly no`, the integration tests' harness).
//!
//! redis-py is a library, not a command: `redis_py_leader.py` beside this file is the leader
//! loop a user of it writes (acquire with a TTL, run the command, extend every TTL/3, stop the
//! command when an extension fails, release on SIGTERM). redis-py itself is installed with pip
//! into a scratch directory under the target directory, never into the repository or the
//! system's Python.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::figures::Cost;
use crate::harness::{self, Proxy, field, unique_lock};
use crate::procfs;
use crate::tools::{
    Candidate, LockServer, REDIS_LABEL, REDIS_PY_LABEL, SETTLE, SETUP_WAIT, Tool, Usage,
    child_script, client_command, first_line, peer_candidate, pip_install, run_command,
    wait_queued,
};

/// The redis-py release the peer runs, pinned so that runs compare.
pub const REDIS_PY_VERSION: &str = "8.1.0";

/// The TTL of the peer's key, in seconds: the same 3 s as `etcdctl lock --ttl` here (redis-py's
/// own default is no TTL at all: a crashed holder's key would stay for ever).
pub const PEER_TTL_SECONDS: u64 = 3;

/// pgleader's check interval on Redis: how often a waiting follower tries again, and so how
/// soon a crashed holder (its connection gone) is replaced.
pub const CHECK_INTERVAL: &str = "--check-interval=200ms";

/// The leader loop around redis-py's `Lock`.
const PEER_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/failover/redis_py_leader.py"
);

/// Where pip installs redis-py: the target directory, so a `cargo clean` removes it.
fn peer_site() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("bench-peers")
        .join(format!("redis-py-{REDIS_PY_VERSION}"))
}

/// Installs redis-py into [`peer_site`] with pip, unless it is there already.
pub fn ensure_redis_py() -> anyhow::Result<()> {
    let site = peer_site();
    let importable = |site: &Path| {
        Command::new("python3")
            .env("PYTHONPATH", site)
            .args([
                "-c",
                "import redis, sys; sys.exit(redis.__version__ != sys.argv[1])",
            ])
            .arg(REDIS_PY_VERSION)
            .output()
            .is_ok_and(|out| out.status.success())
    };
    pip_install(&format!("redis=={REDIS_PY_VERSION}"), &site, importable)
}

/// The benchmark's Redis server, and one connection of its own to it, so that no fault
/// request pays for a connection set-up inside a measurement.
pub struct Server {
    redis: harness::Redis,
    admin: Mutex<redis::Connection>,
}

impl Server {
    pub fn start() -> anyhow::Result<Server> {
        let redis = harness::Redis::new("bench");
        let admin = redis::Client::open(redis.url())?
            .get_connection()
            .context("cannot connect to the benchmark's redis-server")?;
        Ok(Server {
            redis,
            admin: Mutex::new(admin),
        })
    }

    fn query<T: redis::FromRedisValue>(&self, command: &redis::Cmd) -> anyhow::Result<T> {
        let mut admin = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        Ok(command.query(&mut *admin)?)
    }

    fn info(&self, section: &str) -> anyhow::Result<String> {
        self.query(redis::cmd("INFO").arg(section))
    }

    /// A field of `INFO section`.
    fn info_field(&self, section: &str, name: &str) -> anyhow::Result<String> {
        let info = self.info(section)?;
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(|value| value.trim().to_owned())
            .with_context(|| format!("no {name} in INFO {section}"))
    }

    /// Waits until the server has been up for `age`, as a long-running one would be: pgleader
    /// fences a server that has just started (its restart fence).
    pub fn wait_until_up(&self, age: Duration) -> anyhow::Result<()> {
        let up: u64 = self.info_field("server", "uptime_in_seconds")?.parse()?;
        if let Some(rest) = age.checked_sub(Duration::from_secs(up)) {
            sleep(rest + Duration::from_secs(1));
        }
        Ok(())
    }

    pub fn version(&self) -> String {
        first_line(Command::new("redis-server").arg("--version"))
    }

    /// What clients sent over `window`, seen through `MONITOR` (which names each command's
    /// connection, or `lua` for one a script ran), while the candidates `pids` (and a keeper)
    /// are measured over the same window.
    fn commands_over(
        &self,
        window: Duration,
        pids: &[i32],
        keeper: Option<i32>,
    ) -> anyhow::Result<(Commands, Usage)> {
        let port = self.port();
        let monitor = std::thread::spawn(move || monitor(port, window));
        let usage = Usage::measure(pids, keeper, window);
        let by_client = monitor
            .join()
            .map_err(|_| anyhow::anyhow!("the MONITOR thread panicked"))??;
        let (mut requests, mut in_scripts) = (BTreeMap::new(), BTreeMap::new());
        for (sent, ran) in by_client.into_values() {
            add_counts(&mut requests, sent);
            add_counts(&mut in_scripts, ran);
        }
        let per_second = |counts: BTreeMap<String, u64>| {
            counts
                .into_iter()
                .map(|(name, n)| (name, n as f64 / window.as_secs_f64()))
                .collect()
        };
        Ok((
            Commands {
                requests: per_second(requests),
                in_scripts: per_second(in_scripts),
            },
            usage,
        ))
    }

    pub fn url(&self) -> String {
        self.redis.url()
    }

    /// The ports of the connections of pgleader process `pid`: it names each connection
    /// `…:PID@HOST`, as it names its PostgreSQL sessions.
    pub fn clients_of(&self, pid: i32) -> anyhow::Result<Vec<u16>> {
        let clients: String = self.query(redis::cmd("CLIENT").arg("LIST"))?;
        let needle = format!(":{pid}@");
        Ok(clients
            .lines()
            .filter(|line| {
                line.split(' ')
                    .any(|kv| kv.starts_with("name=") && kv.contains(&needle))
            })
            .filter_map(|line| {
                let addr = line.split(' ').find_map(|kv| kv.strip_prefix("addr="))?;
                addr.rsplit_once(':')?.1.parse().ok()
            })
            .collect())
    }

    /// The requests per second that the connections on `ports` sent over `window` from now,
    /// seen by `MONITOR`.
    pub fn requests_over(&self, ports: &[u16], window: Duration) -> anyhow::Result<f64> {
        let by_client = monitor(self.port(), window)?;
        let sent: u64 = ports
            .iter()
            .filter_map(|port| by_client.get(port))
            .map(|(requests, _)| requests.values().sum::<u64>())
            .sum();
        Ok(sent as f64 / window.as_secs_f64())
    }
}

/// Redis has no lock bound to a session: ending the leader's session from the server's side
/// deletes the lock's key, which the leader's child prints.
impl LockServer for Server {
    fn pids(&self) -> Vec<i32> {
        vec![self.redis.pid()]
    }

    fn port(&self) -> u16 {
        self.redis.port
    }

    fn end_session(&self, leader_line: &str) -> anyhow::Result<Instant> {
        let key = field(leader_line, "redis_key");
        let mut admin = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let fault = Instant::now();
        let deleted: i64 = redis::cmd("DEL").arg(&key).query(&mut *admin)?;
        if deleted != 1 {
            bail!("no key {key} to delete");
        }
        Ok(fault)
    }
}

/// What one client sent over a window, by command name: its requests, and the commands its
/// scripts ran inside the server.
pub type Counts = (BTreeMap<String, u64>, BTreeMap<String, u64>);

/// Counts `MONITOR` lines for `window`, by the client's port: the commands each client sent,
/// and those its scripts ran (`MONITOR` names them `lua` and prints them right after the
/// script's own line, so they belong to the client of the line before).
pub fn monitor(port: u16, window: Duration) -> anyhow::Result<BTreeMap<u16, Counts>> {
    let stream = TcpStream::connect(("127.0.0.1", port)).context("cannot reach Redis")?;
    stream.set_read_timeout(Some(Duration::from_millis(50)))?;
    (&stream).write_all(b"MONITOR\r\n")?;
    let mut reader = BufReader::new(&stream);
    let mut by_client: BTreeMap<u16, Counts> = BTreeMap::new();
    let mut last_client = None;
    let mut line = String::new();
    let deadline = Instant::now() + window;
    while Instant::now() < deadline {
        match reader.read_line(&mut line) {
            Ok(0) => bail!("Redis closed the MONITOR connection"),
            Ok(_) if line.ends_with('\n') => {
                // `+1795432600.123456 [0 127.0.0.1:40184] "evalsha" "..."`, or `[0 lua]`.
                if let Some((source, rest)) = line
                    .split_once(" [")
                    .and_then(|(_, rest)| rest.split_once("] \""))
                {
                    let name = rest.split('"').next().unwrap_or_default().to_lowercase();
                    let in_script = source.ends_with(" lua");
                    if !in_script {
                        last_client = source
                            .rsplit_once(':')
                            .and_then(|(_, port)| port.parse::<u16>().ok());
                    }
                    if let Some(client) = last_client {
                        let (requests, in_scripts) = by_client.entry(client).or_default();
                        let counts = if in_script { in_scripts } else { requests };
                        *counts.entry(name).or_insert(0) += 1;
                    }
                }
                line.clear();
            }
            // A partial line stays in `line` until the rest arrives.
            Ok(_) => {}
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(by_client)
}

/// Adds `more` to `total`, name by name.
pub fn add_counts(total: &mut BTreeMap<String, u64>, more: BTreeMap<String, u64>) {
    for (name, n) in more {
        *total.entry(name).or_insert(0) += n;
    }
}

/// Commands per second by name.
struct Commands {
    /// What the clients sent (round trips, blocking ones included).
    requests: BTreeMap<String, f64>,
    /// What their scripts ran inside the server.
    in_scripts: BTreeMap<String, f64>,
}

impl Commands {
    fn total(&self) -> f64 {
        self.requests.values().sum()
    }

    /// What `self` adds to `base`, command by command.
    fn minus(&self, base: &Commands) -> Commands {
        let minus = |ours: &BTreeMap<String, f64>, theirs: &BTreeMap<String, f64>| {
            ours.iter()
                .map(|(name, rate)| {
                    (
                        name.clone(),
                        rate - theirs.get(name).copied().unwrap_or(0.0),
                    )
                })
                .filter(|(_, rate)| rate.abs() >= 0.05)
                .collect()
        };
        Commands {
            requests: minus(&self.requests, &base.requests),
            in_scripts: minus(&self.in_scripts, &base.in_scripts),
        }
    }

    /// "commands ...; sent: evalsha 5.0/s, blpop 5.0/s; run by scripts: ...", leaked into the
    /// report's `&'static str` (a handful per run).
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
        Box::leak(
            format!(
                "commands it sent, seen by MONITOR, one window with the leader alone, then one \
                 with the follower added: {}; run inside its scripts: {}",
                list(&self.requests),
                list(&self.in_scripts)
            )
            .into_boxed_str(),
        )
    }
}

/// An idle leader alone for a window, then with a follower for another; the follower's
/// commands are what the second window adds to the first. `keeper`: whether the leader's only
/// child is a keeper, measured on its own (pgleader's), or the command itself (a peer's).
fn measure_cost(
    tool: &dyn Tool,
    server: &Server,
    window: Duration,
    spawn: &dyn Fn(&str, i64) -> Candidate,
    roles: [&'static str; 2],
    keeper: bool,
) -> anyhow::Result<Vec<Cost>> {
    let lock = unique_lock();
    let leader = spawn("A", lock);
    leader
        .started(None, SETUP_WAIT)
        .with_context(|| format!("the leader never started\n{}", leader.dump()))?;
    sleep(SETTLE * 3);
    let keeper = procfs::children(leader.pid())
        .first()
        .copied()
        .filter(|_| keeper);
    let (alone, alone_usage) = server.commands_over(window, &[leader.pid()], keeper)?;
    let follower = spawn("B", lock);
    wait_queued(tool, lock, 2, SETUP_WAIT).with_context(|| follower.dump())?;
    sleep(SETTLE * 3);
    let (both, both_usage) = server.commands_over(window, &[follower.pid()], None)?;
    let added = both.minus(&alone);
    Ok(vec![
        alone_usage.cost(0, tool.label(), roles[0], alone.total(), alone.how()),
        both_usage.cost(
            0,
            tool.label(),
            roles[1],
            added.total().max(0.0),
            added.how(),
        ),
    ])
}

/// pgleader against the benchmark's Redis, with `--check-interval 200ms`.
pub struct PgleaderRedis {
    pub server: Arc<Server>,
    /// Which binary: cargo's build (None), or another one such as a previous build.
    binary: Option<PathBuf>,
    label: &'static str,
}

impl PgleaderRedis {
    /// The binary cargo built for the benchmark.
    pub fn new(server: Arc<Server>) -> PgleaderRedis {
        PgleaderRedis {
            server,
            binary: None,
            label: REDIS_LABEL,
        }
    }

    /// Another binary, labelled apart in the report, against the same server.
    pub fn with_binary(server: Arc<Server>, binary: PathBuf, label: &'static str) -> PgleaderRedis {
        PgleaderRedis {
            binary: Some(binary),
            label,
            ..PgleaderRedis::new(server)
        }
    }

    fn key(lock: i64) -> String {
        format!("pgleader:{{{lock}}}")
    }

    fn command(&self, lock: i64, options: &[&str], script: &str) -> Command {
        run_command(
            self.binary.as_deref(),
            &self.server.url(),
            lock,
            options,
            script,
        )
    }

    fn spawn(&self, tag: &str, lock: i64, options: &[&str]) -> Candidate {
        let mut command = self.command(lock, options, &child_script(tag));
        command.env("BENCH_REDIS_KEY", PgleaderRedis::key(lock));
        Candidate::spawn(tag, command)
    }

    /// Replicas with `--shards`, checking every 200 ms as the Redis rows do.
    pub fn shard_launcher(&self) -> crate::shards::Launcher<'_> {
        crate::shards::Launcher {
            label: self.label,
            command: Box::new(|lock, options, script| self.command(lock, options, script)),
            handoff_bound: self.handoff_bound(),
            options: &[CHECK_INTERVAL],
        }
    }
}

impl Tool for PgleaderRedis {
    fn label(&self) -> &'static str {
        self.label
    }

    fn candidate(&self, tag: &str, lock: i64, _proxy: Option<&Proxy>) -> Candidate {
        self.spawn(tag, lock, &[CHECK_INTERVAL])
    }

    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        let key = PgleaderRedis::key(lock);
        let held: usize = self.server.query(redis::cmd("EXISTS").arg(&key))?;
        let waiting: usize = self
            .server
            .query(redis::cmd("LLEN").arg(format!("{key}:queue")))?;
        Ok(held + waiting)
    }

    fn server(&self) -> &dyn LockServer {
        &*self.server
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(10)
    }

    /// The leader checks, and a follower tries again, every check interval.
    fn poll_period(&self) -> Duration {
        Duration::from_millis(200)
    }

    fn why_never(&self) -> &'static str {
        "unexpected: a bug in pgleader or in the benchmark"
    }

    fn step_down(&self, lock: i64) -> Option<Command> {
        Some(client_command(
            self.binary.as_deref(),
            &self.server.url(),
            "step-down",
            lock,
        ))
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        let mut costs = measure_cost(
            self,
            &self.server,
            window,
            &|tag, lock| self.spawn(tag, lock, &[CHECK_INTERVAL]),
            ["leader", "follower"],
            true,
        )?;
        // And with pgleader's default check interval (1 s), which sets a follower's rate.
        costs.extend(measure_cost(
            self,
            &self.server,
            window,
            &|tag, lock| self.spawn(tag, lock, &[]),
            [
                "leader, default --check-interval (1 s)",
                "follower, default --check-interval (1 s)",
            ],
            true,
        )?);
        Ok(costs)
    }
}

/// How many connections in a `CLIENT LIST` answer are named `<key>:…`: a peer names each of
/// its connections after the key and its pid.
pub fn named_clients(client_list: &str, key: &str) -> usize {
    let prefix = format!("name={key}:");
    client_list
        .lines()
        .filter(|line| line.split(' ').any(|kv| kv.starts_with(&prefix)))
        .count()
}

/// redis-py's `Lock` in the benchmark's leader loop, against the same Redis.
pub struct RedisPy {
    pub server: Arc<Server>,
}

impl RedisPy {
    fn key(lock: i64) -> String {
        format!("bench-peer:{lock}")
    }

    pub fn python_version() -> String {
        first_line(Command::new("python3").arg("--version"))
    }
}

impl Tool for RedisPy {
    fn label(&self) -> &'static str {
        REDIS_PY_LABEL
    }

    fn candidate(&self, tag: &str, lock: i64, _proxy: Option<&Proxy>) -> Candidate {
        let key = RedisPy::key(lock);
        let (url, ttl) = (self.server.url(), PEER_TTL_SECONDS.to_string());
        let site = peer_site();
        peer_candidate(
            tag,
            "python3",
            &[
                ("PYTHONPATH", site.as_os_str()),
                ("PYTHONDONTWRITEBYTECODE", "1".as_ref()),
                ("BENCH_REDIS_KEY", key.as_ref()),
            ],
            &[PEER_SCRIPT, &url, &key, &ttl],
        )
    }

    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        // Each instance names its connection `bench-peer:<key>:<pid>`; it connects with its
        // first try of the key, so a named connection is a candidate trying.
        let clients: String = self.server.query(redis::cmd("CLIENT").arg("LIST"))?;
        Ok(named_clients(&clients, &RedisPy::key(lock)))
    }

    fn server(&self) -> &dyn LockServer {
        &*self.server
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(PEER_TTL_SECONDS + 5)
    }

    /// The leader extends every TTL/3, a follower tries every 0.1 s.
    fn poll_period(&self) -> Duration {
        Duration::from_secs(PEER_TTL_SECONDS) / 3
    }

    fn why_never(&self) -> &'static str {
        "redis-py's Lock stops nothing: its leader loop notices a lost key only at its next \
         extension (every TTL/3), and a killed loop leaves its command running"
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        measure_cost(
            self,
            &self.server,
            window,
            &|tag, lock| self.candidate(tag, lock, None),
            ["leader", "follower"],
            false,
        )
    }
}
