//! The election itself: one leader runs the command, the others wait; keys; --once;
//! --no-wait; the child's environment; the election resuming after the command exits.

use nix::sys::signal::Signal;

use std::time::{Duration, Instant};

use crate::harness::pg::{
    assert_vacuum_not_held_back, leader, leader_and_follower, leader_on, patient_leader, status,
    vacuum_cluster,
};
use crate::harness::{
    Cluster, Proc, Stream, WAIT, field, kill_9, patient_child, pgleader, pid_field, poll_until,
    run, unique_lock,
};

/// The server's view of a lock: (backend pid, granted) for each session holding or waiting.
fn lock_rows(cluster: &Cluster, key: i64) -> Vec<(i32, bool)> {
    let classid = ((key as u64) >> 32) as u32;
    let objid = key as u64 as u32;
    cluster
        .client()
        .query(
            "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = $1 AND objid = $2 AND objsubid = 1 ORDER BY granted DESC",
            &[&classid, &objid],
        )
        .expect("read pg_locks")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

#[test]
fn the_leader_runs_the_command_and_a_follower_waits() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let (a, b) = leader_and_follower(cluster, lock, &[], &patient_child("B"));
    let started = a.wait_stdout("A started");
    let waiting = b.wait_log("waiting for the lock");

    // The server agrees: A's session holds the lock, B's waits for it.
    let a_backend = pid_field(&started, "backend");
    let b_backend = pid_field(&waiting, "backend_pid");
    // B logs that it waits as it sends its pg_advisory_lock: on a loaded machine the server
    // may list it a moment later.
    let deadline = std::time::Instant::now() + crate::harness::WAIT;
    let mut rows = lock_rows(cluster, lock);
    while rows.len() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
        rows = lock_rows(cluster, lock);
    }
    assert_eq!(rows, vec![(a_backend, true), (b_backend, false)]);
    assert!(
        b.lines(Stream::Stdout).is_empty(),
        "B ran its command while A leads"
    );

    a.terminate_cleanly();
    a.wait_stdout("A got TERM");
    b.wait_stdout("B started");
}

#[test]
fn the_command_learns_the_lock_its_session_and_a_fencing_epoch() {
    let cluster = Cluster::shared();
    let name = format!("nightly-{}", unique_lock());
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .args(["run", "--once", "--lock", &name, "--", "sh", "-c"])
        .arg("echo child lock=$PGLEADER_LOCK_ID name=$PGLEADER_LOCK_NAME backend=$PGLEADER_BACKEND_PID epoch=$PGLEADER_EPOCH");
    let first = Proc::spawn("first", command);
    let line = first.wait_stdout("child");
    assert_eq!(first.wait_code(), 0);

    let mut client = cluster.client();
    let expected: i64 = client
        .query_one("SELECT hashtextextended($1, 0)", &[&name])
        .expect("hash")
        .get(0);
    assert_eq!(
        field(&line, "lock"),
        expected.to_string(),
        "the key of --lock is hashtextextended(name, 0)"
    );
    assert_eq!(field(&line, "name"), name);
    let connected = first.wait_log("connected");
    assert_eq!(field(&line, "backend"), field(&connected, "backend_pid"));
    assert!(
        first
            .wait_log("became leader")
            .contains(&format!("backend_pid={}", field(&line, "backend")))
    );

    // A second leadership gets a larger epoch.
    let mut again = pgleader();
    again.env("PGLEADER_DATABASE_URL", cluster.url()).args([
        "run",
        "--once",
        "--lock",
        &name,
        "--",
        "sh",
        "-c",
        "echo child epoch=$PGLEADER_EPOCH",
    ]);
    let second = Proc::spawn("second", again);
    let second_line = second.wait_stdout("child");
    assert_eq!(second.wait_code(), 0);
    let epoch = |line: &str| field(line, "epoch").parse::<i64>().expect("epoch");
    assert!(
        epoch(&second_line) > epoch(&line),
        "{second_line} after {line}"
    );
}

#[test]
fn a_waiting_follower_holds_no_transaction_id_and_takes_its_epoch_after_the_grant() {
    let cluster = Cluster::shared();
    let (a, b) = leader_and_follower(cluster, unique_lock(), &[], &patient_child("B"));
    let a_line = a.wait_stdout("A started");
    let waiting = b.wait_log("waiting for the lock");
    let b_backend = pid_field(&waiting, "backend_pid");

    // B's statement waits for the lock and takes the fence once granted: while it waits, the
    // server shows it waiting on a lock, with no transaction id of its own.
    let mut client = cluster.client();
    let holds_no_xid: bool = poll_until(
        Duration::from_millis(10),
        || format!("B never waited on the server\n{}", b.dump()),
        || {
            client
                .query_opt(
                    "SELECT backend_xid IS NULL FROM pg_stat_activity \
                     WHERE pid = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
                    &[&b_backend],
                )
                .expect("read pg_stat_activity")
                .map(|row| row.get(0))
        },
    );
    assert!(holds_no_xid, "a waiting follower holds a transaction id");
    // A transaction id handed out while B waits: B's epoch, taken after the grant, is larger.
    let during_wait: i64 = client
        .query_one("SELECT pg_current_xact_id()::text::int8", &[])
        .expect("take a transaction id")
        .get(0);

    a.signal(Signal::SIGKILL);
    let b_line = b.wait_stdout("B started");
    let epoch = |line: &str| field(line, "epoch").parse::<i64>().expect("epoch");
    assert!(epoch(&a_line) < during_wait, "{a_line}");
    assert!(
        epoch(&b_line) > during_wait,
        "B's epoch {} was taken before its grant (a transaction id {during_wait} was handed out while it waited)",
        epoch(&b_line)
    );
}

#[test]
fn sessions_show_host_and_pid_in_pg_stat_activity() {
    let cluster = Cluster::shared();
    let a = patient_leader(cluster, unique_lock());
    let backend = pid_field(&a.wait_stdout("A started"), "backend");
    let name: String = cluster
        .client()
        .query_one(
            "SELECT application_name FROM pg_stat_activity WHERE pid = $1",
            &[&backend],
        )
        .expect("pg_stat_activity")
        .get(0);
    let host = nix::unistd::gethostname()
        .expect("hostname")
        .into_string()
        .expect("utf-8");
    assert_eq!(name, format!("pgleader:{}@{host}", a.pid));
}

#[test]
fn keys_beyond_32_bits_and_negative_keys_are_confirmed_on_the_right_pg_locks_row() {
    let cluster = Cluster::shared();
    let base = unique_lock();
    for key in [
        (1_i64 << 32) + base,
        -base,
        i64::MIN + base,
        i64::MAX - base,
    ] {
        let a = run(
            "A",
            cluster,
            key,
            &["-v", "--check-interval=50ms"],
            &patient_child("A"),
        );
        a.wait_stdout("A started");
        // Several checks pass: the check reads classid, objid and objsubid = 1 correctly.
        a.wait_for_nth(Stream::Stderr, "the session still holds the lock", 3);
        let rows = lock_rows(cluster, key);
        assert_eq!(rows.len(), 1, "key {key}: {rows:?}");
        assert!(rows[0].1, "key {key}: {rows:?}");

        // A key differing only in its high half is a different lock.
        let other = run(
            "other",
            cluster,
            key ^ (1 << 40),
            &["--once"],
            "echo other ran",
        );
        other.wait_stdout("other ran");
        assert_eq!(other.wait_code(), 0);

        // The same key is the same lock.
        let b = run(
            "B",
            cluster,
            key,
            &["--no-wait", "--busy-exit-code=9"],
            "echo B ran",
        );
        assert_eq!(b.wait_code(), 9, "key {key}");
        assert!(b.lines(Stream::Stdout).is_empty());
        a.signal(Signal::SIGTERM);
        assert_eq!(a.wait_code(), 0);
    }
}

#[test]
fn once_exits_with_the_commands_status() {
    let cluster = Cluster::shared();
    let exits = run("exits", cluster, unique_lock(), &["--once"], "exit 7");
    assert_eq!(exits.wait_code(), 7);
    exits.wait_log("released the lock");

    let killed = run(
        "killed",
        cluster,
        unique_lock(),
        &["--once"],
        "kill -KILL $$",
    );
    assert_eq!(killed.wait_code(), 128 + 9);
}

#[test]
fn no_wait_exits_with_the_busy_code_when_another_instance_leads() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = patient_leader(cluster, lock);

    let busy = run("busy", cluster, lock, &["--no-wait"], "echo busy ran");
    assert_eq!(busy.wait_code(), 0, "the default busy code is 0");
    busy.wait_log("another instance holds the lock");
    let busy_custom = run(
        "busy9",
        cluster,
        lock,
        &["--no-wait", "--busy-exit-code", "9"],
        "echo busy ran",
    );
    assert_eq!(busy_custom.wait_code(), 9);
    for process in [&busy, &busy_custom] {
        assert!(
            process.lines(Stream::Stdout).is_empty(),
            "{}",
            process.dump()
        );
    }

    a.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0);
    let free = run(
        "free",
        cluster,
        lock,
        &["--no-wait"],
        "echo free ran; exit 4",
    );
    free.wait_stdout("free ran");
    assert_eq!(free.wait_code(), 4);
}

#[test]
fn after_the_command_exits_the_lock_goes_to_the_next_waiting_replica() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = leader_on(lock, &["--restart-delay=1h"], "echo A ran; exec sleep 1000");
    a.wait_stdout("A ran");
    let b = run("B", cluster, lock, &[], &patient_child("B"));
    b.wait_log("waiting for the lock");

    // A's command ends on its own: A releases, B (already waiting) takes over, A waits out
    // its restart delay.
    let sleep_pid = pid_field(&a.wait_log("started the command"), "pid");
    kill_9(sleep_pid);
    a.wait_log("the command exited");
    a.wait_log("released the lock");
    a.wait_log("entering the election again in 1h");
    b.wait_stdout("B started");
}

#[test]
fn a_lone_replica_runs_the_command_again_after_the_restart_delay() {
    let a = leader(&["--restart-delay=0s"], "echo A ran");
    a.wait_for_nth(Stream::Stdout, "A ran", 3);
}

#[test]
fn status_reports_the_leader_and_the_waiters_in_order() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let status = |json: bool| {
        status(
            "status",
            cluster,
            lock,
            if json { &["--json"] } else { &[] },
        )
    };
    let free = status(false);
    assert_eq!(free.wait_code(), 3, "a free lock exits 3");
    let (_, out, _) = free.finish();
    assert!(out[0].ends_with(": free"), "{out:?}");

    let (a, b) = leader_and_follower(cluster, lock, &[], &patient_child("B"));
    let c = run("C", cluster, lock, &[], &patient_child("C"));
    c.wait_log("waiting for the lock");

    let held = status(true);
    assert_eq!(held.wait_code(), 0, "a held lock exits 0");
    let (_, out, _) = held.finish();
    let report: serde_json::Value = serde_json::from_str(&out.join("\n")).expect("json");
    assert_eq!(report["held"], true);
    assert_eq!(report["holder"]["pgleader_pid"], a.pid.as_raw());
    let waiting: Vec<_> = report["waiting"]
        .as_array()
        .expect("waiting")
        .iter()
        .map(|w| w["pgleader_pid"].clone())
        .collect();
    assert_eq!(
        waiting,
        vec![
            serde_json::json!(b.pid.as_raw()),
            serde_json::json!(c.pid.as_raw())
        ]
    );

    let text = status(false);
    assert_eq!(text.wait_code(), 0);
    let (_, out, _) = text.finish();
    assert!(
        out[1].contains(&format!("pgleader pid {}", a.pid)),
        "{out:?}"
    );
    assert!(
        out[2].contains("waiting #1: ") && out[2].contains(&format!("pgleader pid {}", b.pid)),
        "{out:?}"
    );
}

/// Checks that runs in the journal never overlap: every start follows the previous stop.
fn assert_turns(lines: &[String]) {
    for pair in lines.chunks(2) {
        if let [started, stopped] = pair {
            let tag = started
                .strip_suffix("-started")
                .unwrap_or_else(|| panic!("{lines:?}"));
            assert_eq!(
                stopped,
                &format!("{tag}-stopped"),
                "overlapping runs: {lines:?}"
            );
        }
    }
}

#[test]
fn replicas_take_turns_with_relinquish_after() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let journal = crate::harness::Journal::new("relinquish");
    let every_300ms = ["--relinquish-after=300ms"];
    let a = run("A", cluster, lock, &every_300ms, &journal.child("A", "0"));
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &every_300ms, &journal.child("B", "0"));
    b.wait_for_nth(Stream::Stdout, "B started", 2);
    a.wait_for_nth(Stream::Stdout, "A started", 3);
    a.wait_log("handing leadership over (--relinquish-after)");
    let lines = journal.lines();
    let starts: Vec<&str> = lines
        .iter()
        .filter_map(|line| line.strip_suffix("-started"))
        .take(4)
        .collect();
    assert_eq!(starts, ["A", "B", "A", "B"], "{lines:?}");
    assert_turns(&lines);
}

#[test]
fn a_lone_replica_leads_again_at_once_after_relinquishing() {
    let a = leader(&["--relinquish-after=200ms"], &patient_child("A"));
    a.wait_for_nth(Stream::Stdout, "A got TERM", 2);
    a.wait_for_nth(Stream::Stdout, "A started", 3);
}

#[test]
fn replicas_take_turns_on_a_relinquish_schedule() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let journal = crate::harness::Journal::new("schedule");
    let every_second = ["--relinquish-schedule", "* * * * * *"];
    let a = run("A", cluster, lock, &every_second, &journal.child("A", "0"));
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &every_second, &journal.child("B", "0"));
    b.wait_stdout("B started");
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    a.wait_log("handing leadership over (--relinquish-schedule)");
    assert_turns(&journal.lines());
}

#[test]
fn json_logs_carry_a_stable_set_of_fields() {
    let lock = unique_lock();
    let a = leader_on(lock, &["--log-format=json", "--once"], "echo ran; exit 3");
    assert_eq!(a.wait_code(), 3);
    let (_, _, stderr) = a.finish();
    let events: Vec<serde_json::Value> = stderr
        .iter()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}"))
        })
        .collect();
    for event in &events {
        for field in ["time", "level", "event", "message"] {
            assert!(event.get(field).is_some(), "no {field} in {event}");
        }
        let time = event["time"].as_str().expect("time is a string");
        humantime::parse_rfc3339(time).unwrap_or_else(|err| panic!("{time}: {err}"));
    }
    let find = |name: &str| {
        events
            .iter()
            .find(|event| event["event"] == name)
            .unwrap_or_else(|| panic!("no {name} event in {events:?}"))
    };
    assert_eq!(find("leader")["lock"], lock.to_string());
    assert!(find("leader")["epoch"].is_i64());
    assert!(find("child_started")["pid"].is_i64());
    let exited = find("child_exited");
    assert_eq!(exited["exit_code"], 3);
    assert_eq!(exited["status"], "exit code 3");
    assert_eq!(find("released")["level"], "info");
    assert_eq!(
        events
            .iter()
            .map(|event| event["event"].as_str().expect("event"))
            // PostgreSQL 13's warning (see versions.rs) comes on top of the usual sequence.
            .filter(|event| *event != "old_server")
            .collect::<Vec<_>>(),
        [
            "connected",
            "waiting",
            "leader",
            "child_started",
            "child_exited",
            "released"
        ]
    );
}

/// A follower waits in turns of --wait-refresh, each a transaction of its own: no snapshot of
/// a waiting follower outlives a turn, so VACUUM removes the rows deleted while followers wait,
/// in the very database they wait in, CREATE INDEX CONCURRENTLY there finishes, and the server
/// logs no error for the timeouts that end the turns (they are caught on the server). The
/// leader here is a scheduled one, writing its ledger every second, and `status --watch`
/// reads beside it: neither holds a snapshot for long either.
#[test]
fn waiting_followers_hold_back_neither_vacuum_nor_create_index_concurrently() {
    const REFRESH: Duration = Duration::from_secs(2);
    // A cluster of its own, so that its log holds only this test's sessions.
    let (cluster, mut client) = vacuum_cluster("vacuum");
    let lock = unique_lock();
    let refresh = format!("--wait-refresh={}ms", REFRESH.as_millis());
    let a = run(
        "A",
        &cluster,
        lock,
        &["--schedule=* * * * * *"],
        "echo A ran",
    );
    a.wait_stdout("A ran");
    let status = status("status", &cluster, lock, &["--watch"]);
    let followers = ["B", "C"].map(|name| {
        let follower = run(name, &cluster, lock, &[&refresh], &patient_child(name));
        follower.wait_log("waiting for the lock");
        follower
    });

    // Rows deleted while the followers wait are removed within a turn: no snapshot of theirs
    // holds them back for as long as they wait.
    let waiting = assert_vacuum_not_held_back(&cluster, &mut client, REFRESH, "waiting followers");
    assert_eq!(
        waiting.len(),
        2,
        "both followers were seen waiting: {waiting:?}"
    );
    for follower in &followers {
        assert!(
            follower.lines(Stream::Stdout).is_empty(),
            "a follower stopped waiting before VACUUM and the index were done\n{}",
            follower.dump()
        );
    }

    // The turns' lock timeouts were caught on the server: nothing from pgleader's sessions at
    // ERROR or worse in its log (a lock_timeout sent to the client would be logged at ERROR).
    let log = cluster.log();
    let complaints: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" pgleader"))
        .filter(|line| {
            ["ERROR:", "WARNING:", "FATAL:"]
                .iter()
                .any(|level| line.contains(level))
        })
        .collect();
    assert!(
        complaints.is_empty(),
        "the server logged these for pgleader's sessions:\n{}",
        complaints.join("\n")
    );

    status.signal(Signal::SIGTERM);
    status.wait_exit();
    a.terminate_cleanly();
    for follower in &followers {
        follower.signal(Signal::SIGTERM);
        follower.wait_exit();
    }
}

/// Timeouts set for the role or database end a statement on the server, and so would end a
/// follower's wait (and its turns) with an error: the session sets them to 0 for itself, and
/// the turns' own lock timeout is the only one that applies.
#[test]
fn a_follower_waits_through_the_timeouts_its_database_sets() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let db = format!("timeouts_{lock}");
    cluster.execute(&format!("CREATE DATABASE {db}"));
    let mut settings = vec![
        "statement_timeout",
        "lock_timeout",
        "idle_in_transaction_session_timeout",
    ];
    if cluster.server_major() >= 17 {
        settings.push("transaction_timeout");
    }
    for setting in settings {
        cluster.execute(&format!("ALTER DATABASE {db} SET {setting} = '200ms'"));
    }
    let on = |name: &str| {
        let mut command = pgleader();
        command
            .env(
                "PGLEADER_DATABASE_URL",
                format!("{}/{db}", cluster.url().rsplit_once('/').expect("a URL").0),
            )
            .arg("run")
            .arg(format!("--lock-id={lock}"))
            .arg("--wait-refresh=500ms")
            .args(["--", "sh", "-c", &patient_child(name)]);
        Proc::spawn(name, command)
    };
    let a = on("A");
    a.wait_stdout("A started");
    let b = on("B");
    let waiting = b.wait_log("waiting for the lock");
    let backend = pid_field(&waiting, "backend_pid");

    // Three turns of B's wait after its first, each a transaction of its own, all in the one
    // session.
    let mut client = cluster.client();
    let mut turns = std::collections::BTreeSet::new();
    let deadline = Instant::now() + WAIT;
    while turns.len() < 4 {
        assert!(
            Instant::now() < deadline,
            "B's wait did not turn three times within {WAIT:?}\n{}",
            b.dump()
        );
        let started: Option<String> = client
            .query_one(
                "SELECT xact_start::text FROM pg_stat_activity WHERE pid = $1",
                &[&backend],
            )
            .expect("B's session is still there")
            .get(0);
        turns.extend(started);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        b.lines(Stream::Stderr)
            .iter()
            .filter(|line| line.contains("connected"))
            .count(),
        1,
        "B's wait ended and it connected again\n{}",
        b.dump()
    );

    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    b.signal(Signal::SIGTERM);
    a.wait_exit();
    b.wait_exit();
    drop(client);
    cluster.execute(&format!("DROP DATABASE {db} WITH (FORCE)"));
}

/// The turns of a wait do not delay a grant: the server hands a released lock to the queued
/// follower at once, here one whose turn would end only in an hour.
#[test]
fn a_released_lock_is_taken_at_once_not_at_the_next_turn() {
    let cluster = Cluster::shared();
    let (a, b) = leader_and_follower(
        cluster,
        unique_lock(),
        &["--wait-refresh=1h"],
        &patient_child("B"),
    );
    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    b.signal(Signal::SIGTERM);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
}
