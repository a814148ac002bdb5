//! The catch-up planning of a leadership's runs: which occurrence runs when a leadership begins
//! or an occurrence comes due late, and how the ones passed over are recorded. A leader may win
//! the lock, or wake from a restart fence, `--takeover-delay` or a stall, after occurrences it
//! could not run: the most recent one runs when it may (within `--catch-up`), the others are
//! recorded as `missed` (or it as `skipped`, beside a run still going), never dropped in
//! silence. It sits under `runs.rs` because it decides from the runs' own state (the queue of
//! ledger statements, the due occurrence, the run going on), which that file keeps to itself.

use std::fmt::Write as _;
use std::time::Duration;

use jiff::Timestamp;
use tracing::{debug, info, warn};

use super::{MOST_AT_ONCE, Runs, RunsEvent, Step};
use crate::election::ledger::Ledger;
use crate::schedule::calendar::rfc3339;
use crate::schedule::crontab::Overlap;
use crate::schedule::{EARLY_WINDOW, foreign_ledger_blocks_catch_up};
use crate::time::for_people;

/// Passed-over occurrences listed one by one in a log line; beyond, only the range.
const LISTED: usize = 10;

/// How many passed-over occurrences are counted at most.
const COUNTED: usize = 10_000;

impl<L: Ledger> Runs<L> {
    /// What a new leadership does first: catch up the latest occurrence if it may, or record
    /// it as missed, and record the ones passed over since the ledger's `newest`; then wait for
    /// the next one (a timer: only its own).
    pub(super) fn plan_first(&mut self, newest: Option<Timestamp>) {
        let now = self.clock.now();
        let schedule = self.schedule();
        let latest = schedule.latest_at_or_before(now);
        let next = schedule.next_after(now);
        // From the start jitter= puts the occurrence off to: one whose start has not come is
        // not late, whoever takes the job over meanwhile.
        let plan = self.plan.clone();
        let age = |at: Timestamp| {
            crate::time::elapsed(at.checked_add(plan.delay_of(at)).unwrap_or(at), now)
        };
        let catch_up = self.plan.catch_up;
        if self.plan.once
            && let Some(next) = next
        {
            let ahead = crate::time::elapsed(now, next);
            let half_gap = latest
                .and_then(|latest| Duration::try_from(next.duration_since(latest)).ok())
                .or_else(|| schedule.gap_after(next))
                .map_or(EARLY_WINDOW, |gap| gap / 2);
            let nearer = latest.is_none_or(|latest| ahead < age(latest));
            if ahead <= EARLY_WINDOW.min(half_gap) && nearer {
                info!(event = "waiting_for_occurrence", job = self.plan.job.as_deref(), occurrence = %rfc3339(next), "waiting {} for the occurrence of {} on the server's clock", for_people(ahead), rfc3339(next));
                self.due = Some(next);
                return;
            }
        }
        // The occurrences between the ledger's newest row and the latest one came while no
        // leader could run them.
        if let (Some(newest), Some(latest)) = (newest, latest)
            && let Some(first) = schedule.next_after(newest)
        {
            let passed = self.between(first, latest);
            self.record_passed_over(
                &passed,
                latest,
                "while no leader could run them; only the most recent one, if it is within --catch-up,",
            );
        }
        let blocked = foreign_ledger_blocks_catch_up(self.foreign_ledger_seen, catch_up);
        match latest {
            // A definition the ledger never recorded (a crontab job added or rescheduled)
            // starts from its next occurrence, as cron's do.
            Some(latest) if newest.is_none() && !self.plan.catch_up_new => {
                debug!(event = "first_leader", job = self.plan.job.as_deref(), occurrence = %rfc3339(latest), "the latest occurrence, {}, came before this definition was known: starting from the next", rfc3339(latest));
                self.due = if self.plan.once { None } else { next };
            }
            Some(latest) if blocked => {
                warn!(event = "no_catch_up", job = self.plan.job.as_deref(), occurrence = %rfc3339(latest), "not catching up the occurrence of {}: a replica that records this lock's runs in another ledger table was seen lately and may have run it", rfc3339(latest));
                self.due = if self.plan.once { None } else { next };
            }
            Some(latest) if age(latest) <= catch_up => {
                self.probing = !self.plan.once;
                self.due = Some(latest);
            }
            // The ledger has nothing of this lock yet: the fleet never ran it, so nothing was
            // missed. (A schedule deployed at noon does not report the night's occurrence.)
            Some(latest) if newest.is_none() => {
                debug!(event = "first_leader", job = self.plan.job.as_deref(), occurrence = %rfc3339(latest), "the latest occurrence, {}, came before this schedule ever ran and is older than --catch-up", rfc3339(latest));
                self.due = if self.plan.once { None } else { next };
            }
            Some(latest) => {
                self.record_missed(latest, age(latest));
                self.due = if self.plan.once { None } else { next };
            }
            None => self.due = if self.plan.once { None } else { next },
        }
        if self.plan.once && self.due.is_none() {
            info!(
                event = "nothing_due",
                job = self.plan.job.as_deref(),
                "no occurrence is due for this timer"
            );
            self.closing = Some(RunsEvent::NothingToRun);
        } else if let Some(at) = self.due {
            debug!(event = "next_occurrence", job = self.plan.job.as_deref(), occurrence = %rfc3339(at), "next occurrence: {}", rfc3339(at));
        }
    }

    pub(super) fn on_due(&mut self, at: Timestamp) {
        self.due = None;
        let now = self.clock.now();
        // Held back (the restart fence, --takeover-delay) or stalled, this leader may wake
        // after newer occurrences: the most recent one is the one to run.
        let latest = self
            .schedule()
            .latest_at_or_before(now)
            .map_or(at, |latest| latest.max(at));
        let passed = self.between(at, latest);
        if self.running.is_some()
            && self.plan.overlap == Overlap::Allow
            && self.aside.len() + 1 < MOST_AT_ONCE
        {
            // The run still going goes on aside, and this occurrence is claimed beside it.
            self.aside.extend(self.running.take());
        }
        if self.running.is_some() && self.plan.overlap == Overlap::Replace {
            // Once the run is gone (`exited`), this occurrence is claimed as any other.
            self.due = Some(at);
            self.replacing = Some(latest);
            self.ask = Some(RunsEvent::Replace {
                occurrence: latest,
                asked: false,
            });
            return;
        }
        if let Some(run) = self.running {
            let mut detail = format!("{} was still going", run.describe());
            if !passed.is_empty() {
                let _ = write!(detail, " (and {})", describe(&passed, "before it"));
            }
            self.queue.push_back(Step::Record {
                at: latest,
                outcome: "skipped",
                detail,
            });
            self.due = self.schedule().next_after(now);
            return;
        }
        self.record_passed_over(
            &passed,
            latest,
            "while this leader could not start yet; only the most recent one",
        );
        // Woken for an earlier occurrence, the most recent one still waits for the start
        // jitter= puts it off to.
        if latest != at && self.start_of(latest) > now {
            self.due = Some(latest);
            return;
        }
        let age = crate::time::elapsed(self.start_of(latest), now);
        if age > self.plan.catch_up && !passed.is_empty() {
            self.record_missed(latest, age);
            self.due = self.schedule().next_after(now);
            return;
        }
        self.queue.push_back(Step::Claim(latest));
    }

    /// When the occurrence of `at` starts: `jitter=` puts it off, the same on every replica.
    pub(super) fn start_of(&self, at: Timestamp) -> Timestamp {
        at.checked_add(self.plan.delay_of(at)).unwrap_or(at)
    }

    /// The occurrences from `from` (included) to `to` (excluded), at most [`COUNTED`].
    fn between(&self, from: Timestamp, to: Timestamp) -> Vec<Timestamp> {
        let mut found = Vec::new();
        let mut at = Some(from);
        while let Some(occurrence) = at.filter(|at| *at < to) {
            if found.len() >= COUNTED {
                break;
            }
            found.push(occurrence);
            at = self.schedule().next_after(occurrence);
        }
        found
    }

    /// Records occurrences passed over on the way to `latest` as one `missed` row (the last of
    /// them) that says how many there were.
    fn record_passed_over(&mut self, passed: &[Timestamp], latest: Timestamp, why: &str) {
        if let Some(&last) = passed.last() {
            self.queue.push_back(Step::Record {
                at: last,
                outcome: "missed",
                detail: format!(
                    "{} {why}, {}, runs",
                    describe(passed, "came"),
                    rfc3339(latest)
                ),
            });
        }
    }

    fn record_missed(&mut self, at: Timestamp, age: Duration) {
        self.queue.push_back(Step::Record {
            at,
            outcome: "missed",
            detail: format!(
                "no leader could run it until {} later, more than --catch-up {}",
                for_people(age),
                for_people(self.plan.catch_up)
            ),
        });
    }
}

/// "3 occurrences (2026-11-22T03:00:00Z, ...) came", or a range beyond [`LISTED`].
fn describe(passed: &[Timestamp], verb: &str) -> String {
    let n = passed.len();
    let plural = if n == 1 { "occurrence" } else { "occurrences" };
    let count = if n >= COUNTED {
        format!("{n} or more")
    } else {
        n.to_string()
    };
    if n <= LISTED {
        let list: Vec<String> = passed.iter().copied().map(rfc3339).collect();
        format!("{count} {plural} ({}) {verb}", list.join(", "))
    } else {
        format!(
            "{count} {plural} from {} to {} {verb}",
            rfc3339(passed[0]),
            rfc3339(passed[n - 1])
        )
    }
}
