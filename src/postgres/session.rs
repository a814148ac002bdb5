//! One PostgreSQL session: connect, prepare it for holding a lock, wait for the lock, confirm
//! it is still held, release it, and notice at once when the connection ends.
//!
//! A session is used for one election round and then thrown away; it is never reused after
//! anything went wrong with it. In particular an acquisition that was abandoned (shutdown while
//! waiting, an error) may still have been granted on the server (GreptimeDB issue 7670), so
//! such a session is closed, which frees whatever it might hold.
//!
//! Every query goes through `query_typed` (or the simple protocol): one round trip and no named
//! prepared statements, which a pooler could leave behind on a server connection.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio_postgres::Client;
use tokio_postgres::types::Type;

use crate::election::lease::Lease;
use crate::election::ledger::Definition;
use crate::election::lock::LockKey;
use crate::election::socket::LentSocket;
use crate::election::step_down::{self, Heard, Requests};
use crate::election::{Check, Confirmation, ConnectError, Fence, Session, SessionError};
use crate::postgres::PgBackend;
use crate::postgres::bundle::Bundle;
use crate::postgres::connect::{self, ConnectionTask, Notifications, Opened, TcpEnds, classify};
use crate::postgres::conninfo::{ChannelBinding, ConnSettings, Host};
use crate::postgres::describe::describe;
use crate::postgres::ledger::{Guard, LedgerSettings, PgLedger};
use crate::postgres::locks::{
    BACKEND_PID_SQL, CONFIRM_SQL, FENCE_SETTING, FENCE_SQL, SENDER_MAY_ASK, TRY_SQL, UNLOCK_SQL,
    WON_SQL, setup_identity, setup_sql, step_down_channel, wait_sql,
};
use crate::postgres::version::{self, Support};

/// Why leading through a standby is refused (and retried: a failover may promote it).
const STANDBY: &str =
    "the server is a standby (in recovery); pgleader leads only through a writable primary";

/// Why leading through a transaction pooler is refused, with the evidence.
fn pooler(evidence: &str) -> String {
    format!(
        "{evidence}: the connection goes through a transaction-pooling proxy (such as PgBouncer \
         in transaction mode), where advisory locks leak or vanish. Connect directly to \
         PostgreSQL or through a session-mode pool"
    )
}

/// An open session for one lock, with the task that drives its connection.
#[derive(Debug)]
pub struct PgSession {
    lock: LockKey,
    /// Bounds `pg_try_advisory_lock` (`--no-wait`, timers).
    try_timeout: Duration,
    ledger: LedgerSettings,
    client: Arc<Client>,
    /// The group commit of the ledger statements of every lock and job on this session.
    bundle: Arc<Bundle>,
    connection: ConnectionTask,
    /// The connection's socket, owned by the connection task; lent to a leader's keeper.
    socket: LentSocket,
    /// How often a waiting follower queues again, with a new snapshot (see `locks::wait_sql`).
    refresh: Duration,
    /// Whether `wait` won the lock, and so left the fence in `FENCE_SETTING`.
    waited: Arc<AtomicBool>,
    /// What the server notified this session of, until a sharded lock's holder takes it.
    notifications: Option<Notifications>,
    /// Once a leader LISTENs: its channel, and where `ended` passes step-down requests on.
    step_downs: Option<(String, Heard)>,
    backend_pid: i32,
    server_major: u32,
    connected_at: Instant,
    /// The holder session of a replica that runs this lock's name with `--shards`, as the
    /// set-up found it (see `PgBackend::connect`).
    sharded_replica: Option<i32>,
}

impl Drop for PgSession {
    fn drop(&mut self) {
        // Closing the socket is what frees the session's locks on the server; do not wait for
        // in-flight queries (a blocked pg_advisory_lock would never finish).
        self.connection.abort();
    }
}

/// How long the sender's role may take to read; a request whose sender cannot be checked is
/// not obeyed.
const SENDER_CHECK: Duration = Duration::from_secs(2);

/// Passes a step-down request on once its sender's role is known to be the leader's own (or a
/// member of it); logs and drops it otherwise. Runs beside the leader's loop, so that reading
/// the role delays nothing: the requester keeps its session open while it waits, so its row
/// is there to read.
fn pass_on_if_allowed(client: Arc<Client>, requests: Heard, request: String, sender: i32) {
    tokio::spawn(async move {
        let may =
            tokio::time::timeout(SENDER_CHECK, client.query_one(SENDER_MAY_ASK, &[&sender])).await;
        match may {
            Ok(Ok(row)) if row.get::<_, bool>(0) => {
                let _ = requests.send(request);
            }
            Ok(Ok(_)) => tracing::warn!(
                event = "step_down_refused",
                sender_pid = sender,
                "ignored a step-down request from server process {sender}: its role is neither this leader's nor a member of it"
            ),
            Ok(Err(err)) => tracing::warn!(
                event = "step_down_refused",
                sender_pid = sender,
                reason = %describe(&err),
                "ignored a step-down request from server process {sender}: cannot read its role"
            ),
            Err(_) => tracing::warn!(
                event = "step_down_refused",
                sender_pid = sender,
                "ignored a step-down request from server process {sender}: its role could not be read in time"
            ),
        }
    });
}

impl PgSession {
    /// The ledger of `lock` on this session, whose writes require that the session holds
    /// `guard`'s lock.
    pub fn ledger_of(&self, lock: &LockKey, guard: Guard, definition: &Definition) -> PgLedger {
        PgLedger::new(
            self.client.clone(),
            self.bundle.clone(),
            &self.ledger,
            lock.clone(),
            guard,
            definition.clone(),
        )
    }

    /// The holder session of a replica that ran this lock's name with `--shards` when this
    /// session was set up.
    pub(super) fn sharded_replica_beside(&self) -> Option<i32> {
        self.sharded_replica
    }

    /// The driver's client, for the statements of a sharded lock (`shards/`).
    pub(super) fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// What the server notifies this session of (after it LISTENs); `None` once taken.
    pub(super) fn take_notifications(&mut self) -> Option<Notifications> {
        self.notifications.take()
    }

    /// Connects, applies the session settings, and checks the server is a primary and that no
    /// transaction pooler stands between. On a direct TCP connection the server's own view of
    /// it is the evidence, in the set-up's round trip; otherwise a second connection probes
    /// (`check_not_transaction_pooled`), which costs a server process's start-up (about 2 ms
    /// on a local server, more on a busy one) and two round trips.
    pub async fn connect(
        backend: &PgBackend,
        application_name: &str,
    ) -> Result<PgSession, ConnectError> {
        let settings = &backend.settings;
        let budget = connect_budget(settings);
        let probe = || async {
            tokio::time::timeout(budget, connect_plain(settings, application_name))
                .await
                .map_err(|_| {
                    ConnectError::Transient("the connection-pooler probe timed out".into())
                })?
        };
        let set_up = Self::open_and_set_up(backend, application_name, budget);
        // Over Unix sockets only, the probe is certain: its connection opens alongside the
        // session's, which takes a server process's start-up off the critical path. What it
        // sees is unchanged: a transaction pooler hands a client a server process at its first
        // statement, not at login, and the probe's comes only after the session's set-up.
        let unix_only = settings
            .endpoints
            .iter()
            .all(|endpoint| matches!(endpoint.host, Host::Socket(_)));
        let (session, probe) = if unix_only {
            tracing::debug!(
                event = "pooler_probe",
                "a Unix socket: probing for a transaction pooler"
            );
            let ((session, _), probe) = tokio::try_join!(set_up, probe())?;
            (session, probe)
        } else {
            let (session, direct) = set_up.await?;
            if direct {
                tracing::debug!(
                    event = "direct",
                    "the server sees this connection's own two ends: nothing stands between, no pooler probe needed"
                );
                return Ok(session);
            }
            tracing::debug!(
                event = "pooler_probe",
                "the server does not see this host's TCP connection (a proxy, NAT or a Unix socket): probing for a transaction pooler"
            );
            let probe = probe().await?;
            (session, probe)
        };
        session.check_not_transaction_pooled(probe, budget).await?;
        Ok(session)
    }

    /// Opens the session's connection, applies the session settings, and checks the server
    /// is a primary. True when the server sees the very TCP connection this host opened, so
    /// that no proxy, and so no pooler, stands between (see [`same_connection`]).
    async fn open_and_set_up(
        backend: &PgBackend,
        application_name: &str,
        budget: Duration,
    ) -> Result<(PgSession, bool), ConnectError> {
        let (settings, lease) = (&backend.settings, &backend.lease);
        let (opened, server_major) = open(settings, application_name, Some(lease), budget).await?;
        let tcp_ends = opened.tcp_ends;
        if Support::of(server_major) == Support::NoIdleSessionTimeout {
            // Once per process: a warning at every reconnection would drown the log.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    event = "old_server",
                    server_version = server_major,
                    "{}",
                    version::no_idle_session_timeout_warning(server_major)
                );
            });
        }
        let client = Arc::new(opened.client);
        let bundle = Arc::new(Bundle::new(
            client.clone(),
            backend.ledger.statement_timeout,
            lease.duration(),
        ));
        let mut session = PgSession {
            lock: backend.lock.clone(),
            try_timeout: settings.connect_timeout,
            ledger: backend.ledger.clone(),
            client,
            bundle,
            connection: opened.connection,
            socket: opened.socket,
            refresh: backend.wait_refresh,
            waited: Arc::default(),
            notifications: Some(opened.notifications),
            step_downs: None,
            backend_pid: 0,
            server_major,
            connected_at: Instant::now(),
            sharded_replica: None,
        };
        // Sent together: the identity query runs after the settings on the same connection,
        // in one round trip.
        let setup = setup_sql(lease, server_major);
        let identity = setup_identity(&session.lock);
        let set_up = async {
            tokio::try_join!(
                session.client.batch_execute(&setup),
                session.client.query_typed_one(&identity, &[]),
            )
        };
        let (_, row) = tokio::time::timeout(budget, set_up)
            .await
            .map_err(|_| ConnectError::Transient("the session set-up timed out".into()))?
            .map_err(classify)?;
        let in_recovery: bool = row.get(1);
        if in_recovery {
            return Err(ConnectError::Transient(STANDBY.to_owned()));
        }
        session.backend_pid = row.get(0);
        session.sharded_replica = row.get(6);
        let seen = (
            seen_end(row.get(2), row.get(3)),
            seen_end(row.get(4), row.get(5)),
        );
        let direct = tcp_ends.is_some_and(|ends| same_connection(ends, seen));
        Ok((session, direct))
    }

    /// Refuses a session behind a transaction-mode pooler, where the server process that holds
    /// a session lock goes back to the pool after every statement: the lock would outlive
    /// pgleader, or be "held" by whichever client the pool hands that process to next.
    ///
    /// The probe: a second connection opens a transaction and asks for its backend pid. Behind
    /// a transaction pooler that reuses server connections last-in-first-out (PgBouncer's
    /// default), it is handed the very backend this session used a moment ago; and while it
    /// holds that backend, this session's next statement must run on another one. Directly, or
    /// behind a session-mode pool, neither can happen. The leader's checks keep comparing
    /// backend pids afterwards, for poolers that hand out connections in another order.
    async fn check_not_transaction_pooled(
        &self,
        probe: PlainClient,
        budget: Duration,
    ) -> Result<(), ConnectError> {
        let probe = tokio::time::timeout(budget, async {
            let messages = probe
                .client
                .simple_query("BEGIN; SELECT pg_catalog.pg_backend_pid()")
                .await
                .map_err(classify)?;
            let probe_pid = messages.iter().find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse::<i32>().ok(),
                _ => None,
            });
            let again: i32 = self
                .client
                .query_typed_one(BACKEND_PID_SQL, &[])
                .await
                .map_err(classify)?
                .get(0);
            Ok::<_, ConnectError>((probe_pid, again))
        })
        .await
        .map_err(|_| ConnectError::Transient("the connection-pooler probe timed out".into()))?;
        let (probe_pid, again) = probe?;
        let evidence = match probe_pid {
            Some(pid) if pid == self.backend_pid => {
                format!("another connection was handed this session's server process (pid {pid})")
            }
            _ if again != self.backend_pid => moved(self.backend_pid, again),
            _ => return Ok(()),
        };
        Err(ConnectError::Permanent(pooler(&evidence)))
    }
}

impl Session for PgSession {
    type Ledger = PgLedger;

    /// The pid of the server process behind this session.
    fn id(&self) -> i32 {
        self.backend_pid
    }

    /// The server's major version (15 for 15.4), 0 if unknown.
    fn server_version(&self) -> u32 {
        self.server_major
    }

    fn age(&self) -> Duration {
        self.connected_at.elapsed()
    }

    /// The socket under the connection (under TLS too, or a Unix socket). While the keeper
    /// holds it, the server keeps a crashed pgleader's session, and its lock, until the
    /// command's whole tree is gone.
    fn sockets(&self) -> Vec<std::os::fd::RawFd> {
        self.socket.open().into_iter().collect()
    }

    /// Also passes on the step-down requests a leader hears (see `listen`).
    async fn ended(&mut self) -> String {
        let ended = loop {
            let listening = self.step_downs.is_some();
            let notifications = &mut self.notifications;
            let heard = async {
                match notifications {
                    Some(notifications) if listening => notifications.recv().await,
                    _ => std::future::pending().await,
                }
            };
            let notification = tokio::select! {
                biased;
                ended = &mut self.connection => break ended,
                Some(notification) = heard => notification,
            };
            if let Some((channel, requests)) = &self.step_downs
                && notification.channel() == channel
                && step_down::is_request(notification.payload())
            {
                pass_on_if_allowed(
                    self.client.clone(),
                    requests.clone(),
                    notification.payload().to_owned(),
                    notification.process_id(),
                );
            }
        };
        match ended {
            Ok(Ok(())) => "the server closed the connection".to_owned(),
            Ok(Err(err)) => describe(&err),
            Err(_) => "the connection was closed".to_owned(),
        }
    }

    /// LISTENs on the lock's channel. Sent beside the fence's query, the connection pipelines
    /// both: one round trip.
    fn listen(
        &mut self,
    ) -> (
        Requests,
        impl Future<Output = Result<(), SessionError>> + 'static,
    ) {
        let (heard, requests) = tokio::sync::mpsc::unbounded_channel();
        let channel = step_down_channel(&self.lock);
        let listening = self.notifications.is_some();
        if listening {
            self.step_downs = Some((channel.clone(), heard));
        }
        let client = self.client.clone();
        let sent = async move {
            if !listening {
                return Err(SessionError::Query(
                    "the session's notifications are taken".into(),
                ));
            }
            client
                .batch_execute(&format!("LISTEN {channel}"))
                .await
                .map_err(query_error)
        };
        (requests, sent)
    }

    /// Blocks until the lock is granted (no polling: the server queues waiters, and grants a
    /// released lock at once), and takes the fence in the same statement (see `locks::wait_sql`).
    fn wait(&self) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let (client, waited) = (self.client.clone(), self.waited.clone());
        let sql = wait_sql(self.lock.key(), self.refresh);
        async move {
            // The simple protocol: a DO that commits must be a statement of its own.
            client.batch_execute(&sql).await.map_err(query_error)?;
            waited.store(true, Ordering::Release);
            Ok(())
        }
    }

    async fn try_acquire(&self) -> Result<bool, SessionError> {
        let key = self.lock.key();
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 1] = [(&key, Type::INT8)];
        let attempt = async {
            let rows = self
                .client
                .query_typed(TRY_SQL, &params)
                .await
                .map_err(query_error)?;
            let row = rows.first().ok_or_else(|| {
                SessionError::Query("pg_try_advisory_lock returned no row".into())
            })?;
            same_backend(self.backend_pid, row.get(1))?;
            Ok(row.get(0))
        };
        match tokio::time::timeout(self.try_timeout, attempt).await {
            Ok(Ok(held)) => Ok(held),
            Ok(Err(SessionError::Query(reason))) => Err(SessionError::Query(format!(
                "cannot try the lock: {reason}"
            ))),
            Ok(Err(SessionError::Unsafe(reason))) => Err(SessionError::Unsafe(format!(
                "cannot try the lock: {reason}"
            ))),
            Err(_) => Err(SessionError::Query(
                "no answer from the server to pg_try_advisory_lock".into(),
            )),
        }
    }

    /// Checks, on this session, that it still holds the lock: the right `pg_locks` row, held by
    /// this very backend.
    fn confirm(&self) -> impl Future<Output = Result<Check, SessionError>> + 'static {
        let client = self.client.clone();
        let (expected, classid, objid) = (self.backend_pid, self.lock.classid(), self.lock.objid());
        async move {
            let rows = client
                .query_typed(&CONFIRM_SQL, &[(&classid, Type::OID), (&objid, Type::OID)])
                .await
                .map_err(query_error)?;
            let row = rows
                .first()
                .ok_or_else(|| SessionError::Query("the ownership check returned no row".into()))?;
            same_backend(expected, row.get(0))?;
            Ok(Check {
                confirmation: if row.get(2) {
                    Confirmation::Held
                } else {
                    Confirmation::NotHeld
                },
                server_time: row.get(1),
            })
        }
    }

    /// What a new leader learns before starting its command: a fencing token, and how long
    /// ago the server last freed every lock at once. After `wait` it came with the lock; after
    /// `try_acquire` it is taken now.
    ///
    /// The token is a transaction id assigned once the lock is held. Transaction ids only grow,
    /// and each leader takes its own after the previous leader lost the lock, so tokens
    /// strictly increase from one leadership to the next. Assigning one fails on a read-only
    /// server, which also proves the session is on a writable primary.
    ///
    /// The flush this costs (one WAL write and sync: about 0.2 ms on a local disk, more on a
    /// network one) is what makes the token survive a crash. After a crash the server counts
    /// transaction ids on from the last one its flushed WAL mentions, so an id handed out
    /// without a flushed record is handed out again: measured on PostgreSQL 15 with `pg_ctl
    /// stop -m immediate`, an id taken alone came back after the restart, every time. A
    /// transaction that only takes an id writes no WAL of its own, so PostgreSQL commits it
    /// without flushing: the (transactional) logical message makes the commit wait for its WAL
    /// to be flushed. A server configured with `synchronous_commit = off` would commit even that
    /// without waiting (measured too: the id came back), which is why the session sets it `on`
    /// (see `locks::setup_sql`). The command cannot start before the commit is flushed: the token
    /// exists only then, and the command needs it in its environment.
    ///
    /// The server freed every lock when it last started, or when it last reset after the crash
    /// of one of its processes, which also resets the shared statistics (the bgwriter's
    /// `stats_reset`, readable by any role).
    ///
    /// A fence that came with the lock still costs one round trip (about 0.1 ms), which also
    /// reads the server's clock: the leader's deadline counts from when this call was made (see
    /// `lead`), and only an answer to a request sent now proves that the server heard from this
    /// session since. A grant can arrive late (held up by a frozen proxy, say) when the server
    /// may already have given up on the session.
    ///
    /// The fence's commit now happens inside the wait, which has no timeout: a commit that
    /// cannot complete (a synchronous standby gone, a hung WAL disk) leaves this session
    /// holding the lock while it still looks like a waiting follower. Nothing runs meanwhile,
    /// as before, when the separate fence timed out and the lock went round the replicas, each
    /// of them stuck the same way.
    async fn fence(&self) -> Result<Fence, SessionError> {
        if self.waited.load(Ordering::Acquire) {
            let row = self
                .client
                .query_typed_one(&WON_SQL, &[])
                .await
                .map_err(query_error)?;
            same_backend(self.backend_pid, row.get(0))?;
            // The server's clock as of this round trip, which the leader pairs with its own
            // send and receive times (a schedule follows the server's clock from it).
            return left_fence(row.get(2), row.get(1));
        }
        let row = self
            .client
            .query_typed_one(&FENCE_SQL, &[])
            .await
            .map_err(query_error)?;
        Ok(fence_of(&row))
    }

    /// Releases the lock explicitly (so the next waiter is granted it now), then closes.
    async fn release(self, timeout: Duration) -> Result<(), SessionError> {
        let key = self.lock.key();
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 1] = [(&key, Type::INT8)];
        let unlock = self.client.query_typed(UNLOCK_SQL, &params);
        match tokio::time::timeout(timeout, unlock).await {
            Ok(Ok(rows)) if rows.first().is_some_and(|row| row.get::<_, bool>(0)) => Ok(()),
            Ok(Ok(_)) => Err(SessionError::Query(
                "the server says this session did not hold the lock".into(),
            )),
            Ok(Err(err)) => Err(query_error(err)),
            Err(_) => Err(SessionError::Query(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            ))),
        }
    }

    fn ledger(&self, definition: &Definition) -> PgLedger {
        self.ledger_of(&self.lock.clone(), Guard::Plain, definition)
    }
}

/// A plain connection, for `pgleader status`: no lock, no session settings.
#[derive(Debug)]
pub struct PlainClient {
    pub client: Client,
    pub server_major: u32,
    connection: ConnectionTask,
}

impl Drop for PlainClient {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// Connects without preparing the session for a lock.
pub async fn connect_plain(
    settings: &ConnSettings,
    application_name: &str,
) -> Result<PlainClient, ConnectError> {
    let (opened, server_major) =
        open(settings, application_name, None, connect_budget(settings)).await?;
    Ok(PlainClient {
        client: opened.client,
        server_major,
        connection: opened.connection,
    })
}

/// Each attempt at an address is bounded by connect_timeout; this budget bounds each whole step
/// of connecting (all the hosts, the session's set-up), so that nothing stalls the retry loop.
fn connect_budget(settings: &ConnSettings) -> Duration {
    settings.connect_timeout * settings.endpoints.len().max(1) as u32
}

/// Connects (see `connect.rs`) and checks the server is not too old.
async fn open(
    settings: &ConnSettings,
    application_name: &str,
    lease: Option<&Lease>,
    budget: Duration,
) -> Result<(Opened, u32), ConnectError> {
    let config = driver_config(settings, application_name);
    let attempt = async {
        let opened = connect::connect(settings, &config, lease).await?;
        let server_major = opened
            .server_version
            .as_deref()
            .and_then(parse_major_version)
            .unwrap_or(0);
        if Support::of(server_major) == Support::TooOld {
            opened.connection.abort();
            return Err(ConnectError::Permanent(version::too_old(server_major)));
        }
        Ok::<_, ConnectError>((opened, server_major))
    };
    tokio::time::timeout(budget, attempt).await.map_err(|_| {
        ConnectError::Transient(format!(
            "no answer from the server within {}",
            humantime::format_duration(budget)
        ))
    })?
}

/// Who logs in, and how, for the driver; where to connect is `connect.rs`' business.
fn driver_config(settings: &ConnSettings, application_name: &str) -> tokio_postgres::Config {
    let mut config = tokio_postgres::Config::new();
    config
        .user(&settings.user)
        .dbname(&settings.dbname)
        .application_name(application_name);
    if let Some(password) = &settings.password {
        config.password(password.expose());
    }
    config.channel_binding(match settings.channel_binding {
        ChannelBinding::Disable => tokio_postgres::config::ChannelBinding::Disable,
        ChannelBinding::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
        ChannelBinding::Require => tokio_postgres::config::ChannelBinding::Require,
    });
    if let Some(options) = &settings.options {
        config.options(options);
    }
    config
}

/// "15.4 (Debian 15.4-1)" → 15; "9.6.3" → 9.
fn parse_major_version(version: &str) -> Option<u32> {
    let digits: String = version.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The fence's columns (`locks::FENCE_COLUMNS`).
fn fence_of(row: &tokio_postgres::Row) -> Fence {
    Fence {
        epoch: row.get(0),
        server_time: row.get(3),
        since_server_reset: since_reset(row.get(2)),
    }
}

/// The fence a won wait left in `FENCE_SETTING` ("TOKEN SECONDS"), with the server's clock.
fn left_fence(setting: &str, server_time: jiff::Timestamp) -> Result<Fence, SessionError> {
    let parsed = setting
        .split_once(' ')
        .and_then(|(token, since)| Some((token.parse::<i64>().ok()?, since.parse::<f64>().ok()?)));
    let (epoch, since) = parsed.ok_or_else(|| {
        SessionError::Query(format!(
            "the wait left no fence that can be read ({FENCE_SETTING} = '{setting}')"
        ))
    })?;
    Ok(Fence {
        epoch,
        server_time,
        since_server_reset: since_reset(since),
    })
}

fn since_reset(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds).unwrap_or(Duration::ZERO)
}

/// One end of the connection as the server reports it (`host(inet_client_addr())`, then
/// `inet_client_port()`, or the server's own).
fn seen_end(host: Option<&str>, port: Option<i32>) -> Option<SocketAddr> {
    let ip: IpAddr = host?.parse().ok()?;
    Some(SocketAddr::new(ip, u16::try_from(port?).ok()?))
}

/// Whether the server's view of the connection (the client's end, then its own) is this
/// host's TCP connection, both ends alike. Anything between (PgBouncer, a TCP proxy, NAT) ends
/// this host's connection and opens its own, so the server would see another address or port
/// on one side at least; one TCP connection's four figures cannot belong to two live
/// connections of one network. The pooler probe is then needless. What else could show a
/// match: a transparent proxy that keeps both ends (HAProxy's `usesrc client` under TPROXY),
/// which relays one server connection per client and so pools nothing, or two network
/// namespaces with the same addresses and a pooler between them that keeps the client's port
/// too, which no pooler does. The leader's checks compare backend pids in any case.
fn same_connection(
    ends: TcpEnds,
    (client, server): (Option<SocketAddr>, Option<SocketAddr>),
) -> bool {
    let canonical = |addr: SocketAddr| (addr.ip().to_canonical(), addr.port());
    client.is_some_and(|client| canonical(client) == canonical(ends.local))
        && server.is_some_and(|server| canonical(server) == canonical(ends.peer))
}

fn same_backend(expected: i32, seen: i32) -> Result<(), SessionError> {
    if expected == seen {
        Ok(())
    } else {
        Err(SessionError::Unsafe(pooler(&moved(expected, seen))))
    }
}

fn moved(expected: i32, seen: i32) -> String {
    format!(
        "the session's statements ran on different server processes (pid {expected}, then {seen})"
    )
}

pub(super) fn query_error(err: tokio_postgres::Error) -> SessionError {
    SessionError::Query(describe(&err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_view_of_this_very_connection_is_direct() {
        let at = |text: &str| text.parse::<SocketAddr>().expect("an address");
        let ends = TcpEnds {
            local: at("127.0.0.1:40000"),
            peer: at("127.0.0.1:5432"),
        };
        let seen = |client: &str, server: &str| (Some(at(client)), Some(at(server)));
        assert!(same_connection(
            ends,
            seen("127.0.0.1:40000", "127.0.0.1:5432")
        ));
        // An IPv4 client on a dual-stack server's socket.
        assert!(same_connection(
            ends,
            seen("[::ffff:127.0.0.1]:40000", "[::ffff:127.0.0.1]:5432")
        ));
        // PgBouncer on this host: its own port towards the server, the server's own port.
        assert!(!same_connection(
            ends,
            seen("127.0.0.1:40001", "127.0.0.1:5432")
        ));
        assert!(!same_connection(
            TcpEnds {
                peer: at("127.0.0.1:6432"),
                ..ends
            },
            seen("127.0.0.1:40000", "127.0.0.1:5432")
        ));
        // NAT or a proxy on another host.
        assert!(!same_connection(
            ends,
            seen("10.0.0.7:40000", "127.0.0.1:5432")
        ));
        // A Unix socket on the server's side.
        assert!(!same_connection(ends, (None, None)));
        assert_eq!(seen_end(None, None), None);
        assert_eq!(seen_end(Some("::1"), Some(5432)), Some(at("[::1]:5432")));
    }

    #[test]
    fn reads_the_major_version() {
        assert_eq!(
            parse_major_version("15.4 (Debian 15.4-1.pgdg120+1)"),
            Some(15)
        );
        assert_eq!(parse_major_version("9.6.24"), Some(9));
        assert_eq!(parse_major_version("devel"), None);
    }

    #[test]
    fn reads_the_fence_a_won_wait_left() {
        let now = jiff::Timestamp::UNIX_EPOCH;
        let fence = left_fence("7361 12.5", now).expect("a fence");
        assert_eq!(fence.epoch, 7361);
        assert_eq!(fence.since_server_reset, Duration::from_millis(12_500));
        assert_eq!(fence.server_time, now);
        assert!(left_fence("", now).is_err());
        assert!(left_fence("7361", now).is_err());
    }
}
