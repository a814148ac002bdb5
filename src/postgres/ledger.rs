//! The ledger: one row per occurrence of a scheduled lock, in a table of the same database.
//!
//! It is what makes "at most once per occurrence" hold across replicas, timers, restarts and
//! failovers: before the command starts, the leader inserts the occurrence's row on its own
//! session, the one that holds the lock, so the lock orders every write and the primary key
//! `(lock_key, scheduled_for)` refuses a second claim. A claim also refuses to be early on the
//! server's clock and refuses any occurrence at or before one already recorded, so a server
//! clock that steps back, or pruning, cannot bring an old occurrence back.
//!
//! Rows record how each occurrence ended: `running`, `succeeded`, `failed` (with the exit
//! status), `interrupted` (its leader lost the lock, or was shut down, while it ran), `skipped`
//! (it came while the previous run was still going) and `missed` (no leader could run it
//! within `--catch-up`). Only the newest [`KEEP`] rows of each lock are kept.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use thiserror::Error;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::election::lock::LockKey;
use crate::postgres::session::describe;
use crate::schedule::calendar::Schedule;

/// How many rows of each lock the ledger keeps.
pub const KEEP: i64 = 100;

/// The default table name.
pub const DEFAULT_TABLE: &str = "pgleader_ledger";

/// The table's definition; README.md gives the same text.
pub const DDL: &str = "CREATE TABLE {table} (
    lock_key      bigint      NOT NULL,
    scheduled_for timestamptz NOT NULL,
    lock_name     text,
    schedule      text        NOT NULL,
    timezone      text        NOT NULL,
    outcome       text        NOT NULL CHECK (outcome IN
                  ('running', 'succeeded', 'failed', 'interrupted', 'skipped', 'missed')),
    exit_code     integer,
    detail        text,
    attempt       integer     NOT NULL DEFAULT 1,
    claimed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at      timestamptz,
    host          text,
    pid           integer,
    backend_pid   integer,
    epoch         bigint,
    PRIMARY KEY (lock_key, scheduled_for)
)";

/// A ledger failure, sorted by what the leader does about it.
#[derive(Debug, Error)]
pub enum LedgerError {
    /// Retrying cannot help: no permission, no table, a table of another shape. pgleader exits.
    #[error("{0}")]
    Fatal(String),
    /// The statement waited too long (a lock held on the table, `statement_timeout`) or lost a
    /// serialization race, and was rolled back: try again a little later, still leading.
    #[error("{0}")]
    Busy(String),
    /// The session itself is in trouble: leadership is in doubt.
    #[error("{0}")]
    Query(String),
}

/// A validated table name: `name` or `schema.name`, plain SQL identifiers, folded to lower
/// case as the server folds unquoted names, and quoted in every statement, so that a name
/// that happens to be a keyword (`user`, `order`) works too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableName {
    /// As given, folded: `ops.pgleader_ledger`.
    text: String,
    /// For statements: `"ops"."pgleader_ledger"`.
    sql: String,
}

impl TableName {
    pub fn parse(text: &str) -> Result<TableName, String> {
        let text = text.trim();
        let parts: Vec<&str> = text.split('.').collect();
        let valid = |part: &str| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
                && part.len() <= 63
        };
        if parts.len() > 2 || !parts.iter().all(|part| valid(part)) {
            return Err(format!(
                "{text:?} is not a table name (expected a name such as pgleader_ledger or ops.pgleader_ledger: letters, digits and underscores)"
            ));
        }
        let text = text.to_ascii_lowercase();
        let sql = text
            .split('.')
            .map(|part| format!("\"{part}\""))
            .collect::<Vec<_>>()
            .join(".");
        Ok(TableName { text, sql })
    }

    /// The name as given (folded to lower case), for messages.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The quoted name, for statements and for `to_regclass`.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The statement that creates it, for error messages and README.
    pub fn ddl(&self) -> String {
        DDL.replace("{table}", &self.sql)
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName::parse(DEFAULT_TABLE).expect("the default table name is valid")
    }
}

/// Eight hex digits that identify a ledger table (by its schema-qualified name), announced
/// in `application_name` beside the schedule's, so that replicas that would record one lock's
/// runs in two different tables notice each other.
pub fn table_fingerprint(qualified: &str) -> String {
    let key = LockKey::from_name(&format!("ledger {qualified}")).key();
    format!("{:08x}", (key as u64) as u32)
}

/// Who claims: this pgleader.
#[derive(Clone, Debug)]
pub struct Claimant {
    pub host: String,
    pub pid: i32,
    pub epoch: i64,
}

/// A row of the ledger, newest first when read.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub scheduled_for: DateTime<Utc>,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub attempt: i32,
    pub claimed_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub backend_pid: Option<i32>,
    pub epoch: Option<i64>,
    pub detail: Option<String>,
    pub schedule: String,
    pub timezone: String,
}

/// How a run ended, kept by a leader whose session ended before it could record it.
#[derive(Clone, Debug, PartialEq)]
pub struct LateFinish {
    pub at: DateTime<Utc>,
    pub epoch: i64,
    pub attempt: i32,
    pub outcome: &'static str,
    pub exit_code: Option<i32>,
    pub ended_at: DateTime<Utc>,
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq)]
pub enum Claim {
    /// The occurrence is ours to run; `attempt` is 1, or more for a retried interrupted run.
    Claimed { attempt: i32 },
    /// Already claimed (by anyone, this replica included): its outcome so far.
    Taken { outcome: String },
    /// A later occurrence is already recorded: this one will never run.
    Superseded,
    /// The server's clock has not reached the occurrence yet; it says `server_now`.
    Early { server_now: DateTime<Utc> },
}

/// The ledger of one lock, with the statements prepared as text for its table.
#[derive(Clone, Debug)]
pub struct Ledger {
    inner: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    table: TableName,
    lock: LockKey,
    schedule: Schedule,
    claim: String,
    finish: String,
    record: String,
    interrupt_stale: String,
    recent: String,
    exists: String,
    late_finish: String,
    unclaim: String,
}

impl Ledger {
    pub fn new(table: TableName, lock: LockKey, schedule: Schedule) -> Ledger {
        let t = table.sql();
        let claim = format!(
            "WITH now AS (SELECT pg_catalog.clock_timestamp() AS t),
             existing AS (SELECT outcome FROM {t} WHERE lock_key = $1 AND scheduled_for = $3),
             newer AS (SELECT FROM {t} WHERE lock_key = $1 AND scheduled_for > $3),
             claimed AS (
               INSERT INTO {t} AS l (lock_key, scheduled_for, lock_name, schedule, timezone, outcome,
                                     attempt, claimed_at, host, pid, backend_pid, epoch)
               SELECT $1, $3, $2, $4, $5, 'running', 1, now.t, $6, $7, pg_catalog.pg_backend_pid(), $8
                 FROM now WHERE now.t >= $3 AND NOT EXISTS (SELECT FROM newer)
               ON CONFLICT (lock_key, scheduled_for) DO UPDATE
                  SET outcome = 'running', attempt = l.attempt + 1, claimed_at = EXCLUDED.claimed_at,
                      ended_at = NULL, exit_code = NULL, detail = NULL, host = EXCLUDED.host,
                      pid = EXCLUDED.pid, backend_pid = EXCLUDED.backend_pid, epoch = EXCLUDED.epoch
                WHERE l.outcome = 'interrupted' AND l.attempt <= $9
               RETURNING attempt)
             SELECT (SELECT attempt FROM claimed), (SELECT outcome FROM existing),
                    EXISTS (SELECT FROM newer), (SELECT t FROM now)"
        );
        let finish = format!(
            "WITH done AS (
               UPDATE {t} SET outcome = $4, exit_code = $5, detail = $6,
                              ended_at = pg_catalog.clock_timestamp()
                WHERE lock_key = $1 AND scheduled_for = $2 AND epoch = $3 AND outcome = 'running'
               RETURNING 1),
             pruned AS (
               DELETE FROM {t} WHERE lock_key = $1 AND scheduled_for <
                 (SELECT scheduled_for FROM {t} WHERE lock_key = $1
                   ORDER BY scheduled_for DESC OFFSET {offset} LIMIT 1)
               RETURNING 1)
             SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM pruned)",
            offset = KEEP - 1
        );
        let record = format!(
            "INSERT INTO {t} (lock_key, scheduled_for, lock_name, schedule, timezone, outcome, detail,
                              claimed_at, ended_at, host, pid, backend_pid, epoch)
             SELECT $1, $3, $2, $4, $5, $6, $7, pg_catalog.clock_timestamp(),
                    pg_catalog.clock_timestamp(), $8, $9, pg_catalog.pg_backend_pid(), $10
              WHERE NOT EXISTS (SELECT FROM {t} WHERE lock_key = $1 AND scheduled_for >= $3)
             RETURNING 1"
        );
        let interrupt_stale = format!(
            "UPDATE {t} SET outcome = 'interrupted', ended_at = pg_catalog.clock_timestamp(),
                            detail = COALESCE(detail, 'its leader lost the lock while it ran')
              WHERE lock_key = $1 AND outcome = 'running'
             RETURNING scheduled_for, host, pid"
        );
        let recent = recent_sql(&table);
        // A leader whose session ended before it could record how its run ended records it on
        // its next session, unless the next leader has started the occurrence again since.
        let late_finish = format!(
            "UPDATE {t} SET outcome = $4, exit_code = $5, ended_at = $6,
                            detail = 'recorded on the leader''s next session: its session ended first'
              WHERE lock_key = $1 AND scheduled_for = $2 AND epoch = $3 AND attempt = $7
                AND outcome IN ('running', 'interrupted')"
        );
        // A claim whose command never started: as if it had not been made.
        let unclaim = format!(
            "WITH gone AS (DELETE FROM {t} WHERE lock_key = $1 AND scheduled_for = $2 AND epoch = $3
                                            AND outcome = 'running' AND attempt = 1 RETURNING 1)
             UPDATE {t} SET outcome = 'interrupted', attempt = attempt - 1
              WHERE lock_key = $1 AND scheduled_for = $2 AND epoch = $3 AND outcome = 'running'
                AND attempt > 1"
        );
        let exists =
            format!("SELECT EXISTS (SELECT FROM {t} WHERE lock_key = $1 AND scheduled_for = $2)");
        Ledger {
            inner: Arc::new(Statements {
                table,
                lock,
                schedule,
                claim,
                finish,
                record,
                interrupt_stale,
                recent,
                exists,
                late_finish,
                unclaim,
            }),
        }
    }

    pub fn table(&self) -> &TableName {
        &self.inner.table
    }

    pub fn schedule(&self) -> &Schedule {
        &self.inner.schedule
    }

    /// Makes sure the table exists and that this role may use it: creates it when missing,
    /// and says what to run when it cannot. Returns its schema-qualified name.
    pub async fn prepare(&self, client: &Client) -> Result<String, LedgerError> {
        let table = &self.inner.table;
        if resolve(client, table).await?.is_none() {
            let ddl = table
                .ddl()
                .replacen("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1);
            if let Err(err) = client.batch_execute(&ddl).await {
                // Another replica may have created it at the same moment.
                if resolve(client, table).await?.is_none() {
                    return Err(self.explain(&err, "cannot create the ledger table"));
                }
            }
        }
        let privileges = client
            .query_typed_one(
                "SELECT pg_catalog.has_table_privilege($1, 'SELECT') \
                    AND pg_catalog.has_table_privilege($1, 'INSERT') \
                    AND pg_catalog.has_table_privilege($1, 'UPDATE') \
                    AND pg_catalog.has_table_privilege($1, 'DELETE')",
                &[(&table.sql(), Type::TEXT)],
            )
            .await
            .map_err(query_error)?;
        if !privileges.get::<_, bool>(0) {
            let name = table.as_str();
            return Err(LedgerError::Fatal(format!(
                "this role may not use the ledger table {name}: it needs SELECT, INSERT, UPDATE \
                 and DELETE on it (GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO <role>)",
                table.sql()
            )));
        }
        // A table of another shape fails here, not at the first claim.
        let one = 1_i64;
        client
            .query_typed(
                &self.inner.recent,
                &[(&self.inner.lock.key(), Type::INT8), (&one, Type::INT8)],
            )
            .await
            .map_err(|err| self.explain(&err, "the ledger table cannot be read"))?;
        resolve(client, table).await?.ok_or_else(|| {
            LedgerError::Query(format!("the ledger table {} vanished", table.as_str()))
        })
    }

    /// Marks the runs its previous leaders left `running` as interrupted: whoever holds the
    /// lock is the only one who can be running anything. Returns them.
    pub async fn interrupt_stale(
        &self,
        client: &Client,
    ) -> Result<Vec<(DateTime<Utc>, Option<String>, Option<i32>)>, LedgerError> {
        let rows = client
            .query_typed(
                &self.inner.interrupt_stale,
                &[(&self.inner.lock.key(), Type::INT8)],
            )
            .await
            .map_err(|err| self.classify(err))?;
        Ok(rows
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect())
    }

    /// The newest row of this lock, whatever its definition.
    pub async fn newest(&self, client: &Client) -> Result<Option<Entry>, LedgerError> {
        Ok(self.recent(client, 1).await?.into_iter().next())
    }

    /// The newest `limit` rows of this lock.
    pub async fn recent(&self, client: &Client, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        let rows = client
            .query_typed(
                &self.inner.recent,
                &[(&self.inner.lock.key(), Type::INT8), (&limit, Type::INT8)],
            )
            .await
            .map_err(|err| self.classify(err))?;
        Ok(rows.iter().map(entry).collect())
    }

    /// Whether a row exists for this occurrence.
    pub async fn has(&self, client: &Client, at: DateTime<Utc>) -> Result<bool, LedgerError> {
        Ok(client
            .query_typed_one(
                &self.inner.exists,
                &[
                    (&self.inner.lock.key(), Type::INT8),
                    (&at, Type::TIMESTAMPTZ),
                ],
            )
            .await
            .map_err(|err| self.classify(err))?
            .get(0))
    }

    /// Claims an occurrence for this leader, or says why not. `retries` is how many times an
    /// interrupted run may be started again.
    pub async fn claim(
        &self,
        client: &Client,
        at: DateTime<Utc>,
        claimant: &Claimant,
        retries: i32,
    ) -> Result<Claim, LedgerError> {
        let s = &self.inner;
        let (key, name) = (s.lock.key(), s.lock.name());
        let (expression, timezone) = (s.schedule.expression(), s.schedule.timezone());
        let params: [(&(dyn ToSql + Sync), Type); 9] = [
            (&key, Type::INT8),
            (&name, Type::TEXT),
            (&at, Type::TIMESTAMPTZ),
            (&expression, Type::TEXT),
            (&timezone, Type::TEXT),
            (&claimant.host, Type::TEXT),
            (&claimant.pid, Type::INT4),
            (&claimant.epoch, Type::INT8),
            (&retries, Type::INT4),
        ];
        let row = client
            .query_typed_one(&s.claim, &params)
            .await
            .map_err(|err| self.classify(err))?;
        let attempt: Option<i32> = row.get(0);
        let existing: Option<String> = row.get(1);
        let newer: bool = row.get(2);
        let server_now: DateTime<Utc> = row.get(3);
        Ok(match (attempt, existing) {
            (Some(attempt), _) => Claim::Claimed { attempt },
            (None, _) if newer => Claim::Superseded,
            (None, Some(outcome)) => Claim::Taken { outcome },
            (None, None) => Claim::Early { server_now },
        })
    }

    /// Records how a claimed run ended, and prunes old rows. False if the row was no longer
    /// this leader's to update.
    pub async fn finish(
        &self,
        client: &Client,
        finish: &LateFinish,
        detail: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let key = self.inner.lock.key();
        let params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&key, Type::INT8),
            (&finish.at, Type::TIMESTAMPTZ),
            (&finish.epoch, Type::INT8),
            (&finish.outcome, Type::TEXT),
            (&finish.exit_code, Type::INT4),
            (&detail, Type::TEXT),
        ];
        let row = client
            .query_typed_one(&self.inner.finish, &params)
            .await
            .map_err(|err| self.classify(err))?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    /// Records, on a later session, how a run ended whose leader lost its session before it
    /// could. False if the row had moved on (retried by another leader).
    pub async fn finish_late(
        &self,
        client: &Client,
        late: &LateFinish,
    ) -> Result<bool, LedgerError> {
        let key = self.inner.lock.key();
        let params: [(&(dyn ToSql + Sync), Type); 7] = [
            (&key, Type::INT8),
            (&late.at, Type::TIMESTAMPTZ),
            (&late.epoch, Type::INT8),
            (&late.outcome, Type::TEXT),
            (&late.exit_code, Type::INT4),
            (&late.ended_at, Type::TIMESTAMPTZ),
            (&late.attempt, Type::INT4),
        ];
        let updated = client
            .execute_typed(&self.inner.late_finish, &params)
            .await
            .map_err(|err| self.classify(err))?;
        Ok(updated > 0)
    }

    /// Takes back a claim whose command never started (the leadership ended, or pgleader was
    /// shut down, between the claim and the start), so that the next leader may still run it.
    pub async fn unclaim(
        &self,
        client: &Client,
        at: DateTime<Utc>,
        epoch: i64,
    ) -> Result<(), LedgerError> {
        let key = self.inner.lock.key();
        client
            .execute_typed(
                &self.inner.unclaim,
                &[
                    (&key, Type::INT8),
                    (&at, Type::TIMESTAMPTZ),
                    (&epoch, Type::INT8),
                ],
            )
            .await
            .map_err(|err| self.classify(err))?;
        Ok(())
    }

    /// Records an occurrence that did not run (`skipped`, `missed`), unless it or a later one
    /// is already recorded. True if recorded.
    pub async fn record(
        &self,
        client: &Client,
        at: DateTime<Utc>,
        outcome: &str,
        detail: &str,
        claimant: &Claimant,
    ) -> Result<bool, LedgerError> {
        let s = &self.inner;
        let (key, name) = (s.lock.key(), s.lock.name());
        let (expression, timezone) = (s.schedule.expression(), s.schedule.timezone());
        let params: [(&(dyn ToSql + Sync), Type); 10] = [
            (&key, Type::INT8),
            (&name, Type::TEXT),
            (&at, Type::TIMESTAMPTZ),
            (&expression, Type::TEXT),
            (&timezone, Type::TEXT),
            (&outcome, Type::TEXT),
            (&detail, Type::TEXT),
            (&claimant.host, Type::TEXT),
            (&claimant.pid, Type::INT4),
            (&claimant.epoch, Type::INT8),
        ];
        let rows = client
            .query_typed(&s.record, &params)
            .await
            .map_err(|err| self.classify(err))?;
        Ok(!rows.is_empty())
    }

    fn classify(&self, err: tokio_postgres::Error) -> LedgerError {
        let Some(code) = err.code() else {
            return query_error(err);
        };
        let busy = [
            SqlState::QUERY_CANCELED,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
        ];
        let fatal = [
            SqlState::INSUFFICIENT_PRIVILEGE,
            SqlState::UNDEFINED_TABLE,
            SqlState::UNDEFINED_COLUMN,
            SqlState::DATATYPE_MISMATCH,
            SqlState::WRONG_OBJECT_TYPE,
        ];
        if busy.contains(code) {
            LedgerError::Busy(describe(&err))
        } else if fatal.contains(code) || code.code().starts_with("23") {
            self.explain(&err, "the ledger table cannot be used")
        } else {
            query_error(err)
        }
    }

    /// A fatal error that says what to do: the DDL for a missing table, the grants for a
    /// missing permission.
    fn explain(&self, err: &tokio_postgres::Error, what: &str) -> LedgerError {
        let table = self.inner.table.as_str();
        let quoted = self.inner.table.sql();
        let hint = match err.code() {
            Some(code) if *code == SqlState::INSUFFICIENT_PRIVILEGE => format!(
                "; have an administrator create it with:\n{};\nGRANT SELECT, INSERT, UPDATE, DELETE ON {quoted} TO <role>;",
                self.inner.table.ddl()
            ),
            Some(code) if *code == SqlState::UNDEFINED_TABLE => {
                format!("; create it with:\n{};", self.inner.table.ddl())
            }
            _ => format!(
                " (is {table} a pgleader ledger? README.md gives its definition; --ledger-table names another table)"
            ),
        };
        LedgerError::Fatal(format!("{what} {table}: {}{hint}", describe(err)))
    }
}

/// The table's schema-qualified name, `None` when it does not exist (as the session's
/// `search_path` resolves it).
pub async fn resolve(client: &Client, table: &TableName) -> Result<Option<String>, LedgerError> {
    Ok(client
        .query_typed_one(
            "SELECT (SELECT n.nspname || '.' || c.relname FROM pg_catalog.pg_class c \
                       JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                      WHERE c.oid = pg_catalog.to_regclass($1))",
            &[(&table.sql(), Type::TEXT)],
        )
        .await
        .map_err(query_error)?
        .get(0))
}

fn recent_sql(table: &TableName) -> String {
    format!(
        "SELECT scheduled_for, outcome, exit_code, attempt, claimed_at, ended_at, host, pid, \
                backend_pid, epoch, detail, schedule, timezone \
           FROM {} WHERE lock_key = $1 ORDER BY scheduled_for DESC LIMIT $2",
        table.sql()
    )
}

/// The newest `limit` rows of a lock, for `pgleader status`, which knows no schedule; `None`
/// when the table does not exist.
pub async fn read_recent(
    client: &Client,
    table: &TableName,
    lock: &LockKey,
    limit: i64,
) -> Result<Option<Vec<Entry>>, LedgerError> {
    if resolve(client, table).await?.is_none() {
        return Ok(None);
    }
    let rows = client
        .query_typed(
            &recent_sql(table),
            &[(&lock.key(), Type::INT8), (&limit, Type::INT8)],
        )
        .await
        .map_err(query_error)?;
    Ok(Some(rows.iter().map(entry).collect()))
}

fn entry(row: &tokio_postgres::Row) -> Entry {
    Entry {
        scheduled_for: row.get(0),
        outcome: row.get(1),
        exit_code: row.get(2),
        attempt: row.get(3),
        claimed_at: row.get(4),
        ended_at: row.get(5),
        host: row.get(6),
        pid: row.get(7),
        backend_pid: row.get(8),
        epoch: row.get(9),
        detail: row.get(10),
        schedule: row.get(11),
        timezone: row.get(12),
    }
}

fn query_error(err: tokio_postgres::Error) -> LedgerError {
    LedgerError::Query(describe(&err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        assert_eq!(
            TableName::parse("pgleader_ledger").expect("ok").as_str(),
            "pgleader_ledger"
        );
        let ops = TableName::parse("Ops.Runs").expect("ok");
        assert_eq!((ops.as_str(), ops.sql()), ("ops.runs", "\"ops\".\"runs\""));
        for bad in [
            "",
            "a.b.c",
            "runs; DROP TABLE x",
            "1runs",
            "ru-ns",
            "\"runs\"",
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(
            TableName::default()
                .ddl()
                .starts_with("CREATE TABLE \"pgleader_ledger\" (")
        );
    }
}
