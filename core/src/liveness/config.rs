//! The server's liveness configuration and the checks that keep it sane.
//!
//! Every rejected value is reported with the value seen and what would be right, in
//! words an operator can act on.

use std::time::Duration;
use thiserror::Error;

/// The smallest non-zero reap timeout: 3 × the workers' default heartbeat interval.
pub const REAP_TIMEOUT_FLOOR: Duration = Duration::from_secs(30);

/// The workers' default heartbeat interval, quoted in advice.
const DEFAULT_HEARTBEAT_SECONDS: u64 = 10;

/// The liveness configuration of a server.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Silence budget of a worker that has pinged at least once. ZERO disables reaping.
    pub reap_timeout: Duration,
    /// Silence budget of a worker that registered but never pinged (warm-up).
    pub registration_grace: Duration,
    /// The latest a reap may happen after its deadline. Must be > 0 and <= reap_timeout / 8.
    pub resolution: Duration,
    /// A gap between two inputs longer than this means the server itself was stalled.
    pub stall_threshold: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            reap_timeout: Duration::from_secs(120),
            registration_grace: Duration::from_secs(3600),
            resolution: Duration::from_secs(1),
            stall_threshold: Duration::from_secs(5),
        }
    }
}

/// A configuration value that was rejected, with the value seen and the fix.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ConfigError {
    /// The reap timeout is not finite, negative, or non-zero and below the floor.
    #[error(
        "invalid reap timeout {seconds:?} s: use 0 to disable reaping, or at least \
         {floor:?} s; keep the reap timeout at least 3 × the workers' heartbeat interval \
         (default {DEFAULT_HEARTBEAT_SECONDS} s) so that one late ping never reaps a live worker",
        floor = floor_seconds.unwrap_or(0.0)
    )]
    ReapTimeout {
        /// The value given, in seconds.
        seconds: f64,
        /// The floor in force, in seconds (None: only finiteness and sign were checked).
        floor_seconds: Option<f64>,
    },
    /// The registration grace is not finite or smaller than the reap timeout.
    #[error(
        "invalid registration grace {grace_seconds:?} s with reap timeout \
         {reap_timeout_seconds:?} s: the registration grace must be a finite number of \
         seconds no smaller than the reap timeout, or a worker still warming up would be \
         reaped sooner than a crashed one"
    )]
    RegistrationGrace {
        /// The grace given, in seconds.
        grace_seconds: f64,
        /// The reap timeout it was compared with, in seconds.
        reap_timeout_seconds: f64,
    },
    /// The resolution is zero or coarser than an eighth of the reap timeout.
    #[error(
        "invalid resolution {resolution_seconds:?} s with reap timeout \
         {reap_timeout_seconds:?} s: the resolution must be above 0 and at most \
         reap timeout / 8 ({max_seconds:?} s)",
        max_seconds = reap_timeout_seconds / 8.0
    )]
    Resolution {
        /// The resolution given, in seconds.
        resolution_seconds: f64,
        /// The reap timeout it was compared with, in seconds.
        reap_timeout_seconds: f64,
    },
    /// The stall threshold is zero.
    #[error(
        "invalid stall threshold {stall_threshold_seconds:?} s: it must be above 0 \
         (default 5 s)"
    )]
    StallThreshold {
        /// The threshold given, in seconds.
        stall_threshold_seconds: f64,
    },
}

impl Config {
    /// The operator-facing constructor: seconds as given on a command line, with the
    /// default resolution and stall threshold, checked by [`Config::validate`].
    pub fn from_secs(
        reap_timeout_secs: f64,
        registration_grace_secs: f64,
    ) -> Result<Config, ConfigError> {
        let reap_timeout_error = || ConfigError::ReapTimeout {
            seconds: reap_timeout_secs,
            floor_seconds: Some(REAP_TIMEOUT_FLOOR.as_secs_f64()),
        };
        let reap_timeout =
            Duration::try_from_secs_f64(reap_timeout_secs).map_err(|_| reap_timeout_error())?;
        // The reap timeout is judged first, whatever the grace is.
        if !reap_timeout.is_zero() && reap_timeout < REAP_TIMEOUT_FLOOR {
            return Err(reap_timeout_error());
        }
        let registration_grace =
            Duration::try_from_secs_f64(registration_grace_secs).map_err(|_| {
                ConfigError::RegistrationGrace {
                    grace_seconds: registration_grace_secs,
                    reap_timeout_seconds: reap_timeout_secs,
                }
            })?;
        let config = Config {
            reap_timeout,
            registration_grace,
            ..Config::default()
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every rule, with the 30 s floor on the reap timeout.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with_floor(REAP_TIMEOUT_FLOOR)
    }

    /// Checks every rule with another floor on a non-zero reap timeout. Only tests and
    /// demos lower it (`kvwarden serve --allow-short-timeouts`); production uses
    /// [`Config::validate`].
    pub fn validate_with_floor(&self, reap_timeout_floor: Duration) -> Result<(), ConfigError> {
        let reap_timeout_seconds = self.reap_timeout.as_secs_f64();
        if self.reaping_enabled() && self.reap_timeout < reap_timeout_floor {
            return Err(ConfigError::ReapTimeout {
                seconds: reap_timeout_seconds,
                floor_seconds: Some(reap_timeout_floor.as_secs_f64()),
            });
        }
        if self.registration_grace < self.reap_timeout {
            return Err(ConfigError::RegistrationGrace {
                grace_seconds: self.registration_grace.as_secs_f64(),
                reap_timeout_seconds,
            });
        }
        let too_coarse = self.reaping_enabled() && self.resolution > self.reap_timeout / 8;
        if self.resolution.is_zero() || too_coarse {
            return Err(ConfigError::Resolution {
                resolution_seconds: self.resolution.as_secs_f64(),
                reap_timeout_seconds,
            });
        }
        if self.stall_threshold.is_zero() {
            return Err(ConfigError::StallThreshold {
                stall_threshold_seconds: self.stall_threshold.as_secs_f64(),
            });
        }
        Ok(())
    }

    /// Whether silent workers are reaped at all (a reap timeout of zero disables it).
    pub fn reaping_enabled(&self) -> bool {
        !self.reap_timeout.is_zero()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_as_documented() {
        let config = Config::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.reap_timeout, Duration::from_secs(120));
        assert_eq!(config.registration_grace, Duration::from_secs(3600));
        assert_eq!(Config::from_secs(120.0, 3600.0), Ok(config));
    }

    #[test]
    fn zero_zero_disables_reaping_and_is_valid() {
        let config = Config::from_secs(0.0, 0.0).unwrap();
        assert!(!config.reaping_enabled());
        assert!(Config::default().reaping_enabled());
    }

    #[test]
    fn reap_timeout_below_floor_names_value_and_advice() {
        let message = Config::from_secs(10.0, 3600.0).unwrap_err().to_string();
        assert!(message.contains("reap timeout"), "{message}");
        assert!(message.contains("10.0"), "{message}");
        assert!(
            message.contains("3 × the workers' heartbeat interval"),
            "{message}"
        );
        assert!(message.contains("10 s"), "{message}");
    }

    #[test]
    fn reap_timeout_not_finite_or_negative_is_rejected() {
        for bad in [f64::NAN, f64::INFINITY, -1.0, -0.5, 29.999] {
            let error = Config::from_secs(bad, 3600.0).unwrap_err();
            assert!(
                matches!(error, ConfigError::ReapTimeout { .. }),
                "{bad}: {error}"
            );
            assert!(error.to_string().contains("reap timeout"));
        }
        assert!(Config::from_secs(30.0, 30.0).is_ok());
    }

    #[test]
    fn grace_below_timeout_names_both_values() {
        let message = Config::from_secs(120.0, 60.0).unwrap_err().to_string();
        assert!(message.contains("registration grace"), "{message}");
        assert!(message.contains("60.0"), "{message}");
        assert!(message.contains("120.0"), "{message}");
        for bad in [f64::NAN, f64::INFINITY, -3.0] {
            let error = Config::from_secs(120.0, bad).unwrap_err();
            assert!(
                matches!(error, ConfigError::RegistrationGrace { .. }),
                "{bad}"
            );
        }
    }

    #[test]
    fn resolution_must_be_positive_and_at_most_an_eighth_of_the_timeout() {
        let mut config = Config {
            resolution: Duration::ZERO,
            ..Config::default()
        };
        assert!(matches!(
            config.validate(),
            Err(ConfigError::Resolution { .. })
        ));
        config.resolution = Duration::from_secs(15);
        assert_eq!(config.validate(), Ok(()));
        config.resolution = Duration::from_millis(15_001);
        let message = config.validate().unwrap_err().to_string();
        assert!(
            message.contains("15.001") && message.contains("120.0"),
            "{message}"
        );
    }

    #[test]
    fn a_lower_floor_admits_short_test_timeouts_but_keeps_the_other_rules() {
        let config = Config {
            reap_timeout: Duration::from_secs(2),
            registration_grace: Duration::from_secs(4),
            resolution: Duration::from_millis(100),
            stall_threshold: Duration::from_secs(5),
        };
        assert!(config.validate().is_err());
        assert_eq!(config.validate_with_floor(Duration::ZERO), Ok(()));
        let grace_too_short = Config {
            registration_grace: Duration::from_secs(1),
            ..config
        };
        assert!(grace_too_short.validate_with_floor(Duration::ZERO).is_err());
    }

    #[test]
    fn a_bad_reap_timeout_is_reported_before_a_bad_grace() {
        let error = Config::from_secs(1.0, f64::NAN).unwrap_err();
        assert!(matches!(error, ConfigError::ReapTimeout { .. }), "{error}");
    }

    #[test]
    fn zero_stall_threshold_is_rejected() {
        let config = Config {
            stall_threshold: Duration::ZERO,
            ..Config::default()
        };
        assert!(matches!(
            config.validate(),
            Err(ConfigError::StallThreshold { .. })
        ));
    }
}
