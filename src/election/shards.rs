//! Shards (`--shards K`): K numbered locks of one name, shared out among the replicas that run
//! it, so that each shard's command runs exactly once and every replica runs its share. This
//! file holds what does not depend on the backend: who the members are as the server shows
//! them (a [`Roster`]), each member's share, and which free shards one replica takes.
//!
//! The rule is the same on every replica and reads only the roster, so replicas that see the
//! same roster agree without talking to each other; where two see different ones (one of them
//! read it a moment earlier), the backend's lock decides who takes a shard, and the next
//! roster settles the rest.
//!
//! Shares: with R members and no caps, each holds K / R shards, rounded down, and K mod R of
//! them one more. A member capped by `--max-shards` holds no more than its cap, and what it
//! cannot hold is shared among the others (water-filling). The members that get the one more
//! are those that already hold the most (then the lowest id), so that a roster that is already
//! balanced moves nothing when a member joins or leaves beyond what the new share demands.
//!
//! Moves: a member short of its share takes free shards, the free shards being dealt out among
//! all the members that are short, in id order, so that two of them do not reach for the same
//! one ([`Roster::to_take`]); a member over its share gives the surplus away (its
//! highest-numbered shards), after stopping their commands: the sharded room
//! (`supervise/sharded/`) decides which, since only it knows which of its shards it is giving
//! already. Shares add up to K (or to the sum of the caps), so a surplus
//! somewhere means a shortfall somewhere else, and a shard given away is taken at once.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::time::Duration;

use thiserror::Error;

use crate::election::{ConnectError, Fence, SessionError};

/// Why a replica cannot take part in a sharded lock.
#[derive(Debug, Error)]
pub enum JoinError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Session(#[from] SessionError),
    /// Another replica runs the same name with another shard count, or without shards.
    #[error("{0}")]
    Mismatch(String),
}

/// What a roster read saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub roster: Roster,
    /// Shards held by sessions that are not members (one that is leaving, say): not free.
    pub taken: BTreeSet<u32>,
    /// Why this replica must not run with the others, if it must not.
    pub mismatch: Option<String>,
    pub server_time: jiff::Timestamp,
}

impl Seen {
    /// The shards nobody holds.
    pub fn free(&self) -> Vec<u32> {
        self.roster
            .free()
            .into_iter()
            .filter(|shard| !self.taken.contains(shard))
            .collect()
    }
}

/// A backend that can run a sharded lock: a holder session per replica for its membership and
/// its shards, and a watcher session that waits for the end of one other member. Two sessions
/// per replica, whatever the shard count.
pub trait ShardBackend: Display {
    type Holder: Holder;
    type Watcher: Watcher;

    /// Connects and joins the roster of `shards` shards, taking at most `cap`; refuses to go
    /// on beside a replica that runs the name otherwise ([`JoinError::Mismatch`]).
    fn join(
        &self,
        name: &str,
        shards: u32,
        cap: Option<u32>,
    ) -> impl Future<Output = Result<Self::Holder, JoinError>>;

    /// Opens the session that watches for another member's end.
    fn watcher(&self, name: &str) -> impl Future<Output = Result<Self::Watcher, ConnectError>>;
}

/// What a holder session hears.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HolderEvent {
    /// Another member said this (joined, gave a shard away, left, found one gone).
    Notified(String),
    /// The session ended, for this reason: every shard is lost.
    Ended(String),
}

/// A replica's holder session: its membership and the shards it runs.
pub trait Holder {
    /// The member's id on the roster (PostgreSQL: the holder session's backend pid).
    fn id(&self) -> i32;

    /// The sockets a keeper holds while a shard's command runs (see `Session::sockets`).
    fn sockets(&self) -> Vec<std::os::fd::RawFd>;

    /// What the keeper of `shard`'s command is lent: [`Holder::sockets`], each with what the
    /// keeper says on it if pgleader dies (see `Session::lend`).
    fn lend(&self, shard: u32) -> Vec<super::socket::Lent> {
        let _ = shard;
        self.sockets()
            .into_iter()
            .map(super::socket::Lent::hold)
            .collect()
    }

    /// The next word from another member (joined, gave a shard, left, gone), or the end of
    /// the session, which loses every shard. Cancel-safe.
    fn next_event(&mut self) -> impl Future<Output = HolderEvent>;

    /// Reads the roster, which also proves which shards this session still holds. The future
    /// owns what it needs.
    fn roster(&self) -> impl Future<Output = Result<Seen, SessionError>> + 'static;

    /// Tries to take each of `shards`: those taken, with their fence.
    fn take(
        &self,
        shards: &[u32],
    ) -> impl Future<Output = Result<(Vec<u32>, Option<Fence>), SessionError>>;

    /// Releases a shard whose command is gone, and tells the others.
    fn give(&self, shard: u32) -> impl Future<Output = Result<(), SessionError>>;

    /// Releases everything and tells the others, within `timeout`.
    fn leave(self, timeout: Duration) -> impl Future<Output = Result<(), SessionError>>;

    /// Ends this replica's own abandoned watcher sessions, `ids`, where the server would not
    /// notice by itself that their client went away (PostgreSQL 13: a waiting statement runs
    /// until its lock is granted). The future owns what it needs.
    fn end_sessions(
        &self,
        ids: Vec<i32>,
    ) -> impl Future<Output = Result<(), SessionError>> + 'static;
}

/// A replica's watcher session.
pub trait Watcher {
    /// The watcher session's id on the server.
    fn id(&self) -> i32;

    /// Resolves once member `member` has gone or left, every member told. The future owns
    /// what it needs; one that was dropped may have been granted meanwhile, and the watcher
    /// must then be dropped too.
    fn watch(&self, member: i32) -> impl Future<Output = Result<(), SessionError>> + 'static;
}

/// One member of a sharded lock, as the server shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its session's id on the server (PostgreSQL's backend pid).
    pub id: i32,
    /// The most shards it takes (`--max-shards`); `None`: no cap.
    pub cap: Option<u32>,
    /// The shards it holds.
    pub holds: BTreeSet<u32>,
}

/// Every member of a sharded lock, and the shard count they run with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roster {
    pub shards: u32,
    /// Sorted by id.
    pub members: Vec<Member>,
}

impl Roster {
    /// Each member's share, in the order of `members`.
    pub fn shares(&self) -> Vec<u32> {
        let n = self.members.len();
        let mut shares = vec![0; n];
        let mut open: Vec<usize> = (0..n).collect();
        let mut left = self.shards;
        // Water-filling: members whose cap is below an even split get their cap, and the rest
        // is split again among the others.
        loop {
            if open.is_empty() {
                return shares;
            }
            let even = left / open.len() as u32;
            let (capped, uncapped): (Vec<usize>, Vec<usize>) = open
                .iter()
                .partition(|&&i| self.members[i].cap.is_some_and(|cap| cap <= even));
            if capped.is_empty() {
                open = uncapped;
                break;
            }
            for i in capped {
                let cap = self.members[i].cap.unwrap_or(0);
                shares[i] = cap;
                left -= cap;
            }
            open = uncapped;
        }
        let even = left / open.len() as u32;
        let extra = (left % open.len() as u32) as usize;
        // The one more goes to those that already hold the most, so that nothing moves for it.
        open.sort_by_key(|&i| {
            (
                std::cmp::Reverse(self.members[i].holds.len()),
                self.members[i].id,
            )
        });
        for (rank, &i) in open.iter().enumerate() {
            // A cap above `even` is at least `even + 1`: the extra fits under it.
            shares[i] = even + u32::from(rank < extra);
        }
        shares
    }

    /// The shards no member holds.
    pub fn free(&self) -> Vec<u32> {
        let held: BTreeSet<u32> = self
            .members
            .iter()
            .flat_map(|member| member.holds.iter().copied())
            .collect();
        (0..self.shards).filter(|i| !held.contains(i)).collect()
    }

    /// The free shards member `me` takes, up to its share, in order of preference: none when
    /// it holds its share or more, or is not on the roster.
    pub fn to_take(&self, me: i32) -> Vec<u32> {
        let Some(at) = self.members.iter().position(|member| member.id == me) else {
            return Vec::new();
        };
        let shares = self.shares();
        // Deal the free shards out among the members that are short, in id order, one at a
        // time, so that each reaches for its own. A shard dealt to a member that does not take
        // it (it read an older roster) is dealt again from the next roster.
        let mut short: Vec<(usize, u32)> = self
            .members
            .iter()
            .enumerate()
            .filter_map(|(i, member)| {
                let held = member.holds.len() as u32;
                (held < shares[i]).then(|| (i, shares[i] - held))
            })
            .collect();
        let mut free = self.free().into_iter();
        let mut take = Vec::new();
        'deal: loop {
            let mut dealt = false;
            for (i, wanted) in short.iter_mut().filter(|(_, wanted)| *wanted > 0) {
                let Some(shard) = free.next() else {
                    break 'deal;
                };
                *wanted -= 1;
                dealt = true;
                if *i == at {
                    take.push(shard);
                }
            }
            if !dealt {
                break;
            }
        }
        take
    }

    /// The member after `me` in id order, wrapping round: the one whose end `me` watches for,
    /// so that every member is watched by one other. `None` when `me` is alone (or absent).
    pub fn successor(&self, me: i32) -> Option<i32> {
        if self.members.len() < 2 || !self.members.iter().any(|member| member.id == me) {
            return None;
        }
        self.members
            .iter()
            .map(|member| member.id)
            .find(|&id| id > me)
            .or_else(|| self.members.first().map(|member| member.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: i32, cap: Option<u32>, holds: &[u32]) -> Member {
        Member {
            id,
            cap,
            holds: holds.iter().copied().collect(),
        }
    }

    fn roster(shards: u32, members: Vec<Member>) -> Roster {
        Roster { shards, members }
    }

    #[test]
    fn shares_split_evenly_and_give_the_remainder_to_those_that_hold_the_most() {
        let r = roster(
            10,
            vec![
                member(1, None, &[0]),
                member(2, None, &[1, 2, 3]),
                member(3, None, &[4, 5]),
            ],
        );
        assert_eq!(r.shares(), vec![3, 4, 3]);
        let r = roster(16, (1..=4).map(|id| member(id, None, &[])).collect());
        assert_eq!(r.shares(), vec![4, 4, 4, 4]);
        let r = roster(3, (1..=5).map(|id| member(id, None, &[])).collect());
        assert_eq!(r.shares(), vec![1, 1, 1, 0, 0]);
    }

    #[test]
    fn a_cap_below_the_even_split_is_kept_and_the_rest_shared_out() {
        let r = roster(
            10,
            vec![
                member(1, Some(1), &[]),
                member(2, None, &[]),
                member(3, Some(2), &[]),
            ],
        );
        assert_eq!(r.shares(), vec![1, 7, 2]);
        // Caps that cannot hold every shard: each holds its cap, the rest stays free.
        let r = roster(10, vec![member(1, Some(2), &[]), member(2, Some(3), &[])]);
        assert_eq!(r.shares(), vec![2, 3]);
        // A cap above the even split changes nothing.
        let r = roster(4, vec![member(1, Some(3), &[]), member(2, None, &[])]);
        assert_eq!(r.shares(), vec![2, 2]);
    }

    #[test]
    fn shares_always_add_up_to_the_shards_or_the_caps() {
        for shards in 1..40 {
            for n in 1..7 {
                let members: Vec<Member> = (0..n)
                    .map(|i| member(i, (i % 3 == 1).then_some(i as u32), &[]))
                    .collect();
                let caps: u32 = members.iter().map(|m| m.cap.unwrap_or(shards)).sum();
                let r = roster(shards, members);
                let shares = r.shares();
                assert_eq!(shares.iter().sum::<u32>(), shards.min(caps));
                for (share, m) in shares.iter().zip(&r.members) {
                    assert!(m.cap.is_none_or(|cap| *share <= cap));
                }
            }
        }
    }

    #[test]
    fn members_short_of_their_share_reach_for_different_free_shards() {
        // Member 3 left, and its shards 6, 7 are free.
        let r = roster(
            8,
            vec![member(1, None, &[0, 1, 2]), member(2, None, &[3, 4, 5])],
        );
        assert_eq!(r.to_take(1), vec![6]);
        assert_eq!(r.to_take(2), vec![7]);
        // A new member takes nothing while nothing is free; the others give their surplus.
        let r = roster(
            4,
            vec![
                member(1, None, &[0, 1]),
                member(2, None, &[2, 3]),
                member(3, None, &[]),
            ],
        );
        assert_eq!(r.to_take(3), Vec::<u32>::new());
        // 1 holds the most and keeps the one more; 2 is one over its share.
        assert_eq!(r.shares(), vec![2, 1, 1]);
    }

    #[test]
    fn a_member_alone_takes_every_shard_and_watches_nobody() {
        let r = roster(5, vec![member(7, None, &[])]);
        assert_eq!(r.to_take(7), vec![0, 1, 2, 3, 4]);
        assert_eq!(r.successor(7), None);
    }

    #[test]
    fn free_shards_are_dealt_round_the_members_that_are_short() {
        // Short by two and by one: 1 gets 4 and 6, 2 gets 5.
        let r = roster(
            9,
            vec![
                member(1, None, &[0]),
                member(2, None, &[1, 7]),
                member(3, None, &[2, 3, 8]),
            ],
        );
        assert_eq!(r.shares(), vec![3, 3, 3]);
        assert_eq!(r.to_take(1), vec![4, 6]);
        assert_eq!(r.to_take(2), vec![5]);
        assert_eq!(r.to_take(3), Vec::<u32>::new());
    }

    #[test]
    fn every_member_is_watched_by_exactly_one_other() {
        let r = roster(4, [5, 9, 2].map(|id| member(id, None, &[])).to_vec());
        let mut r = r;
        r.members.sort_by_key(|m| m.id);
        let watched: Vec<i32> = [2, 5, 9].iter().filter_map(|&id| r.successor(id)).collect();
        assert_eq!(watched, vec![5, 9, 2]);
        assert_eq!(r.successor(4), None);
    }
}
