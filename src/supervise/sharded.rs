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
//! single leader awaits `Inbox::stop`.
//!
//! The roster is read when another member says something changed (it joined, gave a shard
//! away, left, or its watcher found it gone) and every `--check-interval`; that read is also
//! the check that this replica still holds its shards, with the single leader's deadline
//! (`--check-interval + --check-timeout`). A shard the check no longer finds, a session that
//! ends, or a deadline passed: the commands concerned are stopped at once.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use anyhow::bail;
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
use crate::operate::telemetry::Telemetry;
use crate::supervise::inbox::{Inbox, KEEPER_GRACE, REPEAT_WINDOW, send_stop_signal, status_of};
use crate::supervise::job::{self, CommandError, Job, Parked};
use crate::supervise::keeper::Report;
use crate::supervise::signals::SignalEvent;
use crate::supervise::{Settings, Sharding};
use crate::time::for_people as fmt;

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

/// Runs a sharded replica until it is shut down or a fatal error occurs.
pub async fn run<B: ShardBackend>(
    backend: B,
    settings: Settings,
    sharding: Sharding,
    signals: UnboundedReceiver<SignalEvent>,
    telemetry: Telemetry,
) -> anyhow::Result<Outcome> {
    let mut room = Room {
        inbox: Inbox::new(signals, telemetry, settings.kill_timeout),
        backend,
        settings,
        sharding,
        backoff: Backoff::default(),
        shards: BTreeMap::new(),
        resting: BTreeMap::new(),
        last_disturbance: None,
        holder_sockets: Vec::new(),
        leading: false,
    };
    let mut pause = Duration::ZERO;
    loop {
        if !pause.is_zero() && !room.inbox.pause(pause).await {
            return Ok(Outcome::Shutdown);
        }
        let Some(holder) = room.join().await? else {
            return Ok(Outcome::Shutdown);
        };
        let joined = Instant::now();
        match room.serve(holder).await? {
            Served::Shutdown => return Ok(Outcome::Shutdown),
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
    /// Shards whose command exited on their own here, and until when this replica leaves them
    /// to the others (`--restart-delay`).
    resting: BTreeMap<u32, Instant>,
    /// When a holder session last ended other than by pgleader's own doing.
    last_disturbance: Option<Instant>,
    /// The holder session's sockets, which every shard's keeper holds.
    holder_sockets: Vec<std::os::fd::RawFd>,
    /// Whether the telemetry says this replica leads (runs a shard).
    leading: bool,
}

/// A shard this replica holds.
struct Shard {
    epoch: i64,
    /// When its command may start (the restart fence, `--takeover-delay`).
    start_at: Instant,
    /// `None` until the command starts.
    job: Option<Job>,
    /// Set once the command is being stopped.
    stopping: Option<Stopping>,
    /// How the command ended, once it did.
    status: Option<ChildStatus>,
}

/// A stop under way.
struct Stopping {
    /// Once the tree is gone: give the shard away, or not (the lock is gone already, or the
    /// whole session goes).
    give: bool,
    /// The signal the command was sent, sent again if it starts only now.
    signal: Signal,
    /// When the kill timeout runs out; `None` once SIGKILL was sent.
    escalate_at: Option<Instant>,
    /// When the keeper is given up on, after SIGKILL, and the group is SIGKILLed directly.
    keeper_kill_at: Option<Instant>,
}

enum Served {
    Shutdown,
    Lost,
}

enum Event {
    Holder(HolderEvent),
    Deadline,
    Read(Result<Seen, SessionError>),
    ReadDue,
    Watched(Result<(), SessionError>),
    Signal(Option<SignalEvent>),
    Report(u32, Report),
    Timer,
}

type ReadFuture = Pin<Box<dyn Future<Output = Result<Seen, SessionError>>>>;
type WatchFuture = Pin<Box<dyn Future<Output = Result<(), SessionError>>>>;

/// The watcher session and what it waits for.
struct Watching<W> {
    watcher: W,
    member: i32,
    watch: Option<WatchFuture>,
}

impl<B: ShardBackend> Room<B> {
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
    async fn serve(&mut self, mut holder: B::Holder) -> anyhow::Result<Served> {
        let me = holder.id();
        let joined = Instant::now();
        self.holder_sockets = holder.sockets();
        let lock = self.settings.lock.clone();
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        info!(event = "joined", lock = %lock, backend_pid = me, shards = self.sharding.count, "joined the replicas of this lock, {} shards", self.sharding.count);
        notify::status(&format!("running shards of lock {lock}"));
        self.inbox.telemetry.following(me);
        let mut deadline = Instant::now() + interval + timeout;
        let mut read: Option<(Instant, ReadFuture)> =
            Some((Instant::now(), Box::pin(holder.roster())));
        let mut next_read = Instant::now() + interval;
        let mut watching: Option<Watching<B::Watcher>> = None;
        // Something changed while a read was under way, which that read may not have seen:
        // read again as soon as it is done.
        let mut stale = false;
        // Why the session is being left: once set, every command is stopping.
        let mut leaving: Option<String> = None;
        let mut fatal: Option<anyhow::Error> = None;
        loop {
            if self.shards.is_empty() {
                if let Some(err) = fatal {
                    let _ = holder.leave(timeout).await;
                    return Err(err);
                }
                if self.inbox.shutdown_requested.is_some() {
                    match holder.leave(timeout).await {
                        Ok(()) => info!(event = "released", lock = %lock, "released every shard"),
                        Err(err) => {
                            warn!(event = "release_failed", lock = %lock, reason = %err, "cannot release the shards explicitly; closing the session frees them")
                        }
                    }
                    return Ok(Served::Shutdown);
                }
                if leaving.is_some() {
                    return Ok(Served::Lost);
                }
            }
            let timer = self.next_timer();
            let holds_any = !self.shards.is_empty();
            let quiet = leaving.is_some() || self.inbox.shutdown_requested.is_some();
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
            // Biased: the end of the session and the deadline win over everything.
            let event = tokio::select! {
                biased;
                event = holder.next_event(), if leaving.is_none() => Event::Holder(event),
                _ = sleep_until(deadline), if !quiet && holds_any => Event::Deadline,
                result = async { match &mut read { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Read(result),
                event = self.inbox.signals.recv() => Event::Signal(event),
                (index, report) = reports => Event::Report(index, report),
                _ = sleep_until(timer) => Event::Timer,
                result = async { match watching.as_mut().and_then(|w| w.watch.as_mut()) { Some(watch) => watch.await, None => std::future::pending().await } } => Event::Watched(result),
                _ = sleep_until(next_read), if read.is_none() && !quiet => Event::ReadDue,
            };
            match event {
                Event::Holder(HolderEvent::Notified(word)) => {
                    debug!(event = "notified", lock = %lock, word = %word, "another replica: {word}");
                    read_soon(&mut read, &mut stale, quiet, &holder);
                }
                Event::Holder(HolderEvent::Ended(reason)) => {
                    self.lose_all(
                        &format!("the connection ended: {reason}"),
                        LossReason::ConnectionEnded,
                    );
                    leaving = Some(reason);
                    read = None;
                    watching = None;
                }
                Event::Deadline => {
                    let reason = format!(
                        "no successful check for {} (--check-interval + --check-timeout)",
                        fmt(interval + timeout)
                    );
                    self.lose_all(&reason, LossReason::CheckTimeout);
                    leaving = Some(reason);
                    read = None;
                    watching = None;
                }
                Event::ReadDue => {
                    read = Some((Instant::now(), Box::pin(holder.roster())));
                }
                Event::Read(result) => {
                    let sent = read.take().map_or_else(Instant::now, |(sent, _)| sent);
                    self.inbox
                        .telemetry
                        .check_completed(sent.elapsed(), result.is_ok());
                    let seen = match result {
                        Ok(seen) => seen,
                        Err(err) => {
                            let reason = format!("the check failed: {err}");
                            self.lose_all(&reason, LossReason::CheckFailed);
                            if let SessionError::Unsafe(_) = err {
                                fatal = Some(err.into());
                            }
                            leaving = Some(reason);
                            watching = None;
                            continue;
                        }
                    };
                    deadline = sent + interval + timeout;
                    next_read = sent + interval;
                    if quiet {
                        continue;
                    }
                    self.keep_watch(&mut watching, &seen, me).await;
                    match self.apply(&holder, &seen, me, joined).await {
                        // Only after the shards it took: a read sent before would not show
                        // them, and they would look lost.
                        Ok(()) if std::mem::take(&mut stale) => {
                            read_soon(&mut read, &mut stale, quiet, &holder);
                        }
                        Ok(()) => {}
                        Err(Failure::Session(err)) => {
                            let reason = format!("a statement failed: {err}");
                            self.lose_all(&reason, LossReason::CheckFailed);
                            leaving = Some(reason);
                            watching = None;
                        }
                        Err(Failure::Fatal(err)) => {
                            self.stop_all(Signal::SIGKILL, false);
                            fatal = Some(err);
                            leaving = Some("a fatal error".into());
                        }
                    }
                }
                Event::Watched(result) => {
                    let Some(mut watch) = watching.take() else {
                        continue;
                    };
                    match result {
                        Ok(()) => {
                            info!(event = "member_gone", lock = %lock, backend_pid = watch.member, "the replica of server process {} is gone; its shards are free", watch.member);
                            // The watch ended as asked: the session is free for the next one.
                            watch.watch = None;
                            watching = Some(watch);
                        }
                        Err(err) => {
                            debug!(event = "watch_failed", reason = %err, "the watcher's session failed; opening another at the next check");
                        }
                    }
                    read_soon(&mut read, &mut stale, quiet, &holder);
                }
                Event::Signal(event) => self.on_signal(event),
                Event::Report(index, report) => {
                    if let Err(err) = self.on_report(index, report) {
                        self.stop_all(Signal::SIGKILL, false);
                        fatal = Some(err.into());
                        leaving = Some("a fatal error".into());
                    }
                }
                Event::Timer => {
                    if let Err(err) = self.on_timer(me) {
                        self.stop_all(Signal::SIGKILL, false);
                        fatal = Some(err);
                        leaving = Some("a fatal error".into());
                    }
                    // A resting shard may be taken again.
                    if self.resting.values().any(|until| *until <= Instant::now()) {
                        self.resting.retain(|_, until| *until > Instant::now());
                        read_soon(&mut read, &mut stale, quiet, &holder);
                    }
                }
            }
            self.finish_stopped(&holder, leaving.is_none()).await;
            self.publish(me);
        }
    }

    /// Acts on a roster: stops the commands of shards this session no longer holds, gives a
    /// surplus away, takes free shards up to its share.
    async fn apply(
        &mut self,
        holder: &B::Holder,
        seen: &Seen,
        me: i32,
        joined: Instant,
    ) -> Result<(), Failure> {
        let lock = self.settings.lock.clone();
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
                !mine.contains(index) && shard.stopping.as_ref().is_none_or(|stop| stop.give)
            })
            .map(|(index, _)| *index)
            .collect();
        for index in lost {
            warn!(event = "leadership_lost", lock = %lock, shard = index, "the check found that this session no longer holds shard {index}; stopping its command");
            self.stop(index, self.settings.kill_signal, false);
        }
        // Held on the server with no command here: a give that failed, or one made while this
        // roster was read. Let it go; a shard given already is no error.
        for index in mine.iter().filter(|index| !self.shards.contains_key(index)) {
            if let Err(err) = holder.give(*index).await {
                debug!(event = "release_failed", shard = *index, reason = %err, "shard {index} was not held any more");
            }
        }
        let share = seen.roster.shares()[at] as usize;
        let giving = self
            .shards
            .values()
            .filter(|shard| shard.stopping.as_ref().is_some_and(|stop| stop.give))
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
                self.stop(index, self.settings.kill_signal, true);
            }
            return Ok(());
        }
        if giving > 0 {
            return Ok(());
        }
        let now = Instant::now();
        let wanted: Vec<u32> = seen
            .roster
            .moves(me)
            .take
            .into_iter()
            .filter(|index| self.resting.get(index).is_none_or(|until| *until <= now))
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let (won, fence) = tokio::time::timeout(self.settings.check_timeout, holder.take(&wanted))
            .await
            .map_err(|_| Failure::Session(SessionError::Query("taking shards timed out".into())))?
            .map_err(Failure::Session)?;
        let Some(fence) = fence else {
            return Ok(());
        };
        let delay = self.settings.start_delay(
            self.last_disturbance,
            fence.since_server_reset,
            joined.elapsed(),
        );
        for index in won {
            info!(event = "leader", lock = %lock, shard = index, epoch = fence.epoch, backend_pid = me, "took shard {index}");
            self.resting.remove(&index);
            self.shards.insert(
                index,
                Shard {
                    epoch: fence.epoch,
                    start_at: Instant::now() + delay,
                    job: None,
                    stopping: None,
                    status: None,
                },
            );
        }
        self.on_timer(me).map_err(Failure::Fatal)
    }

    /// Watches the member after this one, on the watcher session (opened, or opened again, as
    /// needed); nobody when alone.
    async fn keep_watch(
        &mut self,
        watching: &mut Option<Watching<B::Watcher>>,
        seen: &Seen,
        me: i32,
    ) {
        let Some(member) = seen.roster.successor(me) else {
            *watching = None;
            return;
        };
        if let Some(current) = watching
            && current.member == member
            && current.watch.is_some()
        {
            return;
        }
        // A watch that was abandoned may have been granted: its session goes with it.
        let reusable = watching.take().filter(|current| current.watch.is_none());
        let watcher = match reusable {
            Some(current) => current.watcher,
            None => match self.backend.watcher(&self.settings.session_name).await {
                Ok(watcher) => watcher,
                Err(err) => {
                    warn!(event = "watch_failed", reason = %err, "cannot open the watcher's session; trying again at the next check");
                    return;
                }
            },
        };
        debug!(
            event = "watching",
            backend_pid = member,
            "watching the replica of server process {member}"
        );
        let watch = Box::pin(watcher.watch(member));
        *watching = Some(Watching {
            watcher,
            member,
            watch: Some(watch),
        });
    }

    /// Starts the commands whose start time has come, and moves stops along.
    fn on_timer(&mut self, me: i32) -> anyhow::Result<()> {
        let now = Instant::now();
        let starting: Vec<u32> = self
            .shards
            .iter()
            .filter(|(_, shard)| {
                shard.job.is_none() && shard.stopping.is_none() && shard.start_at <= now
            })
            .map(|(index, _)| *index)
            .collect();
        for index in starting {
            let epoch = self.shards[&index].epoch;
            let mut env = self.settings.leader_env(me, epoch);
            env.push(("PGLEADER_SHARD", index.to_string()));
            env.push(("PGLEADER_SHARDS", self.sharding.count.to_string()));
            let job = Parked::spawn(&self.settings.command)
                .and_then(|parked| parked.start(&env, &self.holder_sockets))
                .map_err(|err| anyhow::anyhow!("cannot start the keeper process: {err}"))?;
            debug!(
                event = "spawned",
                shard = index,
                pgid = job.pgid().as_raw(),
                "started the keeper"
            );
            if let Some(shard) = self.shards.get_mut(&index) {
                shard.job = Some(job);
            }
        }
        for (index, shard) in &mut self.shards {
            let (Some(job), Some(stop)) = (&shard.job, &mut shard.stopping) else {
                continue;
            };
            if stop.escalate_at.is_some_and(|at| at <= now) {
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
                let _ = job.signal(Signal::SIGKILL);
                stop.keeper_kill_at = None;
            }
        }
        Ok(())
    }

    /// The next moment a timer is due: a delayed start, a stop's next step, a rest's end.
    fn next_timer(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let shards = self.shards.values().flat_map(|shard| {
            let start = (shard.job.is_none() && shard.stopping.is_none()).then_some(shard.start_at);
            let stop = shard
                .stopping
                .as_ref()
                .and_then(|stop| stop.escalate_at.or(stop.keeper_kill_at));
            start.into_iter().chain(stop)
        });
        shards
            .chain(self.resting.values().copied())
            .min()
            .unwrap_or(far)
            .min(far)
    }

    /// Starts stopping a shard's command: `signal` to its group, then the kill timeout.
    /// `give`: once the tree is gone, release the shard for the others.
    fn stop(&mut self, index: u32, signal: Signal, give: bool) {
        let Some(shard) = self.shards.get_mut(&index) else {
            return;
        };
        if let Some(stop) = &mut shard.stopping {
            // A lost lock or a shutdown overrides a handover: nothing is left to give.
            stop.give &= give;
            return;
        }
        if let Some(job) = &shard.job {
            send_stop_signal(job, signal);
            info!(
                event = "stopping",
                shard = index,
                pgid = job.pgid().as_raw(),
                signal = signal.as_str(),
                "stopping the command of shard {index}: {} to its process group",
                signal.as_str()
            );
        }
        let mut stop = Stopping {
            give,
            signal,
            escalate_at: Some(Instant::now() + self.settings.kill_timeout),
            keeper_kill_at: None,
        };
        if signal == Signal::SIGKILL
            && let Some(job) = &shard.job
        {
            escalate(job, &mut stop);
        }
        shard.stopping = Some(stop);
    }

    fn stop_all(&mut self, signal: Signal, give: bool) {
        let indices: Vec<u32> = self.shards.keys().copied().collect();
        for index in indices {
            self.stop(index, signal, give);
        }
    }

    /// Every shard is lost (or about to be): stop every command.
    fn lose_all(&mut self, reason: &str, loss: LossReason) {
        warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %reason, "lost every shard");
        notify::status(&format!("shards lost ({reason}); stopping their commands"));
        self.inbox.telemetry.leadership_lost(loss, reason);
        self.last_disturbance = Some(Instant::now());
        self.stop_all(self.settings.kill_signal, false);
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
                        if let (Some(job), Some(stop)) = (&shard.job, &mut shard.stopping)
                            && stop.escalate_at.is_some()
                        {
                            escalate(job, stop);
                        }
                    }
                }
                None => self.shut_down(signal),
            },
            None => self.shut_down(Signal::SIGTERM),
        }
    }

    fn shut_down(&mut self, signal: Signal) {
        self.inbox.begin_shutdown(
            signal,
            "shutting down: stopping every shard's command, then releasing the shards",
        );
        self.stop_all(signal, false);
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
                shard.status.get_or_insert(status);
                if shard.stopping.is_none() {
                    // On its own: what it left in its group goes too, then the shard is given
                    // away, and this replica leaves it to the others for --restart-delay.
                    self.resting
                        .insert(index, Instant::now() + self.settings.restart_delay);
                    self.stop(index, self.settings.kill_signal, true);
                }
                Ok(())
            }
            Report::Done(_) => Ok(()),
        }
    }

    /// Settles the shards whose commands are wholly gone: each is given away (or forgotten,
    /// when the lock is gone or the session is being left).
    async fn finish_stopped(&mut self, holder: &B::Holder, may_give: bool) {
        let done: Vec<u32> = self
            .shards
            .iter()
            .filter(|(_, shard)| match &shard.job {
                None => shard.stopping.is_some(),
                Some(job) => job.is_finished(),
            })
            .map(|(index, _)| *index)
            .collect();
        for index in done {
            let Some(mut shard) = self.shards.remove(&index) else {
                continue;
            };
            if let Some(job) = &mut shard.job {
                // A report read only now was not logged yet.
                let logged = shard.status.is_some();
                for report in job.remaining_reports() {
                    if matches!(report, Report::Exited(_) | Report::Killed(_)) {
                        shard.status.get_or_insert(status_of(report));
                    }
                }
                if !job.reported_done() {
                    self.inbox.wait_until_group_gone(job).await;
                }
                // A report the keeper sent just before it was reaped may not be readable yet:
                // its own exit status stands for the command's then.
                let status = shard
                    .status
                    .or_else(|| job.keeper_status())
                    .unwrap_or(ChildStatus::Signaled(Signal::SIGKILL));
                if !logged {
                    info!(event = "child_exited", shard = index, status = %status, exit_code = status.exit_code(), "the command of shard {index} exited");
                }
                self.inbox.telemetry.command_exited(status);
                if shard.stopping.is_none() {
                    // Its keeper vanished (killed from outside): the command is gone.
                    self.resting
                        .insert(index, Instant::now() + self.settings.restart_delay);
                }
            }
            let give = shard.stopping.as_ref().is_none_or(|stop| stop.give);
            if give && may_give && self.inbox.shutdown_requested.is_none() {
                match holder.give(index).await {
                    Ok(()) => {
                        info!(event = "released", lock = %self.settings.lock, shard = index, "released shard {index}")
                    }
                    Err(err) => {
                        warn!(event = "release_failed", shard = index, reason = %err, "cannot release shard {index}; the next check lets it go")
                    }
                }
            }
        }
    }

    /// What the HTTP endpoint and metrics show: leading while this replica runs a shard.
    fn publish(&mut self, me: i32) {
        let running = self
            .shards
            .values()
            .filter(|shard| shard.stopping.is_none())
            .count();
        if running > 0 && !self.leading {
            let epoch = self
                .shards
                .values()
                .map(|shard| shard.epoch)
                .max()
                .unwrap_or(0);
            self.inbox.telemetry.leading(epoch, me);
            self.leading = true;
        } else if running == 0 && self.leading {
            if self.inbox.shutdown_requested.is_none() {
                self.inbox.telemetry.following(me);
            }
            self.leading = false;
        }
    }
}

/// Reads the roster now, or as soon as the read under way is done (`stale`).
fn read_soon<H: Holder>(
    read: &mut Option<(Instant, ReadFuture)>,
    stale: &mut bool,
    quiet: bool,
    holder: &H,
) {
    if read.is_some() {
        *stale = true;
    } else if !quiet {
        *read = Some((Instant::now(), Box::pin(holder.roster())));
    }
}

/// Why a roster could not be acted on.
enum Failure {
    /// A statement failed: the session is done for.
    Session(SessionError),
    /// A command cannot be started at all.
    Fatal(anyhow::Error),
}

/// SIGKILL to everything the command started, through the keeper (or to the group directly if
/// the keeper cannot be asked), and a grace for the keeper to finish.
fn escalate(job: &Job, stop: &mut Stopping) {
    stop.signal = Signal::SIGKILL;
    stop.escalate_at = None;
    if job.kill_everything().is_err() {
        let _ = job.signal(Signal::SIGKILL);
    }
    stop.keeper_kill_at = Some(Instant::now() + KEEPER_GRACE);
}
