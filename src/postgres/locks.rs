//! How statements name the lock in `pg_locks`: one description, used by the leader's check,
//! the ledger's guard, the agreement's and `status`'s lists of participants.
//!
//! A bigint advisory key shows as `classid` = its high 32 bits, `objid` = its low 32 bits and
//! `objsubid = 1` (the two-int4 form uses 2), in the current database only: a check on `objid`
//! alone would be wrong for keys at or above 2^32 and for negative keys.

/// `pg_locks` under the alias `l`, for a `FROM` clause.
pub const LOCK_ROWS: &str = "pg_catalog.pg_locks l";

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
