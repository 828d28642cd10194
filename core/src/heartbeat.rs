//! The worker's side of liveness: when to ping, what a reply means, when to recover.
//!
//! Fixed-delay cycle: ping; on the reply (or after `interval` without one) act; the
//! next ping is due `interval` after the reply, or after the recovery finished. Health
//! is set only after a recovery (re-registering everything under the same id)
//! succeeded, so a worker never believes in state the server no longer holds.
//!
//! The one recovery rule both clients (Rust and Python) follow: a ping answered
//! `false`, a ping answered `true` while unhealthy, and a transfer answered
//! `not_registered` ([`Heartbeat::on_not_registered`]) all lead to the same recovery,
//! run by the heartbeat's driver when [`Heartbeat::handle_timeout`] or
//! [`Heartbeat::on_ping_reply`] says [`HeartbeatAction::Recover`]; the transfer
//! itself is answered as failed, never retried by the machine.

use crate::REAP_TIMEOUT_FLOOR;
use crate::time::Instant;
use std::time::Duration;

/// The worker's heartbeat settings.
#[derive(Clone, Debug, PartialEq)]
pub struct HeartbeatConfig {
    /// Delay between a reply and the next ping; also a ping's timeout. Default 10 s.
    pub interval: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> HeartbeatConfig {
        HeartbeatConfig {
            interval: Duration::from_secs(10),
        }
    }
}

/// What the worker's shell must do now.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HeartbeatAction {
    /// Send `ping [instance_id]`.
    SendPing,
    /// Re-register every registration with the same instance id, then report with
    /// [`Heartbeat::on_recover_done`].
    Recover,
}

/// How the server answered a ping.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PingReply {
    /// The server answered true.
    Known,
    /// The server answered false: it does not hold this instance (reaped, or restarted).
    Unknown,
    /// Error reply, timeout, disconnect.
    Failed,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Phase {
    NotStarted,
    /// The next ping is due at this instant.
    Waiting {
        due: Instant,
    },
    /// A ping was sent; it counts as failed at this instant.
    InFlight {
        deadline: Instant,
    },
    /// A recovery is due at this instant (a transfer was answered `not_registered`).
    RecoverDue {
        due: Instant,
    },
    /// A recovery is running.
    Recovering,
    Stopped,
}

/// The worker's heartbeat machine. Sans-IO: the shell sends pings, runs recoveries and
/// feeds replies and time.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    interval: Duration,
    phase: Phase,
    healthy: bool,
}

impl Heartbeat {
    /// Not started, healthy.
    pub fn new(config: HeartbeatConfig) -> Heartbeat {
        Heartbeat {
            interval: config.interval,
            phase: Phase::NotStarted,
            healthy: true,
        }
    }

    /// Lazy start (first store/retrieve). Idempotent. The first ping is due at `now`.
    pub fn start(&mut self, now: Instant) {
        if self.phase == Phase::NotStarted {
            self.phase = Phase::Waiting { due: now };
        }
    }

    /// Whether `start` was called (and `stop` was not called before it).
    pub fn is_started(&self) -> bool {
        !matches!(self.phase, Phase::NotStarted)
    }

    /// Whether the worker may trust its registrations: false from a failed ping until a
    /// recovery succeeds.
    pub fn is_healthy(&self) -> bool {
        self.healthy
    }

    /// Whether `stop` was called.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// Next ping due, the in-flight ping's deadline, or when a recovery is due; None
    /// when not started, stopped, or while a recovery is running.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::Waiting { due } | Phase::RecoverDue { due } => Some(due),
            Phase::InFlight { deadline } => Some(deadline),
            Phase::NotStarted | Phase::Recovering | Phase::Stopped => None,
        }
    }

    /// `SendPing` when a ping is due, `Recover` when a recovery is. A ping unanswered
    /// for `interval` counts as Failed.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<HeartbeatAction> {
        match self.phase {
            Phase::RecoverDue { due } if now >= due => {
                self.phase = Phase::Recovering;
                Some(HeartbeatAction::Recover)
            }
            Phase::Waiting { due } if now >= due => {
                self.phase = Phase::InFlight {
                    deadline: now + self.interval,
                };
                Some(HeartbeatAction::SendPing)
            }
            Phase::InFlight { deadline } if now >= deadline => {
                self.on_ping_reply(now, PingReply::Failed)
            }
            _ => None,
        }
    }

    /// Failed → unhealthy at once. Known while unhealthy → `Recover` (health stays
    /// cleared until the recovery succeeds). Unknown → unhealthy and `Recover`.
    /// A reply while no ping is in flight (late, duplicated, after stop) is ignored.
    pub fn on_ping_reply(&mut self, now: Instant, reply: PingReply) -> Option<HeartbeatAction> {
        if !matches!(self.phase, Phase::InFlight { .. }) {
            return None;
        }
        match reply {
            PingReply::Known if self.healthy => {
                self.phase = Phase::Waiting {
                    due: now + self.interval,
                };
                None
            }
            PingReply::Failed => {
                self.healthy = false;
                self.phase = Phase::Waiting {
                    due: now + self.interval,
                };
                None
            }
            PingReply::Known | PingReply::Unknown => {
                self.healthy = false;
                self.phase = Phase::Recovering;
                Some(HeartbeatAction::Recover)
            }
        }
    }

    /// true → healthy. false → stays unhealthy; recovery is asked again after the
    /// next successful ping. Ignored unless a recovery was asked for (and after stop).
    pub fn on_recover_done(&mut self, now: Instant, ok: bool) {
        if self.phase != Phase::Recovering {
            return;
        }
        if ok {
            self.healthy = true;
        }
        self.phase = Phase::Waiting {
            due: now + self.interval,
        };
    }

    /// A transfer was answered `not_registered`: the server does not hold a
    /// registration this worker made. Health clears at once and the recovery is due at
    /// `now` (no ping first: the transfer's answer is the evidence, and a ping would
    /// only be answered `false`). A ping in flight leads there by its reply (`Known`
    /// while unhealthy asks for the recovery, as `Unknown` does); a recovery already
    /// running restores health when it succeeds. Ignored before start and after stop.
    pub fn on_not_registered(&mut self, now: Instant) {
        match self.phase {
            Phase::NotStarted | Phase::Stopped => {}
            Phase::Waiting { .. } => {
                self.healthy = false;
                self.phase = Phase::RecoverDue { due: now };
            }
            Phase::InFlight { .. } | Phase::RecoverDue { .. } | Phase::Recovering => {
                self.healthy = false;
            }
        }
    }

    /// After stop no action is ever returned and health never changes again.
    pub fn stop(&mut self) {
        self.phase = Phase::Stopped;
    }
}

/// Some(warning) when 3 × interval exceeds the server's 30 s reap-timeout floor.
pub fn reap_timeout_floor_warning(interval: Duration) -> Option<String> {
    let three_intervals = interval.saturating_mul(3);
    if three_intervals <= REAP_TIMEOUT_FLOOR {
        return None;
    }
    Some(format!(
        "heartbeat interval {:?} s: 3 × interval = {:?} s exceeds the server's {} s \
         reap-timeout floor; a server configured at the floor could reap this worker \
         between two pings. Use an interval of at most {} s, or make sure the server's \
         reap timeout is at least {:?} s",
        interval.as_secs_f64(),
        three_intervals.as_secs_f64(),
        REAP_TIMEOUT_FLOOR.as_secs(),
        REAP_TIMEOUT_FLOOR.as_secs() / 3,
        three_intervals.as_secs_f64(),
    ))
}

/// The warning a worker logs when 3 × its heartbeat `interval` exceeds the reap timeout
/// its server said in `hello` (0: reaping disabled, never too short): the server could
/// reap it between two late pings. None when the interval fits.
pub fn reap_timeout_warning(interval: Duration, reap_timeout: Duration) -> Option<String> {
    let three_intervals = interval.saturating_mul(3);
    if reap_timeout.is_zero() || three_intervals <= reap_timeout {
        return None;
    }
    Some(format!(
        "heartbeat interval {:?} s: 3 × interval = {:?} s exceeds the server's reap timeout \
         of {:?} s, so it could reap this live worker between two late pings; use an \
         interval of at most {:?} s, or raise the server's --worker-reap-timeout-seconds",
        interval.as_secs_f64(),
        three_intervals.as_secs_f64(),
        reap_timeout.as_secs_f64(),
        reap_timeout.as_secs_f64() / 3.0,
    ))
}

#[cfg(test)]
mod warning_tests {
    use super::*;

    #[test]
    fn a_heartbeat_too_slow_for_the_servers_reap_timeout_is_warned_about() {
        let secs = Duration::from_secs;
        let warning = reap_timeout_warning(secs(10), secs(20)).expect("30 s > 20 s");
        assert!(warning.contains("20"), "{warning}");
        assert!(
            warning.contains("--worker-reap-timeout-seconds"),
            "{warning}"
        );
        assert_eq!(reap_timeout_warning(secs(10), secs(30)), None, "30 s fits");
        assert_eq!(
            reap_timeout_warning(secs(10), secs(0)),
            None,
            "reaping disabled"
        );
    }
}
