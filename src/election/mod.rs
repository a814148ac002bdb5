//! The election's boundary: what every backend (PostgreSQL in `postgres/`, Redis next to it)
//! gives the supervisor, and the parts of an election that do not depend on the backend: the
//! lock's key, the lease rule, the backoff between attempts, who takes part, the ledger's
//! contract for scheduled jobs, the majority rule of a quorum, and how a sharded lock's shards
//! are shared out ([`shards`]).
//!
//! A backend is three traits. [`Backend`] is the configured server: it opens a [`Session`] for
//! one round of the election, or an [`Observer`] for `pgleader status`. A session waits for the
//! leadership (blocking, never polling), or tries once; once it leads it hands out a fencing
//! token, confirms on request that it still leads, tells at once when its connection ends, and
//! releases. The supervisor (`supervise/`) only ever sees these traits, and a third backend is a
//! sibling folder that implements them; nothing above this floor changes.
//!
//! Traits with generics rather than an enum over backends: the supervisor is compiled once per
//! backend, calls are direct (no boxing on the check path), and a backend's types stay in its
//! own folder, so the boundary cannot leak SQL or Redis types upward.
//!
//! What every backend must guarantee (the contract suite in `tests/integration/contract.rs`
//! runs the same tests against each):
//!
//! - at most one session leads a lock at a time, as the server sees it; waiters are granted it
//!   in the order they asked;
//! - [`Session::wait`] and [`Session::try_acquire`] are cancellable, and a session whose
//!   acquisition was abandoned is dropped, never reused: dropping it gives up whatever the
//!   server may have granted it meanwhile;
//! - [`Session::ended`] resolves as soon as the backend can tell the connection (or the
//!   leadership) is gone, not at the next check;
//! - a [`Session::confirm`] that answers [`Confirmation::Held`] proves the leadership was held
//!   when the server answered; the supervisor's deadline counts from when it was sent;
//! - the server frees a silent leader's lock no sooner than a lease after the leader's last
//!   successful confirmation (see [`lease`]);
//! - epochs ([`Fence::epoch`]) strictly increase from one leadership to the next;
//! - the ledger's claims succeed only while the claimant leads (see [`ledger`]).

pub mod backoff;
pub mod lease;
pub mod ledger;
pub mod lock;
pub mod majority;
pub mod participant;
pub mod shards;
pub mod socket;
pub mod step_down;

use std::fmt::Display;
use std::time::Duration;

use jiff::Timestamp;
use thiserror::Error;

use ledger::{AskedEntry, Definition, Entry, JobEntry, Ledger, LedgerError};
use participant::LockView;
use step_down::Requests;

/// Why a connection attempt failed, sorted by whether trying again can help.
#[derive(Debug, Error)]
pub enum ConnectError {
    /// Authentication failed, the database or role does not exist, the settings are wrong:
    /// retrying would only hammer the server.
    #[error("{0}")]
    Permanent(String),
    /// The server is down, unreachable, restarting, overloaded, or not a primary yet: try again
    /// later.
    #[error("{0}")]
    Transient(String),
    /// The other replicas of the lock run it in a way this one cannot join (with `--shards`,
    /// where this one runs without): a usage error of the fleet's, never retried.
    #[error("{0}")]
    Conflict(String),
}

impl ConnectError {
    /// Whether the attempt found nothing listening: refused, or no socket file. A transient
    /// error carries the OS error in its text (`... (os error 111)`).
    pub fn nothing_listens(&self) -> bool {
        let reason = self.to_string();
        [libc::ECONNREFUSED, libc::ENOENT]
            .iter()
            .any(|code| reason.contains(&format!("(os error {code})")))
    }
}

/// What the first "cannot connect" line adds when nothing listens at `server` and nothing was
/// ever reached: most likely the wrong place (a new machine without a server), and how to
/// point pgleader elsewhere. Empty otherwise.
pub fn elsewhere_hint(err: &ConnectError, first: bool, server: &str) -> String {
    if !first || !err.nothing_listens() {
        return String::new();
    }
    format!(
        "; nothing listens at {server}: to connect elsewhere, give -d URL or set \
         PGLEADER_DATABASE_URL (PostgreSQL also reads PGHOST, PGPORT, PGUSER and PGDATABASE, as \
         psql does)"
    )
}

/// A failure on an established session.
#[derive(Debug, Error)]
pub enum SessionError {
    /// A statement failed or got no answer: this session is done for.
    #[error("{0}")]
    Query(String),
    /// Leading through this connection is unsafe and will stay so (PostgreSQL behind a
    /// transaction pooler): pgleader exits rather than try again.
    #[error("{0}")]
    Unsafe(String),
}

/// What a new leader learns before it starts its command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The fencing token handed to the command as PGLEADER_EPOCH: strictly greater than every
    /// earlier leadership's.
    pub epoch: i64,
    /// The server's clock when it handed out the token.
    pub server_time: Timestamp,
    /// How long ago the server last freed every lock at once (a restart, a crash reset): the
    /// restart fence waits out what is left of the old leader's worst-case stop time.
    pub since_server_reset: Duration,
}

/// What a leader's check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirmation {
    Held,
    NotHeld,
}

/// A check's answer: whether the leadership is still held, and the server's clock when it
/// looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub confirmation: Confirmation,
    pub server_time: Timestamp,
}

/// A configured backend: the server, the lock, and how pgleader's sessions are set up. Its
/// `Display` names the server for logs, never with a password.
pub trait Backend: Display {
    type Session: Session;
    type Observer: Observer;

    /// Opens a session for one round of the election, ready to wait for the lock; `name` is the
    /// session's name on the server (see [`participant::label`]).
    fn connect(&self, name: &str) -> impl Future<Output = Result<Self::Session, ConnectError>>;

    /// Opens a connection that only looks: `pgleader status` and `status --watch`.
    fn observe(&self) -> impl Future<Output = Result<Self::Observer, ConnectError>>;

    /// Words to add to a permanent connection error that mentions a password (where the
    /// password came from, or that none was given).
    fn password_hint(&self, reason: &str) -> String;
}

/// One session: one round of the election, thrown away afterwards.
pub trait Session {
    type Ledger: Ledger;

    /// The session's id on the server (PostgreSQL's backend pid), for logs, `/status` and
    /// PGLEADER_BACKEND_PID.
    fn id(&self) -> i32;

    /// The server's major version, 0 if unknown.
    fn server_version(&self) -> u32;

    /// How long ago the session was established.
    fn age(&self) -> Duration;

    /// The descriptors of the session's connection sockets, where the backend can give them.
    /// The keeper holds copies of them until every process of the command's tree is gone, so
    /// that when pgleader dies (kill -9, OOM) the server sees the connection close, and frees
    /// the lock, only after the last of them.
    fn sockets(&self) -> Vec<std::os::fd::RawFd>;

    /// What the keeper is lent: [`Session::sockets`], each with what the keeper says on it
    /// if pgleader dies ([`socket::Farewell`]), where the backend has something to say.
    fn lend(&self) -> Vec<socket::Lent> {
        self.sockets().into_iter().map(socket::Lent::hold).collect()
    }

    /// Resolves when the connection, or the leadership it holds, has ended, with the reason.
    fn ended(&mut self) -> impl Future<Output = String>;

    /// Waits for the lock without polling. The future owns what it needs, so the session can
    /// be watched ([`Session::ended`]) meanwhile; dropping it abandons the wait, after which the
    /// session must be dropped too.
    fn wait(&self) -> impl Future<Output = Result<(), SessionError>> + 'static;

    /// Takes the lock if it is free; false if another session holds it. Bounded in time.
    fn try_acquire(&self) -> impl Future<Output = Result<bool, SessionError>>;

    /// After winning: the fencing token, and what the restart fence needs.
    fn fence(&self) -> impl Future<Output = Result<Fence, SessionError>>;

    /// After winning: listens for step-down requests (see [`step_down`]). The future sends what
    /// subscribes; run beside [`Session::fence`], both go out in one round trip. Requests come
    /// through the receiver while [`Session::ended`] is polled.
    fn listen(
        &mut self,
    ) -> (
        Requests,
        impl Future<Output = Result<(), SessionError>> + 'static,
    );

    /// Checks that this session still leads. The future owns what it needs.
    fn confirm(&self) -> impl Future<Output = Result<Check, SessionError>> + 'static;

    /// Releases the lock so that the next waiter is granted it at once, then closes. An error
    /// means this call did not release it; closing the session frees it anyway.
    fn release(self, timeout: Duration) -> impl Future<Output = Result<(), SessionError>>;

    /// The ledger of scheduled runs of `definition`, on this session.
    fn ledger(&self, definition: &Definition) -> Self::Ledger;
}

/// A connection that only reads: who holds and who waits, and the ledger's history.
pub trait Observer {
    /// Who holds the lock and who waits for it, in order.
    fn lock_view(&self) -> impl Future<Output = Result<LockView, String>>;

    /// The newest `limit` rows of the lock's ledger; `None` when it has no ledger at all.
    fn history(&self, limit: i64) -> impl Future<Output = Result<Option<Vec<Entry>>, LedgerError>>;

    /// The newest `limit` rows of crontab job `job`'s ledger in the fleet of this lock (none
    /// where the backend keeps no crontab).
    fn job_history(
        &self,
        job: &str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Entry>, LedgerError>> {
        let _ = (job, limit);
        async { Ok(Vec::new()) }
    }

    /// Pauses crontab job `job` of the fleet of this lock (`*`: every job) with `detail` (who
    /// paused it, and when), or with `None` resumes it (`*`: every pause of the fleet); whether
    /// anything changed. `None` where the backend keeps no crontab.
    fn set_paused(
        &self,
        job: &str,
        detail: Option<&str>,
    ) -> impl Future<Output = Result<Option<bool>, LedgerError>> {
        let _ = (job, detail);
        async { Ok(None) }
    }

    /// The fleet's paused jobs (`*`: every job), each with its pause's detail, by name.
    fn paused(&self) -> impl Future<Output = Result<Vec<(String, String)>, LedgerError>> {
        async { Ok(Vec::new()) }
    }

    /// Asks the crontab fleet of this lock to run its job `job` once, now (`pgleader cron
    /// run`), as `asked_by` (`user@host`), and wakes its replicas; the request's number.
    /// `None` where the backend keeps no crontab.
    fn ask_run(
        &self,
        job: &str,
        asked_by: &str,
    ) -> impl Future<Output = Result<Option<i64>, LedgerError>> {
        let _ = (job, asked_by);
        async { Ok(None) }
    }

    /// The requests to run job `job` by hand, newest first: request `id` alone, or the
    /// newest `limit`.
    fn asked_runs(
        &self,
        job: &str,
        id: Option<i64>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<AskedEntry>, LedgerError>> {
        let _ = (job, id, limit);
        async { Ok(Vec::new()) }
    }

    /// The server's clock now.
    fn server_time(&self) -> impl Future<Output = Result<Timestamp, LedgerError>>;

    /// Each job of the crontab fleet of this lock that the ledger knows, with its newest row;
    /// `None` where the backend cannot tell (no ledger, or a backend without crontabs yet).
    fn jobs(&self) -> impl Future<Output = Result<Option<Vec<JobEntry>>, LedgerError>> {
        async { Ok(None) }
    }

    /// Asks the lock's leader to step down (see [`step_down`]), with the request's id. How many
    /// sessions heard it, where the server tells (Redis); `None` where it cannot (PostgreSQL).
    fn ask_step_down(&self, request: &str) -> impl Future<Output = Result<Option<u64>, String>>;
}
