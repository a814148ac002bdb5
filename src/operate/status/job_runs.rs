//! `pgleader status --lock NAME --job JOB`: one crontab job's last runs, newest first, from the
//! ledger, which keeps them under the job's name whichever replica ran them: each occurrence's
//! outcome, exit code, how long it took, which replica ran it, and what the ledger says of it
//! (why it was missed, skipped or interrupted), and the last lines it printed where they were
//! kept (`--keep-output`). It needs no crontab file and no replica running. Apart from `jobs.rs`, which lists every job with its newest run only.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::election::Observer;
use crate::election::ledger::Entry;
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
}

impl JobRuns {
    pub async fn read<O: Observer>(
        lock: &LockKey,
        job: &str,
        observer: &O,
    ) -> anyhow::Result<JobRuns> {
        let runs = observer
            .job_history(job, SHOWN)
            .await
            .map_err(|err| anyhow::anyhow!("cannot read the ledger: {err}"))?;
        Ok(JobRuns {
            lock: lock.clone(),
            job: job.to_owned(),
            runs,
        })
    }

    pub fn to_text(&self) -> String {
        let mut text = String::new();
        if self.runs.is_empty() {
            let _ = writeln!(
                text,
                "job {} of lock {}: no run recorded (a job's runs are kept under its name, as the \
                 crontab's directive or command gives it)",
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
            if let Some(host) = &run.host {
                let _ = write!(line, "  on {host}");
                if let Some(pid) = run.pid {
                    let _ = write!(line, " (pgleader pid {pid})");
                }
            }
            if let Some(detail) = &run.detail {
                let _ = write!(line, ": {detail}");
            }
            let _ = writeln!(text, "{}", line.trim_end());
            // What it printed, indented under it: the user's text, a line of the job's own
            // never taken for one of status's.
            if let Some(output) = run.output.as_deref().filter(|output| !output.is_empty()) {
                for printed in output.strip_suffix('\n').unwrap_or(output).split('\n') {
                    let _ = writeln!(text, "      | {printed}");
                }
            }
        }
        text
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
        json!({
            "lock": self.lock.name().map_or_else(|| self.lock.key().to_string(), str::to_owned),
            "lock_key": self.lock.key(),
            "job": self.job,
            "runs": runs,
        })
    }
}
