//! Durations and instants as pgleader prints them, in one place: every log line, message,
//! JSON field, ledger reader and the command's PGLEADER_SCHEDULED_TIME use these.
//!
//! Instants are `jiff::Timestamp`s (the one date-time crate: it also carries the time-zone
//! database for schedules and the driver's `timestamptz`), printed in RFC 3339 in UTC.

use std::time::Duration;

use jiff::Timestamp;

/// A duration as logs show it: to the millisecond (`1s 500ms`, `2m`).
pub fn for_people(duration: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(duration.as_millis() as u64))
}

/// An occurrence as the command and the ledger's readers see it: whole seconds when it has no
/// fraction, else the shortest of milli-, micro- or nanoseconds that is exact
/// (`2026-11-23T03:00:00Z`, `2026-11-23T03:00:00.250Z`).
pub fn rfc3339(at: Timestamp) -> String {
    let nanos = at.subsec_nanosecond().unsigned_abs();
    let fraction = if nanos == 0 {
        String::new()
    } else if nanos.is_multiple_of(1_000_000) {
        format!(".{:03}", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!(".{:06}", nanos / 1_000)
    } else {
        format!(".{nanos:09}")
    };
    format!("{}{fraction}Z", at.strftime("%Y-%m-%dT%H:%M:%S"))
}

/// An instant to the millisecond, as logs, `/status` and `status --watch` show it
/// (`2026-11-23T03:00:00.000Z`).
pub fn rfc3339_millis(at: Timestamp) -> String {
    at.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// An instant to the second (`2026-11-23T03:00:00Z`), for certificates' validity, which may
/// name 9999-12-31T23:59:59Z ("no expiry"), past jiff's last instant.
pub fn rfc3339_seconds(at: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// The time from `earlier` to `later`, zero if `later` is not later.
pub fn elapsed(earlier: Timestamp, later: Timestamp) -> Duration {
    Duration::try_from(later.duration_since(earlier)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64, nanosecond: i32) -> Timestamp {
        Timestamp::new(second, nanosecond).expect("a timestamp")
    }

    #[test]
    fn occurrences_print_with_the_shortest_exact_fraction() {
        // 2026-11-23T03:00:00Z
        let second = 1_795_402_800;
        assert_eq!(rfc3339(at(second, 0)), "2026-11-23T03:00:00Z");
        assert_eq!(rfc3339(at(second, 250_000_000)), "2026-11-23T03:00:00.250Z");
        assert_eq!(
            rfc3339(at(second, 250_500_000)),
            "2026-11-23T03:00:00.250500Z"
        );
        assert_eq!(rfc3339(at(second, 1)), "2026-11-23T03:00:00.000000001Z");
    }

    #[test]
    fn logs_print_milliseconds_and_certificates_seconds() {
        let second = 1_795_402_800;
        assert_eq!(rfc3339_millis(at(second, 0)), "2026-11-23T03:00:00.000Z");
        assert_eq!(
            rfc3339_millis(at(second, 2_999_999)),
            "2026-11-23T03:00:00.002Z"
        );
        let certificate = std::time::UNIX_EPOCH + Duration::from_secs(253_402_300_799);
        assert_eq!(rfc3339_seconds(certificate), "9999-12-31T23:59:59Z");
        assert_eq!(
            elapsed(at(second, 0), at(second + 2, 0)),
            Duration::from_secs(2)
        );
        assert_eq!(elapsed(at(second + 2, 0), at(second, 0)), Duration::ZERO);
    }
}
