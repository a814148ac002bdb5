//! `pgleader cron CRONTAB` on one Redis server: the scenarios of `cron_fleet.rs` (the jobs
//! shared out with each occurrence once, a replica killed -9, a long job skipping its next
//! occurrence, shards and a crontab refusing each other), what the ledger keeps under each
//! job's keys, and, at the library's level, the guard: a job's claim succeeds only while the
//! job's item key holds its member's nonce.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use nix::sys::signal::Signal;
use pgleader::election::ledger::{Claim, Claimant, Ledger};
use pgleader::election::shards::{Holder, ShardBackend};

use crate::contract::block_on;
use crate::cron_fleet::{
    RAN, a_killed_replica_s_jobs_run_on_the_other, a_long_job_skips_its_next_occurrence,
    a_reread_starts_new_definitions_at_their_next_occurrence, a_rolling_deploy_runs_every_job_once,
    a_term_drains, cron_replica, every_second, run_replica, runs,
    shards_and_a_crontab_on_one_lock_refuse_each_other, sighup_rereads_the_file,
    stop_and_assert_each_occurrence_once, three_replicas_share_six_jobs,
};
use crate::cron_seen::{claim_left_out, claim_running};
use crate::crontab::File;
use crate::harness::shards::nightly_of_jobs_7_and_9;
use crate::harness::{
    Proc, Redis, Stream, WAIT, is_running, keepers_of, pgleader, poll_until, unique_lock, within,
};
use crate::redis_shards::{QUICK, backend, unique_name};

/// `pgleader cron --lock-id LOCK FILE` on the shared server, with quick checks and a lease
/// (60 s) long enough that only a dead connection, never a key's expiry, moves a job within a
/// test's waits.
fn redis_replica(lock: i64) -> impl Fn(&str, &File) -> Proc {
    move |name, file| cron_replica(name, &Redis::shared().url(), lock, &QUICK, file)
}

/// A ledger row as the scripts keep it (every number a string).
fn rows(redis: &Redis, lock: i64, job: &str) -> Vec<serde_json::Value> {
    redis
        .cli(&["HVALS", &format!("pgleader:{{{lock}}}:job:{job}:rows")])
        .lines()
        .map(|line| serde_json::from_str(line).expect("a row is JSON"))
        .collect()
}

fn text<'a>(row: &'a serde_json::Value, name: &str) -> &'a str {
    row.get(name).and_then(|v| v.as_str()).unwrap_or_default()
}

/// An occurrence as the scripts key it (microseconds), as the jobs print it (RFC 3339).
fn printed(micros: &str) -> String {
    Timestamp::from_microsecond(micros.parse().expect("microseconds"))
        .expect("an instant")
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

#[test]
fn on_redis_the_jobs_are_shared_out_evenly_and_each_occurrence_runs_once() {
    let redis = Redis::shared();
    let lock = unique_lock();
    let ([a, b, c], runners) = three_replicas_share_six_jobs(&redis_replica(lock));
    let replicas = [&a, &b, &c];
    // `status` finds each replica's jobs by their item keys, as PostgreSQL's by their locks.
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", redis.url())
        .args(["status", &format!("--lock-id={lock}")]);
    let (code, out, err) = Proc::spawn("status", command).finish();
    assert_eq!(code.code(), Some(0), "{err:?}");
    let out = out.join("\n");
    assert!(
        out.contains("crontab of 6 jobs on 3 replicas, every job owned"),
        "{out}"
    );
    let held: usize = out
        .lines()
        .filter(|line| line.trim_start().starts_with("replica:"))
        .filter_map(|line| line.rsplit_once(": ").map(|(_, held)| held))
        .filter_map(|held| held.split(' ').next()?.parse::<usize>().ok())
        .sum();
    assert_eq!(held, 6, "{out}");
    // Each job by name, from its ledger, with its owner and last outcome.
    for job in runners.keys() {
        let line = out
            .lines()
            .find(|line| line.trim_start().starts_with(&format!("job {job}: ")))
            .unwrap_or_else(|| panic!("no line for job {job}:\n{out}"));
        assert!(line.contains(": owner "), "{line}");
        assert!(line.contains("last succeeded"), "{line}");
    }
    stop_and_assert_each_occurrence_once(&replicas);
    // The ledger says the same as the jobs' output: each succeeded row by the pgleader that
    // printed it, and every printed run has its row. A job that moved keeps one history.
    let pids: BTreeMap<String, String> = replicas
        .iter()
        .map(|replica| (replica.name.clone(), replica.pid.to_string()))
        .collect();
    let printed_runs = runs(&replicas);
    for job in runners.keys() {
        let rows = rows(redis, lock, job);
        let succeeded: Vec<&serde_json::Value> = rows
            .iter()
            .filter(|row| text(row, "outcome") == "succeeded")
            .collect();
        assert!(succeeded.len() >= 3, "{job}: {rows:?}");
        for row in &succeeded {
            let at = printed(text(row, "scheduled_for"));
            let by = printed_runs
                .get(&(job.clone(), at.clone()))
                .unwrap_or_else(|| panic!("{job} at {at}: in the ledger, never printed"));
            assert_eq!(text(row, "pid"), pids[&by[0]], "{job} at {at}: {row}");
        }
        let recorded: BTreeSet<String> = rows
            .iter()
            .map(|row| printed(text(row, "scheduled_for")))
            .collect();
        let missing: Vec<&String> = printed_runs
            .keys()
            .filter(|(ran, at)| ran == job && !recorded.contains(at))
            .map(|(_, at)| at)
            .collect();
        assert!(
            missing.is_empty(),
            "{job}: ran, never recorded: {missing:?}"
        );
        let zcard = redis.cli(&["ZCARD", &format!("pgleader:{{{lock}}}:job:{job}:runs")]);
        assert_eq!(zcard, rows.len().to_string(), "{job}: runs and rows apart");
    }
    // Every replica gone: what is left of the name is the epoch, the id counter and each
    // job's ledger, under the documented keys.
    let left = redis.cli(&["KEYS", &format!("pgleader:{{{lock}}}*")]);
    let mut left: Vec<&str> = left.lines().collect();
    left.sort_unstable();
    let mut expected = vec![
        format!("pgleader:{{{lock}}}:epoch"),
        format!("pgleader:{{{lock}}}:ids"),
    ];
    for job in runners.keys() {
        for key in ["born", "rows", "runs"] {
            expected.push(format!("pgleader:{{{lock}}}:job:{job}:{key}"));
        }
    }
    expected.sort_unstable();
    assert_eq!(left, expected);
}

#[test]
fn on_redis_the_jobs_of_a_replica_killed_9_run_on_the_other_long_before_the_ttl() {
    let taken = a_killed_replica_s_jobs_run_on_the_other(&redis_replica(unique_lock()));
    // Nobody is told when a connection closes: A's watcher asks every check interval (200 ms)
    // whether B's liveness channel still has a subscriber, and B's jobs are free at the first
    // ask after the kill. So A runs them from the first occurrence after the kill, or the one
    // after it when the kill came within that interval before a whole second (the scenario
    // asserts that), and within 2 s of the kill plus the polls'. The keys' TTL is 60 s: only
    // the watcher can explain this.
    assert!(taken < Duration::from_secs(3), "{taken:?}");
}

/// Checks thirty seconds apart and a lease of 90 s: jobs of a killed replica that another
/// takes within the test's waits, with no "is gone" line before, were handed over by the killed
/// replica's keepers, not found by a watcher's check nor freed by a key's expiry. A
/// `--post-stop` of two seconds keeps a command's keeper (and the job) after its tree is gone.
const THIRTY_SECOND_CHECKS: [&str; 6] = [
    "--check-interval=30s",
    "--check-timeout=500ms",
    "--lease=90s",
    "--kill-timeout=5s",
    "--hook-timeout=10s",
    "--post-stop=sleep 2",
];

/// What the watcher logs when it finds a member gone (`sharded/mod.rs`).
const MEMBER_GONE: &str = "is gone; its shards are free";

/// Asserts that `observer`'s watcher never found the killed replica gone: the jobs it took
/// were handed over by the killed replica's keepers, not found by a check.
fn assert_not_found_by_the_watcher(observer: &Proc) {
    assert!(
        !observer
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains(MEMBER_GONE)),
        "the watcher found the killed replica gone: the jobs moved by its check\n{}",
        observer.dump()
    );
}

/// The long job's `sleep 1000` under each of `replica`'s keepers: `(keeper, run)`.
fn long_job_under(replica: &Proc) -> Vec<(i32, i32)> {
    keepers_of(replica.pid.as_raw())
        .into_iter()
        .flat_map(|keeper| {
            std::fs::read_to_string(format!("/proc/{keeper}/task/{keeper}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|child| child.parse::<i32>().ok())
                .filter(|child| {
                    std::fs::read(format!("/proc/{child}/cmdline"))
                        .is_ok_and(|argv| argv == b"sleep\x001000\x00")
                })
                .map(|run| (keeper, run))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The keepers of `replica` whose child is the long job's `sleep 1000`: not the one of its
/// membership, nor one parked ahead of an occurrence, nor one running `--post-stop` after a
/// hand-over.
fn long_job_keepers(replica: &Proc) -> Vec<i32> {
    long_job_under(replica)
        .into_iter()
        .map(|(keeper, _)| keeper)
        .collect()
}

/// The long job's `sleep 1000` of `replica`, under whichever keeper.
fn long_job_runs(replica: &Proc) -> Vec<i32> {
    long_job_under(replica)
        .into_iter()
        .map(|(_, run)| run)
        .collect()
}

/// Two replicas of four jobs that never fall due within a test, two each; the one that joined
/// second is killed -9 while none of its jobs runs (no command's keeper holds its session's
/// socket): the first takes its jobs at once, by the farewell of its membership's keeper.
#[test]
fn on_redis_a_replica_killed_9_with_no_job_running_has_its_jobs_taken_at_once() {
    let lock = unique_lock();
    let file = File::new(
        "membership-idle",
        "# pgleader: name=y1\n0 0 0 1 1 * * echo y1\n\
         # pgleader: name=y2\n0 0 0 1 1 * * echo y2\n\
         # pgleader: name=y3\n0 0 0 1 1 * * echo y3\n\
         # pgleader: name=y4\n0 0 0 1 1 * * echo y4\n",
    );
    let url = Redis::shared().url();
    let a = cron_replica("A", &url, lock, &THIRTY_SECOND_CHECKS, &file);
    a.wait_for_nth(Stream::Stderr, "took job", 4);
    let b = cron_replica("B", &url, lock, &THIRTY_SECOND_CHECKS, &file);
    b.wait_for_nth(Stream::Stderr, "took job", 2);
    assert_eq!(
        keepers_of(b.pid.as_raw()).len(),
        1,
        "the membership's keeper, alone\n{}",
        b.dump()
    );
    let killed = Instant::now();
    b.signal(Signal::SIGKILL);
    assert!(b.wait_exit().code().is_none());
    let (last, at) = a
        .wait_line(Stream::Stderr, "took job", 2, Some(killed), WAIT)
        .unwrap_or_else(|| panic!("B's two jobs did not move\n{}", a.dump()));
    // B's keeper ended the membership. (A's watcher may log the member gone as well: when it
    // happened to watch B already, the farewell is what it saw.)
    let farewell = "ended the dead replica's membership on the server";
    assert!(
        b.wait_line(Stream::Stderr, farewell, 1, None, WAIT)
            .is_some(),
        "B's membership keeper said no farewell\n{}",
        b.dump()
    );
    let took = at.duration_since(killed);
    assert!(took < Duration::from_secs(3), "{took:?}: {last}");
    a.terminate_cleanly();
}

/// Two replicas with `args` of a crontab of one long job, every second, and three that never
/// fall due: two jobs each, the long one running on one of them, the victim, whose `runs` of it
/// are `[run]` and who has `keepers` (how many, and what they are), killed -9. Returns `(a,
/// b)`, which of them was the victim (true: `a`), `run`, and when it was killed.
fn one_of_two_replicas_killed_9_while_the_long_job_runs(
    args: &[&str],
    runs: fn(&Proc) -> Vec<i32>,
    keepers: (usize, &str),
) -> (Proc, Proc, bool, i32, Instant) {
    let lock = unique_lock();
    let file = File::new(
        "long-job",
        "# pgleader: name=long\n* * * * * * * echo long started; exec sleep 1000\n\
         # pgleader: name=y1\n0 0 0 1 1 * * echo y1\n\
         # pgleader: name=y2\n0 0 0 1 1 * * echo y2\n\
         # pgleader: name=y3\n0 0 0 1 1 * * echo y3\n",
    );
    let url = Redis::shared().url();
    let a = cron_replica("A", &url, lock, args, &file);
    a.wait_stdout("long started");
    let b = cron_replica("B", &url, lock, args, &file);
    for n in 1..=2 {
        b.wait_for_nth(Stream::Stderr, "took job", n);
    }
    // Two jobs each, and the long one running on one of them (B starts it at its next
    // occurrence if it was handed over).
    let (a_is_victim, run) = poll_until(
        Duration::from_millis(50),
        || format!("the long job runs nowhere\n{}\n{}", a.dump(), b.dump()),
        || match (&runs(&a)[..], &runs(&b)[..]) {
            ([run], []) => Some((true, *run)),
            ([], [run]) => Some((false, *run)),
            _ => None,
        },
    );
    let victim = if a_is_victim { &a } else { &b };
    assert_eq!(
        keepers_of(victim.pid.as_raw()).len(),
        keepers.0,
        "{}\n{}",
        keepers.1,
        victim.dump()
    );
    let killed = Instant::now();
    victim.signal(Signal::SIGKILL);
    assert!(victim.wait_exit().code().is_none());
    (a, b, a_is_victim, run, killed)
}

/// A replica killed -9 while one of its jobs runs and the other waits for its next occurrence:
/// the other replica takes neither while the running job's keeper is still at work (its
/// `--post-stop`), and both the moment it is done, long before its watcher's next check. Between
/// runs no command's keeper holds the session's socket, so the keeper of the replica's
/// membership does, and says the membership's farewell once pgleader and every command's
/// keeper are gone.
#[test]
fn on_redis_a_replica_killed_9_between_runs_has_its_jobs_taken_once_its_last_command_is_gone() {
    let (a, b, a_is_victim, _, killed) = one_of_two_replicas_killed_9_while_the_long_job_runs(
        &THIRTY_SECOND_CHECKS,
        long_job_keepers,
        (2, "the long job's keeper and the membership's"),
    );
    let observer = if a_is_victim { &b } else { &a };
    let (first, first_at) = observer
        .wait_line(Stream::Stderr, "took job", 1, Some(killed), WAIT)
        .unwrap_or_else(|| {
            panic!(
                "none of the killed replica's jobs moved\n{}",
                observer.dump()
            )
        });
    let (last, last_at) = observer
        .wait_line(Stream::Stderr, "took job", 2, Some(killed), WAIT)
        .unwrap_or_else(|| {
            panic!(
                "the killed replica's two jobs did not move\n{}",
                observer.dump()
            )
        });
    // Not while the long job's keeper still ran its --post-stop (two seconds from the kill).
    assert!(
        first_at.duration_since(killed) >= Duration::from_secs(2),
        "a job moved {:?} after the kill, while the killed replica's --post-stop still ran: \
         {first}\n{}",
        first_at.duration_since(killed),
        observer.dump()
    );
    // By the keepers' farewells: the watcher's next check is up to 30 s away.
    assert_not_found_by_the_watcher(observer);
    let took = last_at.duration_since(killed);
    assert!(took < Duration::from_secs(5), "{took:?}: {last}");
    observer.terminate_cleanly();
}

/// The checks of [`THIRTY_SECOND_CHECKS`] without hooks: every run under the session's keeper.
const THIRTY_SECOND_CHECKS_NO_HOOKS: [&str; 3] = [
    "--check-interval=30s",
    "--check-timeout=500ms",
    "--lease=90s",
];

/// Without hooks, every run of a replica starts under its session's keeper, which holds the
/// session's connection from the start (`keeper/session.rs`): a replica killed -9 while one of
/// its jobs runs has that job's tree killed by the keeper, which then ends the membership, and
/// the other replica takes all its jobs at once, not by its watcher's check.
#[test]
fn on_redis_a_replica_killed_9_has_its_jobs_taken_once_its_session_s_keeper_killed_its_runs() {
    let (a, b, a_is_victim, run, killed) = one_of_two_replicas_killed_9_while_the_long_job_runs(
        &THIRTY_SECOND_CHECKS_NO_HOOKS,
        long_job_runs,
        (1, "the session's keeper, alone"),
    );
    let (victim, observer) = if a_is_victim { (&a, &b) } else { (&b, &a) };
    let (last, at) = observer
        .wait_line(Stream::Stderr, "took job", 2, Some(killed), WAIT)
        .unwrap_or_else(|| {
            panic!(
                "the killed replica's two jobs did not move\n{}",
                observer.dump()
            )
        });
    assert!(
        !is_running(run),
        "the killed replica's run {run} still lives, its jobs taken\n{}",
        observer.dump()
    );
    assert!(
        victim
            .wait_line(
                Stream::Stderr,
                "released the dead replica's locks",
                1,
                None,
                WAIT
            )
            .is_some(),
        "the session's keeper said no farewell\n{}",
        victim.dump()
    );
    assert_not_found_by_the_watcher(observer);
    let took = at.duration_since(killed);
    assert!(took < Duration::from_secs(3), "{took:?}: {last}");
    observer.terminate_cleanly();
}

/// A job a reread removed stays its replica's while its last run finishes, its key renewed
/// though the run outlasts the lease (3 s here): a replica that joins with a file that still
/// has the job (a rolling deploy) takes it only once that run has ended, never beside it.
#[test]
fn on_redis_a_removed_job_s_last_run_keeps_the_job_past_the_lease_until_it_ends() {
    let redis = Redis::shared();
    let lock = unique_lock();
    let with_r = "# pgleader: name=r\n* * * * * * * echo r start; sleep 8; echo r end\n";
    let file_a = File::new("retiring-a", with_r);
    let file_b = File::new("retiring-b", with_r);
    let args = [
        "--check-interval=200ms",
        "--check-timeout=500ms",
        "--lease=3s",
        "--kill-timeout=1s",
    ];
    let a = cron_replica("A", &redis.url(), lock, &args, &file_a);
    a.wait_stdout("r start");
    // A holds r alone: its one item key is r's.
    let keys = redis.cli(&["KEYS", &format!("pgleader:{{{lock}}}:shard:*")]);
    let [key] = keys.lines().collect::<Vec<_>>()[..] else {
        panic!("one item key, r's: {keys:?}");
    };
    let holder = redis.cli(&["GET", key]);
    std::fs::write(&file_a.0, "# pgleader: name=z\n0 0 0 1 1 * * echo z\n").expect("rewrite");
    a.signal(Signal::SIGHUP);
    a.wait_log("job r removed");
    let reread = Instant::now();
    // Past the lease and more, r's key still names A while its run goes on.
    while reread.elapsed() < Duration::from_millis(4500) {
        assert_eq!(
            redis.cli(&["GET", key]),
            holder,
            "r's key changed while its last run went on\n{}",
            a.dump()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = cron_replica("B", &redis.url(), lock, &args, &file_b);
    let (_, ended) = a
        .wait_line(Stream::Stdout, "r end", 1, None, WAIT)
        .unwrap_or_else(|| panic!("r's last run never ended\n{}", a.dump()));
    let (_, started) = b
        .wait_line(Stream::Stdout, "r start", 1, None, WAIT)
        .unwrap_or_else(|| panic!("B never ran r\n{}", b.dump()));
    assert!(
        started > ended,
        "B started r while A's last run of it went on\n{}\n{}",
        a.dump(),
        b.dump()
    );
    a.terminate_cleanly();
    b.terminate_cleanly();
}

#[test]
fn on_redis_a_job_still_running_at_its_next_occurrence_skips_it_and_never_overlaps() {
    a_long_job_skips_its_next_occurrence(&redis_replica(unique_lock()));
}

#[test]
fn on_redis_shards_and_a_crontab_on_one_lock_refuse_each_other_with_exit_2() {
    let lock = unique_lock();
    shards_and_a_crontab_on_one_lock_refuse_each_other(&redis_replica(lock), &|name, args| {
        let args = [QUICK.as_slice(), args].concat();
        run_replica(name, &Redis::shared().url(), lock, &args)
    });
}

// --- The guard, at the library's level. ---

/// Waits until the server has been up for two seconds: a ledger remembers from the server's
/// start, counted in whole seconds, and refuses an occurrence before it.
fn up_two_seconds(redis: &Redis) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let info = redis.cli(&["INFO", "server"]);
        let up: u64 = info
            .lines()
            .find_map(|line| line.strip_prefix("uptime_in_seconds:"))
            .and_then(|up| up.trim().parse().ok())
            .expect("INFO server says the uptime");
        if up >= 2 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "uptime {up}s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_job_s_claim_succeeds_only_while_its_item_key_holds_its_member_s_nonce_and_its_card_lives() {
    let redis = Redis::shared();
    up_two_seconds(redis);
    let name = unique_name("cron-guard");
    let backend = backend(&name);
    let (items, job, definition) = nightly_of_jobs_7_and_9(backend.lock.key());
    block_on(async {
        let a = within("join", backend.join("cron-a", &items, None))
            .await
            .expect("join");
        let card = redis.cli(&["GET", &format!("pgleader:{{{name}}}:member:{}", a.id())]);
        assert!(card.contains(" shards=0 cap=none "), "{card}");
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(seen.free(), vec![7, 9]);
        let (won, fence) = within("take", a.take(&[7])).await.expect("take");
        assert_eq!(won, vec![7]);
        let claimant = Claimant {
            host: "test".into(),
            pid: 1,
            epoch: fence.expect("a fence").epoch,
        };
        let ledger = a.ledger(&job, 7, &definition).expect("a ledger on Redis");
        let now = within("time", ledger.server_time()).await.expect("time");
        let at = |n: i64| now + jiff::SignedDuration::from_millis(n - 100);
        let claim = |n: i64| {
            let (ledger, claimant) = (ledger.clone(), claimant.clone());
            async move {
                within("claim", ledger.claim(at(n), Duration::ZERO, &claimant, 0))
                    .await
                    .expect("claim")
            }
        };
        assert_eq!(claim(0).await, Claim::Claimed { attempt: 1 });
        assert_eq!(
            redis.cli(&["ZCARD", &format!("pgleader:{{{name}}}:job:nightly:runs")]),
            "1"
        );
        // Its card gone (expired, as a frozen member's does), its item key still naming it: no
        // claim, though the key outlives the card (its TTL is ten leases).
        let card_key = format!("pgleader:{{{name}}}:member:{}", a.id());
        redis.cli(&["DEL", &card_key]);
        assert_eq!(claim(1).await, Claim::NotLeader);
        redis.cli(&["SET", &card_key, &card, "PX", "60000"]);
        // Another member's item (9 is free, nobody's) guards nothing for this one.
        let other = a.ledger(&job, 9, &definition).expect("a ledger");
        let refused = within("claim", other.claim(at(1), Duration::ZERO, &claimant, 0)).await;
        assert_eq!(refused.expect("claim"), Claim::NotLeader);
        // Given away: no claim, no record.
        assert_eq!(within("give", a.give(&[7])).await.expect("give"), [7]);
        assert_eq!(claim(2).await, Claim::NotLeader);
        let recorded = within("record", ledger.record(at(3), "skipped", "x", &claimant)).await;
        assert!(!recorded.expect("record"));
        // Held by someone else (its key foreign): still none.
        let shard = format!("pgleader:{{{name}}}:shard:7");
        redis.cli(&[
            "SET",
            &shard,
            "nonce=00ff epoch=1 member=99 since=0",
            "PX",
            "60000",
        ]);
        assert_eq!(claim(4).await, Claim::NotLeader);
        redis.cli(&["DEL", &shard]);
        // Taken again: claims go on.
        within("take", a.take(&[7])).await.expect("take");
        assert_eq!(claim(5).await, Claim::Claimed { attempt: 1 });
        within("leave", a.leave(WAIT)).await.expect("leave");
        assert_eq!(redis.cli(&["EXISTS", &shard]), "0");
    });
}

#[test]
fn on_redis_in_a_rolling_deploy_a_job_only_some_replicas_know_runs_on_one_of_those() {
    let (redis, lock) = (Redis::shared(), unique_lock());
    a_rolling_deploy_runs_every_job_once(
        &|name, file, args| {
            cron_replica(name, &redis.url(), lock, &[&QUICK[..], args].concat(), file)
        },
        &|name, args| {
            let mut command = pgleader();
            command
                .env("PGLEADER_DATABASE_URL", redis.url())
                .args(["status", &format!("--lock-id={lock}")])
                .args(args);
            Proc::spawn(name, command)
        },
    );
}

#[test]
fn on_redis_a_reread_runs_an_added_or_rescheduled_job_from_its_next_occurrence() {
    a_reread_starts_new_definitions_at_their_next_occurrence(&redis_replica(unique_lock()));
}

#[test]
fn on_redis_a_term_lets_a_running_job_end_and_hands_the_other_jobs_over_at_once() {
    a_term_drains(&redis_replica(unique_lock()), false);
}

#[test]
fn on_redis_a_replica_killed_9_while_it_drains_leaves_nothing_running() {
    a_term_drains(&redis_replica(unique_lock()), true);
}

#[test]
fn on_redis_sighup_rereads_the_file_and_a_bad_one_leaves_the_old_running() {
    sighup_rereads_the_file(&redis_replica(unique_lock()));
}

/// As on PostgreSQL (`cron_seen.rs`, where the test says why): a claim made ahead of its
/// occurrence, its row `running` before the instant, is left out by `status` and `status
/// --job` until the server's clock reaches it; then both show it as the run going on. The row is
/// written by hand, an hour ahead, from the job's newest, while B owns the job under a yearly
/// schedule and has swept its stale claims.
#[test]
fn on_redis_status_leaves_a_claim_made_ahead_of_its_occurrence_out_until_its_instant() {
    let redis = Redis::shared();
    let lock = unique_lock();
    let file = every_second("redis-ahead", 1, RAN);
    let a = redis_replica(lock)("A", &file);
    a.wait_for_nth(Stream::Stdout, "ran job=j1", 2);
    a.terminate_cleanly();
    let yearly = File::new(
        "redis-ahead-yearly",
        "# pgleader: name=j1\n0 0 0 1 1 * * true\n",
    );
    let verbose: Vec<&str> = QUICK.iter().copied().chain(["-v"]).collect();
    let b = cron_replica("B", &redis.url(), lock, &verbose, &yearly);
    b.wait_log("next occurrence: ");

    let mut ran = rows(redis, lock, "j1");
    ran.sort_by_key(|row| {
        text(row, "scheduled_for")
            .parse::<i64>()
            .expect("microseconds")
    });
    let newest = ran.last().expect("A's runs").clone();
    let last = text(&newest, "outcome").to_owned();
    assert_ne!(last, "running", "A ended every run it started");
    let (rows_key, runs_key) = (
        format!("pgleader:{{{lock}}}:job:j1:rows"),
        format!("pgleader:{{{lock}}}:job:j1:runs"),
    );
    // A running row of occurrence `micros`, claimed at it, as a claim ahead writes it.
    let claim = |micros: i64| {
        let mut row = newest.clone();
        for field in ["scheduled_for", "claimed_at"] {
            row[field] = micros.to_string().into();
        }
        row["outcome"] = "running".into();
        for field in ["ended_at", "exit_code", "detail"] {
            row.as_object_mut().expect("a row").remove(field);
        }
        let at = micros.to_string();
        redis.cli(&["HSET", &rows_key, &at, &row.to_string()]);
        redis.cli(&["ZADD", &runs_key, &at, &at]);
    };
    let server_now = || -> i64 {
        let time: Vec<i64> = redis
            .cli(&["TIME"])
            .lines()
            .map(|line| line.trim().parse().expect("TIME"))
            .collect();
        time[0] * 1_000_000 + time[1]
    };
    let ahead = server_now() + 3_600_000_000;
    claim(ahead);
    let (line, json) = redis_seen(redis, lock, "ahead");
    claim_left_out(&line, &json, &last);

    // Its instant come (the row moved to now), it is the job's run going on, in both.
    redis.cli(&["HDEL", &rows_key, &ahead.to_string()]);
    redis.cli(&["ZREM", &runs_key, &ahead.to_string()]);
    claim(server_now());
    let (line, json) = redis_seen(redis, lock, "come");
    claim_running(&line, &json, &last);
    b.terminate_cleanly();
}

/// What `status` says of job j1 of `lock` on the shared server (its line), and `status --job
/// j1 --json`.
fn redis_seen(redis: &Redis, lock: i64, tag: &str) -> (String, serde_json::Value) {
    let status = |name: String, args: &[&str]| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", redis.url())
            .arg("status")
            .arg(format!("--lock-id={lock}"))
            .args(args);
        let (code, out, err) = Proc::spawn(&name, command).finish();
        assert_eq!(code.code(), Some(0), "{out:?} {err:?}");
        out
    };
    let out = status(format!("status-{tag}"), &[]);
    let line = out
        .iter()
        .find(|line| line.starts_with("  job j1: "))
        .unwrap_or_else(|| panic!("no line for j1: {out:?}"))
        .clone();
    let runs = status(format!("status-job-{tag}"), &["--job=j1", "--json"]);
    let json = serde_json::from_str(&runs.join("\n")).expect("JSON");
    (line, json)
}
