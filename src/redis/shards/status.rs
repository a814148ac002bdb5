//! What `pgleader status` reads of a sharded name: the live members' cards and the item keys
//! that name them, with plain reads (no script), so that it changes nothing.

use std::collections::BTreeSet;

use redis::aio::MultiplexedConnection;

use super::roster::definitions_in;
use super::scripts::ShardKeys;
use crate::election::participant::{ShardReplica, ShardsView};
use crate::redis::ledger::participant;
use crate::redis::scripts;

/// Who holds which shard of the sharded lock whose keys start with `base`, for `status`: the
/// members whose card has not expired, with the shards whose keys name them; `None` when no
/// replica runs it sharded. It changes nothing.
pub async fn view(
    conn: &mut MultiplexedConnection,
    base: &str,
) -> Result<Option<ShardsView>, String> {
    let keys = ShardKeys {
        base: base.to_owned(),
    };
    let fail = |err: redis::RedisError| format!("cannot read the shards: {err}");
    let mut ids: Vec<i32> = redis::cmd("SMEMBERS")
        .arg(keys.members())
        .query_async(conn)
        .await
        .map_err(fail)?;
    ids.sort_unstable();
    if ids.is_empty() {
        return Ok(None);
    }
    let cards: Vec<Option<String>> = redis::cmd("MGET")
        .arg(ids.iter().map(|id| keys.member(*id)).collect::<Vec<_>>())
        .query_async(conn)
        .await
        .map_err(fail)?;
    let live: Vec<(i32, String)> = ids
        .into_iter()
        .zip(cards)
        .filter_map(|(id, card)| Some((id, card?)))
        .collect();
    let Some(count) = live
        .iter()
        .find_map(|(_, card)| scripts::field(card, "shards")?.parse::<u32>().ok())
    else {
        return Ok(None);
    };
    // A crontab's items are its jobs' numbers, which no card lists: its item keys say.
    let items: Vec<u32> = if count == 0 {
        item_keys(conn, &keys).await.map_err(fail)?
    } else {
        (0..count).collect()
    };
    let holders: Vec<Option<String>> = if items.is_empty() {
        Vec::new()
    } else {
        redis::cmd("MGET")
            .arg(items.iter().map(|n| keys.shard(*n)).collect::<Vec<_>>())
            .query_async(conn)
            .await
            .map_err(fail)?
    };
    let replicas = live
        .iter()
        .map(|(id, card)| ShardReplica {
            member: *id,
            participant: participant(card, true),
            cap: scripts::field(card, "cap").and_then(|cap| cap.parse().ok()),
            holds: items
                .iter()
                .zip(&holders)
                .filter(|(_, value)| {
                    value
                        .as_deref()
                        .and_then(|value| scripts::field(value, "member"))
                        == Some(id.to_string().as_str())
                })
                .map(|(n, _)| *n)
                .collect(),
            defines: definitions_in(card),
        })
        .collect();
    Ok(Some(ShardsView { count, replicas }))
}

/// The numbers of the item keys of a name that exist now, in order (`SCAN`, for `status`).
async fn item_keys(
    conn: &mut MultiplexedConnection,
    keys: &ShardKeys,
) -> redis::RedisResult<Vec<u32>> {
    let prefix = keys.shard(0);
    let prefix = &prefix[..prefix.len() - 1];
    let pattern = format!("{}*", scripts::glob_escape(prefix));
    let found: BTreeSet<u32> = scripts::scan(conn, &pattern)
        .await?
        .iter()
        .filter_map(|key| key.strip_prefix(prefix)?.parse::<u32>().ok())
        .collect();
    Ok(found.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_s_item_keys_are_scanned_for_literally() {
        assert_eq!(
            scripts::glob_escape("pgleader:{a*[b]?\\}:shard:"),
            "pgleader:{a\\*\\[b\\]\\?\\\\}:shard:"
        );
    }
}
