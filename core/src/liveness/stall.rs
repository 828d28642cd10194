//! The self-stall guard: a server that was paused must not blame its workers.
//!
//! The shell wakes the core at least every `stall_threshold / 2`, so a gap between two
//! inputs longer than `stall_threshold` means the server itself did not run (SIGSTOP,
//! VM pause, a starved loop). The whole gap is credited: entries keep their silence on
//! a *stall-corrected* clock, `shell time - credited`, on which the gap never happened.
//! Time going backwards is ignored: the latest instant seen stands.

use crate::time::{Instant, nanos_saturating};
use std::time::Duration;

#[derive(Debug)]
pub(crate) struct StallClock {
    threshold_nanos: u64,
    /// The latest shell instant seen, in nanoseconds.
    last_input: u64,
    /// Stall gaps credited so far; never more than `last_input`.
    credited: u64,
    stalls_total: u64,
}

impl StallClock {
    pub(crate) fn new(now: Instant, threshold: Duration) -> StallClock {
        StallClock {
            threshold_nanos: nanos_saturating(threshold),
            last_input: now.as_nanos(),
            credited: 0,
            stalls_total: 0,
        }
    }

    /// Takes in `now`; returns it on the stall-corrected clock, with the gap when the
    /// input ends a stall.
    pub(crate) fn observe(&mut self, now: Instant) -> (u64, Option<Duration>) {
        let now = now.as_nanos().max(self.last_input);
        let gap = now - self.last_input;
        let stall = if gap > self.threshold_nanos {
            self.credited += gap;
            self.stalls_total += 1;
            Some(Duration::from_nanos(gap))
        } else {
            None
        };
        self.last_input = now;
        (now - self.credited, stall)
    }

    /// A stall-corrected instant as an instant of the shell's clock, with the stalls
    /// credited so far.
    pub(crate) fn to_shell(&self, corrected: u64) -> Instant {
        Instant::from_nanos(corrected.saturating_add(self.credited))
    }

    /// The latest the shell may wait for its next input without it counting as a stall.
    pub(crate) fn next_watch(&self) -> Instant {
        let half = (self.threshold_nanos / 2).max(1);
        Instant::from_nanos(self.last_input.saturating_add(half))
    }

    /// The latest shell instant seen.
    pub(crate) fn last_input(&self) -> Instant {
        Instant::from_nanos(self.last_input)
    }

    pub(crate) fn stalls_total(&self) -> u64 {
        self.stalls_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_gap_above_the_threshold_is_credited_whole() {
        let mut clock = StallClock::new(Instant::ZERO, Duration::from_secs(5));
        assert_eq!(clock.observe(Instant::from_nanos(5 * SEC)), (5 * SEC, None));
        let (corrected, stall) = clock.observe(Instant::from_nanos(105 * SEC));
        assert_eq!(stall, Some(Duration::from_secs(100)));
        assert_eq!(corrected, 5 * SEC);
        assert_eq!(clock.to_shell(corrected), Instant::from_nanos(105 * SEC));
        assert_eq!(clock.stalls_total(), 1);
    }

    #[test]
    fn time_going_backwards_is_held_at_the_latest_instant() {
        let mut clock = StallClock::new(Instant::from_nanos(10 * SEC), Duration::from_secs(5));
        assert_eq!(
            clock.observe(Instant::from_nanos(3 * SEC)),
            (10 * SEC, None)
        );
        assert_eq!(clock.next_watch(), Instant::from_nanos(12_500_000_000));
    }
}
