//! `pgleader status` of a crontab fleet (`pgleader cron`): each job with its owner, its next
//! occurrence and its last outcome, with no crontab file at hand.
//!
//! The jobs come from two places that `status` can read: the ledger, where each job's rows
//! carry its name (and the schedule and zone it ran under, from which the next occurrence is
//! computed on the server's clock), and the server's locks, where the replica that owns a job
//! holds the lock of its number ([`item_of`] its name). A job held but not yet in the ledger
//! (it never ran) shows by its number. Each replica also says, by the job's number, how its
//! file defines the job (a hash of its schedule, command and options, see
//! `CronJob::definition_marker`): a job that replicas define otherwise (a rolling deploy half
//! done) shows each definition with the replicas that hold it. Apart from `status.rs` because
//! a crontab joins the two sources by name, where a sharded lock only lists numbers.

use std::fmt::Write as _;

use jiff::Timestamp;
use serde_json::{Value, json};

use crate::election::ledger::JobEntry;
use crate::election::participant::{Participant, ShardsView};
use crate::schedule::calendar::{self, Schedule};
use crate::schedule::crontab::{definition_hex, item_of};

/// A crontab fleet's jobs, as `status` shows them.
#[derive(Clone, Debug, PartialEq)]
pub struct JobsReport {
    /// The server's clock when it was read: the next occurrences are after it.
    pub now: Timestamp,
    pub jobs: Vec<JobStatus>,
}

/// A job as `status --watch` compares it: its number, its owner's session, its newest run, and
/// how many definitions the replicas hold of it.
pub type JobChange = (u32, Option<i32>, Option<(Timestamp, String)>, usize);

/// One job: known by its name from the ledger, or only by its number from the locks.
#[derive(Clone, Debug, PartialEq)]
pub struct JobStatus {
    pub name: Option<String>,
    pub item: u32,
    pub owner: Option<Participant>,
    pub entry: Option<JobEntry>,
    /// Each definition the replicas that know the job hold of it, with those replicas (their
    /// member ids and sessions): more than one while their files differ.
    pub definitions: Vec<(u32, Vec<(i32, Participant)>)>,
    /// Who paused it, and when (`pgleader cron pause`), while it is paused.
    pub paused: Option<String>,
}

impl JobsReport {
    /// Joins the ledger's jobs (`ledger`) with who holds which job number (`shards`).
    pub fn new(now: Timestamp, ledger: Vec<JobEntry>, shards: &ShardsView) -> JobsReport {
        let owner = |item: u32| shards.holder_of(item).map(|r| r.participant.clone());
        let definitions = |item: u32| {
            let mut found: Vec<(u32, Vec<(i32, Participant)>)> = Vec::new();
            for replica in &shards.replicas {
                let Some(&definition) = replica.defines.get(&item) else {
                    continue;
                };
                let holder = (replica.member, replica.participant.clone());
                match found.iter_mut().find(|(known, _)| *known == definition) {
                    Some((_, holders)) => holders.push(holder),
                    None => found.push((definition, vec![holder])),
                }
            }
            found.sort_by_key(|(definition, _)| *definition);
            found
        };
        let mut jobs: Vec<JobStatus> = ledger
            .into_iter()
            .map(|entry| {
                let item = item_of(&entry.name);
                JobStatus {
                    name: Some(entry.name.clone()),
                    item,
                    owner: owner(item),
                    entry: Some(entry),
                    definitions: definitions(item),
                    paused: None,
                }
            })
            .collect();
        let mut held: Vec<u32> = shards
            .replicas
            .iter()
            .flat_map(|replica| replica.holds.iter().copied())
            .filter(|item| !jobs.iter().any(|job| job.item == *item))
            .collect();
        held.sort_unstable();
        jobs.extend(held.into_iter().map(|item| JobStatus {
            name: None,
            item,
            owner: owner(item),
            entry: None,
            definitions: definitions(item),
            paused: None,
        }));
        JobsReport { now, jobs }
    }

    /// The report with the fleet's pauses (by job name, `*` for every job) on its jobs.
    pub fn with_pauses(mut self, paused: &[(String, String)]) -> JobsReport {
        let every = paused
            .iter()
            .find(|(job, _)| job == crate::operate::pause::EVERY_JOB);
        for job in &mut self.jobs {
            let own = paused
                .iter()
                .find(|(name, _)| Some(name) == job.name.as_ref());
            job.paused = own.or(every).map(|(_, detail)| detail.clone());
        }
        self
    }

    /// How many jobs nobody owns.
    fn unowned(&self) -> usize {
        self.jobs.iter().filter(|job| job.owner.is_none()).count()
    }

    /// How many jobs the replicas define otherwise.
    fn defined_otherwise(&self) -> usize {
        self.jobs
            .iter()
            .filter(|job| job.is_defined_otherwise())
            .count()
    }

    /// What `status --watch` compares: each job's owner, newest run and definitions.
    pub fn changes(&self) -> Vec<JobChange> {
        self.jobs
            .iter()
            .map(|job| {
                let newest = job
                    .entry
                    .as_ref()
                    .map(|entry| (entry.newest.scheduled_for, entry.newest.outcome.clone()));
                let owner = job.owner.as_ref().map(|o| o.backend_pid);
                (job.item, owner, newest, job.definitions.len())
            })
            .collect()
    }

    /// The jobs on one line, for `status --watch`: each with its owner and newest outcome.
    pub fn to_line(&self) -> String {
        let jobs: Vec<String> = self
            .jobs
            .iter()
            .map(|job| {
                let name = job.name.clone().unwrap_or_else(|| format!("#{}", job.item));
                let owner = job
                    .owner
                    .as_ref()
                    .map_or_else(|| "nobody".to_owned(), Participant::short);
                let last = job.entry.as_ref().map_or_else(
                    || "never ran".to_owned(),
                    |entry| {
                        format!(
                            "{} {}",
                            entry.newest.outcome,
                            calendar::rfc3339(entry.newest.scheduled_for)
                        )
                    },
                );
                let otherwise = match job.definitions.len() {
                    0 | 1 => String::new(),
                    n => format!(", defined {n} ways"),
                };
                format!("{name} {owner}, {last}{otherwise}")
            })
            .collect();
        format!("crontab of {} jobs: {}", self.jobs.len(), jobs.join("; "))
    }

    /// `status` of a crontab fleet: the replicas and their job counts, then a line per job.
    pub fn write_text(&self, text: &mut String, label: &str, shards: &ShardsView) {
        let replicas = shards.replicas.len();
        let unowned = self.unowned();
        let _ = writeln!(
            text,
            "lock {label}: crontab of {} job{} on {replicas} replica{}, {}",
            self.jobs.len(),
            plural(self.jobs.len()),
            plural(replicas),
            if unowned == 0 {
                "every job owned".to_owned()
            } else {
                format!("{unowned} owned by nobody")
            }
        );
        let otherwise = self.defined_otherwise();
        if otherwise > 0 {
            let _ = writeln!(
                text,
                "  {otherwise} job{} defined otherwise by some replicas (their crontabs differ: a \
                 rolling deploy?); each runs under its owner's definition",
                plural(otherwise)
            );
        }
        for replica in &shards.replicas {
            let count = replica.holds.len();
            let _ = writeln!(
                text,
                "  replica: {}: {count} job{}",
                replica.participant.describe(),
                plural(count)
            );
        }
        for job in &self.jobs {
            let _ = writeln!(text, "  {}", self.job_line(job));
        }
    }

    /// One job on one line: `job backup: owner pgleader 45@web-1 (backend 123) from 10.0.0.5;
    /// next 2026-11-27T03:00:00Z; last succeeded (exit 0) at ... for the occurrence of ...`.
    fn job_line(&self, job: &JobStatus) -> String {
        let name = job
            .name
            .clone()
            .unwrap_or_else(|| format!("#{} (not in the ledger yet)", job.item));
        let owner = match &job.owner {
            Some(owner) => format!("owner {}", owner_text(owner)),
            None => "owned by nobody".to_owned(),
        };
        let mut line = format!("job {name}: {owner}");
        if let Some(next) = job.next_occurrence(self.now) {
            let _ = write!(line, "; next {}", calendar::rfc3339(next));
        }
        match &job.entry {
            Some(entry) => {
                let run = &entry.newest;
                let host = run.host.as_deref().unwrap_or("an unknown host");
                if run.outcome == "running" {
                    let _ = write!(
                        line,
                        "; running since {} on {host} (the occurrence of {})",
                        calendar::rfc3339(run.claimed_at),
                        calendar::rfc3339(run.scheduled_for)
                    );
                } else {
                    let exit = run
                        .exit_code
                        .map(|code| format!(" (exit {code})"))
                        .unwrap_or_default();
                    let at = run.ended_at.unwrap_or(run.claimed_at);
                    let _ = write!(
                        line,
                        "; last {}{exit} at {} on {host} (the occurrence of {})",
                        run.outcome,
                        calendar::rfc3339(at),
                        calendar::rfc3339(run.scheduled_for)
                    );
                }
            }
            None => line.push_str("; never ran"),
        }
        if let Some(paused) = &job.paused {
            let _ = write!(line, "; PAUSED ({paused})");
        }
        if job.is_defined_otherwise() {
            let ways: Vec<String> = job
                .definitions
                .iter()
                .map(|(definition, replicas)| {
                    let replicas: Vec<String> = replicas
                        .iter()
                        .map(|(_, replica)| replica.short())
                        .collect();
                    format!("{} by {}", definition_hex(*definition), replicas.join(", "))
                })
                .collect();
            let _ = write!(
                line,
                "; defined {} ways: {}",
                job.definitions.len(),
                ways.join("; ")
            );
        }
        line
    }

    pub fn to_json(&self, participant_json: impl Fn(&Participant) -> Value) -> Value {
        json!({
            "now": calendar::rfc3339(self.now),
            "unowned": self.unowned(),
            "defined_otherwise": self.defined_otherwise(),
            "jobs": self.jobs.iter().map(|job| {
                let entry = job.entry.as_ref();
                let run = entry.map(|entry| &entry.newest);
                json!({
                    "name": job.name,
                    "number": job.item,
                    "owner": job.owner.as_ref().map(&participant_json),
                    "owner_client_address": job.owner.as_ref().and_then(|o| o.client_address.clone()),
                    "schedule": run.map(|run| &run.schedule),
                    "timezone": run.map(|run| &run.timezone),
                    "next_occurrence": job.next_occurrence(self.now).map(calendar::rfc3339),
                    "last_run": run.map(|run| json!({
                        "scheduled_for": calendar::rfc3339(run.scheduled_for),
                        "outcome": run.outcome,
                        "exit_code": run.exit_code,
                        "attempt": run.attempt,
                        "claimed_at": calendar::rfc3339(run.claimed_at),
                        "ended_at": run.ended_at.map(calendar::rfc3339),
                        "host": run.host,
                        "pid": run.pid,
                        "detail": run.detail,
                    })),
                    "last_success": entry.and_then(|entry| entry.last_success).map(calendar::rfc3339),
                    "defined_otherwise": job.is_defined_otherwise(),
                    "paused": job.paused,
                    "definitions": job.definitions.iter().map(|(definition, replicas)| json!({
                        "definition": definition_hex(*definition),
                        "members": replicas.iter().map(|(member, _)| *member).collect::<Vec<_>>(),
                    })).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>(),
        })
    }
}

impl JobStatus {
    /// Whether the replicas that know it hold more than one definition of it.
    fn is_defined_otherwise(&self) -> bool {
        self.definitions.len() > 1
    }

    /// The next occurrence after `now` under the schedule and zone its newest run recorded.
    fn next_occurrence(&self, now: Timestamp) -> Option<Timestamp> {
        let run = &self.entry.as_ref()?.newest;
        Schedule::recorded(&run.schedule, &run.timezone)
            .ok()?
            .next_after(now)
    }
}

/// The owner: `pgleader 45@web-1 (backend 123) from 10.0.0.5`.
fn owner_text(owner: &Participant) -> String {
    match &owner.client_address {
        Some(address) => format!("{} from {address}", owner.short()),
        None => owner.short(),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::election::ledger::Entry;
    use crate::election::participant::ShardReplica;

    fn at(text: &str) -> Timestamp {
        text.parse().expect("time")
    }

    #[test]
    fn each_job_shows_its_owner_next_occurrence_and_last_outcome() {
        let entry = |name: &str, outcome: &str| JobEntry {
            name: name.to_owned(),
            newest: Entry {
                scheduled_for: at("2027-01-10T03:00:00Z"),
                outcome: outcome.to_owned(),
                exit_code: (outcome == "failed").then_some(3),
                attempt: 1,
                claimed_at: at("2027-01-10T03:00:00.004Z"),
                ended_at: Some(at("2027-01-10T03:00:02Z")),
                host: Some("web-1".to_owned()),
                pid: Some(45),
                backend_pid: Some(123),
                epoch: Some(7),
                detail: None,
                schedule: "0 0 3 * * *".to_owned(),
                timezone: "UTC".to_owned(),
                output: None,
            },
            last_success: None,
        };
        let shards = ShardsView {
            count: 0,
            replicas: vec![ShardReplica {
                member: 123,
                participant: Participant {
                    backend_pid: 123,
                    granted: true,
                    application_name: Some("pgleader:45@web-1".to_owned()),
                    client_address: Some("10.0.0.5".to_owned()),
                    ..Participant::default()
                },
                cap: None,
                holds: vec![item_of("backup"), 17],
                defines: Default::default(),
            }],
        };
        let report = JobsReport::new(
            at("2027-01-10T12:00:00Z"),
            vec![entry("backup", "succeeded"), entry("report", "failed")],
            &shards,
        );
        let mut text = String::new();
        report.write_text(&mut text, "\"app-cron\"", &shards);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "lock \"app-cron\": crontab of 3 jobs on 1 replica, 1 owned by nobody"
        );
        assert!(lines[1].ends_with(": 2 jobs"), "{text}");
        assert_eq!(
            lines[2],
            "  job backup: owner pgleader 45@web-1 (backend 123) from 10.0.0.5; next \
             2027-01-11T03:00:00Z; last succeeded at 2027-01-10T03:00:02Z on web-1 (the \
             occurrence of 2027-01-10T03:00:00Z)"
        );
        assert!(
            lines[3].starts_with(
                "  job report: owned by nobody; next 2027-01-11T03:00:00Z; last failed (exit 3)"
            ),
            "{text}"
        );
        assert_eq!(
            lines[4],
            "  job #17 (not in the ledger yet): owner pgleader 45@web-1 (backend 123) from \
             10.0.0.5; never ran"
        );
        let json = report.to_json(|p| json!(p.backend_pid));
        assert_eq!(json["jobs"][0]["owner"], 123);
        assert_eq!(json["jobs"][1]["last_run"]["outcome"], "failed");
        assert_eq!(json["jobs"][0]["next_occurrence"], "2027-01-11T03:00:00Z");
    }

    #[test]
    fn a_job_defined_otherwise_shows_each_definition_and_its_replicas() {
        let (backup, report) = (item_of("backup"), item_of("report"));
        let replica = |pid: i32, holds: Vec<u32>, backup_defined: u32| ShardReplica {
            defines: [(backup, backup_defined), (report, 9)].into(),
            ..crate::operate::status::tests::replica(pid, holds)
        };
        let shards = ShardsView {
            count: 0,
            replicas: vec![
                replica(1, vec![backup], 0x1a2b3c4d),
                replica(2, vec![report], 0x0000abcd),
            ],
        };
        let report_of =
            |shards: &ShardsView| JobsReport::new(at("2027-01-10T12:00:00Z"), Vec::new(), shards);
        let seen = report_of(&shards);
        let mut text = String::new();
        seen.write_text(&mut text, "\"app-cron\"", &shards);
        assert!(
            text.contains("\n  1 job defined otherwise by some replicas"),
            "{text}"
        );
        assert!(
            text.contains(
                "; defined 2 ways: 0000abcd by pgleader 1002@web-2 (backend 2); 1a2b3c4d by \
                 pgleader 1001@web-1 (backend 1)\n"
            ),
            "{text}"
        );
        assert!(
            seen.to_line().contains(", defined 2 ways"),
            "{}",
            seen.to_line()
        );
        let json = seen.to_json(|p| json!(p.backend_pid));
        assert_eq!(json["defined_otherwise"], 1, "{json}");
        let job = |item: u32| {
            json["jobs"]
                .as_array()
                .and_then(|jobs| jobs.iter().find(|job| job["number"] == item))
                .cloned()
                .expect("the job")
        };
        assert_eq!(job(backup)["defined_otherwise"], true, "{json}");
        assert_eq!(
            job(backup)["definitions"],
            json!([
                {"definition": "0000abcd", "members": [2]},
                {"definition": "1a2b3c4d", "members": [1]},
            ])
        );
        assert_eq!(job(report)["defined_otherwise"], false, "{json}");
        // Once they agree, `--watch` sees a change and the job shows one definition.
        let mut agreed = shards.clone();
        agreed.replicas[1].defines.insert(backup, 0x1a2b3c4d);
        let after = report_of(&agreed);
        assert_ne!(seen.changes(), after.changes());
        assert!(!after.to_line().contains("ways"), "{}", after.to_line());
        assert_eq!(
            after.to_json(|p| json!(p.backend_pid))["defined_otherwise"],
            0
        );
    }
}
