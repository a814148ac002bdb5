//! The settings a PostgreSQL session is opened with, once resolved: where to connect (the
//! endpoints, in order), as whom, with which password and TLS, and libpq's defaults for them.
//! Types only, so that the parser, the password file and the builder can all name them.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// The Unix-socket directory of Debian's and Ubuntu's PostgreSQL packages, psql's default there.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";
pub const DEFAULT_PORT: u16 = 5432;
/// pgleader's connect timeout when neither `connect_timeout` nor `PGCONNECT_TIMEOUT` is set:
/// libpq waits forever, which would stall the retry loop on a host that drops packets.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How hard to insist on TLS, with libpq's names and meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => {
                return Err(
                    "expected disable, allow, prefer, require, verify-ca or verify-full".into(),
                );
            }
        })
    }
}

impl SslMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The `sslrootcert` value that means the system's trust store (libpq 16).
pub const SYSTEM_ROOTS: &str = "system";

/// TLS settings from the connection string or `PGSSL*`, with libpq's defaults filled in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`: a PEM file of trusted CAs, or `system` for the system's trust store;
    /// `~/.postgresql/root.crt` by default.
    pub root_cert: Option<PathBuf>,
    /// `sslcert` / `sslkey`: a client certificate and its key; `~/.postgresql/postgresql.crt`
    /// and `postgresql.key` by default. A certificate file that does not exist is not sent.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl TlsSettings {
    /// Whether `sslrootcert=system`: trust the system's certificate store.
    pub fn uses_system_roots(&self) -> bool {
        self.root_cert.as_deref() == Some(Path::new(SYSTEM_ROOTS))
    }
}

/// Where a server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    Tcp(String),
    Socket(PathBuf),
}

/// One server to try, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: Host,
    /// `hostaddr`: connect to this address instead of resolving the host name.
    pub hostaddr: Option<IpAddr>,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Tcp(name) if name.contains(':') => write!(f, "[{name}]:{}", self.port),
            Host::Tcp(name) => write!(f, "{name}:{}", self.port),
            Host::Socket(dir) => write!(f, "{}/.s.PGSQL.{}", dir.display(), self.port),
        }
    }
}

/// `target_session_attrs`: which kind of server to accept when several hosts are listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetSessionAttrs {
    Any,
    ReadWrite,
}

/// A password, kept out of `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(pub(super) String);

impl Password {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

/// Everything needed to open a session, resolved from the string, the environment and the
/// defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnSettings {
    pub endpoints: Vec<Endpoint>,
    pub user: String,
    pub dbname: String,
    pub password: Option<Password>,
    /// Where the password came from, for error messages ("from ~/.pgpass").
    pub password_source: Option<String>,
    pub application_name: Option<String>,
    pub connect_timeout: Duration,
    pub options: Option<String>,
    pub target_session_attrs: TargetSessionAttrs,
    pub load_balance_hosts: bool,
    /// `channel_binding`: with `require`, SCRAM must bind to the TLS channel, which defeats a
    /// man in the middle when the certificate is not verified.
    pub channel_binding: ChannelBinding,
    pub tls: TlsSettings,
}

/// libpq's `channel_binding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelBinding {
    Disable,
    Prefer,
    Require,
}

impl fmt::Display for ConnSettings {
    /// `user@host:port/dbname`, several endpoints separated by commas; never the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@", self.user)?;
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{endpoint}")?;
        }
        write!(f, "/{}", self.dbname)
    }
}
