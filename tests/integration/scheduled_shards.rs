//! `pgleader run --schedule --shards K`: each shard's occurrences once across the fleet, on
//! whichever replica holds the shard, recorded in the ledger per shard; a replica killed -9
//! has its shards' next occurrences run on the others. On PostgreSQL and one Redis server,
//! through the crontab's scenarios (`cron_fleet.rs`): a shard is a job there, named
//! `shard<N>` in what its command prints.

use crate::cron_fleet::{
    RAN, a_killed_replica_s_jobs_run_on_the_other, stop_and_assert_each_occurrence_once,
    succeeded_in_ledger, wait_for_shares,
};
use crate::crontab::File;
use crate::harness::{Cluster, Proc, Redis, Stream, field, run_with_url, unique_lock};
use crate::redis_shards::QUICK;

/// What a shard's command prints at each run: as a crontab job's line, the shard for the job.
fn ran() -> String {
    RAN.replace("$PGLEADER_JOB", "shard$PGLEADER_SHARD/$PGLEADER_SHARDS")
}

/// A replica of `--shards=4 --schedule='* * * * * *'` on `url` (the scenario's crontab is
/// not read: the shards are the jobs).
fn replica(url: String, lock: i64, args: &'static [&'static str]) -> impl Fn(&str, &File) -> Proc {
    move |name, _| {
        let mut all = vec!["--shards=4", "--schedule=* * * * * *"];
        all.extend(args);
        run_with_url(name, &url, lock, &all, &ran())
    }
}

#[test]
fn each_shard_s_occurrences_run_once_across_the_replicas_and_are_recorded_per_shard() {
    let lock = unique_lock();
    let spawn = replica(Cluster::shared().url(), lock, &[]);
    let file = File::new("unused", "");
    let a = spawn("A", &file);
    wait_for_shares(&[&a], 4, &[("A", 4)]);
    let b = spawn("B", &file);
    let runners = wait_for_shares(&[&a, &b], 4, &[("A", 2), ("B", 2)]);
    for replica in [&a, &b] {
        let line = replica.wait_log("joined the replicas of this lock");
        assert_eq!(field(&line, "shards"), "4", "{}", replica.dump());
    }
    // Each shard's runs are kept under its own key, whoever ran them.
    for n in 0..4 {
        let shard = format!("shard{n}/4");
        assert!(
            runners.contains_key(&shard),
            "{shard} never ran: {runners:?}"
        );
        let (distinct, all) = succeeded_in_ledger(&format!("{lock}\u{1f}shard {n}"));
        assert!(distinct >= 2, "shard {n}: {distinct} runs in the ledger");
        assert_eq!(distinct, all, "shard {n}: an occurrence recorded twice");
    }
    // A scheduled shard's command does not run between its occurrences.
    assert!(
        !a.printed(Stream::Stderr, "--restart-delay"),
        "{}",
        a.dump()
    );
    stop_and_assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn the_shards_of_a_replica_killed_9_run_on_the_other_from_their_next_occurrence() {
    let spawn = replica(Cluster::shared().url(), unique_lock(), &[]);
    a_killed_replica_s_jobs_run_on_the_other(&spawn);
}

#[test]
fn on_redis_the_shards_of_a_replica_killed_9_run_on_the_other_from_their_next_occurrence() {
    let spawn = replica(Redis::shared().url(), unique_lock(), &QUICK);
    a_killed_replica_s_jobs_run_on_the_other(&spawn);
}
