//! Runs asked for by hand (`pgleader cron run`) on Redis, beside a crontab job's ledger and
//! inside the fleet's braces: `pgleader:{NAME}:job:<job>:asked`, a hash of request number to
//! its row (JSON, every number a string), with `seq` the last number handed out and
//! `<n>:output` the run's output; and `:asked:queue`, the list of the requests no owner took
//! yet; `:asked:running`, the set of those taken and running.
//!
//! `pgleader cron run` adds a request and says `asked <job>` on the fleet's channel, in one
//! script. The job's owner takes the oldest request with a script that first checks that the
//! job's key holds its holder's nonce, as a claim does, and pops it from the queue: a request
//! is taken once, by one owner, and moved to `running` (or `skipped`, beside a run that goes
//! on under `overlap=skip`). How the run ended is written on its row by the leadership that
//! took it; a row left `running` by an owner that died is marked interrupted by the job's
//! next owner. The newest [`KEEP`] requests of each job are kept.

use std::sync::LazyLock;

use redis::Script;
use redis::aio::MultiplexedConnection;

use super::{RedisLedger, instant, ledger_error};
use crate::election::ledger::{Asked, AskedEntry, AskedFinish, Claimant, KEEP, LedgerError};
use crate::redis::scripts::Keys;

/// What every script of the requests shares: the server's clock in microseconds.
const NOW: &str = r#"
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
"#;

/// KEYS[1] the requests, KEYS[2] the queue; ARGV[1] who asks, ARGV[2] how many to keep,
/// ARGV[3] the fleet's channel, ARGV[4] what is said on it. Returns the request's number.
const ASK: &str = r#"
local id = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('HSET', KEYS[1], id, cjson.encode({id = tostring(id), asked_at = now, asked_by = ARGV[1], outcome = 'asked'}))
redis.call('RPUSH', KEYS[2], id)
local keep = tonumber(ARGV[2])
for old = math.max(1, id - 2 * keep), id - keep do
  local text = redis.call('HGET', KEYS[1], old)
  if text then
    local r = cjson.decode(text)
    if r.outcome ~= 'asked' and r.outcome ~= 'running' then redis.call('HDEL', KEYS[1], old, old .. ':output') end
  end
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return id
"#;

/// KEYS[1] the job's key, KEYS[2] the requests, KEYS[3] the queue, KEYS[4] the running; ARGV[1] the holder's
/// nonce, ARGV[2] the taker's host, ARGV[3] its pid, ARGV[4] its epoch, ARGV[5] the detail of
/// a request skipped, or ''. Returns the request taken (number, when, by whom), or nil.
const TAKE: &str = r#"
local v = redis.call('GET', KEYS[1])
if not (v and string.match(v, '^nonce=(%x+) ') == ARGV[1]) then return false end
while true do
  local id = redis.call('LPOP', KEYS[3])
  if not id then return false end
  local text = redis.call('HGET', KEYS[2], id)
  local r = text and cjson.decode(text)
  if r and r.outcome == 'asked' then
    r.host = ARGV[2]; r.pid = ARGV[3]; r.epoch = ARGV[4]
    if ARGV[5] == '' then
      r.outcome = 'running'; r.started_at = now
      redis.call('SADD', KEYS[4], id)
    else
      r.outcome = 'skipped'; r.detail = ARGV[5]; r.ended_at = now
    end
    redis.call('HSET', KEYS[2], id, cjson.encode(r))
    return {id, r.asked_at, r.asked_by}
  end
end
"#;

/// KEYS[1] the requests, KEYS[2] the running; ARGV[1] the number, ARGV[2] the epoch, ARGV[3]
/// the outcome, ARGV[4] the exit code or '', ARGV[5] the detail or '', ARGV[6] the output or
/// ''. Returns 1 if recorded.
const FINISH: &str = r#"
local text = redis.call('HGET', KEYS[1], ARGV[1])
local r = text and cjson.decode(text)
if not (r and r.epoch == ARGV[2] and r.outcome == 'running') then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
r.outcome = ARGV[3]; r.ended_at = now
if ARGV[4] ~= '' then r.exit_code = ARGV[4] end
if ARGV[5] ~= '' then r.detail = ARGV[5] end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], ARGV[1] .. ':output', ARGV[6]) end
return 1
"#;

/// KEYS[1] the job's key, KEYS[2] the requests, KEYS[3] the running; ARGV[1] the holder's
/// nonce. Marks every `running` request interrupted; returns how many.
const INTERRUPT_STALE: &str = r#"
local v = redis.call('GET', KEYS[1])
if not (v and string.match(v, '^nonce=(%x+) ') == ARGV[1]) then return 0 end
local found = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local text = redis.call('HGET', KEYS[2], id)
  local r = text and cjson.decode(text)
  if r and r.outcome == 'running' then
    r.outcome = 'interrupted'; r.ended_at = now; r.detail = 'its replica lost the job while it ran'
    redis.call('HSET', KEYS[2], id, cjson.encode(r)); found = found + 1
  end
end
redis.call('DEL', KEYS[3])
return found
"#;

/// KEYS[1] the requests; ARGV[1] the newest number wanted ('' for the last), ARGV[2] how
/// many. Each row, newest first, then its output or nil.
const READ: &str = r#"
local top = tonumber(ARGV[1]) or tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local fields = {}
for id = top, math.max(1, top - tonumber(ARGV[2]) + 1), -1 do
  table.insert(fields, tostring(id)); table.insert(fields, id .. ':output')
end
if #fields == 0 then return {} end
return redis.call('HMGET', KEYS[1], unpack(fields))
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{NOW}{body}"))
}

static ASK_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(ASK));
static TAKE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(TAKE));
static FINISH_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(FINISH));
static INTERRUPT_STALE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(INTERRUPT_STALE));
static READ_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(READ));

impl RedisLedger {
    pub(super) async fn take_asked_run(
        &self,
        claimant: &Claimant,
        skip: Option<&str>,
    ) -> Result<Option<Asked>, LedgerError> {
        let keys = &self.args.keys;
        let mut invocation = TAKE_SCRIPT.prepare_invoke();
        invocation
            .key(self.guard_key())
            .key(keys.asked())
            .key(keys.asked_queue())
            .key(keys.asked_running())
            .arg(&self.args.nonce)
            .arg(&claimant.host)
            .arg(claimant.pid)
            .arg(claimant.epoch)
            .arg(skip.unwrap_or_default());
        let taken: Option<(i64, String, String)> = self.run_if_wanted(invocation).await?;
        Ok(taken.map(|(id, asked_at, asked_by)| Asked {
            id,
            asked_at: instant(&asked_at).unwrap_or_else(jiff::Timestamp::now),
            asked_by,
        }))
    }

    pub(super) async fn finish_asked_run(&self, finish: &AskedFinish) -> Result<bool, LedgerError> {
        let mut invocation = FINISH_SCRIPT.prepare_invoke();
        invocation
            .key(self.args.keys.asked())
            .key(self.args.keys.asked_running())
            .arg(finish.id)
            .arg(finish.epoch)
            .arg(finish.outcome)
            .arg(finish.exit_code.map(|c| c.to_string()).unwrap_or_default())
            .arg(finish.detail.as_deref().unwrap_or_default())
            .arg(finish.output.as_deref().unwrap_or_default());
        let done: i64 = self.run(invocation).await?;
        Ok(done > 0)
    }

    pub(super) async fn interrupt_stale_asked_runs(&self) -> Result<u64, LedgerError> {
        let mut invocation = INTERRUPT_STALE_SCRIPT.prepare_invoke();
        invocation
            .key(self.guard_key())
            .key(self.args.keys.asked())
            .key(self.args.keys.asked_running())
            .arg(&self.args.nonce);
        let found: i64 = self.run(invocation).await?;
        Ok(found.max(0) as u64)
    }
}

/// Asks job `job` (its keys `job_keys`) of the fleet to run now, saying `asked <job>` on the
/// fleet's `channel`; the request's number.
pub async fn ask(
    conn: &mut MultiplexedConnection,
    job_keys: &Keys,
    job: &str,
    asked_by: &str,
    channel: &str,
) -> Result<i64, LedgerError> {
    ASK_SCRIPT
        .key(job_keys.asked())
        .key(job_keys.asked_queue())
        .arg(asked_by)
        .arg(KEEP)
        .arg(channel)
        // The members read `<sender>:<word>`; no member's id is `cli`.
        .arg(format!("cli:asked {job}"))
        .invoke_async(conn)
        .await
        .map_err(ledger_error)
}

/// The requests of a job (its keys `job_keys`), newest first: `limit` of them from number
/// `top` down (`None`: from the newest).
pub async fn read(
    conn: &mut MultiplexedConnection,
    job_keys: &Keys,
    top: Option<i64>,
    limit: i64,
) -> Result<Vec<AskedEntry>, LedgerError> {
    let rows: Vec<Option<String>> = READ_SCRIPT
        .key(job_keys.asked())
        .arg(top.map(|top| top.to_string()).unwrap_or_default())
        .arg(limit)
        .invoke_async(conn)
        .await
        .map_err(ledger_error)?;
    Ok(rows
        .chunks(2)
        .filter_map(|pair| {
            let mut entry = asked_entry(pair.first()?.as_deref()?)?;
            entry.output = pair.get(1).cloned().flatten();
            Some(entry)
        })
        .collect())
}

/// A request, from its JSON.
fn asked_entry(json: &str) -> Option<AskedEntry> {
    let row: serde_json::Value = serde_json::from_str(json).ok()?;
    let text = |name: &str| row.get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let number = |name: &str| text(name).and_then(|v| v.parse::<i64>().ok());
    let small = |name: &str| number(name).and_then(|v| i32::try_from(v).ok());
    let at = |name: &str| text(name).as_deref().and_then(instant);
    Some(AskedEntry {
        id: number("id")?,
        asked_at: at("asked_at"),
        asked_by: text("asked_by").unwrap_or_default(),
        outcome: text("outcome")?,
        exit_code: small("exit_code"),
        started_at: at("started_at"),
        ended_at: at("ended_at"),
        host: text("host"),
        pid: small("pid"),
        detail: text("detail"),
        output: None,
    })
}
