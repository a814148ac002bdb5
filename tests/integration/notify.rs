//! systemd notifications, received on a datagram socket the test listens on, as systemd
//! would: READY=1 once waiting or leading, STATUS= lines, STOPPING=1, watchdog pings.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;
use std::time::Instant;

use nix::sys::signal::Signal;

use crate::harness::{
    Cluster, Proc, Stream, WAIT, patient_child, pgleader, pid_field, unique_lock,
};

/// A socket standing in for systemd's notification socket.
struct NotifySocket {
    socket: UnixDatagram,
    /// The value for NOTIFY_SOCKET.
    name: String,
    path: Option<PathBuf>,
    received: Vec<String>,
}

impl NotifySocket {
    /// A socket with a path in the file system.
    fn at_path(tag: &str) -> NotifySocket {
        let path = std::env::temp_dir().join(format!(
            "pgleader-notify-{}-{tag}-{}",
            std::process::id(),
            unique_lock()
        ));
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind the notification socket");
        NotifySocket {
            socket,
            name: path.display().to_string(),
            path: Some(path),
            received: Vec::new(),
        }
    }

    /// A socket in Linux's abstract namespace (NOTIFY_SOCKET=@name), as systemd uses them.
    fn abstract_name(tag: &str) -> NotifySocket {
        let name = format!(
            "pgleader-notify-{}-{tag}-{}",
            std::process::id(),
            unique_lock()
        );
        let address = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract address");
        let socket = UnixDatagram::bind_addr(&address).expect("bind the abstract socket");
        NotifySocket {
            socket,
            name: format!("@{name}"),
            path: None,
            received: Vec::new(),
        }
    }

    /// Receives notifications until one contains `needle`; returns it. Fails after WAIT.
    fn wait_for(&mut self, needle: &str, process: &Proc) -> String {
        self.wait_for_nth(needle, 1, process)
    }

    /// Receives notifications until `n` of them contain `needle`; returns the n-th.
    fn wait_for_nth(&mut self, needle: &str, n: usize, process: &Proc) -> String {
        let deadline = Instant::now() + WAIT;
        let mut buf = vec![0u8; 4096];
        loop {
            if let Some(found) = self
                .received
                .iter()
                .filter(|m| m.contains(needle))
                .nth(n - 1)
            {
                return found.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "no {n}th notification containing {needle:?} within {WAIT:?}; received {:#?}\n{}",
                self.received,
                process.dump()
            );
            self.socket
                .set_read_timeout(Some(left))
                .expect("set a read timeout");
            if let Ok(n) = self.socket.recv(&mut buf) {
                self.received
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
    }

    /// Reads whatever has arrived and not been read yet, without waiting.
    fn drain(&mut self) {
        self.socket.set_nonblocking(true).expect("non-blocking");
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = self.socket.recv(&mut buf) {
            self.received
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }

    fn count(&self, needle: &str) -> usize {
        self.received.iter().filter(|m| m.contains(needle)).count()
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn run_notified(
    name: &str,
    cluster: &Cluster,
    lock: i64,
    socket: &NotifySocket,
    env: &[(&str, &str)],
    script: &str,
) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .env("NOTIFY_SOCKET", &socket.name)
        .envs(env.iter().copied())
        .args(["run", "-v", "--lock-id"])
        .arg(lock.to_string())
        .args(["--", "sh", "-c", script]);
    Proc::spawn(name, command)
}

/// pgleader A on a lock of its own, told by WATCHDOG_USEC that systemd wants a sign of life
/// every 200 ms, with `env` besides.
fn leader_with_a_watchdog(socket: &NotifySocket, env: &[(&str, &str)]) -> Proc {
    let env = [&[("WATCHDOG_USEC", "200000")], env].concat();
    run_notified(
        "A",
        Cluster::shared(),
        unique_lock(),
        socket,
        &env,
        &patient_child("A"),
    )
}

#[test]
fn ready_and_status_say_leader_or_follower_and_stopping_comes_on_shutdown() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let mut leader_socket = NotifySocket::at_path("leader");
    let mut follower_socket = NotifySocket::abstract_name("follower");

    let a = run_notified(
        "A",
        cluster,
        lock,
        &leader_socket,
        &[],
        &format!(
            "echo notify=${{NOTIFY_SOCKET:-unset}}; {}",
            patient_child("A")
        ),
    );
    // Ready once queued for the lock (granted at once here, so the leader status follows).
    leader_socket.wait_for("READY=1", &a);
    leader_socket.wait_for(&format!("STATUS=leader of lock {lock} (epoch "), &a);
    // Readiness and liveness are pgleader's to report, not the command's.
    a.wait_stdout("notify=unset");

    let b = run_notified(
        "B",
        cluster,
        lock,
        &follower_socket,
        &[],
        &patient_child("B"),
    );
    let ready = follower_socket.wait_for("READY=1", &b);
    assert!(
        ready.contains(&format!("STATUS=follower: waiting for lock {lock}")),
        "{ready:?}"
    );

    // The leader shuts down: STOPPING=1, and the follower becomes the leader.
    a.signal(Signal::SIGTERM);
    let stopping = leader_socket.wait_for("STOPPING=1", &a);
    assert!(stopping.contains("STATUS=shutting down"), "{stopping:?}");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    b.wait_stdout("B started");
    follower_socket.wait_for(&format!("STATUS=leader of lock {lock}"), &b);
    assert_eq!(
        follower_socket.count("READY=1"),
        1,
        "READY=1 is sent once: {:#?}",
        follower_socket.received
    );
    b.signal(Signal::SIGTERM);
    follower_socket.wait_for("STOPPING=1", &b);
    assert_eq!(b.wait_code(), 0, "{}", b.dump());
}

#[test]
fn leadership_lost_shows_in_the_status() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let mut socket = NotifySocket::at_path("lost");
    let a = run_notified("A", cluster, lock, &socket, &[], &patient_child("A"));
    let started = a.wait_stdout("A started");
    let backend = pid_field(&started, "backend");
    socket.wait_for("READY=1", &a);
    cluster.terminate_backend(backend);
    socket.wait_for("STATUS=leadership lost (the connection ended", &a);
    // Back in the election, alone: leader again.
    a.wait_for_nth(Stream::Stdout, "A started", 2);
    assert!(
        socket.count(&format!("STATUS=leader of lock {lock}")) >= 1,
        "{:#?}",
        socket.received
    );
    a.terminate_cleanly();
}

#[test]
fn the_watchdog_is_pinged_every_half_of_watchdog_usec() {
    let mut socket = NotifySocket::abstract_name("watchdog");
    // 200 ms: a ping every 100 ms.
    let a = leader_with_a_watchdog(&socket, &[]);
    a.wait_log("pinging the systemd watchdog every 100ms");
    let started = Instant::now();
    let before = socket.count("WATCHDOG=1");
    socket.wait_for_nth("WATCHDOG=1", before + 5, &a);
    // Five pings, four intervals of 100 ms after the first: well under the 200 ms timeout each.
    let elapsed = started.elapsed();
    assert!(
        elapsed.as_millis() < 1500,
        "five pings took {elapsed:?}: {:#?}",
        socket.received
    );
    a.terminate_cleanly();
}

#[test]
fn a_watchdog_meant_for_another_process_is_not_fed() {
    let mut socket = NotifySocket::at_path("not-ours");
    let a = leader_with_a_watchdog(&socket, &[("WATCHDOG_PID", "1")]);
    a.wait_log("not feeding the systemd watchdog: WATCHDOG_PID=1 is not this process");
    socket.wait_for("READY=1", &a);
    a.signal(Signal::SIGTERM);
    socket.wait_for("STOPPING=1", &a);
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    socket.drain();
    assert_eq!(socket.count("WATCHDOG=1"), 0, "{:#?}", socket.received);
}
