//! `pgleader cron pause|resume`: a job paused across the fleet, on PostgreSQL and on one Redis
//! server. Its occurrences are recorded as paused and run nowhere, whichever replica owns it,
//! through a restart of every replica; the other jobs go on; status shows the pause; once
//! resumed it runs from its next occurrence, the paused ones neither run nor caught up.
//! `--all` pauses every job, and resuming one of them alone resumes nothing (exit 1).

use std::time::{Duration, Instant, SystemTime};

use crate::cron_fleet::{RAN, Spawn, cron_replica, every_second, runs};
use crate::harness::{Cluster, Proc, Redis, Stream, WAIT, pgleader, poll_until, unique_lock};
use crate::redis_shards::QUICK;

/// How a scenario runs `pgleader ARGS` against its fleet's server and lock (`--lock-id`
/// appended), named as given.
pub type Cli<'a> = &'a dyn Fn(&str, &[&str]) -> Proc;

/// `pgleader ARGS --lock-id LOCK` against the server of `url`.
pub fn pgleader_on(url: &str, lock: i64, name: &str, args: &[&str]) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .args(args)
        .arg(format!("--lock-id={lock}"));
    Proc::spawn(name, command)
}

fn rfc3339(at: SystemTime) -> String {
    jiff::Timestamp::try_from(at)
        .expect("a time")
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Runs `pgleader ARGS` to its end: its exit code and stdout.
pub fn run(cli: Cli, args: &[&str]) -> (i32, String) {
    let done = cli(&args.join(" "), args);
    let code = done.wait_code();
    (code, done.lines(Stream::Stdout).join("\n"))
}

/// The occurrences of `job` the replicas ran after `from` (RFC 3339, compared as text).
fn ran_after(replicas: &[&Proc], job: &str, from: &str) -> Vec<String> {
    runs(replicas)
        .into_keys()
        .filter(|(j, at)| j == job && at.as_str() > from)
        .map(|(_, at)| at)
        .collect()
}

/// Waits until `status --job JOB --json` shows a run of outcome `outcome` after `from`.
fn wait_for_outcome(cli: Cli, job: &str, outcome: &str, from: &str) {
    poll_until(
        Duration::from_millis(200),
        || format!("status --job {job} showed no {outcome} occurrence after {from}"),
        || {
            let (_, json) = run(cli, &["status", "--job", job, "--json"]);
            let seen: serde_json::Value = serde_json::from_str(&json).ok()?;
            seen["runs"]
                .as_array()?
                .iter()
                .any(|r| r["outcome"] == outcome && r["occurrence"].as_str() > Some(from))
                .then_some(())
        },
    );
}

fn a_paused_job_runs_nowhere_until_resumed(spawn: Spawn, cli: Cli) {
    let file = every_second("paused", 2, RAN);
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    a.wait_line(Stream::Stderr, "took job ", 1, None, WAIT);
    b.wait_line(Stream::Stderr, "took job ", 1, None, WAIT);

    let (code, said) = run(cli, &["cron", "pause", "j1"]);
    assert_eq!(code, 0, "{said}");
    assert!(
        said.contains("job j1 of lock ") && said.contains(": paused;"),
        "{said}"
    );
    // An occurrence claimed as the pause came may still run: from the next second on, none.
    let paused_from = rfc3339(SystemTime::now() + Duration::from_secs(1));
    wait_for_outcome(cli, "j1", "paused", &paused_from);
    let (_, status) = run(cli, &["status", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&status).expect("JSON status");
    let j1 = status["crontab"]["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|job| job["name"] == "j1"))
        .expect("j1 in status");
    assert!(
        j1["paused"]
            .as_str()
            .is_some_and(|p| p.starts_with("paused by ")),
        "{j1}"
    );

    // Every replica restarts: the pause holds, kept by the server.
    a.terminate_cleanly();
    b.terminate_cleanly();
    let c = spawn("C", &file);
    let restarted = rfc3339(SystemTime::now());
    wait_for_outcome(cli, "j1", "paused", &restarted);
    c.wait_line(Stream::Stdout, "ran job=j2", 2, None, WAIT);
    assert_eq!(
        ran_after(&[&a, &b, &c], "j1", &paused_from),
        Vec::<String>::new(),
        "j1 ran while paused\n{}",
        c.dump()
    );

    // Resumed: it runs from its next occurrence, the paused ones not caught up.
    let (code, said) = run(cli, &["cron", "resume", "j1"]);
    assert_eq!(code, 0, "{said}");
    let resumed = rfc3339(SystemTime::now());
    let deadline = Instant::now() + WAIT;
    let again = loop {
        let after = ran_after(&[&c], "j1", &paused_from);
        if !after.is_empty() {
            break after;
        }
        assert!(
            Instant::now() < deadline,
            "j1 never ran again\n{}",
            c.dump()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        again.iter().all(|at| at.as_str() >= resumed.as_str()),
        "an occurrence of the paused time ran once resumed: {again:?} (resumed at {resumed})"
    );

    // --all pauses every job; resuming one of them alone resumes nothing.
    let (code, said) = run(cli, &["cron", "pause", "--all"]);
    assert_eq!(code, 0, "{said}");
    let all_from = rfc3339(SystemTime::now() + Duration::from_secs(1));
    wait_for_outcome(cli, "j2", "paused", &all_from);
    let (code, said) = run(cli, &["cron", "resume", "j2"]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("still paused"), "{said}");
    let (code, said) = run(cli, &["cron", "resume", "--all"]);
    assert_eq!(code, 0, "{said}");
    let all_resumed = rfc3339(SystemTime::now() + Duration::from_secs(1));
    wait_for_outcome(cli, "j2", "succeeded", &all_resumed);

    // A name no job can have.
    let (code, _) = run(cli, &["cron", "pause", "no/slash"]);
    assert_eq!(code, 2);
    c.terminate_cleanly();
}

#[test]
fn a_paused_job_runs_nowhere_through_restarts_until_resumed_then_from_its_next_occurrence() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    a_paused_job_runs_nowhere_until_resumed(
        &|name, file| cron_replica(name, &url, lock, &[], file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

#[test]
fn on_redis_a_paused_job_runs_nowhere_through_restarts_until_resumed() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    a_paused_job_runs_nowhere_until_resumed(
        &|name, file| cron_replica(name, &url, lock, &QUICK, file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

/// A ledger table made before pauses existed (its check without `paused`): the first fleet
/// replica adds `paused` to it, and creates the table of pauses beside it.
#[test]
fn a_ledger_table_made_before_pauses_gains_the_paused_outcome_and_the_output_column() {
    let table = format!("old_ledger_{}", unique_lock());
    let old = pgleader::postgres::ledger::TableName::parse(&table)
        .expect("a table name")
        .ddl()
        .replace(", 'paused'", "")
        .replace("    output        text,\n", "");
    assert!(!old.contains("paused") && !old.contains("output"), "{old}");
    let cluster = Cluster::shared();
    cluster.execute(&old);
    let check = || -> String {
        cluster
            .client()
            .query_one(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
                 WHERE conrelid = to_regclass($1) AND contype = 'c'",
                &[&table],
            )
            .expect("the check")
            .get(0)
    };
    assert!(!check().contains("paused"));
    let file = every_second("old-ledger", 1, RAN);
    let replica = cron_replica(
        "A",
        &cluster.url(),
        unique_lock(),
        &[&format!("--ledger-table={table}")],
        &file,
    );
    replica.wait_stdout("ran job=j1");
    assert!(check().contains("'paused'"), "{}", check());
    let paused: bool = cluster
        .client()
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{table}_paused")],
        )
        .expect("to_regclass")
        .get(0);
    assert!(paused, "no table of pauses beside {table}");
    // And the column of the runs' output (--keep-output).
    let output: bool = cluster
        .client()
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) \
                              AND attname = 'output' AND NOT attisdropped)",
            &[&table],
        )
        .expect("pg_attribute")
        .get(0);
    assert!(output, "no output column added to {table}");
    replica.terminate_cleanly();
}

/// A ledger table made before the runs' output was kept, which the fleet's role may use but
/// not alter: the replica runs its jobs all the same, without their output, and says what its
/// owner should run.
#[test]
fn a_ledger_table_the_role_cannot_alter_runs_its_jobs_without_their_output() {
    let lock = unique_lock();
    let (table, role) = (format!("dml_ledger_{lock}"), format!("dml_only_{lock}"));
    let old = pgleader::postgres::ledger::TableName::parse(&table)
        .expect("a table name")
        .ddl()
        .replace("    output        text,\n", "");
    let cluster = Cluster::shared();
    cluster.execute(&old);
    cluster.execute(&format!(
        "CREATE TABLE {table}_paused (lock_name text PRIMARY KEY, detail text NOT NULL, \
                                     paused_at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE ROLE {role} LOGIN;
         GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_paused TO {role};"
    ));
    let url = cluster.url().replacen("postgres@", &format!("{role}@"), 1);
    let file = every_second("dml-ledger", 1, RAN);
    let replica = cron_replica(
        "A",
        &url,
        lock,
        &[&format!("--ledger-table={table}")],
        &file,
    );
    replica.wait_stdout("ran job=j1");
    replica.wait_log("no column for the runs' output");
    // The statement for the owner, on the line after.
    let alter = format!("ALTER TABLE \"{table}\" ADD COLUMN IF NOT EXISTS output text;");
    assert!(
        replica
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.starts_with(&alter)),
        "{}",
        replica.dump()
    );
    replica.terminate_cleanly();
}
