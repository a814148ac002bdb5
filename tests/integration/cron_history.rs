//! `pgleader status --lock NAME --job JOB`: one crontab job's last runs from the ledger, on
//! PostgreSQL and on one Redis server, with no crontab file at hand: each run's outcome, exit
//! code, duration and replica, a skipped occurrence with the ledger's reason; a job with no
//! run is exit status 3, a name no job can have exit status 2.

use crate::cron_fleet::{Spawn, StatusOf, cron_replica};
use crate::crontab::File;
use crate::harness::{Cluster, Proc, Redis, Stream, pgleader, poll_until, unique_lock};
use crate::redis_shards::QUICK;

/// `status --job JOB --json` of the fleet, once it shows a run for which `wanted` holds.
pub fn runs_until(
    status: StatusOf,
    job: &str,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_until(
        std::time::Duration::from_millis(200),
        || format!("status --job {job} never showed the run looked for"),
        || {
            let shown = status("status --job", &["--job", job, "--json"]);
            shown.wait_code();
            let seen: serde_json::Value =
                serde_json::from_str(&shown.lines(Stream::Stdout).join("\n")).ok()?;
            seen["runs"].as_array()?.iter().any(&wanted).then_some(seen)
        },
    )
}

fn job_history_is_shown_from_the_ledger(spawn: Spawn, status: StatusOf) {
    let file = File::new(
        "history",
        "# pgleader: name=fine\n* * * * * * * true\n\
         # pgleader: name=broken\n* * * * * * * exit 3\n\
         # pgleader: name=slow\n* * * * * * * sleep 1.5\n",
    );
    let replica = spawn("A", &file);
    let pid = i64::from(replica.pid.as_raw());
    let broken = runs_until(status, "broken", |run| run["outcome"] == "failed");
    assert_eq!(broken["job"], "broken");
    let run = &broken["runs"][0];
    assert_eq!(run["exit_code"], 3, "{broken}");
    assert_eq!(run["pid"], pid, "{broken}");
    assert!(run["duration_seconds"].as_f64().is_some(), "{broken}");
    let fine = runs_until(status, "fine", |run| run["outcome"] == "succeeded");
    assert!(
        fine["runs"]
            .as_array()
            .expect("runs")
            .iter()
            .all(|run| run["outcome"] == "succeeded" || run["outcome"] == "running"),
        "{fine}"
    );
    let slow = runs_until(status, "slow", |run| run["outcome"] == "skipped");
    let skipped = slow["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .find(|run| run["outcome"] == "skipped")
        .expect("a skipped run")
        .clone();
    assert!(
        skipped["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("was still going")),
        "{slow}"
    );
    // The text: one line a run, newest first.
    let text = status("status --job text", &["--job", "broken"]);
    assert_eq!(text.wait_code(), 0, "{}", text.dump());
    let lines = text.lines(Stream::Stdout);
    assert!(lines[0].starts_with("job broken of lock "), "{lines:?}");
    // The newest may be running: one of the lines is a failed run.
    assert!(
        lines[1..]
            .iter()
            .any(|line| line.contains(" failed ") && line.contains("exit 3")),
        "{lines:?}"
    );
    // No run of a job nobody defines: 3, nothing there; a name no job can have: 2.
    let none = status("status --job none", &["--job", "nobody"]);
    assert_eq!(none.wait_code(), 3, "{}", none.dump());
    assert!(
        none.lines(Stream::Stdout)[0].contains("no run recorded"),
        "{}",
        none.dump()
    );
    let bad = status("status --job bad", &["--job", "no/slash"]);
    assert_eq!(bad.wait_code(), 2, "{}", bad.dump());
    replica.terminate_cleanly();
}

#[test]
fn status_job_shows_a_job_s_last_runs_from_the_ledger() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    job_history_is_shown_from_the_ledger(
        &|name, file| cron_replica(name, &url, lock, &[], file),
        &|name, args| crate::harness::pg::status(name, Cluster::shared(), lock, args),
    );
}

#[test]
fn on_redis_status_job_shows_a_job_s_last_runs_from_the_ledger() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    job_history_is_shown_from_the_ledger(
        &|name, file| cron_replica(name, &url, lock, &QUICK, file),
        &|name, args| {
            let mut command = pgleader();
            command
                .env("PGLEADER_DATABASE_URL", &url)
                .args(["status", &format!("--lock-id={lock}")])
                .args(args);
            Proc::spawn(name, command)
        },
    );
}
