//! Faults beyond a clean loss: silent partitions, server restarts, standbys, poolers, a paused
//! leader. Each test injects a real fault and checks that two commands never run at once.

use std::time::{Duration, Instant};

use crate::harness::pg::{SLOW_CHECKS, leader};
use crate::harness::pgbouncer::PgBouncer;
use crate::harness::{
    Cluster, Journal, Proc, Proxy, Stream, WAIT, kill_9, log_time, patient_child, pid_field, run,
    run_with_url, unique_lock,
};

/// Timings that make a leader cut off from the server give up within half a second and the
/// server free its lock after three.
const QUICK_LEASE: [&str; 4] = [
    "--check-interval=200ms",
    "--check-timeout=300ms",
    "--kill-timeout=1s",
    "--lease=3s",
];

/// On PostgreSQL 13, where nothing frees the lock of a leader the server still seems to hear
/// from: `follower` starts nothing for the quick lease and two seconds more.
fn stays_waiting(follower: &Proc, while_what: &str) {
    let until = Instant::now() + Duration::from_secs(3 + 2);
    while Instant::now() < until {
        assert!(
            follower.lines(Stream::Stdout).is_empty(),
            "{} started while {while_what}: {}",
            follower.name,
            follower.dump()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
        &[QUICK_LEASE.as_slice(), &["-v"]].concat(),
        &format!(
            "trap '{}; echo A stopped; exit 0' TERM; {}; echo A started; while :; do sleep 1000 & wait $!; done",
            journal.append("A-stopped"),
            journal.append("A-started")
        ),
    );
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &[], &journal.quick_child("B"));
    b.wait_log("waiting for the lock");
    a.wait_log("the session still holds the lock");

    proxy.freeze();
    let lost = a.wait_log("leadership lost");
    assert!(lost.contains("no successful check for 500ms"), "{lost}");
    a.wait_stdout("A stopped");

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
        late <= Duration::from_millis(500 + 1500),
        "stopping came {late:?} after the last good check"
    );
    let backend = crate::harness::field(&a.wait_log("became leader"), "backend_pid");
    if cluster.server_major() < 14 {
        // PostgreSQL 13 has no idle_session_timeout, and the proxy's kernel answers the
        // server's keepalives: the server keeps A's lock for as long as the proxy keeps the
        // connection open, past the lease (pgleader warned about it at start). Only the
        // takeover waits; A's command was stopped on time all the same.
        a.wait_log("has no idle_session_timeout");
        stays_waiting(&b, "A's connection was still open");
        proxy.cut();
        b.wait_stdout("B started");
        assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
        return;
    }
    b.wait_stdout("B started");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
    // And the server freed the lock because of the lease, not because the connection broke:
    // it ended that very session (the server log's lines start with the backend's pid).
    let ended = format!("[{backend}] FATAL:  terminating connection due to idle-session timeout");
    assert!(
        cluster.log().contains(&ended),
        "no {ended:?} in:\n{}",
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
        &SLOW_CHECKS,
        &patient_child("A"),
    );
    a.wait_stdout("A started");
    proxy.cut();
    let lost = a.wait_lost_leadership();
    assert!(lost.contains("the connection ended"), "{lost}");
}

#[test]
fn a_transaction_mode_pooler_is_refused_with_a_clear_message() {
    let cluster = Cluster::shared();
    let pooler = PgBouncer::start(cluster, "transaction");
    let a = run_with_url("A", &pooler.url(), unique_lock(), &[], "echo A ran");
    assert_eq!(a.wait_code(), 1, "{}", a.dump());
    let error = a.wait_log("ERROR");
    assert!(error.contains("transaction-pooling proxy"), "{error}");
    assert!(error.contains("session-mode pool"), "{error}");
    assert!(
        a.lines(Stream::Stdout).is_empty(),
        "the command ran behind a transaction pooler"
    );
}

#[test]
fn only_a_connection_through_something_else_is_probed_for_a_transaction_pooler() {
    let cluster = Cluster::shared();
    // Direct: the server sees this very connection's two ends, so no probe connection.
    let direct = run(
        "direct",
        cluster,
        unique_lock(),
        &["--once", "-v"],
        "echo direct ran",
    );
    assert_eq!(direct.wait_code(), 0, "{}", direct.dump());
    direct.wait_log("nothing stands between, no pooler probe needed");
    assert!(
        !direct.printed(Stream::Stderr, "probing for"),
        "{}",
        direct.dump()
    );
    // Through a TCP proxy the server sees the proxy's ends: probed, and not a pooler.
    let proxy = Proxy::start(cluster.port);
    let proxied = run_with_url(
        "proxied",
        &proxy.url(),
        unique_lock(),
        &["--once", "-v"],
        "echo proxied ran",
    );
    assert_eq!(proxied.wait_code(), 0, "{}", proxied.dump());
    proxied.wait_log(
        "does not see this host's TCP connection (a proxy, NAT or a Unix socket): probing",
    );
    proxied.wait_stdout("proxied ran");
    // A Unix socket tells nothing of the kind: probed, the probe's connection opened alongside.
    let socket = format!(
        "host={} port={} user=postgres dbname=postgres",
        cluster.socket_dir.display(),
        cluster.port
    );
    let local = run_with_url(
        "local",
        &socket,
        unique_lock(),
        &["--once", "-v"],
        "echo local ran",
    );
    assert_eq!(local.wait_code(), 0, "{}", local.dump());
    local.wait_log("a Unix socket: probing for a transaction pooler");
    local.wait_stdout("local ran");
}

#[test]
fn a_session_mode_pool_works_and_frees_the_lock_of_a_killed_leader() {
    let cluster = Cluster::shared();
    let pooler = PgBouncer::start(cluster, "session");
    let lock = unique_lock();
    let a = run_with_url("A", &pooler.url(), lock, &[], &patient_child("A"));
    a.wait_stdout("A started");
    let b = run_with_url("B", &pooler.url(), lock, &[], &patient_child("B"));
    b.wait_log("waiting for the lock");
    // PgBouncer resets the server connection (DISCARD ALL) when its client goes away, which
    // releases the session's advisory locks.
    a.signal(nix::sys::signal::Signal::SIGKILL);
    b.wait_stdout("B started");
}

#[test]
fn a_standby_is_never_led_through_and_a_host_list_finds_the_primary() {
    let primary = Cluster::new("primary");
    let standby = Cluster::standby_of(&primary, "standby");
    let lock = unique_lock();

    let on_standby = run_with_url(
        "on-standby",
        &standby.url(),
        lock,
        &[],
        "echo ran on the standby",
    );
    on_standby.wait_for_nth(Stream::Stderr, "the server is a standby (in recovery)", 2);
    on_standby.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(on_standby.wait_code(), 0);
    assert!(on_standby.lines(Stream::Stdout).is_empty());

    // The standby first, the primary second: pgleader skips the standby.
    let hosts = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        standby.port, primary.port
    );
    let a = run_with_url("A", &hosts, lock, &[], &patient_child("A"));
    let started = a.wait_stdout("A started");
    let backend = pid_field(&started, "backend");
    let on_primary: i64 = primary
        .client()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
            &[&backend],
        )
        .expect("pg_stat_activity")
        .get(0);
    assert_eq!(on_primary, 1, "the leader's session is not on the primary");
}

#[test]
fn a_host_that_takes_the_connection_but_never_answers_is_passed_over_for_the_next() {
    // libpq's connect_timeout bounds each host's whole attempt, the handshake included: a
    // server that accepts and then says nothing (here a frozen proxy) must not keep pgleader
    // from the next host in the list.
    let cluster = Cluster::shared();
    let silent = Proxy::start(cluster.port);
    silent.freeze();
    let hosts = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?connect_timeout=2",
        silent.port(),
        cluster.port
    );
    let a = run_with_url("A", &hosts, unique_lock(), &[], &patient_child("A"));
    a.wait_stdout("A started");
}

#[test]
fn after_a_failover_the_leader_follows_the_promoted_standby() {
    let primary = Cluster::new("primary");
    let standby = Cluster::standby_of(&primary, "standby");
    let hosts = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    );
    let a = run_with_url("A", &hosts, unique_lock(), &[], &patient_child("A"));
    a.wait_stdout("A started");

    primary.stop();
    a.wait_stdout("A got TERM");
    a.wait_log("cannot connect; retrying");
    standby.promote();
    a.wait_for_nth(Stream::Stdout, "A started", 2);
}

/// Waits until one of several processes prints a new stdout line containing `needle` (beyond
/// the ones each had printed when `before` was taken); returns that process.
fn next_to_print<'a>(processes: &[&'a Proc], needle: &str, before: &[usize]) -> &'a Proc {
    let count = |process: &Proc| {
        process
            .lines(Stream::Stdout)
            .iter()
            .filter(|line| line.contains(needle))
            .count()
    };
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(index) = (0..processes.len()).find(|&i| count(processes[i]) > before[i]) {
            return processes[index];
        }
        assert!(
            Instant::now() < deadline,
            "nobody printed {needle:?}:\n{}",
            processes.iter().map(|p| p.dump()).collect::<String>()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn after_a_server_restart_a_new_leader_starts_only_once_the_old_command_must_be_gone() {
    let cluster = Cluster::new("restart");
    let lock = unique_lock();
    let journal = Journal::new("restart");
    let timings = [QUICK_LEASE.as_slice(), &["--restart-fence=auto"]].concat();
    let a = run("A", &cluster, lock, &timings, &journal.child("A", "0"));
    // The server has just started: even the first leader waits out the fence.
    a.wait_log("(--restart-fence)");
    a.wait_stdout("A started");
    let b = run("B", &cluster, lock, &timings, &journal.child("B", "0"));
    b.wait_log("waiting for the lock");

    cluster.stop();
    a.wait_log("leadership lost");
    // The server stays down for a few seconds: several rounds of reconnection attempts.
    for process in [&a, &b] {
        process.wait_for_nth(Stream::Stderr, "cannot connect; retrying", 6);
    }
    assert_eq!(journal.lines(), ["A-started", "A-stopped"]);
    let before = [1, 0];
    cluster.start();

    let winner = next_to_print(&[&a, &b], "started", &before);
    let tag = &winner.name;
    let fence = winner.wait_for_nth(
        Stream::Stderr,
        "(--restart-fence)",
        if tag == "A" { 2 } else { 1 },
    );
    assert!(fence.contains("starting the command in"), "{fence}");
    let lines = journal.lines();
    assert_eq!(lines[..2], ["A-started", "A-stopped"]);
    assert_eq!(lines[2], format!("{tag}-started"));
}

#[test]
fn takeover_delay_keeps_the_next_command_clear_of_a_terminated_leaders_shutdown() {
    let cluster = Cluster::shared();
    let journal = Journal::new("takeover");
    // The old command takes a second to shut down.
    // Without a takeover delay, the lock is free the moment the server ends the leader's
    // session, and the next command starts while the old one is still shutting down: the
    // documented limit that --takeover-delay addresses.
    let lock = unique_lock();
    let a = run("A", cluster, lock, &[], &journal.child("A", "1"));
    let started = a.wait_stdout("A started");
    let b = run("B", cluster, lock, &[], &journal.quick_child("B"));
    b.wait_log("waiting for the lock");
    cluster.terminate_backend(pid_field(&started, "backend"));
    b.wait_stdout("B started");
    a.wait_log("the command exited");
    assert_eq!(journal.lines(), ["A-started", "B-started", "A-stopped"]);
    drop((a, b));
    let _ = std::fs::remove_file(&journal.path);

    // With a takeover delay longer than the old command's shutdown, they never overlap.
    let lock = unique_lock();
    let c = run("C", cluster, lock, &[], &journal.child("C", "1"));
    let started = c.wait_stdout("C started");
    let d = run(
        "D",
        cluster,
        lock,
        &["--takeover-delay=2s"],
        &journal.quick_child("D"),
    );
    d.wait_log("waiting for the lock");
    cluster.terminate_backend(pid_field(&started, "backend"));
    d.wait_log("starting the command in 2s (--takeover-delay)");
    d.wait_stdout("D started");
    assert_eq!(journal.lines(), ["C-started", "C-stopped", "D-started"]);
}

#[test]
fn a_leader_paused_longer_than_the_lease_has_its_command_stopped_by_its_keeper_and_queues_again() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = run("A", cluster, lock, &QUICK_LEASE, &patient_child("A"));
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &QUICK_LEASE, &patient_child("B"));
    b.wait_log("waiting for the lock");

    // pgleader (not its command) is frozen: it can neither check nor stop anything. Its
    // keeper, which is not frozen, stops the command at the leader's deadline (500 ms after
    // the last successful check); the server ends the idle session after the lease and the
    // next replica leads (`frozen.rs` has the timing of each duty and backend).
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    a.wait_stdout("A got TERM");
    if cluster.server_major() < 14 {
        // PostgreSQL 13 has no idle_session_timeout, and a stopped process's kernel still
        // acknowledges the server's keepalives: the server keeps the paused leader's lock, so
        // nobody else leads (no overlap, and no takeover either, as pgleader warned at start).
        stays_waiting(&b, "A was paused");
        a.signal(nix::sys::signal::Signal::SIGCONT);
        a.wait_log("has no idle_session_timeout");
        b.wait_stdout("B started");
        a.signal(nix::sys::signal::Signal::SIGTERM);
        return;
    }
    b.wait_stdout("B started");

    // Resumed, A sees that its leadership is over, says the keeper stopped the command, and
    // queues again.
    a.signal(nix::sys::signal::Signal::SIGCONT);
    let lost = a.wait_lost_leadership();
    assert!(
        lost.contains("the keeper stopped the command by itself"),
        "{lost}"
    );
    a.wait_for_nth(Stream::Stderr, "waiting for the lock", 2);
}

/// On `cluster`, with the restart fence on and a lease of 4 s: A leading with a command that
/// takes 1.5 s to stop, and B queued behind it, both journaling their runs.
fn fenced_leader_and_follower(cluster: &Cluster, journal: &Journal) -> (Proc, Proc) {
    let lock = unique_lock();
    let timings = [
        "--check-interval=200ms",
        "--check-timeout=300ms",
        "--kill-timeout=2s",
        "--lease=4s",
        "--restart-fence=auto",
    ];
    let a = run("A", cluster, lock, &timings, &journal.child("A", "1.5"));
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &timings, &journal.quick_child("B"));
    b.wait_log("waiting for the lock");
    (a, b)
}

#[test]
fn the_restart_fence_keeps_a_new_leader_clear_of_a_command_still_stopping() {
    let cluster = Cluster::new("fence");
    let journal = Journal::new("fence");
    // A's command takes 1.5 s to stop; the server is back long before that.
    let (_a, b) = fenced_leader_and_follower(&cluster, &journal);

    cluster.stop();
    cluster.start();
    // B wins while A's command is still stopping, and waits until 3.5 s have passed since the
    // server started again.
    b.wait_log("(--restart-fence)");
    b.wait_stdout("B started");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
}

#[test]
fn a_leader_paused_before_its_command_started_never_starts_it_once_resumed() {
    let timings = [QUICK_LEASE.as_slice(), &["--takeover-delay=1s"]].concat();
    let a = leader(&timings, &patient_child("A"));
    // Paused during its takeover delay, and resumed once both its deadline (500 ms) and its
    // start time (1 s) have passed but before the server gives up on it (3 s): the deadline
    // must win over the start.
    a.wait_log("starting the command in 1s (--takeover-delay)");
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    // The length of the pause is the fault under test, not a synchronisation.
    std::thread::sleep(Duration::from_millis(1800));
    a.signal(nix::sys::signal::Signal::SIGCONT);
    // Either end is the deadline's: the deadline itself, or the start found already past it
    // (after a pause the command's start may be seen ready before the deadline's timer is).
    let lost = a.wait_log("leadership lost");
    assert!(
        lost.contains("no successful check")
            || lost.contains("the leadership expired before the command could start"),
        "{lost}"
    );
    // Back in the queue: whatever happened to the old leadership is over.
    a.wait_for_nth(Stream::Stderr, "waiting for the lock", 2);
    let started = a.printed(Stream::Stdout, "A started");
    let stopped = a.printed(Stream::Stderr, "stopping the command");
    assert!(
        !started && !stopped,
        "A started its command after its leadership had expired:\n{}",
        a.dump()
    );
}

#[test]
fn the_restart_fence_also_covers_a_crashed_server_process() {
    // When any server process crashes, the postmaster ends every session and frees every lock
    // without restarting itself: pg_postmaster_start_time() does not move. The fence rests on
    // the age of the winner's session, which such a reset cannot leave old.
    let cluster = Cluster::new("crash");
    let journal = Journal::new("crash");
    let (a, b) = fenced_leader_and_follower(&cluster, &journal);
    let started = a.wait_stdout("A started");
    // The fence of B's first session has long passed by now: its age counts from the reset.
    b.wait_for_nth(Stream::Stderr, "waiting for the lock", 1);

    let backend = pid_field(&started, "backend");
    // A crash of a server process.
    kill_9(backend);
    a.wait_log("leadership lost");
    b.wait_stdout("B started");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
}

#[test]
fn the_epoch_keeps_growing_across_a_server_crash() {
    // A transaction that only takes an id is committed without waiting for its WAL to reach
    // disk; with the WAL writer slowed down, a crash right after would hand the same id out
    // again. pgleader makes the epoch's commit wait for the flush, even on this server, which
    // (as every test server) runs with synchronous_commit = off.
    let cluster = Cluster::with_options(
        "epoch-crash",
        crate::harness::cluster::Options {
            settings: vec!["wal_writer_delay = '10s'".into()],
            ..Default::default()
        },
    );
    let lock = unique_lock();
    let epoch_of = |name: &str| {
        let process = run(
            name,
            &cluster,
            lock,
            &["--once"],
            "echo epoch=$PGLEADER_EPOCH",
        );
        let line = process.wait_stdout("epoch=");
        assert_eq!(process.wait_code(), 0);
        crate::harness::field(&line, "epoch")
            .parse::<i64>()
            .expect("epoch")
    };
    // Everything before the leadership is on disk: only the fence's own commit can carry its
    // transaction id past the crash.
    cluster.execute("CHECKPOINT");
    let before = epoch_of("before");
    cluster.crash();
    cluster.start();
    let after = epoch_of("after");
    assert!(
        after > before,
        "epoch {after} after a crash, {before} before it"
    );
}

#[test]
fn a_fresh_start_on_a_server_that_has_been_up_a_while_is_not_fenced() {
    let cluster = Cluster::shared();
    // The shared server may be younger than the fence used here; let it age.
    let up: f64 = cluster
        .client()
        .query_one(
            "SELECT extract(epoch FROM clock_timestamp() - greatest(pg_postmaster_start_time(), \
             (SELECT stats_reset FROM pg_stat_bgwriter)))::float8",
            &[],
        )
        .expect("server age")
        .get(0);
    if up < 1.5 {
        std::thread::sleep(Duration::from_secs_f64(1.5 - up));
    }
    let a = leader(&["--once", "--restart-fence=1s"], "echo A ran");
    a.wait_stdout("A ran");
    assert_eq!(a.wait_code(), 0);
    assert!(
        !a.printed(Stream::Stderr, "--restart-fence"),
        "{}",
        a.dump()
    );
}
