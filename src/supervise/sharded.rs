//! `pgleader run --shards K`: the command runs once per shard, on whichever replica holds that
//! shard, and every replica runs its share (see `election/shards.rs` for the rule, and the
//! backend's `shards.rs` for the sessions).
//!
//! A room of its own beside the single leader's supervisor: one task owns the holder session,
//! the watcher, a job per shard it runs and the signals, and goes round one `select!`. Each
//! shard keeps every promise a single leader keeps: its command starts only once its lock is
//! held and fenced (its own `PGLEADER_EPOCH`, the restart fence and `--takeover-delay`
//! counted), it runs in a process group of its own under a keeper that holds the holder's
//! socket (a kill -9 of pgleader frees the shard only after the whole tree), and a shard is
//! given away only after its command's whole tree is gone. What differs: stopping one shard
//! must not hold up the others, so each stop is a small state machine driven by the loop (the
//! stop signal, `--kill-timeout`, SIGKILL through the keeper, SIGKILL to the group), where the
//! single leader awaits `Inbox::stop`; and nothing the loop awaits in place may outlast the
//! deadline (every statement is bounded by what is left of it, and the watcher's connection
//! opens beside the loop).
//!
//! The roster is read when another member says something changed (it joined, gave a shard
//! away, left, or its watcher found it gone) and every `--check-interval`; that read is also
//! the check that this replica still holds its shards, with the single leader's deadline
//! (`--check-interval + --check-timeout`). A shard the check no longer finds, a session that
//! ends, or a deadline passed: the commands concerned are stopped at once.
//!
//! With `--health-cmd`, a replica joins only while its probe (`health.rs`) says it is healthy.
//! One that turns unhealthy stops every command it runs, gives every shard up once their trees
//! are gone, leaves the fleet (so that the others share its shards out), and joins again only
//! once a probe passes.

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use anyhow::bail;
use jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::election::backoff::Backoff;
use crate::election::shards::{Holder, HolderEvent, JoinError, Seen, ShardBackend, Watcher};
use crate::election::{ConnectError, SessionError};
use crate::exit::{ChildStatus, Outcome};
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::{CommandState, CommandView, ShardView, Telemetry};
use crate::supervise::health::Health;
use crate::supervise::hook;
use crate::supervise::inbox::{Inbox, KEEPER_GRACE, REPEAT_WINDOW, send_stop_signal, status_of};
use crate::supervise::job::{self, CommandError, Job, Parked};
use crate::supervise::keeper::Report;
use crate::supervise::signals::SignalEvent;
use crate::supervise::{Settings, Sharding};
use crate::time::for_people as fmt;

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

/// How often the process table is read for what is left of a group whose keeper was killed
/// from outside.
const GROUP_RECHECK: Duration = Duration::from_millis(10);

/// How soon the roster is read again while it shows shards held by a session that is no
/// longer a member: one that is ending, whose locks the server frees one after the other, so
/// that a read just after its membership went can still find some of its shards held. For at
/// most `TRANSIENT_FOR`; a holder that stays so is waited for at the usual interval.
const TRANSIENT_RECHECK: Duration = Duration::from_millis(5);
const TRANSIENT_FOR: Duration = Duration::from_secs(1);

/// Runs a sharded replica until it is shut down or a fatal error occurs.
pub async fn run<B: ShardBackend + Clone + 'static>(
    backend: B,
    settings: Settings,
    sharding: Sharding,
    signals: UnboundedReceiver<SignalEvent>,
    telemetry: Telemetry,
) -> anyhow::Result<Outcome> {
    let health = match settings.health.clone() {
        Some(check) => Health::start(check, telemetry.clone())?,
        None => Health::none(),
    };
    let mut room = Room {
        health,
        inbox: Inbox::new(
            signals,
            telemetry,
            settings.kill_timeout,
            settings.hooks.timeout,
        ),
        backend,
        settings,
        sharding,
        backoff: Backoff::default(),
        shards: BTreeMap::new(),
        last_disturbance: None,
        signals_open: true,
        leftover_watchers: Vec::new(),
    };
    let mut pause = Duration::ZERO;
    loop {
        if !pause.is_zero() && !room.inbox.pause(pause).await {
            return Ok(Outcome::Shutdown);
        }
        // Out of the fleet until the health probe passes: not even connected.
        if !room.health.sit_out(&mut room.inbox).await {
            return Ok(Outcome::Shutdown);
        }
        let Some(holder) = room.join().await? else {
            return Ok(Outcome::Shutdown);
        };
        let joined = Instant::now();
        match room.serve(holder).await? {
            Served::Shutdown => return Ok(Outcome::Shutdown),
            Served::Unhealthy => {
                room.backoff.reset();
                pause = Duration::ZERO;
            }
            Served::Lost => {
                room.last_disturbance = Some(Instant::now());
                if joined.elapsed() >= STABLE_SESSION {
                    room.backoff.reset();
                }
                pause = room.backoff.next_delay();
            }
        }
    }
}

struct Room<B: ShardBackend> {
    backend: B,
    settings: Settings,
    sharding: Sharding,
    inbox: Inbox,
    backoff: Backoff,
    /// The shards this replica holds, with their commands.
    shards: BTreeMap<u32, Shard>,
    /// When a holder session last ended other than by pgleader's own doing.
    last_disturbance: Option<Instant>,
    /// False once the signal channel has closed (which means: shut down).
    signals_open: bool,
    /// Watcher sessions a lost holder could not end, for the next holder to end.
    leftover_watchers: Vec<i32>,
    /// Whether this replica may join and hold shards (`--health-cmd`).
    health: Health,
}

/// A shard this replica holds.
struct Shard {
    epoch: i64,
    /// When it was taken, and its command's last start and exit: what `/status` shows.
    taken_at: Timestamp,
    started: Option<(i32, Timestamp)>,
    last_exit: Option<(ChildStatus, Timestamp)>,
    /// When its command may start: the restart fence and `--takeover-delay` after it was
    /// taken, `--restart-delay` after its command exited on its own.
    start_at: Instant,
    /// `None` until the command starts.
    job: Option<Job>,
    /// Set once the command is being stopped, or has exited and what it left is.
    stopping: Option<Stopping>,
    /// How the command ended, once it did, and whether that was logged.
    status: Option<(ChildStatus, bool)>,
    /// `--pre-start` failures in a row: the next try waits longer each time.
    pre_start_failures: u32,
}

/// What happens to a shard once its command's whole tree is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum After {
    /// Released, for a replica short of its share.
    Give,
    /// Kept, and its command started again after `--restart-delay` (it exited on its own).
    Restart,
    /// Nothing: the lock is gone already, or the whole session is being left.
    Forget,
}

/// A stop under way.
struct Stopping {
    after: After,
    /// The signal the command was sent, sent again if it starts only now.
    signal: Signal,
    /// When the kill timeout runs out; `None` once SIGKILL was sent.
    escalate_at: Option<Instant>,
    /// When the keeper is given up on, after SIGKILL, and the group is SIGKILLed directly.
    keeper_kill_at: Option<Instant>,
    /// When to read the process table again for what is left of a group whose keeper was
    /// killed from outside.
    recheck_at: Option<Instant>,
}

enum Served {
    Shutdown,
    Lost,
    /// The health probe turned unhealthy: every shard was given up and the fleet left.
    Unhealthy,
}

enum Event<W> {
    Holder(HolderEvent),
    Deadline,
    /// A roster read ended; when it was sent, if it was driven to its end outside the loop.
    Read(Option<Instant>, Result<Seen, SessionError>),
    ReadDue,
    Opened(i32, Result<W, ConnectError>),
    Watched(Result<(), SessionError>),
    Signal(Option<SignalEvent>),
    Report(u32, Report),
    Timer,
    Unhealthy,
}

type ReadFuture = Pin<Box<dyn Future<Output = Result<Seen, SessionError>>>>;
type WatchFuture = Pin<Box<dyn Future<Output = Result<(), SessionError>>>>;
type OpenFuture<W> = Pin<Box<dyn Future<Output = (i32, Result<W, ConnectError>)>>>;

/// One holder session and what goes with it.
struct Link<B: ShardBackend> {
    holder: B::Holder,
    me: i32,
    joined: Instant,
    /// When the leadership of every shard held counts as lost without a successful read.
    deadline: Instant,
    /// The roster read under way, and when it was sent.
    read: Option<(Instant, ReadFuture)>,
    /// A read that ended while another statement was awaited (see `alongside`).
    read_done: Option<(Instant, Result<Seen, SessionError>)>,
    next_read: Instant,
    /// Something changed while a read was under way, which that read may not have seen:
    /// read again as soon as it is done.
    stale: bool,
    /// The watcher session, and the watch on it.
    watching: Option<Watching<B::Watcher>>,
    /// A watcher session being opened, and the member it is for.
    opening: Option<(i32, OpenFuture<B::Watcher>)>,
    /// Why the session is being left: once set, every command is stopping.
    leaving: Option<String>,
    /// Left because the health probe turned unhealthy: the shards are released, not dropped.
    unhealthy: bool,
    fatal: Option<anyhow::Error>,
    /// Since when the roster has shown shards held by a session that is not a member.
    transient_since: Option<Instant>,
    /// Watcher sessions given up while they waited, to end through the holder (see
    /// `Holder::end_sessions`).
    abandoned: Vec<i32>,
    /// When this replica last took or gave a shard: a roster read sent before shows its own
    /// holdings as they were, and is not acted on.
    changed_at: Option<Instant>,
}

/// The watcher session and what it waits for.
struct Watching<W> {
    watcher: W,
    member: i32,
    watch: Option<WatchFuture>,
}

impl<B: ShardBackend> Link<B> {
    /// Reads the roster now, or as soon as the read under way is done.
    fn read_soon(&mut self, quiet: bool, timeout: Duration) {
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
    async fn end_watchers(&mut self, timeout: Duration) {
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
    fn left(&self, timeout: Duration) -> Duration {
        self.deadline
            .saturating_duration_since(Instant::now())
            .min(timeout)
    }

    fn leave_for(&mut self, reason: String) {
        self.leaving = Some(reason);
        self.read = None;
        if let Some(current) = self.watching.take()
            && current.watch.is_some()
        {
            self.abandoned.push(current.watcher.id());
        }
        self.opening = None;
    }
}

impl<B: ShardBackend + Clone + 'static> Room<B> {
    /// Connects and joins the fleet, retrying transient failures with backoff. `None` means
    /// shut down.
    async fn join(&mut self) -> anyhow::Result<Option<B::Holder>> {
        let server = self.backend.to_string();
        self.inbox.telemetry.connecting();
        loop {
            let attempt = self.backend.join(
                &self.settings.session_name,
                self.sharding.count,
                self.sharding.cap,
            );
            tokio::pin!(attempt);
            let result = loop {
                tokio::select! {
                    result = &mut attempt => break result,
                    event = self.inbox.signals.recv() => {
                        if self.inbox.idle_signal(event) {
                            return Ok(None);
                        }
                    }
                }
            };
            let err = match result {
                Ok(holder) => return Ok(Some(holder)),
                Err(
                    err @ (JoinError::Mismatch(_) | JoinError::Connect(ConnectError::Conflict(_))),
                ) => {
                    return Err(err.into());
                }
                Err(JoinError::Connect(ConnectError::Permanent(reason))) => {
                    bail!("cannot connect to {server}: {reason}");
                }
                Err(JoinError::Session(err @ SessionError::Unsafe(_))) => return Err(err.into()),
                Err(err) => err,
            };
            self.last_disturbance = Some(Instant::now());
            let delay = self.backoff.next_delay();
            self.inbox.telemetry.connect_failed(&err.to_string(), delay);
            warn!(event = "connect_failed", server = %server, reason = %err, "cannot join; retrying in {}", fmt(delay));
            if !self.inbox.pause(delay).await {
                return Ok(None);
            }
        }
    }

    /// Runs this replica's share on one holder session, until the session is lost (every
    /// command stopped by then) or pgleader shuts down (the same, and the shards released).
    async fn serve(&mut self, holder: B::Holder) -> anyhow::Result<Served> {
        let lock = self.settings.lock.clone();
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let now = Instant::now();
        let mut link: Link<B> = Link {
            me: holder.id(),
            holder,
            joined: now,
            deadline: now + interval + timeout,
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
            abandoned: std::mem::take(&mut self.leftover_watchers),
            changed_at: None,
        };
        let me = link.me;
        info!(event = "joined", lock = %lock, backend_pid = me, shards = self.sharding.count, "joined the replicas of this lock, {} shards", self.sharding.count);
        notify::status(&format!("running shards of lock {lock}"));
        self.inbox.telemetry.following(me);
        link.read_soon(false, timeout);
        loop {
            if self.shards.is_empty()
                && (link.fatal.is_some()
                    || self.inbox.shutdown_requested.is_some()
                    || link.leaving.is_some())
            {
                // Its answer would hold up the statements below (see `alongside`).
                link.read = None;
                link.read_done = None;
            }
            if self.shards.is_empty() {
                if let Some(err) = link.fatal.take() {
                    link.end_watchers(timeout).await;
                    let _ = link.holder.leave(timeout).await;
                    return Err(err);
                }
                if self.inbox.shutdown_requested.is_some() || link.unhealthy {
                    link.end_watchers(timeout).await;
                    match link.holder.leave(timeout).await {
                        Ok(()) => info!(event = "released", lock = %lock, "released every shard"),
                        Err(err) => {
                            warn!(event = "release_failed", lock = %lock, reason = %err, "cannot release the shards explicitly; closing the session frees them")
                        }
                    }
                    if self.inbox.shutdown_requested.is_some() {
                        return Ok(Served::Shutdown);
                    }
                    return Ok(Served::Unhealthy);
                }
                if link.leaving.is_some() {
                    // The session may still answer (a deadline passed, a statement failed);
                    // what it cannot end, the next one does.
                    link.end_watchers(timeout).await;
                    self.leftover_watchers = std::mem::take(&mut link.abandoned);
                    return Ok(Served::Lost);
                }
            }
            let timer = self.next_timer();
            let holds_any = !self.shards.is_empty();
            let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
            let leaving = link.leaving.is_some();
            let signals_open = self.signals_open;
            let health = &mut self.health;
            let shards = &mut self.shards;
            let reports = std::future::poll_fn(|cx| {
                for (index, shard) in shards.iter_mut() {
                    if let Some(job) = &mut shard.job
                        && let Poll::Ready(report) = job.poll_report(cx)
                    {
                        return Poll::Ready((*index, report));
                    }
                }
                Poll::Pending
            });
            let Link {
                holder,
                deadline,
                read,
                read_done,
                next_read,
                watching,
                opening,
                ..
            } = &mut link;
            // Biased: the end of the session and the deadline win over everything.
            let event = if let Some((sent, result)) = read_done.take() {
                Event::Read(Some(sent), result)
            } else {
                tokio::select! {
                biased;
                event = holder.next_event(), if !leaving => Event::Holder(event),
                () = health.turned_unhealthy(), if !quiet => Event::Unhealthy,
                _ = sleep_until(*deadline), if !quiet && holds_any => Event::Deadline,
                result = async { match read { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Read(None, result),
                event = self.inbox.signals.recv(), if signals_open => Event::Signal(event),
                (index, report) = reports => Event::Report(index, report),
                _ = sleep_until(timer) => Event::Timer,
                result = async { match watching.as_mut().and_then(|w| w.watch.as_mut()) { Some(watch) => watch.await, None => std::future::pending().await } } => Event::Watched(result),
                (member, result) = async { match opening { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Opened(member, result),
                _ = sleep_until(*next_read), if read.is_none() && !quiet => Event::ReadDue,
                }
            };
            match event {
                Event::Holder(HolderEvent::Notified(word)) => {
                    debug!(event = "notified", lock = %lock, word = %word, "another replica: {word}");
                    link.read_soon(quiet, timeout);
                }
                Event::Holder(HolderEvent::Ended(reason)) => {
                    self.lose_all(
                        &format!("the connection ended: {reason}"),
                        LossReason::ConnectionEnded,
                    );
                    link.leave_for(reason);
                }
                Event::Deadline => {
                    let reason = format!(
                        "no successful check for {} (--check-interval + --check-timeout)",
                        fmt(interval + timeout)
                    );
                    self.lose_all(&reason, LossReason::CheckTimeout);
                    link.leave_for(reason);
                }
                Event::Unhealthy => {
                    let reason = "the health probe failed (--health-cmd)";
                    warn!(event = "health_step_down", lock = %lock, "giving up every shard and leaving: {reason}; not joining again until it passes");
                    notify::status(
                        "unhealthy: giving up every shard until the health probe passes",
                    );
                    if !self.shards.is_empty() {
                        self.inbox
                            .telemetry
                            .leadership_lost(LossReason::Unhealthy, reason);
                    }
                    // Released once every command's tree is gone, not before.
                    self.stop_all(self.settings.kill_signal, After::Forget);
                    link.unhealthy = true;
                    link.leave_for(reason.to_owned());
                }
                Event::ReadDue => link.read_soon(quiet, timeout),
                Event::Read(sent, result) => {
                    let sent = sent
                        .or_else(|| link.read.take().map(|(sent, _)| sent))
                        .unwrap_or_else(Instant::now);
                    self.inbox
                        .telemetry
                        .check_completed(sent.elapsed(), result.is_ok());
                    match result {
                        Err(err) => {
                            let reason = format!("the check failed: {err}");
                            self.lose_all(&reason, LossReason::CheckFailed);
                            if let SessionError::Unsafe(_) = err {
                                link.fatal = Some(err.into());
                            }
                            link.leave_for(reason);
                        }
                        Ok(_) if quiet => {}
                        Ok(seen) => {
                            link.deadline = sent + interval + timeout;
                            link.next_read = sent + interval;
                            if seen.taken.is_empty() {
                                link.transient_since = None;
                            } else if link.transient_since.get_or_insert(sent).elapsed()
                                < TRANSIENT_FOR
                            {
                                link.next_read = Instant::now() + TRANSIENT_RECHECK;
                            }
                            if link.changed_at.is_some_and(|at| sent < at) {
                                // Sent before this replica's last take or give: read again.
                                link.stale = false;
                                link.read_soon(quiet, timeout);
                                continue;
                            }
                            if let Some(reason) = seen.mismatch {
                                // A replica of another kind that started at the very moment
                                // this one did, and so was not refused: stop rather than
                                // overlap with it, and exit as a refused replica would.
                                self.lose_all(&reason, LossReason::NotHeld);
                                link.fatal = Some(JoinError::Mismatch(reason).into());
                                link.leave_for("a replica of another kind runs this lock".into());
                            } else {
                                self.keep_watch(&mut link, &seen);
                                match self.apply(&mut link, &seen).await {
                                    // Only after the shards it took: a read sent before would not
                                    // show them, and they would look lost.
                                    Ok(()) if std::mem::take(&mut link.stale) => {
                                        link.read_soon(quiet, timeout);
                                    }
                                    Ok(()) => {}
                                    Err(Failure::Session(err)) => {
                                        let reason = format!("a statement failed: {err}");
                                        self.lose_all(&reason, LossReason::CheckFailed);
                                        link.leave_for(reason);
                                    }
                                    Err(Failure::Fatal(err)) => {
                                        self.stop_all(Signal::SIGKILL, After::Forget);
                                        link.fatal = Some(err);
                                        link.leave_for("a fatal error".into());
                                    }
                                }
                            }
                        }
                    }
                }
                Event::Opened(member, result) => {
                    link.opening = None;
                    match result {
                        Ok(watcher) => {
                            debug!(
                                event = "watching",
                                backend_pid = member,
                                "watching the replica of server process {member}"
                            );
                            let watch = Box::pin(watcher.watch(member));
                            link.watching = Some(Watching {
                                watcher,
                                member,
                                watch: Some(watch),
                            });
                        }
                        Err(err) => {
                            warn!(event = "watch_failed", reason = %err, "cannot open the watcher's session; trying again at the next check");
                        }
                    }
                }
                Event::Watched(result) => {
                    if let Some(mut watch) = link.watching.take() {
                        match result {
                            Ok(()) => {
                                info!(event = "member_gone", lock = %lock, backend_pid = watch.member, "the replica of server process {} is gone; its shards are free", watch.member);
                                // The watch ended as asked: the session is free for the next.
                                watch.watch = None;
                                link.watching = Some(watch);
                            }
                            Err(err) => {
                                debug!(event = "watch_failed", reason = %err, "the watcher's session failed; opening another at the next check");
                            }
                        }
                        link.read_soon(quiet, timeout);
                    }
                }
                Event::Signal(event) => self.on_signal(event),
                Event::Report(index, report) => {
                    if let Err(err) = self.on_report(index, report) {
                        self.stop_all(Signal::SIGKILL, After::Forget);
                        link.fatal = Some(err.into());
                        link.leave_for("a fatal error".into());
                    }
                }
                Event::Timer => {
                    if let Err(err) = self.on_timer(me, &link.holder.sockets()) {
                        self.stop_all(Signal::SIGKILL, After::Forget);
                        link.fatal = Some(err);
                        link.leave_for("a fatal error".into());
                    }
                }
            }
            if let Err(err) = self.finish_stopped(&mut link).await {
                let reason = format!("a statement failed: {err}");
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
            }
            self.publish(me);
        }
    }

    /// Acts on a roster: stops the commands of shards this session no longer holds, gives a
    /// surplus away, takes free shards up to its share. Each statement awaited here is bounded
    /// by what is left of the deadline.
    async fn apply(&mut self, link: &mut Link<B>, seen: &Seen) -> Result<(), Failure> {
        let lock = self.settings.lock.clone();
        let (me, holder) = (link.me, &link.holder);
        let timeout = self.settings.check_timeout;
        let Some(at) = seen
            .roster
            .members
            .iter()
            .position(|member| member.id == me)
        else {
            // The member lock is gone: the session no longer holds anything of the name.
            return Err(Failure::Session(SessionError::Query(
                "this replica's member lock is no longer held".into(),
            )));
        };
        let mine = &seen.roster.members[at].holds;
        let lost: Vec<u32> = self
            .shards
            .iter()
            .filter(|(index, shard)| {
                !mine.contains(index)
                    && shard
                        .stopping
                        .as_ref()
                        .is_none_or(|stop| stop.after != After::Forget)
            })
            .map(|(index, _)| *index)
            .collect();
        for index in lost {
            warn!(event = "leadership_lost", lock = %lock, shard = index, "the check found that this session no longer holds shard {index}; stopping its command");
            self.stop(index, self.settings.kill_signal, After::Forget);
        }
        // Held on the server with no command here: a give that failed, or one made while this
        // roster was read. Let it go; a shard given already is no error.
        for index in mine.iter().filter(|index| !self.shards.contains_key(index)) {
            link.changed_at = Some(Instant::now());
            match tokio::time::timeout(link.left(timeout), holder.give(*index)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    debug!(event = "release_failed", shard = *index, reason = %err, "shard {index} was not held any more");
                }
                Err(_) => return Err(Failure::Session(no_answer("releasing a shard"))),
            }
        }
        let share = seen.roster.shares()[at] as usize;
        let giving = self
            .shards
            .values()
            .filter(|shard| {
                shard
                    .stopping
                    .as_ref()
                    .is_some_and(|stop| stop.after == After::Give)
            })
            .count();
        let keeping = self.shards.len() - giving;
        if keeping > share {
            let surplus: Vec<u32> = self
                .shards
                .iter()
                .rev()
                .filter(|(_, shard)| shard.stopping.is_none())
                .map(|(index, _)| *index)
                .take(keeping - share)
                .collect();
            for index in surplus {
                info!(event = "hand_over", lock = %lock, shard = index, "handing shard {index} over to a replica short of its share");
                self.stop(index, self.settings.kill_signal, After::Give);
            }
            return Ok(());
        }
        if giving > 0 {
            return Ok(());
        }
        // Never a shard this replica holds already, whatever the roster says.
        let wanted: Vec<u32> = seen
            .roster
            .to_take(me)
            .into_iter()
            .filter(|index| !self.shards.contains_key(index))
            .collect();
        // A replica whose probe turned unhealthy takes nothing: it is about to leave.
        if wanted.is_empty() || !self.health.is_healthy() {
            return Ok(());
        }
        link.changed_at = Some(Instant::now());
        let (won, fence) = tokio::time::timeout(link.left(timeout), holder.take(&wanted))
            .await
            .map_err(|_| Failure::Session(no_answer("taking shards")))?
            .map_err(Failure::Session)?;
        let Some(fence) = fence else {
            return Ok(());
        };
        let delay = self.settings.start_delay(
            self.last_disturbance,
            fence.since_server_reset,
            link.joined.elapsed(),
        );
        for index in won {
            info!(event = "leader", lock = %lock, shard = index, epoch = fence.epoch, backend_pid = me, "took shard {index}");
            if self.shards.contains_key(&index) {
                continue;
            }
            self.inbox.telemetry.shard_taken(index, fence.epoch);
            self.shards.insert(
                index,
                Shard {
                    epoch: fence.epoch,
                    taken_at: Timestamp::now(),
                    started: None,
                    last_exit: None,
                    start_at: Instant::now() + delay,
                    job: None,
                    stopping: None,
                    status: None,
                    pre_start_failures: 0,
                },
            );
        }
        self.on_timer(me, &holder.sockets()).map_err(Failure::Fatal)
    }

    /// Watches the member after this one, on the watcher session (opened beside the loop, or
    /// opened again, as needed); nobody when alone.
    fn keep_watch(&mut self, link: &mut Link<B>, seen: &Seen) {
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
                let backend = self.backend.clone();
                let name = self.settings.session_name.clone();
                link.opening = Some((
                    member,
                    Box::pin(async move { (member, backend.watcher(&name).await) }),
                ));
            }
        }
    }

    /// Starts the commands whose start time has come, with the keeper holding `sockets` (the
    /// holder session's, read now: none once it is closed), and moves stops along.
    fn on_timer(&mut self, me: i32, sockets: &[RawFd]) -> anyhow::Result<()> {
        let now = Instant::now();
        let starting: Vec<u32> = self
            .shards
            .iter()
            .filter(|(_, shard)| {
                shard.job.is_none() && shard.stopping.is_none() && shard.start_at <= now
            })
            .map(|(index, _)| *index)
            .collect();
        // Without the session's socket a keeper could not order a crash: the session has
        // ended, which the loop hears next.
        // Nor while the probe says unhealthy (it may have turned so while shards were being
        // taken): the loop hears it next and gives them all up.
        if !starting.is_empty() && !sockets.is_empty() && self.health.is_healthy() {
            for index in starting {
                self.start(index, me, sockets)?;
            }
        }
        for (index, shard) in &mut self.shards {
            let (Some(job), Some(stop)) = (&shard.job, &mut shard.stopping) else {
                continue;
            };
            if stop.escalate_at.is_some_and(|at| at <= now) && !job.is_finished() {
                warn!(
                    event = "kill",
                    shard = *index,
                    pgid = job.pgid().as_raw(),
                    "the command of shard {index} did not exit within {} (--kill-timeout); sending SIGKILL to everything it started",
                    fmt(self.settings.kill_timeout)
                );
                escalate(job, stop);
            } else if stop.keeper_kill_at.is_some_and(|at| at <= now) {
                warn!(
                    event = "kill",
                    shard = *index,
                    pgid = job.pgid().as_raw(),
                    "the keeper of shard {index} did not finish; sending SIGKILL to the process group"
                );
                job.kill_groups();
                stop.keeper_kill_at = None;
            }
        }
        Ok(())
    }

    /// Starts shard `index`'s command under a new keeper.
    fn start(&mut self, index: u32, me: i32, sockets: &[RawFd]) -> anyhow::Result<()> {
        let Some(shard) = self.shards.get_mut(&index) else {
            return Ok(());
        };
        let mut env = self.settings.leader_env(me, shard.epoch);
        env.push(("PGLEADER_SHARD", index.to_string()));
        env.push(("PGLEADER_SHARDS", self.sharding.count.to_string()));
        let job = Parked::spawn(&self.settings.command, &self.settings.hooks)
            .and_then(|parked| parked.start(&env, sockets))
            .map_err(|err| anyhow::anyhow!("cannot start the keeper process: {err}"))?;
        debug!(
            event = "spawned",
            shard = index,
            pgid = job.pgid().as_raw(),
            "started the keeper"
        );
        shard.job = Some(job);
        shard.status = None;
        Ok(())
    }

    /// The next moment a timer is due: a delayed start, a stop's next step.
    fn next_timer(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        self.shards
            .values()
            .flat_map(|shard| {
                let start =
                    (shard.job.is_none() && shard.stopping.is_none()).then_some(shard.start_at);
                let stop = shard.stopping.as_ref().and_then(|stop| {
                    [stop.escalate_at, stop.keeper_kill_at, stop.recheck_at]
                        .into_iter()
                        .flatten()
                        .min()
                });
                start.into_iter().chain(stop)
            })
            .min()
            .unwrap_or(far)
            .min(far)
    }

    /// Starts stopping a shard's command: `signal` to its group, then the kill timeout; once
    /// its tree is gone, `after`.
    fn stop(&mut self, index: u32, signal: Signal, after: After) {
        let Some(shard) = self.shards.get_mut(&index) else {
            return;
        };
        if let Some(stop) = &mut shard.stopping {
            // A lost lock or a shutdown overrides a handover or a restart: nothing is left to
            // give, nothing to restart.
            if after == After::Forget {
                stop.after = After::Forget;
            }
            return;
        }
        if let Some(job) = &shard.job {
            send_stop_signal(job, signal);
            if shard.status.is_none() {
                info!(
                    event = "stopping",
                    shard = index,
                    pgid = job.pgid().as_raw(),
                    signal = signal.as_str(),
                    "stopping the command of shard {index}: {} to its process group",
                    signal.as_str()
                );
            }
        }
        let mut stop = Stopping {
            after,
            signal,
            escalate_at: Some(Instant::now() + self.settings.kill_timeout),
            keeper_kill_at: None,
            recheck_at: None,
        };
        if signal == Signal::SIGKILL
            && let Some(job) = &shard.job
        {
            escalate(job, &mut stop);
        }
        shard.stopping = Some(stop);
    }

    fn stop_all(&mut self, signal: Signal, after: After) {
        let indices: Vec<u32> = self.shards.keys().copied().collect();
        for index in indices {
            self.stop(index, signal, after);
        }
    }

    /// Every shard is lost (or about to be): stop every command.
    fn lose_all(&mut self, reason: &str, loss: LossReason) {
        warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %reason, "lost every shard");
        notify::status(&format!("shards lost ({reason}); stopping their commands"));
        self.inbox.telemetry.leadership_lost(loss, reason);
        self.last_disturbance = Some(Instant::now());
        self.stop_all(self.settings.kill_signal, After::Forget);
    }

    fn on_signal(&mut self, event: Option<SignalEvent>) {
        match event {
            Some(SignalEvent::Forward(signal)) => {
                for shard in self.shards.values() {
                    if let Some(job) = &shard.job
                        && let Err(err) = job.signal(signal)
                    {
                        warn!(event = "signal_failed", reason = %err, "cannot pass the signal on");
                    }
                }
            }
            Some(SignalEvent::ChildStateChanged) => {
                for (pid, status) in job::reap_all() {
                    let ours = self.shards.values_mut().any(|shard| {
                        shard
                            .job
                            .as_mut()
                            .is_some_and(|job| job.note_reaped(pid, status))
                    });
                    if !ours {
                        debug!(
                            event = "reaped",
                            pid = pid.as_raw(),
                            "reaped an orphaned process"
                        );
                    }
                }
            }
            Some(SignalEvent::Shutdown(signal)) => match self.inbox.shutdown_requested {
                Some(first) if first.elapsed() < REPEAT_WINDOW => {}
                Some(_) => {
                    warn!(
                        event = "kill",
                        signal = signal.as_str(),
                        "second shutdown signal: sending SIGKILL"
                    );
                    for shard in self.shards.values_mut() {
                        if let (Some(job), Some(stop)) = (&shard.job, &mut shard.stopping) {
                            if stop.escalate_at.is_some() {
                                escalate(job, stop);
                            } else {
                                // Past the kill timeout, or its --post-stop runs: end that too.
                                let _ = job.abort();
                            }
                        }
                    }
                }
                None => self.shut_down(signal),
            },
            // Nothing more can come: no second TERM, no SIGCHLD (keepers are then read until
            // their reports end, and their groups through the process table).
            None => {
                self.signals_open = false;
                if self.inbox.shutdown_requested.is_none() {
                    self.shut_down(Signal::SIGTERM);
                }
            }
        }
    }

    fn shut_down(&mut self, signal: Signal) {
        self.inbox.begin_shutdown(
            signal,
            "shutting down: stopping every shard's command, then releasing the shards",
        );
        self.stop_all(signal, After::Forget);
    }

    /// A keeper's report about a shard's command.
    fn on_report(&mut self, index: u32, report: Report) -> Result<(), CommandError> {
        let command = &self.settings.command;
        let Some(shard) = self.shards.get_mut(&index) else {
            return Ok(());
        };
        match report {
            Report::Started(pid) => {
                info!(event = "child_started", shard = index, pid, command = %command.display(), "started the command of shard {index}");
                shard.started = Some((pid, Timestamp::now()));
                shard.pre_start_failures = 0;
                if let (Some(job), Some(stop)) = (&shard.job, &shard.stopping) {
                    // A signal sent to the group before it existed reached only the keeper.
                    send_stop_signal(job, stop.signal);
                }
                Ok(())
            }
            Report::SpawnFailed(errno) => Err(CommandError::from_errno(
                command.program().as_os_str(),
                errno,
            )),
            Report::Exited(_) | Report::Killed(_) => {
                let status = status_of(report);
                info!(event = "child_exited", shard = index, status = %status, exit_code = status.exit_code(), "the command of shard {index} exited");
                shard.status.get_or_insert((status, true));
                if shard.stopping.is_none() {
                    // On its own: what it left in its group goes too; the shard stays here
                    // and its command starts again after --restart-delay.
                    self.stop(index, self.settings.kill_signal, After::Restart);
                }
                Ok(())
            }
            Report::Done(_) => Ok(()),
            // The keeper logged why; its post-stop runs next, and the shard's command is tried
            // again later, 1s doubling up to a minute while its pre-start keeps failing.
            Report::PreStartFailed(code) => {
                shard
                    .status
                    .get_or_insert((ChildStatus::Exited(code.max(1)), true));
                shard.pre_start_failures = shard.pre_start_failures.saturating_add(1);
                self.stop(index, self.settings.kill_signal, After::Restart);
                Ok(())
            }
            Report::PostStop(_) => {
                if let Some(stop) = &mut shard.stopping {
                    stop.escalate_at = None;
                    stop.keeper_kill_at =
                        Some(Instant::now() + self.settings.hooks.timeout + KEEPER_GRACE);
                }
                Ok(())
            }
        }
    }

    /// Settles the shards whose commands are wholly gone: each is given away, kept for a
    /// restart, or forgotten. A give is bounded by what is left of the deadline; an error
    /// means the session is in doubt.
    async fn finish_stopped(&mut self, link: &mut Link<B>) -> Result<(), SessionError> {
        let now = Instant::now();
        let done: Vec<u32> = self
            .shards
            .iter()
            .filter(|(_, shard)| match (&shard.job, &shard.stopping) {
                (None, stopping) => stopping.is_some(),
                (Some(job), Some(stop)) => {
                    job.is_finished() && stop.recheck_at.is_none_or(|at| at <= now)
                }
                // Its keeper vanished (killed from outside) without being stopped.
                (Some(job), None) => job.is_finished(),
            })
            .map(|(index, _)| *index)
            .collect();
        for index in done {
            let Some(shard) = self.shards.get_mut(&index) else {
                continue;
            };
            if let Some(job) = &mut shard.job {
                for report in job.remaining_reports() {
                    if matches!(report, Report::Exited(_) | Report::Killed(_)) {
                        shard.status.get_or_insert((status_of(report), false));
                    }
                }
                // Without the keeper's word that nothing is left (it was killed from outside),
                // the group goes through the process table, without holding the loop up.
                if !job.reported_done() && !job.group_members().is_empty() {
                    job.kill_groups();
                    let stop = shard.stopping.get_or_insert(Stopping {
                        after: After::Restart,
                        signal: Signal::SIGKILL,
                        escalate_at: None,
                        keeper_kill_at: None,
                        recheck_at: None,
                    });
                    stop.recheck_at = Some(now + GROUP_RECHECK);
                    // SIGKILL went to the group: the stop's own steps are over.
                    stop.escalate_at = None;
                    stop.keeper_kill_at = None;
                    continue;
                }
                // A report the keeper sent just before it was reaped may not be readable yet:
                // its own exit status stands for the command's then.
                let (status, logged) = shard.status.unwrap_or((
                    job.keeper_status()
                        .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL)),
                    false,
                ));
                if !logged {
                    info!(event = "child_exited", shard = index, status = %status, exit_code = status.exit_code(), "the command of shard {index} exited");
                }
                self.inbox.telemetry.shard_command_exited(status);
                shard.started = None;
                shard.last_exit = Some((status, Timestamp::now()));
            }
            let after = shard.stopping.as_ref().map_or(After::Restart, |s| s.after);
            let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
            match after {
                After::Restart if !quiet && shard.pre_start_failures > 0 => {
                    shard.job = None;
                    shard.stopping = None;
                    let sit_out = hook::sit_out_after(shard.pre_start_failures);
                    shard.start_at = Instant::now() + sit_out;
                    info!(
                        event = "sitting_out",
                        shard = index,
                        "trying shard {index} again in {} (--pre-start failed {} time(s) in a row)",
                        fmt(sit_out),
                        shard.pre_start_failures
                    );
                    continue;
                }
                After::Restart if !quiet => {
                    shard.job = None;
                    shard.stopping = None;
                    shard.start_at = Instant::now() + self.settings.restart_delay;
                    if !self.settings.restart_delay.is_zero() {
                        info!(
                            event = "restart_delay",
                            shard = index,
                            "starting the command of shard {index} again in {} (--restart-delay)",
                            fmt(self.settings.restart_delay)
                        );
                    }
                    continue;
                }
                After::Give if !quiet => {
                    self.shards.remove(&index);
                    let left = link.left(self.settings.check_timeout);
                    link.changed_at = Some(Instant::now());
                    let give = tokio::time::timeout(left, link.holder.give(index));
                    match alongside(&mut link.read, &mut link.read_done, give).await {
                        Ok(Ok(())) => {
                            info!(event = "released", lock = %self.settings.lock, shard = index, "released shard {index}");
                            // A replica that was handing over took nothing meanwhile; the
                            // roster may have changed since (a member gone), and its own word
                            // does not come back to it.
                            link.read_soon(quiet, self.settings.check_timeout);
                        }
                        Ok(Err(err)) => return Err(err),
                        Err(_) => return Err(no_answer("releasing a shard")),
                    }
                }
                _ => {
                    self.shards.remove(&index);
                }
            }
        }
        Ok(())
    }

    /// What the HTTP endpoint and metrics show: the shards held here and their commands;
    /// leading while this replica holds one.
    fn publish(&self, me: i32) {
        let held = self
            .shards
            .iter()
            .map(|(index, shard)| ShardView {
                shard: *index,
                epoch: shard.epoch,
                since: shard.taken_at,
                command: CommandView {
                    state: match (&shard.started, &shard.stopping) {
                        (Some(_), Some(_)) => CommandState::Stopping,
                        (Some(_), None) => CommandState::Running,
                        (None, None) => CommandState::Waiting,
                        (None, Some(_)) => CommandState::NotRunning,
                    },
                    pid: shard.started.map(|(pid, _)| pid),
                    started_at: shard.started.map(|(_, at)| at),
                    last_exit: shard.last_exit,
                },
            })
            .collect();
        self.inbox.telemetry.shards_held(held, me);
    }
}

/// Why a roster could not be acted on.
enum Failure {
    /// A statement failed: the session is done for.
    Session(SessionError),
    /// A command cannot be started at all.
    Fatal(anyhow::Error),
}

/// Awaits a statement on the holder session while the roster read under way, if any, is
/// driven too (its end kept in `done`): the driver stops reading the connection while a
/// response waits for a future that nobody polls, and the statement's answer would wait
/// behind it.
async fn alongside<T>(
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

fn no_answer(what: &str) -> SessionError {
    SessionError::Query(format!("no answer while {what} before the deadline"))
}

/// SIGKILL to everything the command started, through the keeper (or to the group directly if
/// the keeper cannot be asked), and a grace for the keeper to finish.
fn escalate(job: &Job, stop: &mut Stopping) {
    stop.signal = Signal::SIGKILL;
    stop.escalate_at = None;
    if job.kill_everything().is_err() {
        job.kill_groups();
    }
    stop.keeper_kill_at = Some(Instant::now() + KEEPER_GRACE);
}
