//! What `pgleader status` shows of a scheduled lock: its schedule as the ledger last recorded
//! it, the next occurrence on the server's clock, and the last runs with their outcomes.
//!
//! Status knows no `--schedule` of its own: the ledger's newest row says which definition ran
//! last. A row still marked `running` whose leader no longer holds the lock shows as
//! interrupted, which the next leader will record.

use std::fmt::Write as _;

use jiff::Timestamp;
use serde_json::{Value, json};

use crate::election::Observer;
use crate::election::ledger::{Entry, LedgerError};
use crate::schedule::calendar::{Schedule, fingerprint_of, rfc3339};

/// How many runs status shows.
pub const RUNS_SHOWN: i64 = 10;

/// A scheduled lock's schedule and last runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleReport {
    pub expression: String,
    pub timezone: String,
    pub next_occurrence: Option<Timestamp>,
    /// Newest first.
    pub runs: Vec<Entry>,
}

/// Reads the lock's ledger; `None` when there is no ledger or no row for the lock. `holder` is
/// the id of the session holding the lock now, if any.
pub async fn read<O: Observer>(
    observer: &O,
    holder: Option<i32>,
) -> Result<Option<ScheduleReport>, LedgerError> {
    let Some(mut runs) = observer.history(RUNS_SHOWN).await? else {
        return Ok(None);
    };
    let Some(newest) = runs.first().cloned() else {
        return Ok(None);
    };
    for run in &mut runs {
        if run.outcome == "running" && (holder.is_none() || run.backend_pid != holder) {
            run.outcome = "interrupted".into();
            run.detail = Some("its leader no longer holds the lock".into());
        }
    }
    let now = observer.server_time().await?;
    let next_occurrence = Schedule::parse(&newest.schedule, &newest.timezone)
        .ok()
        .and_then(|schedule| schedule.next_after(now));
    Ok(Some(ScheduleReport {
        expression: newest.schedule,
        timezone: newest.timezone,
        next_occurrence,
        runs,
    }))
}

impl ScheduleReport {
    pub fn to_json(&self) -> Value {
        json!({
            "expression": self.expression,
            "timezone": self.timezone,
            "fingerprint": fingerprint_of(&self.expression, &self.timezone),
            "next_occurrence": self.next_occurrence.map(rfc3339),
            "runs": self.runs.iter().map(run_json).collect::<Vec<_>>(),
        })
    }

    pub fn write_text(&self, text: &mut String) {
        let _ = writeln!(
            text,
            "  schedule: \"{}\" ({}), fingerprint {}; next occurrence {}",
            self.expression,
            self.timezone,
            fingerprint_of(&self.expression, &self.timezone),
            self.next_occurrence.map_or("none".to_owned(), rfc3339)
        );
        let _ = writeln!(text, "  last runs, newest first:");
        for run in &self.runs {
            let mut line = format!("    {}  {:<11}", rfc3339(run.scheduled_for), run.outcome);
            if let Some(code) = run.exit_code {
                let _ = write!(line, " exit {code}");
            }
            if run.attempt > 1 {
                let _ = write!(line, " attempt {}", run.attempt);
            }
            if let (Some(host), Some(pid)) = (&run.host, run.pid) {
                let _ = write!(
                    line,
                    " on {host} (pgleader pid {pid}, epoch {})",
                    run.epoch.unwrap_or(0)
                );
            }
            if let Some(ended) = run.ended_at
                && matches!(run.outcome.as_str(), "succeeded" | "failed" | "interrupted")
            {
                let took = ended.duration_since(run.claimed_at).as_millis() as f64 / 1000.0;
                let _ = write!(line, ", ran {took:.3} s");
            }
            if let Some(detail) = &run.detail {
                let _ = write!(line, ": {detail}");
            }
            let _ = writeln!(text, "{}", line.trim_end());
        }
    }
}

fn run_json(run: &Entry) -> Value {
    json!({
        "scheduled_for": rfc3339(run.scheduled_for),
        "outcome": run.outcome,
        "exit_code": run.exit_code,
        "attempt": run.attempt,
        "claimed_at": rfc3339(run.claimed_at),
        "ended_at": run.ended_at.map(rfc3339),
        "host": run.host,
        "pid": run.pid,
        "backend_pid": run.backend_pid,
        "epoch": run.epoch,
        "detail": run.detail,
    })
}
