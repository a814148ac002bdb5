//! `pgleader step-down` end to end, on PostgreSQL and on one Redis server: the leader stops
//! its command, releases, and stays on as a follower; the next replica leads; and every way
//! it can refuse has its documented exit code.

use std::time::{Duration, Instant};

use crate::harness::fleet::{Fleet, on_both_backends};
use crate::harness::{Cluster, Proc, Stream, patient_child, pgleader, unique_lock};

/// Checks quick enough that the pause before a stepped-down leader queues again is short.
const TIMINGS: [&str; 2] = ["--check-interval=200ms", "--kill-timeout=2s"];

/// A replica running a child that reports its start and its signals.
fn replica(fleet: &Fleet, tag: &str) -> Proc {
    fleet.replica(tag, &TIMINGS, &patient_child(tag))
}

/// A leads, and B waits behind it.
fn a_leader_and_a_follower(fleet: &Fleet) -> (Proc, Proc) {
    let a = replica(fleet, "A");
    a.wait_stdout("A started");
    let b = replica(fleet, "B");
    wait_for_waiters(fleet, 1);
    (a, b)
}

/// Waits until the server shows `n` replicas waiting behind the leader.
fn wait_for_waiters(fleet: &Fleet, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, out, _) = fleet.client("status", &["--json"]);
        let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
        let waiting = status["waiting"].as_array().map_or(0, Vec::len);
        if waiting >= n && !status["holder"].is_null() {
            return;
        }
        assert!(Instant::now() < deadline, "never {n} waiters: {status}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A steps down: B leads, A's command got its stop signal, and A is still there, waiting;
/// stepping B down then hands it back to A, which proves A queued again.
fn moves_leadership_and_the_old_leader_stays_a_follower(fleet: &Fleet) {
    let (a, b) = a_leader_and_a_follower(fleet);

    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains(&format!("led by pgleader {}@", a.pid))
            && out.contains(&format!("now led by pgleader {}@", b.pid)),
        "{out}"
    );
    a.wait_stdout("A got TERM");
    a.wait_log("asked to step down");
    b.wait_stdout("B started");
    a.wait_log("queueing again");
    assert!(!a.has_exited(), "{}", a.dump());

    wait_for_waiters(fleet, 1);
    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains(&format!("now led by pgleader {}@", a.pid)),
        "{out}"
    );
    b.wait_stdout("B got TERM");
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    assert!(!b.has_exited(), "{}", b.dump());
}

/// Alone, the leader is not asked at all: exit 4, and its command keeps running.
fn without_a_follower_the_leader_keeps_leading(fleet: &Fleet) {
    let a = replica(fleet, "A");
    a.wait_stdout("A started");
    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 4, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("keeps leading"), "{out}");
    let (code, out, _) = fleet.client("status", &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("pgleader pid {}", a.pid)), "{out}");
    assert!(!a.printed(Stream::Stdout, "got"), "{}", a.dump());
}

/// Nobody leads: exit 3.
fn without_a_leader_there_is_nothing_to_step_down(fleet: &Fleet) {
    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 3, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("no leader"), "{out}");
}

on_both_backends! { &Fleet::postgres(), &Fleet::redis("step-down");
    moves_leadership_and_the_old_leader_stays_a_follower:
        postgres_step_down_moves_leadership_and_the_old_leader_stays_a_follower,
        redis_step_down_moves_leadership_and_the_old_leader_stays_a_follower;
    without_a_follower_the_leader_keeps_leading:
        postgres_step_down_without_a_follower_leaves_the_leader_leading,
        redis_step_down_without_a_follower_leaves_the_leader_leading;
    without_a_leader_there_is_nothing_to_step_down:
        postgres_step_down_without_a_leader_exits_3,
        redis_step_down_without_a_leader_exits_3;
}

/// `--to` is refused before anything is asked: the leader keeps leading.
#[test]
fn to_is_refused_on_both_backends_and_the_leader_keeps_leading() {
    for fleet in [Fleet::postgres(), Fleet::redis("step-down")] {
        let (a, _b) = a_leader_and_a_follower(&fleet);
        let (code, out, err) = fleet.client("step-down", &["--to", "web-2"]);
        assert_eq!(code, 2, "stdout: {out}\nstderr: {err}");
        assert!(err.contains("--to web-2: a step-down cannot pick"), "{err}");
        let (_, out, _) = fleet.client("status", &[]);
        assert!(out.contains(&format!("pgleader pid {}", a.pid)), "{out}");
        assert!(!a.printed(Stream::Stdout, "got"), "{}", a.dump());
    }
}

#[test]
fn bad_input_to_step_down_is_a_usage_error() {
    let url = "postgres://postgres@127.0.0.1:1/postgres";
    let quorum = [
        "-d",
        "redis://127.0.0.1:1",
        "-d",
        "redis://127.0.0.1:2",
        "-d",
        "redis://127.0.0.1:3",
    ];
    let cases: &[(&[&str], &str)] = &[
        (
            &["step-down", "-d", url],
            "give --lock-id <ID> or --lock <NAME>",
        ),
        (
            &["step-down", "-d", url, "--lock-id", "1", "--timeout", "0s"],
            "must be greater than 0",
        ),
        (
            &[
                "step-down",
                "-d",
                url,
                "--lock-id",
                "1",
                "--timeout",
                "soon",
            ],
            "expected a duration",
        ),
        (
            &["step-down", "-d", url, "--lock-id", "1", "--lock", "x"],
            "cannot be used with",
        ),
        (
            &[&["step-down", "--lock", "x"][..], &quorum[..]].concat(),
            "not available on a Redlock quorum",
        ),
    ];
    for (args, expected) in cases {
        let (status, _, err) = Proc::spawn("step-down", {
            let mut command = pgleader();
            command.args(*args);
            command
        })
        .finish();
        let err = err.join("\n");
        assert_eq!(status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}
#[test]
fn on_postgres_a_request_from_a_session_of_another_role_is_ignored() {
    // NOTIFY needs no privilege: the leader checks who sent the request.
    let cluster = Cluster::shared();
    let role = format!("step_down_stranger_{}", unique_lock());
    cluster
        .client()
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .expect("create the role");
    let fleet = Fleet::postgres();
    let (a, _b) = a_leader_and_a_follower(&fleet);

    let stranger = Fleet {
        url: format!("postgres://{role}@127.0.0.1:{}/postgres", cluster.port),
        lock: fleet.lock.clone(),
    };
    let (code, out, err) = stranger.client("step-down", &["--timeout=2s"]);
    assert_eq!(code, 5, "stdout: {out}\nstderr: {err}");
    a.wait_log("ignored a step-down request");
    assert!(!a.printed(Stream::Stdout, "got TERM"), "{}", a.dump());
    // The leader's own role may.
    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let _ = cluster
        .client()
        .batch_execute(&format!("DROP ROLE IF EXISTS {role}"));
}

#[test]
fn a_handoff_slower_than_the_timeout_exits_5() {
    // A command that ignores TERM holds the handoff up to its --kill-timeout.
    let fleet = Fleet::postgres();
    let stubborn = |tag: &str| {
        fleet.replica(
            tag,
            &[
                "--check-interval=200ms",
                "--kill-timeout=10s",
                "--lease=20s",
            ],
            &format!(
                "trap 'echo {tag} got TERM' TERM; echo {tag} started; while :; do sleep 1; done"
            ),
        )
    };
    let a = stubborn("A");
    a.wait_stdout("A started");
    let _b = stubborn("B");
    wait_for_waiters(&fleet, 1);

    let (code, out, err) = fleet.client("step-down", &["--timeout=1s"]);
    assert_eq!(code, 5, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("did not move"), "{out}");
    a.wait_stdout("A got TERM");
}
