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

mod jobs;
mod link;
mod parking;

use std::time::Duration;

use anyhow::bail;
use jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, error, info, warn};

use crate::election::backoff::Backoff;
use crate::election::ledger::LedgerError;
use crate::election::shards::{Holder, HolderEvent, Items, JoinError, Seen, ShardBackend, Watcher};
use crate::election::{ConnectError, SessionError, elsewhere_hint};
use crate::exit::Outcome;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::{CommandState, ShardView, Telemetry};
use crate::schedule::clock::ServerClock;
use crate::schedule::crontab::Crontab;
use crate::schedule::runs::RunsEvent;
use crate::supervise::commands::{After, Commands, Restart, Settled};
use crate::supervise::health::Health;
use crate::supervise::inbox::{Inbox, Shutdown};
use crate::supervise::keeper::handle::Parked;
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::signals::SignalEvent;
use crate::supervise::watchdog::Deadline;
use crate::supervise::{Settings, Sharding};
use crate::time::for_people as fmt;
use jobs::Jobs;
use link::{Link, Watching, alongside, no_answer};
use parking::Parking;

/// What a replica of a sharded lock shares out with the others.
#[derive(Debug)]
pub enum Fleet {
    /// `pgleader run --shards K`: the command once per shard.
    Shards(Sharding),
    /// `pgleader cron`: the crontab's jobs, each occurrence once.
    Crontab(Crontab),
}

/// The ledger a backend's holder session keeps a crontab's runs in.
type LedgerOf<B> = <<B as ShardBackend>::Holder as Holder>::Ledger;

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
    fleet: Fleet,
    signals: UnboundedReceiver<SignalEvent>,
    telemetry: Telemetry,
) -> anyhow::Result<Outcome> {
    let health = match settings.health.clone() {
        Some(check) => Health::start(check, telemetry.clone())?,
        None => Health::none(),
    };
    let (items, cap, jobs, restart) = match fleet {
        Fleet::Shards(sharding) => (
            Items::Numbered(sharding.count),
            sharding.cap,
            None,
            Restart::After(settings.restart_delay),
        ),
        Fleet::Crontab(crontab) => {
            let jobs = Jobs::new(&settings.lock, &crontab, telemetry.clone())?;
            telemetry.jobs_defined(jobs.known());
            (jobs.items(), None, Some(jobs), Restart::WhenAsked)
        }
    };
    let mut inbox = Inbox::new(signals, telemetry, settings.stop_rules());
    inbox.hup_rereads = jobs.is_some();
    let mut room = Room {
        health,
        inbox,
        shards: Commands::new(settings.stop_rules(), settings.kill_signal, restart),
        backend,
        settings,
        items,
        cap,
        jobs,
        backoff: Backoff::default(),
        last_disturbance: None,
        leftover_watchers: Vec::new(),
        parking: Parking::default(),
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
        let served = room.serve(holder).await;
        // The jobs the session owned are no longer this replica's: nor their keepers.
        room.parking.dismiss().await;
        match served? {
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
    /// What this replica shares out: shards, or its crontab's jobs.
    items: Items,
    /// `--max-shards`.
    cap: Option<u32>,
    /// A crontab's jobs, and the runs of those this replica owns.
    jobs: Option<Jobs<LedgerOf<B>>>,
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
    /// Keepers started ahead of the owned jobs' next occurrences.
    parking: Parking,
}

/// Where a crontab job's runs that go on beside the next one (`overlap=allow`) are kept in the
/// table: its item with a slot number in the two high bits (a job's item is below 2^30), so
/// that the job's own key stays free for its newest run.
const ASIDE_SHIFT: u32 = 30;

/// The job or shard a key of the table is about (see [`ASIDE_SHIFT`]).
fn item_of(key: u32) -> u32 {
    key & ((1 << ASIDE_SHIFT) - 1)
}

/// Whether a key of the table is a run kept aside (see [`ASIDE_SHIFT`]).
fn is_aside(key: u32) -> bool {
    key >> ASIDE_SHIFT != 0
}

/// What the room knows of a shard it holds, beside its command.
#[derive(Clone, Debug)]
struct Shard {
    epoch: i64,
    /// When it was taken: what `/status` shows.
    taken_at: Timestamp,
    /// A crontab job's occurrence its command runs (or is about to run) for, and the attempt.
    run: Option<(Timestamp, i32)>,
    /// When a crontab job's run has taken its `timeout=` and is stopped.
    timeout_at: Option<Instant>,
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
    /// An owned crontab job's runs ask for something.
    Runs(u32, RunsEvent),
    /// Keepers started ahead of their jobs' occurrences are ready.
    Parked(parking::Batch),
    /// A crontab job's run has taken its `timeout=`.
    RunTimeout,
}

impl<B: ShardBackend + Clone + 'static> Room<B> {
    /// Connects and joins the fleet, retrying transient failures with backoff. `None` means
    /// shut down.
    async fn join(&mut self) -> anyhow::Result<Option<B::Holder>> {
        let server = self.backend.to_string();
        self.inbox.telemetry.connecting();
        loop {
            let attempt = self
                .backend
                .join(&self.settings.session_name, &self.items, self.cap);
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
        // The deadline, shared with every command's keeper: each stops its tree by itself
        // should it pass unrenewed (pgleader stopped, hung or starved).
        let keepers = match Deadline::new(self.settings.deadline_terms(), now + interval + timeout)
        {
            Ok(keepers) => keepers,
            Err(err) => {
                // Without it a frozen pgleader's commands could outlive the lease: not joining.
                warn!(event = "join_failed", lock = %self.settings.lock, reason = %err, "cannot share the deadline with the commands' keepers (memfd); leaving, to join again");
                let _ = holder.leave(timeout).await;
                return Ok(Served::Lost);
            }
        };
        let mut link: Link<B> = Link {
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
            abandoned: std::mem::take(&mut self.leftover_watchers),
            changed_at: None,
        };
        let me = link.me;
        match &self.jobs {
            Some(_) => {
                info!(event = "joined", lock = %lock, backend_pid = me, jobs = self.items.len(), "joined the replicas of this crontab, {} jobs", self.items.len())
            }
            None => {
                info!(event = "joined", lock = %lock, backend_pid = me, shards = self.items.len(), "joined the replicas of this lock, {} shards", self.items.len())
            }
        }
        if let Some(jobs) = &mut self.jobs {
            let prepared = tokio::time::timeout(timeout, link.holder.prepare_ledger()).await;
            match prepared {
                Ok(Ok(location)) => {
                    jobs.set_own_ledger(crate::schedule::ledger_fingerprint(&location));
                }
                Ok(Err(LedgerError::Fatal(reason))) => {
                    let _ = link.holder.leave(timeout).await;
                    bail!("{reason}");
                }
                Ok(Err(err)) => {
                    warn!(event = "ledger_failed", lock = %lock, reason = %err, "cannot prepare the ledger; joining again");
                    let _ = link.holder.leave(timeout).await;
                    return Ok(Served::Lost);
                }
                Err(_) => {
                    warn!(event = "ledger_failed", lock = %lock, "no answer while preparing the ledger; joining again");
                    let _ = link.holder.leave(timeout).await;
                    return Ok(Served::Lost);
                }
            }
        }
        if self.jobs.is_some() {
            self.parking.keep_membership(&link.holder.lend_membership());
        }
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
            let run_timeout = self
                .shards
                .iter()
                .filter(|(_, _, after)| after.is_none())
                .filter_map(|(_, shard, _)| shard.timeout_at)
                .min();
            let holds_any = !self.shards.is_empty();
            let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
            let park_at = self.plan_parking(quiet);
            let timer = match (self.shards.next_timer(), park_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let leaving = link.leaving.is_some();
            let health = &mut self.health;
            let shards = &mut self.shards;
            let jobs = &mut self.jobs;
            let parking = &mut self.parking;
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
                _ = async { match run_timeout { Some(at) => sleep_until(at).await, None => std::future::pending().await } } => Event::RunTimeout,
                result = async { match watching.as_mut().and_then(|w| w.watch.as_mut()) { Some(watch) => watch.await, None => std::future::pending().await } } => Event::Watched(result),
                (member, result) = async { match opening { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Opened(member, result),
                (item, event) = std::future::poll_fn(|cx| match jobs.as_mut() { Some(jobs) => jobs.poll_next(cx), None => std::task::Poll::Pending }), if !quiet => Event::Runs(item, event),
                batch = std::future::poll_fn(|cx| parking.poll_spawned(cx)) => Event::Parked(batch),
                _ = sleep_until(*next_read), if read.is_none() && !quiet => Event::ReadDue,
                }
            };
            match event {
                Event::Holder(HolderEvent::Notified(word)) => {
                    debug!(event = "notified", lock = %lock, word = %word, "another replica: {word}");
                    link.read_soon(quiet, timeout);
                }
                Event::Holder(HolderEvent::Ended(reason)) => {
                    let why = link.why(format!("the connection ended: {reason}"));
                    self.lose_all(&why, LossReason::ConnectionEnded);
                    link.leave_for(reason);
                }
                Event::Deadline => {
                    let reason = link.why(format!(
                        "no successful check for {} (--check-interval + --check-timeout)",
                        fmt(interval + timeout)
                    ));
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
                            let reason = link.why(format!("the check failed: {err}"));
                            self.lose_all(&reason, LossReason::CheckFailed);
                            if let SessionError::Unsafe(_) = err {
                                link.fatal = Some(err.into());
                            }
                            link.leave_for(reason);
                        }
                        Ok(_) if quiet => {}
                        Ok(seen) => {
                            link.deadline = sent + interval + timeout;
                            // Fails only if a keeper found the deadline past first: its command
                            // is stopping already.
                            if link.keepers.renew(link.deadline).is_err() {
                                let reason = link.keepers.lost_reason();
                                self.lose_all(&reason, LossReason::CheckTimeout);
                                link.leave_for(reason);
                                continue;
                            }
                            debug!(event = "confirmed", lock = %lock, "the session still holds its membership");
                            if let Some(jobs) = &mut self.jobs {
                                jobs.observe_clock(sent, Instant::now(), seen.server_time);
                                jobs.note_disagreements(&seen.roster, me, &lock);
                            }
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
                    // A keeper stops its command by itself: pgleader did not run past the
                    // deadline, and every shard held counts as lost.
                    if matches!(report, Report::Expired(_)) && link.leaving.is_none() {
                        let reason = link.keepers.lost_reason();
                        self.lose_all(&reason, LossReason::CheckTimeout);
                        link.leave_for(reason);
                    }
                    let command = match self
                        .jobs
                        .as_ref()
                        .and_then(|jobs| jobs.definition(item_of(index)))
                    {
                        Some(definition) => &definition.command,
                        None => &self.settings.command,
                    };
                    if let Err(err) = self.shards.on_report(&index, report, command) {
                        self.fail(&mut link, err.into());
                    }
                }
                Event::Runs(item, event) => self.on_runs(&mut link, item, event),
                Event::Timer => {
                    if let Err(err) = self.on_timer(me, &link.holder, &link.keepers) {
                        self.fail(&mut link, err);
                    }
                }
                Event::RunTimeout => self.stop_timed_out(),
                Event::Parked(batch) => self.parking.park(batch),
            }
            if let Err(err) = self.finish_stopped(&mut link).await {
                let reason = format!("a statement failed: {err}");
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
            }
            if std::mem::take(&mut self.inbox.reread_requested) && !quiet {
                self.reread(&mut link).await;
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
        // A job a reread removed is not shared out any more, so the roster does not show it:
        // its last run finishes, then it is given up.
        let lost: Vec<u32> = self
            .shards
            .iter()
            .filter(|(index, _, after)| {
                !mine.contains(&item_of(**index)) && *after != Some(After::Forget)
            })
            .map(|(index, _, _)| *index)
            .filter(|index| self.items.contains(item_of(*index)))
            .collect();
        for index in lost {
            let label = self.shards.label(&index).cloned().unwrap_or_default();
            warn!(event = "leadership_lost", lock = %lock, shard = label.shard, job = label.job.as_deref(), "the check found that this session no longer holds {}; stopping its command", label.name());
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
            .filter(|(index, _, after)| *after == Some(After::Give) && !is_aside(**index))
            .count();
        let keeping = self
            .shards
            .iter()
            .filter(|(index, _, after)| {
                *after != Some(After::Give) && !is_aside(**index) && self.items.contains(**index)
            })
            .count();
        if keeping > share {
            let surplus: Vec<u32> = self
                .shards
                .iter()
                .rev()
                .filter(|(_, _, after)| after.is_none())
                .map(|(index, _, _)| *index)
                // Never a job only this replica knows: nobody else would take it; nor one with
                // runs going aside, which hold its lock until they end.
                .filter(|index| !is_aside(*index) && !self.has_aside(*index))
                .filter(|index| seen.roster.known_elsewhere(*index, me))
                .take(keeping - share)
                .collect();
            for index in surplus {
                let label = self.shards.label(&index).cloned().unwrap_or_default();
                info!(event = "hand_over", lock = %lock, shard = label.shard, job = label.job.as_deref(), "handing {} over to a replica short of its share", label.name());
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
        let sent = Instant::now();
        let (won, fence) = tokio::time::timeout(link.left(timeout), holder.take(&wanted))
            .await
            .map_err(|_| Failure::Session(no_answer("taking shards")))?
            .map_err(Failure::Session)?;
        let received = Instant::now();
        let Some(fence) = fence else {
            return Ok(());
        };
        let delay = self.settings.start_delay(
            self.last_disturbance,
            fence.since_server_reset,
            link.joined.elapsed(),
        );
        for index in won {
            if self.shards.contains_key(&index) {
                continue;
            }
            let shard = Shard {
                epoch: fence.epoch,
                taken_at: Timestamp::now(),
                run: None,
                timeout_at: None,
            };
            self.inbox.telemetry.shard_taken(index, fence.epoch);
            match &mut self.jobs {
                None => {
                    info!(event = "leader", lock = %lock, shard = index, epoch = fence.epoch, backend_pid = me, "took shard {index}");
                    let start_at = Some(Instant::now() + delay);
                    self.shards
                        .insert(index, Label::shard(index), shard, start_at);
                }
                Some(jobs) => {
                    let label = jobs.label(index);
                    info!(event = "leader", lock = %lock, job = label.job.as_deref(), epoch = fence.epoch, backend_pid = me, "took {}", label.name());
                    let clock = ServerClock::sample(sent, received, fence.server_time);
                    jobs.own(index, holder, fence.epoch, clock, Instant::now() + delay);
                    self.shards.insert(index, label, shard, None);
                }
            }
        }
        self.on_timer(me, holder, &link.keepers)
            .map_err(Failure::Fatal)
    }

    /// Starts the commands whose start time has come, with the keeper holding the holder
    /// session's sockets (read now: none once it is closed), and moves stops along.
    fn on_timer(&mut self, me: i32, holder: &B::Holder, keepers: &Deadline) -> anyhow::Result<()> {
        let sockets = holder.sockets();
        // Without the session's socket a keeper could not order a crash: the session has
        // ended, which the loop hears next.
        // Nor while the probe says unhealthy (it may have turned so while shards were being
        // taken): the loop hears it next and gives them all up.
        let may_start = !sockets.is_empty() && self.health.is_healthy();
        let (settings, count, jobs) = (&self.settings, self.items.len(), &self.jobs);
        let parking = &mut self.parking;
        self.shards.on_timer(may_start, |index, shard| {
            let mut env = settings.leader_env(me, shard.epoch);
            let command = match (jobs, shard.run) {
                (Some(jobs), Some((occurrence, attempt))) => {
                    let definition = jobs
                        .definition(*index)
                        .ok_or_else(|| anyhow::anyhow!("job {index} is not in the crontab"))?;
                    env.extend(jobs.env(*index, occurrence, attempt));
                    &definition.command
                }
                _ => {
                    env.push(("PGLEADER_SHARD", index.to_string()));
                    env.push(("PGLEADER_SHARDS", count.to_string()));
                    &settings.command
                }
            };
            let mut hold = holder.lend(item_of(*index));
            hold.extend(parking.membership_lent());
            let label = match jobs {
                Some(jobs) => jobs.label(*index),
                None => Label::shard(*index),
            };
            let watch = Some((keepers, &label));
            let fresh = || Parked::spawn(command, &settings.hooks)?.start(&env, &hold, watch);
            let started = match parking.take(*index, command) {
                // A keeper killed since it was checked fails here; a fresh one is the fallback.
                Some(parked) => parked.start(&env, &hold, watch).or_else(|_| fresh()),
                None => fresh(),
            };
            let job =
                started.map_err(|err| anyhow::anyhow!("cannot start the keeper process: {err}"))?;
            debug!(
                event = "spawned",
                shard = *index,
                pgid = job.pgid().as_raw(),
                "started the keeper"
            );
            Ok(job)
        })
    }

    /// Parks keepers for the owned jobs falling due within `parking::AHEAD` (not for a job
    /// whose command runs, nor while the probe says unhealthy), lets go of those of jobs no
    /// longer owned (of every job once the replica is `quiet`: leaving, or shutting down),
    /// and says when the next job will want one.
    fn plan_parking(&mut self, quiet: bool) -> Option<Instant> {
        let jobs = self.jobs.as_ref()?;
        let healthy = self.health.is_healthy();
        let due = jobs
            .due()
            .filter(|_| !quiet)
            .map(|(item, due)| {
                let idle = healthy && !self.shards.is_started(&item);
                (item, due.filter(|_| idle))
            })
            .collect();
        self.parking.plan(due, &self.settings.hooks)
    }

    /// SIGHUP under `pgleader cron`: rereads the crontab. Added jobs are shared out, removed
    /// ones no longer scheduled (a run in progress finishes first), changed ones follow their
    /// new definition from their next occurrence (after a run in progress), unchanged ones are
    /// not touched. A file that cannot be used is logged and the one read before keeps running.
    async fn reread(&mut self, link: &mut Link<B>) {
        let lock = self.settings.lock.clone();
        let Some(jobs) = &mut self.jobs else {
            return;
        };
        let path = jobs.path().to_owned();
        info!(event = "rereading", lock = %lock, "SIGHUP: rereading the crontab {}", path.display());
        let crontab = match Crontab::read(&path) {
            Ok(crontab) => crontab,
            Err(err) => {
                error!(event = "crontab_refused", lock = %lock, "{err}; the crontab read before keeps running");
                return;
            }
        };
        let reread = match jobs.reread(&lock, crontab) {
            Ok(reread) => reread,
            Err(err) => {
                error!(event = "crontab_refused", lock = %lock, "{err}; the crontab read before keeps running");
                return;
            }
        };
        let changes = &reread.changes;
        for (what, names) in [
            ("added", &changes.added),
            ("removed", &changes.removed),
            ("changed", &changes.changed),
        ] {
            for name in names {
                info!(event = "job_reread", lock = %lock, job = %name, change = what, "job {name} {what}");
            }
        }
        info!(event = "crontab_reread", lock = %lock, added = changes.added.len(), removed = changes.removed.len(), changed = changes.changed.len(), unchanged = changes.unchanged.len(), "reread the crontab: {} added, {} removed, {} changed, {} unchanged", changes.added.len(), changes.removed.len(), changes.changed.len(), changes.unchanged.len());
        let timeout = self.settings.check_timeout;
        for item in reread.removed {
            if !self.shards.is_started(&item) {
                jobs.disown(item, None, timeout).await;
                self.shards
                    .stop(&item, self.settings.kill_signal, After::Give);
            }
        }
        for item in reread.changed {
            if self.shards.is_started(&item) {
                jobs.redefine_later(item);
                continue;
            }
            let epoch = self.shards.item_mut(&item).map_or(0, |shard| shard.epoch);
            jobs.disown(item, None, timeout).await;
            if let Some(clock) = jobs.clock() {
                jobs.own(item, &link.holder, epoch, clock, Instant::now());
            }
        }
        self.items = jobs.items();
        self.inbox.telemetry.jobs_defined(jobs.known());
        // The jobs it removed whose last runs go on stay this replica's until they end.
        let finishing = self
            .shards
            .iter()
            .map(|(key, _, _)| item_of(*key))
            .filter(|item| !self.items.contains(*item))
            .collect();
        let told = tokio::time::timeout(
            link.left(timeout),
            link.holder.set_items(self.items.clone(), finishing),
        )
        .await;
        let failed = match told {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(format!("a statement failed: {err}")),
            Err(_) => Some(format!(
                "a statement failed: {}",
                no_answer("rereading the crontab")
            )),
        };
        if let Some(reason) = failed {
            self.lose_all(&reason, LossReason::CheckFailed);
            link.leave_for(reason);
            return;
        }
        link.read_soon(false, timeout);
    }

    /// An owned crontab job's runs ask for something: start its command for a claimed
    /// occurrence, or give up on the session.
    fn on_runs(&mut self, link: &mut Link<B>, item: u32, event: RunsEvent) {
        let lock = self.settings.lock.clone();
        match event {
            RunsEvent::Start {
                occurrence,
                attempt,
            } => {
                // overlap=allow: the run still going goes on aside, and this one starts.
                if self.shards.is_started(&item)
                    && let Some(aside) = (1..4)
                        .map(|slot| item | (slot << ASIDE_SHIFT))
                        .find(|key| !self.shards.contains_key(key))
                    && let Some(shard) = self.shards.item_mut(&item).cloned()
                {
                    let label = self
                        .jobs
                        .as_ref()
                        .map(|jobs| jobs.label(item))
                        .unwrap_or_default();
                    self.shards.rekey(&item, aside);
                    let fresh = Shard {
                        run: None,
                        timeout_at: None,
                        ..shard
                    };
                    self.shards.insert(item, label, fresh, None);
                }
                let Some(shard) = self.shards.item_mut(&item) else {
                    return;
                };
                shard.run = Some((occurrence, attempt));
                // Not while it is being stopped (given away, lost): the claim is taken back
                // when its runs are settled.
                if !self.shards.start_now(&item) {
                    return;
                }
                if let Err(err) = self.on_timer(link.me, &link.holder, &link.keepers) {
                    self.fail(link, err);
                    return;
                }
                if let Some(jobs) = &mut self.jobs
                    && self.shards.is_started(&item)
                {
                    jobs.started(item);
                    let timeout = jobs.definition(item).and_then(|d| d.job.timeout);
                    if let Some(shard) = self.shards.item_mut(&item) {
                        shard.timeout_at = timeout.map(|timeout| Instant::now() + timeout);
                    }
                }
            }
            RunsEvent::Disagree(reason) => {
                let label = self
                    .jobs
                    .as_ref()
                    .map(|jobs| jobs.label(item))
                    .unwrap_or_default();
                warn!(event = "schedule_mismatch", lock = %lock, job = label.job.as_deref(), "{}: {reason}", label.name());
            }
            RunsEvent::Failed(LedgerError::Fatal(reason)) => {
                self.fail(link, anyhow::anyhow!("{reason}"));
            }
            RunsEvent::Failed(err) => {
                let reason = format!("a ledger statement failed: {err}");
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
            }
            RunsEvent::Replace { occurrence } => {
                let label = self
                    .jobs
                    .as_ref()
                    .map(|jobs| jobs.label(item))
                    .unwrap_or_default();
                info!(event = "replacing_run", lock = %lock, job = label.job.as_deref(), "the occurrence of {} of {} has come while its previous run still goes: stopping that run (overlap=replace)", crate::schedule::calendar::rfc3339(occurrence), label.name());
                self.shards
                    .stop(&item, self.settings.kill_signal, After::Restart);
            }
            RunsEvent::Done | RunsEvent::NothingToRun => {}
        }
    }

    /// Whether runs of the job `item` go on aside (`overlap=allow`).
    fn has_aside(&self, item: u32) -> bool {
        (1..4).any(|slot| self.shards.contains_key(&(item | (slot << ASIDE_SHIFT))))
    }

    /// Stops the crontab runs that have taken their job's `timeout=`: the stop signal, then
    /// SIGKILL after `--kill-timeout`, as any stop; the run is recorded as failed.
    fn stop_timed_out(&mut self) {
        let now = Instant::now();
        let due: Vec<u32> = self
            .shards
            .iter()
            .filter(|(_, shard, after)| {
                after.is_none() && shard.timeout_at.is_some_and(|at| at <= now)
            })
            .map(|(item, _, _)| *item)
            .collect();
        for item in due {
            if let Some(shard) = self.shards.item_mut(&item) {
                shard.timeout_at = None;
            }
            let job = self
                .jobs
                .as_ref()
                .and_then(|jobs| jobs.definition(item_of(item)));
            let (label, timeout) = match job {
                Some(definition) => (Label::job(&definition.job.name), definition.job.timeout),
                None => (Label::shard(item), None),
            };
            warn!(event = "run_timed_out", lock = %self.settings.lock, job = label.job.as_deref(), "the run of {} has taken its timeout={}; stopping it", label.name(), timeout.map_or_else(String::new, |timeout| fmt(timeout).to_string()));
            self.shards
                .stop(&item, self.settings.kill_signal, After::Restart);
        }
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
            Some(SignalEvent::Forward(Signal::SIGHUP)) if self.inbox.hup_rereads => {
                self.inbox.reread_requested = true;
            }
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
        loop {
            let quiet = link.leaving.is_some() || self.inbox.shutdown_requested.is_some();
            let settled = self.shards.settle(quiet);
            if settled.is_empty() {
                return Ok(());
            }
            self.settled(link, settled, quiet).await?;
        }
    }

    /// Acts on the entries [`Commands::settle`] settled: records a crontab job's run, gives a
    /// shard or a job away.
    async fn settled(
        &mut self,
        link: &mut Link<B>,
        settled: Vec<(u32, Option<crate::exit::ChildStatus>, Settled, Label)>,
        quiet: bool,
    ) -> Result<(), SessionError> {
        for status in settled.iter().filter_map(|(_, status, _, _)| *status) {
            self.inbox.telemetry.shard_command_exited(status);
        }
        if let Some(jobs) = &mut self.jobs {
            let shutting_down = self.inbox.shutdown_requested.is_some();
            // The session is lost or in doubt: its statements could only wait; the job's next
            // owner marks what ran here as interrupted.
            let in_doubt = link.leaving.is_some() && !shutting_down && !link.unhealthy;
            for (index, status, settled, _) in &settled {
                match settled {
                    Settled::Restarting => {
                        let occurrence = self
                            .shards
                            .item_mut(index)
                            .and_then(|shard| shard.run.map(|(at, _)| at));
                        if let Some(status) = status {
                            jobs.exited(item_of(*index), occurrence, *status);
                        }
                        if let Some(shard) = self.shards.item_mut(index) {
                            shard.timeout_at = None;
                        }
                        if is_aside(*index) {
                            // A run that went on aside is over: its entry goes.
                            self.shards
                                .stop(index, self.settings.kill_signal, After::Forget);
                            continue;
                        }
                        let timeout = self.settings.check_timeout;
                        if jobs.is_retired(*index) {
                            // Removed from the file: its last run is recorded, then it goes.
                            jobs.disown(*index, None, timeout).await;
                            self.shards
                                .stop(index, self.settings.kill_signal, After::Give);
                        } else if jobs.take_redefinition(*index) {
                            let epoch = self.shards.item_mut(index).map_or(0, |shard| shard.epoch);
                            jobs.disown(*index, None, timeout).await;
                            if let Some(clock) = jobs.clock() {
                                jobs.own(*index, &link.holder, epoch, clock, Instant::now());
                            }
                        }
                    }
                    // A run aside is recorded with its job's runs (see above).
                    _ if is_aside(*index) => {}
                    _ if in_doubt => jobs.forget(*index),
                    Settled::Give | Settled::Gone => {
                        let why = match settled {
                            Settled::Give => "its job moved to another replica",
                            _ if shutting_down => "pgleader was shut down",
                            _ => "this replica no longer holds the job",
                        };
                        let timeout = self.settings.check_timeout;
                        jobs.disown(*index, Some((*status, why)), timeout).await;
                    }
                }
            }
        }
        for (index, _, settled, label) in settled {
            if settled != Settled::Give {
                continue;
            }
            let left = link.left(self.settings.check_timeout);
            link.changed_at = Some(Instant::now());
            let give = tokio::time::timeout(left, link.holder.give(index));
            match alongside(&mut link.read, &mut link.read_done, give).await {
                Ok(Ok(())) => {
                    info!(event = "released", lock = %self.settings.lock, shard = label.shard, job = label.job.as_deref(), "released {}", label.name());
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
    /// leading while this replica holds one. Under `pgleader cron`, the jobs owned here by
    /// name too (between two runs, a job's command is not running, not waiting).
    fn publish(&self, me: i32) {
        if let Some(jobs) = &self.jobs {
            let owned = self.shards.views().filter_map(|(index, _, mut command)| {
                let definition = jobs.definition(*index)?;
                if command.state == CommandState::Waiting {
                    command.state = CommandState::NotRunning;
                }
                Some((definition.job.name.clone(), command))
            });
            self.inbox.telemetry.jobs_owned(owned.collect());
        }
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
