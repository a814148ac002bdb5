//! The keys of a sharded lock on PostgreSQL and every statement a replica sends on them, in one
//! place, as `locks.rs` has the plain lock's: the table of ranges (see `shards/mod.rs`) is only
//! safe while every reader and writer agrees on it.

use std::collections::BTreeMap;

use crate::election::lock::LockKey;
use crate::postgres::locks::{
    SHARD_CAP_BASE, SHARD_COUNT_BASE, defines_space, knows_space, markers_space, shard_space,
};

/// The member locks' range: a server process id is below 2^22 on Linux.
pub(super) const MEMBER_FLOOR: i32 = -(1 << 22);
/// Where the "runs with K shards" markers start.
pub(super) const COUNT_BASE: i32 = SHARD_COUNT_BASE;
/// Where the "takes at most N shards" markers start.
pub(super) const CAP_BASE: i32 = SHARD_CAP_BASE;
/// The largest shard count (and cap) the markers' ranges hold.
pub const MAX_SHARDS: u32 = 1 << 20;

/// The keys of one sharded lock (see the table in `shards/mod.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardKeys {
    pub(super) space: i32,
    /// The first int4 of a crontab's "knows job n" markers.
    pub(super) knows: i32,
    /// The first int4 of a crontab member's markers digest.
    pub(super) markers: i32,
    /// The plain key of the same name, to tell a replica that runs it without `--shards`.
    pub(super) plain: LockKey,
}

impl ShardKeys {
    pub fn of(lock: &LockKey) -> ShardKeys {
        ShardKeys {
            space: shard_space(lock),
            knows: knows_space(lock),
            markers: markers_space(lock),
            plain: lock.clone(),
        }
    }

    /// The first int4 of every key of this name (`pg_locks.classid`).
    pub fn space(&self) -> i32 {
        self.space
    }

    /// The channel every member LISTENs on.
    pub fn channel(&self) -> String {
        format!("pgleader_shards_{:08x}", self.space as u32)
    }

    /// The first int4 of a crontab's "defines job `item` so" marker.
    pub(super) fn defines(&self, item: u32) -> i32 {
        defines_space(&self.plain, item)
    }

    /// The "defines" spaces of `items`, each with its job, as `pg_locks.classid` shows them.
    pub(super) fn defines_of(&self, items: impl Iterator<Item = u32>) -> BTreeMap<u32, u32> {
        items
            .map(|item| (self.defines(item) as u32, item))
            .collect()
    }

    pub(super) fn member(pid: i32) -> i32 {
        -pid
    }

    pub(super) fn count_marker(shards: u32) -> i32 {
        COUNT_BASE + shards as i32
    }

    pub(super) fn cap_marker(cap: u32) -> i32 {
        CAP_BASE + cap as i32
    }
}

/// Every granted advisory lock of the name, and the plain key's too (waiting or not), with
/// the server's clock and this session's server process: one row even when there is no lock.
/// A crontab member's markers ("knows" in `$4`, "defines" in the spaces `$5`) come only for
/// the members whose digest (in space `$6`) is not the one the reader sends for them (`$7`
/// the members, `$8` their digests): read from the same copy of the lock table. The last
/// column is the answer's digest (an md5 of its lock rows, in order): when it is `$9`, the one
/// the reader got last time, the lock rows are left out and the one row says "the same as
/// then", so that a member at rest reads one row per check rather than a row per job.
pub(super) const ROSTER_SQL: &str = "WITH l AS MATERIALIZED (\
        SELECT l.pid, l.objid, l.objsubid, l.mode, l.classid FROM pg_catalog.pg_locks l \
        WHERE l.locktype = 'advisory' \
        AND l.database = (SELECT oid FROM pg_catalog.pg_database \
            WHERE datname = pg_catalog.current_database()) \
        AND ((l.classid = $1 AND l.objsubid = 2 AND l.granted) \
            OR (l.classid = $2 AND l.objid = $3 AND l.objsubid = 1) \
            OR ((l.classid = $4 OR l.classid = $6 OR l.classid = ANY($5)) \
                AND l.objsubid = 2 AND l.granted))), \
    unchanged AS (SELECT l.pid FROM l \
        JOIN ROWS FROM (pg_catalog.unnest($7::int4[]), pg_catalog.unnest($8::oid[])) AS c(pid, digest) \
            ON l.pid = c.pid AND l.objid = c.digest \
        WHERE l.classid = $6 AND l.objsubid = 2), \
    r AS MATERIALIZED (SELECT * FROM l WHERE NOT ((l.classid = $4 OR l.classid = ANY($5)) \
        AND l.pid IN (SELECT pid FROM unchanged))), \
    d AS (SELECT pg_catalog.md5(pg_catalog.string_agg(r.pid::text || ' ' || r.classid::text \
        || ' ' || r.objid::text || ' ' || r.objsubid::text || ' ' || r.mode, ',' \
        ORDER BY r.pid, r.classid, r.objid, r.objsubid, r.mode)) AS digest FROM r) \
    SELECT me.pid, me.now, r.pid, r.objid::int8, r.objsubid::int4, r.mode = 'ExclusiveLock', \
        r.classid::int8, d.digest \
    FROM (SELECT pg_catalog.pg_backend_pid() AS pid, pg_catalog.clock_timestamp() AS now) me \
    CROSS JOIN d LEFT JOIN r ON d.digest IS DISTINCT FROM $9::text";

/// Lets the member's markers digest `$2` in space `$1` go, before its markers change: while
/// they do it shows none, and a reader reads them all and keeps none of them.
pub(super) const UNDIGEST_SQL: &str =
    "SELECT pg_catalog.pg_advisory_unlock_shared($1::int4, $2::int4)";

/// Holds the member's markers digest `$2` in space `$1`, shared, once its markers are what
/// the digest says: a reader that finds one digest reads settled markers under it.
pub(super) const DIGEST_SQL: &str = "SELECT pg_catalog.pg_advisory_lock_shared($1::int4, $2::int4)";

/// Takes the "knows job n" markers of `$2`, shared, in space `$1`: never waits, since nobody
/// takes them exclusively.
pub(super) const KNOW_SQL: &str = "SELECT pg_catalog.pg_advisory_lock_shared($1::int4, i) \
    FROM pg_catalog.unnest($2::int4[]) AS i";

/// Lets the markers of jobs `$2` go.
pub(super) const FORGET_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock_shared($1::int4, i) \
    FROM pg_catalog.unnest($2::int4[]) AS i";

/// Takes the "defines job n so" markers: each (space `$1[i]`, definition `$2[i]`), shared.
pub(super) const DEFINE_SQL: &str = "SELECT pg_catalog.pg_advisory_lock_shared(s, d) \
    FROM ROWS FROM (pg_catalog.unnest($1::int4[]), pg_catalog.unnest($2::int4[])) AS t(s, d)";

/// Lets the "defines" markers (space `$1[i]`, definition `$2[i]`) go.
pub(super) const UNDEFINE_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock_shared(s, d) \
    FROM ROWS FROM (pg_catalog.unnest($1::int4[]), pg_catalog.unnest($2::int4[])) AS t(s, d)";

/// Tries each shard, and tells the others when it took any: a take changes the holdings the
/// shares are computed from (who gets the one more), so a member that read the roster before
/// must read it again, or a shard dealt to it by the new roster would wait for its next check.
pub(super) const TAKE_SQL: &str = "WITH tried AS MATERIALIZED (\
        SELECT i, pg_catalog.pg_try_advisory_lock($1::int4, i) AS won \
        FROM pg_catalog.unnest($2::int4[]) AS i), \
    told AS MATERIALIZED (SELECT pg_catalog.pg_notify($3, 'took') FROM tried WHERE won LIMIT 1) \
    SELECT i, won FROM tried, (SELECT count(*) FROM told) AS n";

/// Only sessions that still exist, carry this session's name and are in a wait's `DO` block,
/// as a watcher is: a pid reused since by another replica's holder is left alone.
pub(super) const END_SESSIONS_SQL: &str = "SELECT pg_catalog.pg_terminate_backend(a.pid) \
    FROM pg_catalog.pg_stat_activity a \
    WHERE a.pid = ANY($1) \
        AND a.application_name = pg_catalog.current_setting('application_name') \
        AND a.query LIKE 'DO $pgleader$%'";

/// Releases each of the shards `$2` this session holds, and tells the others once (`$4`) if
/// it released any; answers the shards it released.
pub(super) const GIVE_SQL: &str = "WITH given AS MATERIALIZED (\
        SELECT i, pg_catalog.pg_advisory_unlock($1::int4, i) AS held \
        FROM pg_catalog.unnest($2::int4[]) AS i), \
    told AS MATERIALIZED (SELECT pg_catalog.pg_notify($3, $4) FROM given WHERE held LIMIT 1) \
    SELECT i FROM given, (SELECT count(*) FROM told) AS n WHERE held";

/// What `status` reads of a sharded lock: every granted lock of its space, with the session
/// that holds it (one row per lock; a replica's session shows on each of its rows).
pub(super) const STATUS_SQL: &str = "SELECT l.pid, l.objid::int8, l.mode = 'ExclusiveLock', \
        a.application_name, host(a.client_addr), a.client_port, \
        to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') \
    FROM pg_catalog.pg_locks l \
    LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
    WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objsubid = 2 \
        AND l.database = (SELECT oid FROM pg_catalog.pg_database \
            WHERE datname = pg_catalog.current_database()) \
    ORDER BY l.pid, l.objid";

/// What `status` reads of a crontab's markers: the granted locks in the spaces `$1`, with
/// their holder.
pub(super) const MARKERS_SQL: &str = "SELECT l.pid, l.classid::int8, l.objid::int8 \
    FROM pg_catalog.pg_locks l \
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = ANY($1) \
        AND l.database = (SELECT oid FROM pg_catalog.pg_database \
            WHERE datname = pg_catalog.current_database())";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_ranges_do_not_overlap() {
        assert!(ShardKeys::count_marker(MAX_SHARDS) < CAP_BASE);
        assert!(ShardKeys::cap_marker(MAX_SHARDS) < MEMBER_FLOOR);
        assert!(ShardKeys::member(1 << 22) >= MEMBER_FLOOR);
        assert!(ShardKeys::member(1) < 0);
    }

    #[test]
    fn the_space_is_a_hash_of_the_plain_key_and_names_the_channel() {
        let space = |key: i64| ShardKeys::of(&LockKey::from_id(key)).space();
        // Keys whose halves are alike, and neighbours, get spaces of their own.
        let spaces: std::collections::BTreeSet<i32> = [0, -1, 1, 2, 1 << 32, (1 << 32) | 1]
            .into_iter()
            .map(space)
            .collect();
        assert_eq!(spaces.len(), 6);
        // A name's space is its key's.
        let named = LockKey::from_name("orders");
        assert_eq!(ShardKeys::of(&named).space(), space(named.key()));
        let keys = ShardKeys::of(&LockKey::from_id(10));
        assert_eq!(
            keys.channel(),
            format!("pgleader_shards_{:08x}", keys.space() as u32)
        );
    }
}
