//! A member's card, written and read, and the roster as a member reads it off the roster
//! script's answer: who runs the name, what each holds, and whether one runs it otherwise
//! (another K, a crontab, or the plain lock), which refuses the join; and the refusal a plain
//! replica gets beside sharded ones.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use super::scripts::{Args, SHARDED_SCRIPT, ShardKeys};
use crate::election::lock::LockKey;
use crate::election::shards::{Items, Member, Roster, Seen, kind_of};
use crate::election::{ConnectError, SessionError};
use crate::redis::session::query_error;

/// A member's card after its nonce: what it runs (`shards=`), its cap, and for a crontab the
/// jobs its file has and how it defines each (`knows=`: numbers, `defines=`: `number:definition`
/// pairs, comma-separated, `-` for none), then how it names itself (`client=... session=...`).
pub(super) fn card_of(items: &Items, cap: Option<u32>, named: &str) -> String {
    let cap = cap.map_or("none".to_owned(), |cap| cap.to_string());
    let listed = match items {
        Items::Listed(listing) => {
            let list = |numbers: Vec<String>| match numbers.is_empty() {
                true => "-".to_owned(),
                false => numbers.join(","),
            };
            format!(
                " knows={} defines={}",
                list(listing.items.iter().map(u32::to_string).collect()),
                list(
                    listing
                        .definitions
                        .iter()
                        .map(|(item, definition)| format!("{item}:{definition}"))
                        .collect()
                )
            )
        }
        Items::Numbered(_) => String::new(),
    };
    format!("shards={} cap={cap}{listed} {named}", items.marker())
}

/// How a card says its member defines each job it knows (`defines=`), by job number.
pub(super) fn definitions_in(card: &str) -> BTreeMap<u32, u32> {
    field(card, "defines")
        .unwrap_or("-")
        .split(',')
        .filter_map(|pair| {
            let (item, definition) = pair.split_once(':')?;
            Some((item.parse().ok()?, definition.parse().ok()?))
        })
        .collect()
}

/// The numbers a card lists in `field` (`knows=`).
fn numbers_in(card: &str, field_name: &str) -> BTreeSet<u32> {
    field(card, field_name)
        .unwrap_or("-")
        .split(',')
        .filter_map(|number| number.parse().ok())
        .collect()
}

/// What a roster read covered: a crontab member's own jobs and those the others' cards know,
/// in the order the script read them; shards as they are.
pub(super) fn seen_items(items: &Items, read: &[u32]) -> Items {
    match items {
        Items::Listed(listing) => {
            Items::Listed(std::sync::Arc::new(crate::election::shards::Listing {
                items: read.iter().copied().collect(),
                definitions: listing.definitions.clone(),
            }))
        }
        Items::Numbered(_) => items.clone(),
    }
}

/// Why a member that shares out what `marker` says cannot run beside member `id`, whose card
/// is `card`: the two run the name in different ways (two shard counts, or shards and a
/// crontab).
pub(super) fn runs_otherwise(id: &str, card: &str, marker: u32) -> String {
    let theirs = match field(card, "shards").and_then(|count| count.parse().ok()) {
        Some(count) => kind_of(count),
        None => "otherwise".to_owned(),
    };
    format!(
        "the replica of member {id} ({}) runs this lock {theirs}, this one {}: every replica of \
         a lock must run it the same way (stop them all to change it)",
        who(card),
        kind_of(marker)
    )
}

/// A `key=value` field of a card or a value; `session` runs to the end.
fn field<'a>(value: &'a str, name: &str) -> Option<&'a str> {
    crate::redis::scripts::field(value, name)
}

/// How a card or a plain lock's value names its replica: `client <id>, session <name>`.
pub(super) fn who(value: &str) -> String {
    format!(
        "client {}, session {}",
        field(value, "client").unwrap_or("?"),
        field(value, "session").unwrap_or("?")
    )
}

/// What a member's card says of its jobs, parsed: the jobs it knows (a crontab's member) and
/// how it defines them.
type Parsed = (Option<Arc<BTreeSet<u32>>>, Arc<BTreeMap<u32, u32>>);

/// The cards a roster read found, by member, each with what was parsed of it: a card the same
/// as at the read before is not parsed again (a crontab member's lists its 1,000 jobs).
#[derive(Debug, Default)]
pub(super) struct Cards(HashMap<i32, (String, Parsed)>);

/// The roster script's answer: the server's clock, the live members, each item's holder,
/// a live plain replica of the name, the items the others' cards added, and the answer's
/// digest (all three lists empty when the caller sent that digest: the same as then).
pub(super) type Answer = (
    i64,
    i64,
    Vec<String>,
    Vec<i64>,
    Option<String>,
    Vec<u32>,
    String,
);

/// Reads the roster script's answer, as seen by a member that shares out `items`: the holders
/// are in the order of `read` (the items the script read: for a crontab, this member's jobs
/// and those the others' cards know), and a member whose card says it runs the name
/// otherwise is a mismatch.
pub(super) fn read_roster(
    items: &Items,
    read: &[u32],
    (flat, before): (&[String], &Cards),
    holders: &[i64],
    server_time: jiff::Timestamp,
) -> Result<(Seen, Cards), SessionError> {
    let mut members: BTreeMap<i32, Member> = BTreeMap::new();
    let mut cards = Cards::default();
    let mut mismatch = None;
    for pair in flat.chunks(2) {
        let [id, card] = pair else {
            return Err(SessionError::Query(format!(
                "the roster's members are not in pairs: {flat:?}"
            )));
        };
        let Ok(id) = id.parse::<i32>() else {
            continue;
        };
        if field(card, "shards") != Some(items.marker().to_string().as_str()) {
            mismatch.get_or_insert_with(|| runs_otherwise(&id.to_string(), card, items.marker()));
        }
        let cap = field(card, "cap").and_then(|cap| cap.parse().ok());
        let (knows, defines) = match before.0.get(&id) {
            Some((same, parsed)) if same == card => parsed.clone(),
            _ => {
                let listed = matches!(items, Items::Listed(_));
                let knows = listed.then(|| Arc::new(numbers_in(card, "knows")));
                (knows, Arc::new(definitions_in(card)))
            }
        };
        cards
            .0
            .insert(id, (card.clone(), (knows.clone(), Arc::clone(&defines))));
        members.insert(
            id,
            Member {
                id,
                cap,
                holds: BTreeSet::new(),
                knows,
                defines,
            },
        );
    }
    let mut taken = BTreeSet::new();
    for (&shard, holder) in read.iter().zip(holders) {
        match *holder {
            0 => {}
            id => match i32::try_from(id).ok().and_then(|id| members.get_mut(&id)) {
                Some(member) => {
                    member.holds.insert(shard);
                }
                None => {
                    taken.insert(shard);
                }
            },
        }
    }
    let seen = Seen {
        roster: Roster {
            items: items.clone(),
            members: members.into_values().collect(),
        },
        taken,
        mismatch,
        server_time,
        unchanged: false,
    };
    Ok((seen, cards))
}

/// Refuses a plain replica's session where replicas run the same lock with `--shards`, so
/// that the two never both run the command: one round trip when a plain replica connects.
pub(crate) async fn refuse_beside_shards(
    conn: &mut MultiplexedConnection,
    lock: &LockKey,
) -> Result<(), ConnectError> {
    let args = Args {
        keys: ShardKeys::of(lock),
        id: "0".into(),
        nonce: String::new(),
        lease: Duration::ZERO,
        items: Items::default(),
        retiring: BTreeSet::new(),
    };
    let card: Option<String> = match args.invocation(&SHARDED_SCRIPT).invoke_async(conn).await {
        Ok(card) => card,
        // An ACL that keeps this user from the shards' keys (or from scripts) keeps it from
        // running shards too; the lock's own scripts say what it refuses.
        Err(err) if matches!(query_error(err.clone()), SessionError::Unsafe(_)) => None,
        Err(err) => return Err(ConnectError::Transient(err.to_string())),
    };
    match card {
        Some(card) => Err(ConnectError::Conflict(format!(
            "the replica of member {} ({}) runs lock {lock} {}: a lock runs either sharded on \
             every replica or on none",
            field(&card, "member").unwrap_or("?"),
            who(&card),
            match field(&card, "shards").and_then(|count| count.parse().ok()) {
                Some(0) => kind_of(0),
                _ => "with --shards".to_owned(),
            }
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roster_names_each_shard_s_holder_and_what_no_member_holds() {
        let flat: Vec<String> = [
            "2",
            "nonce=aa shards=4 cap=none client=9 session=x",
            "5",
            "nonce=bb shards=4 cap=1 client=10 session=y",
        ]
        .map(str::to_owned)
        .to_vec();
        let (seen, _) = read_roster(
            &Items::Numbered(4),
            &[0, 1, 2, 3],
            (&flat, &Cards::default()),
            &[2, 0, 5, -1],
            jiff::Timestamp::UNIX_EPOCH,
        )
        .expect("a roster");
        assert_eq!(
            seen.roster.members,
            vec![
                Member {
                    id: 2,
                    cap: None,
                    holds: BTreeSet::from([0]),
                    knows: None,
                    defines: Arc::default(),
                },
                Member {
                    id: 5,
                    cap: Some(1),
                    holds: BTreeSet::from([2]),
                    knows: None,
                    defines: Arc::default(),
                },
            ]
        );
        assert_eq!(seen.taken, BTreeSet::from([3]));
        assert_eq!(seen.free(), vec![1]);
    }

    #[test]
    fn a_card_the_same_as_at_the_last_read_is_not_parsed_again() {
        let items = Items::Listed(Arc::new(crate::election::shards::Listing {
            items: BTreeSet::from([1, 2, 3]),
            definitions: BTreeMap::new(),
        }));
        let card = |knows: &str| {
            format!("nonce=aa shards=0 cap=none knows={knows} defines=1:7 client=9 session=x")
        };
        let read = |cards: &[String], before: &Cards| {
            let flat: Vec<String> = ["2".to_owned(), cards[0].clone()].to_vec();
            read_roster(
                &items,
                &[1, 2, 3],
                (&flat, before),
                &[2, 0, 0],
                jiff::Timestamp::UNIX_EPOCH,
            )
            .expect("a roster")
        };
        let (first, cards) = read(&[card("1,2")], &Cards::default());
        let (again, cards) = read(&[card("1,2")], &cards);
        let knows = |seen: &Seen| {
            seen.roster.members[0]
                .knows
                .clone()
                .expect("a crontab's member")
        };
        assert!(Arc::ptr_eq(&knows(&first), &knows(&again)));
        let (changed, _) = read(&[card("1,2,3")], &cards);
        assert_eq!(*knows(&changed), BTreeSet::from([1, 2, 3]));
        assert_eq!(*changed.roster.members[0].defines, BTreeMap::from([(1, 7)]));
    }
}
