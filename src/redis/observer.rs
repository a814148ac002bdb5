//! What `pgleader status` reads on Redis: the lock's value (who leads), the live waiters in
//! the order they will be served, who holds which shard when the name runs sharded (see
//! `redis/shards/status.rs`), and the ledger's history. It changes nothing.

use std::time::Duration;

use jiff::Timestamp;

use crate::election::Observer;
use crate::election::ledger::{AskedEntry, Entry, JobEntry, LedgerError};
use crate::election::participant::{LockView, Participant};
use crate::redis::connection::Connection;
use crate::redis::ledger::{self, participant};
use crate::redis::scripts::{self, Keys};
use crate::redis::shards;

/// A connection that only looks.
#[derive(Debug)]
pub struct RedisObserver {
    pub(crate) connection: Connection,
    pub(crate) keys: Keys,
    /// How long a waiter counts as alive after it was last seen, where the ACL hides the
    /// liveness channels.
    pub(crate) stale: Duration,
}

/// The holder a lock's value names.
pub(crate) fn holder(value: &str) -> Participant {
    // The value carries the holder's card at its end: `client=<id> session=<name>`.
    let card = value.find(" client=").map_or(value, |at| &value[at + 1..]);
    let mut holder = participant(card, true);
    holder.backend_start = scripts::field(value, "since")
        .and_then(|since| since.split('.').next()?.parse::<i64>().ok())
        .and_then(|seconds| Timestamp::from_second(seconds).ok())
        .map(|at| crate::time::rfc3339_seconds(at.into()));
    holder
}

impl Observer for RedisObserver {
    async fn lock_view(&self) -> Result<LockView, String> {
        let mut conn = self.connection.conn.clone();
        let (value, waiting) = ledger::view(&mut conn, &self.keys, "", self.stale)
            .await
            .map_err(|err| err.to_string())?;
        let shards = shards::view(&mut conn, &self.keys.lock).await?;
        Ok(LockView {
            holder: value.as_deref().map(holder),
            waiting: waiting
                .iter()
                .map(|(_, card)| participant(card, false))
                .collect(),
            servers: Vec::new(),
            key_name: Some(self.keys.lock.clone()),
            shards,
        })
    }

    async fn history(&self, limit: i64) -> Result<Option<Vec<Entry>>, LedgerError> {
        let mut conn = self.connection.conn.clone();
        let entries = ledger::recent(&mut conn, &self.keys, limit).await?;
        Ok(if entries.is_empty() {
            None
        } else {
            Some(entries)
        })
    }

    async fn job_history(&self, job: &str, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        ledger::recent(
            &mut self.connection.conn.clone(),
            &self.keys.job(job),
            limit,
        )
        .await
    }

    async fn set_paused(
        &self,
        job: &str,
        detail: Option<&str>,
    ) -> Result<Option<bool>, LedgerError> {
        let mut conn = self.connection.conn.clone();
        let key = self.keys.paused();
        let changed: i64 = match (job, detail) {
            (_, Some(detail)) => {
                let value = serde_json::json!({ "detail": detail }).to_string();
                redis::cmd("HSET")
                    .arg(&key)
                    .arg(job)
                    .arg(value)
                    .query_async(&mut conn)
                    .await
            }
            ("*", None) => redis::cmd("DEL").arg(&key).query_async(&mut conn).await,
            (_, None) => {
                redis::cmd("HDEL")
                    .arg(&key)
                    .arg(job)
                    .query_async(&mut conn)
                    .await
            }
        }
        .map_err(|err| LedgerError::Query(format!("cannot change the pauses: {err}")))?;
        Ok(Some(changed > 0 || detail.is_some()))
    }

    async fn paused(&self) -> Result<Vec<(String, String)>, LedgerError> {
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.keys.paused())
            .query_async(&mut self.connection.conn.clone())
            .await
            .map_err(|err| LedgerError::Query(format!("cannot read the pauses: {err}")))?;
        Ok(all
            .into_iter()
            .map(|(job, value)| {
                let detail = serde_json::from_str::<serde_json::Value>(&value)
                    .ok()
                    .and_then(|v| v["detail"].as_str().map(str::to_owned))
                    .unwrap_or(value);
                (job, detail)
            })
            .collect())
    }

    async fn ask_run(&self, job: &str, asked_by: &str) -> Result<Option<i64>, LedgerError> {
        let channel = shards::ShardKeys {
            base: self.keys.lock.clone(),
        }
        .channel();
        let mut conn = self.connection.conn.clone();
        ledger::asked::ask(&mut conn, &self.keys.job(job), job, asked_by, &channel)
            .await
            .map(Some)
    }

    async fn asked_runs(
        &self,
        job: &str,
        id: Option<i64>,
        limit: i64,
    ) -> Result<Vec<AskedEntry>, LedgerError> {
        let mut conn = self.connection.conn.clone();
        let limit = if id.is_some() { 1 } else { limit };
        let found = ledger::asked::read(&mut conn, &self.keys.job(job), id, limit).await?;
        Ok(found
            .into_iter()
            .filter(|entry| id.is_none_or(|id| entry.id == id))
            .collect())
    }

    async fn server_time(&self) -> Result<Timestamp, LedgerError> {
        ledger::server_time(&mut self.connection.conn.clone()).await
    }

    async fn jobs(&self) -> Result<Option<Vec<JobEntry>>, LedgerError> {
        ledger::jobs(&mut self.connection.conn.clone(), &self.keys).await
    }

    /// PUBLISH answers how many subscribers heard it: only a leader subscribes.
    async fn ask_step_down(&self, request: &str) -> Result<Option<u64>, String> {
        let heard: u64 = redis::cmd("PUBLISH")
            .arg(self.keys.step_down())
            .arg(request)
            .query_async(&mut self.connection.conn.clone())
            .await
            .map_err(|err| format!("cannot send the request (PUBLISH): {err}"))?;
        Ok(Some(heard))
    }
}
