//! The electing phase: connect (retrying what can be retried, with backoff), then wait for the
//! lock without polling, or try once (`--no-wait`, a timer).

use anyhow::bail;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{Acquired, STABLE_SESSION, Supervisor, WaitEvent};
use crate::election::{Backend, ConnectError, Session, SessionError, elsewhere_hint};
use crate::operate::notify;
use crate::time::for_people as fmt;

impl<B: Backend> Supervisor<B> {
    /// Connects, retrying transient failures with backoff. `None` means shut down.
    pub(super) async fn connect(&mut self) -> anyhow::Result<Option<B::Session>> {
        let server = self.backend.to_string();
        notify::status(&format!("connecting to {server}"));
        self.inbox.telemetry.connecting();
        loop {
            debug!(event = "connecting", server = %server, "connecting");
            let attempt = self.backend.connect(&self.settings.session_name);
            tokio::pin!(attempt);
            let result = loop {
                let event = tokio::select! {
                    result = &mut attempt => Ok(result),
                    event = self.inbox.next_signal() => Err(event),
                };
                match event {
                    Ok(result) => break result,
                    Err(event) => {
                        if self.inbox.idle_signal(event) {
                            return Ok(None);
                        }
                    }
                }
            };
            let err = match result {
                Ok(session) => {
                    info!(
                        event = "connected",
                        server = %server,
                        backend_pid = session.id(),
                        server_version = session.server_version(),
                        "connected"
                    );
                    return Ok(Some(session));
                }
                Err(err) => err,
            };
            match err {
                err @ ConnectError::Conflict(_) => return Err(err.into()),
                ConnectError::Permanent(reason) => {
                    bail!(
                        "cannot connect to {server}: {reason}{}",
                        self.backend.password_hint(&reason)
                    );
                }
                err if self.settings.no_wait && !self.duty.is_scheduled() => {
                    bail!("cannot connect to {server}: {err} (--no-wait tries once)");
                }
                err if self.connect_deadline.is_some_and(|at| Instant::now() >= at) => {
                    bail!(
                        "cannot connect to {server}: {err} (a scheduled --once stops retrying after --catch-up)"
                    );
                }
                err => {
                    // Said once, in the first line.
                    let first = self.last_disturbance.is_none();
                    let elsewhere = elsewhere_hint(&err, first, &server);
                    self.last_disturbance = Some(Instant::now());
                    let delay = self.backoff.next_delay();
                    self.inbox.telemetry.connect_failed(&err.to_string(), delay);
                    notify::status(&format!(
                        "cannot connect to {server}: {err}; retrying in {}",
                        fmt(delay)
                    ));
                    warn!(
                        event = "connect_failed",
                        server = %server,
                        reason = %err,
                        "cannot connect; retrying in {}{elsewhere}",
                        fmt(delay)
                    );
                    if !self.inbox.pause(delay).await {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Waits for the lock on this session (or tries once under `--no-wait` and for a timer).
    pub(super) async fn acquire(
        &mut self,
        mut session: B::Session,
    ) -> anyhow::Result<Acquired<B::Session>> {
        let lock = self.settings.lock.clone();
        if self.settings.no_wait || self.duty.is_timer() {
            return match session.try_acquire().await {
                Ok(true) => Ok(Acquired::Won(session)),
                Ok(false) => {
                    let why = self.duty.busy_reason(&session).await;
                    info!(
                        event = "busy",
                        lock = %lock,
                        exit_code = self.settings.busy_exit_code,
                        "another instance holds the lock; exiting ({why})"
                    );
                    Ok(Acquired::Busy)
                }
                // The backend's message says what failed ("cannot try the lock: ...").
                Err(err) => Err(err.into()),
            };
        }

        if !self.health.is_healthy() {
            // Turned unhealthy while connecting: never queued.
            drop(session);
            return Ok(Acquired::Unhealthy);
        }
        info!(
            event = "waiting",
            lock = %lock,
            backend_pid = session.id(),
            "waiting for the lock"
        );
        notify::following(&lock);
        self.inbox.telemetry.following(session.id());
        let started = Instant::now();
        let wait = session.wait();
        tokio::pin!(wait);
        loop {
            // Biased: a grant that arrives with the connection's end is no grant at all.
            let event = tokio::select! {
                biased;
                reason = session.ended() => WaitEvent::Ended(reason),
                event = self.inbox.next_signal() => WaitEvent::Signal(event),
                () = self.health.turned_unhealthy() => WaitEvent::Unhealthy,
                result = &mut wait => WaitEvent::Done(result),
            };
            let stable = started.elapsed() >= STABLE_SESSION;
            match event {
                WaitEvent::Done(Ok(())) => return Ok(Acquired::Won(session)),
                WaitEvent::Done(Err(err @ SessionError::Unsafe(_))) => return Err(err.into()),
                WaitEvent::Done(Err(SessionError::Query(reason))) | WaitEvent::Ended(reason) => {
                    self.last_disturbance = Some(Instant::now());
                    warn!(event = "session_lost", reason = %reason, "lost the session while waiting for the lock");
                    self.inbox.telemetry.session_lost(&reason);
                    notify::status(&format!(
                        "lost the session while waiting for the lock: {reason}"
                    ));
                    return Ok(Acquired::Lost { stable });
                }
                WaitEvent::Unhealthy => {
                    info!(event = "left_queue", lock = %lock, "left the queue for the lock: unhealthy until the health probe passes");
                    notify::status("unhealthy: left the queue until the health probe passes");
                    // As for a shutdown: the lock may have been granted a moment ago; the
                    // session is closed, never reused.
                    drop(session);
                    return Ok(Acquired::Unhealthy);
                }
                WaitEvent::Signal(event) => {
                    if self.inbox.idle_signal(event) {
                        // The lock may have been granted a moment ago; dropping the session
                        // closes it, which frees anything it holds.
                        drop(session);
                        return Ok(Acquired::Shutdown);
                    }
                }
            }
        }
    }
}
