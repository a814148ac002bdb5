//! Redlock: one leader over a quorum of independent Redis servers, so that no single server is
//! a point of failure. Each server runs the same scripts as a single one (`redis/scripts.rs`); a
//! leadership holds only while a majority of them hold this session's value.
//!
//! The parts: a session over every server and its rounds (`session.rs`), a leader's way back
//! to a server it lost (`rejoin.rs`), what `status` reads (`observer.rs`), and the ledger of
//! scheduled runs, kept on every server and counted by majority (`ledger.rs`).

mod ledger;
mod observer;
mod rejoin;
mod session;

pub use ledger::QuorumLedger;
pub use observer::QuorumObserver;
pub use session::QuorumSession;

use std::time::Duration;

use tokio::task::JoinSet;

use crate::election::ConnectError;
use crate::election::lease::Lease;
use crate::election::lock::LockKey;
use crate::election::majority::Majority;
use crate::redis::connection::{self, Connection, Purpose};
use crate::redis::scripts::{self, Keys};
use crate::redis::url::RedisServer;

/// Several Redis servers, the lock, and the settings of pgleader's sessions.
#[derive(Clone, Debug)]
pub struct QuorumBackend {
    pub servers: Vec<RedisServer>,
    pub lock: LockKey,
    pub lease: Lease,
    /// How often a waiting follower tries again.
    pub poll: Duration,
    pub ledger_timeout: Duration,
    pub user_name: Option<String>,
}

impl QuorumBackend {
    /// A backend that only observes (`pgleader status`).
    pub fn for_status(servers: Vec<RedisServer>, lock: LockKey) -> QuorumBackend {
        QuorumBackend {
            servers,
            lock,
            lease: Lease::new(Duration::ZERO),
            poll: Duration::from_secs(1),
            ledger_timeout: Duration::ZERO,
            user_name: None,
        }
    }

    /// How many servers make a majority.
    pub fn quorum(&self) -> usize {
        Majority::of(self.servers.len()).need()
    }
}

impl std::fmt::Display for QuorumBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let servers: Vec<String> = self.servers.iter().map(ToString::to_string).collect();
        write!(f, "a quorum of {}", servers.join(", "))
    }
}

impl crate::election::Backend for QuorumBackend {
    type Session = QuorumSession;
    type Observer = QuorumObserver;

    async fn connect(&self, name: &str) -> Result<QuorumSession, ConnectError> {
        QuorumSession::connect(self, name).await
    }

    /// Every server's view; fails only if none can be reached.
    async fn observe(&self) -> Result<QuorumObserver, ConnectError> {
        let name = crate::election::participant::label(Some("pgleader-status"), None);
        let mut opening = JoinSet::new();
        for (index, server) in self.servers.iter().enumerate() {
            let (server, name) = (server.clone(), name.clone());
            opening.spawn(async move {
                let opened = connection::open(&server, &name, None, Purpose::Observe).await;
                (index, opened.map_err(|err| err.to_string()))
            });
        }
        let mut members: Vec<(String, Result<Connection, String>)> = self
            .servers
            .iter()
            .map(|server| (server.to_string(), Err("not asked".to_owned())))
            .collect();
        while let Some(joined) = opening.join_next().await {
            if let Ok((index, opened)) = joined {
                members[index].1 = opened;
            }
        }
        if members.iter().all(|(_, member)| member.is_err()) {
            let reasons: Vec<String> = members
                .iter()
                .filter_map(|(server, member)| {
                    Some(format!("{server}: {}", member.as_ref().err()?))
                })
                .collect();
            return Err(ConnectError::Transient(reasons.join("; ")));
        }
        Ok(QuorumObserver {
            members,
            keys: Keys::of(&self.lock),
            stale: scripts::stale(self.poll),
            quorum: self.quorum(),
        })
    }

    fn password_hint(&self, _reason: &str) -> String {
        String::new()
    }
}
