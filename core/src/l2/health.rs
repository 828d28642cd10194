//! Whether L2 is worth asking: the up / degraded / down state and its circuit breaker.
//!
//! Every L2 operation's result is recorded with the time it arrived. A run of
//! [`L2HealthConfig::failures_to_open`] failures or timeouts in a row opens the breaker:
//! L2 is `Down`, nothing is asked (reads are misses at once, writes are dropped) except
//! one probe after a back-off that doubles on each failed probe up to a cap. Any success
//! closes it (`Up`). Each change of state is returned once, so the shell can log once
//! when L2 goes down and once when it comes back. Time going backwards is ignored.

use crate::Instant;
use std::time::Duration;
use thiserror::Error;

/// The L2 state shown in `/status`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum L2State {
    /// The last operation succeeded.
    Up,
    /// Recent operations failed or timed out, fewer than the breaker's threshold in a
    /// row; L2 is still asked.
    Degraded,
    /// The breaker is open: L2 is not asked, except by one probe after a back-off.
    Down,
}

impl L2State {
    /// The name used in `/status` and `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            L2State::Up => "up",
            L2State::Degraded => "degraded",
            L2State::Down => "down",
        }
    }
}

/// How one L2 operation ended, as the breaker sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum OpResult {
    /// Redis answered (a hit, an absent key and a corrupt value all count: the store works).
    Succeeded,
    /// Redis answered with an error, or the connection failed.
    Failed,
    /// No answer within the L2 timeout.
    TimedOut,
}

/// What the caller may do now.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[must_use]
pub enum Gate {
    /// Ask L2 as usual.
    Ask,
    /// Ask L2 with this one operation, the probe; its result decides whether L2 is back.
    Probe,
    /// Do not ask: answer a miss, drop the write.
    Skip,
}

/// A change of state, returned once by the call that caused it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Transition {
    /// The state before.
    pub from: L2State,
    /// The state now.
    pub to: L2State,
}

/// The breaker's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2HealthConfig {
    /// Failures or timeouts in a row that open the breaker (≥ 1).
    pub failures_to_open: u32,
    /// The wait before the first probe after the breaker opened (> 0).
    pub probe_backoff: Duration,
    /// The cap on the doubling wait between probes (≥ `probe_backoff`).
    pub probe_backoff_max: Duration,
}

impl Default for L2HealthConfig {
    fn default() -> L2HealthConfig {
        L2HealthConfig {
            failures_to_open: 5,
            probe_backoff: Duration::from_secs(1),
            probe_backoff_max: Duration::from_secs(30),
        }
    }
}

/// A breaker configuration that was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum L2HealthConfigError {
    /// Zero failures would open the breaker before the first operation.
    #[error("invalid L2 breaker threshold 0: use at least 1 failure in a row (default 5)")]
    FailuresToOpen,
    /// A zero back-off would probe on every turn.
    #[error("invalid L2 probe back-off 0 s: use more than 0 (default 1 s)")]
    ProbeBackoff,
    /// The cap is below the first back-off.
    #[error(
        "invalid L2 probe back-off cap {max:?}: it must be at least the first back-off {first:?}"
    )]
    ProbeBackoffMax {
        /// The first back-off.
        first: Duration,
        /// The cap given.
        max: Duration,
    },
}

impl L2HealthConfig {
    /// Checks the limits.
    pub fn validate(&self) -> Result<(), L2HealthConfigError> {
        if self.failures_to_open == 0 {
            return Err(L2HealthConfigError::FailuresToOpen);
        }
        if self.probe_backoff.is_zero() {
            return Err(L2HealthConfigError::ProbeBackoff);
        }
        if self.probe_backoff_max < self.probe_backoff {
            return Err(L2HealthConfigError::ProbeBackoffMax {
                first: self.probe_backoff,
                max: self.probe_backoff_max,
            });
        }
        Ok(())
    }
}

/// The L2 health state machine.
#[derive(Clone, Debug)]
pub struct L2Health {
    config: L2HealthConfig,
    state: L2State,
    failures_in_a_row: u32,
    /// The wait after the latest failed probe (or the opening failure).
    backoff: Duration,
    /// While down: when the next probe may go out.
    probe_at: Option<Instant>,
    /// While down: when the probe in flight went out, if one is.
    probe_sent_at: Option<Instant>,
    latest: Instant,
}

impl L2Health {
    /// A breaker that starts `Up`.
    pub fn new(config: L2HealthConfig) -> Result<L2Health, L2HealthConfigError> {
        config.validate()?;
        Ok(L2Health {
            backoff: config.probe_backoff,
            config,
            state: L2State::Up,
            failures_in_a_row: 0,
            probe_at: None,
            probe_sent_at: None,
            latest: Instant::ZERO,
        })
    }

    /// The state now; changes only in [`L2Health::record`].
    pub fn state(&self) -> L2State {
        self.state
    }

    /// Failures and timeouts in a row since the last success.
    pub fn failures_in_a_row(&self) -> u32 {
        self.failures_in_a_row
    }

    /// Whether to ask L2 at `now`. While down, exactly one `Probe` is handed out when the
    /// back-off has passed; another only once its result is recorded, or when it has
    /// been out for a whole back-off with no result (a lost result must not keep L2
    /// down for ever).
    pub fn admit(&mut self, now: Instant) -> Gate {
        let now = self.observe(now);
        if self.state != L2State::Down {
            return Gate::Ask;
        }
        if let Some(sent_at) = self.probe_sent_at
            && now < sent_at + self.backoff
        {
            return Gate::Skip;
        }
        match self.probe_at {
            Some(probe_at) if now >= probe_at => {
                self.probe_sent_at = Some(now);
                Gate::Probe
            }
            _ => Gate::Skip,
        }
    }

    /// Records the result of an operation that ended at `now`; returns the change of
    /// state it caused, if any.
    pub fn record(&mut self, now: Instant, result: OpResult) -> Option<Transition> {
        let now = self.observe(now);
        let from = self.state;
        match result {
            OpResult::Succeeded => {
                self.failures_in_a_row = 0;
                self.backoff = self.config.probe_backoff;
                self.probe_at = None;
                self.probe_sent_at = None;
                self.state = L2State::Up;
            }
            OpResult::Failed | OpResult::TimedOut => {
                self.failures_in_a_row = self.failures_in_a_row.saturating_add(1);
                match self.state {
                    L2State::Down => {
                        // Only the probe's failure pushes the next probe out; results of
                        // operations sent before the breaker opened change nothing.
                        if self.probe_sent_at.take().is_some() {
                            self.backoff = (self.backoff * 2).min(self.config.probe_backoff_max);
                            self.probe_at = Some(now + self.backoff);
                        }
                    }
                    L2State::Up | L2State::Degraded => {
                        if self.failures_in_a_row >= self.config.failures_to_open {
                            self.state = L2State::Down;
                            self.backoff = self.config.probe_backoff;
                            self.probe_at = Some(now + self.backoff);
                            self.probe_sent_at = None;
                        } else {
                            self.state = L2State::Degraded;
                        }
                    }
                }
            }
        }
        (from != self.state).then_some(Transition {
            from,
            to: self.state,
        })
    }

    /// When the caller should next call [`L2Health::admit`] to send a probe: while down
    /// with no probe out, the end of the back-off; otherwise none. May change after
    /// `admit` and `record`.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.state, self.probe_sent_at) {
            (L2State::Down, None) => self.probe_at,
            (L2State::Down, Some(sent_at)) => Some(sent_at + self.backoff),
            _ => None,
        }
    }

    /// `now`, or the latest time seen when `now` is earlier: time never moves back.
    fn observe(&mut self, now: Instant) -> Instant {
        self.latest = self.latest.max(now);
        self.latest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    fn breaker(failures_to_open: u32) -> L2Health {
        L2Health::new(L2HealthConfig {
            failures_to_open,
            probe_backoff: Duration::from_millis(100),
            probe_backoff_max: Duration::from_millis(400),
        })
        .unwrap()
    }

    fn down(to: L2State) -> Option<Transition> {
        Some(Transition {
            from: L2State::Degraded,
            to,
        })
    }

    #[test]
    fn starts_up_and_asks() {
        let mut health = breaker(3);
        assert_eq!(health.state(), L2State::Up);
        assert_eq!(health.admit(at_ms(0)), Gate::Ask);
        assert_eq!(health.poll_timeout(), None);
    }

    #[test]
    fn failures_below_the_threshold_degrade_but_keep_asking() {
        let mut health = breaker(3);
        assert_eq!(
            health.record(at_ms(1), OpResult::Failed),
            Some(Transition {
                from: L2State::Up,
                to: L2State::Degraded
            })
        );
        assert_eq!(health.record(at_ms(2), OpResult::TimedOut), None);
        assert_eq!(health.state(), L2State::Degraded);
        assert_eq!(health.admit(at_ms(3)), Gate::Ask);
    }

    #[test]
    fn success_between_failures_resets_the_count_and_the_breaker_stays_closed() {
        let mut health = breaker(3);
        for round in 0..10 {
            health.record(at_ms(round * 10), OpResult::Failed);
            health.record(at_ms(round * 10 + 1), OpResult::Failed);
            assert_eq!(
                health.record(at_ms(round * 10 + 2), OpResult::Succeeded),
                Some(Transition {
                    from: L2State::Degraded,
                    to: L2State::Up
                })
            );
        }
        assert_eq!(health.state(), L2State::Up);
    }

    #[test]
    fn threshold_failures_in_a_row_open_the_breaker_once() {
        let mut health = breaker(3);
        health.record(at_ms(1), OpResult::Failed);
        health.record(at_ms(2), OpResult::TimedOut);
        assert_eq!(
            health.record(at_ms(3), OpResult::Failed),
            down(L2State::Down)
        );
        // Late failures of operations sent earlier report nothing more.
        assert_eq!(health.record(at_ms(4), OpResult::Failed), None);
        assert_eq!(health.state(), L2State::Down);
        assert_eq!(health.admit(at_ms(4)), Gate::Skip);
    }

    #[test]
    fn open_breaker_probes_once_after_the_backoff_and_closes_on_success() {
        let mut health = breaker(1);
        assert_eq!(
            health.record(at_ms(0), OpResult::TimedOut),
            Some(Transition {
                from: L2State::Up,
                to: L2State::Down
            })
        );
        assert_eq!(health.poll_timeout(), Some(at_ms(100)));
        assert_eq!(health.admit(at_ms(99)), Gate::Skip);
        assert_eq!(health.admit(at_ms(100)), Gate::Probe);
        assert_eq!(health.admit(at_ms(101)), Gate::Skip, "one probe at a time");
        assert_eq!(
            health.record(at_ms(120), OpResult::Succeeded),
            Some(Transition {
                from: L2State::Down,
                to: L2State::Up
            })
        );
        assert_eq!(health.admit(at_ms(121)), Gate::Ask);
        assert_eq!(health.poll_timeout(), None);
    }

    #[test]
    fn failed_probes_double_the_backoff_up_to_the_cap() {
        let mut health = breaker(1);
        health.record(at_ms(0), OpResult::Failed);
        let mut now = 0;
        for expected_wait in [200, 400, 400] {
            now = health.poll_timeout().unwrap().as_nanos() / 1_000_000;
            assert_eq!(health.admit(at_ms(now)), Gate::Probe);
            assert_eq!(health.record(at_ms(now), OpResult::TimedOut), None);
            assert_eq!(health.state(), L2State::Down);
            assert_eq!(health.poll_timeout(), Some(at_ms(now + expected_wait)));
            assert_eq!(health.admit(at_ms(now + expected_wait - 1)), Gate::Skip);
        }
        // Closing resets the back-off: the next opening waits the first back-off again.
        now += 400;
        assert_eq!(health.admit(at_ms(now)), Gate::Probe);
        health.record(at_ms(now), OpResult::Succeeded);
        health.record(at_ms(now + 1), OpResult::Failed);
        assert_eq!(health.poll_timeout(), Some(at_ms(now + 101)));
    }

    #[test]
    fn lost_probe_result_does_not_keep_l2_down_for_ever() {
        let mut health = breaker(1);
        health.record(at_ms(0), OpResult::Failed);
        assert_eq!(health.admit(at_ms(100)), Gate::Probe);
        assert_eq!(health.poll_timeout(), Some(at_ms(200)));
        assert_eq!(health.admit(at_ms(150)), Gate::Skip);
        assert_eq!(health.admit(at_ms(200)), Gate::Probe);
    }

    #[test]
    fn time_going_backwards_never_moves_the_probe_earlier() {
        let mut health = breaker(1);
        health.record(at_ms(1000), OpResult::Failed);
        assert_eq!(health.admit(at_ms(0)), Gate::Skip);
        assert_eq!(health.admit(at_ms(1099)), Gate::Skip);
        assert_eq!(health.admit(at_ms(1100)), Gate::Probe);
    }

    #[test]
    fn zero_threshold_or_backoff_and_a_low_cap_are_refused() {
        let mut config = L2HealthConfig::default();
        assert!(config.validate().is_ok());
        config.failures_to_open = 0;
        assert_eq!(
            L2Health::new(config.clone()).unwrap_err(),
            L2HealthConfigError::FailuresToOpen
        );
        config.failures_to_open = 1;
        config.probe_backoff = Duration::ZERO;
        assert_eq!(config.validate(), Err(L2HealthConfigError::ProbeBackoff));
        config.probe_backoff = Duration::from_secs(2);
        config.probe_backoff_max = Duration::from_secs(1);
        let message = config.validate().unwrap_err().to_string();
        assert!(
            message.contains("1s") && message.contains("2s"),
            "{message}"
        );
    }

    #[test]
    fn state_names_are_the_status_words() {
        assert_eq!(L2State::Up.as_str(), "up");
        assert_eq!(L2State::Degraded.as_str(), "degraded");
        assert_eq!(L2State::Down.as_str(), "down");
    }
}
