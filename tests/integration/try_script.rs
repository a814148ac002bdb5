//! README's first command, as a newcomer runs it: `scripts/try` (given the binary under test
//! rather than building one) leads, takes over after kill -9 of the leader, and leaves no
//! process, server or temporary directory behind; on PostgreSQL, on Redis, and when interrupted
//! midway as Ctrl-C would.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;

use crate::examples::readme_first_block;
use crate::harness::{Proc, WAIT, is_running, poll_until, require_tool, unique_lock};

/// README's `scripts/try` with `args`, in a temporary directory of its own (which the cluster's
/// user can enter), from a clean environment and `env`.
fn start(name: &str, args: &[&str], env: &[(&str, &str)]) -> (Proc, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let block = readme_first_block();
    let words: Vec<&str> = block[0].split_whitespace().collect();
    let tmp = std::env::temp_dir().join(format!(
        "pgleader-try-test-{}-{}",
        std::process::id(),
        unique_lock()
    ));
    fs::create_dir_all(&tmp).expect("create the script's TMPDIR");
    let mut command = Command::new(root.join(words[0]));
    command
        .current_dir(root)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .env("TMPDIR", &tmp)
        .envs(env.iter().copied())
        .args(&words[1..])
        .args(args)
        .args(["--binary", env!("CARGO_BIN_EXE_pgleader")]);
    if let Some(dir) = std::env::var_os("PGLEADER_TEST_PG_BINDIR") {
        command.env("PGLEADER_TEST_PG_BINDIR", dir);
    }
    // As a terminal starts it: INT neither blocked nor ignored. A child inherits both, and
    // the test runner is not always started from a terminal (a non-interactive shell's
    // background job has INT ignored): bash then never runs the script's INT trap, and the
    // script interrupted midway ran on to its end and exited 0.
    // SAFETY: between fork and exec only async-signal-safe calls (sigprocmask, signal).
    unsafe {
        use std::os::unix::process::CommandExt as _;
        command.pre_exec(|| {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    (Proc::spawn(name, command), tmp)
}

/// One line of /proc/PID/stat: the parent and the start time (in clock ticks since boot).
fn stat(pid: i32) -> Option<(i32, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    Some((fields.get(1)?.parse().ok()?, fields.get(19)?.parse().ok()?))
}

/// Every process of the run, with its start time: the script and what descends from it, and
/// whatever names `tmp` in its command line or environment (the cluster, reparented when
/// pg_ctl exited), with what descends from those.
fn processes_of(script: i32, tmp: &Path) -> BTreeSet<(i32, u64)> {
    let mark = tmp.as_os_str().as_encoded_bytes();
    let names = |pid: i32, file: &str| {
        fs::read(format!("/proc/{pid}/{file}"))
            .is_ok_and(|text| text.windows(mark.len()).any(|window| window == mark))
    };
    let all: Vec<(i32, i32, u64)> = fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| stat(pid).map(|(parent, start)| (pid, parent, start)))
        .collect();
    let mut ours: BTreeSet<i32> = all
        .iter()
        .map(|(pid, _, _)| *pid)
        .filter(|pid| *pid == script || names(*pid, "cmdline") || names(*pid, "environ"))
        .collect();
    loop {
        let before = ours.len();
        for (pid, parent, _) in &all {
            if ours.contains(parent) {
                ours.insert(*pid);
            }
        }
        if ours.len() == before {
            break;
        }
    }
    all.into_iter()
        .filter(|(pid, _, _)| ours.contains(pid))
        .map(|(pid, _, start)| (pid, start))
        .collect()
}

/// Asserts that none of `processes` runs any more, and that `tmp` is empty; removes `tmp`.
fn assert_nothing_left(processes: &BTreeSet<(i32, u64)>, tmp: &Path, run: &Proc) {
    let left: Vec<String> = processes
        .iter()
        .filter(|(pid, start)| is_running(*pid) && stat(*pid).is_some_and(|(_, s)| s == *start))
        .map(|(pid, _)| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            )
        })
        .collect();
    assert!(left.is_empty(), "left running: {left:#?}\n{}", run.dump());
    let files: Vec<PathBuf> = fs::read_dir(tmp)
        .expect("read the script's TMPDIR")
        .flatten()
        .map(|entry| entry.path())
        .collect();
    assert!(files.is_empty(), "left behind: {files:?}\n{}", run.dump());
    let _ = fs::remove_dir(tmp);
}

/// The replica named in the line containing `needle`, after `replica `.
fn replica_in(run: &Proc, needle: &str) -> String {
    let line = run.wait_stdout(needle);
    line.split("replica ")
        .nth(1)
        .and_then(|rest| rest.split([' ', ',', ')']).next())
        .unwrap_or_else(|| panic!("no replica in {line:?}"))
        .to_owned()
}

/// Runs the script to its end: one replica leads, another takes over after the kill -9 and
/// the script says how long it took; nothing of the run is left.
fn leads_takes_over_and_leaves_nothing(args: &[&str]) {
    // As everywhere in the suite (harness::clean): the server is seconds old, and the first
    // leader need not wait out the restart fence here.
    let (run, tmp) = start("scripts/try", args, &[("PGLEADER_RESTART_FENCE", "0")]);
    let killed = replica_in(&run, ", the leader)");
    let took_over = run.wait_stdout("took over: its command started");
    let processes = processes_of(run.pid.as_raw(), &tmp);
    let (status, stdout, _) = run.finish();
    assert!(status.success(), "{}", run.dump());
    let successor = replica_in(&run, "took over");
    assert_ne!(killed, successor, "{}", run.dump());
    assert!(took_over.ends_with(" ms after the kill -9"), "{took_over}");
    for replica in [&killed, &successor] {
        let demo = format!("replica {replica} | demo: replica {replica} leads");
        assert!(
            stdout.iter().any(|line| line.contains(&demo)),
            "{}",
            run.dump()
        );
    }
    let leaders = stdout
        .iter()
        .filter(|line| line.contains("leader: "))
        .count();
    assert_eq!(leaders, 2, "pgleader status, twice:\n{}", run.dump());
    assert_nothing_left(&processes, &tmp, &run);
}

#[test]
fn the_try_script_leads_takes_over_after_kill_9_and_leaves_nothing_behind() {
    leads_takes_over_and_leaves_nothing(&[]);
}

#[test]
fn the_try_script_does_the_same_on_redis() {
    require_tool(
        "redis-server",
        "scripts/try --redis runs one (Debian/Ubuntu: apt-get install redis-server)",
    );
    leads_takes_over_and_leaves_nothing(&["--redis"]);
}

#[test]
fn the_try_script_s_crontab_moves_a_killed_replica_s_jobs_and_drains_a_running_job_on_term() {
    let block = readme_first_block();
    let cron: Vec<&str> = block[1].split_whitespace().skip(1).collect();
    let (run, tmp) = start(
        "scripts/try --cron",
        &cron,
        &[("PGLEADER_RESTART_FENCE", "0")],
    );
    run.wait_stdout("tagged with its job");
    let killed = replica_in(&run, "try: kill -9");
    let drained = replica_in(&run, "try: kill -TERM");
    let processes = processes_of(run.pid.as_raw(), &tmp);
    run.wait_stdout("exited 0 once its backup had finished");
    let (status, stdout, _) = run.finish();
    assert!(status.success(), "{}", run.dump());
    // Every job's lines, tagged, both streams; none from the killed replica after its kill.
    for tag in [
        "job=hello stream=stdout",
        "job=report stream=stderr",
        "job=backup",
    ] {
        assert!(
            stdout.iter().any(|line| line.contains(tag)),
            "{tag}\n{}",
            run.dump()
        );
    }
    let after = |needle: &str| {
        stdout
            .iter()
            .position(|line| line.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?}\n{}", run.dump()))
    };
    let kill = after("try: kill -9");
    assert!(
        !stdout[kill..]
            .iter()
            .any(|line| line.starts_with(&format!("    replica {killed} |"))),
        "{}",
        run.dump()
    );
    // The drained replica's backup, begun before the TERM, finished after it.
    let term = after("try: kill -TERM");
    let finished = format!("    replica {drained} |");
    assert!(
        stdout[term..]
            .iter()
            .any(|line| line.starts_with(&finished) && line.contains("backup: finished")),
        "{}",
        run.dump()
    );
    assert_nothing_left(&processes, &tmp, &run);
}

#[test]
fn the_try_script_interrupted_midway_leaves_nothing_behind() {
    // With the restart fence, as a newcomer runs it: the first leader waits it out, seconds in
    // which the script is surely midway.
    let (run, tmp) = start("scripts/try", &[], &[]);
    run.wait_stdout("three replicas of the demo");
    // Interrupted while the three replicas run, once each has connected.
    let processes = poll_until(
        std::time::Duration::from_millis(20),
        || {
            format!(
                "the replicas did not connect within {WAIT:?}\n{}",
                run.dump()
            )
        },
        || {
            let logs = fs::read_dir(&tmp).ok()?.flatten().next()?.path();
            let connected = (1..=3)
                .filter(|n| {
                    fs::read_to_string(logs.join(format!("replica-{n}.log")))
                        .is_ok_and(|log| log.contains(" connected "))
                })
                .count();
            (connected == 3).then(|| processes_of(run.pid.as_raw(), &tmp))
        },
    );
    assert!(processes.len() > 3, "{processes:?}");
    // Ctrl-C signals the foreground process group: the script (its replicas and servers run in
    // sessions of their own).
    run.signal(Signal::SIGINT);
    let (status, _, _) = run.finish();
    assert_eq!(status.code(), Some(130), "{}", run.dump());
    assert!(
        run.printed(crate::harness::Stream::Stdout, "stopping the replicas"),
        "{}",
        run.dump()
    );
    assert_nothing_left(&processes, &tmp, &run);
}
