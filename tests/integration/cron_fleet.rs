//! `pgleader cron CRONTAB` on several replicas against a real PostgreSQL: the jobs are shared
//! out evenly, each occurrence of each job runs once across the fleet, a job still running
//! when its next occurrence comes skips it, the jobs of a replica killed -9 run on the
//! others from their very next occurrence, and shards and a crontab on one name refuse each
//! other. The scenarios are written once, over a [`Spawn`], and `redis_cron.rs` runs them on
//! one Redis server.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use postgres::error::SqlState;

use crate::crontab::File;
use crate::harness::fleet::lines_with;
use crate::harness::http::{address_of, get};
use crate::harness::pg::sessions_of;
use crate::harness::process::{is_running, keepers_of, pid_field};
use crate::harness::shards::wait_for_two_sessions_each;
use crate::harness::{
    Cluster, Proc, Stream, WAIT, field, pgleader, printed, run_with_url, unique_lock,
};
use crate::observability::sample;

/// How a scenario starts a replica of its fleet: `pgleader cron` of the file on the fleet's
/// lock and server, the replica named as given.
pub type Spawn<'a> = &'a dyn Fn(&str, &File) -> Proc;

/// [`Spawn`] with more options (`--http`, say) before the file.
pub type SpawnWith<'a> = &'a dyn Fn(&str, &File, &[&str]) -> Proc;

/// How a scenario runs `pgleader status --lock-id LOCK ARGS` on its fleet's server, the process
/// named as given.
pub type StatusOf<'a> = &'a dyn Fn(&str, &[&str]) -> Proc;

/// A crontab of `jobs` every-second jobs, `j1` to `jN`, each running `command` (which sees
/// PGLEADER_JOB and PGLEADER_SCHEDULED_TIME).
pub fn every_second(tag: &str, jobs: usize, command: &str) -> File {
    let mut text = String::from("# every second, seven fields as supercronic reads them\n");
    for n in 1..=jobs {
        text.push_str(&format!("# pgleader: name=j{n}\n* * * * * * * {command}\n"));
    }
    File::new(tag, &text)
}

/// What every job prints when it runs.
pub const RAN: &str =
    "echo ran job=$PGLEADER_JOB at=$PGLEADER_SCHEDULED_TIME epoch=$PGLEADER_EPOCH";

/// `pgleader cron --lock-id LOCK --passthrough-logs ARGS FILE` against the server of `url`:
/// these scenarios read what the jobs print on the replica's stdout, as it is
/// (`cron_output.rs` tests the tagged lines, and runs a fleet on them).
pub fn cron_replica(name: &str, url: &str, lock: i64, args: &[&str], file: &File) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("cron")
        .arg(format!("--lock-id={lock}"))
        .arg("--passthrough-logs")
        .args(args)
        .arg(&file.0);
    Proc::spawn(name, command)
}

/// `pgleader run --lock-id LOCK ARGS` against the server of `url`, each command saying
/// `<name> started` and sleeping.
pub fn run_replica(name: &str, url: &str, lock: i64, args: &[&str]) -> Proc {
    run_with_url(
        name,
        url,
        lock,
        args,
        &format!("echo {name} started; exec sleep 1000"),
    )
}

/// Every run the replicas printed, as it is or as tagged log lines: (job, occurrence) → the
/// replicas that ran it.
pub fn runs(replicas: &[&Proc]) -> BTreeMap<(String, String), Vec<String>> {
    let mut seen: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for replica in replicas {
        let tagged = replica
            .lines(Stream::Stderr)
            .into_iter()
            .filter_map(|line| printed(&line));
        for line in replica.lines(Stream::Stdout).into_iter().chain(tagged) {
            if line.starts_with("ran ") {
                seen.entry((field(&line, "job"), field(&line, "at")))
                    .or_default()
                    .push(replica.name.clone());
            }
        }
    }
    seen
}

/// Fails, naming them, if any occurrence of any job ran twice.
pub fn assert_each_occurrence_once(replicas: &[&Proc]) {
    let twice: Vec<_> = runs(replicas)
        .into_iter()
        .filter(|(_, by)| by.len() > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "occurrences that ran more than once: {twice:?}"
    );
}

/// Who ran each job's latest occurrence, once every job has one at or after `since` (an RFC
/// 3339 instant, compared as text).
fn latest_runners(replicas: &[&Proc], since: &str) -> BTreeMap<String, String> {
    let mut latest: BTreeMap<String, (String, String)> = BTreeMap::new();
    for ((job, at), by) in runs(replicas) {
        if at.as_str() >= since {
            let entry = latest
                .entry(job)
                .or_insert_with(|| (at.clone(), by[0].clone()));
            if at >= entry.0 {
                *entry = (at, by[0].clone());
            }
        }
    }
    latest.into_iter().map(|(job, (_, by))| (job, by)).collect()
}

/// How many jobs each replica ran the latest occurrence of.
fn shares(runners: &BTreeMap<String, String>) -> BTreeMap<String, usize> {
    let mut shares = BTreeMap::new();
    for by in runners.values() {
        *shares.entry(by.clone()).or_insert(0) += 1;
    }
    shares
}

fn rfc3339(at: SystemTime) -> String {
    jiff::Timestamp::try_from(at)
        .expect("a time")
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Waits until, from a moment on, the latest occurrence of each of `jobs` jobs ran on the
/// replicas as `expected` says (replica → how many jobs), and returns who runs which.
pub(crate) fn wait_for_shares(
    replicas: &[&Proc],
    jobs: usize,
    expected: &[(&str, usize)],
) -> BTreeMap<String, String> {
    let expected: BTreeMap<String, usize> = expected
        .iter()
        .map(|(name, count)| ((*name).to_owned(), *count))
        .collect();
    let deadline = Instant::now() + WAIT;
    loop {
        let since = rfc3339(SystemTime::now() - Duration::from_secs(1));
        std::thread::sleep(Duration::from_millis(1500));
        let runners = latest_runners(replicas, &since);
        if runners.len() == jobs && shares(&runners) == expected {
            return runners;
        }
        assert!(
            Instant::now() < deadline,
            "the jobs were not shared out as {expected:?} within {WAIT:?}: {:?}\n{}",
            shares(&runners),
            replicas
                .iter()
                .map(|replica| replica.dump())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Six every-second jobs on one replica, then on three: two each, every replica having read
/// the whole file. Returns the replicas and who runs which job.
pub fn three_replicas_share_six_jobs(spawn: Spawn) -> ([Proc; 3], BTreeMap<String, String>) {
    let file = every_second("shared", 6, RAN);
    let a = spawn("A", &file);
    wait_for_shares(&[&a], 6, &[("A", 6)]);
    let b = spawn("B", &file);
    let c = spawn("C", &file);
    let runners = wait_for_shares(&[&a, &b, &c], 6, &[("A", 2), ("B", 2), ("C", 2)]);
    // Each replica read the whole file, and none ever thought another defines a job
    // otherwise (B and C join together: a roster read can fall inside the other's join).
    for replica in [&a, &b, &c] {
        let line = replica.wait_log("joined the replicas of this crontab");
        assert_eq!(field(&line, "jobs"), "6");
        assert!(
            !replica.printed(Stream::Stderr, "is defined otherwise"),
            "one file, yet a disagreement:\n{}",
            replica.dump()
        );
    }
    ([a, b, c], runners)
}

/// Stops the replicas with TERM, the last started first, and fails if any occurrence ran
/// twice.
pub fn stop_and_assert_each_occurrence_once(replicas: &[&Proc]) {
    for replica in replicas.iter().rev() {
        replica.terminate_cleanly();
    }
    assert_each_occurrence_once(replicas);
}

/// Four every-second jobs on A and B, two each; B is killed -9, and A runs each of B's jobs
/// from the first occurrence after the kill or the one after it (a kill a hair before the
/// second: the takeover itself takes a moment). Returns how long after the kill A ran the
/// last of B's jobs for the first time.
pub fn a_killed_replica_s_jobs_run_on_the_other(spawn: Spawn) -> Duration {
    let file = every_second("killed", 4, RAN);
    let a = spawn("A", &file);
    wait_for_shares(&[&a], 4, &[("A", 4)]);
    let b = spawn("B", &file);
    let runners = wait_for_shares(&[&a, &b], 4, &[("A", 2), ("B", 2)]);
    let b_jobs: BTreeSet<String> = runners
        .iter()
        .filter(|(_, by)| by.as_str() == "B")
        .map(|(job, _)| job.clone())
        .collect();
    let killed = SystemTime::now();
    let since_kill = Instant::now();
    b.signal(Signal::SIGKILL);
    assert!(b.wait_exit().code().is_none());
    let next = rfc3339(killed + Duration::from_secs(1));
    let after_next = rfc3339(killed + Duration::from_secs(2));
    let mut taken = Duration::ZERO;
    for job in &b_jobs {
        let deadline = Instant::now() + WAIT;
        let first = loop {
            let first = runs(&[&a])
                .into_keys()
                .filter(|(j, at)| j == job && at.as_str() >= next.as_str())
                .map(|(_, at)| at)
                .next();
            if let Some(first) = first {
                break first;
            }
            assert!(
                Instant::now() < deadline,
                "A never ran {job} after the kill\n{}",
                a.dump()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        taken = taken.max(since_kill.elapsed());
        assert!(
            first <= after_next,
            "{job}'s first run on A after the kill was {first}, the kill came before {next}\n{}",
            a.dump()
        );
    }
    a.terminate_cleanly();
    assert_each_occurrence_once(&[&a, &b]);
    taken
}

/// One every-second job that takes 2.5 s, on A and B: whoever owns it skips the occurrences
/// that come while it runs, and never runs it twice at once.
pub fn a_long_job_skips_its_next_occurrence(spawn: Spawn) {
    let file = every_second(
        "overlap",
        1,
        "echo start at=$PGLEADER_SCHEDULED_TIME; sleep 2.5; echo end at=$PGLEADER_SCHEDULED_TIME",
    );
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    // The replica that skips an occurrence is the job's owner, which runs it.
    let deadline = Instant::now() + WAIT;
    let (runner, skipped) = loop {
        let found = [&a, &b].into_iter().find_map(|replica| {
            replica
                .wait_line(
                    Stream::Stderr,
                    "was skipped: the run of",
                    1,
                    None,
                    Duration::ZERO,
                )
                .map(|(line, _)| (replica, line))
        });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no occurrence skipped within {WAIT:?}\n{}\n{}",
            a.dump(),
            b.dump()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(field(&skipped, "job"), "j1", "{skipped}");
    runner.wait_for_nth(Stream::Stdout, "end at=", 2);
    // Start, end, start, end: never two runs at once.
    let events: Vec<String> = runner
        .lines(Stream::Stdout)
        .into_iter()
        .filter(|line| line.starts_with("start") || line.starts_with("end"))
        .collect();
    for pair in events.chunks(2) {
        if let [start, end] = pair {
            assert!(
                start.starts_with("start") && end.starts_with("end"),
                "{events:?}"
            );
            assert_eq!(field(start, "at"), field(end, "at"), "{events:?}");
        }
    }
    for replica in [&a, &b] {
        replica.terminate_cleanly();
    }
}

/// A crontab's replica and a `--shards 2` replica of the same lock, `shards` starting the
/// latter: whichever comes second exits 2 saying how the other runs the lock, and runs
/// nothing; a plain replica of the lock beside the crontab is refused too.
pub fn shards_and_a_crontab_on_one_lock_refuse_each_other(
    spawn: Spawn,
    shards: &dyn Fn(&str, &[&str]) -> Proc,
) {
    let file = every_second("refuse", 2, RAN);
    let cron = spawn("C", &file);
    cron.wait_stdout("ran job=");
    let sharded = shards("S", &["--shards=2"]);
    assert_eq!(sharded.wait_code(), 2, "{}", sharded.dump());
    let refusal = sharded.wait_log("as a crontab (pgleader cron), this one with --shards 2");
    assert!(refusal.contains("runs this lock"), "{refusal}");
    assert!(
        !sharded.printed(Stream::Stdout, "started"),
        "{}",
        sharded.dump()
    );
    let plain = shards("P", &[]);
    assert_eq!(plain.wait_code(), 2, "{}", plain.dump());
    plain.wait_log("a lock runs either sharded on every replica or on none");
    assert!(
        !plain.printed(Stream::Stdout, "started"),
        "{}",
        plain.dump()
    );
    cron.terminate_cleanly();

    let sharded = shards("S2", &["--shards=2"]);
    sharded.wait_for_nth(Stream::Stdout, "started", 2);
    let cron = spawn("C2", &file);
    assert_eq!(cron.wait_code(), 2, "{}", cron.dump());
    cron.wait_log("with --shards 2, this one as a crontab (pgleader cron)");
    assert!(!cron.printed(Stream::Stdout, "ran job="), "{}", cron.dump());
    sharded.signal(Signal::SIGTERM);
    assert_eq!(sharded.wait_code(), 0, "{}", sharded.dump());
}

// --- On PostgreSQL. ---

/// `pgleader cron --lock-id LOCK FILE` on the shared cluster.
fn replica(name: &str, lock: i64, file: &File) -> Proc {
    replica_with(name, lock, file, &[])
}

/// `pgleader cron --lock-id LOCK ARGS... FILE` on the shared cluster.
pub(crate) fn replica_with(name: &str, lock: i64, file: &File, args: &[&str]) -> Proc {
    cron_replica(name, &Cluster::shared().url(), lock, args, file)
}

/// [`replica`] as a scenario's [`Spawn`].
fn pg_replica(lock: i64) -> impl Fn(&str, &File) -> Proc {
    move |name, file| replica(name, lock, file)
}

#[test]
fn the_jobs_are_shared_out_evenly_and_each_occurrence_runs_once() {
    let lock = unique_lock();
    let ([a, b, c], runners) = three_replicas_share_six_jobs(&pg_replica(lock));
    // Two sessions per replica whatever the number of jobs: its holder and its watcher.
    wait_for_two_sessions_each(&[&a, &b, &c], sessions_of);
    // A job moved to another replica keeps one ledger: its history goes on there.
    for job in runners.keys() {
        let (distinct, all) = succeeded_in_ledger(&format!("{lock}\u{1f}{job}"));
        assert!(distinct >= 3, "{job}: {distinct} runs in the ledger");
        assert_eq!(distinct, all, "{job}: an occurrence recorded twice");
    }
    stop_and_assert_each_occurrence_once(&[&a, &b, &c]);
}

/// The outcome the shared cluster's ledger records for the occurrence `at` under the key named
/// `name`.
fn outcome_in_ledger(name: &str, at: &str) -> String {
    let rows = Cluster::shared()
        .client()
        .query(
            "SELECT outcome FROM pgleader_ledger \
             WHERE lock_key = hashtextextended($1, 0) AND scheduled_for = $2::text::timestamptz",
            &[&name, &at],
        )
        .expect("the ledger");
    rows[0].get(0)
}

/// How many distinct occurrences the shared cluster's ledger records as succeeded under the
/// key named `name`, and how many rows.
pub fn succeeded_in_ledger(name: &str) -> (i64, i64) {
    let rows = Cluster::shared()
        .client()
        .query(
            "SELECT count(DISTINCT scheduled_for), count(*) FROM pgleader_ledger \
             WHERE lock_key = hashtextextended($1, 0) AND outcome = 'succeeded'",
            &[&name],
        )
        .expect("the ledger");
    (rows[0].get(0), rows[0].get(1))
}

#[test]
fn the_jobs_of_a_replica_killed_9_run_on_the_others_from_their_next_occurrence() {
    a_killed_replica_s_jobs_run_on_the_other(&pg_replica(unique_lock()));
}

/// A job's occurrence is claimed a moment ahead of it and its command starts at the instant: a
/// replica killed -9 between the two leaves the occurrence to the job's next owner, which takes
/// the claim back and runs the occurrence itself, rather than record it as interrupted.
#[test]
fn an_occurrence_claimed_ahead_by_a_replica_killed_9_before_its_instant_runs_on_the_next_owner() {
    let lock = unique_lock();
    let job = format!("ahead{lock}");
    // Every 2 s: claimed 500 ms ahead (`CLAIM_AHEAD`, a quarter of the gap at most).
    let file = File::new(
        "ahead",
        &format!("# pgleader: name={job}\n*/2 * * * * * * {RAN}\n"),
    );
    let (a, b) = (replica("A", lock, &file), replica("B", lock, &file));
    // A claim of the job's not yet due (more than 300 ms ahead), and who made it; the first
    // replica to begin creates the ledger.
    let mut client = Cluster::shared().client();
    let undefined = |err: &postgres::Error| err.code() == Some(&SqlState::UNDEFINED_TABLE);
    let deadline = Instant::now() + WAIT;
    let (at, pid) = loop {
        let rows = client
            .query(
                "SELECT to_char(scheduled_for AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), pid \
                   FROM pgleader_ledger \
                  WHERE lock_name LIKE '%' || chr(31) || $1 AND outcome = 'running' \
                    AND scheduled_for > clock_timestamp() + interval '300 milliseconds'",
                &[&job],
            )
            .or_else(|err| if undefined(&err) { Ok(Vec::new()) } else { Err(err) })
            .expect("the ledger");
        if let Some(row) = rows.first() {
            break (row.get::<_, String>(0), row.get::<_, i32>(1));
        }
        assert!(
            Instant::now() < deadline,
            "no claim of {job} made ahead of its occurrence\n{}\n{}",
            a.dump(),
            b.dump()
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let (owner, next) = if pid == a.pid.as_raw() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert_eq!(pid, owner.pid.as_raw(), "the claim is one of the replicas'");
    owner.signal(Signal::SIGKILL);
    assert!(owner.wait_exit().code().is_none());
    next.wait_for(Stream::Stdout, &format!("ran job={job} at={at} "));
    let deadline = Instant::now() + WAIT;
    while outcome_in_ledger_of(&job, &at) != "succeeded" {
        assert!(
            Instant::now() < deadline,
            "the occurrence of {at} was not recorded as succeeded: {}\n{}",
            outcome_in_ledger_of(&job, &at),
            next.dump()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    next.terminate_cleanly();
    assert_each_occurrence_once(&[&a, &b]);
}

/// The outcome the shared cluster's ledger records for crontab job `job`'s occurrence `at`.
fn outcome_in_ledger_of(job: &str, at: &str) -> String {
    let rows = Cluster::shared()
        .client()
        .query(
            "SELECT outcome FROM pgleader_ledger \
             WHERE lock_name LIKE '%' || chr(31) || $1 AND scheduled_for = $2::text::timestamptz",
            &[&job, &at],
        )
        .expect("the ledger");
    rows.first()
        .map_or_else(|| "none".to_owned(), |row| row.get(0))
}

#[test]
fn a_job_still_running_at_its_next_occurrence_skips_it_and_never_overlaps() {
    a_long_job_skips_its_next_occurrence(&pg_replica(unique_lock()));
}

#[test]
fn shards_and_a_crontab_on_one_lock_refuse_each_other_with_exit_2() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    shards_and_a_crontab_on_one_lock_refuse_each_other(&pg_replica(lock), &|name, args| {
        run_replica(name, &url, lock, args)
    });
}

#[test]
fn sighup_rereads_the_file_and_a_bad_one_leaves_the_old_running() {
    sighup_rereads_the_file(&pg_replica(unique_lock()));
}

/// A and B run j1 and j2; a file that does not parse is refused on HUP with its line and the
/// old one keeps running; then j1 changed, j2 removed, j3 added: the fleet follows.
pub fn sighup_rereads_the_file(spawn: Spawn) {
    let file = every_second("reread", 2, RAN);
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    wait_for_shares(&[&a, &b], 2, &[("A", 1), ("B", 1)]);

    // A line that does not parse: both say where, and go on with the file read before.
    std::fs::write(
        &file.0,
        "# pgleader: name=j1\n* * * * * * * echo ran\n61 * * * * true\n",
    )
    .expect("write the crontab");
    for replica in [&a, &b] {
        replica.signal(Signal::SIGHUP);
        let refused = replica.wait_log("the crontab read before keeps running");
        assert!(
            refused.contains(&format!("{}:3", file.0.display())),
            "{refused}"
        );
    }
    wait_for_shares(&[&a, &b], 2, &[("A", 1), ("B", 1)]);

    // j1 changed, j2 removed, j3 added; and a name set below a job, which the reread warns of
    // as a start does.
    std::fs::write(
        &file.0,
        format!(
            "# pgleader: name=j1\n* * * * * * * {RAN} v=2\n\
             # pgleader: name=j3\n* * * * * * * {RAN}\nLATE=1\n"
        ),
    )
    .expect("write the crontab");
    let reread = Instant::now();
    for replica in [&a, &b] {
        replica.signal(Signal::SIGHUP);
        let warned = replica.wait_log("LATE is set below a job");
        assert!(
            warned.contains(&format!("{}:5", file.0.display())),
            "{warned}"
        );
        let line = replica.wait_log("reread the crontab");
        assert_eq!(
            (
                field(&line, "added"),
                field(&line, "removed"),
                field(&line, "changed")
            ),
            ("1".into(), "1".into(), "1".into()),
            "{line}"
        );
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let since = rfc3339(SystemTime::now() - Duration::from_secs(1));
        std::thread::sleep(Duration::from_millis(1500));
        let runners = latest_runners(&[&a, &b], &since);
        let v2 = [&a, &b].iter().any(|replica| {
            replica
                .lines(Stream::Stdout)
                .iter()
                .any(|line| line.contains("job=j1 ") && line.ends_with("v=2"))
        });
        if runners.keys().cloned().collect::<Vec<_>>() == ["j1", "j3"]
            && shares(&runners).values().all(|&count| count == 1)
            && v2
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the reread file was not followed within {WAIT:?} of {reread:?}: {runners:?}\n{}\n{}",
            a.dump(),
            b.dump()
        );
    }
    // Whoever owned the removed job let it go once its last run was over, and says which.
    let released = |replica: &Proc| replica.printed(Stream::Stderr, "released job j2");
    assert!(
        released(&a) || released(&b),
        "nobody said it released j2:\n{}\n{}",
        a.dump(),
        b.dump()
    );
    for replica in [&a, &b] {
        replica.terminate_cleanly();
    }
    assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn a_reread_runs_an_added_or_rescheduled_job_from_its_next_occurrence() {
    a_reread_starts_new_definitions_at_their_next_occurrence(&pg_replica(unique_lock()));
}

/// One replica runs j1 every second; a reread, a second and a half after an occurrence of
/// `*/5`, reschedules j1 to every five seconds and adds j9 on the same: each first runs at the
/// next multiple of five, never the one just before the reread (as cron and supercronic; a
/// catch-up is for a known definition's occurrences, missed while no replica ran them).
pub fn a_reread_starts_new_definitions_at_their_next_occurrence(spawn: Spawn) {
    let file = every_second("rescheduled", 1, RAN);
    let a = spawn("A", &file);
    wait_for_shares(&[&a], 1, &[("A", 1)]);
    // 1.5 s past a multiple of five seconds: aligned with the wall clock, not a wait for an
    // event.
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970");
    let into = (now.as_millis() % 5000) as u64;
    std::thread::sleep(Duration::from_millis((6500 - into) % 5000));
    std::fs::write(
        &file.0,
        format!(
            "# pgleader: name=j1\n*/5 * * * * * * {RAN} v=2\n\
             # pgleader: name=j9\n*/5 * * * * * * {RAN}\n"
        ),
    )
    .expect("write the crontab");
    let reread = rfc3339(SystemTime::now());
    // USR2, supercronic's reload signal, rereads as HUP does.
    a.signal(Signal::SIGUSR2);
    a.wait_log("reread the crontab");
    for (job, needle) in [("j1", "job=j1 "), ("j9", "job=j9 ")] {
        let deadline = Instant::now() + WAIT;
        let first = loop {
            let lines = a.lines(Stream::Stdout);
            let first = lines
                .iter()
                .filter(|line| line.contains(needle))
                .filter(|line| job == "j9" || line.ends_with("v=2"))
                .map(|line| field(line, "at"))
                .next();
            if let Some(first) = first {
                break first;
            }
            assert!(Instant::now() < deadline, "{job} never ran\n{}", a.dump());
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            first.as_str() > reread.as_str(),
            "{job}'s first run under its new definition was the occurrence of {first}, before \
             the reread at {reread}\n{}",
            a.dump()
        );
    }
    a.terminate_cleanly();
    assert_each_occurrence_once(&[&a]);
}

#[test]
fn a_term_lets_a_running_job_end_and_hands_the_other_jobs_over_at_once() {
    a_term_drains(&pg_replica(unique_lock()), false);
}

#[test]
fn a_replica_killed_9_while_it_drains_leaves_nothing_running_and_its_job_runs_elsewhere() {
    a_term_drains(&pg_replica(unique_lock()), true);
}

/// Four every-second jobs on A and B, one of them (`long`) taking three seconds. Its owner is
/// told TERM while a run of `long` goes on: it starts no run, hands its other job over at once
/// (the other replica runs its next occurrences on time), lets the run end by itself (no
/// signal), and keeps `long` until then, so that no occurrence of it starts elsewhere beside
/// the run; then it exits 0. With `kill`, the owner is killed -9 in the middle of the drain
/// instead: its keeper kills the run's tree, and `long` runs on the other replica after it.
pub fn a_term_drains(spawn: Spawn, kill: bool) {
    let mut text = String::from("# pgleader: name=long\n");
    text.push_str(&format!(
        "* * * * * * * {RAN}; sleep 3; echo end job=long at=$PGLEADER_SCHEDULED_TIME\n"
    ));
    for n in 1..=3 {
        text.push_str(&format!("# pgleader: name=j{n}\n* * * * * * * {RAN}\n"));
    }
    let file = File::new("drain", &text);
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    let runners = wait_for_shares(&[&a, &b], 4, &[("A", 2), ("B", 2)]);
    let (owner, other) = match runners["long"].as_str() {
        "A" => (&a, &b),
        _ => (&b, &a),
    };
    let handed: Vec<String> = runners
        .iter()
        .filter(|(job, by)| job.as_str() != "long" && by.as_str() == owner.name)
        .map(|(job, _)| job.clone())
        .collect();
    // A run of `long` that has just started: TERM now leaves it most of its three seconds.
    let runs_so_far = lines_with(owner, Stream::Stdout, &["ran job=long"]).len();
    let started = owner.wait_for_nth(Stream::Stdout, "ran job=long", runs_so_far + 1);
    let at = field(&started, "at");
    owner.signal(Signal::SIGTERM);
    let termed = SystemTime::now();
    owner.wait_log("draining");
    // The other replica runs the handed-over job from its next occurrence or the one after.
    let by = rfc3339(termed + Duration::from_secs(2));
    for job in &handed {
        let first = other.wait_stdout(&format!("ran job={job} "));
        let first = lines_with(other, Stream::Stdout, &[&format!("ran job={job} ")])
            .into_iter()
            .map(|line| field(&line, "at"))
            .find(|ran| ran.as_str() > rfc3339(termed - Duration::from_secs(1)).as_str())
            .unwrap_or_else(|| field(&first, "at"));
        assert!(
            first <= by,
            "{job} first ran on {} at {first}, the drain began at {}\n{}",
            other.name,
            rfc3339(termed),
            owner.dump()
        );
    }
    if kill {
        owner.signal(Signal::SIGKILL);
        assert!(owner.wait_exit().code().is_none());
        assert!(
            !owner.printed(Stream::Stdout, &format!("end job=long at={at}")),
            "the run ended before the kill: too slow a machine for this test\n{}",
            owner.dump()
        );
    } else {
        // The run ends by itself, and then the drained replica exits 0.
        owner.wait_stdout(&format!("end job=long at={at}"));
        assert_eq!(owner.wait_code(), 0, "{}", owner.dump());
        assert!(
            !owner.printed(Stream::Stderr, "interrupted"),
            "{}",
            owner.dump()
        );
    }
    // `long` moves once the run's tree is gone, and never ran beside it: drained, its first
    // occurrence on the other replica comes after the run's three seconds; killed, after the
    // occurrence of the run the keeper killed.
    let moved = other.wait_stdout("ran job=long ");
    let moved = field(&moved, "at");
    let began: jiff::Timestamp = at.parse().expect("an instant");
    let after = match kill {
        false => rfc3339(SystemTime::from(began) + Duration::from_secs(3)),
        true => rfc3339(SystemTime::from(began) + Duration::from_secs(1)),
    };
    assert!(
        moved >= after,
        "long ran on {} at {moved}, beside the drained run of {at}\n{}",
        other.name,
        other.dump()
    );
    other.terminate_cleanly();
    assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn a_drain_bounded_by_drain_timeout_stops_the_run_still_going_then() {
    let lock = unique_lock();
    let file = File::new(
        "drain-bound",
        "# pgleader: name=endless\n\
         * * * * * * * trap 'echo got TERM at=$PGLEADER_SCHEDULED_TIME; exit 0' TERM; \
         echo start at=$PGLEADER_SCHEDULED_TIME; sleep 1000 & wait\n",
    );
    let a = replica_with("A", lock, &file, &["--drain-timeout=1s"]);
    let started = field(&a.wait_stdout("start at="), "at");
    a.signal(Signal::SIGTERM);
    a.wait_log("draining");
    let bound = a.wait_log("took its --drain-timeout");
    assert_eq!(field(&bound, "runs"), "1", "{bound}");
    assert_eq!(field(&a.wait_stdout("got TERM"), "at"), started);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    let outcome = outcome_in_ledger(&format!("{lock}\u{1f}endless"), &started);
    assert_eq!(outcome, "interrupted");
}

#[test]
fn in_a_rolling_deploy_a_job_only_some_replicas_know_runs_on_one_of_those() {
    let lock = unique_lock();
    a_rolling_deploy_runs_every_job_once(
        &|name, file, args| replica_with(name, lock, file, args),
        &|name, args| crate::harness::pg::status(name, Cluster::shared(), lock, args),
    );
}

/// A with the old file and B with the new one: a job only one of them knows runs there, the
/// jobs both know run on one of them, and one defined otherwise by each shows once on each's
/// log, in `status --json` (each definition with its replica), in each one's `/status` and
/// metric; once A rereads a file that defines it as B does, none of them shows it any more.
pub fn a_rolling_deploy_runs_every_job_once(spawn: SpawnWith, status: StatusOf) {
    const HTTP: &str = "--http=127.0.0.1:0";
    let job = |name: &str| format!("# pgleader: name={name}\n* * * * * * * {RAN}\n");
    // j2 is defined otherwise in the new file: it runs under one definition at a time, and
    // the disagreement shows once, not at every occurrence.
    let j2_v2 = format!("# pgleader: name=j2\n* * * * * * * {RAN} v=2\n");
    let old = File::new("rolling-old", &[job("j1"), job("j2"), job("old")].concat());
    let new = File::new(
        "rolling-new",
        &[job("j1"), j2_v2.clone(), job("new")].concat(),
    );
    let a = spawn("A", &old, &[HTTP]);
    let b = spawn("B", &new, &[HTTP]);
    let deadline = Instant::now() + WAIT;
    loop {
        let since = rfc3339(SystemTime::now() - Duration::from_secs(1));
        std::thread::sleep(Duration::from_millis(1500));
        let runners = latest_runners(&[&a, &b], &since);
        if runners.len() == 4 {
            assert_eq!(runners["old"], "A", "{runners:?}");
            assert_eq!(runners["new"], "B", "{runners:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every job ran within {WAIT:?}: {runners:?}\n{}\n{}",
            a.dump(),
            b.dump()
        );
    }
    for replica in [&a, &b] {
        let line = replica.wait_log("is defined otherwise by the replica of member");
        assert_eq!(field(&line, "job"), "j2", "{line}");
    }
    // Both logged it, so both have published it; their markers were there before.
    let http = [address_of(&a), address_of(&b)];
    let seen = status_json(status, "status-disagree");
    let ids = member_ids(&seen, &[&a, &b]);
    assert_eq!(seen["crontab"]["defined_otherwise"], 1, "{seen}");
    let j2 = job_of(&seen, "j2");
    assert_eq!(j2["defined_otherwise"], true, "{seen}");
    let definitions = j2["definitions"].as_array().expect("j2's definitions");
    assert_eq!(definitions.len(), 2, "{seen}");
    let definition_of = |id: i64| {
        definitions
            .iter()
            .find(|d| d["members"] == serde_json::json!([id]))
            .unwrap_or_else(|| panic!("no definition held by {id} alone: {seen}"))["definition"]
            .clone()
    };
    for (me, other) in [(0, 1), (1, 0)] {
        let job = replica_job(http[me], "j2");
        assert_eq!(
            job["defined_otherwise_by"],
            serde_json::json!([ids[other]]),
            "{job}"
        );
        assert_eq!(job["definition"], definition_of(ids[me]), "{job}");
        let metrics = get(http[me], "/metrics").body;
        assert_eq!(mismatch(&metrics, "j2"), 1.0, "{metrics}");
        assert_eq!(mismatch(&metrics, "j1"), 0.0, "{metrics}");
    }
    let j1 = job_of(&seen, "j1");
    assert_eq!(j1["defined_otherwise"], false, "{seen}");
    assert_eq!(
        j1["definitions"][0]["members"].as_array().map(Vec::len),
        Some(2),
        "{seen}"
    );

    // `status --watch`, started while they disagree, prints a line once they agree.
    let watch = status("watch", &["--watch"]);
    watch.wait_line_where(Stream::Stdout, "j2 defined 2 ways", |line| {
        line.contains(" j2 ") && line.contains(", defined 2 ways")
    });

    // A rereads a file that defines j2 as B's does: both say so, and it shows nowhere.
    std::fs::write(&old.0, [job("j1"), j2_v2.clone(), job("old")].concat())
        .expect("write the crontab");
    a.signal(Signal::SIGHUP);
    for replica in [&a, &b] {
        let line = replica.wait_log("is no longer defined otherwise");
        assert_eq!(field(&line, "job"), "j2", "{line}");
    }
    let seen = status_json(status, "status-agreed");
    assert_eq!(seen["crontab"]["defined_otherwise"], 0, "{seen}");
    let j2 = job_of(&seen, "j2");
    assert_eq!(j2["defined_otherwise"], false, "{seen}");
    assert_eq!(
        j2["definitions"].as_array().map(Vec::len),
        Some(1),
        "{seen}"
    );
    assert_eq!(
        j2["definitions"][0]["definition"],
        definition_of(ids[1]),
        "{seen}"
    );
    for address in http {
        let job = replica_job(address, "j2");
        assert_eq!(job["defined_otherwise_by"], serde_json::json!([]), "{job}");
        assert_eq!(mismatch(&get(address, "/metrics").body, "j2"), 0.0);
    }
    watch.wait_line_where(Stream::Stdout, "j2 defined one way", |line| {
        line.contains(" j2 ") && !line.contains("defined 2 ways")
    });
    watch.signal(Signal::SIGTERM);
    watch.wait_exit();
    for replica in [&a, &b] {
        replica.terminate_cleanly();
        let mismatches = replica
            .lines(Stream::Stderr)
            .iter()
            .filter(|line| line.contains("is defined otherwise"))
            .count();
        assert_eq!(mismatches, 1, "{}", replica.dump());
    }
    assert_each_occurrence_once(&[&a, &b]);
}

/// `pgleader status --json` of the fleet, once.
fn status_json(status: StatusOf, name: &str) -> serde_json::Value {
    let shown = status(name, &["--json"]);
    assert_eq!(shown.wait_code(), 0, "{}", shown.dump());
    serde_json::from_str(&shown.lines(Stream::Stdout).join("\n")).expect("JSON status")
}

/// The job named `name` in `status --json`.
fn job_of(seen: &serde_json::Value, name: &str) -> serde_json::Value {
    let jobs = seen["crontab"]["jobs"].as_array();
    jobs.and_then(|jobs| jobs.iter().find(|job| job["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no job {name}: {seen}"))
}

/// Each replica's member id (as its log and `/status` name it), as `status --json` shows the
/// replicas.
fn member_ids(seen: &serde_json::Value, replicas: &[&Proc]) -> Vec<i64> {
    let shown = seen["shards"]["replicas"].as_array().expect("replicas");
    replicas
        .iter()
        .map(|replica| {
            let pid = i64::from(replica.pid.as_raw());
            shown
                .iter()
                .find(|shown| shown["pgleader_pid"] == pid)
                .and_then(|shown| shown["member"].as_i64())
                .unwrap_or_else(|| panic!("{} is not a replica: {seen}", replica.name))
        })
        .collect()
}

/// The job named `name` in the `/status` of the replica serving at `address`.
fn replica_job(address: std::net::SocketAddr, name: &str) -> serde_json::Value {
    let status = get(address, "/status").json();
    let jobs = status["jobs"].as_array();
    jobs.and_then(|jobs| jobs.iter().find(|job| job["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no job {name}: {status}"))
}

/// `pgleader_job_definition_mismatch` of `job` in a replica's metrics.
fn mismatch(metrics: &str, job: &str) -> f64 {
    let label = format!("job=\"{job}\"");
    sample(metrics, "pgleader_job_definition_mismatch", &[&label])
}

#[test]
fn a_run_that_takes_its_timeout_is_stopped_and_recorded_as_failed() {
    let lock = unique_lock();
    let file = File::new(
        "timeout",
        "# pgleader: name=slow timeout=1s\n\
         */3 * * * * * * trap 'echo got TERM at=$PGLEADER_SCHEDULED_TIME; exit 3' TERM; \
         echo start at=$PGLEADER_SCHEDULED_TIME; sleep 30 & wait\n",
    );
    let a = replica("A", lock, &file);
    let started = a.wait_stdout("start at=");
    let stopped = a.wait_log("has taken its timeout=1s");
    assert_eq!(field(&stopped, "job"), "slow", "{stopped}");
    let term = a.wait_stdout("got TERM");
    assert_eq!(field(&term, "at"), field(&started, "at"));
    a.wait_log("failed (exit code 3)");
    // The next occurrence runs as usual.
    a.wait_for_nth(Stream::Stdout, "start at=", 2);
    a.terminate_cleanly();
    let mut client = Cluster::shared().client();
    let at = field(&started, "at");
    let rows = client
        .query(
            "SELECT outcome, exit_code FROM pgleader_ledger \
             WHERE lock_key = hashtextextended($1, 0) AND scheduled_for = $2::text::timestamptz",
            &[&format!("{lock}\u{1f}slow"), &at],
        )
        .expect("the ledger");
    assert_eq!(rows.len(), 1, "{at}");
    assert_eq!(rows[0].get::<_, String>(0), "failed");
    assert_eq!(rows[0].get::<_, Option<i32>>(1), Some(3));
}

#[test]
fn with_overlap_replace_the_next_occurrence_stops_the_run_still_going_and_runs() {
    let lock = unique_lock();
    let file = File::new(
        "replace",
        "# pgleader: name=feed overlap=replace\n\
         */2 * * * * * * trap 'echo got TERM at=$PGLEADER_SCHEDULED_TIME; exit 0' TERM; \
         echo start at=$PGLEADER_SCHEDULED_TIME; sleep 30 & wait\n",
    );
    let a = replica("A", lock, &file);
    let first = field(&a.wait_stdout("start at="), "at");
    let replaced = a.wait_log("was replaced by the occurrence of");
    assert_eq!(field(&replaced, "job"), "feed", "{replaced}");
    let term = a.wait_stdout("got TERM");
    assert_eq!(field(&term, "at"), first);
    let second = field(&a.wait_for_nth(Stream::Stdout, "start at=", 2), "at");
    assert!(second > first, "{first} then {second}");
    // Never two runs at once: the second started after the first got its TERM.
    let lines = a.lines(Stream::Stdout);
    let position = |needle: &str| lines.iter().position(|line| line.contains(needle));
    assert!(
        position("got TERM") < position(&format!("start at={second}")),
        "{lines:?}"
    );
    // INT: a TERM would drain, waiting for the run going on.
    a.interrupt_cleanly();
    let outcome = outcome_in_ledger(&format!("{lock}\u{1f}feed"), &first);
    assert_eq!(outcome, "interrupted");
}

#[test]
fn with_overlap_allow_the_next_occurrence_runs_beside_the_run_still_going() {
    let lock = unique_lock();
    let file = File::new(
        "allow",
        "# pgleader: name=slow overlap=allow\n\
         * * * * * * * echo start at=$PGLEADER_SCHEDULED_TIME; sleep 2.5; echo end at=$PGLEADER_SCHEDULED_TIME\n",
    );
    let a = replica("A", lock, &file);
    // Three runs ended and were recorded, whatever ends at the moment of the stop.
    a.wait_for_nth(Stream::Stderr, "succeeded job=slow", 3);
    a.terminate_cleanly();
    // Runs overlap: a second run started before the first one ended, and each occurrence ran
    // once and ended as it started.
    let lines = a.lines(Stream::Stdout);
    let position = |needle: &str| lines.iter().position(|line| line.contains(needle));
    let starts: Vec<String> = lines
        .iter()
        .filter(|line| line.starts_with("start"))
        .map(|line| field(line, "at"))
        .collect();
    assert!(starts.len() >= 3, "{lines:?}");
    assert!(
        position(&format!("start at={}", starts[1])) < position(&format!("end at={}", starts[0])),
        "the second run did not start while the first went on: {lines:?}"
    );
    let unique: BTreeSet<&String> = starts.iter().collect();
    assert_eq!(
        unique.len(),
        starts.len(),
        "an occurrence ran twice: {lines:?}"
    );
    assert!(!a.printed(Stream::Stderr, "was skipped"), "{}", a.dump());
    let mut client = Cluster::shared().client();
    let rows = client
        .query(
            "SELECT count(*) FROM pgleader_ledger WHERE lock_key = hashtextextended($1, 0) \
             AND outcome = 'succeeded'",
            &[&format!("{lock}\u{1f}slow")],
        )
        .expect("the ledger");
    assert!(rows[0].get::<_, i64>(0) >= 3);
}

/// The claims of the occurrences that fall due at one instant are committed together: one
/// transaction (one WAL flush) for all of a replica's jobs, not one each, which made the last
/// of a second's claims wait for all the others' flushes. The rows of one transaction share
/// its `xmin`.
#[test]
fn the_claims_due_at_one_instant_are_committed_in_one_transaction() {
    const JOBS: usize = 20;
    let lock = unique_lock();
    // catch-up=0s: the occurrence already past when a job is taken is recorded missed, not
    // run, so every claim below is one of an instant's, made as it falls due.
    let mut text = String::new();
    for n in 1..=JOBS {
        text.push_str(&format!(
            "# pgleader: name=b{n} catch-up=0s\n*/2 * * * * * * echo start job=$PGLEADER_JOB at=$PGLEADER_SCHEDULED_TIME; exec sleep 1000\n"
        ));
    }
    let file = File::new("bundled", &text);
    let a = replica("A", lock, &file);
    let last = a.wait_for_nth(Stream::Stdout, "start job=", JOBS);
    let at = field(&last, "at");
    let started = lines_with(&a, Stream::Stdout, &["start job="]);
    assert!(
        started.iter().all(|line| field(line, "at") == at),
        "every job's first run is of one occurrence: {started:#?}"
    );
    let keys: Vec<String> = (1..=JOBS).map(|n| format!("{lock}\u{1f}b{n}")).collect();
    let mut client = Cluster::shared().client();
    let row = client
        .query_one(
            "SELECT count(*), count(DISTINCT xmin::text) FROM pgleader_ledger \
             WHERE lock_key IN (SELECT hashtextextended(k, 0) FROM unnest($1::text[]) AS k) \
               AND scheduled_for = $2::text::timestamptz AND outcome = 'running'",
            &[&keys, &at],
        )
        .expect("the ledger");
    let (rows, transactions): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(rows, JOBS as i64, "every job's claim of {at} is recorded");
    // One transaction, or two should the event loop have seen the timers in two turns; one
    // each (20) without the group commit.
    assert!(
        transactions <= 2,
        "the {JOBS} claims of {at} took {transactions} transactions"
    );
    // INT: a TERM would drain, waiting for the run going on.
    a.interrupt_cleanly();
}

/// Every run of a replica's session starts under one keeper, the session's, started with the
/// session (`keeper/session.rs`): no keeper per run or parked ahead of an occurrence. It is gone
/// before pgleader exits.
#[test]
fn every_run_of_a_session_starts_under_the_session_s_one_keeper() {
    let lock = unique_lock();
    let file = File::new(
        "session-keeper",
        "# pgleader: name=p\n* * * * * * * echo start job=$PGLEADER_JOB keeper=$PPID\n\
         # pgleader: name=q\n* * * * * * * echo start job=$PGLEADER_JOB keeper=$PPID\n",
    );
    let a = replica_with("A", lock, &file, &[]);
    let starts: Vec<String> = (1..=6)
        .map(|n| a.wait_for_nth(Stream::Stdout, "start job=", n))
        .collect();
    let keepers: std::collections::BTreeSet<i32> = starts
        .iter()
        .map(|line| pid_field(line, "keeper"))
        .collect();
    assert_eq!(
        keepers.len(),
        1,
        "the runs of both jobs had keepers {keepers:?}\n{}",
        a.dump()
    );
    let keeper = *keepers.first().expect("a keeper");
    assert_eq!(
        keepers_of(a.pid.as_raw()),
        vec![keeper],
        "the session's keeper, alone\n{}",
        a.dump()
    );
    let argv = std::fs::read(format!("/proc/{keeper}/cmdline")).unwrap_or_default();
    assert!(
        argv.split(|b| *b == 0).any(|word| word == b"session"),
        "{keeper} is not a session's keeper: {:?}",
        String::from_utf8_lossy(&argv)
    );
    a.terminate_cleanly();
    assert!(
        !is_running(keeper),
        "the session's keeper {keeper} outlived pgleader\n{}",
        a.dump()
    );
}
