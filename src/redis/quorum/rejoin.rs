//! A leader's way back to a server it lost (its connection ended, or it was not reachable at
//! first): a new connection, with this leadership's key set there again.
//!
//! Without it, a leader over three servers that saw one restart and then another (a rolling
//! restart) would step down at the second, though a majority is up all along. Setting the key
//! again is an acquire on that server, as at the start, and safe for the same reason: the
//! script sets it only where it is free (or already this session's), and this session leads
//! through a majority that holds it meanwhile. A server restarted within the lease may take it
//! too: the delayed restart keeps a young server from voting for a *new* holder, and this
//! leader is the holder the majority confirms. The keeper is not given the new socket: a kill -9
//! of pgleader frees the key there at once, but the keeper still holds the majority it started
//! with until the command's tree is dead.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::session::{Member, QuorumSession, Rejoined, raise_epoch};
use crate::redis::connection::{self, Purpose};
use crate::redis::session::{acquire, enlist, query_error};
use crate::redis::url::RedisServer;

impl QuorumSession {
    /// While leading, connects again to the servers this session lost or never reached (see
    /// [`Rejoined`]), at most once per check interval.
    pub(super) fn start_rejoins(&mut self) {
        self.next_rejoin = Instant::now() + self.poll;
        let gone = self
            .members
            .iter()
            .enumerate()
            .filter(|(index, _)| self.gone[*index]);
        let mut targets: Vec<(Result<usize, usize>, RedisServer)> = gone
            .map(|(index, member)| (Ok(index), member.server.clone()))
            .collect();
        for (index, server) in self.absent.iter().enumerate() {
            if let Some(server) = server {
                targets.push((Err(index), server.clone()));
            }
        }
        for (slot, server) in targets {
            let (name, lease, args) = (self.name.clone(), self.lease, self.args.clone());
            let epoch = self.epoch.load(Ordering::Relaxed);
            let bound = server.connect_timeout * 2;
            self.rejoins.spawn(async move {
                let rejoin = async {
                    let mut connection =
                        connection::open(&server, &name, Some(&lease), Purpose::Elect).await?;
                    let also = [args.keys.released()];
                    enlist(&mut connection, &server, &args.keys, &args.nonce, &also).await?;
                    let mut conn = connection.conn.clone();
                    if !acquire(&mut conn, &args, "try", Duration::ZERO).await? {
                        return Err("the key there is another session's".into());
                    }
                    raise_epoch(&mut conn, args.keys.epoch(), epoch)
                        .await
                        .map_err(query_error)?;
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(connection)
                };
                let connection = match tokio::time::timeout(bound, rejoin).await {
                    Ok(result) => result.map_err(|err| err.to_string()),
                    Err(_) => Err("no answer in time".into()),
                };
                Rejoined {
                    slot,
                    server,
                    connection,
                }
            });
        }
    }

    /// Makes a reconnection a member, if this session still leads.
    pub(super) fn install(&mut self, rejoined: Rejoined) {
        let connection = match rejoined.connection {
            Ok(connection) if self.leading.load(Ordering::Relaxed) => connection,
            Ok(_) => return,
            Err(reason) => {
                tracing::debug!(server = %rejoined.server, %reason, "not connected again yet");
                return;
            }
        };
        self.generations += 1;
        let index = match rejoined.slot {
            Ok(index) => index,
            Err(absent) => {
                self.absent[absent] = None;
                self.lost.push(None);
                self.gone.push(false);
                self.suspect.push(false);
                self.members.len()
            }
        };
        tracing::info!(
            event = "redis_server_rejoined",
            server = %rejoined.server,
            "connected to {} again, and this leadership's key is set there",
            rejoined.server
        );
        let forwarding = (&self.args.keys, &self.released, &self.out);
        let member = Member::new(
            rejoined.server,
            connection,
            (index, self.generations),
            forwarding,
        );
        if index == self.members.len() {
            self.members.push(member);
        } else {
            self.members[index] = member;
        }
        (self.lost[index], self.gone[index], self.suspect[index]) = (None, false, false);
    }
}
