//! `jitter=` on a real fleet: each occurrence of a job starts after the delay drawn for it
//! from the job and the occurrence, `PGLEADER_SCHEDULED_TIME` stays the occurrence, and a
//! replica that takes the job over between the occurrence and its delayed start (the owner
//! killed -9 meanwhile) waits for the same delay, rather than running it at once or drawing
//! another. On PostgreSQL and on one Redis server.

use std::time::{Duration, Instant, SystemTime};

use jiff::Timestamp;
use nix::sys::signal::Signal;
use pgleader::schedule::jitter;

use crate::cron_fleet::{Spawn, assert_each_occurrence_once, cron_replica};
use crate::crontab::File;
use crate::harness::{Cluster, Proc, Redis, Stream, WAIT, field, unique_lock};
use crate::redis_shards::QUICK;

/// The jobs' period, in seconds, and the jitter each is given.
const PERIOD: i64 = 5;
const JITTER: Duration = Duration::from_secs(4);

/// How early a start may seem beside its delayed time: the host's clock and the server's,
/// read on one machine, agree to within this.
const CLOCKS: Duration = Duration::from_millis(20);

/// One run a replica printed: the job, its occurrence (`PGLEADER_SCHEDULED_TIME`), and when
/// its command started (bash's `$EPOCHREALTIME`).
struct Run {
    job: String,
    at: Timestamp,
    started: Timestamp,
}

fn runs_of(replica: &Proc) -> Vec<Run> {
    replica
        .lines(Stream::Stdout)
        .into_iter()
        .filter(|line| line.starts_with("ran "))
        .map(|line| {
            let seconds: f64 = field(&line, "started").parse().expect("$EPOCHREALTIME");
            Run {
                job: field(&line, "job"),
                at: field(&line, "at").parse().expect("an occurrence"),
                started: Timestamp::from_microsecond((seconds * 1e6) as i64).expect("an instant"),
            }
        })
        .collect()
}

/// The delay the fleet draws for `job`'s occurrence of `at`, and when that puts its start.
fn delayed(job: &str, at: Timestamp) -> (Duration, Timestamp) {
    let delay = jitter(job, at, JITTER);
    (delay, at.checked_add(delay).expect("an instant"))
}

/// Fails unless every run `replica` printed started at its delayed time (not before, and
/// within `late` after).
fn assert_started_when_drawn(replica: &Proc, late: Duration) {
    for run in runs_of(replica) {
        let (delay, start) = delayed(&run.job, run.at);
        let early = start.duration_since(run.started);
        let behind = run.started.duration_since(start);
        assert!(
            early.as_millis() <= CLOCKS.as_millis() as i128
                && behind.as_millis() <= late.as_millis() as i128,
            "{}'s run of {} started at {}, its occurrence put off by {delay:?} to {start}\n{}",
            run.job,
            run.at,
            run.started,
            replica.dump()
        );
    }
}

/// Two jobs every 5 s with `jitter=4s catch-up=1s` on A and B, one each. B is killed -9 1.5 s
/// after an occurrence of its job whose delay is at least 2.5 s, before its start (and past its
/// catch-up, counted from the occurrence); A runs that occurrence at the same delayed start.
/// Every run of either replica started at its drawn delay.
fn a_takeover_keeps_the_delay_drawn_for_the_occurrence(spawn: Spawn) {
    let mut text = String::from("SHELL=/bin/bash\n");
    for n in 1..=2 {
        text.push_str(&format!(
            "# pgleader: name=j{n} jitter=4s catch-up=1s\n*/{PERIOD} * * * * * * echo ran job=$PGLEADER_JOB \
             at=$PGLEADER_SCHEDULED_TIME started=$EPOCHREALTIME\n"
        ));
    }
    let file = File::new("jitter", &text);
    let a = spawn("A", &file);
    a.wait_line(Stream::Stderr, "took job ", 2, None, WAIT)
        .unwrap_or_else(|| panic!("A never took both jobs\n{}", a.dump()));
    let b = spawn("B", &file);
    let took = b.wait_log("took job ");
    let job = took
        .split("took job ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("a job's name")
        .to_owned();
    // B runs the job once, so that the ledger knows it and a takeover catches up its
    // occurrence rather than starting from the next.
    b.wait_stdout(&format!("ran job={job} "));
    // The next occurrence whose start is put off by 2.5 s or more, at least a second away.
    let now = Timestamp::now();
    let first = now.as_second() - now.as_second().rem_euclid(PERIOD) + 2 * PERIOD;
    let at = (0..20)
        .map(|k| Timestamp::from_second(first + k * PERIOD).expect("an instant"))
        .find(|at| jitter(&job, *at, JITTER) >= Duration::from_millis(2500))
        .expect("one of 20 occurrences put off by 2.5 s or more");
    let (delay, start) = delayed(&job, at);
    // The fault's moment: 1.5 s after the occurrence, later than its catch-up=1s, well before
    // its delayed start: the occurrence is not late, and must not be recorded missed.
    let kill_at = SystemTime::from(at.checked_add(Duration::from_millis(1500)).expect("time"));
    std::thread::sleep(
        kill_at
            .duration_since(SystemTime::now())
            .unwrap_or_default(),
    );
    b.signal(Signal::SIGKILL);
    assert!(b.wait_exit().code().is_none());
    let deadline = Instant::now() + WAIT;
    let run = loop {
        if let Some(run) = runs_of(&a)
            .into_iter()
            .find(|run| run.job == job && run.at == at)
        {
            break run;
        }
        assert!(
            Instant::now() < deadline,
            "A never ran {job}'s occurrence of {at} after B was killed\n{}\n{}",
            a.dump(),
            b.dump()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        run.started.duration_since(start).as_millis() >= -(CLOCKS.as_millis() as i128),
        "A ran {job}'s occurrence of {at} at {}, before its drawn start {start} (delay {delay:?}): \
         the takeover did not keep the delay\n{}",
        run.started,
        a.dump()
    );
    assert!(
        !runs_of(&b).iter().any(|run| run.job == job && run.at == at),
        "B ran it before it was killed\n{}",
        b.dump()
    );
    a.terminate_cleanly();
    // The takeover itself takes a moment on Redis; everything else starts at its delay.
    assert_started_when_drawn(&a, Duration::from_millis(500));
    assert_started_when_drawn(&b, Duration::from_millis(500));
    assert_each_occurrence_once(&[&a, &b]);
}

#[test]
fn jitter_puts_each_start_off_alike_on_every_replica_through_a_kill_9() {
    let lock = unique_lock();
    let url = Cluster::shared().url();
    a_takeover_keeps_the_delay_drawn_for_the_occurrence(&|name, file| {
        cron_replica(name, &url, lock, &[], file)
    });
}

#[test]
fn on_redis_jitter_puts_each_start_off_alike_on_every_replica_through_a_kill_9() {
    let lock = unique_lock();
    let url = Redis::shared().url();
    a_takeover_keeps_the_delay_drawn_for_the_occurrence(&|name, file| {
        cron_replica(name, &url, lock, &QUICK, file)
    });
}
