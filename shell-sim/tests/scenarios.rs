//! Every scenario file of `scenarios/` passes: one test per failure-mode row, named for
//! the behaviour it proves, and a guard that no file goes untested.

use kvwarden_sim::cli::run_scenario;
use kvwarden_sim::scenario;
use std::path::PathBuf;

fn scenarios_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

fn assert_passes(file: &str) {
    let path = scenarios_dir().join(file);
    let scenario = scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let outcome = run_scenario(&scenario, true);
    if let Some((class, lines)) = &outcome.failure {
        panic!(
            "{file} failed [{}]:\n{}\ntimeline:\n{}",
            class.label(),
            lines.join("\n"),
            outcome.timeline.join("\n")
        );
    }
}

macro_rules! scenario_tests {
    ($($name:ident => $file:literal,)*) => {
        $(
            #[test]
            fn $name() {
                assert_passes($file);
            }
        )*

        const FILES: &[&str] = &[$($file),*];
    };
}

scenario_tests! {
    row_01_same_host_sigkill_is_freed_within_100_ms_by_the_exit_proof => "01-sigkill-same-host.toml",
    row_02_invisible_sigkill_is_reaped_at_timeout_plus_at_most_resolution => "02-sigkill-not-visible.toml",
    row_03_death_during_warm_up_is_freed_on_exit_or_reaped_at_grace => "03-death-during-warm-up.toml",
    row_04_live_heartbeat_without_traffic_is_never_reaped => "04-live-heartbeat-no-traffic.toml",
    row_04_wall_clock_steps_are_ignored => "04-clock-steps-ignored.toml",
    row_05_starved_heartbeat_with_transfers_is_never_reaped => "05-heartbeat-starved-while-transferring.toml",
    row_06_never_started_heartbeat_is_reaped_at_grace_and_re_registers_once => "06-heartbeat-never-started-idle-past-grace.toml",
    row_07_partition_shorter_than_timeout_builds_nothing => "07-partition-shorter-than-timeout.toml",
    row_07_one_way_partitions_shorter_than_timeout_are_not_reaped => "07-one-way-partitions.toml",
    row_08_partition_longer_than_timeout_rebuilds_one_context => "08-partition-longer-than-timeout.toml",
    row_09_frozen_longer_than_timeout_is_reaped_and_re_registers_on_thaw => "09-frozen-longer-than-timeout.toml",
    row_10_restart_gets_a_fresh_id_and_the_old_entry_is_freed => "10-crash-and-restart-fresh-id.toml",
    row_11_server_restart_leaves_exactly_one_context_per_worker => "11-server-restart.toml",
    row_12_server_pause_longer_than_timeout_reaps_nobody => "12-server-paused-longer-than-timeout.toml",
    row_13_legacy_ping_is_answered_bad_args_and_stays_unhealthy => "13-mixed-version-ping.toml",
    row_14_unregister_of_a_freed_instance_answers_false_and_does_nothing => "14-unregister-unknown-instance.toml",
    row_15_register_of_a_present_instance_refreshes_without_building => "15-register-already-present.toml",
    row_15_register_while_building_waits_for_the_build_outcome => "15-register-while-building.toml",
    row_16_reap_racing_builds_and_copies_frees_once_at_the_right_time => "16-reap-racing-build-and-copy.toml",
    row_17_reaping_disabled_reaps_nothing_but_exit_proof_still_frees => "17-reaping-disabled.toml",
    row_18_clean_shutdown_leaves_no_ghost_and_stopped_heartbeat_never_recovers => "18-clean-worker-shutdown.toml",
    row_19_server_shutdown_frees_every_context_exactly_once => "19-clean-server-shutdown.toml",
    row_20_hung_free_is_reported_and_the_loop_keeps_serving => "20-free-hangs.toml",
    row_20_a_server_pause_is_not_counted_as_a_free_hanging => "20-free-across-a-server-pause.toml",
    row_21_freed_engine_driven_instance_discards_reservations_and_pins => "21-engine-driven-reservation-freed.toml",
    row_23_other_uid_is_forbidden_and_the_instance_untouched => "23-other-uid-forbidden.toml",
    row_24_garbage_bytes_are_answered_and_break_nothing => "24-garbage-bytes.toml",
    row_25_stalled_request_loop_reaps_no_live_worker => "25-request-loop-stops-turning.toml",
    row_26_an_instance_with_both_modules_is_reaped_whole_and_its_next_ping_answers_false => "26-instance-lives-and-dies-whole.toml",
    row_27_l2_down_partitioned_or_slow_delays_no_ping_and_reaps_no_one => "27-l2-down-pings-unaffected.toml",
    row_28_a_corrupt_l2_value_is_a_miss_never_served => "28-l2-corrupt-values.toml",
    row_29_only_published_data_reaches_l2_when_a_worker_dies_mid_store => "29-worker-killed-with-reservation-l2.toml",
    row_30_a_same_uid_impostor_naming_an_instance_is_forbidden_and_refreshes_nothing => "30-same-uid-impostor-forbidden.toml",
    row_31_a_wrong_secret_is_forbidden_and_a_squatted_id_costs_the_victim_nothing => "31-wrong-secret-and-squatted-id.toml",
    row_32_a_tcp_peer_without_the_token_is_forbidden_everything => "32-tcp-peer-without-token.toml",
    row_33_another_tenants_reads_miss_and_its_stores_never_reach_the_victim => "33-other-tenant-keys-apart.toml",
    row_33_tenants_stay_apart_through_l2_read_through => "33-other-tenant-keys-apart-l2.toml",
    row_71_a_restarted_server_adopts_its_sealed_pool_and_drops_what_was_torn => "71-restart-keeps-the-pool.toml",
    row_71_a_store_during_the_scan_takes_a_slot_and_its_old_value_is_not_adopted => "71-store-during-the-scan.toml",
}

#[test]
fn every_scenario_file_has_a_test_named_for_its_row() {
    let mut on_disk: Vec<String> = std::fs::read_dir(scenarios_dir())
        .expect("scenarios/ exists")
        .map(|entry| {
            entry
                .expect("readable")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".toml"))
        .collect();
    on_disk.sort();
    let mut tested: Vec<String> = FILES.iter().map(|s| s.to_string()).collect();
    tested.sort();
    assert_eq!(on_disk, tested, "add a test for each scenario file");
    for name in &on_disk {
        let row: String = name.chars().take(2).collect();
        assert!(
            row.parse::<u32>().is_ok_and(|n| (1..=73).contains(&n)),
            "{name} must start with its row number"
        );
    }
}
