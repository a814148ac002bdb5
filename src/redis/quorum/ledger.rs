//! The ledger of scheduled runs over a quorum of Redis servers: each server keeps the same keys
//! as a single server's ledger (`redis/ledger.rs`), and an answer counts only when a majority
//! gave it.
//!
//! Why this keeps an occurrence from running twice: a claim counts only if a majority of the
//! servers accepted it, each in one script that checks the lock's key there still holds this
//! leadership's value and that the occurrence has no row yet. Any two majorities share a server,
//! and that server answers the second claim "taken", so a second majority of claims for one
//! occurrence cannot be gathered. A claim that fell short of a majority is taken back wherever
//! it may have landed, so it never blocks a later leader for good. A server that restarted
//! without its data has lost its rows, but its `born` key (the server's start, see
//! `redis/ledger.rs`) refuses every occurrence at or before the restart, so it cannot hand out a
//! second claim.
//!
//! History is read from a majority too: for each occurrence, the row of the latest leadership
//! (epoch, then attempt) wins, an ended row before a running one, so a row that a minority kept
//! after its claim was taken back, or a server that missed an update, does not hide the truth.

use std::future::Future;
use std::time::Duration;

use jiff::Timestamp;
use tokio::task::JoinSet;

use crate::election::ledger::{Claim, Claimant, Entry, LateFinish, Ledger, LedgerError, StaleRun};
use crate::election::majority::Majority;
use crate::election::participant::Participant;
use crate::redis::ledger::RedisLedger;

/// One ledger per reachable server of the quorum, and how many servers the quorum has.
#[derive(Clone, Debug)]
pub struct QuorumLedger {
    members: Vec<RedisLedger>,
    total: usize,
    /// Bounds each server's answer.
    timeout: Duration,
}

impl QuorumLedger {
    pub fn new(members: Vec<RedisLedger>, total: usize, timeout: Duration) -> QuorumLedger {
        QuorumLedger {
            members,
            total,
            timeout,
        }
    }

    fn quorum(&self) -> usize {
        Majority::of(self.total).need()
    }

    /// Runs `ask` on every server at once, each bounded; the answers in the servers' order.
    async fn each<T, F, Fut>(&self, ask: F) -> Vec<Result<T, LedgerError>>
    where
        T: Send + 'static,
        F: Fn(RedisLedger) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
    {
        let mut asking = JoinSet::new();
        for (index, member) in self.members.iter().enumerate() {
            let (answer, bound) = (ask(member.clone()), self.timeout);
            asking.spawn(async move {
                let answer = tokio::time::timeout(bound, answer)
                    .await
                    .unwrap_or_else(|_| {
                        Err(LedgerError::Query(format!(
                            "no answer from the server within {}",
                            humantime::format_duration(bound)
                        )))
                    });
                (index, answer)
            });
        }
        let mut answers: Vec<Result<T, LedgerError>> = (0..self.members.len())
            .map(|_| Err(LedgerError::Query("the server's task failed".into())))
            .collect();
        while let Some(joined) = asking.join_next().await {
            if let Ok((index, answer)) = joined {
                answers[index] = answer;
            }
        }
        answers
    }

    /// [`each`](Self::each) for a question that carries `what`: each server's question gets a
    /// copy of its own, since the questions outlive this call (they run as tasks).
    async fn each_with<A, T, F, Fut>(&self, what: A, ask: F) -> Vec<Result<T, LedgerError>>
    where
        A: Clone,
        T: Send + 'static,
        F: Fn(RedisLedger, A) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
    {
        self.each(|member| ask(member, what.clone())).await
    }

    /// The answers of a majority, or why there are not enough: a fatal error wins (retrying
    /// cannot help), then "too few answered" (leadership in doubt).
    fn majority<T>(&self, answers: Vec<Result<T, LedgerError>>) -> Result<Vec<T>, LedgerError> {
        let mut good = Vec::new();
        let mut reasons = Vec::new();
        for (index, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(value) => good.push(value),
                Err(LedgerError::Fatal(reason)) => {
                    return Err(LedgerError::Fatal(format!(
                        "server {}: {reason}",
                        index + 1
                    )));
                }
                Err(err) => reasons.push(format!("server {}: {err}", index + 1)),
            }
        }
        if good.len() >= self.quorum() {
            Ok(good)
        } else {
            Err(LedgerError::Query(format!(
                "only {} of {} servers answered the ledger: {}",
                good.len(),
                self.total,
                reasons.join("; ")
            )))
        }
    }

    /// True when a majority of the servers answered true.
    fn agreed(&self, answers: Vec<Result<bool, LedgerError>>) -> Result<bool, LedgerError> {
        let yes = self
            .majority(answers)?
            .into_iter()
            .filter(|yes| *yes)
            .count();
        Ok(yes >= self.quorum())
    }
}

/// What a round of claims comes to.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// A majority claimed it: the run is this leadership's.
    Claimed { attempt: i32 },
    /// No majority: take the claim back where it may have landed, and answer this.
    Refused(Result<Claim, String>),
}

/// Decides a claim from each server's answer (`Err` for no answer). Only a majority of
/// "claimed" counts; otherwise the most telling refusal is the answer: a majority saying "not
/// leader", then an occurrence taken (what ran) or superseded on some server (it will not be
/// claimable there), then "early" (the earliest time a server would accept it, for the retry), then
/// "not leader" from a minority, and an error when too few servers answered to say more.
pub fn decide(answers: &[Result<Claim, String>], total: usize) -> Verdict {
    let quorum = Majority::of(total).need();
    let attempts: Vec<i32> = answers
        .iter()
        .filter_map(|answer| match answer {
            Ok(Claim::Claimed { attempt }) => Some(*attempt),
            _ => None,
        })
        .collect();
    if attempts.len() >= quorum {
        let attempt = attempts.into_iter().max().unwrap_or(1);
        return Verdict::Claimed { attempt };
    }
    let refused = |wanted: fn(&Claim) -> bool| {
        answers
            .iter()
            .filter_map(|answer| answer.as_ref().ok())
            .filter(|claim| wanted(claim))
            .cloned()
            .collect::<Vec<Claim>>()
    };
    let not_leader = refused(|claim| matches!(claim, Claim::NotLeader));
    if not_leader.len() >= quorum {
        return Verdict::Refused(Ok(Claim::NotLeader));
    }
    if let Some(claim) = refused(|claim| matches!(claim, Claim::Taken { .. }))
        .into_iter()
        .next()
        .or_else(|| {
            refused(|claim| matches!(claim, Claim::Superseded))
                .into_iter()
                .next()
        })
    {
        return Verdict::Refused(Ok(claim));
    }
    let latest_early = refused(|claim| matches!(claim, Claim::Early { .. }))
        .into_iter()
        .filter_map(|claim| match claim {
            Claim::Early { server_now } => Some(server_now),
            _ => None,
        })
        .max();
    if let Some(server_now) = latest_early {
        return Verdict::Refused(Ok(Claim::Early { server_now }));
    }
    if !not_leader.is_empty() {
        return Verdict::Refused(Ok(Claim::NotLeader));
    }
    let errors: Vec<&str> = answers
        .iter()
        .filter_map(|answer| answer.as_ref().err().map(String::as_str))
        .collect();
    Verdict::Refused(Err(format!(
        "only {} of {total} servers accepted the claim: {}",
        answers.iter().filter(|answer| answer.is_ok()).count(),
        errors.join("; ")
    )))
}

/// One history from several servers' rows: per occurrence the row of the latest leadership
/// (epoch, then attempt; an ended row before a running one), newest first, at most `limit`.
pub fn merge(histories: Vec<Vec<Entry>>, limit: i64) -> Vec<Entry> {
    let rank = |entry: &Entry| (entry.epoch, entry.attempt, entry.ended_at.is_some());
    let mut best: std::collections::BTreeMap<Timestamp, Entry> = Default::default();
    for entry in histories.into_iter().flatten() {
        match best.get(&entry.scheduled_for) {
            Some(kept) if rank(kept) >= rank(&entry) => {}
            _ => {
                best.insert(entry.scheduled_for, entry);
            }
        }
    }
    best.into_values()
        .rev()
        .take(usize::try_from(limit).unwrap_or(0))
        .collect()
}

/// The items of several servers' lists, once each: of those `same` calls one, the first found.
fn once_each<T>(lists: Vec<Vec<T>>, same: impl Fn(&T, &T) -> bool) -> Vec<T> {
    let mut found: Vec<T> = Vec::new();
    for item in lists.into_iter().flatten() {
        if !found.iter().any(|other| same(other, &item)) {
            found.push(item);
        }
    }
    found
}

impl Ledger for QuorumLedger {
    async fn prepare(&self) -> Result<String, LedgerError> {
        let location = self.members[0].prepare().await?;
        Ok(format!("{location} on each server of the quorum"))
    }

    async fn announce(&self, fingerprints: &str) -> Result<(), LedgerError> {
        let answers = self
            .each_with(fingerprints.to_owned(), |member, fingerprints| async move {
                member.announce(&fingerprints).await
            })
            .await;
        self.majority(answers).map(|_| ())
    }

    /// Everyone any server knows of, once each (a session's name is the same on each server).
    async fn participants(&self) -> Result<Vec<Participant>, LedgerError> {
        let answers = self
            .each(|member| async move { member.participants().await })
            .await;
        let same = |one: &Participant, other: &Participant| {
            one.application_name.is_some() && one.application_name == other.application_name
        };
        Ok(once_each(self.majority(answers)?, same))
    }

    /// The median of the servers' clocks: one server whose clock is off does not move it, and a
    /// claim needs a majority of servers whose clocks have reached the occurrence anyway.
    async fn server_time(&self) -> Result<Timestamp, LedgerError> {
        let answers = self
            .each(|member| async move { member.server_time().await })
            .await;
        let mut times: Vec<Timestamp> = answers.into_iter().filter_map(Result::ok).collect();
        times.sort();
        times
            .get(times.len() / 2)
            .copied()
            .ok_or_else(|| LedgerError::Query("no server of the quorum told its time".into()))
    }

    async fn interrupt_stale(&self) -> Result<Vec<StaleRun>, LedgerError> {
        let answers = self
            .each(|member| async move { member.interrupt_stale().await })
            .await;
        let mut found = once_each(self.majority(answers)?, |one, other| one.0 == other.0);
        found.sort_by_key(|run| run.0);
        Ok(found)
    }

    async fn recent(&self, limit: i64) -> Result<Vec<Entry>, LedgerError> {
        let answers = self
            .each(move |member| async move { member.recent(limit).await })
            .await;
        Ok(merge(self.majority(answers)?, limit))
    }

    async fn has(&self, at: Timestamp) -> Result<bool, LedgerError> {
        let answers = self
            .each(move |member| async move { member.has(at).await })
            .await;
        Ok(self.majority(answers)?.into_iter().any(|has| has))
    }

    async fn claim(
        &self,
        at: Timestamp,
        ahead: Duration,
        claimant: &Claimant,
        retries: i32,
    ) -> Result<Claim, LedgerError> {
        let answers = self
            .each_with(claimant.clone(), |member, who| async move {
                member.claim(at, ahead, &who, retries).await
            })
            .await;
        if let Some(LedgerError::Fatal(reason)) = answers.iter().find_map(|answer| {
            answer
                .as_ref()
                .err()
                .filter(|err| matches!(err, LedgerError::Fatal(_)))
        }) {
            let reason = reason.clone();
            self.unclaim(at, claimant.epoch).await.ok();
            return Err(LedgerError::Fatal(reason));
        }
        let answers: Vec<Result<Claim, String>> = answers
            .into_iter()
            .map(|answer| answer.map_err(|err| err.to_string()))
            .collect();
        match decide(&answers, self.total) {
            Verdict::Claimed { attempt } => Ok(Claim::Claimed { attempt }),
            Verdict::Refused(answer) => {
                // Wherever the claim landed (or may have: a server that did not answer in
                // time may have run the script), it is taken back, so that a minority of
                // claims never blocks the next leader.
                let landed = answers
                    .iter()
                    .any(|answer| matches!(answer, Ok(Claim::Claimed { .. }) | Err(_)));
                if landed && let Err(err) = self.unclaim(at, claimant.epoch).await {
                    tracing::debug!(reason = %err, "could not take back a claim on every server");
                }
                answer.map_err(LedgerError::Query)
            }
        }
    }

    async fn finish(&self, finish: &LateFinish, detail: Option<&str>) -> Result<bool, LedgerError> {
        let what = (finish.clone(), detail.map(str::to_owned));
        let answers = self
            .each_with(what, |member, (finish, detail)| async move {
                member.finish(&finish, detail.as_deref()).await
            })
            .await;
        self.agreed(answers)
    }

    async fn finish_late(&self, late: &LateFinish) -> Result<bool, LedgerError> {
        let answers = self
            .each_with(late.clone(), |member, late| async move {
                member.finish_late(&late).await
            })
            .await;
        self.agreed(answers)
    }

    async fn unclaim(&self, at: Timestamp, epoch: i64) -> Result<(), LedgerError> {
        let answers = self
            .each(move |member| async move { member.unclaim(at, epoch).await })
            .await;
        self.majority(answers).map(|_| ())
    }

    async fn record(
        &self,
        at: Timestamp,
        outcome: &str,
        detail: &str,
        claimant: &Claimant,
    ) -> Result<bool, LedgerError> {
        let what = (outcome.to_owned(), detail.to_owned(), claimant.clone());
        let answers = self
            .each_with(what, |member, (outcome, detail, who)| async move {
                member.record(at, &outcome, &detail, &who).await
            })
            .await;
        self.agreed(answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).expect("a valid instant")
    }

    #[test]
    fn only_a_majority_of_claims_counts() {
        let claimed = || Ok(Claim::Claimed { attempt: 1 });
        let taken = || {
            Ok(Claim::Taken {
                outcome: "succeeded".into(),
            })
        };
        assert_eq!(
            decide(&[claimed(), claimed(), taken()], 3),
            Verdict::Claimed { attempt: 1 }
        );
        assert_eq!(
            decide(&[claimed(), taken(), taken()], 3),
            Verdict::Refused(taken())
        );
        // Two of five is not a majority, even when nobody refused.
        let none = || Err("no answer".to_owned());
        assert!(matches!(
            decide(&[claimed(), claimed(), none(), none(), none()], 5),
            Verdict::Refused(Err(_))
        ));
        // A retried run's attempt is the highest any server counted.
        assert_eq!(
            decide(&[Ok(Claim::Claimed { attempt: 2 }), claimed(), none()], 3),
            Verdict::Claimed { attempt: 2 }
        );
    }

    #[test]
    fn a_refusal_says_the_most_telling_reason() {
        let claimed = || Ok(Claim::Claimed { attempt: 1 });
        let early = |s| Ok(Claim::Early { server_now: at(s) });
        assert_eq!(
            decide(&[Ok(Claim::NotLeader), Ok(Claim::NotLeader), claimed()], 3),
            Verdict::Refused(Ok(Claim::NotLeader))
        );
        assert_eq!(
            decide(&[Ok(Claim::Superseded), early(5), claimed()], 3),
            Verdict::Refused(Ok(Claim::Superseded))
        );
        // The retry waits for the server nearest to the occurrence, not the slowest.
        assert_eq!(
            decide(&[early(5), early(9), claimed()], 3),
            Verdict::Refused(early(9))
        );
        assert_eq!(
            decide(&[Ok(Claim::NotLeader), claimed(), Err("gone".into())], 3),
            Verdict::Refused(Ok(Claim::NotLeader))
        );
    }

    fn entry(occurrence: i64, epoch: i64, attempt: i32, ended: bool) -> Entry {
        Entry {
            scheduled_for: at(occurrence),
            outcome: if ended { "succeeded" } else { "running" }.into(),
            exit_code: None,
            attempt,
            claimed_at: at(occurrence),
            ended_at: ended.then(|| at(occurrence + 1)),
            host: None,
            pid: None,
            backend_pid: None,
            epoch: Some(epoch),
            detail: None,
            schedule: String::new(),
            timezone: String::new(),
            output: None,
        }
    }

    #[test]
    fn history_keeps_the_latest_leaderships_row_of_each_occurrence() {
        let merged = merge(
            vec![
                vec![entry(30, 7, 1, false), entry(20, 5, 1, true)],
                vec![entry(30, 7, 1, true), entry(20, 6, 2, false)],
                vec![entry(10, 4, 1, true)],
            ],
            10,
        );
        let seen: Vec<(i64, Option<i64>, bool)> = merged
            .iter()
            .map(|e| (e.scheduled_for.as_second(), e.epoch, e.ended_at.is_some()))
            .collect();
        assert_eq!(
            seen,
            vec![
                (30, Some(7), true),
                (20, Some(6), false),
                (10, Some(4), true)
            ]
        );
        assert_eq!(
            merge(vec![vec![entry(30, 7, 1, true), entry(20, 5, 1, true)]], 1).len(),
            1
        );
    }
}
