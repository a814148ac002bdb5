//! Scheduled jobs (`--schedule`): each occurrence starts at most once across replicas and
//! timers, on the server's clock, through kill -9, pg_terminate_backend, a server restart and
//! skewed host clocks; missed, interrupted, skipped and mismatched occurrences are handled and
//! recorded as docs/scheduled-jobs.md says.
//!
//! Every job appends `<occurrence> <epoch> <attempt> <tag>` to a journal file when it starts,
//! so the journal is the ground truth of what ran; the ledger is checked against it.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, SubsecRound, Utc};
use nix::sys::signal::Signal;

use crate::harness::process::poll_until;
use crate::harness::{
    Cluster, Journal, Proc, Redis, Stream, WAIT, assert_usage_error, pgleader, unique_lock,
};
use crate::quorum::CLI_TIMINGS;

/// Every two seconds: fast enough for tests, slow enough for a 2-core machine under load.
const EVERY_TWO_SECONDS: &str = "*/2 * * * * *";

/// A ledger table no other test uses.
fn unique_table() -> String {
    format!("ledger_{}", unique_lock())
}

/// A lock and a ledger table of the test's own on a cluster (the shared one unless a test
/// needs its own), and a journal.
struct Setup {
    url: String,
    lock: i64,
    table: String,
    journal: Journal,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        Setup::on(Cluster::shared(), tag)
    }

    fn on(cluster: &Cluster, tag: &str) -> Setup {
        Setup {
            url: cluster.url(),
            lock: unique_lock(),
            table: unique_table(),
            journal: Journal::new(tag),
        }
    }

    /// A replica on `schedule` whose job (tagged `tag`) takes `seconds`.
    fn replica(&self, tag: &str, schedule: &str, args: &[&str], seconds: &str) -> Proc {
        self.replica_of(self.lock, tag, schedule, args, seconds)
    }

    /// [`Setup::replica`] of another lock, with the setup's table and journal.
    fn replica_of(
        &self,
        lock: i64,
        tag: &str,
        schedule: &str,
        args: &[&str],
        seconds: &str,
    ) -> Proc {
        let job = job(&self.journal, tag, seconds);
        self.running(lock, &self.table, tag, schedule, args, &job)
    }

    /// A replica of `lock` with its ledger in `table` (the setup's, or another), running
    /// `script`.
    fn running(
        &self,
        lock: i64,
        table: &str,
        tag: &str,
        schedule: &str,
        args: &[&str],
        script: &str,
    ) -> Proc {
        scheduled_at(
            tag,
            pgleader(),
            &self.url,
            lock,
            table,
            schedule,
            args,
            script,
        )
    }

    fn ledger(&self) -> BTreeMap<String, (String, i32)> {
        ledger(Cluster::shared(), &self.table, self.lock)
    }
}

/// `pgleader run --schedule ...` against `url`.
#[expect(
    clippy::too_many_arguments,
    reason = "a test helper that names each part of the command line"
)]
fn scheduled_at(
    name: &str,
    mut command: Command,
    url: &str,
    lock: i64,
    table: &str,
    schedule: &str,
    args: &[&str],
    script: &str,
) -> Proc {
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(["--schedule", schedule, "--ledger-table", table])
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// A job that journals its start, prints `<tag> ran <occurrence>`, and takes `seconds`.
fn job(journal: &Journal, tag: &str, seconds: &str) -> String {
    format!(
        "{}; echo {tag} ran $PGLEADER_SCHEDULED_TIME; sleep {seconds}",
        journal.append(&format!(
            "$PGLEADER_SCHEDULED_TIME $PGLEADER_EPOCH $PGLEADER_ATTEMPT {tag}"
        ))
    )
}

/// One journaled start.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Started {
    occurrence: String,
    epoch: i64,
    attempt: i32,
    tag: String,
}

fn starts(journal: &Journal) -> Vec<Started> {
    journal
        .lines()
        .iter()
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(
                words.len(),
                4,
                "a journal line without every field: {line:?}"
            );
            Started {
                occurrence: words[0].to_owned(),
                epoch: words[1].parse().expect("epoch"),
                attempt: words[2].parse().expect("attempt"),
                tag: words[3].to_owned(),
            }
        })
        .collect()
}

/// Waits until the journal holds at least `n` starts; returns them.
fn wait_starts(journal: &Journal, n: usize, timeout: Duration) -> Vec<Started> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = starts(journal);
        if seen.len() >= n {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} runs within {timeout:?}: {seen:?}",
            seen.len()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// How many times each occurrence started.
fn counts(seen: &[Started]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for start in seen {
        *counts.entry(start.occurrence.clone()).or_insert(0) += 1;
    }
    counts
}

fn assert_each_started_once(seen: &[Started]) {
    let twice: Vec<_> = counts(seen).into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(
        twice.is_empty(),
        "occurrences started more than once: {twice:?}; {seen:?}"
    );
}

/// [`assert_each_started_once`], with epochs that never go down from one start to the next.
fn assert_each_started_once_in_epoch_order(seen: &[Started]) {
    assert_each_started_once(seen);
    let epochs: Vec<i64> = seen.iter().map(|start| start.epoch).collect();
    assert!(
        epochs.windows(2).all(|pair| pair[0] <= pair[1]),
        "{epochs:?}"
    );
}

/// Asserts that the occurrence whose run was interrupted (the second start, killed with its
/// leader) never started again.
fn assert_not_started_again(seen: &[Started], interrupted: &str) {
    assert!(
        !seen
            .iter()
            .skip(2)
            .any(|start| start.occurrence == interrupted),
        "the interrupted run was started again: {seen:?}"
    );
}

/// When `replica` printed that it ran `occurrence` (the journal is written just before).
fn ran_at(replica: &Proc, occurrence: &str) -> Instant {
    let (_, at) = replica
        .wait_line(Stream::Stdout, &format!("ran {occurrence}"), 1, None, WAIT)
        .expect("the run's line");
    at
}

fn parse_time(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|err| panic!("{text:?}: {err}"))
        .with_timezone(&Utc)
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// A six-field schedule that matches only `at` (once a year), in UTC.
fn only_at(at: DateTime<Utc>) -> String {
    at.format("%-S %-M %-H %-d %-m *").to_string()
}

/// An instant `seconds` (whole) from now, on a whole second.
fn in_seconds(seconds: i64) -> DateTime<Utc> {
    Utc::now().trunc_subsecs(0) + chrono::Duration::seconds(seconds + 1)
}

/// Sleeps until the wall clock shows `at`: the scenario itself (a timer that fires then), not
/// a stand-in for an event.
fn sleep_until(at: DateTime<Utc>) {
    if let Ok(wait) = (at - Utc::now()).to_std() {
        std::thread::sleep(wait);
    }
}

/// The ledger rows of a lock: occurrence → (outcome, attempt).
fn ledger(cluster: &Cluster, table: &str, lock: i64) -> BTreeMap<String, (String, i32)> {
    cluster
        .client()
        .query(
            &format!(
                "SELECT to_char(scheduled_for AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
                        outcome, attempt FROM {table} WHERE lock_key = $1"
            ),
            &[&lock],
        )
        .unwrap_or_else(|err| panic!("read {table}: {err}"))
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect()
}

/// The replica whose command printed `<tag> ran <occurrence>` (the journal is written just
/// before that line).
fn runner<'a>(replicas: &'a [Proc], occurrence: &str) -> &'a Proc {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = replicas.iter().find(|replica| {
            replica
                .lines(Stream::Stdout)
                .iter()
                .any(|line| line.ends_with(&format!("ran {occurrence}")))
        });
        if let Some(replica) = found {
            return replica;
        }
        assert!(Instant::now() < deadline, "no replica ran {occurrence}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Scheduled replicas started one at a time, as a test's faults need them: `start` starts one
/// with the tag it is given (`<prefix><n>`, by its place), which counts once it has connected.
struct Fleet<F> {
    prefix: &'static str,
    start: F,
    replicas: Vec<Proc>,
}

impl<F: Fn(&str) -> Proc> Fleet<F> {
    /// A fleet of `n` replicas, each connected.
    fn of(n: usize, prefix: &'static str, start: F) -> Fleet<F> {
        let mut fleet = Fleet {
            prefix,
            start,
            replicas: Vec::new(),
        };
        for _ in 0..n {
            fleet.add();
        }
        fleet
    }

    /// Starts one more replica, and waits until it has connected.
    fn add(&mut self) {
        let tag = format!("{}{}", self.prefix, self.replicas.len());
        let replica = (self.start)(&tag);
        replica.wait_log("connected");
        self.replicas.push(replica);
    }

    /// The replica that ran `occurrence` (see [`runner`]).
    fn runner(&self, occurrence: &str) -> &Proc {
        runner(&self.replicas, occurrence)
    }
}

/// The backend holding the lock.
fn holder_backend(cluster: &Cluster, lock: i64) -> i32 {
    cluster
        .client()
        .query_one(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
               AND objid = $1::bigint::oid AND classid = 0 AND objsubid = 1",
            &[&lock],
        )
        .expect("the lock's holder")
        .get(0)
}

#[test]
fn three_replicas_run_each_occurrence_once_through_kill_9_terminate_and_restart() {
    let cluster = Cluster::new("schedule-faults");
    let setup = Setup::on(&cluster, "schedule-faults");
    let (lock, table, journal) = (setup.lock, &setup.table, &setup.journal);
    let mut fleet = Fleet::of(3, "R", |tag| {
        setup.replica(tag, EVERY_TWO_SECONDS, &[], "1.2")
    });
    let seen = wait_starts(journal, 3, WAIT);
    // kill -9 of the leader between runs: the next occurrence runs on another replica.
    let last = &seen.last().expect("a run").occurrence;
    let leader = fleet.runner(last);
    leader.wait_log(&format!("the run of {last} succeeded"));
    leader.signal(Signal::SIGKILL);
    fleet.add();
    let seen = wait_starts(journal, seen.len() + 2, WAIT);

    // kill -9 of the leader during a run: that occurrence is interrupted, not run again.
    let interrupted = seen.last().expect("a run").occurrence.clone();
    fleet.runner(&interrupted).signal(Signal::SIGKILL);
    fleet.add();
    let seen = wait_starts(journal, seen.len() + 2, WAIT);

    // pg_terminate_backend of the leader's session between runs.
    let last = seen.last().expect("a run").occurrence.clone();
    fleet
        .runner(&last)
        .wait_log(&format!("the run of {last} succeeded"));
    cluster.terminate_backend(holder_backend(&cluster, lock));
    let seen = wait_starts(journal, seen.len() + 2, WAIT);

    // A server restart, down for three seconds.
    let stopped = Utc::now();
    cluster.stop();
    std::thread::sleep(Duration::from_secs(3));
    cluster.start();
    // Occurrences that may be lost: those that came while the server was down, but the most
    // recent of them.
    let (down, up) = (stopped, Utc::now());
    let seen = wait_starts(journal, seen.len() + 3, WAIT);

    assert_each_started_once(&seen);
    // The first run may catch up an occurrence that came just before the fleet started, and
    // overrun the next one, which is then skipped: count from the second run.
    let first = parse_time(&seen[1].occurrence);
    let latest = parse_time(&seen.last().expect("a run").occurrence);
    let ran = counts(&seen);
    // The run that catches up after the restart may still be going at the next occurrence,
    // which is then skipped.
    let up = up + chrono::Duration::seconds(4);
    let mut at = first;
    let mut lost_in_outage = Vec::new();
    while at <= latest {
        if !ran.contains_key(&rfc3339(at)) {
            assert!(
                at >= down && at <= up,
                "the occurrence of {} did not run, outside any fault window; runs: {seen:?}",
                rfc3339(at)
            );
            lost_in_outage.push(at);
        }
        at += chrono::Duration::seconds(2);
    }
    assert!(lost_in_outage.len() <= 3, "lost {lost_in_outage:?}");

    let rows = ledger(&cluster, table, lock);
    // The last run may still be going.
    for start in &seen[..seen.len() - 1] {
        let (outcome, _) = rows
            .get(&start.occurrence)
            .unwrap_or_else(|| panic!("no ledger row for {start:?}: {rows:?}"));
        if start.occurrence == interrupted {
            assert_eq!(outcome, "interrupted", "{rows:?}");
        } else {
            assert_ne!(
                outcome, "running",
                "{} is still running: {rows:?}",
                start.occurrence
            );
        }
    }
    // Epochs grow from one leadership to the next.
    let epochs: Vec<i64> = seen.iter().map(|start| start.epoch).collect();
    assert!(
        epochs.windows(2).all(|pair| pair[0] <= pair[1]),
        "{epochs:?}"
    );
}

/// Three timers (`--once`, `--busy-exit-code=3`) for the occurrence three seconds ahead, A, B and
/// C started by `start(name, schedule, args, script)` at `offsets` (milliseconds after the
/// occurrence; before it if negative), running a job of 0.3 s: A runs it, B and C find it
/// taken, and the journal holds that one start. Returns the occurrence and the timers.
fn three_timers(
    journal: &Journal,
    offsets: [i64; 3],
    start: impl Fn(&str, &str, &[&str], &str) -> Proc,
) -> (DateTime<Utc>, [Proc; 3]) {
    let occurrence = in_seconds(3);
    let schedule = only_at(occurrence);
    let fire = |name: &str, offset: i64| {
        sleep_until(occurrence + chrono::Duration::milliseconds(offset));
        start(
            name,
            &schedule,
            &["--once", "--busy-exit-code=3"],
            &job(journal, name, "0.3"),
        )
    };
    let timers = [
        fire("A", offsets[0]),
        fire("B", offsets[1]),
        fire("C", offsets[2]),
    ];
    let codes = timers.each_ref().map(Proc::wait_code);
    assert_eq!(codes, [0, 3, 3], "A runs, B and C find it taken");
    let seen = starts(journal);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].occurrence, rfc3339(occurrence));
    (occurrence, timers)
}

/// How many milliseconds after `occurrence`, on the server's clock (see [`arrival`]),
/// `replica` printed `<tag> ran`.
fn ran_late_by(
    replica: &Proc,
    tag: &str,
    reference: (Instant, SystemTime),
    occurrence: DateTime<Utc>,
) -> i64 {
    let (_, ran) = replica
        .wait_line(Stream::Stdout, &format!("{tag} ran"), 1, None, WAIT)
        .unwrap_or_else(|| panic!("{tag}'s run"));
    (arrival(ran, reference) - occurrence).num_milliseconds()
}

/// Three timers (`--once`) for the same occurrence, the second half a second after the first and
/// the third five seconds after that: one run (of a job that takes 0.3 s, as in the issue),
/// never before the occurrence.
fn timers_run_one_occurrence_once(first_fires: i64) {
    let reference = (Instant::now(), SystemTime::now());
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let table = unique_table();
    let journal = Journal::new("timers");
    let offsets = [first_fires, first_fires + 500, first_fires + 5_500];
    let (occurrence, [a, _, c]) =
        three_timers(&journal, offsets, |name, schedule, args, script| {
            scheduled_at(
                name,
                pgleader(),
                &cluster.url(),
                lock,
                &table,
                schedule,
                args,
                script,
            )
        });
    assert_eq!(starts(&journal)[0].tag, "A");
    let late = ran_late_by(&a, "A", reference, occurrence);
    assert!(
        (0..1_500).contains(&late),
        "A ran {late} ms from its occurrence on the server's clock"
    );
    c.wait_log("already claimed (succeeded)");
    assert_eq!(
        ledger(cluster, &table, lock).get(&rfc3339(occurrence)),
        Some(&("succeeded".to_owned(), 1))
    );
}

#[test]
fn timers_half_a_second_and_five_seconds_apart_run_an_occurrence_once() {
    timers_run_one_occurrence_once(200);
}

#[test]
fn a_timer_that_fires_early_waits_for_the_occurrence_on_the_servers_clock() {
    // A fires 1.5 s early and waits; B, half a second later, finds the lock taken.
    timers_run_one_occurrence_once(-1_500);
}

/// libfaketime, preloaded into pgleader itself (not through the `faketime` program, which
/// forks and would stand between the test and pgleader's pid).
fn faketime_library() -> String {
    let path = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(path).is_file(),
        "{path} is missing: the clock-skew test runs pgleader under libfaketime (apt-get install faketime)"
    );
    path.to_owned()
}

/// `pgleader` whose clocks are `offset` off.
fn skewed_pgleader(library: &str, offset: &str) -> Command {
    let mut command = pgleader();
    command.env("LD_PRELOAD", library).env("FAKETIME", offset);
    command
}

/// The wall-clock time at which a line reached the test, from the moment it arrived on the pipe.
fn arrival(at: Instant, reference: (Instant, SystemTime)) -> DateTime<Utc> {
    let wall = if at >= reference.0 {
        reference.1 + (at - reference.0)
    } else {
        reference.1 - (reference.0 - at)
    };
    wall.into()
}

#[test]
fn replicas_with_clocks_30_seconds_off_run_each_occurrence_once_at_the_servers_time() {
    let library = faketime_library();
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let table = unique_table();
    let journal = Journal::new("skew");
    let reference = (Instant::now(), SystemTime::now());
    let skewed = |tag: &str, offset: &str| {
        scheduled_at(
            tag,
            skewed_pgleader(&library, offset),
            &cluster.url(),
            lock,
            &table,
            "*/3 * * * * *",
            &[],
            &job(&journal, tag, "0.2"),
        )
    };
    let ahead = skewed("ahead", "+30s");
    // The offset is measured over a round trip, so it reads 29.999 as often as 30.001.
    let offset_line = ahead.wait_log("this host's clock is");
    let offset: f64 = offset_line
        .split("offset_seconds=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no offset_seconds in {offset_line:?}"));
    assert!(
        (offset - 30.0).abs() < 1.0,
        "the ahead replica measured its clock {offset} s off, not about +30 s: {offset_line}"
    );
    let behind = skewed("behind", "-30s");
    behind.wait_log("waiting for the lock");
    let seen = wait_starts(&journal, 2, WAIT);
    let leader = if seen[0].tag == "ahead" {
        &ahead
    } else {
        &behind
    };
    leader.signal(Signal::SIGKILL);
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);
    assert_each_started_once(&seen);
    assert!(
        seen.iter().any(|s| s.tag == "ahead") && seen.iter().any(|s| s.tag == "behind"),
        "both skewed replicas led: {seen:?}"
    );
    for (replica, tag) in [(&ahead, "ahead"), (&behind, "behind")] {
        // A new leader first catches up the latest occurrence, which may be seconds old; every
        // later one it waits for.
        let (_, won) = replica
            .wait_line(Stream::Stderr, "became leader", 1, None, WAIT)
            .expect("it led");
        let won = arrival(won, reference);
        for start in seen.iter().filter(|s| s.tag == tag) {
            let started = arrival(ran_at(replica, &start.occurrence), reference);
            let occurrence = parse_time(&start.occurrence);
            assert!(
                started >= occurrence,
                "{tag} ran {} early, at {}",
                start.occurrence,
                rfc3339(started)
            );
            let late = (started - occurrence.max(won)).num_milliseconds();
            assert!(
                late < 1_500,
                "{tag} ran {} at {}: {late} ms after the occurrence (or its leadership) on the server's clock",
                start.occurrence,
                rfc3339(started)
            );
        }
    }

    // A timer whose clock is 30 s ahead, started 1.5 s before an occurrence, waits for it.
    let occurrence = in_seconds(3);
    sleep_until(occurrence - chrono::Duration::milliseconds(1_500));
    let timer_lock = unique_lock();
    let timer = scheduled_at(
        "timer",
        skewed_pgleader(&library, "+30s"),
        &cluster.url(),
        timer_lock,
        &table,
        &only_at(occurrence),
        &["--once"],
        &job(&journal, "timer", "0"),
    );
    assert_eq!(timer.wait_code(), 0, "{}", timer.dump());
    let late = ran_late_by(&timer, "timer", reference, occurrence);
    assert!(
        (0..1_500).contains(&late),
        "the timer ran {late} ms from its occurrence"
    );
}

#[test]
fn after_the_whole_fleet_was_down_only_the_latest_missed_occurrence_runs_within_catch_up() {
    let setup = Setup::new("catch-up");

    // Every second: a replica runs a few, dies, and the fleet stays down for four seconds.
    let lock = unique_lock();
    let a = setup.replica_of(lock, "A", "* * * * * *", &[], "0");
    let before = wait_starts(&setup.journal, 2, WAIT);
    a.signal(Signal::SIGKILL);
    a.wait_exit();
    let down = Utc::now();
    std::thread::sleep(Duration::from_secs(4));
    let b = setup.replica_of(lock, "B", "* * * * * *", &[], "0");
    let after = wait_starts(&setup.journal, before.len() + 2, WAIT);
    let first_of_b = after.iter().find(|s| s.tag == "B").expect("B ran");
    let caught_up = parse_time(&first_of_b.occurrence);
    b.wait_log(&format!("running the occurrence of {}", rfc3339(caught_up)));
    assert!(
        caught_up > down + chrono::Duration::seconds(3),
        "B caught up {caught_up}, not the latest missed occurrence"
    );
    let backlog: Vec<_> = after
        .iter()
        .filter(|s| {
            let at = parse_time(&s.occurrence);
            at > down && at < caught_up
        })
        .collect();
    assert!(backlog.is_empty(), "a backlog was replayed: {backlog:?}");
    assert_each_started_once(&after);

    // An occurrence older than --catch-up is recorded as missed, not run, once the lock has
    // run before (a schedule that never ran has missed nothing). Every five seconds: the
    // first replica runs one and dies; the next starts 3 s after a later occurrence.
    let lock = unique_lock();
    let every_five = "*/5 * * * * *";
    let first = setup.replica_of(lock, "first", every_five, &[], "0");
    let ran = wait_starts(&setup.journal, starts(&setup.journal).len() + 1, WAIT);
    first.signal(Signal::SIGKILL);
    first.wait_exit();
    let last = parse_time(&ran.last().expect("a run").occurrence);
    let occurrence = last + chrono::Duration::seconds(10);
    sleep_until(occurrence + chrono::Duration::seconds(3));
    let late = setup.replica_of(lock, "late", every_five, &["--catch-up=2s"], "0");
    late.wait_log(&format!(
        "the occurrence of {} was missed",
        rfc3339(occurrence)
    ));
    assert_eq!(
        ledger(Cluster::shared(), &setup.table, lock)
            .get(&rfc3339(occurrence))
            .map(|(o, _)| o.as_str()),
        Some("missed")
    );
    late.signal(Signal::SIGTERM);
    late.wait_exit();
    // Within the default --catch-up (1h) the same late start runs it, once.
    let lock = unique_lock();
    let occurrence = in_seconds(0);
    sleep_until(occurrence + chrono::Duration::seconds(2));
    let on_time = setup.replica_of(lock, "catcher", &only_at(occurrence), &[], "0");
    on_time.wait_log(&format!("the run of {} succeeded", rfc3339(occurrence)));
    on_time.signal(Signal::SIGTERM);
    on_time.wait_exit();
    let again = setup.replica_of(
        lock,
        "again",
        &only_at(occurrence),
        &["--once", "--busy-exit-code=3"],
        "0",
    );
    assert_eq!(again.wait_code(), 3, "{}", again.dump());
    again.wait_log("already claimed (succeeded)");
    assert!(
        !starts(&setup.journal)
            .iter()
            .any(|s| s.tag == "late" || s.tag == "again")
    );
    assert_eq!(
        starts(&setup.journal)
            .iter()
            .filter(|s| s.tag == "catcher")
            .count(),
        1
    );
    assert!(!late.lines(Stream::Stdout).iter().any(|l| l.contains("ran")));
}

/// An interrupted run: A leads the occurrence and is killed during its run; B, waiting, has
/// taken over; C waits behind B.
struct Interrupted {
    setup: Setup,
    occurrence: DateTime<Utc>,
    b: Proc,
    c: Proc,
}

fn interrupt_a_run(retries: &str) -> Interrupted {
    let setup = Setup::new("interrupted");
    let occurrence = in_seconds(2);
    let schedule = only_at(occurrence);
    let a = setup.replica("A", &schedule, &[retries], "1000");
    a.wait_log("became leader");
    let b = setup.replica("B", &schedule, &[retries], "1000");
    b.wait_log("waiting for the lock");
    let c = setup.replica("C", &schedule, &[retries], "1000");
    c.wait_log("waiting for the lock");
    a.wait_stdout(&format!("A ran {}", rfc3339(occurrence)));
    a.signal(Signal::SIGKILL);
    b.wait_log("became leader");
    Interrupted {
        setup,
        occurrence,
        b,
        c,
    }
}

#[test]
fn an_interrupted_run_is_not_started_again_by_default() {
    let Interrupted {
        setup,
        occurrence,
        b,
        ..
    } = interrupt_a_run("--retry-interrupted=0");
    b.wait_log(&format!(
        "not running the occurrence of {}: it was interrupted",
        rfc3339(occurrence)
    ));
    b.wait_log("was interrupted: its leader lost the lock while it ran");
    assert_eq!(
        setup.ledger().get(&rfc3339(occurrence)),
        Some(&("interrupted".to_owned(), 1))
    );
    let seen = starts(&setup.journal);
    assert_eq!(seen.len(), 1, "{seen:?}");
}

#[test]
fn retry_interrupted_starts_an_interrupted_run_again_with_the_same_scheduled_time() {
    let Interrupted {
        setup,
        occurrence,
        b,
        c,
    } = interrupt_a_run("--retry-interrupted=1");
    b.wait_stdout(&format!("B ran {}", rfc3339(occurrence)));
    let seen = starts(&setup.journal);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!((seen[0].attempt, seen[1].attempt), (1, 2));
    assert_eq!(
        seen[0].occurrence, seen[1].occurrence,
        "the same PGLEADER_SCHEDULED_TIME"
    );
    assert!(
        seen[0].epoch < seen[1].epoch,
        "a new PGLEADER_EPOCH: {seen:?}"
    );
    // Interrupted again: one retry was allowed, and it was used.
    b.signal(Signal::SIGKILL);
    c.wait_log(&format!(
        "not running the occurrence of {}: it was interrupted, and --retry-interrupted allows no more attempts",
        rfc3339(occurrence)
    ));
    assert_eq!(starts(&setup.journal).len(), 2);
    assert_eq!(
        setup.ledger().get(&rfc3339(occurrence)),
        Some(&("interrupted".to_owned(), 2))
    );
}

#[test]
fn an_occurrence_that_comes_while_the_previous_run_goes_on_is_skipped_and_recorded() {
    let setup = Setup::new("overlap");
    let a = setup.replica("A", EVERY_TWO_SECONDS, &[], "3");
    let seen = wait_starts(&setup.journal, 2, WAIT);
    let skipped = a.wait_log("was skipped: the run of");
    assert_each_started_once(&seen);
    let (first, second) = (
        parse_time(&seen[0].occurrence),
        parse_time(&seen[1].occurrence),
    );
    assert!(
        (second - first).num_seconds() >= 4,
        "nothing was skipped: {seen:?}"
    );
    let rows = setup.ledger();
    let mut between = first + chrono::Duration::seconds(2);
    while between < second {
        assert_eq!(
            rows.get(&rfc3339(between)).map(|(o, _)| o.as_str()),
            Some("skipped"),
            "{} came during the run of {}: {rows:?}",
            rfc3339(between),
            seen[0].occurrence
        );
        between += chrono::Duration::seconds(2);
    }
    assert!(
        skipped.contains(&format!(
            "the run of {} was still going",
            seen[0].occurrence
        )),
        "{skipped}"
    );
}

#[test]
fn a_missing_ledger_without_create_permission_is_a_clear_error_that_gives_the_ddl() {
    let cluster = Cluster::shared();
    let table = unique_table();
    let role = format!("r{}", unique_lock());
    cluster.execute(&format!(
        "CREATE ROLE {role} LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC"
    ));
    let url = format!("postgres://{role}@127.0.0.1:{}/postgres", cluster.port);
    let lock = unique_lock();
    // Every attempt runs as the role, on the same lock and table.
    let as_role = |name: &str, script: &str| {
        scheduled_at(
            name,
            pgleader(),
            &url,
            lock,
            &table,
            EVERY_TWO_SECONDS,
            &[],
            script,
        )
    };
    let refused = as_role("refused", "true");
    let (status, _, stderr) = refused.finish();
    assert_eq!(status.code(), Some(1), "{}", refused.dump());
    let stderr = stderr.join("\n");
    assert!(
        stderr.contains(&format!("cannot create the ledger table {table}")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("CREATE TABLE \"{table}\" (")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON \"{table}\" TO"
        )),
        "{stderr}"
    );
    assert!(
        !stderr.contains("waiting for the lock"),
        "it must stop before the election: {stderr}"
    );

    // Created by an administrator but not granted: still refused, saying what is missing.
    let ddl = pgleader::postgres::ledger::TableName::parse(&table)
        .expect("table")
        .ddl();
    cluster.execute(&ddl);
    let ungranted = as_role("ungranted", "true");
    let (status, _, stderr) = ungranted.finish();
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.join("\n").contains("may not use the ledger table"),
        "{stderr:?}"
    );

    // Granted: it runs.
    cluster.execute(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"
    ));
    let journal = Journal::new("granted");
    let granted = as_role("granted", &job(&journal, "G", "0"));
    let first = wait_starts(&journal, 1, WAIT).remove(0);
    granted.wait_log(&format!("the run of {} succeeded", first.occurrence));
    // The log says so as the outcome is sent; the ledger has it once its transaction commits.
    let succeeded = Some(("succeeded".to_owned(), 1));
    poll_until(
        Duration::from_millis(20),
        || format!("the ledger never recorded the run of {}", first.occurrence),
        || {
            (ledger(cluster, &table, lock).get(&first.occurrence) == succeeded.as_ref())
                .then_some(())
        },
    );
}

#[test]
fn a_replica_with_another_schedule_is_reported_and_never_runs_its_version() {
    let setup = Setup::new("mismatch");
    let lock = setup.lock;
    let a1 = setup.replica_of(lock, "A1", EVERY_TWO_SECONDS, &[], "0");
    wait_starts(&setup.journal, 1, WAIT);
    // B reads the same expression in another time zone; it queues before A2.
    let b = setup.replica_of(
        lock,
        "B",
        EVERY_TWO_SECONDS,
        &["--schedule-timezone=Asia/Kolkata"],
        "0",
    );
    b.wait_log("waiting for the lock");
    let a2 = setup.replica_of(lock, "A2", EVERY_TWO_SECONDS, &[], "0");
    a2.wait_log("waiting for the lock");
    // The leader notices the disagreement at its next occurrence.
    let warning = a1.wait_log("replicas with another schedule wait for this lock");
    assert!(
        warning.contains("Asia/Kolkata") || warning.contains(&b.pid.to_string()),
        "{warning}"
    );
    a1.signal(Signal::SIGKILL);
    // B wins the lock, sees A2 announce the established schedule, and hands over.
    let refused = b.wait_log("differs from");
    assert!(
        refused.contains("Asia/Kolkata") && refused.contains("(UTC)"),
        "{refused}"
    );
    b.wait_log("handing the lock over");
    let a2_run = a2.wait_stdout("A2 ran");
    assert!(
        !starts(&setup.journal).iter().any(|s| s.tag == "B"),
        "B ran its version"
    );
    assert!(
        !b.has_exited(),
        "a service replica stays in the fleet: {}",
        b.dump()
    );
    drop(a2_run);

    // A timer with another schedule, after the established one ran at its occurrence: exit 1.
    let timer_lock = unique_lock();
    let occurrence = in_seconds(1);
    let established = setup.replica_of(timer_lock, "T1", &only_at(occurrence), &["--once"], "0");
    assert_eq!(established.wait_code(), 0, "{}", established.dump());
    let other = setup.replica_of(timer_lock, "T2", "* * * * * *", &["--once"], "0");
    let (status, _, stderr) = other.finish();
    assert_eq!(status.code(), Some(1), "{}", other.dump());
    assert!(
        stderr
            .join("\n")
            .contains("another host's timer still uses it"),
        "{stderr:?}"
    );
    assert!(!starts(&setup.journal).iter().any(|s| s.tag == "T2"));
}

#[test]
fn bad_schedules_and_combinations_are_usage_errors_that_name_the_problem() {
    let cases: &[(&[&str], &str)] = &[
        (&["--schedule", "every night"], "five fields"),
        (&["--schedule", "@nightly"], "unknown nickname"),
        (&["--schedule", "0 0 30 2 *"], "never matches"),
        (&["--catch-up", "5m"], "--schedule"),
        (&["--retry-interrupted", "1"], "--schedule"),
    ];
    for (args, expected) in cases {
        assert_usage_error(args, expected);
    }
    // Beside a valid schedule: an option and its value, and what the error says.
    let beside_a_schedule = [
        (
            "--schedule-timezone",
            "Europe/Atlantis",
            "unknown time zone \"Europe/Atlantis\"",
        ),
        ("--relinquish-after", "1h", "cannot be used with"),
        ("--restart-delay", "5s", "cannot be used with"),
        ("--ledger-table", "a;drop", "not a table name"),
        ("--catch-up", "soon", "--catch-up"),
    ];
    for (option, value, expected) in beside_a_schedule {
        assert_usage_error(&["--schedule", "0 3 * * *", option, value], expected);
    }
}

#[test]
fn status_shows_the_schedule_its_last_runs_and_the_next_occurrence() {
    let cluster = Cluster::shared();
    let setup = Setup::new("status");
    let a = setup.replica("A", EVERY_TWO_SECONDS, &[], "0");
    let seen = wait_starts(&setup.journal, 2, WAIT);
    a.wait_log(&format!("the run of {} succeeded", seen[1].occurrence));
    let (lock, table) = (setup.lock, &setup.table);
    let status = |json: bool| {
        let mut command = pgleader();
        command.env("PGLEADER_DATABASE_URL", cluster.url()).args([
            "status",
            &format!("--lock-id={lock}"),
            "--ledger-table",
            table,
        ]);
        if json {
            command.arg("--json");
        }
        let proc = Proc::spawn("status", command);
        let (status, stdout, _) = proc.finish();
        assert_eq!(status.code(), Some(0), "{}", proc.dump());
        stdout.join("\n")
    };
    let text = status(false);
    assert!(text.contains("schedule: \"*/2 * * * * *\" (UTC)"), "{text}");
    assert!(
        text.contains(&format!("{}  succeeded   exit 0", seen[1].occurrence)),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(&status(true)).expect("JSON");
    let schedule = &json["schedule"];
    assert_eq!(schedule["expression"], "*/2 * * * * *");
    assert_eq!(schedule["timezone"], "UTC");
    let next = parse_time(
        schedule["next_occurrence"]
            .as_str()
            .expect("next occurrence"),
    );
    assert!(next > parse_time(&seen[1].occurrence), "{json}");
    let runs = schedule["runs"].as_array().expect("runs");
    let run = runs
        .iter()
        .find(|run| run["scheduled_for"] == seen[1].occurrence.as_str())
        .unwrap_or_else(|| panic!("{} not in {json}", seen[1].occurrence));
    assert_eq!(run["outcome"], "succeeded");
    assert_eq!(run["exit_code"], 0);
    assert_eq!(run["epoch"], seen[1].epoch);
    assert_eq!(
        json["holder"]["schedule_fingerprint"], schedule["fingerprint"],
        "{json}"
    );
}

#[test]
fn without_schedule_no_ledger_table_is_touched() {
    let cluster = Cluster::shared();
    let table = unique_table();
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .env("PGLEADER_LEDGER_TABLE", &table)
        .args([
            "run",
            &format!("--lock-id={}", unique_lock()),
            "--once",
            "--",
            "true",
        ]);
    let proc = Proc::spawn("unscheduled", command);
    assert_eq!(proc.wait_code(), 0, "{}", proc.dump());
    let exists: bool = cluster
        .client()
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .expect("to_regclass")
        .get(0);
    assert!(!exists, "an unscheduled run created {table}");
}

fn create_ledger(table: &str) {
    let ddl = pgleader::postgres::ledger::TableName::parse(table)
        .expect("table")
        .ddl();
    Cluster::shared().execute(&ddl);
}

/// A ledger write that waits (an operator's LOCK TABLE, VACUUM FULL, ALTER TABLE, a
/// synchronous standby that is away) holds up the leader's checks, which share its
/// session: the leadership is lost and the run that was going is stopped.
#[test]
fn a_waiting_ledger_write_does_not_cost_the_leadership() {
    let setup = Setup::new("contention");
    create_ledger(&setup.table);
    let a = setup.replica("A", EVERY_TWO_SECONDS, &[], "7");
    let first = wait_starts(&setup.journal, 1, WAIT).remove(0);
    let mut admin = Cluster::shared().client();
    let mut tx = admin.transaction().expect("begin");
    tx.batch_execute(&format!("LOCK TABLE {} IN SHARE MODE", setup.table))
        .expect("lock");
    // The next occurrence comes during the run: its `skipped` row waits for the lock.
    let lost = a.wait_line(
        Stream::Stderr,
        "leadership lost",
        1,
        None,
        Duration::from_secs(6),
    );
    tx.commit().expect("commit");
    assert!(
        lost.is_none(),
        "a ledger write waiting for a table lock cost the leadership during the run of {}: {}",
        first.occurrence,
        a.dump()
    );
    a.wait_log(&format!("the run of {} succeeded", first.occurrence));
}

/// The leader prepares its ledger statements once per session; an operator who then changes
/// the type of a column they return ("cached plan must not change result type" at their next
/// run) costs neither the leadership nor an occurrence: the statement is prepared again.
#[test]
fn a_ledger_column_changed_under_prepared_statements_costs_nothing() {
    let setup = Setup::new("altered");
    create_ledger(&setup.table);
    let a = setup.replica("A", "* * * * * *", &[], "0");
    let before = wait_starts(&setup.journal, 2, WAIT).len();
    Cluster::shared().execute(&format!(
        "ALTER TABLE {} ALTER COLUMN outcome TYPE varchar(20)",
        setup.table
    ));
    wait_starts(&setup.journal, before + 3, WAIT);
    assert!(
        !a.printed(Stream::Stderr, "leadership lost"),
        "a changed ledger column cost the leadership: {}",
        a.dump()
    );
}

/// Issue 8: "none is silently lost". The fleet is down for five seconds of an every-second
/// schedule; the next leader catches up the latest occurrence only (as it should), but the
/// ones before it are neither recorded nor logged.
#[test]
fn occurrences_passed_over_by_a_catch_up_are_not_silently_lost() {
    let setup = Setup::new("gap");
    let a = setup.replica("A", "* * * * * *", &[], "0");
    wait_starts(&setup.journal, 2, WAIT);
    a.signal(Signal::SIGKILL);
    a.wait_exit();
    let before = starts(&setup.journal);
    let last_before = parse_time(&before.last().expect("a run").occurrence);
    std::thread::sleep(Duration::from_secs(5));
    let b = setup.replica("B", "* * * * * *", &[], "0");
    let after = wait_starts(&setup.journal, before.len() + 1, WAIT);
    let caught = after.iter().find(|s| s.tag == "B").expect("B ran");
    b.wait_log(&format!("the run of {} succeeded", caught.occurrence));
    let caught_up = parse_time(&caught.occurrence);
    let rows = setup.ledger();
    let log = b.lines(Stream::Stderr).join("\n");
    let mut silent = Vec::new();
    let mut at = last_before + chrono::Duration::seconds(1);
    while at < caught_up {
        if !rows.contains_key(&rfc3339(at)) && !log.contains(&rfc3339(at)) {
            silent.push(rfc3339(at));
        }
        at += chrono::Duration::seconds(1);
    }
    assert!(
        silent.is_empty(),
        "occurrences neither run, nor recorded, nor logged: {silent:?}; ledger {rows:?}\n{}",
        b.dump()
    );
}

/// A timer (`--once`) whose command exited 7, but whose session ended before the outcome
/// was recorded, must still exit 7: here it reconnects, finds its own row `running`, marks
/// it interrupted and exits with --busy-exit-code, so cron or systemd see success.
#[test]
fn a_timer_exits_with_its_commands_status_when_the_record_is_cut_off() {
    let setup = Setup::new("once-status");
    create_ledger(&setup.table);
    let occurrence = in_seconds(1);
    let script = format!(
        "{}; sleep 1; exit 7",
        setup
            .journal
            .append("$PGLEADER_SCHEDULED_TIME $PGLEADER_EPOCH $PGLEADER_ATTEMPT T")
    );
    let timer = setup.running(
        setup.lock,
        &setup.table,
        "T",
        &only_at(occurrence),
        &["--once", "--busy-exit-code=3"],
        &script,
    );
    wait_starts(&setup.journal, 1, WAIT);
    let mut admin = Cluster::shared().client();
    let mut tx = admin.transaction().expect("begin");
    tx.batch_execute(&format!("LOCK TABLE {} IN SHARE MODE", setup.table))
        .expect("lock");
    timer.wait_log("the command exited");
    // The outcome's UPDATE now waits for the table lock; the server ends the session.
    let backend = holder_backend(Cluster::shared(), setup.lock);
    std::thread::sleep(Duration::from_millis(200));
    Cluster::shared().terminate_backend(backend);
    tx.commit().expect("commit");
    let code = timer.wait_code();
    let rows = setup.ledger();
    assert_eq!(
        code,
        7,
        "the command exited 7; ledger {rows:?}\n{}",
        timer.dump()
    );
}

/// Issue 8, overlap: "An occurrence that comes while the previous run is still going is
/// skipped and recorded as skipped (logged, visible in status)". A timer that fires while
/// another host's timer still runs the previous occurrence exits busy and records nothing.
#[test]
fn a_timer_that_finds_the_previous_run_going_records_a_skip() {
    let setup = Setup::new("timer-overlap");
    // The next even second at least one second away.
    let mut first = in_seconds(1);
    if first.timestamp() % 2 == 1 {
        first += chrono::Duration::seconds(1);
    }
    let fire = |name: &str, at: DateTime<Utc>| {
        sleep_until(at);
        setup.replica(
            name,
            EVERY_TWO_SECONDS,
            &["--once", "--busy-exit-code=3"],
            "4",
        )
    };
    let a = fire("A", first + chrono::Duration::milliseconds(200));
    let b = fire("B", first + chrono::Duration::milliseconds(2_200));
    assert_eq!(b.wait_code(), 3, "{}", b.dump());
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    let second = rfc3339(first + chrono::Duration::seconds(2));
    let rows = setup.ledger();
    assert_eq!(
        rows.get(&second).map(|(o, _)| o.as_str()),
        Some("skipped"),
        "the occurrence of {second} came while the run of {} went on; ledger {rows:?}\n{}",
        rfc3339(first),
        b.dump()
    );
}

/// Issue 8: "A failing command does not end a --schedule service: its status is logged and
/// recorded, and the next occurrence runs." (no test in the commit covers it)
#[test]
fn a_failing_command_is_recorded_and_the_next_occurrence_runs() {
    let setup = Setup::new("failing");
    let script = format!(
        "{}; exit 5",
        setup
            .journal
            .append("$PGLEADER_SCHEDULED_TIME $PGLEADER_EPOCH $PGLEADER_ATTEMPT F")
    );
    let a = setup.running(
        setup.lock,
        &setup.table,
        "F",
        EVERY_TWO_SECONDS,
        &[],
        &script,
    );
    let seen = wait_starts(&setup.journal, 2, WAIT);
    a.wait_log(&format!("the run of {} failed", seen[0].occurrence));
    assert!(!a.has_exited(), "{}", a.dump());
    let exit_code: Option<i32> = Cluster::shared()
        .client()
        .query_one(
            &format!(
                "SELECT exit_code FROM {} WHERE lock_key = $1 AND scheduled_for = $2::text::timestamptz AND outcome = 'failed'",
                setup.table
            ),
            &[&setup.lock, &seen[0].occurrence],
        )
        .expect("the failed row")
        .get(0);
    assert_eq!(exit_code, Some(5));
}

/// docs/scheduled-jobs.md: "pgleader is stopped (TERM) during the run: the command is stopped,
/// then the run recorded, then the lock released; interrupted, with the command's status".
#[test]
fn a_shutdown_during_a_run_records_it_before_the_lock_goes() {
    let setup = Setup::new("term");
    let a = setup.replica("A", EVERY_TWO_SECONDS, &[], "100");
    let first = wait_starts(&setup.journal, 1, WAIT).remove(0);
    let b = setup.replica("B", EVERY_TWO_SECONDS, &[], "0");
    b.wait_log("waiting for the lock");
    a.signal(Signal::SIGTERM);
    a.wait_exit();
    b.wait_log("became leader");
    wait_starts(&setup.journal, 2, WAIT);
    // B logs an interrupted run when it begins to lead, before it claims an occurrence: once
    // the claim's line is read, so is any line before it on the same pipe. (The journal is a
    // file and may be ahead of the pipe.)
    b.wait_log("running the occurrence of");
    assert!(
        !b.printed(Stream::Stderr, "its leader lost the lock while it ran"),
        "the lock went before the run was recorded: {}",
        b.dump()
    );
    let row = Cluster::shared()
        .client()
        .query_one(
            &format!(
                "SELECT outcome, exit_code, detail FROM {} WHERE lock_key = $1 AND scheduled_for = $2::text::timestamptz",
                setup.table
            ),
            &[&setup.lock, &first.occurrence],
        )
        .expect("the row");
    let (outcome, code, detail): (String, Option<i32>, Option<String>) =
        (row.get(0), row.get(1), row.get(2));
    assert_eq!(
        (outcome.as_str(), code, detail.as_deref()),
        ("interrupted", Some(143), Some("pgleader was shut down"))
    );
}

/// DESIGN invariant 2 and the biased select for scheduled starts: a leader stalled (SIGSTOP)
/// across an occurrence and past its deadline must not start the command when it resumes.
#[test]
fn a_leader_stalled_across_an_occurrence_does_not_start_it_late() {
    let setup = Setup::new("stall");
    let occurrence = in_seconds(3);
    let a = setup.replica("A", &only_at(occurrence), &[], "0");
    a.wait_log("became leader");
    sleep_until(occurrence - chrono::Duration::milliseconds(700));
    a.signal(Signal::SIGSTOP);
    std::thread::sleep(Duration::from_secs(5));
    a.signal(Signal::SIGCONT);
    a.wait_log("leadership lost");
    let ran: Vec<_> = starts(&setup.journal)
        .into_iter()
        .filter(|s| {
            s.epoch == {
                let line = a.wait_log("became leader");
                crate::harness::field(&line, "epoch")
                    .parse::<i64>()
                    .expect("epoch")
            }
        })
        .collect();
    assert!(
        ran.is_empty(),
        "started after its deadline: {ran:?}\n{}",
        a.dump()
    );
}

/// Issue 8, catch-up: "only the most recent missed one". When the start is held back (the
/// restart fence after a server restart, here --takeover-delay, which feeds the same
/// `not_before`), the leader claims the occurrence that was latest when it *won*, seconds
/// stale, and passes over the ones that came during the wait without a trace.
#[test]
fn a_held_back_leader_catches_up_the_most_recent_occurrence() {
    let setup = Setup::new("fence");
    let a = setup.replica("A", "* * * * * *", &["--takeover-delay=3s"], "0");
    let won = a.wait_log("became leader");
    let first = wait_starts(&setup.journal, 1, WAIT).remove(0);
    let started = ran_at(&a, &first.occurrence);
    let age = started.elapsed();
    let started_wall = Utc::now() - chrono::Duration::from_std(age).expect("duration");
    let lag = started_wall - parse_time(&first.occurrence);
    assert!(
        lag < chrono::Duration::milliseconds(1_500),
        "ran the occurrence of {} {} ms after it, though newer ones had come meanwhile ({won})\n{}",
        first.occurrence,
        lag.num_milliseconds(),
        a.dump()
    );
}

/// At most once relies on every replica claiming in the same table, but the ledger table
/// is neither part of the fingerprint nor checked: replicas with another --ledger-table
/// (or an unqualified name that resolves to another schema through search_path) each
/// keep their own ledger, and a failover runs the same occurrence again.
#[test]
fn replicas_with_another_ledger_table_do_not_run_an_occurrence_twice() {
    let setup = Setup::new("two-ledgers");
    let (lock, journal) = (setup.lock, &setup.journal);
    let other_table = unique_table();
    let occurrence = in_seconds(2);
    let schedule = only_at(occurrence);
    let a = setup.replica("A", &schedule, &[], "100");
    a.wait_log("became leader");
    let b_job = job(journal, "B", "100");
    let b = setup.running(lock, &other_table, "B", &schedule, &[], &b_job);
    b.wait_log("waiting for the lock");
    a.wait_stdout(&format!("A ran {}", rfc3339(occurrence)));
    a.signal(Signal::SIGKILL);
    b.wait_log("became leader");
    // Give B the time to catch the occurrence up, if it is going to.
    let again = b.wait_line(
        Stream::Stdout,
        &format!("B ran {}", rfc3339(occurrence)),
        1,
        None,
        Duration::from_secs(5),
    );
    assert!(
        again.is_none(),
        "the occurrence of {} started twice: {:?}\n{}",
        rfc3339(occurrence),
        starts(journal),
        b.dump()
    );
    // Both sides said why.
    b.wait_log("in another ledger table");
    b.wait_log(&format!(
        "not catching up the occurrence of {}",
        rfc3339(occurrence)
    ));
}

#[test]
fn a_ledger_table_named_like_a_keyword_works() {
    let setup = Setup {
        table: "user".to_owned(),
        ..Setup::new("keyword")
    };
    let occurrence = in_seconds(1);
    let timer = setup.replica("T", &only_at(occurrence), &["--once"], "0");
    assert_eq!(timer.wait_code(), 0, "{}", timer.dump());
    assert_eq!(
        Cluster::shared()
            .client()
            .query_one(
                "SELECT outcome FROM \"user\" WHERE lock_key = $1",
                &[&setup.lock]
            )
            .expect("the row")
            .get::<_, String>(0),
        "succeeded"
    );
}

/// `pgleader run --schedule ...` against Redis, one server or a quorum (its URLs separated by
/// spaces): the ledger lives in the lock's keys.
fn scheduled_on_redis(
    name: &str,
    url: &str,
    lock: i64,
    schedule: &str,
    args: &[&str],
    script: &str,
) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(["--schedule", schedule])
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// The ledger rows of a lock on Redis: occurrence → (outcome, attempt).
fn redis_ledger(redis: &Redis, lock: i64) -> BTreeMap<String, (String, i32)> {
    let rows = redis.cli(&["HVALS", &format!("pgleader:{{{lock}}}:rows")]);
    rows.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let row: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|err| panic!("{line:?}: {err}"));
            let text = |name: &str| {
                row[name]
                    .as_str()
                    .unwrap_or_else(|| panic!("no {name} in {line}"))
                    .to_owned()
            };
            let micros: i64 = text("scheduled_for").parse().expect("microseconds");
            let at = DateTime::from_timestamp_micros(micros).expect("an instant");
            (
                rfc3339(at),
                (text("outcome"), text("attempt").parse().expect("attempt")),
            )
        })
        .collect()
}

#[test]
fn on_redis_replicas_run_each_occurrence_once_through_kill_9_client_kill_and_restart() {
    let redis = Redis::new("schedule");
    let lock = unique_lock();
    let journal = Journal::new("redis-schedule");
    let timings = ["--check-interval=200ms", "--check-timeout=500ms"];
    let mut fleet = Fleet::of(3, "R", |tag| {
        let job = job(&journal, tag, "1.2");
        scheduled_on_redis(tag, &redis.url(), lock, EVERY_TWO_SECONDS, &timings, &job)
    });
    let seen = wait_starts(&journal, 2, WAIT);
    // kill -9 of the leader during a run: that occurrence is interrupted, not run again.
    let interrupted = seen.last().expect("a run").occurrence.clone();
    fleet.runner(&interrupted).signal(Signal::SIGKILL);
    fleet.add();
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);

    // The server ends the leader's connection between runs.
    let last = seen.last().expect("a run").occurrence.clone();
    let leader = fleet.runner(&last);
    leader.wait_log(&format!("the run of {last} succeeded"));
    let holder = redis.cli(&["GET", &format!("pgleader:{{{lock}}}")]);
    let client = holder
        .split_whitespace()
        .find_map(|word| word.strip_prefix("client="))
        .unwrap_or_else(|| panic!("no client id in {holder:?}"))
        .to_owned();
    redis.cli(&["CLIENT", "KILL", "ID", &client]);
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);

    // A restart that keeps nothing: the ledger is gone with every key. The occurrences after
    // it run once each, with epochs that still grow, and none from before it runs again.
    redis.crash();
    redis.start();
    let seen = wait_starts(&journal, seen.len() + 3, WAIT);

    assert_each_started_once_in_epoch_order(&seen);
    let rows = redis_ledger(&redis, lock);
    let after_restart = &seen[seen.len() - 3..seen.len() - 1];
    for start in after_restart {
        let (outcome, _) = rows
            .get(&start.occurrence)
            .unwrap_or_else(|| panic!("no ledger row for {start:?}: {rows:?}"));
        assert_ne!(outcome, "running", "{rows:?}");
    }
    assert_not_started_again(&seen, &interrupted);
}

#[test]
fn on_redis_timers_run_an_occurrence_once() {
    let redis = Redis::shared();
    let lock = unique_lock();
    let journal = Journal::new("redis-timers");
    let (occurrence, [_a, _b, c]) = three_timers(
        &journal,
        [200, 700, 2_700],
        |name, schedule, args, script| {
            scheduled_on_redis(name, &redis.url(), lock, schedule, args, script)
        },
    );
    c.wait_log("already claimed (succeeded)");
    assert_eq!(
        redis_ledger(redis, lock).get(&rfc3339(occurrence)),
        Some(&("succeeded".to_owned(), 1))
    );
    // status reads the history from the lock's keys.
    let mut command = pgleader();
    command.args(["status", "-d", &redis.url(), &format!("--lock-id={lock}")]);
    let status = Proc::spawn("status", command);
    let (_, stdout, _) = status.finish();
    let text = stdout.join("\n");
    assert!(text.contains("succeeded"), "{text}");
}

#[test]
fn on_a_quorum_replicas_run_each_occurrence_once_through_kill_9_a_servers_death_and_empty_restart()
{
    let lease = Duration::from_secs(3);
    let servers: Vec<Redis> = (0..3)
        .map(|i| Redis::new(&format!("schedule-quorum-{i}")))
        .collect();
    for server in &servers {
        crate::quorum::wait_older_than(server, lease);
    }
    let lock = unique_lock();
    let journal = Journal::new("quorum-schedule");
    let urls: Vec<String> = servers.iter().map(Redis::url).collect();
    let quorum = urls.join(" ");
    let mut fleet = Fleet::of(3, "Q", |tag| {
        let job = job(&journal, tag, "1.2");
        scheduled_on_redis(tag, &quorum, lock, EVERY_TWO_SECONDS, &CLI_TIMINGS, &job)
    });
    let seen = wait_starts(&journal, 2, WAIT);
    // kill -9 of the leader during a run: that occurrence is interrupted, not run again.
    let interrupted = seen.last().expect("a run").occurrence.clone();
    fleet.runner(&interrupted).signal(Signal::SIGKILL);
    fleet.add();
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);

    // One server of three dies: the runs go on, claimed by the other two.
    servers[0].crash();
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);

    // It comes back empty, and another dies: the leader loses its majority; the next one leads
    // over the empty server (once it is older than the lease) and the survivor, whose ledger
    // alone remembers the earlier runs. The empty server refuses every occurrence from before
    // its start, so none of them runs again.
    servers[0].start();
    servers[1].crash();
    let seen = wait_starts(&journal, seen.len() + 2, WAIT);

    assert_each_started_once_in_epoch_order(&seen);
    assert_not_started_again(&seen, &interrupted);
    // status reads the history from a majority (the survivor and the restarted server).
    let last = &seen[seen.len() - 2].occurrence;
    fleet
        .runner(last)
        .wait_log(&format!("the run of {last} succeeded"));
    let urls: Vec<String> = servers.iter().map(Redis::url).collect();
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", urls.join(" "))
        .args(["status", &format!("--lock-id={lock}")]);
    let (_, stdout, _) = Proc::spawn("status", command).finish();
    let text = stdout.join("\n");
    assert!(
        text.lines()
            .any(|line| line.contains(last.as_str()) && line.contains("succeeded")),
        "{text}"
    );
}
