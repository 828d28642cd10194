//! Virtual time: nanoseconds since the start of a run.
//!
//! The simulator's clock is the monotonic clock the core sees. Wall-clock steps are a
//! separate offset that only logs read (see [`crate::config::Action::ClockStep`]).

use kvwarden_core::Instant;
use std::time::Duration;

/// Virtual nanoseconds since the start of the run.
pub type Nanos = u64;

/// One second of virtual time.
pub const SECOND: Nanos = 1_000_000_000;

/// One millisecond of virtual time.
pub const MILLISECOND: Nanos = 1_000_000;

/// Seconds (as written in scenario files) to virtual nanoseconds, rounded.
pub fn from_seconds(seconds: f64) -> Nanos {
    (seconds * SECOND as f64).round().max(0.0) as Nanos
}

/// Virtual nanoseconds as seconds, for reports.
pub fn as_seconds(nanos: Nanos) -> f64 {
    nanos as f64 / SECOND as f64
}

/// The core's view of a virtual instant.
pub fn instant(nanos: Nanos) -> Instant {
    Instant::from_nanos(nanos)
}

/// A span of virtual time as the core's duration type.
pub fn duration(nanos: Nanos) -> Duration {
    Duration::from_nanos(nanos)
}

/// A core duration as virtual nanoseconds (saturating).
pub fn nanos_of(span: Duration) -> Nanos {
    u64::try_from(span.as_nanos()).unwrap_or(u64::MAX)
}
