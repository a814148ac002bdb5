//! A sharded lock on one Redis server (`--shards K`, or a crontab's jobs under `pgleader
//! cron`): a key per item of one name, held by the replicas that run it, with two connections
//! per replica whatever the number of items.
//!
//! The items are shards `0..K`, or a crontab's jobs, each by its 30-bit number
//! (`election/shards.rs`, `Items`). A crontab's member says `shards=0` on its card and hands its
//! roster read the numbers of the jobs it knows, so it reads, renews and takes only those: in a
//! rolling deploy a job only some replicas know runs on one of those. Shards and a crontab on
//! one name refuse each other, as two shard counts do.
//!
//! **Keys.** Those of a lock named `NAME` (see `redis/scripts.rs` for the braces):
//!
//! | key | type | what it holds |
//! |---|---|---|
//! | `pgleader:{NAME}:shard:<n>` | string, TTL ten leases (10 minutes at least) | item n's holder (shard n, or the job numbered n): `nonce=<hex> epoch=<n> member=<id> since=<unix seconds>` |
//! | `pgleader:{NAME}:member:<id>` | string, TTL the lease | member id's card: `nonce=<hex> shards=<K, or 0 for a crontab> cap=<N or none> [knows=<n,...> defines=<n:d,...>] client=<client id> session=<name>` (a crontab's member lists its jobs' numbers, and each job's number with its definition, `-` for none) |
//! | `pgleader:{NAME}:members` | set | the ids of the members |
//! | `pgleader:{NAME}:renewed:<id>` | string, TTL half an item key's | there while member id's item keys need no renewal |
//! | `pgleader:{NAME}:ids` | counter | the last member id handed out |
//! | `pgleader:{NAME}:epoch` | string | the last fencing token, shared with the plain lock of the name |
//! | `pgleader:{NAME}:job:<job>:runs`, `:rows`, `:born` | see `redis/ledger.rs` | a crontab job's ledger |
//!
//! and two kinds of channel: `pgleader:{NAME}:shards`, on which every change is said (a member
//! joined, took, gave a shard, left, was found gone), and each member's liveness channel
//! `pgleader:{NAME}:alive:<nonce>`, as a single lock's session has.
//!
//! **Holder.** One connection per replica (a [`RedisShardHolder`]) subscribes to its liveness
//! channel and to the name's channel (RESP3 pushes, on the same connection), then joins: one
//! script that refuses a member with another K (or a plain replica of the name), hands out a
//! member id and writes its card. Each roster read is one script that also renews: it extends
//! this member's card, and every half of an item key's TTL the shard keys that still name it
//! (compare, then extend; a shard key that is gone or foreign is never re-created, and the room
//! stops that shard's command), drops the members whose card expired or whose liveness channel
//! has no subscriber (their connection is gone: a keeper holds a crashed replica's socket until
//! its commands' trees are dead), and frees the shard keys of members that are gone. A shard
//! key is its member's only while the member's card is live, and the card's TTL is the lease,
//! so a member whose reads stop (a partition, a frozen pgleader) loses everything after a
//! lease (at the next read of any other member), never before its own deadline plus its kill
//! timeout; a shard key's own TTL only clears what an abandoned name leaves. A read whose
//! answer is the same as the caller's last (its digest, sent with the read) comes back as
//! "the same": a member at rest is sent a digest, not every card and holder.
//!
//! **Watcher.** Nobody is told when a connection closes. So each replica's second connection (a
//! [`RedisShardWatcher`]) asks, every `--check-interval`, whether the next member in id order
//! still has a subscriber on its liveness channel (one script); once it has none, the script
//! drops that member and says `gone` on the name's channel, and every member reads the roster,
//! which frees and deals out its shards. A crashed replica's shards move within a check
//! interval, as a single lock's do, long before the TTL.
//!
//! **A crontab job's ledger** (`Holder::ledger`, in `holder.rs`) is the Redis ledger
//! (`redis/ledger.rs`) under the job's keys, on the holder connection, guarded by the job's
//! item key instead of a plain lock's: a claim succeeds only while
//! `pgleader:{NAME}:shard:<item>` carries this member's nonce, checked in the claim's own
//! script. A job that moved a moment ago (given away, or freed because its member was found
//! gone) is never claimed by its old owner again.
//!
//! An idle replica at its share sends two scripts per check interval: the roster read on its
//! holder connection, the watch on its watcher connection.
//!
//! The parts, the same as on PostgreSQL (`postgres/shards/`): the keys, the Lua and its
//! arguments (`scripts.rs`), the cards and the roster's reading, and a plain replica's refusal
//! beside sharded ones (`roster.rs`), the holder connection with a crontab's ledgers and the
//! keepers' farewells (`holder.rs`), the watcher (`watcher.rs`) and what `status` reads
//! (`status.rs`).

mod holder;
mod roster;
mod scripts;
mod status;
mod watcher;

pub use holder::RedisShardHolder;
pub(crate) use roster::refuse_beside_shards;
pub use scripts::ShardKeys;
pub use status::view;
pub use watcher::RedisShardWatcher;

use crate::election::ConnectError;
use crate::election::shards::{Items, JoinError, ShardBackend};
use crate::redis::RedisBackend;

impl ShardBackend for RedisBackend {
    type Holder = RedisShardHolder;
    type Watcher = RedisShardWatcher;

    async fn join(
        &self,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<RedisShardHolder, JoinError> {
        RedisShardHolder::join(self, name, items, cap).await
    }

    async fn watcher(&self, name: &str) -> Result<RedisShardWatcher, ConnectError> {
        RedisShardWatcher::open(self, name).await
    }
}
