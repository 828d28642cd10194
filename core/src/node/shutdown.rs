//! The shutdown sequence: drain the work in flight (at most `shutdown_drain`), then free
//! every entry, then wait for the frees (at most the free watchdog), then stop.
//!
//! It owns its phase, its timers and the count of contexts freed while it ran; the node
//! tells it what it cannot know (whether the work in flight has drained, how many frees
//! are unfinished) and carries out what [`Shutdown::step`] decides.

use crate::time::Instant;
use std::time::Duration;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Phase {
    Draining { since: Instant },
    Freeing { since: Instant },
    Stopped,
}

/// What the node does next for a shutdown.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Nothing now (no shutdown, or it waits).
    Wait,
    /// Drained (or out of time): unregister every entry, then step again.
    FreeEverything,
    /// Done: tell the shell.
    Stop {
        contexts_freed: u64,
        frees_unfinished: usize,
    },
}

/// The shutdown sequence (see the module docs).
pub(super) struct Shutdown {
    phase: Option<Phase>,
    freed: u64,
    drain: Duration,
    watchdog: Duration,
}

impl Shutdown {
    /// Not begun; it will drain for at most `drain` and wait for frees at most
    /// `watchdog`.
    pub(super) fn new(drain: Duration, watchdog: Duration) -> Shutdown {
        Shutdown {
            phase: None,
            freed: 0,
            drain,
            watchdog,
        }
    }

    /// Whether it has begun and not stopped: only then has [`Shutdown::step`] anything
    /// to decide.
    pub(super) fn under_way(&self) -> bool {
        matches!(
            self.phase,
            Some(Phase::Draining { .. } | Phase::Freeing { .. })
        )
    }

    /// Begins it at `now`; false if it had begun already.
    pub(super) fn begin(&mut self, now: Instant) -> bool {
        if self.phase.is_some() {
            return false;
        }
        self.phase = Some(Phase::Draining { since: now });
        true
    }

    /// Whether it has begun.
    pub(super) fn begun(&self) -> bool {
        self.phase.is_some()
    }

    /// Whether it is complete.
    pub(super) fn stopped(&self) -> bool {
        self.phase == Some(Phase::Stopped)
    }

    /// Whether copies may still start: before the shutdown, and while it drains. Once
    /// the drain is over, a copy not yet handed to the pool never runs.
    pub(super) fn runs_copies(&self) -> bool {
        matches!(self.phase, None | Some(Phase::Draining { .. }))
    }

    /// A context's free started: counted if it began during the shutdown.
    pub(super) fn count_free(&mut self) {
        if self.begun() {
            self.freed += 1;
        }
    }

    /// When its current phase runs out of time.
    pub(super) fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Some(Phase::Draining { since }) => Some(since + self.drain),
            Some(Phase::Freeing { since }) => Some(since + self.watchdog),
            Some(Phase::Stopped) | None => None,
        }
    }

    /// The server did not run for `gap` before `now`: the phase's timer does not count
    /// it (the work it waits for did not run either).
    pub(super) fn credit_stall(&mut self, now: Instant, gap: Duration) {
        let before_gap = |since: Instant| now.saturating_duration_since(since) >= gap;
        self.phase = match self.phase {
            Some(Phase::Draining { since }) if before_gap(since) => {
                Some(Phase::Draining { since: since + gap })
            }
            Some(Phase::Freeing { since }) if before_gap(since) => {
                Some(Phase::Freeing { since: since + gap })
            }
            other => other,
        };
    }

    /// The next step at `now`, given whether the work in flight has `drained` and how
    /// many frees are `unfinished`.
    pub(super) fn step(&mut self, now: Instant, drained: bool, unfinished: usize) -> Step {
        match self.phase {
            None | Some(Phase::Stopped) => Step::Wait,
            Some(Phase::Draining { since }) => {
                if !drained && now.saturating_duration_since(since) < self.drain {
                    return Step::Wait;
                }
                self.phase = Some(Phase::Freeing { since: now });
                Step::FreeEverything
            }
            Some(Phase::Freeing { since }) => {
                if unfinished > 0 && now.saturating_duration_since(since) < self.watchdog {
                    return Step::Wait;
                }
                self.phase = Some(Phase::Stopped);
                Step::Stop {
                    contexts_freed: self.freed,
                    frees_unfinished: unfinished,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: u64) -> Instant {
        Instant::from_nanos(seconds * 1_000_000_000)
    }

    #[test]
    fn it_drains_then_frees_then_stops_and_waits_no_longer_than_its_timers() {
        let mut shutdown = Shutdown::new(Duration::from_secs(10), Duration::from_secs(5));
        // Control: not begun, nothing to do and no deadline.
        assert_eq!(shutdown.step(at(0), true, 0), Step::Wait);
        assert_eq!(shutdown.deadline(), None);
        assert!(!shutdown.under_way(), "nothing for the node to count");
        assert!(shutdown.begin(at(1)));
        assert!(shutdown.under_way());
        assert!(!shutdown.begin(at(2)), "begun once");
        assert_eq!(shutdown.deadline(), Some(at(11)));
        assert_eq!(shutdown.step(at(5), false, 0), Step::Wait, "not drained");
        assert!(shutdown.runs_copies(), "copies run while it drains");
        assert_eq!(shutdown.step(at(11), false, 0), Step::FreeEverything);
        assert!(!shutdown.runs_copies(), "and not after");
        shutdown.count_free();
        assert_eq!(shutdown.step(at(12), true, 1), Step::Wait, "a free runs");
        assert_eq!(
            shutdown.step(at(16), true, 1),
            Step::Stop {
                contexts_freed: 1,
                frees_unfinished: 1
            }
        );
        assert!(shutdown.stopped());
        assert!(!shutdown.under_way(), "stopped");
        assert_eq!(shutdown.deadline(), None);
    }

    #[test]
    fn a_stall_does_not_count_against_the_drain() {
        let mut shutdown = Shutdown::new(Duration::from_secs(10), Duration::from_secs(5));
        shutdown.begin(at(0));
        shutdown.credit_stall(at(30), Duration::from_secs(25));
        assert_eq!(shutdown.deadline(), Some(at(35)));
        assert_eq!(shutdown.step(at(30), false, 0), Step::Wait);
        // A free started before the shutdown is not counted as its own.
        let mut early = Shutdown::new(Duration::from_secs(10), Duration::from_secs(5));
        early.count_free();
        early.begin(at(0));
        assert_eq!(early.step(at(0), true, 0), Step::FreeEverything);
        assert!(matches!(
            early.step(at(0), true, 0),
            Step::Stop {
                contexts_freed: 0,
                ..
            }
        ));
    }
}
