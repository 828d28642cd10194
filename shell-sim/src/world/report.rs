//! What a run reports: the snapshots its expectations are judged on, the records of
//! every free and reap, and the first violation.

use super::World;
use crate::config::SimConfig;
use crate::server::{FreeRecord, ServerStats};
use crate::time::Nanos;
use crate::violation::{Class, Violation};
use crate::worker::WorkerStats;
use kvwarden_core::InstanceId;
use std::collections::BTreeMap;

/// One worker process at a checkpoint.
#[derive(Clone, Debug)]
pub struct WorkerSnapshot {
    /// Its id.
    pub instance: InstanceId,
    /// Which process of the slot.
    pub incarnation: u32,
    /// Heartbeat health.
    pub healthy: bool,
    /// Running or frozen (not dead).
    pub alive: bool,
    /// Live contexts, summed over modules.
    pub contexts: u32,
    /// Whether it holds exactly one context in each of its modules.
    pub one_per_module: bool,
    /// Its counters.
    pub stats: WorkerStats,
}

/// The run at one instant.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// When.
    pub at: Nanos,
    /// Current process of each slot.
    pub workers: Vec<WorkerSnapshot>,
    /// Live contexts of everyone.
    pub live_contexts: u64,
    /// Entries the reference model holds.
    pub entries: usize,
    /// Server counters.
    pub server: ServerStats,
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// The configuration's name.
    pub name: String,
    /// Its seed.
    pub seed: u64,
    /// The first violation, if any.
    pub violation: Option<Violation>,
    /// Hash of the full trace.
    pub trace_hash: u64,
    /// Events processed.
    pub events: u64,
    /// Virtual time reached.
    pub end: Nanos,
    /// The `-v` timeline (empty unless asked for).
    pub timeline: Vec<String>,
    /// Snapshots at the requested checkpoints, in the order asked.
    pub checkpoints: Vec<Snapshot>,
    /// The end of the run.
    pub last: Snapshot,
    /// Every context the core handed back, with the time.
    pub frees: Vec<(Nanos, FreeRecord)>,
    /// Every entry reaped, with the time: (instance, time).
    pub reaps: Vec<(InstanceId, Nanos)>,
    /// Instance ids of each slot, by incarnation: the id it started with, then each
    /// fresh one it drew when its `attach` was refused (row 31).
    pub instances: Vec<Vec<Vec<InstanceId>>>,
    /// Contexts built per instance.
    pub builds: BTreeMap<InstanceId, u64>,
}

impl RunReport {
    /// The current id of `slot`'s process number `incarnation` (None: the last one).
    pub fn instance(&self, slot: usize, incarnation: Option<u32>) -> Option<InstanceId> {
        let incarnations = self.instances.get(slot)?;
        let ids = match incarnation {
            Some(n) => incarnations.get(n as usize)?,
            None => incarnations.last()?,
        };
        ids.last().copied()
    }

    /// Every id of `slot`'s process number `incarnation` (None: of all its processes).
    pub fn ids(&self, slot: usize, incarnation: Option<u32>) -> Vec<InstanceId> {
        let Some(incarnations) = self.instances.get(slot) else {
            return Vec::new();
        };
        match incarnation {
            Some(n) => incarnations.get(n as usize).cloned().unwrap_or_default(),
            None => incarnations.iter().flatten().copied().collect(),
        }
    }
}

/// Runs `cfg`, turning a panic into an internal violation (exit code 127).
pub fn run_config(cfg: SimConfig, checkpoints: Vec<Nanos>, verbose: bool) -> RunReport {
    let name = cfg.name.clone();
    let seed = cfg.seed;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        World::new(cfg, checkpoints, verbose).map(World::run)
    }));
    let failure = |detail: String, invariant: &'static str| RunReport {
        name: name.clone(),
        seed,
        violation: Some(Violation {
            class: Class::Internal,
            invariant,
            at: 0,
            detail,
        }),
        trace_hash: 0,
        events: 0,
        end: 0,
        timeline: Vec::new(),
        checkpoints: Vec::new(),
        last: Snapshot {
            at: 0,
            workers: Vec::new(),
            live_contexts: 0,
            entries: 0,
            server: ServerStats::default(),
        },
        frees: Vec::new(),
        reaps: Vec::new(),
        instances: Vec::new(),
        builds: BTreeMap::new(),
    };
    match outcome {
        Ok(Ok(report)) => report,
        Ok(Err(error)) => failure(error, "invalid_config"),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            failure(message, "panic")
        }
    }
}
