//! A sharded lock on PostgreSQL, at the library's level (`src/postgres/shards.rs`): the keys
//! are the documented ones, members share the shards out and hand a surplus over through the
//! server, the end of a member is heard by everyone at once through the watcher, and a replica
//! that runs the name otherwise is refused. Two sessions per replica, whatever the shard count.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use pgleader::election::Session;
use pgleader::election::lock::LockKey;
use pgleader::election::shards::{Holder, HolderEvent, JoinError, Roster, Watcher};
use pgleader::postgres::PgBackend;
use pgleader::postgres::shards::{ShardHolder, ShardWatcher};

use crate::contract::{NoEnvironment, block_on, within};
use nix::sys::signal::Signal;

use crate::election::snapshots;
use crate::harness::cluster::Options;
use crate::harness::http::{address_of, get, wait_for_status};
use crate::harness::{
    Cluster, Journal, Proc, Stream, WAIT, field, overlaps_seen, pgleader, run, unique_lock,
};
use crate::observability::{promtool, sample};

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
    let to_take = seen.roster.to_take(holder.id());
    if !to_take.is_empty() {
        let (won, fence) = within("take", holder.take(&to_take)).await.expect("take");
        assert_eq!(won, to_take, "free shards were taken by someone else");
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
            match holder.next_event().await {
                HolderEvent::Notified(payload) if payload.starts_with(prefix) => return payload,
                HolderEvent::Notified(_) => {}
                HolderEvent::Ended(reason) => panic!("the holder's session ended: {reason}"),
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
        // The hash of the key, as the documentation gives it in SQL.
        let documented: i32 = server_rows(
            "SELECT hashtextextended('pgleader shards ' || $1::int8, 0)::bit(32)::int4",
            key,
            pid,
        )
        .await[0]
            .get(0);
        assert_eq!(space, documented);
        let rows = server_rows(
            "SELECT objid::int8, objsubid::int4, mode FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = $2 \
             AND classid = (hashtextextended('pgleader shards ' || $1::int8, 0) & 4294967295)::oid \
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

// --- The binary: `pgleader run --shards K`. ---

/// A shard's command: before it starts it looks for a process that another run of the same
/// shard recorded and that is still alive (`<tag> overlap`), records its own pid, prints
/// `<tag> started shard=I shards=K epoch=E`, and becomes a sleep, which a TERM ends. (A shell
/// that traps TERM and waits for a child sleep can miss a TERM that comes while it forks the
/// sleep, and only the kill timeout ends it then.)
pub(crate) fn shard_child(journal: &Journal, tag: &str) -> String {
    let path = journal.path.display();
    format!(
        "for p in $(sed -n \"s/^run $PGLEADER_SHARD \\([0-9]*\\)$/\\1/p\" {path} 2>/dev/null); do \
           if kill -0 $p 2>/dev/null; then echo {tag} overlap shard=$PGLEADER_SHARD pid=$p; fi; \
         done; \
         echo \"run $PGLEADER_SHARD $$\" >> {path}; \
         echo {tag} started shard=$PGLEADER_SHARD shards=$PGLEADER_SHARDS epoch=$PGLEADER_EPOCH; \
         exec sleep 1000"
    )
}

fn replica(tag: &str, lock: i64, shards: &str, journal: &Journal) -> Proc {
    run(
        tag,
        Cluster::shared(),
        lock,
        &[&format!("--shards={shards}"), "--kill-timeout=5s"],
        &shard_child(journal, tag),
    )
}

/// The shards a replica's command started on, in the order they started.
pub(crate) fn started_shards(replica: &Proc) -> Vec<u32> {
    replica
        .lines(Stream::Stdout)
        .iter()
        .filter(|line| line.contains(" started "))
        .map(|line| field(line, "shard").parse().expect("a shard number"))
        .collect()
}

pub(crate) fn sorted(mut shards: Vec<u32>) -> Vec<u32> {
    shards.sort_unstable();
    shards
}

pub(crate) fn assert_no_overlap(replicas: &[&Proc]) {
    for replica in replicas {
        // Every command here exits on TERM: none should have needed SIGKILL.
        let killed: Vec<String> = replica
            .lines(Stream::Stderr)
            .into_iter()
            .filter(|line| line.contains("--kill-timeout"))
            .collect();
        assert!(
            killed.is_empty(),
            "{}: {killed:?}\n{}",
            replica.name,
            replica.dump()
        );
        let overlaps = overlaps_seen(replica);
        assert!(
            overlaps.is_empty(),
            "{}: a shard's command started while another run of it was alive: {overlaps:?}",
            replica.name
        );
    }
}

#[test]
fn replicas_share_the_shards_out_and_a_surplus_is_handed_over_without_overlap() {
    let lock = unique_lock();
    let journal = Journal::new("shards-balance");
    let a = replica("A", lock, "4", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_eq!(sorted(started_shards(&a)), vec![0, 1, 2, 3]);
    let line = a.wait_stdout("A started shard=2");
    assert_eq!(field(&line, "shards"), "4");
    assert!(field(&line, "epoch").parse::<i64>().expect("an epoch") > 0);

    // B joins: A hands two shards over (its highest), each stopped before B starts it.
    let b = replica("B", lock, "4", &journal);
    b.wait_for_nth(Stream::Stdout, "B started", 2);
    assert_eq!(sorted(started_shards(&b)), vec![2, 3]);
    a.wait_log("handing shard 3 over");
    let journal_lines = journal.lines();
    for shard in [2, 3] {
        let runs = journal_lines
            .iter()
            .filter(|line| line.starts_with(&format!("run {shard} ")))
            .count();
        assert_eq!(runs, 2, "{journal_lines:?}");
    }
    // Each replica's epochs: one per take, greater for the later take.
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
    // Every command was stopped, and its stop logged: A's six, B's two.
    for (replica, stopped) in [(&a, 6), (&b, 2)] {
        let exits = replica
            .lines(Stream::Stderr)
            .iter()
            .filter(|line| line.contains("the command of shard"))
            .filter(|line| line.contains("exited"))
            .count();
        assert_eq!(exits, stopped, "{}", replica.dump());
    }
}

#[test]
fn a_killed_replica_s_shards_run_on_the_others_at_once_on_two_connections_each() {
    let lock = unique_lock();
    let journal = Journal::new("shards-kill");
    let a = replica("A", lock, "6", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 6);
    let b = replica("B", lock, "6", &journal);
    b.wait_for_nth(Stream::Stdout, "B started", 3);
    let c = replica("C", lock, "6", &journal);
    c.wait_for_nth(Stream::Stdout, "C started", 2);
    // Balanced: two each (A gave three, then one; B one).
    a.wait_log("handing shard");
    let c_shards = started_shards(&c);

    // Two sessions per replica: the holder and the watcher (a watcher given up for another
    // successor may take a moment to leave the server's list).
    for replica in [&a, &b, &c] {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let sessions: i64 = Cluster::shared()
                .client()
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                    &[&format!("%:{}@%", replica.pid)],
                )
                .expect("pg_stat_activity")
                .get(0);
            if sessions == 2 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} keeps {sessions} sessions",
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
    for replica in [&a, &b] {
        replica.signal(Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0);
    }
}

#[test]
fn a_replica_with_another_shard_count_or_without_shards_is_refused_with_exit_2() {
    let lock = unique_lock();
    let journal = Journal::new("shards-mismatch");
    let a = replica("A", lock, "4", &journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    let b = replica("B", lock, "8", &journal);
    assert_eq!(b.wait_code(), 2);
    let refusal = b.wait_log("--shards 8");
    assert!(refusal.contains("--shards 4"), "{refusal}");
    assert!(started_shards(&b).is_empty());
    // A plain replica of the same lock is refused too, and never runs its command.
    let plain = run(
        "P",
        Cluster::shared(),
        lock,
        &[],
        "echo P started; exec sleep 1000",
    );
    assert_eq!(plain.wait_code(), 2);
    let refusal = plain.wait_log("with --shards");
    assert!(refusal.contains(&format!("lock {lock}")), "{refusal}");
    assert!(plain.lines(Stream::Stdout).is_empty(), "{}", plain.dump());
    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
}

/// Two replicas of different kinds that start at the very same moment can both pass the
/// other's check. A sharded replica that later sees the plain lock of its name held (here
/// taken by hand, as such a plain replica would hold it) stops every command and exits 2 rather
/// than run beside it.
#[test]
fn a_sharded_replica_that_finds_a_plain_one_beside_it_later_stops_and_exits_2() {
    let lock = unique_lock();
    let journal = Journal::new("shards-late-mismatch");
    let a = run(
        "A",
        Cluster::shared(),
        lock,
        &["--shards=2", "--kill-timeout=5s", "--check-interval=200ms"],
        &shard_child(&journal, "A"),
    );
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    let mut plain = Cluster::shared().client();
    plain
        .execute("SELECT pg_advisory_lock($1)", &[&lock])
        .expect("take the plain lock");
    assert_eq!(a.wait_code(), 2, "{}", a.dump());
    let refusal = a.wait_log("without --shards");
    assert!(refusal.contains(&format!("lock {lock}")), "{refusal}");
    let exits = a
        .lines(Stream::Stderr)
        .iter()
        .filter(|line| line.contains("the command of shard") && line.contains("exited"))
        .count();
    assert_eq!(exits, 2, "both commands were stopped first\n{}", a.dump());
    assert_no_overlap(&[&a]);
}

#[test]
fn shards_with_what_they_cannot_work_with_are_usage_errors_that_say_why() {
    let url = "postgres://postgres@127.0.0.1:1/postgres";
    let run = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["run".to_owned(), "--lock-id=1".to_owned()];
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        args.extend(["--".to_owned(), "true".to_owned()]);
        args
    };
    let cases: &[(&[&str], &str)] = &[
        (&["--shards=0"], "--shards <K>"),
        (&["--shards=4097"], "--shards <K>"),
        (&["--max-shards=2"], "--shards <K>"),
        (
            &["--shards=4", "--once"],
            "--shards cannot be used with --once: a replica's share",
        ),
        (
            &["--shards=4", "--no-wait"],
            "--shards cannot be used with --no-wait",
        ),
        (
            &["--shards=4", "--schedule=* * * * *"],
            "--shards cannot be used with --schedule yet: each occurrence once per shard",
        ),
        (
            &["--shards=4", "--relinquish-after=1h"],
            "shards already move between replicas",
        ),
        (
            &[
                "--shards=4",
                "--database-url=redis://127.0.0.1:1",
                "--database-url=redis://127.0.0.1:2",
                "--database-url=redis://127.0.0.1:3",
            ],
            "--shards cannot be used with a Redlock quorum",
        ),
    ];
    for (extra, expected) in cases {
        let args = run(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = crate::usage::outcome(Some(url), &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn signals_are_passed_on_to_every_shard_s_command() {
    let lock = unique_lock();
    // Each command ends on USR1 (a trap that let it loop on could fork its next sleep just as
    // the TERM below comes, which the sleep would miss).
    let script = "trap 'echo got USR1 shard=$PGLEADER_SHARD; exit 0' USR1; \
                  echo started shard=$PGLEADER_SHARD; \
                  sleep 1000 & wait";
    let replica = run(
        "A",
        Cluster::shared(),
        lock,
        &["--shards=3", "--restart-delay=1h"],
        script,
    );
    replica.wait_for_nth(Stream::Stdout, "started", 3);
    replica.signal(Signal::SIGUSR1);
    // Each command exited on its own: its shard stays here, to start again after the delay.
    for shard in 0..3 {
        replica.wait_stdout(&format!("got USR1 shard={shard}"));
        replica.wait_log(&format!(
            "starting the command of shard {shard} again in 1h"
        ));
    }
    assert!(
        !replica
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains("released shard")),
        "{}",
        replica.dump()
    );
    replica.signal(Signal::SIGTERM);
    assert_eq!(replica.wait_code(), 0);
}

#[test]
fn a_shard_whose_command_exits_starts_again_on_its_replica_after_the_restart_delay() {
    let lock = unique_lock();
    let script = "echo started shard=$PGLEADER_SHARD epoch=$PGLEADER_EPOCH; exit 3";
    let replica = run(
        "A",
        Cluster::shared(),
        lock,
        &["--shards=2", "--restart-delay=200ms"],
        script,
    );
    let first = replica.wait_stdout("started shard=1");
    let again = replica.wait_for_nth(Stream::Stdout, "started shard=1", 2);
    assert_eq!(field(&first, "epoch"), field(&again, "epoch"));
    replica.wait_log("starting the command of shard 1 again in 200ms");
    replica.signal(Signal::SIGTERM);
    assert_eq!(replica.wait_code(), 0);
    assert!(
        !replica
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains("released shard")),
        "{}",
        replica.dump()
    );
}

/// What an operator sees of a sharded lock. `status` shows which replica holds which shard (in
/// text and JSON, and `--watch` prints a line as shards move); each replica's `/status` lists
/// the shards it holds with their commands; `/leader` answers 200 on a replica where a shard's
/// command runs and 503 on one that holds none; the metrics carry a `shard` label, one holder
/// per shard summed over the replicas, and pass promtool's check.
#[test]
fn status_http_and_metrics_show_which_replica_runs_which_shard() {
    let lock = unique_lock();
    let journal = Journal::new("shards-seen");
    let status = |args: &[&str]| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", Cluster::shared().url())
            .args(["status", &format!("--lock-id={lock}")])
            .args(args);
        Proc::spawn("status", command)
    };
    let watch = status(&["--watch"]);
    watch.wait_stdout(": free; nobody waiting");
    let sharded = |tag: &str| {
        run(
            tag,
            Cluster::shared(),
            lock,
            &["--shards=2", "--kill-timeout=5s", "--http=127.0.0.1:0"],
            &shard_child(&journal, tag),
        )
    };
    let a = sharded("A");
    let a_http = address_of(&a);
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    watch.wait_stdout(&format!("2 shards: 0-1 pgleader {}@", a.pid));
    // B takes A's highest shard; C, the third replica of two shards, holds none.
    let b = sharded("B");
    let b_http = address_of(&b);
    b.wait_stdout("B started shard=1");
    let c = sharded("C");
    let c_http = address_of(&c);
    c.wait_log("joined the replicas");
    let line = watch.wait_stdout(&format!("none pgleader {}@", c.pid));
    // Replicas in the order of their ids (backend pids), each with its shards.
    assert!(
        line.contains(": 2 shards: ")
            && line.contains(&format!(" 0 pgleader {}@", a.pid))
            && line.contains(&format!(" 1 pgleader {}@", b.pid))
            && line.ends_with("; none free"),
        "{line}"
    );

    let backend_of = |replica: &Proc| -> i64 {
        field(&replica.wait_log("joined the replicas"), "backend_pid")
            .parse()
            .expect("a backend pid")
    };
    let text = status(&[]);
    assert_eq!(text.wait_code(), 0, "a sharded lock whose shards are held");
    let (_, out, _) = text.finish();
    let out = out.join("\n");
    assert!(
        out.contains(": 2 shards on 3 replicas, every shard held"),
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
    assert!(
        out.contains(&format!(
            "backend pid {}, pgleader pid {}",
            backend_of(&c),
            c.pid
        )) && out.contains(": no shard"),
        "{out}"
    );
    let json = status(&["--json"]);
    assert_eq!(json.wait_code(), 0);
    let (_, out, _) = json.finish();
    let report: serde_json::Value = serde_json::from_str(&out.join("\n")).expect("json");
    assert_eq!(report["shards"]["count"], 2, "{report}");
    assert_eq!(
        report["shards"]["holders"][0]["backend_pid"],
        backend_of(&a),
        "{report}"
    );
    assert_eq!(
        report["shards"]["holders"][1]["backend_pid"],
        backend_of(&b)
    );
    assert_eq!(report["shards"]["free"], serde_json::json!([]));

    // Each replica's own view.
    let a_status: serde_json::Value =
        serde_json::from_str(&get(a_http, "/status").body).expect("json");
    let held = &a_status["shards"]["held"];
    assert_eq!(a_status["shards"]["count"], 2, "{a_status}");
    assert_eq!(held.as_array().map(Vec::len), Some(1), "{a_status}");
    assert_eq!(held[0]["shard"], 0);
    assert_eq!(held[0]["command"]["state"], "running");
    let a_command = a.wait_stdout("A started shard=0");
    assert_eq!(
        held[0]["epoch"].to_string(),
        field(&a_command, "epoch"),
        "{a_status}"
    );
    assert_eq!(get(a_http, "/leader").status, 200);
    assert_eq!(get(b_http, "/leader").status, 200);
    let c_leader = get(c_http, "/leader");
    assert_eq!(c_leader.status, 503, "{c_leader:?}");
    let mut summed = [0.0; 2];
    for (http, holds) in [(a_http, Some(0)), (b_http, Some(1)), (c_http, None)] {
        let metrics = get(http, "/metrics").body;
        promtool(&["check", "metrics"], &metrics);
        assert_eq!(sample(&metrics, "pgleader_shards", &[]), 2.0);
        assert_eq!(
            sample(&metrics, "pgleader_shards_held", &[]),
            f64::from(u8::from(holds.is_some()))
        );
        for (shard, sum) in summed.iter_mut().enumerate() {
            let label = format!("shard=\"{shard}\"");
            let value = sample(&metrics, "pgleader_shard_held", &[&label]);
            assert_eq!(
                value,
                f64::from(u8::from(holds == Some(shard))),
                "{metrics}"
            );
            assert_eq!(
                sample(&metrics, "pgleader_shard_command_running", &[&label]),
                value
            );
            *sum += value;
        }
    }
    assert_eq!(summed, [1.0, 1.0], "one holder per shard");

    // A is killed: its shard moves to C, the replica short of its share.
    a.signal(Signal::SIGKILL);
    c.wait_stdout("C started shard=0");
    wait_for_status(c_http, "/leader", 200);
    watch.wait_stdout(&format!(" 0 pgleader {}@", c.pid));
    watch.signal(Signal::SIGTERM);
    assert_eq!(watch.wait_code(), 0);
    for replica in [&b, &c] {
        replica.signal(Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0, "{}", replica.dump());
    }
    assert_no_overlap(&[&b, &c]);
}

/// A sharded fleet holds back VACUUM no more than waiting followers do: the watchers wait in
/// turns of --wait-refresh, the holders hold no snapshot between statements. Rows deleted while
/// the fleet runs are removed, an index is built concurrently, no session of the fleet shows a
/// snapshot older than two turns, and the server logs nothing at ERROR or WARNING for it.
#[test]
fn a_sharded_fleet_holds_back_neither_vacuum_nor_create_index_concurrently() {
    const REFRESH: Duration = Duration::from_secs(1);
    let cluster = Cluster::with_options(
        "shards-vacuum",
        Options {
            settings: vec!["log_line_prefix = '%m [%p] %a: '".into()],
            ..Options::default()
        },
    );
    let lock = unique_lock();
    let journal = Journal::new("shards-vacuum");
    let mut client = cluster.client();
    client
        .batch_execute(
            "CREATE EXTENSION pgstattuple; CREATE TABLE t (i int); \
             INSERT INTO t SELECT generate_series(1, 1000)",
        )
        .expect("setting up the table (pgstattuple is in PostgreSQL's contrib)");
    let refresh = format!("--wait-refresh={}ms", REFRESH.as_millis());
    let replicas: Vec<Proc> = ["A", "B", "C"]
        .into_iter()
        .map(|tag| {
            let replica = run(
                tag,
                &cluster,
                lock,
                &["--shards=2", &refresh],
                &shard_child(&journal, tag),
            );
            replica.wait_log("joined the replicas");
            replica
        })
        .collect();
    // Three members: each one's watcher waits for another's membership.
    let deadline = Instant::now() + WAIT;
    while snapshots(&mut client)
        .iter()
        .filter(|(_, waits, _)| *waits)
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "the three watchers never waited");
        std::thread::sleep(Duration::from_millis(20));
    }

    client.batch_execute("DELETE FROM t").expect("delete");
    let deadline = Instant::now() + WAIT;
    loop {
        client.batch_execute("VACUUM t").expect("vacuum");
        let dead: i64 = client
            .query_one("SELECT dead_tuple_count FROM pgstattuple('t')", &[])
            .expect("pgstattuple")
            .get(0);
        if dead == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{dead} rows deleted beside the sharded fleet are still not removable after {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    client
        .batch_execute(&format!("SET statement_timeout = {}", WAIT.as_millis()))
        .expect("set statement_timeout");
    client
        .batch_execute("CREATE INDEX CONCURRENTLY t_i ON t (i)")
        .expect("CREATE INDEX CONCURRENTLY beside a sharded fleet");
    let watch_until = Instant::now() + REFRESH * 3;
    while Instant::now() < watch_until {
        for (pid, _, age) in snapshots(&mut client) {
            assert!(
                age < REFRESH.as_secs_f64() * 2.0,
                "backend {pid} has held its snapshot for {age:.1} s, past --wait-refresh \
                 {REFRESH:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Nothing at ERROR or WARNING. A watcher whose replica retargets it after a join is closed
    // in its wait, which the server logs once at FATAL, with the wait's statement: at most one
    // per watcher and join, never per turn.
    let log = cluster.log();
    let lines: Vec<&str> = log.lines().collect();
    let mut watchers_closed = 0;
    for (at, line) in lines.iter().enumerate() {
        if !line.contains(" pgleader") {
            continue;
        }
        assert!(
            !line.contains("ERROR:") && !line.contains("WARNING:"),
            "the server logged this for the fleet's sessions:\n{line}\n{log}"
        );
        if line.contains("FATAL:") {
            let context = lines.get(at + 1).copied().unwrap_or_default();
            assert!(
                // PostgreSQL 13 cannot tell that a waiting session's client went: the replica
                // ends it (pg_terminate_backend) instead.
                (line.ends_with("FATAL:  connection to client lost")
                    || line
                        .ends_with("FATAL:  terminating connection due to administrator command"))
                    && context.contains("pg_advisory_lock_shared"),
                "the server ended a session of the fleet other than a retargeted watcher:\n{log}"
            );
            watchers_closed += 1;
        }
    }
    assert!(
        watchers_closed <= 3,
        "{watchers_closed} watchers closed:\n{log}"
    );
    for replica in &replicas {
        replica.signal(Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0, "{}", replica.dump());
    }
    let replicas: Vec<&Proc> = replicas.iter().collect();
    assert_no_overlap(&replicas);
}
