//! Health-gated leadership (`--health-cmd`): a probe that runs beside the supervisor, on its
//! interval, in every phase (connecting, waiting, leading, out of the election), and the state
//! it gives the replica: starting (no pass yet), healthy, or unhealthy (`--health-retries`
//! failures in a row; healthy again after one pass). Docker's HEALTHCHECK rule, with its names.
//!
//! The supervisor, and the sharded room alike, ask one question, "is this replica healthy?"
//! ([`Health::is_healthy`]), await the change that ends a wait or a leadership
//! ([`Health::turned_unhealthy`]), and sit out until a probe passes ([`Health::sit_out`]): a
//! replica queues, leads and holds shards only while healthy. Everything else stays here: running the probe,
//! counting failures, the log lines and what telemetry shows. The probe's task owns all of it
//! and publishes the state through a `watch` channel, so a slow or hanging probe never holds up
//! the supervisor's event loop.
//!
//! Each probe is `sh -c CMD` with stdin from /dev/null, run under a keeper of its own (the
//! command's keeper, `keeper/`, with nothing to hold), so that:
//! - the probe has a process group of its own, never the command's;
//! - its exit status comes over the keeper's socket, not from `waitpid`: pgleader reaps every
//!   child on each SIGCHLD (`handle::reap_all`, it may be PID 1), and would otherwise steal it.
//!   Only the keeper is reaped there, as any orphan is;
//! - a probe that outlives `--health-timeout` is killed with its whole tree (the keeper is a
//!   subreaper: a grandchild that left the group with setsid goes too), and so is anything a
//!   probe that exited left behind;
//! - nothing of a probe outlives pgleader (the keeper kills its tree when pgleader's end of the
//!   socket closes).
//!
//! Its output (stdout and stderr) goes to a file in a private directory, read after it ends:
//! the last lines of a failing probe's output are logged with the failure.

use std::ffi::OsString;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{debug, info, warn};

use crate::exit::ChildStatus;
use crate::operate::metrics::HealthResult;
use crate::operate::notify;
use crate::operate::telemetry::{HealthState, HealthView, Telemetry};
use crate::supervise::hook::Hooks;
use crate::supervise::inbox::Inbox;
use crate::supervise::keeper::handle::{CommandLine, Parked};
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::stop::{Stop, status_of};
use crate::time::for_people as fmt;

/// `--health-cmd` and its companions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// A shell command line, run with `sh -c`.
    pub command: String,
    /// From the end of one probe to the start of the next.
    pub interval: Duration,
    pub timeout: Duration,
    /// Failures in a row that make the replica unhealthy.
    pub retries: u32,
}

/// How many lines of a failing probe's output the warning quotes, and how long each may be.
const OUTPUT_LINES: usize = 2;
const OUTPUT_LINE_CHARS: usize = 200;

/// The outer shell sends the probe's output to the file named by its first argument, then
/// becomes `sh -c CMD` (its second): CMD runs exactly as `sh -c` runs it.
const WRAPPER: &str = "exec </dev/null >\"$1\" 2>&1; exec /bin/sh -c \"$2\"";

/// The supervisor's side: the probe's state, and the task that keeps it. Without
/// `--health-cmd`, always healthy.
#[derive(Debug)]
pub struct Health {
    state: Option<watch::Receiver<HealthState>>,
    task: Option<JoinHandle<()>>,
    /// Where the probe's output goes; removed with `Health`.
    output_dir: Option<PathBuf>,
}

impl Health {
    /// Always healthy: no probe.
    pub fn none() -> Health {
        Health {
            state: None,
            task: None,
            output_dir: None,
        }
    }

    /// Starts probing at once (the first probe runs before the replica may queue), in a task
    /// beside the supervisor, for as long as `Health` lives.
    pub fn start(check: HealthCheck, telemetry: Telemetry) -> anyhow::Result<Health> {
        let output_dir = private_dir();
        let output = output_dir
            .as_ref()
            .map_or_else(|| PathBuf::from("/dev/null"), |dir| dir.join("output"));
        let argv = vec![
            OsString::from("/bin/sh"),
            OsString::from("-c"),
            OsString::from(WRAPPER),
            OsString::from("pgleader-health"),
            output.clone().into_os_string(),
            OsString::from(&check.command),
        ];
        let command = CommandLine::resolve(argv, None)
            .map_err(|err| anyhow::anyhow!("cannot run the health probe: {err}"))?;
        let (sender, receiver) = watch::channel(HealthState::Starting);
        let probe = Probe {
            check,
            command,
            output: output_dir.is_some().then_some(output),
            tracker: Tracker::default(),
            state: sender,
            telemetry,
        };
        Ok(Health {
            state: Some(receiver),
            task: Some(tokio::spawn(probe.run())),
            output_dir,
        })
    }

    /// Whether this replica may queue and lead.
    pub fn is_healthy(&self) -> bool {
        self.state
            .as_ref()
            .is_none_or(|state| *state.borrow() == HealthState::Healthy)
    }

    /// Completes when the replica is not healthy (at once if it is not now). Cancel-safe.
    pub async fn turned_unhealthy(&mut self) {
        let Some(state) = &mut self.state else {
            return std::future::pending().await;
        };
        if state
            .wait_for(|state| *state != HealthState::Healthy)
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    }

    /// Waits out of the election, answering signals, until the probe passes (at once if it
    /// has). False if pgleader should shut down.
    pub async fn sit_out(&mut self, inbox: &mut Inbox) -> bool {
        if self.is_healthy() {
            return true;
        }
        info!(
            event = "health_wait",
            "not queueing for the lock until the health probe (--health-cmd) passes"
        );
        notify::status("waiting for the health probe to pass before queueing for the lock");
        inbox.telemetry.idle();
        loop {
            let event = tokio::select! {
                () = self.passed() => return true,
                event = inbox.next_signal() => event,
            };
            if inbox.idle_signal(event) {
                return false;
            }
        }
    }

    /// Completes when the replica is healthy (at once if it is now). Cancel-safe.
    async fn passed(&mut self) {
        if let Some(state) = &mut self.state
            && state
                .wait_for(|state| *state == HealthState::Healthy)
                .await
                .is_err()
        {
            // The probe's task is gone (it ends only with `Health`): nothing will ever pass
            // again, and a replica must not take that for a pass and spin.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Health {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // A probe running now: its keeper kills its tree when the socket closes.
            task.abort();
        }
        if let Some(dir) = self.output_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A directory only this user can enter, for the probe's output; `None` if none can be made
/// (the output is then thrown away).
fn private_dir() -> Option<PathBuf> {
    let base = std::env::temp_dir();
    sweep_stale_dirs(&base);
    for attempt in 0..3 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let dir = base.join(format!(
            "pgleader-health.{}.{nanos}.{attempt}",
            std::process::id()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Some(dir),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => {
                warn!(event = "health_output", reason = %err, dir = %base.display(), "cannot create a directory for the health probe's output; it is not logged");
                return None;
            }
        }
    }
    None
}

/// Removes the output directories of pgleaders that are gone: one killed -9 (or by the OOM
/// killer) could not remove its own, and its last output may hold what the probe
/// authenticates with. Only this user's own can be removed (they are 0700).
fn sweep_stale_dirs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix("pgleader-health."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// How one probe ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    /// A non-zero exit, or death by a signal; with the last lines of its output.
    Failed(ChildStatus, String),
    /// Killed at `--health-timeout`; with the last lines of its output.
    TimedOut(Duration, String),
    /// The probe could not be started at all.
    CannotRun(String),
}

impl Outcome {
    fn result(&self) -> HealthResult {
        match self {
            Outcome::Passed => HealthResult::Passed,
            Outcome::TimedOut(..) => HealthResult::TimedOut,
            Outcome::Failed(..) | Outcome::CannotRun(_) => HealthResult::Failed,
        }
    }

    /// What failed, for `/healthz`, `/status` and the metrics' neighbours: "exit code 1",
    /// "timed out after 5s", without the probe's output, which may hold what it authenticates
    /// with (the log has it).
    fn summary(&self) -> Option<String> {
        Some(match self {
            Outcome::Passed => return None,
            Outcome::Failed(ChildStatus::Exited(code), _) => format!("exit code {code}"),
            Outcome::Failed(ChildStatus::Signaled(signal), _) => {
                format!("killed by {}", signal.as_str())
            }
            Outcome::TimedOut(after, _) => format!("timed out after {}", fmt(*after)),
            Outcome::CannotRun(reason) => format!("cannot run: {reason}"),
        })
    }

    /// What failed, for the log: the summary with the output's last lines.
    fn reason(&self) -> Option<String> {
        let (what, output) = match self {
            Outcome::Passed => return None,
            Outcome::Failed(ChildStatus::Exited(code), output) => {
                (format!("exit code {code}"), output)
            }
            Outcome::Failed(ChildStatus::Signaled(signal), output) => {
                (format!("killed by {}", signal.as_str()), output)
            }
            Outcome::TimedOut(after, output) => {
                (format!("timed out after {}", fmt(*after)), output)
            }
            Outcome::CannotRun(reason) => return Some(format!("cannot run: {reason}")),
        };
        Some(if output.is_empty() {
            what
        } else {
            format!("{what}: {output}")
        })
    }
}

/// Docker's rule, counted: healthy after one pass, unhealthy after `retries` failures in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracker {
    pub state: HealthState,
    pub failures: u32,
    pub last_check: Option<Timestamp>,
    pub last_failure: Option<(Timestamp, String)>,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            state: HealthState::Starting,
            failures: 0,
            last_check: None,
            last_failure: None,
        }
    }
}

impl Tracker {
    /// Counts a probe's outcome; the new state if it changed.
    pub fn record(
        &mut self,
        outcome: &Outcome,
        retries: u32,
        now: Timestamp,
    ) -> Option<HealthState> {
        self.last_check = Some(now);
        let next = match outcome.summary() {
            None => {
                self.failures = 0;
                HealthState::Healthy
            }
            Some(reason) => {
                self.failures = self.failures.saturating_add(1);
                self.last_failure = Some((now, reason));
                if self.failures >= retries {
                    HealthState::Unhealthy
                } else {
                    self.state
                }
            }
        };
        (next != self.state).then(|| {
            self.state = next;
            next
        })
    }

    fn view(&self) -> HealthView {
        HealthView {
            state: self.state,
            consecutive_failures: self.failures,
            last_check: self.last_check,
            last_failure: self.last_failure.clone(),
        }
    }
}

/// The probe's task: runs the probe, keeps the count, logs, publishes.
struct Probe {
    check: HealthCheck,
    command: CommandLine,
    output: Option<PathBuf>,
    tracker: Tracker,
    state: watch::Sender<HealthState>,
    telemetry: Telemetry,
}

impl Probe {
    async fn run(mut self) {
        loop {
            let started = Instant::now();
            let outcome = self.probe_once().await;
            let retries = self.check.retries;
            let changed = self.tracker.record(&outcome, retries, Timestamp::now());
            let failures = self.tracker.failures;
            match outcome.reason() {
                None => debug!(
                    event = "health_passed",
                    took_ms = started.elapsed().as_millis() as u64,
                    "the health probe passed"
                ),
                Some(reason) => warn!(
                    event = "health_failed",
                    failures,
                    retries,
                    reason = %reason,
                    "the health probe failed ({failures} of {retries} in a row): {reason}"
                ),
            }
            self.telemetry
                .health_probed(self.tracker.view(), outcome.result());
            match changed {
                Some(HealthState::Unhealthy) => warn!(
                    event = "unhealthy",
                    failures,
                    "unhealthy: the health probe failed {failures} times in a row; this replica does not lead or queue for the lock until it passes"
                ),
                Some(HealthState::Healthy) => info!(
                    event = "healthy",
                    "healthy: the health probe passed; this replica may queue for the lock"
                ),
                Some(HealthState::Starting) | None => {}
            }
            if let Some(state) = changed {
                self.state.send_replace(state);
            }
            sleep(self.check.interval).await;
        }
    }

    /// Runs the probe once, within its timeout; whatever it started is gone on return.
    async fn probe_once(&self) -> Outcome {
        let timeout = self.check.timeout;
        let deadline = Instant::now() + timeout;
        let command = self.command.clone();
        let output = self.output.clone();
        let spawned = tokio::task::spawn_blocking(move || {
            // Emptied first: a probe that times out before its shell opened the file must not
            // be quoted with the previous probe's output.
            if let Some(output) = output {
                let _ = std::fs::File::create(output);
            }
            Parked::spawn(&command, &Hooks::default())
        });
        let parked = match spawned.await {
            Ok(Ok(parked)) => parked,
            Ok(Err(err)) => return Outcome::CannotRun(err.to_string()),
            Err(err) => return Outcome::CannotRun(err.to_string()),
        };
        let mut job = match parked.start(&[], &[], None) {
            Ok(job) => job,
            Err(err) => return Outcome::CannotRun(err.to_string()),
        };
        let mut status = None;
        let mut finished = false;
        while !finished {
            tokio::select! {
                report = job.next_report() => match report {
                    Report::Exited(_) | Report::Killed(_) => {
                        status = Some(status_of(report));
                        // What the probe left behind goes too.
                        let _ = job.kill_everything();
                    }
                    Report::SpawnFailed(errno) => {
                        return Outcome::CannotRun(nix::errno::Errno::from_raw(errno).desc().to_owned());
                    }
                    Report::Done(_) => finished = true,
                    // A probe's keeper has no hooks, and watches no deadline.
                    Report::Started(_)
                    | Report::PreStartFailed(_)
                    | Report::PostStop(_)
                    | Report::Expired(_) => {}
                },
                _ = sleep_until(deadline) => break,
            }
        }
        if !finished {
            // Timed out, or its leftovers outlived it: the keeper SIGKILLs every descendant
            // and reports when none is left; if it cannot, its group goes with it, and the
            // probe is over (its keeper is reaped as an orphan, not waited for here).
            let mut stop = Stop::kill_quietly(&job, Label::job("health probe"));
            while stop.finish(&mut job, Instant::now()).is_none() {
                let Some(at) = stop.next_timer() else { break };
                tokio::select! {
                    report = job.next_report() => stop.on_report(&job, report),
                    _ = sleep_until(at) => stop.on_timer(&job, Instant::now()),
                }
            }
        }
        let output = match self.output.clone() {
            // A file read, however small, stays off the thread the supervisor runs on.
            Some(path) => tokio::task::spawn_blocking(move || last_lines(&path))
                .await
                .unwrap_or_default(),
            None => String::new(),
        };
        match status {
            Some(ChildStatus::Exited(0)) => Outcome::Passed,
            Some(status) => Outcome::Failed(status, output),
            None => Outcome::TimedOut(timeout, output),
        }
    }
}

/// The last non-empty lines of the probe's output, each cut short, joined with " | ".
fn last_lines(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 4096;
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let length = file.metadata().map_or(0, |meta| meta.len());
    let _ = file.seek(SeekFrom::Start(length.saturating_sub(TAIL)));
    let mut bytes = Vec::new();
    let _ = file.take(TAIL).read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(|line| line.chars().take(OUTPUT_LINE_CHARS).collect())
        .collect();
    lines[lines.len().saturating_sub(OUTPUT_LINES)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> Outcome {
        Outcome::Failed(ChildStatus::Exited(1), "down".to_owned())
    }

    #[test]
    fn one_pass_makes_healthy_and_retries_failures_in_a_row_unhealthy() {
        let now = Timestamp::now();
        let mut tracker = Tracker::default();
        assert_eq!(tracker.record(&failed(), 3, now), None, "still starting");
        assert_eq!(
            tracker.record(&Outcome::Passed, 3, now),
            Some(HealthState::Healthy)
        );
        assert_eq!(tracker.record(&failed(), 3, now), None);
        assert_eq!(tracker.record(&failed(), 3, now), None);
        assert_eq!(
            tracker.record(
                &Outcome::TimedOut(Duration::from_secs(5), String::new()),
                3,
                now
            ),
            Some(HealthState::Unhealthy)
        );
        assert_eq!(tracker.failures, 3);
        assert_eq!(
            tracker
                .last_failure
                .as_ref()
                .map(|(_, reason)| reason.as_str()),
            Some("timed out after 5s")
        );
        assert_eq!(tracker.record(&failed(), 3, now), None, "stays unhealthy");
        assert_eq!(
            tracker.record(&Outcome::Passed, 3, now),
            Some(HealthState::Healthy)
        );
        assert_eq!(tracker.failures, 0);
    }

    #[test]
    fn a_replica_that_never_passed_turns_unhealthy_after_retries() {
        let now = Timestamp::now();
        let mut tracker = Tracker::default();
        assert_eq!(tracker.record(&failed(), 2, now), None);
        assert_eq!(
            tracker.record(&failed(), 2, now),
            Some(HealthState::Unhealthy)
        );
        assert_eq!(
            failed().reason().as_deref(),
            Some("exit code 1: down"),
            "the reason quotes the output"
        );
    }

    #[test]
    fn the_output_s_last_two_lines_are_kept() {
        let path =
            std::env::temp_dir().join(format!("pgleader-health-test-{}", std::process::id()));
        std::fs::write(&path, "one\ntwo\n\nthree\n").expect("write");
        assert_eq!(last_lines(&path), "two | three");
        std::fs::remove_file(&path).ok();
        assert_eq!(last_lines(&path), "");
    }
}
