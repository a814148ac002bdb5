//! One Redis session: one connection, for one round of the election, thrown away afterwards.
//!
//! A session subscribes to its own liveness channel, so that others can tell (`PUBSUB NUMSUB`)
//! that its connection is gone, and turns on client-side tracking (`CLIENT TRACKING ON
//! NOLOOP`), so that once it leads, any change of the lock's key by someone else (DEL, a
//! foreign SET, FLUSHALL, the key's expiry) is pushed to it at once. Its own renewals do not
//! notify it (NOLOOP).
//!
//! Waiting blocks on the session's wake list (`BLPOP`), woken by the release of the holder
//! before it. The wait wakes up once per `--check-interval` anyway, to try again: that is how a
//! holder whose connection is gone, or whose key expired, is replaced. A waiting follower costs
//! the server two commands per check interval.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use redis::aio::MultiplexedConnection;
use redis::{PushInfo, PushKind, Value};

use crate::election::ledger::Definition;
use crate::election::step_down::{self, Heard, Requests};
use crate::election::{Check, Confirmation, ConnectError, Fence, Session, SessionError};
use crate::redis::RedisBackend;
use crate::redis::connection::{self, Connection, Purpose, ServerInfo};
use crate::redis::ledger::RedisLedger;
use crate::redis::scripts::{
    self, ACQUIRE_SCRIPT, Keys, RELEASE_SCRIPT, RENEW_SCRIPT, ScriptArgs, millis, nonce,
};
use crate::redis::url::RedisServer;

/// An open session for one lock.
#[derive(Debug)]
pub struct RedisSession {
    connection: Connection,
    /// What every script of this session is given.
    args: ScriptArgs,
    /// How long a follower blocks before it tries again.
    poll: Duration,
    /// Bounds `try_acquire` and each round of a wait.
    try_timeout: Duration,
    /// Set once this session leads: from then on, a change of the key means the lock is lost.
    leading: Arc<AtomicBool>,
    /// An invalidation named the lock's key (or everything) and the key has not been read
    /// since. Kept here rather than in `ended`'s future, which a `select!` may drop mid-read.
    suspect: bool,
    connected_at: Instant,
    /// What the session's name starts with, for the ledger's announcements.
    user_name: Option<String>,
    /// Bounds each of a leader's ledger scripts.
    ledger_timeout: Duration,
    /// Once a leader subscribes: where `ended` passes step-down requests on.
    step_downs: Option<Heard>,
}

impl RedisSession {
    pub async fn connect(backend: &RedisBackend, name: &str) -> Result<RedisSession, ConnectError> {
        let mut connection =
            connection::open(&backend.server, name, Some(&backend.lease), Purpose::Elect).await?;
        let keys = scripts::Keys::of(&backend.lock);
        let nonce = nonce();
        let server = &backend.server;
        enlist(&mut connection, server, &keys, &nonce, &[]).await?;
        let card = scripts::card(connection.client_id, name);
        Ok(RedisSession {
            args: ScriptArgs::new(keys, nonce, card, backend.lease.duration(), backend.poll),
            connection,
            poll: backend.poll,
            try_timeout: server.connect_timeout,
            leading: Arc::new(AtomicBool::new(false)),
            suspect: false,
            connected_at: Instant::now(),
            user_name: backend.user_name.clone(),
            ledger_timeout: backend.ledger_timeout,
            step_downs: None,
        })
    }
}

/// Makes a connection a session's: it subscribes to the session's liveness channel (and to
/// `also`), and tracks the keys it reads, so that a change of the lock's key is pushed to it.
pub(crate) async fn enlist(
    connection: &mut Connection,
    server: &RedisServer,
    keys: &Keys,
    nonce: &str,
    also: &[String],
) -> Result<(), ConnectError> {
    let budget = server.connect_timeout;
    let conn = &mut connection.conn;
    let setup = async {
        let refused = |err: redis::RedisError| match err.code() {
            Some("NOPERM") => ConnectError::Permanent(
                "the Redis ACL does not authorize SUBSCRIBE, which a session needs so \
                 that others can tell it is connected (grant +subscribe or +@pubsub)"
                    .to_string(),
            ),
            _ => connection::classify(server, &err),
        };
        conn.subscribe(keys.alive(nonce)).await.map_err(refused)?;
        for channel in also {
            conn.subscribe(channel).await.map_err(refused)?;
        }
        let tracking: Result<(), _> = redis::cmd("CLIENT")
            .arg("TRACKING")
            .arg("ON")
            .arg("NOLOOP")
            .query_async(conn)
            .await;
        if let Err(err) = tracking {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    event = "redis_tracking",
                    "cannot track the lock's key ({err}): a change of the key by \
                     another client is noticed at the next check rather than at once"
                );
            });
        }
        Ok::<_, ConnectError>(())
    };
    tokio::time::timeout(budget, setup).await.map_err(|_| {
        ConnectError::Transient(format!(
            "no answer within {}",
            humantime::format_duration(budget)
        ))
    })?
}

/// One try of the acquire script: true if this session now leads. `young` is the uptime under
/// which a server refuses its vote (Redlock's delayed restart; zero for one server).
pub(crate) async fn acquire(
    conn: &mut MultiplexedConnection,
    args: &ScriptArgs,
    mode: &str,
    young: Duration,
) -> Result<bool, SessionError> {
    let (acquired, blind): (i64, i64) = args
        .invocation(&ACQUIRE_SCRIPT)
        .arg(mode)
        .arg(&args.card)
        .arg(millis(young))
        .invoke_async(conn)
        .await
        .map_err(query_error)?;
    if blind == 1 {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                event = "redis_liveness",
                "the Redis ACL refuses PUBSUB NUMSUB: a crashed leader is replaced only when its \
                 key expires (--lease), not as soon as its connection is gone"
            );
        });
    }
    Ok(acquired == 1)
}

/// A failed command of a session. The ACL's refusal is permanent: retrying cannot help, so it
/// ends pgleader (as a transaction pooler does on PostgreSQL) rather than loop. Inside a script,
/// Redis 7.0 reports it as ERR "The user executing the script can't ...", not NOPERM.
pub(crate) fn query_error(err: redis::RedisError) -> SessionError {
    let refused_in_script = err.to_string().contains("user executing the script can't");
    if err.code() == Some("NOPERM") || refused_in_script {
        return SessionError::Unsafe(format!(
            "the Redis ACL does not authorize what pgleader needs ({err}); README.md, \
             \"Redis\", lists the whole ACL"
        ));
    }
    SessionError::Query(err.to_string())
}

/// A server time from TIME's seconds and microseconds.
pub(crate) fn timestamp(seconds: i64, micros: i64) -> Timestamp {
    Timestamp::new(seconds, i32::try_from(micros * 1000).unwrap_or(0))
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Whether an invalidation push names the lock's key (a null means every key: FLUSHALL).
pub(crate) fn invalidates(push: &PushInfo, key: &str) -> bool {
    match push.data.first() {
        None | Some(Value::Nil) => true,
        Some(Value::Array(keys)) => keys.iter().any(|k| match k {
            Value::BulkString(bytes) => bytes == key.as_bytes(),
            Value::SimpleString(text) => text == key,
            _ => false,
        }),
        Some(_) => false,
    }
}

/// The request a message on `channel` carries, if it is one.
fn step_down_request(push: &PushInfo, channel: &str) -> Option<String> {
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    match push.data.as_slice() {
        [on, payload] if text(on).as_deref() == Some(channel) => {
            text(payload).filter(|payload| step_down::is_request(payload))
        }
        _ => None,
    }
}

impl RedisSession {
    /// A handle on the session's connection, for a check made before it is used.
    pub(crate) fn conn(&self) -> MultiplexedConnection {
        self.connection.conn.clone()
    }
}

impl Session for RedisSession {
    type Ledger = RedisLedger;

    /// The server's id for this connection (`CLIENT ID`).
    fn id(&self) -> i32 {
        i32::try_from(self.connection.client_id).unwrap_or(i32::MAX)
    }

    fn server_version(&self) -> u32 {
        self.connection.server_major
    }

    fn age(&self) -> Duration {
        self.connected_at.elapsed()
    }

    /// The TCP socket under the connection (under TLS too). While the keeper holds it, a
    /// crashed pgleader's connection stays open, and its liveness channel subscribed, so no
    /// follower takes over before the command's whole tree is gone.
    fn sockets(&self) -> Vec<std::os::fd::RawFd> {
        self.connection.open_socket().into_iter().collect()
    }

    /// The socket, with the release for the keeper to send if pgleader dies, so that a
    /// follower takes over as soon as the old tree is gone rather than at its next check.
    fn lend(&self) -> Vec<crate::election::socket::Lent> {
        self.connection
            .lend(|marker| self.args.farewell(marker))
            .into_iter()
            .collect()
    }

    /// An invalidation of the lock's key is a suspicion, not yet a loss: the server's tracking
    /// table knows key names, not databases, so FLUSHDB of any database, or a write to a key of
    /// the same name in another one, is pushed too. The key is read again (which also re-arms
    /// tracking) and the leadership ends only if it is no longer this session's.
    async fn ended(&mut self) -> String {
        loop {
            if self.suspect {
                let mut conn = self.connection.conn.clone();
                let value: Option<String> = match redis::cmd("GET")
                    .arg(&self.args.keys.lock)
                    .query_async(&mut conn)
                    .await
                {
                    Ok(value) => value,
                    Err(err) => {
                        return format!(
                            "cannot read the lock's key after it was invalidated: {err}"
                        );
                    }
                };
                if value.as_deref().and_then(scripts::holder_nonce)
                    != Some(self.args.nonce.as_str())
                {
                    return format!(
                        "the lock's key {} was changed by another client (deleted, \
                         overwritten, flushed) or expired",
                        self.args.keys.lock
                    );
                }
                self.suspect = false;
            }
            match self.connection.pushes.recv().await {
                None => return "the connection was closed".into(),
                Some(push) if push.kind == PushKind::Disconnection => {
                    return "the server closed the connection".into();
                }
                Some(push)
                    if push.kind == PushKind::Invalidate
                        && self.leading.load(Ordering::Relaxed)
                        && invalidates(&push, &self.args.keys.lock) =>
                {
                    self.suspect = true;
                }
                Some(push) if push.kind == PushKind::Message => {
                    if let Some(requests) = &self.step_downs
                        && let Some(request) = step_down_request(&push, &self.args.keys.step_down())
                    {
                        let _ = requests.send(request);
                    }
                }
                Some(_) => {}
            }
        }
    }

    /// SUBSCRIBEs on the session's connection, which already carries its liveness channel:
    /// no connection of its own. Sent beside the fence, the connection pipelines both.
    fn listen(
        &mut self,
    ) -> (
        Requests,
        impl Future<Output = Result<(), SessionError>> + 'static,
    ) {
        let (heard, requests) = tokio::sync::mpsc::unbounded_channel();
        self.step_downs = Some(heard);
        let mut conn = self.connection.conn.clone();
        let channel = self.args.keys.step_down();
        let sent = async move { conn.subscribe(channel).await.map_err(query_error) };
        (requests, sent)
    }

    /// Tries, then blocks on the wake list until woken or a check interval has passed, and
    /// tries again: no busy polling, and a dead holder is noticed within a check interval.
    fn wait(&self) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        let leading = self.leading.clone();
        let (poll, bound) = (self.poll, self.poll + self.try_timeout);
        let wake = args.keys.wake(&args.nonce);
        async move {
            loop {
                let attempt =
                    tokio::time::timeout(bound, acquire(&mut conn, &args, "wait", Duration::ZERO));
                if attempt.await.map_err(|_| no_answer(bound))?? {
                    leading.store(true, Ordering::Relaxed);
                    return Ok(());
                }
                let woken: redis::RedisResult<Option<(String, String)>> = tokio::time::timeout(
                    bound,
                    redis::cmd("BLPOP")
                        .arg(&wake)
                        .arg(poll.as_secs_f64())
                        .query_async(&mut conn),
                )
                .await
                .map_err(|_| no_answer(bound))?;
                woken.map_err(query_error)?;
            }
        }
    }

    async fn try_acquire(&self) -> Result<bool, SessionError> {
        let mut conn = self.connection.conn.clone();
        match tokio::time::timeout(
            self.try_timeout,
            acquire(&mut conn, &self.args, "try", Duration::ZERO),
        )
        .await
        {
            Ok(Ok(acquired)) => {
                if acquired {
                    self.leading.store(true, Ordering::Relaxed);
                }
                Ok(acquired)
            }
            Ok(Err(SessionError::Query(reason))) => Err(SessionError::Query(format!(
                "cannot try the lock: {reason}"
            ))),
            Ok(Err(other)) => Err(other),
            Err(_) => Err(SessionError::Query(format!(
                "cannot try the lock: {}",
                no_answer(self.try_timeout)
            ))),
        }
    }

    /// The epoch the acquire script wrote into the key, the server's clock, and its uptime
    /// (the restart fence). Reading the key also arms tracking for it: from here on a change
    /// by anyone else is pushed to this session.
    ///
    /// It renews the key first. The key's TTL ran from when the acquire script ran, but the
    /// leader's deadline runs from when this request was sent, which can be much later (a slow
    /// answer to the acquire, a stalled pgleader): without the renewal the key could expire,
    /// and a follower start, before this leader has stopped its command.
    async fn fence(&self) -> Result<Fence, SessionError> {
        let mut conn = self.connection.conn.clone();
        let ((held, seconds, micros), value, info): ((i64, i64, i64), Option<String>, String) =
            redis::pipe()
                .add_command(self.args.eval(&scripts::RENEW_SOURCE))
                .cmd("GET")
                .arg(&self.args.keys.lock)
                .cmd("INFO")
                .arg("server")
                .query_async(&mut conn)
                .await
                .map_err(query_error)?;
        let value = value.unwrap_or_default();
        if held != 1 || scripts::holder_nonce(&value) != Some(self.args.nonce.as_str()) {
            return Err(SessionError::Query(format!(
                "the lock's key {} is no longer this session's",
                self.args.keys.lock
            )));
        }
        let epoch = scripts::field(&value, "epoch")
            .and_then(|epoch| epoch.parse().ok())
            .ok_or_else(|| {
                SessionError::Query(format!("no epoch in the lock's value {value:?}"))
            })?;
        let uptime = ServerInfo::parse(&info).uptime.unwrap_or(Duration::ZERO);
        Ok(Fence {
            epoch,
            server_time: timestamp(seconds, micros),
            since_server_reset: uptime,
        })
    }

    /// Extends the key's TTL to a lease from now, only if it is still this session's.
    fn confirm(&self) -> impl Future<Output = Result<Check, SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        async move {
            let (held, seconds, micros): (i64, i64, i64) = args
                .invocation(&RENEW_SCRIPT)
                .invoke_async(&mut conn)
                .await
                .map_err(query_error)?;
            Ok(Check {
                confirmation: if held == 1 {
                    Confirmation::Held
                } else {
                    Confirmation::NotHeld
                },
                server_time: timestamp(seconds, micros),
            })
        }
    }

    /// Deletes the key if it is still this session's and wakes the next waiter, then closes.
    async fn release(self, timeout: Duration) -> Result<(), SessionError> {
        let mut conn = self.connection.conn.clone();
        let invocation = self.args.invocation(&RELEASE_SCRIPT);
        let release = invocation.invoke_async::<i64>(&mut conn);
        match tokio::time::timeout(timeout, release).await {
            Ok(Ok(1)) => Ok(()),
            Ok(Ok(_)) => Err(SessionError::Query(
                "the lock's key was no longer this session's".into(),
            )),
            Ok(Err(err)) => Err(query_error(err)),
            Err(_) => Err(no_answer(timeout)),
        }
    }

    fn ledger(&self, definition: &Definition) -> RedisLedger {
        RedisLedger::new(
            self.connection.conn.clone(),
            self.args.clone(),
            definition.clone(),
            self.user_name.clone(),
            self.connection.client_id,
            (
                self.ledger_timeout,
                Arc::clone(&self.connection.ledger_slots),
            ),
        )
    }
}

pub(crate) fn no_answer(bound: Duration) -> SessionError {
    SessionError::Query(format!(
        "no answer from the server within {}",
        humantime::format_duration(bound)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalidation_names_the_key_or_everything() {
        let push = |data| PushInfo {
            kind: PushKind::Invalidate,
            data,
        };
        let key = "pgleader:{a}";
        assert!(invalidates(
            &push(vec![Value::Array(vec![Value::BulkString(key.into())])]),
            key
        ));
        assert!(!invalidates(
            &push(vec![Value::Array(vec![Value::BulkString(
                b"other".to_vec()
            )])]),
            key
        ));
        assert!(invalidates(&push(vec![Value::Nil]), key), "FLUSHALL");
    }
}
