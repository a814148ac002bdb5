//! Losing the leader: kill -9 of pgleader, a graceful SIGTERM, the server terminating the
//! leader's session, a command that will not stop.

use std::os::fd::AsRawFd;

use nix::sys::signal::Signal;

use crate::harness::pg::{SLOW_CHECKS, leader, leader_and_follower};
use crate::harness::{
    Cluster, Journal, Proc, Stream, WAIT, is_running, keepers_of, kill_9,
    kill_9_never_overlaps_a_41_process_tree, kill_9_never_overlaps_the_dying_tree, overlaps_seen,
    patient_child, pid_field, pid_in, run, unique_lock, wait_gone,
};

#[test]
fn kill_9_of_the_leader_takes_its_command_and_grandchild_down_and_a_follower_takes_over() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let a = run("A", cluster, lock, &[], &with_grandchild("A"));
    let started = a.wait_stdout("A started");
    let child = pid_in(&started);
    let keeper = pid_field(&started, "keeper");
    let grandchild: i32 = pid_in(&a.wait_stdout("A grandchild"));
    let b = run("B", cluster, lock, &[], &patient_child("B"));
    b.wait_log("waiting for the lock");

    a.signal(Signal::SIGKILL);
    assert_tree_gone(child, grandchild, keeper);
    b.wait_stdout("B started");
}

/// A child that starts a grandchild and prints `<tag> grandchild <pid>`, then
/// `<tag> started <pid> keeper=<its keeper's pid>`, and waits.
fn with_grandchild(tag: &str) -> String {
    format!(
        "sh -c 'sleep 1000' & echo {tag} grandchild $!; echo {tag} started $$ keeper=$PPID; wait"
    )
}

/// A leader A, and a follower B running `script` and waiting behind it, with the keeper B
/// parked before it queued up (winning then costs one fork and exec): A, B and that keeper.
fn leader_and_parked_follower(cluster: &Cluster, lock: i64, script: &str) -> (Proc, Proc, i32) {
    let (a, b) = leader_and_follower(cluster, lock, &[], script);
    let parked = keepers_of(b.pid.as_raw());
    assert_eq!(
        parked.len(),
        1,
        "the follower has no parked keeper\n{}",
        b.dump()
    );
    (a, b, parked[0])
}

/// Asserts that `pid` dies within the test's wait; `what` says what outlived what otherwise.
fn assert_dies(pid: i32, what: &str) {
    assert!(wait_gone(pid, WAIT), "{what} (pid {pid})");
}

/// Asserts that `pid` is gone already; `what` says what outlived what otherwise.
fn assert_gone(pid: i32, what: &str) {
    assert!(!is_running(pid), "{what} (pid {pid})");
}

/// Asserts that a killed pgleader's command, its grandchild and its keeper are all gone.
fn assert_tree_gone(child: i32, grandchild: i32, keeper: i32) {
    for (what, pid) in [
        ("command", child),
        ("grandchild", grandchild),
        ("keeper", keeper),
    ] {
        assert_dies(pid, &format!("the {what} outlived pgleader"));
    }
}

#[test]
fn a_follower_parks_a_keeper_that_dies_with_it() {
    let cluster = Cluster::shared();
    let (_a, b, parked) = leader_and_parked_follower(cluster, unique_lock(), &patient_child("B"));

    b.signal(Signal::SIGKILL);
    assert_dies(parked, "the parked keeper outlived its follower");
}

#[test]
fn kill_9_of_a_leader_that_won_with_a_parked_keeper_takes_its_whole_tree_down() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let (a, b, parked) = leader_and_parked_follower(cluster, lock, &with_grandchild("B"));

    a.signal(Signal::SIGTERM);
    let started = b.wait_stdout("B started");
    let keeper = pid_field(&started, "keeper");
    assert_eq!(
        keeper, parked,
        "the command did not start under the parked keeper"
    );
    let child = pid_in(&started);
    let grandchild = pid_in(&b.wait_stdout("B grandchild"));
    let c = run("C", cluster, lock, &[], &patient_child("C"));
    c.wait_log("waiting for the lock");

    b.signal(Signal::SIGKILL);
    assert_tree_gone(child, grandchild, keeper);
    c.wait_stdout("C started");
}

#[test]
fn kill_9_of_the_leader_frees_the_lock_only_after_its_whole_tree_is_gone() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    // A lease of a minute: only the keeper letting go of the leader's socket, not the server's
    // idle_session_timeout, can free the lock within the test's waits.
    kill_9_never_overlaps_the_dying_tree("pg", 5, |name, script| {
        run(name, cluster, lock, &["--lease=60s"], script)
    });
}

#[test]
fn kill_9_of_the_leader_never_overlaps_a_41_process_tree_in_20_rounds() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    kill_9_never_overlaps_a_41_process_tree("pg-41", 20, |name, script| {
        run(name, cluster, lock, &["--lease=60s"], script)
    });
}

#[test]
fn the_keeper_holds_the_leaders_database_socket_with_the_leases_keepalives() {
    use nix::sys::socket::{SockaddrIn, getpeername, getsockopt, sockopt};
    let cluster = Cluster::shared();
    let a = leader(
        &["--lease=15s"],
        "echo A started keeper=$PPID; exec sleep 1000",
    );
    let keeper = pid_field(&a.wait_stdout("A started"), "keeper");
    // The keeper gets the sockets to hold over its channel: among its descriptors, exactly one
    // is a TCP connection, and it is the one to the server.
    let tcp: Vec<(std::os::fd::OwnedFd, SockaddrIn)> =
        std::fs::read_dir(format!("/proc/{keeper}/fd"))
            .expect("the keeper's descriptors")
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|fd| {
                let socket = descriptor_of(keeper, fd);
                let peer: SockaddrIn = getpeername(socket.as_raw_fd()).ok()?;
                Some((socket, peer))
            })
            .collect();
    assert_eq!(
        tcp.len(),
        1,
        "the keeper holds {} TCP connections",
        tcp.len()
    );
    let (socket, peer) = tcp.into_iter().next().expect("one");
    assert_eq!(
        peer.port(),
        cluster.port,
        "the keeper holds {peer}, not the server's connection"
    );
    // The lease's keepalives, set on pgleader's own socket: idle + interval x count covers the
    // lease, and unacknowledged data is given up on after it.
    assert!(getsockopt(&socket, sockopt::KeepAlive).expect("SO_KEEPALIVE"));
    let idle = getsockopt(&socket, sockopt::TcpKeepIdle).expect("TCP_KEEPIDLE");
    let interval = getsockopt(&socket, sockopt::TcpKeepInterval).expect("TCP_KEEPINTVL");
    let count = getsockopt(&socket, sockopt::TcpKeepCount).expect("TCP_KEEPCNT");
    assert!(
        idle + interval * count >= 15 && idle < 15,
        "keepalives {idle} s + {interval} s x {count}"
    );
    assert_eq!(
        getsockopt(&socket, sockopt::TcpUserTimeout).expect("TCP_USER_TIMEOUT"),
        15_000
    );
}

/// A copy of descriptor `fd` of process `pid` (pidfd_getfd, Linux 5.6).
fn descriptor_of(pid: i32, fd: i32) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: plain system calls on integers; a negative result is an error, checked below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: as above; the pidfd is open for the length of the call.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    assert!(
        copy >= 0,
        "pidfd_getfd({pid}, {fd}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: pidfd_getfd returned a new descriptor that nothing else owns.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(copy as i32) }
}

#[test]
fn sigterm_to_the_leader_hands_over_only_after_its_command_has_exited() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let journal = Journal::new("handover");
    // A takes half a second to clean up after TERM; B must not start before A is done.
    let a = run("A", cluster, lock, &[], &journal.child("A", "0.5"));
    a.wait_stdout("A started");
    let b = run("B", cluster, lock, &[], &journal.quick_child("B"));
    b.wait_log("waiting for the lock");

    a.terminate_cleanly();
    b.wait_stdout("B started");
    a.wait_log("released the lock");
    assert_eq!(journal.lines(), ["A-started", "A-stopped", "B-started"]);
}

#[test]
fn terminating_the_leaders_session_stops_its_command_at_once_not_at_the_next_check() {
    let a = leader(&SLOW_CHECKS, &patient_child("A"));
    let started = a.wait_stdout("A started");
    Cluster::shared().terminate_backend(pid_field(&started, "backend"));
    let lost = a.wait_lost_leadership();
    assert!(
        lost.contains("terminating connection due to administrator command"),
        "{lost}"
    );
    // Back in the election, and the lock is free: A leads again.
    a.wait_for_nth(Stream::Stdout, "A started", 2);
}

#[test]
fn once_exits_75_when_leadership_is_lost_mid_run() {
    let cluster = Cluster::shared();
    let a = leader(&["--once"], &patient_child("A"));
    let started = a.wait_stdout("A started");
    cluster.terminate_backend(pid_field(&started, "backend"));
    a.wait_stdout("A got TERM");
    assert_eq!(a.wait_code(), 75, "{}", a.dump());
}

#[test]
fn a_command_that_ignores_sigterm_is_killed_after_the_kill_timeout() {
    let a = leader(
        &["--kill-timeout=300ms"],
        "trap '' TERM; echo A started $$; while :; do sleep 1000 & wait $!; done",
    );
    let child = pid_in(&a.wait_stdout("A started"));
    a.signal(Signal::SIGTERM);
    a.wait_log("did not exit within 300ms (--kill-timeout); sending SIGKILL");
    assert_eq!(a.wait_code(), 128 + 9, "{}", a.dump());
    assert_gone(child, "the command survived SIGKILL");
}

#[test]
fn leftovers_of_a_command_that_exited_are_stopped_before_the_lock_is_released() {
    let a = leader(
        &["--once", "--kill-timeout=5s"],
        "sleep 1000 & echo A left $!; exit 3",
    );
    let leftover: i32 = pid_in(&a.wait_stdout("A left"));
    assert_eq!(a.wait_code(), 3);
    assert_gone(
        leftover,
        "the command's background process outlived the leadership",
    );
}

#[test]
fn processes_that_left_the_process_group_are_killed_after_the_kill_timeout() {
    let a = leader(
        &["--kill-timeout=300ms"],
        "setsid sh -c 'echo A escaped $$; exec sleep 1000' & trap 'exit 0' TERM; echo A started; while :; do sleep 1000 & wait $!; done",
    );
    let escaped: i32 = pid_in(&a.wait_stdout("A escaped"));
    a.wait_stdout("A started");
    a.signal(Signal::SIGTERM);
    a.wait_log(
        "did not exit within 300ms (--kill-timeout); sending SIGKILL to everything it started",
    );
    a.wait_exit();
    assert_gone(
        escaped,
        "a process that left the group outlived the leadership",
    );
}

#[test]
fn the_lock_goes_to_the_next_leader_only_once_processes_that_left_the_group_are_gone() {
    // The keeper says "nothing left" only once it has reaped every descendant, and pgleader
    // releases the lock on that word alone. A's command exits and leaves behind a process that
    // left the group (out of reach of the group's signal) holding 2 GiB, which the kill
    // timeout ends and whose death takes about 100 ms; B's command looks for it the moment it
    // starts. A stays up (no --once), so only that kill, not A's exit, can end it.
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let base = std::env::temp_dir().join(format!("pgleader-left-{}-{lock}", std::process::id()));
    let (pids, go) = (base.with_extension("pids"), base.with_extension("go"));
    let _ = std::fs::remove_file(&go);
    let a = run(
        "A",
        cluster,
        lock,
        &["--kill-timeout=300ms"],
        &format!(
            "setsid python3 -c 'import time; b = b\"\\x01\" * (2 << 30); print(\"A big\", flush=True); time.sleep(1000)' & \
             echo $! > {pids}; echo A started; while [ ! -e {go} ]; do sleep 0.05; done",
            pids = pids.display(),
            go = go.display()
        ),
    );
    a.wait_stdout("A started");
    a.wait_stdout("A big");
    let b = run(
        "B",
        cluster,
        lock,
        &[],
        &format!(
            "for pid in $(cat {}); do if kill -0 $pid 2>/dev/null; then echo B overlap $pid; fi; done; \
             echo B started; exec sleep 1000",
            pids.display()
        ),
    );
    b.wait_log("waiting for the lock");

    std::fs::write(&go, b"").expect("the go file");
    b.wait_stdout("B started");
    let _ = (std::fs::remove_file(&go), std::fs::remove_file(&pids));
    let overlaps = overlaps_seen(&b);
    assert!(
        overlaps.is_empty(),
        "the next command started while the old tree still ran: {overlaps:?}"
    );
    a.wait_log("sending SIGKILL to everything it started");
}

#[test]
fn kill_9_of_pgleader_also_takes_down_processes_that_left_the_group() {
    let a = leader(
        &[],
        "setsid sh -c 'echo A escaped $$; exec sleep 1000' & echo A started; wait",
    );
    let escaped: i32 = pid_in(&a.wait_stdout("A escaped"));
    a.wait_stdout("A started");
    a.signal(Signal::SIGKILL);
    assert_dies(escaped, "a process that left the group outlived pgleader");
}

#[test]
fn a_keeper_killed_from_outside_leaves_nothing_behind_when_the_lock_is_released() {
    let a = leader(&["--once"], &with_grandchild("A"));
    let grandchild: i32 = pid_in(&a.wait_stdout("A grandchild"));
    let keeper = pid_field(&a.wait_stdout("A started"), "keeper");
    kill_9(keeper);
    a.wait_log("released the lock");
    assert_gone(
        grandchild,
        "the grandchild outlived its keeper and the lock was released",
    );
    assert_eq!(a.wait_code(), 128 + 9);
}

#[test]
fn a_stop_signal_sent_before_the_command_exists_still_reaches_it() {
    // A TERM sent to the group while the keeper is still starting the command reaches only
    // the keeper (which blocks it); pgleader sends it again once the command runs. With a
    // kill timeout of an hour, a lost TERM would hang this test.
    for _ in 0..5 {
        let a = leader(
            &["-v", "--kill-timeout=1h", "--lease=2h"],
            "exec sleep 1000",
        );
        a.wait_log("started the keeper");
        a.signal(Signal::SIGTERM);
        assert_eq!(a.wait_code(), 128 + 15, "{}", a.dump());
    }
}
