//! PostgreSQL, the first backend behind the election's boundary (`election/`): the lock is a
//! session-level advisory lock, the fencing token a transaction id, the lease the server's own
//! keepalives and `idle_session_timeout` on pgleader's session, and the ledger a table.
//!
//! What only PostgreSQL needs lives here: connection settings read the way libpq reads them
//! ([`conninfo`], `.pgpass` included), connecting over a socket pgleader opens itself, so that
//! a leader's keeper can hold it ([`connect`]), TLS through rustls ([`tls`]), the session and
//! its set-up, standby and pooler checks ([`session`]), the oldest supported server
//! ([`version`]), the lock's statements and how they name it in `pg_locks` ([`locks`]), the
//! ledger table ([`ledger`]), what `status` reads ([`observer`]) and a sharded lock's sessions
//! ([`shards`]).

pub mod bundle;
pub mod connect;
pub mod conninfo;
pub mod describe;
pub mod ledger;
pub mod locks;
pub mod observer;
pub mod session;
pub mod shards;
pub mod tls;
pub mod version;

use std::fmt;
use std::time::Duration;

use crate::election::lease::Lease;
use crate::election::lock::LockKey;
use crate::election::participant;
use crate::election::{Backend, ConnectError};
use conninfo::ConnSettings;
use ledger::LedgerSettings;
use ledger::TableName;
use observer::PgObserver;
use session::PgSession;

/// A PostgreSQL server (or several, for a failover-aware URL), the lock and the settings of
/// pgleader's sessions.
#[derive(Clone, Debug)]
pub struct PgBackend {
    pub settings: ConnSettings,
    pub lock: LockKey,
    pub lease: Lease,
    pub ledger: LedgerSettings,
    /// How often a waiting follower queues again with a new snapshot, so that it holds back
    /// VACUUM no longer than this (`--wait-refresh`; zero: never).
    pub wait_refresh: Duration,
}

impl PgBackend {
    /// `ledger_statement_timeout` bounds each of a leader's ledger statements (see
    /// [`LedgerSettings`]).
    pub fn new(
        settings: ConnSettings,
        lock: LockKey,
        lease: Lease,
        table: TableName,
        ledger_statement_timeout: Duration,
        wait_refresh: Duration,
    ) -> PgBackend {
        let user_name = settings.application_name.clone();
        PgBackend {
            settings,
            lock,
            lease,
            ledger: LedgerSettings {
                table,
                user_name,
                statement_timeout: ledger_statement_timeout,
                keeps_output: Default::default(),
                asks: Default::default(),
                texts: Default::default(),
            },
            wait_refresh,
        }
    }
}

impl PgBackend {
    /// A backend that only observes (`pgleader status`): it opens no election session, so its
    /// lease, statement bound and wait refresh are never used.
    pub fn for_status(settings: ConnSettings, lock: LockKey, table: TableName) -> PgBackend {
        PgBackend::new(
            settings,
            lock,
            Lease::new(Duration::ZERO),
            table,
            Duration::ZERO,
            Duration::ZERO,
        )
    }
}

impl PgBackend {
    /// A session of the election, plain or sharded, set up and checked (see
    /// `PgSession::connect`).
    pub(crate) async fn session(&self, name: &str) -> Result<PgSession, ConnectError> {
        PgSession::connect(self, name).await
    }
}

impl fmt::Display for PgBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.settings.fmt(f)
    }
}

impl Backend for PgBackend {
    type Session = PgSession;
    type Observer = PgObserver;

    /// A plain replica's session, refused where sharded replicas run the same lock (see
    /// `shards::sharded_replica`).
    async fn connect(&self, name: &str) -> Result<PgSession, ConnectError> {
        let session = self.session(name).await?;
        match session.sharded_replica_beside() {
            Some(pid) => Err(shards::refusal(pid, &self.lock)),
            None => Ok(session),
        }
    }

    async fn observe(&self) -> Result<PgObserver, ConnectError> {
        let name = participant::label(Some("pgleader-status"), None);
        PgObserver::connect(
            &self.settings,
            &name,
            self.lock.clone(),
            self.ledger.table.clone(),
        )
        .await
    }

    fn password_hint(&self, reason: &str) -> String {
        if !reason.contains("password") {
            return String::new();
        }
        match &self.settings.password_source {
            Some(source) => format!(" (the password came from {source})"),
            None => {
                " (no password was given: set one in ~/.pgpass, PGPASSWORD or the URL)".to_owned()
            }
        }
    }
}
