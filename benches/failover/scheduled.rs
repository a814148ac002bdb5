//! Scenario 8, scheduled jobs (issue 8): how late the command starts after its occurrence on
//! the server's clock, on a steady leader and right after the leader was killed; what an idle
//! scheduled leader costs; and, side by side, how many times a job ran per occurrence when
//! three hosts' timers fire for it a little apart, under `--schedule --once` and under the
//! `--once --no-wait` a cron user would otherwise write.
//!
//! The benchmark, the server and the replicas share one machine and so one wall clock: an
//! occurrence's instant on the server's clock can be compared with the moment a job's line
//! reached the benchmark's pipe, converted from the monotonic clock to the wall clock once.

use std::collections::BTreeMap;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use chrono::{DateTime, SubsecRound, Utc};
use nix::sys::signal::Signal;

use crate::figures::{Cost, Figures, Row, SCHEDULED_ROLE, TimerCount};
use crate::harness::{self, Journal, Stream};
use crate::tools::{Candidate, Pgleader, SETUP_WAIT, Usage};

/// The job: a line with the occurrence it runs for.
fn job(tag: &str) -> String {
    format!("echo {tag} ran $PGLEADER_SCHEDULED_TIME")
}

/// A scheduled replica with pgleader's defaults.
fn replica(
    pg: &Pgleader,
    tag: &str,
    lock: i64,
    schedule: &str,
    extra: &[&str],
    script: &str,
) -> Candidate {
    let mut command = harness::pgleader();
    command
        .env_remove("PGLEADER_RESTART_FENCE")
        .env("PGLEADER_DATABASE_URL", pg.cluster.url())
        .arg("run")
        .arg(format!("--lock-id={lock}"))
        .args(["--schedule", schedule, "--ledger-table", "bench_ledger"])
        .args(extra)
        .args(["--", "sh", "-c", script]);
    Candidate::spawn(tag, command)
}

/// Converts the monotonic moments lines arrived at to wall-clock time.
struct WallClock(Instant, SystemTime);

impl WallClock {
    fn now() -> WallClock {
        WallClock(Instant::now(), SystemTime::now())
    }

    fn at(&self, instant: Instant) -> DateTime<Utc> {
        let wall = if instant >= self.0 {
            self.1 + (instant - self.0)
        } else {
            self.1 - (self.0 - instant)
        };
        wall.into()
    }
}

fn parse(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|at| at.with_timezone(&Utc))
}

/// Milliseconds from `occurrence` to `at` (negative: early).
fn late_ms(occurrence: DateTime<Utc>, at: DateTime<Utc>) -> f64 {
    (at - occurrence).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

/// The occurrence a `<tag> ran <occurrence>` line names.
fn occurrence_in(line: &str) -> Option<DateTime<Utc>> {
    parse(line.rsplit(' ').next()?)
}

fn row(id: &str, measure: &'static str, figures: Figures, note: String) -> Row {
    Row {
        id: id.into(),
        scenario: "8. scheduled job".into(),
        tool: "pgleader",
        measure,
        figures,
        old_child_stopped: None,
        note,
    }
}

/// A steady leader (and a follower) on an every-second schedule: from each occurrence to its
/// job's line. The first run, which may catch up an occurrence from before the start, is left
/// out.
pub fn on_time(pg: &Pgleader, runs: usize) -> Row {
    eprintln!("bench: 8. scheduled: occurrence to command, steady leader");
    let mut figures = Figures::default();
    let lock = harness::unique_lock();
    let clock = WallClock::now();
    let leader = replica(pg, "A", lock, "* * * * * *", &[], &job("A"));
    // The follower starts only once A leads: started together, either could win.
    if leader.logged("became leader", SETUP_WAIT).is_none() {
        figures.failure(format!("A never led\n{}", leader.dump()));
    }
    let _follower = replica(pg, "B", lock, "* * * * * *", &[], &job("B"));
    for n in 2..=runs + 1 {
        match leader.line(Stream::Stdout, "A ran ", n, None, SETUP_WAIT) {
            Some((line, at)) => match occurrence_in(&line) {
                Some(occurrence) => figures.sample_ms(late_ms(occurrence, clock.at(at))),
                None => figures.failure(format!("no occurrence in {line:?}")),
            },
            None => {
                figures.failure(format!("run {n} never came\n{}", leader.dump()));
                break;
            }
        }
    }
    row(
        "sched.on_time",
        "from the occurrence (server clock) to the command running, steady leader (p99 = max up to 100 runs)",
        figures,
        "every-second schedule, a follower queued".into(),
    )
}

/// The leader is killed with kill -9 one second before an occurrence; the follower that takes
/// over runs it: from the occurrence to its job's line.
pub fn after_kill9(pg: &Pgleader, runs: usize) -> Row {
    eprintln!("bench: 8. scheduled: occurrence to command, leader killed 1 s before");
    let mut figures = Figures::default();
    let lock = harness::unique_lock();
    let clock = WallClock::now();
    let schedule = "*/2 * * * * *";
    let mut queue: Vec<Candidate> = (0..2)
        .map(|i| {
            replica(
                pg,
                &format!("R{i}"),
                lock,
                schedule,
                &[],
                &job(&format!("R{i}")),
            )
        })
        .collect();
    for run in 0..runs {
        let result = (|| -> anyhow::Result<f64> {
            // The leader is whoever ran last; wait for a steady run first.
            let (leader, _) = wait_any(&queue, " ran ", SETUP_WAIT).context("no replica ran")?;
            let tag = format!("R{}", queue.len() + run);
            queue.push(replica(pg, &tag, lock, schedule, &[], &job(&tag)));
            sleep(Duration::from_millis(300));
            // The next even second at least 1.5 s away, and the kill 1 s before it.
            let now = Utc::now();
            let mut occurrence = now.trunc_subsecs(0) + chrono::Duration::seconds(2);
            while occurrence.timestamp() % 2 != 0
                || occurrence - now < chrono::Duration::milliseconds(1_500)
            {
                occurrence += chrono::Duration::seconds(1);
            }
            let kill_at = occurrence - chrono::Duration::seconds(1);
            if let Ok(wait) = (kill_at - Utc::now()).to_std() {
                sleep(wait);
            }
            let fault = Instant::now();
            queue[leader].signal(Signal::SIGKILL);
            let killed = queue.remove(leader);
            let needle = format!(
                " ran {}",
                occurrence.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
            );
            let (_, at) = queue
                .iter()
                .find_map(|candidate| {
                    candidate.line(Stream::Stdout, &needle, 1, Some(fault), Duration::ZERO)
                })
                .or_else(|| wait_any_since(&queue, &needle, fault, Duration::from_secs(10)))
                .with_context(|| {
                    format!("nobody ran {occurrence} after the kill\n{}", killed.dump())
                })?;
            Ok(late_ms(occurrence, clock.at(at)))
        })();
        match result {
            Ok(late) => figures.sample_ms(late),
            Err(err) => figures.failure(format!("{err:#}")),
        }
    }
    row(
        "sched.kill9",
        "from the occurrence (server clock) to the command running, the leader killed (kill -9) 1 s before (p99 = max up to 100 runs)",
        figures,
        "every-two-seconds schedule, two followers queued".into(),
    )
}

/// The index of the candidate whose latest matching line is the newest, and that line's time.
fn wait_any(queue: &[Candidate], needle: &str, timeout: Duration) -> Option<(usize, Instant)> {
    let deadline = Instant::now() + timeout;
    loop {
        let newest = queue
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let mut last = None;
                let mut n = 1;
                while let Some((_, at)) = c.line(Stream::Stdout, needle, n, None, Duration::ZERO) {
                    last = Some(at);
                    n += 1;
                }
                last.map(|at| (i, at))
            })
            .max_by_key(|(_, at)| *at);
        if newest.is_some() || Instant::now() >= deadline {
            return newest;
        }
        sleep(Duration::from_millis(20));
    }
}

fn wait_any_since(
    queue: &[Candidate],
    needle: &str,
    since: Instant,
    timeout: Duration,
) -> Option<(String, Instant)> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = queue
            .iter()
            .find_map(|c| c.line(Stream::Stdout, needle, 1, Some(since), Duration::ZERO))
        {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        sleep(Duration::from_millis(5));
    }
}

/// An idle scheduled leader (its next occurrence a day away): memory, CPU, statements.
pub fn idle_cost(pg: &Pgleader, window: Duration) -> anyhow::Result<Cost> {
    eprintln!("bench: 8. scheduled: cost of an idle scheduled leader");
    pg.log_statements(true)?;
    let measured = (|| {
        let lock = harness::unique_lock();
        let tomorrow = Utc::now() + chrono::Duration::days(1);
        let schedule = tomorrow.format("%-S %-M %-H %-d %-m *").to_string();
        let leader = replica(pg, "A", lock, &schedule, &[], &job("A"));
        let won = leader
            .line(Stream::Stderr, "became leader", 1, None, SETUP_WAIT)
            .with_context(|| format!("the scheduled leader never led\n{}", leader.dump()))?;
        let backend: i32 = harness::field(&won.0, "backend_pid").parse()?;
        sleep(Duration::from_secs(1));
        let mark = pg.cluster.log().len();
        let usage = Usage::measure(&[leader.pid()], None, window);
        let statements = pg.statements_since(mark);
        let per_second =
            statements.get(&backend).copied().unwrap_or(0) as f64 / window.as_secs_f64();
        Ok(usage.cost(
            0,
            "pgleader",
            SCHEDULED_ROLE,
            per_second,
            "statements in the server log (log_statement = all) from its backend pid",
        ))
    })();
    pg.log_statements(false)?;
    measured
}

/// Three hosts' timers fire for each occurrence of an every-ten-seconds schedule, 0, 0.5 and
/// 4 s after it (systemd's AccuracySec= and clock drift spread them so); each job takes 0.3 s.
/// Both modes run side by side on locks of their own.
pub fn timers(pg: &Pgleader, occurrences: usize) -> anyhow::Result<Vec<TimerCount>> {
    eprintln!("bench: 8. scheduled: three timers per occurrence, {occurrences} occurrences");
    let modes: [(&'static str, &[&str]); 2] = [
        ("pgleader run --once --schedule", &["--once"]),
        (
            "pgleader run --once --no-wait (no --schedule)",
            &["--once", "--no-wait"],
        ),
    ];
    let journals: Vec<Journal> = modes.iter().map(|_| Journal::new("timers")).collect();
    let locks: Vec<i64> = modes.iter().map(|_| harness::unique_lock()).collect();
    let schedule = "*/10 * * * * *";
    let mut first = Utc::now().trunc_subsecs(0) + chrono::Duration::seconds(2);
    while first.timestamp() % 10 != 0 {
        first += chrono::Duration::seconds(1);
    }
    let mut timers = Vec::new();
    for k in 0..occurrences {
        let occurrence = first + chrono::Duration::seconds(10 * k as i64);
        let label = occurrence.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
        for offset_ms in [0, 500, 4_000] {
            let at = occurrence + chrono::Duration::milliseconds(offset_ms);
            if let Ok(wait) = (at - Utc::now()).to_std() {
                sleep(wait);
            }
            for (m, (_, args)) in modes.iter().enumerate() {
                // Each host's timer knows which night it fired for; the job records it.
                let script = format!("{}; sleep 0.3", journals[m].append(&label));
                let mut command = harness::pgleader();
                command
                    .env_remove("PGLEADER_RESTART_FENCE")
                    .env("PGLEADER_DATABASE_URL", pg.cluster.url())
                    .arg("run")
                    .arg(format!("--lock-id={}", locks[m]))
                    .args(*args);
                if m == 0 {
                    command.args(["--schedule", schedule, "--ledger-table", "bench_ledger"]);
                }
                command.args(["--", "sh", "-c", &script]);
                timers.push(Candidate::spawn("timer", command));
            }
        }
    }
    // The last timers finish within a few seconds.
    sleep(Duration::from_secs(3));
    drop(timers);
    Ok(modes
        .iter()
        .zip(&journals)
        .map(|((mode, _), journal)| {
            let mut runs: BTreeMap<String, usize> = BTreeMap::new();
            for line in journal.lines() {
                *runs.entry(line).or_default() += 1;
            }
            let ran: Vec<usize> = (0..occurrences)
                .map(|k| {
                    let occurrence = first + chrono::Duration::seconds(10 * k as i64);
                    let label = occurrence.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
                    runs.get(&label).copied().unwrap_or(0)
                })
                .collect();
            TimerCount {
                mode,
                occurrences,
                once: ran.iter().filter(|n| **n == 1).count(),
                extra_runs: ran.iter().map(|n| n.saturating_sub(1)).sum(),
                missed: ran.iter().filter(|n| **n == 0).count(),
            }
        })
        .collect())
}
