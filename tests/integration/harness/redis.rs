//! Real `redis-server` processes for the Redis backend's tests, each on a free port, keeping
//! nothing on disk (`--save '' --appendonly no`, so a restart loses every key), with `DEBUG`
//! allowed from localhost (`DEBUG SLEEP` freezes the server), or speaking only TLS with a
//! certificate the test made. Commands go through the real `redis-cli`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::cluster::free_port;
use super::spawner;

const INSTALL_HINT: &str = "redis-server and redis-cli are needed for the Redis tests: install \
                            them (Debian: apt-get install redis-server redis-tools)";

/// A password the tests' ACL user has.
pub const SECRET_PASSWORD: &str = "s3cret-redis-pw";

/// The ACL rules README.md documents for pgleader's user.
pub const DOCUMENTED_ACL: [&str; 12] = [
    "~pgleader:*",
    "&pgleader:*",
    "+@read",
    "+@write",
    "+@scripting",
    "+@pubsub",
    "+@blocking",
    "+time",
    "+info",
    "+client|id",
    "+client|setname",
    "+client|tracking",
];

/// One Redis server of a test's own (or the shared one).
#[derive(Debug)]
pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    /// The default user's password (`--requirepass`), for redis-cli.
    password: Option<String>,
    /// For a server that speaks only TLS: the CA file that verifies its certificate.
    tls_ca: Option<PathBuf>,
    server: Mutex<Option<Child>>,
}

/// What a server that speaks only TLS is given: its certificate and key, and the CA that
/// signed it, all PEM.
#[derive(Debug)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl Redis {
    /// The server most tests share.
    pub fn shared() -> &'static Redis {
        static SHARED: OnceLock<Redis> = OnceLock::new();
        SHARED.get_or_init(|| Redis::start_with("shared", &[]))
    }

    /// A server of the test's own, for tests that stop, freeze or restart it.
    pub fn new(name: &str) -> Redis {
        Redis::start_with(name, &[])
    }

    /// A server with extra `redis-server` arguments.
    pub fn start_with(name: &str, extra: &[&str]) -> Redis {
        let redis = Redis::prepare(name, extra);
        redis.start();
        redis
    }

    /// A server that accepts only TLS (`--port 0 --tls-port`), with `tls`'s certificate, and
    /// does not ask clients for one (`--tls-auth-clients no`).
    pub fn start_tls(name: &str, tls: &ServerTls) -> Redis {
        let mut redis = Redis::prepare(name, &[]);
        let file = |file: &str, pem: &str| {
            let path = redis.dir.join(file);
            std::fs::write(&path, pem).expect("write a certificate file");
            path.to_string_lossy().into_owned()
        };
        let (cert, key, ca) = (
            file("server.crt", &tls.cert_pem),
            file("server.key", &tls.key_pem),
            file("ca.crt", &tls.ca_pem),
        );
        redis.extra = [
            "--port",
            "0",
            "--tls-port",
            &redis.port.to_string(),
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "no",
        ]
        .map(str::to_owned)
        .to_vec();
        redis.tls_ca = Some(PathBuf::from(ca));
        redis.start();
        redis
    }

    /// A server not started yet, with its directory and port.
    fn prepare(name: &str, extra: &[&str]) -> Redis {
        super::require_tool("redis-server", INSTALL_HINT);
        super::require_tool("redis-cli", INSTALL_HINT);
        let dir = std::env::temp_dir().join(format!(
            "pgleader-redis-{name}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let password = extra
            .iter()
            .position(|arg| *arg == "--requirepass")
            .and_then(|at| extra.get(at + 1))
            .map(|password| (*password).to_owned());
        Redis {
            port: free_port(),
            dir,
            password,
            extra: extra.iter().map(|arg| (*arg).to_owned()).collect(),
            tls_ca: None,
            server: Mutex::new(None),
        }
    }

    /// Starts the server (again, after [`Redis::crash`]), empty.
    pub fn start(&self) {
        let mut server = self.server.lock().expect("server lock");
        assert!(server.is_none(), "the server already runs");
        let mut command = Command::new("redis-server");
        // A TLS server listens on the port with --tls-port (its extra arguments), on no other.
        if self.tls_ca.is_none() {
            command.args(["--port", &self.port.to_string()]);
        }
        command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local"])
            .args(["--dir", &self.dir.to_string_lossy()])
            .args(["--logfile", &self.dir.join("log").to_string_lossy()])
            .args(&self.extra);
        let child = spawner::spawn(command, Signal::SIGKILL)
            .unwrap_or_else(|err| panic!("cannot start redis-server ({err}). {INSTALL_HINT}"));
        *server = Some(child);
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.try_cli(&["PING"]).as_deref() != Ok("PONG") {
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer PING within 20 s{}; its log:\n{}",
                self.port,
                if self.tls_ca.is_some() {
                    " (over TLS: redis-server and redis-cli must be built with TLS, as \
                     Debian's are)"
                } else {
                    ""
                },
                std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server with SIGKILL and reaps it: every key is gone.
    pub fn crash(&self) {
        if let Some(mut child) = self.server.lock().expect("server lock").take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's pid.
    pub fn pid(&self) -> i32 {
        let server = self.server.lock().expect("server lock");
        let child = server.as_ref().expect("the server runs");
        i32::try_from(child.id()).expect("a pid")
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server.
    pub fn freeze(&self, frozen: bool) {
        let signal = if frozen {
            Signal::SIGSTOP
        } else {
            Signal::SIGCONT
        };
        kill(Pid::from_raw(self.pid()), signal).expect("signal redis-server");
    }

    /// The server's URL, by address (`rediss://` with the CA file for a TLS server, which
    /// verifies only if its certificate names 127.0.0.1).
    pub fn url(&self) -> String {
        match &self.tls_ca {
            Some(ca) => format!("rediss://127.0.0.1:{}?cacert={}", self.port, ca.display()),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The CA file that verifies a TLS server's certificate.
    pub fn ca_file(&self) -> Option<&Path> {
        self.tls_ca.as_deref()
    }

    /// `ACL SETUSER <user> on ><password> <rules...>`.
    pub fn acl_user(&self, user: &str, password: &str, rules: &[&str]) {
        let password = format!(">{password}");
        let mut command = vec!["ACL", "SETUSER", user, "on", &password];
        command.extend(rules);
        self.cli(&command);
    }

    /// Runs one command through redis-cli and returns its output, trimmed; panics on failure.
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args)
            .unwrap_or_else(|err| panic!("redis-cli {args:?} on port {}: {err}", self.port))
    }

    /// Runs one command through redis-cli: its output, or why it failed.
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        let mut command = Command::new("redis-cli");
        command.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        // redis-cli checks the certificate against the CA but not the host name.
        if let Some(ca) = &self.tls_ca {
            command.arg("--tls").arg("--cacert").arg(ca);
        }
        if let Some(password) = &self.password {
            command.env("REDISCLI_AUTH", password);
        }
        let output = command
            .args(args)
            .output()
            .map_err(|err| format!("cannot run redis-cli: {err}. {INSTALL_HINT}"))?;
        let text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if !output.status.success() || text.starts_with("ERR") || text.starts_with("NOPERM") {
            return Err(format!(
                "{text} {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(text)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
