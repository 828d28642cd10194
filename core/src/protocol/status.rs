//! The `status` reply, typed: what `status` (MessagePack) and `GET /status` (JSON) show,
//! field names being the map's keys. The node fills it from its components and the
//! figures only a shell knows ([`ShellFigures`](crate::node::ShellFigures)); every
//! shell encodes it with serde, and clients decode it with [`StatusReport::from_value`].

use crate::protocol::ReplyValue;
use rmpv::Value;
use serde::{Deserialize, Serialize};

/// Everything `status` and `GET /status` report. Field names are the map's keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// `kvwarden <version>` (`kvwarden-sim <version>` from the simulator).
    pub server: String,
    /// The wire protocol version.
    pub protocol: u64,
    /// Random per server start: a changed value means the server restarted.
    pub boot_id: u64,
    /// Seconds since the server started.
    pub uptime_seconds: f64,
    /// The liveness registry.
    pub worker_liveness: LivenessStatus,
    /// Contexts built and freed.
    pub contexts: ContextsStatus,
    /// The L1 pool.
    pub l1: L1Status,
    /// CacheBlend rope tables.
    pub blend: BlendStatus,
    /// The GPUs, or why there are none.
    pub gpu: GpuStatus,
    /// Open worker connections.
    pub connections: usize,
    /// File-descriptor and connection limits.
    pub limits: LimitsStatus,
    /// Bytes of workers' memfds the server maps, and their caps.
    pub mapped: MappedStatus,
    /// Transfers into workers' memory.
    pub transfers: TransfersStatus,
    /// Processes watched for their exit (pidfds).
    pub watched_processes: usize,
    /// Registered instances by how their process's death will be noticed.
    pub instances_by_death_notice: DeathNoticeCounts,
    /// The tracked instances, by id: the first [`MAX_LISTED`].
    pub instances: Vec<InstanceStatus>,
    /// Tracked instances past [`MAX_LISTED`], not listed (the reply stays bounded).
    pub instances_omitted: usize,
    /// Who is who: refusals and bindings.
    pub trust: TrustStatus,
    /// The tenants known, with their L1 use: the [`MAX_LISTED`] using the most slots.
    pub tenants: Vec<TenantStatusReport>,
    /// Tenants past [`MAX_LISTED`], not listed.
    pub tenants_omitted: usize,
    /// The L2 tier; absent without `--l2`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub l2: Option<L2StatusReport>,
}

/// Instances (and tenants) a status lists at most: past it the reply says how many it
/// left out, so that it stays far below a reply's bound however many there are
/// (failure mode 46).
pub const MAX_LISTED: usize = 1000;

impl StatusReport {
    /// What `/status` on a listener other than loopback shows: no uids and no pids,
    /// which only the node's own users need (they read them over the socket or on
    /// loopback).
    pub fn without_local_identities(mut self) -> StatusReport {
        for instance in &mut self.instances {
            instance.owner_uid = None;
            instance.watched_pid = None;
        }
        self
    }
}

/// The `l2` section (present only with `--l2`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct L2StatusReport {
    /// `connecting` (not connected yet), `up`, `degraded` or `down`.
    pub state: String,
    /// Why the latest connection attempt failed (null once one succeeded).
    pub reason: Option<String>,
    /// The seeds of `--l2`.
    pub nodes: Vec<String>,
    /// The node whose slot map the data path uses now: a seed, or (after the first map)
    /// any node the cluster named; null before the first map and for a plain Redis.
    pub map_from: Option<String>,
    /// `cluster` or `single` once connected, else null.
    pub mode: Option<String>,
    /// Whether L2 is reached over TLS (`rediss://`).
    pub tls: bool,
    /// Whether values carry a MAC under the cluster secret (`--l2-secret-file`).
    pub authenticated_values: bool,
    /// The counters, as keys of this section (`hits`, `misses`, `queue_bytes`, ...).
    #[serde(flatten)]
    pub counters: crate::l2::L2Counters,
}

/// The `trust` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct TrustStatus {
    pub forbidden_total: u64,
    pub bound_instances: usize,
    pub retrieve_length_mismatches_total: u64,
}

/// One entry of `tenants`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct TenantStatusReport {
    pub name: String,
    pub slots_used: usize,
    pub quota_slots: usize,
    pub mapped_bytes: u64,
    pub quota_percent: Option<u32>,
    pub engine_driven: bool,
}

/// The `worker_liveness` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct LivenessStatus {
    pub enabled: bool,
    pub reap_timeout_seconds: f64,
    pub registration_grace_seconds: f64,
    pub resolution_seconds: f64,
    pub tracked_instances: usize,
    pub reaped_total: u64,
    pub process_exits_total: u64,
    pub stalls_total: u64,
    pub pings_total: u64,
    pub pings_answered_false_total: u64,
}

/// The `contexts` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ContextsStatus {
    pub built_total: u64,
    pub freed_total: FreedTotals,
    pub frees_in_flight: usize,
    pub frees_hung_total: u64,
}

/// Contexts freed, by cause.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct FreedTotals {
    pub unregistered: u64,
    pub reaped: u64,
    pub process_exited: u64,
    pub cancelled: u64,
    pub shutdown: u64,
}

/// The `l1` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct L1Status {
    pub slot_bytes: u64,
    pub slots_total: usize,
    pub slots_used: usize,
    pub slots_reserved: usize,
    pub slots_pinned: usize,
    /// `anonymous` (a memfd), `adopted` (a pool file whose seals were checked) or
    /// `cold` (a pool file that started empty: `cold_reason` says why).
    pub pool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_reason: Option<String>,
    /// Values committed whose seal is not written yet (a pool file's).
    pub sealing: usize,
    /// Values committed whose seal could not be written (a key longer than a seal
    /// holds): served, but not adopted after a restart.
    pub unsealed_total: u64,
    /// With `pool: adopted`: what the scan found so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adoption: Option<AdoptionStatus>,
    /// The log `kv_events` reads.
    pub events: KvEventsStatus,
}

/// `l1.events`: the log of what entered and left L1 (and L2) that `kv_events` reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvEventsStatus {
    /// Changes held (at most 65,536).
    pub changes: usize,
    /// Bytes of their keys (at most 16 MiB).
    pub bytes: usize,
    /// Tenants with a sequence.
    pub tenants: usize,
    /// Times every sequence started over (more than 65,536 tenants).
    pub epoch: u64,
    /// Pages that started a reader over: new readers, a restart, or a reader behind
    /// changes that left the log (rising fast: readers do not keep up).
    pub resyncs_total: u64,
}

/// `l1.adoption`: a restarted server's scan of its pool file (rows 71-73).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct AdoptionStatus {
    /// `scanning` or `done`.
    pub state: String,
    pub slots: usize,
    pub scanned: usize,
    pub adopted: u64,
    pub adopted_bytes: u64,
    pub dropped: AdoptionDropped,
    /// From the start to the last slot scanned (so far, while scanning).
    pub seconds: f64,
}

/// `l1.adoption.dropped`, by reason.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct AdoptionDropped {
    pub torn: u64,
    pub malformed: u64,
    pub tenant: u64,
    pub duplicate: u64,
    pub taken: u64,
}

/// The `blend` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct BlendStatus {
    pub bytes_total: u64,
    pub instances: usize,
    pub computing: usize,
}

/// The `gpu` section: `{available: true, devices, memory}` or `{available: false, reason}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
#[allow(missing_docs)]
pub enum GpuStatus {
    Available {
        available: bool,
        devices: usize,
        memory: Vec<GpuMemoryStatus>,
    },
    Unavailable {
        available: bool,
        reason: String,
    },
}

/// One device's memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct GpuMemoryStatus {
    pub device: u32,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// The `limits` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct LimitsStatus {
    pub open_files_soft: u64,
    pub open_files_hard: u64,
    pub connection_capacity: usize,
    pub max_connections: usize,
    /// fds peers handed over that the closer threads have not closed yet.
    pub closes_pending: usize,
}

/// The `transfers` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct TransfersStatus {
    pub copies_past_deadline_total: u64,
    pub pool_window: usize,
    pub pool_running: usize,
    pub pool_waiting: usize,
    pub pool_handed_out_total: u64,
}

/// The `mapped` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct MappedStatus {
    pub bytes: u64,
    pub max_bytes: u64,
    pub max_bytes_per_tenant: u64,
    pub max_bytes_per_instance: u64,
    pub refused_total: u64,
}

/// Instances by how their death will be noticed (`instances[].death_noticed_by`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeathNoticeCounts {
    /// By a pidfd the worker sent of itself in `hello`.
    pub pidfd_from_peer: usize,
    /// By a pidfd the server opened on the worker's visible pid.
    pub pidfd_by_pid: usize,
    /// Only by the reap timeout (or the registration grace).
    pub timeout_only: usize,
}

/// One tracked instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct InstanceStatus {
    pub instance_id: u64,
    pub module: String,
    pub age_seconds: f64,
    pub silence_seconds: f64,
    pub proven: bool,
    pub building: bool,
    pub owner_uid: Option<u32>,
    pub tenant: String,
    pub watched_pid: Option<i32>,
    pub death_noticed_by: String,
    pub model_name: String,
    pub blend_bytes: u64,
}

impl ReplyValue for StatusReport {
    /// The report as the `status` op's reply value (a MessagePack map).
    fn to_value(&self) -> Value {
        // Plain structs of numbers and strings always serialize, and read back.
        let bytes = rmp_serde::to_vec_named(self).unwrap_or_default();
        rmpv::decode::read_value(&mut bytes.as_slice()).unwrap_or(Value::Nil)
    }

    /// Reads a `status` reply back; None if it is not a status map of this version.
    fn from_value(value: &Value) -> Option<StatusReport> {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, value).ok()?;
        rmp_serde::from_slice(&bytes).ok()
    }
}
