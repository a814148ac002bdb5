//! Group commit for one session's ledger statements: what falls due together is sent together,
//! in one transaction, and waits for one WAL flush instead of one each.
//!
//! A crontab's jobs share their replica's holder session, and the occurrences of many jobs fall
//! due at one instant (every job of `* * * * *` at the top of the minute). Each claim and each
//! outcome must be committed before it counts, and with `synchronous_commit` on (the default)
//! each commit waits for the server to flush the WAL to disk: a few milliseconds. One
//! transaction per statement, one after the other on one session, made the 33rd claim of a
//! second wait for 32 flushes (a p50 lateness of 140 ms with 100 every-second jobs on three
//! replicas). Here every statement a session's ledgers ask for while a transaction is in flight
//! waits for it, and then all of them go out as the next transaction: one round trip, one flush.
//!
//! The rules that a statement of its own transaction followed still hold:
//! - each statement is bounded by `statement_timeout` and `lock_timeout`, set for the
//!   transaction (`SET LOCAL`), so nothing later on the session inherits the bound;
//! - the transaction's messages go out together, in order, in one go, so that nothing else
//!   the replica sends on the session (a check) falls inside it;
//! - a statement counts only once its transaction has committed: if one statement of a
//!   transaction fails, the others were rolled back with it and are told so (as
//!   [`Outcome::RolledBack`], which the ledger reports as busy, to be tried again).
//!
//! This is the one place below the supervisor with a spawned task and state behind a `Mutex`,
//! which "one task owns the child, the session and the signals; nothing is shared behind
//! locks" (DESIGN.md) would seem to forbid. That rule is about who decides: no two places may
//! disagree on what runs, or act on the session out of turn. Nothing here decides: the task
//! only sends, in order, statements the ledgers chose already. It is a task of its own so that
//! a caller that stops waiting (a crontab job moved to another replica, its future dropped)
//! cannot cancel, half sent, a transaction that carries the others' statements. It lives while
//! statements wait, each bounded by `statement_timeout`, and not past the session: dropping the
//! session aborts its connection, and what waits is told it failed ([`Outcome::NotCommitted`])
//! or [`Outcome::Gone`]. The `Mutex`es hand the queue and the prepared statements between the
//! callers and that task (a spawned task must be `Send`: no `RefCell`); each is held for a few
//! lines without an `.await`, on pgleader's one runtime thread, so nothing ever waits on one
//! and none can delay an event loop.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Error, Row, Statement};

use crate::postgres::locks::{HELD_LOCKS, record_held_locks};

/// One parameter of a statement, owned: the statement is sent later, by whichever task sends
/// its transaction.
pub type Param = (Box<dyn ToSql + Send + Sync>, Type);

/// `value`, typed as `ty`, as a statement's parameter.
pub fn param<T: ToSql + Send + Sync + 'static>(value: T, ty: Type) -> Param {
    (Box::new(value), ty)
}

/// What became of one statement.
#[derive(Debug)]
pub enum Outcome {
    /// It ran and its transaction committed: its rows.
    Committed(Vec<Row>),
    /// It failed: its transaction was rolled back.
    Failed(Error),
    /// It ran, but another statement of its transaction failed, so it was rolled back.
    RolledBack,
    /// The transaction could not be opened or committed (the session is in trouble, or a
    /// serialization failure surfaced at COMMIT): every statement of it is told why.
    NotCommitted(Arc<Error>),
    /// The session went away before the transaction was sent.
    Gone,
}

/// The group commit of one session.
#[derive(Debug)]
pub struct Bundle {
    client: Arc<Client>,
    /// Opens a transaction and bounds its statements.
    begin: String,
    /// The same, and records the advisory locks the session holds (`locks::HELD_LOCKS`).
    begin_reading_held: String,
    state: Mutex<State>,
    /// Each statement text prepared once on the session (a named statement: parsed once, and
    /// planned once its generic plan is as good), by the task that sends transactions.
    prepared: Mutex<HashMap<Arc<str>, Statement>>,
}

#[derive(Debug, Default)]
struct State {
    waiting: Vec<Request>,
    /// Whether a task is sending transactions: it takes what waits when its transaction ends.
    sending: bool,
}

struct Request {
    sql: Arc<str>,
    params: Vec<Param>,
    reply: oneshot::Sender<Outcome>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("sql", &self.sql).finish()
    }
}

impl Bundle {
    /// The group commit of `client`'s session: each statement bounded by `statement_timeout`
    /// (and waiting at most as long for a lock), a transaction idle for longer than `lease`
    /// ended by the server (a replica frozen inside one must still lose its session within the
    /// lease: while a transaction is open, `idle_session_timeout` does not count).
    pub fn new(client: Arc<Client>, statement_timeout: Duration, lease: Duration) -> Bundle {
        let bound = statement_timeout.as_millis().max(1);
        let lease = lease.as_millis().max(1);
        let begin = format!(
            "BEGIN; SET LOCAL statement_timeout = {bound}; SET LOCAL lock_timeout = {bound}; \
             SET LOCAL idle_in_transaction_session_timeout = {lease}"
        );
        Bundle {
            client,
            begin_reading_held: format!("{begin}; {}", record_held_locks()),
            begin,
            state: Mutex::default(),
            prepared: Mutex::default(),
        }
    }

    /// Runs `sql` with `params` in the next transaction, and says what became of it once that
    /// transaction has ended.
    pub async fn run(self: &Arc<Self>, sql: Arc<str>, params: Vec<Param>) -> Outcome {
        let (reply, outcome) = oneshot::channel();
        let start = {
            let mut state = self.state.lock().expect("the bundle's state");
            state.waiting.push(Request { sql, params, reply });
            !std::mem::replace(&mut state.sending, true)
        };
        if start {
            // A task of its own, so that a caller that stops waiting (its job moved away)
            // does not take the others' transaction down with it.
            tokio::spawn(Arc::clone(self).send_all());
        }
        outcome.await.unwrap_or(Outcome::Gone)
    }

    /// Sends transactions until nothing waits.
    async fn send_all(self: Arc<Self>) {
        loop {
            // Statements asked for in the same turn of the event loop (the occurrences due at
            // one instant) join the first.
            tokio::task::yield_now().await;
            let requests = {
                let mut state = self.state.lock().expect("the bundle's state");
                if state.waiting.is_empty() {
                    state.sending = false;
                    return;
                }
                std::mem::take(&mut state.waiting)
            };
            self.send(requests).await;
        }
    }

    /// Prepares on the session the statements of `requests` not prepared yet: each is then
    /// parsed once, and planned once for as long as the server finds its generic plan good
    /// enough (each claim of a crontab's instant was parsed and planned anew: half its cost
    /// on the server). Preparing takes the table's locks as running does, so it is bounded as
    /// a transaction's statements are, in a transaction of its own: a table locked by an
    /// operator must not hold up the session's checks. One that cannot be prepared now is
    /// sent unnamed, and fails in its transaction if it fails at all, as before.
    async fn prepare_new(&self, requests: &[Request]) {
        let new: BTreeMap<&Arc<str>, Vec<Type>> = {
            let known = self.prepared.lock().expect("the prepared statements");
            requests
                .iter()
                .filter(|request| !known.contains_key(&request.sql))
                .map(|request| {
                    let types = request.params.iter().map(|(_, ty)| ty.clone()).collect();
                    (&request.sql, types)
                })
                .collect()
        };
        if new.is_empty() {
            return;
        }
        let client = &self.client;
        let begin = client.batch_execute(&self.begin);
        let prepares: Vec<_> = new
            .iter()
            .map(|(sql, types)| {
                Box::pin(client.prepare_typed(sql, types))
                    as Pin<Box<dyn Future<Output = Result<Statement, Error>> + Send + '_>>
            })
            .collect();
        let commit = client.batch_execute("COMMIT");
        let (_, prepared, _) = in_order(begin, prepares, commit).await;
        let mut known = self.prepared.lock().expect("the prepared statements");
        for (sql, statement) in new.keys().zip(prepared) {
            if let Ok(statement) = statement {
                known.insert(Arc::clone(sql), statement);
            }
        }
    }

    /// One transaction: BEGIN, every request's statement, COMMIT, sent in one go.
    async fn send(&self, requests: Vec<Request>) {
        let client = &self.client;
        self.prepare_new(&requests).await;
        let prepared: Vec<Option<Statement>> = {
            let known = self.prepared.lock().expect("the prepared statements");
            let known = |request: &Request| known.get(&request.sql).cloned();
            requests.iter().map(known).collect()
        };
        // Only a transaction whose statements ask whether the session holds a lock reads
        // the lock table.
        let reads_held = requests
            .iter()
            .any(|request| request.sql.contains(HELD_LOCKS));
        let begin = client.batch_execute(if reads_held {
            &self.begin_reading_held
        } else {
            &self.begin
        });
        let statements: Vec<_> = requests
            .iter()
            .zip(prepared)
            .map(|(request, prepared)| {
                let params = request.params.iter();
                match prepared {
                    Some(statement) => {
                        let params: Vec<&(dyn ToSql + Sync)> = params
                            .map(|(value, _)| &**value as &(dyn ToSql + Sync))
                            .collect();
                        Box::pin(async move { client.query(&statement, &params).await }) as Sent
                    }
                    None => {
                        let params: Vec<(&(dyn ToSql + Sync), Type)> = params
                            .map(|(value, ty)| (&**value as &(dyn ToSql + Sync), ty.clone()))
                            .collect();
                        let sql = &request.sql;
                        Box::pin(async move { client.query_typed(sql, &params).await }) as Sent
                    }
                }
            })
            .collect();
        let commit = client.batch_execute("COMMIT");
        let (begun, results, ended) = in_order(begin, statements, commit).await;
        // A prepared statement that failed is prepared again next time: it may have failed
        // because the table changed under it since it was prepared.
        let failed: Vec<&Arc<str>> = requests
            .iter()
            .zip(&results)
            .filter(|(_, result)| result.is_err())
            .map(|(request, _)| &request.sql)
            .collect();
        if !failed.is_empty() {
            let mut known = self.prepared.lock().expect("the prepared statements");
            for sql in failed {
                known.remove(sql);
            }
        }
        let (begun, ended) = (begun.map_err(Arc::new), ended.map_err(Arc::new));
        let failed = results.iter().any(Result::is_err);
        for (request, result) in requests.into_iter().zip(results) {
            let outcome = match (&begun, result, &ended) {
                (Err(err), _, _) => Outcome::NotCommitted(Arc::clone(err)),
                (_, Err(err), _) => Outcome::Failed(err),
                (_, Ok(_), _) if failed => Outcome::RolledBack,
                (_, Ok(_), Err(err)) => Outcome::NotCommitted(Arc::clone(err)),
                (_, Ok(rows), Ok(())) => Outcome::Committed(rows),
            };
            // A caller that stopped waiting does not want its outcome.
            let _ = request.reply.send(outcome);
        }
    }
}

/// A statement of a transaction, sent when first polled.
type Sent<'a> = Pin<Box<dyn Future<Output = Result<Vec<Row>, Error>> + Send + 'a>>;

/// Polls `first`, then each of `middle`, then `last`, in that order, at every poll until each
/// is done: each sends its request when first polled, so all of them are sent in one go, in
/// order, before anything else the task's caller sends.
async fn in_order<A, B, C>(
    first: impl Future<Output = A>,
    middle: Vec<Pin<Box<dyn Future<Output = B> + Send + '_>>>,
    last: impl Future<Output = C>,
) -> (A, Vec<B>, C) {
    let mut first = std::pin::pin!(first);
    let mut last = std::pin::pin!(last);
    let mut middle: Vec<_> = middle.into_iter().map(|f| (f, None)).collect();
    let (mut a, mut c) = (None, None);
    std::future::poll_fn(|cx| {
        if a.is_none()
            && let Poll::Ready(value) = first.as_mut().poll(cx)
        {
            a = Some(value);
        }
        for (future, out) in &mut middle {
            if out.is_none()
                && let Poll::Ready(value) = future.as_mut().poll(cx)
            {
                *out = Some(value);
            }
        }
        if c.is_none()
            && let Poll::Ready(value) = last.as_mut().poll(cx)
        {
            c = Some(value);
        }
        if a.is_some() && c.is_some() && middle.iter().all(|(_, out)| out.is_some()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    let outs = middle
        .into_iter()
        .map(|(_, out)| out.expect("done"))
        .collect();
    (a.expect("done"), outs, c.expect("done"))
}
