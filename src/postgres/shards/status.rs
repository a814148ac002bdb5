//! What `pgleader status` reads of a sharded lock: who holds which shard, and for a crontab how
//! each replica defines each job it knows. It only reads `pg_locks`, so it changes nothing.

use std::collections::{BTreeMap, BTreeSet};

use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::statements::{CAP_BASE, COUNT_BASE, MARKERS_SQL, MEMBER_FLOOR, STATUS_SQL, ShardKeys};
use crate::election::lock::LockKey;
use crate::election::participant::{Participant, ShardReplica, ShardsView};
use crate::postgres::describe::describe;

/// Who holds which shard of the sharded lock of `lock`'s name, for `status`: `None` when no
/// replica runs it sharded. For a crontab, how each replica defines each job it knows too.
pub async fn view(client: &Client, lock: &LockKey) -> Result<Option<ShardsView>, String> {
    let keys = ShardKeys::of(lock);
    let space = keys.space() as u32;
    let rows = client
        .query_typed(STATUS_SQL, &[(&space, Type::OID)])
        .await
        .map_err(|err| format!("cannot read the shards from pg_locks: {}", describe(&err)))?;
    let mut replicas: BTreeMap<i32, ShardReplica> = BTreeMap::new();
    let (mut count, mut caps, mut holds) = (None, Vec::new(), Vec::new());
    for row in &rows {
        let (pid, objid, exclusive): (i32, i64, bool) = (row.get(0), row.get(1), row.get(2));
        match objid as u32 as i32 {
            n @ 0.. if exclusive => holds.push((pid, n as u32)),
            n @ MEMBER_FLOOR..0 if exclusive && ShardKeys::member(pid) == n => {
                replicas.insert(
                    pid,
                    ShardReplica {
                        member: pid,
                        participant: Participant {
                            backend_pid: pid,
                            granted: true,
                            application_name: row.get(3),
                            client_address: row.get(4),
                            client_port: row.get(5),
                            backend_start: row.get(6),
                            ..Participant::default()
                        },
                        cap: None,
                        holds: Vec::new(),
                        defines: BTreeMap::new(),
                    },
                );
            }
            n @ COUNT_BASE..CAP_BASE => {
                count.get_or_insert((n - COUNT_BASE) as u32);
            }
            n @ CAP_BASE..MEMBER_FLOOR => caps.push((pid, (n - CAP_BASE) as u32)),
            _ => {}
        }
    }
    let Some(count) = count else {
        return Ok(None);
    };
    for (pid, cap) in caps {
        if let Some(replica) = replicas.get_mut(&pid) {
            replica.cap = Some(cap);
        }
    }
    for (pid, shard) in holds {
        if let Some(replica) = replicas.get_mut(&pid) {
            replica.holds.push(shard);
        }
    }
    if count == 0 {
        read_definitions(client, &keys, &mut replicas).await?;
    }
    Ok(Some(ShardsView {
        count,
        replicas: replicas.into_values().collect(),
    }))
}

/// Reads how each crontab replica defines each job it knows: its "knows" markers first, then
/// the "defines" markers of those jobs.
async fn read_definitions(
    client: &Client,
    keys: &ShardKeys,
    replicas: &mut BTreeMap<i32, ShardReplica>,
) -> Result<(), String> {
    let markers = async |spaces: Vec<u32>| {
        client
            .query_typed(MARKERS_SQL, &[(&spaces, Type::OID_ARRAY)])
            .await
            .map_err(|err| {
                format!(
                    "cannot read the jobs' markers from pg_locks: {}",
                    describe(&err)
                )
            })
    };
    let mut knows: BTreeMap<i32, BTreeSet<u32>> = BTreeMap::new();
    for row in markers(vec![keys.knows as u32]).await? {
        let (pid, item): (i32, i64) = (row.get(0), row.get(2));
        knows.entry(pid).or_default().insert(item as u32);
    }
    let spaces = keys.defines_of(knows.values().flatten().copied());
    if spaces.is_empty() {
        return Ok(());
    }
    for row in markers(spaces.keys().copied().collect()).await? {
        let (pid, classid, definition): (i32, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let Some(&item) = spaces.get(&(classid as u32)) else {
            continue;
        };
        if let Some(replica) = replicas.get_mut(&pid)
            && knows.get(&pid).is_some_and(|known| known.contains(&item))
        {
            replica.defines.insert(item, definition as u32);
        }
    }
    Ok(())
}
