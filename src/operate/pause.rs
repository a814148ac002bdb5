//! `pgleader cron pause|resume --lock NAME JOB` (or `--all`): a crontab job paused across the
//! fleet, as Kubernetes suspends a CronJob. The pause is kept by the server beside the ledger
//! (on PostgreSQL a table next to the ledger's, on Redis a hash under the fleet's name), so
//! it holds through restarts, rereads and deploys of every replica, and no replica has to be
//! told: the claim of each occurrence looks it up in the same statement and, while the job is
//! paused, records the occurrence as `paused` instead of running it. A paused occurrence is
//! recorded, so it is neither reported missed nor caught up once the job resumes: the job
//! runs from its next occurrence. A run going on when the pause comes is not stopped.

use anyhow::Context;

use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::election::{Backend, Observer};
use crate::environment::{Environment, ProcessEnvironment};
use crate::exit;
use crate::time::rfc3339_millis;

/// The name under which a pause of every job is kept.
pub const EVERY_JOB: &str = "*";

/// Pauses (`pause`) or resumes `job` (`None`: every job) of the fleet of `lock`; says what it
/// did on stdout.
pub async fn pause_or_resume<B: Backend>(
    lock: &LockKey,
    backend: &B,
    job: Option<&str>,
    pause: bool,
) -> anyhow::Result<u8> {
    let observer = backend
        .observe()
        .await
        .with_context(|| format!("cannot connect to {backend}"))?;
    let name = job.unwrap_or(EVERY_JOB);
    let what = match job {
        Some(job) => format!("job {job} of lock {lock}"),
        None => format!("every job of lock {lock}"),
    };
    let detail = pause.then(|| {
        let user = ProcessEnvironment.os_user().unwrap_or_else(|| "?".into());
        format!(
            "paused by {user}@{} at {}{}",
            host_name(),
            rfc3339_millis(jiff::Timestamp::now()),
            if job.is_none() { ", every job" } else { "" }
        )
    });
    let changed = observer
        .set_paused(name, detail.as_deref())
        .await
        .map_err(anyhow::Error::from)
        .context("cannot change the pause")?
        .context("this backend keeps no crontab")?;
    let paused = observer
        .paused()
        .await
        .map_err(anyhow::Error::from)
        .context("cannot read the pauses")?;
    let every = paused.iter().find(|(name, _)| name == EVERY_JOB);
    let mut out = String::new();
    let mut code = exit::SUCCESS;
    if pause {
        out.push_str(&format!(
            "{what}: paused; its occurrences are recorded as paused, not run, until `pgleader cron resume`\n"
        ));
        if let Some(job) = job {
            let known = observer
                .job_history(job, 1)
                .await
                .map_err(anyhow::Error::from)
                .context("cannot read the ledger")?;
            if known.is_empty() {
                out.push_str(&format!(
                    "note: no run of job {job} is recorded yet: is its name right? (`pgleader cron --check FILE` lists the names)\n"
                ));
            }
        }
    } else if job.is_some() && every.is_some() {
        // Resuming one job while every job is paused resumes nothing.
        out.push_str(&format!(
            "{what}: still paused, as every job of the fleet is ({}); `pgleader cron resume --all` resumes them\n",
            every.map(|(_, detail)| detail.as_str()).unwrap_or_default()
        ));
        code = exit::FAILURE;
    } else if changed {
        out.push_str(&format!(
            "{what}: resumed; it runs from its next occurrence\n"
        ));
    } else {
        out.push_str(&format!("{what}: was not paused\n"));
    }
    // A reader that went away (`| head`) is no reason to panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    Ok(code)
}
