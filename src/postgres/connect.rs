//! Opening a connection to PostgreSQL. pgleader dials each server itself and hands the stream
//! to tokio-postgres (`Config::connect_raw`) rather than letting the driver dial, so that it owns
//! the socket: it sets the lease's keepalives on it, and a leader lends it to the keeper, which
//! holds it until the command's whole tree is gone. A kill -9 of pgleader then frees the lock
//! only after the last process of that tree (see `Session::sockets`).
//!
//! What the driver's own connect did is done here, the way libpq does it: the hosts are tried in
//! order (shuffled with `load_balance_hosts=random`), each address a host name resolves to in
//! turn, `hostaddr` instead of resolving, Unix-socket directories (never with TLS, whatever the
//! sslmode), `connect_timeout` for each attempt (the handshake included, so a server that
//! accepts and then says nothing is passed over too), sslmode `allow` and `prefer` falling back
//! to plaintext when the TLS handshake fails, and `target_session_attrs=read-write`: a server
//! whose `transaction_read_only` is on is passed over for the next. The error of the last
//! attempt is the one returned.
//!
//! The driver's cancel token needs the socket settings only its own connect records; pgleader
//! never cancels a query (it closes the session instead), so the token is left without them.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Notification, SimpleQueryMessage};

use crate::election::ConnectError;
use crate::election::lease::Lease;
use crate::election::socket::{LentSocket, keepalives};
use crate::postgres::conninfo::{ConnSettings, Endpoint, Host, TargetSessionAttrs, TlsSettings};
use crate::postgres::describe::describe;
use crate::postgres::tls::{self, Connector};

/// The task that drives a connection; it owns the socket.
pub type ConnectionTask = JoinHandle<Result<(), tokio_postgres::Error>>;

/// What a session that LISTENs hears: the notifications the connection task passes on.
pub type Notifications = mpsc::UnboundedReceiver<Notification>;

/// An open connection: the client, the task driving it, and its socket.
#[derive(Debug)]
pub struct Opened {
    pub client: Client,
    pub connection: ConnectionTask,
    /// The notifications the server sent (only a session that LISTENs gets any).
    pub notifications: Notifications,
    /// The server's `server_version` parameter, as it reported it at start-up.
    pub server_version: Option<String>,
    pub socket: LentSocket,
    /// A TCP connection's two ends; `None` over a Unix socket.
    pub tcp_ends: Option<TcpEnds>,
}

/// A TCP connection's two ends as this host sees them, to compare with the server's view of
/// the same connection (see `PgSession::connect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpEnds {
    /// This host's address and port.
    pub local: SocketAddr,
    /// The address and port dialled.
    pub peer: SocketAddr,
}

/// A TCP or Unix-socket stream, for the driver.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type Stream = Box<dyn Io>;

/// One address to dial.
#[derive(Debug)]
enum Target {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// Connects to the first server in `settings` that takes the connection (and is writable, with
/// `target_session_attrs=read-write`). `config` carries who connects and how to log in; `lease`
/// sets the socket's keepalives for election sessions.
pub async fn connect(
    settings: &ConnSettings,
    config: &tokio_postgres::Config,
    lease: Option<&Lease>,
) -> Result<Opened, ConnectError> {
    let connector = tls::connector(&settings.tls).map_err(ConnectError::Permanent)?;
    let mut endpoints: Vec<&Endpoint> = settings.endpoints.iter().collect();
    if settings.load_balance_hosts {
        fastrand::shuffle(&mut endpoints);
    }
    let mut last = None;
    for endpoint in endpoints {
        let targets = match targets(endpoint, settings.load_balance_hosts).await {
            Ok(targets) => targets,
            Err(err) => {
                tracing::debug!(event = "connect_failed", host = %endpoint, reason = %err);
                last = Some(err);
                continue;
            }
        };
        let attempt = Attempt {
            settings,
            config,
            connector: &connector,
            lease,
            // The name the server's certificate must be for, even when hostaddr says where to
            // dial. Unix sockets never carry TLS.
            server_name: match &endpoint.host {
                Host::Tcp(name) => name.as_str(),
                Host::Socket(_) => "",
            },
        };
        for target in targets {
            match attempt.run(&target).await {
                Ok(opened) => return Ok(opened),
                Err(err) => {
                    tracing::debug!(event = "connect_failed", host = %endpoint, reason = %err);
                    last = Some(err);
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| ConnectError::Permanent("no host to connect to".into())))
}

/// Where a host's server listens: its Unix socket, its `hostaddr`, or every address its name
/// resolves to.
async fn targets(endpoint: &Endpoint, shuffle: bool) -> Result<Vec<Target>, ConnectError> {
    let name = match (&endpoint.host, endpoint.hostaddr) {
        (Host::Socket(dir), _) => {
            return Ok(vec![Target::Unix(
                dir.join(format!(".s.PGSQL.{}", endpoint.port)),
            )]);
        }
        (_, Some(addr)) => return Ok(vec![Target::Tcp(SocketAddr::new(addr, endpoint.port))]),
        (Host::Tcp(name), None) => name,
    };
    let mut addresses: Vec<Target> = tokio::net::lookup_host((name.as_str(), endpoint.port))
        .await
        .map_err(|err| ConnectError::Transient(format!("error connecting to server: {err}")))?
        .map(Target::Tcp)
        .collect();
    if addresses.is_empty() {
        return Err(ConnectError::Transient(
            "error connecting to server: could not resolve any addresses".into(),
        ));
    }
    if shuffle {
        fastrand::shuffle(&mut addresses);
    }
    Ok(addresses)
}

/// One attempt at one address.
struct Attempt<'a> {
    settings: &'a ConnSettings,
    config: &'a tokio_postgres::Config,
    connector: &'a Connector,
    lease: Option<&'a Lease>,
    server_name: &'a str,
}

impl Attempt<'_> {
    async fn run(&self, target: &Target) -> Result<Opened, ConnectError> {
        let tls_settings = &self.settings.tls;
        let mode = tls::driver_mode(tls_settings, matches!(target, Target::Unix(_)));
        match self.connect(target, mode).await {
            Err(Failure::Driver(err)) if tls::falls_back_to_plaintext(&err, tls_settings) => self
                .connect(target, tokio_postgres::config::SslMode::Disable)
                .await
                .map_err(|failure| failure.classify(tls_settings)),
            result => result.map_err(|failure| failure.classify(tls_settings)),
        }
    }

    /// Dials, logs in, and checks the server is writable if it must be, all within the
    /// connect timeout.
    async fn connect(
        &self,
        target: &Target,
        mode: tokio_postgres::config::SslMode,
    ) -> Result<Opened, Failure> {
        let timeout = self.settings.connect_timeout;
        let deadline = Instant::now() + timeout;
        let (stream, socket, tcp_ends) = tokio::time::timeout_at(deadline, self.dial(target))
            .await
            .map_err(|_| {
                Failure::Other(ConnectError::Transient(
                    "error connecting to server: connection timed out".into(),
                ))
            })??;
        let mut config = self.config.clone();
        config.ssl_mode(mode);
        let tls = <Connector as MakeTlsConnect<Stream>>::make_tls_connect(
            &mut self.connector.clone(),
            self.server_name,
        )
        .unwrap_or_else(|never| match never {});
        let (client, connection) =
            tokio::time::timeout_at(deadline, config.connect_raw(stream, tls))
                .await
                .map_err(|_| Failure::Other(no_answer(timeout)))?
                .map_err(Failure::Driver)?;
        let server_version = connection.parameter("server_version").map(str::to_owned);
        let (connection, notifications) = drive(connection);
        if self.settings.target_session_attrs == TargetSessionAttrs::ReadWrite
            && let Err(failure) = writable(&client, deadline, timeout).await
        {
            connection.abort();
            return Err(failure);
        }
        Ok(Opened {
            client,
            connection,
            notifications,
            server_version,
            socket,
            tcp_ends,
        })
    }

    /// Opens the socket, with keepalives on TCP.
    async fn dial(
        &self,
        target: &Target,
    ) -> Result<(Stream, LentSocket, Option<TcpEnds>), ConnectError> {
        let refused = |err: std::io::Error| {
            ConnectError::Transient(format!("error connecting to server: {err}"))
        };
        match target {
            Target::Tcp(addr) => {
                let tcp = TcpStream::connect(addr).await.map_err(refused)?;
                let _ = tcp.set_nodelay(true);
                match self.lease {
                    Some(lease) => keepalives(tcp.as_fd(), lease),
                    // As the driver did: keepalives on, after the system's idle time.
                    None => {
                        let _ = setsockopt(&tcp, sockopt::KeepAlive, &true);
                    }
                }
                let socket = lend(&tcp)?;
                let ends = match (tcp.local_addr(), tcp.peer_addr()) {
                    (Ok(local), Ok(peer)) => Some(TcpEnds { local, peer }),
                    _ => None,
                };
                Ok((Box::new(tcp), socket, ends))
            }
            Target::Unix(path) => {
                let unix = UnixStream::connect(path).await.map_err(refused)?;
                let socket = lend(&unix)?;
                Ok((Box::new(unix), socket, None))
            }
        }
    }
}

/// Spawns the task that drives the connection, as the driver's own `Connection` future would
/// (which drops notifications), passing notifications on.
fn drive<S, T>(mut connection: tokio_postgres::Connection<S, T>) -> (ConnectionTask, Notifications)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, notifications) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(notification))) => {
                    let _ = sender.send(notification);
                }
                Some(Ok(_)) => {}
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            }
        }
    });
    (task, notifications)
}

fn lend(socket: &impl AsFd) -> Result<LentSocket, ConnectError> {
    LentSocket::of(socket)
        .map_err(|err| ConnectError::Transient(format!("fstat of the socket: {err}")))
}

/// libpq's test for `target_session_attrs=read-write`.
async fn writable(client: &Client, deadline: Instant, timeout: Duration) -> Result<(), Failure> {
    let shown =
        tokio::time::timeout_at(deadline, client.simple_query("SHOW transaction_read_only"))
            .await
            .map_err(|_| Failure::Other(no_answer(timeout)))?
            .map_err(Failure::Driver)?;
    let read_only = shown
        .iter()
        .any(|message| matches!(message, SimpleQueryMessage::Row(row) if row.get(0) == Some("on")));
    if read_only {
        return Err(Failure::Other(ConnectError::Transient(
            "error connecting to server: database does not allow writes".into(),
        )));
    }
    Ok(())
}

/// Why an attempt failed: the driver's error (sorted by [`Failure::classify`]), or one already
/// sorted.
enum Failure {
    Driver(tokio_postgres::Error),
    Other(ConnectError),
}

impl From<ConnectError> for Failure {
    fn from(err: ConnectError) -> Failure {
        Failure::Other(err)
    }
}

impl Failure {
    fn classify(self, settings: &TlsSettings) -> ConnectError {
        match self {
            Failure::Driver(err) => tls::classify(&err, settings).unwrap_or_else(|| classify(err)),
            Failure::Other(err) => err,
        }
    }
}

fn no_answer(timeout: Duration) -> ConnectError {
    ConnectError::Transient(format!(
        "no answer from the server within {}",
        humantime::format_duration(timeout)
    ))
}

/// Sorts a connection error into permanent and transient.
pub fn classify(err: tokio_postgres::Error) -> ConnectError {
    let message = describe(&err);
    let permanent_code = err.code().is_some_and(|code| {
        code.code().starts_with("28")
            || *code == SqlState::INVALID_CATALOG_NAME
            || *code == SqlState::INSUFFICIENT_PRIVILEGE
    });
    let permanent_kind = {
        let top = err.to_string();
        top.starts_with("invalid configuration") || top.starts_with("authentication error")
    };
    if permanent_code || permanent_kind {
        ConnectError::Permanent(message)
    } else {
        ConnectError::Transient(message)
    }
}
