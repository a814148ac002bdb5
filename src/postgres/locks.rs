//! The lock in PostgreSQL's words: the statements a session sends to set itself up, take the
//! lock, wait for it in turns, confirm it, fence a new leadership and let the lock go; the
//! twin of `redis/scripts.rs`, which holds the same in Lua. `session.rs` sends them and reads
//! the answers; a sharded lock's own statements are in `shards/statements.rs`, which builds its waits
//! with [`in_turns`] too.
//!
//! Here too: how statements name the lock in `pg_locks` (one description, used by the
//! leader's check, the ledger's guard, the agreement's and `status`'s lists of participants),
//! and where the locks of the same name run with `--shards` live (`postgres/shards/mod.rs` has
//! the whole table), for a plain session's set-up to tell whether sharded replicas run its name.
//!
//! A bigint advisory key shows as `classid` = its high 32 bits, `objid` = its low 32 bits and
//! `objsubid = 1` (the two-int4 form uses 2), in the current database only: a check on `objid`
//! alone would be wrong for keys at or above 2^32 and for negative keys.

use std::sync::LazyLock;
use std::time::Duration;

use crate::election::lease::Lease;
use crate::election::lock::LockKey;

/// `pg_locks` under the alias `l`, for a `FROM` clause.
pub const LOCK_ROWS: &str = "pg_catalog.pg_locks l";

/// Where the "runs with K shards" markers start (the second int4 of a sharded lock's keys).
pub const SHARD_COUNT_BASE: i32 = i32::MIN;
/// Where the "takes at most N shards" markers start, and the count markers end.
pub const SHARD_CAP_BASE: i32 = -(1 << 30);

/// The first int4 of every lock of `lock`'s name run with `--shards`: a hash of the plain key,
/// `hashtextextended('pgleader shards ' || key, 0)::bit(32)::int4` in SQL (its low 32 bits),
/// so that locks with neighbouring keys do not share it.
pub fn shard_space(lock: &LockKey) -> i32 {
    LockKey::from_name(&format!("pgleader shards {}", lock.key())).key() as i32
}

/// The first int4 of the "knows job n" markers of a crontab run under `lock`'s name:
/// `hashtextextended('pgleader knows ' || key, 0)::bit(32)::int4` in SQL. Apart from
/// [`shard_space`], whose second int4s are all taken by the jobs and the markers.
pub fn knows_space(lock: &LockKey) -> i32 {
    LockKey::from_name(&format!("pgleader knows {}", lock.key())).key() as i32
}

/// The first int4 of the "markers digest" of a crontab's member under `lock`'s name, the
/// second int4 being a digest of the jobs it knows and how it defines them:
/// `hashtextextended('pgleader markers ' || key, 0)::bit(32)::int4` in SQL. A reader reads a
/// member's thousands of markers again only when its digest changed.
pub fn markers_space(lock: &LockKey) -> i32 {
    LockKey::from_name(&format!("pgleader markers {}", lock.key())).key() as i32
}

/// The first int4 of the "defines job `item` so" marker of a crontab run under `lock`'s name,
/// the second int4 being the definition: `hashtextextended('pgleader defines ' || key || ' ' ||
/// item, 0)::bit(32)::int4` in SQL. One space per job, so that whoever reads a member's
/// markers (another member, `status`) can tell which job each definition is of.
pub fn defines_space(lock: &LockKey, item: u32) -> i32 {
    LockKey::from_name(&format!("pgleader defines {} {item}", lock.key())).key() as i32
}

/// A scalar subquery: the server process of a session that runs `lock`'s name with
/// `--shards` (it holds a "runs with K shards" marker), or null.
pub fn sharded_replica(lock: &LockKey) -> String {
    // pg_locks shows an int4 in objid as an oid: the markers' range as unsigned numbers.
    format!(
        "(SELECT l.pid FROM {LOCK_ROWS} WHERE l.locktype = 'advisory' AND l.granted \
         AND l.objsubid = 2 AND l.classid = '{}'::oid \
         AND l.database = {THIS_DATABASE} \
         AND l.objid >= '{}'::oid AND l.objid < '{}'::oid LIMIT 1)",
        shard_space(lock) as u32,
        SHARD_COUNT_BASE as u32,
        SHARD_CAP_BASE as u32
    )
}

/// The oid of the session's database.
const THIS_DATABASE: &str =
    "(SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())";

/// The condition on `l` that selects the advisory lock whose classid and objid are the
/// statement's parameters `classid` and `objid` (`$1`, `$2`, ...), in this database.
pub fn this_lock(classid: &str, objid: &str) -> String {
    lock_of_form(classid, objid, 1)
}

/// The condition on `l` that selects the advisory lock `classid`, `objid` of the form `subid`:
/// 1 for a bigint key, 2 for two int4 (a shard's or a crontab job's).
fn lock_of_form(classid: &str, objid: &str, subid: u8) -> String {
    format!(
        "l.locktype = 'advisory' AND l.database = {THIS_DATABASE} \
         AND l.classid = {classid} AND l.objid = {objid} AND l.objsubid = {subid}"
    )
}

/// True when this session holds that lock: the condition of the leader's check, and of every
/// write a leader makes to the ledger, so that a session that lost the lock a moment ago
/// changes nothing.
pub fn held_here(classid: &str, objid: &str) -> String {
    held_here_of_form(classid, objid, 1)
}

/// The transaction-local setting in which a ledger transaction (`bundle.rs`) records, as it
/// begins, every advisory lock its session holds in this database: ` SUBID:CLASSID:OBJID ` for
/// each, apart by spaces. A statement that names it is sent after [`record_held_locks`].
pub const HELD_LOCKS: &str = "pgleader.held_locks";

/// Records the session's advisory locks in [`HELD_LOCKS`] for the transaction: one read of
/// `pg_locks` (which copies the server's whole lock table, some 400 rows with a crontab of
/// 100 jobs on three replicas) for all its statements instead of one each. Nothing can change
/// between this read and the transaction's statements: they go out together, and only the
/// session itself releases its session-level locks.
pub fn record_held_locks() -> String {
    format!(
        "SELECT pg_catalog.set_config('{HELD_LOCKS}', ' ' || COALESCE((\
         SELECT pg_catalog.string_agg(l.objsubid::text || ':' || l.classid::text || ':' || l.objid::text, ' ') \
         FROM {LOCK_ROWS} WHERE l.locktype = 'advisory' AND l.granted \
         AND l.pid = pg_catalog.pg_backend_pid() AND l.database = {THIS_DATABASE}), '') || ' ', true)"
    )
}

/// [`held_here`] for a lock of the form `subid` (see [`lock_of_form`]), read from what the
/// transaction recorded as it began ([`HELD_LOCKS`]) rather than from `pg_locks` itself.
pub fn held_in_transaction(classid: &str, objid: &str, subid: u8) -> String {
    format!(
        "pg_catalog.strpos(pg_catalog.current_setting('{HELD_LOCKS}'), \
         ' {subid}:' || ({classid})::text || ':' || ({objid})::text || ' ') > 0"
    )
}

/// [`held_here`] for a lock of the form `subid` (see [`lock_of_form`]).
pub fn held_here_of_form(classid: &str, objid: &str, subid: u8) -> String {
    format!(
        "EXISTS (SELECT FROM {LOCK_ROWS} WHERE {} AND l.granted AND l.pid = pg_catalog.pg_backend_pid())",
        lock_of_form(classid, objid, subid)
    )
}

/// The channel a leader of `lock` LISTENs on for step-down requests (`pg_notify`'s first
/// argument): a plain identifier, so LISTEN needs no quoting.
pub fn step_down_channel(lock: &LockKey) -> String {
    format!("pgleader_step_down_{:016x}", lock.key() as u64)
}

/// Whether the session `$1` (a step-down request's sender) runs as this session's role or one
/// that is a member of it (a superuser is): NOTIFY needs no privilege, so without this any
/// role that can connect could bounce the leader.
pub(super) const SENDER_MAY_ASK: &str = "SELECT coalesce((SELECT pg_catalog.pg_has_role(\
     a.usesysid, current_user, 'MEMBER') FROM pg_catalog.pg_stat_activity a \
     WHERE a.pid = $1), false)";

/// The session's server process, whether the server is a standby, the server's view of the
/// connection's two ends (the client's, then its own; null over a Unix socket), and a replica
/// that runs `lock`'s name with `--shards`, if any: all in the set-up's round trip.
pub(super) fn setup_identity(lock: &LockKey) -> String {
    format!(
        "SELECT pg_catalog.pg_backend_pid(), pg_catalog.pg_is_in_recovery(), \
         pg_catalog.host(pg_catalog.inet_client_addr()), pg_catalog.inet_client_port(), \
         pg_catalog.host(pg_catalog.inet_server_addr()), pg_catalog.inet_server_port(), {}",
        sharded_replica(lock)
    )
}
pub(super) const TRY_SQL: &str =
    "SELECT pg_catalog.pg_try_advisory_lock($1), pg_catalog.pg_backend_pid()";
pub(super) const BACKEND_PID_SQL: &str = "SELECT pg_catalog.pg_backend_pid()";
pub(super) const UNLOCK_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock($1)";

/// Seconds since the server last freed every lock at once (see `PgSession::fence`).
const SINCE_RESET_SQL: &str = "extract(epoch FROM pg_catalog.clock_timestamp() - GREATEST(\
    pg_catalog.pg_postmaster_start_time(), \
    (SELECT stats_reset FROM pg_catalog.pg_stat_bgwriter)))::float8";

/// A new leader's fencing token (see `PgSession::fence`). pg_current_xact_id: PostgreSQL 13 or
/// later, which `version` already demands.
const TOKEN_SQL: &str = "pg_catalog.pg_current_xact_id()::text::int8";

/// What makes the token's commit wait for a WAL flush (see `PgSession::fence`).
const FLUSH_SQL: &str = "pg_catalog.pg_logical_emit_message(true, 'pgleader', 'epoch') IS NOT NULL";

/// The token, the flush, the restart fence's figure and the server's clock.
static FENCE_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    format!("{TOKEN_SQL}, {FLUSH_SQL}, {SINCE_RESET_SQL}, pg_catalog.clock_timestamp()")
});

/// The fence alone, after `pg_try_advisory_lock` won.
pub(super) static FENCE_SQL: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {}", *FENCE_COLUMNS));

/// Where a follower's wait leaves the fence it took at the grant, for `PgSession::fence` to
/// read: a setting of the session's own (a placeholder variable, which any role may set).
pub(super) const FENCE_SETTING: &str = "pgleader.fence";

/// What `PgSession::fence` reads after a wait won: the backend, the server's clock, and the
/// fence the wait left in `FENCE_SETTING` ("TOKEN SECONDS_SINCE_RESET").
pub(super) static WON_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT pg_catalog.pg_backend_pid(), pg_catalog.clock_timestamp(), \
         pg_catalog.current_setting('{FENCE_SETTING}')"
    )
});

/// A follower's wait: a loop on the server, in one `DO` statement, so that no client round
/// trip is spent on it.
///
/// A running statement holds a snapshot, and a snapshot holds back VACUUM (and `CREATE INDEX
/// CONCURRENTLY`) in the whole database. So each turn waits for the lock at most a little less
/// than `refresh` (`lock_timeout`, set for that transaction alone), catches the timeout inside
/// the block (a caught error is not logged by the server, where one sent to the client would be
/// logged at ERROR), commits, and queues again in a new transaction with a new snapshot. The
/// server grants a released lock at once to whoever is queued; between two turns a follower is
/// out of the queue for the few microseconds the commit takes, and comes back behind those who
/// queued meanwhile: followers are served in the order they last queued, not the order they
/// came. `refresh` zero waits in one turn, holding its snapshot for the whole wait.
///
/// The fence comes with the lock, in the statement that waits (OFFSET 0 keeps the subquery, and
/// so the lock, ahead of the fence's columns), and so does storing it: one statement, planned
/// before the first wait, so that its catalog look-ups (about 2 ms in a new server process) are
/// done by the grant, which then runs no statement the block has not planned yet. The
/// transaction id is taken only once the lock is granted, so a waiting follower holds none; the
/// statement ends by committing it, flushed, before the server reports the statement done.
pub(super) fn wait_sql(key: i64, refresh: Duration) -> String {
    in_turns(
        refresh,
        &format!(
            "PERFORM pg_catalog.set_config('{FENCE_SETTING}', \
                 pg_catalog.concat_ws(' ', {TOKEN_SQL}, {SINCE_RESET_SQL}), false), {FLUSH_SQL} \
               FROM (SELECT pg_catalog.pg_advisory_lock({key}) OFFSET 0) AS granted;"
        ),
    )
}

/// A wait for a lock in turns of a little less than `refresh` each (zero: one turn), as a `DO`
/// statement: `body` asks for the lock (and does whatever comes with it); a turn that times
/// out commits and asks again, in a new transaction with a new snapshot (see `wait_sql`).
pub(super) fn in_turns(refresh: Duration, body: &str) -> String {
    // A little under `refresh`: the turn's snapshot is taken just before it queues, and is let
    // go a moment after the timeout, so that no snapshot outlives `refresh`.
    let lock_timeout = if refresh.is_zero() {
        0
    } else {
        (refresh.as_millis() * 19 / 20).max(1)
    };
    format!(
        "DO $pgleader$ BEGIN LOOP \
           BEGIN \
             PERFORM pg_catalog.set_config('lock_timeout', '{lock_timeout}', true); \
             {body} \
             EXIT; \
           EXCEPTION WHEN lock_not_available THEN NULL; \
           END; \
           COMMIT; \
         END LOOP; END $pgleader$"
    )
}

/// The leader's check: this backend (the same as ever) holds the lock, and the server's clock.
/// Written once: it runs every check interval.
pub(super) static CONFIRM_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT pg_catalog.pg_backend_pid(), pg_catalog.clock_timestamp(), {}",
        held_here("$1", "$2")
    )
});

/// The statements that prepare a session, sent in one round trip. Waiting for the lock must
/// never time out on the server's side; the lease settings bound how long the server keeps
/// the lock of a leader that vanished (see `election/lease.rs`); the epoch's commit must reach disk
/// (and a synchronous standby, if there is one) even where the server's default is
/// `synchronous_commit = off`.
pub(super) fn setup_sql(lease: &Lease, server_major: u32) -> String {
    let mut sql = String::from(
        "SET statement_timeout = 0; SET lock_timeout = 0; SET idle_in_transaction_session_timeout = 0; \
         SET synchronous_commit = on;",
    );
    sql.push_str(&format!(
        " SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; SET tcp_keepalives_count = {};",
        lease.keepalive_idle().as_secs(),
        lease.keepalive_interval().as_secs(),
        lease.keepalive_count(),
    ));
    if server_major >= 12 || server_major == 0 {
        sql.push_str(&format!(
            " SET tcp_user_timeout = {};",
            lease.duration().as_millis()
        ));
    }
    if server_major >= 14 {
        sql.push_str(&format!(
            " SET idle_session_timeout = {}; SET client_connection_check_interval = {};",
            lease.duration().as_millis(),
            lease.client_check_interval().as_millis(),
        ));
    }
    // PostgreSQL 17's transaction_timeout also bounds a single statement's implicit
    // transaction: set for the role or database, it would end followers' waits.
    if server_major >= 17 {
        sql.push_str(" SET transaction_timeout = 0;");
    }
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_of_the_wait_ends_a_little_before_the_refresh_and_zero_never_ends() {
        let timeout_of = |refresh: Duration| {
            let sql = wait_sql(-42, refresh);
            assert!(sql.contains("pg_advisory_lock(-42)"), "{sql}");
            let (_, rest) = sql
                .split_once("set_config('lock_timeout', '")
                .expect("the turn's lock_timeout");
            rest.split_once('\'').expect("quoted").0.to_owned()
        };
        assert_eq!(timeout_of(Duration::from_secs(10)), "9500");
        assert_eq!(timeout_of(Duration::from_millis(100)), "95");
        assert_eq!(timeout_of(Duration::ZERO), "0");
    }

    #[test]
    fn the_idle_session_timeout_is_set_only_where_it_exists() {
        let lease = Lease::new(Duration::from_secs(15));
        assert!(!setup_sql(&lease, 13).contains("idle_session_timeout"));
        let sql = setup_sql(&lease, 15);
        assert!(sql.contains("idle_session_timeout = 15000"), "{sql}");
        assert!(!sql.contains("transaction_timeout = 0;"), "{sql}");
        assert!(setup_sql(&lease, 17).contains("SET transaction_timeout = 0;"));
        assert!(sql.contains("synchronous_commit = on"), "{sql}");
        assert!(sql.contains("statement_timeout = 0"), "{sql}");
        assert!(sql.contains("lock_timeout = 0"), "{sql}");
    }
}
