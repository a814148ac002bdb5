//! The tools under test, behind one trait so that every scenario is written once and run
//! against each: pgleader against the benchmark's PostgreSQL here, `etcdctl lock` against its
//! etcd in `etcd.rs`, pgleader on Redis and redis-py's `Lock` in `redis_lock.rs`, pgleader over
//! a quorum and npm `redlock` in `redlock.rs`. A candidate is one running instance of a tool, in
//! a process group of its own, whose child prints a line when it starts and another when it gets
//! SIGTERM. Tools over one server share what belongs to the server ([`LockServer`]).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill, killpg};

use crate::figures::Cost;
use crate::harness::{self, Cluster, Proc, Proxy, Stream, field};
use crate::procfs::{self, CpuMeter};

// The labels of the tools' rows, by which the report finds them.

/// pgleader on the benchmark's Redis, with `--check-interval 200ms`.
pub const REDIS_LABEL: &str = "pgleader on Redis";
/// redis-py's `Lock` on the same Redis.
pub const REDIS_PY_LABEL: &str = "redis-py Lock";
/// pgleader over the benchmark's three Redis servers.
pub const QUORUM_LABEL: &str = "pgleader on 3 Redis";
/// npm `redlock` over the same three servers.
pub const REDLOCK_LABEL: &str = "npm redlock (3 servers)";
/// pgleader's `--previous` binary.
pub const PREVIOUS_LABEL: &str = "pgleader previous";
/// The same on Redis.
pub const PREVIOUS_REDIS_LABEL: &str = "pgleader previous on Redis";
/// pgleader's `--static` binary.
/// The previous build over the benchmark's three Redis servers.
pub const PREVIOUS_QUORUM_LABEL: &str = "pgleader previous on 3 Redis";
pub const STATIC_LABEL: &str = "pgleader static";
/// The same on Redis.
pub const STATIC_REDIS_LABEL: &str = "pgleader static on Redis";

/// How long a candidate may take to start, connect and queue up outside the measurement.
pub const SETUP_WAIT: Duration = Duration::from_secs(30);

/// A fault can reach the server's side only after the leader's session has settled.
pub const SETTLE: Duration = Duration::from_millis(300);

/// pgleader's timings in the partition scenario: small, so that a run takes seconds.
pub const PARTITION_ARGS: [&str; 4] = [
    "--check-interval=200ms",
    "--check-timeout=300ms",
    "--kill-timeout=1s",
    "--lease=3s",
];

/// What a scenario needs from the server a tool's candidates lock on: it is the same for every
/// tool on that server, so two tools over one server share it.
pub trait LockServer {
    /// The server's processes, for its CPU time.
    fn pids(&self) -> Vec<i32>;

    /// The server's TCP port, for a proxy in front of it.
    fn port(&self) -> u16;

    /// Ends the session of the leader whose child printed `leader_line`, from the server's
    /// side (on Redis, which has no lock bound to a session: deletes the lock's key). Returns
    /// the moment just before the request left.
    fn end_session(&self, leader_line: &str) -> anyhow::Result<Instant>;
}

/// A peer's leader loop, `program script args.. -- sh -c <child>`, with nothing of the
/// benchmark's environment but `PATH` and `env`.
pub fn peer_candidate(
    tag: &str,
    program: &str,
    env: &[(&str, &OsStr)],
    args: &[&str],
) -> Candidate {
    let mut command = Command::new(program);
    command
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .envs(env.iter().copied())
        .args(args)
        .args(["--", "sh", "-c", &child_script(tag)]);
    Candidate::spawn(tag, command)
}

/// What a scenario needs from a tool.
pub trait Tool {
    fn label(&self) -> &'static str;

    /// Starts a candidate for `lock`, connected through `proxy` if given (pgleader then uses
    /// [`PARTITION_ARGS`]).
    fn candidate(&self, tag: &str, lock: i64, proxy: Option<&Proxy>) -> Candidate;

    /// How many sessions hold or wait for `lock`, as the server sees them.
    fn queued(&self, lock: i64) -> anyhow::Result<usize>;

    /// The server (or servers) its candidates hold the lock on.
    fn server(&self) -> &dyn LockServer;

    /// A handoff that has not happened after this long (from the fault) is not coming.
    fn handoff_bound(&self) -> Duration;

    /// The longest period on which the tool polls or renews when nothing happens (zero for a
    /// tool that waits for events). A fault then comes at a random phase of it, so that a
    /// run's figure does not depend on where the benchmark's fixed pauses put the fault.
    fn poll_period(&self) -> Duration {
        Duration::ZERO
    }

    /// Why this tool may never do what a scenario waits for, for the report.
    fn why_never(&self) -> &'static str;

    /// The command that asks the leader of `lock` to hand over on demand (`pgleader
    /// step-down`), for a tool that has one.
    fn step_down(&self, _lock: i64) -> Option<Command> {
        None
    }

    /// Resident memory, CPU and requests of an idle leader and an idle follower.
    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>>;
}

/// The child every candidate runs: a line when it starts (with what identifies the leader's
/// session to the server), a line when it gets TERM (then it exits at once), else it waits.
pub fn child_script(tag: &str) -> String {
    format!(
        "trap 'echo {tag} got TERM; exit 0' TERM; \
         echo {tag} started $$ backend=$PGLEADER_BACKEND_PID etcd_key=$ETCD_LOCK_KEY \
         redis_key=$BENCH_REDIS_KEY; \
         while :; do sleep 1000 & wait $!; done"
    )
}

/// One running instance of a tool.
pub struct Candidate {
    proc: Proc,
}

impl Candidate {
    /// Starts `command` in a process group of its own: a peer's orphaned child can then be
    /// cleaned up with its group, and a signal to the group reaches only this candidate.
    pub fn spawn(tag: &str, mut command: Command) -> Candidate {
        command.process_group(0);
        Candidate {
            proc: Proc::spawn(tag, command),
        }
    }

    pub fn pid(&self) -> i32 {
        self.proc.pid.as_raw()
    }

    /// The child's first line (after `since`, if given) and when it arrived.
    pub fn started(&self, since: Option<Instant>, timeout: Duration) -> Option<(String, Instant)> {
        self.proc
            .wait_line(Stream::Stdout, " started ", 1, since, timeout)
    }

    /// When the child reported a SIGTERM that arrived after `since`.
    pub fn signalled(&self, since: Instant, timeout: Duration) -> Option<Instant> {
        self.proc
            .wait_line(Stream::Stdout, " got TERM", 1, Some(since), timeout)
            .map(|(_, at)| at)
    }

    /// The `n`-th line on `stream` containing `needle` (after `since`, if given), and when it
    /// arrived.
    pub fn line(
        &self,
        stream: Stream,
        needle: &str,
        n: usize,
        since: Option<Instant>,
        timeout: Duration,
    ) -> Option<(String, Instant)> {
        self.proc.wait_line(stream, needle, n, since, timeout)
    }

    /// Every line on `stream` so far.
    pub fn lines(&self, stream: Stream) -> Vec<String> {
        self.proc.lines(stream)
    }

    /// A log line of the tool's own (stderr).
    pub fn logged(&self, needle: &str, timeout: Duration) -> Option<String> {
        self.proc
            .wait_line(Stream::Stderr, needle, 1, None, timeout)
            .map(|(line, _)| line)
    }

    /// Signals the tool's own process.
    pub fn signal(&self, signal: Signal) {
        let _ = kill(self.proc.pid, signal);
    }

    /// Signals every process in the tool's process group.
    pub fn signal_group(&self, signal: Signal) {
        let _ = killpg(self.proc.pid, signal);
    }

    /// Everything the candidate printed, for error messages.
    pub fn dump(&self) -> String {
        self.proc.dump()
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        // The group, not just the tool: a peer's child outlives a peer that was killed.
        let _ = killpg(self.proc.pid, Signal::SIGKILL);
    }
}

/// Waits until each of `needles` appeared on `stream` of one of `candidates` after `since`;
/// returns how long after `since` the last of them arrived (the moment each line arrived,
/// which this polling does not change), or the needles still missing at `since + bound`.
pub fn last_of(
    candidates: &[&Candidate],
    stream: Stream,
    needles: &[String],
    since: Instant,
    bound: Duration,
) -> Result<Duration, Vec<String>> {
    let mut pending: Vec<&String> = needles.iter().collect();
    let mut last = Duration::ZERO;
    while !pending.is_empty() {
        pending.retain(|needle| {
            let seen = candidates.iter().find_map(|candidate| {
                candidate
                    .line(stream, needle, 1, Some(since), Duration::ZERO)
                    .map(|(_, at)| at)
            });
            if let Some(at) = seen {
                last = last.max(at - since);
            }
            seen.is_none()
        });
        if !pending.is_empty() && Instant::now() > since + bound {
            return Err(pending.into_iter().cloned().collect());
        }
        sleep(Duration::from_millis(1));
    }
    Ok(last)
}

/// Installs `requirement` (`name==version`) with pip into `site`, a scratch directory under the
/// target directory, unless `installed(site)` says it is there already.
pub fn pip_install(
    requirement: &str,
    site: &Path,
    installed: impl Fn(&Path) -> bool,
) -> anyhow::Result<()> {
    if installed(site) {
        return Ok(());
    }
    eprintln!(
        "bench: installing {requirement} with pip into {}",
        site.display()
    );
    let _ = std::fs::remove_dir_all(site);
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
        ])
        .arg(site)
        .arg(requirement)
        .env("PIP_ROOT_USER_ACTION", "ignore")
        .status()
        .context("cannot run python3 -m pip (Debian: apt-get install python3-pip)")?;
    if !status.success() || !installed(site) {
        bail!(
            "pip could not install {requirement} into {} (install python3 and pip, with PyPI \
             reachable)",
            site.display()
        );
    }
    Ok(())
}

/// Scenario 6 for each tool in turn; a tool that fails is left without figures, which the final
/// check reports.
pub fn idle_costs(tools: &[&dyn Tool], window: Duration) -> Vec<Cost> {
    let mut costs = Vec::new();
    for tool in tools {
        eprintln!("bench: 6. cost of an idle candidate ({})", tool.label());
        match tool.cost(window) {
            Ok(figures) => costs.extend(figures),
            Err(err) => eprintln!("bench:   failed: {err:#}"),
        }
    }
    costs
}

/// A random pause in `[0, period)`, from the standard library's hasher seeds.
pub fn random_phase(period: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    if period.is_zero() {
        return Duration::ZERO;
    }
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(Instant::now().elapsed().as_nanos());
    let fraction = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    period.mul_f64(fraction)
}

/// Waits until the server sees `n` sessions holding or waiting for `lock`.
pub fn wait_queued(tool: &dyn Tool, lock: i64, n: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let queued = tool.queued(lock)?;
        if queued == n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{}: {queued} sessions on lock {lock} after {timeout:?}, expected {n}",
                tool.label()
            );
        }
        sleep(Duration::from_millis(5));
    }
}

/// `pgleader` with the integration tests' clean environment: `binary`, or cargo's build.
pub fn pgleader_binary(binary: Option<&Path>) -> Command {
    match binary {
        Some(binary) => harness::clean(Command::new(binary)),
        None => harness::pgleader(),
    }
}

/// `pgleader run --lock-id=<lock> <options> -- sh -c <script>` against `url`, with `binary`
/// (cargo's build if `None`) and pgleader's own defaults, restart fence included (the harness
/// turns it off for tests).
pub fn run_command(
    binary: Option<&Path>,
    url: &str,
    lock: i64,
    options: &[&str],
    script: &str,
) -> Command {
    let mut command = pgleader_binary(binary);
    command
        .env_remove("PGLEADER_RESTART_FENCE")
        .env("PGLEADER_DATABASE_URL", url)
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(options)
        .args(["--", "sh", "-c", script]);
    command
}

/// `pgleader <subcommand> --lock-id=<lock>` against `url`, with `binary` (cargo's build if
/// `None`).
pub fn client_command(binary: Option<&Path>, url: &str, subcommand: &str, lock: i64) -> Command {
    let mut command = pgleader_binary(binary);
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg(subcommand)
        .arg(format!("--lock-id={lock}"));
    command
}

/// pgleader against the benchmark's PostgreSQL.
pub struct Pgleader {
    pub cluster: Arc<Cluster>,
    /// One connection for the benchmark's own queries, so that none of them pays for a
    /// connection set-up inside a measurement.
    admin: Mutex<postgres::Client>,
    /// Which binary: cargo's build (None), or another one such as the release's static binary.
    binary: Option<PathBuf>,
    label: &'static str,
    /// Options every candidate gets (such as `-v`).
    extra: &'static [&'static str],
}

impl Pgleader {
    /// The binary cargo built for the benchmark (release profile, dynamically linked).
    pub fn new(cluster: Arc<Cluster>) -> Pgleader {
        let admin = Mutex::new(cluster.client());
        Pgleader {
            cluster,
            admin,
            binary: None,
            label: "pgleader",
            extra: &[],
        }
    }

    /// The same binary against the same server, its candidates started with `extra` too.
    pub fn with_extra(&self, extra: &'static [&'static str]) -> Pgleader {
        Pgleader {
            admin: Mutex::new(self.cluster.client()),
            cluster: self.cluster.clone(),
            binary: self.binary.clone(),
            label: self.label,
            extra,
        }
    }

    /// Another binary, labelled apart in the report, against the same server.
    pub fn with_binary(cluster: Arc<Cluster>, binary: PathBuf, label: &'static str) -> Pgleader {
        Pgleader {
            binary: Some(binary),
            label,
            ..Pgleader::new(cluster)
        }
    }

    pub fn admin(&self) -> std::sync::MutexGuard<'_, postgres::Client> {
        self.admin
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Waits until the server has been up for `age`, as a long-running server would be: a
    /// server that has just started makes a new leader wait out pgleader's restart fence.
    pub fn wait_until_server_is(&self, age: Duration) -> anyhow::Result<()> {
        let row = self.admin().query_one(
            "SELECT extract(epoch FROM clock_timestamp() - greatest(pg_postmaster_start_time(), \
             (SELECT stats_reset FROM pg_stat_bgwriter)))::float8",
            &[],
        )?;
        let up = Duration::from_secs_f64(row.get::<_, f64>(0).max(0.0));
        if let Some(rest) = age.checked_sub(up) {
            std::thread::sleep(rest);
        }
        Ok(())
    }

    /// A candidate with `extra` options (such as `--http=...`) before its command.
    pub fn candidate_with(
        &self,
        tag: &str,
        lock: i64,
        proxy: Option<&Proxy>,
        extra: &[&str],
    ) -> Candidate {
        let partition: &[&str] = if proxy.is_some() {
            &PARTITION_ARGS
        } else {
            &[]
        };
        let extra = [partition, extra].concat();
        Candidate::spawn(
            tag,
            self.command_through(lock, proxy, &extra, &child_script(tag)),
        )
    }

    /// `pgleader run --lock-id=<lock> <extra> -- sh -c <script>` against the server.
    pub fn command(&self, lock: i64, extra: &[&str], script: &str) -> Command {
        self.command_through(lock, None, extra, script)
    }

    fn command_through(
        &self,
        lock: i64,
        proxy: Option<&Proxy>,
        extra: &[&str],
        script: &str,
    ) -> Command {
        let url = proxy.map_or_else(|| self.cluster.url(), Proxy::url);
        let options = [self.extra, extra].concat();
        run_command(self.binary.as_deref(), &url, lock, &options, script)
    }

    /// The server sessions of pgleader process `pid` (its session name ends `:<pid>@<host>`).
    pub fn backends_of(&self, pid: i32) -> anyhow::Result<Vec<i32>> {
        let rows = self.admin().query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1",
            &[&format!("%:{pid}@%")],
        )?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// The cost of an idle leader and follower started with `extra` options, reported under
    /// `roles`.
    pub fn cost_with(
        &self,
        window: Duration,
        extra: &[&str],
        roles: [&'static str; 2],
    ) -> anyhow::Result<Vec<Cost>> {
        self.log_statements(true)?;
        let measured = (|| {
            let lock = harness::unique_lock();
            let leader = self.candidate_with("A", lock, None, extra);
            let (line, _) = leader
                .started(None, SETUP_WAIT)
                .with_context(|| format!("the leader never started\n{}", leader.dump()))?;
            let follower = self.candidate_with("B", lock, None, extra);
            wait_queued(self, lock, 2, SETUP_WAIT)?;
            let waiting = follower
                .logged("waiting for the lock", SETUP_WAIT)
                .context("the follower never logged that it waits")?;
            let follower_backend: i32 = field(&waiting, "backend_pid").parse()?;
            let leader_backend: i32 = field(&line, "backend").parse()?;
            // The follower's one blocking statement and the leader's start stay out of the
            // window.
            sleep(SETTLE * 3);
            let log_mark = self.cluster.log().len();
            // pgleader's only children are keepers: the leader's runs the command, the
            // follower's is parked, waiting for the leadership.
            let keepers =
                [leader.pid(), follower.pid()].map(|pid| procfs::children(pid).first().copied());
            let usage =
                Usage::measure_with_keepers(&[leader.pid(), follower.pid()], &keepers, window);
            let statements = self.statements_since(log_mark);
            let per_second = |backend: i32| {
                statements.get(&backend).copied().unwrap_or(0) as f64 / window.as_secs_f64()
            };
            let how = "statements in the server log (log_statement = all) from its backend pid";
            Ok(vec![
                usage.cost(0, self.label(), roles[0], per_second(leader_backend), how),
                usage.cost(1, self.label(), roles[1], per_second(follower_backend), how),
            ])
        })();
        self.log_statements(false)?;
        measured
    }

    /// The server's settings that decide what a commit waits for, as it reports them.
    pub fn durability(&self) -> anyhow::Result<String> {
        let row = self.admin().query_one(
            "SELECT current_setting('fsync'), current_setting('synchronous_commit'), \
             current_setting('full_page_writes')",
            &[],
        )?;
        Ok(format!(
            "fsync={}, synchronous_commit={}, full_page_writes={}",
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2)
        ))
    }

    pub fn server_version(&self) -> anyhow::Result<String> {
        let row = self.admin().query_one("SELECT version()", &[])?;
        Ok(row.get(0))
    }

    /// Makes the server log every statement with the pid of the backend that ran it, so that
    /// statements can be counted per session; or stops it.
    pub fn log_statements(&self, on: bool) -> anyhow::Result<()> {
        let mut admin = self.admin();
        // ALTER SYSTEM refuses to run in a transaction block: one statement at a time.
        let statements: &[&str] = if on {
            &[
                "ALTER SYSTEM SET log_statement = 'all'",
                "ALTER SYSTEM SET log_line_prefix = 'pid=%p '",
            ]
        } else {
            &[
                "ALTER SYSTEM RESET log_statement",
                "ALTER SYSTEM RESET log_line_prefix",
            ]
        };
        for statement in statements {
            admin.batch_execute(statement)?;
        }
        admin.batch_execute("SELECT pg_reload_conf()")?;
        drop(admin);
        // The postmaster applies a reload asynchronously; new sessions must see it.
        sleep(Duration::from_millis(500));
        Ok(())
    }

    /// Statements per backend pid in the server log from byte `from` on.
    pub fn statements_since(&self, from: usize) -> HashMap<i32, u64> {
        let log = self.cluster.log();
        let mut counts = HashMap::new();
        for line in log.get(from..).unwrap_or_default().lines() {
            let Some(rest) = line.strip_prefix("pid=") else {
                continue;
            };
            let Some((pid, message)) = rest.split_once(' ') else {
                continue;
            };
            // Simple-protocol statements log as `statement:`, extended-protocol ones (what
            // pgleader sends) as `execute <name>:`.
            if (message.starts_with("LOG:  statement:") || message.starts_with("LOG:  execute "))
                && let Ok(pid) = pid.parse()
            {
                *counts.entry(pid).or_default() += 1;
            }
        }
        counts
    }
}

impl Pgleader {
    /// `pgleader <subcommand> --lock-id=<lock>` against the server, with this binary.
    pub fn client(&self, subcommand: &str, lock: i64) -> Command {
        client_command(
            self.binary.as_deref(),
            &self.cluster.url(),
            subcommand,
            lock,
        )
    }
}

/// PostgreSQL ends a session with `pg_terminate_backend`: the leader's child prints its
/// backend pid.
impl LockServer for Pgleader {
    fn end_session(&self, leader_line: &str) -> anyhow::Result<Instant> {
        let backend: i32 = field(leader_line, "backend")
            .parse()
            .with_context(|| format!("no backend pid in {leader_line:?}"))?;
        let mut admin = self.admin();
        let fault = Instant::now();
        let terminated: bool = admin
            .query_one("SELECT pg_terminate_backend($1)", &[&backend])?
            .get(0);
        if !terminated {
            bail!("no session with backend pid {backend}");
        }
        Ok(fault)
    }

    fn pids(&self) -> Vec<i32> {
        let postmaster = std::fs::read_to_string(self.cluster.data.join("postmaster.pid"))
            .ok()
            .and_then(|text| text.lines().next()?.trim().parse::<i32>().ok());
        match postmaster {
            Some(pid) => {
                let mut pids = procfs::children(pid);
                pids.push(pid);
                pids
            }
            None => Vec::new(),
        }
    }

    fn port(&self) -> u16 {
        self.cluster.port
    }
}

impl Tool for Pgleader {
    fn label(&self) -> &'static str {
        self.label
    }

    fn candidate(&self, tag: &str, lock: i64, proxy: Option<&Proxy>) -> Candidate {
        self.candidate_with(tag, lock, proxy, &[])
    }

    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        let row = self.admin().query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&lock],
        )?;
        Ok(row.get::<_, i64>(0) as usize)
    }

    fn server(&self) -> &dyn LockServer {
        self
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(10)
    }

    fn why_never(&self) -> &'static str {
        "unexpected: a bug in pgleader or in the benchmark"
    }

    fn step_down(&self, lock: i64) -> Option<Command> {
        Some(self.client("step-down", lock))
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        self.cost_with(window, &[], ["leader", "follower"])
    }
}

/// Resident memory at the end of a window and CPU time over it, per process.
pub struct Usage {
    window: Duration,
    rss: Vec<Option<u64>>,
    cpu: Vec<Duration>,
    /// Each process's keeper, if it has one: a leader's runs its command, a follower's waits,
    /// parked.
    keeper_rss: Vec<Option<u64>>,
    keeper_cpu: Vec<Option<Duration>>,
}

impl Usage {
    /// Sleeps through `window`, measuring `pids` (and a keeper of the first, measured on its
    /// own).
    pub fn measure(pids: &[i32], keeper: Option<i32>, window: Duration) -> Usage {
        let mut keepers = vec![None; pids.len()];
        if let Some(first) = keepers.first_mut() {
            *first = keeper;
        }
        Usage::measure_with_keepers(pids, &keepers, window)
    }

    /// Sleeps through `window`, measuring `pids` and, on their own, each one's keeper.
    pub fn measure_with_keepers(pids: &[i32], keepers: &[Option<i32>], window: Duration) -> Usage {
        let meters: Vec<CpuMeter> = pids.iter().map(|pid| CpuMeter::start(&[*pid])).collect();
        let keeper_meters: Vec<Option<CpuMeter>> = keepers
            .iter()
            .map(|keeper| keeper.map(|pid| CpuMeter::start(&[pid])))
            .collect();
        sleep(window);
        Usage {
            window,
            rss: pids.iter().map(|pid| procfs::rss_kib(*pid)).collect(),
            cpu: pids
                .iter()
                .zip(&meters)
                .map(|(pid, meter)| meter.used(&[*pid]))
                .collect(),
            keeper_rss: keepers
                .iter()
                .map(|keeper| keeper.and_then(procfs::rss_kib))
                .collect(),
            keeper_cpu: keepers
                .iter()
                .zip(&keeper_meters)
                .map(|(keeper, meter)| Some(meter.as_ref()?.used(&[(*keeper)?])))
                .collect(),
        }
    }

    /// The cost row of the `index`-th process measured.
    pub fn cost(
        &self,
        index: usize,
        tool: &'static str,
        role: &'static str,
        requests_per_second: f64,
        requests_how: &'static str,
    ) -> Cost {
        Cost {
            tool,
            role,
            window: self.window,
            rss_kib: self.rss[index],
            keeper_rss_kib: self.keeper_rss.get(index).copied().flatten(),
            cpu: self.cpu[index],
            keeper_cpu: self.keeper_cpu.get(index).copied().flatten(),
            requests_per_second: Some(requests_per_second),
            requests_how,
        }
    }
}

/// The first line a command prints, empty if it cannot run: a tool's version.
pub fn first_line(command: &mut Command) -> String {
    command
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_default()
}
