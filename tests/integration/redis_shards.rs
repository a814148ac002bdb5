//! A sharded lock on one Redis server, at the library's level (`src/redis/shards/`): the keys
//! are the documented ones, members share the shards out and hand a surplus over through the
//! server, renewal never re-creates a shard key that vanished, the end of a member's connection
//! is heard by its watcher and told to everyone, and a replica that runs the name otherwise is
//! refused.

use std::collections::BTreeSet;
use std::time::Duration;

use pgleader::election::lock::LockKey;
use pgleader::election::shards::Holder;
use pgleader::redis::RedisBackend;
use pgleader::redis::shards::RedisShardHolder;

use nix::sys::signal::Signal;

use crate::contract::block_on;
use crate::harness::http::{address_of, get};
use crate::harness::redis::DOCUMENTED_ACL;
use crate::harness::shards::{
    Fleet, a_capped_member_holds_no_more_than_its_cap, a_killed_replica_s_shards_run_on_the_others,
    a_member_that_leaves_frees_its_shards, a_second_replica_takes_the_surplus,
    a_sharded_replica_beside_a_plain_one_is_refused, a_surplus_goes_to_the_one_that_is_short,
    alone_with_every_shard, another_count_or_a_plain_replica_is_refused_with_exit_2,
    another_shard_count_is_refused, assert_no_overlap, commands_exited, holds,
    it_stops_every_command_and_exits_2, join, member_holds, notified, one_replica_runs_every_shard,
    shard_child, started_shards, status_shows_each_shard_s_replica, stop, take_share,
    the_end_of_b_is_heard, the_surplus_goes_back_when_its_replica_stops,
    three_members_of_six_shards,
};
use crate::harness::within;
use crate::harness::{Journal, Proc, Redis, Stream, WAIT, field, pgleader, unique_lock};
use crate::observability::sample;

pub(crate) fn backend(name: &str) -> RedisBackend {
    let server = pgleader::redis::url::RedisServer::parse(&Redis::shared().url(), None, WAIT / 4)
        .expect("the harness's URL");
    RedisBackend {
        server,
        lock: LockKey::from_name(name),
        lease: pgleader::election::lease::Lease::new(Duration::from_secs(15)),
        poll: Duration::from_millis(100),
        ledger_timeout: Duration::from_secs(1),
        user_name: None,
    }
}

pub(crate) fn unique_name(tag: &str) -> String {
    format!("shards-{tag}-{}", unique_lock())
}

/// A new name, whose keys a test reads, and a member alone on its `shards` shards.
async fn alone_on_a_new_name(tag: &str, shards: u32) -> (String, RedisShardHolder) {
    let name = unique_name(tag);
    let holder = alone_with_every_shard(&backend(&name), shards).await;
    (name, holder)
}

#[test]
fn the_keys_of_a_sharded_name_are_the_documented_ones_the_card_s_ttl_the_lease() {
    let redis = Redis::shared();
    block_on(async {
        let (name, holder) = alone_on_a_new_name("keys", 3).await;
        let me = holder.id();
        for shard in 0..3 {
            let key = format!("pgleader:{{{name}}}:shard:{shard}");
            let value = redis.cli(&["GET", &key]);
            assert!(
                value.contains(&format!(" member={me} ")) && value.starts_with("nonce="),
                "{key}: {value}"
            );
            // Ten leases, 10 minutes at least: the card's lease says whether it is held.
            let ttl: i64 = redis.cli(&["PTTL", &key]).parse().expect("a TTL");
            assert!(ttl > 590_000 && ttl <= 600_000, "{key}: PTTL {ttl}");
        }
        let card_key = format!("pgleader:{{{name}}}:member:{me}");
        let ttl: i64 = redis.cli(&["PTTL", &card_key]).parse().expect("a TTL");
        assert!(ttl > 10_000 && ttl <= 15_000, "{card_key}: PTTL {ttl}");
        let card = redis.cli(&["GET", &card_key]);
        assert!(card.contains(" shards=3 cap=none "), "{card}");
        assert_eq!(
            redis.cli(&["SMEMBERS", &format!("pgleader:{{{name}}}:members")]),
            me.to_string()
        );
        assert_eq!(
            redis.cli(&["EXISTS", &format!("pgleader:{{{name}}}")]),
            "0",
            "a shard took the plain key of the same name"
        );
    });
}

#[test]
fn the_largest_shard_count_is_read_taken_and_renewed_by_one_script_each() {
    // 4096 keys in one MGET and one take: within what a script's Lua stack holds.
    let backend = backend(&unique_name("largest"));
    block_on(async {
        let a = join(&backend, 4096).await;
        assert_eq!(take_share(&a).await.len(), 4096);
        let b = join(&backend, 4096).await;
        let seen = within("roster", b.roster()).await.expect("roster");
        assert_eq!(seen.roster.shares(), vec![2048, 2048]);
        assert!(seen.free().is_empty());
        within("leave", a.leave(WAIT)).await.expect("leave");
        assert_eq!(take_share(&b).await.len(), 4096);
    });
}

#[test]
fn members_share_the_shards_out_and_a_surplus_goes_to_the_one_that_is_short() {
    let backend = backend(&unique_name("share"));
    block_on(async {
        let (a, b) = a_surplus_goes_to_the_one_that_is_short(&backend).await;
        // A shard another member holds cannot be taken, nor given away by someone else.
        let (won, fence) = within("take", a.take(&[2])).await.expect("take");
        assert!(won.is_empty() && fence.is_none());
        let given = within("give", a.give(&[3])).await.expect("give");
        assert!(
            given.is_empty(),
            "gave away another member's shard: {given:?}"
        );
        a_member_that_leaves_frees_its_shards(a, b).await;
    });
}

#[test]
fn each_take_hands_out_a_greater_epoch_than_every_earlier_one() {
    let backend = backend(&unique_name("epochs"));
    block_on(async {
        let a = join(&backend, 2).await;
        let (_, first) = within("take", a.take(&[0])).await.expect("take");
        assert_eq!(within("give", a.give(&[0])).await.expect("give"), [0]);
        let (_, second) = within("take", a.take(&[0, 1])).await.expect("take");
        let (first, second) = (first.expect("a fence"), second.expect("a fence"));
        assert!(second.epoch > first.epoch, "{first:?} then {second:?}");
    });
}

#[test]
fn a_shard_key_deleted_under_its_holder_is_lost_not_re_created() {
    let redis = Redis::shared();
    block_on(async {
        let (name, a) = alone_on_a_new_name("deleted", 3).await;
        redis.cli(&["DEL", &format!("pgleader:{{{name}}}:shard:1")]);
        // The read renews the others and shows shard 1 free: the room stops its command.
        assert_eq!(holds(&a).await, BTreeSet::from([0, 2]));
        assert_eq!(
            redis.cli(&["EXISTS", &format!("pgleader:{{{name}}}:shard:1")]),
            "0"
        );
        // A foreign value in a shard key is neither this member's nor free.
        redis.cli(&[
            "SET",
            &format!("pgleader:{{{name}}}:shard:2"),
            "x",
            "PX",
            "60000",
        ]);
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(member_holds(&seen.roster, a.id()), BTreeSet::from([0]));
        assert_eq!(seen.taken, BTreeSet::from([2]));
        assert_eq!(seen.free(), vec![1]);
        // The member's own card gone: it is no longer on the roster, and takes nothing.
        redis.cli(&["DEL", &format!("pgleader:{{{name}}}:member:{}", a.id())]);
        let seen = within("roster", a.roster()).await.expect("roster");
        assert!(seen.roster.members.iter().all(|m| m.id != a.id()));
        assert!(within("take", a.take(&[1])).await.is_err());
    });
}

#[test]
fn the_end_of_a_member_s_connection_is_heard_by_its_watcher_and_told_to_every_member() {
    let backend = backend(&unique_name("gone"));
    block_on(async {
        let (members, _) = three_members_of_six_shards(&backend).await;
        let (heard, a_takes, c_takes) =
            the_end_of_b_is_heard(&backend, members, Duration::from_millis(300)).await;
        assert_eq!((a_takes, c_takes), (3, 3));
        // Within a check interval (100 ms here) and a round trip, long before the 15 s TTL.
        assert!(heard < Duration::from_secs(2), "heard after {heard:?}");
    });
}

#[test]
fn a_member_whose_connection_is_gone_is_dropped_by_anyone_s_roster_read() {
    let backend = backend(&unique_name("pruned"));
    block_on(async {
        let a = join(&backend, 4).await;
        take_share(&a).await;
        let b = join(&backend, 4).await;
        let mut c = join(&backend, 4).await;
        let gone = b.id();
        drop(b);
        // No watcher: A's own read finds B's connection gone (once the server has closed
        // it), and the others hear it.
        let ids = within("B gone from the roster", async {
            loop {
                let seen = a.roster().await.expect("roster");
                let ids: Vec<i32> = seen.roster.members.iter().map(|m| m.id).collect();
                if !ids.contains(&gone) {
                    return ids;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert_eq!(ids, vec![a.id(), c.id()]);
        assert_eq!(notified(&mut c, "gone").await, format!("gone {gone}"));
    });
}

#[test]
fn a_replica_with_another_shard_count_or_without_shards_is_refused() {
    let backend = backend(&unique_name("mismatch"));
    let plain_backend = self::backend(&unique_name("plain"));
    block_on(async {
        let (a, reason) = another_shard_count_is_refused(&backend).await;
        assert!(reason.contains(&format!("member {}", a.id())), "{reason}");
        // A plain replica of a sharded name is refused when it connects.
        match within(
            "connect",
            pgleader::election::Backend::connect(&backend, "pgleader-plain"),
        )
        .await
        {
            Err(pgleader::election::ConnectError::Conflict(reason)) => {
                assert!(reason.contains("with --shards"), "{reason}");
            }
            other => panic!("a plain replica connected beside a sharded one: {other:?}"),
        }
        drop(a);
        a_sharded_replica_beside_a_plain_one_is_refused(&plain_backend).await;
    });
}

#[test]
fn a_capped_member_holds_no_more_than_its_cap_and_the_others_share_the_rest() {
    let backend = backend(&unique_name("cap"));
    block_on(a_capped_member_holds_no_more_than_its_cap(&backend));
}

// --- The binary: `pgleader run --shards K` against one Redis server. ---

/// Quick checks, and a lease long enough that only a dead connection (not a key's expiry) can
/// explain a shard moving within the test's waits.
pub(crate) const QUICK: [&str; 4] = [
    "--check-interval=200ms",
    "--check-timeout=500ms",
    "--lease=60s",
    "--kill-timeout=5s",
];

/// Checks five seconds apart: a killed replica's shards that run elsewhere within a second or
/// two were handed over by its keepers (their farewells), not found by a watcher's check.
const FIVE_SECOND_CHECKS: [&str; 4] = [
    "--check-interval=5s",
    "--check-timeout=500ms",
    "--lease=60s",
    "--kill-timeout=5s",
];

/// The replicas of one lock on the shared server, with [`QUICK`] checks (or others).
struct RedisFleet {
    lock: String,
    checks: &'static [&'static str],
}

impl Fleet for RedisFleet {
    fn replica(&self, tag: &str, shards: &str, journal: &Journal) -> Proc {
        let shards = format!("--shards={shards}");
        self.run(tag, &[&shards], &shard_child(journal, tag))
    }

    fn plain(&self, tag: &str, script: &str) -> Proc {
        self.run(tag, &[], script)
    }

    fn lock_named(&self) -> String {
        format!("\"{}\"", self.lock)
    }

    /// The connections it keeps open on the server (its client names carry its pid).
    fn sessions_of(&self, replica: &Proc) -> usize {
        Redis::shared()
            .cli(&["CLIENT", "LIST"])
            .lines()
            .filter(|line| line.contains(&format!(":{}@", replica.pid)))
            .count()
    }
}

impl RedisFleet {
    fn new(tag: &str) -> RedisFleet {
        RedisFleet {
            lock: unique_name(tag),
            checks: &QUICK,
        }
    }

    /// A replica with [`QUICK`] checks and `args`, on the shared server.
    fn run(&self, tag: &str, args: &[&str], script: &str) -> Proc {
        self.run_on(&Redis::shared().url(), tag, args, script)
    }

    fn run_on(&self, url: &str, tag: &str, args: &[&str], script: &str) -> Proc {
        let args = [self.checks, args].concat();
        crate::harness::run_named(tag, url, &self.lock, &args, script)
    }
}

#[test]
fn replicas_share_the_shards_out_on_redis_and_a_surplus_is_handed_over_without_overlap() {
    let fleet = RedisFleet::new("balance");
    let journal = Journal::new("redis-shards-balance");
    let (a, _) = one_replica_runs_every_shard(&fleet, &journal);
    let (b, balanced) = a_second_replica_takes_the_surplus(&fleet, &journal, &a);
    the_surplus_goes_back_when_its_replica_stops(&a, &b);
    // Everything of the name is gone but the epoch and the id counter.
    let lock = &fleet.lock;
    let left = Redis::shared().cli(&["KEYS", &format!("pgleader:{{{lock}}}:*")]);
    let mut left: Vec<&str> = left.lines().collect();
    left.sort_unstable();
    assert_eq!(
        left,
        vec![
            format!("pgleader:{{{lock}}}:epoch"),
            format!("pgleader:{{{lock}}}:ids")
        ],
    );
    eprintln!("balanced {balanced:?} after B started");
    assert!(balanced < Duration::from_secs(2) + WAIT / 4, "{balanced:?}");
}

#[test]
fn a_killed_replica_s_shards_run_on_the_others_before_the_ttl_on_two_connections_each() {
    let fleet = RedisFleet::new("kill");
    let taken =
        a_killed_replica_s_shards_run_on_the_others(&fleet, &Journal::new("redis-shards-kill"));
    // A check interval is 200 ms; the lease (the keys' TTL) is 60 s.
    assert!(taken < Duration::from_secs(5), "{taken:?}");
}

#[test]
fn a_killed_replica_s_keepers_hand_its_shards_over_long_before_anyone_s_next_check() {
    let fleet = RedisFleet {
        checks: &FIVE_SECOND_CHECKS,
        ..RedisFleet::new("farewell")
    };
    let taken =
        a_killed_replica_s_shards_run_on_the_others(&fleet, &Journal::new("redis-shards-farewell"));
    assert!(taken < Duration::from_millis(2500), "{taken:?}");
}

#[test]
fn on_redis_a_replica_with_another_shard_count_or_without_shards_is_refused_with_exit_2() {
    let fleet = RedisFleet::new("mismatch");
    let journal = Journal::new("redis-shards-mismatch");
    another_count_or_a_plain_replica_is_refused_with_exit_2(&fleet, &journal);

    // And the other way round: a sharded replica beside a plain leader.
    let plain = fleet.plain("P", "echo P started; exec sleep 1000");
    plain.wait_stdout("P started");
    let sharded = fleet.replica("S", "2", &journal);
    assert_eq!(sharded.wait_code(), 2);
    sharded.wait_log("without --shards");
    assert!(started_shards(&sharded).is_empty());
    plain.signal(Signal::SIGTERM);
    // The plain replica's command was ended by the TERM passed on to it: 128 + 15.
    assert_eq!(plain.wait_code(), 143);
}

#[test]
fn the_acl_the_readme_documents_is_enough_for_shards() {
    let redis = Redis::new("shards-acl");
    redis.acl_user("minimal", "minimal-pw", &DOCUMENTED_ACL);
    let url = format!("redis://minimal:minimal-pw@127.0.0.1:{}", redis.port);
    let fleet = RedisFleet::new("acl");
    let journal = Journal::new("redis-shards-acl");
    let sharded = |tag: &str| fleet.run_on(&url, tag, &["--shards=2"], &shard_child(&journal, tag));
    let a = sharded("A");
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let b = sharded("B");
    b.wait_for_nth(Stream::Stdout, "B started", 1);
    // B's watcher hears A's end through PUBSUB NUMSUB, which the ACL allows.
    a.signal(Signal::SIGKILL);
    b.wait_for_nth(Stream::Stdout, "B started", 2);
    assert_no_overlap(&[&a, &b]);
    assert!(
        b.lines(Stream::Stderr)
            .iter()
            .all(|line| !line.contains("WARN")),
        "the documented ACL is enough for shards: {}",
        b.dump()
    );
    stop(&[&b]);
}

/// The client id of a replica's holder connection, from its card.
fn holder_client(lock: &str, member: &str) -> String {
    let card = Redis::shared().cli(&["GET", &format!("pgleader:{{{lock}}}:member:{member}")]);
    card.split(' ')
        .find_map(|word| word.strip_prefix("client="))
        .unwrap_or_else(|| panic!("no client in the card {card:?}"))
        .to_owned()
}

/// A replica of two shards that lost both: it joins again and runs both again, never two runs
/// of one at once; then it stops.
fn it_runs_both_shards_again(a: &Proc) {
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_no_overlap(&[a]);
    stop(&[a]);
}

#[test]
fn a_killed_holder_connection_stops_every_shard_s_command_at_once_not_at_the_next_check() {
    let lock = unique_name("clientkill");
    let journal = Journal::new("redis-shards-clientkill");
    // Checks a minute apart: only the connection's end can stop the commands within the waits.
    let args = [
        "--check-interval=60s",
        "--lease=90s",
        "--kill-timeout=5s",
        "--shards=2",
    ];
    let a = crate::harness::run_named(
        "A",
        &Redis::shared().url(),
        &lock,
        &args,
        &shard_child(&journal, "A"),
    );
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let joined = a.wait_log("joined the replicas");
    let client = holder_client(&lock, &field(&joined, "backend_pid"));
    let killed = std::time::Instant::now();
    assert_eq!(Redis::shared().cli(&["CLIENT", "KILL", "ID", &client]), "1");
    let lost = a.wait_log("lost every shard");
    assert!(lost.contains("closed the connection"), "{lost}");
    for shard in 0..2 {
        a.wait_log(&format!("the command of shard {shard} exited"));
    }
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "{:?}",
        killed.elapsed()
    );
    it_runs_both_shards_again(&a);
}

#[test]
fn a_deleted_shard_key_stops_only_that_shard_s_command_and_it_is_taken_again() {
    let fleet = RedisFleet::new("del");
    let a = fleet.replica("A", "3", &Journal::new("redis-shards-del"));
    a.wait_for_nth(Stream::Stdout, "A started", 3);
    let first: i64 = field(&a.wait_stdout("A started shard=1"), "epoch")
        .parse()
        .expect("an epoch");
    Redis::shared().cli(&["DEL", &format!("pgleader:{{{}}}:shard:1", fleet.lock)]);
    a.wait_log("no longer holds shard 1");
    a.wait_log("the command of shard 1 exited");
    // Free again, so taken again, under a greater epoch; the other shards never stopped.
    let again = a.wait_for_nth(Stream::Stdout, "A started shard=1", 2);
    assert!(field(&again, "epoch").parse::<i64>().expect("an epoch") > first);
    assert_eq!(commands_exited(&a), 1, "{}", a.dump());
    assert_no_overlap(&[&a]);
    stop(&[&a]);
}

#[test]
fn a_frozen_server_stops_every_shard_s_command_within_the_check_bound() {
    let redis = Redis::new("shards-frozen");
    let journal = Journal::new("redis-shards-frozen");
    let a = RedisFleet::new("frozen").run_on(
        &redis.url(),
        "A",
        &["--shards=2"],
        &shard_child(&journal, "A"),
    );
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    redis.freeze(true);
    let frozen = std::time::Instant::now();
    let lost = a.wait_log("lost every shard");
    let bound = frozen.elapsed();
    redis.freeze(false);
    // The check's own bound, or the deadline: either way a check, not the connection.
    assert!(lost.contains("check"), "{lost}");
    // check-interval + check-timeout is 700 ms; the lease (the keys' TTL) 60 s.
    assert!(bound < Duration::from_secs(3), "{bound:?}");
    it_runs_both_shards_again(&a);
}

/// What an operator sees of a sharded lock on Redis: `status` shows each shard's holder (the
/// keys' view), each replica's `/leader` answers 200 while a shard's command runs there, and the
/// per-shard metrics name the shard each replica holds.
#[test]
fn on_redis_status_http_and_metrics_show_which_replica_runs_which_shard() {
    let fleet = RedisFleet::new("seen");
    let lock = &fleet.lock;
    let journal = Journal::new("redis-shards-seen");
    let sharded = |tag: &str| {
        fleet.run(
            tag,
            &["--shards=2", "--http=127.0.0.1:0"],
            &shard_child(&journal, tag),
        )
    };
    let a = sharded("A");
    let a_http = address_of(&a);
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let b = sharded("B");
    let b_http = address_of(&b);
    b.wait_stdout("B started shard=1");

    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", Redis::shared().url())
        .args(["status", &format!("--lock={lock}")]);
    let status = Proc::spawn("status", command);
    assert_eq!(status.wait_code(), 0, "{}", status.dump());
    status_shows_each_shard_s_replica(status, 2, [&a, &b]);

    for (http, holds) in [(a_http, 0), (b_http, 1)] {
        assert_eq!(get(http, "/leader").status, 200);
        let metrics = get(http, "/metrics").body;
        for shard in 0..2 {
            let label = format!("shard=\"{shard}\"");
            assert_eq!(
                sample(&metrics, "pgleader_shard_held", &[&label]),
                f64::from(u8::from(shard == holds)),
                "{metrics}"
            );
        }
    }
    stop(&[&a, &b]);
    assert_no_overlap(&[&a, &b]);
}

/// The counter that hands out member ids can be lost (an eviction, a DEL) while members live:
/// a member that joins then never gets a live member's id, so no two members ever answer to one
/// id, and nobody takes or frees another's shards through it.
#[test]
fn a_lost_id_counter_never_hands_out_a_live_member_s_id() {
    let name = unique_name("ids");
    let backend = backend(&name);
    block_on(async {
        let a = alone_with_every_shard(&backend, 2).await;
        Redis::shared().cli(&["DEL", &format!("pgleader:{{{name}}}:ids")]);
        let n = join(&backend, 2).await;
        assert_ne!(n.id(), a.id(), "a live member's id was handed out again");
        assert_eq!(take_share(&n).await, BTreeSet::new());
        assert_eq!(
            holds(&a).await,
            BTreeSet::from([0, 1]),
            "A's shards are still A's"
        );
        within("leave", n.leave(WAIT)).await.expect("leave");
        assert_eq!(
            holds(&a).await,
            BTreeSet::from([0, 1]),
            "N's leaving left A alone"
        );
        within("leave", a.leave(WAIT)).await.expect("leave");
    });
}

/// A plain replica that started at the very moment a sharded one joined can pass the join's
/// check. The sharded replica's next roster read sees it (here a plain holder's value and its
/// connected liveness channel, as a plain replica would hold them), and it stops every command
/// and exits 2 rather than run beside it.
#[test]
fn on_redis_a_sharded_replica_that_finds_a_plain_one_beside_it_later_stops_and_exits_2() {
    let fleet = RedisFleet::new("late-plain");
    let lock = &fleet.lock;
    let a = fleet.replica("A", "2", &Journal::new("redis-shards-late-plain"));
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let nonce = "00000000feedbeef";
    let mut subscriber = std::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &Redis::shared().port.to_string()])
        .args(["SUBSCRIBE", &format!("pgleader:{{{lock}}}:alive:{nonce}")])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli");
    // Its first line is the subscription's confirmation.
    let mut confirmed = [0u8; 1];
    std::io::Read::read_exact(subscriber.stdout.as_mut().expect("stdout"), &mut confirmed)
        .expect("the subscription is confirmed");
    Redis::shared().cli(&[
        "SET",
        &format!("pgleader:{{{lock}}}"),
        &format!("nonce={nonce} epoch=1 since=1 client=1 session=plain:1@elsewhere"),
    ]);
    let refusal = it_stops_every_command_and_exits_2(&a);
    assert!(refusal.contains("session=plain:1@elsewhere"), "{refusal}");
    let _ = subscriber.kill();
    let _ = subscriber.wait();
    assert_no_overlap(&[&a]);
}
