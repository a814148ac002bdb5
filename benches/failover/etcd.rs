//! The peer: `etcdctl lock --ttl N <name> <cmd>` against a single-node etcd of the benchmark's
//! own (free ports on 127.0.0.1, a data directory under the temporary directory). etcd and
//! etcdctl come from Debian's `etcd-server` and `etcd-client`, installed with apt-get when
//! missing. The benchmark talks to etcd itself over its JSON gateway with a few lines of
//! HTTP/1.0, so that measuring needs no client library.

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use nix::unistd::geteuid;

use crate::figures::Cost;
use crate::harness::cluster::free_port;
use crate::harness::{Proxy, field, spawner, unique_lock};
use crate::tools::{
    Candidate, LockServer, SETTLE, SETUP_WAIT, Tool, Usage, child_script, first_line, wait_queued,
};

/// The lease of every `etcdctl lock` session, in seconds: the same 3 s as pgleader's lease in
/// the partition scenario (etcdctl's default is 10 s; etcd's floor is about 2 s with its
/// default election timeout).
pub const TTL_SECONDS: u64 = 3;

/// Installs etcd with apt-get if `etcd` or `etcdctl` is missing.
pub fn ensure_installed() -> anyhow::Result<()> {
    if find_program("etcd").is_some() && find_program("etcdctl").is_some() {
        return Ok(());
    }
    eprintln!("bench: etcd is missing: installing etcd-server and etcd-client with apt-get");
    let apt = |args: &[&str]| -> anyhow::Result<()> {
        let mut command = if geteuid().is_root() {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.arg("apt-get");
            sudo
        };
        let status = command
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("cannot run apt-get")?;
        if !status.success() {
            bail!("apt-get {} failed: {status}", args.join(" "));
        }
        Ok(())
    };
    apt(&["update", "-qq"])?;
    apt(&[
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "etcd-server",
        "etcd-client",
    ])?;
    if find_program("etcd").is_none() || find_program("etcdctl").is_none() {
        bail!("etcd and etcdctl are still missing after installing etcd-server and etcd-client");
    }
    Ok(())
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// A single-node etcd that lives as long as the benchmark.
pub struct Etcd {
    dir: PathBuf,
    port: u16,
    server: Child,
    etcdctl: PathBuf,
    pub version: String,
}

impl Etcd {
    pub fn start() -> anyhow::Result<Etcd> {
        let etcd = find_program("etcd").context("etcd is not installed")?;
        let etcdctl = find_program("etcdctl").context("etcdctl is not installed")?;
        let dir = std::env::temp_dir().join(format!("pgleader-bench-etcd-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).context("cannot create etcd's directory")?;
        let (port, peer_port) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let log = fs::File::create(dir.join("etcd.log")).context("cannot create etcd's log")?;
        let mut command = Command::new(&etcd);
        command
            .args(["--name", "bench", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("bench={peer_url}")])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let server = spawner::spawn(command, Signal::SIGKILL).context("cannot start etcd")?;
        let version = first_line(Command::new(&etcd).arg("--version"));
        let mut started = Etcd {
            dir,
            port,
            server,
            etcdctl,
            version,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(body) = http(port, "GET", "/health", "")
                && body.contains("\"health\":\"true\"")
            {
                return Ok(started);
            }
            if let Some(status) = started.server.try_wait()? {
                bail!("etcd exited at start-up ({status}):\n{}", started.log());
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd did not become healthy within 30 s:\n{}",
                    started.log()
                );
            }
            sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// Every gRPC message the server has received so far: lease keep-alives, watches, reads,
    /// writes, from all clients.
    fn requests_received(&self) -> anyhow::Result<u64> {
        let metrics = http(self.port, "GET", "/metrics", "")?;
        Ok(metrics
            .lines()
            .filter(|line| line.starts_with("grpc_server_msg_received_total{"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64)
    }

    fn lock_name(lock: i64) -> String {
        format!("bench-{lock}")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// etcd ends a client's session by revoking its lease.
impl LockServer for Etcd {
    fn end_session(&self, leader_line: &str) -> anyhow::Result<Instant> {
        // The mutex key is `<name>/<lease id in hex>`: revoking that lease is etcd's way of
        // ending a client's session from the server's side.
        let key = field(leader_line, "etcd_key");
        let lease = key
            .rsplit_once('/')
            .and_then(|(_, hex)| u64::from_str_radix(hex, 16).ok())
            .with_context(|| format!("no lease in {leader_line:?}"))? as i64;
        let mut stream = connect(self.port)?;
        let request = request(
            "POST",
            "/v3/lease/revoke",
            &format!(r#"{{"ID":"{lease}"}}"#),
        );
        let fault = Instant::now();
        exchange(&mut stream, &request)?;
        Ok(fault)
    }

    fn pids(&self) -> Vec<i32> {
        vec![self.server.id() as i32]
    }

    fn port(&self) -> u16 {
        self.port
    }
}

impl Tool for Etcd {
    fn label(&self) -> &'static str {
        "etcdctl lock"
    }

    fn candidate(&self, tag: &str, lock: i64, proxy: Option<&Proxy>) -> Candidate {
        let port = proxy.map_or(self.port, Proxy::port);
        let mut command = Command::new(&self.etcdctl);
        command
            .env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
            )
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=http://127.0.0.1:{port}"))
            .args([
                "lock",
                "--ttl",
                &TTL_SECONDS.to_string(),
                &Etcd::lock_name(lock),
            ])
            .args(["--", "sh", "-c", &child_script(tag)]);
        Candidate::spawn(tag, command)
    }

    fn queued(&self, lock: i64) -> anyhow::Result<usize> {
        // Every holder and waiter of an etcd mutex owns one key under `<name>/`.
        let prefix = format!("{}/", Etcd::lock_name(lock));
        let end = format!("{}0", Etcd::lock_name(lock));
        let body = http(
            self.port,
            "POST",
            "/v3/kv/range",
            &format!(
                r#"{{"key":"{}","range_end":"{}","count_only":true}}"#,
                base64(prefix.as_bytes()),
                base64(end.as_bytes())
            ),
        )?;
        let reply: serde_json::Value = serde_json::from_str(&body)?;
        // The gateway leaves out fields that are zero.
        Ok(match &reply["count"] {
            serde_json::Value::String(count) => count.parse()?,
            serde_json::Value::Number(count) => count.as_u64().unwrap_or(0) as usize,
            _ => 0,
        })
    }

    fn server(&self) -> &dyn LockServer {
        self
    }

    fn handoff_bound(&self) -> Duration {
        Duration::from_secs(TTL_SECONDS + 5)
    }

    fn why_never(&self) -> &'static str {
        "etcdctl lock does not watch its session and passes no signal on to its child; it \
         releases the lock only after the child has exited on its own (or at lease expiry when \
         etcdctl itself dies)"
    }

    fn cost(&self, window: Duration) -> anyhow::Result<Vec<Cost>> {
        // etcd's counters do not tell clients apart: count a leader alone first, then what a
        // follower adds to it.
        let lock = unique_lock();
        let leader = self.candidate("A", lock, None);
        leader
            .started(None, SETUP_WAIT)
            .with_context(|| format!("the leader never started\n{}", leader.dump()))?;
        sleep(SETTLE * 3);
        let before = self.requests_received()?;
        let alone = Usage::measure(&[leader.pid()], None, window);
        let leader_rate = (self.requests_received()? - before) as f64 / window.as_secs_f64();

        let follower = self.candidate("B", lock, None);
        wait_queued(self, lock, 2, SETUP_WAIT)?;
        sleep(SETTLE * 3);
        let before = self.requests_received()?;
        let together = Usage::measure(&[follower.pid()], None, window);
        let both_rate = (self.requests_received()? - before) as f64 / window.as_secs_f64();
        let how = "gRPC messages etcd received (its /metrics), one window alone, then one with the follower added";
        Ok(vec![
            alone.cost(0, self.label(), "leader", leader_rate, how),
            together.cost(
                0,
                self.label(),
                "follower",
                (both_rate - leader_rate).max(0.0),
                how,
            ),
        ])
    }
}

fn connect(port: u16) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(("127.0.0.1", port)).context("cannot reach etcd")?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(stream)
}

/// HTTP/1.0, so that the reply is never chunked and ends when etcd closes the connection.
fn request(method: &str, path: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends a request, returns the body of a 200 reply.
fn exchange(stream: &mut TcpStream, request: &str) -> anyhow::Result<String> {
    stream.write_all(request.as_bytes())?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head.lines().next().unwrap_or_default();
    if !status.contains(" 200 ") {
        bail!("etcd answered {status:?}: {body}");
    }
    Ok(body.to_owned())
}

fn http(port: u16, method: &str, path: &str, body: &str) -> anyhow::Result<String> {
    exchange(&mut connect(port)?, &request(method, path, body))
}

/// Standard base64 with padding, which the gateway wants for keys.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Where etcd keeps its data, for the report.
pub fn data_dir_note() -> String {
    let dir = std::env::temp_dir();
    format!(
        "data directory under {} ({}), fsync on (etcd 3.4 cannot turn it off)",
        dir.display(),
        filesystem_of(&dir)
    )
}

fn filesystem_of(path: &Path) -> String {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount, kind) = (fields.next()?, fields.next()?, fields.next()?);
            path.starts_with(mount)
                .then(|| (mount.len(), kind.to_owned()))
        })
        .max()
        .map_or_else(|| "unknown filesystem".into(), |(_, kind)| kind)
}
