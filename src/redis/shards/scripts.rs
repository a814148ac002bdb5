//! The keys of a sharded name on Redis and the Lua every member runs on them, with the
//! arguments each script is given, in one place, as `redis/scripts.rs` has the plain lock's:
//! the scripts share one prelude, and the key layout (see `shards/mod.rs`) is only safe while
//! every script and every reader agrees on it.

use std::collections::BTreeSet;
use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use crate::election::lock::LockKey;
use crate::election::shards::Items;
use crate::redis::scripts::{Keys, millis};

/// What every shard script shares. ARGV[1] is the lock key (every key's prefix), ARGV[2] the
/// member id of the caller ("0" when it has none yet), ARGV[3] its nonce, ARGV[4] the lease in
/// milliseconds. The scripts that read every item (roster, leave) take the marker in ARGV[5]:
/// K for shards `0..K`, or 0 for a crontab, whose job numbers follow in ARGV[6..], then the
/// word `retiring` and the jobs a reread removed whose last runs may still go on, then (the
/// roster read) the word `since` and the digest of the caller's last answer.
///
/// An item key lives `item_ttl` (ten leases, 10 minutes at least): what makes it its
/// member's is the member's live card (its lease), and a key whose member is gone is freed by
/// the next roster read of any member; its TTL only clears what an abandoned name leaves
/// behind, so that a member at rest renews its items every half of it rather than at every
/// read.
const PRELUDE: &str = r#"
local base, me, nonce, lease = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local item_ttl = math.max(10 * tonumber(lease), 600000)
local t = redis.call('TIME')
local members = base .. ':members'
local function member_key(id) return base .. ':member:' .. id end
local function renewed_key(id) return base .. ':renewed:' .. id end
local function nonce_of(v) return string.match(v, '^nonce=(%x+) ') end
-- true/false from a liveness channel; nil when the ACL forbids asking (the TTL decides then).
local function connected(n)
  local ok, r = pcall(redis.call, 'PUBSUB', 'NUMSUB', base .. ':alive:' .. n)
  if not ok then return nil end
  return tonumber(r[2]) > 0
end
local function say(word) redis.call('PUBLISH', base .. ':shards', me .. ':' .. word) end
-- Releases shard n if it is still this member's: whether it was.
local function release(n)
  local key = base .. ':shard:' .. n
  local v = redis.call('GET', key)
  if not v or nonce_of(v) ~= nonce then return false end
  redis.call('DEL', key)
  return true
end
-- The items this member shares out, in order, as strings: up to the word 'retiring', after
-- which come the jobs a reread removed that this member may still hold (a last run finishing).
local function items()
  local list, k = {}, tonumber(ARGV[5])
  if k == 0 then
    for i = 6, #ARGV do
      if ARGV[i] == 'retiring' or ARGV[i] == 'since' then break end
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
    if ARGV[i] == 'since' then break end
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
    redis.call('DEL', member_key(me), renewed_key(me)); redis.call('SREM', members, me)
    say('left ' .. me)
  end
end
local function drop(id)
  redis.call('DEL', member_key(id), renewed_key(id)); redis.call('SREM', members, id)
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
/// that started at the very moment this one joined), or false, and the items read beyond the
/// caller's own, which the others' cards know}`: the holders are of the caller's items in the
/// order it gave them, then of those. An item key counts as a member's only while it carries
/// that member's nonce. Whether a member runs the name otherwise is read off the cards. The
/// answer ends with its digest (a SHA-1 of the members in id order, the holders, the plain
/// replica and the items added): when it is the one the caller sent after `since`, the three
/// lists come back empty and the plain replica false, meaning "the same as then", so that a
/// member at rest is sent two numbers and a digest rather than every card and every holder.
/// This member's item keys are renewed (to `item_ttl`) once their renewal falls due, half
/// that TTL after the last (`pgleader:{NAME}:renewed:<id>`), not at every read.
const ROSTER: &str = r#"
local live = live_members()
local mine = live[me] and nonce_of(live[me]) == nonce
if mine then
  redis.call('PEXPIRE', member_key(me), lease)
end
local renew = mine and redis.call('SET', renewed_key(me), '1', 'NX', 'PX',
  math.floor(item_ttl / 2))
local holders = {}
local keys = {}
-- A crontab's member reads the jobs the other members' cards say they know too, so that every
-- member counts the jobs held by others alike, whatever its own file holds.
local list = items()
local own = #list
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
      if hid == me and renew then redis.call('PEXPIRE', keys[i], item_ttl) end
    else
      -- Its member is gone (its connection closed, or its card expired): free.
      redis.call('DEL', keys[i])
    end
  end
  holders[i] = h
end
-- A job a reread removed stays this member's, renewed, while its last run finishes: the room
-- gives it up once that run has ended.
if renew then
  for _, n in ipairs(retiring()) do
    local key = base .. ':shard:' .. n
    local v = redis.call('GET', key)
    if v and nonce_of(v) == nonce then redis.call('PEXPIRE', key, item_ttl) end
  end
end
local ids = {}
for id in pairs(live) do ids[#ids + 1] = id end
table.sort(ids, function(a, b) return tonumber(a) < tonumber(b) end)
local flat = {}
for _, id in ipairs(ids) do
  table.insert(flat, id); table.insert(flat, live[id])
end
-- The caller knows its own items: only those the others' cards added come back.
local added = {}
for i = own + 1, #list do added[#added + 1] = list[i] end
local plain = plain_replica() or false
local digest = redis.sha1hex(table.concat(flat, '\n') .. '\n' .. table.concat(holders, ',') ..
  '\n' .. (plain or '') .. '\n' .. table.concat(added, ','))
for i = 6, #ARGV - 1 do
  if ARGV[i] == 'since' and ARGV[i + 1] == digest then
    return {t[1], t[2], {}, {}, false, {}, digest}
  end
end
return {t[1], t[2], flat, holders, plain, added, digest}
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
      ' since=' .. t[1], 'PX', item_ttl)
    table.insert(won, tonumber(ARGV[i]))
  end
end
if epoch then say('took') end
return {1, epoch or '0', t[1], t[2], won}
"#;

/// Releases shard ARGV[5] if it is still this member's, and says so. Returns 1 if it was.
const GIVE: &str = r#"
if not release(ARGV[5]) then return 0 end
say('gave ' .. ARGV[5])
return 1
"#;

/// Releases each of the shards ARGV[6..] still this member's, and says ARGV[5] once if it
/// released any. Returns the shards it released.
const GIVE_ALL: &str = r#"
local given = {}
for i = 6, #ARGV do
  if release(ARGV[i]) then given[#given + 1] = tonumber(ARGV[i]) end
end
if #given > 0 then say(ARGV[5]) end
return given
"#;

/// The keeper's farewell for item ARGV[5] of a replica whose pgleader died, once that item's
/// command's whole tree is gone: [`GIVE`], then, for shards (ARGV[7] is their count), if no
/// shard names this member any more (this was its last keeper), the membership too, so that
/// the others deal out its share at once rather than when their watcher finds its connection
/// gone. A crontab's member says -1 there: the keeper of its membership ends it, once every
/// command's keeper is done (a job added or removed since a command started, or one with no
/// run, would be missing from a list given here). Answers `{given (0/1), ARGV[6]}`, the marker the keeper
/// waits for (see `supervise/keeper/farewell.rs`).
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
/// command of the replica are gone (see `supervise/keeper/membership.rs`): the membership, if it is
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
  if card then redis.call('DEL', member_key(me), renewed_key(me)) end
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
pub(super) static FAREWELL_SOURCE: LazyLock<String> =
    LazyLock::new(|| format!("{PRELUDE}{FAREWELL}{GIVE}{FAREWELL_END}"));
pub(super) static MEMBERSHIP_FAREWELL_SOURCE: LazyLock<String> =
    LazyLock::new(|| format!("{PRELUDE}{MEMBERSHIP_FAREWELL}"));
pub(super) static JOIN_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(JOIN));
pub(super) static ROSTER_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(ROSTER));
pub(super) static TAKE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(TAKE));
pub(super) static GIVE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(GIVE_ALL));
pub(super) static LEAVE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(LEAVE));
pub(super) static GONE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(GONE));
pub(super) static SHARDED_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(SHARDED));
pub(super) static RECARD_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RECARD));

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

/// What every script of one member is given.
#[derive(Clone, Debug)]
pub(super) struct Args {
    pub(super) keys: ShardKeys,
    pub(super) id: String,
    pub(super) nonce: String,
    pub(super) lease: Duration,
    /// What this member shares out: what its roster reads and its leave releases.
    pub(super) items: Items,
    /// The jobs the last reread removed whose last runs were still going on (`finishing`, see
    /// [`Holder::set_items`](crate::election::shards::Holder::set_items)): while its card is its own, its roster read renews each whose key
    /// still carries its nonce, and its leave releases them. Kept until the next reread: a job
    /// given up since has no key to renew.
    pub(super) retiring: BTreeSet<u32>,
}

impl Args {
    pub(super) fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
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
    pub(super) fn farewell(&self, source: &str) -> redis::Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(source)
            .arg(0)
            .arg(&self.keys.base)
            .arg(&self.id)
            .arg(&self.nonce)
            .arg(millis(self.lease));
        eval
    }

    /// The roster read's `EVALSHA` with [`Args::over_items`]' arguments, built once per change
    /// of the items rather than at every check (a crontab's thousand job numbers); the caller
    /// adds `since` and loads the script when the server has not cached it.
    pub(super) fn roster_command(&self) -> redis::Cmd {
        let mut command = redis::cmd("EVALSHA");
        command
            .arg(ROSTER_SCRIPT.get_hash())
            .arg(0)
            .arg(&self.keys.base)
            .arg(&self.id)
            .arg(&self.nonce)
            .arg(millis(self.lease))
            .arg(self.item_args());
        command
    }

    /// A script that reads every item (roster, leave): the marker, then a crontab's job
    /// numbers (see the prelude).
    pub(super) fn over_items<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.invocation(script);
        invocation.arg(self.item_args());
        invocation
    }

    /// What a script that reads every item is given after the prelude's arguments: the
    /// marker, then a crontab's job numbers, then `retiring` and the jobs retiring.
    fn item_args(&self) -> Vec<String> {
        let mut args = vec![self.items.marker().to_string()];
        if let Items::Listed(jobs) = &self.items {
            args.extend(jobs.items.iter().map(u32::to_string));
            if !self.retiring.is_empty() {
                args.push("retiring".to_owned());
                args.extend(self.retiring.iter().map(u32::to_string));
            }
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_are_the_documented_ones() {
        let keys = ShardKeys::of(&LockKey::from_name("orders"));
        assert_eq!(keys.shard(3), "pgleader:{orders}:shard:3");
        assert_eq!(keys.member(7), "pgleader:{orders}:member:7");
        assert_eq!(keys.members(), "pgleader:{orders}:members");
        assert_eq!(keys.channel(), "pgleader:{orders}:shards");
        assert_eq!(keys.alive("00ff"), "pgleader:{orders}:alive:00ff");
    }
}
