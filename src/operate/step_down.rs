//! `pgleader step-down`: asks the lock's leader to hand over, and watches it happen.
//!
//! It reads the holder and the waiters with the backend's observer (as `status` does), refuses
//! where a step-down would only stop the command (nobody waits to take over), sends a request
//! with an id of its own through the lock's server (see `election/step_down.rs`), then reads
//! the holder every [`POLL`] until another replica leads, or `--timeout` has passed.
//!
//! Leadership moved when the lock is held by a session that was waiting when the request went
//! out, or by one whose name (`<name>:<pid>@<host>`) names another pgleader process: a leader
//! that took the lock back (the waiter it handed over to vanished meanwhile) does not count,
//! and two replicas that are both pid 1 in containers with one host name are still told apart.
//! The whole request is bounded by `--timeout`.

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
    // One deadline for the whole request: a server that stops answering (a silent partition)
    // must not hold the command past --timeout.
    let deadline = Instant::now() + timeout;
    let no_answer = || {
        anyhow::anyhow!(
            "no answer from {backend} within {} (--timeout)",
            fmt(timeout)
        )
    };
    let observer = tokio::time::timeout_at(deadline, backend.observe())
        .await
        .map_err(|_| no_answer())?
        .with_context(|| format!("cannot connect to {backend}"))?;
    let before = tokio::time::timeout_at(deadline, status::query(lock, &observer))
        .await
        .map_err(|_| no_answer())??;
    if before.shards.is_some() {
        return Err(Refused(format!(
            "lock {lock} runs with --shards: its replicas share the shards out among themselves, \
             and have no single leader to step down. To move a replica's shards, stop it (TERM) \
             or restart it"
        ))
        .into());
    }
    let Some(leader) = before.holder.clone() else {
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
    let heard = tokio::time::timeout_at(deadline, observer.ask_step_down(&request))
        .await
        .map_err(|_| no_answer())?
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
    let moved = tokio::time::timeout_at(deadline, async {
        loop {
            tokio::time::sleep(POLL).await;
            let now = status::query(lock, &observer).await?;
            if let Some(holder) = now.holder
                && moved_to(&holder, &leader, &before.waiting)
            {
                return Ok::<_, anyhow::Error>(holder);
            }
        }
    })
    .await;
    let moved = match moved {
        Ok(result) => Some(result.context("cannot follow the handoff")?),
        Err(_) => None,
    };
    // At the deadline, one last look, itself bounded: the handoff may have just happened.
    let (moved, now) = match moved {
        Some(holder) => (Some(holder), None),
        None => {
            let last = tokio::time::timeout(POLL * 50, status::query(lock, &observer)).await;
            let now = last.ok().and_then(Result::ok).and_then(|now| now.holder);
            match now {
                Some(holder) if moved_to(&holder, &leader, &before.waiting) => (Some(holder), None),
                other => (None, other),
            }
        }
    };
    if let Some(holder) = moved {
        say(&format!(
            "lock {lock}: led by {}; now led by {} ({} after the request)",
            leader.short(),
            holder.short(),
            fmt(asked.elapsed())
        ));
        return Ok(exit::SUCCESS);
    }
    let where_now = match now {
        Some(holder) if same_session(&holder, &leader) => format!("{} leads still", holder.short()),
        Some(holder) => format!("{} leads again", holder.short()),
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

/// Whether `holder` is another replica than the old `leader`: not its session, and either a
/// session that was waiting when the request was sent, or one whose name names another
/// pgleader process. A stepped-down leader that takes the lock back does so on a new session
/// of the same process, and was not among the waiters: no move. Names alone cannot tell two
/// replicas apart that are both pid 1 in containers with one host name.
fn moved_to(holder: &Participant, leader: &Participant, waiting: &[Participant]) -> bool {
    if same_session(holder, leader) {
        return false;
    }
    if waiting.iter().any(|waiter| same_session(waiter, holder)) {
        return true;
    }
    match (holder.pgleader_process(), leader.pgleader_process()) {
        (Some(one), Some(other)) => one != other,
        _ => true,
    }
}

/// The same session on the server.
fn same_session(a: &Participant, b: &Participant) -> bool {
    a.backend_pid == b.backend_pid && a.backend_start == b.backend_start
}

fn say(line: &str) {
    // A reader that went away (`| head`) is no reason to panic.
    let _ = writeln!(std::io::stdout(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_to_a_waiter_or_another_process_never_to_the_leader_again() {
        let session = |pid: i32, start: &str, name: &str| Participant {
            backend_pid: pid,
            backend_start: Some(start.to_owned()),
            application_name: Some(name.to_owned()),
            ..Participant::default()
        };
        let leader = session(1, "t1", "pgleader:42@web-1");
        let waiter = session(2, "t2", "pgleader:42@web-1");
        // Both pid 1 in containers named alike: the waiter's session tells them apart.
        assert!(moved_to(&waiter, &leader, std::slice::from_ref(&waiter)));
        // The old leader again, on a new session: not a move.
        let back = session(3, "t3", "pgleader:42@web-1");
        assert!(!moved_to(&back, &leader, std::slice::from_ref(&waiter)));
        // A process that started waiting after the request: another process, a move.
        let late = session(4, "t4", "pgleader:43@web-2");
        assert!(moved_to(&late, &leader, std::slice::from_ref(&waiter)));
        assert!(!moved_to(&leader, &leader, &[]));
    }
}
