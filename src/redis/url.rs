//! The Redis server a URL names: `redis://[user[:password]@]host[:port][/db]`, or `rediss://`
//! for TLS, with the password also taken from `REDISCLI_AUTH` (redis-cli's convention).
//!
//! What a URL may not name is refused here, with a message that says why: Sentinel (not
//! supported), a Unix socket, query parameters pgleader does not know. The password is kept
//! out of every `Display` and `Debug`, so that no log line, error or `/status` can show it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::percent::{self, CutShort};

/// The default port of a Redis server.
const DEFAULT_PORT: u16 = 6379;

/// A password, printed as `********` by Debug.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("********")
    }
}

/// One Redis server and how to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisServer {
    pub host: String,
    pub port: u16,
    pub db: i64,
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// Where the password came from ("the URL", "REDISCLI_AUTH"), for error messages.
    pub password_source: Option<&'static str>,
    /// `rediss://`: TLS with the server's certificate verified.
    pub tls: Option<TlsSettings>,
    /// Bounds each step of connecting (TCP, TLS, the handshake).
    pub connect_timeout: Duration,
}

/// TLS to a Redis server: the certificate is always verified, against the CA file given with
/// `?cacert=` or else the system's roots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub ca_file: Option<PathBuf>,
}

/// Whether a URL names Redis (and so the Redis backend).
pub fn is_redis_url(text: &str) -> bool {
    let scheme = text.split_once("://").map(|(scheme, _)| scheme);
    matches!(
        scheme.map(str::to_ascii_lowercase).as_deref(),
        Some("redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+unix" | "unix")
    )
}

impl RedisServer {
    /// Parses a Redis URL. `redis_cli_auth` is the value of `REDISCLI_AUTH`, used when the URL
    /// has no password.
    pub fn parse(
        text: &str,
        redis_cli_auth: Option<String>,
        connect_timeout: Duration,
    ) -> Result<RedisServer, String> {
        let url = url::Url::parse(text).map_err(|err| format!("not a valid Redis URL: {err}"))?;
        let tls = match url.scheme() {
            "redis" => None,
            "rediss" => Some(TlsSettings { ca_file: None }),
            "redis+sentinel" | "rediss+sentinel" => {
                return Err(
                    "Redis Sentinel is not supported: give the URL of the primary \
                            itself (redis://host:port)"
                        .into(),
                );
            }
            "redis+unix" | "unix" => {
                return Err("a Redis Unix socket is not supported: give redis://host:port".into());
            }
            other => return Err(format!("{other}:// is not a Redis URL")),
        };
        let host = match url.host() {
            Some(url::Host::Domain(name)) => name.to_owned(),
            Some(url::Host::Ipv4(address)) => address.to_string(),
            Some(url::Host::Ipv6(address)) => address.to_string(),
            None => return Err("the Redis URL names no host".into()),
        };
        let db = match url.path().trim_start_matches('/') {
            "" => 0,
            number => number
                .parse::<i64>()
                .ok()
                .filter(|db| *db >= 0)
                .ok_or_else(|| {
                    format!("the Redis URL's path must be a database number, not {number:?}")
                })?,
        };
        let decode = |text: &str| {
            percent::decode(text, CutShort::Keep).map_err(|_| {
                "the Redis URL's user or password is not valid UTF-8 after percent-decoding"
                    .to_owned()
            })
        };
        let user = Some(decode(url.username())?).filter(|user| !user.is_empty());
        let (password, password_source) = match url.password() {
            Some(password) => (Some(Secret(decode(password)?)), Some("the URL")),
            None => match redis_cli_auth.filter(|password| !password.is_empty()) {
                Some(password) => (Some(Secret(password)), Some("REDISCLI_AUTH")),
                None => (None, None),
            },
        };
        let mut server = RedisServer {
            host,
            port: url.port().unwrap_or(DEFAULT_PORT),
            db,
            user,
            password,
            password_source,
            tls,
            connect_timeout,
        };
        for (name, value) in url.query_pairs() {
            match (name.as_ref(), &mut server.tls) {
                ("cacert", Some(tls)) => tls.ca_file = Some(PathBuf::from(value.as_ref())),
                ("cacert", None) => {
                    return Err("cacert= needs TLS: use rediss:// rather than redis://".into());
                }
                (other, _) => {
                    return Err(format!(
                        "unknown parameter {other:?} in the Redis URL (pgleader knows cacert=)"
                    ));
                }
            }
        }
        Ok(server)
    }
}

impl fmt::Display for RedisServer {
    /// `redis://user@host:port/db`, never with the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        write!(f, "{scheme}://")?;
        if let Some(user) = &self.user {
            write!(f, "{user}@")?;
        }
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)?;
        } else {
            write!(f, "{}:{}", self.host, self.port)?;
        }
        if self.db != 0 {
            write!(f, "/{}", self.db)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    #[test]
    fn reads_every_part_and_never_shows_the_password() {
        let server =
            RedisServer::parse("redis://app:s%40cret@cache.internal:6380/2", None, TIMEOUT)
                .expect("a valid URL");
        assert_eq!(server.host, "cache.internal");
        assert_eq!(server.port, 6380);
        assert_eq!(server.db, 2);
        assert_eq!(server.user.as_deref(), Some("app"));
        assert_eq!(server.password, Some(Secret("s@cret".into())));
        assert_eq!(server.password_source, Some("the URL"));
        assert_eq!(server.to_string(), "redis://app@cache.internal:6380/2");
        assert!(!format!("{server:?}").contains("cret"));
    }

    #[test]
    fn takes_the_password_from_rediscli_auth_when_the_url_has_none() {
        let server = RedisServer::parse("redis://localhost", Some("pw".into()), TIMEOUT)
            .expect("a valid URL");
        assert_eq!(server.password, Some(Secret("pw".into())));
        assert_eq!(server.password_source, Some("REDISCLI_AUTH"));
        assert_eq!(server.port, 6379);
        let server = RedisServer::parse("redis://:url@localhost", Some("pw".into()), TIMEOUT)
            .expect("a valid URL");
        assert_eq!(server.password, Some(Secret("url".into())), "the URL wins");
    }

    #[test]
    fn a_percent_sign_without_two_digits_after_it_is_kept() {
        let server = RedisServer::parse("redis://:50%@localhost", None, TIMEOUT).expect("valid");
        assert_eq!(server.password, Some(Secret("50%".into())));
        let err = RedisServer::parse("redis://:a%zz@localhost", None, TIMEOUT).expect_err("%zz");
        assert!(err.contains("percent-decoding"), "{err}");
    }

    #[test]
    fn tls_with_a_ca_file() {
        let server = RedisServer::parse("rediss://[::1]:7000?cacert=/etc/ca.pem", None, TIMEOUT)
            .expect("a valid URL");
        assert_eq!(
            server.tls,
            Some(TlsSettings {
                ca_file: Some(PathBuf::from("/etc/ca.pem"))
            })
        );
        assert_eq!(server.to_string(), "rediss://[::1]:7000");
    }

    #[test]
    fn refuses_what_it_does_not_support_saying_why() {
        for (url, expected) in [
            (
                "redis+sentinel://h:26379/mymaster",
                "Sentinel is not supported",
            ),
            ("redis://h/x", "database number"),
            ("redis://h?cacert=/ca.pem", "rediss://"),
            ("redis://h?timeout=3", "unknown parameter"),
            ("redis+unix:///tmp/redis.sock", "Unix socket"),
        ] {
            let err = RedisServer::parse(url, None, TIMEOUT).expect_err(url);
            assert!(err.contains(expected), "{url}: {err}");
        }
        assert!(is_redis_url("REDIS://h"));
        assert!(is_redis_url("redis+sentinel://h"));
        assert!(!is_redis_url("postgres://h"));
        assert!(!is_redis_url("host=redis"));
    }
}
