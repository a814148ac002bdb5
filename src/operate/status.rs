//! `pgleader status`: who holds the lock and who waits for it, read from `pg_locks` and
//! `pg_stat_activity` on the server.
//!
//! pgleader names its sessions `<name>:<pid>@<host>` (see `config.rs`), so the holder's host
//! and pid show up here without any table of pgleader's own. Waiters are listed in the order
//! the server will grant them the lock (by `pg_locks.waitstart`, PostgreSQL 14+; by the start
//! of their query before that). For a scheduled lock it adds the ledger's view (see
//! `schedule/report.rs`): the schedule, the next occurrence and the last runs.

use std::fmt::Write as _;

use anyhow::Context;
use serde_json::{Value, json};
use tokio_postgres::types::Type;

use crate::config;
use crate::election::lock::LockKey;
use crate::postgres::conninfo::ConnSettings;
use crate::postgres::ledger::TableName;
use crate::postgres::session::{self, ConnectError, PlainClient, describe};
use crate::schedule::agreement::fingerprint_in;
use crate::schedule::report::{self, ScheduleReport};

/// One session holding or waiting for the lock.
#[derive(Debug, Clone, PartialEq)]
pub struct Participant {
    pub backend_pid: i32,
    pub granted: bool,
    pub application_name: Option<String>,
    pub client_address: Option<String>,
    pub client_port: Option<i32>,
    pub backend_start: Option<String>,
    pub waiting_since: Option<String>,
}

/// What the server knows about the lock.
#[derive(Debug, Clone, PartialEq)]
pub struct LockStatus {
    pub lock: LockKey,
    pub holder: Option<Participant>,
    pub waiting: Vec<Participant>,
    /// For a scheduled lock: its schedule and last runs, from the ledger.
    pub schedule: Option<ScheduleReport>,
}

const STATUS_SQL: &str = "\
SELECT l.pid, l.granted, a.application_name, host(a.client_addr), a.client_port,
       to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
       to_char(COALESCE(%WAITSTART%, a.query_start) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
  FROM pg_catalog.pg_locks l
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
   AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
   AND l.classid = $1 AND l.objid = $2 AND l.objsubid = 1
 ORDER BY l.granted DESC, COALESCE(%WAITSTART%, a.query_start), l.pid";

/// Reads the lock's status, and its ledger if it is a scheduled lock.
pub async fn read(
    lock: &LockKey,
    connection: &ConnSettings,
    ledger: &TableName,
) -> anyhow::Result<LockStatus> {
    let client = connect(connection)
        .await
        .with_context(|| format!("cannot connect to {connection}"))?;
    let mut status = query(&client, lock).await?;
    let holder_pid = status.holder.as_ref().map(|holder| holder.backend_pid);
    status.schedule = report::read(&client.client, ledger, lock, holder_pid)
        .await
        .map_err(anyhow::Error::from)
        .context("cannot read the ledger")?;
    Ok(status)
}

/// A connection for reading the status, named `pgleader-status:<pid>@<host>`.
pub async fn connect(connection: &ConnSettings) -> Result<PlainClient, ConnectError> {
    session::connect_plain(
        connection,
        &config::application_name(Some("pgleader-status")),
    )
    .await
}

/// Reads who holds and who waits for the lock on an open connection (not the ledger).
pub async fn query(client: &PlainClient, lock: &LockKey) -> anyhow::Result<LockStatus> {
    let major = client.server_major;
    let waitstart = if major >= 14 {
        "l.waitstart"
    } else {
        "NULL::timestamptz"
    };
    let sql = STATUS_SQL.replace("%WAITSTART%", waitstart);
    let rows = client
        .client
        .query_typed(
            &sql,
            &[(&lock.classid(), Type::OID), (&lock.objid(), Type::OID)],
        )
        .await
        .map_err(|err| anyhow::anyhow!(describe(&err)))
        .context("cannot read pg_locks")?;
    let mut holder = None;
    let mut waiting = Vec::new();
    for row in rows {
        let participant = Participant {
            backend_pid: row.get(0),
            granted: row.get(1),
            application_name: row.get(2),
            client_address: row.get(3),
            client_port: row.get(4),
            backend_start: row.get(5),
            waiting_since: row.get(6),
        };
        if participant.granted {
            holder = Some(Participant {
                waiting_since: None,
                ..participant
            });
        } else {
            waiting.push(participant);
        }
    }
    Ok(LockStatus {
        lock: lock.clone(),
        holder,
        waiting,
        schedule: None,
    })
}

impl Participant {
    /// The pid and host of the pgleader that owns this session, from its application name
    /// `<name>:<pid>@<host>`.
    pub fn pgleader_process(&self) -> Option<(u32, &str)> {
        let name = self.application_name.as_deref()?;
        let (_, rest) = name.rsplit_once(':')?;
        let (pid, host) = rest.split_once('@')?;
        Some((pid.parse().ok()?, host))
    }

    fn to_json(&self) -> Value {
        let process = self.pgleader_process();
        let fingerprints = self.application_name.as_deref().and_then(fingerprint_in);
        json!({
            "backend_pid": self.backend_pid,
            "application_name": self.application_name,
            "pgleader_pid": process.map(|(pid, _)| pid),
            "pgleader_host": process.map(|(_, host)| host),
            "schedule_fingerprint": fingerprints.map(|(schedule, _)| schedule),
            "ledger_fingerprint": fingerprints.and_then(|(_, ledger)| ledger),
            "client_address": self.client_address,
            "client_port": self.client_port,
            "backend_start": self.backend_start,
            "waiting_since": self.waiting_since,
        })
    }

    /// A short name for one line: `pgleader 4242@web-1 (backend 8581)`.
    pub fn short(&self) -> String {
        match (self.pgleader_process(), &self.application_name) {
            (Some((pid, host)), _) => {
                format!("pgleader {pid}@{host} (backend {})", self.backend_pid)
            }
            (None, Some(name)) if !name.is_empty() => {
                format!("backend {} ({name:?})", self.backend_pid)
            }
            _ => format!("backend {}", self.backend_pid),
        }
    }

    fn describe(&self) -> String {
        let mut line = format!("backend pid {}", self.backend_pid);
        if let Some((pid, host)) = self.pgleader_process() {
            let _ = write!(line, ", pgleader pid {pid} on {host}");
            if let Some((schedule, ledger)) =
                self.application_name.as_deref().and_then(fingerprint_in)
            {
                let _ = write!(line, ", schedule {schedule}");
                if let Some(ledger) = ledger {
                    let _ = write!(line, ", ledger {ledger}");
                }
            }
        } else if let Some(name) = &self.application_name
            && !name.is_empty()
        {
            let _ = write!(line, ", application {name:?}");
        }
        match (&self.client_address, self.client_port) {
            (Some(addr), Some(port)) if port > 0 => {
                let _ = write!(line, ", client {addr}:{port}");
            }
            (Some(addr), _) => {
                let _ = write!(line, ", client {addr}");
            }
            (None, Some(-1)) | (None, None) => line.push_str(", local socket"),
            _ => {}
        }
        if let Some(since) = &self.waiting_since {
            let _ = write!(line, ", waiting since {since}");
        } else if let Some(start) = &self.backend_start {
            let _ = write!(line, ", session started {start}");
        }
        line
    }
}

impl LockStatus {
    pub fn is_held(&self) -> bool {
        self.holder.is_some()
    }

    pub fn to_json(&self) -> Value {
        json!({
            "lock": {
                "key": self.lock.key(),
                "name": self.lock.name(),
                "classid": self.lock.classid(),
                "objid": self.lock.objid(),
            },
            "held": self.is_held(),
            "holder": self.holder.as_ref().map(Participant::to_json),
            "waiting": self.waiting.iter().map(Participant::to_json).collect::<Vec<_>>(),
            "schedule": self.schedule.as_ref().map(ScheduleReport::to_json),
        })
    }

    /// Who holds and who waits, in order: what `status --watch` compares. The holder's session
    /// start is part of it, so that a new session with a recycled backend pid counts as new.
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
        let mut line = format!("lock {}: ", self.lock);
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
            self.lock,
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
        if let Some(schedule) = &self.schedule {
            schedule.write_text(&mut text);
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_pgleader_pid_and_host_from_the_application_name() {
        let participant = Participant {
            backend_pid: 1,
            granted: true,
            application_name: Some("billing:job:4242@web-1.example".into()),
            client_address: None,
            client_port: None,
            backend_start: None,
            waiting_since: None,
        };
        assert_eq!(
            participant.pgleader_process(),
            Some((4242, "web-1.example"))
        );
    }
}
