//! From parameters to settings: the `PG*` variables fill what the connection string leaves
//! out, psql's defaults what both leave out, and the password file the password; every value
//! is checked here, so that a bad one is refused before any connection is tried.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::parse::{ConnInfoError, IGNORED, KEYWORDS, Params, parse};
use super::pgpass::password_from_file;
use super::settings::{
    ChannelBinding, ConnSettings, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_SOCKET_DIR,
    Endpoint, Host, Password, SYSTEM_ROOTS, SslMode, TargetSessionAttrs, TlsSettings,
};
use crate::environment::Environment;

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
    let endpoints = endpoints(&mut params, env)?;
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
    let connect_timeout = connect_timeout(&mut params)?;
    let target_session_attrs = target_session_attrs(&mut params, endpoints.len())?;
    let (channel_binding, load_balance_hosts) = negotiation(&mut params)?;
    let tls = tls(&mut params, env)?;
    let (password, password_source) =
        password(&mut params, env, (&endpoints, &dbname, &user), warnings);
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

/// The servers to try, in order: `host`, `hostaddr` and `port`, one per host or one for all.
fn endpoints(params: &mut Params, env: &dyn Environment) -> Result<Vec<Endpoint>, ConnInfoError> {
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
    Ok(endpoints)
}

/// `connect_timeout`, bounded.
fn connect_timeout(params: &mut Params) -> Result<Duration, ConnInfoError> {
    let timeout = match params.remove("connect_timeout") {
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
    Ok(timeout)
}

/// `target_session_attrs`: with several hosts, the primary by default.
fn target_session_attrs(
    params: &mut Params,
    endpoints: usize,
) -> Result<TargetSessionAttrs, ConnInfoError> {
    let attrs = match params.remove("target_session_attrs").as_deref() {
        // pgleader never leads through a standby: with several hosts, look for the primary.
        None if endpoints > 1 => TargetSessionAttrs::ReadWrite,
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
    Ok(attrs)
}

/// `channel_binding`, `gssencmode` (there is no GSSAPI) and `load_balance_hosts`.
fn negotiation(params: &mut Params) -> Result<(ChannelBinding, bool), ConnInfoError> {
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
    Ok((channel_binding, load_balance_hosts))
}

/// `sslmode` and the certificate files.
fn tls(params: &mut Params, env: &dyn Environment) -> Result<TlsSettings, ConnInfoError> {
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
    Ok(TlsSettings {
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
    })
}

/// The password, and where it came from: `password`, else the password file.
fn password(
    params: &mut Params,
    env: &dyn Environment,
    (endpoints, dbname, user): (&[Endpoint], &str, &str),
    warnings: &mut Vec<String>,
) -> (Option<Password>, Option<String>) {
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
                        password_from_file(&path, endpoint, dbname, user, warnings)
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
    (password, password_source)
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

// Every test reads a string through `resolve` (parser, environment, password file and
// defaults together), so they live beside it.
#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

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
