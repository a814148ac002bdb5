//! `--pre-start` and `--post-stop` through real failovers, on PostgreSQL and on Redis: the old
//! leader's post-stop has finished before the new leader's pre-start begins, and that before its
//! command starts; a failing or hanging pre-start never starts the command and hands leadership
//! on; a hanging post-stop is killed at its timeout, and only then is the lock released.
//!
//! The hooks and commands write to one journal, each line with the writer's own clock
//! (`date +%s%N`): the order of the lines is the order of the events, and the timestamps say so
//! too.

use nix::sys::signal::Signal;

use crate::harness::fleet::{Fleet, lines_with, on_both_backends};
use crate::harness::{
    Cluster, Journal, Proc, Stream, WAIT, assert_usage_error, field, pgleader, run, unique_lock,
    wait_gone,
};

/// Shell text that journals `<what> <tag> <nanoseconds>`.
fn stamp(journal: &Journal, what: &str, tag: &str) -> String {
    format!(
        "echo {what} {tag} $(date +%s%N) >> {}",
        journal.path.display()
    )
}

/// The hooks of replica `tag`: each journals its begin and end and takes 300 ms between, long
/// enough that a new leader's pre-start beginning before the old post-stop ended would show.
fn hooks(journal: &Journal, tag: &str) -> Vec<String> {
    let hook = |name: &str| {
        format!(
            "--{name}={}; sleep 0.3; {}",
            stamp(journal, &format!("{name}-begin"), tag),
            stamp(journal, &format!("{name}-end"), tag)
        )
    };
    vec![hook("pre-start"), hook("post-stop")]
}

/// Timings that keep the tests quick and satisfy the lease rule with hooks.
const TIMINGS: [&str; 5] = [
    "--check-interval=200ms",
    "--check-timeout=500ms",
    "--kill-timeout=2s",
    "--hook-timeout=3s",
    "--lease=60s",
];

/// The test's timings and the [`hooks`] of replica `tag`: a replica's options.
fn timed_hooks(journal: &Journal, tag: &str) -> Vec<String> {
    let mut args: Vec<String> = TIMINGS.iter().map(|s| (*s).to_owned()).collect();
    args.extend(hooks(journal, tag));
    args
}

/// A command that journals its start, prints `<tag> started backend=<pid>` and waits; TERM ends
/// it at once.
fn command(journal: &Journal, tag: &str) -> String {
    format!(
        "{}; echo {tag} started backend=$PGLEADER_BACKEND_PID; exec sleep 1000",
        stamp(journal, "command", tag)
    )
}

/// Quick checks, a lease long enough for any hook, and `--hook-timeout=<timeout>`: the options
/// of a replica whose hook will hang.
fn hanging_hook_options(timeout: &str) -> Vec<String> {
    vec![
        "--check-interval=200ms".to_owned(),
        "--check-timeout=500ms".to_owned(),
        format!("--hook-timeout={timeout}"),
        "--lease=60s".to_owned(),
    ]
}

/// A hook that hangs with a child: it writes the child's pid and its own to `pids`, and waits.
fn hanging_tree(pids: &Journal) -> String {
    format!(
        "sleep 1000 & echo $! >> {p}; echo $$ >> {p}; wait",
        p = pids.path.display()
    )
}

/// The pids a [`hanging_tree`] wrote.
fn pids_in(pids: &Journal) -> Vec<i32> {
    pids.lines()
        .iter()
        .map(|pid| pid.parse().expect("pid"))
        .collect()
}

/// Asserts that each of a hanging `hook`'s processes is gone (killed at its timeout).
fn assert_gone(pids: &[i32], hook: &str) {
    for &pid in pids {
        assert!(
            wait_gone(pid, WAIT),
            "{hook}'s process {pid} outlived its timeout"
        );
    }
}

/// The journal's events as `(what, tag, nanoseconds)`.
fn events(journal: &Journal) -> Vec<(String, String, u128)> {
    journal
        .lines()
        .iter()
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words
                .get(2)
                .and_then(|ns| ns.parse().ok())
                .unwrap_or_else(|| panic!("no timestamp in {line:?}"));
            (words[0].to_owned(), words[1].to_owned(), at)
        })
        .collect()
}

/// Asserts that the journal holds exactly the full cycles of `tags`' leaderships, one after
/// the other (each replica's post-stop ended before the next one's pre-start began), with
/// timestamps that never go back; `last_runs` when the last leader still leads.
fn assert_in_order(journal: &Journal, tags: &[&str], logs: &[&Proc]) {
    let events = events(journal);
    let mut expected = Vec::new();
    for (i, tag) in tags.iter().enumerate() {
        expected.extend(["pre-start-begin", "pre-start-end", "command"].map(|what| (what, *tag)));
        if i + 1 < tags.len() {
            expected.extend(["post-stop-begin", "post-stop-end"].map(|what| (what, *tag)));
        }
    }
    let seen: Vec<(&str, &str)> = events
        .iter()
        .map(|(what, tag, _)| (what.as_str(), tag.as_str()))
        .collect();
    let dumps: String = logs.iter().map(|p| p.dump()).collect();
    assert_eq!(seen, expected, "events out of order\n{dumps}");
    for pair in events.windows(2) {
        assert!(
            pair[0].2 <= pair[1].2,
            "{pair:?}: the timestamps go back\n{dumps}"
        );
    }
}

/// A leadership passed on by SIGTERM, then by kill -9 of pgleader, then by `pgleader
/// step-down`: A, B, C, then D, each post-stop over before the next pre-start began.
fn hooks_run_in_order_through_sigterm_kill_9_and_step_down(fleet: &Fleet) {
    let journal = Journal::new("hooks");
    let start =
        |tag: &str| fleet.replica(tag, &timed_hooks(&journal, tag), &command(&journal, tag));
    let a = start("A");
    a.wait_stdout("A started");
    let b = start("B");
    b.wait_log("waiting for the lock");

    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    a.wait_exit();
    let c = start("C");
    c.wait_log("waiting for the lock");

    b.signal(Signal::SIGKILL);
    c.wait_stdout("C started");
    let d = start("D");
    d.wait_log("waiting for the lock");

    let (code, out, err) = fleet.step_down();
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    d.wait_stdout("D started");
    assert_in_order(&journal, &["A", "B", "C", "D"], &[&a, &b, &c, &d]);
    assert!(
        !c.has_exited(),
        "the stepped-down leader exited\n{}",
        c.dump()
    );
    for replica in [&c, &d] {
        replica.signal(Signal::SIGTERM);
        replica.wait_exit();
    }
}

on_both_backends! { &Fleet::postgres(), &Fleet::redis("hooks");
    hooks_run_in_order_through_sigterm_kill_9_and_step_down:
        on_postgres_hooks_run_in_order_through_sigterm_kill_9_and_step_down,
        on_redis_hooks_run_in_order_through_sigterm_kill_9_and_step_down;
}

#[test]
fn after_the_server_ends_the_leaders_session_a_takeover_delay_keeps_the_hooks_in_order() {
    // The server frees the lock the moment it ends the session: only --takeover-delay (here
    // longer than the old leader's stop and post-stop) keeps the next pre-start behind the
    // old post-stop, as docs/operating.md says.
    let fleet = Fleet::postgres();
    let journal = Journal::new("terminated");
    let start = |name: &str| {
        let mut args = timed_hooks(&journal, name);
        args.push("--takeover-delay=2s".to_owned());
        fleet.replica(name, &args, &command(&journal, name))
    };
    let a = start("A");
    let started = a.wait_stdout("A started");
    let b = start("B");
    b.wait_log("waiting for the lock");

    Cluster::shared().terminate_backend(field(&started, "backend").parse().expect("backend pid"));
    b.wait_stdout("B started");
    assert_in_order(&journal, &["A", "B"], &[&a, &b]);
}

#[test]
fn a_failing_pre_start_never_starts_the_command_runs_post_stop_and_hands_leadership_on() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let journal = Journal::new("failing");
    let mut args: Vec<String> = TIMINGS.iter().map(|s| (*s).to_owned()).collect();
    args.push(format!(
        "--pre-start={}; echo cannot attach >&2; exit 3",
        stamp(&journal, "pre-start", "A")
    ));
    args.push(format!("--post-stop={}", stamp(&journal, "post-stop", "A")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let a = run("A", cluster, lock, &args, &command(&journal, "A"));
    let failed = a.wait_log("--pre-start failed:");
    assert!(failed.contains("exit code 3"), "{failed}");
    a.wait_log("cannot attach hook=pre-start");
    a.wait_log("released the lock");
    a.wait_log("entering the election again in 1s");
    // Alone, it tries again, fails again, and sits out longer.
    a.wait_for_nth(Stream::Stderr, "--pre-start failed: exit code 3", 2);
    a.wait_log("entering the election again in 2s");

    // A healthy replica takes the lock A gave up.
    let b = run("B", cluster, lock, &TIMINGS, &command(&journal, "B"));
    b.wait_stdout("B started");
    let a_lines: Vec<(String, String)> = events(&journal)
        .into_iter()
        .filter(|(_, tag, _)| tag == "A")
        .map(|(what, tag, _)| (what, tag))
        .collect();
    assert!(
        a_lines.iter().all(|(what, _)| what != "command"),
        "A's command ran\n{}",
        a.dump()
    );
    // Each failed pre-start was followed by its post-stop, before anything else of A's.
    assert!(a_lines.len() >= 4, "{a_lines:?}\n{}", a.dump());
    for pair in a_lines.chunks(2) {
        assert_eq!(
            pair.iter()
                .map(|(what, _)| what.as_str())
                .collect::<Vec<_>>(),
            ["pre-start", "post-stop"],
            "{a_lines:?}\n{}",
            a.dump()
        );
    }
    assert!(a.lines(Stream::Stdout).is_empty(), "{}", a.dump());
}

#[test]
fn a_hanging_pre_start_is_killed_at_its_timeout_with_its_tree_and_the_command_never_starts() {
    let fleet = Fleet::redis("hanging-pre");
    let pids = Journal::new("hanging-pre");
    let mut args = hanging_hook_options("500ms");
    args.push(format!("--pre-start={}", hanging_tree(&pids)));
    let a = fleet.replica("A", &args, "echo A started; exec sleep 1000");
    let failed = a.wait_log("--pre-start failed");
    assert!(failed.contains("ran past --hook-timeout"), "{failed}");
    let hook_pids = pids_in(&pids);
    assert_eq!(hook_pids.len(), 2, "{}", a.dump());
    assert_gone(&hook_pids, "pre-start");
    a.wait_log("released the lock");
    assert!(a.lines(Stream::Stdout).is_empty(), "{}", a.dump());
}

#[test]
fn a_hanging_post_stop_is_killed_at_its_timeout_and_only_then_is_the_lock_released() {
    let fleet = Fleet::postgres();
    let journal = Journal::new("hanging-post");
    let pids = Journal::new("hanging-post-pids");
    let options = hanging_hook_options("700ms");
    let mut args = options.clone();
    args.push(format!(
        "--post-stop={}; {}",
        stamp(&journal, "post-stop-begin", "A"),
        hanging_tree(&pids)
    ));
    let a = fleet.replica("A", &args, &command(&journal, "A"));
    a.wait_stdout("A started");
    let b = fleet.replica("B", &options, &command(&journal, "B"));
    b.wait_log("waiting for the lock");

    a.signal(Signal::SIGTERM);
    b.wait_stdout("B started");
    let failed = a.wait_log("--post-stop failed");
    assert!(failed.contains("ran past --hook-timeout"), "{failed}");
    assert_gone(&pids_in(&pids), "post-stop");
    let events = events(&journal);
    let at = |what: &str, tag: &str| {
        events
            .iter()
            .find(|(w, t, _)| w == what && t == tag)
            .map(|(_, _, at)| *at)
            .unwrap_or_else(|| panic!("no {what} of {tag}: {events:?}"))
    };
    let waited_ms = (at("command", "B") - at("post-stop-begin", "A")) / 1_000_000;
    assert!(
        waited_ms >= 700,
        "B started {waited_ms} ms after A's post-stop began, before its 700 ms timeout\n{}{}",
        a.dump(),
        b.dump()
    );
    a.wait_exit();
}

#[test]
fn hooks_get_the_commands_environment_and_their_output_is_logged_tagged() {
    let cluster = Cluster::shared();
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", cluster.url())
        .args(["--log-format=json", "run", "--once", "--lease=20s"])
        .arg(format!("--lock-id={}", unique_lock()))
        .arg("--pre-start=echo said $PGLEADER_HOOK epoch=$PGLEADER_EPOCH")
        .arg("--post-stop=echo said $PGLEADER_HOOK exit=$PGLEADER_EXIT_CODE epoch=$PGLEADER_EPOCH")
        .args(["--", "sh", "-c", "echo ran epoch=$PGLEADER_EPOCH; exit 4"]);
    let once = Proc::spawn("once", command);
    let (status, stdout, stderr) = once.finish();
    assert_eq!(status.code(), Some(4), "{}", once.dump());
    let epoch = field(&stdout.join(" "), "epoch");
    let logged = |text: &str| -> serde_json::Value {
        stderr
            .iter()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|line| line["message"].as_str().is_some_and(|m| m.contains(text)))
            .unwrap_or_else(|| panic!("no JSON log line with {text:?}\n{}", once.dump()))
    };
    let pre = logged("said pre-start");
    assert_eq!(pre["event"], "hook_output");
    assert_eq!(pre["hook"], "pre-start");
    assert_eq!(pre["message"], format!("said pre-start epoch={epoch}"));
    let post = logged("said post-stop");
    assert_eq!(post["hook"], "post-stop");
    assert_eq!(
        post["message"],
        format!("said post-stop exit=4 epoch={epoch}")
    );
    // Once each, in order around the command.
    let order: Vec<&str> = stderr
        .iter()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|line| match line["event"].as_str()? {
            "hook_finished" => Some(if line["hook"] == "pre-start" {
                "pre"
            } else {
                "post"
            }),
            "child_started" => Some("command"),
            "released" => Some("released"),
            _ => None,
        })
        .collect();
    assert_eq!(
        order,
        ["pre", "command", "post", "released"],
        "{}",
        once.dump()
    );
}

#[test]
fn hooks_that_the_lease_cannot_cover_or_that_are_empty_are_usage_errors() {
    for (args, expected) in [
        (
            vec!["--post-stop=true"],
            "--check-interval + --check-timeout + --kill-timeout + --hook-timeout = 13s",
        ),
        (
            vec!["--pre-start= "],
            "a shell command line must not be empty",
        ),
        (
            vec!["--pre-start=true", "--hook-timeout=0s"],
            "--hook-timeout",
        ),
    ] {
        assert_usage_error(&args, expected);
    }
}

#[test]
fn with_shards_each_shards_post_stop_finishes_before_its_next_holders_pre_start() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let journal = Journal::new("shard-hooks");
    let start = |tag: &str| {
        let hook = |name: &str| {
            format!(
                "--{name}=echo {name}-begin {tag} $PGLEADER_SHARD >> {p}; sleep 0.2; echo {name}-end {tag} $PGLEADER_SHARD >> {p}",
                p = journal.path.display()
            )
        };
        let args = [
            "--shards=4".to_owned(),
            "--hook-timeout=2s".to_owned(),
            "--lease=15s".to_owned(),
            hook("pre-start"),
            hook("post-stop"),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let script = format!(
            "echo command {tag} $PGLEADER_SHARD >> {p}; echo {tag} started shard=$PGLEADER_SHARD; exec sleep 1000",
            p = journal.path.display()
        );
        run(tag, cluster, lock, &args, &script)
    };
    let a = start("A");
    for n in 1..=4 {
        a.wait_for_nth(Stream::Stdout, " started ", n);
    }
    let b = start("B");
    b.wait_for_nth(Stream::Stdout, " started ", 2);

    let lines = journal.lines();
    let handed: Vec<String> = b
        .lines(Stream::Stdout)
        .iter()
        .map(|line| field(line, "shard"))
        .collect();
    for shard in ["0", "1", "2", "3"] {
        let of_shard: Vec<String> = lines
            .iter()
            .filter(|line| line.ends_with(&format!(" {shard}")))
            .map(|line| line.rsplit_once(' ').expect("a shard").0.to_owned())
            .collect();
        let mut expected = vec!["pre-start-begin A", "pre-start-end A", "command A"];
        if handed.contains(&shard.to_owned()) {
            expected.extend([
                "post-stop-begin A",
                "post-stop-end A",
                "pre-start-begin B",
                "pre-start-end B",
                "command B",
            ]);
        }
        assert_eq!(
            of_shard,
            expected,
            "shard {shard}\n{}{}",
            a.dump(),
            b.dump()
        );
    }
}

#[test]
fn with_a_schedule_the_hooks_wrap_each_run() {
    let cluster = Cluster::shared();
    let journal = Journal::new("scheduled-hooks");
    let table = format!("hooks_ledger_{}", unique_lock());
    let args = [
        "--schedule=* * * * * *".to_owned(),
        format!("--ledger-table={table}"),
        "--lease=15s".to_owned(),
        format!("--pre-start={}", journal.append("pre-start")),
        format!("--post-stop={}", journal.append("post-stop")),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let script = format!("{}; echo ran", journal.append("command"));
    let a = run("A", cluster, unique_lock(), &args, &script);
    a.wait_for_nth(Stream::Stdout, "ran", 2);
    a.wait_for_nth(Stream::Stderr, "--post-stop finished", 2);
    let lines = journal.lines();
    assert_eq!(
        &lines[..6],
        [
            "pre-start",
            "command",
            "post-stop",
            "pre-start",
            "command",
            "post-stop"
        ],
        "{}",
        a.dump()
    );
    // The lock was kept between the runs: one leadership.
    let leaderships = lines_with(&a, Stream::Stderr, &["became leader"]);
    assert_eq!(leaderships.len(), 1, "{}", a.dump());
}

#[test]
fn a_stop_signal_of_sigkill_still_lets_post_stop_finish_before_the_release() {
    // SIGKILL to the job's group would take the keeper, which runs post-stop: it goes through
    // the keeper instead.
    let cluster = Cluster::shared();
    let journal = Journal::new("sigkill");
    let args = [
        "--once".to_owned(),
        "--kill-signal=KILL".to_owned(),
        "--lease=20s".to_owned(),
        format!(
            "--post-stop={}; sleep 0.5; {}",
            journal.append("post-stop-begin"),
            journal.append("post-stop-end")
        ),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let a = run("A", cluster, unique_lock(), &args, "sleep 1000 & exit 0");
    let (status, _, stderr) = a.finish();
    assert_eq!(status.code(), Some(0), "{}", a.dump());
    assert_eq!(
        journal.lines(),
        ["post-stop-begin", "post-stop-end"],
        "{}",
        a.dump()
    );
    let at = |text: &str| {
        stderr
            .iter()
            .position(|line| line.contains(text))
            .unwrap_or_else(|| panic!("no {text:?}\n{}", a.dump()))
    };
    assert!(
        at("--post-stop finished") < at("released the lock"),
        "{}",
        a.dump()
    );
}

#[test]
fn a_lost_lock_during_pre_start_stops_it_and_runs_post_stop_once() {
    let cluster = Cluster::shared();
    let lock = unique_lock();
    let args = [
        "--check-interval=200ms",
        "--check-timeout=500ms",
        "--hook-timeout=30s",
        "--lease=60s",
        "--pre-start=echo entered; exec sleep 1000",
        "--post-stop=echo undone",
    ];
    let a = run("A", cluster, lock, &args, "echo A started; exec sleep 1000");
    let leader = a.wait_log("became leader");
    a.wait_log("entered hook=pre-start");
    cluster.terminate_backend(field(&leader, "backend_pid").parse().expect("backend pid"));
    // It reconnects, wins again (alone) and runs pre-start again: one post-stop between.
    a.wait_for_nth(Stream::Stderr, "entered hook=pre-start", 2);
    let hooks = lines_with(&a, Stream::Stderr, &["entered hook=", "undone hook="]);
    assert_eq!(hooks.len(), 3, "{hooks:?}\n{}", a.dump());
    assert!(hooks[1].contains("undone"), "{hooks:?}\n{}", a.dump());
    assert!(a.lines(Stream::Stdout).is_empty(), "{}", a.dump());
    a.signal(Signal::SIGTERM);
    a.wait_exit();
}

#[test]
fn a_second_term_kills_a_running_post_stop() {
    let cluster = Cluster::shared();
    let args = [
        "--hook-timeout=30s",
        "--lease=60s",
        "--post-stop=echo undoing; exec sleep 1000",
    ];
    let a = run(
        "A",
        cluster,
        unique_lock(),
        &args,
        "echo A started; exec sleep 1000",
    );
    a.wait_stdout("A started");
    a.signal(Signal::SIGTERM);
    a.wait_log("undoing hook=post-stop");
    // A second TERM within a second of the first is taken for the same one, repeated (as
    // timeout(1) sends it): this one must come later.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    a.signal(Signal::SIGTERM);
    a.wait_log("second shutdown signal: killing --post-stop");
    let failed = a.wait_log("--post-stop failed");
    assert!(failed.contains("interrupted"), "{failed}");
    a.wait_exit();
}

#[test]
fn with_a_schedule_a_post_stop_longer_than_the_checks_deadline_keeps_the_leadership() {
    let cluster = Cluster::shared();
    let table = format!("hooks_ledger_{}", unique_lock());
    let args = [
        "--schedule=* * * * * *".to_owned(),
        format!("--ledger-table={table}"),
        "--check-interval=200ms".to_owned(),
        "--check-timeout=300ms".to_owned(),
        "--hook-timeout=3s".to_owned(),
        "--lease=20s".to_owned(),
        "--post-stop=sleep 1".to_owned(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let a = run("A", cluster, unique_lock(), &args, "echo ran");
    a.wait_for_nth(Stream::Stderr, "--post-stop finished", 2);
    let lost = lines_with(&a, Stream::Stderr, &["leadership lost", "became leader"]);
    assert_eq!(lost.len(), 1, "{lost:?}\n{}", a.dump());
}
