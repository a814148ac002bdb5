//! A sharded lock on PostgreSQL, at the library's level (`src/postgres/shards.rs`): the keys
//! are the documented ones, members share the shards out and hand a surplus over through the
//! server, the end of a member is heard by everyone at once through the watcher, and a replica
//! that runs the name otherwise is refused. Two sessions per replica, whatever the shard count.

use std::collections::BTreeSet;
use std::time::Duration;

use pgleader::election::Session;
use pgleader::election::lock::LockKey;
use pgleader::election::shards::Roster;
use pgleader::postgres::PgBackend;
use pgleader::postgres::shards::{JoinError, ShardHolder, ShardWatcher};

use crate::contract::{NoEnvironment, block_on, within};
use crate::harness::{Cluster, WAIT, unique_lock};

fn backend(lock: i64) -> PgBackend {
    let url = Cluster::shared().url();
    let (settings, _) = pgleader::postgres::conninfo::resolve(Some(&url), &NoEnvironment)
        .unwrap_or_else(|err| panic!("{url}: {err}"));
    PgBackend::new(
        settings,
        LockKey::from_id(lock),
        pgleader::election::lease::Lease::new(Duration::from_secs(15)),
        pgleader::postgres::ledger::TableName::parse("pgleader_runs").expect("a table name"),
        Duration::from_secs(1),
        Duration::from_secs(10),
    )
}

/// A key with both halves set, so that the space is their fold.
fn unique_key() -> i64 {
    (unique_lock() << 32) | 0x0bad_cafe
}

async fn join(backend: &PgBackend, shards: u32) -> ShardHolder {
    within(
        "join",
        ShardHolder::join(backend, "pgleader-shards-test", shards, None),
    )
    .await
    .unwrap_or_else(|err| panic!("join: {err}"))
}

/// Takes what the roster deals this member, and returns what it holds now.
async fn take_share(holder: &ShardHolder) -> BTreeSet<u32> {
    let seen = within("roster", holder.roster()).await.expect("roster");
    let moves = seen.roster.moves(holder.id());
    if !moves.take.is_empty() {
        let (won, fence) = within("take", holder.take(&moves.take))
            .await
            .expect("take");
        assert_eq!(won, moves.take, "free shards were taken by someone else");
        assert!(fence.is_some_and(|fence| fence.epoch > 0));
    }
    holds(holder).await
}

async fn holds(holder: &ShardHolder) -> BTreeSet<u32> {
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
async fn notified(holder: &mut ShardHolder, prefix: &str) -> String {
    within(&format!("a notification {prefix:?}"), async {
        loop {
            let payload = holder.notified().await.expect("the holder's connection");
            if payload.starts_with(prefix) {
                return payload;
            }
        }
    })
    .await
}

/// Runs a query on the harness' blocking client, off the runtime's thread.
async fn server_rows(sql: &'static str, key: i64, pid: i32) -> Vec<postgres::Row> {
    tokio::task::spawn_blocking(move || {
        let mut client = Cluster::shared().client();
        let params: Vec<&(dyn postgres::types::ToSql + Sync)> = if sql.contains("$2") {
            vec![&key, &pid]
        } else {
            vec![&key]
        };
        client.query(sql, &params).expect(sql)
    })
    .await
    .expect("the query's thread")
}

#[test]
fn the_locks_of_a_sharded_name_are_the_documented_keys_and_never_the_plain_one() {
    let key = unique_key();
    let backend = backend(key);
    block_on(async {
        let holder = join(&backend, 3).await;
        assert_eq!(take_share(&holder).await, BTreeSet::from([0, 1, 2]));
        let (pid, space) = (holder.id(), holder.keys().space());
        // The fold of the key's halves, as the module's documentation gives it in SQL.
        let documented: i32 = server_rows(
            "SELECT ((($1::int8 >> 32) # ($1::int8 & 4294967295)) & 4294967295)::bit(32)::int4",
            key,
            pid,
        )
        .await[0]
            .get(0);
        assert_eq!(space, documented);
        let rows = server_rows(
            "SELECT objid::int8, objsubid::int4, mode FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = $2 \
             AND classid = ((($1::int8 >> 32) # ($1::int8 & 4294967295)) & 4294967295)::oid \
             ORDER BY objid",
            key,
            pid,
        )
        .await;
        let locks: Vec<(i32, i32, String)> = rows
            .iter()
            .map(|row| (row.get::<_, i64>(0) as u32 as i32, row.get(1), row.get(2)))
            .collect();
        let mut expected = vec![
            (0, 2, "ExclusiveLock".to_owned()),
            (1, 2, "ExclusiveLock".to_owned()),
            (2, 2, "ExclusiveLock".to_owned()),
            (i32::MIN + 3, 2, "ShareLock".to_owned()),
            (-pid, 2, "ExclusiveLock".to_owned()),
        ];
        expected.sort_by_key(|(n, _, _)| *n as u32);
        assert_eq!(locks, expected);
        let plain: i64 = server_rows(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND classid = ($1::int8 >> 32)::oid AND objid = ($1::int8 & 4294967295)::oid",
            key,
            pid,
        )
        .await[0]
            .get(0);
        assert_eq!(plain, 0, "a shard took the plain key of the same name");
    });
}

#[test]
fn members_share_the_shards_out_and_a_surplus_goes_to_the_one_that_is_short() {
    let backend = backend(unique_key());
    block_on(async {
        let mut a = join(&backend, 4).await;
        assert_eq!(take_share(&a).await, BTreeSet::from([0, 1, 2, 3]));
        let mut b = join(&backend, 4).await;
        // B finds nothing free; A hears B join and gives its surplus away.
        assert_eq!(take_share(&b).await, BTreeSet::new());
        let joined = notified(&mut a, "joined").await;
        assert_eq!(joined, format!("joined {}", b.id()));
        let seen = within("roster", a.roster()).await.expect("roster");
        let moves = seen.roster.moves(a.id());
        assert_eq!(moves.give, vec![3, 2]);
        for shard in &moves.give {
            within("give", a.give(*shard)).await.expect("give");
        }
        notified(&mut b, "gave 2").await;
        assert_eq!(take_share(&b).await, BTreeSet::from([2, 3]));
        assert_eq!(holds(&a).await, BTreeSet::from([0, 1]));
        // Each replica holds its share on one session, whatever the count.
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
fn the_end_of_a_member_is_heard_by_its_watcher_and_told_to_every_member() {
    let backend = backend(unique_key());
    block_on(async {
        let mut a = join(&backend, 6).await;
        let b = join(&backend, 6).await;
        let mut c = join(&backend, 6).await;
        for holder in [&a, &b, &c] {
            take_share(holder).await;
        }
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(
            seen.roster.shares(),
            vec![2, 2, 2],
            "the roster {:?}",
            seen.roster
        );
        // Whoever's successor B is watches it, on a session of its own.
        let (watching, watcher_of_b) = if seen.roster.successor(a.id()) == Some(b.id()) {
            (
                "a",
                ShardWatcher::open(&backend, "pgleader-shards-watch").await,
            )
        } else {
            assert_eq!(seen.roster.successor(c.id()), Some(b.id()));
            (
                "c",
                ShardWatcher::open(&backend, "pgleader-shards-watch").await,
            )
        };
        let watcher = watcher_of_b.expect("the watcher connects");
        let watch = watcher.watch(b.id());
        tokio::pin!(watch);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut watch)
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
        // Both remaining members are told, whoever watched.
        for holder in [&mut a, &mut c] {
            assert_eq!(notified(holder, "gone").await, format!("gone {gone}"));
        }
        let seen = within("roster", a.roster()).await.expect("roster");
        assert_eq!(seen.roster.members.len(), 2);
        assert_eq!(seen.free(), b_holds.iter().copied().collect::<Vec<_>>());
        let a_takes = take_share(&a).await.len();
        let c_takes = take_share(&c).await.len();
        assert_eq!((a_takes, c_takes), (3, 3), "after B, watched by {watching}");
        assert!(heard < WAIT);
    });
}

#[test]
fn a_replica_with_another_shard_count_or_without_shards_is_refused() {
    let backend = backend(unique_key());
    let plain_backend = self::backend(unique_key());
    block_on(async {
        let a = join(&backend, 4).await;
        let refused = within(
            "join",
            ShardHolder::join(&backend, "pgleader-shards-test", 8, None),
        )
        .await;
        match refused {
            Err(JoinError::Mismatch(reason)) => {
                assert!(
                    reason.contains(&format!("server process {}", a.id())),
                    "{reason}"
                );
                assert!(reason.contains("--shards 4"), "{reason}");
                assert!(reason.contains("--shards 8"), "{reason}");
            }
            other => panic!("a replica with --shards 8 beside --shards 4 joined: {other:?}"),
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
            ShardHolder::join(&backend, "pgleader-shards-test", 2, None),
        )
        .await
        {
            Err(JoinError::Mismatch(reason)) => {
                assert!(reason.contains("without --shards"), "{reason}");
                assert!(
                    reason.contains(&format!("server process {}", plain.id())),
                    "{reason}"
                );
            }
            other => panic!("a sharded replica joined beside a plain one: {other:?}"),
        }
    });
}

#[test]
fn a_capped_member_holds_no_more_than_its_cap_and_the_others_share_the_rest() {
    let backend = backend(unique_key());
    block_on(async {
        let small = within(
            "join",
            ShardHolder::join(&backend, "pgleader-shards-test", 5, Some(1)),
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
