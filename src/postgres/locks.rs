//! How statements name the lock in `pg_locks`: one description, used by the leader's check,
//! the ledger's guard, the agreement's and `status`'s lists of participants; and where the
//! locks of the same name run with `--shards` live (`postgres/shards.rs` has the whole table),
//! for a plain session's set-up to tell whether sharded replicas run its name.
//!
//! A bigint advisory key shows as `classid` = its high 32 bits, `objid` = its low 32 bits and
//! `objsubid = 1` (the two-int4 form uses 2), in the current database only: a check on `objid`
//! alone would be wrong for keys at or above 2^32 and for negative keys.

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

/// A scalar subquery: the server process of a session that runs `lock`'s name with
/// `--shards` (it holds a "runs with K shards" marker), or null.
pub fn sharded_replica(lock: &LockKey) -> String {
    // pg_locks shows an int4 in objid as an oid: the markers' range as unsigned numbers.
    format!(
        "(SELECT l.pid FROM {LOCK_ROWS} WHERE l.locktype = 'advisory' AND l.granted \
         AND l.objsubid = 2 AND l.classid = '{}'::oid \
         AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()) \
         AND l.objid >= '{}'::oid AND l.objid < '{}'::oid LIMIT 1)",
        shard_space(lock) as u32,
        SHARD_COUNT_BASE as u32,
        SHARD_CAP_BASE as u32
    )
}

/// The condition on `l` that selects the advisory lock whose classid and objid are the
/// statement's parameters `classid` and `objid` (`$1`, `$2`, ...), in this database.
pub fn this_lock(classid: &str, objid: &str) -> String {
    format!(
        "l.locktype = 'advisory' \
         AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()) \
         AND l.classid = {classid} AND l.objid = {objid} AND l.objsubid = 1"
    )
}

/// True when this session holds that lock: the condition of the leader's check, and of every
/// write a leader makes to the ledger, so that a session that lost the lock a moment ago
/// changes nothing.
pub fn held_here(classid: &str, objid: &str) -> String {
    format!(
        "EXISTS (SELECT FROM {LOCK_ROWS} WHERE {} AND l.granted AND l.pid = pg_catalog.pg_backend_pid())",
        this_lock(classid, objid)
    )
}

/// The channel a leader of `lock` LISTENs on for step-down requests (`pg_notify`'s first
/// argument): a plain identifier, so LISTEN needs no quoting.
pub fn step_down_channel(lock: &LockKey) -> String {
    format!("pgleader_step_down_{:016x}", lock.key() as u64)
}
