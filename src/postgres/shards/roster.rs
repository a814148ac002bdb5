//! The roster as a member reads it: who runs the name, what each holds, and whether one runs it
//! otherwise (another K, or the plain lock), which refuses the join; and the refusal a plain
//! replica gets beside sharded ones. Kept apart from the session so that it reads rows only.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::statements::{CAP_BASE, COUNT_BASE, MEMBER_FLOOR, ShardKeys};
use crate::election::ConnectError;
use crate::election::SessionError;
use crate::election::lock::LockKey;
use crate::election::shards::{Items, Listing, Member, Roster, Seen, kind_of};

/// A crontab member's markers as a reader last read them, under the digest they were read
/// with: while the member shows the same digest, they are not read again.
#[derive(Clone, Debug, Default)]
pub(super) struct Marked {
    pub(super) digest: u32,
    /// The jobs it knows.
    knows: Arc<BTreeSet<u32>>,
    /// How it defines those of the jobs it knows that the reader knows.
    defines: Arc<BTreeMap<u32, u32>>,
}

/// Each member's markers as last read, by member.
pub(super) type MarkersRead = BTreeMap<i32, Marked>;

/// Reads a roster from `ROSTER_SQL`'s rows, as seen by a member that shares out `items`.
/// `spaces` are the "defines" spaces of the reader's own jobs, each with its job; `read` the
/// markers read before, which the statement left out for the members whose digest is the
/// same. Answers the roster and the markers as read now.
pub(super) fn read_roster(
    keys: &ShardKeys,
    items: &Items,
    spaces: &BTreeMap<u32, u32>,
    read: &MarkersRead,
    rows: &[tokio_postgres::Row],
) -> Result<(Seen, MarkersRead), SessionError> {
    let first = rows
        .first()
        .ok_or_else(|| SessionError::Query("the roster returned no row".into()))?;
    let server_time: jiff::Timestamp = first.get(1);
    let mut members: BTreeMap<i32, Member> = BTreeMap::new();
    let (mut holds, mut counts, mut caps, mut plain) = (Vec::new(), Vec::new(), Vec::new(), None);
    let mut knows: BTreeMap<i32, BTreeSet<u32>> = BTreeMap::new();
    let mut defines: BTreeMap<i32, BTreeMap<u32, u32>> = BTreeMap::new();
    // Each member's digest: none while it changes its markers (see `know`).
    let mut digests: BTreeMap<i32, Vec<u32>> = BTreeMap::new();
    for row in rows {
        let (Some(pid), Some(objid), Some(subid), Some(exclusive)) = (
            row.get::<_, Option<i32>>(2),
            row.get::<_, Option<i64>>(3),
            row.get::<_, Option<i32>>(4),
            row.get::<_, Option<bool>>(5),
        ) else {
            continue;
        };
        if subid == 1 {
            plain.get_or_insert(pid);
            continue;
        }
        let classid = row.get::<_, Option<i64>>(6);
        if classid == Some(i64::from(keys.markers as u32)) {
            digests.entry(pid).or_default().push(objid as u32);
            continue;
        }
        if classid == Some(i64::from(keys.knows as u32)) {
            knows.entry(pid).or_default().insert(objid as u32);
            continue;
        }
        if let Some(&item) = classid.and_then(|classid| spaces.get(&(classid as u32))) {
            defines.entry(pid).or_default().insert(item, objid as u32);
            continue;
        }
        let n = objid as u32 as i32;
        match n {
            0.. if exclusive => holds.push((pid, n as u32)),
            MEMBER_FLOOR..0 if exclusive && ShardKeys::member(pid) == n => {
                let holds = BTreeSet::new();
                members.insert(
                    pid,
                    Member {
                        id: pid,
                        cap: None,
                        holds,
                        knows: None,
                        defines: Arc::default(),
                    },
                );
            }
            COUNT_BASE..CAP_BASE => counts.push((pid, (n - COUNT_BASE) as u32)),
            CAP_BASE..MEMBER_FLOOR => caps.push((pid, (n - CAP_BASE) as u32)),
            _ => {}
        }
    }
    for (pid, cap) in caps {
        if let Some(member) = members.get_mut(&pid) {
            member.cap = Some(cap);
        }
    }
    let mut marked = MarkersRead::new();
    if let Items::Listed(_) = items {
        for member in members.values_mut() {
            let digests = digests.remove(&member.id).unwrap_or_default();
            let (knows, defines, digest) = match read.get(&member.id) {
                // Left out by the statement, as it decides: its digest is the one they were
                // read with.
                Some(before) if digests.contains(&before.digest) => (
                    Arc::clone(&before.knows),
                    Arc::clone(&before.defines),
                    Some(before.digest),
                ),
                _ => {
                    let knows = Arc::new(knows.remove(&member.id).unwrap_or_default());
                    let defines = Arc::new(defines.remove(&member.id).unwrap_or_default());
                    // Kept under its digest; not while it changes it (or it has none).
                    let digest = match digests[..] {
                        [digest] => Some(digest),
                        _ => None,
                    };
                    (knows, defines, digest)
                }
            };
            member.knows = Some(Arc::clone(&knows));
            member.defines = Arc::clone(&defines);
            if let Some(digest) = digest {
                marked.insert(
                    member.id,
                    Marked {
                        digest,
                        knows,
                        defines,
                    },
                );
            }
        }
    }
    let marker = items.marker();
    let mut mismatch = counts
        .iter()
        .find(|(_, count)| *count != marker)
        .map(|(pid, count)| {
            format!(
                "the replica of server process {pid} runs this lock {}, this one {}: every replica \
             of a lock must run it the same way (stop them all to change it)",
                kind_of(*count),
                kind_of(marker)
            )
        });
    if let (None, Some(pid)) = (&mismatch, plain) {
        mismatch = Some(format!(
            "the replica of server process {pid} runs lock {} without --shards: a lock runs \
             either sharded on every replica or on none",
            keys.plain
        ));
    }
    let mut taken = BTreeSet::new();
    // A crontab's job held by a member that knows it and this replica does not (a rolling
    // deploy) still counts among the jobs shared out, so that every replica computes the same
    // shares whatever its own file holds.
    let mut unknown = BTreeSet::new();
    for (pid, shard) in holds {
        let known = items.contains(shard);
        match members.get_mut(&pid) {
            Some(member) if known || matches!(items, Items::Listed(_)) => {
                member.holds.insert(shard);
                if !known {
                    unknown.insert(shard);
                }
            }
            None if known => {
                taken.insert(shard);
            }
            _ => {}
        }
    }
    let items = match items {
        Items::Listed(listing) if !unknown.is_empty() => Items::Listed(Arc::new(Listing {
            items: listing.items.union(&unknown).copied().collect(),
            definitions: listing.definitions.clone(),
        })),
        items => items.clone(),
    };
    let seen = Seen {
        roster: Roster {
            items,
            members: members.into_values().collect(),
        },
        taken,
        mismatch,
        server_time,
        unchanged: false,
    };
    Ok((seen, marked))
}

/// The refusal of a plain replica's session where the replica of server process `pid` runs
/// the same lock with `--shards` (the session's set-up looks: `locks::sharded_replica`), so
/// that the two never both run the command.
pub(crate) fn refusal(pid: i32, lock: &LockKey) -> ConnectError {
    ConnectError::Conflict(format!(
        "the replica of server process {pid} runs lock {lock} with --shards: a lock runs \
         either sharded on every replica or on none"
    ))
}
