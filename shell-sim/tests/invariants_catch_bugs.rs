//! The checker is not a rubber stamp: deliberately wrong expectations fail, and bugs
//! planted in the real node (`kvwarden_core::node::PlantedBug`, through this crate's
//! test-only feature `planted-bugs`) or injected into the simulated shell and workers
//! are caught by the right invariant with the right exit-code class.

use kvwarden_sim::cli::{run_files, run_scenario};
use kvwarden_sim::scenario::{self, ScenarioError};
use kvwarden_sim::violation::Class;
use kvwarden_sim::world::run_config;
use std::path::Path;

fn scenario_text(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(file);
    std::fs::read_to_string(path).expect("scenario file exists")
}

/// Runs a scenario given as text; returns the failure class and lines, if any.
fn outcome(text: &str) -> Option<(Class, Vec<String>)> {
    let scenario =
        scenario::parse(Path::new("inline.toml"), text).unwrap_or_else(|e| panic!("{e}"));
    run_scenario(&scenario, false).failure
}

/// Runs a scenario with a bug injected; returns the violated invariant and its class.
fn violation_with_bug(file: &str, bug: &str) -> (Class, &'static str, String) {
    let text = format!("inject_bug = \"{bug}\"\n{}", scenario_text(file));
    let scenario = scenario::parse(Path::new(file), &text).unwrap_or_else(|e| panic!("{e}"));
    let report = run_config(scenario.config, Vec::new(), false);
    let violation = report
        .violation
        .unwrap_or_else(|| panic!("bug {bug} in {file} went unnoticed"));
    (violation.class, violation.invariant, violation.detail)
}

#[test]
fn a_reap_expected_in_the_wrong_window_fails_as_liveness() {
    let text = scenario_text("08-partition-longer-than-timeout.toml").replace(
        "between_seconds = [140, 151]",
        "between_seconds = [200, 210]",
    );
    let (class, lines) = outcome(&text).expect("the wrong window must fail");
    assert_eq!(class, Class::Safety, "{lines:?}"); // it happened before the window: early
    let text = scenario_text("08-partition-longer-than-timeout.toml").replace(
        "between_seconds = [140, 151]",
        "between_seconds = [100, 110]",
    );
    let (class, lines) = outcome(&text).expect("the wrong window must fail");
    assert_eq!(class, Class::Liveness, "{lines:?}");
    assert!(
        lines[0].contains("not reaped between 100.000s and 110.000s"),
        "{lines:?}"
    );
}

#[test]
fn not_reaped_for_a_worker_that_is_reaped_fails_as_safety() {
    let text = scenario_text("08-partition-longer-than-timeout.toml").replace(
        "kind = \"not_reaped\"\nworker = \"w0\"",
        "kind = \"not_reaped\"\nworker = \"w1\"",
    );
    let (class, lines) = outcome(&text).expect("w1 is reaped, so not_reaped must fail");
    assert_eq!(class, Class::Safety);
    // Reaped at the end of its deadline's tick (ticks are 2^29 ns: the largest power of
    // two of nanoseconds within R = 1 s).
    assert!(lines[0].contains("w1 was reaped at 140.123s"), "{lines:?}");
}

#[test]
fn a_wrong_context_count_fails_in_both_directions() {
    let base = scenario_text("08-partition-longer-than-timeout.toml");
    let more = base.replace(
        "kind = \"contexts\"\ncount = 2",
        "kind = \"contexts\"\ncount = 1",
    );
    assert_eq!(outcome(&more).map(|o| o.0), Some(Class::Safety));
    let fewer = base.replace(
        "kind = \"contexts\"\ncount = 2",
        "kind = \"contexts\"\ncount = 3",
    );
    assert_eq!(outcome(&fewer).map(|o| o.0), Some(Class::Liveness));
    assert_eq!(outcome(&base), None);
}

#[test]
fn a_server_loop_that_skips_handle_timeout_is_a_liveness_violation() {
    let (class, invariant, detail) =
        violation_with_bug("02-sigkill-not-visible.toml", "skip_handle_timeout");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "spurious_stall"),
        "{detail}"
    );
    assert_eq!(class.exit_code(), 128);
}

#[test]
fn freeing_a_context_twice_is_a_safety_violation() {
    let (class, invariant, detail) = violation_with_bug("01-sigkill-same-host.toml", "double_free");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "double_free"),
        "{detail}"
    );
    assert_eq!(class.exit_code(), 129);
}

#[test]
fn blend_state_kept_after_its_instance_went_is_a_safety_violation() {
    let text = r#"
inject_bug = "keep_blend_state"
name = "blend-leak"
duration_seconds = 100
[[workers]]
blend = true
same_host = true
[[events]]
at_seconds = 30
action = "crash"
workers = ["w0"]
"#;
    let scenario = scenario::parse(Path::new("blend.toml"), text).unwrap();
    let violation = run_config(scenario.config, Vec::new(), false)
        .violation
        .expect("caught");
    assert_eq!(
        (violation.class, violation.invariant),
        (Class::Safety, "blend_without_entry")
    );
}

#[test]
fn pins_kept_after_their_context_was_freed_are_a_safety_violation() {
    let (class, invariant, detail) =
        violation_with_bug("21-engine-driven-reservation-freed.toml", "keep_pins");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "pin_of_freed_instance"),
        "{detail}"
    );
}

#[test]
fn ignoring_pings_reaps_a_live_worker_and_is_caught() {
    // The node answers the ping `true` without refreshing the entry: the reference
    // model, refreshed by that ping, sees the reap come before the window ends.
    let (class, invariant, detail) =
        violation_with_bug("13-mixed-version-ping.toml", "ignore_pings");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "reaped_early"),
        "{detail}"
    );
}

#[test]
fn a_node_that_frees_while_a_copy_runs_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("16-reap-racing-build-and-copy.toml", "free_during_copy");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "free_during_copy"),
        "{detail}"
    );
}

#[test]
fn a_node_that_never_starts_a_free_leaks_and_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("01-sigkill-same-host.toml", "leak_on_free");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "context_leaked"),
        "{detail}"
    );
    assert_eq!(class.exit_code(), 128);
}

#[test]
fn a_node_that_never_reaps_spins_and_is_caught() {
    // Its registry is never told the time, so its wake stays in the past: the loop
    // spins at one instant.
    let (class, invariant, detail) = violation_with_bug("02-sigkill-not-visible.toml", "skip_reap");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "livelock"),
        "{detail}"
    );
}

#[test]
fn a_node_that_ignores_a_proven_exit_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("01-sigkill-same-host.toml", "ignore_process_exit");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "exit_ignored"),
        "{detail}"
    );
}

#[test]
fn a_node_that_stops_without_freeing_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("19-clean-server-shutdown.toml", "shutdown_leaks");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "not_freed_at_shutdown"),
        "{detail}"
    );
}

#[test]
fn a_node_that_drops_a_built_context_diverges_from_the_reference() {
    let (class, invariant, detail) =
        violation_with_bug("01-sigkill-same-host.toml", "drop_built_context");
    assert_eq!(
        (class, invariant),
        (Class::Internal, "core_diverged"),
        "{detail}"
    );
}

#[test]
fn a_node_that_writes_an_unpublished_reservation_to_l2_is_caught() {
    let (class, invariant, detail) = violation_with_bug(
        "29-worker-killed-with-reservation-l2.toml",
        "write_unpublished",
    );
    assert_eq!(
        (class, invariant),
        (Class::Safety, "l2_unpublished"),
        "{detail}"
    );
    assert_eq!(class.exit_code(), 129);
}

#[test]
fn a_node_that_serves_a_corrupt_l2_value_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("28-l2-corrupt-values.toml", "serve_corrupt");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "l2_corrupt_served"),
        "{detail}"
    );
}

#[test]
fn a_node_whose_ping_waits_with_l2_on_is_caught() {
    let (class, invariant, detail) =
        violation_with_bug("27-l2-down-pings-unaffected.toml", "ping_waits_for_l2");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "ping_waited_for_l2"),
        "{detail}"
    );
}

#[test]
fn a_node_that_trusts_any_connection_serves_the_impostor_and_is_caught() {
    // Row 30: the same-uid impostor's ping of w0's instance, from a connection that
    // never attached it, is answered (and refreshes w0) instead of `forbidden`.
    let (class, invariant, detail) = violation_with_bug(
        "30-same-uid-impostor-forbidden.toml",
        "trust_any_connection",
    );
    assert_eq!(
        (class, invariant),
        (Class::Safety, "non_owner_served"),
        "{detail}"
    );
    assert!(detail.contains("not `forbidden`"), "{detail}");
}

#[test]
fn a_node_that_trusts_any_connection_is_caught_on_tcp_too() {
    // Row 32: the authenticated TCP peer attached nothing, yet its requests naming the
    // workers' instances are served.
    let (class, invariant, detail) =
        violation_with_bug("32-tcp-peer-without-token.toml", "trust_any_connection");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "non_owner_served"),
        "{detail}"
    );
}

#[test]
fn a_node_with_one_keyspace_for_every_tenant_reveals_chunks_and_is_caught() {
    // Row 33: the other tenant's retrieve of a key only the victims' tenant stored is
    // answered with their bytes (or a victim reads the poacher's).
    let (class, invariant, detail) =
        violation_with_bug("33-other-tenant-keys-apart.toml", "shared_keyspace");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "non_owner_served"),
        "{detail}"
    );
    assert!(detail.contains("never stored"), "{detail}");
}

#[test]
fn an_l2_fault_without_l2_is_a_bad_scenario() {
    let text = "name = \"x\"\nduration_seconds = 10\n[[workers]]\n[[events]]\nat_seconds = 1\naction = \"l2_down\"\n";
    let error = scenario::parse(Path::new("l2.toml"), text).expect_err("no [l2]");
    let message = error.to_string();
    assert!(message.contains("l2.toml"), "{message}");
    assert!(message.contains("events[0].action"), "{message}");
    assert!(message.contains("l2_down"), "{message}");
    let text = "name = \"x\"\nduration_seconds = 10\n[l2]\ntimeout_ms = -3\n[[workers]]\n";
    let message = scenario::parse(Path::new("l2.toml"), text)
        .expect_err("bad timeout")
        .to_string();
    assert!(
        message.contains("l2.timeout_ms") && message.contains("-3"),
        "{message}"
    );
}

#[test]
fn keep_reservations_is_keep_pins() {
    let (class, invariant, detail) = violation_with_bug(
        "21-engine-driven-reservation-freed.toml",
        "keep_reservations",
    );
    assert_eq!(
        (class, invariant),
        (Class::Safety, "pin_of_freed_instance"),
        "{detail}"
    );
}

#[test]
fn a_loop_that_wakes_late_reaps_late_and_is_a_liveness_violation() {
    let (class, invariant, detail) = violation_with_bug("02-sigkill-not-visible.toml", "late_wake");
    assert_eq!(
        (class, invariant),
        (Class::Liveness, "reap_late"),
        "{detail}"
    );
}

/// w1 dies at 55 s (last ping about 50.01 s); a chatty w0 keeps the loop busy. The wall
/// clock steps 4 s forward at 168.5 s, under the stall threshold.
const WALL_STEP: &str = r#"
name = "wall-clock-step"
duration_seconds = 300
[[workers]]
same_host = false
heartbeat_interval_seconds = 0.5
[[workers]]
same_host = false
[[events]]
at_seconds = 55
action = "crash"
workers = ["w1"]
[[events]]
at_seconds = 168.5
action = "clock_step"
step_seconds = 4
[[expect]]
kind = "reaped"
worker = "w1"
between_seconds = [170, 171.1]
"#;

#[test]
fn a_shell_feeding_the_core_the_wall_clock_reaps_early_on_a_step() {
    assert_eq!(
        outcome(WALL_STEP),
        None,
        "the monotonic clock ignores the step"
    );
    let text = format!("inject_bug = \"wall_clock\"\n{WALL_STEP}");
    let scenario = scenario::parse(Path::new("wall.toml"), &text).unwrap();
    let violation = run_config(scenario.config, Vec::new(), false)
        .violation
        .expect("caught");
    assert_eq!(
        (violation.class, violation.invariant),
        (Class::Safety, "reaped_early"),
        "{}",
        violation.detail
    );
}

#[test]
fn a_register_after_the_clean_shutdown_is_a_ghost() {
    let (class, invariant, detail) =
        violation_with_bug("18-clean-worker-shutdown.toml", "register_after_unregister");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "ghost_context"),
        "{detail}"
    );
}

#[test]
fn a_panic_in_the_shell_is_exit_code_127() {
    let (class, invariant, _) = violation_with_bug("02-sigkill-not-visible.toml", "panic");
    assert_eq!((class, invariant), (Class::Internal, "panic"));
    assert_eq!(class.exit_code(), 127);
}

/// A worker thawed just before its deadline pings while the server is briefly paused
/// (shorter than the stall threshold, so nothing is credited). The ping is queued; the
/// server must read it before judging deadlines on resume.
const QUEUED_PING: &str = r#"
name = "queued-ping-before-deadline"
duration_seconds = 300
[[workers]]
same_host = false
[[workers]]
same_host = false
heartbeat_interval_seconds = 1
[[events]]
at_seconds = 25
action = "freeze"
workers = ["w0"]
until_seconds = 139
[[events]]
at_seconds = 138
action = "server_pause"
until_seconds = 141.5
[[expect]]
kind = "not_reaped"
"#;

#[test]
fn queued_pings_are_read_before_deadlines_are_judged() {
    assert_eq!(outcome(QUEUED_PING), None);
    let text = format!("inject_bug = \"timeout_before_input\"\n{QUEUED_PING}");
    let scenario = scenario::parse(Path::new("queued.toml"), &text).unwrap();
    let violation = run_config(scenario.config, Vec::new(), false)
        .violation
        .expect("caught");
    assert_eq!(
        (violation.class, violation.invariant),
        (Class::Safety, "live_worker_reaped"),
        "{}",
        violation.detail
    );
}

#[test]
fn a_bad_scenario_names_the_file_the_field_and_the_value() {
    let text = scenario_text("08-partition-longer-than-timeout.toml")
        .replace("workers = [\"w1\"]", "workers = [\"w9\"]");
    let error = scenario::parse(Path::new("bad.toml"), &text).unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, ScenarioError::Field { .. }), "{message}");
    assert!(
        message.contains("bad.toml")
            && message.contains("events[0].workers")
            && message.contains("w9"),
        "{message}"
    );

    let typo = scenario_text("02-sigkill-not-visible.toml").replace("same_host", "same_hots");
    let message = scenario::parse(Path::new("typo.toml"), &typo)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("typo.toml") && message.contains("same_hots"),
        "{message}"
    );

    let short =
        "name = \"x\"\nduration_seconds = 10\n[server]\nreap_timeout_seconds = 10\n[[workers]]\n";
    let message = scenario::parse(Path::new("short.toml"), short)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("reap timeout") && message.contains("10"),
        "{message}"
    );
}

#[test]
fn the_cli_exits_2_on_a_bad_file_and_with_the_class_on_a_failing_one() {
    let dir = std::env::temp_dir().join(format!("kvwarden-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "name = 1").unwrap();
    assert_eq!(run_files(&[bad], false), 2);
    let failing = dir.join("failing.toml");
    let text = scenario_text("08-partition-longer-than-timeout.toml").replace(
        "between_seconds = [140, 151]",
        "between_seconds = [100, 110]",
    );
    std::fs::write(&failing, text).unwrap();
    assert_eq!(run_files(&[failing], false), 128);
    let good = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios/08-partition-longer-than-timeout.toml");
    assert_eq!(run_files(&[good], false), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn answering_refreshed_while_building_leaves_a_worker_without_a_module() {
    let text = format!(
        "inject_bug = \"refresh_while_building\"\n{}",
        scenario_text("15-register-while-building.toml")
    );
    let (class, lines) = outcome(&text).expect("the worker must end without one module");
    assert_eq!(class, Class::Liveness);
    assert!(lines[0].contains("one per module: false"), "{lines:?}");
}

// Row 26: the checker itself, driven the way a server that judged each module's entry
// on its own (the reference design) would drive it.

mod row_26 {
    use kvwarden_core::{FreeCause, InstanceId, Module, TransferError};
    use kvwarden_sim::invariants::{Checker, ShellView};
    use kvwarden_sim::time::{Nanos, SECOND};
    use kvwarden_sim::violation::Class;
    use std::collections::BTreeSet;
    use std::time::Duration;

    const SD: Module = Module::ServerDriven;
    const ED: Module = Module::EngineDriven;

    /// T = 30 s, G = 60 s, R = 1 s; one instance registered and built in both modules.
    fn checker_with_both_modules(id: InstanceId) -> Checker {
        let mut checker = Checker::new(0, 30 * SECOND, 60 * SECOND, SECOND, 5 * SECOND);
        checker.register(0, (id, SD), Some(1));
        checker.built(0, (id, SD), 1, 0);
        checker.register(0, (id, ED), Some(2));
        checker.built(0, (id, ED), 2, 1);
        checker
    }

    /// Inputs every 2 s up to `to`, as a loop that honours its wakes.
    fn tick_until(checker: &mut Checker, from: Nanos, to: Nanos) {
        let mut now = from;
        while now < to {
            now = (now + 2 * SECOND).min(to);
            checker.handle_timeout(now);
        }
    }

    fn end_step(checker: &mut Checker) {
        let blend = BTreeSet::new();
        checker.end_step(&ShellView {
            blend: &blend,
            l1_held: 0,
            l1_explained: 0,
        });
    }

    fn reaped(silence_s: u64) -> FreeCause {
        FreeCause::Reaped {
            silence: Duration::from_secs(silence_s),
            proven: true,
        }
    }

    #[test]
    fn a_reap_that_leaves_a_sibling_entry_held_is_reaped_in_part() {
        let id = InstanceId::new(5).unwrap();
        let mut checker = checker_with_both_modules(id);
        checker.ping(0, id, true);
        tick_until(&mut checker, 0, 31 * SECOND);
        checker.free_requested((id, SD), 0, reaped(31));
        checker.reaped(1, vec![((id, SD), Some((31 * SECOND, true)), false)]);
        end_step(&mut checker);
        let violation = checker.violation.expect("a reap in part is caught");
        assert_eq!(
            (violation.class, violation.invariant),
            (Class::Safety, "reaped_in_part")
        );
    }

    #[test]
    fn a_reap_of_the_whole_instance_in_one_turn_is_no_violation() {
        let id = InstanceId::new(6).unwrap();
        let mut checker = checker_with_both_modules(id);
        checker.ping(0, id, true);
        tick_until(&mut checker, 0, 31 * SECOND);
        checker.free_requested((id, SD), 0, reaped(31));
        checker.reaped(1, vec![((id, SD), Some((31 * SECOND, true)), false)]);
        checker.free_requested((id, ED), 1, reaped(31));
        checker.reaped(1, vec![((id, ED), Some((31 * SECOND, true)), false)]);
        end_step(&mut checker);
        checker.ping(31 * SECOND, id, false);
        assert!(checker.violation.is_none(), "{:?}", checker.violation);
    }

    #[test]
    fn a_ping_answered_true_while_a_registration_is_gone_is_ping_true_for_part() {
        let id = InstanceId::new(7).unwrap();
        let mut checker = checker_with_both_modules(id);
        checker.ping(0, id, true);
        tick_until(&mut checker, 0, 31 * SECOND);
        // One module's entry goes, the worker is not told, and its next ping says true.
        checker.free_requested((id, ED), 1, reaped(31));
        checker.reaped(1, vec![((id, ED), Some((31 * SECOND, true)), false)]);
        checker.ping(31 * SECOND, id, true);
        let violation = checker.violation.expect("a true ping for half an instance");
        assert_eq!(
            (violation.class, violation.invariant),
            (Class::Safety, "ping_true_for_part")
        );
    }

    #[test]
    fn a_ping_answered_true_after_the_worker_was_told_or_unregistered_is_no_violation() {
        let id = InstanceId::new(8).unwrap();
        let mut checker = checker_with_both_modules(id);
        checker.ping(0, id, true);
        // Unregistered by the worker itself: it no longer counts on that module.
        checker.unregister(SECOND, (id, ED), true, false);
        checker.free_requested((id, ED), 1, FreeCause::Unregistered);
        end_step(&mut checker);
        checker.ping(2 * SECOND, id, true);
        // A failed build is answered as a failure.
        checker.register(3 * SECOND, (id, ED), Some(3));
        checker.build_failed(3 * SECOND, (id, ED), 3);
        end_step(&mut checker);
        checker.ping(4 * SECOND, id, true);
        // A transfer answered not_registered tells the worker too.
        checker.transfer(5 * SECOND, (id, ED), Err(TransferError::NotRegistered));
        checker.ping(6 * SECOND, id, true);
        assert!(checker.violation.is_none(), "{:?}", checker.violation);
    }
}

// Rows 30–33: the trust rules' reference model, driven the way a node that let a
// non-owner through would drive it.

mod who_is_who {
    use kvwarden_core::InstanceId;
    use kvwarden_core::protocol::Op;
    use kvwarden_core::protocol::{Answer, Attached, HelloReply};
    use kvwarden_sim::invariants::{AttachExpect, Checker, TenantRead, Verdict, prefix_of};
    use kvwarden_sim::time::SECOND;
    use kvwarden_sim::violation::Class;

    fn checker() -> Checker {
        let mut checker = Checker::new(0, 30 * SECOND, 60 * SECOND, SECOND, 5 * SECOND);
        checker.set_trust(1000, Some(b"0123456789abcdef-token".to_vec()));
        checker
    }

    fn outcome(label: &str) -> Result<Answer, kvwarden_core::protocol::ProtocolError> {
        Ok(Answer::Attached(match label {
            "claimed" => Attached::Claimed,
            _ => Attached::Proven,
        }))
    }

    fn hello_accepted() -> Result<Answer, kvwarden_core::protocol::ProtocolError> {
        Ok(Answer::Hello(HelloReply {
            protocol: 2,
            server: "sim".into(),
            boot_id: 1,
            reap_timeout_seconds: 30.0,
            registration_grace_seconds: 5.0,
            exit_proof: "timeout_only".into(),
            sends_fds: false,
            tenant: Some("t".into()),
        }))
    }

    #[test]
    fn a_wrong_secret_attach_the_node_accepts_is_non_owner_served() {
        let mut checker = checker();
        let id = InstanceId::new(9).unwrap();
        checker.connected(1, Some(1000));
        checker.connected(2, Some(1000));
        let owner = Op::Attach {
            instance: id,
            secret: vec![1; 32],
        };
        let verdict = checker.verdict(1, &owner);
        checker.judge_trust(1, "attach", Some(id), &verdict, Some(&outcome("claimed")));
        assert!(checker.violation.is_none(), "{:?}", checker.violation);
        // The owner's own connection may now name it; the impostor's may not.
        let ping = Op::Ping { instance: Some(id) };
        assert_eq!(checker.verdict(1, &ping), Verdict::Allowed);
        assert!(matches!(checker.verdict(2, &ping), Verdict::Refused(_)));
        let thief = Op::Attach {
            instance: id,
            secret: vec![2; 32],
        };
        let verdict = checker.verdict(2, &thief);
        assert!(matches!(
            verdict,
            Verdict::Attach {
                expect: AttachExpect::Forbidden,
                ..
            }
        ));
        checker.judge_trust(2, "attach", Some(id), &verdict, Some(&outcome("proven")));
        let violation = checker.violation.expect("a stolen capability is caught");
        assert_eq!(
            (violation.class, violation.invariant),
            (Class::Safety, "non_owner_served")
        );
    }

    #[test]
    fn an_id_is_free_again_once_no_connection_and_no_entry_hold_it() {
        let mut checker = checker();
        let id = InstanceId::new(3).unwrap();
        checker.connected(1, Some(1000));
        let attach = |secret: u8| Op::Attach {
            instance: id,
            secret: vec![secret; 32],
        };
        let verdict = checker.verdict(1, &attach(1));
        checker.judge_trust(1, "attach", Some(id), &verdict, Some(&outcome("claimed")));
        checker.disconnected(1);
        // Another uid claims the unbound id (a squat): the rules allow it.
        checker.connected(2, Some(1001));
        assert!(matches!(
            checker.verdict(2, &attach(7)),
            Verdict::Attach {
                expect: AttachExpect::Claimed,
                ..
            }
        ));
    }

    #[test]
    fn a_tcp_peer_is_nobody_until_its_hello_proves_the_token() {
        use kvwarden_core::protocol::Challenge;
        use kvwarden_core::protocol::tcp_auth::TcpKey;
        let key = TcpKey::from_token(b"0123456789abcdef-token");
        let (client, server) = ([1u8; 32], [2u8; 32]);
        let ping = Op::Ping {
            instance: Some(InstanceId::new(4).unwrap()),
        };
        let hello = |token: Option<&[u8]>, proof: Vec<u8>| Op::Hello {
            protocol: 3,
            client: "t".into(),
            pidfd_index: None,
            sends_fds: false,
            token: token.map(<[u8]>::to_vec),
            proof: Some(proof),
            wait_ms: None,
        };
        // `auth` with the token's key id, answered with the server's proof.
        let challenged = |checker: &mut Checker| {
            checker.connected(5, None);
            assert!(matches!(
                checker.verdict(5, &Op::Status),
                Verdict::Refused(_)
            ));
            let auth = Op::Auth {
                id: key.id(),
                nonce: client,
            };
            let verdict = checker.verdict(5, &auth);
            assert!(matches!(verdict, Verdict::Auth { answered: true, .. }));
            let answer = Ok(Answer::Challenge(Challenge {
                nonce: server,
                proof: key.server_proof(&client, &server),
            }));
            checker.judge_trust(5, "auth", None, &verdict, Some(&answer));
            assert!(checker.violation.is_none());
        };
        let mut checker = checker();
        challenged(&mut checker);
        let wrong = checker.verdict(5, &hello(None, vec![0; 32]));
        assert_eq!(
            wrong,
            Verdict::Hello {
                authenticates: false
            }
        );
        // A node that accepts it lets a stranger in.
        checker.judge_trust(5, "hello", None, &wrong, Some(&hello_accepted()));
        assert_eq!(
            checker.violation.as_ref().map(|v| v.invariant),
            Some("non_owner_served")
        );
        // The right proof with protocol 2's token beside it: refused too.
        let mut checker = self::checker();
        challenged(&mut checker);
        let proof = key.client_proof(&client, &server).to_vec();
        let old = checker.verdict(5, &hello(Some(b"0123456789abcdef-token"), proof.clone()));
        assert_eq!(
            old,
            Verdict::Hello {
                authenticates: false
            }
        );
        // The control: the right proof alone.
        let mut checker = self::checker();
        challenged(&mut checker);
        let right = checker.verdict(5, &hello(None, proof));
        assert_eq!(
            right,
            Verdict::Hello {
                authenticates: true
            }
        );
        checker.judge_trust(5, "hello", None, &right, Some(&hello_accepted()));
        assert_eq!(checker.verdict(5, &Op::Status), Verdict::Allowed);
        assert!(matches!(checker.verdict(5, &ping), Verdict::Refused(_)));
        assert!(checker.violation.is_none());
    }

    #[test]
    fn a_read_answered_with_another_tenants_chunk_is_non_owner_served() {
        let mut checker = checker();
        checker.connected(1, Some(1000));
        checker.connected(2, Some(1001));
        let mut scoped = prefix_of("uid-1000");
        scoped.extend_from_slice(b"chunk");
        checker.published(scoped);
        let read = TenantRead {
            prefix: prefix_of("uid-1001"),
            keys: vec![b"chunk".to_vec()],
            lookup: false,
        };
        // A miss is right, and counted as a poacher kept out.
        assert_eq!(
            checker.read_answered("retrieve", &read, &Ok(Answer::Length(None))),
            1
        );
        assert!(checker.violation.is_none());
        checker.read_answered("retrieve", &read, &Ok(Answer::Length(Some(4096))));
        let violation = checker
            .violation
            .expect("another tenant's bytes are caught");
        assert_eq!(
            (violation.class, violation.invariant),
            (Class::Safety, "non_owner_served")
        );
    }
}

#[test]
fn a_restarted_node_adopting_a_slot_a_store_took_is_caught() {
    // Row 71: the store took the unscanned slot and wrote its own value; the scan had
    // read the old seal intact before. Adopting it would serve the store's bytes under
    // the old key.
    let (class, invariant, detail) =
        violation_with_bug("71-store-during-the-scan.toml", "adopt_taken");
    assert_eq!(
        (class, invariant),
        (Class::Safety, "adopted_other_bytes"),
        "{detail}"
    );
    assert!(detail.contains("the value of key"), "{detail}");
}
