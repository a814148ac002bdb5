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
//! jobs it knows and how it defines each. Beside them it holds one "markers digest"
//! (`markers_space`, a digest of its jobs and their definitions), changed after its markers:
//! a member's markers are read again only when its digest is not the one read with them
//! last (it reread its crontab, or it is new), so that a roster read of a 1,000-job fleet
//! carries its holdings, not its 3,000 markers per member at every check.
//!
//! **Holder.** One session per replica (a [`PgShardHolder`]) holds its member lock, its markers
//! and every shard it runs, LISTENs on the name's channel (`pgleader_shards_` and the space in
//! hex), and reads the roster (`pg_locks`, one statement) when notified and at every check.
//! Every change is notified: a member joins, gives a shard away, leaves, or is found gone.
//!
//! **Watcher.** Nobody is notified when a replica dies: the server just frees its locks. So
//! each replica's second session (a [`PgShardWatcher`]) waits for a shared lock on the member lock
//! of the next member in id order (the roster's `successor`), in turns like a follower's wait
//! (no snapshot older than `--wait-refresh`), and is granted it the moment that member's holder
//! session ends; in the same statement it lets it go and notifies everyone. Every member is
//! watched by one other, so the death of any one is heard by all within a round trip or two.
//!
//! **Mismatch.** A replica takes its markers before it reads the roster: of two replicas that
//! start at once with different K, the later reader sees the other's marker. A replica that
//! sees a member with another K, or a session on the plain key of the same name, refuses to
//! join.
//!
//! The parts, the same on Redis (`redis/shards/`): the keys and every statement on them
//! (`statements.rs`), the roster's reading and a plain replica's refusal beside it (`roster.rs`),
//! the holder session with a crontab's markers and ledgers (`holder.rs`), the watcher
//! (`watcher.rs`) and what `status` reads (`status.rs`).

mod holder;
mod roster;
mod statements;
mod status;
mod watcher;

pub use holder::PgShardHolder;
pub(crate) use roster::refusal;
pub use statements::{MAX_SHARDS, ShardKeys};
pub use status::view;
pub use watcher::PgShardWatcher;

use crate::election::ConnectError;
use crate::election::shards::{Items, JoinError, ShardBackend};
use crate::postgres::PgBackend;

impl ShardBackend for PgBackend {
    type Holder = PgShardHolder;
    type Watcher = PgShardWatcher;

    async fn join(
        &self,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<PgShardHolder, JoinError> {
        PgShardHolder::join(self, name, items, cap).await
    }

    async fn watcher(&self, name: &str) -> Result<PgShardWatcher, ConnectError> {
        PgShardWatcher::open(self, name).await
    }
}
