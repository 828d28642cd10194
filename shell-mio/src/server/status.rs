//! The status map: `status` op (MessagePack) and `GET /status` (JSON) show the same
//! typed [`StatusReport`] (the core's, which the node fills), serialized by serde for
//! each. The JSON spells the 63-bit ids as strings.

use kvwarden_core::protocol::StatusReport;
use rmpv::Value;
use serde_json::Value as Json;

/// The report as `GET /status` serves it: the 63-bit ids (`boot_id`, each
/// `instance_id`) as strings, since a JSON number above 2^53 is rounded by jq,
/// JavaScript and Grafana (an id copied from them would name another instance). The
/// `status` op's MessagePack keeps them integers.
pub fn to_json_pretty(report: &StatusReport) -> Vec<u8> {
    serde_json::to_vec_pretty(&to_json(report)).unwrap_or_default()
}

/// The JSON of `GET /status` (see [`to_json_pretty`]).
pub fn to_json(report: &StatusReport) -> Json {
    let mut json = serde_json::to_value(report).unwrap_or_default();
    ids_as_strings(&mut json);
    json
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
    use kvwarden_core::protocol::ReplyValue;
    use kvwarden_core::protocol::status::*;

    fn report() -> StatusReport {
        StatusReport {
            server: "kvwarden test".into(),
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
                pool: "anonymous".into(),
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
                module: "server_driven".into(),
                age_seconds: 2.0,
                silence_seconds: 0.5,
                proven: true,
                building: false,
                owner_uid: Some(1000),
                tenant: "uid-1000".into(),
                watched_pid: None,
                death_noticed_by: "timeout_only".into(),
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
        let shown = to_json(&report.without_local_identities());
        assert_eq!(shown["instances"][0]["owner_uid"], Json::Null, "{shown}");
        assert_eq!(shown["instances"][0]["watched_pid"], Json::Null, "{shown}");
        assert_eq!(shown["instances"][0]["instance_id"], "42", "{shown}");
    }

    #[test]
    fn the_status_op_and_get_status_show_the_same_map() {
        let report = report();
        let mut from_msgpack = msgpack_to_json(&report.to_value());
        let from_http: Json = serde_json::from_slice(&to_json_pretty(&report)).unwrap();
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
