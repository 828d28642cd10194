//! Scenario files: one TOML file per failure-mode row, read into a [`SimConfig`] and a
//! list of expectations.
//!
//! Unknown keys are errors (a typo must not silently turn an expectation off), and every
//! error names the file, the field, the value seen and what would be right. The format
//! is documented in `docs/simulator.md`.

use crate::config::{FaultEvent, HeartbeatStart, InjectedBug, LinkSpec, SimConfig, WorkerSpec};
use crate::expect::{ExpectKind, ExpectTarget, Expectation};
use crate::time::{Nanos, from_seconds};
use kvwarden_core::Module;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use thiserror::Error;

mod event;
mod server;
use server::RawServer;

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
        let bug = self.injected_bug(raw.inject_bug.as_deref())?;
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

    /// The bug `inject_bug` names, if any.
    fn injected_bug(&self, name: Option<&str>) -> Result<Option<InjectedBug>, ScenarioError> {
        let Some(name) = name else {
            return Ok(None);
        };
        let bug = InjectedBug::ALL
            .iter()
            .find(|(_, label)| *label == name)
            .map(|(bug, _)| *bug)
            .ok_or_else(|| {
                let names: Vec<&str> = InjectedBug::ALL.iter().map(|(_, label)| *label).collect();
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
        Ok(Some(bug))
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
            spec.heartbeat_start = self.heartbeat_start(&field("heartbeat_start"), v)?;
        }
        if let Some(modules) = &raw.modules {
            spec.modules = self.modules(&field("modules"), modules)?;
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

    /// When a worker's heartbeat starts.
    fn heartbeat_start(&self, field: &str, v: &str) -> Result<HeartbeatStart, ScenarioError> {
        match v {
            "register" => Ok(HeartbeatStart::OnRegister),
            "first_transfer" => Ok(HeartbeatStart::OnFirstTransfer),
            "never" => Ok(HeartbeatStart::Never),
            _ => Err(self.bad(
                field,
                format!("{v:?}"),
                "one of \"register\", \"first_transfer\", \"never\"",
            )),
        }
    }

    /// A worker's modules, each once, at least one.
    fn modules(&self, field: &str, modules: &[String]) -> Result<Vec<Module>, ScenarioError> {
        let mut parsed = Vec::new();
        for m in modules {
            let module = match m.as_str() {
                "server_driven" => Module::ServerDriven,
                "engine_driven" => Module::EngineDriven,
                _ => {
                    return Err(self.bad(
                        field,
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
            return Err(self.bad(field, "[]", "at least one module"));
        }
        Ok(parsed)
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

    /// The free cause an expectation names; None for any.
    fn cause(&self, field: &str, cause: Option<&str>) -> Result<Option<String>, ScenarioError> {
        match cause {
            None | Some("any") => Ok(None),
            Some(c @ ("reaped" | "process_exited" | "unregistered" | "cancelled")) => {
                Ok(Some(c.to_string()))
            }
            Some(other) => Err(self.bad(
                field,
                format!("{other:?}"),
                "one of reaped, process_exited, unregistered, cancelled, any",
            )),
        }
    }

    /// An expectation's `[earliest, latest]` window.
    fn window(&self, field: &str, [a, b]: [f64; 2]) -> Result<(Nanos, Nanos), ScenarioError> {
        let (earliest, latest) = (self.seconds(field, a)?, self.seconds(field, b)?);
        if latest < earliest {
            return Err(self.bad(
                field,
                format!("[{a}, {b}]"),
                "[earliest, latest] with earliest ≤ latest",
            ));
        }
        Ok((earliest, latest))
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
            None => ExpectTarget::All,
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
                ExpectTarget::Worker {
                    slot,
                    incarnation: raw.incarnation,
                }
            }
        };
        if kind.needs_worker() && target == ExpectTarget::All {
            return Err(self.bad(
                field("worker"),
                "nothing",
                "this kind needs worker = \"wN\"",
            ));
        }
        let between = match raw.between_seconds {
            None => None,
            Some(window) => Some(self.window(&field("between_seconds"), window)?),
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
        let cause = self.cause(&field("cause"), raw.cause.as_deref())?;
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
