//! Signals pgleader receives: passed on to the command's process group; TERM and INT also
//! shut pgleader down; a second one does not wait for the kill timeout.

use nix::sys::signal::Signal;

use std::time::{Duration, Instant};

use crate::harness::pg::{leader, leader_and_follower};
use crate::harness::{Cluster, WAIT, patient_child, pid_field, unique_lock};

#[test]
fn signals_are_passed_on_to_the_commands_process_group() {
    // The command starts a grandchild that reports signals too: they go to the whole group,
    // not only to the process pgleader's keeper started.
    let script = format!(
        "sh -c \"{}\" & {}",
        patient_child("G").replace('$', "\\$").replace('"', "\\\""),
        patient_child("A")
    );
    let a = leader(&["--kill-timeout=1s"], &script);
    a.wait_stdout("A started");
    a.wait_stdout("G started");
    for signal in [
        Signal::SIGHUP,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGWINCH,
        Signal::SIGQUIT,
    ] {
        a.signal(signal);
        let name = &signal.as_str()[3..];
        a.wait_stdout(&format!("A got {name}"));
        // A background job of sh starts with INT and QUIT ignored, and sh cannot trap a signal
        // it started with ignored: the grandchild reports the others.
        if signal != Signal::SIGQUIT {
            a.wait_stdout(&format!("G got {name}"));
        }
    }
    // INT is passed on too, and shuts pgleader down once the command has exited.
    a.signal(Signal::SIGINT);
    a.wait_stdout("A got INT");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    a.wait_log("released the lock");
}

#[test]
fn a_second_sigterm_kills_the_command_without_waiting_for_the_kill_timeout() {
    let a = leader(
        &["-v", "--kill-timeout=1h", "--lease=2h"],
        "trap 'echo A ignores TERM' TERM; echo A started; while :; do sleep 1000 & wait $!; done",
    );
    a.wait_stdout("A started");
    a.signal(Signal::SIGTERM);
    a.wait_stdout("A ignores TERM");
    // A TERM right behind the first (as timeout(1) sends them) is not an insistence.
    a.signal(Signal::SIGTERM);
    a.wait_log("ignoring a repeated shutdown signal");
    // One that comes later is. The wait is the rule under test, not a synchronisation.
    std::thread::sleep(pgleader::supervise::inbox::REPEAT_WINDOW);
    a.signal(Signal::SIGTERM);
    a.wait_log("second shutdown signal: sending SIGKILL");
    assert_eq!(a.wait_code(), 128 + 9);
}

#[test]
fn sigterm_while_waiting_for_the_lock_exits_at_once_with_0() {
    let cluster = Cluster::shared();
    let (_a, b) = leader_and_follower(cluster, unique_lock(), &[], &patient_child("B"));
    let waiting = b.wait_log("waiting for the lock");
    b.signal(Signal::SIGTERM);
    assert_eq!(b.wait_code(), 0);
    b.wait_log("shutting down");
    assert!(b.lines(crate::harness::Stream::Stdout).is_empty());

    // The abandoned acquisition's session is closed, not left in the lock's queue: the server
    // drops it (it checks waiting clients' sockets every second).
    let backend = pid_field(&waiting, "backend_pid");
    let deadline = Instant::now() + WAIT;
    let mut client = cluster.client();
    while client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
            &[&backend],
        )
        .expect("pg_stat_activity")
        .get::<_, i64>(0)
        > 0
    {
        assert!(
            Instant::now() < deadline,
            "the abandoned session {backend} lives on"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
