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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::election::ledger::{Definition, Ledger};
use crate::election::lock::LockKey;
use crate::election::{ConnectError, Fence, SessionError};

/// What a sharded lock shares out: K numbered shards (`--shards K`), or the jobs of a crontab
/// (`pgleader cron`), each known by a number derived from its name. The two kinds never run
/// side by side on one name: each replica says which it runs ([`Items::marker`]) and a replica
/// that finds the other kind refuses to go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Items {
    /// Shards `0..K`.
    Numbered(u32),
    /// A crontab's jobs: the numbers of the jobs this replica knows. A replica shares out only
    /// the jobs it knows, and never takes one it does not, so that in a rolling deploy a job
    /// only some replicas know runs on one of those.
    Listed(Arc<Listing>),
}

/// A crontab's jobs as one replica's file defines them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// Each job's number.
    pub items: BTreeSet<u32>,
    /// Each job's definition, by its number: 32 bits of a hash of its name and definition
    /// (`CronJob::definition_marker`). Replicas that define a job alike say the same number, so
    /// one that defines it otherwise shows, and `status` can tell which job it is.
    pub definitions: BTreeMap<u32, u32>,
}

impl Listing {
    /// 32 bits of a hash of the jobs and their definitions: alike for alike listings within
    /// one build, different (but for a chance in 2^32) when either changed.
    pub fn digest(&self) -> u32 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        self.items.hash(&mut hasher);
        self.definitions.hash(&mut hasher);
        hasher.finish() as u32
    }
}

impl Items {
    /// Whether `item` is one of these.
    pub fn contains(&self, item: u32) -> bool {
        match self {
            Items::Numbered(count) => item < *count,
            Items::Listed(listing) => listing.items.contains(&item),
        }
    }

    /// How many there are.
    pub fn len(&self) -> u32 {
        match self {
            Items::Numbered(count) => *count,
            Items::Listed(listing) => listing.items.len() as u32,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every item, in order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Items::Numbered(count) => Box::new(0..*count),
            Items::Listed(listing) => Box::new(listing.items.iter().copied()),
        }
    }

    /// What a replica says it runs, for the others to compare: the shard count, or 0 for a
    /// crontab (a shard count is never 0).
    pub fn marker(&self) -> u32 {
        match self {
            Items::Numbered(count) => *count,
            Items::Listed(_) => 0,
        }
    }
}

/// How a replica that says `marker` runs the name (see [`Items::marker`]), for the message
/// that refuses two kinds side by side.
pub fn kind_of(marker: u32) -> String {
    match marker {
        0 => "as a crontab (pgleader cron)".to_owned(),
        count => format!("with --shards {count}"),
    }
}

impl Default for Items {
    fn default() -> Self {
        Items::Numbered(0)
    }
}

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
    /// The backend found the roster the same as at its last read (its answer's digest): this
    /// is that read's roster, and a room that acted on it has nothing new to act on.
    pub unchanged: bool,
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

    /// Connects and joins the roster of `items`, taking at most `cap`; refuses to go on beside
    /// a replica that runs the name otherwise ([`JoinError::Mismatch`]).
    fn join(
        &self,
        name: &str,
        items: &Items,
        cap: Option<u32>,
    ) -> impl Future<Output = Result<Self::Holder, JoinError>>;

    /// Opens the session that watches for another member's end.
    fn watcher(&self, name: &str) -> impl Future<Output = Result<Self::Watcher, ConnectError>>;
}

/// What a member says when it gave `items` away: the first few of them, and how many more,
/// so that a hand-over of hundreds stays one short word (PostgreSQL's payloads are bounded).
pub fn gave_word(items: &[u32]) -> String {
    const SHOWN: usize = 20;
    let mut word = String::from("gave");
    for item in items.iter().take(SHOWN) {
        word.push_str(&format!(" {item}"));
    }
    if items.len() > SHOWN {
        word.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    word
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
    /// The ledger of a crontab's jobs, on this session.
    type Ledger: Ledger;

    /// The ledger of one crontab job, `item`, recorded under `job`'s key, whose claims succeed
    /// only while this session holds that item. `None` where the backend keeps no ledger for
    /// a sharded lock's items (the configuration refuses a crontab there).
    fn ledger(&self, job: &LockKey, item: u32, definition: &Definition) -> Option<Self::Ledger>;

    /// Makes the ledger ready for use on this session (creating its storage when missing) and
    /// says where it lives, once per session before any job's [`Holder::ledger`] claims.
    fn prepare_ledger(
        &self,
    ) -> impl Future<Output = Result<String, crate::election::ledger::LedgerError>>;

    /// Changes what this member shares out (a crontab reread): the next roster reads these,
    /// and the others learn which jobs it knows. `finishing` are the jobs no longer among them
    /// that this member still holds while their last runs end: they stay its own until given
    /// (Redis renews their keys; PostgreSQL's session locks need nothing).
    fn set_items(
        &mut self,
        items: Items,
        finishing: BTreeSet<u32>,
    ) -> impl Future<Output = Result<(), SessionError>>;

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

    /// What a crontab member's keeper of its membership is lent (see `handle::MembershipKeeper`):
    /// the holder's sockets with a farewell that ends the membership, said once pgleader and
    /// every command of the replica are gone. None where the server itself ends everything when
    /// the connection closes (PostgreSQL), or where no farewell can be said (TLS).
    fn lend_membership(&self) -> Vec<super::socket::Lent> {
        Vec::new()
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

    /// Releases the shards whose commands are gone, in one statement, and tells the others
    /// once: those it still held and released. One statement, so that handing hundreds of a
    /// crontab's jobs over to a replica that joins takes one round trip, not one each.
    fn give(&self, shards: &[u32]) -> impl Future<Output = Result<Vec<u32>, SessionError>>;

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
    /// The items it knows (a crontab's jobs in its file); `None`: every one (shards). Shared
    /// with what the reader kept of the member's markers: a thousand jobs are not copied at
    /// every check.
    pub knows: Option<Arc<BTreeSet<u32>>>,
    /// How it defines the jobs it knows, by job number (see [`Listing::definitions`]): on
    /// PostgreSQL only those of the jobs the reader knows itself.
    pub defines: Arc<BTreeMap<u32, u32>>,
}

impl Member {
    /// Whether it knows `item`, and so may take it.
    pub fn knows(&self, item: u32) -> bool {
        self.knows
            .as_ref()
            .is_none_or(|knows| knows.contains(&item))
    }
}

/// Every member of a sharded lock, and what they share out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roster {
    pub items: Items,
    /// Sorted by id.
    pub members: Vec<Member>,
}

impl Roster {
    /// Each member's share, in the order of `members`.
    pub fn shares(&self) -> Vec<u32> {
        let n = self.members.len();
        let mut shares = vec![0; n];
        let mut open: Vec<usize> = (0..n).collect();
        let mut left = self.items.len();
        let limits: Vec<Option<u32>> = (0..n).map(|i| self.limit(i)).collect();
        // Water-filling: members whose cap is below an even split get their cap, and the rest
        // is split again among the others.
        loop {
            if open.is_empty() {
                return shares;
            }
            let even = left / open.len() as u32;
            let (capped, uncapped): (Vec<usize>, Vec<usize>) = open
                .iter()
                .partition(|&&i| limits[i].is_some_and(|cap| cap <= even));
            if capped.is_empty() {
                open = uncapped;
                break;
            }
            for i in capped {
                let cap = limits[i].unwrap_or(0);
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

    /// The most items member `i` can hold: its `--max-shards`, and no more than the items
    /// of the roster it knows (a draining crontab replica knows none: it takes nothing, so
    /// its share must go to the others, or they pass its jobs back and forth).
    fn limit(&self, i: usize) -> Option<u32> {
        let member = &self.members[i];
        let known = member.knows.as_ref().map(|knows| match &self.items {
            // Both in order: one pass over each, not a lookup per item.
            Items::Listed(listing) => listing.items.intersection(knows).count() as u32,
            items => items.iter().filter(|item| knows.contains(item)).count() as u32,
        });
        match (member.cap, known) {
            (Some(cap), Some(known)) => Some(cap.min(known)),
            (cap, known) => cap.or(known),
        }
    }

    /// The items no member holds.
    pub fn free(&self) -> Vec<u32> {
        let held: BTreeSet<u32> = self
            .members
            .iter()
            .flat_map(|member| member.holds.iter().copied())
            .collect();
        self.items.iter().filter(|i| !held.contains(i)).collect()
    }

    /// The free items member `me` takes, up to its share, in order of preference: none when
    /// it holds its share or more, or is not on the roster. An item is dealt only to a member
    /// that knows it (a crontab job in its file); one that no member short of its share knows
    /// goes to the member that knows it and holds the fewest, so that a job only some replicas
    /// know runs, on one of those.
    pub fn to_take(&self, me: i32) -> Vec<u32> {
        let Some(at) = self.members.iter().position(|member| member.id == me) else {
            return Vec::new();
        };
        let shares = self.shares();
        // Deal the free items out among the members that are short, in id order, one at a
        // time, so that each reaches for its own. An item dealt to a member that does not take
        // it (it read an older roster) is dealt again from the next roster.
        let mut wanted: Vec<u32> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, member)| shares[i].saturating_sub(member.holds.len() as u32))
            .collect();
        let mut held: Vec<usize> = self.members.iter().map(|m| m.holds.len()).collect();
        let n = self.members.len();
        let mut next = 0;
        let mut take = Vec::new();
        for item in self.free() {
            let short = (0..n)
                .map(|k| (next + k) % n)
                .find(|&i| wanted[i] > 0 && self.members[i].knows(item));
            let to = match short {
                Some(i) => {
                    wanted[i] -= 1;
                    next = (i + 1) % n;
                    Some(i)
                }
                // Nobody short knows it: the knower that holds the fewest.
                None => (0..n)
                    .filter(|&i| self.members[i].knows(item))
                    .filter(|&i| self.members[i].knows.is_some())
                    .min_by_key(|&i| (held[i], self.members[i].id)),
            };
            if let Some(i) = to {
                held[i] += 1;
                if i == at {
                    take.push(item);
                }
            }
        }
        take
    }

    /// Whether a member other than `me` knows `item`: one `me` may hand over.
    pub fn known_elsewhere(&self, item: u32, me: i32) -> bool {
        self.members
            .iter()
            .any(|member| member.id != me && member.knows(item))
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

    #[test]
    fn a_hand_over_of_hundreds_is_one_short_word() {
        assert_eq!(gave_word(&[3, 2]), "gave 3 2");
        let many: Vec<u32> = (0..667).map(|n| n * 1_000_003).collect();
        let word = gave_word(&many);
        assert!(word.ends_with(" and 647 more"), "{word}");
        assert!(word.len() < 300, "{word}");
    }

    fn member(id: i32, cap: Option<u32>, holds: &[u32]) -> Member {
        Member {
            knows: None,
            defines: Arc::default(),
            id,
            cap,
            holds: holds.iter().copied().collect(),
        }
    }

    fn roster(shards: u32, members: Vec<Member>) -> Roster {
        Roster {
            items: Items::Numbered(shards),
            members,
        }
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
    fn a_job_is_dealt_only_to_a_member_that_knows_it() {
        let knowing = |id: i32, knows: &[u32]| Member {
            knows: Some(Arc::new(knows.iter().copied().collect())),
            ..member(id, None, &[])
        };
        let jobs = |items: &[u32]| {
            Items::Listed(Arc::new(Listing {
                items: items.iter().copied().collect(),
                definitions: BTreeMap::new(),
            }))
        };
        // 2 knows two of the three: it gets one of those, 1 the other two.
        let r = Roster {
            items: jobs(&[10, 20, 30]),
            members: vec![knowing(1, &[10, 20, 30]), knowing(2, &[10, 20])],
        };
        assert_eq!(r.to_take(1), vec![10, 30]);
        assert_eq!(r.to_take(2), vec![20]);
        // A job only a member at its share knows still runs, there; and it is never handed
        // over, since nobody else would take it.
        let r = Roster {
            items: jobs(&[10, 20, 30]),
            members: vec![knowing(1, &[10, 20]), knowing(2, &[10, 20, 30])],
        };
        assert_eq!(r.to_take(1), vec![10]);
        assert_eq!(r.to_take(2), vec![20, 30]);
        assert!(!r.known_elsewhere(30, 2));
        assert!(r.known_elsewhere(20, 2));
    }

    #[test]
    fn a_draining_member_that_knows_no_job_has_no_share_and_the_others_keep_theirs() {
        let knowing = |id: i32, knows: &[u32], holds: &[u32]| Member {
            knows: Some(Arc::new(knows.iter().copied().collect())),
            ..member(id, None, holds)
        };
        let items = Items::Listed(Arc::new(Listing {
            items: (0..11).collect(),
            definitions: BTreeMap::new(),
        }));
        // 3 drains: it lists no job while its last run ends, holding that job still. The two
        // others share all eleven, so that neither is over its share once it has taken the
        // drained jobs (a share of 4 each, as before, had them hand those jobs back and forth
        // until 3 was gone, and occurrences went unclaimed meanwhile).
        let all: Vec<u32> = (0..11).collect();
        let r = Roster {
            items,
            members: vec![
                knowing(1, &all, &[0, 1, 2, 3, 4]),
                knowing(2, &all, &[5, 6, 7, 8]),
                knowing(3, &[], &[10]),
            ],
        };
        assert_eq!(r.shares(), vec![6, 5, 0]);
        assert_eq!(r.to_take(1), vec![9]);
        assert_eq!(r.to_take(2), Vec::<u32>::new());
    }

    #[test]
    fn shares_add_up_to_what_the_members_can_hold_and_none_exceeds_its_limit() {
        // Members that know some of 12 jobs (a rolling deploy, a drain), some capped: every
        // share is within what its member can hold, and together they hold every job some
        // member can, or all their limits.
        let items = Items::Listed(Arc::new(Listing {
            items: (0..12).collect(),
            definitions: BTreeMap::new(),
        }));
        let mut seed = 7u64;
        let mut next = |below: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) % below
        };
        for _ in 0..500 {
            let n = 1 + next(5) as i32;
            let members: Vec<Member> = (1..=n)
                .map(|id| Member {
                    knows: (next(3) > 0)
                        .then(|| Arc::new((0..12).filter(|_| next(4) > 0).collect())),
                    ..member(id, (next(4) == 0).then(|| next(6) as u32), &[])
                })
                .collect();
            let r = Roster {
                items: items.clone(),
                members,
            };
            let shares = r.shares();
            let limits: Vec<u32> = (0..r.members.len())
                .map(|i| r.limit(i).unwrap_or(12))
                .collect();
            for (share, limit) in shares.iter().zip(&limits) {
                assert!(share <= limit, "{shares:?} over {limits:?}");
            }
            let total: u32 = shares.iter().sum();
            assert_eq!(
                total,
                limits.iter().sum::<u32>().min(12),
                "{shares:?} of {limits:?}"
            );
        }
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
