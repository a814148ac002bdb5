//! `pgleader status`: who holds the lock and who waits for it, as the backend's observer reads
//! them (on PostgreSQL, `pg_locks` and `pg_stat_activity`; on Redis, the lock's key, its queue
//! and the sessions' cards, see `redis/observer.rs`), in text or JSON. Each session is named by
//! the id its server gives it: a backend pid on PostgreSQL, a client id on Redis.
//!
//! pgleader names its sessions `<name>:<pid>@<host>` (see `election/participant.rs`), so the
//! holder's host and pid show up here without any table of pgleader's own. Waiters are listed in
//! the order they began waiting. For a scheduled lock it adds the ledger's view
//! (see `schedule/report.rs`): the schedule, the next occurrence and the last runs.

use std::fmt::Write as _;

use anyhow::Context;
use serde_json::{Value, json};

use crate::election::Observer;
use crate::election::lock::LockKey;
use crate::election::participant::{Participant, ServerView};
use crate::schedule::report::{self, ScheduleReport};

/// What the server knows about the lock.
#[derive(Debug, Clone, PartialEq)]
pub struct LockStatus {
    pub lock: LockKey,
    pub holder: Option<Participant>,
    pub waiting: Vec<Participant>,
    /// For a quorum: what each server shows.
    pub servers: Vec<ServerView>,
    /// The key the lock is on, where the backend names it (Redis).
    pub key_name: Option<String>,
    /// For a scheduled lock: its schedule and last runs, from the ledger.
    pub schedule: Option<ScheduleReport>,
}

/// Reads the lock's status on `observer`, and its ledger if it is a scheduled lock.
pub async fn read<O: Observer>(lock: &LockKey, observer: &O) -> anyhow::Result<LockStatus> {
    let mut status = query(lock, observer).await?;
    let holder_pid = status.holder.as_ref().map(|holder| holder.backend_pid);
    status.schedule = report::read(observer, holder_pid)
        .await
        .map_err(anyhow::Error::from)
        .context("cannot read the ledger")?;
    Ok(status)
}

/// Reads who holds and who waits for the lock (not the ledger).
pub async fn query<O: Observer>(lock: &LockKey, observer: &O) -> anyhow::Result<LockStatus> {
    let view = observer.lock_view().await.map_err(anyhow::Error::msg)?;
    Ok(LockStatus {
        lock: lock.clone(),
        holder: view.holder,
        waiting: view.waiting,
        servers: view.servers,
        key_name: view.key_name,
        schedule: None,
    })
}

/// A participant as `status --json` shows it.
fn participant_json(participant: &Participant) -> Value {
    let process = participant.pgleader_process();
    let fingerprints = participant.fingerprints();
    json!({
        "backend_pid": participant.backend_pid,
        "application_name": participant.application_name,
        "pgleader_pid": process.map(|(pid, _)| pid),
        "pgleader_host": process.map(|(_, host)| host),
        "schedule_fingerprint": fingerprints.map(|(schedule, _)| schedule),
        "ledger_fingerprint": fingerprints.and_then(|(_, ledger)| ledger),
        "client_address": participant.client_address,
        "client_port": participant.client_port,
        "backend_start": participant.backend_start,
        "waiting_since": participant.waiting_since,
    })
}

impl LockStatus {
    pub fn is_held(&self) -> bool {
        self.holder.is_some()
    }

    /// The lock as its server knows it: `"nightly" (key 2774890235012722556)` on PostgreSQL,
    /// `"nightly" (key pgleader:{nightly})` on Redis.
    fn lock_label(&self) -> String {
        match (&self.key_name, self.lock.name()) {
            (Some(key), Some(name)) => format!("{name:?} (key {key})"),
            (Some(key), None) => format!("{} (key {key})", self.lock.key()),
            (None, _) => self.lock.to_string(),
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "lock": {
                "key": self.lock.key(),
                "redis_key": self.key_name,
                "name": self.lock.name(),
                "classid": self.lock.classid(),
                "objid": self.lock.objid(),
            },
            "held": self.is_held(),
            "holder": self.holder.as_ref().map(participant_json),
            "waiting": self.waiting.iter().map(participant_json).collect::<Vec<_>>(),
            "servers": self.servers.iter().map(|view| json!({
                "server": view.server,
                "reachable": view.holder.is_ok(),
                "holder": view.holder.as_ref().ok().and_then(Option::as_ref).map(participant_json),
                "error": view.holder.as_ref().err(),
            })).collect::<Vec<_>>(),
            "schedule": self.schedule.as_ref().map(ScheduleReport::to_json),
        })
    }

    /// Who holds and who waits, in order: what `status --watch` compares. The holder's session
    /// start is part of it, so that a new session with a recycled id counts as new.
    pub fn participants(&self) -> (Option<(i32, Option<&str>)>, Vec<i32>) {
        (
            self.holder
                .as_ref()
                .map(|holder| (holder.backend_pid, holder.backend_start.as_deref())),
            self.waiting
                .iter()
                .map(|waiter| waiter.backend_pid)
                .collect(),
        )
    }

    /// The state on one line, for `status --watch`.
    pub fn to_line(&self) -> String {
        let mut line = format!("lock {}: ", self.lock_label());
        match &self.holder {
            Some(holder) => {
                let _ = write!(line, "leader {}", holder.short());
            }
            None => line.push_str("free"),
        }
        if self.waiting.is_empty() {
            line.push_str("; nobody waiting");
        } else {
            let waiting: Vec<String> = self.waiting.iter().map(Participant::short).collect();
            let _ = write!(line, "; waiting: {}", waiting.join(", "));
        }
        line
    }

    pub fn to_text(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "lock {}: {}",
            self.lock_label(),
            if self.is_held() { "held" } else { "free" }
        );
        if let Some(holder) = &self.holder {
            let _ = writeln!(text, "  leader:  {}", holder.describe());
        }
        for (i, waiter) in self.waiting.iter().enumerate() {
            let _ = writeln!(text, "  waiting #{}: {}", i + 1, waiter.describe());
        }
        if self.waiting.is_empty() {
            let _ = writeln!(text, "  nobody is waiting");
        }
        for view in &self.servers {
            let seen = match &view.holder {
                Ok(Some(holder)) => format!("held by {}", holder.short()),
                Ok(None) => "free".to_owned(),
                Err(reason) => format!("unreachable: {reason}"),
            };
            let _ = writeln!(text, "  server {}: {seen}", view.server);
        }
        if let Some(schedule) = &self.schedule {
            schedule.write_text(&mut text);
        }
        text
    }
}
