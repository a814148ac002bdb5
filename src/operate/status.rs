//! `pgleader status`: who holds the lock and who waits for it, as the backend's observer reads
//! them (on PostgreSQL, `pg_locks` and `pg_stat_activity`; on Redis, the lock's key, its queue
//! and the sessions' cards, see `redis/observer.rs`), in text or JSON. Each session is named by
//! the id its server gives it: a backend pid on PostgreSQL, a client id on Redis.
//!
//! pgleader names its sessions `<name>:<pid>@<host>` (see `election/participant.rs`), so the
//! holder's host and pid show up here without any table of pgleader's own. Waiters are listed in
//! the order they began waiting. For a scheduled lock it adds the ledger's view
//! (see `schedule/report.rs`): the schedule, the next occurrence and the last runs. For a
//! sharded lock (`--shards`) it shows each replica with its shards, and every shard's holder.

mod job_runs;
mod jobs;

use std::fmt::Write as _;

use anyhow::Context;
use serde_json::{Value, json};

use crate::election::Observer;
use crate::election::lock::LockKey;
use crate::election::participant::{Participant, ServerView, ShardsView};
use crate::schedule::report::{self, ScheduleReport};
pub use job_runs::JobRuns;
pub use jobs::JobsReport;

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
    /// For a sharded lock whose replicas run: who holds which shard.
    pub shards: Option<ShardsView>,
    /// For a crontab fleet (`pgleader cron`) whose replicas run: its jobs.
    pub crontab: Option<JobsReport>,
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

/// Reads who holds and who waits for the lock (not the ledger), and for a crontab fleet
/// (whose replicas say so by the count marker 0, see `Items::marker`) its jobs.
pub async fn query<O: Observer>(lock: &LockKey, observer: &O) -> anyhow::Result<LockStatus> {
    let view = observer.lock_view().await.map_err(anyhow::Error::msg)?;
    let crontab = match &view.shards {
        Some(shards) if shards.count == 0 => {
            let now = observer
                .server_time()
                .await
                .map_err(anyhow::Error::from)
                .context("cannot read the server's clock")?;
            let jobs = observer
                .jobs()
                .await
                .map_err(anyhow::Error::from)
                .context("cannot read the crontab's jobs from the ledger")?;
            let paused = observer
                .paused()
                .await
                .map_err(anyhow::Error::from)
                .context("cannot read the crontab's paused jobs")?;
            Some(JobsReport::new(now, jobs.unwrap_or_default(), shards).with_pauses(&paused))
        }
        _ => None,
    };
    Ok(LockStatus {
        crontab,
        lock: lock.clone(),
        holder: view.holder,
        waiting: view.waiting,
        servers: view.servers,
        key_name: view.key_name,
        schedule: None,
        shards: view.shards,
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
            || self
                .shards
                .as_ref()
                .is_some_and(|shards| shards.replicas.iter().any(|r| !r.holds.is_empty()))
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
            "shards": self.shards.as_ref().map(|shards| json!({
                "count": shards.count,
                "replicas": shards.replicas.iter().map(|replica| {
                    let mut object = participant_json(&replica.participant);
                    object["max_shards"] = replica.cap.into();
                    object["holds"] = replica.holds.clone().into();
                    object["member"] = replica.member.into();
                    object
                }).collect::<Vec<_>>(),
                "holders": (0..shards.count).map(|shard| json!({
                    "shard": shard,
                    "backend_pid": shards.holder_of(shard).map(|r| r.participant.backend_pid),
                })).collect::<Vec<_>>(),
                "free": shards.free(),
            })),
            "crontab": self.crontab.as_ref().map(|crontab| crontab.to_json(participant_json)),
        })
    }

    /// Who holds and who waits, in order, and who holds which shard: what `status --watch`
    /// compares. A holder's session start is part of it, so that a new session with a
    /// recycled id counts as new.
    pub fn participants(&self) -> Participants<'_> {
        (
            self.holder
                .as_ref()
                .map(|holder| (holder.backend_pid, holder.backend_start.as_deref())),
            self.waiting
                .iter()
                .map(|waiter| waiter.backend_pid)
                .collect(),
            self.shards.as_ref().map_or_else(Vec::new, |shards| {
                shards
                    .replicas
                    .iter()
                    .map(|replica| {
                        (
                            replica.participant.backend_pid,
                            replica.participant.backend_start.as_deref(),
                            replica.holds.clone(),
                        )
                    })
                    .collect()
            }),
            self.crontab
                .as_ref()
                .map_or_else(Vec::new, JobsReport::changes),
        )
    }

    /// The state on one line, for `status --watch`.
    pub fn to_line(&self) -> String {
        if let Some(crontab) = &self.crontab {
            return format!("lock {}: {}", self.lock_label(), crontab.to_line());
        }
        if let Some(shards) = &self.shards {
            return format!("lock {}: {}", self.lock_label(), shards_line(shards));
        }
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
        if let (Some(crontab), Some(shards)) = (&self.crontab, &self.shards) {
            crontab.write_text(&mut text, &self.lock_label(), shards);
            return text;
        }
        if let Some(shards) = &self.shards {
            write_shards(&mut text, &self.lock_label(), shards);
            return text;
        }
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

/// What `status --watch` compares: the holder (backend pid, session start), the waiters,
/// each sharded replica with its shards, and a crontab's jobs with their owners and newest runs.
pub type Participants<'a> = (
    Option<(i32, Option<&'a str>)>,
    Vec<i32>,
    Vec<(i32, Option<&'a str>, Vec<u32>)>,
    Vec<jobs::JobChange>,
);

/// A sharded lock on one line: each replica's shards, then the free ones.
fn shards_line(shards: &ShardsView) -> String {
    let mut parts: Vec<String> = shards
        .replicas
        .iter()
        .map(|replica| {
            let held = if replica.holds.is_empty() {
                "none".to_owned()
            } else {
                ranges(&replica.holds)
            };
            format!("{held} {}", replica.participant.short())
        })
        .collect();
    let free = shards.free();
    parts.push(if free.is_empty() {
        "none free".to_owned()
    } else {
        format!("free {}", ranges(&free))
    });
    format!("{} shards: {}", shards.count, parts.join("; "))
}

/// `status` of a sharded lock: the replicas with their shards, then shard → holder.
fn write_shards(text: &mut String, label: &str, shards: &ShardsView) {
    let free = shards.free();
    let _ = writeln!(
        text,
        "lock {label}: {} shards on {} replica{}, {}",
        shards.count,
        shards.replicas.len(),
        if shards.replicas.len() == 1 { "" } else { "s" },
        if free.is_empty() {
            "every shard held".to_owned()
        } else {
            format!("{} free", free.len())
        }
    );
    for replica in &shards.replicas {
        let held = if replica.holds.is_empty() {
            "no shard".to_owned()
        } else {
            format!("shards {}", ranges(&replica.holds))
        };
        let cap = replica
            .cap
            .map(|cap| format!(" (--max-shards {cap})"))
            .unwrap_or_default();
        let _ = writeln!(
            text,
            "  replica: {}: {held}{cap}",
            replica.participant.describe()
        );
    }
    for shard in 0..shards.count {
        let holder = shards
            .holder_of(shard)
            .map_or_else(|| "free".to_owned(), |r| r.participant.short());
        let _ = writeln!(text, "  shard {shard}: {holder}");
    }
}

/// Sorted shard numbers as ranges: `0-3, 8, 10-11`.
fn ranges(shards: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut iter = shards.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while iter.peek() == Some(&(end + 1)) {
            end += 1;
            iter.next();
        }
        parts.push(if end == start {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::participant::ShardReplica;

    #[test]
    fn shard_numbers_read_as_ranges() {
        assert_eq!(ranges(&[]), "");
        assert_eq!(ranges(&[0, 1, 2, 3, 8, 10, 11]), "0-3, 8, 10-11");
        assert_eq!(ranges(&[5]), "5");
    }

    /// A replica of member `pid` (its backend pid too), pgleader `pid + 1000` on `web-<pid>`.
    pub(super) fn replica(pid: i32, holds: Vec<u32>) -> ShardReplica {
        ShardReplica {
            member: pid,
            participant: Participant {
                backend_pid: pid,
                granted: true,
                application_name: Some(format!("pgleader:{}@web-{pid}", pid + 1000)),
                ..Participant::default()
            },
            cap: None,
            holds,
            defines: Default::default(),
        }
    }

    #[test]
    fn a_sharded_lock_shows_each_shard_and_its_holder() {
        let shards = ShardsView {
            count: 6,
            replicas: vec![replica(1, vec![0, 1, 2]), replica(2, vec![3, 4])],
        };
        assert_eq!(
            shards_line(&shards),
            "6 shards: 0-2 pgleader 1001@web-1 (backend 1); 3-4 pgleader 1002@web-2 \
             (backend 2); free 5"
        );
        let mut text = String::new();
        write_shards(&mut text, "\"jobs\"", &shards);
        assert!(
            text.starts_with("lock \"jobs\": 6 shards on 2 replicas, 1 free\n"),
            "{text}"
        );
        assert!(text.contains("\n  shard 4: pgleader 1002@web-2"), "{text}");
        assert!(text.contains("\n  shard 5: free\n"), "{text}");
    }
}
