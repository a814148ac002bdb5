//! A session over a quorum: one connection per reachable server, the same value on each, and
//! the rounds that ask them all. With the guards Redlock's critics ask for:
//!
//! - **Acquire** on every server at once, each bounded; leadership only if a majority accepted
//!   and the time the round took, plus a drift allowance, leaves the lease some validity.
//!   Otherwise the key is released wherever it was set.
//! - **Renew** on every server (compare, then extend: never re-create); a check confirms the
//!   leadership as soon as a majority renewed, and fails as soon as a majority no longer can.
//!   The leader's deadline runs on its monotonic clock from when the check was sent.
//! - **Delayed restart**: a server up for less than a lease refuses its vote, so a server that
//!   restarted without its data cannot hand a live leader's lock to someone else.
//! - **Epochs** from the majority: the largest epoch the majority handed out, written back to
//!   every server before the command starts, so the next majority (which shares a server with
//!   this one) starts above it.
//! - **Loss by events**: a connection's end and a change of the key (tracking pushes) count
//!   against the majority at once; the leadership ends when fewer than a majority still hold.
//! - Followers wait for a release's message on any server (pub/sub), and try again every
//!   `--check-interval`, with jitter, to replace a holder whose connections are gone.
//!
//! Unlike one server, a quorum does not queue its waiters: a released lock goes to whichever
//! waiter reaches a majority first. Scheduled jobs keep their ledger on every server, and an
//! answer counts only from a majority (`ledger.rs`).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{PushInfo, PushKind};
use tokio::sync::{Notify, mpsc};
use tokio::task::{JoinHandle, JoinSet};

use super::QuorumBackend;
use super::ledger::QuorumLedger;
use crate::election::lease::Lease;
use crate::election::ledger::Definition;
use crate::election::majority::Majority;
use crate::election::step_down::{self, Requests};
use crate::election::{Check, Confirmation, ConnectError, Fence, Session, SessionError};
use crate::redis::connection::{self, Connection, Purpose, ServerInfo};
use crate::redis::ledger::RedisLedger;
use crate::redis::scripts::{self, Keys, RELEASE_SCRIPT, RENEW_SCRIPT, ScriptArgs, nonce};
use crate::redis::session::{acquire, enlist, invalidates, no_answer, query_error, timestamp};
use crate::redis::url::RedisServer;

/// Raises a server's epoch counter to at least ARGV[1].
static RAISE_EPOCH: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r#"
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"#,
    )
});

/// Raises the epoch counter `key` on one server to at least `epoch`, for the fence and for a
/// server the leader rejoins.
pub(super) async fn raise_epoch(
    conn: &mut MultiplexedConnection,
    key: String,
    epoch: i64,
) -> redis::RedisResult<i64> {
    let mut invocation = RAISE_EPOCH.prepare_invoke();
    invocation.key(key).arg(epoch);
    invocation.invoke_async::<i64>(conn).await
}

/// What a member's connection reports, through its forwarder: (slot, generation, push).
type Pushes = mpsc::UnboundedSender<(usize, u64, PushInfo)>;

/// One server's connection in a quorum session, and what the quorum adds to it: which server
/// it reaches, its generation, and the task that forwards its pushes to the session.
#[derive(Debug)]
pub(super) struct Member {
    pub(super) server: RedisServer,
    /// Tells this connection's pushes from those of the connection it replaced.
    generation: u64,
    /// Forwards the connection's pushes (see [`forward`]).
    forwarder: JoinHandle<()>,
    connection: Connection,
}

impl Member {
    /// A member over a connection; its pushes are forwarded, tagged with its slot and
    /// generation, to the session.
    pub(super) fn new(
        server: RedisServer,
        mut connection: Connection,
        (index, generation): (usize, u64),
        (keys, released, out): (&Keys, &Arc<Notify>, &Pushes),
    ) -> Member {
        let (_, dummy) = mpsc::unbounded_channel();
        let receiver = std::mem::replace(&mut connection.pushes, dummy);
        Member {
            server,
            generation,
            forwarder: tokio::spawn(forward(
                (index, generation),
                receiver,
                keys.released(),
                released.clone(),
                out.clone(),
            )),
            connection,
        }
    }

    /// A handle on the connection, to send on (redis-rs multiplexes the clones).
    fn conn(&self) -> MultiplexedConnection {
        self.connection.conn.clone()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.forwarder.abort();
    }
}

/// A session over a quorum: one connection per reachable server, the same nonce on each.
#[derive(Debug)]
pub struct QuorumSession {
    pub(super) members: Vec<Member>,
    /// How many servers the quorum has, reachable or not.
    total: usize,
    pub(super) args: ScriptArgs,
    pub(super) poll: Duration,
    /// Bounds each server's answer in a round.
    per_server: Duration,
    pub(super) leading: Arc<AtomicBool>,
    /// A release was published on some server.
    pub(super) released: Arc<Notify>,
    /// What the members' connections report: (member, generation, push).
    pushes: mpsc::UnboundedReceiver<(usize, u64, PushInfo)>,
    /// Where new members' forwarders send.
    pub(super) out: Pushes,
    /// Members whose connection ended or whose key changed under the leadership, and why.
    pub(super) lost: Vec<Option<String>>,
    /// Members whose connection ended: a leader connects to them again (see [`Rejoined`]).
    pub(super) gone: Vec<bool>,
    /// Servers not reachable when the session connected (`None` once a leader reached them).
    pub(super) absent: Vec<Option<RedisServer>>,
    /// Reconnections under way, and when to try the next ones.
    pub(super) rejoins: JoinSet<Rejoined>,
    pub(super) next_rejoin: Instant,
    pub(super) generations: u64,
    /// What a reconnection needs: the session's name, its lease, and the epoch it fenced.
    pub(super) name: String,
    pub(super) lease: Lease,
    pub(super) epoch: Arc<AtomicI64>,
    /// Members whose key was invalidated and must be read again: tracking knows key names, not
    /// databases, so a change in another database is pushed too.
    pub(super) suspect: Vec<bool>,
    connected_at: Instant,
    user_name: Option<String>,
    ledger_timeout: Duration,
}

/// A leader's new connection to a server it had lost (its connection ended, or it was not
/// reachable at first), with this leadership's key set there again (see `rejoin.rs`).
#[derive(Debug)]
pub(super) struct Rejoined {
    /// The member's slot, or the server's place among the absent.
    pub(super) slot: Result<usize, usize>,
    pub(super) server: RedisServer,
    /// The connection, with the key set to this session's value, or why not.
    pub(super) connection: Result<Connection, String>,
}

/// Reads one member's pushes: a release's message wakes the waiters; everything else goes to
/// the session's [`Session::ended`].
async fn forward(
    (index, generation): (usize, u64),
    mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    released_channel: String,
    released: Arc<Notify>,
    out: Pushes,
) {
    while let Some(push) = pushes.recv().await {
        let is_release = push.kind == PushKind::Message
            && matches!(push.data.first(), Some(redis::Value::BulkString(channel)) if channel == released_channel.as_bytes());
        if is_release {
            released.notify_waiters();
        } else if out.send((index, generation, push)).is_err() {
            return;
        }
    }
    let _ = out.send((
        index,
        generation,
        PushInfo {
            kind: PushKind::Disconnection,
            data: Vec::new(),
        },
    ));
}

impl QuorumSession {
    pub async fn connect(
        backend: &QuorumBackend,
        name: &str,
    ) -> Result<QuorumSession, ConnectError> {
        let keys = Keys::of(&backend.lock);
        let nonce = nonce();
        let mut opening = JoinSet::new();
        for (index, server) in backend.servers.iter().enumerate() {
            let (server, name, lease) = (server.clone(), name.to_owned(), backend.lease);
            let (keys, nonce) = (keys.clone(), nonce.clone());
            opening.spawn(async move {
                let opened = async {
                    let mut connection =
                        connection::open(&server, &name, Some(&lease), Purpose::Elect).await?;
                    enlist(&mut connection, &server, &keys, &nonce, &[keys.released()]).await?;
                    Ok::<_, ConnectError>(connection)
                };
                // Each server's failure names it: the quorum's message lists several.
                match opened.await {
                    Ok(connection) => Ok((index, connection)),
                    Err(ConnectError::Permanent(reason)) => {
                        Err(ConnectError::Permanent(format!("{server}: {reason}")))
                    }
                    Err(ConnectError::Transient(reason)) => {
                        Err(ConnectError::Transient(format!("{server}: {reason}")))
                    }
                    // Redis never says so; kept as it is.
                    Err(err @ ConnectError::Conflict(_)) => Err(err),
                }
            });
        }
        let mut opened = Vec::new();
        let mut failures = Vec::new();
        while let Some(joined) = opening.join_next().await {
            match joined {
                Ok(Ok(member)) => opened.push(member),
                Ok(Err(err @ (ConnectError::Permanent(_) | ConnectError::Conflict(_)))) => {
                    return Err(err);
                }
                Ok(Err(ConnectError::Transient(reason))) => failures.push(reason),
                Err(err) => failures.push(err.to_string()),
            }
        }
        if opened.len() < backend.quorum() {
            return Err(ConnectError::Transient(format!(
                "only {} of {} servers reachable, fewer than a majority: {}",
                opened.len(),
                backend.servers.len(),
                failures.join("; ")
            )));
        }
        opened.sort_by_key(|(index, _)| *index);
        let absent: Vec<Option<RedisServer>> = backend
            .servers
            .iter()
            .enumerate()
            .filter(|(index, _)| !opened.iter().any(|(opened, _)| opened == index))
            .map(|(_, server)| Some(server.clone()))
            .collect();
        let released = Arc::new(Notify::new());
        let (out, pushes) = mpsc::unbounded_channel();
        let mut members = Vec::new();
        for (index, (server_index, connection)) in opened.into_iter().enumerate() {
            let server = backend.servers[server_index].clone();
            let forwarding = (&keys, &released, &out);
            members.push(Member::new(server, connection, (index, 0), forwarding));
        }
        let card = scripts::card(members[0].connection.client_id, name);
        let (lost, suspect) = (vec![None; members.len()], vec![false; members.len()]);
        let gone = vec![false; members.len()];
        Ok(QuorumSession {
            total: backend.servers.len(),
            args: ScriptArgs::new(keys, nonce, card, backend.lease.duration(), backend.poll),
            poll: backend.poll,
            per_server: backend
                .servers
                .iter()
                .map(|server| server.connect_timeout)
                .min()
                .unwrap_or(Duration::from_secs(1))
                .min(backend.lease.duration() / 10)
                .max(Duration::from_millis(50)),
            members,
            leading: Arc::new(AtomicBool::new(false)),
            released,
            pushes,
            out,
            lost,
            gone,
            absent,
            rejoins: JoinSet::new(),
            next_rejoin: Instant::now(),
            generations: 0,
            name: name.to_owned(),
            lease: backend.lease,
            epoch: Arc::new(AtomicI64::new(0)),
            suspect,
            connected_at: Instant::now(),
            user_name: backend.user_name.clone(),
            ledger_timeout: backend.ledger_timeout,
        })
    }

    fn quorum(&self) -> usize {
        Majority::of(self.total).need()
    }

    fn round(&self) -> Round {
        Round {
            conns: self.members.iter().map(Member::conn).collect(),
            args: self.args.clone(),
            quorum: self.quorum(),
            per_server: self.per_server,
            leading: self.leading.clone(),
        }
    }
}

/// What one acquisition round needs, owned, so that a wait's future is `'static`.
#[derive(Clone)]
struct Round {
    conns: Vec<MultiplexedConnection>,
    args: ScriptArgs,
    quorum: usize,
    per_server: Duration,
    leading: Arc<AtomicBool>,
}

impl Round {
    /// Tries every server at once. Leads if a majority accepted with validity left; otherwise
    /// releases wherever the key was set. An error only when fewer than a majority answered.
    async fn try_once(&self) -> Result<bool, SessionError> {
        let started = Instant::now();
        let lease = self.args.lease;
        let mut tries = JoinSet::new();
        for (index, conn) in self.conns.iter().enumerate() {
            let (mut conn, args, bound) = (conn.clone(), self.args.clone(), self.per_server);
            tries.spawn(async move {
                let answer = tokio::time::timeout(bound, acquire(&mut conn, &args, "try", lease));
                (index, matches!(answer.await, Ok(Ok(true))), true)
            });
        }
        let mut granted = Vec::new();
        while let Some(joined) = tries.join_next().await {
            if let Ok((index, true, _)) = joined {
                granted.push(index);
            }
        }
        let drift = lease / 100 + Duration::from_millis(2);
        if granted.len() >= self.quorum && started.elapsed() + drift < lease {
            self.leading.store(true, Ordering::Relaxed);
            return Ok(true);
        }
        self.release(&granted).await;
        Ok(false)
    }

    /// Releases the key on these servers, each bounded; how many released it.
    async fn release(&self, on: &[usize]) -> usize {
        let mut releases = JoinSet::new();
        for index in on {
            let (mut conn, args, bound) = (
                self.conns[*index].clone(),
                self.args.clone(),
                self.per_server,
            );
            releases.spawn(async move {
                let invocation = args.invocation(&RELEASE_SCRIPT);
                matches!(
                    tokio::time::timeout(bound, invocation.invoke_async::<i64>(&mut conn)).await,
                    Ok(Ok(1))
                )
            });
        }
        let mut released = 0;
        while let Some(joined) = releases.join_next().await {
            released += usize::from(matches!(joined, Ok(true)));
        }
        released
    }
}

impl Session for QuorumSession {
    type Ledger = QuorumLedger;

    fn id(&self) -> i32 {
        i32::try_from(self.members[0].connection.client_id).unwrap_or(i32::MAX)
    }

    fn server_version(&self) -> u32 {
        self.members
            .iter()
            .map(|m| m.connection.server_major)
            .min()
            .unwrap_or(0)
    }

    fn age(&self) -> Duration {
        self.connected_at.elapsed()
    }

    /// Only the sockets still open: a member whose connection ended lives on in the session,
    /// and its old descriptor number may now be another file's (see `open_socket`).
    fn sockets(&self) -> Vec<std::os::fd::RawFd> {
        self.members
            .iter()
            .filter_map(|m| m.connection.open_socket())
            .collect()
    }

    /// Each open socket with the release for its server (see `RedisSession::lend`): the keeper
    /// releases on every server it reaches, and a release's message wakes the followers.
    fn lend(&self) -> Vec<crate::election::socket::Lent> {
        self.members
            .iter()
            .filter_map(|m| m.connection.lend(|marker| self.args.farewell(marker)))
            .collect()
    }

    /// Resolves once fewer than a majority of the servers still hold this session: their
    /// connections ended, or (while leading) the key changed under it.
    async fn ended(&mut self) -> String {
        loop {
            let unreachable = self.absent.iter().flatten().count();
            let lost = self.lost.iter().flatten().count() + unreachable;
            if self.total - lost < self.quorum() {
                let reasons: Vec<&str> = self.lost.iter().flatten().map(String::as_str).collect();
                return format!(
                    "fewer than a majority of the servers still hold this session: {}",
                    reasons.join("; ")
                );
            }
            if let Some(index) = self.suspect.iter().position(|suspect| *suspect) {
                let mut conn = self.members[index].conn();
                let value: redis::RedisResult<Option<String>> = redis::cmd("GET")
                    .arg(&self.args.keys.lock)
                    .query_async(&mut conn)
                    .await;
                self.suspect[index] = false;
                let ours = matches!(&value, Ok(Some(value))
                    if scripts::holder_nonce(value) == Some(self.args.nonce.as_str()));
                if !ours {
                    self.lost[index].get_or_insert_with(|| {
                        format!(
                            "{}: the lock's key was changed by another client or expired",
                            self.members[index].server
                        )
                    });
                }
                continue;
            }
            let leading = self.leading.load(Ordering::Relaxed);
            let missing = unreachable > 0 || self.gone.iter().any(|gone| *gone);
            let rejoin = leading && missing && self.rejoins.is_empty();
            if rejoin && Instant::now() >= self.next_rejoin {
                self.start_rejoins();
                continue;
            }
            let next_rejoin = self.next_rejoin;
            tokio::select! {
                received = self.pushes.recv() => {
                    let Some((index, generation, push)) = received else {
                        return "the connections were closed".into();
                    };
                    // A push of a connection since replaced says nothing of its successor.
                    if self.members[index].generation != generation {
                        continue;
                    }
                    match push.kind {
                        PushKind::Disconnection => {
                            self.gone[index] = true;
                            self.lost[index].get_or_insert_with(|| {
                                format!("{}: the connection ended", self.members[index].server)
                            });
                        }
                        PushKind::Invalidate
                            if leading && invalidates(&push, &self.args.keys.lock) =>
                        {
                            self.suspect[index] = true;
                        }
                        _ => {}
                    }
                }
                Some(joined) = self.rejoins.join_next(), if !self.rejoins.is_empty() => {
                    if let Ok(rejoined) = joined {
                        self.install(rejoined);
                    }
                }
                () = tokio::time::sleep_until(next_rejoin.into()), if rejoin => {}
            }
        }
    }

    fn wait(&self) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let round = self.round();
        let (released, poll) = (self.released.clone(), self.poll);
        async move {
            loop {
                let woken = released.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                if round.try_once().await? {
                    return Ok(());
                }
                // Jitter keeps followers that failed together from colliding again.
                let jitter = poll.mul_f64(fastrand::f64() * 0.25);
                tokio::select! {
                    () = woken => tokio::time::sleep(jitter / 10).await,
                    () = tokio::time::sleep(poll + jitter) => {}
                }
            }
        }
    }

    async fn try_acquire(&self) -> Result<bool, SessionError> {
        self.round().try_once().await
    }

    /// A quorum's leader hears no step-down request: `pgleader step-down` refuses a quorum
    /// before it sends one (listening on every server is not built).
    fn listen(
        &mut self,
    ) -> (
        Requests,
        impl Future<Output = Result<(), SessionError>> + 'static,
    ) {
        (step_down::deaf(), std::future::ready(Ok(())))
    }

    /// The largest epoch the majority handed out, written back to every server (a majority
    /// must take it) before the command starts.
    async fn fence(&self) -> Result<Fence, SessionError> {
        let mut reads = JoinSet::new();
        // The renewal comes first: each server's TTL started when its acquire ran, before the
        // leader's deadline starts counting (when this is sent), so the key is extended again
        // here, as on one server.
        for member in &self.members {
            let (mut conn, args, bound) = (member.conn(), self.args.clone(), self.per_server * 4);
            reads.spawn(async move {
                let mut pipe = redis::pipe();
                pipe.add_command(args.eval(&scripts::RENEW_SOURCE))
                    .cmd("GET")
                    .arg(&args.keys.lock)
                    .cmd("INFO")
                    .arg("server");
                let read = pipe.query_async::<((i64, i64, i64), Option<String>, String)>(&mut conn);
                tokio::time::timeout(bound, read).await.ok()?.ok()
            });
        }
        let (mut epochs, mut uptime, mut time) = (Vec::new(), Duration::MAX, None);
        while let Some(joined) = reads.join_next().await {
            let Ok(Some(((held, seconds, micros), value, info))) = joined else {
                continue;
            };
            let value = value.unwrap_or_default();
            if held != 1 || scripts::holder_nonce(&value) != Some(self.args.nonce.as_str()) {
                continue;
            }
            if let Some(epoch) = scripts::field(&value, "epoch").and_then(|e| e.parse::<i64>().ok())
            {
                epochs.push(epoch);
            }
            uptime = uptime.min(ServerInfo::parse(&info).uptime.unwrap_or(Duration::ZERO));
            time.get_or_insert(timestamp(seconds, micros));
        }
        if epochs.len() < self.quorum() {
            return Err(SessionError::Query(format!(
                "only {} of {} servers hold this session's key",
                epochs.len(),
                self.total
            )));
        }
        let epoch = epochs.iter().copied().max().unwrap_or(0);
        self.epoch.store(epoch, Ordering::Relaxed);
        let mut writes = JoinSet::new();
        for member in &self.members {
            let (mut conn, key, bound) =
                (member.conn(), self.args.keys.epoch(), self.per_server * 4);
            writes.spawn(async move {
                let write = raise_epoch(&mut conn, key, epoch);
                matches!(tokio::time::timeout(bound, write).await, Ok(Ok(1)))
            });
        }
        let mut written = 0;
        while let Some(joined) = writes.join_next().await {
            written += usize::from(matches!(joined, Ok(true)));
        }
        if written < self.quorum() {
            return Err(SessionError::Query(format!(
                "the epoch reached only {written} of {} servers",
                self.total
            )));
        }
        Ok(Fence {
            epoch,
            server_time: time.unwrap_or_else(jiff::Timestamp::now),
            since_server_reset: uptime,
        })
    }

    /// Renews on every server; answers as soon as a majority renewed, or can no longer.
    fn confirm(&self) -> impl Future<Output = Result<Check, SessionError>> + 'static {
        let conns: Vec<MultiplexedConnection> = self.members.iter().map(Member::conn).collect();
        let (args, quorum, total) = (self.args.clone(), self.quorum(), self.total);
        async move {
            let mut renewals = JoinSet::new();
            for mut conn in conns.iter().cloned() {
                let args = args.clone();
                renewals.spawn(async move {
                    args.invocation(&RENEW_SCRIPT)
                        .invoke_async::<(i64, i64, i64)>(&mut conn)
                        .await
                });
            }
            let (mut held, mut refused) = (0, total - conns.len());
            let mut server_time = None;
            let mut last_error = None;
            while let Some(joined) = renewals.join_next().await {
                match joined {
                    Ok(Ok((1, seconds, micros))) => {
                        held += 1;
                        server_time.get_or_insert(timestamp(seconds, micros));
                    }
                    Ok(Ok((_, seconds, micros))) => {
                        refused += 1;
                        server_time.get_or_insert(timestamp(seconds, micros));
                    }
                    Ok(Err(err)) => {
                        refused += 1;
                        last_error = Some(query_error(err));
                    }
                    Err(err) => {
                        refused += 1;
                        last_error = Some(SessionError::Query(err.to_string()));
                    }
                }
                let now = server_time.unwrap_or_else(jiff::Timestamp::now);
                if held >= quorum {
                    return Ok(Check {
                        confirmation: Confirmation::Held,
                        server_time: now,
                    });
                }
                if total - refused < quorum {
                    if let (Some(err), None) = (last_error, server_time) {
                        return Err(err);
                    }
                    return Ok(Check {
                        confirmation: Confirmation::NotHeld,
                        server_time: now,
                    });
                }
            }
            Err(no_answer(Duration::ZERO))
        }
    }

    async fn release(self, timeout: Duration) -> Result<(), SessionError> {
        let round = self.round();
        let everywhere: Vec<usize> = (0..self.members.len()).collect();
        let released = tokio::time::timeout(timeout, round.release(&everywhere))
            .await
            .map_err(|_| no_answer(timeout))?;
        if released >= self.quorum() {
            Ok(())
        } else {
            Err(SessionError::Query(format!(
                "released on {released} of {} servers only",
                self.total
            )))
        }
    }

    fn ledger(&self, definition: &Definition) -> QuorumLedger {
        let members = self
            .members
            .iter()
            .map(|member| {
                RedisLedger::new(
                    member.conn(),
                    self.args.clone(),
                    definition.clone(),
                    self.user_name.clone(),
                    member.connection.client_id,
                    (
                        self.ledger_timeout,
                        Arc::clone(&member.connection.ledger_slots),
                    ),
                )
            })
            .collect();
        QuorumLedger::new(members, self.total, self.ledger_timeout)
    }
}
