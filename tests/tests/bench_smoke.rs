//! `kvwarden bench` smoke: every figure runs in a tiny configuration, exits 0 and prints
//! its lines in the stable `ID name value unit (note)` form. Figures are never checked
//! against their targets here (shared CI machines are noisy); `docs/benchmarks.md`
//! holds the measured runs.

use kvwarden_tests::kvwarden_bin;
use std::process::Command;

/// Runs `kvwarden bench <args>` and returns its stdout, which must hold a line starting
/// with each of `figures`.
fn bench(args: &[&str], figures: &[&str]) -> String {
    let output = Command::new(kvwarden_bin())
        .arg("bench")
        .args(args)
        .output()
        .expect("running kvwarden bench");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvwarden bench {args:?} exited with {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    for figure in figures {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{figure} ")))
            .unwrap_or_else(|| panic!("no `{figure}` line in:\n{stdout}\nstderr:\n{stderr}"));
        // `ID name value unit (note)`.
        let fields: Vec<&str> = line.splitn(5, ' ').collect();
        assert_eq!(fields.len(), 5, "not `ID name value unit (note)`: {line:?}");
        assert!(
            line.ends_with(')'),
            "the note is not in parentheses: {line:?}"
        );
    }
    stdout
}

/// `kvwarden bench ping` in its smoke configuration.
const PING_SMOKE: &[&str] = &[
    "ping",
    "--connections",
    "4",
    "--seconds",
    "0.2",
    "--rounds",
    "1",
];
/// The S1 lines `bench ping` prints with or without Redis.
const PING_FIGURES: &[&str] = &["S1 kvwarden_ping_throughput", "S1 ratio_vs_redis"];

#[test]
fn bench_ping_prints_throughput_and_says_when_redis_is_skipped() {
    let out = bench(&[PING_SMOKE, &["--no-redis"]].concat(), PING_FIGURES);
    assert!(out.contains("S1 ratio_vs_redis skipped"), "{out}");
}

#[test]
fn bench_ping_compares_with_redis_where_it_is_installed() {
    let out = bench(PING_SMOKE, PING_FIGURES);
    // CI machines may lack redis-server/redis-benchmark: then it says it skipped.
    if !out.contains("S1 ratio_vs_redis skipped") {
        for figure in [
            "S1 redis_ping_throughput ",
            "S1 redis_ping_throughput_same_generator ",
        ] {
            assert!(out.contains(figure), "no `{figure}` in:\n{out}");
        }
    }
}

#[test]
fn bench_latency_and_slow_contexts_print_percentiles() {
    bench(
        &[
            "latency",
            "--workers",
            "20",
            "--interval-ms",
            "20",
            "--seconds",
            "0.3",
        ],
        &[
            "S2 ping_round_trip_p50",
            "S2 ping_round_trip_p99",
            "S2 ping_round_trip_p999",
        ],
    );
    bench(
        &[
            "slow-contexts",
            "--workers",
            "20",
            "--interval-ms",
            "20",
            "--seconds",
            "0.5",
            "--build-delay-ms",
            "20",
            "--hung-frees",
            "2",
            "--churners",
            "2",
        ],
        &["S3 ping_round_trip_p99", "S3 registrations_during_run"],
    );
}

#[test]
fn bench_kill_and_reap_measure_frees() {
    bench(
        &["kill", "--kills", "3"],
        &["S4 sigkill_to_free_p50", "S4 sigkill_to_free_p99"],
    );
    bench(
        &[
            "reap",
            "--samples",
            "2",
            "--reap-timeout-seconds",
            "1",
            "--resolution-seconds",
            "0.1",
        ],
        &[
            "S5 reap_after_last_evidence_max",
            "S5 reap_lateness_past_t_max",
        ],
    );
}

#[test]
fn bench_copy_memory_and_connections_print_their_figures() {
    bench(
        &[
            "copy",
            "--seconds",
            "0.1",
            "--buffer-bytes",
            "8M",
            "--l1-bytes",
            "16M",
        ],
        &["S6 store_retrieve_bandwidth", "S6 ratio_vs_memcpy"],
    );
    bench(
        &[
            "batch",
            "--seconds",
            "0.1",
            "--blocks",
            "8",
            "--block-bytes",
            "64K",
            "--l1-bytes",
            "8M",
        ],
        &[
            "B1 store_batch_8",
            "B1 store_single_8",
            "B1 store_batch_speedup",
            "B1 retrieve_batch_8",
            "B1 retrieve_single_8",
            "B1 retrieve_batch_speedup",
        ],
    );
    bench(
        &["memory", "--instances", "200"],
        &["S7 server_rss_with_instances", "S7 rss_per_instance"],
    );
    let out = bench(
        &["connections", "50", "--seconds", "0.5"],
        &[
            "R5 connections_held",
            "R5 slow_peer_disconnected",
            "R5 server_rss_after_close",
        ],
    );
    assert!(out.contains("R5 slow_peer_disconnected yes"), "{out}");
}

#[test]
fn bench_kill_with_the_server_in_its_own_pid_namespace_frees_by_the_workers_pidfd() {
    if let Some(reason) = kvwarden_tests::pid_namespace_unavailable() {
        println!("SKIPPED bench kill --server-pid-namespace: {reason}");
        return;
    }
    let out = bench(
        &["kill", "--kills", "2", "--server-pid-namespace"],
        &[
            "S4 sigkill_to_free_p99",
            "S4 control_without_pidfd_held_at_least",
        ],
    );
    assert!(out.contains("(2 proofs counted)"), "{out}");
}

#[test]
fn bench_l2_prints_l1_to_l4_against_a_cluster_it_starts() {
    // A debug build reads a 2 MiB value slowly: a timeout that fits it.
    bench(
        &["l2", "--smoke", "--l2-timeout-ms", "2000"],
        &[
            "L1 cross_node_retrieve_p50",
            "L1 ratio_vs_get",
            "L2 write_behind_256k_c1",
            "L2 read_through_2048k_c2",
            "L2 batch_read_through_256k_c2",
            "L2 ratio_read_through_2048k_c1",
            "L2 ratio_write_behind_256k_c2",
            "L2 ratio_batch_2048k_c2",
            "L2 hit_rate_held_256k_c1",
            "L2 hit_rate_held_2048k_c2",
            "L3 ping_p99",
            "L3 reaped",
            "L4 resumed_after_master_kill",
            "L4 corrupt_served",
        ],
    );
}

#[test]
fn bench_floods_prints_the_victims_latency_under_each_flood() {
    // The tests run as root: the copy flood (uid 1001) runs too.
    bench(
        &["floods", "--probes", "3", "--hold", "10"],
        &[
            "F1 tcp_flood_victim_p50_ratio",
            "F1 http_flood_victim_p50_ratio",
            "F1 copy_flood_victim_p50_ratio",
        ],
    );
}

#[test]
fn bench_restart_prints_what_a_restarted_server_adopts() {
    let stdout = bench(
        &["restart", "--smoke"],
        &[
            "W1 adopted_over_stored",
            "W1 seconds_to_ready",
            "W1 seconds_to_adopted",
            "W1 adoption_gb_per_s",
            "W1 sequential_read_gb_per_s",
            "W1 ratio_adoption_over_read",
            "W1 store_sealed_over_anonymous",
            "W1 adopted_chunks_identical",
        ],
    );
    // Not a speed check: every chunk stored before the SIGKILL is adopted.
    assert!(
        stdout.contains("W1 adopted_over_stored 1.0000 x"),
        "{stdout}"
    );
}

#[test]
fn bench_events_prints_what_kv_events_cost_and_how_late_they_come() {
    bench(
        &["events", "--smoke"],
        &[
            "E1 changes_per_second",
            "E1 server_cpu_with_reader_over_without",
            "E1 store_to_change_p50",
            "E1 store_to_change_p99",
            "E1 record_share_of_a_store",
            "E1 server_gone_known_after",
        ],
    );
}

#[test]
fn bench_stream_prints_what_the_servers_own_stream_costs_and_how_late_it_comes() {
    bench(
        &["stream", "--smoke"],
        &[
            "E2 events_per_second",
            "E2 server_cpu_with_stream_over_without",
            "E2 describe_to_stored_p50",
            "E2 describe_to_stored_p99",
            "E2 eviction_to_removed_p99",
        ],
    );
}
