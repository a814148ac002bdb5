//! What only the Redlock quorum needs beyond the contract suite, tested on its sessions directly
//! and through the command line: losing one server of three changes nothing, losing two ends
//! the leadership, Kleppmann's scenario (a server of the leader's majority restarts empty, and a
//! follower that reaches it and two others must not win) is refused by the delayed restart, and
//! a scheduled job's claim counts only when a majority of the servers accepts it.

use std::process::Command;
use std::time::Duration;

use pgleader::election::lease::Lease;
use pgleader::election::lock::LockKey;
use pgleader::election::{Backend, Check, Confirmation, Session};
use pgleader::redis::quorum::{QuorumBackend, QuorumSession};
use pgleader::redis::url::RedisServer;

use crate::harness::cluster::free_port;
use crate::harness::within;
use crate::harness::{
    Journal, Proc, Proxy, Redis, Stream, WAIT, kill_9_never_overlaps_a_41_process_tree,
    patient_child, pgleader, unique_lock, wait_gone,
};

const LEASE: Duration = Duration::from_secs(3);

/// The command-line tests' checks, quick, with the sessions' lease of 3 s (the scheduled
/// quorum's tests in `schedule.rs` use them too).
pub(crate) const CLI_TIMINGS: [&str; 4] = [
    "--check-interval=200ms",
    "--check-timeout=500ms",
    "--kill-timeout=1s",
    "--lease=3s",
];

/// A URL of a server that is not there: a server this replica is cut off from.
fn unreachable() -> String {
    format!("redis://127.0.0.1:{}", free_port())
}

fn backend(urls: &[String], lock: &str) -> QuorumBackend {
    QuorumBackend {
        servers: urls
            .iter()
            .map(|url| {
                RedisServer::parse(url, None, Duration::from_millis(500)).expect("a Redis URL")
            })
            .collect(),
        lock: LockKey::from_name(lock),
        lease: Lease::new(LEASE),
        poll: Duration::from_millis(200),
        ledger_timeout: Duration::from_secs(1),
        user_name: None,
    }
}

/// Servers of the test's own, old enough to vote (a server younger than the lease refuses).
fn servers(n: usize) -> Vec<Redis> {
    let servers: Vec<Redis> = (0..n).map(|i| Redis::new(&format!("quorum-{i}"))).collect();
    for redis in &servers {
        wait_older_than_lease(redis);
    }
    servers
}

/// Three servers of the test's own, old enough to vote, and their URLs.
fn three_servers() -> (Vec<Redis>, Vec<String>) {
    let servers = servers(3);
    let urls = servers.iter().map(Redis::url).collect();
    (servers, urls)
}

fn wait_older_than_lease(redis: &Redis) {
    wait_older_than(redis, LEASE);
}

/// Waits until the server has been up for more than `lease` (by its own `uptime_in_seconds`,
/// which is what the acquire script reads), so that it votes.
pub(crate) fn wait_older_than(redis: &Redis, lease: Duration) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let uptime: u64 = redis
            .cli(&["INFO", "server"])
            .lines()
            .find_map(|line| line.trim().strip_prefix("uptime_in_seconds:")?.parse().ok())
            .unwrap_or(0);
        if Duration::from_secs(uptime) > lease {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server does not age"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn block_on<T>(test: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(test)
}

/// A session of `quorum` named `name`, connected to a majority of its servers.
async fn connect(quorum: &QuorumBackend, name: &str) -> QuorumSession {
    within("connect", quorum.connect(name))
        .await
        .unwrap_or_else(|err| panic!("{name} reaches no majority: {err}"))
}

/// Whether `session` acquired the lock.
async fn acquires(session: &QuorumSession) -> bool {
    within("acquire", session.try_acquire())
        .await
        .expect("tries")
}

/// A session that connected to a majority, acquired the lock and took its fencing token.
async fn lead(quorum: &QuorumBackend) -> (QuorumSession, i64) {
    let session = connect(quorum, "leader:1@test").await;
    assert!(acquires(&session).await);
    let epoch = within("fence", session.fence())
        .await
        .expect("a token")
        .epoch;
    (session, epoch)
}

fn held(check: &Result<Check, pgleader::election::SessionError>) -> bool {
    matches!(
        check,
        Ok(Check {
            confirmation: Confirmation::Held,
            ..
        })
    )
}

#[test]
fn a_leader_keeps_leading_when_one_server_of_three_dies_and_stops_when_two_do() {
    let (servers, urls) = three_servers();
    let quorum = backend(&urls, &format!("lose-{}", unique_lock()));
    block_on(async {
        let (mut leader, _) = lead(&quorum).await;

        servers[2].crash();
        assert!(
            held(&within("check", leader.confirm()).await),
            "two of three still hold it"
        );
        let early = tokio::time::timeout(Duration::from_millis(300), leader.ended()).await;
        assert!(
            early.is_err(),
            "the session ended with a majority left: {early:?}"
        );

        servers[1].crash();
        let reason = within("the majority's loss", leader.ended()).await;
        assert!(reason.contains("fewer than a majority"), "{reason}");
        assert!(
            !held(&within("check", leader.confirm()).await),
            "one of three cannot hold it"
        );
    });
}

#[test]
fn kleppmanns_scenario_a_server_restarted_empty_does_not_vote_for_a_second_leader() {
    // Five servers: the leader reaches A, B and C (a majority); the follower is cut off from A
    // and B and reaches C, D and E. C restarts without its data.
    let servers = servers(5);
    let url = |i: usize| servers[i].url();
    let lock = format!("kleppmann-{}", unique_lock());
    let leader_view = backend(
        &[url(0), url(1), url(2), unreachable(), unreachable()],
        &lock,
    );
    let follower_view = backend(
        &[unreachable(), unreachable(), url(2), url(3), url(4)],
        &lock,
    );
    block_on(async {
        let leader = connect(&leader_view, "leader:1@test").await;
        assert!(acquires(&leader).await);
        let follower = connect(&follower_view, "follower:2@test").await;
        assert!(
            !acquires(&follower).await,
            "C holds the leader's key: the follower has two votes of five"
        );

        // (The harness blocks this thread for the restart: the sessions just wait.)
        servers[2].crash();
        servers[2].start();
        let follower = connect(&follower_view, "follower:3@test").await;
        assert!(
            !acquires(&follower).await,
            "C restarted empty and voted with D and E: a second leader while the first one's \
             command may still run"
        );
        // The leader lost C's copy: two of five, and its next check says so (a renewal never
        // re-creates a key), so it stops its command.
        assert!(
            !held(&within("check", leader.confirm()).await),
            "two of five cannot hold it"
        );
        // Once C has been up for a lease, the old leader's command is long gone: C votes again.
        wait_older_than_lease(&servers[2]);
        assert!(acquires(&follower).await, "after a lease, C votes again");
    });
}

#[test]
fn epochs_keep_growing_across_majorities_even_when_one_server_hands_out_larger_ones() {
    // A's counter is a minute ahead (as if its clock ran fast, or it had served many more
    // leaderships), so the epoch a majority with A hands out is above what B and C would; the
    // next majority, without A, must still start above it. (libfaketime cannot skew
    // redis-server's clock: it clashes with jemalloc.)
    let servers = servers(3);
    let (a, b, c) = (&servers[0], &servers[1], &servers[2]);
    let lock = format!("skew-{}", unique_lock());
    let ahead = (std::time::SystemTime::now() + Duration::from_secs(60))
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros()
        .to_string();
    a.cli(&["SET", &format!("pgleader:{{{lock}}}:epoch"), &ahead]);
    let quorum = backend(&[a.url(), b.url(), c.url()], &lock);
    let leadership = || {
        block_on(async {
            let (session, epoch) = lead(&quorum).await;
            within("release", session.release(WAIT))
                .await
                .expect("released");
            epoch
        })
    };
    c.crash();
    let first = leadership(); // A and B
    a.crash();
    c.start();
    wait_older_than_lease(c);
    let second = leadership(); // B and C
    assert!(
        second > first,
        "epoch {second} after {first}: the majority's largest epoch was not written back"
    );
}

/// `pgleader run` over a quorum, through repeated `-d`.
fn run_on(name: &str, urls: &[String], lock: &str, args: &[&str], script: &str) -> Proc {
    run_on_with(pgleader(), name, urls, lock, args, script)
}

/// [`run_on`], from a `pgleader` command the test has prepared (its environment).
fn run_on_with(
    mut command: Command,
    name: &str,
    urls: &[String],
    lock: &str,
    args: &[&str],
    script: &str,
) -> Proc {
    command.arg("run");
    for url in urls {
        command.args(["-d", url]);
    }
    command
        .arg(format!("--lock={lock}"))
        .args(args)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

#[test]
fn the_command_line_refuses_a_quorum_it_cannot_keep_and_warns_on_an_even_one() {
    let redis = |port: u16| format!("redis://127.0.0.1:{port}");
    for (urls, extra, expected) in [
        (
            vec![redis(1), redis(2)],
            vec![],
            "at least three Redis servers",
        ),
        (
            vec![redis(1), redis(2), "postgres://x/y".to_owned()],
            vec![],
            "each must be a redis://",
        ),
        (vec![redis(1), redis(2), redis(1)], vec![], "given twice"),
    ] {
        let run = run_on("usage", &urls, "x", &extra, "true");
        let (status, _, stderr) = run.finish();
        assert_eq!(status.code(), Some(2), "{urls:?}: {}", run.dump());
        let text = stderr.join("\n");
        assert!(text.contains(expected), "{urls:?}: {text}");
    }
    let four: Vec<String> = (1..=4).map(|_| unreachable()).collect();
    let run = run_on("even", &four, "x", &[], "true");
    run.wait_log("an even count adds a server without adding tolerance");
    run.signal(nix::sys::signal::Signal::SIGTERM);
    run.wait_exit();
}

#[test]
fn kill_9_of_the_leader_never_overlaps_a_41_process_tree_in_20_rounds_and_hands_over_at_once() {
    let (servers, urls) = three_servers();
    let lock = format!("tree-{}", unique_lock());
    // Tries five seconds apart: a takeover within a second or two comes from the dead leader's
    // keeper, which released the key on every server once the tree was gone. The shortest lease
    // those checks allow, which the servers must have been up for to vote.
    let timings = [
        "--check-interval=5s",
        "--check-timeout=500ms",
        "--kill-timeout=1s",
        "--lease=8s",
    ];
    for redis in &servers {
        wait_older_than(redis, Duration::from_secs(8));
    }
    let takeovers = kill_9_never_overlaps_a_41_process_tree("quorum-41", 20, |name, script| {
        run_on(name, &urls, &lock, &timings, script)
    });
    let slowest = takeovers.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < Duration::from_millis(2500),
        "a takeover waited for the follower's check: {takeovers:?}"
    );
}

#[test]
fn over_three_servers_the_leader_rides_out_one_servers_death_and_stops_at_the_seconds() {
    let (servers, urls) = three_servers();
    let lock = format!("cli-{}", unique_lock());
    // One space-separated PGLEADER_DATABASE_URL for A, repeated -d for B.
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", urls.join(" "))
        .arg("run")
        .arg(format!("--lock={lock}"))
        .args(CLI_TIMINGS)
        .args(["--", "sh", "-c", &patient_child("A")]);
    let a = Proc::spawn("A", command);
    a.wait_stdout("A started");
    let b = run_on("B", &urls, &lock, &CLI_TIMINGS, &patient_child("B"));
    b.wait_log("waiting for the lock");

    servers[0].crash();
    // Seven check intervals later, A still leads and its command was never signalled: the
    // window is the claim itself (nothing happens), not a stand-in for an event.
    std::thread::sleep(Duration::from_millis(1_500));
    assert!(
        !a.printed(Stream::Stdout, "got"),
        "the command was signalled with two servers of three left: {}",
        a.dump()
    );
    // status shows each server's view, and the holder a majority shows.
    let mut command = pgleader();
    command.arg("status");
    for url in &urls {
        command.args(["-d", url]);
    }
    command.arg(format!("--lock={lock}"));
    let status = Proc::spawn("status", command);
    let (exit, stdout, _) = status.finish();
    assert_eq!(exit.code(), Some(0), "held: {}", status.dump());
    let text = stdout.join("\n");
    assert_eq!(text.matches("held by pgleader").count(), 2, "{text}");
    assert_eq!(text.matches("unreachable").count(), 1, "{text}");
    assert!(text.contains(&format!("{}@", a.pid)), "{text}");

    servers[1].crash();
    a.wait_stdout("A got TERM");
    a.wait_log("leadership lost");
    assert!(
        b.lines(Stream::Stdout).is_empty(),
        "B started without a majority: {}",
        b.dump()
    );
}

#[test]
fn a_leader_cut_from_two_servers_stops_before_a_follower_that_reaches_them_can_start() {
    let servers = servers(3);
    let lock = format!("partition-{}", unique_lock());
    let journal = Journal::new("quorum-partition");
    // The leader reaches B and C through proxies that will freeze (no FIN, no RST: its
    // connections stay open on the servers, so only the keys' TTL can free them).
    let (to_b, to_c) = (Proxy::start(servers[1].port), Proxy::start(servers[2].port));
    let leader_urls = [
        servers[0].url(),
        format!("redis://127.0.0.1:{}", to_b.port()),
        format!("redis://127.0.0.1:{}", to_c.port()),
    ];
    let follower_urls: Vec<String> = servers.iter().map(Redis::url).collect();
    // A takes 0.8 s to stop after TERM; B must not start before A has stopped.
    let a = run_on(
        "A",
        &leader_urls,
        &lock,
        &CLI_TIMINGS,
        &journal.child("A", "0.8"),
    );
    a.wait_stdout("A started");
    let b = run_on(
        "B",
        &follower_urls,
        &lock,
        &CLI_TIMINGS,
        &journal.quick_child("B"),
    );
    b.wait_log("waiting for the lock");
    to_b.freeze();
    to_c.freeze();
    a.wait_log("leadership lost");
    b.wait_stdout("B started");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
}

#[test]
fn a_jump_of_a_replicas_wall_clock_changes_nothing() {
    let library = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(library).is_file(),
        "{library} is missing: this test jumps pgleader's wall clock with libfaketime (apt-get install faketime)"
    );
    let (_servers, urls) = three_servers();
    let lock = format!("jump-{}", unique_lock());
    let clock = std::env::temp_dir().join(format!("pgleader-clock-{lock}"));
    std::fs::write(&clock, "+0\n").expect("write the clock file");
    // Both replicas read their wall-clock offset from the file at every call; their monotonic
    // clocks are left alone, as a wall-clock step (NTP, a VM resumed) leaves them.
    let under_faketime = |name: &str, script: &str| {
        let mut command = pgleader();
        command
            .env("LD_PRELOAD", library)
            .env("FAKETIME_TIMESTAMP_FILE", &clock)
            .env("FAKETIME_NO_CACHE", "1")
            .env("DONT_FAKE_MONOTONIC", "1");
        run_on_with(command, name, &urls, &lock, &CLI_TIMINGS, script)
    };
    let a = under_faketime("A", &patient_child("A"));
    a.wait_stdout("A started");
    let b = under_faketime("B", &patient_child("B"));
    b.wait_log("waiting for the lock");
    for jump in ["+1h", "-2h", "+30m"] {
        std::fs::write(&clock, format!("{jump}\n")).expect("jump the clock");
        // Seven check intervals of nothing happening: the claim itself, not a stand-in.
        std::thread::sleep(Duration::from_millis(1_500));
    }
    assert!(
        !a.printed(Stream::Stdout, "got"),
        "a wall-clock jump stopped the leader's command: {}",
        a.dump()
    );
    assert!(
        b.lines(Stream::Stdout).is_empty(),
        "a wall-clock jump let a follower in: {}",
        b.dump()
    );
    let _ = std::fs::remove_file(&clock);
}

#[test]
fn a_leader_that_lost_one_servers_connection_before_its_command_started_leaves_nothing_behind_when_killed()
 {
    // Two of three still hold the session after the server ends one connection, so it lives
    // on; that socket's number went to the next descriptor pgleader opened, its own end of the
    // keeper's channel. Handed to the keeper as a connection to hold, it kept the channel open,
    // so the keeper never saw pgleader die and the command outlived a kill -9 of pgleader.
    let (servers, urls) = three_servers();
    let lock = format!("stale-socket-{}", unique_lock());
    let a = run_on(
        "A",
        &urls,
        &lock,
        &["--takeover-delay=2s"],
        "echo \"A started $$\"; exec sleep 1000",
    );
    a.wait_log("starting the command in 2s");
    let needle = format!(":{}@", a.pid);
    let list = servers[2].cli(&["CLIENT", "LIST"]);
    let ids: Vec<&str> = list
        .lines()
        .filter(|line| line.contains(&needle))
        .filter_map(|line| line.split_whitespace().next()?.strip_prefix("id="))
        .collect();
    assert!(!ids.is_empty(), "no connection of A on C: {list}");
    for id in ids {
        servers[2].cli(&["CLIENT", "KILL", "ID", id]);
    }
    let started = a.wait_stdout("A started");
    assert!(
        !a.printed(Stream::Stderr, "leadership lost"),
        "two of three still hold it: {}",
        a.dump()
    );
    let command: i32 = started
        .rsplit(' ')
        .next()
        .and_then(|pid| pid.parse().ok())
        .expect("the command's pid");
    a.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(
        wait_gone(command, WAIT),
        "the command outlived a kill -9 of pgleader: {}",
        a.dump()
    );
}

/// A ledger row as pgleader writes it on one server: a run of `at` that already succeeded.
fn write_row(redis: &Redis, lock: &str, at: jiff::Timestamp) {
    let micros = at.as_microsecond().to_string();
    let row = serde_json::json!({
        "scheduled_for": micros, "outcome": "succeeded", "attempt": "1",
        "claimed_at": micros, "ended_at": micros, "epoch": "1",
        "host": "elsewhere", "pid": "1", "schedule": "* * * * * *", "timezone": "UTC",
    });
    redis.cli(&[
        "HSET",
        &format!("pgleader:{{{lock}}}:rows"),
        &micros,
        &row.to_string(),
    ]);
    redis.cli(&[
        "ZADD",
        &format!("pgleader:{{{lock}}}:runs"),
        &micros,
        &micros,
    ]);
}

fn has_row(redis: &Redis, lock: &str, at: jiff::Timestamp) -> bool {
    let micros = at.as_microsecond().to_string();
    redis.cli(&["HEXISTS", &format!("pgleader:{{{lock}}}:rows"), &micros]) == "1"
}

#[test]
fn a_claim_counts_only_when_a_majority_of_the_servers_accepts_it() {
    use pgleader::election::ledger::{Claim, Claimant, Definition, Ledger};
    let (servers, urls) = three_servers();
    let lock = format!("claims-{}", unique_lock());
    let quorum = backend(&urls, &lock);
    // Occurrences after the servers started (a server refuses those before its start: it may
    // have lost their rows), and already due.
    let now = jiff::Timestamp::now();
    let ago = |millis: i64| now - jiff::SignedDuration::from_millis(millis);
    let (both, one, none) = (ago(1500), ago(1000), ago(500));
    // Two of three servers already recorded the first; one server the second.
    write_row(&servers[1], &lock, both);
    write_row(&servers[2], &lock, both);
    write_row(&servers[2], &lock, one);
    block_on(async {
        let (session, epoch) = lead(&quorum).await;
        let ledger = session.ledger(&Definition {
            expression: "* * * * * *".into(),
            timezone: "UTC".into(),
        });
        let claimant = Claimant {
            host: "test".into(),
            pid: 1,
            epoch,
        };
        // The first server alone would accept it; two of three refuse: not a claim, and the
        // first server's claim is taken back.
        let claim = within("claim", ledger.claim(both, Duration::ZERO, &claimant, 0))
            .await
            .expect("answers");
        assert_eq!(
            claim,
            Claim::Taken {
                outcome: "succeeded".into()
            }
        );
        assert!(
            !has_row(&servers[0], &lock, both),
            "the minority's claim was not taken back"
        );
        // The third server already recorded `one`; the other two accept it: a majority, so a
        // claim.
        let claim = within("claim", ledger.claim(one, Duration::ZERO, &claimant, 0))
            .await
            .expect("answers");
        assert_eq!(claim, Claim::Claimed { attempt: 1 });
        assert!(has_row(&servers[0], &lock, one) && has_row(&servers[1], &lock, one));
        // With two servers gone, nothing can be claimed: the one left accepts, but alone.
        servers[1].crash();
        servers[2].crash();
        let claim = within("claim", ledger.claim(none, Duration::ZERO, &claimant, 0)).await;
        assert!(claim.is_err(), "a claim without a majority: {claim:?}");
        assert!(
            !has_row(&servers[0], &lock, none),
            "the lone server kept a claim no majority accepted"
        );
    });
}

#[test]
fn a_leader_sets_its_key_again_on_a_server_that_came_back_and_rides_out_a_rolling_restart() {
    let (servers, urls) = three_servers();
    let lock = format!("rolling-{}", unique_lock());
    let quorum = backend(&urls, &lock);
    let key = format!("pgleader:{{{lock}}}");
    block_on(async {
        let (mut leader, _) = lead(&quorum).await;
        let ours = servers[1].cli(&["GET", &key]);
        // Each server in turn restarts empty; the leader, which keeps watching its session and
        // checking (as the supervisor does), sets its key there again before the next one goes
        // down.
        for (down, next) in [(0, 1), (1, 2)] {
            servers[down].crash();
            servers[down].start();
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                let early = tokio::time::timeout(Duration::from_millis(50), leader.ended()).await;
                assert!(early.is_err(), "the session ended: {early:?}");
                // Renewed as the supervisor's checks renew it.
                assert!(held(&within("check", leader.confirm()).await));
                let value = servers[down].cli(&["GET", &key]);
                if value.split(' ').next() == ours.split(' ').next() {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the leader never set its key on server {down} again: {value:?}"
                );
            }
            assert!(
                held(&within("check", leader.confirm()).await),
                "after server {down}'s restart, before server {next}'s"
            );
        }
        servers[2].crash();
        servers[1].crash();
        let reason = within("the majority's loss", leader.ended()).await;
        assert!(reason.contains("fewer than a majority"), "{reason}");
    });
}
