//! The status map: `status` op (MessagePack) and `GET /status` (JSON) show the same
//! typed [`StatusReport`], serialized by serde for each.

use rmpv::Value;
use serde::Serialize;
use serde_json::Value as Json;

/// Everything `status` and `GET /status` report. Field names are the map's keys.
#[derive(Clone, Debug, Serialize)]
pub struct StatusReport {
    /// `kvwarden <version>`.
    pub server: &'static str,
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
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct L2StatusReport {
    /// `connecting` (not connected yet), `up`, `degraded` or `down`.
    pub state: &'static str,
    /// Why the latest connection attempt failed (null once one succeeded).
    pub reason: Option<String>,
    /// The seeds of `--l2`.
    pub nodes: Vec<String>,
    /// The node whose slot map the data path uses now: a seed, or (after the first map)
    /// any node the cluster named; null before the first map and for a plain Redis.
    pub map_from: Option<String>,
    /// `cluster` or `single` once connected, else null.
    pub mode: Option<&'static str>,
    /// Whether L2 is reached over TLS (`rediss://`).
    pub tls: bool,
    /// Whether values carry a MAC under the cluster secret (`--l2-secret-file`).
    pub authenticated_values: bool,
    pub queue_bytes: u64,
    pub writes: u64,
    pub write_drops: u64,
    pub hits: u64,
    pub misses: u64,
    pub corrupt: u64,
    pub timeouts: u64,
    pub errors: u64,
}

/// The `trust` section.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct TrustStatus {
    pub forbidden_total: u64,
    pub bound_instances: usize,
    pub retrieve_length_mismatches_total: u64,
}

/// One entry of `tenants`.
#[derive(Clone, Debug, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct ContextsStatus {
    pub built_total: u64,
    pub freed_total: FreedTotals,
    pub frees_in_flight: usize,
    pub frees_hung_total: u64,
}

/// Contexts freed, by cause.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct FreedTotals {
    pub unregistered: u64,
    pub reaped: u64,
    pub process_exited: u64,
    pub cancelled: u64,
    pub shutdown: u64,
}

/// The `l1` section.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct L1Status {
    pub slot_bytes: u64,
    pub slots_total: usize,
    pub slots_used: usize,
    pub slots_reserved: usize,
    pub slots_pinned: usize,
    /// `anonymous` (a memfd), `adopted` (a pool file whose seals were checked) or
    /// `cold` (a pool file that started empty: `cold_reason` says why).
    pub pool: &'static str,
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
#[derive(Clone, Debug, Default, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct AdoptionStatus {
    /// `scanning` or `done`.
    pub state: &'static str,
    pub slots: usize,
    pub scanned: usize,
    pub adopted: u64,
    pub adopted_bytes: u64,
    pub dropped: AdoptionDropped,
    /// From the start to the last slot scanned (so far, while scanning).
    pub seconds: f64,
}

/// `l1.adoption.dropped`, by reason.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct AdoptionDropped {
    pub torn: u64,
    pub malformed: u64,
    pub tenant: u64,
    pub duplicate: u64,
    pub taken: u64,
}

impl AdoptionStatus {
    /// The view's figures; `now` ends `seconds` while scanning.
    pub fn of(
        view: &kvwarden_core::node::AdoptionView,
        now: kvwarden_core::Instant,
    ) -> AdoptionStatus {
        AdoptionStatus {
            state: if view.finished.is_some() {
                "done"
            } else {
                "scanning"
            },
            slots: view.slots,
            scanned: view.scanned,
            adopted: view.adopted,
            adopted_bytes: view.adopted_bytes,
            dropped: AdoptionDropped {
                torn: view.dropped_torn,
                malformed: view.dropped_malformed,
                tenant: view.dropped_tenant,
                duplicate: view.dropped_duplicate,
                taken: view.dropped_taken,
            },
            seconds: view
                .finished
                .unwrap_or(now)
                .saturating_duration_since(view.started)
                .as_secs_f64(),
        }
    }
}

/// The `blend` section.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct BlendStatus {
    pub bytes_total: u64,
    pub instances: usize,
    pub computing: usize,
}

/// The `gpu` section: `{available: true, devices, memory}` or `{available: false, reason}`.
#[derive(Clone, Debug, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct GpuMemoryStatus {
    pub device: u32,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// The `limits` section.
#[derive(Clone, Debug, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct TransfersStatus {
    pub copies_past_deadline_total: u64,
    pub pool_window: usize,
    pub pool_running: usize,
    pub pool_waiting: usize,
    pub pool_handed_out_total: u64,
}

/// The `mapped` section.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)] // the keys of docs/protocol.md's status section
pub struct MappedStatus {
    pub bytes: u64,
    pub max_bytes: u64,
    pub max_bytes_per_tenant: u64,
    pub max_bytes_per_instance: u64,
    pub refused_total: u64,
}

/// Instances by how their death will be noticed (`instances[].death_noticed_by`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeathNoticeCounts {
    /// By a pidfd the worker sent of itself in `hello`.
    pub pidfd_from_peer: usize,
    /// By a pidfd the server opened on the worker's visible pid.
    pub pidfd_by_pid: usize,
    /// Only by the reap timeout (or the registration grace).
    pub timeout_only: usize,
}

/// One tracked instance.
#[derive(Clone, Debug, Serialize)]
#[allow(missing_docs)]
pub struct InstanceStatus {
    pub instance_id: u64,
    pub module: &'static str,
    pub age_seconds: f64,
    pub silence_seconds: f64,
    pub proven: bool,
    pub building: bool,
    pub owner_uid: Option<u32>,
    pub tenant: String,
    pub watched_pid: Option<i32>,
    pub death_noticed_by: &'static str,
    pub model_name: String,
    pub blend_bytes: u64,
}

impl StatusReport {
    /// The report as the `status` op's reply value (a MessagePack map).
    pub fn to_msgpack(&self) -> Value {
        // Serializing plain structs of numbers and strings into a Vec cannot fail.
        let bytes = rmp_serde::to_vec_named(self).unwrap_or_default();
        rmpv::decode::read_value(&mut bytes.as_slice()).unwrap_or(Value::Nil)
    }

    /// The report as `GET /status` serves it: the 63-bit ids (`boot_id`, each
    /// `instance_id`) as strings, since a JSON number above 2^53 is rounded by jq,
    /// JavaScript and Grafana (an id copied from them would name another instance). The
    /// `status` op's MessagePack keeps them integers.
    pub fn to_json_pretty(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(&self.to_json()).unwrap_or_default()
    }

    /// The JSON of `GET /status` (see [`StatusReport::to_json_pretty`]).
    pub fn to_json(&self) -> Json {
        let mut json = serde_json::to_value(self).unwrap_or_default();
        kvwarden_client::ids_as_strings(&mut json);
        json
    }
}

/// Converts JSON into MessagePack (the arguments `kvwarden call` reads as JSON).
pub fn json_to_msgpack(json: &Json) -> Value {
    match json {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Boolean(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::F64(n.as_f64().unwrap_or(0.0))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::Array(items.iter().map(json_to_msgpack).collect()),
        Json::Object(map) => Value::Map(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_msgpack(v)))
                .collect(),
        ),
    }
}

pub use kvwarden_client::{ids_as_strings, msgpack_to_json};

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> StatusReport {
        StatusReport {
            server: "kvwarden test",
            protocol: 1,
            boot_id: 7,
            uptime_seconds: 1.5,
            worker_liveness: LivenessStatus {
                enabled: true,
                reap_timeout_seconds: 120.0,
                registration_grace_seconds: 3600.0,
                resolution_seconds: 1.0,
                tracked_instances: 1,
                reaped_total: 0,
                process_exits_total: 0,
                stalls_total: 0,
                pings_total: 3,
                pings_answered_false_total: 0,
            },
            contexts: ContextsStatus {
                built_total: 1,
                freed_total: FreedTotals {
                    unregistered: 0,
                    reaped: 0,
                    process_exited: 0,
                    cancelled: 0,
                    shutdown: 0,
                },
                frees_in_flight: 0,
                frees_hung_total: 0,
            },
            l1: L1Status {
                slot_bytes: 4096,
                slots_total: 8,
                slots_used: 0,
                slots_reserved: 0,
                slots_pinned: 0,
                pool: "anonymous",
                cold_reason: None,
                sealing: 0,
                unsealed_total: 0,
                adoption: None,
                events: KvEventsStatus::default(),
            },
            blend: BlendStatus {
                bytes_total: 0,
                instances: 0,
                computing: 0,
            },
            gpu: GpuStatus::Unavailable {
                available: false,
                reason: "no CUDA driver".into(),
            },
            connections: 1,
            limits: LimitsStatus {
                open_files_soft: 1024,
                open_files_hard: 4096,
                connection_capacity: 400,
                max_connections: 1000,
                closes_pending: 0,
            },
            mapped: MappedStatus {
                bytes: 1 << 20,
                max_bytes: 64 << 30,
                max_bytes_per_tenant: 48 << 30,
                max_bytes_per_instance: 48 << 30,
                refused_total: 0,
            },
            transfers: TransfersStatus {
                copies_past_deadline_total: 0,
                pool_window: 4,
                pool_running: 0,
                pool_waiting: 0,
                pool_handed_out_total: 0,
            },
            watched_processes: 0,
            instances_by_death_notice: DeathNoticeCounts {
                timeout_only: 1,
                ..DeathNoticeCounts::default()
            },
            instances: vec![InstanceStatus {
                instance_id: 42,
                module: "server_driven",
                age_seconds: 2.0,
                silence_seconds: 0.5,
                proven: true,
                building: false,
                owner_uid: Some(1000),
                tenant: "uid-1000".into(),
                watched_pid: None,
                death_noticed_by: "timeout_only",
                model_name: "m".into(),
                blend_bytes: 0,
            }],
            instances_omitted: 0,
            trust: TrustStatus {
                forbidden_total: 2,
                bound_instances: 1,
                retrieve_length_mismatches_total: 0,
            },
            tenants: vec![TenantStatusReport {
                name: "uid-1000".into(),
                slots_used: 0,
                quota_slots: 8,
                mapped_bytes: 1 << 20,
                quota_percent: None,
                engine_driven: true,
            }],
            tenants_omitted: 0,
            l2: None,
        }
    }

    #[test]
    fn status_off_loopback_leaves_out_uids_and_pids() {
        let mut report = report();
        report.instances[0].watched_pid = Some(4321);
        let shown = report.without_local_identities().to_json();
        assert_eq!(shown["instances"][0]["owner_uid"], Json::Null, "{shown}");
        assert_eq!(shown["instances"][0]["watched_pid"], Json::Null, "{shown}");
        assert_eq!(shown["instances"][0]["instance_id"], "42", "{shown}");
    }

    #[test]
    fn the_status_op_and_get_status_show_the_same_map() {
        let report = report();
        let mut from_msgpack = msgpack_to_json(&report.to_msgpack());
        let from_http: Json = serde_json::from_slice(&report.to_json_pretty()).unwrap();
        // The same map, but for the ids: integers in MessagePack, strings in JSON.
        assert_eq!(from_msgpack["boot_id"], 7);
        assert_eq!(from_http["boot_id"], "7");
        // `kvwarden status --json` prints the MessagePack map with its ids as strings.
        ids_as_strings(&mut from_msgpack);
        assert_eq!(from_msgpack, from_http);
        assert_eq!(from_http["worker_liveness"]["pings_total"], 3);
        assert_eq!(from_http["gpu"]["available"], false);
        assert_eq!(from_http["gpu"]["reason"], "no CUDA driver");
        assert_eq!(from_http["instances"][0]["instance_id"], "42");
        assert_eq!(from_http["instances"][0]["watched_pid"], Json::Null);
        assert_eq!(from_http["uptime_seconds"], 1.5);
        assert_eq!(from_http["trust"]["forbidden_total"], 2);
        assert_eq!(from_http["tenants"][0]["name"], "uid-1000");
        assert_eq!(from_http["instances"][0]["tenant"], "uid-1000");
    }
}
