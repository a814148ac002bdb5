//! A replica's holder connection: it subscribes, joins, reads (and renews) the roster, takes
//! and gives items and leaves; for a crontab it hands out each job's ledger, guarded by the
//! job's item key, and lends its socket with the farewells a keeper says if pgleader dies.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{ErrorKind, PushKind, ServerErrorKind, Value};

use super::roster::{Answer, Cards, card_of, read_roster, runs_otherwise, seen_items, who};
use super::scripts::{
    Args, FAREWELL_SOURCE, GIVE_SCRIPT, JOIN_SCRIPT, LEAVE_SCRIPT, MEMBERSHIP_FAREWELL_SOURCE,
    RECARD_SCRIPT, ROSTER_SCRIPT, ShardKeys, TAKE_SCRIPT,
};
use crate::election::ledger::{Definition, LedgerError};
use crate::election::lock::LockKey;
use crate::election::shards::{Holder, HolderEvent, Items, JoinError, Seen, gave_word};
use crate::election::{ConnectError, Fence, SessionError};
use crate::redis::RedisBackend;
use crate::redis::connection::{self, Connection, Purpose, ServerInfo};
use crate::redis::ledger::{Guard, RedisLedger};
use crate::redis::scripts::{self, Keys, ScriptArgs, nonce};
use crate::redis::session::{no_answer, query_error, timestamp};

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
    /// The members' cards as the last roster read found them, parsed (see [`Cards`]).
    cards: Arc<Mutex<Arc<Cards>>>,
    /// The last roster read in full (see [`Answered`]).
    answered: Arc<Mutex<Answered>>,
    /// The roster read, as `args` make it (see [`Args::roster_command`]).
    roster_command: redis::Cmd,
}

/// The last roster read in full for this member's items as they are: its answer's digest and
/// what was seen. The next read sends the digest; an answer that says it is the same is that
/// roster, not read again. `items` counts the changes of the items (the digest does not cover
/// the caller's own list): a read sent for other items stores nothing and uses nothing.
#[derive(Debug, Default)]
struct Answered {
    items: u64,
    last: Option<(String, Seen)>,
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
                let roster_command = args.roster_command();
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
                    cards: Arc::default(),
                    answered: Arc::default(),
                    roster_command,
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

impl Holder for RedisShardHolder {
    type Ledger = RedisLedger;

    /// The job's ledger under `pgleader:{NAME}:job:<job>` on the holder connection, its claims
    /// guarded by the job's item key (see `shards/mod.rs`).
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
            (
                self.ledger.timeout,
                Arc::clone(&self.connection.ledger_slots),
            ),
        );
        Some(ledger.guarded_by(Guard::Item {
            shard: self.args.keys.shard(item),
            paused: fleet.paused(),
            job: job_name(job),
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
        self.roster_command = self.args.roster_command();
        {
            let mut answered = self.answered.lock().expect("not poisoned");
            answered.items += 1;
            answered.last = None;
        }
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
    /// A crontab's job keepers release only their job (see `FAREWELL` in `scripts.rs`): the
    /// keeper of the membership ([`Holder::lend_membership`]) ends the membership after the
    /// last of them.
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

    /// Reads the roster and renews this member's card and shards (see `shards/mod.rs`).
    fn roster(&self) -> impl Future<Output = Result<Seen, SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        let store = Arc::clone(&self.cards);
        let before = Arc::clone(&store.lock().expect("not poisoned"));
        let answered = Arc::clone(&self.answered);
        let command = self.roster_command.clone();
        let (generation, mut since) = {
            let answered = answered.lock().expect("not poisoned");
            let since = answered.last.as_ref().map(|(digest, _)| digest.clone());
            (answered.items, since)
        };
        async move {
            let (server_time, flat, holders, plain, added, digest) = loop {
                let mut command = command.clone();
                if let Some(since) = &since {
                    command.arg("since").arg(since);
                }
                let answer = match command.query_async(&mut conn).await {
                    Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                        ROSTER_SCRIPT
                            .load_async(&mut conn)
                            .await
                            .map_err(query_error)?;
                        command.query_async(&mut conn).await
                    }
                    answer => answer,
                };
                let (seconds, micros, flat, holders, plain, added, digest): Answer =
                    answer.map_err(query_error)?;
                let server_time = timestamp(seconds, micros);
                if since.as_ref() != Some(&digest) {
                    break (server_time, flat, holders, plain, added, digest);
                }
                let stored = answered.lock().expect("not poisoned");
                if stored.items == generation
                    && let Some((last, seen)) = &stored.last
                    && *last == digest
                {
                    return Ok(Seen {
                        server_time,
                        unchanged: true,
                        ..seen.clone()
                    });
                }
                // Another read stored its answer meanwhile, or the items changed: read in full.
                drop(stored);
                since = None;
            };
            // This member's items in the order it gave them, then those the others' cards
            // added (see `ROSTER`).
            let read: Vec<u32> = match &args.items {
                Items::Listed(listing) => listing.items.iter().copied().chain(added).collect(),
                Items::Numbered(_) => args.items.iter().collect(),
            };
            let items = seen_items(&args.items, &read);
            let (mut seen, cards) =
                read_roster(&items, &read, (&flat, &before), &holders, server_time)?;
            *store.lock().expect("not poisoned") = Arc::new(cards);
            if let Some(plain) = plain {
                seen.mismatch = Some(format!(
                    "a replica runs this lock without --shards ({plain}): a lock runs either \
                     sharded on every replica or on none"
                ));
            }
            let mut stored = answered.lock().expect("not poisoned");
            if stored.items == generation {
                stored.last = Some((digest, seen.clone()));
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

    async fn give(&self, shards: &[u32]) -> Result<Vec<u32>, SessionError> {
        let mut conn = self.connection.conn.clone();
        let mut invocation = self.args.invocation(&GIVE_SCRIPT);
        invocation.arg(gave_word(shards));
        for shard in shards {
            invocation.arg(*shard);
        }
        invocation
            .invoke_async(&mut conn)
            .await
            .map_err(query_error)
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
