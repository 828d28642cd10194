//! A bounded swarm, determinism, and the regression seeds (the full swarm runs from the
//! CLI in CI: see docs/simulator.md).

use kvwarden_sim::cli::{SwarmOptions, run_seed, run_swarm};
use kvwarden_sim::config::Action;
use kvwarden_sim::swarm;
use kvwarden_sim::world::run_config;

#[test]
fn bounded_swarm_heals_and_converges_with_no_violation() {
    for seed in 0..1000 {
        let outcome = run_seed(seed, seed % 10 == 0, false);
        assert!(
            outcome.violation.is_none(),
            "SEED={seed}: {}\n{}",
            outcome.violation.unwrap(),
            swarm::describe(&swarm::draw(seed))
        );
    }
}

#[test]
fn same_seed_gives_the_same_trace_hash_and_other_seeds_differ() {
    let a = run_config(swarm::draw(42), Vec::new(), false);
    let b = run_config(swarm::draw(42), Vec::new(), false);
    let c = run_config(swarm::draw(43), Vec::new(), false);
    assert_eq!(a.trace_hash, b.trace_hash);
    assert_eq!(a.events, b.events);
    assert_ne!(a.trace_hash, c.trace_hash);
}

#[test]
fn every_profile_ends_with_a_heal_and_a_convergence_check() {
    for seed in 0..50 {
        let cfg = swarm::draw(seed);
        assert!(cfg.converge_at_end);
        let heal = cfg
            .events
            .iter()
            .find(|e| e.action == Action::HealAll)
            .expect("heal");
        let g_plus_r = cfg.server.registration_grace + cfg.server.resolution;
        assert!(
            cfg.duration > heal.at + g_plus_r,
            "seed {seed}: too short to converge"
        );
        assert!(cfg.events.iter().all(|e| e.at <= cfg.duration));
    }
}

#[test]
fn regression_seeds_replay_clean() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/regressions.txt"))
        .expect("regressions.txt is checked in");
    let seeds = swarm::parse_seed_list(&text).expect("a valid seed list");
    assert!(!seeds.is_empty());
    let options = SwarmOptions {
        check_determinism: true,
        determinism_every: 1,
        jobs: 2,
        verbose: false,
        stats: false,
        bug: None,
    };
    assert_eq!(run_swarm(&seeds, &options), 0);
}

#[test]
fn seed_ranges_and_lists_parse_and_reject_nonsense() {
    assert_eq!(swarm::parse_range("0..10"), Ok(0..10));
    assert_eq!(swarm::parse_range("7"), Ok(7..8));
    assert!(swarm::parse_range("10..3").is_err());
    assert!(swarm::parse_range("x..3").is_err());
    assert_eq!(swarm::parse_seed_list("1\n# c\n 2 # why\n"), Ok(vec![1, 2]));
    assert!(
        swarm::parse_seed_list("1\nnope\n")
            .unwrap_err()
            .contains("line 2")
    );
}

#[test]
fn the_swarm_catches_injected_bugs_with_the_right_class() {
    use kvwarden_sim::cli::run_seed_with;
    use kvwarden_sim::config::InjectedBug;
    use kvwarden_sim::violation::Class;
    let cases = [
        (InjectedBug::DoubleFree, Class::Safety, "double_free"),
        (
            InjectedBug::KeepPins,
            Class::Safety,
            "pin_of_freed_instance",
        ),
        (
            InjectedBug::KeepBlendState,
            Class::Safety,
            "blend_without_entry",
        ),
        (InjectedBug::IgnorePings, Class::Safety, "reaped_early"),
        (
            InjectedBug::FreeDuringCopy,
            Class::Safety,
            "free_during_copy",
        ),
        (InjectedBug::LeakOnFree, Class::Liveness, "context_leaked"),
        (
            InjectedBug::IgnoreProcessExit,
            Class::Liveness,
            "exit_ignored",
        ),
        (
            InjectedBug::RegisterAfterUnregister,
            Class::Safety,
            "ghost_context",
        ),
        (InjectedBug::LateWake, Class::Liveness, "reap_late"),
        (
            InjectedBug::WriteUnpublished,
            Class::Safety,
            "l2_unpublished",
        ),
        (
            InjectedBug::TrustAnyConnection,
            Class::Safety,
            "non_owner_served",
        ),
        (
            InjectedBug::SharedKeyspace,
            Class::Safety,
            "non_owner_served",
        ),
    ];
    for (bug, class, invariant) in cases {
        let caught = (0..200)
            .filter_map(|seed| run_seed_with(seed, false, false, Some(bug)).violation)
            .find(|v| v.class == class && v.invariant == invariant);
        assert!(
            caught.is_some(),
            "{bug:?} was never caught as {invariant} in 200 seeds"
        );
    }
}
