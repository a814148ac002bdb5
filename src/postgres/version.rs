//! Which PostgreSQL servers pgleader leads through, and what it says about the ones with a gap.
//!
//! PostgreSQL 13 is the oldest supported server: it is the oldest the test suite runs against
//! (13 to 18, see `scripts/pg-matrix`), and 12 has been out of upstream support since November
//! 2024. An older server is refused at connection time rather than half-supported.
//!
//! PostgreSQL 13 works, with one gap worth a warning: it has no `idle_session_timeout`, which
//! is what frees the lock of a leader the server can no longer hear from when a TCP middlebox
//! (a proxy, a session-mode pooler, a cloud load balancer) keeps the connection alive on the
//! leader's behalf. Over a direct connection the TCP keepalives and `tcp_user_timeout` that
//! pgleader sets still bound the lease; behind a middlebox nothing does, and the followers wait
//! until the middlebox closes the connection. The leader itself still stops its command on
//! time: only the takeover is delayed, never made unsafe.

/// The oldest major version pgleader accepts.
pub const OLDEST_SUPPORTED: u32 = 13;

/// The first major version with `idle_session_timeout`.
const IDLE_SESSION_TIMEOUT: u32 = 14;

/// What pgleader makes of a server's major version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Everything pgleader relies on is there (or the version is unknown: 0).
    Full,
    /// Supported, but the server cannot free a silently partitioned leader's lock behind a
    /// middlebox: warn once.
    NoIdleSessionTimeout,
    /// Older than [`OLDEST_SUPPORTED`]: refuse.
    TooOld,
}

impl Support {
    pub fn of(major: u32) -> Support {
        match major {
            0 => Support::Full,
            major if major < OLDEST_SUPPORTED => Support::TooOld,
            major if major < IDLE_SESSION_TIMEOUT => Support::NoIdleSessionTimeout,
            _ => Support::Full,
        }
    }
}

/// The error for a server that is too old.
pub fn too_old(major: u32) -> String {
    format!(
        "the server runs PostgreSQL {major}; pgleader needs PostgreSQL {OLDEST_SUPPORTED} or later"
    )
}

/// The warning for a PostgreSQL 13 server, logged once per process.
pub fn no_idle_session_timeout_warning(major: u32) -> String {
    format!(
        "PostgreSQL {major} has no idle_session_timeout: if this connection goes through a proxy, \
         a pooler or a load balancer, the server cannot tell when a leader is cut off behind it, \
         and other replicas take over only once that middlebox closes the connection (a direct \
         connection is covered by TCP keepalives); connect directly, or use PostgreSQL \
         {IDLE_SESSION_TIMEOUT} or later"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_servers_older_than_13_and_warns_about_13() {
        assert_eq!(Support::of(9), Support::TooOld);
        assert_eq!(Support::of(12), Support::TooOld);
        assert_eq!(Support::of(13), Support::NoIdleSessionTimeout);
        for major in [14, 15, 16, 17, 18, 19] {
            assert_eq!(Support::of(major), Support::Full, "{major}");
        }
        // A server that did not say its version is given the benefit of the doubt.
        assert_eq!(Support::of(0), Support::Full);
        assert_eq!(
            too_old(12),
            "the server runs PostgreSQL 12; pgleader needs PostgreSQL 13 or later"
        );
    }
}
