//! Pings to a monitor (`ping=URL` on a crontab job), in the protocol of healthchecks.io, which
//! Healthchecks, Cronitor-style monitors and Uptime Kuma's push monitors understand: `URL/start`
//! when a run starts, `URL` when it succeeds, `URL/N` when it exits with status N, and
//! `URL/fail` with a short body for an occurrence that was missed, skipped or interrupted,
//! each carrying `rid=`, a run id made from the job and the occurrence, so that the start and
//! the end of a run match whichever replica sent them.
//!
//! A ping is news about the schedule, never part of it: the runs hand each ping to a bounded
//! queue and go on; one task sends them, a few at once, each attempt bounded by
//! [`ATTEMPT_TIMEOUT`], retried [`ATTEMPTS`] times, and counted as undelivered when all fail or
//! when the queue is full. A monitor's URL is its credential (a Healthchecks UUID, a ping key):
//! logs, status and metrics show its scheme and host only ([`Target::shown`]).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tracing::{debug, warn};
use url::Url;

use crate::election::lock::LockKey;
use crate::operate::telemetry::Telemetry;
use crate::schedule::{RunView, ScheduledOutcome};

/// How many pings wait to be sent at most; more are dropped (and counted).
pub const QUEUE: usize = 256;

/// How many pings are sent at once.
const IN_FLIGHT: usize = 8;

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
            return Err(format!(
                "a {}: URL; a monitor is pinged over http:// or https://",
                url.scheme()
            ));
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

/// Sends the pings of a replica's jobs: cheap to clone, each clone queueing to the same task.
#[derive(Clone, Debug)]
pub struct Pinger {
    queue: mpsc::Sender<Ping>,
    telemetry: Telemetry,
}

impl Pinger {
    /// Starts the task that sends the pings (on the current runtime); `telemetry` counts what
    /// could not be delivered.
    pub fn start(telemetry: Telemetry) -> Pinger {
        let (queue, pings) = mpsc::channel(QUEUE);
        tokio::spawn(send_all(pings, telemetry.clone()));
        Pinger { queue, telemetry }
    }

    /// Pings `target` about `run` of `job`, if the run says something a monitor wants: its
    /// start, or its outcome. Never waits.
    pub fn run(&self, job: &str, target: &Target, run: &RunView) {
        let at = crate::time::rfc3339(run.scheduled_for);
        let (suffix, body) = match run.outcome {
            None if run.claimed_at.is_some() => ("/start".to_owned(), String::new()),
            None | Some(ScheduledOutcome::Busy) => return,
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
        if let Err(err) = self.queue.try_send(ping) {
            let ping = match err {
                mpsc::error::TrySendError::Full(ping) | mpsc::error::TrySendError::Closed(ping) => {
                    ping
                }
            };
            warn!(event = "ping_dropped", job = %ping.job, monitor = %ping.shown, "a ping to {} was dropped: {QUEUE} pings already wait to be sent", ping.shown);
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

async fn send_all(mut pings: mpsc::Receiver<Ping>, telemetry: Telemetry) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(ping) = pings.recv().await {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let telemetry = telemetry.clone();
        tokio::spawn(async move {
            deliver(ping, &telemetry).await;
            drop(slot);
        });
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
    let url = &ping.url;
    let host = url.host_str().unwrap_or_default();
    let port = url.port_or_known_default().unwrap_or(80);
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|err| format!("cannot connect: {err}"))?;
    if url.scheme() == "https" {
        let config = tls_config()?;
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|err| format!("not a host name for TLS: {err}"))?;
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
fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
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
            ("ftp://host/SECRET", "a ftp: URL"),
            ("https://user:pw@host/SECRET", "user"),
            ("https://host/SECRET#x", "fragment"),
        ] {
            let err = Target::parse(text, "job").expect_err(text);
            assert!(err.contains(wanted), "{text}: {err}");
            assert!(!err.contains("SECRET"), "{err}");
        }
    }
}
