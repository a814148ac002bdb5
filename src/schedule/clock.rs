//! The database server's clock, as seen from here.
//!
//! Occurrences are instants on the server's clock (`clock_timestamp()`), so that a replica whose
//! own clock is off by a minute runs neither early, nor late, nor twice. Each round trip that
//! returns the server's time is a sample: the server read its clock somewhere between sending
//! and receiving, so the midpoint of the round trip, on this host's monotonic clock, is taken
//! to be that moment (wrong by at most half the round trip). Waiting for an occurrence is then
//! a sleep on the monotonic clock, which neither the host's wall clock nor its corrections
//! move. Every new sample replaces the mapping, so drift between the two clocks never
//! accumulates beyond one check interval; and the claim itself refuses to run early on the
//! server's own clock (see `election/ledger.rs`).

use std::time::{Duration, SystemTime};

use jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;

/// A mapping from this host's monotonic clock to the server's wall clock.
#[derive(Clone, Copy, Debug)]
pub struct ServerClock {
    server: Timestamp,
    local: Instant,
    /// The host's wall clock at `local`, to report its offset from the server's.
    wall: SystemTime,
    round_trip: Duration,
}

impl ServerClock {
    /// A sample: the query was sent at `sent`, its answer arrived at `received`, and the
    /// server's clock said `server`.
    pub fn sample(sent: Instant, received: Instant, server: Timestamp) -> ServerClock {
        let round_trip = received.saturating_duration_since(sent);
        let local = sent + round_trip / 2;
        let wall = SystemTime::now()
            .checked_sub(received.saturating_duration_since(local))
            .unwrap_or_else(SystemTime::now);
        ServerClock {
            server,
            local,
            wall,
            round_trip,
        }
    }

    /// The server's time now.
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// The server's time at a local instant.
    pub fn at(&self, instant: Instant) -> Timestamp {
        let delta = if instant >= self.local {
            SignedDuration::try_from(instant - self.local).unwrap_or(SignedDuration::MAX)
        } else {
            -SignedDuration::try_from(self.local - instant).unwrap_or(SignedDuration::MAX)
        };
        self.server
            .checked_add(delta)
            .unwrap_or(if delta.is_negative() {
                Timestamp::MIN
            } else {
                Timestamp::MAX
            })
    }

    /// The local instant at which the server's clock shows `at` (now, if that has passed).
    pub fn instant_of(&self, at: Timestamp) -> Instant {
        match Duration::try_from(at.duration_since(self.server)) {
            Ok(ahead) => self.local + ahead,
            Err(_) => {
                let behind =
                    Duration::try_from(self.server.duration_since(at)).unwrap_or(Duration::MAX);
                self.local.checked_sub(behind).unwrap_or(self.local)
            }
        }
    }

    /// How far this host's wall clock is ahead of the server's (negative: behind), in
    /// seconds, to within half a round trip.
    pub fn host_offset_seconds(&self) -> f64 {
        let host = Timestamp::try_from(self.wall).unwrap_or(self.server);
        host.duration_since(self.server).as_micros() as f64 / 1e6
    }

    /// How far this sample moves the local instant of a server time from where `other` put
    /// it: the two clocks' drift between the samples, or a step of either.
    pub fn moved_from(&self, other: &ServerClock) -> Duration {
        let then = other.instant_of(self.server);
        if then > self.local {
            then - self.local
        } else {
            self.local - then
        }
    }

    /// Whether this sample was taken after `other`.
    pub fn is_newer_than(&self, other: &ServerClock) -> bool {
        self.local > other.local
    }

    pub fn round_trip(&self) -> Duration {
        self.round_trip
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_server_instants_to_local_ones_through_the_round_trips_midpoint() {
        let sent = Instant::now();
        let received = sent + Duration::from_millis(10);
        let server = 1_800_000_000_000_000; // 2027-01-15T08:00:00Z
        let clock = ServerClock::sample(
            sent,
            received,
            Timestamp::from_microsecond(server).expect("time"),
        );
        let midpoint = sent + Duration::from_millis(5);
        assert_eq!(clock.at(midpoint).as_microsecond(), server);
        let later = Timestamp::from_microsecond(server + 2_000_000).expect("time");
        assert_eq!(clock.instant_of(later), midpoint + Duration::from_secs(2));
        let earlier = Timestamp::from_microsecond(server - 1_000).expect("time");
        assert_eq!(
            clock.instant_of(earlier),
            midpoint - Duration::from_millis(1)
        );
        assert_eq!(clock.round_trip(), Duration::from_millis(10));
    }
}
