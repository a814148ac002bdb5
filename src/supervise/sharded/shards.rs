//! The `--shards K` duty: the command runs once per shard, on whichever replica holds that
//! shard, with `PGLEADER_SHARD` and `PGLEADER_SHARDS` in its environment, and starts again
//! `--restart-delay` after it exits, for as long as the shard is held (a service per shard).

use std::convert::Infallible;
use std::task::{Context, Poll};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::info;

use super::duty::{Duty, Held, Launch, Mood, Slot, Table, Then, Unready, keeper_failed};
use crate::election::shards::{Holder, Items, Seen};
use crate::exit::ChildStatus;
use crate::operate::telemetry::Telemetry;
use crate::schedule::clock::ServerClock;
use crate::supervise::Sharding;
use crate::supervise::commands::{Restart, Settled};
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::handle::{CommandLine, Job, Parked};
use crate::supervise::label::Label;
use crate::supervise::watchdog::Deadline;

/// The command, once per shard.
pub struct Shards {
    sharding: Sharding,
    command: CommandLine,
    hooks: Hooks,
    restart_delay: Duration,
    lock: String,
}

impl Shards {
    pub fn new(
        sharding: Sharding,
        command: CommandLine,
        hooks: Hooks,
        restart_delay: Duration,
        lock: String,
    ) -> Shards {
        Shards {
            sharding,
            command,
            hooks,
            restart_delay,
            lock,
        }
    }
}

impl<H: Holder> Duty<H> for Shards {
    type Ask = Infallible;

    fn items(&self) -> Items {
        Items::Numbered(self.sharding.count)
    }

    fn cap(&self) -> Option<u32> {
        self.sharding.cap
    }

    fn restart(&self) -> Restart {
        Restart::After(self.restart_delay)
    }

    fn rereads(&self) -> bool {
        false
    }

    fn log_joined(&self, lock: &str, me: i32) {
        let count = self.sharding.count;
        info!(event = "joined", lock = %lock, backend_pid = me, shards = count, "joined the replicas of this lock, {count} shards");
    }

    async fn begin(&mut self, _: &H, _: &Deadline, _: Duration) -> Result<(), Unready> {
        Ok(())
    }

    async fn end(&mut self) {}

    fn label(&self, item: u32) -> Label {
        Label::shard(item)
    }

    fn command(&self, _: Slot) -> Option<&CommandLine> {
        Some(&self.command)
    }

    fn start(&mut self, slot: Slot, _: &Held, mut launch: Launch<'_>) -> anyhow::Result<Job> {
        launch.env.push(("PGLEADER_SHARD", slot.item.to_string()));
        launch
            .env
            .push(("PGLEADER_SHARDS", self.sharding.count.to_string()));
        let (env, hold, watch) = (&launch.env, &launch.hold, Some(launch.watch));
        Parked::start_or_fresh(None, &self.command, &self.hooks, env, hold, watch)
            .map_err(keeper_failed)
    }

    fn taken(
        &mut self,
        item: u32,
        holder: &H,
        epoch: i64,
        _: ServerClock,
        not_before: Instant,
    ) -> (Label, Option<Instant>) {
        let (lock, me) = (&self.lock, holder.id());
        info!(event = "leader", lock = %lock, shard = item, epoch, backend_pid = me, "took shard {item}");
        (Label::shard(item), Some(not_before))
    }

    fn observed(&mut self, _: Instant, _: Instant, _: &Seen, _: i32) {}

    fn plan(&mut self, _: &Table, _: bool, _: bool) -> Option<Instant> {
        None
    }

    fn woken(&mut self, _: &mut Table, _: Signal) {}

    fn poll_ask(&mut self, _: &mut Context<'_>, _: bool) -> Poll<Infallible> {
        Poll::Pending
    }

    fn on_ask(&mut self, ask: Infallible, _: &mut Table, _: Signal) -> Then {
        match ask {}
    }

    fn started(&mut self, _: Slot, _: &mut Table) {}

    async fn settled(
        &mut self,
        _: &[(Slot, Option<ChildStatus>, Settled, Label)],
        _: &mut Table,
        _: &H,
        _: Mood,
    ) {
    }

    async fn reread(&mut self, _: &mut Table, _: &H, _: Mood) -> Option<Items> {
        None
    }

    async fn drain(&mut self, _: &mut Table, _: &H, _: Mood) -> Option<(Items, Option<Duration>)> {
        None
    }

    fn publish(&self, _: &Table, _: &Telemetry) {}
}
