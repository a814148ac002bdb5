//! `pgleader cron --check`: a crontab as pgleader reads it, job by job, with the next
//! occurrences of each in its own zone, so that a file can be checked (in CI, in a Dockerfile's
//! build) before any replica runs it, and a daylight-saving night can be looked at in advance.
//! It also says what the file may not mean to its author (the reader's notes: where cron would
//! read it otherwise, where supercronic would refuse it, a job that never runs) and where each
//! job's zone comes from, since with no `CRON_TZ` that is the host's.

use std::fmt::Write;

use jiff::Timestamp;

use crate::schedule::crontab::{CronJob, Crontab, definition_hex};
use crate::time::for_people as fmt;

/// The report: a line for the file, then a paragraph for each job.
pub fn report(crontab: &Crontab, from: Timestamp, count: usize) -> String {
    let mut out = String::new();
    let jobs = crontab.jobs.len();
    let _ = writeln!(
        out,
        "{}: {jobs} job{}",
        crontab.path.display(),
        if jobs == 1 { "" } else { "s" }
    );
    for warning in crontab.warnings(from) {
        let _ = writeln!(out, "warning: {warning}");
    }
    for job in &crontab.jobs {
        let _ = writeln!(out, "\n{} (line {})", job.name, job.line);
        let _ = writeln!(out, "  schedule  {}", schedule(job));
        let _ = writeln!(
            out,
            "  zone      {} ({})",
            job.when.timezone(),
            job.zone_source
        );
        let _ = writeln!(out, "  command   {} -c {:?}", job.shell, job.command);
        let _ = writeln!(
            out,
            "  options   overlap={} catch-up={} timeout={} jitter={} ping={}",
            job.overlap.as_str(),
            fmt(job.catch_up),
            job.timeout
                .map_or_else(|| "none".to_owned(), |timeout| fmt(timeout).to_string()),
            job.jitter
                .map_or_else(|| "none".to_owned(), |jitter| fmt(jitter).to_string()),
            // The monitor's host only: its path is the check's secret.
            job.ping
                .as_ref()
                .map_or_else(|| "none".to_owned(), |ping| ping.shown())
        );
        // As `status` shows a job's definitions while replicas disagree: which file is which.
        let definition = definition_hex(job.definition_marker());
        let _ = writeln!(out, "  definition {definition}");
        let next = occurrences(job, from, count);
        if next.is_empty() && count > 0 {
            let _ = writeln!(
                out,
                "  next      none: it never occurs again, and never runs"
            );
        }
        for (index, at) in next.into_iter().enumerate() {
            let label = if index == 0 { "  next" } else { "" };
            let _ = writeln!(out, "{label:<12}{at}");
        }
    }
    out
}

fn schedule(job: &CronJob) -> String {
    match job.when.period() {
        Some(every) => format!("@every {} (from the Unix epoch, UTC)", fmt(every)),
        None => format!(
            "{} in {} (seconds first)",
            job.when.expression(),
            job.when.timezone()
        ),
    }
}

/// The next `count` occurrences after `from`, as the wall clock of the job's zone shows them.
fn occurrences(job: &CronJob, from: Timestamp, count: usize) -> Vec<String> {
    let mut found = Vec::new();
    let mut at = from;
    while found.len() < count {
        let Some(next) = job.when.next_after(at) else {
            break;
        };
        let wall_clock = job
            .when
            .local(next)
            .unwrap_or_else(|| next.to_zoned(jiff::tz::TimeZone::UTC));
        let mut line = wall_clock.strftime("%Y-%m-%d %H:%M:%S %:z").to_string();
        if let Some(most) = job.jitter {
            // Every replica puts this occurrence off by as much: it can be shown in advance.
            let delay = crate::schedule::jitter(&job.name, next, most);
            let start = job
                .when
                .local(next.checked_add(delay).unwrap_or(next))
                .unwrap_or_else(|| next.to_zoned(jiff::tz::TimeZone::UTC));
            let format = if start.date() == wall_clock.date() {
                "%H:%M:%S%.3f"
            } else {
                "%Y-%m-%d %H:%M:%S%.3f"
            };
            let _ = write!(line, ", starts {} (jitter)", start.strftime(format));
        }
        found.push(line);
        at = next;
    }
    found
}
