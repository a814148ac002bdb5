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
//! must not hold up the others, so the commands are a table (`commands.rs`) whose stops the
//! loop drives, by the same stop machine the single leader awaits (`stop.rs`); and nothing the
//! loop awaits in place may outlast the deadline (every statement is bounded by what is left
//! of it, and the watcher's connection opens beside the loop: `link.rs`).
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

mod link;

use std::time::Duration;

use anyhow::bail;
use jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::election::backoff::Backoff;
use crate::election::shards::{Holder, HolderEvent, JoinError, Seen, ShardBackend, Watcher};
use crate::election::{ConnectError, SessionError, elsewhere_hint};
use crate::exit::Outcome;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::{ShardView, Telemetry};
use crate::supervise::commands::{After, Commands, Settled};
use crate::supervise::health::Health;
use crate::supervise::inbox::{Inbox, Shutdown};
use crate::supervise::job::Parked;
use crate::supervise::keeper::Report;
use crate::supervise::signals::SignalEvent;
use crate::supervise::{Settings, Sharding};
use crate::time::for_people as fmt;
use link::{Link, Watching, alongside, no_answer};

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

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
        inbox: Inbox::new(signals, telemetry, settings.stop_rules()),
        shards: Commands::new(
            settings.stop_rules(),
            settings.kill_signal,
            settings.restart_delay,
        ),
        backend,
        settings,
        sharding,
        backoff: Backoff::default(),
        last_disturbance: None,
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
    shards: Commands<u32, Shard>,
    /// When a holder session last ended other than by pgleader's own doing.
    last_disturbance: Option<Instant>,
    /// Watcher sessions a lost holder could not end, for the next holder to end.
    leftover_watchers: Vec<i32>,
    /// Whether this replica may join and hold shards (`--health-cmd`).
    health: Health,
}

/// What the room knows of a shard it holds, beside its command.
#[derive(Debug)]
struct Shard {
    epoch: i64,
    /// When it was taken: what `/status` shows.
    taken_at: Timestamp,
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
                    event = self.inbox.next_signal() => {
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
            // Said once, in the first line (see `elsewhere_hint`).
            let elsewhere = match &err {
                JoinError::Connect(connect) => {
                    elsewhere_hint(connect, self.last_disturbance.is_none(), &server)
                }
                _ => String::new(),
            };
            self.last_disturbance = Some(Instant::now());
            let delay = self.backoff.next_delay();
            self.inbox.telemetry.connect_failed(&err.to_string(), delay);
            warn!(event = "connect_failed", server = %server, reason = %err, "cannot join; retrying in {}{elsewhere}", fmt(delay));
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
            let timer = self.shards.next_timer();
            let holds_any = !self.shards.is_empty();
            let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
            let leaving = link.leaving.is_some();
            let health = &mut self.health;
            let shards = &mut self.shards;
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
                event = self.inbox.next_signal() => Event::Signal(event),
                (index, report) = shards.next_report() => Event::Report(index, report),
                _ = async { match timer { Some(at) => sleep_until(at).await, None => std::future::pending().await } } => Event::Timer,
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
                    self.shards
                        .stop_all(self.settings.kill_signal, After::Forget);
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
                                link.keep_watch(&seen, &self.backend, &self.settings.session_name);
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
                                    Err(Failure::Fatal(err)) => self.fail(&mut link, err),
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
                    let command = &self.settings.command;
                    if let Err(err) = self.shards.on_report(&index, report, command) {
                        self.fail(&mut link, err.into());
                    }
                }
                Event::Timer => {
                    if let Err(err) = self.on_timer(me, &link.holder) {
                        self.fail(&mut link, err);
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
            .filter(|(index, _, after)| !mine.contains(index) && *after != Some(After::Forget))
            .map(|(index, _, _)| *index)
            .collect();
        for index in lost {
            warn!(event = "leadership_lost", lock = %lock, shard = index, "the check found that this session no longer holds shard {index}; stopping its command");
            self.shards
                .stop(&index, self.settings.kill_signal, After::Forget);
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
            .iter()
            .filter(|(_, _, after)| *after == Some(After::Give))
            .count();
        let keeping = self.shards.len() - giving;
        if keeping > share {
            let surplus: Vec<u32> = self
                .shards
                .iter()
                .rev()
                .filter(|(_, _, after)| after.is_none())
                .map(|(index, _, _)| *index)
                .take(keeping - share)
                .collect();
            for index in surplus {
                info!(event = "hand_over", lock = %lock, shard = index, "handing shard {index} over to a replica short of its share");
                self.shards
                    .stop(&index, self.settings.kill_signal, After::Give);
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
                },
                Instant::now() + delay,
            );
        }
        self.on_timer(me, holder).map_err(Failure::Fatal)
    }

    /// Starts the commands whose start time has come, with the keeper holding the holder
    /// session's sockets (read now: none once it is closed), and moves stops along.
    fn on_timer(&mut self, me: i32, holder: &B::Holder) -> anyhow::Result<()> {
        let sockets = holder.sockets();
        // Without the session's socket a keeper could not order a crash: the session has
        // ended, which the loop hears next.
        // Nor while the probe says unhealthy (it may have turned so while shards were being
        // taken): the loop hears it next and gives them all up.
        let may_start = !sockets.is_empty() && self.health.is_healthy();
        let (settings, count) = (&self.settings, self.sharding.count);
        self.shards.on_timer(may_start, |index, shard| {
            let mut env = settings.leader_env(me, shard.epoch);
            env.push(("PGLEADER_SHARD", index.to_string()));
            env.push(("PGLEADER_SHARDS", count.to_string()));
            let job = Parked::spawn(&settings.command, &settings.hooks)
                .and_then(|parked| parked.start(&env, &holder.lend(*index)))
                .map_err(|err| anyhow::anyhow!("cannot start the keeper process: {err}"))?;
            debug!(
                event = "spawned",
                shard = *index,
                pgid = job.pgid().as_raw(),
                "started the keeper"
            );
            Ok(job)
        })
    }

    /// A command cannot run at all: every command is killed, and the session left with `err`
    /// once their trees are gone.
    fn fail(&mut self, link: &mut Link<B>, err: anyhow::Error) {
        self.shards.stop_all(Signal::SIGKILL, After::Forget);
        link.fatal = Some(err);
        link.leave_for("a fatal error".into());
    }

    /// Every shard is lost (or about to be): stop every command.
    fn lose_all(&mut self, reason: &str, loss: LossReason) {
        warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %reason, "lost every shard");
        notify::status(&format!("shards lost ({reason}); stopping their commands"));
        self.inbox.telemetry.leadership_lost(loss, reason);
        self.last_disturbance = Some(Instant::now());
        self.shards
            .stop_all(self.settings.kill_signal, After::Forget);
    }

    fn on_signal(&mut self, event: Option<SignalEvent>) {
        match event {
            Some(SignalEvent::Forward(signal)) => self.shards.forward(signal),
            Some(SignalEvent::ChildStateChanged) => self.shards.reap(),
            Some(SignalEvent::Shutdown(signal)) => match self.inbox.shutdown_signal(signal) {
                Shutdown::First => self.shut_down(signal),
                Shutdown::Repeated => {}
                Shutdown::Insist => self.shards.insist(signal),
            },
            // Nothing more can come: no second TERM, no SIGCHLD (keepers are then read until
            // their reports end, and their groups through the process table).
            None => {
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
        self.shards.retarget(signal);
        self.shards.stop_all(signal, After::Forget);
    }

    /// Settles the shards whose commands are wholly gone: each is given away, kept for a
    /// restart, or forgotten. A give is bounded by what is left of the deadline; an error
    /// means the session is in doubt.
    async fn finish_stopped(&mut self, link: &mut Link<B>) -> Result<(), SessionError> {
        let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
        let settled = self.shards.settle(quiet);
        for status in settled.iter().filter_map(|(_, status, _)| *status) {
            self.inbox.telemetry.shard_command_exited(status);
        }
        for (index, _, settled) in settled {
            if settled != Settled::Give {
                continue;
            }
            let left = link.left(self.settings.check_timeout);
            link.changed_at = Some(Instant::now());
            let give = tokio::time::timeout(left, link.holder.give(index));
            match alongside(&mut link.read, &mut link.read_done, give).await {
                Ok(Ok(())) => {
                    info!(event = "released", lock = %self.settings.lock, shard = index, "released shard {index}");
                    // A replica that was handing over took nothing meanwhile; the roster may
                    // have changed since (a member gone), and its own word does not come back
                    // to it.
                    link.read_soon(quiet, self.settings.check_timeout);
                }
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(no_answer("releasing a shard")),
            }
        }
        Ok(())
    }

    /// What the HTTP endpoint and metrics show: the shards held here and their commands;
    /// leading while this replica holds one.
    fn publish(&self, me: i32) {
        let held = self
            .shards
            .views()
            .map(|(index, shard, command)| ShardView {
                shard: *index,
                epoch: shard.epoch,
                since: shard.taken_at,
                command,
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
