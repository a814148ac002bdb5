//! A sharded lock on PostgreSQL (`--shards K`): K advisory locks of one name, held by the
//! replicas that run it, with two sessions per replica whatever K is.
//!
//! **Keys.** Every lock of a sharded name is a two-int4 advisory lock `(space, n)` (in
//! `pg_locks`: `classid` = space, `objid` = n, `objsubid` = 2), so none of them is ever the
//! bigint key of the plain `--lock NAME` (`objsubid` = 1). `space` is a hash of the plain key,
//! `hashtextextended('pgleader shards ' || key, 0)::bit(32)::int4` in SQL, so that locks with
//! neighbouring keys (or keys whose halves are alike: 0 and -1) do not share it. Then `n` is:
//!
//! | n | lock | mode | held by |
//! |---|---|---|---|
//! | 0 ≤ i < K | shard i | exclusive | the replica that runs shard i |
//! | −pid | the member of server process pid | exclusive | each replica's holder session |
//! | −2^31 + K | "runs with K shards" | shared | each replica's holder session |
//! | −2^30 + N | "takes at most N shards" | shared | a replica started with `--max-shards N` |
//!
//! A crontab's member (`pgleader cron`) also holds, shared, a "knows job n" marker
//! (`knows_space`, n) for each job of its file and a "defines job n so" marker
//! (`defines_space` of n, the job's definition), so that the others (and `status`) see which
//! jobs it knows and how it defines each.
//!
//! **Holder.** One session per replica (a [`ShardHolder`]) holds its member lock, its markers
//! and every shard it runs, LISTENs on the name's channel (`pgleader_shards_` and the space in
//! hex), and reads the roster (`pg_locks`, one statement) when notified and at every check.
//! Every change is notified: a member joins, gives a shard away, leaves, or is found gone.
//!
//! **Watcher.** Nobody is notified when a replica dies: the server just frees its locks. So
//! each replica's second session (a [`ShardWatcher`]) waits for a shared lock on the member lock
//! of the next member in id order (the roster's `successor`), in turns like a follower's wait
//! (no snapshot older than `--wait-refresh`), and is granted it the moment that member's holder
//! session ends; in the same statement it lets it go and notifies everyone. Every member is
//! watched by one other, so the death of any one is heard by all within a round trip or two.
//!
//! **Mismatch.** A replica takes its markers before it reads the roster: of two replicas that
//! start at once with different K, the later reader sees the other's marker. A replica that
//! sees a member with another K, or a session on the plain key of the same name, refuses to
//! join.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::election::ledger::{Definition, Ledger, LedgerError};
use crate::election::lock::LockKey;
use crate::election::participant::{Participant, ShardReplica, ShardsView};
use crate::election::shards::{
    Holder, HolderEvent, Items, JoinError, Listing, Member, Roster, Seen, ShardBackend, Watcher,
    kind_of,
};
use crate::election::{ConnectError, Fence, Session, SessionError};
use crate::postgres::PgBackend;
use crate::postgres::connect::Notifications;
use crate::postgres::describe::describe;
use crate::postgres::ledger::{Guard, PgLedger};
use crate::postgres::locks::{
    SHARD_CAP_BASE, SHARD_COUNT_BASE, defines_space, in_turns, knows_space, shard_space,
};
use crate::postgres::session::{PgSession, query_error};

/// The member locks' range: a server process id is below 2^22 on Linux.
const MEMBER_FLOOR: i32 = -(1 << 22);
/// Where the "runs with K shards" markers start.
const COUNT_BASE: i32 = SHARD_COUNT_BASE;
/// Where the "takes at most N shards" markers start.
const CAP_BASE: i32 = SHARD_CAP_BASE;
/// The largest shard count (and cap) the markers' ranges hold.
pub const MAX_SHARDS: u32 = 1 << 20;

/// The keys of one sharded lock (see the module's table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardKeys {
    space: i32,
    /// The first int4 of a crontab's "knows job n" markers.
    knows: i32,
    /// The plain key of the same name, to tell a replica that runs it without `--shards`.
    plain: LockKey,
}

impl ShardKeys {
    pub fn of(lock: &LockKey) -> ShardKeys {
        ShardKeys {
            space: shard_space(lock),
            knows: knows_space(lock),
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
    fn defines(&self, item: u32) -> i32 {
        defines_space(&self.plain, item)
    }

    /// The "defines" spaces of `items`, each with its job, as `pg_locks.classid` shows them.
    fn defines_of(&self, items: impl Iterator<Item = u32>) -> BTreeMap<u32, u32> {
        items
            .map(|item| (self.defines(item) as u32, item))
            .collect()
    }

    fn member(pid: i32) -> i32 {
        -pid
    }

    fn count_marker(shards: u32) -> i32 {
        COUNT_BASE + shards as i32
    }

    fn cap_marker(cap: u32) -> i32 {
        CAP_BASE + cap as i32
    }
}

/// Every granted advisory lock of the name, and the plain key's too (waiting or not), with
/// the server's clock and this session's server process: one row even when there is no lock.
const ROSTER_SQL: &str = "SELECT me.pid, me.now, l.pid, l.objid::int8, l.objsubid::int4, \
        l.mode = 'ExclusiveLock', l.classid::int8 \
    FROM (SELECT pg_catalog.pg_backend_pid() AS pid, pg_catalog.clock_timestamp() AS now) me \
    LEFT JOIN pg_catalog.pg_locks l ON l.locktype = 'advisory' \
        AND l.database = (SELECT oid FROM pg_catalog.pg_database \
            WHERE datname = pg_catalog.current_database()) \
        AND ((l.classid = $1 AND l.objsubid = 2 AND l.granted) \
            OR (l.classid = $2 AND l.objid = $3 AND l.objsubid = 1) \
            OR ((l.classid = $4 OR l.classid = ANY($5)) AND l.objsubid = 2 AND l.granted))";

/// Takes the "knows job n" markers of `$2`, shared, in space `$1`: never waits, since nobody
/// takes them exclusively.
const KNOW_SQL: &str = "SELECT pg_catalog.pg_advisory_lock_shared($1::int4, i) \
    FROM pg_catalog.unnest($2::int4[]) AS i";

/// Lets the markers of jobs `$2` go.
const FORGET_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock_shared($1::int4, i) \
    FROM pg_catalog.unnest($2::int4[]) AS i";

/// Takes the "defines job n so" markers: each (space `$1[i]`, definition `$2[i]`), shared.
const DEFINE_SQL: &str = "SELECT pg_catalog.pg_advisory_lock_shared(s, d) \
    FROM ROWS FROM (pg_catalog.unnest($1::int4[]), pg_catalog.unnest($2::int4[])) AS t(s, d)";

/// Lets the "defines" markers (space `$1[i]`, definition `$2[i]`) go.
const UNDEFINE_SQL: &str = "SELECT pg_catalog.pg_advisory_unlock_shared(s, d) \
    FROM ROWS FROM (pg_catalog.unnest($1::int4[]), pg_catalog.unnest($2::int4[])) AS t(s, d)";

/// Tries each shard, and tells the others when it took any: a take changes the holdings the
/// shares are computed from (who gets the one more), so a member that read the roster before
/// must read it again, or a shard dealt to it by the new roster would wait for its next check.
const TAKE_SQL: &str = "WITH tried AS MATERIALIZED (\
        SELECT i, pg_catalog.pg_try_advisory_lock($1::int4, i) AS won \
        FROM pg_catalog.unnest($2::int4[]) AS i), \
    told AS MATERIALIZED (SELECT pg_catalog.pg_notify($3, 'took') FROM tried WHERE won LIMIT 1) \
    SELECT i, won FROM tried, (SELECT count(*) FROM told) AS n";

/// Only sessions that still exist, carry this session's name and are in a wait's `DO` block,
/// as a watcher is: a pid reused since by another replica's holder is left alone.
const END_SESSIONS_SQL: &str = "SELECT pg_catalog.pg_terminate_backend(a.pid) \
    FROM pg_catalog.pg_stat_activity a \
    WHERE a.pid = ANY($1) \
        AND a.application_name = pg_catalog.current_setting('application_name') \
        AND a.query LIKE 'DO $pgleader$%'";

const GIVE_SQL: &str =
    "SELECT pg_catalog.pg_advisory_unlock($1::int4, $2::int4), pg_catalog.pg_notify($3, $4)";

/// What `status` reads of a sharded lock: every granted lock of its space, with the session
/// that holds it (one row per lock; a replica's session shows on each of its rows).
const STATUS_SQL: &str = "SELECT l.pid, l.objid::int8, l.mode = 'ExclusiveLock', \
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
const MARKERS_SQL: &str = "SELECT l.pid, l.classid::int8, l.objid::int8 \
    FROM pg_catalog.pg_locks l \
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = ANY($1) \
        AND l.database = (SELECT oid FROM pg_catalog.pg_database \
            WHERE datname = pg_catalog.current_database())";

/// Who holds which shard of the sharded lock of `lock`'s name, for `status`: `None` when no
/// replica runs it sharded. For a crontab, how each replica defines each job it knows too.
pub async fn view(client: &Client, lock: &LockKey) -> Result<Option<ShardsView>, String> {
    let keys = ShardKeys::of(lock);
    let space = keys.space() as u32;
    let rows = client
        .query_typed(STATUS_SQL, &[(&space, Type::OID)])
        .await
        .map_err(|err| format!("cannot read the shards from pg_locks: {}", describe(&err)))?;
    let mut replicas: BTreeMap<i32, ShardReplica> = BTreeMap::new();
    let (mut count, mut caps, mut holds) = (None, Vec::new(), Vec::new());
    for row in &rows {
        let (pid, objid, exclusive): (i32, i64, bool) = (row.get(0), row.get(1), row.get(2));
        match objid as u32 as i32 {
            n @ 0.. if exclusive => holds.push((pid, n as u32)),
            n @ MEMBER_FLOOR..0 if exclusive && ShardKeys::member(pid) == n => {
                replicas.insert(
                    pid,
                    ShardReplica {
                        member: pid,
                        participant: Participant {
                            backend_pid: pid,
                            granted: true,
                            application_name: row.get(3),
                            client_address: row.get(4),
                            client_port: row.get(5),
                            backend_start: row.get(6),
                            ..Participant::default()
                        },
                        cap: None,
                        holds: Vec::new(),
                        defines: BTreeMap::new(),
                    },
                );
            }
            n @ COUNT_BASE..CAP_BASE => {
                count.get_or_insert((n - COUNT_BASE) as u32);
            }
            n @ CAP_BASE..MEMBER_FLOOR => caps.push((pid, (n - CAP_BASE) as u32)),
            _ => {}
        }
    }
    let Some(count) = count else {
        return Ok(None);
    };
    for (pid, cap) in caps {
        if let Some(replica) = replicas.get_mut(&pid) {
            replica.cap = Some(cap);
        }
    }
    for (pid, shard) in holds {
        if let Some(replica) = replicas.get_mut(&pid) {
            replica.holds.push(shard);
        }
    }
    if count == 0 {
        read_definitions(client, &keys, &mut replicas).await?;
    }
    Ok(Some(ShardsView {
        count,
        replicas: replicas.into_values().collect(),
    }))
}

/// Reads how each crontab replica defines each job it knows: its "knows" markers first, then
/// the "defines" markers of those jobs.
async fn read_definitions(
    client: &Client,
    keys: &ShardKeys,
    replicas: &mut BTreeMap<i32, ShardReplica>,
) -> Result<(), String> {
    let markers = async |spaces: Vec<u32>| {
        client
            .query_typed(MARKERS_SQL, &[(&spaces, Type::OID_ARRAY)])
            .await
            .map_err(|err| {
                format!(
                    "cannot read the jobs' markers from pg_locks: {}",
                    describe(&err)
                )
            })
    };
    let mut knows: BTreeMap<i32, BTreeSet<u32>> = BTreeMap::new();
    for row in markers(vec![keys.knows as u32]).await? {
        let (pid, item): (i32, i64) = (row.get(0), row.get(2));
        knows.entry(pid).or_default().insert(item as u32);
    }
    let spaces = keys.defines_of(knows.values().flatten().copied());
    if spaces.is_empty() {
        return Ok(());
    }
    for row in markers(spaces.keys().copied().collect()).await? {
        let (pid, classid, definition): (i32, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let Some(&item) = spaces.get(&(classid as u32)) else {
            continue;
        };
        if let Some(replica) = replicas.get_mut(&pid)
            && knows.get(&pid).is_some_and(|known| known.contains(&item))
        {
            replica.defines.insert(item, definition as u32);
        }
    }
    Ok(())
}

/// Reads a roster from `ROSTER_SQL`'s rows, as seen by a member that shares out `items`.
/// `spaces` are the "defines" spaces of the reader's own jobs, each with its job.
fn read_roster(
    keys: &ShardKeys,
    items: &Items,
    spaces: &BTreeMap<u32, u32>,
    rows: &[tokio_postgres::Row],
) -> Result<Seen, SessionError> {
    let first = rows
        .first()
        .ok_or_else(|| SessionError::Query("the roster returned no row".into()))?;
    let server_time: jiff::Timestamp = first.get(1);
    let mut members: BTreeMap<i32, Member> = BTreeMap::new();
    let (mut holds, mut counts, mut caps, mut plain) = (Vec::new(), Vec::new(), Vec::new(), None);
    let mut knows: BTreeMap<i32, BTreeSet<u32>> = BTreeMap::new();
    let mut defines: BTreeMap<i32, BTreeMap<u32, u32>> = BTreeMap::new();
    for row in rows {
        let (Some(pid), Some(objid), Some(subid), Some(exclusive)) = (
            row.get::<_, Option<i32>>(2),
            row.get::<_, Option<i64>>(3),
            row.get::<_, Option<i32>>(4),
            row.get::<_, Option<bool>>(5),
        ) else {
            continue;
        };
        if subid == 1 {
            plain.get_or_insert(pid);
            continue;
        }
        let classid = row.get::<_, Option<i64>>(6);
        if classid == Some(i64::from(keys.knows as u32)) {
            knows.entry(pid).or_default().insert(objid as u32);
            continue;
        }
        if let Some(&item) = classid.and_then(|classid| spaces.get(&(classid as u32))) {
            defines.entry(pid).or_default().insert(item, objid as u32);
            continue;
        }
        let n = objid as u32 as i32;
        match n {
            0.. if exclusive => holds.push((pid, n as u32)),
            MEMBER_FLOOR..0 if exclusive && ShardKeys::member(pid) == n => {
                let holds = BTreeSet::new();
                members.insert(
                    pid,
                    Member {
                        id: pid,
                        cap: None,
                        holds,
                        knows: None,
                        defines: BTreeMap::new(),
                    },
                );
            }
            COUNT_BASE..CAP_BASE => counts.push((pid, (n - COUNT_BASE) as u32)),
            CAP_BASE..MEMBER_FLOOR => caps.push((pid, (n - CAP_BASE) as u32)),
            _ => {}
        }
    }
    for (pid, cap) in caps {
        if let Some(member) = members.get_mut(&pid) {
            member.cap = Some(cap);
        }
    }
    if let Items::Listed(_) = items {
        for member in members.values_mut() {
            member.knows = Some(knows.remove(&member.id).unwrap_or_default());
            member.defines = defines.remove(&member.id).unwrap_or_default();
        }
    }
    let marker = items.marker();
    let mut mismatch = counts
        .iter()
        .find(|(_, count)| *count != marker)
        .map(|(pid, count)| {
            format!(
                "the replica of server process {pid} runs this lock {}, this one {}: every replica \
             of a lock must run it the same way (stop them all to change it)",
                kind_of(*count),
                kind_of(marker)
            )
        });
    if let (None, Some(pid)) = (&mismatch, plain) {
        mismatch = Some(format!(
            "the replica of server process {pid} runs lock {} without --shards: a lock runs \
             either sharded on every replica or on none",
            keys.plain
        ));
    }
    let mut taken = BTreeSet::new();
    // A crontab's job held by a member that knows it and this replica does not (a rolling
    // deploy) still counts among the jobs shared out, so that every replica computes the same
    // shares whatever its own file holds.
    let mut unknown = BTreeSet::new();
    for (pid, shard) in holds {
        let known = items.contains(shard);
        match members.get_mut(&pid) {
            Some(member) if known || matches!(items, Items::Listed(_)) => {
                member.holds.insert(shard);
                if !known {
                    unknown.insert(shard);
                }
            }
            None if known => {
                taken.insert(shard);
            }
            _ => {}
        }
    }
    let items = match items {
        Items::Listed(listing) if !unknown.is_empty() => {
            Items::Listed(std::sync::Arc::new(Listing {
                items: listing.items.union(&unknown).copied().collect(),
                definitions: listing.definitions.clone(),
            }))
        }
        items => items.clone(),
    };
    Ok(Seen {
        roster: Roster {
            items,
            members: members.into_values().collect(),
        },
        taken,
        mismatch,
        server_time,
    })
}

/// The refusal of a plain replica's session where the replica of server process `pid` runs
/// the same lock with `--shards` (the session's set-up looks: `locks::sharded_replica`), so
/// that the two never both run the command.
pub(super) fn refusal(pid: i32, lock: &LockKey) -> ConnectError {
    ConnectError::Conflict(format!(
        "the replica of server process {pid} runs lock {lock} with --shards: a lock runs \
         either sharded on every replica or on none"
    ))
}

/// A replica's holder session: its membership, its markers and the shards it runs.
#[derive(Debug)]
pub struct ShardHolder {
    session: PgSession,
    keys: ShardKeys,
    items: Items,
    notifications: Notifications,
}

impl ShardHolder {
    /// Connects, joins the roster (member lock, markers, LISTEN) and refuses to go on beside a
    /// replica that runs the name otherwise; then tells the others it joined.
    pub async fn join(
        backend: &PgBackend,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<ShardHolder, JoinError> {
        assert!(
            items.marker() <= MAX_SHARDS && items.iter().all(|item| item < 1 << 30),
            "a shard count and job numbers are checked at start-up"
        );
        let mut session = backend.session(name).await?;
        let notifications = session
            .take_notifications()
            .ok_or_else(|| SessionError::Query("the session's notifications are gone".into()))?;
        let keys = ShardKeys::of(&backend.lock);
        let space = keys.space;
        let mut join = format!(
            "SET lock_timeout = '5s'; LISTEN {channel}; \
             SELECT pg_catalog.pg_advisory_lock({space}, -pg_catalog.pg_backend_pid()); \
             SELECT pg_catalog.pg_advisory_lock_shared({space}, {count});",
            channel = keys.channel(),
            count = ShardKeys::count_marker(items.marker()),
        );
        if let Some(cap) = cap {
            join.push_str(&format!(
                " SELECT pg_catalog.pg_advisory_lock_shared({space}, {});",
                ShardKeys::cap_marker(cap.min(MAX_SHARDS))
            ));
        }
        join.push_str(" SET lock_timeout = 0;");
        session
            .client()
            .batch_execute(&join)
            .await
            .map_err(query_error)?;
        let mut holder = ShardHolder {
            session,
            keys,
            items: Items::Listed(Default::default()),
            notifications,
        };
        match items {
            Items::Listed(_) => holder.know(items).await?,
            Items::Numbered(_) => holder.items = items.clone(),
        }
        let seen = Holder::roster(&holder).await?;
        if let Some(reason) = seen.mismatch {
            return Err(JoinError::Mismatch(reason));
        }
        holder
            .notify_others(&format!("joined {}", holder.id()))
            .await?;
        Ok(holder)
    }

    pub fn keys(&self) -> &ShardKeys {
        &self.keys
    }
}

impl Holder for ShardHolder {
    type Ledger = PgLedger;

    fn ledger(&self, job: &LockKey, item: u32, definition: &Definition) -> Option<PgLedger> {
        let guard = Guard::Item {
            space: self.keys.space,
            item,
        };
        Some(self.session.ledger_of(job, guard, definition))
    }

    async fn prepare_ledger(&self) -> Result<String, LedgerError> {
        let definition = Definition {
            expression: String::new(),
            timezone: String::new(),
        };
        self.session
            .ledger_of(&self.keys.plain, Guard::Plain, &definition)
            .prepare()
            .await
    }

    /// Takes the markers of the jobs added and lets those of the jobs removed go, then tells
    /// the others, so that they deal the new ones out (to a replica that knows them).
    async fn set_items(
        &mut self,
        items: Items,
        _finishing: std::collections::BTreeSet<u32>,
    ) -> Result<(), SessionError> {
        self.know(&items).await?;
        self.notify_others("knows").await
    }

    /// The holder session's server process: the member's id on the roster.
    fn id(&self) -> i32 {
        self.session.id()
    }

    /// The socket a keeper holds while a shard's command runs (see `Session::sockets`).
    fn sockets(&self) -> Vec<std::os::fd::RawFd> {
        self.session.sockets()
    }

    async fn next_event(&mut self) -> HolderEvent {
        let me = self.session.id();
        loop {
            // Biased: the end of the session comes before what it heard last.
            tokio::select! {
                biased;
                reason = self.session.ended() => return HolderEvent::Ended(reason),
                Some(notification) = self.notifications.recv() => {
                    if notification.process_id() != me {
                        return HolderEvent::Notified(notification.payload().to_owned());
                    }
                }
            }
        }
    }

    /// Reads the roster: who runs the name, what each holds, and the server's clock.
    fn roster(&self) -> impl Future<Output = Result<Seen, SessionError>> + 'static {
        let client = self.session.client().clone();
        let (keys, items, me) = (self.keys.clone(), self.items.clone(), self.id());
        async move {
            let spaces = match &items {
                Items::Listed(listing) => keys.defines_of(listing.items.iter().copied()),
                Items::Numbered(_) => BTreeMap::new(),
            };
            let defines: Vec<u32> = spaces.keys().copied().collect();
            let (space, classid, objid, knows) = (
                keys.space as u32,
                keys.plain.classid(),
                keys.plain.objid(),
                keys.knows as u32,
            );
            let rows = client
                .query_typed(
                    ROSTER_SQL,
                    &[
                        (&space, Type::OID),
                        (&classid, Type::OID),
                        (&objid, Type::OID),
                        (&knows, Type::OID),
                        (&defines, Type::OID_ARRAY),
                    ],
                )
                .await
                .map_err(query_error)?;
            let seen = read_roster(&keys, &items, &spaces, &rows)?;
            let pid: i32 = rows.first().map_or(0, |row| row.get(0));
            if pid != me {
                return Err(SessionError::Unsafe(format!(
                    "this session's server process changed from {me} to {pid}: a transaction \
                     pooler stands between"
                )));
            }
            Ok(seen)
        }
    }

    /// Tries to take each of `shards`; returns those it took, with their fence. Bounded by
    /// the connect timeout, as a follower's try is.
    async fn take(&self, shards: &[u32]) -> Result<(Vec<u32>, Option<Fence>), SessionError> {
        let wanted: Vec<i32> = shards.iter().map(|&shard| shard as i32).collect();
        let rows = self
            .session
            .client()
            .query_typed(
                TAKE_SQL,
                &[
                    (&self.keys.space, Type::INT4),
                    (&wanted, Type::INT4_ARRAY),
                    (&self.keys.channel(), Type::TEXT),
                ],
            )
            .await
            .map_err(query_error)?;
        let won: Vec<u32> = rows
            .iter()
            .filter(|row| row.get::<_, bool>(1))
            .map(|row| row.get::<_, i32>(0) as u32)
            .collect();
        if won.is_empty() {
            return Ok((won, None));
        }
        // One token for the shards taken together: each is greater than every earlier
        // holder's of each of them (see `PgSession::fence`).
        let fence = self.session.fence().await?;
        Ok((won, Some(fence)))
    }

    /// Releases a shard (its command is gone) and tells the others, who take it at once.
    async fn give(&self, shard: u32) -> Result<(), SessionError> {
        let payload = format!("gave {shard}");
        let channel = self.keys.channel();
        let shard = shard as i32;
        let row = self
            .session
            .client()
            .query_typed_one(
                GIVE_SQL,
                &[
                    (&self.keys.space, Type::INT4),
                    (&shard, Type::INT4),
                    (&channel, Type::TEXT),
                    (&payload, Type::TEXT),
                ],
            )
            .await
            .map_err(query_error)?;
        if row.get::<_, bool>(0) {
            Ok(())
        } else {
            Err(SessionError::Query(format!(
                "the server says this session did not hold shard {shard}"
            )))
        }
    }

    /// Leaves the roster: every lock of the name released and the others told, within
    /// `timeout`; then the session closes (which frees them anyway).
    /// `pg_terminate_backend`, which any role may use on its own sessions (see
    /// `END_SESSIONS_SQL`): a session gone already logs no warning.
    fn end_sessions(
        &self,
        ids: Vec<i32>,
    ) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let client = self.session.client().clone();
        async move {
            client
                .query_typed(END_SESSIONS_SQL, &[(&ids, Type::INT4_ARRAY)])
                .await
                .map_err(query_error)?;
            Ok(())
        }
    }

    async fn leave(self, timeout: Duration) -> Result<(), SessionError> {
        let sql = format!(
            "SELECT pg_catalog.pg_advisory_unlock_all(); \
             SELECT pg_catalog.pg_notify('{}', 'left {}')",
            self.keys.channel(),
            self.id()
        );
        match tokio::time::timeout(timeout, self.session.client().batch_execute(&sql)).await {
            Ok(result) => result.map_err(query_error),
            Err(_) => Err(SessionError::Query(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            ))),
        }
    }
}

impl ShardHolder {
    /// Holds the "knows job n" marker of each of a crontab's `items`, and of no other job.
    async fn know(&mut self, items: &Items) -> Result<(), SessionError> {
        let (Items::Listed(new), Items::Listed(old)) = (items, &self.items) else {
            self.items = items.clone();
            return Ok(());
        };
        let changes = |new: &BTreeSet<u32>, old: &BTreeSet<u32>| -> [Vec<i32>; 2] {
            [
                new.difference(old).map(|&n| n as i32).collect(),
                old.difference(new).map(|&n| n as i32).collect(),
            ]
        };
        let [know, forget] = changes(&new.items, &old.items);
        // A job defined anew holds its new marker before it lets the old one go.
        let pairs = |new: &BTreeMap<u32, u32>, old: &BTreeMap<u32, u32>| -> [Vec<i32>; 2] {
            let (spaces, definitions) = new
                .iter()
                .filter(|(item, definition)| old.get(item) != Some(definition))
                .map(|(&item, &definition)| (self.keys.defines(item), definition as i32))
                .unzip();
            [spaces, definitions]
        };
        let [define, undefine] = [
            pairs(&new.definitions, &old.definitions),
            pairs(&old.definitions, &new.definitions),
        ];
        // Each its own statement, so a roster read can fall between them: a job is defined
        // before it is known, and no longer known before its definition goes, so that no
        // reader ever finds a job known and not defined (which says "defined otherwise": one
        // warning per job at every start of a fleet, and another as it ended).
        let (client, space) = (self.session.client(), self.keys.knows);
        let by_pairs = |sql, [spaces, definitions]: [Vec<i32>; 2]| async move {
            if spaces.is_empty() {
                return Ok(());
            }
            let params: [(&(dyn ToSql + Sync), Type); 2] = [
                (&spaces, Type::INT4_ARRAY),
                (&definitions, Type::INT4_ARRAY),
            ];
            client.query_typed(sql, &params).await.map(drop)
        };
        let by_items = |sql, numbers: Vec<i32>| async move {
            if numbers.is_empty() {
                return Ok(());
            }
            let params: [(&(dyn ToSql + Sync), Type); 2] =
                [(&space, Type::INT4), (&numbers, Type::INT4_ARRAY)];
            client.query_typed(sql, &params).await.map(drop)
        };
        by_pairs(DEFINE_SQL, define).await.map_err(query_error)?;
        by_items(KNOW_SQL, know).await.map_err(query_error)?;
        by_items(FORGET_SQL, forget).await.map_err(query_error)?;
        by_pairs(UNDEFINE_SQL, undefine)
            .await
            .map_err(query_error)?;
        self.items = items.clone();
        Ok(())
    }

    async fn notify_others(&self, payload: &str) -> Result<(), SessionError> {
        let channel = self.keys.channel();
        self.session
            .client()
            .query_typed(
                "SELECT pg_catalog.pg_notify($1, $2)",
                &[(&channel, Type::TEXT), (&payload, Type::TEXT)],
            )
            .await
            .map_err(query_error)?;
        Ok(())
    }
}

/// A replica's second session: it waits for the end of one other member.
#[derive(Debug)]
pub struct ShardWatcher {
    session: PgSession,
    keys: ShardKeys,
    refresh: Duration,
}

impl ShardBackend for PgBackend {
    type Holder = ShardHolder;
    type Watcher = ShardWatcher;

    async fn join(
        &self,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<ShardHolder, JoinError> {
        ShardHolder::join(self, name, items, cap).await
    }

    async fn watcher(&self, name: &str) -> Result<ShardWatcher, ConnectError> {
        ShardWatcher::open(self, name).await
    }
}

impl ShardWatcher {
    pub async fn open(backend: &PgBackend, name: &str) -> Result<ShardWatcher, ConnectError> {
        Ok(ShardWatcher {
            session: backend.session(name).await?,
            keys: ShardKeys::of(&backend.lock),
            refresh: backend.wait_refresh,
        })
    }
}

impl Watcher for ShardWatcher {
    fn id(&self) -> i32 {
        self.session.id()
    }

    /// Resolves once the member whose holder session is server process `member` has gone
    /// (or left), having told every member. Without polling, in turns (see the module). As
    /// with a follower's wait, a watch that was dropped may have been granted meanwhile: the
    /// watcher must then be dropped too.
    fn watch(&self, member: i32) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let (space, key) = (self.keys.space, ShardKeys::member(member));
        let body = format!(
            "PERFORM pg_catalog.pg_advisory_lock_shared({space}, {key}); \
             PERFORM pg_catalog.pg_advisory_unlock_shared({space}, {key}); \
             PERFORM pg_catalog.pg_notify('{}', 'gone {member}');",
            self.keys.channel()
        );
        let sql = in_turns(self.refresh, &body);
        let client: Arc<Client> = self.session.client().clone();
        async move { client.batch_execute(&sql).await.map_err(query_error) }
    }
}

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
