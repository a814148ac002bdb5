//! One connection to a Redis server, opened by pgleader itself: the TCP socket (with keepalives
//! that add up to the lease), TLS with the certificate verified, then redis-rs' RESP3 handshake
//! (`HELLO 3 AUTH`) over that stream. pgleader owns the socket rather than letting the driver
//! dial, so that it can set its options and, for a leader, hand a duplicate of it to the keeper.
//!
//! What every connection checks before it is used, and what each failure means:
//! - a wrong password, an unknown user, or an ACL that refuses a command pgleader needs (TIME,
//!   INFO, SUBSCRIBE, EVAL): permanent, the message names the password or the ACL;
//! - a replica (`role:slave`): refused for leading, and retried, since a failover may promote it;
//! - a Cluster node (`cluster_enabled:1`): permanent; a lock on one shard is not what a Cluster
//!   user means by a lock;
//! - unreachable, loading its data, no answer: retried with backoff.

use std::os::fd::{AsFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, RedisConnectionInfo, RedisError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::election::ConnectError;
use crate::election::lease::Lease;
use crate::election::socket::{Farewell, Lent, LentSocket, keepalives};
use crate::redis::url::{RedisServer, TlsSettings};

/// What a connection is for: a session may lead, so it must reach a primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    Elect,
    Observe,
}

/// An open connection, the task that drives it, and the pushes it receives (tracking
/// invalidations, and the driver's own notice that the connection is gone).
#[derive(Debug)]
pub struct Connection {
    pub conn: MultiplexedConnection,
    pub pushes: mpsc::UnboundedReceiver<PushInfo>,
    pub driver: JoinHandle<()>,
    /// The server's id for this connection (`CLIENT ID`), 0 if the ACL hides it.
    pub client_id: i64,
    pub server_major: u32,
    /// The socket, owned by the driver task: lent to the keeper while it is still open.
    pub socket: LentSocket,
    /// Whether TLS runs over the socket: then only the process that holds the TLS session can
    /// write on it, and the keeper is lent the socket without a farewell.
    pub tls: bool,
    /// The ledger scripts that may be on their way on this connection at once (see
    /// [`LEDGER_SLOTS`]).
    pub ledger_slots: Arc<tokio::sync::Semaphore>,
}

/// How many ledger scripts a connection has on their way at once. Each is bounded by the
/// ledger's timeout from when it is sent (a quorum's ledger bounds each member's from the call
/// as well: a crontab does not run on a quorum), which must measure the server, not a queue of
/// this replica's own: a crontab of 1,000 jobs on 3 replicas claims 333 occurrences at one instant,
/// and with all of them sent at once the last waited behind 332 others on a machine busy
/// starting their commands, past the 1 s timeout, which lost the replica's session and every
/// job with it (334 of 2,000 occurrences never ran in the benchmark's burst). The rest wait
/// their turn in order (the semaphore is fair), the checks never behind more than these.
pub const LEDGER_SLOTS: usize = 8;

impl Connection {
    /// The socket's descriptor if it still is this connection's socket: in a quorum the session
    /// lives on with its other servers after one connection ended (see [`LentSocket::open`]).
    pub fn open_socket(&self) -> Option<RawFd> {
        self.socket.open()
    }

    /// The socket, if still open, for the keeper, with the farewell `command` builds for a
    /// fresh marker (the script must answer with the marker). Over TLS without one: the keeper
    /// cannot speak inside pgleader's TLS session, so a crash there is noticed at the next
    /// check, as before.
    pub fn lend(&self, command: impl FnOnce(&str) -> Vec<u8>) -> Option<Lent> {
        let fd = self.open_socket()?;
        let farewell = (!self.tls).then(|| {
            let marker = Farewell::marker();
            Farewell {
                command: command(&marker),
                marker: marker.into_bytes(),
            }
        });
        Some(Lent { fd, farewell })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Dropping the driver closes the socket, which is what tells the server (and every
        // follower watching this session's liveness channel) that this session is gone.
        self.driver.abort();
    }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Opens and checks a connection. `lease` sets the socket's keepalives (so that a dead server
/// is noticed) for election sessions.
pub async fn open(
    server: &RedisServer,
    name: &str,
    lease: Option<&Lease>,
    purpose: Purpose,
) -> Result<Connection, ConnectError> {
    let budget = server.connect_timeout;
    let bounded = |what: &'static str| {
        move |_| {
            ConnectError::Transient(format!(
                "no answer within {} ({what})",
                humantime::format_duration(budget)
            ))
        }
    };
    let tcp = tokio::time::timeout(
        budget,
        TcpStream::connect((server.host.as_str(), server.port)),
    )
    .await
    .map_err(bounded("connecting"))?
    .map_err(|err| ConnectError::Transient(format!("{err}")))?;
    let _ = tcp.set_nodelay(true);
    if let Some(lease) = lease {
        keepalives(tcp.as_fd(), lease);
    }
    let socket = LentSocket::of(&tcp)
        .map_err(|err| ConnectError::Transient(format!("fstat of the socket: {err}")))?;
    let stream: Box<dyn Stream> = match &server.tls {
        None => Box::new(tcp),
        Some(tls) => {
            let connector = tls_connector(tls).map_err(ConnectError::Permanent)?;
            let name = rustls::pki_types::ServerName::try_from(server.host.clone())
                .map_err(|err| ConnectError::Permanent(format!("{}: {err}", server.host)))?;
            let tls_stream = tokio::time::timeout(budget, connector.connect(name, tcp))
                .await
                .map_err(bounded("the TLS handshake"))?
                .map_err(|err| tls_error(tls, &err))?;
            Box::new(tls_stream)
        }
    };
    let mut info = RedisConnectionInfo::default()
        .set_protocol(ProtocolVersion::RESP3)
        .set_skip_set_lib_name()
        .set_db(server.db);
    if let Some(user) = &server.user {
        info = info.set_username(user);
    }
    if let Some(password) = &server.password {
        info = info.set_password(&password.0);
    }
    let (sender, pushes) = mpsc::unbounded_channel();
    let config = AsyncConnectionConfig::new()
        .set_push_sender(sender)
        .set_response_timeout(None)
        .set_connection_timeout(None);
    let (mut conn, driver) = tokio::time::timeout(
        budget,
        MultiplexedConnection::new_with_config(&info, stream, config),
    )
    .await
    .map_err(bounded("the handshake"))?
    .map_err(|err| classify(server, &err))?;
    let driver = tokio::spawn(driver);
    let mut connection = Connection {
        conn: conn.clone(),
        pushes,
        driver,
        client_id: 0,
        server_major: 0,
        socket,
        tls: server.tls.is_some(),
        ledger_slots: Arc::new(tokio::sync::Semaphore::new(LEDGER_SLOTS)),
    };
    let checks = async {
        let mut setup = redis::pipe();
        setup
            .cmd("CLIENT")
            .arg("SETNAME")
            .arg(client_name(name))
            .ignore();
        let _: Result<(), _> = setup.query_async(&mut conn).await;
        connection.client_id = redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut conn)
            .await
            .unwrap_or(0);
        let info: String = redis::cmd("INFO")
            .query_async(&mut conn)
            .await
            .map_err(|err| refused(server, "INFO", &err))?;
        let _: (String, String) = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(|err| refused(server, "TIME", &err))?;
        let facts = ServerInfo::parse(&info);
        if facts.cluster_enabled {
            return Err(ConnectError::Permanent(
                "the server is a Redis Cluster node: a lock on one shard is not a lock across the \
                 cluster. Give pgleader a standalone Redis server (or several, for a quorum)"
                    .to_string(),
            ));
        }
        if purpose == Purpose::Elect && facts.role.as_deref() == Some("slave") {
            return Err(ConnectError::Transient(
                "the server is a replica (role:slave); pgleader leads only through a primary"
                    .to_string(),
            ));
        }
        Ok::<_, ConnectError>(facts.major)
    };
    connection.server_major = tokio::time::timeout(budget, checks)
        .await
        .map_err(bounded("the connection's checks"))??;
    Ok(connection)
}

/// A client name may not contain spaces.
fn client_name(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect()
}

/// What `INFO` says that pgleader needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ServerInfo {
    pub role: Option<String>,
    pub cluster_enabled: bool,
    pub uptime: Option<Duration>,
    pub run_id: Option<String>,
    pub major: u32,
}

impl ServerInfo {
    pub fn parse(info: &str) -> ServerInfo {
        let mut facts = ServerInfo::default();
        for line in info.lines() {
            let Some((name, value)) = line.trim_end().split_once(':') else {
                continue;
            };
            match name {
                "role" => facts.role = Some(value.to_owned()),
                "cluster_enabled" => facts.cluster_enabled = value == "1",
                "uptime_in_seconds" => {
                    facts.uptime = value.parse().ok().map(Duration::from_secs);
                }
                "run_id" => facts.run_id = Some(value.to_owned()),
                "redis_version" => {
                    facts.major = value
                        .split('.')
                        .next()
                        .and_then(|major| major.parse().ok())
                        .unwrap_or(0);
                }
                _ => {}
            }
        }
        facts
    }
}

/// Sorts a failure of the handshake or of a command by whether retrying can help.
pub fn classify(server: &RedisServer, err: &RedisError) -> ConnectError {
    match err.code() {
        Some("WRONGPASS" | "NOAUTH") => ConnectError::Permanent(format!(
            "authentication failed: the user name or password is wrong{}",
            password_hint(server)
        )),
        Some("NOPERM") => ConnectError::Permanent(format!(
            "the Redis ACL does not authorize what pgleader needs: {}",
            err.detail().unwrap_or("permission denied")
        )),
        _ if err.kind() == redis::ErrorKind::AuthenticationFailed => ConnectError::Permanent(
            format!("authentication failed ({err}){}", password_hint(server)),
        ),
        // SELECT failed: the database number is out of range (the server's `databases`,
        // fixed until it restarts) or the ACL refuses SELECT. Like a missing PostgreSQL
        // database, waiting does not help.
        _ if err.to_string().contains("refused to switch database") => {
            ConnectError::Permanent(format!(
                "the server refused to select database {} ({}): it has databases 0 \
                 to `databases` - 1 (16 by default)",
                server.db,
                err.detail().unwrap_or("no reason given")
            ))
        }
        _ if err.kind() == redis::ErrorKind::RESP3NotSupported => ConnectError::Permanent(
            "the server does not speak RESP3: pgleader needs Redis 6 or later".to_string(),
        ),
        _ => ConnectError::Transient(format!("{err}")),
    }
}

/// A command pgleader needs, refused: by the ACL (permanent, saying what to grant), or for
/// another reason.
fn refused(server: &RedisServer, command: &str, err: &RedisError) -> ConnectError {
    if err.code() == Some("NOPERM") {
        let user = server.user.as_deref().unwrap_or("default");
        return ConnectError::Permanent(format!(
            "the Redis ACL does not authorize {command} for user {user:?}; pgleader \
             needs it (ACL SETUSER {user} +time +info; README, \"Redis\", lists the whole ACL)"
        ));
    }
    classify(server, err)
}

fn password_hint(server: &RedisServer) -> String {
    match server.password_source {
        Some(source) => format!(" (the password came from {source})"),
        None => " (no password was given: put it in the URL or REDISCLI_AUTH)".into(),
    }
}

fn tls_connector(settings: &TlsSettings) -> Result<tokio_rustls::TlsConnector, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match &settings.ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
                .map_err(|err| format!("cannot read CA file {}: {err}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "CA file {} holds no PEM certificate",
                    path.display()
                ));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|err| format!("cannot use CA file {}: {err}", path.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(
                    "no certificate found in the system's certificate store (install \
                            ca-certificates, or name a CA file with ?cacert=)"
                        .into(),
                );
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|err| err.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A failed TLS handshake: a certificate that does not verify is permanent.
fn tls_error(settings: &TlsSettings, err: &std::io::Error) -> ConnectError {
    let against = match &settings.ca_file {
        Some(path) => format!("the CA file {}", path.display()),
        None => "the system's trusted certificates".into(),
    };
    let certificate = err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|err| {
            matches!(
                err,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        });
    if certificate {
        ConnectError::Permanent(format!(
            "the server's TLS certificate does not verify against {against}: {err}"
        ))
    } else {
        ConnectError::Transient(format!("the TLS handshake failed: {err}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_needs_from_info() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\nuptime_in_seconds:42\r\n\
                    # Replication\r\nrole:master\r\n# Cluster\r\ncluster_enabled:0\r\n";
        assert_eq!(
            ServerInfo::parse(info),
            ServerInfo {
                role: Some("master".into()),
                cluster_enabled: false,
                uptime: Some(Duration::from_secs(42)),
                run_id: Some("abc".into()),
                major: 7,
            }
        );
    }

    #[test]
    fn a_client_name_has_no_spaces() {
        assert_eq!(client_name("job x:1@h"), "job_x:1@h");
    }
}
