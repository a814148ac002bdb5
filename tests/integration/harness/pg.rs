//! What the PostgreSQL tests keep writing: a leader alone on a lock of its own, a leader with a
//! follower queued behind it, `status` on a lock, checks too slow to notice anything, a
//! password that must not show, the VACUUM check. Named once, a test reads as what it does to
//! them.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::cluster::Options;
use super::{Cluster, Proc, WAIT, patient_child, pgleader, run, unique_lock};

/// pgleader A running `script` with `args` on the shared cluster, on a lock no other test
/// uses: a leader with no rival, for what it does to its command.
pub fn leader(args: &[&str], script: &str) -> Proc {
    leader_on(unique_lock(), args, script)
}

/// pgleader A running `script` with `args` on `lock` of the shared cluster, for a test that
/// names the lock again (to a follower, to `status`, in what it expects).
pub fn leader_on(lock: i64, args: &[&str], script: &str) -> Proc {
    run("A", Cluster::shared(), lock, args, script)
}

/// pgleader A leading `lock` with a [`patient_child`], its command started (its line stays
/// readable with `a.wait_stdout("A started")`).
pub fn patient_leader(cluster: &Cluster, lock: i64) -> Proc {
    let a = run("A", cluster, lock, &[], &patient_child("A"));
    a.wait_stdout("A started");
    a
}

/// How many sessions (connections) pgleader process `replica` keeps on the shared cluster: those
/// whose application_name carries its pid (`<name>:<pid>@<host>`).
pub fn sessions_of(replica: &Proc) -> usize {
    let sessions: i64 = Cluster::shared()
        .client()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
            &[&format!("%:{}@%", replica.pid)],
        )
        .expect("pg_stat_activity")
        .get(0);
    sessions.try_into().expect("a count")
}

/// `pgleader status --lock-id=<lock> <args...>` against `cluster`.
pub fn status(name: &str, cluster: &Cluster, lock: i64, args: &[&str]) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .arg("status")
        .arg(format!("--lock-id={lock}"))
        .args(args);
    Proc::spawn(name, command)
}

/// A leading `lock` with a patient child (its command started), then B, running `script` with
/// `args`, queued behind it (it logged that it waits). Their lines stay readable with
/// `a.wait_stdout("A started")` and `b.wait_log("waiting for the lock")`.
pub fn leader_and_follower(
    cluster: &Cluster,
    lock: i64,
    args: &[&str],
    script: &str,
) -> (Proc, Proc) {
    let a = patient_leader(cluster, lock);
    let b = run("B", cluster, lock, args, script);
    b.wait_log("waiting for the lock");
    (a, b)
}

/// Asserts that `stderr` never shows `password`.
pub fn assert_password_hidden(stderr: &str, password: &str) {
    assert!(!stderr.contains(password), "the password leaked:\n{stderr}");
}

/// Checks a minute apart: only noticing the connection's end, not a check, can stop a command
/// within a test's waits.
pub const SLOW_CHECKS: [&str; 2] = ["--check-interval=60s", "--lease=90s"];

/// The server's view of pgleader's sessions (leaders, followers, status) that hold a snapshot:
/// (backend pid, whether it waits for a lock, seconds since its transaction began).
///
/// pg_stat_activity reads each backend's fields one by one, not at one instant: a session
/// caught between two turns can show its last snapshot's xmin with no transaction (a null
/// `xact_start`). It holds no snapshot then, so its age is 0.
pub fn snapshots(client: &mut postgres::Client) -> Vec<(i32, bool, f64)> {
    client
        .query(
            "SELECT pid, wait_event IS NOT DISTINCT FROM 'advisory', \
                    coalesce(extract(epoch FROM clock_timestamp() - xact_start)::float8, 0) \
               FROM pg_stat_activity \
              WHERE application_name LIKE 'pgleader%' AND backend_xmin IS NOT NULL",
            &[],
        )
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

/// A cluster of its own, `name`, for the VACUUM check, and a client on it: its log names each
/// line's session (`%m [%p] %a: `), so that a test reads what the server said of pgleader's
/// sessions and of no other test's, and it has a table `t` of 1000 rows and pgstattuple to
/// count the dead ones.
pub fn vacuum_cluster(name: &str) -> (Cluster, postgres::Client) {
    let cluster = Cluster::with_options(
        name,
        Options {
            settings: vec!["log_line_prefix = '%m [%p] %a: '".into()],
            ..Options::default()
        },
    );
    let mut client = cluster.client();
    client
        .batch_execute(
            "CREATE EXTENSION pgstattuple; CREATE TABLE t (i int); \
             INSERT INTO t SELECT generate_series(1, 1000)",
        )
        .expect("setting up the table (pgstattuple is in PostgreSQL's contrib)");
    (cluster, client)
}

/// The VACUUM check, beside pgleader's sessions on a [`vacuum_cluster`] that wait in turns of
/// `refresh` (`beside` names them in the messages): the rows of `t` deleted now are all removed
/// by VACUUM, and CREATE INDEX CONCURRENTLY finishes, each within [`WAIT`]; then, for three
/// turns, no session of pgleader's shows a snapshot two turns old. Returns the sessions seen
/// waiting for a lock meanwhile.
pub fn assert_vacuum_not_held_back(
    cluster: &Cluster,
    client: &mut postgres::Client,
    refresh: Duration,
    beside: &str,
) -> BTreeSet<i32> {
    // VACUUM removes the deleted rows once the snapshots taken before the delete are gone,
    // within a turn.
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
            "{dead} rows deleted beside {beside} are still not removable after {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // CREATE INDEX CONCURRENTLY waits for every snapshot older than its own to go: bounded
    // here, so that a session that held one would fail the test rather than hang it.
    client
        .batch_execute(&format!("SET statement_timeout = {}", WAIT.as_millis()))
        .expect("set statement_timeout");
    client
        .batch_execute("CREATE INDEX CONCURRENTLY t_i ON t (i)")
        .unwrap_or_else(|err| panic!("CREATE INDEX CONCURRENTLY beside {beside}: {err:?}"));
    // Three more turns: each snapshot the server shows is younger than a turn (with a turn's
    // margin for a loaded machine).
    let watch_until = Instant::now() + refresh * 3;
    let mut waiting = BTreeSet::new();
    while Instant::now() < watch_until {
        for (pid, waits, age) in snapshots(client) {
            if waits {
                waiting.insert(pid);
            }
            assert!(
                age < refresh.as_secs_f64() * 2.0,
                "backend {pid} has held its snapshot for {age:.1} s, past --wait-refresh \
                 {refresh:?}\n{}",
                cluster.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    waiting
}
