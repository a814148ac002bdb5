//! `pgleader cron`'s jobs' output as log lines of their own (without `--passthrough-logs`):
//! each line names its job, stream, occurrence and replica, in text and in JSON; long lines
//! are split into marked parts, bytes that are not UTF-8 escaped, both streams' lines kept
//! whole and in order under a lot of output; a run's last line survives a kill -9 of
//! pgleader; and a fleet reading only these lines runs each occurrence once, through a kill -9,
//! on PostgreSQL and Redis. The other crontab scenarios read the jobs' output as it is
//! (`cron_replica` passes `--passthrough-logs`).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::cron_fleet::{
    a_killed_replica_s_jobs_run_on_the_other, stop_and_assert_each_occurrence_once,
    three_replicas_share_six_jobs,
};
use crate::cron_history::runs_until;
use crate::crontab::File;
use crate::harness::process::{poll_until, wait_gone};
use crate::harness::{Cluster, Proc, Redis, Stream, field, pgleader, printed, unique_lock};
use crate::redis_shards::QUICK;

/// `pgleader cron --lock-id LOCK ARGS FILE` against the server of `url`, its jobs' output
/// tagged (the default).
pub fn tagged(name: &str, url: &str, lock: i64, args: &[&str], file: &File) -> Proc {
    let mut command = pgleader();
    command
        .env("PGLEADER_DATABASE_URL", url)
        .arg("cron")
        .arg(format!("--lock-id={lock}"))
        .args(args)
        .arg(&file.0);
    Proc::spawn(name, command)
}

/// This machine's name, as pgleader names a replica's host.
fn host() -> String {
    nix::unistd::gethostname()
        .expect("a host name")
        .into_string()
        .expect("UTF-8")
}

/// The JSON log lines of `replica` for job `job`'s occurrence `at`.
fn json_lines_of(replica: &Proc, job: &str, at: &str) -> Vec<serde_json::Value> {
    replica
        .lines(Stream::Stderr)
        .iter()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .unwrap_or_else(|err| panic!("a log line that is not JSON ({err}): {line:?}"))
        })
        .filter(|value| value["event"] == "output" && value["job"] == job)
        .filter(|value| value["occurrence"] == at)
        .collect()
}

#[test]
fn each_line_a_job_writes_is_a_log_line_naming_its_job_stream_occurrence_and_replica() {
    let file = File::new(
        "tagged-text",
        "# pgleader: name=talk\n\
         * * * * * * * echo 'out one'; echo 'out two'; echo 'err one' >&2; printf 'no newline'\n",
    );
    let a = tagged("A", &Cluster::shared().url(), unique_lock(), &[], &file);
    let last = a.wait_line_where(Stream::Stderr, "the run's last line", |line| {
        printed(line).as_deref() == Some("no newline")
    });
    let at = field(&last, "occurrence");
    // stdout and stderr are relayed apart: "err one" may come after the last stdout line.
    for text in ["out one", "out two", "err one"] {
        a.wait_line_where(Stream::Stderr, text, |line| {
            printed(line).as_deref() == Some(text) && line.contains(&format!(" occurrence={at} "))
        });
    }
    let of_run: BTreeMap<String, String> = a
        .lines(Stream::Stderr)
        .iter()
        .filter(|line| line.contains(&format!(" occurrence={at} ")))
        .filter_map(|line| Some((printed(line)?, field(line, "stream"))))
        .collect();
    let expected: BTreeMap<String, String> = [
        ("out one", "stdout"),
        ("out two", "stdout"),
        ("err one", "stderr"),
        ("no newline", "stdout"),
    ]
    .into_iter()
    .map(|(text, stream)| (text.to_owned(), stream.to_owned()))
    .collect();
    assert_eq!(of_run, expected, "{}", a.dump());
    assert_eq!(field(&last, "job"), "talk");
    assert_eq!(
        field(&last, "replica"),
        format!("{}@{}", a.pid, host()),
        "{last}"
    );
    // Nothing of it went out as it is.
    assert!(!a.printed(Stream::Stdout, "out one"), "{}", a.dump());
    a.interrupt_cleanly();
}

#[test]
fn long_lines_binary_bytes_and_a_lot_of_output_on_both_streams_stay_whole_in_valid_json() {
    const LONG: usize = 10_000;
    const COUNT: usize = 10_000;
    // Once: the next occurrences find the mark and print nothing.
    // Named after this test process too: lock ids start again in each, and a file a failed
    // run left behind would keep the job quiet.
    let once = std::env::temp_dir().join(format!(
        "pgleader-loud-{}-{}",
        std::process::id(),
        unique_lock()
    ));
    let file = File::new(
        "tagged-json",
        &format!(
            "# pgleader: name=loud\n\
             * * * * * * * [ -e {once} ] && exit 0; touch {once}; \
             head -c {LONG} /dev/zero | tr '\\0' x; echo; printf '\\377\\376 bin\\n'; \
             seq 1 {COUNT} & seq 1 {COUNT} >&2; wait; printf 'the end'\n",
            once = once.display()
        ),
    );
    let a = tagged(
        "A",
        &Cluster::shared().url(),
        unique_lock(),
        &["--log-format=json"],
        &file,
    );
    let last = a.wait_line_where(Stream::Stderr, "the run's last line", |line| {
        line.contains("\"message\":\"the end\"")
    });
    let last: serde_json::Value = serde_json::from_str(&last).expect("JSON");
    let at = last["occurrence"]
        .as_str()
        .expect("an occurrence")
        .to_owned();
    // stderr is relayed apart from stdout: its last line may come after "the end".
    a.wait_line_where(Stream::Stderr, "stderr's last number", |line| {
        line.contains(&format!("\"message\":\"{COUNT}\""))
            && line.contains("\"stream\":\"stderr\"")
            && line.contains(&format!("\"occurrence\":\"{at}\""))
    });
    let lines = json_lines_of(&a, "loud", &at);
    let text = |value: &serde_json::Value| value["message"].as_str().expect("a message").to_owned();

    // The long line: parts numbered from 1, each log line within 4 KiB, the text whole.
    let parts: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|value| value.get("part").is_some())
        .collect();
    assert!(parts.len() >= 3, "{LONG} bytes in {} parts", parts.len());
    let numbers: Vec<u64> = parts
        .iter()
        .map(|value| value["part"].as_u64().expect("a part number"))
        .collect();
    assert_eq!(numbers, (1..=parts.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        parts.iter().map(|v| text(v)).collect::<String>(),
        "x".repeat(LONG)
    );
    for line in a.lines(Stream::Stderr) {
        assert!(line.len() < 4096, "a log line of {} bytes", line.len());
    }

    // Bytes that are not UTF-8, escaped.
    assert!(
        lines.iter().any(|value| text(value) == "\\xff\\xfe bin"),
        "{}",
        a.dump()
    );

    // Both streams at once: every line, whole and in order.
    for stream in ["stdout", "stderr"] {
        let counted: Vec<String> = lines
            .iter()
            .filter(|value| value["stream"] == stream && value.get("part").is_none())
            .map(text)
            .filter(|text| text.chars().all(|c| c.is_ascii_digit()) && !text.is_empty())
            .collect();
        let expected: Vec<String> = (1..=COUNT).map(|n| n.to_string()).collect();
        assert!(
            counted == expected,
            "{stream}: {} lines, not 1 to {COUNT} in order",
            counted.len()
        );
    }
    assert_eq!(last["replica"], format!("{}@{}", a.pid, host()));
    a.interrupt_cleanly();
    let _ = std::fs::remove_file(&once);
}

#[test]
fn a_run_s_last_line_reaches_the_log_after_pgleader_is_killed_9() {
    let file = File::new(
        "tagged-kill",
        "# pgleader: name=slow\n\
         * * * * * * * echo started pid=$$; printf 'unfinished'; exec sleep 1000\n",
    );
    let a = tagged("A", &Cluster::shared().url(), unique_lock(), &[], &file);
    let started = a.wait_line_where(Stream::Stderr, "the run started", |line| {
        printed(line).is_some_and(|text| text.starts_with("started pid="))
    });
    let pid: i32 = printed(&started).expect("tagged")["started pid=".len()..]
        .parse()
        .expect("a pid");
    // The printf is done once the shell has become the sleep: killed before that, the run
    // would have had no last line to lose (under load, the kill can come between the two).
    poll_until(
        Duration::from_millis(5),
        || format!("the run (pid {pid}) never became the sleep\n{}", a.dump()),
        || {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (comm.trim_end() == "sleep").then_some(())
        },
    );
    // The unfinished line waits in the keeper for its end; pgleader dies before that.
    let unfinished = |line: &str| printed(line).as_deref() == Some("unfinished");
    assert!(
        !a.lines(Stream::Stderr).iter().any(|line| unfinished(line)),
        "{}",
        a.dump()
    );
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let last = a
        .wait_line(
            Stream::Stderr,
            "INFO  unfinished job=",
            1,
            None,
            crate::harness::WAIT,
        )
        .map(|(line, _)| line)
        .filter(|line| unfinished(line))
        .unwrap_or_else(|| panic!("no unfinished line within the wait\n{}", a.dump()));
    assert_eq!(field(&last, "job"), "slow");
    // The line is written at the pipe's end, which a process killed -9 closes as it exits,
    // a moment before it is gone: the run goes at once after, not necessarily before.
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "the run outlived pgleader\n{}",
        a.dump()
    );
}

/// [`Spawn`] for a tagged replica on `url`'s server, with `args`.
fn tagged_on(
    url: String,
    lock: i64,
    args: &'static [&'static str],
) -> impl Fn(&str, &File) -> Proc {
    move |name, file| tagged(name, &url, lock, args, file)
}

/// Two of the fleet's scenarios on `url`'s server, each on a lock of its own, the runs read
/// from the tagged lines alone.
fn a_fleet_reading_tagged_lines_runs_each_occurrence_once(
    url: &str,
    args: &'static [&'static str],
) {
    let ([a, b, c], _) = three_replicas_share_six_jobs(&tagged_on(url.into(), unique_lock(), args));
    stop_and_assert_each_occurrence_once(&[&a, &b, &c]);
    a_killed_replica_s_jobs_run_on_the_other(&tagged_on(url.into(), unique_lock(), args));
}

#[test]
fn on_postgres_a_fleet_with_tagged_output_shares_its_jobs_and_survives_a_kill_9() {
    a_fleet_reading_tagged_lines_runs_each_occurrence_once(&Cluster::shared().url(), &[]);
}

#[test]
fn on_redis_a_fleet_with_tagged_output_shares_its_jobs_and_survives_a_kill_9() {
    a_fleet_reading_tagged_lines_runs_each_occurrence_once(&Redis::shared().url(), &QUICK);
}

/// `pgleader status --lock-id LOCK ARGS` on `url`'s server.
fn status_on(url: &str, lock: i64) -> impl Fn(&str, &[&str]) -> Proc {
    move |name, args| {
        let mut command = pgleader();
        command
            .env("PGLEADER_DATABASE_URL", url)
            .args(["status", &format!("--lock-id={lock}")])
            .args(args);
        Proc::spawn(name, command)
    }
}

/// The run of `job` that `status --job` shows once one has ended as `outcome` with its output
/// kept (or, `kept` false, once one has ended so at all).
fn ended_run(url: &str, lock: i64, job: &str, outcome: &str, kept: bool) -> serde_json::Value {
    let ended =
        |run: &serde_json::Value| run["outcome"] == outcome && (!kept || run["output"].is_string());
    let seen = runs_until(&status_on(url, lock), job, ended);
    let runs = seen["runs"].as_array().expect("runs");
    runs.iter().find(|run| ended(run)).expect("the run").clone()
}

/// A run's last lines are kept with its ledger row, bounded by --keep-output, from a whole
/// line, both streams, bytes that are not text escaped; shown by `status --job` in JSON and
/// indented under the run in text; a run stopped with its replica keeps them too, as
/// interrupted; --keep-output 0 keeps nothing.
fn a_run_s_last_lines_are_kept_with_its_ledger_row(url: &str, args: &[&str]) {
    let file = File::new(
        "kept",
        "# pgleader: name=talk\n\
         * * * * * * * for i in $(seq -w 1 40); do echo \"line $i\"; done; echo warned >&2; \
         printf 'bin\\377'; exit 3\n\
         # pgleader: name=long\n\
         * * * * * * * echo begun; exec sleep 1000\n",
    );
    let lock = unique_lock();
    let mut with = args.to_vec();
    with.extend(["--keep-output", "100"]);
    let a = tagged("A", url, lock, &with, &file);
    let run = ended_run(url, lock, "talk", "failed", true);
    let output = run["output"].as_str().expect("output kept");
    // 100 bytes, the one that is not text written in four characters.
    assert!(output.len() <= 100 + 3, "{output:?}");
    assert!(
        output.starts_with("line "),
        "not from a whole line: {output:?}"
    );
    // The two streams' last lines in the order they ended, which the pipes do not fix.
    let (_, last) = output
        .split_once("line 40\n")
        .expect("the last stdout line");
    assert!(
        ["warned\nbin\\xff\n", "bin\\xff\nwarned\n"].contains(&last),
        "{output:?}"
    );
    // The text: the run's lines indented under it.
    let text = status_on(url, lock)("status --job text", &["--job", "talk"]);
    assert_eq!(text.wait_code(), 0, "{}", text.dump());
    let lines = text.lines(Stream::Stdout);
    assert!(
        lines.iter().any(|line| line == "      | line 40"),
        "{lines:?}"
    );
    // A run stopped with its replica (INT: at once) is recorded as interrupted, with its lines.
    a.wait_line_where(Stream::Stderr, "the long run began", |line| {
        printed(line).as_deref() == Some("begun")
    });
    a.interrupt_cleanly();
    let run = ended_run(url, lock, "long", "interrupted", true);
    assert_eq!(run["output"], "begun\n", "{run}");
    // Nothing kept with 0.
    let lock = unique_lock();
    let mut with = args.to_vec();
    with.extend(["--keep-output", "0"]);
    let b = tagged("B", url, lock, &with, &file);
    let run = ended_run(url, lock, "talk", "failed", false);
    assert!(run["output"].is_null(), "{run}");
    b.interrupt_cleanly();
}

#[test]
fn on_postgres_a_run_s_last_lines_are_kept_with_its_ledger_row() {
    a_run_s_last_lines_are_kept_with_its_ledger_row(&Cluster::shared().url(), &[]);
}

#[test]
fn on_redis_a_run_s_last_lines_are_kept_with_its_ledger_row() {
    a_run_s_last_lines_are_kept_with_its_ledger_row(&Redis::shared().url(), &QUICK);
}

#[test]
fn a_keep_output_size_out_of_range_is_refused_with_exit_2() {
    let file = File::new("kept-bad", "* * * * * true\n");
    for bad in ["65KiB", "lots", "-1"] {
        let refused = tagged(
            "bad size",
            &Cluster::shared().url(),
            unique_lock(),
            &[&format!("--keep-output={bad}")],
            &file,
        );
        assert_eq!(refused.wait_code(), 2, "{}", refused.dump());
        assert!(
            refused
                .lines(Stream::Stderr)
                .iter()
                .any(|line| line.contains("--keep-output")),
            "{}",
            refused.dump()
        );
    }
}
