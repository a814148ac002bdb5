//! What the PostgreSQL tests keep writing: a leader alone on a lock of its own, a leader with a
//! follower queued behind it, `status` on a lock, checks too slow to notice anything, a
//! password that must not show. Named once, a test reads as what it does to them.

use super::{Cluster, Proc, patient_child, pgleader, run, unique_lock};

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
