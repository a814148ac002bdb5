//! A replica's holder session: it joins (member lock, markers, LISTEN), reads the roster, takes
//! and gives shards and leaves; for a crontab it holds the "knows" and "defines" markers of its
//! jobs and hands out each job's ledger, guarded by the job's shard lock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

use super::roster::{MarkersRead, read_roster};
use super::statements::{
    DEFINE_SQL, DIGEST_SQL, END_SESSIONS_SQL, FORGET_SQL, GIVE_SQL, KNOW_SQL, MAX_SHARDS,
    ROSTER_SQL, ShardKeys, TAKE_SQL, UNDEFINE_SQL, UNDIGEST_SQL,
};
use crate::election::ledger::{Definition, Ledger, LedgerError};
use crate::election::lock::LockKey;
use crate::election::shards::{Holder, HolderEvent, Items, JoinError, Seen, gave_word};
use crate::election::{Fence, Session, SessionError};
use crate::postgres::PgBackend;
use crate::postgres::connect::Notifications;
use crate::postgres::ledger::{Guard, PgLedger};
use crate::postgres::session::{PgSession, query_error};

/// A replica's holder session: its membership, its markers and the shards it runs.
#[derive(Debug)]
pub struct PgShardHolder {
    session: PgSession,
    keys: ShardKeys,
    items: Items,
    /// The "defines" spaces of `items`' jobs, each with its job, as a roster read asks for
    /// them: worked out once per change of the items, not at every check.
    spaces: Arc<BTreeMap<u32, u32>>,
    /// The digest of this member's markers, once it holds them (see `shards/mod.rs`).
    digest: Option<u32>,
    /// The others' markers as last read (see `MarkersRead`): of the jobs in `spaces`, and so
    /// dropped when they change.
    read: Arc<Mutex<Arc<MarkersRead>>>,
    /// The last roster read in full (see [`Answered`]).
    answered: Arc<Mutex<Option<Answered>>>,
    notifications: Notifications,
}

/// A roster read in full: the answer's digest, what was seen, and the markers it was read
/// with. The next read sends the digest while the markers read are the same; an answer with
/// that digest is the same roster, and is not read again.
#[derive(Debug)]
struct Answered {
    read: Arc<MarkersRead>,
    digest: String,
    seen: Seen,
}

impl PgShardHolder {
    /// Connects, joins the roster (member lock, markers, LISTEN) and refuses to go on beside a
    /// replica that runs the name otherwise; then tells the others it joined.
    pub async fn join(
        backend: &PgBackend,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> Result<PgShardHolder, JoinError> {
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
        let mut holder = PgShardHolder {
            session,
            keys,
            items: Items::Listed(Default::default()),
            spaces: Arc::default(),
            digest: None,
            read: Arc::default(),
            answered: Arc::default(),
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

impl Holder for PgShardHolder {
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
        let ledger = self
            .session
            .ledger_of(&self.keys.plain, Guard::Plain, &definition);
        let location = ledger.prepare().await?;
        // The jobs' claims look their pauses up (`pgleader cron pause`).
        ledger.prepare_pauses().await?;
        Ok(location)
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
        let spaces = Arc::clone(&self.spaces);
        let store = Arc::clone(&self.read);
        let read = Arc::clone(&store.lock().expect("not poisoned"));
        let answered = Arc::clone(&self.answered);
        let mut last = answered
            .lock()
            .expect("not poisoned")
            .as_ref()
            .filter(|last| Arc::ptr_eq(&last.read, &read))
            .map(|last| last.digest.clone());
        async move {
            let defines: Vec<u32> = spaces.keys().copied().collect();
            let (space, classid, objid, knows, markers) = (
                keys.space as u32,
                keys.plain.classid(),
                keys.plain.objid(),
                keys.knows as u32,
                keys.markers as u32,
            );
            let (members, digests): (Vec<i32>, Vec<u32>) =
                read.iter().map(|(&id, marked)| (id, marked.digest)).unzip();
            let (rows, digest) = loop {
                let rows = client
                    .query_typed(
                        ROSTER_SQL,
                        &[
                            (&space, Type::OID),
                            (&classid, Type::OID),
                            (&objid, Type::OID),
                            (&knows, Type::OID),
                            (&defines, Type::OID_ARRAY),
                            (&markers, Type::OID),
                            (&members, Type::INT4_ARRAY),
                            (&digests, Type::OID_ARRAY),
                            (&last, Type::TEXT),
                        ],
                    )
                    .await
                    .map_err(query_error)?;
                let pid: i32 = rows.first().map_or(0, |row| row.get(0));
                if pid != me {
                    return Err(SessionError::Unsafe(format!(
                        "this session's server process changed from {me} to {pid}: a \
                         transaction pooler stands between"
                    )));
                }
                let digest: Option<String> = rows.first().and_then(|row| row.get(7));
                if digest.is_none() || digest != last {
                    break (rows, digest);
                }
                if let Some(same) = answered.lock().expect("not poisoned").as_ref()
                    && Some(&same.digest) == digest.as_ref()
                    && Arc::ptr_eq(&same.read, &read)
                {
                    return Ok(Seen {
                        server_time: rows[0].get(1),
                        unchanged: true,
                        ..same.seen.clone()
                    });
                }
                // The jobs changed meanwhile (`know` dropped what was read): read in full.
                last = None;
            };
            let (seen, marked) = read_roster(&keys, &items, &spaces, &read, &rows)?;
            // Unless the jobs changed meanwhile (`know` dropped what was read of them).
            let mut stored = store.lock().expect("not poisoned");
            if Arc::ptr_eq(&stored, &read) {
                let marked = Arc::new(marked);
                *stored = Arc::clone(&marked);
                *answered.lock().expect("not poisoned") = digest.map(|digest| Answered {
                    read: marked,
                    digest,
                    seen: seen.clone(),
                });
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

    /// Releases the shards (their commands are gone) and tells the others, who take them at
    /// once.
    async fn give(&self, shards: &[u32]) -> Result<Vec<u32>, SessionError> {
        let payload = gave_word(shards);
        let channel = self.keys.channel();
        let shards: Vec<i32> = shards.iter().map(|&shard| shard as i32).collect();
        let rows = self
            .session
            .client()
            .query_typed(
                GIVE_SQL,
                &[
                    (&self.keys.space, Type::INT4),
                    (&shards, Type::INT4_ARRAY),
                    (&channel, Type::TEXT),
                    (&payload, Type::TEXT),
                ],
            )
            .await
            .map_err(query_error)?;
        Ok(rows.iter().map(|row| row.get::<_, i32>(0) as u32).collect())
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

impl PgShardHolder {
    /// Holds the "knows job n" marker of each of a crontab's `items`, and of no other job.
    async fn know(&mut self, items: &Items) -> Result<(), SessionError> {
        let (Items::Listed(new), Items::Listed(old)) = (items, &self.items) else {
            self.items = items.clone();
            self.spaces = Arc::default();
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
        // The old digest goes first: a reader that found it while the markers change would
        // keep half-changed markers under it, and take them for settled should this member
        // come back to that file (a rollback) before the reader read it again.
        let markers = self.keys.markers;
        let by_digest = |sql, digest: u32| async move {
            let params: [(&(dyn ToSql + Sync), Type); 2] =
                [(&markers, Type::INT4), (&(digest as i32), Type::INT4)];
            client.query_typed(sql, &params).await.map(drop)
        };
        let digest = new.digest();
        let changed = self.digest != Some(digest);
        if let Some(old) = self.digest.filter(|_| changed) {
            by_digest(UNDIGEST_SQL, old).await.map_err(query_error)?;
            self.digest = None;
        }
        by_pairs(DEFINE_SQL, define).await.map_err(query_error)?;
        by_items(KNOW_SQL, know).await.map_err(query_error)?;
        by_items(FORGET_SQL, forget).await.map_err(query_error)?;
        by_pairs(UNDEFINE_SQL, undefine)
            .await
            .map_err(query_error)?;
        // Then the new digest: a reader that finds one digest finds the markers it says.
        if changed {
            by_digest(DIGEST_SQL, digest).await.map_err(query_error)?;
        }
        self.digest = Some(digest);
        self.items = items.clone();
        self.spaces = Arc::new(self.keys.defines_of(new.items.iter().copied()));
        *self.read.lock().expect("not poisoned") = Arc::default();
        *self.answered.lock().expect("not poisoned") = None;
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
