//! The HTTP endpoint of `--http`: `/leader` (200 while this instance leads, else 503), `/healthz`
//! (200 while healthy, else 503 with the reason; with `--health-cmd`, 503 too while the probe
//! has not passed or has failed `--health-retries` times in a row), `/status` (JSON) and `/metrics` (Prometheus).
//!
//! It runs as tasks on pgleader's one runtime thread, beside the supervisor, and only reads:
//! each answer is made from a clone of the published state or from atomic counters (see
//! `telemetry.rs`; what each route says is `telemetry/answers.rs`), so a client can never hold
//! up the supervisor. Running on the same thread is deliberate: if pgleader's event loop were
//! stuck, the endpoint would stop answering too, which is what a liveness probe should see.
//!
//! A client cannot pile up work or hold resources for long either: at most
//! [`MAX_CONNECTIONS`] connections at once (beyond that a new one is closed at once), request
//! heads of at most 8 KiB that must arrive within [`READ_TIMEOUT`] (which also ends idle
//! keep-alive connections), and no connection lives longer than [`CONNECTION_LIFETIME`], which
//! bounds the time spent writing to a client that does not read.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use jiff::Timestamp;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::operate::metrics;
use crate::operate::telemetry::Telemetry;

/// Connections served at once; a new one beyond this is closed without an answer.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send a request's head, counted from the connection or from
/// the previous answer.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is kept, whatever it does.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// The most a request's head (request line and headers) may take; hyper's minimum buffer.
const MAX_HEAD: usize = 8192;

/// Listens on `address`. Called before the election, so that a port that is taken stops
/// pgleader at once (exit 1) instead of after it has won the lock.
pub async fn bind(address: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address} (--http)"))
}

/// Serves the routes on `listener` from a task of its own, for as long as the runtime runs.
pub fn spawn(listener: TcpListener, telemetry: Telemetry) {
    if let Ok(address) = listener.local_addr() {
        info!(event = "http", address = %address, "serving /leader, /healthz, /status and /metrics on http://{address}");
    }
    tokio::spawn(serve(listener, telemetry));
}

async fn serve(listener: TcpListener, telemetry: Telemetry) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(READ_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .max_headers(32);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of file descriptors, most likely: let some close before trying again.
                warn!(event = "http_accept_failed", reason = %err, "cannot accept an HTTP connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(
                event = "http_refused",
                "{MAX_CONNECTIONS} HTTP connections are open; closing a new one"
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let telemetry = telemetry.clone();
        let connection = builder.serve_connection(
            TokioIo::new(stream),
            service_fn(move |request| {
                let response = answer(&telemetry, &request);
                async move { Ok::<_, Infallible>(response) }
            }),
        );
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop(slot);
        });
    }
}

/// The answer to one request: made at once from what is published, never waiting.
fn answer<B>(telemetry: &Telemetry, request: &Request<B>) -> Response<Full<Bytes>> {
    let route = request.uri().path();
    if !matches!(route, "/leader" | "/healthz" | "/status" | "/metrics") {
        return plain(StatusCode::NOT_FOUND, format!("no such route: {route}\n"));
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let mut response = plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are allowed\n".to_owned(),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let snapshot = telemetry.snapshot();
    let response = match route {
        "/leader" => match telemetry.leads(&snapshot) {
            Ok(()) => plain(StatusCode::OK, "leader\n".to_owned()),
            Err(instead) => plain(StatusCode::SERVICE_UNAVAILABLE, format!("{instead}\n")),
        },
        "/healthz" => match telemetry.health(&snapshot, Timestamp::now()) {
            Ok(()) => plain(StatusCode::OK, format!("ok: {}\n", snapshot.role.as_str())),
            Err(reason) => plain(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
        },
        "/status" => with_type(
            StatusCode::OK,
            format!("{}\n", telemetry.status_json(&snapshot, Timestamp::now())),
            "application/json",
        ),
        _ => with_type(
            StatusCode::OK,
            telemetry.render_metrics(),
            metrics::CONTENT_TYPE,
        ),
    };
    // For HEAD, hyper sends these headers (Content-Length included) and no body.
    response
}

fn plain(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    with_type(status, body, "text/plain; charset=utf-8")
}

fn with_type(
    status: StatusCode,
    body: String,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
