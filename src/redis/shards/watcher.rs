//! A replica's watcher connection: nobody is told when a connection closes, so it asks, every
//! `--check-interval`, whether the next member is still connected, and tells everyone once it
//! is not.

use std::collections::BTreeSet;
use std::time::Duration;

use super::scripts::{Args, GONE_SCRIPT, ShardKeys};
use crate::election::shards::{Items, Watcher};
use crate::election::{ConnectError, SessionError};
use crate::redis::RedisBackend;
use crate::redis::connection::{self, Connection, Purpose};
use crate::redis::session::{no_answer, query_error};

/// A replica's second connection: it asks whether one other member is gone.
#[derive(Debug)]
pub struct RedisShardWatcher {
    connection: Connection,
    args: Args,
    poll: Duration,
    timeout: Duration,
}

impl RedisShardWatcher {
    pub async fn open(backend: &RedisBackend, name: &str) -> Result<Self, ConnectError> {
        let connection =
            connection::open(&backend.server, name, Some(&backend.lease), Purpose::Elect).await?;
        Ok(RedisShardWatcher {
            connection,
            args: Args {
                keys: ShardKeys::of(&backend.lock),
                id: "0".into(),
                nonce: String::new(),
                lease: backend.lease.duration(),
                items: Items::default(),
                retiring: BTreeSet::new(),
            },
            poll: backend.poll,
            timeout: backend.server.connect_timeout,
        })
    }
}

impl Watcher for RedisShardWatcher {
    /// The watcher connection's client id.
    fn id(&self) -> i32 {
        i32::try_from(self.connection.client_id).unwrap_or(i32::MAX)
    }

    /// Resolves once member `member` is gone (or left), every member told: asks once per
    /// `--check-interval`, each ask bounded by the connect timeout plus that interval.
    fn watch(&self, member: i32) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let mut conn = self.connection.conn.clone();
        let args = self.args.clone();
        let (poll, bound) = (self.poll, self.timeout + self.poll);
        async move {
            loop {
                let gone: i64 = tokio::time::timeout(
                    bound,
                    args.invocation(&GONE_SCRIPT)
                        .arg(member)
                        .invoke_async(&mut conn),
                )
                .await
                .map_err(|_| no_answer(bound))?
                .map_err(query_error)?;
                if gone == 1 {
                    return Ok(());
                }
                tokio::time::sleep(poll).await;
            }
        }
    }
}
