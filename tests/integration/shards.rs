//! A sharded lock on PostgreSQL, at the library's level (`src/postgres/shards/`): the keys
//! are the documented ones, members share the shards out and hand a surplus over through the
//! server, the end of a member is heard by everyone at once through the watcher, and a replica
//! that runs the name otherwise is refused. Two sessions per replica, whatever the shard count.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgleader::election::ledger::{Claim, Claimant, Ledger};
use pgleader::election::lock::LockKey;
use pgleader::election::shards::{Holder, Items, Listing, Seen, ShardBackend};
use pgleader::postgres::PgBackend;
use pgleader::postgres::ledger::PgLedger;

use crate::contract::{NoEnvironment, block_on};
use nix::sys::signal::Signal;

use crate::harness::http::{address_of, get, wait_for_status};
use crate::harness::pg::{assert_vacuum_not_held_back, snapshots, vacuum_cluster};
use crate::harness::shards::{
    Fleet, a_capped_member_holds_no_more_than_its_cap, a_killed_replica_s_shards_run_on_the_others,
    a_member_that_leaves_frees_its_shards, a_second_replica_takes_the_surplus,
    a_sharded_replica_beside_a_plain_one_is_refused, a_surplus_goes_to_the_one_that_is_short,
    alone_with_every_shard, another_count_or_a_plain_replica_is_refused_with_exit_2,
    another_shard_count_is_refused, assert_no_overlap, commands_exited,
    it_stops_every_command_and_exits_2, nightly_of_jobs_7_and_9, one_replica_runs_every_shard,
    shard_child, status_shows_each_shard_s_replica, stop, the_end_of_b_is_heard,
    the_surplus_goes_back_when_its_replica_stops, three_members_of_six_shards,
};
use crate::harness::{
    Cluster, Journal, Proc, Stream, WAIT, field, pgleader, run, unique_lock, within,
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
        let holder = alone_with_every_shard(&backend, 3).await;
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

/// A crontab member holds one markers digest (in the documented space), never two, and a
/// new one once its markers changed; another member's roster read follows each change, back
/// to the first file too (its markers are read again whenever the digest is not the one
/// they were kept under).
#[test]
fn a_crontab_member_holds_one_markers_digest_and_the_others_follow_its_rereads() {
    let key = unique_key();
    let backend = backend(key);
    let listing = |jobs: &[(u32, u32)]| {
        Items::Listed(Arc::new(Listing {
            items: jobs.iter().map(|(job, _)| *job).collect(),
            definitions: jobs.iter().copied().collect(),
        }))
    };
    let (first, second) = (listing(&[(7, 1), (9, 2)]), listing(&[(7, 1), (11, 3)]));
    block_on(async {
        let mut a = within("join", backend.join("cron-a", &first, None))
            .await
            .expect("join");
        let b = within("join", backend.join("cron-b", &first, None))
            .await
            .expect("join");
        let digests = |pid: i32| async move {
            let rows = server_rows(
                "SELECT objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND pid = $2 \
                 AND objsubid = 2 \
                 AND classid = (hashtextextended('pgleader markers ' || $1::int8, 0) & 4294967295)::oid",
                key,
                pid,
            )
            .await;
            rows.iter()
                .map(|row| row.get::<_, i64>(0))
                .collect::<Vec<_>>()
        };
        let knows = |seen: Seen, id: i32| {
            let member = seen.roster.members.into_iter().find(|m| m.id == id);
            let knows = member.and_then(|m| m.knows).expect("a crontab's member");
            knows.iter().copied().collect::<Vec<u32>>()
        };
        let at_first = digests(a.id()).await;
        assert_eq!(at_first.len(), 1, "{at_first:?}");
        let seen = within("roster", b.roster()).await.expect("roster");
        assert_eq!(knows(seen, a.id()), [7, 9]);
        for (items, expected) in [(&second, [7, 11]), (&first, [7, 9])] {
            within("set items", a.set_items(items.clone(), BTreeSet::new()))
                .await
                .expect("set items");
            let now = digests(a.id()).await;
            assert_eq!(now.len(), 1, "{now:?}");
            assert_eq!(now == at_first, items == &first, "{now:?} {at_first:?}");
            let seen = within("roster", b.roster()).await.expect("roster");
            assert_eq!(knows(seen, a.id()), expected);
        }
    });
}

#[test]
fn members_share_the_shards_out_and_a_surplus_goes_to_the_one_that_is_short() {
    let backend = backend(unique_key());
    block_on(async {
        let (a, b) = a_surplus_goes_to_the_one_that_is_short(&backend).await;
        // Each replica holds its share on one session, whatever the count: two members.
        a_member_that_leaves_frees_its_shards(a, b).await;
    });
}

#[test]
fn the_end_of_a_member_is_heard_by_its_watcher_and_told_to_every_member() {
    let backend = backend(unique_key());
    block_on(async {
        let ([a, b, c], seen) = three_members_of_six_shards(&backend).await;
        // Whoever's successor B is watches it, on a session of its own.
        let watching = if seen.roster.successor(a.id()) == Some(b.id()) {
            "a"
        } else {
            assert_eq!(seen.roster.successor(c.id()), Some(b.id()));
            "c"
        };
        // Both remaining members are told, whoever watched.
        let (heard, a_takes, c_takes) =
            the_end_of_b_is_heard(&backend, [a, b, c], Duration::from_millis(100)).await;
        assert_eq!((a_takes, c_takes), (3, 3), "after B, watched by {watching}");
        assert!(heard < WAIT);
    });
}

#[test]
fn a_replica_with_another_shard_count_or_without_shards_is_refused() {
    let backend = backend(unique_key());
    let plain_backend = self::backend(unique_key());
    block_on(async {
        let (a, reason) = another_shard_count_is_refused(&backend).await;
        assert!(
            reason.contains(&format!("server process {}", a.id())),
            "{reason}"
        );
        drop(a);
        let (plain, reason) = a_sharded_replica_beside_a_plain_one_is_refused(&plain_backend).await;
        assert!(
            reason.contains(&format!(
                "server process {}",
                pgleader::election::Session::id(&plain)
            )),
            "{reason}"
        );
    });
}

#[test]
fn a_capped_member_holds_no_more_than_its_cap_and_the_others_share_the_rest() {
    let backend = backend(unique_key());
    block_on(a_capped_member_holds_no_more_than_its_cap(&backend));
}

// --- The binary: `pgleader run --shards K`. ---

/// The replicas of one advisory lock on the shared cluster.
struct PgFleet {
    lock: i64,
}

impl Fleet for PgFleet {
    fn replica(&self, tag: &str, shards: &str, journal: &Journal) -> Proc {
        run(
            tag,
            Cluster::shared(),
            self.lock,
            &[&format!("--shards={shards}"), "--kill-timeout=5s"],
            &shard_child(journal, tag),
        )
    }

    fn plain(&self, tag: &str, script: &str) -> Proc {
        run(tag, Cluster::shared(), self.lock, &[], script)
    }

    fn lock_named(&self) -> String {
        self.lock.to_string()
    }

    fn sessions_of(&self, replica: &Proc) -> usize {
        crate::harness::pg::sessions_of(replica)
    }
}

#[test]
fn replicas_share_the_shards_out_and_a_surplus_is_handed_over_without_overlap() {
    let fleet = PgFleet {
        lock: unique_lock(),
    };
    let journal = Journal::new("shards-balance");
    let (a, line) = one_replica_runs_every_shard(&fleet, &journal);
    assert!(field(&line, "epoch").parse::<i64>().expect("an epoch") > 0);
    let (b, _) = a_second_replica_takes_the_surplus(&fleet, &journal, &a);
    let journal_lines = journal.lines();
    for shard in [2, 3] {
        let runs = journal_lines
            .iter()
            .filter(|line| line.starts_with(&format!("run {shard} ")))
            .count();
        assert_eq!(runs, 2, "{journal_lines:?}");
    }
    the_surplus_goes_back_when_its_replica_stops(&a, &b);
    // Every command was stopped, and its stop logged: A's six, B's two.
    for (replica, stopped) in [(&a, 6), (&b, 2)] {
        assert_eq!(commands_exited(replica), stopped, "{}", replica.dump());
    }
}

#[test]
fn a_killed_replica_s_shards_run_on_the_others_at_once_on_two_connections_each() {
    let fleet = PgFleet {
        lock: unique_lock(),
    };
    a_killed_replica_s_shards_run_on_the_others(&fleet, &Journal::new("shards-kill"));
}

#[test]
fn a_replica_with_another_shard_count_or_without_shards_is_refused_with_exit_2() {
    let fleet = PgFleet {
        lock: unique_lock(),
    };
    another_count_or_a_plain_replica_is_refused_with_exit_2(
        &fleet,
        &Journal::new("shards-mismatch"),
    );
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
    let refusal = it_stops_every_command_and_exits_2(&a);
    assert!(refusal.contains(&format!("lock {lock}")), "{refusal}");
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

/// A command that exits on its own keeps its shard on its replica: nothing was released.
fn assert_released_nothing(replica: &Proc) {
    assert!(
        !replica
            .lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains("released shard")),
        "{}",
        replica.dump()
    );
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
    assert_released_nothing(&replica);
    stop(&[&replica]);
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
    stop(&[&replica]);
    assert_released_nothing(&replica);
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
    let out = status_shows_each_shard_s_replica(text, 3, [&a, &b]);
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
    stop(&[&watch, &b, &c]);
    assert_no_overlap(&[&b, &c]);
}

/// Whether the session that logged `fatal` had just failed to send its last answer: a watcher
/// whose wait returned as its replica closed it. PostgreSQL then ends the session at its next
/// interrupt check, after the statement, so the FATAL comes without the statement beside it.
fn answered_as_it_closed(before: &[&str], fatal: &str) -> bool {
    // The prefix is `%m [%p] %a: `: the pid in brackets names the session.
    fn session(line: &str) -> Option<&str> {
        Some(line.split_once(" [")?.1.split_once(']')?.0)
    }
    let Some(pid) = session(fatal) else {
        return false;
    };
    before
        .iter()
        .rev()
        .find(|line| session(line) == Some(pid))
        .is_some_and(|line| line.contains("LOG:  could not send data to client"))
}

/// A sharded fleet holds back VACUUM no more than waiting followers do: the watchers wait in
/// turns of --wait-refresh, the holders hold no snapshot between statements. Rows deleted while
/// the fleet runs are removed, an index is built concurrently, no session of the fleet shows a
/// snapshot older than two turns, and the server logs nothing at ERROR or WARNING for it.
#[test]
fn a_sharded_fleet_holds_back_neither_vacuum_nor_create_index_concurrently() {
    const REFRESH: Duration = Duration::from_secs(1);
    let (cluster, mut client) = vacuum_cluster("shards-vacuum");
    let lock = unique_lock();
    let journal = Journal::new("shards-vacuum");
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

    assert_vacuum_not_held_back(&cluster, &mut client, REFRESH, "a sharded fleet");
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
                    && (context.contains("pg_advisory_lock_shared")
                        || answered_as_it_closed(&lines[..at], line)),
                "the server ended a session of the fleet other than a retargeted watcher:\n{log}"
            );
            watchers_closed += 1;
        }
    }
    assert!(
        watchers_closed <= 3,
        "{watchers_closed} watchers closed:\n{log}"
    );
    // So a session ended without its statement beside it was no holder's or member's either.
    for replica in &replicas {
        for loss in ["no longer holds shard", "lost every shard"] {
            assert!(
                !replica.printed(Stream::Stderr, loss),
                "{} lost a shard beside VACUUM",
                replica.name
            );
        }
    }
    let replicas: Vec<&Proc> = replicas.iter().collect();
    stop(&replicas);
    assert_no_overlap(&replicas);
}

/// A crontab job's ledger on PostgreSQL claims only while the holder session holds the job's
/// item lock: refused for an item nobody holds, after the item is given away, and taken again
/// once it is taken again. Each transaction of the session's group commit reads the session's
/// locks once, as it begins (`locks::record_held_locks`): two claims in one transaction, one
/// for a held item and one for an item not held, each get their own answer.
#[test]
fn a_job_s_claim_succeeds_only_while_its_session_holds_the_job_s_item_lock() {
    let lock = unique_key();
    let backend = backend(lock);
    let (items, job, definition) = nightly_of_jobs_7_and_9(lock);
    block_on(async {
        let a = within("join", backend.join("cron-a", &items, None))
            .await
            .expect("join");
        within("prepare", a.prepare_ledger())
            .await
            .expect("the ledger can be prepared");
        let (won, fence) = within("take", a.take(&[7])).await.expect("take");
        assert_eq!(won, vec![7]);
        let claimant = Claimant {
            host: "test".into(),
            pid: 1,
            epoch: fence.expect("a fence").epoch,
        };
        let ledger = a.ledger(&job, 7, &definition).expect("a ledger");
        let other = a.ledger(&job, 9, &definition).expect("a ledger");
        let now = within("time", ledger.server_time()).await.expect("time");
        let at = |n: i64| now + jiff::SignedDuration::from_millis(n - 100);
        let claim = |ledger: &PgLedger, n: i64| {
            let (ledger, claimant) = (ledger.clone(), claimant.clone());
            async move {
                within("claim", ledger.claim(at(n), Duration::ZERO, &claimant, 0))
                    .await
                    .expect("claim")
            }
        };
        // Asked for at one moment: one transaction, each claim answered for its own item.
        let (held, not_held) = tokio::join!(claim(&ledger, 0), claim(&other, 1));
        assert_eq!(held, Claim::Claimed { attempt: 1 });
        assert_eq!(
            not_held,
            Claim::NotLeader,
            "item 9 is nobody's: its job's claim is refused"
        );
        assert_eq!(within("give", a.give(&[7])).await.expect("give"), [7]);
        assert_eq!(claim(&ledger, 2).await, Claim::NotLeader, "given away");
        let recorded = within("record", ledger.record(at(3), "skipped", "x", &claimant)).await;
        assert!(!recorded.expect("record"), "given away: nothing recorded");
        within("take", a.take(&[7])).await.expect("take");
        assert_eq!(claim(&ledger, 4).await, Claim::Claimed { attempt: 1 });
        within("leave", a.leave(WAIT)).await.expect("leave");
    });
}
