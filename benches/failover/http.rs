//! Scenario 9, issue 10's: what the HTTP endpoint (`--http`) costs and how fast it tells the
//! truth. The idle cost with `--http` on goes into the cost table beside the cost without it;
//! here, a scrape of `/metrics`, and how soon after a kill -9 the new leader's `/leader`
//! answers 200 compared with the moment its command started, while a client asks it without
//! pause (which also shows that such a client does not slow the failover down).

use std::net::SocketAddr;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use nix::sys::signal::Signal;

use crate::figures::{Figures, Row};
use crate::harness::http::{get, request};
use crate::harness::{field, unique_lock};
use crate::tools::{Candidate, Pgleader, SETTLE, SETUP_WAIT, Tool, wait_queued};

/// Listen on a free port of the loopback interface; the log says which.
pub const HTTP: &str = "--http=127.0.0.1:0";

/// The address a candidate started with [`HTTP`] serves on.
fn address(candidate: &Candidate) -> anyhow::Result<SocketAddr> {
    let line = candidate
        .logged("serving /leader", SETUP_WAIT)
        .ok_or_else(|| anyhow!("no HTTP endpoint\n{}", candidate.dump()))?;
    field(&line, "address")
        .parse()
        .with_context(|| format!("no address in {line:?}"))
}

/// `GET /metrics` on an idle leader, `runs` times, each on a new connection: from the
/// connection to the end of the answer.
pub fn scrape(pgleader: &Pgleader, runs: usize) -> Vec<Row> {
    let scenario = "9. --http: GET /metrics of an idle leader";
    eprintln!("bench: {scenario} ({runs} scrapes)");
    let mut figures = Figures::default();
    let measured = (|| {
        let leader = pgleader.candidate_with("A", unique_lock(), None, &[HTTP]);
        leader
            .started(None, SETUP_WAIT)
            .ok_or_else(|| anyhow!("never led\n{}", leader.dump()))?;
        let address = address(&leader)?;
        // The first answer warms up nothing that a later one would not find warm anyway, but
        // it is the one that proves the route works.
        anyhow::ensure!(get(address, "/metrics").status == 200, "/metrics failed");
        for _ in 0..runs {
            let began = Instant::now();
            let reply = request(address, "GET", "/metrics")?;
            let took = began.elapsed();
            anyhow::ensure!(reply.status == 200, "/metrics answered {}", reply.status);
            figures.sample(took);
        }
        Ok::<_, anyhow::Error>(())
    })();
    if let Err(err) = measured {
        eprintln!("bench:   failed: {err:#}");
        figures.failure(format!("{err:#}"));
    }
    vec![Row {
        id: "http.metrics".into(),
        scenario: scenario.into(),
        tool: pgleader.label(),
        measure: "whole answer, new connection each",
        figures,
        old_child_stopped: None,
        note: "Prometheus' classic text format, ~3.6 KB".into(),
    }]
}

/// Kill -9 of the leader while a client asks the follower's `/leader` without pause: when the
/// answer turns 200, relative to the line the new command printed when it started (negative:
/// `/leader` said 200 before that line arrived), and how long the failover itself took.
pub fn leader_after_kill9(pgleader: &Pgleader, runs: usize) -> Vec<Row> {
    let scenario = "9. --http: kill -9 of the leader, /leader of the follower polled";
    eprintln!("bench: {scenario}");
    let mut turned = Figures::default();
    let mut next = Figures::default();
    for run in 0..runs {
        match failover_run(pgleader) {
            Ok((failover, gap)) => {
                eprintln!(
                    "bench:   run {}/{runs}: child after {:.1} ms, /leader 200 {:+.1} ms from it",
                    run + 1,
                    failover.as_secs_f64() * 1000.0,
                    gap
                );
                next.sample(failover);
                turned.sample_ms(gap);
            }
            Err(err) => {
                eprintln!("bench:   run {}/{runs} failed: {err:#}", run + 1);
                turned.failure(format!("{err:#}"));
                next.failure(format!("{err:#}"));
            }
        }
    }
    vec![
        Row {
            id: "http.leader_200".into(),
            scenario: scenario.into(),
            tool: pgleader.label(),
            measure: "/leader answers 200, from the new command's start",
            figures: turned,
            old_child_stopped: None,
            note: "the start is the moment the command's first line reached the benchmark".into(),
        },
        Row {
            id: "http.next".into(),
            scenario: scenario.into(),
            tool: pgleader.label(),
            measure: "next leader's child runs (from the kill)",
            figures: next,
            old_child_stopped: None,
            note: "while /leader is asked without pause".into(),
        },
    ]
}

/// One run: the failover's duration, and the gap from the command's start to `/leader` 200 in
/// milliseconds.
fn failover_run(pgleader: &Pgleader) -> anyhow::Result<(Duration, f64)> {
    let lock = unique_lock();
    let leader = pgleader.candidate_with("A", lock, None, &[HTTP]);
    leader
        .started(None, SETUP_WAIT)
        .ok_or_else(|| anyhow!("the first candidate never led\n{}", leader.dump()))?;
    let follower = pgleader.candidate_with("B", lock, None, &[HTTP]);
    wait_queued(pgleader, lock, 2, SETUP_WAIT).with_context(|| follower.dump())?;
    let address = address(&follower)?;
    sleep(SETTLE);
    let bound = pgleader.handoff_bound();
    let poller = std::thread::spawn(move || {
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            if request(address, "GET", "/leader").is_ok_and(|reply| reply.status == 200) {
                return Some(Instant::now());
            }
        }
        None
    });
    // The poller is asking before the fault.
    sleep(Duration::from_millis(20));
    let fault = Instant::now();
    leader.signal(Signal::SIGKILL);
    let started = follower.started(Some(fault), bound);
    let said_200 = poller
        .join()
        .map_err(|_| anyhow!("the poller panicked"))?
        .ok_or_else(|| anyhow!("/leader never answered 200\n{}", follower.dump()))?;
    let (_, started) =
        started.ok_or_else(|| anyhow!("the follower never led\n{}", follower.dump()))?;
    let gap = if said_200 >= started {
        (said_200 - started).as_secs_f64() * 1000.0
    } else {
        -(started - said_200).as_secs_f64() * 1000.0
    };
    Ok((started - fault, gap))
}
