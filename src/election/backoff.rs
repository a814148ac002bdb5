//! Capped exponential backoff with jitter, for reconnecting.
//!
//! After a database restart every replica reconnects at once; jitter spreads them out, and the
//! cap bounds how long after the server is back a new leader appears.

use std::time::Duration;

/// The first non-zero delay.
pub const BASE: Duration = Duration::from_millis(100);
/// The longest delay between two attempts.
pub const CAP: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    /// The pause before the next attempt: none right after a reset, then about 100 ms, 200 ms,
    /// 400 ms ... up to 2 s, each drawn between half and all of its nominal value.
    pub fn next_delay(&mut self) -> Duration {
        let failures = self.failures;
        self.failures = self.failures.saturating_add(1);
        if failures == 0 {
            return Duration::ZERO;
        }
        let nominal = BASE.saturating_mul(1u32 << (failures - 1).min(16)).min(CAP);
        let half = nominal / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// Starts over: the next attempt happens at once.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_starts_over_after_a_reset() {
        let mut backoff = Backoff::default();
        assert_eq!(backoff.next_delay(), Duration::ZERO);
        let first = backoff.next_delay();
        assert!(first >= BASE / 2 && first <= BASE, "{first:?}");
        for _ in 0..20 {
            let delay = backoff.next_delay();
            assert!(delay <= CAP, "{delay:?}");
        }
        assert!(backoff.next_delay() >= CAP / 2);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::ZERO);
    }
}
