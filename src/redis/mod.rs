//! Redis, the second backend behind the election's boundary (`election/`): the lock is a key
//! set only if absent, with the lease as its TTL and a value unique to the leadership; the
//! fencing token comes from the server; followers block on a wake list; and the ledger lives in
//! the lock's own key space.
//!
//! Redis gives no lock bound to a connection: a key lives until it is deleted or expires,
//! whoever dies. So pgleader binds it itself: each session subscribes to a channel of its own,
//! and a follower takes over a held key as soon as its holder's channel has no subscriber
//! (its connection is gone), long before the TTL; the leader renews only its own key
//! (compare, then extend), never re-creating one that vanished; and client-side tracking
//! tells the leader at once when anyone else changes its key.
//!
//! The parts: the URL ([`url`]), one connection with its checks and TLS ([`connection`]),
//! the keys and scripts ([`scripts`]), a session ([`session`]), the ledger ([`ledger`]),
//! what `status` reads ([`observer`]) and the shards of `--shards K` ([`shards`]); and the
//! Redlock quorum over several servers, with its own ledger ([`quorum`]).

pub mod connection;
pub mod ledger;
pub mod observer;
pub mod quorum;
pub mod scripts;
pub mod session;
pub mod shards;
pub mod url;

use std::fmt;
use std::time::Duration;

use crate::election::lease::Lease;
use crate::election::lock::LockKey;
use crate::election::participant;
use crate::election::{Backend, ConnectError};
use connection::Purpose;
use observer::RedisObserver;
use session::RedisSession;
use url::RedisServer;

/// A Redis server, the lock and the settings of pgleader's sessions.
#[derive(Clone, Debug)]
pub struct RedisBackend {
    pub server: RedisServer,
    pub lock: LockKey,
    pub lease: Lease,
    /// How often a waiting follower tries again (`--check-interval`): how soon a holder whose
    /// connection is gone is replaced.
    pub poll: Duration,
    /// Bounds each of a leader's ledger scripts.
    pub ledger_timeout: Duration,
    /// What the session's name starts with ("pgleader" when `None`).
    pub user_name: Option<String>,
}

impl RedisBackend {
    /// A backend that only observes (`pgleader status`).
    pub fn for_status(server: RedisServer, lock: LockKey) -> RedisBackend {
        RedisBackend {
            server,
            lock,
            lease: Lease::new(Duration::ZERO),
            poll: Duration::from_secs(1),
            ledger_timeout: Duration::ZERO,
            user_name: None,
        }
    }
}

impl fmt::Display for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.server.fmt(f)
    }
}

impl Backend for RedisBackend {
    type Session = RedisSession;
    type Observer = RedisObserver;

    /// A plain replica's session is refused beside sharded replicas of the same name, which
    /// would run the command too (one script, as PostgreSQL's one statement).
    async fn connect(&self, name: &str) -> Result<RedisSession, ConnectError> {
        let session = RedisSession::connect(self, name).await?;
        let budget = self.server.connect_timeout;
        tokio::time::timeout(
            budget,
            shards::refuse_beside_shards(&mut session.conn(), &self.lock),
        )
        .await
        .map_err(|_| {
            ConnectError::Transient(format!(
                "no answer within {}",
                humantime::format_duration(budget)
            ))
        })??;
        Ok(session)
    }

    async fn observe(&self) -> Result<RedisObserver, ConnectError> {
        let name = participant::label(Some("pgleader-status"), None);
        let connection = connection::open(&self.server, &name, None, Purpose::Observe).await?;
        Ok(RedisObserver {
            connection,
            keys: scripts::Keys::of(&self.lock),
            stale: scripts::stale(self.poll),
        })
    }

    /// The connection's own errors already say where the password came from.
    fn password_hint(&self, _reason: &str) -> String {
        String::new()
    }
}
