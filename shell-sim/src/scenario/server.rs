//! A scenario's `[server]` table: the simulated server's timings, faults and token.

use super::{Reader, ScenarioError};
use crate::config::ServerSpec;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    reap_timeout_seconds: Option<f64>,
    registration_grace_seconds: Option<f64>,
    resolution_seconds: Option<f64>,
    stall_threshold_seconds: Option<f64>,
    allow_short_timeouts: Option<bool>,
    build_delay_seconds: Option<f64>,
    build_delay_max_seconds: Option<f64>,
    build_failure_rate: Option<f64>,
    copy_seconds: Option<f64>,
    pool_file: Option<bool>,
    scan_seconds: Option<f64>,
    exit_notice_seconds: Option<f64>,
    free_seconds: Option<f64>,
    free_hang_rate: Option<f64>,
    free_watchdog_seconds: Option<f64>,
    tcp_token: Option<String>,
}

impl Reader<'_> {
    pub(super) fn server(&self, raw: &RawServer) -> Result<ServerSpec, ScenarioError> {
        let mut spec = ServerSpec::default();
        if let Some(v) = raw.reap_timeout_seconds {
            spec.reap_timeout = self.seconds("server.reap_timeout_seconds", v)?;
        }
        if let Some(v) = raw.registration_grace_seconds {
            spec.registration_grace = self.seconds("server.registration_grace_seconds", v)?;
        }
        if let Some(v) = raw.resolution_seconds {
            spec.resolution = self.seconds("server.resolution_seconds", v)?;
        }
        if let Some(v) = raw.stall_threshold_seconds {
            spec.stall_threshold = self.seconds("server.stall_threshold_seconds", v)?;
        }
        if let Some(v) = raw.allow_short_timeouts {
            spec.allow_short_timeouts = v;
        }
        if let Some(v) = raw.build_delay_seconds {
            let delay = self.seconds("server.build_delay_seconds", v)?;
            spec.build_delay = (delay, delay);
        }
        if let Some(v) = raw.build_delay_max_seconds {
            let max = self.seconds("server.build_delay_max_seconds", v)?;
            if max < spec.build_delay.0 {
                return Err(self.bad(
                    "server.build_delay_max_seconds",
                    v,
                    "at least server.build_delay_seconds",
                ));
            }
            spec.build_delay.1 = max;
        }
        if let Some(v) = raw.build_failure_rate {
            spec.build_failure_rate = self.probability("server.build_failure_rate", v)?;
        }
        if let Some(v) = raw.copy_seconds {
            spec.copy_duration = self.seconds("server.copy_seconds", v)?;
        }
        if let Some(v) = raw.pool_file {
            spec.pool_file = v;
        }
        if let Some(v) = raw.scan_seconds {
            spec.scan_duration = self.seconds("server.scan_seconds", v)?;
        }
        if let Some(v) = raw.exit_notice_seconds {
            spec.exit_notice_delay = self.seconds("server.exit_notice_seconds", v)?;
        }
        if let Some(v) = raw.free_seconds {
            spec.free_delay = self.seconds("server.free_seconds", v)?;
        }
        if let Some(v) = raw.free_hang_rate {
            spec.free_hang_rate = self.probability("server.free_hang_rate", v)?;
        }
        if let Some(v) = &raw.tcp_token {
            if v.len() < 16 {
                return Err(self.bad(
                    "server.tcp_token",
                    format!("{v:?}"),
                    "at least 16 bytes (the server refuses shorter tokens)",
                ));
            }
            spec.tcp_token = Some(v.as_bytes().to_vec());
        }
        if let Some(v) = raw.free_watchdog_seconds {
            spec.free_watchdog = self.seconds("server.free_watchdog_seconds", v)?;
            if spec.free_watchdog == 0 {
                return Err(self.bad(
                    "server.free_watchdog_seconds",
                    v,
                    "more than 0 s (default 10)",
                ));
            }
        }
        self.check_server(&spec)?;
        Ok(spec)
    }

    /// The server's liveness settings, as the server would check them.
    fn check_server(&self, spec: &ServerSpec) -> Result<(), ScenarioError> {
        let config = crate::server::Server::core_config(spec);
        let floor = if spec.allow_short_timeouts {
            std::time::Duration::ZERO
        } else {
            kvwarden_core::REAP_TIMEOUT_FLOOR
        };
        config
            .validate_with_floor(floor)
            .map_err(|error| self.bad("server", "the [server] table", &error.to_string()))
    }
}
