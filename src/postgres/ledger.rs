//! The ledger: one row per occurrence of a scheduled lock, in a table of the same database.
//!
//! It is PostgreSQL's implementation of the ledger's contract (`election/ledger.rs`), what
//! makes "at most once per occurrence" hold across replicas, timers, restarts and failovers:
//! before the command starts, the leader inserts the occurrence's row on its own session, and
//! the statement itself requires that this session holds the advisory lock, so the lock orders
//! every write, a session that lost it claims nothing, and the primary key
//! `(lock_key, scheduled_for)` refuses a second claim. A claim also refuses to be early on the
//! server's clock (earlier than the lead its caller asks for: a crontab job's claim lands a
//! moment ahead, its command starts at the instant) and refuses any occurrence at or before
//! one already recorded, so a server clock that steps back, or pruning, cannot bring an old
//! occurrence back.
//!
//! Rows record how each occurrence ended: `running`, `succeeded`, `failed` (with the exit
//! status), `interrupted` (its leader lost the lock, or was shut down, while it ran), `skipped`
//! (it came while the previous run was still going) and `missed` (no leader could run it
//! within `--catch-up`). Only the newest [`KEEP`] rows of each lock are kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use crate::election::ledger::{
    Asked, AskedFinish, Claim, Claimant, Definition, Entry, JobEntry, KEEP, LateFinish, Ledger,
    LedgerError, StaleRun,
};
use crate::election::lock::LockKey;
use crate::election::participant::{self, Participant};
use crate::postgres::bundle::{Bundle, Outcome, Param, param};
use crate::postgres::describe::describe;
use crate::postgres::locks::{LOCK_ROWS, held_in_transaction, this_lock};

mod asked;

pub use asked::{ASKED_DDL, ask, read_asked, read_asked_history};

/// The default table name.
pub const DEFAULT_TABLE: &str = "pgleader_ledger";

/// The table's definition; docs/scheduled-jobs.md gives the same text.
pub const DDL: &str = "CREATE TABLE {table} (
    lock_key      bigint      NOT NULL,
    scheduled_for timestamptz NOT NULL,
    lock_name     text,
    schedule      text        NOT NULL,
    timezone      text        NOT NULL,
    outcome       text        NOT NULL CHECK (outcome IN
                  ('running', 'succeeded', 'failed', 'interrupted', 'skipped', 'missed', 'paused')),
    exit_code     integer,
    detail        text,
    output        text,
    attempt       integer     NOT NULL DEFAULT 1,
    claimed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at      timestamptz,
    host          text,
    pid           integer,
    backend_pid   integer,
    epoch         bigint,
    PRIMARY KEY (lock_key, scheduled_for)
)";

/// The outcomes the ledger table's check allows, as the DDL lists them.
const OUTCOMES: &str =
    "'running', 'succeeded', 'failed', 'interrupted', 'skipped', 'missed', 'paused'";

/// The table of a crontab fleet's paused jobs (`pgleader cron pause`), beside the ledger table
/// and named after it (`pgleader_ledger_paused`): a row per paused job, by the name its ledger
/// rows carry (`<fleet key>` U+001F `<job>`, or `*` for every job), with who paused it.
pub const PAUSED_DDL: &str = "CREATE TABLE {table} (
    lock_name text        PRIMARY KEY,
    detail    text        NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp()
)";

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

    /// The statement that creates it, for error messages and docs/scheduled-jobs.md.
    pub fn ddl(&self) -> String {
        DDL.replace("{table}", &self.sql)
    }

    /// The table of a crontab fleet's paused jobs, beside this one: `<name>_paused`.
    pub fn paused(&self) -> TableName {
        self.beside("_paused")
    }

    /// The table of a crontab fleet's runs asked for by hand, beside this one: `<name>_asked`.
    pub fn asked(&self) -> TableName {
        self.beside("_asked")
    }

    /// A table named after this one: `<name><suffix>`, the name cut where it would be longer
    /// than PostgreSQL's 63 characters.
    fn beside(&self, suffix: &str) -> TableName {
        TableName::parse(&format!("{}{suffix}", self.text)).unwrap_or_else(|_| {
            let (schema, name) = match self.text.split_once('.') {
                Some((schema, name)) => (format!("{schema}."), name),
                None => (String::new(), self.text.as_str()),
            };
            let cut: String = name.chars().take(63 - suffix.len()).collect();
            TableName::parse(&format!("{schema}{cut}{suffix}")).expect("a valid name")
        })
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName::parse(DEFAULT_TABLE).expect("the default table name is valid")
    }
}

/// What a leader's ledger statements need from the backend's settings.
#[derive(Clone, Debug)]
pub struct LedgerSettings {
    pub table: TableName,
    /// The application name the user gave (the session's name starts with it).
    pub user_name: Option<String>,
    /// How long one of a leader's ledger statements may wait: well under --check-timeout, so
    /// that the checks, which share the session, are not held up past their deadline.
    pub statement_timeout: Duration,
    /// Whether the table has the column of the runs' output, learned when a fleet prepares it
    /// (`prepare_pauses`), for every ledger of this process's sessions (one per job).
    pub keeps_output: Arc<AtomicBool>,
    /// Whether the table of runs asked for by hand exists (`asked.rs`), learned likewise.
    pub asks: Arc<AtomicBool>,
    /// The statements' texts for `table`, of the plain lock's ledger and of a crontab job's,
    /// built once and shared by every ledger (a crontab of 1,000 jobs held 7 KiB of the same
    /// SQL per job).
    pub texts: Arc<[std::sync::OnceLock<Arc<Texts>>; 2]>,
}

/// The ledger of one lock and one schedule definition, on one session: the statements,
/// prepared as text for its table, and the session's client.
#[derive(Clone, Debug)]
pub struct PgLedger {
    client: Arc<Client>,
    /// The session's group commit, which every leader-side statement goes through.
    bundle: Arc<Bundle>,
    inner: Arc<Statements>,
}

/// The advisory lock a leader's writes to the ledger require its session to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The plain lock of the ledger's own key (`--schedule`).
    Plain,
    /// A crontab job's lock: the two-int4 key `(space, item)` of a sharded lock's items.
    Item { space: i32, item: u32 },
}

#[derive(Debug)]
struct Statements {
    table: TableName,
    lock: LockKey,
    guard: Guard,
    definition: Definition,
    /// The application name the user gave, which the session's name starts with.
    user_name: Option<String>,
    keeps_output: Arc<AtomicBool>,
    asks: Arc<AtomicBool>,
    texts: Arc<Texts>,
}

/// The texts of a ledger's statements, which depend on its table and its guard's form only.
#[derive(Debug)]
pub struct Texts {
    claim: Arc<str>,
    finish: Arc<str>,
    /// `finish` that records the run's output too, once the table has the column (a crontab
    /// fleet's or scheduled shards' ledger, see `prepare_pauses`).
    finish_output: Arc<str>,
    /// The statements of the runs asked for by hand, for a crontab job's ledger.
    asked: Option<asked::Statements>,
    record: Arc<str>,
    interrupt_stale: Arc<str>,
    recent: Arc<str>,
    exists: Arc<str>,
    late_finish: String,
    unclaim: Arc<str>,
    participants: Arc<str>,
}

impl PgLedger {
    /// The ledger in `table`, on the session of `client`. Each statement a leader runs goes
    /// through the session's group commit (`bundle.rs`), which bounds it by the ledger's
    /// statement timeout in a transaction shared with the statements asked for at the same
    /// moment.
    pub fn new(
        client: Arc<Client>,
        bundle: Arc<Bundle>,
        settings: &LedgerSettings,
        lock: LockKey,
        guard: Guard,
        definition: Definition,
    ) -> PgLedger {
        let form = match guard {
            Guard::Plain => 0,
            Guard::Item { .. } => 1,
        };
        let texts =
            settings.texts[form].get_or_init(|| Arc::new(Texts::new(&settings.table, guard)));
        PgLedger {
            client,
            bundle,
            inner: Arc::new(Statements {
                table: settings.table.clone(),
                lock,
                guard,
                definition,
                user_name: settings.user_name.clone(),
                keeps_output: Arc::clone(&settings.keeps_output),
                asks: Arc::clone(&settings.asks),
                texts: Arc::clone(texts),
            }),
        }
    }
}

impl Texts {
    /// The texts for `table` and the form of `guard` (its lock is a parameter of each).
    fn new(table: &TableName, guard: Guard) -> Texts {
        let t = table.sql();
        let subid = match guard {
            Guard::Plain => 1,
            Guard::Item { .. } => 2,
        };
        // Every leader-side statement goes through the group commit, which records the
        // session's locks as each transaction begins.
        let leads = |classid: &str, objid: &str| held_in_transaction(classid, objid, subid);
        let leads_claim = leads("$10", "$11");
        // A crontab job's occurrence is recorded as paused while the fleet pauses the job (its
        // name, or `*`): `<fleet key>` U+001F `<job>` is the job's lock name, `$2`.
        let paused = match guard {
            Guard::Plain => "SELECT NULL::text AS detail WHERE false".to_owned(),
            Guard::Item { .. } => format!(
                "SELECT detail FROM {} WHERE lock_name IN ($2, \
                   pg_catalog.split_part($2, pg_catalog.chr(31), 1) || pg_catalog.chr(31) || '*') \
                 ORDER BY lock_name DESC LIMIT 1",
                table.paused().sql()
            ),
        };
        let claim = format!(
            "WITH now AS (SELECT pg_catalog.clock_timestamp() AS t),
             leads AS (SELECT {leads_claim} AS held),
             paused AS ({paused}),
             existing AS (SELECT outcome FROM {t} WHERE lock_key = $1 AND scheduled_for = $3),
             newer AS (SELECT FROM {t} WHERE lock_key = $1 AND scheduled_for > $3),
             claimed AS (
               INSERT INTO {t} AS l (lock_key, scheduled_for, lock_name, schedule, timezone, outcome,
                                     attempt, claimed_at, host, pid, backend_pid, epoch, ended_at, detail)
               SELECT $1, $3, $2, $4, $5, CASE WHEN paused.detail IS NULL THEN 'running' ELSE 'paused' END,
                      1, GREATEST(now.t, $3), $6, $7, pg_catalog.pg_backend_pid(), $8,
                      CASE WHEN paused.detail IS NULL THEN NULL ELSE GREATEST(now.t, $3) END, paused.detail
                 FROM now CROSS JOIN leads LEFT JOIN paused ON true
                WHERE leads.held AND now.t >= $12 AND NOT EXISTS (SELECT FROM newer)
               ON CONFLICT (lock_key, scheduled_for) DO UPDATE
                  SET outcome = 'running', attempt = l.attempt + 1, claimed_at = EXCLUDED.claimed_at,
                      ended_at = NULL, exit_code = NULL, detail = NULL, host = EXCLUDED.host,
                      pid = EXCLUDED.pid, backend_pid = EXCLUDED.backend_pid, epoch = EXCLUDED.epoch
                WHERE l.outcome = 'interrupted' AND l.attempt <= $9
               RETURNING attempt)
             SELECT (SELECT attempt FROM claimed), (SELECT outcome FROM existing),
                    EXISTS (SELECT FROM newer), (SELECT t FROM now), (SELECT held FROM leads),
                    (SELECT detail FROM paused)"
        );
        let finish_with = |output: &str| {
            format!(
                "WITH done AS (
               UPDATE {t} SET outcome = $4, exit_code = $5, detail = $6{output},
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
            )
        };
        let (finish, finish_output) = (finish_with(""), finish_with(", output = $7"));
        let leads_record = leads("$11", "$12");
        let record = format!(
            "INSERT INTO {t} (lock_key, scheduled_for, lock_name, schedule, timezone, outcome, detail,
                              claimed_at, ended_at, host, pid, backend_pid, epoch)
             SELECT $1, $3, $2, $4, $5, $6, $7, pg_catalog.clock_timestamp(),
                    pg_catalog.clock_timestamp(), $8, $9, pg_catalog.pg_backend_pid(), $10
              WHERE NOT EXISTS (SELECT FROM {t} WHERE lock_key = $1 AND scheduled_for >= $3)
                AND {leads_record}
             RETURNING 1"
        );
        let leads_stale = leads("$2", "$3");
        // A claim made ahead of an occurrence the server's clock has not reached never started
        // its command (it starts at the instant): taken back, for the new holder to claim. Only
        // one 100 ms away or more: its claimant, if alive, has had a moment to hear that its
        // session ended (`election/ledger.rs`).
        let interrupt_stale = format!(
            "WITH bound AS (SELECT pg_catalog.clock_timestamp() + interval '100 milliseconds' AS t),
             ahead AS (
               DELETE FROM {t} WHERE lock_key = $1 AND outcome = 'running'
                                  AND scheduled_for > (SELECT t FROM bound) AND {leads_stale}
               RETURNING 1)
             UPDATE {t} SET outcome = 'interrupted', ended_at = pg_catalog.clock_timestamp(),
                            detail = COALESCE(detail, 'its leader lost the lock while it ran')
              WHERE lock_key = $1 AND outcome = 'running' AND scheduled_for <= (SELECT t FROM bound)
                AND {leads_stale}
             RETURNING scheduled_for, host, pid"
        );
        let recent = recent_sql(table);
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
        Texts {
            claim: claim.into(),
            finish: finish.into(),
            finish_output: finish_output.into(),
            asked: match guard {
                Guard::Plain => None,
                Guard::Item { .. } => Some(asked::Statements::new(table, leads)),
            },
            record: record.into(),
            interrupt_stale: interrupt_stale.into(),
            recent: recent.into(),
            exists: exists.into(),
            late_finish,
            unclaim: unclaim.into(),
            participants: participants_sql().into(),
        }
    }
}

impl PgLedger {
    /// Runs one leader-side statement through the session's group commit: bounded by the
    /// statement timeout, in the transaction of the statements asked for at the same moment,
    /// and counted only once that transaction has committed.
    async fn bounded(&self, sql: &Arc<str>, params: Vec<Param>) -> Result<Vec<Row>, LedgerError> {
        match self.bundle.run(Arc::clone(sql), params).await {
            Outcome::Committed(rows) => Ok(rows),
            Outcome::Failed(err) => Err(self.classify(&err)),
            Outcome::RolledBack => Err(LedgerError::Busy(
                "rolled back with another ledger statement of its transaction, which failed"
                    .to_owned(),
            )),
            // A serialization failure can surface at COMMIT: rolled back, to be tried again.
            Outcome::NotCommitted(err) => Err(self.classify(&err)),
            Outcome::Gone => Err(LedgerError::Query(
                "the session ended before the statement was sent".to_owned(),
            )),
        }
    }

    /// The single row of a statement that returns one.
    async fn bounded_one(&self, sql: &Arc<str>, params: Vec<Param>) -> Result<Row, LedgerError> {
        let mut rows = self.bounded(sql, params).await?;
        match rows.len() {
            1 => Ok(rows.remove(0)),
            n => Err(LedgerError::Query(format!(
                "a ledger statement returned {n} rows where one was expected"
            ))),
        }
    }

    /// What a new row of occurrence `at` starts with (claim and record, `$1` to `$5`): the
    /// ledger's key, the lock's name, the occurrence, and the schedule's definition.
    fn row_params(&self, at: Timestamp) -> Vec<Param> {
        let s = &self.inner;
        vec![
            param(s.lock.key(), Type::INT8),
            param(s.lock.name().map(str::to_owned), Type::TEXT),
            param(at, Type::TIMESTAMPTZ),
            param(s.definition.expression.clone(), Type::TEXT),
            param(s.definition.timezone.clone(), Type::TEXT),
        ]
    }

    /// The ledger's key, and the guarding lock's classid and objid as `pg_locks` shows them.
    fn key_params(&self) -> (i64, u32, u32) {
        let lock = &self.inner.lock;
        match self.inner.guard {
            Guard::Plain => (lock.key(), lock.classid(), lock.objid()),
            Guard::Item { space, item } => (lock.key(), space as u32, item),
        }
    }

    fn classify(&self, err: &tokio_postgres::Error) -> LedgerError {
        let Some(code) = err.code() else {
            return LedgerError::Query(describe(err));
        };
        let busy = [
            // A statement prepared before an operator changed the table's columns ("cached
            // plan must not change result type"): the group commit prepares it again.
            SqlState::FEATURE_NOT_SUPPORTED,
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
            LedgerError::Busy(describe(err))
        } else if fatal.contains(code) || code.code().starts_with("23") {
            self.explain(err, "the ledger table cannot be used")
        } else {
            LedgerError::Query(describe(err))
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
                " (is {table} a pgleader ledger? docs/scheduled-jobs.md gives its definition; --ledger-table names another table)"
            ),
        };
        LedgerError::Fatal(format!("{what} {table}: {}{hint}", describe(err)))
    }
}

impl PgLedger {
    /// Makes a crontab fleet's ledger ready for paused jobs: the table of pauses beside the
    /// ledger table ([`PAUSED_DDL`]), and `paused` among the outcomes the ledger table's check
    /// allows (a table made before pauses existed has its check replaced). Says what to run
    /// when this role cannot.
    pub async fn prepare_pauses(&self) -> Result<(), LedgerError> {
        let client = &self.client;
        let table = &self.inner.table;
        ensure_paused_table(client, table).await?;
        let keeps = ensure_output_column(client, table).await?;
        self.inner.keeps_output.store(keeps, Ordering::Relaxed);
        let asks = asked::ensure_table(client, table).await?;
        self.inner.asks.store(asks, Ordering::Relaxed);
        let checks = client
            .query_typed(
                "SELECT c.conname::text, pg_catalog.pg_get_constraintdef(c.oid) \
                   FROM pg_catalog.pg_constraint c \
                  WHERE c.conrelid = pg_catalog.to_regclass($1) AND c.contype = 'c'",
                &[(&table.sql(), Type::TEXT)],
            )
            .await
            .map_err(query_error)?;
        for check in checks {
            let (name, definition): (String, String) = (check.get(0), check.get(1));
            if !definition.contains("outcome") || definition.contains("'paused'") {
                continue;
            }
            let alter = format!(
                "ALTER TABLE {t} DROP CONSTRAINT \"{name}\", \
                 ADD CONSTRAINT \"{name}\" CHECK (outcome IN ({OUTCOMES}))",
                t = table.sql()
            );
            if let Err(err) = client.batch_execute(&alter).await {
                return Err(LedgerError::Fatal(format!(
                    "the ledger table {} was made before crontab jobs could be paused, and this \
                     role cannot add 'paused' to the outcomes its check allows: {}; have its \
                     owner run:\n{alter};",
                    table.as_str(),
                    describe(&err)
                )));
            }
        }
        Ok(())
    }
}

/// Adds the column of the runs' output (`--keep-output`) to a ledger table made before it
/// existed; whether the table has it. A nullable column without a default: PostgreSQL adds it
/// without rewriting the table, but the ALTER waits for a lock on it, bounded here so that
/// the runs' statements never queue behind it for long. A role that may not alter the table
/// (or a table busy for longer) keeps working without the column, and the log says what to
/// run: the output is then not kept.
async fn ensure_output_column(client: &Client, table: &TableName) -> Result<bool, LedgerError> {
    let has = || async {
        let row = client
            .query_typed_one(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute \
                                 WHERE attrelid = pg_catalog.to_regclass($1) \
                                   AND attname = 'output' AND NOT attisdropped)",
                &[(&table.sql(), Type::TEXT)],
            )
            .await
            .map_err(query_error)?;
        Ok::<bool, LedgerError>(row.get(0))
    };
    if has().await? {
        return Ok(true);
    }
    let alter = format!(
        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS output text",
        table.sql()
    );
    // One query string: an implicit transaction, whose failure undoes the SET too.
    let bounded = format!("SET lock_timeout = '2s'; {alter}; RESET lock_timeout");
    if let Err(err) = client.batch_execute(&bounded).await {
        tracing::warn!(
            event = "ledger_output_column",
            table = table.as_str(),
            "the ledger table {} has no column for the runs' output, and it could not be added ({}): runs are recorded without their output; have its owner run:\n{alter};",
            table.as_str(),
            describe(&err)
        );
        return Ok(false);
    }
    has().await
}

/// Creates the table of a crontab fleet's paused jobs beside the ledger table `ledger` when it
/// is missing, and says what to run when this role cannot.
pub async fn ensure_paused_table(client: &Client, ledger: &TableName) -> Result<(), LedgerError> {
    let paused = ledger.paused();
    if resolve(client, &paused).await?.is_some() {
        return Ok(());
    }
    let ddl = PAUSED_DDL.replace("{table}", paused.sql());
    let create = ddl.replacen("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1);
    if let Err(err) = client.batch_execute(&create).await
        && resolve(client, &paused).await?.is_none()
    {
        return Err(LedgerError::Fatal(format!(
            "cannot create the table of paused jobs {}: {}; have an administrator create it \
             with:\n{ddl};\nGRANT SELECT, INSERT, UPDATE, DELETE ON {} TO <role>;",
            paused.as_str(),
            describe(&err),
            paused.sql()
        )));
    }
    Ok(())
}

/// Pauses `name` (`<fleet key>` U+001F `<job>`, or `*` after the separator) with `detail`, or
/// resumes it (`None`; `*`: every pause of the fleet); whether a row changed.
pub async fn set_paused(
    client: &Client,
    ledger: &TableName,
    fleet: &LockKey,
    job: &str,
    detail: Option<&str>,
) -> Result<bool, LedgerError> {
    ensure_paused_table(client, ledger).await?;
    let t = ledger.paused();
    let name = format!("{}\u{1f}{job}", fleet.key());
    let changed = match (job, detail) {
        (_, Some(detail)) => {
            client
                .execute_typed(
                    &format!(
                        "INSERT INTO {} (lock_name, detail) VALUES ($1, $2) \
                         ON CONFLICT (lock_name) DO UPDATE SET detail = EXCLUDED.detail, \
                         paused_at = pg_catalog.clock_timestamp()",
                        t.sql()
                    ),
                    &[(&name, Type::TEXT), (&detail, Type::TEXT)],
                )
                .await
        }
        ("*", None) => {
            let prefix = format!("{}\u{1f}", fleet.key());
            client
                .execute_typed(
                    &format!(
                        "DELETE FROM {} WHERE pg_catalog.left(lock_name, pg_catalog.length($1)) = $1",
                        t.sql()
                    ),
                    &[(&prefix, Type::TEXT)],
                )
                .await
        }
        (_, None) => {
            client
                .execute_typed(
                    &format!("DELETE FROM {} WHERE lock_name = $1", t.sql()),
                    &[(&name, Type::TEXT)],
                )
                .await
        }
    }
    .map_err(query_error)?;
    Ok(changed > 0)
}

/// The paused jobs of the fleet of `fleet` (`*`: every job), each with its detail; none when
/// the table of pauses does not exist.
pub async fn read_paused(
    client: &Client,
    ledger: &TableName,
    fleet: &LockKey,
) -> Result<Vec<(String, String)>, LedgerError> {
    let t = ledger.paused();
    if resolve(client, &t).await?.is_none() {
        return Ok(Vec::new());
    }
    let prefix = format!("{}\u{1f}", fleet.key());
    let rows = client
        .query_typed(
            &format!(
                "SELECT pg_catalog.substr(lock_name, pg_catalog.length($1) + 1), detail FROM {} \
                  WHERE pg_catalog.left(lock_name, pg_catalog.length($1)) = $1 ORDER BY 1",
                t.sql()
            ),
            &[(&prefix, Type::TEXT)],
        )
        .await
        .map_err(query_error)?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

impl Ledger for PgLedger {
    /// Makes sure the table exists and that this role may use it: creates it when missing,
    /// and says what to run when it cannot. Returns its schema-qualified name.
    async fn prepare(&self) -> Result<String, LedgerError> {
        let (client, table) = (&self.client, &self.inner.table);
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
                &self.inner.texts.recent,
                &[(&self.inner.lock.key(), Type::INT8), (&one, Type::INT8)],
            )
            .await
            .map_err(|err| self.explain(&err, "the ledger table cannot be read"))?;
        resolve(client, table).await?.ok_or_else(|| {
            LedgerError::Query(format!("the ledger table {} vanished", table.as_str()))
        })
    }

    async fn announce(&self, fingerprints: &str) -> Result<(), LedgerError> {
        let name = participant::label(self.inner.user_name.as_deref(), Some(fingerprints));
        self.client
            .query_typed(
                "SELECT pg_catalog.set_config('application_name', $1, false)",
                &[(&name, Type::TEXT)],
            )
            .await
            .map_err(query_error)?;
        Ok(())
    }

    async fn participants(&self) -> Result<Vec<Participant>, LedgerError> {
        // A crontab job's key is no lock anyone holds or waits for: which replica defines the
        // job how is the roster's business (its knows and defines markers), and reading
        // pg_locks beside pg_stat_activity before each of a second's claims cost more than the
        // claims themselves.
        if let Guard::Item { .. } = self.inner.guard {
            return Ok(Vec::new());
        }
        let lock = &self.inner.lock;
        let params = vec![
            param(lock.classid(), Type::OID),
            param(lock.objid(), Type::OID),
        ];
        let rows = self.bounded(&self.inner.texts.participants, params).await?;
        Ok(rows
            .iter()
            .map(|row| Participant {
                application_name: Some(row.get(0)),
                backend_pid: row.get(1),
                granted: row.get(2),
                ..Participant::default()
            })
            .collect())
    }

    async fn server_time(&self) -> Result<Timestamp, LedgerError> {
        server_time(&self.client).await
    }

    async fn interrupt_stale(&self) -> Result<Vec<StaleRun>, LedgerError> {
        let (key, classid, objid) = self.key_params();
        let params = vec![
            param(key, Type::INT8),
            param(classid, Type::OID),
            param(objid, Type::OID),
        ];
        let rows = self
            .bounded(&self.inner.texts.interrupt_stale, params)
            .await?;
        Ok(rows
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect())
    }

    async fn recent(&self, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        let key = self.inner.lock.key();
        let params = vec![param(key, Type::INT8), param(limit, Type::INT8)];
        let rows = self.bounded(&self.inner.texts.recent, params).await?;
        Ok(rows.iter().map(entry).collect())
    }

    async fn has(&self, at: Timestamp) -> Result<bool, LedgerError> {
        let key = self.inner.lock.key();
        let params = vec![param(key, Type::INT8), param(at, Type::TIMESTAMPTZ)];
        let row = self.bounded_one(&self.inner.texts.exists, params).await?;
        Ok(row.get(0))
    }

    async fn claim(
        &self,
        at: Timestamp,
        ahead: Duration,
        claimant: &Claimant,
        retries: i32,
    ) -> Result<Claim, LedgerError> {
        let (_, classid, objid) = self.key_params();
        let mut params = self.row_params(at);
        params.extend(claimant_params(claimant));
        let from = at
            .checked_sub(SignedDuration::try_from(ahead).unwrap_or_default())
            .unwrap_or(at);
        params.extend([
            param(retries, Type::INT4),
            param(classid, Type::OID),
            param(objid, Type::OID),
            param(from, Type::TIMESTAMPTZ),
        ]);
        let row = self.bounded_one(&self.inner.texts.claim, params).await?;
        let attempt: Option<i32> = row.get(0);
        let existing: Option<String> = row.get(1);
        let newer: bool = row.get(2);
        let server_now: Timestamp = row.get(3);
        let held: bool = row.get(4);
        let paused: Option<String> = row.get(5);
        Ok(match (attempt, existing) {
            // A new row for a paused job is the paused occurrence's, not a claim (a retried
            // interrupted run, an existing row, goes on).
            (Some(_), None) if let Some(detail) = paused => Claim::Paused { detail },
            (Some(attempt), _) => Claim::Claimed { attempt },
            (None, _) if !held => Claim::NotLeader,
            (None, _) if newer => Claim::Superseded,
            (None, Some(outcome)) => Claim::Taken { outcome },
            (None, None) => Claim::Early { server_now },
        })
    }

    async fn finish(&self, finish: &LateFinish, detail: Option<&str>) -> Result<bool, LedgerError> {
        let key = self.inner.lock.key();
        let mut params = vec![
            param(key, Type::INT8),
            param(finish.at, Type::TIMESTAMPTZ),
            param(finish.epoch, Type::INT8),
            param(finish.outcome, Type::TEXT),
            param(finish.exit_code, Type::INT4),
            param(detail.map(str::to_owned), Type::TEXT),
        ];
        let statement = if self.inner.keeps_output.load(Ordering::Relaxed) {
            params.push(param(finish.output.clone(), Type::TEXT));
            &self.inner.texts.finish_output
        } else {
            &self.inner.texts.finish
        };
        let row = self.bounded_one(statement, params).await?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    async fn finish_late(&self, late: &LateFinish) -> Result<bool, LedgerError> {
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
        let updated = self
            .client
            .execute_typed(&self.inner.texts.late_finish, &params)
            .await
            .map_err(|err| self.classify(&err))?;
        Ok(updated > 0)
    }

    async fn unclaim(&self, at: Timestamp, epoch: i64) -> Result<(), LedgerError> {
        let key = self.inner.lock.key();
        let params = vec![
            param(key, Type::INT8),
            param(at, Type::TIMESTAMPTZ),
            param(epoch, Type::INT8),
        ];
        self.bounded(&self.inner.texts.unclaim, params).await?;
        Ok(())
    }

    async fn take_asked(
        &self,
        claimant: &Claimant,
        skip: Option<&str>,
    ) -> Result<Option<Asked>, LedgerError> {
        self.take_asked_run(claimant, skip).await
    }

    async fn finish_asked(&self, finish: &AskedFinish) -> Result<bool, LedgerError> {
        self.finish_asked_run(finish).await
    }

    async fn interrupt_stale_asked(&self) -> Result<u64, LedgerError> {
        self.interrupt_stale_asked_runs().await
    }

    async fn record(
        &self,
        at: Timestamp,
        outcome: &str,
        detail: &str,
        claimant: &Claimant,
    ) -> Result<bool, LedgerError> {
        let (_, classid, objid) = self.key_params();
        let mut params = self.row_params(at);
        params.extend([
            param(outcome.to_owned(), Type::TEXT),
            param(detail.to_owned(), Type::TEXT),
        ]);
        params.extend(claimant_params(claimant));
        params.extend([param(classid, Type::OID), param(objid, Type::OID)]);
        let rows = self.bounded(&self.inner.texts.record, params).await?;
        Ok(!rows.is_empty())
    }
}

/// Who claims or records a row: host, pid and fencing token, in that order.
fn claimant_params(claimant: &Claimant) -> [Param; 3] {
    [
        param(claimant.host.clone(), Type::TEXT),
        param(claimant.pid, Type::INT4),
        param(claimant.epoch, Type::INT8),
    ]
}

/// The other sessions that hold or wait for the lock, with their names.
fn participants_sql() -> String {
    format!(
        "SELECT COALESCE(a.application_name, ''), l.pid, l.granted
           FROM {LOCK_ROWS}
           JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
          WHERE {} AND l.pid <> pg_catalog.pg_backend_pid()",
        this_lock("$1", "$2")
    )
}

/// The server's clock now.
pub async fn server_time(client: &Client) -> Result<Timestamp, LedgerError> {
    Ok(client
        .query_typed_one("SELECT pg_catalog.clock_timestamp()", &[])
        .await
        .map_err(query_error)?
        .get(0))
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

/// The newest rows of a lock, with the runs' output where the table has the column (read
/// through the row as JSON: a plain lock's table made before the column has none).
fn recent_sql(table: &TableName) -> String {
    format!(
        "SELECT scheduled_for, outcome, exit_code, attempt, claimed_at, ended_at, host, pid, \
                backend_pid, epoch, detail, schedule, timezone, \
                pg_catalog.to_jsonb(l) ->> 'output' \
           FROM {} l WHERE lock_key = $1 ORDER BY scheduled_for DESC LIMIT $2",
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
    Ok(Some(rows.iter().map(entry_with_output).collect()))
}

/// Each job of the crontab fleet of `lock` with its newest row, for `pgleader status`, which
/// knows no crontab: a job's rows are under the key of the name `<fleet key>` U+001F `<job>`
/// (see `supervise/sharded/jobs.rs`), and `lock_name` holds that name, so one prefix finds
/// every job of the fleet. A claim made ahead of an occurrence the server's clock
/// has not reached is not a run yet (its command starts at the instant): the row before it is
/// the job's newest. `None` when the table does not exist.
pub async fn read_jobs(
    client: &Client,
    table: &TableName,
    lock: &LockKey,
) -> Result<Option<Vec<JobEntry>>, LedgerError> {
    if resolve(client, table).await?.is_none() {
        return Ok(None);
    }
    let t = table.sql();
    let sql = format!(
        "SELECT DISTINCT ON (l.lock_key) l.scheduled_for, l.outcome, l.exit_code, l.attempt, \
                l.claimed_at, l.ended_at, l.host, l.pid, l.backend_pid, l.epoch, l.detail, \
                l.schedule, l.timezone, substr(l.lock_name, length($1) + 1), \
                (SELECT max(s.ended_at) FROM {t} s \
                  WHERE s.lock_key = l.lock_key AND s.outcome = 'succeeded') \
           FROM {t} l WHERE left(l.lock_name, length($1)) = $1 \
            AND NOT (l.outcome = 'running' AND l.scheduled_for > pg_catalog.clock_timestamp()) \
          ORDER BY l.lock_key, l.scheduled_for DESC"
    );
    let prefix = format!("{}\u{1f}", lock.key());
    let rows = client
        .query_typed(&sql, &[(&prefix, Type::TEXT)])
        .await
        .map_err(query_error)?;
    let mut jobs: Vec<JobEntry> = rows
        .iter()
        .map(|row| JobEntry {
            newest: entry(row),
            name: row.get(13),
            last_success: row.get(14),
        })
        .collect();
    jobs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Some(jobs))
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
        output: None,
    }
}

/// A row of [`recent_sql`]: with the run's output.
fn entry_with_output(row: &tokio_postgres::Row) -> Entry {
    Entry {
        output: row.get(13),
        ..entry(row)
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
