//! Where to connect and as whom: a `postgres://` URL or a `key=value` conninfo string, the
//! `PG*` environment variables psql reads, psql's defaults, and the password file.
//!
//! tokio-postgres parses URLs too, but it rejects every libpq keyword it does not know
//! (`sslrootcert`, `passfile`, `sslmode=verify-full`) and reads neither the environment nor
//! `.pgpass`. Users copy connection strings from libpq programs, so this module follows libpq:
//! values in the string win over the environment, the environment wins over the defaults.
//!
//! The password never leaves this module in readable form except into the driver's
//! configuration: [`ConnSettings`] prints as `user@host:port/dbname`, and parse errors name the
//! part that is wrong, never its value.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

// Re-exported: callers (and the integration tests) that named it here still do.
pub use crate::environment::{Environment, ProcessEnvironment};

/// The Unix-socket directory of Debian's and Ubuntu's PostgreSQL packages, psql's default there.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";
pub const DEFAULT_PORT: u16 = 5432;
/// pgleader's connect timeout when neither `connect_timeout` nor `PGCONNECT_TIMEOUT` is set:
/// libpq waits forever, which would stall the retry loop on a host that drops packets.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection string that cannot be used, or a setting pgleader does not support.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConnInfoError {
    #[error("the connection string is neither a postgres:// URL nor key=value pairs")]
    UnknownFormat,
    #[error("invalid connection URL: {0}")]
    Url(String),
    #[error("invalid connection string: {0}")]
    KeyValue(String),
    #[error("invalid connection option {0:?}{hint}", hint = suggestion(.0))]
    UnknownOption(String),
    /// An unknown name that may be a fragment of a badly quoted password: not repeated.
    /// An unknown name in key=value pairs, which may be a piece of a password with an
    /// unquoted space: not repeated, only the keyword it resembles.
    #[error("the connection string has a setting whose name is no connection option{}; is a value with spaces unquoted? write key='a b'", .0.map(|k| format!(" (did you mean {k:?}?)")).unwrap_or_default())]
    UnknownSetting(Option<&'static str>),
    #[error("connection option {0:?} is not supported by pgleader")]
    Unsupported(String),
    #[error("invalid value for connection option {0:?}: {1}")]
    InvalidValue(String, String),
}

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
pub struct Password(String);

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

/// The keywords pgleader understands, with the environment variable libpq reads for each.
const KEYWORDS: &[(&str, Option<&str>)] = &[
    ("host", Some("PGHOST")),
    ("hostaddr", Some("PGHOSTADDR")),
    ("port", Some("PGPORT")),
    ("dbname", Some("PGDATABASE")),
    ("user", Some("PGUSER")),
    ("password", Some("PGPASSWORD")),
    ("passfile", Some("PGPASSFILE")),
    ("application_name", Some("PGAPPNAME")),
    ("connect_timeout", Some("PGCONNECT_TIMEOUT")),
    ("options", Some("PGOPTIONS")),
    ("sslmode", Some("PGSSLMODE")),
    ("sslrootcert", Some("PGSSLROOTCERT")),
    ("sslcert", Some("PGSSLCERT")),
    ("sslkey", Some("PGSSLKEY")),
    ("target_session_attrs", Some("PGTARGETSESSIONATTRS")),
    ("load_balance_hosts", Some("PGLOADBALANCEHOSTS")),
    ("channel_binding", Some("PGCHANNELBINDING")),
    ("gssencmode", Some("PGGSSENCMODE")),
];

/// libpq keywords that pgleader accepts and ignores, with the reason it gives.
const IGNORED: &[(&str, &str)] = &[
    (
        "keepalives",
        "pgleader sets its own keepalives from --lease",
    ),
    (
        "keepalives_idle",
        "pgleader sets its own keepalives from --lease",
    ),
    (
        "keepalives_interval",
        "pgleader sets its own keepalives from --lease",
    ),
    (
        "keepalives_count",
        "pgleader sets its own keepalives from --lease",
    ),
    (
        "tcp_user_timeout",
        "pgleader sets its own TCP user timeout from --lease",
    ),
    (
        "fallback_application_name",
        "pgleader sets its own application_name",
    ),
    ("client_encoding", "pgleader uses UTF8"),
    ("sslcompression", "TLS compression is never used"),
    ("sslsni", "pgleader always sends SNI for host names"),
];

/// libpq keywords whose meaning pgleader cannot honour: refused rather than silently ignored.
const UNSUPPORTED: &[&str] = &[
    "service",
    "requirepeer",
    "krbsrvname",
    "gsslib",
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "sslnegotiation",
    "replication",
    "require_auth",
    "sslcertmode",
];

/// The parameters found in a connection string, before the environment and defaults apply.
type Params = BTreeMap<String, String>;

/// Resolves the settings: the connection string (if any), then `PG*` variables, then psql's
/// defaults. Returns the settings and warnings worth logging (ignored options, an unsafe
/// password file).
pub fn resolve(
    conninfo: Option<&str>,
    env: &dyn Environment,
) -> Result<(ConnSettings, Vec<String>), ConnInfoError> {
    let mut warnings = Vec::new();
    let mut params = match conninfo {
        Some(text) => parse(text)?,
        None => Params::new(),
    };
    for (keyword, reason) in IGNORED {
        if params.remove(*keyword).is_some() {
            warnings.push(format!("ignoring connection option {keyword:?}: {reason}"));
        }
    }
    for (keyword, variable) in KEYWORDS {
        if let Some(variable) = variable
            && !params.contains_key(*keyword)
            && let Some(value) = env.var(variable)
        {
            params.insert((*keyword).to_owned(), value);
        }
    }
    let settings = build(params, env, &mut warnings)?;
    Ok((settings, warnings))
}

fn build(
    mut params: Params,
    env: &dyn Environment,
    warnings: &mut Vec<String>,
) -> Result<ConnSettings, ConnInfoError> {
    let ports = match params.remove("port") {
        Some(list) => list
            .split(',')
            .map(|port| parse_port(port.trim()))
            .collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    let hostaddrs = match params.remove("hostaddr") {
        Some(list) => list
            .split(',')
            .map(|addr| {
                addr.trim().parse::<IpAddr>().map_err(|_| {
                    ConnInfoError::InvalidValue("hostaddr".into(), "not an IP address".into())
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    let mut hosts: Vec<Option<Host>> = match params.remove("host") {
        Some(list) => list
            .split(',')
            .map(|host| {
                let host = host.trim();
                if host.is_empty() {
                    None
                } else if host.starts_with('/') {
                    Some(Host::Socket(PathBuf::from(host)))
                } else {
                    Some(Host::Tcp(host.to_owned()))
                }
            })
            .collect(),
        None => Vec::new(),
    };
    if hosts.is_empty() {
        hosts = vec![None; hostaddrs.len().max(1)];
    }
    if !hostaddrs.is_empty() && hostaddrs.len() != hosts.len() {
        return Err(ConnInfoError::InvalidValue(
            "hostaddr".into(),
            format!(
                "{} addresses for {} hosts; give one per host",
                hostaddrs.len(),
                hosts.len()
            ),
        ));
    }
    if ports.len() > 1 && ports.len() != hosts.len() {
        return Err(ConnInfoError::InvalidValue(
            "port".into(),
            format!(
                "{} ports for {} hosts; give one port, or one per host",
                ports.len(),
                hosts.len()
            ),
        ));
    }
    let endpoints = hosts
        .into_iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports
                .get(i)
                .or(ports.first())
                .copied()
                .unwrap_or(DEFAULT_PORT);
            let hostaddr = hostaddrs.get(i).copied();
            let host = host.unwrap_or_else(|| match hostaddr {
                Some(addr) => Host::Tcp(addr.to_string()),
                None => default_host(port, env),
            });
            Endpoint {
                host,
                hostaddr,
                port,
            }
        })
        .collect::<Vec<_>>();

    let user = match params.remove("user") {
        Some(user) => user,
        None => env.os_user().ok_or_else(|| {
            ConnInfoError::InvalidValue(
                "user".into(),
                "no user given and the operating-system user is unknown".into(),
            )
        })?,
    };
    let dbname = params.remove("dbname").unwrap_or_else(|| user.clone());

    let connect_timeout = match params.remove("connect_timeout") {
        Some(value) => {
            let seconds: i64 = value.trim().parse().map_err(|_| {
                ConnInfoError::InvalidValue(
                    "connect_timeout".into(),
                    "expected a whole number of seconds".into(),
                )
            })?;
            // libpq: zero or negative means wait forever; pgleader keeps a bound (an hour) so
            // that the retry loop cannot hang. Values under 2 s are raised to 2 s, as libpq does.
            match seconds {
                i64::MIN..=0 => Duration::from_secs(3600),
                1 => Duration::from_secs(2),
                _ => Duration::from_secs(seconds as u64),
            }
        }
        None => DEFAULT_CONNECT_TIMEOUT,
    };

    let target_session_attrs = match params.remove("target_session_attrs").as_deref() {
        // pgleader never leads through a standby: with several hosts, look for the primary.
        None if endpoints.len() > 1 => TargetSessionAttrs::ReadWrite,
        None | Some("any") => TargetSessionAttrs::Any,
        Some("read-write") | Some("primary") => TargetSessionAttrs::ReadWrite,
        Some(_) => {
            return Err(ConnInfoError::InvalidValue(
                "target_session_attrs".into(),
                "pgleader accepts any, read-write or primary (it never leads through a standby)"
                    .into(),
            ));
        }
    };
    let channel_binding = match params.remove("channel_binding").as_deref() {
        None | Some("prefer") => ChannelBinding::Prefer,
        Some("disable") => ChannelBinding::Disable,
        Some("require") => ChannelBinding::Require,
        Some(_) => {
            return Err(ConnInfoError::InvalidValue(
                "channel_binding".into(),
                "expected disable, prefer or require".into(),
            ));
        }
    };
    // pgleader has no GSSAPI: "prefer" (libpq's default) falls back to TLS or plain text as
    // libpq does without GSSAPI credentials; "require" cannot be honoured.
    match params.remove("gssencmode").as_deref() {
        None | Some("disable") | Some("prefer") => {}
        Some("require") => return Err(ConnInfoError::Unsupported("gssencmode=require".into())),
        Some(_) => {
            return Err(ConnInfoError::InvalidValue(
                "gssencmode".into(),
                "expected disable, prefer or require".into(),
            ));
        }
    }
    let load_balance_hosts = match params.remove("load_balance_hosts").as_deref() {
        None | Some("disable") => false,
        Some("random") => true,
        Some(_) => {
            return Err(ConnInfoError::InvalidValue(
                "load_balance_hosts".into(),
                "expected disable or random".into(),
            ));
        }
    };

    // libpq's default certificate files live in ~/.postgresql; like libpq, tls.rs uses them
    // only if they exist when connecting.
    let in_home = |file: &str| env.home().map(|home| home.join(".postgresql").join(file));
    let root_cert = params
        .remove("sslrootcert")
        .map(PathBuf::from)
        .or_else(|| in_home("root.crt"));
    let system_roots = root_cert.as_deref() == Some(Path::new(SYSTEM_ROOTS));
    let mode = match params.remove("sslmode") {
        Some(mode) => mode
            .parse()
            .map_err(|reason| ConnInfoError::InvalidValue("sslmode".into(), reason))?,
        // As libpq 16: anyone can get a certificate from a public CA for a name they control,
        // so trusting the system's store only means something if the host name is checked.
        None if system_roots => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    if system_roots && mode != SslMode::VerifyFull {
        return Err(ConnInfoError::InvalidValue(
            "sslmode".into(),
            format!(
                "weak sslmode \"{}\" may not be used with sslrootcert=system (use \"verify-full\")",
                mode.as_str()
            ),
        ));
    }
    let tls = TlsSettings {
        mode,
        root_cert,
        client_cert: params
            .remove("sslcert")
            .map(PathBuf::from)
            .or_else(|| in_home("postgresql.crt")),
        client_key: params
            .remove("sslkey")
            .map(PathBuf::from)
            .or_else(|| in_home("postgresql.key")),
    };

    let passfile = params.remove("passfile").map(PathBuf::from);
    let mut password_source = None;
    let password = match params.remove("password") {
        Some(password) => {
            password_source = Some("the connection settings".to_owned());
            Some(Password(password))
        }
        None => {
            let path = passfile.or_else(|| env.home().map(|home| home.join(".pgpass")));
            match path {
                Some(path) => {
                    let found = endpoints.iter().find_map(|endpoint| {
                        password_from_file(&path, endpoint, &dbname, &user, warnings)
                    });
                    if found.is_some() {
                        password_source = Some(path.display().to_string());
                    }
                    found.map(Password)
                }
                None => None,
            }
        }
    };

    let application_name = params.remove("application_name");
    let options = params.remove("options");
    debug_assert!(params.is_empty(), "every keyword in KEYWORDS is consumed");

    Ok(ConnSettings {
        endpoints,
        user,
        dbname,
        password,
        password_source,
        application_name,
        connect_timeout,
        options,
        target_session_attrs,
        load_balance_hosts,
        channel_binding,
        tls,
    })
}

/// psql's default: the local Unix socket when a server listens there, else localhost.
fn default_host(port: u16, env: &dyn Environment) -> Host {
    let socket = Path::new(DEFAULT_SOCKET_DIR).join(format!(".s.PGSQL.{port}"));
    if env.socket_exists(&socket) {
        Host::Socket(PathBuf::from(DEFAULT_SOCKET_DIR))
    } else {
        Host::Tcp("localhost".to_owned())
    }
}

/// A port number. The text is not repeated in the error: in a URL whose password has an
/// unencoded '/', what looks like a port is part of the password.
fn parse_port(text: &str) -> Result<u16, ConnInfoError> {
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(ConnInfoError::InvalidValue(
            "port".into(),
            "not a port number (1-65535); in a URL, a password with '/', '?', '#' or '@' must be percent-encoded".into(),
        )),
    }
}

/// " (did you mean \"sslmode\"?)" for a name one or two typos away from a known one.
fn suggestion(name: &str) -> String {
    nearest_keyword(name)
        .map(|keyword| format!(" (did you mean {keyword:?}?)"))
        .unwrap_or_default()
}

/// The keyword one or two typos away from `name`, if any.
fn nearest_keyword(name: &str) -> Option<&'static str> {
    KEYWORDS
        .iter()
        .map(|(keyword, _)| *keyword)
        .chain(IGNORED.iter().map(|(keyword, _)| *keyword))
        .map(|keyword| (edit_distance(name, keyword), keyword))
        .filter(|(distance, _)| *distance <= 2)
        .min()
        .map(|(_, keyword)| keyword)
}

/// Levenshtein distance, for suggestions.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous + usize::from(ca != *cb);
            previous = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// Parses a connection string in either form into its parameters.
fn parse(text: &str) -> Result<Params, ConnInfoError> {
    let text = text.trim();
    let (params, from_url) = if let Some(rest) = text
        .strip_prefix("postgresql://")
        .or_else(|| text.strip_prefix("postgres://"))
    {
        (parse_url(rest)?, true)
    } else if text.contains('=') {
        (parse_key_values(text)?, false)
    } else {
        return Err(ConnInfoError::UnknownFormat);
    };
    for key in params.keys() {
        if UNSUPPORTED.contains(&key.as_str()) {
            return Err(ConnInfoError::Unsupported(key.clone()));
        }
        let known = KEYWORDS.iter().any(|(keyword, _)| keyword == key)
            || IGNORED.iter().any(|(keyword, _)| keyword == key);
        if !known {
            // In key=value pairs, a stray word may be a piece of a badly quoted password. In a
            // URL the parameters come after the '?', which a password cannot reach unencoded
            // (parse_url refuses an '@' after the host part).
            return Err(if from_url {
                ConnInfoError::UnknownOption(key.clone())
            } else {
                ConnInfoError::UnknownSetting(nearest_keyword(key))
            });
        }
    }
    Ok(params)
}

/// `[user[:password]@][host[:port][,host[:port]...]][/dbname][?name=value&...]`, everything
/// after the scheme.
fn parse_url(rest: &str) -> Result<Params, ConnInfoError> {
    let mut params = Params::new();
    // Everything up to the first '/', '?' or '#' is user, password and hosts; an '@' after it
    // means a password (or user) with one of those characters was not percent-encoded, and
    // the pieces would land in the host, port or database name, where they would be shown.
    if let Some(end) = rest.find(['/', '?', '#'])
        && rest[end..].contains('@')
    {
        return Err(ConnInfoError::Url(
            "there is an '@' after the host part: percent-encode '/', '?', '#' and '@' in the user name and password".into(),
        ));
    }
    let (before_query, query) = match rest.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (rest, None),
    };
    let (authority, dbname) = match before_query.split_once('/') {
        Some((authority, dbname)) => (authority, Some(dbname)),
        None => (before_query, None),
    };
    // The password may contain '@' when it is not percent-encoded; the host list cannot.
    let (userinfo, hostlist) = match authority.rsplit_once('@') {
        Some((userinfo, hostlist)) => (Some(userinfo), hostlist),
        None => (None, authority),
    };
    if let Some(userinfo) = userinfo {
        let (user, password) = match userinfo.split_once(':') {
            Some((user, password)) => (user, Some(password)),
            None => (userinfo, None),
        };
        if !user.is_empty() {
            params.insert("user".into(), percent_decode(user, "the user name")?);
        }
        if let Some(password) = password {
            params.insert("password".into(), percent_decode(password, "the password")?);
        }
    }
    if !hostlist.is_empty() {
        let mut hosts = Vec::new();
        let mut ports = Vec::new();
        for spec in hostlist.split(',') {
            let (host, port) = split_host_port(spec)?;
            hosts.push(percent_decode(host, "a host name")?);
            ports.push(port.map(str::to_owned));
        }
        if hosts.iter().any(|host| !host.is_empty()) {
            params.insert("host".into(), hosts.join(","));
        }
        if ports.iter().any(Option::is_some) {
            let default = DEFAULT_PORT.to_string();
            let ports: Vec<String> = ports
                .into_iter()
                .map(|port| port.unwrap_or_else(|| default.clone()))
                .collect();
            params.insert("port".into(), ports.join(","));
        }
    }
    if let Some(dbname) = dbname
        && !dbname.is_empty()
    {
        params.insert(
            "dbname".into(),
            percent_decode(dbname, "the database name")?,
        );
    }
    if let Some(query) = query {
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| ConnInfoError::Url("a query parameter has no '=value'".into()))?;
            let key = percent_decode(key, "a parameter name")?;
            let value = percent_decode(value, "a parameter value")?;
            // libpq accepts ssl=true as a synonym of sslmode=require in URLs.
            if key == "ssl" && value == "true" {
                params.insert("sslmode".into(), "require".into());
            } else {
                params.insert(key, value);
            }
        }
    }
    Ok(params)
}

/// Splits `host:port`, `[v6addr]:port`, `host`, `:port`.
fn split_host_port(spec: &str) -> Result<(&str, Option<&str>), ConnInfoError> {
    if let Some(rest) = spec.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| ConnInfoError::Url("an IPv6 address lacks its closing ']'".into()))?;
        return match after {
            "" => Ok((host, None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((host, Some(port))),
                None => Err(ConnInfoError::Url(
                    "unexpected text after an IPv6 address".into(),
                )),
            },
        };
    }
    Ok(match spec.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (spec, None),
    })
}

fn percent_decode(text: &str, what: &str) -> Result<String, ConnInfoError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| {
                    ConnInfoError::Url(format!("{what} has an invalid percent-encoding"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| ConnInfoError::Url(format!("{what} is not valid UTF-8 once decoded")))
}

/// `key=value key='quoted value' key = value`, with `\` escaping the next character.
fn parse_key_values(text: &str) -> Result<Params, ConnInfoError> {
    let mut params = Params::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(params);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            // The word may be a piece of a password with an unquoted space: not repeated.
            return Err(ConnInfoError::KeyValue(format!(
                "setting number {} has no '=' (is a value with spaces unquoted? write key='a b')",
                params.len() + 1
            )));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => match chars.next() {
                        Some(c) => value.push(c),
                        None => break,
                    },
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        // Named only if it is a keyword: the name could be a piece of a
                        // password with an unquoted space.
                        let known = KEYWORDS.iter().any(|(keyword, _)| *keyword == key);
                        return Err(ConnInfoError::KeyValue(if known {
                            format!("the quoted value of {key:?} is not terminated")
                        } else {
                            "a quoted value is not terminated".to_owned()
                        }));
                    }
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(escaped) = chars.next() {
                        value.push(escaped);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        params.insert(key, value);
    }
}

/// Looks the endpoint up in a libpq password file (`host:port:database:user:password`, `*`
/// matching anything, `\` escaping `:` and `\`). Like libpq, a file that others can read is
/// ignored with a warning, and the default socket directory matches the name `localhost`.
fn password_from_file(
    path: &Path,
    endpoint: &Endpoint,
    dbname: &str,
    user: &str,
    warnings: &mut Vec<String>,
) -> Option<String> {
    let meta = fs::metadata(path).ok()?;
    if !meta.is_file() {
        warnings.push(format!(
            "password file {} is not a plain file; not using it",
            path.display()
        ));
        return None;
    }
    if meta.permissions().mode() & 0o077 != 0 {
        warnings.push(format!(
            "password file {} has group or world access; permissions should be u=rw (0600) or less; not using it",
            path.display()
        ));
        return None;
    }
    let contents = fs::read_to_string(path).ok()?;
    let host = match &endpoint.host {
        Host::Tcp(name) => name.clone(),
        Host::Socket(dir) if dir == Path::new(DEFAULT_SOCKET_DIR) => "localhost".to_owned(),
        Host::Socket(dir) => dir.display().to_string(),
    };
    let port = endpoint.port.to_string();
    let wanted = [host.as_str(), port.as_str(), dbname, user];
    contents
        .lines()
        .filter(|line| !line.trim_start().starts_with('#') && !line.trim().is_empty())
        .find_map(|line| {
            let fields = split_pgpass_line(line);
            if fields.len() < 5 {
                return None;
            }
            let matches = fields[..4]
                .iter()
                .zip(wanted)
                .all(|(field, want)| field == "*" || field == want);
            matches.then(|| fields[4..].join(":"))
        })
}

fn split_pgpass_line(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(escaped) = chars.next()
                    && let Some(field) = fields.last_mut()
                {
                    field.push(escaped);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            _ => {
                if let Some(field) = fields.last_mut() {
                    field.push(c);
                }
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Default)]
    struct FakeEnv {
        vars: HashMap<&'static str, String>,
        home: Option<PathBuf>,
        socket: bool,
    }

    impl Environment for FakeEnv {
        fn var(&self, name: &str) -> Option<String> {
            self.vars.get(name).cloned()
        }
        fn home(&self) -> Option<PathBuf> {
            self.home.clone()
        }
        fn os_user(&self) -> Option<String> {
            Some("osuser".into())
        }
        fn socket_exists(&self, _: &Path) -> bool {
            self.socket
        }
    }

    fn resolve_with(text: Option<&str>, env: &FakeEnv) -> ConnSettings {
        resolve(text, env).expect("valid settings").0
    }

    #[test]
    fn reads_a_url_with_every_part() {
        let settings = resolve_with(
            Some(
                "postgres://app:s%40cret@db1:6000,[::1]:6001/jobs?sslmode=require&application_name=x",
            ),
            &FakeEnv::default(),
        );
        assert_eq!(settings.user, "app");
        assert_eq!(
            settings.password.as_ref().map(Password::expose),
            Some("s@cret")
        );
        assert_eq!(settings.dbname, "jobs");
        assert_eq!(
            settings.endpoints,
            vec![
                Endpoint {
                    host: Host::Tcp("db1".into()),
                    hostaddr: None,
                    port: 6000
                },
                Endpoint {
                    host: Host::Tcp("::1".into()),
                    hostaddr: None,
                    port: 6001
                },
            ]
        );
        assert_eq!(settings.tls.mode, SslMode::Require);
        assert_eq!(settings.application_name.as_deref(), Some("x"));
        assert_eq!(settings.target_session_attrs, TargetSessionAttrs::ReadWrite);
        let single = resolve_with(Some("postgres://h/d"), &FakeEnv::default());
        assert_eq!(single.target_session_attrs, TargetSessionAttrs::Any);
    }

    #[test]
    fn reads_key_value_pairs_with_quotes_and_escapes() {
        let settings = resolve_with(
            Some(r"host=/tmp port = 5433 user='o\'brien' password=a\ b dbname='my db'"),
            &FakeEnv::default(),
        );
        assert_eq!(settings.endpoints[0].host, Host::Socket("/tmp".into()));
        assert_eq!(settings.endpoints[0].port, 5433);
        assert_eq!(settings.user, "o'brien");
        assert_eq!(
            settings.password.as_ref().map(Password::expose),
            Some("a b")
        );
        assert_eq!(settings.dbname, "my db");
    }

    #[test]
    fn a_socket_directory_can_be_percent_encoded_in_a_url() {
        let settings = resolve_with(
            Some("postgresql://%2Fvar%2Frun%2Fpostgresql/db"),
            &FakeEnv::default(),
        );
        assert_eq!(
            settings.endpoints[0].host,
            Host::Socket("/var/run/postgresql".into())
        );
    }

    #[test]
    fn the_environment_fills_what_the_string_leaves_out() {
        let env = FakeEnv {
            vars: HashMap::from([
                ("PGHOST", "envhost".to_owned()),
                ("PGPORT", "7000".to_owned()),
                ("PGUSER", "envuser".to_owned()),
                ("PGDATABASE", "envdb".to_owned()),
                ("PGAPPNAME", "envapp".to_owned()),
                ("PGCONNECT_TIMEOUT", "5".to_owned()),
            ]),
            ..FakeEnv::default()
        };
        let settings = resolve_with(Some("dbname=fromstring"), &env);
        assert_eq!(settings.endpoints[0].host, Host::Tcp("envhost".into()));
        assert_eq!(settings.endpoints[0].port, 7000);
        assert_eq!(settings.user, "envuser");
        assert_eq!(settings.dbname, "fromstring");
        assert_eq!(settings.application_name.as_deref(), Some("envapp"));
        assert_eq!(settings.connect_timeout, Duration::from_secs(5));
    }

    #[test]
    fn tls_files_default_to_libpqs_in_home_and_system_roots_mean_verify_full() {
        let env = FakeEnv {
            home: Some("/home/app".into()),
            ..FakeEnv::default()
        };
        let tls = resolve_with(Some("host=db"), &env).tls;
        assert_eq!(tls.mode, SslMode::Prefer);
        assert_eq!(
            tls.root_cert.as_deref(),
            Some(Path::new("/home/app/.postgresql/root.crt"))
        );
        assert_eq!(
            tls.client_key.as_deref(),
            Some(Path::new("/home/app/.postgresql/postgresql.key"))
        );

        let env = FakeEnv {
            vars: HashMap::from([("PGSSLROOTCERT", "system".to_owned())]),
            ..FakeEnv::default()
        };
        let tls = resolve_with(Some("host=db"), &env).tls;
        assert!(tls.uses_system_roots());
        assert_eq!(tls.mode, SslMode::VerifyFull);
        let weak = resolve(Some("host=db sslmode=require"), &env).expect_err("weak");
        assert_eq!(
            weak.to_string(),
            "invalid value for connection option \"sslmode\": weak sslmode \"require\" may not \
             be used with sslrootcert=system (use \"verify-full\")"
        );
    }

    #[test]
    fn defaults_follow_psql() {
        let tcp = resolve_with(None, &FakeEnv::default());
        assert_eq!(tcp.endpoints[0].host, Host::Tcp("localhost".into()));
        assert_eq!(tcp.endpoints[0].port, 5432);
        assert_eq!(tcp.user, "osuser");
        assert_eq!(tcp.dbname, "osuser");
        assert_eq!(tcp.tls.mode, SslMode::Prefer);

        let socket = resolve_with(
            None,
            &FakeEnv {
                socket: true,
                ..FakeEnv::default()
            },
        );
        assert_eq!(
            socket.endpoints[0].host,
            Host::Socket(DEFAULT_SOCKET_DIR.into())
        );
    }

    #[test]
    fn display_and_debug_never_show_the_password() {
        let settings = resolve_with(Some("postgres://u:hunter2@h/d"), &FakeEnv::default());
        assert_eq!(settings.to_string(), "u@h:5432/d");
        assert!(!format!("{settings:?}").contains("hunter2"));
    }

    #[test]
    fn errors_name_the_problem_but_not_the_secret() {
        let env = FakeEnv::default();
        let cases = [
            ("mydb", ConnInfoError::UnknownFormat),
            ("host=h bogus=1", ConnInfoError::UnknownSetting(None)),
            (
                "host=h sslmod=require",
                ConnInfoError::UnknownSetting(Some("sslmode")),
            ),
            (
                "postgres://h/d?sslmod=require",
                ConnInfoError::UnknownOption("sslmod".into()),
            ),
            ("service=x", ConnInfoError::Unsupported("service".into())),
        ];
        for (text, expected) in cases {
            assert_eq!(resolve(Some(text), &env).expect_err(text), expected);
        }
        let bad_port = resolve(Some("postgres://u:hunter2@h:99999/d"), &env).expect_err("bad port");
        assert!(bad_port.to_string().contains("port"), "{bad_port}");
        let bad_escape =
            resolve(Some("postgres://u:hunter2%zz@h/d"), &env).expect_err("bad escape");
        assert!(!bad_escape.to_string().contains("hunter2"), "{bad_escape}");
        let unterminated = resolve(Some("password='hunter2"), &env).expect_err("unterminated");
        assert!(
            !unterminated.to_string().contains("hunter2"),
            "{unterminated}"
        );
        assert!(
            ConnInfoError::UnknownOption("sslmod".into())
                .to_string()
                .contains("did you mean \"sslmode\"")
        );
        // Passwords that were not quoted or percent-encoded: none of their pieces is repeated.
        for (text, secret) in [
            ("postgres://u:s3cr/et@host/db", "s3cr"),
            (
                "postgres://postgres:5432/Xy+secret@127.0.0.1:55999/postgres",
                "Xy+secret",
            ),
            ("postgres://u:pa?ss@host/db", "ss@host"),
            ("password=correct horse", "horse"),
            ("password=x horse=battery", "horse"),
            ("host=h port=5432/Xy+secret", "Xy+secret"),
            ("password=correct horse='x", "horse"),
        ] {
            let err = resolve(Some(text), &env).expect_err(text).to_string();
            assert!(!err.contains(secret), "{text}: {err}");
        }
    }

    #[test]
    fn ignored_options_are_reported() {
        let (_, warnings) =
            resolve(Some("host=h keepalives_idle=30"), &FakeEnv::default()).expect("valid");
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("keepalives_idle"), "{warnings:?}");
    }

    #[test]
    fn the_password_file_is_read_with_libpq_rules() {
        let dir = std::env::temp_dir().join(format!("pgleader-pgpass-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("pgpass");
        fs::write(
            &file,
            "# comment\nother:5432:*:u:nope\nh:5432:d:u:pa\\:ss\n*:*:*:*:fallback\n",
        )
        .expect("write pgpass");
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).expect("chmod");
        let env = FakeEnv {
            vars: HashMap::from([("PGPASSFILE", file.display().to_string())]),
            ..FakeEnv::default()
        };
        let exact = resolve_with(Some("host=h dbname=d user=u"), &env);
        assert_eq!(exact.password.as_ref().map(Password::expose), Some("pa:ss"));
        let wildcard = resolve_with(Some("host=x dbname=d user=u"), &env);
        assert_eq!(
            wildcard.password.as_ref().map(Password::expose),
            Some("fallback")
        );

        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).expect("chmod");
        let (unsafe_file, warnings) = resolve(Some("host=h dbname=d user=u"), &env).expect("valid");
        assert_eq!(unsafe_file.password, None);
        assert!(
            warnings.iter().any(|w| w.contains("group or world")),
            "{warnings:?}"
        );
        fs::remove_dir_all(&dir).ok();
    }
}
