//! The ledger of scheduled runs on Redis: Redis' implementation of the ledger's contract
//! (`election/ledger.rs`), in the lock's own key space.
//!
//! - `pgleader:{NAME}:runs`, a sorted set of occurrences (microseconds since the epoch, as score
//!   and member), newest last;
//! - `pgleader:{NAME}:rows`, a hash from occurrence to its row, as JSON (every number a string,
//!   so that Lua's doubles and cjson's 14 digits lose nothing).
//!
//! A crontab job's ledger (`pgleader cron`) is the same, under the job's own keys inside the
//! fleet's braces (`scripts::Keys::job`):
//!
//! | key | type | what it holds |
//! |---|---|---|
//! | `pgleader:{NAME}:runs`, `pgleader:{NAME}:job:<job>:runs` | sorted set | the occurrences |
//! | `pgleader:{NAME}:rows`, `pgleader:{NAME}:job:<job>:rows` | hash | occurrence → row (JSON) |
//! | `pgleader:{NAME}:born`, `pgleader:{NAME}:job:<job>:born` | string | since when it remembers |
//!
//! Every claim, record and interruption is one script that first checks that the key its
//! [`Guard`] names still holds this session's nonce: the lock's key for `--schedule`, the job's
//! shard key (`pgleader:{NAME}:shard:<item>`, see `shards/mod.rs`) for a crontab job, held by the
//! replica's holder connection. So a claim succeeds only while the claimant leads (or owns the
//! job), atomically: nothing can change the key between the check and the write. How a run
//! ended is recorded on its own row only (its epoch), as on PostgreSQL, whether or not the key
//! is still held: the row is this leadership's alone, and a run that ended just after its job
//! moved is then recorded as what it was rather than left for the next owner to call
//! interrupted. Like PostgreSQL's ledger, a claim refuses an occurrence
//! the server's clock (`TIME`) has not reached, and any occurrence at or before one already
//! recorded; the newest [`KEEP`] rows are kept.
//!
//! A Redis server that restarts without its data (no RDB, no AOF), or whose keys are flushed,
//! forgets what ran. `pgleader:{NAME}:born` says since when the ledger remembers: the server's
//! start, written by the first claim. A claim refuses an occurrence at or before it, so a
//! restart can lose an occurrence but never run one twice. (FLUSHALL, or an eviction policy
//! that evicts keys without a TTL, loses the ledger without a restart: keep the ledger's
//! server on `noeviction` or a `volatile-*` policy, and do not flush it.)
//!
//! One difference: a script that got no answer in time may still have run (Redis cannot roll it
//! back), so a ledger statement that times out is reported as a failure of the session
//! ([`LedgerError::Query`]: leadership in doubt), never as "busy, try again".

pub mod asked;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use redis::Script;
use redis::aio::MultiplexedConnection;
use tokio::sync::Semaphore;

use crate::election::ledger::{
    Asked, AskedFinish, Claim, Claimant, Definition, Entry, JobEntry, KEEP, LateFinish, Ledger,
    LedgerError, StaleRun,
};
use crate::election::participant::{self, Participant};
use crate::redis::scripts::ScriptArgs;
use crate::redis::scripts::{self, VIEW_SCRIPT};

/// What every ledger script shares: KEYS[1] the guard's key (the lock, or a job's shard), KEYS[2] the runs, KEYS[3] the rows,
/// KEYS[4] when the ledger's memory begins; ARGV[1] this session's nonce.
const PRELUDE: &str = r#"
local me = ARGV[1]
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
local function leads()
  local v = redis.call('GET', KEYS[1])
  if not (v and string.match(v, '^nonce=(%x+) ') == me) then return false end
  -- A crontab job's item key is its member's only while the member's card lives (the card's
  -- TTL is the lease, the key's own longer: see shards/scripts.rs).
  local base = string.match(KEYS[1], '^(.*):shard:%d+$')
  local id = string.match(v, ' member=(%d+)')
  if base and id then
    local card = redis.call('GET', base .. ':member:' .. id)
    return card ~= false and string.match(card, '^nonce=(%x+) ') == me
  end
  return true
end
local function newer(at)
  return redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. at, '+inf', 'LIMIT', 0, 1)[1] ~= nil
end
local function row(at)
  local text = redis.call('HGET', KEYS[3], at)
  return text and cjson.decode(text)
end
local function put(at, r)
  redis.call('HSET', KEYS[3], at, cjson.encode(r)); redis.call('ZADD', KEYS[2], at, at)
end
"#;

/// ARGV[2] the occurrence, ARGV[3] the retries allowed, ARGV[4] the claimant's fields as JSON
/// (host, pid, backend_pid, epoch, schedule, timezone, lock_name), ARGV[5] from when on the
/// server's clock the claim may land (the occurrence, or a moment ahead of it: `claimed_at` is
/// then the occurrence); for a crontab job, KEYS[5] the fleet's paused jobs and ARGV[6] the
/// job's name: a paused job's occurrence is recorded as `paused` instead of claimed.
const CLAIM: &str = r#"
if not leads() then return {'notleader'} end
local at, retries = ARGV[2], tonumber(ARGV[3])
local who = cjson.decode(ARGV[4])
local existing = row(at)
local later = newer(at)
local function fill(r)
  r.outcome = 'running'; r.ended_at = nil; r.exit_code = nil; r.detail = nil
  r.claimed_at = now
  if tonumber(now) < tonumber(at) then r.claimed_at = at end
  r.host = who.host; r.pid = who.pid; r.backend_pid = who.backend_pid; r.epoch = who.epoch
  return r
end
if existing then
  if existing.outcome == 'interrupted' and tonumber(existing.attempt) <= retries and not later then
    existing.attempt = tostring(tonumber(existing.attempt) + 1)
    put(at, fill(existing)); redis.call('HDEL', KEYS[3], at .. ':output')
    return {'claimed', existing.attempt}
  end
  if later then return {'superseded'} end
  return {'taken', existing.outcome}
end
if later then return {'superseded'} end
if tonumber(now) < tonumber(ARGV[5]) then return {'early', now} end
-- A server that restarted without its data forgot what ran before: its ledger remembers from
-- the server's start only (a server that kept its data keeps this key, with its older time).
local born = redis.call('GET', KEYS[4])
if not born then
  local up = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)'))
  born = string.format('%.0f', tonumber(now) - up * 1000000)
  redis.call('SET', KEYS[4], born)
end
if tonumber(at) <= tonumber(born) then return {'taken', 'unknown: the server restarted without its data after it'} end
local r = fill({scheduled_for = at, attempt = '1', schedule = who.schedule, timezone = who.timezone, lock_name = who.lock_name})
if KEYS[5] then
  local p = redis.call('HGET', KEYS[5], ARGV[6]) or redis.call('HGET', KEYS[5], '*')
  if p then
    r.outcome = 'paused'; r.ended_at = r.claimed_at; r.detail = cjson.decode(p).detail
    put(at, r)
    return {'paused', r.detail}
  end
end
put(at, r)
return {'claimed', '1'}
"#;

/// ARGV[2] the occurrence, ARGV[3] the epoch, ARGV[4] the outcome, ARGV[5] the exit code or
/// '', ARGV[6] the detail or '', ARGV[7] how many rows to keep, ARGV[8] the run's output or ''.
/// Returns how many rows were updated.
const FINISH: &str = r#"
local at = ARGV[2]
local r = row(at)
local done = 0
if r and r.epoch == ARGV[3] and r.outcome == 'running' then
  r.outcome = ARGV[4]; r.ended_at = now
  if ARGV[5] ~= '' then r.exit_code = ARGV[5] end
  if ARGV[6] ~= '' then r.detail = ARGV[6] end
  put(at, r); done = 1
  -- Beside the row, not in it: the scripts that read rows never decode it.
  if ARGV[8] ~= '' then redis.call('HSET', KEYS[3], at .. ':output', ARGV[8]) end
end
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[7])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, extra - 1)) do
    redis.call('HDEL', KEYS[3], old, old .. ':output'); redis.call('ZREM', KEYS[2], old)
  end
end
return done
"#;

/// ARGV[2] the occurrence, ARGV[3] the epoch, ARGV[4] the outcome, ARGV[5] the exit code or
/// '', ARGV[6] when it ended, ARGV[7] the attempt.
const FINISH_LATE: &str = r#"
local at = ARGV[2]
local r = row(at)
if r and r.epoch == ARGV[3] and r.attempt == ARGV[7] and (r.outcome == 'running' or r.outcome == 'interrupted') then
  r.outcome = ARGV[4]; r.ended_at = ARGV[6]
  if ARGV[5] ~= '' then r.exit_code = ARGV[5] end
  r.detail = "recorded on the leader's next session: its session ended first"
  put(at, r)
  return 1
end
return 0
"#;

/// ARGV[2] the occurrence, ARGV[3] the epoch.
const UNCLAIM: &str = r#"
local at = ARGV[2]
local r = row(at)
if r and r.epoch == ARGV[3] and r.outcome == 'running' then
  if r.attempt == '1' then
    redis.call('HDEL', KEYS[3], at, at .. ':output'); redis.call('ZREM', KEYS[2], at)
  else
    r.outcome = 'interrupted'; r.attempt = tostring(tonumber(r.attempt) - 1); put(at, r)
  end
end
return 0
"#;

/// ARGV[2] the occurrence, ARGV[3] the outcome, ARGV[4] the detail, ARGV[5] the claimant's
/// fields as JSON.
const RECORD: &str = r#"
if not leads() then return 0 end
local at = ARGV[2]
if row(at) or newer(at) then return 0 end
local who = cjson.decode(ARGV[5])
put(at, {scheduled_for = at, outcome = ARGV[3], detail = ARGV[4], attempt = '1',
  claimed_at = now, ended_at = now, host = who.host, pid = who.pid,
  backend_pid = who.backend_pid, epoch = who.epoch, schedule = who.schedule,
  timezone = who.timezone, lock_name = who.lock_name})
return 1
"#;

/// Marks every `running` row interrupted, if this session leads; returns them as JSON rows.
const INTERRUPT_STALE: &str = r#"
if not leads() then return {} end
local found = {}
for _, at in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local r = row(at)
  if r and r.outcome == 'running' and tonumber(at) > tonumber(now) + 100000 then
    -- Claimed ahead of an instant not reached yet (100 ms away or more, so that its claimant,
    -- if alive, had a moment to hear it lost the job): its command never started. Taken back,
    -- for the new holder to claim.
    redis.call('HDEL', KEYS[3], at); redis.call('ZREM', KEYS[2], at)
  elseif r and r.outcome == 'running' then
    r.outcome = 'interrupted'; r.ended_at = now
    if not r.detail then r.detail = 'its leader lost the lock while it ran' end
    put(at, r); table.insert(found, cjson.encode(r))
  end
end
return found
"#;

/// ARGV[2] how many: the newest rows, newest first, as JSON.
/// ARGV[2] how many rows: each row, then the output kept beside it (`<at>:output`) or nil.
const RECENT: &str = r#"
local ids = redis.call('ZREVRANGE', KEYS[2], 0, tonumber(ARGV[2]) - 1)
if #ids == 0 then return {} end
local fields = {}
for _, id in ipairs(ids) do
  table.insert(fields, id); table.insert(fields, id .. ':output')
end
return redis.call('HMGET', KEYS[3], unpack(fields))
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{body}"))
}

static CLAIM_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(CLAIM));
static FINISH_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(FINISH));
static FINISH_LATE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(FINISH_LATE));
static UNCLAIM_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(UNCLAIM));
static RECORD_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RECORD));
static INTERRUPT_STALE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(INTERRUPT_STALE));
pub static RECENT_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RECENT));

/// The key a leader's claims require to hold its nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The plain lock's own key (`--schedule`).
    Plain,
    /// A crontab job's item: its shard key, `pgleader:{NAME}:shard:<item>`, which the fleet
    /// member's holder connection holds while it owns the job; and the fleet's paused jobs
    /// (`pgleader:{NAME}:paused`), which the job's claims look up by its name `job`.
    Item {
        shard: String,
        paused: String,
        job: String,
    },
}

/// The ledger of one lock and one schedule definition, on one session's connection.
#[derive(Clone, Debug)]
pub struct RedisLedger {
    conn: MultiplexedConnection,
    args: ScriptArgs,
    guard: Guard,
    definition: Definition,
    /// What the session's name starts with.
    user_name: Option<String>,
    client_id: i64,
    /// Bounds each of a leader's ledger scripts, from when it is sent.
    timeout: Duration,
    /// The connection's turns to send one (`connection::LEDGER_SLOTS`).
    slots: Arc<Semaphore>,
}

/// What becomes of a ledger script whose caller stopped waiting before its turn came.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Abandoned {
    Send,
    Drop,
}

impl RedisLedger {
    pub fn new(
        conn: MultiplexedConnection,
        args: ScriptArgs,
        definition: Definition,
        user_name: Option<String>,
        client_id: i64,
        (timeout, slots): (Duration, Arc<Semaphore>),
    ) -> RedisLedger {
        RedisLedger {
            conn,
            args,
            guard: Guard::Plain,
            definition,
            user_name,
            client_id,
            timeout,
            slots,
        }
    }

    /// The same ledger with its claims guarded by `guard` instead of the lock's own key.
    pub fn guarded_by(mut self, guard: Guard) -> RedisLedger {
        self.guard = guard;
        self
    }

    /// The key its claims require to hold this session's nonce: the lock's, or the job's.
    fn guard_key(&self) -> &str {
        match &self.guard {
            Guard::Plain => &self.args.keys.lock,
            Guard::Item { shard, .. } => shard,
        }
    }

    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        invocation
            .key(self.guard_key())
            .key(self.args.keys.runs())
            .key(self.args.keys.rows())
            .key(self.args.keys.born())
            .arg(&self.args.nonce);
        invocation
    }

    /// A script that ends a run (FINISH, FINISH_LATE): both take the occurrence, the epoch, the
    /// outcome and the exit code first.
    fn ending<'a>(&self, script: &'a Script, run: &LateFinish) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.invocation(script);
        invocation
            .arg(micros(run.at))
            .arg(run.epoch)
            .arg(run.outcome)
            .arg(run.exit_code.map(|c| c.to_string()).unwrap_or_default());
        invocation
    }

    /// Runs a ledger script that records (an outcome, a finish, the runs a dead leader left):
    /// sent even if its caller gave up waiting, as it was before turns were taken, so that what
    /// it records is not lost to a settle's timeout (a finished run recorded as interrupted
    /// would run again under --retry-interrupted). See [`RedisLedger::run_if_wanted`].
    async fn run<T: redis::FromRedisValue + Send + 'static>(
        &self,
        invocation: redis::ScriptInvocation<'static>,
    ) -> Result<T, LedgerError> {
        self.run_on_turn(invocation, Abandoned::Send).await
    }

    /// Runs a ledger script that takes something (a claim, a run asked by hand) only if its
    /// caller still waits when its turn comes: taken for a caller that gave up, it would be
    /// left for nobody to start or give back.
    async fn run_if_wanted<T: redis::FromRedisValue + Send + 'static>(
        &self,
        invocation: redis::ScriptInvocation<'static>,
    ) -> Result<T, LedgerError> {
        self.run_on_turn(invocation, Abandoned::Drop).await
    }

    /// Runs a ledger script on its own task, once the connection has a turn for it
    /// (`connection::LEDGER_SLOTS`), bounded by the timeout from then. On a task of its own,
    /// because a turn is held until the answer: a caller's future left unpolled (a job's run
    /// waiting while the room settles another) must not keep a turn from the others. The task
    /// ends with the connection at the latest: dropping it aborts its driver, and the script
    /// fails.
    async fn run_on_turn<T: redis::FromRedisValue + Send + 'static>(
        &self,
        invocation: redis::ScriptInvocation<'static>,
        abandoned: Abandoned,
    ) -> Result<T, LedgerError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let (mut conn, slots, timeout) = (self.conn.clone(), Arc::clone(&self.slots), self.timeout);
        tokio::spawn(async move {
            // Never closed.
            let Ok(_turn) = slots.acquire_owned().await else {
                return;
            };
            if abandoned == Abandoned::Drop && answer.is_closed() {
                return;
            }
            let result =
                match tokio::time::timeout(timeout, invocation.invoke_async(&mut conn)).await {
                    Ok(result) => result.map_err(ledger_error),
                    Err(_) => Err(LedgerError::Query(format!(
                        "no answer from the server to a ledger script within {}",
                        humantime::format_duration(timeout)
                    ))),
                };
            let _ = answer.send(result);
        });
        answered.await.unwrap_or_else(|_| {
            Err(LedgerError::Query(
                "the ledger script's task ended without an answer".to_owned(),
            ))
        })
    }

    /// The claimant's fields, as the scripts take them.
    fn who(&self, claimant: &Claimant) -> String {
        serde_json::json!({
            "host": claimant.host,
            "pid": claimant.pid.to_string(),
            "backend_pid": self.client_id.to_string(),
            "epoch": claimant.epoch.to_string(),
            "schedule": self.definition.expression,
            "timezone": self.definition.timezone,
            "lock_name": self.args.keys.lock,
        })
        .to_string()
    }
}

/// Microseconds since the Unix epoch, the ledger's key for an instant.
fn micros(at: Timestamp) -> String {
    at.as_microsecond().to_string()
}

fn instant(text: &str) -> Option<Timestamp> {
    Timestamp::from_microsecond(text.parse().ok()?).ok()
}

fn ledger_error(err: redis::RedisError) -> LedgerError {
    match err.code() {
        Some("NOPERM") => LedgerError::Fatal(format!(
            "the Redis ACL does not authorize the ledger's scripts: {err}"
        )),
        Some("BUSY") => LedgerError::Busy(err.to_string()),
        _ => LedgerError::Query(err.to_string()),
    }
}

/// A row of the ledger, from its JSON.
fn entry(json: &str) -> Option<Entry> {
    let row: serde_json::Value = serde_json::from_str(json).ok()?;
    let text = |name: &str| row.get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let number = |name: &str| text(name).and_then(|v| v.parse::<i64>().ok());
    Some(Entry {
        scheduled_for: instant(&text("scheduled_for")?)?,
        outcome: text("outcome")?,
        exit_code: number("exit_code").and_then(|v| i32::try_from(v).ok()),
        attempt: number("attempt")
            .and_then(|v| i32::try_from(v).ok())
            .unwrap_or(1),
        claimed_at: text("claimed_at").as_deref().and_then(instant)?,
        ended_at: text("ended_at").as_deref().and_then(instant),
        host: text("host"),
        pid: number("pid").and_then(|v| i32::try_from(v).ok()),
        backend_pid: number("backend_pid").and_then(|v| i32::try_from(v).ok()),
        epoch: number("epoch"),
        detail: text("detail"),
        schedule: text("schedule").unwrap_or_default(),
        timezone: text("timezone").unwrap_or_default(),
        output: None,
    })
}

/// Each job of the crontab fleet of `keys` that the ledger knows (its `job:<name>:runs` keys,
/// by `SCAN`), with its newest row and when its last success ended, for `status`; `None` when
/// there is none. A claim made ahead of an occurrence the server's clock has not reached is
/// not a run yet (its command starts at the instant): the row before it is the job's newest.
pub async fn jobs(
    conn: &mut MultiplexedConnection,
    keys: &scripts::Keys,
) -> Result<Option<Vec<JobEntry>>, LedgerError> {
    let prefix = format!("{}:job:", keys.lock);
    let pattern = format!("{}*:runs", scripts::glob_escape(&prefix));
    let names: std::collections::BTreeSet<String> = scripts::scan(conn, &pattern)
        .await
        .map_err(ledger_error)?
        .iter()
        .filter_map(|key| Some(key.strip_prefix(&prefix)?.strip_suffix(":runs")?.to_owned()))
        .collect();
    let now = server_time(conn).await?;
    let mut jobs = Vec::new();
    for name in names {
        let rows = recent(conn, &keys.job(&name), KEEP).await?;
        let Some(newest) = rows
            .iter()
            .find(|row| !(row.outcome == "running" && row.scheduled_for > now))
            .cloned()
        else {
            continue;
        };
        let last_success = rows
            .iter()
            .find(|row| row.outcome == "succeeded")
            .map(|row| row.ended_at.unwrap_or(row.claimed_at));
        jobs.push(JobEntry {
            name,
            newest,
            last_success,
        });
    }
    Ok((!jobs.is_empty()).then_some(jobs))
}

/// The newest `limit` rows of a lock, through any connection.
pub async fn recent(
    conn: &mut MultiplexedConnection,
    keys: &scripts::Keys,
    limit: i64,
) -> Result<Vec<Entry>, LedgerError> {
    let rows: Vec<Option<String>> = RECENT_SCRIPT
        .key(&keys.lock)
        .key(keys.runs())
        .key(keys.rows())
        .arg("")
        .arg(limit)
        .invoke_async(conn)
        .await
        .map_err(ledger_error)?;
    Ok(rows
        .chunks(2)
        .filter_map(|pair| {
            let mut entry = entry(pair.first()?.as_deref()?)?;
            entry.output = pair.get(1).cloned().flatten();
            Some(entry)
        })
        .collect())
}

/// The server's clock, through any connection.
pub async fn server_time(conn: &mut MultiplexedConnection) -> Result<Timestamp, LedgerError> {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME")
        .query_async(conn)
        .await
        .map_err(ledger_error)?;
    Timestamp::from_microsecond(seconds * 1_000_000 + micros)
        .map_err(|err| LedgerError::Query(err.to_string()))
}

/// Who holds and who waits, as the view script sees it: the lock's value, and the live
/// waiters' nonces and cards.
pub async fn view(
    conn: &mut MultiplexedConnection,
    keys: &scripts::Keys,
    me: &str,
    stale: Duration,
) -> redis::RedisResult<(Option<String>, Vec<(String, String)>)> {
    let mut invocation = VIEW_SCRIPT.prepare_invoke();
    for key in keys.all() {
        invocation.key(key);
    }
    let (value, _holder, waiting, _, _): (Option<String>, i64, Vec<String>, i64, i64) = invocation
        .arg(&keys.lock)
        .arg(me)
        .arg(0)
        .arg(u64::try_from(stale.as_millis()).unwrap_or(u64::MAX))
        .invoke_async(conn)
        .await?;
    let waiting = waiting
        .chunks(2)
        .filter_map(|pair| match pair {
            [nonce, card] => Some((nonce.clone(), card.clone())),
            _ => None,
        })
        .collect();
    Ok((value, waiting))
}

/// A participant, from its card (`client=<id> session=<name>`).
pub fn participant(card: &str, granted: bool) -> Participant {
    Participant {
        backend_pid: scripts::field(card, "client")
            .and_then(|id| id.parse().ok())
            .unwrap_or(0),
        id_kind: participant::SessionId::ClientId,
        granted,
        application_name: scripts::field(card, "session").map(str::to_owned),
        ..Participant::default()
    }
}

impl Ledger for RedisLedger {
    /// Nothing to create: the keys appear with the first row.
    async fn prepare(&self) -> Result<String, LedgerError> {
        Ok(format!("Redis keys {}:runs and :rows", self.args.keys.lock))
    }

    /// Nothing for a crontab job's: its member's card says who the replica is, and the
    /// holder connection's name is the member's, whichever jobs it owns.
    async fn announce(&self, fingerprints: &str) -> Result<(), LedgerError> {
        if let Guard::Item { .. } = self.guard {
            return Ok(());
        }
        let name = participant::label(self.user_name.as_deref(), Some(fingerprints));
        let card = scripts::card(self.client_id, &name);
        let mut conn = self.conn.clone();
        redis::pipe()
            .cmd("HSET")
            .arg(self.args.keys.who())
            .arg(&self.args.nonce)
            .arg(card)
            .ignore()
            .cmd("CLIENT")
            .arg("SETNAME")
            .arg(name.replace(' ', "_"))
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(ledger_error)
    }

    /// A crontab job's has none: nobody holds or waits for a plain lock of a job (the fleet's
    /// members are on their cards), as on PostgreSQL, where nobody holds the job's key.
    async fn participants(&self) -> Result<Vec<Participant>, LedgerError> {
        if let Guard::Item { .. } = self.guard {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let (value, waiting) = view(
            &mut conn,
            &self.args.keys,
            &self.args.nonce,
            self.args.stale,
        )
        .await
        .map_err(ledger_error)?;
        let mut found = Vec::new();
        if let Some(value) = value
            && let Some(holder) = scripts::holder_nonce(&value)
            && holder != self.args.nonce
        {
            let card: Option<String> = redis::cmd("HGET")
                .arg(self.args.keys.who())
                .arg(holder)
                .query_async(&mut conn)
                .await
                .map_err(ledger_error)?;
            found.push(participant(card.as_deref().unwrap_or(&value), true));
        }
        found.extend(waiting.iter().map(|(_, card)| participant(card, false)));
        Ok(found)
    }

    async fn server_time(&self) -> Result<Timestamp, LedgerError> {
        server_time(&mut self.conn.clone()).await
    }

    async fn interrupt_stale(&self) -> Result<Vec<StaleRun>, LedgerError> {
        let rows: Vec<String> = self.run(self.invocation(&INTERRUPT_STALE_SCRIPT)).await?;
        Ok(rows
            .iter()
            .filter_map(|json| entry(json))
            .map(|entry| (entry.scheduled_for, entry.host, entry.pid))
            .collect())
    }

    async fn recent(&self, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, recent(&mut conn, &self.args.keys, limit)).await {
            Ok(result) => result,
            Err(_) => Err(LedgerError::Busy(
                "no answer from the server in time".into(),
            )),
        }
    }

    async fn has(&self, at: Timestamp) -> Result<bool, LedgerError> {
        let mut conn = self.conn.clone();
        redis::cmd("HEXISTS")
            .arg(self.args.keys.rows())
            .arg(micros(at))
            .query_async(&mut conn)
            .await
            .map_err(ledger_error)
    }

    async fn claim(
        &self,
        at: Timestamp,
        ahead: Duration,
        claimant: &Claimant,
        retries: i32,
    ) -> Result<Claim, LedgerError> {
        let from = at
            .checked_sub(SignedDuration::try_from(ahead).unwrap_or_default())
            .unwrap_or(at);
        let mut invocation = self.invocation(&CLAIM_SCRIPT);
        invocation
            .arg(micros(at))
            .arg(retries)
            .arg(self.who(claimant))
            .arg(micros(from));
        // A crontab job's claim records the occurrence as paused while the fleet pauses it.
        if let Guard::Item { paused, job, .. } = &self.guard {
            invocation.key(paused).arg(job);
        }
        let answer: Vec<String> = self.run_if_wanted(invocation).await?;
        let detail = answer.get(1).map(String::as_str).unwrap_or_default();
        Ok(match answer.first().map(String::as_str) {
            Some("claimed") => Claim::Claimed {
                attempt: detail.parse().unwrap_or(1),
            },
            Some("taken") => Claim::Taken {
                outcome: detail.to_owned(),
            },
            Some("superseded") => Claim::Superseded,
            Some("early") => Claim::Early {
                server_now: instant(detail).unwrap_or(at),
            },
            Some("notleader") => Claim::NotLeader,
            Some("paused") => Claim::Paused {
                detail: detail.to_owned(),
            },
            other => {
                return Err(LedgerError::Query(format!(
                    "the claim script answered {other:?}"
                )));
            }
        })
    }

    async fn finish(&self, finish: &LateFinish, detail: Option<&str>) -> Result<bool, LedgerError> {
        let mut invocation = self.ending(&FINISH_SCRIPT, finish);
        invocation
            .arg(detail.unwrap_or_default())
            .arg(KEEP)
            .arg(finish.output.as_deref().unwrap_or_default());
        let done: i64 = self.run(invocation).await?;
        Ok(done > 0)
    }

    async fn finish_late(&self, late: &LateFinish) -> Result<bool, LedgerError> {
        let mut invocation = self.ending(&FINISH_LATE_SCRIPT, late);
        invocation.arg(micros(late.ended_at)).arg(late.attempt);
        let done: i64 = self.run(invocation).await?;
        Ok(done > 0)
    }

    async fn unclaim(&self, at: Timestamp, epoch: i64) -> Result<(), LedgerError> {
        let mut invocation = self.invocation(&UNCLAIM_SCRIPT);
        invocation.arg(micros(at)).arg(epoch);
        self.run::<i64>(invocation).await.map(|_| ())
    }

    async fn take_asked(
        &self,
        claimant: &Claimant,
        skip: Option<&str>,
    ) -> Result<Option<Asked>, LedgerError> {
        self.take_asked_run(claimant, skip).await
    }

    async fn finish_asked(&self, finish: &AskedFinish) -> Result<bool, LedgerError> {
        self.finish_asked_run(finish).await
    }

    async fn interrupt_stale_asked(&self) -> Result<u64, LedgerError> {
        self.interrupt_stale_asked_runs().await
    }

    async fn record(
        &self,
        at: Timestamp,
        outcome: &str,
        detail: &str,
        claimant: &Claimant,
    ) -> Result<bool, LedgerError> {
        let mut invocation = self.invocation(&RECORD_SCRIPT);
        invocation
            .arg(micros(at))
            .arg(outcome)
            .arg(detail)
            .arg(self.who(claimant));
        let recorded: i64 = self.run(invocation).await?;
        Ok(recorded == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_survives_json() {
        let json = r#"{"scheduled_for":"1795000000123456","outcome":"failed","exit_code":"3",
            "attempt":"2","claimed_at":"1795000000200000","host":"web-1","pid":"42",
            "backend_pid":"7","epoch":"1795000000000001","schedule":"0 0 3 * * *","timezone":"UTC"}"#;
        let entry = entry(json).expect("a row");
        assert_eq!(entry.scheduled_for.as_microsecond(), 1_795_000_000_123_456);
        assert_eq!(entry.exit_code, Some(3));
        assert_eq!(entry.attempt, 2);
        assert_eq!(entry.epoch, Some(1_795_000_000_000_001));
        assert_eq!(entry.ended_at, None);
    }
}
