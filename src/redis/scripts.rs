//! The lock's keys and the Lua scripts that change them. Every change of the lock is one script,
//! so that Redis runs it whole, with nothing in between: acquire (set only if free, hand out the
//! epoch), renew (compare, then extend), release (compare, then delete, then wake the next).
//! What every script is given, the keys and the session's identity, is [`ScriptArgs`]: it lives
//! here, below the session and the ledger that both pass it.
//!
//! The keys of a lock named `NAME` (or numbered `N`: `--lock-id N`) all start with
//! `pgleader:{NAME}`, braces included, so that no lock's keys can be another lock's:
//!
//! - `pgleader:{NAME}`: the lock. Its value names the holder and this leadership:
//!   `nonce=<hex> epoch=<n> since=<unix seconds> client=<client id> session=<name:pid@host>`;
//!   its TTL is the lease. `redis-cli GET 'pgleader:{NAME}'` shows who leads.
//! - `pgleader:{NAME}:epoch`: the last fencing token handed out.
//! - `pgleader:{NAME}:runs`, `:rows`, `:born`: the ledger of `--schedule` (see `ledger.rs`);
//!   a crontab job's ledger has the same three under `pgleader:{NAME}:job:<job name>`
//!   ([`Keys::job`]), inside the fleet's braces so that a script given a job's keys and the
//!   fleet's shard key never spans two cluster slots.
//! - `pgleader:{NAME}:queue` (list) and `:who` (hash), `:seen` (hash): the waiters, first come
//!   first served, and how each names itself.
//! - `pgleader:{NAME}:wake:<nonce>`: the list a waiter blocks on (`BLPOP`); a release pushes
//!   onto the first live waiter's.
//! - `pgleader:{NAME}:alive:<nonce>`: not a key but a channel each session subscribes to, on the
//!   connection that holds or waits. `PUBSUB NUMSUB` of it drops to 0 the moment the server
//!   closes that connection, which is how a crashed holder is told from a slow one long before
//!   its TTL. (The keeper holds a leader's socket until its command's whole tree is dead, so
//!   the connection closes only then.)
//!
//! The epoch: `max(last + 1, the server's clock in microseconds)`. It strictly increases while
//! the server keeps its data, and across a restart that kept nothing it still does as long as
//! the server's clock has not gone back by more than the time the restart took: the previous
//! leader's epoch was at most its own start's time, in microseconds.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use crate::election::lock::LockKey;

/// The keys of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    /// `pgleader:{NAME}`: every other key starts with it.
    pub lock: String,
}

impl Keys {
    pub fn of(lock: &LockKey) -> Keys {
        let name = match lock.name() {
            Some(name) => name.to_owned(),
            None => lock.key().to_string(),
        };
        Keys {
            lock: format!("pgleader:{{{name}}}"),
        }
    }

    pub fn epoch(&self) -> String {
        format!("{}:epoch", self.lock)
    }

    pub fn queue(&self) -> String {
        format!("{}:queue", self.lock)
    }

    pub fn who(&self) -> String {
        format!("{}:who", self.lock)
    }

    pub fn seen(&self) -> String {
        format!("{}:seen", self.lock)
    }

    /// The ledger's occurrences (a sorted set) and rows (a hash): see `redis/ledger.rs`.
    pub fn runs(&self) -> String {
        format!("{}:runs", self.lock)
    }

    pub fn rows(&self) -> String {
        format!("{}:rows", self.lock)
    }

    /// Since when the ledger remembers (microseconds): see `redis/ledger.rs`.
    pub fn born(&self) -> String {
        format!("{}:born", self.lock)
    }

    /// The crontab fleet's paused jobs (`pgleader cron pause`): a hash of job name (or `*`,
    /// every job) to who paused it and when, as JSON.
    pub fn paused(&self) -> String {
        format!("{}:paused", self.lock)
    }

    /// A crontab job's runs asked for by hand (`pgleader cron run`): a hash of request number
    /// to its row as JSON (`seq` the last number handed out, `<n>:output` the run's output),
    /// the list of the numbers no owner took yet (`:asked:queue`), and the set of those running
    /// (`:asked:running`). See
    /// `redis/ledger/asked.rs`.
    pub fn asked(&self) -> String {
        format!("{}:asked", self.lock)
    }

    pub fn asked_queue(&self) -> String {
        format!("{}:asked:queue", self.lock)
    }

    /// The numbers of the requests taken and running (a set), which the job's next owner
    /// marks interrupted.
    pub fn asked_running(&self) -> String {
        format!("{}:asked:running", self.lock)
    }

    /// The keys of crontab job `job` of this fleet, whose ledger lives under
    /// `pgleader:{NAME}:job:<job>` (`:runs`, `:rows`, `:born`). A job's name is letters,
    /// digits, `-`, `_` and `.`, so no job's keys are another's or the fleet's own.
    pub fn job(&self, job: &str) -> Keys {
        Keys {
            lock: format!("{}:job:{job}", self.lock),
        }
    }

    pub fn wake(&self, nonce: &str) -> String {
        format!("{}:wake:{nonce}", self.lock)
    }

    /// The channel a release publishes on: what a quorum's followers wait for.
    pub fn released(&self) -> String {
        format!("{}:released", self.lock)
    }

    /// The channel a leader SUBSCRIBEs to for step-down requests (`election/step_down.rs`).
    pub fn step_down(&self) -> String {
        format!("{}:step-down", self.lock)
    }

    pub fn alive(&self, nonce: &str) -> String {
        format!("{}:alive:{nonce}", self.lock)
    }

    /// The keys every lock script is given, in order: KEYS[1] to KEYS[5].
    pub fn all(&self) -> [String; 5] {
        [
            self.lock.clone(),
            self.epoch(),
            self.queue(),
            self.who(),
            self.seen(),
        ]
    }
}

/// What every lock script shares. ARGV[1] is the lock key (the prefix of the wake lists and
/// the liveness channels), ARGV[2] this session's nonce, ARGV[3] the lease in milliseconds,
/// ARGV[4] how long a waiter that cannot be checked by its channel counts as alive after it was
/// last seen (milliseconds).
const PRELUDE: &str = r#"
local base, me, lease, stale = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local blind = 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function holder_of(v) return string.match(v, '^nonce=(%x+) ') end
-- true/false from the session's liveness channel; nil when the ACL forbids asking.
local function connected(n)
  local ok, r = pcall(redis.call, 'PUBSUB', 'NUMSUB', base .. ':alive:' .. n)
  if not ok then blind = 1; return nil end
  return tonumber(r[2]) > 0
end
local function waiter_alive(n)
  local c = connected(n)
  if c ~= nil then return c end
  return now - tonumber(redis.call('HGET', KEYS[5], n) or '0') < stale
end
local function holder_alive(n)
  local c = connected(n)
  if c == nil then return true end
  return c
end
local function forget(n)
  redis.call('HDEL', KEYS[4], n); redis.call('HDEL', KEYS[5], n)
end
-- The first waiter still connected; the dead ones before it leave the queue.
local function first_waiter()
  while true do
    local head = redis.call('LINDEX', KEYS[3], 0)
    if not head then return nil end
    if head == me or waiter_alive(head) then return head end
    redis.call('LPOP', KEYS[3]); forget(head)
  end
end
local function wake(n)
  local key = base .. ':wake:' .. n
  redis.call('DEL', key); redis.call('RPUSH', key, '1'); redis.call('PEXPIRE', key, lease)
end
"#;

/// Takes the lock if it is free, or if its holder's connection is gone, and if no live waiter
/// is ahead; in "wait" mode a session that does not get it joins the queue. ARGV[5] is "wait"
/// or "try", ARGV[6] the session's card (`client=<id> session=<name>`), ARGV[7] the uptime
/// (milliseconds) under which this server refuses to take part: a member of a quorum that
/// restarted without its data must not vote until a lease has passed (Redlock's delayed
/// restart). Returns `{acquired (0/1), blind (1 if the ACL hid the liveness channels)}`.
const ACQUIRE: &str = r#"
local young = tonumber(ARGV[7] or '0')
if young > 0 then
  local up = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)'))
  if up * 1000 < young then return {0, blind} end
end
local current = redis.call('GET', KEYS[1])
local free = true
if current then
  local h = holder_of(current)
  if h == me then return {1, blind} end
  if h == nil or holder_alive(h) then free = false else forget(h) end
end
local function queue_up()
  if ARGV[5] == 'wait' then
    if not redis.call('LPOS', KEYS[3], me) then
      -- A newcomer clears out the waiters that are gone. Otherwise sessions that died while
      -- the lock was held would stay queued until they reached the head at a handoff, and a
      -- lock held for months would grow a queue that every status and release walks through.
      for _, n in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
        if not waiter_alive(n) then redis.call('LREM', KEYS[3], 0, n); forget(n) end
      end
      redis.call('RPUSH', KEYS[3], me)
    end
    redis.call('HSET', KEYS[4], me, ARGV[6]); redis.call('HSET', KEYS[5], me, now)
  end
  return {0, blind}
end
if not free then return queue_up() end
local head = first_waiter()
if head and head ~= me then wake(head); return queue_up() end
if head == me then redis.call('LPOP', KEYS[3]) end
local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
local epoch = string.format('%.0f', math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, micros))
redis.call('SET', KEYS[2], epoch)
local since = t[1] .. '.' .. string.sub(string.format('%06d', tonumber(t[2])), 1, 3)
redis.call('SET', KEYS[1], 'nonce=' .. me .. ' epoch=' .. epoch .. ' since=' .. since .. ' ' .. ARGV[6], 'PX', lease)
-- Whoever neither waits nor now holds has no business in :who and :seen: a leader whose key
-- was deleted or expired under it never took its own entry out (its release found the key
-- gone), and without this the hashes would grow with every such loss.
local queued = {}
for _, n in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do queued[n] = true end
for _, n in ipairs(redis.call('HKEYS', KEYS[4])) do
  if not queued[n] then redis.call('HDEL', KEYS[4], n) end
end
for _, n in ipairs(redis.call('HKEYS', KEYS[5])) do
  if not queued[n] then redis.call('HDEL', KEYS[5], n) end
end
redis.call('HSET', KEYS[4], me, ARGV[6])
redis.call('DEL', base .. ':wake:' .. me)
return {1, blind}
"#;

/// The leader's check: extends the lock's TTL only if the value is still this session's
/// (never re-creates it). Returns `{held (0/1), seconds, microseconds}` of the server's clock.
///
/// The second GET is not redundant: any write to a tracked key, the leader's own PEXPIRE
/// included (NOLOOP only keeps it from being pushed), drops the key from the server's tracking
/// table. Reading it again re-arms tracking, so that a foreign change after this renewal is
/// still pushed at once.
const RENEW: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and holder_of(v) == me then
  redis.call('PEXPIRE', KEYS[1], lease)
  redis.call('GET', KEYS[1])
  return {1, t[1], t[2]}
end
return {0, t[1], t[2]}
"#;

/// Deletes the lock only if it is this session's, then wakes the first live waiter. Returns 1
/// if it was released, 0 if it was not this session's.
const RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v or holder_of(v) ~= me then return 0 end
redis.call('DEL', KEYS[1]); forget(me)
local head = first_waiter()
if head then wake(head) end
redis.call('PUBLISH', base .. ':released', '1')
return 1
"#;

/// The keeper's farewell for a leader whose pgleader died: [`RELEASE`] once its command's whole
/// tree is gone, answering `{released (0/1), ARGV[5]}`, the marker the keeper waits for (see
/// `supervise/keeper/farewell.rs`).
const FAREWELL: &str = r#"
local function release()
"#;

const FAREWELL_END: &str = r#"
end
return {release(), ARGV[5]}
"#;

/// What `status` shows, changing nothing: `{lock value or false, holder connected (0/1/-1 when
/// it cannot tell), {nonce, card, ...} of the live waiters in order, seconds, microseconds}`.
const VIEW: &str = r#"
local current = redis.call('GET', KEYS[1])
local holder = -1
if current then
  local h = holder_of(current)
  local c = h and connected(h)
  if c == true then holder = 1 elseif c == false then holder = 0 end
end
local waiting = {}
for _, n in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
  if n ~= me and waiter_alive(n) then
    table.insert(waiting, n); table.insert(waiting, redis.call('HGET', KEYS[4], n) or '')
  end
end
return {current, holder, waiting, t[1], t[2]}
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{body}"))
}

/// The renew script's whole text, for an `EVAL` inside a pipeline (the fence's).
pub static RENEW_SOURCE: LazyLock<String> = LazyLock::new(|| format!("{PRELUDE}{RENEW}"));

/// The farewell's whole text: sent by the keeper with `EVAL`, since it cannot fall back from
/// `EVALSHA` when the server has not cached it.
pub static FAREWELL_SOURCE: LazyLock<String> =
    LazyLock::new(|| format!("{PRELUDE}{FAREWELL}{RELEASE}{FAREWELL_END}"));

pub static ACQUIRE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(ACQUIRE));
pub static RENEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RENEW));
pub static RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RELEASE));
pub static VIEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(VIEW));

/// The nonce in a lock's value.
pub fn holder_nonce(value: &str) -> Option<&str> {
    value.strip_prefix("nonce=")?.split(' ').next()
}

/// A `key=value` field of a lock's value or a card; `session` runs to the end.
pub fn field<'a>(value: &'a str, name: &str) -> Option<&'a str> {
    if name == "session" {
        return value
            .split_once(" session=")
            .map(|(_, session)| session)
            .or_else(|| value.strip_prefix("session="));
    }
    value
        .split(' ')
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
}

/// How a session names itself to the others, in the lock's value and in its waiter's card:
/// `client=<id> session=<name>`, the name without spaces (the card's fields are split on them).
pub fn card(client_id: i64, name: &str) -> String {
    format!("client={client_id} session={}", name.replace(' ', "_"))
}

/// How long a waiter counts as alive after it was last seen, where the ACL hides the liveness
/// channels: three of its polls and a second.
pub fn stale(poll: Duration) -> Duration {
    poll * 3 + Duration::from_secs(1)
}

/// The lock's keys and this session's identity, as the scripts take them.
#[derive(Clone, Debug)]
pub struct ScriptArgs {
    pub keys: Keys,
    /// Unique to this session, and so to the leadership it may win.
    pub nonce: String,
    /// How the session names itself to the others: `client=<id> session=<name>`.
    pub card: String,
    pub lease: Duration,
    /// How long a waiter counts as alive after it was last seen, when the ACL hides the
    /// liveness channels.
    pub stale: Duration,
}

impl ScriptArgs {
    /// A session's arguments; its waiters count as alive for [`stale`] of its `poll`.
    pub fn new(keys: Keys, nonce: String, card: String, lease: Duration, poll: Duration) -> Self {
        ScriptArgs {
            keys,
            nonce,
            card,
            lease,
            stale: stale(poll),
        }
    }

    pub(crate) fn invocation<'a>(&self, script: &'a redis::Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in self.keys.all() {
            invocation.key(key);
        }
        invocation
            .arg(&self.keys.lock)
            .arg(&self.nonce)
            .arg(millis(self.lease))
            .arg(millis(self.stale));
        invocation
    }
}

impl ScriptArgs {
    /// `EVAL` of a lock script's whole text with this session's keys and arguments: one round
    /// trip even on a server that has not cached the script, and usable inside a pipeline.
    pub(crate) fn eval(&self, source: &str) -> redis::Cmd {
        let keys = self.keys.all();
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(source).arg(keys.len()).arg(&keys[..]);
        cmd.arg(&self.keys.lock)
            .arg(&self.nonce)
            .arg(millis(self.lease))
            .arg(millis(self.stale));
        cmd
    }
}

impl ScriptArgs {
    /// The farewell for this session's leadership, in RESP, answering with `marker`.
    pub(crate) fn farewell(&self, marker: &str) -> Vec<u8> {
        let mut cmd = self.eval(&FAREWELL_SOURCE);
        cmd.arg(marker);
        cmd.get_packed_command()
    }
}

pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A fresh random nonce: 16 hex digits.
pub(crate) fn nonce() -> String {
    format!("{:016x}", fastrand::u64(..))
}

/// Every key that matches `pattern` now, by `SCAN` (for `status`: it never blocks the server
/// as `KEYS` would); a key may come more than once.
pub async fn scan(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor = 0_u64;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(page);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// `text` matched literally by a `SCAN MATCH` pattern.
pub fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_locks_keys_are_another_locks() {
        let a = Keys::of(&LockKey::from_name("a"));
        let b = Keys::of(&LockKey::from_name("a}:epoch"));
        assert_eq!(a.lock, "pgleader:{a}");
        assert_ne!(a.epoch(), b.lock);
        assert_eq!(Keys::of(&LockKey::from_id(-7)).lock, "pgleader:{-7}");
        let job = a.job("nightly-report");
        assert_eq!(job.runs(), "pgleader:{a}:job:nightly-report:runs");
        assert_eq!(job.rows(), "pgleader:{a}:job:nightly-report:rows");
        assert_eq!(job.born(), "pgleader:{a}:job:nightly-report:born");
    }

    #[test]
    fn reads_the_fields_of_a_value() {
        let value =
            "nonce=00ff epoch=1795000000000000 since=1795000000.123 client=17 session=job:42@web 1";
        assert_eq!(holder_nonce(value), Some("00ff"));
        assert_eq!(field(value, "epoch"), Some("1795000000000000"));
        assert_eq!(field(value, "client"), Some("17"));
        assert_eq!(field(value, "session"), Some("job:42@web 1"));
        assert_eq!(field("client=3 session=x", "session"), Some("x"));
    }
}
