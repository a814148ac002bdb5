//! One holder session of a sharded replica and what goes with it: the roster read under way
//! (bounded by `--check-timeout`), the deadline every held shard counts from, and the watcher
//! session that waits for the member after this one to go (so that its shards are shared out
//! the moment it does). The room (`mod.rs`) drives it; nothing here runs a command.

use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
use tracing::debug;

use crate::election::shards::{Holder, Seen, ShardBackend, Watcher};
use crate::election::{ConnectError, SessionError};
use crate::supervise::watchdog::Deadline;
use crate::time::for_people as fmt;

pub(super) type ReadFuture = Pin<Box<dyn Future<Output = Result<Seen, SessionError>>>>;
pub(super) type WatchFuture = Pin<Box<dyn Future<Output = Result<(), SessionError>>>>;
pub(super) type OpenFuture<W> = Pin<Box<dyn Future<Output = (i32, Result<W, ConnectError>)>>>;

/// One holder session and what goes with it.
pub(super) struct Link<B: ShardBackend> {
    pub(super) holder: B::Holder,
    pub(super) me: i32,
    pub(super) joined: Instant,
    /// When the leadership of every shard held counts as lost without a successful read.
    pub(super) deadline: Instant,
    /// The same deadline, shared with every command's keeper (see `watchdog.rs`).
    pub(super) keepers: Deadline,
    /// The roster read under way, and when it was sent.
    pub(super) read: Option<(Instant, ReadFuture)>,
    /// A read that ended while another statement was awaited (see `alongside`).
    pub(super) read_done: Option<(Instant, Result<Seen, SessionError>)>,
    pub(super) next_read: Instant,
    /// Something changed while a read was under way, which that read may not have seen:
    /// read again as soon as it is done.
    pub(super) stale: bool,
    /// The watcher session, and the watch on it.
    pub(super) watching: Option<Watching<B::Watcher>>,
    /// A watcher session being opened, and the member it is for.
    pub(super) opening: Option<(i32, OpenFuture<B::Watcher>)>,
    /// Why the session is being left: once set, every command is stopping.
    pub(super) leaving: Option<String>,
    /// Left because the health probe turned unhealthy: the shards are released, not dropped.
    pub(super) unhealthy: bool,
    pub(super) fatal: Option<anyhow::Error>,
    /// Since when the roster has shown shards held by a session that is not a member.
    pub(super) transient_since: Option<Instant>,
    /// Watcher sessions given up while they waited, to end through the holder (see
    /// `Holder::end_sessions`).
    pub(super) abandoned: Vec<i32>,
    /// When this replica last took or gave a shard: a roster read sent before shows its own
    /// holdings as they were, and is not acted on.
    pub(super) changed_at: Option<Instant>,
    /// The table's changes when a roster was last acted on: a roster the backend finds
    /// unchanged, with the table as it was then, has nothing new to act on (at rest, a check
    /// does not plan a thousand jobs again). `None` once the items change.
    pub(super) applied: Option<u64>,
}

/// The watcher session and what it waits for.
pub(super) struct Watching<W> {
    pub(super) watcher: W,
    pub(super) member: i32,
    pub(super) watch: Option<WatchFuture>,
}

impl<B: ShardBackend> Link<B> {
    /// A session joined at `now` on `holder`, its deadline `interval + timeout` ahead (shared
    /// with the keepers through `keepers`), with the watcher sessions a lost one could not end.
    pub(super) fn new(
        holder: B::Holder,
        keepers: Deadline,
        abandoned: Vec<i32>,
        now: Instant,
        (interval, timeout): (Duration, Duration),
    ) -> Link<B> {
        Link {
            me: holder.id(),
            holder,
            joined: now,
            deadline: now + interval + timeout,
            keepers,
            read: None,
            read_done: None,
            next_read: now + interval,
            stale: false,
            watching: None,
            opening: None,
            leaving: None,
            unhealthy: false,
            fatal: None,
            transient_since: None,
            abandoned,
            changed_at: None,
            applied: None,
        }
    }

    /// Reads the roster now, or as soon as the read under way is done.
    pub(super) fn read_soon(&mut self, quiet: bool, timeout: Duration) {
        if self.read.is_some() {
            self.stale = true;
        } else if !quiet {
            // Abandoned watchers are ended first, on the same session, within the same bound.
            let ending = (!self.abandoned.is_empty()).then(|| {
                self.holder
                    .end_sessions(std::mem::take(&mut self.abandoned))
            });
            let roster = self.holder.roster();
            let read = async move {
                if let Some(ending) = ending {
                    // A watcher that cannot be ended now is no reason to doubt the session;
                    // the read says whether it still works.
                    let _ = ending.await;
                }
                roster.await
            };
            let bounded = async move {
                tokio::time::timeout(timeout, read)
                    .await
                    .unwrap_or_else(|_| {
                        Err(SessionError::Query(format!(
                            "no answer to the check within {} (--check-timeout)",
                            fmt(timeout)
                        )))
                    })
            };
            self.read = Some((Instant::now(), Box::pin(bounded)));
        }
    }

    /// Before the holder leaves: ends the watcher sessions, the one that waits included, so
    /// that none outlives this replica on the server.
    pub(super) async fn end_watchers(&mut self, timeout: Duration) {
        if let Some(current) = self.watching.take()
            && current.watch.is_some()
        {
            self.abandoned.push(current.watcher.id());
        }
        if !self.abandoned.is_empty() {
            let ending = self
                .holder
                .end_sessions(std::mem::take(&mut self.abandoned));
            let _ = tokio::time::timeout(timeout, ending).await;
        }
    }

    /// What is left of the deadline, for a statement awaited in place: never past it.
    pub(super) fn left(&self, timeout: Duration) -> Duration {
        self.deadline
            .saturating_duration_since(Instant::now())
            .min(timeout)
    }

    /// Why every shard is lost: `reason`, unless the keepers found the deadline past first
    /// (pgleader did not run) and stop their commands by themselves.
    pub(super) fn why(&self, reason: String) -> String {
        if self.keepers.has_expired() {
            self.keepers.lost_reason()
        } else {
            reason
        }
    }

    pub(super) fn leave_for(&mut self, reason: String) {
        self.leaving = Some(reason);
        self.read = None;
        if let Some(current) = self.watching.take()
            && current.watch.is_some()
        {
            self.abandoned.push(current.watcher.id());
        }
        self.opening = None;
    }

    /// Watches the member after this one, on the watcher session (opened beside the loop, or
    /// opened again, as needed); nobody when alone.
    pub(super) fn keep_watch(&mut self, seen: &Seen, backend: &B, name: &str)
    where
        B: Clone + 'static,
    {
        let link = self;
        let Some(member) = seen.roster.successor(link.me) else {
            if let Some(current) = link.watching.take()
                && current.watch.is_some()
            {
                link.abandoned.push(current.watcher.id());
            }
            link.opening = None;
            return;
        };
        if let Some(current) = &link.watching
            && current.member == member
            && current.watch.is_some()
        {
            return;
        }
        if link
            .opening
            .as_ref()
            .is_some_and(|(opening, _)| *opening == member)
        {
            return;
        }
        // A watch that was abandoned may have been granted: its session goes with it, and
        // the server is told to end it.
        if let Some(current) = link.watching.take_if(|current| current.watch.is_some()) {
            link.abandoned.push(current.watcher.id());
        }
        match link.watching.take() {
            Some(mut current) => {
                debug!(
                    event = "watching",
                    backend_pid = member,
                    "watching the replica of server process {member}"
                );
                current.watch = Some(Box::pin(current.watcher.watch(member)));
                current.member = member;
                link.watching = Some(current);
            }
            None => {
                let backend = backend.clone();
                let name = name.to_owned();
                link.opening = Some((
                    member,
                    Box::pin(async move { (member, backend.watcher(&name).await) }),
                ));
            }
        }
    }
}

/// Awaits a statement on the holder session while the roster read under way, if any, is
/// driven too (its end kept in `done`): the driver stops reading the connection while a
/// response waits for a future that nobody polls, and the statement's answer would wait
/// behind it.
pub(super) async fn alongside<T>(
    read: &mut Option<(Instant, ReadFuture)>,
    done: &mut Option<(Instant, Result<Seen, SessionError>)>,
    statement: impl Future<Output = T>,
) -> T {
    tokio::pin!(statement);
    if let Some((sent, future)) = read {
        let sent = *sent;
        tokio::select! {
            biased;
            result = future => {
                *done = Some((sent, result));
                *read = None;
            }
            out = &mut statement => return out,
        }
    }
    statement.await
}

pub(super) fn no_answer(what: &str) -> SessionError {
    SessionError::Query(format!("no answer while {what} before the deadline"))
}
