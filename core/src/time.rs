//! Time as the core sees it: a point on the shell's monotonic clock, in nanoseconds.
//!
//! The core never reads a clock. Every input carries `now`; spans are
//! [`std::time::Duration`].

use std::time::Duration;

/// A point on the shell's monotonic clock, in nanoseconds from an arbitrary origin.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The origin of the clock.
    pub const ZERO: Instant = Instant(0);

    /// The instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The span from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;

    /// Saturates at the end of the clock instead of wrapping.
    fn add(self, span: Duration) -> Instant {
        Instant(self.0.saturating_add(nanos_saturating(span)))
    }
}

/// A span in whole nanoseconds, saturating at `u64::MAX` (584 years).
pub(crate) fn nanos_saturating(span: Duration) -> u64 {
    u64::try_from(span.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_saturates_instead_of_wrapping() {
        let late = Instant::from_nanos(u64::MAX - 1);
        assert_eq!(late + Duration::from_secs(1), Instant::from_nanos(u64::MAX));
        assert_eq!(
            Instant::ZERO + Duration::from_millis(1500),
            Instant::from_nanos(1_500_000_000)
        );
    }

    #[test]
    fn duration_since_a_later_instant_is_zero() {
        let a = Instant::from_nanos(10);
        let b = Instant::from_nanos(25);
        assert_eq!(b.saturating_duration_since(a), Duration::from_nanos(15));
        assert_eq!(a.saturating_duration_since(b), Duration::ZERO);
    }
}
