//! A sharded lock on one Redis server, at the library's level (`src/redis/shards.rs`): the keys
//! are the documented ones, members share the shards out and hand a surplus over through the
//! server, renewal never re-creates a shard key that vanished, the end of a member's connection
//! is heard by its watcher and told to everyone, and a replica that runs the name otherwise is
//! refused.

use std::collections::BTreeSet;
use std::time::Duration;

use pgleader::election::Session;
use pgleader::election::lock::LockKey;
use pgleader::election::shards::{Holder, HolderEvent, JoinError, Roster, Watcher};
use pgleader::redis::RedisBackend;
use pgleader::redis::shards::{RedisShardHolder, RedisShardWatcher};

use nix::sys::signal::Signal;

use crate::contract::{block_on, within};
use crate::harness::http::{address_of, get};
use crate::harness::{Journal, Proc, Redis, Stream, WAIT, field, pgleader, unique_lock};
use crate::observability::sample;
use crate::shards::{assert_no_overlap, shard_child, sorted, started_shards};

fn backend(name: &str) -> RedisBackend {
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

fn unique_name(tag: &str) -> String {
    format!("shards-{tag}-{}", unique_lock())
}

async fn join(backend: &RedisBackend, shards: u32) -> RedisShardHolder {
    within(
        "join",
        RedisShardHolder::join(backend, "pgleader-shards-test", shards, None),
    )
    .await
    .unwrap_or_else(|err| panic!("join: {err}"))
}

/// Takes what the roster deals this member, and returns what it holds now.
async fn take_share(holder: &RedisShardHolder) -> BTreeSet<u32> {
    let seen = within("roster", holder.roster()).await.expect("roster");
    let to_take = seen.roster.to_take(holder.id());
    if !to_take.is_empty() {
        let (won, fence) = within("take", holder.take(&to_take)).await.expect("take");
        assert_eq!(won, to_take, "free shards were taken by someone else");
        assert!(fence.is_some_and(|fence| fence.epoch > 0));
    }
    holds(holder).await
}

async fn holds(holder: &RedisShardHolder) -> BTreeSet<u32> {
    let seen = within("roster", holder.roster()).await.expect("roster");
    member_holds(&seen.roster, holder.id())
}

fn member_holds(roster: &Roster, id: i32) -> BTreeSet<u32> {
    roster
        .members
        .iter()
        .find(|member| member.id == id)
        .unwrap_or_else(|| panic!("{id} is not on the roster {roster:?}"))
        .holds
        .clone()
}

/// Waits for a notification whose payload starts with `prefix`.
async fn notified(holder: &mut RedisShardHolder, prefix: &str) -> String {
    within(&format!("a notification {prefix:?}"), async {
        loop {
            match holder.next_event().await {
                HolderEvent::Notified(payload) if payload.starts_with(prefix) => return payload,
                HolderEvent::Notified(_) => {}
                HolderEvent::Ended(reason) => panic!("the holder's session ended: {reason}"),
            }
        }
    })
    .await
}

#[test]
fn the_keys_of_a_sharded_name_are_the_documented_ones_with_the_lease_as_ttl() {
    let name = unique_name("keys");
    let backend = backend(&name);
    let redis = Redis::shared();
    block_on(async {
        let holder = join(&backend, 3).await;
        assert_eq!(take_share(&holder).await, BTreeSet::from([0, 1, 2]));
        let me = holder.id();
        for shard in 0..3 {
            let key = format!("pgleader:{{{name}}}:shard:{shard}");
            let value = redis.cli(&["GET", &key]);
            assert!(
                value.contains(&format!(" member={me} ")) && value.starts_with("nonce="),
                "{key}: {value}"
            );
            let ttl: i64 = redis.cli(&["PTTL", &key]).parse().expect("a TTL");
            assert!(ttl > 10_000 && ttl <= 15_000, "{key}: PTTL {ttl}");
        }
        let card = redis.cli(&["GET", &format!("pgleader:{{{name}}}:member:{me}")]);
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
    let name = unique_name("largest");
    let backend = backend(&name);
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
        let mut a = join(&backend, 4).await;
        assert_eq!(take_share(&a).await, BTreeSet::from([0, 1, 2, 3]));
        let mut b = join(&backend, 4).await;
        // B finds nothing free; A hears B join and gives its surplus away.
        assert_eq!(take_share(&b).await, BTreeSet::new());
        let joined = notified(&mut a, "joined").await;
        assert_eq!(joined, format!("joined {}", b.id()));
        let seen = within("roster", a.roster()).await.expect("roster");
        let at = seen
            .roster
            .members
            .iter()
            .position(|member| member.id == a.id())
            .expect("A is a member");
        assert_eq!(seen.roster.shares()[at], 2);
        // Its surplus, from the top, as the room gives it.
        for shard in [3, 2] {
            within("give", a.give(shard)).await.expect("give");
        }
        notified(&mut b, "gave 2").await;
        assert_eq!(take_share(&b).await, BTreeSet::from([2, 3]));
        assert_eq!(holds(&a).await, BTreeSet::from([0, 1]));
        // A shard another member holds cannot be taken, nor given away by someone else.
        let (won, fence) = within("take", a.take(&[2])).await.expect("take");
        assert!(won.is_empty() && fence.is_none());
        assert!(within("give", a.give(3)).await.is_err());
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(seen.roster.members.len(), 2);
        assert!(seen.free().is_empty());
        // A member that leaves frees what it held and says so.
        let left = a.id();
        within("leave", a.leave(WAIT)).await.expect("leave");
        assert_eq!(notified(&mut b, "left").await, format!("left {left}"));
        assert_eq!(take_share(&b).await, BTreeSet::from([0, 1, 2, 3]));
    });
}

#[test]
fn each_take_hands_out_a_greater_epoch_than_every_earlier_one() {
    let backend = backend(&unique_name("epochs"));
    block_on(async {
        let a = join(&backend, 2).await;
        let (_, first) = within("take", a.take(&[0])).await.expect("take");
        within("give", a.give(0)).await.expect("give");
        let (_, second) = within("take", a.take(&[0, 1])).await.expect("take");
        let (first, second) = (first.expect("a fence"), second.expect("a fence"));
        assert!(second.epoch > first.epoch, "{first:?} then {second:?}");
    });
}

#[test]
fn a_shard_key_deleted_under_its_holder_is_lost_not_re_created() {
    let name = unique_name("deleted");
    let backend = backend(&name);
    let redis = Redis::shared();
    block_on(async {
        let a = join(&backend, 3).await;
        assert_eq!(take_share(&a).await, BTreeSet::from([0, 1, 2]));
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
        let mut a = join(&backend, 6).await;
        let b = join(&backend, 6).await;
        let mut c = join(&backend, 6).await;
        for holder in [&a, &b, &c] {
            take_share(holder).await;
        }
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(seen.roster.shares(), vec![2, 2, 2], "{:?}", seen.roster);
        let watcher = within(
            "the watcher",
            RedisShardWatcher::open(&backend, "pgleader-shards-watch"),
        )
        .await
        .expect("the watcher connects");
        let watch = watcher.watch(b.id());
        tokio::pin!(watch);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut watch)
                .await
                .is_err(),
            "the watch of a live member ended"
        );
        let gone = b.id();
        let b_holds = holds(&b).await;
        let ended = tokio::time::Instant::now();
        // Closing the connection, as a kill -9 does once the keeper lets go.
        drop(b);
        within("the watch", &mut watch)
            .await
            .unwrap_or_else(|err| panic!("the watch failed: {err}"));
        let heard = ended.elapsed();
        for holder in [&mut a, &mut c] {
            assert_eq!(notified(holder, "gone").await, format!("gone {gone}"));
        }
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(seen.roster.members.len(), 2);
        assert_eq!(seen.free(), b_holds.iter().copied().collect::<Vec<_>>());
        assert_eq!(take_share(&a).await.len(), 3);
        assert_eq!(take_share(&c).await.len(), 3);
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
        let a = join(&backend, 4).await;
        let refused = within(
            "join",
            RedisShardHolder::join(&backend, "pgleader-shards-test", 8, None),
        )
        .await;
        match refused {
            Err(JoinError::Mismatch(reason)) => {
                assert!(reason.contains(&format!("member {}", a.id())), "{reason}");
                assert!(reason.contains("--shards 4"), "{reason}");
                assert!(reason.contains("--shards 8"), "{reason}");
            }
            other => panic!("a replica with --shards 8 beside --shards 4 joined: {other:?}"),
        }
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

        // A plain replica of the same name holds its key: a sharded one refuses to join.
        let backend = plain_backend;
        let plain = pgleader::election::Backend::connect(&backend, "pgleader-plain")
            .await
            .expect("connect");
        assert!(plain.try_acquire().await.expect("try"));
        match within(
            "join",
            RedisShardHolder::join(&backend, "pgleader-shards-test", 2, None),
        )
        .await
        {
            Err(JoinError::Mismatch(reason)) => {
                assert!(reason.contains("without --shards"), "{reason}");
            }
            other => panic!("a sharded replica joined beside a plain one: {other:?}"),
        }
    });
}

#[test]
fn a_capped_member_holds_no_more_than_its_cap_and_the_others_share_the_rest() {
    let backend = backend(&unique_name("cap"));
    block_on(async {
        let small = within(
            "join",
            RedisShardHolder::join(&backend, "pgleader-shards-test", 5, Some(1)),
        )
        .await
        .expect("join");
        let big = join(&backend, 5).await;
        let seen = within("roster", small.roster()).await.expect("roster");
        let capped = seen
            .roster
            .members
            .iter()
            .find(|member| member.id == small.id())
            .expect("on the roster");
        assert_eq!(capped.cap, Some(1));
        assert_eq!(take_share(&small).await.len(), 1);
        assert_eq!(take_share(&big).await.len(), 4);
    });
}

// --- The binary: `pgleader run --shards K` against one Redis server. ---

/// Quick checks, and a lease long enough that only a dead connection (not a key's expiry) can
/// explain a shard moving within the test's waits.
const QUICK: [&str; 4] = [
    "--check-interval=200ms",
    "--check-timeout=500ms",
    "--lease=60s",
    "--kill-timeout=5s",
];

fn replica(tag: &str, lock: &str, shards: &str, journal: &Journal) -> Proc {
    let mut args = QUICK.to_vec();
    let shards = format!("--shards={shards}");
    args.push(&shards);
    crate::harness::run_named(
        tag,
        &Redis::shared().url(),
        lock,
        &args,
        &shard_child(journal, tag),
    )
}

/// The connections a replica keeps open on the server (its client names carry its pid).
fn connections_of(replica: &Proc) -> usize {
    Redis::shared()
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter(|line| line.contains(&format!(":{}@", replica.pid)))
        .count()
}

#[test]
fn replicas_share_the_shards_out_on_redis_and_a_surplus_is_handed_over_without_overlap() {
    let lock = unique_name("balance");
    let journal = Journal::new("redis-shards-balance");
    let a = replica("A", &lock, "4", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_eq!(sorted(started_shards(&a)), vec![0, 1, 2, 3]);
    let line = a.wait_stdout("A started shard=2");
    assert_eq!(field(&line, "shards"), "4");

    // B joins: A hands two shards over (its highest), each stopped before B starts it.
    let joined = std::time::Instant::now();
    let b = replica("B", &lock, "4", &journal);
    b.wait_for_nth(Stream::Stdout, "B started", 2);
    let balanced = joined.elapsed();
    assert_eq!(sorted(started_shards(&b)), vec![2, 3]);
    a.wait_log("handing shard 3 over");
    let epoch_of = |replica: &Proc, shard: u32| -> i64 {
        let line = replica.wait_stdout(&format!("started shard={shard}"));
        field(&line, "epoch").parse().expect("an epoch")
    };
    assert!(epoch_of(&b, 2) > epoch_of(&a, 2));

    // B is stopped: its shards go back to A at once.
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0);
    a.wait_for_nth(Stream::Stdout, "A started", 6);
    assert_eq!(sorted(started_shards(&a)[4..].to_vec()), vec![2, 3]);
    assert_no_overlap(&[&a, &b]);
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
    // Everything of the name is gone but the epoch and the id counter.
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
    let lock = unique_name("kill");
    let journal = Journal::new("redis-shards-kill");
    let a = replica("A", &lock, "6", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 6);
    let b = replica("B", &lock, "6", &journal);
    b.wait_for_nth(Stream::Stdout, "B started", 3);
    let c = replica("C", &lock, "6", &journal);
    c.wait_for_nth(Stream::Stdout, "C started", 2);
    a.wait_log("handing shard");
    let c_shards = started_shards(&c);

    // Two connections per replica, whatever K: the holder and the watcher.
    for replica in [&a, &b, &c] {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let connections = connections_of(replica);
            if connections == 2 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} keeps {connections} connections",
                replica.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    let killed = std::time::Instant::now();
    c.signal(Signal::SIGKILL);
    a.wait_for_nth(Stream::Stdout, "A started", 7);
    b.wait_for_nth(Stream::Stdout, "B started", 4);
    let taken = killed.elapsed();
    let retaken: Vec<u32> = [&a, &b]
        .iter()
        .flat_map(|replica| started_shards(replica).into_iter().rev().take(1))
        .collect();
    assert_eq!(
        sorted(retaken),
        sorted(c_shards),
        "C's shards were not the ones taken"
    );
    assert_no_overlap(&[&a, &b]);
    eprintln!("C's shards ran elsewhere {taken:?} after its kill -9");
    // A check interval is 200 ms; the lease (the keys' TTL) is 60 s.
    assert!(taken < Duration::from_secs(5), "{taken:?}");
    for replica in [&a, &b] {
        replica.signal(Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0);
    }
}

#[test]
fn on_redis_a_replica_with_another_shard_count_or_without_shards_is_refused_with_exit_2() {
    let lock = unique_name("mismatch");
    let journal = Journal::new("redis-shards-mismatch");
    let a = replica("A", &lock, "4", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    let b = replica("B", &lock, "8", &journal);
    assert_eq!(b.wait_code(), 2);
    let refusal = b.wait_log("--shards 8");
    assert!(refusal.contains("--shards 4"), "{refusal}");
    assert!(started_shards(&b).is_empty());
    // A plain replica of the same lock is refused too, and never runs its command.
    let plain = crate::harness::run_named(
        "P",
        &Redis::shared().url(),
        &lock,
        &QUICK,
        "echo P started; exec sleep 1000",
    );
    assert_eq!(plain.wait_code(), 2);
    let refusal = plain.wait_log("with --shards");
    assert!(refusal.contains(&format!("lock \"{lock}\"")), "{refusal}");
    assert!(plain.lines(Stream::Stdout).is_empty(), "{}", plain.dump());
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);

    // And the other way round: a sharded replica beside a plain leader.
    let plain = crate::harness::run_named(
        "P",
        &Redis::shared().url(),
        &lock,
        &QUICK,
        "echo P started; exec sleep 1000",
    );
    plain.wait_stdout("P started");
    let sharded = replica("S", &lock, "2", &journal);
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
    redis.cli(&[
        "ACL",
        "SETUSER",
        "minimal",
        "on",
        ">minimal-pw",
        "~pgleader:*",
        "&pgleader:*",
        "+@read",
        "+@write",
        "+@scripting",
        "+@pubsub",
        "+@blocking",
        "+time",
        "+info",
        "+client|id",
        "+client|setname",
        "+client|tracking",
    ]);
    let url = format!("redis://minimal:minimal-pw@127.0.0.1:{}", redis.port);
    let lock = unique_name("acl");
    let journal = Journal::new("redis-shards-acl");
    let mut args = QUICK.to_vec();
    args.push("--shards=2");
    let a = crate::harness::run_named("A", &url, &lock, &args, &shard_child(&journal, "A"));
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let b = crate::harness::run_named("B", &url, &lock, &args, &shard_child(&journal, "B"));
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
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0);
}

/// The client id of a replica's holder connection, from its card.
fn holder_client(lock: &str, member: &str) -> String {
    let card = Redis::shared().cli(&["GET", &format!("pgleader:{{{lock}}}:member:{member}")]);
    card.split(' ')
        .find_map(|word| word.strip_prefix("client="))
        .unwrap_or_else(|| panic!("no client in the card {card:?}"))
        .to_owned()
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
    // It joins again, and runs both shards again.
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_no_overlap(&[&a]);
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
}

#[test]
fn a_deleted_shard_key_stops_only_that_shard_s_command_and_it_is_taken_again() {
    let lock = unique_name("del");
    let journal = Journal::new("redis-shards-del");
    let a = replica("A", &lock, "3", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 3);
    let first: i64 = field(&a.wait_stdout("A started shard=1"), "epoch")
        .parse()
        .expect("an epoch");
    Redis::shared().cli(&["DEL", &format!("pgleader:{{{lock}}}:shard:1")]);
    a.wait_log("no longer holds shard 1");
    a.wait_log("the command of shard 1 exited");
    // Free again, so taken again, under a greater epoch; the other shards never stopped.
    let again = a.wait_for_nth(Stream::Stdout, "A started shard=1", 2);
    assert!(field(&again, "epoch").parse::<i64>().expect("an epoch") > first);
    let stopped: Vec<String> = a
        .lines(Stream::Stderr)
        .into_iter()
        .filter(|line| line.contains("the command of shard") && line.contains("exited"))
        .collect();
    assert_eq!(stopped.len(), 1, "{stopped:?}");
    assert_no_overlap(&[&a]);
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
}

#[test]
fn a_frozen_server_stops_every_shard_s_command_within_the_check_bound() {
    let redis = Redis::new("shards-frozen");
    let lock = unique_name("frozen");
    let journal = Journal::new("redis-shards-frozen");
    let mut args = QUICK.to_vec();
    args.push("--shards=2");
    let a = crate::harness::run_named("A", &redis.url(), &lock, &args, &shard_child(&journal, "A"));
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
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_no_overlap(&[&a]);
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
}

/// What an operator sees of a sharded lock on Redis: `status` shows each shard's holder (the
/// keys' view), each replica's `/leader` answers 200 while a shard's command runs there, and the
/// per-shard metrics name the shard each replica holds.
#[test]
fn on_redis_status_http_and_metrics_show_which_replica_runs_which_shard() {
    let lock = unique_name("seen");
    let journal = Journal::new("redis-shards-seen");
    let sharded = |tag: &str| {
        crate::harness::run_named(
            tag,
            &Redis::shared().url(),
            &lock,
            &[QUICK.as_slice(), &["--shards=2", "--http=127.0.0.1:0"]].concat(),
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
    let (_, out, _) = status.finish();
    let out = out.join("\n");
    assert!(
        out.contains(": 2 shards on 2 replicas, every shard held"),
        "{out}"
    );
    assert!(
        out.contains(&format!("\n  shard 0: pgleader {}@", a.pid)),
        "{out}"
    );
    assert!(
        out.contains(&format!("\n  shard 1: pgleader {}@", b.pid)),
        "{out}"
    );

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
    for replica in [&a, &b] {
        replica.signal(Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0, "{}", replica.dump());
    }
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
        let a = join(&backend, 2).await;
        assert_eq!(take_share(&a).await, BTreeSet::from([0, 1]));
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
    let lock = unique_name("late-plain");
    let journal = Journal::new("redis-shards-late-plain");
    let a = replica("A", &lock, "2", &journal);
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
    assert_eq!(a.wait_code(), 2, "{}", a.dump());
    let refusal = a.wait_log("without --shards");
    assert!(refusal.contains("session=plain:1@elsewhere"), "{refusal}");
    let exits = a
        .lines(Stream::Stderr)
        .iter()
        .filter(|line| line.contains("the command of shard") && line.contains("exited"))
        .count();
    assert_eq!(exits, 2, "both commands were stopped first\n{}", a.dump());
    let _ = subscriber.kill();
    let _ = subscriber.wait();
    assert_no_overlap(&[&a]);
}
