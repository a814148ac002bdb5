//! A sharded replica's room: `pgleader run --shards K` (the command once per shard, or with
//! `--schedule` each shard's occurrences once) and `pgleader cron` (each of a crontab's jobs'
//! occurrences once), on whichever replica holds the item, every replica running its share (see `election/shards.rs` for the rule, and the
//! backend's `shards/` for the sessions).
//!
//! The room is the same whatever it shares out: one task owns the holder session and its
//! watcher (`link.rs`), reads the roster and acts on it (`roster.rs`), keeps the table of
//! commands and the signals, and goes round one `select!`. What runs for an item is a duty's
//! answer (`duty.rs`): `--shards` (`shards.rs`), or scheduled jobs (`scheduled.rs`, with
//! `jobs.rs` and `parking.rs`): a crontab's, or a shard's occurrences under `--schedule`. Each item keeps every promise a single leader keeps: its command starts only
//! once its lock is held and fenced (its own `PGLEADER_EPOCH`, the restart fence and
//! `--takeover-delay` counted), it runs in a process group of its own under a keeper that
//! holds the holder's socket and watches the session's deadline (a kill -9 of pgleader frees
//! the item only after the whole tree; a frozen pgleader's keepers stop their trees by
//! themselves), and an item is given away only after its command's whole tree is gone.
//! Stopping one command must not hold up the others: the commands are a table
//! (`commands.rs`) whose stops the loop drives, by the same stop machine the single leader
//! awaits (`stop.rs`); and nothing the loop awaits in place may outlast the deadline (every
//! statement is bounded by what is left of it, and the watcher's connection opens beside the
//! loop).
//!
//! The roster is read when another member says something changed (it joined, gave an item
//! away, left, or its watcher found it gone) and every `--check-interval`; that read is also
//! the check that this replica still holds its items, with the single leader's deadline
//! (`--check-interval + --check-timeout`). An item the check no longer finds, a session that
//! ends, or a deadline passed: the commands concerned are stopped at once.
//!
//! With `--health-cmd`, a replica joins only while its probe (`health.rs`) says it is healthy.
//! One that turns unhealthy stops every command it runs, gives every item up once their trees
//! are gone, leaves the fleet (so that the others share its items out), and joins again only
//! once a probe passes.

mod duty;
mod jobs;
mod link;
mod parking;
mod roster;
mod scheduled;
mod shards;

use std::collections::BTreeSet;
use std::task::Poll;
use std::time::Duration;

use anyhow::bail;
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::config::CronOptions;
use crate::election::backoff::Backoff;
use crate::election::shards::{Holder, HolderEvent, Items, JoinError, ShardBackend, Watcher};
use crate::election::{ConnectError, SessionError, elsewhere_hint};
use crate::exit::Outcome;
use crate::operate::metrics::LossReason;
use crate::operate::notify;
use crate::operate::telemetry::{ShardView, Telemetry};
use crate::schedule::crontab::Crontab;
use crate::supervise::commands::{After, Settled};
use crate::supervise::health::Health;
use crate::supervise::heap::Trim;
use crate::supervise::inbox::{Inbox, Shutdown, SignalMeaning};
use crate::supervise::keeper::handle::CommandLine;
use crate::supervise::keeper::protocol::Report;
use crate::supervise::label::Label;
use crate::supervise::signals::SignalEvent;
use crate::supervise::watchdog::Deadline;
use crate::supervise::{Settings, Sharding};
use crate::time::for_people as fmt;
use duty::{Duty, Launch, Mood, Slot, Table, Then, Unready};
use link::{Link, Watching, alongside, no_answer};
use scheduled::Scheduled;
use shards::Shards;

/// What a replica of a sharded lock shares out with the others.
#[derive(Debug)]
pub enum Fleet {
    /// `pgleader run --shards K`: the command once per shard.
    Shards(Sharding, CommandLine),
    /// `pgleader cron`: the crontab's jobs, each occurrence once; and how it runs them.
    Crontab(Crontab, CronOptions),
}

/// A session that lived this long was healthy: the next reconnection happens at once.
const STABLE_SESSION: Duration = Duration::from_secs(2);

/// How soon the roster is read again while it shows items held by a session that is no
/// longer a member: one that is ending, whose locks the server frees one after the other, so
/// that a read just after its membership went can still find some of its items held. For at
/// most `TRANSIENT_FOR`; a holder that stays so is waited for at the usual interval.
const TRANSIENT_RECHECK: Duration = Duration::from_millis(5);
const TRANSIENT_FOR: Duration = Duration::from_secs(1);

/// The most reports and asks already in taken in one turn of the loop (see
/// [`Room::take_ready`]).
const READY_AT_ONCE: usize = 64;

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
    let inbox = Inbox::new(signals, telemetry.clone(), settings.stop_rules());
    let (lock, hooks) = (settings.lock.clone(), settings.hooks.clone());
    match (fleet, &settings.schedule) {
        (Fleet::Shards(sharding, command), None) => {
            let restart_delay = settings.restart_delay;
            let duty = Shards::new(sharding, command, hooks, restart_delay, lock.to_string());
            Room::new(backend, settings, duty, health, inbox)
                .run()
                .await
        }
        (Fleet::Shards(sharding, command), Some(plan)) => {
            let what = (plan, &command);
            let duty: Scheduled<B::Holder> =
                Scheduled::shards(lock, sharding, what, hooks, telemetry);
            Room::new(backend, settings, duty, health, inbox)
                .run()
                .await
        }
        (Fleet::Crontab(crontab, options), _) => {
            let what = (&crontab, options);
            let duty: Scheduled<B::Holder> = Scheduled::crontab(lock, what, hooks, telemetry)?;
            Room::new(backend, settings, duty, health, inbox)
                .run()
                .await
        }
    }
}

/// A sharded replica: the holder session it joins the fleet on, the roster, the table of
/// commands, the signals; and its duty, which says what runs for the items it holds.
struct Room<B: ShardBackend, D> {
    backend: B,
    settings: Settings,
    duty: D,
    /// What this replica shares out, as its duty last said.
    items: Items,
    inbox: Inbox,
    backoff: Backoff,
    /// The items this replica holds, with their commands.
    table: Table,
    /// When a holder session last ended other than by pgleader's own doing.
    last_disturbance: Option<Instant>,
    /// Watcher sessions a lost holder could not end, for the next holder to end.
    leftover_watchers: Vec<i32>,
    /// Whether this replica may join and hold items (`--health-cmd`).
    health: Health,
    /// A TERM's drain, under way (see [`Room::drain`]).
    drain: Option<Drain>,
    /// A TERM came that asks for a drain, not begun yet.
    drain_requested: bool,
    /// The table's changes and the member id last published (see [`Room::publish`]); `None`
    /// when something else has told the telemetry of a role since.
    published: Option<(u64, i32)>,
    /// The items whose command the duty asked to start in this turn of the loop, started
    /// together at its end (see [`Room::take_ready`]).
    starting: Vec<Slot>,
    /// When to give the heap back: after giving many items away (`heap.rs`).
    trim: Trim,
}

/// A TERM's drain under way: the runs going on end by themselves, until `until` if
/// `--drain-timeout` bounds it.
#[derive(Clone, Copy, Debug)]
struct Drain {
    until: Option<Instant>,
}

/// How a session that is being left ends, once every command's tree is gone.
enum Ending {
    /// Left, and pgleader exits with this error.
    Fatal(anyhow::Error),
    /// Every item released on the server, explicitly.
    Release(Served),
    /// Lost: what the session can still end, it ends; the rest, the next one.
    Lost,
}

enum Served {
    Shutdown,
    Lost,
    /// The health probe turned unhealthy: every item was given up and the fleet left.
    Unhealthy,
}

enum Event<W, A> {
    Holder(HolderEvent),
    Deadline,
    /// A roster read ended; when it was sent, if it was driven to its end outside the loop.
    Read(
        Option<Instant>,
        Result<crate::election::shards::Seen, SessionError>,
    ),
    ReadDue,
    Opened(i32, Result<W, ConnectError>),
    Watched(Result<(), SessionError>),
    Signal(Option<SignalEvent>),
    Report(Slot, Report),
    /// A command's start or a stop's next step is due.
    Timer,
    /// The moment the duty asked to be woken at has come.
    Wake,
    /// A TERM's drain took its `--drain-timeout`.
    DrainTimeout,
    /// The duty asks for something.
    Ask(A),
    Unhealthy,
}

impl<B: ShardBackend + Clone + 'static, D: Duty<B::Holder>> Room<B, D> {
    fn new(backend: B, settings: Settings, duty: D, health: Health, mut inbox: Inbox) -> Self {
        inbox.rereads = duty.rereads();
        let table = Table::new(settings.stop_rules(), settings.kill_signal, duty.restart());
        Room {
            items: duty.items(),
            duty,
            health,
            inbox,
            table,
            backend,
            settings,
            backoff: Backoff::default(),
            last_disturbance: None,
            leftover_watchers: Vec::new(),
            drain: None,
            drain_requested: false,
            published: None,
            starting: Vec::new(),
            trim: Trim::default(),
        }
    }

    /// Joins, serves and joins again, until pgleader shuts down or a fatal error occurs.
    async fn run(mut self) -> anyhow::Result<Outcome> {
        let mut pause = Duration::ZERO;
        loop {
            if !pause.is_zero() && !self.inbox.pause(pause).await {
                return Ok(Outcome::Shutdown);
            }
            // Out of the fleet until the health probe passes: not even connected.
            if !self.health.sit_out(&mut self.inbox).await {
                return Ok(Outcome::Shutdown);
            }
            let Some(holder) = self.join().await? else {
                return Ok(Outcome::Shutdown);
            };
            let joined = Instant::now();
            let served = self.serve(holder).await;
            self.duty.end().await;
            match served? {
                Served::Shutdown => return Ok(Outcome::Shutdown),
                Served::Unhealthy => {
                    self.backoff.reset();
                    pause = Duration::ZERO;
                }
                Served::Lost => {
                    self.last_disturbance = Some(Instant::now());
                    if joined.elapsed() >= STABLE_SESSION {
                        self.backoff.reset();
                    }
                    pause = self.backoff.next_delay();
                }
            }
        }
    }

    /// Connects and joins the fleet, retrying transient failures with backoff. `None` means
    /// shut down.
    async fn join(&mut self) -> anyhow::Result<Option<B::Holder>> {
        let server = self.backend.to_string();
        self.inbox.telemetry.connecting();
        loop {
            let attempt =
                self.backend
                    .join(&self.settings.session_name, &self.items, self.duty.cap());
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
    /// command stopped by then) or pgleader shuts down (the same, and the items released).
    async fn serve(&mut self, holder: B::Holder) -> anyhow::Result<Served> {
        let Some(mut link) = self.begin(holder).await? else {
            return Ok(Served::Lost);
        };
        notify::status(&format!("running shards of lock {}", self.settings.lock));
        self.inbox.telemetry.following(link.me);
        self.published = None;
        link.read_soon(false, self.settings.check_timeout);
        loop {
            if let Some(ending) = self.ending(&mut link) {
                return self.end_session(link, ending).await;
            }
            let quiet = self.quiet(&link);
            let event = self.next_event(&mut link, quiet).await;
            // Only after a report or an ask: the select found every branch before them
            // pending (a signal, the deadline), and nothing can come in meanwhile.
            let more = matches!(event, Event::Report(..) | Event::Ask(_));
            self.on_event(&mut link, event, quiet).await;
            self.take_ready(&mut link, quiet, more).await;
            if std::mem::take(&mut self.drain_requested) {
                self.drain(&mut link).await;
            }
            if let Err(err) = self.finish_stopped(&mut link).await {
                let reason = format!("a statement failed: {err}");
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
                // The items with no command settle at once, and nothing else would wake the
                // loop for them: leaving, it waits for no deadline and reads no roster. (A
                // replica of a 1,000-job fleet whose hand-over missed the deadline sat there,
                // its jobs lost, until restarted.) What fails now is the same lost session.
                let _ = self.finish_stopped(&mut link).await;
            }
            if std::mem::take(&mut self.inbox.reread_requested) && !quiet && !self.draining() {
                self.reread(&mut link).await;
            }
            self.trim.held(self.table.len());
            self.publish(link.me);
        }
    }

    /// The session's start: its deadline, shared with every command's keeper, and the duty's
    /// own preparation. `None`: the session was left, to join again.
    async fn begin(&mut self, holder: B::Holder) -> anyhow::Result<Option<Link<B>>> {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let now = Instant::now();
        // Each keeper stops its tree by itself should the deadline pass unrenewed (pgleader
        // stopped, hung or starved).
        let keepers = match Deadline::new(self.settings.deadline_terms(), now + interval + timeout)
        {
            Ok(keepers) => keepers,
            Err(err) => {
                // Without it a frozen pgleader's commands could outlive the lease: not joining.
                warn!(event = "join_failed", lock = %self.settings.lock, reason = %err, "cannot share the deadline with the commands' keepers (memfd); leaving, to join again");
                let _ = holder.leave(timeout).await;
                return Ok(None);
            }
        };
        let abandoned = std::mem::take(&mut self.leftover_watchers);
        let mut link = Link::new(holder, keepers, abandoned, now, (interval, timeout));
        self.duty
            .log_joined(&self.settings.lock.to_string(), link.me);
        match self.duty.begin(&link.holder, &link.keepers, timeout).await {
            Ok(()) => Ok(Some(link)),
            Err(unready) => {
                self.leftover_watchers = std::mem::take(&mut link.abandoned);
                let _ = link.holder.leave(timeout).await;
                match unready {
                    Unready::Fatal(reason) => bail!("{reason}"),
                    Unready::Again => Ok(None),
                }
            }
        }
    }

    /// Whether the session is over: being left, with every command's tree gone.
    fn ending(&mut self, link: &mut Link<B>) -> Option<Ending> {
        if !self.table.is_empty() {
            return None;
        }
        let shutting_down = self.inbox.shutdown_requested.is_some();
        if link.fatal.is_some() || shutting_down || link.leaving.is_some() {
            // Its answer would hold up the statements below (see `alongside`).
            link.read = None;
            link.read_done = None;
        }
        if let Some(err) = link.fatal.take() {
            Some(Ending::Fatal(err))
        } else if shutting_down {
            Some(Ending::Release(Served::Shutdown))
        } else if link.unhealthy {
            Some(Ending::Release(Served::Unhealthy))
        } else if link.leaving.is_some() {
            Some(Ending::Lost)
        } else {
            None
        }
    }

    /// Ends the session as `ending` says, its watchers first.
    async fn end_session(&mut self, mut link: Link<B>, ending: Ending) -> anyhow::Result<Served> {
        let timeout = self.settings.check_timeout;
        link.end_watchers(timeout).await;
        match ending {
            Ending::Fatal(err) => {
                let _ = link.holder.leave(timeout).await;
                Err(err)
            }
            Ending::Release(served) => {
                let lock = &self.settings.lock;
                match link.holder.leave(timeout).await {
                    Ok(()) => info!(event = "released", lock = %lock, "released every shard"),
                    Err(err) => {
                        warn!(event = "release_failed", lock = %lock, reason = %err, "cannot release the shards explicitly; closing the session frees them")
                    }
                }
                Ok(served)
            }
            Ending::Lost => {
                // The session may still answer (a deadline passed, a statement failed); what
                // it cannot end, the next one does.
                self.leftover_watchers = std::mem::take(&mut link.abandoned);
                Ok(Served::Lost)
            }
        }
    }

    /// Waits for the next thing to act on. Biased: the end of the session and the deadline
    /// win over everything.
    async fn next_event(&mut self, link: &mut Link<B>, quiet: bool) -> Event<B::Watcher, D::Ask> {
        if let Some((sent, result)) = link.read_done.take() {
            return Event::Read(Some(sent), result);
        }
        let holds_any = !self.table.is_empty();
        let wake = self.duty.plan(&self.table, quiet, self.health.is_healthy());
        let timer = self.table.next_timer();
        let drain_until = self.drain.and_then(|drain| drain.until);
        let leaving = link.leaving.is_some();
        let (health, table, duty) = (&mut self.health, &mut self.table, &mut self.duty);
        let Link {
            holder,
            deadline,
            read,
            next_read,
            watching,
            opening,
            ..
        } = link;
        tokio::select! {
            biased;
            event = holder.next_event(), if !leaving => Event::Holder(event),
            () = health.turned_unhealthy(), if !quiet => Event::Unhealthy,
            _ = sleep_until(*deadline), if !quiet && holds_any => Event::Deadline,
            result = async { match read { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Read(None, result),
            event = self.inbox.next_signal() => Event::Signal(event),
            (slot, report) = table.next_report() => Event::Report(slot, report),
            _ = until(timer) => Event::Timer,
            _ = until(wake) => Event::Wake,
            _ = until(drain_until) => Event::DrainTimeout,
            result = async { match watching.as_mut().and_then(|w| w.watch.as_mut()) { Some(watch) => watch.await, None => std::future::pending().await } } => Event::Watched(result),
            (member, result) = async { match opening { Some((_, future)) => future.await, None => std::future::pending().await } } => Event::Opened(member, result),
            ask = std::future::poll_fn(|cx| duty.poll_ask(cx, quiet)) => Event::Ask(ask),
            _ = sleep_until(*next_read), if read.is_none() && !quiet => Event::ReadDue,
        }
    }

    async fn on_event(
        &mut self,
        link: &mut Link<B>,
        event: Event<B::Watcher, D::Ask>,
        quiet: bool,
    ) {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let lock = self.settings.lock.clone();
        match event {
            Event::Holder(HolderEvent::Notified(word)) => {
                debug!(event = "notified", lock = %lock, word = %word, "another replica: {word}");
                if !quiet {
                    self.duty.heard(&word);
                }
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
            Event::Unhealthy => self.turn_unhealthy(link),
            Event::ReadDue => link.read_soon(quiet, timeout),
            Event::Read(sent, result) => self.on_read(link, sent, result, quiet).await,
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
            Event::Report(slot, report) => {
                // A keeper stops its command by itself: pgleader did not run past the
                // deadline, and every item held counts as lost.
                if matches!(report, Report::Expired(_)) && link.leaving.is_none() {
                    let reason = link.keepers.lost_reason();
                    self.lose_all(&reason, LossReason::CheckTimeout);
                    link.leave_for(reason);
                }
                let command = self.duty.command(slot);
                if let Err(err) = self.table.on_report(&slot, report, command) {
                    self.fail(link, err.into());
                }
            }
            Event::Timer => {
                if let Err(err) = self.start_due(link) {
                    self.fail(link, err);
                }
            }
            Event::Wake => self.duty.woken(&mut self.table, self.settings.kill_signal),
            Event::DrainTimeout => {
                let left = self
                    .table
                    .iter()
                    .filter(|(slot, _, _)| self.table.is_started(slot));
                let left = left.count();
                warn!(event = "drain_timeout", lock = %self.settings.lock, runs = left, "the drain took its --drain-timeout: stopping the {left} run(s) still going");
                self.drain = None;
                self.shut_down(Signal::SIGTERM);
            }
            Event::Ask(ask) => {
                let then = self
                    .duty
                    .on_ask(ask, &mut self.table, self.settings.kill_signal);
                self.then(link, then);
            }
        }
    }

    /// Takes the commands' reports and the duty's asks already in (when `more`: after a report
    /// or an ask), up to [`READY_AT_ONCE`]; then starts the commands asked for. At a burst (a
    /// thousand jobs due at one instant) they come by the hundred, and each turn of the loop
    /// walks every entry of the table (to plan, settle, start and publish): taken one per
    /// turn, that is quadratic in the jobs due. They are what the next turns would take anyway:
    /// the loop's select is biased, and after a report or an ask every branch before them (the
    /// session's end, the deadline, a signal) was found pending; handling them awaits nothing,
    /// so on pgleader's one thread nothing of those comes in meanwhile.
    async fn take_ready(&mut self, link: &mut Link<B>, quiet: bool, more: bool) {
        let batch = if more { READY_AT_ONCE } else { 0 };
        for _ in 0..batch {
            if self.quiet(link) != quiet {
                break;
            }
            let event = if let Some((slot, report)) = self.table.report_now().await {
                Event::Report(slot, report)
            } else {
                let duty = &mut self.duty;
                let ask = std::future::poll_fn(|cx| match duty.poll_ask(cx, quiet) {
                    Poll::Ready(ask) => Poll::Ready(Some(ask)),
                    Poll::Pending => Poll::Ready(None),
                });
                match ask.await {
                    Some(ask) => Event::Ask(ask),
                    None => break,
                }
            };
            self.on_event(link, event, quiet).await;
        }
        if self.starting.is_empty() {
            return;
        }
        let started = self.start_due(link);
        // Those started before one that failed are runs all the same: recorded as such when
        // the failure stops them, not taken back.
        for slot in std::mem::take(&mut self.starting) {
            self.duty.started(slot, &mut self.table);
        }
        if let Err(err) = started {
            self.fail(link, err);
        }
    }

    /// Does what the duty said to after acting on something.
    fn then(&mut self, link: &mut Link<B>, then: Then) {
        match then {
            Then::Nothing => {}
            Then::Start(slot) => self.starting.push(slot),
            Then::Lose(reason) => {
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
            }
            Then::Fail(err) => self.fail(link, err),
        }
    }

    /// The health probe turned unhealthy: every command stops, and the fleet is left once
    /// their trees are gone.
    fn turn_unhealthy(&mut self, link: &mut Link<B>) {
        let reason = "the health probe failed (--health-cmd)";
        warn!(event = "health_step_down", lock = %self.settings.lock, "giving up every shard and leaving: {reason}; not joining again until it passes");
        notify::status("unhealthy: giving up every shard until the health probe passes");
        if !self.table.is_empty() {
            self.inbox
                .telemetry
                .leadership_lost(LossReason::Unhealthy, reason);
        }
        // Released once every command's tree is gone, not before.
        self.table
            .stop_all(self.settings.kill_signal, After::Forget);
        link.unhealthy = true;
        link.leave_for(reason.to_owned());
    }

    /// Starts the commands whose start time has come, with the keeper holding the holder
    /// session's sockets (read now: none once it is closed), and moves stops along.
    fn start_due(&mut self, link: &Link<B>) -> anyhow::Result<()> {
        let sockets = link.holder.sockets();
        // Without the session's socket a keeper could not order a crash: the session has
        // ended, which the loop hears next.
        // Nor while the probe says unhealthy (it may have turned so while items were being
        // taken): the loop hears it next and gives them all up.
        let may_start = !sockets.is_empty() && self.health.is_healthy();
        let (settings, duty, me) = (&self.settings, &mut self.duty, link.me);
        self.table.on_timer(may_start, |slot, held| {
            let label = duty.label(slot.item);
            let launch = Launch {
                env: settings.leader_env(me, held.epoch),
                hold: link.holder.lend(slot.item),
                watch: (&link.keepers, &label),
            };
            let job = duty.start(*slot, held, launch)?;
            debug!(
                event = "spawned",
                shard = slot.item,
                pgid = job.pgid().as_raw(),
                "started the keeper"
            );
            Ok(job)
        })
    }

    /// SIGHUP or SIGUSR2, where the duty rereads: the items it shares out from now on are told to the
    /// server (those it removed whose last runs go on stay this replica's until they end).
    async fn reread(&mut self, link: &mut Link<B>) {
        // A reread renames what the duty publishes.
        self.published = None;
        let mood = self.mood(link);
        let reread = self.duty.reread(&mut self.table, &link.holder, mood);
        let Some(items) = reread.await else {
            return;
        };
        self.tell_items(link, items, "rereading the crontab").await;
    }

    /// Tells the server the items this replica shares out from now on, `items` (those it no
    /// longer knows whose last runs go on stay this replica's until they end), and reads the
    /// roster again; a statement that fails loses every item.
    async fn tell_items(&mut self, link: &mut Link<B>, items: Items, doing: &str) {
        let timeout = self.settings.check_timeout;
        self.items = items;
        let finishing = self
            .table
            .iter()
            .map(|(slot, _, _)| slot.item)
            .filter(|item| !self.items.contains(*item))
            .collect();
        // A roster read sent before shows the items as they were: not acted on (see `on_read`).
        // And a roster unchanged since is acted on again, for the items as they are now.
        link.changed_at = Some(Instant::now());
        link.applied = None;
        let told = tokio::time::timeout(
            link.left(timeout),
            link.holder.set_items(self.items.clone(), finishing),
        )
        .await;
        let failed = match told {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(format!("a statement failed: {err}")),
            Err(_) => Some(format!("a statement failed: {}", no_answer(doing))),
        };
        if let Some(reason) = failed {
            self.lose_all(&reason, LossReason::CheckFailed);
            link.leave_for(reason);
            return;
        }
        link.read_soon(false, timeout);
    }

    /// The first TERM, where the duty drains: no run starts any more, the items whose
    /// commands do not run are given up at once (the others deal them out and run their next
    /// occurrences on time), and those whose runs go on are kept, so that nobody starts their
    /// next occurrence beside them, until the runs end by themselves; then pgleader leaves and
    /// exits. Where the duty does not drain, every command is stopped.
    async fn drain(&mut self, link: &mut Link<B>) {
        let mood = self.mood(link);
        let drained = self.duty.drain(&mut self.table, &link.holder, mood).await;
        let Some((items, timeout)) = drained else {
            self.drain = None;
            self.shut_down(Signal::SIGTERM);
            return;
        };
        self.drain = Some(Drain {
            until: timeout.map(|timeout| Instant::now() + timeout),
        });
        let running = self
            .table
            .iter()
            .filter(|(slot, _, _)| self.table.is_started(slot));
        let running = running.count();
        let bound = timeout.map_or_else(
            || "with no bound".to_owned(),
            |timeout| format!("for at most {} (--drain-timeout)", fmt(timeout)),
        );
        self.inbox.begin_shutdown(
            Signal::SIGTERM,
            &format!("draining: {running} run(s) go on to their end, {bound}; the other jobs are handed over"),
        );
        info!(event = "draining", lock = %self.settings.lock, runs = running, "draining: no run starts any more, the jobs not running are handed over now, and {running} run(s) go on to their end, {bound}; a second TERM or an INT stops them");
        self.tell_items(link, items, "draining").await;
    }

    /// Whether a TERM's drain is under way.
    fn draining(&self) -> bool {
        self.drain.is_some()
    }

    /// Whether the session takes nothing new and starts nothing: it is being left, or
    /// pgleader shuts down; not while it drains, whose runs go on, and the session with them.
    fn quiet(&self, link: &Link<B>) -> bool {
        link.leaving.is_some() || (self.inbox.shutdown_requested.is_some() && !self.draining())
    }

    /// A command cannot run at all: every command is killed, and the session left with `err`
    /// once their trees are gone.
    fn fail(&mut self, link: &mut Link<B>, err: anyhow::Error) {
        self.table.stop_all(Signal::SIGKILL, After::Forget);
        link.fatal = Some(err);
        link.leave_for("a fatal error".into());
    }

    /// Every item is lost (or about to be): stop every command.
    fn lose_all(&mut self, reason: &str, loss: LossReason) {
        warn!(event = "leadership_lost", lock = %self.settings.lock, reason = %reason, "lost every shard");
        notify::status(&format!("shards lost ({reason}); stopping their commands"));
        self.inbox.telemetry.leadership_lost(loss, reason);
        self.published = None;
        self.last_disturbance = Some(Instant::now());
        self.table
            .stop_all(self.settings.kill_signal, After::Forget);
    }

    fn on_signal(&mut self, event: Option<SignalEvent>) {
        match self.inbox.meaning(event) {
            SignalMeaning::Forward(signal) => self.table.forward(signal),
            SignalMeaning::Reap => self.table.reap(),
            // Where the duty drains (`drain`), the first TERM lets the runs end by themselves.
            SignalMeaning::Shutdown(Signal::SIGTERM, Shutdown::First) => {
                self.drain = Some(Drain { until: None });
                self.drain_requested = true;
            }
            SignalMeaning::Shutdown(signal, Shutdown::First) => self.shut_down(signal),
            // A second TERM, or an INT, during a drain: the runs are stopped as at any
            // shutdown; after that, each stop insists.
            SignalMeaning::Shutdown(signal, Shutdown::Insist) if self.draining() => {
                self.drain = None;
                self.drain_requested = false;
                self.shut_down(signal);
            }
            SignalMeaning::Shutdown(signal, Shutdown::Insist) => self.table.insist(signal),
            // A reread waits for the end of the event's handling (`serve`); a repeated signal
            // and the channel's end after a shutdown change nothing.
            SignalMeaning::Reread
            | SignalMeaning::Shutdown(_, Shutdown::Repeated)
            | SignalMeaning::Closed => {}
        }
    }

    fn shut_down(&mut self, signal: Signal) {
        self.inbox.begin_shutdown(
            signal,
            "shutting down: stopping every shard's command, then releasing the shards",
        );
        self.table.retarget(signal);
        self.table.stop_all(signal, After::Forget);
    }

    /// How the room is doing, for the duty's statements.
    fn mood(&self, link: &Link<B>) -> Mood {
        let shutting_down = self.inbox.shutdown_requested.is_some();
        Mood {
            shutting_down,
            // The session is lost or in doubt: its statements could only wait.
            in_doubt: link.leaving.is_some() && !shutting_down && !link.unhealthy,
            timeout: self.settings.check_timeout,
            kill_signal: self.settings.kill_signal,
        }
    }

    /// Settles the items whose commands are wholly gone: each is given away, kept for a
    /// restart, or forgotten. A give is bounded by what is left of the deadline; an error
    /// means the session is in doubt.
    async fn finish_stopped(&mut self, link: &mut Link<B>) -> Result<(), SessionError> {
        loop {
            let quiet = self.quiet(link);
            let settled = self.table.settle(quiet);
            if settled.is_empty() {
                return Ok(());
            }
            self.settled(link, settled, quiet).await?;
        }
    }

    /// Acts on the entries [`crate::supervise::commands::Commands::settle`] settled: the duty
    /// first (a crontab records its runs), then the items to give away are given.
    async fn settled(
        &mut self,
        link: &mut Link<B>,
        settled: Vec<(Slot, Option<crate::exit::ChildStatus>, Settled, Label)>,
        quiet: bool,
    ) -> Result<(), SessionError> {
        for status in settled.iter().filter_map(|(_, status, _, _)| *status) {
            self.inbox.telemetry.shard_command_exited(status);
        }
        let mood = self.mood(link);
        let duty = self
            .duty
            .settled(&settled, &mut self.table, &link.holder, mood);
        duty.await;
        let given: Vec<(u32, Label)> = settled
            .into_iter()
            .filter(|(_, _, settled, _)| *settled == Settled::Give)
            .map(|(slot, _, _, label)| (slot.item, label))
            .collect();
        if given.is_empty() {
            return Ok(());
        }
        let items: Vec<u32> = given.iter().map(|(item, _)| *item).collect();
        let left = link.left(self.settings.check_timeout);
        link.changed_at = Some(Instant::now());
        let give = tokio::time::timeout(left, link.holder.give(&items));
        let released: BTreeSet<u32> =
            match alongside(&mut link.read, &mut link.read_done, give).await {
                Ok(result) => result?.into_iter().collect(),
                Err(_) => return Err(no_answer("releasing shards")),
            };
        let mut not_held = None;
        for (item, label) in &given {
            if released.contains(item) {
                info!(event = "released", lock = %self.settings.lock, shard = label.shard, job = label.job.as_deref(), "released {}", label.name());
            } else {
                not_held.get_or_insert_with(|| label.name());
            }
        }
        if let Some(name) = not_held {
            return Err(SessionError::Query(format!(
                "the server says this session did not hold {name}"
            )));
        }
        // A replica that was handing over took nothing meanwhile; the roster may have changed
        // since (a member gone), and its own word does not come back to it.
        link.read_soon(quiet, self.settings.check_timeout);
        Ok(())
    }

    /// What the HTTP endpoint and metrics show: the items held here and their commands;
    /// leading while this replica holds one; and what the duty adds.
    fn publish(&mut self, me: i32) {
        // Nothing changed since the last turn of the loop (a check at rest, say): nothing to
        // publish, and no thousand views built to find that out.
        let now = (self.table.changes(), me);
        if self.published == Some(now) {
            return;
        }
        self.published = Some(now);
        self.duty.publish(&self.table, &self.inbox.telemetry);
        let held = self
            .table
            .views()
            .map(|(slot, held, command)| ShardView {
                shard: slot.item,
                epoch: held.epoch,
                since: held.taken_at,
                command,
            })
            .collect();
        self.inbox.telemetry.shards_held(held, me);
    }
}

/// Sleeps until `at`; forever when there is nothing to wait for.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}
