//! What the integration tests share: a real PostgreSQL cluster, pgleader processes with their
//! output captured, and small helpers to build child commands.

pub mod certs;
pub mod cluster;
pub mod fleet;
pub mod http;
pub mod monitor;
pub mod namespace;
pub mod nemesis;
pub mod pg;
pub mod pgbouncer;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod shards;
pub mod spawner;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};

pub use cluster::Cluster;
pub use process::{
    Proc, Stream, WAIT, assert_permanent_error, is_running, keepers_of, kill_9, pid_field,
    poll_until, wait_gone,
};
pub use proxy::Proxy;
pub use redis::Redis;

/// A lock key no other test uses.
pub fn unique_lock() -> i64 {
    static NEXT: AtomicI64 = AtomicI64::new(1_000);
    NEXT.fetch_add(1, Ordering::SeqCst)
}

/// An empty HOME, so no test reads the developer's ~/.pgpass.
pub fn empty_home() -> &'static PathBuf {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pgleader-test-home-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the test HOME");
        dir
    })
}

/// `pgleader` with a clean environment (no PG* variables from the developer's shell).
///
/// The restart fence is off: test clusters are seconds old, and tests of other behaviour
/// should not wait it out. The tests of the fence turn it back on with --restart-fence.
pub fn pgleader() -> Command {
    clean(Command::new(env!("CARGO_BIN_EXE_pgleader")))
}

/// `pgleader` started by another program (`unshare ... pgleader`), with the same clean
/// environment.
pub fn pgleader_under(wrapper: &[&str]) -> Command {
    let mut command = Command::new(wrapper[0]);
    command
        .args(&wrapper[1..])
        .arg(env!("CARGO_BIN_EXE_pgleader"));
    clean(command)
}

/// The clean environment of [`pgleader`], for another pgleader binary (the release's static
/// one, in the release tests and the benchmark).
pub fn clean(mut command: Command) -> Command {
    command
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .env("HOME", empty_home())
        .env("PGLEADER_RESTART_FENCE", "0");
    command
}

/// Fails the test, saying what to install, unless `tool` is on PATH.
pub fn require_tool(tool: &str, needed_because: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()));
    assert!(found, "{tool} is not installed: {needed_because}");
}

/// `pgleader run --lock-id <lock> <args...> -- sh -c <script>` against `cluster`.
pub fn run(name: &str, cluster: &Cluster, lock: i64, args: &[&str], script: &str) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// A child that reports its start and the signals it gets, and otherwise waits forever.
/// It prints `<tag> started <pid>`, `<tag> got <SIG>` for each signal, and exits 0 on TERM
/// and INT.
pub fn patient_child(tag: &str) -> String {
    format!(
        "trap 'echo {tag} got TERM; exit 0' TERM; \
         trap 'echo {tag} got INT; exit 0' INT; \
         trap 'echo {tag} got HUP' HUP; \
         trap 'echo {tag} got QUIT' QUIT; \
         trap 'echo {tag} got USR1' USR1; \
         trap 'echo {tag} got USR2' USR2; \
         trap 'echo {tag} got WINCH' WINCH; \
         echo {tag} started $$ lock=$PGLEADER_LOCK_ID name=$PGLEADER_LOCK_NAME backend=$PGLEADER_BACKEND_PID epoch=$PGLEADER_EPOCH; \
         while :; do sleep 1000 & wait $!; done"
    )
}

/// Kills a leading pgleader -9, `rounds` times, while its command's tree takes a moment to die,
/// and asserts that the next leader's command never starts before the last of that tree is
/// gone. `start(name, script)` starts a pgleader running `script` on the test's lock.
///
/// The tree: the command, a grandchild, one that left the group with setsid, and one holding
/// 2 GiB, whose death after SIGKILL (freeing it) takes about 100 to 170 ms. The next leader's
/// command looks for every one of them the moment it starts. Were the lock freed when pgleader
/// died rather than when its keeper is done, the next command would start during that death.
pub fn kill_9_never_overlaps_the_dying_tree(
    tag: &str,
    rounds: usize,
    start: impl Fn(&str, &str) -> Proc,
) {
    kill_9_never_overlaps(tag, rounds, 1, start);
}

/// [`kill_9_never_overlaps_the_dying_tree`] with a tree of 41 processes: the command, 20
/// children, 19 that left the group with setsid, and the one holding 2 GiB. Returns, for each
/// round, how long after the kill the next leader's command was seen to start.
pub fn kill_9_never_overlaps_a_41_process_tree(
    tag: &str,
    rounds: usize,
    start: impl Fn(&str, &str) -> Proc,
) -> Vec<std::time::Duration> {
    kill_9_never_overlaps(tag, rounds, 20, start)
}

/// The tree-order rounds, over a tree of the command, `wide` children and `wide - 1` (at least
/// one) that left the group, and one holding 2 GiB.
fn kill_9_never_overlaps(
    tag: &str,
    rounds: usize,
    wide: usize,
    start: impl Fn(&str, &str) -> Proc,
) -> Vec<std::time::Duration> {
    let pids = std::env::temp_dir().join(format!(
        "pgleader-{tag}-{}-{}.pids",
        std::process::id(),
        unique_lock()
    ));
    let children = format!("sleep 1000 & echo $! >> {p}; ", p = pids.display()).repeat(wide);
    let left = format!("setsid sleep 1000 & echo $! >> {p}; ", p = pids.display())
        .repeat(wide.saturating_sub(1).max(1));
    let tree = format!(
        "{children}{left}\
         python3 -c 'import time; b = b\"\\x01\" * (2 << 30); print(\"A big\", flush=True); time.sleep(1000)' & echo $! >> {p}; \
         echo $$ >> {p}; echo A started; wait",
        p = pids.display()
    );
    let check = format!(
        "for pid in $(cat {p}); do if kill -0 $pid 2>/dev/null; then echo B overlap $pid; fi; done; \
         echo B started; exec sleep 1000",
        p = pids.display()
    );
    let mut takeovers = Vec::new();
    for round in 0..rounds {
        let _ = std::fs::remove_file(&pids);
        let a = start("A", &tree);
        a.wait_stdout("A started");
        a.wait_stdout("A big");
        let b = start("B", &check);
        b.wait_log("waiting for the lock");
        let killed = std::time::Instant::now();
        a.signal(nix::sys::signal::Signal::SIGKILL);
        b.wait_stdout("B started");
        takeovers.push(killed.elapsed());
        let overlaps = overlaps_seen(&b);
        assert!(
            overlaps.is_empty(),
            "round {round}: the next command started while the old tree still ran: {overlaps:?}"
        );
        b.signal(nix::sys::signal::Signal::SIGKILL);
        b.wait_exit();
    }
    let _ = std::fs::remove_file(&pids);
    takeovers
}

/// The lines in which a command that checked the old leader's tree at its start named a
/// process of that tree still alive (`B overlap PID`).
pub fn overlaps_seen(next: &Proc) -> Vec<String> {
    next.lines(Stream::Stdout)
        .into_iter()
        .filter(|line| line.contains("overlap"))
        .collect()
}

/// The values of `key=` lines in a systemd unit file.
pub fn unit_values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

/// When a log line (text format) was written.
pub fn log_time(line: &str) -> std::time::SystemTime {
    let stamp = line.split_whitespace().next().unwrap_or_default();
    humantime::parse_rfc3339(stamp).unwrap_or_else(|err| panic!("no timestamp in {line:?}: {err}"))
}

/// The value after `key=` in a line such as `A started 42 backend=17`.
pub fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .trim_matches('"')
        .to_owned()
}

/// What a `pgleader cron` job printed, from a tagged log line of its (text format): the text
/// without pgleader's time, level and tag; `None` for any other line.
pub fn printed(line: &str) -> Option<String> {
    if !line.contains(" stream=std") {
        return None;
    }
    let (_, rest) = line.split_once(" INFO  ")?;
    let (text, _) = rest.rsplit_once(" job=")?;
    Some(text.to_owned())
}

/// Bounds an async step of a test, as every wait in the suite is bounded.
pub async fn within<T>(what: &str, step: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, step)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {WAIT:?}"))
}

/// The pid a child printed as the third word of a line: `<tag> started <pid>`,
/// `<tag> escaped <pid>`.
pub fn pid_in(line: &str) -> i32 {
    line.split_whitespace()
        .nth(2)
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"))
}

/// Asserts that `pgleader run --lock-id=1 ARGS -- true` is a usage error (status 2) whose
/// message contains `expected`; the server it names is never reached (usage comes first).
pub fn assert_usage_error(args: &[&str], expected: &str) {
    let mut command = pgleader();
    command
        .env(
            "PGLEADER_DATABASE_URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .args(["run", "--lock-id=1"])
        .args(args)
        .args(["--", "true"]);
    let proc = Proc::spawn("usage", command);
    let (status, _, stderr) = proc.finish();
    let stderr = stderr.join("\n");
    assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.contains(expected),
        "{args:?}: expected {expected:?} in {stderr}"
    );
}

/// `pgleader run` through another connection string (a proxy, a pooler, a standby).
pub fn run_with_url(name: &str, url: &str, lock: i64, args: &[&str], script: &str) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// `pgleader run --lock <lock> <args...> -- sh -c <script>` against `url` (Redis locks are
/// named in their keys, so the Redis tests name theirs).
pub fn run_named(name: &str, url: &str, lock: &str, args: &[&str], script: &str) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("run")
        .arg(format!("--lock={lock}"))
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// A file the children of one test append to, to prove the order of their runs.
pub struct Journal {
    pub path: PathBuf,
}

impl Journal {
    pub fn new(tag: &str) -> Journal {
        let path = std::env::temp_dir().join(format!(
            "pgleader-journal-{}-{tag}-{}",
            std::process::id(),
            unique_lock()
        ));
        let _ = std::fs::remove_file(&path);
        Journal { path }
    }

    /// Shell text that appends `line` to the journal.
    pub fn append(&self, line: &str) -> String {
        format!("echo {line} >> {}", self.path.display())
    }

    pub fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Journal {
    /// A command that journals `<tag>-started`, prints `<tag> started backend=<pid>`, and on
    /// TERM takes `stop_seconds` to shut down, journals `<tag>-stopped` and exits 0.
    pub fn child(&self, tag: &str, stop_seconds: &str) -> String {
        format!(
            "trap 'sleep {stop_seconds}; {}; exit 0' TERM; {}; echo {tag} started backend=$PGLEADER_BACKEND_PID; while :; do sleep 1000 & wait $!; done",
            self.append(&format!("{tag}-stopped")),
            self.append(&format!("{tag}-started"))
        )
    }
}

impl Journal {
    /// A command that journals `<tag>-started`, prints `<tag> started` and waits, dying at
    /// once on TERM.
    pub fn quick_child(&self, tag: &str) -> String {
        format!(
            "{}; echo {tag} started; exec sleep 1000",
            self.append(&format!("{tag}-started"))
        )
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
