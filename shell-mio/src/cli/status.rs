//! `kvwarden status`: the server's status as a readable table, or JSON.

use crate::client::Client;
use crate::server::status::{ids_as_strings, msgpack_to_json};
use kvwarden_core::protocol::status::{ContextsStatus, L2StatusReport};
use kvwarden_core::protocol::{ReplyValue, StatusReport};
use std::fmt::Display;
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
    let value = match Client::connect(config).and_then(|client| client.call("status", Vec::new())) {
        Ok(value) => value,
        Err(error) => {
            eprintln!("kvwarden status: {}", super::connect_error(&error));
            return ExitCode::from(1);
        }
    };
    if args.json {
        // The same map as `GET /status`, as the server sent it: ids as strings, which
        // jq cannot round.
        let mut json = msgpack_to_json(&value);
        ids_as_strings(&mut json);
        println!(
            "{}",
            serde_json::to_string_pretty(&json).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    match StatusReport::from_value(&value) {
        Some(status) => print!("{}", table(&status)),
        None => {
            eprintln!(
                "kvwarden status: the server's status map is not this version's (it says {}); \
                 print it as it is with --json",
                msgpack_to_json(&value)["server"]
            );
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}

/// A figure as the table shows it: seconds with one decimal, `-` for none.
fn seconds(value: f64) -> String {
    format!("{value:.1}")
}

fn or_dash<T: Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".into(), |value| value.to_string())
}

/// The status as text: the server's figures, then one line per instance.
pub fn table(status: &StatusReport) -> String {
    let mut out = String::new();
    out += &liveness_lines(status);
    out += &contexts_line(&status.contexts);
    out += &l1_line(status);
    if let Some(l2) = &status.l2 {
        out += &l2_line(l2);
    }
    out += "\n";
    out += &instances_table(status);
    out
}

/// The server, and the liveness registry's settings and counts.
fn liveness_lines(status: &StatusReport) -> String {
    let live = &status.worker_liveness;
    let mut out = String::new();
    out += &format!(
        "{} (protocol {}, boot {}), up {} s\n",
        status.server,
        status.protocol,
        status.boot_id,
        seconds(status.uptime_seconds)
    );
    out += &format!(
        "worker liveness: {}, reap timeout {} s, registration grace {} s, resolution {} s\n",
        if live.enabled { "enabled" } else { "DISABLED" },
        seconds(live.reap_timeout_seconds),
        seconds(live.registration_grace_seconds),
        seconds(live.resolution_seconds),
    );
    out += &format!(
        "tracked {}, reaped {}, process exits {}, server stalls {}, pings {} ({} answered \
         false: not held, re-register)\n",
        live.tracked_instances,
        live.reaped_total,
        live.process_exits_total,
        live.stalls_total,
        live.pings_total,
        live.pings_answered_false_total,
    );
    out
}

/// Contexts built and freed, by cause.
fn contexts_line(contexts: &ContextsStatus) -> String {
    let freed = &contexts.freed_total;
    // "process_exited 1, reaped 2", by cause's name, zero causes left out.
    let causes = [
        ("cancelled", freed.cancelled),
        ("process_exited", freed.process_exited),
        ("reaped", freed.reaped),
        ("shutdown", freed.shutdown),
        ("unregistered", freed.unregistered),
    ];
    let listed: Vec<String> = causes
        .iter()
        .filter(|(_, count)| *count > 0)
        .map(|(cause, count)| format!("{cause} {count}"))
        .collect();
    let freed = if listed.is_empty() {
        "none".to_string()
    } else {
        listed.join(", ")
    };
    format!(
        "contexts: built {}, freed ({freed}), frees in flight {}, hung frees {}\n",
        contexts.built_total, contexts.frees_in_flight, contexts.frees_hung_total,
    )
}

/// L1's slots, by tenant; connections; what trust refused.
fn l1_line(status: &StatusReport) -> String {
    let l1 = &status.l1;
    // "tenants: uid-1000 12/256 slots, team-a 40/128 slots (engine-driven)".
    let tenants: Vec<String> = status
        .tenants
        .iter()
        .map(|tenant| {
            format!(
                "{} {}/{} slots{}",
                tenant.name,
                tenant.slots_used,
                tenant.quota_slots,
                if tenant.engine_driven {
                    " (engine-driven)"
                } else {
                    ""
                }
            )
        })
        .collect();
    format!(
        "L1: {}/{} slots of {} bytes (by tenant, used/quota: {}); connections {}; forbidden \
         {}, retrieves of another length {}\n",
        l1.slots_used,
        l1.slots_total,
        l1.slot_bytes,
        if tenants.is_empty() {
            "none".to_string()
        } else {
            tenants.join(", ")
        },
        status.connections,
        status.trust.forbidden_total,
        status.trust.retrieve_length_mismatches_total,
    )
}

/// L2's state and counters, when the server runs with `--l2`.
fn l2_line(l2: &L2StatusReport) -> String {
    format!(
        "L2: {} ({}), queue {} bytes, writes {} (dropped {}), hits {}, misses {} (corrupt {}, \
         timeouts {}, errors {})\n",
        l2.state,
        l2.nodes.join(","),
        l2.counters.queue_bytes,
        l2.counters.writes,
        l2.counters.write_drops,
        l2.counters.hits,
        l2.counters.misses,
        l2.counters.corrupt,
        l2.counters.timeouts,
        l2.counters.errors,
    )
}

/// One line per registered instance, under a header.
fn instances_table(status: &StatusReport) -> String {
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
    for item in &status.instances {
        out += &format!(
            "{:<20} {:<14} {:>9} {:>11} {:>7} {:>7} {:>8} {:<15} {}{}\n",
            item.instance_id,
            item.module,
            seconds(item.age_seconds),
            seconds(item.silence_seconds),
            item.proven,
            or_dash(item.owner_uid),
            or_dash(item.watched_pid),
            item.death_noticed_by,
            item.model_name,
            if item.building { " (building)" } else { "" }
        );
    }
    if status.instances.is_empty() {
        out += "(no instances registered)\n";
    }
    out
}
