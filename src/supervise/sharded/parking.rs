//! Keepers started ahead of a crontab's occurrences, so that an occurrence costs the command's
//! own fork and exec, not a keeper's too.
//!
//! Every command runs under a keeper of pgleader's (`keeper/`), and starting one is an exec
//! of pgleader: about a millisecond of CPU, spent by the spawning thread until the exec is done.
//! A room that started its keepers as the occurrences came did it one after the other on its
//! one thread, at the very instant every job of a `* * * * *` crontab falls due: measured with
//! 100 every-second jobs on 3 replicas of a 2-core machine, a start took 3.5 ms of the room's
//! loop, and the 33rd job of a replica waited for the 32 before it. So, as a waiting replica
//! of `pgleader run` parks a keeper before it queues for the lock, a replica here parks one for
//! each job it owns [`AHEAD`] before the job's next occurrence (earlier the more jobs fall due
//! together, [`EACH`] per job), on a blocking thread, all the jobs falling due together in one
//! batch. When the occurrence is claimed the keeper is handed the command's environment and
//! the session's sockets, and starts it at once.
//!
//! Beside them, while a session lasts, a replica whose backend asks for it (Redis) keeps one
//! keeper of its membership ([`MembershipKeeper`]): it holds the session's socket between the
//! jobs' runs, when no command's keeper does, and ends the membership on the server if
//! pgleader dies, once the replica's last command is gone, so that the others take its jobs at
//! once rather than at their watcher's next check. PostgreSQL needs none: the server frees a
//! session's locks when its connection closes.
//!
//! A parked keeper is for one command line: a job the crontab redefined since starts under a
//! fresh keeper, as does a job whose parked keeper is gone (killed from outside) or was not
//! ready. A job given up (moved to another replica, the session lost) lets its keeper go, which
//! exits on the end of its channel having started nothing. Only jobs due within their lead
//! ([`AHEAD`], at most [`MOST_AHEAD`]) hold one: a crontab at rest holds none.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use nix::unistd::Pid;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::election::socket::Lent;
use crate::supervise::hook::Hooks;
use crate::supervise::keeper::handle::{CommandLine, MembershipKeeper, Parked, await_let_go};

/// How long before its job's next occurrence a keeper is started, at the least (each job due
/// within [`TOGETHER`] that still wants one adds [`EACH`], up to [`MOST_AHEAD`]): ample for a
/// batch of keepers to be spawned on a busy machine (33 took 30 to 100 ms on the benchmark's 2
/// cores), short enough that a crontab holds none between its occurrences but for this moment
/// (a keeper is 1.5 MiB of RSS, most of it shared: a few every-second jobs hold one each a
/// quarter of the time).
pub const AHEAD: Duration = Duration::from_millis(250);

/// What starting one keeper takes on a busy machine, as [`AHEAD`] grows with the jobs falling
/// due together: a batch is started one keeper after the other, about a millisecond of CPU
/// each (an exec of pgleader), more when the cores are shared.
pub const EACH: Duration = Duration::from_millis(2);

/// How far ahead the jobs counted for [`EACH`] fall due: those that will want their keepers
/// in the same batch.
const TOGETHER: Duration = Duration::from_secs(2);

/// The longest lead, however many jobs fall due together: every-second jobs beyond some 375
/// per replica would otherwise want their next keepers as soon as their runs end.
const MOST_AHEAD: Duration = Duration::from_secs(1);

/// A batch of keepers being started: each job's item, the command line, and how it went.
pub type Batch = Vec<(u32, CommandLine, io::Result<Parked>)>;

/// The keepers parked for the jobs a replica owns, and the batch being started.
#[derive(Default)]
pub struct Parking {
    parked: BTreeMap<u32, (CommandLine, Parked)>,
    spawning: Option<JoinHandle<Batch>>,
    /// Keepers let go while the session went on (their jobs moved, or the replica is leaving):
    /// each exits on the end of its channel; [`Parking::dismiss`] waits for them too.
    let_go: Vec<Pid>,
    /// The occurrence each job was last given a keeper for (its claim's instant): one try per
    /// occurrence, so that a keeper that cannot be started is not tried again in a loop.
    tried_for: BTreeMap<u32, Instant>,
    /// The keeper of this session's membership, where the backend lends one a farewell.
    membership: Option<MembershipKeeper>,
}

impl std::fmt::Debug for Parking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parking")
            .field("parked", &self.parked.keys().collect::<Vec<_>>())
            .field("spawning", &self.spawning.is_some())
            .field("membership", &self.membership)
            .finish()
    }
}

impl Parking {
    /// Looks at the owned jobs, `owned`: each job's item, and when its next occurrence is
    /// claimed with its command line if it may have a keeper now (not while its command runs,
    /// its next occurrence is being claimed, or it waits for a new definition). Lets go of the
    /// keepers of jobs no longer owned, starts a batch for the jobs due within [`AHEAD`] (and
    /// [`EACH`] more per job due within [`TOGETHER`]) that have none, and says when the next
    /// job will want one.
    pub fn plan(
        &mut self,
        owned: Vec<(u32, Option<(Instant, &CommandLine)>)>,
        hooks: &Hooks,
    ) -> Option<Instant> {
        let items: BTreeSet<u32> = owned.iter().map(|(item, _)| *item).collect();
        let let_go = &mut self.let_go;
        // Those reaped since (by the room's SIGCHLD) need no more waiting for.
        let_go.retain(|pid| nix::sys::signal::kill(*pid, None).is_ok());
        self.parked.retain(|item, (_, parked)| {
            let keep = items.contains(item);
            if !keep {
                let_go.push(parked.pid());
            }
            keep
        });
        self.tried_for.retain(|item, _| items.contains(item));
        if self.spawning.is_some() {
            // Its end wakes the room, which plans again.
            return None;
        }
        let now = Instant::now();
        // A thousand jobs falling due at one instant on 3 replicas: 333 keepers each, whose
        // batch took some 500 ms, most of them still being started at the instant.
        // Counted: those that still want a keeper for that occurrence.
        let together = owned
            .iter()
            .filter(|(item, due)| {
                due.is_some_and(|(at, _)| {
                    at <= now + TOGETHER
                        && !self.parked.contains_key(item)
                        && self.tried_for.get(item) != Some(&at)
                })
            })
            .count();
        let ahead = (AHEAD + EACH * u32::try_from(together).unwrap_or(u32::MAX)).min(MOST_AHEAD);
        let mut batch = Vec::new();
        let mut next: Option<Instant> = None;
        for (item, due) in owned {
            let Some((at, command)) = due else { continue };
            if self.parked.contains_key(&item) || self.tried_for.get(&item) == Some(&at) {
                continue;
            }
            let want_at = at.checked_sub(ahead).unwrap_or(now);
            if want_at <= now {
                self.tried_for.insert(item, at);
                batch.push((item, command.clone()));
            } else {
                next = Some(next.map_or(want_at, |next| next.min(want_at)));
            }
        }
        if !batch.is_empty() {
            let hooks = hooks.clone();
            self.spawning = Some(tokio::task::spawn_blocking(move || {
                batch
                    .into_iter()
                    .map(|(item, command)| {
                        let parked = Parked::spawn(&command, &hooks);
                        (item, command, parked)
                    })
                    .collect()
            }));
        }
        next
    }

    /// The batch being started, once it is done. Pending while none is. Cancel-safe.
    pub fn poll_spawned(&mut self, cx: &mut Context<'_>) -> Poll<Batch> {
        let Some(spawning) = self.spawning.as_mut() else {
            return Poll::Pending;
        };
        let done = std::task::ready!(Pin::new(spawning).poll(cx));
        self.spawning = None;
        Poll::Ready(done.unwrap_or_else(|err| {
            warn!(event = "keeper_failed", reason = %err, "cannot start keepers ahead of time; the commands start under fresh ones");
            Vec::new()
        }))
    }

    /// Keeps the keepers of a batch that is done.
    pub fn park(&mut self, batch: Batch) {
        for (item, command, parked) in batch {
            match parked {
                Ok(parked) => {
                    debug!(
                        event = "keeper_parked",
                        item,
                        pid = parked.pid().as_raw(),
                        "started a keeper for the job's next occurrence"
                    );
                    self.parked.insert(item, (command, parked));
                }
                Err(err) => {
                    warn!(event = "keeper_failed", item, reason = %err, "cannot start a keeper ahead of time; the command starts under a fresh one");
                }
            }
        }
    }

    /// Starts the keeper of the session's membership, to hold `lent` (the holder's sockets
    /// with the membership's farewell), if any of them has a farewell to say. Without one the
    /// replica goes on as before: a crash is found by the others' next check.
    pub fn keep_membership(&mut self, lent: &[Lent]) {
        if lent.iter().all(|lent| lent.farewell.is_none()) {
            return;
        }
        match Parked::spawn_membership().and_then(|parked| parked.into_membership(lent)) {
            Ok(keeper) => self.membership = Some(keeper),
            Err(err) => {
                warn!(event = "keeper_failed", reason = %err, "cannot start the keeper of this replica's membership; if pgleader dies, the others take its jobs at their next check");
            }
        }
    }

    /// What each command's keeper holds beside the session's sockets: its copy of the channel
    /// to the membership's keeper, which waits for it (see [`MembershipKeeper::lent`]).
    pub fn membership_lent(&self) -> Option<Lent> {
        self.membership.as_ref().map(MembershipKeeper::lent)
    }

    /// The keeper parked for `item`, if it was started for `command` and still waits.
    pub fn take(&mut self, item: u32, command: &CommandLine) -> Option<Parked> {
        let (parked_for, parked) = self.parked.remove(&item)?;
        Some(parked).filter(|parked| &parked_for == command && parked.is_waiting())
    }

    /// Lets every keeper go (each exits on the end of its channel, the membership's on being
    /// dismissed) and waits a moment for them, so that pgleader leaves none behind: the session
    /// that owned their jobs is over.
    pub async fn dismiss(&mut self) {
        if let Some(spawning) = self.spawning.take()
            && let Ok(batch) = spawning.await
        {
            self.park(batch);
        }
        self.tried_for.clear();
        let mut pids: Vec<_> = std::mem::take(&mut self.parked)
            .into_values()
            .map(|(_, parked)| parked.pid())
            .collect();
        pids.append(&mut self.let_go);
        pids.extend(self.membership.take().map(MembershipKeeper::dismiss));
        await_let_go(pids, Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    #[test]
    fn jobs_falling_due_together_get_their_keepers_earlier() {
        let command = CommandLine::resolve(vec!["true".into()], Some(OsStr::new("/bin:/usr/bin")))
            .expect("true is in /bin");
        let at = Instant::now() + Duration::from_secs(1);
        // Far enough ahead that none is started yet: only when the first will want one.
        let wants_at = |jobs: u32| {
            let mut parking = Parking::default();
            let owned = (0..jobs).map(|item| (item, Some((at, &command)))).collect();
            parking.plan(owned, &Hooks::default())
        };
        assert_eq!(wants_at(1), Some(at - AHEAD - EACH));
        assert_eq!(wants_at(100), Some(at - AHEAD - EACH * 100));
        // Those due later than TOGETHER do not count.
        let mut parking = Parking::default();
        let later = at + TOGETHER;
        let owned = (0..100)
            .map(|item| (item, Some((if item == 0 { at } else { later }, &command))))
            .collect();
        assert_eq!(
            parking.plan(owned, &Hooks::default()),
            Some(at - AHEAD - EACH)
        );
    }
}
