//! The Redis backend end to end: the real binary against real `redis-server` processes, and
//! what only Redis needs beyond the contract suite (`contract.rs`): a crashed leader replaced
//! long before its key's TTL yet never while its tree runs, the key deleted or flushed under a
//! leader, a killed connection, a frozen server, a restart that kept nothing, passwords, ACLs,
//! replicas, and what a Redis URL refuses.

use nix::sys::signal::Signal;

use crate::harness::fleet::lines_with;
use crate::harness::redis::{DOCUMENTED_ACL, SECRET_PASSWORD};
use crate::harness::run_named as run;
use crate::harness::{
    Journal, Proc, Proxy, Redis, Stream, field, kill_9_never_overlaps_a_41_process_tree,
    kill_9_never_overlaps_the_dying_tree, patient_child, pgleader,
};

/// A lock name no other test uses.
fn lock(tag: &str) -> String {
    format!("{tag}-{}", crate::harness::unique_lock())
}

/// Quick checks, and a lease long enough that only noticing the holder's dead connection (not
/// its key's expiry) can explain a takeover within the test's waits.
const QUICK: [&str; 3] = [
    "--check-interval=200ms",
    "--check-timeout=500ms",
    "--lease=60s",
];

/// Checks a minute apart: only an event (a push, the connection's end) can stop a command
/// within the test's waits.
const SLOW_CHECKS: [&str; 2] = ["--check-interval=60s", "--lease=90s"];

/// A server of the test's own, and a lock on it, both named after the test.
fn own_server(tag: &str) -> (Redis, String) {
    (Redis::new(tag), lock(tag))
}

/// Asserts that `replica`'s command got TERM and that the replica logged the loss of its
/// leadership, saying `why`.
fn assert_lost_because(replica: &Proc, tag: &str, why: &str) {
    let lost = stopped_by_a_lost_leadership(replica, tag);
    assert!(lost.contains(why), "{lost}");
}

/// Runs `replica` to its end and asserts that it exited 1 (a permanent error) without running
/// its command: its stderr, which says why.
fn refused_for_good(replica: &Proc) -> String {
    let (status, stdout, stderr) = replica.finish();
    assert_eq!(status.code(), Some(1), "{}", replica.dump());
    assert!(stdout.is_empty(), "{}", replica.dump());
    stderr.join("\n")
}

/// A replica running a [`patient_child`] on `url`, once its command has started: the replica
/// and the line its command printed.
fn leading(tag: &str, url: &str, lock: &str, args: &[&str]) -> (Proc, String) {
    let replica = run(tag, url, lock, args, &patient_child(tag));
    let started = replica.wait_stdout(&format!("{tag} started"));
    (replica, started)
}

/// Waits until `replica`'s command got TERM and the replica logged that it lost the
/// leadership: that line, which says why.
fn stopped_by_a_lost_leadership(replica: &Proc, tag: &str) -> String {
    replica.wait_stdout(&format!("{tag} got TERM"));
    replica.wait_log("leadership lost")
}

#[test]
fn kill_9_of_the_leader_is_replaced_before_the_ttl_but_only_after_its_whole_tree_is_gone() {
    let url = Redis::shared().url();
    let lock = lock("kill9");
    let timings = [
        "--check-interval=50ms",
        "--check-timeout=500ms",
        "--lease=60s",
    ];
    // Followers try every 50 ms: two or three tries during the 2 GiB process' death.
    kill_9_never_overlaps_the_dying_tree("redis", 3, |name, script| {
        run(name, &url, &lock, &timings, script)
    });
}

/// Checks five seconds apart and a lease of a minute: a follower that starts its command within
/// a second or two of the leader's kill -9 was woken by the dead leader's keeper (its farewell
/// released the key and woke the follower), since its own next try was still seconds away.
const FIVE_SECOND_CHECKS: [&str; 2] = ["--check-interval=5s", "--lease=60s"];

/// Well under the five seconds between a waiting follower's tries.
const BY_EVENT: std::time::Duration = std::time::Duration::from_millis(2500);

#[test]
fn kill_9_of_the_leader_never_overlaps_a_41_process_tree_in_20_rounds() {
    let url = Redis::shared().url();
    let lock = lock("kill9-41");
    let takeovers = kill_9_never_overlaps_a_41_process_tree("redis-41", 20, |name, script| {
        run(name, &url, &lock, &FIVE_SECOND_CHECKS, script)
    });
    let slowest = takeovers.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < BY_EVENT,
        "a takeover waited for the follower's check: {takeovers:?}"
    );
}

#[test]
fn after_kill_9_of_the_leader_its_keeper_hands_over_long_before_the_followers_next_check() {
    let url = Redis::shared().url();
    let lock = lock("farewell");
    let (a, _) = leading("A", &url, &lock, &FIVE_SECOND_CHECKS);
    let b = run("B", &url, &lock, &FIVE_SECOND_CHECKS, &patient_child("B"));
    // B tried once when it logged this, and blocks on its wake list for five seconds from then.
    b.wait_log("waiting for the lock");
    let killed = std::time::Instant::now();
    a.signal(Signal::SIGKILL);
    b.wait_stdout("B started");
    let took = killed.elapsed();
    eprintln!("B started {took:?} after A's kill -9");
    assert!(took < BY_EVENT, "{took:?}: {}", b.dump());
    // The key is B's, taken by the release (the queue is empty), not found expired.
    let value = Redis::shared().cli(&["GET", &format!("pgleader:{{{lock}}}")]);
    assert!(value.contains(&format!("{}@", b.pid)), "{value}");
}

#[test]
fn a_late_answer_to_the_acquire_never_lets_the_key_expire_before_the_leaders_deadline() {
    // The key's TTL starts when the acquire script runs; the leader's deadline must not start
    // later. B's answers come back 2.2 s late (a slow path back); once it leads, B is cut off
    // for good. B stops its command by its deadline, counted from when it asked for its fencing
    // token; the key must outlive that, or C takes over while B's command still runs.
    let redis = Redis::new("late-answer");
    let proxy = Proxy::start(redis.port);
    let through_proxy = format!("redis://127.0.0.1:{}", proxy.port());
    let lock = lock("late-answer");
    let journal = Journal::new("redis-late-answer");
    let lease = "--lease=9100ms";
    // A and C reach the server directly, and their commands stop at once.
    let direct = |tag: &str, check_interval: &str| {
        run(
            tag,
            &redis.url(),
            &lock,
            &[check_interval, "--kill-timeout=1s", lease],
            &journal.quick_child(tag),
        )
    };
    let a = direct("A", "--check-interval=200ms");
    a.wait_stdout("A started");
    // Four seconds between checks, so B's first renewal comes well after it has started, and
    // a check timeout that the late answers fit in.
    let b = run(
        "B",
        &through_proxy,
        &lock,
        &[
            "--check-interval=4s",
            "--check-timeout=3s",
            "--kill-timeout=1s",
            lease,
        ],
        &journal.child("B", "0.9"),
    );
    b.wait_log("waiting for the lock");
    // B is first in the queue before C arrives: the release wakes B, not C.
    let queue = format!("pgleader:{{{lock}}}:queue");
    let queued = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while redis.cli(&["LLEN", &queue]) != "1" {
        assert!(
            std::time::Instant::now() < queued,
            "B never queued: {}",
            b.dump()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let c = direct("C", "--check-interval=100ms");
    c.wait_log("waiting for the lock");
    proxy.delay_replies(std::time::Duration::from_millis(2200));
    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    proxy.freeze();
    c.wait_stdout("C started");
    let lines = journal.lines();
    let at = |tag: &str| lines.iter().position(|line| line == tag);
    assert!(
        at("B-stopped").is_some_and(|stopped| at("C-started").is_some_and(|c| stopped < c)),
        "C started while B's command still ran: {lines:?}\n{}",
        b.dump()
    );
}

#[test]
fn sigterm_to_the_leader_hands_over_only_after_its_command_has_exited() {
    let redis = Redis::shared();
    let lock = lock("handover");
    let journal = Journal::new("redis-handover");
    let a = run("A", &redis.url(), &lock, &QUICK, &journal.child("A", "0.5"));
    a.wait_stdout("A started");
    let b = run("B", &redis.url(), &lock, &QUICK, &journal.quick_child("B"));
    b.wait_log("waiting for the lock");
    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    a.wait_log("released the lock");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
}

#[test]
fn deleting_the_key_stops_the_command_at_once_not_at_the_next_check() {
    let redis = Redis::shared();
    let lock = lock("del");
    let (a, _) = leading("A", &redis.url(), &lock, &SLOW_CHECKS);
    let key = format!("pgleader:{{{lock}}}");
    assert!(
        redis.cli(&["GET", &key]).contains("session=pgleader:"),
        "the key's value names the holder"
    );
    assert_eq!(redis.cli(&["DEL", &key]), "1");
    assert_lost_because(&a, "A", "changed by another client");
    // Never re-created by the old leader: the next holder is a new leadership.
    a.wait_log("became leader");
}

#[test]
fn deleting_the_key_after_renewals_still_stops_the_command_at_once() {
    // A leader's own renewal (PEXPIRE) drops the key from the server's tracking table, NOLOOP
    // or not: unless the leader reads the key again, a later DEL is no longer pushed to it.
    let redis = Redis::shared();
    let lock = lock("del-renewed");
    let args = [
        "--check-interval=1s",
        "--check-timeout=500ms",
        "--kill-timeout=1s",
        "--lease=60s",
    ];
    let (a, _) = leading("A", &redis.url(), &lock, &args);
    // Two or three renewals.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let key = format!("pgleader:{{{lock}}}");
    assert_eq!(redis.cli(&["DEL", &key]), "1");
    let lost = stopped_by_a_lost_leadership(&a, "A");
    assert!(
        lost.contains("changed by another client"),
        "noticed by the next check, not by the push: {lost}"
    );
}

#[test]
fn a_leadership_lost_to_a_deleted_key_leaves_nothing_behind() {
    // Each session names itself in the lock's :who hash; a leader that lost its key must still
    // take its entry out when it steps down, or the hash grows with every loss.
    let redis = Redis::shared();
    let lock = lock("who-leak");
    let key = format!("pgleader:{{{lock}}}");
    let who = format!("{key}:who");
    let args = [SLOW_CHECKS[0], SLOW_CHECKS[1], "--restart-delay=0s"];
    let a = run("A", &redis.url(), &lock, &args, &patient_child("A"));
    for round in 1..=3 {
        a.wait_for_nth(Stream::Stdout, "A started", round);
        assert_eq!(redis.cli(&["DEL", &key]), "1");
        a.wait_for_nth(Stream::Stdout, "A got TERM", round);
    }
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_eq!(
        redis.cli(&["HLEN", &who]),
        "1",
        "entries of lost leaderships: {}",
        redis.cli(&["HGETALL", &who])
    );
}

#[test]
fn waiters_that_died_while_the_lock_was_held_do_not_pile_up_in_the_queue() {
    // Dead waiters used to leave the queue only when they reached its head at a handoff: a
    // lock held for months, with followers restarted or reconnecting meanwhile, grew a queue
    // that every `status` and the next release walk through, NUMSUB by NUMSUB.
    let redis = Redis::shared();
    let lock = lock("dead-waiters");
    let queue = format!("pgleader:{{{lock}}}:queue");
    let (_a, _) = leading("A", &redis.url(), &lock, &QUICK);
    let queued = |n: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while redis.cli(&["LLEN", &queue]) != n {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue never held {n}: {:?}",
                redis.cli(&["LRANGE", &queue, "0", "-1"])
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let who = format!("pgleader:{{{lock}}}:who");
    for tag in ["B", "C", "D"] {
        let follower = run(tag, &redis.url(), &lock, &QUICK, "true");
        follower.wait_log("waiting for the lock");
        // Queued: its card is written in the same script that queues it.
        let card = format!(":{}@", follower.pid);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !redis.cli(&["HVALS", &who]).contains(&card) {
            assert!(std::time::Instant::now() < deadline, "{tag} never queued");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        follower.signal(Signal::SIGKILL);
        follower.wait_exit();
    }
    let e = run("E", &redis.url(), &lock, &QUICK, "true");
    e.wait_log("waiting for the lock");
    queued("1");
}

#[test]
fn flushall_and_a_foreign_set_stop_the_command_at_once() {
    let (redis, lock) = own_server("flush");
    let key = format!("pgleader:{{{lock}}}");
    let args = [SLOW_CHECKS[0], SLOW_CHECKS[1], "--restart-delay=60s"];
    let (a, _) = leading("A", &redis.url(), &lock, &args);
    redis.cli(&["FLUSHALL"]);
    stopped_by_a_lost_leadership(&a, "A");
    a.signal(Signal::SIGKILL);

    let (b, _) = leading("B", &redis.url(), &lock, &args);
    redis.cli(&["SET", &key, "nonce=0 someone else"]);
    assert_lost_because(&b, "B", "changed by another client");
}

#[test]
fn another_databases_flushdb_or_key_leaves_the_leader_alone() {
    // The server's tracking table knows key names, not databases: FLUSHDB of any database
    // pushes "everything changed" to every tracking client, and a write to a key of the same
    // name in another database pushes that name. Neither touches this leader's key.
    let (redis, lock) = own_server("otherdb");
    let key = format!("pgleader:{{{lock}}}");
    let (a, _) = leading("A", &redis.url(), &lock, &SLOW_CHECKS);
    redis.cli(&["-n", "5", "SET", "cache", "1"]);
    redis.cli(&["-n", "5", "FLUSHDB"]);
    redis.cli(&["-n", "5", "SET", &key, "an unrelated value"]);
    let stopped = a.wait_line(
        Stream::Stdout,
        "A got TERM",
        1,
        None,
        std::time::Duration::from_secs(2),
    );
    assert!(
        stopped.is_none(),
        "a change in another database stopped the command: {}",
        a.dump()
    );
    // Its own key is still noticed at once.
    assert_eq!(redis.cli(&["DEL", &key]), "1");
    assert_lost_because(&a, "A", "changed by another client");
}

#[test]
fn a_killed_connection_stops_the_command_at_once() {
    let redis = Redis::shared();
    let lock = lock("clientkill");
    let (a, started) = leading("A", &redis.url(), &lock, &SLOW_CHECKS);
    let id = field(&started, "backend");
    assert_eq!(redis.cli(&["CLIENT", "KILL", "ID", &id]), "1");
    assert_lost_because(&a, "A", "closed");
}

#[test]
fn a_frozen_server_stops_the_command_within_the_check_bound() {
    let (redis, lock) = own_server("frozen");
    let (a, _) = leading("A", &redis.url(), &lock, &QUICK);
    redis.freeze(true);
    let lost = stopped_by_a_lost_leadership(&a, "A");
    redis.freeze(false);
    assert!(lost.contains("check"), "{lost}");
}

#[test]
fn epochs_keep_growing_across_a_restart_that_kept_nothing() {
    let (redis, lock) = own_server("restart");
    let a = run(
        "A",
        &redis.url(),
        &lock,
        &["--check-interval=200ms", "--check-timeout=500ms"],
        &patient_child("A"),
    );
    let first: i64 = field(&a.wait_stdout("A started"), "epoch")
        .parse()
        .expect("an epoch");
    redis.crash();
    a.wait_stdout("A got TERM");
    redis.start();
    let second: i64 = field(&a.wait_for_nth(Stream::Stdout, "A started", 2), "epoch")
        .parse()
        .expect("an epoch");
    assert!(
        second > first,
        "epoch {second} after {first}: the server kept nothing, yet tokens must grow"
    );
}

#[test]
fn a_wrong_password_is_a_permanent_error_that_says_so_and_never_shows_it() {
    let redis = Redis::start_with("auth", &["--requirepass", SECRET_PASSWORD]);
    let url = format!("redis://:wrong-{SECRET_PASSWORD}@127.0.0.1:{}", redis.port);
    let a = run("A", &url, &lock("auth"), &[], "true");
    let (status, _, stderr) = a.finish();
    assert_eq!(status.code(), Some(1), "{}", a.dump());
    let text = stderr.join("\n");
    assert!(text.contains("password"), "{text}");
    assert!(
        !text.contains(SECRET_PASSWORD),
        "the password was printed: {text}"
    );

    // The right one, from REDISCLI_AUTH.
    let mut command = pgleader();
    command
        .env(
            "PGLEADER_DATABASE_URL",
            format!("redis://127.0.0.1:{}", redis.port),
        )
        .env("REDISCLI_AUTH", SECRET_PASSWORD)
        .args([
            "run",
            "--lock=auth-ok",
            "--once",
            "--",
            "sh",
            "-c",
            "echo ran",
        ]);
    let ok = Proc::spawn("ok", command);
    ok.wait_stdout("ran");
    assert_eq!(ok.wait_code(), 0, "{}", ok.dump());
}

#[test]
fn a_user_without_the_documented_acl_is_refused_and_one_with_it_leads() {
    let redis = Redis::new("acl");
    redis.acl_user(
        "narrow",
        "narrow-pw",
        &[
            "~*",
            "&*",
            "+@read",
            "+@write",
            "+@scripting",
            "+@pubsub",
            "+@blocking",
        ],
    );
    let url = format!("redis://narrow:narrow-pw@127.0.0.1:{}", redis.port);
    let a = run("A", &url, &lock("acl"), &[], "true");
    let (status, _, stderr) = a.finish();
    assert_eq!(status.code(), Some(1), "{}", a.dump());
    let text = stderr.join("\n");
    assert!(
        text.contains("ACL") && text.contains("+time +info"),
        "{text}"
    );

    // The ACL README.md documents.
    redis.acl_user("minimal", "minimal-pw", &DOCUMENTED_ACL);
    let url = format!("redis://minimal:minimal-pw@127.0.0.1:{}", redis.port);
    let b = run("B", &url, &lock("acl"), &["--once"], "echo B ran");
    b.wait_stdout("B ran");
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
    assert!(
        b.lines(Stream::Stderr)
            .iter()
            .all(|line| !line.contains("WARN")),
        "the documented ACL is enough for everything: {}",
        b.dump()
    );
}

#[test]
fn an_acl_that_refuses_the_lock_scripts_is_a_permanent_error_not_a_retry_loop() {
    // Connecting needs only what every user has here; the first script is the first refusal.
    let (redis, lock) = own_server("acl-scripts");
    redis.acl_user("noscript", "pw", &["~*", "&*", "+@all", "-@scripting"]);
    let only_the_lock = format!("~pgleader:{{{lock}}}");
    redis.acl_user("onekey", "pw", &[&only_the_lock, "&*", "+@all"]);
    for user in ["noscript", "onekey"] {
        let url = format!("redis://{user}:pw@127.0.0.1:{}", redis.port);
        let a = run(user, &url, &lock, &QUICK, "echo ran");
        let text = refused_for_good(&a);
        assert!(text.contains("ACL"), "{user}: {text}");
        assert!(
            !text.contains("retrying") && text.matches("waiting for the lock").count() == 1,
            "{user}: retried what cannot succeed: {text}"
        );
    }
}

#[test]
fn a_database_the_server_does_not_have_is_a_permanent_error() {
    // DESIGN.md's failure model: a missing database is permanent, like bad credentials. A
    // Redis server has `databases` (16 by default) numbered from 0, fixed until it restarts.
    let redis = Redis::shared();
    let url = format!("{}/99", redis.url());
    let a = run("A", &url, &lock("nodb"), &[], "echo ran");
    let text = refused_for_good(&a);
    assert!(text.contains("database 99"), "{text}");
    assert!(
        !text.contains("retrying"),
        "retried what cannot succeed: {text}"
    );
}

#[test]
fn a_replica_is_never_led_through() {
    let primary = Redis::new("primary");
    let replica = Redis::start_with(
        "replica",
        &["--replicaof", "127.0.0.1", &primary.port.to_string()],
    );
    let a = run(
        "A",
        &replica.url(),
        &lock("replica"),
        &[],
        &patient_child("A"),
    );
    let refused = a.wait_log("replica");
    assert!(refused.contains("role:slave"), "{refused}");
    a.signal(Signal::SIGTERM);
    a.wait_exit();
    assert!(
        a.lines(Stream::Stdout).is_empty(),
        "the command ran through a replica: {}",
        a.dump()
    );
}

#[test]
fn what_a_redis_url_cannot_mean_is_a_usage_error() {
    for (args, expected) in [
        (
            vec!["-d", "redis+sentinel://127.0.0.1:26379/mymaster"],
            "Sentinel is not supported",
        ),
        (
            vec!["-d", "redis://127.0.0.1", "--ledger-table=x"],
            "--ledger-table has no meaning on Redis",
        ),
        (
            vec![
                "-d",
                "redis://127.0.0.1",
                "--check-interval=1s",
                "--lease=9s",
            ],
            "server's clock runs 1% fast",
        ),
    ] {
        let mut command = pgleader();
        command
            .arg("run")
            .args(&args)
            .args(["--lock=x", "--", "true"]);
        let run = Proc::spawn("usage", command);
        let (status, _, stderr) = run.finish();
        assert_eq!(status.code(), Some(2), "{args:?}: {}", run.dump());
        let text = stderr.join("\n");
        assert!(text.contains(expected), "{args:?}: {text}");
    }
}

#[test]
fn status_shows_the_leader_and_the_waiters_in_order() {
    let redis = Redis::shared();
    let lock = lock("status");
    let a = run("A", &redis.url(), &lock, &QUICK, &patient_child("A"));
    let a_client = field(&a.wait_log("became leader"), "backend_pid");
    a.wait_stdout("A started");
    let b = run("B", &redis.url(), &lock, &QUICK, &patient_child("B"));
    let b_client = field(&b.wait_log("waiting for the lock"), "backend_pid");
    let status = |extra: &[&str]| {
        let mut command = pgleader();
        command
            .args(["status", "-d", &redis.url(), "--lock", &lock])
            .args(extra);
        let status = Proc::spawn("status", command);
        let (exit, stdout, _) = status.finish();
        assert_eq!(exit.code(), Some(0), "{}", status.dump());
        stdout.join("\n")
    };
    let json: serde_json::Value =
        serde_json::from_str(&status(&["--json"])).expect("status --json prints JSON");
    let text = json.to_string();
    assert!(text.contains(&format!(":{}@", a.pid)), "{text}");
    assert!(text.contains(&format!(":{}@", b.pid)), "{text}");
    assert_eq!(json["lock"]["redis_key"], format!("pgleader:{{{lock}}}"));
    // The text names what Redis knows: the key, and client ids (not PostgreSQL's backend
    // pids, and no "local socket": Redis tells no address here).
    let text = status(&[]);
    assert!(
        text.starts_with(&format!("lock {lock:?} (key pgleader:{{{lock}}}): held")),
        "{text}"
    );
    let leader = format!("leader:  client id {a_client}, pgleader pid {}", a.pid);
    assert!(text.contains(&leader), "{text}");
    assert!(
        text.contains(&format!("waiting #1: client id {b_client}")),
        "{text}"
    );
    assert!(
        !text.contains("backend") && !text.contains("local socket"),
        "{text}"
    );
}

#[test]
fn after_a_restart_that_kept_nothing_the_new_leader_waits_out_the_restart_fence() {
    let (redis, lock) = own_server("fence");
    let journal = Journal::new("redis-fence");
    let timings = [
        "--check-interval=200ms",
        "--check-timeout=500ms",
        "--kill-timeout=1s",
        "--lease=3s",
        "--restart-fence=auto",
    ];
    // The old command takes 0.8 s to stop: a new leader must not start before that has passed.
    let a = run(
        "A",
        &redis.url(),
        &lock,
        &timings,
        &journal.child("A", "0.8"),
    );
    // The server has just started: even the first leader waits out the fence.
    a.wait_log("(--restart-fence)");
    a.wait_stdout("A started");
    redis.crash();
    redis.start();
    let fence = a.wait_for_nth(Stream::Stderr, "(--restart-fence)", 2);
    assert!(fence.contains("starting the command in"), "{fence}");
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "A-started"]);
}

#[test]
fn without_pubsub_numsub_a_crashed_leader_is_replaced_when_its_key_expires_and_it_says_so() {
    let redis = Redis::new("blind");
    // The documented ACL, less PUBSUB NUMSUB (taken away last, so nothing before adds it back).
    redis.acl_user(
        "blind",
        "blind-pw",
        &[&DOCUMENTED_ACL[..], &["-pubsub|numsub"]].concat(),
    );
    let url = format!("redis://blind:blind-pw@127.0.0.1:{}", redis.port);
    let lock = lock("blind");
    let timings = [
        "--check-interval=200ms",
        "--check-timeout=500ms",
        "--kill-timeout=1s",
        "--lease=3s",
    ];
    let (a, _) = leading("A", &url, &lock, &timings);
    let b = run("B", &url, &lock, &timings, &patient_child("B"));
    let warning = b.wait_log("PUBSUB NUMSUB");
    assert!(warning.contains("when its key expires"), "{warning}");
    a.signal(Signal::SIGKILL);
    b.wait_stdout("B started");
    let warnings = lines_with(&b, Stream::Stderr, &["PUBSUB NUMSUB"]);
    assert_eq!(warnings.len(), 1, "said once: {}", b.dump());
}

#[test]
fn a_log_reader_that_went_away_does_not_kill_pgleader() {
    // `pgleader run ... 2>&1 | head -1`: stderr becomes a pipe nobody reads.
    let redis = Redis::shared();
    let marker = std::env::temp_dir().join(format!("pgleader-{}.ran", lock("stderr")));
    let mut command = pgleader();
    command
        .args([
            "run",
            "-d",
            &redis.url(),
            "--lock",
            &lock("stderr"),
            "--once",
            "--",
        ])
        .args([
            "sh",
            "-c",
            &format!("sleep 0.3; echo ran > {}", marker.display()),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().expect("start pgleader");
    drop(child.stderr.take());
    let deadline = std::time::Instant::now() + crate::harness::WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pgleader did not exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "pgleader died of its closed stderr");
    assert!(marker.exists(), "the command did not run to its end");
    let _ = std::fs::remove_file(&marker);
}
