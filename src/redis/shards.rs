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
//! **Keys.** Those of a lock named `NAME` (see `scripts.rs` for the braces):
//!
//! | key | type | what it holds |
//! |---|---|---|
//! | `pgleader:{NAME}:shard:<n>` | string, TTL the lease | item n's holder (shard n, or the job numbered n): `nonce=<hex> epoch=<n> member=<id> since=<unix seconds>` |
//! | `pgleader:{NAME}:member:<id>` | string, TTL the lease | member id's card: `nonce=<hex> shards=<K, or 0 for a crontab> cap=<N or none> [knows=<n,...> defines=<n:d,...>] client=<client id> session=<name>` (a crontab's member lists its jobs' numbers, and each job's number with its definition, `-` for none) |
//! | `pgleader:{NAME}:members` | set | the ids of the members |
//! | `pgleader:{NAME}:ids` | counter | the last member id handed out |
//! | `pgleader:{NAME}:epoch` | string | the last fencing token, shared with the plain lock of the name |
//! | `pgleader:{NAME}:job:<job>:runs`, `:rows`, `:born` | see `ledger.rs` | a crontab job's ledger |
//!
//! and two kinds of channel: `pgleader:{NAME}:shards`, on which every change is said (a member
//! joined, took, gave a shard, left, was found gone), and each member's liveness channel
//! `pgleader:{NAME}:alive:<nonce>`, as a single lock's session has.
//!
//! **Holder.** One connection per replica (a [`RedisShardHolder`]) subscribes to its liveness
//! channel and to the name's channel (RESP3 pushes, on the same connection), then joins: one
//! script that refuses a member with another K (or a plain replica of the name), hands out a
//! member id and writes its card. Each roster read is one script that also renews: it extends
//! this member's card and the shard keys that still name it (compare, then extend; a shard key
//! that is gone or foreign is never re-created, and the room stops that shard's command), drops
//! the members whose card expired or whose liveness channel has no subscriber (their connection
//! is gone: a keeper holds a crashed replica's socket until its commands' trees are dead), and
//! frees the shard keys of members that are gone. The keys' TTL is the lease, so a member whose
//! reads stop (a partition, a frozen pgleader) loses everything after a lease, never before its
//! own deadline plus its kill timeout.
//!
//! **Watcher.** Nobody is told when a connection closes. So each replica's second connection (a
//! [`RedisShardWatcher`]) asks, every `--check-interval`, whether the next member in id order
//! still has a subscriber on its liveness channel (one script); once it has none, the script
//! drops that member and says `gone` on the name's channel, and every member reads the roster,
//! which frees and deals out its shards. A crashed replica's shards move within a check
//! interval, as a single lock's do, long before the TTL.
//!
//! **A crontab job's ledger** ([`Holder::ledger`]) is the Redis ledger (`ledger.rs`) under the
//! job's keys, on the holder connection, guarded by the job's item key instead of a plain
//! lock's: a claim succeeds only while `pgleader:{NAME}:shard:<item>` carries this member's
//! nonce, checked in the claim's own script. A job that moved a moment ago (given away, or
//! freed because its member was found gone) is never claimed by its old owner again.
//!
//! An idle replica at its share sends two scripts per check interval: the roster read on its
//! holder connection, the watch on its watcher connection.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{PushKind, Script, Value};

use crate::election::ledger::{Definition, LedgerError};
use crate::election::lock::LockKey;
use crate::election::participant::{ShardReplica, ShardsView};
use crate::election::shards::{
    Holder, HolderEvent, Items, JoinError, Member, Roster, Seen, ShardBackend, Watcher, kind_of,
};
use crate::election::{ConnectError, Fence, SessionError};
use crate::redis::RedisBackend;
use crate::redis::connection::{self, Connection, Purpose, ServerInfo};
use crate::redis::ledger::{Guard, RedisLedger, participant};
use crate::redis::scripts::{self, Keys, ScriptArgs, millis, nonce};
use crate::redis::session::{no_answer, query_error, timestamp};

/// What every shard script shares. ARGV[1] is the lock key (every key's prefix), ARGV[2] the
/// member id of the caller ("0" when it has none yet), ARGV[3] its nonce, ARGV[4] the lease in
/// milliseconds. The scripts that read every item (roster, leave) take the marker in ARGV[5]:
/// K for shards `0..K`, or 0 for a crontab, whose job numbers follow in ARGV[6..], then the
/// word `retiring` and the jobs a reread removed whose last runs may still go on.
const PRELUDE: &str = r#"
local base, me, nonce, lease = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local t = redis.call('TIME')
local members = base .. ':members'
local function member_key(id) return base .. ':member:' .. id end
local function nonce_of(v) return string.match(v, '^nonce=(%x+) ') end
-- true/false from a liveness channel; nil when the ACL forbids asking (the TTL decides then).
local function connected(n)
  local ok, r = pcall(redis.call, 'PUBSUB', 'NUMSUB', base .. ':alive:' .. n)
  if not ok then return nil end
  return tonumber(r[2]) > 0
end
local function say(word) redis.call('PUBLISH', base .. ':shards', me .. ':' .. word) end
-- The items this member shares out, in order, as strings: up to the word 'retiring', after
-- which come the jobs a reread removed that this member may still hold (a last run finishing).
local function items()
  local list, k = {}, tonumber(ARGV[5])
  if k == 0 then
    for i = 6, #ARGV do
      if ARGV[i] == 'retiring' then break end
      list[#list + 1] = ARGV[i]
    end
  else
    for n = 0, k - 1 do list[n + 1] = tostring(n) end
  end
  return list
end
local function retiring()
  local list, after = {}, false
  for i = 6, #ARGV do
    if after then list[#list + 1] = ARGV[i] end
    if ARGV[i] == 'retiring' then after = true end
  end
  return list
end
-- Whether a member's card is a live one: not expired, and its connection not gone. The
-- caller's own only while it still carries the caller's nonce.
local function alive(id, card)
  if not card then return false end
  local n = nonce_of(card)
  if not n then return false end
  if id == me then return n == nonce end
  return connected(n) ~= false
end
-- Why a replica that runs the name without --shards is in the way: a holder of the plain lock
-- that is not known to be gone, or a waiter known to be connected; else nil.
local function plain_replica()
  local plain = redis.call('GET', base)
  if plain then
    local h = nonce_of(plain)
    if not h or connected(h) ~= false then return plain end
  end
  for _, n in ipairs(redis.call('LRANGE', base .. ':queue', 0, -1)) do
    if connected(n) == true then
      return redis.call('HGET', base .. ':who', n) or ('nonce=' .. n)
    end
  end
  return nil
end
-- Ends this member's membership if its card is still its own, and says so.
local function end_own_membership()
  local card = redis.call('GET', member_key(me))
  if card and nonce_of(card) == nonce then
    redis.call('DEL', member_key(me)); redis.call('SREM', members, me)
    say('left ' .. me)
  end
end
local function drop(id)
  redis.call('DEL', member_key(id)); redis.call('SREM', members, id)
  say('gone ' .. id)
end
-- The live members, id -> card; the others leave the roster, and everyone is told.
local function live_members()
  local live = {}
  for _, id in ipairs(redis.call('SMEMBERS', members)) do
    local card = redis.call('GET', member_key(id))
    if alive(id, card) then live[id] = card else drop(id) end
  end
  return live
end
"#;

/// Joins: refuses to if a live member runs the name otherwise (its card's `shards=` is not the
/// marker ARGV[5]), or a live plain replica holds or waits for the plain lock; else hands out a
/// member id and writes the card (`nonce=<hex> ` and ARGV[6]). Returns `{'joined', id}`, `{'mismatch', id, card}` or
/// `{'plain', what it holds or waits as}`.
const JOIN: &str = r#"
local live = live_members()
for id, card in pairs(live) do
  if string.match(card, ' shards=(%d+) ') ~= ARGV[5] then return {'mismatch', id, card} end
end
local plain = plain_replica()
if plain then return {'plain', plain} end
-- Never an id whose card or membership is still there (the counter may have been lost: an
-- eviction, a DEL), so that no two members ever answer to one id.
local id
repeat
  id = tostring(redis.call('INCR', base .. ':ids'))
until redis.call('EXISTS', member_key(id)) == 0 and redis.call('SISMEMBER', members, id) == 0
redis.call('SET', member_key(id), 'nonce=' .. nonce .. ' ' .. ARGV[6], 'PX', lease)
redis.call('SADD', members, id)
me = id
say('joined ' .. id)
return {'joined', id}
"#;

/// Reads the roster of this member's items (ARGV[5..], see the prelude) and renews what is
/// still this member's (its card and the item keys that name it, compare then extend), freeing
/// the item keys of members that are gone. Returns `{seconds, microseconds, {id, card, ...} of
/// the live members, the holder of each item in order (a member id, 0 when free, -1 when the
/// value is not a holder's), and what a live replica of the plain lock holds or waits as (one
/// that started at the very moment this one joined), or false}`. An item key counts as a
/// member's only while it carries that member's nonce. Whether a member runs the name
/// otherwise is read off the cards.
const ROSTER: &str = r#"
local live = live_members()
if live[me] and nonce_of(live[me]) == nonce then
  redis.call('PEXPIRE', member_key(me), lease)
end
local holders = {}
local keys = {}
-- A crontab's member reads the jobs the other members' cards say they know too, so that every
-- member counts the jobs held by others alike, whatever its own file holds.
local list = items()
if tonumber(ARGV[5]) == 0 then
  local seen = {}
  for _, n in ipairs(list) do seen[n] = true end
  for _, card in pairs(live) do
    local known = string.match(card, ' knows=([%d,]+) ')
    if known then
      for n in string.gmatch(known, '%d+') do
        if not seen[n] then seen[n] = true; list[#list + 1] = n end
      end
    end
  end
end
for i, n in ipairs(list) do keys[i] = base .. ':shard:' .. n end
local values = {}
if #keys > 0 then values = redis.call('MGET', unpack(keys)) end
for i = 1, #keys do
  local v = values[i]
  local h = 0
  if v then
    local hn, hid = string.match(v, '^nonce=(%x+) epoch=%d+ member=(%d+)')
    if not hn then
      h = -1
    elseif live[hid] and nonce_of(live[hid]) == hn then
      h = tonumber(hid)
      if hid == me then redis.call('PEXPIRE', keys[i], lease) end
    else
      -- Its member is gone (its connection closed, or its card expired): free.
      redis.call('DEL', keys[i])
    end
  end
  holders[i] = h
end
-- A job a reread removed stays this member's, renewed, while its last run finishes: the room
-- gives it up once that run has ended.
if live[me] and nonce_of(live[me]) == nonce then
  for _, n in ipairs(retiring()) do
    local key = base .. ':shard:' .. n
    local v = redis.call('GET', key)
    if v and nonce_of(v) == nonce then redis.call('PEXPIRE', key, lease) end
  end
end
local flat = {}
for id, card in pairs(live) do
  table.insert(flat, id); table.insert(flat, card)
end
return {t[1], t[2], flat, holders, plain_replica() or false, list}
"#;

/// Rewrites this member's card (ARGV[6], after its nonce) where it is still its own, keeping
/// its TTL, and tells the others (a crontab reread: the jobs it knows and how it defines them).
/// Returns 1, or 0 when the card is no longer this member's.
const RECARD: &str = r#"
local card = redis.call('GET', member_key(me))
if not card or nonce_of(card) ~= nonce then return 0 end
redis.call('SET', member_key(me), 'nonce=' .. nonce .. ' ' .. ARGV[6], 'KEEPTTL')
say('knows')
return 1
"#;

/// Takes each of the shards ARGV[5..] that nobody holds, with one new epoch for them all:
/// `max(last + 1, the server's clock in microseconds)`, as the plain lock's acquire. Only for a
/// member whose card is still its own. Returns `{member (0/1), epoch, seconds, microseconds,
/// {shards taken}}`.
const TAKE: &str = r#"
local card = redis.call('GET', member_key(me))
if not card or nonce_of(card) ~= nonce then return {0, '0', t[1], t[2], {}} end
local won, epoch = {}, nil
for i = 5, #ARGV do
  local key = base .. ':shard:' .. ARGV[i]
  if redis.call('EXISTS', key) == 0 then
    if not epoch then
      local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
      epoch = string.format('%.0f',
        math.max(tonumber(redis.call('GET', base .. ':epoch') or '0') + 1, micros))
      redis.call('SET', base .. ':epoch', epoch)
    end
    redis.call('SET', key, 'nonce=' .. nonce .. ' epoch=' .. epoch .. ' member=' .. me ..
      ' since=' .. t[1], 'PX', lease)
    table.insert(won, tonumber(ARGV[i]))
  end
end
if epoch then say('took') end
return {1, epoch or '0', t[1], t[2], won}
"#;

/// Releases shard ARGV[5] if it is still this member's, and says so. Returns 1 if it was.
const GIVE: &str = r#"
local key = base .. ':shard:' .. ARGV[5]
local v = redis.call('GET', key)
if not v or nonce_of(v) ~= nonce then return 0 end
redis.call('DEL', key)
say('gave ' .. ARGV[5])
return 1
"#;

/// The keeper's farewell for item ARGV[5] of a replica whose pgleader died, once that item's
/// command's whole tree is gone: [`GIVE`], then, for shards (ARGV[7] is their count), if no
/// shard names this member any more (this was its last keeper), the membership too, so that
/// the others deal out its share at once rather than when their watcher finds its connection
/// gone. A crontab's member says -1 there: the keeper of its membership ends it, once every
/// command's keeper is done (a job added or removed since a command started, or one with no
/// run, would be missing from a list given here). Answers `{given (0/1), ARGV[6]}`, the marker the keeper
/// waits for (see `supervise/farewell.rs`).
const FAREWELL: &str = r#"
local function give()
"#;

const FAREWELL_END: &str = r#"
end
local given = give()
local k = tonumber(ARGV[7])
-- A crontab's: the keeper of the membership ends it, once the last command's keeper is done.
if k < 0 then return {given, ARGV[6]} end
for n = 0, k - 1 do
  local v = redis.call('GET', base .. ':shard:' .. n)
  if v and nonce_of(v) == nonce then return {given, ARGV[6]} end
end
end_own_membership()
return {given, ARGV[6]}
"#;

/// The farewell of a crontab member's keeper of its membership, said once pgleader and every
/// command of the replica are gone (see `keeper::hold_membership`): the membership, if it is
/// still this member's. The others then read the roster, which frees every item key naming a
/// member that is gone, and deal the jobs out at once. Answers `{1, ARGV[5]}`, the marker the
/// keeper waits for.
const MEMBERSHIP_FAREWELL: &str = r#"
end_own_membership()
return {1, ARGV[5]}
"#;

/// Releases every item (ARGV[5..], see the prelude) that is still this member's, and the
/// membership; says so.
const LEAVE: &str = r#"
local list = items()
for _, n in ipairs(retiring()) do list[#list + 1] = n end
for _, n in ipairs(list) do
  local key = base .. ':shard:' .. n
  local v = redis.call('GET', key)
  if v and nonce_of(v) == nonce then redis.call('DEL', key) end
end
-- The membership only while it is still this member's: never another's that took the id.
local card = redis.call('GET', member_key(me))
if not card or nonce_of(card) == nonce then
  if card then redis.call('DEL', member_key(me)) end
  redis.call('SREM', members, me)
  say('left ' .. me)
end
return 1
"#;

/// The watcher's question about member ARGV[5]: 1 once it is no longer a live member (its card
/// expired, or its connection is gone: then it leaves the roster and everyone is told), else 0.
const GONE: &str = r#"
local id = ARGV[5]
if redis.call('SISMEMBER', members, id) == 0 then return 1 end
local card = redis.call('GET', member_key(id))
if alive(id, card) then return 0 end
drop(id)
return 1
"#;

/// Whether a live sharded replica runs the name: the card of one, or false.
const SHARDED: &str = r#"
for _, id in ipairs(redis.call('SMEMBERS', members)) do
  local card = redis.call('GET', member_key(id))
  if alive(id, card) then return 'member=' .. id .. ' ' .. card end
end
return false
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{body}"))
}

/// The farewell's whole text: the keeper sends it with `EVAL` (it cannot fall back from
/// `EVALSHA`).
static FAREWELL_SOURCE: LazyLock<String> =
    LazyLock::new(|| format!("{PRELUDE}{FAREWELL}{GIVE}{FAREWELL_END}"));
static MEMBERSHIP_FAREWELL_SOURCE: LazyLock<String> =
    LazyLock::new(|| format!("{PRELUDE}{MEMBERSHIP_FAREWELL}"));
static JOIN_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(JOIN));
static ROSTER_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(ROSTER));
static TAKE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(TAKE));
static GIVE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(GIVE));
static LEAVE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(LEAVE));
static GONE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(GONE));
static SHARDED_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(SHARDED));
static RECARD_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RECARD));

/// The keys of a sharded name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardKeys {
    /// `pgleader:{NAME}`: every key starts with it.
    pub base: String,
}

impl ShardKeys {
    pub fn of(lock: &LockKey) -> ShardKeys {
        ShardKeys {
            base: Keys::of(lock).lock,
        }
    }

    pub fn shard(&self, n: u32) -> String {
        format!("{}:shard:{n}", self.base)
    }

    pub fn member(&self, id: i32) -> String {
        format!("{}:member:{id}", self.base)
    }

    pub fn members(&self) -> String {
        format!("{}:members", self.base)
    }

    /// The channel every change is said on.
    pub fn channel(&self) -> String {
        format!("{}:shards", self.base)
    }

    pub fn alive(&self, nonce: &str) -> String {
        format!("{}:alive:{nonce}", self.base)
    }
}

/// Who holds which shard of the sharded lock whose keys start with `base`, for `status`: the
/// members whose card has not expired, with the shards whose keys name them; `None` when no
/// replica runs it sharded. It changes nothing.
pub async fn view(
    conn: &mut MultiplexedConnection,
    base: &str,
) -> Result<Option<ShardsView>, String> {
    let keys = ShardKeys {
        base: base.to_owned(),
    };
    let fail = |err: redis::RedisError| format!("cannot read the shards: {err}");
    let mut ids: Vec<i32> = redis::cmd("SMEMBERS")
        .arg(keys.members())
        .query_async(conn)
        .await
        .map_err(fail)?;
    ids.sort_unstable();
    if ids.is_empty() {
        return Ok(None);
    }
    let cards: Vec<Option<String>> = redis::cmd("MGET")
        .arg(ids.iter().map(|id| keys.member(*id)).collect::<Vec<_>>())
        .query_async(conn)
        .await
        .map_err(fail)?;
    let live: Vec<(i32, String)> = ids
        .into_iter()
        .zip(cards)
        .filter_map(|(id, card)| Some((id, card?)))
        .collect();
    let Some(count) = live
        .iter()
        .find_map(|(_, card)| scripts::field(card, "shards")?.parse::<u32>().ok())
    else {
        return Ok(None);
    };
    // A crontab's items are its jobs' numbers, which no card lists: its item keys say.
    let items: Vec<u32> = if count == 0 {
        item_keys(conn, &keys).await.map_err(fail)?
    } else {
        (0..count).collect()
    };
    let holders: Vec<Option<String>> = if items.is_empty() {
        Vec::new()
    } else {
        redis::cmd("MGET")
            .arg(items.iter().map(|n| keys.shard(*n)).collect::<Vec<_>>())
            .query_async(conn)
            .await
            .map_err(fail)?
    };
    let replicas = live
        .iter()
        .map(|(id, card)| ShardReplica {
            member: *id,
            participant: participant(card, true),
            cap: scripts::field(card, "cap").and_then(|cap| cap.parse().ok()),
            holds: items
                .iter()
                .zip(&holders)
                .filter(|(_, value)| {
                    value
                        .as_deref()
                        .and_then(|value| scripts::field(value, "member"))
                        == Some(id.to_string().as_str())
                })
                .map(|(n, _)| *n)
                .collect(),
            defines: definitions_in(card),
        })
        .collect();
    Ok(Some(ShardsView { count, replicas }))
}

/// The numbers of the item keys of a name that exist now, in order (`SCAN`, for `status`).
async fn item_keys(
    conn: &mut MultiplexedConnection,
    keys: &ShardKeys,
) -> redis::RedisResult<Vec<u32>> {
    let prefix = keys.shard(0);
    let prefix = &prefix[..prefix.len() - 1];
    let pattern = format!("{}*", scripts::glob_escape(prefix));
    let found: BTreeSet<u32> = scripts::scan(conn, &pattern)
        .await?
        .iter()
        .filter_map(|key| key.strip_prefix(prefix)?.parse::<u32>().ok())
        .collect();
    Ok(found.into_iter().collect())
}

/// What every script of one member is given.
#[derive(Clone, Debug)]
struct Args {
    keys: ShardKeys,
    id: String,
    nonce: String,
    lease: Duration,
    /// What this member shares out: what its roster reads and its leave releases.
    items: Items,
    /// The jobs the last reread removed whose last runs were still going on (`finishing`, see
    /// [`Holder::set_items`]): while its card is its own, its roster read renews each whose key
    /// still carries its nonce, and its leave releases them. Kept until the next reread: a job
    /// given up since has no key to renew.
    retiring: BTreeSet<u32>,
}

impl Args {
    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        invocation
            .arg(&self.keys.base)
            .arg(&self.id)
            .arg(&self.nonce)
            .arg(millis(self.lease));
        invocation
    }

    /// A keeper's farewell: `EVAL` of the whole `source` (the keeper cannot fall back from
    /// `EVALSHA`) with the prelude's arguments, as [`Args::invocation`] gives them to a script.
    fn farewell(&self, source: &str) -> redis::Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(source)
            .arg(0)
            .arg(&self.keys.base)
            .arg(&self.id)
            .arg(&self.nonce)
            .arg(millis(self.lease));
        eval
    }

    /// A script that reads every item (roster, leave): the marker, then a crontab's job
    /// numbers (see the prelude).
    fn over_items<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.invocation(script);
        invocation.arg(self.items.marker());
        if let Items::Listed(jobs) = &self.items {
            for job in &jobs.items {
                invocation.arg(*job);
            }
            if !self.retiring.is_empty() {
                invocation.arg("retiring");
                for job in &self.retiring {
                    invocation.arg(*job);
                }
            }
        }
        invocation
    }
}

/// A replica's holder connection: its membership and the items it runs.
#[derive(Debug)]
pub struct RedisShardHolder {
    connection: Connection,
    args: Args,
    me: i32,
    /// `--max-shards`, which its card says.
    cap: Option<u32>,
    /// What a crontab job's ledger needs beside the connection (see [`Holder::ledger`]).
    ledger: LedgerSettings,
}

/// What a crontab job's ledger is given, from the backend's settings.
#[derive(Clone, Debug)]
struct LedgerSettings {
    /// How this member names itself: `client=<id> session=<name>`.
    card: String,
    poll: Duration,
    user_name: Option<String>,
    timeout: Duration,
}

impl RedisShardHolder {
    /// Connects, subscribes (its liveness channel, the name's channel) and joins, refusing to
    /// beside a replica that runs the name otherwise.
    pub async fn join(
        backend: &RedisBackend,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<RedisShardHolder, JoinError> {
        let marker = items.marker();
        let mut connection =
            connection::open(&backend.server, name, Some(&backend.lease), Purpose::Elect).await?;
        let keys = ShardKeys::of(&backend.lock);
        let nonce = nonce();
        let timeout = backend.server.connect_timeout;
        let subscribe = async {
            connection.conn.subscribe(keys.alive(&nonce)).await?;
            connection.conn.subscribe(keys.channel()).await
        };
        match tokio::time::timeout(timeout, subscribe).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) if err.code() == Some("NOPERM") => {
                return Err(ConnectError::Permanent(
                    "the Redis ACL does not authorize SUBSCRIBE, which shards need so that \
                     others can tell a replica is connected (grant +subscribe or +@pubsub)"
                        .into(),
                )
                .into());
            }
            Ok(Err(err)) => return Err(connection::classify(&backend.server, &err).into()),
            Err(_) => return Err(no_answer(timeout).into()),
        }
        let named = scripts::card(connection.client_id, name);
        let card = card_of(items, cap, &named);
        let mut args = Args {
            keys,
            id: "0".into(),
            nonce,
            lease: backend.lease.duration(),
            items: items.clone(),
            retiring: BTreeSet::new(),
        };
        let mut conn = connection.conn.clone();
        let joined: Vec<String> = tokio::time::timeout(
            timeout,
            args.invocation(&JOIN_SCRIPT)
                .arg(marker)
                .arg(&card)
                .invoke_async(&mut conn),
        )
        .await
        .map_err(|_| no_answer(timeout))?
        .map_err(query_error)?;
        match joined.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["joined", id] => {
                let me = id.parse().map_err(|_| {
                    SessionError::Query(format!("the server handed out member id {id:?}"))
                })?;
                args.id = id.to_owned();
                Ok(RedisShardHolder {
                    connection,
                    args,
                    me,
                    cap,
                    ledger: LedgerSettings {
                        card: named,
                        poll: backend.poll,
                        user_name: backend.user_name.clone(),
                        timeout: backend.ledger_timeout,
                    },
                })
            }
            ["mismatch", id, card] => Err(JoinError::Mismatch(runs_otherwise(id, card, marker))),
            ["plain", value] => Err(JoinError::Mismatch(format!(
                "the replica ({}) runs lock {} without --shards: a lock runs either sharded on \
                 every replica or on none",
                who(value),
                backend.lock
            ))),
            _ => Err(SessionError::Query(format!("the join script returned {joined:?}")).into()),
        }
    }

    pub fn keys(&self) -> &ShardKeys {
        &self.args.keys
    }
}

/// A member's card after its nonce: what it runs (`shards=`), its cap, and for a crontab the
/// jobs its file has and how it defines each (`knows=`: numbers, `defines=`: `number:definition`
/// pairs, comma-separated, `-` for none), then how it names itself (`client=... session=...`).
fn card_of(items: &Items, cap: Option<u32>, named: &str) -> String {
    let cap = cap.map_or("none".to_owned(), |cap| cap.to_string());
    let listed = match items {
        Items::Listed(listing) => {
            let list = |numbers: Vec<String>| match numbers.is_empty() {
                true => "-".to_owned(),
                false => numbers.join(","),
            };
            format!(
                " knows={} defines={}",
                list(listing.items.iter().map(u32::to_string).collect()),
                list(
                    listing
                        .definitions
                        .iter()
                        .map(|(item, definition)| format!("{item}:{definition}"))
                        .collect()
                )
            )
        }
        Items::Numbered(_) => String::new(),
    };
    format!("shards={} cap={cap}{listed} {named}", items.marker())
}

/// How a card says its member defines each job it knows (`defines=`), by job number.
fn definitions_in(card: &str) -> BTreeMap<u32, u32> {
    field(card, "defines")
        .unwrap_or("-")
        .split(',')
        .filter_map(|pair| {
            let (item, definition) = pair.split_once(':')?;
            Some((item.parse().ok()?, definition.parse().ok()?))
        })
        .collect()
}

/// The numbers a card lists in `field` (`knows=`).
fn numbers_in(card: &str, field_name: &str) -> BTreeSet<u32> {
    field(card, field_name)
        .unwrap_or("-")
        .split(',')
        .filter_map(|number| number.parse().ok())
        .collect()
}

/// What a roster read covered: a crontab member's own jobs and those the others' cards know,
/// in the order the script read them; shards as they are.
fn seen_items(items: &Items, read: &[u32]) -> Items {
    match items {
        Items::Listed(listing) => {
            Items::Listed(std::sync::Arc::new(crate::election::shards::Listing {
                items: read.iter().copied().collect(),
                definitions: listing.definitions.clone(),
            }))
        }
        Items::Numbered(_) => items.clone(),
    }
}

/// Why a member that shares out what `marker` says cannot run beside member `id`, whose card
/// is `card`: the two run the name in different ways (two shard counts, or shards and a
/// crontab).
fn runs_otherwise(id: &str, card: &str, marker: u32) -> String {
    let theirs = match field(card, "shards").and_then(|count| count.parse().ok()) {
        Some(count) => kind_of(count),
        None => "otherwise".to_owned(),
    };
    format!(
        "the replica of member {id} ({}) runs this lock {theirs}, this one {}: every replica of \
         a lock must run it the same way (stop them all to change it)",
        who(card),
        kind_of(marker)
    )
}

/// The name of a crontab job, from the key its ledger rows are kept under on PostgreSQL:
/// `<fleet key>` U+001F `<job>` (the sharded room's `jobs::job_key`).
fn job_name(job: &LockKey) -> String {
    match job.name() {
        Some(name) => name
            .rsplit_once('\u{1f}')
            .map_or(name, |(_, job)| job)
            .to_owned(),
        None => job.key().to_string(),
    }
}

/// A `key=value` field of a card or a value; `session` runs to the end.
fn field<'a>(value: &'a str, name: &str) -> Option<&'a str> {
    crate::redis::scripts::field(value, name)
}

/// How a card or a plain lock's value names its replica: `client <id>, session <name>`.
fn who(value: &str) -> String {
    format!(
        "client {}, session {}",
        field(value, "client").unwrap_or("?"),
        field(value, "session").unwrap_or("?")
    )
}

impl Holder for RedisShardHolder {
    type Ledger = RedisLedger;

    /// The job's ledger under `pgleader:{NAME}:job:<job>` on the holder connection, its claims
    /// guarded by the job's item key (see the module).
    fn ledger(&self, job: &LockKey, item: u32, definition: &Definition) -> Option<RedisLedger> {
        let fleet = Keys {
            lock: self.args.keys.base.clone(),
        };
        let args = ScriptArgs::new(
            fleet.job(&job_name(job)),
            self.args.nonce.clone(),
            self.ledger.card.clone(),
            self.args.lease,
            self.ledger.poll,
        );
        let ledger = RedisLedger::new(
            self.connection.conn.clone(),
            args,
            definition.clone(),
            self.ledger.user_name.clone(),
            self.connection.client_id,
            self.ledger.timeout,
        );
        Some(ledger.guarded_by(Guard::Item {
            shard: self.args.keys.shard(item),
        }))
    }

    /// Nothing to create: a job's keys appear with its first row.
    async fn prepare_ledger(&self) -> Result<String, LedgerError> {
        Ok(format!(
            "Redis keys {}:job:<job>:runs and :rows",
            self.args.keys.base
        ))
    }

    /// The next roster reads (and renews) these items, and `finishing` while they still name
    /// this member (see `Args::retiring`); the card says the jobs this member knows and how it
    /// defines them, and the others are told.
    async fn set_items(
        &mut self,
        items: Items,
        finishing: BTreeSet<u32>,
    ) -> Result<(), SessionError> {
        let card = card_of(&items, self.cap, &self.ledger.card);
        self.args.retiring = finishing;
        self.args.items = items;
        let mut conn = self.connection.conn.clone();
        let mine: i64 = self
            .args
            .invocation(&RECARD_SCRIPT)
            .arg(self.args.items.marker())
            .arg(&card)
            .invoke_async(&mut conn)
            .await
            .map_err(query_error)?;
        if mine == 0 {
            return Err(SessionError::Query(
                "this replica's card is no longer its own".into(),
            ));
        }
        Ok(())
    }

    /// The member id the join handed out (`pgleader:{NAME}:member:<id>`).
    fn id(&self) -> i32 {
        self.me
    }

    /// The socket under the holder connection: while a keeper holds it, a crashed replica's
    /// liveness channel stays subscribed, so no other takes its shards before its commands'
    /// trees are gone.
    fn sockets(&self) -> Vec<std::os::fd::RawFd> {
        self.connection.open_socket().into_iter().collect()
    }

    /// The socket, with the release of `shard` for its keeper to send if pgleader dies. The
    /// keepers of all this replica's shards share the one socket; each says its own farewell.
    /// A crontab's job keepers release only their job (see [`FAREWELL`]): the keeper of the
    /// membership ([`Holder::lend_membership`]) ends the membership after the last of them.
    fn lend(&self, shard: u32) -> Vec<crate::election::socket::Lent> {
        let args = &self.args;
        self.connection
            .lend(|marker| {
                let mut farewell = args.farewell(&FAREWELL_SOURCE);
                farewell.arg(shard).arg(marker);
                match &args.items {
                    Items::Numbered(count) => farewell.arg(*count),
                    Items::Listed(_) => farewell.arg(-1),
                };
                farewell.get_packed_command()
            })
            .into_iter()
            .collect()
    }

    /// The socket, with the end of this membership for its keeper to say if pgleader dies.
    fn lend_membership(&self) -> Vec<crate::election::socket::Lent> {
        let args = &self.args;
        self.connection
            .lend(|marker| {
                args.farewell(&MEMBERSHIP_FAREWELL_SOURCE)
                    .arg(marker)
                    .get_packed_command()
            })
            .into_iter()
            .collect()
    }

    async fn next_event(&mut self) -> HolderEvent {
        let channel = self.args.keys.channel();
        loop {
            match self.connection.pushes.recv().await {
                None => return HolderEvent::Ended("the connection was closed".into()),
                Some(push) if push.kind == PushKind::Disconnection => {
                    return HolderEvent::Ended("the server closed the connection".into());
                }
                Some(push) if push.kind == PushKind::Message => {
                    let text = |value: Option<&Value>| match value {
                        Some(Value::BulkString(bytes)) => {
                            Some(String::from_utf8_lossy(bytes).into_owned())
                        }
                        Some(Value::SimpleString(text)) => Some(text.clone()),
                        _ => None,
                    };
                    if text(push.data.first()).as_deref() != Some(channel.as_str()) {
                        continue;
                    }
                    let Some(message) = text(push.data.get(1)) else {
                        continue;
                    };
                    if let Some((sender, word)) = message.split_once(':')
                        && sender != self.args.id
                    {
                        return HolderEvent::Notified(word.to_owned());
                    }
                }
                Some(_) => {}
            }
        }
    }

    /// Reads the roster and renews this member's card and shards (see the module).
    fn roster(&self) -> impl Future<Output = Result<Seen, SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        async move {
            let (seconds, micros, flat, holders, plain, read): Answer = args
                .over_items(&ROSTER_SCRIPT)
                .invoke_async(&mut conn)
                .await
                .map_err(query_error)?;
            let read = match &args.items {
                Items::Listed(_) => read,
                Items::Numbered(_) => args.items.iter().collect(),
            };
            let items = seen_items(&args.items, &read);
            let mut seen = read_roster(&items, &read, &flat, &holders, timestamp(seconds, micros))?;
            if let Some(plain) = plain {
                seen.mismatch = Some(format!(
                    "a replica runs this lock without --shards ({plain}): a lock runs either \
                     sharded on every replica or on none"
                ));
            }
            Ok(seen)
        }
    }

    /// Takes each of `shards` that nobody holds: those taken, with their fence.
    async fn take(&self, shards: &[u32]) -> Result<(Vec<u32>, Option<Fence>), SessionError> {
        let mut conn = self.connection.conn.clone();
        let mut invocation = self.args.invocation(&TAKE_SCRIPT);
        for shard in shards {
            invocation.arg(*shard);
        }
        let (member, epoch, seconds, micros, won): (i64, i64, i64, i64, Vec<u32>) = invocation
            .invoke_async(&mut conn)
            .await
            .map_err(query_error)?;
        if member != 1 {
            return Err(SessionError::Query(format!(
                "this replica's member key {} is no longer its own",
                self.args.keys.member(self.me)
            )));
        }
        if won.is_empty() {
            return Ok((won, None));
        }
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .map_err(query_error)?;
        let uptime = ServerInfo::parse(&info).uptime.unwrap_or(Duration::ZERO);
        Ok((
            won,
            Some(Fence {
                epoch,
                server_time: timestamp(seconds, micros),
                since_server_reset: uptime,
            }),
        ))
    }

    async fn give(&self, shard: u32) -> Result<(), SessionError> {
        let mut conn = self.connection.conn.clone();
        let given: i64 = self
            .args
            .invocation(&GIVE_SCRIPT)
            .arg(shard)
            .invoke_async(&mut conn)
            .await
            .map_err(query_error)?;
        if given == 1 {
            Ok(())
        } else {
            Err(SessionError::Query(format!(
                "the server says this replica did not hold shard {shard}"
            )))
        }
    }

    /// Releases every shard and the membership, says so, then closes the connection.
    async fn leave(self, timeout: Duration) -> Result<(), SessionError> {
        let mut conn = self.connection.conn.clone();
        let invocation = self.args.over_items(&LEAVE_SCRIPT);
        let leave = invocation.invoke_async::<i64>(&mut conn);
        match tokio::time::timeout(timeout, leave).await {
            Ok(result) => result.map(|_| ()).map_err(query_error),
            Err(_) => Err(no_answer(timeout)),
        }
    }

    /// Nothing to do: a watcher's connection closes when it is dropped, and the server forgets
    /// its script at once.
    fn end_sessions(
        &self,
        _ids: Vec<i32>,
    ) -> impl Future<Output = Result<(), SessionError>> + 'static {
        std::future::ready(Ok(()))
    }
}

/// The roster script's answer: the server's clock, the live members, each item's holder, and
/// a live plain replica of the name.
type Answer = (i64, i64, Vec<String>, Vec<i64>, Option<String>, Vec<u32>);

/// Reads the roster script's answer, as seen by a member that shares out `items`: the holders
/// are in the order of `read` (the items the script read: for a crontab, this member's jobs
/// and those the others' cards know), and a member whose card says it runs the name
/// otherwise is a mismatch.
fn read_roster(
    items: &Items,
    read: &[u32],
    flat: &[String],
    holders: &[i64],
    server_time: jiff::Timestamp,
) -> Result<Seen, SessionError> {
    let mut members: BTreeMap<i32, Member> = BTreeMap::new();
    let mut mismatch = None;
    for pair in flat.chunks(2) {
        let [id, card] = pair else {
            return Err(SessionError::Query(format!(
                "the roster's members are not in pairs: {flat:?}"
            )));
        };
        let Ok(id) = id.parse::<i32>() else {
            continue;
        };
        if field(card, "shards") != Some(items.marker().to_string().as_str()) {
            mismatch.get_or_insert_with(|| runs_otherwise(&id.to_string(), card, items.marker()));
        }
        let cap = field(card, "cap").and_then(|cap| cap.parse().ok());
        let listed = matches!(items, Items::Listed(_));
        members.insert(
            id,
            Member {
                id,
                cap,
                holds: BTreeSet::new(),
                knows: listed.then(|| numbers_in(card, "knows")),
                defines: definitions_in(card),
            },
        );
    }
    let mut taken = BTreeSet::new();
    for (&shard, holder) in read.iter().zip(holders) {
        match *holder {
            0 => {}
            id => match i32::try_from(id).ok().and_then(|id| members.get_mut(&id)) {
                Some(member) => {
                    member.holds.insert(shard);
                }
                None => {
                    taken.insert(shard);
                }
            },
        }
    }
    Ok(Seen {
        roster: Roster {
            items: items.clone(),
            members: members.into_values().collect(),
        },
        taken,
        mismatch,
        server_time,
    })
}

/// Refuses a plain replica's session where replicas run the same lock with `--shards`, so
/// that the two never both run the command: one round trip when a plain replica connects.
pub(crate) async fn refuse_beside_shards(
    conn: &mut MultiplexedConnection,
    lock: &LockKey,
) -> Result<(), ConnectError> {
    let args = Args {
        keys: ShardKeys::of(lock),
        id: "0".into(),
        nonce: String::new(),
        lease: Duration::ZERO,
        items: Items::default(),
        retiring: BTreeSet::new(),
    };
    let card: Option<String> = match args.invocation(&SHARDED_SCRIPT).invoke_async(conn).await {
        Ok(card) => card,
        // An ACL that keeps this user from the shards' keys (or from scripts) keeps it from
        // running shards too; the lock's own scripts say what it refuses.
        Err(err) if matches!(query_error(err.clone()), SessionError::Unsafe(_)) => None,
        Err(err) => return Err(ConnectError::Transient(err.to_string())),
    };
    match card {
        Some(card) => Err(ConnectError::Conflict(format!(
            "the replica of member {} ({}) runs lock {lock} {}: a lock runs either sharded on \
             every replica or on none",
            field(&card, "member").unwrap_or("?"),
            who(&card),
            match field(&card, "shards").and_then(|count| count.parse().ok()) {
                Some(0) => kind_of(0),
                _ => "with --shards".to_owned(),
            }
        ))),
        None => Ok(()),
    }
}

/// A replica's second connection: it asks whether one other member is gone.
#[derive(Debug)]
pub struct RedisShardWatcher {
    connection: Connection,
    args: Args,
    poll: Duration,
    timeout: Duration,
}

impl RedisShardWatcher {
    pub async fn open(backend: &RedisBackend, name: &str) -> Result<Self, ConnectError> {
        let connection =
            connection::open(&backend.server, name, Some(&backend.lease), Purpose::Elect).await?;
        Ok(RedisShardWatcher {
            connection,
            args: Args {
                keys: ShardKeys::of(&backend.lock),
                id: "0".into(),
                nonce: String::new(),
                lease: backend.lease.duration(),
                items: Items::default(),
                retiring: BTreeSet::new(),
            },
            poll: backend.poll,
            timeout: backend.server.connect_timeout,
        })
    }
}

impl Watcher for RedisShardWatcher {
    /// The watcher connection's client id.
    fn id(&self) -> i32 {
        i32::try_from(self.connection.client_id).unwrap_or(i32::MAX)
    }

    /// Resolves once member `member` is gone (or left), every member told: asks once per
    /// `--check-interval`, each ask bounded by the connect timeout plus that interval.
    fn watch(&self, member: i32) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        let (poll, bound) = (self.poll, self.timeout + self.poll);
        async move {
            loop {
                let gone: i64 = tokio::time::timeout(
                    bound,
                    args.invocation(&GONE_SCRIPT)
                        .arg(member)
                        .invoke_async(&mut conn),
                )
                .await
                .map_err(|_| no_answer(bound))?
                .map_err(query_error)?;
                if gone == 1 {
                    return Ok(());
                }
                tokio::time::sleep(poll).await;
            }
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_s_item_keys_are_scanned_for_literally() {
        assert_eq!(
            scripts::glob_escape("pgleader:{a*[b]?\\}:shard:"),
            "pgleader:{a\\*\\[b\\]\\?\\\\}:shard:"
        );
    }

    #[test]
    fn the_keys_are_the_documented_ones() {
        let keys = ShardKeys::of(&LockKey::from_name("orders"));
        assert_eq!(keys.shard(3), "pgleader:{orders}:shard:3");
        assert_eq!(keys.member(7), "pgleader:{orders}:member:7");
        assert_eq!(keys.members(), "pgleader:{orders}:members");
        assert_eq!(keys.channel(), "pgleader:{orders}:shards");
        assert_eq!(keys.alive("00ff"), "pgleader:{orders}:alive:00ff");
    }

    #[test]
    fn a_roster_names_each_shard_s_holder_and_what_no_member_holds() {
        let flat: Vec<String> = [
            "2",
            "nonce=aa shards=4 cap=none client=9 session=x",
            "5",
            "nonce=bb shards=4 cap=1 client=10 session=y",
        ]
        .map(str::to_owned)
        .to_vec();
        let seen = read_roster(
            &Items::Numbered(4),
            &[0, 1, 2, 3],
            &flat,
            &[2, 0, 5, -1],
            jiff::Timestamp::UNIX_EPOCH,
        )
        .expect("a roster");
        assert_eq!(
            seen.roster.members,
            vec![
                Member {
                    id: 2,
                    cap: None,
                    holds: BTreeSet::from([0]),
                    knows: None,
                    defines: BTreeMap::new(),
                },
                Member {
                    id: 5,
                    cap: Some(1),
                    holds: BTreeSet::from([2]),
                    knows: None,
                    defines: BTreeMap::new(),
                },
            ]
        );
        assert_eq!(seen.taken, BTreeSet::from([3]));
        assert_eq!(seen.free(), vec![1]);
    }
}
