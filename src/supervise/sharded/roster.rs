//! The roster read and what the room does with it: the read is the check that this replica
//! still holds its items (it renews the deadline its keepers watch), and then the roster is
//! applied: commands of items no longer held stop, a surplus is handed over, free items are
//! taken up to this replica's share.

use std::collections::BTreeSet;

use jiff::Timestamp;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::duty::{Duty, Held, Slot};
use super::link::{Link, no_answer};
use super::{Room, TRANSIENT_FOR, TRANSIENT_RECHECK};
use crate::election::SessionError;
use crate::election::shards::{Holder, JoinError, Seen, ShardBackend};
use crate::operate::metrics::LossReason;
use crate::schedule::clock::ServerClock;
use crate::supervise::commands::After;

/// Why a roster could not be acted on.
pub(super) enum Failure {
    /// A statement failed: the session is done for.
    Session(SessionError),
    /// A command cannot be started at all.
    Fatal(anyhow::Error),
}

impl<B: ShardBackend + Clone + 'static, D: Duty<B::Holder>> Room<B, D> {
    /// A roster read ended (`sent`: when, if it was driven to its end outside the loop).
    pub(super) async fn on_read(
        &mut self,
        link: &mut Link<B>,
        sent: Option<Instant>,
        result: Result<Seen, SessionError>,
        quiet: bool,
    ) {
        let (interval, timeout) = (self.settings.check_interval, self.settings.check_timeout);
        let sent = sent
            .or_else(|| link.read.take().map(|(sent, _)| sent))
            .unwrap_or_else(Instant::now);
        self.inbox
            .telemetry
            .check_completed(sent.elapsed(), result.is_ok());
        let seen = match result {
            Err(err) => {
                let reason = link.why(format!("the check failed: {err}"));
                self.lose_all(&reason, LossReason::CheckFailed);
                if let SessionError::Unsafe(_) = err {
                    link.fatal = Some(err.into());
                }
                link.leave_for(reason);
                return;
            }
            Ok(_) if quiet => return,
            Ok(seen) => seen,
        };
        link.deadline = sent + interval + timeout;
        // Fails only if a keeper found the deadline past first: its command is stopping
        // already.
        if link.keepers.renew(link.deadline).is_err() {
            let reason = link.keepers.lost_reason();
            self.lose_all(&reason, LossReason::CheckTimeout);
            link.leave_for(reason);
            return;
        }
        debug!(event = "confirmed", lock = %self.settings.lock, "the session still holds its membership");
        self.duty.observed(sent, Instant::now(), &seen, link.me);
        link.next_read = sent + interval;
        if seen.taken.is_empty() {
            link.transient_since = None;
        } else if link.transient_since.get_or_insert(sent).elapsed() < TRANSIENT_FOR {
            link.next_read = Instant::now() + TRANSIENT_RECHECK;
        }
        if link.changed_at.is_some_and(|at| sent < at) {
            // Sent before this replica's last take or give: read again.
            link.stale = false;
            link.read_soon(quiet, timeout);
            return;
        }
        if let Some(reason) = seen.mismatch {
            // A replica of another kind that started at the very moment this one did, and
            // so was not refused: stop rather than overlap with it, and exit as a refused
            // replica would.
            self.lose_all(&reason, LossReason::NotHeld);
            link.fatal = Some(JoinError::Mismatch(reason).into());
            link.leave_for("a replica of another kind runs this lock".into());
            return;
        }
        link.keep_watch(&seen, &self.backend, &self.settings.session_name);
        if seen.unchanged && !link.stale && link.applied == Some(self.table.changes()) {
            return;
        }
        match self.apply(link, &seen).await {
            // Only after the items it took: a read sent before would not show them, and
            // they would look lost.
            Ok(()) if std::mem::take(&mut link.stale) => {
                link.applied = None;
                link.read_soon(quiet, timeout);
            }
            Ok(()) => link.applied = Some(self.table.changes()),
            Err(Failure::Session(err)) => {
                let reason = format!("a statement failed: {err}");
                self.lose_all(&reason, LossReason::CheckFailed);
                link.leave_for(reason);
            }
            Err(Failure::Fatal(err)) => self.fail(link, err),
        }
    }

    /// Acts on a roster: stops the commands of items this session no longer holds, gives a
    /// surplus away, takes free items up to its share. Each statement awaited here is bounded
    /// by what is left of the deadline.
    async fn apply(&mut self, link: &mut Link<B>, seen: &Seen) -> Result<(), Failure> {
        let me = link.me;
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
        self.stop_lost(mine);
        self.give_back_strays(link, mine).await?;
        let share = seen.roster.shares()[at] as usize;
        let own =
            |slot: &Slot, after: Option<After>| !slot.is_aside() && after != Some(After::Give);
        let giving = self
            .table
            .iter()
            .filter(|(slot, _, after)| !slot.is_aside() && *after == Some(After::Give))
            .count();
        let keeping = self
            .table
            .iter()
            .filter(|(slot, _, after)| own(slot, *after) && self.items.contains(slot.item))
            .count();
        if keeping > share {
            self.hand_over(seen, me, keeping - share);
            return Ok(());
        }
        if giving > 0 {
            return Ok(());
        }
        self.take_free(link, seen).await
    }

    /// Stops the commands of the items the roster no longer shows this replica holding. A
    /// job a reread removed is not shared out any more, so the roster does not show it: its
    /// last run finishes, then it is given up.
    fn stop_lost(&mut self, mine: &BTreeSet<u32>) {
        let lost: Vec<Slot> = self
            .table
            .iter()
            .filter(|(slot, _, after)| !mine.contains(&slot.item) && *after != Some(After::Forget))
            .map(|(slot, _, _)| *slot)
            .filter(|slot| self.items.contains(slot.item))
            .collect();
        for slot in lost {
            let label = self.table.label(&slot).cloned().unwrap_or_default();
            warn!(event = "leadership_lost", lock = %self.settings.lock, shard = label.shard, job = label.job.as_deref(), "the check found that this session no longer holds {}; stopping its command", label.name());
            self.table
                .stop(&slot, self.settings.kill_signal, After::Forget);
        }
    }

    /// Lets go of what the server shows held with no command here: a give that failed, or
    /// one made while this roster was read. An item given already is no error.
    async fn give_back_strays(
        &mut self,
        link: &mut Link<B>,
        mine: &BTreeSet<u32>,
    ) -> Result<(), Failure> {
        let strays: Vec<u32> = mine
            .iter()
            .copied()
            .filter(|item| !self.table.contains_key(&Slot::of(*item)))
            .collect();
        if strays.is_empty() {
            return Ok(());
        }
        link.changed_at = Some(Instant::now());
        let left = link.left(self.settings.check_timeout);
        match tokio::time::timeout(left, link.holder.give(&strays)).await {
            Ok(Ok(released)) => {
                let released: BTreeSet<u32> = released.into_iter().collect();
                for item in strays.iter().filter(|item| !released.contains(item)) {
                    debug!(
                        event = "release_failed",
                        shard = *item,
                        "shard {item} was not held any more"
                    );
                }
                Ok(())
            }
            Ok(Err(err)) => Err(Failure::Session(err)),
            Err(_) => Err(Failure::Session(no_answer("releasing shards"))),
        }
    }

    /// Hands `count` items over to replicas short of their share, once their commands' trees
    /// are gone.
    fn hand_over(&mut self, seen: &Seen, me: i32, count: usize) {
        let surplus: Vec<Slot> = self
            .table
            .iter()
            .rev()
            .filter(|(slot, _, after)| after.is_none() && !slot.is_aside())
            .map(|(slot, _, _)| *slot)
            // Never a job only this replica knows: nobody else would take it; nor one with
            // runs going aside, which hold its lock until they end.
            .filter(|slot| !self.has_aside(slot.item))
            .filter(|slot| seen.roster.known_elsewhere(slot.item, me))
            .take(count)
            .collect();
        for slot in surplus {
            let label = self.table.label(&slot).cloned().unwrap_or_default();
            info!(event = "hand_over", lock = %self.settings.lock, shard = label.shard, job = label.job.as_deref(), "handing {} over to a replica short of its share", label.name());
            self.table
                .stop(&slot, self.settings.kill_signal, After::Give);
        }
    }

    /// Whether runs of `item` go on aside (a crontab's `overlap=allow`).
    fn has_aside(&self, item: u32) -> bool {
        self.table
            .iter()
            .any(|(slot, _, _)| slot.item == item && slot.is_aside())
    }

    /// Takes the free items the roster deals this replica, fenced, and starts those whose
    /// commands may start now.
    async fn take_free(&mut self, link: &mut Link<B>, seen: &Seen) -> Result<(), Failure> {
        let me = link.me;
        // Never an item this replica holds already, nor one it does not share out (a job a
        // reread removed, dealt by a roster read before it), whatever the roster says.
        let wanted: Vec<u32> = seen
            .roster
            .to_take(me)
            .into_iter()
            .filter(|item| !self.table.contains_key(&Slot::of(*item)))
            .filter(|item| self.items.contains(*item))
            .collect();
        // A replica whose probe turned unhealthy takes nothing: it is about to leave.
        if wanted.is_empty() || !self.health.is_healthy() {
            return Ok(());
        }
        link.changed_at = Some(Instant::now());
        let sent = Instant::now();
        let timeout = self.settings.check_timeout;
        let (won, fence) = tokio::time::timeout(link.left(timeout), link.holder.take(&wanted))
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
        let clock = ServerClock::sample(sent, received, fence.server_time);
        for item in won {
            let slot = Slot::of(item);
            if self.table.contains_key(&slot) {
                continue;
            }
            self.inbox.telemetry.shard_taken(item, fence.epoch);
            let not_before = Instant::now() + delay;
            let (label, start_at) =
                self.duty
                    .taken(item, &link.holder, fence.epoch, clock, not_before);
            let held = Held {
                epoch: fence.epoch,
                taken_at: Timestamp::now(),
                run: None,
            };
            self.table.insert(slot, label, held, start_at);
        }
        self.start_due(link).map_err(Failure::Fatal)
    }
}
