//! Whether the replicas of a lock agree on its schedule, and what a leader does when they do
//! not.
//!
//! Two definitions of one lock's schedule (another expression, another time zone) would run
//! the job at the union of their occurrences: twice a night, say. That is a configuration
//! error, and pgleader must not run both versions. The evidence it has:
//!
//! - the ledger's newest row, which says which definition ran last: the *established* one;
//! - the sessions that hold or wait for the lock right now: each scheduled pgleader puts the
//!   fingerprint of its definition, and of the ledger it records runs in, in its session's name
//!   (`pgleader#1a2b3c4d5e6f7a8b:<pid>@<host>`: schedule, then ledger; see
//!   `election/participant.rs`), which the ledger's `participants` reads.
//!
//! The rules, applied by a leader before it claims an occurrence:
//!
//! 1. Its definition is the established one (or there is none yet): it runs, and warns about
//!    any live replica with another definition.
//! 2. Otherwise, if a live replica announces the established definition, the two disagree:
//!    it does not run (a service hands the lock over so that a replica with the established
//!    definition leads; a timer exits 1) and says so.
//! 3. Otherwise the established definition's replicas are gone, as after a rolling update,
//!    and this one takes over: unless it is a timer (`--once`) with no live replica to vouch
//!    for the fleet, in which case the established definition still counts as in use when
//!    its own latest occurrence was run; timers of the old definition could fire again.
//!
//! [`judge`] and [`settle`] apply the rules to the evidence; [`agree`] gathers it on the
//! leader's session, as a leadership begins and before each claim, and `runs.rs` acts on what
//! it found.

use std::fmt::Write as _;

use crate::election::ledger::{Entry, Ledger, LedgerError};
use crate::election::participant::Participant;
use crate::schedule::calendar::{Schedule, fingerprint_of};
use crate::schedule::clock::ServerClock;

/// The live replicas that record this lock's runs in another ledger table than `own` (a
/// table fingerprint): a configuration error, which would let an occurrence run once in each.
pub fn foreign_ledgers<'a>(live: &'a [Participant], own: &str) -> Vec<&'a Participant> {
    live.iter()
        .filter(|p| p.ledger_fingerprint().is_some_and(|fp| fp != own))
        .collect()
}

/// What the evidence says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Run. `warning` names live replicas with another definition, if any.
    Agree { warning: Option<String> },
    /// Run, and from now on this definition is the established one; the text says what
    /// changed.
    Adopt { change: String },
    /// Do not run: the text says who disagrees with whom.
    Disagree { reason: String },
    /// The established definition differs and no live replica speaks for or against it: it
    /// is still in use if its own latest occurrence has a row. The caller looks that up and
    /// calls [`settle`].
    Undecided { established: (String, String) },
}

/// Applies the rules to what the ledger and `pg_locks` show. `once` is true for a timer.
pub fn judge(
    expression: &str,
    timezone: &str,
    newest: Option<&Entry>,
    live: &[Participant],
    once: bool,
) -> Verdict {
    let own = fingerprint_of(expression, timezone);
    let others: Vec<&Participant> = live
        .iter()
        .filter(|p| p.fingerprint().is_some_and(|fp| fp != own))
        .collect();
    let Some(newest) = newest.filter(|n| n.schedule != expression || n.timezone != timezone) else {
        let warning = (!others.is_empty()).then(|| {
            let mut text = String::from("replicas with another schedule wait for this lock: ");
            text.push_str(&list(&others));
            text.push_str(
                "; they will not run it while this definition is established. Give every replica the same --schedule and --schedule-timezone",
            );
            text
        });
        return Verdict::Agree { warning };
    };
    let established = fingerprint_of(&newest.schedule, &newest.timezone);
    let holders: Vec<&Participant> = live
        .iter()
        .filter(|p| p.fingerprint() == Some(established.as_str()))
        .collect();
    let definition = format!("\"{}\" ({})", newest.schedule, newest.timezone);
    let mine = format!("\"{expression}\" ({timezone})");
    if !holders.is_empty() {
        return Verdict::Disagree {
            reason: format!(
                "this replica's schedule {mine} differs from {definition}, which the lock's last run used and which {} still announce(s); not running this version. Give every replica the same --schedule and --schedule-timezone",
                list(&holders)
            ),
        };
    }
    let fleet_present = live.iter().any(|p| p.fingerprint().is_some());
    if once && !fleet_present {
        return Verdict::Undecided {
            established: (newest.schedule.clone(), newest.timezone.clone()),
        };
    }
    Verdict::Adopt {
        change: format!(
            "the schedule changed from {definition} to {mine}: no replica with the old one is left"
        ),
    }
}

/// Settles an [`Verdict::Undecided`]: `still_used` is whether the established definition's
/// own latest occurrence has a row.
pub fn settle(
    expression: &str,
    timezone: &str,
    established: &(String, String),
    still_used: bool,
) -> Verdict {
    let definition = format!("\"{}\" ({})", established.0, established.1);
    let mine = format!("\"{expression}\" ({timezone})");
    if still_used {
        Verdict::Disagree {
            reason: format!(
                "this replica's schedule {mine} differs from {definition}, which ran at its own latest occurrence; another host's timer still uses it. Not running this version. Give every replica the same --schedule and --schedule-timezone (a schedule changed on purpose takes over once no replica runs the old one)"
            ),
        }
    } else {
        Verdict::Adopt {
            change: format!(
                "the schedule changed from {definition} to {mine}: the old one no longer runs"
            ),
        }
    }
}

/// What the agreement check found: the verdict, and whether a live replica records the lock's
/// runs in another ledger table.
#[derive(Debug)]
pub struct Agreement {
    pub verdict: Verdict,
    pub foreign_ledger: Option<String>,
}

impl Agreement {
    /// Nothing to say: what a check already made found still holds.
    pub fn settled() -> Agreement {
        Agreement {
            verdict: Verdict::Agree { warning: None },
            foreign_ledger: None,
        }
    }
}

/// Checks the replicas' agreement on the schedule, and on the ledger table, on the leader's
/// session.
pub async fn agree<L: Ledger>(
    ledger: &L,
    schedule: &Schedule,
    clock: &ServerClock,
    once: bool,
    own_ledger: &str,
) -> Result<Agreement, LedgerError> {
    let newest = ledger.recent(1).await?.into_iter().next();
    let live = ledger.participants().await?;
    let foreign: Vec<String> = foreign_ledgers(&live, own_ledger)
        .iter()
        .map(|p| p.describe_briefly())
        .collect();
    let foreign_ledger = (!foreign.is_empty()).then(|| {
        format!(
            "{} record(s) this lock's runs in another ledger table; an occurrence could run once in each. Give every replica the same --ledger-table (and the same search_path)",
            foreign.join(", ")
        )
    });
    let verdict = judge(
        schedule.expression(),
        schedule.timezone(),
        newest.as_ref(),
        &live,
        once,
    );
    let verdict = match &verdict {
        Verdict::Undecided { established } => {
            let still_used = match Schedule::parse(&established.0, &established.1) {
                Ok(old) => match old.latest_at_or_before(clock.now()) {
                    Some(at) => ledger.has(at).await?,
                    None => false,
                },
                // A definition this version cannot read is not one any replica of it runs.
                Err(_) => false,
            };
            settle(
                schedule.expression(),
                schedule.timezone(),
                established,
                still_used,
            )
        }
        _ => verdict,
    };
    Ok(Agreement {
        verdict,
        foreign_ledger,
    })
}

fn list(participants: &[&Participant]) -> String {
    let mut text = String::new();
    for (i, p) in participants.iter().enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        let _ = write!(text, "{}", p.describe_briefly());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::Timestamp;

    const EXPR: &str = "0 0 3 * * *";

    fn row(schedule: &str, timezone: &str) -> Entry {
        Entry {
            scheduled_for: Timestamp::now(),
            outcome: "succeeded".into(),
            exit_code: Some(0),
            attempt: 1,
            claimed_at: Timestamp::now(),
            ended_at: None,
            host: None,
            pid: None,
            backend_pid: None,
            epoch: None,
            detail: None,
            schedule: schedule.into(),
            timezone: timezone.into(),
            output: None,
        }
    }

    fn replica(schedule: &str, timezone: &str, pid: i32) -> Participant {
        Participant {
            application_name: Some(format!(
                "pgleader#{}:{pid}@host-{pid}",
                fingerprint_of(schedule, timezone)
            )),
            backend_pid: pid,
            ..Participant::default()
        }
    }

    #[test]
    fn the_established_definition_runs_and_warns_about_others() {
        assert_eq!(
            judge(EXPR, "UTC", None, &[], false),
            Verdict::Agree { warning: None }
        );
        let verdict = judge(
            EXPR,
            "UTC",
            Some(&row(EXPR, "UTC")),
            &[replica(EXPR, "Europe/Paris", 7)],
            false,
        );
        assert!(
            matches!(&verdict, Verdict::Agree { warning: Some(w) } if w.contains("backend pid 7")),
            "{verdict:?}"
        );
    }

    #[test]
    fn a_live_replica_with_the_established_definition_wins() {
        let verdict = judge(
            EXPR,
            "UTC",
            Some(&row(EXPR, "Europe/Paris")),
            &[replica(EXPR, "Europe/Paris", 9)],
            false,
        );
        assert!(
            matches!(&verdict, Verdict::Disagree { reason } if reason.contains("Europe/Paris") && reason.contains("backend pid 9")),
            "{verdict:?}"
        );
    }

    #[test]
    fn a_definition_nobody_runs_any_more_is_replaced() {
        let service = judge(EXPR, "UTC", Some(&row(EXPR, "Europe/Paris")), &[], false);
        assert!(matches!(service, Verdict::Adopt { .. }), "{service:?}");
        let fleet = [replica(EXPR, "UTC", 3)];
        let timer_with_fleet = judge(EXPR, "UTC", Some(&row(EXPR, "Europe/Paris")), &fleet, true);
        assert!(matches!(timer_with_fleet, Verdict::Adopt { .. }));
        let timer = judge(EXPR, "UTC", Some(&row(EXPR, "Europe/Paris")), &[], true);
        assert!(matches!(timer, Verdict::Undecided { .. }), "{timer:?}");
        let established = (EXPR.to_owned(), "Europe/Paris".to_owned());
        assert!(matches!(
            settle(EXPR, "UTC", &established, true),
            Verdict::Disagree { .. }
        ));
        assert!(matches!(
            settle(EXPR, "UTC", &established, false),
            Verdict::Adopt { .. }
        ));
    }
}
