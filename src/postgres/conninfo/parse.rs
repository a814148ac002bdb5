//! Reading a connection string into its parameters: a `postgres://` URL or libpq's
//! `key=value` pairs, each name checked against the keywords pgleader knows, ignores or
//! refuses, and a spelling suggestion for a name one or two typos away from one. The error
//! every refusal is ([`ConnInfoError`]) lives here, beside the suggester its message uses.
//! Nothing here reads the environment or fills in a default: that is `build.rs`.

use std::collections::BTreeMap;

use thiserror::Error;

use super::settings::DEFAULT_PORT;
use crate::percent::{self, CutShort, PercentError};

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

/// The keywords pgleader understands, with the environment variable libpq reads for each.
pub(super) const KEYWORDS: &[(&str, Option<&str>)] = &[
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
pub(super) const IGNORED: &[(&str, &str)] = &[
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
pub(super) type Params = BTreeMap<String, String>;

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
pub(super) fn parse(text: &str) -> Result<Params, ConnInfoError> {
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
            params.insert("user".into(), url_part(user, "the user name")?);
        }
        if let Some(password) = password {
            params.insert("password".into(), url_part(password, "the password")?);
        }
    }
    if !hostlist.is_empty() {
        let mut hosts = Vec::new();
        let mut ports = Vec::new();
        for spec in hostlist.split(',') {
            let (host, port) = split_host_port(spec)?;
            hosts.push(url_part(host, "a host name")?);
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
        params.insert("dbname".into(), url_part(dbname, "the database name")?);
    }
    if let Some(query) = query {
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| ConnInfoError::Url("a query parameter has no '=value'".into()))?;
            let key = url_part(key, "a parameter name")?;
            let value = url_part(value, "a parameter value")?;
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

/// A URL's part, percent-decoded; the error names the part (`what`), never its text.
fn url_part(text: &str, what: &str) -> Result<String, ConnInfoError> {
    percent::decode(text, CutShort::Refuse).map_err(|err| {
        ConnInfoError::Url(match err {
            PercentError::InvalidEscape => format!("{what} has an invalid percent-encoding"),
            PercentError::NotUtf8 => format!("{what} is not valid UTF-8 once decoded"),
        })
    })
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
