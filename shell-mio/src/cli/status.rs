//! `kvwarden status`: the server's status as a readable table, or JSON.

use crate::client::Client;
use crate::server::status::{ids_as_strings, msgpack_to_json};
use serde_json::Value;
use std::process::ExitCode;

/// Flags of `kvwarden status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    endpoint: super::EndpointArgs,
    /// Print the status as JSON: the map `GET /status` serves (ids as strings).
    #[arg(long)]
    json: bool,
}

/// Fetches and prints the status.
pub fn run(args: StatusArgs) -> ExitCode {
    let config = match args.endpoint.client_config() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("kvwarden status: {message}");
            return ExitCode::from(2);
        }
    };
    let status = Client::connect(config).and_then(|client| client.call("status", Vec::new()));
    let status = match status {
        Ok(value) => {
            // The same map as `GET /status`: ids as strings, which jq cannot round.
            let mut json = msgpack_to_json(&value);
            ids_as_strings(&mut json);
            json
        }
        Err(error) => {
            eprintln!("kvwarden status: {}", super::connect_error(&error));
            return ExitCode::from(1);
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&status).unwrap_or_default()
        );
    } else {
        print!("{}", table(&status));
    }
    ExitCode::SUCCESS
}

fn number(value: &Value) -> String {
    match value {
        Value::Number(n) if n.is_f64() => format!("{:.1}", n.as_f64().unwrap_or(0.0)),
        Value::Null => "-".into(),
        other => other.to_string().trim_matches('"').to_string(),
    }
}

/// The status as text: the server's figures, then one line per instance.
pub fn table(status: &Value) -> String {
    let mut out = String::new();
    out += &liveness_lines(status);
    out += &contexts_line(&status["contexts"]);
    out += &l1_line(status);
    out += &l2_line(&status["l2"]);
    out += "\n";
    out += &instances_table(status);
    out
}

/// The server, and the liveness registry's settings and counts.
fn liveness_lines(status: &Value) -> String {
    let live = &status["worker_liveness"];
    let mut out = String::new();
    out += &format!(
        "{} (protocol {}, boot {}), up {} s\n",
        number(&status["server"]),
        number(&status["protocol"]),
        number(&status["boot_id"]),
        number(&status["uptime_seconds"])
    );
    out += &format!(
        "worker liveness: {}, reap timeout {} s, registration grace {} s, resolution {} s\n",
        if live["enabled"].as_bool() == Some(true) {
            "enabled"
        } else {
            "DISABLED"
        },
        number(&live["reap_timeout_seconds"]),
        number(&live["registration_grace_seconds"]),
        number(&live["resolution_seconds"]),
    );
    out += &format!(
        "tracked {}, reaped {}, process exits {}, server stalls {}, pings {} ({} answered \
         false: not held, re-register)\n",
        number(&live["tracked_instances"]),
        number(&live["reaped_total"]),
        number(&live["process_exits_total"]),
        number(&live["stalls_total"]),
        number(&live["pings_total"]),
        number(&live["pings_answered_false_total"]),
    );
    out
}

/// Contexts built and freed, by cause.
fn contexts_line(contexts: &Value) -> String {
    let mut out = String::new();
    // "unregistered 3, reaped 1, ..." in the server's order, zero causes left out.
    let freed = contexts["freed_total"]
        .as_object()
        .map(|causes| {
            let listed: Vec<String> = causes
                .iter()
                .filter(|(_, count)| count.as_u64().is_some_and(|n| n > 0))
                .map(|(cause, count)| format!("{cause} {count}"))
                .collect();
            if listed.is_empty() {
                "none".to_string()
            } else {
                listed.join(", ")
            }
        })
        .unwrap_or_else(|| "?".to_string());
    out += &format!(
        "contexts: built {}, freed ({freed}), frees in flight {}, hung frees {}\n",
        number(&contexts["built_total"]),
        number(&contexts["frees_in_flight"]),
        number(&contexts["frees_hung_total"]),
    );
    out
}

/// L1's slots, by tenant; connections; what trust refused.
fn l1_line(status: &Value) -> String {
    let l1 = &status["l1"];
    let mut out = String::new();
    // "tenants: uid-1000 12/256 slots, team-a 40/128 slots (engine-driven)".
    let tenants: Vec<String> = status["tenants"]
        .as_array()
        .map(|tenants| {
            tenants
                .iter()
                .map(|tenant| {
                    format!(
                        "{} {}/{} slots{}",
                        number(&tenant["name"]),
                        number(&tenant["slots_used"]),
                        number(&tenant["quota_slots"]),
                        if tenant["engine_driven"].as_bool() == Some(true) {
                            " (engine-driven)"
                        } else {
                            ""
                        }
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let trust = &status["trust"];
    out += &format!(
        "L1: {}/{} slots of {} bytes (by tenant, used/quota: {}); connections {}; forbidden \
         {}, retrieves of another length {}\n",
        number(&l1["slots_used"]),
        number(&l1["slots_total"]),
        number(&l1["slot_bytes"]),
        if tenants.is_empty() {
            "none".to_string()
        } else {
            tenants.join(", ")
        },
        number(&status["connections"]),
        number(&trust["forbidden_total"]),
        number(&trust["retrieve_length_mismatches_total"]),
    );
    out
}

/// L2's state and counters, when the server runs with `--l2`.
fn l2_line(l2: &Value) -> String {
    let mut out = String::new();
    if l2.is_object() {
        out += &format!(
            "L2: {} ({}), queue {} bytes, writes {} (dropped {}), hits {}, misses {} (corrupt \
             {}, timeouts {}, errors {})\n",
            number(&l2["state"]),
            l2["nodes"]
                .as_array()
                .map(|nodes| nodes.iter().map(number).collect::<Vec<_>>().join(","))
                .unwrap_or_default(),
            number(&l2["queue_bytes"]),
            number(&l2["writes"]),
            number(&l2["write_drops"]),
            number(&l2["hits"]),
            number(&l2["misses"]),
            number(&l2["corrupt"]),
            number(&l2["timeouts"]),
            number(&l2["errors"]),
        );
    }
    out
}

/// One line per registered instance, under a header.
fn instances_table(status: &Value) -> String {
    let mut out = String::new();
    out += &format!(
        "{:<20} {:<14} {:>9} {:>11} {:>7} {:>7} {:>8} {:<15} {}\n",
        "INSTANCE",
        "MODULE",
        "AGE(s)",
        "SILENCE(s)",
        "PROVEN",
        "OWNER",
        "PID",
        "DEATH_NOTICED",
        "MODEL"
    );
    let empty = Vec::new();
    let instances = status["instances"].as_array().unwrap_or(&empty);
    for item in instances {
        let state = if item["building"].as_bool() == Some(true) {
            " (building)"
        } else {
            ""
        };
        out += &format!(
            "{:<20} {:<14} {:>9} {:>11} {:>7} {:>7} {:>8} {:<15} {}{}\n",
            number(&item["instance_id"]),
            number(&item["module"]),
            number(&item["age_seconds"]),
            number(&item["silence_seconds"]),
            number(&item["proven"]),
            number(&item["owner_uid"]),
            number(&item["watched_pid"]),
            number(&item["death_noticed_by"]),
            number(&item["model_name"]),
            state
        );
    }
    if instances.is_empty() {
        out += "(no instances registered)\n";
    }
    out
}
