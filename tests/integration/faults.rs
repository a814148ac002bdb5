//! Faults beyond a clean loss: silent partitions, server restarts, standbys, poolers, a paused
//! leader. Each test injects a real fault and checks that two commands never run at once.

use crate::harness::{
    Cluster, Journal, Proxy, Stream, patient_child, run, run_with_url, unique_lock,
};

/// When a log line was written.
fn log_time(line: &str) -> std::time::SystemTime {
    let stamp = line.split_whitespace().next().unwrap_or_default();
    humantime::parse_rfc3339(stamp).unwrap_or_else(|err| panic!("no timestamp in {line:?}: {err}"))
}

#[test]
fn a_partitioned_leader_stops_its_command_before_the_server_frees_the_lock() {
    let cluster = Cluster::shared();
    let proxy = Proxy::start(cluster.port);
    let lock = unique_lock();
    let journal = Journal::new("partition");
    let a = run_with_url(
        "A",
        &proxy.url(),
        lock,
        &[
            "-v",
            "--check-interval=200ms",
            "--check-timeout=300ms",
            "--kill-timeout=1s",
            "--lease=3s",
        ],
        &format!(
            "trap '{}; echo A stopped; exit 0' TERM; {}; echo A started; while :; do sleep 1000 & wait $!; done",
            journal.append("A-stopped"),
            journal.append("A-started")
        ),
    );
    a.wait_stdout("A started");
    let b = run(
        "B",
        cluster,
        lock,
        &[],
        &format!(
            "{}; echo B started; exec sleep 1000",
            journal.append("B-started")
        ),
    );
    b.wait_log("waiting for the lock");
    a.wait_log("the session still holds the lock");

    proxy.freeze();
    let lost = a.wait_log("leadership lost");
    assert!(lost.contains("no successful check for 500ms"), "{lost}");
    a.wait_stdout("A stopped");
    b.wait_stdout("B started");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);

    // The leader's own deadline held: the command was being stopped no later than
    // check-interval + check-timeout after the last successful check (with slack for a busy
    // machine; the benchmarks measure the real figure).
    let checks = a.lines(Stream::Stderr);
    let last_check = checks
        .iter()
        .rfind(|line| line.contains("the session still holds the lock"))
        .expect("a successful check");
    let stopping = a.wait_log("stopping the command");
    let late = log_time(&stopping)
        .duration_since(log_time(last_check))
        .expect("stopping after the last check");
    assert!(
        late <= std::time::Duration::from_millis(500 + 1500),
        "stopping came {late:?} after the last good check"
    );
    // And the server freed the lock because of the lease, not because the connection broke.
    assert!(
        cluster.log().contains("idle-session timeout"),
        "{}",
        cluster.log()
    );
}

#[test]
fn a_cut_connection_stops_the_command_at_once() {
    let cluster = Cluster::shared();
    let proxy = Proxy::start(cluster.port);
    let a = run_with_url(
        "A",
        &proxy.url(),
        unique_lock(),
        &["--check-interval=60s", "--lease=90s"],
        &patient_child("A"),
    );
    a.wait_stdout("A started");
    proxy.cut();
    a.wait_stdout("A got TERM");
    let lost = a.wait_log("leadership lost");
    assert!(lost.contains("the connection ended"), "{lost}");
}
