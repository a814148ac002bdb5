//! What the shard tests (`shards.rs` on PostgreSQL, `redis_shards.rs` on Redis) share: the
//! library's steps on any [`ShardBackend`] (join, take a share, hear a word), the scenarios
//! both backends must play out alike, and, for the binary, a [`Fleet`] of `pgleader run
//! --shards K` replicas with the checks that no shard's command ever ran twice at once. Each
//! backend's file keeps only what is peculiar to it (PostgreSQL's advisory locks, Redis' keys).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgleader::election::ledger::Definition;
use pgleader::election::lock::LockKey;
use pgleader::election::shards::{
    Holder, HolderEvent, Items, JoinError, Listing, Member, Roster, Seen, ShardBackend, Watcher,
};
use pgleader::election::{Backend, Session};

use super::{Journal, Proc, Stream, WAIT, field, overlaps_seen, within};

/// The name every holder of these tests gives its session.
const HOLDER_NAME: &str = "pgleader-shards-test";

/// What the job-guard tests of both backends share: a crontab fleet's items, jobs 7 and 9;
/// the key job `nightly`'s rows are kept under in the fleet of lock key `fleet` (the sharded
/// room's `jobs::job_key`: the fleet's key and the job's name apart by U+001F); and the
/// schedule its ledger records.
pub fn nightly_of_jobs_7_and_9(fleet: i64) -> (Items, LockKey, Definition) {
    let items = Items::Listed(Arc::new(Listing {
        items: BTreeSet::from([7, 9]),
        definitions: BTreeMap::new(),
    }));
    let job = LockKey::from_name(&format!("{fleet}\u{1f}nightly"));
    let definition = Definition {
        expression: "0 0 3 * * *".into(),
        timezone: "UTC".into(),
    };
    (items, job, definition)
}

/// Joins a roster of `shards` shards, with no cap.
pub async fn join<B: ShardBackend>(backend: &B, shards: u32) -> B::Holder {
    join_capped(backend, shards, None)
        .await
        .unwrap_or_else(|err| panic!("join: {err}"))
}

/// Joins a roster of `shards` shards, taking at most `cap`: the join's own answer.
pub async fn join_capped<B: ShardBackend>(
    backend: &B,
    shards: u32,
    cap: Option<u32>,
) -> Result<B::Holder, JoinError> {
    within(
        "join",
        backend.join(HOLDER_NAME, &Items::Numbered(shards), cap),
    )
    .await
}

/// A member alone on a roster of `shards` shards, which takes them all.
pub async fn alone_with_every_shard<B: ShardBackend>(backend: &B, shards: u32) -> B::Holder {
    let holder = join(backend, shards).await;
    assert_eq!(
        take_share(&holder).await,
        (0..shards).collect::<BTreeSet<_>>()
    );
    holder
}

/// Takes what the roster deals this member, and returns what it holds now.
pub async fn take_share<H: Holder>(holder: &H) -> BTreeSet<u32> {
    let seen = within("roster", holder.roster()).await.expect("roster");
    let to_take = seen.roster.to_take(holder.id());
    if !to_take.is_empty() {
        let (won, fence) = within("take", holder.take(&to_take)).await.expect("take");
        assert_eq!(won, to_take, "free shards were taken by someone else");
        assert!(fence.is_some_and(|fence| fence.epoch > 0));
    }
    holds(holder).await
}

/// The roster as `holder` reads it now.
pub async fn roster<H: Holder>(holder: &H) -> Seen {
    within("roster", holder.roster()).await.expect("roster")
}

pub async fn holds<H: Holder>(holder: &H) -> BTreeSet<u32> {
    member_holds(&roster(holder).await.roster, holder.id())
}

pub fn member_holds(roster: &Roster, id: i32) -> BTreeSet<u32> {
    member(roster, id).holds.clone()
}

/// Member `id` as the roster shows it.
pub fn member(roster: &Roster, id: i32) -> &Member {
    roster
        .members
        .iter()
        .find(|member| member.id == id)
        .unwrap_or_else(|| panic!("{id} is not on the roster {roster:?}"))
}

/// Waits for a notification whose payload starts with `prefix`.
pub async fn notified<H: Holder>(holder: &mut H, prefix: &str) -> String {
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

// --- Scenarios both backends play out alike. ---

/// A holds all four shards; B joins and finds none free; A hears it and gives its surplus away,
/// from the top as the room gives it, and B takes it. Returns A (holding 0 and 1) and B.
pub async fn a_surplus_goes_to_the_one_that_is_short<B: ShardBackend>(
    backend: &B,
) -> (B::Holder, B::Holder) {
    let mut a = alone_with_every_shard(backend, 4).await;
    let mut b = join(backend, 4).await;
    assert_eq!(take_share(&b).await, BTreeSet::new());
    let joined = notified(&mut a, "joined").await;
    assert_eq!(joined, format!("joined {}", b.id()));
    let seen = roster(&a).await;
    let at = seen
        .roster
        .members
        .iter()
        .position(|member| member.id == a.id())
        .expect("A is a member");
    assert_eq!(seen.roster.shares()[at], 2);
    // Both in one statement, said once.
    let given = within("give", a.give(&[3, 2])).await.expect("give");
    assert_eq!(
        given.into_iter().collect::<BTreeSet<_>>(),
        BTreeSet::from([2, 3])
    );
    assert_eq!(notified(&mut b, "gave").await, "gave 3 2");
    assert_eq!(take_share(&b).await, BTreeSet::from([2, 3]));
    assert_eq!(holds(&a).await, BTreeSet::from([0, 1]));
    (a, b)
}

/// Two members that hold every shard between them: the one that leaves frees what it held and
/// says so, and the other takes it all.
pub async fn a_member_that_leaves_frees_its_shards<H: Holder>(a: H, mut b: H) {
    let seen = roster(&a).await;
    assert_eq!(seen.roster.members.len(), 2);
    assert!(seen.free().is_empty());
    let left = a.id();
    within("leave", a.leave(WAIT)).await.expect("leave");
    assert_eq!(notified(&mut b, "left").await, format!("left {left}"));
    assert_eq!(take_share(&b).await, BTreeSet::from([0, 1, 2, 3]));
}

/// Three members of six shards, two each, and the roster they share.
pub async fn three_members_of_six_shards<B: ShardBackend>(backend: &B) -> ([B::Holder; 3], Seen) {
    let members = [
        join(backend, 6).await,
        join(backend, 6).await,
        join(backend, 6).await,
    ];
    for holder in &members {
        take_share(holder).await;
    }
    let seen = roster(&members[0]).await;
    assert_eq!(
        seen.roster.shares(),
        vec![2, 2, 2],
        "the roster {:?}",
        seen.roster
    );
    (members, seen)
}

/// B ends (its connection closed, as a kill -9 does once the keeper lets go): a watcher of
/// B's, quiet for `quiet` while B lives, hears it; A and C are both told and share B's shards
/// out. Returns how soon the watch heard it and how many shards A and C then hold.
pub async fn the_end_of_b_is_heard<B: ShardBackend>(
    backend: &B,
    [mut a, b, mut c]: [B::Holder; 3],
    quiet: Duration,
) -> (Duration, usize, usize) {
    let watcher = within("the watcher", backend.watcher("pgleader-shards-watch"))
        .await
        .expect("the watcher connects");
    let watch = watcher.watch(b.id());
    tokio::pin!(watch);
    assert!(
        tokio::time::timeout(quiet, &mut watch).await.is_err(),
        "the watch of a live member ended"
    );
    let gone = b.id();
    let b_holds = holds(&b).await;
    let ended = tokio::time::Instant::now();
    drop(b);
    within("the watch", &mut watch)
        .await
        .unwrap_or_else(|err| panic!("the watch failed: {err}"));
    let heard = ended.elapsed();
    for holder in [&mut a, &mut c] {
        assert_eq!(notified(holder, "gone").await, format!("gone {gone}"));
    }
    let seen = roster(&a).await;
    assert_eq!(seen.roster.members.len(), 2);
    assert_eq!(seen.free(), b_holds.iter().copied().collect::<Vec<_>>());
    let a_takes = take_share(&a).await.len();
    let c_takes = take_share(&c).await.len();
    (heard, a_takes, c_takes)
}

/// A member of four shards, beside which one of eight is refused. Returns the member and the
/// refusal, which names both counts.
pub async fn another_shard_count_is_refused<B: ShardBackend<Holder: Debug>>(
    backend: &B,
) -> (B::Holder, String) {
    let a = join(backend, 4).await;
    match join_capped(backend, 8, None).await {
        Err(JoinError::Mismatch(reason)) => {
            assert!(reason.contains("--shards 4"), "{reason}");
            assert!(reason.contains("--shards 8"), "{reason}");
            (a, reason)
        }
        other => panic!("a replica with --shards 8 beside --shards 4 joined: {other:?}"),
    }
}

/// A plain replica of the same name holds its key: a sharded one refuses to join. Returns the
/// plain session and the refusal.
pub async fn a_sharded_replica_beside_a_plain_one_is_refused<
    B: ShardBackend<Holder: Debug> + Backend,
>(
    backend: &B,
) -> (B::Session, String) {
    let plain = Backend::connect(backend, "pgleader-plain")
        .await
        .expect("connect");
    assert!(plain.try_acquire().await.expect("try"));
    match join_capped(backend, 2, None).await {
        Err(JoinError::Mismatch(reason)) => {
            assert!(reason.contains("without --shards"), "{reason}");
            (plain, reason)
        }
        other => panic!("a sharded replica joined beside a plain one: {other:?}"),
    }
}

/// A member capped at one shard of five holds one; the other takes the four left.
pub async fn a_capped_member_holds_no_more_than_its_cap<B: ShardBackend>(backend: &B) {
    let small = join_capped(backend, 5, Some(1)).await.expect("join");
    let big = join(backend, 5).await;
    let seen = roster(&small).await;
    assert_eq!(member(&seen.roster, small.id()).cap, Some(1));
    assert_eq!(take_share(&small).await.len(), 1);
    assert_eq!(take_share(&big).await.len(), 4);
}

// --- The binary: `pgleader run --shards K`. ---

/// A shard's command: before it starts it looks for a process that another run of the same
/// shard recorded and that is still alive (`<tag> overlap`), records its own pid, prints
/// `<tag> started shard=I shards=K epoch=E`, and becomes a sleep, which a TERM ends. (A shell
/// that traps TERM and waits for a child sleep can miss a TERM that comes while it forks the
/// sleep, and only the kill timeout ends it then.)
pub fn shard_child(journal: &Journal, tag: &str) -> String {
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

/// The shards a replica's command started on, in the order they started.
pub fn started_shards(replica: &Proc) -> Vec<u32> {
    replica
        .lines(Stream::Stdout)
        .iter()
        .filter(|line| line.contains(" started "))
        .map(|line| field(line, "shard").parse().expect("a shard number"))
        .collect()
}

pub fn sorted(mut shards: Vec<u32>) -> Vec<u32> {
    shards.sort_unstable();
    shards
}

pub fn assert_no_overlap(replicas: &[&Proc]) {
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

/// Ends each replica with a TERM, which it must answer by exiting 0.
pub fn stop(replicas: &[&Proc]) {
    for replica in replicas {
        replica.signal(nix::sys::signal::Signal::SIGTERM);
        assert_eq!(replica.wait_code(), 0, "{}", replica.dump());
    }
}

/// How many logged lines say that a shard's command exited.
pub fn commands_exited(replica: &Proc) -> usize {
    replica
        .lines(Stream::Stderr)
        .iter()
        .filter(|line| line.contains("the command of shard") && line.contains("exited"))
        .count()
}

/// The replicas of one sharded lock on one backend, as the binary's tests start them.
pub trait Fleet {
    /// Starts replica `tag` of `shards` shards, running [`shard_child`].
    fn replica(&self, tag: &str, shards: &str, journal: &Journal) -> Proc;
    /// Starts a plain replica (no --shards) of the same lock, running `script`.
    fn plain(&self, tag: &str, script: &str) -> Proc;
    /// The lock as pgleader's messages name it.
    fn lock_named(&self) -> String;
    /// How many sessions (connections) a replica keeps on the server.
    fn sessions_of(&self, replica: &Proc) -> usize;
}

/// Waits until each of `replicas` keeps two sessions on the server (its holder and its
/// watcher), as `sessions_of` counts them: a watcher given up for another may take a moment to
/// go.
pub fn wait_for_two_sessions_each(replicas: &[&Proc], sessions_of: impl Fn(&Proc) -> usize) {
    for replica in replicas {
        let deadline = Instant::now() + WAIT;
        loop {
            let sessions = sessions_of(replica);
            if sessions == 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} keeps {sessions} sessions",
                replica.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A alone runs all four shards; returns it and the line of its command on shard 2.
pub fn one_replica_runs_every_shard(fleet: &impl Fleet, journal: &Journal) -> (Proc, String) {
    let a = fleet.replica("A", "4", journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    assert_eq!(sorted(started_shards(&a)), vec![0, 1, 2, 3]);
    let line = a.wait_stdout("A started shard=2");
    assert_eq!(field(&line, "shards"), "4");
    (a, line)
}

/// B joins: A hands two shards over (its highest), each stopped before B starts it. Returns B
/// and how long after its start it ran its share.
pub fn a_second_replica_takes_the_surplus(
    fleet: &impl Fleet,
    journal: &Journal,
    a: &Proc,
) -> (Proc, Duration) {
    let joined = Instant::now();
    let b = fleet.replica("B", "4", journal);
    b.wait_for_nth(Stream::Stdout, "B started", 2);
    let balanced = joined.elapsed();
    assert_eq!(sorted(started_shards(&b)), vec![2, 3]);
    a.wait_log("handing shard 3 over");
    (b, balanced)
}

/// B's epochs are greater, a later take's; then B stops, and its shards go back to A at once.
pub fn the_surplus_goes_back_when_its_replica_stops(a: &Proc, b: &Proc) {
    let epoch_of = |replica: &Proc, shard: u32| -> i64 {
        let line = replica.wait_stdout(&format!("started shard={shard}"));
        field(&line, "epoch").parse().expect("an epoch")
    };
    assert!(epoch_of(b, 2) > epoch_of(a, 2));
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0);
    a.wait_for_nth(Stream::Stdout, "A started", 6);
    assert_eq!(sorted(started_shards(a)[4..].to_vec()), vec![2, 3]);
    assert_no_overlap(&[a, b]);
    stop(&[a]);
}

/// Three replicas of six shards, two each (A gave three, then one; B one), each on two
/// sessions whatever K (the holder and the watcher; one given up for another successor may
/// take a moment to leave the server's list). C is killed: its shards run on A and B. Returns
/// how soon.
pub fn a_killed_replica_s_shards_run_on_the_others(
    fleet: &impl Fleet,
    journal: &Journal,
) -> Duration {
    let a = fleet.replica("A", "6", journal);
    a.wait_for_nth(Stream::Stdout, "A started", 6);
    let b = fleet.replica("B", "6", journal);
    b.wait_for_nth(Stream::Stdout, "B started", 3);
    let c = fleet.replica("C", "6", journal);
    c.wait_for_nth(Stream::Stdout, "C started", 2);
    a.wait_log("handing shard");
    let c_shards = started_shards(&c);
    wait_for_two_sessions_each(&[&a, &b, &c], |replica| fleet.sessions_of(replica));

    let killed = Instant::now();
    c.signal(nix::sys::signal::Signal::SIGKILL);
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
    stop(&[&a, &b]);
    taken
}

/// Beside A, of four shards, a replica of eight exits 2 and runs nothing; so does a plain
/// replica of the same lock, which never runs its command. A then stops.
pub fn another_count_or_a_plain_replica_is_refused_with_exit_2(
    fleet: &impl Fleet,
    journal: &Journal,
) {
    let a = fleet.replica("A", "4", journal);
    a.wait_for_nth(Stream::Stdout, "A started", 4);
    let b = fleet.replica("B", "8", journal);
    assert_eq!(b.wait_code(), 2);
    let refusal = b.wait_log("--shards 8");
    assert!(refusal.contains("--shards 4"), "{refusal}");
    assert!(started_shards(&b).is_empty());
    let plain = fleet.plain("P", "echo P started; exec sleep 1000");
    assert_eq!(plain.wait_code(), 2);
    let refusal = plain.wait_log("with --shards");
    assert!(
        refusal.contains(&format!("lock {}", fleet.lock_named())),
        "{refusal}"
    );
    assert!(plain.lines(Stream::Stdout).is_empty(), "{}", plain.dump());
    a.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
}

/// A sharded replica, A, that found a plain holder of its lock beside it stops both its
/// commands first and exits 2; returns its refusal.
pub fn it_stops_every_command_and_exits_2(a: &Proc) -> String {
    assert_eq!(a.wait_code(), 2, "{}", a.dump());
    let refusal = a.wait_log("without --shards");
    assert_eq!(
        commands_exited(a),
        2,
        "both commands were stopped first\n{}",
        a.dump()
    );
    refusal
}

/// `pgleader status` of a lock of two shards, A's and B's, on `replicas` replicas: every
/// shard held, each by its replica. Returns what it printed.
pub fn status_shows_each_shard_s_replica(
    status: Proc,
    replicas: usize,
    [a, b]: [&Proc; 2],
) -> String {
    let (_, out, _) = status.finish();
    let out = out.join("\n");
    assert!(
        out.contains(&format!(
            ": 2 shards on {replicas} replicas, every shard held"
        )),
        "{out}"
    );
    for (shard, holder) in [a, b].into_iter().enumerate() {
        assert!(
            out.contains(&format!("\n  shard {shard}: pgleader {}@", holder.pid)),
            "{out}"
        );
    }
    out
}
