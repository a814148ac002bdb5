//! Pings to a monitor (`ping=URL` on a crontab job), in the protocol of healthchecks.io, which
//! Healthchecks, Cronitor-style monitors and Uptime Kuma's push monitors understand: `URL/start`
//! when a run starts, `URL` when it succeeds, `URL/N` when it exits with status N, and
//! `URL/fail` with a short body for an occurrence that was missed, skipped or interrupted,
//! each carrying `rid=`, a run id made from the job and the occurrence, so that the start and
//! the end of a run match whichever replica sent them.
//!
//! A ping is news about the schedule, never part of it: the runs hand each ping to a bounded
//! queue of its job's and go on. A task per job sends that job's pings one after the other, in
//! the order they came (a monitor must not see a run's start after its end), each attempt
//! bounded by [`ATTEMPT_TIMEOUT`], retried [`ATTEMPTS`] times, and counted as undelivered when
//! all fail or when the queue is full; a monitor that hangs holds up its own jobs' pings only.
//! At most [`IN_FLIGHT`] go at once across the jobs. A replica that ends waits a moment for the
//! pings still queued ([`drain`]), so that a drained run's end reaches its monitor. A monitor's
//! URL is its credential (a Healthchecks UUID, a ping key): logs, status and metrics show its
//! scheme and host only ([`Target::shown`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Notify, Semaphore, mpsc};
use tracing::{debug, warn};
use url::Url;

use crate::election::lock::LockKey;
use crate::operate::telemetry::Telemetry;
use crate::schedule::{RunView, ScheduledOutcome};

/// How many pings of one job wait to be sent at most; more are dropped (and counted).
pub const QUEUE: usize = 32;

/// How many pings are sent at once, across the jobs.
const IN_FLIGHT: usize = 64;

/// How long an ending replica waits for the pings still queued.
pub const DRAIN: Duration = Duration::from_secs(5);

/// How many times a ping is tried.
pub const ATTEMPTS: u32 = 3;

/// How long one attempt may take, from connecting to the answer's status.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The pause before the second attempt (doubled before each next).
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// A monitor's URL, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct Target(Url);

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Target({})", self.shown())
    }
}

impl Target {
    /// An `http://` or `https://` URL with a host, `{job}` in it replaced by `job` (a default
    /// for every job of a file: `https://hc-ping.com/KEY/{job}`). The error never repeats the
    /// URL's path or query.
    pub fn parse(text: &str, job: &str) -> Result<Target, String> {
        let text = text.replace("{job}", job);
        let url = Url::parse(&text).map_err(|err| format!("not a URL ({err})"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("not an http:// or https:// URL: a monitor is pinged over HTTP".into());
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err("a URL without a host".into());
        }
        if url.fragment().is_some() || !url.username().is_empty() || url.password().is_some() {
            return Err("a URL with a #fragment or a user: a monitor's URL has neither".into());
        }
        Ok(Target(url))
    }

    /// What logs, status and metrics show of it: the scheme and the host (and port), never the
    /// path or query, which hold the check's credential.
    pub fn shown(&self) -> String {
        let url = &self.0;
        match url.port() {
            Some(port) => format!(
                "{}://{}:{port}",
                url.scheme(),
                url.host_str().unwrap_or_default()
            ),
            None => format!("{}://{}", url.scheme(), url.host_str().unwrap_or_default()),
        }
    }

    /// The whole URL, for a job's definition's hash only (never shown).
    pub fn url_for_fingerprint(&self) -> &str {
        self.0.as_str()
    }

    /// The URL of a ping: the path gets `suffix` (`/start`, `/fail`, `/3`, or nothing), the
    /// query `rid=`.
    fn url(&self, suffix: &str, rid: &str) -> Url {
        let mut url = self.0.clone();
        if !suffix.is_empty() {
            let path = format!("{}{suffix}", url.path().trim_end_matches('/'));
            url.set_path(&path);
        }
        url.query_pairs_mut().append_pair("rid", rid);
        url
    }
}

/// One ping to send.
#[derive(Debug)]
struct Ping {
    job: String,
    url: Url,
    shown: String,
    body: String,
}

/// The pings queued or being sent, process-wide, for [`drain`].
static PENDING: AtomicUsize = AtomicUsize::new(0);
static SETTLED: Notify = Notify::const_new();

/// One ping less to wait for.
fn settled() {
    if PENDING.fetch_sub(1, Ordering::AcqRel) == 1 {
        SETTLED.notify_waiters();
    }
}

/// Waits up to `bound` for the pings still queued or being sent (a replica that ends).
pub async fn drain(bound: Duration) {
    let _ = tokio::time::timeout(bound, async {
        loop {
            let settled = SETTLED.notified();
            if PENDING.load(Ordering::Acquire) == 0 {
                return;
            }
            settled.await;
        }
    })
    .await;
}

/// Sends the pings of a replica's jobs, each job's in order: cheap to clone, the clones
/// sharing the jobs' queues.
#[derive(Clone, Debug)]
pub struct Pinger {
    queues: Rc<RefCell<HashMap<String, mpsc::Sender<Ping>>>>,
    slots: Arc<Semaphore>,
    telemetry: Telemetry,
}

impl Pinger {
    /// A pinger whose jobs' tasks start on the current runtime with their first ping;
    /// `telemetry` counts what could not be delivered.
    pub fn new(telemetry: Telemetry) -> Pinger {
        Pinger {
            queues: Rc::default(),
            slots: Arc::new(Semaphore::new(IN_FLIGHT)),
            telemetry,
        }
    }

    /// The queue of `job`'s pings, and its task, started with its first ping.
    fn queue_of(&self, job: &str) -> mpsc::Sender<Ping> {
        let mut queues = self.queues.borrow_mut();
        queues
            .entry(job.to_owned())
            .or_insert_with(|| {
                let (queue, pings) = mpsc::channel(QUEUE);
                tokio::spawn(send_in_order(
                    pings,
                    self.slots.clone(),
                    self.telemetry.clone(),
                ));
                queue
            })
            .clone()
    }

    /// Pings `target` about `run` of `job`, if the run says something a monitor wants: its
    /// start, or its outcome. Never waits.
    pub fn run(&self, job: &str, target: &Target, run: &RunView) {
        let at = crate::time::rfc3339(run.scheduled_for);
        let (suffix, body) = match run.outcome {
            None if run.claimed_at.is_some() => ("/start".to_owned(), String::new()),
            // A paused job is neither late nor failing: its monitor is told nothing.
            None | Some(ScheduledOutcome::Busy | ScheduledOutcome::Paused) => return,
            Some(ScheduledOutcome::Succeeded) => (String::new(), String::new()),
            Some(ScheduledOutcome::Failed) => match run.exit_code {
                Some(code) => (
                    format!("/{}", code.clamp(1, 255)),
                    format!("pgleader: the run of {at} failed, exit status {code}"),
                ),
                None => (
                    "/fail".to_owned(),
                    format!("pgleader: the run of {at} failed"),
                ),
            },
            Some(outcome) => (
                "/fail".to_owned(),
                format!(
                    "pgleader: the occurrence of {at} was {}",
                    match outcome {
                        ScheduledOutcome::Interrupted =>
                            "interrupted: its run was stopped, or its replica was lost, before it ended",
                        ScheduledOutcome::Skipped => "skipped: the previous run was still going",
                        _ => "missed: no replica could run it in time",
                    }
                ),
            ),
        };
        let ping = Ping {
            job: job.to_owned(),
            url: target.url(&suffix, &run_id(job, &at)),
            shown: target.shown(),
            body,
        };
        PENDING.fetch_add(1, Ordering::AcqRel);
        if let Err(err) = self.queue_of(job).try_send(ping) {
            settled();
            let ping = match err {
                mpsc::error::TrySendError::Full(ping) | mpsc::error::TrySendError::Closed(ping) => {
                    ping
                }
            };
            warn!(event = "ping_dropped", job = %ping.job, monitor = %ping.shown, "a ping to {} was dropped: {QUEUE} pings of job {} already wait to be sent", ping.shown, ping.job);
            self.telemetry.ping_undelivered(&ping.job);
        }
    }
}

/// The run id of `job`'s occurrence `at`: a UUID (as healthchecks.io wants one) made from a
/// hash of both, so that the start and the end of a run carry the same one whichever replica
/// sends them.
pub fn run_id(job: &str, at: &str) -> String {
    let high = LockKey::from_name(&format!("pgleader rid {job} {at}")).key() as u64;
    let low = LockKey::from_name(&format!("pgleader rid2 {job} {at}")).key() as u64;
    let high = (high & !0xf000) | 0x4000;
    let low = (low & !(0b11 << 62)) | (0b10 << 62);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// Sends one job's pings, one after the other.
async fn send_in_order(
    mut pings: mpsc::Receiver<Ping>,
    slots: Arc<Semaphore>,
    telemetry: Telemetry,
) {
    while let Some(ping) = pings.recv().await {
        if let Ok(_slot) = slots.acquire().await {
            deliver(ping, &telemetry).await;
        }
        settled();
    }
}

async fn deliver(ping: Ping, telemetry: &Telemetry) {
    let mut pause = RETRY_PAUSE;
    let mut last = String::new();
    for attempt in 1..=ATTEMPTS {
        match tokio::time::timeout(ATTEMPT_TIMEOUT, send(&ping)).await {
            Ok(Ok(status)) if (200..300).contains(&status) => {
                debug!(event = "ping_sent", job = %ping.job, monitor = %ping.shown, status, attempt, "pinged {}", ping.shown);
                return;
            }
            Ok(Ok(status)) => last = format!("it answered {status}"),
            Ok(Err(err)) => last = err,
            Err(_) => {
                last = format!(
                    "no answer within {}",
                    crate::time::for_people(ATTEMPT_TIMEOUT)
                );
            }
        }
        if attempt < ATTEMPTS {
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }
    warn!(event = "ping_undelivered", job = %ping.job, monitor = %ping.shown, "a ping of job {} to {} could not be delivered after {ATTEMPTS} attempts: {last}", ping.job, ping.shown);
    telemetry.ping_undelivered(&ping.job);
}

/// One attempt: a POST of the body, the answer's status.
async fn send(ping: &Ping) -> Result<u16, String> {
    use rustls::pki_types::ServerName;
    let url = &ping.url;
    let port = url.port_or_known_default().unwrap_or(80);
    // A name is looked up; an address (`[::1]` in the URL) is connected to as it is, and its
    // certificate checked for the address.
    let (tcp, name) = match url.host() {
        Some(url::Host::Domain(domain)) => (
            TcpStream::connect((domain, port)).await,
            ServerName::try_from(domain.to_owned()).map_err(|err| err.to_string()),
        ),
        Some(url::Host::Ipv4(address)) => (
            TcpStream::connect((address, port)).await,
            Ok(ServerName::IpAddress(std::net::IpAddr::V4(address).into())),
        ),
        Some(url::Host::Ipv6(address)) => (
            TcpStream::connect((address, port)).await,
            Ok(ServerName::IpAddress(std::net::IpAddr::V6(address).into())),
        ),
        None => return Err("no host".into()),
    };
    let tcp = tcp.map_err(|err| format!("cannot connect: {err}"))?;
    if url.scheme() == "https" {
        // Read once, off the runtime's thread (the certificate store is files); after that,
        // taken as it is.
        let config = match TLS_CONFIG.get() {
            Some(config) => config.clone()?,
            None => tokio::task::spawn_blocking(tls_config)
                .await
                .map_err(|err| format!("TLS: {err}"))??,
        };
        let name = name.map_err(|err| format!("not a host name for TLS: {err}"))?;
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|err| format!("TLS: {err}"))?;
        post(tls, ping).await
    } else {
        post(tcp, ping).await
    }
}

async fn post<S>(stream: S, ping: &Ping) -> Result<u16, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|err| format!("HTTP: {err}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let url = &ping.url;
    let mut target = url.path().to_owned();
    if let Some(query) = url.query() {
        target.push('?');
        target.push_str(query);
    }
    // host_str() keeps an IPv6 address's brackets, as the Host header wants them.
    let authority = match url.port() {
        Some(port) => format!("{}:{port}", url.host_str().unwrap_or_default()),
        None => url.host_str().unwrap_or_default().to_owned(),
    };
    let request = hyper::Request::post(target)
        .header(hyper::header::HOST, authority)
        .header(
            hyper::header::USER_AGENT,
            concat!("pgleader/", env!("CARGO_PKG_VERSION")),
        )
        .header(hyper::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(ping.body.clone())))
        .map_err(|err| format!("HTTP: {err}"))?;
    let answer = sender
        .send_request(request)
        .await
        .map_err(|err| format!("HTTP: {err}"))?;
    Ok(answer.status().as_u16())
}

/// The TLS settings of every ping: the system's trusted roots (`SSL_CERT_FILE` and
/// `SSL_CERT_DIR` point elsewhere), read once.
static TLS_CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();

fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    TLS_CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err("no certificate found in the system's certificate store (install the ca-certificates package, or point SSL_CERT_FILE at a bundle)".into());
            }
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("TLS: {err}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
            Ok(Arc::new(config))
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ping_url_keeps_its_query_gets_the_suffix_and_the_run_id_and_shows_its_host_only() {
        let target =
            Target::parse("https://hc-ping.com/KEY/{job}?create=1", "backup").expect("a URL");
        assert_eq!(target.shown(), "https://hc-ping.com");
        let rid = run_id("backup", "2026-11-28T03:00:00Z");
        assert_eq!(rid, run_id("backup", "2026-11-28T03:00:00Z"));
        assert_ne!(rid, run_id("backup", "2026-11-28T03:01:00Z"));
        assert_eq!(rid.len(), 36);
        assert_eq!(&rid[14..15], "4");
        assert_eq!(
            target.url("/start", &rid).as_str(),
            format!("https://hc-ping.com/KEY/backup/start?create=1&rid={rid}")
        );
        let plain = Target::parse("http://127.0.0.1:8000/ping/abc/", "x").expect("a URL");
        assert_eq!(plain.shown(), "http://127.0.0.1:8000");
        assert_eq!(
            plain.url("/3", "r").as_str(),
            "http://127.0.0.1:8000/ping/abc/3?rid=r"
        );
        assert_eq!(
            plain.url("", "r").as_str(),
            "http://127.0.0.1:8000/ping/abc/?rid=r"
        );
    }

    #[test]
    fn a_bad_ping_url_is_refused_without_repeating_its_secret() {
        for (text, wanted) in [
            ("hc-ping.com/SECRET", "not a URL"),
            ("ftp://host/SECRET", "not an http:// or https:// URL"),
            ("https://user:pw@host/SECRET", "user"),
            ("https://host/SECRET#x", "fragment"),
        ] {
            let err = Target::parse(text, "job").expect_err(text);
            assert!(err.contains(wanted), "{text}: {err}");
            assert!(!err.contains("SECRET"), "{err}");
        }
    }
}
