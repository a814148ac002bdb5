//! Durations and instants as pgleader prints them.

use std::time::Duration;

/// A duration as logs show it: to the millisecond (`1s 500ms`, `2m`).
pub fn for_people(duration: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(duration.as_millis() as u64))
}
