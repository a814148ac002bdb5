//! The seam between the room and what it runs: a sharded replica's room (`mod.rs`) keeps the
//! holder session, the roster, the table of commands and the signals, the same whatever the
//! replica shares out; a [`Duty`] answers the room's questions about the items themselves
//! (what runs for an item and with which environment, what happens when one is taken, what is
//! due next, what follows a command's end, what a reread changes, what to publish).
//!
//! Two duties, each in a file of its own: `--shards K` (`shards.rs`: a command per shard,
//! started again after it exits) and scheduled jobs (`scheduled.rs`: a job's occurrences, each
//! once, through the ledger), whose jobs are a crontab's or, under `--schedule --shards K`,
//! one per shard. The single leader's supervisor has the same shape
//! (`supervise/duty.rs`).

use std::task::{Context, Poll};
use std::time::Duration;

use jiff::Timestamp;
use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::election::ledger::{Asked, LedgerError};
use crate::election::shards::{Holder, Items, Seen};
use crate::election::socket::Lent;
use crate::exit::ChildStatus;
use crate::operate::telemetry::Telemetry;
use crate::schedule::clock::ServerClock;
use crate::supervise::commands::{Commands, Restart, Settled};
use crate::supervise::keeper::handle::{CommandLine, Job};
use crate::supervise::label::Label;
use crate::supervise::watchdog::Deadline;

/// Where a command sits in the room's table: the item it runs for and, for a run that goes on
/// beside its item's next one (a crontab's `overlap=allow`), which of those it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Slot {
    pub item: u32,
    /// 0 for the item's own command; 1 and up for the runs kept aside.
    pub aside: u8,
}

impl Slot {
    /// The item's own place: its command, or its newest run.
    pub fn of(item: u32) -> Slot {
        Slot { item, aside: 0 }
    }

    pub fn is_aside(self) -> bool {
        self.aside != 0
    }
}

/// A scheduled run an item's command runs for: its occurrence, the attempt, and when it has
/// taken its `timeout=` (a crontab job's); or a run asked by hand, `occurrence` being when it
/// was asked.
#[derive(Clone, Debug)]
pub struct Run {
    pub occurrence: Timestamp,
    pub attempt: i32,
    pub timeout_at: Option<Instant>,
    /// A run asked by hand (`pgleader cron run`): the request.
    pub asked: Option<Asked>,
}

/// What the room knows of an item it holds, beside its command.
#[derive(Clone, Debug)]
pub struct Held {
    /// The fencing token it was taken with.
    pub epoch: i64,
    /// When it was taken: what `/status` shows.
    pub taken_at: Timestamp,
    /// The run its command runs (or is about to run) for, where the duty schedules runs.
    pub run: Option<Run>,
}

/// The commands the room holds, one per slot.
pub type Table = Commands<Slot, Held>;

/// What the room does after a duty acted on something it asked for.
pub enum Then {
    Nothing,
    /// Start `slot`'s command now (its start time has come), and tell the duty once it runs
    /// ([`Duty::started`]).
    Start(Slot),
    /// The session is in trouble: every command stops and the session is left.
    Lose(String),
    /// Nothing can run at all: pgleader exits once every tree is gone.
    Fail(anyhow::Error),
}

/// Why a duty could not begin on a new holder session.
pub enum Unready {
    /// Leave the session and join again.
    Again,
    /// Leave and exit with this error.
    Fatal(String),
}

/// What a command's start is given by the room: the leader's environment (the duty adds its
/// own), the sockets its keeper holds, and the deadline its keeper watches.
pub struct Launch<'a> {
    pub env: Vec<(&'static str, String)>,
    pub hold: Vec<Lent>,
    pub watch: (&'a Deadline, &'a Label),
}

/// How the room is doing when commands settle.
#[derive(Clone, Copy)]
pub struct Mood {
    /// pgleader shuts down.
    pub shutting_down: bool,
    /// The session is lost or in doubt: its statements could only wait.
    pub in_doubt: bool,
    /// How long a statement may take.
    pub timeout: Duration,
    /// `--kill-signal`.
    pub kill_signal: Signal,
}

/// What a sharded replica runs for the items it holds. `H` is the backend's holder session.
pub trait Duty<H: Holder> {
    /// Something the duty waits for beside the room's events.
    type Ask;

    /// What the roster shares out, and how many this replica takes at most.
    fn items(&self) -> Items;
    fn cap(&self) -> Option<u32>;
    /// When a command that exited on its own starts again.
    fn restart(&self) -> Restart;
    /// Whether SIGHUP rereads the duty's definition (else it is passed on to the commands).
    fn rereads(&self) -> bool;
    /// Logs that the replica joined the fleet as member `me`.
    fn log_joined(&self, lock: &str, me: i32);

    /// A new holder session, before anything is taken on it, with the deadline its commands'
    /// keepers watch.
    async fn begin(
        &mut self,
        holder: &H,
        keepers: &Deadline,
        timeout: Duration,
    ) -> Result<(), Unready>;
    /// The session is over: nothing of the duty's may outlive it.
    async fn end(&mut self);

    /// How the log names `item`'s command.
    fn label(&self, item: u32) -> Label;
    /// The command line `slot` runs, if the duty knows it.
    fn command(&self, slot: Slot) -> Option<&CommandLine>;
    /// Starts `slot`'s command under a keeper, with `launch` and the duty's own environment.
    fn start(&mut self, slot: Slot, held: &Held, launch: Launch<'_>) -> anyhow::Result<Job>;

    /// `item` was taken, fenced by `epoch`, with the server's clock `clock`; its command may
    /// not start before `not_before`. Says how the log names it and when its command starts
    /// (`None`: when the duty asks, [`Then::Start`]).
    fn taken(
        &mut self,
        item: u32,
        holder: &H,
        epoch: i64,
        clock: ServerClock,
        not_before: Instant,
    ) -> (Label, Option<Instant>);
    /// A roster read, sent at `sent` and answered at `received`, succeeded.
    fn observed(&mut self, sent: Instant, received: Instant, seen: &Seen, me: i32);

    /// Looks at the table (before the room waits): says when the duty wants to be woken.
    fn plan(&mut self, table: &Table, quiet: bool, healthy: bool) -> Option<Instant>;
    /// The moment [`Duty::plan`] asked for has come.
    fn woken(&mut self, table: &mut Table, kill_signal: Signal);
    /// The next thing the duty asks for (only the duty's own housekeeping when `quiet`).
    /// Cancel-safe.
    fn poll_ask(&mut self, cx: &mut Context<'_>, quiet: bool) -> Poll<Self::Ask>;
    /// Acts on what it asked for.
    fn on_ask(&mut self, ask: Self::Ask, table: &mut Table, kill_signal: Signal) -> Then;
    /// `slot`'s command was started after a [`Then::Start`].
    fn started(&mut self, slot: Slot, table: &mut Table);

    /// Acts on the commands the table settled (see `Commands::settle`), before the room gives
    /// away those settled to be given.
    async fn settled(
        &mut self,
        settled: &[(Slot, Option<ChildStatus>, Settled, Label)],
        table: &mut Table,
        holder: &H,
        mood: Mood,
    );
    /// SIGHUP, when [`Duty::rereads`]: rereads the definition; the items shared out from now
    /// on, if they changed.
    async fn reread(&mut self, table: &mut Table, holder: &H, mood: Mood) -> Option<Items>;

    /// Another replica, or `pgleader cron run`, said `word` on the fleet's channel (the room
    /// reads the roster again on any word).
    fn heard(&mut self, word: &str) {
        let _ = word;
    }

    /// The first TERM, where the duty drains rather than stops (`pgleader cron`, as
    /// supercronic): no run starts any more, the items whose commands do not run are given up
    /// now, and those whose runs go on stay held until the runs end by themselves. The items
    /// shared out from now on, and how long the drain may last (`--drain-timeout`); `None`:
    /// the duty does not drain, and every command is stopped.
    async fn drain(
        &mut self,
        table: &mut Table,
        holder: &H,
        mood: Mood,
    ) -> Option<(Items, Option<Duration>)>;

    /// What the HTTP endpoint and metrics show of the duty, beside the room's shards.
    fn publish(&self, table: &Table, telemetry: &Telemetry);
}

/// A ledger statement failed: fatally, or the session is in trouble.
pub fn ledger_failed(err: LedgerError) -> Then {
    match err {
        LedgerError::Fatal(reason) => Then::Fail(anyhow::anyhow!("{reason}")),
        err => Then::Lose(format!("a ledger statement failed: {err}")),
    }
}

/// A command's keeper could not be started.
pub fn keeper_failed(err: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!("cannot start the keeper process: {err}")
}
