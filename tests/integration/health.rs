//! Health-gated leadership (`--health-cmd`), on PostgreSQL and on one Redis server: a leader
//! whose probe starts failing is replaced within interval × retries and a margin, after its
//! command got the stop signal; an unhealthy replica neither queues nor leads until its probe
//! passes, even alone; a hanging probe is killed with its whole tree; `/healthz`, `/status` and
//! `/metrics` show the probe; bad values are usage errors.
//!
//! The probe is `test -e FILE`, so each test decides when a replica is healthy. The logs are
//! JSON, so that the tests wait for events by name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::harness::fleet::on_both_backends;
use crate::harness::http::{get, wait_for_status};
use crate::harness::process::wait_gone;
use crate::harness::{Cluster, Proc, Redis, Stream, patient_child, run_with_url, unique_lock};

const INTERVAL: Duration = Duration::from_millis(200);
const RETRIES: u32 = 3;
/// What replacing a leader may take beyond interval × retries: three probes' own run time (a
/// keeper and a shell each), stopping the command, releasing, and the follower's start.
const MARGIN: Duration = Duration::from_millis(1200);

/// The servers the tests run against.
#[derive(Clone, Copy, Debug)]
enum Server {
    Postgres,
    Redis,
}

impl Server {
    fn url(self) -> String {
        match self {
            Server::Postgres => Cluster::shared().url(),
            Server::Redis => Redis::shared().url(),
        }
    }
}

/// A file whose existence is a replica's health.
struct Switch(PathBuf);

impl Switch {
    fn new(tag: &str, on: bool) -> Switch {
        let path = std::env::temp_dir().join(format!(
            "pgleader-health-{tag}-{}-{}",
            std::process::id(),
            unique_lock()
        ));
        let switch = Switch(path);
        switch.set(on);
        switch
    }

    fn set(&self, on: bool) {
        if on {
            std::fs::write(&self.0, "").expect("create the health file");
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn probe(&self) -> String {
        format!("--health-cmd=test -e {}", self.0.display())
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn health_args(probe: &str) -> Vec<String> {
    vec![
        probe.to_owned(),
        format!("--health-interval={}ms", INTERVAL.as_millis()),
        "--health-timeout=2s".to_owned(),
        format!("--health-retries={RETRIES}"),
        "--log-format=json".to_owned(),
        "--check-interval=200ms".to_owned(),
        "--check-timeout=500ms".to_owned(),
        "--kill-timeout=2s".to_owned(),
        "--lease=10s".to_owned(),
    ]
}

fn start(server: Server, name: &str, lock: i64, args: &[String], script: &str) -> Proc {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_with_url(name, &server.url(), lock, &args, script)
}

fn event(name: &str) -> String {
    format!("\"event\":\"{name}\"")
}

/// How many lines of `stream` contain `needle` so far.
fn count(process: &Proc, stream: Stream, needle: &str) -> usize {
    process
        .lines(stream)
        .iter()
        .filter(|line| line.contains(needle))
        .count()
}

/// Two healthy replicas of one lock: A leads, B waits.
struct Pair {
    a_health: Switch,
    b_health: Switch,
    a: Proc,
    b: Proc,
}

impl Pair {
    fn start(server: Server) -> Pair {
        Pair::start_with(server, false)
    }

    /// With `sharded`, two shards: A runs one, B the other.
    fn start_with(server: Server, sharded: bool) -> Pair {
        let lock = unique_lock();
        let (a_health, b_health) = (Switch::new("a", true), Switch::new("b", true));
        let args = |health: &Switch| {
            let mut args = health_args(&health.probe());
            if sharded {
                args.push("--shards=2".to_owned());
            }
            args
        };
        let child = |tag: &str| {
            if sharded {
                shard_child(tag)
            } else {
                patient_child(tag)
            }
        };
        let a = start(server, "A", lock, &args(&a_health), &child("A"));
        a.wait_for_nth(Stream::Stdout, "A started", if sharded { 2 } else { 1 });
        let b = start(server, "B", lock, &args(&b_health), &child("B"));
        if sharded {
            // A hands one shard over to B: one each.
            a.wait_stdout("A got TERM");
            b.wait_stdout("B started shard");
        } else {
            b.wait_log(&event("waiting"));
        }
        Pair {
            a_health,
            b_health,
            a,
            b,
        }
    }
}

fn a_failing_leader_is_replaced_and_comes_back_only_once_healthy(server: Server) {
    let Pair {
        a_health,
        b_health: _b_health,
        a,
        b,
    } = Pair::start(server);

    let failing = Instant::now();
    a_health.set(false);
    a.wait_stdout("A got TERM");
    b.wait_stdout("B started");
    let took = failing.elapsed();
    let bound = INTERVAL * RETRIES + MARGIN;
    eprintln!("health: leader replaced {took:?} after its probe began to fail");
    assert!(
        took <= bound,
        "replaced after {took:?}, more than {bound:?}\n{}\n{}",
        a.dump(),
        b.dump()
    );
    a.wait_log(&event("unhealthy"));
    a.wait_log(&event("released"));
    a.wait_log(&event("health_wait"));

    // Unhealthy and alone once B goes: A never queues or leads until its probe passes.
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
    leads_only_once_healthy(&a, "A", &a_health);
}

/// `process` (whose command prints "`tag` started"), unhealthy and alone, neither queues nor
/// leads over four more of its probes; once `health` is back on, it queues and leads.
fn leads_only_once_healthy(process: &Proc, tag: &str, health: &Switch) {
    let started = format!("{tag} started");
    let (leaderships, waits, failed) = (
        count(process, Stream::Stdout, &started),
        count(process, Stream::Stderr, &event("waiting")),
        count(process, Stream::Stderr, &event("health_failed")),
    );
    process.wait_for_nth(Stream::Stderr, &event("health_failed"), failed + 4);
    assert_eq!(
        count(process, Stream::Stdout, &started),
        leaderships,
        "an unhealthy replica led\n{}",
        process.dump()
    );
    assert_eq!(
        count(process, Stream::Stderr, &event("waiting")),
        waits,
        "an unhealthy replica queued\n{}",
        process.dump()
    );
    health.set(true);
    process.wait_log(&event("healthy"));
    process.wait_for_nth(Stream::Stdout, &started, leaderships + 1);
    process.signal(Signal::SIGTERM);
    process.wait_exit();
}

fn a_follower_that_turns_unhealthy_leaves_the_queue(server: Server) {
    let Pair {
        a_health: _a_health,
        b_health,
        a,
        b,
    } = Pair::start(server);
    b_health.set(false);
    b.wait_log(&event("left_queue"));
    // The leader goes: the unhealthy follower must not take over.
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    leads_only_once_healthy(&b, "B", &b_health);
}

fn a_lone_unhealthy_replica_never_starts_its_command_and_says_so(server: Server) {
    let lock = unique_lock();
    let health = Switch::new("lone", false);
    // A probe that prints what it authenticates with: the log may show it, HTTP never.
    let probe = health.probe().replacen("--health-cmd=", "", 1);
    let mut args = health_args(&format!("--health-cmd=echo token=hunter2 >&2; {probe}"));
    args.push("--http=127.0.0.1:0".to_owned());
    let a = start(server, "A", lock, &args, &patient_child("A"));
    let line = a.wait_log(&event("http"));
    let log: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    let http: std::net::SocketAddr = log["address"]
        .as_str()
        .and_then(|address| address.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line}"));
    a.wait_log(&event("health_wait"));

    // Starting: no probe has passed.
    let (reply, _) = wait_for_status(http, "/healthz", 503);
    assert!(
        reply.body.contains("starting") || reply.body.contains("unhealthy"),
        "{}",
        reply.body
    );

    a.wait_log(&event("unhealthy"));
    a.wait_for_nth(Stream::Stderr, &event("health_failed"), 6);
    assert_eq!(count(&a, Stream::Stdout, "A started"), 0, "{}", a.dump());
    assert_eq!(count(&a, Stream::Stderr, &event("child_started")), 0);
    assert_eq!(count(&a, Stream::Stderr, &event("waiting")), 0);
    let failure = a.wait_log(&event("health_failed"));
    assert!(failure.contains("exit code 1"), "{failure}");
    assert!(failure.contains("token=hunter2"), "{failure}");

    let healthz = get(http, "/healthz");
    assert_eq!(healthz.status, 503, "{}", healthz.body);
    assert!(healthz.body.starts_with("unhealthy:"), "{}", healthz.body);
    assert!(!healthz.body.contains("hunter2"), "{}", healthz.body);
    let status = get(http, "/status").json();
    assert!(!status.to_string().contains("hunter2"), "{status}");
    assert_eq!(status["healthy"], false, "{status}");
    assert_eq!(status["health"]["state"], "unhealthy", "{status}");
    assert!(
        status["health"]["consecutive_failures"].as_u64() >= Some(u64::from(RETRIES)),
        "{status}"
    );
    assert!(
        status["health"]["last_failure"]["reason"]
            .as_str()
            .is_some_and(|reason| reason.starts_with("exit code 1")),
        "{status}"
    );
    assert!(
        status["health"]["last_failure"]["at"].is_string(),
        "{status}"
    );
    let metrics = get(http, "/metrics").body;
    assert!(
        shows(&metrics, "pgleader_health_ok", |line| line.ends_with("} 0")),
        "{metrics}"
    );
    assert!(
        shows(&metrics, "pgleader_health_checks_total", |line| {
            line.contains("result=\"failed\"") && !line.ends_with("} 0")
        }),
        "{metrics}"
    );

    health.set(true);
    a.wait_log(&event("healthy"));
    a.wait_stdout("A started");
    wait_for_status(http, "/healthz", 200);
    let status = get(http, "/status").json();
    assert_eq!(status["health"]["state"], "healthy", "{status}");
    assert_eq!(status["health"]["consecutive_failures"], 0, "{status}");
    let metrics = get(http, "/metrics").body;
    assert!(
        shows(&metrics, "pgleader_health_ok", |line| line.ends_with("} 1")),
        "{metrics}"
    );
    a.signal(Signal::SIGTERM);
    a.wait_exit();
}

/// A shard's command: prints "`tag` started shard N" and "`tag` got TERM N", waits forever.
fn shard_child(tag: &str) -> String {
    format!(
        "trap 'echo {tag} got TERM $PGLEADER_SHARD; exit 0' TERM; \
         echo {tag} started shard $PGLEADER_SHARD; \
         while :; do sleep 1000 & wait $!; done"
    )
}

fn an_unhealthy_sharded_replica_gives_up_every_shard_until_healthy(server: Server) {
    let Pair {
        a_health,
        b_health: _b_health,
        a,
        b,
    } = Pair::start_with(server, true);

    let failing = Instant::now();
    a_health.set(false);
    a.wait_for_nth(Stream::Stdout, "A got TERM", 2);
    b.wait_for_nth(Stream::Stdout, "B started shard", 2);
    let took = failing.elapsed();
    eprintln!("health: shards moved {took:?} after the probe began to fail");
    assert!(
        took <= INTERVAL * RETRIES + MARGIN,
        "shards moved after {took:?}\n{}\n{}",
        a.dump(),
        b.dump()
    );
    a.wait_log(&event("health_step_down"));
    a.wait_log(&event("health_wait"));

    // Alone once B goes: A runs no shard until its probe passes, then both.
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
    let started = count(&a, Stream::Stdout, "A started shard");
    let failed = count(&a, Stream::Stderr, &event("health_failed"));
    a.wait_for_nth(Stream::Stderr, &event("health_failed"), failed + 4);
    assert_eq!(
        count(&a, Stream::Stdout, "A started shard"),
        started,
        "an unhealthy replica ran a shard\n{}",
        a.dump()
    );
    a_health.set(true);
    a.wait_log(&event("healthy"));
    a.wait_for_nth(Stream::Stdout, "A started shard", started + 2);
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
}

on_both_backends! { Server::Postgres, Server::Redis;
    a_failing_leader_is_replaced_and_comes_back_only_once_healthy:
        postgres_a_failing_leader_is_replaced_and_comes_back_only_once_healthy,
        redis_a_failing_leader_is_replaced_and_comes_back_only_once_healthy;
    a_follower_that_turns_unhealthy_leaves_the_queue:
        postgres_a_follower_that_turns_unhealthy_leaves_the_queue,
        redis_a_follower_that_turns_unhealthy_leaves_the_queue;
    a_lone_unhealthy_replica_never_starts_its_command_and_says_so:
        postgres_a_lone_unhealthy_replica_never_starts_its_command_and_says_so,
        redis_a_lone_unhealthy_replica_never_starts_its_command_and_says_so;
    an_unhealthy_sharded_replica_gives_up_every_shard_until_healthy:
        postgres_an_unhealthy_sharded_replica_gives_up_every_shard_until_healthy,
        redis_an_unhealthy_sharded_replica_gives_up_every_shard_until_healthy;
}

/// Whether `/metrics` shows a series of `metric` whose line passes `test`.
fn shows(metrics: &str, metric: &str, test: impl Fn(&str) -> bool) -> bool {
    metrics
        .lines()
        .any(|line| line.starts_with(&format!("{metric}{{")) && test(line))
}

/// A file of this test's own for a probe to write to, `what` naming what it holds.
fn scratch_file(what: &str, lock: i64) -> PathBuf {
    std::env::temp_dir().join(format!(
        "pgleader-health-{what}-{}-{lock}",
        std::process::id()
    ))
}

/// The pids a probe wrote, one a line.
fn pids_in(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

#[test]
fn a_hanging_probe_is_killed_at_its_timeout_with_its_whole_tree() {
    let lock = unique_lock();
    let pids = scratch_file("hang-pids", lock);
    let _ = std::fs::remove_file(&pids);
    // A grandchild in the probe's group, one that left it with setsid, and the probe itself.
    let probe = format!(
        "--health-cmd=sleep 1000 & echo $! >> {p}; setsid sleep 1000 & echo $! >> {p}; echo $$ >> {p}; echo hanging now; wait",
        p = pids.display()
    );
    let args = vec![
        probe,
        "--health-interval=10s".to_owned(),
        "--health-timeout=300ms".to_owned(),
        "--health-retries=1".to_owned(),
        "--log-format=json".to_owned(),
    ];
    let a = start(Server::Postgres, "A", lock, &args, &patient_child("A"));
    let failure = a.wait_log(&event("health_failed"));
    assert!(failure.contains("timed out after 300ms"), "{failure}");
    assert!(
        failure.contains("hanging now"),
        "the output is quoted: {failure}"
    );
    let started = pids_in(&pids);
    assert_eq!(started.len(), 3, "{started:?}\n{}", a.dump());
    for pid in started {
        assert!(
            wait_gone(pid, Duration::from_secs(2)),
            "probe process {pid} outlived its timeout\n{}",
            a.dump()
        );
    }
    assert_eq!(count(&a, Stream::Stdout, "A started"), 0, "{}", a.dump());
    // A replica out of the election shuts down at once.
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    let _ = std::fs::remove_file(&pids);
}

#[test]
fn the_probe_runs_outside_the_command_s_process_group() {
    let lock = unique_lock();
    let groups = scratch_file("pgid", lock);
    let probe = format!(
        "--health-cmd=awk '{{print $5}}' /proc/$$/stat > {}",
        groups.display()
    );
    let args = vec![
        probe,
        "--health-interval=100ms".to_owned(),
        "--log-format=json".to_owned(),
    ];
    let a = start(
        Server::Postgres,
        "A",
        lock,
        &args,
        "echo A group $(awk '{print $5}' /proc/$$/stat); exec sleep 1000",
    );
    let line = a.wait_stdout("A group");
    let command_group: i32 = line
        .rsplit(' ')
        .next()
        .and_then(|pgid| pgid.trim().parse().ok())
        .unwrap_or_else(|| panic!("no group in {line:?}"));
    let probe_group: i32 = std::fs::read_to_string(&groups)
        .expect("the probe wrote its group")
        .trim()
        .parse()
        .expect("a process group");
    assert_ne!(probe_group, command_group, "{}", a.dump());
    assert_ne!(probe_group, a.pid.as_raw(), "not pgleader's group either");
    a.signal(Signal::SIGTERM);
    a.wait_exit();
    let _ = std::fs::remove_file(&groups);
}

#[test]
fn bad_health_values_are_usage_errors() {
    let url = Some("postgres://postgres@127.0.0.1:1/postgres");
    let cases: &[(&[&str], &str)] = &[
        (&["--health-cmd="], "a shell command line must not be empty"),
        (
            &["--health-cmd=true", "--health-interval=0s"],
            "must be greater than 0",
        ),
        (
            &["--health-cmd=true", "--health-timeout=soon"],
            "expected a duration",
        ),
        (
            &["--health-cmd=true", "--health-retries=0"],
            "--health-retries",
        ),
        (&["--health-interval=1s"], "--health-cmd"),
        (
            &["--health-cmd=true", "--no-wait"],
            "--health-cmd cannot be used with --no-wait",
        ),
        (
            &["--health-cmd=true", "--once", "--schedule=0 3 * * *"],
            "--health-cmd cannot be used with --schedule --once",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["run", "--lock-id=1"];
        args.extend_from_slice(extra);
        args.extend(["--", "true"]);
        let (code, stderr) = crate::usage::outcome(url, &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
