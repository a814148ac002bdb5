//! The scenarios of issue 5, written once for any [`Tool`]. Each run starts from fresh
//! candidates on a fresh lock, injects one fault, and observes on the children's pipes when
//! the next leader's child started and when the old child got its SIGTERM; durations count
//! from the moment just before the fault.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Stdio;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use nix::sys::signal::Signal;

use crate::figures::{Figures, Row, Scale};
use crate::harness::{Proxy, Stream, field, is_running, pid_in, unique_lock, wait_gone};
use crate::procfs::CpuMeter;
use crate::tools::{Candidate, SETTLE, SETUP_WAIT, Tool, random_phase, wait_queued};

/// After the next leader started (or the handoff bound passed), how much longer the old child
/// is given to report a signal or to be gone, before the answer counts as "never".
const GRACE: Duration = Duration::from_secs(1);

/// What one run saw.
#[derive(Debug, Default)]
struct Observed {
    /// From the fault to the next leader's child's first line.
    next: Option<Duration>,
    /// From the fault to the old child's report of SIGTERM.
    signal: Option<Duration>,
    /// Whether the old child was gone shortly after the handoff.
    stopped: Option<bool>,
    /// Whether the old child still ran when the next leader's child had started.
    overlap: Option<bool>,
    /// Scenario 5: from the moment the tool's exec had succeeded to its child's first line.
    from_exec: Option<Duration>,
}

/// A leader and a follower queued behind it, on a lock of their own.
struct Pair {
    lock: i64,
    leader: Candidate,
    follower: Candidate,
    leader_line: String,
    child: i32,
    /// Dropped last: the candidates go before their connections are cut.
    proxy: Option<Proxy>,
}

impl Pair {
    fn start(tool: &dyn Tool, through_proxy: bool) -> anyhow::Result<Pair> {
        let lock = unique_lock();
        let proxy = through_proxy.then(|| Proxy::start(tool.server().port()));
        let leader = tool.candidate("A", lock, proxy.as_ref());
        let (leader_line, _) = leader
            .started(None, SETUP_WAIT)
            .ok_or_else(|| anyhow!("the first candidate never led\n{}", leader.dump()))?;
        let follower = tool.candidate("B", lock, None);
        wait_queued(tool, lock, 2, SETUP_WAIT).with_context(|| follower.dump())?;
        sleep(SETTLE + random_phase(tool.poll_period()));
        Ok(Pair {
            lock,
            child: pid_in(&leader_line),
            leader,
            follower,
            leader_line,
            proxy,
        })
    }

    /// Waits for the handoff after a fault at `fault`; `bound` is how long it may take. With
    /// `signal`, also for the old child's report of SIGTERM (a SIGKILLed one sends none).
    fn observe(&self, fault: Instant, bound: Duration, signal: bool) -> Observed {
        let next = self.follower.started(Some(fault), bound);
        let overlap = next.as_ref().map(|_| is_running(self.child));
        let signal = signal
            .then(|| self.leader.signalled(fault, GRACE))
            .flatten();
        Observed {
            next: next.map(|(_, at)| at - fault),
            signal: signal.map(|at| at - fault),
            stopped: Some(wait_gone(self.child, GRACE)),
            overlap,
            from_exec: None,
        }
    }
}

/// Runs `run` `runs` times; a run that fails or panics is reported, not fatal.
fn repeat(
    label: &str,
    runs: usize,
    mut run: impl FnMut() -> anyhow::Result<Observed>,
) -> Vec<anyhow::Result<Observed>> {
    (0..runs)
        .map(|i| {
            let result = catch_unwind(AssertUnwindSafe(&mut run))
                .unwrap_or_else(|_| Err(anyhow!("the run panicked (see above)")));
            match &result {
                Ok(seen) => eprintln!(
                    "bench:   {label} run {}/{runs}: {}{}",
                    i + 1,
                    show(seen.next),
                    seen.signal.map_or_else(String::new, |signal| format!(
                        ", old child signalled after {}",
                        show(Some(signal))
                    ))
                ),
                Err(err) => eprintln!("bench:   {label} run {}/{runs} failed: {err:#}", i + 1),
            }
            result
        })
        .collect()
}

fn millis(value: Option<Duration>) -> Option<f64> {
    value.map(|d| d.as_secs_f64() * 1000.0)
}

fn show(value: Option<Duration>) -> String {
    value.map_or_else(
        || "never".into(),
        |d| format!("{:.1} ms", d.as_secs_f64() * 1000.0),
    )
}

/// The two rows of a scenario that watches both ends of a handoff: when the old child got its
/// SIGTERM (`<id>.signal`), and when the next leader's child ran (`<id>.next`).
fn handoff_rows(
    id: &str,
    scenario: &str,
    tool: &dyn Tool,
    results: &[anyhow::Result<Observed>],
    bound: Duration,
) -> Vec<Row> {
    vec![
        row(
            &format!("{id}.signal"),
            scenario,
            tool,
            "old child gets SIGTERM",
            results,
            bound,
            |o| millis(o.signal),
        ),
        row(
            &format!("{id}.next"),
            scenario,
            tool,
            "next leader's child runs",
            results,
            bound,
            |o| millis(o.next),
        ),
    ]
}

/// One row from the runs, taking the figure `pick` chooses.
fn row(
    id: &str,
    scenario: &str,
    tool: &dyn Tool,
    measure: &'static str,
    runs: &[anyhow::Result<Observed>],
    bound: Duration,
    pick: impl Fn(&Observed) -> Option<f64>,
) -> Row {
    let mut figures = Figures::default();
    let (mut stopped, mut checked, mut overlaps, mut seen) = (0, 0, 0, 0);
    for run in runs {
        match run {
            Ok(observed) => {
                match pick(observed) {
                    Some(value) => figures.sample_ms(value),
                    None => figures.never(bound),
                }
                if let Some(gone) = observed.stopped {
                    checked += 1;
                    stopped += usize::from(gone);
                }
                if let Some(overlap) = observed.overlap {
                    seen += 1;
                    overlaps += usize::from(overlap);
                }
            }
            Err(err) => figures.failure(format!("{err:#}").replace('\n', " ")),
        }
    }
    let mut notes = Vec::new();
    if figures.only_never() {
        notes.push(tool.why_never().to_owned());
    }
    if overlaps > 0 {
        notes.push(format!(
            "the old child still ran when the next one started in {overlaps} of {seen} runs"
        ));
    }
    Row {
        id: id.to_owned(),
        scenario: scenario.to_owned(),
        tool: tool.label(),
        measure,
        figures,
        old_child_stopped: Some((stopped, checked)),
        note: notes.join("; "),
    }
}

/// Scenario 1: the leader's tool is killed with SIGKILL.
pub fn kill9(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "1. kill -9 of the leader";
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, false)?;
        let fault = Instant::now();
        pair.leader.signal(Signal::SIGKILL);
        Ok(pair.observe(fault, tool.handoff_bound(), false))
    });
    vec![row(
        "kill9.next",
        scenario,
        tool,
        "next leader's child runs",
        &results,
        tool.handoff_bound(),
        |o| millis(o.next),
    )]
}

/// Scenario 1c: where the time of a kill -9 failover goes, as the new leader logs it at debug
/// level (`start_timeline`; `tool` must run pgleader with `-v`): the lock granted → the fencing
/// token in hand → the keeper handed the environment and the sockets → the keeper's report that
/// the command was executed. On PostgreSQL a follower's grant brings the token with it (taken
/// and flushed by the same statement), so the fence step is the one round trip that gives the
/// leader's deadline its base.
pub fn breakdown(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "1c. kill -9 of the leader: the new leader's steps (its debug log)";
    eprintln!("bench: {scenario} ({})", tool.label());
    const STEPS: [(&str, &str, &str); 5] = [
        (
            "breakdown.fence",
            "fence_ms",
            "lock granted (the token with it) → fence done (one round trip)",
        ),
        (
            "breakdown.keeper",
            "keeper_ms",
            "fence done → parked keeper handed the environment",
        ),
        (
            "breakdown.exec",
            "exec_ms",
            "keeper handed → command executed (its report read)",
        ),
        (
            "breakdown.total",
            "total_ms",
            "lock granted → command executed",
        ),
        (
            "breakdown.next",
            "",
            "kill → next leader's child runs (this scenario's runs)",
        ),
    ];
    let mut figures: Vec<Figures> = STEPS.iter().map(|_| Figures::default()).collect();
    for i in 0..runs {
        let run = || -> anyhow::Result<Vec<f64>> {
            let pair = Pair::start(tool, false)?;
            let fault = Instant::now();
            pair.leader.signal(Signal::SIGKILL);
            let (_, at) = pair
                .follower
                .started(Some(fault), tool.handoff_bound())
                .ok_or_else(|| anyhow!("no handoff\n{}", pair.follower.dump()))?;
            let (line, _) = pair
                .follower
                .line(Stream::Stderr, "from the lock granted", 1, None, GRACE)
                .ok_or_else(|| anyhow!("no start_timeline in the new leader's log (-v)"))?;
            let mut values = Vec::new();
            for (_, key, _) in &STEPS[..4] {
                values.push(
                    field(&line, key)
                        .parse::<f64>()
                        .with_context(|| format!("no {key} in {line:?}"))?,
                );
            }
            values.push((at - fault).as_secs_f64() * 1000.0);
            Ok(values)
        };
        match catch_unwind(AssertUnwindSafe(run))
            .unwrap_or_else(|_| Err(anyhow!("the run panicked (see above)")))
        {
            Ok(values) => {
                eprintln!(
                    "bench:   {} run {}/{runs}: {}",
                    tool.label(),
                    i + 1,
                    values
                        .iter()
                        .map(|v| format!("{v:.2}"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                );
                for (figure, value) in figures.iter_mut().zip(values) {
                    figure.sample_ms(value);
                }
            }
            Err(err) => {
                eprintln!(
                    "bench:   {} run {}/{runs} failed: {err:#}",
                    tool.label(),
                    i + 1
                );
                for figure in &mut figures {
                    figure.failure(format!("{err:#}").replace('\n', " "));
                }
            }
        }
    }
    STEPS
        .iter()
        .zip(figures)
        .map(|((id, _, measure), figures)| Row {
            id: (*id).to_owned(),
            scenario: scenario.to_owned(),
            tool: tool.label(),
            measure,
            figures,
            old_child_stopped: None,
            note: String::new(),
        })
        .collect()
}

/// Scenario 2: the leader is stopped with SIGTERM, sent to the tool's own process, or
/// (`to_group`) to its whole process group. The child exits as soon as it gets TERM.
pub fn sigterm(tool: &dyn Tool, runs: usize, to_group: bool) -> Vec<Row> {
    let scenario = if to_group {
        "2b. SIGTERM to the leader's process group (kill -TERM -- -PGID)"
    } else {
        "2. SIGTERM to the leader (graceful handoff)"
    };
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, false)?;
        let fault = Instant::now();
        if to_group {
            pair.leader.signal_group(Signal::SIGTERM);
        } else {
            pair.leader.signal(Signal::SIGTERM);
        }
        Ok(pair.observe(fault, tool.handoff_bound(), true))
    });
    let id = if to_group { "sigterm_group" } else { "sigterm" };
    handoff_rows(id, scenario, tool, &results, tool.handoff_bound())
}

/// Scenario 2c: `pgleader step-down` asks the leader to hand over; from the moment the
/// command is started (its own connection included) to the next leader's child running. The
/// child exits as soon as it gets TERM. Only for a tool that has such a command.
pub fn step_down(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "2c. pgleader step-down (leadership moved on demand)";
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, false)?;
        let mut command = tool
            .step_down(pair.lock)
            .ok_or_else(|| anyhow!("{} has no step-down", tool.label()))?;
        command.stdout(Stdio::null()).stderr(Stdio::null());
        let fault = Instant::now();
        let mut client = command.spawn().context("cannot start pgleader step-down")?;
        let observed = pair.observe(fault, tool.handoff_bound(), true);
        let status = client.wait().context("pgleader step-down")?;
        anyhow::ensure!(status.success(), "pgleader step-down: {status}");
        Ok(observed)
    });
    handoff_rows("step_down", scenario, tool, &results, tool.handoff_bound())
}

/// Scenario 3: the server ends the leader's session: `pg_terminate_backend`, or for etcd the
/// revocation of the leader's lease.
pub fn end_session(tool: &dyn Tool, runs: usize, how: &str) -> Vec<Row> {
    let scenario = format!("3. the server ends the leader's session ({how})");
    at_server(tool, runs, "end_session", &scenario)
}

/// Scenario 3b, on Redis: someone deletes the lock's key (`DEL`), as a `FLUSHALL`, an eviction
/// or an operator's mistake would.
pub fn key_deleted(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    at_server(
        tool,
        runs,
        "key_deleted",
        "3b. the lock's key is deleted (Redis: DEL)",
    )
}

/// A fault at the server ([`Tool::end_session`]): when the old child is signalled, and when
/// the next leader's runs.
fn at_server(tool: &dyn Tool, runs: usize, id: &str, scenario: &str) -> Vec<Row> {
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, false)?;
        let fault = tool.server().end_session(&pair.leader_line)?;
        Ok(pair.observe(fault, tool.handoff_bound(), true))
    });
    handoff_rows(id, scenario, tool, &results, tool.handoff_bound())
}

/// A fault at the servers themselves, for [`majority_lost`].
pub trait ServerFault {
    /// Before each run: waits until the servers can elect again.
    fn prepare(&self) -> anyhow::Result<()>;

    /// Injects the fault; returns the moment just before it.
    fn inject(&self) -> anyhow::Result<Instant>;

    /// Undoes it after the run, whatever happened in the run.
    fn restore(&self);
}

/// Restores the servers when a run ends, also when it fails or panics.
struct Restore<'a>(&'a dyn ServerFault);

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        self.0.restore();
    }
}

/// Scenario 10: a quorum loses its majority under a leader (no follower): the leader must stop
/// its child on its own, within `bound`.
pub fn majority_lost(
    tool: &dyn Tool,
    runs: usize,
    id: &str,
    scenario: &str,
    bound: Duration,
    fault: &dyn ServerFault,
) -> Vec<Row> {
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        fault.prepare()?;
        let leader = tool.candidate("A", unique_lock(), None);
        let (line, _) = leader
            .started(None, SETUP_WAIT)
            .ok_or_else(|| anyhow!("the leader never started\n{}", leader.dump()))?;
        sleep(SETTLE + random_phase(tool.poll_period()));
        let child = pid_in(&line);
        let _restore = Restore(fault);
        let at = fault.inject()?;
        let signal = leader.signalled(at, bound);
        Ok(Observed {
            signal: signal.map(|signalled| signalled - at),
            stopped: Some(wait_gone(child, GRACE)),
            ..Observed::default()
        })
    });
    vec![row(
        &format!("{id}.signal"),
        scenario,
        tool,
        "old child gets SIGTERM",
        &results,
        bound,
        |o| millis(o.signal),
    )]
}

/// Scenario 4: the leader's traffic is frozen by a proxy (no RST, no FIN): its tool must stop the
/// child on its own deadline, and the server free the lock only later.
pub fn partition(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "4. the leader is partitioned (proxy freezes its traffic)";
    eprintln!("bench: {scenario} ({})", tool.label());
    // The server frees the lock one lease (or TTL) after it last heard from the leader.
    let bound = tool.handoff_bound() + Duration::from_secs(5);
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, true)?;
        let proxy = pair.proxy.as_ref().context("no proxy")?;
        let fault = Instant::now();
        proxy.freeze();
        Ok(pair.observe(fault, bound, true))
    });
    // Signed: a next leader that started before the old child's signal shows as negative.
    let gap = |o: &Observed| Some(millis(o.next)? - millis(o.signal)?);
    let gap_row = row(
        "partition.gap",
        scenario,
        tool,
        "gap: old child's signal → next leader's child",
        &results,
        bound,
        gap,
    );
    let mut rows = handoff_rows("partition", scenario, tool, &results, bound);
    rows.push(gap_row);
    rows
}

/// Scenario 4b: the leading tool's own process alone frozen (SIGSTOP), its child and, for
/// pgleader, its keeper untouched: a pgleader blocked on a log pipe nobody reads, hung or
/// starved looks the same. With the partition's short timings (through an idle proxy), so that
/// the server frees the lock after 3 s.
pub fn frozen(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "4b. the leading tool alone is frozen (SIGSTOP of its pid)";
    eprintln!("bench: {scenario} ({})", tool.label());
    let bound = tool.handoff_bound() + Duration::from_secs(5);
    let results = repeat(tool.label(), runs, || {
        let pair = Pair::start(tool, true)?;
        let fault = Instant::now();
        pair.leader.signal(Signal::SIGSTOP);
        let seen = pair.observe(fault, bound, true);
        pair.leader.signal(Signal::SIGCONT);
        Ok(seen)
    });
    handoff_rows("frozen", scenario, tool, &results, bound)
}

/// Scenario 5: from starting the tool to its child running, with the lock free.
pub fn start(tool: &dyn Tool, runs: usize) -> Vec<Row> {
    let scenario = "5. start with a free lock";
    eprintln!("bench: {scenario} ({})", tool.label());
    let results = repeat(tool.label(), runs, || {
        let lock = unique_lock();
        let began = Instant::now();
        let candidate = tool.candidate("A", lock, None);
        // The spawn returns once the tool's exec has succeeded (std waits for it). Before
        // that, the benchmark forks itself, a large process with many threads: 0.5 to 3.5 ms
        // that are the benchmark's, not the tool's.
        let execed = Instant::now();
        let (_, at) = candidate
            .started(None, SETUP_WAIT)
            .ok_or_else(|| anyhow!("the child never started\n{}", candidate.dump()))?;
        Ok(Observed {
            next: Some(at - began),
            from_exec: Some(at.saturating_duration_since(execed)),
            ..Observed::default()
        })
    });
    let mut rows = Vec::new();
    for (id, measure, pick) in [
        (
            "start",
            "start → child runs",
            (|o: &Observed| millis(o.next)) as fn(&Observed) -> Option<f64>,
        ),
        ("start.exec", "exec done → child runs", |o| {
            millis(o.from_exec)
        }),
    ] {
        let mut row = row(id, scenario, tool, measure, &results, SETUP_WAIT, pick);
        row.old_child_stopped = None;
        rows.push(row);
    }
    rows
}

/// Scenario 7: `n` candidates on one lock: the server's CPU while they wait, then failover after
/// SIGKILL of the leader, a fresh candidate taking the killed one's place after each run.
pub fn scale(tool: &dyn Tool, n: usize, runs: usize, window: Duration) -> Scale {
    eprintln!("bench: 7. scale with {n} candidates ({})", tool.label());
    let mut scale = Scale {
        tool: tool.label(),
        candidates: n,
        failover: Figures::default(),
        old_child_stopped: (0, 0),
        server_cpu: None,
        window,
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        scale_runs(tool, n, runs, window, &mut scale)
    }))
    .unwrap_or_else(|_| Err(anyhow!("the scenario panicked (see above)")));
    if let Err(err) = outcome {
        eprintln!("bench:   failed: {err:#}");
        scale
            .failover
            .failure(format!("{err:#}").replace('\n', " "));
    }
    scale
}

fn scale_runs(
    tool: &dyn Tool,
    n: usize,
    runs: usize,
    window: Duration,
    scale: &mut Scale,
) -> anyhow::Result<()> {
    let lock = unique_lock();
    let mut spawned = 0;
    let mut spawn = || {
        spawned += 1;
        tool.candidate(&format!("c{spawned}"), lock, None)
    };
    let mut candidates: Vec<Candidate> = (0..n).map(|_| spawn()).collect();
    wait_queued(tool, lock, n, SETUP_WAIT * 2)?;
    let (mut leader, (mut leader_line, _)) =
        first_started(&candidates, None, SETUP_WAIT).context("no candidate led")?;
    // Let the start-up load pass before measuring the server at rest.
    sleep(SETTLE * 3);
    let server = tool.server().pids();
    let meter = CpuMeter::start(&server);
    sleep(window);
    scale.server_cpu = Some(meter.used(&server).as_secs_f64() / window.as_secs_f64());

    for run in 0..runs {
        let child = pid_in(&leader_line);
        let fault = Instant::now();
        candidates[leader].signal(Signal::SIGKILL);
        let next = first_started(&candidates, Some(fault), tool.handoff_bound());
        scale.old_child_stopped.1 += 1;
        scale.old_child_stopped.0 += usize::from(wait_gone(child, GRACE));
        let Some((index, line, at)) = next.map(|(i, (line, at))| (i, line, at)) else {
            scale.failover.never(tool.handoff_bound());
            eprintln!("bench:   run {}/{runs}: no handoff", run + 1);
            break;
        };
        scale.failover.sample(at - fault);
        eprintln!(
            "bench:   run {}/{runs}: next {}",
            run + 1,
            show(Some(at - fault))
        );
        candidates[leader] = spawn();
        wait_queued(tool, lock, n, SETUP_WAIT)?;
        sleep(SETTLE);
        (leader, leader_line) = (index, line);
    }
    Ok(())
}

/// The first candidate whose child printed its first line (after `since`), polling them all;
/// the moment is when the line arrived, not when the poll saw it.
fn first_started(
    candidates: &[Candidate],
    since: Option<Instant>,
    timeout: Duration,
) -> Option<(usize, (String, Instant))> {
    let deadline = Instant::now() + timeout;
    loop {
        let found = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.started(since, Duration::ZERO)?)))
            .min_by_key(|(_, (_, at))| *at);
        if found.is_some() || Instant::now() > deadline {
            return found;
        }
        sleep(Duration::from_millis(5));
    }
}
