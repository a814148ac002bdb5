//! What `pgleader status` and `status --watch` read on PostgreSQL: who holds and who waits for
//! the lock (`pg_locks` joined with `pg_stat_activity`), who holds which shard of it when it
//! runs sharded (`postgres/shards/status.rs`), and the ledger's history.
//!
//! Waiters are listed in the order they began waiting: by the start of the statement they wait
//! in (`query_start`). A follower queues again at every turn of that statement (see
//! `locks::wait_sql`), so the server grants a released lock in the order they last queued
//! (`pg_locks.waitstart`), which changes from turn to turn; the order they came in does not,
//! and `status --watch` prints a line only when something real changed.

use std::sync::LazyLock;

use jiff::Timestamp;
use tokio_postgres::types::Type;

use crate::election::ledger::{AskedEntry, Entry, JobEntry, LedgerError};
use crate::election::lock::LockKey;
use crate::election::participant::{LockView, Participant};
use crate::election::{ConnectError, Observer};
use crate::postgres::conninfo::ConnSettings;
use crate::postgres::describe::describe;
use crate::postgres::ledger::{self, TableName};
use crate::postgres::locks::{LOCK_ROWS, step_down_channel, this_lock};
use crate::postgres::session::{self, PlainClient};
use crate::postgres::shards;

/// A connection that only reads, for one lock and its ledger table.
#[derive(Debug)]
pub struct PgObserver {
    client: PlainClient,
    lock: LockKey,
    table: TableName,
}

impl PgObserver {
    /// Connects as `name` (`pgleader-status:<pid>@<host>`).
    pub async fn connect(
        settings: &ConnSettings,
        name: &str,
        lock: LockKey,
        table: TableName,
    ) -> Result<PgObserver, ConnectError> {
        let client = session::connect_plain(settings, name).await?;
        Ok(PgObserver {
            client,
            lock,
            table,
        })
    }
}

/// Who holds and waits: written once, read at every poll of `status --watch`.
static STATUS_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT l.pid, l.granted, a.application_name, host(a.client_addr), a.client_port,
                to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                to_char(a.query_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
           FROM {LOCK_ROWS}
           LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
          WHERE {}
          ORDER BY l.granted DESC, a.query_start, l.pid",
        this_lock("$1", "$2")
    )
});

impl Observer for PgObserver {
    async fn lock_view(&self) -> Result<LockView, String> {
        let client = &self.client.client;
        let plain = async {
            client
                .query_typed(
                    &STATUS_SQL,
                    &[
                        (&self.lock.classid(), Type::OID),
                        (&self.lock.objid(), Type::OID),
                    ],
                )
                .await
                .map_err(|err| format!("cannot read pg_locks: {}", describe(&err)))
        };
        // Both in one round trip: the connection pipelines them.
        let (rows, shards) = tokio::try_join!(plain, shards::view(client, &self.lock))?;
        let mut view = LockView {
            shards,
            ..LockView::default()
        };
        for row in rows {
            let participant = Participant {
                backend_pid: row.get(0),
                granted: row.get(1),
                application_name: row.get(2),
                client_address: row.get(3),
                client_port: row.get(4),
                backend_start: row.get(5),
                waiting_since: row.get(6),
                ..Participant::default()
            };
            if participant.granted {
                view.holder = Some(Participant {
                    waiting_since: None,
                    ..participant
                });
            } else {
                view.waiting.push(participant);
            }
        }
        Ok(view)
    }

    async fn history(&self, limit: i64) -> Result<Option<Vec<Entry>>, LedgerError> {
        ledger::read_recent(&self.client.client, &self.table, &self.lock, limit).await
    }

    async fn job_history(&self, job: &str, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        let key = self.lock.of_job(job);
        let rows = ledger::read_recent(&self.client.client, &self.table, &key, limit).await?;
        Ok(rows.unwrap_or_default())
    }

    async fn set_paused(
        &self,
        job: &str,
        detail: Option<&str>,
    ) -> Result<Option<bool>, LedgerError> {
        ledger::set_paused(&self.client.client, &self.table, &self.lock, job, detail)
            .await
            .map(Some)
    }

    async fn paused(&self) -> Result<Vec<(String, String)>, LedgerError> {
        ledger::read_paused(&self.client.client, &self.table, &self.lock).await
    }

    async fn ask_run(&self, job: &str, asked_by: &str) -> Result<Option<i64>, LedgerError> {
        let channel = shards::ShardKeys::of(&self.lock).channel();
        let client = &self.client.client;
        ledger::ask(client, &self.table, &self.lock, job, asked_by, &channel)
            .await
            .map(Some)
    }

    async fn asked_runs(
        &self,
        job: &str,
        id: Option<i64>,
        limit: i64,
    ) -> Result<Vec<AskedEntry>, LedgerError> {
        let client = &self.client.client;
        match id {
            Some(id) => Ok(ledger::read_asked(client, &self.table, &self.lock, job, id)
                .await?
                .into_iter()
                .collect()),
            None => ledger::read_asked_history(client, &self.table, &self.lock, job, limit).await,
        }
    }

    async fn server_time(&self) -> Result<Timestamp, LedgerError> {
        ledger::server_time(&self.client.client).await
    }

    async fn jobs(&self) -> Result<Option<Vec<JobEntry>>, LedgerError> {
        ledger::read_jobs(&self.client.client, &self.table, &self.lock).await
    }

    /// `pg_notify` does not say who listened: the requester watches the holder instead.
    async fn ask_step_down(&self, request: &str) -> Result<Option<u64>, String> {
        let channel = step_down_channel(&self.lock);
        self.client
            .client
            .query_typed(
                "SELECT pg_catalog.pg_notify($1, $2)",
                &[(&channel, Type::TEXT), (&request, Type::TEXT)],
            )
            .await
            .map_err(|err| format!("cannot send the request (pg_notify): {}", describe(&err)))?;
        Ok(None)
    }
}
