//! `pgleader cron run --lock NAME JOB`: a crontab job run once, now, by hand, on whichever
//! replica owns it. The request is kept by the server beside the ledger (on PostgreSQL a table
//! next to the ledger's, on Redis a hash under the job's keys) and the fleet is woken on the
//! channel its replicas already listen on (NOTIFY, PUBLISH), so the owner takes it at once,
//! without polling; an owner that takes a job over takes what waits for it too. The owner
//! takes a request in one atomic step that succeeds only while it holds the job, so a request
//! runs at most once, and records the run on the request, never as one of the job's
//! occurrences. The run follows the job's `overlap=`: beside a run going on, `skip` records it
//! as skipped, `allow` runs it beside, `replace` stops the one going on first.
//!
//! The command waits for the run by reading the request (a few times a second: only this
//! command waits on it) and exits with its exit status, or at once with `--no-wait`.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;

use crate::config::UsageError;
use crate::election::ledger::AskedEntry;
use crate::election::lock::LockKey;
use crate::election::participant::host_name;
use crate::election::{Backend, Observer};
use crate::environment::{Environment, ProcessEnvironment};
use crate::exit;
use crate::schedule::crontab::item_of;
use crate::time::{elapsed, for_people, rfc3339_millis};

/// How often a waiting `cron run` reads its request.
const POLL: Duration = Duration::from_millis(100);

/// After this long without an owner taking the request, the command says so (and waits on).
const UNTAKEN_NOTE: Duration = Duration::from_secs(5);

/// Asks the fleet of `lock` to run `job` now; waits for the run unless `!wait`. The exit
/// code: the run's (0 when it succeeded), [`exit::LOST_LEADERSHIP`] when it was skipped or
/// interrupted, 0 at once with `--no-wait`.
pub async fn run_now<B: Backend>(
    lock: &LockKey,
    backend: &B,
    job: &str,
    wait: bool,
) -> anyhow::Result<u8> {
    let observer = backend
        .observe()
        .await
        .with_context(|| format!("cannot connect to {backend}"))?;
    check_fleet(lock, &observer, job).await?;
    let user = ProcessEnvironment.os_user().unwrap_or_else(|| "?".into());
    let asked_by = format!("{user}@{}", host_name());
    let id = observer
        .ask_run(job, &asked_by)
        .await
        .map_err(anyhow::Error::from)
        .context("cannot ask for the run")?
        .context("this backend keeps no crontab")?;
    say(&format!(
        "asked the fleet of lock {lock} to run job {job} now (request {id}, by {asked_by})"
    ));
    if !wait {
        return Ok(exit::SUCCESS);
    }
    let asked = std::time::Instant::now();
    let (mut told_started, mut told_untaken) = (false, false);
    loop {
        let found = observer
            .asked_runs(job, Some(id), 1)
            .await
            .map_err(anyhow::Error::from)
            .context("cannot read the request")?;
        let Some(entry) = found.into_iter().next() else {
            anyhow::bail!("request {id} of job {job} is no longer kept");
        };
        if entry.is_settled() {
            return Ok(settled(job, &entry));
        }
        if entry.outcome == "running" && !told_started {
            told_started = true;
            say(&format!("job {job} started {}", where_(&entry)));
        }
        if entry.outcome == "asked" && !told_untaken && asked.elapsed() >= UNTAKEN_NOTE {
            told_untaken = true;
            say(&format!(
                "no replica has taken request {id} yet (the job's owner takes it at once; one \
                 that takes the job over takes it then); still waiting"
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Refuses a job no replica of the fleet defines (usage error, exit 2) and a fleet with no
/// replica running (exit 1): nobody could run it.
async fn check_fleet<O: Observer>(lock: &LockKey, observer: &O, job: &str) -> anyhow::Result<()> {
    let view = observer
        .lock_view()
        .await
        .map_err(|err| anyhow::anyhow!("cannot read the fleet: {err}"))?;
    let replicas = match &view.shards {
        Some(shards) if shards.count != 0 => {
            return Err(UsageError(format!(
                "lock {lock} runs with --shards {}, not as a crontab (pgleader cron): it has no \
                 jobs to run",
                shards.count
            ))
            .into());
        }
        Some(shards) => &shards.replicas,
        None => &Vec::new(),
    };
    if replicas.is_empty() {
        anyhow::bail!(
            "no replica of lock {lock} is running (pgleader cron): nobody could run job {job}"
        );
    }
    let item = item_of(job);
    if !replicas
        .iter()
        .any(|replica| replica.defines.contains_key(&item))
    {
        return Err(UsageError(format!(
            "no replica of lock {lock} defines a job named {job} (`pgleader cron --check \
             CRONTAB` lists the names)"
        ))
        .into());
    }
    Ok(())
}

/// Says how the run ended, with the lines it printed last where they were kept; the exit
/// code for it.
fn settled(job: &str, entry: &AskedEntry) -> u8 {
    let mut text = String::new();
    if let Some(output) = entry.output.as_deref().filter(|output| !output.is_empty()) {
        for printed in output.strip_suffix('\n').unwrap_or(output).split('\n') {
            let _ = writeln!(text, "  | {printed}");
        }
    }
    let took = match (entry.started_at, entry.ended_at) {
        (Some(started), Some(ended)) => format!(" after {}", for_people(elapsed(started, ended))),
        _ => String::new(),
    };
    let detail = entry
        .detail
        .as_deref()
        .map(|detail| format!(": {detail}"))
        .unwrap_or_default();
    let (what, code) = match (entry.outcome.as_str(), entry.exit_code) {
        ("succeeded", _) => ("succeeded".to_owned(), exit::SUCCESS),
        ("failed", Some(code)) => (
            format!("failed with exit status {code}"),
            u8::try_from(code).unwrap_or(exit::FAILURE).max(1),
        ),
        ("skipped", _) => ("was not run".to_owned(), exit::LOST_LEADERSHIP),
        ("interrupted", _) => ("was interrupted".to_owned(), exit::LOST_LEADERSHIP),
        (outcome, _) => (outcome.to_owned(), exit::FAILURE),
    };
    let _ = writeln!(text, "job {job} {what}{took} {}{detail}", where_(entry));
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    code
}

/// "on HOST (pgleader pid P)", where the request says.
fn where_(entry: &AskedEntry) -> String {
    let mut text = String::new();
    if let Some(host) = &entry.host {
        let _ = write!(text, "on {host}");
        if let Some(pid) = entry.pid {
            let _ = write!(text, " (pgleader pid {pid})");
        }
    }
    if let Some(at) = entry.started_at {
        let _ = write!(text, " at {}", rfc3339_millis(at));
    }
    text.trim_start().to_owned()
}

/// One line on stdout; a reader that went away (`| head`) is no reason to panic.
fn say(line: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stdout(), format!("{line}\n").as_bytes());
}
