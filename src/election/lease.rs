//! The lease: how long the server keeps the lock of a leader it no longer hears from.
//!
//! A leader that stops hearing from the server (a silent partition: no RST, no FIN) stops its
//! child once `check-interval + check-timeout` have passed since its last successful check,
//! and the child is gone at most `kill-timeout` later. The server, on its side, frees the lock
//! only when it gives up on the leader. The rule every backend keeps: the server never frees
//! the lock before `last successful check + lease`, and frees it within about a lease after.
//! Requiring `lease >= check-interval + check-timeout + kill-timeout + margin` (plus
//! `hook-timeout` with `--post-stop`: `--post-stop` runs before the lock may go) therefore means
//! the old child is gone before anyone else can win. [`Lease::validate`] refuses anything else.
//!
//! How the server is made to keep it is the backend's business. PostgreSQL's defaults would
//! keep a silent leader's lock for about two hours (TCP keepalives), so pgleader sets, on its
//! own session (`postgres/session.rs`):
//!
//! - `idle_session_timeout` = lease (PostgreSQL 14+): a leader sends a check every
//!   check-interval, so a session idle for a whole lease belongs to a leader that is gone;
//! - `tcp_user_timeout` = lease: data the server sent must be acknowledged within the lease;
//! - `tcp_keepalives_idle/interval/count` adding up to at least the lease (computed here, as
//!   any TCP backend would set them).
//!
//! Each of these starts counting at the earliest at the leader's last successful check. The
//! same keepalives, on pgleader's side of the socket, let a waiting follower notice a dead
//! server. (A key's TTL is the lease on Redis.)

use std::time::Duration;

/// Room left for scheduling delays between the leader's deadline and the server's release. A
/// quarter of it is the grace a command's keeper gives pgleader to act at the deadline itself
/// before it stops the command in pgleader's place (`supervise::watchdog::GRACE`).
pub const MARGIN: Duration = Duration::from_secs(1);

/// Probes a dead peer gets before the connection is declared dead.
const KEEPALIVE_COUNT: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    duration: Duration,
}

impl Lease {
    pub fn new(duration: Duration) -> Self {
        Lease { duration }
    }

    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// The lease in whole seconds, rounded up: keepalive settings take seconds.
    fn whole_seconds(&self) -> u64 {
        self.duration.as_secs() + u64::from(self.duration.subsec_nanos() > 0)
    }

    pub fn keepalive_interval(&self) -> Duration {
        Duration::from_secs((self.whole_seconds() / 6).max(1))
    }

    pub fn keepalive_count(&self) -> u32 {
        KEEPALIVE_COUNT
    }

    /// Idle time before the first probe, chosen so that idle + interval × count is at least
    /// the lease.
    pub fn keepalive_idle(&self) -> Duration {
        let probing = self.keepalive_interval().as_secs() * u64::from(KEEPALIVE_COUNT);
        Duration::from_secs(self.whole_seconds().saturating_sub(probing).max(1))
    }

    /// How often the server checks that a waiting follower's client is still connected
    /// (`client_connection_check_interval`), so dead waiters leave the queue.
    pub fn client_check_interval(&self) -> Duration {
        Duration::from_secs(1)
    }

    /// Refuses timings where an old leader's child could still run when the server frees the
    /// lock.
    pub fn validate(&self, stop: &StopTimings) -> Result<(), String> {
        let needed = stop.total() + MARGIN;
        if self.duration < needed {
            return Err(format!(
                "--lease {} is too short: a leader cut off from the server stops its command up to \
                 {} = {} after its last successful check, and the server must not free the lock \
                 before that (plus {} of margin). Use --lease {} or more, or shorten the other \
                 timings",
                fmt(self.duration),
                stop.names(),
                fmt(stop.total()),
                fmt(MARGIN),
                fmt(needed),
            ));
        }
        Ok(())
    }
}

/// What a leader cut off from the server takes, at most, from its last successful check until
/// nothing of its leadership is left: the deadline (`check-interval + check-timeout`), the
/// kill timeout, and `--post-stop` when hooks are set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopTimings {
    pub check_interval: Duration,
    pub check_timeout: Duration,
    pub kill_timeout: Duration,
    /// `--hook-timeout`, with `--post-stop`.
    pub hook_timeout: Option<Duration>,
}

impl StopTimings {
    pub fn total(&self) -> Duration {
        self.check_interval
            + self.check_timeout
            + self.kill_timeout
            + self.hook_timeout.unwrap_or_default()
    }

    /// The options that add up to [`StopTimings::total`].
    fn names(&self) -> &'static str {
        if self.hook_timeout.is_some() {
            "--check-interval + --check-timeout + --kill-timeout + --hook-timeout"
        } else {
            "--check-interval + --check-timeout + --kill-timeout"
        }
    }
}

/// How much faster than a leader's clock a server's clock may run, in percent, when the lease is
/// a TTL that the server counts itself (Redis): the key must outlive the leader's deadline by
/// this much more.
pub const CLOCK_DRIFT_PERCENT: u32 = 1;

impl Lease {
    /// [`Lease::validate`] for a lease that is a key's TTL on the server's clock: the key must
    /// outlive the leader's deadline even if the server's clock runs
    /// [`CLOCK_DRIFT_PERCENT`] faster than the leader's.
    pub fn validate_ttl(&self, stop: &StopTimings) -> Result<(), String> {
        let deadline = stop.total() + MARGIN;
        let needed = deadline * 100 / (100 - CLOCK_DRIFT_PERCENT);
        if self.duration < needed {
            return Err(format!(
                "--lease {} is too short: it is the Redis key's TTL, and a leader cut off from \
                 the server stops its command up to {} = {} after its last successful check; \
                 the key must outlive that, plus {} of margin, even if the server's clock runs \
                 {CLOCK_DRIFT_PERCENT}% fast. Use --lease {} or more, or shorten the other \
                 timings",
                fmt(self.duration),
                stop.names(),
                fmt(stop.total()),
                fmt(MARGIN),
                fmt(Duration::from_millis(
                    needed.as_millis().div_ceil(1000) as u64 * 1000
                )),
            ));
        }
        Ok(())
    }
}

fn fmt(duration: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn keepalives_add_up_to_at_least_the_lease() {
        for millis in [1_500, 2_000, 2_500, 10_000, 15_000, 61_000, 3_600_000] {
            let lease = Lease::new(Duration::from_millis(millis));
            let total =
                lease.keepalive_idle() + lease.keepalive_interval() * lease.keepalive_count();
            assert!(total >= lease.duration(), "{millis} ms: {total:?}");
            assert!(lease.keepalive_idle() >= S(1) && lease.keepalive_interval() >= S(1));
        }
        let lease = Lease::new(S(10));
        assert_eq!(
            (
                lease.keepalive_idle(),
                lease.keepalive_interval(),
                lease.keepalive_count()
            ),
            (S(7), S(1), 3)
        );
    }

    fn stop(interval: u64, timeout: u64, kill: u64, hook: Option<u64>) -> StopTimings {
        StopTimings {
            check_interval: S(interval),
            check_timeout: S(timeout),
            kill_timeout: S(kill),
            hook_timeout: hook.map(S),
        }
    }

    #[test]
    fn refuses_a_lease_shorter_than_the_leaders_own_deadline() {
        let lease = Lease::new(S(10));
        assert!(lease.validate(&stop(1, 2, 5, None)).is_ok());
        assert!(lease.validate(&stop(1, 2, 6, None)).is_ok());
        let err = lease.validate(&stop(1, 2, 7, None)).expect_err("too short");
        assert!(err.contains("--lease 11s or more"), "{err}");
    }

    #[test]
    fn a_hook_counts_towards_the_lease() {
        let lease = Lease::new(S(10));
        assert!(lease.validate(&stop(1, 2, 5, Some(1))).is_ok());
        let err = lease
            .validate(&stop(1, 2, 5, Some(5)))
            .expect_err("too short");
        assert!(err.contains("--lease 14s or more"), "{err}");
        assert!(
            err.contains("--kill-timeout + --hook-timeout = 13s"),
            "{err}"
        );
        let err = lease
            .validate_ttl(&stop(1, 2, 5, Some(5)))
            .expect_err("too short");
        assert!(err.contains("--hook-timeout"), "{err}");
    }

    #[test]
    fn a_ttl_allows_for_a_server_clock_that_runs_fast() {
        let lease = Lease::new(S(10));
        assert!(lease.validate_ttl(&stop(1, 2, 5, None)).is_ok());
        // Exactly the deadline is enough for PostgreSQL, not for a TTL.
        assert!(lease.validate(&stop(1, 2, 6, None)).is_ok());
        let err = lease
            .validate_ttl(&stop(1, 2, 6, None))
            .expect_err("too short");
        assert!(err.contains("--lease 11s or more"), "{err}");
    }
}
