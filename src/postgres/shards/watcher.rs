//! A replica's watcher session: nobody is notified when a replica dies, so it waits, in turns,
//! for the member lock of the next member and tells everyone once it is granted.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

use super::statements::ShardKeys;
use crate::election::shards::Watcher;
use crate::election::{ConnectError, Session, SessionError};
use crate::postgres::PgBackend;
use crate::postgres::locks::in_turns;
use crate::postgres::session::{PgSession, query_error};

/// A replica's second session: it waits for the end of one other member.
#[derive(Debug)]
pub struct PgShardWatcher {
    session: PgSession,
    keys: ShardKeys,
    refresh: Duration,
}

impl PgShardWatcher {
    pub async fn open(backend: &PgBackend, name: &str) -> Result<PgShardWatcher, ConnectError> {
        Ok(PgShardWatcher {
            session: backend.session(name).await?,
            keys: ShardKeys::of(&backend.lock),
            refresh: backend.wait_refresh,
        })
    }
}

impl Watcher for PgShardWatcher {
    fn id(&self) -> i32 {
        self.session.id()
    }

    /// Resolves once the member whose holder session is server process `member` has gone
    /// (or left), having told every member. Without polling, in turns (see `shards/mod.rs`). As
    /// with a follower's wait, a watch that was dropped may have been granted meanwhile: the
    /// watcher must then be dropped too.
    fn watch(&self, member: i32) -> impl Future<Output = Result<(), SessionError>> + 'static {
        let (space, key) = (self.keys.space, ShardKeys::member(member));
        let body = format!(
            "PERFORM pg_catalog.pg_advisory_lock_shared({space}, {key}); \
             PERFORM pg_catalog.pg_advisory_unlock_shared({space}, {key}); \
             PERFORM pg_catalog.pg_notify('{}', 'gone {member}');",
            self.keys.channel()
        );
        let sql = in_turns(self.refresh, &body);
        let client: Arc<Client> = self.session.client().clone();
        async move { client.batch_execute(&sql).await.map_err(query_error) }
    }
}
