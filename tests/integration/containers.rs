//! pgleader as PID 1, the way a container runs its entrypoint: in a new pid namespace
//! (`unshare --pid --fork`), it passes signals on and reaps the orphans the kernel hands it.
//!
//! Orphans of the command itself go to the keeper, which is a child subreaper; the orphans that
//! reach PID 1 are those of processes started into the namespace from outside, as
//! `docker exec` and `kubectl exec` do. The test makes both kinds.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::stat::Mode;
use nix::unistd::{Pid, mkfifo};

use crate::harness::namespace::{NsProcess, namespace_processes};
use crate::harness::{
    Cluster, Proc, Stream, WAIT, patient_child, pgleader_under, require_tool, unique_lock,
};

const NEEDS: &str = "this test runs pgleader as PID 1 of a new pid namespace: it needs \
    util-linux's unshare and nsenter (Debian/Ubuntu: apt-get install util-linux) and the right \
    to create namespaces (run the tests as root, or in a container started with \
    --privileged or CAP_SYS_ADMIN)";

/// Polls `condition` until it holds, failing after the hard timeout with `what`.
fn wait_until(what: &str, mut condition: impl FnMut() -> Option<String>) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(found) = condition() {
            return found;
        }
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Lets the process blocked reading `fifo` go on: opens it for writing without blocking
/// (which fails until the reader is there) and writes a line.
fn release(fifo: &Path) {
    wait_until(&format!("a reader on {}", fifo.display()), || {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo)
            .ok()?;
        file.write_all(b"go\n").ok().map(|()| String::new())
    });
}

/// Runs `command` (the tool `name`) to its end and asserts that it succeeded, or fails saying
/// what the test needs: the process and its stdout.
fn succeeds(name: &str, command: Command) -> (Proc, Vec<String>) {
    let process = Proc::spawn(name, command);
    let (status, stdout, stderr) = process.finish();
    assert!(
        status.success(),
        "{name} failed ({}): {NEEDS}",
        stderr.join(" ")
    );
    (process, stdout)
}

/// The process of `member`'s PID namespace that passes `test`.
fn in_namespace(member: i32, test: impl Fn(&NsProcess) -> bool) -> Option<NsProcess> {
    namespace_processes(member).into_iter().find(|p| test(p))
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    mkfifo(&path, Mode::from_bits_truncate(0o600)).expect("mkfifo");
    path
}

#[test]
fn as_pid_1_it_passes_signals_on_and_reaps_the_orphans_it_inherits() {
    require_tool("unshare", NEEDS);
    require_tool("nsenter", NEEDS);
    let mut preflight = Command::new("unshare");
    preflight.args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"]);
    succeeds("unshare", preflight);

    let dir = std::env::temp_dir().join(format!("pgleader-pid1-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create the fifo directory");
    let inner = fifo(&dir, "inner");
    let outer = fifo(&dir, "outer");

    // The command's own child double-forks: the grandchild is orphaned at once.
    let script = format!(
        "( sh -c 'read line < {}; echo grandchild done' & ); {}",
        inner.display(),
        patient_child("A")
    );
    let cluster = Cluster::shared();
    let mut command =
        pgleader_under(&["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]);
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .args(["run", "-v", "--lock-id"])
        .arg(unique_lock().to_string())
        .args(["--", "sh", "-c", &script]);
    let a = Proc::spawn("pgleader as PID 1", command);
    a.wait_stdout("A started");

    // unshare's child is pgleader, PID 1 inside.
    let children = fs::read_to_string(format!("/proc/{}/task/{}/children", a.pid, a.pid))
        .expect("unshare's children");
    let pgleader: i32 = children
        .split_whitespace()
        .next()
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("unshare has no child\n{}", a.dump()));
    let init =
        in_namespace(pgleader, |p| p.host_pid == pgleader).expect("pgleader in its namespace");
    assert_eq!(init.ns_pid, 1, "pgleader is not PID 1: {init:?}");

    // The command's orphan exits: the keeper (a subreaper) reaps it. (Before the signals
    // below, which would kill it too: it is in the command's process group.)
    release(&inner);
    a.wait_stdout("grandchild done");

    // Signals sent to PID 1 from outside reach the command's process group.
    for signal in [Signal::SIGHUP, Signal::SIGUSR1] {
        kill(Pid::from_raw(pgleader), signal).expect("signal pgleader");
        a.wait_stdout(&format!("A got {}", &signal.as_str()[3..]));
    }

    // A process started into the namespace from outside (as `docker exec` does) leaves a child
    // behind: the kernel hands it to PID 1.
    // The orphan's output goes elsewhere: it would hold nsenter's pipe open.
    let mut enter = Command::new("nsenter");
    enter
        .args(["--target", &pgleader.to_string(), "--pid", "--"])
        .args([
            "sh",
            "-c",
            &format!(
                "sh -c 'read line < {}; exit 3' </dev/null >/dev/null 2>&1 & echo orphan $!",
                outer.display()
            ),
        ]);
    let (exec, stdout) = succeeds("nsenter", enter);
    let orphan_ns_pid: i32 = stdout
        .first()
        .and_then(|line| line.strip_prefix("orphan "))
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no orphan pid\n{}", exec.dump()));
    let orphan = in_namespace(pgleader, |p| p.ns_pid == orphan_ns_pid).expect("the orphan runs");
    assert_eq!(
        orphan.parent, pgleader,
        "the orphan was not handed to PID 1: {orphan:?}"
    );
    release(&outer);
    a.wait_log(&format!("reaped an orphaned process pid={orphan_ns_pid}"));

    // No zombie is left anywhere in the namespace.
    wait_until("no zombie in the namespace", || {
        let zombies: Vec<_> = namespace_processes(pgleader)
            .into_iter()
            .filter(|p| p.state == 'Z')
            .collect();
        zombies.is_empty().then(String::new)
    });
    assert!(
        namespace_processes(pgleader)
            .iter()
            .all(|p| p.host_pid != orphan.host_pid),
        "the orphan was not reaped"
    );

    // TERM to PID 1: passed on, the command exits 0, and so does pgleader (and unshare).
    kill(Pid::from_raw(pgleader), Signal::SIGTERM).expect("signal pgleader");
    a.wait_stdout("A got TERM");
    assert_eq!(a.wait_code(), 0, "{}", a.dump());
    assert!(
        a.lines(Stream::Stderr)
            .iter()
            .any(|line| line.contains("released the lock")),
        "{}",
        a.dump()
    );
    let _ = fs::remove_dir_all(&dir);
}
