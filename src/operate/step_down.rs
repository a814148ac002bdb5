//! `pgleader step-down`: asks the lock's leader to hand over, and watches it happen.
//!
//! It reads the holder and the waiters with the backend's observer (as `status` does), refuses
//! where a step-down would only stop the command (nobody waits to take over), sends a request
//! with an id of its own through the lock's server (see `election/step_down.rs`), then reads
//! the holder every [`POLL`] until another replica leads, or `--timeout` has passed.
//!
//! A replica is told apart from another by the pgleader process its session names
//! (`<name>:<pid>@<host>`), so that a leader that took the lock back (the waiter it handed
//! over to vanished meanwhile) does not count as a move.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use thiserror::Error;
use tokio::time::Instant;

use crate::election::lock::LockKey;
use crate::election::participant::Participant;
use crate::election::step_down::request_id;
use crate::election::{Backend, Observer};
use crate::exit;
use crate::operate::status;
use crate::time::for_people as fmt;

/// How often the holder is read while the handoff runs: a few round trips a second would do,
/// but the line's timing is what an operator reads.
pub const POLL: Duration = Duration::from_millis(10);

/// A step-down that cannot be asked for this lock: a usage error (exit 2).
#[derive(Debug, Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Asks the leader of `lock` to step down, and waits up to `timeout` for another replica to
/// lead. Returns the exit code; prints one line on stdout.
pub async fn step_down<B: Backend>(
    lock: &LockKey,
    backend: &B,
    timeout: Duration,
) -> anyhow::Result<u8> {
    let observer = backend
        .observe()
        .await
        .with_context(|| format!("cannot connect to {backend}"))?;
    let before = status::query(lock, &observer).await?;
    if before.shards.is_some() {
        return Err(Refused(format!(
            "lock {lock} runs with --shards: its replicas share the shards out among themselves, \
             and have no single leader to step down. To move a replica's shards, stop it (TERM) \
             or restart it"
        ))
        .into());
    }
    let Some(leader) = before.holder else {
        say(&format!("lock {lock}: no leader; nothing to step down"));
        return Ok(exit::LOCK_FREE);
    };
    if before.waiting.is_empty() {
        say(&format!(
            "lock {lock}: led by {}; no replica waits to take over, so the request was not \
             sent: it keeps leading",
            leader.short()
        ));
        return Ok(exit::NO_FOLLOWER);
    }
    let request = request_id();
    let asked = Instant::now();
    let heard = observer
        .ask_step_down(&request)
        .await
        .map_err(anyhow::Error::msg)?;
    tracing::debug!(event = "step_down_sent", request = %request, heard = ?heard, "asked the leader to step down");
    if heard == Some(0) {
        say(&format!(
            "lock {lock}: led by {}, which did not hear the request (a pgleader without \
             step-down, or one that has just lost the lock): leadership did not move",
            leader.short()
        ));
        return Ok(exit::NOT_MOVED);
    }
    let moved = tokio::time::timeout(timeout, async {
        loop {
            tokio::time::sleep(POLL).await;
            let now = status::query(lock, &observer).await?;
            if let Some(holder) = now.holder
                && !same_replica(&holder, &leader)
            {
                return Ok::<_, anyhow::Error>(holder);
            }
        }
    })
    .await;
    match moved {
        Ok(Ok(holder)) => {
            say(&format!(
                "lock {lock}: led by {}; now led by {} ({} after the request)",
                leader.short(),
                holder.short(),
                fmt(asked.elapsed())
            ));
            Ok(exit::SUCCESS)
        }
        Ok(Err(err)) => Err(err.context("cannot follow the handoff")),
        Err(_) => {
            let now = status::query(lock, &observer).await.ok();
            let where_now = match now.and_then(|now| now.holder) {
                Some(holder) if same_replica(&holder, &leader) => {
                    format!("{} leads again", holder.short())
                }
                Some(holder) => format!("{} leads", holder.short()),
                None => "nobody leads".to_owned(),
            };
            say(&format!(
                "lock {lock}: led by {}; leadership did not move to another replica within {} \
                 (--timeout); {where_now}",
                leader.short(),
                fmt(timeout)
            ));
            Ok(exit::NOT_MOVED)
        }
    }
}

/// Whether two sessions belong to one replica: the same pgleader process where their names
/// tell it, else the same session.
fn same_replica(a: &Participant, b: &Participant) -> bool {
    match (a.pgleader_process(), b.pgleader_process()) {
        (Some(one), Some(other)) => one == other,
        _ => a.backend_pid == b.backend_pid && a.backend_start == b.backend_start,
    }
}

fn say(line: &str) {
    // A reader that went away (`| head`) is no reason to panic.
    let _ = writeln!(std::io::stdout(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_its_pgleader_process_not_its_session() {
        let named = |pid: i32, name: &str| Participant {
            backend_pid: pid,
            application_name: Some(name.to_owned()),
            ..Participant::default()
        };
        assert!(same_replica(
            &named(1, "pgleader:42@web-1"),
            &named(2, "pgleader:42@web-1")
        ));
        assert!(!same_replica(
            &named(1, "pgleader:42@web-1"),
            &named(1, "pgleader:43@web-1")
        ));
        assert!(!same_replica(&named(1, "psql"), &named(2, "psql")));
    }
}
