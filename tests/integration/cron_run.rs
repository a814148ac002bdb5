//! `pgleader cron run --lock NAME JOB`: a job run once, now, by hand, on whichever replica owns
//! it, on PostgreSQL and on one Redis server. The run is recorded apart from the job's
//! occurrences, with who asked; the command waits for it and exits with its status (or at once
//! with `--no-wait`); the job's `overlap=` holds beside a run going on (`skip`: not run, exit
//! 75; `replace`: the one going on is stopped first); an unknown job exits 2, a fleet with no
//! replica 1. A request is consumed once: its owner killed -9 while it runs, the job's next
//! owner records it as interrupted and never starts it again.

use std::path::PathBuf;

use nix::sys::signal::Signal;

use crate::cron_output::tagged as replica;
use crate::cron_pause::{Cli, pgleader_on, run};
use crate::crontab::File;
use crate::harness::{Cluster, Proc, Redis, Stream, poll_until, unique_lock};
use crate::redis_shards::QUICK;

/// How a scenario starts a replica of its fleet (tagged output, so that runs keep theirs).
type Spawn<'a> = &'a dyn Fn(&str, &File) -> Proc;

/// A file that does not exist yet, which a job waits for.
fn gate(tag: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "pgleader-cron-run-{}-{}-{tag}",
        std::process::id(),
        unique_lock()
    ));
    let _ = std::fs::remove_file(&path);
    path
}

/// The crontab: jobs that never fall due during a test (the first of January), so that every
/// run is one asked by hand. `long` and `swap` run until their gate file exists.
fn crontab(tag: &str, long: &PathBuf, swap: &PathBuf) -> File {
    let wait = |gate: &PathBuf| format!("while [ ! -e {} ]; do sleep 0.05; done", gate.display());
    File::new(
        tag,
        &format!(
            "# pgleader: name=hello\n\
             0 0 1 1 * echo ran-by-hand job=$PGLEADER_JOB by=$PGLEADER_ASKED_BY\n\
             # pgleader: name=fails\n\
             0 0 1 1 * echo first line; echo last words; exit 3\n\
             # pgleader: name=long overlap=skip\n\
             0 0 1 1 * echo long-started; {}; echo long-done\n\
             # pgleader: name=swap overlap=replace\n\
             0 0 1 1 * echo swap-started at=$PGLEADER_SCHEDULED_TIME; {}\n",
            wait(long),
            wait(swap)
        ),
    )
}

/// The lines the replicas' jobs printed (tagged log lines) that contain `needle`.
fn printed(replicas: &[&Proc], needle: &str) -> Vec<String> {
    replicas
        .iter()
        .flat_map(|replica| replica.lines(Stream::Stderr))
        .filter(|line| line.contains("stream=stdout") && line.contains(needle))
        .collect()
}

/// How many lines the replicas' jobs printed that contain `needle`.
fn count(replicas: &[&Proc], needle: &str) -> usize {
    printed(replicas, needle).len()
}

/// Waits until the replicas logged `n` lines containing `needle`.
fn wait_count(replicas: &[&Proc], needle: &str, n: usize) {
    poll_until(
        std::time::Duration::from_millis(20),
        || {
            format!(
                "{n} lines containing {needle:?} never came\n{}",
                replicas.iter().map(|r| r.dump()).collect::<String>()
            )
        },
        || (count(replicas, needle) >= n).then_some(()),
    );
}

/// `status --job JOB --json`.
fn job_status(cli: Cli, job: &str) -> serde_json::Value {
    let (_, json) = run(cli, &["status", "--job", job, "--json"]);
    serde_json::from_str(&json).unwrap_or_else(|err| panic!("{err}: {json}"))
}

fn a_job_asked_by_hand_runs_once_and_follows_its_overlap(spawn: Spawn, cli: Cli) {
    let (long, swap) = (gate("long"), gate("swap"));
    let file = crontab("asked", &long, &swap);
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    a.wait_log("took job ");
    b.wait_log("took job ");
    let both = [&a, &b];

    // Waits for the run and exits with its status; the run is recorded apart, with who asked.
    let (code, said) = run(cli, &["cron", "run", "hello"]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("job hello succeeded"), "{said}");
    assert_eq!(count(&both, "ran-by-hand job=hello by="), 1);
    let by = printed(&both, "ran-by-hand").remove(0);
    assert!(by.contains('@'), "PGLEADER_ASKED_BY is user@host: {by}");
    let status = job_status(cli, "hello");
    let asked = status["asked"].as_array().expect("asked runs");
    assert_eq!(asked.len(), 1, "{status}");
    assert_eq!(asked[0]["outcome"], "succeeded", "{status}");
    assert!(
        asked[0]["asked_by"]
            .as_str()
            .is_some_and(|by| by.contains('@'))
    );
    assert_eq!(
        status["runs"].as_array().map(Vec::len),
        Some(0),
        "a run asked by hand is no occurrence: {status}"
    );

    // A failure's exit status, and its last lines.
    let (code, said) = run(cli, &["cron", "run", "fails"]);
    assert_eq!(code, 3, "{said}");
    assert!(
        said.contains("  | first line\n  | last words\njob fails failed with exit status 3"),
        "{said}"
    );

    // overlap=skip: a run goes on, so the one asked is not started; exit 75.
    let (code, said) = run(cli, &["cron", "run", "long", "--no-wait"]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("(request "), "{said}");
    wait_count(&both, "long-started", 1);
    let (code, said) = run(cli, &["cron", "run", "long"]);
    assert_eq!(code, 75, "{said}");
    assert!(said.contains("was still going (overlap=skip)"), "{said}");
    std::fs::write(&long, "").expect("open the gate");
    wait_count(&both, "long-done", 1);
    assert_eq!(count(&both, "long-started"), 1);

    // overlap=replace: the run going on is stopped, recorded as interrupted, and the one asked
    // runs.
    let (code, said) = run(cli, &["cron", "run", "swap", "--no-wait"]);
    assert_eq!(code, 0, "{said}");
    wait_count(&both, "swap-started", 1);
    let second = cli("second swap", &["cron", "run", "swap"]);
    wait_count(&both, "swap-started", 2);
    std::fs::write(&swap, "").expect("open the gate");
    assert_eq!(second.wait_code(), 0, "{}", second.dump());
    let status = job_status(cli, "swap");
    let asked = status["asked"].as_array().expect("asked runs");
    assert_eq!(asked.len(), 2, "{status}");
    assert_eq!(asked[0]["outcome"], "succeeded", "{status}");
    assert_eq!(asked[1]["outcome"], "interrupted", "{status}");
    assert!(
        asked[1]["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("replaced by a run asked by hand")),
        "{status}"
    );

    // A job no replica defines: exit 2; a name no job can have: exit 2.
    let (code, said) = run(cli, &["cron", "run", "nosuchjob"]);
    assert_eq!(code, 2, "{said}");
    let (code, _) = run(cli, &["cron", "run", "no/slash"]);
    assert_eq!(code, 2);
    a.terminate_cleanly();
    b.terminate_cleanly();
    // No replica left to run it: exit 1.
    let (code, said) = run(cli, &["cron", "run", "hello"]);
    assert_eq!(code, 1, "{said}");
    let _ = std::fs::remove_file(&long);
    let _ = std::fs::remove_file(&swap);
}

/// The owner of a run asked by hand is killed -9 while it runs: its keeper ends the run, the
/// job's next owner records the request as interrupted, the waiting command says so (exit
/// 75), and the request is never started again.
fn a_request_is_consumed_once_when_its_owner_dies(spawn: Spawn, cli: Cli) {
    let (long, swap) = (gate("long"), gate("swap"));
    let file = crontab("consumed", &long, &swap);
    let a = spawn("A", &file);
    let b = spawn("B", &file);
    a.wait_log("took job ");
    b.wait_log("took job ");
    let waiting = cli("waiting", &["cron", "run", "long"]);
    let both = [&a, &b];
    wait_count(&both, "long-started", 1);
    let (owner, other) = if count(&[&a], "long-started") == 1 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    owner.signal(Signal::SIGKILL);
    assert_eq!(waiting.wait_code(), 75, "{}", waiting.dump());
    let said = waiting.lines(Stream::Stdout).join("\n");
    assert!(said.contains("job long was interrupted"), "{said}");
    other.wait_log("took job long");
    let status = job_status(cli, "long");
    assert_eq!(status["asked"][0]["outcome"], "interrupted", "{status}");
    // The next owner took the job over, and with it what waited for it: nothing.
    assert_eq!(count(&both, "long-started"), 1, "{}", other.dump());
    other.terminate_cleanly();
    let _ = std::fs::remove_file(&long);
}

/// overlap=replace, a job due every second: a run asked by hand stops the occurrence's run
/// going on, and the next occurrence stops the run asked by hand in turn (recorded as
/// interrupted, replaced by that occurrence); the occurrences run on after it.
fn an_occurrence_replaces_a_run_asked_by_hand(spawn: Spawn, cli: Cli) {
    let file = File::new(
        "replaced",
        "# pgleader: name=busy overlap=replace\n\
         * * * * * * * echo busy-started asked=${PGLEADER_ASKED_BY:-no}; exec sleep 30\n",
    );
    let a = spawn("A", &file);
    wait_count(&[&a], "busy-started asked=no", 1);
    let waiting = cli("waiting", &["cron", "run", "busy"]);
    assert_eq!(waiting.wait_code(), 75, "{}", waiting.dump());
    let said = waiting.lines(Stream::Stdout).join("\n");
    assert!(said.contains("job busy was interrupted"), "{said}");
    assert!(said.contains("replaced by the occurrence of "), "{said}");
    assert_eq!(
        count(&[&a], "busy-started asked=") - count(&[&a], "asked=no"),
        1
    );
    // The occurrences go on after it.
    let before = count(&[&a], "busy-started asked=no");
    wait_count(&[&a], "busy-started asked=no", before + 2);
    // INT: a TERM would wait for the run going on, as supercronic does.
    a.interrupt_cleanly();
}

#[test]
fn an_occurrence_replaces_a_run_asked_by_hand_and_the_occurrences_go_on() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    an_occurrence_replaces_a_run_asked_by_hand(
        &|name, file| replica(name, &url, lock, &[], file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

#[test]
fn on_redis_an_occurrence_replaces_a_run_asked_by_hand_and_the_occurrences_go_on() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    an_occurrence_replaces_a_run_asked_by_hand(
        &|name, file| replica(name, &url, lock, &QUICK, file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

/// A table of runs asked for by hand that the fleet's role may not use (an administrator made
/// it, and granted nothing): the replica says so and runs its jobs all the same; the request
/// waits, untaken.
#[test]
fn a_table_of_requests_the_role_may_not_use_leaves_the_jobs_running() {
    let lock = unique_lock();
    let (table, role) = (format!("guarded_ledger_{lock}"), format!("no_asks_{lock}"));
    let cluster = Cluster::shared();
    cluster.execute(&format!(
        "{};
         {};
         {};
         CREATE ROLE {role} LOGIN;
         GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_paused TO {role};",
        pgleader::postgres::ledger::TableName::parse(&table)
            .expect("a table name")
            .ddl(),
        pgleader::postgres::ledger::PAUSED_DDL.replace("{table}", &format!("{table}_paused")),
        pgleader::postgres::ledger::ASKED_DDL.replace("{table}", &format!("{table}_asked")),
    ));
    let url = cluster.url().replacen("postgres@", &format!("{role}@"), 1);
    let ledger = format!("--ledger-table={table}");
    let file = crate::cron_fleet::every_second("no-asks", 1, crate::cron_fleet::RAN);
    let a = replica("A", &url, lock, &[&ledger], &file);
    a.wait_log("may not use the table of runs asked for by hand");
    // As the table's owner: the request is written, and no replica takes it.
    let (code, said) = run(
        &|name, args| pgleader_on(&cluster.url(), lock, name, args),
        &["cron", "run", "j1", "--no-wait", &ledger],
    );
    assert_eq!(code, 0, "{said}");
    wait_count(&[&a], "ran job=j1", 3);
    assert!(!a.has_exited(), "{}", a.dump());
    a.terminate_cleanly();
}

#[test]
fn a_job_asked_by_hand_runs_once_apart_from_its_occurrences_and_follows_its_overlap() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    a_job_asked_by_hand_runs_once_and_follows_its_overlap(
        &|name, file| replica(name, &url, lock, &[], file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

#[test]
fn on_redis_a_job_asked_by_hand_runs_once_and_follows_its_overlap() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    a_job_asked_by_hand_runs_once_and_follows_its_overlap(
        &|name, file| replica(name, &url, lock, &QUICK, file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

#[test]
fn a_run_asked_by_hand_is_consumed_once_when_its_owner_is_killed_9() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    a_request_is_consumed_once_when_its_owner_dies(
        &|name, file| replica(name, &url, lock, &[], file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}

#[test]
fn on_redis_a_run_asked_by_hand_is_consumed_once_when_its_owner_is_killed_9() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    a_request_is_consumed_once_when_its_owner_dies(
        &|name, file| replica(name, &url, lock, &QUICK, file),
        &|name, args| pgleader_on(&url, lock, name, args),
    );
}
