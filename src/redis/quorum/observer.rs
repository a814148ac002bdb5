//! What `status` reads from a quorum: each server's view, the holder a majority shows, and the
//! history a majority tells.

use std::time::Duration;

use tokio::task::JoinSet;

use super::ledger;
use crate::redis::connection::Connection;
use crate::redis::scripts::{self, Keys};

/// What `status` reads from a quorum: each server's view, and the holder a majority shows.
#[derive(Debug)]
pub struct QuorumObserver {
    /// Each server, as logs name it, and its connection or why there is none.
    pub(super) members: Vec<(String, Result<Connection, String>)>,
    pub(super) keys: Keys,
    pub(super) stale: Duration,
    pub(super) quorum: usize,
}

impl crate::election::Observer for QuorumObserver {
    async fn lock_view(&self) -> Result<crate::election::participant::LockView, String> {
        let mut views = JoinSet::new();
        for (index, (_, member)) in self.members.iter().enumerate() {
            let Ok(connection) = member else { continue };
            let (mut conn, keys, stale) = (connection.conn.clone(), self.keys.clone(), self.stale);
            views.spawn(async move {
                let view = crate::redis::ledger::view(&mut conn, &keys, "", stale);
                let answer = tokio::time::timeout(Duration::from_secs(5), view).await;
                (index, answer)
            });
        }
        let mut seen: Vec<Result<Option<String>, String>> = self
            .members
            .iter()
            .map(|(_, member)| member.as_ref().map(|_| None).map_err(Clone::clone))
            .collect();
        while let Some(joined) = views.join_next().await {
            let Ok((index, answer)) = joined else {
                continue;
            };
            seen[index] = match answer {
                Ok(Ok((value, _))) => Ok(value),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err("no answer within 5s".into()),
            };
        }
        if seen.iter().all(Result::is_err) {
            return Err("no server of the quorum could be asked".into());
        }
        let nonces: Vec<&str> = seen
            .iter()
            .filter_map(|value| scripts::holder_nonce(value.as_ref().ok()?.as_deref()?))
            .collect();
        let majority = nonces
            .iter()
            .find(|nonce| nonces.iter().filter(|other| other == nonce).count() >= self.quorum);
        let holder = majority.and_then(|nonce| {
            seen.iter()
                .filter_map(|value| value.as_ref().ok()?.as_deref())
                .find(|value| scripts::holder_nonce(value) == Some(*nonce))
                .map(crate::redis::observer::holder)
        });
        Ok(crate::election::participant::LockView {
            holder,
            waiting: Vec::new(),
            key_name: Some(self.keys.lock.clone()),
            shards: None,
            servers: self
                .members
                .iter()
                .zip(seen)
                .map(
                    |((server, _), value)| crate::election::participant::ServerView {
                        server: server.clone(),
                        holder: value
                            .map(|value| value.as_deref().map(crate::redis::observer::holder)),
                    },
                )
                .collect(),
        })
    }

    /// The history a majority of the servers tells (see `ledger::merge`).
    async fn history(
        &self,
        limit: i64,
    ) -> Result<Option<Vec<crate::election::ledger::Entry>>, crate::election::ledger::LedgerError>
    {
        let mut reads = JoinSet::new();
        for (_, member) in &self.members {
            let Ok(connection) = member else { continue };
            let (mut conn, keys) = (connection.conn.clone(), self.keys.clone());
            reads.spawn(async move {
                let read = crate::redis::ledger::recent(&mut conn, &keys, limit);
                tokio::time::timeout(Duration::from_secs(5), read)
                    .await
                    .ok()?
                    .ok()
            });
        }
        let mut histories = Vec::new();
        while let Some(joined) = reads.join_next().await {
            if let Ok(Some(history)) = joined {
                histories.push(history);
            }
        }
        if histories.len() < self.quorum {
            return Err(crate::election::ledger::LedgerError::Query(format!(
                "only {} of {} servers could tell the history, fewer than a majority",
                histories.len(),
                self.members.len()
            )));
        }
        Ok(Some(ledger::merge(histories, limit)))
    }

    async fn server_time(&self) -> Result<jiff::Timestamp, crate::election::ledger::LedgerError> {
        let first = self
            .members
            .iter()
            .find_map(|(_, member)| member.as_ref().ok());
        match first {
            Some(connection) => {
                crate::redis::ledger::server_time(&mut connection.conn.clone()).await
            }
            None => Err(crate::election::ledger::LedgerError::Query(
                "no server of the quorum is reachable".into(),
            )),
        }
    }

    async fn ask_step_down(&self, _request: &str) -> Result<Option<u64>, String> {
        Err("a Redlock quorum's leader does not listen for step-down requests".into())
    }
}
