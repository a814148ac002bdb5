//! `pgleader cron CRONTAB` on several replicas against a real PostgreSQL: the jobs are shared
//! out evenly, each occurrence of each job runs once across the fleet, a job still running
//! when its next occurrence comes skips it, and the jobs of a replica killed -9 run on the
//! others from their very next occurrence.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;

use crate::crontab::File;
use crate::harness::{Cluster, Proc, Stream, WAIT, field, pgleader, unique_lock};

/// A crontab of `jobs` every-second jobs, `j1` to `jN`, each running `command` (which sees
/// PGLEADER_JOB and PGLEADER_SCHEDULED_TIME).
pub(crate) fn every_second(tag: &str, jobs: usize, command: &str) -> File {
    let mut text = String::from("# every second, seven fields as supercronic reads them\n");
    for n in 1..=jobs {
        text.push_str(&format!("# pgleader: name=j{n}\n* * * * * * * {command}\n"));
    }
    File::new(tag, &text)
}

/// What every job prints when it runs.
pub(crate) const RAN: &str =
    "echo ran job=$PGLEADER_JOB at=$PGLEADER_SCHEDULED_TIME epoch=$PGLEADER_EPOCH";

/// `pgleader cron --lock-id LOCK FILE` on the shared cluster.
fn replica(name: &str, lock: i64, file: &File) -> Proc {
    replica_with(name, lock, file, &[])
}

/// `pgleader cron --lock-id LOCK ARGS... FILE` on the shared cluster.
pub(crate) fn replica_with(name: &str, lock: i64, file: &File, args: &[&str]) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", Cluster::shared().url())
        .arg("cron")
        .arg(format!("--lock-id={lock}"))
        .args(args)
        .arg(&file.0);
    Proc::spawn(name, command)
}

/// Every run the replicas printed: (job, occurrence) → the replicas that ran it.
fn runs(replicas: &[&Proc]) -> BTreeMap<(String, String), Vec<String>> {
    let mut seen: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for replica in replicas {
        for line in replica.lines(Stream::Stdout) {
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
fn assert_each_occurrence_once(replicas: &[&Proc]) {
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

#[test]
fn the_jobs_are_shared_out_evenly_and_each_occurrence_runs_once() {
    let lock = unique_lock();
    let file = every_second("shared", 6, RAN);
    let a = replica("A", lock, &file);
    wait_for_shares(&[&a], 6, &[("A", 6)]);
    let b = replica("B", lock, &file);
    let c = replica("C", lock, &file);
    let runners = wait_for_shares(&[&a, &b, &c], 6, &[("A", 2), ("B", 2), ("C", 2)]);
    // Each replica read the whole file.
    for replica in [&a, &b, &c] {
        let line = replica.wait_log("joined the replicas of this crontab");
        assert_eq!(field(&line, "jobs"), "6");
    }
    // A job moved to another replica keeps one ledger: its history goes on there.
    let mut client = Cluster::shared().client();
    for job in runners.keys() {
        let rows = client
            .query(
                "SELECT count(DISTINCT scheduled_for), count(*) FROM pgleader_ledger \
                 WHERE lock_key = hashtextextended($1, 0) AND outcome = 'succeeded'",
                &[&format!("{lock}\u{1f}{job}")],
            )
            .expect("the ledger");
        let (distinct, all): (i64, i64) = (rows[0].get(0), rows[0].get(1));
        assert!(distinct >= 3, "{job}: {distinct} runs in the ledger");
        assert_eq!(distinct, all, "{job}: an occurrence recorded twice");
    }
    for replica in [&c, &b, &a] {
        replica.terminate_cleanly();
    }
    assert_each_occurrence_once(&[&a, &b, &c]);
}

#[test]
fn the_jobs_of_a_replica_killed_9_run_on_the_others_from_their_next_occurrence() {
    let lock = unique_lock();
    let file = every_second("killed", 4, RAN);
    let a = replica("A", lock, &file);
    wait_for_shares(&[&a], 4, &[("A", 4)]);
    let b = replica("B", lock, &file);
    let runners = wait_for_shares(&[&a, &b], 4, &[("A", 2), ("B", 2)]);
    let b_jobs: BTreeSet<String> = runners
        .iter()
        .filter(|(_, by)| by.as_str() == "B")
        .map(|(job, _)| job.clone())
        .collect();
    let killed = SystemTime::now();
    b.signal(Signal::SIGKILL);
    assert!(b.wait_exit().code().is_none());
    // The first occurrence after the kill starts at the next whole second: A runs it for
    // every job B had, and the one after it at the latest (a kill a hair before the second).
    let next = rfc3339(killed + Duration::from_secs(1));
    let after_next = rfc3339(killed + Duration::from_secs(2));
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
        assert!(
            first <= after_next,
            "{job}'s first run on A after the kill was {first}, the kill came before {next}\n{}",
            a.dump()
        );
    }
    a.terminate_cleanly();
    assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn a_job_still_running_at_its_next_occurrence_skips_it_and_never_overlaps() {
    let lock = unique_lock();
    let file = every_second(
        "overlap",
        1,
        "echo start at=$PGLEADER_SCHEDULED_TIME; sleep 2.5; echo end at=$PGLEADER_SCHEDULED_TIME",
    );
    let a = replica("A", lock, &file);
    let b = replica("B", lock, &file);
    // The replica that owns the job says it skipped an occurrence.
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
            "no occurrence was skipped within {WAIT:?}"
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

#[test]
fn sighup_rereads_the_file_and_a_bad_one_leaves_the_old_running() {
    let lock = unique_lock();
    let file = every_second("reread", 2, RAN);
    let a = replica("A", lock, &file);
    let b = replica("B", lock, &file);
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

    // j1 changed, j2 removed, j3 added.
    std::fs::write(
        &file.0,
        format!(
            "# pgleader: name=j1\n* * * * * * * {RAN} v=2\n\
             # pgleader: name=j3\n* * * * * * * {RAN}\n"
        ),
    )
    .expect("write the crontab");
    let reread = Instant::now();
    for replica in [&a, &b] {
        replica.signal(Signal::SIGHUP);
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
    for replica in [&a, &b] {
        replica.terminate_cleanly();
    }
    assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn in_a_rolling_deploy_a_job_only_some_replicas_know_runs_on_one_of_those() {
    let lock = unique_lock();
    let job = |name: &str| format!("# pgleader: name={name}\n* * * * * * * {RAN}\n");
    let old = File::new("rolling-old", &[job("j1"), job("j2"), job("old")].concat());
    let new = File::new("rolling-new", &[job("j1"), job("j2"), job("new")].concat());
    let a = replica("A", lock, &old);
    let b = replica("B", lock, &new);
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
        replica.terminate_cleanly();
    }
    assert_each_occurrence_once(&[&a, &b]);
}
