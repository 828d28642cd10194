//! Scenario files: one TOML file per failure-mode row, read into a [`SimConfig`] and a
//! list of expectations.
//!
//! Unknown keys are errors (a typo must not silently turn an expectation off), and every
//! error names the file, the field, the value seen and what would be right. The format
//! is documented in `docs/simulator.md`.

use crate::config::{
    Action, Direction, FaultEvent, HeartbeatStart, InjectedBug, LinkSpec, ServerSpec, SimConfig,
    TokenChoice, WorkerSpec,
};
use crate::expect::{ExpectKind, Expectation, Target};
use crate::time::{Nanos, from_seconds};
use kvwarden_core::Module;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A scenario file that cannot be run.
#[derive(Debug, Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("{file}: cannot read the scenario file: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the format.
    #[error("{file}: {message}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// The TOML reader's message (it names the line and the key).
        message: String,
    },
    /// A field has a value the simulator cannot use.
    #[error("{file}: field `{field}` = {value}: {fix}")]
    Field {
        /// The file.
        file: PathBuf,
        /// The field, with its table and index (e.g. `events[2].workers`).
        field: String,
        /// The value seen.
        value: String,
        /// What would be right.
        fix: String,
    },
}

/// A scenario ready to run.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Where it came from.
    pub file: PathBuf,
    /// The run.
    pub config: SimConfig,
    /// What must be seen.
    pub expectations: Vec<Expectation>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    seed: u64,
    duration_seconds: f64,
    #[serde(default)]
    inject_bug: Option<String>,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    l2: Option<RawL2>,
    #[serde(default)]
    workers: Vec<RawWorkers>,
    #[serde(default)]
    events: Vec<RawEvent>,
    #[serde(default)]
    expect: Vec<RawExpect>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawL2 {
    enabled: Option<bool>,
    delay_ms: Option<f64>,
    timeout_ms: Option<f64>,
    queue_bytes: Option<u64>,
    corrupt_rate: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkers {
    #[serde(default = "one")]
    count: usize,
    start_seconds: Option<f64>,
    heartbeat_interval_seconds: Option<f64>,
    same_host: Option<bool>,
    traffic_every_seconds: Option<f64>,
    traffic_start_seconds: Option<f64>,
    heartbeat_start: Option<String>,
    modules: Option<Vec<String>>,
    blend: Option<bool>,
    legacy_ping: Option<bool>,
    commit_after_seconds: Option<f64>,
    link: Option<RawLink>,
    uid: Option<u32>,
    garbage_every_seconds: Option<f64>,
}

fn one() -> usize {
    1
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    delay_ms: Option<f64>,
    jitter_ms: Option<f64>,
    loss: Option<f64>,
    duplicate: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at_seconds: f64,
    action: String,
    #[serde(default)]
    workers: Vec<String>,
    until_seconds: Option<f64>,
    direction: Option<String>,
    down_seconds: Option<f64>,
    step_seconds: Option<f64>,
    rate: Option<f64>,
    delay_ms: Option<f64>,
    link: Option<RawLink>,
    target: Option<String>,
    token: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExpect {
    kind: String,
    worker: Option<String>,
    incarnation: Option<u32>,
    between_seconds: Option<[f64; 2]>,
    at_seconds: Option<f64>,
    count: Option<u64>,
    min: Option<u64>,
    value: Option<bool>,
    cause: Option<String>,
}

/// Reads and checks one scenario file.
pub fn load(file: &Path) -> Result<Scenario, ScenarioError> {
    let text = std::fs::read_to_string(file).map_err(|source| ScenarioError::Read {
        file: file.to_path_buf(),
        source,
    })?;
    parse(file, &text)
}

/// Checks one scenario given as text (`file` names it in errors).
pub fn parse(file: &Path, text: &str) -> Result<Scenario, ScenarioError> {
    let raw: RawScenario = toml::from_str(text).map_err(|error| ScenarioError::Parse {
        file: file.to_path_buf(),
        message: error.to_string(),
    })?;
    Reader { file }.scenario(raw)
}

struct Reader<'a> {
    file: &'a Path,
}

impl Reader<'_> {
    fn bad(
        &self,
        field: impl Into<String>,
        value: impl std::fmt::Display,
        fix: &str,
    ) -> ScenarioError {
        ScenarioError::Field {
            file: self.file.to_path_buf(),
            field: field.into(),
            value: value.to_string(),
            fix: fix.to_string(),
        }
    }

    fn seconds(&self, field: &str, value: f64) -> Result<Nanos, ScenarioError> {
        if !value.is_finite() || value < 0.0 {
            return Err(self.bad(field, value, "a finite number of seconds, 0 or more"));
        }
        Ok(from_seconds(value))
    }

    fn probability(&self, field: &str, value: f64) -> Result<f64, ScenarioError> {
        if !(0.0..=1.0).contains(&value) {
            return Err(self.bad(field, value, "a probability between 0.0 and 1.0"));
        }
        Ok(value)
    }

    fn scenario(&self, raw: RawScenario) -> Result<Scenario, ScenarioError> {
        let _ = raw.description;
        let duration = self.seconds("duration_seconds", raw.duration_seconds)?;
        if duration == 0 {
            return Err(self.bad(
                "duration_seconds",
                raw.duration_seconds,
                "a run must last more than 0 s",
            ));
        }
        let mut server = self.server(&raw.server)?;
        if let Some(l2) = &raw.l2 {
            server.l2 = self.l2(l2)?;
        }
        let mut workers = Vec::new();
        for (index, group) in raw.workers.iter().enumerate() {
            if group.count == 0 || group.count > 100_000 {
                return Err(self.bad(
                    format!("workers[{index}].count"),
                    group.count,
                    "between 1 and 100000",
                ));
            }
            for _ in 0..group.count {
                let name = format!("w{}", workers.len());
                workers.push(self.worker(index, group, name)?);
            }
        }
        if workers.is_empty() {
            return Err(self.bad("workers", "[]", "declare at least one [[workers]] group"));
        }
        let bug = match &raw.inject_bug {
            None => None,
            Some(name) => {
                let bug = InjectedBug::ALL
                    .iter()
                    .find(|(_, label)| label == name)
                    .map(|(bug, _)| *bug)
                    .ok_or_else(|| {
                        let names: Vec<&str> =
                            InjectedBug::ALL.iter().map(|(_, label)| *label).collect();
                        self.bad(
                            "inject_bug",
                            format!("{name:?}"),
                            &format!("one of {}", names.join(", ")),
                        )
                    })?;
                if !bug.available() {
                    return Err(self.bad(
                        "inject_bug",
                        format!("{name:?}"),
                        "a bug of the node: build kvwarden-sim with --features planted-bugs",
                    ));
                }
                Some(bug)
            }
        };
        let mut events = Vec::new();
        for (index, event) in raw.events.iter().enumerate() {
            self.event(index, event, &workers, &mut events)?;
        }
        if !server.l2.enabled
            && let Some(index) = raw.events.iter().position(|e| e.action.starts_with("l2_"))
        {
            return Err(self.bad(
                format!("events[{index}].action"),
                format!("{:?}", raw.events[index].action),
                "an L2 fault needs L2: add an [l2] section (enabled = true)",
            ));
        }
        events.sort_by_key(|e: &FaultEvent| e.at);
        let mut expectations = Vec::new();
        let mut converge_at_end = false;
        for (index, expect) in raw.expect.iter().enumerate() {
            let expectation = self.expect(index, expect, &workers, duration)?;
            if expectation.kind == ExpectKind::Converged {
                converge_at_end = true;
            }
            expectations.push(expectation);
        }
        Ok(Scenario {
            file: self.file.to_path_buf(),
            config: SimConfig {
                name: raw.name,
                seed: raw.seed,
                duration,
                server,
                workers,
                events,
                bug,
                converge_at_end,
            },
            expectations,
        })
    }

    fn millis(&self, field: &str, value: f64) -> Result<Nanos, ScenarioError> {
        if !value.is_finite() || value <= 0.0 {
            return Err(self.bad(field, value, "a finite number of milliseconds above 0"));
        }
        Ok(from_seconds(value / 1e3))
    }

    /// `[l2]`: present means enabled unless `enabled = false`.
    fn l2(&self, raw: &RawL2) -> Result<crate::l2::L2Spec, ScenarioError> {
        let mut spec = crate::l2::L2Spec {
            enabled: raw.enabled.unwrap_or(true),
            ..crate::l2::L2Spec::default()
        };
        if let Some(v) = raw.delay_ms {
            spec.delay = self.millis("l2.delay_ms", v)?;
        }
        if let Some(v) = raw.timeout_ms {
            spec.timeout = self.millis("l2.timeout_ms", v)?;
        }
        if let Some(v) = raw.queue_bytes {
            if v == 0 {
                return Err(self.bad("l2.queue_bytes", v, "at least 1 byte"));
            }
            spec.queue_bytes = v;
        }
        if let Some(v) = raw.corrupt_rate {
            spec.corrupt_rate = self.probability("l2.corrupt_rate", v)?;
        }
        Ok(spec)
    }

    fn server(&self, raw: &RawServer) -> Result<ServerSpec, ScenarioError> {
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
        let config = crate::server::Server::core_config(&spec);
        let floor = if spec.allow_short_timeouts {
            std::time::Duration::ZERO
        } else {
            kvwarden_core::REAP_TIMEOUT_FLOOR
        };
        config
            .validate_with_floor(floor)
            .map_err(|error| self.bad("server", "the [server] table", &error.to_string()))?;
        Ok(spec)
    }

    fn worker(
        &self,
        index: usize,
        raw: &RawWorkers,
        name: String,
    ) -> Result<WorkerSpec, ScenarioError> {
        let field = |name: &str| format!("workers[{index}].{name}");
        let mut spec = WorkerSpec::new(name);
        if let Some(v) = raw.start_seconds {
            spec.start_at = self.seconds(&field("start_seconds"), v)?;
        }
        if let Some(v) = raw.heartbeat_interval_seconds {
            spec.heartbeat_interval = self.seconds(&field("heartbeat_interval_seconds"), v)?;
            if spec.heartbeat_interval == 0 {
                return Err(self.bad(
                    field("heartbeat_interval_seconds"),
                    v,
                    "more than 0 s (default 10)",
                ));
            }
        }
        if let Some(v) = raw.same_host {
            spec.same_host = v;
        }
        if let Some(v) = raw.traffic_every_seconds {
            let every = self.seconds(&field("traffic_every_seconds"), v)?;
            if every == 0 {
                return Err(self.bad(
                    field("traffic_every_seconds"),
                    v,
                    "more than 0 s, or leave it out for no traffic",
                ));
            }
            spec.traffic_every = Some(every);
        }
        if let Some(v) = raw.traffic_start_seconds {
            spec.traffic_start_after = self.seconds(&field("traffic_start_seconds"), v)?;
        }
        if let Some(v) = &raw.heartbeat_start {
            spec.heartbeat_start = match v.as_str() {
                "register" => HeartbeatStart::OnRegister,
                "first_transfer" => HeartbeatStart::OnFirstTransfer,
                "never" => HeartbeatStart::Never,
                _ => {
                    return Err(self.bad(
                        field("heartbeat_start"),
                        format!("{v:?}"),
                        "one of \"register\", \"first_transfer\", \"never\"",
                    ));
                }
            };
        }
        if let Some(modules) = &raw.modules {
            let mut parsed = Vec::new();
            for m in modules {
                let module = match m.as_str() {
                    "server_driven" => Module::ServerDriven,
                    "engine_driven" => Module::EngineDriven,
                    _ => {
                        return Err(self.bad(
                            field("modules"),
                            format!("{m:?}"),
                            "\"server_driven\" or \"engine_driven\"",
                        ));
                    }
                };
                if !parsed.contains(&module) {
                    parsed.push(module);
                }
            }
            if parsed.is_empty() {
                return Err(self.bad(field("modules"), "[]", "at least one module"));
            }
            spec.modules = parsed;
        }
        if let Some(v) = raw.blend {
            spec.blend = v;
        }
        if let Some(v) = raw.legacy_ping {
            spec.legacy_ping = v;
        }
        if let Some(v) = raw.commit_after_seconds {
            spec.commit_after = self.seconds(&field("commit_after_seconds"), v)?;
        }
        if let Some(link) = &raw.link {
            spec.link = self.link(&field("link"), link)?;
        }
        if let Some(v) = raw.uid {
            spec.uid = v;
        }
        if let Some(v) = raw.garbage_every_seconds {
            let every = self.seconds(&field("garbage_every_seconds"), v)?;
            if every == 0 {
                return Err(self.bad(
                    field("garbage_every_seconds"),
                    v,
                    "more than 0 s, or leave it out for no garbage",
                ));
            }
            spec.garbage_every = Some(every);
        }
        Ok(spec)
    }

    fn link(&self, field: &str, raw: &RawLink) -> Result<LinkSpec, ScenarioError> {
        let mut spec = LinkSpec::default();
        if let Some(v) = raw.delay_ms {
            spec.delay = self.seconds(&format!("{field}.delay_ms"), v)? / 1000;
        }
        if let Some(v) = raw.jitter_ms {
            spec.jitter = self.seconds(&format!("{field}.jitter_ms"), v)? / 1000;
        }
        if let Some(v) = raw.loss {
            spec.loss = self.probability(&format!("{field}.loss"), v)?;
        }
        if let Some(v) = raw.duplicate {
            spec.duplicate = self.probability(&format!("{field}.duplicate"), v)?;
        }
        Ok(spec)
    }

    fn slots(
        &self,
        field: &str,
        names: &[String],
        workers: &[WorkerSpec],
    ) -> Result<Vec<usize>, ScenarioError> {
        if names.is_empty() {
            return Err(self.bad(
                field,
                "[]",
                "name the workers it acts on, e.g. [\"w0\"] (or [\"*\"] for all)",
            ));
        }
        if names.len() == 1 && names[0] == "*" {
            return Ok((0..workers.len()).collect());
        }
        names
            .iter()
            .map(|name| {
                workers.iter().position(|w| &w.name == name).ok_or_else(|| {
                    self.bad(
                        field,
                        format!("{name:?}"),
                        &format!("a declared worker, w0 to w{}", workers.len() - 1),
                    )
                })
            })
            .collect()
    }

    fn event(
        &self,
        index: usize,
        raw: &RawEvent,
        workers: &[WorkerSpec],
        events: &mut Vec<FaultEvent>,
    ) -> Result<(), ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        let at = self.seconds(&field("at_seconds"), raw.at_seconds)?;
        let slots = || self.slots(&field("workers"), &raw.workers, workers);
        let (action, undo) = match raw.action.as_str() {
            "crash" => (Action::Crash(slots()?), None),
            "restart" => (Action::Restart(slots()?), None),
            "freeze" => (Action::Freeze(slots()?), Some(Action::Thaw(slots()?))),
            "thaw" => (Action::Thaw(slots()?), None),
            "starve_heartbeat" => (
                Action::StarveHeartbeat(slots()?),
                Some(Action::FeedHeartbeat(slots()?)),
            ),
            "feed_heartbeat" => (Action::FeedHeartbeat(slots()?), None),
            "stop" => (Action::Stop(slots()?), None),
            "unregister" => (Action::Unregister(slots()?), None),
            "register" => (Action::Register(slots()?), None),
            "transfer" => (Action::Transfer(slots()?), None),
            "partition" => {
                let direction = match raw.direction.as_deref().unwrap_or("both") {
                    "both" => Direction::Both,
                    "to_server" => Direction::ToServer,
                    "to_worker" => Direction::ToWorker,
                    other => {
                        return Err(self.bad(
                            field("direction"),
                            format!("{other:?}"),
                            "\"both\", \"to_server\" or \"to_worker\"",
                        ));
                    }
                };
                (
                    Action::Partition(slots()?, direction),
                    Some(Action::Heal(slots()?)),
                )
            }
            "heal" => (Action::Heal(slots()?), None),
            "set_link" => {
                let Some(link) = &raw.link else {
                    return Err(self.bad(
                        field("link"),
                        "nothing",
                        "set_link needs link = { delay_ms, jitter_ms, loss, duplicate }",
                    ));
                };
                (
                    Action::SetLink(slots()?, self.link(&field("link"), link)?),
                    None,
                )
            }
            "server_pause" => (Action::ServerPause, Some(Action::ServerResume)),
            "server_resume" => (Action::ServerResume, None),
            "server_restart" => {
                let down = self.seconds(&field("down_seconds"), raw.down_seconds.unwrap_or(0.0))?;
                (Action::ServerRestart { down }, None)
            }
            "server_stop" => (Action::ServerStop, None),
            "clock_step" => {
                let Some(step) = raw.step_seconds.filter(|s| s.is_finite()) else {
                    return Err(self.bad(
                        field("step_seconds"),
                        format!("{:?}", raw.step_seconds),
                        "clock_step needs a finite step_seconds (negative: backwards)",
                    ));
                };
                (Action::ClockStep((step * 1e9) as i64), None)
            }
            "build_failure_rate" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::BuildFailureRate(rate), None)
            }
            "free_hang_rate" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::FreeHangRate(rate), None)
            }
            "intrude" => {
                let from = slots()?;
                let target = raw
                    .target
                    .as_ref()
                    .map(|t| vec![t.clone()])
                    .unwrap_or_default();
                let target = self.slots(&field("target"), &target, workers)?;
                if from.len() != 1 || target.len() != 1 || from[0] == target[0] {
                    return Err(self.bad(
                        field("target"),
                        format!("{:?}", raw.target),
                        "intrude needs one worker in workers and another one in target",
                    ));
                }
                (Action::Intrude(from[0], target[0]), None)
            }
            "impersonate" | "poach" => {
                let from = slots()?;
                if from.len() != 1 {
                    return Err(self.bad(
                        field("workers"),
                        format!("{:?}", raw.workers),
                        "impersonate and poach need exactly one worker (the adversary)",
                    ));
                }
                if raw.action == "poach" {
                    (Action::Poach(from[0]), None)
                } else {
                    (Action::Impersonate(from[0]), None)
                }
            }
            "tcp_probe" => {
                let token = match raw.token.as_deref().unwrap_or("missing") {
                    "missing" => TokenChoice::Missing,
                    "wrong" => TokenChoice::Wrong,
                    "right" => TokenChoice::Right,
                    other => {
                        return Err(self.bad(
                            field("token"),
                            format!("{other:?}"),
                            "\"missing\", \"wrong\" or \"right\" (the server's tcp_token)",
                        ));
                    }
                };
                (Action::TcpProbe(token), None)
            }
            "l2_down" => (Action::L2Down, Some(Action::L2Up)),
            "l2_partition" => (Action::L2Partition, Some(Action::L2Up)),
            "l2_up" => (Action::L2Up, None),
            "l2_slow" => {
                let Some(delay) = raw.delay_ms else {
                    return Err(self.bad(
                        field("delay_ms"),
                        "nothing",
                        "l2_slow needs delay_ms (how late L2 answers; above l2.timeout_ms to be slow)",
                    ));
                };
                (
                    Action::L2Slow(self.millis(&field("delay_ms"), delay)?),
                    Some(Action::L2Up),
                )
            }
            "l2_corrupt" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::L2Corrupt(rate), Some(Action::L2Corrupt(0.0)))
            }
            "l2_garble" => (Action::L2Garble(slots()?), None),
            "l2_flaky" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::L2Flaky(rate), Some(Action::L2Flaky(0.0)))
            }
            "heal_all" => (Action::HealAll, None),
            other => {
                return Err(self.bad(
                    field("action"),
                    format!("{other:?}"),
                    "one of crash, restart, freeze, thaw, starve_heartbeat, feed_heartbeat, stop, unregister, register, transfer, partition, heal, set_link, server_pause, server_resume, server_restart, server_stop, clock_step, build_failure_rate, free_hang_rate, intrude, impersonate, poach, tcp_probe, l2_down, l2_partition, l2_up, l2_slow, l2_corrupt, l2_flaky, l2_garble, heal_all",
                ));
            }
        };
        events.push(FaultEvent { at, action });
        if let Some(until) = raw.until_seconds {
            let Some(undo) = undo else {
                return Err(self.bad(field("until_seconds"), until, "only freeze, starve_heartbeat, partition, server_pause, l2_down, l2_partition, l2_slow, l2_corrupt and l2_flaky can be undone with until_seconds"));
            };
            let end = self.seconds(&field("until_seconds"), until)?;
            if end < at {
                return Err(self.bad(field("until_seconds"), until, "not before at_seconds"));
            }
            events.push(FaultEvent {
                at: end,
                action: undo,
            });
        }
        Ok(())
    }

    fn expect(
        &self,
        index: usize,
        raw: &RawExpect,
        workers: &[WorkerSpec],
        duration: Nanos,
    ) -> Result<Expectation, ScenarioError> {
        let field = |name: &str| format!("expect[{index}].{name}");
        let kind = ExpectKind::parse(&raw.kind)
            .ok_or_else(|| self.bad(field("kind"), format!("{:?}", raw.kind), ExpectKind::HELP))?;
        let target = match &raw.worker {
            None => Target::All,
            Some(name) => {
                let slot = workers
                    .iter()
                    .position(|w| &w.name == name)
                    .ok_or_else(|| {
                        self.bad(
                            field("worker"),
                            format!("{name:?}"),
                            &format!("a declared worker, w0 to w{}", workers.len() - 1),
                        )
                    })?;
                Target::Worker {
                    slot,
                    incarnation: raw.incarnation,
                }
            }
        };
        if kind.needs_worker() && target == Target::All {
            return Err(self.bad(
                field("worker"),
                "nothing",
                "this kind needs worker = \"wN\"",
            ));
        }
        let between = match raw.between_seconds {
            None => None,
            Some([a, b]) => {
                let (a, b) = (
                    self.seconds(&field("between_seconds"), a)?,
                    self.seconds(&field("between_seconds"), b)?,
                );
                if b < a {
                    return Err(self.bad(
                        field("between_seconds"),
                        format!(
                            "[{}, {}]",
                            raw.between_seconds.unwrap()[0],
                            raw.between_seconds.unwrap()[1]
                        ),
                        "[earliest, latest] with earliest ≤ latest",
                    ));
                }
                Some((a, b))
            }
        };
        let at = match raw.at_seconds {
            None => None,
            Some(v) => {
                let at = self.seconds(&field("at_seconds"), v)?;
                if at > duration {
                    return Err(self.bad(field("at_seconds"), v, "not after duration_seconds"));
                }
                Some(at)
            }
        };
        let cause = match raw.cause.as_deref() {
            None | Some("any") => None,
            Some(c @ ("reaped" | "process_exited" | "unregistered" | "cancelled")) => {
                Some(c.to_string())
            }
            Some(other) => {
                return Err(self.bad(
                    field("cause"),
                    format!("{other:?}"),
                    "one of reaped, process_exited, unregistered, cancelled, any",
                ));
            }
        };
        if kind.needs_count() && raw.count.is_none() {
            return Err(self.bad(field("count"), "nothing", "this kind needs count = N"));
        }
        if kind == ExpectKind::Healthy && raw.value.is_none() {
            return Err(self.bad(
                field("value"),
                "nothing",
                "healthy needs value = true or false",
            ));
        }
        Ok(Expectation {
            index,
            kind,
            target,
            between,
            at,
            count: raw.count,
            min: raw.min,
            value: raw.value,
            cause,
        })
    }
}
