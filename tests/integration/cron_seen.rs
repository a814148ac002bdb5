//! What operators see of a crontab fleet (`pgleader cron`) on a real PostgreSQL: `pgleader
//! status` (text and JSON) lists each job with its owner, next occurrence and last outcome,
//! found from the ledger and the server's locks with no crontab file; each replica's `/status`
//! lists the jobs it knows and which it owns; `/metrics` carries per-job series that promtool
//! accepts and that add up over the fleet (each job owned by exactly one replica); `status
//! --watch` prints a line as a job's owner changes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::cron_fleet::{RAN, every_second, replica_with, wait_for_shares};
use crate::crontab::File;
use crate::harness::http::{address_of, get};
use crate::harness::pg::status;
use crate::harness::{Cluster, Stream, WAIT, unique_lock};
use crate::observability::{promtool, sample};

const HTTP: &str = "--http=127.0.0.1:0";
const JOBS: [&str; 4] = ["j1", "j2", "j3", "j4"];

#[test]
fn status_http_and_metrics_show_each_job_with_its_owner_and_last_outcome() {
    let lock = unique_lock();
    let file = every_second("seen", 4, RAN);
    let a = replica_with("A", lock, &file, &[HTTP]);
    let b = replica_with("B", lock, &file, &[HTTP]);
    let (a_http, b_http) = (address_of(&a), address_of(&b));
    wait_for_shares(&[&a, &b], 4, &[("A", 2), ("B", 2)]);

    // `pgleader status`: a line per job, each owned by one of the two, each with a last run.
    let cluster = Cluster::shared();
    let text = status("status", cluster, lock, &[]);
    assert_eq!(text.wait_code(), 0, "{}", text.dump());
    let lines = text.lines(Stream::Stdout);
    assert!(
        lines[0].ends_with(": crontab of 4 jobs on 2 replicas, every job owned"),
        "{}",
        text.dump()
    );
    let owners = [a.pid.as_raw(), b.pid.as_raw()].map(|pid| format!("owner pgleader {pid}@"));
    for job in JOBS {
        let line = lines
            .iter()
            .find(|line| line.starts_with(&format!("  job {job}: ")))
            .unwrap_or_else(|| panic!("no line for {job}\n{}", text.dump()));
        assert!(
            owners.iter().any(|owner| line.contains(owner.as_str())),
            "{line}"
        );
        assert!(line.contains("; next "), "{line}");
        assert!(
            line.contains("; last succeeded") || line.contains("; running since"),
            "{line}"
        );
    }

    // `status --json`: the same, with the owner's session and the last run's fields.
    let json = status("status-json", cluster, lock, &["--json"]);
    assert_eq!(json.wait_code(), 0, "{}", json.dump());
    let json: Value =
        serde_json::from_str(&json.lines(Stream::Stdout).join("\n")).expect("JSON status");
    let jobs = json["crontab"]["jobs"].as_array().expect("jobs");
    let names: Vec<&str> = jobs.iter().filter_map(|job| job["name"].as_str()).collect();
    assert_eq!(names, JOBS, "{json}");
    let mut backends = BTreeSet::new();
    for job in jobs {
        let pid = job["owner"]["pgleader_pid"].as_i64().expect("an owner");
        assert!(
            [a.pid.as_raw(), b.pid.as_raw()].contains(&(pid as i32)),
            "{job}"
        );
        backends.insert(job["owner"]["backend_pid"].as_i64());
        assert!(job["next_occurrence"].is_string(), "{job}");
        assert_eq!(job["timezone"], "UTC", "{job}");
        assert!(job["last_run"]["outcome"].is_string(), "{job}");
        assert!(job["last_run"]["host"].is_string(), "{job}");
    }
    assert_eq!(backends.len(), 2, "two owners: {json}");
    assert_eq!(json["crontab"]["unowned"], 0, "{json}");

    // Each replica's /status: the four jobs it knows, two owned, each owned one with a run.
    for http in [a_http, b_http] {
        let deadline = Instant::now() + WAIT;
        let status = loop {
            let status = get(http, "/status").json();
            let ran = status["jobs"].as_array().is_some_and(|jobs| {
                jobs.iter()
                    .filter(|job| job["owned"] == true)
                    .all(|job| job["last_run"]["outcome"] == "succeeded")
            });
            if ran {
                break status;
            }
            assert!(Instant::now() < deadline, "no finished runs: {status}");
            std::thread::sleep(Duration::from_millis(100));
        };
        let jobs = status["jobs"].as_array().expect("jobs");
        assert_eq!(jobs.len(), 4, "{status}");
        let owned = jobs.iter().filter(|job| job["owned"] == true).count();
        assert_eq!(owned, 2, "{status}");
        assert_eq!(status["leader"], true, "{status}");
        for job in jobs {
            assert_eq!(job["schedule"], "* * * * * *", "{job}");
            assert!(job["next_occurrence"].is_string(), "{job}");
        }
    }

    // /metrics: promtool accepts them; each job is owned on exactly one replica, and its owner
    // counts its successes.
    let metrics = [a_http, b_http].map(|http| get(http, "/metrics").body);
    for text in &metrics {
        promtool(&["check", "metrics"], text);
    }
    for job in JOBS {
        let label = format!("job=\"{job}\"");
        let owned: Vec<f64> = metrics
            .iter()
            .map(|text| sample(text, "pgleader_job_owned", &[&label]))
            .collect();
        assert_eq!(owned.iter().sum::<f64>(), 1.0, "{job}: {owned:?}");
        let owner = &metrics[owned.iter().position(|o| *o == 1.0).expect("an owner")];
        assert!(
            sample(
                owner,
                "pgleader_job_runs_total",
                &[&label, "outcome=\"succeeded\""]
            ) >= 1.0
        );
        assert!(
            sample(
                owner,
                "pgleader_job_last_success_timestamp_seconds",
                &[&label]
            ) > 0.0
        );
        assert_eq!(sample(owner, "pgleader_job_period_seconds", &[&label]), 1.0);
        let late = sample(owner, "pgleader_job_lateness_seconds", &[&label]);
        assert!((0.0..1.0).contains(&late), "{job} started {late}s late");
    }
    assert!(
        !metrics[0].contains("pgleader_shard_held"),
        "{}",
        metrics[0]
    );
    b.terminate_cleanly();
    a.terminate_cleanly();
}

#[test]
fn status_watch_prints_a_line_when_a_killed_owner_s_jobs_move() {
    let lock = unique_lock();
    let file = every_second("watch", 2, RAN);
    let a = replica_with("A", lock, &file, &[]);
    let b = replica_with("B", lock, &file, &[]);
    wait_for_shares(&[&a, &b], 2, &[("A", 1), ("B", 1)]);
    let watch = status("watch", Cluster::shared(), lock, &["--watch"]);
    // A job on one line of the watch: `j1 pgleader <pid>@<host> (backend <n>), ...`.
    let owner_of = |line: &str, job: &str, replica: &crate::harness::Proc| {
        line.contains(&format!(" {job} pgleader {}@", replica.pid))
    };
    let line = watch.wait_line_where(Stream::Stdout, "one job on A, the other on B", |line| {
        JOBS[..2].iter().any(|job| owner_of(line, job, &a))
            && JOBS[..2].iter().any(|job| owner_of(line, job, &b))
    });
    assert!(line.contains(": crontab of 2 jobs: "), "{line}");

    // kill -9 B: the watch prints B's job on A, and B no more.
    b.signal(Signal::SIGKILL);
    assert!(b.wait_exit().code().is_none());
    let line = watch.wait_line_where(Stream::Stdout, "both jobs on A", |line| {
        JOBS[..2].iter().all(|job| owner_of(line, job, &a))
    });
    assert!(
        !line.contains(&format!("pgleader {}@", b.pid)),
        "{line}\n{}",
        watch.dump()
    );
    watch.signal(Signal::SIGTERM);
    watch.wait_exit();
    a.terminate_cleanly();
}

/// A job's occurrence is claimed up to 500 ms ahead of it (`schedule/runs.rs`), its row
/// `running` before the instant: `status` and `status --job` leave such a row out until the
/// server's clock reaches it, and show the run before it. The row is written here an hour
/// ahead, as a claim ahead would be (its `claimed_at` the occurrence), so that no timing
/// decides what the test sees: after A ran the job, while B owns it under a yearly schedule
/// (`status` lists a crontab's jobs while a replica is up) and has swept its stale claims.
/// Then the row is moved to now, its instant come: both show it as the run going on.
#[test]
fn status_leaves_a_claim_made_ahead_of_its_occurrence_out_until_its_instant() {
    let lock = unique_lock();
    let file = every_second("ahead", 1, RAN);
    let a = replica_with("A", lock, &file, &[]);
    a.wait_for_nth(Stream::Stdout, "ran job=j1", 2);
    a.terminate_cleanly();
    let yearly = File::new("ahead-yearly", "# pgleader: name=j1\n0 0 0 1 1 * * true\n");
    let b = replica_with("B", lock, &yearly, &["-v"]);
    b.wait_log("next occurrence: ");

    let cluster = Cluster::shared();
    let mut client = cluster.client();
    let name = format!("{lock}\u{1f}j1");
    let newest = |client: &mut postgres::Client| -> String {
        client
            .query_one(
                "SELECT outcome FROM pgleader_ledger WHERE lock_name = $1 \
                 ORDER BY scheduled_for DESC LIMIT 1",
                &[&name],
            )
            .expect("the job's newest row")
            .get(0)
    };
    let last = newest(&mut client);
    assert_ne!(last, "running", "the replica ended every run it started");
    let ahead = client
        .execute(
            "INSERT INTO pgleader_ledger (lock_key, scheduled_for, lock_name, schedule, timezone, \
                                          outcome, claimed_at, host, pid, epoch) \
             SELECT lock_key, date_trunc('second', now()) + interval '1 hour', lock_name, \
                    schedule, timezone, 'running', date_trunc('second', now()) + interval '1 hour', \
                    host, pid, epoch \
               FROM pgleader_ledger WHERE lock_name = $1 ORDER BY scheduled_for DESC LIMIT 1",
            &[&name],
        )
        .expect("a claim ahead");
    assert_eq!(ahead, 1);
    assert_eq!(newest(&mut client), "running");

    let (line, json) = seen(lock, "ahead");
    claim_left_out(&line, &json, &last);

    // Its instant come (the row moved to now), it is the job's run going on, in both.
    let moved = client
        .execute(
            "UPDATE pgleader_ledger SET scheduled_for = now(), claimed_at = now() \
              WHERE lock_name = $1 AND outcome = 'running'",
            &[&name],
        )
        .expect("the claim's instant come");
    assert_eq!(moved, 1);
    let (line, json) = seen(lock, "come");
    claim_running(&line, &json, &last);
    b.terminate_cleanly();
}

/// A claim ahead as `status` (job j1's `line`) and `status --job j1 --json` (`json`) show it
/// before its instant: left out, the job's last run the one before it, whose outcome was
/// `last`.
pub(crate) fn claim_left_out(line: &str, json: &Value, last: &str) {
    assert!(line.contains(&format!("; last {last}")), "{line}");
    assert!(!line.contains("running since"), "{line}");
    let listed = json["runs"].as_array().expect("runs");
    assert_eq!(listed[0]["outcome"], last, "{json}");
    assert!(
        listed.iter().all(|run| run["outcome"] != "running"),
        "{json}"
    );
}

/// The same claim once its instant has come: the run going on, before the one whose outcome
/// was `last`.
pub(crate) fn claim_running(line: &str, json: &Value, last: &str) {
    assert!(line.contains("; running since "), "{line}");
    assert_eq!(json["runs"][0]["outcome"], "running", "{json}");
    assert_eq!(json["runs"][1]["outcome"], last, "{json}");
}

/// What `status` says of job j1 of `lock` (its line), and `status --job j1 --json`.
fn seen(lock: i64, tag: &str) -> (String, Value) {
    let cluster = Cluster::shared();
    let text = status(&format!("status-{tag}"), cluster, lock, &[]);
    assert_eq!(text.wait_code(), 0, "{}", text.dump());
    let line = text
        .lines(Stream::Stdout)
        .into_iter()
        .find(|line| line.starts_with("  job j1: "))
        .unwrap_or_else(|| panic!("no line for j1\n{}", text.dump()));
    let runs = status(
        &format!("status-job-{tag}"),
        cluster,
        lock,
        &["--job=j1", "--json"],
    );
    assert_eq!(runs.wait_code(), 0, "{}", runs.dump());
    let json = serde_json::from_str(&runs.lines(Stream::Stdout).join("\n")).expect("JSON");
    (line, json)
}
