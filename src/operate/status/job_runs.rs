//! `pgleader status --lock NAME --job JOB`: one crontab job's last runs, newest first, from the
//! ledger, which keeps them under the job's name whichever replica ran them: each occurrence's
//! outcome, exit code, how long it took, which replica ran it, and what the ledger says of it
//! (why it was missed, skipped or interrupted), and the last lines it printed where they were
//! kept (`--keep-output`); and the runs asked for by hand (`pgleader cron run`), kept beside
//! the ledger with who asked. It needs no crontab file and no replica running. Apart from `jobs.rs`, which lists every job with its newest run only.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::election::Observer;
use crate::election::ledger::{AskedEntry, Entry};
use crate::election::lock::LockKey;
use crate::time::{elapsed, for_people, rfc3339_millis};

/// How many runs are shown.
pub const SHOWN: i64 = 20;

/// A job's last runs.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRuns {
    pub lock: LockKey,
    pub job: String,
    /// Newest first.
    pub runs: Vec<Entry>,
    /// The runs asked for by hand, newest first.
    pub asked: Vec<AskedEntry>,
}

impl JobRuns {
    pub async fn read<O: Observer>(
        lock: &LockKey,
        job: &str,
        observer: &O,
    ) -> anyhow::Result<JobRuns> {
        let mut runs = observer
            .job_history(job, SHOWN)
            .await
            .map_err(|err| anyhow::anyhow!("cannot read the ledger: {err}"))?;
        // A claim made ahead of an occurrence the server's clock has not reached is not a run
        // yet: its command starts at the instant.
        if runs.first().is_some_and(|run| run.outcome == "running") {
            let now = observer
                .server_time()
                .await
                .map_err(|err| anyhow::anyhow!("cannot read the server's clock: {err}"))?;
            runs.retain(|run| !(run.outcome == "running" && run.scheduled_for > now));
        }
        let asked = observer
            .asked_runs(job, None, SHOWN)
            .await
            .map_err(|err| anyhow::anyhow!("cannot read the runs asked for by hand: {err}"))?;
        Ok(JobRuns {
            lock: lock.clone(),
            job: job.to_owned(),
            runs,
            asked,
        })
    }

    pub fn to_text(&self) -> String {
        let mut text = String::new();
        if self.runs.is_empty() && self.asked.is_empty() {
            let _ = writeln!(
                text,
                "job {} of lock {}: no run recorded (a job's runs are kept under its name, as the \
                 crontab's directive or command gives it)",
                self.job, self.lock
            );
            return text;
        }
        self.asked_text(&mut text);
        if self.runs.is_empty() {
            let _ = writeln!(
                text,
                "job {} of lock {}: no scheduled run recorded",
                self.job, self.lock
            );
            return text;
        }
        let _ = writeln!(
            text,
            "job {} of lock {}: its last {} run{}, newest first",
            self.job,
            self.lock,
            self.runs.len(),
            if self.runs.len() == 1 { "" } else { "s" }
        );
        for run in &self.runs {
            let mut line = format!(
                "  {}  {:<11}",
                crate::time::rfc3339(run.scheduled_for),
                run.outcome
            );
            if let Some(code) = run.exit_code {
                let _ = write!(line, "  exit {code}");
            }
            if let Some(ended) = run.ended_at
                && !matches!(run.outcome.as_str(), "missed" | "skipped" | "paused")
            {
                let _ = write!(
                    line,
                    "  took {}",
                    for_people(elapsed(run.claimed_at, ended))
                );
            }
            if run.attempt > 1 {
                let _ = write!(line, "  attempt {}", run.attempt);
            }
            on_replica(&mut line, run.host.as_deref(), run.pid);
            if let Some(detail) = &run.detail {
                let _ = write!(line, ": {detail}");
            }
            let _ = writeln!(text, "{}", line.trim_end());
            printed(&mut text, run.output.as_deref());
        }
        text
    }

    /// The runs asked for by hand, newest first, before the scheduled ones.
    fn asked_text(&self, text: &mut String) {
        if self.asked.is_empty() {
            return;
        }
        let _ = writeln!(
            text,
            "job {} of lock {}: {} run{} asked for by hand (pgleader cron run), newest first",
            self.job,
            self.lock,
            self.asked.len(),
            if self.asked.len() == 1 { "" } else { "s" }
        );
        for run in &self.asked {
            let asked_at = run.asked_at.map(rfc3339_millis).unwrap_or_default();
            let mut line = format!("  #{:<4} {asked_at}  {:<11}", run.id, run.outcome);
            if let Some(code) = run.exit_code {
                let _ = write!(line, "  exit {code}");
            }
            if let (Some(started), Some(ended)) = (run.started_at, run.ended_at) {
                let _ = write!(line, "  took {}", for_people(elapsed(started, ended)));
            }
            let _ = write!(line, "  asked by {}", run.asked_by);
            on_replica(&mut line, run.host.as_deref(), run.pid);
            if let Some(detail) = &run.detail {
                let _ = write!(line, ": {detail}");
            }
            let _ = writeln!(text, "{}", line.trim_end());
            printed(text, run.output.as_deref());
        }
    }

    pub fn to_json(&self) -> Value {
        let runs: Vec<Value> = self
            .runs
            .iter()
            .map(|run| {
                json!({
                    "occurrence": crate::time::rfc3339(run.scheduled_for),
                    "outcome": run.outcome,
                    "exit_code": run.exit_code,
                    "attempt": run.attempt,
                    "claimed_at": rfc3339_millis(run.claimed_at),
                    "ended_at": run.ended_at.map(rfc3339_millis),
                    "duration_seconds": run
                        .ended_at
                        .map(|ended| elapsed(run.claimed_at, ended).as_secs_f64()),
                    "host": run.host,
                    "pid": run.pid,
                    "epoch": run.epoch,
                    "detail": run.detail,
                    "output": run.output,
                })
            })
            .collect();
        let asked: Vec<Value> = self
            .asked
            .iter()
            .map(|run| {
                json!({
                    "request": run.id,
                    "asked_at": run.asked_at.map(rfc3339_millis),
                    "asked_by": run.asked_by,
                    "outcome": run.outcome,
                    "exit_code": run.exit_code,
                    "started_at": run.started_at.map(rfc3339_millis),
                    "ended_at": run.ended_at.map(rfc3339_millis),
                    "duration_seconds": run
                        .started_at
                        .zip(run.ended_at)
                        .map(|(started, ended)| elapsed(started, ended).as_secs_f64()),
                    "host": run.host,
                    "pid": run.pid,
                    "detail": run.detail,
                    "output": run.output,
                })
            })
            .collect();
        json!({
            "lock": self.lock.name().map_or_else(|| self.lock.key().to_string(), str::to_owned),
            "lock_key": self.lock.key(),
            "job": self.job,
            "runs": runs,
            "asked": asked,
        })
    }
}

/// "  on HOST (pgleader pid PID)", where the row says.
fn on_replica(line: &mut String, host: Option<&str>, pid: Option<i32>) {
    if let Some(host) = host {
        let _ = write!(line, "  on {host}");
        if let Some(pid) = pid {
            let _ = write!(line, " (pgleader pid {pid})");
        }
    }
}

/// What a run printed, indented under it: the user's text, a line of the job's own never
/// taken for one of status's.
fn printed(text: &mut String, output: Option<&str>) {
    if let Some(output) = output.filter(|output| !output.is_empty()) {
        for line in output.strip_suffix('\n').unwrap_or(output).split('\n') {
            let _ = writeln!(text, "      | {line}");
        }
    }
}
