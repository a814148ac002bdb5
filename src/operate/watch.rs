//! `pgleader status --watch`: follow a lock's holder and waiters, printing a line (or a JSON
//! object) whenever they change, until TERM or INT.
//!
//! The server tells nobody when a lock changes hands, so this reads the backend's observer (on
//! PostgreSQL `pg_locks`, on Redis the lock's key and its queue) on one connection every
//! [`POLL`] (a change shows within that time plus a round trip). A connection that breaks or a
//! read that does not come back within [`QUERY_TIMEOUT`] is replaced, with backoff; errors that
//! retrying cannot fix (a bad password) end the watch.
//!
//! The epoch (the fencing token) is not compared; a leader takes a new one with each
//! leadership, on a new session, so a new epoch always shows here as a new holder.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use jiff::Timestamp;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::{MissedTickBehavior, interval, sleep, timeout};
use tracing::warn;

use crate::election::backoff::Backoff;
use crate::election::lock::LockKey;
use crate::election::{Backend, ConnectError};
use crate::exit;
use crate::operate::status::{self, LockStatus};
use crate::operate::telemetry::rfc3339;

/// How often the lock is read.
pub const POLL: Duration = Duration::from_millis(250);
/// How long one read may take before the connection is given up.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Watches until TERM or INT (exit 0), or until stdout is closed.
pub async fn watch<B: Backend>(lock: &LockKey, backend: &B, json: bool) -> anyhow::Result<u8> {
    let mut term = signal(SignalKind::terminate()).context("cannot listen for TERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot listen for INT")?;
    let stop = async {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    };
    tokio::select! {
        result = follow(lock, backend, json) => result,
        () = stop => Ok(exit::SUCCESS),
    }
}

async fn follow<B: Backend>(lock: &LockKey, backend: &B, json: bool) -> anyhow::Result<u8> {
    let mut backoff = Backoff::default();
    let mut last: Option<LockStatus> = None;
    loop {
        sleep(backoff.next_delay()).await;
        let observer = match backend.observe().await {
            Ok(observer) => observer,
            Err(ConnectError::Permanent(reason)) => {
                bail!("cannot connect to {backend}: {reason}")
            }
            Err(err) => {
                warn!(event = "connect_failed", server = %backend, reason = %err, "cannot connect; retrying");
                continue;
            }
        };
        let mut ticks = interval(POLL);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let status = match timeout(QUERY_TIMEOUT, status::query(lock, &observer)).await {
                Ok(Ok(status)) => status,
                Ok(Err(err)) => {
                    warn!(event = "session_lost", reason = %format!("{err:#}"), "cannot read the lock; reconnecting");
                    break;
                }
                Err(_) => {
                    warn!(
                        event = "session_lost",
                        "no answer within {}; reconnecting",
                        humantime::format_duration(QUERY_TIMEOUT)
                    );
                    break;
                }
            };
            backoff.reset();
            let changed = last
                .as_ref()
                .is_none_or(|last| last.participants() != status.participants());
            if changed {
                let line = if json {
                    let mut object = status.to_json();
                    object["time"] = rfc3339(Timestamp::now()).into();
                    object.to_string()
                } else {
                    format!("{} {}", rfc3339(Timestamp::now()), status.to_line())
                };
                let mut stdout = std::io::stdout().lock();
                if writeln!(stdout, "{line}")
                    .and_then(|()| stdout.flush())
                    .is_err()
                {
                    // Whoever read the output is gone (`| head -3`): nothing left to do.
                    return Ok(exit::SUCCESS);
                }
                last = Some(status);
            }
        }
    }
}
